//! Builds the eBPF object (`lb-ebpf`) for the BPF target and embeds it.
//!
//! It needs the nightly toolchain with `rust-src` and a `bpf-linker` built
//! against the nightly's own LLVM under `target/tools/`. This script only
//! uses them; `cargo xtask build-ebpf` (or any xtask command that builds
//! lb) installs them, once. Without the linker the build fails with one
//! line saying so.
//!
//! The object is built once in `target/ebpf/`, which every profile and
//! tool (check, clippy, test, debug, release) shares; see `build_shared`.
//!
//! `AYA_BUILD_SKIP=1` skips the eBPF build (host-only builds, docs).

use std::{
    env,
    fs::{self, File},
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    if env::var("AYA_BUILD_SKIP").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true")) {
        // An empty object keeps host-only builds (check, clippy, docs)
        // compiling; loading it fails with a clear error.
        fs::write(PathBuf::from(env::var("OUT_DIR")?).join("lb"), [])?;
        return aya_build::build_ebpf([], Toolchain::Nightly);
    }
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let workspace = manifest_dir.parent().context("lb-user has no parent directory")?;
    let target_dir =
        env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace.join("target"), PathBuf::from);

    // Where xtask's toolchain module installs the linker.
    let linker_dir = target_dir.join("tools").join("bin");
    let linker = linker_dir.join("bpf-linker");
    // Run again once the linker is there, and when it is rebuilt.
    println!("cargo:rerun-if-changed={}", linker.display());
    if !linker.is_file() {
        // One line that fails the build (no backtrace, unlike an error
        // returned from main under RUST_BACKTRACE).
        println!(
            "cargo::error=bpf-linker is missing (looked for {}): run `cargo xtask build-ebpf` once to install it \
             and the nightly toolchain's rust-src (about a minute), then build again",
            linker.display()
        );
        return Ok(());
    }
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
    build_shared(&target_dir.join("ebpf"), package)
}

/// Builds the object in `shared` and copies it to this build's `OUT_DIR`.
///
/// aya-build builds under `OUT_DIR`, which cargo gives each build of this
/// script: check, clippy, test, debug and release each have their own. So
/// each of them compiled `core` and the programs for the BPF target again
/// (35-45 s each, four times in `cargo xtask test`), although that build
/// is always the same (release, for the BPF target, the same flags). Here
/// it runs in one directory they all share, so that only the first does
/// the work; a lock keeps two concurrent builds (an editor's check and a
/// build) from copying a half-written object.
fn build_shared(shared: &Path, package: Package<'_>) -> anyhow::Result<()> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR is not set")?);
    fs::create_dir_all(shared).with_context(|| format!("creating {}", shared.display()))?;
    let lock_path = shared.join(".lock");
    let lock =
        File::create(&lock_path).with_context(|| format!("creating {}", lock_path.display()))?;
    lock.lock().with_context(|| format!("locking {}", lock_path.display()))?;
    // aya-build takes its directory from OUT_DIR and has no other way to
    // be told.
    // SAFETY: as above, nothing reads the environment concurrently.
    unsafe { env::set_var("OUT_DIR", shared) };
    let built = aya_build::build_ebpf([package], Toolchain::Nightly);
    // SAFETY: as above.
    unsafe { env::set_var("OUT_DIR", &out_dir) };
    built?;
    let object = shared.join("lb");
    fs::copy(&object, out_dir.join("lb"))
        .with_context(|| format!("copying {} to {}", object.display(), out_dir.display()))?;
    Ok(())
}
