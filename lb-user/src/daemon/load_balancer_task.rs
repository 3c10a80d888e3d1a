//! The LoadBalancer Services' part the owner loop holds (`owner.rs`):
//! the task (`loadbalancer::allocator`) started when the config has
//! `[[pool]]`s, what it said last, and the services made from it (one
//! per address and port, beside the file's); resumed from the state file
//! at start. `load_balancers.rs` acts on it.

use std::{collections::HashSet, net::SocketAddr, time::Duration};

use tokio::{sync::watch, task::JoinHandle};
use tracing::{info, warn};

use crate::{
    config::{
        self, Announce, CheckKind, DEFAULT_HOLD_DOWN, Discovery, External, HealthConfig,
        LoadBalancers, Policy, PortRef, Scope,
    },
    loadbalancer::{Served, health_check::HealthPorts, pools::Pool},
    state::SavedState,
};

/// How long a burst of EndpointSlice changes settles before it applies,
/// for a LoadBalancer Service's services: shorter than a `[[service]]`'s
/// default (1 s), as a new Service's first list waits for it too (from
/// creation to the first connect answered: 1.02 s with 1 s, measured by
/// `tests/benches/load_balancers.rs`), and still one update for a burst.
const DEBOUNCE: Duration = Duration::from_millis(200);

/// The token the allocating node is placed by, as if it were a VIP: the
/// unspecified address, which no VIP can be.
pub(super) const ALLOCATOR: &str = "0.0.0.0";

/// The running task and what it said last.
pub(super) struct LoadBalancerTask {
    /// Whether this node allocates, as the membership says.
    pub(super) leading: watch::Sender<bool>,
    _stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    /// What the task said to serve last.
    pub(super) served: Vec<Served>,
    /// The names of the services made from it, running now.
    pub(super) names: HashSet<String>,
    /// The `healthCheckNodePort`s of its `Local` Services, answered.
    pub(super) health: HealthPorts,
}

