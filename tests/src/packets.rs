//! Ethernet frames for the XDP fixtures, built and read back with
//! `etherparse`: a [`Segment`] says what a TCP or UDP packet carries, an
//! [`IcmpError`] what an ICMP error says and quotes; their `frame` builds
//! them with correct checksums, [`read_frame`] and [`read_icmp_error`]
//! parse a frame the program wrote and check every checksum it carries.

use std::net::{IpAddr, SocketAddr};

use etherparse::{NetSlice, PacketBuilder, SlicedPacket, TransportSlice, checksum::Sum16BitWords};

/// A MAC address.
pub type Mac = [u8; 6];

/// TCP flags of a [`Segment`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flags {
    pub syn: bool,
    pub ack: bool,
    pub rst: bool,
    pub fin: bool,
}

impl Flags {
    pub const SYN: Flags = Flags { syn: true, ack: false, rst: false, fin: false };
    pub const SYN_ACK: Flags = Flags { syn: true, ack: true, rst: false, fin: false };
    pub const ACK: Flags = Flags { syn: false, ack: true, rst: false, fin: false };
    pub const RST_ACK: Flags = Flags { syn: false, ack: true, rst: true, fin: false };
    pub const FIN_ACK: Flags = Flags { syn: false, ack: true, rst: false, fin: true };
}

/// What one packet carries, link layer to ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Destination MAC, then source MAC.
    pub macs: (Mac, Mac),
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// TTL or hop limit.
    pub ttl: u8,
    /// `None` for UDP.
    pub tcp: Option<Tcp>,
    pub payload: Vec<u8>,
}

/// The TCP part of a [`Segment`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tcp {
    pub flags: Flags,
    pub seq: u32,
    pub ack: u32,
}

impl Segment {
    /// A TCP segment from `src` to `dst` with TTL 64 and no payload.
    pub fn tcp(
        macs: (Mac, Mac),
        src: SocketAddr,
        dst: SocketAddr,
        flags: Flags,
        seq: u32,
        ack: u32,
    ) -> Self {
        Self { macs, src, dst, ttl: 64, tcp: Some(Tcp { flags, seq, ack }), payload: Vec::new() }
    }

    /// A UDP datagram from `src` to `dst` with TTL 64.
    pub fn udp(macs: (Mac, Mac), src: SocketAddr, dst: SocketAddr, payload: &[u8]) -> Self {
        Self { macs, src, dst, ttl: 64, tcp: None, payload: payload.to_vec() }
    }

    /// The same segment, sent to `dst`.
    pub fn to(mut self, dst: SocketAddr) -> Self {
        self.dst = dst;
        self
    }

    /// The Ethernet frame, with correct checksums. Panics if `src` and
    /// `dst` are of different families.
    pub fn frame(&self) -> Vec<u8> {
        let link = PacketBuilder::ethernet2(self.macs.1, self.macs.0);
        let ip = match (self.src.ip(), self.dst.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => link.ipv4(s.octets(), d.octets(), self.ttl),
            (IpAddr::V6(s), IpAddr::V6(d)) => link.ipv6(s.octets(), d.octets(), self.ttl),
            other => panic!("a segment between families: {other:?}"),
        };
        let mut out = Vec::new();
        match self.tcp {
            Some(tcp) => {
                let mut b = ip.tcp(self.src.port(), self.dst.port(), tcp.seq, 64_000);
                if tcp.flags.syn {
                    b = b.syn();
                }
                if tcp.flags.rst {
                    b = b.rst();
                }
                if tcp.flags.fin {
                    b = b.fin();
                }
                if tcp.flags.ack {
                    b = b.ack(tcp.ack);
                }
                b.write(&mut out, &self.payload).expect("building a TCP frame");
            }
            None => {
                ip.udp(self.src.port(), self.dst.port())
                    .write(&mut out, &self.payload)
                    .expect("building a UDP frame");
            }
        }
        out
    }
}

