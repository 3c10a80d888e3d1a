//! The elections by membership beside the per-VIP Leases, for `cargo
//! xtask bench` (its `election` part), on the election tests' topology
//! (three nodes on one bridge with a client, the fake API server on it),
//! default timings (per VIP: lease 1 s, renew and retry 200 ms; by
//! membership: 1.2 s, renewed every 700 ms):
//!
//! - API requests per second in steady state, by verb, all three nodes
//!   together, and the watch events the server sent, at 1, 50 and 200
//!   VIPs, each way (`lease = {..}` per VIP, `elect = true`), in this run;
//! - with 200 VIPs by membership, [`ROUNDS`] times: every VIP where
//!   placement puts it, the node placement gives the most VIPs SIGKILLed,
//!   the time until every one of its VIPs is claimed by exactly one other
//!   node (from the Leases, looked at every 50 ms: a claim is answered a
//!   watch event later), then the node started again; then [`DETACHES`]
//!   times the same with `lb detach` instead of the SIGKILL.
//!
//! Prints one JSON line. Needs root and `LB_BIN`. With `LB_BENCH_LOGS`
//! (a directory), the daemons' logs are written there after the steady
//! state and after the takeovers.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use k8s_openapi::api::coordination::v1::Lease;
use lb_tests::{
    fakes::{
        apiserver::{FakeApiServer, Kubeconfig},
        runtime,
    },
    in_new_netns,
    lan::{API, Lan},
    privileged, wait_every,
};
use lb_user::election::placement;

/// Node deaths measured.
const ROUNDS: usize = 10;
/// Nodes detached (`lb detach`) measured.
const DETACHES: usize = 5;
/// How long the steady state's requests are counted.
const STEADY: Duration = Duration::from_secs(5);
/// The VIP counts measured.
const COUNTS: [usize; 3] = [1, 50, 200];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    PerVip,
    Membership,
}

fn main() {
    if !privileged() {
        return;
    }
    let mut load = serde_json::Map::new();
    let only_takeover = std::env::var_os("LB_BENCH_TAKEOVER_ONLY").is_some();
    for way in [Way::PerVip, Way::Membership].into_iter().filter(|_| !only_takeover) {
        for n in COUNTS {
            let figures = in_new_netns(move || steady(way, n, false));
            let key = match way {
                Way::PerVip => format!("per_vip_{n}"),
                Way::Membership => format!("membership_{n}"),
            };
            load.insert(key, figures);
        }
    }
    let takeover = in_new_netns(|| steady(Way::Membership, 200, true));
    let report = serde_json::json!({
        "nodes": 3,
        "lease_duration_ms": 1000,
        "renew_ms": 200,
        "membership_duration_ms": 1200,
        "membership_renew_ms": 700,
        "steady_s": STEADY.as_secs(),
        "load": load,
        "takeover": takeover,
    });
    println!("{report}");
}

/// `n` services on VIPs of their own, elected `way`; health checks once
/// a second (the nodes run 3 × `n` of them on two CPUs).
fn services(way: Way, n: usize) -> String {
    let mut text = String::new();
    if way == Way::Membership {
        text.push_str("[kubernetes]\nnamespace = \"lb-system\"\n");
    }
    for k in 0..n {
        let elect = match way {
            Way::PerVip => format!("lease = {{ namespace = \"lb-system\", name = \"web{k}\" }}\n"),
            Way::Membership => "elect = true\n".to_owned(),
        };
        text.push_str(&format!(
            "[[service]]\nname = \"web{k}\"\nvip = \"198.18.1.{}:80\"\nservers = [\"198.18.2.2:8080\"]\n\
             [service.health]\ncheck = \"tcp\"\ninterval = \"1s\"\ntimeout = \"500ms\"\nrise = 1\nfall = 1\n\
             [service.external]\ninterfaces = [\"ext0\"]\nannounce = \"arp\"\n{elect}",
            1 + k
        ));
    }
    text
}

