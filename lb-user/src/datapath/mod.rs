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
//!
//! Rooms: this file is the lifecycle (open: adopt or attach; selections
//! written); `object` the embedded eBPF object and its loading; `maps`
//! reads and writes the pinned maps,
//! `pins` holds the pin directory's layout, its lock and `detach`,
//! `upgrade` the `META` map and the programs' replacement, `sys` the raw
//! system calls aya does not offer.

mod external_maps;
mod fast_path;
mod maps;
mod object;
mod pins;
mod sockets;
mod sys;
mod upgrade;
pub mod xdp;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    net::SocketAddr,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use aya::{
    Ebpf, EbpfLoader,
    maps::{MapData, RingBuf},
    programs::{
        CgroupAttachMode, CgroupSock, CgroupSockAddr, SockOps,
        links::{FdLink, PinnedLink},
    },
};
use lb_common::{NETNS_ANY, maps as map_names, programs};
use tracing::{info, warn};

pub use self::{
    external_maps::{Announced, ExternalMaps, ExternalVips, Forwarded},
    maps::{Forgotten, PinnedMaps, VipEntry, failed_within},
    object::{KernelLogger, XdpLimits},
    pins::detach,
    sockets::{SocketTables, UdpPeerCount, VipSocket},
    sys::{cgroup2_root, monotonic_now_ns},
    upgrade::{
        pinned_program_ids, programs_fingerprint, read_layout_version, read_program_fingerprint,
        write_program_fingerprint,
    },
};
use self::{
    object::{load_object, load_program},
    pins::{
        PinLock, ensure_bpffs, has_getpeername, links_dir, maps_dir, open_pinned_map, remove_pins,
        required_pins,
    },
    sys::host_netns_cookie,
    upgrade::{needs_upgrade, replace_programs, stamp_meta},
};

/// The attached datapath: handles to its maps, and the pin directory's lock.
pub struct Datapath {
    maps: PinnedMaps,
    /// The external path's maps.
    external: ExternalMaps,
    /// `lb_xdp` on the pinned maps, loaded when an interface first needs it.
    xdp: Option<xdp::Program>,
    /// What `lb_xdp` is loaded with.
    xdp_limits: XdpLimits,
    /// The pin directory.
    bpffs: PathBuf,
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

/// What is fixed when the datapath is attached or its programs loaded
/// (`[daemon]`).
#[derive(Clone, Copy, Debug)]
pub struct AttachSettings {
    /// `SOCKETS`' size (`socket_table`).
    pub socket_table: u32,
    /// The external path's flow tables' size, each (`flow_table`).
    pub flow_table: u32,
    /// Written into each `lb_xdp` loaded (`new_flows_per_cpu`,
    /// `nat_ports`).
    pub xdp: XdpLimits,
}

/// What a fresh attach is made with.
struct Attach {
    sizes: AttachSettings,
    /// `--bpf-log`.
    bpf_log: bool,
    /// What `scope = "host"` writes (see `host_netns_cookie`).
    host_netns: u64,
    /// Whether `host_netns` is this namespace's own.
    netns_scope: bool,
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
        sizes: AttachSettings,
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
        let any_map = map_names::ALL.iter().any(|m| maps_dir(bpffs).join(m).exists());
        if any_link {
            // Programs are attached: refuse a layout we cannot read or
            // write before touching anything.
            let upgrade = needs_upgrade(bpffs, read_layout_version(bpffs)?)?;
            if required_pins(bpffs, upgrade).all(|p| p.exists()) {
                let logger = if upgrade
                    || read_program_fingerprint(bpffs)? != Some(programs_fingerprint())
                {
                    Self::replace(bpffs, cgroup, bpf_log, upgrade, sizes.xdp)?
                } else {
                    if bpf_log {
                        warn!(
                            "--bpf-log has no effect on an adopted datapath; run `lb detach` and start again to enable it"
                        );
                    }
                    None
                };
                let mut datapath = Self::adopt(bpffs, lock, host_netns, netns_scope)?;
                datapath.xdp_limits = sizes.xdp;
                datapath.logger = logger;
                let pinned = datapath.maps.socket_capacity().0;
                let socket_table = sizes.socket_table;
                if pinned != socket_table as usize {
                    warn!(
                        "the pinned socket table holds {pinned} TCP connections, not the {socket_table} of [daemon] \
                         socket_table: its size is fixed at attach; run `lb detach` and start again to change it"
                    );
                }
                let pinned = datapath.external.flow_capacity();
                let flow_table = sizes.flow_table;
                if pinned != flow_table as usize {
                    warn!(
                        "the pinned flow tables hold {pinned} flows, not the {flow_table} of [daemon] flow_table: \
                         their size is fixed at attach; run `lb detach` and start again to change it"
                    );
                }
                // The daemon writes an adopted datapath's selections itself,
                // starting from what the kernel holds (see `Daemon::adopt` in `daemon/startup.rs`).
                return Ok(datapath);
            }
        }
        if any_link || any_map || has_getpeername(bpffs) {
            warn!(bpffs = %bpffs.display(), "found an incomplete pinned datapath (interrupted attach?); removing it and attaching afresh");
            // Keep the directory itself: it is what we hold locked.
            remove_pins(bpffs)?;
        }
        let attach = Attach { sizes, bpf_log, host_netns, netns_scope };
        Self::attach(bpffs, cgroup, initial, &attach, lock).inspect_err(|_| {
            // Leave nothing half-attached behind.
            if let Err(e) = detach(bpffs) {
                warn!("cleaning up after a failed attach: {e:#}");
            }
        })
    }

