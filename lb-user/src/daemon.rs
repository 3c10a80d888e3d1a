//! `lb run`: the daemon. One task owns every service's balancer and the
//! datapath and is the only writer of the maps; kernel events, health
//! results, control requests, timers and signals reach it as messages.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::SocketAddr,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use aya::maps::{MapData, RingBuf};
use lb_common::{EVENT_CLOSED, EVENT_CONNECT_FAILED, EVENT_CONNECT_TIMEOUT, EVENT_ESTABLISHED, Event, MAX_SERVERS};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, unix::AsyncFd},
    net::{UnixListener, UnixStream},
    signal::unix::{SignalKind, signal},
    sync::{mpsc, oneshot},
    task::JoinHandle,
};
use tracing::{debug, error, info, warn};

use crate::{
    balancer::{Balancer, Checks, CloseReason, Connection, Effect, Health, Readiness, State},
    config::{self, CheckKind, Config},
    control::{self, ConfigStatus, DatapathStatus, Features, ReloadStatus, Request, Response, ServerStatus, ServiceStatus, Status},
    datapath::{self, Datapath, VipEntry},
    health::Checker,
    metrics::{self, ClosedLabels, Metrics, ResultLabels, ServiceLabels, server_labels},
    sock_destroy,
    state::{SavedList, SavedState},
};

enum Message {
    Control(Request, oneshot::Sender<Response>),
    Kernel(Event),
    Health { service: String, server: SocketAddr, result: Health, took: Duration },
}

pub struct Options {
    pub config_path: PathBuf,
    pub bpf_log: bool,
    /// Detach everything on SIGTERM/SIGINT instead of leaving the datapath
    /// working (fail-static).
    pub detach_on_exit: bool,
}

/// One service: its config, its state machine and its health check tasks.
struct Service {
    config: config::Service,
    balancer: Balancer,
    checks: HashMap<SocketAddr, JoinHandle<()>>,
}

impl Drop for Service {
    fn drop(&mut self) {
        for task in self.checks.values() {
            task.abort();
        }
    }
}

struct Daemon {
    config: Config,
    config_path: PathBuf,
    cgroup: PathBuf,
    datapath: Datapath,
    services: Vec<Service>,
    saved: SavedState,
    tx: mpsc::Sender<Message>,
    metrics: Metrics,
    last_reload: Option<ReloadStatus>,
    /// Netlink SOCK_DESTROY works on this kernel (probed once at start).
    sock_destroy: bool,
}

/// Builds each service's health checker once, so that what only shows
/// when the files are read (a missing CA bundle, a key that does not
/// parse) fails a start or a reload instead of leaving servers unchecked.
fn check_health_settings(config: &Config) -> anyhow::Result<()> {
    for service in &config.services {
        // No check is made: the address only goes into the URL.
        Checker::new(&service.health, service.vip).with_context(|| format!("service {:?}", service.name))?;
    }
    Ok(())
}

fn checks_of(service: &config::Service) -> Checks {
    Checks { rise: service.health.rise, fall: service.health.fall, passive_only: service.health.check == CheckKind::None }
}

