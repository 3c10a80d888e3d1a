//! `cargo xtask fuzz`: the fuzz targets under `fuzz/` (cargo-fuzz and
//! libFuzzer, on the nightly toolchain), each run for a while on the
//! project's real parsing and decoding code:
//! - `config`: `Config::parse` on any text;
//! - `config_reload`: a reload's parse of only the changed service tables
//!   against the whole parse, on any old and new text;
//! - `control_request`: the control socket's request and response lines;
//! - `state_file`: `servers.json` and the server-list check;
//! - `kernel_event`: ring-buffer records, counter indexes, and the
//!   kernel's `choose_server` for a service of any shape.
//!
//! The targets build once (into `target/fuzz/`, lb-user with
//! `AYA_BUILD_SKIP=1` and without its discovery features: the fuzzed code
//! never loads programs nor follows a source), then each
//! runs for `--seconds`. libFuzzer reads the seed corpus in git
//! (`fuzz/corpus/<target>/`, kept small) and writes what it finds to a
//! working corpus under `target/fuzz/corpus/`, so a run never changes the
//! work tree except for crash inputs in `fuzz/artifacts/` (ignored by git).
//! A crash fails the task, naming the input and how to replay it.
//! cargo-fuzz is installed under `target/tools/` on first use.

use std::{
    fs::{self, File},
    path::{Path, PathBuf},
    process::Command,
    time::SystemTime,
};

use anyhow::{Context as _, bail};

use crate::{
    cmd::{describe, output_of, run_cmd, target_dir, workspace},
    toolchain,
};

/// The fuzz targets, as named in `fuzz/Cargo.toml`.
pub const TARGETS: [&str; 5] =
    ["config", "config_reload", "control_request", "state_file", "kernel_event"];
/// How long `cargo xtask test` runs each target: without a sanitizer
/// (see [`BUILD_ARGS`]), 10 s try about twice the inputs that 20 s did
/// with AddressSanitizer.
pub const TEST_SECONDS: u64 = 10;
/// The cargo-fuzz release these targets are run with.
const CARGO_FUZZ_VERSION: &str = "0.13.2";
/// One input taking longer than this is a finding (a hang or a blow-up).
const INPUT_TIMEOUT_SECONDS: u64 = 10;
/// The build settings, the same for `build` and `run` (cargo-fuzz rebuilds
/// when they differ): release with debug assertions and overflow checks,
/// and no sanitizer. The code the targets reach is safe Rust (lb-user's
/// `unsafe` is in syscalls and kernel-object plumbing, none of it on these
/// paths; the one `read_unaligned`, lb-common's `Event::from_bytes` that
/// `kernel_event` decodes records with, sits behind its length check),
/// where AddressSanitizer has no memory error to find; libFuzzer still
/// catches every panic, overflow, hang and blow-up. Without it the targets
/// build in about 7 minutes instead of 8 on the 2-CPU machine and run 4-5
/// times the inputs per second.
const BUILD_ARGS: [&str; 4] = ["--release", "--debug-assertions", "--sanitizer", "none"];

#[derive(clap::Args, Debug)]
pub struct Args {
    /// How long to run each target.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Run only this target (default: all of them).
    #[arg(long, value_name = "NAME", value_parser = clap::builder::PossibleValuesParser::new(TARGETS))]
    pub target: Option<String>,
}

/// Builds the targets, runs each (or the one asked for) for
/// `args.seconds`, and fails if any of them crashed. Every target runs
/// even when an earlier one crashed.
pub fn run(args: &Args) -> anyhow::Result<()> {
    ensure_cargo_fuzz()?;
    let targets: Vec<&str> = match &args.target {
        Some(name) => vec![name.as_str()],
        None => TARGETS.to_vec(),
    };
    println!("==> building the fuzz targets (cargo +nightly fuzz build, no sanitizer)");
    let mut build = cargo_fuzz("build")?;
    run_cmd(&mut build).context("building the fuzz targets")?;

    let mut failed = Vec::new();
    for target in targets {
        println!("==> fuzzing {target} for {} s", args.seconds);
        if let Err(e) = run_target(target, args.seconds) {
            eprintln!("{e:#}");
            failed.push(target);
        }
    }
    if !failed.is_empty() {
        bail!("fuzz target(s) {} failed (see above)", failed.join(", "));
    }
    Ok(())
}

