//! The discovery tests' rig (`tests/tests/discovery_e2e.rs`): services that
//! follow a fake Kubernetes API server, EndpointSlices made from
//! (address, node, condition) lists, what `lb status --json` says of a
//! service's discovered and selected servers, bounded waits for a change
//! to show, and the judges of a change applied or ignored while a client
//! loop connects.

use std::{
    collections::{BTreeSet, HashMap},
    net::{SocketAddr, TcpListener, UdpSocket},
    path::PathBuf,
    thread,
    time::Duration,
};

use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use serde_json::Value;

use crate::{
    Backend, Client, Connect, Daemon, ServiceBuilder, addr,
    fakes::apiserver::{Condition, FakeApiServer, Kubeconfig, endpoint, endpoint_slice},
    monotonic_ns, wait_until,
};

/// The longest one expected change may take to show (debounce, apply,
/// and a relist after a backoff of at most 5 s included).
pub const WAIT: Duration = Duration::from_secs(20);

/// A port that is free, for TCP and UDP (a [`Backend`] binds both), on
/// every `127.77.<net>.<host>` of `hosts`: endpoints of one EndpointSlice
/// share the slice's port number.
pub fn shared_port(net: u8, hosts: &[u8]) -> u16 {
    for _ in 0..50 {
        let first = TcpListener::bind(addr(net, hosts[0], 0)).expect("binding a loopback port");
        let port = first.local_addr().unwrap().port();
        let mut held = Vec::new();
        let free = hosts.iter().enumerate().all(|(i, host)| {
            let at = addr(net, *host, port);
            let tcp = if i == 0 { Ok(None) } else { TcpListener::bind(at).map(Some) };
            match (tcp, UdpSocket::bind(at)) {
                (Ok(tcp), Ok(udp)) => {
                    held.push((tcp, udp));
                    true
                }
                _ => false,
            }
        });
        drop(held);
        drop(first);
        if free {
            return port;
        }
    }
    panic!("no port free on every one of 127.77.{net}.{hosts:?}");
}

/// The `[service.discovery]` lines of a Kubernetes source.
pub fn kubernetes(
    builder: ServiceBuilder,
    service: &str,
    port: &str,
    debounce: Duration,
) -> ServiceBuilder {
    builder
        .raw("[service.discovery]")
        .raw(&format!(
            "kubernetes = {{ namespace = \"default\", service = \"{service}\", port = \"{port}\" }}"
        ))
        .raw(&format!("debounce = \"{}ms\"", debounce.as_millis()))
}

/// `[daemon] kubeconfig = "..."`.
pub fn kubeconfig_setting(kubeconfig: &Kubeconfig) -> String {
    format!("kubeconfig = {:?}\n", kubeconfig.path())
}

/// One endpoint of a slice: (address, node, condition).
pub fn endpoints(list: &[(SocketAddr, &str, Condition)]) -> Vec<Endpoint> {
    list.iter().map(|(a, node, c)| endpoint(&a.ip().to_string(), node, *c)).collect()
}

/// An IPv4 EndpointSlice of Service `service` whose port `https` is `port`.
pub fn slice(
    name: &str,
    service: &str,
    port: u16,
    list: &[(SocketAddr, &str, Condition)],
) -> EndpointSlice {
    endpoint_slice(name, service, "IPv4", &[("https", port)], endpoints(list))
}

pub fn service_status(daemon: &Daemon) -> Value {
    daemon.status()["services"][0].clone()
}

pub fn addrs(value: &Value) -> Vec<SocketAddr> {
    value
        .as_array()
        .map_or_else(Vec::new, |a| a.iter().filter_map(|s| s.as_str()?.parse().ok()).collect())
}

/// The kernel's selection and each listed server's readiness, as one view.
#[derive(Debug, PartialEq, Eq)]
pub struct View {
    pub selected: Vec<SocketAddr>,
    pub readiness: HashMap<SocketAddr, String>,
}

