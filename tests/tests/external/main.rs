//! The external path end to end: clients in a network namespace of their
//! own reach a VIP through the node, whose daemon attaches `lb_xdp` to the
//! node's interfaces and forwards with NAT to servers in a third namespace.
//! Needs root; see `lb_tests::privileged`.
//!
//! ```text
//!  [client ns] c0 ──── ext0 [node ns: lb run] srv0 ──── s0 [server ns]
//!  198.18.0.10/24      198.18.0.1   198.18.2.1        198.18.2.2, .3 (s1, s2)
//!  2001:2::10/64       2001:2::1    2001:2:0:2::1     2001:2:0:2::2, ::3
//! ```
//!
//! The VIPs (198.18.1.100:80, [2001:2:0:1::100]:80) are routed to the node
//! by the client's routes (`announce = "none"`). A veth that an XDP
//! program redirects into must have NAPI on its peer: c0 and s0 carry
//! `lb_xdp` on empty maps of their own, which passes every packet (on
//! Linux 5.13+ GRO on the peer would do as well; this works from 5.10).

use std::{io::Write as _, time::Duration};

use lb_tests::{
    Daemon, TestCgroup, in_new_netns, privileged_test,
    topology::{
        Topology, VIP4, VIP6, client_neighbour, goes_the_short_way, has_xdp, mac_of, who, xdp_id,
    },
    wait_until,
};

mod fail_closed;
mod hostile;
mod icmp;
mod nat_ports;

fn services(check: &str) -> String {
    services_announced(check, "none")
}

