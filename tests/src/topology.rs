//! The external path's test topology (see `tests/tests/external/`): three network
//! namespaces joined by veths, and what the tests ask of them. Shared by
//! the external path's test files.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use crate::{
    Backend, Namespace,
    pass_xdp::{PassThrough, attach_pass_through},
    sh,
};

pub const VIP4: &str = "198.18.1.100:80";
pub const VIP6: &str = "[2001:2:0:1::100]:80";

/// How long a test waits for a VIP to answer once its daemon runs (or
/// reloads): `lb_xdp`'s attach, which the verifier takes seconds over
/// (some 14 s on 6.1 under a guest's software emulation).
pub const SERVING_WITHIN: Duration = Duration::from_secs(60);

/// The three namespaces and what runs in them; the test body runs in the
/// node's (`in_new_netns`).
pub struct Topology {
    pub client: Namespace,
    pub servers: Namespace,
    /// The pass-through programs on c0 and s0, attached while this lives.
    _peers: Vec<PassThrough>,
}

impl Topology {
    /// Builds the picture above; the calling thread is the node. The
    /// client reaches the VIPs through the node as its router.
    #[expect(clippy::new_without_default, reason = "it builds namespaces: not a default")]
    pub fn new() -> Self {
        Self::build(false)
    }

    /// As [`Self::new`], but the client has the VIPs' subnets on its link:
    /// it asks who has a VIP (ARP, neighbour solicitation), and only an
    /// announcing node answers.
    pub fn on_link() -> Self {
        Self::build(true)
    }

