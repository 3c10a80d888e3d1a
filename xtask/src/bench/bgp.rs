//! The BGP part, measured by `tests/benches/bgp.rs` (see there for how:
//! three nodes and a router running BIRD with ECMP and BFD, a client
//! behind it): connects per second through one node announcing by ARP
//! and one, two and three by BGP, in the same run, with each node's
//! share; and the time from a node's death to the router withdrawing it.

use anyhow::Context as _;

use super::{
    external_path::bench_json,
    results::{Bgp, BgpStep, Results},
};

/// The steps, in the order the bench takes them: its key, and what it is.
const STEPS: [(&str, &str); 4] = [
    ("arp_1", "1 node by ARP (no router)"),
    ("bgp_1", "1 node by BGP"),
    ("bgp_2", "2 nodes by BGP"),
    ("bgp_3", "3 nodes by BGP"),
];

pub fn run(results: &mut Results) -> anyhow::Result<()> {
    println!("==> BGP: connects through 1 to 3 nodes announcing, withdrawal of a dead node");
    let figures = bench_json("bgp")?;
    let number = |value: &serde_json::Value, key: &str| {
        value[key].as_f64().with_context(|| format!("no {key} in {value}"))
    };
    let mut steps = Vec::new();
    for (key, what) in STEPS {
        let step = &figures["steps"][key];
        let answered = step["answered"].as_object().with_context(|| format!("no {key}"))?;
        steps.push(BgpStep {
            what,
            connects_per_s: number(step, "connects_per_s")?,
            answered: answered
                .iter()
                .map(|(node, n)| (node.clone(), n.as_u64().unwrap_or(0)))
                .collect(),
        });
    }
    let withdrawn = figures["withdrawn_ms"].as_array().context("no withdrawn_ms")?;
    results.bgp = Some(Bgp {
        clients: number(&figures, "clients")? as usize,
        measure_s: number(&figures, "measure_s")?,
        steps,
        rounds: number(&figures, "rounds")? as usize,
        failed_rounds: number(&figures, "failed_rounds")? as usize,
        withdrawn_ms: withdrawn.iter().filter_map(serde_json::Value::as_f64).collect(),
    });
    Ok(())
}
