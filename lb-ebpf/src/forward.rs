//! The external path: packets from other machines to an external VIP,
//! forwarded to a server with NAT, and the servers' replies translated
//! back (`lb_xdp`, on the interfaces the daemon attaches it to).
//!
//! A client's packet to VIP:port belongs to a flow (`FLOWS`, `known`):
//! its first packet gets a server (`choose`), chosen as a connect to the
//! VIP would be (`select.rs`), and a NAT port (`new_flow`), allocated by
//! inserting the flow's reply key into `NAT_REPLIES`. Its packets leave
//! with the server as destination and the node's own address toward that
//! server (`NODE_ADDRESSES`) and the NAT port as source, by the kernel's
//! FIB (`send`); one too big for that route is answered with the node's
//! own ICMP error (`too_big.rs`).
//! A flow keeps its server while the server is in the selection and
//! usable; then its next packet chooses again.
//!
//! Only a SYN opens a TCP flow: a client's TCP packet of no flow that is
//! not one is answered with the node's own reset (`reset.rs`), as a host
//! answers it, and reaches no server.
//!
//! A server's packet to a NAT port (`reply`) is translated back to the
//! VIP and the client, and leaves the way the client's packets came, if
//! it arrived on the interface the flow's packets to the server leave by
//! (anything else claiming to be the server is dropped). The server's
//! packets keep the flow's NAT port (`lb_common::nat`), except while the
//! flow is half-open: a server re-sending its SYN-ACK to a forged address
//! does not hold the port.
//!
//! ICMP errors about a flow, from either side, are translated as its
//! packets are (`icmp.rs`).
//!
//! Failures, as on the socket path: a reset that answers a flow's SYN, or
//! the client's SYN sent again while the server has not answered, marks
//! the server failed (`FAILED_AT`), so the next choice skips it, and tells
//! the daemon. A reset counts only if it arrives where packets to the
//! server leave and acknowledges the SYN, and a SYN only if the server
//! must answer it (`packet::syn`): a packet forged on the client's side
//! cannot fail a server.

#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys go by reference: a key passed by value is one more copy of it on a stack that \
              holds 512 bytes for the whole call chain"
)]

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST, xdp_action},
    helpers::{bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_ns},
    programs::XdpContext,
};
use lb_common::{
    DAEMON_STATE_FAILED, EXTERNAL_FLOW_COOKIE, Endpoint, EventKind, Flow, FlowKey, NAT_PORT_COUNT,
    NAT_PORT_FIRST, NAT_REPLY_ESTABLISHED, NAT_REPLY_SYN, NatKey, NatReply, Reason, Service,
    TRAFFIC_SLOT_IDLE_TICKS, Traffic, TrafficSlot, maglev, nat, traffic_slot,
};

