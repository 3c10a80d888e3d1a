//! Packet fixtures of the external path (forwarding with NAT, replies,
//! failure marks, ICMP errors, announcing): the XDP program, loaded on maps
//! of its own, runs under `BPF_PROG_TEST_RUN` on frames built here; each
//! case checks the verdict and the frame the program made (addresses,
//! ports, MACs, TTL, and every checksum, by a full recomputation in
//! `lb_tests::packets`), and what it left in its maps. Needs root; see
//! `lb_tests::privileged`.
//!
//! Each case runs in a network namespace of its own (`in_new_netns`) whose
//! routes and neighbours the test sets, so the kernel's FIB, which the
//! program asks where a packet goes, answers the same on every machine:
//!
//! ```text
//!  clients ── ext0 [node] srv0 ── servers
//!  198.18.0.0/24     198.18.2.1 → 198.18.2.2, .3 (permanent neighbours)
//!  2001:2::/64       2001:2:0:2::1 → ::2, ::3
//! ```
//!
//! IPv6 uses 2001:2::/48, the IPv6 benchmarking range (RFC 5180), as
//! 198.18.0.0/15 is IPv4's. Nothing is sent: a redirect under
//! `BPF_PROG_TEST_RUN` only returns its verdict.

use std::net::SocketAddr;

use aya::maps::HashMap;
use lb_common::{
    Endpoint, NAT_PORT_COUNT, NAT_PORT_FIRST, NAT_REPLY_ESTABLISHED, NatKey, NatReply, Reason,
    maglev::{flow_hash, server_for},
    maps,
};
use lb_tests::packets::{Flags, Segment, read_frame};
use lb_tests::privileged_test;

mod affinity;
mod announce;
mod hostile;
mod icmp;
mod keep_client;
mod kept;
mod nat;
mod short_way;
mod tables;
mod too_big;

use lb_tests::xdp_node::*;

#[privileged_test]
fn a_syn_goes_to_the_first_server_and_its_flow_stays_there() {
    both_families(|node, f| {
        let first = forwarded(node, f, f.client, 1_000);
        assert_eq!(first.dst, f.servers[0], "failover picks the first usable server");
        // The next segment of the flow: same server, same NAT port.
        let (verdict, out) = node.run(&from_client(f, f.client, Flags::ACK, 1_001).frame(), None);
        assert_eq!(verdict, XDP_REDIRECT);
        let out = read_frame(&out).unwrap();
        assert_eq!(
            (out.src, out.dst),
            (first.src, first.dst),
            "the flow changed its NAT or server"
        );
        assert_eq!(node.counter(Reason::XdpNewFlow), 1);
        assert_eq!(node.counter(Reason::XdpForwarded), 1);
    });
}

#[privileged_test]
fn replies_go_back_to_the_client_from_the_vip_the_way_they_came() {
    both_families(|node, f| {
        let out = forwarded(node, f, f.client, 1_000);
        let (verdict, back) = node.run(&from_server(&out, Flags::SYN_ACK).frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT, "the reply was not redirected");
        let back = read_frame(&back).expect("the translated reply");
        assert_eq!(
            (back.src, back.dst),
            (f.vip, f.client),
            "the reply is not from the VIP to the client"
        );
        assert_eq!(
            back.macs,
            (CLIENT_MAC, EXT_MAC),
            "the reply does not go back the way the SYN came"
        );
        assert_eq!(back.ttl, 63);
        assert_eq!(back.tcp.unwrap().ack, 1_001);
        assert_eq!(node.counter(Reason::XdpReplied), 1);
    });
}

