//! Discovery against a fake Kubernetes API server and a fake DNS server on
//! loopback: `lb_user::discovery::spawn_with` is driven directly (no
//! daemon, no eBPF, no root) and its updates are checked step by step.
//!
//! Every wait is bounded; nothing leaves loopback (the addresses in the
//! slices are data, never dialled, except the fake apiservers' own).

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use lb_tests::fakes::{
    apiserver::{Condition, FakeApiServer, Kubeconfig, RequestLog, endpoint, endpoint_slice},
    dns::{FakeDns, Mode},
};
use lb_user::{
    balancer::Readiness,
    config::{Discovery, PortRef},
    discovery::{self, Endpoint, Options, Source, Update},
};
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
    time::Instant,
};

/// The longest any one expected update may take.
const WAIT: Duration = Duration::from_secs(20);
const DEBOUNCE: Duration = Duration::from_millis(200);

/// One running discovery task, aborted on drop.
struct Follower {
    updates: mpsc::Receiver<Update>,
    usable: watch::Sender<Vec<SocketAddr>>,
    task: JoinHandle<()>,
    /// Every update received, for failure messages.
    seen: Vec<Update>,
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Follower {
    fn start(
        vip: SocketAddr,
        discovery: Discovery,
        options: Options,
        usable: Vec<SocketAddr>,
    ) -> Self {
        let (usable_tx, usable_rx) = watch::channel(usable);
        let (tx, updates) = mpsc::channel(64);
        let task =
            discovery::spawn_with("svc".to_owned(), vip, discovery, options, vec![], usable_rx, tx);
        Self { updates, usable: usable_tx, task, seen: Vec::new() }
    }

    /// The next update, whatever it is.
    async fn next(&mut self) -> Update {
        match tokio::time::timeout(WAIT, self.updates.recv()).await {
            Ok(Some(update)) => {
                self.seen.push(update.clone());
                update
            }
            Ok(None) => panic!("the discovery task ended; updates so far: {:#?}", self.seen),
            Err(_) => panic!("no update within {WAIT:?}; updates so far: {:#?}", self.seen),
        }
    }

    /// The next update, which must be a success: its list.
    async fn next_ok(&mut self) -> Vec<Endpoint> {
        let update = self.next().await;
        assert_eq!(update.service, "svc");
        match update.result {
            Ok(list) => list,
            Err(e) => {
                panic!("expected a list, got the error {e:?}; updates so far: {:#?}", self.seen)
            }
        }
    }

    /// Skips updates (errors, older lists) until one has exactly `want`.
    async fn until(&mut self, want: &[Endpoint]) {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            let update = self.next().await;
            if update.result.as_deref() == Ok(want) {
                return;
            }
        }
        panic!("never got {want:?}; updates: {:#?}", self.seen);
    }

    /// Skips updates until an error that contains `needle`.
    async fn until_error(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            if let Err(e) = self.next().await.result
                && e.contains(needle)
            {
                return e;
            }
        }
        panic!("never got an error with {needle:?}; updates: {:#?}", self.seen);
    }

    /// No update at all for `within`.
    async fn quiet(&mut self, within: Duration) {
        if let Ok(update) = tokio::time::timeout(within, self.updates.recv()).await {
            panic!("unexpected update {update:?}; before it: {:#?}", self.seen);
        }
    }
}

fn ready(addr: &str) -> Endpoint {
    Endpoint { addr: addr.parse().unwrap(), readiness: Readiness::Ready }
}

fn serving(addr: &str) -> Endpoint {
    Endpoint { addr: addr.parse().unwrap(), readiness: Readiness::Serving }
}

fn kubernetes(service: &str, port: &str, debounce: Duration) -> Discovery {
    Discovery::Kubernetes {
        namespace: "default".to_owned(),
        service: service.to_owned(),
        port: PortRef::Name(port.to_owned()),
        debounce,
        node: None,
    }
}

fn vip() -> SocketAddr {
    "127.0.0.1:9443".parse().unwrap()
}

