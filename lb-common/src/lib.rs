//! Types shared by the kernel programs (`lb-ebpf`) and the daemon (`lb-user`).
//!
//! Every map key, map value and ring-buffer record here is `#[repr(C)]` with
//! explicit padding and no `bool`, enum or `Option`, because it crosses the
//! user/kernel boundary as raw bytes. Sizes are asserted at compile time so a
//! layout change cannot slip through on one side only. The enums
//! ([`EventKind`], [`Reason`]) name the raw `u32` values those records and
//! the `COUNTERS` array carry; they are converted at the edge, never stored.
//!
//! [`choose`] is the kernel's choice of a server, a pure function tested on
//! the host; [`UdpPeers`] (module `udp`) a UDP socket's reverse mapping,
//! with the functions the sendmsg and recvmsg programs use on it;
//! [`Reason`] (module `reason`) the counters' names; module `external` the
//! flow and NAT tables of the XDP path, and [`checksum`] its incremental
//! checksum updates; [`reference`](mod@reference) the map of the bench's reference
//! forwarder (not lb's). The `user` feature adds the userspace-only
//! conversions (`user` module).
#![no_std]
#![warn(missing_docs)]

pub mod checksum;
pub mod choose;
mod flow_tables;
pub mod maglev;
pub mod maps;
pub mod nat;
pub mod programs;
mod reason;
pub mod reference;
mod udp;
#[cfg(feature = "user")]
pub mod user;

pub use flow_tables::{
    AnnounceKey, AnnounceValue, Flow, FlowKey, MAX_EXTERNAL_FLOWS, NAT_PORT_COUNT, NAT_PORT_FIRST,
    NAT_REPLY_ESTABLISHED, NAT_REPLY_SYN, NatKey, NatReply, TRAFFIC_SLOT_COUNT,
    TRAFFIC_SLOT_IDLE_TICKS, Traffic, TrafficSlot, traffic_slot, udp_flow_table,
};
pub use reason::{Reason, UnknownReason};
pub use udp::{UdpPeer, UdpPeers};

/// Most servers one service can select from (the kernel walks this many).
pub const MAX_SERVERS: usize = 16;

/// Map capacities. The daemon refuses configurations that would not fit.
pub const MAX_SERVICES: u32 = 16_384;
/// TCP sockets connected through a VIP (`SOCKETS`): more than the
/// ephemeral ports one source address has for one server (28,232 by
/// default). Not larger: each connect through a VIP touches a random
/// bucket of this table (and, where connect4 cannot mark sockets, every
/// TCP connect in the cgroup does), and at 262,144 entries (4 MB of
/// buckets) those touches missed the CPU's caches: about 150 ns more
/// program time per connect (`bpf_stats`). A connect beyond it is still
/// balanced, only not tracked (`connect_untracked`: no live count, no
/// failure mark, no getpeername). A datapath adopted from pins keeps the
/// size it was created with.
pub const MAX_TRACKED_SOCKETS: u32 = 65_536;
/// Connected UDP sockets through a VIP (`SOCKETS_UDP`), apart from TCP so
/// that a churn of UDP sockets never takes a TCP connection's slot. Small
/// for the same reason as `SOCKETS`: the release of every UDP socket in the
/// cgroup (a DNS query each) looks it up.
pub const MAX_TRACKED_UDP_SOCKETS: u32 = 16_384;
/// UDP sockets that sent to or connected through a VIP (`UDP_PEERS`): the
/// reverse mapping that makes their answers come from the VIP. As small
/// as `SOCKETS_UDP`, for the same reason: every UDP socket's release and
/// every `recvfrom()` of the cgroup looks it up.
pub const MAX_UDP_PEER_SOCKETS: u32 = 16_384;
/// The (VIP, server) pairs one UDP socket's entry in `UDP_PEERS` holds:
/// one per VIP it sends to (a resolver sends to each of its name servers),
/// the oldest replaced by a fifth.
pub const UDP_PEERS_PER_SOCKET: usize = 4;
/// TCP connects between connect4 and their SYN (`CONNECTING`, kernel-only):
/// microseconds each, or until the first write of a `TCP_FASTOPEN_CONNECT`
/// socket. An LRU map: a connect that failed on the spot (it never sends a
/// SYN) leaves its entry until its socket is released, and such leftovers
/// are evicted, oldest first, instead of filling anything.
pub const MAX_CONNECTING_SOCKETS: u32 = 16_384;
/// (VIP, server) pairs with live connection counts (`CONNECTIONS`).
pub const MAX_SERVER_PAIRS: u32 = 65_536;
/// Servers with a failure mark (`FAILED_AT`).
pub const MAX_FAILED_SERVERS: u32 = 16_384;
/// Size of the `EVENTS` ring buffer.
pub const EVENTS_BYTES: u32 = 256 * 1024;
/// Interfaces `lb_xdp` runs on, at most (`LINK_MACS`).
pub const MAX_LINKS: u32 = 1024;
/// Slots of `COUNTERS`, one per [`Reason`] and room for the reasons of
/// later versions: an upgrade adopts the pinned map as it was made, and a
/// map sized by the reasons of its day would not count the new ones.
pub const COUNTER_SLOTS: u32 = 128;
const _: () = assert!(Reason::COUNT as u32 <= COUNTER_SLOTS);

