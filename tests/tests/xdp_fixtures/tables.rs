//! Established flows have tables of their own: a flow opens in the
//! opening tables (`OPENING_FLOWS`, `OPENING_REPLIES`) and moves to the
//! established ones (`FLOWS`, `NAT_REPLIES`) when its client acknowledges
//! the server's answer, which a sender of forged addresses never sees. So
//! a flood of new flows, however large, evicts no established flow. UDP
//! flows have tables of their own (`UDP_FLOWS`, `UDP_REPLIES`), which no
//! TCP flow evicts.

use std::{net::SocketAddr, time::Duration};

use lb_common::{Endpoint, NatKey, Reason, maps, nat};
use lb_tests::{
    packets::{Flags, Segment, read_frame},
    privileged_test,
    xdp_node::*,
};

/// The NAT key of the forwarded segment `out`'s flow.
fn key_of(out: &Segment) -> NatKey {
    NatKey {
        server: Endpoint::from(out.dst),
        node: Endpoint::from(out.src),
        protocol: 6,
        _pad: [0; 3],
    }
}

/// Opens `client`'s flow with a full handshake: its SYN, the server's
/// SYN-ACK (sequence number 7,000) on srv0, and its ACK of that. Returns
/// the SYN as forwarded.
fn handshake(node: &Node, f: &Family, client: SocketAddr) -> Segment {
    let syn = forwarded(node, f, client, 1_000);
    let syn_ack = from_server(&syn, Flags::SYN_ACK).frame();
    assert_eq!(node.run(&syn_ack, Some(node.srv0)).0, XDP_REDIRECT, "the SYN-ACK was not sent on");
    let mut ack = from_client(f, client, Flags::ACK, 1_001);
    ack.tcp.as_mut().unwrap().ack = 7_001;
    let (verdict, out) = node.run(&ack.frame(), None);
    assert_eq!(verdict, XDP_REDIRECT);
    assert_eq!(read_frame(&out).unwrap().src, syn.src, "the ACK left with another NAT port");
    syn
}

#[privileged_test]
fn a_flow_is_established_only_when_its_client_saw_the_servers_answer() {
    both_families(|node, f| {
        let syn = handshake(node, f, f.client);
        assert_eq!(node.counter(Reason::XdpPromoted), 1);
        let entry = node.nat_entry_in(maps::NAT_REPLIES, &key_of(&syn));
        assert_eq!(entry.map(|e| e.client), Some(Endpoint::from(f.client)), "not established");
        assert!(node.nat_entry_in(maps::OPENING_REPLIES, &key_of(&syn)).is_none());

        // A forged address's flow: the server answers, the "client"
        // acknowledges blindly, and even ACKs of other guesses move
        // nothing.
        let forged = SocketAddr::new(f.client.ip(), 41_000);
        let syn = forwarded(node, f, forged, 5_000);
        let syn_ack = from_server(&syn, Flags::SYN_ACK).frame();
        assert_eq!(node.run(&syn_ack, Some(node.srv0)).0, XDP_REDIRECT);
        for guess in [0, 1, 7_000, 7_000 + (1 << 16) + 1, 6_999] {
            let mut ack = from_client(f, forged, Flags::ACK, 5_001);
            ack.tcp.as_mut().unwrap().ack = guess;
            assert_eq!(node.run(&ack.frame(), None).0, XDP_REDIRECT, "its ACK was not sent on");
        }
        assert_eq!(node.counter(Reason::XdpNotPromoted), 5);
        assert_eq!(node.counter(Reason::XdpPromoted), 1);
        assert!(node.nat_entry_in(maps::NAT_REPLIES, &key_of(&syn)).is_none(), "established");
        assert!(node.nat_entry_in(maps::OPENING_REPLIES, &key_of(&syn)).is_some());

        // Out of order: an ACK of the right number before the server has
        // answered moves nothing; after the answer, the same ACK does.
        let early = SocketAddr::new(f.client.ip(), 42_000);
        let syn = forwarded(node, f, early, 9_000);
        let mut ack = from_client(f, early, Flags::ACK, 9_001);
        ack.tcp.as_mut().unwrap().ack = 7_001;
        assert_eq!(node.run(&ack.frame(), None).0, XDP_REDIRECT);
        assert_eq!(node.counter(Reason::XdpNotPromoted), 6, "an ACK before the answer promoted");
        let syn_ack = from_server(&syn, Flags::SYN_ACK).frame();
        assert_eq!(node.run(&syn_ack, Some(node.srv0)).0, XDP_REDIRECT);
        assert_eq!(node.run(&ack.frame(), None).0, XDP_REDIRECT);
        assert_eq!(node.counter(Reason::XdpPromoted), 2);
        assert!(node.nat_entry_in(maps::NAT_REPLIES, &key_of(&syn)).is_some(), "not established");
    });
}

