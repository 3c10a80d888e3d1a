//! Discovery: a service's server list from the cluster or from DNS.
//!
//! One task per service with a `[service.discovery]` source follows that
//! source and sends the daemon an [`Update`] after each settled change. The
//! daemon owns what happens next (whether an empty list is applied, the
//! state file, status and metrics): this module only tells what the source
//! says, never changes balancer state (the one owner rule).
//!
//! - `kubernetes`: the EndpointSlices of a Service, judged per endpoint
//!   address by their conditions (MetalLB 474); the watch reconnects
//!   through a usable server of the service when it discovers the
//!   apiservers themselves (k3s 11349).
//! - `dns`: the A or AAAA records of a name, re-resolved at their TTL.
//!
//! Both sources produce `Signal`s; `forward` debounces them into
//! [`Update`]s, the same way for both.
//!
//! Each source is a cargo feature of lb-user (`kubernetes`, `dns`; both on
//! by default). A build without one refuses a config that names it
//! ([`config::Discovery::is_built`]).

#[cfg(feature = "kubernetes")]
pub(crate) mod dial;
#[cfg(feature = "dns")]
pub mod dns;
#[cfg(any(feature = "kubernetes", feature = "dns"))]
mod forward;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
#[cfg(feature = "kubernetes")]
mod slices;

use std::{fmt, net::SocketAddr, path::PathBuf, time::Duration};

use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};

#[cfg(any(feature = "kubernetes", feature = "dns"))]
use self::forward::forward;
use crate::{balancer::Readiness, config};

/// The most servers a service holds (`lb_common::MAX_SERVERS`); discovered
/// endpoints beyond it are left out, worst first, and counted in
/// [`Update::truncated`].
pub const MAX_SERVERS: usize = lb_common::MAX_SERVERS;

/// The environment variable that points DNS discovery at one name server
/// (`IP:PORT`) instead of the system's resolv.conf: a test and debugging
/// knob, e.g. `LB_DNS_SERVER=127.0.0.1:5353`.
pub const DNS_SERVER_ENV: &str = "LB_DNS_SERVER";

/// One discovered server and what its source says of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Where it listens.
    pub addr: SocketAddr,
    /// [`Readiness::Ready`], or [`Readiness::Serving`] for an endpoint that
    /// is terminating but still serving (drained: no new connections while
    /// a ready server exists). Endpoints that are not serving are left out.
    pub readiness: Readiness,
}

/// Where a list came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// A Kubernetes Service's EndpointSlices.
    Kubernetes,
    /// DNS A/AAAA records.
    Dns,
}

impl Source {
    /// The name used in logs, status and metric labels.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Kubernetes => "kubernetes",
            Self::Dns => "dns",
        }
    }
}

impl From<&config::Discovery> for Source {
    fn from(discovery: &config::Discovery) -> Self {
        match discovery {
            config::Discovery::Kubernetes { .. } => Self::Kubernetes,
            config::Discovery::Dns { .. } => Self::Dns,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a discovery task tells the daemon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Update {
    /// The service whose list it is.
    pub service: String,
    /// Where it came from.
    pub source: Source,
    /// The whole list, best first (ready before serving, then by address),
    /// at most [`MAX_SERVERS`]; or why the sync failed (the daemon keeps
    /// its last list). An empty list is sent as `Ok(vec![])`: the daemon
    /// decides to keep its last list.
    ///
    /// An `Ok` may repeat the list sent before: it confirms a successful
    /// sync (after each Kubernetes relist, after each DNS resolution, and
    /// the first success after an error).
    pub result: Result<Vec<Endpoint>, String>,
    /// Endpoints left out because the list holds at most [`MAX_SERVERS`].
    pub truncated: usize,
}

/// Knobs that are not in the config file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// The kubeconfig (`[daemon] kubeconfig`); `None`: in-cluster.
    pub kubeconfig: Option<PathBuf>,
    /// One name server for DNS discovery (UDP, then TCP, at this address)
    /// instead of the system's resolv.conf.
    pub dns_server: Option<SocketAddr>,
    /// How long one DNS query waits for an answer (two attempts are made);
    /// `None`: `dns::DEFAULT_TIMEOUT`.
    pub dns_timeout: Option<Duration>,
}

impl Options {
    /// The options of a daemon: `kubeconfig` from the config, the DNS
    /// server from [`DNS_SERVER_ENV`] when set.
    pub fn from_env(kubeconfig: Option<PathBuf>) -> Self {
        let dns_server = std::env::var(DNS_SERVER_ENV).ok().and_then(|v| match v.parse() {
            Ok(addr) => Some(addr),
            Err(e) => {
                tracing::warn!(
                    "{DNS_SERVER_ENV}={v:?} is not IP:PORT ({e}); using the system's resolv.conf"
                );
                None
            }
        });
        Self { kubeconfig, dns_server, dns_timeout: None }
    }
}

/// Starts following `discovery` for the service `name` whose VIP is `vip`
/// (its address family picks A vs AAAA and the EndpointSlice addressType).
///
/// Sends an [`Update`] after each settled change (debounced by the
/// discovery's `debounce`), and an `Err` when a sync fails. `usable`: the
/// daemon's current usable servers of this service (best first); the
/// Kubernetes watch of the apiservers' own Service reconnects through them
/// (see `kubernetes`), and then through `seeds`, the config's servers, as
/// a last resort. The task ends when `tx` is closed, or when aborted.
pub fn spawn(
    name: String,
    vip: SocketAddr,
    discovery: config::Discovery,
    kubeconfig: Option<PathBuf>,
    seeds: Vec<SocketAddr>,
    usable: watch::Receiver<Vec<SocketAddr>>,
    tx: mpsc::Sender<Update>,
) -> JoinHandle<()> {
    spawn_with(name, vip, discovery, Options::from_env(kubeconfig), seeds, usable, tx)
}

/// [`spawn`] with explicit [`Options`] (tests: a DNS server on loopback).
pub fn spawn_with(
    name: String,
    vip: SocketAddr,
    discovery: config::Discovery,
    options: Options,
    seeds: Vec<SocketAddr>,
    usable: watch::Receiver<Vec<SocketAddr>>,
    tx: mpsc::Sender<Update>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        match discovery {
            #[cfg(feature = "kubernetes")]
            config::Discovery::Kubernetes { namespace, service, port, debounce, node } => {
                let (signals, signal_rx) = mpsc::channel(SIGNALS);
                let follow = kubernetes::run(
                    kubernetes::Target {
                        service: name.clone(),
                        vip,
                        namespace,
                        name: service,
                        port,
                        node,
                        seeds,
                    },
                    options.kubeconfig,
                    usable,
                    signals,
                );
                let forward = forward(name, Source::Kubernetes, debounce, signal_rx, tx);
                tokio::select! {
                    () = follow => {}
                    () = forward => {}
                }
            }
            #[cfg(feature = "dns")]
            config::Discovery::Dns { name: host, port, debounce, refresh_min, refresh_max } => {
                let (signals, signal_rx) = mpsc::channel(SIGNALS);
                let follow = dns::run(
                    dns::Target {
                        service: name.clone(),
                        host,
                        port,
                        vip,
                        refresh_min,
                        refresh_max,
                    },
                    dns::ResolverChoice {
                        server: options.dns_server,
                        timeout: options.dns_timeout,
                    },
                    signals,
                );
                let forward = forward(name, Source::Dns, debounce, signal_rx, tx);
                tokio::select! {
                    () = follow => {}
                    () = forward => {}
                }
            }
            // `Config::parse` refuses a source this build lacks: only a
            // caller that makes its own `Discovery` gets here, and hears it
            // as a failed sync, once.
            #[cfg(not(all(feature = "kubernetes", feature = "dns")))]
            built_out => {
                // Only the missing source would have used these.
                let _ = (vip, options, seeds, usable);
                let feature = built_out.feature();
                let update = Update {
                    service: name,
                    source: Source::from(&built_out),
                    result: Err(format!("lb was built without the `{feature}` feature")),
                    truncated: 0,
                };
                let _ = tx.send(update).await;
            }
        }
    })
}

