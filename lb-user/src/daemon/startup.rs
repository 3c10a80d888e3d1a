//! Start-up: the config to keep (parsed in another arena, memory tuned),
//! the server lists saved at runtime, the datapath opened (attached or
//! adopted), the owner loop's channels and helpers started.
//!
//! Adopting a running datapath is decided by [`adoptable`], over plain
//! values: a service whose servers are the kernel's keeps the kernel's
//! value until its own checks say otherwise.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    path::Path,
    time::Instant,
};

use anyhow::Context as _;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info, warn};

use super::{
    census::Census,
    close_worker::Closer,
    external_state::External,
    messages::{After, Message},
    owner::{Abilities, Daemon, Options, RunningConfig, Senders, Workers},
    saver::Saver,
    service::Service,
    service_table::ServiceTable,
    tasks::{forward_events, forward_kernel_logs},
    timers::Timers,
    watch::TableWatch,
};
use crate::{
    balancer::{KernelValue, Readiness},
    config::{self, Config},
    control,
    datapath::{self, AttachSettings, Datapath, VipEntry},
    discovery, election,
    health::Tls,
    metrics::{self, Metrics},
    netns, sock_destroy,
    state::{SavedList, SavedState},
};

/// A started daemon and the channels its owner loop reads.
pub(super) struct Started {
    pub(super) daemon: Daemon,
    pub(super) messages: mpsc::Receiver<Message>,
    pub(super) calls: mpsc::Receiver<control::Call>,
    pub(super) discoveries: mpsc::Receiver<discovery::Update>,
    pub(super) elections: mpsc::Receiver<election::Update>,
    pub(super) memberships: mpsc::Receiver<election::membership_task::Answering>,
    /// What the LoadBalancer Services ask the nodes to serve.
    pub(super) served: tokio::sync::watch::Receiver<Vec<crate::loadbalancer::Served>>,
    pub(super) scrapes: mpsc::Receiver<oneshot::Sender<String>>,
}

