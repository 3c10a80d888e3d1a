//! ICMP errors about the external path's flows, translated as the flows'
//! packets are, so that both ends learn what the network said: a server's
//! "port unreachable" reaches the client's socket, a router's "too big"
//! lowers the path MTU of the end that sent too much.
//!
//! An error quotes the packet it is about (RFC 792, RFC 4443: its IP
//! header and at least the first 8 bytes after it, where the ports are).
//! `parse` reads the quote into the `Packet` in place of the error's own
//! addresses, so the flow tables are asked about the quoted packet:
//!
//! - a quote of a forwarded packet (node:NAT port → server) is answered
//!   from `NAT_REPLIES` or the opening ones (`to_client`): the error goes back to the client
//!   the way its flow's replies go, quoting the packet as the client sent
//!   it (client → VIP). Its source, if it is the server, becomes the VIP;
//!   a router on the way keeps its own address.
//! - a quote of a reply (VIP → client) is answered from `FLOWS` or the opening ones
//!   (`to_server`): the error goes to the flow's server from the node's
//!   address, quoting the reply as the server sent it.
//!
//! Every checksum the rewrite touches is updated incrementally: the outer
//! IPv4 header's, the ICMP checksum (for ICMPv6 its pseudo-header holds
//! the outer addresses), the quoted IPv4 header's, and the quoted TCP or
//! UDP checksum where the quote holds it (as Linux's NAT does; a quote of
//! 8 bytes ends before a TCP checksum).
//!
//! An error from the servers' side counts only if it arrives where the
//! flow's packets to the server leave, as a server's reset does: one
//! forged on the clients' side is passed untouched. An error about a
//! reply counts only if it arrives where the flow's client packets
//! arrive, and a "too big" only if its MTU is one a path may have
//! ([`MIN_MTU4`], [`MIN_MTU6`]): the server keeps one path MTU toward the
//! node's address for all its flows through the node, so a client's
//! forged "too big" about its own flow could otherwise shrink every
//! one of them to nothing.

#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys go by reference, as in forward.rs: a key passed by value is one more copy \
              of it on the stack"
)]

use aya_ebpf::{bindings::xdp_action, programs::XdpContext};
use lb_common::{Endpoint, Flow, FlowKey, NatKey, Reason, checksum};

use crate::{
    consts::{IPPROTO_TCP, L3},
    maps::{EXTERNAL, FLOWS, NAT_REPLIES, count_xdp, opening_flows, opening_replies},
    packet::{
        self,
        quote::{ICMP4, ICMP6, QUOTE4, QUOTE4_L4, QUOTE6, QUOTE6_L4},
        read, write,
    },
    route::{self, Route},
    scratch::Packet,
};

/// The least MTU a "too big" about a reply may say, IPv4: Linux's
/// `net.ipv4.route.min_pmtu` default, below which a Linux server would
/// not go anyway (RFC 791's 68 is for fragments, which no TCP path uses).
const MIN_MTU4: u32 = 552;
/// The same for IPv6: every IPv6 link carries 1280 (RFC 8200).
const MIN_MTU6: u32 = 1280;

/// What to do with an ICMP error `parse` took: `None` if it is about no
/// flow of the external path and not sent to a VIP's address.
#[inline(always)]
pub(crate) fn forward_error(ctx: &XdpContext, p: &Packet) -> Option<u32> {
    if !packet::for_this_node(ctx) {
        return None;
    }
    // SAFETY: the value is only read; the daemon replaces values whole.
    let translated = if unsafe { EXTERNAL.get(&p.src) }.is_some() {
        to_server(ctx, p)
    } else {
        to_client(ctx, p)
    };
    translated.or_else(|| to_a_vip(p))
}

/// An error about no flow sent to a VIP's address: dropped, counted
/// (`xdp_unserved`), as anything else for that address lb does not
/// serve (`forward::unserved`): the kernel does not own the address and
/// would route it back out. `None` if it is sent elsewhere.
#[inline(never)]
fn to_a_vip(p: &Packet) -> Option<u32> {
    let address = Endpoint { addr: p.error_to, port: 0, _pad: [0; 2] };
    // SAFETY: the value is only read.
    unsafe { EXTERNAL.get(&address) }?;
    count_xdp(Reason::XdpUnserved);
    Some(xdp_action::XDP_DROP)
}

