//! The tables of the external path: packets from other machines to a VIP,
//! forwarded by XDP with NAT (destination → the server, source → the
//! node's own address toward it, with a port of [`NAT_PORT_FIRST`]..).
//!
//! - `FLOWS` ([`FlowKey`] → [`Flow`]): a client's flow to a VIP and where
//!   it goes; the next packet of the flow goes there too while its server
//!   is usable.
//! - `NAT_REPLIES` ([`NatKey`] → [`NatReply`]): the same flow as the
//!   server's replies carry it, to translate them back; its insertion
//!   allocates the NAT port (a port is in use while its entry exists,
//!   and may go to a new flow once its flow has ended: [`crate::nat`]).
//!
//! Each comes three times: the established TCP flows (`FLOWS`,
//! `NAT_REPLIES`: the client acknowledged the server's answer, which no
//! sender of forged addresses sees), TCP handshakes under way
//! (`OPENING_FLOWS`, `OPENING_REPLIES`) and UDP flows (`UDP_FLOWS`,
//! `UDP_REPLIES`). A TCP flow opens in the second pair and moves to the
//! first when its handshake completes, so a flood of new TCP flows,
//! however large, evicts only other new TCP flows. UDP has no handshake
//! that proves a client sees its answers: a UDP flow stays in the third
//! pair, which a flood of SYNs does not touch; a flood of forged UDP
//! evicts the least recently used UDP flows.
//!
//! All are LRU maps, of `[daemon] flow_table` entries each, a quarter of
//! that for UDP ([`udp_flow_table`]; the daemon sizes them at attach,
//! [`MAX_EXTERNAL_FLOWS`] in the object): flows are not removed one by one
//! (a close is noted, not followed to its end), the least recently used go
//! first when the table is full.

use crate::Endpoint;

/// Flows the external path tracks (`FLOWS` and `NAT_REPLIES` each) as the
/// object declares them: the size of the maps loaded without the daemon
/// (the packet fixtures, the benchmarks). The daemon loads them at
/// `[daemon] flow_table`. LRU maps are preallocated: about 2.5 MB each at
/// this size.
pub const MAX_EXTERNAL_FLOWS: u32 = 16_384;

/// The size of the UDP flow tables (`UDP_FLOWS`, `UDP_REPLIES`) beside
/// TCP's of `flow_table` entries each: a quarter. Most of a node's
/// external flows are TCP; a UDP flow of a service that answers at once
/// (DNS) needs its entry for a round trip.
pub const fn udp_flow_table(flow_table: u32) -> u32 {
    let quarter = flow_table / 4;
    if quarter < 256 { 256 } else { quarter }
}

/// The first source port the external path gives a forwarded flow, above
/// the kernel's default ephemeral range (32768–60999, `ip_local_port_range`),
/// so that a NAT port never collides with a connection the node makes
/// itself from the same address.
pub const NAT_PORT_FIRST: u16 = 61_000;
/// How many NAT ports there are from [`NAT_PORT_FIRST`]: concurrent flows
/// per (node address, server, protocol).
pub const NAT_PORT_COUNT: u16 = 65_535 - NAT_PORT_FIRST + 1;

/// The key of `FLOWS`: one flow from a client to a VIP, as its packets
/// arrive.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// The client's address and port.
    pub client: Endpoint,
    /// The VIP and port it sent to.
    pub vip: Endpoint,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub protocol: u8,
    /// Explicit padding (zero).
    pub _pad: [u8; 3],
}

/// The value of `FLOWS`: where a flow goes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flow {
    /// The server its packets go to.
    pub server: Endpoint,
    /// The source they get: the node's address toward the server and the
    /// flow's NAT port.
    pub node: Endpoint,
    /// `bpf_ktime_get_ns()` of the first SYN sent to `server` (TCP; 0 for
    /// UDP, before a SYN has left, and once the client's next packet has
    /// completed the handshake): a SYN of the flow seen again while the
    /// server has not answered is a retransmission, and the server is
    /// failed.
    pub syn_at_ns: u64,
}

/// The key of `NAT_REPLIES`: a forwarded flow as its replies carry it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NatKey {
    /// The server (the replies' source).
    pub server: Endpoint,
    /// The node's address and the flow's NAT port (their destination).
    pub node: Endpoint,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub protocol: u8,
    /// Explicit padding (zero).
    pub _pad: [u8; 3],
}

/// `NatReply::flags`: the server answered the flow (anything but a reset):
/// a SYN of the client seen again is a new attempt, no sign of a dead
/// server, and a later reset no failure.
pub const NAT_REPLY_ESTABLISHED: u32 = 1 << 0;
/// `NatReply::flags`: the flow began with a SYN (`syn_seq` holds its
/// sequence number): only a reset that answers it is a server's refusal.
/// The other bits say how the flow ended and when it was last seen
/// ([`crate::nat`]).
pub const NAT_REPLY_SYN: u32 = 1 << 1;

