//! `cargo xtask test`: every check and test, in order — formatting and
//! lints, the host tests, the fuzz targets briefly, the privileged
//! integration tests on this kernel, a demo smoke run, then the
//! integration tests on other kernels in VMs — with a table of each
//! stage's time at the end.

use crate::{
    cargo::{cargo, cargo_command},
    cmd::{self, is_root, lb_bin, run_cmd, workspace},
    demo, doc_paths, fuzz, previous,
    stages::Stages,
    toolchain,
    vmtest::{self, KernelSpec, Release},
};

/// What the integration tests run besides lb: dnsmasq, `dig` and a static
/// musl resolver (`tests/musl/resolve.c`) for the UDP tests; BIRD for the
/// BGP tests (the speaker lb runs, and their router).
const TEST_PACKAGES: [&str; 4] = ["dnsmasq-base", "bind9-dnsutils", "musl-tools", "bird2"];

/// `cargo xtask test`: the style checks, then every tier of tests (see
/// the README), each stage timed; the table of their times closes the
/// run, also when it fails. Expects [`toolchain::ensure`] to have run.
pub fn run() -> anyhow::Result<()> {
    let mut stages = Stages::new();
    let result = stages_in_order(&mut stages);
    stages.finish(if result.is_ok() { "passed" } else { "failed" });
    result
}

fn stages_in_order(stages: &mut Stages) -> anyhow::Result<()> {
    if is_root() {
        // Before anything builds the tests: their build script compiles
        // the musl resolver with musl-tools.
        cmd::install_missing_packages(&TEST_PACKAGES)?;
    }
    stages.begin("formatting, lints and docs");
    style_checks()?;

    stages.begin("host tests (no privileges needed)");
    cargo(&["test", "--workspace", "--exclude", "lb-tests"])?;

    // Each target briefly; `cargo xtask fuzz` runs them longer.
    stages.begin("fuzz targets, briefly");
    fuzz::run(&fuzz::Args { seconds: fuzz::TEST_SECONDS, target: None })?;

    stages.begin("lb and the previous version, built");
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
    stages.begin("privileged integration tests on the host kernel");
    cargo(&["test", "--package", "lb-tests"])?;

    if !is_root() {
        println!("(not root: the demo smoke run and the VM tests are skipped)");
        return Ok(());
    }
    stages.begin("demo smoke run");
    demo::run(3)?;

    if std::env::var("CI").is_ok_and(|v| v == "true") {
        // Under software emulation on the 2-CPU machine the oldest kernel
        // takes 10-12 min with every binary, about 8 without those of
        // `TRIMMED_IN_CI`; the newest, between it and the host's, runs the
        // binaries that drive the kernel most directly (`CI_NEWEST`): about
        // 2 min. `cargo xtask vmtest` runs everything on all three.
        println!(
            "CI: Linux 5.10 (bullseye) trimmed, 6.12 (trixie) the kernel's own tests; \
             `cargo xtask vmtest` runs everything on 5.10, 6.1 and 6.12"
        );
        vmtest::run(
            &[KernelSpec::Release(Release::Bullseye)],
            vmtest::Guests::Trimmed,
            None,
            Some(stages),
        )?;
        let newest = vmtest::CI_NEWEST.map(str::to_owned).to_vec();
        vmtest::run(
            &[KernelSpec::Release(Release::Trixie)],
            vmtest::Guests::Only(newest),
            None,
            Some(stages),
        )
    } else {
        vmtest::run(&Release::ALL.map(KernelSpec::Release), vmtest::Guests::All, None, Some(stages))
    }
}

/// Formatting and lints, before any test runs: `cargo fmt --check` over
/// the workspace, clippy with warnings as errors over the host crates
/// (a real build: lb-user embeds the eBPF object), their docs with
/// rustdoc's warnings as errors, and clippy over the eBPF crate for the
/// BPF target.
fn style_checks() -> anyhow::Result<()> {
    toolchain::ensure_lint_tools()?;
    println!("==> the docs name only paths that exist, and ARCHITECTURE.md every source file");
    doc_paths::check(&workspace())?;
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
