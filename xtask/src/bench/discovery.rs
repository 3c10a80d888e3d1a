//! The discovery part: how fast EndpointSlice changes reach the kernel.
//!
//! - latency: one service whose one endpoint alternates between two
//!   servers; a client in the cgroup connects through the VIP in a loop
//!   (200 µs apart); the time from the change at the API server to the first
//!   connect answered by the new endpoint. [`CHANGES`] changes, p50/p99.
//!   The service's `debounce` is 1 ms (the default, 1 s, would be all there
//!   is to see).
//! - throughput: 1,000 services × 10 endpoints; one endpoint of every
//!   service replaced at once; the time until the daemon's status shows
//!   all 1,000 new selections. Updates/s = 1,000 / that time (median of
//!   [`WAVES`] waves, or of fewer when one takes over 5 s). Also the initial sync: from `lb run` until every service has
//!   its 10 endpoints.
//!
//! The API server is the tests' fake ([`FakeApiServer`] of
//! `lb_tests::fakes`), on a runtime of its own, listening on `127.78.6.1`
//! only.

use std::{
    net::{Ipv4Addr, SocketAddr, TcpListener},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use lb_tests::{
    Daemon, ServiceBuilder, TestCgroup,
    fakes::{
        apiserver::{
            Condition, EndpointSlice, FakeApiServer, Kubeconfig, endpoint, endpoint_slice,
        },
        runtime,
    },
};

use super::{
    agent::{Agent, Want},
    host::free_port,
    limits::{check_stop, poll},
    paths::Who,
    results::{Discovery, Results},
    stats::{median, ms_between},
    status::{status, tail},
};

pub const CHANGES: usize = 200;
pub const SERVICES: usize = 1_000;
pub const ENDPOINTS: usize = 10;
const WAVES: usize = 3;
/// The port of every endpoint in the throughput services (nothing listens:
/// `check = "none"` and no client).
const PORT: u16 = 8443;

pub fn run(results: &mut Results) -> anyhow::Result<()> {
    // Declared before the fake, so that it is dropped after it.
    let rt = runtime();
    let api = rt.block_on(FakeApiServer::start_at(SocketAddr::from(([127, 78, 6, 1], 0))));
    let kubeconfig = Kubeconfig::write(&api.url());
    let settings = format!("kubeconfig = {:?}\n", kubeconfig.path());
    let mut discovery = Discovery::default();

    println!("==> discovery: {CHANGES} EndpointSlice changes to the kernel's selection");
    let port = shared_port(&[[127, 78, 6, 11], [127, 78, 6, 12]])?;
    let servers = [
        Who::start("e1", SocketAddr::from(([127, 78, 6, 11], port)))?,
        Who::start("e2", SocketAddr::from(([127, 78, 6, 12], port)))?,
    ];
    let ip = |who: &Who| match who.addr {
        SocketAddr::V4(a) => *a.ip(),
        SocketAddr::V6(_) => unreachable!("IPv4 servers"),
    };
    api.apply(slice("web", &[ip(&servers[0])], port));
    let vip = SocketAddr::from(([127, 78, 6, 100], 443));
    let cgroup = TestCgroup::new("bench-disc");
    let daemon = Daemon::start_with_env(
        "bench-disc",
        &cgroup,
        &settings,
        &[("RUST_LOG", "info")],
        &discovered("web", vip),
    );
    let mut agent = Agent::start(&cgroup.path)?;
    agent.until(vip, &Want::Name("e1"), Duration::from_secs(20), Duration::from_millis(5))?;
    agent.until_done().context("the first EndpointSlice list never reached the kernel")?;
    let mut latencies = Vec::new();
    for i in 0..CHANGES {
        check_stop()?;
        let to = &servers[(i + 1) % 2];
        agent.until(
            vip,
            &Want::Name(&to.name),
            Duration::from_secs(10),
            Duration::from_micros(200),
        )?;
        let changed = lb_tests::monotonic_ns();
        api.apply(slice("web", &[ip(to)], port));
        let landed =
            agent.until_done().with_context(|| format!("EndpointSlice change {}", i + 1))?.at_ns;
        latencies.push(ms_between(changed, landed));
    }
    discovery.latency_ms = latencies;
    println!("  change to kernel: p50 {:.1} ms", median(&discovery.latency_ms));
    drop((agent, daemon, cgroup, servers));

    println!("==> discovery: {SERVICES} services × {ENDPOINTS} endpoints");
    let endpoints = |i: usize, wave: usize| -> Vec<Ipv4Addr> {
        (0..ENDPOINTS)
            .map(|j| {
                let k = i * ENDPOINTS + j;
                // Odd waves move endpoint 0 of every service elsewhere.
                if j == 0 && wave % 2 == 1 {
                    Ipv4Addr::new(127, 83, (i / 250) as u8, (i % 250 + 1) as u8)
                } else {
                    Ipv4Addr::new(127, 82, (k / 250) as u8, (k % 250 + 1) as u8)
                }
            })
            .collect()
    };
    for i in 0..SERVICES {
        api.apply(slice(&format!("svc-{i}"), &endpoints(i, 0), PORT));
    }
    let toml: String = (0..SERVICES)
        .map(|i| {
            discovered(
                &format!("svc-{i}"),
                SocketAddr::from(([127, 84, (i / 250) as u8, (i % 250 + 1) as u8], 443)),
            )
        })
        .collect();
    let cgroup = TestCgroup::new("bench-disc-1k");
    let started = Instant::now();
    let daemon =
        Daemon::start_with_env("bench-disc-1k", &cgroup, &settings, &[("RUST_LOG", "info")], &toml);
    // How many services the kernel shows with the endpoints of `wave`.
    let showing = |wave: usize| -> anyhow::Result<usize> {
        let status = status(&daemon)?;
        let services = status["services"].as_array().map_or(&[][..], Vec::as_slice);
        Ok(services
            .iter()
            .filter(|s| {
                let Some(i) = s["name"]
                    .as_str()
                    .and_then(|n| n.strip_prefix("svc-"))
                    .and_then(|i| i.parse::<usize>().ok())
                else {
                    return false;
                };
                let mut want: Vec<String> = endpoints(i, wave)
                    .iter()
                    .map(|ip| SocketAddr::from((*ip, PORT)).to_string())
                    .collect();
                let mut got: Vec<String> = s["selected"]
                    .as_array()
                    .map(|l| l.iter().filter_map(|a| Some(a.as_str()?.to_owned())).collect())
                    .unwrap_or_default();
                want.sort();
                got.sort();
                want == got
            })
            .count())
    };
    let all_show = |wave: usize| Ok(showing(wave)? == SERVICES);
    if !poll(Duration::from_secs(90), Duration::from_millis(20), || all_show(0))? {
        bail!(
            "{SERVICES} discovered services did not all get their {ENDPOINTS} endpoints within 90 s; the daemon's log:\n{}",
            tail(&daemon.log())
        );
    }
    discovery.initial_sync = Some(started.elapsed());
    // Every service's watch is open before the changes start.
    if !poll(Duration::from_secs(30), Duration::from_millis(20), || Ok(api.watching() >= SERVICES))?
    {
        bail!("only {} of {SERVICES} watches are open", api.watching());
    }
    let mut rates = Vec::new();
    for wave in 1..=WAVES {
        check_stop()?;
        let started = Instant::now();
        for i in 0..SERVICES {
            api.apply(slice(&format!("svc-{i}"), &endpoints(i, wave), PORT));
        }
        if !poll(Duration::from_secs(60), Duration::from_millis(20), || all_show(wave))? {
            bail!(
                "wave {wave}: {SERVICES} changes did not all reach the kernel within 60 s: {} did; the daemon's log ends:\n{}",
                showing(wave)?,
                tail(&daemon.log())
            );
        }
        rates.push(SERVICES as f64 / started.elapsed().as_secs_f64());
        // Slow waves: one is figure enough (the bench stays short).
        if started.elapsed() > Duration::from_secs(5) {
            break;
        }
    }
    discovery.updates_per_second = Some(median(&rates));
    println!(
        "  initial sync {:.2} s; {:.0} updates/s applied",
        discovery.initial_sync.unwrap_or_default().as_secs_f64(),
        discovery.updates_per_second.unwrap_or(f64::NAN)
    );
    drop((daemon, cgroup));
    results.discovery = Some(discovery);
    Ok(())
}

/// A service discovered from the EndpointSlices of the Kubernetes
/// Service of the same name (port `https`), debounce 1 ms.
fn discovered(name: &str, vip: SocketAddr) -> String {
    ServiceBuilder::new(name, vip)
        .raw("[service.discovery]")
        .raw(&format!(
            "kubernetes = {{ namespace = \"default\", service = \"{name}\", port = \"https\" }}"
        ))
        .raw("debounce = \"1ms\"")
        .toml()
}

/// A port free on every one of `ips` (endpoints of a slice share its port).
fn shared_port(ips: &[[u8; 4]]) -> anyhow::Result<u16> {
    for _ in 0..50 {
        let port = free_port(ips[0])?;
        let held: Vec<_> =
            ips.iter().map(|ip| TcpListener::bind(SocketAddr::from((*ip, port)))).collect();
        if held.iter().all(Result::is_ok) {
            return Ok(port);
        }
    }
    bail!("no port free on every one of {ips:?}")
}

/// The EndpointSlice `<service>-1` of a Service: IPv4, port `https`, every
/// endpoint ready (and on no node).
fn slice(service: &str, ips: &[Ipv4Addr], port: u16) -> EndpointSlice {
    let endpoints = ips
        .iter()
        .map(|ip| {
            let mut endpoint = endpoint(&ip.to_string(), "", Condition::Ready);
            endpoint.node_name = None;
            endpoint
        })
        .collect();
    endpoint_slice(&format!("{service}-1"), service, "IPv4", &[("https", port)], endpoints)
}
