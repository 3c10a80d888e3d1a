//! LoadBalancer Services on three nodes (issue 41): every node runs the
//! same config (a pool, `default_class`), none names a service. One node
//! allocates (elected by membership), one node answers ARP for each
//! address, and when the allocating node's daemon is killed another
//! allocates the next Service, without moving any address. A Service
//! with `externalTrafficPolicy: Local` is answered by the node its
//! endpoint is on, and by no other, keeping the client's address.

use std::{
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use lb_tests::{
    fakes::apiserver::{
        Condition, FakeApiServer, Kubeconfig, endpoint, endpoint_slice, ingress_ip,
        load_balancer_service,
    },
    in_new_netns,
    lan::{
        FIRST_SERVING, Lan, VIP, VIP_IP, lan_and_api, nodes_are_gateways, one_at_a_time, place_web,
    },
    privileged_test,
    topology::{peer, who},
    wait_until,
};

const CONFIG: &str = "[kubernetes]\ndefault_class = true\ninterfaces = [\"ext0\"]\n\
     [[pool]]\nname = \"default\"\naddresses = [\"198.18.1.100-198.18.1.101\"]\n";

fn logs(lan: &Lan) -> String {
    let logs: Vec<String> =
        lan.nodes.iter().map(|n| format!("--- {}:\n{}", n.name, n.daemon().log())).collect();
    logs.join("\n")
}

/// The nodes whose daemon logged assigning an address to `service`.
fn allocated_by(lan: &Lan, service: &str) -> Vec<usize> {
    let line = format!("service=default/{service}");
    (0..lan.nodes.len())
        .filter(|&i| {
            lan.nodes[i]
                .daemon()
                .log()
                .lines()
                .any(|l| l.contains("LoadBalancer address assigned") && l.contains(&line))
        })
        .collect()
}

/// Waits until `service`'s status shows `ip`.
#[track_caller]
fn wait_address(api: &FakeApiServer, lan: &Lan, service: &str, ip: &str) {
    let given = wait_until(Duration::from_secs(30), || {
        api.service("default", service).and_then(|s| ingress_ip(&s)).as_deref() == Some(ip)
    });
    assert!(given, "{service} was not given {ip}\n{}", logs(lan));
}

#[privileged_test]
fn one_node_allocates_one_answers_and_a_killed_allocator_is_replaced() {
    let _serial = one_at_a_time();
    in_new_netns(|| {
        let (mut lan, _rt, api) = lan_and_api("el-lbsvc", 3);
        let kubeconfig = Kubeconfig::write(&api.url());
        // Every node's server is 198.18.2.2:8080, behind that node.
        for service in ["web", "shop"] {
            let pod = endpoint("198.18.2.2", "node1", Condition::Ready);
            let slice = endpoint_slice(
                &format!("{service}-1"),
                service,
                "IPv4",
                &[("http", 8080)],
                vec![pod],
            );
            api.apply(slice);
        }
        for node in &mut lan.nodes {
            node.start(kubeconfig.path(), CONFIG);
        }
        api.apply_service(load_balancer_service("web", &[("http", 80, 8080)]));
        wait_address(&api, &lan, "web", VIP_IP);
        let answered = wait_until(FIRST_SERVING, || lan.ask().is_ok());
        assert!(answered, "{VIP_IP} never answered\n{}", logs(&lan));

        // One writer, once; one node answering ARP for the address.
        let written: Vec<_> =
            api.service_writes().into_iter().filter(|w| w.status == 200).collect();
        assert_eq!(written.len(), 1, "{written:?}\n{}", logs(&lan));
        let mut allocator = Vec::new();
        wait_until(Duration::from_secs(5), || {
            allocator = allocated_by(&lan, "web");
            !allocator.is_empty()
        });
        assert_eq!(allocator.len(), 1, "one node allocates: {allocator:?}\n{}", logs(&lan));
        let mac = lan.client_neighbour().expect("a node answers ARP for the address");
        let answering: Vec<&str> =
            lan.nodes.iter().filter(|n| n.mac == mac).map(|n| n.name.as_str()).collect();
        assert_eq!(answering.len(), 1, "{mac}: {answering:?}");
        let served_by = lan.ask().expect("a connect through the address");
        assert_eq!(served_by, answering[0], "the announcing node forwards to its server");

        // The allocating node's daemon dies: another allocates the next
        // Service, and web keeps its address.
        let killed = allocator[0];
        lan.nodes[killed].daemon_mut().kill();
        api.apply_service(load_balancer_service("shop", &[("http", 80, 8080)]));
        wait_address(&api, &lan, "shop", "198.18.1.101");
        // The allocator logs its assignment after the write the status
        // shows: a moment later.
        let mut now = Vec::new();
        wait_until(Duration::from_secs(5), || {
            now = allocated_by(&lan, "shop");
            !now.is_empty()
        });
        assert!(now.len() == 1 && now[0] != killed, "shop allocated by {now:?}\n{}", logs(&lan));
        assert_eq!(
            api.service("default", "web").and_then(|s| ingress_ip(&s)).as_deref(),
            Some(VIP_IP),
            "web kept its address"
        );
    });
}

#[privileged_test]
fn a_local_service_is_answered_only_by_the_node_of_its_endpoint() {
    let _serial = one_at_a_time();
    in_new_netns(|| {
        let (mut lan, _rt, api) = lan_and_api("el-lblocal", 3);
        let kubeconfig = Kubeconfig::write(&api.url());
        nodes_are_gateways(&lan);
        place_web(&api, "node2");
        for node in &mut lan.nodes {
            node.start(kubeconfig.path(), CONFIG);
        }
        let mut web = load_balancer_service("web", &[("http", 80, 8080)]);
        web.spec.as_mut().unwrap().external_traffic_policy = Some("Local".into());
        api.apply_service(web);
        wait_address(&api, &lan, "web", VIP_IP);
        // Which node's server answers, and whom it sees.
        let ask = || {
            lan.client.run(|| {
                let vip: SocketAddr = VIP.parse().unwrap();
                let stream = TcpStream::connect_timeout(&vip, Duration::from_millis(500)).ok()?;
                let name = who(&stream).ok()?;
                let stream = TcpStream::connect_timeout(&vip, Duration::from_millis(500)).ok()?;
                Some((name, peer(&stream).ok()?))
            })
        };
        for (node, mac) in [("node2", &lan.nodes[1].mac), ("node3", &lan.nodes[2].mac)] {
            place_web(&api, node);
            let moved = wait_until(FIRST_SERVING, || {
                ask().is_some_and(|(name, _)| name == node)
                    && lan.client_neighbour().as_ref() == Some(mac)
            });
            assert!(moved, "{node} never answered alone: {:?}\n{}", ask(), logs(&lan));
            for _ in 0..5 {
                let (name, seen) = ask().expect("a connect through the Local address");
                assert_eq!(name, node, "another node's server answered");
                assert_eq!(seen.ip().to_string(), "198.18.0.10", "the server saw {seen}");
            }
            let announcing: Vec<&str> = lan
                .nodes
                .iter()
                .filter(|n| n.daemon().log().contains("announcing vip=198.18.1.100"))
                .map(|n| n.name.as_str())
                .collect();
            assert!(!announcing.contains(&"node1"), "node1 has no endpoint: {announcing:?}");
            // The client learns the MAC again when the node changes.
            lan.client.sh(&["ip", "neigh", "flush", "dev", "c0"]);
        }
    });
}
