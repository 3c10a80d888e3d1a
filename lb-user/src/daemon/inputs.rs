//! Inputs to the balancers: kernel reports, health check results and
//! deadlines. Each becomes one balancer step whose effects `apply` carries
//! out. And the tick's look at the datapath itself (`watch`).

use std::{net::SocketAddr, time::Duration, time::Instant};

use lb_common::{Event, EventKind};
use tracing::{debug, warn};

use super::owner::Daemon;
use crate::{
    balancer::{Health, KernelReport},
    datapath::monotonic_now_ns,
    metrics::server_labels,
};

impl Daemon {
    /// A report from the kernel's ring buffer.
    pub(super) fn on_kernel_event(&mut self, event: &Event) {
        let vip = SocketAddr::from(event.vip);
        let server = SocketAddr::from(event.server);
        if event.time_ns < self.started_ns {
            return debug!(%vip, %server, kind = event.kind, "ignoring a kernel event from before this daemon started");
        }
        let report = match EventKind::try_from(event.kind) {
            Ok(kind) => KernelReport::of(kind, event.cookie),
            Err(e) => return warn!("ignoring a kernel event: {e}"),
        };
        match report {
            KernelReport::Established => debug!(%vip, %server, "connection established"),
            KernelReport::ConnectFailed => {
                warn!(%vip, %server, "connect through the VIP failed; the kernel skips this server for its hold-down");
            }
            KernelReport::ConnectTimeout => {
                warn!(%vip, %server, "connect through the VIP got no answer yet; the kernel skips this server for its hold-down");
            }
            KernelReport::ExternalFailure => {
                warn!(%vip, %server, "a flow from the network was refused or went unanswered; the kernel skips this server for its new flows for its hold-down, and a check decides");
            }
        }
        let Some(&i) = self.services.by_vip.get(&vip) else { return };
        if report != KernelReport::Established {
            self.metrics.count_connect_failure(&self.services[i].config.name, server);
        }
        let effects = self.services[i].balancer.on_kernel_report(server, report, Instant::now());
        self.apply(i, effects);
        // Decided (and any new selection written): how long the report
        // waited for the owner loop, by the kernel's own clock.
        let delay_ns = monotonic_now_ns().saturating_sub(event.time_ns);
        self.metrics.kernel_event_delay.observe(delay_ns as f64 / 1e9);
    }

    /// A health check result.
    pub(super) fn on_health(
        &mut self,
        service: &str,
        server: SocketAddr,
        result: Health,
        took: Duration,
    ) {
        let Ok(i) = self.services.index(service) else { return };
        debug!(service, %server, ?result, ?took, "health check");
        let effects = self.services[i].balancer.on_health(server, result, Instant::now());
        self.apply(i, effects);
        if let Some(s) = self.services[i].balancer.server(server) {
            self.metrics.set_healthy(service, server, s.healthy);
            self.metrics
                .health_check_duration
                .get_or_create(&server_labels(service, server))
                .observe(took.as_secs_f64());
        }
    }

    /// The deadlines due at `now`: each of those balancers gets its tick.
    pub(super) fn on_deadlines(&mut self, now: Instant) {
        for name in self.timers.take_due(now) {
            let Ok(i) = self.services.index(&name) else { continue };
            let effects = self.services[i].balancer.on_tick(now);
            self.apply(i, effects);
            // `apply` set the next deadline if the tick had effects; a tick
            // without any (a deadline that another input made moot) still
            // leaves the balancer's own next one to keep.
            self.timers.set(&name, self.services[i].balancer.next_deadline());
        }
    }
}

impl Daemon {
    /// Logs a full TCP socket table (see [`TableWatch`]).
    pub(super) fn watch_socket_table(&mut self, now: Instant) {
        let maps = self.datapath.maps();
        let Some(missed) = self.table_watch.observe(maps.untracked_connects(), now) else {
            return;
        };
        let (capacity, _) = maps.socket_capacity();
        warn!(
            untracked = missed,
            "the TCP socket table is full ({capacity} connections through VIPs): {missed} connects were \
             rewritten but not tracked (no failure mark when their server fails, no live count, not \
             closed on failover); raise [daemon] socket_table, then `lb detach` and start again"
        );
    }
}