fn services_announced(check: &str, announce: &str) -> String {
    let mut toml = String::new();
    for (name, vip, servers) in [
        ("web4", VIP4, r#"["198.18.2.2:8080", "198.18.2.3:8080"]"#),
        ("web6", VIP6, r#"["[2001:2:0:2::2]:8080", "[2001:2:0:2::3]:8080"]"#),
    ] {
        toml.push_str(&format!(
            "[[service]]\nname = \"{name}\"\nvip = \"{vip}\"\nservers = {servers}\nhold_down = \"60s\"\n\
             [service.health]\ncheck = \"{check}\"\ninterval = \"200ms\"\ntimeout = \"200ms\"\n\
             [service.external]\ninterfaces = [\"ext0\"]\nannounce = \"{announce}\"\n"
        ));
    }
    toml
}

/// TCP and UDP, IPv4 and IPv6, from another machine's namespace to the
/// first server of each VIP, with status and counters saying so;
/// `lb detach` removes every XDP program lb attached.
#[privileged_test]
fn external_clients_reach_the_selected_server() {
    in_new_netns(|| {
        let net = Topology::new();
        let (_s1, _s2) = (net.server("s1", "198.18.2.2:8080"), net.server("s2", "198.18.2.3:8080"));
        let (_s1v6, _s2v6) =
            (net.server("s1", "[2001:2:0:2::2]:8080"), net.server("s2", "[2001:2:0:2::3]:8080"));
        let cgroup = TestCgroup::new("external");
        let daemon = Daemon::start_with(
            "external",
            &cgroup,
            "flow_table = 4096\nnew_flows_per_cpu = 54321",
            &services("tcp"),
        );
        let status = daemon.status();
        // The flow tables are of the size the config asks.
        assert_eq!(status["datapath"]["external"]["flow_capacity"], 4096, "{status}");
        for map in [lb_common::maps::FLOWS, lb_common::maps::NAT_REPLIES] {
            let info = aya::maps::MapInfo::from_pin(daemon.bpffs.join("maps").join(map)).unwrap();
            assert_eq!(info.max_entries(), 4096, "{map}'s size");
        }
        let interfaces = &status["datapath"]["external"]["interfaces"];
        for (name, role) in [("ext0", "clients"), ("srv0", "servers")] {
            let row = interfaces.as_array().unwrap().iter().find(|i| i["name"] == name);
            let row = row.unwrap_or_else(|| panic!("no {name} in {interfaces}\n{}", daemon.log()));
            assert_eq!(
                (row["role"].as_str(), row["mode"].as_str()),
                (Some(role), Some("native")),
                "{row}"
            );
            assert!(has_xdp(name), "no XDP program on {name}");
        }
        // The failure marks' stamps are one map for every program: a mark
        // sock_ops makes (a local connect refused) reaches the external
        // path's flows, which skip `FAILED_AT` while their slot is clear.
        let stamps = aya::maps::MapInfo::from_pin(
            daemon.bpffs.join("maps").join(lb_common::maps::MARKED_AT),
        )
        .expect("the pinned MARKED_AT")
        .id();
        let sock_ops = lb_user::datapath::pinned_program_ids(&daemon.bpffs)
            .unwrap()
            .into_iter()
            .find(|(name, _)| *name == lb_common::programs::SOCK_OPS)
            .expect("a pinned sock_ops link")
            .1;
        for program in [sock_ops, xdp_id("ext0").expect("the XDP program's id")] {
            let info = aya::programs::loaded_programs()
                .filter_map(Result::ok)
                .find(|info| info.id() == program)
                .expect("the program's info");
            let maps = info.map_ids().unwrap().unwrap_or_default();
            assert!(maps.contains(&stamps), "program {program} stamps a MARKED_AT of its own");
        }
        // The new-flow limit went into the XDP program's own LIMITS.
        let info = aya::programs::loaded_programs()
            .filter_map(Result::ok)
            .find(|info| Some(info.id()) == xdp_id("ext0"))
            .expect("the XDP program's info");
        let limits = info
            .map_ids()
            .unwrap()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|id| aya::maps::MapData::from_id(id).ok())
            .find(|map| map.info().is_ok_and(|i| i.name_as_str() == Some(lb_common::maps::LIMITS)))
            .expect("the program's LIMITS map");
        let limits: aya::maps::Array<_, u32> =
            aya::maps::Array::try_from(aya::maps::Map::Array(limits)).unwrap();
        assert_eq!(limits.get(&lb_common::LIMIT_NEW_FLOWS, 0).unwrap(), 54_321);
        // Failover: one server of each service takes every new flow (the
        // first whose check passed), and only it.
        let mut active: Vec<(String, String)> = Vec::new();
        let elected = || {
            let status = daemon.status();
            let found: Vec<(String, String)> = (0..2)
                .filter_map(|i| {
                    let servers = status["services"][i]["servers"].as_array()?;
                    let (j, server) =
                        servers.iter().enumerate().find(|(_, s)| s["state"] == "active")?;
                    Some((format!("s{}", j + 1), server["address"].as_str()?.to_owned()))
                })
                .collect();
            found.len() == 2 && {
                active = found;
                true
            }
        };
        assert!(wait_until(Duration::from_secs(10), elected), "{}", daemon.log());
        for (vip, (name, _)) in [VIP4, VIP6].into_iter().zip(&active) {
            for _ in 0..5 {
                let answer = net.ask(vip);
                assert_eq!(
                    answer.as_deref(),
                    Ok(name.as_str()),
                    "TCP to {vip}\n{}",
                    daemon.status()
                );
            }
            assert_eq!(net.ask_udp(vip).as_deref(), Ok(name.as_str()), "UDP to {vip}");
        }
        // Bursts on a held connection: a segment within a kept route's life
        // of the one before goes the short way, on the verdict the full
        // path left (the daemon wrote `VIP_PORTS`).
        for (vip, (name, _)) in [VIP4, VIP6].into_iter().zip(&active) {
            let held = net.connect(vip).expect("a connection through the VIP");
            assert_eq!(who(&held).as_deref(), Ok(name.as_str()));
            assert!(
                goes_the_short_way(&held, || daemon.counter("xdp_forwarded_short")),
                "no segment to {vip} went the short way\n{}",
                daemon.status()
            );
        }
        let status = daemon.status();
        let external = &status["datapath"]["external"];
        assert!(external["flows"].as_u64().unwrap() >= 12, "{external}");
        // Each TCP connection's client acknowledged its server's answer:
        // established, in the table new flows never evict.
        assert!(external["established_flows"].as_u64().unwrap() >= 10, "{external}");
        assert!(daemon.counter("xdp_promoted") >= 10);
        assert!(external["nat_ports"].as_u64().unwrap() >= 12, "{external}");
        let traffic = external["traffic"].as_array().unwrap();
        let to = |server: &str| {
            traffic.iter().find(|t| t["server"] == server).map(|t| t["packets"].as_u64().unwrap())
        };
        for (_, server) in &active {
            assert!(to(server).unwrap_or(0) >= 5 * 3, "{external}");
        }
        assert_eq!(traffic.len(), 2, "only the active servers got traffic: {external}");
        assert!(daemon.counter("xdp_new_flow") >= 12);
        assert!(daemon.counter("xdp_replied") >= 12);
        assert_eq!(status["services"][0]["external"]["interfaces"][0], "ext0");

        daemon.lb(&["detach"]);
        for dev in ["ext0", "srv0"] {
            assert!(!has_xdp(dev), "lb detach left an XDP program on {dev}");
        }
        drop(daemon);
        drop(cgroup);
    });
}

/// The program forwards only to resolved neighbours and starts no
/// resolution itself: with the servers' neighbour entries flushed (and
/// the routes it kept aged out, after 100 ms at most), a client's SYN is
/// dropped (counted), the daemon has the kernel resolve the next hops at
/// its next sync, and the SYN sent again reaches the same server. The
/// drop was the node's: it fails no server.
#[privileged_test]
fn a_flushed_neighbour_is_resolved_again() {
    in_new_netns(|| {
        let net = Topology::new();
        let (_s1, _s2) = (net.server("s1", "198.18.2.2:8080"), net.server("s2", "198.18.2.3:8080"));
        let (_s1v6, _s2v6) =
            (net.server("s1", "[2001:2:0:2::2]:8080"), net.server("s2", "[2001:2:0:2::3]:8080"));
        let cgroup = TestCgroup::new("external-neigh");
        let daemon = Daemon::start("external-neigh", &cgroup, &services("none"));
        for vip in [VIP4, VIP6] {
            assert_eq!(net.ask(vip).as_deref(), Ok("s1"), "{}", daemon.log());
            lb_tests::sh(&["ip", "neigh", "flush", "dev", "srv0"]);
            std::thread::sleep(Duration::from_millis(150));
            // Again: the daemon may have had them resolved meanwhile.
            lb_tests::sh(&["ip", "neigh", "flush", "dev", "srv0"]);
            let dropped = daemon.counter("xdp_no_route");
            let to: std::net::SocketAddr = vip.parse().unwrap();
            // SYNs go at 0, 1 and 3 s; the daemon syncs every second.
            let stream = net
                .client
                .run(move || std::net::TcpStream::connect_timeout(&to, Duration::from_secs(6)));
            let stream = stream.unwrap_or_else(|e| panic!("{vip}: {e}\n{}", daemon.log()));
            assert_eq!(who(&stream).as_deref(), Ok("s1"), "{vip}: the drop failed the server");
            assert!(
                daemon.counter("xdp_no_route") > dropped,
                "{vip}: no SYN was dropped (the flush did nothing: this tests nothing)"
            );
        }
        assert_eq!(daemon.counter("xdp_syn_retransmitted"), 0);
        drop(daemon);
        drop(cgroup);
    });
}

/// NAT: flows are not removed one by one, yet a server takes far more
/// connections than it has NAT ports (4,536 toward each server): ports of
/// flows that ended go to new ones. 5,000 connects, one after another, each
/// closed by the client, all answered by the one server (a plain one here:
/// `Backend` takes milliseconds per accept).
#[privileged_test]
fn more_connects_than_nat_ports_all_land() {
    in_new_netns(|| {
        let net = Topology::new();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let server = {
            let stop = stop.clone();
            net.servers.spawn(move || serve_in_turn("198.18.2.2:8080", &stop))
        };
        let cgroup = TestCgroup::new("external-nat");
        let config = "[[service]]\nname = \"web4\"\nvip = \"198.18.1.100:80\"\n\
                      servers = [\"198.18.2.2:8080\"]\n[service.external]\ninterfaces = [\"ext0\"]\n";
        let daemon = Daemon::start("external-nat", &cgroup, config);
        let to: std::net::SocketAddr = VIP4.parse().unwrap();
        // Past 20 failures the path is broken: the rest would take hours.
        let failed = net.client.run(move || {
            let mut failed = 0;
            for _ in 0..5_000 {
                let stream = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(3));
                if !stream.is_ok_and(|s| who(&s).as_deref() == Ok("s1")) {
                    failed += 1;
                    if failed == 20 {
                        break;
                    }
                }
            }
            failed
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let served = server.join().expect("the server thread");
        let external = &daemon.status()["datapath"]["external"];
        assert_eq!(failed, 0, "{failed} of 5,000 connects failed: {external}");
        assert!(served >= 5_000, "the server saw {served} connections");
        assert!(daemon.counter("xdp_nat_port_reused") > 0, "{external}");
        assert_eq!(daemon.counter("xdp_nat_ports_exhausted"), 0);
        drop(daemon);
        drop(cgroup);
    });
}

/// Serves connections on `addr` one at a time, until `stop`: answers the
/// request with "s1", then waits for the client to close. Returns how
/// many it served.
fn serve_in_turn(addr: &str, stop: &std::sync::atomic::AtomicBool) -> usize {
    use std::os::fd::AsRawFd as _;
    let listener = std::net::TcpListener::bind(addr).expect("binding the server");
    // accept() returns every 100 ms to look at `stop`.
    let timeout = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
    // SAFETY: a valid socket and a timeval of the size given.
    let set = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const timeout).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    assert_eq!(set, 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
    let mut served = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let Ok((mut stream, _)) = listener.accept() else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(3)));
        // Read the request, answer, and wait for the client to close: the
        // client closes first, as HTTP clients do.
        let _ = std::io::Read::read(&mut stream, &mut [0u8; 16]);
        let _ = stream.write_all(b"s1\n");
        let _ = std::io::Read::read(&mut stream, &mut [0u8; 16]);
        served += 1;
    }
    served
}

