//! NAT ports: a flow's end is noted in its `NAT_REPLIES` entry, and a new
//! flow that finds no free port takes one whose flow has ended long enough
//! ago (`lb_common::nat`), the old flow's `FLOWS` entry going with it.

use std::{net::SocketAddr, time::Duration};

use aya::maps::HashMap;
use lb_common::{
    Endpoint, Flow, FlowKey, NAT_PORT_COUNT, NAT_PORT_FIRST, NAT_REPLY_ESTABLISHED, NAT_REPLY_SYN,
    NatKey, NatReply, Reason, maps,
    nat::{
        self, NAT_REPLY_CLIENT_ACKED, NAT_REPLY_CLIENT_FIN, NAT_REPLY_RESET,
        NAT_REPLY_SERVER_CLOSED_FIRST, NAT_REPLY_SERVER_FIN,
    },
};
use lb_tests::packets::{Flags, read_frame};
use lb_tests::privileged_test;

use lb_tests::xdp_node::*;

/// The NAT key of the forwarded segment `out`'s flow.
fn key_of(out: &lb_tests::packets::Segment) -> NatKey {
    NatKey {
        server: Endpoint::from(out.dst),
        node: Endpoint::from(out.src),
        protocol: 6,
        _pad: [0; 3],
    }
}

/// The `FLOWS` key of `client`'s TCP flow to `f`'s VIP.
fn tcp_flow(client: Endpoint, f: &Family) -> FlowKey {
    FlowKey { client, vip: Endpoint::from(f.vip), protocol: 6, _pad: [0; 3] }
}

/// Every NAT port toward `f`'s first server but `except` taken by a flow
/// of its own (client port = NAT port) whose entry has `flags`, with its
/// `FLOWS` entry. The entries are stamped as the `NAT_REPLIES` writes
/// begin, the `FLOWS` ones written before: returns that tick.
fn take_every_port(node: &mut Node, f: &Family, except: u16, flags: u32) -> u32 {
    let server = Endpoint::from(f.servers[0]);
    let mut entries: Vec<(NatKey, NatReply, FlowKey, Flow)> = Vec::new();
    for port in NAT_PORT_FIRST..=NAT_PORT_FIRST + (NAT_PORT_COUNT - 1) {
        if port == except {
            continue;
        }
        let client = Endpoint::from(SocketAddr::new(f.client.ip(), port));
        let node_end = Endpoint::from(SocketAddr::new(f.node, port));
        let key = NatKey { server, node: node_end, protocol: 6, _pad: [0; 3] };
        let reply = NatReply { client, vip: Endpoint::from(f.vip), flags, ..NatReply::default() };
        entries.push((
            key,
            reply,
            tcp_flow(client, f),
            Flow { server, node: node_end, syn_at_ns: 0 },
        ));
    }
    let mut flows: HashMap<_, FlowKey, Flow> =
        HashMap::try_from(node.ebpf.map_mut(maps::FLOWS).unwrap()).unwrap();
    for (_, _, key, flow) in &entries {
        flows.insert(key, flow, 0).unwrap();
    }
    let now = nat::tick(monotonic_ns());
    let mut replies: HashMap<_, NatKey, NatReply> =
        HashMap::try_from(node.ebpf.map_mut(maps::NAT_REPLIES).unwrap()).unwrap();
    for (key, reply, _, _) in &mut entries {
        reply.flags = nat::stamp(flags, now);
        replies.insert(*key, *reply, 0).unwrap();
    }
    now
}

/// SYNs of `count` new flows from the client's ports 30000 on, each
/// forwarded: what left.
fn syns_forwarded(node: &Node, f: &Family, count: u16) -> Vec<lb_tests::packets::Segment> {
    (0..count)
        .map(|i| {
            let client = SocketAddr::new(f.client.ip(), 30_000 + i);
            let (verdict, out) = node.run(&from_client(f, client, Flags::SYN, 1).frame(), None);
            assert_eq!(verdict, XDP_REDIRECT, "the SYN was not forwarded");
            read_frame(&out).expect("the forwarded SYN")
        })
        .collect()
}

/// Ticks (`nat::tick`) from `since` to now, on the ticks' wrapping clock
/// (`nat::tick(u64::MAX)` is its mask).
fn ticks_since(since: u32) -> u32 {
    nat::tick(monotonic_ns()).wrapping_sub(since) & nat::tick(u64::MAX)
}

/// Removes `key`'s `FLOWS` entry, if any.
fn forget_flow(node: &mut Node, key: &FlowKey) {
    let mut flows: HashMap<_, FlowKey, Flow> =
        HashMap::try_from(node.ebpf.map_mut(maps::FLOWS).unwrap()).unwrap();
    let _ = flows.remove(key);
}

