//! One service as the daemon holds it: its config, its state machine, its
//! health check tasks and its discovery task.

use std::{collections::HashMap, net::SocketAddr, sync::Arc, time::Instant};

use tokio::{
    sync::{Notify, watch},
    task::JoinHandle,
};

use crate::{
    balancer::{Balancer, Checks, Effect},
    config::{self, CheckKind},
    control::DiscoveryStatus,
    datapath::VipEntry,
    health::Tls,
};

/// The health check task of one server.
pub(super) struct CheckTask {
    pub(super) task: JoinHandle<()>,
    /// Wakes the task for a check out of turn ([`Effect::CheckNow`]).
    pub(super) now: Arc<Notify>,
}

/// The discovery task of one service and what it last said.
pub(super) struct Discovery {
    pub(super) task: JoinHandle<()>,
    /// The service's selection, best first, for the task to reconnect
    /// through (a watch of the apiservers goes through a usable one).
    pub(super) usable: watch::Sender<Vec<SocketAddr>>,
    pub(super) status: DiscoveryStatus,
    /// The addresses the last list had that can never be a server (logged
    /// when they change).
    pub(super) dropped: Vec<SocketAddr>,
}

/// One service: its config, its state machine, its health check tasks and
/// its discovery task.
pub(super) struct Service {
    pub(super) config: config::Service,
    /// The TLS files of its checks, read once (start or reload).
    pub(super) tls: Tls,
    pub(super) balancer: Balancer,
    pub(super) checks: HashMap<SocketAddr, CheckTask>,
    /// Boxed: most services have none.
    pub(super) discovery: Option<Box<Discovery>>,
}

impl Service {
    /// A service with `servers` (and `default`); the effects include its
    /// first selection.
    pub(super) fn new(
        config: config::Service,
        tls: Tls,
        servers: &[SocketAddr],
        default: Option<SocketAddr>,
        now: Instant,
    ) -> (Self, Vec<Effect>) {
        let (balancer, effects) =
            Balancer::new(config.policy, checks_of(&config), servers, default, now);
        (Self { config, tls, balancer, checks: HashMap::new(), discovery: None }, effects)
    }

    /// The kernel's entry for this service: the value its balancer has
    /// written (or adopted, or would write first), with the service's
    /// settings.
    pub(super) fn entry(&self) -> VipEntry {
        VipEntry {
            vip: self.config.vip,
            value: self.balancer.written().cloned().unwrap_or_else(|| self.balancer.kernel_value()),
            hold_down: self.config.hold_down,
            scope: self.config.scope,
        }
    }

    pub(super) fn stop_checks(&mut self) {
        for (_, check) in self.checks.drain() {
            check.task.abort();
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop_checks();
        if let Some(discovery) = self.discovery.take() {
            discovery.task.abort();
        }
    }
}

/// The state machine's view of a service's health settings.
pub(super) fn checks_of(service: &config::Service) -> Checks {
    Checks {
        rise: service.health.rise,
        fall: service.health.fall,
        passive_only: service.health.check == CheckKind::None,
    }
}