/// Runs the daemon until SIGTERM/SIGINT or a shutdown request. The datapath
/// stays pinned and working after it returns (fail-static).
pub async fn run(options: Options) -> anyhow::Result<()> {
    let config = Config::load(&options.config_path)?;
    // Before anything is attached.
    check_health_settings(&config)?;
    let cgroup = match &config.daemon.cgroup {
        Some(path) => path.clone(),
        None => datapath::cgroup2_root()?,
    };
    let socket_path = config.daemon.control_socket.clone();
    // Bind first: a second daemon for the same config fails here, before it
    // touches the datapath the first one owns.
    let listener = bind_control_socket(&socket_path).await?;

    let saved = SavedState::load(&config.daemon.state_dir);
    let now = Instant::now();
    let mut services = Vec::new();
    let mut initial = Vec::new();
    for service in &config.services {
        let (list, default) = saved
            .list_for(&service.name, &service.servers, service.default)
            .inspect(|(list, _)| info!(service = %service.name, servers = ?list, "using the server list set at runtime (state file)"))
            .unwrap_or_else(|| (service.servers.clone(), service.default));
        let (balancer, _) = Balancer::new(service.policy, checks_of(service), &list, default, now);
        initial.push(VipEntry { vip: service.vip, selection: balancer.selection(), hold_down: service.hold_down });
        services.push(Service { config: service.clone(), balancer, checks: HashMap::new() });
    }

    let bpffs = config.daemon.bpffs.clone();
    let mut datapath = Datapath::open(&bpffs, &cgroup, &initial, options.bpf_log)?;
    let (tx, mut rx) = mpsc::channel(4096);
    if let Some(events) = datapath.take_events() {
        tokio::spawn(forward_events(events, tx.clone()));
    }
    if let Some(logger) = datapath.take_logger() {
        tokio::spawn(forward_kernel_logs(logger));
    }
    tokio::spawn(serve_control(listener, tx.clone()));
    let (scrape_tx, mut scrapes) = mpsc::channel(16);
    if let Some(addr) = config.daemon.metrics {
        metrics::serve(addr, scrape_tx).await?;
    }

    let sock_destroy = sock_destroy::supported();
    if !sock_destroy {
        warn!("this kernel cannot destroy sockets (CONFIG_INET_DIAG_DESTROY, or the tcp_diag module): connections that must move are left to end on their own");
    }
    let metrics = Metrics::new();
    let mut daemon =
        Daemon { config, config_path: options.config_path, cgroup, datapath, services, saved, tx, metrics, last_reload: None, sock_destroy };
    for i in 0..daemon.services.len() {
        let service = &daemon.services[i];
        for server in service.balancer.servers() {
            daemon.metrics.set_state(&service.config.name, server.addr, server.state);
        }
        daemon.sync_checks(i);
    }
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
    loop {
        tokio::select! {
            _ = terminate.recv() => { info!("SIGTERM: exiting; the datapath stays attached"); break; }
            _ = interrupt.recv() => { info!("SIGINT: exiting; the datapath stays attached"); break; }
            _ = hangup.recv() => { let _ = daemon.reload(); }
            Some(scrape) = scrapes.recv() => { let _ = scrape.send(daemon.scrape()); }
            _ = tick.tick() => {
                let now = Instant::now();
                for i in 0..daemon.services.len() {
                    let effects = daemon.services[i].balancer.on_tick(now);
                    daemon.apply(i, effects);
                }
            }
            Some(message) = rx.recv() => match message {
                Message::Kernel(event) => daemon.on_kernel_event(&event),
                Message::Health { service, server, result, took } => daemon.on_health(&service, server, result, took),
                Message::Control(Request::Shutdown, reply) => {
                    info!("shutdown requested: exiting; the datapath stays attached");
                    let _ = reply.send(Response::Ok);
                    let _ = std::fs::remove_file(&socket_path);
                    return Ok(());
                }
                Message::Control(request, reply) => {
                    let _ = reply.send(daemon.handle(request));
                }
            },
        }
    }
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    let _ = std::fs::remove_file(&socket_path);
    if options.detach_on_exit {
        drop(daemon);
        let removed = datapath::detach(&bpffs)?;
        info!(pins = removed.len(), "--detach-on-exit: detached everything");
    }
    Ok(())
}

impl Daemon {
    fn index(&self, name: &str) -> Option<usize> {
        self.services.iter().position(|s| s.config.name == name)
    }

    /// Carries out a balancer's effects for service `i`.
    fn apply(&mut self, i: usize, effects: Vec<Effect>) {
        let changed_servers = effects.iter().any(|e| matches!(e, Effect::StateChanged { .. }));
        let mut closes = Vec::new();
        for effect in effects {
            let service = &self.services[i];
            let (name, vip) = (service.config.name.clone(), service.config.vip);
            match effect {
                Effect::StateChanged { server, from, to, why } => {
                    info!(service = %name, %server, %from, %to, "server {from} -> {to}: {why}");
                    if to == State::Invalid {
                        self.metrics.forget_server(&name, server);
                    } else {
                        self.metrics.set_state(&name, server, to);
                    }
                }
                Effect::WriteSelection(selection) => {
                    let entry = VipEntry { vip, selection, hold_down: service.config.hold_down };
                    match self.datapath.write(&entry) {
                        Ok(()) => {
                            info!(service = %name, selection = ?entry.selection.servers, spread = entry.selection.spread, "selection written");
                            self.metrics.selection_changes.get_or_create(&ServiceLabels { service: name.clone() }).inc();
                        }
                        Err(e) => error!(service = %name, "writing the selection failed: {e:#}"),
                    }
                }
                Effect::CloseConnections { server, reason } => closes.push((server, reason)),
            }
        }
        // After the new selection is written, so that a client reconnecting
        // at once gets a server of it.
        self.close_servers(i, &closes);
        if changed_servers {
            self.sync_checks(i);
        }
    }

