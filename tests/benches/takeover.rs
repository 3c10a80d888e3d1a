//! The elections' takeover time and API load, for `cargo xtask bench` (its
//! `election` part), on the election tests' topology
//! (`tests/tests/election/lan.rs`: three nodes on one bridge with a client,
//! the fake API server serving the Lease), default timings (lease 1 s,
//! renew and retry 200 ms).
//!
//! - API requests per second for the VIP in steady state: every Lease
//!   request the fake answered over [`STEADY`], all nodes together.
//! - [`ROUNDS`] times: the holder dies (its daemon SIGKILLed and its LAN
//!   link taken down at once: a node that is gone, whose XDP program no
//!   longer forwards), and the client connects through the VIP every
//!   [`PROBE`] (each connect given up after [`PROBE`]) until a connect is
//!   answered by another node; the takeover time is from the death to
//!   that answer. Beside it, from the death to the new holder's first ARP
//!   answer on the wire. Then the dead node comes back (a candidate) and
//!   the next round kills the new holder.
//!
//! Prints one JSON line. Needs root and `LB_BIN`.

use std::time::{Duration, Instant};

use lb_tests::{
    arp::Watch,
    fakes::{
        apiserver::{FakeApiServer, Kubeconfig},
        runtime,
    },
    in_new_netns,
    lan::{API, Lan, Servers, services},
    privileged, wait_until,
};

/// Holder deaths measured.
const ROUNDS: usize = 15;
/// How long the steady state's API requests are counted.
const STEADY: Duration = Duration::from_secs(5);
/// How often the client tries, and how long each connect may take.
const PROBE: Duration = Duration::from_millis(50);
/// A round whose takeover takes longer than this counts as failed.
const GIVE_UP: Duration = Duration::from_secs(10);

fn main() {
    if !privileged() {
        return;
    }
    let report = in_new_netns(run);
    println!("{report}");
}

fn run() -> String {
    let mut lan = Lan::new("takeover", 3);
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start_at(format!("{API}:0").parse().unwrap()));
    let kubeconfig = Kubeconfig::write(&api.url());
    for node in &mut lan.nodes {
        node.start(kubeconfig.path(), &services(Servers::Static));
    }
    let mut holder = lan.wait_holder(&api, None);
    // Every node settled: the holder renewing, the others reading.
    std::thread::sleep(Duration::from_secs(2));
    let before = api.lease_requests().len();
    std::thread::sleep(STEADY);
    let requests_per_s = (api.lease_requests().len() - before) as f64 / STEADY.as_secs_f64();

    let watch = Watch::start(&lan.client, "pc", Duration::from_millis(10));
    let (mut connect_ms, mut arp_ms, mut failed) = (Vec::new(), Vec::new(), 0);
    for _ in 0..ROUNDS {
        let dead = lan.nodes[holder].name.clone();
        let dead_mac = lan.nodes[holder].mac.clone();
        assert_eq!(lan.ask().as_deref(), Ok(dead.as_str()), "the holder serves before it dies");
        let died = Instant::now();
        let died_at = watch.started.elapsed();
        lan.nodes[holder].daemon_mut().kill();
        lan.nodes[holder].ns.sh(&["ip", "link", "set", "ext0", "down"]);
        let answered = loop {
            let tried = Instant::now();
            match lan.ask_within(PROBE) {
                Ok(name) if name != dead => break Some(died.elapsed()),
                _ if died.elapsed() > GIVE_UP => break None,
                _ => std::thread::sleep(PROBE.saturating_sub(tried.elapsed())),
            }
        };
        match answered {
            Some(took) => connect_ms.push(took.as_secs_f64() * 1e3),
            None => failed += 1,
        }
        let first_arp = watch.seen().into_iter().find(|s| s.at > died_at && s.mac != dead_mac);
        if let Some(seen) = first_arp {
            arp_ms.push((seen.at - died_at).as_secs_f64() * 1e3);
        }
        let next = lan.wait_holder(&api, Some(holder));
        // The dead node comes back, a candidate.
        lan.nodes[holder].ns.sh(&["ip", "link", "set", "ext0", "up"]);
        lan.nodes[holder].start(kubeconfig.path(), "");
        let back = &lan.nodes[holder];
        assert!(
            wait_until(Duration::from_secs(10), || back.role().as_deref() == Some("candidate")),
            "{}",
            back.daemon().log()
        );
        holder = next;
    }
    drop(watch);
    let report = serde_json::json!({
        "nodes": lan.nodes.len(),
        "lease_duration_ms": 1000,
        "renew_ms": 200,
        "retry_ms": 200,
        "rounds": ROUNDS,
        "failed_rounds": failed,
        "takeover_connect_ms": connect_ms,
        "takeover_arp_ms": arp_ms,
        "api_requests_per_s": requests_per_s,
    });
    drop(lan);
    drop(api);
    drop(rt);
    report.to_string()
}
