//! Helpers of the load, stress and chaos tests (`tests/chaos.rs`,
//! `tests/stress.rs`): the commands of the test client that drive many
//! connections at once ([`Client::chaos`], [`Client::hold`]) and its
//! per-attempt record ([`Attempt`]), a flood of idle connections
//! ([`Flood`]), and what a test reads about the daemon process from `/proc`
//! ([`ProcSample`], of [`Daemon::pid`](crate::Daemon::pid)). Their backend
//! is [`HoldBackend`](crate::hold_backend::HoldBackend).
//!
//! Like the rest of the harness, everything here cleans up on drop and
//! every loop is bounded in count and time.

use std::{
    collections::HashMap,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use crate::{client::Client, daemon::Daemon};

/// Raises this process's limit of open files to at least `want` if it
/// can (raising the hard limit needs CAP_SYS_RESOURCE, which a container's
/// root may lack; then up to the hard limit). Returns the limit now in
/// force. Children started afterwards inherit it.
pub fn raise_nofile(want: u64) -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit fills the struct we pass.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
    if limit.rlim_cur >= want {
        return limit.rlim_cur;
    }
    let wanted = libc::rlimit { rlim_cur: want, rlim_max: limit.rlim_max.max(want) };
    // SAFETY: setrlimit reads the struct we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) } == 0 {
        return want;
    }
    let most = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
    // SAFETY: as above.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &most) };
    assert_eq!(
        rc,
        0,
        "raising RLIMIT_NOFILE to its hard limit {}: {}",
        limit.rlim_max,
        std::io::Error::last_os_error()
    );
    limit.rlim_max
}

/// The commands of [`Client`] that drive many connections at once
/// (`chaos`, `hold`, `held`, `release`; see the client's documentation).
impl Client {
    /// `threads` threads (thread `i` on `vips[i % vips.len()]`) connect, read
    /// the greeting and close, in a loop, until `stop_file` exists (at most
    /// `limit`), then once more each. Returns every attempt, read back from
    /// `out`.
    pub fn chaos(
        &mut self,
        vips: &[SocketAddr],
        threads: usize,
        limit: Duration,
        stop_file: &Path,
        out: &Path,
    ) -> Vec<Attempt> {
        let vips: Vec<String> = vips.iter().map(ToString::to_string).collect();
        let answer = self.ask(&format!(
            "chaos {} {threads} {} {} {}",
            vips.join(","),
            limit.as_millis(),
            stop_file.display(),
            out.display()
        ));
        assert!(answer.starts_with("chaos attempts="), "{answer}");
        let attempts = read_attempts(out);
        assert_eq!(
            answer,
            format!("chaos attempts={}", attempts.len()),
            "the record in {} is incomplete",
            out.display()
        );
        attempts
    }

    /// Opens `count` connections through `vip` with `threads` threads and
    /// keeps them: (greeting → count, failures).
    pub fn hold(&mut self, vip: SocketAddr, count: usize, threads: usize) -> Held {
        let answer = self.ask(&format!("hold {vip} {count} {threads}"));
        let fields = fields(&answer, "held");
        Held {
            ok: number(&fields, "ok"),
            failed: number(&fields, "failed"),
            names: counts(&fields, "names"),
            errors: counts(&fields, "errors"),
        }
    }

    /// The held connections: (alive, dead by kind).
    pub fn held(&mut self) -> (usize, HashMap<String, usize>) {
        let answer = self.ask("held");
        let fields = fields(&answer, "held");
        let kinds = counts(&fields, "kinds");
        assert_eq!(kinds.values().sum::<usize>(), number(&fields, "dead"), "{answer}");
        (number(&fields, "alive"), kinds)
    }

    /// Closes the held connections.
    pub fn release(&mut self) {
        assert_eq!(self.ask("release"), "released");
    }
}

/// The answer to [`Client::hold`].
#[derive(Debug)]
pub struct Held {
    pub ok: usize,
    pub failed: usize,
    pub names: HashMap<String, usize>,
    pub errors: HashMap<String, usize>,
}

