//! The owner-loop part: how long a kernel report waits for the daemon's
//! decision on it (the daemon's `lb_kernel_event_delay_seconds`), idle and
//! under load: a full socket table (65,536 connections through VIPs) with a
//! flood of metrics scrapes and `lb status` requests. The target: p99 under
//! 10 ms under that load. ("Full" leaves [`ROOM`] entries: a connect that
//! finds the table full reports nothing.)
//!
//! - Reports: [`EVENTS`] services per phase whose first server refuses
//!   (nothing listens on it; each service has its own); one connect
//!   through each, 5 ms apart, is one report each, so reports queue only behind the load, never behind each
//!   other.
//! - The full table: [`FILL_SERVICES`] services spread over
//!   [`FILL_SERVERS`] listeners each that never accept: their accept queues
//!   (4,096 deep) hold the connections, so no server socket takes a file
//!   descriptor, and [`FILL_AGENTS`] agents in the cgroup hold the client
//!   sockets (an unprivileged container's open-file limit per process may
//!   be as low as 20,000).
//! - The flood: scrapes back to back on one thread, a status request every
//!   100 ms on another (what a liveness probe and an eager dashboard do).
//!
//! The delays are the daemon's histogram, read by scrapes before and after
//! each phase; percentiles are interpolated within its buckets (each 1.5
//! times the one below), as Prometheus' `histogram_quantile` does.

use std::{
    net::{SocketAddr, TcpListener},
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::{Context as _, bail};
use lb_tests::{Daemon, Policy, ServiceBuilder, TestCgroup, load::scrape};

use super::{
    agent::Agent,
    limits::check_stop,
    results::{OwnerLoop, Results},
    status::status,
};

/// Reports per phase.
pub const EVENTS: usize = 400;
/// The size of the socket table: lb's default.
pub const TABLE: usize = 65_536;
const FILL_SERVICES: usize = 3;
const FILL_SERVERS: usize = 8;
const FILL_AGENTS: usize = 4;
/// Room left in the table for the reports' connects: a connect that
/// finds the table full is balanced but not followed, so it reports
/// nothing.
const ROOM: usize = 1_000;
/// Connections each agent holds: together the table but [`ROOM`].
const PER_AGENT: usize = (TABLE - ROOM) / FILL_AGENTS;
const METRIC: &str = "lb_kernel_event_delay_seconds";

fn ip(third: u8, fourth: u8, port: u16) -> SocketAddr {
    SocketAddr::from(([127, 78, third, fourth], port))
}

pub fn run(results: &mut Results) -> anyhow::Result<()> {
    println!(
        "==> owner loop: kernel report → decision, idle, then with a full socket table ({TABLE}) and a flood of scrapes"
    );
    // Listeners that never accept, with deep accept queues.
    let mut listeners = Vec::new();
    for i in 0..FILL_SERVICES * FILL_SERVERS {
        let listener = TcpListener::bind(ip(11, i as u8 + 1, 0)).context("binding a listener")?;
        // SAFETY: listen on a valid bound socket; only the backlog changes.
        unsafe { libc::listen(listener.as_raw_fd(), 4096) };
        listeners.push(listener);
    }
    let addrs: Vec<SocketAddr> =
        listeners.iter().map(TcpListener::local_addr).collect::<Result<_, _>>()?;
    let fill_vips: Vec<SocketAddr> = (0..FILL_SERVICES).map(|k| ip(12, k as u8 + 1, 80)).collect();
    let mut services = String::new();
    for (k, vip) in fill_vips.iter().enumerate() {
        let servers = &addrs[k * FILL_SERVERS..(k + 1) * FILL_SERVERS];
        services += &ServiceBuilder::new(&format!("ol-fill-{k}"), *vip)
            .servers(servers)
            .policy(Policy::Spread)
            .toml();
    }
    // Nothing listens on 127.78.13.1: every connect there is refused. Each
    // service has a port of its own (the kernel's failure marks are per
    // server, for every service).
    let live = TcpListener::bind(ip(13, 2, 0)).context("binding the live server")?;
    let event_vips: Vec<SocketAddr> =
        (0..2 * EVENTS).map(|i| ip(14 + (i / 200) as u8, (i % 200) as u8 + 1, 80)).collect();
    for (i, vip) in event_vips.iter().enumerate() {
        let refuses = ip(13, 1, 20_000 + i as u16);
        services += &ServiceBuilder::new(&format!("ol-event-{i}"), *vip)
            .servers(&[refuses, live.local_addr()?])
            .hold_down(Duration::from_secs(600))
            .toml();
    }
    let metrics = ip(13, 200, 9464);
    let cgroup = TestCgroup::new("bench-owner");
    let daemon = Daemon::start_with(
        "bench-owner",
        &cgroup,
        &format!("metrics = \"{metrics}\"\n"),
        &services,
    );
    let mut events = Agent::start(&cgroup.path)?;

    let before = histogram(metrics)?;
    reports(&mut events, &event_vips[..EVENTS])?;
    let idle = histogram(metrics)?;

    let mut holders = Vec::new();
    for _ in 0..FILL_AGENTS {
        check_stop()?;
        let mut agent = Agent::start(&cgroup.path)?;
        agent.hold(&fill_vips, PER_AGENT).context("filling the socket table")?;
        holders.push(agent);
    }
    let tracked = status(&daemon)?["datapath"]["tracked_sockets"]["tcp"].as_u64().unwrap_or(0);
    if tracked < (FILL_AGENTS * PER_AGENT) as u64 {
        bail!("the socket table holds {tracked} sockets, not {}", FILL_AGENTS * PER_AGENT);
    }
    let flood = Flood::start(&daemon, metrics);
    let during = reports(&mut events, &event_vips[EVENTS..]);
    let (scrapes, statuses) = flood.stop();
    during?;
    let loaded = histogram(metrics)?;
    for mut agent in holders {
        agent.release()?;
    }
    drop(listeners);

    results.owner_loop = Some(OwnerLoop {
        idle: delays(&before, &idle),
        loaded: delays(&idle, &loaded),
        tracked,
        scrapes,
        statuses,
    });
    Ok(())
}

/// One connect through each of `vips`, 5 ms apart; each must be refused
/// (one kernel report), and the daemon must have seen them all.
fn reports(agent: &mut Agent, vips: &[SocketAddr]) -> anyhow::Result<()> {
    for vip in vips {
        check_stop()?;
        match agent.try_land(*vip)? {
            Err(e) if e.contains("refused") => {}
            Ok(name) => bail!("a connect through {vip} was answered by {name}, not refused"),
            Err(e) => bail!("a connect through {vip} failed otherwise than refused: {e}"),
        }
        thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// The daemon's histogram of report delays: (upper bound in seconds,
/// cumulative count), `+Inf` last.
fn histogram(metrics: SocketAddr) -> anyhow::Result<Vec<(f64, f64)>> {
    // A scrape is shared for a second: wait for a fresh one.
    thread::sleep(Duration::from_millis(1100));
    let text = scrape(metrics).map_err(|e| anyhow::anyhow!("scraping {metrics}: {e}"))?;
    let prefix = format!("{METRIC}_bucket{{le=\"");
    let buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|line| {
            let (le, count) = line.strip_prefix(&prefix)?.split_once("\"} ")?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, count.split_whitespace().next()?.parse().ok()?))
        })
        .collect();
    if buckets.is_empty() {
        bail!("the daemon's metrics have no {METRIC}");
    }
    Ok(buckets)
}