/// Loads the config, opens the datapath and starts everything the owner
/// loop needs; the first selections are in the kernel when it returns.
pub(super) async fn start(options: Options) -> anyhow::Result<Started> {
    let started_ns = datapath::monotonic_now_ns();
    tune_allocator();
    let (mut config, source) = load_config_to_keep(&options.config_path)?;
    // Before anything is attached.
    let mut tls = load_tls(&config.services)?;
    let cgroup = match &config.daemon.cgroup {
        Some(path) => path.clone(),
        None => datapath::cgroup2_root()?,
    };
    let socket_path = config.daemon.control_socket.clone();
    // Bind first: a second daemon for the same config fails here, before it
    // touches the datapath the first one owns.
    let listener = control::bind(&socket_path).await?;

    let saved = SavedState::load(&config.daemon.state_dir);
    // The LoadBalancer Services' services the last daemon served, served
    // again from the start (with their saved lists, below).
    let resumed = super::load_balancer_task::resume(&config.daemon, &config.services, &saved);
    config.services.extend(resumed.services.iter().cloned());
    let now = Instant::now();
    // The lists set at runtime or discovered (state file), checked against
    // every VIP; cloned, so that the config's services can be moved into
    // the daemon's (a copy of each would double the daemon's memory).
    let restored: Vec<Option<SavedList>> = {
        let vips: HashMap<SocketAddr, &str> =
            config.services.iter().map(|s| (s.vip, s.name.as_str())).collect();
        config.services.iter().map(|s| saved_list(&saved, &vips, s).cloned()).collect()
    };
    let Config { daemon: settings, services: configured } = config;
    let mut services = Vec::with_capacity(configured.len());
    let mut discovered_at = HashMap::new();
    for (service, restored) in configured.into_iter().zip(restored) {
        let (list, default) = restored.as_ref().map_or_else(
            || (service.servers.clone(), service.default),
            |s| (s.servers.clone(), s.default),
        );
        let tls = tls.remove(&service.name).unwrap_or_default();
        let name = service.name.clone();
        // Its first value goes into the kernel with `initial` below.
        let (mut new, _) = Service::new(service, tls, &list, default, now);
        if let Some(restored) = restored {
            // A discovered list comes back as it was: drained endpoints
            // stay drained until the source says otherwise.
            for &addr in &restored.drained {
                new.balancer.set_readiness(addr, Readiness::Serving, now);
            }
            if let Some(at) = restored.discovered_at {
                discovered_at.insert(name, at);
            }
        }
        services.push(new);
    }
    drop(tls);
    let initial: Vec<VipEntry> = services.iter().map(Service::entry).collect();

    let mut datapath = match Datapath::open(
        &settings.bpffs,
        &cgroup,
        &initial,
        AttachSettings {
            socket_table: settings.socket_table,
            flow_table: settings.flow_table,
            xdp: datapath::XdpLimits {
                new_flows_per_cpu: settings.new_flows_per_cpu,
                nat_ports: (*settings.nat_ports.start(), *settings.nat_ports.end()),
            },
        },
        options.bpf_log,
    ) {
        Ok(datapath) => datapath,
        Err(e) => {
            // E.g. another daemon holds these pins: leave no socket file
            // behind that looks like ours.
            drop(listener);
            let _ = std::fs::remove_file(&socket_path);
            return Err(e);
        }
    };
    let (tx, messages) = mpsc::channel(4096);
    if let Some(events) = datapath.take_events() {
        tokio::spawn(forward_events(events, tx.clone()));
    }
    if let Some(logger) = datapath.take_logger() {
        tokio::spawn(forward_kernel_logs(logger));
    }
    let (calls_tx, calls) = mpsc::channel(64);
    let (discovered, discoveries) = mpsc::channel(64);
    let (election_updates, elections) = mpsc::channel(64);
    let (membership, memberships) = mpsc::channel(64);
    tokio::spawn(control::serve(listener, calls_tx));
    let (scrape_tx, scrapes) = mpsc::channel(16);
    if let Some(addr) = settings.metrics {
        metrics::serve(addr, metrics::Limits::default(), scrape_tx).await?;
    }

    let sock_destroy = sock_destroy::supported();
    if !sock_destroy {
        warn!(
            "this kernel cannot destroy sockets (CONFIG_INET_DIAG_DESTROY, or the tcp_diag module): connections that must move are left to end on their own"
        );
    }
    let close_in_pods = netns::can_enter();
    if !close_in_pods && services.iter().any(|s| s.config.scope == config::Scope::All) {
        warn!(
            "lb may not enter other network namespaces (it lacks CAP_SYS_ADMIN, or setns is filtered): connections that pods make through scope = \"all\" VIPs are not closed on failover; see the README's Requirements"
        );
    }
    let saver =
        Saver::start(settings.state_dir.clone()).context("starting the state file's writer")?;
    let closer = Closer::start(datapath.maps().socket_tables(), tx.clone())
        .context("starting the closing thread")?;
    let census = Census::start(&settings.bpffs).context("starting the census thread")?;
    let table_watch = TableWatch::new(datapath.maps().untracked_connects());
    let mut daemon = Daemon {
        config: RunningConfig { settings, path: options.config_path, source, cgroup },
        datapath,
        services: ServiceTable::new(services),
        saved,
        senders: Senders { owner: tx, discovered, elections: election_updates, membership },
        metrics: Metrics::new(),
        last_reload: None,
        kernel: Abilities { sock_destroy, close_in_pods },
        workers: Workers { census, closer, saver },
        started_ns,
        after_discovery: After::default(),
        timers: Timers::default(),
        table_watch,
        external: External::default(),
        elections: HashMap::new(),
        membership: None,
        answering: Default::default(),
        membership_ended: false,
        load_balancers: None,
        bgp: None,
    };
    daemon.bgp = daemon
        .config
        .settings
        .bgp
        .clone()
        .map(|bgp| crate::bgp::Speaker::new(bgp, &daemon.config.settings.state_dir));
    let reach =
        super::elections::reach(&daemon.services, daemon.config.settings.kubeconfig.clone());
    let (load_balancers, served) =
        super::load_balancer_task::start(&daemon.config.settings, reach, resumed);
    daemon.load_balancers = load_balancers;
    for i in 0..daemon.services.len() {
        daemon.service_appeared(i);
        let service = &daemon.services[i];
        daemon.timers.set(&service.config.name, service.balancer.next_deadline());
    }
    if daemon.datapath.adopted {
        daemon.adopt();
    }
    for i in 0..daemon.services.len() {
        daemon.start_discovery(i);
        let service = &mut daemon.services[i];
        if let (Some(discovery), Some(&at)) =
            (&mut service.discovery, discovered_at.get(&service.config.name))
        {
            discovery.status.last_success = Some(at);
        }
    }
    release_freed_memory();
    // systemd (Type=notify): ready once the datapath is attached and the
    // first selections are written. A no-op outside systemd.
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    info!(
        services = daemon.services.len(),
        adopted = daemon.datapath.adopted,
        control_socket = %socket_path.display(),
        "lb is running"
    );
    Ok(Started { daemon, messages, calls, discoveries, elections, memberships, served, scrapes })
}

