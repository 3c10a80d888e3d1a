//! The owner loop's state: the one value that holds every service and the
//! datapath. The rooms that act on it import it; it imports only the
//! parts it holds (`service`, `timers`, `census`, `close_worker`,
//! `saver`, `watch`, `external_state`, `load_balancer_task`) and the messages
//! (`messages`).

use std::{collections::HashMap, path::PathBuf};

use tokio::sync::mpsc;

use super::{
    census::Census,
    close_worker::Closer,
    external_state::External,
    load_balancer_task::LoadBalancerTask,
    messages::{After, Message},
    saver::Saver,
    service_table::ServiceTable,
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
/// Grouped in parts, so that what a room touches shows in which parts it
/// names.
pub(super) struct Daemon {
    /// What the daemon was started with.
    pub(super) config: RunningConfig,
    pub(super) datapath: Datapath,
    pub(super) services: ServiceTable,
    pub(super) saved: SavedState,
    /// Where background work reports to.
    pub(super) senders: Senders,
    /// Work that discovered lists call for, done once for a burst of them
    /// ([`Self::after_discovered`]).
    pub(super) after_discovery: After,
    /// When each balancer next needs its clock ([`Self::on_deadlines`]).
    pub(super) timers: Timers,
    pub(super) metrics: Metrics,
    pub(super) last_reload: Option<ReloadStatus>,
    /// What this kernel and these privileges allow, probed once at start.
    pub(super) kernel: Abilities,
    /// The work done off this loop.
    pub(super) workers: Workers,
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
    /// The elections by membership, while a service elects
    /// (`membership.rs`).
    pub(super) membership: Option<election::membership_task::Membership>,
    /// What the membership task last said this node answers.
    pub(super) answering: election::membership_task::Answering,
    /// The daemon is stopping: no membership task starts again.
    pub(super) membership_ended: bool,
    /// The LoadBalancer Services' task, when the config has pools
    /// (`load_balancers.rs`).
    pub(super) load_balancers: Option<LoadBalancerTask>,
    /// The BGP speaker, when the config has `[bgp]` (`crate::bgp`).
    pub(super) bgp: Option<crate::bgp::Speaker>,
}

/// The running config's daemon side (the services are in
/// [`Daemon::services`]).
pub(super) struct RunningConfig {
    /// Its `[daemon]` settings.
    pub(super) settings: config::Daemon,
    pub(super) path: PathBuf,
    /// The text it was read from: a reload parses only the service tables
    /// that changed since.
    pub(super) source: config::Source,
    /// The cgroup the programs are attached to.
    pub(super) cgroup: PathBuf,
}

/// The channels background work reports to the owner loop on.
pub(super) struct Senders {
    /// Kernel reports, health results, finished closes.
    pub(super) owner: mpsc::Sender<Message>,
    /// Where discovery tasks send their lists.
    pub(super) discovered: mpsc::Sender<discovery::Update>,
    /// Where election tasks send their news.
    pub(super) elections: mpsc::Sender<election::Update>,
    /// Where the membership task says what the node answers.
    pub(super) membership: mpsc::Sender<election::membership_task::Answering>,
}

/// What this kernel and these privileges allow.
pub(super) struct Abilities {
    /// Netlink SOCK_DESTROY works on this kernel.
    pub(super) sock_destroy: bool,
    /// lb may enter pods' network namespaces to close their connections
    /// (CAP_SYS_ADMIN, no seccomp filter against it).
    pub(super) close_in_pods: bool,
}

/// The threads that work off the owner loop.
pub(super) struct Workers {
    /// Counts the socket tables for status and metrics.
    pub(super) census: Census,
    /// Closes VIP connections.
    pub(super) closer: Closer,
    /// Writes the state file.
    pub(super) saver: Saver,
}
