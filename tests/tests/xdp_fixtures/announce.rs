//! Announcing: an ARP request for an announced VIP is answered in place, on
//! the interface it is announced on, until its fence (`ANNOUNCE_UNTIL`, an
//! elected node's deadline); past it, the request passes untouched and is
//! counted. Duplicate address probes for an IPv6 VIP are defended within
//! the node's budget of answers.

use std::net::IpAddr;

use aya::maps::HashMap;
use lb_common::{AnnounceKey, AnnounceValue, Reason, maps};

use lb_tests::privileged_test;
use lb_tests::xdp_node::*;

/// The MAC the node announces the VIP with.
const ANNOUNCED_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x42];

fn arp_request(asker: [u8; 4], target: [u8; 4]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(42);
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&[0x08, 0x06, 0, 1, 8, 0, 6, 4, 0, 1]);
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&asker);
    frame.extend_from_slice(&[0; 6]);
    frame.extend_from_slice(&target);
    frame
}

#[privileged_test]
fn an_announced_vip_is_answered_until_its_fence() {
    lb_tests::in_new_netns(|| {
        let mut node = Node::new();
        let f = v4();
        let IpAddr::V4(vip) = f.vip.ip() else { unreachable!() };
        // Where test packets arrive: ext0, or loopback before Linux 5.14.
        let ext0 = ifindex("ext0");
        let arrives = if node.knows_ingress() { ext0 } else { 1 };
        let addr = host(f.vip.ip()).addr;
        let mut announce: HashMap<_, AnnounceKey, AnnounceValue> =
            HashMap::try_from(node.ebpf.map_mut(maps::ANNOUNCE).unwrap()).unwrap();
        announce
            .insert(
                AnnounceKey { ifindex: arrives, addr },
                AnnounceValue { mac: ANNOUNCED_MAC, _pad: [0; 2] },
                0,
            )
            .unwrap();
        let asker = [198, 18, 0, 10];
        let request = arp_request(asker, vip.octets());

        let mut answer = Vec::with_capacity(42);
        answer.extend_from_slice(&CLIENT_MAC);
        answer.extend_from_slice(&ANNOUNCED_MAC);
        answer.extend_from_slice(&[0x08, 0x06, 0, 1, 8, 0, 6, 4, 0, 2]);
        answer.extend_from_slice(&ANNOUNCED_MAC);
        answer.extend_from_slice(&vip.octets());
        answer.extend_from_slice(&CLIENT_MAC);
        answer.extend_from_slice(&asker);
        assert_eq!(node.run(&request, Some(ext0)), (XDP_TX, answer.clone()), "no lease: answered");

        let fence = |node: &mut Node, until: u64| {
            let mut fences: HashMap<_, [u32; 4], u64> =
                HashMap::try_from(node.ebpf.map_mut(maps::ANNOUNCE_UNTIL).unwrap()).unwrap();
            fences.insert(addr, until, 0).unwrap();
        };
        fence(&mut node, monotonic_ns() + 10_000_000_000);
        assert_eq!(node.run(&request, Some(ext0)), (XDP_TX, answer), "before the fence: answered");
        assert_eq!(node.counter(Reason::XdpArpAnswered), 2);

        for until in [monotonic_ns().saturating_sub(1), 0] {
            fence(&mut node, until);
            assert_eq!(
                node.run(&request, Some(ext0)),
                (XDP_PASS, request.clone()),
                "fenced at {until}"
            );
        }
        assert_eq!(node.counter(Reason::XdpAnnounceFenced), 2);
        assert_eq!(node.counter(Reason::XdpArpAnswered), 2);

        // Another address, or another interface: not asked of this node.
        let other = arp_request(asker, [198, 18, 1, 101]);
        assert_eq!(node.run(&other, Some(ext0)), (XDP_PASS, other));
    });
}

/// A duplicate address probe (a neighbour solicitation from `::`) for
/// `target`: the frame as it arrives.
fn dad_probe(target: std::net::Ipv6Addr) -> Vec<u8> {
    let t = target.octets();
    let mut frame = Vec::with_capacity(78);
    frame.extend_from_slice(&[0x33, 0x33, 0xff, t[13], t[14], t[15]]);
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&[0x86, 0xdd]);
    // IPv6: 24 bytes of ICMPv6, hop limit 255, from ::, to the
    // solicited-node group.
    frame.extend_from_slice(&[0x60, 0, 0, 0, 0, 24, 58, 255]);
    frame.extend_from_slice(&[0; 16]);
    frame.extend_from_slice(&[0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, t[13], t[14], t[15]]);
    // Neighbour solicitation: type, code, checksum (the answer's is
    // updated from it, never checked here), reserved, target.
    frame.extend_from_slice(&[135, 0, 0, 0, 0, 0, 0, 0]);
    frame.extend_from_slice(&t);
    frame
}

/// A probe for an announced IPv6 VIP is defended with an advertisement
/// to all nodes on the link, so a flood of forged probes would make the
/// node flood the link: each CPU defends at most its answers' budget a
/// second (the daemon writes `lb_common::ANSWERS_PER_CPU`; 2 here), and
/// drops the rest, counted.
#[privileged_test]
fn a_flood_of_duplicate_address_probes_is_defended_within_a_budget() {
    lb_tests::in_new_netns(|| {
        let mut node = Node::new();
        stay_on_one_cpu();
        let f = v6();
        let IpAddr::V6(vip) = f.vip.ip() else { unreachable!() };
        let ext0 = ifindex("ext0");
        let arrives = if node.knows_ingress() { ext0 } else { 1 };
        let mut announce: HashMap<_, AnnounceKey, AnnounceValue> =
            HashMap::try_from(node.ebpf.map_mut(maps::ANNOUNCE).unwrap()).unwrap();
        announce
            .insert(
                AnnounceKey { ifindex: arrives, addr: host(f.vip.ip()).addr },
                AnnounceValue { mac: ANNOUNCED_MAC, _pad: [0; 2] },
                0,
            )
            .unwrap();
        node.set_limit(lb_common::LIMIT_ANSWERS, 2);
        let started = std::time::Instant::now();
        let probe = dad_probe(vip);
        let verdicts: Vec<u32> = (0..6).map(|_| node.run(&probe, Some(ext0)).0).collect();
        let (answer_verdict, answer) = {
            node.set_limit(lb_common::LIMIT_ANSWERS, 0);
            node.run(&probe, Some(ext0))
        };
        assert_eq!(answer_verdict, XDP_TX, "without a limit, a probe is defended");
        assert_eq!(&answer[..6], &[0x33, 0x33, 0, 0, 0, 1], "to all nodes");
        let defended = verdicts.iter().filter(|v| **v == XDP_TX).count();
        if started.elapsed() < std::time::Duration::from_millis(900) {
            assert_eq!(defended, 2, "{verdicts:?}");
        }
        assert!(defended < 6, "nothing was limited: {verdicts:?}");
        assert!(verdicts.iter().all(|v| *v == XDP_TX || *v == XDP_DROP), "{verdicts:?}");
        assert_eq!(node.counter(Reason::XdpAnswerLimited), 6 - defended as u64);
    });
}
