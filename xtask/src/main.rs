//! `cargo xtask`: build, run, demo and test lb. See README.md.
//!
//! Every task that builds lb first installs what that build needs
//! ([`toolchain::ensure`]), so each works on a fresh machine.

mod bench;
mod cargo;
mod cmd;
mod demo;
mod fuzz;
mod previous;
mod toolchain;
mod vmtest;

use std::{
    process::{Command, ExitCode},
    time::Instant,
};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
// fuzz.rs imports these from the crate root.
use cmd::{run_cmd, workspace};
use vmtest::{KernelSpec, Release};

use crate::{
    cargo::{cargo, cargo_command},
    cmd::{is_root, lb_bin},
};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what the eBPF build needs (once: the nightly's rust-src and
    /// bpf-linker under target/tools/), then build lb with its eBPF object.
    /// After this, a plain `cargo build` works.
    BuildEbpf,
    /// Build lb and run it with the given arguments, e.g.
    /// `cargo xtask run -- run --config deploy/config.toml`.
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Three HTTP backends on loopback behind the VIP 127.0.0.1:6444.
    Demo {
        /// Exit by itself after this many seconds (0: run until Ctrl-C).
        #[arg(long, default_value_t = 0)]
        exit_after: u64,
    },
    /// Run every check and test: formatting, clippy and rustdoc, host tests, each
    /// fuzz target briefly, the privileged integration tests on this
    /// kernel, a demo smoke run, then
    /// the integration tests in VMs on other kernels (`vmtest`).
    Test,
    /// Run the privileged integration tests on other kernels, each booted
    /// in a QEMU guest (virtme-ng). Default: Debian's bullseye (5.10),
    /// bookworm (6.1) and trixie (6.12) kernels; `--release` and `--kernel`
    /// replace that list.
    Vmtest(vmtest::Args),
    /// Build the previous version of lb (from its commit) for the upgrade
    /// test, as `test` does, and print where its `lb` is.
    BuildPrevious,
    /// As root, loopback only, a few minutes: lb's speed side by side with
    /// direct connections, haproxy and nginx (wrk, connect + close, bulk),
    /// scale (10,000 and 16,384 services, reload), failover and discovery
    /// latency. A table, target/bench/report.md and target/bench/ratios.svg.
    Bench(bench::Args),
    /// Run the fuzz targets under fuzz/ (cargo-fuzz on the nightly): config
    /// parsing, control requests, the state file, kernel event decoding.
    /// Fails if any target finds a crash.
    Fuzz(fuzz::Args),
    /// (internal) The benchmark's client.
    #[command(hide = true)]
    BenchClient {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// (internal) One HTTP GET from inside the demo cgroup.
    #[command(hide = true)]
    DemoGet { addr: String },
}

fn main() -> ExitCode {
    // A failed task says what failed; a backtrace of xtask itself (which
    // anyhow would add under RUST_BACKTRACE=1) says nothing more.
    match run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(task: Task) -> anyhow::Result<()> {
    // Every task that builds lb first installs what that build needs.
    match task {
        Task::BuildEbpf => {
            toolchain::ensure()?;
            cargo(&["build", "--package", "lb-user"])
        }
        Task::Run { args } => {
            toolchain::ensure()?;
            cargo(&["build", "--package", "lb-user"])?;
            let status = Command::new(lb_bin()).args(&args).status().context("running lb")?;
            if !status.success() {
                bail!("lb exited with {status}");
            }
            Ok(())
        }
        Task::Demo { exit_after } => {
            toolchain::ensure()?;
            cargo(&["build", "--package", "lb-user"])?;
            demo::run(exit_after)
        }
        Task::Test => {
            toolchain::ensure()?;
            test()
        }
        Task::Vmtest(args) => {
            // A bad argument fails before anything is installed or built.
            let kernels = args.kernel_specs()?;
            toolchain::ensure()?;
            vmtest::run(&kernels, vmtest::Guests::All)
        }
        Task::Bench(args) => {
            toolchain::ensure()?;
            bench::run(&args)
        }
        Task::Fuzz(args) => {
            toolchain::ensure()?;
            fuzz::run(&args)
        }
        Task::DemoGet { addr } => demo::get(&addr),
        Task::BuildPrevious => {
            toolchain::ensure()?;
            match previous::build()? {
                Some(bin) => println!("{}", bin.display()),
                None => bail!("this clone lacks the previous version's commit"),
            }
            Ok(())
        }
        Task::BenchClient { args } => bench::client_main(&args),
    }
}

/// What the integration tests run besides lb: dnsmasq, `dig` and a static
/// musl resolver (`tests/musl/resolve.c`) for the UDP tests.
const TEST_PACKAGES: [&str; 3] = ["dnsmasq-base", "bind9-dnsutils", "musl-tools"];

/// `cargo xtask test`: the style checks, then every tier of tests (see
/// the README). Expects [`toolchain::ensure`] to have run.
fn test() -> anyhow::Result<()> {
    if is_root() {
        // Before anything builds the tests: their build script compiles
        // the musl resolver with musl-tools.
        cmd::install_missing_packages(&TEST_PACKAGES)?;
    }
    let started = Instant::now();
    style_checks()?;

    stage(started, "host tests (no privileges needed)");
    cargo(&["test", "--workspace", "--exclude", "lb-tests"])?;

    // Each target briefly; `cargo xtask fuzz` runs them longer.
    fuzz::run(&fuzz::Args { seconds: fuzz::TEST_SECONDS, target: None })?;

    stage(started, "privileged integration tests on the host kernel");
    cargo(&["build", "--package", "lb-user"])?;
    if !is_root() {
        println!("(not root: the integration tests will report themselves skipped)");
    }
    let previous = if is_root() { previous::build()? } else { None };
    // SAFETY: single-threaded at this point; children inherit it.
    unsafe {
        std::env::set_var("LB_BIN", lb_bin());
        // This kernel is the reference: every optional feature must be there.
        std::env::set_var("LB_TEST_REQUIRE_FEATURES", "1");
        // The upgrade from the previous version runs here, not in the VMs.
        if let Some(previous) = &previous {
            std::env::set_var("LB_PREVIOUS_BIN", previous);
        }
    }
    cargo(&["test", "--package", "lb-tests"])?;

    if !is_root() {
        println!("(not root: the demo smoke run and the VM tests are skipped)");
        return Ok(());
    }
    stage(started, "demo smoke run");
    demo::run(3)?;

    stage(started, "the integration tests on other kernels, in VMs");
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        // Under software emulation on the 2-CPU machine a kernel takes
        // 10-12 min with every binary, 7-8 min without the elections and
        // discovery through a VIP (`Guests::Trimmed`). CI keeps the oldest
        // and the newest kernel, trimmed: 18.5 min with lb's release
        // build, of 33 min in all. `cargo xtask vmtest` runs everything on
        // all three.
        println!(
            "CI: Linux 5.10 (bullseye) and 6.12 (trixie), trimmed; `cargo xtask vmtest` adds 6.1 and the rest"
        );
        vmtest::run(
            &[KernelSpec::Release(Release::Bullseye), KernelSpec::Release(Release::Trixie)],
            vmtest::Guests::Trimmed,
        )
    } else {
        vmtest::run(&Release::ALL.map(KernelSpec::Release), vmtest::Guests::All)
    }
}

/// A stage's heading, with the time since `cargo xtask test` began: a CI
/// log that ends early still says where the time went.
fn stage(started: Instant, title: &str) {
    let secs = started.elapsed().as_secs();
    println!("==> {title} (at {}:{:02})", secs / 60, secs % 60);
}

/// Formatting and lints, before any test runs: `cargo fmt --check` over
/// the workspace, clippy with warnings as errors over the host crates
/// (a real build: lb-user embeds the eBPF object), their docs with
/// rustdoc's warnings as errors, and clippy over the eBPF crate for the
/// BPF target.
fn style_checks() -> anyhow::Result<()> {
    toolchain::ensure_lint_tools()?;
    println!("==> formatting (cargo fmt --all --check)");
    cargo(&["fmt", "--all", "--check"])?;

    // lb-ebpf is left to the next step: on the host it compiles with an
    // empty `main` and without its `cfg(target_arch = "bpf")` code, so the
    // same lints would be reported twice and the BPF-only code not at all.
    println!("==> lints, host crates (cargo clippy --workspace --all-targets)");
    cargo(&[
        "clippy",
        "--workspace",
        "--exclude",
        "lb-ebpf",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    // lb-user without its discovery sources (the fuzz build's, and a
    // distribution's that does not want kube or hickory): no warning
    // either way.
    println!("==> lints, lb-user without discovery (--no-default-features)");
    cargo(&[
        "clippy",
        "--package",
        "lb-user",
        "--no-default-features",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;

    // Broken intra-doc links, bare URLs, unclosed HTML in doc comments.
    // lb-ebpf only builds for the BPF target. (Not with AYA_BUILD_SKIP:
    // that would swap lb-user's embedded object for an empty one, shared
    // with the builds of the steps after this one.)
    println!("==> docs, host crates (cargo doc --no-deps, warnings denied)");
    let mut doc = cargo_command(&["doc", "--no-deps", "--workspace", "--exclude", "lb-ebpf"])?;
    doc.env("RUSTDOCFLAGS", "-D warnings");
    run_cmd(&mut doc)?;

    // lb-ebpf as lb-user/build.rs (aya-build) builds it: the nightly, the
    // BPF target, core built from source, the target architecture's cfg.
    println!("==> lints, eBPF programs (cargo +nightly clippy --target bpfel-unknown-none)");
    let arch_cfg = format!("--cfg=bpf_target_arch=\"{}\"", std::env::consts::ARCH);
    let mut clippy = toolchain::nightly("cargo");
    clippy
        .args(["clippy", "--package", "lb-ebpf", "--target", "bpfel-unknown-none"])
        .args(["-Z", "build-std=core", "--", "-D", "warnings"])
        .current_dir(workspace())
        .env("CARGO_ENCODED_RUSTFLAGS", arch_cfg);
    run_cmd(&mut clippy)
}
