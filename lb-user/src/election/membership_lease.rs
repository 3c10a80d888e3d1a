//! A membership Lease as the API holds it (`coordination.k8s.io/v1`): one
//! per node, named after it, in lb's namespace, labelled so that one
//! watch sees them all. What the node can serve and what it claims are
//! two annotations, each a comma-separated list of VIP addresses (sorted;
//! a VIP is placed by its address, which is what a node announces):
//!
//! ```yaml
//! metadata:
//!   name: node-a
//!   labels: { lb.dev/membership: node }
//!   annotations:
//!     lb.dev/eligible: 198.18.1.100,198.18.1.101
//!     lb.dev/claims: 198.18.1.100
//! spec:
//!   holderIdentity: node-a_3f9c0e4b1d2a7788
//!   leaseDurationSeconds: 2
//!   renewTime: "2026-12-07T00:00:00.000000Z"
//! ```
//!
//! Any client with write access to the namespace can write these, so a
//! Lease is read as untrusted input: an entry that is not an address is
//! left out, and a list longer than [`MAX_VIPS`] is cut there.

use std::{collections::BTreeSet, net::IpAddr, time::Duration};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};

use super::membership::{self, Content};

/// The label every membership Lease carries, and its value: the watch's
/// selector.
pub(crate) const LABEL: (&str, &str) = ("lb.dev/membership", "node");
/// The annotation listing the VIPs a node can serve.
pub(crate) const ELIGIBLE: &str = "lb.dev/eligible";
/// The annotation listing the VIPs a node claims.
pub(crate) const CLAIMS: &str = "lb.dev/claims";
/// The most VIPs one annotation is read for (the API caps all of an
/// object's annotations at 256 KiB; an IPv6 address takes up to 40 bytes).
pub(crate) const MAX_VIPS: usize = 4_096;

/// The Lease node `node` (holder `identity`) writes to say `content`.
pub(crate) fn lease(
    namespace: &str,
    node: &str,
    identity: &str,
    content: &Content,
    duration: Duration,
) -> Lease {
    let annotations = [(ELIGIBLE, &content.eligible), (CLAIMS, &content.claims)]
        .into_iter()
        .map(|(key, vips)| (key.to_owned(), vips.iter().cloned().collect::<Vec<_>>().join(",")))
        .collect();
    Lease {
        metadata: ObjectMeta {
            name: Some(node.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some([(LABEL.0.to_owned(), LABEL.1.to_owned())].into_iter().collect()),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(identity.to_owned()),
            lease_duration_seconds: Some(
                i32::try_from(duration.as_secs()).unwrap_or(i32::MAX).max(1),
            ),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..LeaseSpec::default()
        }),
    }
}

/// What a Lease says, as the machine reads it; `None` for one with no
/// name or resourceVersion (the API never sends such).
pub(crate) fn read(lease: &Lease) -> Option<membership::Lease> {
    let node = lease.metadata.name.clone()?;
    let version = lease.metadata.resource_version.clone()?;
    let identity = lease.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap_or_default();
    let annotation = |key: &str| {
        let annotations = lease.metadata.annotations.as_ref();
        vips(annotations.and_then(|a| a.get(key)).map_or("", String::as_str))
    };
    let content = Content { eligible: annotation(ELIGIBLE), claims: annotation(CLAIMS) };
    Some(membership::Lease { node, identity, version, content })
}

/// The addresses of a comma-separated list, in their canonical spelling:
/// anything else is left out.
fn vips(list: &str) -> BTreeSet<String> {
    list.split(',')
        .filter_map(|entry| entry.trim().parse::<IpAddr>().ok())
        .take(MAX_VIPS)
        .map(|ip| ip.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content(eligible: &[&str], claims: &[&str]) -> Content {
        let set = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect();
        Content { eligible: set(eligible), claims: set(claims) }
    }

    #[test]
    fn what_a_node_writes_reads_back_the_same() {
        let written = content(&["198.18.1.100", "2001:db8::1"], &["198.18.1.100"]);
        let mut lease = lease("lb-system", "node-a", "node-a_t", &written, Duration::from_secs(2));
        assert_eq!(lease.metadata.labels.as_ref().unwrap()[LABEL.0], LABEL.1);
        assert_eq!(
            lease.metadata.annotations.as_ref().unwrap()[ELIGIBLE],
            "198.18.1.100,2001:db8::1"
        );
        assert_eq!(lease.spec.as_ref().unwrap().lease_duration_seconds, Some(2));
        lease.metadata.resource_version = Some("42".into());
        let read = read(&lease).unwrap();
        assert_eq!(read.node, "node-a");
        assert_eq!(read.identity, "node-a_t");
        assert_eq!(read.version, "42");
        assert_eq!(read.content, written);
    }

    #[test]
    fn a_lease_written_by_anyone_else_is_read_for_what_is_an_address_only() {
        let mut lease = Lease::default();
        assert_eq!(read(&lease), None, "no name");
        lease.metadata.name = Some("node-b".into());
        lease.metadata.resource_version = Some("7".into());
        let read_back = read(&lease).unwrap();
        assert_eq!((read_back.identity.as_str(), read_back.content), ("", Content::default()));
        lease.metadata.annotations = Some(
            [
                (ELIGIBLE.to_owned(), " 198.18.1.1 ,,junk,198.018.1.2,::ffff:1.2.3.4,".to_owned()),
                (CLAIMS.to_owned(), "2001:DB8:0::1".to_owned()),
            ]
            .into_iter()
            .collect(),
        );
        let read_back = read(&lease).unwrap();
        assert_eq!(read_back.content, content(&["198.18.1.1", "::ffff:1.2.3.4"], &["2001:db8::1"]));
    }

    #[test]
    fn a_list_past_the_limit_is_cut() {
        let long: Vec<String> =
            (0..MAX_VIPS + 10).map(|i| format!("10.{}.{}.1", i / 256, i % 256)).collect();
        assert_eq!(vips(&long.join(",")).len(), MAX_VIPS);
    }
}
