//! The external path's flow tables as flows open, settle and end: a new
//! flow opened in the opening tables with a NAT port (`new_flow`, the port
//! taken from a flow that has ended where none is free: `reclaim`), moved
//! to the established tables when its handshake completes (`promote`), or
//! forgotten when its first packet could not be sent (`forget`). Which
//! packets do what is `forward.rs`'s.
//!
//! Three pairs of tables (`lb_common::flow_tables`): `FLOWS` and
//! `NAT_REPLIES` hold established TCP flows, which only a client that saw
//! its server's SYN-ACK reaches; `OPENING_FLOWS` and `OPENING_REPLIES`
//! TCP flows until then, `UDP_FLOWS` and `UDP_REPLIES` UDP flows (the
//! opening tables of a protocol: `maps::opening_flows`). A NAT port is in
//! use while a table of its protocol holds it.

#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys go by reference: a key passed by value is one more copy of it on a stack that \
              holds 512 bytes for the whole call chain"
)]

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    programs::XdpContext,
};
use lb_common::{
    Endpoint, Flow, FlowKey, LIMIT_NAT_PORT_FIRST, LIMIT_NAT_PORT_LAST, MAX_NAT_ADDRESSES,
    NAT_PORT_COUNT, NAT_PORT_FIRST, NAT_REPLY_ESTABLISHED, NAT_REPLY_SYN, NatKey, NatReply, Reason,
    nat,
};

use crate::{
    consts::IPPROTO_TCP,
    maps::{
        FLOWS, LIMITS, NAT_REPLIES, NEW_FLOW, NODE_ADDRESSES, OPENING_FLOWS, OPENING_REPLIES,
        count_xdp, opening_flows, opening_replies,
    },
    packet,
    scratch::Packet,
};

/// NAT ports tried for a new flow before it is refused.
const NAT_TRIES: u32 = 8;
/// The most NAT source addresses a server has beside the node's own
/// address toward it (`lb_common::MAX_NAT_ADDRESSES`).
const MORE_SOURCES: u32 = MAX_NAT_ADDRESSES as u32;

/// How far past the server's SYN-ACK the client's first acknowledgement
/// may reach for its flow to be established (`promote`): the data a
/// server sends with its SYN-ACK (TCP Fast Open). A sender of forged
/// addresses, which never sees the SYN-ACK, guesses within it once in
/// 65,536 tries.
const PROMOTE_ACK_WINDOW: u32 = 1 << 16;

/// The NAT ports (`[daemon] nat_ports`, written into `LIMITS` with the
/// programs): the first, and how many. The default (`NAT_PORT_FIRST` to
/// 65535) where the daemon wrote none.
#[inline(always)]
pub(crate) fn nat_ports() -> (u32, u32) {
    let first = LIMITS.get(LIMIT_NAT_PORT_FIRST).copied().unwrap_or(0);
    let last = LIMITS.get(LIMIT_NAT_PORT_LAST).copied().unwrap_or(0);
    if first == 0 || last < first || last > u32::from(u16::MAX) {
        (u32::from(NAT_PORT_FIRST), u32::from(NAT_PORT_COUNT))
    } else {
        (first, last - first + 1)
    }
}

/// Puts into `node` one of the server's NAT source addresses at random:
/// `primary` (the node's address toward it) or one of its `sources` more
/// (`[daemon] nat_addresses`: in `NODE_ADDRESSES` under the server's
/// address with ports 1 to `sources`). Each address has all the NAT
/// ports. A function of its own: its key would otherwise sit in
/// `new_flow`'s frame, on a chain (to `reclaim`) that holds 512 bytes on
/// Linux 5.10.
#[inline(never)]
fn pick_source(host: &Endpoint, sources: u32, primary: &Endpoint, node: &mut Endpoint) {
    // SAFETY: plain helper call without arguments.
    let k = unsafe { bpf_get_prandom_u32() } % (sources.min(MORE_SOURCES) + 1);
    let key = Endpoint { addr: host.addr, port: (k as u16).to_be(), _pad: [0; 2] };
    // SAFETY: a copy of the value.
    let more = if k == 0 { None } else { unsafe { NODE_ADDRESSES.get(&key) }.copied() };
    *node = more.unwrap_or(*primary);
}

/// Removes a new flow whose first packet was not sent (no route or
/// neighbour yet, too big): the flow's next packet opens it anew. Kept,
/// it would not know where its server's replies arrive (`send`), and
/// they would be dropped.
#[inline(never)]
pub(crate) fn forget(p: &Packet, flow: &Flow) {
    let _ = opening_replies(p.protocol).remove(&reply_key(flow, p.protocol));
    let _ = opening_flows(p.protocol).remove(&flow_key(p));
}

