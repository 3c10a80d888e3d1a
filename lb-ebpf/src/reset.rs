//! The node's own TCP reset, as a host answers a segment that belongs to
//! no connection (RFC 9293, 3.10.7.1): a client's TCP packet to an
//! external VIP that is not a SYN and has no flow (one the node never
//! saw, or whose server has left), or to a port of a VIP's address that
//! lb does not serve. Only a SYN creates a flow (`forward.rs`): a forged
//! ACK, FIN or data segment takes no NAT port and reaches no server. The
//! reset tells a client whose connection was cut (its server gone, or the
//! VIP moved to this node) at once, rather than after minutes of
//! retransmissions.
//!
//! A reset is never answered (it is dropped and counted). The answer is
//! the size of the question or smaller (a 40- or 60-byte IP packet), from
//! the VIP to the packet's source, out of the interface it came in on
//! (`XDP_TX`), to the MAC it came from: no amplification.
//!
//! It is built in place, as the node's "too big" is (`too_big.rs`): the
//! packet is cut to its IP and TCP headers (without options), and every
//! header written anew.

use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_csum_diff, bpf_xdp_adjust_tail},
    programs::XdpContext,
};
use lb_common::{Reason, checksum};

use crate::{
    consts::{IPPROTO_TCP, IPV4_HLEN, IPV6_HLEN, L3, TCP_ACK, TCP_FIN, TCP_HLEN, TCP_RST, TCP_SYN},
    maps::count_xdp,
    packet::{self, read, write},
    per_second::{Budget, spend},
    scratch::Packet,
};

/// The reset's TTL or hop limit.
const TTL: u8 = 64;

/// Answers `p`, a client's TCP segment of no flow: the verdict, `XDP_TX`
/// with the reset in the packet's place, or `XDP_DROP` (counted) for a
/// reset, a packet the answer cannot be built from, or one past this
/// CPU's answers for the second (`per_second.rs`: a flood of forged
/// segments makes the node send no more than that).
#[inline(never)]
pub(crate) fn answer(ctx: &XdpContext, p: &Packet) -> u32 {
    if p.is_rst() || !spend(Budget::Answer) || !build(ctx, p) {
        return xdp_action::XDP_DROP;
    }
    count_xdp(Reason::XdpResetSent);
    xdp_action::XDP_TX
}

/// Turns the packet into its reset; false if a helper refused or the
/// packet is shorter than parsed.
#[inline(always)]
fn build(ctx: &XdpContext, p: &Packet) -> bool {
    let Some(macs) = packet::macs(ctx) else { return false };
    let (seq, ack, flags) = if p.tcp_flags & TCP_ACK != 0 {
        // It acknowledged something: the reset takes that as its sequence.
        (p.tcp_ack, 0, TCP_RST)
    } else {
        let Some(offset) = read::<u8>(ctx, p.l4() + 12) else { return false };
        let ip_hlen = if p.ipv6 { IPV6_HLEN } else { IPV4_HLEN } as u32;
        let data = p.ip_len.saturating_sub(ip_hlen + 4 * u32::from(offset >> 4));
        let controls =
            u32::from(p.tcp_flags & TCP_SYN != 0) + u32::from(p.tcp_flags & TCP_FIN != 0);
        (0, p.tcp_seq.wrapping_add(data + controls), TCP_RST | TCP_ACK)
    };
    let length = ctx.data_end() - ctx.data();
    let wanted = p.l4() + TCP_HLEN;
    if length < wanted {
        return false;
    }
    // SAFETY: the helper takes the program's own context; the packet's
    // pointers are read anew after it.
    if unsafe { bpf_xdp_adjust_tail(ctx.ctx, wanted as i32 - length as i32) } != 0 {
        return false;
    }
    let mut link = [0u8; 12];
    link[..6].copy_from_slice(&macs[6..]);
    link[6..].copy_from_slice(&macs[..6]);
    // Ports as they lie in the packet (network order), swapped.
    let ports = [p.dst.port.to_ne_bytes(), p.src.port.to_ne_bytes()];
    let (seq, ack) = (seq.to_be_bytes(), ack.to_be_bytes());
    let tcp: [u8; TCP_HLEN] = [
        ports[0][0],
        ports[0][1],
        ports[1][0],
        ports[1][1],
        seq[0],
        seq[1],
        seq[2],
        seq[3],
        ack[0],
        ack[1],
        ack[2],
        ack[3],
        5 << 4,
        flags,
        0,
        0,
        0,
        0,
        0,
        0,
    ];
    write(ctx, 0, link)
        && write(ctx, p.l4(), tcp)
        && if p.ipv6 { ipv6(ctx, p) } else { ipv4(ctx, p) }
}

/// The IPv4 header, from the VIP to the client, and the TCP checksum.
#[inline(always)]
fn ipv4(ctx: &XdpContext, p: &Packet) -> bool {
    let total = ((IPV4_HLEN + TCP_HLEN) as u16).to_be_bytes();
    let (vip, client) = (p.dst.addr[3].to_ne_bytes(), p.src.addr[3].to_ne_bytes());
    // Version and header length, TOS, length, ID, DF, TTL, TCP, the
    // checksum (below), the addresses.
    let mut header: [u8; IPV4_HLEN] = [
        0x45,
        0,
        total[0],
        total[1],
        0,
        0,
        0x40,
        0,
        TTL,
        IPPROTO_TCP as u8,
        0,
        0,
        vip[0],
        vip[1],
        vip[2],
        vip[3],
        client[0],
        client[1],
        client[2],
        client[3],
    ];
    checksum::seal_ipv4_header(&mut header);
    let pseudo = u64::from(p.dst.addr[3])
        + u64::from(p.src.addr[3])
        + u64::from(u32::from_ne_bytes([0, IPPROTO_TCP as u8, 0, TCP_HLEN as u8]));
    write(ctx, L3, header) && tcp_checksum(ctx, p, u32::from(checksum::fold(pseudo)))
}

/// The IPv6 header, from the VIP to the client, and the TCP checksum.
#[inline(always)]
fn ipv6(ctx: &XdpContext, p: &Packet) -> bool {
    // Version 6, no traffic class or flow label; payload length, next
    // header TCP, hop limit.
    let first = [0x60u8, 0, 0, 0, 0, TCP_HLEN as u8, IPPROTO_TCP as u8, TTL];
    let mut pseudo = u64::from((TCP_HLEN as u32).to_be()) + u64::from(IPPROTO_TCP.to_be());
    for i in 0..4 {
        pseudo += u64::from(p.dst.addr[i]) + u64::from(p.src.addr[i]);
    }
    write(ctx, L3, first)
        && write(ctx, L3 + 8, p.dst.addr)
        && write(ctx, L3 + 24, p.src.addr)
        && tcp_checksum(ctx, p, u32::from(checksum::fold(pseudo)))
}

/// Writes the checksum of the TCP header (its field zero until now),
/// `seed` (the pseudo-header's sum) added.
#[inline(always)]
fn tcp_checksum(ctx: &XdpContext, p: &Packet, seed: u32) -> bool {
    let Some(tcp) = packet::at::<[u8; TCP_HLEN]>(ctx, p.l4()) else { return false };
    // SAFETY: `at` checked that the packet holds all 20 bytes (a multiple
    // of 4, as the helper needs).
    let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, tcp.cast(), TCP_HLEN as u32, seed) };
    if sum < 0 {
        return false;
    }
    write(ctx, p.l4() + 16, !checksum::fold(sum as u64))
}
