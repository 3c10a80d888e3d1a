//! Hardening, datapath side: a connect its application gave up on is no
//! server failure; released sockets leave the socket tables; the kernel
//! forgets removed servers; one daemon per set of pins; pins of another map
//! layout are refused (upgrades: `upgrade.rs`). Needs root; see
//! `lb_tests::privileged`.
//!
//! Every service here has the builder's default health setting, no checks:
//! servers are judged by the kernel's reports alone, so a false report
//! would show.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use lb_tests::{
    Backend, Client, Daemon, ServiceBuilder, TestCgroup, addr,
    hardening::{SlowToOne, run_to_exit},
    lb_bin, privileged_test, wait_until,
};
use lb_user::datapath::PinnedMaps;

const CLIENT: &str = env!("CARGO_BIN_EXE_lb-test-client");

/// Long enough that a failure mark is still "recent" when a test looks.
const HOLD_DOWN: Duration = Duration::from_secs(60);

/// Held by each test that cancels connects before their SYN's first
/// retransmission (1 s), so that no two of them starve each other's
/// client past that second. (The 200-thread storms of the upgrade tests
/// are in a test binary of their own, never run beside these.)
static QUIET: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn quiet() -> std::sync::MutexGuard<'static, ()> {
    QUIET.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn client(cgroup: &TestCgroup) -> Client {
    Client::start(CLIENT, Some(cgroup))
}

fn maps(daemon: &Daemon) -> PinnedMaps {
    PinnedMaps::open(&daemon.bpffs).unwrap_or_else(|e| {
        panic!("opening the pinned maps under {}: {e:#}", daemon.bpffs.display())
    })
}

/// A connect its application gave up on is no server failure: a healthy
/// server whose SYN-ACKs to one client never come, and that client cancels
/// 100 connects in SYN_SENT by closing them. Before, each cancelled connect
/// marked the server failed in the kernel (its next connects went
/// elsewhere) and reported a failed connect to the daemon.
#[privileged_test]
fn a_cancelled_connect_is_no_server_failure() {
    cancelled_connects_are_no_server_failure("close", 60);
}

/// As above, given up on by `shutdown(SHUT_RDWR)`. It went through
/// `tcp_disconnect`, which closes the socket like a reset would, and marked
/// the healthy server failed for the whole node.
#[privileged_test]
fn a_connect_shut_down_in_syn_sent_is_no_server_failure() {
    cancelled_connects_are_no_server_failure("shutdown", 69);
}

/// As above, given up on by `connect(AF_UNSPEC)`.
#[privileged_test]
fn a_connect_disconnected_in_syn_sent_is_no_server_failure() {
    cancelled_connects_are_no_server_failure("unspec", 70);
}

/// 100 connects to a healthy server whose SYN-ACKs to one client never
/// come, given up on by that client `how` (see `Client::cancel`), on the
/// test's addresses `addr(test, ..)`: no failure, and a real refusal still
/// is one.
fn cancelled_connects_are_no_server_failure(how: &str, test: u8) {
    let _quiet = quiet();
    let name = format!("cancel-{how}");
    let cgroup = TestCgroup::new(&name);
    let slow_client = Ipv4Addr::new(127, 77, test, 50);
    let s1 = SlowToOne::start("s1", addr(test, 1, 0), slow_client);
    let s2 = Backend::start("s2", addr(test, 2, 0));
    let vip = addr(test, 100, 6444);
    let config =
        ServiceBuilder::new("api", vip).servers(&[s1.addr, s2.addr]).hold_down(HOLD_DOWN).toml();
    let daemon = Daemon::start(&name, &cgroup, &config);
    let mut inside = client(&cgroup);

    let held = inside.connect(vip);
    assert_eq!(
        (held.landed(), held.peer()),
        ("s1", vip),
        "the held connection goes to s1 and shows the VIP"
    );
    assert!(
        s1.slow_client_is_ignored(),
        "the setup: SYNs from {slow_client} to s1 must go unanswered"
    );
    let state = daemon.server_field(s1.addr, "state");

    let syn_sent = inside.cancel(vip, IpAddr::V4(slow_client), 100, Duration::from_millis(50), how);
    // Whatever the kernel reported, the daemon has read it by now.
    std::thread::sleep(Duration::from_millis(500));

    let reported =
        ["sockops_connect_failed", "sockops_connect_timeout"].map(|r| (r, daemon.counter(r)));
    assert_eq!(
        daemon.server_field(s1.addr, "recently_failed"),
        false,
        "a cancelled connect marked s1 failed in the kernel: {reported:?}"
    );
    assert!(
        !maps(&daemon).failure_marks().contains(&s1.addr),
        "a cancelled connect left a failure mark for s1 in FAILED_AT"
    );
    // (A mark would have sent the next connects to s2, where they establish.)
    assert_eq!(syn_sent, 100, "every connect went to s1 and was given up on in SYN_SENT");
    assert_eq!(
        daemon.server_field(s1.addr, "state"),
        state,
        "s1's state changed:\n{}",
        daemon.log()
    );
    assert!(inside.alive(held.id()), "the held connection to s1 was closed");
    assert_eq!(
        daemon.counter("sockops_connect_failed"),
        0,
        "a cancelled connect was reported as failed"
    );
    assert_eq!(daemon.counter("sockops_connect_timeout"), 0);
    // A close marks the socket at its release; a shutdown or a disconnect
    // closes it first, told apart by the SYN still queued.
    let reasons: &[&str] = if how == "close" {
        &["release_cancelled", "sockops_cancelled"]
    } else {
        &["sockops_cancelled"]
    };
    for reason in reasons {
        assert!(daemon.counter(reason) >= 100, "{reason}: {}", daemon.counter(reason));
    }
    assert_eq!(inside.once(vip).as_deref(), Ok("s1"), "new connects still go to s1");

    // A real refusal still moves the very next connect, in the kernel.
    let s1 = s1.stop();
    let refused = inside.once(vip);
    assert!(
        refused.as_ref().is_err_and(|e| e.contains("refused")),
        "the connect to the stopped s1: {refused:?}"
    );
    let after_refusal = Instant::now();
    assert_eq!(inside.once(vip).as_deref(), Ok("s2"), "the connect right after the refusal");
    eprintln!("the connect after the refusal landed on s2 {:?} later", after_refusal.elapsed());
    assert!(maps(&daemon).failure_marks().contains(&s1), "the refusal marked s1 failed");
    assert_eq!(daemon.server_field(s1, "recently_failed"), true);
}

