//! [`Agent`]: a `bench-client agent` process that connects on request,
//! from inside a cgroup, and the copy of xtask it runs as.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    sync::OnceLock,
    time::Duration,
};

use anyhow::{Context as _, bail};

/// The program to start as `bench-client`: a copy of this one made at the
/// first call, under `target/bench/`, so that a rebuild of xtask during the
/// run (another `cargo` on the machine) cannot pull it away.
pub fn client_exe() -> anyhow::Result<PathBuf> {
    static COPY: OnceLock<PathBuf> = OnceLock::new();
    if let Some(copy) = COPY.get() {
        return Ok(copy.clone());
    }
    let copy = crate::cmd::target_dir().join("bench/xtask-bench-client");
    let _ = std::fs::remove_file(&copy);
    // /proc/self/exe opens this program even if its file was replaced.
    std::fs::copy("/proc/self/exe", &copy)
        .with_context(|| format!("copying xtask to {}", copy.display()))?;
    Ok(COPY.get_or_init(|| copy).clone())
}

/// A `bench-client agent`, in a cgroup it can leave: connects on request
/// and says how long they took, or where they landed and when (see
/// [`client`](super::client)). One process serves a whole part, so that no measurement
/// includes a process start.
pub struct Agent {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// What [`Agent::until`] waits for.
pub enum Want<'a> {
    /// A connect answered by the server of this name.
    Name(&'a str),
    /// A connect answered by any server but this one.
    Not(&'a str),
}

impl Agent {
    /// An agent inside `cgroup`.
    pub fn start(cgroup: &Path) -> anyhow::Result<Self> {
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
    pub fn enter(&mut self, cgroup: &Path) -> anyhow::Result<()> {
        self.expect_ok(&format!("cgroup {}", cgroup.display()))
    }

    /// Lets the agent run only on `cpu` ([`paths_cpu`](super::host::paths_cpu)).
    pub fn pin(&mut self, cpu: usize) -> anyhow::Result<()> {
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
    pub fn connects(&mut self, addr: SocketAddr, n: u64) -> anyhow::Result<Duration> {
        self.timed(&format!("connect {addr} {n}"))
    }

    /// `bytes` read from one connection to `addr` (exactly): how long it
    /// took.
    pub fn bulk(&mut self, addr: SocketAddr, bytes: u64) -> anyhow::Result<Duration> {
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

    /// Opens `n` connections to `addrs` in turn and keeps them (until
    /// [`Self::release`]): how many it holds.
    pub fn hold(&mut self, addrs: &[SocketAddr], n: usize) -> anyhow::Result<usize> {
        let list: Vec<String> = addrs.iter().map(ToString::to_string).collect();
        self.send(&format!("hold {} {n}", list.join(",")))?;
        let answer = self.answer()?;
        match answer.strip_prefix("ok ").and_then(|n| n.parse().ok()) {
            Some(held) => Ok(held),
            None => bail!("bench-client hold: {answer}"),
        }
    }

    /// Closes the connections [`Self::hold`] opened.
    pub fn release(&mut self) -> anyhow::Result<()> {
        self.send("release")?;
        let answer = self.answer()?;
        if answer != "ok" {
            bail!("bench-client release: {answer}");
        }
        Ok(())
    }

    /// One connect to `addr`: the name of the server that answered, or
    /// the error's line.
    pub fn try_land(&mut self, addr: SocketAddr) -> anyhow::Result<Result<String, String>> {
        self.send(&format!("land {addr}"))?;
        let answer = self.answer()?;
        Ok(match answer.strip_prefix("ok ") {
            Some(name) => Ok(name.to_owned()),
            None => Err(answer),
        })
    }

    /// One connect to `addr`: the name of the server that answered.
    pub fn land(&mut self, addr: SocketAddr) -> anyhow::Result<String> {
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
    pub fn until(
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
    pub fn until_done(&mut self) -> anyhow::Result<Landed> {
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
pub struct Landed {
    /// CLOCK_MONOTONIC (ns) at which the awaited connect was answered.
    pub at_ns: u64,
    /// Attempts of the loop that failed (refused, reset, timed out).
    pub failed: u64,
    /// CLOCK_MONOTONIC (ns) at which the last failed attempt returned.
    pub last_failed_ns: Option<u64>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
