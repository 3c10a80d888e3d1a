//! The external path's program time per packet, for `cargo xtask bench`
//! (its `external` part): `lb_xdp` under `BPF_PROG_TEST_RUN` on the packet
//! fixtures' node, beside the bench's reference forwarder
//! (`lb-ebpf/src/bin/reference_forwarder.rs`: the least a NAT forwarder
//! does for a packet of a known flow) and a program that passes every
//! packet, timed in the same run on the same frames. Cases, IPv4 and
//! IPv6: the first packet of a flow (a SYN: a choice, a NAT port, two map
//! inserts), a packet of an established flow, a server's reply, and a
//! packet that is not the VIP's (the floor every other packet of the
//! interface pays). Prints one JSON line. Needs root.
//!
//! How: a program that rewrites what it forwards is timed one run at a
//! time on a fresh copy (`repeat` 1), whose time the kernel measures with
//! a fixed overhead around it. Each sample is three runs back to back:
//! `lb_xdp`, the reference forwarder and the pass-through program, on
//! the same frame; a program's time is the median over the samples of
//! its run less the pass-through's, so that the overhead, and whatever
//! else the machine was doing at that moment, cancels in each sample. A
//! packet that is not ours passes untouched, so it runs 100,000 times on
//! one buffer instead, against the pass-through program run the same way.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{Ebpf, maps::HashMap, programs::Xdp};
use lb_common::{
    Endpoint, FlowKey, Reason,
    reference::{REFERENCE_FLOWS, ReferenceRewrite},
};
use lb_tests::{
    in_new_netns,
    packets::{Flags, Segment, read_frame},
    privileged,
    xdp_node::{
        CLIENT_MAC, EXT_MAC, Family, Node, XDP_REDIRECT, forwarded, from_client, from_server,
        test_run, time_run, v4, v6,
    },
};

/// Single runs per case.
const RUNS: u16 = 3_000;
/// Repeats of the untouched packet.
const REPEAT: u32 = 100_000;
/// `IPPROTO_TCP`.
const TCP: u8 = 6;

/// The median of `values`, in nanoseconds.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    values[values.len() / 2]
}

/// One family's program times, in nanoseconds over the pass-through
/// program's (medians of paired samples), and the untouched packet's
/// average of repeats.
struct Times {
    first: f64,
    established: f64,
    reply: f64,
    not_ours: f64,
    reference_established: f64,
    reference_reply: f64,
    /// The pass-through program's single run, overhead and all.
    pass_single: f64,
}

/// The reference forwarder's object, built beside lb's by lb-user's build
/// script in `target/ebpf/` (this bench runs from `target/<profile>/deps/`).
fn reference_object() -> PathBuf {
    let exe = std::env::current_exe().expect("this bench's path");
    let target = exe.ancestors().nth(3).expect("the bench runs from target/<profile>/deps");
    target.join("ebpf").join("reference_forwarder")
}

fn load_reference(path: &Path) -> Ebpf {
    let mut ebpf = Ebpf::load_file(path).unwrap_or_else(|e| {
        panic!("loading {} (built with lb's eBPF object): {e}", path.display())
    });
    for name in ["reference_nat", "reference_pass"] {
        let program: &mut Xdp = ebpf.program_mut(name).unwrap().try_into().unwrap();
        program.load().unwrap_or_else(|e| panic!("loading {name}: {e}"));
    }
    ebpf
}

/// The reference object's program `name`'s time per run on `frame`
/// arriving on `ingress`, run `repeat` times on one buffer.
fn time(ebpf: &Ebpf, name: &str, frame: &[u8], repeat: u32, ingress: Option<u32>) -> Duration {
    time_run(ebpf.program(name).unwrap().try_into().unwrap(), frame, repeat, ingress)
}

/// Tells the reference forwarder that `packet` leaves as `leaves` does.
fn reference_flow(ebpf: &mut Ebpf, packet: &Segment, leaves: &Segment) {
    let mut flows: HashMap<_, FlowKey, ReferenceRewrite> =
        HashMap::try_from(ebpf.map_mut(REFERENCE_FLOWS).unwrap()).unwrap();
    let key = FlowKey {
        client: Endpoint::from(packet.src),
        vip: Endpoint::from(packet.dst),
        protocol: TCP,
        _pad: [0; 3],
    };
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(&leaves.macs.0);
    macs[6..].copy_from_slice(&leaves.macs.1);
    let rewrite = ReferenceRewrite {
        src: Endpoint::from(leaves.src),
        dst: Endpoint::from(leaves.dst),
        ifindex: 1,
        macs,
    };
    flows.insert(key, rewrite, 0).unwrap();
}

/// Checks that the reference forwarder turns `packet` into `leaves`, as
/// lb did: the yardstick does the same work.
fn assert_same_output(ebpf: &Ebpf, packet: &Segment, leaves: &Segment) {
    let program: &Xdp = ebpf.program("reference_nat").unwrap().try_into().unwrap();
    let ran = test_run(program, &packet.frame(), 1, None).expect("BPF_PROG_TEST_RUN");
    assert_eq!(ran.verdict, XDP_REDIRECT, "the reference forwarder did not redirect");
    assert_eq!(ran.frame, leaves.frame(), "the reference forwarder's frame differs from lb_xdp's");
}

