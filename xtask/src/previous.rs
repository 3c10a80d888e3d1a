//! The previous version of lb, built from its commit, for the test of a
//! real upgrade (`tests/upgrade.rs`): its daemon attaches its own programs,
//! and this version's daemon must replace them in place while clients
//! connect.
//!
//! [`PREVIOUS`] is the last version whose programs differ from this one's
//! with the same map layout. Move it forward when a version with different
//! programs is released; when the map layout changes, an upgrade is no
//! longer in place (`lb detach` first), and the test says so.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use crate::{
    cargo::cargo_command,
    cmd::{run_cmd, target_dir, workspace},
};

/// The commit of the previous version: main with the membership
/// elections (layout 10), before the established flows' short way
/// (`EPOCH`, `VIP_PORTS`, layout 11).
pub const PREVIOUS: &str = "422b988db1f33e98460e1809ef009d3374f5b4b1";

/// The directories of compiled units that the previous version's build
/// can take from this version's (`seed`): lb's debug build, and the eBPF
/// build's (`core` for the BPF target, its build scripts), which
/// `lb-user/build.rs` keeps under `target/ebpf/`.
const SEEDED: [&str; 3] = [
    "debug",
    "ebpf/aya-build/target/lb-ebpf/release",
    "ebpf/aya-build/target/lb-ebpf/bpfel-unknown-none/release",
];

/// The previous version's `lb`, built once under `target/previous/` (and
/// kept there for the next run). `None` when this clone lacks its commit
/// (a shallow clone), said on stdout.
pub fn build() -> anyhow::Result<Option<PathBuf>> {
    let short = &PREVIOUS[..12];
    let dir = target_dir().join("previous");
    let bin = dir.join(format!("lb-{short}"));
    if bin.is_file() {
        return Ok(Some(bin));
    }
    if !has_commit() {
        println!(
            "SKIPPED: the upgrade from the previous version: commit {short} is not in this clone (a shallow clone?)"
        );
        return Ok(None);
    }
    println!("==> building the previous version of lb ({short}) for the upgrade test");
    let src = dir.join(format!("src-{short}"));
    let build_dir = dir.join("target");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src).with_context(|| format!("creating {}", src.display()))?;
    extract(&src)?;
    std::fs::create_dir_all(&build_dir)?;
    for profile in SEEDED {
        seed(&target_dir().join(profile), &build_dir.join(profile))?;
    }
    // Its build script looks for bpf-linker under its target directory.
    let tools = build_dir.join("tools");
    if !tools.exists() {
        std::os::unix::fs::symlink(target_dir().join("tools"), &tools)
            .with_context(|| format!("linking {}", tools.display()))?;
    }
    let mut cargo = cargo_command(&["build", "--package", "lb-user"])?;
    cargo.current_dir(&src).env("CARGO_TARGET_DIR", &build_dir);
    run_cmd(&mut cargo)?;
    let built = build_dir.join("debug/lb");
    if std::fs::read(&built).ok() == std::fs::read(crate::cmd::lb_bin()).ok() {
        bail!(
            "the build of {short} produced this version's lb ({}): a seeded unit of lb was taken as fresh",
            built.display()
        );
    }
    std::fs::copy(&built, &bin)
        .with_context(|| format!("copying the previous lb to {}", bin.display()))?;
    // The binary is what is kept; its build is gigabytes.
    let _ = std::fs::remove_dir_all(&src);
    let _ = std::fs::remove_dir_all(&build_dir);
    Ok(Some(bin))
}

/// Hard-links this version's compiled dependencies from `from` (one of
/// [`SEEDED`]) into `to`, the previous version's, so that its build
/// compiles only what differs: the dependencies at the same versions,
/// features and flags are the same units (cargo names them by a hash of
/// those), and a fresh unit is only read. lb's own crates (`lb-*`) stay
/// out: the previous version's have the same names and versions, so the
/// same hashes, and cargo would take this version's as fresh for them.
/// About 4 minutes of CI's build become 1 on the 2-CPU machine. Nothing
/// there yet (no debug build) is not an error: it all builds.
fn seed(from: &Path, to: &Path) -> anyhow::Result<()> {
    for dir in ["deps", "build", ".fingerprint"] {
        let (from, to) = (from.join(dir), to.join(dir));
        let Ok(entries) = std::fs::read_dir(&from) else { continue };
        std::fs::create_dir_all(&to).with_context(|| format!("creating {}", to.display()))?;
        let mut sources = Vec::new();
        for entry in entries {
            let entry = entry.with_context(|| format!("reading {}", from.display()))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let crate_name = name.strip_prefix("lib").unwrap_or(&name);
            if !(crate_name.starts_with("lb-") || crate_name.starts_with("lb_")) {
                sources.push(entry.path());
            }
        }
        if sources.is_empty() {
            continue;
        }
        let linked = Command::new("cp").arg("-al").args(&sources).arg(&to).status();
        if !linked.as_ref().is_ok_and(std::process::ExitStatus::success) {
            bail!("cp -al of {} into {}: {linked:?}", from.display(), to.display());
        }
    }
    Ok(())
}

fn has_commit() -> bool {
    Command::new("git")
        .args(["cat-file", "-e", &format!("{PREVIOUS}^{{commit}}")])
        .current_dir(workspace())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// The previous version's tree, from git, into `src`.
fn extract(src: &Path) -> anyhow::Result<()> {
    let mut archive = Command::new("git")
        .args(["archive", "--format=tar", PREVIOUS])
        .current_dir(workspace())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting git archive")?;
    let tar = Command::new("tar")
        .arg("-x")
        .current_dir(src)
        .stdin(archive.stdout.take().context("git archive's output")?)
        .status()
        .context("running tar")?;
    let archived = archive.wait().context("waiting for git archive")?;
    if !archived.success() || !tar.success() {
        bail!("extracting {PREVIOUS} into {}: git archive {archived}, tar {tar}", src.display());
    }
    Ok(())
}