/// Connects that fail on the spot, after connect6 rewrote them (an
/// IPv6-only socket dialling the IPv4 VIP IPv4-mapped: `ENETUNREACH`),
/// leave nothing in the socket table while their sockets stay open. Before,
/// each held an entry until its close, and 65,536 of them left every later
/// connect on the node untracked.
#[privileged_test]
fn connects_that_fail_on_the_spot_hold_no_socket_table_entry() {
    let cgroup = TestCgroup::new("failfast");
    let s1 = Backend::start("s1", addr(71, 1, 0));
    let vip = addr(71, 100, 6444);
    let config = ServiceBuilder::new("api", vip).servers(&[s1.addr]).toml();
    let daemon = Daemon::start("failfast", &cgroup, &config);
    let mut inside = client(&cgroup);
    let n = 2_000;
    assert_eq!(inside.failfast(vip, n), n, "each connect failed on the spot with ENETUNREACH");
    assert!(daemon.counter("connect_rewritten") >= n as u64, "connect6 rewrote each first");
    let held = inside.connect(vip);
    assert_eq!((held.landed(), held.peer()), ("s1", vip), "a real connect is still tracked");
    assert_eq!(
        maps(&daemon).tracked_sockets(),
        (1, 0),
        "the socket table holds only the real connection, with {n} failed sockets open"
    );
    inside.unstick();
    assert!(maps(&daemon).failure_marks().is_empty(), "no failure mark for s1");
    assert_eq!(daemon.counter("sockops_connect_failed"), 0);
}

/// A socket whose connect to the VIP failed on the spot, reused to connect
/// elsewhere, is not taken for the VIP's. Before, its leftover entry made a
/// refused connect to the user's own port mark the VIP's server failed, and
/// a connect to the user's own listener lift a real failure mark (and
/// report a recovery).
#[privileged_test]
fn a_socket_reused_after_a_connect_that_failed_on_the_spot_is_not_the_vips() {
    let cgroup = TestCgroup::new("reuse");
    let s1 = Backend::start("s1", addr(72, 1, 0));
    let vip = addr(72, 100, 6444);
    let config = ServiceBuilder::new("api", vip).servers(&[s1.addr]).hold_down(HOLD_DOWN).toml();
    let daemon = Daemon::start("reuse", &cgroup, &config);
    let mut inside = client(&cgroup);

    let closed_port = std::net::TcpListener::bind("[::1]:0").unwrap().local_addr().unwrap();
    assert_eq!(inside.reuse(vip, closed_port), "ConnectionRefused", "the setup: {closed_port}");
    // Whatever the kernel reported, the daemon has read it by now.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !maps(&daemon).failure_marks().contains(&s1.addr),
        "a refused connect to {closed_port} marked the VIP's server failed"
    );
    assert_eq!(daemon.server_field(s1.addr, "recently_failed"), false);
    assert_eq!(daemon.counter("sockops_connect_failed"), 0);

    // A real failure of s1 (the only server: connects still go to it).
    let s1 = s1.stop();
    assert!(inside.once(vip).is_err_and(|e| e.contains("refused")), "s1 is down");
    assert!(maps(&daemon).failure_marks().contains(&s1), "the refusal marked s1 failed");
    let own = std::net::TcpListener::bind("[::1]:0").unwrap();
    assert_eq!(inside.reuse(vip, own.local_addr().unwrap()), "ok", "the setup: own listener");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        maps(&daemon).failure_marks().contains(&s1),
        "a connect to the user's own listener lifted s1's failure mark"
    );
    assert_eq!(daemon.server_field(s1, "recently_failed"), true, "{}", daemon.log());
}