/// Moves a flow whose client acknowledged its server's answer (the
/// server's SYN-ACK, whose sequence number `reply` kept) to the
/// established tables, where new flows never evict it. A client that has
/// not seen the answer (a forged address) cannot: its flow stays opening,
/// and lives there as a half-open one does. Counted either way.
#[inline(never)]
pub(crate) fn promote(p: &Packet, flow: &Flow) {
    let key = reply_key(flow, p.protocol);
    // SAFETY: a copy of the value.
    let Some(entry) = (unsafe { OPENING_REPLIES.get(&key) }).copied() else { return };
    let answered = entry.flags & NAT_REPLY_ESTABLISHED != 0;
    // The server's data, if any, came with its SYN-ACK (TCP Fast Open).
    if !answered || p.tcp_ack.wrapping_sub(entry.syn_seq.wrapping_add(1)) >= PROMOTE_ACK_WINDOW {
        count_xdp(Reason::XdpNotPromoted);
        return;
    }
    let copy = *flow;
    if NAT_REPLIES.insert(&key, &entry, u64::from(BPF_NOEXIST)).is_err() {
        count_xdp(Reason::XdpNotPromoted);
        return;
    }
    if FLOWS.insert(&flow_key(p), &copy, u64::from(BPF_ANY)).is_err() {
        let _ = NAT_REPLIES.remove(&key);
        count_xdp(Reason::XdpNotPromoted);
        return;
    }
    let _ = OPENING_FLOWS.remove(&flow_key(p));
    let _ = OPENING_REPLIES.remove(&key);
    count_xdp(Reason::XdpPromoted);
}

/// Records `p`'s new flow, to the server `choose` chose, with a NAT
/// port, in the opening tables of its protocol (`OPENING_FLOWS`,
/// `OPENING_REPLIES`; UDP's): its entry there, or `None` (counted) if the flow must be
/// refused. A port is free if neither table has an entry for it, or if
/// the flows of those it has ended long enough ago (`reclaim`). With
/// `keep_client`, the client's own address and port stand for the NAT
/// source: nothing to choose, one try.
#[inline(never)]
pub(crate) fn new_flow(
    ctx: &XdpContext,
    p: &Packet,
    keep_client: bool,
) -> Option<&'static mut Flow> {
    let Some(slot) = NEW_FLOW.get_ptr_mut(0) else {
        count_xdp(Reason::MapError);
        return None;
    };
    // SAFETY: as in `choose`; its server written there for this packet.
    let new = unsafe { &mut *slot };
    let host = Endpoint { addr: new.nat.server.addr, port: 0, _pad: [0; 2] };
    // SAFETY: a copy of the value.
    let Some(node) = (unsafe { NODE_ADDRESSES.get(&host) }).copied() else {
        count_xdp(Reason::XdpNoNodeAddress);
        return None;
    };
    let macs = packet::macs(ctx)?;
    let tcp = u32::from(p.protocol) == IPPROTO_TCP;
    let syn = tcp && p.is_syn();
    // SAFETY: plain helper call without arguments.
    let tick = nat::tick(unsafe { bpf_ktime_get_ns() });
    new.nat.node = node;
    new.nat.protocol = p.protocol;
    new.nat._pad = [0; 3];
    new.reply.client = p.src;
    new.reply.vip = p.dst;
    new.reply.flags = nat::stamp(if syn { NAT_REPLY_SYN } else { 0 }, tick);
    new.reply.syn_seq = p.tcp_seq;
    // SAFETY: the context's fields are valid for the whole program run.
    new.reply.client_ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    new.reply.server_ifindex = 0;
    new.reply.macs = swapped(macs);
    // The node's address toward the server says in its port how many
    // more it has (`[daemon] nat_addresses`).
    let sources = u32::from(u16::from_be(node.port)).min(MORE_SOURCES);
    let mut allocated = false;
    if keep_client {
        // A client that claims the node's own address toward the server
        // is forged, and would take one of its NAT ports.
        if node.addr == p.src.addr {
            count_xdp(Reason::XdpClientIsNode);
            return None;
        }
        new.nat.node = p.src;
        // Pressed: the client reuses its port for a new connection.
        allocated = take_port(&new.nat, &new.reply, tcp, tick, true);
    } else {
        let (first, count) = nat_ports();
        // Ports at random, each on its own: ports tried in a row would cluster
        // the ones taken, as linear probing does in a hash table. The second
        // half of the tries is pressed (`lb_common::nat`).
        for i in 0..2 * NAT_TRIES {
            // SAFETY: plain helper call without arguments.
            let random = unsafe { bpf_get_prandom_u32() };
            // `max(1)`: no division by zero for LLVM to guard (`nat_ports`
            // never says 0).
            let port = (first + random % count.max(1)) as u16;
            if sources > 0 {
                pick_source(&host, sources, &node, &mut new.nat.node);
            }
            new.nat.node.port = port.to_be();
            if take_port(&new.nat, &new.reply, tcp, tick, i >= NAT_TRIES) {
                allocated = true;
                break;
            }
        }
    }
    if !allocated {
        count_xdp(Reason::XdpNatPortsExhausted);
        return None;
    }
    // Its SYN's time is set as the SYN leaves (`send`).
    let flow = Flow { server: new.nat.server, node: new.nat.node, syn_at_ns: 0 };
    let flows = opening_flows(p.protocol);
    let entry = match flows.insert(&flow_key(p), &flow, u64::from(BPF_ANY)) {
        Ok(()) => flows.get_ptr_mut(&flow_key(p)),
        Err(_) => None,
    };
    let Some(entry) = entry else {
        count_xdp(Reason::MapError);
        let _ = opening_replies(p.protocol).remove(&new.nat);
        return None;
    };
    count_xdp(Reason::XdpNewFlow);
    // SAFETY: as in `known`.
    Some(unsafe { &mut *entry })
}