    /// Makes the health check tasks of service `i` match its servers.
    fn sync_checks(&mut self, i: usize) {
        let tx = self.tx.clone();
        let service = &mut self.services[i];
        let wanted: HashSet<SocketAddr> = service.balancer.servers().iter().map(|s| s.addr).collect();
        service.checks.retain(|addr, task| {
            let keep = wanted.contains(addr);
            if !keep {
                task.abort();
            }
            keep
        });
        if service.config.health.check == CheckKind::None {
            return;
        }
        for addr in wanted {
            if service.checks.contains_key(&addr) {
                continue;
            }
            match Checker::new(&service.config.health, addr) {
                Ok(checker) => {
                    let task = tokio::spawn(check_loop(service.config.name.clone(), addr, checker, service.config.health.interval, tx.clone()));
                    service.checks.insert(addr, task);
                }
                Err(e) => error!(service = %service.config.name, server = %addr, "cannot check this server: {e:#}"),
            }
        }
    }

    /// Resets the VIP connections that `wanted(vip, server)` picks, with one
    /// socket dump however many servers that covers. Returns how many were
    /// closed per (VIP, server).
    fn close(&self, wanted: impl Fn(SocketAddr, SocketAddr) -> bool) -> anyhow::Result<BTreeMap<(SocketAddr, SocketAddr), u64>> {
        if !self.sock_destroy {
            bail!("this kernel cannot destroy sockets (it lacks CONFIG_INET_DIAG_DESTROY, or the tcp_diag module is not loaded)");
        }
        let sockets: HashMap<u64, (SocketAddr, SocketAddr)> =
            self.datapath.vip_sockets().filter(|s| wanted(s.vip, s.server)).map(|s| (s.cookie, (s.vip, s.server))).collect();
        let cookies = sockets.keys().copied().collect();
        let mut closed = BTreeMap::new();
        for cookie in sock_destroy::destroy(&cookies).context("destroying sockets with netlink SOCK_DESTROY")? {
            *closed.entry(sockets[&cookie]).or_default() += 1;
        }
        Ok(closed)
    }

    /// Closes the VIP connections of service `i` to the servers one step of
    /// its balancer moved traffic away from, and counts them by reason.
    fn close_servers(&mut self, i: usize, closes: &[(SocketAddr, CloseReason)]) {
        // Without socket destroy (said once at start) they end on their own.
        if closes.is_empty() || !self.sock_destroy {
            return;
        }
        let (name, vip) = (self.services[i].config.name.clone(), self.services[i].config.vip);
        let closed = match self.close(|v, server| v == vip && closes.iter().any(|(s, _)| *s == server)) {
            Ok(closed) => closed,
            Err(e) => return error!(service = %name, "closing connections failed: {e:#}"),
        };
        for &(server, reason) in closes {
            let count = closed.get(&(vip, server)).copied().unwrap_or(0);
            info!(service = %name, %server, closed = count, reason = reason.name(), "closed VIP connections");
            let labels = ClosedLabels { service: name.clone(), server: server.to_string(), reason: reason.name().to_owned() };
            self.metrics.connections_closed.get_or_create(&labels).inc_by(count);
        }
    }

    fn on_health(&mut self, service: &str, server: SocketAddr, result: Health, took: Duration) {
        let Some(i) = self.index(service) else { return };
        debug!(service, %server, ?result, ?took, "health check");
        let effects = self.services[i].balancer.on_health(server, result, Instant::now());
        self.apply(i, effects);
        if let Some(s) = self.services[i].balancer.server(server) {
            self.metrics.set_healthy(service, server, s.healthy);
            self.metrics.health_check_duration.get_or_create(&server_labels(service, server)).observe(took.as_secs_f64());
        }
    }