fn options(kubeconfig: &Kubeconfig) -> Options {
    Options { kubeconfig: Some(kubeconfig.path().to_owned()), ..Options::default() }
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Waits until the fake apiserver logged a request that `pred` accepts.
async fn until_request(api: &FakeApiServer, what: &str, pred: impl Fn(&RequestLog) -> bool) {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if api.requests().iter().any(&pred) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no request {what}; requests: {:#?}", api.requests());
}

/// MetalLB 474 as it happened: a 2-replica rolling update where each new,
/// not yet ready pod lands on the node of a remaining old, ready one. At
/// every step the list is judged per endpoint: a not-ready endpoint never
/// takes out a ready one on its node, a terminating one is drained (still
/// serving), and one that stops serving leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_update_is_judged_per_endpoint_at_every_step() {
    use Condition::{NotReady, Ready, TerminatingNotServing, TerminatingServing};
    let api = FakeApiServer::start().await;
    let kubeconfig = Kubeconfig::write(&api.url());
    let step = |endpoints: &[(&str, &str, Condition)]| {
        let endpoints = endpoints.iter().map(|(ip, node, c)| endpoint(ip, node, *c)).collect();
        api.apply(endpoint_slice(
            "web-abcde",
            "web",
            "IPv4",
            &[("metrics", 9090), ("https", 8443)],
            endpoints,
        ));
    };
    // Endpoint addresses in this file are data only: these tests drive the
    // discovery module alone (no daemon, no kernel), so nothing dials them.
    // IPv4 ones are loopback all the same (127.10.x.y); IPv6 ones are fd00::
    // where a test needs several, which loopback has not.
    // old-1 on node-a and old-2 on node-b serve; new-1 starts on node-a.
    step(&[
        ("127.10.0.1", "node-a", Ready),
        ("127.10.0.2", "node-b", Ready),
        ("127.10.0.3", "node-a", NotReady),
    ]);
    let mut f =
        Follower::start(vip(), kubernetes("web", "https", DEBOUNCE), options(&kubeconfig), vec![]);
    assert_eq!(f.next_ok().await, [ready("127.10.0.1:8443"), ready("127.10.0.2:8443")]);

    // new-1 is ready.
    step(&[
        ("127.10.0.1", "node-a", Ready),
        ("127.10.0.2", "node-b", Ready),
        ("127.10.0.3", "node-a", Ready),
    ]);
    assert_eq!(
        f.next_ok().await,
        [ready("127.10.0.1:8443"), ready("127.10.0.2:8443"), ready("127.10.0.3:8443")]
    );

    // old-1 terminates, still serving its connections: drained.
    step(&[
        ("127.10.0.1", "node-a", TerminatingServing),
        ("127.10.0.2", "node-b", Ready),
        ("127.10.0.3", "node-a", Ready),
    ]);
    assert_eq!(
        f.next_ok().await,
        [ready("127.10.0.2:8443"), ready("127.10.0.3:8443"), serving("127.10.0.1:8443")]
    );

    // old-1 stops serving; new-2 starts on node-b, next to old-2.
    step(&[
        ("127.10.0.1", "node-a", TerminatingNotServing),
        ("127.10.0.2", "node-b", Ready),
        ("127.10.0.3", "node-a", Ready),
        ("127.10.0.4", "node-b", NotReady),
    ]);
    assert_eq!(f.next_ok().await, [ready("127.10.0.2:8443"), ready("127.10.0.3:8443")]);

    // old-1 is gone; new-2 is ready.
    step(&[
        ("127.10.0.2", "node-b", Ready),
        ("127.10.0.3", "node-a", Ready),
        ("127.10.0.4", "node-b", Ready),
    ]);
    assert_eq!(
        f.next_ok().await,
        [ready("127.10.0.2:8443"), ready("127.10.0.3:8443"), ready("127.10.0.4:8443")]
    );

    // old-2 terminates, then goes.
    step(&[
        ("127.10.0.2", "node-b", TerminatingServing),
        ("127.10.0.3", "node-a", Ready),
        ("127.10.0.4", "node-b", Ready),
    ]);
    assert_eq!(
        f.next_ok().await,
        [ready("127.10.0.3:8443"), ready("127.10.0.4:8443"), serving("127.10.0.2:8443")]
    );
    step(&[("127.10.0.3", "node-a", Ready), ("127.10.0.4", "node-b", Ready)]);
    assert_eq!(f.next_ok().await, [ready("127.10.0.3:8443"), ready("127.10.0.4:8443")]);
    assert_eq!(f.seen.iter().map(|u| u.source).collect::<Vec<_>>(), [Source::Kubernetes; 7]);
}

/// Only terminating-but-serving endpoints left (over two slices): they are
/// the list, drained; a ready one appears and goes first; the terminating
/// ones leave when they stop serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_but_serving_endpoints_are_kept_drained() {
    use Condition::{Ready, TerminatingNotServing, TerminatingServing};
    let api = FakeApiServer::start().await;
    let kubeconfig = Kubeconfig::write(&api.url());
    api.apply(endpoint_slice(
        "api-1",
        "api",
        "IPv4",
        &[("https", 6443)],
        vec![endpoint("127.10.1.1", "n1", TerminatingServing)],
    ));
    api.apply(endpoint_slice(
        "api-2",
        "api",
        "IPv4",
        &[("https", 6443)],
        vec![
            endpoint("127.10.1.2", "n2", TerminatingServing),
            endpoint("127.10.1.3", "n2", TerminatingNotServing),
        ],
    ));
    let mut f =
        Follower::start(vip(), kubernetes("api", "https", DEBOUNCE), options(&kubeconfig), vec![]);
    assert_eq!(f.next_ok().await, [serving("127.10.1.1:6443"), serving("127.10.1.2:6443")]);

    api.apply(endpoint_slice(
        "api-2",
        "api",
        "IPv4",
        &[("https", 6443)],
        vec![endpoint("127.10.1.2", "n2", TerminatingServing), endpoint("127.10.1.9", "n2", Ready)],
    ));
    assert_eq!(
        f.next_ok().await,
        [ready("127.10.1.9:6443"), serving("127.10.1.1:6443"), serving("127.10.1.2:6443")]
    );

    api.delete("default", "api-1").unwrap();
    api.apply(endpoint_slice(
        "api-2",
        "api",
        "IPv4",
        &[("https", 6443)],
        vec![endpoint("127.10.1.9", "n2", Ready)],
    ));
    f.until(&[ready("127.10.1.9:6443")]).await;
}