fn has_flow(node: &Node, key: &FlowKey) -> bool {
    let flows: HashMap<_, FlowKey, Flow> =
        HashMap::try_from(node.ebpf.map(maps::FLOWS).unwrap()).unwrap();
    flows.get(key, 0).is_ok()
}

#[privileged_test]
fn the_end_of_a_flow_is_noted_in_its_nat_entry() {
    both_families(|node, f| {
        // Closed by the client first: its FIN, then the server's.
        let out = forwarded(node, f, f.client, 1);
        let server = |flags| node.run(&from_server(&out, flags).frame(), Some(node.srv0)).0;
        assert_eq!(server(Flags::SYN_ACK), XDP_REDIRECT);
        let fin = from_client(f, f.client, Flags::FIN_ACK, 2).frame();
        assert_eq!(node.run(&fin, None).0, XDP_REDIRECT);
        assert_eq!(server(Flags::FIN_ACK), XDP_REDIRECT);
        let flags = node.nat_entry(&key_of(&out)).expect("the flow's NAT entry").flags;
        assert_ne!(flags & NAT_REPLY_CLIENT_ACKED, 0, "the handshake was not noted: {flags:#x}");
        let ends = NAT_REPLY_CLIENT_FIN | NAT_REPLY_SERVER_FIN | NAT_REPLY_SERVER_CLOSED_FIRST;
        assert_eq!(flags & ends, NAT_REPLY_CLIENT_FIN | NAT_REPLY_SERVER_FIN, "{flags:#x}");
        let now = nat::tick(monotonic_ns());
        assert!(!nat::reusable(flags, true, now, true), "the port is free at once: {flags:#x}");
        assert!(nat::reusable(flags, true, now + nat::CLOSED_WAIT_TICKS + 2, false), "{flags:#x}");

        // Closed by the server first: it holds TIME_WAIT.
        let client2 = SocketAddr::new(f.client.ip(), 40_002);
        let out = forwarded(node, f, client2, 1);
        let server = |flags| node.run(&from_server(&out, flags).frame(), Some(node.srv0)).0;
        assert_eq!(server(Flags::SYN_ACK), XDP_REDIRECT);
        assert_eq!(server(Flags::FIN_ACK), XDP_REDIRECT);
        let fin = from_client(f, client2, Flags::FIN_ACK, 2).frame();
        assert_eq!(node.run(&fin, None).0, XDP_REDIRECT);
        let flags = node.nat_entry(&key_of(&out)).unwrap().flags;
        assert_ne!(flags & NAT_REPLY_SERVER_CLOSED_FIRST, 0, "{flags:#x}");
        let now = nat::tick(monotonic_ns());
        assert!(!nat::reusable(flags, true, now + nat::CLOSED_WAIT_TICKS + 2, false), "{flags:#x}");

        // Answered, not yet acknowledged: not established (a forged
        // client's flow holds its port 30 s, not 2 h); then reset by the
        // client.
        let client3 = SocketAddr::new(f.client.ip(), 40_003);
        let out = forwarded(node, f, client3, 1);
        assert_eq!(
            node.run(&from_server(&out, Flags::SYN_ACK).frame(), Some(node.srv0)).0,
            XDP_REDIRECT
        );
        let flags = node.nat_entry(&key_of(&out)).unwrap().flags;
        assert_eq!(flags & NAT_REPLY_CLIENT_ACKED, 0, "{flags:#x}");
        let now = nat::tick(monotonic_ns());
        assert!(nat::reusable(flags, true, now + nat::IDLE_TICKS + 2, false), "{flags:#x}");
        let rst = from_client(f, client3, Flags::RST_ACK, 2).frame();
        assert_eq!(node.run(&rst, None).0, XDP_REDIRECT);
        let flags = node.nat_entry(&key_of(&out)).unwrap().flags;
        assert_ne!(flags & NAT_REPLY_RESET, 0, "{flags:#x}");
        assert_ne!(flags & NAT_REPLY_ESTABLISHED, 0, "{flags:#x}");
    });
}

