//! The balancer on real sockets: health checks, passive failure detection,
//! fail-back and connection closing. Each test names the k3s (or rke2)
//! issue it reproduces. Needs root; see `lb_tests::privileged`.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use lb_tests::{
    Backend, Check, Client, Connect, Daemon, ServiceBuilder, TestCgroup, addr, monotonic_ns,
    privileged_test, wait_until,
};

fn client(cgroup: &TestCgroup) -> Client {
    Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(cgroup))
}

/// The readiness check the k3s issues are about: `GET /readyz` every
/// `interval_ms` (timeout: the builder's 3/4 of it, at least 50 ms).
fn readyz(interval_ms: u64) -> Check {
    Check::Http { path: "/readyz", interval: Duration::from_millis(interval_ms) }
}

/// How long the kernel skips a server after a failed connect, in these tests.
const HOLD_DOWN: Duration = Duration::from_secs(1);

#[track_caller]
fn wait_state(daemon: &Daemon, server: SocketAddr, state: &str) {
    assert!(
        wait_until(Duration::from_secs(10), || daemon.server_field(server, "state") == state),
        "{server} did not become {state}; status:\n{}\nlog:\n{}",
        serde_json::to_string_pretty(&daemon.status()).unwrap(),
        daemon.log()
    );
}

/// Waits until both servers are checked and one is active; returns
/// (active, the other). Which one wins depends on whose first check
/// answers first.
#[track_caller]
fn wait_active_pair<'a>(
    daemon: &Daemon,
    x: &'a Backend,
    y: &'a Backend,
) -> (&'a Backend, &'a Backend) {
    let checked = |b: &Backend| {
        matches!(
            daemon.server_field(b.addr, "state").as_str(),
            Some("active" | "preferred" | "healthy")
        )
    };
    assert!(
        wait_until(Duration::from_secs(10), || checked(x) && checked(y)),
        "servers were not checked:\n{}",
        daemon.log()
    );
    if daemon.server_field(x.addr, "state") == "active" { (x, y) } else { (y, x) }
}

#[track_caller]
fn landed(answer: &Connect) -> String {
    answer.landed().to_owned()
}

