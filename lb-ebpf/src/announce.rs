//! Announcing VIPs on the wire: an ARP request (IPv4) or a neighbour
//! solicitation (IPv6) for an address in `ANNOUNCE` on the interface it is
//! announced on is answered in place and sent back out of that interface
//! (`XDP_TX`), with the interface's MAC from the map. The daemon writes an
//! address there while its service has a usable server and removes it
//! otherwise; the VIP is never an address of the node.
//!
//! An address with an `ANNOUNCE_UNTIL` entry (a VIP elected by lease) is
//! answered only until that time: the holder's fence, kept by the kernel
//! itself, so a node whose daemon died or cannot renew its lease falls
//! silent before another node may take the lease over.
//!
//! Only the plain shapes are answered: Ethernet without a VLAN tag, ARP
//! for IPv4 over Ethernet, a solicitation in an IPv6 header without
//! extension headers, with at most its source link-layer option. Anything
//! else goes on to the rest of the program.
//!
//! A host probing for the address before it takes it is told it is taken,
//! as a host that has it would: an ARP probe (RFC 5227: sender address
//! 0.0.0.0) is answered as any request; duplicate address detection's
//! solicitation (source `::`) with an advertisement to all nodes, not
//! solicited (RFC 4861, 7.2.4).

use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns, programs::XdpContext};
use lb_common::{AnnounceKey, Reason, checksum};

use crate::{
    maps::{ANNOUNCE, ANNOUNCE_UNTIL, count_xdp},
    packet::{read, write},
    per_second::{Budget, spend},
};

const ETH_P_ARP: u16 = 0x0806;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_ICMPV6: u8 = 58;
const NEIGHBOUR_SOLICITATION: u8 = 135;
const NEIGHBOUR_ADVERTISEMENT: u8 = 136;
/// ARP's fixed part for IPv4 over Ethernet: htype 1, ptype 0x0800, hlen 6,
/// plen 4.
const ARP_IPV4_ETHERNET: [u8; 6] = [0, 1, 8, 0, 6, 4];
const ARP_REQUEST: u8 = 1;
const ARP_REPLY: u8 = 2;

/// Where things are: the ARP body and the IPv6 and ICMPv6 fields used.
const ARP: usize = 14;
const IP6_PAYLOAD_LEN: usize = 18;
const IP6_NEXT_HEADER: usize = 20;
const IP6_SRC: usize = 22;
const IP6_DST: usize = 38;
const ICMP6: usize = 54;
const ICMP6_CHECKSUM: usize = ICMP6 + 2;
const ICMP6_FLAGS: usize = ICMP6 + 4;
const NS_TARGET: usize = ICMP6 + 8;
const NS_OPTION: usize = ICMP6 + 24;
/// A solicitation's length without and with its source link-layer option.
const NS_LEN: u16 = 24;
const NS_LEN_WITH_OPTION: u16 = 32;
/// Neighbour advertisement flags: solicited, override.
const NA_SOLICITED_OVERRIDE: u8 = 0x60;
/// The flags of an answer to duplicate address detection: override alone.
const NA_OVERRIDE: u8 = 0x20;
/// ff02::1, all nodes on the link (as its 32-bit words lie in a packet),
/// and its multicast MAC.
const ALL_NODES: [u32; 4] =
    [u32::from_ne_bytes([0xff, 0x02, 0, 0]), 0, 0, u32::from_ne_bytes([0, 0, 0, 1])];
const ALL_NODES_MAC: [u8; 6] = [0x33, 0x33, 0, 0, 0, 1];

/// What [`answer`] returns for a packet that is no question it answers.
pub(crate) const NOT_ASKED: u32 = u32::MAX;

/// `XDP_TX` when the packet was a question about an announced address and
/// is now its answer; [`NOT_ASKED`] for anything else. Each kind of
/// question is answered in a BPF function of its own: their stack frames
/// are not added to each other's, nor to the forwarding path's.
#[inline(always)]
pub(crate) fn answer(ctx: &XdpContext) -> u32 {
    asked(ctx).unwrap_or(NOT_ASKED)
}