/// Whether a service adopts the value the kernel holds for its VIP
/// (`kernel`) instead of its own fresh one (`ours`): when the kernel's
/// selection has exactly our servers. Then a restart during an outage does
/// not send connects back to the server that is down.
pub(super) fn adoptable(ours: &KernelValue, kernel: Option<KernelValue>) -> Option<KernelValue> {
    let kernel = kernel?;
    let theirs: HashSet<SocketAddr> = kernel.selection.servers.iter().copied().collect();
    let ours: HashSet<SocketAddr> = ours.selection.servers.iter().copied().collect();
    (!theirs.is_empty() && theirs == ours).then_some(kernel)
}

impl Daemon {
    /// Starts from what the kernel of an adopted datapath holds: a service
    /// whose servers are the same ([`adoptable`]) keeps the kernel's value
    /// (and its failure marks make those servers suspect, checked at once)
    /// until this daemon's own checks say otherwise; the others get their
    /// new value.
    fn adopt(&mut self) {
        for i in 0..self.services.len() {
            let service = &self.services[i];
            let ours = service.balancer.kernel_value();
            let Some(kernel) =
                adoptable(&ours, self.datapath.maps().kernel_value(service.config.vip))
            else {
                continue;
            };
            let hold_down = service.config.hold_down;
            let failed: Vec<SocketAddr> = kernel
                .selection
                .servers
                .iter()
                .copied()
                .filter(|s| self.datapath.maps().recently_failed(*s, hold_down))
                .collect();
            info!(service = %service.config.name, selection = ?kernel.selection.servers, recently_failed = ?failed, "adopted the kernel's selection");
            let effects = self.services[i].balancer.adopt(
                kernel.selection,
                &kernel.states,
                &failed,
                Instant::now(),
            );
            self.apply(i, effects);
        }
        let entries: Vec<VipEntry> = self.services.iter().map(Service::entry).collect();
        if let Err(e) = self.datapath.reconcile(&entries) {
            error!("writing the selections of the adopted datapath failed: {e:#}");
        }
    }
}

/// Reads the TLS files of `services` (at start every service; at a reload
/// the ones whose checks start or restart), so that what only shows when
/// the files are read (a missing CA bundle, a key that does not parse)
/// fails the start or the reload instead of leaving servers unchecked.
pub(super) fn load_tls<'a>(
    services: impl IntoIterator<Item = &'a config::Service>,
) -> anyhow::Result<HashMap<String, Tls>> {
    services
        .into_iter()
        .map(|s| {
            Ok((
                s.name.clone(),
                Tls::load(&s.health).with_context(|| format!("service {:?}", s.name))?,
            ))
        })
        .collect()
}

