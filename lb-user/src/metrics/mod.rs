//! Prometheus metrics (`[daemon] metrics = "127.0.0.1:9464"`, off when
//! absent). The owner task updates them as things happen; a scrape asks the
//! owner task for a fresh snapshot, which also reads the kernel's live
//! connection counts and decision counters.
//!
//! The per-server series are kept as plain numbers and written out at
//! each scrape (`server_series.rs`). A server that leaves its service
//! keeps its counters for [`KEEP_DEPARTED`].
//!
//! The endpoint (`serve`) is bounded ([`Limits`]): a local process that
//! opens thousands of idle connections to it cannot take the daemon's file
//! descriptors or time; extra connections are closed at once, idle ones
//! after a short timeout.

mod bgp_series;
mod external_series;
mod lease;
mod serve;
mod server_series;

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Instant,
};

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use self::server_series::{CLOSE_REASONS, ServerCollector, ServerSeries, Servers};
pub use self::{
    bgp_series::BgpSeries,
    external_series::ExternalSeries,
    lease::LeaseSeries,
    serve::{Limits, ScrapeRequest, serve},
    server_series::KEEP_DEPARTED,
};
use crate::balancer::{CloseReason, State};

/// Labels of a per-server series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServerLabels {
    /// The service's name.
    pub service: String,
    /// The server's address.
    pub server: String,
}

/// Labels of `lb_discovery_dropped_endpoints`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DroppedLabels {
    /// The service's name.
    pub service: String,
    /// Why: `unspecified`, `loopback`, `link_local`, `multicast`,
    /// `broadcast` or `vip`.
    pub reason: String,
}

/// Labels of a per-service series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    /// The service's name.
    pub service: String,
}

/// Labels of `lb_tracked_sockets`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProtocolLabels {
    /// `tcp` or `udp`.
    pub protocol: &'static str,
}

/// Labels of `lb_datapath_decisions`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// The kernel's reason (`lb_common::Reason`'s name).
    pub reason: String,
}

/// Labels of `lb_config_reloads`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `success` or `failure`.
    pub result: String,
}

/// Labels of `lb_discovery_updates`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DiscoveryLabels {
    /// The service's name.
    pub service: String,
    /// `kubernetes` or `dns`.
    pub source: String,
    /// `applied`, `empty` (kept the last list) or `error`.
    pub result: String,
}

type HistogramFamily = Family<ServerLabels, Histogram, fn() -> Histogram>;

/// The daemon's Prometheus metrics: the families below, and the per-server
/// series (state, health, connections, closes) kept apart and encoded by a
/// collector.
pub struct Metrics {
    registry: Registry,
    servers: Arc<Mutex<Servers>>,
    /// `lb_selection_changes`: selections written to the kernel.
    pub selection_changes: Family<ServiceLabels, Counter>,
    /// `lb_health_check_duration_seconds`.
    pub health_check_duration: HistogramFamily,
    /// `lb_kernel_event_delay_seconds`: from a kernel report to the
    /// daemon's decision on it (the owner loop's delay).
    pub kernel_event_delay: Histogram,
    /// `lb_datapath_decisions`: the kernel's counters, by reason.
    pub datapath_decisions: Family<ReasonLabels, Counter>,
    /// `lb_config_reloads`, by result.
    pub config_reloads: Family<ResultLabels, Counter>,
    /// `lb_discovery_updates`: lists from discovery sources, by result.
    pub discovery_updates: Family<DiscoveryLabels, Counter>,
    /// `lb_discovery_last_success_timestamp_seconds`.
    pub discovery_last_success: Family<ServiceLabels, Gauge>,
    /// `lb_discovery_truncated_endpoints`: endpoints beyond the 16 a
    /// service holds.
    pub discovery_truncated: Family<ServiceLabels, Gauge>,
    /// `lb_discovery_dropped_endpoints`: discovered addresses that can
    /// never be a server (and a VIP's own), left out, by reason.
    pub discovery_dropped: Family<DroppedLabels, Counter>,
    /// `lb_tracked_sockets`: sockets in the kernel's socket tables.
    pub tracked_sockets: Family<ProtocolLabels, Gauge>,
    /// `lb_tracked_sockets_capacity`: how many each table holds.
    pub tracked_sockets_capacity: Family<ProtocolLabels, Gauge>,
    /// The external path's series (`lb_external_*`), from the snapshot
    /// each scrape takes.
    pub external: ExternalSeries,
    /// The elections' series (`lb_lease_*`), from the snapshot each
    /// scrape takes.
    pub leases: LeaseSeries,
    /// The BGP speaker's series (`lb_bgp_*`), from the snapshot each
    /// scrape takes.
    pub bgp: BgpSeries,
    /// Kernel counters as last read, to turn them into counter increments.
    last_decisions: HashMap<&'static str, u64>,
}

