//! The paths part: every workload over every route, in rounds (round 1
//! runs each route once, round 2 each again in the reverse order...) so
//! that a change in the machine's load hits the routes alike. A route's
//! figure is the median of its runs; its ratio to direct is the median of
//! its paired ratios (each run over the direct run of the same round),
//! with their interquartile range as the spread. Short runs, many rounds:
//! what drifts over seconds on a shared machine cancels out of a pair.
//!
//! - wrk keep-alive and wrk with `Connection: close` (one new connection per
//!   request) against the nginx origin: req/s and p99 latency (`--latency`);
//!   2 threads, 16 connections; [`WRK_RUNS`] runs per route and round;
//! - connect + close: [`CONNECTS`] connects per route and round, each
//!   waiting for the sink to close, in [`CONNECT_SLICES`] slices, each
//!   slice right next to a direct one ([`Pairs::Adjacent`]); every connect
//!   must reach the sink;
//! - bulk: [`BULK`] bytes from the source on one connection, every byte
//!   counted; [`BULK_REPEATS`] transfers per route and round, alternated.
//!
//! Connects and transfers are made by one `bench-client` agent, started
//! once, which moves into the cgroup for the cgroup and VIP routes and out
//! of it for the others: the same process, so that only the route differs
//! (two processes differ by where the scheduler keeps them, up to 20 % in a
//! connect loop on this 2-CPU machine). wrk starts inside the cgroup for
//! those routes. Every client, origin and proxy runs on one CPU
//! (`paths_cpu` says why).
//! Also measured: the daemon's CPU time (utime + stime) during the VIP and
//! in-cgroup connect rounds, and with `bpftool`, one extra round each with
//! `kernel.bpf_stats_enabled=1` for each lb program's runs and run time.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, bail};
use lb_tests::{Daemon, ServiceBuilder, TestCgroup};
use serde_json::Value;

use super::{
    agent::Agent,
    args::Args,
    bpf_stats::{BpfStats, attached_programs, program_stats},
    host::{cpu_time, own_cgroup, paths_cpu, start_on_cpu},
    limits::{check_stop, output_within},
    paths::{BULK, Origins, Route, Servers, VIP_IP, versions},
    results::{Figure, KeepAliveCost, KernelCost, Results, Workload},
    stats::{median, percentile},
    status::status,
};

/// Connects per route in a connect + close round.
pub const CONNECTS: u64 = 10_000;
/// Slices a connect + close round is cut into per route (250 connects, a
/// few tens of milliseconds each), each paired with a direct slice.
pub const CONNECT_SLICES: usize = 40;
/// wrk runs per route and round, alternated.
pub const WRK_RUNS: usize = 3;
/// Bulk transfers per route and round, alternated between the routes.
pub const BULK_REPEATS: usize = 3;

