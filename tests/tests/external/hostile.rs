//! A client that sends what it likes: raw frames from the client's
//! namespace (`lb_tests::raw`), which no socket API would send.

use std::{
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use lb_tests::{
    Daemon, TestCgroup, in_new_netns,
    packets::{Flags, Mac, Segment},
    privileged_test, raw,
    topology::{Topology, VIP4, carries_data, mac_of, who},
    wait_until,
};

use crate::services;

/// Once the VIP serves s1: five connections held through it (each asked
/// `who` once), and the link-layer addresses of a client's frame to the
/// node (the node's ext0, the client's c0).
fn hold_connections(net: &Topology, daemon: &Daemon) -> (Vec<TcpStream>, (Mac, Mac)) {
    assert!(
        wait_until(Duration::from_secs(10), || net.ask(VIP4).as_deref() == Ok("s1")),
        "{}",
        daemon.log()
    );
    let held: Vec<_> =
        (0..5).map(|_| net.connect(VIP4).expect("a connection through the VIP")).collect();
    for stream in &held {
        assert_eq!(who(stream).as_deref(), Ok("s1"));
    }
    let macs = (raw::parse_mac(&mac_of("ext0")), net.client.run(|| raw::parse_mac(&mac_of("c0"))));
    (held, macs)
}

/// SYN|FIN and SYNs with a bad checksum, each sent again 1.2 s later as a
/// client's unanswered SYN would be: no server answers them, and none is
/// failed for it (a client's packet counts towards a failure only as a
/// well-formed SYN), so connections held through the VIP to that server
/// carry data afterwards, new ones still reach it, and the counters name
/// what was refused.
#[privileged_test]
fn malformed_syns_sent_again_fail_no_server() {
    in_new_netns(|| {
        let net = Topology::new();
        let (_s1, _s2) = (net.server("s1", "198.18.2.2:8080"), net.server("s2", "198.18.2.3:8080"));
        let cgroup = TestCgroup::new("ext-raw");
        let daemon = Daemon::start_with("ext-raw", &cgroup, "", &services("tcp"));
        let (held, macs) = hold_connections(&net, &daemon);
        let vip: SocketAddr = VIP4.parse().unwrap();
        let mut syn_fin =
            Segment::tcp(macs, "198.18.0.10:40100".parse().unwrap(), vip, Flags::SYN, 1_000, 0);
        syn_fin.tcp.as_mut().unwrap().flags.fin = true;
        let mut bad_checksum =
            Segment::tcp(macs, "198.18.0.10:40101".parse().unwrap(), vip, Flags::SYN, 2_000, 0)
                .frame();
        // The TCP checksum: after Ethernet (14), IPv4 (20) and 16 bytes of TCP.
        bad_checksum[14 + 20 + 16] ^= 0xff;
        let frames = vec![syn_fin.frame(), bad_checksum];
        for round in 0..3 {
            if round > 0 {
                std::thread::sleep(Duration::from_millis(1_200));
            }
            let frames = frames.clone();
            net.client.run(move || raw::send("c0", &frames));
        }
        std::thread::sleep(Duration::from_millis(500));

        let status = daemon.status();
        let server = &status["services"][0]["servers"][0];
        assert_eq!(
            (server["address"].as_str(), server["state"].as_str()),
            (Some("198.18.2.2:8080"), Some("active")),
            "a server was failed: {status}"
        );
        assert!(daemon.counter("xdp_no_flow") >= 3, "the SYN|FINs: {status}");
        assert!(daemon.counter("xdp_syn_malformed") >= 2, "the bad SYNs sent again: {status}");
        assert_eq!(daemon.counter("xdp_syn_retransmitted"), 0, "{status}");
        assert_eq!(net.ask(VIP4).as_deref(), Ok("s1"), "new connections moved");
        for stream in &held {
            assert_eq!(carries_data(stream), Ok(()), "a held connection broke");
        }
    });
}

/// A flood of SYNs from forged addresses, three times as many new flows
/// as the flow tables hold (4,096 here) at 2,000 a second, below what the
/// NAT ports absorb (4,536 per server, a half-open flow's port free
/// after 1 s when they run short): every legitimate connect made during
/// it reaches a server, and connections held through the VIP, idle
/// meanwhile, carry data afterwards: the flood evicted no established
/// flow.
#[privileged_test]
fn a_forged_syn_flood_refuses_no_client_and_evicts_no_held_connection() {
    in_new_netns(|| {
        let net = Topology::new();
        let (_s1, _s2) = (net.server("s1", "198.18.2.2:8080"), net.server("s2", "198.18.2.3:8080"));
        let cgroup = TestCgroup::new("ext-flood");
        let daemon =
            Daemon::start_with("ext-flood", &cgroup, "flow_table = 4096", &services("tcp"));
        let (held, macs) = hold_connections(&net, &daemon);
        let vip: SocketAddr = VIP4.parse().unwrap();
        let flood: Vec<Vec<u8>> = (0..3 * 4096u32)
            .map(|i| {
                let forged = SocketAddr::from((
                    [198, 19, (i >> 8) as u8, i as u8],
                    1_024 + (i % 50_000) as u16,
                ));
                Segment::tcp(macs, forged, vip, Flags::SYN, i, 0).frame()
            })
            .collect();
        let mut refused = Vec::new();
        let started = std::time::Instant::now();
        for (k, burst) in flood.chunks(200).enumerate() {
            // 200 every 100 ms: 2,000 a second.
            let due = Duration::from_millis(100 * k as u64);
            std::thread::sleep(due.saturating_sub(started.elapsed()));
            let burst = burst.to_vec();
            net.client.run(move || raw::send("c0", &burst));
            if k % 5 == 0 {
                match net.ask(VIP4) {
                    Ok(name) if name == "s1" || name == "s2" => {}
                    other => refused.push(format!("after burst {k}: {other:?}")),
                }
            }
        }
        let status = daemon.status();
        assert!(
            refused.is_empty(),
            "legitimate connects refused during the flood: {refused:?}\n{status}"
        );
        assert!(
            daemon.counter("xdp_new_flow") >= 3 * 4096,
            "the flood did not reach the program: {status}"
        );
        for stream in &held {
            assert_eq!(carries_data(stream), Ok(()), "a held connection broke in the flood");
        }
    });
}
