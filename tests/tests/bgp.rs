//! Announcing by BGP (issue 42) through the BIRD each node's lb runs, to
//! a real router (BIRD, `lb_tests::bgp_router`) that spreads a VIP over
//! every node announcing it (ECMP): both nodes announce while they can
//! serve; one whose server goes is withdrawn and no connect fails after;
//! one whose speaker freezes (its link up, its sockets open) is withdrawn
//! by BFD, long before BGP's hold timer (90 s) would (a flow held on the
//! other node carries on; one held on it is reset); `lb detach`
//! withdraws; one whose daemon is killed announces on (fail-static) for
//! `[bgp] routes_outlive_daemon`, no longer. An IPv6 VIP goes to the
//! router over IPv6 sessions, and is spread likewise. Routes the router
//! offers (a default route among them) reach neither a node's BIRD
//! tables nor its kernel's; another local user reaches neither BIRD's
//! socket nor the renewals. A LoadBalancer Service from a pool announced
//! by BGP, `externalTrafficPolicy: Local`, is announced by the node of
//! its endpoint alone, and follows it. The nodes are the elections' LAN
//! (`lan.rs`); needs root and BIRD (`bird2`), see `lb_tests::privileged`.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr, TcpStream},
    os::unix::fs::PermissionsExt as _,
    time::{Duration, Instant},
};

use lb_tests::{
    Backend,
    bgp_router::{NODE_ASN, OFFERED, OFFERED6, ROUTER, ROUTER_ASN, ROUTER6, Router, SERVER6},
    fakes::apiserver::{Kubeconfig, ingress_ip, load_balancer_service},
    in_new_netns,
    lan::{
        FIRST_SERVING, Lan, VIP, VIP_IP, lan_and_api, nodes_are_gateways, one_at_a_time, place_web,
    },
    other_user::{As, Attempt, try_as},
    privileged_test,
    topology::{carries_data, peer, who},
    wait_until,
};

/// The IPv6 VIP.
const VIP6: &str = "[2001:2:0:1::100]:80";
const VIP6_IP: &str = "2001:2:0:1::100";
/// How long a killed daemon's routes stay (`[bgp] routes_outlive_daemon`).
const OUTLIVE: Duration = Duration::from_secs(3);

/// Every node's config: a VIP of each family, its node's servers,
/// announced by BGP to the router's IPv4 and IPv6 addresses.
fn config() -> String {
    let service = |name: &str, vip: &str, server: &str| {
        format!(
            "[[service]]\nname = \"{name}\"\nvip = \"{vip}\"\nservers = [\"{server}\"]\n\
             [service.health]\ncheck = \"tcp\"\ninterval = \"100ms\"\ntimeout = \"100ms\"\nrise = 1\nfall = 1\n\
             [service.external]\ninterfaces = [\"ext0\"]\nannounce = \"bgp\"\n"
        )
    };
    format!(
        "[bgp]\nasn = {NODE_ASN}\nroutes_outlive_daemon = \"{}s\"\n\
         [[bgp.peer]]\naddress = \"{ROUTER}\"\nasn = {ROUTER_ASN}\n\
         [[bgp.peer]]\naddress = \"{ROUTER6}\"\nasn = {ROUTER_ASN}\n{}{}",
        OUTLIVE.as_secs(),
        service("web", VIP, "198.18.2.2:8080"),
        service("web6", VIP6, SERVER6),
    )
}

fn logs(lan: &Lan) -> String {
    let logs: Vec<String> =
        lan.nodes.iter().map(|n| format!("--- {}:\n{}", n.name, n.daemon().log())).collect();
    logs.join("\n")
}

/// What the router and each node say of BGP and the services, then the
/// nodes' logs: a failure's message.
fn bgp_state(lan: &Lan, router: &Router) -> String {
    let mut text = format!("--- the router:\n{}\n", router.protocols());
    for n in &lan.nodes {
        let status = n.daemon().status();
        text.push_str(&format!(
            "--- {}'s status:\nbgp {}\nservices {}\n",
            n.name, status["bgp"], status["services"]
        ));
    }
    text + &logs(lan)
}

fn node(k: u8) -> IpAddr {
    IpAddr::from([198, 18, 0, k])
}

fn node6(k: u16) -> IpAddr {
    IpAddr::from([0x2001, 2, 0, 0, 0, 0, 0, k])
}