/// An ICMP error: ICMPv4 or ICMPv6, by the addresses' family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IcmpError {
    /// Destination MAC, then source MAC.
    pub macs: (Mac, Mac),
    pub src: IpAddr,
    pub dst: IpAddr,
    /// TTL or hop limit.
    pub ttl: u8,
    /// ICMP type and code.
    pub kind: u8,
    pub code: u8,
    /// The four bytes after the checksum (the MTU of "fragmentation
    /// needed" and "packet too big").
    pub rest: [u8; 4],
    /// The packet it quotes, from its IP header on.
    pub quote: Vec<u8>,
}

impl IcmpError {
    /// An error from `src` to `dst` quoting `quote` (a packet from its IP
    /// header on), with TTL 64.
    pub fn new(
        macs: (Mac, Mac),
        (src, dst): (IpAddr, IpAddr),
        (kind, code, rest): (u8, u8, [u8; 4]),
        quote: &[u8],
    ) -> Self {
        Self { macs, src, dst, ttl: 64, kind, code, rest, quote: quote.to_vec() }
    }

    /// The Ethernet frame, with correct checksums.
    pub fn frame(&self) -> Vec<u8> {
        let link = PacketBuilder::ethernet2(self.macs.1, self.macs.0);
        let mut out = Vec::new();
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => link
                .ipv4(s.octets(), d.octets(), self.ttl)
                .icmpv4_raw(self.kind, self.code, self.rest)
                .write(&mut out, &self.quote),
            (IpAddr::V6(s), IpAddr::V6(d)) => link
                .ipv6(s.octets(), d.octets(), self.ttl)
                .icmpv6_raw(self.kind, self.code, self.rest)
                .write(&mut out, &self.quote),
            other => panic!("an ICMP error between families: {other:?}"),
        }
        .expect("building an ICMP frame");
        out
    }

    /// The quoted packet, read as [`read_frame`] reads a frame (its
    /// checksums checked): a quote of a whole packet only.
    pub fn quoted(&self) -> Result<Segment, String> {
        let ethertype: [u8; 2] = if self.src.is_ipv4() { [0x08, 0x00] } else { [0x86, 0xdd] };
        let mut frame = vec![0u8; 12];
        frame.extend_from_slice(&ethertype);
        frame.extend_from_slice(&self.quote);
        read_frame(&frame).map_err(|e| format!("the quoted packet: {e}"))
    }
}

/// Parses `frame` as a TCP or UDP packet over IPv4 or IPv6, checking the
/// IPv4 header checksum and the TCP or UDP checksum; an error says what
/// is wrong.
pub fn read_frame(frame: &[u8]) -> Result<Segment, String> {
    let sliced =
        SlicedPacket::from_ethernet(frame).map_err(|e| format!("unparsable frame: {e}"))?;
    let (macs, src_ip, dst_ip, ttl) = link_and_ip(&sliced)?;
    let check_tcp = |tcp: &etherparse::TcpSlice<'_>| -> Result<u16, String> {
        match &sliced.net {
            Some(NetSlice::Ipv4(ip)) => {
                tcp.calc_checksum_ipv4(ip.header().source(), ip.header().destination())
            }
            Some(NetSlice::Ipv6(ip)) => {
                tcp.calc_checksum_ipv6(ip.header().source(), ip.header().destination())
            }
            _ => unreachable!(),
        }
        .map_err(|e| format!("computing the TCP checksum: {e}"))
    };
    let segment = match &sliced.transport {
        Some(TransportSlice::Tcp(tcp)) => {
            let expected = check_tcp(tcp)?;
            if tcp.checksum() != expected {
                return Err(format!(
                    "bad TCP checksum {:#06x}, expected {expected:#06x}",
                    tcp.checksum()
                ));
            }
            let flags = Flags { syn: tcp.syn(), ack: tcp.ack(), rst: tcp.rst(), fin: tcp.fin() };
            Segment {
                macs,
                src: SocketAddr::new(src_ip, tcp.source_port()),
                dst: SocketAddr::new(dst_ip, tcp.destination_port()),
                ttl,
                tcp: Some(Tcp {
                    flags,
                    seq: tcp.sequence_number(),
                    ack: tcp.acknowledgment_number(),
                }),
                payload: tcp.payload().to_vec(),
            }
        }
        Some(TransportSlice::Udp(udp)) => {
            let header = udp.to_header();
            let payload = udp.payload();
            let expected = match &sliced.net {
                Some(NetSlice::Ipv4(ip)) => {
                    header.calc_checksum_ipv4(&ip.header().to_header(), payload)
                }
                Some(NetSlice::Ipv6(ip)) => {
                    header.calc_checksum_ipv6(&ip.header().to_header(), payload)
                }
                _ => unreachable!(),
            }
            .map_err(|e| format!("computing the UDP checksum: {e}"))?;
            // IPv4 may send none (0).
            let none = header.checksum == 0 && src_ip.is_ipv4();
            if !none && header.checksum != expected {
                return Err(format!(
                    "bad UDP checksum {:#06x}, expected {expected:#06x}",
                    header.checksum
                ));
            }
            Segment {
                macs,
                src: SocketAddr::new(src_ip, header.source_port),
                dst: SocketAddr::new(dst_ip, header.destination_port),
                ttl,
                tcp: None,
                payload: payload.to_vec(),
            }
        }
        other => return Err(format!("neither TCP nor UDP: {other:?}")),
    };
    Ok(segment)
}

