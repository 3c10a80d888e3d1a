//! The `lb` daemon and its command-line client. ARCHITECTURE.md at the top
//! of the repository is the map; in short, top floor first (each module
//! uses only those below it):
//! - `client`: the subcommands that talk to a running daemon;
//! - `daemon/`: `lb run`, the owner loop, the one place that mutates
//!   balancer state and writes the maps (a folder: the loop and dispatch
//!   in `mod.rs`, one file per job beside it);
//! - `datapath/` (loading, attaching, pinning, adopting and upgrading the
//!   eBPF programs; map reads and writes), `metrics` (Prometheus), `health`
//!   (tcp, http, https and dns checks), `discovery/` (EndpointSlices, DNS), `routes`
//!   (the kernel's route to a server, over netlink),
//!   `status` (the status view and its table);
//! - `balancer` (the server state machine: sans-I/O, simulated-time tests),
//!   `cli` (the command line), `reload_plan` (a reload's plan: pure);
//! - `control` (the control socket protocol, client and server), `config`
//!   (the TOML file and the one validation of server lists);
//! - `sock_destroy` (closing VIP connections, with `netns` in pods'), `state` (server lists set at
//!   runtime, kept across restarts), `detach` (what makes `lb detach`
//!   final).
//!
//! Every public item is documented (`missing_docs`).
#![warn(missing_docs)]

pub mod announce;
pub mod balancer;
pub mod bgp;
pub mod cli;
pub mod client;
pub mod config;
pub mod control;
pub mod daemon;
pub mod datapath;
pub mod detach;
pub mod discovery;
pub mod election;
pub mod health;
pub mod interfaces;
pub mod loadbalancer;
pub mod maglev;
pub mod metrics;
pub mod nat_addresses;
pub mod nat_ports;
pub mod netns;
pub mod reload_plan;
pub mod routes;
pub mod sock_destroy;
pub mod state;
pub mod status;
