//! The raw system calls and `/proc` reads that aya 0.14 does not offer:
//! `bpf(2)` for pinned links (an fd to pass to `BPF_LINK_UPDATE`, which aya
//! lacks; a cgroup link's cgroup and attach type, which aya's
//! `FdLink::info()` leaves out: it gives the link and program ids only;
//! the programs a cgroup runs, `BPF_PROG_QUERY`, crate-private in aya),
//! the network namespace's cookie, the bpffs mount, the cgroup2 mount
//! point, the monotonic clock the kernel programs stamp with.

use std::{
    ffi::CString,
    fs::File,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::{ffi::OsStrExt as _, fs::MetadataExt as _},
    },
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use lb_common::NETNS_INITIAL;
use tracing::warn;

/// `statfs`'s `f_type` of a BPF filesystem.
pub(super) const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The ids of a pinned link and of the program it runs.
pub(super) struct LinkIds {
    pub(super) link: u32,
    pub(super) program: u32,
    /// For a cgroup link: the cgroup's id (its inode number in cgroup2)
    /// and the attach type.
    pub(super) cgroup: Option<(u64, u32)>,
}

pub(super) fn pinned_link_ids(link: &Path) -> anyhow::Result<LinkIds> {
    let fd =
        bpf_obj_get(link).with_context(|| format!("opening pinned link {}", link.display()))?;
    // struct bpf_link_info: __u32 type, id, prog_id, then a union whose
    // cgroup member (at byte 16) is __u64 cgroup_id, __u32 attach_type.
    let mut info = [0u32; 16];
    let mut attr = BpfAttr::default();
    attr.set_u32(0, fd.as_raw_fd() as u32);
    attr.set_u32(4, size_of_val(&info) as u32);
    attr.set_u64(8, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)
        .with_context(|| format!("reading the info of link {}", link.display()))?;
    let cgroup_id = |lo: u32, hi: u32| {
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&lo.to_ne_bytes());
        bytes[4..].copy_from_slice(&hi.to_ne_bytes());
        u64::from_ne_bytes(bytes)
    };
    let cgroup = (info[0] == BPF_LINK_TYPE_CGROUP).then(|| (cgroup_id(info[4], info[5]), info[6]));
    Ok(LinkIds { link: info[1], program: info[2], cgroup })
}

/// The ids of the programs attached directly to `cgroup` for
/// `attach_type` (`BPF_PROG_QUERY`; CAP_NET_ADMIN).
pub(super) fn cgroup_program_ids(cgroup: &File, attach_type: u32) -> io::Result<Vec<u32>> {
    let mut ids = [0u32; 64];
    let mut attr = BpfAttr::default();
    // query: target_fd, attach_type, query_flags, attach_flags,
    // prog_ids (__aligned_u64), prog_cnt.
    attr.set_u32(0, cgroup.as_raw_fd() as u32);
    attr.set_u32(4, attach_type);
    attr.set_u64(16, ids.as_mut_ptr() as u64);
    attr.set_u32(24, ids.len() as u32);
    match bpf(BPF_PROG_QUERY, &mut attr) {
        // ENOSPC: more than fit; the first ones are there.
        Err(e) if e.raw_os_error() != Some(libc::ENOSPC) => return Err(e),
        _ => {}
    }
    let count = u32::from_ne_bytes(attr.0[24..28].try_into().unwrap_or_default()) as usize;
    Ok(ids[..count.min(ids.len())].to_vec())
}

/// The directory of the cgroup whose id is `id`, found by walking the
/// cgroup2 hierarchy (at most `limit` directories).
pub(super) fn find_cgroup(id: u64, limit: usize) -> Option<PathBuf> {
    let mut queue = std::collections::VecDeque::from([cgroup2_root().ok()?]);
    let mut seen = 0;
    while let Some(dir) = queue.pop_front() {
        if std::fs::metadata(&dir).is_ok_and(|m| m.ino() == id) {
            return Some(dir);
        }
        seen += 1;
        if seen >= limit {
            return None;
        }
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        queue.extend(
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path()),
        );
    }
    None
}

// The bpf(2) commands used here (see the module's doc for why not aya's).
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_PROG_QUERY: libc::c_long = 16;
/// `bpf_link_info::type` of a cgroup link (`BPF_LINK_TYPE_CGROUP`).
const BPF_LINK_TYPE_CGROUP: u32 = 3;

/// A `union bpf_attr`, zeroed, written by byte offset (the layouts are the
/// kernel's UAPI, `include/uapi/linux/bpf.h`). The kernel reads as much of
/// it as it knows and requires the rest to be zero.
#[repr(C, align(8))]
struct BpfAttr([u8; 128]);

impl Default for BpfAttr {
    fn default() -> Self {
        Self([0; 128])
    }
}