/// A `TCP_FASTOPEN_CONNECT` socket is in SYN_SENT after its connect, with
/// no SYN sent and no sock_ops callback asked for; closed before its first
/// write, it must still leave `SOCKETS` (it stayed there for good), and it
/// is no failure of the server.
#[privileged_test]
fn fast_open_sockets_closed_before_a_write_leave_the_socket_table() {
    let cgroup = TestCgroup::new("tfo");
    let s1 = Backend::start("s1", addr(62, 1, 0));
    let vip = addr(62, 100, 6444);
    // The client's fast-open sockets are in a network namespace of their
    // own (see `Client::fastopen`).
    let service = ServiceBuilder::new("api", vip).servers(&[s1.addr]).raw("scope = \"all\"");
    let daemon = Daemon::start("tfo", &cgroup, &service.toml());
    let mut inside = client(&cgroup);
    let n = 200;
    assert_eq!(inside.fastopen(vip, n), n, "precondition: each socket was in SYN_SENT at close");
    let mut tracked = (usize::MAX, usize::MAX);
    assert!(
        wait_until(Duration::from_secs(5), || {
            tracked = maps(&daemon).tracked_sockets();
            tracked == (0, 0)
        }),
        "the socket tables hold (TCP, UDP) = {tracked:?} after {n} fast-open sockets closed"
    );
    assert!(maps(&daemon).failure_marks().is_empty(), "no failure mark for s1");
    assert_eq!(daemon.status()["services"][0]["servers"][0]["state"], "active", "not failed");
    assert!(daemon.counter("release_cancelled") >= n as u64, "each left at its release");
    assert_eq!(inside.connect(vip).landed(), "s1");
}

/// A churn of connected-UDP and TCP sockets through a VIP leaves the socket
/// tables holding exactly the live sockets, and a held connection is still
/// counted, still shows the VIP, and can still be closed. Before, UDP
/// sockets stayed in the (LRU) table until evicted.
#[privileged_test]
fn released_sockets_leave_the_socket_table() {
    let cgroup = TestCgroup::new("churn");
    let s1 = Backend::start("s1", addr(61, 1, 0));
    let vip = addr(61, 100, 6444);
    let daemon = Daemon::start(
        "churn",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[s1.addr]).toml(),
    );
    let mut inside = client(&cgroup);

    let held = inside.connect(vip);
    assert_eq!(held.landed(), "s1");
    assert_eq!(inside.churn("udp", vip, 2000), (2000, 0), "connected UDP through the VIP");
    assert_eq!(inside.churn("tcp", vip, 500), (500, 0), "TCP through the VIP");

    let mut tracked = (usize::MAX, usize::MAX);
    assert!(
        wait_until(Duration::from_secs(10), || {
            tracked = maps(&daemon).tracked_sockets();
            tracked == (1, 0)
        }),
        "the socket tables hold (TCP, UDP) = {tracked:?}; live: one TCP connection"
    );
    assert!(daemon.counter("release_udp") >= 2000);
    assert_eq!(daemon.counter("connect_untracked") + daemon.counter("connect_untracked_udp"), 0);

    assert_eq!(daemon.connections("api", s1.addr), 1, "the held connection is still counted");
    assert_eq!(inside.peer(held.id()), vip, "getpeername still shows the VIP");
    if !daemon.has_feature("sock_destroy") {
        return;
    }
    let closed = daemon.lb(&["close-connections", &s1.addr.to_string()]);
    assert!(
        wait_until(Duration::from_secs(5), || !inside.alive(held.id())),
        "lb close-connections did not close the held connection: {closed}"
    );
    assert!(
        wait_until(Duration::from_secs(5), || maps(&daemon).tracked_sockets() == (0, 0)),
        "{:?}",
        maps(&daemon).tracked_sockets()
    );
    assert!(wait_until(Duration::from_secs(5), || daemon.connections("api", s1.addr) == 0));
}