#[privileged_test]
fn a_new_flow_takes_the_port_of_an_ended_one_when_none_is_free() {
    both_families(|node, f| {
        // Every port toward the first server held by a flow reset just now.
        // Filling 4,535 entries can outlast the reset ports' wait (67 ms)
        // on a slow machine (a 5.10 VM did): the first ports written are
        // free again when the SYN comes, and its verdict says nothing. So
        // the SYN is judged only if it ran within that wait of the stamps,
        // and the ports are filled again otherwise, a few times at most.
        let client = SocketAddr::new(f.client.ip(), 30_000);
        let syn = from_client(f, client, Flags::SYN, 1).frame();
        let flow = tcp_flow(Endpoint::from(client), f);
        let mut judged = None;
        for _ in 0..5 {
            let before = (
                node.counter(Reason::XdpNatPortsExhausted),
                node.counter(Reason::XdpNatPortReused),
            );
            let stamped = take_every_port(node, f, 0, NAT_REPLY_ESTABLISHED | NAT_REPLY_RESET);
            let verdict = node.run(&syn, None).0;
            if ticks_since(stamped) < nat::CLOSED_WAIT_TICKS {
                judged = Some((verdict, before));
                break;
            }
            forget_flow(node, &flow);
        }
        let Some((verdict, (exhausted, reused))) = judged else {
            panic!(
                "filling the NAT ports took longer than {} ms five times",
                nat::CLOSED_WAIT_TICKS
            )
        };
        assert_eq!(verdict, XDP_DROP, "a port was taken too soon");
        assert_eq!(node.counter(Reason::XdpNatPortsExhausted), exhausted + 1);
        assert_eq!(node.counter(Reason::XdpNatPortReused), reused);

        // A second later, they may go: the SYN takes one.
        node.age_nat(Duration::from_secs(1));
        let (verdict, out) = node.run(&syn, None);
        assert_eq!(verdict, XDP_REDIRECT, "no ended flow's port was taken");
        let out = read_frame(&out).expect("the forwarded SYN");
        assert_eq!(out.dst, f.servers[0]);
        assert_eq!(node.counter(Reason::XdpNatPortReused), reused + 1);
        let entry = node.nat_entry(&key_of(&out)).expect("the new flow's NAT entry");
        assert_eq!(entry.client, Endpoint::from(client), "the port still answers the old flow");
        // The old flow (client port = the NAT port) is gone: its next
        // packet is a new flow, never one sharing the port.
        let old = tcp_flow(Endpoint::from(SocketAddr::new(f.client.ip(), out.src.port())), f);
        assert!(!has_flow(node, &old), "the old flow still holds the port");

        // Live flows, idle a second, keep their ports.
        take_every_port(node, f, 0, NAT_REPLY_ESTABLISHED | NAT_REPLY_CLIENT_ACKED);
        node.age_nat(Duration::from_secs(1));
        let syn = from_client(f, SocketAddr::new(f.client.ip(), 30_001), Flags::SYN, 1).frame();
        assert_eq!(node.run(&syn, None).0, XDP_DROP, "a live flow's port was taken");
        assert_eq!(node.counter(Reason::XdpNatPortReused), reused + 1);
    });
}

/// A flood of SYNs from forged addresses, answered by the server and
/// never acknowledged, holds the ports it took a quarter of a second
/// from the server's answer, not a minute: the server's SYN-ACKs sent
/// again do not keep them, and a client's SYN that finds no other port
/// free takes one of them.
#[privileged_test]
fn a_flood_of_half_open_flows_holds_its_ports_a_quarter_second() {
    both_families(|node, f| {
        let stamped = take_every_port(node, f, 0, NAT_REPLY_SYN | NAT_REPLY_ESTABLISHED);
        let client = SocketAddr::new(f.client.ip(), 30_000);
        let syn = from_client(f, client, Flags::SYN, 1).frame();
        let verdict = node.run(&syn, None).0;
        // Judged only if it ran within that time (a slow guest may not).
        if ticks_since(stamped) < nat::ANSWERED_PRESSED_TICKS {
            assert_eq!(verdict, XDP_DROP, "a half-open flow's port was taken at once");
        }

        // The server sends its SYN-ACK again to one of them: no stamp.
        let server = Endpoint::from(f.servers[0]);
        let port = NAT_PORT_FIRST + 7;
        let key = NatKey {
            server,
            node: Endpoint::from(SocketAddr::new(f.node, port)),
            protocol: 6,
            _pad: [0; 3],
        };
        node.age_nat(Duration::from_secs(2));
        let mut entry = node.nat_entry(&key).expect("the flood's entry");
        entry.server_ifindex = node.srv0;
        let mut replies: HashMap<_, NatKey, NatReply> =
            HashMap::try_from(node.ebpf.map_mut(maps::NAT_REPLIES).unwrap()).unwrap();
        replies.insert(key, entry, 0).unwrap();
        let to_forged = SocketAddr::new(f.client.ip(), port);
        let syn_ack = lb_tests::packets::Segment::tcp(
            (SRV_MAC, server_mac(f.servers[0])),
            f.servers[0],
            SocketAddr::new(f.node, port),
            Flags::SYN_ACK,
            7_000,
            2,
        );
        let (verdict, out) = node.run(&syn_ack.frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT, "the server's answer did not reach its client");
        assert_eq!(read_frame(&out).unwrap().dst, to_forged);
        let after = node.nat_entry(&key).expect("the entry");
        assert_eq!(
            after.flags >> 8,
            entry.flags >> 8,
            "the server's SYN-ACK stamped a half-open flow"
        );

        // Two seconds on, a client's SYN takes one of their ports.
        let reused = node.counter(Reason::XdpNatPortReused);
        let (verdict, out) = node.run(&syn, None);
        assert_eq!(verdict, XDP_REDIRECT, "no half-open flow's port was taken");
        assert_eq!(node.counter(Reason::XdpNatPortReused), reused + 1);
        let out = read_frame(&out).expect("the forwarded SYN");
        let entry = node.nat_entry(&key_of(&out)).expect("the new flow's NAT entry");
        assert_eq!(entry.client, Endpoint::from(client));
    });
}

