//! The pin directory: where each pin lives, the lock that makes one daemon
//! its owner, the bpffs mount it needs, and `detach`, which removes it all.
//!
//! Layout under the configured bpffs directory: `links/<program>` (one
//! cgroup link per program) and `maps/<MAP>`.

use std::{
    fs::File,
    io,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};
use lb_common::{maps, programs};
use tracing::{info, warn};

use super::sys::{BPF_FS_MAGIC, fs_type, link_exists, mount_bpffs, pinned_link_ids};

pub(super) fn links_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("links")
}

pub(super) fn maps_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("maps")
}

/// The pins a working datapath must have: the required links and every map.
pub(super) fn required_pins(bpffs: &Path) -> impl Iterator<Item = PathBuf> + '_ {
    let links = programs::REQUIRED.iter().map(|p| links_dir(bpffs).join(p));
    let maps = maps::ALL.iter().map(|m| maps_dir(bpffs).join(m));
    links.chain(maps)
}

pub(super) fn has_getpeername(bpffs: &Path) -> bool {
    programs::OPTIONAL.iter().all(|p| links_dir(bpffs).join(p).exists())
}

/// The exclusive `flock` on a pin directory: one daemon per set of pins.
pub(super) struct PinLock {
    _dir: File,
}

impl PinLock {
    /// Locks `bpffs` (a directory that exists) without waiting; if another
    /// process holds it, fails naming that process.
    pub(super) fn acquire(bpffs: &Path) -> anyhow::Result<Self> {
        let dir =
            File::open(bpffs).with_context(|| format!("opening {} to lock it", bpffs.display()))?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Self { _dir: dir });
        }
        let error = io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(error).with_context(|| format!("locking {}", bpffs.display()));
        }
        let holder = dir
            .metadata()
            .ok()
            .and_then(|meta| {
                lock_holder(&std::fs::read_to_string("/proc/locks").ok()?, meta.dev(), meta.ino())
            })
            .map_or_else(|| "another process (see /proc/locks)".to_owned(), describe_process);
        bail!(
            "another lb daemon already runs on the pins under {}: {holder} holds its lock. Two daemons on one set \
             of pins would overwrite each other's selections. Stop that daemon first, or give this one its own \
             `[daemon] bpffs` directory (and `cgroup`)",
            bpffs.display()
        )
    }
}

/// The pid holding a `flock` on the file (`dev`, `ino`), from the text of
/// `/proc/locks` (`1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF`; the
/// device as hex major:minor).
fn lock_holder(locks: &str, dev: u64, ino: u64) -> Option<i32> {
    let want = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // Waiters are listed as `1: -> FLOCK ...`; skip them.
        if fields.get(1) != Some(&"FLOCK") || fields.get(5) != Some(&want.as_str()) {
            return None;
        }
        fields.get(4)?.parse().ok()
    })
}

/// "pid N (`its command line`)".
fn describe_process(pid: i32) -> String {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|w| !w.is_empty())
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    if words.is_empty() {
        format!("pid {pid}")
    } else {
        format!("pid {pid} (`{}`)", words.join(" "))
    }
}

/// Removes every pinned link and map under `bpffs`, and the directories:
/// the programs detach and the maps are freed once no process holds them.
/// Returns what was removed.
pub fn detach(bpffs: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let removed = remove_pins(bpffs)?;
    match std::fs::remove_dir(bpffs) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => warn!(dir = %bpffs.display(), "could not remove: {e}"),
    }
    Ok(removed)
}

/// As [`detach`], but keeps `bpffs` itself (a daemon holds it locked).
pub(super) fn remove_pins(bpffs: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let mut links = Vec::new();
    for name in programs::ALL {
        let path = links_dir(bpffs).join(name);
        if !path.exists() {
            continue;
        }
        let ids = pinned_link_ids(&path)?;
        // Removing the pin drops its reference; the link detaches when the
        // last one goes.
        std::fs::remove_file(&path).with_context(|| format!("unpinning {}", path.display()))?;
        links.push((name, ids.link));
        removed.push(path);
    }
    wait_links_gone(&links);
    for path in maps::ALL.iter().map(|m| maps_dir(bpffs).join(m)) {
        match std::fs::remove_file(&path) {
            Ok(()) => removed.push(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
        }
    }
    for dir in [links_dir(bpffs), maps_dir(bpffs)] {
        match std::fs::remove_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => warn!(dir = %dir.display(), "could not remove: {e}"),
        }
    }
    Ok(removed)
}

/// Waits (up to 2 s) until no link of `links` (program name, link id)
/// exists any more, so that a detach is over when it returns: the kernel
/// may drop a link's last reference after the close that released ours
/// (seen on Linux 5.10, where a connect right after `lb detach` was still
/// rewritten). A link someone else holds open stays; it is named.
fn wait_links_gone(links: &[(&str, u32)]) {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        let left: Vec<_> = links.iter().filter(|(_, id)| link_exists(*id)).collect();
        if left.is_empty() {
            return;
        }
        if std::time::Instant::now() >= deadline {
            for (name, id) in left {
                warn!(
                    program = name,
                    link = id,
                    "the link is unpinned but still held open by a process (see `bpftool link show id {id}`); its program stays attached until that process closes it"
                );
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Makes sure `bpffs` is on a BPF filesystem, mounting one at
/// `/sys/fs/bpf` when that is where it should be and nothing is mounted.
pub(super) fn ensure_bpffs(bpffs: &Path) -> anyhow::Result<()> {
    let mut existing = bpffs;
    while !existing.exists() {
        existing = existing.parent().context("bpffs path has no existing ancestor")?;
    }
    if fs_type(existing)? == BPF_FS_MAGIC {
        std::fs::create_dir_all(bpffs)?;
        return Ok(());
    }
    let default_mount = Path::new("/sys/fs/bpf");
    if !bpffs.starts_with(default_mount) {
        bail!(
            "{} is not on a BPF filesystem; mount one first (`mount -t bpf bpf DIR`) or use a path under /sys/fs/bpf",
            bpffs.display()
        );
    }
    std::fs::create_dir_all(default_mount)?;
    mount_bpffs(default_mount).context("mounting bpffs at /sys/fs/bpf")?;
    info!("mounted bpffs at /sys/fs/bpf");
    std::fs::create_dir_all(bpffs)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_who_holds_a_lock_in_proc_locks() {
        let dev = libc::makedev(0, 0x2d);
        let locks = "1: POSIX  ADVISORY  WRITE 77 00:2d:1234 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 4242 00:2d:1234 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 99 00:2d:1234 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 5 00:2e:1234 0 EOF\n";
        assert_eq!(lock_holder(locks, dev, 1234), Some(4242));
        assert_eq!(lock_holder(locks, dev, 999), None);
    }

    #[test]
    fn a_second_lock_on_a_directory_fails_naming_the_holder() {
        let dir = std::env::temp_dir().join(format!("lb-pinlock-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = PinLock::acquire(&dir).unwrap();
        // flock locks belong to the open file: a second open conflicts even
        // in the same process, as a second daemon's would.
        let error =
            format!("{:#}", PinLock::acquire(&dir).err().expect("the second lock must fail"));
        assert!(error.contains(&format!("pid {}", std::process::id())), "{error}");
        drop(first);
        assert!(PinLock::acquire(&dir).is_ok(), "the lock goes with its holder");
        std::fs::remove_dir(&dir).unwrap();
    }
}
