//! The kernel side as the daemon sees it: load and attach the programs, pin
//! and adopt them, write selections, read counts and counters, detach.
//!
//! Pinned layout under the configured bpffs directory:
//! `links/<program>` (one cgroup link per program) and `maps/<MAP>`. While
//! those pins exist the datapath keeps working with nobody running
//! (fail-static); a starting daemon that finds them all adopts them instead
//! of attaching again, so there is no window without the programs.

use std::{
    ffi::CString,
    fs::File,
    io,
    net::SocketAddr,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, Map, MapData, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{
        CgroupAttachMode, CgroupSockAddr, SockOps,
        links::{FdLink, PinnedLink},
    },
};
use lb_common::{
    ConnKey, Endpoint, MAX_SERVERS, Reason, Service as ServiceValue, SockEntry,
    maps, programs,
};
use tracing::{info, warn};

use crate::{balancer::Selection, config::Scope};

/// Forwards the kernel programs' aya-log records to `log` (and so to tracing).
pub type KernelLogger = aya_log::EbpfLogger<&'static dyn log::Log>;

/// The eBPF object, built by `build.rs` from `lb-ebpf`.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb"));

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The attached datapath: handles to its maps.
pub struct Datapath {
    services: HashMap<MapData, Endpoint, ServiceValue>,
    failed_at: HashMap<MapData, Endpoint, u64>,
    sockets: HashMap<MapData, u64, SockEntry>,
    connections: PerCpuHashMap<MapData, ConnKey, i64>,
    counters: PerCpuArray<MapData, u64>,
    events: Option<RingBuf<MapData>>,
    /// Whether the programs were already attached when we started.
    pub adopted: bool,
    /// The getpeername hooks are attached (optional, Linux 5.8+).
    pub getpeername: bool,
    /// Reader of the kernel programs' logs when `--bpf-log` is on.
    logger: Option<KernelLogger>,
}

/// What one VIP gets in the kernel: its selection and its hold-down.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VipEntry {
    pub vip: SocketAddr,
    pub selection: Selection,
    pub hold_down: Duration,
    /// Whose connects are rewritten: this network namespace's, or all.
    pub scope: Scope,
}

/// A live socket that connected through a VIP (from the kernel's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VipSocket {
    pub cookie: u64,
    pub vip: SocketAddr,
    pub server: SocketAddr,
}

impl VipEntry {
    fn to_value(&self) -> ServiceValue {
        let mut value = ServiceValue::default();
        let servers = &self.selection.servers;
        for (slot, server) in value.servers.iter_mut().zip(servers.iter().take(MAX_SERVERS)) {
            *slot = Endpoint::from(*server);
        }
        value.count = servers.len().min(MAX_SERVERS) as u32;
        value.spread = self.selection.spread.clamp(1, MAX_SERVERS) as u32;
        value.hold_down_ns = u64::try_from(self.hold_down.as_nanos()).unwrap_or(u64::MAX);
        value
    }
}

fn links_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("links")
}

fn maps_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("maps")
}

/// The pins a working datapath must have: the required links and every map.
fn required_pins(bpffs: &Path) -> impl Iterator<Item = PathBuf> + '_ {
    let links = programs::REQUIRED.iter().map(|p| links_dir(bpffs).join(p));
    let maps = maps::ALL.iter().map(|m| maps_dir(bpffs).join(m));
    links.chain(maps)
}

fn has_getpeername(bpffs: &Path) -> bool {
    programs::OPTIONAL.iter().all(|p| links_dir(bpffs).join(p).exists())
}

impl Datapath {
    /// Adopts the pinned datapath under `bpffs` if it is complete (its maps
    /// untouched: `initial` is not written); otherwise loads the programs,
    /// writes `initial` selections, attaches to `cgroup` and pins everything.
    pub fn open(
        bpffs: &Path,
        cgroup: &Path,
        initial: &[VipEntry],
        bpf_log: bool,
    ) -> anyhow::Result<Self> {
        ensure_bpffs(bpffs)?;
        let present = required_pins(bpffs).filter(|p| p.exists()).count();
        if present == programs::REQUIRED.len() + maps::ALL.len() {
            let datapath = Self::adopt(bpffs)?;
            if bpf_log {
                warn!("--bpf-log has no effect on an adopted datapath; run `lb detach` and start again to enable it");
            }
            // The daemon writes an adopted datapath's selections itself,
            // starting from what the kernel holds (see `daemon::adopt`).
            return Ok(datapath);
        }
        if present > 0 || has_getpeername(bpffs) {
            warn!(bpffs = %bpffs.display(), present, "found an incomplete pinned datapath (interrupted attach?); removing it and attaching afresh");
            detach(bpffs)?;
        }
        Self::attach(bpffs, cgroup, initial, bpf_log).inspect_err(|_| {
            // Leave nothing half-attached behind.
            if let Err(e) = detach(bpffs) {
                warn!("cleaning up after a failed attach: {e:#}");
            }
        })
    }

