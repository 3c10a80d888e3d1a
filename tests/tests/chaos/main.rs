//! Chaos: 200 client threads connect through two VIPs
//! in a loop while the daemon is SIGKILLed and restarted every 2 s, the
//! config is reloaded every second, and servers are killed (listener
//! closed: connects refused) and restored, never all at once. Needs root;
//! see `lb_tests::privileged`.
//!
//! What must hold, from the design: fail-static (the pinned datapath keeps
//! serving while the daemon is dead; every restarted daemon adopts), the
//! kernel steers off a server at its first refused connect (so a kill costs
//! at most the connects already in flight to it), every connection lands
//! on a server that is alive and in the VIP's list, no daemon panics, and
//! nothing leaks across restarts.
//!
//! `LB_CHAOS_KEEP_LOG=FILE` copies the daemons' log (every restart appends
//! to it) to FILE before the verdict, to read after a failure.

use std::{
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use lb_tests::{
    Check, Client, Daemon, Policy, ServiceBuilder, TestCgroup, addr, files_under,
    hold_backend::HoldBackend,
    load::{Attempt, Outcome, ProcSample, log_len, log_since, panics},
    monotonic_ns, privileged_test, wait_until,
};

mod judge;

use self::judge::{judge, unexplained_failures};

/// This file's loopback range: 127.77.90.0/24.
const NET: u8 = 90;

/// How long the chaos runs, and the client threads.
const CHAOS_FOR: Duration = Duration::from_secs(34);
const THREADS: usize = 200;

/// The most connects one kill may fail. Why this bound holds, from the
/// design: the kernel marks the server failed (`FAILED_AT`) when the first
/// connect to it is refused, before that connect returns, and from then on
/// connect4 skips it; so only connects that had already been sent to it
/// (past connect4, their RST not yet processed) can be refused too. On
/// loopback the RST is processed inside the connecting thread's own
/// syscall, so those are the connects in flight on the CPUs at that
/// instant, plus the few threads preempted inside that window: a couple
/// per CPU. (`judge` also checks the stronger, timing-free form: no
/// refused connect began after the first refusal had returned.) The
/// backend's kill serves every connection already in its accept queue
/// before it closes the listener, so resets (or aborts, when the daemon
/// closes the dead server's connections) can only hit connects that were
/// connected to it before it died and had no greeting yet: the few that
/// reached the queue after its last accept, or had not been greeted, in
/// the last microseconds (`connect` itself reports the reset when the
/// connecting thread had not run since the handshake). Four per CPU, at least 8: 200 threads share 4
/// (spread) or 1 (failover) servers, so a kernel that kept sending to a
/// dead server, or a daemon that sent traffic back to it, goes far past it.
fn max_failed_per_kill() -> usize {
    (4 * std::thread::available_parallelism().map_or(2, usize::from)).max(8)
}

/// How old each daemon is when its fds and memory are sampled.
const SAMPLE_AT_AGE: Duration = Duration::from_millis(1000);

#[derive(Clone, Copy, Debug)]
enum Action {
    /// SIGKILL the daemon, do `between` (if any) while it is dead, start it again.
    Restart {
        between: Option<ServerAction>,
    },
    /// Rewrite the config (the other variant) and reload it.
    Reload,
    Server(ServerAction),
}

#[derive(Clone, Copy, Debug)]
enum ServerAction {
    /// Close server `i`'s listener: connects to it are refused.
    Kill(usize),
    /// Listen again on server `i`'s address.
    Restore(usize),
}

/// A kill, for judging the failed connects after it.
#[derive(Debug)]
struct Kill {
    server: usize,
    /// CLOCK_MONOTONIC when the kill began, when the listener was closed
    /// (at the latest), and when the server listened again (`u64::MAX`
    /// until then).
    began: u64,
    closed: u64,
    restored: u64,
    daemon_down: bool,
}

const NAMES: [&str; 5] = ["s1", "s2", "s3", "s4", "s5"];
/// Servers (indexes) of each VIP: the spread VIP uses s1..s4; the failover
/// VIP s5, s4, s3 and, in config variant 0 only, s2.
const SPREAD: [usize; 4] = [0, 1, 2, 3];
const FAILOVER: [usize; 4] = [4, 3, 2, 1];
const S2: usize = 1;

fn http(interval_ms: u64) -> Check {
    Check::Http { path: "/readyz", interval: Duration::from_millis(interval_ms) }
}

/// Every service fails a server after 3 failing checks in a row: on this
/// loaded 2-CPU machine one check can time out without anything being
/// wrong, and a healthy server failed by mistake would have its VIP
/// connections closed (aborting connects in flight). A kernel report of a
/// refused connect is still confirmed by the first failing check.
const FALL: u32 = 3;

/// The two configs a reload alternates between. Variant 1 changes what a
/// reload can change without closing a connection that clients use: the
/// spread service's hold-down and check interval (its check tasks
/// restart), the failover service's check (tcp instead of http) and list
/// (s2, its last server, which has no connections, leaves), and an extra
/// service appears.
fn config(variant: usize, addrs: &[SocketAddr], vips: &[SocketAddr; 3]) -> String {
    let pick = |list: &[usize]| list.iter().map(|i| addrs[*i]).collect::<Vec<_>>();
    let spread = ServiceBuilder::new("spread", vips[0])
        .servers(&pick(&SPREAD))
        .policy(Policy::Spread)
        .fall(FALL);
    let failover =
        ServiceBuilder::new("failover", vips[1]).hold_down(Duration::from_secs(5)).fall(FALL);
    if variant == 0 {
        spread.hold_down(Duration::from_secs(5)).check(http(300)).toml()
            + &failover.servers(&pick(&FAILOVER)).check(http(300)).toml()
    } else {
        spread.hold_down(Duration::from_secs(4)).check(http(400)).toml()
            + &failover
                .servers(&pick(&FAILOVER[..3]))
                .check(Check::Tcp { interval: Duration::from_millis(300) })
                .toml()
            + &ServiceBuilder::new("extra", vips[2]).servers(&[addrs[0]]).toml()
    }
}

/// The plan, in seconds from the start of the chaos: restarts every 2 s,
/// reloads every second (between the restarts), and kills and restores:
/// one at a time, two at once (s3 and s1), one kill and one restore while
/// the daemon is dead, and one outage (s3, 8.3 s) longer than the
/// hold-down (at most 5 s), with restarts during it (at 22, 24, 26 and 28
/// s) also after the kernel's failure mark has expired, so that only the
/// adopted selection (the dead server last) keeps connects off it.
fn plan() -> Vec<(f64, Action)> {
    use Action::{Reload, Restart, Server};
    use ServerAction::{Kill, Restore};
    let mut plan: Vec<(f64, Action)> = Vec::new();
    for s in (2..=32).step_by(2) {
        let between = match s {
            16 => Some(Kill(1)),
            28 => Some(Kill(4)),
            30 => Some(Restore(4)),
            _ => None,
        };
        plan.push((f64::from(s), Restart { between }));
    }
    for s in 0..34 {
        plan.push((f64::from(s) + 0.5, Reload));
    }
    for (at, action) in [
        (3.0, Kill(0)),
        (6.0, Restore(0)),
        (7.1, Kill(4)),
        (10.1, Restore(4)),
        (11.2, Kill(3)),
        (14.1, Restore(3)),
        (19.1, Restore(1)),
        (21.3, Kill(2)),
        (23.0, Kill(0)),
        (25.7, Restore(0)),
        (29.6, Restore(2)),
        (31.1, Kill(1)),
        (33.2, Restore(1)),
    ] {
        plan.push((at, Server(action)));
    }
    plan.sort_by(|a, b| a.0.total_cmp(&b.0));
    plan
}

/// Everything the test did, with CLOCK_MONOTONIC times, to judge the
/// client's record and the daemon log against.
#[derive(Default)]
struct Log {
    kills: Vec<Kill>,
    /// Intervals in which s2 was certainly out of the failover list: from
    /// an acknowledged reload to variant 1 until the next reload was sent.
    s2_out: Vec<(u64, u64)>,
    /// When s2 was put back into the failover list (reloads to variant 0 sent).
    s2_added: Vec<u64>,
    /// (SIGKILL, restarted) of each restart: the daemon was dead in between.
    restarts: Vec<(u64, u64)>,
    reloads: usize,
    /// What happened when, for the report.
    events: Vec<(u64, String)>,
    samples: Vec<ProcSample>,
}

struct Servers {
    backends: Vec<Option<HoldBackend>>,
    addrs: Vec<SocketAddr>,
}

impl Servers {
    fn act(&mut self, action: ServerAction, log: &mut Log, daemon_down: bool) {
        match action {
            ServerAction::Kill(i) => {
                let backend = self.backends[i]
                    .take()
                    .unwrap_or_else(|| panic!("{} is already down", NAMES[i]));
                let began = monotonic_ns();
                let (_, closed) = backend.kill();
                log.kills.push(Kill { server: i, began, closed, restored: u64::MAX, daemon_down });
                log.events.push((
                    began,
                    format!("kill {}{}", NAMES[i], if daemon_down { " (daemon dead)" } else { "" }),
                ));
                let up = |list: &[usize]| list.iter().any(|j| self.backends[*j].is_some());
                assert!(
                    up(&SPREAD) && up(&FAILOVER[..3]),
                    "the plan must never kill every server of a VIP"
                );
            }
            ServerAction::Restore(i) => {
                assert!(self.backends[i].is_none(), "{} is not down", NAMES[i]);
                let now = monotonic_ns();
                log.kills.iter_mut().rev().find(|k| k.server == i).unwrap().restored = now;
                log.events.push((now, format!("restore {}", NAMES[i])));
                self.backends[i] = Some(HoldBackend::start(NAMES[i], self.addrs[i]));
            }
        }
    }
}

#[privileged_test]
fn chaos_restarts_reloads_and_server_kills_under_200_connecting_threads() {
    let test_started = Instant::now();
    let cgroup = TestCgroup::new("chaos");
    let mut servers = Servers { backends: Vec::new(), addrs: Vec::new() };
    for (i, name) in NAMES.iter().enumerate() {
        let backend = HoldBackend::start(name, addr(NET, i as u8 + 1, 0));
        servers.addrs.push(backend.addr);
        servers.backends.push(Some(backend));
    }
    let addrs = servers.addrs.clone();
    let vips = [addr(NET, 100, 6444), addr(NET, 101, 6444), addr(NET, 102, 6444)];
    let mut daemon = Daemon::start("chaos", &cgroup, &config(0, &addrs, &vips));
    let pins = files_under(&daemon.bpffs);
    assert!(!pins.is_empty(), "nothing pinned under {}", daemon.bpffs.display());
    // Every server checked before the chaos starts.
    assert!(
        wait_until(Duration::from_secs(10), || {
            let status = daemon.status();
            status["services"].as_array().unwrap().iter().all(|s| {
                s["servers"].as_array().unwrap().iter().all(|s| {
                    matches!(s["state"].as_str(), Some("active" | "preferred" | "healthy"))
                })
            })
        }),
        "servers were not all checked:\n{}",
        daemon.log()
    );

    let record = daemon.dir.join("attempts");
    let stop_file = daemon.dir.join("stop");
    let mut client = Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(&cgroup));
    let client_pid = client.pid();
    let chaos = {
        let (record, stop_file) = (record.clone(), stop_file.clone());
        std::thread::spawn(move || {
            client.chaos(
                &vips[..2],
                THREADS,
                CHAOS_FOR + Duration::from_secs(20),
                &stop_file,
                &record,
            )
        })
    };

    let mut log = Log::default();
    let t0 = Instant::now();
    log.events.push((monotonic_ns(), "chaos started".to_owned()));
    let mut variant = 0;
    let mut out_since: Option<u64> = None;
    let mut started_at = Instant::now();
    let mut sampled = true; // the first daemon's age differs: not compared
    for (at, action) in plan() {
        let at = Duration::from_secs_f64(at);
        // Wait for the planned time; meanwhile sample the daemon at its age.
        loop {
            if !sampled && started_at.elapsed() >= SAMPLE_AT_AGE {
                let pid = daemon.pid().expect("the daemon is running");
                log.samples.push(ProcSample::of(pid).expect("the daemon's /proc entry"));
                sampled = true;
            }
            let now = t0.elapsed();
            if now >= at {
                break;
            }
            std::thread::sleep((at - now).min(Duration::from_millis(20)));
        }
        match action {
            Action::Restart { between } => {
                let killed = monotonic_ns();
                log.events.push((killed, "daemon SIGKILLed".to_owned()));
                daemon.kill();
                if let Some(between) = between {
                    servers.act(between, &mut log, true);
                }
                // Panics with the log if `lb run` exits or does not answer.
                daemon.restart();
                started_at = Instant::now();
                let restarted = monotonic_ns();
                log.events.push((restarted, "daemon restarted".to_owned()));
                log.restarts.push((killed, restarted));
                sampled = false;
                assert_eq!(files_under(&daemon.bpffs), pins, "the pins changed across a restart");
            }
            Action::Reload => {
                variant = 1 - variant;
                daemon.write_config(&cgroup, &config(variant, &addrs, &vips));
                let sent = monotonic_ns();
                log.events.push((sent, format!("reload to variant {variant}")));
                if let Some(since) = out_since.take() {
                    log.s2_out.push((since, sent));
                }
                if variant == 0 {
                    log.s2_added.push(sent);
                }
                // Every fourth by SIGHUP (always back to variant 0, which
                // has s2 again), the others by `lb reload`.
                if log.reloads % 4 == 3 {
                    assert_eq!(variant, 0);
                    let from = log_len(&daemon);
                    daemon.signal(libc::SIGHUP);
                    assert!(
                        wait_until(Duration::from_secs(10), || log_since(&daemon, from)
                            .contains("config reloaded")),
                        "SIGHUP did not reload:\n{}",
                        log_since(&daemon, from)
                    );
                } else {
                    assert_eq!(daemon.lb(&["reload"]).trim(), "config reloaded");
                    if variant == 1 {
                        out_since = Some(monotonic_ns());
                    }
                }
                log.reloads += 1;
            }
            Action::Server(action) => servers.act(action, &mut log, false),
        }
    }
    let chaos_took = t0.elapsed();
    // Everything back, then the stop: each thread's final connect must work.
    let down: Vec<usize> = (0..NAMES.len()).filter(|i| servers.backends[*i].is_none()).collect();
    for i in down {
        servers.act(ServerAction::Restore(i), &mut log, false);
    }
    if let Some(since) = out_since.take() {
        log.s2_out.push((since, u64::MAX));
    }
    std::thread::sleep(Duration::from_millis(500));
    let pid = daemon.pid().expect("the daemon is running");
    let final_sample = ProcSample::of(pid).expect("the daemon's /proc entry");
    std::fs::write(&stop_file, "").unwrap();
    let attempts = chaos.join().expect("the chaos client failed");

    let report = judge(&attempts, &log);
    if let Some(path) = std::env::var_os("LB_CHAOS_KEEP_LOG") {
        std::fs::write(path, daemon.log()).unwrap();
    }
    eprintln!("{report}");
    eprintln!(
        "chaos: {:?} of chaos, {} restarts, {} reloads, {} kills, {} attempts; daemon at age {SAMPLE_AT_AGE:?}: {:?}; at the end: {final_sample:?}",
        chaos_took,
        log.restarts.len(),
        log.reloads,
        log.kills.len(),
        attempts.len(),
        log.samples
    );

    // No daemon panicked or logged an error; every start adopted the pins;
    // every reload took.
    let text = daemon.log();
    assert!(panics(&text).is_empty(), "a daemon panicked: {:?}", panics(&text));
    let errors: Vec<&str> = text.lines().filter(|l| l.contains(" ERROR ")).collect();
    assert!(errors.is_empty(), "the daemons logged errors: {errors:#?}");
    let starts: Vec<&str> = text.lines().filter(|l| l.contains("lb is running")).collect();
    assert_eq!(starts.len(), log.restarts.len() + 1, "{starts:#?}");
    assert!(
        starts[1..].iter().all(|l| l.contains("adopted=true")),
        "every restarted daemon must adopt the pins: {starts:#?}"
    );
    assert!(!text.contains("reload failed"), "a reload failed:\n{text}");
    assert!(text.matches("config reloaded").count() >= log.reloads);
    // The daemons failed only servers that were down (see `unexplained_failures`).
    let unexplained = unexplained_failures(&text, &log, &addrs);
    assert!(
        unexplained.is_empty(),
        "the daemons failed servers more often than their outages explain: {unexplained:#?}"
    );

    // No leak across restarts: the daemons of the chaos, each at the same
    // age, hold about the same descriptors and memory.
    let (first, last) = (log.samples[0], *log.samples.last().unwrap());
    let most_fds = log.samples.iter().map(|s| s.fds).max().unwrap();
    assert!(
        last.fds <= first.fds + 16 && most_fds <= first.fds + 32,
        "daemon fds grew across restarts: {:?}",
        log.samples
    );
    assert!(
        last.rss_kib <= first.rss_kib * 3 / 2 + 8 * 1024,
        "daemon memory grew across restarts: {:?}",
        log.samples
    );
    assert!(
        final_sample.fds <= first.fds + 32,
        "the last daemon holds more fds than the first: {final_sample:?} vs {first:?}"
    );

    // The client is gone and the test cgroup is empty; the guard's detach
    // then removes every pin (it fails the test if one is left).
    std::fs::remove_file(&record).ok();
    assert!(
        wait_until(Duration::from_secs(5), || !std::path::Path::new(&format!(
            "/proc/{client_pid}"
        ))
        .exists()),
        "the client outlived its guard"
    );
    let procs = std::fs::read_to_string(cgroup.path.join("cgroup.procs")).unwrap();
    assert!(procs.trim().is_empty(), "processes left in the test cgroup: {procs}");
    let bpffs: PathBuf = daemon.bpffs.clone();
    drop(daemon);
    assert!(!bpffs.exists(), "pins left under {}", bpffs.display());
    eprintln!("chaos test took {:?} in all", test_started.elapsed());

    // Last, so that everything above is checked on every run: the
    // connects, judged (see `judge`).
    assert!(
        report.violations.is_empty(),
        "{} connects broke the rules:\n{}",
        report.violations.len(),
        report.violations.join("\n")
    );
    let finals: Vec<&Attempt> = attempts.iter().filter(|a| a.last).collect();
    assert_eq!(finals.len(), THREADS);
    assert!(
        finals.iter().all(|a| matches!(a.outcome, Outcome::Server(_))),
        "every thread must end with a working connection"
    );
    // Kills moved traffic on both VIPs; the datapath served while the
    // daemon was dead (fail-static).
    for (vip, landed) in report.landed.iter().enumerate() {
        assert!(landed.len() >= 2, "VIP {vip}: traffic never moved between servers: {landed:?}");
    }
    assert!(report.while_dead > 0, "no connect was made while the daemon was dead");
}