fn health_histogram() -> Histogram {
    // 1 ms .. ~16 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// The labels of `server` of `service`.
pub fn server_labels(service: &str, server: SocketAddr) -> ServerLabels {
    ServerLabels { service: service.to_owned(), server: server.to_string() }
}

impl Metrics {
    /// Every family registered, no series yet.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let servers = Arc::new(Mutex::new(Servers::new()));
        registry.register_collector(Box::new(ServerCollector(Arc::clone(&servers))));
        let external = ExternalSeries::default();
        registry.register_collector(Box::new(external.clone()));
        let leases = LeaseSeries::default();
        registry.register_collector(Box::new(leases.clone()));
        let bgp = BgpSeries::default();
        registry.register_collector(Box::new(bgp.clone()));
        let selection_changes = Family::default();
        registry.register(
            "lb_selection_changes",
            "Selections written to the kernel",
            selection_changes.clone(),
        );
        let health_check_duration: HistogramFamily = Family::new_with_constructor(health_histogram);
        registry.register(
            "lb_health_check_duration_seconds",
            "How long health checks took",
            health_check_duration.clone(),
        );
        // 50 µs .. ~0.56 s, each bucket 1.5 times the one below.
        let kernel_event_delay = Histogram::new(exponential_buckets(0.000_05, 1.5, 24));
        registry.register(
            "lb_kernel_event_delay_seconds",
            "From a kernel report on a connect through a VIP to the daemon's decision on it",
            kernel_event_delay.clone(),
        );
        let datapath_decisions = Family::default();
        registry.register(
            "lb_datapath_decisions",
            "Decisions of the kernel programs, by reason",
            datapath_decisions.clone(),
        );
        let config_reloads = Family::default();
        registry.register("lb_config_reloads", "Config reloads, by result", config_reloads.clone());
        let discovery_updates = Family::default();
        registry.register(
            "lb_discovery_updates",
            "Lists from discovery sources, by result",
            discovery_updates.clone(),
        );
        let discovery_last_success = Family::default();
        registry.register(
            "lb_discovery_last_success_timestamp_seconds",
            "When a discovery source last synced (Unix time)",
            discovery_last_success.clone(),
        );
        let discovery_truncated = Family::default();
        registry.register(
            "lb_discovery_truncated_endpoints",
            "Endpoints a discovery source listed beyond the 16 a service holds (left out)",
            discovery_truncated.clone(),
        );
        let discovery_dropped = Family::default();
        registry.register(
            "lb_discovery_dropped_endpoints",
            "Discovered addresses left out because they can never be a server, by reason",
            discovery_dropped.clone(),
        );
        let tracked_sockets = Family::default();
        registry.register(
            "lb_tracked_sockets",
            "Sockets connected through VIPs that the kernel tracks, by protocol",
            tracked_sockets.clone(),
        );
        let tracked_sockets_capacity = Family::default();
        registry.register(
            "lb_tracked_sockets_capacity",
            "How many sockets each kernel socket table holds; a full TCP table leaves connects untracked",
            tracked_sockets_capacity.clone(),
        );
        Self {
            registry,
            tracked_sockets,
            tracked_sockets_capacity,
            servers,
            selection_changes,
            health_check_duration,
            kernel_event_delay,
            datapath_decisions,
            config_reloads,
            discovery_updates,
            discovery_last_success,
            discovery_truncated,
            discovery_dropped,
            external,
            leases,
            bgp,
            last_decisions: HashMap::new(),
        }
    }

    /// Runs `update` on the record of `server` of `service`, if it has one
    /// (a server that left has none: nothing recreates its series).
    fn update(&self, service: &str, server: SocketAddr, update: impl FnOnce(&mut ServerSeries)) {
        let mut servers = self.servers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let found = servers.get_mut(service).and_then(|s| s.iter_mut().find(|(a, _)| *a == server));
        if let Some((_, series)) = found {
            update(series);
        }
    }

    /// A server joined its service, in `state`: its series exist from now
    /// on, the counters at zero, so that `rate()` and alerts see the first
    /// failure (as Prometheus advises for labels known in advance). A
    /// server that left less than [`KEEP_DEPARTED`] ago keeps its counters.
    pub fn server_appeared(&self, service: &str, server: SocketAddr, state: State) {
        let mut servers = self.servers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let of_service = servers.entry(service.to_owned()).or_default();
        if let Some((_, series)) = of_service.iter_mut().find(|(a, _)| *a == server) {
            series.departed = None;
            series.state = state;
        } else {
            // One at a time: most services have one or a few servers.
            of_service.reserve_exact(1);
            of_service.push((
                server,
                ServerSeries {
                    departed: None,
                    state,
                    healthy: None,
                    connections: 0,
                    connect_failures: 0,
                    closed: [0; CLOSE_REASONS.len()],
                },
            ));
        }
    }

    /// The server's state in the balancer.
    pub fn set_state(&self, service: &str, server: SocketAddr, state: State) {
        self.update(service, server, |series| series.state = state);
    }

    /// The last health check's outcome (`None`: no check result).
    pub fn set_healthy(&self, service: &str, server: SocketAddr, healthy: Option<bool>) {
        self.update(service, server, |series| series.healthy = healthy);
    }

    /// Live connections to `server`, as the kernel counts them.
    pub fn set_connections(&self, service: &str, server: SocketAddr, connections: i64) {
        self.update(service, server, |series| series.connections = connections);
    }

    /// A connect through the VIP to `server` failed before establishing.
    pub fn count_connect_failure(&self, service: &str, server: SocketAddr) {
        self.update(service, server, |series| series.connect_failures += 1);
    }

    /// The daemon closed `n` VIP connections to `server`, for `reason`.
    pub fn count_closed(&self, service: &str, server: SocketAddr, reason: CloseReason, n: u64) {
        let i = reason as usize;
        self.update(service, server, |series| series.closed[i] += n);
    }

    /// A server left its service at `now`: its gauges and histogram go at
    /// once, its counters after [`KEEP_DEPARTED`] ([`Self::expire`]).
    pub fn server_left(&self, service: &str, server: SocketAddr, now: Instant) {
        self.health_check_duration.remove(&server_labels(service, server));
        self.update(service, server, |series| {
            series.departed.get_or_insert(now);
            series.healthy = None;
            series.connections = 0;
        });
    }

    /// Drops the series of servers that left more than [`KEEP_DEPARTED`]
    /// before `now`.
    pub fn expire(&self, now: Instant) {
        let mut servers = self.servers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        servers.retain(|_, of_service| {
            of_service.retain(|(_, series)| {
                series.departed.is_none_or(|at| now.saturating_duration_since(at) < KEEP_DEPARTED)
            });
            !of_service.is_empty()
        });
    }

    /// Sets `lb_tracked_sockets` and its capacity for `protocol`.
    pub fn set_tracked_sockets(&self, protocol: &'static str, tracked: usize, capacity: usize) {
        let labels = ProtocolLabels { protocol };
        self.tracked_sockets.get_or_create(&labels).set(tracked as i64);
        self.tracked_sockets_capacity.get_or_create(&labels).set(capacity as i64);
    }

    /// Adds what the kernel counted since the last read.
    pub fn record_decisions(&mut self, counters: &[(&'static str, u64)]) {
        for (reason, total) in counters {
            let last = self.last_decisions.insert(reason, *total).unwrap_or(0);
            let counter = self
                .datapath_decisions
                .get_or_create(&ReasonLabels { reason: (*reason).to_owned() });
            counter.inc_by(total.saturating_sub(last));
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_the_named_series() {
        let mut metrics = Metrics::new();
        let server: SocketAddr = "127.0.0.1:6443".parse().unwrap();
        metrics.server_appeared("api", server, State::Unchecked);
        metrics.set_state("api", server, State::Active);
        metrics.set_healthy("api", server, Some(true));
        metrics.set_connections("api", server, 3);
        metrics.count_connect_failure("api", server);
        metrics.count_closed("api", server, CloseReason::Manual, 2);
        metrics.record_decisions(&[("connect_rewritten", 5)]);
        metrics.record_decisions(&[("connect_rewritten", 7)]);
        let text = metrics.encode();
        for line in [
            r#"lb_server_state{service="api",server="127.0.0.1:6443",state="active"} 1"#,
            r#"lb_server_state{service="api",server="127.0.0.1:6443",state="failed"} 0"#,
            r#"lb_server_healthy{service="api",server="127.0.0.1:6443"} 1"#,
            r#"lb_server_connections{service="api",server="127.0.0.1:6443"} 3"#,
            r#"lb_connect_failures_total{service="api",server="127.0.0.1:6443"} 1"#,
            r#"lb_connections_closed_total{service="api",server="127.0.0.1:6443",reason="manual"} 2"#,
            r#"lb_datapath_decisions_total{reason="connect_rewritten"} 7"#,
            "# TYPE lb_server_state gauge",
            "# TYPE lb_connect_failures counter",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
        // A server that left: its gauges go at once; its counters stay a
        // while and still count (the connections closed because it left).
        let left = Instant::now();
        metrics.server_left("api", server, left);
        metrics.count_closed("api", server, CloseReason::Removed, 4);
        let text = metrics.encode();
        assert!(
            !text.contains(r#"lb_server_state{service="api",server="127.0.0.1:6443""#),
            "{text}"
        );
        assert!(!text.contains(r#"lb_server_connections{service="api""#), "{text}");
        for line in [
            r#"lb_connect_failures_total{service="api",server="127.0.0.1:6443"} 1"#,
            r#"lb_connections_closed_total{service="api",server="127.0.0.1:6443",reason="removed"} 4"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
        metrics.expire(left + KEEP_DEPARTED / 2);
        assert!(metrics.encode().contains("127.0.0.1:6443"));
        metrics.expire(left + KEEP_DEPARTED);
        assert!(!metrics.encode().contains("127.0.0.1:6443"));
        // Gone for good: a late report does not bring it back.
        metrics.count_connect_failure("api", server);
        metrics.set_state("api", server, State::Failed);
        assert!(!metrics.encode().contains("127.0.0.1:6443"));
    }

    #[test]
    fn a_server_back_within_the_grace_period_keeps_its_counters() {
        let metrics = Metrics::new();
        let server: SocketAddr = "127.0.0.1:6443".parse().unwrap();
        metrics.server_appeared("api", server, State::Unchecked);
        metrics.count_connect_failure("api", server);
        metrics.server_left("api", server, Instant::now());
        metrics.server_appeared("api", server, State::Healthy);
        metrics.count_connect_failure("api", server);
        let text = metrics.encode();
        for line in [
            r#"lb_connect_failures_total{service="api",server="127.0.0.1:6443"} 2"#,
            r#"lb_server_state{service="api",server="127.0.0.1:6443",state="healthy"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
        metrics.expire(Instant::now() + KEEP_DEPARTED);
        assert!(metrics.encode().contains("127.0.0.1:6443"), "a present server never expires");
    }

    #[test]
    fn a_new_servers_counters_start_at_zero() {
        let metrics = Metrics::new();
        let server: SocketAddr = "127.0.0.1:6443".parse().unwrap();
        metrics.server_appeared("api", server, State::Unchecked);
        let text = metrics.encode();
        for line in [
            r#"lb_connect_failures_total{service="api",server="127.0.0.1:6443"} 0"#,
            r#"lb_connections_closed_total{service="api",server="127.0.0.1:6443",reason="failed"} 0"#,
            r#"lb_connections_closed_total{service="api",server="127.0.0.1:6443",reason="manual"} 0"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
        let left = Instant::now();
        metrics.server_left("api", server, left);
        metrics.expire(left + KEEP_DEPARTED);
        assert!(!metrics.encode().contains("127.0.0.1:6443"));
    }
}
