//! Discovery: a service's server list from the cluster or from DNS.
//!
//! One task per service with a `[service.discovery]` source follows that
//! source and sends the daemon an [`Update`] after each settled change. The
//! daemon owns what happens next (whether an empty list is applied, the
//! state file, status and metrics): this module only tells what the source
//! says, never changes balancer state (the one owner rule).
//!
//! - [`kubernetes`]: the EndpointSlices of a Service, judged per endpoint
//!   address by their conditions (MetalLB 474); the watch reconnects
//!   through a usable server of the service when it discovers the
//!   apiservers themselves (k3s 11349).
//! - [`dns`]: the A or AAAA records of a name, re-resolved at their TTL.
//!
//! Both sources produce `Signal`s; `forward` debounces them into
//! [`Update`]s, the same way for both.

pub mod dns;
pub mod kubernetes;

use std::{
    cmp::Reverse, collections::HashMap, fmt, net::SocketAddr, path::PathBuf, time::Duration,
};

use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
    time::Instant,
};

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
    /// `None`: [`dns::DEFAULT_TIMEOUT`].
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
/// (see [`kubernetes`]). The task ends when `tx` is closed, or when aborted.
pub fn spawn(
    name: String,
    vip: SocketAddr,
    discovery: config::Discovery,
    kubeconfig: Option<PathBuf>,
    usable: watch::Receiver<Vec<SocketAddr>>,
    tx: mpsc::Sender<Update>,
) -> JoinHandle<()> {
    spawn_with(name, vip, discovery, Options::from_env(kubeconfig), usable, tx)
}