    pub fn build(on_link: bool) -> Self {
        let client = Namespace::new();
        let servers = Namespace::new();
        let (c, s) = (client.tid.to_string(), servers.tid.to_string());
        // Interfaces that have long been up, as on a real node: no
        // duplicate address detection, whose tentative link-local address
        // keeps IPv6 from soliciting its neighbours for the first second.
        for ns in [&client, &servers] {
            ns.sh(&["sysctl", "-qw", "net.ipv6.conf.default.accept_dad=0"]);
        }
        sh(&["sysctl", "-qw", "net.ipv6.conf.default.accept_dad=0"]);
        sh(&["ip", "link", "add", "ext0", "type", "veth", "peer", "name", "c0", "netns", &c]);
        sh(&["ip", "link", "add", "srv0", "type", "veth", "peer", "name", "s0", "netns", &s]);
        for (dev, v4, v6) in [
            ("ext0", "198.18.0.1/24", "2001:2::1/64"),
            ("srv0", "198.18.2.1/24", "2001:2:0:2::1/64"),
        ] {
            sh(&["ip", "addr", "add", v4, "dev", dev]);
            sh(&["ip", "addr", "add", v6, "dev", dev, "nodad"]);
            sh(&["ip", "link", "set", dev, "up"]);
        }
        sh(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        sh(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
        client.sh(&["ip", "addr", "add", "198.18.0.10/24", "dev", "c0"]);
        client.sh(&["ip", "addr", "add", "2001:2::10/64", "dev", "c0", "nodad"]);
        client.sh(&["ip", "link", "set", "c0", "up"]);
        if on_link {
            client.sh(&["ip", "route", "add", "198.18.1.0/24", "dev", "c0"]);
            client.sh(&["ip", "route", "add", "2001:2:0:1::/64", "dev", "c0"]);
        } else {
            client.sh(&["ip", "route", "add", "198.18.1.0/24", "via", "198.18.0.1"]);
            client.sh(&["ip", "route", "add", "2001:2:0:1::/64", "via", "2001:2::1"]);
        }
        for a in ["198.18.2.2/24", "198.18.2.3/24", "198.18.2.4/24"] {
            servers.sh(&["ip", "addr", "add", a, "dev", "s0"]);
        }
        for a in ["2001:2:0:2::2/64", "2001:2:0:2::3/64"] {
            servers.sh(&["ip", "addr", "add", a, "dev", "s0", "nodad"]);
        }
        servers.sh(&["ip", "link", "set", "s0", "up"]);
        // A veth hands the stack's packets over with the TCP and UDP
        // checksums left to "hardware" (CHECKSUM_PARTIAL); a frame the XDP
        // program redirects loses that mark and arrives with a checksum
        // that was never finished. A real client's NIC finishes it.
        client.run(|| tx_checksums_off("c0"));
        servers.run(|| tx_checksums_off("s0"));
        let peers = vec![client.run(|| pass_through("c0")), servers.run(|| pass_through("s0"))];
        Self { client, servers, _peers: peers }
    }

    /// Attaches a pass-through program to `dev` in this thread's
    /// namespace (generic mode), as a foreign XDP program would be: lb
    /// cannot attach there while it is. Detached when dropped.
    pub fn occupy_xdp(&self, dev: &str) -> PassThrough {
        attach_pass_through(dev, true)
    }

    /// A server in the servers' namespace that answers with its name.
    pub fn server(&self, name: &str, addr: &str) -> Backend {
        let (name, addr): (String, SocketAddr) = (name.to_owned(), addr.parse().unwrap());
        self.servers.run(move || Backend::start(&name, addr))
    }

    /// A TCP connection from the client's namespace.
    pub fn connect(&self, to: &str) -> std::io::Result<TcpStream> {
        let to: SocketAddr = to.parse().unwrap();
        self.client.run(move || TcpStream::connect_timeout(&to, Duration::from_secs(3)))
    }

    /// Waits until a new connection to `vip` reaches `server` (any
    /// server: `None`), for at most [`SERVING_WITHIN`]: whether it did.
    pub fn wait_serving(&self, vip: &str, server: Option<&str>) -> bool {
        crate::wait_until(SERVING_WITHIN, || {
            self.ask(vip).is_ok_and(|name| server.is_none_or(|s| s == name))
        })
    }

    /// Which server a new connection to `to` reaches, or why none.
    pub fn ask(&self, to: &str) -> Result<String, String> {
        let stream = self.connect(to).map_err(|e| e.to_string())?;
        who(&stream)
    }

    /// Which server answers a UDP datagram to `to`.
    pub fn ask_udp(&self, to: &str) -> Result<String, String> {
        let to: SocketAddr = to.parse().unwrap();
        self.client.run(move || {
            let any: SocketAddr =
                if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().unwrap();
            let socket = std::net::UdpSocket::bind(any).map_err(|e| e.to_string())?;
            socket.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            socket.send_to(b"who", to).map_err(|e| e.to_string())?;
            let mut buf = [0u8; 64];
            let (n, from) = socket.recv_from(&mut buf).map_err(|e| e.to_string())?;
            if from != to {
                return Err(format!("the answer came from {from}, not the VIP {to}"));
            }
            Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
        })
    }
}

/// A program that passes every packet, natively on `dev` (in the calling
/// thread's namespace): gives the veth the NAPI that redirected packets
/// need. Attached while the value lives.
pub fn pass_through(dev: &str) -> PassThrough {
    attach_pass_through(dev, false)
}

/// Turns `dev`'s transmit checksum offload off (`ethtool -K dev tx off`,
/// by its ioctl): the stack then finishes every checksum itself.
pub fn tx_checksums_off(dev: &str) {
    const ETHTOOL_STXCSUM: u32 = 0x17;
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    let mut value = EthtoolValue { cmd: ETHTOOL_STXCSUM, data: 0 };
    // SAFETY: a zeroed ifreq is valid; the socket is owned at once; the
    // ioctl reads `value` through the pointer while it lives.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let fd = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (dst, src) in ifr.ifr_name.iter_mut().zip(dev.as_bytes()) {
            *dst = *src as libc::c_char;
        }
        ifr.ifr_ifru.ifru_data = (&raw mut value).cast();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&fd);
        assert_eq!(
            libc::ioctl(fd, libc::SIOCETHTOOL, &mut ifr),
            0,
            "ETHTOOL_STXCSUM on {dev}: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The server's name, as it answers `who` on a connection.
pub fn who(mut stream: &TcpStream) -> Result<String, String> {
    stream.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    stream.write_all(b"who\n").map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).map_err(|e| e.to_string())?;
    if line.is_empty() {
        return Err("closed without an answer".to_owned());
    }
    Ok(line.trim().to_owned())
}

/// Whether a connection held open (its server said `who` already, and now
/// only reads) still carries data: written to three times, it is neither
/// reset (a node's answer to a packet of no flow) nor closed, and reading
/// finds nothing to read rather than its end. `Err` says what broke.
pub fn carries_data(mut held: &TcpStream) -> Result<(), String> {
    for _ in 0..3 {
        held.write_all(b"still there\n").map_err(|e| format!("writing: {e}"))?;
        std::thread::sleep(Duration::from_millis(200));
    }
    held.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let mut buf = [0u8; 16];
    match std::io::Read::read(&mut held, &mut buf) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Ok(())
        }
        Ok(0) => Err("closed".to_owned()),
        other => Err(format!("reading: {other:?}")),
    }
}