impl Drop for LoadBalancerTask {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the last daemon served for the LoadBalancer Services (the state
/// file), to serve again from the start, before the Services watch has
/// listed: as the file's services, they keep working across a restart.
pub(super) struct Resumed {
    served: Vec<Served>,
    /// The services made from it, beside the file's.
    pub(super) services: Vec<config::Service>,
}

/// [`Resumed`] from `saved`, if `settings` still has pools.
pub(super) fn resume(
    settings: &config::Daemon,
    file: &[config::Service],
    saved: &SavedState,
) -> Resumed {
    if settings.load_balancers.pools.is_empty() {
        return Resumed { served: Vec::new(), services: Vec::new() };
    }
    let served = resumable(&saved.load_balancers, &settings.load_balancers.pools);
    let services = services_of(&served, &settings.load_balancers, &settings.node_name, file);
    Resumed { served, services }
}

/// What of the state file's `saved` may be served again: only addresses
/// still in a pool (the pools may have changed since), ports that are
/// ports, a health port only for a `Local` Service. The file is the
/// daemon's own, but read as untrusted as anything from outside: a hand
/// edit or a stale file must not serve an address no pool has.
fn resumable(saved: &[Served], pools: &[Pool]) -> Vec<Served> {
    saved
        .iter()
        .cloned()
        .map(|mut s| {
            s.addresses.retain(|&ip| pools.iter().any(|p| p.contains(ip)));
            s.ports.retain(|p| p.port != 0);
            s.health_check_node_port = s.health_check_node_port.filter(|&p| s.local && p != 0);
            s
        })
        .filter(|s| !s.addresses.is_empty() && !s.ports.is_empty())
        .collect()
}

/// Starts the task if `settings` has pools: the task, and where it says
/// what to serve (a receiver whose sender is gone when there is none, so
/// that the owner loop's branch never fires).
pub(super) fn start(
    settings: &config::Daemon,
    reach: crate::election::Reach,
    resumed: Resumed,
) -> (Option<LoadBalancerTask>, watch::Receiver<Vec<Served>>) {
    let (served_tx, served) = watch::channel(Vec::new());
    if settings.load_balancers.pools.is_empty() || !cfg!(feature = "kubernetes") {
        return (None, served);
    }
    let (leading, leading_rx) = watch::channel(false);
    let (stop, stop_rx) = watch::channel(false);
    #[cfg(feature = "kubernetes")]
    let task = crate::loadbalancer::allocator::spawn_with(
        reach,
        settings.load_balancers.clone(),
        settings.node_name.clone(),
        crate::loadbalancer::allocator::Channels {
            leading: leading_rx,
            served: served_tx,
            stop: stop_rx,
        },
    );
    #[cfg(not(feature = "kubernetes"))]
    let task = {
        let _ = (reach, leading_rx, stop_rx, served_tx);
        tokio::spawn(async {})
    };
    info!(pools = settings.load_balancers.pools.len(), "serving LoadBalancer Services");
    let names = resumed.services.iter().map(|s| s.name.clone()).collect();
    let task = LoadBalancerTask {
        leading,
        _stop: stop,
        task,
        served: resumed.served,
        names,
        health: HealthPorts::default(),
    };
    (Some(task), served)
}

/// The services `served` asks for, beside the file's `file`: one per
/// address and port, named `namespace/name@VIP`. A VIP or name the file
/// already has is the file's (the LoadBalancer Service's is left out,
/// with a warning); of two Services claiming one VIP (the allocator
/// settles that) the first by name is served meanwhile. A Service whose
/// `externalTrafficPolicy` is `Local` is served from the endpoints on
/// `node` alone (none here: this node is not eligible, and never
/// announces it), keeping the client's address.
pub(super) fn services_of(
    served: &[Served],
    settings: &LoadBalancers,
    node: &str,
    file: &[config::Service],
) -> Vec<config::Service> {
    let mut names: HashSet<String> = file.iter().map(|s| s.name.clone()).collect();
    let mut vips: HashSet<SocketAddr> = file.iter().map(|s| s.vip).collect();
    let mut services = Vec::new();
    for wanted in served {
        for &ip in &wanted.addresses {
            let by_bgp = settings.pools.iter().any(|p| p.by_bgp && p.contains(ip));
            for port in &wanted.ports {
                let vip = SocketAddr::new(ip, port.port);
                let name = format!("{}@{vip}", wanted.service);
                if vips.contains(&vip) || names.contains(&name) {
                    warn!(
                        service = %wanted.service, %vip,
                        "LoadBalancer Service not served at this VIP: another service has it"
                    );
                    continue;
                }
                vips.insert(vip);
                names.insert(name.clone());
                services.push(config::Service {
                    name,
                    vip,
                    servers: Vec::new(),
                    default: None,
                    // As kube-proxy: every ready endpoint, judged by its
                    // EndpointSlice conditions.
                    policy: Policy::Spread,
                    hold_down: DEFAULT_HOLD_DOWN,
                    health: HealthConfig { check: CheckKind::None, ..HealthConfig::default() },
                    discovery: Some(Discovery::Kubernetes {
                        namespace: wanted.service.namespace.clone(),
                        service: wanted.service.name.clone(),
                        port: PortRef::Name(port.name.clone()),
                        debounce: DEBOUNCE,
                        node: wanted.local.then(|| node.to_owned()),
                    }),
                    // A Local Service's local clients are left to the
                    // host (kube-proxy's rules for the address send them to
                    // any endpoint): this node may have none of its own.
                    scope: if wanted.local { Scope::None } else { Scope::All },
                    external: Some(External {
                        interfaces: settings.interfaces.clone(),
                        // By BGP every node that can serve announces; by
                        // ARP one node, elected by membership.
                        announce: if by_bgp { Announce::Bgp } else { Announce::Arp },
                        lease: None,
                        elect: !by_bgp,
                        keep_client_address: wanted.local,
                        client_affinity: wanted.client_affinity,
                    }),
                });
            }
        }
    }
    services
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadbalancer::{ServedPort, allocate::ServiceRef};

    fn served(name: &str, addresses: &[&str], ports: &[(&str, u16)]) -> Served {
        Served {
            service: ServiceRef { namespace: "shop".into(), name: name.into() },
            addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
            ports: ports.iter().map(|&(n, p)| ServedPort { name: n.into(), port: p }).collect(),
            local: false,
            health_check_node_port: None,
            client_affinity: false,
        }
    }

    #[test]
    fn each_address_and_port_is_a_service_following_the_endpoint_slices() {
        let settings = LoadBalancers {
            default_class: false,
            interfaces: vec!["eth1".into()],
            pools: Vec::new(),
        };
        let all = services_of(
            &[served(
                "web",
                &["198.18.1.100", "fd00:198:18::100"],
                &[("http", 80), ("https", 443)],
            )],
            &settings,
            "n1",
            &[],
        );
        let names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "shop/web@198.18.1.100:80",
                "shop/web@198.18.1.100:443",
                "shop/web@[fd00:198:18::100]:80",
                "shop/web@[fd00:198:18::100]:443",
            ]
        );
        let https = &all[1];
        assert_eq!(
            https.discovery,
            Some(Discovery::Kubernetes {
                namespace: "shop".into(),
                service: "web".into(),
                port: PortRef::Name("https".into()),
                debounce: DEBOUNCE,
                node: None,
            })
        );
        let external = https.external.as_ref().unwrap();
        assert!(external.elect && external.announce == Announce::Arp);
        assert!(!external.keep_client_address);
        assert_eq!(external.interfaces, ["eth1"]);
        assert!(https.servers.is_empty() && https.health.check == CheckKind::None);

        // A pool announced by BGP: every node that can serve announces,
        // no election.
        let mut pool = Pool::new("bgp", &["198.18.1.100/30"]).unwrap();
        pool.by_bgp = true;
        let settings = LoadBalancers { pools: vec![pool], ..settings };
        let web = served("web", &["198.18.1.100", "fd00:198:18::100"], &[("http", 80)]);
        let all = services_of(&[web], &settings, "n1", &[]);
        let external = |i: usize| all[i].external.clone().unwrap();
        assert!(!external(0).elect && external(0).announce == Announce::Bgp, "in the pool");
        assert!(external(1).elect && external(1).announce == Announce::Arp, "in none");
    }

