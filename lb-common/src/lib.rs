//! Types shared by the kernel programs (`lb-ebpf`) and the daemon (`lb-user`).
//!
//! Everything here is `#[repr(C)]` with explicit padding and no `bool`, enum
//! or `Option`, because it crosses the user/kernel boundary as raw bytes in
//! BPF maps and ring-buffer records. Sizes are asserted at compile time so a
//! layout change cannot slip through on one side only.
//!
//! The `user` feature adds the userspace-only conversions (`user` module).
#![no_std]

#[cfg(feature = "user")]
pub mod user;

/// Most servers one service can select from (the kernel walks this many).
pub const MAX_SERVERS: usize = 16;

/// Map capacities. The daemon refuses configurations that would not fit.
pub const MAX_SERVICES: u32 = 16_384;
pub const MAX_TRACKED_SOCKETS: u32 = 262_144;
pub const MAX_SERVER_PAIRS: u32 = 65_536;
pub const MAX_FAILED_SERVERS: u32 = 16_384;
pub const EVENTS_BYTES: u32 = 256 * 1024;

/// Names of the maps, as the object file and the pin directory know them.
pub mod maps {
    pub const SERVICES: &str = "SERVICES";
    pub const FAILED_AT: &str = "FAILED_AT";
    pub const SOCKETS: &str = "SOCKETS";
    pub const CONNECTIONS: &str = "CONNECTIONS";
    pub const EVENTS: &str = "EVENTS";
    pub const COUNTERS: &str = "COUNTERS";
    /// Every map the daemon pins, in one list so attach, adopt and detach agree.
    pub const ALL: [&str; 6] = [SERVICES, FAILED_AT, SOCKETS, CONNECTIONS, EVENTS, COUNTERS];
}

/// Names of the programs in the object file; also their link pin names.
pub mod programs {
    pub const CONNECT4: &str = "lb_connect4";
    pub const CONNECT6: &str = "lb_connect6";
    pub const GETPEERNAME4: &str = "lb_getpeername4";
    pub const GETPEERNAME6: &str = "lb_getpeername6";
    pub const SOCK_OPS: &str = "lb_sock_ops";
    pub const ALL: [&str; 5] = [CONNECT4, CONNECT6, GETPEERNAME4, GETPEERNAME6, SOCK_OPS];
    /// Without these there is no load balancing: a kernel lacking them is
    /// an error.
    pub const REQUIRED: [&str; 3] = [CONNECT4, CONNECT6, SOCK_OPS];
    /// The getpeername hooks (Linux 5.8+): without them applications see
    /// the server's address instead of the VIP; lb degrades and says so.
    pub const OPTIONAL: [&str; 2] = [GETPEERNAME4, GETPEERNAME6];
}

/// An IP endpoint exactly as `bpf_sock_addr` carries it: the address as four
/// 32-bit words in network byte order (IPv4 as IPv4-mapped IPv6,
/// `::ffff:a.b.c.d`) and the port in network byte order.
///
/// Keeping IPv4 in mapped form lets one lookup serve `connect4` and an
/// IPv4-mapped destination on an IPv6 socket in `connect6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub _pad: [u8; 2],
}

/// The third word of an IPv4-mapped address (`::ffff:0:0/96`), as it is laid
/// out in memory (network byte order) and read as a native `u32`.
pub const V4_MAPPED_WORD: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

impl Endpoint {
    /// An IPv4 endpoint from the values `user_ip4` / `user_port` hold.
    pub const fn from_v4_raw(ip4: u32, port_be: u16) -> Self {
        Self { addr: [0, 0, V4_MAPPED_WORD, ip4], port: port_be, _pad: [0; 2] }
    }

    /// Whether the address is IPv4 (stored IPv4-mapped).
    pub const fn is_v4(&self) -> bool {
        self.addr[0] == 0 && self.addr[1] == 0 && self.addr[2] == V4_MAPPED_WORD
    }
}

/// The value of the `SERVICES` map, keyed by the VIP's [`Endpoint`].
///
/// The daemon replaces the whole value in one map update; the kernel never
/// sees a half-written selection.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Service {
    /// The selection, best first. Only the first `count` entries are valid.
    pub servers: [Endpoint; MAX_SERVERS],
    /// Number of valid entries in `servers`. Zero means "refuse connects".
    pub count: u32,
    /// The kernel picks at random among the usable servers of the first
    /// `spread` entries; if none of them is usable, the first usable one
    /// after them; if none at all, the first. 0 and 1 both mean strict order
    /// (failover).
    pub spread: u32,
    /// A server whose connect failed less than this long ago is skipped
    /// while another one is usable.
    pub hold_down_ns: u64,
}

impl Default for Service {
    fn default() -> Self {
        Self { servers: [Endpoint::default(); MAX_SERVERS], count: 0, spread: 1, hold_down_ns: 0 }
    }
}

/// `SockEntry::flags`: the connection reached ESTABLISHED and is counted.
pub const SOCK_ESTABLISHED: u32 = 1 << 0;
/// `SockEntry::flags`: a failure was already reported for this connect.
pub const SOCK_FAILURE_REPORTED: u32 = 1 << 1;

