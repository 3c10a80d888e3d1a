//! The short way for most of what the external path forwards: a client's
//! packet of an established TCP flow, which the full path (`forward.rs`)
//! has already judged for its VIP and server, and a server's TCP packet
//! to a NAT port.
//!
//! When the full path sends a client's packet on (no SYN, FIN or reset,
//! its flow in `FLOWS`), it keeps its verdict beside the route this CPU
//! keeps for the server (`route::keep_verdict`): in the daemon's current
//! `EPOCH`, established flows of this VIP to this server, arriving on
//! this interface sent to this MAC address, go on. Here, before anything
//! else, such a packet is parsed onto the stack, looked up in `FLOWS`,
//! and, if the verdict and the route both hold, rewritten and redirected
//! at once: no parse into `PACKET`, no lookup in `EXTERNAL`, `LINK_MACS`
//! or `SERVICES`, no look at the server's state.
//!
//! What the verdict stands for does not change behind it: `SERVICES`,
//! `EXTERNAL` and `LINK_MACS` are the daemon's, and it bumps `EPOCH`
//! after every change to them; a failure mark of the kernel's own moves
//! no established flow (`forward::keeps`); a new route clears the
//! verdict, and a route is kept only `route::ROUTE_KEPT_TICKS`. Anything
//! the verdict does not cover goes the full way: a SYN, FIN or reset
//! (they change the flow's state), a flow waiting for a SYN's answer, a
//! TTL about to run out, another MAC address or interface, IPv4 options,
//! fragments, IPv6 extension headers.
//!
//! A server's packet goes to `reply.rs` at once, as the full path would
//! send it there, after its parse and its lookups, which tell a VIP's
//! packet from a reply: here a port no external VIP has (`VIP_PORTS`, an
//! array of a bit per port: no hash) in the NAT ports says the same.
//! Only a packet to such a port is looked at here beyond its port, so
//! that the node's own traffic pays little for the short way.

#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys go by reference: a key passed by value is one more copy of it on the stack"
)]

use aya_ebpf::{bindings::xdp_action, helpers::bpf_jiffies64, programs::XdpContext};
use lb_common::{Endpoint, Reason};

use crate::{
    consts::{
        ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_TCP, IPV4_HLEN, IPV6_HLEN, TCP_FIN, TCP_HLEN,
        TCP_RST, TCP_SYN,
    },
    flows::{flow_key, nat_ports},
    maps::{EPOCH, FLOWS, count_xdp, in_vip_ports},
    packet::{self, read},
    route,
    scratch::Packet,
    traffic::add_traffic_at,
};

/// What the short way made of a packet.
pub(crate) enum Short {
    /// A client's packet of an established flow, sent on: the verdict.
    Sent(u32),
    /// A TCP packet to a NAT port that no external VIP has, parsed into
    /// the `Packet` given: what the full path hands `reply.rs` too,
    /// without what comes before it there (the parse, a lookup in
    /// `EXTERNAL`: a port no VIP has is none of its entries). The caller
    /// runs `reply`: its frame and this one's do not fit on the stack
    /// one on top of the other.
    Reply,
    /// Anything else, untouched: the full path's.
    Full,
}

/// A client's packet of an established flow with a kept verdict, sent
/// on; a server's TCP packet to a NAT port, parsed into `p` for
/// `reply.rs`; anything else left for the full path.
#[inline(never)]
pub(crate) fn short_way(ctx: &XdpContext, p: &mut Packet) -> Short {
    let Some(ethertype) = read::<u16>(ctx, 12) else { return Short::Full };
    let ethertype = u16::from_be(ethertype);
    let ipv6 = ethertype == ETH_P_IPV6;
    if !ipv6 && ethertype != ETH_P_IP {
        return Short::Full;
    }
    // First the port, where a TCP header would hold it: most packets that
    // are neither (the node's own) go no further.
    let port = if ipv6 {
        read::<u16>(ctx, ETH_HLEN + IPV6_HLEN + 2)
    } else {
        read::<u16>(ctx, ETH_HLEN + IPV4_HLEN + 2)
    };
    let Some(port) = port.map(u16::from_be) else { return Short::Full };
    if in_vip_ports(port) {
        // Parsed onto the stack, where its fields stay in registers.
        let mut own = Packet::empty();
        if !parse(ctx, ipv6, &mut own) {
            return Short::Full;
        }
        return match from_client(ctx, &own) {
            Some(verdict) => Short::Sent(verdict),
            None => Short::Full,
        };
    }
    let (first, count) = nat_ports();
    if u32::from(port).wrapping_sub(first) < count && parse(ctx, ipv6, p) {
        return Short::Reply;
    }
    Short::Full
}