/// Past `[daemon] new_flows_per_cpu` in a second, a CPU opens no more
/// flows (no port, no table entry, no route: a flood's cost is bounded);
/// flows already open go on, and the next second opens flows again.
#[privileged_test]
fn past_the_new_flow_limit_a_cpu_opens_no_flow_that_second() {
    both_families(|node, f| {
        stay_on_one_cpu();
        node.set_limit(lb_common::LIMIT_NEW_FLOWS, 10);
        let established = SocketAddr::new(f.client.ip(), 40_000);
        let started = std::time::Instant::now();
        let syn = handshake(node, f, established);
        let verdicts: Vec<u32> = (0..20)
            .map(|i| node.run(&from_client(f, spoofed(f, i), Flags::SYN, 1).frame(), None).0)
            .collect();
        let opened = verdicts.iter().filter(|v| **v == XDP_REDIRECT).count();
        // The handshake's flow was the first of the ten. Judged exactly if
        // the runs took less than the second (a stalled guest may cross
        // into the next one, whose ten may open too).
        if started.elapsed() < Duration::from_millis(900) {
            assert_eq!(opened, 9, "{verdicts:?}");
        }
        assert!(opened < 20, "nothing was limited: {verdicts:?}");
        assert_eq!(node.counter(Reason::XdpNewFlowLimited), 20 - opened as u64);
        assert_eq!(node.nat_entries(), 1 + opened, "a refused flow took a port");
        // The established flow goes on.
        let mut ack = from_client(f, established, Flags::ACK, 1_001);
        ack.tcp.as_mut().unwrap().ack = 7_001;
        let (verdict, out) = node.run(&ack.frame(), None);
        assert_eq!(verdict, XDP_REDIRECT, "an established flow was limited");
        assert_eq!(read_frame(&out).unwrap().src, syn.src);
        // The next second opens flows again.
        std::thread::sleep(Duration::from_millis(1_100));
        let again = from_client(f, spoofed(f, 99), Flags::SYN, 1).frame();
        assert_eq!(node.run(&again, None).0, XDP_REDIRECT, "the limit did not end with its second");
    });
}

/// The node's own answers to packets it did not ask for are a budget per
/// CPU and second (the daemon writes `lb_common::ANSWERS_PER_CPU`; 3
/// here): a flood of forged ACKs of no flow, each of which a reset would
/// answer, gets that many, the rest dropped unanswered and counted, and
/// the next second answers again.
#[privileged_test]
fn past_its_answers_for_the_second_a_cpu_sends_no_more() {
    both_families(|node, f| {
        stay_on_one_cpu();
        node.set_limit(lb_common::LIMIT_ANSWERS, 3);
        let started = std::time::Instant::now();
        let verdicts: Vec<u32> = (0..8)
            .map(|i| node.run(&from_client(f, spoofed(f, i), Flags::ACK, 1).frame(), None).0)
            .collect();
        let answered = verdicts.iter().filter(|v| **v == XDP_TX).count();
        // Judged exactly if the runs took less than the second.
        if started.elapsed() < Duration::from_millis(900) {
            assert_eq!(answered, 3, "{verdicts:?}");
        }
        assert!(answered < 8, "nothing was limited: {verdicts:?}");
        assert!(verdicts.iter().all(|v| *v == XDP_TX || *v == XDP_DROP), "{verdicts:?}");
        assert_eq!(node.counter(Reason::XdpAnswerLimited), 8 - answered as u64);
        assert_eq!(node.counter(Reason::XdpResetSent), answered as u64);
        assert_eq!(node.nat_entries(), 0, "a forged ACK took a port");
        // The next second answers again.
        std::thread::sleep(Duration::from_millis(1_100));
        let again = from_client(f, spoofed(f, 99), Flags::ACK, 1).frame();
        assert_eq!(node.run(&again, None).0, XDP_TX, "the limit did not end with its second");
    });
}

