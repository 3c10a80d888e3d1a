//! The external path's part (issue 25, item 7): `lb_xdp`'s program time
//! per packet, measured by `tests/benches/xdp_program_time.rs` under
//! `BPF_PROG_TEST_RUN` (see there for how: single runs less the kernel's
//! timing overhead, measured in the same run). Not yet here: connects and
//! requests per second from a client namespace through the VIP against
//! plain routing, IPVS and haproxy.

use anyhow::Context as _;

use super::results::{External, Results};
use crate::cmd::output_of;

pub fn run(results: &mut Results) -> anyhow::Result<()> {
    println!("==> external path: lb_xdp's program time per packet (BPF_PROG_TEST_RUN)");
    let out = output_of(&mut crate::cargo::cargo_command(&[
        "bench",
        "--package",
        "lb-tests",
        "--bench",
        "xdp_program_time",
    ])?)?;
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("xdp_program_time printed no figures:\n{out}"))?;
    let json: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("reading {line}"))?;
    let ns = |key: &str| json[key].as_f64().with_context(|| format!("no {key} in {line}"));
    results.external = Some(External {
        first_ns: ns("first_ns")?,
        established_ns: ns("established_ns")?,
        reply_ns: ns("reply_ns")?,
        not_ours_ns: ns("not_ours_ns")?,
        overhead_ns: ns("overhead_ns")?,
    });
    Ok(())
}
