//! Userspace-only impls: `aya::Pod` for the map types and conversions
//! between [`Endpoint`] and `std::net::SocketAddr`.
extern crate std;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::{ConnKey, Endpoint, Event, Service, SockEntry};

// SAFETY: all of these are `#[repr(C)]`, made only of integers and arrays of
// integers, with every padding byte spelled out as a field.
unsafe impl aya::Pod for Endpoint {}
unsafe impl aya::Pod for Service {}
unsafe impl aya::Pod for SockEntry {}
unsafe impl aya::Pod for ConnKey {}
unsafe impl aya::Pod for Event {}

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
    fn v6_round_trips() {
        let addr: SocketAddr = "[fd00:1b::100]:8080".parse().unwrap();
        let ep = Endpoint::from(addr);
        assert!(!ep.is_v4());
        assert_eq!(SocketAddr::from(ep), addr);
    }
}