pub fn run(
    args: &Args,
    dir: &Path,
    origins: &Origins,
    results: &mut Results,
) -> anyhow::Result<()> {
    println!("==> paths: starting the origins, haproxy and nginx");
    results.versions = versions();
    let servers = Servers::start(dir, origins)?;
    let cgroup = TestCgroup::new("bench");
    let vip = |rank: u16| SocketAddr::from((VIP_IP, 80 + rank));
    let services = [
        ("bench-http", servers.http),
        ("bench-connect", servers.sink),
        ("bench-bulk", servers.source),
    ]
    .iter()
    .zip(0..)
    .map(|((name, server), rank)| ServiceBuilder::new(name, vip(rank)).servers(&[*server]).toml())
    .collect::<String>();
    // RUST_LOG as shipped (the harness's default is debug logging).
    let daemon = Daemon::start_with_env("bench", &cgroup, "", &[("RUST_LOG", "info")], &services);
    let active =
        |status: &Value| (0..3).all(|i| status["services"][i]["servers"][0]["state"] == "active");
    if !lb_tests::wait_until(Duration::from_secs(10), || active(&daemon.status())) {
        bail!("the daemon did not make the servers active; its log:\n{}", daemon.log());
    }
    let pid = daemon.pid().context("the daemon is not running")?;
    let bench = Bench { cgroup: &cgroup.path, rounds: args.rounds as usize };
    let mut client = Client::start(&cgroup.path)?;

    let duration = args.wrk_seconds;
    println!("==> wrk keep-alive, {duration} s per run, {} rounds of {WRK_RUNS}", args.rounds);
    let figures = bench.rounds_of(bench.rounds * WRK_RUNS, Pairs::PerRound, |route| {
        wrk(bench.cgroup_of(route), route.target(servers.http, 0), duration, false)
            .map(|w| w.sample())
    })?;
    results.paths.push((Workload::KeepAlive, figures));

    println!(
        "==> wrk, one new connection per request, {duration} s per run, {} rounds of {WRK_RUNS}",
        args.rounds
    );
    let mut vip_cpu = (Duration::ZERO, 0u64);
    let figures = bench.rounds_of(bench.rounds * WRK_RUNS, Pairs::PerRound, |route| {
        let before = cpu_time(pid)?;
        let w = wrk(bench.cgroup_of(route), route.target(servers.http, 0), duration, true)?;
        if route == Route::Vip {
            vip_cpu.0 += cpu_time(pid)? - before;
            vip_cpu.1 += w.requests;
        }
        Ok(w.sample())
    })?;
    results.paths.push((Workload::NewConnection, figures));
    results.daemon_cpu.push((
        "wrk, new connection per request, through the VIP".to_owned(),
        vip_cpu.0,
        vip_cpu.1,
    ));

    println!(
        "==> connect + close, {CONNECTS} per round, {} rounds of {CONNECT_SLICES} alternated slices",
        args.rounds
    );
    let mut cpu = [(Duration::ZERO, 0u64); 2];
    // Short slices, each next to a direct one: a connect loop is the
    // workload most moved by whatever else the machine does.
    let slice = CONNECTS / CONNECT_SLICES as u64;
    let figures = bench.rounds_of(bench.rounds * CONNECT_SLICES, Pairs::Adjacent, |route| {
        let before = (cpu_time(pid)?, origins.sink.accepted());
        let took = client.of(route)?.connects(route.target(servers.sink, 1), slice)?;
        let accepted = (origins.sink.accepted() - before.1) as u64;
        if accepted != slice {
            bail!("{slice} connects {}, but the sink accepted {accepted}", route.label());
        }
        if let Some(slot) = match route {
            Route::Vip => Some(0),
            Route::Cgroup => Some(1),
            _ => None,
        } {
            cpu[slot].0 += cpu_time(pid)? - before.0;
            cpu[slot].1 += slice;
        }
        Ok(Sample { value: slice as f64 / took.as_secs_f64(), p99_ms: None })
    })?;
    results.paths.push((Workload::Connect, figures));
    results.daemon_cpu.push(("connect + close through the VIP".to_owned(), cpu[0].0, cpu[0].1));
    results.daemon_cpu.push((
        "connect + close direct, in the cgroup".to_owned(),
        cpu[1].0,
        cpu[1].1,
    ));

    println!(
        "==> bulk transfer, {} MiB per transfer, {BULK_REPEATS} per round, {} rounds",
        BULK >> 20,
        args.rounds
    );
    // Each transfer is short (under a second): repeated, alternated, so
    // that one slow moment does not decide a route's figure.
    let figures = bench.rounds_of(bench.rounds * BULK_REPEATS, Pairs::PerRound, |route| {
        let took = client.of(route)?.bulk(route.target(servers.source, 2), BULK)?;
        Ok(Sample { value: BULK as f64 / took.as_secs_f64() / 1e9, p99_ms: None })
    })?;
    results.paths.push((Workload::Bulk, figures));

    println!("==> kernel cost per connect (bpf_stats)");
    match kernel_cost(&bench, &mut client, &servers, origins, duration) {
        Ok((costs, keepalive)) => {
            results.kernel_cost = costs;
            results.keepalive_cost = Some(keepalive);
        }
        Err(e) => results.notes.push(format!("kernel cost per program not measured: {e:#}")),
    }
    // The daemon must have kept up: every service still has its server.
    let status = status(&daemon)?;
    for i in 0..3 {
        if status["services"][i]["selected"].as_array().is_none_or(Vec::is_empty) {
            bail!(
                "after the paths part, service {} has no selection: {status}",
                status["services"][i]["name"]
            );
        }
    }
    Ok(())
}

/// One run of a workload over one route.
#[derive(Clone, Copy)]
struct Sample {
    /// Requests/s, connects/s or GB/s.
    value: f64,
    /// wrk's 99th percentile latency.
    p99_ms: Option<f64>,
}

struct Bench<'a> {
    cgroup: &'a Path,
    rounds: usize,
}

