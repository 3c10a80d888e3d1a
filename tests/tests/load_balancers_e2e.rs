//! LoadBalancer Services end to end (issue 41): the daemon follows a fake
//! Kubernetes API server (the real list and watch protocol,
//! `lb_tests::fakes`) in the node's network namespace and serves the
//! Services' addresses to a client on another machine, through the node's
//! XDP program (see `tests/tests/external/` for the topology). Needs root;
//! see `lb_tests::privileged`.

use std::{
    collections::BTreeSet,
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
    topology::{SERVING_WITHIN, Topology, client_neighbour, who},
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