    /// A metrics scrape: refresh what lives in the kernel, then encode.
    fn scrape(&mut self) -> String {
        for service in &self.services {
            for server in service.balancer.servers() {
                let count = self.datapath.connections(service.config.vip, server.addr);
                self.metrics.server_connections.get_or_create(&server_labels(&service.config.name, server.addr)).set(count);
            }
        }
        let counters = self.datapath.counters();
        self.metrics.record_decisions(&counters);
        self.metrics.encode()
    }

    fn on_kernel_event(&mut self, event: &Event) {
        let vip = SocketAddr::from(event.vip);
        let server = SocketAddr::from(event.server);
        let connection = match event.kind {
            EVENT_ESTABLISHED => Connection::Established,
            EVENT_CONNECT_FAILED => Connection::ConnectFailed,
            EVENT_CONNECT_TIMEOUT => Connection::ConnectTimedOut,
            EVENT_CLOSED => {
                debug!(%vip, %server, "connection closed");
                return;
            }
            other => {
                warn!(kind = other, "unknown kernel event");
                return;
            }
        };
        match connection {
            Connection::Established => debug!(%vip, %server, "connection established"),
            Connection::ConnectFailed => warn!(%vip, %server, "connect through the VIP failed; the kernel skips this server for its hold-down"),
            Connection::ConnectTimedOut => warn!(%vip, %server, "connect through the VIP got no answer yet; the kernel skips this server for its hold-down"),
        }
        let Some(i) = self.services.iter().position(|s| s.config.vip == vip) else { return };
        if connection != Connection::Established {
            self.metrics.connect_failures.get_or_create(&server_labels(&self.services[i].config.name, server)).inc();
        }
        let effects = self.services[i].balancer.on_connection(server, connection, Instant::now());
        self.apply(i, effects);
    }

    fn handle(&mut self, request: Request) -> Response {
        let result = match request {
            Request::Status => return Response::Status(self.status()),
            Request::CloseConnections { server, service } => self.close_connections(server, service.as_deref()).map(|closed| Response::Closed { closed }),
            Request::SetServers { service, servers, default } => self.set_servers(&service, &servers, default).map(|()| Response::Ok),
            Request::Drain { service, server, undo } => self.drain(&service, server, undo).map(|()| Response::Ok),
            Request::Reload => self.reload().map(|()| Response::Ok),
            Request::Shutdown => Ok(Response::Ok),
        };
        result.unwrap_or_else(|e| Response::Error { error: format!("{e:#}") })
    }

    fn set_servers(&mut self, name: &str, servers: &[SocketAddr], default: Option<SocketAddr>) -> anyhow::Result<()> {
        let i = self.index(name).with_context(|| format!("no service named {name:?}"))?;
        let vip = self.services[i].config.vip;
        let all: Vec<SocketAddr> = servers.iter().chain(&default).copied().collect();
        for addr in &all {
            if addr.port() == 0 || addr.ip().is_unspecified() {
                bail!("{addr} is not a usable server address");
            }
            if addr.is_ipv4() != vip.is_ipv4() {
                bail!("{addr} and the VIP {vip} are of different address families; a socket dialling the VIP cannot reach it");
            }
            if self.services.iter().any(|s| s.config.vip == *addr) {
                bail!("{addr} is a VIP; using it as a server would loop");
            }
        }
        let unique: HashSet<SocketAddr> = all.iter().copied().collect();
        if unique.len() > MAX_SERVERS {
            bail!("{} servers (with the default); at most {MAX_SERVERS} are supported", unique.len());
        }
        let effects = self.services[i].balancer.set_servers(servers, default, Instant::now());
        self.apply(i, effects);
        let config = &self.services[i].config;
        self.saved.services.insert(
            name.to_owned(),
            SavedList { servers: servers.to_vec(), default, configured: config.servers.clone(), configured_default: config.default },
        );
        self.saved.save(&self.config.daemon.state_dir).context("saving the server list to the state directory")?;
        info!(service = name, ?servers, ?default, "server list set");
        Ok(())
    }