/// The value of `NAT_REPLIES`: whom a reply goes back to, as whom, and the
/// way back.
///
/// Replies go back the way the flow's packets came, with no lookup: out
/// of the interface they arrived on, to the MAC address they came from
/// (the client, or the router in front of it). So the node needs no route
/// or neighbour entry for the client, and no reverse-path check drops a
/// reply whose source (the VIP) is no address of the node.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatReply {
    /// The client (the reply's new destination).
    pub client: Endpoint,
    /// The VIP (its new source).
    pub vip: Endpoint,
    /// `NAT_REPLY_*` bits.
    pub flags: u32,
    /// The client's SYN's sequence number (host byte order), with
    /// [`NAT_REPLY_SYN`]: a reset answering it acknowledges one more.
    /// Once the server has answered a TCP flow's SYN
    /// ([`NAT_REPLY_ESTABLISHED`]), the server's own (its SYN-ACK's): only
    /// a client that acknowledges it has seen the answer, and its flow
    /// moves to the established tables. There, the server's sequence
    /// number as [`crate::nat::server_window`] last noted it.
    pub syn_seq: u32,
    /// The interface the client's packets arrive on: where replies go out.
    pub client_ifindex: u32,
    /// The interface packets to the server leave by (0 until the first
    /// one has): only a reset arriving there can fail the server, not one
    /// forged from the client's side.
    pub server_ifindex: u32,
    /// The link layer replies are sent with: the MAC address the client's
    /// packets came from (destination), then the one they came to
    /// (source).
    pub macs: [u8; 12],
}
/// Per-CPU packets and bytes the external path forwarded to one server
/// (`TRAFFIC`, keyed by the server, and [`TrafficSlot`]), replies not
/// included.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Packets forwarded.
    pub packets: u64,
    /// Their bytes, from the IP header on.
    pub bytes: u64,
}

/// Slots of `TRAFFIC_SLOTS` on each CPU (a power of two).
pub const TRAFFIC_SLOT_COUNT: u32 = 1024;

/// How long a server's slot of `TRAFFIC_SLOTS` may go unused before
/// another server hashed to it takes it, in jiffies: 1 to 10 minutes, as
/// the kernel's `HZ` is 1000 to 100. The slot's counts then move to the
/// server's `TRAFFIC` entry.
pub const TRAFFIC_SLOT_IDLE_TICKS: u64 = 60_000;

/// One CPU's slot of `TRAFFIC_SLOTS` (layout 8): what the external path
/// forwarded to the server that holds it.
///
/// A server's traffic is counted in its slot ([`traffic_slot`]) on the
/// CPU that forwards it, which the first packet there takes if it is free
/// or idle; if another server holds it, in the server's `TRAFFIC` entry.
/// A per-CPU array's slot is found without a hash lookup, which cost an
/// established packet 18 of its 108 ns. A server's count is the sum of
/// both over the CPUs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrafficSlot {
    /// The server that holds the slot; zero (no address, port 0): free.
    pub server: Endpoint,
    /// Explicit padding (zero).
    pub _pad: u32,
    /// When it last counted a packet (`bpf_jiffies64()`).
    pub used_at: u64,
    /// What it counted.
    pub traffic: Traffic,
}

/// The slot of `TRAFFIC_SLOTS` that counts `server`'s traffic
/// ([`Endpoint::slot`]). The kernel and the daemon find slots by it alike.
#[inline(always)]
pub const fn traffic_slot(server: &Endpoint) -> u32 {
    server.slot(0, TRAFFIC_SLOT_COUNT)
}

const _: () = assert!(TRAFFIC_SLOT_COUNT.is_power_of_two());

/// `ANNOUNCE`'s key: an address the node announces on one interface.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AnnounceKey {
    /// The interface (its index) the address is announced on.
    pub ifindex: u32,
    /// The address, as an [`Endpoint`]'s (IPv4 as IPv4-mapped IPv6).
    pub addr: [u32; 4],
}

/// `ANNOUNCE`'s value: what the answers say.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnnounceValue {
    /// The interface's MAC address: where the address is.
    pub mac: [u8; 6],
    /// Zero.
    pub _pad: [u8; 2],
}

const _: () = assert!(size_of::<AnnounceKey>() == 20);
const _: () = assert!(size_of::<AnnounceValue>() == 8);
const _: () = assert!(size_of::<FlowKey>() == 44);
const _: () = assert!(size_of::<Flow>() == 48);
const _: () = assert!(size_of::<NatKey>() == 44);
const _: () = assert!(size_of::<NatReply>() == 68);
const _: () = assert!(size_of::<Traffic>() == 16);
const _: () = assert!(size_of::<TrafficSlot>() == 48);