/// Fewer sock_ops lookups: connect4 marks each TCP socket it tracks (a
/// sock_ops callback flag, set with `bpf_setsockopt`, Linux 6.12+), so that
/// sock_ops looks up no other connecting socket of the cgroup. An older
/// kernel refuses the mark; then every connecting socket is looked up, as
/// before. Tracking is the same either way.
#[privileged_test]
fn sock_ops_looks_up_only_the_sockets_connect4_marked() {
    let cgroup = TestCgroup::new("marks");
    let s1 = Backend::start("s1", addr(68, 1, 0));
    let vip = addr(68, 100, 6444);
    let daemon = Daemon::start(
        "marks",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[s1.addr]).toml(),
    );
    let mut inside = client(&cgroup);

    // Through the VIP first: on an older kernel this connect is where the
    // programs find out that they cannot mark.
    let held = inside.connect(vip);
    assert_eq!(held.landed(), "s1");
    assert!(
        wait_until(Duration::from_secs(5), || daemon.connections("api", s1.addr) == 1),
        "the connection through the VIP is counted"
    );

    let before = daemon.counter("sockops_untracked");
    assert_eq!(inside.churn("tcp", s1.addr, 50), (50, 0), "straight to the server");
    let looked_up = daemon.counter("sockops_untracked") - before;
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap().trim().to_owned();
    let version: Vec<u32> =
        release.split(['.', '-']).take(2).map(|n| n.parse().unwrap_or(0)).collect();
    if version >= vec![6, 12] {
        assert_eq!(looked_up, 0, "Linux {release}: connects not to a VIP were looked up");
    } else {
        assert_eq!(looked_up, 50, "Linux {release}: every connect is looked up without marks");
    }

    assert_eq!(daemon.connections("api", s1.addr), 1, "the held connection is still counted");
    assert_eq!(inside.peer(held.id()), vip, "getpeername still shows the VIP");
    inside.close(held.id());
    assert!(
        wait_until(Duration::from_secs(5), || daemon.connections("api", s1.addr) == 0),
        "its close is counted"
    );
    assert_eq!(maps(&daemon).tracked_sockets(), (0, 0));
}

/// Forgetting removed servers, the API the daemon calls: `forget` removes
/// the failure mark of a server in no service and the count of a pair no
/// longer configured once it has no live connection; a pair with live
/// connections keeps its count.
#[privileged_test]
fn forget_removes_what_the_kernel_keeps_about_removed_servers() {
    let cgroup = TestCgroup::new("forget");
    let s1 = Backend::start("s1", addr(63, 1, 0));
    let s2 = Backend::start("s2", addr(63, 2, 0));
    let vip = addr(63, 100, 6444);
    let daemon = Daemon::start(
        "forget",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[s1.addr, s2.addr]).hold_down(HOLD_DOWN).toml(),
    );
    let mut inside = client(&cgroup);
    assert_eq!(inside.once(vip).as_deref(), Ok("s1"));
    let s1 = s1.stop();
    assert!(inside.once(vip).is_err(), "the connect that reveals the stopped s1");
    let held = inside.connect(vip);
    assert_eq!(held.landed(), "s2");

    let mut maps = maps(&daemon);
    assert!(maps.failure_marks().contains(&s1));
    assert!(
        wait_until(Duration::from_secs(5), || maps.connection_counts().contains(&(vip, s1, 0))),
        "{:?}",
        maps.connection_counts()
    );
    daemon.lb(&["servers", "api", &s2.addr.to_string()]);
    assert!(wait_until(Duration::from_secs(5), || daemon.status()["services"][0]["selected"]
        == serde_json::json!([s2.addr.to_string()])));

    let forgotten = maps.forget(&[(vip, vec![s2.addr])]).expect("forget");
    eprintln!("forget: {forgotten:?}");
    assert!(!maps.failure_marks().contains(&s1), "s1 is in no service: its failure mark must go");
    assert_eq!(
        maps.connection_counts(),
        vec![(vip, s2.addr, 1)],
        "s1's zero count must go; s2's stays"
    );

    // Not configured, but with a live connection: the count stays.
    maps.forget(&[]).expect("forget");
    assert_eq!(maps.connection_counts(), vec![(vip, s2.addr, 1)]);
    assert!(inside.alive(held.id()));
}

