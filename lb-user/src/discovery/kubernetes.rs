//! Kubernetes discovery: the EndpointSlices of one Service.
//!
//! The task watches `discovery.k8s.io/v1` EndpointSlices labelled
//! `kubernetes.io/service-name=<service>` in the namespace (kube-runtime's
//! watcher: list, then watch from the list's resourceVersion, with
//! bookmarks), keeps every slice of the service by name, and after each
//! change merges them (`endpoints_of`):
//! - only slices whose `addressType` is the VIP's family (a dual-stack
//!   Service has one slice per family), and of each slice the port named
//!   (or numbered) in the config. A slice lists the endpoints' own
//!   (target) ports, so a number is matched against those, not against the
//!   Service's port (`default/kubernetes` has port 443 named `https`, its
//!   slice lists 6443 named `https`): a name follows a Service port;
//! - each endpoint judged by its own conditions, never by its node (MetalLB
//!   474): `ready` (nil counts as ready) → [`Readiness::Ready`]; not ready
//!   but `serving` (nil: as ready) → [`Readiness::Serving`] (terminating,
//!   drained); not serving → left out. Of an endpoint's addresses only the
//!   first is used, as kube-proxy does;
//! - ranked and cut to the best 16 by `super::forward::rank`.
//!
//! A relist (the first list, a `410 Gone`, any watch failure) replaces the
//! whole view when it completes: slices that are not in it are gone. A
//! failed request is sent as an `Err`, then the watch starts again from a
//! fresh list after a backoff (250 ms doubling to 5 s). A watch stream that
//! merely ends (the apiserver's timeout, a cut connection) resumes from its
//! resourceVersion, as the protocol says; an expired one gets `410` and
//! relists.
//!
//! How the client reaches the apiserver (through the usable servers of the
//! apiservers' own service, k3s 11349) is `discovery::dial`'s.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    pin::pin,
    time::Duration,
};

use futures::StreamExt as _;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointSlice};
use kube::{
    Api, Client,
    client::ConfigExt as _,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::watcher,
};
use tokio::{
    sync::{mpsc, watch},
    time::Instant,
};
use tower::{BoxError, ServiceBuilder};

use super::{
    Backoff, Endpoint, chain,
    dial::{DialRule, Dialer},
    forward::{Signal, rank},
};
use crate::{balancer::Readiness, config::PortRef};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Retries after a failure: from this, doubling...
const BACKOFF_MIN: Duration = Duration::from_millis(250);
/// ...up to this.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A watch that ran this long without failing resets the backoff.
const HEALTHY_AFTER: Duration = Duration::from_secs(30);

/// What to follow.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    /// The lb service (for logs).
    pub service: String,
    pub vip: SocketAddr,
    pub namespace: String,
    /// The Kubernetes Service.
    pub name: String,
    pub port: PortRef,
    /// The config's servers of the lb service: dialled last.
    pub seeds: Vec<SocketAddr>,
}

impl Target {
    /// Whether the Service is the apiservers' own.
    fn is_apiserver_service(&self) -> bool {
        self.namespace == "default" && self.name == "kubernetes"
    }
}