    fn drain(&mut self, name: &str, server: SocketAddr, undo: bool) -> anyhow::Result<()> {
        let i = self.index(name).with_context(|| format!("no service named {name:?}"))?;
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
        let services = self
            .services
            .iter()
            .map(|s| {
                let vip = s.config.vip;
                ServiceStatus {
                    name: s.config.name.clone(),
                    vip,
                    policy: s.config.policy.to_string(),
                    selected: self.datapath.selection(vip),
                    servers: s
                        .balancer
                        .servers()
                        .iter()
                        .map(|server| ServerStatus {
                            address: server.addr,
                            connections: self.datapath.connections(vip, server.addr),
                            state: server.state.name().to_owned(),
                            healthy: server.healthy,
                            last_check: server.last_error.clone(),
                            readiness: match server.readiness {
                                Readiness::Ready => "ready",
                                Readiness::Serving => "serving",
                                Readiness::Terminating => "terminating",
                            }
                            .to_owned(),
                            default: server.is_default,
                            recently_failed: self.datapath.recently_failed(server.addr, s.config.hold_down),
                        })
                        .collect(),
                }
            })
            .collect();
        Status {
            services,
            config: ConfigStatus { path: self.config_path.display().to_string(), last_reload: self.last_reload.clone() },
            datapath: DatapathStatus {
                cgroup: self.cgroup.display().to_string(),
                bpffs: self.config.daemon.bpffs.display().to_string(),
                adopted: self.datapath.adopted,
                counters: self.datapath.counters().into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
                features: Features { getpeername: self.datapath.getpeername, sock_destroy: self.sock_destroy },
            },
        }
    }

    /// `lb close-connections`: resets the connections made through a VIP
    /// (of `service`, or of any service) to `server`. Direct connections to
    /// it are left alone. Counted with reason `manual`.
    fn close_connections(&mut self, server: SocketAddr, service: Option<&str>) -> anyhow::Result<u64> {
        let vip = match service {
            None => None,
            Some(name) => Some(self.services[self.index(name).with_context(|| format!("no service named {name:?}"))?].config.vip),
        };
        let closed = self
            .close(|v, s| s == server && vip.is_none_or(|vip| vip == v))
            .with_context(|| format!("closing connections to {server}"))?;
        for (&(vip, server), &count) in &closed {
            if let Some(service) = self.services.iter().find(|s| s.config.vip == vip) {
                let labels = ClosedLabels { service: service.config.name.clone(), server: server.to_string(), reason: "manual".to_owned() };
                self.metrics.connections_closed.get_or_create(&labels).inc_by(count);
            }
        }
        let total = closed.values().sum();
        info!(%server, closed = total, "closed VIP connections on request");
        Ok(total)
    }

    /// SIGHUP or `lb reload`: apply a new config if it is valid; keep the
    /// old one if not. Records the outcome for `lb status` and metrics.
    fn reload(&mut self) -> anyhow::Result<()> {
        let result = self.try_reload();
        let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let outcome = if result.is_ok() { "success" } else { "failure" };
        self.metrics.config_reloads.get_or_create(&ResultLabels { result: outcome.to_owned() }).inc();
        if let Err(e) = &result {
            error!("reload failed; still serving the previous config:\n{e:#}");
        }
        self.last_reload = Some(ReloadStatus { ok: result.is_ok(), error: result.as_ref().err().map(|e| format!("{e:#}")), at });
        result
    }

