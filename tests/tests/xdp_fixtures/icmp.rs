//! ICMP errors about external flows: translated both ways, checksums and
//! all; forged or stray ones passed untouched.

use std::net::{IpAddr, SocketAddr};

use lb_common::Reason;
use lb_tests::packets::{Flags, IcmpError, Segment, read_frame, read_icmp_error};
use lb_tests::privileged_test;

use lb_tests::xdp_node::*;

/// ICMP type, code and the four bytes after the checksum: "fragmentation
/// needed" (IPv4) or "packet too big" (IPv6), with an MTU of 1280.
fn too_big(f: &Family) -> (u8, u8, [u8; 4]) {
    if f.vip.is_ipv4() { (3, 4, [0, 0, 5, 0]) } else { (2, 0, [0, 0, 5, 0]) }
}

/// As [`too_big`]: "port unreachable".
fn port_unreachable(f: &Family) -> (u8, u8, [u8; 4]) {
    if f.vip.is_ipv4() { (3, 3, [0; 4]) } else { (1, 4, [0; 4]) }
}

/// A router's address on one side of the node: `last` in the servers'
/// subnet (`toward_servers`) or in the clients'.
fn router(f: &Family, toward_servers: bool, last: u8) -> IpAddr {
    let subnet = match (f.vip.is_ipv4(), toward_servers) {
        (true, true) => "198.18.2.",
        (true, false) => "198.18.0.",
        (false, true) => "2001:2:0:2::",
        (false, false) => "2001:2::",
    };
    format!("{subnet}{last}").parse().unwrap()
}

/// The addresses and ports of a quote that may end right after the ports,
/// its IPv4 header checksum checked.
fn quoted_endpoints(quote: &[u8]) -> (SocketAddr, SocketAddr) {
    let (ip, rest, _) = etherparse::IpHeaders::from_slice_lax(quote).expect("a quoted IP header");
    let ports = |at: usize| u16::from_be_bytes([rest.payload[at], rest.payload[at + 1]]);
    let (src, dst): (IpAddr, IpAddr) = match ip {
        etherparse::IpHeaders::Ipv4(h, _) => {
            assert_eq!(h.header_checksum, h.calc_header_checksum(), "the quote's IPv4 checksum");
            (h.source.into(), h.destination.into())
        }
        etherparse::IpHeaders::Ipv6(h, _) => (h.source_addr().into(), h.destination_addr().into()),
    };
    (SocketAddr::new(src, ports(0)), SocketAddr::new(dst, ports(2)))
}

/// An ICMP error from the servers' side about a forwarded packet (a
/// router's "too big", the server's "port unreachable") reaches the flow's
/// client, quoting the packet as the client sent it; the server's own
/// address is shown as the VIP, a router keeps its own. One forged on the
/// clients' side is passed untouched.
#[privileged_test]
fn icmp_errors_about_a_flow_reach_its_client() {
    both_families(|node, f| {
        let out = forwarded(node, f, f.client, 1_000);
        let quote = out.frame()[14..].to_vec();
        let from_servers_side = (SRV_MAC, server_mac(out.dst));
        let hop = router(f, true, 9);
        let error = IcmpError::new(from_servers_side, (hop, f.node), too_big(f), &quote);
        let frame = error.frame();
        assert_eq!(node.run(&frame, None), (XDP_PASS, frame.clone()), "a forged error was sent on");
        let (verdict, back) = node.run(&frame, Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT, "the error was not sent on");
        let back = read_icmp_error(&back).expect("the translated error");
        assert_eq!((back.src, back.dst), (hop, f.client.ip()), "addresses of the translated error");
        assert_eq!(back.macs, (CLIENT_MAC, EXT_MAC), "not back the way the flow came");
        assert_eq!(back.ttl, 63);
        assert_eq!((back.kind, back.code, back.rest), (error.kind, error.code, error.rest));
        let quoted = back.quoted().expect("the quote, checksums and all");
        assert_eq!((quoted.src, quoted.dst), (f.client, f.vip), "the quote is not the client's");
        assert_eq!(quoted.tcp.unwrap().seq, 1_000);

        // The server's own error, quoting the least a router may: up to
        // the ports (the TCP checksum is not in it).
        let ip_header = if f.vip.is_ipv4() { 20 } else { 40 };
        let short = &quote[..ip_header + 8];
        let error =
            IcmpError::new(from_servers_side, (out.dst.ip(), f.node), port_unreachable(f), short);
        let (verdict, back) = node.run(&error.frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT);
        let back = read_icmp_error(&back).expect("the translated error");
        assert_eq!((back.src, back.dst), (f.vip.ip(), f.client.ip()), "the server was not hidden");
        assert_eq!(back.quote.len(), short.len());
        assert_eq!(quoted_endpoints(&back.quote), (f.client, f.vip));
        assert_eq!(node.counter(Reason::XdpIcmpToClient), 2);
    });
}

