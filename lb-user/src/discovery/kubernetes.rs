//! Kubernetes discovery: the EndpointSlices of one Service.
//!
//! The task watches `discovery.k8s.io/v1` EndpointSlices labelled
//! `kubernetes.io/service-name=<service>` in the namespace (kube-runtime's
//! watcher: list, then watch from the list's resourceVersion, with
//! bookmarks), keeps every slice of the service by name, and after each
//! change merges them (`super::slices`, which says how).
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
    net::SocketAddr,
    path::{Path, PathBuf},
    pin::pin,
    time::Duration,
};

use futures::StreamExt as _;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::discovery::v1::EndpointSlice;
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
    Backoff, chain,
    dial::{DialRule, Dialer},
    forward::Signal,
    slices::endpoints_of,
};
use crate::config::PortRef;

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
    /// Only the endpoints on this node (`externalTrafficPolicy: Local`).
    pub node: Option<String>,
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
            let (endpoints, truncated) =
                endpoints_of(slices.values(), target.vip, &target.port, target.node.as_deref());
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
