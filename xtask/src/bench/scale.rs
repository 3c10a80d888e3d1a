//! The scale part: how the daemon copes with many services (`check =
//! "none"`: no probes; VIPs in `127.79.0.0/16`, servers in `127.80.0.0/16`,
//! which nothing connects to except where said).
//!
//! - start-up: from starting `lb run` to its first status answer, and until
//!   its status lists every service with a selection, at 1,000, 10,000 and
//!   16,384 (the limit) services; the daemon's RSS (VmRSS) then;
//! - connect + close through one VIP (to the sink) with 1,000 services
//!   configured vs 1: two daemons, each on its own cgroup, rounds
//!   alternated between them;
//! - reload: with 10,000 services, the config rewritten so that one
//!   service moves to another server, then SIGHUP; the time until a connect
//!   through that VIP, looping in the cgroup, lands on the new server.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use lb_tests::{Daemon, ServiceBuilder, TestCgroup};

use super::{
    agent::{Agent, Want},
    args::Args,
    format::millis,
    host::{paths_cpu, rss},
    limits::{check_stop, poll},
    paths::{Origins, Who},
    results::{Results, Scale, Startup},
    stats::{median, ms_between},
    status::{status, status_received, tail},
    workloads::CONNECTS,
};

/// The service whose server a reload changes.
const RELOAD_SERVICE: usize = 5_000;
/// Reloads measured (each moves the service to the other server).
const RELOADS: usize = 5;
/// The longest a reload may take to reach the kernel.
const RELOAD_LIMIT: Duration = Duration::from_secs(60);

fn vip(i: usize) -> SocketAddr {
    SocketAddr::from(([127, 79, (i / 250) as u8, (i % 250 + 1) as u8], 80))
}

fn server(i: usize) -> SocketAddr {
    SocketAddr::from(([127, 80, (i / 250) as u8, (i % 250 + 1) as u8], 80))
}

/// `n` services `svc-I`; service 0 leads to `first`, service
/// [`RELOAD_SERVICE`] to `moved` if given, the others to addresses nothing
/// listens on (never connected to: no probes, no clients).
fn services(n: usize, first: SocketAddr, moved: Option<SocketAddr>) -> String {
    let mut toml = String::with_capacity(n * 120);
    for i in 0..n {
        let to = match (i, moved) {
            (0, _) => first,
            (RELOAD_SERVICE, Some(moved)) => moved,
            _ => server(i),
        };
        toml += &ServiceBuilder::new(&format!("svc-{i}"), vip(i)).servers(&[to]).toml();
    }
    toml
}

/// Starts a daemon with `toml` (`n` services) on `cgroup`; returns it and
/// the times from starting `lb run` to its first status answer and to the
/// first answer that lists every service with a selection, as a client
/// asking the control socket every 10 ms receives them (the time to read an
/// answer counts, the time to parse it does not). A daemon that does not
/// answer within 60 s is a figure (`None`), not an error.
fn start(
    name: &str,
    cgroup: &TestCgroup,
    n: usize,
    toml: &str,
) -> anyhow::Result<(Option<Daemon>, Startup)> {
    let mut daemon = Daemon::prepare(name, cgroup, "", &[("RUST_LOG", "info")], toml);
    let mut startup = Startup { services: n, answered: None, ready: None, rss: None };
    let started = Instant::now();
    daemon.spawn_with(&[]);
    poll(Duration::from_secs(90), Duration::from_millis(10), || {
        if daemon.wait_exit(Duration::ZERO) {
            bail!("lb run with {n} services exited; its log ends:\n{}", tail(&daemon.log()));
        }
        let Ok((status, received)) = status_received(&daemon) else {
            // Not answering yet; 60 s without an answer is the figure.
            return Ok(started.elapsed() > Duration::from_secs(60));
        };
        let at = received - started;
        startup.answered.get_or_insert(at);
        let services = status["services"].as_array().map_or(&[][..], Vec::as_slice);
        let ready = services.len() == n
            && services.iter().all(|s| s["selected"].as_array().is_some_and(|l| !l.is_empty()));
        if ready {
            startup.ready = Some(at);
        }
        Ok(ready)
    })?;
    if startup.answered.is_none() {
        println!("  {}", startup.describe());
        return Ok((None, startup));
    }
    if startup.ready.is_none() {
        bail!(
            "the daemon with {n} services answered, but did not list them all with selections within 90 s; its log ends:\n{}",
            tail(&daemon.log())
        );
    }
    startup.rss = Some(rss(daemon.pid().context("the daemon is not running")?)?);
    println!("  {}", startup.describe());
    Ok((Some(daemon), startup))
}

pub fn run(args: &Args, origins: &Origins, results: &mut Results) -> anyhow::Result<()> {
    let mut scale = Scale::default();
    let sink = origins.sink.addr;
    let outcome = measure(args, origins, sink, &mut scale);
    results.scale = Some(scale);
    outcome
}

