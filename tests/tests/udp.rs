//! UDP services (issue 24): a DNS service judged by DNS checks, against
//! two fake DNS servers (`lb_tests::fakes::dns`). Needs root; see
//! `lb_tests::privileged`.

use std::time::Duration;

use lb_tests::{
    Check, Daemon, ServiceBuilder, TestCgroup, addr,
    fakes::dns::{FakeDns, Mode},
    privileged, wait_until,
};

/// `check = "dns"`: a server that answers (NXDOMAIN included) passes; one
/// that drops queries or answers SERVFAIL fails its checks, and the
/// kernel's selection moves to the other, with no TCP port to probe; the
/// server is taken back once it answers again.
#[test]
fn a_dns_service_fails_over_on_its_dns_checks() {
    if !privileged() {
        return;
    }
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
    // not flap back to it).
    let servers = [&a, &b];
    for (round, (mode, why)) in
        [(Mode::Drop, "no answer within"), (Mode::ServFail, "answered Server Failure")]
            .into_iter()
            .enumerate()
    {
        let (failing, other) = (servers[round % 2], servers[(round + 1) % 2]);
        assert_eq!(lead(), Some(failing.addr().to_string()), "round {round}");
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