/// A UDP flow both ways (an IPv4 datagram without a checksum keeps none);
/// the server's reply forged from the clients' side reaches no client.
#[privileged_test]
fn udp_both_ways_with_and_without_an_ipv4_checksum() {
    both_families(|node, f| {
        let query = Segment::udp((EXT_MAC, CLIENT_MAC), f.client, f.vip, b"query");
        let mut frame = query.frame();
        if f.vip.is_ipv4() {
            // IPv4 UDP may carry no checksum: it must stay none.
            let at = 14 + 20 + 6;
            frame[at..at + 2].copy_from_slice(&[0, 0]);
        }
        let (verdict, out) = node.run(&frame, None);
        assert_eq!(verdict, XDP_REDIRECT);
        let out_seg = read_frame(&out).expect("the forwarded datagram");
        assert_eq!(out_seg.dst, f.servers[0]);
        assert_eq!(out_seg.payload, b"query");
        if f.vip.is_ipv4() {
            assert_eq!(&out[14 + 20 + 6..14 + 20 + 8], &[0, 0], "a checksum appeared");
        }
        let answer =
            Segment::udp((SRV_MAC, server_mac(out_seg.dst)), out_seg.dst, out_seg.src, b"answer");
        // The same datagram forged from the clients' side: no reply.
        let forged =
            Segment::udp((EXT_MAC, CLIENT_MAC), out_seg.dst, out_seg.src, b"forged").frame();
        assert_eq!(node.run(&forged, None).0, XDP_DROP, "a forged reply reached the client");
        assert_eq!(node.counter(Reason::XdpReplyElsewhere), 1);
        let (verdict, back) = node.run(&answer.frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT);
        let back = read_frame(&back).expect("the translated answer");
        assert_eq!(
            (back.src, back.dst, back.payload.as_slice()),
            (f.vip, f.client, &b"answer"[..])
        );
    });
}

#[privileged_test]
fn what_is_not_ours_passes_untouched() {
    both_families(|node, f| {
        let stray_reply = Segment::tcp(
            (SRV_MAC, server_mac(f.servers[0])),
            f.servers[0],
            SocketAddr::new(f.node, 61_001),
            Flags::SYN_ACK,
            1,
            1,
        );
        let frames = [
            stray_reply.frame(),
            // ARP: neither IPv4 nor IPv6.
            {
                let mut arp = vec![0u8; 42];
                arp[..6].copy_from_slice(&[0xff; 6]);
                arp[6..12].copy_from_slice(&CLIENT_MAC);
                arp[12..14].copy_from_slice(&[0x08, 0x06]);
                arp
            },
        ];
        for frame in frames {
            let (verdict, out) = node.run(&frame, None);
            assert_eq!((verdict, out), (XDP_PASS, frame), "a packet not for lb was touched");
        }
        assert_eq!(node.counter(Reason::XdpNotOurs), 1);
        assert_eq!(node.counter(Reason::XdpNotIp), 1);
        // A TTL that would run out: the kernel answers it.
        let mut last_hop = from_client(f, f.client, Flags::SYN, 1);
        last_hop.ttl = 1;
        let frame = last_hop.frame();
        assert_eq!(node.run(&frame, None), (XDP_PASS, frame));
        assert_eq!(node.counter(Reason::XdpTtlExceeded), 1);
    });
}

#[privileged_test]
fn a_reset_answering_the_syn_fails_the_server_and_the_next_syn_goes_elsewhere() {
    both_families(|node, f| {
        let out = forwarded(node, f, f.client, 5_000);
        assert_eq!(out.dst, f.servers[0]);
        // Forged on the clients' side (arriving on loopback, not srv0):
        // dropped, no mark.
        let rst = from_server(&out, Flags::RST_ACK).frame();
        let (verdict, _) = node.run(&rst, None);
        assert_eq!(verdict, XDP_DROP, "a reset from elsewhere than the server's side went on");
        assert_eq!(node.counter(Reason::XdpReplyElsewhere), 1);
        assert!(!node.failed(f.servers[0]), "a reset from the wrong side failed the server");
        // A reset that does not acknowledge the SYN: no mark either.
        let mut wrong_ack = from_server(&out, Flags::RST_ACK);
        wrong_ack.tcp.as_mut().unwrap().ack = 1;
        node.run(&wrong_ack.frame(), Some(node.srv0));
        assert!(!node.failed(f.servers[0]), "a reset not answering the SYN failed the server");
        // The server's own refusal.
        node.run(&rst, Some(node.srv0));
        assert!(node.failed(f.servers[0]), "the refusal did not mark the server");
        assert_eq!(node.counter(Reason::XdpServerReset), 1);
        let client2 = SocketAddr::new(f.client.ip(), 40_001);
        let next = forwarded(node, f, client2, 9_000);
        assert_eq!(next.dst, f.servers[1], "the next SYN went to the failed server");
        assert_eq!(node.counter(Reason::XdpSkippedFailed), 1);
    });
}

