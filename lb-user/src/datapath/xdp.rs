//! The external path's XDP program (`lb_xdp`) as userspace loads and
//! attaches it.
//!
//! One program on every interface of the external path, each attachment a
//! bpf_link pinned at `links/xdp-native/<interface>` or
//! `links/xdp-generic/<interface>`: the directory records the mode, which
//! the kernel's link info does not. While the pin exists the program runs
//! (fail-static); removing it detaches the program at once.
//!
//! [`load_unattached`] loads it on fresh, unpinned maps, attached nowhere:
//! for the packet fixtures (`tests/tests/xdp_fixtures/`), which run it with
//! `BPF_PROG_TEST_RUN`, and the benchmark of its program time.

use std::{io, os::fd::AsFd as _, path::Path};

use anyhow::Context as _;
use aya::{
    Ebpf, EbpfLoader,
    programs::{
        ProgramError, Xdp,
        links::{FdLink, PinnedLink},
        xdp::XdpMode,
    },
};
use lb_common::{maps, programs};

pub use super::pins::{Mode, attachments};
use super::{
    object::{XdpLimits, load_object, load_retrying, write_limits},
    pins::maps_dir,
    sys::{bpf_link_update, bpf_obj_get},
};

/// The eBPF object with `lb_xdp` loaded (verified) on maps of its own,
/// pinned and attached nowhere: the caller fills the maps and runs the
/// program with `BPF_PROG_TEST_RUN` (`aya::programs::TestRun`).
pub fn load_unattached() -> anyhow::Result<Ebpf> {
    load_unattached_with(None)
}

/// As [`load_unattached`], with opening flow tables (`OPENING_FLOWS`,
/// `OPENING_REPLIES`, and UDP's: `UDP_FLOWS`, `UDP_REPLIES`) of
/// `opening_flows` entries each, if given: a test turns small tables over
/// with few packets.
pub fn load_unattached_with(opening_flows: Option<u32>) -> anyhow::Result<Ebpf> {
    let mut loader = EbpfLoader::new();
    if let Some(size) = opening_flows {
        for map in [maps::OPENING_FLOWS, maps::OPENING_REPLIES, maps::UDP_FLOWS, maps::UDP_REPLIES]
        {
            loader.map_max_entries(map, size);
        }
    }
    let (mut ebpf, _) = load_object(loader, false)?;
    let program = xdp_program(&mut ebpf)?;
    load_retrying(|| program.load()).with_context(|| format!("loading {}", programs::XDP))?;
    Ok(ebpf)
}

/// `lb_xdp` loaded on the maps pinned under a bpffs directory, to attach.
pub(super) struct Program {
    ebpf: Ebpf,
}

impl Program {
    /// Loads `lb_xdp` on the maps pinned under `bpffs`, opening at most
    /// `limits` written into it.
    pub(super) fn load(bpffs: &Path, limits: XdpLimits) -> anyhow::Result<Self> {
        let (mut ebpf, _) = load_object(on_pinned_maps(bpffs), false)
            .context("loading the eBPF object on the pinned maps")?;
        write_limits(&mut ebpf, limits)?;
        let program = xdp_program(&mut ebpf)?;
        load_retrying(|| program.load()).with_context(|| format!("loading {}", programs::XDP))?;
        Ok(Self { ebpf })
    }

    /// Attaches the program to `interface`, natively where its driver can
    /// and generically otherwise, and pins the link. Returns the mode.
    pub(super) fn attach(&mut self, bpffs: &Path, interface: &str) -> anyhow::Result<Mode> {
        let program = xdp_program(&mut self.ebpf)?;
        let (id, mode) = match program.attach(interface, XdpMode::Driver) {
            Ok(id) => (id, Mode::Native),
            Err(native) => match program.attach(interface, XdpMode::Skb) {
                Ok(id) => {
                    tracing::warn!(
                        interface,
                        "the driver cannot run XDP natively ({native}); attached in generic mode, which is slower"
                    );
                    (id, Mode::Generic)
                }
                Err(e) => return Err(explain(e, interface)),
            },
        };
        let link: FdLink = program
            .take_link(id)?
            .try_into()
            .context("this kernel attached XDP without a bpf_link (Linux 5.9+ needed)")?;
        let dir = mode.dir(bpffs);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(interface);
        link.pin(&path).with_context(|| format!("pinning link {}", path.display()))?;
        Ok(mode)
    }
}