/// k3s 11349: the apiserver the watch is connected to dies; the watch
/// reconnects through another usable server of the service it discovers
/// (the apiservers' own Service, `default/kubernetes`), and a change made
/// after the outage arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_survives_the_loss_of_its_apiserver_through_a_usable_server() {
    // Two apiservers on one store, same port, two loopback addresses.
    let api = FakeApiServer::start().await;
    let a = api.addr();
    let b = api.listen(SocketAddr::new("127.0.0.2".parse().unwrap(), a.port())).await;
    let kubeconfig = Kubeconfig::write(&format!("http://{a}"));
    let slice = |ips: &[&str]| {
        let endpoints = ips.iter().map(|ip| endpoint(ip, ip, Condition::Ready)).collect();
        endpoint_slice("kubernetes", "kubernetes", "IPv4", &[("https", a.port())], endpoints)
    };
    api.apply(slice(&["127.0.0.1", "127.0.0.2"]));
    let mut f = Follower::start(
        vip(),
        kubernetes("kubernetes", "https", DEBOUNCE),
        options(&kubeconfig),
        vec![a, b],
    );
    assert_eq!(f.next_ok().await, [ready(&a.to_string()), ready(&b.to_string())]);
    until_request(&api, "watching through A", |r| r.watch && r.via == a).await;
    let before = api.requests().len();

    // A dies. The daemon has not noticed yet: A is still first in the
    // usable list, so the dialler must pass over the refusal.
    api.stop_listener(a);
    until_request(&api, "watching through B", |r| r.watch && r.via == b).await;
    assert!(api.requests()[before..].iter().all(|r| r.via == b), "{:#?}", api.requests());

    // A change after the outage arrives.
    api.apply(slice(&["127.0.0.2", "127.0.0.3"]));
    f.until(&[ready(&b.to_string()), ready(&format!("127.0.0.3:{}", a.port()))]).await;

    // B dies too and A comes back: the watch moves back to A.
    api.restart_listener(a).await;
    let before = api.requests().len();
    api.stop_listener(b);
    api.apply(slice(&["127.0.0.1"]));
    f.until(&[ready(&a.to_string())]).await;
    assert!(
        api.requests()[before..].iter().any(|r| r.watch && r.via == a),
        "{:#?}",
        api.requests()
    );
}

