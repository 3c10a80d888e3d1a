//! LoadBalancer Services in the daemon (issue 41): the task
//! (`loadbalancer::allocator`, held in `load_balancer_task.rs`);
//! what it says the nodes serve turned into services beside the file's
//! (one per address and port: servers from the Service's EndpointSlices,
//! announced by ARP/NDP on `[kubernetes] interfaces`, elected by
//! membership), applied as a reload applies the file's; and the one node
//! that allocates, elected by membership too: [`ALLOCATOR`] is placed as
//! a VIP every node with the task can serve, so exactly one node answers
//! it at a time, fenced like any VIP, at no cost to the API server beyond
//! the membership Leases the nodes write anyway. `Local` Services'
//! `healthCheckNodePort`s are answered from here too.

use std::collections::{BTreeMap, HashSet};

use tracing::{info, warn};

use super::{
    external_sync::is_usable,
    load_balancer_task::{ALLOCATOR, services_of},
    owner::Daemon,
    service::Service,
};
use crate::{
    config,
    control::{LoadBalancerStatus, LoadBalancersStatus},
    loadbalancer::{Served, health_check::Health},
};

impl Daemon {
    /// Whether the service named `name` was made from a LoadBalancer
    /// Service (not from the file).
    pub(super) fn is_load_balancer(&self, name: &str) -> bool {
        self.load_balancers.as_ref().is_some_and(|t| t.names.contains(name))
    }

    /// The services the LoadBalancer Services ask for now, beside the
    /// file's `file`.
    pub(super) fn load_balancer_services(
        &mut self,
        file: &[config::Service],
    ) -> Vec<config::Service> {
        let settings = &self.config.settings;
        let Some(task) = &mut self.load_balancers else { return Vec::new() };
        let services =
            services_of(&task.served, &settings.load_balancers, &settings.node_name, file);
        task.names = services.iter().map(|s| s.name.clone()).collect();
        services
    }

    /// The task's word: serve what it says, beside the file's services.
    pub(super) fn on_served(&mut self, served: Vec<Served>) {
        let Some(task) = &mut self.load_balancers else { return };
        if task.served == served {
            return;
        }
        task.served.clone_from(&served);
        self.saved.load_balancers = served;
        self.workers.saver.save(self.saved.clone(), None);
        let mut wanted: Vec<config::Service> = self
            .services
            .iter()
            .filter(|s| !self.is_load_balancer(&s.config.name))
            .map(|s| s.config.clone())
            .collect();
        wanted.extend(self.load_balancer_services(&wanted));
        match self.apply_services(&wanted) {
            Ok(changed) if changed > 0 => info!(changed, "LoadBalancer Services applied"),
            Ok(_) => {}
            Err(e) => warn!("applying the LoadBalancer Services: {e:#}"),
        }
    }

    /// The LoadBalancer Services in `lb status`.
    pub(super) fn load_balancers_status(&self) -> Option<LoadBalancersStatus> {
        let task = self.load_balancers.as_ref()?;
        let pools = &self.config.settings.load_balancers.pools;
        let services = task
            .served
            .iter()
            .map(|served| LoadBalancerStatus {
                service: served.service.to_string(),
                addresses: served.addresses.clone(),
                pool: served
                    .addresses
                    .first()
                    .and_then(|&ip| pools.iter().find(|p| p.contains(ip)))
                    .map(|p| p.name.clone()),
                ports: served.ports.iter().map(|p| p.port).collect(),
                traffic_policy: if served.local { "Local" } else { "Cluster" }.to_owned(),
                served_as: made_from(&self.services, &task.names, served)
                    .map(|s| s.config.name.clone())
                    .collect(),
            })
            .collect();
        Some(LoadBalancersStatus { allocating: *task.leading.borrow(), services })
    }

    /// Answers each `Local` Service's `healthCheckNodePort` with its
    /// ready endpoints on this node: the most any of its services (one per
    /// address and port) has usable. Called with every sync of the
    /// external path (each second, and as servers change).
    pub(super) fn sync_health_checks(&mut self) {
        let Some(task) = &mut self.load_balancers else { return };
        let mut wanted = BTreeMap::new();
        for served in &task.served {
            let Some(port) = served.health_check_node_port else { continue };
            let local_endpoints = made_from(&self.services, &task.names, served)
                .map(|s| s.balancer.servers().iter().filter(|s| is_usable(s.state)).count())
                .max()
                .unwrap_or(0);
            wanted.insert(port, Health { service: served.service.clone(), local_endpoints });
        }
        task.health.set(wanted);
    }

    /// Whether the membership task should place [`ALLOCATOR`] too.
    pub(super) fn allocates(&self) -> bool {
        self.load_balancers.is_some()
    }

    /// The membership task's word on [`ALLOCATOR`]: this node allocates
    /// while it answers it.
    pub(super) fn set_leading(&self) {
        if let Some(task) = &self.load_balancers {
            let leads = self.answering.vips.contains(ALLOCATOR);
            task.leading.send_if_modified(|before| std::mem::replace(before, leads) != leads);
        }
    }
}

/// The running services made from `served` (one per address and port,
/// named `namespace/name@VIP`), among `services`; `names`: those made from
/// LoadBalancer Services at all (a file's service may share the prefix).
fn made_from<'a>(
    services: &'a [Service],
    names: &'a HashSet<String>,
    served: &Served,
) -> impl Iterator<Item = &'a Service> {
    let prefix = format!("{}@", served.service);
    services
        .iter()
        .filter(move |s| s.config.name.starts_with(&prefix) && names.contains(&s.config.name))
}
