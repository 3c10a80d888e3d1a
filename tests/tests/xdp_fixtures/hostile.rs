//! What a client's packets cannot do to other clients: fail a server with
//! SYNs a server never answers (SYN|FIN, a bad checksum, a header length
//! that does not fit), or move an established flow with a failure mark
//! of the kernel's own. Only the daemon's confirmed failure, or the
//! server leaving the selection, moves an established flow.

use std::{net::SocketAddr, time::Duration};

use aya::maps::HashMap;
use lb_common::{DAEMON_STATE_FAILED, Endpoint, Reason, Service, maps};
use lb_tests::{
    packets::{Flags, IcmpError, Segment, read_frame},
    privileged_test,
    xdp_node::*,
};

/// Offsets in a frame of the TCP header's data offset and checksum.
fn tcp_at(f: &Family) -> usize {
    14 + if f.vip.is_ipv4() { 20 } else { 40 }
}

/// The client's SYNs a server drops without a word, each as sent again
/// by a client whose first SYN (well formed) went unanswered.
fn unanswerable(f: &Family, client: SocketAddr, seq: u32) -> Vec<(&'static str, Vec<u8>)> {
    let syn = || from_client(f, client, Flags::SYN, seq).frame();
    let mut syn_fin = from_client(f, client, Flags::SYN, seq);
    syn_fin.tcp.as_mut().unwrap().flags.fin = true;
    let mut bad_checksum = syn();
    bad_checksum[tcp_at(f) + 16] ^= 0x5a;
    let mut short_header = syn();
    short_header[tcp_at(f) + 12] = 4 << 4;
    let mut long_header = syn();
    long_header[tcp_at(f) + 12] = 15 << 4;
    let mut with_data = from_client(f, client, Flags::SYN, seq);
    with_data.payload = b"GET / HTTP/1.1\r\n".to_vec();
    vec![
        ("SYN|FIN", syn_fin.frame()),
        ("a bad checksum", bad_checksum),
        ("a header shorter than 20 bytes", short_header),
        ("a header longer than the segment", long_header),
        ("data", with_data.frame()),
    ]
}

#[privileged_test]
fn a_syn_a_server_never_answers_sent_again_fails_no_server() {
    both_families(|node, f| {
        for n in 0..5 {
            let client = SocketAddr::new(f.client.ip(), 41_000 + n as u16);
            let (what, frame) = unanswerable(f, client, 5_000).swap_remove(n);
            let first = forwarded(node, f, client, 5_000);
            assert_eq!(first.dst, f.servers[0]);
            node.age_syns(Duration::from_secs(1));
            let (verdict, out) = node.run(&frame, None);
            assert_eq!(verdict, XDP_REDIRECT, "{what}: not forwarded along its flow");
            assert_eq!(read_frame_unchecked(&out), f.servers[0], "{what}: the flow moved");
            assert!(!node.failed(f.servers[0]), "{what}: the server was failed");
        }
        assert_eq!(node.counter(Reason::XdpSynMalformed), 5);
        assert_eq!(node.counter(Reason::XdpSynRetransmitted), 0);
        // The same client's well-formed SYN, sent again: that one counts.
        let client = SocketAddr::new(f.client.ip(), 41_000);
        node.age_syns(Duration::from_secs(1));
        assert_eq!(forwarded(node, f, client, 5_000).dst, f.servers[1]);
        assert!(node.failed(f.servers[0]), "a well-formed SYN sent again failed nothing");
        assert_eq!(node.counter(Reason::XdpSynRetransmitted), 1);
    });
}

#[privileged_test]
fn a_kernel_mark_moves_half_open_flows_but_keeps_established_ones() {
    both_families(|node, f| {
        let [a, b] = f.servers;
        let established = SocketAddr::new(f.client.ip(), 42_001);
        let half_open = SocketAddr::new(f.client.ip(), 42_002);
        let out = forwarded(node, f, established, 1_000);
        assert_eq!(out.dst, a);
        let (verdict, _) = node.run(&from_server(&out, Flags::SYN_ACK).frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT);
        assert_eq!(forwarded(node, f, half_open, 2_000).dst, a);
        fail_by_a_silent_syn(node, f);

        let ack = from_client(f, established, Flags::ACK, 1_001).frame();
        assert_eq!(to(node, &ack), a, "an established flow moved on a kernel mark");
        assert_eq!(node.counter(Reason::XdpKeptEstablished), 1);
        // The half-open one leaves the marked server: the node resets its
        // next packet, and its SYN sent again goes to the next server.
        assert_reset(node, f, &from_client(f, half_open, Flags::ACK, 2_001));
        assert_eq!(node.counter(Reason::XdpFlowMoved), 1);
        assert_eq!(forwarded(node, f, half_open, 2_000).dst, b);
    });
}

