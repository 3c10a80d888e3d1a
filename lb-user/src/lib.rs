//! The `lb` daemon and its command-line client.
//!
//! Where things are:
//! - `cli`: the command line;
//! - `config`: the TOML config and its validation;
//! - `daemon`: `lb run`, the task that owns all balancer state;
//! - `datapath`: loading, attaching, pinning and adopting the eBPF programs
//!   and reading and writing their maps (the programs are in `lb-ebpf`);
//! - `sock_destroy`: closing connections made through a VIP;
//! - `control`: the control socket protocol and `lb status`.

pub mod cli;
pub mod config;
pub mod control;
pub mod daemon;
pub mod datapath;
pub mod sock_destroy;