/// The reports between two readings of the histogram: (count, p50, p99)
/// in milliseconds.
pub fn delays(before: &[(f64, f64)], after: &[(f64, f64)]) -> (usize, f64, f64) {
    let counts: Vec<(f64, f64)> =
        after.iter().zip(before).map(|(&(le, a), &(_, b))| (le, a - b)).collect();
    let total = counts.last().map_or(0.0, |&(_, n)| n);
    let quantile = |q: f64| {
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(le, n) in &counts {
            if n >= rank && n > lower.1 {
                if le.is_infinite() {
                    return lower.0 * 1e3;
                }
                return (lower.0 + (le - lower.0) * (rank - lower.1) / (n - lower.1)) * 1e3;
            }
            lower = (le, n);
        }
        f64::NAN
    };
    (total as usize, quantile(0.5), quantile(0.99))
}

/// Scrapes back to back, and a status every 100 ms, until stopped.
struct Flood {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<usize>>,
}

impl Flood {
    fn start(daemon: &Daemon, metrics: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let scrapes = {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) && check_stop().is_ok() {
                    n += usize::from(scrape(metrics).is_ok());
                }
                n
            })
        };
        let socket = daemon.dir.join("lb.sock");
        let statuses = {
            let (stop, done) = (Arc::clone(&stop), Arc::new(AtomicUsize::new(0)));
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) && check_stop().is_ok() {
                    if super::status::status_at(&socket).is_ok() {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    thread::sleep(Duration::from_millis(100));
                }
                done.load(Ordering::Relaxed)
            })
        };
        Self { stop, threads: vec![scrapes, statuses] }
    }

    /// Stops both threads: (scrapes, statuses) answered.
    fn stop(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        let mut counts = self.threads.into_iter().map(|t| t.join().unwrap_or(0));
        (counts.next().unwrap_or(0), counts.next().unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_interpolated_within_buckets() {
        let before = [(0.001, 0.0), (0.002, 0.0), (0.004, 0.0), (f64::INFINITY, 0.0)];
        // 100 reports: 50 up to 1 ms, 40 in (1, 2] ms, 10 in (2, 4] ms.
        let after = [(0.001, 50.0), (0.002, 90.0), (0.004, 100.0), (f64::INFINITY, 100.0)];
        let (n, p50, p99) = delays(&before, &after);
        assert_eq!(n, 100);
        assert!((p50 - 1.0).abs() < 1e-9, "{p50}");
        assert!((p99 - 3.8).abs() < 1e-9, "{p99}");
    }
}