/// Parses `frame` as an ICMP error over IPv4 or IPv6, checking the IPv4
/// header checksum and the ICMP checksum (for ICMPv6 with its
/// pseudo-header); an error says what is wrong.
pub fn read_icmp_error(frame: &[u8]) -> Result<IcmpError, String> {
    let sliced =
        SlicedPacket::from_ethernet(frame).map_err(|e| format!("unparsable frame: {e}"))?;
    let (macs, src, dst, ttl) = link_and_ip(&sliced)?;
    let (bytes, quote) = match (&sliced.transport, src, dst) {
        (Some(TransportSlice::Icmpv4(icmp)), _, _) => {
            // No pseudo-header: the message sums to all ones.
            let sum = Sum16BitWords::new().add_slice(icmp.slice()).ones_complement();
            if sum != 0 {
                return Err(format!("bad ICMP checksum {:#06x}", icmp.checksum()));
            }
            (icmp.slice(), icmp.payload())
        }
        (Some(TransportSlice::Icmpv6(icmp)), IpAddr::V6(s), IpAddr::V6(d)) => {
            if !icmp.is_checksum_valid(s.octets(), d.octets()) {
                return Err(format!("bad ICMPv6 checksum {:#06x}", icmp.checksum()));
            }
            (icmp.slice(), icmp.payload())
        }
        other => return Err(format!("not an ICMP message: {:?}", other.0)),
    };
    Ok(IcmpError {
        macs,
        src,
        dst,
        ttl,
        kind: bytes[0],
        code: bytes[1],
        rest: [bytes[4], bytes[5], bytes[6], bytes[7]],
        quote: quote.to_vec(),
    })
}

/// The MACs, addresses and TTL of a sliced frame, with the IPv4 header
/// checksum checked.
#[allow(clippy::type_complexity, reason = "a private helper's tuple")]
fn link_and_ip(sliced: &SlicedPacket<'_>) -> Result<((Mac, Mac), IpAddr, IpAddr, u8), String> {
    let Some(etherparse::LinkSlice::Ethernet2(eth)) = &sliced.link else {
        return Err("no Ethernet header".into());
    };
    let macs = (eth.destination(), eth.source());
    let (src, dst, ttl) = match &sliced.net {
        Some(NetSlice::Ipv4(ip)) => {
            let header = ip.header().to_header();
            if header.header_checksum != header.calc_header_checksum() {
                return Err(format!(
                    "bad IPv4 header checksum {:#06x}, expected {:#06x}",
                    header.header_checksum,
                    header.calc_header_checksum()
                ));
            }
            (header.source.into(), header.destination.into(), header.time_to_live)
        }
        Some(NetSlice::Ipv6(ip)) => {
            let h = ip.header();
            (h.source_addr().into(), h.destination_addr().into(), h.hop_limit())
        }
        other => return Err(format!("not IP: {other:?}")),
    };
    Ok((macs, src, dst, ttl))
}
