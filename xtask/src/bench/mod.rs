//! `cargo xtask bench`: the one place for speed. What lb costs an
//! application, side by side with what it replaces, in one run on one
//! machine, as ratios against a direct connection measured in the same run
//! (absolute figures depend on the machine and its load; ratios much less).
//!
//! Parts (each can be run alone with `--only`):
//! - **paths** ([`workloads`], over the routes of [`paths`]): direct; direct
//!   from inside the attached cgroup (not a VIP); through the lb VIP; through
//!   haproxy (mode tcp) and nginx (stream) configured as node-local proxies
//!   are. Workloads: wrk keep-alive and one new connection per request
//!   against an nginx origin (req/s, p99), connect + close against a Rust
//!   sink, 1 GiB bulk from a Rust source. Medians of alternated rounds. Also
//!   the daemon's CPU per 10,000 VIP connects, and (with `bpftool`) each lb
//!   program's runs and run time per connect.
//! - **scale** ([`scale`]): time from `lb run` to every service in status at
//!   1,000, 10,000 and 16,384 services, RSS, connects/s through one VIP with
//!   1,000 services vs 1, time for a reload changing one service of 10,000
//!   to reach the kernel.
//! - **failover** ([`failover`]): killing the selected server, the kernel's
//!   reaction (first successful connect elsewhere) and the daemon's (health
//!   checks every 100 ms; selection changed in status), p50/p99.
//! - **discovery** ([`discovery`]): EndpointSlice change at a fake API server
//!   to the kernel's new selection, p50/p99; updates/s for 1,000 services × 10
//!   endpoints.
//!
//! Output: a table on stdout, `target/bench/report.md` and the plot
//! `target/bench/ratios.svg` ([`report`]). Targets of the Speed issue are
//! PASS/MISS lines; a miss never fails the run. The run fails only if
//! something did not work: a connect that landed on the wrong server, a
//! transfer that lost bytes, a daemon that did not come up.
//!
//! Machine rules: root, loopback only (`127.78.0.0/16` for the routes, other
//! `127.x` ranges for the scale and discovery services), the bench's own
//! throwaway cgroups and pins (the integration tests' guards, `lb-tests`),
//! its own haproxy and nginx processes in the foreground with configs under
//! `target/bench/`, all removed on every path, Ctrl-C included (it sets a
//! flag that every loop checks; the guards then clean up). Every step has a
//! time limit.

mod client;
mod discovery;
mod failover;
mod paths;
mod report;
mod scale;
mod workloads;

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::SocketAddr,
    os::unix::{net::UnixStream, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Output, Stdio},
    sync::{
        OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
pub use client::client_main;
use lb_tests::Daemon;
use serde_json::Value;

/// The options of `cargo xtask bench`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Rounds per figure, the routes taking turns; more rounds, a steadier
    /// median (the run's time limit grows with them).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
    /// Seconds per wrk run (several runs per route and round).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=30))]
    pub wrk_seconds: u64,
    /// Run only these parts (comma-separated). Default: all.
    #[arg(long, value_delimiter = ',', value_enum)]
    pub only: Vec<Part>,
}

/// A part of the benchmark.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Paths,
    Scale,
    Failover,
    Discovery,
}

impl Args {
    /// The whole run may not take longer than this, whatever happens (each
    /// step has its own, shorter limit; this is the backstop): 10 minutes,
    /// and per round three times what the round's wrk runs take, plus a
    /// minute for the rest of the round.
    fn time_limit(&self) -> Duration {
        let wrk = 2 * paths::Route::ALL.len() as u64 * workloads::WRK_RUNS as u64;
        let round = 3 * wrk * (self.wrk_seconds + 1) + 60;
        Duration::from_secs(600 + u64::from(self.rounds) * round)
    }
}

static STOP: AtomicBool = AtomicBool::new(false);
/// When the run started (after the build), and its time limit.
static STARTED: OnceLock<(Instant, Duration)> = OnceLock::new();

