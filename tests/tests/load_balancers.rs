//! The LoadBalancer allocator over a real API protocol: the task
//! (`lb_user::loadbalancer::allocator`, driven directly: no daemon, no
//! kernel, no root) against the fake API server on loopback, which lists
//! and watches Services as an apiserver does, takes their status by
//! merge patch (`409` on a stale resourceVersion) and keeps the Events.
//! The test creates, changes and deletes Services and checks what their
//! status and Events say.
//!
//! Every wait is bounded; nothing leaves loopback (the addresses in the
//! pools are data, from 198.18.0.0/15, never dialled).

use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use k8s_openapi::{
    api::core::v1::{
        LoadBalancerIngress, LoadBalancerStatus, ServicePort, ServiceSpec, ServiceStatus,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use lb_tests::fakes::apiserver::{Event, FakeApiServer, Kubeconfig, Race, Service};
use lb_user::{
    config::LoadBalancers,
    loadbalancer::{
        Served, allocator,
        pools::Pool,
        service::{CLASS, METALLB_IPS, SHARING},
    },
};
use tokio::{sync::watch, task::JoinHandle};

const WAIT: Duration = Duration::from_secs(20);

fn pool(name: &str, ranges: &[&str]) -> Pool {
    Pool::new(name, ranges).unwrap()
}

fn settings(pools: Vec<Pool>) -> LoadBalancers {
    LoadBalancers { default_class: true, interfaces: vec!["eth1".into()], pools }
}

/// A LoadBalancer Service in `shop` with TCP `ports`.
fn service(name: &str, ports: &[i32], annotations: &[(&str, &str)]) -> Service {
    Service {
        metadata: ObjectMeta {
            namespace: Some("shop".into()),
            name: Some(name.into()),
            annotations: Some(
                annotations.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            ports: Some(
                ports.iter().map(|&port| ServicePort { port, ..ServicePort::default() }).collect(),
            ),
            ip_families: Some(vec!["IPv4".into()]),
            ip_family_policy: Some("SingleStack".into()),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// One allocator task, stopped on drop.
struct Allocator {
    task: JoinHandle<()>,
    leading: watch::Sender<bool>,
    served: watch::Receiver<Vec<Served>>,
    _stop: watch::Sender<bool>,
}

impl Allocator {
    fn start(kubeconfig: &Kubeconfig, settings: LoadBalancers, leading: bool) -> Self {
        let (leading_tx, leading) = watch::channel(leading);
        let (stop_tx, stop) = watch::channel(false);
        let (served_tx, served) = watch::channel(Vec::new());
        let channels = allocator::Channels { leading, served: served_tx, stop };
        let task = allocator::spawn(
            Some(kubeconfig.path().to_owned()),
            settings,
            "node-a".into(),
            channels,
        );
        Self { task, leading: leading_tx, served, _stop: stop_tx }
    }

    /// What the task says to serve now: Service name → (addresses, ports).
    fn served(&self) -> BTreeMap<String, (Vec<String>, Vec<u16>)> {
        self.served
            .borrow()
            .iter()
            .map(|s| {
                let addresses = s.addresses.iter().map(ToString::to_string).collect();
                (s.service.name.clone(), (addresses, s.ports.iter().map(|p| p.port).collect()))
            })
            .collect()
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The addresses `name`'s status shows, each with `ipMode: VIP`.
fn addresses(api: &FakeApiServer, name: &str) -> Vec<IpAddr> {
    let Some(service) = api.service("shop", name) else { return Vec::new() };
    let ingress = service.status.and_then(|s| s.load_balancer).and_then(|lb| lb.ingress);
    ingress
        .unwrap_or_default()
        .into_iter()
        .map(|i| {
            assert_eq!(i.ip_mode.as_deref(), Some("VIP"), "{name}: {i:?}");
            i.ip.unwrap().parse().unwrap()
        })
        .collect()
}

/// Waits until `name`'s status shows `expected` (empty: none).
async fn until_addresses(api: &FakeApiServer, name: &str, expected: &[&str]) {
    let expected: Vec<IpAddr> = expected.iter().map(|ip| ip.parse().unwrap()).collect();
    let deadline = tokio::time::Instant::now() + WAIT;
    while addresses(api, name) != expected {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name}: status {:?}, expected {expected:?}; events: {:#?}",
            addresses(api, name),
            notes(api)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every Event as `(service, type, reason, note)`.
fn notes(api: &FakeApiServer) -> Vec<(String, String, String, String)> {
    api.events()
        .into_iter()
        .map(|e: Event| {
            let regarding = e.regarding.unwrap_or_default();
            (
                regarding.name.unwrap_or_default(),
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default(),
            )
        })
        .collect()
}

/// Waits for an Event about `name` of `reason` whose note has `text`.
async fn until_event(api: &FakeApiServer, name: &str, reason: &str, text: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    let found = |api: &FakeApiServer| {
        notes(api).iter().any(|(n, _, r, note)| n == name && r == reason && note.contains(text))
    };
    while !found(api) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {reason} event about {name} saying {text:?}: {:#?}",
            notes(api)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Gives the allocator time to see and act on everything made so far (a
/// bookmark wakes its watch). Only used before asserting that nothing
/// happened, which no wait can prove.
async fn settle(api: &FakeApiServer) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    api.bookmark();
    tokio::time::sleep(Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_get_addresses_from_the_pool_and_keep_them_across_restarts() {
    let api = FakeApiServer::start().await;
    let kubeconfig = Kubeconfig::write(&api.url());
    let pools = vec![pool("default", &["198.18.1.100-198.18.1.102"])];
    let allocator = Allocator::start(&kubeconfig, settings(pools.clone()), true);

    api.apply_service(service("web", &[80], &[]));
    until_addresses(&api, "web", &["198.18.1.100"]).await;
    until_event(&api, "web", "AddressAssigned", "198.18.1.100 from pool \"default\"").await;

    // Asked for by name, MetalLB's annotation: honoured.
    api.apply_service(service("asks", &[80], &[(METALLB_IPS, "198.18.1.102")]));
    until_addresses(&api, "asks", &["198.18.1.102"]).await;
    // Sharing on purpose, no port in common: one address.
    api.apply_service(service("dns", &[53], &[(SHARING, "edge")]));
    until_addresses(&api, "dns", &["198.18.1.101"]).await;
    api.apply_service(service("dot", &[853], &[(SHARING, "edge")]));
    until_addresses(&api, "dot", &["198.18.1.101"]).await;

    // The pool is full: the next one stays pending, with the reason, and
    // nothing else moves.
    api.apply_service(service("late", &[80], &[]));
    until_event(&api, "late", "AllocationFailed", "has an IPv4 address left").await;
    assert_eq!(addresses(&api, "late"), Vec::<IpAddr>::new());
    // Asking for a taken address is refused by name.
    api.apply_service(service("greedy", &[80], &[(METALLB_IPS, "198.18.1.100")]));
    until_event(&api, "greedy", "AllocationFailed", "198.18.1.100 is taken by shop/web").await;
    // A Service of another class is not ours: never written.
    let mut other = service("other", &[80], &[]);
    other.spec.as_mut().unwrap().load_balancer_class = Some("example.com/else".into());
    api.apply_service(other);
    settle(&api).await;
    let before: BTreeMap<&str, Vec<IpAddr>> =
        ["web", "asks", "dns", "dot"].map(|n| (n, addresses(&api, n))).into_iter().collect();
    assert_eq!(addresses(&api, "other"), Vec::<IpAddr>::new());
    // What every node serves: the statuses' addresses, on each port.
    let served = allocator.served();
    let expect = |ip: &str, port| (vec![ip.to_owned()], vec![port]);
    assert_eq!(served.len(), 4, "pending and others' Services are not served: {served:?}");
    assert_eq!(served["web"], expect("198.18.1.100", 80));
    assert_eq!(served["asks"], expect("198.18.1.102", 80));
    assert_eq!(served["dns"], expect("198.18.1.101", 53));
    assert_eq!(served["dot"], expect("198.18.1.101", 853));
    let warned = notes(&api).iter().filter(|n| n.2 == "AllocationFailed").count();

    // A steady state writes nothing, however often the watch wakes.
    let writes = api.service_writes().len();
    for _ in 0..3 {
        api.bookmark();
        settle(&api).await;
    }
    assert_eq!(api.service_writes().len(), writes, "no write without a change");
    assert_eq!(
        notes(&api).iter().filter(|n| n.2 == "AllocationFailed").count(),
        warned,
        "a refusal is told once"
    );

    // A new allocator (a restart, another node elected) reads the status
    // back: nothing moves, nothing is written.
    drop(allocator);
    let allocator = Allocator::start(&kubeconfig, settings(pools.clone()), true);
    settle(&api).await;
    settle(&api).await;
    for (name, held) in &before {
        assert_eq!(&addresses(&api, name), held, "{name} moved after a restart");
    }
    assert_eq!(api.service_writes().len(), writes, "a restart writes nothing");
    assert_eq!(allocator.served().len(), 4, "a new task serves what the statuses say");

    // Deleted: its address goes back to the pool, to the pending Service
    // (once the one that asked for that address by name is gone too: of
    // two pending Services the elder is served first, and these two were
    // created within the same second, the timestamps' resolution).
    api.delete_service("shop", "greedy").unwrap();
    api.delete_service("shop", "web").unwrap();
    until_addresses(&api, "late", &["198.18.1.100"]).await;
    assert!(api.service_writes().iter().all(|w| w.status == 200 && w.patch == "merge"));
    drop(allocator);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_leading_allocator_writes_and_a_conflicting_status_is_settled() {
    let api = FakeApiServer::start().await;
    let kubeconfig = Kubeconfig::write(&api.url());
    let pools = vec![pool("default", &["198.18.1.100-198.18.1.110"])];
    let follower = Allocator::start(&kubeconfig, settings(pools), false);

    // Two Services whose status both claim one address (written by hand,
    // or by another controller before lb): the elder keeps it.
    let claim = |name: &str, created: i64| {
        let mut s = service(name, &[80], &[]);
        s.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(created).unwrap(),
        ));
        s.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(vec![LoadBalancerIngress {
                    ip: Some("198.18.1.105".into()),
                    ip_mode: Some("VIP".into()),
                    ..LoadBalancerIngress::default()
                }]),
            }),
            ..ServiceStatus::default()
        });
        s
    };
    api.apply_service(claim("elder", 1_000));
    api.apply_service(claim("younger", 2_000));
    // The fake keeps a new Service's status as given (a test's shortcut
    // for "written before").
    assert_eq!(addresses(&api, "younger"), ["198.18.1.105".parse::<IpAddr>().unwrap()]);
    let mut ours = service("classy", &[80], &[]);
    ours.spec.as_mut().unwrap().load_balancer_class = Some(CLASS.into());
    api.apply_service(ours);
    settle(&api).await;
    assert!(api.service_writes().is_empty(), "a follower writes nothing");
    // ...but serves what the statuses say, wherever it was written from.
    assert_eq!(follower.served().len(), 2, "{:?}", follower.served());

    follower.leading.send_replace(true);
    until_addresses(&api, "younger", &["198.18.1.100"]).await;
    until_addresses(&api, "classy", &["198.18.1.101"]).await;
    assert_eq!(addresses(&api, "elder"), ["198.18.1.105".parse::<IpAddr>().unwrap()]);
    drop(follower);
}

/// Racing writers, as an abuser or a busy cluster makes them: a Service
/// edited by another client between the allocator's plan and its write
/// gets `409 Conflict`, and the allocator writes again from the version
/// its watch brings, once, keeping the other client's edit; one deleted
/// meanwhile gets `404` and nothing more, and its address goes to the
/// next Service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_write_that_loses_a_race_is_planned_again() {
    let api = FakeApiServer::start().await;
    let kubeconfig = Kubeconfig::write(&api.url());
    let pools = vec![pool("default", &["198.18.1.100-198.18.1.101"])];
    let _allocator = Allocator::start(&kubeconfig, settings(pools), true);
    let statuses = |name: &str| -> Vec<u16> {
        api.service_writes().iter().filter(|w| w.name == name).map(|w| w.status).collect()
    };

    api.race_next_status_write("web", Race::Edited);
    api.apply_service(service("web", &[80], &[]));
    until_addresses(&api, "web", &["198.18.1.100"]).await;
    assert_eq!(statuses("web"), [409, 200], "written again after the conflict");
    let labels = api.service("shop", "web").unwrap().metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("edited-by").map(String::as_str), Some("another-client"));

    api.race_next_status_write("gone", Race::Deleted);
    api.apply_service(service("gone", &[80], &[]));
    let deadline = tokio::time::Instant::now() + WAIT;
    while statuses("gone").is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "gone was never written");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    api.apply_service(service("next", &[80], &[]));
    until_addresses(&api, "next", &["198.18.1.101"]).await;
    settle(&api).await;
    assert_eq!(statuses("gone"), [404], "a deleted Service is written to once");
    assert_eq!(statuses("web"), [409, 200], "nothing more for web");
}
