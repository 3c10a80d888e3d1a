//! The daemon under load: closing thousands of connections must not stop
//! the owner loop, and a flood of idle connections to the metrics endpoint
//! must not take the daemon's file descriptors. Needs root; see
//! `lb_tests::privileged`.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use lb_tests::{
    Backend, Check, Client, Connect, Daemon, ServiceBuilder, TestCgroup, addr,
    hold_backend::HoldBackend,
    load::{
        Flood, Outcome, ProcSample, log_since, raise_nofile, sample, scrape, server_field,
        timed_status,
    },
    privileged_test, wait_until,
};
use lb_user::control::{Request, Response};

/// The tests of this file load the machine on purpose: one at a time.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static HEAVY: Mutex<()> = Mutex::new(());
    HEAVY.lock().unwrap_or_else(PoisonError::into_inner)
}

fn readyz(interval_ms: u64) -> Check {
    Check::Http { path: "/readyz", interval: Duration::from_millis(interval_ms) }
}

/// A service checked with `GET /readyz` every 200 ms, failed after 3
/// failing checks in a row: on a loaded 2-CPU machine one check can time
/// out (150 ms) without anything being wrong. A kernel report of a failed
/// connect is still confirmed by the first failing check, whatever `fall` is.
fn service(name: &str, vip: SocketAddr, servers: &[SocketAddr]) -> String {
    ServiceBuilder::new(name, vip).servers(servers).check(readyz(200)).fall(3).toml()
}

/// How long one `lb status` may take here before it counts as not
/// answering. Not a speed limit: a daemon whose owner loop is blocked
/// (the old code, while it closed connections) does not answer at all
/// until the blocking work is done; a working one answers in milliseconds.
const ANSWERS_WITHIN: Duration = Duration::from_secs(5);

fn state(daemon: &Daemon, service: &str, server: SocketAddr) -> String {
    server_field(&daemon.status(), service, server, "state").as_str().unwrap_or("").to_owned()
}

fn in_healthy_class(state: &str) -> bool {
    matches!(state, "active" | "preferred" | "healthy")
}

/// Connects through `vip` right after its active server was killed: the
/// first connect may meet the dead server and be refused, which marks it in
/// the kernel, so the second must work. Returns the greeting and the tries.
#[track_caller]
fn connect_after_a_kill(inside: &mut Client, vip: SocketAddr) -> (String, usize) {
    for attempt in 1..=2 {
        match inside.connect(vip) {
            Connect::Ok { greeting, .. } => return (greeting, attempt),
            Connect::Err(e) => eprintln!("connect {attempt} through {vip} after the kill: {e}"),
        }
    }
    panic!("after its server was killed, the second connect through {vip} failed too");
}

/// How many VIP connections one server holds. 10,000 is the scale the
/// closing must handle; it takes a few seconds to open on a 2-CPU machine.
const HELD: usize = 10_000;

