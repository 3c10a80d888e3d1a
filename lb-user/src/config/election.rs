//! The settings of the elections: this node's name and the leases'
//! timings (`[daemon]`), each service's lease (`[service.external] lease =
//! { namespace, name }`), and the membership's (`[kubernetes]`).

use std::time::Duration;

use super::{
    model::{Announce, Election, LeaseRef, Membership},
    problems::{Key, Problem},
    raw::{RawDaemon, RawKubernetesSettings, RawLease},
    values::parse_duration,
};

/// `[daemon] node_name`, else `$LB_NODE_NAME` (the DaemonSet sets it from
/// `spec.nodeName`), else the hostname.
pub(super) fn parse_node_name(raw: Option<String>, problems: &mut Vec<Problem>) -> String {
    let from_env = || std::env::var("LB_NODE_NAME").ok().filter(|n| !n.trim().is_empty());
    let Some(name) = raw.or_else(from_env) else { return hostname() };
    if name.is_empty()
        || name.len() > 253
        || name.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        problems.push(Problem::new(
            None,
            "daemon.node_name",
            format!("{name:?} is not a node name (1 to 253 characters, no spaces)"),
        ));
    }
    name
}

/// The kernel's hostname: the node's name when the config gives none.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// A top-level duration setting `key`, or `default` when absent or bad
/// (then a problem says why).
fn duration_or(
    text: &Option<String>,
    key: &'static str,
    default: Duration,
    problems: &mut Vec<Problem>,
) -> Duration {
    text.as_deref()
        .and_then(|t| parse_duration(t, None, Key::top(key), problems))
        .unwrap_or(default)
}

/// `[daemon] lease_duration`, `lease_renew`, `lease_retry`.
pub(super) fn parse_election(raw: &RawDaemon, problems: &mut Vec<Problem>) -> Election {
    let defaults = Election::default();
    let mut read = |text: &Option<String>, key, default| duration_or(text, key, default, problems);
    let election = Election {
        duration: read(&raw.lease_duration, "daemon.lease_duration", defaults.duration),
        renew: read(&raw.lease_renew, "daemon.lease_renew", defaults.renew),
        retry: read(&raw.lease_retry, "daemon.lease_retry", defaults.retry),
    };
    if election.duration.subsec_nanos() != 0 || election.duration.as_secs() > 3600 {
        problems.push(Problem::new(
            None,
            "daemon.lease_duration",
            format!(
                "{:?} is not a whole number of seconds from 1 to 3600 (a Lease counts whole seconds)",
                election.duration
            ),
        ));
    }
    if election.renew * 2 > election.duration {
        problems.push(Problem::new(
            None,
            "daemon.lease_renew",
            format!(
                "{:?} is more than half of lease_duration ({:?}): the holder must be able to renew \
                 twice before it stops answering (a quarter of the duration before the lease runs out)",
                election.renew, election.duration
            ),
        ));
    }
    if election.retry > election.duration {
        problems.push(Problem::new(
            None,
            "daemon.lease_retry",
            format!(
                "{:?} is more than lease_duration ({:?}): a takeover would wait for it",
                election.retry, election.duration
            ),
        ));
    }
    election
}

/// `[kubernetes] namespace`, `membership_duration`, `membership_renew`:
/// the elections by membership. `retry` is `[daemon] lease_retry`, which
/// they share with the leases.
pub(super) fn parse_membership(
    raw: Option<RawKubernetesSettings>,
    retry: Duration,
    problems: &mut Vec<Problem>,
) -> Membership {
    // Without the `kubernetes` feature nothing is elected by default: an
    // explicit `elect` is refused, with the reason, by the service.
    let by_default = raw.is_some() && cfg!(feature = "kubernetes");
    let raw = raw.unwrap_or_default();
    let defaults = Membership::default();
    let mut read = |text: &Option<String>, key, default| duration_or(text, key, default, problems);
    let membership = Membership {
        duration: read(
            &raw.membership_duration,
            "kubernetes.membership_duration",
            defaults.duration,
        ),
        renew: read(&raw.membership_renew, "kubernetes.membership_renew", defaults.renew),
        namespace: raw.namespace.unwrap_or(defaults.namespace),
        by_default,
    };
    if let Some(why) = bad_object_name(&membership.namespace) {
        problems.push(Problem::new(
            None,
            "kubernetes.namespace",
            format!("{:?} is not a Kubernetes namespace: {why}", membership.namespace),
        ));
    }
    if !(Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&membership.duration) {
        problems.push(Problem::new(
            None,
            "kubernetes.membership_duration",
            format!("{:?} is not from 100ms to 1h", membership.duration),
        ));
    }
    // A node answers until an eighth of the duration before the others may
    // count it gone: a renewal that fails once must be retried before then.
    let fence = membership.duration - membership.duration / 8;
    if membership.renew + retry >= fence {
        problems.push(Problem::new(
            None,
            "kubernetes.membership_renew",
            format!(
                "{:?} (and lease_retry, {retry:?}) leaves no room for a failed renewal to be \
                 retried before the node falls silent ({fence:?} after a renewal, seven eighths \
                 of membership_duration)",
                membership.renew
            ),
        ));
    }
    membership
}

