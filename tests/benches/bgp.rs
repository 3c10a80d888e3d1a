//! Announcing by BGP (issue 42), for `cargo xtask bench` (its `bgp` part),
//! on the BGP tests' topology (`lb_tests::bgp_router`: three nodes on one
//! bridge with a client and a router, BIRD with ECMP and BFD).
//!
//! - Connects per second from the client through the VIP, [`CLIENTS`]
//!   threads for [`MEASURE`] each: first with one node announcing by ARP
//!   (the client on the VIP's link, no router), then with one, two and
//!   three nodes announcing by BGP (the router spreading), in the same
//!   run; and how the connects spread over the nodes.
//! - [`ROUNDS`] times: a node dies (its LAN link taken down: it sends
//!   nothing more, and its sessions' TCP never closes), and the time until
//!   the router's table no longer has it (BFD, 100 ms × 3), polled every
//!   [`POLL`]; then its link comes back and the router learns it again.
//!
//! On one machine every node shares its CPUs: spreading shows in the
//! shares, not in a higher rate. Prints one JSON line. Needs root,
//! `LB_BIN` and BIRD (`bird2`).

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use lb_tests::{
    bgp_router::{NODE_ASN, ROUTER, ROUTER_ASN, Router},
    fakes::{
        apiserver::{FakeApiServer, Kubeconfig},
        runtime,
    },
    in_new_netns,
    lan::{API, Lan, Servers, VIP, VIP_IP, services},
    privileged,
    topology::who,
    wait_until,
};

/// Client threads, each connecting one after another.
const CLIENTS: usize = 4;
/// How long connects are counted at each step.
const MEASURE: Duration = Duration::from_secs(5);
/// Node deaths measured.
const ROUNDS: usize = 12;
/// How often the router's table is read while a node dies.
const POLL: Duration = Duration::from_millis(10);

fn main() {
    if !privileged() {
        return;
    }
    let report = in_new_netns(run);
    println!("{report}");
}

/// Every node's config announced by BGP: the VIP, its node's server.
fn by_bgp() -> String {
    format!(
        "[bgp]\nasn = {NODE_ASN}\n[[bgp.peer]]\naddress = \"{ROUTER}\"\nasn = {ROUTER_ASN}\n\
         [[service]]\nname = \"web\"\nvip = \"{VIP}\"\nservers = [\"198.18.2.2:8080\"]\n\
         [service.health]\ncheck = \"tcp\"\ninterval = \"100ms\"\ntimeout = \"100ms\"\nrise = 1\nfall = 1\n\
         [service.external]\ninterfaces = [\"ext0\"]\nannounce = \"bgp\"\n"
    )
}

fn node(k: usize) -> IpAddr {
    IpAddr::from([198, 18, 0, u8::try_from(k).unwrap()])
}

/// Connects per second over [`MEASURE`] from [`CLIENTS`] threads, and
/// how many each node's server answered (failed connects under "failed").
fn measure(lan: &Lan) -> (f64, BTreeMap<String, u64>) {
    let answers: Vec<BTreeMap<String, u64>> = lan.client.run(|| {
        let vip: SocketAddr = VIP.parse().unwrap();
        let threads: Vec<_> = (0..CLIENTS)
            .map(|_| {
                std::thread::spawn(move || {
                    let mut seen = BTreeMap::new();
                    let start = Instant::now();
                    while start.elapsed() < MEASURE {
                        let name = TcpStream::connect_timeout(&vip, Duration::from_millis(500))
                            .map_err(|e| e.to_string())
                            .and_then(|s| who(&s))
                            .unwrap_or_else(|_| "failed".to_owned());
                        *seen.entry(name).or_insert(0) += 1;
                    }
                    seen
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let mut total = BTreeMap::new();
    for seen in answers {
        for (name, n) in seen {
            *total.entry(name).or_insert(0) += n;
        }
    }
    let answered: u64 = total.iter().filter(|(n, _)| *n != "failed").map(|(_, n)| n).sum();
    (answered as f64 / MEASURE.as_secs_f64(), total)
}

fn run() -> String {
    let mut lan = Lan::new("bench-bgp", 3);
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start_at(format!("{API}:0").parse().unwrap()));
    let kubeconfig = Kubeconfig::write(&api.url());
    let router = Router::start(&lan, "bench-bgp");
    let mut steps = serde_json::Map::new();

    // One node by ARP: the client on the VIP's link.
    lan.client.sh(&["ip", "route", "replace", "198.18.1.0/24", "dev", "c0"]);
    lan.nodes[0].start(kubeconfig.path(), &services(Servers::Static));
    assert!(wait_until(Duration::from_secs(30), || lan.ask().is_ok()), "ARP: no answer");
    let (rate, shares) = measure(&lan);
    steps.insert("arp_1".into(), serde_json::json!({ "connects_per_s": rate, "answered": shares }));

    // One, two, three nodes by BGP: the client through the router.
    lan.client.sh(&["ip", "route", "replace", "198.18.1.0/24", "via", ROUTER]);
    lan.nodes[0].roll(&by_bgp());
    for k in 1..=3 {
        if k > 1 {
            lan.nodes[k - 1].start(kubeconfig.path(), &by_bgp());
        }
        let all: Vec<IpAddr> = (1..=k).map(node).collect();
        let learned = wait_until(Duration::from_secs(30), || router.next_hops(VIP_IP) == all);
        assert!(learned, "{k} nodes: the router has {:?}", router.next_hops(VIP_IP));
        let (rate, shares) = measure(&lan);
        steps.insert(
            format!("bgp_{k}"),
            serde_json::json!({ "connects_per_s": rate, "answered": shares }),
        );
    }

    // A node dies; the router withdraws it (BFD).
    let mut withdrawn_ms = Vec::new();
    let mut failed = 0;
    for round in 0..ROUNDS {
        let k = round % 3;
        let died = Instant::now();
        lan.nodes[k].ns.sh(&["ip", "link", "set", "ext0", "down"]);
        let mut gone = None;
        while died.elapsed() < Duration::from_secs(10) {
            if !router.next_hops(VIP_IP).contains(&node(k + 1)) {
                gone = Some(died.elapsed());
                break;
            }
            std::thread::sleep(POLL);
        }
        match gone {
            Some(took) => withdrawn_ms.push(took.as_secs_f64() * 1e3),
            None => failed += 1,
        }
        lan.nodes[k].ns.sh(&["ip", "link", "set", "ext0", "up"]);
        let all: Vec<IpAddr> = (1..=3).map(node).collect();
        let back = wait_until(Duration::from_secs(60), || router.next_hops(VIP_IP) == all);
        assert!(back, "node{} was not learned again: {:?}", k + 1, router.next_hops(VIP_IP));
    }
    let report = serde_json::json!({
        "nodes": 3,
        "clients": CLIENTS,
        "measure_s": MEASURE.as_secs_f64(),
        "steps": steps,
        "rounds": ROUNDS,
        "failed_rounds": failed,
        "bfd_interval_ms": 100,
        "bfd_multiplier": 3,
        "withdrawn_ms": withdrawn_ms,
    });
    for n in &lan.nodes {
        lb_user::bgp::stop_speaker(&n.daemon().dir.join("state"));
    }
    drop(router);
    drop(lan);
    drop(api);
    drop(rt);
    report.to_string()
}
