//! The client of the hardening tests (`tests/hardening.rs`), run *inside*
//! the test cgroup so that its connects go through the datapath. Like
//! `lb-test-client` it reads commands on stdin and answers one line each:
//!
//! - `hold ADDR` → `ok ID PEER GREETING` or `err MESSAGE`: a TCP connection
//!   that stays open, with what getpeername showed and the server's name;
//! - `peer ID` → `peer ADDR`: getpeername of held connection ID, now;
//! - `alive ID` → `alive` or `dead WHY`;
//! - `connect ADDR` → `ok PEER GREETING` or `err MESSAGE`: one connect, closed
//!   at once (a refused connect answers `err connection_refused`);
//! - `churn-udp ADDR N` / `churn-tcp ADDR N` → `churned ok=K failed=F`: N
//!   sockets one after the other, each connected to ADDR, asked who it is,
//!   and closed;
//! - `cancel ADDR SOURCE N WAIT_MS` → `cancelled total=N syn_sent=S other=O`:
//!   N non-blocking connects to ADDR from the address SOURCE (any port),
//!   all closed by the application WAIT_MS after the last started;
//!   `syn_sent` counts those still in SYN_SENT then (connects the
//!   application gave up on).
//!
//! And one job from the command line, in a network namespace of its own:
//! `lb-hardening-client netns VIP SERVER` unshares a new network namespace,
//! listens there on VIP (answering `pod-vip`) and on SERVER (answering
//! `pod-server`), connects to VIP and prints `ok PEER GREETING` or
//! `err MESSAGE`. The namespace goes with the process.
//!
//! Every wait has a timeout, so a test can never hang on it.

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, ErrorKind, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

const TIMEOUT: Duration = Duration::from_secs(5);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("netns") {
        let answer = match (args.get(2), args.get(3)) {
            (Some(vip), Some(server)) => netns(vip, server).unwrap_or_else(|e| format!("err {e}")),
            _ => "err usage: netns VIP SERVER".to_owned(),
        };
        println!("{answer}");
        return;
    }
    let mut held: HashMap<u32, TcpStream> = HashMap::new();
    let mut next_id = 0u32;
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["hold", addr] => match connect(addr) {
                Ok((stream, peer, greeting)) => {
                    next_id += 1;
                    held.insert(next_id, stream);
                    format!("ok {next_id} {peer} {greeting}")
                }
                Err(e) => format!("err {e}"),
            },
            ["peer", id] => match id.parse().ok().and_then(|id: u32| held.get(&id)) {
                Some(stream) => {
                    stream.peer_addr().map_or_else(|e| format!("err {e}"), |p| format!("peer {p}"))
                }
                None => "err no such connection".to_owned(),
            },
            ["alive", id] => match id.parse().ok().and_then(|id: u32| held.get(&id)) {
                Some(stream) => alive(stream),
                None => "err no such connection".to_owned(),
            },
            ["connect", addr] => match connect(addr) {
                Ok((_, peer, greeting)) => format!("ok {peer} {greeting}"),
                Err(e) => format!("err {e}"),
            },
            ["churn-udp", addr, n] => churn(n, || udp(addr).map(drop)),
            ["churn-tcp", addr, n] => churn(n, || connect(addr).map(drop)),
            ["cancel", addr, source, n, wait_ms] => {
                cancel(addr, source, n, wait_ms).unwrap_or_else(|e| format!("err {e}"))
            }
            ["exit"] => break,
            _ => format!("err bad command {line:?}"),
        };
        let mut out = stdout.lock();
        let _ = writeln!(out, "{answer}");
        let _ = out.flush();
    }
}

fn connect(addr: &str) -> Result<(TcpStream, SocketAddr, String), String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let stream = TcpStream::connect_timeout(&addr, TIMEOUT)
        .map_err(|e| e.to_string().replace(' ', "_").to_lowercase())?;
    let peer = stream.peer_addr().map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    (&stream).write_all(b"who\n").map_err(|e| format!("send:{}", e.kind()))?;
    let mut greeting = String::new();
    BufReader::new(&stream)
        .read_line(&mut greeting)
        .map_err(|e| format!("no_greeting:{}", e.kind()))?;
    Ok((stream, peer, greeting.trim().to_owned()))
}

fn udp(addr: &str) -> Result<String, String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let bind: SocketAddr =
        if addr.is_ipv4() { "0.0.0.0:0".parse().unwrap() } else { "[::]:0".parse().unwrap() };
    let socket = UdpSocket::bind(bind).map_err(|e| e.to_string())?;
    socket.connect(addr).map_err(|e| e.to_string())?;
    socket.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    socket.send(b"who").map_err(|e| e.to_string())?;
    let mut buf = [0u8; 64];
    let n = socket.recv(&mut buf).map_err(|e| format!("no_reply:{}", e.kind()))?;
    Ok(String::from_utf8_lossy(&buf[..n]).trim().to_owned())
}