/// A server killed under load costs at most the connects in flight, the
/// kernel moving to the next server at once (the health checks are off:
/// only the reset marks it); with the daemon SIGKILLed a held flow keeps
/// working and new ones are forwarded; a restarted daemon adopts the
/// programs and the flow lives on.
#[privileged_test]
fn external_flows_survive_failover_and_the_daemon() {
    in_new_netns(|| {
        let net = Topology::new();
        let s1 = net.server("s1", "198.18.2.2:8080");
        let _s2 = net.server("s2", "198.18.2.3:8080");
        let cgroup = TestCgroup::new("external-failover");
        let mut daemon = Daemon::start("external-failover", &cgroup, &services("none"));
        assert_eq!(net.ask(VIP4).as_deref(), Ok("s1"), "{}", daemon.log());
        net.servers.run(move || s1.stop());
        let answers: Vec<Result<String, String>> = (0..20).map(|_| net.ask(VIP4)).collect();
        let failed = answers.iter().filter(|a| a.is_err()).count();
        assert!(failed <= 1, "a killed server cost {failed} connects: {answers:?}");
        assert!(answers.iter().skip(1).all(|a| a.as_deref() == Ok("s2")), "{answers:?}");
        assert!(daemon.counter("xdp_server_reset") >= 1);

        let held = net.connect(VIP4).unwrap();
        assert_eq!(who(&held).as_deref(), Ok("s2"));
        daemon.kill();
        assert_eq!(net.ask(VIP4).as_deref(), Ok("s2"), "new flows with the daemon dead");
        (&held).write_all(b"still there\n").expect("the held flow broke with the daemon dead");
        // The restarted daemon finds programs of another build (a faked
        // fingerprint): it adopts the pins and swaps every program in
        // place, the XDP program on each interface too.
        let before = ["ext0", "srv0"].map(xdp_id);
        lb_user::datapath::write_program_fingerprint(&daemon.bpffs, 0).unwrap();
        daemon.restart();
        assert_eq!(daemon.status()["datapath"]["adopted"], true);
        let after = ["ext0", "srv0"].map(xdp_id);
        assert!(after.iter().all(Option::is_some), "{after:?}\n{}", daemon.log());
        assert!(
            before.iter().zip(&after).all(|(b, a)| b != a),
            "not replaced: {before:?} {after:?}"
        );
        assert_eq!(after[0], after[1], "one program on both interfaces");
        assert_eq!(net.ask(VIP4).as_deref(), Ok("s2"), "new flows after the restart");
        // The held flow carries data both ways: the server sees our close
        // and closes too, and we read its end (a reset would be an error).
        held.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = String::new();
        let read = std::io::Read::read_to_string(&mut &held, &mut rest);
        assert!(read.is_ok(), "the held flow was reset: {read:?}");
        drop(daemon);
        drop(cgroup);
    });
}