/// Which node holds each of the `n` services, of those in `nodes`;
/// `None` where none does or two do. By membership, from the Leases'
/// claims (a claim is answered once its write comes back to its node, a
/// watch event later), so that watching costs the nodes nothing; per VIP,
/// from each VIP's Lease.
fn holders(
    lan: &Lan,
    api: &FakeApiServer,
    way: Way,
    nodes: &[usize],
    n: usize,
) -> Vec<Option<usize>> {
    let annotation = |lease: &Lease, key: &str| {
        let annotations = lease.metadata.annotations.as_ref();
        annotations.and_then(|a| a.get(key)).cloned().unwrap_or_default()
    };
    let mut held: Vec<Vec<usize>> = vec![Vec::new(); n];
    match way {
        Way::Membership => {
            for &i in nodes {
                let Some(lease) = api.lease("lb-system", &lan.nodes[i].node_name) else { continue };
                for vip in annotation(&lease, "lb.dev/claims").split(',').filter(|v| !v.is_empty())
                {
                    let k = vip.rsplit('.').next().and_then(|o| o.parse::<usize>().ok());
                    if let Some(k) = k.filter(|k| (1..=n).contains(k)) {
                        held[k - 1].push(i);
                    }
                }
            }
        }
        Way::PerVip => {
            for (k, held) in held.iter_mut().enumerate() {
                let lease = api.lease("lb-system", &format!("web{k}"));
                let holder = lease.and_then(|l| l.spec?.holder_identity).unwrap_or_default();
                let node = nodes
                    .iter()
                    .find(|&&i| holder.starts_with(&format!("{}_", lan.nodes[i].node_name)));
                held.extend(node);
            }
        }
    }
    held.into_iter().map(|h| if h.len() == 1 { Some(h[0]) } else { None }).collect()
}

/// Waits, looking every 50 ms (reading three Leases), at most `timeout`.
fn wait(timeout: Duration, check: impl FnMut() -> bool) -> bool {
    wait_every(Duration::from_millis(50), timeout, check)
}

/// Three nodes with `n` VIPs elected `way`: the steady state's API load,
/// and with `kill`, the takeovers after SIGKILLs.
fn steady(way: Way, n: usize, kill: bool) -> serde_json::Value {
    let mut lan = Lan::new("membership-bench", 3);
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start_at(format!("{API}:0").parse().unwrap()));
    let kubeconfig = Kubeconfig::write(&api.url());
    let text = services(way, n);
    for node in &mut lan.nodes {
        node.start(kubeconfig.path(), &text);
    }
    let all = [0, 1, 2];
    let placed = wait(Duration::from_secs(120), || {
        holders(&lan, &api, way, &all, n).iter().all(Option::is_some)
    });
    assert!(placed, "{n} VIPs not all held within 120 s");
    // Settled: the hold-downs over (nodes started one after another hand
    // shares on as they settle), no claim moving and, by membership, no
    // node's eligibility changing (its checks coming up) for 3 s.
    let published = |lan: &Lan| {
        let lease = |i: usize| api.lease("lb-system", &lan.nodes[i].node_name);
        let eligible = |i: usize| {
            let lease = lease(i)?;
            lease.metadata.annotations?.get("lb.dev/eligible").cloned()
        };
        (holders(lan, &api, way, &all, n), all.map(eligible))
    };
    let mut last = published(&lan);
    let mut since = Instant::now();
    let settled = wait(Duration::from_secs(60), || {
        let now = published(&lan);
        if now != last {
            (last, since) = (now, Instant::now());
        }
        since.elapsed() >= Duration::from_secs(3)
    });
    assert!(settled, "{n} VIPs: the claims still moving after 60 s");
    let (requests, lists, events) =
        (api.lease_requests().len(), api.requests().len(), api.watch_events());
    std::thread::sleep(STEADY);
    let seconds = STEADY.as_secs_f64();
    let mut by_verb: BTreeMap<String, f64> = BTreeMap::new();
    for request in &api.lease_requests()[requests..] {
        // Refused ones apart: a conflict is a write lost.
        let verb = match request.status {
            200..=299 => request.method.clone(),
            status => format!("{} {status}", request.method),
        };
        *by_verb.entry(verb).or_default() += 1.0 / seconds;
    }
    for request in &api.requests()[lists..] {
        let verb = if request.watch { "WATCH" } else { "LIST" };
        *by_verb.entry(verb.to_owned()).or_default() += 1.0 / seconds;
    }
    let events = (api.watch_events() - events) as f64 / seconds;
    keep_logs(&lan, &format!("-{}-{n}", way as u8));
    let requests: f64 = by_verb.values().sum();
    let mut figures = serde_json::json!({
        "vips": n,
        "requests_per_s": requests,
        "requests_per_s_per_node": requests / 3.0,
        "watch_events_per_s": events,
        "by_verb": by_verb,
    });
    if kill {
        let (killed, detached) = takeovers(&mut lan, &api, &kubeconfig, &text, n);
        figures["takeover_ms"] = killed.into();
        figures["rounds"] = ROUNDS.into();
        figures["graceful_ms"] = detached.into();
        figures["graceful_rounds"] = DETACHES.into();
    }
    drop(lan);
    drop(api);
    drop(rt);
    figures
}