fn measure(
    args: &Args,
    origins: &Origins,
    sink: SocketAddr,
    scale: &mut Scale,
) -> anyhow::Result<()> {
    println!("==> scale: 1 and 1,000 services");
    let (cg_one, cg_many) = (TestCgroup::new("bench-1svc"), TestCgroup::new("bench-1k"));
    let (one, _) = start("bench-1svc", &cg_one, 1, &services(1, sink, None))?;
    let (many, startup) = start("bench-1k", &cg_many, 1_000, &services(1_000, sink, None))?;
    scale.startups.push(startup);
    let (Some(one), Some(many)) = (one, many) else {
        bail!("a daemon with 1 or 1,000 services did not answer within 60 s")
    };

    let mut rates = [Vec::new(), Vec::new()];
    // One agent, moving between the two cgroups: only the daemon differs.
    let mut agent = Agent::start(&cg_one.path)?;
    // On the sink's CPU, as in the paths part (`paths_cpu`).
    agent.pin(paths_cpu()?)?;
    for _ in 0..args.rounds {
        for (cgroup, rates) in [&cg_one, &cg_many].iter().zip(&mut rates) {
            check_stop()?;
            agent.enter(&cgroup.path)?;
            let before = origins.sink.accepted();
            let took = agent.connects(vip(0), CONNECTS)?;
            let accepted = (origins.sink.accepted() - before) as u64;
            if accepted != CONNECTS {
                bail!("{CONNECTS} connects through {}, but the sink accepted {accepted}", vip(0));
            }
            rates.push(CONNECTS as f64 / took.as_secs_f64());
        }
    }
    scale.connects = Some((median(&rates[0]), median(&rates[1])));
    println!(
        "  connect + close through one VIP: {:.0}/s with 1 service, {:.0}/s with 1,000",
        median(&rates[0]),
        median(&rates[1])
    );
    drop((agent, one, many, cg_one, cg_many));

    println!("==> scale: 10,000 services, and a reload that changes one");
    let cgroup = TestCgroup::new("bench-10k");
    let mut servers = [
        Who::start("x", SocketAddr::from(([127, 78, 2, 1], 0)))?,
        Who::start("y", SocketAddr::from(([127, 78, 2, 2], 0)))?,
    ];
    let (daemon, startup) =
        start("bench-10k", &cgroup, 10_000, &services(10_000, sink, Some(servers[0].addr)))?;
    scale.startups.push(startup);
    if let Some(daemon) = daemon {
        scale.reload_ms = reloads(&daemon, &cgroup, sink, &servers)?;
    }
    drop(cgroup);
    servers.iter_mut().for_each(Who::kill);

    println!("==> scale: 16,384 services (the limit)");
    let cgroup = TestCgroup::new("bench-16k");
    let (daemon, startup) = start("bench-16k", &cgroup, 16_384, &services(16_384, sink, None))?;
    scale.startups.push(startup);
    drop((daemon, cgroup));
    Ok(())
}

/// Up to [`RELOADS`] reloads, each moving service [`RELOAD_SERVICE`] to the
/// other of `servers`: from SIGHUP to the first connect through its VIP
/// (looping in the cgroup, 1 ms apart) that the new server answers. Stops
/// early once one takes over 5 s (the bench stays short where reloads are
/// slow).
fn reloads(
    daemon: &Daemon,
    cgroup: &TestCgroup,
    sink: SocketAddr,
    servers: &[Who; 2],
) -> anyhow::Result<Vec<f64>> {
    let mut agent = Agent::start(&cgroup.path)?;
    let target = vip(RELOAD_SERVICE);
    let first = agent.land(target)?;
    if first != "x" {
        bail!("a connect through {target} landed on {first:?}, not on its server x");
    }
    let mut reloads = Vec::new();
    for i in 0..RELOADS {
        check_stop()?;
        let to = &servers[(i + 1) % 2];
        agent.until(target, &Want::Name(&to.name), RELOAD_LIMIT, Duration::from_millis(1))?;
        daemon.write_config(cgroup, &services(10_000, sink, Some(to.addr)));
        let sent = lb_tests::monotonic_ns();
        daemon.signal(libc::SIGHUP);
        let landed = match agent.until_done() {
            Ok(at) => at,
            Err(e) => {
                let reload = status(daemon)
                    .map(|s| s["config"]["last_reload"].to_string())
                    .unwrap_or_else(|e| e.to_string());
                bail!(
                    "reload {} of 10,000 services: {e:#}; last reload in status: {reload}; the daemon's log ends:\n{}",
                    i + 1,
                    tail(&daemon.log())
                );
            }
        };
        reloads.push(ms_between(sent, landed.at_ns));
        if reloads[i] > 5_000.0 {
            break;
        }
    }
    let status = status(daemon)?;
    if status["config"]["last_reload"]["ok"] != true {
        bail!("the last reload did not take: {}", status["config"]["last_reload"]);
    }
    println!(
        "  reload changing one service of 10,000: median {} (of {})",
        millis(median(&reloads)),
        reloads.len()
    );
    Ok(reloads)
}
