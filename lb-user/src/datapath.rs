//! The kernel side as the daemon sees it: load and attach the programs, pin
//! and adopt them, write selections, read counts and counters, detach.
//!
//! Pinned layout under the configured bpffs directory:
//! `links/<program>` (one cgroup link per program) and `maps/<MAP>`. While
//! those pins exist the datapath keeps working with nobody running
//! (fail-static); a starting daemon that finds them all adopts them instead
//! of attaching again, so there is no window without the programs.
//!
//! Guards, both checked before anything is touched:
//! - one daemon per pin directory: [`Datapath::open`] takes an exclusive
//!   `flock` on it, held for the `Datapath`'s life; a second daemon fails
//!   naming the first;
//! - one map layout: `maps/META` holds `lb_common::LAYOUT_VERSION`; pins of
//!   another layout (or from before layouts were versioned) are refused
//!   with the command that removes them (`lb detach`).
//!
//! Upgrades: `META` also holds a fingerprint of the attached programs. A
//! daemon that adopts pins of its layout but finds other programs (an older
//! or newer lb) loads its own on the pinned maps and swaps each pinned link
//! to them with `BPF_LINK_UPDATE`: every connect runs either the old or the
//! new program, never none.

use std::{
    collections::HashSet,
    ffi::CString,
    fs::File,
    io,
    net::SocketAddr,
    os::{
        fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::{ffi::OsStrExt as _, fs::MetadataExt as _},
    },
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{
        CgroupAttachMode, CgroupSock, CgroupSockAddr, SockOps,
        links::{FdLink, PinnedLink},
    },
};
use lb_common::{
    ConnKey, Endpoint, LAYOUT_VERSION, MAX_SERVERS, META_LAYOUT_VERSION, META_PROGRAMS_HIGH,
    META_PROGRAMS_LOW, NETNS_ANY, NETNS_INITIAL, Reason, Service as ServiceValue, SockEntry, maps,
    programs,
};
use tracing::{info, warn};

use crate::{balancer::Selection, config::Scope};

/// Forwards the kernel programs' aya-log records to `log` (and so to tracing).
pub type KernelLogger = aya_log::EbpfLogger<&'static dyn log::Log>;

/// The eBPF object, built by `build.rs` from `lb-ebpf`.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb"));

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The attached datapath: handles to its maps, and the pin directory's lock.
pub struct Datapath {
    maps: PinnedMaps,
    events: Option<RingBuf<MapData>>,
    /// Whether the programs were already attached when we started.
    pub adopted: bool,
    /// The getpeername hooks are attached (optional, Linux 5.8+).
    pub getpeername: bool,
    /// `host`-scoped services are rewritten only in this daemon's network
    /// namespace. False when this kernel cannot say which namespace that is
    /// (no `SO_NETNS_COOKIE`, Linux 5.14+, and the daemon is not in the
    /// initial namespace): then `host` acts as `all` (warned at start).
    pub netns_scope: bool,
    /// What `Scope::Host` writes into a service value (`Service::netns_cookie`).
    host_netns: u64,
    /// Reader of the kernel programs' logs when `--bpf-log` is on.
    logger: Option<KernelLogger>,
    /// The exclusive lock on the pin directory: released when the
    /// `Datapath` is dropped (or the process dies).
    _lock: PinLock,
}

/// Handles to the pinned maps the daemon reads and writes (all but the ring
/// buffer). [`Datapath`] holds one; [`PinnedMaps::open`] opens another on a
/// pin directory without its lock, to inspect it (tests, tools).
pub struct PinnedMaps {
    services: HashMap<MapData, Endpoint, ServiceValue>,
    failed_at: HashMap<MapData, Endpoint, u64>,
    sockets: HashMap<MapData, u64, SockEntry>,
    sockets_udp: HashMap<MapData, u64, SockEntry>,
    connections: PerCpuHashMap<MapData, ConnKey, i64>,
    counters: PerCpuArray<MapData, u64>,
}

/// What [`Datapath::forget`] removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forgotten {
    /// `FAILED_AT` entries of servers in no service.
    pub failure_marks: usize,
    /// `CONNECTIONS` entries of (VIP, server) pairs no longer configured,
    /// with no live connection.
    pub connection_counts: usize,
}

/// What one VIP gets in the kernel: its selection and its hold-down.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VipEntry {
    /// The address clients connect to.
    pub vip: SocketAddr,
    /// The servers, best first, and the spread.
    pub selection: Selection,
    /// How long the kernel skips a server after a connect to it failed.
    pub hold_down: Duration,
    /// Whose connects are rewritten: this network namespace's, or all.
    pub scope: Scope,
    /// The daemon's state of each server of the selection
    /// (`Service::daemon_states`), kept in the kernel for a restarted daemon.
    pub states: Vec<u8>,
}

/// A live socket that connected through a VIP (from the kernel's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VipSocket {
    /// The socket's cookie (what SOCK_DESTROY is asked to close).
    pub cookie: u64,
    /// The VIP it dialled.
    pub vip: SocketAddr,
    /// The server it was sent to.
    pub server: SocketAddr,
}

