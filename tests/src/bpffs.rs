//! The bpffs at `/sys/fs/bpf` that the daemons under test pin to: mounted
//! by the harness if nothing is there, and left as it was found.

use std::{
    ffi::CString,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    sync::Mutex,
};

use crate::leak::leaked;

/// Every file below `dir` (e.g. pins on bpffs), relative to it, sorted.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(next) = todo.pop() {
        for entry in std::fs::read_dir(&next).into_iter().flatten().flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(path);
            } else {
                files.push(path.strip_prefix(dir).unwrap_or(&path).to_path_buf());
            }
        }
    }
    files.sort();
    files
}

/// Where the daemons under test pin, each in its own directory.
pub(crate) const BPFFS_ROOT: &str = "/sys/fs/bpf";

/// This test process's use of the bpffs at `/sys/fs/bpf`, held by each
/// [`Daemon`]. If nothing is mounted there when a daemon is about to start,
/// the harness mounts it itself (not left to the daemon's own fallback:
/// two daemons starting at once could stack two mounts), and unmounts it
/// when the last daemon of this process is gone, so a test run leaves the
/// host's mounts as it found them. A bpffs that was already mounted is
/// never touched.
///
/// It stays mounted, with a printed note, if it then holds anything this
/// process did not create (say, a second test run that started while the
/// mount was there): unmounting would drop that run's pins and detach its
/// programs. Pins this process left there are removed and are a leak.
pub(crate) struct BpffsMount(());

struct BpffsUsers {
    users: usize,
    /// Set while the mount is this process's: what a fresh mount holds by
    /// itself (`maps.debug`, `progs.debug` with `CONFIG_BPF_PRELOAD`).
    mounted_here: Option<Vec<PathBuf>>,
}

static BPFFS_USERS: Mutex<BpffsUsers> = Mutex::new(BpffsUsers { users: 0, mounted_here: None });

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).collect();
    entries.sort();
    entries
}

impl BpffsMount {
    pub(crate) fn acquire() -> Self {
        let mut state = BPFFS_USERS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let root = Path::new(BPFFS_ROOT);
        if state.users == 0 && !is_bpffs(root) {
            let target = CString::new(BPFFS_ROOT).unwrap();
            // SAFETY: valid NUL-terminated strings; no data.
            let rc = unsafe {
                libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null())
            };
            assert_eq!(
                rc,
                0,
                "mounting bpffs at {BPFFS_ROOT}: {}",
                std::io::Error::last_os_error()
            );
            eprintln!(
                "(mounted bpffs at {BPFFS_ROOT}; unmounted again after the last daemon of this test process)"
            );
            state.mounted_here = Some(entries(root));
        }
        state.users += 1;
        Self(())
    }
}

impl Drop for BpffsMount {
    fn drop(&mut self) {
        let mut state = BPFFS_USERS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.users -= 1;
        if state.users > 0 {
            return;
        }
        let Some(fresh) = state.mounted_here.take() else { return };
        let root = Path::new(BPFFS_ROOT);
        let ours = format!("lb-test-{}-", std::process::id());
        let (mine, theirs): (Vec<PathBuf>, Vec<PathBuf>) = entries(root)
            .into_iter()
            .filter(|p| !fresh.contains(p))
            .partition(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&ours)));
        let mut problems = Vec::new();
        for dir in &mine {
            let pins = files_under(dir);
            let removed = std::fs::remove_dir_all(dir)
                .map_or_else(|e| format!("removing it failed: {e}"), |()| "removed it".to_owned());
            problems.push(format!(
                "{} left on bpffs after every daemon was gone: {pins:?}; {removed}",
                dir.display()
            ));
        }
        if theirs.is_empty() {
            let target = CString::new(BPFFS_ROOT).unwrap();
            // SAFETY: a valid NUL-terminated path. No MNT_DETACH: if it is
            // busy, that is reported, not hidden.
            if unsafe { libc::umount2(target.as_ptr(), 0) } != 0 {
                problems.push(format!(
                    "unmounting the bpffs this test process mounted at {BPFFS_ROOT}: {}",
                    std::io::Error::last_os_error()
                ));
            }
        } else {
            eprintln!(
                "note: leaving the bpffs this test process mounted at {BPFFS_ROOT} in place: it now holds {theirs:?}, not created here"
            );
        }
        leaked("bpffs mount", &problems);
    }
}

fn is_bpffs(path: &Path) -> bool {
    let Ok(c_path) = CString::new(path.as_os_str().as_bytes()) else { return false };
    // SAFETY: statfs fills the zeroed struct we pass.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid path and out-pointer.
    (unsafe { libc::statfs(c_path.as_ptr(), &mut stat) }) == 0 && stat.f_type == libc::BPF_FS_MAGIC
}