/// The layout of the pinned maps (their names, types, keys and values).
/// A daemon adopts pins only of its own layout; it is written to
/// `META[META_LAYOUT_VERSION]` at attach. Bump it with every change a
/// daemon of the previous version could not read or write correctly.
///
/// 1 (implicit: no `META` map): before the daemon checked the layout of
/// the pins it adopts.
/// 2: `META`; `SOCKETS` a plain hash map of TCP sockets, `SOCKETS_UDP`;
/// `Service::netns_cookie`; the `lb_sock_release` program.
/// 3: `Service::daemon_states`.
/// 4: `UDP_PEERS`; the sendmsg and recvmsg programs.
/// 5: the external path's maps (`EXTERNAL`, `NODE_ADDRESSES`, `FLOWS`,
/// `NAT_REPLIES`, `TRAFFIC`) and its XDP program.
/// 6: `ANNOUNCE`, the addresses the XDP program answers ARP and neighbour
/// solicitations for; `MAGLEV`, the consistent-hash tables.
/// 7: `ANNOUNCE_UNTIL`, when an elected node's answers stop by themselves
/// (its lease's fence); `LINK_MACS`, the MAC of each interface `lb_xdp`
/// runs on.
/// 8: `TRAFFIC_SLOTS`, where the external path counts most of its
/// traffic; `MARKED_AT`, the failure marks' stamps.
/// 9: `OPENING_FLOWS` and `OPENING_REPLIES`, the external path's flows
/// until they are established; `FLOWS` and `NAT_REPLIES` keep established
/// TCP flows only. A daemon of layout 9 adopts pins of layout 8 and
/// upgrades them (`UPGRADABLE_LAYOUT`): their flows stay where they are.
/// 10: `UDP_FLOWS` and `UDP_REPLIES`, the external path's UDP flows, apart
/// from TCP's opening ones: a flood of SYNs evicts no UDP flow. A daemon
/// of layout 10 adopts pins of layout 9 and moves their UDP flows there.
/// 11: `EPOCH` and `VIP_PORTS`, for the established flows' fast path. A
/// daemon of layout 11 adopts pins of layout 10 (it adds the two maps).
pub const LAYOUT_VERSION: u32 = 11;
/// The one older layout a daemon adopts, by adding what its layout lacks
/// (maps and programs; nothing pinned changes shape) before it replaces
/// the programs.
pub const UPGRADABLE_LAYOUT: u32 = 10;

/// Index of the layout version in `META`.
pub const META_LAYOUT_VERSION: u32 = 0;
/// Indexes in `META` of a fingerprint of the attached programs (the low
/// and high halves of a hash of the eBPF object): a daemon whose programs
/// differ replaces them (atomic link updates) when it adopts the pins.
pub const META_PROGRAMS_LOW: u32 = 1;
/// See [`META_PROGRAMS_LOW`].
pub const META_PROGRAMS_HIGH: u32 = 2;
/// Number of `META` slots.
pub const META_SLOTS: u32 = 3;