impl VipEntry {
    /// The kernel's value; `host_netns` is what `Scope::Host` writes
    /// ([`Datapath`] probed it at start).
    fn to_value(&self, host_netns: u64) -> ServiceValue {
        let mut value = ServiceValue::default();
        let servers = &self.selection.servers;
        for (slot, server) in value.servers.iter_mut().zip(servers.iter().take(MAX_SERVERS)) {
            *slot = Endpoint::from(*server);
        }
        value.count = servers.len().min(MAX_SERVERS) as u32;
        value.spread = self.selection.spread.clamp(1, MAX_SERVERS) as u32;
        value.hold_down_ns = u64::try_from(self.hold_down.as_nanos()).unwrap_or(u64::MAX);
        for (slot, state) in value.daemon_states.iter_mut().zip(&self.states) {
            *slot = *state;
        }
        value.netns_cookie = match self.scope {
            Scope::Host => host_netns,
            Scope::All => NETNS_ANY,
        };
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
    ///
    /// Fails, touching nothing, if another daemon holds the pin directory,
    /// or if the pins there have another map layout (the message names
    /// `lb detach`).
    pub fn open(
        bpffs: &Path,
        cgroup: &Path,
        initial: &[VipEntry],
        bpf_log: bool,
    ) -> anyhow::Result<Self> {
        ensure_bpffs(bpffs)?;
        let lock = PinLock::acquire(bpffs)?;
        let (host_netns, netns_scope) = match host_netns_cookie() {
            Some(cookie) => (cookie, true),
            None => {
                warn!(
                    "this kernel cannot tell lb which network namespace is its own (SO_NETNS_COOKIE needs Linux \
                     5.14, and lb does not run in the initial network namespace): services with scope = \"host\" \
                     are rewritten in every network namespace of the cgroup, as with scope = \"all\""
                );
                (NETNS_ANY, false)
            }
        };
        let any_link = programs::ALL.iter().any(|p| links_dir(bpffs).join(p).exists());
        let any_map = maps::ALL.iter().any(|m| maps_dir(bpffs).join(m).exists());
        if any_link {
            // Programs are attached: refuse a layout we cannot read or
            // write before touching anything.
            check_layout(bpffs, read_layout_version(bpffs)?)?;
            let present = required_pins(bpffs).filter(|p| p.exists()).count();
            if present == programs::REQUIRED.len() + maps::ALL.len() {
                let mut datapath = Self::adopt(bpffs, lock, host_netns, netns_scope)?;
                if read_program_fingerprint(bpffs)? != Some(programs_fingerprint()) {
                    match replace_programs(bpffs, bpf_log) {
                        Ok(logger) => {
                            datapath.logger = logger;
                            info!(
                                "the pinned programs differed from this lb's: replaced them (one atomic link update each)"
                            );
                            if let Err(e) = write_program_fingerprint(bpffs, programs_fingerprint())
                            {
                                // The next start replaces them again: harmless.
                                warn!("recording the new programs' fingerprint: {e:#}");
                            }
                        }
                        // Same layout: the old programs keep serving correctly.
                        Err(e) => warn!(
                            "keeping the pinned programs, which differ from this lb's: replacing them failed: {e:#}"
                        ),
                    }
                } else if bpf_log {
                    warn!(
                        "--bpf-log has no effect on an adopted datapath; run `lb detach` and start again to enable it"
                    );
                }
                // The daemon writes an adopted datapath's selections itself,
                // starting from what the kernel holds (see `daemon::adopt`).
                return Ok(datapath);
            }
        }
        if any_link || any_map || has_getpeername(bpffs) {
            warn!(bpffs = %bpffs.display(), "found an incomplete pinned datapath (interrupted attach?); removing it and attaching afresh");
            // Keep the directory itself: it is what we hold locked.
            remove_pins(bpffs)?;
        }
        Self::attach(bpffs, cgroup, initial, bpf_log, lock, host_netns, netns_scope).inspect_err(
            |_| {
                // Leave nothing half-attached behind.
                if let Err(e) = detach(bpffs) {
                    warn!("cleaning up after a failed attach: {e:#}");
                }
            },
        )
    }

    fn adopt(
        bpffs: &Path,
        lock: PinLock,
        host_netns: u64,
        netns_scope: bool,
    ) -> anyhow::Result<Self> {
        info!(bpffs = %bpffs.display(), "adopting the pinned datapath; programs stay attached");
        let map = |name: &str| open_pinned_map(bpffs, name);
        let events = RingBuf::try_from(map(maps::EVENTS)?).context("pinned map EVENTS")?;
        Ok(Self {
            maps: PinnedMaps::from_maps(map)?,
            events: Some(events),
            adopted: true,
            getpeername: has_getpeername(bpffs),
            netns_scope,
            host_netns,
            logger: None,
            _lock: lock,
        })
    }

    fn attach(
        bpffs: &Path,
        cgroup: &Path,
        initial: &[VipEntry],
        bpf_log: bool,
        lock: PinLock,
        host_netns: u64,
        netns_scope: bool,
    ) -> anyhow::Result<Self> {
        // aya-log's level: 0 turns every kernel log statement into a no-op.
        let log_level: u8 = if bpf_log { 0xff } else { 0 };
        if EBPF_OBJECT.is_empty() {
            bail!(
                "this lb was built with AYA_BUILD_SKIP=1 and carries no eBPF programs; rebuild without it"
            );
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

        // The layout version goes in before anything is pinned, so no pin
        // set of this layout is ever without it.
        {
            let meta = ebpf.map_mut(maps::META).context("map META missing from the eBPF object")?;
            let mut meta: Array<&mut MapData, u32> = Array::try_from(meta).context("map META")?;
            meta.set(META_LAYOUT_VERSION, LAYOUT_VERSION, 0)
                .context("writing the layout version to META")?;
            let fingerprint = programs_fingerprint();
            meta.set(META_PROGRAMS_LOW, fingerprint as u32, 0)
                .context("writing the programs' fingerprint to META")?;
            meta.set(META_PROGRAMS_HIGH, (fingerprint >> 32) as u32, 0)
                .context("writing the programs' fingerprint to META")?;
        }
        let maps_dir = maps_dir(bpffs);
        std::fs::create_dir_all(&maps_dir)
            .with_context(|| format!("creating {}", maps_dir.display()))?;
        for name in maps::ALL {
            let map = ebpf
                .map(name)
                .with_context(|| format!("map {name} missing from the eBPF object"))?;
            let path = maps_dir.join(name);
            map.pin(&path).with_context(|| format!("pinning map {name} at {}", path.display()))?;
        }
        let mut take = |name: &str| {
            ebpf.take_map(name).with_context(|| format!("map {name} missing from the eBPF object"))
        };
        let events = RingBuf::try_from(take(maps::EVENTS)?).context("map EVENTS")?;
        let maps = PinnedMaps::from_maps(take)?;
        let mut datapath = Self {
            maps,
            events: Some(events),
            adopted: false,
            getpeername: false,
            netns_scope,
            host_netns,
            logger,
            _lock: lock,
        };
        // Selections go in before the programs attach: the first connect
        // already finds its service.
        datapath.reconcile(initial)?;
        datapath.getpeername = load_and_attach(&mut ebpf, bpffs, cgroup)?;
        info!(cgroup = %cgroup.display(), bpffs = %bpffs.display(), "datapath attached and pinned");
        Ok(datapath)
    }

    /// Makes the `SERVICES` map equal `desired`, writing only what changed.
    /// Returns how many entries were written or removed.
    pub fn reconcile(&mut self, desired: &[VipEntry]) -> anyhow::Result<usize> {
        let wanted: std::collections::HashMap<Endpoint, ServiceValue> = desired
            .iter()
            .map(|entry| (Endpoint::from(entry.vip), entry.to_value(self.host_netns)))
            .collect();
        let services = &mut self.maps.services;
        let existing: Vec<Endpoint> =
            services.keys().collect::<Result<_, _>>().context("listing SERVICES")?;
        let mut changes = 0;
        for vip in existing {
            if !wanted.contains_key(&vip) {
                services
                    .remove(&vip)
                    .with_context(|| format!("removing VIP {}", SocketAddr::from(vip)))?;
                changes += 1;
            }
        }
        for (vip, value) in wanted {
            if services.get(&vip, 0).ok() != Some(value) {
                // One update replaces the whole value: the kernel never sees
                // a half-written selection.
                services
                    .insert(vip, value, 0)
                    .with_context(|| format!("writing VIP {}", SocketAddr::from(vip)))?;
                changes += 1;
            }
        }
        Ok(changes)
    }

    /// Writes one VIP's entry (one whole-value update) unless it is unchanged.
    pub fn write(&mut self, entry: &VipEntry) -> anyhow::Result<()> {
        let (vip, value) = (Endpoint::from(entry.vip), entry.to_value(self.host_netns));
        let services = &mut self.maps.services;
        if services.get(&vip, 0).ok() != Some(value) {
            services.insert(vip, value, 0).with_context(|| format!("writing VIP {}", entry.vip))?;
        }
        Ok(())
    }

    /// Stops rewriting connects to `vip` (removes its entry, if any).
    pub fn remove(&mut self, vip: SocketAddr) -> anyhow::Result<()> {
        match self.maps.services.remove(&Endpoint::from(vip)) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(e).with_context(|| format!("removing VIP {vip}")),
        }
    }

    /// The selection currently in the kernel for `vip`.
    pub fn selection(&self, vip: SocketAddr) -> Vec<SocketAddr> {
        self.maps.selection(vip)
    }

    /// The spread width the kernel holds for `vip` (1 when unknown).
    pub fn spread(&self, vip: SocketAddr) -> usize {
        self.maps.spread(vip)
    }

    /// The daemon's states the kernel holds for the selection of `vip`
    /// (`Service::daemon_states`, one per selected server).
    pub fn daemon_states(&self, vip: SocketAddr) -> Vec<u8> {
        match self.maps.services.get(&Endpoint::from(vip), 0) {
            Ok(value) => value.daemon_states.iter().take(value.count as usize).copied().collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Live connections through `vip` to `server`.
    pub fn connections(&self, vip: SocketAddr, server: SocketAddr) -> i64 {
        self.maps.connections(vip, server)
    }

    /// Whether a connect to `server` failed less than `hold_down` ago.
    pub fn recently_failed(&self, server: SocketAddr, hold_down: Duration) -> bool {
        self.maps.recently_failed(server, hold_down)
    }

    /// Every failure mark (`FAILED_AT`): server → when its connect failed
    /// (`CLOCK_MONOTONIC` ns). One pass over a map that holds only the
    /// marked servers, for a view of every service at once (`lb status`)
    /// instead of a lookup per server.
    pub fn failure_times(&self) -> std::collections::HashMap<SocketAddr, u64> {
        self.maps.failure_times()
    }

    /// The kernel's decision counters, summed over CPUs, by reason name.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        self.maps.counters()
    }

    /// The live TCP sockets that connected through a VIP (the ones
    /// `sock_destroy` can close).
    pub fn vip_sockets(&self) -> impl Iterator<Item = VipSocket> + '_ {
        self.maps.vip_sockets()
    }

    /// How many sockets the kernel tracks: (TCP, connected UDP). One map
    /// read per entry: for status, not for a hot loop.
    pub fn tracked_sockets(&self) -> (usize, usize) {
        self.maps.tracked_sockets()
    }

    /// Removes what the kernel keeps about servers and pairs that are gone:
    /// the `FAILED_AT` mark of every server in no service of `live`, and
    /// the `CONNECTIONS` count of every (VIP, server) pair not in `live`
    /// once it has no live connection. `live` lists every service's VIP
    /// with all its servers (configured, runtime and default).
    pub fn forget(&mut self, live: &[(SocketAddr, Vec<SocketAddr>)]) -> anyhow::Result<Forgotten> {
        self.maps.forget(live)
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

impl PinnedMaps {
    /// Opens the maps pinned under `bpffs` without taking its lock, to look
    /// at them (or, in tests, to call [`forget`](Self::forget) as a daemon
    /// would). Fails if they are not of this lb's layout.
    pub fn open(bpffs: &Path) -> anyhow::Result<Self> {
        check_layout(bpffs, read_layout_version(bpffs)?)?;
        Self::from_maps(|name| open_pinned_map(bpffs, name))
    }

    fn from_maps(mut map: impl FnMut(&str) -> anyhow::Result<Map>) -> anyhow::Result<Self> {
        macro_rules! typed {
            ($kind:ident, $name:expr) => {
                $kind::try_from(map($name)?)
                    .with_context(|| format!("map {} has an unexpected type or size", $name))?
            };
        }
        Ok(Self {
            services: typed!(HashMap, maps::SERVICES),
            failed_at: typed!(HashMap, maps::FAILED_AT),
            sockets: typed!(HashMap, maps::SOCKETS),
            sockets_udp: typed!(HashMap, maps::SOCKETS_UDP),
            connections: typed!(PerCpuHashMap, maps::CONNECTIONS),
            counters: typed!(PerCpuArray, maps::COUNTERS),
        })
    }

    /// The selection currently in the kernel for `vip`.
    pub fn selection(&self, vip: SocketAddr) -> Vec<SocketAddr> {
        match self.services.get(&Endpoint::from(vip), 0) {
            Ok(value) => value
                .servers
                .iter()
                .take(value.count as usize)
                .map(|e| SocketAddr::from(*e))
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    /// The spread width the kernel holds for `vip` (1 when unknown).
    pub fn spread(&self, vip: SocketAddr) -> usize {
        self.services.get(&Endpoint::from(vip), 0).map_or(1, |value| value.spread.max(1) as usize)
    }

    /// Live connections through `vip` to `server`.
    pub fn connections(&self, vip: SocketAddr, server: SocketAddr) -> i64 {
        let key = ConnKey { vip: vip.into(), server: server.into() };
        self.connections.get(&key, 0).map(|per_cpu| per_cpu.iter().sum()).unwrap_or(0)
    }

    /// Whether a connect to `server` failed less than `hold_down` ago.
    pub fn recently_failed(&self, server: SocketAddr, hold_down: Duration) -> bool {
        self.failed_at
            .get(&Endpoint::from(server), 0)
            .is_ok_and(|at| failed_within(at, monotonic_now_ns(), hold_down))
    }

    /// Every failure mark: server → when its connect failed.
    pub fn failure_times(&self) -> std::collections::HashMap<SocketAddr, u64> {
        self.failed_at
            .iter()
            .filter_map(Result::ok)
            .map(|(server, at)| (SocketAddr::from(server), at))
            .collect()
    }

    /// Every server with a failure mark in `FAILED_AT`.
    pub fn failure_marks(&self) -> Vec<SocketAddr> {
        self.failure_times().into_keys().collect()
    }

    /// Every (VIP, server) pair in `CONNECTIONS`, with its count.
    pub fn connection_counts(&self) -> Vec<(SocketAddr, SocketAddr, i64)> {
        self.connections
            .iter()
            .filter_map(Result::ok)
            .map(|(key, per_cpu)| {
                (SocketAddr::from(key.vip), SocketAddr::from(key.server), per_cpu.iter().sum())
            })
            .collect()
    }

    /// The kernel's decision counters, summed over CPUs, by reason name.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        Reason::ALL
            .into_iter()
            .map(|reason| {
                let total =
                    self.counters.get(&reason.index(), 0).map(|v| v.iter().sum()).unwrap_or(0);
                (reason.name(), total)
            })
            .collect()
    }

    /// The live TCP sockets that connected through a VIP.
    pub fn vip_sockets(&self) -> impl Iterator<Item = VipSocket> + '_ {
        self.sockets.iter().filter_map(Result::ok).map(|(cookie, e)| VipSocket {
            cookie,
            vip: SocketAddr::from(e.vip),
            server: SocketAddr::from(e.server),
        })
    }

    /// How many sockets the kernel tracks: (TCP, connected UDP).
    pub fn tracked_sockets(&self) -> (usize, usize) {
        (
            self.sockets.keys().filter(Result::is_ok).count(),
            self.sockets_udp.keys().filter(Result::is_ok).count(),
        )
    }

    /// See [`Datapath::forget`].
    pub fn forget(&mut self, live: &[(SocketAddr, Vec<SocketAddr>)]) -> anyhow::Result<Forgotten> {
        // Read first, remove after: removing while walking a hash map makes
        // the walk start over.
        let marks: Vec<Endpoint> =
            self.failed_at.keys().collect::<Result<_, _>>().context("listing FAILED_AT")?;
        let counts: Vec<(ConnKey, i64)> = self
            .connections
            .iter()
            .map(|entry| entry.map(|(key, per_cpu)| (key, per_cpu.iter().sum())))
            .collect::<Result<_, _>>()
            .context("reading CONNECTIONS")?;
        let (marks, counts) = to_forget(live, &marks, &counts);
        let mut forgotten = Forgotten::default();
        for server in marks {
            let what = || format!("removing the failure mark of {}", SocketAddr::from(server));
            forgotten.failure_marks +=
                usize::from(removed(self.failed_at.remove(&server)).with_context(what)?);
        }
        for key in counts {
            // A connect chosen before the pair left the selection may
            // establish between the read above and this removal; its close
            // then counts -1 on a fresh entry, which a later `forget`
            // removes once it nets to zero again. A race, not a leak.
            let what = || {
                format!(
                    "removing the count of {} via {}",
                    SocketAddr::from(key.server),
                    SocketAddr::from(key.vip)
                )
            };
            forgotten.connection_counts +=
                usize::from(removed(self.connections.remove(&key)).with_context(what)?);
        }
        Ok(forgotten)
    }
}

/// What [`PinnedMaps::forget`] removes, from plain data: the failure marks
/// (`marks`, from `FAILED_AT`) of servers in no service of `live`, and the
/// counts (`counts`, from `CONNECTIONS`, summed over CPUs) of (VIP, server)
/// pairs not in `live` that have no live connection. A pair that still
/// counts connections keeps its entry until they close: the kernel uncounts
/// them there.
fn to_forget(
    live: &[(SocketAddr, Vec<SocketAddr>)],
    marks: &[Endpoint],
    counts: &[(ConnKey, i64)],
) -> (Vec<Endpoint>, Vec<ConnKey>) {
    let servers: HashSet<Endpoint> =
        live.iter().flat_map(|(_, servers)| servers.iter().map(|s| Endpoint::from(*s))).collect();
    let pairs: HashSet<ConnKey> = live
        .iter()
        .flat_map(|(vip, servers)| {
            servers
                .iter()
                .map(|s| ConnKey { vip: Endpoint::from(*vip), server: Endpoint::from(*s) })
        })
        .collect();
    let marks = marks.iter().copied().filter(|server| !servers.contains(server)).collect();
    let counts = counts
        .iter()
        .filter(|(key, live)| *live == 0 && !pairs.contains(key))
        .map(|(key, _)| *key)
        .collect();
    (marks, counts)
}

/// Whether a map removal removed something: a key that is already gone
/// (the kernel removed it meanwhile) is not an error.
fn removed(result: Result<(), MapError>) -> Result<bool, MapError> {
    match result {
        Ok(()) => Ok(true),
        Err(MapError::KeyNotFound) => Ok(false),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

fn open_pinned_map(bpffs: &Path, name: &str) -> anyhow::Result<Map> {
    let path = maps_dir(bpffs).join(name);
    let data = MapData::from_pin(&path)
        .with_context(|| format!("opening pinned map {}", path.display()))?;
    Map::from_map_data(data)
        .with_context(|| format!("pinned map {} has an unexpected type", path.display()))
}

/// The pinned `META` map, if there is one.
fn pinned_meta(bpffs: &Path) -> anyhow::Result<Option<Array<MapData, u32>>> {
    let path = maps_dir(bpffs).join(maps::META);
    if !path.exists() {
        return Ok(None);
    }
    let meta = Array::try_from(open_pinned_map(bpffs, maps::META)?)
        .with_context(|| format!("pinned map {} is not an array of u32", path.display()))?;
    Ok(Some(meta))
}

/// The layout version pinned under `bpffs`: `None` if there is no `META`
/// map (pins of an lb from before layouts were versioned, or none at all).
pub fn read_layout_version(bpffs: &Path) -> anyhow::Result<Option<u32>> {
    let Some(meta) = pinned_meta(bpffs)? else { return Ok(None) };
    let version = meta
        .get(&META_LAYOUT_VERSION, 0)
        .with_context(|| format!("reading the layout version under {}", bpffs.display()))?;
    Ok(Some(version))
}

/// The fingerprint of the programs attached under `bpffs` (see
/// [`programs_fingerprint`]), if there is a `META` map.
pub fn read_program_fingerprint(bpffs: &Path) -> anyhow::Result<Option<u64>> {
    let Some(meta) = pinned_meta(bpffs)? else { return Ok(None) };
    let read = |i| {
        meta.get(&i, 0)
            .with_context(|| format!("reading the programs' fingerprint under {}", bpffs.display()))
    };
    Ok(Some(u64::from(read(META_PROGRAMS_LOW)?) | (u64::from(read(META_PROGRAMS_HIGH)?) << 32)))
}

/// Records `fingerprint` as that of the programs attached under `bpffs`.
/// The daemon writes its own after replacing them; a test writes another
/// to make the next daemon replace them, as an upgrade would.
pub fn write_program_fingerprint(bpffs: &Path, fingerprint: u64) -> anyhow::Result<()> {
    let mut meta = pinned_meta(bpffs)?
        .with_context(|| format!("no META map pinned under {}", bpffs.display()))?;
    let what = || format!("writing the programs' fingerprint under {}", bpffs.display());
    meta.set(META_PROGRAMS_LOW, fingerprint as u32, 0).with_context(what)?;
    meta.set(META_PROGRAMS_HIGH, (fingerprint >> 32) as u32, 0).with_context(what)?;
    Ok(())
}

/// A fingerprint of this lb's programs: FNV-1a (64 bits) of the embedded
/// eBPF object. Stable across runs and builds of the same object; two
/// objects that differ get different fingerprints (barring a collision,
/// which would only skip one replacement).
pub fn programs_fingerprint() -> u64 {
    static FINGERPRINT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *FINGERPRINT.get_or_init(|| {
        EBPF_OBJECT.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
            (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
        })
    })
}

/// Loads this lb's programs on the maps pinned under `bpffs` (reused, not
/// created) and points every pinned link at them, one `BPF_LINK_UPDATE`
/// each: the cgroup's program is swapped in place, so each connect runs
/// either the old program or the new one. All programs are loaded before
/// the first link moves, so a kernel that refuses one leaves all the old
/// ones in place. Only the programs whose links are pinned are replaced
/// (the optional getpeername hooks may be absent).
fn replace_programs(bpffs: &Path, bpf_log: bool) -> anyhow::Result<Option<KernelLogger>> {
    if EBPF_OBJECT.is_empty() {
        bail!("this lb was built with AYA_BUILD_SKIP=1 and carries no eBPF programs");
    }
    let log_level: u8 = if bpf_log { 0xff } else { 0 };
    let pins: Vec<(&str, PathBuf)> =
        maps::ALL.iter().map(|m| (*m, maps_dir(bpffs).join(m))).collect();
    let mut loader = EbpfLoader::new();
    loader.override_global("AYA_LOG_LEVEL", &log_level, false);
    for (name, path) in &pins {
        // Reuse the pinned map (of the same layout: checked before).
        loader.map_pin_path(name, path.as_path());
    }
    let mut ebpf =
        loader.load(EBPF_OBJECT).context("loading the eBPF object on the pinned maps")?;
    let logger = if bpf_log {
        Some(aya_log::EbpfLogger::init(&mut ebpf).context("setting up --bpf-log")?)
    } else {
        None
    };
    // The sockets the running programs track carry no mark of these
    // programs (a connect may also run connect4 under the old programs and
    // its sock_ops under the new ones; with TCP Fast Open, the first send
    // is that much later): the new programs look every connecting socket
    // up, as on a kernel that refuses the mark. Until the next fresh attach.
    let unmarked = ebpf
        .map_mut(maps::UNMARKED)
        .with_context(|| format!("map {} missing from the eBPF object", maps::UNMARKED))?;
    Array::<_, u32>::try_from(unmarked)
        .and_then(|mut unmarked| unmarked.set(0, 1, 0))
        .with_context(|| format!("writing map {}", maps::UNMARKED))?;
    let links = links_dir(bpffs);
    let pinned: Vec<(&str, PathBuf)> = programs::ALL
        .iter()
        .map(|p| (*p, links.join(p)))
        .filter(|(_, link)| link.exists())
        .collect();
    for (name, _) in &pinned {
        load_program(&mut ebpf, name)?;
    }
    for (name, link) in &pinned {
        let program = ebpf
            .program(name)
            .with_context(|| format!("program {name} missing from the eBPF object"))?;
        let program = program.fd().with_context(|| format!("program {name}"))?;
        let link_fd =
            bpf_obj_get(link).with_context(|| format!("opening pinned link {}", link.display()))?;
        bpf_link_update(link_fd.as_fd(), program.as_fd())
            .with_context(|| format!("updating link {} to the new {name}", link.display()))?;
    }
    Ok(logger)
}

/// Loads (verifies) program `name` of `ebpf`, of the type its name says.
fn load_program(ebpf: &mut Ebpf, name: &str) -> anyhow::Result<()> {
    let program = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?;
    let loaded = if name == programs::SOCK_OPS {
        <&mut SockOps>::try_from(program)?.load()
    } else if name == programs::SOCK_RELEASE {
        <&mut CgroupSock>::try_from(program)?.load()
    } else {
        <&mut CgroupSockAddr>::try_from(program)?.load()
    };
    loaded.with_context(|| format!("loading {name}"))
}

/// The ids of the programs the links pinned under `bpffs` run, by program
/// name (only pinned links are listed).
pub fn pinned_program_ids(bpffs: &Path) -> anyhow::Result<Vec<(&'static str, u32)>> {
    let mut ids = Vec::new();
    for name in programs::ALL {
        let link = links_dir(bpffs).join(name);
        if !link.exists() {
            continue;
        }
        ids.push((name, pinned_link_ids(&link)?.program));
    }
    Ok(ids)
}

/// The ids of a pinned link and of the program it runs.
struct LinkIds {
    link: u32,
    program: u32,
}

fn pinned_link_ids(link: &Path) -> anyhow::Result<LinkIds> {
    let fd =
        bpf_obj_get(link).with_context(|| format!("opening pinned link {}", link.display()))?;
    // struct bpf_link_info starts with: __u32 type, id, prog_id.
    let mut info = [0u32; 16];
    let mut attr = BpfAttr::default();
    attr.set_u32(0, fd.as_raw_fd() as u32);
    attr.set_u32(4, size_of_val(&info) as u32);
    attr.set_u64(8, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)
        .with_context(|| format!("reading the info of link {}", link.display()))?;
    Ok(LinkIds { link: info[1], program: info[2] })
}

/// Whether the bpf link `id` still exists (anyone may hold it open). An
/// error other than "no such link" is read as gone: nothing to wait for.
fn link_exists(id: u32) -> bool {
    let mut attr = BpfAttr::default();
    attr.set_u32(0, id);
    match bpf(BPF_LINK_GET_FD_BY_ID, &mut attr) {
        Ok(fd) => {
            // SAFETY: the kernel just returned this descriptor to us.
            drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
            true
        }
        Err(_) => false,
    }
}

// The bpf(2) commands aya 0.14 does not expose for pinned links.
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;

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
fn bpf_obj_get(path: &Path) -> io::Result<OwnedFd> {
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
fn bpf_link_update(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = BpfAttr::default();
    // link_update: link_fd, new_prog_fd, flags (0: whatever runs now), old_prog_fd.
    attr.set_u32(0, link.as_raw_fd() as u32);
    attr.set_u32(4, program.as_raw_fd() as u32);
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

/// Refuses pins of another layout than this lb's, saying what to run.
fn check_layout(bpffs: &Path, found: Option<u32>) -> anyhow::Result<()> {
    if found == Some(LAYOUT_VERSION) {
        return Ok(());
    }
    let found = match found {
        Some(version) => format!("map layout version {version}"),
        None => {
            "no map layout version (they were made by an lb from before layouts were versioned)"
                .to_owned()
        }
    };
    bail!(
        "refusing to adopt the datapath pinned under {}: its maps have {found}, and this lb uses version \
         {LAYOUT_VERSION}. Run `lb detach --config <this config>` to remove it, then start lb again \
         (until then connects to VIPs are not rewritten; established connections are not touched)",
        bpffs.display()
    )
}

/// The exclusive `flock` on a pin directory: one daemon per set of pins.
struct PinLock {
    _dir: File,
}

impl PinLock {
    /// Locks `bpffs` (a directory that exists) without waiting; if another
    /// process holds it, fails naming that process.
    fn acquire(bpffs: &Path) -> anyhow::Result<Self> {
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

/// What `Scope::Host` writes into a service value: this process's network
/// namespace cookie (`SO_NETNS_COOKIE`, Linux 5.14+); on an older kernel,
/// [`NETNS_INITIAL`] if this process is in the initial network namespace
/// (the kernel program then asks for that cookie itself); otherwise `None`.
fn host_netns_cookie() -> Option<u64> {
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

/// Loads and attaches every program and pins its link. Returns whether the
/// optional getpeername hooks are attached; a missing required program is
/// an error.
fn load_and_attach(ebpf: &mut Ebpf, bpffs: &Path, cgroup: &Path) -> anyhow::Result<bool> {
    let cgroup_dir =
        File::open(cgroup).with_context(|| format!("opening cgroup {}", cgroup.display()))?;
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
            Err(e) => {
                return Err(e.context("this kernel lacks a feature lb needs (cgroup connect hooks, sock_ops and sock_release, Linux 5.10+)"));
            }
        }
    }
    if !getpeername {
        // All or nothing: a lone getpeername4 would make IPv4 and IPv6 differ.
        for name in programs::OPTIONAL {
            let _ = PinnedLink::from_pin(links.join(name)).map(PinnedLink::unpin);
        }
    }
    Ok(getpeername)
}

fn attach_one(
    ebpf: &mut Ebpf,
    name: &str,
    cgroup_dir: &File,
    cgroup: &Path,
    links: &Path,
) -> anyhow::Result<()> {
    let program = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?;
    // A bpf_link attachment always coexists with other programs on the
    // cgroup (systemd, a CNI); the kernel refuses attach flags on links.
    let mode = CgroupAttachMode::Single;
    let link: FdLink = if name == programs::SOCK_OPS {
        let program: &mut SockOps = program.try_into()?;
        program.load().with_context(|| format!("loading {name}"))?;
        let id = program
            .attach(cgroup_dir, mode)
            .with_context(|| format!("attaching {name} to {}", cgroup.display()))?;
        program.take_link(id)?.try_into()?
    } else if name == programs::SOCK_RELEASE {
        let program: &mut CgroupSock = program.try_into()?;
        program.load().with_context(|| format!("loading {name}"))?;
        let id = program
            .attach(cgroup_dir, mode)
            .with_context(|| format!("attaching {name} to {}", cgroup.display()))?;
        program.take_link(id)?.try_into()?
    } else {
        let program: &mut CgroupSockAddr = program.try_into()?;
        program.load().with_context(|| format!("loading {name}"))?;
        let id = program
            .attach(cgroup_dir, mode)
            .with_context(|| format!("attaching {name} to {}", cgroup.display()))?;
        program.take_link(id)?.try_into()?
    };
    let path = links.join(name);
    // Dropping the pinned handle closes our fd; the pin keeps the link.
    link.pin(&path).with_context(|| format!("pinning link {}", path.display()))?;
    Ok(())
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
fn remove_pins(bpffs: &Path) -> anyhow::Result<Vec<PathBuf>> {
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
    let rc = unsafe {
        libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null())
    };
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

/// Whether a failure mark set at `at_ns` is less than `hold_down` older
/// than `now_ns` (both `CLOCK_MONOTONIC`, as `bpf_ktime_get_ns`). A mark
/// from after `now_ns` (set while the caller read the clock) is recent.
pub fn failed_within(at_ns: u64, now_ns: u64, hold_down: Duration) -> bool {
    now_ns.saturating_sub(at_ns) < hold_down.as_nanos() as u64
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
    fn a_failure_mark_is_recent_for_its_hold_down_only() {
        let second = 1_000_000_000;
        let hold_down = Duration::from_secs(5);
        assert!(failed_within(10 * second, 14 * second, hold_down));
        assert!(!failed_within(10 * second, 15 * second, hold_down), "hold-down over");
        assert!(!failed_within(10 * second, 20 * second, hold_down));
        assert!(failed_within(15 * second, 14 * second, hold_down), "marked after the read");
        assert!(!failed_within(10 * second, 10 * second, Duration::ZERO), "no hold-down");
    }

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
            selection: Selection {
                servers: vec!["127.0.0.2:80".parse().unwrap(), "127.0.0.3:81".parse().unwrap()],
                spread: 2,
            },
            hold_down: Duration::from_millis(1500),
            scope: Scope::Host,
            states: vec![7, 1],
        };
        let value = entry.to_value(42);
        assert_eq!(value.netns_cookie, 42, "host scope: the daemon's namespace");
        assert_eq!(
            VipEntry { scope: Scope::All, ..entry.clone() }.to_value(42).netns_cookie,
            NETNS_ANY
        );
        assert_eq!(value.count, 2);
        assert_eq!(value.spread, 2);
        assert_eq!(value.hold_down_ns, 1_500_000_000);
        assert_eq!(SocketAddr::from(value.servers[1]), "127.0.0.3:81".parse().unwrap());
        assert_eq!(value.servers[2], Endpoint::default());
        assert_eq!(value.daemon_states[..3], [7, 1, 0]);
    }

    #[test]
    fn forget_takes_only_what_no_service_has() {
        let a = |s: &str| -> SocketAddr { s.parse().unwrap() };
        let (vip1, vip2) = (a("127.0.0.1:80"), a("127.0.0.1:81"));
        let (s1, s2, s3) = (a("127.10.0.1:80"), a("127.10.0.2:80"), a("127.10.0.3:80"));
        let pair =
            |vip, server| ConnKey { vip: Endpoint::from(vip), server: Endpoint::from(server) };
        let live = [(vip1, vec![s1]), (vip2, vec![s2])];
        let marks = [s1, s2, s3].map(Endpoint::from);
        let counts = [
            (pair(vip1, s1), 0), // configured: stays
            (pair(vip1, s2), 0), // s2 is only vip2's now: goes, though s2's mark stays
            (pair(vip1, s3), 2), // removed, but two connections still open: stays
            (pair(vip2, s3), 0), // removed and idle: goes
        ];
        let (marks, counts) = to_forget(&live, &marks, &counts);
        assert_eq!(marks, vec![Endpoint::from(s3)]);
        assert_eq!(counts, vec![pair(vip1, s2), pair(vip2, s3)]);
        assert_eq!(to_forget(&live, &[], &[]), (vec![], vec![]));
    }

    #[test]
    fn only_pins_of_this_layout_are_adopted() {
        let bpffs = Path::new("/sys/fs/bpf/lb");
        assert!(check_layout(bpffs, Some(LAYOUT_VERSION)).is_ok());
        for found in [None, Some(1), Some(LAYOUT_VERSION + 1)] {
            let error = format!("{:#}", check_layout(bpffs, found).unwrap_err());
            assert!(error.contains("/sys/fs/bpf/lb") && error.contains("`lb detach"), "{error}");
        }
        let old = format!("{:#}", check_layout(bpffs, None).unwrap_err());
        assert!(old.contains("before layouts were versioned"), "{old}");
    }

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