/// A reload that removes a service's external table detaches the programs;
/// one that adds it back attaches them again.
#[privileged_test]
fn a_reload_attaches_and_detaches_the_external_path() {
    in_new_netns(|| {
        let net = Topology::new();
        let _s1 = net.server("s1", "198.18.2.2:8080");
        let cgroup = TestCgroup::new("external-reload");
        let local_only = "[[service]]\nname = \"web4\"\nvip = \"198.18.1.100:80\"\nservers = [\"198.18.2.2:8080\"]\n";
        let daemon = Daemon::start("external-reload", &cgroup, local_only);
        assert!(!has_xdp("ext0"));
        assert!(net.ask(VIP4).is_err(), "the VIP answered with no external path");
        daemon.write_config(
            &cgroup,
            &format!("{local_only}[service.external]\ninterfaces = [\"ext0\"]\n"),
        );
        daemon.lb(&["reload"]);
        assert!(has_xdp("ext0") && has_xdp("srv0"), "{}", daemon.log());
        assert!(net.wait_serving(VIP4, Some("s1")), "{}", daemon.log());
        daemon.write_config(&cgroup, local_only);
        daemon.lb(&["reload"]);
        assert!(!has_xdp("ext0") && !has_xdp("srv0"), "{}", daemon.log());
        assert!(daemon.status()["datapath"]["external"].is_null());
        drop(daemon);
        drop(cgroup);
    });
}

