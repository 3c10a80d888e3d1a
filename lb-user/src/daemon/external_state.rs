//! What the daemon keeps of the external path between two syncs
//! (`external_sync.rs`): the routes to the servers, the interfaces
//! `lb_xdp` runs on and why, and what is announced where.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::IpAddr,
    time::Instant,
};

use tokio::sync::watch;

use crate::{
    announce,
    datapath::{Announced, xdp::Mode},
    routes::Route,
};

/// What the daemon keeps of the external path between two syncs.
#[derive(Default)]
pub(super) struct External {
    /// The kernel's route to each server of a service with
    /// `[service.external]`, or why there is none.
    pub(super) routes: HashMap<IpAddr, Result<Route, String>>,
    /// Each server's NAT source addresses beside the route's own source
    /// (`[daemon] nat_addresses` that serve it), asked with its route.
    pub(super) sources: HashMap<IpAddr, Vec<IpAddr>>,
    /// When `routes` were last all asked again.
    pub(super) refreshed: Option<Instant>,
    /// The program's count of packets it could not route, as last read.
    pub(super) unrouted: u64,
    /// Each interface the program should run on: why, and how it went.
    pub(super) interfaces: BTreeMap<String, (Role, Result<Mode, String>)>,
    /// Whether the kernel forwards IPv4 and IPv6, as last read.
    pub(super) forwarding: Option<bool>,
    /// Whether the NAT ports are reserved from the node's own connections
    /// (`nat_ports`): done once, tried again at each sync until it is.
    pub(super) nat_ports_reserved: bool,
    /// The interfaces `lb_xdp` runs on, as the last sync found them: each
    /// one's index and MAC address.
    pub(super) links: HashMap<String, (u32, announce::Mac)>,
    /// The addresses announced now, on which interfaces.
    pub(super) announced: HashSet<Announced>,
    /// The same, for the repeated announcements (`tell_the_link`): one
    /// withdrawn meanwhile is not told again.
    pub(super) announced_now: watch::Sender<HashSet<Announced>>,
}

/// Why `lb_xdp` runs on an interface.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Role {
    /// A service lists it: clients' packets arrive there.
    pub(super) clients: bool,
    /// A server is reached through it: its replies arrive there.
    pub(super) servers: bool,
}

impl Role {
    pub(super) fn name(self) -> &'static str {
        match (self.clients, self.servers) {
            (true, true) => "clients, servers",
            (true, false) => "clients",
            _ => "servers",
        }
    }
}
