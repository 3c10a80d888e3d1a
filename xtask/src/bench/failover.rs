//! The failover part: how long a VIP keeps sending connects to a server
//! that died. A server "dies" by closing its listener (connects to it are
//! refused at once); it is started again after each measurement. Each kill
//! is of the server selected at that moment: [`KERNEL_KILLS`] for the
//! kernel path, [`DAEMON_KILLS`] for the daemon path (whose kills take a
//! check interval or more each).
//!
//! - kernel path (service `fo-kernel`, health checks every 60 s: only the
//!   kernel reacts within the measurement): a client in the cgroup connects
//!   through the VIP in a loop (100 µs apart). Two times per kill: from
//!   the kill to the first connect answered by another server (what the
//!   application sees), and from the return of the refused connect to that
//!   answer (lb's reaction: the refusal marks the server failed in the
//!   kernel, the next connect skips it). They differ by how long the
//!   refused connect itself took: a SYN that meets the listener while it
//!   closes is refused only some 8–16 ms later in a few kills in a hundred
//!   (checked by hand: a client and a listener on loopback alone, no lb
//!   anywhere, show the same). Between kills, the hold-down (100 ms) is
//!   let pass, so each kill starts from a kernel with no failure marks.
//!   200 kills, so that the p99 is not simply the largest.
//! - daemon path (service `fo-daemon`, TCP checks every 100 ms, no client
//!   traffic): the time from the kill until the daemon's status shows
//!   another server first in the kernel's selection and the killed one
//!   unhealthy, polled every 2 ms. Between kills, both servers are let pass
//!   a check again and the selection settle; each kill falls at a random
//!   point of the check interval.

