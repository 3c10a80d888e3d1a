//! UDP services: a DNS service judged by DNS checks, against two fake DNS
//! servers (`lb_tests::fakes::dns`); real resolvers through a DNS VIP in
//! front of real DNS servers (`lb_tests::resolvers`); unconnected sends,
//! their answers and their sockets' entries. Needs root; see
//! `lb_tests::privileged`.

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use lb_tests::{
    Backend, Check, Client, Daemon, Policy, ServiceBuilder, TestCgroup, addr, emulated,
    fakes::dns::{FakeDns, Mode},
    privileged_test,
    resolvers::{self, Dnsmasq, Resolver, ResolverEnv},
    wait_until,
};

const CLIENT: &str = env!("CARGO_BIN_EXE_lb-test-client");

/// `check = "dns"`: a server that answers (NXDOMAIN included) passes; one
/// that drops queries or answers SERVFAIL fails its checks, and the
/// kernel's selection moves to the other, with no TCP port to probe; the
/// server is taken back once it answers again.
#[privileged_test]
fn a_dns_service_fails_over_on_its_dns_checks() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (a, b) = runtime.block_on(async { (FakeDns::start().await, FakeDns::start().await) });
    let cgroup = TestCgroup::new("dnscheck");
    let vip = addr(75, 100, 53);
    let service =
        ServiceBuilder::new("dns", vip).servers(&[a.addr(), b.addr()]).check(Check::Dns {
            query: "kubernetes.default.svc.cluster.local",
            interval: Duration::from_millis(200),
        });
    let daemon = Daemon::start("dnscheck", &cgroup, &service.toml());
    let lead = || daemon.status()["services"][0]["selected"][0].as_str().map(str::to_owned);
    let healthy = |server| daemon.server_field(server, "healthy") == true;
    assert!(
        wait_until(Duration::from_secs(10), || healthy(a.addr()) && healthy(b.addr())),
        "both servers answer (NXDOMAIN) and pass:\n{}",
        daemon.log()
    );
    let queries = a.queries();
    assert!(wait_until(Duration::from_secs(5), || a.queries() > queries), "a is asked again");

    // Each round fails the server that leads, which moves the lead to the
    // other; the failed one passes again once it answers (failover does
    // not flap back to it). Which one leads first is not this test's
    // business: on a loaded machine a's very first check can time out and
    // the first election go to b.
    for (mode, why) in
        [(Mode::Drop, "no answer within"), (Mode::ServFail, "answered Server Failure")]
    {
        let leader = lead();
        let (failing, other) = if leader == Some(a.addr().to_string()) {
            (&a, &b)
        } else {
            assert_eq!(leader, Some(b.addr().to_string()), "one of the two leads");
            (&b, &a)
        };
        failing.set_mode(mode);
        assert!(
            wait_until(Duration::from_secs(10), || !healthy(failing.addr())
                && lead() == Some(other.addr().to_string())),
            "{} failed its DNS checks ({why}) and the other leads:\n{}",
            failing.addr(),
            daemon.log()
        );
        let last = daemon.server_field(failing.addr(), "last_check").to_string();
        assert!(last.contains(why), "{last}");
        failing.set_mode(Mode::Answer);
        assert!(
            wait_until(Duration::from_secs(10), || healthy(failing.addr())),
            "{} answers again and passes:\n{}",
            failing.addr(),
            daemon.log()
        );
    }
}

/// Two dnsmasq servers behind a VIP on port 53 (test `test`), answering
/// `web.lb.test` with 198.18.<test>.1 and .2, and the service in front of
/// them, judged by DNS checks every 200 ms.
fn two_dns_servers(test: u8) -> (Dnsmasq, Dnsmasq, ServiceBuilder) {
    let a = Dnsmasq::start(addr(test, 1, 53), Ipv4Addr::new(198, 18, test, 1));
    let b = Dnsmasq::start(addr(test, 2, 53), Ipv4Addr::new(198, 18, test, 2));
    let service = ServiceBuilder::new("dns", addr(test, 53, 53))
        .servers(&[a.addr, b.addr])
        .check(Check::Dns { query: resolvers::NAME, interval: Duration::from_millis(200) })
        .fall(2);
    (a, b, service)
}

fn lead(daemon: &Daemon) -> Option<String> {
    daemon.status()["services"][0]["selected"][0].as_str().map(str::to_owned)
}

