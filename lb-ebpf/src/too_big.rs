//! The node's own "too big": a client's packet that the route toward its
//! server cannot carry (the kernel's FIB says the next hop's MTU is
//! smaller) is answered as a router answers it, with ICMP "fragmentation
//! needed" (IPv4) or "packet too big" (IPv6) carrying that MTU and quoting
//! the packet as the client sent it. The client's stack lowers its path
//! MTU to the VIP and sends smaller packets: without the answer the flow
//! would hang in a black hole (TCP's MSS says nothing of a smaller link
//! between the node and the server).
//!
//! The error comes from the VIP, the address the client knows, and goes
//! back out of the interface the packet came in on (`XDP_TX`), to the MAC
//! it came from. It is built in place: the packet is cut to the quote
//! (its IP header and [`QUOTED_L4`] bytes after it), and room for the new
//! IP and ICMP headers is made before it, where its Ethernet header was.
//!
//! Not answered, dropped and counted: an IPv4 packet that allows
//! fragmenting (a router would fragment it; XDP cannot), and any packet
//! on a kernel whose FIB does not say the MTU (before Linux 5.12).

use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_csum_diff, bpf_xdp_adjust_head, bpf_xdp_adjust_tail},
    programs::XdpContext,
};
use lb_common::{Reason, checksum};

use crate::{
    consts::L3,
    maps::count_xdp,
    packet::{self, read, write},
    per_second::{Budget, spend},
    scratch::Packet,
};

/// Bytes of the client's packet after its IP header that the error
/// quotes: the whole TCP header and more (RFC 792 asks for 8, RFC 4443
/// for as much as fits; the client needs the ports and, for TCP, the
/// sequence number).
const QUOTED_L4: usize = 64;
/// The error's TTL or hop limit.
const TTL: u8 = 64;
const IPV4_HLEN: usize = 20;
const IPV6_HLEN: usize = 40;
const ICMP_HLEN: usize = 8;
/// What the ICMP checksum covers: the ICMP header and the quote.
const ICMP4_LEN: usize = ICMP_HLEN + IPV4_HLEN + QUOTED_L4;
const ICMP6_LEN: usize = ICMP_HLEN + IPV6_HLEN + QUOTED_L4;

/// Answers `p`, too big for the route toward its server by the FIB's
/// `mtu`: the verdict, `XDP_TX` with the error in the packet's place, or
/// `XDP_DROP` (counted) where no answer is due or possible, or past this
/// CPU's answers for the second (`per_second.rs`).
#[inline(never)]
pub(crate) fn answer(ctx: &XdpContext, p: &Packet, mtu: u16) -> u32 {
    // Before Linux 5.12 the FIB leaves the field as the packet's length.
    let known_mtu = u32::from(mtu) < p.ip_len;
    // IPv4 flags: DF is bit 0x40 of byte 6.
    let may_fragment = !p.ipv6 && read::<u8>(ctx, L3 + 6).is_some_and(|b| b & 0x40 == 0);
    if !known_mtu || may_fragment || !spend(Budget::Answer) || !build(ctx, p, mtu) {
        count_xdp(Reason::XdpTooBigDropped);
        return xdp_action::XDP_DROP;
    }
    count_xdp(Reason::XdpTooBig);
    xdp_action::XDP_TX
}

/// Turns the packet into its error; false if the packet is shorter than
/// the quote or a helper refused.
#[inline(always)]
fn build(ctx: &XdpContext, p: &Packet, mtu: u16) -> bool {
    let Some(macs) = packet::macs(ctx) else { return false };
    let ip_hlen = if p.ipv6 { IPV6_HLEN } else { IPV4_HLEN };
    let length = ctx.data_end() - ctx.data();
    let quoted = L3 + ip_hlen + QUOTED_L4;
    if length < quoted {
        return false;
    }
    // SAFETY: the helpers take the program's own context; the packet's
    // pointers are read anew after them.
    let resized = unsafe {
        bpf_xdp_adjust_tail(ctx.ctx, quoted as i32 - length as i32) == 0
            && bpf_xdp_adjust_head(ctx.ctx, -((ip_hlen + ICMP_HLEN) as i32)) == 0
    };
    if !resized {
        return false;
    }
    // Back to where it came from: the MACs swapped, the same EtherType.
    let mut link = [0u8; 14];
    link[..6].copy_from_slice(&macs[6..]);
    link[6..12].copy_from_slice(&macs[..6]);
    link[12..].copy_from_slice(if p.ipv6 { &[0x86, 0xdd] } else { &[0x08, 0x00] });
    write(ctx, 0, link) && if p.ipv6 { ipv6(ctx, p, mtu) } else { ipv4(ctx, p, mtu) }
}

