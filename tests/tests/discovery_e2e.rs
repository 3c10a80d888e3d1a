//! Discovery end to end: the real daemon follows a fake
//! Kubernetes API server or a fake DNS server on loopback, and clients in
//! the test cgroup connect through the VIP with the real kernel programs.
//! Each test asserts what really happened: which server accepted each
//! connect, what the client saw, and what `lb status --json` says (its
//! `selected` list is read from the kernel's map).
//!
//! Timing: a change made at the fake source reaches the kernel after the
//! service's `debounce` and the daemon's apply step. A test takes the
//! moment it *observed* the new selection in `lb status --json` as the
//! moment the change was applied (the map was written before that read),
//! and judges connects against it; no assertion depends on how fast the
//! daemon is, only on the order of events. Every wait is bounded.
//!
//! Addresses: `127.77.140.0/24` to `127.77.145.0/24`, one per test; the
//! fakes listen on `127.0.0.1` (and, for the apiservers behind the VIP of
//! `k3s_11349`, in that test's range). Needs root; see
//! `lb_tests::privileged`.

use std::{
    collections::{BTreeSet, HashMap},
    net::{IpAddr, SocketAddr},
    thread,
    time::{Duration, Instant},
};

use lb_tests::{
    Backend, Client, Daemon, Policy, ServiceBuilder, TestCgroup, addr,
    discovery_rig::*,
    fakes::{
        apiserver::{Condition, FakeApiServer, Kubeconfig},
        dns::{FakeDns, Mode},
        runtime,
    },
    load::{Attempt, Outcome, sample, scrape},
    privileged_test, wait_until,
};

fn client(cgroup: &TestCgroup) -> Client {
    Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(cgroup))
}

