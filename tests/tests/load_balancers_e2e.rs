//! LoadBalancer Services end to end (issue 41): the daemon follows a fake
//! Kubernetes API server (the real list and watch protocol,
//! `lb_tests::fakes`) in the node's network namespace and serves the
//! Services' addresses to a client on another machine, through the node's
//! XDP program (see `tests/tests/external/` for the topology). Needs root;
//! see `lb_tests::privileged`.

use std::{
    collections::BTreeSet,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use lb_tests::{
    Daemon, TestCgroup,
    fakes::{
        apiserver::{
            Condition, FakeApiServer, Kubeconfig, endpoint, endpoint_slice, ingress_ip,
            load_balancer_service,
        },
        runtime,
    },
    in_new_netns, privileged_test,
    rolling_update::{Vip, metallb_474},
    topology::{SERVING_WITHIN, Topology, client_neighbour, peer, who},
    wait_until,
};

/// A LoadBalancer Service end to end (issue 41): created in the fake API
/// server with no address, it is given one from the config's pool
/// (`status.loadBalancer.ingress`), the node announces it (the client has
/// the pool's subnet on its link and asks who has the address: only an
/// announcing node answers) and the client's connects land on its
/// endpoints; deleted, it is withdrawn and its address goes to the next
/// Service, a dual-stack one, served on both families.
#[privileged_test]
fn a_load_balancer_service_is_given_an_address_announced_and_served() {
    in_new_netns(|| {
        use Condition::Ready;
        let net = Topology::on_link();
        let rt = runtime();
        let api = rt.block_on(FakeApiServer::start());
        let kubeconfig = Kubeconfig::write(&api.url());
        let pod1 = net.server("pod-1", "198.18.2.2:8080");
        let pod2 = net.server("pod-2", "198.18.2.3:8080");
        let endpoints = vec![
            endpoint(&pod1.addr.ip().to_string(), "node-a", Ready),
            endpoint(&pod2.addr.ip().to_string(), "node-b", Ready),
        ];
        api.apply(endpoint_slice("web-1", "web", "IPv4", &[("http", 8080)], endpoints.clone()));
        api.apply(endpoint_slice("shop-1", "shop", "IPv4", &[("http", 8080)], endpoints));
        let pod6 = net.server("pod-6", "[2001:2:0:2::2]:8080");
        let endpoints6 = vec![endpoint(&pod6.addr.ip().to_string(), "node-a", Ready)];
        api.apply(endpoint_slice("shop-6", "shop", "IPv6", &[("http", 8080)], endpoints6));
        api.apply_service(load_balancer_service("web", &[("http", 80, 8080)]));

        let cgroup = TestCgroup::new("external-lbsvc");
        let mut daemon = Daemon::start_with(
            "external-lbsvc",
            &cgroup,
            &format!("kubeconfig = {:?}\nnode_name = \"node-a\"\n", kubeconfig.path()),
            "[kubernetes]\ndefault_class = true\ninterfaces = [\"ext0\"]\n\
             [[pool]]\nname = \"default\"\n\
             addresses = [\"198.18.1.100-198.18.1.101\", \"2001:2:0:1::100-2001:2:0:1::101\"]\n",
        );
        let address = |name: &str| ingress_ip(&api.service("default", name)?);
        let given = wait_until(SERVING_WITHIN, || address("web").is_some());
        assert!(given, "web was given no address\n{}", daemon.log());
        assert_eq!(address("web").as_deref(), Some("198.18.1.100"), "the pool's first");

        // Served from another machine, on its endpoints.
        let vip: SocketAddr = "198.18.1.100:80".parse().unwrap();
        let greeted = |vip: SocketAddr| {
            net.client.run(move || {
                let stream = TcpStream::connect_timeout(&vip, Duration::from_secs(1)).ok()?;
                who(&stream).ok()
            })
        };
        let served = wait_until(SERVING_WITHIN, || greeted(vip).is_some());
        assert!(served, "{vip} never answered\n{}", daemon.log());
        let mut pods = BTreeSet::new();
        for _ in 0..40 {
            pods.insert(greeted(vip).expect("a connect through the LoadBalancer address"));
        }
        assert_eq!(pods, BTreeSet::from(["pod-1".to_owned(), "pod-2".to_owned()]), "spread");
        assert!(client_neighbour(&net, "198.18.1.100").is_some(), "the node answers its ARP");
        let status = daemon.status();
        let names: Vec<&str> = status["services"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s["name"].as_str())
            .collect();
        assert_eq!(names, ["default/web@198.18.1.100:80"], "lb status lists it");
        let lbs = &status["load_balancers"];
        assert_eq!(lbs["allocating"], true, "the only node allocates: {lbs}");
        let web = &lbs["services"][0];
        assert_eq!(web["service"], "default/web", "{lbs}");
        assert_eq!(web["addresses"][0], "198.18.1.100");
        assert_eq!(web["pool"], "default");
        assert_eq!(web["ports"][0], 80);
        assert_eq!(web["served_as"][0], "default/web@198.18.1.100:80");
        let table = daemon.lb(&["status"]);
        assert!(
            table.contains("LoadBalancer Services (this node allocates):")
                && table.contains("default/web 198.18.1.100 pool default, Cluster, ports 80"),
            "{table}"
        );

        // A daemon killed and restarted: the kernel serves on meanwhile, the
        // new daemon serves the Service from the start (the state file),
        // before its watch has listed, and nothing is written: no address
        // changes.
        let writes = api.service_writes().len();
        let added = daemon.log().matches("service added").count();
        daemon.kill();
        assert!(greeted(vip).is_some(), "fail-static: the kernel serves on without the daemon");
        daemon.restart();
        assert!(greeted(vip).is_some(), "served right after the restart\n{}", daemon.log());
        std::thread::sleep(Duration::from_secs(1));
        assert!(greeted(vip).is_some(), "served after the restart\n{}", daemon.log());
        // Made at start-up from the state file, not added when the watch
        // listed (the log is the runs' one after the other).
        let log = daemon.log();
        assert_eq!(log.matches("service added").count(), added, "{log}");
        assert!(!log.contains("service removed"), "{log}");
        assert_eq!(address("web").as_deref(), Some("198.18.1.100"));
        assert_eq!(api.service_writes().len(), writes, "a restart writes nothing");

        // Deleted: withdrawn, and its address given to the next Service,
        // dual-stack: IPv6 announced by NDP and served on the IPv6 pod.
        api.delete_service("default", "web").unwrap();
        let withdrawn = wait_until(SERVING_WITHIN, || greeted(vip).is_none());
        assert!(withdrawn, "{vip} still answers after its Service was deleted");
        let mut shop = load_balancer_service("shop", &[("http", 80, 8080)]);
        let spec = shop.spec.as_mut().unwrap();
        spec.ip_families = Some(vec!["IPv4".into(), "IPv6".into()]);
        spec.ip_family_policy = Some("RequireDualStack".into());
        api.apply_service(shop);
        let both = || {
            let status = api.service("default", "shop")?.status?.load_balancer?.ingress?;
            Some(status.into_iter().filter_map(|i| i.ip).collect::<Vec<_>>())
        };
        let reused = wait_until(SERVING_WITHIN, || both().is_some_and(|ips| ips.len() == 2));
        assert!(reused, "shop was given no addresses: {:?}\n{}", both(), daemon.log());
        assert_eq!(both().unwrap(), ["198.18.1.100", "2001:2:0:1::100"], "back in the pool");
        let served = wait_until(SERVING_WITHIN, || greeted(vip).is_some());
        assert!(served, "{vip} never answered for shop\n{}", daemon.log());
        let vip6: SocketAddr = "[2001:2:0:1::100]:80".parse().unwrap();
        let served6 = wait_until(SERVING_WITHIN, || greeted(vip6).as_deref() == Some("pod-6"));
        assert!(served6, "{vip6} never answered from pod-6\n{}", daemon.log());
        assert!(client_neighbour(&net, "2001:2:0:1::100").is_some(), "NDP answered");
        drop(daemon);
        drop(cgroup);
    });
}

/// MetalLB 474's rolling update through a LoadBalancer Service: its address from
/// the pool, its servers its EndpointSlices' endpoints, judged by their
/// conditions alone (no active check).
#[privileged_test]
fn metallb_474_rolling_update_through_a_load_balancer_service() {
    in_new_netns(|| metallb_474(Vip::LoadBalancer));
}

/// `externalTrafficPolicy: Local` (issue 41): only a node with a ready
/// endpoint of its own announces the address and serves it, from that
/// endpoint alone, and the server sees the client's own address (the
/// pods' gateway is the node, as in a cluster, so their replies pass
/// through it and are translated back); the node's
/// `healthCheckNodePort` says how many local endpoints it has, `503`
/// with none. IPv4 and IPv6.
#[privileged_test]
fn a_local_service_is_served_only_from_a_local_endpoint_keeping_the_client() {
    in_new_netns(|| {
        use Condition::Ready;
        const HEALTH_PORT: u16 = 31_999;
        let net = Topology::on_link();
        net.servers.sh(&["ip", "route", "add", "198.18.0.0/24", "via", "198.18.2.1"]);
        net.servers.sh(&["ip", "-6", "route", "add", "2001:2::/64", "via", "2001:2:0:2::1"]);
        let rt = runtime();
        let api = rt.block_on(FakeApiServer::start());
        let kubeconfig = Kubeconfig::write(&api.url());
        let _pod = net.server("pod-1", "198.18.2.2:8080");
        let _pod6 = net.server("pod-6", "[2001:2:0:2::2]:8080");
        // The pods run on `node`.
        let place = |node: &str| {
            let at = |ip: &str| vec![endpoint(ip, node, Ready)];
            api.apply(endpoint_slice("web-4", "web", "IPv4", &[("http", 8080)], at("198.18.2.2")));
            api.apply(endpoint_slice(
                "web-6",
                "web",
                "IPv6",
                &[("http", 8080)],
                at("2001:2:0:2::2"),
            ));
        };
        place("node-b");
        let mut web = load_balancer_service("web", &[("http", 80, 8080)]);
        let spec = web.spec.as_mut().unwrap();
        spec.external_traffic_policy = Some("Local".into());
        spec.health_check_node_port = Some(i32::from(HEALTH_PORT));
        spec.ip_families = Some(vec!["IPv4".into(), "IPv6".into()]);
        spec.ip_family_policy = Some("RequireDualStack".into());
        api.apply_service(web);

        let cgroup = TestCgroup::new("external-lblocal");
        let daemon = Daemon::start_with(
            "external-lblocal",
            &cgroup,
            &format!("kubeconfig = {:?}\nnode_name = \"node-a\"\n", kubeconfig.path()),
            "[kubernetes]\ndefault_class = true\ninterfaces = [\"ext0\"]\n\
             [[pool]]\nname = \"default\"\n\
             addresses = [\"198.18.1.100\", \"2001:2:0:1::100\"]\n",
        );
        let (vip, vip6): (SocketAddr, SocketAddr) =
            ("198.18.1.100:80".parse().unwrap(), "[2001:2:0:1::100]:80".parse().unwrap());
        let seen_by_server = |vip: SocketAddr| {
            net.client.run(move || {
                let stream = TcpStream::connect_timeout(&vip, Duration::from_secs(1)).ok()?;
                peer(&stream).ok()
            })
        };
        // kube-proxy's answer on the node's address: (status, body).
        let health = || {
            net.client.run(|| {
                let to: SocketAddr = format!("198.18.0.1:{HEALTH_PORT}").parse().unwrap();
                let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(1)).ok()?;
                s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                s.write_all(b"GET /healthz HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
                    .ok()?;
                let mut text = String::new();
                s.read_to_string(&mut text).ok()?;
                let status = text.split_whitespace().nth(1)?.parse::<u16>().ok()?;
                Some((status, text.split("\r\n\r\n").nth(1)?.to_owned()))
            })
        };

        // Allocated, but this node has no endpoint of it: silent.
        let given = wait_until(SERVING_WITHIN, || {
            let status =
                api.service("default", "web").and_then(|s| s.status?.load_balancer?.ingress);
            status.is_some_and(|ingress| ingress.len() == 2)
        });
        assert!(given, "web was given no addresses\n{}", daemon.log());
        let answered = wait_until(SERVING_WITHIN, || health().is_some_and(|(code, _)| code == 503));
        assert!(answered, "healthCheckNodePort: {:?}\n{}", health(), daemon.log());
        let (_, body) = health().unwrap();
        assert!(
            body.contains(r#""localEndpoints":0"#) && body.contains(r#""name":"web""#),
            "{body}"
        );
        let status = daemon.status();
        let web = &status["load_balancers"]["services"][0];
        assert_eq!(web["traffic_policy"], "Local", "{web}");
        // Its local clients are the host's (kube-proxy's rules), not lb's:
        // this node has no endpoint to give them.
        for service in status["services"].as_array().unwrap() {
            assert_eq!(service["scope"], "none", "{service}");
        }
        std::thread::sleep(Duration::from_secs(2));
        assert_eq!(seen_by_server(vip), None, "served with no local endpoint");
        assert_eq!(
            client_neighbour(&net, "198.18.1.100"),
            None,
            "announced with no local endpoint"
        );

        // The pods move to this node: announced, served from them, and the
        // servers see the client's own address.
        place("node-a");
        let client4: SocketAddr = "198.18.0.10:0".parse().unwrap();
        let served = wait_until(SERVING_WITHIN, || seen_by_server(vip).is_some());
        assert!(served, "{vip} never answered\n{}", daemon.log());
        for _ in 0..10 {
            let seen = seen_by_server(vip).expect("a connect through the Local address");
            assert_eq!(seen.ip(), client4.ip(), "the server saw {seen}, not the client");
        }
        let served6 = wait_until(SERVING_WITHIN, || seen_by_server(vip6).is_some());
        assert!(served6, "{vip6} never answered\n{}", daemon.log());
        let seen6 = seen_by_server(vip6).unwrap();
        assert_eq!(seen6.ip().to_string(), "2001:2::10", "the server saw {seen6}, not the client");
        assert!(client_neighbour(&net, "198.18.1.100").is_some(), "ARP answered");
        let healthy = wait_until(SERVING_WITHIN, || health().is_some_and(|(code, _)| code == 200));
        assert!(healthy, "healthCheckNodePort: {:?}", health());
        assert!(health().unwrap().1.contains(r#""localEndpoints":1"#));

        // They move away again: withdrawn.
        place("node-b");
        let withdrawn = wait_until(SERVING_WITHIN, || seen_by_server(vip).is_none());
        assert!(withdrawn, "{vip} still served with no local endpoint\n{}", daemon.log());
        let unhealthy =
            wait_until(SERVING_WITHIN, || health().is_some_and(|(code, _)| code == 503));
        assert!(unhealthy, "healthCheckNodePort: {:?}", health());
        drop(daemon);
        drop(cgroup);
    });
}

/// Requested, shared and exhausted end to end (issue 41): a Service asks
/// for the pool's second address by MetalLB's annotation and gets it; two
/// Services share the first by a sharing key, each on its own port, each
/// port served on its own Service's endpoint from another machine; a
/// fourth finds the pool exhausted: pending, an Event says why, and the
/// others are still served, unchanged.
#[privileged_test]
fn requested_shared_and_exhausted_addresses_end_to_end() {
    in_new_netns(|| {
        use Condition::Ready;
        const SHARING: &str = "lb.dev/allow-shared-ip";
        let net = Topology::on_link();
        let rt = runtime();
        let api = rt.block_on(FakeApiServer::start());
        let kubeconfig = Kubeconfig::write(&api.url());
        let _pod1 = net.server("pod-1", "198.18.2.2:8080");
        let _pod2 = net.server("pod-2", "198.18.2.3:8080");
        let _pod3 = net.server("pod-3", "198.18.2.4:8080");
        for (service, ip) in [("asks", "198.18.2.2"), ("dns", "198.18.2.3"), ("dot", "198.18.2.4")]
        {
            let ready = vec![endpoint(ip, "node-a", Ready)];
            api.apply(endpoint_slice(
                &format!("{service}-1"),
                service,
                "IPv4",
                &[("p", 8080)],
                ready,
            ));
        }
        let with = |name: &str, port: u16, annotations: &[(&str, &str)]| {
            let mut service = load_balancer_service(name, &[("p", port, 8080)]);
            service.metadata.annotations =
                Some(annotations.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect());
            service
        };
        api.apply_service(with(
            "asks",
            80,
            &[("metallb.universe.tf/loadBalancerIPs", "198.18.1.101")],
        ));
        api.apply_service(with("dns", 53, &[(SHARING, "edge")]));
        api.apply_service(with("dot", 853, &[(SHARING, "edge")]));

        let cgroup = TestCgroup::new("external-lbshare");
        let daemon = Daemon::start_with(
            "external-lbshare",
            &cgroup,
            &format!("kubeconfig = {:?}\nnode_name = \"node-a\"\n", kubeconfig.path()),
            "[kubernetes]\ndefault_class = true\ninterfaces = [\"ext0\"]\n\
             [[pool]]\nname = \"default\"\naddresses = [\"198.18.1.100-198.18.1.101\"]\n",
        );
        let address = |name: &str| ingress_ip(&api.service("default", name)?);
        let given = wait_until(SERVING_WITHIN, || {
            ["asks", "dns", "dot"].iter().all(|name| address(name).is_some())
        });
        assert!(given, "not every Service was given an address\n{}", daemon.log());
        assert_eq!(address("asks").as_deref(), Some("198.18.1.101"), "the address asked for");
        assert_eq!(address("dns").as_deref(), Some("198.18.1.100"));
        assert_eq!(address("dot").as_deref(), Some("198.18.1.100"), "shared on purpose");
        let greeted = |to: &str| {
            let to: SocketAddr = to.parse().unwrap();
            net.client.run(move || {
                let stream = TcpStream::connect_timeout(&to, Duration::from_secs(1)).ok()?;
                who(&stream).ok()
            })
        };
        let every = [
            ("198.18.1.101:80", "pod-1"),
            ("198.18.1.100:53", "pod-2"),
            ("198.18.1.100:853", "pod-3"),
        ];
        let all_served = || every.iter().all(|(vip, pod)| greeted(vip).as_deref() == Some(*pod));
        assert!(wait_until(SERVING_WITHIN, all_served), "not all served\n{}", daemon.log());

        // The pool is exhausted: the next stays pending, told why, and
        // nothing else moves.
        let writes = api.service_writes().len();
        api.apply_service(with("late", 80, &[]));
        let told = wait_until(SERVING_WITHIN, || {
            api.events().iter().any(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("late")
                    && e.reason.as_deref() == Some("AllocationFailed")
                    && e.note.as_deref().is_some_and(|n| n.contains("has an IPv4 address left"))
            })
        });
        assert!(told, "no AllocationFailed event: {:#?}", api.events());
        assert_eq!(address("late"), None, "pending");
        assert_eq!(api.service_writes().len(), writes, "nothing else written");
        assert!(all_served(), "another Service was disturbed\n{}", daemon.log());
        assert_eq!(address("asks").as_deref(), Some("198.18.1.101"));
        assert_eq!(address("dot").as_deref(), Some("198.18.1.100"));
        drop(daemon);
        drop(cgroup);
    });
}