    #[test]
    fn a_tampered_state_file_serves_nothing_outside_the_pools() {
        let pools = [Pool::new("default", &["198.18.1.100/30"]).unwrap()];
        let saved: Vec<Served> = serde_json::from_value(serde_json::json!([
            // An address added by hand, outside every pool, and port 0.
            { "service": { "namespace": "shop", "name": "web" },
              "addresses": ["198.18.1.101", "203.0.113.7"],
              "ports": [{ "name": "http", "port": 80 }, { "name": "zero", "port": 0 }],
              "health_check_node_port": 22 },
            // Nothing in a pool at all.
            { "service": { "namespace": "shop", "name": "evil" },
              "addresses": ["203.0.113.8"], "ports": [{ "name": "", "port": 80 }] },
            // A Local one: its health port is kept.
            { "service": { "namespace": "shop", "name": "local" },
              "addresses": ["198.18.1.102"], "ports": [{ "name": "", "port": 80 }],
              "local": true, "health_check_node_port": 31000 },
            // A file of an older daemon: no policy fields at all.
            { "service": { "namespace": "shop", "name": "old" },
              "addresses": ["198.18.1.100"], "ports": [{ "name": "", "port": 443 }] },
        ]))
        .unwrap();
        let kept = resumable(&saved, &pools);
        let names: Vec<&str> = kept.iter().map(|s| s.service.name.as_str()).collect();
        assert_eq!(names, ["web", "local", "old"]);
        assert_eq!(kept[0].addresses, ["198.18.1.101".parse::<std::net::IpAddr>().unwrap()]);
        assert_eq!(kept[0].ports.len(), 1, "port 0 is no port");
        assert_eq!(kept[0].health_check_node_port, None, "a health port needs Local");
        assert_eq!(kept[1].health_check_node_port, Some(31_000));
        assert!(!kept[2].local && !kept[2].client_affinity);
    }

    #[test]
    fn a_local_service_follows_this_nodes_endpoints_and_keeps_the_client() {
        let mut local = served("web", &["198.18.1.100"], &[("http", 80)]);
        local.local = true;
        let all = services_of(&[local], &LoadBalancers::default(), "n1", &[]);
        let Some(Discovery::Kubernetes { node, .. }) = &all[0].discovery else { panic!() };
        assert_eq!(node.as_deref(), Some("n1"));
        assert!(all[0].external.as_ref().unwrap().keep_client_address);
        assert_eq!(all[0].scope, Scope::None, "local clients are the host's");
    }

    #[test]
    fn a_vip_the_file_or_another_service_has_is_not_taken() {
        let settings = LoadBalancers::default();
        let file =
            services_of(&[served("file", &["198.18.1.100"], &[("", 80)])], &settings, "n1", &[]);
        let all = services_of(
            &[
                served("a", &["198.18.1.100"], &[("", 80), ("", 81)]),
                served("b", &["198.18.1.101"], &[("", 80)]),
                served("c", &["198.18.1.101"], &[("", 80)]),
            ],
            &settings,
            "n1",
            &file,
        );
        let names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["shop/a@198.18.1.100:81", "shop/b@198.18.1.101:80"]);
    }
}