    fn adopt(bpffs: &Path) -> anyhow::Result<Self> {
        let map = |name: &str| -> anyhow::Result<Map> {
            let path = maps_dir(bpffs).join(name);
            let data = MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))?;
            Map::from_map_data(data).with_context(|| format!("pinned map {} has an unexpected type", path.display()))
        };
        info!(bpffs = %bpffs.display(), "adopting the pinned datapath; programs stay attached");
        let mut datapath = Self::from_maps(map, true, None)?;
        datapath.getpeername = has_getpeername(bpffs);
        Ok(datapath)
    }

    fn attach(
        bpffs: &Path,
        cgroup: &Path,
        initial: &[VipEntry],
        bpf_log: bool,
    ) -> anyhow::Result<Self> {
        // aya-log's level: 0 turns every kernel log statement into a no-op.
        let log_level: u8 = if bpf_log { 0xff } else { 0 };
        if EBPF_OBJECT.is_empty() {
            bail!("this lb was built with AYA_BUILD_SKIP=1 and carries no eBPF programs; rebuild without it");
        }
        let mut ebpf = EbpfLoader::new()
            .override_global("AYA_LOG_LEVEL", &log_level, false)
            .load(EBPF_OBJECT)
            .context("loading the eBPF object (is this kernel 5.10 or newer, with BTF?)")?;
        let logger = if bpf_log {
            Some(aya_log::EbpfLogger::init(&mut ebpf).context("setting up --bpf-log")?)
        } else {
            None
        };

        let maps_dir = maps_dir(bpffs);
        std::fs::create_dir_all(&maps_dir).with_context(|| format!("creating {}", maps_dir.display()))?;
        let mut pinned = Vec::new();
        for name in maps::ALL {
            let map = ebpf.map(name).with_context(|| format!("map {name} missing from the eBPF object"))?;
            let path = maps_dir.join(name);
            map.pin(&path).with_context(|| format!("pinning map {name} at {}", path.display()))?;
            pinned.push(name);
        }
        let mut datapath =
            Self::from_maps(|name| ebpf.take_map(name).with_context(|| format!("map {name} missing")), false, logger)?;
        // Selections go in before the programs attach: the first connect
        // already finds its service.
        datapath.reconcile(initial)?;
        datapath.getpeername = load_and_attach(&mut ebpf, bpffs, cgroup)?;
        info!(cgroup = %cgroup.display(), bpffs = %bpffs.display(), "datapath attached and pinned");
        Ok(datapath)
    }

    fn from_maps(
        mut map: impl FnMut(&str) -> anyhow::Result<Map>,
        adopted: bool,
        logger: Option<KernelLogger>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            services: HashMap::try_from(map(maps::SERVICES)?)?,
            failed_at: HashMap::try_from(map(maps::FAILED_AT)?)?,
            sockets: HashMap::try_from(map(maps::SOCKETS)?)?,
            connections: PerCpuHashMap::try_from(map(maps::CONNECTIONS)?)?,
            counters: PerCpuArray::try_from(map(maps::COUNTERS)?)?,
            events: Some(RingBuf::try_from(map(maps::EVENTS)?)?),
            adopted,
            getpeername: false,
            logger,
        })
    }

    /// Makes the `SERVICES` map equal `desired`, writing only what changed.
    /// Returns how many entries were written or removed.
    pub fn reconcile(&mut self, desired: &[VipEntry]) -> anyhow::Result<usize> {
        let wanted: std::collections::HashMap<Endpoint, ServiceValue> =
            desired.iter().map(|entry| (Endpoint::from(entry.vip), entry.to_value())).collect();
        let existing: Vec<Endpoint> = self.services.keys().collect::<Result<_, _>>().context("listing SERVICES")?;
        let mut changes = 0;
        for vip in existing {
            if !wanted.contains_key(&vip) {
                self.services.remove(&vip).with_context(|| format!("removing VIP {}", SocketAddr::from(vip)))?;
                changes += 1;
            }
        }
        for (vip, value) in wanted {
            if self.services.get(&vip, 0).ok() != Some(value) {
                // One update replaces the whole value: the kernel never sees
                // a half-written selection.
                self.services.insert(vip, value, 0).with_context(|| format!("writing VIP {}", SocketAddr::from(vip)))?;
                changes += 1;
            }
        }
        Ok(changes)
    }

    /// Writes one VIP's entry (one whole-value update) unless it is unchanged.
    pub fn write(&mut self, entry: &VipEntry) -> anyhow::Result<()> {
        let (vip, value) = (Endpoint::from(entry.vip), entry.to_value());
        if self.services.get(&vip, 0).ok() != Some(value) {
            self.services.insert(vip, value, 0).with_context(|| format!("writing VIP {}", entry.vip))?;
        }
        Ok(())
    }

    /// The selection currently in the kernel for `vip`.
    pub fn selection(&self, vip: SocketAddr) -> Vec<SocketAddr> {
        match self.services.get(&Endpoint::from(vip), 0) {
            Ok(value) => value.servers.iter().take(value.count as usize).map(|e| SocketAddr::from(*e)).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Live connections through `vip` to `server`.
    /// The spread width the kernel holds for `vip` (1 when unknown).
    pub fn spread(&self, vip: SocketAddr) -> usize {
        self.services.get(&Endpoint::from(vip), 0).map_or(1, |value| value.spread.max(1) as usize)
    }

    pub fn connections(&self, vip: SocketAddr, server: SocketAddr) -> i64 {
        let key = ConnKey { vip: vip.into(), server: server.into() };
        self.connections.get(&key, 0).map(|per_cpu| per_cpu.iter().sum()).unwrap_or(0)
    }

    /// Whether a connect to `server` failed less than `hold_down` ago.
    pub fn recently_failed(&self, server: SocketAddr, hold_down: Duration) -> bool {
        match self.failed_at.get(&Endpoint::from(server), 0) {
            Ok(at) => monotonic_now_ns().saturating_sub(at) < hold_down.as_nanos() as u64,
            Err(_) => false,
        }
    }

    /// The kernel's decision counters, summed over CPUs, by reason name.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        Reason::ALL
            .into_iter()
            .map(|reason| {
                let total = self.counters.get(&reason.index(), 0).map(|v| v.iter().sum()).unwrap_or(0);
                (reason.name(), total)
            })
            .collect()
    }

    /// The live sockets that connected through a VIP.
    pub fn vip_sockets(&self) -> impl Iterator<Item = VipSocket> + '_ {
        self.sockets.iter().filter_map(Result::ok).map(|(cookie, e)| VipSocket {
            cookie,
            vip: SocketAddr::from(e.vip),
            server: SocketAddr::from(e.server),
        })
    }

    /// The kernel log reader (only with `--bpf-log`); can be taken once.
    pub fn take_logger(&mut self) -> Option<KernelLogger> {
        self.logger.take()
    }

    /// The ring buffer of connection events; can be taken once.
    pub fn take_events(&mut self) -> Option<RingBuf<MapData>> {
        self.events.take()
    }
}

