//! `cargo xtask`: build, run, demo and test lb. See README.md.
//!
//! Every task that builds lb first installs what that build needs
//! ([`toolchain::ensure`]), so each works on a fresh machine.

mod bench;
mod cargo;
mod cmd;
mod demo;
mod doc_paths;
mod fuzz;
mod previous;
mod stages;
mod test_suite;
mod toolchain;
mod vmtest;

use std::process::{Command, ExitCode};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

use crate::{cargo::cargo, cmd::lb_bin};

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
    /// Check that the docs name only paths that exist and that
    /// ARCHITECTURE.md names every source file (as `test` does first).
    CheckDocs,
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
            test_suite::run()
        }
        Task::Vmtest(args) => {
            // A bad argument fails before anything is installed or built.
            let kernels = args.kernel_specs()?;
            toolchain::ensure()?;
            vmtest::run(&kernels, args.guests(), args.filter.as_deref(), None)
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
        Task::CheckDocs => doc_paths::check(&cmd::workspace()),
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
