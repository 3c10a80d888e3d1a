//! `lb run`: the daemon. One task owns the configuration and the datapath
//! and is the only writer of the maps; kernel events, control requests and
//! signals reach it as messages.

use std::{
    collections::HashSet,
    net::SocketAddr,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use aya::maps::{MapData, RingBuf};
use lb_common::{EVENT_CLOSED, EVENT_CONNECT_FAILED, EVENT_CONNECT_TIMEOUT, EVENT_ESTABLISHED, Event};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader},
    io::unix::AsyncFd,
    net::{UnixListener, UnixStream},
    signal::unix::{SignalKind, signal},
    sync::{mpsc, oneshot},
};
use tracing::{debug, error, info, warn};

use crate::{
    config::Config,
    control::{self, DatapathStatus, Request, Response, ServerStatus, ServiceStatus, Status},
    datapath::{self, Datapath, Selection},
    sock_destroy,
};

enum Message {
    Control(Request, oneshot::Sender<Response>),
    Kernel(Event),
}

pub struct Options {
    pub config_path: PathBuf,
    pub bpf_log: bool,
}

struct Daemon {
    config: Config,
    config_path: PathBuf,
    cgroup: PathBuf,
    datapath: Datapath,
}

/// Runs the daemon until SIGTERM/SIGINT or a shutdown request. The datapath
/// stays pinned and working after it returns (fail-static).
pub async fn run(options: Options) -> anyhow::Result<()> {
    let config = Config::load(&options.config_path)?;
    let cgroup = match &config.daemon.cgroup {
        Some(path) => path.clone(),
        None => datapath::cgroup2_root()?,
    };
    let socket_path = config.daemon.control_socket.clone();
    // Bind first: a second daemon for the same config fails here, before it
    // touches the datapath the first one owns.
    let listener = bind_control_socket(&socket_path).await?;

    let initial = selections(&config);
    let bpffs = config.daemon.bpffs.clone();
    let mut datapath = Datapath::open(&bpffs, &cgroup, &initial, options.bpf_log)?;
    let (tx, mut rx) = mpsc::channel(1024);
    if let Some(events) = datapath.take_events() {
        tokio::spawn(forward_events(events, tx.clone()));
    }
    if let Some(logger) = datapath.take_logger() {
        tokio::spawn(forward_kernel_logs(logger));
    }
    tokio::spawn(serve_control(listener, tx.clone()));

    let mut daemon = Daemon { config, config_path: options.config_path, cgroup, datapath };
    info!(
        services = daemon.config.services.len(),
        adopted = daemon.datapath.adopted,
        control_socket = %socket_path.display(),
        "lb is running"
    );

    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut hangup = signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = terminate.recv() => { info!("SIGTERM: exiting; the datapath stays attached"); break; }
            _ = interrupt.recv() => { info!("SIGINT: exiting; the datapath stays attached"); break; }
            _ = hangup.recv() => daemon.reload(),
            Some(message) = rx.recv() => match message {
                Message::Kernel(event) => daemon.on_kernel_event(&event),
                Message::Control(Request::Shutdown, reply) => {
                    info!("shutdown requested: exiting; the datapath stays attached");
                    let _ = reply.send(Response::Ok);
                    break;
                }
                Message::Control(request, reply) => {
                    let _ = reply.send(daemon.handle(request));
                }
            },
        }
    }
    let _ = std::fs::remove_file(&socket_path);
    Ok(())
}

/// The selection each VIP gets until the balancer decides: the configured
/// servers, default first.
fn selections(config: &Config) -> Vec<(SocketAddr, Selection)> {
    config
        .services
        .iter()
        .map(|s| (s.vip, Selection { servers: s.static_selection(), policy: s.policy, hold_down: s.hold_down }))
        .collect()
}

impl Daemon {
    fn handle(&mut self, request: Request) -> Response {
        match request {
            Request::Status => Response::Status(self.status()),
            Request::CloseConnections { server, service } => match self.close_connections(server, service.as_deref()) {
                Ok(closed) => Response::Closed { closed },
                Err(e) => Response::Error { error: format!("{e:#}") },
            },
            Request::Shutdown => Response::Ok,
        }
    }

    fn status(&self) -> Status {
        let services = self
            .config
            .services
            .iter()
            .map(|s| {
                let mut addresses = s.static_selection();
                // Servers that still hold connections but left the list.
                addresses.extend(self.datapath.selection(s.vip).into_iter().filter(|a| !s.static_selection().contains(a)));
                ServiceStatus {
                    name: s.name.clone(),
                    vip: s.vip,
                    policy: s.policy.to_string(),
                    selected: self.datapath.selection(s.vip),
                    servers: addresses
                        .into_iter()
                        .map(|address| ServerStatus {
                            address,
                            connections: self.datapath.connections(s.vip, address),
                            default: s.default == Some(address),
                            recently_failed: self.datapath.recently_failed(address, s.hold_down),
                        })
                        .collect(),
                }
            })
            .collect();
        Status {
            services,
            datapath: DatapathStatus {
                cgroup: self.cgroup.display().to_string(),
                bpffs: self.config.daemon.bpffs.display().to_string(),
                adopted: self.datapath.adopted,
                counters: self.datapath.counters().into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
            },
        }
    }

    /// Resets the connections made through a VIP (of `service`, or of any
    /// service) to `server`. Direct connections to it are left alone.
    fn close_connections(&self, server: SocketAddr, service: Option<&str>) -> anyhow::Result<usize> {
        let vips: Option<HashSet<SocketAddr>> = match service {
            None => None,
            Some(name) => match self.config.services.iter().find(|s| s.name == name) {
                Some(s) => Some(HashSet::from([s.vip])),
                None => bail!("no service named {name:?}"),
            },
        };
        let cookies = self.datapath.vip_sockets_to(server, vips.as_ref());
        let closed = sock_destroy::destroy(&cookies).with_context(|| format!("closing connections to {server}"))?;
        info!(%server, closed, "closed VIP connections");
        Ok(closed)
    }

    fn on_kernel_event(&mut self, event: &Event) {
        let vip = SocketAddr::from(event.vip);
        let server = SocketAddr::from(event.server);
        match event.kind {
            EVENT_ESTABLISHED => debug!(%vip, %server, "connection established"),
            EVENT_CLOSED => debug!(%vip, %server, "connection closed"),
            EVENT_CONNECT_FAILED => warn!(%vip, %server, "connect through the VIP failed; the kernel skips this server for its hold-down"),
            EVENT_CONNECT_TIMEOUT => warn!(%vip, %server, "connect through the VIP got no answer yet; the kernel skips this server for its hold-down"),
            other => warn!(kind = other, "unknown kernel event"),
        }
    }

    /// SIGHUP: apply a new config if it is valid; keep the old one if not.
    fn reload(&mut self) {
        let config = match Config::load(&self.config_path) {
            Ok(config) => config,
            Err(e) => {
                error!("reload failed; still serving the previous config:\n{e}");
                return;
            }
        };
        if config.daemon != self.config.daemon {
            warn!("[daemon] settings changed; they take effect at the next start");
        }
        match self.datapath.reconcile(&selections(&config)) {
            Ok(changes) => {
                info!(changes, "config reloaded");
                self.config.services = config.services;
            }
            Err(e) => error!("reload failed while writing the datapath: {e:#}"),
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