impl BpfAttr {
    fn set_u32(&mut self, offset: usize, value: u32) {
        self.0[offset..offset + 4].copy_from_slice(&value.to_ne_bytes());
    }
    fn set_u64(&mut self, offset: usize, value: u64) {
        self.0[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
    }
}

fn bpf(cmd: libc::c_long, attr: &mut BpfAttr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a zero-initialized union bpf_attr of the size we pass,
    // whose pointer fields point at memory that outlives the call.
    let rc =
        unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_mut_ptr(), size_of::<BpfAttr>()) };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) }
}

/// `BPF_OBJ_GET`: a new file descriptor for the object pinned at `path`.
pub(super) fn bpf_obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = BpfAttr::default();
    // pathname (__aligned_u64), bpf_fd, file_flags.
    attr.set_u64(0, path.as_ptr() as u64);
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `BPF_LINK_UPDATE`: `link` runs `program` from now on (atomically).
pub(super) fn bpf_link_update(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = BpfAttr::default();
    // link_update: link_fd, new_prog_fd, flags (0: whatever runs now), old_prog_fd.
    attr.set_u32(0, link.as_raw_fd() as u32);
    attr.set_u32(4, program.as_raw_fd() as u32);
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

/// What `Scope::Host` writes into a service value: this process's network
/// namespace cookie (`SO_NETNS_COOKIE`, Linux 5.14+); on an older kernel,
/// [`NETNS_INITIAL`] if this process is in the initial network namespace
/// (the kernel program then asks for that cookie itself); otherwise `None`.
pub(super) fn host_netns_cookie() -> Option<u64> {
    match own_netns_cookie() {
        Ok(cookie) => Some(cookie),
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => {
            in_initial_netns().then_some(NETNS_INITIAL)
        }
        Err(e) => {
            warn!("reading this network namespace's cookie (SO_NETNS_COOKIE): {e}");
            in_initial_netns().then_some(NETNS_INITIAL)
        }
    }
}

fn own_netns_cookie() -> io::Result<u64> {
    // Any socket answers for its network namespace; a Unix one touches no
    // network stack (and no cgroup socket hook).
    // SAFETY: plain socket call.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: we own the new descriptor.
    let socket = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut cookie: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: a valid socket and an out-buffer of the size we pass.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// Whether this process is in the initial network namespace: the same as
/// pid 1's, where pid 1 is the real init (this process is in the initial
/// pid namespace, whose inode number is fixed: `PROC_PID_INIT_INO`).
fn in_initial_netns() -> bool {
    const PROC_PID_INIT_INO: u64 = 0xEFFF_FFFC;
    let ns = |path: &str| std::fs::metadata(path).map(|m| (m.dev(), m.ino())).ok();
    let initial_pid_ns = ns("/proc/self/ns/pid").is_some_and(|(_, ino)| ino == PROC_PID_INIT_INO);
    initial_pid_ns
        && ns("/proc/self/ns/net").is_some()
        && ns("/proc/self/ns/net") == ns("/proc/1/ns/net")
}

/// Mounts a BPF filesystem at `target`.
pub(super) fn mount_bpffs(target: &Path) -> anyhow::Result<()> {
    let target = CString::new(target.as_os_str().as_bytes())?;
    // SAFETY: all pointers are valid NUL-terminated strings; data is null.
    let rc = unsafe {
        libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null())
    };
    if rc != 0 {
        return Err(io::Error::last_os_error().into());
    }
    Ok(())
}

pub(super) fn fs_type(path: &Path) -> anyhow::Result<i64> {
    let c_path = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: statfs fills the zeroed struct we pass.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error())
            .with_context(|| format!("statfs {}", path.display()));
    }
    Ok(stat.f_type as i64)
}

/// The root of the cgroup v2 hierarchy, from `/proc/self/mountinfo`.
pub fn cgroup2_root() -> anyhow::Result<PathBuf> {
    let mountinfo =
        std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    cgroup2_root_in(&mountinfo).context("no cgroup2 filesystem is mounted; mount one (`mount -t cgroup2 none /sys/fs/cgroup`) or set daemon.cgroup")
}

fn cgroup2_root_in(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // `<id> <parent> <dev> <root> <mount point> <options...> - <fstype> ...`
        let (before, after) = line.split_once(" - ")?;
        let mount_point = before.split_whitespace().nth(4)?;
        (after.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount_point))
    })
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_ns()`.
pub fn monotonic_now_ns() -> u64 {
    // SAFETY: clock_gettime fills the struct we pass.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid clock id and out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_in_a_hybrid_layout() {
        let mountinfo = "25 30 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro\n\
                         41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_root_in(mountinfo), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(cgroup2_root_in("25 30 0:22 / /sys/fs/cgroup ro - tmpfs tmpfs ro\n"), None);
    }
}