/// Installs cargo-fuzz under `target/tools/bin` (where
/// [`toolchain::path_with_linker`] puts it first on `PATH`) unless it is
/// there. Expects the nightly toolchain ([`toolchain::ensure`]).
fn ensure_cargo_fuzz() -> anyhow::Result<()> {
    let tools = target_dir().join("tools");
    if tools.join("bin/cargo-fuzz").is_file() {
        return Ok(());
    }
    println!(
        "==> installing cargo-fuzz {CARGO_FUZZ_VERSION} under {} (once, about half a minute)",
        tools.display()
    );
    let mut install = toolchain::nightly("cargo");
    // A debug build: cargo-fuzz only starts cargo and libFuzzer, and it
    // builds in 22 s instead of 34 s on the 2-CPU machine.
    install
        .env("CARGO_TARGET_DIR", tools.join("build"))
        .args(["install", "--debug", "--locked", "cargo-fuzz", "--version", CARGO_FUZZ_VERSION])
        .arg("--root")
        .arg(&tools);
    run_cmd(&mut install).context("installing cargo-fuzz")
}

/// `cargo +nightly fuzz SUBCOMMAND` for the project's fuzz directory, with
/// the build settings and target directory every call shares.
fn cargo_fuzz(subcommand: &str) -> anyhow::Result<Command> {
    let mut cmd = toolchain::nightly("cargo");
    cmd.args(["fuzz", subcommand, "--fuzz-dir", "fuzz", "--target-dir"])
        .arg(fuzz_target_dir())
        .args(BUILD_ARGS)
        .current_dir(workspace())
        .env("PATH", toolchain::path_with_linker()?)
        // lb-user's build script makes an empty eBPF object: nothing here
        // loads programs, and the nightly build needs no bpf-linker.
        .env("AYA_BUILD_SKIP", "1");
    Ok(cmd)
}

fn fuzz_target_dir() -> PathBuf {
    target_dir().join("fuzz")
}

