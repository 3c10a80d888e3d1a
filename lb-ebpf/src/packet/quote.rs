//! The quote of an ICMP error: the packet it is about (RFC 792, RFC 4443:
//! its IP header and at least the first 8 bytes after it, where the
//! ports are). `parse` reads the quote into the `Packet` in place of the
//! error's own addresses, so that the flow tables are asked about the
//! quoted packet; `icmp.rs` translates the errors it finds a flow for.

use aya_ebpf::programs::XdpContext;
use lb_common::{Endpoint, Reason};

use super::{Parsed, read};
use crate::{
    consts::{IPPROTO_TCP, IPPROTO_UDP, L3},
    maps::count_xdp,
    scratch::Packet,
};

pub(crate) const IPPROTO_ICMP: u8 = 1;
pub(crate) const IPPROTO_ICMPV6: u8 = 58;

/// Where the ICMP header starts, and the quoted packet's IP header and
/// its TCP or UDP header (no IPv4 options, no IPv6 extension headers, in
/// the error or in the quote: the external path forwards none).
pub(crate) const ICMP4: usize = L3 + 20;
pub(crate) const QUOTE4: usize = ICMP4 + 8;
pub(crate) const QUOTE4_L4: usize = QUOTE4 + 20;
pub(crate) const ICMP6: usize = L3 + 40;
pub(crate) const QUOTE6: usize = ICMP6 + 8;
pub(crate) const QUOTE6_L4: usize = QUOTE6 + 40;

/// Whether `kind` is an ICMP error type that quotes a packet: destination
/// unreachable (fragmentation needed is one), time exceeded, parameter
/// problem; for ICMPv6 also packet too big.
#[inline(always)]
fn is_error(ipv6: bool, kind: u8) -> bool {
    if ipv6 { matches!(kind, 1..=4) } else { matches!(kind, 3 | 11 | 12) }
}

/// Parses an ICMP error's quote into `p` (the outer family and length
/// stay): its protocol, and its source and destination as the quoted
/// packet had them. `Unbalanced` (counted) for any other ICMP message (an
/// echo request, say; `p` is still the packet's own), `Other` for a quote
/// the external path cannot have sent.
#[inline(always)]
pub(crate) fn parse(ctx: &XdpContext, p: &mut Packet) -> Parsed {
    let at = if p.ipv6 { ICMP6 } else { ICMP4 };
    let Some(kind) = read::<u8>(ctx, at) else {
        count_xdp(Reason::XdpTruncated);
        return Parsed::Other;
    };
    if !is_error(p.ipv6, kind) {
        count_xdp(Reason::XdpOtherProtocol);
        return Parsed::Unbalanced;
    }
    p.error_to = p.dst.addr;
    let quoted = if p.ipv6 { quote6(ctx, p) } else { quote4(ctx, p) };
    let Some(protocol) = quoted else {
        count_xdp(Reason::XdpUnparsed);
        return Parsed::Other;
    };
    if u32::from(protocol) != IPPROTO_TCP && u32::from(protocol) != IPPROTO_UDP {
        count_xdp(Reason::XdpOtherProtocol);
        return Parsed::Other;
    }
    let Some(ports) = read::<[u16; 2]>(ctx, if p.ipv6 { QUOTE6_L4 } else { QUOTE4_L4 }) else {
        count_xdp(Reason::XdpTruncated);
        return Parsed::Other;
    };
    p.protocol = protocol;
    p.src.port = ports[0];
    p.dst.port = ports[1];
    p.icmp_error = true;
    Parsed::Packet
}

/// The quoted IPv4 header's addresses into `p`; its protocol.
#[inline(always)]
fn quote4(ctx: &XdpContext, p: &mut Packet) -> Option<u8> {
    let header = read::<[u8; 20]>(ctx, QUOTE4)?;
    if header[0] != 0x45 {
        return None;
    }
    let word =
        |i: usize| u32::from_ne_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    p.src = Endpoint::from_v4_raw(word(12), 0);
    p.dst = Endpoint::from_v4_raw(word(16), 0);
    Some(header[9])
}

/// The quoted IPv6 header's addresses into `p`; its next header.
#[inline(always)]
fn quote6(ctx: &XdpContext, p: &mut Packet) -> Option<u8> {
    let header = read::<[u32; 10]>(ctx, QUOTE6)?;
    if header[0].to_ne_bytes()[0] >> 4 != 6 {
        return None;
    }
    p.src = Endpoint { addr: [header[2], header[3], header[4], header[5]], port: 0, _pad: [0; 2] };
    p.dst = Endpoint { addr: [header[6], header[7], header[8], header[9]], port: 0, _pad: [0; 2] };
    Some(header[1].to_ne_bytes()[2])
}