/// MetalLB 474 as it happened, through the real daemon and kernel: a
/// 2-replica rolling update where each new pod, not ready yet, lands on
/// the node of the remaining old, ready pod (first with the same IP and a
/// different port, then with its own IP on the same node name). A client
/// loop connects through the VIP (spread over the ready endpoints) for the
/// whole update: old ready + new not ready → new ready → old terminating
/// but serving (drained) → old gone.
///
/// Asserted from the client's record of every connect (CLOCK_MONOTONIC at
/// its start, the server that greeted it):
/// - not one connect failed;
/// - while a new pod was not ready, the ready old pod on its node kept
///   getting connects (the MetalLB bug took that node out);
/// - no connect reached a new pod before the test declared it ready;
/// - no connect that started after a drain was applied reached the
///   drained pod, nor any after it was gone.
#[privileged_test]
fn metallb_474_rolling_update_with_zero_failed_connects() {
    use Condition::{NotReady, Ready, TerminatingNotServing, TerminatingServing};
    const NET: u8 = 140;
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start());
    let kubeconfig = Kubeconfig::write(&api.url());
    // Node a is 127.77.140.1, node b .2; new-2 gets its own IP .3 on node b.
    let old_port = shared_port(NET, &[1, 2]);
    let new_port = (0..50)
        .map(|_| shared_port(NET, &[2, 3]))
        .find(|p| *p != old_port)
        .expect("a second shared port");
    let old1 = Backend::start("old-1", addr(NET, 1, old_port));
    let old2 = Backend::start("old-2", addr(NET, 2, old_port));
    let new1 = Backend::start("new-1", addr(NET, 2, new_port)); // old-2's IP, another port
    let new2 = Backend::start("new-2", addr(NET, 3, new_port)); // old-2's node name
    let (o1, o2, n1, n2) = (old1.addr, old2.addr, new1.addr, new2.addr);
    let old =
        |list: &[(SocketAddr, &str, Condition)]| api.apply(slice("web-old", "web", old_port, list));
    let new =
        |list: &[(SocketAddr, &str, Condition)]| api.apply(slice("web-new", "web", new_port, list));
    old(&[(o1, "node-a", Ready), (o2, "node-b", Ready)]);

    let cgroup = TestCgroup::new("disc-metallb");
    let vip = addr(NET, 100, 8443);
    let debounce = Duration::from_millis(200);
    let config = kubernetes(
        ServiceBuilder::new("web", vip).policy(Policy::Spread),
        "web",
        "https",
        debounce,
    )
    .toml();
    let daemon =
        Daemon::start_with("disc-metallb", &cgroup, &kubeconfig_setting(&kubeconfig), &config);
    wait_view(&daemon, &[o1, o2], &[], "the first list");

    // The client loop: 4 threads, each connecting, reading the greeting
    // and closing, until the stop file exists.
    let mut load = Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(&cgroup));
    let stop_path = daemon.dir.join("stop");
    let record = daemon.dir.join("attempts");
    let looper = {
        let (stop_path, record) = (stop_path.clone(), record.clone());
        thread::spawn(move || load.chaos(&[vip], 4, Duration::from_secs(80), &stop_path, &record))
    };
    let stop = StopFile(stop_path);
    wait_traffic(&[&old1, &old2], 20, "before the update");

    let mut steps: Vec<Step> = Vec::new();
    // Replica 1. new-1 starts on node b (old-2's IP, another port), not ready.
    steps.push(change_ignored(
        &daemon,
        "new-1 not ready",
        debounce,
        || _ = new(&[(n1, "node-b", NotReady)]),
        &[o1, o2],
        &[&old1, &old2],
    ));
    steps.push(change_applied(
        &daemon,
        "new-1 ready",
        || _ = new(&[(n1, "node-b", Ready)]),
        &[o1, o2, n1],
        &[],
    ));
    wait_traffic(&[&new1], 20, "new-1 ready");
    steps.push(change_applied(
        &daemon,
        "old-1 terminating",
        || _ = old(&[(o1, "node-a", TerminatingServing), (o2, "node-b", Ready)]),
        &[o2, n1],
        &[o1],
    ));
    wait_traffic(&[&old2, &new1], 20, "old-1 drained");
    steps.push(change_applied(
        &daemon,
        "old-1 gone",
        || _ = old(&[(o2, "node-b", Ready)]),
        &[o2, n1],
        &[],
    ));
    // Its pod exits: a connect that still reached it would be refused.
    old1.stop();

    // Replica 2. new-2 starts on node b too (its own IP), not ready.
    steps.push(change_ignored(
        &daemon,
        "new-2 not ready",
        debounce,
        || _ = new(&[(n1, "node-b", Ready), (n2, "node-b", NotReady)]),
        &[o2, n1],
        &[&old2, &new1],
    ));
    steps.push(change_applied(
        &daemon,
        "new-2 ready",
        || _ = new(&[(n1, "node-b", Ready), (n2, "node-b", Ready)]),
        &[o2, n1, n2],
        &[],
    ));
    wait_traffic(&[&new2], 20, "new-2 ready");
    steps.push(change_applied(
        &daemon,
        "old-2 terminating",
        || _ = old(&[(o2, "node-b", TerminatingServing)]),
        &[n1, n2],
        &[o2],
    ));
    wait_traffic(&[&new1, &new2], 20, "old-2 drained");
    // Terminating and no longer serving: it leaves; then its slice goes.
    steps.push(change_applied(
        &daemon,
        "old-2 gone",
        || _ = old(&[(o2, "node-b", TerminatingNotServing)]),
        &[n1, n2],
        &[],
    ));
    api.delete("default", "web-old").expect("the old slice");
    old2.stop();
    wait_traffic(&[&new1, &new2], 20, "after the update");

    drop(stop);
    let attempts: Vec<Attempt> = looper.join().expect("the client loop");
    let step = |what: &str| steps.iter().find(|s| s.what == what).unwrap();
    let applied = |what: &str| step(what).applied.unwrap();
    let (new1_declared, new2_declared) = (step("new-1 ready").changed, step("new-2 ready").changed);
    let (new1_not_ready, new2_not_ready) =
        (step("new-1 not ready").changed, step("new-2 not ready").changed);
    let (old1_drained, old2_drained) = (applied("old-1 terminating"), applied("old-2 terminating"));

    let mut names: HashMap<String, usize> = HashMap::new();
    let mut problems = Vec::new();
    for a in &attempts {
        let Outcome::Server(name) = &a.outcome else {
            problems.push(format!("a connect failed: {a:?}"));
            continue;
        };
        *names.entry(name.clone()).or_default() += 1;
        let bad = match name.as_str() {
            "new-1" if a.end < new1_declared => "reached new-1 before it was declared ready",
            "new-2" if a.end < new2_declared => "reached new-2 before it was declared ready",
            "old-1" if a.start > old1_drained => {
                "started after old-1's drain was applied and reached it"
            }
            "old-2" if a.start > old2_drained => {
                "started after old-2's drain was applied and reached it"
            }
            _ => continue,
        };
        problems.push(format!("{bad}: {a:?}"));
    }
    // The MetalLB property: while a not-ready pod shared its node, the
    // ready old pod there kept serving (counted from the client's record).
    let on_old2 = |from: u64, to: u64| {
        attempts
            .iter()
            .filter(|a| {
                a.start >= from && a.end <= to && a.outcome == Outcome::Server("old-2".into())
            })
            .count()
    };
    let during_new1_not_ready = on_old2(new1_not_ready, new1_declared);
    let during_new2_not_ready = on_old2(new2_not_ready, new2_declared);
    eprintln!(
        "{} connects: {names:?}; old-2 took {during_new1_not_ready} connects while new-1 was not ready on its node, \
         {during_new2_not_ready} while new-2 was",
        attempts.len(),
    );
    assert!(
        problems.is_empty(),
        "{} problems of {} connects, e.g.:\n{}\nsteps: {steps:#?}",
        problems.len(),
        attempts.len(),
        problems[..problems.len().min(20)].join("\n")
    );
    assert!(
        during_new1_not_ready > 0 && during_new2_not_ready > 0,
        "old-2 got no connects while a not-ready pod shared its node"
    );
    assert!(attempts.iter().filter(|a| a.last).all(|a| matches!(a.outcome, Outcome::Server(_))));
    for name in ["old-1", "old-2", "new-1", "new-2"] {
        assert!(names.get(name).is_some_and(|n| *n > 0), "{name} never took a connect: {names:?}");
    }
}