use std::{
    hash::{BuildHasher as _, RandomState},
    net::SocketAddr,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use lb_tests::{Check, Daemon, ServiceBuilder, TestCgroup};
use serde_json::Value;

use super::{
    agent::{Agent, Want},
    limits::{check_stop, poll},
    paths::Who,
    results::{Failover, Results},
    stats::ms_between,
    status::{selected, status},
};

pub const KERNEL_KILLS: usize = 200;
pub const DAEMON_KILLS: usize = 50;
const HOLD_DOWN: Duration = Duration::from_millis(100);

pub fn run(results: &mut Results) -> anyhow::Result<()> {
    println!(
        "==> failover: kills of the selected server, {KERNEL_KILLS} on the kernel path, then {DAEMON_KILLS} on the daemon path"
    );
    let ip = |host: u8| SocketAddr::from(([127, 78, 5, host], 0));
    let mut kernel_servers = [Who::start("a", ip(1))?, Who::start("b", ip(2))?];
    let mut daemon_servers = [Who::start("c", ip(3))?, Who::start("d", ip(4))?];
    let kernel_vip = SocketAddr::from(([127, 78, 5, 100], 80));
    let daemon_vip = SocketAddr::from(([127, 78, 5, 101], 80));
    let services = ServiceBuilder::new("fo-kernel", kernel_vip)
        .servers(&kernel_servers.each_ref().map(|s| s.addr))
        .hold_down(HOLD_DOWN)
        .check(Check::Tcp { interval: Duration::from_secs(60) })
        .toml()
        + &ServiceBuilder::new("fo-daemon", daemon_vip)
            .servers(&daemon_servers.each_ref().map(|s| s.addr))
            .check(Check::Tcp { interval: Duration::from_millis(100) })
            .toml();
    let cgroup = TestCgroup::new("bench-failover");
    let daemon =
        Daemon::start_with_env("bench-failover", &cgroup, "", &[("RUST_LOG", "info")], &services);
    if !poll(Duration::from_secs(10), Duration::from_millis(20), || {
        let status = status(&daemon)?;
        Ok(all_healthy(&status, "fo-kernel") && all_healthy(&status, "fo-daemon"))
    })? {
        bail!(
            "the failover services' servers did not become healthy; the daemon's log:\n{}",
            daemon.log()
        );
    }

    let mut agent = Agent::start(&cgroup.path)?;
    let mut kernel = Vec::new();
    let (mut reaction, mut failed_max) = (Vec::new(), 0);
    for i in 0..KERNEL_KILLS {
        check_stop()?;
        let landed = agent.land(kernel_vip)?;
        let victim = kernel_servers
            .iter_mut()
            .find(|s| s.name == landed)
            .with_context(|| format!("a connect through the VIP landed on {landed:?}"))?;
        agent.until(
            kernel_vip,
            &Want::Not(&landed),
            Duration::from_secs(5),
            Duration::from_micros(100),
        )?;
        // The loop is running (and landing on the victim) before the kill.
        thread::sleep(Duration::from_millis(5));
        let killed = lb_tests::monotonic_ns();
        victim.kill();
        let elsewhere =
            agent.until_done().with_context(|| format!("kernel path, kill {}", i + 1))?;
        kernel.push(ms_between(killed, elsewhere.at_ns));
        if let Some(failed) = elsewhere.last_failed_ns {
            reaction.push(ms_between(failed, elsewhere.at_ns));
        }
        failed_max = failed_max.max(elsewhere.failed);
        victim.restart()?;
        thread::sleep(HOLD_DOWN + Duration::from_millis(50));
    }
    drop(agent);

    let mut via_daemon = Vec::new();
    let random = RandomState::new();
    for i in 0..DAEMON_KILLS {
        check_stop()?;
        // Both servers up and passing checks, and the selection settled (the
        // same lead over more than a check interval: a server that came
        // back may take the lead again), then kill the lead.
        let mut first = String::new();
        let mut since = (String::new(), Instant::now());
        if !poll(Duration::from_secs(10), Duration::from_millis(5), || {
            let status = status(&daemon)?;
            let lead = selected(&status, "fo-daemon").first().cloned().unwrap_or_default();
            if lead != since.0 {
                since = (lead.clone(), Instant::now());
            }
            first = lead;
            Ok(!first.is_empty()
                && all_healthy(&status, "fo-daemon")
                && since.1.elapsed() > Duration::from_millis(250))
        })? {
            bail!(
                "daemon path, kill {}: the servers did not pass their checks again, or the selection did not settle, within 10 s",
                i + 1
            );
        }
        let victim = daemon_servers
            .iter_mut()
            .find(|s| s.addr.to_string() == first)
            .with_context(|| format!("the selection leads with {first}, not one of the servers"))?;
        // At a random point of the check interval (a clock reading would
        // not do: the loop above ends in step with the checks).
        thread::sleep(Duration::from_micros(random.hash_one(i) % 100_000));
        let killed = lb_tests::monotonic_ns();
        victim.kill();
        let mut moved = 0;
        // Moved: the dead server no longer leads and the daemon says why.
        if !poll(Duration::from_secs(5), Duration::from_millis(2), || {
            let status = status(&daemon)?;
            moved = lb_tests::monotonic_ns();
            let lead = selected(&status, "fo-daemon").first().cloned().unwrap_or_default();
            Ok(lead != first && server_field(&status, "fo-daemon", &first, "healthy") == false)
        })? {
            bail!(
                "daemon path, kill {}: the selection still leads with the dead server after 5 s",
                i + 1
            );
        }
        via_daemon.push(ms_between(killed, moved));
        victim.restart()?;
    }
    results.failover = Some(Failover {
        kernel_ms: kernel,
        reaction_ms: reaction,
        failed_max,
        daemon_ms: via_daemon,
    });
    Ok(())
}

fn service<'a>(status: &'a Value, name: &str) -> Option<&'a Value> {
    status["services"].as_array()?.iter().find(|s| s["name"] == name)
}

/// Whether every server of service `name` passed its last check.
fn all_healthy(status: &Value, name: &str) -> bool {
    service(status, name)
        .and_then(|s| s["servers"].as_array())
        .is_some_and(|servers| servers.iter().all(|server| server["healthy"] == true))
}

/// A field of server `address` of service `name` in the status.
fn server_field(status: &Value, name: &str, address: &str, field: &str) -> Value {
    service(status, name)
        .and_then(|s| s["servers"].as_array()?.iter().find(|s| s["address"] == address))
        .map_or(Value::Null, |s| s[field].clone())
}
