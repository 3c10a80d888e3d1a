//! Packets as the XDP program sees them: Ethernet, then IPv4 (no options,
//! no fragments) or IPv6 (no extension headers), then TCP or UDP, or an
//! ICMP error quoting a TCP or UDP packet (`quote.rs`). Parsing
//! names where the headers are and what they say; rewriting changes the
//! addresses and ports with incremental checksum updates
//! (`lb_common::checksum`); where the rewritten packet goes is
//! `route.rs`'s, and it is redirected there.
//!
//! Addresses are kept as `Endpoint`s (IPv4 as IPv4-mapped, words in
//! network byte order, loaded as they lie), the same keys the socket path
//! uses, so the selection, the failure marks and the flow tables all speak
//! one form.

use core::mem::size_of;

use aya_ebpf::{helpers::bpf_redirect, programs::XdpContext};
use lb_common::{Endpoint, Reason, checksum};

pub(crate) mod quote;
pub(crate) mod syn;

use crate::{
    consts::{
        ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_TCP, IPPROTO_UDP, IPV4_HLEN, IPV6_HLEN, L3,
        TCP_HLEN,
    },
    maps::{EPOCH, LINK_MACS, LINKS_SEEN, count_xdp},
    scratch::{LINK_SLOTS, Packet, SeenLink},
};

/// A pointer to a `T` at `offset` bytes into the packet, if the packet
/// holds all of it (the check the verifier needs before every access).
#[inline(always)]
pub(crate) fn at<T>(ctx: &XdpContext, offset: usize) -> Option<*mut T> {
    let start = ctx.data() + offset;
    if start + size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some(start as *mut T)
}

/// Reads a `T` at `offset`; `None` past the end.
#[inline(always)]
pub(crate) fn read<T: Copy>(ctx: &XdpContext, offset: usize) -> Option<T> {
    // SAFETY: `at` checked the bounds; packet data may be unaligned.
    at::<T>(ctx, offset).map(|p| unsafe { p.read_unaligned() })
}

/// Writes `value` at `offset`; false past the end.
#[inline(always)]
pub(crate) fn write<T>(ctx: &XdpContext, offset: usize, value: T) -> bool {
    match at::<T>(ctx, offset) {
        Some(p) => {
            // SAFETY: as in `read`.
            unsafe { p.write_unaligned(value) };
            true
        }
        None => false,
    }
}

/// What `parse` made of a packet.
pub(crate) enum Parsed {
    /// TCP, UDP, or an ICMP error quoting one: the `Packet` says what.
    Packet,
    /// An IP packet the external path does not balance (another protocol,
    /// an ICMP message that is not an error, a fragment, IPv4 options,
    /// IPv6 extension headers): of the `Packet`, only `dst`'s address
    /// (port 0) is its own.
    Unbalanced,
    /// Anything else (not IP, truncated, an ICMP error's quote lb cannot
    /// have sent): passed untouched.
    Other,
}