/// Runs one target for `seconds`, its output in a log file; prints a
/// summary line. A crash is an error with what went wrong, the input, and
/// how to replay and minimize it.
fn run_target(target: &str, seconds: u64) -> anyhow::Result<()> {
    let fuzz_dir = workspace().join("fuzz");
    let seeds = fuzz_dir.join("corpus").join(target);
    let corpus = fuzz_target_dir().join("corpus").join(target);
    let artifacts = fuzz_dir.join("artifacts").join(target);
    let logs = fuzz_target_dir().join("logs");
    for dir in [&corpus, &artifacts, &logs] {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let log_path = logs.join(format!("{target}.log"));
    let log =
        File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;

    let mut cmd = cargo_fuzz("run")?;
    // libFuzzer writes new inputs to the first corpus directory only: the
    // seeds in git are read, never added to.
    cmd.arg(target).arg(&corpus).arg(&seeds).arg("--");
    cmd.arg(format!("-max_total_time={seconds}"))
        .arg(format!("-timeout={INPUT_TIMEOUT_SECONDS}"))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg("-print_final_stats=1");
    let dict = fuzz_dir.join("dicts").join(format!("{target}.dict"));
    if dict.is_file() {
        cmd.arg(format!("-dict={}", dict.display()));
    }
    cmd.stdout(log.try_clone()?).stderr(log);

    let started = SystemTime::now();
    let status = cmd.status().with_context(|| format!("running {}", describe(&cmd)))?;
    let output =
        fs::read_to_string(&log_path).with_context(|| format!("reading {}", log_path.display()))?;
    let stats = Stats::from_log(&output);
    if status.success() {
        println!("{target}: {} (log: {})", stats.summary(), log_path.display());
        return Ok(());
    }

    let binary = fuzz_target_dir().join(format!("{}/release/{target}", host_triple()));
    let mut message = format!(
        "{target} failed ({status}) after {}\n--- what went wrong (the whole log: {}):\n{}\n---",
        stats.summary(),
        log_path.display(),
        crash_report(&output, &workspace().to_string_lossy()),
    );
    match new_files(&artifacts, started) {
        inputs if inputs.is_empty() => message.push_str("\nno crash input was written"),
        inputs => {
            for input in inputs {
                message.push_str(&format!(
                    "\ncrash input: {input}\n  replay: {binary} {input}\n  minimize: PATH=target/tools/bin:$PATH AYA_BUILD_SKIP=1 \
                     cargo +nightly fuzz tmin --fuzz-dir fuzz --target-dir {dir} {build} {target} {input}",
                    input = input.display(),
                    build = BUILD_ARGS.join(" "),
                    binary = binary.display(),
                    dir = fuzz_target_dir().display(),
                ));
            }
        }
    }
    bail!(message)
}

/// The lines of a failed run's log that say what went wrong: a panic's
/// message and the stack frames in the project's own code (files under
/// `workspace`), libFuzzer's error lines (and a sanitizer's, were one
/// built in), and where
/// the input was written. The end of the log if none of these is there.
fn crash_report(log: &str, workspace: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    let ours = |line: &str| {
        (line.contains(workspace) || line.contains("fuzz_targets/")) && !line.contains("/target/")
    };
    let mut report = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        if line.contains(" panicked at ") {
            // The location, then the message up to the backtrace.
            report.push(line);
            while i < lines.len()
                && !lines[i].starts_with("stack backtrace:")
                && !lines[i].starts_with("note: ")
                && !lines[i].starts_with("==")
            {
                report.push(lines[i]);
                i += 1;
            }
        } else if line.trim_start().starts_with("at ") && ours(line) {
            // A Rust backtrace frame: its function is on the line before.
            report.extend(i.checked_sub(2).map(|function| lines[function]));
            report.push(line);
        } else if (line.trim_start().starts_with('#') && line.contains(" in ") && ours(line))
            || line.contains("ERROR: ")
            || line.starts_with("SUMMARY: ")
            || line.starts_with("ALARM: ")
            || line.contains("Test unit written to")
        {
            report.push(line);
        }
    }
    if report.is_empty() {
        report = lines[lines.len().saturating_sub(30)..].to_vec();
    }
    report.join("\n")
}

/// The files in `dir` modified at or after `since`, oldest first.
fn new_files(dir: &Path, since: SystemTime) -> Vec<PathBuf> {
    let mut found: Vec<(SystemTime, PathBuf)> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .filter(|(modified, _)| *modified >= since)
        .collect();
    found.sort();
    found.into_iter().map(|(_, path)| path).collect()
}

/// The host's target triple, as cargo-fuzz builds for it explicitly.
fn host_triple() -> String {
    let mut rustc = toolchain::nightly("rustc");
    rustc.arg("-vV");
    output_of(&mut rustc)
        .ok()
        .and_then(|text| {
            text.lines().find_map(|line| line.strip_prefix("host: ").map(str::to_owned))
        })
        .unwrap_or_else(|| format!("{}-unknown-linux-gnu", std::env::consts::ARCH))
}

/// What libFuzzer says about a run, from its log.
#[derive(Debug, Default, PartialEq, Eq)]
struct Stats {
    /// `stat::number_of_executed_units`, else the last status line's `#N`.
    runs: Option<u64>,
    /// `stat::average_exec_per_sec`.
    per_second: Option<u64>,
    /// `cov:` (code edges) and `ft:` (features) of the last status line.
    coverage: Option<u64>,
    features: Option<u64>,
    /// `corp:` of the last status line: inputs in the working corpus.
    corpus: Option<u64>,
}