#[privileged_test]
fn the_daemons_confirmed_failure_moves_established_flows() {
    both_families(|node, f| {
        let [a, b] = f.servers;
        let out = forwarded(node, f, f.client, 1_000);
        let (verdict, _) = node.run(&from_server(&out, Flags::SYN_ACK).frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT);
        let ack = from_client(f, f.client, Flags::ACK, 1_001).frame();
        assert_eq!(to(node, &ack), a);
        // The daemon confirms a's failure: a stays in the selection, last.
        let mut services: HashMap<_, Endpoint, Service> =
            HashMap::try_from(node.ebpf.map_mut(maps::SERVICES).unwrap()).unwrap();
        let vip = Endpoint::from(f.vip);
        let mut service = services.get(&vip, 0).unwrap();
        service.servers[..2].copy_from_slice(&[Endpoint::from(b), Endpoint::from(a)]);
        service.daemon_states[1] = DAEMON_STATE_FAILED;
        services.insert(vip, service, 0).unwrap();
        node.new_epoch();
        assert_reset(node, f, &from_client(f, f.client, Flags::ACK, 1_001));
        assert_eq!(node.counter(Reason::XdpFlowMoved), 1, "a confirmed failure kept the flow");
        assert_eq!(forwarded(node, f, f.client, 5_000).dst, b);
        assert_eq!(node.counter(Reason::XdpKeptEstablished), 0);
    });
}

/// A server that refuses a burst of flows (or a flood of forged flows it
/// resets) is reported to the daemon once, not once a flow: the ring
/// buffer the socket path reports through cannot be crowded from the
/// network.
#[privileged_test]
fn a_burst_of_refused_flows_is_one_report() {
    both_families(|node, f| {
        drain_events(node);
        let opened: Vec<_> = (0..20)
            .map(|n| forwarded(node, f, SocketAddr::new(f.client.ip(), 43_000 + n), 1))
            .collect();
        for out in &opened {
            assert_eq!(out.dst, f.servers[0]);
            let rst = from_server(out, Flags::RST_ACK).frame();
            assert_eq!(node.run(&rst, Some(node.srv0)).0, XDP_REDIRECT);
        }
        assert_eq!(node.counter(Reason::XdpServerReset), 20, "every refusal was seen");
        assert!(node.failed(f.servers[0]));
        assert_eq!(drain_events(node), 1, "a burst of refusals was reported more than once");
    });
}

/// Only a SYN opens a TCP flow: any other packet of no flow (a forged
/// ACK, FIN, data, a SYN|ACK) takes no NAT port and reaches no server; it
/// is answered with the node's reset, as a host answers it. A reset of no
/// flow is dropped unanswered.
#[privileged_test]
fn only_a_syn_opens_a_flow() {
    both_families(|node, f| {
        let mut with_data = from_client(f, f.client, Flags::ACK, 10);
        with_data.payload = b"GET / HTTP/1.1\r\n".to_vec();
        let mut fin = from_client(f, f.client, Flags::FIN_ACK, 20);
        fin.tcp.as_mut().unwrap().ack = 0x1234_5678;
        let mut syn_fin = from_client(f, f.client, Flags::SYN, 30);
        syn_fin.tcp.as_mut().unwrap().flags.fin = true;
        let strays = [
            from_client(f, f.client, Flags::ACK, 1),
            with_data,
            fin,
            from_client(f, f.client, Flags::SYN_ACK, 40),
            syn_fin,
        ];
        for stray in &strays {
            assert_reset(node, f, stray);
        }
        let rst = from_client(f, f.client, Flags::RST_ACK, 50).frame();
        assert_eq!(node.run(&rst, None).0, XDP_DROP, "a reset was answered");
        assert_eq!(node.counter(Reason::XdpNoFlow), 6);
        assert_eq!(node.counter(Reason::XdpResetSent), 5);
        assert_eq!(node.counter(Reason::XdpNewFlow), 0, "a packet other than a SYN opened a flow");
        assert_eq!(node.nat_entries(), 0, "a NAT port was taken");
        // The client's SYN opens its flow, and its ACK follows it.
        let out = forwarded(node, f, f.client, 99);
        assert_eq!(to(node, &from_client(f, f.client, Flags::ACK, 100).frame()), out.dst);
    });
}