/// An ICMP error from the clients' side about a reply (a router's "too big"
/// on the way to the client) reaches the flow's server from the node's
/// address, quoting the reply as the server sent it.
#[privileged_test]
fn icmp_errors_about_a_reply_reach_the_server() {
    both_families(|node, f| {
        let out = forwarded(node, f, f.client, 1_000);
        let (verdict, reply) =
            node.run(&from_server(&out, Flags::SYN_ACK).frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT);
        let reply = read_frame(&reply).expect("the translated reply");
        let hop = router(f, false, 254);
        let error = IcmpError::new(
            (EXT_MAC, CLIENT_MAC),
            (hop, f.vip.ip()),
            too_big(f),
            &reply.frame()[14..],
        );
        let (verdict, to) = node.run(&error.frame(), None);
        assert_eq!(verdict, XDP_REDIRECT, "the error was not sent on");
        let to = read_icmp_error(&to).expect("the translated error");
        assert_eq!((to.src, to.dst), (f.node, out.dst.ip()), "addresses of the translated error");
        assert_eq!(to.macs, (server_mac(out.dst), SRV_MAC), "not routed to the server");
        assert_eq!(to.ttl, 63);
        assert_eq!((to.kind, to.code, to.rest), (error.kind, error.code, error.rest));
        let quoted = to.quoted().expect("the quote, checksums and all");
        assert_eq!((quoted.src, quoted.dst), (out.dst, out.src), "the quote is not the server's");
        assert_eq!(quoted.tcp.unwrap().ack, 1_001);
        assert_eq!(node.counter(Reason::XdpIcmpToServer), 1);
    });
}

/// An error about a reply counts only from the clients' side, and a "too
/// big" only at the least MTU a path may have or above: the same error
/// arriving on the servers' side, and a "too big" of one byte below the
/// floor (IPv4 552, IPv6 1280) from the clients', are dropped and
/// counted; one of the floor itself reaches the server.
#[privileged_test]
fn icmp_errors_about_a_reply_count_only_from_the_clients_side_above_a_floor() {
    both_families(|node, f| {
        let out = forwarded(node, f, f.client, 1_000);
        let (verdict, reply) =
            node.run(&from_server(&out, Flags::SYN_ACK).frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT);
        let quote = read_frame(&reply).expect("the translated reply").frame()[14..].to_vec();
        let hop = router(f, false, 254);
        let too_big_of = |mtu: u16| {
            let ((kind, code, _), mtu) = (too_big(f), mtu.to_be_bytes());
            (kind, code, [0, 0, mtu[0], mtu[1]])
        };
        let error =
            |macs, mtu| IcmpError::new(macs, (hop, f.vip.ip()), too_big_of(mtu), &quote).frame();
        let (from_clients, from_servers) = ((EXT_MAC, CLIENT_MAC), (SRV_MAC, server_mac(out.dst)));
        let floor: u16 = if f.vip.is_ipv4() { 552 } else { 1280 };

        let (verdict, _) = node.run(&error(from_servers, 1280), Some(node.srv0));
        assert_eq!(verdict, XDP_DROP, "an error from the servers' side was sent on");
        assert_eq!(node.counter(Reason::XdpIcmpElsewhere), 1);
        let (verdict, _) = node.run(&error(from_clients, floor - 1), None);
        assert_eq!(verdict, XDP_DROP, "a \"too big\" below the floor was sent on");
        assert_eq!(node.counter(Reason::XdpTooBigBelowFloor), 1);
        let (verdict, to) = node.run(&error(from_clients, floor), None);
        assert_eq!(verdict, XDP_REDIRECT, "a \"too big\" at the floor was not sent on");
        assert_eq!(read_icmp_error(&to).expect("the translated error").rest, too_big_of(floor).2);
        assert_eq!(node.counter(Reason::XdpIcmpToServer), 1);
    });
}

/// ICMP that is about no flow passes untouched: an error quoting a packet
/// the node never forwarded, and an echo request to the VIP.
#[privileged_test]
fn icmp_about_no_flow_passes_untouched() {
    both_families(|node, f| {
        let server_side = (SRV_MAC, server_mac(f.servers[0]));
        let never_sent = Segment::tcp(
            server_side,
            SocketAddr::new(f.node, 61_001),
            f.servers[0],
            Flags::SYN,
            1,
            0,
        );
        let stray = IcmpError::new(
            server_side,
            (f.servers[0].ip(), f.node),
            port_unreachable(f),
            &never_sent.frame()[14..],
        );
        let echo_request = if f.vip.is_ipv4() { 8 } else { 128 };
        // A ping to an address that is not a VIP's (one to a VIP's is
        // dropped: `hostile::a_vips_address_is_never_handed_to_the_kernel`).
        let ping = IcmpError::new(
            (EXT_MAC, CLIENT_MAC),
            (f.client.ip(), f.servers[0].ip()),
            (echo_request, 0, [0, 1, 0, 1]),
            b"ping",
        );
        // Its probe (a packet that is not ours) counted before the cases.
        node.knows_ingress();
        let not_ours = node.counter(Reason::XdpNotOurs);
        for frame in [stray.frame(), ping.frame()] {
            assert_eq!(node.run(&frame, Some(node.srv0)), (XDP_PASS, frame), "ICMP was touched");
        }
        assert_eq!(node.counter(Reason::XdpNotOurs) - not_ours, 1);
        assert_eq!(node.counter(Reason::XdpOtherProtocol), 1);
    });
}
