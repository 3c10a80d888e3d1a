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
    // Its build script looks for bpf-linker under its target directory.
    std::fs::create_dir_all(&build_dir)?;
    let tools = build_dir.join("tools");
    if !tools.exists() {
        std::os::unix::fs::symlink(target_dir().join("tools"), &tools)
            .with_context(|| format!("linking {}", tools.display()))?;
    }
    let mut cargo = cargo_command(&["build", "--package", "lb-user"])?;
    cargo.current_dir(&src).env("CARGO_TARGET_DIR", &build_dir);
    run_cmd(&mut cargo)?;
    std::fs::copy(build_dir.join("debug/lb"), &bin)
        .with_context(|| format!("copying the previous lb to {}", bin.display()))?;
    // The binary is what is kept; its build is gigabytes.
    let _ = std::fs::remove_dir_all(&src);
    let _ = std::fs::remove_dir_all(&build_dir);
    Ok(Some(bin))
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
