//! [`Client`]: the `lb-test-client` process that connects from inside a
//! test cgroup, and [`Connect`], its answer to a connect.

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, Write as _},
    net::SocketAddr,
    path::Path,
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    time::Duration,
};

use crate::{
    cgroup::{TestCgroup, start_in_cgroup},
    env::client_bin,
    leak::leaked,
};

/// The answer to a `connect`/`udp` command of the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Connect {
    /// Connection id, the peer the application saw, the server's greeting.
    Ok {
        id: u32,
        peer: SocketAddr,
        greeting: String,
    },
    Err(String),
}

impl Connect {
    /// The greeting (which backend accepted), or a panic with the error.
    #[track_caller]
    pub fn landed(&self) -> &str {
        match self {
            Self::Ok { greeting, .. } => greeting,
            Self::Err(e) => panic!("connect failed: {e}"),
        }
    }

    /// The client's id of the connection, or a panic with the error.
    #[track_caller]
    pub fn id(&self) -> u32 {
        match self {
            Self::Ok { id, .. } => *id,
            Self::Err(e) => panic!("connect failed: {e}"),
        }
    }

    /// The peer the application saw (getpeername), or a panic with the error.
    #[track_caller]
    pub fn peer(&self) -> SocketAddr {
        match self {
            Self::Ok { peer, .. } => *peer,
            Self::Err(e) => panic!("connect failed: {e}"),
        }
    }
}

/// `lb-test-client` running in a cgroup (or outside any test cgroup): one
/// process answering one line per command (see the binary for them). The
/// commands of the load and hardening tests are in `load` and `hardening`.
pub struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    /// Starts the client binary `bin` (`env!("CARGO_BIN_EXE_lb-test-client")`
    /// in a test, overridden by `$LB_TEST_CLIENT`) inside `cgroup`, or in
    /// the test's own cgroup if `None`.
    pub fn start(bin: &str, cgroup: Option<&TestCgroup>) -> Self {
        let bin = client_bin(bin);
        let mut cmd = Command::new(&bin);
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        if let Some(cgroup) = cgroup {
            start_in_cgroup(&mut cmd, &cgroup.path);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Self { child, stdin, stdout }
    }

    /// Sends one command and returns its one-line answer. Every command of
    /// the client is bounded in time (its own deadlines and 5 s socket
    /// timeouts), so this cannot hang for ever.
    pub fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").expect("client died");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("client died");
        assert!(!line.is_empty(), "client exited on {command:?}");
        line.trim().to_owned()
    }

    pub(crate) fn parse(answer: &str) -> Connect {
        let mut words = answer.splitn(4, ' ');
        match words.next() {
            Some("ok") => Connect::Ok {
                id: words.next().unwrap().parse().unwrap(),
                peer: words.next().unwrap().parse().unwrap(),
                greeting: words.next().unwrap_or("").to_owned(),
            },
            _ => Connect::Err(answer.to_owned()),
        }
    }

    /// A TCP connect to `addr`; the connection stays open.
    pub fn connect(&mut self, addr: SocketAddr) -> Connect {
        Self::parse(&self.ask(&format!("connect {addr}")))
    }

    /// A connected UDP socket to `addr`, one datagram there and back.
    pub fn udp(&mut self, addr: SocketAddr) -> Connect {
        Self::parse(&self.ask(&format!("udp {addr}")))
    }

    /// Whether connection `id` is still open (not closed or reset by
    /// the peer or the daemon).
    pub fn alive(&mut self, id: u32) -> bool {
        let answer = self.ask(&format!("alive {id}"));
        assert!(!answer.starts_with("err"), "{answer}");
        answer == "alive"
    }

    /// `threads` threads connecting in a loop until `stop_file` exists (at
    /// most `limit`), then once more each; returns the client's `storm ...`
    /// summary line.
    pub fn storm(
        &mut self,
        addr: SocketAddr,
        threads: usize,
        limit: Duration,
        stop_file: &Path,
    ) -> String {
        self.ask(&format!("storm {addr} {threads} {} {}", limit.as_millis(), stop_file.display()))
    }

    /// Closes connection `id`.
    pub fn close(&mut self, id: u32) {
        assert_eq!(self.ask(&format!("close {id}")), "closed");
    }

    /// The client process's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Client {
    /// Kills and reaps the client; one that cannot be reaped is a leak.
    fn drop(&mut self) {
        let _ = self.child.kill();
        if let Err(e) = self.child.wait() {
            leaked(
                "Client",
                &[format!("lb-test-client (pid {}) could not be reaped: {e}", self.child.id())],
            );
        }
    }
}

/// Counts how many answers landed on each backend name.
pub fn tally<'a>(answers: impl IntoIterator<Item = &'a Connect>) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for answer in answers {
        *counts.entry(answer.landed().to_owned()).or_default() += 1;
    }
    counts
}
