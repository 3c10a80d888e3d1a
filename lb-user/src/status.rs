//! The status view: what `lb status` shows, built from the services' state
//! and the kernel's maps (data in, data out), and its table for people.

use std::{fmt::Write as _, net::SocketAddr, time::Duration};

use crate::{
    balancer::{Balancer, Readiness},
    config,
    control::{DiscoveryStatus, ExternalStatus, ServerStatus, ServiceStatus, Status},
};

/// What status needs from the kernel's maps.
pub trait KernelView {
    /// The selection the kernel holds for `vip`, best first.
    fn selection(&self, vip: SocketAddr) -> Vec<SocketAddr>;
    /// Live connections through `vip` to `server`.
    fn connections(&self, vip: SocketAddr, server: SocketAddr) -> i64;
    /// Whether a connect to `server` through a VIP failed within `hold_down`.
    fn recently_failed(&self, server: SocketAddr, hold_down: Duration) -> bool;
}

/// One service as `lb status` shows it.
pub fn service(
    config: &config::Service,
    balancer: &Balancer,
    discovery: Option<&DiscoveryStatus>,
    kernel: &impl KernelView,
) -> ServiceStatus {
    let vip = config.vip;
    ServiceStatus {
        name: config.name.clone(),
        vip,
        policy: config.policy.to_string(),
        selected: kernel.selection(vip),
        servers: balancer
            .servers()
            .iter()
            .map(|server| ServerStatus {
                address: server.addr,
                connections: kernel.connections(vip, server.addr),
                state: server.state.name().to_owned(),
                healthy: server.healthy,
                last_check: server.last_error.clone(),
                readiness: readiness_name(server.readiness).to_owned(),
                default: server.is_default,
                recently_failed: kernel.recently_failed(server.addr, config.hold_down),
            })
            .collect(),
        scope: config.scope.to_string(),
        discovery: discovery.cloned(),
        external: None,
    }
}

const fn readiness_name(readiness: Readiness) -> &'static str {
    match readiness {
        Readiness::Ready => "ready",
        Readiness::Serving => "serving",
        Readiness::Terminating => "terminating",
    }
}

/// The human-readable table of `lb status`.
pub fn table(status: &Status) -> String {
    let mut out = String::new();
    if status.services.is_empty() {
        out.push_str("no services configured\n");
    }
    for s in &status.services {
        let selected: Vec<String> = s.selected.iter().map(ToString::to_string).collect();
        let _ = writeln!(
            out,
            "{}  vip {}  policy {}  scope {}  selected [{}]",
            s.name,
            s.vip,
            s.policy,
            s.scope,
            selected.join(", ")
        );
        if let Some(e) = &s.external {
            let announcing = match (e.announce.as_str(), e.announcing) {
                ("none", _) => "not announced (routing is the operator's)",
                (_, true) => "announcing",
                (_, false) => "withdrawn",
            };
            let _ = writeln!(out, "  external on {}: {announcing}", e.interfaces.join(", "));
            if let Some(l) = &e.lease {
                lease_line(&mut out, l);
            }
        }
        if let Some(d) = &s.discovery {
            let synced = d.last_success.map_or_else(
                || "not synced yet".to_owned(),
                |at| {
                    format!(
                        "last sync {}",
                        humantime::format_rfc3339_seconds(
                            std::time::UNIX_EPOCH + Duration::from_secs(at)
                        )
                    )
                },
            );
            let _ = write!(out, "  discovery {}: {synced}", d.source);
            if d.truncated > 0 {
                let _ = write!(out, "; {} endpoints left out (at most 16 servers)", d.truncated);
            }
            if let Some(error) = &d.last_error {
                let _ = write!(out, "; LAST SYNC: {error}");
            }
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "  {:<42} {:<10} {:<8} {:>11}  NOTES",
            "SERVER", "STATE", "HEALTHY", "CONNECTIONS"
        );
        for server in &s.servers {
            let mut notes = Vec::new();
            if server.default {
                notes.push("default".to_owned());
            }
            if server.readiness != "ready" {
                notes.push(server.readiness.clone());
            }
            if server.recently_failed {
                notes.push("connect failed recently".to_owned());
            }
            if let Some(error) = &server.last_check {
                notes.push(format!("last check: {error}"));
            }
            let healthy = match server.healthy {
                Some(true) => "yes",
                Some(false) => "no",
                None => "-",
            };
            let _ = writeln!(
                out,
                "  {:<42} {:<10} {:<8} {:>11}  {}",
                server.address.to_string(),
                server.state,
                healthy,
                server.connections,
                notes.join("; ")
            );
        }
    }
    if let Some(reload) = &status.config.last_reload {
        match &reload.error {
            None => out.push_str("config: last reload ok\n"),
            Some(error) => {
                let _ = writeln!(
                    out,
                    "config: LAST RELOAD FAILED; still serving the previous config:\n{error}"
                );
            }
        }
    }
    let datapath = &status.datapath;
    let _ = writeln!(
        out,
        "datapath: cgroup {}  pins {}{}",
        datapath.cgroup,
        datapath.bpffs,
        if datapath.adopted { "  (adopted from a previous run)" } else { "" }
    );
    let sockets = &datapath.tracked_sockets;
    let _ = writeln!(
        out,
        "tracked sockets: {} tcp (of {}), {} connected udp (of {}), {} udp with VIP peers (of {})",
        sockets.tcp,
        sockets.tcp_capacity,
        sockets.udp,
        sockets.udp_capacity,
        sockets.udp_peers,
        sockets.udp_peers_capacity
    );
    if !sockets.udp_reverse.is_empty() {
        let _ = writeln!(out, "  udp answers shown as from the VIP (VIP <- server: sockets):");
        for row in &sockets.udp_reverse {
            let _ = writeln!(out, "    {} <- {}: {}", row.vip, row.server, row.sockets);
        }
    }
    if sockets.tcp_full {
        let _ = writeln!(
            out,
            "  the TCP socket table is FULL: connects through VIPs are rewritten but not tracked \
             (connect_untracked: {}); raise [daemon] socket_table",
            datapath.counters.get("connect_untracked").copied().unwrap_or(0)
        );
    }
    if let Some(external) = &datapath.external {
        external_table(&mut out, external);
    }
    if let Some(lbs) = &status.load_balancers {
        load_balancers_table(&mut out, lbs);
    }
    if let Some(bgp) = &status.bgp {
        let announced: Vec<String> = bgp.announced.iter().map(ToString::to_string).collect();
        let _ = writeln!(
            out,
            "BGP: announcing {}",
            if announced.is_empty() { "nothing".to_owned() } else { announced.join(" ") }
        );
        for s in &bgp.sessions {
            let bfd = s.bfd.as_deref().map(|b| format!(", BFD {b}")).unwrap_or_default();
            let _ = writeln!(out, "  {} {} {} {}{bfd}", s.name, s.peer, s.state, s.info);
        }
    }
    for (name, present) in [
        ("getpeername hooks", datapath.features.getpeername),
        ("closing connections (SOCK_DESTROY)", datapath.features.sock_destroy),
        (
            "network namespace scope (scope = \"host\" acts as \"all\")",
            datapath.features.netns_scope,
        ),
        (
            "closing pods' connections (CAP_SYS_ADMIN to enter their network namespaces)",
            datapath.features.close_in_pods,
        ),
    ] {
        if !present {
            let _ = writeln!(out, "degraded: this kernel lacks {name}");
        }
    }
    out
}

