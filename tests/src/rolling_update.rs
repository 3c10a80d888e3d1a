//! MetalLB issue 474's rolling update through the external path, from a
//! client on another machine, for `tests/tests/external_discovery.rs`
//! (the VIP a `[[service]]` with discovery) and
//! `tests/tests/load_balancers_e2e.rs` (the VIP a LoadBalancer Service's).
//! The daemon follows a fake Kubernetes API server (the real list and
//! watch protocol, `crate::fakes`) in the node's network namespace; the
//! pods are servers in the servers' namespace and the client connects
//! from its own, through the node's XDP program.

use std::{
    collections::{BTreeSet, HashMap},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use crate::{
    Daemon, TestCgroup,
    fakes::{
        apiserver::{
            Condition, FakeApiServer, Kubeconfig, endpoint, endpoint_slice, load_balancer_service,
        },
        runtime,
    },
    topology::{Topology, VIP4, who},
    wait_until,
};

/// One connect of the client loop: when it started and ended (since the
/// loop's start) and which pod greeted it, or why none did.
#[derive(Debug)]
struct Attempt {
    start: Duration,
    end: Duration,
    outcome: Result<String, String>,
}

/// The servers `lb status` says the kernel selects: (all, the ready ones
/// that lead).
fn selected(daemon: &Daemon) -> Vec<SocketAddr> {
    daemon.status()["services"][0]["selected"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

/// Waits until the kernel selects exactly `ready` then `serving` (drained),
/// the ready ones first; returns when that was seen.
#[track_caller]
fn wait_view(daemon: &Daemon, ready: &[SocketAddr], serving: &[SocketAddr], what: &str) -> Instant {
    let want: BTreeSet<SocketAddr> = ready.iter().chain(serving).copied().collect();
    let lead: BTreeSet<SocketAddr> = ready.iter().copied().collect();
    let mut last = Vec::new();
    let seen = wait_until(Duration::from_secs(20), || {
        last = selected(daemon);
        last.len() == want.len()
            && last.iter().copied().collect::<BTreeSet<_>>() == want
            && last.iter().take(ready.len()).copied().collect::<BTreeSet<_>>() == lead
    });
    assert!(
        seen,
        "{what}: selected never became {ready:?} then {serving:?}; last {last:?}\n{}",
        daemon.log()
    );
    Instant::now()
}

/// How the rolling update's VIP is configured.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Vip {
    /// A `[[service]]` with `[service.discovery]`.
    Configured,
    /// A LoadBalancer Service given `VIP4` from a pool of one address.
    LoadBalancer,
}

/// MetalLB 474 through the external path: a 2-replica rolling update
/// where each new pod, not ready yet, lands on the node of the remaining
/// old, ready pod (first on its IP with another port, then with its own
/// IP). A client on another machine connects through the VIP, configured
/// `how`, for the whole update. Not one connect may fail; while a new pod
/// was not ready, the old ready pod on its node kept getting connects (the
/// MetalLB bug withdrew that node); the new pods get connects once ready.
/// Call it in a fresh network namespace (the node's).
pub fn metallb_474(how: Vip) {
    use Condition::{NotReady, Ready, TerminatingNotServing, TerminatingServing};
    let net = Topology::new();
    let rt = runtime();
    // In the node's namespace, where the daemon runs.
    let api = rt.block_on(FakeApiServer::start());
    let kubeconfig = Kubeconfig::write(&api.url());
    let old1 = net.server("old-1", "198.18.2.2:8080");
    let old2 = net.server("old-2", "198.18.2.3:8080");
    let new1 = net.server("new-1", "198.18.2.3:9090"); // old-2's IP, another port
    let new2 = net.server("new-2", "198.18.2.4:9090"); // old-2's node, its own IP
    let (o1, o2, n1, n2) = (old1.addr, old2.addr, new1.addr, new2.addr);
    let slice = |name: &str, port: u16, list: &[(SocketAddr, &str, Condition)]| {
        let endpoints =
            list.iter().map(|(a, node, c)| endpoint(&a.ip().to_string(), node, *c)).collect();
        api.apply(endpoint_slice(name, "web", "IPv4", &[("http", port)], endpoints));
    };
    let old = |list: &[(SocketAddr, &str, Condition)]| slice("web-old", 8080, list);
    let new = |list: &[(SocketAddr, &str, Condition)]| slice("web-new", 9090, list);
    old(&[(o1, "node-a", Ready), (o2, "node-b", Ready)]);

    let tag = match how {
        Vip::Configured => "external-474",
        Vip::LoadBalancer => "external-474-lb",
    };
    let cgroup = TestCgroup::new(tag);
    let config = match how {
        Vip::Configured => format!(
            "[[service]]\nname = \"web\"\nvip = \"{VIP4}\"\npolicy = \"spread\"\nhold_down = \"60s\"\n\
                 [service.health]\ncheck = \"tcp\"\ninterval = \"200ms\"\ntimeout = \"200ms\"\n\
                 [service.discovery]\nkubernetes = {{ namespace = \"default\", service = \"web\", port = \"http\" }}\n\
                 debounce = \"200ms\"\n[service.external]\ninterfaces = [\"ext0\"]\n"
        ),
        Vip::LoadBalancer => {
            api.apply_service(load_balancer_service("web", &[("http", 80, 8080)]));
            "[kubernetes]\ndefault_class = true\ninterfaces = [\"ext0\"]\n\
                 [[pool]]\nname = \"default\"\naddresses = [\"198.18.1.100\"]\n"
                .to_owned()
        }
    };
    let daemon = Daemon::start_with(
        tag,
        &cgroup,
        &format!("kubeconfig = {:?}\nnode_name = \"node-a\"\n", kubeconfig.path()),
        &config,
    );
    wait_view(&daemon, &[o1, o2], &[], "the first list");

    // The client loop, on another machine: connect, read the greeting,
    // close, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let looper = {
        let stop = Arc::clone(&stop);
        let vip: SocketAddr = VIP4.parse().unwrap();
        net.client.spawn(move || {
            let mut attempts = Vec::new();
            // Bounded: the test stops it within a minute or two.
            for _ in 0..200_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let start = started.elapsed();
                let outcome = TcpStream::connect_timeout(&vip, Duration::from_secs(3))
                    .map_err(|e| e.to_string())
                    .and_then(|stream| who(&stream));
                attempts.push(Attempt { start, end: started.elapsed(), outcome });
            }
            attempts
        })
    };
    let pause = || std::thread::sleep(Duration::from_millis(600));
    pause();
    // Replica 1: new-1 on node b, not ready: nothing changes.
    let new1_not_ready = started.elapsed();
    new(&[(n1, "node-b", NotReady)]);
    pause();
    assert_eq!(
        selected(&daemon).iter().copied().collect::<BTreeSet<_>>(),
        BTreeSet::from([o1, o2])
    );
    let new1_ready = started.elapsed();
    new(&[(n1, "node-b", Ready)]);
    wait_view(&daemon, &[o1, o2, n1], &[], "new-1 ready");
    pause();
    old(&[(o1, "node-a", TerminatingServing), (o2, "node-b", Ready)]);
    wait_view(&daemon, &[o2, n1], &[o1], "old-1 terminating");
    pause();
    old(&[(o2, "node-b", Ready)]);
    wait_view(&daemon, &[o2, n1], &[], "old-1 gone");
    old1.stop();
    // Replica 2: new-2 on node b too, its own IP, not ready.
    let new2_not_ready = started.elapsed();
    new(&[(n1, "node-b", Ready), (n2, "node-b", NotReady)]);
    pause();
    let new2_ready = started.elapsed();
    new(&[(n1, "node-b", Ready), (n2, "node-b", Ready)]);
    wait_view(&daemon, &[o2, n1, n2], &[], "new-2 ready");
    pause();
    old(&[(o2, "node-b", TerminatingServing)]);
    wait_view(&daemon, &[n1, n2], &[o2], "old-2 terminating");
    pause();
    old(&[(o2, "node-b", TerminatingNotServing)]);
    wait_view(&daemon, &[n1, n2], &[], "old-2 gone");
    api.delete("default", "web-old").expect("the old slice");
    old2.stop();
    pause();
    stop.store(true, Ordering::Relaxed);
    let attempts = looper.join().expect("the client loop");

    let failed: Vec<&Attempt> = attempts.iter().filter(|a| a.outcome.is_err()).collect();
    let mut names: HashMap<&str, usize> = HashMap::new();
    for a in &attempts {
        if let Ok(name) = &a.outcome {
            *names.entry(name.as_str()).or_default() += 1;
        }
    }
    let on_old2 = |from: Duration, to: Duration| {
        attempts
            .iter()
            .filter(|a| a.start >= from && a.end <= to && a.outcome.as_deref() == Ok("old-2"))
            .count()
    };
    eprintln!(
        "{} connects from another machine: {names:?}; old-2 took {} while new-1 was not ready on its node, {} while new-2 was",
        attempts.len(),
        on_old2(new1_not_ready, new1_ready),
        on_old2(new2_not_ready, new2_ready),
    );
    assert!(
        failed.is_empty(),
        "{} of {} connects failed, e.g. {:?}",
        failed.len(),
        attempts.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(
        on_old2(new1_not_ready, new1_ready) > 0,
        "old-2 got nothing while new-1 was not ready on its node"
    );
    assert!(
        on_old2(new2_not_ready, new2_ready) > 0,
        "old-2 got nothing while new-2 was not ready on its node"
    );
    for pod in ["old-1", "old-2", "new-1", "new-2"] {
        assert!(names.get(pod).is_some_and(|n| *n > 0), "{pod} got no connect: {names:?}");
    }
    drop(daemon);
    drop(cgroup);
}
