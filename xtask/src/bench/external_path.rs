//! The external path's part: `lb_xdp`'s program time per packet beside a
//! reference NAT forwarder's and a pass-through program's, measured
//! by `tests/benches/xdp_program_time.rs` under `BPF_PROG_TEST_RUN` (see
//! there for how: single runs, each less the pass-through program's run
//! beside it); and connects and requests per second from a client
//! namespace through the node, by plain routing, lb's external VIP, IPVS in
//! NAT mode and haproxy, measured by `tests/benches/external_throughput.rs`
//! (see there for how); and legitimate connects and held connections
//! under forged SYNs at rising rates, by `tests/benches/syn_flood.rs`.

use anyhow::Context as _;
use serde_json::Value;

use super::results::{External, ExternalRoute, Flood, FloodRate, ProgramTime, Results};
use crate::cmd::output_of;

/// What the throughput bench compares lb with: IPVS (kube-proxy's IPVS
/// mode) and haproxy, installed if missing (the bench says why a route
/// could not run, e.g. a kernel without IPVS).
const PACKAGES: [&str; 2] = ["haproxy", "ipvsadm"];

pub fn run(results: &mut Results) -> anyhow::Result<()> {
    println!("==> external path: lb_xdp's program time per packet (BPF_PROG_TEST_RUN)");
    let times = bench_json("xdp_program_time")?;
    let ns = |key: &str| times[key].as_f64().with_context(|| format!("no {key} in {times}"));
    let mut program = Vec::new();
    for family in ["ipv4", "ipv6"] {
        let t = &times[family];
        let ns =
            |key: &str| t[key].as_f64().with_context(|| format!("no {family}.{key} in {times}"));
        program.push(ProgramTime {
            family: if family == "ipv4" { "IPv4" } else { "IPv6" },
            first_ns: ns("first_ns")?,
            established_ns: ns("established_ns")?,
            reply_ns: ns("reply_ns")?,
            not_ours_ns: ns("not_ours_ns")?,
            reference_established_ns: ns("reference_established_ns")?,
            reference_reply_ns: ns("reference_reply_ns")?,
        });
    }
    let mut external = External {
        program,
        overhead_ns: ns("overhead_ns")?,
        pass_ns: ns("pass_ns")?,
        live_connects_ns: 0.0,
        live_requests_ns: 0.0,
        routes: Vec::new(),
        skipped: Vec::new(),
        flood: None,
    };
    println!(
        "==> external path: connects and requests per second, plain routing, lb, IPVS, haproxy"
    );
    crate::cmd::install_missing_packages(&PACKAGES)?;
    let throughput = bench_json("external_throughput")?;
    let live =
        |key: &str| throughput[key].as_f64().with_context(|| format!("no {key} in {throughput}"));
    external.live_connects_ns = live("xdp_ns_per_packet_connects")?;
    external.live_requests_ns = live("xdp_ns_per_packet_requests")?;
    for route in throughput["routes"].as_array().context("no routes")? {
        let field = |key: &str| route[key].as_f64().with_context(|| format!("no {key} in {route}"));
        external.routes.push(ExternalRoute {
            name: route["route"].as_str().context("a route without a name")?.to_owned(),
            connects_per_s: field("connects_per_s")?,
            connects_ratio: field("connects_ratio")?,
            requests_per_s: field("requests_per_s")?,
            requests_ratio: field("requests_ratio")?,
        });
    }
    for skipped in throughput["skipped"].as_array().context("no skipped")? {
        let text = |key: &str| skipped[key].as_str().unwrap_or("?").to_owned();
        external.skipped.push((text("route"), text("why")));
    }
    println!("==> external path: forged SYNs at rising rates, legitimate connects meanwhile");
    external.flood = Some(flood(&bench_json("syn_flood")?)?);
    results.external = Some(external);
    Ok(())
}

/// The SYN flood bench's figures, from its JSON line.
fn flood(figures: &Value) -> anyhow::Result<Flood> {
    let count = |v: &Value, key: &str| v[key].as_u64().with_context(|| format!("no {key} in {v}"));
    let mut configs = Vec::new();
    for config in figures["configs"].as_array().context("no configs")? {
        let mut rates = Vec::new();
        for rate in config["rates"].as_array().context("no rates")? {
            rates.push(FloodRate {
                asked_per_s: count(rate, "asked_per_s")?,
                sent_per_s: rate["sent_per_s"].as_f64().context("no sent_per_s")?,
                connected: count(rate, "connected")?,
                connects: count(rate, "connects")?,
                held_alive: count(rate, "held_alive")?,
                new_flows: count(rate, "new_flows")?,
                guard_refused: count(rate, "guard_refused")?,
                ports_exhausted: count(rate, "ports_exhausted")?,
            });
        }
        let nat_ports = config["nat_ports"].as_str().context("no nat_ports")?.to_owned();
        configs.push((nat_ports, rates));
    }
    Ok(Flood {
        flow_table: count(figures, "flow_table")?,
        flow_tables_bytes: count(figures, "flow_tables_bytes")?,
        held: count(figures, "held")?,
        configs,
    })
}

/// Runs `cargo bench --bench NAME` in lb-tests and reads the JSON line it
/// prints last.
pub(super) fn bench_json(name: &str) -> anyhow::Result<Value> {
    let out = output_of(&mut crate::cargo::cargo_command(&[
        "bench",
        "--package",
        "lb-tests",
        "--bench",
        name,
    ])?)?;
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("{name} printed no figures:\n{out}"))?;
    serde_json::from_str(line).with_context(|| format!("reading {line}"))
}
