//! What a run needs on the host: the Debian packages virtme-ng uses,
//! virtme-ng itself in a Python virtual environment of its own, a lock
//! that keeps two runs apart.

use std::{
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::cmd::{install_missing_packages, run_cmd};

/// The virtme-ng release this was verified with, installed into a Python
/// virtual environment of its own under `target/vmtest/`.
const VIRTME_NG_VERSION: &str = "1.42";
/// Debian packages virtme-ng needs. Without udev the guest's output and
/// exit code are lost; python3-venv makes its virtual environment.
const HOST_PACKAGES: [&str; 5] =
    ["qemu-system-x86", "busybox-static", "kmod", "udev", "python3-venv"];
/// How long a run waits for another one in the same target directory.
const LOCK_WAIT: Duration = Duration::from_secs(45 * 60);

/// virtme-ng, ready to run.
pub struct Vng {
    pub program: PathBuf,
    /// `PATH` for it: `vng` starts `virtme-run` by name.
    pub path: OsString,
}

/// Installs what virtme-ng needs when it is missing, and virtme-ng itself
/// into its own virtual environment under `base`. Only ever adds packages;
/// the machine's apt sources and Python packages are not changed.
pub fn ensure(base: &Path) -> anyhow::Result<Vng> {
    install_missing_packages(&HOST_PACKAGES)?;
    let venv = base.join(format!("virtme-ng-{VIRTME_NG_VERSION}"));
    let bin = venv.join("bin");
    // Written last: an interrupted install is never mistaken for a
    // complete one. (Not made aside and renamed: a virtual environment's
    // scripts name their interpreter by its path.)
    let installed = venv.join("installed");
    if !installed.is_file() {
        println!("==> installing virtme-ng {VIRTME_NG_VERSION} into {}", venv.display());
        if venv.exists() {
            fs::remove_dir_all(&venv).with_context(|| format!("removing {}", venv.display()))?;
        }
        let python = if which("python3").is_some() { "python3" } else { "python" };
        run_cmd(Command::new(python).args(["-m", "venv"]).arg(&venv))?;
        let spec = format!("virtme-ng=={VIRTME_NG_VERSION}");
        run_cmd(Command::new(bin.join("pip")).args([
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &spec,
        ]))?;
        fs::write(&installed, &spec).with_context(|| format!("writing {}", installed.display()))?;
    }
    let path = std::env::join_paths(
        std::iter::once(bin.clone())
            .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .context("building PATH for virtme-ng")?;
    Ok(Vng { program: bin.join("vng"), path })
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(program)).find(|candidate| candidate.is_file())
}

/// An exclusive lock on `<base>/lock`, waiting at most [`LOCK_WAIT`] for
/// another run to finish. Released when the file is closed, also when the
/// process dies.
pub fn lock(base: &Path) -> anyhow::Result<fs::File> {
    fs::create_dir_all(base).with_context(|| format!("creating {}", base.display()))?;
    let path = base.join("lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    let deadline = Instant::now() + LOCK_WAIT;
    let mut said = false;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(fs::TryLockError::WouldBlock) => {}
            Err(fs::TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", path.display()));
            }
        }
        if Instant::now() >= deadline {
            bail!(
                "another vmtest run still holds {} after {} min",
                path.display(),
                LOCK_WAIT.as_secs() / 60
            );
        }
        if !said {
            println!("waiting for another vmtest run to finish (it holds {})", path.display());
            said = true;
        }
        std::thread::sleep(Duration::from_secs(5));
    }
}