/// The kubeconfig points at the service's VIP, where nothing listens (the
/// daemon is outside the attached cgroup): the client reaches the
/// apiserver through the usable servers, and follows the usable list as it
/// changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeconfig_pointing_at_the_vip_is_dialled_through_the_usable_servers() {
    let api = FakeApiServer::start().await;
    let a = api.addr();
    let b = api.listen("127.0.0.1:0".parse().unwrap()).await;
    let vip: SocketAddr = format!("127.0.0.1:{}", closed_port()).parse().unwrap();
    let kubeconfig = Kubeconfig::write(&format!("http://{vip}"));
    api.apply(endpoint_slice(
        "apiserver-x",
        "apiserver",
        "IPv4",
        &[("https", 6443)],
        vec![endpoint("127.10.2.1", "n1", Condition::Ready)],
    ));
    // Not default/kubernetes: only the kubeconfig-at-the-VIP rule applies.
    let mut f = Follower::start(
        vip,
        kubernetes("apiserver", "https", DEBOUNCE),
        options(&kubeconfig),
        vec![a],
    );
    assert_eq!(f.next_ok().await, [ready("127.10.2.1:6443")]);
    assert!(api.requests().iter().all(|r| r.via == a));

    // The daemon now uses B only; A dies.
    f.usable.send_replace(vec![b]);
    api.stop_listener(a);
    api.apply(endpoint_slice(
        "apiserver-x",
        "apiserver",
        "IPv4",
        &[("https", 6443)],
        vec![endpoint("127.10.2.2", "n1", Condition::Ready)],
    ));
    f.until(&[ready("127.10.2.2:6443")]).await;
    assert!(api.requests().iter().any(|r| r.watch && r.via == b), "{:#?}", api.requests());
}

/// An application's Service never uses its own servers to reach the
/// apiserver: with the kubeconfig's apiserver down, the sync fails with a
/// clear error (and the daemon keeps its list).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_apiserver_is_an_error_update() {
    let api = FakeApiServer::start().await;
    let kubeconfig = Kubeconfig::write(&format!("http://127.0.0.1:{}", closed_port()));
    let usable = vec![api.addr()];
    let mut f =
        Follower::start(vip(), kubernetes("web", "https", DEBOUNCE), options(&kubeconfig), usable);
    let error = f.until_error("kubernetes").await;
    eprintln!("the error: {error}");
    assert!(error.contains("EndpointSlices of default/web"), "{error}");
    assert!(error.contains("(kubeconfig)"), "{error}");
    assert!(api.requests().is_empty(), "the app's servers were used: {:#?}", api.requests());

    // A missing kubeconfig is an error too, not a panic.
    let options =
        Options { kubeconfig: Some("/nonexistent/kubeconfig".into()), ..Options::default() };
    let mut g = Follower::start(vip(), kubernetes("web", "https", DEBOUNCE), options, vec![]);
    let error = g.until_error("kubeconfig").await;
    eprintln!("the error: {error}");
    assert!(error.contains("/nonexistent/kubeconfig"), "{error}");
}

/// Start-up flapping: an endpoint added, removed and re-added within the
/// debounce window is one update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_remove_readd_within_the_debounce_window_is_one_update() {
    let api = FakeApiServer::start().await;
    let kubeconfig = Kubeconfig::write(&api.url());
    let slice = |ips: &[&str]| {
        let endpoints = ips.iter().map(|ip| endpoint(ip, "n", Condition::Ready)).collect();
        endpoint_slice("kubernetes", "kubernetes", "IPv4", &[("https", 6443)], endpoints)
    };
    api.apply(slice(&["127.10.3.1"]));
    let debounce = Duration::from_millis(1500);
    let mut f = Follower::start(
        vip(),
        kubernetes("kubernetes", "https", debounce),
        options(&kubeconfig),
        vec![],
    );
    assert_eq!(f.next_ok().await, [ready("127.10.3.1:6443")]);

    let start = Instant::now();
    api.apply(slice(&["127.10.3.1", "127.10.3.2"]));
    tokio::time::sleep(Duration::from_millis(100)).await;
    api.apply(slice(&["127.10.3.1"]));
    tokio::time::sleep(Duration::from_millis(100)).await;
    api.apply(slice(&["127.10.3.1", "127.10.3.2"]));
    assert_eq!(f.next_ok().await, [ready("127.10.3.1:6443"), ready("127.10.3.2:6443")]);
    let took = start.elapsed();
    assert!(
        took >= debounce - Duration::from_millis(100),
        "sent after {took:?}, before the window closed"
    );
    f.quiet(Duration::from_secs(3)).await;

    // Added and removed within the window: nothing at all.
    api.apply(slice(&["127.10.3.1", "127.10.3.2", "127.10.3.3"]));
    api.apply(slice(&["127.10.3.1", "127.10.3.2"]));
    f.quiet(Duration::from_secs(3)).await;
}