/// How many signals a source may send ahead of the forwarder.
#[cfg(any(feature = "kubernetes", feature = "dns"))]
const SIGNALS: usize = 64;

/// Bounded exponential backoff for retries after a failure.
#[cfg(feature = "kubernetes")]
#[derive(Clone, Debug)]
pub(crate) struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

#[cfg(feature = "kubernetes")]
impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Self { next: min, min, max }
    }

    /// The delay before the next retry; each one doubles, up to `max`.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.min;
    }
}

/// An error and its sources, joined by ": ", for an `Err` update.
#[cfg(any(feature = "kubernetes", feature = "dns"))]
pub(crate) fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut words = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let word = e.to_string();
        // Some errors repeat their source in their own message.
        if !words.contains(&word) {
            words.push_str(": ");
            words.push_str(&word);
        }
        source = e.source();
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_names() {
        assert_eq!(Source::Kubernetes.name(), "kubernetes");
        assert_eq!(Source::Dns.name(), "dns");
        assert_eq!(Source::Dns.to_string(), "dns");
    }

    #[test]
    #[cfg(feature = "kubernetes")]
    fn backoff_doubles_up_to_the_bound_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(250), Duration::from_secs(5));
        let delays: Vec<_> = (0..7).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [250, 500, 1000, 2000, 4000, 5000, 5000]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(250));
    }

    #[tokio::test]
    #[cfg(not(all(feature = "kubernetes", feature = "dns")))]
    async fn a_source_this_build_lacks_is_one_failed_sync() {
        let sources = [
            config::Discovery::Kubernetes {
                namespace: "default".into(),
                service: "kubernetes".into(),
                port: config::PortRef::Name("https".into()),
                debounce: Duration::from_secs(1),
                node: None,
            },
            config::Discovery::Dns {
                name: "api.example.internal".into(),
                port: 6443,
                debounce: Duration::from_secs(1),
                refresh_min: Duration::from_secs(5),
                refresh_max: Duration::from_secs(300),
            },
        ];
        for discovery in sources.into_iter().filter(|d| !d.is_built()) {
            let feature = discovery.feature();
            let source = Source::from(&discovery);
            let (tx, mut updates) = mpsc::channel(4);
            let (_usable, usable_rx) = watch::channel(Vec::new());
            let vip = "127.0.0.1:6444".parse().unwrap();
            let task =
                spawn_with("api".into(), vip, discovery, Options::default(), vec![], usable_rx, tx);
            task.await.unwrap();
            let expected = Update {
                service: "api".into(),
                source,
                result: Err(format!("lb was built without the `{feature}` feature")),
                truncated: 0,
            };
            assert_eq!(updates.recv().await, Some(expected));
            assert_eq!(updates.recv().await, None, "one update, then the task ends");
        }
    }
}