/// Fails once Ctrl-C was pressed or the run's time limit passed; every
/// loop of the bench calls it, so the guards clean up promptly.
fn check_stop() -> anyhow::Result<()> {
    if STOP.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    if let Some((started, limit)) = STARTED.get()
        && started.elapsed() > *limit
    {
        bail!("the bench ran past its time limit of {} s", limit.as_secs());
    }
    Ok(())
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("the benchmark attaches the datapath to cgroups and runs proxies: run it as root");
    }
    // Ctrl-C only sets the flag; the steps stop at their next check and the
    // guards take everything down. (The proxies run in process groups of
    // their own, so the terminal's SIGINT does not reach them first.)
    let _ = ctrlc::set_handler(|| STOP.store(true, Ordering::Relaxed));
    let parts: Vec<Part> = if args.only.is_empty() {
        vec![Part::Paths, Part::Scale, Part::Failover, Part::Discovery]
    } else {
        args.only.clone()
    };

    // The daemon is off the data path, but it handles kernel events on the
    // same CPUs: measured as shipped, optimized.
    crate::cargo(&["build", "--release", "--package", "lb-user"])?;
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("LB_BIN", crate::target_dir().join("release/lb")) };
    // The time limit and the reported duration start after the build.
    let (started, _) = *STARTED.get_or_init(|| (Instant::now(), args.time_limit()));
    let dir = crate::target_dir().join("bench");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    client_exe()?;
    if parts.contains(&Part::Paths) {
        paths::ensure_packages()?;
    }
    let mut results = report::Results::new(args, &parts);
    let origins = paths::Origins::start()?;
    for part in &parts {
        check_stop()?;
        let part_started = Instant::now();
        match part {
            Part::Paths => workloads::run(args, &dir, &origins, &mut results)?,
            Part::Scale => scale::run(args, &origins, &mut results)?,
            Part::Failover => failover::run(&mut results)?,
            Part::Discovery => discovery::run(&mut results)?,
        }
        println!("    ({:?} took {:.0} s)", part, part_started.elapsed().as_secs_f64());
    }
    results.duration = started.elapsed();
    report::write(&results, &dir)
}

/// The program to start as `bench-client`: a copy of this one made at the
/// first call, under `target/bench/`, so that a rebuild of xtask during the
/// run (another `cargo` on the machine) cannot pull it away.
fn client_exe() -> anyhow::Result<PathBuf> {
    static COPY: OnceLock<PathBuf> = OnceLock::new();
    if let Some(copy) = COPY.get() {
        return Ok(copy.clone());
    }
    let copy = crate::target_dir().join("bench/xtask-bench-client");
    let _ = std::fs::remove_file(&copy);
    // /proc/self/exe opens this program even if its file was replaced.
    std::fs::copy("/proc/self/exe", &copy)
        .with_context(|| format!("copying xtask to {}", copy.display()))?;
    Ok(COPY.get_or_init(|| copy).clone())
}

/// Median; `NaN` for no samples.
fn median(samples: &[f64]) -> f64 {
    percentile(samples, 50.0)
}

/// The `p`th percentile (nearest rank) of `samples`; `NaN` for none.
fn percentile(samples: &[f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Runs `cmd` to its end, at most `limit` (then it is killed), and returns
/// its output. Stops early, killing it, on Ctrl-C.
fn output_within(cmd: &mut Command, limit: Duration) -> anyhow::Result<Output> {
    let what = crate::describe(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        buf
    });
    let err_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf);
        buf
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline || STOP.load(Ordering::Relaxed) {
            let _ = child.kill();
            let _ = child.wait();
            check_stop()?;
            bail!("{what} did not finish within {} s (killed)", limit.as_secs());
        }
        thread::sleep(Duration::from_millis(5));
    };
    Ok(Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    })
}