/// The LoadBalancer Services' lines of `lb status`.
fn load_balancers_table(out: &mut String, lbs: &crate::control::LoadBalancersStatus) {
    let who = if lbs.allocating { "this node allocates" } else { "another node allocates" };
    let _ = writeln!(out, "LoadBalancer Services ({who}):");
    if lbs.services.is_empty() {
        let _ = writeln!(out, "  none with an address");
    }
    for s in &lbs.services {
        let addresses: Vec<String> = s.addresses.iter().map(ToString::to_string).collect();
        let ports: Vec<String> = s.ports.iter().map(ToString::to_string).collect();
        let _ = writeln!(
            out,
            "  {} {} pool {}, {}, ports {}",
            s.service,
            addresses.join(" "),
            s.pool.as_deref().unwrap_or("-"),
            s.traffic_policy,
            ports.join(" ")
        );
    }
}

/// A leased VIP's line of `lb status`: this node's role, the holder, the
/// last takeover.
fn lease_line(out: &mut String, l: &crate::control::LeaseStatus) {
    let role = match &l.why {
        Some(why) => format!("{} ({why})", l.role),
        None => l.role.clone(),
    };
    let holder = l.holder.as_deref().unwrap_or("nobody");
    let age = l.changed_ms_ago.map_or_else(String::new, |ms| format!(", changed {ms} ms ago"));
    let me = l.identity.as_deref().unwrap_or(&l.node);
    let _ = write!(out, "  lease {} as {me}: {role}; held by {holder}{age}", l.lease);
    if let Some(t) = &l.last_takeover {
        let from = t.from.as_deref().map_or_else(String::new, |f| format!(" from {f}"));
        let _ = write!(out, "; took it{from} {} ms ago, in {} ms", t.ms_ago, t.took_ms);
    }
    if let Some(e) = &l.error {
        let _ = write!(out, "; LAST REQUEST FAILED: {e}");
    }
    out.push('\n');
}