impl Stats {
    fn from_log(log: &str) -> Self {
        let stat = |name: &str| {
            log.lines().find_map(|line| {
                line.strip_prefix(name)
                    .and_then(|rest| rest.trim_start_matches(':').trim().parse().ok())
            })
        };
        // `#123456	pulse  cov: 1234 ft: 5678 corp: 90/12Kb ...`
        let last_status =
            log.lines().rev().find(|line| line.starts_with('#') && line.contains(" cov: "));
        let field = |name: &str| {
            let line = last_status?;
            let rest = &line[line.find(name)? + name.len()..];
            rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
        };
        let status_runs = last_status
            .and_then(|line| line[1..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok());
        Self {
            runs: stat("stat::number_of_executed_units").or(status_runs),
            per_second: stat("stat::average_exec_per_sec"),
            coverage: field(" cov: "),
            features: field(" ft: "),
            corpus: field(" corp: "),
        }
    }

    fn summary(&self) -> String {
        let show = |value: Option<u64>| value.map_or_else(|| "?".to_owned(), |v| v.to_string());
        format!(
            "{} runs ({}/s), coverage {} edges / {} features, corpus {} inputs",
            show(self.runs),
            show(self.per_second),
            show(self.coverage),
            show(self.features),
            show(self.corpus)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_report_keeps_the_panic_and_our_frames() {
        let log = "INFO: Seed: 1\n#2\tINITED cov: 10 ft: 11 corp: 3/1Kb\n\
                   thread '<unnamed>' (2587) panicked at /w/lb-user/src/config.rs:17:5:\n\
                   index out of bounds\nstack backtrace:\n   0: __rustc::rust_begin_unwind\n\
                   \x20            at /rustc/abc/library/std/src/panicking.rs:689:5\n\
                   \x20  1: lb_user::config::Config::parse\n\x20            at /w/lb-user/src/config.rs:17:5\n\
                   \x20  2: config::_::__libfuzzer_sys_run\n\x20            at ./fuzz_targets/config.rs:12:5\n\
                   \x20  3: libfuzzer_sys::test_input_wrap\n\x20            at /w/target/fuzz/x.rs:1:1\n\
                   ==2587== ERROR: libFuzzer: deadly signal\n    #0 0x5 in f /usr/lib/x.c:1\n\
                   SUMMARY: libFuzzer: deadly signal\nMS: 3 CMP-\n\
                   artifact_prefix='/w/fuzz/artifacts/config/'; Test unit written to /w/fuzz/artifacts/config/crash-1\n";
        assert_eq!(
            crash_report(log, "/w"),
            "thread '<unnamed>' (2587) panicked at /w/lb-user/src/config.rs:17:5:\n\
             index out of bounds\n\
             \x20  1: lb_user::config::Config::parse\n\x20            at /w/lb-user/src/config.rs:17:5\n\
             \x20  2: config::_::__libfuzzer_sys_run\n\x20            at ./fuzz_targets/config.rs:12:5\n\
             ==2587== ERROR: libFuzzer: deadly signal\n\
             SUMMARY: libFuzzer: deadly signal\n\
             artifact_prefix='/w/fuzz/artifacts/config/'; Test unit written to /w/fuzz/artifacts/config/crash-1"
        );
        assert_eq!(crash_report("a\nb\n", "/w"), "a\nb");
    }

    #[test]
    fn stats_from_a_libfuzzer_log() {
        let log = "INFO: Seed: 1\n#2\tINITED cov: 10 ft: 11 corp: 3/1Kb exec/s: 0 rss: 30Mb\n\
                   #1048576\tpulse  cov: 1234 ft: 5678 corp: 90/12Kb lim: 4096 exec/s: 52428 rss: 80Mb\n\
                   Done 1100000 runs in 21 second(s)\nstat::number_of_executed_units: 1100000\n\
                   stat::average_exec_per_sec:     52380\nstat::new_units_added:          87\n";
        let stats = Stats::from_log(log);
        assert_eq!(
            stats,
            Stats {
                runs: Some(1_100_000),
                per_second: Some(52_380),
                coverage: Some(1234),
                features: Some(5678),
                corpus: Some(90)
            }
        );
        assert_eq!(
            stats.summary(),
            "1100000 runs (52380/s), coverage 1234 edges / 5678 features, corpus 90 inputs"
        );
        assert_eq!(
            Stats::from_log("").summary(),
            "? runs (?/s), coverage ? edges / ? features, corpus ? inputs"
        );
    }
}
