//! Names of the maps, as the object file and the pin directory know them.

/// VIP → [`Service`](crate::Service): the selections.
pub const SERVICES: &str = "SERVICES";
/// Server → when a connect to it last failed.
pub const FAILED_AT: &str = "FAILED_AT";
/// TCP socket cookie → [`SockEntry`](crate::SockEntry).
pub const SOCKETS: &str = "SOCKETS";
/// [`ConnKey`](crate::ConnKey) → live connections, per CPU.
pub const CONNECTIONS: &str = "CONNECTIONS";
/// The ring buffer of [`Event`](crate::Event)s.
pub const EVENTS: &str = "EVENTS";
/// Per-CPU decision counters, indexed by [`Reason`](crate::Reason).
pub const COUNTERS: &str = "COUNTERS";
/// Connected-UDP socket cookie → [`SockEntry`](crate::SockEntry).
pub const SOCKETS_UDP: &str = "SOCKETS_UDP";
/// The layout version (`LAYOUT_VERSION`), an array of u32.
pub const META: &str = "META";
/// UDP socket cookie → [`UdpPeers`](crate::UdpPeers): the servers it
/// was sent to, and for which VIP (layout 4).
pub const UDP_PEERS: &str = "UDP_PEERS";
/// Kernel-only, not pinned: TCP socket cookie → the
/// [`SockEntry`](crate::SockEntry) connect4 chose, until sock_ops' connect
/// callback (the SYN about to go) moves it to `SOCKETS`.
pub const CONNECTING: &str = "CONNECTING";
/// Kernel-only, not pinned: settings the daemon writes into each object
/// it loads, indexed by [`LIMIT_NEW_FLOWS`](crate::LIMIT_NEW_FLOWS).
pub const LIMITS: &str = "LIMITS";
/// Kernel-only, not pinned: two flags, indexed by
/// [`UNMARKED_KERNEL`](crate::UNMARKED_KERNEL) and
/// [`UNMARKED_REPLACED`](crate::UNMARKED_REPLACED).
pub const UNMARKED: &str = "UNMARKED";
/// VIP → `u32` (reserved, zero): the VIPs the external path (XDP)
/// forwards packets from the network for (layout 5).
pub const EXTERNAL: &str = "EXTERNAL";
/// A server's address (port 0) → the node's own address toward it
/// (port 0): the source the external path gives forwarded packets.
pub const NODE_ADDRESSES: &str = "NODE_ADDRESSES";
/// [`FlowKey`](crate::FlowKey) → [`Flow`](crate::Flow), an LRU map.
pub const FLOWS: &str = "FLOWS";
/// [`NatKey`](crate::NatKey) → [`NatReply`](crate::NatReply), an LRU map.
pub const NAT_REPLIES: &str = "NAT_REPLIES";
/// As [`FLOWS`], for TCP flows not yet established (handshakes under
/// way): a flood of them evicts none of `FLOWS` (layout 9).
pub const OPENING_FLOWS: &str = "OPENING_FLOWS";
/// As [`NAT_REPLIES`], for the flows of [`OPENING_FLOWS`] (layout 9).
pub const OPENING_REPLIES: &str = "OPENING_REPLIES";
/// As [`FLOWS`], for UDP flows: a flood of TCP flows evicts none of
/// them (layout 10).
pub const UDP_FLOWS: &str = "UDP_FLOWS";
/// As [`NAT_REPLIES`], for the flows of [`UDP_FLOWS`] (layout 10).
pub const UDP_REPLIES: &str = "UDP_REPLIES";
/// Server → per-CPU [`Traffic`](crate::Traffic) forwarded to it.
pub const TRAFFIC: &str = "TRAFFIC";
/// [`AnnounceKey`](crate::AnnounceKey) (interface, address) →
/// [`AnnounceValue`](crate::AnnounceValue) (its MAC): what the XDP
/// program answers ARP requests and neighbour solicitations for (layout 6).
pub const ANNOUNCE: &str = "ANNOUNCE";
/// External VIP → its [`Maglev`](crate::maglev::Maglev) table: where
/// the external path sends a `spread` service's new flows (layout 6).
pub const MAGLEV: &str = "MAGLEV";
/// An announced address (as an [`Endpoint`](crate::Endpoint)'s, IPv4
/// mapped) → `u64`, the `CLOCK_MONOTONIC` nanosecond at which `lb_xdp`
/// stops answering for it: an elected node's fence, which holds even
/// when its daemon is dead. No entry: answered while in `ANNOUNCE`
/// (layout 7).
pub const ANNOUNCE_UNTIL: &str = "ANNOUNCE_UNTIL";
/// Interface index → [`AnnounceValue`](crate::AnnounceValue), its MAC
/// address: `lb_xdp` takes only frames sent to it there, not those a
/// switch floods to every port (layout 7).
pub const LINK_MACS: &str = "LINK_MACS";
/// Per CPU, [`TRAFFIC_SLOT_COUNT`](crate::TRAFFIC_SLOT_COUNT) ×
/// [`TrafficSlot`](crate::TrafficSlot): what the external path
/// forwarded to each server, counted without a hash lookup; the rest
/// is in `TRAFFIC` (layout 8).
pub const TRAFFIC_SLOTS: &str = "TRAFFIC_SLOTS";
/// [`MARK_SLOTS`](crate::MARK_SLOTS) `u64`s, each the jiffy at which
/// a server hashed to it was last marked failed (or
/// [`MARKED_UNKNOWN`](crate::MARKED_UNKNOWN)): the external path looks
/// a flow's server up in `FAILED_AT` only if its slot was stamped
/// within the hold-down. Pinned, so that the marks of every program
/// (sock_ops, `lb_xdp`) stamp the one map `lb_xdp` reads (layout 8).
pub const MARKED_AT: &str = "MARKED_AT";
/// One `u32`, bumped by the daemon after every change to what decides
/// whether an established flow goes on to its server (`SERVICES`,
/// `EXTERNAL`, `LINK_MACS`): a verdict `lb_xdp` keeps per CPU beside a
/// route holds only within the epoch it was reached in (layout 11).
pub const EPOCH: &str = "EPOCH";
/// [`VIP_PORT_WORDS`](crate::VIP_PORT_WORDS) `u64`s, a bit per port: set
/// for the ports of external VIPs, and of the servers of those that keep
/// the client's address. `lb_xdp` looks a packet up among the
/// established flows before anything else only if its destination port
/// is one, and a server's packet to a port that is not a NAT port among
/// the replies only if its source port is one (layout 11).
pub const VIP_PORTS: &str = "VIP_PORTS";
/// Every map the daemon pins, in one list so attach, adopt and detach agree.
pub const ALL: [&str; 26] = [
    SERVICES,
    FAILED_AT,
    SOCKETS,
    CONNECTIONS,
    EVENTS,
    COUNTERS,
    SOCKETS_UDP,
    META,
    UDP_PEERS,
    EXTERNAL,
    NODE_ADDRESSES,
    FLOWS,
    NAT_REPLIES,
    TRAFFIC,
    ANNOUNCE,
    MAGLEV,
    ANNOUNCE_UNTIL,
    LINK_MACS,
    TRAFFIC_SLOTS,
    MARKED_AT,
    OPENING_FLOWS,
    OPENING_REPLIES,
    UDP_FLOWS,
    UDP_REPLIES,
    EPOCH,
    VIP_PORTS,
];
/// The maps pins of `UPGRADABLE_LAYOUT` lack (an upgrade creates them).
pub const NEW_IN_LAYOUT: [&str; 2] = [EPOCH, VIP_PORTS];
