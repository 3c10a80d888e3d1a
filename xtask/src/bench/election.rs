//! The elections' part: how long clients wait when the node announcing an
//! external VIP dies, and what the elections cost the API server, measured
//! by `tests/benches/takeover.rs` (see there for how: three nodes, the
//! holder SIGKILLed and its link taken down, the client connecting
//! every 50 ms).

use anyhow::Context as _;

use super::{
    external_path::bench_json,
    results::{Election, Results},
};

pub fn run(results: &mut Results) -> anyhow::Result<()> {
    println!("==> elections: takeover after the holder dies, API requests per VIP");
    let figures = bench_json("takeover")?;
    let number =
        |key: &str| figures[key].as_f64().with_context(|| format!("no {key} in {figures}"));
    let list = |key: &str| -> anyhow::Result<Vec<f64>> {
        let values = figures[key].as_array().with_context(|| format!("no {key} in {figures}"))?;
        Ok(values.iter().filter_map(serde_json::Value::as_f64).collect())
    };
    results.election = Some(Election {
        nodes: number("nodes")? as usize,
        rounds: number("rounds")? as usize,
        failed_rounds: number("failed_rounds")? as usize,
        lease_duration_ms: number("lease_duration_ms")?,
        renew_ms: number("renew_ms")?,
        retry_ms: number("retry_ms")?,
        takeover_connect_ms: list("takeover_connect_ms")?,
        takeover_arp_ms: list("takeover_arp_ms")?,
        api_requests_per_s: number("api_requests_per_s")?,
    });
    Ok(())
}
