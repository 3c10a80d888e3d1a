//! LoadBalancer Services (issue 41) on the election tests' topology:
//! three nodes on one bridge with a client, the fake API server on it,
//! every node running the same config (a pool of 128 addresses,
//! `default_class`), none naming a service.
//!
//! - From a Service's creation to its status showing an address, and to
//!   the first connect from the client through that address answered (the
//!   client has the pool's subnet on its link: a node must announce it),
//!   p50/p99, for [`SERVICES`] Services created one after another;
//! - then, with all of them served, the API requests per second in a
//!   steady state of [`STEADY`], by kind, all three nodes together, and
//!   the watches open and watch events sent.
//!
//! Prints one JSON line. Needs root and `LB_BIN`. Run with `cargo bench
//! --package lb-tests --bench load_balancers`.

use std::{
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use lb_tests::{
    fakes::{
        apiserver::{
            Condition, FakeApiServer, Kubeconfig, endpoint, endpoint_slice, ingress_ip,
            load_balancer_service,
        },
        runtime,
    },
    in_new_netns,
    lan::{API, Lan, who},
    privileged, wait_every,
};

/// The Services created, one after another.
const SERVICES: usize = 100;
/// How long the steady state's requests are counted.
const STEADY: Duration = Duration::from_secs(10);

const CONFIG: &str = "[kubernetes]\ndefault_class = true\ninterfaces = [\"ext0\"]\n\
     [[pool]]\nname = \"default\"\naddresses = [\"198.18.1.100-198.18.1.227\"]\n";

fn main() {
    if !privileged() {
        return;
    }
    println!("{}", in_new_netns(bench));
}

fn bench() -> serde_json::Value {
    let mut lan = Lan::new("lbsvc-bench", 3);
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start_at(format!("{API}:0").parse().unwrap()));
    let kubeconfig = Kubeconfig::write(&api.url());
    for node in &mut lan.nodes {
        node.start(kubeconfig.path(), CONFIG);
    }
    let (mut to_status, mut to_claim, mut to_connect) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..SERVICES {
        let name = format!("svc{k}");
        let pod = endpoint("198.18.2.2", "node1", Condition::Ready);
        let slice =
            endpoint_slice(&format!("{name}-1"), &name, "IPv4", &[("http", 8080)], vec![pod]);
        api.apply(slice);
        let created = Instant::now();
        api.apply_service(load_balancer_service(&name, &[("http", 80, 8080)]));
        let mut address = None;
        let given = wait_every(Duration::from_millis(2), Duration::from_secs(30), || {
            address = api.service("default", &name).and_then(|s| ingress_ip(&s));
            address.is_some()
        });
        assert!(given, "{name} was given no address within 30 s");
        to_status.push(created.elapsed());
        let address = address.unwrap();
        let claimed = wait_every(Duration::from_millis(2), Duration::from_secs(30), || {
            lan.nodes.iter().any(|node| {
                let lease = api.lease("lb-system", &node.node_name);
                let claims =
                    lease.and_then(|l| l.metadata.annotations?.get("lb.dev/claims").cloned());
                claims.is_some_and(|c| c.split(',').any(|vip| vip == address))
            })
        });
        assert!(claimed, "{address} ({name}) never claimed within 30 s");
        to_claim.push(created.elapsed());
        let to: SocketAddr = format!("{address}:80").parse().unwrap();
        let answered = wait_every(Duration::from_millis(5), Duration::from_secs(30), || {
            lan.client
                .run(move || {
                    let stream =
                        TcpStream::connect_timeout(&to, Duration::from_millis(200)).ok()?;
                    who(&stream).ok()
                })
                .is_some()
        });
        assert!(answered, "{to} ({name}) never answered within 30 s");
        to_connect.push(created.elapsed());
    }
    // Settle, then count.
    std::thread::sleep(Duration::from_secs(3));
    let (requests, leases, writes, events) = (
        api.requests().len(),
        api.lease_requests().len(),
        api.service_writes().len(),
        api.watch_events(),
    );
    std::thread::sleep(STEADY);
    let seconds = STEADY.as_secs_f64();
    let per_s = |n: usize| n as f64 / seconds;
    let ms = |list: &mut Vec<Duration>| {
        list.sort();
        let at = |q: f64| {
            let i = ((list.len() as f64 - 1.0) * q).round() as usize;
            list[i].as_secs_f64() * 1000.0
        };
        serde_json::json!({ "p50": at(0.5), "p99": at(0.99), "max": at(1.0) })
    };
    serde_json::json!({
        "nodes": 3,
        "services": SERVICES,
        "creation_to_status_ms": ms(&mut to_status),
        "creation_to_claimed_ms": ms(&mut to_claim),
        "creation_to_first_connect_ms": ms(&mut to_connect),
        "steady_s": seconds,
        "steady_per_s": {
            "lists_and_watches": per_s(api.requests().len() - requests),
            "lease_requests": per_s(api.lease_requests().len() - leases),
            "status_writes": per_s(api.service_writes().len() - writes),
            "watch_events": per_s(api.watch_events() - events),
        },
        "watches_open": api.watching(),
        "events_total": api.events().len(),
    })
}