#[privileged_test]
fn every_node_that_can_serve_announces_and_the_router_spreads_over_them() {
    let _serial = one_at_a_time();
    in_new_netns(|| {
        let (mut lan, _rt, api) = lan_and_api("el-bgp", 2);
        let kubeconfig = Kubeconfig::write(&api.url());
        let router = Router::start(&lan, "el-bgp");
        let _servers6: Vec<Backend> = lan
            .nodes
            .iter()
            .map(|n| {
                let name = n.name.clone();
                n.servers.run(move || Backend::start(&name, SERVER6.parse().unwrap()))
            })
            .collect();
        for n in &mut lan.nodes {
            n.start(kubeconfig.path(), &config());
        }
        let both = wait_until(Duration::from_secs(30), || {
            router.next_hops(VIP_IP) == [node(1), node(2)]
                && router.next_hops(VIP6_IP) == [node6(1), node6(2)]
        });
        assert!(
            both,
            "the router learned {:?} and {:?}\n{}",
            router.next_hops(VIP_IP),
            router.next_hops(VIP6_IP),
            bgp_state(&lan, &router)
        );
        // Spread: a client's connections (each its own source port) land
        // on both nodes' servers, over either family.
        for vip in [VIP, VIP6] {
            let mut reached = BTreeSet::new();
            for _ in 0..40 {
                let to = vip.parse().unwrap();
                reached.insert(lan.ask_at(to, Duration::from_millis(500)).expect("a connect"));
            }
            assert_eq!(reached, BTreeSet::from(["node1".to_owned(), "node2".to_owned()]), "{vip}");
        }
        // Both sessions up, and BFD on each.
        let mut bgp = serde_json::Value::Null;
        let up = wait_until(Duration::from_secs(10), || {
            bgp = lan.nodes[0].daemon().status()["bgp"].clone();
            [0, 1].iter().all(|&k| {
                let session = &bgp["sessions"][k];
                session["info"] == "Established" && session["bfd"] == "Up"
            })
        });
        assert!(up, "{bgp}");
        assert_eq!(bgp["announced"], serde_json::json!([VIP_IP, VIP6_IP]), "{bgp}");
        assert_eq!(bgp["sessions"][1]["peer"], ROUTER6, "{bgp}");
        // The router offers routes of its own, a default route among them;
        // lb imports none: each node's BIRD received them and kept none,
        // and its kernel's tables have none.
        for n in &lan.nodes {
            let socket = n.daemon().dir.join("state").join("bird").join("bird.ctl");
            for peer in ["lb_peer0", "lb_peer1"] {
                let (received, accepted) = import_updates(&socket, peer);
                assert!(received >= 2, "{}'s {peer} received {received} routes", n.name);
                assert_eq!(accepted, 0, "{}'s {peer} imported a route", n.name);
            }
            let tables = n.ns.run(|| {
                let out = |family: &str| {
                    let out = std::process::Command::new("ip")
                        .args([family, "route", "show", "table", "all"])
                        .output()
                        .unwrap();
                    String::from_utf8_lossy(&out.stdout).into_owned()
                };
                out("-4") + &out("-6")
            });
            for offered in [OFFERED, OFFERED6, "default"] {
                assert!(!tables.contains(offered), "{}'s kernel has {offered}:\n{tables}", n.name);
            }
        }
        // Another local user reaches neither BIRD's socket (it takes any
        // command: `down`) nor the renewals, even where the state
        // directory around them is open to all (lb keeps it 0700; an
        // operator may not): BIRD's directory is root's alone.
        let bird = lan.nodes[0].daemon().dir.join("state").join("bird");
        let (socket, renewed) = (bird.join("bird.ctl"), bird.join("renewed"));
        let state = bird.parent().unwrap();
        std::fs::set_permissions(state, std::fs::Permissions::from_mode(0o755)).unwrap();
        let control = |who, attempt| try_as(who, attempt).map_err(|e| e.to_string());
        assert_eq!(control(As::Root, Attempt::Connect(&socket)), Ok(()), "{}", socket.display());
        assert_eq!(control(As::Root, Attempt::Write(&renewed)), Ok(()), "{}", renewed.display());
        assert_eq!(control(As::Nobody, Attempt::List(state)), Ok(()), "{}", state.display());
        for attempt in [Attempt::Connect(&socket), Attempt::Write(&renewed), Attempt::List(&bird)] {
            let reached = try_as(As::Nobody, attempt).map_err(|e| e.kind());
            assert_eq!(reached, Err(std::io::ErrorKind::PermissionDenied));
        }
        let table = lan.nodes[0].daemon().lb(&["status"]);
        assert!(table.contains("BGP: announcing 198.18.1.100 2001:2:0:1::100"), "{table}");
        assert!(table.contains("lb_peer1 2001:2::fe up Established, BFD Up"), "{table}");

        // node1's server goes: node1 withdraws, every connect lands on node2.
        drop(lan.nodes[0].server.take());
        let withdrawn =
            wait_until(Duration::from_secs(30), || router.next_hops(VIP_IP) == [node(2)]);
        assert!(
            withdrawn,
            "the router kept {:?}\n{}",
            router.next_hops(VIP_IP),
            bgp_state(&lan, &router)
        );
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
        assert!(back, "node1 did not announce again\n{}", bgp_state(&lan, &router));
        // Two connections held, one on each node.
        let held: Vec<(String, TcpStream)> = lan.client.run(|| {
            let vip: SocketAddr = VIP.parse().unwrap();
            let mut held: Vec<(String, TcpStream)> = Vec::new();
            for _ in 0..64 {
                let stream = TcpStream::connect_timeout(&vip, Duration::from_millis(500)).unwrap();
                let name = who(&stream).unwrap();
                if !held.iter().any(|(n, _)| *n == name) {
                    held.push((name, stream));
                }
                if held.len() == 2 {
                    break;
                }
            }
            held
        });
        assert_eq!(held.len(), 2, "64 connects did not reach both nodes");
        let state = lan.nodes[1].daemon().dir.join("state").join("bird");
        let pid: i32 =
            std::fs::read_to_string(state.join("bird.pid")).unwrap().trim().parse().unwrap();
        // SAFETY: sending a signal has no memory-safety preconditions.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let frozen = Instant::now();
        let gone = wait_until(Duration::from_secs(10), || router.next_hops(VIP_IP) == [node(1)]);
        let took = frozen.elapsed();
        // Its daemon never waits on BIRD: its status answers from the last
        // look at once (a call on BIRD's socket would wait 2 s for the
        // greeting a frozen BIRD never sends, twice).
        let asked = Instant::now();
        let status = lan.nodes[1].daemon().status();
        let answered = asked.elapsed();
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        assert!(answered < Duration::from_secs(2), "lb status waited {answered:?} on BIRD");
        assert_eq!(status["bgp"]["sessions"].as_array().map(Vec::len), Some(2), "{status}");
        assert!(gone, "a frozen node was not withdrawn: {:?}", router.next_hops(VIP_IP));
        eprintln!("a frozen node withdrawn after {took:?} (BFD: 3 x 100 ms)");
        // The router now sends both held flows to node1: the one there
        // carries on; node2's meets no flow state on node1 and is reset
        // (flow state is per node: docs/external.md).
        for (name, stream) in &held {
            let now = carries_data(stream);
            if name == "node1" {
                assert_eq!(now, Ok(()), "a flow on the surviving node was cut");
            } else {
                assert!(now.is_err(), "node2's flow, now on node1, carried on");
            }
        }

        // lb detach on node1 withdraws its route.
        let back = wait_until(Duration::from_secs(30), || router.next_hops(VIP_IP).len() == 2);
        assert!(back, "node2 did not announce again\n{}", bgp_state(&lan, &router));
        lan.nodes[0].daemon().lb(&["detach"]);
        let detached =
            wait_until(Duration::from_secs(10), || router.next_hops(VIP_IP) == [node(2)]);
        assert!(detached, "lb detach left {:?}", router.next_hops(VIP_IP));

        // node2's daemon killed: its BIRD announces on (the kernel serves
        // on), for `routes_outlive_daemon` after its last renewal (within
        // a second before the kill), no longer.
        lan.nodes[1].daemon_mut().kill();
        let killed = Instant::now();
        let gone = wait_until(OUTLIVE * 3, || router.next_hops(VIP_IP).is_empty());
        let took = killed.elapsed();
        assert!(gone, "a killed daemon's routes stayed {took:?}: {:?}", router.next_hops(VIP_IP));
        // The last renewal is at most a second (and a tick's lateness)
        // before the kill: withdrawn at once would be ~0.3 s.
        let earliest = OUTLIVE - Duration::from_millis(1_500);
        assert!(took >= earliest, "withdrawn after {took:?}: not fail-static");
        eprintln!("a killed daemon's routes withdrawn after {took:?} (bound {OUTLIVE:?})");
        // Started again, it announces again (a BIRD of its own).
        lan.nodes[1].start(kubeconfig.path(), &config());
        let again = wait_until(Duration::from_secs(30), || router.next_hops(VIP_IP) == [node(2)]);
        assert!(again, "a restarted daemon did not announce\n{}", bgp_state(&lan, &router));
        for n in &lan.nodes {
            lb_user::bgp::stop_speaker(&n.daemon().dir.join("state"));
        }
        drop(router);
    });
}

