//! `cargo xtask bench`: the one place for speed. What lb costs an
//! application, side by side with what it replaces, in one run on one
//! machine, as ratios against a direct connection measured in the same run
//! (absolute figures depend on the machine and its load; ratios much less).
//!
//! Parts (each can be run alone with `--only`):
//! - **paths** ([`workloads`], over the routes of [`paths`]): direct; direct
//!   from inside the attached cgroup (not a VIP); through the lb VIP; through
//!   haproxy (mode tcp) and nginx (stream) configured as node-local proxies
//!   are. Workloads: wrk keep-alive and one new connection per request
//!   against an nginx origin (req/s, p99), connect + close against a Rust
//!   sink, 1 GiB bulk from a Rust source. Medians of alternated rounds. Also
//!   the daemon's CPU per 10,000 VIP connects, and (with `bpftool`) each lb
//!   program's runs and run time per connect.
//! - **scale** ([`scale`]): time from `lb run` to every service in status at
//!   1,000, 10,000 and 16,384 services, RSS, connects/s through one VIP with
//!   1,000 services vs 1, time for a reload changing one service of 10,000
//!   to reach the kernel.
//! - **failover** ([`failover`]): killing the selected server, the kernel's
//!   reaction (first successful connect elsewhere) and the daemon's (health
//!   checks every 100 ms; selection changed in status), p50/p99.
//! - **discovery** ([`discovery`]): EndpointSlice change at a fake API server
//!   to the kernel's new selection, p50/p99; updates/s for 1,000 services × 10
//!   endpoints.
//! - **owner** ([`owner`]): how long a kernel report waits for the
//!   daemon's decision, idle and with a full socket table and a flood of
//!   scrapes and status requests, p50/p99.
//! - **dns** ([`dns`]): DNS queries per second with dnsperf against one
//!   dnsmasq server: direct, through a VIP (unconnected UDP), through a
//!   dnsmasq forwarder; lb's program time per query.
//! - **external** ([`external_path`]): the XDP program's time per packet (first
//!   of a flow, established, reply, not ours), under `BPF_PROG_TEST_RUN`;
//!   connects and requests per second from a client namespace through the
//!   node by plain routing, lb's external VIP, IPVS (NAT) and haproxy.
//! - **election** ([`election`]): the node announcing an external VIP dies;
//!   how long until a client's connect is answered by another node (and
//!   the new holder's first ARP answer), p50/p99 over repeated deaths; the
//!   Lease requests per second one VIP costs the API server; and the
//!   elections by membership beside per-VIP Leases at 1, 50 and 200 VIPs
//!   (requests by verb, watch events), with their takeover at 200 VIPs.
//! - **load-balancers** ([`load_balancers`]): LoadBalancer Services on
//!   three nodes: a Service's creation to its address in its status, to
//!   a node claiming it, to the first connect from another machine
//!   answered, p50/p99 over 100 Services; the API load with all served.
//! - **bgp** ([`bgp`]): connects per second through one node announcing
//!   by ARP and one, two and three by BGP (a router spreading over them),
//!   in the same run; a node's death to the router withdrawing it (BFD),
//!   p50/p99.
//!
//! Output: a table on stdout, `target/bench/report.md` and the plot
//! `target/bench/ratios.svg` ([`report`]). The targets ([`targets`]) are
//! PASS/MISS lines; a miss never fails the run. The run fails only if
//! something did not work: a connect that landed on the wrong server, a
//! transfer that lost bytes, a daemon that did not come up.
//!
//! Machine rules: root, loopback only (`127.78.0.0/16` for the routes, other
//! `127.x` ranges for the scale and discovery services), the bench's own
//! throwaway cgroups and pins (the integration tests' guards, `lb-tests`),
//! its own haproxy and nginx processes in the foreground with configs under
//! `target/bench/`, all removed on every path, Ctrl-C included (it sets a
//! flag that every loop checks; the guards then clean up). Every step has a
//! time limit.

// Top floor first: each module imports only modules below it in this
// list, and no two import each other.
mod agent;
mod args;
mod bgp;
mod bpf_stats;
mod client;
mod discovery;
mod dns;
mod election;
mod external_path;
mod external_tables;
mod failover;
mod format;
mod host;
mod limits;
mod load_balancers;
mod owner;
mod paths;
mod plot;
mod report;
mod results;
mod scale;
mod stats;
mod status;
mod table;
mod tables;
mod targets;
mod workloads;

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
pub use args::Args;
use args::Part;
pub use client::client_main;
use limits::{STARTED, STOP, check_stop};

pub fn run(args: &Args) -> anyhow::Result<()> {
    if !crate::cmd::is_root() {
        bail!("the benchmark attaches the datapath to cgroups and runs proxies: run it as root");
    }
    // Ctrl-C only sets the flag; the steps stop at their next check and the
    // guards take everything down. (The proxies run in process groups of
    // their own, so the terminal's SIGINT does not reach them first.)
    let _ = ctrlc::set_handler(|| STOP.store(true, Ordering::Relaxed));
    let parts: Vec<Part> = if args.only.is_empty() {
        vec![
            Part::Paths,
            Part::Scale,
            Part::Failover,
            Part::Discovery,
            Part::Owner,
            Part::Dns,
            Part::External,
            Part::Election,
            Part::LoadBalancers,
            Part::Bgp,
        ]
    } else {
        args.only.clone()
    };

    // The daemon is off the data path, but it handles kernel events on the
    // same CPUs: measured as shipped, optimized.
    crate::cargo::cargo(&["build", "--release", "--package", "lb-user"])?;
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("LB_BIN", crate::cmd::target_dir().join("release/lb")) };
    // The time limit and the reported duration start after the build.
    let (started, _) = *STARTED.get_or_init(|| (Instant::now(), time_limit(args)));
    let dir = crate::cmd::target_dir().join("bench");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    agent::client_exe()?;
    if parts.contains(&Part::Paths) {
        paths::ensure_packages()?;
    }
    let mut results = results::Results::new(args, &parts);
    let origins = paths::Origins::start()?;
    for part in &parts {
        check_stop()?;
        let part_started = Instant::now();
        match part {
            Part::Paths => workloads::run(args, &dir, &origins, &mut results)?,
            Part::Scale => scale::run(args, &origins, &mut results)?,
            Part::Failover => failover::run(&mut results)?,
            Part::Discovery => discovery::run(&mut results)?,
            Part::Owner => owner::run(&mut results)?,
            Part::Dns => dns::run(args.rounds, &dir, &mut results)?,
            Part::External => external_path::run(&mut results)?,
            Part::Election => election::run(&mut results)?,
            Part::LoadBalancers => load_balancers::run(&mut results)?,
            Part::Bgp => bgp::run(&mut results)?,
        }
        println!("    ({:?} took {:.0} s)", part, part_started.elapsed().as_secs_f64());
    }
    results.duration = started.elapsed();
    report::write(&results, &dir)
}

/// The whole run may not take longer than this, whatever happens (each
/// step has its own, shorter limit; this is the backstop): 10 minutes,
/// and per round three times what the round's wrk runs take, plus a
/// minute for the rest of the round.
fn time_limit(args: &Args) -> Duration {
    let wrk = 2 * paths::Route::ALL.len() as u64 * workloads::WRK_RUNS as u64;
    let round = 3 * wrk * (args.wrk_seconds + 1) + 60;
    Duration::from_secs(600 + u64::from(args.rounds) * round)
}
