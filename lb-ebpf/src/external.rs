//! The external path: packets from other machines to an external VIP,
//! forwarded to a server with NAT, and the servers' replies translated
//! back (`lb_xdp`, on the interfaces the daemon attaches it to).
//!
//! A client's packet to VIP:port belongs to a flow (`FLOWS`, `lookup`):
//! its first packet gets a server (`new_flow`), chosen as a connect to the VIP would be
//! (`select.rs`), and a NAT port, allocated by inserting the flow's reply
//! key into `NAT_REPLIES`. Its packets leave with the server as
//! destination and the node's own address toward that server
//! (`NODE_ADDRESSES`) and the NAT port as source, by the kernel's FIB
//! (`send`).
//! A flow keeps its server while the server is in the selection and
//! usable; then its next packet chooses again.
//!
//! A server's packet to a NAT port (`reply`) is translated back to the
//! VIP and the client, and leaves the way the client's packets came.
//!
//! ICMP errors about a flow, from either side, are translated as its
//! packets are (`icmp.rs`).
//!
//! Failures, as on the socket path: a reset that answers a flow's SYN, or
//! the client's SYN sent again while the server has not answered, marks
//! the server failed (`FAILED_AT`), so the next choice skips it, and tells
//! the daemon. A reset counts only if it arrives where packets to the
//! server leave and acknowledges the SYN: a packet forged on the client's
//! side cannot fail a server.

#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys go by reference: a key passed by value is one more copy of it on a stack that \
              holds 512 bytes for the whole call chain"
)]

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST, xdp_action},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    programs::XdpContext,
};
use lb_common::{
    Endpoint, EventKind, Flow, FlowKey, NAT_PORT_COUNT, NAT_PORT_FIRST, NAT_REPLY_ESTABLISHED,
    NAT_REPLY_SYN, NatKey, NatReply, Reason, Service, Traffic, maglev,
};

use crate::{
    CHOSEN, EXTERNAL, FLOWS, IPPROTO_TCP, MAGLEV, NAT_REPLIES, NODE_ADDRESSES, SERVICES, TRAFFIC,
    atomic_add, count, icmp,
    packet::{self, Packet},
    report::{emit, mark_failed},
    select::{XDP, choose_server, preferred, selected, usable},
};

/// NAT ports tried for a new flow before it is refused.
const NAT_TRIES: u32 = 8;

/// The soonest a client's SYN sent again counts as a retransmission: no
/// TCP retransmits a SYN sooner (Linux waits 1 s, RFC 6298 at least 1 s).
/// One sooner is a duplicate, or forged to fail a server that has had no
/// time to answer: it follows the first and fails nothing.
const SYN_RETRANSMIT_MIN_NS: u64 = 900_000_000;

/// What `lookup` found for a client's packet to an external VIP.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Its flow is known and keeps its server.
    Known,
    /// It needs a server and a NAT port (`new_flow`).
    New,
    /// Done: this verdict.
    Verdict(u32),
}

/// What to do with a packet the external path takes: `None` if it is
/// neither for an external VIP nor a reply to a forwarded flow.
///
/// A client's packet goes through `lookup`, `choose` and `new_flow` (for a
/// flow's first packet) and `send`, one after the other: each is a BPF function of its
/// own (not inlined), with its own stack frame, as are `reply` and
/// `packet::route`. Inlined into one, or calling each other, their frames
/// would add up past the 512 bytes a program's call chain may use.
#[inline(always)]
pub(crate) fn handle(ctx: &XdpContext, p: &Packet) -> Option<u32> {
    if p.icmp_error {
        return icmp::handle(ctx, p);
    }
    // SAFETY: the values are only read; the daemon replaces values whole.
    if unsafe { EXTERNAL.get(&p.dst) }.is_none() {
        return reply(ctx, p);
    }
    let step = lookup(ctx, p);
    if let Step::Verdict(verdict) = step {
        return Some(verdict);
    }
    if step == Step::New && !(choose(p) && new_flow(ctx, p)) {
        return Some(xdp_action::XDP_DROP);
    }
    Some(send(ctx, p, step == Step::New))
}

/// A client's packet to an external VIP: whether its flow is known and
/// keeps its server (a flow that does not loses its reply entry, and so
/// its NAT port).
#[inline(never)]
fn lookup(ctx: &XdpContext, p: &Packet) -> Step {
    // SAFETY: as in `handle`.
    let Some(service) = (unsafe { SERVICES.get(&p.dst) }) else {
        count(Reason::XdpNoServer);
        return Step::Verdict(xdp_action::XDP_DROP);
    };
    if packet::ttl(ctx, p) <= 1 {
        count(Reason::XdpTtlExceeded);
        return Step::Verdict(xdp_action::XDP_PASS);
    }
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: a map value, valid for the whole program run; this CPU alone
    // writes a flow's entry while it handles the flow's packet (a flow
    // arrives on one queue). Read in place: the flow tables' structs are
    // not copied onto the stack.
    let Some(known) = (unsafe { FLOWS.get(&flow_key(p)) }) else { return Step::New };
    if keeps(service, known, p, now) {
        count(Reason::XdpForwarded);
        return Step::Known;
    }
    let _ = NAT_REPLIES.remove(&reply_key(known, p.protocol));
    Step::New
}