/// glibc (`getent`), bind9's `dig` and musl's `getaddrinfo` (a static musl
/// binary: unconnected `sendto()`, answers only from the address it asked)
/// resolve through a DNS VIP, from its own `resolv.conf`; when the server
/// they use is killed, the DNS checks move the VIP to the other and every
/// resolver is answered by it; their released sockets leave nothing in the
/// kernel's UDP tables.
#[privileged_test]
fn real_resolvers_resolve_through_a_dns_vip_and_fail_over() {
    if !resolvers::resolvers_present() {
        return;
    }
    let cgroup = TestCgroup::new("resolvers");
    let (mut a, b, service) = two_dns_servers(76);
    let daemon = Daemon::start("resolvers", &cgroup, &service.toml());
    let vip = addr(76, 53, 53);
    assert!(
        wait_until(Duration::from_secs(10), || daemon.server_field(a.addr, "healthy") == true
            && daemon.server_field(b.addr, "healthy") == true),
        "both dnsmasq servers pass their DNS checks:\n{}",
        daemon.log()
    );
    assert_eq!(lead(&daemon), Some(a.addr.to_string()));
    let env = ResolverEnv::new("failover", vip.ip());
    // Every resolver is asked each time, so a failure shows them all.
    let all_answer = |server: &Dnsmasq, when: &str| {
        let answers: Vec<(Resolver, Result<String, String>)> =
            Resolver::ALL.iter().map(|r| (*r, env.resolve(*r, &cgroup))).collect();
        let expected = Ok(server.answer.to_string());
        assert!(
            answers.iter().all(|(_, got)| *got == expected),
            "{when}, through {vip}, every resolver gets {expected:?} (files in {}): {answers:?}\n\
             counters: {}\ntracked: {}",
            env.dir().display(),
            daemon.status()["datapath"]["counters"],
            daemon.status()["datapath"]["tracked_sockets"]
        );
    };
    all_answer(&a, "before the failover");
    assert!(daemon.counter("sendmsg_rewritten") > 0, "musl sent unconnected");
    assert!(daemon.counter("recvmsg_rewritten") >= 3, "every resolver saw the VIP answer");

    a.kill();
    let killed = Instant::now();
    assert!(
        wait_until(Duration::from_secs(10), || lead(&daemon) == Some(b.addr.to_string())),
        "the DNS checks move the VIP to {} once {} is gone:\n{}",
        b.addr,
        a.addr,
        daemon.log()
    );
    eprintln!("the VIP moved {:?} after the kill", killed.elapsed());
    all_answer(&b, "after the failover");
    // Every resolver has exited: its sockets were released.
    assert!(
        wait_until(Duration::from_secs(5), || {
            daemon.status()["datapath"]["tracked_sockets"]["udp_peers"] == 0
        }),
        "released sockets leave no UDP peer entry: {}",
        daemon.status()["datapath"]["tracked_sockets"]
    );
    assert_eq!(daemon.status()["datapath"]["tracked_sockets"]["udp"], 0);
}

/// Thousands of queries with `sendto()` from one unconnected socket (IPv4,
/// IPv4-mapped from an IPv6 socket, and IPv6): every one is answered, every
/// answer comes from the VIP, and all go to one server (a socket keeps its
/// server, here with `spread`); while the last socket lives, `lb status`
/// shows its reverse mapping.
#[privileged_test]
fn thousands_of_unconnected_queries_from_one_socket_are_all_answered_by_the_vip() {
    if !resolvers::resolvers_present() {
        return;
    }
    let cgroup = TestCgroup::new("sendto");
    let a = Dnsmasq::start(addr(77, 1, 53), Ipv4Addr::new(198, 18, 77, 1));
    let b = Dnsmasq::start(addr(77, 2, 53), Ipv4Addr::new(198, 18, 77, 2));
    let a6 = Dnsmasq::start("[::1]:5377".parse().unwrap(), Ipv4Addr::new(198, 18, 77, 61));
    let b6 = Dnsmasq::start("[::1]:5378".parse().unwrap(), Ipv4Addr::new(198, 18, 77, 62));
    let vip = addr(77, 53, 53);
    let vip6: SocketAddr = "[fd00:1b::53]:53".parse().unwrap();
    let services = [
        ServiceBuilder::new("dns", vip).servers(&[a.addr, b.addr]).policy(Policy::Spread),
        ServiceBuilder::new("dns6", vip6).servers(&[a6.addr, b6.addr]).policy(Policy::Spread),
    ];
    let toml: String = services.iter().map(ServiceBuilder::toml).collect();
    let daemon = Daemon::start("sendto", &cgroup, &toml);
    let SocketAddr::V4(vip4) = vip else { unreachable!("addr() is IPv4") };
    let mapped = SocketAddr::new(vip4.ip().to_ipv6_mapped().into(), 53);
    let mut client = Client::start(CLIENT, Some(&cgroup));
    for to in [vip, mapped, vip6] {
        let answer = client.ask(&format!("sendto {to} 2000"));
        let field = |name: &str| {
            answer.split_whitespace().find_map(|w| w.strip_prefix(name)).unwrap_or("").to_owned()
        };
        assert_eq!(field("answered="), "2000", "to {to}: {answer}");
        assert_eq!(field("from_addr="), "2000", "every answer from {to}: {answer}");
        assert_eq!(field("names=").split(',').count(), 1, "one server for the socket: {answer}");
    }
    assert_eq!(daemon.counter("sendmsg_rewritten"), 3, "one choice per socket and VIP");
    assert!(daemon.counter("sendmsg_kept") >= 3 * 1999);
    assert_eq!(daemon.counter("udp_peers_full"), 0);
    // The last socket is still open: its pair is the table's one row.
    let tracked = &daemon.status()["datapath"]["tracked_sockets"];
    assert_eq!(tracked["udp_peers"], 1, "{tracked}");
    let rows = tracked["udp_reverse"].as_array().expect("udp_reverse");
    assert_eq!(rows.len(), 1, "{tracked}");
    assert_eq!(rows[0]["vip"], vip6.to_string());
    assert!(
        [a6.addr, b6.addr]
            .map(|a| a.to_string())
            .contains(&rows[0]["server"].as_str().unwrap().to_owned())
    );
    let status = daemon.lb(&["status"]);
    assert!(status.contains(&format!("{vip6} <- ")), "{status}");
    client.ask("sendto 127.0.0.1:9 0");
    assert!(
        wait_until(
            Duration::from_secs(5),
            || daemon.status()["datapath"]["tracked_sockets"]["udp_peers"] == 0
        ),
        "the released socket's entry is gone"
    );
}