#[privileged_test]
fn a_syn_sent_again_unanswered_fails_the_server_and_moves_the_flow() {
    both_families(|node, f| {
        let first = forwarded(node, f, f.client, 5_000);
        assert_eq!(first.dst, f.servers[0]);
        // At once: a duplicate (or a forgery), not a retransmission.
        let duplicate = forwarded(node, f, f.client, 5_000);
        assert_eq!(duplicate.dst, f.servers[0], "a duplicate SYN moved the flow");
        assert!(!node.failed(f.servers[0]), "a duplicate SYN failed the server");
        node.age_syns(std::time::Duration::from_secs(1));
        let again = forwarded(node, f, f.client, 5_000);
        assert_eq!(again.dst, f.servers[1], "the retransmitted SYN stayed on the silent server");
        assert!(node.failed(f.servers[0]));
        assert_eq!(node.counter(Reason::XdpSynRetransmitted), 1);
        // Answered, a SYN on the same ports is a new connection: it stays.
        let (verdict, _) = node.run(&from_server(&again, Flags::SYN_ACK).frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT);
        let later = forwarded(node, f, f.client, 77_000);
        assert_eq!((later.dst, later.src), (again.dst, again.src));
        assert!(!node.failed(f.servers[1]));
    });
}

/// A `spread` service's new flows go where its consistent-hash (Maglev)
/// table says, by client address and port; a slot whose server has failed
/// falls back to the choice among the others.
#[privileged_test]
fn a_spread_services_new_flows_follow_its_maglev_table() {
    both_families(|node, f| {
        node.serve_spread(f, &f.servers);
        let table = lb_user::maglev::table(&f.servers);
        let mut landed = [0; 2];
        for port in 40_000..40_032 {
            let client = SocketAddr::new(f.client.ip(), port);
            let out = forwarded(node, f, client, 1);
            let expected = server_for(&table, flow_hash(&Endpoint::from(client), 6)).unwrap();
            assert_eq!(Endpoint::from(out.dst), expected, "client port {port}");
            landed[usize::from(out.dst == f.servers[1])] += 1;
        }
        assert_eq!(node.counter(Reason::XdpConsistent), 32);
        assert!(landed.iter().all(|n| *n > 0), "one server took every flow: {landed:?}");
        // Through the reset of a forwarded SYN, the first server fails; the
        // flows its slots name go to the second.
        let syn = forwarded(node, f, SocketAddr::new(f.client.ip(), 50_000), 9);
        let reset = from_server(&syn, Flags::RST_ACK);
        let _ = node.run(&reset.frame(), Some(node.srv0));
        let failed = syn.dst;
        assert!(node.failed(failed));
        for port in 41_000..41_016 {
            let out = forwarded(node, f, SocketAddr::new(f.client.ip(), port), 1);
            assert_ne!(out.dst, failed, "a new flow went to the failed server");
        }
    });
}

#[privileged_test]
fn a_removed_server_loses_its_flows_to_the_next() {
    both_families(|node, f| {
        let first = forwarded(node, f, f.client, 1);
        assert_eq!(first.dst, f.servers[0]);
        node.serve(f, &f.servers[1..]);
        // Its next packet: the connection is gone with the server; the
        // node says so at once (under NAT the next server would).
        assert_reset(node, f, &from_client(f, f.client, Flags::ACK, 2));
        assert_eq!(node.counter(Reason::XdpFlowMoved), 1);
        assert_eq!(node.counter(Reason::XdpResetSent), 1);
        // The client connects again, on the same ports: the next server.
        assert_eq!(forwarded(node, f, f.client, 3).dst, f.servers[1]);
    });
}

