//! Builds the eBPF object (`lb-ebpf`) for the BPF target and embeds it.
//!
//! On a fresh machine this first installs what that build needs, so a plain
//! `cargo build` works with nothing done by hand:
//! - the nightly toolchain's `rust-src` component (for `-Z build-std=core`);
//! - `bpf-linker`, built against the nightly toolchain's own shared LLVM
//!   (no prebuilt linker matches it), under `target/tools/`.
//!
//! `AYA_BUILD_SKIP=1` skips all of it (host-only builds, docs, clippy).

use std::{
    env,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use aya_build::{Package, Toolchain};

/// The bpf-linker release known to build against the nightly's LLVM 22.
const BPF_LINKER_VERSION: &str = "0.13.0";

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
    if env::var("AYA_BUILD_SKIP").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true")) {
        // An empty object keeps host-only builds (check, clippy, docs)
        // compiling; loading it fails with a clear error.
        fs::write(PathBuf::from(env::var("OUT_DIR")?).join("lb"), [])?;
        return aya_build::build_ebpf([], Toolchain::Nightly);
    }
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let workspace = manifest_dir.parent().context("lb-user has no parent directory")?;
    let target_dir = env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace.join("target"), PathBuf::from);
    let tools = target_dir.join("tools");

    ensure_rust_src()?;
    let linker_dir = ensure_bpf_linker(&tools)?;
    // aya-build runs `rustup run nightly cargo build` from this process; it
    // must find our bpf-linker first on PATH.
    let path = env::var_os("PATH").unwrap_or_default();
    let path = env::join_paths(std::iter::once(linker_dir).chain(env::split_paths(&path)))?;
    // SAFETY: build scripts are single-threaded; nothing reads the
    // environment concurrently.
    unsafe { env::set_var("PATH", &path) };

    let ebpf_dir = workspace.join("lb-ebpf");
    let ebpf_dir = ebpf_dir.to_str().context("lb-ebpf path is not UTF-8")?;
    let package = Package { name: "lb-ebpf", root_dir: ebpf_dir, ..Default::default() };
    aya_build::build_ebpf([package], Toolchain::Nightly)
}

fn nightly(tool: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", tool]);
    // Settings meant for the outer (host) build must not leak into ours.
    for key in ["RUSTC", "RUSTC_WRAPPER", "RUSTC_WORKSPACE_WRAPPER", "RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS", "RUSTUP_TOOLCHAIN"] {
        cmd.env_remove(key);
    }
    cmd
}

fn output(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("failed to run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ensure_rust_src() -> anyhow::Result<()> {
    let installed = output(Command::new("rustup").args(["component", "list", "--installed", "--toolchain", "nightly"]))
        .context("the nightly toolchain is needed to build the eBPF programs")?;
    if installed.lines().any(|l| l.starts_with("rust-src")) {
        return Ok(());
    }
    println!("cargo:warning=installing rust-src for the nightly toolchain (needed to build eBPF)");
    output(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))?;
    Ok(())
}

/// Installs bpf-linker under `tools/bin` unless it is there; returns that dir.
fn ensure_bpf_linker(tools: &Path) -> anyhow::Result<PathBuf> {
    let bin_dir = tools.join("bin");
    if bin_dir.join("bpf-linker").is_file() {
        return Ok(bin_dir);
    }
    // The linker must use the very LLVM the nightly rustc was built with:
    // take its major version from `rustc -vV` and link against the shared
    // library in the toolchain's sysroot.
    let version = output(nightly("rustc").arg("-vV"))?;
    let llvm_major = version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("`rustc +nightly -vV` does not report an LLVM version")?
        .to_owned();
    let sysroot = PathBuf::from(output(nightly("rustc").args(["--print", "sysroot"]))?.trim());
    let libllvm = fs::read_dir(sysroot.join("lib"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libLLVM") && n.contains(".so")))
        .with_context(|| format!("no libLLVM shared library in {}/lib", sysroot.display()))?;

    let prefix = tools.join("llvm");
    fs::create_dir_all(prefix.join("lib"))?;
    let link = prefix.join("lib").join("libLLVM.so");
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(&libllvm, &link)?;

    println!("cargo:warning=building bpf-linker {BPF_LINKER_VERSION} against {} (once, about a minute)", libllvm.display());
    let mut install = Command::new("cargo");
    for key in ["RUSTC", "RUSTC_WRAPPER", "RUSTC_WORKSPACE_WRAPPER", "RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS", "CARGO_BUILD_TARGET"] {
        install.env_remove(key);
    }
    install
        .env("LLVM_PREFIX", &prefix)
        .env("CARGO_TARGET_DIR", tools.join("build"))
        .args(["install", "--locked", "bpf-linker", "--version", BPF_LINKER_VERSION, "--no-default-features"])
        .arg("--features")
        .arg(format!("llvm-{llvm_major}"))
        .arg("--root")
        .arg(tools);
    let status = install.status().with_context(|| format!("failed to run {install:?}"))?;
    if !status.success() {
        bail!("installing bpf-linker failed ({status}); command: {install:?}");
    }
    Ok(bin_dir)
}
