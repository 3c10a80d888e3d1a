//! Failing closed: a VIP is announced only while the node can serve it
//! whole, its servers' replies translated back on their way out.

use std::time::Duration;

use lb_tests::{Daemon, TestCgroup, in_new_netns, privileged_test, topology::Topology, wait_until};

use crate::services_announced;

/// Another XDP program on srv0, where the servers' replies arrive: lb
/// cannot attach there, the replies would leave untranslated, so no VIP
/// of those servers is announced (status says why the interface failed).
/// The other program gone, lb attaches at its next sync and announces.
#[privileged_test]
fn a_vip_is_not_announced_while_its_servers_replies_would_go_untranslated() {
    in_new_netns(|| {
        let net = Topology::on_link();
        let _s1 = net.server("s1", "198.18.2.2:8080");
        let _s1v6 = net.server("s1", "[2001:2:0:2::2]:8080");
        let foreign = net.occupy_xdp("srv0");
        let cgroup = TestCgroup::new("external-closed");
        let daemon = Daemon::start("external-closed", &cgroup, &services_announced("tcp", "arp"));
        let srv0_failed = || {
            let status = daemon.status();
            let interfaces = status["datapath"]["external"]["interfaces"].as_array().cloned();
            interfaces
                .unwrap_or_default()
                .iter()
                .any(|i| i["name"] == "srv0" && !i["error"].is_null())
        };
        assert!(wait_until(Duration::from_secs(10), srv0_failed), "{}", daemon.log());
        let announcing =
            |i: usize| daemon.status()["services"][i]["external"]["announcing"] == true;
        let healthy = || {
            let status = daemon.status();
            (0..2).all(|i| status["services"][i]["servers"][0]["state"] == "active")
        };
        assert!(wait_until(Duration::from_secs(10), healthy), "{}", daemon.status());
        std::thread::sleep(Duration::from_secs(1));
        assert!(!announcing(0) && !announcing(1), "announced with untranslated replies");
        assert_eq!(daemon.counter("xdp_arp_answered"), 0);

        // Detached: lb may attach there now.
        drop(foreign);
        assert!(
            wait_until(Duration::from_secs(10), || announcing(0) && announcing(1)),
            "{}",
            daemon.log()
        );
        assert_eq!(net.ask(lb_tests::topology::VIP4).as_deref(), Ok("s1"));
        drop(daemon);
        drop(cgroup);
    });
}