/// `[daemon] nat_ports`, as the daemon writes it into `LIMITS`: new flows
/// take their ports from the range written, their servers' replies come
/// back through them, and with the default range written back, a
/// packet to one of those ports is no reply (passed untouched, not looked
/// up) though a flow holds it.
#[privileged_test]
fn new_flows_take_their_ports_from_the_range_written() {
    both_families(|node, f| {
        node.set_limit(lb_common::LIMIT_NAT_PORT_FIRST, 40_000);
        node.set_limit(lb_common::LIMIT_NAT_PORT_LAST, 41_023);
        let outs = syns_forwarded(node, f, 32);
        for out in &outs {
            let port = out.src.port();
            assert!((40_000..=41_023).contains(&port), "NAT port {port} outside the range");
        }
        let (verdict, _) =
            node.run(&from_server(&outs[0], Flags::SYN_ACK).frame(), Some(node.srv0));
        assert_eq!(verdict, XDP_REDIRECT, "a reply through a port of the range was not sent back");

        node.set_limit(lb_common::LIMIT_NAT_PORT_FIRST, 0);
        node.set_limit(lb_common::LIMIT_NAT_PORT_LAST, 0);
        let not_ours = node.counter(Reason::XdpNotOurs);
        let reply = from_server(&outs[1], Flags::SYN_ACK).frame();
        assert_eq!(node.run(&reply, Some(node.srv0)), (XDP_PASS, reply), "taken for a reply");
        assert_eq!(node.counter(Reason::XdpNotOurs), not_ours + 1);
    });
}

/// A server with a NAT source address beside the node's own toward it
/// (`[daemon] nat_addresses`; its number in the first entry's port, the
/// address under the server's with port 1): new flows leave from both,
/// each address with its own ports, and a reply to either goes back to
/// its client.
#[privileged_test]
fn new_flows_leave_from_every_nat_source_address() {
    both_families(|node, f| {
        let more: std::net::IpAddr =
            if f.vip.is_ipv4() { "198.18.2.10" } else { "2001:2:0:2::10" }.parse().unwrap();
        // The node's own, as the daemon requires (`nat_addresses::toward`).
        let with_prefix = format!("{more}/{}", if more.is_ipv4() { 24 } else { 64 });
        let mut add = vec!["ip", "addr", "add", &with_prefix, "dev", "srv0"];
        if more.is_ipv6() {
            add.push("nodad");
        }
        lb_tests::sh(&add);
        let at = |ip, port| Endpoint::from(SocketAddr::new(ip, port));
        let mut addresses: HashMap<_, Endpoint, Endpoint> =
            HashMap::try_from(node.ebpf.map_mut(maps::NODE_ADDRESSES).unwrap()).unwrap();
        for server in &f.servers {
            addresses.insert(at(server.ip(), 0), at(f.node, 1), 0).unwrap();
            addresses.insert(at(server.ip(), 1), at(more, 0), 0).unwrap();
        }
        let outs = syns_forwarded(node, f, 48);
        let from = |ip| outs.iter().filter(|out| out.src.ip() == ip).count();
        assert_eq!(from(f.node) + from(more), outs.len(), "a flow left from another address");
        // Each of the 48 from either at even odds: both, but for 2^-47.
        assert!(from(f.node) > 0 && from(more) > 0, "{} and {}", from(f.node), from(more));
        for out in [outs.iter().find(|o| o.src.ip() == more).unwrap(), &outs[0]] {
            let (verdict, back) =
                node.run(&from_server(out, Flags::SYN_ACK).frame(), Some(node.srv0));
            assert_eq!(verdict, XDP_REDIRECT, "a reply to {} was not sent back", out.src);
            assert_eq!(read_frame(&back).unwrap().dst.ip(), f.client.ip());
        }
    });
}
