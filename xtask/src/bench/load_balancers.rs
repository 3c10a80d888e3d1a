//! The LoadBalancer Services' part, measured by
//! `tests/benches/load_balancers.rs` (see there for how: three nodes on
//! one bridge, the fake API server, 100 Services created one after
//! another): from a Service's creation to its status showing an address,
//! to a node claiming it and to the first connect from another machine
//! answered through it, p50/p99; and the API load in a steady state with
//! all of them served.

use anyhow::Context as _;

use super::{
    external_path::bench_json,
    results::{LoadBalancers, Results},
};

pub fn run(results: &mut Results) -> anyhow::Result<()> {
    println!("==> LoadBalancer Services: creation to first connect, API load with 100");
    let figures = bench_json("load_balancers")?;
    let number = |value: &serde_json::Value, key: &str| {
        value[key].as_f64().with_context(|| format!("no {key} in {value}"))
    };
    let percentiles = |key: &str| -> anyhow::Result<(f64, f64)> {
        let value = &figures[key];
        Ok((number(value, "p50")?, number(value, "p99")?))
    };
    let steady = &figures["steady_per_s"];
    results.load_balancers = Some(LoadBalancers {
        nodes: number(&figures, "nodes")? as usize,
        services: number(&figures, "services")? as usize,
        to_status_ms: percentiles("creation_to_status_ms")?,
        to_claim_ms: percentiles("creation_to_claimed_ms")?,
        to_connect_ms: percentiles("creation_to_first_connect_ms")?,
        lease_requests_per_s: number(steady, "lease_requests")?,
        lists_and_watches_per_s: number(steady, "lists_and_watches")?,
        status_writes_per_s: number(steady, "status_writes")?,
        watch_events_per_s: number(steady, "watch_events")?,
        watches_open: number(&figures, "watches_open")? as usize,
    });
    Ok(())
}