use crate::{
    consts::{IPPROTO_TCP, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    icmp,
    maps::{
        EXTERNAL, FLOWS, MAGLEV, NAT_REPLIES, NEW_FLOW, NODE_ADDRESSES, SERVICES, TRAFFIC,
        TRAFFIC_SLOTS, count_xdp,
    },
    packet,
    report::{emit, mark_failed_reporting},
    reset,
    route::{self, Route},
    scratch::Packet,
    select::{XDP, choose_server, daemon_state, preferred, unmarked_lately, usable},
    too_big,
};

/// NAT ports tried for a new flow before it is refused.
const NAT_TRIES: u32 = 8;

/// The soonest a client's SYN sent again counts as a retransmission: no
/// TCP retransmits a SYN sooner (Linux waits 1 s, RFC 6298 at least 1 s).
/// One sooner is a duplicate, or forged to fail a server that has had no
/// time to answer: it follows the first and fails nothing.
const SYN_RETRANSMIT_MIN_NS: u64 = 900_000_000;

/// What to do with a packet the external path takes: `None` if it is
/// neither for an external VIP nor a reply to a forwarded flow.
///
/// A client's packet goes through `known` (its flow, if it has one that
/// keeps its server), or `choose` and `new_flow` (a new flow), then
/// `send`, one after the other: each is a BPF function of its own (not
/// inlined), with its own stack frame, as are `reply` and `route::route`.
/// Inlined into one, or calling each other, their frames would add up
/// past the 512 bytes a program's call chain may use. The flow's entry
/// goes from one to the next as a pointer into the map: looked up once.
#[inline(always)]
pub(crate) fn forward(ctx: &XdpContext, p: &Packet) -> Option<u32> {
    if p.icmp_error {
        return icmp::forward_error(ctx, p);
    }
    // SAFETY: the values are only read; the daemon replaces values whole.
    if unsafe { EXTERNAL.get(&p.dst) }.is_none() {
        return reply(ctx, p).or_else(|| unserved(ctx, p));
    }
    if !packet::for_this_node(ctx) {
        return Some(xdp_action::XDP_PASS);
    }
    // SAFETY: as above.
    let Some(service) = (unsafe { SERVICES.get(&p.dst) }) else {
        count_xdp(Reason::XdpNoServer);
        return Some(xdp_action::XDP_DROP);
    };
    if packet::ttl(ctx, p) <= 1 {
        count_xdp(Reason::XdpTtlExceeded);
        return Some(xdp_action::XDP_PASS);
    }
    if let Some(flow) = known(ctx, p, service) {
        count_xdp(Reason::XdpForwarded);
        return Some(send(ctx, p, flow, false));
    }
    // Only a SYN opens a TCP flow; anything else of no flow is answered
    // as a host answers it.
    if u32::from(p.protocol) == IPPROTO_TCP
        && p.tcp_flags & (TCP_SYN | TCP_ACK | TCP_FIN | TCP_RST) != TCP_SYN
    {
        count_xdp(Reason::XdpNoFlow);
        return Some(reset::answer(ctx, p));
    }
    if !choose(p, service) {
        return Some(xdp_action::XDP_DROP);
    }
    let Some(flow) = new_flow(ctx, p) else { return Some(xdp_action::XDP_DROP) };
    let verdict = send(ctx, p, flow, true);
    if verdict != xdp_action::XDP_REDIRECT {
        forget(p, flow);
    }
    Some(verdict)
}

/// Removes a new flow whose first packet was not sent (no route or
/// neighbour yet, too big): the flow's next packet opens it anew. Kept,
/// it would not know where its server's replies arrive (`send`), and
/// they would be dropped.
#[inline(never)]
fn forget(p: &Packet, flow: &Flow) {
    let _ = NAT_REPLIES.remove(&reply_key(flow, p.protocol));
    let _ = FLOWS.remove(&flow_key(p));
}

/// A packet to an external VIP's address that lb does not serve there
/// (another port, another protocol, a fragment: `p` may be `Unbalanced`,
/// its `dst` address alone its own): `None` if it is not to such an
/// address. It is never handed to the kernel, which does not own the
/// address and would route it back out (or ask its neighbours for it):
/// TCP is answered with the node's reset, as a host with no listener
/// answers; anything else is dropped (an ICMP "unreachable" would answer
/// forged sources, and a VIP answering pings would claim a service that
/// may have no server). Counted either way (`xdp_unserved`).
#[inline(never)]
pub(crate) fn unserved(ctx: &XdpContext, p: &Packet) -> Option<u32> {
    let address = Endpoint { addr: p.dst.addr, port: 0, _pad: [0; 2] };
    // SAFETY: the values are only read.
    unsafe { EXTERNAL.get(&address) }?;
    if !packet::for_this_node(ctx) {
        return Some(xdp_action::XDP_PASS);
    }
    count_xdp(Reason::XdpUnserved);
    if u32::from(p.protocol) == IPPROTO_TCP && !p.icmp_error && p.dst.port != 0 {
        return Some(reset::answer(ctx, p));
    }
    Some(xdp_action::XDP_DROP)
}

/// A client's packet to an external VIP: its flow's entry, if the flow is
/// known and keeps its server (a flow that does not leaves both tables,
/// and so frees its NAT port: its next packet is of no flow).
#[inline(never)]
fn known(ctx: &XdpContext, p: &Packet, service: &Service) -> Option<&'static mut Flow> {
    // SAFETY: a map value, valid for the whole program run; this CPU alone
    // writes a flow's entry while it handles the flow's packet (a flow
    // arrives on one queue). Used in place: the flow tables' structs are
    // not copied onto the stack.
    let flow = unsafe { &mut *FLOWS.get_ptr_mut(&flow_key(p))? };
    if keeps(ctx, service, flow, p) {
        return Some(flow);
    }
    let _ = NAT_REPLIES.remove(&reply_key(flow, p.protocol));
    let _ = FLOWS.remove(&flow_key(p));
    None
}

