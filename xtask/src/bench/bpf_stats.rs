//! The kernel's own measure of lb's programs: `kernel.bpf_stats_enabled=1`
//! while a [`BpfStats`] is held, and each attached program's runs and run
//! time (`bpftool`), for the paths and DNS parts.

use std::{path::Path, process::Command, time::Duration};

use anyhow::{Context as _, bail};
use serde_json::Value;

use super::limits::output_within;

/// The programs attached to `cgroup`: (id, name), by `bpftool cgroup show`.
pub fn attached_programs(cgroup: &Path) -> anyhow::Result<Vec<(u64, String)>> {
    let out = output_within(
        Command::new("bpftool").args(["-j", "cgroup", "show"]).arg(cgroup),
        Duration::from_secs(10),
    )?;
    let list: Value =
        serde_json::from_slice(&out.stdout).context("bpftool cgroup show: not JSON")?;
    let programs: Vec<(u64, String)> = list
        .as_array()
        .context("bpftool cgroup show: not a list")?
        .iter()
        .filter_map(|p| Some((p["id"].as_u64()?, p["name"].as_str().unwrap_or("?").to_owned())))
        .collect();
    if programs.is_empty() {
        bail!("bpftool shows no program attached to {}", cgroup.display());
    }
    Ok(programs)
}

/// Per program (name): (run_cnt, run_time_ns).
pub fn program_stats(programs: &[(u64, String)]) -> anyhow::Result<Vec<(String, (u64, u64))>> {
    programs
        .iter()
        .map(|(id, name)| {
            let out = output_within(
                Command::new("bpftool").args(["-j", "prog", "show", "id", &id.to_string()]),
                Duration::from_secs(10),
            )?;
            let prog: Value = serde_json::from_slice(&out.stdout)
                .with_context(|| format!("bpftool prog show id {id}: not JSON"))?;
            Ok((
                name.clone(),
                (prog["run_cnt"].as_u64().unwrap_or(0), prog["run_time_ns"].as_u64().unwrap_or(0)),
            ))
        })
        .collect()
}

/// `kernel.bpf_stats_enabled=1` while held; the previous value is written
/// back on drop (every path: errors and Ctrl-C unwind through it).
pub struct BpfStats {
    previous: String,
}

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    pub fn enable() -> anyhow::Result<Self> {
        let previous = std::fs::read_to_string(BPF_STATS)
            .with_context(|| format!("reading {BPF_STATS}"))?
            .trim()
            .to_owned();
        std::fs::write(BPF_STATS, "1").with_context(|| format!("writing {BPF_STATS}"))?;
        Ok(Self { previous })
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(BPF_STATS, &self.previous) {
            eprintln!("warning: could not set {BPF_STATS} back to {}: {e}", self.previous);
        }
    }
}
