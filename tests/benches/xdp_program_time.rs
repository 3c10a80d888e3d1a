//! The external path's program time per packet, for `cargo xtask bench`
//! (its `external` part): `lb_xdp` under `BPF_PROG_TEST_RUN` on the packet
//! fixtures' node. Cases: the first packet of a flow (a SYN: a choice, a
//! NAT port, two map inserts), a packet of an established flow, a server's
//! reply, and a packet that is not the VIP's (the floor every other packet
//! of the interface pays). IPv4. Prints one JSON line. Needs root.
//!
//! How: the program rewrites what it forwards, so each forwarded packet
//! is one run on a fresh copy (`repeat` 1), whose time the kernel measures
//! with a fixed overhead around it. A packet that is not ours passes
//! untouched, so it also runs 100,000 times on one buffer, where the
//! overhead spreads to nothing; the difference of its single-run median
//! and that average is the overhead, taken off every single-run median.

use std::{net::SocketAddr, time::Duration};

use lb_tests::{in_new_netns, packets::Flags, privileged};

use lb_tests::xdp_node::{Node, forwarded, from_client, from_server, v4};

/// Single runs per case.
const RUNS: u16 = 3_000;
/// Repeats of the untouched packet.
const REPEAT: u32 = 100_000;

fn median(mut times: Vec<Duration>) -> f64 {
    times.sort_unstable();
    times[times.len() / 2].as_secs_f64() * 1e9
}

fn main() {
    if !privileged() {
        return;
    }
    let ([first, established, reply, not_ours], floor) = in_new_netns(|| {
        let mut node = Node::new();
        let f = v4();
        node.serve(&f, &f.servers);
        let first = (0..RUNS)
            .map(|i| {
                let client = SocketAddr::new(f.client.ip(), 20_000 + i);
                node.time(&from_client(&f, client, Flags::SYN, 1).frame(), 1)
            })
            .collect();
        let out = forwarded(&node, &f, f.client, 1);
        let ack = from_client(&f, f.client, Flags::ACK, 2).frame();
        let established = (0..RUNS).map(|_| node.time(&ack, 1)).collect();
        let answer = from_server(&out, Flags::ACK).frame();
        let reply = (0..RUNS).map(|_| node.time(&answer, 1)).collect();
        let mut stray = from_client(&f, f.client, Flags::ACK, 2);
        stray.dst = SocketAddr::new(f.node, 22);
        let stray = stray.frame();
        let not_ours = (0..RUNS).map(|_| node.time(&stray, 1)).collect();
        let floor = node.time(&stray, REPEAT).as_secs_f64() * 1e9;
        ([first, established, reply, not_ours].map(median), floor)
    });
    let overhead = (not_ours - floor).max(0.0);
    let net = |single: f64| (single - overhead).max(0.0);
    println!(
        "{{\"runs\":{RUNS},\"overhead_ns\":{overhead:.0},\"first_ns\":{:.0},\"established_ns\":{:.0},\"reply_ns\":{:.0},\"not_ours_ns\":{floor:.0}}}",
        net(first),
        net(established),
        net(reply)
    );
}
