//! The `lb` daemon and its command-line client.
//!
//! Where things are:
//! - `cli`: the command line;
//! - `config`: the TOML config and its validation;
//! - `balancer`: the server state machine (sans-I/O, simulated-time tests);
//! - `health`: active health checks (tcp, http, https);
//! - `state`: server lists set at runtime, kept across restarts;
//! - `daemon`: `lb run`, the task that owns all balancer state;
//! - `datapath`: loading, attaching, pinning and adopting the eBPF programs
//!   and reading and writing their maps (the programs are in `lb-ebpf`);
//! - `sock_destroy`: closing connections made through a VIP;
//! - `control`: the control socket protocol and `lb status`;
//! - `metrics`: Prometheus metrics.

pub mod balancer;
pub mod cli;
pub mod config;
pub mod control;
pub mod daemon;
pub mod datapath;
pub mod health;
pub mod metrics;
pub mod sock_destroy;
pub mod state;
