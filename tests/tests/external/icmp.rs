//! ICMP end to end: what the network says about a flow reaches the end that
//! must hear it, through the node.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::Duration,
};

use lb_tests::{
    Daemon, TestCgroup, in_new_netns, privileged_test,
    topology::{Topology, VIP4, VIP6},
};

use crate::services;

/// ICMP: a datagram to a server with nothing listening on its port draws
/// the server's "port unreachable", which the node translates back: the
/// client's connected socket sees the refusal at once, as it would from the
/// VIP itself, instead of waiting out a timeout.
#[privileged_test]
fn a_servers_port_unreachable_reaches_the_client() {
    in_new_netns(|| {
        // No server runs: the servers' ports are closed.
        let net = Topology::new();
        let cgroup = TestCgroup::new("external-icmp");
        let daemon = Daemon::start("external-icmp", &cgroup, &services("none"));
        for vip in [VIP4, VIP6] {
            let to: SocketAddr = vip.parse().unwrap();
            let answer = net.client.run(move || {
                let any = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
                let socket = UdpSocket::bind(any).unwrap();
                socket.connect(to).unwrap();
                socket.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                socket.send(b"who").unwrap();
                socket.recv(&mut [0u8; 64])
            });
            let refused = answer.as_ref().is_err_and(|e| e.kind() == ErrorKind::ConnectionRefused);
            assert!(refused, "UDP to {vip}: {answer:?}, not refused\n{}", daemon.status());
        }
        assert_eq!(daemon.counter("xdp_icmp_to_client"), 2);
        drop(daemon);
        drop(cgroup);
    });
}

/// The node's own "too big": the node's link toward the servers has a
/// smaller MTU (1400) than the client's and the server's (1500), so neither
/// end's MSS knows of it. The client's full-sized segments draw
/// "fragmentation needed" / "packet too big" from the node, its stack
/// lowers the path MTU to the VIP and sends them again smaller, and every
/// byte arrives. Without the answer the transfer would stall in a black
/// hole.
#[privileged_test]
fn a_smaller_mtu_toward_the_servers_is_learned_by_the_client() {
    if !lb_tests::kernel_at_least(5, 12) {
        eprintln!("SKIPPED: the node's own \"too big\" needs Linux 5.12+ (its FIB says the MTU)");
        return;
    }
    in_new_netns(|| {
        let net = Topology::new();
        lb_tests::sh(&["ip", "link", "set", "srv0", "mtu", "1400"]);
        let cgroup = TestCgroup::new("external-mtu");
        let daemon = Daemon::start("external-mtu", &cgroup, &services("none"));
        for (vip, server) in [(VIP4, "198.18.2.2:8080"), (VIP6, "[2001:2:0:2::2]:8080")] {
            let server: SocketAddr = server.parse().unwrap();
            let listener = net.servers.run(move || TcpListener::bind(server).unwrap());
            // Counts what one connection sends and answers with the count.
            let counter = std::thread::spawn(move || {
                // A connect that never arrives ends the wait, not the test.
                listener.set_nonblocking(true)?;
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                let mut stream = loop {
                    match listener.accept() {
                        Ok((stream, _)) => break stream,
                        Err(e) if std::time::Instant::now() > deadline => return Err(e),
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                };
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let mut received = Vec::new();
                let read = stream.read_to_end(&mut received);
                let _ = stream.write_all(received.len().to_string().as_bytes());
                read.map(|_| received.len())
            });
            let before = daemon.counter("xdp_too_big");
            let to: SocketAddr = vip.parse().unwrap();
            let answer = net.client.run(move || -> std::io::Result<String> {
                let mut stream = TcpStream::connect_timeout(&to, Duration::from_secs(3))?;
                stream.set_write_timeout(Some(Duration::from_secs(10)))?;
                stream.set_read_timeout(Some(Duration::from_secs(10)))?;
                stream.write_all(&[7u8; 256 * 1024])?;
                stream.shutdown(Shutdown::Write)?;
                let mut answer = String::new();
                stream.read_to_string(&mut answer)?;
                Ok(answer)
            });
            let received = counter.join().unwrap();
            assert_eq!(
                answer.as_deref().ok(),
                Some("262144"),
                "{vip}: {answer:?}, the server read {received:?}\n{}",
                daemon.status()
            );
            assert!(daemon.counter("xdp_too_big") > before, "{vip}: no \"too big\" was sent");
        }
        assert_eq!(daemon.counter("xdp_too_big_dropped"), 0);
        drop(daemon);
        drop(cgroup);
    });
}
