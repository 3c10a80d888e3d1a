//! The external path kept in step with the services: the VIPs it serves,
//! the node's address toward each of their servers (the NAT source) and
//! the interfaces `lb_xdp` runs on, those the services list (clients'
//! packets arrive there) and those the servers are reached through
//! (their replies arrive there). Routes are asked of the kernel once per
//! server and again every [`ROUTES_REFRESH`], or at the next sync when the
//! program has dropped a packet for want of a route or a neighbour, and
//! each time the next hop's link-layer address is asked for: the program
//! forwards only to resolved neighbours, and starts no resolution itself.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use tokio::sync::watch;
use tracing::{info, warn};

use super::{external_state::Role, owner::Daemon};
use crate::{
    announce,
    balancer::State,
    config::{Announce, Policy},
    control::{ExternalStatus, InterfaceStatus, ServiceExternal, TrafficStatus},
    datapath::{Announced, ExternalVips},
    maglev, nat_addresses, nat_ports, routes,
};

/// How often the routes to the servers are asked again (a route that
/// changes moves the NAT source and the interface replies arrive on).
pub(super) const ROUTES_REFRESH: Duration = Duration::from_secs(30);

/// `server`'s NAT sources beside `route`'s own source: those of
/// `configured` that serve it (`nat_addresses::toward`). Says which do
/// not, and why, when what serves differs from `before`.
fn nat_sources(
    server: IpAddr,
    route: &routes::Route,
    configured: &[IpAddr],
    before: Option<&Vec<IpAddr>>,
) -> Vec<IpAddr> {
    let (usable, not) = nat_addresses::toward(server, route, configured);
    if before != Some(&usable) {
        if !usable.is_empty() {
            info!(%server, sources = ?usable, "more NAT source addresses toward a server");
        }
        for (address, why) in not {
            warn!(%server, %address, "[daemon] nat_addresses: not a NAT source toward this server: {why}");
        }
    }
    usable
}

impl Daemon {
    /// Makes the external path's maps and XDP attachments match the
    /// services; with `refresh`, asks every server's route again. Nothing
    /// here fails the daemon: what cannot be done is logged and shown by
    /// `lb status`, and tried again at the next sync.
    pub(super) fn sync_external(&mut self, refresh: bool) {
        let external: Vec<usize> = (0..self.services.len())
            .filter(|&i| self.services[i].config.external.is_some())
            .collect();
        let mut vips = ExternalVips::default();
        for &i in &external {
            let service = &self.services[i];
            vips.vips.insert(service.config.vip);
            let Some(external) = &service.config.external else { continue };
            if external.client_affinity {
                vips.by_address.insert(service.config.vip);
            }
            if external.keep_client_address {
                vips.keeping.insert(service.config.vip);
                vips.server_ports.extend(service.balancer.servers().iter().map(|s| s.addr.port()));
            }
        }
        if let Err(e) = self.datapath.external().set_vips(&vips) {
            warn!("writing the external VIPs: {e:#}");
        }
        self.sync_health_checks();
        let servers: HashSet<IpAddr> = external
            .iter()
            .flat_map(|&i| self.services[i].balancer.servers().iter().map(|s| s.addr.ip()))
            .collect();
        let configured = self.config.settings.nat_addresses.clone();
        let state = &mut self.external;
        let now = Instant::now();
        // A packet dropped for want of a neighbour: its resolution may have
        // failed (an IPv6 interface soliciting nothing while its link-local
        // address is tentative), or the entry was flushed.
        let unrouted = self.datapath.maps().unrouted_packets();
        let dropped = unrouted != state.unrouted;
        state.unrouted = unrouted;
        let refresh =
            refresh || dropped || state.refreshed.is_none_or(|at| now - at >= ROUTES_REFRESH);
        if refresh {
            state.refreshed = Some(now);
        }
        state.routes.retain(|server, _| servers.contains(server));
        state.sources.retain(|server, _| servers.contains(server));
        for &server in &servers {
            if !refresh && state.routes.contains_key(&server) {
                continue;
            }
            let route = routes::route_to(server).map_err(|e| format!("no route to {server}: {e}"));
            if let Ok(route) = &route
                && route.source != route.next_hop
                && let Err(e) = routes::resolve_next_hop(route)
            {
                warn!(%server, next_hop = %route.next_hop, "asking the kernel to resolve the next hop: {e}");
            }
            let sources = match &route {
                Ok(route) => nat_sources(server, route, &configured, state.sources.get(&server)),
                Err(_) => Vec::new(),
            };
            state.sources.insert(server, sources);
            let before = state.routes.insert(server, route.clone());
            match (&route, before) {
                (Err(e), before) if !matches!(before, Some(Err(_))) => warn!("external path: {e}"),
                (Ok(route), Some(Ok(old))) if old != *route => {
                    info!(%server, ?route, "the route to a server changed");
                }
                _ => {}
            }
        }
        let addresses: HashMap<IpAddr, Vec<IpAddr>> = state
            .routes
            .iter()
            .filter_map(|(server, route)| {
                let more = state.sources.get(server).into_iter().flatten();
                Some((
                    *server,
                    std::iter::once(route.as_ref().ok()?.source).chain(more.copied()).collect(),
                ))
            })
            .collect();
        if let Err(e) = self.datapath.external().set_node_addresses(&addresses) {
            warn!("writing the node's addresses toward the servers: {e:#}");
        }
        let mut roles: BTreeMap<String, Role> = BTreeMap::new();
        for &i in &external {
            for name in
                &self.services[i].config.external.as_ref().expect("filtered above").interfaces
            {
                roles.entry(name.clone()).or_default().clients = true;
            }
        }
        for route in state.routes.values().flatten() {
            match routes::ifname(route.ifindex) {
                // A server on this node: nothing arrives from it on a wire.
                Some(name) if name == "lo" => {}
                Some(name) => roles.entry(name).or_default().servers = true,
                None => {}
            }
        }
        let wanted: BTreeSet<String> = roles.keys().cloned().collect();
        let attached = self.datapath.sync_xdp(&wanted);
        for (name, result) in &attached {
            let before = self.external.interfaces.get(name).map(|(_, r)| r);
            if let Err(e) = result
                && before != Some(result)
            {
                warn!(interface = %name, "the external path cannot run here (tried again every second): {e}");
            }
        }
        // Each interface the program runs on, read once a sync: its MAC
        // goes to LINK_MACS, and is what announcements answer with.
        self.external.links = attached
            .iter()
            .filter(|(_, result)| result.is_ok())
            .filter_map(|(name, _)| {
                let mac = announce::interface_mac(name)
                    .inspect_err(
                        |e| warn!(interface = %name, "reading the interface's MAC address: {e}"),
                    )
                    .ok()?;
                Some((name.clone(), (routes::ifindex(name)?, mac)))
            })
            .collect();
        let link_macs: HashMap<u32, announce::Mac> =
            self.external.links.values().copied().collect();
        if let Err(e) = self.datapath.external().set_link_macs(&link_macs) {
            warn!("writing the interfaces' MAC addresses: {e:#}");
        }
        self.external.interfaces = attached
            .into_iter()
            .map(|(name, result)| {
                let role = roles.get(&name).copied().unwrap_or_default();
                (name, (role, result))
            })
            .collect();
        let families =
            (vips.vips.iter().any(SocketAddr::is_ipv4), vips.vips.iter().any(SocketAddr::is_ipv6));
        if !external.is_empty() {
            self.watch_forwarding(families);
            self.reserve_nat_ports();
        }
        self.announce(&external);
        self.consistent_hashing(&external);
    }