/// An opening flow whose NAT entry was evicted, its port since taken by
/// another client's flow, does not take that flow's place: its next
/// packet finds the port another's, forgets its own entry and opens anew
/// with a port of its own; the other flow keeps its port.
#[privileged_test]
fn an_opening_flow_whose_port_is_anothers_opens_anew() {
    both_families(|node, f| {
        let query = Segment::udp((EXT_MAC, CLIENT_MAC), f.client, f.vip, b"query").frame();
        let (verdict, out) = node.run(&query, None);
        assert_eq!(verdict, XDP_REDIRECT);
        let first = read_frame(&out).expect("the forwarded datagram");
        let key = NatKey { protocol: 17, ..key_of(&first) };
        // The entry was evicted, and another client's new flow took its port.
        let mut replies: aya::maps::HashMap<_, NatKey, lb_common::NatReply> =
            aya::maps::HashMap::try_from(node.ebpf.map_mut(maps::UDP_REPLIES).unwrap()).unwrap();
        let mut theirs = replies.get(&key, 0).expect("the flow's NAT entry");
        let other = spoofed(f, 7);
        theirs.client = Endpoint::from(other);
        replies.insert(key, theirs, 0).unwrap();

        let (verdict, out) = node.run(&query, None);
        assert_eq!(verdict, XDP_REDIRECT, "the client's next datagram was not sent");
        let again = read_frame(&out).expect("the forwarded datagram");
        assert_ne!(again.src, first.src, "it took the port of another client's flow");
        let kept = node.nat_entry_in(maps::UDP_REPLIES, &key).expect("the other's entry");
        assert_eq!(kept.client, Endpoint::from(other), "the other flow lost its port");
        let mine = NatKey { protocol: 17, ..key_of(&again) };
        let mine = node.nat_entry_in(maps::UDP_REPLIES, &mine).expect("its new entry");
        assert_eq!(mine.client, Endpoint::from(f.client));
        assert_eq!(node.counter(Reason::XdpNewFlow), 2);
    });
}

/// An established flow's reset, FIN or SYN from the servers' side counts
/// only within the server's window (a megabyte either way of the
/// sequence number the node last noted): forged ones outside it are sent
/// on to the client, whose stack judges them, but end nothing, so the
/// flow keeps its port; the window follows the server's data, and a
/// reset within it ends the flow.
#[privileged_test]
fn a_servers_reset_ends_an_established_flow_only_within_its_window() {
    both_families(|node, f| {
        let syn = handshake(node, f, f.client);
        let key = key_of(&syn);
        let flags = || node.nat_entry_in(maps::NAT_REPLIES, &key).expect("the entry").flags;
        let ended = nat::NAT_REPLY_RESET | nat::NAT_REPLY_SERVER_FIN;
        let server_isn: u32 = 7_000;
        let from_server_at = |flags: Flags, seq: u32| {
            let mut segment = from_server(&syn, flags);
            segment.tcp.as_mut().unwrap().seq = seq;
            segment.frame()
        };
        for (sent, seq) in [
            (Flags::RST_ACK, server_isn.wrapping_add(1 << 30)),
            (Flags::FIN_ACK, server_isn.wrapping_sub(1 << 21)),
            (Flags::SYN_ACK, server_isn.wrapping_add(3 << 20)),
        ] {
            let (verdict, _) = node.run(&from_server_at(sent, seq), Some(node.srv0));
            assert_eq!(verdict, XDP_REDIRECT, "{sent:?} was not sent on to the client");
            assert_eq!(flags() & ended, 0, "an out-of-window {sent:?} ended the flow");
        }
        assert_eq!(node.counter(Reason::XdpServerOutOfWindow), 3);
        // Three megabytes of the server's data, then a reset there.
        for kb in (64..=3_072).step_by(64) {
            let seq = server_isn.wrapping_add(1 + kb * 1_024);
            assert_eq!(node.run(&from_server_at(Flags::ACK, seq), Some(node.srv0)).0, XDP_REDIRECT);
        }
        let seq = server_isn.wrapping_add(1 + 3_072 * 1_024);
        node.run(&from_server_at(Flags::RST_ACK, seq), Some(node.srv0));
        assert_ne!(flags() & nat::NAT_REPLY_RESET, 0, "a reset within the window ended nothing");
        assert_eq!(node.counter(Reason::XdpServerOutOfWindow), 3);
    });
}