/// Sends a client's packet along its flow (recorded in `FLOWS`): NAT,
/// the FIB's route, redirect. `new`: the flow's first packet, whose route
/// says where the server's replies arrive.
#[inline(never)]
fn send(ctx: &XdpContext, p: &Packet, new: bool) -> u32 {
    // SAFETY: as in `lookup`.
    let Some(flow) = (unsafe { FLOWS.get(&flow_key(p)) }) else {
        count(Reason::MapError);
        return xdp_action::XDP_DROP;
    };
    if !packet::rewrite(ctx, p, &flow.node, &flow.server) {
        count(Reason::XdpTruncated);
        return xdp_action::XDP_DROP;
    }
    let Some(ifindex) = packet::route(ctx, p, &flow.node, &flow.server) else {
        if new {
            // Never sent: the client's SYN sent again is a new flow, not a
            // sign of a silent server.
            let (reply, key) = (reply_key(flow, p.protocol), flow_key(p));
            let _ = NAT_REPLIES.remove(&reply);
            let _ = FLOWS.remove(&key);
        }
        return xdp_action::XDP_DROP;
    };
    if new {
        // Where the server's replies arrive: only there can a reset fail it.
        if let Some(entry) = NAT_REPLIES.get_ptr_mut(&reply_key(flow, p.protocol)) {
            // SAFETY: a map value of this flow, written only for it.
            unsafe { (*entry).server_ifindex = ifindex };
        }
    }
    add_traffic(&flow.server, p.ip_len);
    packet::redirect(ifindex)
}

/// Whether a packet of a known flow keeps going to the flow's server: the
/// server is still selected and usable, and this is not the client's SYN
/// sent again to a server that has not answered it (which fails it).
#[inline(always)]
fn keeps(service: &Service, flow: &Flow, p: &Packet, now: u64) -> bool {
    if !selected(service, &flow.server) || !usable(service, &flow.server, now) {
        count(Reason::XdpFlowMoved);
        return false;
    }
    if !p.is_syn() || flow.syn_at_ns == 0 {
        return true;
    }
    // SAFETY: a copy of the flags.
    let flags = unsafe { NAT_REPLIES.get(&reply_key(flow, p.protocol)) }.map_or(0, |r| r.flags);
    if flags & NAT_REPLY_ESTABLISHED != 0 {
        // A new connection on the same ports, after the last one.
        return true;
    }
    if now.wrapping_sub(flow.syn_at_ns) < SYN_RETRANSMIT_MIN_NS {
        return true;
    }
    count(Reason::XdpSynRetransmitted);
    mark_failed(&flow.server);
    emit(0, &p.dst, &flow.server, EventKind::ConnectTimeout);
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
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    if !(preferred(service, &server) && usable(service, &server, now)) {
        return None;
    }
    count(Reason::XdpConsistent);
    Some(server)
}

/// Chooses the server of `p`'s new flow (the Maglev table's, else the
/// socket path's choice) into this CPU's `CHOSEN` slot; false (counted)
/// if the flow must be refused. A BPF function of its own, apart from
/// `new_flow`: together their frames passed Linux 5.10's limit.
#[inline(never)]
fn choose(p: &Packet) -> bool {
    // SAFETY: as in `handle`.
    let Some(service) = (unsafe { SERVICES.get(&p.dst) }) else {
        count(Reason::XdpNoServer);
        return false;
    };
    let server = match consistent(service, p) {
        Some(server) => server,
        None => {
            let Ok(server) = choose_server(service, &XDP) else { return false };
            server
        }
    };
    if server.is_v4() == p.ipv6 {
        count(Reason::XdpFamilyMismatch);
        return false;
    }
    let Some(slot) = CHOSEN.get_ptr_mut(0) else {
        count(Reason::MapError);
        return false;
    };
    // SAFETY: this CPU's slot, used by this program run alone (see
    // `PACKET` in main.rs).
    unsafe { *slot = server };
    true
}