#[privileged_test]
fn no_server_or_no_nat_port_refuses_the_flow() {
    both_families(|node, f| {
        node.serve(f, &[]);
        let syn = from_client(f, f.client, Flags::SYN, 1).frame();
        assert_eq!(node.run(&syn, None).0, XDP_DROP, "a service with no server must refuse");
        assert_eq!(node.counter(Reason::XdpNoServer), 1);

        // Every NAT port toward the first server taken.
        node.serve(f, &f.servers);
        let mut nat: HashMap<_, NatKey, NatReply> =
            HashMap::try_from(node.ebpf.map_mut(maps::NAT_REPLIES).unwrap()).unwrap();
        let mut key = NatKey {
            server: Endpoint::from(f.servers[0]),
            node: host(f.node),
            protocol: 6,
            _pad: [0; 3],
        };
        // Each by a live flow (seen just now).
        let live = NatReply {
            flags: lb_common::nat::stamp(
                NAT_REPLY_ESTABLISHED,
                lb_common::nat::tick(monotonic_ns()),
            ),
            ..NatReply::default()
        };
        for port in NAT_PORT_FIRST..=NAT_PORT_FIRST + (NAT_PORT_COUNT - 1) {
            key.node.port = port.to_be();
            nat.insert(key, live, 0).unwrap();
        }
        assert_eq!(node.run(&syn, None).0, XDP_DROP, "a flow with no NAT port must be refused");
        assert_eq!(node.counter(Reason::XdpNatPortsExhausted), 1);
    });
}

/// Frames a switch floods (sent to another machine's MAC, such as a dead
/// node's) are not forwarded: only the machine they were sent to may,
/// or two nodes would each send the server a copy.
#[privileged_test]
fn a_frame_sent_to_another_machine_is_not_forwarded() {
    both_families(|node, f| {
        const OTHER_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x99];
        let ext0 = node.know_ext0_mac();
        let mut flooded = from_client(f, f.client, Flags::SYN, 1);
        flooded.macs = (OTHER_MAC, CLIENT_MAC);
        let frame = flooded.frame();
        assert_eq!(node.run(&frame, Some(ext0)), (XDP_PASS, frame), "a flooded frame was touched");
        assert_eq!(node.counter(Reason::XdpOtherHost), 1);
        assert_eq!(node.counter(Reason::XdpNewFlow), 0);
        let (verdict, _) = node.run(&from_client(f, f.client, Flags::SYN, 1).frame(), Some(ext0));
        assert_eq!(verdict, XDP_REDIRECT, "a frame sent to the node is forwarded");
    });
}

/// The program keeps each interface's MAC address per CPU for the
/// daemon's epoch (`packet::for_this_node`): once the daemon writes an
/// interface's new address (and starts a new epoch, as it does after
/// every change), a frame sent to the old one is another machine's from
/// the next packet on, and one sent to the new one is forwarded.
#[privileged_test]
fn an_interfaces_new_mac_address_is_followed_from_the_next_frame() {
    both_families(|node, f| {
        const NEW_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x77];
        let ext0 = node.know_ext0_mac();
        let syn = |port: u16, to: [u8; 6]| {
            let mut syn = from_client(f, SocketAddr::new(f.client.ip(), port), Flags::SYN, 1);
            syn.macs = (to, CLIENT_MAC);
            syn.frame()
        };
        let (verdict, _) = node.run(&syn(30_001, EXT_MAC), Some(ext0));
        assert_eq!(verdict, XDP_REDIRECT, "a frame sent to ext0's address is forwarded");
        node.know_ext0_mac_as(NEW_MAC);
        let to_old = syn(30_002, EXT_MAC);
        assert_eq!(
            node.run(&to_old, Some(ext0)),
            (XDP_PASS, to_old),
            "a frame sent to ext0's old address was forwarded"
        );
        assert_eq!(node.counter(Reason::XdpOtherHost), 1);
        let (verdict, _) = node.run(&syn(30_003, NEW_MAC), Some(ext0));
        assert_eq!(verdict, XDP_REDIRECT, "a frame sent to ext0's new address is not forwarded");
    });
}