/// Terminating endpoints, through the kernel: when the only endpoints
/// left are terminating but serving, traffic still flows to them; when a
/// ready one appears, new connects go there and the connections held to
/// the terminating ones stay open; each is closed when its endpoint
/// leaves the list (not before).
#[privileged_test]
fn terminating_endpoints_serve_until_a_ready_one_appears_and_keep_connections_until_they_leave() {
    use Condition::{Ready, TerminatingServing};
    const NET: u8 = 141;
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start());
    let kubeconfig = Kubeconfig::write(&api.url());
    let port = shared_port(NET, &[1, 2, 3]);
    let t1 = Backend::start("t1", addr(NET, 1, port));
    let t2 = Backend::start("t2", addr(NET, 2, port));
    let r1 = Backend::start("r1", addr(NET, 3, port));
    let (a1, a2, a3) = (t1.addr, t2.addr, r1.addr);
    let set = |list: &[(SocketAddr, &str, Condition)]| api.apply(slice("web-x", "web", port, list));
    set(&[(a1, "n1", Ready), (a2, "n2", Ready)]);

    let cgroup = TestCgroup::new("disc-term");
    let vip = addr(NET, 100, 8443);
    let config = kubernetes(
        ServiceBuilder::new("web", vip).policy(Policy::Spread),
        "web",
        "https",
        Duration::from_millis(200),
    )
    .toml();
    let daemon =
        Daemon::start_with("disc-term", &cgroup, &kubeconfig_setting(&kubeconfig), &config);
    wait_view(&daemon, &[a1, a2], &[], "the first list");
    let closes = daemon.has_feature("sock_destroy");

    // Hold one connection to each (spread picks at random: bounded tries).
    let mut inside = client(&cgroup);
    let mut held: HashMap<String, u32> = HashMap::new();
    for _ in 0..200 {
        if held.len() == 2 {
            break;
        }
        let answer = inside.connect(vip);
        match held.entry(answer.landed().to_owned()) {
            std::collections::hash_map::Entry::Occupied(_) => inside.close(answer.id()),
            std::collections::hash_map::Entry::Vacant(slot) => _ = slot.insert(answer.id()),
        }
    }
    assert_eq!(held.len(), 2, "spread never reached both servers: {held:?}");
    let (h1, h2) = (held["t1"], held["t2"]);

    // Both terminate, still serving: the only endpoints left. Traffic
    // still flows to them.
    set(&[(a1, "n1", TerminatingServing), (a2, "n2", TerminatingServing)]);
    wait_view(&daemon, &[], &[a1, a2], "only terminating endpoints");
    let names = connects(&mut inside, vip, 20);
    all_in(&names, &["t1", "t2"], "only terminating endpoints left");
    assert!(
        inside.alive(h1) && inside.alive(h2),
        "a held connection to a terminating endpoint was closed"
    );

    // A ready one appears: every new connect goes there; the held ones stay.
    set(&[(a1, "n1", TerminatingServing), (a2, "n2", TerminatingServing), (a3, "n3", Ready)]);
    wait_view(&daemon, &[a3], &[a1, a2], "a ready endpoint appeared");
    let names = connects(&mut inside, vip, 20);
    all_in(&names, &["r1"], "a ready endpoint exists");
    assert!(
        inside.alive(h1) && inside.alive(h2),
        "a held connection to a drained endpoint was closed while it was still listed"
    );
    assert!(
        daemon.connections("web", a1) >= 1 && daemon.connections("web", a2) >= 1,
        "the kernel no longer counts the held connections"
    );

    // t1 leaves: its connection is closed, t2's stays.
    set(&[(a2, "n2", TerminatingServing), (a3, "n3", Ready)]);
    wait_view(&daemon, &[a3], &[a2], "t1 left");
    if closes {
        assert!(
            wait_until(Duration::from_secs(5), || !inside.alive(h1)),
            "t1 left the list but its connection stayed open"
        );
    }
    assert!(inside.alive(h2), "t2 is still listed (serving) but its connection was closed");
    all_in(&connects(&mut inside, vip, 10), &["r1"], "after t1 left");

    // t2 leaves too.
    set(&[(a3, "n3", Ready)]);
    wait_view(&daemon, &[a3], &[], "t2 left");
    if closes {
        assert!(
            wait_until(Duration::from_secs(5), || !inside.alive(h2)),
            "t2 left the list but its connection stayed open"
        );
    }
    let before = (t1.accepted(), t2.accepted());
    all_in(&connects(&mut inside, vip, 10), &["r1"], "after both left");
    assert_eq!((t1.accepted(), t2.accepted()), before);
}

