//! `lb run`: the daemon's owner loop. One task owns every service's
//! balancer and the datapath, and is the only writer of the maps; kernel
//! reports, health results, control requests, timers and signals reach it
//! as messages, and it carries out the balancers' effects.
//!
//! What it decides with lives elsewhere: the state machine in `balancer`,
//! what a reload changes in `reload`, the status view in `status`, the
//! socket protocol in `control`.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use aya::maps::{MapData, RingBuf};
use lb_common::{Event, EventKind};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
    sync::{Notify, mpsc, oneshot, watch},
    task::JoinHandle,
};
use tracing::{debug, error, info, warn};

use crate::{
    balancer::{
        Balancer, Checks, CloseReason, Connection, Effect, Health, Readiness, Selection, State,
    },
    config::{self, CheckKind, Config},
    control::{
        self, ConfigStatus, DatapathStatus, DiscoveryStatus, Features, ReloadStatus, Request,
        Response, Status, TrackedSockets,
    },
    datapath::{self, Datapath, VipEntry},
    discovery,
    health::{Checker, Tls},
    metrics::{self, DiscoveryLabels, Metrics, ResultLabels, ServiceLabels, server_labels},
    reload::{self, Change},
    sock_destroy,
    state::{SavedList, SavedState},
    status::{self, KernelView},
};

/// What reaches the owner task from the kernel, the health checks and its
/// own background work. (Control requests come on their own channel, as
/// `control::Call`s.)
enum Message {
    Kernel(Event),
    Health {
        service: String,
        server: SocketAddr,
        result: Health,
        took: Duration,
    },
    /// A batch of VIP connections was closed in the background.
    Closed {
        why: Closing,
        result: Result<Closed, String>,
    },
}

/// How many VIP connections were closed, per (VIP, server).
type Closed = BTreeMap<(SocketAddr, SocketAddr), u64>;

/// Why a batch of VIP connections is closed: what to log and count when
/// the closing is done.
enum Closing {
    /// One step of a service's balancer moved traffic off these servers.
    Balancer { service: String, vip: SocketAddr, servers: Vec<(SocketAddr, CloseReason)> },
    /// `lb close-connections`: the client waits for the total.
    Manual { server: SocketAddr, reply: oneshot::Sender<Response> },
    /// A reload removed these VIPs.
    RemovedVips,
}

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

/// The health check task of one server.
struct CheckTask {
    task: JoinHandle<()>,
    /// Wakes the task for a check out of turn ([`Effect::CheckNow`]).
    now: Arc<Notify>,
}

/// The discovery task of one service and what it last said.
struct Discovery {
    task: JoinHandle<()>,
    /// The service's selection, best first, for the task to reconnect
    /// through (a watch of the apiservers goes through a usable one).
    usable: watch::Sender<Vec<SocketAddr>>,
    status: DiscoveryStatus,
}

/// What applied discovered lists left to do ([`Daemon::after_discovered`]).
#[derive(Default)]
struct AfterDiscovery {
    /// A list changed: write the state file.
    save: bool,
    /// A server left: clean the kernel's maps of it.
    forget: bool,
}

/// One service: its config, its state machine, its health check tasks and
/// its discovery task.
struct Service {
    config: config::Service,
    /// The TLS files of its checks, read once (start or reload).
    tls: Tls,
    balancer: Balancer,
    checks: HashMap<SocketAddr, CheckTask>,
    /// Boxed: most services have none.
    discovery: Option<Box<Discovery>>,
}

