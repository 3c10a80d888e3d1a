//! What `lb_xdp` keeps so that an established flow's packet costs little
//! (the bench's target: under 100 ns of program time): the route to a
//! server, a while per CPU (`ROUTES`); a server's traffic in its slot of
//! `TRAFFIC_SLOTS`; the stamps that let a server with no recent failure
//! mark go without a `FAILED_AT` lookup (`MARKED_AT`). Each case checks
//! that what is kept changes nothing the maps say: where packets go, what
//! is counted, which server is usable.

use std::{net::SocketAddr, time::Duration};

use lb_common::{Endpoint, Reason, TRAFFIC_SLOT_IDLE_TICKS, Traffic, TrafficSlot, traffic_slot};
use lb_tests::packets::{Flags, Segment, read_frame};
use lb_tests::privileged_test;

use lb_tests::xdp_node::*;

/// The longest a CPU keeps a route: 10 jiffies at `HZ` 100.
const ROUTE_KEPT_AT_MOST: Duration = Duration::from_millis(100);

#[privileged_test]
fn a_servers_route_is_kept_and_a_changed_neighbour_is_followed() {
    both_families(|node, f| {
        stay_on_one_cpu();
        let first = forwarded(node, f, f.client, 1_000);
        assert_eq!(node.counter(Reason::XdpFibLookup), 1, "the SYN asks the FIB");
        const PACKETS: u64 = 20;
        let ack = from_client(f, f.client, Flags::ACK, 1_001).frame();
        let since = jiffies();
        for _ in 0..PACKETS {
            let (verdict, out) = node.run(&ack, None);
            assert_eq!(verdict, XDP_REDIRECT);
            let out = read_frame(&out).expect("the forwarded frame");
            assert_eq!((out.src, out.dst), (first.src, first.dst));
            assert_eq!(out.macs, (server_mac(first.dst), SRV_MAC), "a kept route's link layer");
            assert_eq!(out.ttl, 63);
        }
        // A route is kept 10 jiffies: asked again at most once per 10 that
        // passed (and once more for the one under way), however slow the
        // runs.
        let ticks = jiffies() - since;
        let asked = node.counter(Reason::XdpFibLookup) - 1;
        assert!(
            asked <= ticks / 10 + 1 && asked < PACKETS,
            "the FIB was asked for {asked} of {PACKETS} packets in {ticks} jiffies"
        );

        // A longer packet than the route was found for asks again: it may
        // not fit the route's MTU.
        let mut longer = from_client(f, f.client, Flags::ACK, 1_001);
        longer.payload = vec![0; 200];
        let before = node.counter(Reason::XdpFibLookup);
        assert_eq!(node.run(&longer.frame(), None).0, XDP_REDIRECT);
        assert_eq!(
            node.counter(Reason::XdpFibLookup),
            before + 1,
            "a longer packet took the route"
        );

        // A UDP datagram to the same server asks again: policy rules may
        // route TCP and UDP apart (`ip rule ... ipproto`).
        let udp = Segment::udp((EXT_MAC, CLIENT_MAC), f.client, f.vip, b"x");
        let (verdict, out) = node.run(&udp.frame(), None);
        assert_eq!(verdict, XDP_REDIRECT);
        assert_eq!(read_frame(&out).expect("the forwarded datagram").dst, first.dst);
        assert_eq!(
            node.counter(Reason::XdpFibLookup),
            before + 2,
            "a UDP datagram took a TCP flow's route"
        );

        // The server's MAC changes (its neighbour entry): followed once the
        // kept route has aged out.
        let mac = "02:00:00:00:02:99";
        let ip = first.dst.ip().to_string();
        sh(&["ip", "neigh", "replace", &ip, "lladdr", mac, "dev", "srv0", "nud", "permanent"]);
        std::thread::sleep(ROUTE_KEPT_AT_MOST + Duration::from_millis(50));
        let (verdict, out) = node.run(&ack, None);
        assert_eq!(verdict, XDP_REDIRECT);
        let out = read_frame(&out).expect("the forwarded frame");
        assert_eq!(out.macs.0, [2, 0, 0, 0, 2, 0x99], "the new neighbour was not followed");
    });
}

