//! Helpers of the load, stress and chaos tests (`tests/chaos.rs`,
//! `tests/stress.rs`): the commands of the test client that drive many
//! connections at once ([`Client::chaos`], [`Client::hold`]) and its
//! per-attempt record ([`Attempt`]), a backend
//! that holds thousands of connections on one thread ([`HoldBackend`]), a
//! flood of idle connections ([`Flood`]), and what a test reads about the
//! daemon process from `/proc` ([`ProcSample`], of [`Daemon::pid`](crate::Daemon::pid)).
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
        atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};

use crate::{client::Client, daemon::Daemon, wait::monotonic_ns};

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

/// What a [`HoldBackend`] has seen of its client connections.
#[derive(Default, Debug)]
pub struct HoldStats {
    /// Client connections greeted.
    pub accepted: AtomicUsize,
    /// Greeted connections still open.
    pub open: AtomicUsize,
    /// Greeted connections that ended with a reset from the client side.
    pub resets: AtomicUsize,
    /// Greeted connections the client closed normally (EOF).
    pub eofs: AtomicUsize,
}

/// A backend like [`crate::Backend`] (greets clients with its name, answers
/// `GET` with the status set by [`set_health`](Self::set_health)) that holds
/// its connections on a one-thread tokio runtime instead of a thread each,
/// so that it can hold tens of thousands, and counts how they end: a
/// connection reset by the daemon (SOCK_DESTROY aborts the client's socket,
/// which sends a reset) is told apart from a client's normal close.
/// [`kill`](Self::kill) serves the connections already in its accept
/// queue before it closes its listener, so that a kill causes refusals and
/// at most a few resets: of the connections that reach the queue between
/// its last accept and the close (the kernel resets those).
pub struct HoldBackend {
    pub name: String,
    pub addr: SocketAddr,
    pub stats: Arc<HoldStats>,
    health: Arc<AtomicU16>,
    /// Connections accepted and not yet greeted (or answered).
    pending: Arc<AtomicUsize>,
    kill: Option<tokio::sync::oneshot::Sender<()>>,
    listener_closed: std::sync::mpsc::Receiver<()>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl HoldBackend {
    /// Listens on `addr` (port 0: any free port).
    pub fn start(name: &str, addr: SocketAddr) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(format!("hold-{name}"))
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let listener = std::net::TcpListener::bind(addr)
            .unwrap_or_else(|e| panic!("backend {name}: bind {addr}: {e}"));
        let addr = listener.local_addr().unwrap();
        // A deep accept queue: thousands of clients connect at once.
        // SAFETY: listen on a valid bound socket; only the backlog changes.
        unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&listener), 4096) };
        listener.set_nonblocking(true).unwrap();
        let (stats, health, pending) = (
            Arc::new(HoldStats::default()),
            Arc::new(AtomicU16::new(200)),
            Arc::new(AtomicUsize::new(0)),
        );
        let (kill, mut killed) = tokio::sync::oneshot::channel::<()>();
        let (closed_tx, listener_closed) = std::sync::mpsc::channel();
        {
            let (name, stats, health, pending) =
                (name.to_owned(), stats.clone(), health.clone(), pending.clone());
            runtime.spawn(async move {
                let serve = |stream: tokio::net::TcpStream| {
                    pending.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(hold_connection(
                        stream,
                        name.clone(),
                        stats.clone(),
                        health.clone(),
                        pending.clone(),
                    ));
                };
                let listener =
                    tokio::net::TcpListener::from_std(listener).expect("registering the listener");
                loop {
                    tokio::select! {
                        accepted = listener.accept() => match accepted {
                            Ok((stream, _)) => serve(stream),
                            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                        },
                        _ = &mut killed => break,
                    }
                }
                // Killed: serve what the kernel already queued (those
                // clients are connected), then close the listener.
                if let Ok(listener) = listener.into_std() {
                    while let Ok((stream, _)) = listener.accept() {
                        if stream.set_nonblocking(true).is_ok()
                            && let Ok(stream) = tokio::net::TcpStream::from_std(stream)
                        {
                            serve(stream);
                        }
                    }
                }
                let _ = closed_tx.send(());
            });
        }
        Self {
            name: name.to_owned(),
            addr,
            stats,
            health,
            pending,
            kill: Some(kill),
            listener_closed,
            runtime: Some(runtime),
        }
    }

    /// Kills the server: closes the listener (connects are refused from
    /// then on) after serving the connections already in its accept queue,
    /// lets those get their greeting, then closes every connection. Returns
    /// its address and the CLOCK_MONOTONIC time at which the listener was
    /// closed (at the latest).
    pub fn kill(mut self) -> (SocketAddr, u64) {
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
        let _ = self.listener_closed.recv_timeout(Duration::from_secs(5));
        let closed = monotonic_ns();
        wait_until_quick(Duration::from_secs(2), || self.pending.load(Ordering::Relaxed) == 0);
        (self.addr, closed)
    }

    /// The HTTP status its health endpoint answers from now on.
    pub fn set_health(&self, status: u16) {
        self.health.store(status, Ordering::Relaxed);
    }

    pub fn accepted(&self) -> usize {
        self.stats.accepted.load(Ordering::Relaxed)
    }

    pub fn open(&self) -> usize {
        self.stats.open.load(Ordering::Relaxed)
    }

    pub fn resets(&self) -> usize {
        self.stats.resets.load(Ordering::Relaxed)
    }

    pub fn eofs(&self) -> usize {
        self.stats.eofs.load(Ordering::Relaxed)
    }
}

/// Counts down `pending` when dropped: however a connection's task ends.
struct Pending(Arc<AtomicUsize>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn hold_connection(
    stream: tokio::net::TcpStream,
    name: String,
    stats: Arc<HoldStats>,
    health: Arc<AtomicU16>,
    pending: Arc<AtomicUsize>,
) {
    let pending = Pending(pending);
    let mut stream = tokio::io::BufReader::new(stream);
    let mut first = String::new();
    match tokio::time::timeout(Duration::from_secs(5), stream.read_line(&mut first)).await {
        Ok(Ok(n)) if n > 0 => {}
        _ => return, // a TCP health check: connect and close
    }
    if first.starts_with("GET ") {
        let status = health.load(Ordering::Relaxed);
        let answer =
            format!("HTTP/1.1 {status} Status\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        let _ = stream.get_mut().write_all(answer.as_bytes()).await;
        return;
    }
    if stream.get_mut().write_all(format!("{name}\n").as_bytes()).await.is_err() {
        return;
    }
    drop(pending);
    stats.accepted.fetch_add(1, Ordering::Relaxed);
    stats.open.fetch_add(1, Ordering::Relaxed);
    let mut sink = [0u8; 64];
    let ended = loop {
        match stream.read(&mut sink).await {
            Ok(0) => break &stats.eofs,
            Ok(_) => {}
            Err(_) => break &stats.resets,
        }
    };
    ended.fetch_add(1, Ordering::Relaxed);
    stats.open.fetch_sub(1, Ordering::Relaxed);
}

impl Drop for HoldBackend {
    /// Stops listening and closes every connection (its runtime's tasks).
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

/// Polls `check` every millisecond until it holds or `timeout` passes.
fn wait_until_quick(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while !check() {
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(1));
    }
    true
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
