//! `[service.external]`: the VIP served to clients on other machines
//! through the XDP path, on which interfaces, and how it is announced.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
};

use super::{
    election::parse_lease,
    model::{Announce, External, LeaseRef, Service},
    problems::{Key, Problem},
    raw::RawExternal,
};

/// The longest interface name Linux takes (`IFNAMSIZ` less its NUL).
const MAX_IFNAME: usize = 15;

/// `[service.external]` of the service whose VIP is `vip` (`at`: the
/// table's key); `elect_by_default`: `[kubernetes]` is set, so a VIP
/// announced with no lease of its own is elected by membership unless it
/// says `elect = false`. Whether the interfaces exist is the daemon's to
/// see: one may appear after lb starts (a bond, a VLAN), and status says
/// which are missing.
pub(super) fn parse_external(
    raw: RawExternal,
    vip: Option<SocketAddr>,
    line: Option<usize>,
    at: Key,
    elect_by_default: bool,
    problems: &mut Vec<Problem>,
) -> External {
    let mut problem = |key: Key, what: String| problems.push(Problem::new(line, key, what));
    if let Some(vip) = vip
        && vip.ip().is_loopback()
    {
        problem(
            at.at("interfaces"),
            format!(
                "{vip} is a loopback address, which no other machine can reach; give the service a VIP routed \
                 to this node"
            ),
        );
    }
    if raw.interfaces.is_empty() {
        problem(
            at.at("interfaces"),
            "must name at least one interface where clients' packets arrive (e.g. [\"eth1\"])"
                .to_owned(),
        );
    }
    let mut interfaces: Vec<String> = Vec::with_capacity(raw.interfaces.len());
    for (i, name) in raw.interfaces.into_iter().enumerate() {
        if let Some(why) = bad_interface_name(&name) {
            problem(
                at.at("interfaces").nth(i),
                format!("{name:?} is not an interface name: {why}"),
            );
        } else if interfaces.contains(&name) {
            problem(at.at("interfaces").nth(i), format!("{name:?} is listed twice"));
        } else {
            interfaces.push(name);
        }
    }
    let announce = match raw.announce.as_deref() {
        None | Some("none") => Announce::None,
        Some("arp") => Announce::Arp,
        Some("bgp") => Announce::Bgp,
        Some(other) => {
            problem(
                at.at("announce"),
                format!("{other:?} is not a way to announce; use \"arp\", \"bgp\" or \"none\""),
            );
            Announce::None
        }
    };
    let elect =
        raw.elect.unwrap_or(elect_by_default && raw.lease.is_none() && announce == Announce::Arp);
    if elect {
        let why = if announce != Announce::Arp {
            Some("elects the node that announces the VIP, so it needs announce = \"arp\"")
        } else if !cfg!(feature = "kubernetes") {
            Some("lb was built without the `kubernetes` feature, which elections need")
        } else {
            None
        };
        if let Some(why) = why {
            problems.push(Problem::new(line, at.at("elect"), why));
        }
    }
    let lease = raw.lease.and_then(|lease| parse_lease(lease, announce, line, &at, problems));
    let keep_client_address = raw.keep_client_address.unwrap_or(false);
    let client_affinity = raw.client_affinity.unwrap_or(false);
    External { interfaces, announce, lease, elect, keep_client_address, client_affinity }
}

/// The services announcing an address that another service announces
/// elected another way (one with `elect`, one with a lease, or a different
/// lease, or none): each would let a different node answer the address,
/// so two nodes would. Each with the problem to report at its `elect`.
pub(super) fn mixed_elections<'a>(
    services: impl IntoIterator<Item = &'a Service>,
) -> Vec<(usize, String)> {
    let way = |s: &Service| {
        let e = s.external.as_ref().filter(|e| e.announce == Announce::Arp)?;
        Some((e.elect, e.lease.clone()))
    };
    let mut first: HashMap<IpAddr, (usize, (bool, Option<LeaseRef>))> = HashMap::new();
    let mut mixed = Vec::new();
    for (i, service) in services.into_iter().enumerate() {
        let Some(this) = way(service) else { continue };
        match first.get(&service.vip.ip()) {
            None => {
                first.insert(service.vip.ip(), (i, this));
            }
            Some((j, that)) if *that != this => mixed.push((
                i,
                format!(
                    "{} is also announced by service[{j}], elected another way: services on one \
                     address are answered by one node, so they need the same elect or lease",
                    service.vip.ip()
                ),
            )),
            Some(_) => {}
        }
    }
    mixed
}