/// Follows the Service's EndpointSlices until `signals` closes.
pub(crate) async fn run(
    target: Target,
    kubeconfig: Option<PathBuf>,
    usable: watch::Receiver<Vec<SocketAddr>>,
    signals: mpsc::Sender<Signal>,
) {
    let what = format!("EndpointSlices of {}/{}", target.namespace, target.name);
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    let client = loop {
        match client(&target, kubeconfig.as_deref(), usable.clone()).await {
            Ok(client) => break client,
            Err(error) => {
                tracing::warn!(service = %target.service, "kubernetes discovery: {error}");
                if signals.send(Signal::Failed(format!("kubernetes: {error}"))).await.is_err() {
                    return;
                }
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    };
    let api: Api<EndpointSlice> = Api::namespaced(client, &target.namespace);
    let config =
        watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL}={}", target.name));
    // The slices of the service, by name: the view that each list replaces.
    let mut slices: BTreeMap<String, EndpointSlice> = BTreeMap::new();
    loop {
        let started = Instant::now();
        let mut stream = pin!(watcher(api.clone(), config.clone()));
        // A list in progress: replaces `slices` when it is complete.
        let mut listing: Option<BTreeMap<String, EndpointSlice>> = None;
        let failure = loop {
            let event = match stream.next().await {
                None => break Failure::Error("the watch ended".to_owned()),
                Some(Ok(event)) => event,
                // An expired resourceVersion in the stream: the watcher
                // relists by itself.
                Some(Err(watcher::Error::WatchError(status))) if status.code == 410 => {
                    tracing::info!(service = %target.service, "kubernetes discovery: {what}: {}; relisting", status.message);
                    continue;
                }
                // The same as an HTTP status: start again from a list.
                Some(Err(watcher::Error::WatchStartFailed(kube::Error::Api(status))))
                    if status.code == 410 =>
                {
                    break Failure::Gone(status.message.clone());
                }
                Some(Err(error)) => break Failure::Error(chain(&error)),
            };
            let confirm = match event {
                watcher::Event::Init => {
                    listing = Some(BTreeMap::new());
                    continue;
                }
                watcher::Event::InitApply(slice) => {
                    listing.get_or_insert_default().insert(slice_name(&slice), slice);
                    continue;
                }
                watcher::Event::InitDone => {
                    slices = listing.take().unwrap_or_default();
                    true
                }
                watcher::Event::Apply(slice) => {
                    slices.insert(slice_name(&slice), slice);
                    false
                }
                watcher::Event::Delete(slice) => {
                    slices.remove(&slice_name(&slice));
                    false
                }
            };
            let (endpoints, truncated) = endpoints_of(slices.values(), target.vip, &target.port);
            if truncated > 0 {
                tracing::warn!(
                    service = %target.service,
                    "kubernetes discovery: {what} has {} usable endpoints; keeping the best {}, {truncated} left out",
                    endpoints.len() + truncated,
                    endpoints.len(),
                );
            }
            tracing::debug!(service = %target.service, "kubernetes discovery: {what}: {endpoints:?}");
            if signals.send(Signal::List { endpoints, truncated, confirm }).await.is_err() {
                return;
            }
        };
        if started.elapsed() >= HEALTHY_AFTER {
            backoff.reset();
        }
        match failure {
            Failure::Gone(message) => {
                tracing::info!(service = %target.service, "kubernetes discovery: {what}: 410 Gone ({message}); relisting");
            }
            Failure::Error(error) => {
                let error = format!("kubernetes: watching {what}: {error}");
                tracing::warn!(service = %target.service, "{error}");
                if signals.send(Signal::Failed(error)).await.is_err() {
                    return;
                }
            }
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

enum Failure {
    /// The resourceVersion expired: relist, nothing is wrong.
    Gone(String),
    Error(String),
}

fn slice_name(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

/// The Service's endpoints, merged over all its slices: those of the VIP's
/// family, on the configured port, by their conditions; ranked, at most 16,
/// and how many more were left out.
pub(crate) fn endpoints_of<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    vip: SocketAddr,
    port: &PortRef,
) -> (Vec<Endpoint>, usize) {
    let family = if vip.is_ipv4() { "IPv4" } else { "IPv6" };
    let mut found = Vec::new();
    for slice in slices {
        if slice.address_type != family {
            continue;
        }
        let Some(port) = port_of(slice, port) else {
            continue;
        };
        for endpoint in &slice.endpoints {
            let Some(readiness) = readiness_of(endpoint.conditions.as_ref()) else {
                continue;
            };
            // Only the first address has a meaning (the API says so;
            // kube-proxy uses only it).
            let Some(ip) = endpoint.addresses.first().and_then(|a| a.parse::<IpAddr>().ok()) else {
                continue;
            };
            if ip.is_ipv4() != vip.is_ipv4() || ip.is_unspecified() {
                continue;
            }
            found.push(Endpoint { addr: SocketAddr::new(ip, port), readiness });
        }
    }
    rank(found)
}

/// What an endpoint's conditions mean for it: `None` when it is not
/// serving (it leaves the list).
pub(crate) fn readiness_of(conditions: Option<&EndpointConditions>) -> Option<Readiness> {
    let Some(c) = conditions else {
        return Some(Readiness::Ready);
    };
    let ready = c.ready.unwrap_or(true);
    if ready {
        return Some(Readiness::Ready);
    }
    c.serving.unwrap_or(ready).then_some(Readiness::Serving)
}

/// The slice's port that `wanted` names, when it has one.
fn port_of(slice: &EndpointSlice, wanted: &PortRef) -> Option<u16> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    let port = ports.iter().find(|p| match wanted {
        PortRef::Name(name) => p.name.as_deref().unwrap_or("") == name,
        PortRef::Number(number) => p.port == Some(i32::from(*number)),
    })?;
    u16::try_from(port.port?).ok().filter(|p| *p != 0)
}

/// The kube client: the kubeconfig's (or in-cluster) settings, on a
/// [`Dialer`].
async fn client(
    target: &Target,
    kubeconfig: Option<&Path>,
    usable: watch::Receiver<Vec<SocketAddr>>,
) -> Result<Client, String> {
    let rule = DialRule { vip: target.vip, apiserver_service: target.is_apiserver_service() };
    client_with(rule, target.seeds.clone(), kubeconfig, usable, &target.service).await
}

/// The kube client: the kubeconfig's (or in-cluster) settings, dialling
/// as `rule` says through `usable` and then `seeds` (see [`DialRule::plan`]).
/// `who` names the user in logs.
pub(crate) async fn client_with(
    rule: DialRule,
    seeds: Vec<SocketAddr>,
    kubeconfig: Option<&Path>,
    usable: watch::Receiver<Vec<SocketAddr>>,
    who: &str,
) -> Result<Client, String> {
    let config = match kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)
                .map_err(|e| format!("reading the kubeconfig {}: {}", path.display(), chain(&e)))?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(|e| format!("loading the kubeconfig {}: {}", path.display(), chain(&e)))?
        }
        None => kube::Config::incluster().map_err(|e| {
            format!("loading the in-cluster config (no [daemon] kubeconfig is set): {}", chain(&e))
        })?,
    };
    if config.accept_invalid_certs {
        tracing::warn!(service = %who, "the kubeconfig skips TLS verification (insecure-skip-tls-verify)");
    }
    let dialer = Dialer::new(rule, seeds, usable);
    let https = config
        .rustls_https_connector_with_connector(dialer)
        .map_err(|e| format!("TLS settings: {}", chain(&e)))?;
    // No pooled idle connections: every request dials afresh, so after an
    // apiserver dies the next one goes to a live one.
    let http: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(https);
    let auth = config.auth_layer().map_err(|e| format!("credentials: {}", chain(&e)))?;
    let headers = config.extra_headers_layer().map_err(|e| format!("headers: {}", chain(&e)))?;
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(auth)
        .layer(headers)
        .map_err(BoxError::from)
        .service(http);
    Ok(Client::new(service, config.default_namespace))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::discovery::v1::{Endpoint as K8sEndpoint, EndpointPort},
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    fn port(name: &str, number: i32) -> EndpointPort {
        EndpointPort {
            name: Some(name.into()),
            port: Some(number),
            protocol: Some("TCP".into()),
            ..Default::default()
        }
    }

    fn conditions(
        ready: Option<bool>,
        serving: Option<bool>,
        terminating: Option<bool>,
    ) -> Option<EndpointConditions> {
        Some(EndpointConditions { ready, serving, terminating })
    }

    fn endpoint(addr: &str, node: &str, conditions: Option<EndpointConditions>) -> K8sEndpoint {
        K8sEndpoint {
            addresses: vec![addr.into()],
            conditions,
            node_name: Some(node.into()),
            ..Default::default()
        }
    }

    fn slice(
        name: &str,
        family: &str,
        ports: Vec<EndpointPort>,
        endpoints: Vec<K8sEndpoint>,
    ) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
            address_type: family.into(),
            ports: Some(ports),
            endpoints,
        }
    }

    fn ep(addr: &str, readiness: Readiness) -> Endpoint {
        Endpoint { addr: addr.parse().unwrap(), readiness }
    }

    const READY: Option<EndpointConditions> = Some(EndpointConditions {
        ready: Some(true),
        serving: Some(true),
        terminating: Some(false),
    });
    const NOT_READY: Option<EndpointConditions> = Some(EndpointConditions {
        ready: Some(false),
        serving: Some(false),
        terminating: Some(false),
    });
    const DRAINING: Option<EndpointConditions> = Some(EndpointConditions {
        ready: Some(false),
        serving: Some(true),
        terminating: Some(true),
    });
    const GOING: Option<EndpointConditions> = Some(EndpointConditions {
        ready: Some(false),
        serving: Some(false),
        terminating: Some(true),
    });

    fn vip4() -> SocketAddr {
        "127.0.0.1:6444".parse().unwrap()
    }

    fn https() -> PortRef {
        PortRef::Name("https".into())
    }

    #[test]
    fn conditions_map_to_readiness_per_the_api() {
        assert_eq!(readiness_of(None), Some(Readiness::Ready));
        assert_eq!(
            readiness_of(conditions(None, None, None).as_ref()),
            Some(Readiness::Ready),
            "nil ready counts as ready"
        );
        assert_eq!(readiness_of(READY.as_ref()), Some(Readiness::Ready));
        assert_eq!(readiness_of(DRAINING.as_ref()), Some(Readiness::Serving));
        assert_eq!(readiness_of(GOING.as_ref()), None);
        assert_eq!(readiness_of(NOT_READY.as_ref()), None);
        // Not ready, serving unset: serving follows ready.
        assert_eq!(readiness_of(conditions(Some(false), None, Some(true)).as_ref()), None);
        // Ready wins whatever else is said.
        assert_eq!(
            readiness_of(conditions(Some(true), Some(false), None).as_ref()),
            Some(Readiness::Ready)
        );
    }

    #[test]
    fn metallb_474_a_not_ready_endpoint_never_hides_a_ready_one_on_its_node() {
        // A rolling update: the new pod (not ready yet) landed on the node
        // of the remaining old, ready pod.
        let s = slice(
            "web-abc",
            "IPv4",
            vec![port("https", 8443)],
            vec![
                endpoint("127.10.0.1", "node-a", READY),
                endpoint("127.10.0.2", "node-a", NOT_READY),
            ],
        );
        let (list, truncated) = endpoints_of([&s], vip4(), &https());
        assert_eq!(list, [ep("127.10.0.1:8443", Readiness::Ready)]);
        assert_eq!(truncated, 0);
        // And the other way round: a ready endpoint never lifts a not-ready
        // one on its node.
        let s = slice(
            "web-abc",
            "IPv4",
            vec![port("https", 8443)],
            vec![
                endpoint("127.10.0.2", "node-a", NOT_READY),
                endpoint("127.10.0.3", "node-a", DRAINING),
                endpoint("127.10.0.1", "node-a", READY),
            ],
        );
        let (list, _) = endpoints_of([&s], vip4(), &https());
        assert_eq!(
            list,
            [ep("127.10.0.1:8443", Readiness::Ready), ep("127.10.0.3:8443", Readiness::Serving)]
        );
    }

    #[test]
    fn every_slice_of_the_service_is_merged() {
        let a = slice(
            "web-a",
            "IPv4",
            vec![port("https", 8443)],
            vec![endpoint("127.10.0.1", "n1", READY)],
        );
        let b = slice(
            "web-b",
            "IPv4",
            vec![port("https", 8443)],
            vec![endpoint("127.10.0.2", "n2", None)],
        );
        let (list, _) = endpoints_of([&a, &b], vip4(), &https());
        assert_eq!(
            list,
            [ep("127.10.0.1:8443", Readiness::Ready), ep("127.10.0.2:8443", Readiness::Ready)]
        );
    }

    #[test]
    fn only_the_vips_family_is_taken() {
        let v4 = slice(
            "web-v4",
            "IPv4",
            vec![port("https", 8443)],
            vec![endpoint("127.10.0.1", "n1", READY)],
        );
        // fd00:: (and every address in these tests) is data only: nothing
        // here dials it.
        let v6 = slice(
            "web-v6",
            "IPv6",
            vec![port("https", 8443)],
            vec![endpoint("fd00::1", "n1", READY)],
        );
        let fqdn = slice(
            "web-fqdn",
            "FQDN",
            vec![port("https", 8443)],
            vec![endpoint("web.example", "n1", READY)],
        );
        let (list, _) = endpoints_of([&v4, &v6, &fqdn], vip4(), &https());
        assert_eq!(list, [ep("127.10.0.1:8443", Readiness::Ready)]);
        let (list, _) = endpoints_of([&v4, &v6, &fqdn], "[::1]:6444".parse().unwrap(), &https());
        assert_eq!(list, [ep("[fd00::1]:8443", Readiness::Ready)]);
        // A slice that says IPv4 but carries something else is skipped.
        let bad = slice(
            "web-bad",
            "IPv4",
            vec![port("https", 8443)],
            vec![endpoint("fd00::2", "n1", READY), endpoint("0.0.0.0", "n1", READY)],
        );
        assert_eq!(endpoints_of([&bad], vip4(), &https()).0, []);
    }

    #[test]
    fn the_port_is_found_by_name_or_number_per_slice() {
        // Two slices of one Service whose named port maps to different
        // container ports (pods of two versions).
        let old = slice(
            "web-old",
            "IPv4",
            vec![port("metrics", 9090), port("https", 8443)],
            vec![endpoint("127.10.0.1", "n1", READY)],
        );
        let new = slice(
            "web-new",
            "IPv4",
            vec![port("https", 9443)],
            vec![endpoint("127.10.0.2", "n2", READY)],
        );
        let (list, _) = endpoints_of([&old, &new], vip4(), &https());
        assert_eq!(
            list,
            [ep("127.10.0.1:8443", Readiness::Ready), ep("127.10.0.2:9443", Readiness::Ready)]
        );
        let (list, _) = endpoints_of([&old, &new], vip4(), &PortRef::Number(9090));
        assert_eq!(list, [ep("127.10.0.1:9090", Readiness::Ready)]);
        // An unnamed port (a Service with one port) is the name "".
        let unnamed = slice(
            "web-u",
            "IPv4",
            vec![EndpointPort { port: Some(6443), ..Default::default() }],
            vec![endpoint("127.10.0.3", "n3", READY)],
        );
        assert_eq!(
            endpoints_of([&unnamed], vip4(), &PortRef::Name(String::new())).0,
            [ep("127.10.0.3:6443", Readiness::Ready)]
        );
        assert_eq!(endpoints_of([&unnamed], vip4(), &https()).0, []);
        // A slice without ports, or a port without a number, gives nothing.
        let mut none = unnamed.clone();
        none.ports = None;
        assert_eq!(endpoints_of([&none], vip4(), &PortRef::Number(6443)).0, []);
    }

    /// Issue 24: the cluster's DNS (`kube-system/kube-dns`, port `dns`) is
    /// UDP; a port is found by its name whatever its protocol.
    #[test]
    fn a_udp_port_is_found_by_its_name() {
        let udp = EndpointPort { protocol: Some("UDP".into()), ..port("dns", 53) };
        let s = slice(
            "kube-dns",
            "IPv4",
            vec![udp, port("dns-tcp", 53), port("metrics", 9153)],
            vec![endpoint("127.10.0.1", "n1", READY)],
        );
        assert_eq!(
            endpoints_of([&s], vip4(), &PortRef::Name("dns".into())).0,
            [ep("127.10.0.1:53", Readiness::Ready)]
        );
    }

    #[test]
    fn only_the_first_address_of_an_endpoint_counts() {
        let mut e = endpoint("127.10.0.1", "n1", READY);
        e.addresses.push("127.10.0.99".into());
        let s = slice("web", "IPv4", vec![port("https", 8443)], vec![e]);
        assert_eq!(
            endpoints_of([&s], vip4(), &https()).0,
            [ep("127.10.0.1:8443", Readiness::Ready)]
        );
    }

    #[test]
    fn more_than_sixteen_keeps_ready_first_then_by_address() {
        let mut endpoints: Vec<K8sEndpoint> =
            (1..=12).map(|i| endpoint(&format!("127.10.1.{i}"), "n", DRAINING)).collect();
        endpoints.extend((1..=12).map(|i| endpoint(&format!("127.10.2.{i}"), "n", READY)));
        let s = slice("web", "IPv4", vec![port("https", 443)], endpoints);
        let (list, truncated) = endpoints_of([&s], vip4(), &https());
        assert_eq!(list.len(), 16);
        assert_eq!(truncated, 8);
        assert!(list[..12].iter().all(|e| e.readiness == Readiness::Ready));
        assert_eq!(list[12], ep("127.10.1.1:443", Readiness::Serving));
        assert_eq!(list[15], ep("127.10.1.4:443", Readiness::Serving));
    }
}