/// 10,000 VIP connections to server a1; a1 fails its health check, so the
/// daemon closes all 10,000 (a2 is healthy), on a blocking thread. While
/// that closing is in progress, `lb status` answers and a second service
/// fails over when its active server is killed. Then every one of the
/// 10,000 is reset, which the client, the server and the metrics each see.
#[privileged_test]
fn closing_ten_thousand_connections_blocks_neither_status_nor_another_failover() {
    let _heavy = one_at_a_time();
    let test_started = Instant::now();
    // This process holds the server side of every connection, the client
    // the other; each needs HELD descriptors and some to spare.
    let limit = raise_nofile(HELD as u64 + 4096);
    assert!(
        limit >= HELD as u64 + 1024,
        "RLIMIT_NOFILE is {limit} and cannot be raised: {HELD} connections need more"
    );
    let net = 91;
    let cgroup = TestCgroup::new("stress10k");
    let a1 = HoldBackend::start("a1", addr(net, 1, 0));
    let a2 = HoldBackend::start("a2", addr(net, 2, 0));
    let b1 = Backend::start("b1", addr(net, 3, 0));
    let b2 = Backend::start("b2", addr(net, 4, 0));
    let (a_vip, b_vip, metrics) =
        (addr(net, 100, 6444), addr(net, 101, 6444), addr(net, 200, 9464));
    let config =
        service("a", a_vip, &[a1.addr, a2.addr]) + &service("b", b_vip, &[b1.addr, b2.addr]);
    let daemon =
        Daemon::start_with("stress10k", &cgroup, &format!("metrics = \"{metrics}\"\n"), &config);
    if !daemon.has_feature("sock_destroy") {
        return;
    }
    // The first configured servers win the first elections.
    assert!(
        wait_until(Duration::from_secs(15), || {
            state(&daemon, "a", a1.addr) == "active"
                && in_healthy_class(&state(&daemon, "a", a2.addr))
                && state(&daemon, "b", b1.addr) == "active"
                && in_healthy_class(&state(&daemon, "b", b2.addr))
        }),
        "a1 and b1 were not elected:\n{}",
        serde_json::to_string_pretty(&daemon.status()).unwrap()
    );

    let mut holder = Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(&cgroup));
    let opening = Instant::now();
    let held = holder.hold(a_vip, HELD, 8);
    eprintln!("opened {} VIP connections in {:?}: {held:?}", held.ok, opening.elapsed());
    assert_eq!((held.ok, held.failed), (HELD, 0), "{held:?}");
    assert_eq!(
        held.names,
        HashMap::from([("a1".to_owned(), HELD)]),
        "every connection through the VIP must reach the active server"
    );
    assert!(
        wait_until(Duration::from_secs(15), || daemon.connections("a", a1.addr) == HELD as i64),
        "the kernel counts {} connections to a1, not {HELD}",
        daemon.connections("a", a1.addr)
    );
    assert_eq!(a1.open(), HELD);
    let mut inside = Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(&cgroup));
    let on_b = inside.connect(b_vip);
    assert_eq!(
        on_b.landed(),
        "b1",
        "{}",
        daemon
            .log()
            .lines()
            .filter(|l| l.contains(" -> ") || l.contains("WARN"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let log_from = lb_tests::load::log_len(&daemon);

    // a1's next check fails: the daemon fails it and closes its 10,000.
    let failed_at = Instant::now();
    a1.set_health(500);
    assert!(
        wait_until(Duration::from_secs(30), || a1.resets() > 0),
        "a1's connections were never closed:\n{}",
        log_since(&daemon, log_from)
    );
    let closing_seen = failed_at.elapsed();

    // While the closing is in progress, the second service fails over.
    let resets_at_kill = a1.resets();
    let b1_addr = b1.stop();
    let (landed, tries) = connect_after_a_kill(&mut inside, b_vip);
    let resets_at_failover = a1.resets();
    assert_eq!(landed, "b2", "after b1 was killed, the next connect through b's VIP must reach b2");

    // And `lb status` answers, again and again, until the closing is done
    // and the daemon has failed b1 (bounded: 60 s). What proves that an
    // answer was made *while* the closing was in progress is what it says:
    // the owner loop read a1's live connection count from the kernel
    // (sock_ops uncounts each connection as it is destroyed) and found it
    // between 0 and 10,000. A daemon whose owner loop blocks while it
    // closes could only ever answer 10,000 (before) or 0 (after).
    struct Call {
        took: Duration,
        /// a1's live connections, as this status showed them.
        a1_left: i64,
        a1: String,
        b1: String,
    }
    let mut calls: Vec<Call> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (took, status) = timed_status(&daemon);
        let status = status.unwrap_or_else(|e| {
            panic!("lb status failed after {took:?}: {e}\n{}", log_since(&daemon, log_from))
        });
        let field = |service: &str, server: SocketAddr, name: &str| {
            server_field(&status, service, server, name)
        };
        let call = Call {
            took,
            a1_left: field("a", a1.addr, "connections").as_i64().unwrap(),
            a1: field("a", a1.addr, "state").as_str().unwrap_or("").to_owned(),
            b1: field("b", b1_addr, "state").as_str().unwrap_or("").to_owned(),
        };
        let done = call.a1_left == 0 && call.b1 == "failed" && a1.resets() == HELD;
        let (left, b1_state) = (call.a1_left, call.b1.clone());
        calls.push(call);
        if done {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after 60 s: status shows {left} connections left on a1, b1 {b1_state:?}; a1 saw {} resets\n{}",
            a1.resets(),
            log_since(&daemon, log_from)
        );
    }
    let closing_done = failed_at.elapsed();
    let slowest = calls.iter().map(|c| c.took).max().unwrap();
    let during: Vec<&Call> =
        calls.iter().filter(|c| c.a1_left > 0 && c.a1_left < HELD as i64).collect();
    let lefts: Vec<i64> = calls.iter().map(|c| c.a1_left).collect();
    eprintln!(
        "a1 failed its check; first reset seen after {closing_seen:?}, all {HELD} closed after {closing_done:?}. b1 killed with {resets_at_kill} \
         reset; b's next connect ({tries} tries) reached b2 with {resets_at_failover} reset. {} status calls (slowest {slowest:?}) showed a1 \
         with {lefts:?} connections; b1 failed in {} of the {} answered mid-closing",
        calls.len(),
        during.iter().filter(|c| c.b1 == "failed").count(),
        during.len()
    );
    assert!(slowest < ANSWERS_WITHIN, "an `lb status` took {slowest:?}");
    assert!(
        !during.is_empty(),
        "no `lb status` answered while a1's connections were being closed: it showed {lefts:?}"
    );
    assert!(
        during.iter().all(|c| c.a1 == "failed"),
        "a1 must show failed while its connections are closed"
    );
    assert!(
        during.iter().any(|c| c.b1 == "failed"),
        "the daemon did not fail b1 while a1's connections were being closed (b1 in those answers: {:?})",
        during.iter().map(|c| c.b1.as_str()).collect::<Vec<_>>()
    );
    assert!(resets_at_failover < HELD, "the closing was over before b failed over");

    // Every one of the 10,000 was reset: the client's sockets were aborted,
    // the server saw resets (no normal close), the metrics count them.
    let mut report = holder.held();
    assert!(wait_until(Duration::from_secs(10), || {
        report = holder.held();
        report.0 == 0
    }));
    let (alive, kinds) = report;
    eprintln!("the client's held connections: {alive} alive, dead: {kinds:?}");
    assert_eq!(kinds.values().sum::<usize>(), HELD);
    assert!(
        kinds.keys().all(|k| k == "connection_aborted" || k == "connection_reset"),
        "closed otherwise than by a reset: {kinds:?}"
    );
    assert_eq!((a1.resets(), a1.eofs(), a1.open()), (HELD, 0, 0));
    let closed = format!(
        "lb_connections_closed_total{{service=\"a\",server=\"{}\",reason=\"failed\"}}",
        a1.addr
    );
    let text = scrape(metrics).unwrap();
    assert_eq!(
        sample(&text, &closed),
        Some(HELD as f64),
        "{}",
        text.lines().filter(|l| l.contains("closed")).collect::<Vec<_>>().join("\n")
    );
    let log = log_since(&daemon, log_from);
    assert!(
        log.lines()
            .any(|l| l.contains("closed VIP connections") && l.contains(&format!("closed={HELD}"))),
        "{log}"
    );
    assert!(wait_until(Duration::from_secs(10), || daemon.connections("a", a1.addr) == 0));
    // a's traffic is on a2 now; b1 stays failed, b2 active.
    assert_eq!(inside.connect(a_vip).landed(), "a2");
    assert!(wait_until(Duration::from_secs(10), || state(&daemon, "b", b2.addr) == "active"));
    holder.release();
    drop(b2);
    eprintln!("test took {:?}", test_started.elapsed());
}

/// 2,000 idle connections to the metrics endpoint, kept open (each one the
/// daemon closes is opened again, as a hostile neighbour would) while a
/// check fails and recovers, `lb status` answers, and the active server is
/// killed: the next connects go to the other server and status shows it
/// failed. The daemon's descriptors stay within 200 of where they were: the
/// endpoint's connection limit works. Once the flood stops, scrapes work
/// again.
#[privileged_test]
fn two_thousand_idle_metrics_connections_stop_neither_checks_nor_status_nor_failover() {
    let _heavy = one_at_a_time();
    let test_started = Instant::now();
    const IDLE: usize = 2_000;
    assert!(
        raise_nofile(IDLE as u64 + 4096) > IDLE as u64 + 256,
        "RLIMIT_NOFILE too low for {IDLE} connections"
    );
    let net = 92;
    let cgroup = TestCgroup::new("metricsflood");
    let s1 = Backend::start("s1", addr(net, 1, 0));
    let s2 = Backend::start("s2", addr(net, 2, 0));
    let (vip, metrics) = (addr(net, 100, 6444), addr(net, 200, 9464));
    let config = service("api", vip, &[s1.addr, s2.addr]);
    let daemon =
        Daemon::start_with("metricsflood", &cgroup, &format!("metrics = \"{metrics}\"\n"), &config);
    assert!(
        wait_until(Duration::from_secs(15), || state(&daemon, "api", s1.addr) == "active"
            && in_healthy_class(&state(&daemon, "api", s2.addr))),
        "s1 was not elected:\n{}",
        daemon.log()
    );
    scrape(metrics).expect("a scrape before the flood");
    let pid = daemon.pid().expect("the daemon is running");
    let baseline = ProcSample::of(pid).expect("the daemon's /proc entry");

    // Watch the daemon's descriptors every 20 ms while the flood lasts.
    let (watching, most_fds) = (Arc::new(AtomicBool::new(true)), Arc::new(AtomicUsize::new(0)));
    let watcher = {
        let (watching, most_fds) = (watching.clone(), most_fds.clone());
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(120);
            while watching.load(Ordering::Relaxed) && Instant::now() < deadline {
                if let Some(s) = ProcSample::of(pid) {
                    most_fds.fetch_max(s.fds, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let flood_started = Instant::now();
    let flood = Flood::start(metrics, IDLE, Duration::from_millis(500), Duration::from_secs(90));
    assert!(
        wait_until(Duration::from_secs(30), || flood.opened.load(Ordering::Relaxed) >= IDLE),
        "the flood could not open {IDLE} connections"
    );

    let mut slowest = Duration::ZERO;
    let mut status_of = |server: SocketAddr| {
        let (took, status) = timed_status(&daemon);
        slowest = slowest.max(took);
        let status = status
            .unwrap_or_else(|e| panic!("lb status failed after {took:?} during the flood: {e}"));
        server_field(&status, "api", server, "state").as_str().unwrap_or("").to_owned()
    };
    // Checks keep running: s2's check fails, then passes again.
    s2.set_health(500);
    assert!(
        wait_until(Duration::from_secs(10), || status_of(s2.addr) == "failed"),
        "s2's failing check was not seen during the flood"
    );
    s2.set_health(200);
    assert!(
        wait_until(Duration::from_secs(10), || in_healthy_class(&status_of(s2.addr))),
        "s2's passing check was not seen during the flood"
    );

    // Failover: the active server is killed.
    let mut inside = Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(&cgroup));
    assert_eq!(inside.connect(vip).landed(), "s1");
    let s1_addr = s1.stop();
    let (landed, tries) = connect_after_a_kill(&mut inside, vip);
    assert_eq!(landed, "s2", "after s1 was killed, the next connect must reach s2");
    assert!(
        wait_until(Duration::from_secs(10), || status_of(s1_addr) == "failed"),
        "status never showed s1 failed during the flood"
    );
    assert!(
        wait_until(Duration::from_secs(10), || status_of(s2.addr) == "active"),
        "s2 was not elected during the flood"
    );
    for _ in 0..5 {
        assert_eq!(inside.connect(vip).landed(), "s2");
    }
    // The flood goes on past the endpoint's 5 s header timeout, so the
    // connections it let in are timed out and their slots taken again;
    // status keeps answering.
    while flood_started.elapsed() < Duration::from_secs(8) {
        assert_eq!(status_of(s2.addr), "active");
        std::thread::sleep(Duration::from_millis(200));
    }
    let opened_during = flood.opened.load(Ordering::Relaxed);

    let stats = flood.stop();
    watching.store(false, Ordering::Relaxed);
    watcher.join().unwrap();
    let most = most_fds.load(Ordering::Relaxed);
    eprintln!(
        "flood: {stats:?} ({opened_during} opened by the end of the checks); the daemon's fds: {} before, at most {most} during; \
         failover took {tries} tries; slowest status {slowest:?}",
        baseline.fds
    );
    assert!(stats.opened >= IDLE, "{stats:?}");
    assert!(stats.closed_by_peer > 0, "the daemon never closed a flood connection: {stats:?}");
    assert!(
        most < baseline.fds + 200,
        "the daemon's descriptors went from {} to {most}",
        baseline.fds
    );
    assert!(slowest < ANSWERS_WITHIN, "an `lb status` took {slowest:?} during the flood");

    // The endpoint serves again once the flood is gone, and it tells what
    // happened.
    let mut text = String::new();
    assert!(
        wait_until(Duration::from_secs(15), || scrape(metrics).map(|t| text = t).is_ok()),
        "no scrape worked within 15 s after the flood: {:?}",
        scrape(metrics)
    );
    let series =
        format!("lb_server_state{{service=\"api\",server=\"{s1_addr}\",state=\"failed\"}}");
    assert_eq!(sample(&text, &series), Some(1.0), "{text}");
    eprintln!("test took {:?}", test_started.elapsed());
}

/// The kernel's counters and live counts are exact under concurrency. Two
/// clients with four connecting threads each, on two CPUs, through one VIP
/// for three seconds: every connect made is counted once as rewritten,
/// established and closed, and the live counts return to zero. A per-CPU
/// slot is shared by every program that runs on its CPU (a preempted
/// connect4, sock_ops in softirq), so plain increments could lose one; the
/// programs add atomically.
#[privileged_test]
fn the_kernels_counts_match_what_happened_under_a_connect_storm() {
    let _heavy = one_at_a_time();
    let net = 93;
    let cgroup = TestCgroup::new("counts");
    let s1 = Backend::start("s1", addr(net, 1, 0));
    let s2 = Backend::start("s2", addr(net, 2, 0));
    let vip = addr(net, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[s1.addr, s2.addr])
        .policy(lb_tests::Policy::Spread)
        .toml();
    let daemon = Daemon::start("counts", &cgroup, &config);
    let storms: Vec<String> = std::thread::scope(|scope| {
        let storms: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    let mut inside =
                        Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(&cgroup));
                    let never = std::path::Path::new("/nonexistent/lb-test-stop");
                    inside.storm(vip, 4, Duration::from_secs(3), never)
                })
            })
            .collect();
        storms.into_iter().map(|s| s.join().unwrap()).collect()
    });
    let field = |storm: &str, name: &str| -> u64 {
        storm
            .split_whitespace()
            .find_map(|w| w.strip_prefix(name)?.parse().ok())
            .unwrap_or_else(|| panic!("storm: {storm}"))
    };
    let made: u64 = storms.iter().map(|s| field(s, "total=")).sum();
    let failed: u64 = storms.iter().map(|s| field(s, "failed=")).sum();
    eprintln!("{made} connects: {storms:?}");
    assert_eq!(failed, 0, "every connect to the healthy servers worked: {storms:?}");
    let maps = lb_user::datapath::PinnedMaps::open(&daemon.bpffs).unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || maps.tracked_sockets() == (0, 0)),
        "every connection closed, but the socket table holds {:?}",
        maps.tracked_sockets()
    );
    let counters = daemon.status()["datapath"]["counters"].clone();
    for reason in ["connect_rewritten", "sockops_established", "sockops_closed"] {
        assert_eq!(counters[reason].as_u64(), Some(made), "{reason} after {made} connects");
    }
    for server in [s1.addr, s2.addr] {
        assert_eq!(maps.connections(vip, server), 0, "live connections to {server}");
    }
}

