//! The allocator's cases, one per rule, and its properties over random
//! sets of Services.

use std::net::IpAddr;

use proptest::prelude::*;

use super::*;

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn pool(name: &str, ranges: &[&str]) -> Pool {
    Pool::new(name, ranges).unwrap()
}

fn wish(name: &str, created: i64) -> Wish {
    Wish {
        service: ServiceRef { namespace: "default".into(), name: name.into() },
        created,
        families: Families::Single(Family::V4),
        requested: Vec::new(),
        pool: None,
        sharing: None,
        ports: vec![PortKey { udp: false, port: 80 }],
        held: Vec::new(),
    }
}

fn outcome<'a>(plan: &'a BTreeMap<ServiceRef, Outcome>, name: &str) -> &'a Outcome {
    plan.iter().find(|(s, _)| s.name == name).map(|(_, o)| o).unwrap()
}

fn addresses(plan: &BTreeMap<ServiceRef, Outcome>, name: &str) -> Vec<IpAddr> {
    match outcome(plan, name) {
        Ok(assigned) => assigned.addresses.clone(),
        Err(why) => panic!("{name} refused: {why}"),
    }
}

fn refusal(plan: &BTreeMap<ServiceRef, Outcome>, name: &str) -> String {
    match outcome(plan, name) {
        Ok(assigned) => panic!("{name} assigned {:?}", assigned.addresses),
        Err(why) => why.to_string(),
    }
}

#[test]
fn services_get_the_lowest_free_addresses_eldest_first() {
    let pools = [pool("default", &["198.18.1.100-198.18.1.101"])];
    let plan = plan(&pools, &[wish("young", 20), wish("old", 10), wish("late", 30)]);
    assert_eq!(addresses(&plan, "old"), [ip("198.18.1.100")]);
    assert_eq!(addresses(&plan, "young"), [ip("198.18.1.101")]);
    assert_eq!(
        refusal(&plan, "late"),
        "no pool this Service may draw from has an IPv4 address left"
    );
}

#[test]
fn what_a_service_holds_is_kept_before_anything_is_assigned() {
    // After a restart: "late" was given .100 when "old" did not exist yet.
    let pools = [pool("default", &["198.18.1.100-198.18.1.110"])];
    let mut late = wish("late", 30);
    late.held = vec![ip("198.18.1.100")];
    let plan = plan(&pools, &[wish("old", 10), late]);
    assert_eq!(addresses(&plan, "late"), [ip("198.18.1.100")]);
    assert_eq!(addresses(&plan, "old"), [ip("198.18.1.101")]);
}

#[test]
fn of_two_services_holding_one_address_the_elder_keeps_it() {
    let pools = [pool("default", &["198.18.1.100-198.18.1.110"])];
    let mut a = wish("a", 10);
    let mut b = wish("b", 20);
    a.held = vec![ip("198.18.1.105")];
    b.held = vec![ip("198.18.1.105")];
    let plan = plan(&pools, &[b, a]);
    assert_eq!(addresses(&plan, "a"), [ip("198.18.1.105")]);
    assert_eq!(addresses(&plan, "b"), [ip("198.18.1.100")], "b moves; never one address twice");
}

#[test]
fn an_address_outside_the_pools_is_not_kept() {
    // The pool was shrunk: what was held there is given up.
    let pools = [pool("default", &["198.18.1.100-198.18.1.101"])];
    let mut a = wish("a", 10);
    a.held = vec![ip("198.18.1.110")];
    assert_eq!(addresses(&plan(&pools, &[a]), "a"), [ip("198.18.1.100")]);
}

#[test]
fn a_requested_address_is_honoured_when_free_and_in_a_pool() {
    let pools = [pool("default", &["198.18.1.100-198.18.1.110"])];
    let mut asks = wish("asks", 20);
    asks.requested = vec![ip("198.18.1.107")];
    let mut outside = wish("outside", 30);
    outside.requested = vec![ip("198.18.9.9")];
    let mut taken = wish("taken", 40);
    taken.requested = vec![ip("198.18.1.107")];
    let plan = plan(&pools, &[wish("first", 10), asks, outside, taken]);
    assert_eq!(addresses(&plan, "first"), [ip("198.18.1.100")]);
    assert_eq!(addresses(&plan, "asks"), [ip("198.18.1.107")]);
    assert_eq!(refusal(&plan, "outside"), "198.18.9.9 is in no pool this Service may draw from");
    assert_eq!(
        refusal(&plan, "taken"),
        "198.18.1.107 is taken by default/asks, which does not share it with this Service"
    );
}

#[test]
fn a_changed_request_moves_the_service() {
    let pools = [pool("default", &["198.18.1.100-198.18.1.110"])];
    let mut a = wish("a", 10);
    a.held = vec![ip("198.18.1.100")];
    a.requested = vec![ip("198.18.1.109")];
    assert_eq!(addresses(&plan(&pools, &[a]), "a"), [ip("198.18.1.109")]);
}