#[privileged_test]
fn traffic_is_counted_in_the_servers_slot_or_else_in_its_entry() {
    both_families(|node, f| {
        stay_on_one_cpu();
        let [a, b] = f.servers;
        let ack = from_client(f, f.client, Flags::ACK, 1_001).frame();
        forwarded(node, f, f.client, 1_000);
        for _ in 0..3 {
            assert_eq!(node.run(&ack, None).0, XDP_REDIRECT);
        }
        let counted = |entry, slots| TrafficParts { entry, slots };
        assert_eq!(node.traffic(a), counted(0, 4), "a free slot was not taken");
        assert_eq!(node.traffic(b), counted(0, 0));

        // Another server, busy, holds b's slot on every CPU: b is counted
        // in its `TRAFFIC` entry, and the holder keeps its slot.
        let holder = colliding(b);
        let slot = traffic_slot(&Endpoint::from(b));
        let busy = TrafficSlot {
            server: Endpoint::from(holder),
            used_at: jiffies(),
            traffic: Traffic { packets: 5, bytes: 500 },
            ..TrafficSlot::default()
        };
        node.set_traffic_slot(slot, busy);
        let cpus = aya::util::nr_cpus().unwrap() as u64;
        node.serve(f, &[b]);
        // a left the selection: the flow moves to b.
        assert_eq!(moved_to(node, f), b);
        assert_eq!(node.traffic(b), counted(1, 0), "a busy holder lost its slot");
        assert_eq!(node.traffic(holder), counted(0, 5 * cpus));

        // Idle for longer than a slot may be, the holder gives it up to b
        // on this CPU, and its counts there move to its entry.
        let idle = TrafficSlot { used_at: jiffies() - TRAFFIC_SLOT_IDLE_TICKS - 1, ..busy };
        node.set_traffic_slot(slot, idle);
        assert_eq!(node.run(&ack, None).0, XDP_REDIRECT);
        assert_eq!(node.traffic(b), counted(1, 1), "an idle holder kept its slot");
        assert_eq!(node.traffic(holder), counted(5, 5 * (cpus - 1)), "the holder's counts");
    });
}

#[privileged_test]
fn a_mark_made_by_a_program_stamps_its_slot_and_moves_the_servers_flows() {
    both_families(|node, f| {
        let [a, b] = f.servers;
        let ack = flow_to_first_server(node, f);
        // Another flow's SYN to a, sent again unanswered, fails a.
        let other = SocketAddr::new(f.client.ip(), 40_001);
        assert_eq!(forwarded(node, f, other, 1).dst, a);
        node.age_syns(Duration::from_secs(1));
        assert_eq!(forwarded(node, f, other, 1).dst, b);
        assert_eq!(node.counter(Reason::XdpSynRetransmitted), 1);
        // The first flow's next packet finds the mark, and moves.
        assert_ne!(to_or_reset(node, &ack), Some(a), "the stamped mark was not looked up");
        assert_eq!(node.counter(Reason::XdpFlowMoved), 1);
        assert_eq!(moved_to(node, f), b);
    });
}

#[privileged_test]
fn a_flows_server_is_looked_up_in_failed_at_while_its_slot_is_stamped_or_unknown() {
    both_families(|node, f| {
        let [a, b] = f.servers;
        let ack = flow_to_first_server(node, f);
        // A mark that stamped no slot, as a program of layout 7 made it
        // before this one replaced it: the flow's packets do not look for
        // it (a new flow's choice does).
        node.mark_without_stamp(a);
        assert_eq!(to(node, &ack), a, "an unstamped slot's server was looked up");
        // The daemon says the marks are of unknown age, as it does when its
        // programs replace running ones: the flow's next packet finds the
        // mark, and the flow moves.
        node.forget_marks();
        assert_ne!(to_or_reset(node, &ack), Some(a), "the mark was not looked up");
        assert_eq!(node.counter(Reason::XdpFlowMoved), 1);
        assert_eq!(moved_to(node, f), b);
        assert_eq!(to(node, &ack), b);
    });
}

/// Opens the client's flow, which goes to the first server, and returns
/// its next packet (an ACK).
fn flow_to_first_server(node: &Node, f: &Family) -> Vec<u8> {
    assert_eq!(forwarded(node, f, f.client, 1_000).dst, f.servers[0]);
    let ack = from_client(f, f.client, Flags::ACK, 1_001).frame();
    assert_eq!(to(node, &ack), f.servers[0]);
    ack
}

/// Where the client's flow goes once it has left its server: its next
/// packet is answered with the node's reset, and the client's SYN sent
/// again on the same ports goes to the server returned.
fn moved_to(node: &Node, f: &Family) -> SocketAddr {
    assert_reset(node, f, &from_client(f, f.client, Flags::ACK, 1_001));
    forwarded(node, f, f.client, 1_000).dst
}

/// Where `frame`, a client's packet of a flow, is forwarded to; `None`
/// if the node answered it instead (its flow left its server).
fn to_or_reset(node: &Node, frame: &[u8]) -> Option<SocketAddr> {
    let (verdict, out) = node.run(frame, None);
    if verdict == XDP_TX {
        return None;
    }
    assert_eq!(verdict, XDP_REDIRECT);
    Some(read_frame(&out).expect("the forwarded frame").dst)
}

/// Where `frame`, a client's packet of a flow, is forwarded to.
fn to(node: &Node, frame: &[u8]) -> SocketAddr {
    let (verdict, out) = node.run(frame, None);
    assert_eq!(verdict, XDP_REDIRECT);
    read_frame(&out).expect("the forwarded frame").dst
}

/// A server other than `server` whose traffic slot is the same: its
/// address, another port.
fn colliding(server: SocketAddr) -> SocketAddr {
    let slot = traffic_slot(&Endpoint::from(server));
    (1..=u16::MAX)
        .map(|port| SocketAddr::new(server.ip(), port))
        .find(|other| *other != server && traffic_slot(&Endpoint::from(*other)) == slot)
        .expect("no port of the server's address shares its slot")
}
