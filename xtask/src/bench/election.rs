//! The elections' part: how long clients wait when the node announcing an
//! external VIP dies, and what the elections cost the API server, measured
//! by `tests/benches/takeover.rs` (see there for how: three nodes, the
//! holder SIGKILLed and its link taken down, the client connecting
//! every 50 ms); and the elections by membership beside the per-VIP
//! Leases at 1, 50 and 200 VIPs, by `tests/benches/membership.rs`.

use anyhow::Context as _;

use super::{
    external_path::bench_json,
    results::{ApiLoad, Election, Membership, Results},
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
    println!("==> elections: by membership beside per-VIP Leases, 1 to 200 VIPs");
    let membership = membership(&bench_json("membership")?)?;
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
        membership: Some(membership),
    });
    Ok(())
}

fn membership(figures: &serde_json::Value) -> anyhow::Result<Membership> {
    let load_of = |value: &serde_json::Value| -> anyhow::Result<ApiLoad> {
        let number =
            |key: &str| value[key].as_f64().with_context(|| format!("no {key} in {value}"));
        let verbs =
            value["by_verb"].as_object().with_context(|| format!("no by_verb in {value}"))?;
        Ok(ApiLoad {
            requests_per_s: number("requests_per_s")?,
            watch_events_per_s: number("watch_events_per_s")?,
            by_verb: verbs.iter().map(|(k, v)| (k.clone(), v.as_f64().unwrap_or(0.0))).collect(),
        })
    };
    let mut load = Vec::new();
    for (way, prefix) in [("a Lease per VIP", "per_vip"), ("membership", "membership")] {
        for n in [1, 50, 200] {
            let key = format!("{prefix}_{n}");
            load.push((way, n, load_of(&figures["load"][&key])?));
        }
    }
    let takeover = &figures["takeover"];
    let takeover_ms = takeover["takeover_ms"].as_array().context("no takeover_ms")?;
    let graceful_ms = takeover["graceful_ms"].as_array().context("no graceful_ms")?;
    Ok(Membership {
        load,
        takeover_vips: takeover["vips"].as_u64().context("no takeover vips")? as usize,
        takeover_rounds: takeover["rounds"].as_u64().context("no takeover rounds")? as usize,
        takeover_ms: takeover_ms.iter().filter_map(serde_json::Value::as_f64).collect(),
        graceful_rounds: takeover["graceful_rounds"].as_u64().context("no graceful rounds")?
            as usize,
        graceful_ms: graceful_ms.iter().filter_map(serde_json::Value::as_f64).collect(),
    })
}