pub fn view(status: &Value) -> View {
    let readiness = status["servers"]
        .as_array()
        .map(|servers| {
            servers
                .iter()
                .filter_map(|s| {
                    Some((
                        s["address"].as_str()?.parse().ok()?,
                        s["readiness"].as_str()?.to_owned(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    View { selected: addrs(&status["selected"]), readiness }
}

/// Whether the view is: exactly `ready` ∪ `serving` selected, the ready
/// servers first (in any order: the kernel's leading group), each server
/// with the readiness its endpoint declares.
pub fn view_is(view: &View, ready: &[SocketAddr], serving: &[SocketAddr]) -> bool {
    let want: BTreeSet<SocketAddr> = ready.iter().chain(serving).copied().collect();
    let got: BTreeSet<SocketAddr> = view.selected.iter().copied().collect();
    let leading: BTreeSet<SocketAddr> = view.selected.iter().take(ready.len()).copied().collect();
    got == want
        && view.selected.len() == want.len()
        && leading == ready.iter().copied().collect()
        && ready.iter().all(|a| view.readiness.get(a).is_some_and(|r| r == "ready"))
        && serving.iter().all(|a| view.readiness.get(a).is_some_and(|r| r == "serving"))
        && view.readiness.len() == want.len()
}

/// Waits until the kernel holds `ready` then `serving` (see [`view_is`]);
/// returns CLOCK_MONOTONIC when that was observed: the change was applied
/// before it.
#[track_caller]
pub fn wait_view(daemon: &Daemon, ready: &[SocketAddr], serving: &[SocketAddr], what: &str) -> u64 {
    let mut last = None;
    if wait_until(WAIT, || {
        let v = view(&service_status(daemon));
        let ok = view_is(&v, ready, serving);
        last = Some(v);
        ok
    }) {
        return monotonic_ns();
    }
    panic!(
        "{what}: the kernel never held ready {ready:?} then serving {serving:?}; last view {last:?}\nstatus:\n{}\nlog:\n{}",
        serde_json::to_string_pretty(&daemon.status()).unwrap(),
        daemon.log()
    );
}

/// Waits until `lb status --json` selects exactly the servers of `want`
/// (in any order); returns CLOCK_MONOTONIC when observed.
#[track_caller]
pub fn wait_selected_set(daemon: &Daemon, want: &[SocketAddr], what: &str) -> u64 {
    let want: BTreeSet<SocketAddr> = want.iter().copied().collect();
    let mut last = Vec::new();
    if wait_until(WAIT, || {
        last = addrs(&service_status(daemon)["selected"]);
        last.len() == want.len() && last.iter().copied().collect::<BTreeSet<_>>() == want
    }) {
        return monotonic_ns();
    }
    panic!("{what}: selected never became {want:?}; last {last:?}\nlog:\n{}", daemon.log());
}

/// Waits until `services[0].discovery` satisfies `pred`; returns it.
#[track_caller]
pub fn wait_discovery(daemon: &Daemon, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    if wait_until(WAIT, || {
        last = service_status(daemon)["discovery"].clone();
        pred(&last)
    }) {
        return last;
    }
    panic!("{what}: discovery status never matched; last {last}\nlog:\n{}", daemon.log());
}

/// Waits until every backend of `backends` answered `n` more client
/// connections than when this was called (the client loop is running).
#[track_caller]
pub fn wait_traffic(backends: &[&Backend], n: usize, what: &str) {
    let before: Vec<usize> = backends.iter().map(|b| b.accepted()).collect();
    assert!(
        wait_until(WAIT, || backends.iter().zip(&before).all(|(b, was)| b.accepted() >= was + n)),
        "{what}: not every one of {:?} got {n} more connections: {:?} -> {:?}",
        backends.iter().map(|b| &b.name).collect::<Vec<_>>(),
        before,
        backends.iter().map(|b| b.accepted()).collect::<Vec<_>>()
    );
}

/// Lines of the daemon's log that contain `needle`.
pub fn log_lines(daemon: &Daemon, needle: &str) -> usize {
    daemon.log().lines().filter(|l| l.contains(needle)).count()
}

/// Connects `n` times through `vip`; returns who answered each.
#[track_caller]
pub fn connects(inside: &mut Client, vip: SocketAddr, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| match inside.connect(vip) {
            Connect::Ok { greeting, .. } => greeting,
            Connect::Err(e) => panic!("connect {i} of {n} through {vip} failed: {e}"),
        })
        .collect()
}

#[track_caller]
pub fn all_in(names: &[String], allowed: &[&str], what: &str) {
    assert!(
        names.iter().all(|n| allowed.contains(&n.as_str())),
        "{what}: connects landed on {names:?}, only {allowed:?} allowed"
    );
}

/// Creates the client loop's stop file when dropped, so that a failing
/// test does not leave the loop running until its time limit.
pub struct StopFile(pub PathBuf);

impl Drop for StopFile {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, "");
    }
}

/// A change the test made to the source, and when it was applied.
#[derive(Debug)]
pub struct Step {
    pub what: &'static str,
    /// CLOCK_MONOTONIC when the test made the change at the fake.
    pub changed: u64,
    /// When the test saw the kernel's new selection (`None`: a change
    /// that must not change the selection).
    pub applied: Option<u64>,
}

pub fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// The test changes the source (`change`) and waits until the kernel
/// holds `ready` then `serving`.
#[track_caller]
pub fn change_applied(
    daemon: &Daemon,
    what: &'static str,
    change: impl FnOnce(),
    ready: &[SocketAddr],
    serving: &[SocketAddr],
) -> Step {
    let changed = monotonic_ns();
    change();
    let applied = wait_view(daemon, ready, serving, what);
    eprintln!("{what}: applied and seen {:.1} ms after the change", ms(applied - changed));
    Step { what, changed, applied: Some(applied) }
}

/// The log line of the Kubernetes source for each event it got.
pub const SOURCE_SAW: &str = "kubernetes discovery: EndpointSlices of default/";

/// The test changes the source in a way that must leave the selection
/// alone (a not-ready endpoint appears): waits until discovery saw the
/// event, then two debounce windows, and until each of `still_serving`
/// took more connects; the kernel must still hold exactly `ready`.
#[track_caller]
pub fn change_ignored(
    daemon: &Daemon,
    what: &'static str,
    debounce: Duration,
    change: impl FnOnce(),
    ready: &[SocketAddr],
    still_serving: &[&Backend],
) -> Step {
    let seen = log_lines(daemon, SOURCE_SAW);
    let changed = monotonic_ns();
    change();
    assert!(
        wait_until(WAIT, || log_lines(daemon, SOURCE_SAW) > seen),
        "{what}: discovery never saw the change:\n{}",
        daemon.log()
    );
    thread::sleep(debounce * 2);
    wait_traffic(still_serving, 20, what);
    let now = view(&service_status(daemon));
    assert!(
        view_is(&now, ready, &[]),
        "{what}: the selection changed to {now:?}:\n{}",
        daemon.log()
    );
    Step { what, changed, applied: None }
}

/// The apiservers' own EndpointSlice (`default/kubernetes`): `list` as
/// (address, node), every one ready, on port `port`.
pub fn set_apiservers(api: &FakeApiServer, port: u16, list: &[(SocketAddr, &str)]) {
    let list: Vec<_> = list.iter().map(|(a, n)| (*a, *n, Condition::Ready)).collect();
    api.apply(slice("kubernetes", "kubernetes", port, &list));
}

/// The lb service `api` at `vip` that follows the apiservers' own Service,
/// with `bootstrap` as its configured server.
pub fn apiservers_service(vip: SocketAddr, bootstrap: SocketAddr) -> String {
    kubernetes(
        ServiceBuilder::new("api", vip).servers(&[bootstrap]),
        "kubernetes",
        "https",
        Duration::from_millis(200),
    )
    .toml()
}
