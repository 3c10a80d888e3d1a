//! Reloading the config: what changed between the running services and the
//! new file's, as a [`Plan`] for the daemon to carry out: the changes, the
//! kernel values to write and the VIPs to remove. Pure: the daemon owns the
//! state and only executes the plan.
//!
//! A service is known by its name. Same name and VIP: updated in place (its
//! servers keep their state and connections). Same name, new VIP: removed
//! and added again, since the kernel knows a service by its VIP.

use std::{
    borrow::Borrow,
    collections::{HashMap, HashSet},
    net::SocketAddr,
};

use crate::config::Service;

/// One difference between the running services and the new config's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Stop rewriting this service's VIP and close its connections (unless
    /// an added service takes the VIP over).
    Remove {
        /// The service's name.
        name: String,
    },
    /// A new service (or one whose VIP changed, after its `Remove`).
    Add(Service),
    /// A service that stays, with what changed about it.
    Update {
        /// The service as the new config has it.
        service: Service,
        /// What about it changed.
        what: Update,
    },
}

/// What changed about a service that stays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Update {
    /// The policy or the health settings: checks restart with the new ones.
    pub policy_or_health: bool,
    /// The configured server list or default: the new list replaces a list
    /// set at runtime (`lb servers`), as the operator just edited it.
    pub servers: bool,
    /// The hold-down or the scope: only the kernel's value changes.
    pub kernel: bool,
    /// The discovery source: its task restarts with the new settings.
    pub discovery: bool,
    /// `[service.external]`: the external path's tables and XDP
    /// attachments follow (they are made to match every service's after
    /// any reload).
    pub external: bool,
}

/// What a reload does, decided before anything is touched.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// The changes that turn the running services into the new file's:
    /// removals first, then additions and updates in the new file's order.
    /// Unchanged services are left out.
    pub changes: Vec<Change>,
    /// The services whose kernel value the reload writes, once each after
    /// every change is applied (added or updated), by name. The daemon is
    /// the only writer of the other entries, which hold what it wrote
    /// (10,000 services need not be read back to change one).
    pub writes: Vec<String>,
    /// VIPs that no service has any more: the kernel stops rewriting them
    /// and their connections are closed. A VIP that a removed service gave
    /// up and another service takes is not among them.
    pub removed_vips: Vec<SocketAddr>,
    /// A server list changed or a service left: the kernel's maps are
    /// cleaned of servers that no service has.
    pub lists_changed: bool,
}

/// The plan that turns `old` into `new` (see [`Plan`]). `old` may be
/// borrowed: the running services are not copied.
pub fn plan<S: Borrow<Service>>(old: &[S], new: &[Service]) -> Plan {
    let changes = changes(old, new);
    let writes = changes
        .iter()
        .filter_map(|c| match c {
            Change::Add(s) | Change::Update { service: s, .. } => Some(s.name.clone()),
            Change::Remove { .. } => None,
        })
        .collect();
    let lists_changed = changes.iter().any(|c| match c {
        Change::Remove { .. } => true,
        Change::Update { what, .. } => what.servers,
        Change::Add(_) => false,
    });
    let kept: HashSet<SocketAddr> = new.iter().map(|s| s.vip).collect();
    let removed: HashSet<&str> = changes
        .iter()
        .filter_map(|c| if let Change::Remove { name } = c { Some(name.as_str()) } else { None })
        .collect();
    let removed_vips = old
        .iter()
        .map(Borrow::borrow)
        .filter(|s| removed.contains(s.name.as_str()) && !kept.contains(&s.vip))
        .map(|s| s.vip)
        .collect();
    Plan { changes, writes, removed_vips, lists_changed }
}

/// The changes that turn `old` into `new` ([`Plan::changes`]).
fn changes<S: Borrow<Service>>(old: &[S], new: &[Service]) -> Vec<Change> {
    let before: HashMap<&str, &Service> =
        old.iter().map(|s| (s.borrow().name.as_str(), s.borrow())).collect();
    let after: HashMap<&str, &Service> = new.iter().map(|s| (s.name.as_str(), s)).collect();
    let mut changes: Vec<Change> = old
        .iter()
        .map(Borrow::borrow)
        .filter(|s: &&Service| after.get(s.name.as_str()).is_none_or(|n| n.vip != s.vip))
        .map(|s| Change::Remove { name: s.name.clone() })
        .collect();
    for wanted in new {
        let Some(previous) = before.get(wanted.name.as_str()).filter(|p| p.vip == wanted.vip)
        else {
            changes.push(Change::Add(wanted.clone()));
            continue;
        };
        let Service {
            name: _,
            vip: _,
            servers,
            default,
            policy,
            hold_down,
            health,
            discovery,
            scope,
            external,
        } = previous;
        let what = Update {
            policy_or_health: *policy != wanted.policy || *health != wanted.health,
            servers: *servers != wanted.servers || *default != wanted.default,
            kernel: *hold_down != wanted.hold_down || *scope != wanted.scope,
            discovery: *discovery != wanted.discovery,
            external: *external != wanted.external,
        };
        if what != Update::default() {
            changes.push(Change::Update { service: wanted.clone(), what });
        }
    }
    changes
}