/// Records `reply` under `nat` in the opening replies of its protocol,
/// if its port is free: no flow holds it, or the one that does has ended
/// (`reclaim`). The port is a NAT port, or the client's own for a flow
/// that keeps its address.
#[inline(always)]
fn take_port(nat: &NatKey, reply: &NatReply, tcp: bool, tick: u32, pressed: bool) -> bool {
    // SAFETY: only whether an entry exists (UDP flows are never there).
    let established = tcp && unsafe { NAT_REPLIES.get(nat) }.is_some();
    let replies = opening_replies(nat.protocol);
    !established && replies.insert(nat, reply, u64::from(BPF_NOEXIST)).is_ok()
        || reclaim(nat, tcp, tick, pressed)
            && replies.insert(nat, reply, u64::from(BPF_ANY)).is_ok()
}

/// Whether the NAT port of `nat` may go to a new flow: no established
/// flow holds it (`NAT_REPLIES`), or the one that does has ended or idled
/// out (`lb_common::nat::reusable`), and so has the opening flow that
/// holds it, if any. A flow whose port goes loses its `FLOWS` or
/// opening entry too, if it still holds the port: its next packet
/// is a new flow, never one that shares the port. The new flow's entry
/// then replaces the opening one (`BPF_ANY`).
#[inline(never)]
fn reclaim(nat: &NatKey, tcp: bool, tick: u32, pressed: bool) -> bool {
    // UDP flows are never established.
    // SAFETY: map values, read in place.
    let established = if tcp { unsafe { NAT_REPLIES.get(nat) } } else { None };
    // SAFETY: as above.
    let opening = unsafe { opening_replies(nat.protocol).get(nat) };
    if established.is_none() && opening.is_none() {
        return false;
    }
    let free = |entry: Option<&NatReply>| {
        entry.is_none_or(|old| nat::reusable(old.flags, tcp, tick, pressed))
    };
    if !(free(established) && free(opening)) {
        return false;
    }
    if let Some(old) = established {
        let key =
            FlowKey { client: old.client, vip: old.vip, protocol: nat.protocol, _pad: [0; 3] };
        // SAFETY: as above.
        if unsafe { FLOWS.get(&key) }.is_some_and(|f| f.node == nat.node && f.server == nat.server)
        {
            let _ = FLOWS.remove(&key);
        }
        let _ = NAT_REPLIES.remove(nat);
    }
    if let Some(old) = opening {
        let key =
            FlowKey { client: old.client, vip: old.vip, protocol: nat.protocol, _pad: [0; 3] };
        let flows = opening_flows(nat.protocol);
        // SAFETY: as above.
        if unsafe { flows.get(&key) }.is_some_and(|f| f.node == nat.node && f.server == nat.server)
        {
            let _ = flows.remove(&key);
        }
    }
    count_xdp(Reason::XdpNatPortReused);
    true
}

/// The `FLOWS` key of `p`'s flow.
#[inline(always)]
pub(crate) fn flow_key(p: &Packet) -> FlowKey {
    FlowKey { client: p.src, vip: p.dst, protocol: p.protocol, _pad: [0; 3] }
}

/// The `NAT_REPLIES` key of `flow`'s replies.
#[inline(always)]
pub(crate) fn reply_key(flow: &Flow, protocol: u8) -> NatKey {
    NatKey { server: flow.server, node: flow.node, protocol, _pad: [0; 3] }
}

/// The link layer of a reply to a packet that came with `macs`
/// (destination, source): the two swapped.
#[inline(always)]
fn swapped(macs: [u8; 12]) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[..6].copy_from_slice(&macs[6..]);
    out[6..].copy_from_slice(&macs[..6]);
    out
}