/// An error about a forwarded packet (quoted as node:NAT port → server):
/// to the flow's client, as a reply of the flow.
#[inline(never)]
fn to_client(ctx: &XdpContext, p: &Packet) -> Option<u32> {
    let key = NatKey { server: p.dst, node: p.src, protocol: p.protocol, _pad: [0; 3] };
    // SAFETY: map values, valid for the whole program run, only read.
    let nat = unsafe { NAT_REPLIES.get(&key).or_else(|| opening_replies(p.protocol).get(&key)) };
    let Some(nat) = nat else {
        count_xdp(Reason::XdpNotOurs);
        return None;
    };
    // SAFETY: the context's fields are valid for the whole program run.
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    if ingress != nat.server_ifindex {
        count_xdp(Reason::XdpNotOurs);
        return None;
    }
    if packet::ttl(ctx, p) <= 1 {
        count_xdp(Reason::XdpTtlExceeded);
        return Some(xdp_action::XDP_PASS);
    }
    let from = outer_source(ctx, p)?;
    let from = if from == p.dst.addr { &nat.vip.addr } else { &from };
    if !outer(ctx, p, from, &nat.client.addr)
        || !quote(ctx, p, &nat.client, &nat.vip)
        || !packet::set_link(ctx, p, nat.macs)
    {
        count_xdp(Reason::XdpTruncated);
        return Some(xdp_action::XDP_DROP);
    }
    count_xdp(Reason::XdpIcmpToClient);
    Some(packet::redirect(nat.client_ifindex))
}

/// An error about a reply (quoted as VIP → client): to the flow's server,
/// from the node's address toward it, by the kernel's FIB.
#[inline(never)]
fn to_server(ctx: &XdpContext, p: &Packet) -> Option<u32> {
    let key = FlowKey { client: p.dst, vip: p.src, protocol: p.protocol, _pad: [0; 3] };
    // SAFETY: as in `to_client`.
    let flow = unsafe { FLOWS.get(&key).or_else(|| opening_flows(p.protocol).get(&key)) };
    let Some(flow) = flow else {
        count_xdp(Reason::XdpNotOurs);
        return None;
    };
    if !from_the_clients_side(ctx, p, flow) {
        return Some(xdp_action::XDP_DROP);
    }
    if packet::ttl(ctx, p) <= 1 {
        count_xdp(Reason::XdpTtlExceeded);
        return Some(xdp_action::XDP_PASS);
    }
    if !outer(ctx, p, &flow.node.addr, &flow.server.addr)
        || !quote(ctx, p, &flow.server, &flow.node)
    {
        count_xdp(Reason::XdpTruncated);
        return Some(xdp_action::XDP_DROP);
    }
    let ifindex = match route::route(ctx, p, &flow.node, &flow.server) {
        Route::Via(ifindex) => ifindex,
        Route::TooBig(_) => {
            // An error is never answered with another.
            count_xdp(Reason::XdpTooBigDropped);
            return Some(xdp_action::XDP_DROP);
        }
        Route::Unreachable => return Some(xdp_action::XDP_DROP),
    };
    count_xdp(Reason::XdpIcmpToServer);
    Some(packet::redirect(ifindex))
}

/// Whether an error about `flow`'s reply may go to its server: it arrived
/// on the interface the flow's client packets arrive on (its
/// `NatReply::client_ifindex`), and if it is a "too big", its MTU is at
/// least [`MIN_MTU4`] or [`MIN_MTU6`]. Counted when not. A function of
/// its own: its key would otherwise sit in `to_server`'s frame, on the
/// chain that reaches the FIB lookup.
#[inline(never)]
fn from_the_clients_side(ctx: &XdpContext, p: &Packet, flow: &Flow) -> bool {
    let key = NatKey { server: flow.server, node: flow.node, protocol: p.protocol, _pad: [0; 3] };
    // SAFETY: map values, valid for the whole program run, only read; the
    // context's fields are valid for the whole program run.
    let (nat, ingress) = unsafe {
        (
            NAT_REPLIES.get(&key).or_else(|| opening_replies(p.protocol).get(&key)),
            (*ctx.ctx).ingress_ifindex,
        )
    };
    if nat.is_none_or(|nat| nat.client_ifindex != ingress) {
        count_xdp(Reason::XdpIcmpElsewhere);
        return false;
    }
    // "Fragmentation needed" (type 3 code 4) carries its MTU in bytes
    // 6-7; ICMPv6 "packet too big" (type 2) in bytes 4-7.
    let mtu = if p.ipv6 {
        match read::<[u8; 8]>(ctx, ICMP6) {
            Some([2, _, _, _, a, b, c, d]) => Some((u32::from_be_bytes([a, b, c, d]), MIN_MTU6)),
            _ => None,
        }
    } else {
        match read::<[u8; 8]>(ctx, ICMP4) {
            Some([3, 4, _, _, _, _, a, b]) => {
                Some((u32::from(u16::from_be_bytes([a, b])), MIN_MTU4))
            }
            _ => None,
        }
    };
    if let Some((mtu, floor)) = mtu
        && mtu < floor
    {
        count_xdp(Reason::XdpTooBigBelowFloor);
        return false;
    }
    true
}

/// The error's own source address, in an `Endpoint`'s form.
#[inline(always)]
fn outer_source(ctx: &XdpContext, p: &Packet) -> Option<[u32; 4]> {
    if p.ipv6 {
        read::<[u32; 4]>(ctx, L3 + 8)
    } else {
        read::<u32>(ctx, L3 + 12).map(|w| Endpoint::from_v4_raw(w, 0).addr)
    }
}

