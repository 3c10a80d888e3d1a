//! The DNS part: DNS queries per second with `dnsperf` (Debian's package)
//! against one dnsmasq server on the node, three ways:
//! - direct, to the server's address;
//! - through a VIP, from inside the attached cgroup (dnsperf sends with
//!   `sendto()` on unconnected sockets: lb's sendmsg and recvmsg programs);
//! - through dnsmasq as a forwarding proxy on the node, without a cache
//!   (the proxy a node-local DNS address usually is, NodeLocal DNSCache's
//!   shape).
//!
//! The routes take turns, [`SECONDS`] each, for the bench's rounds; the
//! figures are medians, and the VIP's ratio is the median of its ratios
//! to the direct run of the same round. Then, with `kernel.bpf_stats_enabled`,
//! one more run through the VIP gives each lb program's runs and run time
//! per query. The server is the same dnsmasq every time, so a ratio near 1
//! says lb adds nothing the server notices.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, bail};
use lb_tests::{
    Daemon, ServiceBuilder, TestCgroup,
    resolvers::{Dnsmasq, NAME},
    start_in_cgroup,
};

use super::{
    bpf_stats::{BpfStats, attached_programs, program_stats},
    limits::{check_stop, output_within},
    results::{Dns, DnsRoute, Results},
    stats::median,
    status::status,
};

/// Seconds per dnsperf run.
pub const SECONDS: u64 = 5;
/// dnsperf's clients (sockets), threads and queries outstanding.
pub const CLIENTS: u32 = 8;
const THREADS: u32 = 2;
const OUTSTANDING: u32 = 200;

const PACKAGES: [&str; 2] = ["dnsperf", "dnsmasq-base"];

fn ip(fourth: u8) -> SocketAddr {
    SocketAddr::from(([127, 78, 21, fourth], 53))
}

/// At least this many rounds: a run is short, and a DNS server on a
/// shared 2-CPU machine swings by 10% from one run to the next.
pub const MIN_ROUNDS: u32 = 7;

pub fn run(rounds: u32, dir: &Path, results: &mut Results) -> anyhow::Result<()> {
    let rounds = rounds.max(MIN_ROUNDS);
    println!(
        "==> DNS: queries per second with dnsperf, direct, through a VIP and through a forwarder"
    );
    crate::cmd::install_missing_packages(&PACKAGES)?;
    let answer = Ipv4Addr::new(198, 18, 21, 1);
    let server = Dnsmasq::start(ip(1), answer);
    let forwarder = Dnsmasq::forwarder(ip(100), server.addr, answer);
    let vip = ip(53);
    let cgroup = TestCgroup::new("bench-dns");
    let daemon = Daemon::start(
        "bench-dns",
        &cgroup,
        &ServiceBuilder::new("dns", vip).servers(&[server.addr]).toml(),
    );
    let queries = dir.join("dns-queries.txt");
    std::fs::write(&queries, format!("{NAME} A\n")).context("writing dnsperf's query file")?;

    let routes = [
        (DnsRoute::Direct, server.addr, None),
        (DnsRoute::Vip, vip, Some(&cgroup)),
        (DnsRoute::Forwarder, forwarder.addr, None),
    ];
    let mut samples: Vec<(DnsRoute, Vec<f64>)> =
        routes.iter().map(|(r, ..)| (*r, Vec::new())).collect();
    let mut lost: Vec<(DnsRoute, u64)> = routes.iter().map(|(r, ..)| (*r, 0)).collect();
    let mut vip_ratios = Vec::new();
    let before = counters(&daemon)?;
    for round in 0..rounds {
        let mut direct = None;
        for (i, (route, to, cgroup)) in routes.iter().enumerate() {
            check_stop()?;
            let run = dnsperf(*to, &queries, cgroup.map(|c| c.path.as_path()), SECONDS)?;
            println!(
                "    round {}: {:<9} {:>9.0} queries/s, {} lost",
                round + 1,
                route.label(),
                run.qps,
                run.lost
            );
            samples[i].1.push(run.qps);
            lost[i].1 += run.lost;
            match route {
                DnsRoute::Direct => direct = Some(run.qps),
                DnsRoute::Vip => vip_ratios.extend(direct.map(|d| run.qps / d)),
                DnsRoute::Forwarder => {}
            }
        }
    }
    let after = counters(&daemon)?;
    let rewritten = ["sendmsg_rewritten", "sendmsg_kept", "recvmsg_rewritten", "connect_rewritten"]
        .into_iter()
        .map(|name| (name.to_owned(), delta(&before, &after, name)))
        .collect();

    check_stop()?;
    let programs = attached_programs(&cgroup.path)?;
    let _stats = BpfStats::enable()?;
    let before = program_stats(&programs)?;
    let run = dnsperf(vip, &queries, Some(&cgroup.path), 2)?;
    let after = program_stats(&programs)?;
    let per_query = before
        .iter()
        .zip(&after)
        .map(|((name, (cnt0, ns0)), (_, (cnt1, ns1)))| {
            let queries = run.completed.max(1) as f64;
            (name.clone(), (cnt1 - cnt0) as f64 / queries, (ns1 - ns0) as f64 / queries)
        })
        .filter(|(_, runs, _)| *runs > 0.0)
        .collect();

    results.dns = Some(Dns {
        rounds,
        qps: samples.into_iter().map(|(route, s)| (route, median(&s))).collect(),
        lost,
        vip_ratio: median(&vip_ratios),
        rewritten,
        programs: per_query,
        queries_for_programs: run.completed,
    });
    Ok(())
}

/// One dnsperf run's figures.
struct Run {
    qps: f64,
    completed: u64,
    lost: u64,
}

/// Runs dnsperf against `to` for `seconds`, inside `cgroup` if given.
fn dnsperf(
    to: SocketAddr,
    queries: &Path,
    cgroup: Option<&Path>,
    seconds: u64,
) -> anyhow::Result<Run> {
    let mut cmd = Command::new("dnsperf");
    cmd.args(["-s", &to.ip().to_string(), "-p", &to.port().to_string()])
        .arg("-d")
        .arg(queries)
        .args(["-l", &seconds.to_string(), "-t", "2"])
        .args([
            "-c",
            &CLIENTS.to_string(),
            "-T",
            &THREADS.to_string(),
            "-q",
            &OUTSTANDING.to_string(),
        ]);
    if let Some(cgroup) = cgroup {
        start_in_cgroup(&mut cmd, cgroup);
    }
    let out = output_within(&mut cmd, Duration::from_secs(seconds + 30))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "dnsperf against {to} failed ({}): {text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let field = |label: &str| -> anyhow::Result<f64> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(label))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("dnsperf's output has no {label:?}: {text}"))
    };
    Ok(Run {
        qps: field("Queries per second:")?,
        completed: field("Queries completed:")? as u64,
        lost: field("Queries lost:")? as u64,
    })
}

fn counters(daemon: &Daemon) -> anyhow::Result<serde_json::Value> {
    Ok(status(daemon)?["datapath"]["counters"].clone())
}

fn delta(before: &serde_json::Value, after: &serde_json::Value, name: &str) -> u64 {
    let read = |v: &serde_json::Value| v[name].as_u64().unwrap_or(0);
    read(after).saturating_sub(read(before))
}
