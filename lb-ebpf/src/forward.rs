//! The external path: packets from other machines to an external VIP,
//! forwarded to a server with NAT, and the servers' replies translated
//! back (`lb_xdp`, on the interfaces the daemon attaches it to).
//!
//! A client's packet to VIP:port belongs to a flow (`known`): its first
//! packet gets a server (`choose`), chosen as a connect to the VIP would
//! be (`select.rs`), and a NAT port (`new_flow`), allocated by inserting
//! the flow's reply key into `OPENING_REPLIES` (its flow in
//! `OPENING_FLOWS`; a UDP flow's in `UDP_REPLIES` and `UDP_FLOWS`, where
//! it stays). A TCP flow whose client acknowledges its server's
//! SYN-ACK moves to the established tables, `FLOWS` and `NAT_REPLIES`
//! (`promote`), which new flows never evict. Its packets leave
//! with the server as destination and the node's own address toward that
//! server (`NODE_ADDRESSES`) and the NAT port as source, by the kernel's
//! FIB (`send`); one too big for that route is answered with the node's
//! own ICMP error (`too_big.rs`).
//! A VIP that keeps the client's address (`externalTrafficPolicy:
//! Local`; its `EXTERNAL` value says so) is translated the same way but
//! for the source: its flows' packets leave with the client's own
//! address and port, which stand where the NAT port stands in the reply
//! key; the server, on this node or behind it, sends its replies through
//! the node, its gateway, where `reply.rs` translates them back.
//! A flow keeps its server while the server is in the selection and
//! usable; then its next packet chooses again.
//!
//! Only a SYN opens a TCP flow: a client's TCP packet of no flow that is
//! not one is answered with the node's own reset (`reset.rs`), as a host
//! answers it, and reaches no server.
//!
//! A server's packet to a NAT port is translated back to the VIP and the
//! client (`reply.rs`).
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

use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns, programs::XdpContext};
use lb_common::{
    DAEMON_STATE_FAILED, EXTERNAL_CLIENT_AFFINITY, EXTERNAL_FLOW_COOKIE, EXTERNAL_KEEP_CLIENT,
    Endpoint, EventKind, Flow, NAT_REPLY_ESTABLISHED, Reason, Service, maglev, nat,
};

