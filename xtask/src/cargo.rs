//! `cargo` in the workspace, as xtask runs it: with the installed
//! bpf-linker on `PATH` and without the variables cargo set for xtask.

use std::process::Command;

use crate::{
    cmd::{remove_package_env, run_cmd, workspace},
    toolchain,
};

/// `cargo ARGS` in the workspace, with the installed bpf-linker first on
/// `PATH` (see [`toolchain::path_with_linker`]).
pub fn cargo_command(args: &[&str]) -> anyhow::Result<Command> {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args(args).current_dir(workspace()).env("PATH", toolchain::path_with_linker()?);
    remove_package_env(&mut cmd);
    Ok(cmd)
}

/// Runs `cargo ARGS` in the workspace (see [`cargo_command`]).
pub fn cargo(args: &[&str]) -> anyhow::Result<()> {
    run_cmd(&mut cargo_command(args)?)
}