    /// Writes each external `spread` service's Maglev table, built from its
    /// spread group (the servers new flows go to), and removes the others'.
    fn consistent_hashing(&mut self, external: &[usize]) {
        let tables: HashMap<SocketAddr, lb_common::maglev::Maglev> = external
            .iter()
            .filter(|&&i| self.services[i].config.policy == Policy::Spread)
            .map(|&i| {
                let service = &self.services[i];
                let selection = service.entry().value.selection;
                let group = selection.spread.clamp(1, selection.servers.len().max(1));
                let group = &selection.servers[..group.min(selection.servers.len())];
                (service.config.vip, maglev::table(group))
            })
            .collect();
        if let Err(e) = self.datapath.external().set_maglev(&tables) {
            warn!("writing the consistent-hash tables: {e:#}");
        }
    }

    /// Makes `ANNOUNCE` hold the VIPs of the services that announce
    /// (`announce = "arp"`), have a usable server and, with a lease, hold
    /// it (`may_announce`), on each of their interfaces, and
    /// `ANNOUNCE_UNTIL` their fences, in an order safe against a crash
    /// between writes (`set_announced_fenced`); tells the link about each one
    /// announced anew, then tells the elections whether this node is
    /// eligible (after the kernel has fallen silent, never before).
    fn announce(&mut self, external: &[usize]) {
        let mut wanted: HashMap<Announced, announce::Mac> = HashMap::new();
        let mut eligible: HashMap<usize, Option<&'static str>> = HashMap::new();
        let running: HashSet<u32> =
            self.external.links.values().map(|(ifindex, _)| *ifindex).collect();
        let mut by_bgp: BTreeSet<IpAddr> = BTreeSet::new();
        for &i in external {
            let service = &self.services[i];
            let config = service.config.external.as_ref().expect("filtered by the caller");
            if config.announce == Announce::None {
                continue;
            }
            // The interfaces the program runs on, as the last sync found
            // them: no reads here, which every renewal of a lease runs.
            let here: Vec<(u32, announce::Mac)> = config
                .interfaces
                .iter()
                .filter_map(|name| self.external.links.get(name).copied())
                .collect();
            let why_not = if !has_usable(service.balancer.servers()) {
                Some("no usable server")
            } else if here.is_empty() {
                Some("none of its interfaces is present with a MAC address")
            } else if !self.replies_translated(service.balancer.servers(), &running) {
                // Fail closed: its replies would leave untranslated.
                Some("lb_xdp does not run where a usable server's replies arrive")
            } else {
                None
            };
            if config.announce == Announce::Bgp {
                // Every node that can serve it announces: no election.
                if why_not.is_none() {
                    by_bgp.insert(service.config.vip.ip());
                }
                continue;
            }
            eligible.insert(i, why_not);
            if why_not.is_some() || !self.may_announce(i) {
                continue;
            }
            for (ifindex, mac) in here {
                wanted.insert((ifindex, service.config.vip.ip()), mac);
            }
        }
        let fences = self.fences(external);
        match self.datapath.external().set_announced_fenced(&wanted, &fences) {
            Ok(added) => {
                let now: HashSet<Announced> = wanted.keys().copied().collect();
                self.external.announced_now.send_replace(now.clone());
                for (ifindex, ip) in &added {
                    info!(vip = %ip, interface = ?routes::ifname(*ifindex), "announcing");
                    let rx = self.external.announced_now.subscribe();
                    tell_the_link(*ifindex, *ip, wanted[&(*ifindex, *ip)], rx);
                }
                for (ifindex, ip) in self.external.announced.difference(&now) {
                    info!(vip = %ip, interface = ?routes::ifname(*ifindex), "withdrawn: no longer announced");
                }
                self.external.announced = now;
            }
            Err(e) => warn!("writing the announced VIPs: {e:#}"),
        }
        self.sync_elections(&eligible);
        if let Some(speaker) = &mut self.bgp {
            speaker.announce(&by_bgp);
        }
    }