/// [`ROUNDS`] SIGKILLs of the node placement gives the most VIPs, then
/// [`DETACHES`] times `lb detach` of it: for each, the milliseconds until
/// every one of its VIPs is held by another node. Each round begins with
/// every VIP where placement puts it; the node is started again and takes
/// its share back after its hold-down.
fn takeovers(
    lan: &mut Lan,
    api: &FakeApiServer,
    kubeconfig: &Kubeconfig,
    text: &str,
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let all = [0, 1, 2];
    let placed: Vec<Option<usize>> = (0..n)
        .map(|k| {
            let names = all.iter().map(|i| lan.nodes[*i].node_name.as_str());
            let first = placement::first(&format!("198.18.1.{}", k + 1), names);
            all.into_iter().find(|i| Some(lan.nodes[*i].node_name.as_str()) == first)
        })
        .collect();
    let as_placed = |lan: &Lan| holders(lan, api, Way::Membership, &all, n) == placed;
    let count = |i: usize| placed.iter().filter(|h| **h == Some(i)).count();
    let victim = (0..3).max_by_key(|&i| count(i)).unwrap();
    let rest: Vec<usize> = all.into_iter().filter(|&i| i != victim).collect();
    let (mut took, mut handed) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS + DETACHES {
        if !wait(Duration::from_secs(30), || as_placed(lan)) {
            eprintln!("{}", off_placement(lan, api, &placed, n));
        }
        // Steady: the restarted node's checks and writes settled too.
        std::thread::sleep(Duration::from_secs(3));
        let died = Instant::now();
        if round < ROUNDS {
            lan.nodes[victim].daemon_mut().kill();
        } else {
            // Withdrawn and resigned: the others take over at once.
            lan.nodes[victim].daemon().lb(&["detach"]);
        }
        let moved = wait(Duration::from_secs(20), || {
            let now = holders(lan, api, Way::Membership, &rest, n);
            placed.iter().zip(&now).all(|(p, h)| *p != Some(victim) || h.is_some())
        });
        let ms = died.elapsed().as_secs_f64() * 1e3;
        let how = if round < ROUNDS { "SIGKILL" } else { "lb detach" };
        eprintln!("round {round} ({how}): every VIP claimed elsewhere after {ms:.0} ms");
        match (moved, round < ROUNDS) {
            (true, true) => took.push(ms),
            (true, false) => handed.push(ms),
            (false, _) => {}
        }
        if round >= ROUNDS {
            assert!(lan.nodes[victim].daemon_mut().wait_exit(Duration::from_secs(10)), "detach");
        }
        // Back, and its share back after the hold-down.
        lan.nodes[victim].start(kubeconfig.path(), text);
    }
    if !wait(Duration::from_secs(30), || as_placed(lan)) {
        eprintln!("{}", off_placement(lan, api, &placed, n));
    }
    keep_logs(lan, "-end");
    (took, handed)
}

/// The VIPs not held where placement puts them, and by whom they are.
fn off_placement(lan: &Lan, api: &FakeApiServer, placed: &[Option<usize>], n: usize) -> String {
    let now = holders(lan, api, Way::Membership, &[0, 1, 2], n);
    let off: Vec<String> = (0..n)
        .filter(|&k| now[k] != placed[k])
        .map(|k| format!("198.18.1.{}: placed on {:?}, held by {:?}", k + 1, placed[k], now[k]))
        .collect();
    format!("{} VIPs not where placement puts them after 30 s: {off:?}", off.len())
}

/// With `LB_BENCH_LOGS`, writes each daemon's log there as
/// `<node><suffix>.log`.
fn keep_logs(lan: &Lan, suffix: &str) {
    let Some(dir) = std::env::var_os("LB_BENCH_LOGS") else { return };
    for node in &lan.nodes {
        let to = std::path::Path::new(&dir).join(format!("{}{suffix}.log", node.name));
        let _ = std::fs::write(to, node.daemon().log());
    }
}