/// Loads and attaches every program and pins its link. Returns whether the
/// optional getpeername hooks are attached; a missing required program is
/// an error.
fn load_and_attach(ebpf: &mut Ebpf, bpffs: &Path, cgroup: &Path) -> anyhow::Result<bool> {
    let cgroup_dir = File::open(cgroup).with_context(|| format!("opening cgroup {}", cgroup.display()))?;
    let links = links_dir(bpffs);
    std::fs::create_dir_all(&links).with_context(|| format!("creating {}", links.display()))?;
    let mut getpeername = true;
    for name in programs::ALL {
        match attach_one(ebpf, name, &cgroup_dir, cgroup, &links) {
            Ok(()) => {}
            Err(e) if programs::OPTIONAL.contains(&name) => {
                if getpeername {
                    warn!(
                        "this kernel cannot attach the getpeername hooks (Linux 5.8+): applications will see the \
                         server's address instead of the VIP ({e:#})"
                    );
                }
                getpeername = false;
            }
            Err(e) => return Err(e.context("this kernel lacks a feature lb needs (cgroup connect hooks and sock_ops, Linux 5.10+)")),
        }
    }
    if !getpeername {
        // All or nothing: a lone getpeername4 would make IPv4 and IPv6 differ.
        for name in programs::OPTIONAL {
            let _ = PinnedLink::from_pin(links.join(name)).map(|l| l.unpin());
        }
    }
    Ok(getpeername)
}

