//! The datapath on the host kernel: real programs attached to a throwaway
//! cgroup, real loopback sockets. Each test proves where a connection
//! landed (the greeting of the backend that accepted it) and what the
//! application saw (getpeername). Needs root; see `lb_tests::privileged`.
//!
//! Every service here has the builder's default health setting, no checks
//! (`ServiceBuilder::DEFAULT_CHECK`): servers are judged by the kernel's
//! reports alone, so these tests see the kernel's own choices.

use std::{net::SocketAddr, time::Duration};

use lb_tests::{
    Backend, Client, Connect, Daemon, Policy, ServiceBuilder, TestCgroup, addr, in_new_netns,
    privileged_test, tally, wait_until,
};

fn client(cgroup: &TestCgroup) -> Client {
    Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(cgroup))
}

fn outside_client() -> Client {
    Client::start(env!("CARGO_BIN_EXE_lb-test-client"), None)
}

#[track_caller]
fn assert_lands(answer: &Connect, backend: &Backend, vip: SocketAddr) {
    match answer {
        Connect::Ok { peer, greeting, .. } => {
            assert_eq!(greeting, &backend.name, "connection landed on the wrong server");
            assert_eq!(*peer, vip, "getpeername must show the VIP the application dialled");
        }
        Connect::Err(e) => panic!("connect to {vip} failed: {e}"),
    }
}

#[privileged_test]
fn ipv4_vip_is_rewritten_only_for_vips_and_only_inside_the_cgroup() {
    let cgroup = TestCgroup::new("ipv4");
    let one = Backend::start("one", addr(1, 1, 0));
    let two = Backend::start("two", addr(1, 2, 0));
    let vip = addr(1, 100, 6444);
    let _daemon = Daemon::start(
        "ipv4",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[one.addr, two.addr]).toml(),
    );

    let mut inside = client(&cgroup);
    // TCP through the VIP: lands on the first server, the app sees the VIP.
    assert_lands(&inside.connect(vip), &one, vip);
    // An IPv4-mapped VIP on an IPv6 socket goes through connect6.
    let mapped: SocketAddr = format!("[::ffff:{}]:{}", vip.ip(), vip.port()).parse().unwrap();
    assert_lands(&inside.connect(mapped), &one, mapped);
    // Connected UDP is rewritten too.
    assert_lands(&inside.udp(vip), &one, vip);
    // A destination that is not a VIP is left alone.
    assert_lands(&inside.connect(two.addr), &two, two.addr);
    // A process outside the cgroup is not rewritten: nothing listens on the VIP.
    let refused = outside_client().connect(vip);
    assert!(
        matches!(&refused, Connect::Err(e) if e.contains("refused")),
        "outside the cgroup: {refused:?}"
    );
    assert_eq!(one.accepted(), 2, "exactly the two TCP VIP connects reached server one");
}

#[privileged_test]
fn ipv6_vip_in_a_test_netns() {
    in_new_netns(|| {
        let cgroup = TestCgroup::new("ipv6");
        let one = Backend::start("one6", "[::1]:0".parse().unwrap());
        let two = Backend::start("two6", "[::1]:0".parse().unwrap());
        // Only routable inside this namespace, which has nothing but lo.
        let vip: SocketAddr = "[fd00:1b::100]:6444".parse().unwrap();
        let _daemon = Daemon::start(
            "ipv6",
            &cgroup,
            &ServiceBuilder::new("api6", vip).servers(&[one.addr, two.addr]).toml(),
        );
        let mut inside = client(&cgroup);
        assert_lands(&inside.connect(vip), &one, vip);
        assert_lands(&inside.udp(vip), &one, vip);
    });
}

#[privileged_test]
fn changing_the_selection_moves_new_connections_and_keeps_established_ones() {
    let cgroup = TestCgroup::new("reselect");
    let one = Backend::start("one", addr(3, 1, 0));
    let two = Backend::start("two", addr(3, 2, 0));
    let vip = addr(3, 100, 6444);
    let daemon = Daemon::start(
        "reselect",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[one.addr, two.addr]).toml(),
    );
    let mut inside = client(&cgroup);
    let old = inside.connect(vip);
    assert_lands(&old, &one, vip);

    // Draining server one changes the selection without closing anything.
    daemon.lb(&["drain", "api", &one.addr.to_string()]);
    assert_eq!(daemon.status()["services"][0]["selected"][0], two.addr.to_string());
    assert_lands(&inside.connect(vip), &two, vip);
    assert!(inside.alive(old.id()), "an established connection must survive a selection change");
}