/// The external path's lines of `lb status`.
fn external_table(out: &mut String, external: &ExternalStatus) {
    let _ = writeln!(
        out,
        "external path: {} flows ({} established; tables of {}), {} NAT ports in use{}",
        external.flows,
        external.established_flows,
        external.flow_capacity,
        external.nat_ports,
        if external.forwarding { "" } else { "; IP FORWARDING IS OFF: nothing is forwarded" }
    );
    for interface in &external.interfaces {
        let how = match (&interface.mode, &interface.error) {
            (Some(mode), _) => format!("xdp {mode}"),
            (None, Some(error)) => format!("NOT ATTACHED: {error}"),
            (None, None) => "not attached".to_owned(),
        };
        let _ = writeln!(out, "  interface {} ({}): {how}", interface.name, interface.role);
    }
    for t in &external.traffic {
        let _ =
            writeln!(out, "  forwarded to {}: {} packets, {} bytes", t.server, t.packets, t.bytes);
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, time::Instant};

    use super::*;
    use crate::{
        balancer::{Checks, Health},
        config::{HealthConfig, Policy},
    };

    struct FakeKernel {
        connections: HashMap<SocketAddr, i64>,
        failed: Vec<SocketAddr>,
    }

    impl KernelView for FakeKernel {
        fn selection(&self, _vip: SocketAddr) -> Vec<SocketAddr> {
            vec![a(2), a(1)]
        }
        fn connections(&self, _vip: SocketAddr, server: SocketAddr) -> i64 {
            self.connections.get(&server).copied().unwrap_or(0)
        }
        fn recently_failed(&self, server: SocketAddr, _hold_down: Duration) -> bool {
            self.failed.contains(&server)
        }
    }

    fn a(n: u8) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, n], 80))
    }

    #[test]
    fn the_table_shows_the_external_path() {
        let mut status = Status::default();
        status.services.push(ServiceStatus {
            name: "web".into(),
            vip: "198.18.1.100:80".parse().unwrap(),
            policy: "failover".into(),
            selected: Vec::new(),
            servers: Vec::new(),
            scope: "all".into(),
            discovery: None,
            external: Some(crate::control::ServiceExternal {
                interfaces: vec!["eth1".into()],
                announce: "arp".into(),
                announcing: false,
                lease: Some(crate::control::LeaseStatus {
                    lease: "lb-system/web".into(),
                    node: "node-a".into(),
                    role: "candidate".into(),
                    holder: Some("node-b".into()),
                    changed_ms_ago: Some(120),
                    ..crate::control::LeaseStatus::default()
                }),
            }),
        });
        status.datapath.external = Some(ExternalStatus::sample(false));
        let text = table(&status);
        for line in [
            "  external on eth1: withdrawn",
            "  lease lb-system/web as node-a: candidate; held by node-b, changed 120 ms ago",
            "external path: 3 flows (2 established; tables of 16384), 3 NAT ports in use; IP FORWARDING IS OFF: \
             nothing is forwarded",
            "  interface eth1 (clients): xdp native",
            "  interface eth9 (clients): NOT ATTACHED: no such interface",
            "  forwarded to 198.18.2.2:8080: 10 packets, 600 bytes",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing from:\n{text}");
        }
    }

    #[test]
    fn status_shows_the_balancer_and_the_kernel_side_by_side() {
        let config = config::Service {
            name: "api".into(),
            vip: SocketAddr::from(([127, 0, 0, 100], 6444)),
            servers: vec![a(1), a(2)],
            default: None,
            policy: Policy::Failover,
            hold_down: Duration::from_secs(5),
            health: HealthConfig::default(),
            discovery: None,
            scope: config::Scope::Host,
            external: None,
        };
        let now = Instant::now();
        let checks = Checks { rise: 1, fall: 1, passive_only: false };
        let (mut balancer, _) = Balancer::new(config.policy, checks, &config.servers, None, now);
        balancer.on_health(a(1), Health::Fail("tcp connect: refused".into()), now);
        balancer.on_health(a(2), Health::Pass, now);
        let kernel = FakeKernel { connections: HashMap::from([(a(2), 7)]), failed: vec![a(1)] };

        let discovery = DiscoveryStatus {
            source: "dns".into(),
            last_success: Some(1_700_000_000),
            last_error: Some("SERVFAIL".into()),
            truncated: 0,
        };
        let status = service(&config, &balancer, Some(&discovery), &kernel);
        assert_eq!(status.selected, vec![a(2), a(1)]);
        let (one, two) = (&status.servers[0], &status.servers[1]);
        assert_eq!(
            (one.state.as_str(), one.healthy, one.recently_failed, one.connections),
            ("failed", Some(false), true, 0)
        );
        assert_eq!(one.last_check.as_deref(), Some("tcp connect: refused"));
        assert_eq!(
            (two.state.as_str(), two.healthy, two.connections, two.readiness.as_str()),
            ("active", Some(true), 7, "ready")
        );

        let text = table(&Status { services: vec![status], ..Status::default() });
        assert!(text.contains("api  vip 127.0.0.100:6444  policy failover  scope host  selected [127.0.0.2:80, 127.0.0.1:80]"), "{text}");
        assert!(
            text.contains("  discovery dns: last sync 2023-11-14T22:13:20Z; LAST SYNC: SERVFAIL"),
            "{text}"
        );
        assert!(
            text.contains("connect failed recently; last check: tcp connect: refused"),
            "{text}"
        );
    }
}
