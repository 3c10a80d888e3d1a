//! Discovered lists to server lists: what a source's answer means
//! ([`list_to_apply`], pure: an empty list or a failed sync keeps the last
//! list), the list applied like `lb servers` with each endpoint's
//! readiness, kept in the state file, and the discovery tasks started.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::{messages::After, owner::Daemon, service::Discovery};
use crate::{
    balancer::{Effect, Readiness, State},
    config,
    control::DiscoveryStatus,
    discovery::{self, Endpoint},
    metrics::{DiscoveryLabels, DroppedLabels, ServiceLabels},
    state::SavedList,
};

/// What became of a source's answer (`lb_discovery_updates_total`'s
/// `result`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// The list was applied (or confirmed the one in force).
    Applied,
    /// The source listed no endpoint: the last list stays.
    Empty,
    /// The sync failed, or the list was refused: the last list stays.
    Error,
}

impl Outcome {
    const fn name(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Empty => "empty",
            Self::Error => "error",
        }
    }
}

/// Why a discovered address was left out: it can never be a server of
/// this service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dropped {
    /// `0.0.0.0` or `::`.
    Unspecified,
    /// A loopback address, for a VIP that is not on loopback: it would be
    /// the node itself.
    Loopback,
    /// `169.254.0.0/16` or `fe80::/10` (among them the cloud metadata
    /// address `169.254.169.254`).
    LinkLocal,
    /// A multicast address.
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// The VIP of a service: connects to it would loop.
    Vip,
}

impl Dropped {
    const fn name(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::Loopback => "loopback",
            Self::LinkLocal => "link_local",
            Self::Multicast => "multicast",
            Self::Broadcast => "broadcast",
            Self::Vip => "vip",
        }
    }
}

/// Why `addr`, discovered for the service at `vip`, can never be one of
/// its servers, if so; `is_vip` says whether an address is any service's
/// VIP.
pub(super) fn why_dropped(
    addr: SocketAddr,
    vip: SocketAddr,
    is_vip: impl Fn(SocketAddr) -> bool,
) -> Option<Dropped> {
    let ip = addr.ip().to_canonical();
    let link_local = match ip {
        IpAddr::V4(ip) => ip.is_link_local(),
        IpAddr::V6(ip) => ip.is_unicast_link_local(),
    };
    if ip.is_unspecified() {
        Some(Dropped::Unspecified)
    } else if ip.is_loopback() && !vip.ip().to_canonical().is_loopback() {
        Some(Dropped::Loopback)
    } else if link_local {
        Some(Dropped::LinkLocal)
    } else if ip.is_multicast() {
        Some(Dropped::Multicast)
    } else if ip == IpAddr::V4(Ipv4Addr::BROADCAST) {
        Some(Dropped::Broadcast)
    } else if is_vip(addr) {
        Some(Dropped::Vip)
    } else {
        None
    }
}

/// Leaves out of `endpoints` the addresses that can never be a server
/// ([`why_dropped`]) and says which, and why.
pub(super) fn screen(
    endpoints: &mut Vec<Endpoint>,
    vip: SocketAddr,
    is_vip: impl Fn(SocketAddr) -> bool,
) -> Vec<(SocketAddr, Dropped)> {
    let mut dropped = Vec::new();
    endpoints.retain(|e| match why_dropped(e.addr, vip, &is_vip) {
        Some(why) => {
            dropped.push((e.addr, why));
            false
        }
        None => true,
    });
    dropped
}

/// The list to apply from a source's answer, or why the last one stays: a
/// source that goes blank or fails must never empty a VIP, unless a blank
/// list is one of its answers (`blank_applies`: the endpoints on this node
/// of a Service whose traffic stays on the node that receives it, which
/// may have none here: the node then stops announcing it).
pub(super) fn list_to_apply(
    result: Result<Vec<Endpoint>, String>,
    blank_applies: bool,
) -> Result<Vec<(SocketAddr, Readiness)>, (Outcome, String)> {
    match result {
        Ok(endpoints) if endpoints.is_empty() && !blank_applies => {
            Err((Outcome::Empty, "the source listed no endpoints".to_owned()))
        }
        Ok(endpoints) => Ok(endpoints.iter().map(|e| (e.addr, e.readiness)).collect()),
        Err(error) => Err((Outcome::Error, error)),
    }
}