impl Bench<'_> {
    fn cgroup_of(&self, route: Route) -> Option<&Path> {
        route.in_cgroup().then_some(self.cgroup)
    }

    /// Runs `measure` over every route, `rounds` rounds, its runs paired
    /// with direct runs as `pairs` says; the median of each route's figures
    /// (and of its p99s), and the median and interquartile range of its
    /// paired ratios to direct.
    fn rounds_of(
        &self,
        rounds: usize,
        pairs: Pairs,
        mut measure: impl FnMut(Route) -> anyhow::Result<Sample>,
    ) -> anyhow::Result<Vec<(Route, Figure)>> {
        let direct = Route::ALL.iter().position(|r| *r == Route::Direct).unwrap_or(0);
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); Route::ALL.len()];
        let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); Route::ALL.len()];
        let mut run = |i: usize| -> anyhow::Result<f64> {
            check_stop()?;
            let route = Route::ALL[i];
            let sample = measure(route).with_context(|| format!("route {}", route.label()))?;
            samples[i].push(sample);
            Ok(sample.value)
        };
        for round in 0..rounds {
            // Forwards, then backwards: what drifts during a round (the
            // machine's load, the TIME_WAIT sockets that each connect
            // leaves on loopback) favours no route, not even the first.
            let forwards = round % 2 == 0;
            let order: Vec<usize> = if forwards {
                (0..Route::ALL.len()).collect()
            } else {
                (0..Route::ALL.len()).rev().collect()
            };
            match pairs {
                Pairs::PerRound => {
                    let mut values = vec![f64::NAN; Route::ALL.len()];
                    for i in order {
                        values[i] = run(i)?;
                    }
                    for (i, value) in values.iter().enumerate() {
                        ratios[i].push(value / values[direct]);
                    }
                }
                Pairs::Adjacent => {
                    for i in order.into_iter().filter(|i| *i != direct) {
                        let (baseline, value) = if forwards {
                            (run(direct)?, run(i)?)
                        } else {
                            let value = run(i)?;
                            (run(direct)?, value)
                        };
                        ratios[i].push(value / baseline);
                        ratios[direct].push(1.0);
                    }
                }
            }
        }
        let figures = Route::ALL
            .iter()
            .zip(samples.iter().zip(&ratios))
            .map(|(route, (mine, ratios))| {
                let values: Vec<f64> = mine.iter().map(|f| f.value).collect();
                let p99s: Vec<f64> = mine.iter().filter_map(|f| f.p99_ms).collect();
                (
                    *route,
                    Figure {
                        value: median(&values),
                        p99_ms: (!p99s.is_empty()).then(|| median(&p99s)),
                        ratio: median(ratios),
                        spread: (percentile(ratios, 25.0), percentile(ratios, 75.0)),
                    },
                )
            })
            .collect::<Vec<_>>();
        for (route, figure) in &figures {
            println!("  {:<22} {}", route.label(), figure.describe());
        }
        Ok(figures)
    }
}

/// How [`Bench::rounds_of`] pairs a route's runs with direct runs. Paired
/// with a baseline taken moments before or after it, a ratio is spared the
/// machine's slower drifts, which a ratio of two medians is not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pairs {
    /// One direct run per round, and every route's run of the round is
    /// paired with it.
    PerRound,
    /// A direct run right next to every run of every other route (before
    /// it in one round, after it in the next): twice the direct runs, and
    /// each pair only one run apart, for the workload whose runs are
    /// shortest and most moved by the machine (connect + close).
    Adjacent,
}

/// The bench's agent, which makes every connect and transfer of every
/// route: one process, so that which CPU a process happens to share with
/// the server does not differ between routes. It moves into the attached
/// cgroup for the routes that start there, and back out for the others.
struct Client {
    agent: Agent,
    /// Where it starts: this process's own cgroup.
    home: PathBuf,
    cgroup: PathBuf,
    inside: bool,
}

impl Client {
    fn start(cgroup: &Path) -> anyhow::Result<Self> {
        let home = own_cgroup()?;
        let mut agent = Agent::start(&home)?;
        agent.pin(paths_cpu()?)?;
        Ok(Self { agent, home, cgroup: cgroup.to_owned(), inside: false })
    }

    /// The agent, in the cgroup that `route` starts in.
    fn of(&mut self, route: Route) -> anyhow::Result<&mut Agent> {
        if route.in_cgroup() != self.inside {
            let to = if route.in_cgroup() { &self.cgroup } else { &self.home };
            self.agent.enter(to)?;
            self.inside = route.in_cgroup();
        }
        Ok(&mut self.agent)
    }
}

