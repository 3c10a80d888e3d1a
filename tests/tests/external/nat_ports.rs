//! The NAT ports and addresses: the ports kept off the node's own
//! connections (a connection the node made from one would have its
//! replies taken for a flow's), a range set wider, and a second NAT
//! source address.

use std::{net::UdpSocket, time::Duration};

use lb_tests::{
    Daemon, TestCgroup, in_new_netns, privileged_test,
    topology::{Topology, VIP4, who},
    wait_until,
};

use crate::services;

const RESERVED: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";
const EPHEMERAL: &str = "/proc/sys/net/ipv4/ip_local_port_range";

/// With an ephemeral range that reaches into the NAT ports (61000 on),
/// the daemon reserves them (beside what the list held) and says so; the
/// node's own sockets then get ports below 61000 only.
#[privileged_test]
fn the_nat_ports_are_kept_from_the_nodes_own_connections() {
    in_new_netns(|| {
        let _net = Topology::new();
        std::fs::write(EPHEMERAL, "60900 65000").expect("setting the ephemeral range");
        std::fs::write(RESERVED, "8080").expect("reserving a port");
        let cgroup = TestCgroup::new("external-nat-ports");
        let daemon = Daemon::start("external-nat-ports", &cgroup, &services("none"));
        let reserved = || std::fs::read_to_string(RESERVED).unwrap();
        let done = wait_until(Duration::from_secs(5), || reserved().contains("61000-65535"));
        assert!(done, "not reserved: {:?}\n{}", reserved(), daemon.log());
        assert_eq!(reserved().trim(), "8080,61000-65535", "the list lost what it held");
        let warned = wait_until(Duration::from_secs(5), || {
            daemon.log().contains("overlap the external path's NAT ports 61000-65535")
        });
        assert!(warned, "no warning of the overlap\n{}", daemon.log());
        // 60 ports picked by the kernel from 60900-65000: every one below
        // the NAT ports (without the reservation, most would be above).
        let sockets: Vec<UdpSocket> =
            (0..60).map(|_| UdpSocket::bind("0.0.0.0:0").expect("binding")).collect();
        for socket in &sockets {
            let port = socket.local_addr().unwrap().port();
            assert!((60_900..61_000).contains(&port), "the node took NAT port {port}");
        }
        drop(daemon);
        drop(cgroup);
    });
}

/// `[daemon] nat_ports` set wider than the default: the daemon reserves
/// that range, says so in its status, and a connection through the VIP
/// reaches its server from a port inside it (the server's own table
/// says which).
#[privileged_test]
fn a_configured_nat_port_range_is_reserved_and_used() {
    in_new_netns(|| {
        let net = Topology::new();
        let _s1 = net.server("s1", "198.18.2.2:8080");
        std::fs::write(EPHEMERAL, "32768 40000").expect("setting the ephemeral range");
        std::fs::write(RESERVED, "").expect("clearing the reserved ports");
        let cgroup = TestCgroup::new("external-nat-range");
        let daemon = Daemon::start_with(
            "external-nat-range",
            &cgroup,
            "nat_ports = \"50000-65535\"",
            &services("tcp"),
        );
        let reserved = || std::fs::read_to_string(RESERVED).unwrap();
        let done = wait_until(Duration::from_secs(5), || reserved().trim() == "50000-65535");
        assert!(done, "not reserved: {:?}\n{}", reserved(), daemon.log());
        assert!(net.wait_serving(VIP4, None), "the VIP never answered\n{}", daemon.log());
        let held = net.connect(VIP4).expect("a connection through the VIP");
        assert_eq!(who(&held).as_deref(), Ok("s1"));
        // The daemon's health checks come from its ephemeral ports
        // (32768-40000 here): only the others are the VIP's flows.
        let ports: Vec<u16> = net
            .servers
            .run(peers_of_8080)
            .iter()
            .map(std::net::SocketAddrV4::port)
            .filter(|port| *port > 40_000)
            .collect();
        assert!(!ports.is_empty(), "the server holds no connection");
        for port in ports {
            assert!((50_000..=65_535).contains(&port), "the node's NAT port {port} is outside");
        }
        let status = daemon.status();
        assert_eq!(status["datapath"]["external"]["nat_port_capacity"], 15_536, "{status}");
        assert!(!daemon.log().contains("overlap"), "{}", daemon.log());
    });
}

/// `[daemon] nat_addresses`: a second address of the node on the
/// servers' side serves as a NAT source too. Connections through the VIP
/// reach the server from both of the node's addresses, and the daemon
/// says so.
#[privileged_test]
fn a_second_nat_address_is_a_source_too() {
    in_new_netns(|| {
        let net = Topology::new();
        let _s1 = net.server("s1", "198.18.2.2:8080");
        lb_tests::sh(&["ip", "addr", "add", "198.18.2.10/24", "dev", "srv0"]);
        let cgroup = TestCgroup::new("external-nat-addresses");
        let daemon = Daemon::start_with(
            "external-nat-addresses",
            &cgroup,
            "nat_addresses = [\"198.18.2.10\"]",
            &services("tcp"),
        );
        assert!(net.wait_serving(VIP4, None), "the VIP never answered\n{}", daemon.log());
        let held: Vec<_> = (0..24)
            .map(|_| {
                let stream = net.connect(VIP4).expect("a connection through the VIP");
                assert_eq!(who(&stream).as_deref(), Ok("s1"));
                stream
            })
            .collect();
        let sources: std::collections::BTreeSet<std::net::Ipv4Addr> = net
            .servers
            .run(peers_of_8080)
            .into_iter()
            .filter(|peer| peer.port() >= 61_000)
            .map(|peer| *peer.ip())
            .collect();
        let both = ["198.18.2.1".parse().unwrap(), "198.18.2.10".parse().unwrap()].into();
        // Each of 24 connections from either at even odds: both, but for 2^-23.
        assert_eq!(sources, both, "{} held\n{}", held.len(), daemon.log());
        assert!(daemon.log().contains("more NAT source addresses"), "{}", daemon.log());
    });
}

/// The peers of this namespace's established TCP connections to local
/// port 8080, from `/proc/thread-self/net/tcp` (IPv4).
fn peers_of_8080() -> Vec<std::net::SocketAddrV4> {
    // This thread's namespace: /proc/net is the process's.
    let table = std::fs::read_to_string("/proc/thread-self/net/tcp").expect("reading tcp");
    // An address as the kernel prints it: its bytes in memory order,
    // read as a native 32-bit number in hexadecimal.
    let endpoint = |field: &str| {
        let (ip, port) = field.split_once(':')?;
        let ip = u32::from_str_radix(ip, 16).ok()?.to_ne_bytes();
        Some(std::net::SocketAddrV4::new(ip.into(), u16::from_str_radix(port, 16).ok()?))
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local = endpoint(fields.get(1)?)?;
            (fields.get(3) == Some(&"01") && local.port() == 8080)
                .then(|| endpoint(fields.get(2)?))?
        })
        .collect()
}
