//! The external path's series, written out at each scrape from the
//! snapshot the owner task took ([`ExternalStatus`], what `lb status`
//! shows): interfaces and their XDP mode, the flow and NAT tables' fill,
//! and what was forwarded to each server.

use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

use crate::control::ExternalStatus;

/// The last snapshot of the external path; `None`: no service has one.
#[derive(Clone, Debug, Default)]
pub struct ExternalSeries(pub(super) Arc<Mutex<Option<ExternalStatus>>>);

impl ExternalSeries {
    /// Replaces the snapshot the next scrape writes out.
    pub fn set(&self, status: Option<ExternalStatus>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = status;
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: usize,
) -> Result<(), std::fmt::Error> {
    let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(family)
}

impl Collector for ExternalSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let status = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(status) = status.as_ref() else { return Ok(()) };
        let mut family = encoder.encode_descriptor(
            "lb_external_interface_attached",
            "1 if the XDP program runs on the interface (in this mode), 0 if it should and cannot",
            None,
            MetricType::Gauge,
        )?;
        for interface in &status.interfaces {
            let mode = interface.mode.as_deref().unwrap_or("none");
            let labels = [("interface", interface.name.as_str()), ("mode", mode)];
            ConstGauge::new(i64::from(interface.mode.is_some()))
                .encode(family.encode_family(&labels)?)?;
        }
        gauge(
            &mut encoder,
            "lb_external_flows",
            "Flows in the external path's flow table",
            status.flows,
        )?;
        gauge(
            &mut encoder,
            "lb_external_established_flows",
            "Of those, established TCP flows (new flows never evict them)",
            status.established_flows,
        )?;
        gauge(
            &mut encoder,
            "lb_external_flows_capacity",
            "How many flows each flow table holds (LRU: the oldest go)",
            status.flow_capacity,
        )?;
        gauge(&mut encoder, "lb_external_nat_ports", "NAT ports held by flows", status.nat_ports)?;
        gauge(
            &mut encoder,
            "lb_external_ip_forwarding",
            "1 if the kernel forwards the external VIPs' families",
            usize::from(status.forwarding),
        )?;
        let mut packets = encoder.encode_descriptor(
            "lb_external_forwarded_packets",
            "Packets the external path forwarded to the server",
            None,
            MetricType::Counter,
        )?;
        let servers: Vec<String> = status.traffic.iter().map(|t| t.server.to_string()).collect();
        for (t, server) in status.traffic.iter().zip(&servers) {
            ConstCounter::new(t.packets)
                .encode(packets.encode_family(&[("server", server.as_str())])?)?;
        }
        let mut bytes = encoder.encode_descriptor(
            "lb_external_forwarded_bytes",
            "Bytes (IP header and payload) the external path forwarded to the server",
            None,
            MetricType::Counter,
        )?;
        for (t, server) in status.traffic.iter().zip(&servers) {
            ConstCounter::new(t.bytes)
                .encode(bytes.encode_family(&[("server", server.as_str())])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn the_external_path_is_written_out_when_there_is_one() {
        let metrics = Metrics::new();
        assert!(!metrics.encode().contains("lb_external"), "no series without an external path");
        metrics.external.set(Some(ExternalStatus::sample(true)));
        let text = metrics.encode();
        for line in [
            r#"lb_external_interface_attached{interface="eth1",mode="native"} 1"#,
            r#"lb_external_interface_attached{interface="eth9",mode="none"} 0"#,
            "lb_external_flows 3",
            "lb_external_established_flows 2",
            "lb_external_nat_ports 3",
            "lb_external_ip_forwarding 1",
            r#"lb_external_forwarded_packets_total{server="198.18.2.2:8080"} 10"#,
            r#"lb_external_forwarded_bytes_total{server="198.18.2.2:8080"} 600"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
    }
}