/// Sends a client's packet along its flow (`flow`, its `FLOWS` entry):
/// the FIB's route, NAT, redirect; or, too big for the route, answers it
/// with the node's own "too big" (`too_big.rs`). `new`: the flow's first
/// packet, whose route says where the server's replies arrive.
#[inline(never)]
fn send(ctx: &XdpContext, p: &Packet, flow: &mut Flow, new: bool) -> u32 {
    // Routed before it is rewritten: a packet too big is quoted as the
    // client sent it.
    let ifindex = match route::route(ctx, p, &flow.node, &flow.server) {
        Route::Via(ifindex) => ifindex,
        not_sent => {
            // The client's SYN sent again is the first the server sees,
            // not a sign that it is silent (a new flow is forgotten).
            flow.syn_at_ns = 0;
            if let Route::TooBig(mtu) = not_sent {
                return too_big::answer(ctx, p, mtu as u16);
            }
            return xdp_action::XDP_DROP;
        }
    };
    if !packet::rewrite(ctx, p, &flow.node, &flow.server) {
        count_xdp(Reason::XdpTruncated);
        return xdp_action::XDP_DROP;
    }
    let tcp = u32::from(p.protocol) == IPPROTO_TCP;
    // The first SYN of the flow (or of a new connection on its ports).
    if flow.syn_at_ns == 0 && p.is_syn() && tcp {
        // SAFETY: plain helper call without arguments.
        flow.syn_at_ns = unsafe { bpf_ktime_get_ns() };
    }
    // The client's first packet after its SYN completes the handshake.
    let acked = flow.syn_at_ns != 0 && !p.is_syn() && tcp;
    if acked {
        flow.syn_at_ns = 0;
    }
    if new {
        // Where the server's replies arrive: only there can a reset fail it.
        if let Some(entry) = NAT_REPLIES.get_ptr_mut(&reply_key(flow, p.protocol)) {
            // SAFETY: a map value of this flow, written only for it.
            unsafe { (*entry).server_ifindex = ifindex };
        }
    }
    if acked || p.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        client_notes(flow, p);
    }
    add_traffic(&flow.server, p.ip_len);
    packet::redirect(ifindex)
}

/// Notes in the flow's `NAT_REPLIES` entry that the client completed its
/// handshake, or sent a FIN or a reset (`lb_common::nat`: when its NAT
/// port may go to another flow). A BPF function of its own: inlined,
/// `send`'s frame grew by a third.
#[inline(never)]
fn client_notes(flow: &Flow, p: &Packet) {
    let Some(entry) = NAT_REPLIES.get_ptr_mut(&reply_key(flow, p.protocol)) else { return };
    // SAFETY: plain helper call without arguments.
    let now = nat::tick(unsafe { bpf_ktime_get_ns() });
    let fin = p.tcp_flags & TCP_FIN != 0;
    // SAFETY: a map value of this flow; its flags word is written whole.
    unsafe {
        let flags = nat::after_tcp((*entry).flags, false, false, fin, p.is_rst());
        (*entry).flags = nat::stamp(flags, now);
    }
}