/// An empty result is sent as an empty list (the daemon keeps its last
/// servers): no slice at all, a slice with no serving endpoint, the last
/// slice deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_result_is_sent_as_an_empty_list() {
    let api = FakeApiServer::start().await;
    let kubeconfig = Kubeconfig::write(&api.url());
    let mut f =
        Follower::start(vip(), kubernetes("web", "https", DEBOUNCE), options(&kubeconfig), vec![]);
    assert_eq!(f.next_ok().await, []);

    api.apply(endpoint_slice(
        "web-1",
        "web",
        "IPv4",
        &[("https", 8443)],
        vec![endpoint("127.10.4.1", "n", Condition::Ready)],
    ));
    assert_eq!(f.next_ok().await, [ready("127.10.4.1:8443")]);
    api.apply(endpoint_slice(
        "web-1",
        "web",
        "IPv4",
        &[("https", 8443)],
        vec![endpoint("127.10.4.1", "n", Condition::NotReady)],
    ));
    assert_eq!(f.next_ok().await, []);
    api.apply(endpoint_slice(
        "web-1",
        "web",
        "IPv4",
        &[("https", 8443)],
        vec![endpoint("127.10.4.1", "n", Condition::Unset)],
    ));
    assert_eq!(f.next_ok().await, [ready("127.10.4.1:8443")], "no conditions: ready");
    api.delete("default", "web-1").unwrap();
    assert_eq!(f.next_ok().await, []);
    // Slices of another Service or another family never count.
    api.apply(endpoint_slice(
        "other-1",
        "other",
        "IPv4",
        &[("https", 8443)],
        vec![endpoint("127.10.4.2", "n", Condition::Ready)],
    ));
    api.apply(endpoint_slice(
        "web-v6",
        "web",
        "IPv6",
        &[("https", 8443)],
        vec![endpoint("fd00::1", "n", Condition::Ready)],
    ));
    f.quiet(Duration::from_secs(1)).await;
}

/// The watch falls behind while the store changes (a slice deleted, one
/// changed) and the history is compacted: the watch gets 410 Gone (an
/// ERROR event in the stream), and the relist replaces the whole view: the
/// deleted slice is gone though no event said so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_forces_a_relist_that_replaces_the_whole_view() {
    relist_after_gone(false).await;
}

/// The same with 410 Gone as the HTTP status of the re-watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_as_an_http_status_forces_a_relist_too() {
    relist_after_gone(true).await;
}

fn one(name: &str, ip: &str) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    endpoint_slice(
        name,
        "web",
        "IPv4",
        &[("https", 8443)],
        vec![endpoint(ip, "n", Condition::Ready)],
    )
}

async fn relist_after_gone(as_http: bool) {
    let api = FakeApiServer::start().await;
    api.set_gone_as_http(as_http);
    let kubeconfig = Kubeconfig::write(&api.url());
    api.apply(one("web-1", "127.10.5.1"));
    api.apply(one("web-2", "127.10.5.2"));
    let mut f =
        Follower::start(vip(), kubernetes("web", "https", DEBOUNCE), options(&kubeconfig), vec![]);
    assert_eq!(f.next_ok().await, [ready("127.10.5.1:8443"), ready("127.10.5.2:8443")]);
    until_request(&api, "watching", |r| r.watch).await;
    let lists = |api: &FakeApiServer| api.requests().iter().filter(|r| !r.watch).count();
    assert_eq!(lists(&api), 1);

    api.pause_watches();
    api.delete("default", "web-2").unwrap();
    api.apply(one("web-1", "127.10.5.3"));
    api.expire();
    f.until(&[ready("127.10.5.3:8443")]).await;
    let requests = api.requests();
    assert_eq!(lists(&api), 2, "one relist: {requests:#?}");
    if as_http {
        assert!(requests.iter().any(|r| r.watch && r.gone), "no watch answered 410: {requests:#?}");
    }
    // Only the relist could have told: no watch delivered an event.
    api.resume_watches();
    // The watch goes on after it.
    api.apply(one("web-4", "127.10.5.4"));
    f.until(&[ready("127.10.5.3:8443"), ready("127.10.5.4:8443")]).await;
    // A 410 is no failure: no error was sent.
    assert!(f.seen.iter().all(|u| u.result.is_ok()), "{:#?}", f.seen);
}