fn churn(n: &str, mut one: impl FnMut() -> Result<(), String>) -> String {
    let n: usize = n.parse().unwrap_or(0);
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..n {
        if one().is_ok() { ok += 1 } else { failed += 1 }
    }
    format!("churned ok={ok} failed={failed}")
}

/// Open means: no EOF and no error pending.
fn alive(stream: &TcpStream) -> String {
    let _ = stream.set_nonblocking(true);
    let mut buf = [0u8; 1];
    let result = stream.peek(&mut buf);
    let _ = stream.set_nonblocking(false);
    match result {
        Err(e) if e.kind() == ErrorKind::WouldBlock => "alive".to_owned(),
        Ok(0) => "dead eof".to_owned(),
        Ok(_) => "alive".to_owned(),
        Err(e) => format!("dead {}", e.kind()),
    }
}

/// `tcpi_state` of a TCP socket (the first byte of `struct tcp_info`).
fn tcp_state(fd: &OwnedFd) -> Option<u8> {
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

const TCP_SYN_SENT: u8 = 2;

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is valid; we fill one variant.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and aligned for it.
            unsafe { std::ptr::write((&raw mut storage).cast(), sin) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: 0,
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((&raw mut storage).cast(), sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// N connects the application gives up on: non-blocking, from `source`,
/// all started, then all closed after `wait_ms`, well before the SYN's
/// first retransmission timeout of one second (all at once, so that a busy
/// machine cannot stretch the whole batch past it).
fn cancel(addr: &str, source: &str, n: &str, wait_ms: &str) -> Result<String, String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let source: IpAddr = source.parse().map_err(|e| format!("bad source: {e}"))?;
    let n: usize = n.parse().map_err(|e| format!("bad count: {e}"))?;
    let wait = Duration::from_millis(wait_ms.parse().map_err(|e| format!("bad wait: {e}"))?);
    let mut sockets = Vec::with_capacity(n);
    for _ in 0..n {
        let family = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
        // SAFETY: plain socket call.
        let fd = unsafe {
            libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0)
        };
        if fd < 0 {
            return Err(format!("socket: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: we own the new descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let (local, local_len) = sockaddr(SocketAddr::new(source, 0));
        // SAFETY: a valid socket and address of the given length.
        if unsafe { libc::bind(fd.as_raw_fd(), (&raw const local).cast(), local_len) } != 0 {
            return Err(format!("bind {source}: {}", std::io::Error::last_os_error()));
        }
        let (remote, remote_len) = sockaddr(addr);
        // SAFETY: as above.
        let rc = unsafe { libc::connect(fd.as_raw_fd(), (&raw const remote).cast(), remote_len) };
        if rc != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(format!("connect {addr}: {}", std::io::Error::last_os_error()));
        }
        sockets.push(fd);
    }
    std::thread::sleep(wait);
    let syn_sent = sockets.iter().filter(|fd| tcp_state(fd) == Some(TCP_SYN_SENT)).count();
    // The application gives up: close() in SYN_SENT.
    drop(sockets);
    Ok(format!("cancelled total={n} syn_sent={syn_sent} other={}", n - syn_sent))
}

/// In a network namespace of its own: listeners on `vip` and `server`,
/// then one connect to `vip`.
fn netns(vip: &str, server: &str) -> Result<String, String> {
    let vip: SocketAddr = vip.parse().map_err(|e| format!("bad vip: {e}"))?;
    let server: SocketAddr = server.parse().map_err(|e| format!("bad server: {e}"))?;
    // SAFETY: unshare has no memory-safety preconditions; this process is
    // single-threaded here.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(format!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error()));
    }
    loopback_up()?;
    for (addr, name) in [(vip, "pod-vip"), (server, "pod-server")] {
        let listener =
            TcpListener::bind(addr).map_err(|e| format!("bind {addr} in the new netns: {e}"))?;
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = stream.set_read_timeout(Some(TIMEOUT));
                let mut line = String::new();
                let _ = BufReader::new(&stream).read_line(&mut line);
                let _ = writeln!(&stream, "{name}");
            }
        });
    }
    let (_, peer, greeting) = connect(&vip.to_string())?;
    Ok(format!("ok {peer} {greeting}"))
}

fn loopback_up() -> Result<(), String> {
    // SAFETY: plain socket/ioctl calls on a zeroed, correctly sized ifreq.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(format!("socket: {}", std::io::Error::last_os_error()));
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr) != 0 {
            return Err(format!("SIOCGIFFLAGS lo: {}", std::io::Error::last_os_error()));
        }
        ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCSIFFLAGS, &mut ifr) != 0 {
            return Err(format!("bringing lo up: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}
