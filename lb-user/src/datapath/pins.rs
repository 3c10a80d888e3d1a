//! The pin directory: where each pin lives, the lock that makes one daemon
//! its owner, the bpffs mount it needs, and `detach`, which removes it all.
//!
//! Layout under the configured bpffs directory: `links/<program>` (one
//! cgroup link per program), `links/xdp-<mode>/<interface>` (the external
//! path's: `Mode`, `attachments`) and `maps/<MAP>`.

use std::{
    collections::HashMap,
    fmt,
    fs::File,
    io,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};
use aya::maps::{Map, MapData};
use lb_common::{maps, programs};
use tracing::{debug, info, warn};

use super::sys::{
    BPF_FS_MAGIC, LinkIds, cgroup_program_ids, find_cgroup, fs_type, mount_bpffs, pinned_link_ids,
};

pub(super) fn links_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("links")
}

pub(super) fn maps_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("maps")
}

/// Where an XDP program runs on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    /// In the driver, before any socket buffer is made.
    Native,
    /// In the stack, after the driver made a socket buffer (any driver;
    /// slower).
    Generic,
}

impl Mode {
    pub(super) const ALL: [Self; 2] = [Self::Native, Self::Generic];

    pub(super) fn dir(self, bpffs: &Path) -> PathBuf {
        links_dir(bpffs).join(match self {
            Self::Native => "xdp-native",
            Self::Generic => "xdp-generic",
        })
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Native => "native",
            Self::Generic => "generic",
        })
    }
}

/// The interfaces the pinned XDP links are on, with their mode.
pub fn attachments(bpffs: &Path) -> Vec<(String, Mode)> {
    let mut found = Vec::new();
    for mode in Mode::ALL {
        let Ok(entries) = std::fs::read_dir(mode.dir(bpffs)) else { continue };
        for entry in entries.flatten() {
            if let Some(name) = entry.file_name().to_str() {
                found.push((name.to_owned(), mode));
            }
        }
    }
    found.sort();
    found
}

/// Every pinned XDP link's path.
pub(super) fn link_pins(bpffs: &Path) -> Vec<PathBuf> {
    attachments(bpffs).into_iter().map(|(name, mode)| mode.dir(bpffs).join(name)).collect()
}

/// The directories of the XDP links' pins.
pub(super) fn link_dirs(bpffs: &Path) -> [PathBuf; 2] {
    Mode::ALL.map(|mode| mode.dir(bpffs))
}

pub(super) fn open_pinned_map(bpffs: &Path, name: &str) -> anyhow::Result<Map> {
    let path = maps_dir(bpffs).join(name);
    let data = MapData::from_pin(&path)
        .with_context(|| format!("opening pinned map {}", path.display()))?;
    Map::from_map_data(data)
        .with_context(|| format!("pinned map {} has an unexpected type", path.display()))
}
/// The pins a working datapath must have: the required links and every
/// map; of pins of the upgradable layout (`upgradable`), those it had.
pub(super) fn required_pins(bpffs: &Path, upgradable: bool) -> impl Iterator<Item = PathBuf> + '_ {
    let links = programs::REQUIRED
        .iter()
        .filter(move |p| !(upgradable && programs::NEW_IN_LAYOUT.contains(p)))
        .map(|p| links_dir(bpffs).join(p));
    let maps = maps::ALL
        .iter()
        .filter(move |m| !(upgradable && maps::NEW_IN_LAYOUT.contains(m)))
        .map(|m| maps_dir(bpffs).join(m));
    links.chain(maps)
}

pub(super) fn has_getpeername(bpffs: &Path) -> bool {
    programs::OPTIONAL.iter().all(|p| links_dir(bpffs).join(p).exists())
}

/// The exclusive `flock` on a pin directory: one daemon per set of pins.
pub(super) struct PinLock {
    _dir: File,
}

/// How long `detach` waits for the pins' lock (a daemon told to exit).
const DETACH_LOCK_WAIT: Duration = Duration::from_secs(10);