#[test]
fn services_with_one_sharing_key_share_unless_a_port_clashes() {
    let pools = [pool("default", &["198.18.1.100-198.18.1.110"])];
    let shared = |name: &str, created, port| {
        let mut w = wish(name, created);
        w.sharing = Some("key".into());
        w.ports = vec![PortKey { udp: false, port }];
        w
    };
    let mut dns_udp = shared("dns-udp", 30, 53);
    dns_udp.ports = vec![PortKey { udp: true, port: 53 }];
    let mut other_key = wish("other", 50);
    other_key.sharing = Some("else".into());
    other_key.requested = vec![ip("198.18.1.100")];
    let plan = plan(
        &pools,
        &[
            shared("web", 10, 80),
            shared("tls", 20, 443),
            dns_udp,
            shared("clash", 40, 80),
            other_key,
        ],
    );
    let one = [ip("198.18.1.100")];
    assert_eq!(addresses(&plan, "web"), one);
    assert_eq!(addresses(&plan, "tls"), one);
    assert_eq!(addresses(&plan, "dns-udp"), one, "UDP 53 is not TCP 53 or 80");
    assert_eq!(addresses(&plan, "clash"), [ip("198.18.1.101")], "80/TCP is web's: a new address");
    assert!(refusal(&plan, "other").contains("taken by default/web"), "another key does not share");
}

#[test]
fn a_requested_shared_address_with_a_clashing_port_is_refused_with_the_port() {
    let pools = [pool("default", &["198.18.1.100-198.18.1.110"])];
    let mut a = wish("a", 10);
    a.sharing = Some("k".into());
    let mut b = wish("b", 20);
    b.sharing = Some("k".into());
    b.requested = vec![ip("198.18.1.100")];
    assert_eq!(
        refusal(&plan(&pools, &[a, b]), "b"),
        "198.18.1.100 is shared with default/a, which already has port 80/TCP"
    );
}

#[test]
fn families_decide_how_many_addresses_and_from_which_pool() {
    let pools = [
        pool("v4-only", &["198.18.1.100-198.18.1.110"]),
        pool("dual", &["198.18.5.0/28", "fd00:198:18::100/124"]),
    ];
    let with = |name: &str, created, families| {
        let mut w = wish(name, created);
        w.families = families;
        w
    };
    use Family::{V4, V6};
    let plan = plan(
        &pools,
        &[
            with("v4", 1, Families::Single(V4)),
            with("v6", 2, Families::Single(V6)),
            with("prefer", 3, Families::PreferDual(V6, V4)),
            with("require", 4, Families::RequireDual(V4, V6)),
        ],
    );
    assert_eq!(addresses(&plan, "v4"), [ip("198.18.1.100")], "the first pool that has one");
    assert_eq!(addresses(&plan, "v6"), [ip("fd00:198:18::100")]);
    let prefer = addresses(&plan, "prefer");
    assert_eq!(prefer.len(), 2, "the pool with both is chosen: {prefer:?}");
    assert_eq!(prefer, [ip("fd00:198:18::101"), ip("198.18.5.0")], "in ipFamilies' order");
    let require = addresses(&plan, "require");
    assert_eq!(require, [ip("198.18.5.1"), ip("fd00:198:18::102")]);
}

#[test]
fn prefer_dual_stack_takes_one_family_when_that_is_all_there_is() {
    let pools = [pool("v4-only", &["198.18.1.100-198.18.1.101"])];
    let mut prefer = wish("prefer", 10);
    prefer.families = Families::PreferDual(Family::V4, Family::V6);
    let mut require = wish("require", 20);
    require.families = Families::RequireDual(Family::V4, Family::V6);
    let plan = plan(&pools, &[prefer, require]);
    assert_eq!(addresses(&plan, "prefer"), [ip("198.18.1.100")]);
    assert_eq!(
        refusal(&plan, "require"),
        "no pool this Service may draw from has an IPv6 address left"
    );
}

#[test]
fn named_pools_namespaces_and_auto_assign_are_honoured() {
    let mut reserved = pool("reserved", &["198.18.7.1-198.18.7.2"]);
    reserved.auto_assign = false;
    let mut infra = pool("infra", &["198.18.8.1"]);
    infra.namespaces = vec!["infra".into()];
    let pools = [reserved, infra, pool("default", &["198.18.1.100"])];

    let mut named = wish("named", 10);
    named.pool = Some("reserved".into());
    let mut unknown = wish("unknown", 20);
    unknown.pool = Some("nope".into());
    let mut wrong_namespace = wish("wrong-namespace", 30);
    wrong_namespace.pool = Some("infra".into());
    let mut in_infra = wish("in-infra", 40);
    in_infra.service.namespace = "infra".into();
    let plan = plan(&pools, &[named, unknown, wrong_namespace, in_infra, wish("plain", 50)]);
    assert_eq!(addresses(&plan, "named"), [ip("198.18.7.1")], "named even if not auto-assigned");
    assert_eq!(refusal(&plan, "unknown"), "no address pool is named \"nope\"");
    assert_eq!(
        refusal(&plan, "wrong-namespace"),
        "pool \"infra\" does not serve namespace \"default\""
    );
    assert_eq!(addresses(&plan, "in-infra"), [ip("198.18.8.1")]);
    assert_eq!(addresses(&plan, "plain"), [ip("198.18.1.100")], "never the reserved pool");
}