/// Routes a node's BIRD received from the router on `peer`, and those it
/// accepted: `Import updates:` of `show protocols all` (received,
/// rejected, filtered, ignored, accepted).
fn import_updates(socket: &std::path::Path, peer: &str) -> (u64, u64) {
    let reply = lb_user::bgp::control::command(socket, &format!("show protocols all {peer}"))
        .expect("asking a node's BIRD");
    let text: Vec<String> = reply.into_iter().map(|line| line.text).collect();
    let text = text.join("\n");
    let counts: Vec<u64> = text
        .lines()
        .find_map(|line| line.trim().strip_prefix("Import updates:"))
        .map(|rest| rest.split_whitespace().filter_map(|w| w.parse().ok()).collect())
        .unwrap_or_default();
    match counts.as_slice() {
        [received, .., accepted] if counts.len() == 5 => (*received, *accepted),
        _ => panic!("no import updates in {peer}'s protocol:\n{text}"),
    }
}

/// The LoadBalancer Services' pool, announced by BGP.
const POOL_BY_BGP: &str = "[kubernetes]\ndefault_class = true\ninterfaces = [\"ext0\"]\n\
     [[pool]]\nname = \"default\"\naddresses = [\"198.18.1.100-198.18.1.101\"]\nannounce = \"bgp\"\n";