/// `Service::netns_cookie`: rewrite connects from every network namespace.
pub const NETNS_ANY: u64 = 0;
/// `Service::netns_cookie`: rewrite connects only from the initial network
/// namespace, whose cookie the kernel program asks for itself
/// (`bpf_get_netns_cookie(NULL)`). For a daemon in the initial namespace on
/// a kernel that cannot tell userspace its cookie (`SO_NETNS_COOKIE` is
/// Linux 5.14+). Kernel cookies count up from 1 and never reach it.
pub const NETNS_INITIAL: u64 = u64::MAX;
/// `Service::netns_cookie`: rewrite no connect at all (no namespace has
/// this cookie: they count up from 1): a VIP that only the external path
/// serves, whose local clients are left to the host's own routing.
pub const NETNS_NONE: u64 = u64::MAX - 1;

/// An IP endpoint exactly as `bpf_sock_addr` carries it: the address as four
/// 32-bit words in network byte order (IPv4 as IPv4-mapped IPv6,
/// `::ffff:a.b.c.d`) and the port in network byte order.
///
/// Keeping IPv4 in mapped form lets one lookup serve `connect4` and an
/// IPv4-mapped destination on an IPv6 socket in `connect6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// The address as four 32-bit words in network byte order.
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    /// Explicit padding (zero).
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

    /// This endpoint's slot in a table of `slots` (a power of two) that
    /// the kernel finds without a hash lookup: a multiplicative hash of the
    /// address, the port and `salt` (what else the table is keyed by), its
    /// top bits.
    #[inline(always)]
    pub const fn slot(&self, salt: u32, slots: u32) -> u32 {
        let [a, b, c, d] = self.addr;
        let mixed = a ^ b ^ c ^ d ^ self.port as u32 ^ salt;
        mixed.wrapping_mul(0x9e37_79b1) >> (32 - slots.trailing_zeros())
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
    /// Whose connects are rewritten: [`NETNS_ANY`], [`NETNS_INITIAL`], or
    /// the cookie of the one network namespace (the daemon's) whose
    /// sockets are rewritten; others are left alone.
    pub netns_cookie: u64,
    /// The daemon's state of each server in `servers`, in its own encoding,
    /// so that a restarted daemon starts from what the previous one knew,
    /// e.g. which servers had failed, even after their failure marks
    /// expired. The kernel reads one value of it: [`DAEMON_STATE_FAILED`].
    pub daemon_states: [u8; MAX_SERVERS],
}

impl Default for Service {
    fn default() -> Self {
        Self {
            servers: [Endpoint::default(); MAX_SERVERS],
            count: 0,
            spread: 1,
            hold_down_ns: 0,
            netns_cookie: NETNS_ANY,
            daemon_states: [0; MAX_SERVERS],
        }
    }
}

/// The one daemon state (`Service::daemon_states`) the kernel reads: the
/// daemon has confirmed the server's failure. The external path then
/// moves even the server's established flows, which a failure mark of
/// the kernel's own never moves.
pub const DAEMON_STATE_FAILED: u8 = 1;

/// A flag of an external VIP's value in `EXTERNAL`: its flows keep the
/// client's address (destination NAT only; `externalTrafficPolicy:
/// Local`). Their servers' replies pass through the node (it is their
/// gateway) and are translated back to the VIP; the servers' ports are
/// in `VIP_PORTS` so that their replies are looked up.
pub const EXTERNAL_KEEP_CLIENT: u32 = 1;

/// A flag of an external VIP's value in `EXTERNAL`: a `spread` VIP's new
/// flows are placed by their client's address alone, not its port, so
/// that a client's flows go to one server while the servers stay the
/// same (`sessionAffinity: ClientIP`).
pub const EXTERNAL_CLIENT_AFFINITY: u32 = 2;

/// The socket cookie of an `Event` about a flow of the external path
/// (a socket's cookie is never 0).
pub const EXTERNAL_FLOW_COOKIE: u64 = 0;

/// `UNMARKED[UNMARKED_KERNEL]` is 1 once a connect program found that this
/// kernel does not let it mark the sockets it tracks (before Linux 6.12), or
/// in programs that replace running ones: sock_ops then looks every
/// connecting socket up, not only the marked ones.
pub const UNMARKED_KERNEL: u32 = 0;
/// `UNMARKED[UNMARKED_REPLACED]` is 1 in programs that replaced running
/// ones (set by the daemon): a connect that ran the old connect4 has its
/// entry in `SOCKETS` already, not in `CONNECTING`.
pub const UNMARKED_REPLACED: u32 = 1;
/// Number of `UNMARKED` slots.
pub const UNMARKED_SLOTS: u32 = 2;