    /// Replaces the pinned programs with this lb's ([`replace_programs`]),
    /// and upgrades pins of the previous layout (`upgrade`). Pins of this
    /// layout keep their programs if that fails (they serve correctly);
    /// pins of the previous one cannot be adopted without it.
    fn replace(
        bpffs: &Path,
        cgroup: &Path,
        bpf_log: bool,
        upgrade: bool,
        limits: XdpLimits,
    ) -> anyhow::Result<Option<KernelLogger>> {
        match replace_programs(bpffs, cgroup, bpf_log, limits) {
            Ok(logger) => {
                info!(
                    "the pinned programs differed from this lb's: replaced them (one atomic link update each){}",
                    if upgrade { ", and added the maps and programs of this layout" } else { "" }
                );
                if let Err(e) = write_program_fingerprint(bpffs, programs_fingerprint()) {
                    // The next start replaces them again: harmless.
                    warn!("recording the new programs' fingerprint: {e:#}");
                }
                Ok(logger)
            }
            Err(e) if upgrade => Err(e.context(format!(
                "upgrading the datapath pinned under {} to this lb's layout; its programs keep serving as \
                 they did. Run `lb detach --config <this config>` and start lb again",
                bpffs.display()
            ))),
            Err(e) => {
                warn!("keeping the pinned programs, which differ from this lb's: replacing them failed: {e:#}");
                Ok(None)
            }
        }
    }