#[inline(always)]
fn asked(ctx: &XdpContext) -> Option<u32> {
    let ethertype = u16::from_be(read::<u16>(ctx, 12)?);
    if ethertype == ETH_P_ARP {
        return Some(arp_answer(ctx));
    }
    if ethertype == ETH_P_IPV6
        && read::<u8>(ctx, IP6_NEXT_HEADER)? == IPPROTO_ICMPV6
        && read::<u8>(ctx, ICMP6)? == NEIGHBOUR_SOLICITATION
    {
        let verdict = solicitation_answer(ctx);
        // The defence against a duplicate address probe goes to every node
        // on the link: past this CPU's answers for the second (a flood of
        // forged probes), none. Decided here, outside `solicitation`'s
        // frame: Linux 5.10 allows a chain of calls 512 bytes in all.
        if verdict == xdp_action::XDP_TX
            && read::<[u8; 6]>(ctx, 0) == Some(ALL_NODES_MAC)
            && !spend(Budget::Answer)
        {
            return Some(xdp_action::XDP_DROP);
        }
        return Some(verdict);
    }
    None
}

/// [`arp`] in a BPF function of its own, and [`solicitation`] in
/// another (see [`answer`]).
#[inline(never)]
fn arp_answer(ctx: &XdpContext) -> u32 {
    arp(ctx).unwrap_or(NOT_ASKED)
}

#[inline(never)]
fn solicitation_answer(ctx: &XdpContext) -> u32 {
    solicitation(ctx).unwrap_or(NOT_ASKED)
}

/// The interface the packet arrived on.
#[inline(always)]
fn ifindex(ctx: &XdpContext) -> u32 {
    // SAFETY: the context's fields are valid for the whole program run.
    unsafe { (*ctx.ctx).ingress_ifindex }
}

/// The MAC to answer with for `key`'s address on its interface: `None`
/// if it is not announced there, or if its fence has passed (counted).
#[inline(always)]
fn announced(key: &AnnounceKey) -> Option<[u8; 6]> {
    // SAFETY: a copy of the value.
    let mac = unsafe { ANNOUNCE.get(key) }?.mac;
    // SAFETY: as above.
    if let Some(&until) = unsafe { ANNOUNCE_UNTIL.get(key.addr) } {
        // SAFETY: plain helper call without arguments.
        if unsafe { bpf_ktime_get_ns() } >= until {
            count_xdp(Reason::XdpAnnounceFenced);
            return None;
        }
    }
    Some(mac)
}

/// An ARP request for an announced IPv4 address becomes its reply.
#[inline(always)]
fn arp(ctx: &XdpContext) -> Option<u32> {
    let body = read::<[u8; 28]>(ctx, ARP)?;
    if body[..6] != ARP_IPV4_ETHERNET || body[6] != 0 || body[7] != ARP_REQUEST {
        return None;
    }
    let (sender_mac, sender_ip, target_ip) = (&body[8..14], &body[14..18], &body[24..28]);
    let target = u32::from_ne_bytes([target_ip[0], target_ip[1], target_ip[2], target_ip[3]]);
    let key = AnnounceKey { ifindex: ifindex(ctx), addr: [0, 0, 0xffff_u32.to_be(), target] };
    let mac = announced(&key)?;
    let mut reply = [0u8; 28];
    reply[..6].copy_from_slice(&ARP_IPV4_ETHERNET);
    reply[7] = ARP_REPLY;
    reply[8..14].copy_from_slice(&mac);
    reply[14..18].copy_from_slice(target_ip);
    reply[18..24].copy_from_slice(sender_mac);
    reply[24..28].copy_from_slice(sender_ip);
    let mut link = [0u8; 12];
    link[..6].copy_from_slice(sender_mac);
    link[6..].copy_from_slice(&mac);
    if !(write(ctx, 0, link) && write(ctx, ARP, reply)) {
        return None;
    }
    count_xdp(Reason::XdpArpAnswered);
    Some(xdp_action::XDP_TX)
}

