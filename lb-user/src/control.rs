//! The control socket: a Unix stream socket (mode 0600) carrying one JSON
//! request and one JSON response per line. `lb status`, `lb detach` and the
//! other client subcommands talk to the daemon through it.

use std::{collections::BTreeMap, net::SocketAddr, path::Path, time::Duration};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader},
    net::UnixStream,
};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum Request {
    Status,
    /// Reset the connections made through a VIP to `server` (of one service
    /// when `service` is set; of every service otherwise).
    CloseConnections { server: SocketAddr, service: Option<String> },
    /// Replace a service's server list (and default). Unchanged sets are a no-op.
    SetServers { service: String, servers: Vec<SocketAddr>, default: Option<SocketAddr> },
    /// Drain a server (no new connections unless nothing else is usable;
    /// existing ones stay), or undo that.
    Drain { service: String, server: SocketAddr, undo: bool },
    /// Re-read the config file (as SIGHUP does) and say how it went.
    Reload,
    /// Exit, leaving the datapath pinned and working.
    Shutdown,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    Status(Status),
    Closed { closed: u64 },
    Ok,
    Error { error: String },
}

/// `lb status --json`. Fields are only ever added, never changed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub services: Vec<ServiceStatus>,
    #[serde(default)]
    pub datapath: DatapathStatus,
    #[serde(default)]
    pub config: ConfigStatus,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigStatus {
    pub path: String,
    /// The last reload (SIGHUP or `lb reload`), if any.
    pub last_reload: Option<ReloadStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadStatus {
    pub ok: bool,
    /// Why it failed (the old config keeps serving), or `null`.
    pub error: Option<String>,
    /// Seconds since the Unix epoch.
    pub at: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub name: String,
    pub vip: SocketAddr,
    pub policy: String,
    /// The selection in the kernel, best first.
    pub selected: Vec<SocketAddr>,
    pub servers: Vec<ServerStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerStatus {
    pub address: SocketAddr,
    /// Live connections through the VIP to this server.
    pub connections: i64,
    /// `active`, `preferred`, `healthy`, `recovering`, `unchecked`,
    /// `standby`, `failed` (see the balancer).
    pub state: String,
    /// Result of the last health check; `null` until one is known.
    pub healthy: Option<bool>,
    /// Error of the last failed health check, or `null`.
    pub last_check: Option<String>,
    /// `ready`, `serving` (drained) or `terminating`.
    pub readiness: String,
    pub default: bool,
    /// A connect to it through a VIP failed within the hold-down; the
    /// kernel skips it while another server is usable.
    pub recently_failed: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatapathStatus {
    pub cgroup: String,
    pub bpffs: String,
    /// The programs were already attached when this daemon started.
    pub adopted: bool,
    /// The kernel's per-reason decision counters.
    pub counters: BTreeMap<String, u64>,
    /// Optional kernel features and whether this kernel has them.
    #[serde(default)]
    pub features: Features,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Features {
    /// getpeername hooks (Linux 5.8+): applications see the VIP as peer.
    pub getpeername: bool,
    /// Netlink SOCK_DESTROY (CONFIG_INET_DIAG_DESTROY): closing connections.
    pub sock_destroy: bool,
}

/// Sends one request to the daemon behind `socket` and returns its answer.
pub async fn call(socket: &Path, request: &Request) -> anyhow::Result<Response> {
    let stream = tokio::time::timeout(Duration::from_secs(5), UnixStream::connect(socket))
        .await
        .with_context(|| format!("timed out connecting to {}", socket.display()))?
        .with_context(|| format!("cannot reach the lb daemon at {} (is `lb run` running with this config?)", socket.display()))?;
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_string(request)?;
    line.push('\n');
    write.write_all(line.as_bytes()).await?;
    let mut answer = String::new();
    let mut reader = BufReader::new(read);
    tokio::time::timeout(Duration::from_secs(30), reader.read_line(&mut answer))
        .await
        .context("the daemon did not answer within 30 s")??;
    if answer.is_empty() {
        bail!("the daemon closed the control connection without answering");
    }
    serde_json::from_str(&answer).with_context(|| format!("unexpected answer from the daemon: {answer}"))
}

impl Status {
    /// The human-readable table of `lb status`.
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        if self.services.is_empty() {
            out.push_str("no services configured\n");
        }
        for s in &self.services {
            let selected: Vec<String> = s.selected.iter().map(ToString::to_string).collect();
            let _ = writeln!(out, "{}  vip {}  policy {}  selected [{}]", s.name, s.vip, s.policy, selected.join(", "));
            let _ = writeln!(out, "  {:<42} {:<10} {:<8} {:>11}  NOTES", "SERVER", "STATE", "HEALTHY", "CONNECTIONS");
            for server in &s.servers {
                let mut notes = Vec::new();
                if server.default {
                    notes.push("default".to_owned());
                }
                if server.readiness != "ready" {
                    notes.push(server.readiness.clone());
                }
                if server.recently_failed {
                    notes.push("connect failed recently".to_owned());
                }
                if let Some(error) = &server.last_check {
                    notes.push(format!("last check: {error}"));
                }
                let healthy = match server.healthy {
                    Some(true) => "yes",
                    Some(false) => "no",
                    None => "-",
                };
                let _ = writeln!(
                    out,
                    "  {:<42} {:<10} {:<8} {:>11}  {}",
                    server.address.to_string(),
                    server.state,
                    healthy,
                    server.connections,
                    notes.join("; ")
                );
            }
        }
        if let Some(reload) = &self.config.last_reload {
            match &reload.error {
                None => {
                    let _ = writeln!(out, "config: last reload ok");
                }
                Some(error) => {
                    let _ = writeln!(out, "config: LAST RELOAD FAILED; still serving the previous config:\n{error}");
                }
            }
        }
        let _ = writeln!(
            out,
            "datapath: cgroup {}  pins {}{}",
            self.datapath.cgroup,
            self.datapath.bpffs,
            if self.datapath.adopted { "  (adopted from a previous run)" } else { "" }
        );
        for (name, present) in [("getpeername hooks", self.datapath.features.getpeername), ("closing connections (SOCK_DESTROY)", self.datapath.features.sock_destroy)] {
            if !present {
                let _ = writeln!(out, "degraded: this kernel lacks {name}");
            }
        }
        out
    }
}
