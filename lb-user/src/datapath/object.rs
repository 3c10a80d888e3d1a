//! The eBPF object this lb carries (built by `build.rs` from `lb-ebpf`)
//! and its loading: the kernel's log level, the log reader, one program
//! verified by the type its name says, the settings written into it.
//! Attach and upgrade both load through here.

use anyhow::{Context as _, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{CgroupSock, CgroupSockAddr, ProgramError, SockOps},
};
use lb_common::{
    ANSWERS_PER_CPU, LIMIT_ANSWERS, LIMIT_NAT_PORT_FIRST, LIMIT_NAT_PORT_LAST, LIMIT_NEW_FLOWS,
    maps, programs,
};

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

/// The `[daemon]` settings `lb_xdp` is loaded with: written into its
/// kernel-only `LIMITS` map, they go with the programs. Zeros are the
/// kernel's defaults (no limit; `lb_common::NAT_PORT_FIRST` to 65535).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XdpLimits {
    /// New external flows per CPU per second, at most (`new_flows_per_cpu`;
    /// 0: no limit).
    pub new_flows_per_cpu: u32,
    /// The NAT ports, first and last (`nat_ports`).
    pub nat_ports: (u16, u16),
}

/// Writes `limits` (and `lb_common::ANSWERS_PER_CPU`) into a loaded
/// object's `LIMITS`, before any of its programs runs.
pub(super) fn write_limits(ebpf: &mut Ebpf, limits: XdpLimits) -> anyhow::Result<()> {
    let array = ebpf
        .map_mut(maps::LIMITS)
        .with_context(|| format!("map {} missing from the eBPF object", maps::LIMITS))?;
    let mut array = Array::<_, u32>::try_from(array)
        .with_context(|| format!("map {} has an unexpected type or size", maps::LIMITS))?;
    for (slot, value) in [
        (LIMIT_NEW_FLOWS, limits.new_flows_per_cpu),
        (LIMIT_ANSWERS, ANSWERS_PER_CPU),
        (LIMIT_NAT_PORT_FIRST, u32::from(limits.nat_ports.0)),
        (LIMIT_NAT_PORT_LAST, u32::from(limits.nat_ports.1)),
    ] {
        array.set(slot, value, 0).with_context(|| format!("writing map {}", maps::LIMITS))?;
    }
    Ok(())
}

/// Times a program's load is tried while signals interrupt the verifier.
const LOAD_ATTEMPTS: usize = 5;

/// Runs `load` (a program's `BPF_PROG_LOAD`) again while the kernel says
/// EAGAIN: a signal that arrives while the verifier works interrupts it
/// (Linux 4.20+), and the daemon gets signals (a reload's SIGHUP, its
/// checks' child processes ending), as do the tests. `lb_xdp` takes the
/// verifier long enough for that to happen: the tests saw it.
pub(super) fn load_retrying(
    mut load: impl FnMut() -> Result<(), ProgramError>,
) -> Result<(), ProgramError> {
    let mut attempts = 1;
    loop {
        match load() {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && attempts < LOAD_ATTEMPTS =>
            {
                attempts += 1;
            }
            done => return done,
        }
    }
}

/// Loads (verifies) program `name` of `ebpf`, of the type its name says.
pub(super) fn load_program(ebpf: &mut Ebpf, name: &str) -> anyhow::Result<()> {
    let program = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?;
    let loaded = if name == programs::SOCK_OPS {
        let program = <&mut SockOps>::try_from(program)?;
        load_retrying(|| program.load())
    } else if name == programs::SOCK_RELEASE {
        let program = <&mut CgroupSock>::try_from(program)?;
        load_retrying(|| program.load())
    } else {
        let program = <&mut CgroupSockAddr>::try_from(program)?;
        load_retrying(|| program.load())
    };
    loaded.with_context(|| format!("loading {name}"))
}
