//! Other network namespaces (pods'): a `host`-scoped service leaves them
//! alone; with `scope = "all"` their connects are rewritten and their
//! connections closed like the node's. Needs root; see
//! `lb_tests::privileged`.

use std::time::Duration;

use lb_tests::{
    Backend, Client, Daemon, ServiceBuilder, TestCgroup, addr, hardening::connect_from_own_netns,
    privileged_test, wait_until,
};

const CLIENT: &str = env!("CARGO_BIN_EXE_lb-test-client");

/// Long enough that a failure mark is still "recent" when a test looks.
const HOLD_DOWN: Duration = Duration::from_secs(60);

fn client(cgroup: &TestCgroup) -> Client {
    Client::start(CLIENT, Some(cgroup))
}

/// A process in the attached cgroup but in a network namespace of its own,
/// with its own listener on the VIP's address, reaches that listener while
/// the service is `host`-scoped (the default for a loopback VIP); with
/// `scope = "all"` the same connect is rewritten. Before, it was always
/// rewritten (to the server address, inside its own namespace).
#[privileged_test]
fn a_host_scoped_service_leaves_other_network_namespaces_alone() {
    let cgroup = TestCgroup::new("netns");
    let s1 = Backend::start("s1", addr(62, 1, 0));
    let vip = addr(62, 100, 6444);
    let service = ServiceBuilder::new("api", vip).servers(&[s1.addr]).hold_down(HOLD_DOWN);
    let daemon = Daemon::start("netns", &cgroup, &service.toml());
    // `Datapath::netns_scope` as status shows it: false when this kernel
    // cannot tell the daemon's namespace (no SO_NETNS_COOKIE, Linux 5.14,
    // and the daemon is not in the initial namespace); never here, where
    // the daemon runs in the initial namespace.
    let datapath = &daemon.status()["datapath"];
    assert!(
        datapath["netns_scope"] != false && datapath["features"]["netns_scope"] != false,
        "{datapath}"
    );
    let mut host = client(&cgroup);
    assert_eq!(
        host.once(vip).as_deref(),
        Ok("s1"),
        "in the daemon's namespace the VIP is rewritten"
    );
    let state = daemon.server_field(s1.addr, "state");

    let answer = connect_from_own_netns(CLIENT, &cgroup, vip, s1.addr);
    assert_eq!(
        answer,
        format!("ok {vip} pod-vip"),
        "from another network namespace, a host-scoped VIP must reach that namespace's own listener"
    );
    assert_eq!(s1.accepted(), 1, "only the host's connect reached s1");
    assert!(daemon.counter("connect_other_netns") >= 1);
    assert_eq!(
        daemon.server_field(s1.addr, "state"),
        state,
        "the host's server state changed:\n{}",
        daemon.log()
    );
    assert_eq!(daemon.server_field(s1.addr, "recently_failed"), false);
    assert_eq!(daemon.counter("sockops_connect_failed"), 0);

    // scope = "all": the same connect is rewritten, to the server's address
    // inside that namespace (where its own listener answers `pod-server`).
    daemon.write_config(&cgroup, &service.raw("scope = \"all\"").toml());
    daemon.signal(libc::SIGHUP);
    let mut last = String::new();
    assert!(
        wait_until(Duration::from_secs(10), || {
            last = connect_from_own_netns(CLIENT, &cgroup, vip, s1.addr);
            last.ends_with("pod-server")
        }),
        "with scope = \"all\" the connect from the other namespace was not rewritten: {last}\n{}",
        daemon.log()
    );
    assert_eq!(last, format!("ok {vip} pod-server"), "getpeername shows the VIP there too");
    assert_eq!(host.once(vip).as_deref(), Ok("s1"));
}

/// With `scope = "all"`, a pod's connection through a VIP (made from a
/// network namespace of its own) is closed as the node's are: by
/// `lb close-connections` and when its server leaves the service. Before,
/// SOCK_DESTROY acted only in lb's own namespace, so the pod kept its
/// connection to a server lb had moved traffic off.
#[privileged_test]
fn pods_connections_through_a_vip_are_closed_in_their_namespaces() {
    let cgroup = TestCgroup::new("podclose");
    let s1 = Backend::start("s1", addr(73, 1, 0));
    let s2 = Backend::start("s2", addr(73, 2, 0));
    let vip = addr(73, 100, 6444);
    let service = ServiceBuilder::new("api", vip)
        .servers(&[s1.addr, s2.addr])
        .hold_down(HOLD_DOWN)
        .raw("scope = \"all\"");
    let daemon = Daemon::start("podclose", &cgroup, &service.toml());
    if !daemon.has_feature("close_in_pods") {
        return;
    }
    let mut clients = client(&cgroup);

    // By request: the node's connection and the pod's.
    let node = clients.connect(vip);
    assert_eq!(node.landed(), "s1");
    let pod = clients.pod(vip, s1.addr);
    assert_eq!(pod.landed(), "pod-server", "the pod's connect was not rewritten: {pod:?}");
    assert_eq!(pod.peer(), vip, "the pod's application sees the VIP");
    let out = daemon.lb(&["close-connections", &s1.addr.to_string()]);
    assert!(out.contains("closed 2 connections"), "{out}\n{}", daemon.log());
    for (who, id) in [("node", node.id()), ("pod", pod.id())] {
        assert!(
            wait_until(Duration::from_secs(2), || !clients.alive(id)),
            "the {who}'s connection through the VIP was not reset"
        );
    }

    // By the balancer: s1 leaves the service, and its connections go.
    let pod = clients.pod(vip, s1.addr);
    assert_eq!(pod.landed(), "pod-server");
    daemon.write_config(&cgroup, &service.clone().servers(&[s2.addr]).toml());
    daemon.signal(libc::SIGHUP);
    assert!(
        wait_until(Duration::from_secs(10), || !clients.alive(pod.id())),
        "the pod's connection to a removed server was not closed:\n{}",
        daemon.log()
    );
    assert_eq!(clients.connect(vip).landed(), "s2");
}
