//! `lb reload` and SIGHUP: the new file parsed (only the service tables
//! that changed), its [`Plan`](crate::reload_plan::Plan) made by the pure
//! `reload_plan::plan`, and carried out here: services removed, added and
//! updated, each touched VIP written once, removed VIPs closed. The
//! LoadBalancer Services' services (`load_balancers.rs`) are applied the
//! same way, beside the file's.

use std::{
    collections::{HashMap, HashSet},
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use tracing::{error, info, warn};

use super::{
    apply::Write,
    messages::Close,
    owner::Daemon,
    service::{Service, checks_of},
    startup::{load_tls, parse_config, release_freed_memory},
};
use crate::{
    config,
    control::ReloadStatus,
    metrics::ResultLabels,
    reload_plan::{self, Change},
};

impl Daemon {
    /// SIGHUP or `lb reload`: apply a new config if it is valid; keep the
    /// old one if not. Records the outcome for `lb status` and metrics.
    pub(super) fn reload(&mut self) -> anyhow::Result<()> {
        let result = self.try_reload();
        let at = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let outcome = if result.is_ok() { "success" } else { "failure" };
        self.metrics
            .config_reloads
            .get_or_create(&ResultLabels { result: outcome.to_owned() })
            .inc();
        if let Err(e) = &result {
            error!("reload failed; still serving the previous config:\n{e:#}");
            self.config.source.forget();
        }
        release_freed_memory();
        self.last_reload = Some(ReloadStatus {
            ok: result.is_ok(),
            error: result.as_ref().err().map(|e| format!("{e:#}")),
            at,
        });
        result
    }

    /// Applies the config file's difference ([`reload_plan::plan`]): unchanged
    /// services keep their state and connections; removed services stop
    /// being rewritten and their VIP connections are closed. Nothing
    /// changes if the file is invalid.
    fn try_reload(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        // The file's services: the LoadBalancer Services' are not in it.
        let running: Vec<&config::Service> = self
            .services
            .iter()
            .map(|s| &s.config)
            .filter(|s| !self.is_load_balancer(&s.name))
            .collect();
        // Only the changed services' settings are kept (copied below), and
        // the source, copied here out of the parser's arena.
        let (config, source, read) = parse_config(|| {
            self.config.source.reload(&self.config.path, &self.config.settings, &running)
        })?;
        let source = source.clone();
        let parsed_in = started.elapsed();
        if config.daemon != self.config.settings {
            warn!("[daemon] settings changed; they take effect at the next start");
        }
        let mut wanted = config.services;
        wanted.extend(self.load_balancer_services(&wanted));
        let changed = self.apply_services(&wanted)?;
        self.config.settings = config.daemon;
        self.config.source = source;
        info!(
            services = self.services.len(),
            changed,
            tables_parsed = %read,
            parse_ms = parsed_in.as_millis(),
            apply_ms = (started.elapsed() - parsed_in).as_millis(),
            "config reloaded"
        );
        Ok(())
    }

    /// Makes the running services `wanted` ([`reload_plan::plan`]):
    /// unchanged services keep their state and connections; removed
    /// services stop being rewritten and their VIP connections are closed.
    /// Returns how many services changed. An error (a certificate that
    /// does not load) changes nothing.
    pub(super) fn apply_services(&mut self, wanted: &[config::Service]) -> anyhow::Result<usize> {
        let running: Vec<&config::Service> = self.services.iter().map(|s| &s.config).collect();
        let plan = reload_plan::plan(&running, wanted);
        let changed = plan.changes.len();
        // The certificates of the services that start or restart their
        // checks; the others keep what they loaded.
        let mut tls = load_tls(plan.changes.iter().filter_map(|c| match c {
            Change::Add(s) => Some(s),
            Change::Update { service: s, what } if what.policy_or_health => Some(s),
            Change::Update { .. } | Change::Remove { .. } => None,
        }))?;
        let now = Instant::now();
        self.remove_services(&plan.changes, now);
        // Closed once the kernel has the new values; logged as written once
        // they are.
        let mut moved = Vec::new();
        let mut reordered = HashSet::new();
        for change in plan.changes {
            match change {
                Change::Remove { .. } => {}
                Change::Add(wanted) => {
                    info!(service = %wanted.name, vip = %wanted.vip, "service added");
                    let tls = tls.remove(&wanted.name).unwrap_or_default();
                    let (servers, default) = (wanted.servers.clone(), wanted.default);
                    let (service, effects) = Service::new(wanted, tls, &servers, default, now);
                    self.services.push(service);
                    let i = self.services.len() - 1;
                    let deferred = self.carry_out(i, effects, Write::Later);
                    moved.extend(deferred.close);
                    if deferred.reordered {
                        reordered.insert(self.services[i].config.name.clone());
                    }
                    self.service_appeared(i);
                    self.start_discovery(i);
                }
                Change::Update { service: wanted, what } => {
                    let i = self.services.index(&wanted.name)?;
                    let service = &mut self.services[i];
                    service.config = wanted.clone();
                    let mut effects = Vec::new();
                    if what.policy_or_health {
                        service.tls = tls.remove(&wanted.name).unwrap_or_default();
                        effects.extend(service.balancer.set_policy(
                            wanted.policy,
                            checks_of(&wanted),
                            now,
                        ));
                        // Restarted by `sync_checks` below, with the new settings.
                        service.stop_checks();
                    }
                    if what.servers {
                        effects.extend(service.balancer.set_servers(
                            &wanted.servers,
                            wanted.default,
                            now,
                        ));
                        self.saved.services.remove(&wanted.name);
                    }
                    let deferred = self.carry_out(i, effects, Write::Later);
                    moved.extend(deferred.close);
                    if deferred.reordered {
                        reordered.insert(wanted.name.clone());
                    }
                    if what.discovery {
                        self.start_discovery(i);
                    }
                }
            }
        }
        self.keep_config_order(wanted);
        // The NAT sources of new servers go in before any selection has them.
        self.sync_external(false);
        for name in &plan.writes {
            let i = self.services.index(name)?;
            match self.datapath.write(&self.services[i].entry()) {
                Ok(()) if reordered.contains(name) => self.written(i),
                Ok(()) => {}
                Err(e) => error!(service = %name, "reload: writing the datapath failed: {e:#}"),
            }
            // Only an added or changed service can have new servers or
            // stopped checks.
            self.sync_checks(i);
        }
        for &vip in &plan.removed_vips {
            if let Err(e) = self.datapath.remove(vip) {
                error!("reload: {e:#}");
            }
        }
        for close in moved {
            self.close_moved(close);
        }
        if plan.lists_changed {
            self.forget_stale();
        }
        if !plan.removed_vips.is_empty() {
            let removed: HashSet<_> = plan.removed_vips.iter().copied().collect();
            self.close(move |vip, _| removed.contains(&vip), Close::RemovedVips);
        }
        Ok(changed)
    }

    /// The plan's removals, in one pass (they come first in the plan):
    /// their tasks stop and their servers' metrics leave.
    fn remove_services(&mut self, changes: &[Change], now: Instant) {
        let removed: HashSet<&str> = changes
            .iter()
            .filter_map(
                |c| if let Change::Remove { name } = c { Some(name.as_str()) } else { None },
            )
            .collect();
        if removed.is_empty() {
            return;
        }
        let (gone, kept): (Vec<Service>, Vec<Service>) = std::mem::take(&mut self.services.list)
            .into_iter()
            .partition(|s| removed.contains(s.config.name.as_str()));
        self.services.list = kept;
        self.services.reindex();
        for service in gone {
            let name = &service.config.name;
            info!(service = %name, vip = %service.config.vip, "service removed");
            for server in service.balancer.servers() {
                self.metrics.server_left(name, server.addr, now);
            }
        }
    }

    /// Puts the services in the config's order, as `lb status` shows them
    /// (most reloads keep it).
    fn keep_config_order(&mut self, wanted: &[config::Service]) {
        let in_order = self.services.len() == wanted.len()
            && self.services.iter().zip(wanted).all(|(s, c)| s.config.name == c.name);
        if !in_order {
            let order: HashMap<&str, usize> =
                wanted.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
            self.services.sort_by_cached_key(|s| order.get(s.config.name.as_str()).copied());
            self.services.reindex();
        }
    }
}
