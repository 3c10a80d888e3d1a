//! A client that sends what it likes: raw frames from the client's
//! namespace (`lb_tests::raw`), which no socket API would send.

use std::{
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use lb_common::NAT_PORT_FIRST;
use lb_tests::{
    Daemon, TestCgroup, in_new_netns,
    packets::{Flags, Mac, Segment},
    privileged_test, raw,
    topology::{Topology, VIP4, carries_data, mac_of, who},
};

use crate::services;

/// The two servers behind the VIP, as the tests start them.
const SERVERS: [(&str, &str); 2] = [("s1", "198.18.2.2:8080"), ("s2", "198.18.2.3:8080")];

/// The server the VIP's new connections go to: (name, address).
type Active = (&'static str, SocketAddr);

/// Once the VIP serves: the server that serves it (s1 or s2: the first
/// to pass its health check becomes active, and stays), five connections
/// held through it (each asked `who` once), and the link-layer addresses
/// of a client's frame to the node (the node's ext0, the client's c0).
fn hold_connections(net: &Topology, daemon: &Daemon) -> (Active, Vec<TcpStream>, (Mac, Mac)) {
    assert!(net.wait_serving(VIP4, None), "{}", daemon.log());
    let name = net.ask(VIP4).expect("the VIP's server");
    let (name, addr) = SERVERS
        .into_iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("the VIP answered {name}"));
    let held: Vec<_> =
        (0..5).map(|_| net.connect(VIP4).expect("a connection through the VIP")).collect();
    for stream in &held {
        assert_eq!(who(stream).as_deref(), Ok(name));
    }
    let macs = (raw::parse_mac(&mac_of("ext0")), net.client.run(|| raw::parse_mac(&mac_of("c0"))));
    ((name, addr.parse().unwrap()), held, macs)
}

/// Sends `frames` from the client's c0 in bursts of 200 every 100 ms
/// (2,000 a second), asking the VIP which server answers after every
/// fifth burst; returns what the legitimate client was refused.
fn flood_while_asking(net: &Topology, frames: &[Vec<u8>]) -> Vec<String> {
    let mut refused = Vec::new();
    let started = std::time::Instant::now();
    for (k, burst) in frames.chunks(200).enumerate() {
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
    refused
}

/// SYNs from `count` forged clients (198.19.0.0/16) to the VIP.
fn forged_syns(macs: (Mac, Mac), count: u32) -> Vec<Vec<u8>> {
    let vip: SocketAddr = VIP4.parse().unwrap();
    (0..count)
        .map(|i| {
            let forged =
                SocketAddr::from(([198, 19, (i >> 8) as u8, i as u8], 1_024 + (i % 50_000) as u16));
            Segment::tcp(macs, forged, vip, Flags::SYN, i, 0).frame()
        })
        .collect()
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
        let _servers = SERVERS.map(|(name, addr)| net.server(name, addr));
        let cgroup = TestCgroup::new("ext-raw");
        let daemon = Daemon::start_with("ext-raw", &cgroup, "", &services("tcp"));
        let (active, held, macs) = hold_connections(&net, &daemon);
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
        let servers = status["services"][0]["servers"].as_array().cloned().unwrap_or_default();
        let states: Vec<_> = servers.iter().map(|s| s["state"].as_str()).collect();
        let server = servers.iter().find(|s| s["address"] == active.1.to_string());
        assert_eq!(
            server.and_then(|s| s["state"].as_str()),
            Some("active"),
            "the active server was failed: {status}"
        );
        assert!(!states.contains(&Some("failed")), "a server was failed: {status}");
        assert!(daemon.counter("xdp_no_flow") >= 3, "the SYN|FINs: {status}");
        assert!(daemon.counter("xdp_syn_malformed") >= 2, "the bad SYNs sent again: {status}");
        assert_eq!(daemon.counter("xdp_syn_retransmitted"), 0, "{status}");
        assert_eq!(net.ask(VIP4).as_deref(), Ok(active.0), "new connections moved");
        for stream in &held {
            assert_eq!(carries_data(stream), Ok(()), "a held connection broke");
        }
    });
}

/// A flood of SYNs from forged addresses, three times as many new flows
/// as the flow tables hold (4,096 here) at 2,000 a second, below what the
/// NAT ports absorb (4,536 per server; when they run short, a half-open
/// flow's port is free 250 ms after its server's answer): every
/// legitimate connect made during
/// it reaches a server, and connections held through the VIP, idle
/// meanwhile, carry data afterwards: the flood evicted no established
/// flow.
#[privileged_test]
fn a_forged_syn_flood_refuses_no_client_and_evicts_no_held_connection() {
    in_new_netns(|| {
        let net = Topology::new();
        let _servers = SERVERS.map(|(name, addr)| net.server(name, addr));
        let cgroup = TestCgroup::new("ext-flood");
        let daemon =
            Daemon::start_with("ext-flood", &cgroup, "flow_table = 4096", &services("tcp"));
        let (_, held, macs) = hold_connections(&net, &daemon);
        let flood = forged_syns(macs, 3 * 4096);
        let refused = flood_while_asking(&net, &flood);
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

/// Resets forged from the clients' side as if the server sent them, to
/// every NAT port of the node's address toward it, then a burst of
/// forged SYNs (more flows than one server's NAT ports) and 2,000
/// legitimate connects: a server's packet counts only where the flow's
/// packets to it leave (srv0), so no held connection's port is freed,
/// taken by a new flow or reset, every legitimate connect reaches a
/// server, and `xdp_reply_elsewhere` names the resets dropped.
#[privileged_test]
fn forged_server_resets_to_every_nat_port_free_no_port() {
    in_new_netns(|| {
        let net = Topology::new();
        let _servers = SERVERS.map(|(name, addr)| net.server(name, addr));
        let cgroup = TestCgroup::new("ext-resets");
        let daemon = Daemon::start_with("ext-resets", &cgroup, "", &services("tcp"));
        let ((_, server), held, macs) = hold_connections(&net, &daemon);
        let resets: Vec<Vec<u8>> = (NAT_PORT_FIRST..=u16::MAX)
            .map(|port| {
                let node = SocketAddr::from(([198, 18, 2, 1], port));
                Segment::tcp(macs, server, node, Flags::RST_ACK, u32::from(port), 1).frame()
            })
            .collect();
        let refused = flood_while_asking(&net, &resets);
        assert!(refused.is_empty(), "connects refused among the resets: {refused:?}");
        let status = daemon.status();
        assert!(
            daemon.counter("xdp_reply_elsewhere") >= held.len() as u64,
            "the resets to the held connections' ports were not dropped: {status}"
        );
        let refused = flood_while_asking(&net, &forged_syns(macs, 4_600));
        assert!(refused.is_empty(), "connects refused in the SYN burst: {refused:?}");
        let refused: Vec<String> = net.client.run(|| {
            let vip: SocketAddr = VIP4.parse().unwrap();
            (0..2_000)
                .filter_map(|i| {
                    let answer = TcpStream::connect_timeout(&vip, Duration::from_secs(3))
                        .map_err(|e| e.to_string())
                        .and_then(|stream| who(&stream));
                    match answer {
                        Ok(name) if name == "s1" || name == "s2" => None,
                        other => Some(format!("connect {i}: {other:?}")),
                    }
                })
                .collect()
        });
        assert!(
            refused.is_empty(),
            "{} of 2,000 connects refused: {:?}",
            refused.len(),
            &refused[..refused.len().min(5)]
        );
        for stream in &held {
            assert_eq!(carries_data(stream), Ok(()), "a held connection lost its port");
        }
    });
}