use crate::{
    consts::{IPPROTO_TCP, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    flows::{flow_key, forget, new_flow, promote, reply_key},
    icmp,
    maps::{
        EPOCH, EXTERNAL, FLOWS, MAGLEV, NAT_REPLIES, NEW_FLOW, OPENING_REPLIES, SERVICES,
        count_xdp, in_vip_ports, opening_flows, opening_replies,
    },
    packet,
    per_second::{Budget, spend},
    reply,
    report::{emit, mark_failed_reporting},
    reset,
    route::{self, Route},
    scratch::Packet,
    select::{XDP, choose_server, daemon_state, preferred, unmarked_lately, usable},
    too_big,
    traffic::add_traffic,
};

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
pub(crate) fn forward(ctx: &XdpContext, p: &mut Packet) -> Option<u32> {
    if p.icmp_error {
        return icmp::forward_error(ctx, p);
    }
    // Read before what it stands for, and before the link layer is
    // rewritten: the verdict this packet may leave for its flow's next.
    let epoch = EPOCH.get(0).copied().unwrap_or(0);
    let to_mac = packet::read::<[u8; 6]>(ctx, 0).unwrap_or_default();
    // A port no external VIP has is none of `EXTERNAL`'s VIPs: most of
    // what is not lb's (the node's own traffic) pays no hash miss here,
    // and one in all (`unserved`'s, for the address).
    let external = if in_vip_ports(u16::from_be(p.dst.port)) {
        // SAFETY: the values are only read; the daemon replaces values whole.
        unsafe { EXTERNAL.get(&p.dst) }
    } else {
        None
    };
    let Some(&external) = external else {
        return reply::reply(ctx, p).or_else(|| {
            count_xdp(Reason::XdpNotOurs);
            unserved(ctx, p)
        });
    };
    let keep_client = external & EXTERNAL_KEEP_CLIENT != 0;
    let by_address = external & EXTERNAL_CLIENT_AFFINITY != 0;
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
    if let Some(flow) = known(ctx, p, service, keep_client) {
        count_xdp(Reason::XdpForwarded);
        // A client's packet after its SYN, of an opening TCP flow: the
        // handshake may be complete (`promote` checks).
        let completes =
            p.opening && u32::from(p.protocol) == IPPROTO_TCP && p.tcp_flags & TCP_SYN == 0;
        let verdict = send(ctx, p, flow, false);
        if completes && verdict == xdp_action::XDP_REDIRECT {
            promote(p, flow);
        } else if verdict == xdp_action::XDP_REDIRECT && established_only(p, flow) {
            // SAFETY: the context's fields are valid for the whole program run.
            let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
            route::keep_verdict(&flow.server, ingress, &p.dst, epoch, to_mac);
        }
        return Some(verdict);
    }
    // Only a SYN opens a TCP flow; anything else of no flow is answered
    // as a host answers it.
    if u32::from(p.protocol) == IPPROTO_TCP
        && p.tcp_flags & (TCP_SYN | TCP_ACK | TCP_FIN | TCP_RST) != TCP_SYN
    {
        count_xdp(Reason::XdpNoFlow);
        return Some(reset::answer(ctx, p));
    }
    if !spend(Budget::NewFlow) || !choose(p, service, by_address) {
        return Some(xdp_action::XDP_DROP);
    }
    let Some(flow) = new_flow(ctx, p, keep_client) else { return Some(xdp_action::XDP_DROP) };
    p.opening = true;
    let verdict = send(ctx, p, flow, true);
    if verdict != xdp_action::XDP_REDIRECT {
        forget(p, flow);
    }
    Some(verdict)
}

/// Whether `p`, a client's packet that went on along `flow`, is one of
/// those `established.rs` forwards: of an established TCP flow not
/// waiting for a SYN's answer, and no SYN, FIN or reset itself.
#[inline(always)]
fn established_only(p: &Packet, flow: &Flow) -> bool {
    !p.opening
        && u32::from(p.protocol) == IPPROTO_TCP
        && p.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0
        && flow.syn_at_ns == 0
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
/// known and keeps its server, and is translated as the VIP now says
/// (`keep_client`: its source toward the server is the client's own). A
/// flow that does not leaves both tables, and so frees its NAT port: its
/// next packet is of no flow.
#[inline(never)]
fn known(
    ctx: &XdpContext,
    p: &mut Packet,
    service: &Service,
    keep_client: bool,
) -> Option<&'static mut Flow> {
    let key = flow_key(p);
    // UDP flows are never established.
    let tcp = u32::from(p.protocol) == IPPROTO_TCP;
    let (entry, opening) = match if tcp { FLOWS.get_ptr_mut(&key) } else { None } {
        Some(entry) => (entry, false),
        None => (opening_flows(p.protocol).get_ptr_mut(&key)?, true),
    };
    p.opening = opening;
    // SAFETY: a map value, valid for the whole program run; this CPU alone
    // writes a flow's entry while it handles the flow's packet (a flow
    // arrives on one queue). Used in place: the flow tables' structs are
    // not copied onto the stack.
    let flow = unsafe { &mut *entry };
    if opening && !owns_port(p, flow) {
        // Its NAT entry was evicted, and its port may be another flow's.
        let _ = opening_flows(p.protocol).remove(&key);
        return None;
    }
    if translated_as(flow, p, keep_client) && keeps(ctx, service, flow, p) {
        return Some(flow);
    }
    if opening {
        let _ = opening_replies(p.protocol).remove(&reply_key(flow, p.protocol));
        let _ = opening_flows(p.protocol).remove(&key);
    } else {
        let _ = NAT_REPLIES.remove(&reply_key(flow, p.protocol));
        let _ = FLOWS.remove(&key);
    }
    None
}

/// Whether `flow` is translated as `p`'s VIP now says: its source toward
/// the server is the client's own exactly when the VIP keeps the
/// client's address (`keep_client`). A BPF function of its own: inlined,
/// the branches of the endpoints' comparison multiplied the verifier's
/// paths through `keeps` (a fifth more instructions for all of `lb_xdp`).
#[inline(never)]
fn translated_as(flow: &Flow, p: &Packet, keep_client: bool) -> bool {
    (flow.node == p.src) == keep_client
}

/// Whether the NAT port of `flow`, an opening flow of `p`'s, is still its
/// own: the opening tables are evicted apart, and a port whose entry went
/// may be another flow's by now.
#[inline(always)]
fn owns_port(p: &Packet, flow: &Flow) -> bool {
    // SAFETY: a map value, only read.
    match unsafe { opening_replies(p.protocol).get(&reply_key(flow, p.protocol)) } {
        Some(entry) => entry.client == p.src && entry.vip == p.dst,
        None => false,
    }
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
        if let Some(entry) = opening_replies(p.protocol).get_ptr_mut(&reply_key(flow, p.protocol)) {
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
    let key = reply_key(flow, p.protocol);
    let entry = if p.opening {
        opening_replies(p.protocol).get_ptr_mut(&key)
    } else {
        NAT_REPLIES.get_ptr_mut(&key)
    };
    let Some(entry) = entry else { return };
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
    // An established table's flow, or a TCP one the server answered.
    let established = u32::from(p.protocol) == IPPROTO_TCP
        && (!p.opening
            // SAFETY: a copy of the flags.
            || unsafe { OPENING_REPLIES.get(&reply_key(flow, p.protocol)) }
                .is_some_and(|r| r.flags & NAT_REPLY_ESTABLISHED != 0));
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
/// the socket path's. `by_address`: the slot is the client address's,
/// whatever its port (`sessionAffinity: ClientIP`).
#[inline(always)]
fn consistent(service: &Service, p: &Packet, by_address: bool) -> Option<Endpoint> {
    if service.spread <= 1 {
        return None;
    }
    // SAFETY: the value is only read; the daemon replaces values whole.
    let table = unsafe { MAGLEV.get(&p.dst) }?;
    let port = if by_address { 0 } else { p.src.port };
    let client = Endpoint { addr: p.src.addr, port, _pad: [0; 2] };
    let server = maglev::server_for(table, maglev::flow_hash(&client, p.protocol))?;
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
fn choose(p: &Packet, service: &Service, by_address: bool) -> bool {
    let server = match consistent(service, p, by_address) {
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