/// The apiserver goes away while the store changes and is compacted: when
/// it is back, the client relists and the view is replaced whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apiserver_outage_ends_with_a_relist_that_replaces_the_whole_view() {
    let api = FakeApiServer::start().await;
    let kubeconfig = Kubeconfig::write(&api.url());
    api.apply(one("web-1", "127.10.5.1"));
    api.apply(one("web-2", "127.10.5.2"));
    let mut f =
        Follower::start(vip(), kubernetes("web", "https", DEBOUNCE), options(&kubeconfig), vec![]);
    assert_eq!(f.next_ok().await, [ready("127.10.5.1:8443"), ready("127.10.5.2:8443")]);
    until_request(&api, "watching", |r| r.watch).await;

    api.stop();
    api.delete("default", "web-2").unwrap();
    api.apply(one("web-1", "127.10.5.3"));
    api.expire();
    // The outage is reported...
    let error = f.until_error("kubernetes").await;
    assert!(error.contains("EndpointSlices of default/web"), "{error}");
    // ...and the list after it is the store's, whole.
    api.restart().await;
    f.until(&[ready("127.10.5.3:8443")]).await;
}

/// A cut stream resumes from its resourceVersion (the last event's, or a
/// later bookmark's) and misses nothing made meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_stream_resumes_from_the_last_bookmark_and_misses_nothing() {
    let api = FakeApiServer::start().await;
    let kubeconfig = Kubeconfig::write(&api.url());
    let one = |name: &str, ip: &str| {
        endpoint_slice(
            name,
            "web",
            "IPv4",
            &[("https", 8443)],
            vec![endpoint(ip, "n", Condition::Ready)],
        )
    };
    api.apply(one("web-1", "127.10.6.1"));
    let mut f =
        Follower::start(vip(), kubernetes("web", "https", DEBOUNCE), options(&kubeconfig), vec![]);
    assert_eq!(f.next_ok().await, [ready("127.10.6.1:8443")]);
    until_request(&api, "watching", |r| r.watch).await;

    // Other objects moved the resourceVersion on; a bookmark says so.
    let rv = api.advance().to_string();
    let resumed = |api: &FakeApiServer| {
        api.requests().iter().any(|r| r.watch && r.resource_version.as_deref() == Some(&rv))
    };
    // The bookmark must reach the client before the cut: try a few times.
    for _ in 0..10 {
        api.bookmark();
        tokio::time::sleep(Duration::from_millis(200)).await;
        api.cut_streams();
        let deadline = Instant::now() + Duration::from_secs(2);
        while !resumed(&api) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if resumed(&api) {
            break;
        }
    }
    assert!(
        resumed(&api),
        "never resumed from the bookmark's resourceVersion {rv}: {:#?}",
        api.requests()
    );

    // Cut again, and change the store before the client is back.
    api.cut_streams();
    api.apply(one("web-2", "127.10.6.2"));
    f.until(&[ready("127.10.6.1:8443"), ready("127.10.6.2:8443")]).await;
    assert!(!api.requests().iter().any(|r| r.gone), "{:#?}", api.requests());
    // A cut stream is no failure: no error was sent.
    assert!(f.seen.iter().all(|u| u.result.is_ok()), "{:#?}", f.seen);
}

fn dns(name: &str, port: u16, refresh_min: Duration, refresh_max: Duration) -> Discovery {
    Discovery::Dns {
        name: name.to_owned(),
        port,
        debounce: Duration::from_millis(50),
        refresh_min,
        refresh_max,
    }
}