    /// Applies the config file's difference: unchanged services keep their
    /// state and connections; removed services stop being rewritten and
    /// their VIP connections are closed. Nothing changes if it is invalid.
    fn try_reload(&mut self) -> anyhow::Result<()> {
        let config = Config::load(&self.config_path)?;
        check_health_settings(&config)?;
        if config.daemon != self.config.daemon {
            warn!("[daemon] settings changed; they take effect at the next start");
        }
        let now = Instant::now();
        let mut old: HashMap<String, Service> = self.services.drain(..).map(|s| (s.config.name.clone(), s)).collect();
        let mut removed_vips = HashSet::new();
        for wanted in &config.services {
            let service = match old.remove(&wanted.name) {
                Some(mut service) if service.config.vip == wanted.vip => {
                    let previous = std::mem::replace(&mut service.config, wanted.clone());
                    let mut effects = Vec::new();
                    if previous.policy != wanted.policy || previous.health != wanted.health {
                        effects.extend(service.balancer.set_policy(wanted.policy, checks_of(wanted), now));
                        for task in service.checks.values() {
                            task.abort();
                        }
                        service.checks.clear();
                    }
                    if previous.servers != wanted.servers || previous.default != wanted.default {
                        effects.extend(service.balancer.set_servers(&wanted.servers, wanted.default, now));
                        self.saved.services.remove(&wanted.name);
                    }
                    if previous.hold_down != wanted.hold_down {
                        let entry = VipEntry { vip: wanted.vip, selection: service.balancer.selection(), hold_down: wanted.hold_down };
                        if let Err(e) = self.datapath.write(&entry) {
                            error!(service = %wanted.name, "writing the hold-down failed: {e:#}");
                        }
                    }
                    self.services.push(service);
                    let i = self.services.len() - 1;
                    self.apply(i, effects);
                    continue;
                }
                Some(service) => {
                    removed_vips.insert(service.config.vip);
                    info!(service = %wanted.name, "VIP changed: replacing the service");
                    drop(service);
                    let (balancer, effects) = Balancer::new(wanted.policy, checks_of(wanted), &wanted.servers, wanted.default, now);
                    (Service { config: wanted.clone(), balancer, checks: HashMap::new() }, effects)
                }
                None => {
                    info!(service = %wanted.name, vip = %wanted.vip, "service added");
                    let (balancer, effects) = Balancer::new(wanted.policy, checks_of(wanted), &wanted.servers, wanted.default, now);
                    (Service { config: wanted.clone(), balancer, checks: HashMap::new() }, effects)
                }
            };
            let (service, effects) = service;
            self.services.push(service);
            let i = self.services.len() - 1;
            self.apply(i, effects);
            self.sync_checks(i);
        }
        for (name, service) in old {
            info!(service = %name, vip = %service.config.vip, "service removed");
            for server in service.balancer.servers() {
                self.metrics.forget_server(&name, server.addr);
            }
            removed_vips.insert(service.config.vip);
        }
        let entries: Vec<VipEntry> = self
            .services
            .iter()
            .map(|s| VipEntry { vip: s.config.vip, selection: s.balancer.selection(), hold_down: s.config.hold_down })
            .collect();
        if let Err(e) = self.datapath.reconcile(&entries) {
            error!("reload: writing the datapath failed: {e:#}");
        }
        // A removed VIP no longer rewrites; its connections are closed
        // (unless another service has taken the VIP over).
        for service in &self.services {
            removed_vips.remove(&service.config.vip);
        }
        if !removed_vips.is_empty() && self.sock_destroy {
            match self.close(|vip, _| removed_vips.contains(&vip)) {
                Ok(closed) => info!(closed = closed.values().sum::<u64>(), "closed the connections of removed VIPs"),
                Err(e) => error!("closing the connections of removed VIPs failed: {e:#}"),
            }
        }
        for i in 0..self.services.len() {
            self.sync_checks(i);
        }
        self.config = config;
        info!(services = self.services.len(), "config reloaded");
        Ok(())
    }
}

async fn check_loop(service: String, server: SocketAddr, checker: Checker, interval: Duration, tx: mpsc::Sender<Message>) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let started = Instant::now();
        let result = checker.check(server).await;
        let took = started.elapsed();
        if tx.send(Message::Health { service: service.clone(), server, result, took }).await.is_err() {
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

async fn bind_control_socket(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if path.exists() {
        if UnixStream::connect(path).await.is_ok() {
            bail!("another lb daemon is already listening on {}", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    let listener = UnixListener::bind(path).with_context(|| format!("binding control socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

async fn serve_control(listener: UnixListener, tx: mpsc::Sender<Message>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let tx = tx.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_client(stream, tx).await {
                debug!("control client: {e:#}");
            }
        });
    }
}

async fn serve_client(stream: UnixStream, tx: mpsc::Sender<Message>) -> anyhow::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    while let Some(line) = lines.next_line().await? {
        let response = match serde_json::from_str::<Request>(&line) {
            Ok(request) => {
                let (reply_tx, reply_rx) = oneshot::channel();
                tx.send(Message::Control(request, reply_tx)).await.context("daemon is shutting down")?;
                reply_rx.await.context("daemon is shutting down")?
            }
            Err(e) => Response::Error { error: format!("bad request {line:?}: {e}") },
        };
        let mut out = serde_json::to_string(&response)?;
        out.push('\n');
        write.write_all(out.as_bytes()).await?;
    }
    Ok(())
}

/// Used by `lb detach`: stop a running daemon first so it does not keep
/// working on a datapath that is going away.
pub async fn stop_running_daemon(socket: &Path) -> bool {
    matches!(control::call(socket, &Request::Shutdown).await, Ok(Response::Ok))
}
