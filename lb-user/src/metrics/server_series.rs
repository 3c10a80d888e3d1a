//! The per-server series (state, health, connections, failures,
//! closings: 14 a server), kept as plain numbers, one small record per
//! server ([`ServerSeries`]), and written out at each scrape by
//! [`ServerCollector`]. As labelled series in `prometheus-client`
//! families they took about 3 KB a server, 30 MB with 10,000 services.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

use crate::balancer::{CloseReason, State};

/// Reasons the daemon closes connections, as `lb_connections_closed_total`
/// labels them (indexed by `CloseReason as usize`); every server has each
/// series from the start, at zero.
pub(super) const CLOSE_REASONS: [CloseReason; 4] = CloseReason::ALL;

const STATES: [State; 7] = [
    State::Active,
    State::Preferred,
    State::Healthy,
    State::Recovering,
    State::Unchecked,
    State::Standby,
    State::Failed,
];

/// How long the counters of a server that left its service are still
/// served: a few scrape intervals, so that the connections closed because
/// it was removed (counted after it left) are seen, and a server that comes
/// back within it keeps counting from where it was (counters do not reset
/// when a list flaps).
pub const KEEP_DEPARTED: Duration = Duration::from_secs(300);

/// What the metrics say about one server of one service.
#[derive(Debug)]
pub(super) struct ServerSeries {
    /// When the server left its service: from then on only its counters
    /// are served, until [`KEEP_DEPARTED`] has passed.
    pub(super) departed: Option<Instant>,
    pub(super) state: State,
    /// The last health check's outcome; `None` before the first, or
    /// without checks (no `lb_server_healthy` series then).
    pub(super) healthy: Option<bool>,
    /// Live connections, as the kernel counted them at the last scrape.
    pub(super) connections: i64,
    pub(super) connect_failures: u64,
    /// Per [`CLOSE_REASONS`] entry.
    pub(super) closed: [u64; CLOSE_REASONS.len()],
}

/// Every server's series, by service name (sorted, so that scrapes list
/// them in a stable order), then in the order the servers appeared (a
/// service has at most 16: a short list beats a map's nodes).
pub(super) type Servers = BTreeMap<String, Vec<(SocketAddr, ServerSeries)>>;

/// Writes the per-server series at each scrape; shares the records with
/// [`Metrics`].
#[derive(Debug)]
pub(super) struct ServerCollector(pub(super) Arc<Mutex<Servers>>);

impl Collector for ServerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let servers = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // The server label of each series, formatted once per scrape.
        let rows: Vec<(&str, String, &ServerSeries)> = servers
            .iter()
            .flat_map(|(service, servers)| {
                servers.iter().map(|(addr, series)| (service.as_str(), addr.to_string(), series))
            })
            .collect();
        let mut family = encoder.encode_descriptor(
            "lb_server_connections",
            "Live connections through the VIP to the server",
            None,
            MetricType::Gauge,
        )?;
        // The gauges describe servers in their service now.
        let present: Vec<_> = rows.iter().filter(|(_, _, s)| s.departed.is_none()).collect();
        for (service, server, series) in &present {
            let labels = [("service", *service), ("server", server.as_str())];
            ConstGauge::new(series.connections).encode(family.encode_family(&labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "lb_server_state",
            "1 for the server's current state, 0 for the others",
            None,
            MetricType::Gauge,
        )?;
        for (service, server, series) in &present {
            for state in STATES {
                let labels =
                    [("service", *service), ("server", server.as_str()), ("state", state.name())];
                ConstGauge::new(i64::from(series.state == state))
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "lb_server_healthy",
            "1 if the server's last health check passed, 0 if it failed",
            None,
            MetricType::Gauge,
        )?;
        for (service, server, series) in &present {
            if let Some(healthy) = series.healthy {
                let labels = [("service", *service), ("server", server.as_str())];
                ConstGauge::new(i64::from(healthy)).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "lb_connect_failures",
            "Connects through the VIP that failed before establishing",
            None,
            MetricType::Counter,
        )?;
        for (service, server, series) in &rows {
            let labels = [("service", *service), ("server", server.as_str())];
            ConstCounter::new(series.connect_failures).encode(family.encode_family(&labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "lb_connections_closed",
            "VIP connections the daemon closed, by reason",
            None,
            MetricType::Counter,
        )?;
        for (service, server, series) in &rows {
            for (reason, count) in CLOSE_REASONS.iter().zip(series.closed) {
                let labels =
                    [("service", *service), ("server", server.as_str()), ("reason", reason.name())];
                ConstCounter::new(count).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}