/// The value of the `SOCKETS` map, keyed by socket cookie: a socket whose
/// connect went through a VIP.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockEntry {
    pub vip: Endpoint,
    pub server: Endpoint,
    /// `SOCK_*` bits.
    pub flags: u32,
    pub _pad: u32,
}

/// The key of the `CONNECTIONS` map (per-CPU live connection counts): the
/// service's VIP and the server the connection went to. The daemon sums the
/// per-CPU values; an open on one CPU and a close on another still net out.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConnKey {
    pub vip: Endpoint,
    pub server: Endpoint,
}

/// `Event::kind`: a connect through a VIP established.
pub const EVENT_ESTABLISHED: u32 = 1;
/// `Event::kind`: a connect through a VIP closed before establishing
/// (refused, reset, timed out, abandoned).
pub const EVENT_CONNECT_FAILED: u32 = 2;
/// `Event::kind`: a connect's SYN went unanswered for a retransmission
/// timeout; it may still establish later.
pub const EVENT_CONNECT_TIMEOUT: u32 = 3;
/// `Event::kind`: an established connection through a VIP closed.
pub const EVENT_CLOSED: u32 = 4;

/// A ring-buffer record from `sock_ops` about one connection through a VIP.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    pub cookie: u64,
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) when it happened.
    pub time_ns: u64,
    pub vip: Endpoint,
    pub server: Endpoint,
    /// `EVENT_*`.
    pub kind: u32,
    pub _pad: u32,
}

/// Index of a per-CPU counter in the `COUNTERS` array: why a program did
/// what it did. Every early return of every program is counted.
pub mod reason {
    /// connect: destination was a VIP and was rewritten.
    pub const CONNECT_REWRITTEN: u32 = 0;
    /// connect: destination is not a VIP; untouched.
    pub const CONNECT_NOT_VIP: u32 = 1;
    /// connect: the VIP's service has no server; connect refused (EPERM).
    pub const CONNECT_NO_SERVER: u32 = 2;
    /// connect: every server failed recently; the first was used anyway.
    pub const CONNECT_ALL_FAILED: u32 = 3;
    /// connect: a recently failed server was skipped.
    pub const CONNECT_SKIPPED_FAILED: u32 = 4;
    /// connect: protocol is neither TCP nor UDP; untouched.
    pub const CONNECT_OTHER_PROTOCOL: u32 = 5;
    /// connect4: the selected server is IPv6, unreachable from an IPv4
    /// socket; untouched (the daemon's config check prevents this).
    pub const CONNECT_FAMILY_MISMATCH: u32 = 6;
    /// connect: the socket table was full; rewritten but not tracked.
    pub const CONNECT_UNTRACKED: u32 = 7;
    /// getpeername: the VIP was reported instead of the server.
    pub const GETPEERNAME_REWRITTEN: u32 = 8;
    /// getpeername: not a socket connected through a VIP; untouched.
    pub const GETPEERNAME_UNTOUCHED: u32 = 9;
    /// sock_ops: a tracked connect established.
    pub const SOCKOPS_ESTABLISHED: u32 = 10;
    /// sock_ops: a tracked connect failed before establishing.
    pub const SOCKOPS_CONNECT_FAILED: u32 = 11;
    /// sock_ops: a tracked connect's SYN timed out once.
    pub const SOCKOPS_CONNECT_TIMEOUT: u32 = 12;
    /// sock_ops: a tracked connection closed.
    pub const SOCKOPS_CLOSED: u32 = 13;
    /// sock_ops: a callback for a socket that is not tracked; ignored.
    pub const SOCKOPS_UNTRACKED: u32 = 14;
    /// sock_ops: the event ring buffer was full; the event was dropped
    /// (counts and failure marks are still updated).
    pub const EVENT_DROPPED: u32 = 15;
    /// Any program: a map update failed.
    pub const MAP_ERROR: u32 = 16;

    /// Number of counters (the `COUNTERS` array's size).
    pub const COUNT: u32 = 17;

    /// Stable names for metrics and `lb status`, indexed by reason.
    pub const NAMES: [&str; COUNT as usize] = [
        "connect_rewritten",
        "connect_not_vip",
        "connect_no_server",
        "connect_all_failed",
        "connect_skipped_failed",
        "connect_other_protocol",
        "connect_family_mismatch",
        "connect_untracked",
        "getpeername_rewritten",
        "getpeername_untouched",
        "sockops_established",
        "sockops_connect_failed",
        "sockops_connect_timeout",
        "sockops_closed",
        "sockops_untracked",
        "event_dropped",
        "map_error",
    ];
}

// The kernel and the daemon must agree on these byte for byte.
const _: () = assert!(core::mem::size_of::<Endpoint>() == 20);
const _: () = assert!(core::mem::size_of::<Service>() == 20 * MAX_SERVERS + 16);
const _: () = assert!(core::mem::size_of::<SockEntry>() == 48);
const _: () = assert!(core::mem::size_of::<ConnKey>() == 40);
const _: () = assert!(core::mem::size_of::<Event>() == 64);
const _: () = assert!(core::mem::align_of::<Service>() == 8);
