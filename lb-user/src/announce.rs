//! Telling the link that a VIP is here: a gratuitous ARP (IPv4) or an
//! unsolicited neighbour advertisement (IPv6) sent when the node starts
//! announcing it, so that neighbours that cached another node's MAC move
//! at once. (The answers to requests come from the XDP program, which
//! `ANNOUNCE` tells what to answer.) Frames are built with `etherparse`
//! and sent on an `AF_PACKET` socket in the daemon's network namespace.

use std::{
    io,
    mem::size_of,
    net::IpAddr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::Mutex,
};

use etherparse::{
    ArpHardwareId, ArpOperation, ArpPacket, EtherType, Icmpv6Type, PacketBuilder,
    icmpv6::NeighborAdvertisementHeader,
};

/// A MAC address.
pub type Mac = [u8; 6];

const BROADCAST: Mac = [0xff; 6];
/// `ff02::1` (all nodes) at the link layer.
const ALL_NODES_MAC: Mac = [0x33, 0x33, 0, 0, 0, 1];
const ALL_NODES: [u8; 16] = [0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];

/// The MAC address of the interface `name` in this network namespace.
pub fn interface_mac(name: &str) -> io::Result<Mac> {
    let socket = socket(libc::AF_INET, libc::SOCK_DGRAM, 0)?;
    // SAFETY: a zeroed ifreq is valid; the name fits (checked below), and
    // SIOCGIFHWADDR writes the address into the ifreq it is given.
    unsafe {
        let mut ifr: libc::ifreq = std::mem::zeroed();
        if name.len() >= ifr.ifr_name.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is too long"),
            ));
        }
        for (dst, src) in ifr.ifr_name.iter_mut().zip(name.as_bytes()) {
            *dst = *src as libc::c_char;
        }
        if libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFHWADDR, &mut ifr) != 0 {
            return Err(io::Error::last_os_error());
        }
        let data = ifr.ifr_ifru.ifru_hwaddr.sa_data;
        Ok([data[0], data[1], data[2], data[3], data[4], data[5]].map(|b| b as u8))
    }
}

/// The frame that tells the link `ip` is at `mac`: a gratuitous ARP
/// request (sender and target both `ip`, broadcast) or an unsolicited
/// neighbour advertisement to all nodes (override set, with the target's
/// link-layer address).
pub fn unsolicited(ip: IpAddr, mac: Mac) -> Vec<u8> {
    match ip {
        IpAddr::V4(ip) => {
            let arp = ArpPacket::new(
                ArpHardwareId::ETHERNET,
                EtherType::IPV4,
                ArpOperation::REQUEST,
                &mac,
                &ip.octets(),
                &[0; 6],
                &ip.octets(),
            )
            .expect("Ethernet and IPv4 address lengths fit ARP");
            let builder = PacketBuilder::ethernet2(mac, BROADCAST).arp(arp);
            let mut frame = Vec::with_capacity(builder.size());
            builder.write(&mut frame).expect("writing to a Vec");
            frame
        }
        IpAddr::V6(ip) => {
            let header =
                NeighborAdvertisementHeader { router: false, solicited: false, r#override: true };
            let builder = PacketBuilder::ethernet2(mac, ALL_NODES_MAC)
                .ipv6(ip.octets(), ALL_NODES, 255)
                .icmpv6(Icmpv6Type::NeighborAdvertisement(header));
            // The target address, then the target link-layer address option.
            let mut payload = ip.octets().to_vec();
            payload.extend([2, 1]);
            payload.extend(mac);
            let mut frame = Vec::with_capacity(builder.size(payload.len()));
            builder.write(&mut frame, &payload).expect("writing to a Vec");
            frame
        }
    }
}

/// Sends `frame` out of interface `ifindex` as it is.
pub fn send(ifindex: u32, frame: &[u8]) -> io::Result<()> {
    // One socket for every frame: closing an `AF_PACKET` socket waits for
    // an RCU grace period (`packet_release`: `synchronize_net`, 12 ms
    // measured here), and a daemon that starts announcing 200 VIPs at once
    // spent seconds in it, its other work (renewing its membership)
    // starved meanwhile. It sends only (protocol 0: it receives nothing).
    static SOCKET: Mutex<Option<OwnedFd>> = Mutex::new(None);
    let mut cached = SOCKET.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if cached.is_none() {
        *cached = Some(socket(libc::AF_PACKET, libc::SOCK_RAW, 0)?);
    }
    let socket = cached.as_ref().expect("set just above");
    // SAFETY: a zeroed sockaddr_ll is valid.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = libc::AF_PACKET as u16;
    to.sll_ifindex =
        i32::try_from(ifindex).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    to.sll_halen = 6;
    to.sll_addr[..6].copy_from_slice(&frame[..6]);
    // SAFETY: `frame` and `to` are valid for the lengths given.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&raw const to).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn socket(domain: i32, kind: i32, protocol: i32) -> io::Result<OwnedFd> {
    // SAFETY: a plain socket(2) call; the descriptor is owned at once.
    let fd = unsafe { libc::socket(domain, kind | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use etherparse::{NetSlice, SlicedPacket, TransportSlice};

    use super::*;

    const MAC: Mac = [2, 0, 0, 0, 0, 2];

    #[test]
    fn a_gratuitous_arp_names_the_vip_twice_from_the_interfaces_mac() {
        let frame = unsolicited("198.18.1.100".parse().unwrap(), MAC);
        let packet = SlicedPacket::from_ethernet(&frame).unwrap();
        let link = packet.link.unwrap().to_header().unwrap();
        let etherparse::LinkHeader::Ethernet2(eth) = link else { panic!("not Ethernet") };
        assert_eq!((eth.source, eth.destination), (MAC, BROADCAST));
        let Some(NetSlice::Arp(arp)) = packet.net else { panic!("not ARP") };
        assert_eq!(arp.operation(), ArpOperation::REQUEST);
        assert_eq!(arp.sender_hw_addr(), MAC);
        assert_eq!(arp.sender_protocol_addr(), [198, 18, 1, 100]);
        assert_eq!(arp.target_protocol_addr(), [198, 18, 1, 100]);
    }

    #[test]
    fn an_unsolicited_advertisement_overrides_with_a_valid_checksum() {
        let vip: std::net::Ipv6Addr = "2001:2:0:1::100".parse().unwrap();
        let frame = unsolicited(IpAddr::V6(vip), MAC);
        let packet = SlicedPacket::from_ethernet(&frame).unwrap();
        let Some(NetSlice::Ipv6(ip)) = &packet.net else { panic!("not IPv6") };
        assert_eq!(ip.header().source(), vip.octets());
        assert_eq!(ip.header().hop_limit(), 255);
        let Some(TransportSlice::Icmpv6(icmp)) = &packet.transport else { panic!("not ICMPv6") };
        let Icmpv6Type::NeighborAdvertisement(header) = icmp.icmp_type() else {
            panic!("not an NA")
        };
        assert!(header.r#override && !header.solicited);
        assert_eq!(&icmp.payload()[..16], &vip.octets());
        assert_eq!(&icmp.payload()[16..], &[2, 1, 2, 0, 0, 0, 0, 2]);
        let expected = icmp
            .icmp_type()
            .calc_checksum(ip.header().source(), ip.header().destination(), icmp.payload())
            .unwrap();
        assert_eq!(icmp.checksum(), expected);
    }
}
