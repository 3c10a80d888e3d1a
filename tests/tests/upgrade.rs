//! Upgrades in place: a daemon that adopts pins whose programs are not its
//! own replaces every program with one atomic link update each, while 200
//! threads connect through the VIP in a loop, and every connect is
//! rewritten. Needs root; see `lb_tests::privileged`.
//!
//! A listener on the VIP's own address catches any connect that was not
//! rewritten (it would have been refused before; a refusal can also come
//! from elsewhere, a connect that lands on the trap cannot).
//!
//! 200 threads against one test backend on a loaded machine can overflow
//! its accept queue: a dropped SYN is retried after 1 s and 3 s, and a
//! connect can time out. Timeouts are printed and allowed; every other
//! failure (refused, reset, permission denied: a program that rejected the
//! connect) fails the test.

use std::{
    io::Write as _,
    net::TcpStream,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use lb_tests::{
    Backend, Client, Daemon, ServiceBuilder, TestCgroup, addr, in_new_netns, privileged_test,
    topology::{Topology, VIP4, carries_data, goes_the_short_way, who},
    wait_until,
};
use lb_user::datapath::{
    PinnedMaps, pinned_program_ids, programs_fingerprint, read_program_fingerprint,
};

const CLIENT: &str = env!("CARGO_BIN_EXE_lb-test-client");

fn client(cgroup: &TestCgroup) -> Client {
    Client::start(CLIENT, Some(cgroup))
}

/// Pins another lb made, the upgrade half (the refusal half:
/// `hardening.rs`): the pinned fingerprint says another build's programs
/// (the same object under a faked fingerprint). Before, adoption kept the
/// old programs.
#[privileged_test]
fn an_upgrade_replaces_the_programs_while_every_connect_is_rewritten() {
    let (_, _, added) = upgrade_under_a_storm("upgrade", 67, None, |daemon| {
        daemon.kill();
        // What an older lb's programs would look like to this one.
        lb_user::datapath::write_program_fingerprint(&daemon.bpffs, 0)
            .expect("writing the fingerprint");
    });
    assert_eq!(added, Vec::<&str>::new(), "same layout: no program to add");
}

/// A real upgrade. The previous version of lb (built from its commit by
/// `cargo xtask test`, `$LB_PREVIOUS_BIN`) runs with its own programs, and
/// is stopped as systemd stops it (SIGTERM); this version starts on its
/// pins. Its daemon adopts the previous one's maps and replaces the
/// previous programs under the storm. The previous version's pins are of
/// layout 10; the upgrade adds the maps of the established flows' short
/// way (`EPOCH`, `VIP_PORTS`; no cgroup program is new).
#[privileged_test]
fn an_upgrade_from_the_previous_version_keeps_every_connect_rewritten() {
    let Some(previous) = previous_bin() else { return };
    let (daemon, first, added) =
        upgrade_under_a_storm("upgrade-real", 74, Some(previous), |daemon| {
            daemon.signal(libc::SIGTERM);
            assert!(daemon.wait_exit(Duration::from_secs(10)), "the previous daemon did not stop");
        });
    assert_ne!(first, Some(programs_fingerprint()), "the previous version has this one's programs");
    assert_eq!(
        read_program_fingerprint(&daemon.bpffs).expect("reading the pinned fingerprint"),
        Some(programs_fingerprint()),
        "the pins do not say this version's programs"
    );
    assert_eq!(
        lb_user::datapath::read_layout_version(&daemon.bpffs).expect("reading the layout"),
        Some(lb_common::LAYOUT_VERSION)
    );
    assert_eq!(added, lb_common::programs::NEW_IN_LAYOUT, "{}", daemon.log());
    for map in lb_common::maps::NEW_IN_LAYOUT {
        assert!(
            daemon.bpffs.join("maps").join(map).exists(),
            "the upgrade did not add map {map}: {}",
            daemon.log()
        );
    }
    assert!(
        daemon.log().contains("added the maps and programs of this layout"),
        "{}",
        daemon.log()
    );
}

/// A real upgrade of the external path: a flow the previous version's
/// `lb_xdp` forwarded keeps its server and its NAT port under this
/// version's. A held TCP connection carries data after it, the short way
/// once the new programs have judged it (the daemon wrote the new maps);
/// a UDP flow's next datagram opens no new flow.
#[privileged_test]
fn an_upgrade_from_the_previous_version_keeps_external_flows() {
    let Some(previous) = previous_bin() else { return };
    in_new_netns(|| {
        let net = Topology::new();
        let _s1 = net.server("s1", "198.18.2.2:8080");
        let cgroup = TestCgroup::new("upgrade-external");
        let services = format!(
            "[[service]]\nname = \"web4\"\nvip = \"{VIP4}\"\nservers = [\"198.18.2.2:8080\"]\n\
             [service.health]\ncheck = \"none\"\n\
             [service.external]\ninterfaces = [\"ext0\"]\nannounce = \"none\"\n"
        );
        let mut daemon = Daemon::prepare("upgrade-external", &cgroup, "", &[], &services);
        daemon.use_bin(Some(previous));
        daemon.restart();
        assert!(
            net.wait_serving(VIP4, None),
            "the previous version's VIP never answered\n{}",
            daemon.log()
        );
        let held = net.connect(VIP4).expect("a connection through the VIP");
        assert_eq!(who(&held).as_deref(), Ok("s1"));
        let udp = net.client.run(|| {
            let socket = std::net::UdpSocket::bind("0.0.0.0:0").expect("a UDP socket");
            socket.connect(VIP4).expect("connecting the UDP socket");
            socket.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            socket
        });
        let ask = || {
            udp.send(b"who").map_err(|e| e.to_string())?;
            let mut buf = [0u8; 64];
            let n = udp.recv(&mut buf).map_err(|e| e.to_string())?;
            Ok::<_, String>(String::from_utf8_lossy(&buf[..n]).into_owned())
        };
        assert_eq!(ask().as_deref(), Ok("s1"), "UDP through the previous version");

        daemon.signal(libc::SIGTERM);
        assert!(daemon.wait_exit(Duration::from_secs(10)), "the previous daemon did not stop");
        // The held connection sends all along the upgrade: from the new
        // programs' first packet, before the daemon has written anything,
        // its segments must go on to s1, not be taken for a VIP's port
        // that is not served (answered with a reset).
        let streaming = keep_sending(&held);
        daemon.use_bin(None);
        daemon.restart();
        let sent = streaming.stop();
        assert!(
            matches!(sent, Ok(n) if n > 0),
            "the held connection, sending all along the upgrade: {sent:?}\n{}",
            daemon.log()
        );
        let opened = daemon.counter("xdp_new_flow");
        assert_eq!(ask().as_deref(), Ok("s1"), "UDP after the upgrade\n{}", daemon.log());
        assert_eq!(daemon.counter("xdp_new_flow"), opened, "the UDP flow opened anew");
        carries_data(&held).expect("the held connection after the upgrade");
        assert!(
            goes_the_short_way(&held, || daemon.counter("xdp_forwarded_short")),
            "no packet of the held connection went the short way\n{}",
            daemon.log()
        );
        drop(daemon);
        drop(cgroup);
    });
}

/// A thread writing a byte to `held` every millisecond (at most 20,000)
/// until stopped.
struct Sending {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<u32, String>>,
}

fn keep_sending(held: &TcpStream) -> Sending {
    let mut held = held.try_clone().expect("a second handle on the held connection");
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = Arc::clone(&stop);
    let thread = std::thread::spawn(move || {
        let mut sent = 0;
        while !stopped.load(Ordering::Relaxed) && sent < 20_000 {
            held.write_all(b".").map_err(|e| format!("writing after {sent} bytes: {e}"))?;
            sent += 1;
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(sent)
    });
    Sending { stop, thread }
}

impl Sending {
    /// How many bytes went, or the error that stopped it.
    fn stop(self) -> Result<u32, String> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().map_err(|_| "the sending thread panicked".to_owned())?
    }
}

/// The previous version of lb, or `None` (said) when there is none.
fn previous_bin() -> Option<PathBuf> {
    let previous = std::env::var_os("LB_PREVIOUS_BIN").map(PathBuf::from);
    if previous.is_none() {
        eprintln!(
            "SKIPPED: no previous version of lb ($LB_PREVIOUS_BIN; `cargo xtask test` builds it)"
        );
    }
    previous
}

/// Starts a daemon (`first`: the `lb` to start it with, else this
/// version's), starts a storm of 200 threads through its VIP, calls
/// `stop` to end that daemon, starts this version's on the same pins, and
/// checks that the programs were replaced with every connect rewritten and
/// that every connection left the kernel's tables. Returns the daemon,
/// the fingerprint the first daemon's programs were pinned with, and the
/// programs the replacement attached besides (new in this layout).
fn upgrade_under_a_storm(
    name: &str,
    net: u8,
    first: Option<PathBuf>,
    stop: impl FnOnce(&mut Daemon),
) -> (Daemon, Option<u64>, Vec<&'static str>) {
    let cgroup = TestCgroup::new(name);
    let s1 = Backend::start("s1", addr(net, 1, 0));
    let vip = addr(net, 100, 6444);
    let trap = Backend::start("unrewritten", vip);
    let services = ServiceBuilder::new("api", vip).servers(&[s1.addr]).toml();
    let mut daemon = Daemon::prepare(name, &cgroup, "", &[], &services);
    daemon.use_bin(first);
    daemon.restart();
    let before = pinned_program_ids(&daemon.bpffs).expect("reading the pinned links");
    assert!(before.len() >= 4, "{before:?}");
    let fingerprint = read_program_fingerprint(&daemon.bpffs).expect("reading the fingerprint");
    let stop_file = daemon.dir.join("stop-storm");

    let summary = std::thread::scope(|scope| {
        // The storm ends when this goes, on every path out of the scope.
        let _stop = StopFile(&stop_file);
        let storm =
            scope.spawn(|| client(&cgroup).storm(vip, 200, Duration::from_secs(120), &stop_file));
        assert!(
            wait_until(Duration::from_secs(30), || s1.accepted() > 200),
            "the storm did not start"
        );
        stop(&mut daemon);
        daemon.use_bin(None);
        daemon.restart();
        let replaced = s1.accepted();
        assert!(
            wait_until(Duration::from_secs(30), || s1.accepted() > replaced + 200),
            "the storm stopped after the replacement"
        );
        std::fs::write(&stop_file, "").unwrap();
        storm.join().expect("the storm client")
    });
    eprintln!("{summary}");
    let after = pinned_program_ids(&daemon.bpffs).expect("reading the pinned links");
    for (name, old) in &before {
        let new = after.iter().find(|(n, _)| n == name).map(|(_, id)| *id);
        assert!(new.is_some_and(|new| new != *old), "{name} was not replaced:\n{}", daemon.log());
    }
    let added: Vec<&'static str> = after
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !before.iter().any(|(b, _)| b == name))
        .collect();
    assert!(daemon.log().contains("replaced them"), "{}", daemon.log());
    let field = |name: &str| {
        summary
            .split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .unwrap_or_else(|| panic!("{summary}"))
            .to_owned()
    };
    assert_eq!(trap.accepted(), 0, "connects during the replacement were not rewritten: {summary}");
    assert!(!field("names=").contains("unrewritten"), "{summary}");
    let failed: usize = field("failed=").parse().unwrap();
    let succeeded: usize = field("names=").strip_prefix("s1:").map_or(0, |n| n.parse().unwrap());
    assert_eq!(succeeded + failed, field("total=").parse::<usize>().unwrap(), "{summary}");
    for error in field("errors=").split(',').filter(|e| !e.is_empty()) {
        assert!(
            error.contains(":TimedOut:") || error.contains(":WouldBlock:"),
            "a connect during the replacement failed other than by a timeout: {error} in {summary}"
        );
    }

    // Every connection of the storm, tracked by the old programs or the
    // new ones, left the socket table and the counts when it closed.
    let maps = PinnedMaps::open(&daemon.bpffs).expect("opening the pinned maps");
    let mut tracked = (usize::MAX, usize::MAX);
    assert!(
        wait_until(Duration::from_secs(10), || {
            tracked = maps.tracked_sockets();
            tracked == (0, 0)
        }),
        "the socket tables still hold (TCP, UDP) = {tracked:?} after the storm"
    );
    assert_eq!(daemon.connections("api", s1.addr), 0);
    // The replacing programs look every connecting socket up: sockets the
    // old ones tracked carry none of their marks.
    let before = daemon.counter("sockops_untracked");
    assert_eq!(client(&cgroup).churn("tcp", s1.addr, 20), (20, 0));
    assert_eq!(daemon.counter("sockops_untracked") - before, 20);
    (daemon, fingerprint, added)
}

/// Creates its file when dropped: tells a storm to stop.
struct StopFile<'a>(&'a Path);

impl Drop for StopFile<'_> {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0, "");
    }
}