/// Parses the packet's headers into `packet` (counted when it is not one
/// the external path forwards).
#[inline(always)]
pub(crate) fn parse(ctx: &XdpContext, packet: &mut Packet) -> Parsed {
    let Some(ethertype) = read::<u16>(ctx, 12) else {
        count_xdp(Reason::XdpNotIp);
        return Parsed::Other;
    };
    let ethertype = u16::from_be(ethertype);
    let (ipv6, protocol, src, dst, ip_len, l4) = if ethertype == ETH_P_IP {
        let Some(header) = read::<[u8; IPV4_HLEN]>(ctx, ETH_HLEN) else {
            count_xdp(Reason::XdpTruncated);
            return Parsed::Other;
        };
        let word =
            |i: usize| u32::from_ne_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        // Version 4, no options; not a fragment (neither MF nor an offset).
        if header[0] != 0x45 || u16::from_be_bytes([header[6], header[7]]) & 0x3fff != 0 {
            count_xdp(Reason::XdpUnparsed);
            if header[0] >> 4 != 4 {
                return Parsed::Other;
            }
            packet.dst = Endpoint::from_v4_raw(word(16), 0);
            return Parsed::Unbalanced;
        }
        let ip_len = u32::from(u16::from_be_bytes([header[2], header[3]]));
        (
            false,
            header[9],
            Endpoint::from_v4_raw(word(12), 0),
            Endpoint::from_v4_raw(word(16), 0),
            ip_len,
            ETH_HLEN + IPV4_HLEN,
        )
    } else if ethertype == ETH_P_IPV6 {
        let Some(header) = read::<[u32; IPV6_HLEN / 4]>(ctx, ETH_HLEN) else {
            count_xdp(Reason::XdpTruncated);
            return Parsed::Other;
        };
        let bytes = header[1].to_ne_bytes();
        let ip_len = u32::from(u16::from_be_bytes([bytes[0], bytes[1]])) + IPV6_HLEN as u32;
        let src =
            Endpoint { addr: [header[2], header[3], header[4], header[5]], port: 0, _pad: [0; 2] };
        let dst =
            Endpoint { addr: [header[6], header[7], header[8], header[9]], port: 0, _pad: [0; 2] };
        (true, bytes[2], src, dst, ip_len, ETH_HLEN + IPV6_HLEN)
    } else {
        count_xdp(Reason::XdpNotIp);
        return Parsed::Other;
    };
    *packet = Packet {
        ipv6,
        protocol,
        src,
        dst,
        tcp_flags: 0,
        tcp_ack: 0,
        tcp_seq: 0,
        ip_len,
        icmp_error: false,
        error_to: [0; 4],
        opening: false,
    };
    if u32::from(protocol) == IPPROTO_TCP {
        let Some(tcp) = read::<[u32; TCP_HLEN / 4]>(ctx, l4) else {
            count_xdp(Reason::XdpTruncated);
            return Parsed::Other;
        };
        let ports = tcp[0].to_ne_bytes();
        packet.src.port = u16::from_ne_bytes([ports[0], ports[1]]);
        packet.dst.port = u16::from_ne_bytes([ports[2], ports[3]]);
        packet.tcp_seq = u32::from_be(tcp[1]);
        packet.tcp_ack = u32::from_be(tcp[2]);
        packet.tcp_flags = tcp[3].to_ne_bytes()[1];
    } else if u32::from(protocol) == IPPROTO_UDP {
        let Some(ports) = read::<[u16; 2]>(ctx, l4) else {
            count_xdp(Reason::XdpTruncated);
            return Parsed::Other;
        };
        packet.src.port = ports[0];
        packet.dst.port = ports[1];
    } else if protocol == if ipv6 { quote::IPPROTO_ICMPV6 } else { quote::IPPROTO_ICMP } {
        return quote::parse(ctx, packet);
    } else if ipv6 && matches!(protocol, 0 | 43 | 44 | 50 | 51 | 60 | 135) {
        // Hop-by-hop, routing, fragment, ESP, AH, destination options,
        // mobility: extension headers lb does not walk.
        count_xdp(Reason::XdpUnparsed);
        return Parsed::Unbalanced;
    } else {
        count_xdp(Reason::XdpOtherProtocol);
        return Parsed::Unbalanced;
    }
    Parsed::Packet
}

/// Where the L4 checksum is, and whether it may be left alone (IPv4 UDP
/// without a checksum, field zero).
#[inline(always)]
fn l4_checksum(ctx: &XdpContext, p: &Packet) -> Option<(usize, u16, bool)> {
    let offset = p.l4() + if u32::from(p.protocol) == IPPROTO_TCP { 16 } else { 6 };
    let check = read::<u16>(ctx, offset)?;
    let udp = u32::from(p.protocol) == IPPROTO_UDP;
    Some((offset, check, udp && !p.ipv6 && check == 0))
}

/// Rewrites the packet's source to `src` and its destination to `dst`
/// (addresses and ports), updating the IPv4 header checksum and the TCP or
/// UDP checksum (whose pseudo-header holds the addresses) incrementally.
/// False if the packet is shorter than parsed, which cannot happen.
#[inline(always)]
pub(crate) fn rewrite(ctx: &XdpContext, p: &Packet, src: &Endpoint, dst: &Endpoint) -> bool {
    let Some((check_at, mut check, no_checksum)) = l4_checksum(ctx, p) else { return false };
    if p.ipv6 {
        for i in 0..4 {
            check = checksum::replace32(check, p.src.addr[i], src.addr[i]);
            check = checksum::replace32(check, p.dst.addr[i], dst.addr[i]);
        }
        let ok = write(ctx, L3 + 8, src.addr) && write(ctx, L3 + 24, dst.addr);
        if !ok {
            return false;
        }
    } else {
        let Some(ip_check) = read::<u16>(ctx, L3 + 10) else { return false };
        let (old_src, old_dst) = (p.src.addr[3], p.dst.addr[3]);
        let ip_check = checksum::replace32(ip_check, old_src, src.addr[3]);
        let ip_check = checksum::replace32(ip_check, old_dst, dst.addr[3]);
        check = checksum::replace32(check, old_src, src.addr[3]);
        check = checksum::replace32(check, old_dst, dst.addr[3]);
        let ok = write(ctx, L3 + 10, ip_check)
            && write(ctx, L3 + 12, src.addr[3])
            && write(ctx, L3 + 16, dst.addr[3]);
        if !ok {
            return false;
        }
    }
    check = checksum::replace16(check, p.src.port, src.port);
    check = checksum::replace16(check, p.dst.port, dst.port);
    if u32::from(p.protocol) == IPPROTO_UDP {
        check = checksum::udp_field(check);
    }
    if !no_checksum && !write(ctx, check_at, check) {
        return false;
    }
    write(ctx, p.l4(), [src.port, dst.port])
}