#[privileged_test]
fn spread_mode_uses_every_selected_server() {
    let cgroup = TestCgroup::new("spread");
    let backends: Vec<Backend> =
        (1..=3).map(|i| Backend::start(&format!("s{i}"), addr(4, i, 0))).collect();
    let servers: Vec<SocketAddr> = backends.iter().map(|b| b.addr).collect();
    let vip = addr(4, 100, 6444);
    let _daemon = Daemon::start(
        "spread",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&servers).policy(Policy::Spread).toml(),
    );
    let mut inside = client(&cgroup);
    let answers: Vec<Connect> = (0..60).map(|_| inside.connect(vip)).collect();
    let counts = tally(&answers);
    // P(some server gets none of 60 uniform picks) = 3 * (2/3)^60 < 1e-10.
    for b in &backends {
        assert!(
            counts.get(&b.name).copied().unwrap_or(0) > 0,
            "{} got no connection: {counts:?}",
            b.name
        );
    }
    assert_eq!(counts.values().sum::<usize>(), 60);
}

#[privileged_test]
fn sock_ops_counts_connections_and_reports_refused_connects() {
    let cgroup = TestCgroup::new("sockops");
    let one = Backend::start("one", addr(5, 1, 0));
    // Nothing listens here: connects to it are refused.
    let dead = addr(5, 9, one.addr.port());
    let vip = addr(5, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[dead, one.addr])
        .hold_down(Duration::from_secs(60))
        .toml();
    let daemon = Daemon::start("sockops", &cgroup, &config);
    let mut inside = client(&cgroup);

    // The first connect goes to the dead first server and is refused ...
    let refused = inside.connect(vip);
    assert!(matches!(&refused, Connect::Err(e) if e.contains("refused")), "{refused:?}");
    // ... which the kernel reports at once: the next connect goes on.
    let ids: Vec<u32> = (0..3)
        .map(|_| inside.connect(vip))
        .inspect(|a| assert_lands(a, &one, vip))
        .map(|a| a.id())
        .collect();
    assert!(
        wait_until(Duration::from_secs(5), || {
            daemon.log().lines().any(|l| {
                l.contains("connect through the VIP failed")
                    && l.contains(&format!("server={dead}"))
            })
        }),
        "the daemon was not told about the refused connect:\n{}",
        daemon.log()
    );
    let status = daemon.status();
    let dead_status = &status["services"][0]["servers"][0];
    assert_eq!(dead_status["address"], dead.to_string());
    assert_eq!(dead_status["recently_failed"], true);

    assert!(
        wait_until(Duration::from_secs(5), || daemon.connections("api", one.addr) == 3),
        "count after 3 connects: {}",
        daemon.connections("api", one.addr)
    );
    inside.close(ids[0]);
    inside.close(ids[1]);
    assert!(
        wait_until(Duration::from_secs(5), || daemon.connections("api", one.addr) == 1),
        "count after 2 closes: {}",
        daemon.connections("api", one.addr)
    );
    assert_eq!(daemon.connections("api", dead), 0);
}

#[privileged_test]
fn the_kernel_fails_over_and_back_while_the_daemon_is_dead() {
    let cgroup = TestCgroup::new("selfheal");
    let one = Backend::start("one", addr(6, 1, 0));
    let two = Backend::start("two", addr(6, 2, 0));
    let vip = addr(6, 100, 6444);
    let config = ServiceBuilder::new("api", vip)
        .servers(&[one.addr, two.addr])
        .hold_down(Duration::from_secs(1))
        .toml();
    let mut daemon = Daemon::start("selfheal", &cgroup, &config);
    let mut inside = client(&cgroup);
    assert_lands(&inside.connect(vip), &one, vip);

    daemon.kill();
    let one_addr = one.stop();
    // The connect that meets the stopped server fails; the next goes on.
    let first = inside.connect(vip);
    assert!(matches!(&first, Connect::Err(_)), "{first:?}");
    for _ in 0..3 {
        assert_lands(&inside.connect(vip), &two, vip);
    }
    // Server one comes back; once the hold-down passed, traffic returns.
    let one = Backend::start("one", one_addr);
    std::thread::sleep(Duration::from_millis(1200));
    assert_lands(&inside.connect(vip), &one, vip);
    assert_lands(&inside.connect(vip), &one, vip);
}

