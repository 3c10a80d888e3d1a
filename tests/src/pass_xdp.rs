//! The smallest XDP program, which passes every packet, loaded and
//! attached with raw `bpf(2)` calls: what a veth's peer needs to take the
//! frames `lb_xdp` redirects to it (NAPI), and what a test puts on an
//! interface as another program would be. `lb_xdp` on empty maps of its
//! own passes every packet too, but the verifier takes seconds over it
//! under a guest's software emulation, and every topology needs two.

use std::{
    ffi::CString,
    os::fd::{FromRawFd as _, OwnedFd},
};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_XDP: u32 = 6;
/// `enum bpf_attach_type`'s `BPF_XDP`.
const BPF_XDP: u32 = 37;
const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// `r0 = XDP_PASS (2); exit`, as `struct bpf_insn`s: opcode, registers,
/// offset, immediate, little-endian.
const PASS: [u64; 2] = [0xb7 | (2 << 32), 0x95];

/// `union bpf_attr` as `BPF_PROG_LOAD` reads it; the kernel takes the
/// zeroed rest as absent.
#[repr(C)]
#[derive(Default)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    rest: [u64; 8],
}

/// `union bpf_attr` as `BPF_LINK_CREATE` reads it.
#[repr(C)]
#[derive(Default)]
struct LinkCreate {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
    rest: [u64; 6],
}

/// The pass-through program attached to an interface; detached when
/// dropped (the link is closed).
pub struct PassThrough {
    _link: OwnedFd,
}

/// Attaches a program that passes every packet to `dev`, in the calling
/// thread's network namespace: natively, or in generic mode (`generic`),
/// where a second program cannot attach natively either.
pub fn attach_pass_through(dev: &str, generic: bool) -> PassThrough {
    // Linux before 5.11 charges a program's memory to RLIMIT_MEMLOCK and
    // refuses the load (EPERM) past it; aya lifts it for lb's own loads.
    let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: a valid rlimit; the tests run as root, which may raise it.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) };
    let license = CString::new("GPL").unwrap();
    let mut name = [0u8; 16];
    name[..8].copy_from_slice(b"lb_tpass");
    let load = ProgLoad {
        prog_type: BPF_PROG_TYPE_XDP,
        insn_cnt: PASS.len() as u32,
        insns: PASS.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_name: name,
        ..ProgLoad::default()
    };
    let program = bpf(BPF_PROG_LOAD, &load).unwrap_or_else(|e| panic!("loading XDP_PASS: {e}"));
    let ifname = CString::new(dev).unwrap();
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(ifname.as_ptr()) };
    assert_ne!(ifindex, 0, "no interface {dev}");
    let create = LinkCreate {
        prog_fd: std::os::fd::AsRawFd::as_raw_fd(&program) as u32,
        target_ifindex: ifindex,
        attach_type: BPF_XDP,
        flags: if generic { XDP_FLAGS_SKB_MODE } else { XDP_FLAGS_DRV_MODE },
        ..LinkCreate::default()
    };
    let link = bpf(BPF_LINK_CREATE, &create)
        .unwrap_or_else(|e| panic!("attaching XDP_PASS to {dev}: {e}"));
    // The link holds the program.
    PassThrough { _link: link }
}

/// `bpf(cmd, attr)`: the file descriptor it returns.
fn bpf<T>(cmd: libc::c_long, attr: &T) -> std::io::Result<OwnedFd> {
    // SAFETY: `attr` is a `union bpf_attr` prefix of its size, zero past
    // the fields the command reads; the pointers in it outlive the call.
    let fd = unsafe {
        libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_ref(attr), size_of::<T>() as libc::c_uint)
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
