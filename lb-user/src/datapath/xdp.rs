//! The external path's XDP program (`lb_xdp`) as userspace loads it.
//!
//! [`load_unattached`] loads it on fresh, unpinned maps, attached nowhere:
//! for the packet fixtures (`tests/xdp_fixtures.rs`), which run it with
//! `BPF_PROG_TEST_RUN`, and the benchmark of its program time.

use anyhow::Context as _;
use aya::{Ebpf, EbpfLoader, programs::Xdp};
use lb_common::programs;

use super::object::load_object;

/// The eBPF object with `lb_xdp` loaded (verified) on maps of its own,
/// pinned and attached nowhere: the caller fills the maps and runs the
/// program with `BPF_PROG_TEST_RUN` (`aya::programs::TestRun`).
pub fn load_unattached() -> anyhow::Result<Ebpf> {
    let (mut ebpf, _) = load_object(EbpfLoader::new(), false)?;
    let program: &mut Xdp = ebpf
        .program_mut(programs::XDP)
        .with_context(|| format!("program {} missing from the eBPF object", programs::XDP))?
        .try_into()?;
    program.load().with_context(|| format!("loading {}", programs::XDP))?;
    Ok(ebpf)
}