/// A neighbour solicitation for an announced IPv6 address becomes a
/// solicited advertisement (RFC 4861, 4.4 and 7.2.4) from that address to
/// the one that asked; one from `::` (duplicate address detection), an
/// advertisement to all nodes, not solicited. The checksum is updated for
/// what changed: the pseudo-header's addresses (the solicited-node group
/// gives way to the target; the asker stays, now as destination, or `::`
/// gives way to all nodes), the type, the flags, and the option's type
/// and address.
#[inline(always)]
fn solicitation(ctx: &XdpContext) -> Option<u32> {
    let length = u16::from_be(read::<u16>(ctx, IP6_PAYLOAD_LEN)?);
    // RFC 4861: hop limit 255 (it came from the link itself), code 0.
    if read::<u8>(ctx, IP6_NEXT_HEADER + 1)? != 255 || read::<u8>(ctx, ICMP6 + 1)? != 0 {
        return None;
    }
    let with_option = match length {
        NS_LEN => false,
        NS_LEN_WITH_OPTION => read::<[u8; 2]>(ctx, NS_OPTION)? == [1, 1],
        _ => return None,
    };
    let source = read::<[u32; 4]>(ctx, IP6_SRC)?;
    // Duplicate address detection (RFC 4862: no source link-layer option).
    let dad = source == [0; 4];
    if dad && with_option {
        return None;
    }
    let group = read::<[u32; 4]>(ctx, IP6_DST)?;
    let target = read::<[u32; 4]>(ctx, NS_TARGET)?;
    let key = AnnounceKey { ifindex: ifindex(ctx), addr: target };
    let mac = announced(&key)?;
    let asker_mac = read::<[u8; 6]>(ctx, 6)?;
    // To the asker; a prober has no address yet: to all nodes.
    let (to, to_mac, na_flags) = if dad {
        (ALL_NODES, ALL_NODES_MAC, NA_OVERRIDE)
    } else {
        (source, asker_mac, NA_SOLICITED_OVERRIDE)
    };
    let mut check = read::<u16>(ctx, ICMP6_CHECKSUM)?;
    let mut i = 0;
    while i < 4 {
        // The pseudo-header: (source, group) becomes (target, to).
        check = checksum::replace32(check, group[i], target[i]);
        check = checksum::replace32(check, source[i], to[i]);
        i += 1;
    }
    let kind = read::<u16>(ctx, ICMP6)?;
    let new_kind = u16::from_ne_bytes([NEIGHBOUR_ADVERTISEMENT, 0]);
    check = checksum::replace16(check, kind, new_kind);
    let flags = read::<u32>(ctx, ICMP6_FLAGS)?;
    let new_flags = u32::from_ne_bytes([na_flags, 0, 0, 0]);
    check = checksum::replace32(check, flags, new_flags);
    if with_option {
        let option = read::<[u16; 4]>(ctx, NS_OPTION)?;
        let mut new_option = [0u8; 8];
        new_option[0] = 2;
        new_option[1] = 1;
        new_option[2..].copy_from_slice(&mac);
        let new_words = [
            u16::from_ne_bytes([new_option[0], new_option[1]]),
            u16::from_ne_bytes([new_option[2], new_option[3]]),
            u16::from_ne_bytes([new_option[4], new_option[5]]),
            u16::from_ne_bytes([new_option[6], new_option[7]]),
        ];
        let mut w = 0;
        while w < 4 {
            check = checksum::replace16(check, option[w], new_words[w]);
            w += 1;
        }
        if !write(ctx, NS_OPTION, new_option) {
            return None;
        }
    }
    let mut link = [0u8; 12];
    link[..6].copy_from_slice(&to_mac);
    link[6..].copy_from_slice(&mac);
    let written = write(ctx, 0, link)
        && write(ctx, IP6_SRC, target)
        && write(ctx, IP6_DST, to)
        && write(ctx, ICMP6, new_kind)
        && write(ctx, ICMP6_FLAGS, new_flags)
        && write(ctx, ICMP6_CHECKSUM, check);
    if !written {
        return None;
    }
    count_xdp(Reason::XdpNdpAnswered);
    Some(xdp_action::XDP_TX)
}
