//! The elections' series, written out at each scrape from the snapshot
//! the owner task took (what `lb status` shows of each leased service):
//! this node's role and the last takeover it made.

use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, gauge::ConstGauge},
};

use crate::control::LeaseStatus;

/// The roles a node has in an election, as `lb status` names them.
const ROLES: [&str; 4] = ["holder", "candidate", "not eligible", "starting"];

/// The last snapshot: each leased service's name and election.
#[derive(Clone, Debug, Default)]
pub struct LeaseSeries(pub(super) Arc<Mutex<Vec<(String, LeaseStatus)>>>);

impl LeaseSeries {
    /// Replaces the snapshot the next scrape writes out.
    pub fn set(&self, leases: Vec<(String, LeaseStatus)>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = leases;
    }
}

impl Collector for LeaseSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let leases = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if leases.is_empty() {
            return Ok(());
        }
        let mut family = encoder.encode_descriptor(
            "lb_lease_role",
            "1 for this node's role in the election of the service's VIP (holder: it announces the VIP)",
            None,
            MetricType::Gauge,
        )?;
        for (service, lease) in leases.iter() {
            for role in ROLES {
                let labels = [
                    ("service", service.as_str()),
                    ("lease", lease.lease.as_str()),
                    ("role", role),
                ];
                ConstGauge::new(i64::from(lease.role == role))
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "lb_lease_last_takeover_milliseconds",
            "How long this node's last takeover of the lease took, from the previous holder's last renewal seen",
            None,
            MetricType::Gauge,
        )?;
        for (service, lease) in leases.iter() {
            let Some(takeover) = &lease.last_takeover else { continue };
            let labels = [("service", service.as_str()), ("lease", lease.lease.as_str())];
            ConstGauge::new(i64::try_from(takeover.took_ms).unwrap_or(i64::MAX))
                .encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{control::TakeoverStatus, metrics::Metrics};

    #[test]
    fn each_election_is_written_out_with_its_role() {
        let metrics = Metrics::new();
        assert!(!metrics.encode().contains("lb_lease"), "no series without a lease");
        let lease = LeaseStatus {
            lease: "kube-system/web".into(),
            node: "node-a".into(),
            role: "holder".into(),
            last_takeover: Some(TakeoverStatus { ms_ago: 5, took_ms: 1210, from: None }),
            ..LeaseStatus::default()
        };
        metrics.leases.set(vec![("web".into(), lease)]);
        let text = metrics.encode();
        for line in [
            r#"lb_lease_role{service="web",lease="kube-system/web",role="holder"} 1"#,
            r#"lb_lease_role{service="web",lease="kube-system/web",role="candidate"} 0"#,
            r#"lb_lease_last_takeover_milliseconds{service="web",lease="kube-system/web"} 1210"#,
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }
}