/// Whether segments of a held connection go the short way: bursts of
/// one-byte writes (`TCP_NODELAY`), each segment after the first of a
/// burst within a kept route's life (10 jiffies) of the one before, until
/// `short_count` (the daemon's `xdp_forwarded_short`) grows. A slow or
/// emulated machine may let a burst's segments fall further apart than
/// that: up to ten bursts, 200 ms apart; a short way that never takes
/// any segment fails all ten.
pub fn goes_the_short_way(mut held: &TcpStream, short_count: impl Fn() -> u64) -> bool {
    held.set_nodelay(true).expect("TCP_NODELAY");
    let before = short_count();
    for _ in 0..10 {
        for _ in 0..20 {
            held.write_all(b"x").expect("writing a burst");
        }
        if crate::wait_until(Duration::from_millis(200), || short_count() > before) {
            return true;
        }
    }
    false
}

/// The id of the XDP program attached to `dev` (in this namespace).
pub fn xdp_id(dev: &str) -> Option<u32> {
    let out =
        std::process::Command::new("ip").args(["-d", "link", "show", "dev", dev]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let words: Vec<&str> = text.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "prog/xdp")?;
    words.get(at + 2)?.parse().ok()
}

/// Whether an XDP program is attached to `dev` (in this namespace).
pub fn has_xdp(dev: &str) -> bool {
    let out =
        std::process::Command::new("ip").args(["-d", "link", "show", "dev", dev]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).contains("prog/xdp")
}

/// The link-layer address the client's neighbour table holds for `ip`,
/// if it holds one that is usable.
pub fn client_neighbour(net: &Topology, ip: &str) -> Option<String> {
    neighbour(&net.client, ip)
}

/// The link-layer address the neighbour table of `ns` holds for `ip` on
/// `c0` (a client's link), if it holds one that is usable.
pub fn neighbour(ns: &Namespace, ip: &str) -> Option<String> {
    let ip = ip.to_owned();
    ns.run(move || {
        let out = std::process::Command::new("ip")
            .args(["neigh", "show", &ip, "dev", "c0"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let words: Vec<&str> = text.split_whitespace().collect();
        let at = words.iter().position(|w| *w == "lladdr")?;
        Some(words.get(at + 1)?.to_string())
    })
}

/// The node's MAC address on `dev` (in this network namespace).
pub fn mac_of(dev: &str) -> String {
    let out = std::process::Command::new("ip")
        .args(["-br", "link", "show", "dev", dev])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().nth(2).unwrap_or_default().to_owned()
}

/// The address the server sees `stream` come from (it answers `peer`
/// with it): the client's own, or the node's NAT source.
pub fn peer(mut stream: &TcpStream) -> Result<SocketAddr, String> {
    stream.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    stream.write_all(b"peer\n").map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).map_err(|e| e.to_string())?;
    line.trim().parse().map_err(|e| format!("{line:?}: {e}"))
}
