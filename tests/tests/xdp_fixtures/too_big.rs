//! The node's own "too big": a client's packet larger than the MTU of the
//! route toward its server is answered, back the way it came, with
//! "fragmentation needed" / "packet too big" from the VIP, carrying that
//! MTU and quoting the packet as the client sent it.

use lb_common::{Reason, checksum};
use lb_tests::packets::{Flags, read_icmp_error};
use lb_tests::privileged_test;

use lb_tests::xdp_node::*;

/// The MTU of the node's link toward the servers in these cases.
const SERVERS_MTU: u16 = 1400;

/// Whether this kernel's FIB says the MTU of a route a packet exceeds
/// (Linux 5.12+); before, the program cannot answer and drops the packet.
fn fib_says_the_mtu() -> bool {
    lb_tests::kernel_at_least(5, 12)
}

/// A segment of `payload` bytes after the SYN of the client's flow.
fn big_segment(f: &Family, payload: usize) -> Vec<u8> {
    let mut segment = from_client(f, f.client, Flags::ACK, 2);
    segment.payload = vec![7; payload];
    segment.frame()
}

#[privileged_test]
fn a_packet_too_big_for_the_route_to_its_server_is_answered() {
    both_families(|node, f| {
        sh(&["ip", "link", "set", "srv0", "mtu", &SERVERS_MTU.to_string()]);
        forwarded(node, f, f.client, 1);
        // Exactly the MTU still goes.
        let ip_header = if f.vip.is_ipv4() { 20 } else { 40 };
        let fits = usize::from(SERVERS_MTU) - ip_header - 20;
        assert_eq!(node.run(&big_segment(f, fits), None).0, XDP_REDIRECT, "a packet of the MTU");

        let frame = big_segment(f, fits + 1);
        let (verdict, answer) = node.run(&frame, None);
        if !fib_says_the_mtu() {
            assert_eq!(verdict, XDP_DROP);
            assert_eq!(node.counter(Reason::XdpTooBigDropped), 1);
            return;
        }
        assert_eq!(verdict, XDP_TX, "the packet too big was not answered");
        let error = read_icmp_error(&answer).expect("the node's own error");
        assert_eq!(error.macs, (CLIENT_MAC, EXT_MAC), "back to the MAC it came from");
        assert_eq!((error.src, error.dst), (f.vip.ip(), f.client.ip()), "from the VIP");
        let mtu = u32::from(SERVERS_MTU).to_be_bytes();
        let (kind, code) = if f.vip.is_ipv4() { (3, 4) } else { (2, 0) };
        let rest = if f.vip.is_ipv4() { [0, 0, mtu[2], mtu[3]] } else { mtu };
        assert_eq!((error.kind, error.code, error.rest), (kind, code, rest));
        // The packet as the client sent it: its IP header and 64 bytes.
        assert_eq!(error.quote, frame[14..14 + ip_header + 64], "the quote");
        assert_eq!(node.counter(Reason::XdpTooBig), 1);
        assert_eq!(node.counter(Reason::XdpNoRoute), 0);
    });
}

/// An IPv4 packet that allows fragmenting is one a router would fragment;
/// XDP cannot, and it is not answered either.
#[privileged_test]
fn an_ipv4_packet_that_may_be_fragmented_is_dropped_unanswered() {
    both_families(|node, f| {
        if !f.vip.is_ipv4() {
            return;
        }
        sh(&["ip", "link", "set", "srv0", "mtu", &SERVERS_MTU.to_string()]);
        forwarded(node, f, f.client, 1);
        let mut frame = big_segment(f, usize::from(SERVERS_MTU));
        // Clear DF (the flags word, bytes 6-7 of the IPv4 header), with
        // the header checksum updated.
        let word = |frame: &[u8], at: usize| u16::from_ne_bytes([frame[at], frame[at + 1]]);
        let flags = word(&frame, 14 + 6);
        let cleared = flags & !0x40u16.to_be() & !0x4000u16.to_be();
        let check = checksum::replace16(word(&frame, 14 + 10), flags, cleared);
        frame[14 + 6..14 + 8].copy_from_slice(&cleared.to_ne_bytes());
        frame[14 + 10..14 + 12].copy_from_slice(&check.to_ne_bytes());
        assert_eq!(node.run(&frame, None).0, XDP_DROP);
        assert_eq!(node.counter(Reason::XdpTooBigDropped), 1);
        assert_eq!(node.counter(Reason::XdpTooBig), 0);
    });
}