/// Whether a packet of a known flow keeps going to the flow's server.
/// It does while the server is in the selection and usable. A failure
/// mark of the kernel's own moves the flow only if it is not an
/// established TCP flow (under NAT the next server resets a moved one);
/// the daemon's confirmed failure moves every flow. The client's SYN
/// sent again to a server that has not answered it fails the server,
/// if it is a SYN the server must answer (`packet::syn`), and moves it.
#[inline(always)]
fn keeps(ctx: &XdpContext, service: &Service, flow: &Flow, p: &Packet) -> bool {
    let server = &flow.server;
    let Some(state) = daemon_state(service, server) else {
        count_xdp(Reason::XdpFlowMoved);
        return false;
    };
    let confirmed = state == DAEMON_STATE_FAILED;
    let marked = confirmed || !(unmarked_lately(service, server) || usable(service, server));
    let syn_again = p.is_syn() && flow.syn_at_ns != 0;
    if !marked && !syn_again {
        return true;
    }
    // SAFETY: a copy of the flags.
    let flags = unsafe { NAT_REPLIES.get(&reply_key(flow, p.protocol)) }.map_or(0, |r| r.flags);
    let established = u32::from(p.protocol) == IPPROTO_TCP && flags & NAT_REPLY_ESTABLISHED != 0;
    if marked {
        if confirmed || !established {
            count_xdp(Reason::XdpFlowMoved);
            return false;
        }
        count_xdp(Reason::XdpKeptEstablished);
    }
    if !syn_again || established {
        // Established: a new connection on the same ports, after the last.
        return true;
    }
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if now.wrapping_sub(flow.syn_at_ns) < SYN_RETRANSMIT_MIN_NS {
        return true;
    }
    if !packet::syn::answerable(ctx, p) {
        count_xdp(Reason::XdpSynMalformed);
        return true;
    }
    count_xdp(Reason::XdpSynRetransmitted);
    if mark_failed_reporting(&flow.server) {
        emit(EXTERNAL_FLOW_COOKIE, &p.dst, &flow.server, EventKind::ConnectTimeout);
    }
    false
}

/// A `spread` service's server for `p`'s new flow from its Maglev table
/// (`MAGLEV`, written by the daemon from the spread group), if the slot
/// names one that is still preferred and usable; otherwise the choice is
/// the socket path's.
#[inline(always)]
fn consistent(service: &Service, p: &Packet) -> Option<Endpoint> {
    if service.spread <= 1 {
        return None;
    }
    // SAFETY: the value is only read; the daemon replaces values whole.
    let table = unsafe { MAGLEV.get(&p.dst) }?;
    let server = maglev::server_for(table, maglev::flow_hash(&p.src, p.protocol))?;
    if !(preferred(service, &server) && usable(service, &server)) {
        return None;
    }
    count_xdp(Reason::XdpConsistent);
    Some(server)
}

/// Chooses the server of `p`'s new flow (the Maglev table's, else the
/// socket path's choice) into this CPU's `NEW_FLOW` slot; false (counted)
/// if the flow must be refused. A BPF function of its own, apart from
/// `new_flow`: together their frames passed Linux 5.10's limit.
#[inline(never)]
fn choose(p: &Packet, service: &Service) -> bool {
    let server = match consistent(service, p) {
        Some(server) => server,
        None => {
            let Ok(server) = choose_server(service, &XDP) else { return false };
            server
        }
    };
    if server.is_v4() == p.ipv6 {
        count_xdp(Reason::XdpFamilyMismatch);
        return false;
    }
    let Some(slot) = NEW_FLOW.get_ptr_mut(0) else {
        count_xdp(Reason::MapError);
        return false;
    };
    // SAFETY: this CPU's slot, used by this program run alone (see
    // `PACKET` in maps.rs).
    unsafe { (*slot).nat.server = server };
    true
}

/// Records `p`'s new flow, to the server `choose` chose, with a NAT
/// port in `FLOWS` and `NAT_REPLIES`: its `FLOWS` entry, or `None`
/// (counted) if the flow must be refused. A port is free if it has no
/// entry, or if its entry's flow has ended long enough ago (`reclaim`).
#[inline(never)]
fn new_flow(ctx: &XdpContext, p: &Packet) -> Option<&'static mut Flow> {
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
    let mut allocated = false;
    // Ports at random, each on its own: ports tried in a row would cluster
    // the ones taken, as linear probing does in a hash table. The second
    // half of the tries is pressed (`lb_common::nat`).
    for i in 0..2 * NAT_TRIES {
        // SAFETY: plain helper call without arguments.
        let random = unsafe { bpf_get_prandom_u32() };
        let port = NAT_PORT_FIRST + (random % u32::from(NAT_PORT_COUNT)) as u16;
        new.nat.node.port = port.to_be();
        if NAT_REPLIES.insert(&new.nat, &new.reply, u64::from(BPF_NOEXIST)).is_ok()
            || reclaim(&new.nat, tcp, tick, i >= NAT_TRIES)
                && NAT_REPLIES.insert(&new.nat, &new.reply, u64::from(BPF_ANY)).is_ok()
        {
            allocated = true;
            break;
        }
    }
    if !allocated {
        count_xdp(Reason::XdpNatPortsExhausted);
        return None;
    }
    // Its SYN's time is set as the SYN leaves (`send`).
    let flow = Flow { server: new.nat.server, node: new.nat.node, syn_at_ns: 0 };
    let entry = match FLOWS.insert(&flow_key(p), &flow, u64::from(BPF_ANY)) {
        Ok(()) => FLOWS.get_ptr_mut(&flow_key(p)),
        Err(_) => None,
    };
    let Some(entry) = entry else {
        count_xdp(Reason::MapError);
        let _ = NAT_REPLIES.remove(&new.nat);
        return None;
    };
    count_xdp(Reason::XdpNewFlow);
    // SAFETY: as in `known`.
    Some(unsafe { &mut *entry })
}