/// A churn of a million unconnected sockets (a tenth under emulation), each
/// sending one query to a VIP and closed at once, leaves no UDP entry
/// behind and does not disturb TCP tracking: connections held through a TCP
/// VIP meanwhile stay tracked and counted.
#[privileged_test]
fn a_million_unconnected_sockets_leave_no_entry_and_tcp_tracking_alone() {
    if !resolvers::resolvers_present() {
        return;
    }
    // A million on the host kernel; a tenth under emulation (the VMs).
    let churn: usize = if emulated() { 100_000 } else { 1_000_000 };
    const HELD: usize = 200;
    let cgroup = TestCgroup::new("udpchurn");
    let a = Dnsmasq::start(addr(78, 1, 53), Ipv4Addr::new(198, 18, 78, 1));
    let backend = Backend::start("tcp", addr(78, 10, 0));
    let dns_vip = addr(78, 53, 53);
    let tcp_vip = addr(78, 100, 8080);
    let toml = format!(
        "{}{}",
        ServiceBuilder::new("dns", dns_vip).servers(&[a.addr]).toml(),
        ServiceBuilder::new("web", tcp_vip).servers(&[backend.addr]).toml()
    );
    let daemon = Daemon::start("udpchurn", &cgroup, &toml);
    let mut holder = Client::start(CLIENT, Some(&cgroup));
    let held = holder.ask(&format!("hold {tcp_vip} {HELD} 4"));
    assert!(held.starts_with(&format!("held ok={HELD} ")), "{held}");
    let tracked = |table: &str| daemon.status()["datapath"]["tracked_sockets"][table].as_u64();
    assert_eq!(tracked("tcp"), Some(HELD as u64));

    let mut churner = Client::start(CLIENT, Some(&cgroup));
    let started = Instant::now();
    let churned = churner.ask(&format!("churn-sendto {dns_vip} {churn}"));
    eprintln!("{churned} in {:?}", started.elapsed());
    assert_eq!(churned, format!("churned ok={churn} failed=0"));
    assert!(daemon.counter("sendmsg_rewritten") >= churn as u64);
    assert_eq!(daemon.counter("udp_peers_full"), 0, "released sockets freed their entries");
    // Every entry goes at its socket's release; the last releases may
    // still be under way when the client answers (seen once in CI: one
    // entry at the first look).
    let emptied = wait_until(Duration::from_secs(5), || tracked("udp_peers") == Some(0));
    assert!(emptied, "entries left behind: {:?}", tracked("udp_peers"));
    assert_eq!(tracked("tcp"), Some(HELD as u64), "the TCP connections are still tracked");
    assert_eq!(daemon.connections("web", backend.addr), HELD as i64);
    let still = holder.ask("held");
    assert!(still.starts_with(&format!("held alive={HELD} dead=0")), "{still}");
}