/// User + system CPU time of process `pid` so far (all its threads).
fn cpu_time(pid: i32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After "pid (comm) ": state is field 3; utime and stime are 14 and 15.
    let fields: Vec<&str> = stat
        .rsplit_once(") ")
        .context("/proc/PID/stat without a comm")?
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// Resident memory of process `pid` (VmRSS), in bytes.
fn rss(pid: i32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line =
        status.lines().find(|l| l.starts_with("VmRSS:")).context("no VmRSS in /proc/PID/status")?;
    let kb: u64 = line.split_whitespace().nth(1).context("VmRSS without a value")?.parse()?;
    Ok(kb * 1024)
}

/// The daemon's status, asked on its control socket directly (one JSON
/// line each way, what `lb status --json` asks): cheaper than starting
/// `lb`, so polls disturb the daemon less.
fn status(daemon: &Daemon) -> anyhow::Result<Value> {
    status_received(daemon).map(|(status, _)| status)
}

/// [`status`], and when its answer had been read (before it was parsed).
fn status_received(daemon: &Daemon) -> anyhow::Result<(Value, Instant)> {
    let socket = daemon.dir.join("lb.sock");
    let mut stream = UnixStream::connect(&socket)
        .with_context(|| format!("connecting to {}", socket.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    stream.write_all(b"{\"command\":\"status\"}\n")?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    let received = Instant::now();
    let answer: Value = serde_json::from_str(&line)
        .with_context(|| format!("the daemon's answer is not JSON: {line:.200}"))?;
    if answer["result"] != "status" {
        bail!("the daemon answered a status request with {line:.300}");
    }
    Ok((answer, received))
}

/// The selection of service `name` in the kernel, from `status`.
fn selected(status: &Value, name: &str) -> Vec<String> {
    status["services"]
        .as_array()
        .and_then(|services| services.iter().find(|s| s["name"] == name))
        .and_then(|s| s["selected"].as_array())
        .map(|list| list.iter().filter_map(|a| Some(a.as_str()?.to_owned())).collect())
        .unwrap_or_default()
}

/// Polls `check` every `every` until it holds (`Ok(true)`) or `limit`
/// passes (`Ok(false)`); stops on Ctrl-C.
fn poll(
    limit: Duration,
    every: Duration,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<bool> {
    let deadline = Instant::now() + limit;
    loop {
        if check()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        check_stop()?;
        thread::sleep(every);
    }
}

/// A `bench-client agent`, in a cgroup it can leave: connects on request
/// and says how long they took, or where they landed and when (see
/// [`client`]). One process serves a whole part, so that no measurement
/// includes a process start.
struct Agent {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// What [`Agent::until`] waits for.
enum Want<'a> {
    /// A connect answered by the server of this name.
    Name(&'a str),
    /// A connect answered by any server but this one.
    Not(&'a str),
}

impl Agent {
    /// An agent inside `cgroup`.
    fn start(cgroup: &Path) -> anyhow::Result<Self> {
        let mut cmd = Command::new(client_exe()?);
        cmd.args(["bench-client", "agent"]).stdin(Stdio::piped()).stdout(Stdio::piped());
        lb_tests::start_in_cgroup(&mut cmd, cgroup);
        let mut child = cmd.spawn().context("starting xtask bench-client agent")?;
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Ok(Self { child, stdin, stdout })
    }

    fn send(&mut self, line: &str) -> anyhow::Result<()> {
        writeln!(self.stdin, "{line}").context("the bench agent died")
    }

    /// The agent answers every command, each within its own time limit.
    fn answer(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        self.stdout.read_line(&mut line).context("reading from the bench agent")?;
        if line.is_empty() {
            bail!("the bench agent exited");
        }
        Ok(line.trim().to_owned())
    }

    /// Moves the agent into `cgroup`: its sockets from now on are that
    /// cgroup's.
    fn enter(&mut self, cgroup: &Path) -> anyhow::Result<()> {
        self.expect_ok(&format!("cgroup {}", cgroup.display()))
    }

    /// Lets the agent run only on `cpu` ([`paths_cpu`]).
    fn pin(&mut self, cpu: usize) -> anyhow::Result<()> {
        self.expect_ok(&format!("cpu {cpu}"))
    }

    fn expect_ok(&mut self, command: &str) -> anyhow::Result<()> {
        self.send(command)?;
        match self.answer()?.as_str() {
            "ok" => Ok(()),
            answer => bail!("the bench agent, {command}: {answer}"),
        }
    }

    /// `n` connects to `addr`, each waiting for the server to close: how
    /// long they took.
    fn connects(&mut self, addr: SocketAddr, n: u64) -> anyhow::Result<Duration> {
        self.timed(&format!("connect {addr} {n}"))
    }

    /// `bytes` read from one connection to `addr` (exactly): how long it
    /// took.
    fn bulk(&mut self, addr: SocketAddr, bytes: u64) -> anyhow::Result<Duration> {
        self.timed(&format!("bulk {addr} {bytes}"))
    }

    fn timed(&mut self, command: &str) -> anyhow::Result<Duration> {
        self.send(command)?;
        let answer = self.answer()?;
        match answer.strip_prefix("ok ").and_then(|ns| ns.parse().ok()) {
            Some(ns) => Ok(Duration::from_nanos(ns)),
            None => bail!("bench-client {command}: {answer}"),
        }
    }

    /// One connect to `addr`: the name of the server that answered.
    fn land(&mut self, addr: SocketAddr) -> anyhow::Result<String> {
        self.send(&format!("land {addr}"))?;
        let answer = self.answer()?;
        match answer.strip_prefix("ok ") {
            Some(name) => Ok(name.to_owned()),
            None => bail!("connect to {addr} from the cgroup: {answer}"),
        }
    }

    /// Starts connecting to `addr` in a loop (a pause of `pause` between
    /// attempts) until a connect is answered as `want`; collect the result
    /// with [`Self::until_done`].
    fn until(
        &mut self,
        addr: SocketAddr,
        want: &Want,
        limit: Duration,
        pause: Duration,
    ) -> anyhow::Result<()> {
        let want = match want {
            Want::Name(n) => format!("={n}"),
            Want::Not(n) => format!("!{n}"),
        };
        self.send(&format!("until {addr} {want} {} {}", limit.as_millis(), pause.as_micros()))
    }

    /// When the awaited connect was answered, and what failed before it.
    fn until_done(&mut self) -> anyhow::Result<Landed> {
        let answer = self.answer()?;
        let numbers: Option<Vec<u64>> =
            answer.strip_prefix("ok ").and_then(|r| r.split(' ').map(|n| n.parse().ok()).collect());
        match numbers.as_deref() {
            Some(&[at_ns, _attempts, failed, failed_ns]) => {
                Ok(Landed { at_ns, failed, last_failed_ns: (failed > 0).then_some(failed_ns) })
            }
            _ => bail!("waiting for a connect through the VIP to land as expected: {answer}"),
        }
    }
}

/// The end of an agent's `until` loop.
struct Landed {
    /// CLOCK_MONOTONIC (ns) at which the awaited connect was answered.
    at_ns: u64,
    /// Attempts of the loop that failed (refused, reset, timed out).
    failed: u64,
    /// CLOCK_MONOTONIC (ns) at which the last failed attempt returned.
    last_failed_ns: Option<u64>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The cgroup (v2) this process is in: where the bench's own agents start.
fn own_cgroup() -> anyhow::Result<PathBuf> {
    let line = std::fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    let relative = line
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .context("this process is in no cgroup v2 (no 0:: line in /proc/self/cgroup)")?;
    let root = lb_tests::cgroup2_root().context("finding the cgroup2 mount")?;
    Ok(root.join(relative.trim_start_matches('/')))
}

/// The CPUs the calling thread may run on.
fn affinity() -> std::io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is an empty set; the kernel fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; 0 is this thread.
    if unsafe { libc::sched_getaffinity(0, size_of_val(&set), &raw mut set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: CPU_ISSET reads the set; every index is below its size.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Lets the calling thread run only on `cpus`. Async-signal-safe (no
/// allocation): [`start_on_cpu`] calls it between fork and exec.
fn set_affinity(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: as in `affinity`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        // CPU_SET would index out of the set (and panic) beyond its size.
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: `cpu` is within the set, checked above.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; 0 is this thread.
    if unsafe { libc::sched_setaffinity(0, size_of_val(&set), &raw const set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `cmd` start on `cpu` only (its threads and children inherit it).
fn start_on_cpu(cmd: &mut Command, cpu: usize) {
    // SAFETY: between fork and exec only `set_affinity`, which is
    // async-signal-safe.
    unsafe { cmd.pre_exec(move || set_affinity(&[cpu])) };
}

/// The one CPU on which the paths part runs: its clients (the agent and
/// wrk), the origins and the proxies. The last one this process may use.
///
/// Why one: a request or a connect wakes the server and then the client.
/// Left to the scheduler, the two share a CPU after a pause and are spread
/// over both CPUs after some 20 ms of running; a connect + close loop then
/// ran at 55,000/s or at 13,000/s on the development VM (in the second
/// case most of each connect is the wake-up of a halted virtual CPU, which
/// the host does, and the CPUs are 60 % idle), and wrk keep-alive read
/// anything from 0.82 to 1.26 × direct through a VIP that runs no code per
/// request. Which case a run got depended on what came before it (a
/// pause, the agent's move between cgroups), so a ratio measured the
/// scheduler. On one CPU every run does all of its work itself: a rate is
/// the CPU time that a request, a connect or a byte costs, which is what
/// lb (or a proxy) adds to.
fn paths_cpu() -> anyhow::Result<usize> {
    affinity().context("reading this process's CPU affinity")?.last().copied().context("no CPU")
}

/// A free TCP port on `ip` (bound, then released: the caller binds it
/// again soon after).
fn free_port(ip: [u8; 4]) -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind(SocketAddr::from((ip, 0)))
        .with_context(|| format!("binding a port on {ip:?}"))?;
    Ok(listener.local_addr()?.port())
}

/// The last lines of a long log.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Milliseconds between two CLOCK_MONOTONIC readings.
fn ms_between(from_ns: u64, to_ns: u64) -> f64 {
    to_ns.saturating_sub(from_ns) as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread pinned to [`paths_cpu`] runs there alone, and is let go
    /// to every CPU again.
    #[test]
    fn a_thread_pins_to_the_paths_cpu_and_back() {
        thread::spawn(|| {
            let all = affinity().unwrap();
            let cpu = paths_cpu().unwrap();
            assert_eq!(all.last(), Some(&cpu));
            set_affinity(&[cpu]).unwrap();
            assert_eq!(affinity().unwrap(), [cpu]);
            set_affinity(&all).unwrap();
            assert_eq!(affinity().unwrap(), all);
            // A CPU beyond what a set can hold is an error, not a panic.
            assert!(set_affinity(&[1 << 20]).is_err());
        })
        .join()
        .unwrap();
    }
}
