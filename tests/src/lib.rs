//! Harness for lb's privileged integration tests: throwaway cgroups, loopback
//! backends that say who they are, a client that runs inside the cgroup, and
//! a daemon under test, and [`ServiceBuilder`] for the services of its
//! config. Everything cleans up on drop, also when a test fails or panics.
//!
//! A test that needs root says so with [`privileged_test`] in place of
//! `#[test]` (the `lb-test-macros` crate): it skips with a printed reason
//! without root, and fails under `CI=true`.
//!
//! Leaks fail the test. Each guard ([`TestCgroup`], [`Client`], [`Daemon`],
//! the bpffs mount, [`in_new_netns`]) first does all the cleanup it can, then
//! checks that nothing is left (a cgroup, pins, a process, a process in the
//! namespace) and, if something is, panics with what and where; when the
//! test is already failing it prints the leak instead (a second panic
//! would abort the process and hide the first).
//!
//! Addresses: every test owns `127.77.<id>.0/24` (VIPs and backends), or
//! lives in a network namespace it created. Nothing leaves loopback.
//!
//! One module per concern, each importing only modules below it:
//! - [`load`], [`hardening`]: the load generators and the hostile clients
//!   of the stress, chaos and hardening tests, and [`hold_backend`], the
//!   backend that holds their tens of thousands of connections;
//! - [`fakes`]: what discovery talks to (a Kubernetes API server, DNS),
//!   and [`discovery_rig`], the discovery tests' services, slices and
//!   judges over them;
//! - [`resolvers`]: real DNS servers (dnsmasq) and resolvers (glibc, dig,
//!   musl) for the UDP tests;
//! - [`xdp_node`]: `lb_xdp` loaded once, on maps cleared between cases,
//!   in a namespace of the case's own, for the XDP fixtures and the
//!   program-time bench;
//! - [`lan`] (with [`arp`], who answers for a VIP) and [`topology`]: the
//!   network namespaces of the election and external-path tests and
//!   benches;
//! - [`packets`]: Ethernet frames for the XDP fixtures, built and checked,
//!   and [`raw`], frames sent or watched on an interface as they are;
//! - `daemon` ([`Daemon`]) over `bpffs` (its pins' mount);
//! - `client` ([`Client`], [`Connect`]) over `cgroup` ([`TestCgroup`]);
//! - `backend` ([`Backend`]), `service` ([`ServiceBuilder`]), `netns`
//!   ([`in_new_netns`]);
//! - at the ground: `env` (root, the binaries, addresses), `wait` (polling,
//!   the clock) and `leak` (how a guard reports what it found).

#[cfg(feature = "rigs")]
pub mod arp;
mod backend;
#[cfg(feature = "rigs")]
pub mod bgp_router;
mod bpffs;
mod cgroup;
mod client;
mod daemon;
pub mod discovery_rig;
mod env;
pub mod fakes;
pub mod hardening;
pub mod hold_backend;
#[cfg(feature = "rigs")]
pub mod lan;
mod leak;
pub mod load;
mod netns;
pub mod other_user;
pub mod packets;
#[cfg(feature = "rigs")]
pub mod pass_xdp;
pub mod raw;
pub mod resolvers;
#[cfg(feature = "rigs")]
pub mod rolling_update;
mod service;
pub mod supervisor;
#[cfg(feature = "rigs")]
pub mod topology;
mod wait;
#[cfg(feature = "rigs")]
pub mod xdp_node;

pub use backend::Backend;
pub use bpffs::files_under;
pub use cgroup::{TestCgroup, cgroup2_root, start_in_cgroup};
pub use client::{Client, Connect, tally};
pub use daemon::Daemon;
pub use env::{addr, client_bin, emulated, kernel_at_least, lb_bin, privileged};
pub use lb_test_macros::privileged_test;
pub use netns::{Namespace, NetnsGuard, in_new_netns, loopback_up, sh};
pub use service::{Check, Policy, ServiceBuilder};
pub use wait::{monotonic_ns, wait_every, wait_until};