/// Whether the NAT port of `nat`'s entry may go to a new flow: its flow
/// has ended or idled out (`lb_common::nat::reusable`). If so, that
/// flow's `FLOWS` entry goes too, if it still holds the port: its next
/// packet is a new flow, never one that shares the port.
#[inline(always)]
fn reclaim(nat: &NatKey, tcp: bool, tick: u32, pressed: bool) -> bool {
    // SAFETY: a map value, read in place.
    let Some(old) = (unsafe { NAT_REPLIES.get(nat) }) else { return false };
    if !nat::reusable(old.flags, tcp, tick, pressed) {
        return false;
    }
    let key = FlowKey { client: old.client, vip: old.vip, protocol: nat.protocol, _pad: [0; 3] };
    // SAFETY: as above.
    if let Some(flow) = unsafe { FLOWS.get(&key) }
        && flow.node == nat.node
        && flow.server == nat.server
    {
        let _ = FLOWS.remove(&key);
    }
    count_xdp(Reason::XdpNatPortReused);
    true
}

/// A server's packet: translated back and sent to its client if it
/// answers a forwarded flow; `None` if it does not.
#[inline(never)]
fn reply(ctx: &XdpContext, p: &Packet) -> Option<u32> {
    let key = NatKey { server: p.src, node: p.dst, protocol: p.protocol, _pad: [0; 3] };
    let Some(entry) = NAT_REPLIES.get_ptr_mut(&key) else {
        count_xdp(Reason::XdpNotOurs);
        return None;
    };
    if !packet::for_this_node(ctx) {
        return Some(xdp_action::XDP_PASS);
    }
    // SAFETY: a map value, valid for the whole program run; copied, and
    // written back only in its flags word.
    let nat = unsafe { *entry };
    // SAFETY: the context's fields are valid for the whole program run.
    if unsafe { (*ctx.ctx).ingress_ifindex } != nat.server_ifindex {
        count_xdp(Reason::XdpReplyElsewhere);
        return Some(xdp_action::XDP_DROP);
    }
    let mut flags = nat.flags;
    if flags & NAT_REPLY_ESTABLISHED == 0 {
        if !p.is_rst() {
            flags |= NAT_REPLY_ESTABLISHED;
        } else if refuses(&nat, p) {
            count_xdp(Reason::XdpServerReset);
            if mark_failed_reporting(&p.src) {
                emit(EXTERNAL_FLOW_COOKIE, &nat.vip, &p.src, EventKind::ConnectFailed);
            }
        }
    }
    let tcp = u32::from(p.protocol) == IPPROTO_TCP;
    if tcp {
        let (syn, fin) = (p.tcp_flags & TCP_SYN != 0, p.tcp_flags & TCP_FIN != 0);
        flags = nat::after_tcp(flags, true, syn, fin, p.is_rst());
    }
    // SAFETY: plain helper call without arguments.
    let tick = nat::tick(unsafe { bpf_ktime_get_ns() });
    let flags = nat::stamp_reply(nat.flags, flags, tcp, tick);
    if flags != nat.flags {
        // SAFETY: as above; a stamp changes about once a millisecond.
        unsafe { (*entry).flags = flags };
    }
    if packet::ttl(ctx, p) <= 1 {
        count_xdp(Reason::XdpTtlExceeded);
        return Some(xdp_action::XDP_PASS);
    }
    if !packet::rewrite(ctx, p, &nat.vip, &nat.client) || !packet::set_link(ctx, p, nat.macs) {
        return Some(xdp_action::XDP_DROP);
    }
    count_xdp(Reason::XdpReplied);
    Some(packet::redirect(nat.client_ifindex))
}