/// k3s 11349 through the real daemon: the lb service is the apiservers'
/// own (`default/kubernetes`), its VIP is the kubeconfig's server, and the
/// two fake apiservers are its servers. The apiserver the watch is
/// connected to dies; the watch reconnects through the other (a usable
/// server of the service: the VIP itself is not reachable from the
/// daemon, which is outside the cgroup), and an endpoint change made after
/// the outage reaches the kernel's selection.
#[privileged_test]
fn k3s_11349_the_watch_follows_the_apiservers_after_its_own_dies() {
    const NET: u8 = 142;
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start());
    // Only the apiservers in this test's range serve.
    api.stop_listener(api.addr());
    let port = shared_port(NET, &[1, 2, 3]);
    let (a1, a2, a3) = (addr(NET, 1, port), addr(NET, 2, port), addr(NET, 3, port));
    rt.block_on(api.listen(a1));
    rt.block_on(api.listen(a2));
    let apiservers = |list: &[(SocketAddr, &str)]| set_apiservers(&api, port, list);
    apiservers(&[(a1, "server-1"), (a2, "server-2")]);

    let cgroup = TestCgroup::new("disc-k11349");
    let vip = addr(NET, 100, 6443);
    let kubeconfig = Kubeconfig::write(&format!("http://{vip}"));
    // The static list is the bootstrap: one apiserver.
    let config = apiservers_service(vip, a1);
    let daemon =
        Daemon::start_with("disc-k11349", &cgroup, &kubeconfig_setting(&kubeconfig), &config);
    wait_selected_set(&daemon, &[a1, a2], "both apiservers discovered");

    // The apiserver the watch is on.
    let mut watching = None;
    assert!(
        wait_until(WAIT, || {
            watching = api.requests().iter().rev().find(|r| r.watch).map(|r| r.via);
            watching.is_some()
        }),
        "no watch request: {:#?}",
        api.requests()
    );
    let dead = watching.unwrap();
    let survivor = if dead == a1 { a2 } else { a1 };
    assert!(
        dead == a1 || dead == a2,
        "the watch went to {dead}, not to an apiserver of the service"
    );
    let before = api.requests().len();
    api.stop_listener(dead);

    // After the outage: the dead one's endpoint goes, a new apiserver comes.
    rt.block_on(api.listen(a3));
    let survivor_name = if dead == a1 { "server-2" } else { "server-1" };
    apiservers(&[(survivor, survivor_name), (a3, "server-3")]);
    wait_selected_set(&daemon, &[survivor, a3], "the change made after the outage");
    let after: Vec<_> = api.requests()[before..].to_vec();
    assert!(
        after.iter().any(|r| r.via == survivor),
        "nothing asked the surviving apiserver {survivor}: {after:#?}"
    );
    let status = wait_discovery(&daemon, "synced again", |d| {
        d["last_error"].is_null() && d["last_success"].is_u64()
    });
    eprintln!("requests after the outage: {after:?}; discovery status: {status}");
    assert_eq!(status["source"], "kubernetes");
    let selected = view(&service_status(&daemon)).selected;
    assert!(!selected.contains(&dead), "the dead apiserver is still selected: {selected:?}");
    // The kubeconfig's address, the VIP, answers nobody outside the test
    // cgroup (the daemon is outside it): the watch can only have come back
    // through a server of the service, and the daemon says which.
    assert!(
        std::net::TcpStream::connect_timeout(&vip, Duration::from_secs(2)).is_err(),
        "the VIP answered outside the cgroup"
    );
    assert!(
        log_lines(&daemon, &format!("connected to the apiserver at {survivor}")) > 0,
        "no connection to the surviving apiserver in the log:\n{}",
        daemon.log()
    );
}