/// A full TCP socket table degrades visibly and safely. With
/// `socket_table = 64`, 80 held connections: every connect is still
/// rewritten to the server, the ones beyond the table are counted, status
/// and metrics say the table is full, and the log says so once.
#[privileged_test]
fn a_full_socket_table_still_balances_and_says_so() {
    let _heavy = one_at_a_time();
    let net = 94;
    let cgroup = TestCgroup::new("fulltable");
    let s1 = Backend::start("s1", addr(net, 1, 0));
    let vip = addr(net, 100, 6444);
    let metrics = addr(net, 200, 9464);
    let config = ServiceBuilder::new("api", vip).servers(&[s1.addr]).toml();
    let daemon = Daemon::start_with(
        "fulltable",
        &cgroup,
        &format!("metrics = \"{metrics}\"\nsocket_table = 64\n"),
        &config,
    );
    let mut holder = Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(&cgroup));
    let held = holder.hold(vip, 80, 4);
    assert_eq!(
        (held.ok, held.names.get("s1").copied()),
        (80, Some(80)),
        "every connect reached the server through the VIP, tracked or not: {held:?}"
    );
    let status = daemon.status();
    let sockets = &status["datapath"]["tracked_sockets"];
    assert_eq!(
        (sockets["tcp"].as_u64(), sockets["tcp_capacity"].as_u64(), sockets["tcp_full"].as_bool()),
        (Some(64), Some(64), Some(true)),
        "status: {sockets}"
    );
    let untracked = status["datapath"]["counters"]["connect_untracked"].as_u64().unwrap_or(0);
    assert_eq!(untracked, 16, "the 16 connects beyond the table are counted");
    let text = scrape(metrics).unwrap();
    for line in [
        "lb_tracked_sockets{protocol=\"tcp\"} 64",
        "lb_tracked_sockets_capacity{protocol=\"tcp\"} 64",
    ] {
        assert!(text.contains(line), "metrics lack {line:?}:\n{text}");
    }
    let said = || daemon.log().matches("the TCP socket table is full").count();
    assert!(wait_until(Duration::from_secs(5), || said() == 1), "the log: {}", daemon.log());
    // More untracked connects within the minute: no second line.
    let more = holder.hold(vip, 10, 2);
    assert_eq!(more.ok, 10, "{more:?}");
    std::thread::sleep(Duration::from_millis(2_500));
    assert_eq!(said(), 1, "a full table is logged at most once a minute");

    holder.release();
    let maps = lb_user::datapath::PinnedMaps::open(&daemon.bpffs).unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || maps.tracked_sockets() == (0, 0)),
        "the table empties as the connections close: {:?}",
        maps.tracked_sockets()
    );
    assert_eq!(daemon.status()["datapath"]["tracked_sockets"]["tcp_full"], false);
}

