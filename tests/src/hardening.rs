//! Harness pieces of the hardening tests (`tests/hardening.rs`): the test
//! client's commands that hold, churn and cancel connections inside the
//! test cgroup, and a server whose SYN-ACKs to one client never come.
//!
//! [`SlowToOne`] stands in for netem (not in this kernel): a reuseport
//! group on the server's address whose classic-BPF program
//! (`SO_ATTACH_REUSEPORT_CBPF`) sends the SYNs from one source address to a
//! listener whose accept queue is full (it never accepts), where the kernel
//! drops them, and every other SYN to the listener that serves. Everything
//! stays on loopback.

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use crate::{
    cgroup::{TestCgroup, start_in_cgroup},
    client::{Client, Connect},
    env::client_bin,
};

/// The commands of [`Client`] that the hardening tests add (see the
/// client's documentation).
impl Client {
    /// getpeername of a held connection, now.
    #[track_caller]
    pub fn peer(&mut self, id: u32) -> SocketAddr {
        let answer = self.ask(&format!("peer {id}"));
        answer
            .strip_prefix("peer ")
            .unwrap_or_else(|| panic!("peer {id}: {answer}"))
            .parse()
            .unwrap()
    }

    /// A connection to `vip` made from a network namespace of the
    /// client's own (a pod's), where a listener on `server` answers
    /// `pod-server`; the client holds it. Watch it with `alive`.
    pub fn pod(&mut self, vip: SocketAddr, server: SocketAddr) -> Connect {
        Self::parse(&self.ask(&format!("pod {vip} {server}")))
    }

    /// One connect, closed at once: `Ok(server name)` or `Err(message)`.
    pub fn once(&mut self, addr: SocketAddr) -> Result<String, String> {
        let answer = self.ask(&format!("once {addr}"));
        match answer.strip_prefix("ok ") {
            Some(rest) => Ok(rest.split_once(' ').map_or("", |(_, name)| name).to_owned()),
            None => Err(answer),
        }
    }

    /// `churn-udp` / `churn-tcp`: (succeeded, failed).
    #[track_caller]
    pub fn churn(&mut self, protocol: &str, addr: SocketAddr, n: usize) -> (usize, usize) {
        let answer = self.ask(&format!("churn-{protocol} {addr} {n}"));
        let field = |name: &str| -> usize {
            answer
                .split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.parse().ok())
                .unwrap_or_else(|| panic!("churn: {answer}"))
        };
        (field("ok="), field("failed="))
    }

    /// `fastopen`: how many of `n` `TCP_FASTOPEN_CONNECT` sockets, closed
    /// before their first write, were in SYN_SENT when closed. They are made
    /// in a network namespace of the client's own (where Fast Open needs no
    /// cookie), so the VIP's service must have `scope = "all"`.
    #[track_caller]
    pub fn fastopen(&mut self, addr: SocketAddr, n: usize) -> usize {
        let answer = self.ask(&format!("fastopen {addr} {n}"));
        answer
            .split_whitespace()
            .find_map(|w| w.strip_prefix("syn_sent=")?.parse().ok())
            .unwrap_or_else(|| panic!("fastopen: {answer}"))
    }

    /// `cancel`: how many of `n` connects were still in SYN_SENT when the
    /// client gave up on them, `how` (`close`, `shutdown` or `unspec`).
    #[track_caller]
    pub fn cancel(
        &mut self,
        addr: SocketAddr,
        source: IpAddr,
        n: usize,
        wait: Duration,
        how: &str,
    ) -> usize {
        let answer = self.ask(&format!("cancel {addr} {source} {n} {} {how}", wait.as_millis()));
        answer
            .split_whitespace()
            .find_map(|w| w.strip_prefix("syn_sent=")?.parse().ok())
            .unwrap_or_else(|| panic!("cancel: {answer}"))
    }

    /// `failfast`: how many of `n` connects to the IPv4 `vip` from
    /// IPv6-only sockets failed on the spot with `ENETUNREACH`; the sockets
    /// stay open until [`Client::unstick`].
    #[track_caller]
    pub fn failfast(&mut self, vip: SocketAddr, n: usize) -> usize {
        let answer = self.ask(&format!("failfast {vip} {n}"));
        answer
            .split_whitespace()
            .find_map(|w| w.strip_prefix("unreachable=")?.parse().ok())
            .unwrap_or_else(|| panic!("failfast: {answer}"))
    }

    /// Closes the sockets of [`Client::failfast`].
    #[track_caller]
    pub fn unstick(&mut self) {
        assert_eq!(self.ask("unstick"), "unstuck");
    }

    /// `reuse`: one socket's connect to the IPv4 `vip` fails on the spot,
    /// then it connects to `other`; the second connect's outcome (`ok` or
    /// the error's kind, e.g. `ConnectionRefused`).
    #[track_caller]
    pub fn reuse(&mut self, vip: SocketAddr, other: SocketAddr) -> String {
        let answer = self.ask(&format!("reuse {vip} {other}"));
        let field = |name: &str| {
            answer.split_whitespace().find_map(|w| w.strip_prefix(name)).map(str::to_owned)
        };
        assert_eq!(
            field("first=").as_deref(),
            Some(libc::ENETUNREACH.to_string().as_str()),
            "reuse: the first connect must fail on the spot: {answer}"
        );
        field("second=").unwrap_or_else(|| panic!("reuse: {answer}"))
    }
}