/// A listed interface deleted and created anew under its name (a driver
/// reloaded, a veth recreated) gets the program again at the next sync: the
/// pin named after it is found stale (the link followed the old device),
/// not trusted.
#[privileged_test]
fn an_interface_created_anew_gets_the_program_again() {
    in_new_netns(|| {
        let net = Topology::new();
        let _s1 = net.server("s1", "198.18.2.2:8080");
        let cgroup = TestCgroup::new("external-recreated");
        let daemon = Daemon::start("external-recreated", &cgroup, &services("none"));
        assert_eq!(net.ask(VIP4).as_deref(), Ok("s1"), "{}", daemon.log());
        // The device goes (its peer c0 with it) and a new one takes its name.
        lb_tests::sh(&["ip", "link", "del", "ext0"]);
        let client = net.client.tid.to_string();
        lb_tests::sh(&[
            "ip", "link", "add", "ext0", "type", "veth", "peer", "name", "c0", "netns", &client,
        ]);
        lb_tests::sh(&["ip", "addr", "add", "198.18.0.1/24", "dev", "ext0"]);
        lb_tests::sh(&["ip", "link", "set", "ext0", "up"]);
        net.client.sh(&["ip", "addr", "add", "198.18.0.10/24", "dev", "c0"]);
        net.client.sh(&["ip", "link", "set", "c0", "up"]);
        net.client.sh(&["ip", "route", "add", "198.18.1.0/24", "via", "198.18.0.1"]);
        net.client.run(|| lb_tests::topology::tx_checksums_off("c0"));
        let _peer = net.client.run(|| lb_tests::topology::pass_through("c0"));
        assert!(
            net.wait_serving(VIP4, Some("s1")),
            "the new ext0 was not served\n{}",
            daemon.log()
        );
        assert!(has_xdp("ext0"), "no XDP program on the new ext0");
        assert!(daemon.log().contains("stale"), "{}", daemon.log());
        drop(daemon);
        drop(cgroup);
    });
}

