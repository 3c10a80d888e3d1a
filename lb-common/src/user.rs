//! Userspace-only impls: `aya::Pod` for the map types, conversions
//! between [`Endpoint`] and `std::net::SocketAddr`, and the decoding of a
//! ring-buffer record ([`Event::from_bytes`]).
extern crate std;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::{
    AnnounceKey, AnnounceValue, ConnKey, Endpoint, Event, Flow, FlowKey, NatKey, NatReply, Service,
    SockEntry, Traffic, TrafficSlot, UdpPeers,
};

// SAFETY: all of these are `#[repr(C)]`, made only of integers and arrays of
// integers, with every padding byte spelled out as a field.
unsafe impl aya::Pod for Endpoint {}
// SAFETY: as above.
unsafe impl aya::Pod for Service {}
// SAFETY: as above.
unsafe impl aya::Pod for SockEntry {}
// SAFETY: as above.
unsafe impl aya::Pod for ConnKey {}
// SAFETY: as above.
unsafe impl aya::Pod for Event {}
// SAFETY: as above.
unsafe impl aya::Pod for UdpPeers {}
// SAFETY: as above.
unsafe impl aya::Pod for FlowKey {}
// SAFETY: as above.
unsafe impl aya::Pod for Flow {}
// SAFETY: as above.
unsafe impl aya::Pod for NatKey {}
// SAFETY: as above.
unsafe impl aya::Pod for NatReply {}
// SAFETY: as above.
unsafe impl aya::Pod for crate::reference::ReferenceRewrite {}
// SAFETY: as above.
unsafe impl aya::Pod for Traffic {}
// SAFETY: as above.
unsafe impl aya::Pod for TrafficSlot {}
// SAFETY: as above.
unsafe impl aya::Pod for AnnounceKey {}
// SAFETY: as above.
unsafe impl aya::Pod for AnnounceValue {}
// SAFETY: as above.
unsafe impl aya::Pod for crate::maglev::Maglev {}

impl Event {
    /// The record at the start of `bytes`, as `sock_ops` wrote it to the
    /// `EVENTS` ring buffer; `None` when `bytes` is shorter than an
    /// `Event`. Bytes after the record are ignored, and `bytes` need not be
    /// aligned. Every bit pattern is an `Event`, so nothing else is
    /// checked: its `kind` may name no [`EventKind`](crate::EventKind)
    /// (see [`Event::kind`]).
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let record = bytes.get(..size_of::<Self>())?;
        // SAFETY: `record` is `size_of::<Event>()` readable bytes, read
        // unaligned; `Event` is `#[repr(C)]`, made only of integers and
        // arrays of integers with its padding spelled out as fields, so any
        // bytes are a valid `Event`.
        Some(unsafe { core::ptr::read_unaligned(record.as_ptr().cast::<Self>()) })
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(addr: SocketAddr) -> Self {
        let v6 = match addr.ip() {
            IpAddr::V4(ip) => ip.to_ipv6_mapped(),
            IpAddr::V6(ip) => ip,
        };
        let o = v6.octets();
        let word = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
        Self {
            addr: [word(0), word(4), word(8), word(12)],
            port: addr.port().to_be(),
            _pad: [0; 2],
        }
    }
}

impl From<Endpoint> for SocketAddr {
    fn from(ep: Endpoint) -> Self {
        let mut octets = [0u8; 16];
        for (chunk, word) in octets.chunks_exact_mut(4).zip(ep.addr) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        let v6 = Ipv6Addr::from(octets);
        let port = u16::from_be(ep.port);
        match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), port),
            None => SocketAddr::new(IpAddr::V6(v6), port),
        }
    }
}

impl Endpoint {
    /// The IPv4 address, if this endpoint is IPv4.
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        match SocketAddr::from(*self) {
            SocketAddr::V4(a) => Some(*a.ip()),
            SocketAddr::V6(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v4_round_trips_through_mapped_form() {
        let addr: SocketAddr = "127.0.0.1:6444".parse().unwrap();
        let ep = Endpoint::from(addr);
        assert!(ep.is_v4());
        // What the kernel reads from user_ip4 for 127.0.0.1 on this host.
        assert_eq!(ep.addr[3], u32::from_ne_bytes([127, 0, 0, 1]));
        assert_eq!(ep, Endpoint::from_v4_raw(u32::from_ne_bytes([127, 0, 0, 1]), 6444u16.to_be()));
        assert_eq!(SocketAddr::from(ep), addr);
    }

    #[test]
    fn v4_mapped_v6_is_the_same_key_as_v4() {
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:80".parse().unwrap();
        let v4: SocketAddr = "127.0.0.1:80".parse().unwrap();
        assert_eq!(Endpoint::from(mapped), Endpoint::from(v4));
    }

    #[test]
    fn an_event_is_read_from_its_bytes_as_the_kernel_lays_them_out() {
        let vip = Endpoint::from("127.0.0.1:6444".parse::<SocketAddr>().unwrap());
        let server = Endpoint::from("[fd00:1b::100]:8080".parse::<SocketAddr>().unwrap());
        let endpoint_bytes = |ep: Endpoint| {
            let words = ep.addr.iter().flat_map(|w| w.to_ne_bytes());
            words.chain(ep.port.to_ne_bytes()).chain(ep._pad).collect::<std::vec::Vec<u8>>()
        };
        // One byte first, so that the record is not aligned; two after it.
        let mut bytes = std::vec![0xee];
        bytes.extend(0x0102_0304_0506_0708u64.to_ne_bytes());
        bytes.extend(42u64.to_ne_bytes());
        bytes.extend(endpoint_bytes(vip));
        bytes.extend(endpoint_bytes(server));
        bytes.extend(2u32.to_ne_bytes());
        bytes.extend(0u32.to_ne_bytes());
        bytes.extend([0xaa, 0xbb]);
        let expected =
            Event { cookie: 0x0102_0304_0506_0708, time_ns: 42, vip, server, kind: 2, _pad: 0 };
        assert_eq!(Event::from_bytes(&bytes[1..]), Some(expected));
        assert_eq!(Event::from_bytes(&bytes[1..65]), Some(expected), "exactly one record");
        assert_eq!(Event::from_bytes(&bytes[1..64]), None, "one byte short");
        assert_eq!(Event::from_bytes(&[]), None);
        assert_eq!(expected.kind(), Ok(crate::EventKind::ConnectFailed));
        // A kind no EventKind names still decodes; `kind()` says so.
        let unknown = Event::from_bytes(&[0xff; 64]).unwrap();
        assert_eq!(unknown.kind, u32::MAX);
        assert_eq!(unknown.kind(), Err(crate::UnknownEventKind(u32::MAX)));
    }

    #[test]
    fn v6_round_trips() {
        let addr: SocketAddr = "[fd00:1b::100]:8080".parse().unwrap();
        let ep = Endpoint::from(addr);
        assert!(!ep.is_v4());
        assert_eq!(SocketAddr::from(ep), addr);
    }
}
