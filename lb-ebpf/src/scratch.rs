//! The per-CPU working values of `lb_xdp`, kept in maps (`maps.rs`)
//! rather than on the stack, which holds 512 bytes for a program's whole
//! call chain: the parsed packet, the new flow being built, and the
//! routes a CPU keeps. Plain data; the modules that fill them say how.

use lb_common::{Endpoint, NatKey, NatReply};

use crate::consts::{IPV4_HLEN, IPV6_HLEN, L3, TCP_ACK, TCP_RST, TCP_SYN};

/// What a parsed packet says. Its headers start at constant offsets
/// (`L3`, `Packet::l4`), checked against the packet's end at every access.
pub(crate) struct Packet {
    pub(crate) ipv6: bool,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub(crate) protocol: u8,
    pub(crate) src: Endpoint,
    pub(crate) dst: Endpoint,
    /// TCP flags; 0 for UDP.
    pub(crate) tcp_flags: u8,
    /// TCP: the acknowledgement number (host byte order); 0 for UDP.
    pub(crate) tcp_ack: u32,
    /// TCP: the sequence number (host byte order); 0 for UDP.
    pub(crate) tcp_seq: u32,
    /// Bytes from the IP header on.
    pub(crate) ip_len: u32,
    /// An ICMP error: `protocol`, `src` and `dst` are those of the packet
    /// it quotes (`packet::quote::parse`), not its own.
    pub(crate) icmp_error: bool,
    /// An ICMP error's own destination address (`dst` is the quote's).
    pub(crate) error_to: [u32; 4],
    /// Its flow's entries are in the opening tables of its protocol
    /// (`maps::opening_flows`), not the established ones: set by
    /// `forward::known`, false for a new flow until then.
    pub(crate) opening: bool,
}

impl Packet {
    /// A packet of nothing, to parse into.
    #[inline(always)]
    pub(crate) fn empty() -> Self {
        Packet {
            ipv6: false,
            protocol: 0,
            src: Endpoint::default(),
            dst: Endpoint::default(),
            tcp_flags: 0,
            tcp_ack: 0,
            tcp_seq: 0,
            ip_len: 0,
            icmp_error: false,
            error_to: [0; 4],
            opening: false,
        }
    }

    /// Where the TCP or UDP header starts. A constant on each branch, never
    /// a value read back from the packet's map slot, which the verifier
    /// would not let near a packet pointer.
    #[inline(always)]
    pub(crate) fn l4(&self) -> usize {
        if self.ipv6 { L3 + IPV6_HLEN } else { L3 + IPV4_HLEN }
    }

    /// A SYN opening a connection (no ACK).
    pub(crate) fn is_syn(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }

    pub(crate) fn is_rst(&self) -> bool {
        self.tcp_flags & TCP_RST != 0
    }
}

/// A new flow as `choose` (its server, `nat.server`) and `new_flow` (the
/// rest) build it, in this CPU's `NEW_FLOW` slot: its `NAT_REPLIES` key
/// and value, written to the map from there.
#[repr(C)]
pub(crate) struct NewFlow {
    pub(crate) nat: NatKey,
    pub(crate) reply: NatReply,
}

/// Slots of `LINKS_SEEN` on each CPU (a power of two): interfaces whose
/// index is the same modulo this take turns.
pub(crate) const LINK_SLOTS: u32 = 8;

/// An interface's `LINK_MACS` entry as this CPU found it, in the daemon's
/// epoch `epoch` (`LINKS_SEEN`): good while that epoch lasts, since the
/// daemon starts a new one after every change to `LINK_MACS`. Zeroed, it
/// is no interface's (no interface has index 0).
#[repr(C)]
pub(crate) struct SeenLink {
    pub(crate) ifindex: u32,
    pub(crate) epoch: u32,
    pub(crate) mac: [u8; 6],
    /// 1 if `LINK_MACS` had the interface (then `mac` is its MAC).
    pub(crate) known: u8,
    pub(crate) _pad: u8,
}

/// Slots of `ROUTES` on each CPU: how many servers' routes it keeps at
/// once (servers whose slot is the same take turns).
pub(crate) const ROUTE_SLOTS: u32 = 256;

/// A route the FIB gave, in this CPU's slot of its server (`ROUTES`).
#[repr(C)]
pub(crate) struct KeptRoute {
    /// What the FIB was asked: the packet's new destination (the server),
    /// its new source address (the node's), the interface it arrived on,
    /// its L4 protocol.
    pub(crate) server: Endpoint,
    pub(crate) node: [u32; 4],
    pub(crate) ingress: u32,
    pub(crate) protocol: u32,
    /// What it answered: the interface out, and the link layer
    /// (destination MAC, then source MAC).
    pub(crate) ifindex: u32,
    pub(crate) macs: [u8; 12],
    /// The length (from the IP header on) of the packet it was asked for:
    /// no longer packet takes the route without asking again.
    pub(crate) fits: u32,
    /// When it answered (`bpf_jiffies64()`); 0 in a slot never filled.
    pub(crate) found_at: u64,
    /// The verdict kept with the route (`route::keep_verdict`): in
    /// `EPOCH` `epoch`, the established TCP flows of `vip` to `server`,
    /// arriving on `ingress` sent to `to_mac`, go on to `server`. None
    /// (`vip` zero) from each new route on.
    pub(crate) vip: Endpoint,
    pub(crate) epoch: u32,
    pub(crate) to_mac: [u8; 6],
}

/// What this CPU spent of one budget in its current second
/// (`per_second::spend`).
#[repr(C)]
pub(crate) struct Spent {
    /// When the second began (`bpf_ktime_get_ns`).
    pub(crate) since_ns: u64,
    /// How much was spent since.
    pub(crate) count: u32,
}