/// With `announce = "arp"` the node answers ARP and neighbour solicitations
/// for its VIPs on the listed interface, with that interface's MAC, while a
/// server is usable; with every server failed it stops (a client that
/// forgot the VIP's address cannot find it), and answers again once one is
/// back. `lb detach` withdraws it.
#[privileged_test]
fn an_announced_vip_is_found_on_the_link_while_it_has_a_server() {
    in_new_netns(|| {
        let net = Topology::on_link();
        let s1 = net.server("s1", "198.18.2.2:8080");
        let s1v6 = net.server("s1", "[2001:2:0:2::2]:8080");
        let cgroup = TestCgroup::new("external-announce");
        let daemon = Daemon::start("external-announce", &cgroup, &services_announced("tcp", "arp"));
        let announcing =
            |i: usize| daemon.status()["services"][i]["external"]["announcing"] == true;
        assert!(
            wait_until(Duration::from_secs(10), || announcing(0) && announcing(1)),
            "{}",
            daemon.log()
        );
        let ext0 = mac_of("ext0");
        for (vip, ip) in [(VIP4, "198.18.1.100"), (VIP6, "2001:2:0:1::100")] {
            assert_eq!(net.ask(vip).as_deref(), Ok("s1"), "{vip}\n{}", daemon.status()["datapath"]);
            assert_eq!(
                client_neighbour(&net, ip),
                Some(ext0.clone()),
                "the client did not learn {ip} at ext0"
            );
        }
        assert!(daemon.counter("xdp_arp_answered") >= 1);
        assert!(daemon.counter("xdp_ndp_answered") >= 1);
        // A host that probes for the IPv6 VIP before taking it (duplicate
        // address detection, from `::`) is told it is taken.
        net.client.sh(&["sysctl", "-qw", "net.ipv6.conf.c0.accept_dad=1"]);
        net.client.sh(&["ip", "addr", "add", "2001:2:0:1::100/128", "dev", "c0"]);
        let c0_addresses = || {
            let out = net.client.run(|| {
                std::process::Command::new("ip").args(["-6", "addr", "show", "dev", "c0"]).output()
            });
            String::from_utf8_lossy(&out.expect("ip addr").stdout).into_owned()
        };
        let refused = wait_until(Duration::from_secs(5), || c0_addresses().contains("dadfailed"));
        assert!(refused, "the probe for the VIP was not answered: {}", c0_addresses());
        net.client.sh(&["ip", "addr", "del", "2001:2:0:1::100/128", "dev", "c0"]);
        net.client.sh(&["sysctl", "-qw", "net.ipv6.conf.c0.accept_dad=0"]);

        // Every server of web4 gone: withdrawn. The client forgets the
        // VIP's address and asks again, in vain.
        let s1_addr = net.servers.run(move || s1.stop());
        assert!(wait_until(Duration::from_secs(10), || !announcing(0)), "{}", daemon.log());
        assert!(announcing(1), "web6 still has its server");
        net.client.sh(&["ip", "neigh", "flush", "dev", "c0"]);
        assert!(net.ask(VIP4).is_err(), "a withdrawn VIP was found");
        assert_eq!(client_neighbour(&net, "198.18.1.100"), None);
        // Back: announced again, found again.
        let _s1 = net.server("s1", &s1_addr.to_string());
        assert!(wait_until(Duration::from_secs(10), || announcing(0)), "{}", daemon.log());
        assert!(net.wait_serving(VIP4, Some("s1")), "{}", daemon.log());

        daemon.lb(&["detach"]);
        net.client.sh(&["ip", "neigh", "flush", "dev", "c0"]);
        assert!(net.ask(VIP4).is_err(), "lb detach left the VIP announced");
        drop(s1v6);
        drop(daemon);
        drop(cgroup);
    });
}