impl PinLock {
    /// As [`Self::acquire`], retrying for up to `wait`.
    fn wait(bpffs: &Path, wait: Duration) -> anyhow::Result<Self> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            match Self::acquire(bpffs) {
                Ok(lock) => return Ok(lock),
                Err(e) if std::time::Instant::now() >= deadline => {
                    return Err(e.context(format!(
                        "waited {wait:?} for the lock of {}; stop the daemon (systemctl stop lb) and run \
                         lb detach again",
                        bpffs.display()
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

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
    if !bpffs.exists() {
        return Ok(Vec::new());
    }
    // A daemon told to exit lets go of the lock as it exits; one that a
    // supervisor starts meanwhile waits or fails on it, and cannot attach
    // half-way through the removal.
    let _lock = PinLock::wait(bpffs, DETACH_LOCK_WAIT)?;
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
        links.push((name, ids));
        removed.push(path);
    }
    // An XDP link detaches as its last reference goes.
    for path in link_pins(bpffs) {
        std::fs::remove_file(&path).with_context(|| format!("unpinning {}", path.display()))?;
        removed.push(path);
    }
    wait_detached(&links);
    for path in maps::ALL.iter().map(|m| maps_dir(bpffs).join(m)) {
        match std::fs::remove_file(&path) {
            Ok(()) => removed.push(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
        }
    }
    let [native, generic] = link_dirs(bpffs);
    for dir in [native, generic, links_dir(bpffs), maps_dir(bpffs)] {
        match std::fs::remove_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => warn!(dir = %dir.display(), "could not remove: {e}"),
        }
    }
    Ok(removed)
}

/// Waits (up to 2 s) until the programs of the unpinned `links` (program
/// name, ids) are no longer attached to their cgroups, so that a detach is
/// over when it returns. The link's id is no witness: it stops resolving
/// as soon as the last reference goes, and the kernel detaches the program
/// later, from a work queue (a connect right after `lb detach` was still
/// rewritten, on 5.10 and on a loaded 6.18). So the cgroup is asked
/// (`BPF_PROG_QUERY`, CAP_NET_ADMIN). A link that someone else holds open
/// stays attached; it is named.
fn wait_detached(links: &[(&str, LinkIds)]) {
    // (name, link id, program id, cgroup, attach type) of each cgroup link
    // whose cgroup is found.
    let mut waiting = Vec::new();
    let mut cgroups: HashMap<u64, Option<File>> = HashMap::new();
    for (name, ids) in links {
        let Some((cgroup_id, attach_type)) = ids.cgroup else { continue };
        let cgroup = cgroups.entry(cgroup_id).or_insert_with(|| {
            find_cgroup(cgroup_id, CGROUPS_WALKED).and_then(|dir| File::open(dir).ok())
        });
        match cgroup {
            Some(_) => waiting.push((*name, ids.link, ids.program, cgroup_id, attach_type)),
            None => warn!(
                program = name,
                cgroup_id, "cannot find the link's cgroup to confirm its detach"
            ),
        }
    }
    let started = std::time::Instant::now();
    let deadline = started + Duration::from_secs(2);
    loop {
        waiting.retain(|(name, _, program, cgroup_id, attach_type)| {
            let Some(Some(cgroup)) = cgroups.get(cgroup_id) else { return false };
            match cgroup_program_ids(cgroup, *attach_type) {
                Ok(ids) => ids.contains(program),
                Err(e) => {
                    warn!(program = name, "cannot confirm the program's detach (BPF_PROG_QUERY needs CAP_NET_ADMIN): {e}");
                    false
                }
            }
        });
        if waiting.is_empty() {
            return debug!(waited = ?started.elapsed(), "the unpinned links' programs are detached");
        }
        if std::time::Instant::now() >= deadline {
            for (name, link, ..) in waiting {
                warn!(
                    program = name,
                    link,
                    "the link is unpinned but its program is still attached: a process holds the link open (see `bpftool link show id {link}`); it stays attached until that process closes it"
                );
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// How many cgroup directories a detach walks to find its links' cgroup.
const CGROUPS_WALKED: usize = 100_000;

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