/// Connects until one lands on `name` (the selection may take a moment to
/// be written); panics after 10 s.
#[track_caller]
fn wait_lands(inside: &mut Client, vip: SocketAddr, name: &str) -> Connect {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = inside.connect(vip);
        if matches!(&answer, Connect::Ok { greeting, .. } if greeting == name) {
            return answer;
        }
        assert!(Instant::now() < deadline, "connections never reached {name}; last: {answer:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[track_caller]
fn wait_dead(inside: &mut Client, id: u32, what: &str) {
    assert!(wait_until(Duration::from_secs(5), || !inside.alive(id)), "{what} was not closed");
}

/// k3s PR 11329's own test sequence, step by step, on real sockets.
#[privileged_test]
fn k3s_rework_sequence() {
    let cgroup = TestCgroup::new("k3sseq");
    let default = Backend::start("default", addr(20, 1, 0));
    let s1 = Backend::start("s1", addr(20, 2, 0));
    let s2 = Backend::start("s2", addr(20, 3, 0));
    let s3 = Backend::start("s3", addr(20, 4, 0));
    let vip = addr(20, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[])
        .default(default.addr)
        .hold_down(HOLD_DOWN)
        .check(readyz(200))
        .toml();
    let daemon = Daemon::start("k3sseq", &cgroup, &config);
    if !daemon.has_feature("sock_destroy") {
        return;
    }
    let mut inside = client(&cgroup);
    let on_default = inside.connect(vip);
    assert_eq!(landed(&on_default), "default", "only the default: it is used");

    // A server is added and passes: it takes new connections, and the
    // default's connections are closed (fail-back).
    daemon.lb(&["servers", "api", &s1.addr.to_string(), "--default", &default.addr.to_string()]);
    let on_s1 = wait_lands(&mut inside, vip, "s1");
    wait_state(&daemon, s1.addr, "active");
    wait_dead(&mut inside, on_default.id(), "the default's connection after fail-back");

    // Its check fails: its connections are closed, new ones go to the default.
    s1.set_health(500);
    wait_state(&daemon, s1.addr, "failed");
    wait_dead(&mut inside, on_s1.id(), "the failed server's connection");
    let on_default = inside.connect(vip);
    assert_eq!(landed(&on_default), "default");

    // The list is replaced: the new server passes; fail-back closes the default's.
    daemon.lb(&["servers", "api", &s2.addr.to_string(), "--default", &default.addr.to_string()]);
    let on_s2 = wait_lands(&mut inside, vip, "s2");
    wait_dead(&mut inside, on_default.id(), "the default's connection after the new server passed");

    // The default is added as a real server: traffic stays on s2.
    daemon.lb(&[
        "servers",
        "api",
        &s2.addr.to_string(),
        &default.addr.to_string(),
        "--default",
        &default.addr.to_string(),
    ]);
    wait_state(&daemon, default.addr, "preferred");
    assert_eq!(landed(&inside.connect(vip)), "s2");
    assert!(inside.alive(on_s2.id()));

    // The default is removed from the list: it stays as the last resort.
    daemon.lb(&["servers", "api", &s2.addr.to_string(), "--default", &default.addr.to_string()]);
    wait_state(&daemon, default.addr, "standby");
    assert_eq!(
        daemon.status()["services"][0]["selected"],
        serde_json::json!([s2.addr.to_string(), default.addr.to_string()])
    );

    // Set-default to another server.
    daemon.lb(&["servers", "api", &s2.addr.to_string(), "--default", &s3.addr.to_string()]);
    wait_state(&daemon, s3.addr, "standby");
    assert_eq!(
        daemon.server_field(default.addr, "state"),
        serde_json::Value::Null,
        "the old default is gone"
    );
    assert_eq!(
        daemon.status()["services"][0]["selected"],
        serde_json::json!([s2.addr.to_string(), s3.addr.to_string()])
    );
    assert!(inside.alive(on_s2.id()), "the active server's connections were never touched");
}

/// k3s 10240: every health check fails but the servers still accept.
#[privileged_test]
fn k3s_10240_all_checks_failing_still_connects() {
    let cgroup = TestCgroup::new("k10240");
    let s1 = Backend::start("s1", addr(21, 1, 0));
    let s2 = Backend::start("s2", addr(21, 2, 0));
    s1.set_health(500);
    s2.set_health(503);
    let vip = addr(21, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[s1.addr, s2.addr])
        .hold_down(HOLD_DOWN)
        .check(readyz(200))
        .toml();
    let daemon = Daemon::start("k10240", &cgroup, &config);
    wait_state(&daemon, s1.addr, "failed");
    wait_state(&daemon, s2.addr, "failed");
    let mut inside = client(&cgroup);
    for _ in 0..5 {
        assert_eq!(landed(&inside.connect(vip)), "s1");
    }
    assert_eq!(daemon.server_field(s1.addr, "healthy"), false);
    assert!(daemon.server_field(s1.addr, "last_check").as_str().unwrap().contains("HTTP 500"));
}

/// k3s 9882 / 7193: a removed server never gets another connection, and its
/// VIP connections are closed.
#[privileged_test]
fn k3s_9882_removed_server_loses_everything() {
    let cgroup = TestCgroup::new("k9882");
    let s1 = Backend::start("s1", addr(22, 1, 0));
    let s2 = Backend::start("s2", addr(22, 2, 0));
    let vip = addr(22, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[s1.addr, s2.addr])
        .hold_down(HOLD_DOWN)
        .check(readyz(200))
        .toml();
    let daemon = Daemon::start("k9882", &cgroup, &config);
    if !daemon.has_feature("sock_destroy") {
        return;
    }
    let (s1, s2) = wait_active_pair(&daemon, &s1, &s2);
    let mut inside = client(&cgroup);
    let ids: Vec<u32> = (0..3)
        .map(|_| inside.connect(vip))
        .inspect(|a| assert_eq!(landed(a), s1.name))
        .map(|a| a.id())
        .collect();

    let removed_at = Instant::now();
    daemon.lb(&["servers", "api", &s2.addr.to_string()]);
    for id in ids {
        wait_dead(&mut inside, id, "a removed server's connection");
    }
    eprintln!("removed server's connections closed {:?} after `lb servers`", removed_at.elapsed());
    assert!(removed_at.elapsed() < Duration::from_secs(5));
    let before = s1.accepted();
    for _ in 0..20 {
        assert_eq!(landed(&inside.connect(vip)), s2.name);
    }
    assert_eq!(s1.accepted(), before, "the removed server received a connection");
}

/// k3s 9910 / rke2 6376: a server that still accepts TCP but fails /readyz
/// loses new connections and its connections to a healthy peer.
#[privileged_test]
fn k3s_9910_readyz_failure_moves_traffic_and_connections() {
    let cgroup = TestCgroup::new("k9910");
    let s1 = Backend::start("s1", addr(23, 1, 0));
    let s2 = Backend::start("s2", addr(23, 2, 0));
    let vip = addr(23, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[s1.addr, s2.addr])
        .hold_down(HOLD_DOWN)
        .check(readyz(200))
        .toml();
    let daemon = Daemon::start("k9910", &cgroup, &config);
    if !daemon.has_feature("sock_destroy") {
        return;
    }
    let (s1, s2) = wait_active_pair(&daemon, &s1, &s2);
    let mut inside = client(&cgroup);
    let on_s1 = inside.connect(vip);
    assert_eq!(landed(&on_s1), s1.name);

    let failed_at = Instant::now();
    s1.set_health(500);
    wait_dead(&mut inside, on_s1.id(), "the unready server's connection");
    eprintln!(
        "from /readyz turning 500 to its connections closed: {:?} (health interval 200 ms)",
        failed_at.elapsed()
    );
    assert_eq!(landed(&inside.connect(vip)), s2.name);
    wait_state(&daemon, s2.addr, "active");
    // It still accepts TCP: only the readiness check tells.
    assert!(std::net::TcpStream::connect(s1.addr).is_ok());
}

/// With a 60 s health interval, only the kernel's report of a failed connect
/// can explain traffic moving at once.
#[privileged_test]
fn passive_detection_moves_traffic_without_waiting_for_a_check() {
    let cgroup = TestCgroup::new("passive");
    let s1 = Backend::start("s1", addr(24, 1, 0));
    let s2 = Backend::start("s2", addr(24, 2, 0));
    let vip = addr(24, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[s1.addr, s2.addr])
        .hold_down(HOLD_DOWN)
        .check(readyz(60_000))
        .toml();
    let daemon = Daemon::start("passive", &cgroup, &config);
    let (active, other) = wait_active_pair(&daemon, &s1, &s2);
    let (active_name, other_name, other_addr) =
        (active.name.clone(), other.name.clone(), other.addr);
    let (s1, _s2) = if active.name == "s1" { (s1, s2) } else { (s2, s1) };
    let mut inside = client(&cgroup);
    assert_eq!(landed(&inside.connect(vip)), active_name);

    let s1_addr = s1.addr;
    let killed_at = Instant::now();
    s1.stop();
    // The first connect may meet the dead server; the next must not.
    let mut attempts = 0;
    let first_ok = loop {
        attempts += 1;
        if let Connect::Ok { greeting, .. } = inside.connect(vip) {
            break greeting;
        }
        assert!(attempts < 3, "no successful connect after the active server died");
    };
    let elapsed = killed_at.elapsed();
    eprintln!(
        "from killing the active server to the first successful connect through the VIP: {elapsed:?} ({attempts} attempts)"
    );
    assert_eq!(first_ok, other_name);
    wait_state(&daemon, s1_addr, "failed");
    wait_state(&daemon, other_addr, "active");
    // The check that confirmed it ran at once, asked for by the kernel's report.
    assert!(
        daemon.log().contains("a check confirmed the kernel's report of a failed connect"),
        "{}",
        daemon.log()
    );
}

/// k3s 11311: after an outage of every real server, the recovery of one
/// moves traffic back off the default and closes the default's connections.
#[privileged_test]
fn k3s_11311_fail_back_off_the_default() {
    let cgroup = TestCgroup::new("k11311");
    let default = Backend::start("default", addr(25, 1, 0));
    let s1 = Backend::start("s1", addr(25, 2, 0));
    let s2 = Backend::start("s2", addr(25, 3, 0));
    let vip = addr(25, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[s1.addr, s2.addr])
        .default(default.addr)
        .hold_down(HOLD_DOWN)
        .check(readyz(200))
        .toml();
    let daemon = Daemon::start("k11311", &cgroup, &config);
    if !daemon.has_feature("sock_destroy") {
        return;
    }
    let (active, _) = wait_active_pair(&daemon, &s1, &s2);
    let mut inside = client(&cgroup);
    assert_eq!(landed(&inside.connect(vip)), active.name);

    s1.set_health(500);
    s2.set_health(500);
    wait_state(&daemon, s1.addr, "failed");
    wait_state(&daemon, s2.addr, "failed");
    let on_default = wait_lands(&mut inside, vip, "default");

    s2.set_health(200);
    wait_state(&daemon, s2.addr, "active");
    wait_dead(&mut inside, on_default.id(), "the default's connection after fail-back");
    assert_eq!(landed(&inside.connect(vip)), "s2");
}

/// k3s 11349: servers go down and come back, alternately, for several
/// rounds; the node recovers every time with no restart.
#[privileged_test]
fn k3s_11349_recovers_round_after_round() {
    let cgroup = TestCgroup::new("k11349");
    let mut s1 = Some(Backend::start("s1", addr(26, 1, 0)));
    let mut s2 = Some(Backend::start("s2", addr(26, 2, 0)));
    let (a1, a2) = (s1.as_ref().unwrap().addr, s2.as_ref().unwrap().addr);
    let vip = addr(26, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[a1, a2])
        .hold_down(HOLD_DOWN)
        .check(readyz(200))
        .toml();
    let daemon = Daemon::start("k11349", &cgroup, &config);
    let mut inside = client(&cgroup);
    for round in 0..3 {
        // s1 down: traffic on s2.
        s1.take().unwrap().stop();
        wait_lands(&mut inside, vip, "s2");
        s1 = Some(Backend::start("s1", a1));
        wait_state(&daemon, a1, "preferred");
        // s2 down: traffic on s1.
        s2.take().unwrap().stop();
        wait_lands(&mut inside, vip, "s1");
        s2 = Some(Backend::start("s2", a2));
        wait_state(&daemon, a2, "preferred");
        eprintln!("round {round}: recovered");
    }
    // Both down at once, then both back.
    s1.take().unwrap().stop();
    s2.take().unwrap().stop();
    wait_state(&daemon, a1, "failed");
    wait_state(&daemon, a2, "failed");
    let _s2 = Backend::start("s2", a2);
    let _s1 = Backend::start("s1", a1);
    assert!(
        wait_until(Duration::from_secs(10), || matches!(inside.connect(vip), Connect::Ok { .. })),
        "no recovery after a total outage"
    );
}

/// k3s 10317 / 10506: 200 concurrent clients connect in a loop while the
/// server list changes and checks flap: no panic, no deadlock, no
/// connection to a server after it left the list, every client ends with a
/// working connection.
#[privileged_test]
fn k3s_10317_no_races_under_concurrent_connects_and_list_changes() {
    let cgroup = TestCgroup::new("k10317");
    let backends: Vec<Backend> =
        (1..=4).map(|i| Backend::start(&format!("s{i}"), addr(27, i, 0))).collect();
    let vip = addr(27, 100, 6444);
    let all: Vec<SocketAddr> = backends.iter().map(|b| b.addr).collect();
    let config = ServiceBuilder::new("api", vip)
        .servers(&all[..2])
        .hold_down(HOLD_DOWN)
        .check(readyz(100))
        .toml();
    let mut daemon = Daemon::start("k10317", &cgroup, &config);
    let mut storm_client = client(&cgroup);

    let stop_file = daemon.dir.join("stop-storm");
    let storm = {
        let stop_file = stop_file.clone();
        std::thread::spawn(move || {
            storm_client.storm(vip, 200, Duration::from_secs(60), &stop_file)
        })
    };
    // While it runs: replace the list, flap checks. Remember when each
    // server last left the list (CLOCK_MONOTONIC, after the change was
    // acknowledged, so it is in the kernel).
    let lists: [&[usize]; 6] = [&[2, 3], &[0, 3], &[1, 2], &[0, 1, 2, 3], &[1, 3], &[3]];
    let mut removed_at: Vec<Option<u64>> = vec![None; 4];
    let mut current: Vec<usize> = vec![0, 1];
    for (round, list) in lists.iter().enumerate() {
        std::thread::sleep(Duration::from_millis(700));
        backends[round % 4].set_health(if round % 2 == 0 { 500 } else { 200 });
        let args: Vec<String> = list.iter().map(|i| all[*i].to_string()).collect();
        let mut cmd = vec!["servers", "api"];
        cmd.extend(args.iter().map(String::as_str));
        daemon.lb(&cmd);
        let now = monotonic_ns();
        for (i, removed) in removed_at.iter_mut().enumerate() {
            if current.contains(&i) && !list.contains(&i) {
                *removed = Some(now);
            } else if list.contains(&i) {
                *removed = None;
            }
        }
        current = list.to_vec();
    }
    for b in &backends {
        b.set_health(200);
    }
    // Let the last change settle, then stop the storm: each client's final
    // connect must work.
    std::thread::sleep(Duration::from_millis(500));
    std::fs::write(&stop_file, "").unwrap();
    let summary = storm.join().expect("the storm client panicked");
    eprintln!("{summary}");
    assert!(
        summary.contains("last_ok=200"),
        "every client must end with a working connection: {summary}"
    );
    // A connect that *started* after a server left the list never lands there.
    let latest = summary.split_whitespace().find_map(|w| w.strip_prefix("latest=")).unwrap_or("");
    for entry in latest.split(',').filter(|e| !e.is_empty()) {
        let (name, started) = entry.split_once(':').unwrap();
        let started: u64 = started.parse().unwrap();
        let i = backends
            .iter()
            .position(|b| b.name == name)
            .unwrap_or_else(|| panic!("a connection reached {name:?}, not a backend"));
        if let Some(removed) = removed_at[i] {
            assert!(
                started < removed,
                "{name}: a connect started {} ms after it left the list landed there",
                (started - removed) / 1_000_000
            );
        }
    }
    // The daemon is still alive and answering.
    assert_eq!(daemon.status()["services"][0]["selected"][0], all[3].to_string());
    daemon.kill();
}

/// A daemon restarted mid-run restores the runtime server list from its
/// state directory.
#[privileged_test]
fn restart_restores_the_runtime_server_list() {
    let cgroup = TestCgroup::new("statefile");
    let s1 = Backend::start("s1", addr(28, 1, 0));
    let s2 = Backend::start("s2", addr(28, 2, 0));
    let vip = addr(28, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[s1.addr])
        .hold_down(HOLD_DOWN)
        .check(readyz(200))
        .toml();
    let mut daemon = Daemon::start("statefile", &cgroup, &config);
    daemon.lb(&["servers", "api", &s2.addr.to_string()]);
    wait_state(&daemon, s2.addr, "active");
    daemon.kill();
    daemon.restart();
    let servers = daemon.status()["services"][0]["servers"].clone();
    assert_eq!(servers.as_array().unwrap().len(), 1, "{servers}");
    assert_eq!(servers[0]["address"], s2.addr.to_string());
    wait_state(&daemon, s2.addr, "active");
    let mut inside = client(&cgroup);
    assert_eq!(landed(&inside.connect(vip)), "s2");
}

/// A daemon restarted during an outage starts from what the kernel learned.
/// Server 1 accepts nothing and was failed by the kernel's report more than
/// a hold-down ago, so no kernel mark protects it any more; with
/// `check = "none"` there is no check to ask after the restart either: only
/// what the kernel holds about the previous daemon's view keeps connects
/// off server 1.
#[privileged_test]
fn restart_during_an_outage_sends_no_connect_to_the_dead_server() {
    let cgroup = TestCgroup::new("adopt");
    let hung = full_listener(addr(34, 1, 0));
    let hung_addr = hung.addr;
    let good = Backend::start("good", addr(34, 2, 0));
    let vip = addr(34, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[hung_addr, good.addr])
        .hold_down(HOLD_DOWN)
        .check(Check::None)
        .toml();
    let mut daemon = Daemon::start("adopt", &cgroup, &config);
    let mut inside = client(&cgroup);
    // The first connect meets the full queue; its SYN timeout is the report.
    assert!(matches!(inside.connect(vip), Connect::Err(_)));
    wait_state(&daemon, hung_addr, "failed");
    assert_eq!(landed(&inside.connect(vip)), "good");
    std::thread::sleep(HOLD_DOWN * 2);
    assert_eq!(
        daemon.server_field(hung_addr, "recently_failed"),
        false,
        "the kernel's mark must have expired"
    );
    daemon.kill();
    daemon.restart();
    for n in 0..20 {
        let answer = inside.connect(vip);
        assert!(
            matches!(&answer, Connect::Ok { greeting, .. } if greeting == "good"),
            "connect {n} after the restart: {answer:?}\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(daemon.server_field(hung_addr, "state"), "failed", "{}", daemon.log());
    assert_eq!(daemon.status()["services"][0]["selected"][0], good.addr.to_string());
    drop(hung);
}

/// A server that accepts nothing (its accept queue is full, so SYNs are
/// dropped): sock_ops sees the SYN go unanswered for a retransmission
/// timeout and marks it at once, well before the application gives up.
#[privileged_test]
fn passive_detection_of_a_server_that_accepts_nothing() {
    let cgroup = TestCgroup::new("hung");
    let good = Backend::start("good", addr(29, 2, 0));
    let hung = full_listener(addr(29, 1, 0));
    let hung_addr = hung.addr;
    let vip = addr(29, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[hung_addr, good.addr])
        .hold_down(Duration::from_secs(60))
        .check(Check::None)
        .toml();
    let daemon = Daemon::start("hung", &cgroup, &config);
    let mut inside = client(&cgroup);
    // This connect meets the full queue: its SYN is dropped, retransmitted
    // after ~1 s (the report), and the client gives up after 5 s.
    let first = inside.connect(vip);
    assert!(matches!(&first, Connect::Err(_)), "{first:?}");
    assert!(
        wait_until(Duration::from_secs(10), || daemon.server_field(hung_addr, "state") == "failed"),
        "{}",
        daemon.log()
    );
    assert!(daemon.log().contains("connects through the VIP timed out"), "{}", daemon.log());
    assert_eq!(landed(&inside.connect(vip)), "good");
    drop(hung);
}

/// A listener whose accept queue is full: it never accepts, and further
/// SYNs are dropped (not refused), as with a hung server process.
struct FullListener {
    addr: SocketAddr,
    _listener: std::net::TcpListener,
    _queued: Vec<std::net::TcpStream>,
}

fn full_listener(at: SocketAddr) -> FullListener {
    let listener = std::net::TcpListener::bind(at).unwrap();
    // SAFETY: a valid listening socket fd; a backlog of 0 leaves room for
    // a single queued connection.
    assert_eq!(unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&listener), 0) }, 0);
    let addr = listener.local_addr().unwrap();
    // Fill the queue directly (not through a VIP).
    let queued: Vec<std::net::TcpStream> = (0..2)
        .filter_map(|_| {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)).ok()
        })
        .collect();
    FullListener { addr, _listener: listener, _queued: queued }
}
