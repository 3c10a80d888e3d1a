//! What building lb needs beyond the stable toolchain, installed once:
//! - the nightly toolchain (for the eBPF programs) and its `rust-src`
//!   component (for `-Z build-std=core`);
//! - `bpf-linker`, built against the nightly toolchain's own shared LLVM
//!   (no prebuilt linker matches it), under `target/tools/`;
//! - for `cargo xtask test`'s style checks, rustfmt and clippy of the
//!   toolchain running xtask, and clippy of the nightly.
//!
//! `lb-user/build.rs` only uses the linker installed here, and asks for
//! `cargo xtask build-ebpf` when it is missing.

use std::{
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context as _;

use crate::cmd::{output_of, remove_package_env, run_cmd, target_dir};

/// The bpf-linker release known to build against the nightly's LLVM 22.
const BPF_LINKER_VERSION: &str = "0.13.0";
/// The toolchain the eBPF programs build with (aya-build's `Toolchain::Nightly`).
const NIGHTLY: &str = "nightly";
/// Variables meant for the outer (host) build that must not leak into a
/// nightly or `cargo install` child.
const HOST_BUILD_ENV: [&str; 6] = [
    "RUSTC",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_BUILD_TARGET",
];

/// Makes sure everything the eBPF build needs is installed: the nightly
/// toolchain, its `rust-src`, and bpf-linker under `target/tools/`. Each
/// step is skipped when already done; the first run takes about a minute.
pub fn ensure() -> anyhow::Result<()> {
    ensure_nightly()?;
    ensure_component(Some(NIGHTLY), "rust-src")?;
    ensure_bpf_linker(&tools_dir())
}

/// Makes sure rustfmt and clippy are there for the style checks: both for
/// the toolchain running xtask (the host build's), clippy for the nightly
/// (the eBPF crate's).
pub fn ensure_lint_tools() -> anyhow::Result<()> {
    ensure_component(None, "rustfmt")?;
    ensure_component(None, "clippy")?;
    ensure_component(Some(NIGHTLY), "clippy")
}

/// Where the tools built here live: `target/tools/` (`bin/bpf-linker`,
/// `llvm/`, the link to the nightly's libLLVM, and `build/`).
fn tools_dir() -> PathBuf {
    target_dir().join("tools")
}

/// The directory holding the installed `bpf-linker`.
fn linker_dir() -> PathBuf {
    tools_dir().join("bin")
}

/// `PATH` with [`linker_dir`] first, for cargo children: aya-build (in
/// `lb-user/build.rs`) finds the linker on it.
pub fn path_with_linker() -> anyhow::Result<OsString> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::join_paths(std::iter::once(linker_dir()).chain(std::env::split_paths(&path)))
        .with_context(|| format!("adding {} to PATH", linker_dir().display()))
}

/// `rustup run nightly <tool>`, without the host build's settings (nor
/// the toolchain rustup chose for xtask, in `RUSTUP_TOOLCHAIN`).
pub fn nightly(tool: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", NIGHTLY, tool]).env_remove("RUSTUP_TOOLCHAIN");
    for key in HOST_BUILD_ENV {
        cmd.env_remove(key);
    }
    remove_package_env(&mut cmd);
    cmd
}

/// Installs the nightly toolchain (minimal profile) unless it is there.
fn ensure_nightly() -> anyhow::Result<()> {
    let toolchains = output_of(Command::new("rustup").args(["toolchain", "list"]))?;
    if toolchains.lines().any(is_plain_nightly) {
        return Ok(());
    }
    println!("==> installing the nightly toolchain (the eBPF programs need it)");
    run_cmd(Command::new("rustup").args(["toolchain", "install", NIGHTLY, "--profile", "minimal"]))
}

/// Whether a line of `rustup toolchain list` is the toolchain `nightly`
/// names (`nightly-x86_64-unknown-linux-gnu (default)`), not a dated one
/// (`nightly-2025-01-01-...`), which `rustup run nightly` would not use.
fn is_plain_nightly(line: &str) -> bool {
    let name = line.split_whitespace().next().unwrap_or_default();
    name.strip_prefix(NIGHTLY).is_some_and(|rest| {
        rest.is_empty()
            || rest
                .strip_prefix('-')
                .is_some_and(|host| !host.starts_with(|c: char| c.is_ascii_digit()))
    })
}