/// Whether the reset `p` (from where the flow's packets to the server
/// leave: `reply` checked) is the server refusing the flow's SYN: the
/// flow began with a SYN and the reset acknowledges it.
#[inline(always)]
fn refuses(nat: &NatReply, p: &Packet) -> bool {
    nat.flags & NAT_REPLY_SYN != 0 && p.tcp_ack == nat.syn_seq.wrapping_add(1)
}

/// The `FLOWS` key of `p`'s flow.
#[inline(always)]
fn flow_key(p: &Packet) -> FlowKey {
    FlowKey { client: p.src, vip: p.dst, protocol: p.protocol, _pad: [0; 3] }
}

/// The `NAT_REPLIES` key of `flow`'s replies.
#[inline(always)]
fn reply_key(flow: &Flow, protocol: u8) -> NatKey {
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

/// Counts a packet of `bytes` forwarded to `server`: in this CPU's slot
/// of `TRAFFIC_SLOTS` for it if the server holds it, or takes it (free,
/// or idle for `TRAFFIC_SLOT_IDLE_TICKS`, its counts moved to its holder's
/// `TRAFFIC` entry); else in `TRAFFIC` (`lb_common::TrafficSlot`).
#[inline(always)]
fn add_traffic(server: &Endpoint, bytes: u32) {
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_jiffies64() };
    if let Some(slot) = TRAFFIC_SLOTS.get_ptr_mut(traffic_slot(server)) {
        // SAFETY: this CPU's slot, written only by `lb_xdp` on this CPU,
        // which runs one packet at a time (see `count_xdp`).
        let slot = unsafe { &mut *slot };
        if slot.server == *server || take_slot(slot, server, now) {
            slot.used_at = now;
            slot.traffic.packets += 1;
            slot.traffic.bytes += u64::from(bytes);
            return;
        }
    }
    let Some(traffic) = traffic_entry(server) else { return };
    // SAFETY: a per-CPU map value of two u64s, valid for the program run;
    // plain adds, as in `count_xdp`.
    unsafe {
        (*traffic).packets += 1;
        (*traffic).bytes += u64::from(bytes);
    }
}

/// Whether `server` may have `slot`, and has it now: the slot is free, or
/// its holder has not used it for `TRAFFIC_SLOT_IDLE_TICKS` and its counts
/// moved to the holder's `TRAFFIC` entry.
#[inline(always)]
fn take_slot(slot: &mut TrafficSlot, server: &Endpoint, now: u64) -> bool {
    if slot.server != Endpoint::default() {
        if now.wrapping_sub(slot.used_at) < TRAFFIC_SLOT_IDLE_TICKS {
            return false;
        }
        let Some(traffic) = traffic_entry(&slot.server) else { return false };
        // SAFETY: as in `add_traffic`.
        unsafe {
            (*traffic).packets += slot.traffic.packets;
            (*traffic).bytes += slot.traffic.bytes;
        }
    }
    *slot = TrafficSlot { server: *server, ..TrafficSlot::default() };
    true
}

/// This CPU's entry of `server` in `TRAFFIC`, as sock_ops counts
/// connections (`add_connection`): the first packet to a server on any
/// CPU creates its entry (the other CPUs' slots start at zero); one that
/// lost that race to another CPU adds to the entry it made. `None`
/// (counted) if the map is full.
#[inline(always)]
fn traffic_entry(server: &Endpoint) -> Option<*mut Traffic> {
    if TRAFFIC.get_ptr_mut(server).is_none() {
        let _ = TRAFFIC.insert(server, &Traffic::default(), u64::from(BPF_NOEXIST));
    }
    let entry = TRAFFIC.get_ptr_mut(server);
    if entry.is_none() {
        count_xdp(Reason::MapError);
    }
    entry
}