#[cfg(test)]
mod tests {
    use std::{net::SocketAddr, time::Duration};

    use super::*;
    use crate::config::{CheckKind, HealthConfig, Policy};

    fn service(name: &str, vip: u16) -> Service {
        Service {
            name: name.into(),
            vip: SocketAddr::from(([127, 0, 0, 1], vip)),
            servers: vec![SocketAddr::from(([127, 0, 0, 2], 80))],
            default: None,
            policy: Policy::Failover,
            hold_down: Duration::from_secs(5),
            health: HealthConfig::default(),
            discovery: None,
            scope: crate::config::Scope::Host,
            external: None,
        }
    }

    #[test]
    fn the_same_config_changes_nothing() {
        let config = vec![service("a", 1), service("b", 2)];
        assert_eq!(plan(&config, &config), Plan::default());
    }

    #[test]
    fn added_and_removed_services() {
        let old = vec![service("a", 1), service("b", 2)];
        let new = vec![service("b", 2), service("c", 3)];
        assert_eq!(
            plan(&old, &new).changes,
            vec![Change::Remove { name: "a".into() }, Change::Add(service("c", 3))]
        );
    }

    #[test]
    fn a_new_vip_is_a_new_service() {
        let old = vec![service("a", 1)];
        let new = vec![service("a", 9)];
        assert_eq!(
            plan(&old, &new).changes,
            vec![Change::Remove { name: "a".into() }, Change::Add(service("a", 9))]
        );
    }

    #[test]
    fn each_kind_of_update_is_named() {
        let old = vec![service("a", 1)];
        let update = |edit: fn(&mut Service)| {
            let mut new = service("a", 1);
            edit(&mut new);
            match plan(&old, &[new]).changes.as_slice() {
                [Change::Update { what, .. }] => *what,
                other => panic!("expected one update, got {other:?}"),
            }
        };
        let servers = Update { servers: true, ..Update::default() };
        let policy = Update { policy_or_health: true, ..Update::default() };
        assert_eq!(update(|s| s.servers.push(SocketAddr::from(([127, 0, 0, 3], 80)))), servers);
        assert_eq!(update(|s| s.default = Some(SocketAddr::from(([127, 0, 0, 3], 80)))), servers);
        assert_eq!(update(|s| s.policy = Policy::Spread), policy);
        assert_eq!(update(|s| s.health.check = CheckKind::None), policy);
        assert_eq!(
            update(|s| s.hold_down = Duration::from_secs(1)),
            Update { kernel: true, ..Update::default() }
        );
        assert_eq!(
            update(|s| s.scope = crate::config::Scope::All),
            Update { kernel: true, ..Update::default() }
        );
        let dns = |s: &mut Service| {
            s.discovery = Some(crate::config::Discovery::Dns {
                name: "api.example.internal".into(),
                port: 443,
                debounce: Duration::from_secs(1),
                refresh_min: Duration::from_secs(5),
                refresh_max: Duration::from_secs(300),
            });
        };
        assert_eq!(update(dns), Update { discovery: true, ..Update::default() });
        let external = |s: &mut Service| {
            s.external = Some(crate::config::External {
                interfaces: vec!["eth1".into()],
                announce: crate::config::Announce::None,
                lease: None,
                elect: false,
                keep_client_address: false,
                client_affinity: false,
            });
        };
        assert_eq!(update(external), Update { external: true, ..Update::default() });
        assert_eq!(
            update(|s| {
                s.hold_down = Duration::from_secs(1);
                s.health.fall = 3;
            }),
            Update { policy_or_health: true, kernel: true, ..Update::default() }
        );
    }

    #[test]
    fn the_plan_names_what_to_write_and_what_to_remove() {
        let old = vec![service("a", 1), service("b", 2), service("c", 3)];
        let mut b = service("b", 2);
        b.hold_down = Duration::from_secs(1);
        // "c" gives VIP 3 to the new "d"; "a" and its VIP go.
        let new = vec![b, service("d", 3)];
        let plan = plan(&old, &new);
        assert_eq!(plan.writes, ["b", "d"]);
        assert_eq!(plan.removed_vips, [SocketAddr::from(([127, 0, 0, 1], 1))]);
        assert!(plan.lists_changed, "services left");
        let mut c = service("c", 3);
        c.hold_down = Duration::from_secs(1);
        let kernel_only = super::plan(&old[2..], &[c]);
        assert_eq!(
            (kernel_only.writes.as_slice(), kernel_only.lists_changed),
            (&["c".to_owned()][..], false)
        );
        assert!(kernel_only.removed_vips.is_empty());
    }

    #[test]
    fn a_vip_moving_between_services_is_removed_before_it_is_added() {
        let old = vec![service("a", 1), service("b", 2)];
        let new = vec![service("b", 1)];
        assert_eq!(
            plan(&old, &new).changes,
            vec![
                Change::Remove { name: "a".into() },
                Change::Remove { name: "b".into() },
                Change::Add(service("b", 1))
            ]
        );
    }
}
