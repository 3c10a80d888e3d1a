//! Discovered lists to server lists: what a source's answer means
//! ([`list_to_apply`], pure: an empty list or a failed sync keeps the last
//! list), the list applied like `lb servers` with each endpoint's
//! readiness, kept in the state file, and the discovery tasks started.

use std::{
    net::SocketAddr,
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use super::{Daemon, service::Discovery};
use crate::{
    balancer::{Effect, Readiness, State},
    config,
    control::DiscoveryStatus,
    discovery::{self, Endpoint},
    metrics::{DiscoveryLabels, ServiceLabels},
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

/// Work that applied lists call for, done once for a burst of them
/// ([`Daemon::after_discovered`]).
#[derive(Default)]
pub(super) struct After {
    /// A list changed: write the state file.
    save: bool,
    /// A server left: clean the kernel's maps of it.
    forget: bool,
}

/// The list to apply from a source's answer, or why the last one stays: a
/// source that goes blank or fails must never empty a VIP.
pub(super) fn list_to_apply(
    result: Result<Vec<Endpoint>, String>,
) -> Result<Vec<(SocketAddr, Readiness)>, (Outcome, String)> {
    match result {
        Ok(endpoints) if endpoints.is_empty() => {
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
        let kubeconfig = self.settings.kubeconfig.clone();
        let service = &mut self.services[i];
        if let Some(old) = service.discovery.take() {
            old.task.abort();
        }
        let Some(source) = service.config.discovery.clone() else { return };
        let name = match &source {
            config::Discovery::Kubernetes { .. } => discovery::Source::Kubernetes,
            config::Discovery::Dns { .. } => discovery::Source::Dns,
        };
        let (usable, usable_rx) = watch::channel(service.balancer.selection().servers);
        let task = discovery::spawn(
            service.config.name.clone(),
            service.config.vip,
            source,
            kubeconfig,
            usable_rx,
            self.discovered.clone(),
        );
        info!(service = %service.config.name, source = name.name(), "following the discovery source");
        let status =
            DiscoveryStatus { source: name.name().to_owned(), ..DiscoveryStatus::default() };
        service.discovery = Some(Box::new(Discovery { task, usable, status }));
    }

    /// A list from a discovery source. Applied like `lb servers` (same
    /// checks, kept in the state file), with each endpoint's readiness;
    /// an empty list or a failed sync keeps the last list.
    pub(super) fn on_discovered(&mut self, update: discovery::Update) {
        let Ok(i) = self.index(&update.service) else { return };
        let source = update.source.name();
        let name = update.service;
        let result = list_to_apply(update.result).and_then(|list| {
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
        config::validate_servers(vip, &servers, default, |addr| self.vip_owner(addr))
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
    /// file and cleans the kernel's maps once for all of them (each is a
    /// file write with fsync, or a walk of two maps).
    pub(super) fn after_discovered(&mut self) {
        let After { save, forget } = std::mem::take(&mut self.after_discovery);
        if forget {
            self.forget_stale();
        }
        if save && let Err(e) = self.saved.save(&self.settings.state_dir) {
            error!("saving the discovered lists to the state directory failed: {e:#}");
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
    fn an_empty_or_failed_answer_keeps_the_last_list() {
        let a: SocketAddr = "127.10.0.1:443".parse().unwrap();
        let endpoint = Endpoint { addr: a, readiness: Readiness::Serving };
        assert_eq!(list_to_apply(Ok(vec![endpoint])), Ok(vec![(a, Readiness::Serving)]));
        assert_eq!(list_to_apply(Ok(vec![])).unwrap_err().0, Outcome::Empty);
        assert_eq!(
            list_to_apply(Err("watch failed".into())),
            Err((Outcome::Error, "watch failed".into()))
        );
    }
}