/// The k3s agent's case, the config's servers a last resort: the lb service is the
/// apiservers' own, the kubeconfig points at its VIP, and the config's
/// server is the registration address `reg` (an apiserver that stays).
/// The discovered apiservers are persisted; the daemon dies, and while it
/// is down both are replaced by a third. The restarted daemon holds the
/// persisted list and dials it and the VIP in vain, then `reg`, which
/// lists the new apiserver. Before, the config's servers were forgotten
/// once a discovered list was persisted, and the node never recovered.
#[privileged_test]
fn a_node_down_while_every_apiserver_was_replaced_recovers_through_the_config_servers() {
    const NET: u8 = 146;
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start());
    api.stop_listener(api.addr());
    let port = shared_port(NET, &[1, 2, 3, 9]);
    let (a1, a2, a3) = (addr(NET, 1, port), addr(NET, 2, port), addr(NET, 3, port));
    let reg = addr(NET, 9, port);
    for listener in [a1, a2, reg] {
        rt.block_on(api.listen(listener));
    }
    let apiservers = |list: &[(SocketAddr, &str)]| set_apiservers(&api, port, list);
    apiservers(&[(a1, "server-1"), (a2, "server-2")]);

    let cgroup = TestCgroup::new("disc-seeds");
    let vip = addr(NET, 100, 6443);
    let kubeconfig = Kubeconfig::write(&format!("http://{vip}"));
    let config = apiservers_service(vip, reg);
    let mut daemon =
        Daemon::start_with("disc-seeds", &cgroup, &kubeconfig_setting(&kubeconfig), &config);
    wait_selected_set(&daemon, &[a1, a2], "both apiservers discovered");
    let state = daemon.dir.join("state/servers.json");
    assert!(
        wait_until(WAIT, || std::fs::read_to_string(&state)
            .is_ok_and(|s| s.contains(&a1.to_string()) && s.contains(&a2.to_string()))),
        "the discovered list was not persisted"
    );

    // The node is down while both apiservers are replaced.
    daemon.kill();
    api.stop_listener(a1);
    api.stop_listener(a2);
    rt.block_on(api.listen(a3));
    apiservers(&[(a3, "server-3")]);
    daemon.restart();
    wait_selected_set(&daemon, &[a3], "the apiserver that replaced them");
    assert!(
        log_lines(&daemon, &format!("connected to the apiserver at {reg}")) > 0,
        "discovery did not come back through the config's server {reg}:\n{}",
        daemon.log()
    );
}