/// Runs `lb-test-client netns VIP SERVER` inside `cgroup`: in a
/// network namespace of its own, with its own listeners on `vip` (`pod-vip`)
/// and `server` (`pod-server`), it connects to `vip`. Returns its answer
/// line (`ok PEER GREETING` or `err ...`). The namespace goes with the
/// process, which has exited when this returns.
pub fn connect_from_own_netns(
    bin: &str,
    cgroup: &TestCgroup,
    vip: SocketAddr,
    server: SocketAddr,
) -> String {
    let mut cmd = Command::new(client_bin(bin));
    cmd.args(["netns", &vip.to_string(), &server.to_string()]).stdin(Stdio::null());
    start_in_cgroup(&mut cmd, &cgroup.path);
    let out =
        cmd.output().unwrap_or_else(|e| panic!("running {} netns: {e}", client_bin(bin).display()));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A server on one address that answers every client with its name (and
/// holds the connection, like [`crate::Backend`]), except that SYNs from
/// `slow_client` go to a listener whose accept queue is full: they are
/// dropped, so that client's connects stay in SYN_SENT.
pub struct SlowToOne {
    pub name: String,
    pub addr: SocketAddr,
    pub slow_client: Ipv4Addr,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    serve_thread: Option<JoinHandle<()>>,
    black_hole: Option<TcpListener>,
    /// Direct connections that fill the black hole's accept queue.
    filler: Vec<OwnedFd>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
}

/// `SKF_NET_OFF`: classic-BPF loads relative to the network header.
const SKF_NET_OFF: u32 = (-0x0010_0000i32) as u32;

impl SlowToOne {
    /// Listens on `addr` (IPv4; port 0: any free port).
    pub fn start(name: &str, addr: SocketAddr, slow_client: Ipv4Addr) -> Self {
        let serving = reuseport_listener(addr, 128);
        let addr = serving.local_addr().unwrap();
        // Same address and port; joins the group second: index 1.
        let black_hole = reuseport_listener(addr, 0);
        steer(&serving, slow_client);
        serving.set_nonblocking(true).unwrap();
        let (accepted, stop, conns) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new(HashMap::new())),
        );
        let serve_thread = {
            let (name, accepted, stop, conns) =
                (name.to_owned(), accepted.clone(), stop.clone(), conns.clone());
            thread::spawn(move || {
                static NEXT: AtomicUsize = AtomicUsize::new(0);
                while !stop.load(Ordering::Relaxed) {
                    let Ok((stream, _)) = serving.accept() else {
                        thread::sleep(Duration::from_millis(5));
                        continue;
                    };
                    let (name, accepted, conns) = (name.clone(), accepted.clone(), conns.clone());
                    thread::spawn(move || {
                        let _ = stream.set_nonblocking(false);
                        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                        let mut first = String::new();
                        if BufReader::new(&stream).read_line(&mut first).is_err()
                            || first.is_empty()
                        {
                            return; // a TCP health check
                        }
                        let _ = writeln!(&stream, "{name}");
                        accepted.fetch_add(1, Ordering::Relaxed);
                        let id = NEXT.fetch_add(1, Ordering::Relaxed) as u64;
                        if let Ok(clone) = stream.try_clone() {
                            conns.lock().unwrap().insert(id, clone);
                        }
                        let _ = stream.set_read_timeout(None);
                        let mut sink = [0u8; 64];
                        while matches!(std::io::Read::read(&mut &stream, &mut sink), Ok(n) if n > 0)
                        {
                        }
                        conns.lock().unwrap().remove(&id);
                    });
                }
            })
        };
        let mut server = Self {
            name: name.to_owned(),
            addr,
            slow_client,
            accepted,
            stop,
            serve_thread: Some(serve_thread),
            black_hole: Some(black_hole),
            filler: Vec::new(),
            conns,
        };
        server.fill_black_hole();
        server
    }

    /// Fills the black hole's accept queue with direct connects from the
    /// slow client's address (this process is in no attached cgroup: they
    /// are not rewritten or tracked), until a SYN goes unanswered; panics
    /// if none ever does, since the test would then prove nothing.
    fn fill_black_hole(&mut self) {
        for _ in 0..16 {
            let fd =
                nonblocking_connect(SocketAddr::new(IpAddr::V4(self.slow_client), 0), self.addr);
            thread::sleep(Duration::from_millis(200));
            if tcp_state(&fd) == Some(TCP_SYN_SENT) {
                // Dropped: the queue is full. This one can go.
                return;
            }
            self.filler.push(fd);
        }
        panic!(
            "{}: SYNs from {} to {} were still answered after 16 connects",
            self.name, self.slow_client, self.addr
        );
    }

    /// Client connections the serving listener answered.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Whether a SYN from the slow client to this server now goes
    /// unanswered (checked with a direct connect).
    pub fn slow_client_is_ignored(&self) -> bool {
        let fd = nonblocking_connect(SocketAddr::new(IpAddr::V4(self.slow_client), 0), self.addr);
        thread::sleep(Duration::from_millis(100));
        tcp_state(&fd) == Some(TCP_SYN_SENT)
    }

    /// Closes both listeners (new connects are refused) and its connections.
    pub fn stop(mut self) -> SocketAddr {
        self.shutdown();
        self.addr
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.serve_thread.take() {
            let _ = t.join();
        }
        self.black_hole = None;
        self.filler.clear();
        for (_, conn) in self.conns.lock().unwrap().drain() {
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for SlowToOne {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// `tcpi_state` of a connect in progress.
pub const TCP_SYN_SENT: u8 = 2;

fn check(rc: libc::c_int, what: &str) {
    assert!(rc == 0, "{what}: {}", std::io::Error::last_os_error());
}

fn sockaddr_in(addr: SocketAddr) -> libc::sockaddr_in {
    let SocketAddr::V4(addr) = addr else { panic!("{addr}: SlowToOne is IPv4 only") };
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(addr.ip().octets()) },
        sin_zero: [0; 8],
    }
}

fn tcp_socket(flags: libc::c_int) -> OwnedFd {
    // SAFETY: plain socket call.
    let fd =
        unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | flags, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: we own the new descriptor.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn reuseport_listener(addr: SocketAddr, backlog: libc::c_int) -> TcpListener {
    let fd = tcp_socket(0);
    let one: libc::c_int = 1;
    let sin = sockaddr_in(addr);
    // SAFETY: a valid socket, option value and address of the sizes we pass.
    unsafe {
        check(
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_REUSEPORT,
                (&raw const one).cast(),
                size_of::<libc::c_int>() as u32,
            ),
            "SO_REUSEPORT",
        );
        check(
            libc::bind(
                fd.as_raw_fd(),
                (&raw const sin).cast(),
                size_of::<libc::sockaddr_in>() as u32,
            ),
            &format!("bind {addr}"),
        );
        check(libc::listen(fd.as_raw_fd(), backlog), "listen");
    }
    TcpListener::from(fd)
}

/// The group's classic-BPF program: a SYN from `slow_client` (the IPv4
/// source address, at network-header offset 12) goes to the group's second
/// socket, any other to its first.
fn steer(listener: &TcpListener, slow_client: Ipv4Addr) {
    let code =
        |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter { code: code as u16, jt, jf, k };
    let program = [
        code(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0, 0, SKF_NET_OFF + 12),
        code(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, 0, 1, u32::from(slow_client)),
        code(libc::BPF_RET | libc::BPF_K, 0, 0, 1),
        code(libc::BPF_RET | libc::BPF_K, 0, 0, 0),
    ];
    let fprog = libc::sock_fprog { len: program.len() as u16, filter: program.as_ptr().cast_mut() };
    // SAFETY: a valid socket and a program that outlives the call.
    check(
        unsafe {
            libc::setsockopt(
                listener.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_REUSEPORT_CBPF,
                (&raw const fprog).cast(),
                size_of::<libc::sock_fprog>() as u32,
            )
        },
        "SO_ATTACH_REUSEPORT_CBPF",
    );
}

fn nonblocking_connect(from: SocketAddr, to: SocketAddr) -> OwnedFd {
    let fd = tcp_socket(libc::SOCK_NONBLOCK);
    let (local, remote) = (sockaddr_in(from), sockaddr_in(to));
    // SAFETY: a valid socket and addresses of the sizes we pass.
    unsafe {
        check(
            libc::bind(
                fd.as_raw_fd(),
                (&raw const local).cast(),
                size_of::<libc::sockaddr_in>() as u32,
            ),
            &format!("bind {from}"),
        );
        let rc = libc::connect(
            fd.as_raw_fd(),
            (&raw const remote).cast(),
            size_of::<libc::sockaddr_in>() as u32,
        );
        let error = std::io::Error::last_os_error();
        assert!(
            rc == 0 || error.raw_os_error() == Some(libc::EINPROGRESS),
            "connect {to}: {error}"
        );
    }
    fd
}

/// `tcpi_state` of a TCP socket (the first byte of `struct tcp_info`).
pub fn tcp_state(fd: &OwnedFd) -> Option<u8> {
    let mut info = [0u8; 256];
    let mut len = info.len() as libc::socklen_t;
    // SAFETY: a valid socket and an out-buffer of the size we pass.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(info[0])
}

/// Runs `lb run --config CONFIG` to its end (at most `timeout`): its exit
/// status (None if it had to be killed) and everything it printed.
pub fn run_to_exit(
    lb: &std::path::Path,
    config: &std::path::Path,
    timeout: Duration,
) -> (Option<std::process::ExitStatus>, String) {
    let log = config.with_extension("run.log");
    let out = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(lb)
        .args(["run", "--config"])
        .arg(config)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("starting lb run");
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    (status, text)
}