/// The IPv4 and ICMP headers of "fragmentation needed" (type 3, code 4),
/// from the VIP to the client, and the ICMP checksum over the quote.
#[inline(always)]
fn ipv4(ctx: &XdpContext, p: &Packet, mtu: u16) -> bool {
    let total = ((IPV4_HLEN + ICMP4_LEN) as u16).to_be_bytes();
    let (vip, client) = (p.dst.addr[3].to_ne_bytes(), p.src.addr[3].to_ne_bytes());
    // Version and header length, TOS, length, ID, no flags, TTL, ICMP,
    // the checksum (below), the addresses.
    let mut header: [u8; IPV4_HLEN] = [
        0x45, 0, total[0], total[1], 0, 0, 0, 0, TTL, 1, 0, 0, vip[0], vip[1], vip[2], vip[3],
        client[0], client[1], client[2], client[3],
    ];
    checksum::seal_ipv4_header(&mut header);
    let mtu = mtu.to_be_bytes();
    let icmp = [3u8, 4, 0, 0, 0, 0, mtu[0], mtu[1]];
    write(ctx, L3, header)
        && write(ctx, L3 + IPV4_HLEN, icmp)
        && icmp_checksum::<ICMP4_LEN>(ctx, L3 + IPV4_HLEN, 0)
}

/// The IPv6 and ICMPv6 headers of "packet too big" (type 2), from the VIP
/// to the client, and the ICMPv6 checksum over its pseudo-header and the
/// quote.
#[inline(always)]
fn ipv6(ctx: &XdpContext, p: &Packet, mtu: u16) -> bool {
    let length = (ICMP6_LEN as u16).to_be_bytes();
    // Version 6, no traffic class or flow label; payload length, next
    // header ICMPv6, hop limit.
    let first = [0x60u8, 0, 0, 0, length[0], length[1], 58, TTL];
    let mut pseudo = u64::from((ICMP6_LEN as u32).to_be()) + u64::from(58u32.to_be());
    for i in 0..4 {
        pseudo += u64::from(p.dst.addr[i]) + u64::from(p.src.addr[i]);
    }
    let mtu = u32::from(mtu).to_be_bytes();
    let icmp = [2u8, 0, 0, 0, mtu[0], mtu[1], mtu[2], mtu[3]];
    write(ctx, L3, first)
        && write(ctx, L3 + 8, p.dst.addr)
        && write(ctx, L3 + 24, p.src.addr)
        && write(ctx, L3 + IPV6_HLEN, icmp)
        && icmp_checksum::<ICMP6_LEN>(ctx, L3 + IPV6_HLEN, u32::from(checksum::fold(pseudo)))
}

/// Writes the checksum of the `N` bytes of ICMP header and quote at `at`
/// (its field zero until now), `seed` (a pseudo-header's sum) added.
#[inline(always)]
fn icmp_checksum<const N: usize>(ctx: &XdpContext, at: usize, seed: u32) -> bool {
    let Some(icmp) = packet::at::<[u8; N]>(ctx, at) else { return false };
    // SAFETY: `at` checked that the packet holds all `N` bytes (a multiple
    // of 4, as the helper needs).
    let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, icmp.cast(), N as u32, seed) };
    if sum < 0 {
        return false;
    }
    write(ctx, at + 2, !checksum::fold(sum as u64))
}