/// The case's frame, as `lb_xdp` leaves it (it must redirect it).
fn lb_output(node: &Node, frame: &[u8], ingress: Option<u32>) -> Segment {
    let (verdict, out) = node.run(frame, ingress);
    assert_eq!(verdict, XDP_REDIRECT, "lb_xdp did not forward the bench's packet");
    read_frame(&out).expect("the frame lb_xdp sent")
}

/// `RUNS` samples of `lb_xdp` on the frames `lb` gives, each beside the
/// reference forwarder on `yardstick` and the pass-through program:
/// the medians of `lb_xdp`'s and the reference's runs less the
/// pass-through's, and of the pass-through's own.
fn paired(
    node: &Node,
    reference: &Ebpf,
    lb: impl Fn(u16) -> Vec<u8>,
    yardstick: &[u8],
    ingress: Option<u32>,
) -> (f64, f64, f64) {
    let ns = |d: Duration| d.as_secs_f64() * 1e9;
    let (mut lb_ns, mut reference_ns, mut pass_ns) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..RUNS {
        let frame = lb(i);
        let lb_run = ns(node.time(&frame, 1, ingress));
        let reference_run = ns(time(reference, "reference_nat", yardstick, 1, ingress));
        let pass = ns(time(reference, "reference_pass", yardstick, 1, ingress));
        lb_ns.push(lb_run - pass);
        reference_ns.push(reference_run - pass);
        pass_ns.push(pass);
    }
    (median(lb_ns), median(reference_ns), median(pass_ns))
}

fn family(node: &mut Node, reference: &mut Ebpf, f: &Family) -> Times {
    node.serve(f, &f.servers);
    // A whole handshake: the flow moves to the established tables.
    let out = forwarded(node, f, f.client, 1);
    let from_servers = Some(node.srv0);
    let syn_ack = from_server(&out, Flags::SYN_ACK);
    lb_output(node, &syn_ack.frame(), from_servers);
    let server_seq = syn_ack.tcp.unwrap().seq;
    let ack = Segment::tcp((EXT_MAC, CLIENT_MAC), f.client, f.vip, Flags::ACK, 2, server_seq + 1);
    let promoted = node.counter(Reason::XdpPromoted);
    let ack_out = lb_output(node, &ack.frame(), None);
    assert_eq!(node.counter(Reason::XdpPromoted), promoted + 1, "the flow is not established");
    // The server's next segment; replies count only where the flow's
    // packets to the server leave.
    let answer =
        Segment::tcp(syn_ack.macs, syn_ack.src, syn_ack.dst, Flags::ACK, server_seq + 1, 2);
    let answer_out = lb_output(node, &answer.frame(), from_servers);
    reference_flow(reference, &ack, &ack_out);
    reference_flow(reference, &answer, &answer_out);
    assert_same_output(reference, &ack, &ack_out);
    assert_same_output(reference, &answer, &answer_out);

    let (ack, answer) = (ack.frame(), answer.frame());
    let syn = |i: u16| {
        let client = SocketAddr::new(f.client.ip(), 20_000 + i);
        from_client(f, client, Flags::SYN, 1).frame()
    };
    let (first, _, _) = paired(node, reference, syn, &ack, None);
    let (established, reference_established, pass_single) =
        paired(node, reference, |_| ack.clone(), &ack, None);
    let (reply, reference_reply, _) =
        paired(node, reference, |_| answer.clone(), &answer, from_servers);
    let mut stray = from_client(f, f.client, Flags::ACK, 2);
    stray.dst = SocketAddr::new(f.node, 22);
    let not_ours = node.time(&stray.frame(), REPEAT, None).as_secs_f64() * 1e9;
    Times {
        first,
        established,
        reply,
        not_ours,
        reference_established,
        reference_reply,
        pass_single,
    }
}

fn main() {
    if !privileged() {
        return;
    }
    let object = reference_object();
    let (families, pass) = in_new_netns(move || {
        let mut node = Node::new();
        let mut reference = load_reference(&object);
        let families = [v4(), v6()].map(|f| family(&mut node, &mut reference, &f));
        let stray = from_client(&v4(), v4().client, Flags::ACK, 2).frame();
        let pass = time(&reference, "reference_pass", &stray, REPEAT, None).as_secs_f64() * 1e9;
        (families, pass)
    });
    let json = |t: &Times| {
        serde_json::json!({
            "first_ns": t.first.round(),
            "established_ns": t.established.round(),
            "reply_ns": t.reply.round(),
            "not_ours_ns": t.not_ours.round(),
            "reference_established_ns": t.reference_established.round(),
            "reference_reply_ns": t.reference_reply.round(),
        })
    };
    let out = serde_json::json!({
        "runs": RUNS,
        "overhead_ns": families[0].pass_single.round(),
        "pass_ns": pass.round(),
        "ipv4": json(&families[0]),
        "ipv6": json(&families[1]),
    });
    println!("{out}");
}