#[test]
fn an_exhausted_pool_refuses_the_newcomer_and_moves_nobody() {
    let pools = [pool("small", &["198.18.1.100-198.18.1.101"])];
    let mut before = vec![wish("a", 10), wish("b", 20)];
    let first = plan(&pools, &before);
    for w in &mut before {
        w.held = addresses(&first, &w.service.name);
    }
    let mut after = before.clone();
    after.push(wish("c", 30));
    let second = plan(&pools, &after);
    assert_eq!(addresses(&second, "a"), addresses(&first, "a"));
    assert_eq!(addresses(&second, "b"), addresses(&first, "b"));
    assert_eq!(
        refusal(&second, "c"),
        "no pool this Service may draw from has an IPv4 address left"
    );
    let mut named = wish("named", 40);
    named.pool = Some("small".into());
    after.push(named);
    assert_eq!(refusal(&plan(&pools, &after), "named"), "pool \"small\" has no IPv4 address left");
}

/// A random Service over a small pool, so that sharing, clashes and
/// exhaustion all happen.
fn any_wish() -> impl Strategy<Value = Wish> {
    (
        0..20usize,
        0..5i64,
        prop::option::of(0..2u8),
        prop::collection::vec((any::<bool>(), 1..4u16), 1..3),
        prop::option::of(0..12u8),
        prop::option::of(0..12u8),
        0..3u8,
    )
        .prop_map(|(name, created, sharing, ports, requested, held, families)| {
            let mut w = wish(&format!("s{name}"), created);
            w.sharing = sharing.map(|k| format!("key{k}"));
            w.ports = ports.into_iter().map(|(udp, port)| PortKey { udp, port }).collect();
            w.requested =
                requested.map(|r| vec![ip(&format!("198.18.1.{}", 100 + r))]).unwrap_or_default();
            w.held = held.map(|h| vec![ip(&format!("198.18.1.{}", 100 + h))]).unwrap_or_default();
            w.families = match families {
                0 => Families::Single(Family::V4),
                1 => Families::PreferDual(Family::V4, Family::V6),
                _ => Families::RequireDual(Family::V6, Family::V4),
            };
            w
        })
}

proptest! {
    /// No address twice unless shared on purpose without a common port;
    /// every address from a pool and fitting the families; the same
    /// inputs in any order give the same plan; a plan fed back as status
    /// is kept whole (a restart moves nothing).
    #[test]
    fn plans_never_give_one_address_twice_and_are_stable(
        wishes in prop::collection::vec(any_wish(), 0..14),
    ) {
        // Names are unique, as in a cluster.
        let mut wishes = wishes;
        wishes.sort_by(|a, b| a.service.cmp(&b.service));
        wishes.dedup_by(|a, b| a.service == b.service);
        let pools = [
            pool("default", &["198.18.1.100-198.18.1.107"]),
            pool("six", &["fd00:198:18::/126"]),
        ];
        let first = plan(&pools, &wishes);
        prop_assert_eq!(first.len(), wishes.len());

        let mut users: BTreeMap<IpAddr, Vec<&Wish>> = BTreeMap::new();
        for w in &wishes {
            if let Ok(assigned) = &first[&w.service] {
                prop_assert!(w.families.fit(&assigned.addresses), "{:?}", assigned);
                for &ip in &assigned.addresses {
                    prop_assert!(pools.iter().any(|p| p.contains(ip)));
                    users.entry(ip).or_default().push(w);
                }
                if !w.requested.is_empty() {
                    prop_assert_eq!(sorted(&assigned.addresses), sorted(&w.requested));
                }
            }
        }
        for (ip, sharing) in &users {
            if sharing.len() > 1 {
                let key = &sharing[0].sharing;
                prop_assert!(key.is_some(), "{} given twice without a key", ip);
                for (i, a) in sharing.iter().enumerate() {
                    prop_assert_eq!(&a.sharing, key);
                    for b in &sharing[..i] {
                        prop_assert!(a.ports.iter().all(|p| !b.ports.contains(p)), "{} port clash", ip);
                    }
                }
            }
        }

        let mut reversed = wishes.clone();
        reversed.reverse();
        prop_assert_eq!(&plan(&pools, &reversed), &first);

        let mut restarted = wishes.clone();
        for w in &mut restarted {
            w.held = first[&w.service].as_ref().map(|a| a.addresses.clone()).unwrap_or_default();
        }
        let again = plan(&pools, &restarted);
        for w in &wishes {
            if let Ok(assigned) = &first[&w.service] {
                prop_assert_eq!(&again[&w.service].as_ref().unwrap().addresses, &assigned.addresses);
            }
        }
    }
}
