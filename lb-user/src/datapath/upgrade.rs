//! The `META` map (the pins' layout version and the attached programs'
//! fingerprint) and upgrades: programs of another lb replaced in place on
//! the pinned maps, one `BPF_LINK_UPDATE` per link; pins of the previous
//! layout get the maps and programs it lacked.

use std::{
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use aya::{
    Ebpf,
    maps::{Array, MapData},
};
use lb_common::{
    LAYOUT_VERSION, MARK_SLOTS, MARKED_UNKNOWN, META_LAYOUT_VERSION, META_PROGRAMS_HIGH,
    META_PROGRAMS_LOW, UNMARKED_KERNEL, UNMARKED_REPLACED, UPGRADABLE_LAYOUT, VIP_PORT_WORDS, maps,
    programs,
};

use super::{
    attach_one,
    object::{EBPF_OBJECT, KernelLogger, XdpLimits, load_object, load_program, write_limits},
    pins::{links_dir, maps_dir, open_pinned_map},
    sys::{bpf_link_update, bpf_obj_get, pinned_link_ids},
    xdp::{self, on_pinned_maps},
};

/// Writes this lb's layout version and programs' fingerprint into the
/// `META` map of a freshly loaded object, before anything is pinned: no pin
/// set of this layout is ever without them.
pub(super) fn stamp_meta(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let meta = ebpf.map_mut(maps::META).context("map META missing from the eBPF object")?;
    let mut meta: Array<&mut MapData, u32> = Array::try_from(meta).context("map META")?;
    meta.set(META_LAYOUT_VERSION, LAYOUT_VERSION, 0)
        .context("writing the layout version to META")?;
    let fingerprint = programs_fingerprint();
    meta.set(META_PROGRAMS_LOW, fingerprint as u32, 0)
        .context("writing the programs' fingerprint to META")?;
    meta.set(META_PROGRAMS_HIGH, (fingerprint >> 32) as u32, 0)
        .context("writing the programs' fingerprint to META")?;
    Ok(())
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

/// Loads this lb's programs on the maps pinned under `bpffs` (reused; a
/// map the pins lack, new in this layout, is created and pinned) and
/// points every pinned link at them, one `BPF_LINK_UPDATE` each: the
/// cgroup's program is swapped in place, so each connect runs either the
/// old program or the new one. All programs are loaded before the first
/// link moves, so a kernel that refuses one leaves all the old ones in
/// place. Only the programs whose links are pinned are replaced (the
/// optional getpeername hooks may be absent); then the programs new in
/// this layout are attached to `cgroup` if their links are missing, and
/// the pins are stamped with this layout. The maps pins of the previous
/// layout lack (`lb_common::maps::NEW_IN_LAYOUT`) are made and pinned by
/// the load.
pub(super) fn replace_programs(
    bpffs: &Path,
    cgroup: &Path,
    bpf_log: bool,
    limits: XdpLimits,
) -> anyhow::Result<Option<KernelLogger>> {
    // The pinned maps are of this layout or the previous one: checked before.
    let vip_ports_made = !maps_dir(bpffs).join(maps::VIP_PORTS).exists();
    let loader = on_pinned_maps(bpffs);
    let (mut ebpf, logger) =
        load_object(loader, bpf_log).context("loading the eBPF object on the pinned maps")?;
    if vip_ports_made {
        every_port_maybe_a_vips(&mut ebpf)?;
    }
    // The sockets the running programs track carry no mark of these
    // programs (a connect may also run connect4 under the old programs and
    // its sock_ops under the new ones; with TCP Fast Open, the first send
    // is that much later): the new programs look every connecting socket
    // up, as on a kernel that refuses the mark, and find a connect that ran
    // the old connect4 in `SOCKETS`. Until the next fresh attach.
    let unmarked = ebpf
        .map_mut(maps::UNMARKED)
        .with_context(|| format!("map {} missing from the eBPF object", maps::UNMARKED))?;
    Array::<_, u32>::try_from(unmarked)
        .and_then(|mut unmarked| {
            unmarked.set(UNMARKED_KERNEL, 1, 0)?;
            unmarked.set(UNMARKED_REPLACED, 1, 0)
        })
        .with_context(|| format!("writing map {}", maps::UNMARKED))?;
    forget_marks(&mut ebpf)?;
    write_limits(&mut ebpf, limits)?;
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
    xdp::replace(&mut ebpf, bpffs)?;
    // A running program may have marked a server between the first
    // `forget_marks` and its replacement.
    forget_marks(&mut ebpf)?;
    let missing: Vec<&str> =
        programs::NEW_IN_LAYOUT.into_iter().filter(|p| !links.join(p).exists()).collect();
    if !missing.is_empty() {
        let cgroup_dir = std::fs::File::open(cgroup)
            .with_context(|| format!("opening cgroup {}", cgroup.display()))?;
        for name in missing {
            attach_one(&mut ebpf, name, &cgroup_dir, cgroup, &links)?;
        }
    }
    let mut meta = pinned_meta(bpffs)?
        .with_context(|| format!("no META map pinned under {}", bpffs.display()))?;
    meta.set(META_LAYOUT_VERSION, LAYOUT_VERSION, 0)
        .with_context(|| format!("writing the layout version under {}", bpffs.display()))?;
    Ok(logger)
}

/// Sets every bit of `VIP_PORTS`, made empty by this load (pins of
/// layout 10 lack it): the new `lb_xdp` looks a packet up among the
/// external VIPs, their established flows and the replies of flows that
/// keep the client's address only if its port is there, so until the
/// daemon writes the VIPs' ports (its next sync, after the programs are
/// replaced) every port must be. Set, a bit costs only a lookup.
fn every_port_maybe_a_vips(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let ports = ebpf
        .map_mut(maps::VIP_PORTS)
        .with_context(|| format!("map {} missing from the eBPF object", maps::VIP_PORTS))?;
    let mut ports = Array::<_, u64>::try_from(ports)
        .with_context(|| format!("map {} has an unexpected type or size", maps::VIP_PORTS))?;
    for word in 0..VIP_PORT_WORDS {
        ports.set(word, u64::MAX, 0).with_context(|| format!("writing map {}", maps::VIP_PORTS))?;
    }
    Ok(())
}

/// Fills `MARKED_AT` with `MARKED_UNKNOWN`: the running programs, if of
/// layout 7, mark servers in `FAILED_AT` without stamping it, and the new
/// programs must look each flow's server up until a hold-down has passed
/// (`select::unmarked_lately` in lb-ebpf). Programs of this layout do
/// stamp it; filling it after them only costs those lookups.
fn forget_marks(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let marked = ebpf
        .map_mut(maps::MARKED_AT)
        .with_context(|| format!("map {} missing from the eBPF object", maps::MARKED_AT))?;
    let mut marked = Array::<_, u64>::try_from(marked)
        .with_context(|| format!("map {} has an unexpected type or size", maps::MARKED_AT))?;
    for slot in 0..MARK_SLOTS {
        marked
            .set(slot, MARKED_UNKNOWN, 0)
            .with_context(|| format!("writing map {}", maps::MARKED_AT))?;
    }
    Ok(())
}

/// Whether the pins under `bpffs`, of layout `found`, are of the layout a
/// daemon upgrades when it adopts them ([`replace_programs`]); an error
/// (as [`check_layout`]'s) if they are of neither that nor this one.
pub(super) fn needs_upgrade(bpffs: &Path, found: Option<u32>) -> anyhow::Result<bool> {
    if found == Some(UPGRADABLE_LAYOUT) {
        return Ok(true);
    }
    check_layout(bpffs, found)?;
    Ok(false)
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

/// Refuses pins of another layout than this lb's, saying what to run.
pub(super) fn check_layout(bpffs: &Path, found: Option<u32>) -> anyhow::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_daemon_upgrades_pins_of_the_previous_layout_only() {
        let bpffs = Path::new("/sys/fs/bpf/lb");
        assert!(!needs_upgrade(bpffs, Some(LAYOUT_VERSION)).unwrap());
        assert!(needs_upgrade(bpffs, Some(UPGRADABLE_LAYOUT)).unwrap());
        for found in [None, Some(UPGRADABLE_LAYOUT - 1), Some(LAYOUT_VERSION + 1)] {
            let error = format!("{:#}", needs_upgrade(bpffs, found).unwrap_err());
            assert!(error.contains("`lb detach"), "{error}");
        }
    }
}