    /// Announces again after an election's news.
    pub(super) fn reannounce(&mut self) {
        let external: Vec<usize> = (0..self.services.len())
            .filter(|&i| self.services[i].config.external.is_some())
            .collect();
        self.announce(&external);
    }

    /// Before service `i`'s selection `servers` is written: the routes of
    /// servers new to the external path are asked now, so that its first
    /// packets find the NAT source, and its announcement and Maglev table
    /// follow its servers' states (the tick would be up to a second late).
    pub(super) fn before_external_write(&mut self, i: usize, servers: &[SocketAddr]) {
        let config = &self.services[i].config;
        let Some(external) = &config.external else { return };
        // Announcing and the consistent-hash table follow the servers'
        // states at once, too.
        if external.announce != Announce::None
            || config.policy == Policy::Spread
            || servers.iter().any(|s| !self.external.routes.contains_key(&s.ip()))
        {
            self.sync_external(false);
        }
    }

    /// Warns when the kernel does not forward: its FIB then refuses every
    /// lookup of the XDP program, which forwards nothing.
    fn watch_forwarding(&mut self, (v4, v6): (bool, bool)) {
        let on = forwarding(v4, v6);
        if on != self.external.forwarding.unwrap_or(true)
            || (self.external.forwarding.is_none() && !on)
        {
            if on {
                info!("IP forwarding is on: the external path forwards");
            } else {
                warn!(
                    "IP forwarding is off (net.ipv4.ip_forward or net.ipv6.conf.all.forwarding, for the external \
                     VIPs' families): the external path forwards nothing until it is on (sysctl -w net.ipv4.ip_forward=1)"
                );
            }
        }
        self.external.forwarding = Some(on);
    }

    /// Keeps the node's own connections off the NAT ports, once
    /// (`nat_ports`), and says so when its ephemeral range overlaps them.
    fn reserve_nat_ports(&mut self) {
        if self.external.nat_ports_reserved {
            return;
        }
        let ports = self.datapath.nat_port_range();
        let nat = format!("{}-{}", ports.start(), ports.end());
        match nat_ports::reserve(&ports) {
            Ok(done) => {
                if done.added {
                    info!(
                        "NAT ports {nat} reserved from the node's own connections (net.ipv4.ip_local_reserved_ports)"
                    );
                }
                if let Some(range) = done.overlap {
                    warn!(
                        "the node's ephemeral ports (net.ipv4.ip_local_port_range {}-{}) overlap the external path's NAT \
                         ports {nat}: those are reserved, so the node's own connections skip them; move \
                         either range to keep every port the ephemeral range names",
                        range.start(),
                        range.end(),
                    );
                }
                self.external.nat_ports_reserved = true;
            }
            Err(e) => warn!(
                "could not reserve the NAT ports {nat} from the node's own connections: {e:#}; a connection the node \
                 makes from one of them would have its replies taken for a flow's"
            ),
        }
    }