fn fields(answer: &str, word: &str) -> HashMap<String, String> {
    let mut words = answer.split_whitespace();
    assert_eq!(words.next(), Some(word), "unexpected answer: {answer}");
    words.filter_map(|w| w.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
}

fn number(fields: &HashMap<String, String>, key: &str) -> usize {
    fields
        .get(key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number {key} in {fields:?}"))
}

fn counts(fields: &HashMap<String, String>, key: &str) -> HashMap<String, usize> {
    fields
        .get(key)
        .map(|v| {
            v.split(',')
                .filter(|e| !e.is_empty())
                .filter_map(|e| e.rsplit_once(':'))
                .map(|(k, c)| (k.to_owned(), c.parse().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default()
}

/// One connect of the `chaos` client, with CLOCK_MONOTONIC times
/// (comparable with [`crate::monotonic_ns`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// Which VIP (its index in the list given to [`Client::chaos`]).
    pub vip: usize,
    /// When the thread called `connect`.
    pub start: u64,
    /// When it had the greeting or the error.
    pub end: u64,
    /// The attempt each thread makes after the stop.
    pub last: bool,
    pub outcome: Outcome,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The greeting: which server accepted.
    Server(String),
    /// `connect` was refused (ECONNREFUSED).
    Refused,
    /// Connected, then reset (or EOF) before the greeting: the connection
    /// sat in the accept queue of a listener that closed.
    Reset,
    /// Connected, then aborted before the greeting (ECONNABORTED): the
    /// daemon destroyed the socket (SOCK_DESTROY) while it waited.
    Aborted,
    /// Anything else (a timeout, an abort, EPERM, ...).
    Other(String),
}

/// Reads the record the `chaos` client wrote.
pub fn read_attempts(path: &Path) -> Vec<Attempt> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .map(|line| {
            let mut w = line.splitn(5, ' ');
            let mut next =
                || w.next().unwrap_or_else(|| panic!("short line {line:?} in {}", path.display()));
            let (vip, start, end, last, outcome) = (next(), next(), next(), next(), next());
            let outcome = match outcome {
                "!refused" => Outcome::Refused,
                "!reset" => Outcome::Reset,
                "!aborted" => Outcome::Aborted,
                o if o.starts_with('!') => Outcome::Other(o[1..].to_owned()),
                name => Outcome::Server(name.to_owned()),
            };
            Attempt {
                vip: vip.parse().unwrap(),
                start: start.parse().unwrap(),
                end: end.parse().unwrap(),
                last: last == "1",
                outcome,
            }
        })
        .collect()
}

/// What a [`Flood`] did.
#[derive(Debug, Default, Clone)]
pub struct FloodStats {
    /// Connections it opened (the first `count`, and every replacement).
    pub opened: usize,
    /// Connects that failed or timed out (1 s each).
    pub connect_failures: usize,
    /// Its connections it found closed by the other side, and replaced.
    pub closed_by_peer: usize,
    /// Rounds over all its connections.
    pub rounds: usize,
}

/// `count` idle TCP connections to `target`, opened from this process
/// (not through a VIP) and kept open: a thread looks at them every
/// `every` and replaces those the other side closed, as a hostile
/// neighbour would, until [`stop`](Self::stop) or `limit`.
pub struct Flood {
    stop: Arc<AtomicBool>,
    /// Connections opened so far (readable while it runs).
    pub opened: Arc<AtomicUsize>,
    thread: Option<JoinHandle<FloodStats>>,
}

impl Flood {
    pub fn start(target: SocketAddr, count: usize, every: Duration, limit: Duration) -> Self {
        let (stop, opened) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let thread = {
            let (stop, opened) = (stop.clone(), opened.clone());
            thread::spawn(move || {
                let deadline = Instant::now() + limit;
                let mut stats = FloodStats::default();
                let mut conns: Vec<Option<TcpStream>> = (0..count).map(|_| None).collect();
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    // One round: replace what is missing or closed (each
                    // round bounded in time too).
                    let round_end = Instant::now() + Duration::from_secs(3);
                    for slot in &mut conns {
                        if stop.load(Ordering::Relaxed) || Instant::now() >= round_end {
                            break;
                        }
                        if let Some(stream) = slot {
                            if is_open(stream) {
                                continue;
                            }
                            stats.closed_by_peer += 1;
                        }
                        *slot = match TcpStream::connect_timeout(&target, Duration::from_secs(1)) {
                            Ok(stream) => {
                                stats.opened += 1;
                                opened.fetch_add(1, Ordering::Relaxed);
                                Some(stream)
                            }
                            Err(_) => {
                                stats.connect_failures += 1;
                                None
                            }
                        };
                    }
                    stats.rounds += 1;
                    let pause = Instant::now() + every;
                    while !stop.load(Ordering::Relaxed) && Instant::now() < pause.min(deadline) {
                        thread::sleep(Duration::from_millis(10));
                    }
                }
                stats
            })
        };
        Self { stop, opened, thread: Some(thread) }
    }

    /// Stops it, closes its connections and says what it did.
    pub fn stop(mut self) -> FloodStats {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map(|t| t.join().expect("the flood thread panicked")).unwrap_or_default()
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// No EOF and no error pending on `stream`.
fn is_open(stream: &TcpStream) -> bool {
    let _ = stream.set_nonblocking(true);
    let mut buf = [0u8; 1];
    let result = stream.peek(&mut buf);
    let _ = stream.set_nonblocking(false);
    matches!(result, Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock)
        || matches!(result, Ok(n) if n > 0)
}

/// What `/proc` says about a process's resources.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcSample {
    /// Open file descriptors.
    pub fds: usize,
    /// Resident memory, KiB.
    pub rss_kib: u64,
    pub threads: usize,
}

impl ProcSample {
    /// `None` if the process is gone.
    pub fn of(pid: i32) -> Option<Self> {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let field = |name: &str| -> Option<u64> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name)?.split_whitespace().next()?.parse().ok())
        };
        Some(Self {
            fds,
            rss_kib: field("VmRSS:")?,
            threads: usize::try_from(field("Threads:")?).ok()?,
        })
    }
}

/// `GET /metrics` from the daemon's metrics endpoint: the body, or why not.
pub fn scrape(metrics: SocketAddr) -> Result<String, String> {
    let mut stream = TcpStream::connect_timeout(&metrics, Duration::from_secs(2))
        .map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("send: {e}"))?;
    let mut response = String::new();
    stream.read_to_string(&mut response).map_err(|e| format!("read: {e}"))?;
    if !response.starts_with("HTTP/1.1 200") {
        return Err(format!("answer: {:?}", response.lines().next().unwrap_or("")));
    }
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .ok_or_else(|| "no body".to_owned())
}