/// Start-up flapping: an endpoint added, removed and re-added within the
/// debounce window is one change of the kernel's selection, not three
/// (`lb_selection_changes_total`, the "selection written" log lines and
/// `lb_discovery_updates_total{result="applied"}` each grow by one), and
/// the connection held through it is untouched.
#[privileged_test]
fn startup_flapping_within_the_debounce_window_is_one_selection_change() {
    use Condition::Ready;
    const NET: u8 = 143;
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start());
    let kubeconfig = Kubeconfig::write(&api.url());
    let port = shared_port(NET, &[1, 2]);
    let s1 = Backend::start("s1", addr(NET, 1, port));
    let s2 = Backend::start("s2", addr(NET, 2, port));
    let set = |list: &[(SocketAddr, &str, Condition)]| api.apply(slice("api-x", "api", port, list));
    set(&[(s1.addr, "n1", Ready)]);

    let cgroup = TestCgroup::new("disc-flap");
    let vip = addr(NET, 100, 6443);
    let metrics = addr(NET, 200, 9464);
    let debounce = Duration::from_secs(2);
    let config = kubernetes(ServiceBuilder::new("api", vip), "api", "https", debounce).toml();
    let settings = format!("{}metrics = \"{metrics}\"\n", kubeconfig_setting(&kubeconfig));
    let daemon = Daemon::start_with("disc-flap", &cgroup, &settings, &config);
    wait_view(&daemon, &[s1.addr], &[], "the first list");
    let mut inside = client(&cgroup);
    let held = inside.connect(vip);
    assert_eq!(held.landed(), "s1");

    let counts = || {
        let text = scrape(metrics).unwrap_or_else(|e| panic!("scraping {metrics}: {e}"));
        let changes = sample(&text, "lb_selection_changes_total{service=\"api\"}").unwrap_or(0.0);
        let applied: f64 = text
            .lines()
            .filter(|l| {
                l.starts_with("lb_discovery_updates_total{")
                    && l.contains("service=\"api\"")
                    && l.contains("result=\"applied\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        (changes, applied, log_lines(&daemon, "selection written"))
    };
    let before = counts();

    // The apiserver adds, removes and re-adds itself while it starts.
    let burst = Instant::now();
    set(&[(s1.addr, "n1", Ready), (s2.addr, "n2", Ready)]);
    set(&[(s1.addr, "n1", Ready)]);
    set(&[(s1.addr, "n1", Ready), (s2.addr, "n2", Ready)]);
    let burst = burst.elapsed();
    assert!(
        burst < debounce,
        "precondition: the test's own burst of three changes took {burst:?}, longer than the window {debounce:?}"
    );

    wait_view(&daemon, &[s1.addr, s2.addr], &[], "the settled list");
    // Anything the burst could still cause lands within one more window.
    thread::sleep(debounce + Duration::from_millis(500));
    let after = counts();
    eprintln!(
        "burst of 3 changes in {burst:?}; (selection changes, applied updates, log lines) {before:?} -> {after:?}"
    );
    assert_eq!(
        after.0 - before.0,
        1.0,
        "lb_selection_changes_total grew by {} for one burst:\n{}",
        after.0 - before.0,
        daemon.log()
    );
    assert_eq!(
        after.1 - before.1,
        1.0,
        "applied discovery updates grew by {} for one burst",
        after.1 - before.1
    );
    assert_eq!(
        after.2 - before.2,
        1,
        "\"selection written\" logged {} times for one burst:\n{}",
        after.2 - before.2,
        daemon.log()
    );
    assert!(view_is(&view(&service_status(&daemon)), &[s1.addr, s2.addr], &[]));
    assert!(inside.alive(held.id()), "the connection held through the flapping was closed");
    all_in(&connects(&mut inside, vip, 5), &["s1", "s2"], "after the flapping");
}

/// An empty list keeps the last servers (status says so, connects still
/// work); then a restart during an API outage (apiserver stopped, daemon
/// SIGKILLed and started again) uses the persisted list, not the static
/// bootstrap one: connects work right after the restart and reach the
/// discovered servers. When the apiserver is back, discovery recovers.
#[privileged_test]
fn empty_list_keeps_the_last_servers_and_a_restart_during_an_outage_uses_the_persisted_list() {
    use Condition::Ready;
    const NET: u8 = 144;
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start());
    let kubeconfig = Kubeconfig::write(&api.url());
    let port = shared_port(NET, &[1, 2]);
    let s1 = Backend::start("s1", addr(NET, 1, port));
    let s2 = Backend::start("s2", addr(NET, 2, port));
    let boot = Backend::start("boot", addr(NET, 3, 0));
    let set = |list: &[(SocketAddr, &str, Condition)]| api.apply(slice("web-x", "web", port, list));
    set(&[(s1.addr, "n1", Ready), (s2.addr, "n2", Ready)]);

    let cgroup = TestCgroup::new("disc-empty");
    let vip = addr(NET, 100, 8443);
    let config = kubernetes(
        ServiceBuilder::new("web", vip).servers(&[boot.addr]).policy(Policy::Spread),
        "web",
        "https",
        Duration::from_millis(200),
    )
    .toml();
    let mut daemon =
        Daemon::start_with("disc-empty", &cgroup, &kubeconfig_setting(&kubeconfig), &config);
    wait_view(&daemon, &[s1.addr, s2.addr], &[], "the first list");
    let mut inside = client(&cgroup);
    all_in(&connects(&mut inside, vip, 10), &["s1", "s2"], "the discovered list");

    // The source goes blank: the last list stays.
    set(&[]);
    let status = wait_discovery(&daemon, "the empty list", |d| {
        d["last_error"].as_str().is_some_and(|e| e.contains("no endpoints"))
    });
    eprintln!("after an empty list: {status}");
    assert!(
        view_is(&view(&service_status(&daemon)), &[s1.addr, s2.addr], &[]),
        "an empty list changed the selection"
    );
    all_in(&connects(&mut inside, vip, 10), &["s1", "s2"], "after an empty list");
    let saved =
        std::fs::read_to_string(daemon.dir.join("state/servers.json")).expect("the state file");
    assert!(
        saved.contains(&s1.addr.to_string()) && saved.contains(&s2.addr.to_string()),
        "the discovered list was not persisted: {saved}"
    );

    // An API outage, and the daemon dies in it.
    api.stop();
    daemon.kill();
    daemon.restart();
    let names = connects(&mut inside, vip, 10);
    let status = service_status(&daemon);
    all_in(&names, &["s1", "s2"], "right after the restart");
    let servers: BTreeSet<SocketAddr> = status["servers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["address"].as_str()?.parse().ok())
        .collect();
    assert_eq!(
        servers,
        BTreeSet::from([s1.addr, s2.addr]),
        "the restarted daemon does not hold the persisted list: {status}"
    );
    assert!(view_is(&view(&status), &[s1.addr, s2.addr], &[]), "{status}");
    let status = wait_discovery(&daemon, "the outage", |d| {
        d["last_error"].as_str().is_some_and(|e| e.starts_with("kubernetes"))
    });
    eprintln!("during the outage: {status}");
    all_in(&connects(&mut inside, vip, 10), &["s1", "s2"], "during the outage");
    assert_eq!(boot.accepted(), 0, "the bootstrap server got connects");

    // The apiserver is back, with a change: it is followed again.
    rt.block_on(api.restart());
    set(&[(s2.addr, "n2", Ready)]);
    wait_view(&daemon, &[s2.addr], &[], "after the outage");
    wait_discovery(&daemon, "recovered", |d| d["last_error"].is_null());
    all_in(&connects(&mut inside, vip, 10), &["s2"], "after the outage");
}

/// DNS: a DNS server on loopback (`LB_DNS_SERVER` in the daemon's
/// environment) whose records change: the kernel's selection follows, and
/// no connect after the change reaches a server that left; SERVFAIL keeps
/// the last list (status `last_error` says so, connects still work); the
/// first good answer clears the error.
#[privileged_test]
fn dns_records_are_followed_and_servfail_keeps_the_last_list() {
    const NET: u8 = 145;
    let rt = runtime();
    let dns = rt.block_on(FakeDns::start());
    let port = shared_port(NET, &[1, 2, 3]);
    let d1 = Backend::start("d1", addr(NET, 1, port));
    let d2 = Backend::start("d2", addr(NET, 2, port));
    let d3 = Backend::start("d3", addr(NET, 3, port));
    let name = "api.lb-test.internal.";
    let ips = |list: &[&Backend]| list.iter().map(|b| b.addr.ip()).collect::<Vec<IpAddr>>();
    dns.set(name, &ips(&[&d1]), 1);

    let cgroup = TestCgroup::new("disc-dns");
    let vip = addr(NET, 100, 2379);
    let config = ServiceBuilder::new("etcd", vip)
        .policy(Policy::Spread)
        .raw("[service.discovery]")
        .raw(&format!("dns = {{ name = \"{name}\", port = {port} }}"))
        .raw("debounce = \"100ms\"")
        // The shortest re-resolution a config takes (a TTL of 1 s).
        .raw("refresh_min = \"1s\"")
        .raw("refresh_max = \"2s\"")
        .toml();
    let server = dns.addr().to_string();
    let daemon =
        Daemon::start_with_env("disc-dns", &cgroup, "", &[("LB_DNS_SERVER", &server)], &config);
    wait_view(&daemon, &[d1.addr], &[], "the first answer");
    assert_eq!(service_status(&daemon)["discovery"]["source"], "dns");
    let mut inside = client(&cgroup);
    all_in(&connects(&mut inside, vip, 5), &["d1"], "the first answer");

    // The records change: the selection follows; d1 gets nothing more.
    dns.set(name, &ips(&[&d2, &d3]), 1);
    wait_view(&daemon, &[d2.addr, d3.addr], &[], "the changed records");
    let d1_before = d1.accepted();
    let names = connects(&mut inside, vip, 20);
    all_in(&names, &["d2", "d3"], "after the records changed");
    assert_eq!(d1.accepted(), d1_before, "d1 left the records but got a connect");

    // SERVFAIL: the last list stays, and status says why.
    dns.set_mode(Mode::ServFail);
    let status = wait_discovery(&daemon, "SERVFAIL", |d| {
        d["last_error"].as_str().is_some_and(|e| e.contains("SERVFAIL"))
    });
    eprintln!("during SERVFAIL: {status}");
    assert!(
        view_is(&view(&service_status(&daemon)), &[d2.addr, d3.addr], &[]),
        "SERVFAIL changed the selection"
    );
    all_in(&connects(&mut inside, vip, 10), &["d2", "d3"], "during SERVFAIL");
    let queries = dns.queries();
    assert!(
        wait_until(WAIT, || dns.queries() > queries + 1),
        "the daemon stopped asking during SERVFAIL"
    );
    assert!(
        view_is(&view(&service_status(&daemon)), &[d2.addr, d3.addr], &[]),
        "a later SERVFAIL changed the selection"
    );

    // Answers again: the error clears.
    dns.set_mode(Mode::Answer);
    let status = wait_discovery(&daemon, "answers again", |d| {
        d["last_error"].is_null() && d["last_success"].is_u64()
    });
    eprintln!("recovered: {status}");
    all_in(&connects(&mut inside, vip, 10), &["d2", "d3"], "after recovery");
}