/// Adds `component` to `toolchain` (`None`: the one running xtask) unless
/// it is installed.
fn ensure_component(toolchain: Option<&str>, component: &str) -> anyhow::Result<()> {
    let rustup = |args: &[&str]| {
        let mut cmd = Command::new("rustup");
        cmd.args(args);
        if let Some(toolchain) = toolchain {
            cmd.args(["--toolchain", toolchain]);
        }
        cmd
    };
    let installed = output_of(&mut rustup(&["component", "list", "--installed"]))?;
    // Lines are `rust-src` or `clippy-x86_64-unknown-linux-gnu`.
    if installed.lines().any(|line| {
        line == component || line.strip_prefix(component).is_some_and(|rest| rest.starts_with('-'))
    }) {
        return Ok(());
    }
    // rustup names the toolchain running xtask in RUSTUP_TOOLCHAIN.
    let name = toolchain.map(str::to_owned).or_else(|| std::env::var("RUSTUP_TOOLCHAIN").ok());
    println!("==> adding {component} to the {} toolchain", name.as_deref().unwrap_or("current"));
    run_cmd(&mut rustup(&["component", "add", component]))
}

/// Installs bpf-linker into `tools/bin` unless it is there.
///
/// The linker must use the very LLVM the nightly rustc was built with: its
/// major version comes from `rustc -vV` (the `llvm-NN` feature), and it is
/// linked against the shared library in the toolchain's sysroot, so a
/// newer nightly keeps working.
fn ensure_bpf_linker(tools: &Path) -> anyhow::Result<()> {
    if tools.join("bin/bpf-linker").is_file() {
        return Ok(());
    }
    let version = output_of(nightly("rustc").arg("-vV"))?;
    let llvm_major =
        llvm_major(&version).context("`rustc +nightly -vV` reports no LLVM version")?;
    let sysroot = PathBuf::from(output_of(nightly("rustc").args(["--print", "sysroot"]))?.trim());
    let sysroot_lib = sysroot.join("lib");
    let libllvm = fs::read_dir(&sysroot_lib)
        .with_context(|| format!("listing {}", sysroot_lib.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM") && n.contains(".so"))
        })
        .with_context(|| format!("no libLLVM shared library in {}", sysroot_lib.display()))?;

    // bpf-linker's build finds LLVM as `$LLVM_PREFIX/lib/libLLVM.so`.
    let prefix = tools.join("llvm");
    let link = prefix.join("lib/libLLVM.so");
    fs::create_dir_all(prefix.join("lib"))
        .with_context(|| format!("creating {}/lib", prefix.display()))?;
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(&libllvm, &link)
        .with_context(|| format!("linking {} to {}", link.display(), libllvm.display()))?;

    println!(
        "==> building bpf-linker {BPF_LINKER_VERSION} against {} (once, about a minute)",
        libllvm.display()
    );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut install = Command::new(cargo);
    for key in HOST_BUILD_ENV {
        install.env_remove(key);
    }
    remove_package_env(&mut install);
    install
        .env("LLVM_PREFIX", &prefix)
        .env("CARGO_TARGET_DIR", tools.join("build"))
        .args([
            "install",
            "--locked",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--no-default-features",
        ])
        .arg("--features")
        .arg(format!("llvm-{llvm_major}"))
        .arg("--root")
        .arg(tools);
    run_cmd(&mut install).context("installing bpf-linker")
}

/// The LLVM major version in `rustc -vV`'s output (`LLVM version: 22.1.2`).
fn llvm_major(rustc_version: &str) -> Option<&str> {
    rustc_version
        .lines()
        .find_map(|line| line.strip_prefix("LLVM version: "))
        .and_then(|version| version.split('.').next())
        .filter(|major| !major.is_empty() && major.chars().all(|c| c.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nightly_toolchain_names() {
        assert!(is_plain_nightly("nightly-x86_64-unknown-linux-gnu"));
        assert!(is_plain_nightly("nightly-x86_64-unknown-linux-gnu (default)"));
        assert!(is_plain_nightly("nightly"));
        assert!(!is_plain_nightly("nightly-2025-01-01-x86_64-unknown-linux-gnu"));
        assert!(!is_plain_nightly("stable-x86_64-unknown-linux-gnu (active, default)"));
        assert!(!is_plain_nightly(""));
    }

    #[test]
    fn llvm_major_from_rustc() {
        let text = "rustc 1.97.0-nightly (0123456 2026-05-01)\nbinary: rustc\nhost: x86_64-unknown-linux-gnu\nrelease: 1.97.0-nightly\nLLVM version: 22.1.2\n";
        assert_eq!(llvm_major(text), Some("22"));
        assert_eq!(llvm_major("rustc 1.0\n"), None);
    }
}
