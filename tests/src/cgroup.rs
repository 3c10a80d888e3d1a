//! Cgroups: where cgroup2 is mounted, starting a process inside a cgroup,
//! and [`TestCgroup`], a throwaway child cgroup.

use std::{
    ffi::CString,
    os::unix::{ffi::OsStringExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::Duration,
};

use crate::leak::leaked;

/// Where the cgroup2 file system is mounted (from `/proc/self/mountinfo`).
/// Also used by `cargo xtask demo`.
pub fn cgroup2_root() -> std::io::Result<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    mountinfo
        .lines()
        .find_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let mount_point = before.split_whitespace().nth(4)?;
            (after.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount_point))
        })
        .ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "no cgroup2 file system is mounted")
        })
}

/// Makes `cmd` start inside the cgroup directory `cgroup`: the child moves
/// itself there between fork and exec, so not one instruction of the
/// program runs outside it. Also used by `cargo xtask demo`.
pub fn start_in_cgroup(cmd: &mut Command, cgroup: &Path) {
    // A path from the file system has no NUL byte.
    let procs = CString::new(cgroup.join("cgroup.procs").into_os_string().into_vec())
        .expect("a path without NUL bytes");
    // SAFETY: between fork and exec only async-signal-safe calls (open,
    // write, close) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // "0" moves the writing process itself.
            let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
            libc::close(fd);
            if ok { Ok(()) } else { Err(std::io::Error::last_os_error()) }
        });
    }
}

/// A throwaway child cgroup of the cgroup2 root. On drop, every process in
/// it is killed and the directory removed.
pub struct TestCgroup {
    /// The cgroup's directory.
    pub path: PathBuf,
}

impl TestCgroup {
    /// Creates `lb-test-<pid>-<name>` under the cgroup2 root (first
    /// emptying and removing one left by an earlier run of this pid).
    pub fn new(name: &str) -> Self {
        let root =
            cgroup2_root().unwrap_or_else(|e| panic!("privileged tests need cgroup v2: {e}"));
        let path = root.join(format!("lb-test-{}-{name}", std::process::id()));
        if path.exists() {
            kill_members(&path);
            let _ = std::fs::remove_dir(&path);
        }
        std::fs::create_dir(&path)
            .unwrap_or_else(|e| panic!("creating cgroup {}: {e}", path.display()));
        Self { path }
    }
}

fn kill_members(path: &Path) {
    let _ = std::fs::write(path.join("cgroup.kill"), "1");
    for _ in 0..100 {
        let procs = std::fs::read_to_string(path.join("cgroup.procs")).unwrap_or_default();
        if procs.trim().is_empty() {
            return;
        }
        for pid in procs.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
            // SAFETY: sending a signal has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for TestCgroup {
    /// Kills every member and removes the directory; a cgroup that is still
    /// there after a second is a leak.
    fn drop(&mut self) {
        kill_members(&self.path);
        let mut error = None;
        for _ in 0..50 {
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(e) => error = Some(e),
            }
            thread::sleep(Duration::from_millis(20));
        }
        let members = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
        let members: Vec<&str> = members.split_whitespace().collect();
        leaked(
            "TestCgroup",
            &[format!(
                "cgroup {} could not be removed ({}); processes still in it: {members:?}",
                self.path.display(),
                error.map_or_else(|| "no error".to_owned(), |e| e.to_string())
            )],
        );
    }
}