fn attach_one(ebpf: &mut Ebpf, name: &str, cgroup_dir: &File, cgroup: &Path, links: &Path) -> anyhow::Result<()> {
    let program = ebpf.program_mut(name).with_context(|| format!("program {name} missing from the eBPF object"))?;
    // A bpf_link attachment always coexists with other programs on the
    // cgroup (systemd, a CNI); the kernel refuses attach flags on links.
    let mode = CgroupAttachMode::Single;
    let link: FdLink = if name == programs::SOCK_OPS {
        let program: &mut SockOps = program.try_into()?;
        program.load().with_context(|| format!("loading {name}"))?;
        let id = program.attach(cgroup_dir, mode).with_context(|| format!("attaching {name} to {}", cgroup.display()))?;
        program.take_link(id)?.try_into()?
    } else {
        let program: &mut CgroupSockAddr = program.try_into()?;
        program.load().with_context(|| format!("loading {name}"))?;
        let id = program.attach(cgroup_dir, mode).with_context(|| format!("attaching {name} to {}", cgroup.display()))?;
        program.take_link(id)?.try_into()?
    };
    let path = links.join(name);
    // Dropping the pinned handle closes our fd; the pin keeps the link.
    link.pin(&path).with_context(|| format!("pinning link {}", path.display()))?;
    Ok(())
}

/// Removes every pinned link and map under `bpffs`: the programs detach and
/// the maps are freed once no process holds them. Returns what was removed.
pub fn detach(bpffs: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for name in programs::ALL {
        let path = links_dir(bpffs).join(name);
        if !path.exists() {
            continue;
        }
        let link = PinnedLink::from_pin(&path).with_context(|| format!("opening pinned link {}", path.display()))?;
        // Unpinning drops the last reference (we hold no other): detached.
        drop(link.unpin().with_context(|| format!("unpinning {}", path.display()))?);
        removed.push(path);
    }
    for path in maps::ALL.iter().map(|m| maps_dir(bpffs).join(m)) {
        match std::fs::remove_file(&path) {
            Ok(()) => removed.push(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
        }
    }
    for dir in [links_dir(bpffs), maps_dir(bpffs), bpffs.to_path_buf()] {
        match std::fs::remove_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => warn!(dir = %dir.display(), "could not remove: {e}"),
        }
    }
    Ok(removed)
}

/// Makes sure `bpffs` is on a BPF filesystem, mounting one at
/// `/sys/fs/bpf` when that is where it should be and nothing is mounted.
fn ensure_bpffs(bpffs: &Path) -> anyhow::Result<()> {
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
    let target = CString::new(default_mount.as_os_str().as_bytes())?;
    // SAFETY: all pointers are valid NUL-terminated strings; data is null.
    let rc = unsafe { libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        return Err(io::Error::last_os_error()).context("mounting bpffs at /sys/fs/bpf");
    }
    info!("mounted bpffs at /sys/fs/bpf");
    std::fs::create_dir_all(bpffs)?;
    Ok(())
}

fn fs_type(path: &Path) -> anyhow::Result<i64> {
    let c_path = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: statfs fills the zeroed struct we pass.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error()).with_context(|| format!("statfs {}", path.display()));
    }
    Ok(stat.f_type as i64)
}

/// The root of the cgroup v2 hierarchy, from `/proc/self/mountinfo`.
pub fn cgroup2_root() -> anyhow::Result<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
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

    #[test]
    fn selection_value_is_whole_and_ordered() {
        let entry = VipEntry {
            vip: "127.0.0.1:80".parse().unwrap(),
            selection: Selection { servers: vec!["127.0.0.2:80".parse().unwrap(), "127.0.0.3:81".parse().unwrap()], spread: 2 },
            hold_down: Duration::from_millis(1500),
            scope: Scope::Host,
        };
        let value = entry.to_value();
        assert_eq!(value.count, 2);
        assert_eq!(value.spread, 2);
        assert_eq!(value.hold_down_ns, 1_500_000_000);
        assert_eq!(SocketAddr::from(value.servers[1]), "127.0.0.3:81".parse().unwrap());
        assert_eq!(value.servers[2], Endpoint::default());
    }
}