#[privileged_test]
fn sigkill_keeps_traffic_flowing_restart_adopts_and_detach_removes_everything() {
    let cgroup = TestCgroup::new("failstatic");
    let one = Backend::start("one", addr(7, 1, 0));
    let vip = addr(7, 100, 6444);
    let mut daemon = Daemon::start(
        "failstatic",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[one.addr]).toml(),
    );
    let mut inside = client(&cgroup);
    let before: Vec<u32> = (0..2)
        .map(|_| inside.connect(vip))
        .inspect(|a| assert_lands(a, &one, vip))
        .map(|a| a.id())
        .collect();
    let status_before = daemon.status();

    daemon.kill();
    let during = inside.connect(vip);
    assert_lands(&during, &one, vip);

    daemon.restart();
    let status = daemon.status();
    assert_eq!(status["datapath"]["adopted"], true, "the restarted daemon must adopt the pins");
    assert_eq!(status["services"], {
        let mut s = status_before["services"].clone();
        s[0]["servers"][0]["connections"] = 3.into();
        s
    });
    for id in before.iter().chain([&during.id()]) {
        assert!(inside.alive(*id), "connection {id} must survive the restart");
    }
    assert_lands(&inside.connect(vip), &one, vip);

    let out = daemon.lb(&["detach"]);
    assert!(out.contains("detached"), "{out}");
    assert!(!daemon.bpffs.exists(), "pins left behind in {}", daemon.bpffs.display());
    // Nothing rewrites any more: nothing listens on the VIP itself.
    let after = inside.connect(vip);
    assert!(matches!(&after, Connect::Err(e) if e.contains("refused")), "after detach: {after:?}");
}

#[privileged_test]
fn closing_a_server_resets_only_its_vip_connections() {
    let cgroup = TestCgroup::new("close");
    let one = Backend::start("one", addr(8, 1, 0));
    let two = Backend::start("two", addr(8, 2, 0));
    let vip = addr(8, 100, 6444);
    let other_vip = addr(8, 101, 6444);
    let config = ServiceBuilder::new("api", vip).servers(&[one.addr]).toml()
        + &ServiceBuilder::new("other", other_vip).servers(&[two.addr]).toml();
    let daemon = Daemon::start("close", &cgroup, &config);
    if !daemon.has_feature("sock_destroy") {
        return;
    }
    let mut inside = client(&cgroup);
    let through_vip: Vec<u32> = (0..2)
        .map(|_| inside.connect(vip))
        .inspect(|a| assert_lands(a, &one, vip))
        .map(|a| a.id())
        .collect();
    let direct = inside.connect(one.addr);
    assert_lands(&direct, &one, one.addr);
    let other = inside.connect(other_vip);
    assert_lands(&other, &two, other_vip);

    let out = daemon.lb(&["close-connections", &one.addr.to_string()]);
    assert!(out.contains("closed 2 connections"), "{out}");
    for id in &through_vip {
        assert!(
            wait_until(Duration::from_secs(2), || !inside.alive(*id)),
            "VIP connection {id} was not reset"
        );
    }
    assert!(
        inside.alive(direct.id()),
        "a direct connection to the same server must not be touched"
    );
    assert!(inside.alive(other.id()), "a connection to another server must not be touched");
    assert!(wait_until(Duration::from_secs(5), || daemon.connections("api", one.addr) == 0));
}

#[privileged_test]
fn a_thousand_services_load_and_route() {
    let cgroup = TestCgroup::new("thousand");
    let backends: Vec<Backend> =
        (1..=4).map(|i| Backend::start(&format!("b{i}"), addr(9, i, 0))).collect();
    // VIPs 127.78.<i / 250>.<i % 250 + 1>:7000, each with one backend.
    let vips: Vec<SocketAddr> = (0..1000u16)
        .map(|i| SocketAddr::from(([127, 78, (i / 250) as u8, (i % 250 + 1) as u8], 7000)))
        .collect();
    let config: String = vips
        .iter()
        .enumerate()
        .map(|(i, vip)| {
            ServiceBuilder::new(&format!("svc{i}"), *vip).servers(&[backends[i % 4].addr]).toml()
        })
        .collect();
    let daemon = Daemon::start("thousand", &cgroup, &config);
    assert_eq!(daemon.status()["services"].as_array().unwrap().len(), 1000);
    let mut inside = client(&cgroup);
    for (i, vip) in vips.iter().enumerate() {
        let answer = inside.connect(*vip);
        assert_lands(&answer, &backends[i % 4], *vip);
        inside.close(answer.id());
    }
}