/// Nothing for a VIP's address is handed to the kernel, which does not
/// own it (it would route it back out, or ask its neighbours who has
/// it): TCP to a port lb does not serve there is answered with the
/// node's reset, anything else (UDP, a ping, another protocol, a
/// fragment, an ICMP error about no flow) dropped. Another address's
/// packets pass untouched.
#[privileged_test]
fn a_vips_address_is_never_handed_to_the_kernel() {
    both_families(|node, f| {
        let other_port = SocketAddr::new(f.vip.ip(), 81);
        assert_reset(node, f, &from_client(f, f.client, Flags::SYN, 1).to(other_port));
        let udp = Segment::udp((EXT_MAC, CLIENT_MAC), f.client, other_port, b"query");
        let echo_request = if f.vip.is_ipv4() { 8 } else { 128 };
        let ping = IcmpError::new(
            (EXT_MAC, CLIENT_MAC),
            (f.client.ip(), f.vip.ip()),
            (echo_request, 0, [0, 1, 0, 1]),
            b"ping",
        );
        let to_vip = SocketAddr::new(f.vip.ip(), 80);
        let mut gre = Segment::udp((EXT_MAC, CLIENT_MAC), f.client, to_vip, b"tunnel").frame();
        gre[14 + if f.vip.is_ipv4() { 9 } else { 6 }] = 47;
        // An error about a "reply" of no flow (quoted VIP → client), sent
        // to the VIP: none of lb's to translate, and the kernel's to route
        // back out if handed on.
        let unreachable = if f.vip.is_ipv4() { (3, 3, [0; 4]) } else { (1, 4, [0; 4]) };
        let never_sent = Segment::tcp((CLIENT_MAC, EXT_MAC), to_vip, f.client, Flags::ACK, 1, 1);
        let error = IcmpError::new(
            (EXT_MAC, CLIENT_MAC),
            (f.client.ip(), f.vip.ip()),
            unreachable,
            &never_sent.frame()[14..],
        );
        let mut dropped = vec![udp.frame(), ping.frame(), gre, error.frame()];
        if f.vip.is_ipv4() {
            // A first fragment (MF set) of a datagram to the VIP's port.
            let mut fragment = Segment::udp((EXT_MAC, CLIENT_MAC), f.client, to_vip, b"x").frame();
            fragment[14 + 6] |= 0x20;
            dropped.push(fragment);
        }
        for frame in &dropped {
            assert_eq!(node.run(frame, None).0, XDP_DROP, "handed to the kernel: {frame:02x?}");
        }
        assert_eq!(node.counter(Reason::XdpUnserved), 1 + dropped.len() as u64);
        // Another address, on the same ports: not lb's.
        let elsewhere = SocketAddr::new(f.servers[0].ip(), 81);
        let frame = from_client(f, f.client, Flags::SYN, 1).to(elsewhere).frame();
        assert_eq!(node.run(&frame, None), (XDP_PASS, frame));
        assert_eq!(node.counter(Reason::XdpUnserved), 1 + dropped.len() as u64);
    });
}

/// Reads every event waiting in the program's ring buffer: how many.
fn drain_events(node: &mut Node) -> usize {
    let mut ring = aya::maps::RingBuf::try_from(node.ebpf.map_mut(maps::EVENTS).unwrap()).unwrap();
    let mut read = 0;
    while ring.next().is_some() {
        read += 1;
    }
    read
}

/// Fails the first server as a silent one is failed: another client's
/// well-formed SYN, sent again after a second unanswered.
fn fail_by_a_silent_syn(node: &mut Node, f: &Family) {
    let other = SocketAddr::new(f.client.ip(), 42_999);
    assert_eq!(forwarded(node, f, other, 9).dst, f.servers[0]);
    node.age_syns(Duration::from_secs(1));
    assert_eq!(forwarded(node, f, other, 9).dst, f.servers[1]);
    assert!(node.failed(f.servers[0]));
}

/// Where a forwarded frame goes, without judging its checksums (a
/// malformed one is forwarded as it came).
fn read_frame_unchecked(frame: &[u8]) -> SocketAddr {
    let ip = &frame[14..];
    if ip[0] >> 4 == 4 {
        let port = u16::from_be_bytes([ip[22], ip[23]]);
        SocketAddr::from(([ip[16], ip[17], ip[18], ip[19]], port))
    } else {
        let addr: [u8; 16] = ip[24..40].try_into().unwrap();
        let port = u16::from_be_bytes([ip[42], ip[43]]);
        SocketAddr::from((addr, port))
    }
}

/// Where `frame`, a client's packet of a flow, is forwarded to.
fn to(node: &Node, frame: &[u8]) -> SocketAddr {
    let (verdict, out) = node.run(frame, None);
    assert_eq!(verdict, XDP_REDIRECT);
    read_frame(&out).expect("the forwarded frame").dst
}