/// Records `p`'s new flow, to the server `choose` chose, with a NAT port
/// in `FLOWS` and `NAT_REPLIES`; false (counted) if the flow must be
/// refused.
#[inline(never)]
fn new_flow(ctx: &XdpContext, p: &Packet) -> bool {
    let Some(slot) = CHOSEN.get_ptr_mut(0) else {
        count(Reason::MapError);
        return false;
    };
    // SAFETY: as in `choose`; written there for this packet.
    let server = unsafe { *slot };
    let host = Endpoint { addr: server.addr, port: 0, _pad: [0; 2] };
    // SAFETY: a copy of the value.
    let Some(node) = (unsafe { NODE_ADDRESSES.get(&host) }).copied() else {
        count(Reason::XdpNoNodeAddress);
        return false;
    };
    let syn = u32::from(p.protocol) == IPPROTO_TCP && p.is_syn();
    // SAFETY: the context's fields are valid for the whole program run.
    let client_ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    let reply = NatReply {
        client: p.src,
        vip: p.dst,
        flags: if syn { NAT_REPLY_SYN } else { 0 },
        syn_seq: p.tcp_seq,
        client_ifindex,
        server_ifindex: 0,
        macs: match packet::macs(ctx) {
            Some(macs) => swapped(macs),
            None => return false,
        },
    };
    let mut nat = NatKey { server, node, protocol: p.protocol, _pad: [0; 3] };
    // SAFETY: plain helper call without arguments.
    let start = unsafe { bpf_get_prandom_u32() };
    let mut allocated = false;
    for i in 0..NAT_TRIES {
        let port = NAT_PORT_FIRST + (start.wrapping_add(i) % u32::from(NAT_PORT_COUNT)) as u16;
        nat.node.port = port.to_be();
        if NAT_REPLIES.insert(&nat, &reply, u64::from(BPF_NOEXIST)).is_ok() {
            allocated = true;
            break;
        }
    }
    if !allocated {
        count(Reason::XdpNatPortsExhausted);
        return false;
    }
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let flow = Flow { server, node: nat.node, syn_at_ns: if syn { now } else { 0 } };
    if FLOWS.insert(&flow_key(p), &flow, u64::from(BPF_ANY)).is_err() {
        count(Reason::MapError);
        let _ = NAT_REPLIES.remove(&nat);
        return false;
    }
    count(Reason::XdpNewFlow);
    true
}

/// A server's packet: translated back and sent to its client if it
/// answers a forwarded flow; `None` if it does not.
#[inline(never)]
fn reply(ctx: &XdpContext, p: &Packet) -> Option<u32> {
    let key = NatKey { server: p.src, node: p.dst, protocol: p.protocol, _pad: [0; 3] };
    let Some(entry) = NAT_REPLIES.get_ptr_mut(&key) else {
        count(Reason::XdpNotOurs);
        return None;
    };
    // SAFETY: a map value, valid for the whole program run; copied, and
    // written back only in its flags word.
    let nat = unsafe { *entry };
    if nat.flags & NAT_REPLY_ESTABLISHED == 0 {
        if !p.is_rst() {
            // SAFETY: as above.
            unsafe { (*entry).flags = nat.flags | NAT_REPLY_ESTABLISHED };
        } else if refuses(ctx, &nat, p) {
            count(Reason::XdpServerReset);
            mark_failed(&p.src);
            emit(0, &nat.vip, &p.src, EventKind::ConnectFailed);
        }
    }
    if packet::ttl(ctx, p) <= 1 {
        count(Reason::XdpTtlExceeded);
        return Some(xdp_action::XDP_PASS);
    }
    if !packet::rewrite(ctx, p, &nat.vip, &nat.client) || !packet::set_link(ctx, p, nat.macs) {
        return Some(xdp_action::XDP_DROP);
    }
    count(Reason::XdpReplied);
    Some(packet::redirect(nat.client_ifindex))
}

/// Whether the reset `p` is the server refusing the flow's SYN: the flow
/// began with a SYN, the reset acknowledges it, and it arrived where the
/// flow's packets to the server leave.
#[inline(always)]
fn refuses(ctx: &XdpContext, nat: &NatReply, p: &Packet) -> bool {
    // SAFETY: the context's fields are valid for the whole program run.
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    nat.flags & NAT_REPLY_SYN != 0
        && nat.server_ifindex != 0
        && ingress == nat.server_ifindex
        && p.tcp_ack == nat.syn_seq.wrapping_add(1)
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

/// Counts a packet of `bytes` forwarded to `server`, as sock_ops counts
/// connections (`add_connection`): the first packet to a server on any CPU
/// creates its entry (the other CPUs' slots start at zero); one that lost
/// that race to another CPU adds to the entry it made.
#[inline(always)]
fn add_traffic(server: &Endpoint, bytes: u32) {
    if TRAFFIC.get_ptr_mut(server).is_none() {
        let _ = TRAFFIC.insert(server, &Traffic::default(), u64::from(BPF_NOEXIST));
    }
    let Some(traffic) = TRAFFIC.get_ptr_mut(server) else {
        // The map is full: uncounted.
        count(Reason::MapError);
        return;
    };
    // SAFETY: a per-CPU map value of two u64s, valid for the program run.
    unsafe {
        atomic_add(&raw mut (*traffic).packets, 1);
        atomic_add(&raw mut (*traffic).bytes, u64::from(bytes));
    }
}
