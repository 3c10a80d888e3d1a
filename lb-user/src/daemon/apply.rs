//! A balancer's effects carried out: state changes logged and counted, the
//! service's kernel value written (one whole-value update per change),
//! connections closed after that write, checks woken or (re)started.

use std::{collections::HashSet, net::SocketAddr, sync::Arc, time::Instant};

use tokio::sync::Notify;
use tracing::{error, info, warn};

use super::{messages::Close, owner::Daemon, service::CheckTask, tasks::check_loop};
use crate::{
    balancer::{CloseReason, Effect, KernelValue, State},
    config::CheckKind,
    metrics::ServiceLabels,
};

/// Whether [`Daemon::carry_out`] writes the kernel value (and then closes
/// what must move) at once, or leaves both to its caller, which writes each
/// service it touched once at the end and closes after that (a reload: a
/// service's hold-down, servers and policy may all change in it, and the
/// kernel must get one value, not three).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Write {
    Now,
    Later,
}

/// What [`Daemon::carry_out`] leaves to do once the value is written.
pub(super) struct Deferred {
    /// The connections to close (always after the write).
    pub(super) close: Option<Close>,
    /// The selection changed: with [`Write::Later`], the caller logs and
    /// counts it ([`Daemon::written`]) once its write succeeds.
    pub(super) reordered: bool,
}

impl Daemon {
    /// Carries out a balancer's effects for service `i`.
    pub(super) fn apply(&mut self, i: usize, effects: Vec<Effect>) {
        if let Some(close) = self.carry_out(i, effects, Write::Now).close {
            self.close_moved(close);
        }
    }

    /// Carries out a balancer's effects for service `i`; `write` says
    /// whether its kernel value is written here. What is left to do after
    /// the write comes back ([`Deferred`]).
    #[must_use]
    pub(super) fn carry_out(&mut self, i: usize, effects: Vec<Effect>, write: Write) -> Deferred {
        let reordered =
            effects.iter().any(|e| matches!(e, Effect::WriteSelection { reordered: true, .. }));
        let changed_servers = effects.iter().any(|e| matches!(e, Effect::StateChanged { .. }));
        let mut closes: Vec<(SocketAddr, CloseReason)> = Vec::new();
        for effect in effects {
            match effect {
                Effect::StateChanged { server, from, to, why } => {
                    let name = &self.services[i].config.name;
                    info!(service = %name, %server, %from, %to, "server {from} -> {to}: {why}");
                    if to == State::Invalid {
                        self.metrics.server_left(name, server, Instant::now());
                    } else if from == State::Invalid {
                        self.metrics.server_appeared(name, server, to);
                    } else {
                        self.metrics.set_state(name, server, to);
                    }
                }
                Effect::WriteSelection { value, reordered } => {
                    self.write_value(i, value, reordered, write);
                }
                Effect::CloseConnections { server, reason } => closes.push((server, reason)),
                Effect::CheckNow { server } => {
                    let service = &self.services[i];
                    match service.checks.get(&server) {
                        Some(check) => check.now.notify_one(),
                        None => {
                            warn!(service = %service.config.name, %server, "no check task to confirm a kernel report with");
                        }
                    }
                }
            }
        }
        if changed_servers {
            self.sync_checks(i);
        }
        let service = &self.services[i];
        self.timers.set(&service.config.name, service.balancer.next_deadline());
        // Closed after the new value is written (the balancer orders its
        // effects so), so that a client reconnecting at once gets a server
        // of it.
        let config = &service.config;
        let close = (!closes.is_empty()).then(|| Close::Moved {
            service: config.name.clone(),
            vip: config.vip,
            servers: closes,
        });
        Deferred { close, reordered }
    }

    /// One [`Effect::WriteSelection`]: the discovery task learns the new
    /// order, and the kernel gets the whole value, unless `write` leaves it
    /// to the caller (which then calls [`Self::written`] itself).
    fn write_value(&mut self, i: usize, value: KernelValue, reordered: bool, write: Write) {
        let service = &self.services[i];
        if reordered && let Some(discovery) = &service.discovery {
            discovery.usable.send_replace(value.selection.servers.clone());
        }
        if write == Write::Later {
            return;
        }
        let mut entry = service.entry();
        entry.value = value;
        self.before_external_write(i, &entry.value.selection.servers);
        match self.datapath.write(&entry) {
            Ok(()) if reordered => self.written(i),
            Ok(()) => {}
            Err(e) => {
                error!(service = %self.services[i].config.name, "writing the selection failed: {e:#}");
            }
        }
    }

    /// A new selection of service `i` is in the kernel: logged and counted.
    pub(super) fn written(&self, i: usize) {
        let service = &self.services[i];
        let (name, selection) = (&service.config.name, &service.entry().value.selection);
        info!(service = %name, selection = ?selection.servers, spread = selection.spread, "selection written");
        self.metrics
            .selection_changes
            .get_or_create(&ServiceLabels { service: name.clone() })
            .inc();
    }

    /// Metrics and checks for service `i`, new to this daemon.
    pub(super) fn service_appeared(&mut self, i: usize) {
        let service = &self.services[i];
        for server in service.balancer.servers() {
            self.metrics.server_appeared(&service.config.name, server.addr, server.state);
        }
        self.sync_checks(i);
    }

    /// Makes the health check tasks of service `i` match its servers.
    pub(super) fn sync_checks(&mut self, i: usize) {
        let tx = self.senders.owner.clone();
        let service = &mut self.services[i];
        let wanted: HashSet<SocketAddr> =
            service.balancer.servers().iter().map(|s| s.addr).collect();
        service.checks.retain(|addr, check| {
            let keep = wanted.contains(addr);
            if !keep {
                check.task.abort();
            }
            keep
        });
        let config = &service.config;
        // `check = "none"`: the kernel's reports are the signal.
        if config.health.check == CheckKind::None {
            return;
        }
        for addr in wanted {
            if service.checks.contains_key(&addr) {
                continue;
            }
            let now = Arc::new(Notify::new());
            let task = tokio::spawn(check_loop(
                config.name.clone(),
                addr,
                config.health.clone(),
                service.tls.clone(),
                Arc::clone(&now),
                tx.clone(),
            ));
            service.checks.insert(addr, CheckTask { task, now });
        }
    }
}