/// Why `name` cannot name a Linux network interface, if it cannot.
pub(super) fn bad_interface_name(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("empty")
    } else if name.len() > MAX_IFNAME {
        Some("longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("reserved")
    } else if name.chars().any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control()) {
        Some("has '/', ':' or a space")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{parse, problems};
    use crate::config::{Announce, External};
    use std::time::Duration;

    const EXTERNAL: &str = r#"
        [[service]]
        name = "web"
        vip = "198.18.1.100:80"
        servers = ["198.18.2.2:8080"]
        [service.external]
        interfaces = ["eth1", "eth2"]
    "#;

    #[test]
    fn an_external_table_parses_with_its_default() {
        let config = parse(EXTERNAL).unwrap();
        let expected = External {
            interfaces: vec!["eth1".into(), "eth2".into()],
            announce: Announce::None,
            lease: None,
            elect: false,
            keep_client_address: false,
            client_affinity: false,
        };
        assert_eq!(config.services[0].external, Some(expected));
        let arp = parse(&format!("{EXTERNAL}announce = \"arp\"\n")).unwrap();
        assert_eq!(arp.services[0].external.as_ref().unwrap().announce, Announce::Arp);
    }

    #[test]
    fn bad_external_settings_are_named() {
        let bad = EXTERNAL
            .replace(r#"["eth1", "eth2"]"#, r#"["eth1", "eth1", "a/b", "averyveryverylongname"]"#);
        let text = problems(&bad);
        assert!(text.contains("external.interfaces[1]") && text.contains("listed twice"), "{text}");
        assert!(text.contains("\"a/b\" is not an interface name"), "{text}");
        assert!(text.contains("longer than 15 bytes"), "{text}");
        let none = problems(&EXTERNAL.replace(r#"["eth1", "eth2"]"#, "[]"));
        assert!(none.contains("must name at least one interface"), "{none}");
        let how = problems(&format!("{EXTERNAL}announce = \"ospf\"\n"));
        assert!(how.contains("\"ospf\" is not a way to announce"), "{how}");
        let bgp = problems(&format!("{EXTERNAL}announce = \"bgp\"\n"));
        assert!(bgp.contains("external.announce: \"bgp\" needs a [bgp] table"), "{bgp}");
        let lo = problems(&EXTERNAL.replace("198.18.1.100:80", "127.0.0.1:80"));
        assert!(lo.contains("loopback address, which no other machine can reach"), "{lo}");
    }

    #[test]
    fn a_vip_elected_by_membership_announces_and_may_keep_its_lease_while_moving() {
        let elected = parse(&format!("{EXTERNAL}announce = \"arp\"\nelect = true\n")).unwrap();
        assert!(elected.services[0].external.as_ref().unwrap().elect);
        assert_eq!(elected.daemon.membership.namespace, "lb-system");
        let silent = problems(&format!("{EXTERNAL}elect = true\n"));
        assert!(
            silent.contains("external.elect") && silent.contains("announce = \"arp\""),
            "{silent}"
        );
        // Both: a cluster moving from a Lease per VIP to membership.
        let both = parse(&format!(
            "{EXTERNAL}announce = \"arp\"\nelect = true\nlease = {{ namespace = \"lb\", name = \"web\" }}\n"
        ))
        .unwrap();
        let external = both.services[0].external.as_ref().unwrap();
        assert!(external.elect && external.lease.is_some());
        let namespace = parse(&format!("[kubernetes]\nnamespace = \"infra\"\n{EXTERNAL}")).unwrap();
        assert_eq!(namespace.daemon.membership.namespace, "infra");
        let bad = problems(&format!("[kubernetes]\nnamespace = \"No_Such\"\n{EXTERNAL}"));
        assert!(
            bad.contains("kubernetes.namespace") && bad.contains("not a Kubernetes namespace"),
            "{bad}"
        );
        assert_eq!(elected.daemon.membership.duration, Duration::from_millis(1_200));
        assert_eq!(elected.daemon.membership.renew, Duration::from_millis(700));
        let timed = "[kubernetes]\nmembership_duration = \"3s\"\nmembership_renew = \"1s\"\n";
        let timed = parse(&format!("{timed}{EXTERNAL}")).unwrap();
        assert_eq!(timed.daemon.membership.duration, Duration::from_secs(3));
        assert_eq!(timed.daemon.membership.renew, Duration::from_secs(1));
        // 1s + the default retry (200ms) reaches the fence, 7/8 of 1.2s.
        let tight = problems(&format!("[kubernetes]\nmembership_renew = \"1s\"\n{EXTERNAL}"));
        assert!(
            tight.contains("kubernetes.membership_renew") && tight.contains("no room"),
            "{tight}"
        );
        let short = problems(&format!("[kubernetes]\nmembership_duration = \"50ms\"\n{EXTERNAL}"));
        assert!(short.contains("kubernetes.membership_duration"), "{short}");
    }

    #[test]
    fn with_kubernetes_set_an_announced_vip_without_a_lease_is_elected_by_default() {
        let elect = |text: &str| parse(text).unwrap().services[0].external.as_ref().unwrap().elect;
        let arp = format!("{EXTERNAL}announce = \"arp\"\n");
        assert!(!elect(&arp), "no [kubernetes]: announced alone");
        let kubernetes = "[kubernetes]\n";
        // (A build without Kubernetes elects nothing by default.)
        assert_eq!(elect(&format!("{kubernetes}{arp}")), cfg!(feature = "kubernetes"));
        assert!(!elect(&format!("{kubernetes}{arp}elect = false\n")), "said no");
        let leased = format!("{kubernetes}{arp}lease = {{ namespace = \"lb\", name = \"web\" }}\n");
        assert!(!elect(&leased), "a Lease of its own stays the way it is elected");
        assert!(!elect(&format!("{kubernetes}{EXTERNAL}")), "not announced: nothing to elect");
    }

    #[test]
    fn services_on_one_address_are_elected_one_way() {
        let second = EXTERNAL.replace("\"web\"", "\"api\"").replace(":80\"", ":443\"");
        let elect = "announce = \"arp\"\nelect = true\n";
        let alone = "announce = \"arp\"\n";
        assert!(parse(&format!("{EXTERNAL}{elect}{second}{elect}")).is_ok());
        let mixed = problems(&format!("{EXTERNAL}{elect}{second}{alone}"));
        assert!(
            mixed.contains("service[1]")
                && mixed.contains("announced by service[0], elected another way"),
            "{mixed}"
        );
        // Not announced, it answers nothing: nothing to elect.
        assert!(parse(&format!("{EXTERNAL}{elect}{second}")).is_ok());
    }
}
