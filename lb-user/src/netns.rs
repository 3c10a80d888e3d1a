//! The node's other network namespaces (pods' and containers'), entered to
//! close the connections made there through a VIP with `scope = "all"`.
//!
//! A namespace is found where container runtimes pin it (`/run/netns`,
//! Docker's `/run/docker/netns`) or through a thread in it
//! (`/proc/PID/task/TID/ns/net`, which needs the host's PID namespace). Entering one
//! (setns(2)) needs CAP_SYS_ADMIN; it is done on a thread of its own, which
//! ends with it, so no other work ever runs in a pod's namespace.

use std::{
    collections::HashSet,
    fs::{self, File},
    io,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::PathBuf,
};

/// Where runtimes pin the network namespaces they make.
const PINNED: [&str; 2] = ["/run/netns", "/run/docker/netns"];

/// Every place a network namespace may be opened from, pinned ones first
/// (the same namespace is usually found more than once).
fn candidates() -> impl Iterator<Item = PathBuf> {
    let pinned = PINNED.into_iter().flat_map(|dir| {
        fs::read_dir(dir).into_iter().flatten().flatten().map(|entry| entry.path())
    });
    // Every thread: one may have entered a namespace its process is not in.
    let threads = numbered("/proc".into()).flat_map(|process| numbered(process.join("task")));
    pinned.chain(threads.map(|thread| thread.join("ns/net")))
}

/// The entries of `dir` named by a number (processes, threads).
fn numbered(dir: PathBuf) -> impl Iterator<Item = PathBuf> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.file_name().to_str().is_some_and(|n| n.parse::<u32>().is_ok()))
        .map(|entry| entry.path())
}

/// Whether this process may enter network namespaces: CAP_SYS_ADMIN, and
/// no seccomp filter against setns(2) (systemd's `RestrictNamespaces`).
/// Tried by entering its own, on a thread of its own.
pub fn can_enter() -> bool {
    std::thread::spawn(|| {
        let Ok(own) = File::open("/proc/thread-self/ns/net") else { return false };
        // SAFETY: as in `visit_others`; the namespace is this thread's own.
        unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWNET) == 0 }
    })
    .join()
    .unwrap_or(false)
}

/// Runs `visit` once in every network namespace of the node but the
/// caller's, on a new thread that enters them in turn; stops early when
/// `visit` returns false.
///
/// A namespace that cannot be opened (its process is gone, or is not ours
/// to look at) is skipped. Failing to enter one is an error: EPERM means
/// lb lacks CAP_SYS_ADMIN, and then none can be entered.
pub fn for_each_other(visit: impl FnMut() -> bool + Send) -> io::Result<()> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| visit_others(visit))
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// [`for_each_other`]'s thread: it ends in the last namespace it entered.
fn visit_others(mut visit: impl FnMut() -> bool) -> io::Result<()> {
    let own = fs::metadata("/proc/thread-self/ns/net")?;
    let mut seen = HashSet::from([(own.dev(), own.ino())]);
    for path in candidates() {
        let Ok(file) = File::open(&path) else { continue };
        let Ok(meta) = file.metadata() else { continue };
        if !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        // SAFETY: setns takes a descriptor this function owns and a flag;
        // it changes only this thread's network namespace.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            let e = io::Error::last_os_error();
            // Not a network namespace (a stray file in a pin directory).
            if e.raw_os_error() == Some(libc::EINVAL) {
                continue;
            }
            return Err(io::Error::new(
                e.kind(),
                format!("entering the network namespace {}: {e}", path.display()),
            ));
        }
        if !visit() {
            break;
        }
    }
    Ok(())
}
