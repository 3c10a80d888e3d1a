//! Announcing by BGP (issue 42) through the BIRD each node's lb runs, to
//! a real router (BIRD, `lb_tests::bgp_router`) that spreads a VIP over
//! every node announcing it (ECMP): both nodes announce while they can
//! serve; one whose server goes is withdrawn and no connect fails after;
//! one whose speaker freezes (its link up, its sockets open) is withdrawn
//! by BFD, long before BGP's hold timer (90 s) would; `lb detach`
//! withdraws.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    time::{Duration, Instant},
};

use lb_tests::{
    bgp_router::{NODE_ASN, ROUTER, ROUTER_ASN, Router, stop_bird},
    fakes::apiserver::Kubeconfig,
    in_new_netns,
    lan::{Lan, VIP, VIP_IP},
    privileged_test, wait_until,
};

use super::{lan_and_api, one_at_a_time};

/// Every node's config: the VIP, its node's server, announced by BGP.
fn config() -> String {
    format!(
        "[bgp]\nasn = {NODE_ASN}\n[[bgp.peer]]\naddress = \"{ROUTER}\"\nasn = {ROUTER_ASN}\n\
         [[service]]\nname = \"web\"\nvip = \"{VIP}\"\nservers = [\"198.18.2.2:8080\"]\n\
         [service.health]\ncheck = \"tcp\"\ninterval = \"100ms\"\ntimeout = \"100ms\"\nrise = 1\nfall = 1\n\
         [service.external]\ninterfaces = [\"ext0\"]\nannounce = \"bgp\"\n"
    )
}

fn logs(lan: &Lan) -> String {
    let logs: Vec<String> =
        lan.nodes.iter().map(|n| format!("--- {}:\n{}", n.name, n.daemon().log())).collect();
    logs.join("\n")
}

fn node(k: u8) -> IpAddr {
    IpAddr::from([198, 18, 0, k])
}

#[privileged_test]
fn every_node_that_can_serve_announces_and_the_router_spreads_over_them() {
    let _serial = one_at_a_time();
    in_new_netns(|| {
        let (mut lan, _rt, api) = lan_and_api("el-bgp", 2);
        let kubeconfig = Kubeconfig::write(&api.url());
        let router = Router::start(&lan, "el-bgp");
        for n in &mut lan.nodes {
            n.start(kubeconfig.path(), &config());
        }
        let both =
            wait_until(Duration::from_secs(30), || router.next_hops(VIP_IP) == [node(1), node(2)]);
        assert!(both, "the router learned {:?}\n{}", router.next_hops(VIP_IP), logs(&lan));
        // Spread: a client's connections (each its own source port) land
        // on both nodes' servers.
        let mut reached = BTreeSet::new();
        for _ in 0..40 {
            reached.insert(lan.ask().expect("a connect through the router"));
        }
        assert_eq!(reached, BTreeSet::from(["node1".to_owned(), "node2".to_owned()]));
        let status = lan.nodes[0].daemon().status();
        let bgp = &status["bgp"];
        assert_eq!(bgp["announced"][0], VIP_IP, "{bgp}");
        assert_eq!(bgp["sessions"][0]["info"], "Established", "{bgp}");
        assert!(lan.nodes[0].daemon().lb(&["status"]).contains("BGP: announcing 198.18.1.100"));

        // node1's server goes: node1 withdraws, every connect lands on node2.
        drop(lan.nodes[0].server.take());
        let withdrawn =
            wait_until(Duration::from_secs(30), || router.next_hops(VIP_IP) == [node(2)]);
        assert!(withdrawn, "the router kept {:?}\n{}", router.next_hops(VIP_IP), logs(&lan));
        // Each node's counters before and after, to tell on failure who
        // took the connects.
        let counters = |k: usize| lan.nodes[k].daemon().status()["datapath"]["counters"].clone();
        let before = [counters(0), counters(1)];
        let answers: Vec<Result<String, String>> = (0..20).map(|_| lan.ask()).collect();
        let moved: Vec<Vec<String>> = (0..2)
            .map(|k| {
                let after = counters(k);
                let changed =
                    after.as_object().unwrap().iter().filter(|(name, v)| before[k][*name] != **v);
                changed.map(|(name, v)| format!("{name}: {} -> {v}", before[k][name])).collect()
            })
            .collect();
        assert!(
            answers.iter().all(|a| a.as_deref() == Ok("node2")),
            "{answers:?}\nnode1's counters {:?}\nnode2's {:?}",
            moved[0],
            moved[1]
        );

        // node2's speaker freezes (its process stopped, its link up, its
        // sockets open): BFD withdraws it, not BGP's hold timer.
        lan.nodes[0].server = Some(lb_tests::lan::serve(&lan.nodes[0].servers, "node1"));
        let back = wait_until(Duration::from_secs(30), || router.next_hops(VIP_IP).len() == 2);
        assert!(back, "node1 did not announce again\n{}", logs(&lan));
        let state = lan.nodes[1].daemon().dir.join("state").join("bird");
        let pid: i32 =
            std::fs::read_to_string(state.join("bird.pid")).unwrap().trim().parse().unwrap();
        // SAFETY: sending a signal has no memory-safety preconditions.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let frozen = Instant::now();
        let gone = wait_until(Duration::from_secs(10), || router.next_hops(VIP_IP) == [node(1)]);
        let took = frozen.elapsed();
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        assert!(gone, "a frozen node was not withdrawn: {:?}", router.next_hops(VIP_IP));
        eprintln!("a frozen node withdrawn after {took:?} (BFD: 3 x 100 ms)");

        // lb detach on node1 withdraws its route.
        let back = wait_until(Duration::from_secs(30), || router.next_hops(VIP_IP).len() == 2);
        assert!(back, "node2 did not announce again\n{}", logs(&lan));
        lan.nodes[0].daemon().lb(&["detach"]);
        let detached =
            wait_until(Duration::from_secs(10), || router.next_hops(VIP_IP) == [node(2)]);
        assert!(detached, "lb detach left {:?}", router.next_hops(VIP_IP));
        for n in &lan.nodes {
            stop_bird(&n.daemon().dir.join("state").join("bird").join("bird.ctl"));
        }
        drop(router);
    });
}
