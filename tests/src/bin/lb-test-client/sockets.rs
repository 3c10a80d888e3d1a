//! The client's jobs on raw sockets, where `std::net` has no call for what
//! a test needs: connects given up on in SYN_SENT (by close, shutdown or
//! `connect(AF_UNSPEC)`), Fast Open connects that never write, and
//! connects that fail on the spot.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

use lb_tests::{
    hardening::{TCP_SYN_SENT, tcp_state},
    loopback_up,
};

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

/// How an application gives up on a connect in SYN_SENT.
#[derive(Clone, Copy)]
pub enum GiveUp {
    /// `close()`: the socket is released.
    Close,
    /// `shutdown(SHUT_RDWR)`, then `close()`.
    Shutdown,
    /// `connect()` to an `AF_UNSPEC` address (a disconnect), then `close()`.
    Unspec,
}

impl std::str::FromStr for GiveUp {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "close" => Ok(Self::Close),
            "shutdown" => Ok(Self::Shutdown),
            "unspec" => Ok(Self::Unspec),
            _ => Err(format!("bad way to give up {s:?}: close, shutdown or unspec")),
        }
    }
}

/// A new TCP socket of `addr`'s family, non-blocking if `nonblocking`.
fn tcp_socket(addr: SocketAddr, nonblocking: bool) -> Result<OwnedFd, String> {
    let family = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    let flags = if nonblocking { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: plain socket call.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | flags, 0) };
    if fd < 0 {
        return Err(format!("socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: we own the new descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `connect(fd, addr)`: the error, if any, as `std::io::Error`.
fn connect_fd(fd: &OwnedFd, addr: SocketAddr) -> std::io::Result<()> {
    let (remote, remote_len) = sockaddr(addr);
    // SAFETY: a valid socket and address of the given length.
    let rc = unsafe { libc::connect(fd.as_raw_fd(), (&raw const remote).cast(), remote_len) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Sets an int socket option to 1.
fn set_flag(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, what: &str) -> Result<(), String> {
    let on: libc::c_int = 1;
    // SAFETY: a valid socket and an int option of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&raw const on).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 { Ok(()) } else { Err(format!("{what}: {}", std::io::Error::last_os_error())) }
}

/// N connects the application gives up on: non-blocking, from `source`,
/// all started, then all given up on `how` after `wait_ms`, well before
/// the SYN's first retransmission timeout of one second (all at once, so
/// that a busy machine cannot stretch the whole batch past it).
pub fn cancel(
    addr: &str,
    source: &str,
    n: &str,
    wait_ms: &str,
    how: &str,
) -> Result<String, String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let source: IpAddr = source.parse().map_err(|e| format!("bad source: {e}"))?;
    let n: usize = n.parse().map_err(|e| format!("bad count: {e}"))?;
    let wait = Duration::from_millis(wait_ms.parse().map_err(|e| format!("bad wait: {e}"))?);
    let how: GiveUp = how.parse()?;
    let mut sockets = Vec::with_capacity(n);
    for _ in 0..n {
        let fd = tcp_socket(addr, true)?;
        let (local, local_len) = sockaddr(SocketAddr::new(source, 0));
        // SAFETY: a valid socket and address of the given length.
        if unsafe { libc::bind(fd.as_raw_fd(), (&raw const local).cast(), local_len) } != 0 {
            return Err(format!("bind {source}: {}", std::io::Error::last_os_error()));
        }
        match connect_fd(&fd, addr) {
            Err(e) if e.raw_os_error() != Some(libc::EINPROGRESS) => {
                return Err(format!("connect {addr}: {e}"));
            }
            _ => sockets.push(fd),
        }
    }
    std::thread::sleep(wait);
    let syn_sent = sockets.iter().filter(|fd| tcp_state(fd) == Some(TCP_SYN_SENT)).count();
    for fd in &sockets {
        give_up(fd, how)?;
    }
    drop(sockets);
    Ok(format!("cancelled total={n} syn_sent={syn_sent} other={}", n - syn_sent))
}

/// Gives up on the connect of `fd` as `how` says (a close follows anyway).
fn give_up(fd: &OwnedFd, how: GiveUp) -> Result<(), String> {
    match how {
        GiveUp::Close => Ok(()),
        GiveUp::Shutdown => {
            // SAFETY: a valid socket.
            if unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) } != 0 {
                return Err(format!("shutdown: {}", std::io::Error::last_os_error()));
            }
            Ok(())
        }
        GiveUp::Unspec => {
            // SAFETY: an all-zero sockaddr is valid; AF_UNSPEC is 0.
            let unspec: libc::sockaddr = unsafe { std::mem::zeroed() };
            // SAFETY: a valid socket and address of the given length.
            let rc = unsafe {
                libc::connect(
                    fd.as_raw_fd(),
                    &raw const unspec,
                    size_of::<libc::sockaddr>() as libc::socklen_t,
                )
            };
            if rc != 0 {
                return Err(format!("connect(AF_UNSPEC): {}", std::io::Error::last_os_error()));
            }
            Ok(())
        }
    }
}

/// The IPv4-mapped form of an IPv4 `addr`, as an IPv6 socket dials it.
fn mapped(addr: SocketAddr) -> Result<SocketAddr, String> {
    match addr {
        SocketAddr::V4(a) => Ok(SocketAddr::new(IpAddr::V6(a.ip().to_ipv6_mapped()), a.port())),
        SocketAddr::V6(_) => Err(format!("{addr} is not an IPv4 address")),
    }
}

/// An IPv6-only socket's connect to the IPv4 `vip` dialled IPv4-mapped:
/// connect6 rewrites it, then the kernel's connect fails on the spot
/// (`ENETUNREACH`). The socket stays open.
fn fail_on_the_spot(vip: SocketAddr) -> Result<(OwnedFd, std::io::Error), String> {
    let dial = mapped(vip)?;
    let fd = tcp_socket(dial, true)?;
    set_flag(&fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, "IPV6_V6ONLY")?;
    match connect_fd(&fd, dial) {
        Ok(()) => Err(format!("the connect to {dial} from an IPv6-only socket worked")),
        Err(e) => Ok((fd, e)),
    }
}

/// `failfast VIP N`: N connects to the IPv4 `vip` that fail on the spot
/// (see [`fail_on_the_spot`]), their sockets kept open in `stuck`.
pub fn failfast(vip: &str, n: Option<&str>, stuck: &mut Vec<OwnedFd>) -> Result<String, String> {
    let vip: SocketAddr = vip.parse().map_err(|e| format!("bad address: {e}"))?;
    let n: usize =
        n.ok_or("usage: failfast VIP N")?.parse().map_err(|e| format!("bad count: {e}"))?;
    let mut unreachable = 0;
    for _ in 0..n {
        let (fd, error) = fail_on_the_spot(vip)?;
        if error.raw_os_error() == Some(libc::ENETUNREACH) {
            unreachable += 1;
        }
        stuck.push(fd);
    }
    Ok(format!("failfast total={n} unreachable={unreachable}"))
}

/// `reuse VIP OTHER`: one socket's connect to the IPv4 `vip` fails on the
/// spot (see [`fail_on_the_spot`]), then the same socket connects to the
/// IPv6 `other`, blocking; answers `reuse first=ERRNO second=OUTCOME`
/// (`ok` or the error's kind).
pub fn reuse(vip: &str, other: Option<&str>) -> Result<String, String> {
    let vip: SocketAddr = vip.parse().map_err(|e| format!("bad address: {e}"))?;
    let other: SocketAddr =
        other.ok_or("usage: reuse VIP OTHER")?.parse().map_err(|e| format!("bad address: {e}"))?;
    let (fd, first) = fail_on_the_spot(vip)?;
    // Blocking from here: the second connect's outcome is its return.
    // SAFETY: a valid socket; F_SETFL with plain flags.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, 0) };
    let second = match connect_fd(&fd, other) {
        Ok(()) => "ok".to_owned(),
        Err(e) => format!("{:?}", e.kind()),
    };
    Ok(format!("reuse first={} second={second}", first.raw_os_error().unwrap_or(0)))
}

/// N `TCP_FASTOPEN_CONNECT` connects that never write: connect() returns
/// at once with the socket in SYN_SENT and no SYN sent; then close().
pub fn fastopen(addr: &str, n: Option<&str>) -> Result<String, String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let n: usize =
        n.ok_or("usage: fastopen ADDR N")?.parse().map_err(|e| format!("bad count: {e}"))?;
    // A network namespace is a thread's own: the rest of this client stays
    // in its namespace.
    std::thread::spawn(move || {
        // SAFETY: unshare takes no pointers; it moves only this thread.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(format!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error()));
        }
        loopback_up().map_err(|e| format!("bringing lo up: {e}"))?;
        // Client Fast Open without a cookie, in this namespace only: the
        // connect is deferred to the first write.
        std::fs::write("/proc/sys/net/ipv4/tcp_fastopen", "5")
            .map_err(|e| format!("net.ipv4.tcp_fastopen: {e}"))?;
        fastopen_connects(addr, n)
    })
    .join()
    .map_err(|_| "the fast-open thread panicked".to_owned())?
}