/// `lease = { namespace, name }` of a `[service.external]` table (`at`).
pub(super) fn parse_lease(
    raw: RawLease,
    announce: Announce,
    line: Option<usize>,
    at: &Key,
    problems: &mut Vec<Problem>,
) -> Option<LeaseRef> {
    let before = problems.len();
    for (key, value) in [("lease.namespace", &raw.namespace), ("lease.name", &raw.name)] {
        if let Some(why) = bad_object_name(value) {
            problems.push(Problem::new(
                line,
                at.at(key),
                format!("{value:?} is not a Kubernetes name: {why}"),
            ));
        }
    }
    if !cfg!(feature = "kubernetes") {
        problems.push(Problem::new(
            line,
            at.at("lease"),
            "lb was built without the `kubernetes` feature, which elections by Lease need",
        ));
    }
    if announce != Announce::Arp {
        problems.push(Problem::new(
            line,
            at.at("lease"),
            "elects the node that announces the VIP, so it needs announce = \"arp\"",
        ));
    }
    (problems.len() == before).then_some(LeaseRef { namespace: raw.namespace, name: raw.name })
}

/// Why `name` cannot name a namespace or a Lease (a DNS subdomain, RFC
/// 1123), if it cannot.
pub(super) fn bad_object_name(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("empty")
    } else if name.len() > 253 {
        Some("longer than 253 characters")
    } else if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
    {
        Some("only lowercase letters, digits, '-' and '.' are allowed")
    } else if !name.starts_with(|c: char| c.is_ascii_alphanumeric())
        || !name.ends_with(|c: char| c.is_ascii_alphanumeric())
    {
        Some("must start and end with a letter or digit")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::testing::{parse, problems};
    use crate::config::{Election, LeaseRef};

    const LEASED: &str = r#"
        [daemon]
        node_name = "node-a"
        [[service]]
        name = "web"
        vip = "198.18.1.100:80"
        servers = ["198.18.2.2:8080"]
        [service.external]
        interfaces = ["eth1"]
        announce = "arp"
        lease = { namespace = "lb-system", name = "web" }
    "#;

    #[test]
    fn a_lease_and_the_timings_parse_with_their_defaults() {
        let config = parse(LEASED).unwrap();
        assert_eq!(config.daemon.node_name, "node-a");
        assert_eq!(config.daemon.election, Election::default());
        let lease = config.services[0].external.as_ref().unwrap().lease.clone();
        assert_eq!(lease, Some(LeaseRef { namespace: "lb-system".into(), name: "web".into() }));
        let timed = parse(&LEASED.replace(
            "node_name = \"node-a\"",
            "node_name = \"node-a\"\nlease_duration = \"2s\"\nlease_renew = \"500ms\"\nlease_retry = \"100ms\"",
        ))
        .unwrap();
        assert_eq!(timed.daemon.election.duration, Duration::from_secs(2));
        assert_eq!(timed.daemon.election.renew, Duration::from_millis(500));
        assert_eq!(timed.daemon.election.retry, Duration::from_millis(100));
    }

    #[test]
    fn localhost_names_no_node_when_elections_are_used() {
        for name in ["localhost", "localhost.localdomain"] {
            let text = problems(&LEASED.replace("node-a", name));
            assert!(text.contains("daemon.node_name") && text.contains("names no node"), "{text}");
        }
        // Without a lease, the node's name matters to nobody.
        let unleased = LEASED
            .replace("node-a", "localhost")
            .replace("lease = { namespace = \"lb-system\", name = \"web\" }", "");
        assert_eq!(parse(&unleased).unwrap().daemon.node_name, "localhost");
        // Elected by membership: one Lease per node name.
        let elected = unleased.replace("announce = \"arp\"", "announce = \"arp\"\nelect = true");
        let text = problems(&elected);
        assert!(text.contains("daemon.node_name") && text.contains("names no node"), "{text}");
    }

    #[test]
    fn bad_election_settings_are_named() {
        let text = problems(&LEASED.replace("name = \"web\" }", "name = \"Web_1\" }"));
        assert!(
            text.contains("external.lease.name")
                && text.contains("\"Web_1\" is not a Kubernetes name"),
            "{text}"
        );
        let text = problems(&LEASED.replace("announce = \"arp\"", "announce = \"none\""));
        assert!(text.contains("needs announce = \"arp\""), "{text}");
        let text = problems(&LEASED.replace(
            "node_name = \"node-a\"",
            "node_name = \"node-a\"\nlease_duration = \"1500ms\"",
        ));
        assert!(
            text.contains("daemon.lease_duration") && text.contains("whole number of seconds"),
            "{text}"
        );
        let text =
            problems(&LEASED.replace(
                "node_name = \"node-a\"",
                "node_name = \"node-a\"\nlease_renew = \"600ms\"",
            ));
        assert!(text.contains("daemon.lease_renew") && text.contains("more than half"), "{text}");
        let text = problems(&LEASED.replace("node_name = \"node-a\"", "node_name = \"a b\""));
        assert!(text.contains("daemon.node_name"), "{text}");
    }
}
