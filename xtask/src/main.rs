//! `cargo xtask`: build, run, demo and test lb. See README.md.

mod bench;
mod demo;
mod vmtest;

use std::{
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build the eBPF object (and the toolchain it needs, once).
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
    /// Run every test: host tests, the privileged integration tests on this
    /// kernel, a demo smoke run, then the integration tests in VMs on other
    /// kernels (`vmtest`).
    Test,
    /// Run the privileged integration tests on other kernels, each booted
    /// in a QEMU guest (virtme-ng). Default: Debian's bullseye, bookworm
    /// and trixie kernels.
    Vmtest {
        /// A kernel package (.deb) or image (vmlinuz) to test instead of
        /// the default kernels; may be repeated.
        #[arg(long)]
        kernel: Vec<PathBuf>,
    },
    /// As root: the datapath's cost to applications (connect rate and bulk
    /// throughput through a VIP), as ratios against direct connections and
    /// a userspace proxy measured in the same run. Loopback only.
    Bench,
    /// (internal) The benchmark's client.
    #[command(hide = true)]
    BenchClient { mode: String, addr: String, amount: u64 },
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
    match task {
        Task::BuildEbpf => cargo(&["build", "--package", "lb-user"]),
        Task::Run { args } => {
            cargo(&["build", "--package", "lb-user"])?;
            let status = Command::new(lb_bin()).args(&args).status().context("running lb")?;
            if !status.success() {
                bail!("lb exited with {status}");
            }
            Ok(())
        }
        Task::Demo { exit_after } => {
            cargo(&["build", "--package", "lb-user"])?;
            demo::run(exit_after)
        }
        Task::Test => test(),
        Task::Vmtest { kernel } => vmtest::run(kernel),
        Task::DemoGet { addr } => demo::get(&addr),
        Task::Bench => bench::run(),
        Task::BenchClient { mode, addr, amount } => bench::client_main(&mode, &addr, amount),
    }
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace().join("target"), PathBuf::from)
}

fn lb_bin() -> PathBuf {
    target_dir().join("debug/lb")
}

fn cargo(args: &[&str]) -> anyhow::Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .args(args)
        .current_dir(workspace())
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn test() -> anyhow::Result<()> {
    println!("==> host tests (no privileges needed)");
    cargo(&["test", "--workspace", "--exclude", "lb-tests"])?;

    println!("==> privileged integration tests on the host kernel");
    cargo(&["build", "--package", "lb-user"])?;
    if !is_root() {
        println!("(not root: the integration tests will report themselves skipped)");
    }
    // SAFETY: single-threaded at this point; children inherit it.
    unsafe {
        std::env::set_var("LB_BIN", lb_bin());
        // This kernel is the reference: every optional feature must be there.
        std::env::set_var("LB_TEST_REQUIRE_FEATURES", "1");
    }
    cargo(&["test", "--package", "lb-tests"])?;

    if !is_root() {
        println!("(not root: the demo smoke run and the VM tests are skipped)");
        return Ok(());
    }
    println!("==> demo smoke run");
    demo::run(3)?;

    println!("==> the integration tests on other kernels, in VMs");
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        // Three kernels take ~10.5 min under software emulation, which on
        // top of a cold build passes 20 min; CI keeps the oldest and the
        // newest. `cargo xtask vmtest` runs all three.
        println!("CI: testing Linux 5.10 (bullseye) and 6.12 (trixie); `cargo xtask vmtest` also runs 6.1 (bookworm)");
        vmtest::run(vec!["bullseye".into(), "trixie".into()])
    } else {
        vmtest::run(Vec::new())
    }
}