/// The value of the sample `series` (`name{labels}`) in a scrape.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// `lb status --json`, timed; an error (or a status that does not parse)
/// is returned, not a panic, so a test can say how long it waited.
pub fn timed_status(daemon: &Daemon) -> (Duration, Result<serde_json::Value, String>) {
    let started = Instant::now();
    let result = daemon
        .try_lb(&["status", "--json"])
        .and_then(|out| serde_json::from_str(&out).map_err(|e| format!("{e}: {out}")));
    (started.elapsed(), result)
}

/// A server's field in a status: `status.services[name=service].servers[address=server][field]`.
pub fn server_field(
    status: &serde_json::Value,
    service: &str,
    server: SocketAddr,
    field: &str,
) -> serde_json::Value {
    status["services"]
        .as_array()
        .and_then(|services| services.iter().find(|s| s["name"] == service))
        .and_then(|s| s["servers"].as_array()?.iter().find(|s| s["address"] == server.to_string()))
        .map_or(serde_json::Value::Null, |s| s[field].clone())
}

/// Lines of a daemon log that show a panic.
pub fn panics(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.contains("panicked")).collect()
}

/// The length of `daemon`'s log so far, for [`log_since`].
pub fn log_len(daemon: &Daemon) -> u64 {
    std::fs::metadata(daemon.dir.join("lb.log")).map_or(0, |m| m.len())
}

/// What `daemon` logged after the first `from` bytes (a busy daemon's
/// debug log grows fast; this reads only the new part).
pub fn log_since(daemon: &Daemon, from: u64) -> String {
    use std::io::{Seek as _, SeekFrom};
    let Ok(mut file) = std::fs::File::open(daemon.dir.join("lb.log")) else {
        return String::new();
    };
    let mut bytes = Vec::new();
    if file.seek(SeekFrom::Start(from)).is_ok() {
        let _ = file.read_to_end(&mut bytes);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}
