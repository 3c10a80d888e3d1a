//! The `lb` command line.

use std::{net::SocketAddr, path::PathBuf};

use clap::{Parser, Subcommand};

use crate::config::DEFAULT_CONFIG_PATH;

/// lb: a node-local, kernel-assisted load balancer. Programs connect to a
/// VIP; an eBPF program sends each connection straight to a chosen server.
#[derive(Debug, Parser)]
#[command(name = "lb", version)]
pub struct Cli {
    /// Log filter (e.g. `info`, `debug`, `lb_user=debug`); RUST_LOG wins if set.
    #[arg(long, global = true, default_value = "info")]
    pub log_level: String,

    /// Log lines as text or as JSON objects.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// For people.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon in the foreground: attach the datapath (or adopt a
    /// pinned one), write the services, serve the control socket.
    /// SIGHUP reloads the config; SIGTERM exits and leaves the datapath
    /// working (fail-static).
    Run {
        /// The config file (TOML).
        #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
        /// Forward the kernel programs' debug logs (one line per connect:
        /// for debugging only). Takes effect on a fresh attach.
        #[arg(long)]
        bpf_log: bool,
        /// On SIGTERM/SIGINT, detach everything instead of leaving the
        /// datapath working on the last selection.
        #[arg(long)]
        detach_on_exit: bool,
    },
    /// Show services, selections and live connections.
    Status {
        /// The config file, to find the daemon's control socket.
        #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Refresh every second until interrupted.
        #[arg(long)]
        watch: bool,
    },
    /// Make the daemon re-read its config (as SIGHUP does) and report
    /// whether it took; an invalid config changes nothing.
    Reload {
        /// The config file, to find the daemon's control socket.
        #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
    },
    /// Validate a config file without touching the kernel.
    CheckConfig {
        /// The config file (TOML).
        file: PathBuf,
    },
    /// Reset the connections made through a VIP to SERVER. Direct
    /// connections to SERVER are never touched.
    CloseConnections {
        /// The server, e.g. 127.0.0.1:16443.
        server: SocketAddr,
        /// Only connections through this service's VIP.
        #[arg(long)]
        service: Option<String>,
        /// The config file, to find the daemon's control socket.
        #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
    },
    /// Replace a service's server list (and default) at runtime. The list
    /// is kept in the state directory and survives restarts.
    Servers {
        /// The service's name.
        service: String,
        /// The new servers, e.g. 127.0.0.1:6443 127.0.0.2:6443.
        servers: Vec<SocketAddr>,
        /// The default server: kept as a last resort when not in the list.
        #[arg(long)]
        default: Option<SocketAddr>,
        /// The config file, to find the daemon's control socket.
        #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
    },
    /// Drain a server: no new connections while another server is usable;
    /// existing connections stay. `--undo` ends the drain.
    Drain {
        /// The service's name.
        service: String,
        /// The server to drain, e.g. 127.0.0.1:6443.
        server: SocketAddr,
        /// End the drain.
        #[arg(long)]
        undo: bool,
        /// The config file, to find the daemon's control socket.
        #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
    },
    /// Run BIRD for the daemon and stop it once the daemon has not renewed
    /// its routes for `[bgp] routes_outlive_daemon` (the daemon starts
    /// this; not for people).
    #[command(hide = true)]
    BgpSpeaker {
        /// BIRD's directory (`state_dir/bird`).
        #[arg(long)]
        dir: PathBuf,
        /// The BIRD binary.
        #[arg(long)]
        speaker: PathBuf,
    },
    /// Stop the daemon if it runs, detach the programs and remove every pin.
    Detach {
        /// The config file, to find the pins and the control socket.
        #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
    },
}
