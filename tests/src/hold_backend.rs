//! [`HoldBackend`]: a backend for the load, stress and chaos tests that
//! holds tens of thousands of connections on one thread and counts how
//! each ends (a reset told apart from a normal close).

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU16, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};

use crate::wait::monotonic_ns;

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