/// A client's packet of an established flow, sent on if this CPU keeps
/// the verdict that it may be (`route::kept_verdict`): the verdict;
/// `None`, untouched, for the full path.
#[inline(always)]
fn from_client(ctx: &XdpContext, p: &Packet) -> Option<u32> {
    if p.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) != 0 {
        return None;
    }
    // SAFETY: a map value, valid for the whole program run, only read.
    let flow = unsafe { FLOWS.get(&flow_key(p)) }?;
    if flow.syn_at_ns != 0 || packet::ttl(ctx, p) <= 1 {
        return None;
    }
    // SAFETY: the context's fields are valid for the whole program run.
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    // SAFETY: a plain helper call without arguments.
    let (epoch, now) = (EPOCH.get(0).copied()?, unsafe { bpf_jiffies64() });
    let to_mac = read::<[u8; 6]>(ctx, 0)?;
    let kept = route::kept_verdict(ingress, p, flow, to_mac, epoch, now)?;
    if !(packet::rewrite(ctx, p, &flow.node, &flow.server) && packet::set_link(ctx, p, kept.macs)) {
        count_xdp(Reason::XdpTruncated);
        return Some(xdp_action::XDP_DROP);
    }
    add_traffic_at(&flow.server, p.ip_len, now);
    count_xdp(Reason::XdpForwardedShort);
    Some(packet::redirect(kept.ifindex))
}

/// Parses the packet into `p` if it is a TCP segment (any flags), over
/// IPv4 without options and not a fragment, or IPv6 without extension
/// headers. Field by field: a `Packet` built first would take room on
/// the stack.
#[inline(always)]
fn parse(ctx: &XdpContext, ipv6: bool, p: &mut Packet) -> bool {
    let l4 = if ipv6 {
        let Some(header) = read::<[u32; IPV6_HLEN / 4]>(ctx, ETH_HLEN) else { return false };
        let bytes = header[1].to_ne_bytes();
        if u32::from(bytes[2]) != IPPROTO_TCP {
            return false;
        }
        p.ip_len = u32::from(u16::from_be_bytes([bytes[0], bytes[1]])) + IPV6_HLEN as u32;
        p.src.addr = [header[2], header[3], header[4], header[5]];
        p.dst.addr = [header[6], header[7], header[8], header[9]];
        ETH_HLEN + IPV6_HLEN
    } else {
        let Some(header) = read::<[u32; IPV4_HLEN / 4]>(ctx, ETH_HLEN) else { return false };
        let (head, fragment) = (header[0].to_ne_bytes(), header[1].to_ne_bytes());
        let protocol = header[2].to_ne_bytes()[1];
        // Version 4, no options; neither MF nor an offset; TCP.
        if head[0] != 0x45
            || u16::from_be_bytes([fragment[2], fragment[3]]) & 0x3fff != 0
            || u32::from(protocol) != IPPROTO_TCP
        {
            return false;
        }
        p.ip_len = u32::from(u16::from_be_bytes([head[2], head[3]]));
        p.src.addr = Endpoint::from_v4_raw(header[3], 0).addr;
        p.dst.addr = Endpoint::from_v4_raw(header[4], 0).addr;
        ETH_HLEN + IPV4_HLEN
    };
    let Some(tcp) = read::<[u32; TCP_HLEN / 4]>(ctx, l4) else { return false };
    let ports = tcp[0].to_ne_bytes();
    p.ipv6 = ipv6;
    p.protocol = IPPROTO_TCP as u8;
    p.src.port = u16::from_ne_bytes([ports[0], ports[1]]);
    p.dst.port = u16::from_ne_bytes([ports[2], ports[3]]);
    p.src._pad = [0; 2];
    p.dst._pad = [0; 2];
    p.tcp_flags = tcp[3].to_ne_bytes()[1];
    p.tcp_ack = u32::from_be(tcp[2]);
    p.tcp_seq = u32::from_be(tcp[1]);
    p.icmp_error = false;
    p.error_to = [0; 4];
    p.opening = false;
    true
}
