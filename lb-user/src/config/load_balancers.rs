//! `[kubernetes] default_class`, `interfaces` and the `[[pool]]` tables:
//! the LoadBalancer Services lb serves and the addresses they draw from.

use toml::Spanned;

use crate::loadbalancer::pools::{AddressRange, Pool, check_pools};

use super::{
    election::bad_object_name,
    external_service::bad_interface_name,
    model::LoadBalancers,
    problems::{Key, Problem},
    raw::{RawKubernetesSettings, RawPool},
};

/// The LoadBalancer settings, or the problems with them; `line_of` says
/// which line of the file a span is on; `bgp_given`: the file has `[bgp]`.
pub(super) fn parse_load_balancers(
    kubernetes: Option<&RawKubernetesSettings>,
    tables: Vec<Spanned<RawPool>>,
    bgp_given: bool,
    line_of: &dyn Fn(std::ops::Range<usize>) -> usize,
    problems: &mut Vec<Problem>,
) -> LoadBalancers {
    let default_class = kubernetes.and_then(|k| k.default_class).unwrap_or(false);
    let mut interfaces: Vec<String> = Vec::new();
    for (i, name) in
        kubernetes.and_then(|k| k.interfaces.clone()).unwrap_or_default().into_iter().enumerate()
    {
        let key = Key::top("kubernetes.interfaces").nth(i);
        if let Some(why) = bad_interface_name(&name) {
            problems.push(Problem::new(
                None,
                key,
                format!("{name:?} is not an interface name: {why}"),
            ));
        } else if interfaces.contains(&name) {
            problems.push(Problem::new(None, key, format!("{name:?} is listed twice")));
        } else {
            interfaces.push(name);
        }
    }

    let mut pools = Vec::with_capacity(tables.len());
    for (i, table) in tables.into_iter().enumerate() {
        let line = Some(line_of(table.span()));
        let raw = table.into_inner();
        let key = |at: &str| format!("pool[{i}].{at}");
        let mut problem = |at: &str, what: String| problems.push(Problem::new(line, key(at), what));
        if let Some(why) = bad_object_name(&raw.name) {
            problem("name", format!("{:?} is not a Kubernetes name: {why}", raw.name));
        }
        if raw.addresses.is_empty() {
            problem(
                "addresses",
                "must list at least one range (e.g. \"198.18.1.100-198.18.1.110\")".into(),
            );
        }
        let mut ranges = Vec::with_capacity(raw.addresses.len());
        for (j, text) in raw.addresses.iter().enumerate() {
            match AddressRange::parse(text) {
                Ok(range) => ranges.push(range),
                Err(why) => {
                    problems.push(Problem::new(line, format!("{}[{j}]", key("addresses")), why));
                }
            }
        }
        let namespaces = raw.namespaces.unwrap_or_default();
        for (j, namespace) in namespaces.iter().enumerate() {
            if let Some(why) = bad_object_name(namespace) {
                problems.push(Problem::new(
                    line,
                    format!("{}[{j}]", key("namespaces")),
                    format!("{namespace:?} is not a Kubernetes namespace: {why}"),
                ));
            }
        }
        let by_bgp = match raw.announce.as_deref() {
            None | Some("arp") => false,
            Some("bgp") => {
                if !bgp_given {
                    problems.push(Problem::new(
                        line,
                        key("announce"),
                        "\"bgp\" needs a [bgp] table: the AS number and the routers to announce to",
                    ));
                }
                true
            }
            Some(other) => {
                problems.push(Problem::new(
                    line,
                    key("announce"),
                    format!("{other:?} is not a way to announce: write \"arp\" or \"bgp\""),
                ));
                false
            }
        };
        pools.push(Pool {
            name: raw.name,
            ranges,
            auto_assign: raw.auto_assign.unwrap_or(true),
            namespaces,
            by_bgp,
        });
    }
    if let Err(why) = check_pools(&pools) {
        problems.push(Problem::new(None, "pool", why));
    }
    let serves = !pools.is_empty() || default_class || !interfaces.is_empty();
    if serves && !cfg!(feature = "kubernetes") {
        problems.push(Problem::new(
            None,
            "pool",
            "lb was built without the `kubernetes` feature, which LoadBalancer Services need",
        ));
    } else if !pools.is_empty() && kubernetes.is_none() {
        problems.push(Problem::new(
            None,
            "pool",
            "pools serve LoadBalancer Services, which need a [kubernetes] table",
        ));
    } else if !pools.is_empty() && interfaces.is_empty() {
        problems.push(Problem::new(
            None,
            "kubernetes.interfaces",
            "must name at least one interface where the pools' addresses are announced and clients' \
             packets arrive (e.g. [\"eth1\"])",
        ));
    }
    LoadBalancers { default_class, interfaces, pools }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{parse, problems};

    const POOLS: &str = r#"
        [kubernetes]
        default_class = true
        interfaces = ["eth1"]
        [[pool]]
        name = "default"
        addresses = ["198.18.1.100-198.18.1.110", "198.18.5.0/28", "fd00:198:18::100/124"]
        [[pool]]
        name = "reserved"
        addresses = ["198.18.7.1"]
        auto_assign = false
        namespaces = ["infra"]
    "#;

    #[test]
    fn pools_and_the_kubernetes_keys_parse_with_their_defaults() {
        if !cfg!(feature = "kubernetes") {
            assert!(problems(POOLS).contains("without the `kubernetes` feature"));
            return;
        }
        let lbs = parse(POOLS).unwrap().daemon.load_balancers;
        assert!(lbs.default_class);
        assert_eq!(lbs.interfaces, ["eth1"]);
        assert_eq!(lbs.pools.len(), 2);
        assert!(lbs.pools[0].auto_assign && lbs.pools[0].namespaces.is_empty());
        assert!(!lbs.pools[0].by_bgp, "announced by ARP and NDP by default");
        assert!(lbs.pools[0].contains("fd00:198:18::10f".parse().unwrap()));
        assert!(!lbs.pools[1].auto_assign && lbs.pools[1].serves("infra"));
        assert!(!lbs.pools[1].serves("default"));
        let none = parse("").unwrap().daemon.load_balancers;
        assert!(!none.default_class && none.pools.is_empty(), "nothing served by default");
    }

    #[test]
    fn bad_pools_are_named_by_key_and_line() {
        if !cfg!(feature = "kubernetes") {
            return;
        }
        let text = problems(&POOLS.replace("198.18.5.0/28", "198.18.5.1/28"));
        assert!(text.contains("pool[0].addresses[1]") && text.contains("host bits"), "{text}");
        assert!(text.contains("test.toml:5:"), "the pool's line: {text}");
        let overlap = problems(&POOLS.replace("\"198.18.7.1\"", "\"198.18.1.110\""));
        assert!(overlap.contains("overlaps 198.18.1.100-198.18.1.110"), "{overlap}");
        let twice = problems(&POOLS.replace("\"reserved\"", "\"default\""));
        assert!(twice.contains("two pools are named"), "{twice}");
        let name = problems(&POOLS.replace("\"reserved\"", "\"Not A Name\""));
        assert!(name.contains("pool[1].name") && name.contains("not a Kubernetes name"), "{name}");
        let how = problems(&POOLS.replace("auto_assign = false", "announce = \"ospf\""));
        assert!(how.contains("pool[1].announce: \"ospf\" is not a way to announce"), "{how}");
        let bgp = problems(&POOLS.replace("auto_assign = false", "announce = \"bgp\""));
        assert!(bgp.contains("pool[1].announce: \"bgp\" needs a [bgp] table"), "{bgp}");
        let empty = problems(&POOLS.replace("[\"198.18.7.1\"]", "[]"));
        assert!(empty.contains("must list at least one range"), "{empty}");
        let typo = problems(&POOLS.replace("auto_assign", "autoassign"));
        assert!(typo.contains("autoassign"), "unknown keys are errors: {typo}");
        let no_interfaces = problems(&POOLS.replace("interfaces = [\"eth1\"]", ""));
        assert!(no_interfaces.contains("kubernetes.interfaces"), "{no_interfaces}");
        let no_table = problems(
            &POOLS
                .replace("[kubernetes]", "")
                .replace("default_class = true\n        interfaces = [\"eth1\"]", ""),
        );
        assert!(no_table.contains("need a [kubernetes] table"), "{no_table}");
    }
}
