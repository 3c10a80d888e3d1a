//! The daemon's services, in the config's order, with where each is by
//! name and by VIP: with thousands of services, every lookup (a kernel
//! report, a check result, a request) must not walk them all. Reads go
//! through the list (`Deref`); a change of its shape reindexes.

use std::{
    collections::HashMap,
    net::SocketAddr,
    ops::{Deref, DerefMut},
};

use anyhow::Context as _;

use super::service::Service;

/// Every service, and its index by name and by VIP.
pub(super) struct ServiceTable {
    /// In the config's order.
    pub(super) list: Vec<Service>,
    pub(super) by_name: HashMap<String, usize>,
    pub(super) by_vip: HashMap<SocketAddr, usize>,
}

impl ServiceTable {
    pub(super) fn new(list: Vec<Service>) -> Self {
        let mut table = Self { list, by_name: HashMap::new(), by_vip: HashMap::new() };
        table.reindex();
        table
    }

    /// Where the service named `name` is.
    pub(super) fn index(&self, name: &str) -> anyhow::Result<usize> {
        self.by_name.get(name).copied().with_context(|| format!("no service named {name:?}"))
    }

    /// Rebuilds `by_name` and `by_vip` after `list` changed shape.
    pub(super) fn reindex(&mut self) {
        self.by_name =
            self.list.iter().enumerate().map(|(i, s)| (s.config.name.clone(), i)).collect();
        self.by_vip = self.list.iter().enumerate().map(|(i, s)| (s.config.vip, i)).collect();
    }

    /// Adds `service` at the end.
    pub(super) fn push(&mut self, service: Service) {
        let i = self.list.len();
        self.by_name.insert(service.config.name.clone(), i);
        self.by_vip.insert(service.config.vip, i);
        self.list.push(service);
    }

    /// Names the service whose VIP `addr` is, for server-list checks.
    pub(super) fn vip_owner(&self, addr: SocketAddr) -> Option<String> {
        self.by_vip.get(&addr).map(|&i| format!("service {:?}", self.list[i].config.name))
    }
}

impl Deref for ServiceTable {
    type Target = [Service];

    fn deref(&self) -> &[Service] {
        &self.list
    }
}

impl DerefMut for ServiceTable {
    fn deref_mut(&mut self) -> &mut [Service] {
        &mut self.list
    }
}
