//! [`Backend`]: a loopback server that says who it is and answers health
//! checks with a status the test sets.

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

/// A TCP (and UDP) server on one address that answers `who` with its
/// name, so a test knows which server a connection really reached,
/// `peer` with the address the connection came from, and
/// answers `GET /...` (a health check) with a status the test controls.
pub struct Backend {
    /// What it answers `who` with.
    pub name: String,
    /// Where it listens (TCP and UDP).
    pub addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    last_accept: Arc<Mutex<Option<Instant>>>,
    health_status: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
}

impl Backend {
    /// Listens on `addr` (port 0: any free port).
    pub fn start(name: &str, addr: SocketAddr) -> Self {
        let listener =
            TcpListener::bind(addr).unwrap_or_else(|e| panic!("backend {name}: bind {addr}: {e}"));
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let udp = UdpSocket::bind(addr)
            .unwrap_or_else(|e| panic!("backend {name}: bind udp {addr}: {e}"));
        udp.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let (accepted, stop, conns) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new(HashMap::new())),
        );
        let health_status = Arc::new(AtomicUsize::new(200));
        let last_accept = Arc::new(Mutex::new(None));
        let tcp_thread = {
            let (name, accepted, stop, conns, health_status) = (
                name.to_owned(),
                accepted.clone(),
                stop.clone(),
                conns.clone(),
                health_status.clone(),
            );
            let last_accept = last_accept.clone();
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            let (name, accepted, conns, health_status) = (
                                name.clone(),
                                accepted.clone(),
                                conns.clone(),
                                health_status.clone(),
                            );
                            let last_accept = last_accept.clone();
                            thread::spawn(move || {
                                serve(stream, &name, &conns, &health_status, || {
                                    accepted.fetch_add(1, Ordering::Relaxed);
                                    *last_accept.lock().unwrap() = Some(Instant::now());
                                });
                            });
                        }
                        Err(_) => thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        let udp_thread = {
            let (name, stop) = (name.to_owned(), stop.clone());
            thread::spawn(move || {
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((_, from)) = udp.recv_from(&mut buf) {
                        let _ = udp.send_to(name.as_bytes(), from);
                    }
                }
            })
        };
        Self {
            name: name.to_owned(),
            addr,
            accepted,
            last_accept,
            health_status,
            stop,
            threads: vec![tcp_thread, udp_thread],
            conns,
        }
    }

    /// Client connections this backend answered so far (not health checks).
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    /// When this backend last answered a client connection.
    pub fn last_accept(&self) -> Option<Instant> {
        *self.last_accept.lock().unwrap()
    }

    /// The HTTP status its health endpoint answers from now on.
    pub fn set_health(&self, status: u16) {
        self.health_status.store(usize::from(status), Ordering::Relaxed);
    }

    /// Stops listening (new connects are refused) and closes its connections.
    pub fn stop(mut self) -> SocketAddr {
        self.shutdown();
        self.addr
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for (_, conn) in self.conns.lock().unwrap().drain() {
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// One accepted connection: a health check gets an HTTP answer and is
/// closed; a client gets the backend's name (then `on_client` runs) and is
/// held until it closes, or until `stop` shuts it down.
fn serve(
    mut stream: TcpStream,
    name: &str,
    conns: &Mutex<HashMap<u64, TcpStream>>,
    health_status: &AtomicUsize,
    on_client: impl FnOnce(),
) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut first = String::new();
    if BufReader::new(&stream).read_line(&mut first).is_err() || first.is_empty() {
        return; // a TCP health check: connect and close
    }
    if first.trim_end() == "peer" {
        // Whom the server sees: the client's own address, or a NAT source.
        let peer = stream.peer_addr().map_or_else(|e| e.to_string(), |a| a.to_string());
        let _ = writeln!(stream, "{peer}");
        return;
    }
    if first.starts_with("GET ") {
        let status = health_status.load(Ordering::Relaxed);
        let _ = write!(
            stream,
            "HTTP/1.1 {status} Status\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        return;
    }
    let _ = writeln!(stream, "{name}");
    on_client();
    let id = NEXT.fetch_add(1, Ordering::Relaxed) as u64;
    if let Ok(clone) = stream.try_clone() {
        conns.lock().unwrap().insert(id, clone);
    }
    let _ = stream.set_read_timeout(None);
    let mut sink = [0u8; 64];
    while matches!(std::io::Read::read(&mut stream, &mut sink), Ok(n) if n > 0) {}
    conns.lock().unwrap().remove(&id);
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.shutdown();
    }
}