    fn adopt(
        bpffs: &Path,
        lock: PinLock,
        host_netns: u64,
        netns_scope: bool,
    ) -> anyhow::Result<Self> {
        info!(bpffs = %bpffs.display(), "adopting the pinned datapath; programs stay attached");
        let map = |name: &str| open_pinned_map(bpffs, name);
        let events = RingBuf::try_from(map(map_names::EVENTS)?).context("pinned map EVENTS")?;
        Ok(Self {
            maps: PinnedMaps::from_maps(map)?,
            external: ExternalMaps::from_maps(map)?,
            xdp: None,
            xdp_limits: XdpLimits::default(),
            bpffs: bpffs.to_owned(),
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
        attach: &Attach,
        lock: PinLock,
    ) -> anyhow::Result<Self> {
        let &Attach { sizes, bpf_log, host_netns, netns_scope } = attach;
        let mut loader = EbpfLoader::new();
        loader.map_max_entries(map_names::SOCKETS, sizes.socket_table);
        loader.map_max_entries(map_names::FLOWS, sizes.flow_table);
        loader.map_max_entries(map_names::NAT_REPLIES, sizes.flow_table);
        loader.map_max_entries(map_names::OPENING_FLOWS, sizes.flow_table);
        loader.map_max_entries(map_names::OPENING_REPLIES, sizes.flow_table);
        let udp = lb_common::udp_flow_table(sizes.flow_table);
        loader.map_max_entries(map_names::UDP_FLOWS, udp);
        loader.map_max_entries(map_names::UDP_REPLIES, udp);
        let (mut ebpf, logger) = load_object(loader, bpf_log)?;

        // The layout version goes in before anything is pinned, so no pin
        // set of this layout is ever without it.
        stamp_meta(&mut ebpf)?;
        let maps_dir = maps_dir(bpffs);
        std::fs::create_dir_all(&maps_dir)
            .with_context(|| format!("creating {}", maps_dir.display()))?;
        for name in map_names::ALL {
            let map = ebpf
                .map(name)
                .with_context(|| format!("map {name} missing from the eBPF object"))?;
            let path = maps_dir.join(name);
            map.pin(&path).with_context(|| format!("pinning map {name} at {}", path.display()))?;
        }
        let mut take = |name: &str| {
            ebpf.take_map(name).with_context(|| format!("map {name} missing from the eBPF object"))
        };
        let events = RingBuf::try_from(take(map_names::EVENTS)?).context("map EVENTS")?;
        let maps = PinnedMaps::from_maps(&mut take)?;
        let external = ExternalMaps::from_maps(&mut take)?;
        let mut datapath = Self {
            maps,
            external,
            xdp: None,
            xdp_limits: sizes.xdp,
            bpffs: bpffs.to_owned(),
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
    /// Each change ends the verdicts `lb_xdp` keeps for established flows
    /// (a new epoch).
    pub fn reconcile(&mut self, desired: &[VipEntry]) -> anyhow::Result<usize> {
        let changes = self.maps.reconcile(desired, self.host_netns)?;
        if changes > 0 {
            self.external.new_epoch()?;
        }
        Ok(changes)
    }

    /// Writes one VIP's entry (one whole-value update) unless it is
    /// unchanged; a new epoch, as for [`Self::reconcile`].
    pub fn write(&mut self, entry: &VipEntry) -> anyhow::Result<()> {
        if self.maps.write(entry, self.host_netns)? {
            self.external.new_epoch()?;
        }
        Ok(())
    }

    /// Stops rewriting connects to `vip` (removes its entry, if any); a
    /// new epoch, as for [`Self::reconcile`].
    pub fn remove(&mut self, vip: SocketAddr) -> anyhow::Result<()> {
        if self.maps.remove(vip)? {
            self.external.new_epoch()?;
        }
        Ok(())
    }

    /// The pinned maps, to read (the daemon writes through [`Self::write`],
    /// [`Self::reconcile`] and [`Self::remove`], which know this daemon's
    /// network namespace).
    pub fn maps(&self) -> &PinnedMaps {
        &self.maps
    }

    /// Removes what the kernel keeps about servers and pairs that are gone
    /// ([`PinnedMaps::forget`]).
    pub fn forget(&mut self, live: &[(SocketAddr, Vec<SocketAddr>)]) -> anyhow::Result<Forgotten> {
        self.maps.forget(live)
    }

    /// The external path's maps, to write ([`ExternalMaps::set_vips`], ...).
    pub fn external(&mut self) -> &mut ExternalMaps {
        &mut self.external
    }

    /// The external path's maps, to read.
    pub fn external_maps(&self) -> &ExternalMaps {
        &self.external
    }

    /// The NAT ports `lb_xdp` is loaded with (`[daemon] nat_ports` as the
    /// daemon started: a reload changes it only at the next start).
    pub fn nat_port_range(&self) -> std::ops::RangeInclusive<u16> {
        match self.xdp_limits.nat_ports {
            (0, _) | (_, 0) => crate::nat_ports::DEFAULT,
            (first, last) => first..=last,
        }
    }

    /// The interfaces `lb_xdp` is attached to, and how.
    pub fn xdp_attachments(&self) -> Vec<(String, xdp::Mode)> {
        xdp::attachments(&self.bpffs)
    }

    /// Makes `lb_xdp` run on exactly the interfaces `wanted`: attaches it
    /// where it is missing (natively where the driver can), detaches it
    /// from the others. Returns each wanted interface's mode, or why it is
    /// not attached (the caller says so, once: it is asked again at every
    /// sync); one interface's failure does not stop the others.
    pub fn sync_xdp(
        &mut self,
        wanted: &BTreeSet<String>,
    ) -> BTreeMap<String, Result<xdp::Mode, String>> {
        let mut attached: BTreeMap<String, xdp::Mode> =
            self.xdp_attachments().into_iter().collect();
        // A pin whose interface no longer runs the program through it goes,
        // and a wanted interface is attached anew.
        attached.retain(|name, mode| match xdp::stale(&self.bpffs, name, *mode) {
            None => true,
            Some(why) => {
                warn!(interface = %name, "the XDP link pinned for this interface is stale ({why}): replacing it");
                if let Err(e) = xdp::release(&self.bpffs, name) {
                    warn!(interface = %name, "removing the stale link: {e:#}");
                }
                false
            }
        });
        for name in attached.keys().filter(|name| !wanted.contains(*name)) {
            match xdp::release(&self.bpffs, name) {
                Ok(()) => info!(interface = %name, "{} detached", programs::XDP),
                Err(e) => warn!(interface = %name, "detaching {}: {e:#}", programs::XDP),
            }
        }
        let mut outcome = BTreeMap::new();
        for name in wanted {
            if let Some(mode) = attached.get(name) {
                outcome.insert(name.clone(), Ok(*mode));
                continue;
            }
            let mut attach = || -> anyhow::Result<xdp::Mode> {
                if self.xdp.is_none() {
                    self.xdp = Some(xdp::Program::load(&self.bpffs, self.xdp_limits)?);
                }
                let program = self.xdp.as_mut().expect("loaded just above");
                program.attach(&self.bpffs, name)
            };
            let result = attach().map_err(|e| format!("{e:#}"));
            if let Ok(mode) = &result {
                info!(interface = %name, %mode, "{} attached", programs::XDP);
            }
            outcome.insert(name.clone(), result);
        }
        outcome
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

pub(super) fn attach_one(
    ebpf: &mut Ebpf,
    name: &str,
    cgroup_dir: &File,
    cgroup: &Path,
    links: &Path,
) -> anyhow::Result<()> {
    load_program(ebpf, name)?;
    let program = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?;
    // A bpf_link attachment always coexists with other programs on the
    // cgroup (systemd, a CNI); the kernel refuses attach flags on links.
    let mode = CgroupAttachMode::Single;
    let link: FdLink = if name == programs::SOCK_OPS {
        let program: &mut SockOps = program.try_into()?;
        let id = program
            .attach(cgroup_dir, mode)
            .with_context(|| format!("attaching {name} to {}", cgroup.display()))?;
        program.take_link(id)?.try_into()?
    } else if name == programs::SOCK_RELEASE {
        let program: &mut CgroupSock = program.try_into()?;
        let id = program
            .attach(cgroup_dir, mode)
            .with_context(|| format!("attaching {name} to {}", cgroup.display()))?;
        program.take_link(id)?.try_into()?
    } else {
        let program: &mut CgroupSockAddr = program.try_into()?;
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