#[privileged_test]
fn a_local_load_balancer_service_is_announced_by_the_nodes_of_its_endpoints() {
    let _serial = one_at_a_time();
    in_new_netns(|| {
        let (mut lan, _rt, api) = lan_and_api("el-bgplocal", 2);
        let kubeconfig = Kubeconfig::write(&api.url());
        let router = Router::start(&lan, "el-bgplocal");
        nodes_are_gateways(&lan);
        place_web(&api, "node2");
        let config = format!(
            "[bgp]\nasn = {NODE_ASN}\n[[bgp.peer]]\naddress = \"{ROUTER}\"\nasn = {ROUTER_ASN}\n\
             {POOL_BY_BGP}"
        );
        for n in &mut lan.nodes {
            n.start(kubeconfig.path(), &config);
        }
        let mut web = load_balancer_service("web", &[("http", 80, 8080)]);
        web.spec.as_mut().unwrap().external_traffic_policy = Some("Local".into());
        api.apply_service(web);
        let given = wait_until(Duration::from_secs(30), || {
            api.service("default", "web").and_then(|s| ingress_ip(&s)).as_deref() == Some(VIP_IP)
        });
        assert!(given, "web was not given {VIP_IP}\n{}", bgp_state(&lan, &router));
        // Only the node of the endpoint announces; the server sees the
        // client's own address. Then the endpoint moves, and the route.
        for (k, name) in [(2, "node2"), (1, "node1")] {
            place_web(&api, name);
            let only = wait_until(FIRST_SERVING, || router.next_hops(VIP_IP) == [node(k)]);
            let hops = router.next_hops(VIP_IP);
            assert!(only, "{name}: the router has {hops:?}\n{}", bgp_state(&lan, &router));
            for _ in 0..5 {
                let (answered, seen) = lan.client.run(|| {
                    let vip: SocketAddr = VIP.parse().unwrap();
                    let stream = TcpStream::connect_timeout(&vip, Duration::from_millis(500))
                        .expect("a connect through the router");
                    let answered = who(&stream).unwrap();
                    let stream =
                        TcpStream::connect_timeout(&vip, Duration::from_millis(500)).unwrap();
                    (answered, peer(&stream).unwrap())
                });
                assert_eq!(answered, name, "another node's server answered");
                assert_eq!(seen.ip().to_string(), "198.18.0.10", "the server saw {seen}");
            }
        }
        for n in &lan.nodes {
            lb_user::bgp::stop_speaker(&n.daemon().dir.join("state"));
        }
        drop(router);
    });
}