    /// A service's external path in `lb status`.
    pub(super) fn service_external(&self, i: usize) -> Option<ServiceExternal> {
        let external = self.services[i].config.external.as_ref()?;
        let vip = self.services[i].config.vip.ip();
        Some(ServiceExternal {
            interfaces: external.interfaces.clone(),
            announce: external.announce.to_string(),
            announcing: self.external.announced.iter().any(|(_, ip)| *ip == vip),
            lease: self.lease_status(i),
        })
    }

    /// The external path in `lb status`, when a service has one or a
    /// program is still attached.
    pub(super) fn external_status(&self) -> Option<ExternalStatus> {
        let attached = self.datapath.xdp_attachments();
        if self.external.interfaces.is_empty() && attached.is_empty() {
            return None;
        }
        let mut interfaces: Vec<InterfaceStatus> = self
            .external
            .interfaces
            .iter()
            .map(|(name, (role, result))| InterfaceStatus {
                name: name.clone(),
                role: role.name().to_owned(),
                mode: result.as_ref().ok().map(ToString::to_string),
                error: result.as_ref().err().cloned(),
            })
            .collect();
        for (name, mode) in attached {
            if !self.external.interfaces.contains_key(&name) {
                interfaces.push(InterfaceStatus {
                    name,
                    role: "none (left from an earlier config)".to_owned(),
                    mode: Some(mode.to_string()),
                    error: None,
                });
            }
        }
        let maps = self.datapath.external_maps();
        let (established_flows, flows) = maps.flows();
        Some(ExternalStatus {
            interfaces,
            flows,
            established_flows,
            flow_capacity: maps.flow_capacity(),
            nat_ports: maps.nat_ports(),
            nat_port_capacity: self.datapath.nat_port_range().len(),
            traffic: maps
                .traffic()
                .into_iter()
                .map(|(server, t)| TrafficStatus { server, packets: t.packets, bytes: t.bytes })
                .collect(),
            forwarding: self.external.forwarding.unwrap_or(false),
        })
    }
}

/// When a VIP announced anew is told to the link again after the first
/// time, for the frames that get lost: clients move at once on a takeover.
const TELL_AGAIN_AFTER: [Duration; 3] =
    [Duration::from_millis(200), Duration::from_millis(500), Duration::from_secs(1)];

/// Sends a gratuitous ARP (IPv4) or an unsolicited neighbour advertisement
/// (IPv6) for `ip` at `mac` out of `ifindex` now, and again after each of
/// [`TELL_AGAIN_AFTER`] while it is still announced there.
fn tell_the_link(
    ifindex: u32,
    ip: IpAddr,
    mac: announce::Mac,
    announced: watch::Receiver<HashSet<Announced>>,
) {
    let frame = announce::unsolicited(ip, mac);
    if let Err(e) = announce::send(ifindex, &frame) {
        return warn!(vip = %ip, "telling the link: {e}");
    }
    tokio::spawn(async move {
        for delay in TELL_AGAIN_AFTER {
            tokio::time::sleep(delay).await;
            if !announced.borrow().contains(&(ifindex, ip)) {
                return;
            }
            let _ = announce::send(ifindex, &frame);
        }
    });
}

impl Daemon {
    /// Whether `lb_xdp` runs (`running`: interface indexes) on every
    /// interface a usable server of `servers` is reached through, where its
    /// replies arrive to be translated back. A server on this node (its
    /// route by loopback) needs none; one with no route yet is not judged.
    fn replies_translated(
        &self,
        servers: &[crate::balancer::Server],
        running: &HashSet<u32>,
    ) -> bool {
        let loopback = 1;
        servers.iter().filter(|s| is_usable(s.state)).all(|s| {
            match self.external.routes.get(&s.addr.ip()) {
                Some(Ok(route)) => route.ifindex == loopback || running.contains(&route.ifindex),
                _ => true,
            }
        })
    }
}

/// Whether a server in `state` can take connections now.
pub(super) fn is_usable(state: State) -> bool {
    matches!(state, State::Active | State::Preferred | State::Healthy | State::Standby)
}

/// Whether one of `servers` can take connections now: the VIP is worth
/// announcing.
fn has_usable(servers: &[crate::balancer::Server]) -> bool {
    servers.iter().any(|s| is_usable(s.state))
}

/// Whether this network namespace forwards the families asked for (IPv4,
/// IPv6).
fn forwarding(v4: bool, v6: bool) -> bool {
    let on = |path: &str| std::fs::read_to_string(path).is_ok_and(|v| v.trim() == "1");
    (!v4 || on("/proc/sys/net/ipv4/ip_forward"))
        && (!v6 || on("/proc/sys/net/ipv6/conf/all/forwarding"))
}