/// Seconds since the Unix epoch (what status and the state file show).
fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Daemon {
    /// Starts (or restarts) the discovery task of service `i`, if it has a
    /// source.
    pub(super) fn start_discovery(&mut self, i: usize) {
        let kubeconfig = self.config.settings.kubeconfig.clone();
        let service = &mut self.services[i];
        if let Some(old) = service.discovery.take() {
            old.task.abort();
        }
        let Some(source) = service.config.discovery.clone() else { return };
        let name = discovery::Source::from(&source);
        let (usable, usable_rx) = watch::channel(service.balancer.selection().servers);
        let task = discovery::spawn(
            service.config.name.clone(),
            service.config.vip,
            source,
            kubeconfig,
            service.config.servers.clone(),
            usable_rx,
            self.senders.discovered.clone(),
        );
        info!(service = %service.config.name, source = name.name(), "following the discovery source");
        let status =
            DiscoveryStatus { source: name.name().to_owned(), ..DiscoveryStatus::default() };
        service.discovery = Some(Box::new(Discovery { task, usable, status, dropped: Vec::new() }));
    }

    /// A list from a discovery source. Applied like `lb servers` (same
    /// checks, kept in the state file), with each endpoint's readiness;
    /// an empty list or a failed sync keeps the last list.
    pub(super) fn on_discovered(&mut self, update: discovery::Update) {
        let Ok(i) = self.services.index(&update.service) else { return };
        let source = update.source.name();
        let name = update.service;
        let mut result = update.result;
        if let Ok(endpoints) = &mut result {
            let vip = self.services[i].config.vip;
            let dropped = screen(endpoints, vip, |addr| self.services.by_vip.contains_key(&addr));
            self.count_dropped(i, &dropped);
        }
        let local = matches!(
            &self.services[i].config.discovery,
            Some(config::Discovery::Kubernetes { node: Some(_), .. })
        );
        let result = list_to_apply(result, local).and_then(|list| {
            self.apply_discovered(i, &list, update.truncated).map_err(|e| (Outcome::Error, e))
        });
        let outcome = result.as_ref().map_or_else(|(outcome, _)| *outcome, |()| Outcome::Applied);
        if let Err((_, error)) = &result {
            warn!(service = %name, source, "discovery: {error}; keeping the last list");
        }
        let labels = DiscoveryLabels {
            service: name.clone(),
            source: source.to_owned(),
            result: outcome.name().to_owned(),
        };
        self.metrics.discovery_updates.get_or_create(&labels).inc();
        let Some(discovery) = &mut self.services[i].discovery else { return };
        match result {
            Ok(()) => {
                let now = unix_now();
                discovery.status.last_success = Some(now);
                discovery.status.last_error = None;
                discovery.status.truncated = update.truncated;
                let labels = ServiceLabels { service: name };
                let at = i64::try_from(now).unwrap_or(i64::MAX);
                self.metrics.discovery_last_success.get_or_create(&labels).set(at);
                let truncated = i64::try_from(update.truncated).unwrap_or(i64::MAX);
                self.metrics.discovery_truncated.get_or_create(&labels).set(truncated);
            }
            Err((_, error)) => discovery.status.last_error = Some(error),
        }
    }

    /// Counts the addresses dropped from a list of service `i`, and logs them
    /// when they differ from the last list's (a source repeats its list at
    /// every sync).
    fn count_dropped(&mut self, i: usize, dropped: &[(SocketAddr, Dropped)]) {
        let service = &mut self.services[i];
        let name = &service.config.name;
        for (_, why) in dropped {
            let labels = DroppedLabels { service: name.clone(), reason: why.name().to_owned() };
            self.metrics.discovery_dropped.get_or_create(&labels).inc();
        }
        let Some(discovery) = &mut service.discovery else { return };
        let addrs: Vec<SocketAddr> = dropped.iter().map(|(addr, _)| *addr).collect();
        if addrs != discovery.dropped {
            for (addr, why) in dropped {
                warn!(service = %name, %addr, reason = why.name(), "left a discovered address out: it can never be a server of this service");
            }
            discovery.dropped = addrs;
        }
    }

    /// Applies a discovered, non-empty list to service `i` and keeps it in
    /// the state file.
    fn apply_discovered(
        &mut self,
        i: usize,
        list: &[(SocketAddr, Readiness)],
        truncated: usize,
    ) -> Result<(), String> {
        let config = &self.services[i].config;
        let (name, vip, default) = (config.name.clone(), config.vip, config.default);
        let servers: Vec<SocketAddr> = list.iter().map(|(addr, _)| *addr).collect();
        config::validate_servers(vip, &servers, default, |addr| self.services.vip_owner(addr))
            .map_err(|problems| format!("the discovered list was refused: {problems}"))?;
        if truncated > 0 {
            warn!(service = %name, truncated, "the source lists more endpoints than a service holds; the best 16 are used");
        }
        let effects = self.services[i].balancer.set_endpoints(list, default, Instant::now());
        let removed =
            effects.iter().any(|e| matches!(e, Effect::StateChanged { to: State::Invalid, .. }));
        if !effects.is_empty() {
            info!(service = %name, servers = ?servers, "applying the discovered list");
        }
        self.apply(i, effects);
        self.after_discovery.forget |= removed;
        let config = &self.services[i].config;
        let drained =
            list.iter().filter(|(_, r)| *r != Readiness::Ready).map(|(addr, _)| *addr).collect();
        let saved = SavedList {
            servers,
            default,
            configured: config.servers.clone(),
            configured_default: config.default,
            drained,
            discovered_at: Some(unix_now()),
        };
        // Written when the list changes, not at every confirmation.
        let unchanged = self.saved.services.get(&name).is_some_and(|old| {
            SavedList { discovered_at: old.discovered_at, ..saved.clone() } == *old
        });
        if !unchanged {
            self.saved.services.insert(name, saved);
            self.after_discovery.save = true;
        }
        Ok(())
    }

    /// After the discovered lists at hand are applied: writes the state
    /// file (on the saver's thread) and cleans the kernel's maps once for
    /// all of them.
    pub(super) fn after_discovered(&mut self) {
        let After { save, forget } = std::mem::take(&mut self.after_discovery);
        if forget {
            self.forget_stale();
        }
        if save {
            self.workers.saver.save(self.saved.clone(), None);
        }
    }

    /// Removes from the kernel what it keeps about servers no longer in
    /// any service (failure marks, zero connection counts), so that maps
    /// do not fill up with the dead. After every change of server lists.
    pub(super) fn forget_stale(&mut self) {
        let live: Vec<(SocketAddr, Vec<SocketAddr>)> = self
            .services
            .iter()
            .map(|s| {
                (s.config.vip, s.balancer.servers().iter().map(|server| server.addr).collect())
            })
            .collect();
        match self.datapath.forget(&live) {
            Ok(forgotten) => {
                debug!(?forgotten, "forgot what the kernel kept about removed servers");
            }
            Err(e) => warn!("cleaning the kernel's maps of removed servers failed: {e:#}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_that_can_never_be_a_server_are_dropped_alone() {
        let a = |s: &str| -> SocketAddr { s.parse().unwrap() };
        let vip = a("198.18.1.100:443");
        let other_vip = a("198.18.1.101:443");
        let is_vip = |addr: SocketAddr| addr == vip || addr == other_vip;
        let why = |addr: &str| why_dropped(a(addr), vip, is_vip);
        assert_eq!(why("198.18.2.2:443"), None);
        assert_eq!(why("[2001:db8::1]:443"), None);
        assert_eq!(why("0.0.0.0:443"), Some(Dropped::Unspecified));
        assert_eq!(why("[::]:443"), Some(Dropped::Unspecified));
        assert_eq!(why("127.0.0.1:443"), Some(Dropped::Loopback));
        assert_eq!(why("[::1]:443"), Some(Dropped::Loopback));
        assert_eq!(why("169.254.169.254:80"), Some(Dropped::LinkLocal));
        assert_eq!(why("[fe80::1]:443"), Some(Dropped::LinkLocal));
        assert_eq!(why("[::ffff:169.254.169.254]:80"), Some(Dropped::LinkLocal));
        assert_eq!(why("224.0.0.1:443"), Some(Dropped::Multicast));
        assert_eq!(why("[ff02::1]:443"), Some(Dropped::Multicast));
        assert_eq!(why("255.255.255.255:443"), Some(Dropped::Broadcast));
        assert_eq!(why("198.18.1.101:443"), Some(Dropped::Vip));
        // A loopback VIP (the node-local case) takes loopback servers.
        assert_eq!(why_dropped(a("127.10.0.1:443"), a("127.0.0.1:6443"), is_vip), None);

        let endpoint = |addr: &str| Endpoint { addr: a(addr), readiness: Readiness::Ready };
        let mut list = vec![
            endpoint("198.18.2.2:443"),
            endpoint("198.18.1.101:443"),
            endpoint("169.254.169.254:80"),
        ];
        let dropped = screen(&mut list, vip, is_vip);
        assert_eq!(list, [endpoint("198.18.2.2:443")], "the good endpoint stays");
        assert_eq!(
            dropped,
            [(a("198.18.1.101:443"), Dropped::Vip), (a("169.254.169.254:80"), Dropped::LinkLocal)]
        );
        let mut only_bad = vec![endpoint("169.254.169.254:80")];
        screen(&mut only_bad, vip, is_vip);
        assert_eq!(
            list_to_apply(Ok(only_bad), false).unwrap_err().0,
            Outcome::Empty,
            "keeps the last list"
        );
    }

    #[test]
    fn an_empty_or_failed_answer_keeps_the_last_list() {
        let a: SocketAddr = "127.10.0.1:443".parse().unwrap();
        let endpoint = Endpoint { addr: a, readiness: Readiness::Serving };
        assert_eq!(list_to_apply(Ok(vec![endpoint]), false), Ok(vec![(a, Readiness::Serving)]));
        assert_eq!(list_to_apply(Ok(vec![]), false).unwrap_err().0, Outcome::Empty);
        assert_eq!(list_to_apply(Ok(vec![]), true), Ok(vec![]), "none on this node");
        assert_eq!(
            list_to_apply(Err("watch failed".into()), true),
            Err((Outcome::Error, "watch failed".into()))
        );
    }
}
