//! A VIP that keeps the client's address (`EXTERNAL_KEEP_CLIENT`, what
//! `externalTrafficPolicy: Local` asks for): its flows' packets reach the
//! server with the client's own address and port, only the destination
//! translated; the server's replies, which pass through the node, leave
//! from the VIP. A client that claims the node's own address is refused,
//! and a server's packet to a client of no flow is not translated.

use std::net::SocketAddr;

use aya::maps::{Array, HashMap};
use lb_common::{EXTERNAL_KEEP_CLIENT, Endpoint, Reason, maps, vip_port_bit};
use lb_tests::packets::{Flags, Segment, read_frame};
use lb_tests::privileged_test;

use lb_tests::xdp_node::*;

/// Makes `f`'s VIP keep its clients' addresses, as the daemon writes it:
/// the flag in `EXTERNAL`, the servers' port in `VIP_PORTS`, a new epoch.
fn keep_clients(node: &mut Node, f: &Family) {
    let mut external: HashMap<_, Endpoint, u32> =
        HashMap::try_from(node.ebpf.map_mut(maps::EXTERNAL).unwrap()).unwrap();
    external.insert(Endpoint::from(f.vip), EXTERNAL_KEEP_CLIENT, 0).unwrap();
    let mut ports: Array<_, u64> =
        Array::try_from(node.ebpf.map_mut(maps::VIP_PORTS).unwrap()).unwrap();
    let (word, bit) = vip_port_bit(f.servers[0].port());
    let had = ports.get(&word, 0).unwrap();
    ports.set(word, had | bit, 0).unwrap();
    node.new_epoch();
}

/// The client's `flags` segment sent to the VIP: checks that it reaches a
/// server from the client's own address and port; the frame as it left.
fn reaches_server(node: &Node, f: &Family, client: SocketAddr, flags: Flags, seq: u32) -> Segment {
    let sent = Segment::tcp((EXT_MAC, CLIENT_MAC), client, f.vip, flags, seq, 0);
    let (verdict, out) = node.run(&sent.frame(), None);
    assert_eq!(verdict, XDP_REDIRECT, "the client's {flags:?} was not forwarded");
    let out = read_frame(&out).expect("the forwarded frame");
    assert!(f.servers.contains(&out.dst), "forwarded to {}, not a server", out.dst);
    assert_eq!(out.src, client, "the server does not see the client's own address and port");
    assert_eq!(out.macs, (server_mac(out.dst), SRV_MAC), "link layer of the forwarded frame");
    assert_eq!(out.ttl, 63);
    out
}

/// The server's `flags` segment to the client, arriving on `srv0`:
/// checks that it leaves from the VIP to the client, back the way the
/// client's packets came.
fn reaches_client(node: &Node, f: &Family, to: &Segment, flags: Flags) {
    let reply = from_server(to, flags);
    assert_eq!(reply.dst, to.src, "a reply to the client's own address");
    let (verdict, out) = node.run(&reply.frame(), Some(node.srv0));
    assert_eq!(verdict, XDP_REDIRECT, "the server's {flags:?} was not sent back");
    let out = read_frame(&out).expect("the translated reply");
    assert_eq!((out.src, out.dst), (f.vip, to.src), "the reply's addresses");
    assert_eq!(out.macs, (CLIENT_MAC, EXT_MAC), "the reply's link layer");
}

#[privileged_test]
fn a_vip_that_keeps_the_client_translates_only_the_destination_and_the_replies_back() {
    both_families(|node, f| {
        keep_clients(node, f);
        let syn = reaches_server(node, f, f.client, Flags::SYN, 1_000);
        // The server answers the client's own address: the node, its
        // gateway, sends it on from the VIP.
        reaches_client(node, f, &syn, Flags::SYN_ACK);
        let promoted = node.counter(Reason::XdpPromoted);
        let ack = Segment::tcp((EXT_MAC, CLIENT_MAC), f.client, f.vip, Flags::ACK, 1_001, 7_001);
        assert_eq!(node.run(&ack.frame(), None).0, XDP_REDIRECT, "the client's ACK");
        assert_eq!(node.counter(Reason::XdpPromoted), promoted + 1, "the flow is not established");
        // Established: the same both ways, the short way included.
        for _ in 0..3 {
            let data = reaches_server(node, f, f.client, Flags::ACK, 1_001);
            assert_eq!(data.dst, syn.dst, "the flow moved");
            reaches_client(node, f, &data, Flags::ACK);
        }
        // Another client port is another flow, with its own port kept.
        let other = SocketAddr::new(f.client.ip(), f.client.port() + 1);
        let second = reaches_server(node, f, other, Flags::SYN, 5_000);
        reaches_client(node, f, &second, Flags::SYN_ACK);
    });
}

#[privileged_test]
fn a_client_claiming_the_nodes_own_address_is_refused() {
    both_families(|node, f| {
        keep_clients(node, f);
        let forged = SocketAddr::new(f.node, 61_000);
        let refused = node.counter(Reason::XdpClientIsNode);
        let syn = Segment::tcp((EXT_MAC, CLIENT_MAC), forged, f.vip, Flags::SYN, 1, 0);
        assert_eq!(node.run(&syn.frame(), None).0, XDP_DROP);
        assert_eq!(node.counter(Reason::XdpClientIsNode), refused + 1);
        assert_eq!(node.nat_entries(), 0, "a forged client holds a port");
    });
}

#[privileged_test]
fn a_servers_packet_to_a_client_of_no_flow_is_not_translated() {
    both_families(|node, f| {
        keep_clients(node, f);
        let stray = Segment::tcp(
            (SRV_MAC, server_mac(f.servers[0])),
            f.servers[0],
            f.client,
            Flags::ACK,
            1,
            1,
        );
        let (verdict, out) = node.run(&stray.frame(), Some(node.srv0));
        assert_ne!(verdict, XDP_REDIRECT, "a reply of no flow was sent on");
        if let Ok(out) = read_frame(&out) {
            assert_eq!(out.src, f.servers[0], "a reply of no flow was translated");
        }
    });
}

#[privileged_test]
fn a_flow_moves_when_its_vip_stops_keeping_the_client() {
    both_families(|node, f| {
        keep_clients(node, f);
        let syn = reaches_server(node, f, f.client, Flags::SYN, 1_000);
        assert_eq!(syn.src, f.client);
        // The policy changes (Local → Cluster): the flow, opened keeping
        // the client's address, is not followed half one way, half the
        // other. Its next SYN is a new flow, with a NAT port.
        node.serve(f, &f.servers);
        let again = forwarded(node, f, f.client, 2_000);
        assert_eq!(again.src.ip(), f.node, "the new flow is translated both ways");
    });
}
