//! An XDP program that passes every packet, attached natively to a veth:
//! a veth delivers frames that XDP redirects into it only when its
//! receiving end runs NAPI, which an XDP program of its own gives it (as
//! Cilium's l4lb test does). Two instructions (`r0 = XDP_PASS; exit`)
//! loaded with `BPF_PROG_LOAD` and attached with `BPF_LINK_CREATE`
//! (Linux 5.9+): loading lb's own `lb_xdp` for this took the verifier
//! seconds per veth, minutes of a guest's software emulation per run.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
/// `XDP_FLAGS_DRV_MODE`: in the driver (veths have native XDP).
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
const XDP_PASS: i32 = 2;

/// The program, attached: detached when dropped (its link's last file
/// descriptor closes).
pub struct PassThrough {
    _link: OwnedFd,
    _program: OwnedFd,
}

/// One BPF instruction (`struct bpf_insn`).
#[repr(C)]
struct Insn {
    code: u8,
    /// `dst_reg` in the low four bits, `src_reg` in the high.
    regs: u8,
    off: i16,
    imm: i32,
}

/// The start of `union bpf_attr` as `BPF_PROG_LOAD` reads it.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
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
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// The start of `union bpf_attr` as `BPF_LINK_CREATE` reads it.
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

/// `bpf(cmd, attr)`: the file descriptor it returns.
fn bpf<T>(cmd: libc::c_long, attr: &T) -> std::io::Result<OwnedFd> {
    // SAFETY: `attr` is a valid prefix of `union bpf_attr` for `cmd`, its
    // pointers valid for the call; the kernel reads `size_of::<T>()` bytes.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_ref(attr), size_of::<T>()) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new file descriptor the kernel just returned, owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Attaches a program that passes every packet to `dev`, natively.
pub fn pass_through(dev: &str) -> PassThrough {
    let insns = [
        // r0 = XDP_PASS
        Insn { code: 0xb7, regs: 0, off: 0, imm: XDP_PASS },
        // exit
        Insn { code: 0x95, regs: 0, off: 0, imm: 0 },
    ];
    let license = c"GPL";
    let load = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_XDP,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        expected_attach_type: BPF_XDP,
        ..ProgLoadAttr::default()
    };
    let program = bpf(BPF_PROG_LOAD, &load).expect("loading the pass-through XDP program");
    let name = std::ffi::CString::new(dev).expect("an interface name");
    // SAFETY: a valid C string.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert_ne!(ifindex, 0, "no interface {dev}");
    let link = LinkCreateAttr {
        prog_fd: program.as_raw_fd() as u32,
        target_ifindex: ifindex,
        attach_type: BPF_XDP,
        flags: XDP_FLAGS_DRV_MODE,
    };
    let link = bpf(BPF_LINK_CREATE, &link).unwrap_or_else(|e| panic!("attaching to {dev}: {e}"));
    PassThrough { _link: link, _program: program }
}
