//! The short way of an established flow's packets (`established.rs` in
//! lb-ebpf): taken once the full path has judged a packet of the flow's
//! VIP and server in the daemon's current epoch, it sends each packet
//! exactly as the full path would, and gives way to the full path for
//! anything the verdict does not cover: a new epoch (the daemon changed
//! what decides), another MAC address, a FIN or a reset, a TTL running out.

use std::net::SocketAddr;

use aya::maps::{HashMap, MapData};
use lb_common::{Endpoint, Reason, Service, maps};
use lb_tests::packets::{Flags, Segment, read_frame};
use lb_tests::privileged_test;

use lb_tests::xdp_node::*;

/// The node's `SERVICES`, to write a selection as the daemon would.
fn services(node: &mut Node) -> HashMap<&mut MapData, Endpoint, Service> {
    HashMap::try_from(node.ebpf.map_mut(maps::SERVICES).unwrap()).unwrap()
}

/// Packets sent along an established flow per case.
const PACKETS: u64 = 20;

/// Opens and establishes a flow from `client` (SYN, the server's SYN-ACK,
/// the client's ACK) and sends one more ACK, which the full path judges
/// and leaves its verdict for: that ACK's frame, and what it left as.
fn established(node: &Node, f: &Family, client: SocketAddr) -> (Vec<u8>, Vec<u8>) {
    let out = forwarded(node, f, client, 1_000);
    let syn_ack = from_server(&out, Flags::SYN_ACK);
    let (verdict, _) = node.run(&syn_ack.frame(), Some(node.srv0));
    assert_eq!(verdict, XDP_REDIRECT, "the server's SYN-ACK");
    let server_seq = syn_ack.tcp.unwrap().seq;
    let ack = Segment::tcp((EXT_MAC, CLIENT_MAC), client, f.vip, Flags::ACK, 1_001, server_seq + 1)
        .frame();
    let promoted = node.counter(Reason::XdpPromoted);
    assert_eq!(node.run(&ack, None).0, XDP_REDIRECT, "the client's ACK");
    assert_eq!(node.counter(Reason::XdpPromoted), promoted + 1, "the flow is not established");
    let full = node.counter(Reason::XdpForwarded);
    let (verdict, left) = node.run(&ack, None);
    assert_eq!(verdict, XDP_REDIRECT);
    assert_eq!(node.counter(Reason::XdpForwarded), full + 1, "the full path judges it first");
    (ack, left)
}

/// Sends `frame` `PACKETS` times, each leaving as `left`; checks that
/// the short way took all of them but those after a kept route aged out
/// (10 jiffies; the kernel's clock is read around the loop).
fn all_short(node: &Node, frame: &[u8], left: &[u8]) {
    let (short, full) =
        (node.counter(Reason::XdpForwardedShort), node.counter(Reason::XdpForwarded));
    let since = jiffies();
    for _ in 0..PACKETS {
        assert_eq!(node.run(frame, None), (XDP_REDIRECT, left.to_vec()), "left otherwise");
    }
    let ticks = jiffies() - since;
    let short = node.counter(Reason::XdpForwardedShort) - short;
    let full = node.counter(Reason::XdpForwarded) - full;
    assert_eq!(short + full, PACKETS);
    assert!(
        full <= ticks / 10 + 1,
        "{full} of {PACKETS} packets went the full way in {ticks} jiffies"
    );
}

#[privileged_test]
fn an_established_flows_packets_go_the_short_way_and_leave_as_the_full_path_sends_them() {
    both_families(|node, f| {
        stay_on_one_cpu();
        let (ack, left) = established(node, f, f.client);
        let server = read_frame(&left).expect("the forwarded frame").dst;
        let before = node.traffic(server);
        all_short(node, &ack, &left);
        // The short way counts each packet's traffic as the full path does.
        let after = node.traffic(server);
        assert_eq!(after.entry + after.slots, before.entry + before.slots + PACKETS);
        // A longer segment, with data: the same flow, the same way.
        let mut data = from_client(f, f.client, Flags::ACK, 1_001);
        data.payload = vec![7; 100];
        let (verdict, out) = node.run(&data.frame(), None);
        assert_eq!(verdict, XDP_REDIRECT);
        let out = read_frame(&out).expect("the forwarded segment");
        assert_eq!((out.dst, out.payload.len()), (server, 100));
    });
}

