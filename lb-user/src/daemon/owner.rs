//! The owner loop's state: the one value that holds every service and the
//! datapath. The rooms that act on it import it; it imports only the
//! parts it holds (`service`, `timers`, `census`, `close_worker`,
//! `saver`, `watch`, `external_state`) and the messages (`messages`).

use std::{collections::HashMap, net::SocketAddr, path::PathBuf};

use anyhow::Context as _;
use tokio::sync::mpsc;

use super::{
    census::Census,
    close_worker::Closer,
    external_state::External,
    messages::{After, Message},
    saver::Saver,
    service::Service,
    timers::Timers,
    watch::TableWatch,
};
use crate::{
    config, control::ReloadStatus, datapath::Datapath, discovery, election, metrics::Metrics,
    state::SavedState,
};

/// How `lb run` was started.
pub struct Options {
    /// The config file.
    pub config_path: PathBuf,
    /// Forward the kernel programs' debug log (`--bpf-log`).
    pub bpf_log: bool,
    /// Detach everything on SIGTERM/SIGINT instead of leaving the datapath
    /// working (fail-static).
    pub detach_on_exit: bool,
}

/// The owner loop's state: every service, the datapath, the channels.
pub(super) struct Daemon {
    /// The running config's `[daemon]` settings (the services are in
    /// `services`).
    pub(super) settings: config::Daemon,
    pub(super) config_path: PathBuf,
    /// The text the running config was read from: a reload parses only
    /// the service tables that changed since.
    pub(super) source: config::Source,
    pub(super) cgroup: PathBuf,
    pub(super) datapath: Datapath,
    /// In the config's order.
    pub(super) services: Vec<Service>,
    /// Where each service is in `services`, by name and by VIP: with
    /// thousands of services, every lookup (a kernel report, a check
    /// result, a request) must not walk them all.
    pub(super) by_name: HashMap<String, usize>,
    pub(super) by_vip: HashMap<SocketAddr, usize>,
    pub(super) saved: SavedState,
    pub(super) tx: mpsc::Sender<Message>,
    /// Where discovery tasks send their lists.
    pub(super) discovered: mpsc::Sender<discovery::Update>,
    /// Work that discovered lists call for, done once for a burst of them
    /// ([`Self::after_discovered`]).
    pub(super) after_discovery: After,
    /// When each balancer next needs its clock ([`Self::on_deadlines`]).
    pub(super) timers: Timers,
    pub(super) metrics: Metrics,
    pub(super) last_reload: Option<ReloadStatus>,
    /// Netlink SOCK_DESTROY works on this kernel (probed once at start).
    pub(super) sock_destroy: bool,
    /// lb may enter pods' network namespaces to close their connections
    /// (probed once at start: CAP_SYS_ADMIN, no seccomp filter against it).
    pub(super) close_in_pods: bool,
    /// Counts the socket tables for status and metrics, off this loop.
    pub(super) census: Census,
    /// Closes VIP connections, off this loop.
    pub(super) closer: Closer,
    /// Writes the state file, off this loop.
    pub(super) saver: Saver,
    /// `CLOCK_MONOTONIC` when this daemon started: kernel events from
    /// before (left in the ring buffer by a previous daemon) are history,
    /// not news; the kernel has already acted on them.
    pub(super) started_ns: u64,
    /// A full TCP socket table, logged from the tick.
    pub(super) table_watch: TableWatch,
    /// The external path's routes and interfaces ([`Self::sync_external`]).
    pub(super) external: External,
    /// The election of each leased service, by service name.
    pub(super) elections: HashMap<String, election::Election>,
    /// Where election tasks send their news.
    pub(super) election_updates: mpsc::Sender<election::Update>,
}

impl Daemon {
    pub(super) fn index(&self, name: &str) -> anyhow::Result<usize> {
        self.by_name.get(name).copied().with_context(|| format!("no service named {name:?}"))
    }

    /// Rebuilds `by_name` and `by_vip` after `services` changed shape.
    pub(super) fn reindex(&mut self) {
        self.by_name =
            self.services.iter().enumerate().map(|(i, s)| (s.config.name.clone(), i)).collect();
        self.by_vip = self.services.iter().enumerate().map(|(i, s)| (s.config.vip, i)).collect();
    }

    /// Names the service whose VIP `addr` is, for server-list checks.
    pub(super) fn vip_owner(&self, addr: SocketAddr) -> Option<String> {
        self.by_vip.get(&addr).map(|&i| format!("service {:?}", self.services[i].config.name))
    }
}
