//! What the bench found, three ways: a table on stdout, a Markdown report
//! (`target/bench/report.md`, what `docs/benchmark.md` copies) and a plot of the
//! ratios per path and workload (`target/bench/ratios.svg`). The tables
//! are `tables.rs`'s; the targets are PASS/MISS lines, and a miss is
//! reported, never an error.

use std::{fmt::Write as _, path::Path, process::Command};

use super::{
    format::count,
    paths::BULK,
    plot,
    results::{Results, load_average},
    tables::tables,
    targets::targets,
    workloads::{BULK_REPEATS, CONNECT_SLICES, CONNECTS, WRK_RUNS},
};
use anyhow::Context as _;

fn machine(r: &Results) -> Vec<(String, String)> {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let mem_kb: u64 = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let os = read("/etc/os-release")
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|l| l.trim_matches('"').to_owned())
        .unwrap_or_default();
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    vec![
        ("taken".to_owned(), date),
        ("machine".to_owned(), format!("{cpus} CPUs ({cpu}), {:.0} GB RAM", mem_kb as f64 / 1e6)),
        ("system".to_owned(), format!("{os}, Linux {}", read("/proc/sys/kernel/osrelease").trim())),
        (
            "load average (1 min) at start / end".to_owned(),
            format!("{} / {}", r.load_at_start, load_average()),
        ),
    ]
}

pub fn write(r: &Results, dir: &Path) -> anyhow::Result<()> {
    let tables = tables(r);
    let targets = targets(r);
    let machine = machine(r);
    let settings = format!(
        "release build; every client, origin and proxy on one CPU; {} rounds, the routes in turn, forwards then backwards (a ratio: the median of each run's ratio to the direct run of its round); wrk -t2 -c16, {} × {} s per route and round; connect + close: {} connects per route and round, in {} slices, each next to a direct slice; bulk: {} × {} MiB per route and round; parts: {}",
        r.rounds,
        WRK_RUNS,
        r.wrk_seconds,
        count(CONNECTS as usize),
        CONNECT_SLICES,
        BULK_REPEATS,
        BULK >> 20,
        r.parts.iter().map(|p| format!("{p:?}").to_lowercase()).collect::<Vec<_>>().join(", ")
    );

    let mut text = String::from("\n==> results\n");
    for (k, v) in &machine {
        let _ = writeln!(text, "{k}: {v}");
    }
    let _ = writeln!(text, "{settings}\n");
    for t in &tables {
        text += &t.text();
        text += "\n";
    }
    if !targets.is_empty() {
        text += "Targets (a MISS is reported, not an error)\n";
        for (pass, line) in &targets {
            let _ = writeln!(text, "  {}  {line}", if *pass { "PASS" } else { "MISS" });
        }
    }
    for note in &r.notes {
        let _ = writeln!(text, "note: {note}");
    }
    let _ = writeln!(
        text,
        "\nbench took {:.0} s; report: {}; plot: {}",
        r.duration.as_secs_f64(),
        dir.join("report.md").display(),
        dir.join("ratios.svg").display()
    );
    print!("{text}");

    let mut md = String::from("# `cargo xtask bench`\n\n");
    for (k, v) in machine.iter().chain(&r.versions) {
        let _ = writeln!(md, "- {k}: {v}");
    }
    let _ = writeln!(md, "- {settings}\n- duration: {:.0} s\n", r.duration.as_secs_f64());
    for t in &tables {
        md += &t.markdown();
    }
    if !targets.is_empty() {
        md += "### Targets\n\n";
        for (pass, line) in &targets {
            let _ = writeln!(md, "- **{}** {line}", if *pass { "PASS" } else { "MISS" });
        }
        md += "\n";
    }
    for note in &r.notes {
        let _ = writeln!(md, "Note: {note}\n");
    }
    if !r.paths.is_empty() {
        md += "![ratios per path and workload](ratios.svg)\n";
    }
    if r.external.is_some() {
        md += "![lb_xdp against its yardsticks](xdp_ratios.svg)\n";
    }
    std::fs::write(dir.join("report.md"), md).context("writing report.md")?;
    if !r.paths.is_empty() {
        plot::ratios(r, &dir.join("ratios.svg"))
            .map_err(|e| anyhow::anyhow!("drawing ratios.svg: {e}"))?;
    }
    if let Some(e) = &r.external {
        plot::program_ratios(e, &dir.join("xdp_ratios.svg"))
            .map_err(|e| anyhow::anyhow!("drawing xdp_ratios.svg: {e}"))?;
    }
    Ok(())
}