/// What one wrk run reported.
struct WrkRun {
    requests: u64,
    per_second: f64,
    p99_ms: f64,
}

impl WrkRun {
    fn sample(&self) -> Sample {
        Sample { value: self.per_second, p99_ms: Some(self.p99_ms) }
    }
}

/// `wrk -t2 -c16 -dSECONDS --latency http://ADDR/`, inside `cgroup` if
/// given; with `close`, `Connection: close` (one connection per request).
/// Errors on any non-2xx answer or failed connect: a request that did not
/// reach the origin is not a figure.
fn wrk(
    cgroup: Option<&Path>,
    addr: SocketAddr,
    seconds: u64,
    close: bool,
) -> anyhow::Result<WrkRun> {
    let mut cmd = Command::new("wrk");
    cmd.args(["-t2", "-c16", &format!("-d{seconds}s"), "--timeout", "5s", "--latency"]);
    if close {
        cmd.args(["-H", "Connection: close"]);
    }
    cmd.arg(format!("http://{addr}/"));
    if let Some(cgroup) = cgroup {
        lb_tests::start_in_cgroup(&mut cmd, cgroup);
    }
    start_on_cpu(&mut cmd, paths_cpu()?);
    let out = output_within(&mut cmd, Duration::from_secs(seconds + 20))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("wrk {addr} failed: {}{}", text.trim(), String::from_utf8_lossy(&out.stderr).trim());
    }
    parse_wrk(&text).with_context(|| format!("wrk {addr} said:\n{text}"))
}

fn parse_wrk(text: &str) -> anyhow::Result<WrkRun> {
    let mut run = WrkRun { requests: 0, per_second: f64::NAN, p99_ms: f64::NAN };
    for line in text.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["Requests/sec:", value] => run.per_second = value.parse()?,
            ["99%", value] => run.p99_ms = wrk_ms(value)?,
            [n, "requests", "in", ..] => run.requests = n.parse()?,
            ["Non-2xx", "or", "3xx", "responses:", n] => bail!("{n} answers were not 2xx"),
            ["Socket", "errors:", "connect", n, ..] if *n != "0," => {
                bail!("failed connects: {line}")
            }
            _ => {}
        }
    }
    if run.requests == 0 || run.per_second.is_nan() || run.p99_ms.is_nan() {
        bail!("no requests, rate or p99 in wrk's output");
    }
    Ok(run)
}

/// wrk's latency (`850.00us`, `1.20ms`, `2.00s`) in milliseconds.
fn wrk_ms(value: &str) -> anyhow::Result<f64> {
    let split =
        value.find(|c: char| c.is_ascii_alphabetic()).context("a latency without a unit")?;
    let (number, unit) = value.split_at(split);
    let number: f64 = number.parse()?;
    Ok(match unit {
        "us" => number / 1e3,
        "ms" => number,
        "s" => number * 1e3,
        "m" => number * 60e3,
        _ => bail!("unknown latency unit in {value}"),
    })
}