/// The `i`th forged source address of a flood, in 198.18.0.0/15 or
/// 2001:2::/48 (the fixtures' client side).
fn spoofed(f: &Family, i: u32) -> SocketAddr {
    let ip = match f.client.ip() {
        std::net::IpAddr::V4(_) => {
            std::net::IpAddr::from([198, 18, 100 + (i >> 16) as u8, (i >> 8) as u8])
        }
        std::net::IpAddr::V6(_) => {
            std::net::IpAddr::from([0x2001, 2, 0, 0x100, 0, 0, (i >> 16) as u16, (i >> 8) as u16])
        }
    };
    SocketAddr::new(ip, 1_024 + (i & 0xff) as u16)
}

/// Many more new flows than the opening tables hold (spoofed SYNs) after
/// a flow was established: that flow keeps its server and its NAT port,
/// and its server's replies still reach it.
#[privileged_test]
fn a_flood_of_new_flows_evicts_no_established_one() {
    both_families(|node, f| {
        let established = SocketAddr::new(f.client.ip(), 40_000);
        let syn = handshake(node, f, established);
        // Three times as many new flows as the opening tables hold (the
        // fixtures' are small: `OPENING_FLOWS`), with ports to spare.
        node.serve_spread(f, &f.servers);
        let flood = 3 * OPENING_FLOWS + 500;
        for i in 0..flood {
            let frame = from_client(f, spoofed(f, i), Flags::SYN, 1).frame();
            assert_eq!(node.run(&frame, None).0, XDP_REDIRECT, "a new flow was refused");
        }
        assert_eq!(node.counter(Reason::XdpNewFlow), 1 + u64::from(flood));
        // The established flow: same server, same port, both ways.
        let mut ack = from_client(f, established, Flags::ACK, 1_001);
        ack.tcp.as_mut().unwrap().ack = 7_001;
        let (verdict, out) = node.run(&ack.frame(), None);
        assert_eq!(verdict, XDP_REDIRECT);
        let out = read_frame(&out).unwrap();
        assert_eq!((out.src, out.dst), (syn.src, syn.dst), "the established flow moved");
        let reply = from_server(&syn, Flags::ACK).frame();
        let (verdict, back) = node.run(&reply, Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT, "the server's reply was not sent on");
        assert_eq!(read_frame(&back).unwrap().dst, established, "the reply went to another client");
    });
}

/// A UDP flow has tables of its own: many more forged SYNs than the
/// opening tables hold leave it its server and its NAT port, and its
/// server's answers still reach its client.
#[privileged_test]
fn a_syn_flood_evicts_no_udp_flow() {
    both_families(|node, f| {
        let client = SocketAddr::new(f.client.ip(), 40_001);
        let query = Segment::udp((EXT_MAC, CLIENT_MAC), client, f.vip, b"query").frame();
        let (verdict, out) = node.run(&query, None);
        assert_eq!(verdict, XDP_REDIRECT, "the query was not sent on");
        let first = read_frame(&out).expect("the forwarded query");
        node.serve_spread(f, &f.servers);
        let flood = 3 * OPENING_FLOWS + 500;
        for i in 0..flood {
            let frame = from_client(f, spoofed(f, i), Flags::SYN, 1).frame();
            assert_eq!(node.run(&frame, None).0, XDP_REDIRECT, "a new flow was refused");
        }
        let (verdict, out) = node.run(&query, None);
        assert_eq!(verdict, XDP_REDIRECT);
        let again = read_frame(&out).expect("the forwarded query");
        assert_eq!((again.src, again.dst), (first.src, first.dst), "the UDP flow lost its port");
        assert_eq!(node.counter(Reason::XdpNewFlow), 1 + u64::from(flood), "it opened anew");
        let answer =
            Segment::udp((SRV_MAC, server_mac(first.dst)), first.dst, first.src, b"answer");
        let (verdict, back) = node.run(&answer.frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT, "the server's answer was not sent on");
        let back = read_frame(&back).expect("the translated answer");
        assert_eq!((back.src, back.dst), (f.vip, client), "the answer went elsewhere");
    });
}
