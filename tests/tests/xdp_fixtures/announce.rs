//! Announcing: an ARP request for an announced VIP is answered in place, on
//! the interface it is announced on, until its fence (`ANNOUNCE_UNTIL`, an
//! elected node's deadline); past it, the request passes untouched and is
//! counted.

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