/// `LIMITS[LIMIT_NEW_FLOWS]`: how many new flows `lb_xdp` opens per CPU
/// per second (`[daemon] new_flows_per_cpu`); 0: no limit. Written by the
/// daemon into each object it loads, before any program of it runs
/// (`LIMITS` is kernel-only: the setting goes with the programs).
pub const LIMIT_NEW_FLOWS: u32 = 0;
/// `LIMITS[LIMIT_ANSWERS]`: how many packets of its own `lb_xdp` sends per
/// CPU per second in answer to packets it did not ask for (a TCP reset to
/// a segment of no flow, a "too big", a defence against a duplicate
/// address probe); 0: no limit. The daemon writes [`ANSWERS_PER_CPU`].
pub const LIMIT_ANSWERS: u32 = 1;
/// `LIMITS[LIMIT_NAT_PORT_FIRST]` and `LIMITS[LIMIT_NAT_PORT_LAST]`: the
/// NAT ports `lb_xdp` gives flows and takes replies on (`[daemon]
/// nat_ports`); 0 in either, or a range that is none: the default,
/// [`NAT_PORT_FIRST`] to 65535.
pub const LIMIT_NAT_PORT_FIRST: u32 = 2;
/// See [`LIMIT_NAT_PORT_FIRST`].
pub const LIMIT_NAT_PORT_LAST: u32 = 3;
/// How many NAT source addresses a server may have beside the node's own
/// address toward it (`[daemon] nat_addresses`). `NODE_ADDRESSES` holds
/// them under the server's address with ports 1 to their number, and
/// their number in the port of the node's own address (its entry under
/// the server's address with port 0).
pub const MAX_NAT_ADDRESSES: usize = 7;
/// Number of `LIMITS` slots.
pub const LIMIT_SLOTS: u32 = 4;
/// Words of `VIP_PORTS`: a bit for each of the 65,536 ports.
pub const VIP_PORT_WORDS: u32 = 65_536 / 64;

/// The word of `VIP_PORTS` that holds `port`'s bit (host byte order), and
/// the bit.
#[inline(always)]
pub const fn vip_port_bit(port: u16) -> (u32, u64) {
    ((port >> 6) as u32, 1 << (port & 63))
}
/// The daemon's `LIMITS[LIMIT_ANSWERS]`: as many answers as a flood of
/// 10,000 forged packets a second per CPU asks for, no more (Linux answers
/// ICMP errors at 1,000 a second in all by default; these are TCP resets
/// too, and a client cut off by a failover should learn at once).
pub const ANSWERS_PER_CPU: u32 = 10_000;

/// Number of `MARKED_AT` slots (a power of two).
pub const MARK_SLOTS: u32 = 64;
/// A `MARKED_AT` slot whose last mark is of unknown age: the daemon writes
/// it into every slot when its programs replace running ones (those of
/// layout 7 marked servers without stamping); a program that reads it
/// takes it as a mark made now.
pub const MARKED_UNKNOWN: u64 = u64::MAX;

/// `SockEntry::flags`: the connection reached ESTABLISHED and is counted.
pub const SOCK_ESTABLISHED: u32 = 1 << 0;
/// `SockEntry::flags`: a failure was already reported for this connect.
pub const SOCK_FAILURE_REPORTED: u32 = 1 << 1;
/// `SockEntry::flags`: the connection established but `CONNECTIONS` was
/// full, so it was not counted (and its close must not uncount it).
pub const SOCK_UNCOUNTED: u32 = 1 << 2;
/// `SockEntry::flags`: connect4 recorded the socket and sock_ops' connect
/// callback (the SYN about to go) has not run yet. Only the connect4 of
/// the lb before `CONNECTING` (layout 3, the same as now) set it in
/// `SOCKETS` entries; the programs that replace it still clear and honour
/// it, for the connects that straddle the upgrade.
pub const SOCK_CONNECT_PENDING: u32 = 1 << 3;