/// With `bpftool`: one more connect + close round through the VIP and one
/// direct from inside the cgroup, each with `kernel.bpf_stats_enabled=1`;
/// per attached lb program, its runs and run time per connect. And one wrk
/// keep-alive run of `seconds` through the VIP: its requests, and the runs
/// and run time of all lb programs during it (after its connects, lb has
/// nothing to do).
fn kernel_cost(
    bench: &Bench,
    client: &mut Client,
    servers: &Servers,
    origins: &Origins,
    seconds: u64,
) -> anyhow::Result<(Vec<KernelCost>, KeepAliveCost)> {
    if Command::new("bpftool").arg("version").output().is_err() {
        bail!("bpftool is not installed (Debian package bpftool)");
    }
    let programs = attached_programs(bench.cgroup)?;
    let _stats = BpfStats::enable()?;
    let mut costs = Vec::new();
    for route in [Route::Vip, Route::Cgroup] {
        check_stop()?;
        let before = program_stats(&programs)?;
        let before_accepted = origins.sink.accepted();
        client.of(route)?.connects(route.target(servers.sink, 1), CONNECTS)?;
        let accepted = (origins.sink.accepted() - before_accepted) as u64;
        if accepted != CONNECTS {
            bail!("{CONNECTS} connects {}, but the sink accepted {accepted}", route.label());
        }
        let after = program_stats(&programs)?;
        for ((name, (cnt0, ns0)), (_, (cnt1, ns1))) in before.iter().zip(&after) {
            costs.push(KernelCost {
                route,
                program: name.clone(),
                runs_per_connect: (cnt1 - cnt0) as f64 / CONNECTS as f64,
                ns_per_connect: (ns1 - ns0) as f64 / CONNECTS as f64,
            });
        }
    }
    check_stop()?;
    let before = program_stats(&programs)?;
    let run = wrk(Some(bench.cgroup), Route::Vip.target(servers.http, 0), seconds, false)?;
    let after = program_stats(&programs)?;
    let total = |stats: &[(String, (u64, u64))]| {
        stats.iter().fold((0, 0), |(runs, ns), (_, (r, n))| (runs + r, ns + n))
    };
    let ((runs0, ns0), (runs1, ns1)) = (total(&before), total(&after));
    Ok((costs, KeepAliveCost { requests: run.requests, runs: runs1 - runs0, ns: ns1 - ns0 }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every route's ratio is its own run over its paired direct run, and
    /// `Adjacent` runs direct once per other route.
    #[test]
    fn rounds_pair_each_run_with_a_direct_one() {
        let bench = Bench { cgroup: Path::new("/nonexistent"), rounds: 4 };
        let cost = |route: Route| match route {
            Route::Direct => 1.0,
            Route::Cgroup => 0.99,
            Route::Vip => 0.95,
            _ => 0.5,
        };
        for pairs in [Pairs::PerRound, Pairs::Adjacent] {
            // A steady machine: every ratio is the route's cost, exactly.
            let figures = bench
                .rounds_of(bench.rounds, pairs, |route| {
                    Ok(Sample { value: cost(route) * 1000.0, p99_ms: None })
                })
                .unwrap();
            for (route, figure) in figures {
                assert!((figure.ratio - cost(route)).abs() < 1e-12, "{pairs:?} {route:?}");
                assert!((figure.spread.1 - figure.spread.0).abs() < 1e-12);
                assert!((figure.value - cost(route) * 1000.0).abs() < 1e-9);
            }
            let (mut runs, mut direct_runs) = (0usize, 0usize);
            // The machine slows down run by run: pairs cancel that out.
            let figures = bench
                .rounds_of(bench.rounds, pairs, |route| {
                    runs += 1;
                    direct_runs += usize::from(route == Route::Direct);
                    Ok(Sample { value: cost(route) * 1000.0 / runs as f64, p99_ms: None })
                })
                .unwrap();
            let others = Route::ALL.len() - 1;
            let expected_direct = if pairs == Pairs::Adjacent { 4 * others } else { 4 };
            assert_eq!(direct_runs, expected_direct);
            assert_eq!(runs, 4 * others + expected_direct);
            for (route, figure) in figures {
                // A run one or two places from its direct run: within the
                // drift of those places.
                let ratio = figure.ratio / cost(route);
                let drift = if pairs == Pairs::Adjacent { 0.5 } else { 0.9 };
                assert!(
                    ratio > 1.0 - drift && ratio < 1.0 / (1.0 - drift),
                    "{pairs:?} {route:?}: {ratio}"
                );
            }
        }
    }

    #[test]
    fn wrk_output_parses() {
        let text = "Running 2s test @ http://127.78.0.1:8080/\n  2 threads and 16 connections\n  Thread Stats   Avg      Stdev     Max   +/- Stdev\n\
                    \x20   Latency   510.37us  200.00us   5.00ms   90.00%\n  Latency Distribution\n     50%  480.00us\n     75%  600.00us\n\
                    \x20    90%  800.00us\n     99%    1.25ms\n  61234 requests in 2.00s, 9.00MB read\nRequests/sec:  30617.00\nTransfer/sec:      4.50MB\n";
        let run = parse_wrk(text).unwrap();
        assert_eq!(run.requests, 61234);
        assert!((run.per_second - 30617.0).abs() < 1e-9);
        assert!((run.p99_ms - 1.25).abs() < 1e-9);
        assert!(
            parse_wrk(&format!("{text}  Socket errors: connect 3, read 0, write 0, timeout 0\n"))
                .is_err()
        );
        assert!(parse_wrk(&format!("{text}  Non-2xx or 3xx responses: 7\n")).is_err());
        assert!((wrk_ms("850.00us").unwrap() - 0.85).abs() < 1e-9);
        assert!((wrk_ms("2.00s").unwrap() - 2000.0).abs() < 1e-9);
    }
}