/// A VIP's value is read whole. Two VIPs, each switching between two
/// servers of its own as fast as the control socket takes it (the daemon
/// writes one VIP, then the other), while 200 threads connect through both:
/// no connect lands on the other VIP's server. In a preallocated hash map a
/// replaced value goes back to the CPU's free list at once, and the next
/// write can reuse it while connect4 still reads it.
#[privileged_test]
fn a_vip_never_reads_another_vips_servers_while_both_change() {
    let _heavy = one_at_a_time();
    let net = 95;
    let cgroup = TestCgroup::new("whole");
    let servers: Vec<Backend> = ["a1", "a2", "b1", "b2"]
        .iter()
        .zip(1..)
        .map(|(name, host)| Backend::start(name, addr(net, host, 0)))
        .collect();
    let [a1, a2, b1, b2] = [0, 1, 2, 3].map(|i| servers[i].addr);
    let (vip_a, vip_b) = (addr(net, 100, 6444), addr(net, 101, 6444));
    let config = ServiceBuilder::new("a", vip_a).servers(&[a1, a2]).toml()
        + &ServiceBuilder::new("b", vip_b).servers(&[b1, b2]).toml();
    let daemon = Daemon::start("whole", &cgroup, &config);
    let (record, stop) = (daemon.dir.join("attempts"), daemon.dir.join("stop"));
    let mut client = Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(&cgroup));
    let chaos = {
        let (record, stop) = (record.clone(), stop.clone());
        std::thread::spawn(move || {
            client.chaos(&[vip_a, vip_b], 200, Duration::from_secs(90), &stop, &record)
        })
    };
    let socket = daemon.dir.join("lb.sock");
    let writes =
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(
            async {
                // 400 writes (about 3 s here), bounded by a minute on a
                // slow machine.
                let mut writes = 0;
                let until = Instant::now() + Duration::from_secs(60);
                let lists = [("a", a1), ("b", b1), ("a", a2), ("b", b2)];
                while writes < 400 && Instant::now() < until {
                    for (service, server) in lists {
                        let request = Request::SetServers {
                            service: service.to_owned(),
                            servers: vec![server],
                            default: None,
                        };
                        match lb_user::control::call(&socket, &request).await {
                            Ok(Response::Ok) => writes += 1,
                            other => panic!("lb servers {service} {server}: {other:?}"),
                        }
                    }
                }
                writes
            },
        );
    std::fs::write(&stop, b"").unwrap();
    let attempts = chaos.join().unwrap();
    let landed = |vip: usize| {
        attempts.iter().filter(move |a| a.vip == vip).filter_map(|a| match &a.outcome {
            Outcome::Server(name) => Some(name.clone()),
            _ => None,
        })
    };
    let (on_a, on_b) = (landed(0).count(), landed(1).count());
    eprintln!("{writes} writes, {} attempts, {on_a} + {on_b} answered", attempts.len());
    assert!(
        writes >= 400 && on_a > 0 && on_b > 0,
        "nothing to judge: {writes} writes, {on_a} + {on_b}"
    );
    let astray: Vec<String> = landed(0)
        .filter(|n| !n.starts_with('a'))
        .chain(landed(1).filter(|n| !n.starts_with('b')))
        .collect();
    assert!(astray.is_empty(), "connects landed on the other VIP's servers: {astray:?}");
}
