//! The frames the fixtures send the node, and the checks of what it sent
//! back: a client's segment to the VIP, its SYN forwarded to a server, a
//! server's answer, the node's own reset.

use std::net::{IpAddr, SocketAddr};

use super::{CLIENT_MAC, EXT_MAC, Family, Node, SERVER_MACS, SRV_MAC, XDP_REDIRECT, XDP_TX};
use crate::packets::{Flags, Mac, Segment, read_frame};
use lb_common::{NAT_PORT_COUNT, NAT_PORT_FIRST};

/// The MAC address of `server`, one of the fixtures' two.
pub fn server_mac(server: SocketAddr) -> Mac {
    let last = match server.ip() {
        IpAddr::V4(ip) => ip.octets()[3],
        IpAddr::V6(ip) => ip.octets()[15],
    };
    SERVER_MACS.iter().find(|(l, _)| *l == last).expect("a server's MAC").1
}

/// A client's segment to the VIP, as it arrives from its router.
pub fn from_client(f: &Family, client: SocketAddr, flags: Flags, seq: u32) -> Segment {
    Segment::tcp((EXT_MAC, CLIENT_MAC), client, f.vip, flags, seq, 0)
}

/// Sends the client's SYN and checks what the program made of it: a
/// redirect out of `srv0` to a server, with the node's address and a NAT
/// port as source. Returns the frame as it left.
pub fn forwarded(node: &Node, f: &Family, client: SocketAddr, seq: u32) -> Segment {
    let (verdict, out) = node.run(&from_client(f, client, Flags::SYN, seq).frame(), None);
    assert_eq!(verdict, XDP_REDIRECT, "the SYN was not redirected");
    let out = read_frame(&out).expect("the forwarded frame");
    assert!(f.servers.contains(&out.dst), "forwarded to {}, not a server", out.dst);
    assert_eq!(out.src.ip(), f.node, "the source is not the node's address toward the server");
    let nat = out.src.port();
    assert!(
        (NAT_PORT_FIRST..=NAT_PORT_FIRST.saturating_add(NAT_PORT_COUNT - 1)).contains(&nat),
        "NAT port {nat}"
    );
    assert_eq!(out.macs, (server_mac(out.dst), SRV_MAC), "link layer of the forwarded frame");
    assert_eq!(out.ttl, 63, "a router takes one off the TTL");
    assert_eq!(out.tcp.unwrap().seq, seq);
    out
}

/// The server's answer to the forwarded `to`, as it arrives on `srv0`.
pub fn from_server(to: &Segment, flags: Flags) -> Segment {
    let ack = to.tcp.unwrap().seq.wrapping_add(1);
    Segment::tcp((SRV_MAC, server_mac(to.dst)), to.dst, to.src, flags, 7_000, ack)
}

/// Checks that the node answers `packet`, a client's TCP packet other
/// than a SYN of no flow (or of one whose server left), with its own
/// reset from the VIP, back the way the packet came.
pub fn assert_reset(node: &Node, f: &Family, packet: &Segment) {
    assert_eq!(packet.dst.ip(), f.vip.ip(), "not a packet to the VIP");
    let (verdict, out) = node.run(&packet.frame(), None);
    assert_eq!(verdict, XDP_TX, "a packet of no flow was not answered with a reset");
    let reset = read_frame(&out).expect("the reset");
    assert_eq!((reset.src, reset.dst), (packet.dst, packet.src), "the reset's addresses");
    assert_eq!(reset.macs, (packet.macs.1, packet.macs.0), "the reset's link layer");
    let (sent, tcp) = (packet.tcp.unwrap(), reset.tcp.unwrap());
    assert!(tcp.flags.rst && !tcp.flags.syn && !tcp.flags.fin, "not a reset: {:?}", tcp.flags);
    if sent.flags.ack {
        assert_eq!((tcp.seq, tcp.flags.ack), (sent.ack, false), "the reset's sequence");
    } else {
        let controls = u32::from(sent.flags.syn) + u32::from(sent.flags.fin);
        let length = packet.payload.len() as u32 + controls;
        assert_eq!((tcp.ack, tcp.flags.ack), (sent.seq + length, true), "what the reset acks");
    }
    assert!(reset.payload.is_empty(), "the reset carries data");
}
