//! Running commands and finding things: the workspace and its target
//! directory, a command run to its end (its output on the terminal, or
//! returned), Debian packages installed on demand, and whether this is
//! root. The ground floor of xtask: it imports no other module of it.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

/// The workspace's root directory.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Cargo's target directory (`$CARGO_TARGET_DIR`, or the workspace's).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace().join("target"), PathBuf::from)
}

/// The debug build of `lb`.
pub fn lb_bin() -> PathBuf {
    target_dir().join("debug/lb")
}

/// Removes the variables `cargo run` set for xtask itself
/// (`CARGO_MANIFEST_DIR`, `CARGO_PKG_NAME`, ...) from a cargo child's
/// environment. Build scripts that watch them (ring's does) would
/// otherwise see them change between `cargo xtask ...` and a plain
/// `cargo build`, and rebuild each time.
pub fn remove_package_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let key_text = key.to_string_lossy();
        if key_text.starts_with("CARGO_PKG_")
            || key_text.starts_with("CARGO_MANIFEST_")
            || ["CARGO_CRATE_NAME", "CARGO_BIN_NAME", "CARGO_PRIMARY_PACKAGE"].contains(&&*key_text)
        {
            cmd.env_remove(&key);
        }
    }
}

/// A command as one would type it, for messages.
pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` with its output on the terminal; an unsuccessful exit is an
/// error naming the command.
pub fn run_cmd(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(cmd));
    }
    Ok(())
}

/// Installs whichever of the Debian `packages` are missing (apt-get, as
/// root). Only adds packages; the package lists are updated first only if
/// an install fails, as they may be absent or stale on a fresh machine.
pub fn install_missing_packages(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !dpkg_installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    println!("==> installing {}", missing.join(" "));
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    if !install() {
        run_cmd(
            Command::new("apt-get")
                .args(["update", "-qq"])
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
        if !install() {
            bail!("apt-get install {} failed", missing.join(" "));
        }
    }
    Ok(())
}

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
}

/// Runs `cmd` and returns its standard output (its standard error goes to
/// the terminal); an unsuccessful exit is an error naming the command.
pub fn output_of(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", describe(cmd)))?;
    if !out.status.success() {
        bail!("{} failed ({})", describe(cmd), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