/// Reads the 16-bit checksum at `at`, applies `update` and writes it back.
#[inline(always)]
fn update(ctx: &XdpContext, at: usize, update: impl FnOnce(u16) -> u16) -> bool {
    match read::<u16>(ctx, at) {
        Some(check) => write(ctx, at, update(check)),
        None => false,
    }
}

/// Rewrites the error's own addresses to `src` → `dst`, and the checksum
/// that covers them: the IPv4 header's, or ICMPv6's (its pseudo-header).
/// False if the packet is shorter than parsed, which cannot happen.
///
/// A BPF function of its own, as is `quote`: inlined into their callers,
/// the frames passed the 512 bytes of stack a call chain may use.
#[inline(never)]
fn outer(ctx: &XdpContext, p: &Packet, src: &[u32; 4], dst: &[u32; 4]) -> bool {
    if p.ipv6 {
        let Some(old) = read::<[u32; 8]>(ctx, L3 + 8) else { return false };
        let updated = update(ctx, ICMP6 + 2, |mut check| {
            for i in 0..4 {
                check = checksum::replace32(check, old[i], src[i]);
                check = checksum::replace32(check, old[4 + i], dst[i]);
            }
            check
        });
        updated && write(ctx, L3 + 8, *src) && write(ctx, L3 + 24, *dst)
    } else {
        let Some(old) = read::<[u32; 2]>(ctx, L3 + 12) else { return false };
        let updated = update(ctx, L3 + 10, |check| {
            checksum::replace32(checksum::replace32(check, old[0], src[3]), old[1], dst[3])
        });
        updated && write(ctx, L3 + 12, [src[3], dst[3]])
    }
}

/// Rewrites the quoted packet to `src` → `dst` (addresses and ports), and
/// every checksum that covers them: the quoted IPv4 header's, the quoted
/// TCP or UDP checksum if the quote holds it, and the ICMP checksum over
/// all of these.
#[inline(never)]
fn quote(ctx: &XdpContext, p: &Packet, src: &Endpoint, dst: &Endpoint) -> bool {
    let (icmp_at, l4) = if p.ipv6 { (ICMP6 + 2, QUOTE6_L4) } else { (ICMP4 + 2, QUOTE4_L4) };
    let Some(mut icmp) = read::<u16>(ctx, icmp_at) else { return false };
    // The addresses and ports, as they count in any checksum over them.
    // Verifier workaround: functions inlined, not closures. LLVM made the
    // closure a BPF function of its own, a fourth frame on the chain from
    // `lb_xdp` through `to_server` (160 + 192 + 128 + 64 bytes), past the
    // 512 Linux 5.10 allows a chain; inlined, the chain is 512.
    let addresses = |check: u16| moved_addresses(check, p, src, dst);
    let ports = |check: u16| moved_ports(check, p, src, dst);
    icmp = ports(addresses(icmp));
    let written = if p.ipv6 {
        write(ctx, QUOTE6 + 8, src.addr) && write(ctx, QUOTE6 + 24, dst.addr)
    } else {
        let Some(old) = read::<u16>(ctx, QUOTE4 + 10) else { return false };
        let new = addresses(old);
        icmp = checksum::replace16(icmp, old, new);
        write(ctx, QUOTE4 + 10, new) && write(ctx, QUOTE4 + 12, [src.addr[3], dst.addr[3]])
    };
    if !(written && write(ctx, l4, [src.port, dst.port])) {
        return false;
    }
    // The quoted TCP or UDP checksum, if the quote reaches it (a UDP
    // header is 8 bytes; a quote of 8 bytes ends before TCP's), and is
    // not IPv4 UDP's "no checksum".
    let tcp = u32::from(p.protocol) == IPPROTO_TCP;
    let at = l4 + if tcp { 16 } else { 6 };
    if let Some(old) = read::<u16>(ctx, at)
        && (tcp || p.ipv6 || old != 0)
    {
        let mut new = ports(addresses(old));
        if !tcp {
            new = checksum::udp_field(new);
        }
        icmp = checksum::replace16(icmp, old, new);
        if !write(ctx, at, new) {
            return false;
        }
    }
    write(ctx, icmp_at, icmp)
}

/// `check` after the quote's addresses moved from `p`'s to `src` → `dst`.
#[inline(always)]
fn moved_addresses(mut check: u16, p: &Packet, src: &Endpoint, dst: &Endpoint) -> u16 {
    for i in 0..4 {
        check = checksum::replace32(check, p.src.addr[i], src.addr[i]);
        check = checksum::replace32(check, p.dst.addr[i], dst.addr[i]);
    }
    check
}

/// `check` after the quote's ports moved from `p`'s to `src` → `dst`.
#[inline(always)]
fn moved_ports(check: u16, p: &Packet, src: &Endpoint, dst: &Endpoint) -> u16 {
    let check = checksum::replace16(check, p.src.port, src.port);
    checksum::replace16(check, p.dst.port, dst.port)
}