/// [`spawn`] with explicit [`Options`] (tests: a DNS server on loopback).
pub fn spawn_with(
    name: String,
    vip: SocketAddr,
    discovery: config::Discovery,
    options: Options,
    usable: watch::Receiver<Vec<SocketAddr>>,
    tx: mpsc::Sender<Update>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let (signals, signal_rx) = mpsc::channel(64);
        match discovery {
            config::Discovery::Kubernetes { namespace, service, port, debounce } => {
                let follow = kubernetes::run(
                    kubernetes::Target {
                        service: name.clone(),
                        vip,
                        namespace,
                        name: service,
                        port,
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
            config::Discovery::Dns { name: host, port, debounce, refresh_min, refresh_max } => {
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
        }
    })
}

/// What a source tells the forwarder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Signal {
    /// The whole current list (ranked by [`rank`]).
    List {
        endpoints: Vec<Endpoint>,
        truncated: usize,
        /// Send it even if it equals the last list sent: a full sync
        /// (relist, resolution) that the daemon should hear of.
        confirm: bool,
    },
    /// A sync failed: sent at once.
    Failed(String),
}

/// Orders endpoints best first (ready before serving, then by address),
/// keeps one per address (the best readiness), and keeps at most
/// [`MAX_SERVERS`]: returns the list and how many were left out.
pub(crate) fn rank(endpoints: impl IntoIterator<Item = Endpoint>) -> (Vec<Endpoint>, usize) {
    let mut best: HashMap<SocketAddr, Readiness> = HashMap::new();
    for Endpoint { addr, readiness } in endpoints {
        let slot = best.entry(addr).or_insert(readiness);
        *slot = (*slot).max(readiness);
    }
    let mut list: Vec<Endpoint> =
        best.into_iter().map(|(addr, readiness)| Endpoint { addr, readiness }).collect();
    list.sort_by_key(|e| (Reverse(e.readiness), e.addr));
    let truncated = list.len().saturating_sub(MAX_SERVERS);
    list.truncate(MAX_SERVERS);
    (list, truncated)
}

/// Turns a source's signals into updates: a failure goes out at once; a
/// list that differs from the last one sent (or a confirmation) opens a
/// window of `debounce`, and when it closes the latest list goes out once,
/// if it still differs or a confirmation is due. A burst inside the window
/// (an endpoint added, removed and re-added) is one update, and an update
/// is never later than `debounce` after the first change. The first
/// success after a failure is always sent.
///
/// Returns when the daemon closes `tx` or the source closes `signals`.
pub(crate) async fn forward(
    service: String,
    source: Source,
    debounce: Duration,
    mut signals: mpsc::Receiver<Signal>,
    tx: mpsc::Sender<Update>,
) {
    let mut sent: Option<(Vec<Endpoint>, usize)> = None;
    let mut latest: Option<(Vec<Endpoint>, usize)> = None;
    let mut confirm = true; // the first list always goes out
    let mut window: Option<Instant> = None;
    loop {
        let signal = tokio::select! {
            signal = signals.recv() => signal,
            () = sleep_until(window) => {
                window = None;
                if let Some(list) = latest.take()
                    && (confirm || sent.as_ref() != Some(&list))
                {
                    confirm = false;
                    let (endpoints, truncated) = list.clone();
                    sent = Some(list);
                    if tx.send(Update { service: service.clone(), source, result: Ok(endpoints), truncated }).await.is_err() {
                        return;
                    }
                }
                continue;
            }
            () = tx.closed() => return,
        };
        let Some(signal) = signal else { return };
        match signal {
            Signal::List { endpoints, truncated, confirm: c } => {
                let list = (endpoints, truncated);
                confirm |= c;
                if window.is_none() && (confirm || sent.as_ref() != Some(&list)) {
                    window = Some(Instant::now() + debounce);
                }
                latest = Some(list);
            }
            Signal::Failed(error) => {
                confirm = true;
                let update =
                    Update { service: service.clone(), source, result: Err(error), truncated: 0 };
                if tx.send(update).await.is_err() {
                    return;
                }
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Bounded exponential backoff for retries after a failure.
#[derive(Clone, Debug)]
pub(crate) struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

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

    fn ep(addr: &str, readiness: Readiness) -> Endpoint {
        Endpoint { addr: addr.parse().unwrap(), readiness }
    }

    fn ready(addr: &str) -> Endpoint {
        ep(addr, Readiness::Ready)
    }

    #[test]
    fn source_names() {
        assert_eq!(Source::Kubernetes.name(), "kubernetes");
        assert_eq!(Source::Dns.name(), "dns");
        assert_eq!(Source::Dns.to_string(), "dns");
    }

    #[test]
    fn rank_puts_ready_first_then_orders_by_address() {
        let (list, truncated) = rank([
            ep("127.10.0.3:80", Readiness::Serving),
            ready("127.10.0.9:80"),
            ready("127.10.0.1:80"),
            ep("127.10.0.2:80", Readiness::Serving),
        ]);
        assert_eq!(
            list,
            [
                ready("127.10.0.1:80"),
                ready("127.10.0.9:80"),
                ep("127.10.0.2:80", Readiness::Serving),
                ep("127.10.0.3:80", Readiness::Serving)
            ]
        );
        assert_eq!(truncated, 0);
    }

    #[test]
    fn rank_keeps_one_entry_per_address_with_the_best_readiness() {
        // The same endpoint in two slices (a slice being replaced).
        let (list, _) = rank([ep("127.10.0.1:80", Readiness::Serving), ready("127.10.0.1:80")]);
        assert_eq!(list, [ready("127.10.0.1:80")]);
    }

    #[test]
    fn rank_keeps_the_best_sixteen_and_counts_the_rest() {
        // 10 serving with low addresses, 10 ready with high ones: the 10
        // ready stay, then the 6 lowest serving.
        let serving = (1..=10).map(|i| ep(&format!("127.10.0.{i}:80"), Readiness::Serving));
        let readies = (101..=110).map(|i| ready(&format!("127.10.0.{i}:80")));
        let (list, truncated) = rank(serving.chain(readies));
        assert_eq!(list.len(), MAX_SERVERS);
        assert_eq!(truncated, 4);
        assert!(list[..10].iter().all(|e| e.readiness == Readiness::Ready));
        assert_eq!(list[10], ep("127.10.0.1:80", Readiness::Serving));
        assert_eq!(list[15], ep("127.10.0.6:80", Readiness::Serving));
        // Stable: the same input in another order gives the same list.
        let again: Vec<_> = list.iter().rev().copied().collect();
        assert_eq!(rank(again).0, list);
    }

    #[test]
    fn backoff_doubles_up_to_the_bound_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(250), Duration::from_secs(5));
        let delays: Vec<_> = (0..7).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [250, 500, 1000, 2000, 4000, 5000, 5000]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(250));
    }

    struct Harness {
        signals: mpsc::Sender<Signal>,
        updates: mpsc::Receiver<Update>,
        task: JoinHandle<()>,
    }

    const DEBOUNCE: Duration = Duration::from_secs(1);

    fn harness() -> Harness {
        let (signals, signal_rx) = mpsc::channel(16);
        let (tx, updates) = mpsc::channel(16);
        let task = tokio::spawn(forward("api".into(), Source::Kubernetes, DEBOUNCE, signal_rx, tx));
        Harness { signals, updates, task }
    }

    fn list(endpoints: &[Endpoint], confirm: bool) -> Signal {
        Signal::List { endpoints: endpoints.to_vec(), truncated: 0, confirm }
    }

    fn ok(endpoints: &[Endpoint]) -> Update {
        Update {
            service: "api".into(),
            source: Source::Kubernetes,
            result: Ok(endpoints.to_vec()),
            truncated: 0,
        }
    }

    impl Harness {
        async fn send(&self, signal: Signal) {
            self.signals.send(signal).await.unwrap();
            // Let the forwarder take it before time moves.
            tokio::task::yield_now().await;
        }

        /// The next update, and how long (simulated) it took.
        async fn next(&mut self) -> (Update, Duration) {
            let start = Instant::now();
            let update = tokio::time::timeout(Duration::from_secs(60), self.updates.recv())
                .await
                .expect("no update")
                .unwrap();
            (update, start.elapsed())
        }

        /// No update within `within`.
        async fn quiet(&mut self, within: Duration) {
            if let Ok(update) = tokio::time::timeout(within, self.updates.recv()).await {
                panic!("unexpected update {update:?}");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_list_goes_out_after_the_window_even_if_empty() {
        let mut h = harness();
        h.send(list(&[], true)).await;
        let (update, took) = h.next().await;
        assert_eq!(update, ok(&[]));
        assert_eq!(took, DEBOUNCE);
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn add_remove_readd_within_the_window_is_one_update() {
        let mut h = harness();
        let a = ready("127.10.0.1:443");
        let b = ready("127.10.0.2:443");
        h.send(list(&[a], true)).await;
        assert_eq!(h.next().await.0, ok(&[a]));

        h.send(list(&[a, b], false)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        h.send(list(&[a], false)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        h.send(list(&[a, b], false)).await;
        let (update, took) = h.next().await;
        assert_eq!(update, ok(&[a, b]));
        // The window opened with the first change: 1 s after it.
        assert_eq!(took, DEBOUNCE - Duration::from_millis(600));
        h.quiet(Duration::from_secs(10)).await;
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_undone_within_the_window_sends_nothing() {
        let mut h = harness();
        let a = ready("127.10.0.1:443");
        let b = ready("127.10.0.2:443");
        h.send(list(&[a], true)).await;
        h.next().await;
        h.send(list(&[a, b], false)).await;
        h.send(list(&[a], false)).await;
        h.quiet(Duration::from_secs(10)).await;
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn an_unchanged_list_is_not_resent_unless_confirmed() {
        let mut h = harness();
        let a = ready("127.10.0.1:443");
        h.send(list(&[a], true)).await;
        h.next().await;
        h.send(list(&[a], false)).await;
        h.quiet(Duration::from_secs(5)).await;
        // A relist confirms the same list.
        h.send(list(&[a], true)).await;
        assert_eq!(h.next().await.0, ok(&[a]));
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_goes_out_at_once_and_the_next_success_is_always_sent() {
        let mut h = harness();
        let a = ready("127.10.0.1:443");
        h.send(list(&[a], true)).await;
        h.next().await;
        h.send(Signal::Failed("boom".into())).await;
        let (update, took) = h.next().await;
        assert_eq!(update.result, Err("boom".into()));
        assert_eq!(took, Duration::ZERO);
        // The same list as before, not flagged as a confirmation: still
        // sent, so the daemon knows the source recovered.
        h.send(list(&[a], false)).await;
        assert_eq!(h.next().await.0, ok(&[a]));
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn steady_changes_are_sent_every_window_not_held_back() {
        let mut h = harness();
        h.send(list(&[], true)).await;
        h.next().await;
        // A change every 400 ms for 3 s: updates keep coming, each at most
        // one window after the change that opened it.
        let mut updates = 0;
        for i in 1..=8u16 {
            h.send(list(&[ready(&format!("127.10.0.{i}:443"))], false)).await;
            tokio::time::sleep(Duration::from_millis(400)).await;
            while let Ok(u) = h.updates.try_recv() {
                assert!(u.result.is_ok());
                updates += 1;
            }
        }
        assert!(updates >= 2, "{updates} updates");
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn truncation_is_reported() {
        let mut h = harness();
        let a = ready("127.10.0.1:443");
        h.send(Signal::List { endpoints: vec![a], truncated: 3, confirm: true }).await;
        let (update, _) = h.next().await;
        assert_eq!(update.truncated, 3);
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn the_forwarder_ends_when_the_daemon_goes() {
        let h = harness();
        drop(h.updates);
        tokio::time::timeout(Duration::from_secs(1), h.task).await.expect("still running").unwrap();
    }
}