impl Service {
    fn new(
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

    /// The kernel's value for this service: its selection now.
    fn entry(&self) -> VipEntry {
        self.entry_for(self.balancer.selection())
    }

    fn entry_for(&self, selection: Selection) -> VipEntry {
        let states = self.balancer.state_codes(&selection.servers);
        VipEntry {
            vip: self.config.vip,
            selection,
            hold_down: self.config.hold_down,
            scope: self.config.scope,
            states,
        }
    }

    fn stop_checks(&mut self) {
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

/// Why the owner loop ended.
enum Exit {
    Signal(&'static str),
    /// `lb detach` (or a control client) asked; answered once the daemon
    /// has done what exiting means.
    Requested(oneshot::Sender<Response>),
}

struct Daemon {
    /// The running config's `[daemon]` settings (the services are in
    /// `services`).
    settings: config::Daemon,
    config_path: PathBuf,
    /// The text the running config was read from: a reload parses only
    /// the service tables that changed since.
    source: config::Source,
    cgroup: PathBuf,
    datapath: Datapath,
    /// In the config's order.
    services: Vec<Service>,
    /// Where each service is in `services`, by name and by VIP: with
    /// thousands of services, every lookup (a kernel report, a check
    /// result, a request) must not walk them all.
    by_name: HashMap<String, usize>,
    by_vip: HashMap<SocketAddr, usize>,
    saved: SavedState,
    tx: mpsc::Sender<Message>,
    /// Where discovery tasks send their lists.
    discovered: mpsc::Sender<discovery::Update>,
    /// Work that discovered lists call for, done once for a burst of them
    /// ([`Self::after_discovered`]).
    after_discovery: AfterDiscovery,
    metrics: Metrics,
    last_reload: Option<ReloadStatus>,
    /// Netlink SOCK_DESTROY works on this kernel (probed once at start).
    sock_destroy: bool,
    /// `CLOCK_MONOTONIC` when this daemon started: kernel events from
    /// before (left in the ring buffer by a previous daemon) are history,
    /// not news; the kernel has already acted on them.
    started_ns: u64,
}

/// Reads the TLS files of `services` (at start every service; at a reload
/// the ones whose checks start or restart), so that what only shows when
/// the files are read (a missing CA bundle, a key that does not parse)
/// fails the start or the reload instead of leaving servers unchecked.
fn load_tls<'a>(
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

/// Parses the config (`parse`: [`config::Source::load`] or
/// [`config::Source::reload`]) on a thread of its own, so in another
/// allocator arena than the owner loop's. Parsing is the daemon's peak:
/// with 10,000 services `toml` allocates about 40 MB of small temporaries,
/// which would otherwise be interleaved with the daemon's long-lived
/// allocations and keep thousands of mostly free pages resident. What it
/// returns still lives in that arena; see [`load_config_to_keep`]. The
/// caller releases the freed memory ([`release_freed_memory`]) when it is
/// done with the config: a reload does so after the kernel has the change.
fn parse_config<T: Send>(parse: impl FnOnce() -> T + Send) -> T {
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
fn release_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free pages of the allocator's own
    // arenas to the kernel; it is safe to call at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn checks_of(service: &config::Service) -> Checks {
    Checks {
        rise: service.health.rise,
        fall: service.health.fall,
        passive_only: service.health.check == CheckKind::None,
    }
}

/// The kernel as one `lb status` reads it: selections and live counts by
/// lookup, the failure marks in one pass taken at the start (`FAILED_AT`
/// holds only the marked servers, so that is a few reads instead of one per
/// server of every service).
struct KernelSnapshot<'a> {
    datapath: &'a Datapath,
    failure_times: HashMap<SocketAddr, u64>,
    now_ns: u64,
}

impl<'a> KernelSnapshot<'a> {
    fn of(datapath: &'a Datapath) -> Self {
        Self {
            datapath,
            failure_times: datapath.failure_times(),
            now_ns: datapath::monotonic_now_ns(),
        }
    }
}

impl KernelView for KernelSnapshot<'_> {
    fn selection(&self, vip: SocketAddr) -> Vec<SocketAddr> {
        self.datapath.selection(vip)
    }
    fn connections(&self, vip: SocketAddr, server: SocketAddr) -> i64 {
        self.datapath.connections(vip, server)
    }
    fn recently_failed(&self, server: SocketAddr, hold_down: Duration) -> bool {
        self.failure_times
            .get(&server)
            .is_some_and(|&at| datapath::failed_within(at, self.now_ns, hold_down))
    }
}

/// Runs the daemon until SIGTERM/SIGINT or a shutdown request. The datapath
/// stays pinned and working after it returns (fail-static) unless
/// `detach_on_exit`.
pub async fn run(options: Options) -> anyhow::Result<()> {
    let started_ns = datapath::monotonic_now_ns();
    // Large blocks (the parser's token list, the service table) come from
    // mmap and go back to the system when freed. glibc's default raises
    // this threshold after the first large free, so the next parser's
    // token list (17 MB for 10,000 services) would land in the heap.
    //
    // No fastbins: a small block freed into one is merged into the free
    // space at the top of its heap only later, by `malloc_trim` itself,
    // which then does not give that space back for a thread's heap (the
    // parser's). Depending on which block happened to be freed last, the
    // parser's 20 MB stayed resident after one start or reload and not
    // after another (RSS with 10,000 services: 25 or 46 MB). Freed blocks
    // are merged at once instead, and the heap shrinks as they are.
    #[cfg(target_env = "gnu")]
    // SAFETY: sets allocator parameters; valid at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_MXFAST, 0);
    }
    let (config, source) = load_config_to_keep(&options.config_path)?;
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

    let bpffs = settings.bpffs.clone();
    let mut datapath = match Datapath::open(&bpffs, &cgroup, &initial, options.bpf_log) {
        Ok(datapath) => datapath,
        Err(e) => {
            // E.g. another daemon holds these pins: leave no socket file
            // behind that looks like ours.
            drop(listener);
            let _ = std::fs::remove_file(&socket_path);
            return Err(e);
        }
    };
    let (tx, mut rx) = mpsc::channel(4096);
    if let Some(events) = datapath.take_events() {
        tokio::spawn(forward_events(events, tx.clone()));
    }
    if let Some(logger) = datapath.take_logger() {
        tokio::spawn(forward_kernel_logs(logger));
    }
    let (calls_tx, mut calls) = mpsc::channel(64);
    let (discovered, mut discoveries) = mpsc::channel(64);
    tokio::spawn(control::serve(listener, calls_tx));
    let (scrape_tx, mut scrapes) = mpsc::channel(16);
    if let Some(addr) = settings.metrics {
        metrics::serve(addr, metrics::Limits::default(), scrape_tx).await?;
    }

    let sock_destroy = sock_destroy::supported();
    if !sock_destroy {
        warn!(
            "this kernel cannot destroy sockets (CONFIG_INET_DIAG_DESTROY, or the tcp_diag module): connections that must move are left to end on their own"
        );
    }
    let metrics = Metrics::new();
    let mut daemon = Daemon {
        settings,
        config_path: options.config_path,
        source,
        cgroup,
        datapath,
        services,
        saved,
        tx,
        metrics,
        last_reload: None,
        sock_destroy,
        started_ns,
        discovered,
        after_discovery: AfterDiscovery::default(),
        by_name: HashMap::new(),
        by_vip: HashMap::new(),
    };
    daemon.reindex();
    for i in 0..daemon.services.len() {
        daemon.service_appeared(i);
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

    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut hangup = signal(SignalKind::hangup())?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    // systemd's WatchdogSec: pinged from the owner loop's tick, so a loop
    // that stops turning (not only a dead process) gets the daemon restarted.
    let watchdog = sd_notify::watchdog_enabled();
    if let Some(every) = watchdog {
        info!(?every, "systemd watchdog enabled; pinging every second");
    }
    let exit = loop {
        tokio::select! {
            _ = terminate.recv() => break Exit::Signal("SIGTERM"),
            _ = interrupt.recv() => break Exit::Signal("SIGINT"),
            _ = hangup.recv() => { let _ = daemon.reload(); }
            Some(scrape) = scrapes.recv() => { let _ = scrape.send(daemon.scrape()); }
            _ = tick.tick() => {
                daemon.on_tick(Instant::now());
                if watchdog.is_some() {
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                }
            }
            Some((request, reply)) = calls.recv() => match request {
                Request::Shutdown => break Exit::Requested(reply),
                Request::CloseConnections { server, service } => daemon.close_connections(server, service.as_deref(), reply),
                request => { let _ = reply.send(daemon.handle(request)); }
            },
            Some(update) = discoveries.recv() => {
                // A burst (1,000 services changed at once) is applied in
                // one go, then saved and cleaned up once.
                daemon.on_discovered(update);
                while let Ok(update) = discoveries.try_recv() {
                    daemon.on_discovered(update);
                }
                daemon.after_discovered();
            }
            Some(message) = rx.recv() => match message {
                Message::Kernel(event) => daemon.on_kernel_event(&event),
                Message::Health { service, server, result, took } => daemon.on_health(&service, server, result, took),
                Message::Closed { why, result } => daemon.on_closed(why, result),
            },
        }
    };
    // The same way out for a signal and a request: tell systemd, free the
    // socket path, detach if asked, and only then answer the requester.
    match &exit {
        Exit::Signal(name) => info!("{name}: exiting"),
        Exit::Requested(_) => info!("shutdown requested: exiting"),
    }
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    let _ = std::fs::remove_file(&socket_path);
    drop(daemon);
    if options.detach_on_exit {
        let removed = datapath::detach(&bpffs)?;
        info!(pins = removed.len(), "--detach-on-exit: detached everything");
    } else {
        info!("the datapath stays attached and keeps serving the last selections");
    }
    if let Exit::Requested(reply) = exit {
        let _ = reply.send(Response::Ok);
    }
    Ok(())
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

impl Daemon {
    /// Starts from what the kernel of an adopted datapath holds: a service
    /// whose servers are the same keeps the kernel's selection (and its
    /// failure marks make those servers suspect, checked at once) until
    /// this daemon's own checks say otherwise; the others get their new
    /// selection. So a restart during an outage does not send connects back
    /// to the server that is down.
    fn adopt(&mut self) {
        let mut entries = Vec::with_capacity(self.services.len());
        for i in 0..self.services.len() {
            let service = &mut self.services[i];
            let mut entry = service.entry();
            let kernel = self.datapath.selection(entry.vip);
            let same: HashSet<SocketAddr> = kernel.iter().copied().collect();
            let ours: HashSet<SocketAddr> = entry.selection.servers.iter().copied().collect();
            if !kernel.is_empty() && same == ours {
                let failed: Vec<SocketAddr> = kernel
                    .iter()
                    .copied()
                    .filter(|s| self.datapath.recently_failed(*s, service.config.hold_down))
                    .collect();
                info!(service = %service.config.name, selection = ?kernel, recently_failed = ?failed, "adopted the kernel's selection");
                entry.selection.servers = kernel;
                entry.selection.spread = self.datapath.spread(entry.vip);
                let states = self.datapath.daemon_states(entry.vip);
                let effects = service.balancer.adopt(
                    entry.selection.clone(),
                    &states,
                    &failed,
                    Instant::now(),
                );
                entry.states = states;
                entries.push(entry);
                self.apply(i, effects);
            } else {
                entries.push(entry);
            }
        }
        if let Err(e) = self.datapath.reconcile(&entries) {
            error!("writing the selections of the adopted datapath failed: {e:#}");
        }
    }

    fn index(&self, name: &str) -> anyhow::Result<usize> {
        self.by_name.get(name).copied().with_context(|| format!("no service named {name:?}"))
    }

    /// Rebuilds `by_name` and `by_vip` after `services` changed shape.
    fn reindex(&mut self) {
        self.by_name =
            self.services.iter().enumerate().map(|(i, s)| (s.config.name.clone(), i)).collect();
        self.by_vip = self.services.iter().enumerate().map(|(i, s)| (s.config.vip, i)).collect();
    }

    /// Names the service whose VIP `addr` is, for server-list checks.
    fn vip_owner(&self, addr: SocketAddr) -> Option<String> {
        self.by_vip.get(&addr).map(|&i| format!("service {:?}", self.services[i].config.name))
    }

    /// Metrics and checks for service `i`, new to this daemon.
    fn service_appeared(&mut self, i: usize) {
        let service = &self.services[i];
        for server in service.balancer.servers() {
            self.metrics.server_appeared(&service.config.name, server.addr, server.state);
        }
        self.sync_checks(i);
    }

    /// Carries out a balancer's effects for service `i`.
    fn apply(&mut self, i: usize, effects: Vec<Effect>) {
        let changed_servers = effects.iter().any(|e| matches!(e, Effect::StateChanged { .. }));
        let mut closes = Vec::new();
        for effect in effects {
            let service = &self.services[i];
            let name = &service.config.name;
            match effect {
                Effect::StateChanged { server, from, to, why } => {
                    info!(service = %name, %server, %from, %to, "server {from} -> {to}: {why}");
                    if to == State::Invalid {
                        self.metrics.server_left(name, server, Instant::now());
                    } else {
                        if from == State::Invalid {
                            self.metrics.server_appeared(name, server, to);
                        } else {
                            self.metrics.set_state(name, server, to);
                        }
                    }
                }
                Effect::WriteSelection(selection) => {
                    if let Some(discovery) = &service.discovery {
                        discovery.usable.send_replace(selection.servers.clone());
                    }
                    let entry = service.entry_for(selection);
                    match self.datapath.write(&entry) {
                        Ok(()) => {
                            info!(service = %name, selection = ?entry.selection.servers, spread = entry.selection.spread, "selection written");
                            self.metrics
                                .selection_changes
                                .get_or_create(&ServiceLabels { service: name.clone() })
                                .inc();
                        }
                        Err(e) => error!(service = %name, "writing the selection failed: {e:#}"),
                    }
                }
                Effect::CloseConnections { server, reason } => closes.push((server, reason)),
                Effect::CheckNow { server } => match service.checks.get(&server) {
                    Some(check) => check.now.notify_one(),
                    None => {
                        warn!(service = %name, %server, "no check task to confirm a kernel report with");
                    }
                },
            }
        }
        // States changed without a new selection: keep the kernel's copy of
        // them current too (one whole-value update, only if it differs), so
        // that a restarted daemon starts from them.
        if changed_servers {
            let service = &self.services[i];
            if let Some(written) = service.balancer.written()
                && let Err(e) = self.datapath.write(&service.entry_for(written.clone()))
            {
                error!(service = %service.config.name, "writing the server states failed: {e:#}");
            }
        }
        // After the new selection is written, so that a client reconnecting
        // at once gets a server of it.
        self.close_servers(i, closes);
        if changed_servers {
            self.sync_checks(i);
        }
    }

    /// Starts (or restarts) the discovery task of service `i`, if it has a
    /// source.
    fn start_discovery(&mut self, i: usize) {
        let kubeconfig = self.settings.kubeconfig.clone();
        let service = &mut self.services[i];
        if let Some(old) = service.discovery.take() {
            old.task.abort();
        }
        let Some(source) = service.config.discovery.clone() else { return };
        let name = match &source {
            config::Discovery::Kubernetes { .. } => discovery::Source::Kubernetes,
            config::Discovery::Dns { .. } => discovery::Source::Dns,
        };
        let (usable, usable_rx) = watch::channel(service.balancer.selection().servers);
        let task = discovery::spawn(
            service.config.name.clone(),
            service.config.vip,
            source,
            kubeconfig,
            usable_rx,
            self.discovered.clone(),
        );
        info!(service = %service.config.name, source = name.name(), "following the discovery source");
        let status =
            DiscoveryStatus { source: name.name().to_owned(), ..DiscoveryStatus::default() };
        service.discovery = Some(Box::new(Discovery { task, usable, status }));
    }

    /// A list from a discovery source. Applied like `lb servers` (same
    /// checks, kept in the state file), with each endpoint's readiness;
    /// an empty list or a failed sync keeps the last list (a source that
    /// goes blank must never empty a VIP).
    fn on_discovered(&mut self, update: discovery::Update) {
        let Ok(i) = self.index(&update.service) else { return };
        let source = update.source.name();
        let name = update.service.clone();
        let now_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let result = match update.result {
            Ok(endpoints) if endpoints.is_empty() => {
                warn!(service = %name, source, "the discovery source lists no endpoints; keeping the last list");
                Err(("empty", "the source listed no endpoints; keeping the last list".to_owned()))
            }
            Ok(endpoints) => {
                let list: Vec<(SocketAddr, Readiness)> =
                    endpoints.iter().map(|e| (e.addr, e.readiness)).collect();
                self.apply_discovered(i, &list, update.truncated).map_err(|e| ("error", e))
            }
            Err(error) => {
                warn!(service = %name, source, "discovery failed; keeping the last list: {error}");
                Err(("error", error))
            }
        };
        let outcome = match &result {
            Ok(()) => "applied",
            Err((outcome, _)) => outcome,
        };
        let labels = DiscoveryLabels {
            service: name.clone(),
            source: source.to_owned(),
            result: outcome.to_owned(),
        };
        self.metrics.discovery_updates.get_or_create(&labels).inc();
        let Some(discovery) = &mut self.services[i].discovery else { return };
        match result {
            Ok(()) => {
                discovery.status.last_success = Some(now_unix);
                discovery.status.last_error = None;
                discovery.status.truncated = update.truncated;
                let at = i64::try_from(now_unix).unwrap_or(i64::MAX);
                let labels = ServiceLabels { service: name };
                self.metrics.discovery_last_success.get_or_create(&labels).set(at);
                let truncated = i64::try_from(update.truncated).unwrap_or(i64::MAX);
                self.metrics.discovery_truncated.get_or_create(&labels).set(truncated);
            }
            Err((_, error)) => discovery.status.last_error = Some(error),
        }
    }

    /// Applies a discovered, non-empty list to service `i` and keeps it in
    /// the state file.
    fn apply_discovered(
        &mut self,
        i: usize,
        list: &[(SocketAddr, Readiness)],
        truncated: usize,
    ) -> Result<(), String> {
        let config = &self.services[i].config;
        let (name, vip, default) = (config.name.clone(), config.vip, config.default);
        let servers: Vec<SocketAddr> = list.iter().map(|(addr, _)| *addr).collect();
        config::validate_servers(vip, &servers, default, |addr| self.vip_owner(addr))
            .map_err(|problems| format!("the discovered list was refused: {problems}"))?;
        if truncated > 0 {
            warn!(service = %name, truncated, "the source lists more endpoints than a service holds; the best 16 are used");
        }
        let effects = self.services[i].balancer.set_endpoints(list, default, Instant::now());
        let removed =
            effects.iter().any(|e| matches!(e, Effect::StateChanged { to: State::Invalid, .. }));
        if !effects.is_empty() {
            info!(service = %name, servers = ?servers, "applying the discovered list");
        }
        self.apply(i, effects);
        self.after_discovery.forget |= removed;
        let config = &self.services[i].config;
        let drained =
            list.iter().filter(|(_, r)| *r != Readiness::Ready).map(|(addr, _)| *addr).collect();
        let now_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let saved = SavedList {
            servers,
            default,
            configured: config.servers.clone(),
            configured_default: config.default,
            drained,
            discovered_at: Some(now_unix),
        };
        // Written when the list changes, not at every confirmation.
        let unchanged = self.saved.services.get(&name).is_some_and(|old| {
            SavedList { discovered_at: old.discovered_at, ..saved.clone() } == *old
        });
        if !unchanged {
            self.saved.services.insert(name, saved);
            self.after_discovery.save = true;
        }
        Ok(())
    }

    /// After the discovered lists at hand are applied: writes the state
    /// file and cleans the kernel's maps once for all of them (each is a
    /// file write with fsync, or a walk of two maps).
    fn after_discovered(&mut self) {
        let AfterDiscovery { save, forget } = std::mem::take(&mut self.after_discovery);
        if forget {
            self.forget_stale();
        }
        if save && let Err(e) = self.saved.save(&self.settings.state_dir) {
            error!("saving the discovered lists to the state directory failed: {e:#}");
        }
    }

    /// Removes from the kernel what it keeps about servers no longer in
    /// any service (failure marks, zero connection counts), so that maps
    /// do not fill up with the dead. After every change of server lists.
    fn forget_stale(&mut self) {
        let live: Vec<(SocketAddr, Vec<SocketAddr>)> = self
            .services
            .iter()
            .map(|s| {
                (s.config.vip, s.balancer.servers().iter().map(|server| server.addr).collect())
            })
            .collect();
        match self.datapath.forget(&live) {
            Ok(forgotten) => {
                debug!(?forgotten, "forgot what the kernel kept about removed servers");
            }
            Err(e) => warn!("cleaning the kernel's maps of removed servers failed: {e:#}"),
        }
    }

    fn on_tick(&mut self, now: Instant) {
        for i in 0..self.services.len() {
            let effects = self.services[i].balancer.on_tick(now);
            self.apply(i, effects);
        }
        self.metrics.expire(now);
    }

    /// Makes the health check tasks of service `i` match its servers.
    fn sync_checks(&mut self, i: usize) {
        let tx = self.tx.clone();
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
        for addr in wanted {
            if service.checks.contains_key(&addr) {
                continue;
            }
            // `check = "none"`: the kernel's reports are the signal.
            if config.health.check == CheckKind::None {
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

    /// Resets, in the background, the VIP connections that
    /// `wanted(vip, server)` picks; `why` says what to do with the outcome
    /// ([`Self::on_closed`]). The netlink socket dump and the destroys run
    /// on a blocking thread: with thousands of connections they take a
    /// while, and the owner loop must keep answering kernel reports, checks
    /// and `lb status` meanwhile. The sockets are picked here, from the
    /// `SOCKETS` map, after the new selection is written.
    fn close_in_background(&self, wanted: impl Fn(SocketAddr, SocketAddr) -> bool, why: Closing) {
        if !self.sock_destroy {
            let error = "this kernel cannot destroy sockets (it lacks CONFIG_INET_DIAG_DESTROY, or the tcp_diag module is not loaded)";
            return self.on_closed(why, Err(error.to_owned()));
        }
        let sockets: HashMap<u64, (SocketAddr, SocketAddr)> = self
            .datapath
            .vip_sockets()
            .filter(|s| wanted(s.vip, s.server))
            .map(|s| (s.cookie, (s.vip, s.server)))
            .collect();
        let tx = self.tx.clone();
        tokio::task::spawn_blocking(move || {
            let cookies = sockets.keys().copied().collect();
            let result = sock_destroy::destroy(&cookies)
                .map(|destroyed| {
                    let mut closed = Closed::new();
                    for cookie in destroyed {
                        *closed.entry(sockets[&cookie]).or_default() += 1;
                    }
                    closed
                })
                .map_err(|e| format!("destroying sockets with netlink SOCK_DESTROY: {e}"));
            let _ = tx.blocking_send(Message::Closed { why, result });
        });
    }

    /// A background closing is done: log it, count it, answer who asked.
    fn on_closed(&self, why: Closing, result: Result<Closed, String>) {
        let service_of =
            |vip: SocketAddr| self.by_vip.get(&vip).map(|&i| self.services[i].config.name.clone());
        let count = |service: String, server: SocketAddr, reason: &str, n: u64| {
            self.metrics.count_closed(&service, server, reason, n);
        };
        match (why, result) {
            (Closing::Balancer { service, vip, servers }, Ok(closed)) => {
                for (server, reason) in servers {
                    let n = closed.get(&(vip, server)).copied().unwrap_or(0);
                    info!(service = %service, %server, closed = n, reason = reason.name(), "closed VIP connections");
                    count(service.clone(), server, reason.name(), n);
                }
            }
            (Closing::Balancer { service, .. }, Err(e)) => {
                error!(service = %service, "closing connections failed: {e}");
            }
            (Closing::Manual { server, reply }, result) => {
                let response = match result {
                    Ok(closed) => {
                        for (&(vip, server), &n) in &closed {
                            if let Some(service) = service_of(vip) {
                                count(service, server, "manual", n);
                            }
                        }
                        let total = closed.values().sum();
                        info!(%server, closed = total, "closed VIP connections on request");
                        Response::Closed { closed: total }
                    }
                    Err(e) => {
                        Response::Error { error: format!("closing connections to {server}: {e}") }
                    }
                };
                let _ = reply.send(response);
            }
            (Closing::RemovedVips, Ok(closed)) => info!(
                closed = closed.values().sum::<u64>(),
                "closed the connections of removed VIPs"
            ),
            (Closing::RemovedVips, Err(e)) => {
                error!("closing the connections of removed VIPs failed: {e}");
            }
        }
    }

    /// Closes the VIP connections of service `i` to the servers one step of
    /// its balancer moved traffic away from.
    fn close_servers(&self, i: usize, closes: Vec<(SocketAddr, CloseReason)>) {
        // Without socket destroy (said once at start) they end on their own.
        if closes.is_empty() || !self.sock_destroy {
            return;
        }
        let (service, vip) = (self.services[i].config.name.clone(), self.services[i].config.vip);
        let servers: HashSet<SocketAddr> = closes.iter().map(|(s, _)| *s).collect();
        self.close_in_background(
            |v, server| v == vip && servers.contains(&server),
            Closing::Balancer { service, vip, servers: closes },
        );
    }

    fn on_health(&mut self, service: &str, server: SocketAddr, result: Health, took: Duration) {
        let Ok(i) = self.index(service) else { return };
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

    /// A metrics scrape: refresh what lives in the kernel, then encode.
    fn scrape(&mut self) -> String {
        for service in &self.services {
            for server in service.balancer.servers() {
                let count = self.datapath.connections(service.config.vip, server.addr);
                self.metrics.set_connections(&service.config.name, server.addr, count);
            }
        }
        let counters = self.datapath.counters();
        self.metrics.record_decisions(&counters);
        self.metrics.encode()
    }

    fn on_kernel_event(&mut self, event: &Event) {
        let vip = SocketAddr::from(event.vip);
        let server = SocketAddr::from(event.server);
        if event.time_ns < self.started_ns {
            return debug!(%vip, %server, kind = event.kind, "ignoring a kernel event from before this daemon started");
        }
        let connection = match EventKind::try_from(event.kind) {
            Ok(EventKind::Established) => {
                debug!(%vip, %server, "connection established");
                Connection::Established
            }
            Ok(EventKind::ConnectFailed) => {
                warn!(%vip, %server, "connect through the VIP failed; the kernel skips this server for its hold-down");
                Connection::ConnectFailed
            }
            Ok(EventKind::ConnectTimeout) => {
                warn!(%vip, %server, "connect through the VIP got no answer yet; the kernel skips this server for its hold-down");
                Connection::ConnectTimedOut
            }
            Err(e) => return warn!("ignoring a kernel event: {e}"),
        };
        let Some(&i) = self.by_vip.get(&vip) else { return };
        if connection != Connection::Established {
            self.metrics.count_connect_failure(&self.services[i].config.name, server);
        }
        let effects = self.services[i].balancer.on_connection(server, connection, Instant::now());
        self.apply(i, effects);
    }

    /// A control request (other than shutdown, which ends the loop).
    fn handle(&mut self, request: Request) -> Response {
        let result = match request {
            Request::Status => return Response::Status(self.status()),
            Request::CloseConnections { .. } => {
                Err(anyhow::anyhow!("close-connections is answered when the closing is done"))
            }
            Request::SetServers { service, servers, default } => {
                self.set_servers(&service, &servers, default).map(|()| Response::Ok)
            }
            Request::Drain { service, server, undo } => {
                self.drain(&service, server, undo).map(|()| Response::Ok)
            }
            Request::Reload => self.reload().map(|()| Response::Ok),
            Request::Shutdown => Err(anyhow::anyhow!("shutdown is handled by the owner loop")),
        };
        result.unwrap_or_else(|e| Response::Error { error: format!("{e:#}") })
    }

    /// `lb servers`: checked with the same rules as the config file.
    fn set_servers(
        &mut self,
        name: &str,
        servers: &[SocketAddr],
        default: Option<SocketAddr>,
    ) -> anyhow::Result<()> {
        let i = self.index(name)?;
        let vip = self.services[i].config.vip;
        config::validate_servers(vip, servers, default, |addr| self.vip_owner(addr))
            .map_err(anyhow::Error::msg)?;
        let effects = self.services[i].balancer.set_servers(servers, default, Instant::now());
        self.apply(i, effects);
        let config = &self.services[i].config;
        self.saved.services.insert(
            name.to_owned(),
            SavedList {
                servers: servers.to_vec(),
                default,
                configured: config.servers.clone(),
                configured_default: config.default,
                drained: Vec::new(),
                discovered_at: None,
            },
        );
        self.forget_stale();
        self.saved
            .save(&self.settings.state_dir)
            .context("saving the server list to the state directory")?;
        info!(service = name, ?servers, ?default, "server list set");
        Ok(())
    }

    fn drain(&mut self, name: &str, server: SocketAddr, undo: bool) -> anyhow::Result<()> {
        let i = self.index(name)?;
        if self.services[i].balancer.server(server).is_none() {
            bail!("{server} is not a server of {name:?}");
        }
        let readiness = if undo { Readiness::Ready } else { Readiness::Serving };
        let effects = self.services[i].balancer.set_readiness(server, readiness, Instant::now());
        self.apply(i, effects);
        info!(service = name, %server, drained = !undo, "drain changed");
        Ok(())
    }

    fn status(&self) -> Status {
        let kernel = KernelSnapshot::of(&self.datapath);
        Status {
            services: self
                .services
                .iter()
                .map(|s| {
                    status::service(
                        &s.config,
                        &s.balancer,
                        s.discovery.as_ref().map(|d| &d.status),
                        &kernel,
                    )
                })
                .collect(),
            config: ConfigStatus {
                path: self.config_path.display().to_string(),
                last_reload: self.last_reload.clone(),
            },
            datapath: DatapathStatus {
                cgroup: self.cgroup.display().to_string(),
                bpffs: self.settings.bpffs.display().to_string(),
                adopted: self.datapath.adopted,
                counters: self
                    .datapath
                    .counters()
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v))
                    .collect(),
                features: Features {
                    getpeername: self.datapath.getpeername,
                    sock_destroy: self.sock_destroy,
                    netns_scope: self.datapath.netns_scope,
                },
                tracked_sockets: {
                    let (tcp, udp) = self.datapath.tracked_sockets();
                    TrackedSockets { tcp, udp }
                },
            },
        }
    }

    /// `lb close-connections`: resets the connections made through a VIP
    /// (of `service`, or of any service) to `server`, and answers with how
    /// many once done. Direct connections to it are left alone. Counted
    /// with reason `manual`.
    fn close_connections(
        &self,
        server: SocketAddr,
        service: Option<&str>,
        reply: oneshot::Sender<Response>,
    ) {
        let vip = match service
            .map(|name| self.index(name).map(|i| self.services[i].config.vip))
            .transpose()
        {
            Ok(vip) => vip,
            Err(e) => return drop(reply.send(Response::Error { error: format!("{e:#}") })),
        };
        self.close_in_background(
            |v, s| s == server && vip.is_none_or(|vip| vip == v),
            Closing::Manual { server, reply },
        );
    }

    /// SIGHUP or `lb reload`: apply a new config if it is valid; keep the
    /// old one if not. Records the outcome for `lb status` and metrics.
    fn reload(&mut self) -> anyhow::Result<()> {
        let result = self.try_reload();
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let outcome = if result.is_ok() { "success" } else { "failure" };
        self.metrics
            .config_reloads
            .get_or_create(&ResultLabels { result: outcome.to_owned() })
            .inc();
        if let Err(e) = &result {
            error!("reload failed; still serving the previous config:\n{e:#}");
            self.source.forget();
        }
        release_freed_memory();
        self.last_reload = Some(ReloadStatus {
            ok: result.is_ok(),
            error: result.as_ref().err().map(|e| format!("{e:#}")),
            at,
        });
        result
    }

    /// Applies the config file's difference ([`reload::plan`]): unchanged
    /// services keep their state and connections; removed services stop
    /// being rewritten and their VIP connections are closed. Nothing
    /// changes if the file is invalid.
    fn try_reload(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        let running: Vec<&config::Service> = self.services.iter().map(|s| &s.config).collect();
        // Only the changed services' settings are kept (copied below), and
        // the source, copied here out of the parser's arena.
        let (config, source, read) =
            parse_config(|| self.source.reload(&self.config_path, &self.settings, &running))?;
        let source = source.clone();
        let parsed_in = started.elapsed();
        if config.daemon != self.settings {
            warn!("[daemon] settings changed; they take effect at the next start");
        }
        let now = Instant::now();
        let mut removed_vips = HashSet::new();
        let changes = reload::plan(&running, &config.services);
        let changed = changes.len();
        // The certificates of the services that start or restart their
        // checks; the others keep what they loaded.
        let mut tls = load_tls(changes.iter().filter_map(|c| match c {
            Change::Add(s) => Some(s),
            Change::Update { service: s, what } if what.policy_or_health => Some(s),
            _ => None,
        }))?;
        // What this reload writes to the kernel: the services it adds or
        // changes, and the VIPs it removes. The daemon is the only writer of
        // the other entries, which hold what it wrote (10,000 services need
        // not be read back to change one).
        let touched: Vec<String> = changes
            .iter()
            .filter_map(|c| match c {
                Change::Add(s) | Change::Update { service: s, .. } => Some(s.name.clone()),
                Change::Remove { .. } => None,
            })
            .collect();
        let lists_changed = changes.iter().any(|c| match c {
            Change::Remove { .. } => true,
            Change::Update { what, .. } => what.servers,
            Change::Add(_) => false,
        });
        // Removals first, in one pass (they come first in the plan).
        let removed: HashSet<&str> = changes
            .iter()
            .filter_map(
                |c| if let Change::Remove { name } = c { Some(name.as_str()) } else { None },
            )
            .collect();
        if !removed.is_empty() {
            let (gone, kept): (Vec<Service>, Vec<Service>) = std::mem::take(&mut self.services)
                .into_iter()
                .partition(|s| removed.contains(s.config.name.as_str()));
            self.services = kept;
            self.reindex();
            for service in gone {
                let name = &service.config.name;
                info!(service = %name, vip = %service.config.vip, "service removed");
                for server in service.balancer.servers() {
                    self.metrics.server_left(name, server.addr, now);
                }
                removed_vips.insert(service.config.vip);
            }
        }
        for change in changes {
            match change {
                Change::Remove { .. } => {}
                Change::Add(wanted) => {
                    info!(service = %wanted.name, vip = %wanted.vip, "service added");
                    let tls = tls.remove(&wanted.name).unwrap_or_default();
                    let (servers, default) = (wanted.servers.clone(), wanted.default);
                    let (service, effects) = Service::new(wanted, tls, &servers, default, now);
                    self.services.push(service);
                    let i = self.services.len() - 1;
                    self.by_name.insert(self.services[i].config.name.clone(), i);
                    self.by_vip.insert(self.services[i].config.vip, i);
                    self.apply(i, effects);
                    self.service_appeared(i);
                    self.start_discovery(i);
                }
                Change::Update { service: wanted, what } => {
                    let i = self.index(&wanted.name)?;
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
                    if what.kernel
                        && let Err(e) = self.datapath.write(&self.services[i].entry())
                    {
                        error!(service = %wanted.name, "writing the hold-down and scope failed: {e:#}");
                    }
                    self.apply(i, effects);
                    if what.discovery {
                        self.start_discovery(i);
                    }
                }
            }
        }
        // The config's order, as `lb status` shows it (most reloads keep it).
        let in_order = self.services.len() == config.services.len()
            && self.services.iter().zip(&config.services).all(|(s, c)| s.config.name == c.name);
        if !in_order {
            let order: HashMap<&str, usize> =
                config.services.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
            self.services.sort_by_cached_key(|s| order.get(s.config.name.as_str()).copied());
            self.reindex();
        }
        for name in &touched {
            let i = self.index(name)?;
            if let Err(e) = self.datapath.write(&self.services[i].entry()) {
                error!(service = %name, "reload: writing the datapath failed: {e:#}");
            }
            // Only an added or changed service can have new servers or
            // stopped checks.
            self.sync_checks(i);
        }
        // A removed VIP no longer rewrites; its connections are closed
        // (unless another service has taken the VIP over).
        for service in &self.services {
            removed_vips.remove(&service.config.vip);
        }
        for &vip in &removed_vips {
            if let Err(e) = self.datapath.remove(vip) {
                error!("reload: {e:#}");
            }
        }
        if lists_changed {
            self.forget_stale();
        }
        if !removed_vips.is_empty() && self.sock_destroy {
            self.close_in_background(|vip, _| removed_vips.contains(&vip), Closing::RemovedVips);
        }
        self.settings = config.daemon;
        self.source = source;
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
}

/// Checks `server` every interval, and at once when `now` is notified.
/// The checker is built here, on a blocking thread, not by the owner loop:
/// an https client may load the system's CA store, which takes a while.
async fn check_loop(
    service: String,
    server: SocketAddr,
    health: config::HealthConfig,
    tls: Tls,
    now: Arc<Notify>,
    tx: mpsc::Sender<Message>,
) {
    let interval = health.interval;
    let checker =
        match tokio::task::spawn_blocking(move || Checker::new(&health, &tls, server)).await {
            Ok(Ok(Some(checker))) => checker,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => return error!(service, %server, "cannot check this server: {e:#}"),
            Err(e) => return error!(service, %server, "building the checker failed: {e}"),
        };
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = now.notified() => ticker.reset(),
        }
        let started = Instant::now();
        let result = checker.check(server).await;
        let took = started.elapsed();
        if tx
            .send(Message::Health { service: service.clone(), server, result, took })
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Reads the kernel's connection events and hands them to the owner task.
async fn forward_events(events: RingBuf<MapData>, tx: mpsc::Sender<Message>) {
    // SAFETY: the ring buffer owns its fd and keeps it open while registered.
    let mut events = match unsafe { AsyncFd::register(events) } {
        Ok(fd) => fd,
        Err(e) => {
            error!("cannot poll the event ring buffer: {e}");
            return;
        }
    };
    loop {
        let Ok(mut guard) = events.readable_mut().await else { return };
        let ring = guard.get_inner_mut();
        while let Some(item) = ring.next() {
            if item.len() < size_of::<Event>() {
                continue;
            }
            // SAFETY: the kernel writes whole `Event` records (size checked).
            let event = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<Event>()) };
            if tx.send(Message::Kernel(event)).await.is_err() {
                return;
            }
        }
        guard.clear_ready();
    }
}

/// `--bpf-log`: drains the kernel programs' log ring buffer as it fills.
async fn forward_kernel_logs(logger: datapath::KernelLogger) {
    // SAFETY: the logger owns its ring buffer fd and keeps it open.
    let mut logger = match unsafe { AsyncFd::register(logger) } {
        Ok(fd) => fd,
        Err(e) => {
            error!("cannot poll the kernel log buffer: {e}");
            return;
        }
    };
    loop {
        let Ok(mut guard) = logger.readable_mut().await else { return };
        guard.get_inner_mut().flush();
        guard.clear_ready();
    }
}
