//! The eBPF object this lb carries (built by `build.rs` from `lb-ebpf`)
//! and its loading: the kernel's log level, the log reader, one program
//! verified by the type its name says. Attach and upgrade both load
//! through here.

use anyhow::{Context as _, bail};
use aya::{
    Ebpf, EbpfLoader,
    programs::{CgroupSock, CgroupSockAddr, SockOps},
};
use lb_common::programs;

/// Forwards the kernel programs' aya-log records to `log` (and so to tracing).
pub type KernelLogger = aya_log::EbpfLogger<&'static dyn log::Log>;

/// The eBPF object, built by `build.rs` from `lb-ebpf`.
pub(super) static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb"));

/// The kernel's log level for the programs (aya-log): every statement on
/// with `--bpf-log`, none without (each is then a no-op).
const LOG_ALL: u8 = 0xff;
const LOG_NONE: u8 = 0;

/// Loads the embedded eBPF object with `loader` (which may reuse pinned
/// maps), its log level set from `bpf_log`, and sets up the reader of its
/// log when `bpf_log` is on.
pub(super) fn load_object(
    mut loader: EbpfLoader<'_>,
    bpf_log: bool,
) -> anyhow::Result<(Ebpf, Option<KernelLogger>)> {
    if EBPF_OBJECT.is_empty() {
        bail!(
            "this lb was built with AYA_BUILD_SKIP=1 and carries no eBPF programs; rebuild without it"
        );
    }
    loader.override_global("AYA_LOG_LEVEL", if bpf_log { &LOG_ALL } else { &LOG_NONE }, false);
    let mut ebpf = loader
        .load(EBPF_OBJECT)
        .context("loading the eBPF object (is this kernel 5.10 or newer, with BTF?)")?;
    let logger = if bpf_log {
        Some(aya_log::EbpfLogger::init(&mut ebpf).context("setting up --bpf-log")?)
    } else {
        None
    };
    Ok((ebpf, logger))
}

/// Loads (verifies) program `name` of `ebpf`, of the type its name says.
pub(super) fn load_program(ebpf: &mut Ebpf, name: &str) -> anyhow::Result<()> {
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
