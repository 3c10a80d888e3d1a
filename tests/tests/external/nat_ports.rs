//! The node's own connections kept off the NAT ports: a connection the
//! node made from one would have its replies taken for a flow's.

use std::{net::UdpSocket, time::Duration};

use lb_tests::{Daemon, TestCgroup, in_new_netns, privileged_test, topology::Topology, wait_until};

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