/// The TTL (IPv4) or hop limit (IPv6) of the packet; 0 if unreadable.
#[inline(always)]
pub(crate) fn ttl(ctx: &XdpContext, p: &Packet) -> u8 {
    read::<u8>(ctx, L3 + if p.ipv6 { 7 } else { 8 }).unwrap_or(0)
}

/// Takes one off the TTL or hop limit, as a router does (the caller
/// checked it is above 1).
#[inline(always)]
fn decrement_ttl(ctx: &XdpContext, p: &Packet) -> bool {
    if p.ipv6 {
        return write(ctx, L3 + 7, ttl(ctx, p).wrapping_sub(1));
    }
    // The TTL shares a checksummed 16-bit word with the protocol.
    let Some(old) = read::<[u8; 2]>(ctx, L3 + 8) else { return false };
    let new = [old[0].wrapping_sub(1), old[1]];
    let Some(ip_check) = read::<u16>(ctx, L3 + 10) else { return false };
    let ip_check = checksum::replace16(ip_check, u16::from_ne_bytes(old), u16::from_ne_bytes(new));
    write(ctx, L3 + 8, new) && write(ctx, L3 + 10, ip_check)
}

/// Whether the frame was sent to this node: to the MAC address of the
/// interface it arrived on (`LINK_MACS`; one the daemon has not written
/// yet is taken as this node's). A switch floods a frame for an address
/// it has not learned (a dead node's, one that aged out) to every port:
/// only the machine it was meant for may forward it, or two nodes would
/// each send the server a copy. Counted when it was not.
#[inline(always)]
pub(crate) fn for_this_node(ctx: &XdpContext) -> bool {
    // SAFETY: the context's fields are valid for the whole program run.
    let ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    let Some(mac) = link_mac(ifindex) else { return true };
    if read::<[u8; 6]>(ctx, 0) == Some(mac) {
        return true;
    }
    count_xdp(Reason::XdpOtherHost);
    false
}

/// The MAC address `LINK_MACS` has for interface `ifindex`: from this
/// CPU's copy (`LINKS_SEEN`) if it was read in the daemon's current
/// `EPOCH`, else looked up and copied. The epoch is read before the
/// lookup, so a copy is never newer than the epoch it is kept for.
#[inline(always)]
fn link_mac(ifindex: u32) -> Option<[u8; 6]> {
    let epoch = EPOCH.get(0).copied().unwrap_or(0);
    let seen = LINKS_SEEN.get_ptr_mut(ifindex & (LINK_SLOTS - 1));
    if let Some(seen) = seen {
        // SAFETY: this CPU's slot, used by this program run alone (see
        // `PACKET` in maps.rs).
        let seen = unsafe { &*seen };
        if seen.ifindex == ifindex && seen.epoch == epoch {
            return (seen.known != 0).then_some(seen.mac);
        }
    }
    // SAFETY: a copy of the value.
    let mac = unsafe { LINK_MACS.get(ifindex) }.map(|link| link.mac);
    if let Some(seen) = seen {
        let known = u8::from(mac.is_some());
        // SAFETY: as above.
        unsafe {
            *seen = SeenLink { ifindex, epoch, mac: mac.unwrap_or_default(), known, _pad: 0 }
        };
    }
    mac
}

/// The MAC addresses a packet came with: to send a reply back the way its
/// request came, with no lookup.
#[inline(always)]
pub(crate) fn macs(ctx: &XdpContext) -> Option<[u8; 12]> {
    read::<[u8; 12]>(ctx, 0)
}

/// Writes the link layer a packet leaves with (destination MAC, then
/// source MAC) and takes one off its TTL or hop limit, as a router does.
#[inline(always)]
pub(crate) fn set_link(ctx: &XdpContext, p: &Packet, macs: [u8; 12]) -> bool {
    if decrement_ttl(ctx, p) && write(ctx, 0, macs) {
        return true;
    }
    count_xdp(Reason::XdpTruncated);
    false
}

/// Sends the packet out of `ifindex`.
#[inline(always)]
pub(crate) fn redirect(ifindex: u32) -> u32 {
    count_xdp(Reason::XdpRedirected);
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(ifindex, 0) as u32 }
}