/// Forgetting removed servers, end to end: the daemon forgets a server
/// removed with `lb servers` (the daemon calls `Datapath::forget` after
/// every change of its server lists: `lb servers`, reloads, discovered
/// lists).
#[privileged_test]
fn removing_a_server_forgets_its_failure_mark() {
    let cgroup = TestCgroup::new("forgetd");
    let s1 = Backend::start("s1", addr(64, 1, 0));
    let s2 = Backend::start("s2", addr(64, 2, 0));
    let vip = addr(64, 100, 6444);
    let daemon = Daemon::start(
        "forgetd",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[s1.addr, s2.addr]).hold_down(HOLD_DOWN).toml(),
    );
    let mut inside = client(&cgroup);
    assert_eq!(inside.once(vip).as_deref(), Ok("s1"));
    let s1 = s1.stop();
    assert!(inside.once(vip).is_err());
    assert_eq!(inside.once(vip).as_deref(), Ok("s2"));
    assert!(maps(&daemon).failure_marks().contains(&s1));

    daemon.lb(&["servers", "api", &s2.addr.to_string()]);
    assert!(
        wait_until(Duration::from_secs(5), || {
            let maps = maps(&daemon);
            !maps.failure_marks().contains(&s1)
                && !maps.connection_counts().iter().any(|(_, server, _)| *server == s1)
        }),
        "the removed server's FAILED_AT mark or CONNECTIONS count stayed: {:?} {:?}",
        maps(&daemon).failure_marks(),
        maps(&daemon).connection_counts()
    );
}

/// One daemon per set of pins: a second daemon with its own control socket
/// but the same pins exits, naming the first; the first keeps working.
/// Before, the second adopted the pins and both ran.
#[privileged_test]
fn a_second_daemon_on_the_same_pins_exits_naming_the_first() {
    let cgroup = TestCgroup::new("twodaemons");
    let s1 = Backend::start("s1", addr(65, 1, 0));
    let vip = addr(65, 100, 6444);
    let daemon = Daemon::start(
        "twodaemons",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[s1.addr]).toml(),
    );
    let first = daemon.pid().expect("the first daemon runs");

    let text = std::fs::read_to_string(&daemon.config).unwrap();
    let second = daemon.dir.join("second.toml");
    let second_text = text.replace("lb.sock", "second.sock").replace("/state\"", "/second-state\"");
    assert_ne!(second_text, text);
    std::fs::write(&second, second_text).unwrap();
    let (status, output) = run_to_exit(&lb_bin(), &second, Duration::from_secs(30));
    let status = status.unwrap_or_else(|| {
        panic!("the second daemon kept running on the first one's pins:\n{output}")
    });
    assert!(!status.success(), "the second daemon exited with {status}:\n{output}");
    assert!(
        output.contains(&format!("pid {first}")),
        "the message must name the first daemon (pid {first}):\n{output}"
    );
    assert!(
        output.contains(&daemon.bpffs.display().to_string()),
        "the message must name the pins:\n{output}"
    );

    let mut inside = client(&cgroup);
    assert_eq!(inside.once(vip).as_deref(), Ok("s1"), "the first daemon's datapath keeps working");
    assert_eq!(
        daemon.status()["services"][0]["selected"],
        serde_json::json!([s1.addr.to_string()]),
        "and the first daemon answers"
    );
}

/// Pins another lb made, the refusal half (the upgrade half: `upgrade.rs`):
/// pins without the layout version this lb writes (an older lb's) are
/// refused with a message naming `lb detach`, and left working; after
/// `lb detach` the daemon starts.
#[privileged_test]
fn pins_of_another_layout_are_refused_naming_lb_detach() {
    let cgroup = TestCgroup::new("layout");
    let s1 = Backend::start("s1", addr(66, 1, 0));
    let vip = addr(66, 100, 6444);
    let mut daemon = Daemon::start(
        "layout",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[s1.addr]).toml(),
    );
    daemon.kill();
    let meta = daemon.bpffs.join("maps/META");
    std::fs::remove_file(&meta).unwrap_or_else(|e| panic!("removing {}: {e}", meta.display()));

    let (status, output) = run_to_exit(&lb_bin(), &daemon.config, Duration::from_secs(30));
    let status =
        status.unwrap_or_else(|| panic!("the daemon adopted pins of another layout:\n{output}"));
    assert!(!status.success());
    assert!(
        output.contains("layout") && output.contains("lb detach"),
        "the message must say why and what to run:\n{output}"
    );
    let mut inside = client(&cgroup);
    assert_eq!(inside.once(vip).as_deref(), Ok("s1"), "the refused pins were left working");

    daemon.lb(&["detach"]);
    daemon.restart();
    assert_eq!(inside.once(vip).as_deref(), Ok("s1"), "after lb detach, a fresh attach");
}
