//! The BGP speaker's series, written out at each scrape from the snapshot
//! the owner task took ([`BgpStatus`], what `lb status` shows): each
//! session's state, its BFD session's, and the VIPs announced.

use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, gauge::ConstGauge},
};

use crate::control::BgpStatus;

/// The last snapshot of the speaker; `None`: the config has no `[bgp]`.
#[derive(Clone, Debug, Default)]
pub struct BgpSeries(Arc<Mutex<Option<BgpStatus>>>);

impl BgpSeries {
    /// Replaces the snapshot the next scrape writes out.
    pub fn set(&self, status: Option<BgpStatus>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = status;
    }
}

impl Collector for BgpSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let status = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(status) = status.as_ref() else { return Ok(()) };
        let mut sessions = encoder.encode_descriptor(
            "lb_bgp_session_established",
            "1 if the BGP session with the peer is established (BFD, when on, \
             takes it down within 300 ms of the peer going silent), 0 if not",
            None,
            MetricType::Gauge,
        )?;
        for session in &status.sessions {
            let labels = [("session", session.name.as_str()), ("peer", session.peer.as_str())];
            ConstGauge::new(i64::from(session.info == "Established"))
                .encode(sessions.encode_family(&labels)?)?;
        }
        let mut bfd = encoder.encode_descriptor(
            "lb_bgp_bfd_up",
            "1 if the BFD session with the peer is up, 0 if not (sessions BFD watches)",
            None,
            MetricType::Gauge,
        )?;
        for session in status.sessions.iter().filter(|s| s.bfd.is_some()) {
            let labels = [("session", session.name.as_str()), ("peer", session.peer.as_str())];
            ConstGauge::new(i64::from(session.bfd.as_deref() == Some("Up")))
                .encode(bfd.encode_family(&labels)?)?;
        }
        let mut routes = encoder.encode_descriptor(
            "lb_bgp_announced",
            "1 for each VIP whose host route this node gives its BGP peers",
            None,
            MetricType::Gauge,
        )?;
        let vips: Vec<String> = status.announced.iter().map(ToString::to_string).collect();
        for vip in &vips {
            ConstGauge::new(1).encode(routes.encode_family(&[("vip", vip.as_str())])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::{
        control::{BgpSession, BgpStatus},
        metrics::Metrics,
    };

    #[test]
    fn sessions_and_routes_are_written_out_when_there_is_a_speaker() {
        let metrics = Metrics::new();
        assert!(!metrics.encode().contains("lb_bgp"), "no series without [bgp]");
        let session = |name: &str, peer: &str, info: &str, bfd: &str| BgpSession {
            name: name.into(),
            peer: peer.into(),
            state: "up".into(),
            info: info.into(),
            bfd: Some(bfd.into()),
        };
        metrics.bgp.set(Some(BgpStatus {
            sessions: vec![
                session("lb_peer0", "198.18.0.254", "Established", "Up"),
                session("lb_peer1", "2001:2::fe", "Idle Error: BFD session down", "Down"),
            ],
            announced: vec!["198.18.1.100".parse().unwrap()],
        }));
        let text = metrics.encode();
        for line in [
            r#"lb_bgp_session_established{session="lb_peer0",peer="198.18.0.254"} 1"#,
            r#"lb_bgp_session_established{session="lb_peer1",peer="2001:2::fe"} 0"#,
            r#"lb_bgp_bfd_up{session="lb_peer0",peer="198.18.0.254"} 1"#,
            r#"lb_bgp_bfd_up{session="lb_peer1",peer="2001:2::fe"} 0"#,
            r#"lb_bgp_announced{vip="198.18.1.100"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
    }
}