/// The list set at runtime for `service` (state file), if it was saved
/// against the same configured list and still passes the checks every
/// server list must pass. A saved list that fails them is reported loudly
/// and the config's list is used.
fn saved_list<'a>(
    saved: &'a SavedState,
    vips: &HashMap<SocketAddr, &str>,
    service: &config::Service,
) -> Option<&'a SavedList> {
    let list = saved.list_for(&service.name, &service.servers, service.default)?;
    match config::validate_servers(service.vip, &list.servers, list.default, |addr| {
        vips.get(&addr).map(|name| format!("service {name:?}"))
    }) {
        Ok(()) => {
            info!(service = %service.name, servers = ?list.servers, "using the server list set at runtime or discovered (state file)");
            Some(list)
        }
        Err(problems) => {
            error!(service = %service.name, "ignoring the server list in the state file, using the config's: {problems}");
            None
        }
    }
}

/// Sets the allocator up for a daemon whose peak is parsing its config.
///
/// Large blocks (the parser's token list, the service table) come from
/// mmap and go back to the system when freed. glibc's default raises this
/// threshold after the first large free, so the next parser's token list
/// (17 MB for 10,000 services) would land in the heap.
///
/// No fastbins: a small block freed into one is merged into the free space
/// at the top of its heap only later, by `malloc_trim` itself, which then
/// does not give that space back for a thread's heap (the parser's).
/// Depending on which block happened to be freed last, the parser's 20 MB
/// stayed resident after one start or reload and not after another (RSS
/// with 10,000 services: 25 or 46 MB). Freed blocks are merged at once
/// instead, and the heap shrinks as they are.
fn tune_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: sets allocator parameters; valid at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_MXFAST, 0);
    }
}

/// Parses the config (`parse`: [`config::Source::load`] or
/// [`config::Source::reload`]) on a thread of its own, so in another
/// allocator arena than the owner loop's. Parsing is the daemon's peak:
/// with 10,000 services `toml` allocates about 40 MB of small temporaries,
/// which would otherwise be interleaved with the daemon's long-lived
/// allocations and keep thousands of mostly free pages resident. What it
/// returns still lives in that arena; see [`load_config_to_keep`]. The
/// caller releases the freed memory ([`release_freed_memory`]) when it is
/// done with the config: a reload does so after the kernel has the change.
pub(super) fn parse_config<T: Send>(parse: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| scope.spawn(parse).join())
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// [`parse_config`] for a config the daemon keeps (the one it starts with):
/// copied into the owner loop's arena and the parsed original freed, so
/// that its strings do not pin the parser's arena either. With 10,000
/// services: RSS 29 MB after start-up instead of 42 (and 102 before the
/// metrics kept their per-server series as numbers).
fn load_config_to_keep(path: &Path) -> Result<(Config, config::Source), config::ConfigError> {
    let parsed = parse_config(|| config::Source::load(path))?;
    let kept = parsed.clone();
    drop(parsed);
    release_freed_memory();
    Ok(kept)
}

/// Gives the memory freed since the last call back to the system (glibc
/// keeps freed pages mapped until asked).
pub(super) fn release_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free pages of the allocator's own
    // arenas to the kernel; it is safe to call at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balancer::Selection;

    fn value(servers: &[u8], states: &[u8]) -> KernelValue {
        KernelValue {
            selection: Selection {
                servers: servers.iter().map(|n| SocketAddr::from(([127, 10, 0, *n], 80))).collect(),
                spread: 1,
            },
            states: states.to_vec(),
        }
    }

    #[test]
    fn the_kernels_value_is_adopted_only_for_the_same_servers() {
        let ours = value(&[1, 2], &[0, 0]);
        let kernel = value(&[2, 1], &[7, 5]);
        assert_eq!(adoptable(&ours, Some(kernel.clone())), Some(kernel), "same set, other order");
        assert_eq!(adoptable(&ours, Some(value(&[1], &[7]))), None, "a server less");
        assert_eq!(adoptable(&ours, Some(value(&[1, 2, 3], &[7, 5, 5]))), None, "a server more");
        assert_eq!(adoptable(&ours, None), None, "nothing in the kernel");
        assert_eq!(adoptable(&value(&[], &[]), Some(value(&[], &[]))), None, "no servers");
    }
}