/// Why the XDP link pinned for `interface` (in `mode`) no longer runs
/// lb's program on the interface of that name, if it does not: the
/// interface went away, or was renamed (the link follows the device, not
/// the name), or is a new one under the old name (the old device's link
/// is defunct).
pub(super) fn stale(bpffs: &Path, interface: &str, mode: Mode) -> Option<String> {
    let path = mode.dir(bpffs).join(interface);
    let link = match PinnedLink::from_pin(&path) {
        Ok(link) => FdLink::from(link),
        Err(e) => return Some(format!("its pinned link cannot be opened: {e}")),
    };
    let program = match link.info() {
        Ok(info) => info.program_id(),
        Err(e) => return Some(format!("its pinned link cannot be read: {e}")),
    };
    match crate::interfaces::xdp_program_id(interface) {
        Ok(Some(id)) if id == program => None,
        Ok(Some(id)) => Some(format!("it runs another XDP program (id {id})")),
        Ok(None) => Some("it runs no XDP program".to_owned()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Some("it is gone".to_owned()),
        // Unknown: trusted, as before.
        Err(_) => None,
    }
}

/// The pinned link of `interface`'s XDP program removed: the program
/// detaches from it.
pub(super) fn release(bpffs: &Path, interface: &str) -> anyhow::Result<()> {
    for mode in Mode::ALL {
        let path = mode.dir(bpffs).join(interface);
        if path.exists() {
            PinnedLink::from_pin(&path)
                .with_context(|| format!("opening pinned link {}", path.display()))?
                .unpin()
                .with_context(|| format!("unpinning {}", path.display()))?;
        }
    }
    Ok(())
}

/// Points every pinned XDP link at `ebpf`'s `lb_xdp` (loaded here), one
/// `BPF_LINK_UPDATE` each: a packet meets the old program or the new one.
pub(super) fn replace(ebpf: &mut Ebpf, bpffs: &Path) -> anyhow::Result<()> {
    let attached = attachments(bpffs);
    if attached.is_empty() {
        return Ok(());
    }
    let program = xdp_program(ebpf)?;
    load_retrying(|| program.load()).with_context(|| format!("loading {}", programs::XDP))?;
    let program = program.fd().with_context(|| format!("program {}", programs::XDP))?;
    for (interface, mode) in attached {
        let link = mode.dir(bpffs).join(&interface);
        let link_fd = bpf_obj_get(&link)
            .with_context(|| format!("opening pinned link {}", link.display()))?;
        let Err(e) = bpf_link_update(link_fd.as_fd(), program.as_fd()) else { continue };
        // The link of an interface that went away while no daemon ran
        // cannot be updated: it goes, and the next sync attaches anew.
        if let Some(why) = stale(bpffs, &interface, mode) {
            tracing::warn!(
                interface,
                "the XDP link pinned for this interface is stale ({why}): removing it"
            );
            release(bpffs, &interface)?;
            continue;
        }
        return Err(e).with_context(|| {
            format!("updating link {} to the new {}", link.display(), programs::XDP)
        });
    }
    Ok(())
}

/// A loader that reuses every map pinned under `bpffs`.
pub(super) fn on_pinned_maps(bpffs: &Path) -> EbpfLoader<'static> {
    let mut loader = EbpfLoader::new();
    for name in maps::ALL {
        loader.map_pin_path(name, maps_dir(bpffs).join(name));
    }
    loader
}

fn xdp_program(ebpf: &mut Ebpf) -> anyhow::Result<&mut Xdp> {
    let program = ebpf
        .program_mut(programs::XDP)
        .with_context(|| format!("program {} missing from the eBPF object", programs::XDP))?;
    Ok(program.try_into()?)
}

/// An attach error, with what an operator can do about the usual ones.
fn explain(error: ProgramError, interface: &str) -> anyhow::Error {
    let busy = matches!(&error, ProgramError::SyscallError(e) if e.io_error.raw_os_error() == Some(libc::EBUSY));
    let unknown = matches!(error, ProgramError::UnknownInterface { .. });
    let hint = if busy {
        ": another XDP program is attached there (see `ip link show dev IFACE`); lb does not replace it"
    } else if unknown {
        ": no such interface in lb's network namespace"
    } else {
        ""
    };
    anyhow::Error::new(io::Error::other(format!("{error}{hint}")))
        .context(format!("attaching {} to {interface}", programs::XDP))
}