/// See [`fastopen`]: the connects, in the current network namespace.
fn fastopen_connects(addr: SocketAddr, n: usize) -> Result<String, String> {
    let mut sockets = Vec::with_capacity(n);
    for _ in 0..n {
        let fd = tcp_socket(addr, false)?;
        set_flag(&fd, libc::IPPROTO_TCP, libc::TCP_FASTOPEN_CONNECT, "TCP_FASTOPEN_CONNECT")?;
        connect_fd(&fd, addr).map_err(|e| format!("connect {addr}: {e}"))?;
        sockets.push(fd);
    }
    let syn_sent = sockets.iter().filter(|fd| tcp_state(fd) == Some(TCP_SYN_SENT)).count();
    drop(sockets);
    Ok(format!("fastopen total={n} syn_sent={syn_sent}"))
}

/// `pod VIP SERVER`: a connection made from a network namespace of its
/// own, as a pod makes it. A thread unshares the namespace, listens there
/// on SERVER (answering `pod-server` and holding every connection) and
/// connects to VIP; the connection is returned to the caller, which can
/// watch it from its own namespace. The listener's thread keeps the
/// namespace for the life of the process.
pub fn pod(vip: &str, server: Option<&str>) -> Result<(TcpStream, SocketAddr, String), String> {
    let server: SocketAddr =
        server.ok_or("usage: pod VIP SERVER")?.parse().map_err(|e| format!("bad server: {e}"))?;
    let vip = vip.to_owned();
    std::thread::spawn(move || {
        // SAFETY: unshare takes no pointers; it moves only this thread.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(format!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error()));
        }
        loopback_up().map_err(|e| format!("bringing lo up: {e}"))?;
        let listener =
            TcpListener::bind(server).map_err(|e| format!("bind {server} in the pod: {e}"))?;
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming().flatten() {
                let _ = stream.set_read_timeout(Some(super::TIMEOUT));
                let mut line = String::new();
                let _ = BufReader::new(&stream).read_line(&mut line);
                let _ = writeln!(&stream, "pod-server");
                held.push(stream);
            }
        });
        super::connect(&vip)
    })
    .join()
    .map_err(|_| "the pod's thread panicked".to_owned())?
}