/// The value of the `SOCKETS` (TCP) and `SOCKETS_UDP` maps, keyed by socket
/// cookie: a socket whose connect went through a VIP.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockEntry {
    /// The VIP the application dialled.
    pub vip: Endpoint,
    /// The server the connect was sent to.
    pub server: Endpoint,
    /// `SOCK_*` bits; written only by sock_ops (under the socket's lock).
    pub flags: u32,
    /// Nonzero once the application released the socket (close) before it
    /// established: a connect it gave up on, whose close is no server
    /// failure. Written only by sock_release, which runs without the
    /// socket's lock: a word apart from `flags`, so that neither program's
    /// write can undo the other's.
    pub released: u32,
}

/// The key of the `CONNECTIONS` map (per-CPU live connection counts): the
/// service's VIP and the server the connection went to. The daemon sums the
/// per-CPU values; an open on one CPU and a close on another still net out.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConnKey {
    /// The service's VIP.
    pub vip: Endpoint,
    /// The server the connections went to.
    pub server: Endpoint,
}

/// What a sock_ops [`Event`] reports. The record carries it as a raw `u32`
/// (`EventKind::X as u32`, see [`Event::kind`]): no enum crosses the
/// user/kernel boundary, so an unknown value from a newer or older kernel
/// object is an error to handle, not undefined behaviour.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A connect through a VIP established to a server that had a failure
    /// mark (the first success after failures; others are only counted).
    Established = 1,
    /// A connect through a VIP closed before establishing (refused, reset,
    /// timed out, abandoned).
    ConnectFailed = 2,
    /// A connect's SYN went unanswered for a retransmission timeout; it may
    /// still establish later.
    ConnectTimeout = 3,
}

/// An [`Event::kind`] value that names no [`EventKind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownEventKind(pub u32);

impl core::fmt::Display for UnknownEventKind {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "unknown kernel event kind {}", self.0)
    }
}

impl core::error::Error for UnknownEventKind {}

impl TryFrom<u32> for EventKind {
    type Error = UnknownEventKind;

    fn try_from(value: u32) -> Result<Self, Self::Error> {
        match value {
            1 => Ok(Self::Established),
            2 => Ok(Self::ConnectFailed),
            3 => Ok(Self::ConnectTimeout),
            other => Err(UnknownEventKind(other)),
        }
    }
}

impl From<EventKind> for u32 {
    fn from(kind: EventKind) -> Self {
        kind as u32
    }
}

/// A ring-buffer record from `sock_ops` about one connection through a VIP.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// The socket's cookie.
    pub cookie: u64,
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) when it happened.
    pub time_ns: u64,
    /// The VIP the application dialled.
    pub vip: Endpoint,
    /// The server the connect went to.
    pub server: Endpoint,
    /// An [`EventKind`] as `u32`; read it with [`Event::kind()`].
    pub kind: u32,
    /// Explicit padding (zero).
    pub _pad: u32,
}

impl Event {
    /// What happened, or the raw value if it names no [`EventKind`].
    pub fn kind(&self) -> Result<EventKind, UnknownEventKind> {
        EventKind::try_from(self.kind)
    }
}

// The kernel and the daemon must agree on these byte for byte.
const _: () = assert!(size_of::<Endpoint>() == 20);
const _: () = assert!(size_of::<Service>() == 20 * MAX_SERVERS + 24 + MAX_SERVERS);
const _: () = assert!(size_of::<SockEntry>() == 48);
const _: () = assert!(size_of::<ConnKey>() == 40);
const _: () = assert!(size_of::<Event>() == 64);
const _: () = assert!(align_of::<Service>() == 8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_kinds_keep_their_wire_values() {
        for (kind, value) in [
            (EventKind::Established, 1),
            (EventKind::ConnectFailed, 2),
            (EventKind::ConnectTimeout, 3),
        ] {
            assert_eq!(u32::from(kind), value);
            assert_eq!(EventKind::try_from(value), Ok(kind));
            assert_eq!(Event { kind: value, ..Event::default() }.kind(), Ok(kind));
        }
        // 4 was the close event, no longer sent.
        for bad in [0, 4, u32::MAX] {
            assert_eq!(Event { kind: bad, ..Event::default() }.kind(), Err(UnknownEventKind(bad)));
        }
    }
}