fn dns_options(server: &FakeDns) -> Options {
    Options {
        dns_server: Some(server.addr()),
        dns_timeout: Some(Duration::from_millis(300)),
        ..Options::default()
    }
}

/// DNS answers for the fake server. Their addresses (127.10.x.y, and fd00::
/// where a test needs several IPv6 addresses, which loopback has not) are
/// data only: the DNS tests drive the discovery module alone (no daemon, no
/// kernel), so nothing ever dials them.
fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

/// DNS: the records change and the list follows; SERVFAIL, NXDOMAIN and a
/// timeout are errors; recovery is a list again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_records_are_followed_and_failures_are_errors() {
    let server = FakeDns::start().await;
    server.set("api.lb.test", &ips(&["127.10.7.2", "127.10.7.1", "fd00::7"]), 1);
    let discovery =
        dns("api.lb.test.", 6443, Duration::from_millis(200), Duration::from_millis(500));
    let mut f = Follower::start(vip(), discovery, dns_options(&server), vec![]);
    let first = f.next().await;
    assert_eq!(first.source, Source::Dns);
    assert_eq!(first.result, Ok(vec![ready("127.10.7.1:6443"), ready("127.10.7.2:6443")]));

    server.set("api.lb.test", &ips(&["127.10.7.3"]), 1);
    f.until(&[ready("127.10.7.3:6443")]).await;

    server.set_mode(Mode::ServFail);
    let error = f.until_error("dns").await;
    eprintln!("the error: {error}");
    assert!(error.contains("SERVFAIL") && error.contains("api.lb.test"), "{error}");

    server.set_mode(Mode::Answer);
    f.until(&[ready("127.10.7.3:6443")]).await;

    server.set_mode(Mode::NxDomain);
    let error = f.until_error("NXDOMAIN").await;
    eprintln!("the error: {error}");
    assert!(error.contains("api.lb.test"), "{error}");

    server.set_mode(Mode::Drop);
    let error = f.until_error("dns").await;
    eprintln!("the error: {error}");
    assert!(error.contains("timed out") || error.contains("timeout"), "{error}");

    server.set_mode(Mode::Answer);
    server.set("api.lb.test", &ips(&["127.10.7.4"]), 1);
    f.until(&[ready("127.10.7.4:6443")]).await;
}

/// An IPv6 VIP asks for AAAA records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_follows_the_vips_family() {
    let server = FakeDns::start().await;
    server.set("api6.lb.test", &ips(&["127.10.8.1", "fd00::8:2", "fd00::8:1"]), 30);
    let discovery = dns("api6.lb.test.", 443, Duration::from_millis(200), Duration::from_secs(1));
    let vip6: SocketAddr = "[::1]:9443".parse().unwrap();
    let mut f = Follower::start(vip6, discovery, dns_options(&server), vec![]);
    assert_eq!(f.next_ok().await, [ready("[fd00::8:1]:443"), ready("[fd00::8:2]:443")]);
}

/// Re-resolution follows the TTL within the bounds: a long TTL is cut to
/// `refresh_max`, a short one raised to `refresh_min`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_is_resolved_again_at_the_ttl_within_the_bounds() {
    let server = FakeDns::start().await;
    server.set("long.lb.test", &ips(&["127.10.9.1"]), 3600);
    let discovery =
        dns("long.lb.test.", 80, Duration::from_millis(100), Duration::from_millis(400));
    let f = Follower::start(vip(), discovery, dns_options(&server), vec![]);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let long = server.queries();
    drop(f);
    // About 2.1 s / 0.4 s + 1 = 6 resolutions.
    assert!((4..=8).contains(&long), "{long} queries with a TTL of 3600 s and refresh_max 0.4 s");

    let server = FakeDns::start().await;
    server.set("short.lb.test", &ips(&["127.10.9.2"]), 0);
    let discovery = dns("short.lb.test.", 80, Duration::from_millis(800), Duration::from_secs(10));
    let f = Follower::start(vip(), discovery, dns_options(&server), vec![]);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let short = server.queries();
    drop(f);
    // About 2.1 s / 0.8 s + 1 = 3 resolutions.
    assert!((2..=4).contains(&short), "{short} queries with a TTL of 0 and refresh_min 0.8 s");
}