#[privileged_test]
fn a_new_epoch_sends_the_next_packet_the_full_way() {
    both_families(|node, f| {
        stay_on_one_cpu();
        let [a, b] = f.servers;
        let vip = Endpoint::from(f.vip);
        let selected = services(node).get(&vip, 0).unwrap();
        // What the verdict stands for changes without a new epoch (the
        // daemon never does that): the kept verdict still holds, as long
        // as its route (10 jiffies). Under software emulation the steps
        // in between may take longer; then the packet is judged anew (and
        // its flow moves), and the case starts over with another client,
        // at most three times.
        let mut tries = 0;
        let client = loop {
            tries += 1;
            let client = SocketAddr::new(f.client.ip(), 41_000 + tries);
            let (ack, left) = established(node, f, client);
            all_short(node, &ack, &left);
            // The selection changes under the verdict: a leaves it.
            let mut without_a = selected;
            without_a.servers[0] = Endpoint::from(b);
            without_a.count = 1;
            services(node).insert(vip, without_a, 0).unwrap();
            let short = node.counter(Reason::XdpForwardedShort);
            let (_, out) = node.run(&ack, None);
            if node.counter(Reason::XdpForwardedShort) == short + 1 {
                assert_eq!(read_frame(&out).unwrap().dst, a, "the kept verdict did not hold");
                break client;
            }
            assert!(tries < 3, "the kept verdict never held in {tries} tries (its route aged?)");
            eprintln!("the route aged before the packet (try {tries}): again with another client");
            services(node).insert(vip, selected, 0).unwrap();
            node.new_epoch();
        };
        // The epoch is what ends it.
        node.new_epoch();
        let (moved, short) =
            (node.counter(Reason::XdpFlowMoved), node.counter(Reason::XdpForwardedShort));
        assert_reset(node, f, &from_client(f, client, Flags::ACK, 1_001));
        assert_eq!(node.counter(Reason::XdpFlowMoved), moved + 1, "the flow kept a server it left");
        assert_eq!(node.counter(Reason::XdpForwardedShort), short);
        assert_eq!(forwarded(node, f, client, 5_000).dst, b);
    });
}

#[privileged_test]
fn what_the_verdict_does_not_cover_goes_the_full_way() {
    both_families(|node, f| {
        stay_on_one_cpu();
        const OTHER_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x99];
        let (ack, left) = established(node, f, f.client);
        all_short(node, &ack, &left);
        let short = node.counter(Reason::XdpForwardedShort);

        // A frame a switch flooded, sent to another machine: the full
        // path, which leaves it alone once the node knows its own MAC.
        let ext0 = node.know_ext0_mac();
        let full = node.counter(Reason::XdpForwarded);
        assert_eq!(node.run(&ack, Some(ext0)).0, XDP_REDIRECT);
        assert_eq!(node.counter(Reason::XdpForwarded), full + 1, "the full path judges anew");
        let mut flooded = from_client(f, f.client, Flags::ACK, 1_001);
        flooded.macs = (OTHER_MAC, CLIENT_MAC);
        let frame = flooded.frame();
        assert_eq!(node.run(&frame, Some(ext0)), (XDP_PASS, frame), "a flooded frame was touched");
        assert_eq!(node.counter(Reason::XdpOtherHost), 1);

        // A TTL about to run out: the kernel answers it (the full path
        // passes it up).
        let mut dying = from_client(f, f.client, Flags::ACK, 1_001);
        dying.ttl = 1;
        let frame = dying.frame();
        assert_eq!(node.run(&frame, Some(ext0)), (XDP_PASS, frame));
        assert_eq!(node.counter(Reason::XdpTtlExceeded), 1);

        // The flow's segment as a first fragment (IPv4: MF set): the
        // full path, which hands no fragment on (its port may be
        // anything's).
        if f.vip.is_ipv4() {
            let mut fragment = from_client(f, f.client, Flags::ACK, 1_001).frame();
            fragment[14 + 6] |= 0x20;
            assert_eq!(node.run(&fragment, Some(ext0)).0, XDP_DROP, "a fragment went on");
        }

        // A FIN and a reset change the flow's state: the full path.
        let full = node.counter(Reason::XdpForwarded);
        for flags in [Flags::FIN_ACK, Flags::RST_ACK] {
            let packet = Segment::tcp((EXT_MAC, CLIENT_MAC), f.client, f.vip, flags, 1_001, 0);
            assert_eq!(node.run(&packet.frame(), Some(ext0)).0, XDP_REDIRECT);
        }
        assert_eq!(node.counter(Reason::XdpForwarded), full + 2);
        assert_eq!(node.counter(Reason::XdpForwardedShort), short);
    });
}
