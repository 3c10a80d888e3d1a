//! A supervisor for `lb run` as the shipped systemd unit makes one
//! (`Restart=always`, `RestartPreventExitStatus=3`, no CAP_SYS_ADMIN in
//! the bounding set), for the detach tests.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus},
    sync::{Arc, Mutex, PoisonError},
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use crate::env::lb_bin;

/// `CAP_SYS_ADMIN` (`include/uapi/linux/capability.h`).
const CAP_SYS_ADMIN: libc::c_ulong = 21;

/// Makes `cmd` run without CAP_SYS_ADMIN, as `capsh --drop=cap_sys_admin`
/// does: dropped from the bounding set between fork and exec, so a root
/// process cannot regain it at exec.
pub fn without_cap_sys_admin(cmd: &mut Command) {
    // SAFETY: between fork and exec only prctl, which is async-signal-safe
    // and touches no memory of ours.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, || {
            if libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// What the restart loop saw.
#[derive(Debug, Default)]
struct Runs {
    /// The running child, if any.
    child: Option<Child>,
    /// How each run ended, in order.
    exits: Vec<ExitStatus>,
    /// Start no more runs (the loop is being dropped).
    stop: bool,
}

/// `lb run --config CONFIG` without CAP_SYS_ADMIN, started again 200 ms
/// after it exits (systemd's `RestartSec`, shortened), unless it exited
/// with 3 (`lb_user::detach::EXIT_DETACHED`), or for at most `limit`.
pub struct RestartLoop {
    runs: Arc<Mutex<Runs>>,
    thread: Option<JoinHandle<()>>,
}

impl RestartLoop {
    /// Starts the loop; the runs append to `log`.
    pub fn start(config: &Path, log: PathBuf, limit: Duration) -> Self {
        let runs = Arc::new(Mutex::new(Runs::default()));
        let config = config.to_owned();
        let shared = Arc::clone(&runs);
        let thread = thread::spawn(move || {
            let deadline = Instant::now() + limit;
            while Instant::now() < deadline && !lock(&shared).stop {
                let out = std::fs::OpenOptions::new().create(true).append(true).open(&log);
                let Ok(out) = out else { return };
                let mut cmd = Command::new(lb_bin());
                cmd.args(["run", "--config"]).arg(&config);
                cmd.env("RUST_LOG", "info,lb_user=debug").env("NO_COLOR", "1");
                cmd.stdout(out.try_clone().expect("a log file")).stderr(out);
                without_cap_sys_admin(&mut cmd);
                let Ok(child) = cmd.spawn() else { return };
                lock(&shared).child = Some(child);
                // Polled, so that `kill` can reach the child meanwhile.
                let status = loop {
                    let polled = lock(&shared).child.as_mut().map(Child::try_wait);
                    match polled {
                        Some(Ok(Some(status))) => break Some(status),
                        Some(Ok(None)) if Instant::now() < deadline => {
                            thread::sleep(Duration::from_millis(20));
                        }
                        _ => break None,
                    }
                };
                let mut runs = lock(&shared);
                runs.child = None;
                let Some(status) = status else { return };
                runs.exits.push(status);
                if status.code() == Some(3) {
                    return;
                }
                drop(runs);
                thread::sleep(Duration::from_millis(200));
            }
        });
        Self { runs, thread: Some(thread) }
    }

    /// SIGKILLs the running `lb run` (a crash); the loop starts another.
    pub fn kill(&self) {
        if let Some(child) = lock(&self.runs).child.as_mut() {
            let _ = child.kill();
        }
    }

    /// How the runs so far ended.
    pub fn exits(&self) -> Vec<Option<i32>> {
        lock(&self.runs).exits.iter().map(ExitStatus::code).collect()
    }

    /// Waits up to `timeout` for the loop to end by itself (an exit with
    /// 3); whether it did.
    pub fn wait_end(&mut self, timeout: Duration) -> bool {
        crate::wait_until(timeout, || self.thread.as_ref().is_none_or(JoinHandle::is_finished))
    }
}

impl Drop for RestartLoop {
    /// Kills the running `lb run`, if any, and ends the loop.
    fn drop(&mut self) {
        lock(&self.runs).stop = true;
        let mut ended = false;
        for _ in 0..50 {
            self.kill();
            if self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
                ended = true;
                break;
            }
            thread::sleep(Duration::from_millis(100));
        }
        if ended && let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock(runs: &Mutex<Runs>) -> std::sync::MutexGuard<'_, Runs> {
    runs.lock().unwrap_or_else(PoisonError::into_inner)
}
