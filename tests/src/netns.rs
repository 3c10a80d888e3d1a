//! Network namespaces: [`in_new_netns`] runs a test body in a fresh one,
//! with loopback up, and checks that nothing is left in it.

use std::{fs::File, os::unix::fs::MetadataExt as _, thread, time::Duration};

use crate::{leak::leaked, wait::wait_until};

/// Runs `body` on a thread in a new network namespace with loopback up.
/// Every process the body starts lives in that namespace; the namespace
/// disappears when the body's processes and the thread are gone. A process
/// or thread still in it once the body is done is a leak (see [`NetnsGuard`]).
pub fn in_new_netns<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    let (ns_tx, ns_rx) = std::sync::mpsc::channel();
    let result = thread::spawn(move || {
        // SAFETY: unshare(CLONE_NEWNET) takes no pointers and affects only
        // this thread.
        let unshared = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(unshared, 0, "unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
        let ns = File::open("/proc/thread-self/ns/net").expect("opening /proc/thread-self/ns/net");
        let _ = ns_tx.send(NetnsGuard { ns });
        loopback_up().expect("bringing lo up in the new network namespace");
        body()
    })
    .join();
    // Declared before the body's panic is resumed, so it checks on that
    // path too (and then only prints).
    let _guard = ns_rx.try_recv().ok();
    result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// The network namespace of an [`in_new_netns`] body, after the body is
/// done. On drop it waits up to 5 s for every task to leave it (a
/// backend's connection thread may take a moment), then kills any process
/// still in it (by construction one the test started) and reports the
/// leak. The open namespace file keeps the namespace's inode from being
/// reused by another namespace while it looks.
///
/// Not checked: sockets still open in it, which also keep a namespace
/// alive; they belong to this process and go with its other guards.
pub struct NetnsGuard {
    ns: File,
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        let Ok(meta) = self.ns.metadata() else { return };
        let id = (meta.dev(), meta.ino());
        let mut left = Vec::new();
        if wait_until(Duration::from_secs(5), || {
            left = tasks_in_netns(id);
            left.is_empty()
        }) {
            return;
        }
        let me = std::process::id() as i32;
        let mut described = Vec::new();
        for (pid, tid, name) in &left {
            if *pid == me {
                described.push(format!("thread {tid} ({name}) of this test process"));
            } else {
                // SAFETY: sending a signal has no memory-safety preconditions.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
                described.push(format!("pid {pid} ({name}), killed"));
            }
        }
        described.dedup();
        leaked(
            "in_new_netns",
            &[format!(
                "the test's network namespace net:[{}] still has tasks in it: {}",
                id.1,
                described.join(", ")
            )],
        );
    }
}

/// Every task (pid, tid, name) whose network namespace is the nsfs inode `id`.
fn tasks_in_netns(id: (u64, u64)) -> Vec<(i32, i32, String)> {
    let mut tasks = Vec::new();
    for pid in std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
    {
        for tid in std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        {
            // metadata() follows the `net:[inode]` link to the namespace's nsfs inode.
            if std::fs::metadata(format!("/proc/{pid}/task/{tid}/ns/net"))
                .is_ok_and(|m| (m.dev(), m.ino()) == id)
            {
                let name = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                    .unwrap_or_default();
                tasks.push((pid, tid, name.trim().to_owned()));
            }
        }
    }
    tasks
}

/// Brings up `lo` in this thread's network namespace (a new one starts
/// with it down).
pub fn loopback_up() -> std::io::Result<()> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    // SAFETY: plain socket/ioctl calls on a zeroed, correctly sized ifreq;
    // the new descriptor is owned at once.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCSIFFLAGS, &mut ifr) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A network namespace of the test's own beside the one it runs in: a
/// thread that made it and runs what it is given there ([`Self::run`]).
/// Sockets made in it stay in it wherever they are used. Dropping it ends
/// the thread; the namespace (and the veth ends in it) goes with the last
/// socket or process in it.
pub struct Namespace {
    /// The thread's id, which `ip link ... netns <tid>` takes.
    pub tid: i32,
    /// The namespace itself, for [`Self::spawn`]'s threads to enter.
    file: File,
    jobs: Option<std::sync::mpsc::Sender<Box<dyn FnOnce() + Send>>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Namespace {
    /// A new network namespace with loopback up.
    pub fn new() -> Self {
        let (jobs, inbox) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let thread = thread::spawn(move || {
            // SAFETY: unshare(CLONE_NEWNET) takes no pointers and affects
            // only this thread.
            let unshared = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            assert_eq!(unshared, 0, "unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
            loopback_up().expect("bringing lo up in the new network namespace");
            let file = File::open("/proc/thread-self/ns/net").expect("opening the namespace");
            // SAFETY: gettid has no preconditions.
            let _ = tid_tx.send((unsafe { libc::gettid() }, file));
            for job in inbox {
                job();
            }
        });
        let (tid, file) = tid_rx.recv().expect("the namespace's thread died");
        Self { tid, file, jobs: Some(jobs), thread: Some(thread) }
    }

    /// Runs `job` on a thread of its own in the namespace, alongside
    /// whatever [`Self::run`] runs.
    pub fn spawn<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> thread::JoinHandle<T> {
        use std::os::fd::AsRawFd as _;
        let ns = self.file.try_clone().expect("duplicating the namespace's descriptor");
        thread::spawn(move || {
            // SAFETY: setns on a namespace descriptor we own; it affects
            // only this thread.
            let entered = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(entered, 0, "setns: {}", std::io::Error::last_os_error());
            job()
        })
    }

    /// Runs `job` in the namespace and returns what it returns.
    pub fn run<T: Send + 'static>(&self, job: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        let job = Box::new(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            let _ = tx.send(result);
        });
        self.jobs
            .as_ref()
            .expect("namespace dropped")
            .send(job)
            .expect("the namespace's thread died");
        match rx.recv().expect("the namespace's thread died") {
            Ok(value) => value,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// Runs a command (`ip ...`) in the namespace; panics if it fails.
    pub fn sh(&self, args: &[&str]) {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        self.run(move || sh(&args));
    }
}

impl Default for Namespace {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Runs a command in the calling thread's network namespace; panics with
/// its error output if it fails.
pub fn sh<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[S]) {
    let out = std::process::Command::new(&args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("running {args:?}: {e}"));
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}
