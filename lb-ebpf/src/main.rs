//! The kernel half of `lb`: rewrite connects to a VIP to a chosen server, in
//! the kernel, and report what became of them.
//!
//! - `lb_connect4` / `lb_connect6` (cgroup/connect4, cgroup/connect6): if the
//!   destination is a VIP, pick a server from the service's selection
//!   (`lb_common::choose`, tested on the host) and rewrite the destination.
//!   Record a TCP socket's choice in `CONNECTING` and mark it for sock_ops
//!   (`mark_tracked`); track a UDP one in `SOCKETS_UDP`.
//! - `lb_getpeername4` / `lb_getpeername6`: a tracked socket reports the VIP
//!   as its peer, so the application sees the address it dialled.
//! - `lb_sock_ops` (its callbacks are in `sock_ops.rs`): when a recorded
//!   connect sends its SYN (to the server connect4 chose), track it in
//!   `SOCKETS`; for tracked TCP sockets, count live connections per (VIP,
//!   server), mark a server failed the moment the server refuses a connect
//!   or leaves its SYN unanswered, and tell the daemon through the `EVENTS`
//!   ring buffer when a connect establishes, fails or times out (a close is
//!   only counted).
//! - `lb_sock_release` (cgroup sock_release): a released socket leaves the
//!   socket tables: connected UDP at once; TCP that never sent its SYN (a
//!   connect that failed on the spot, a Fast Open connect closed before its
//!   first write) at once; TCP that never established is marked released
//!   (the application gave up on the connect), so that its close untracks
//!   it as no server failure. Established TCP stays tracked until sock_ops
//!   sees it close.
//!
//! The programs are dumb and fast: the daemon decides the selection; the
//! kernel only skips servers whose connect failed within the hold-down.
//! Each entry point is thin; every early return is counted in `COUNTERS`.
#![no_std]
// Built for the BPF target by lb-user's build script; on the host (e.g.
// `cargo test --workspace`) it compiles to an empty program.
#![cfg_attr(target_arch = "bpf", no_main)]
// `asm!` for the BPF target (`atomic_add`); the eBPF build is on nightly.
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

mod sock_ops;

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_ANY, BPF_F_NO_PREALLOC, BPF_SOCK_OPS_RTO_CB_FLAG},
    helpers::{
        bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_getsockopt,
        bpf_ktime_get_ns, bpf_setsockopt,
    },
    macros::{cgroup_sock, cgroup_sock_addr, map, sock_ops},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{SockAddrContext, SockContext, SockOpsContext},
};
use aya_log_ebpf::debug;
use lb_common::{
    ConnKey, EVENTS_BYTES, Endpoint, MAX_CONNECTING_SOCKETS, MAX_FAILED_SERVERS, MAX_SERVER_PAIRS,
    MAX_SERVERS, MAX_SERVICES, MAX_TRACKED_SOCKETS, MAX_TRACKED_UDP_SOCKETS, META_SLOTS, NETNS_ANY,
    NETNS_INITIAL, Reason, SOCK_CONNECT_PENDING, Service, SockEntry, UNMARKED_KERNEL,
    UNMARKED_SLOTS,
    choose::{Choice, choose_from_mask, usable_mask},
};

/// VIP → service (its selection). Written only by the daemon, one whole
/// value per update.
///
/// Not preallocated: in a preallocated hash map an update puts the value it
/// replaces back on the CPU's free list at once, and the next update (of
/// any VIP) may overwrite it while connect4 on another CPU still reads it,
/// so a connect could read another VIP's servers. Without preallocation
/// the replaced value is freed only after an RCU grace period, when no
/// program can still hold it: every read is of one whole value.
#[map]
static SERVICES: HashMap<Endpoint, Service> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// Server → `bpf_ktime_get_ns()` of the last connect to it that failed
/// before establishing. Written by `sock_ops`, cleared on an established
/// connect; read by connect4/6 to skip servers within the hold-down.
#[map]
static FAILED_AT: HashMap<Endpoint, u64> = HashMap::with_max_entries(MAX_FAILED_SERVERS, 0);

/// Socket cookie → the VIP and server of a TCP connect through a VIP whose
/// SYN went out (moved here from `CONNECTING` by `on_connect`). A plain
/// hash map, not an LRU: nothing is evicted behind anyone's back. An entry
/// leaves when sock_ops sees the socket close, or at release if it never
/// established (`lb_sock_release`); a full table is counted
/// (`connect_untracked`).
#[map]
static SOCKETS: HashMap<u64, SockEntry> = HashMap::with_max_entries(MAX_TRACKED_SOCKETS, 0);

/// Socket cookie → the choice connect4 made for a TCP socket, until its SYN
/// goes (`on_connect`). Apart from `SOCKETS` because a connect can fail on
/// the spot after connect4 ran (a taken 4-tuple: `EADDRNOTAVAIL`; an
/// IPv6-only socket dialling an IPv4 VIP: `ENETUNREACH`): no callback ever
/// comes for it, and any process could hold thousands of such sockets
/// open. Here they cannot fill the table of real connections, and the LRU
/// evicts them; a socket that connects again elsewhere is not taken for
/// the VIP's (`on_connect` checks where the SYN goes). Kernel-only.
#[map]
static CONNECTING: LruHashMap<u64, SockEntry> =
    LruHashMap::with_max_entries(MAX_CONNECTING_SOCKETS, 0);

/// As `SOCKETS`, for connected UDP sockets: apart, so that a churn of UDP
/// sockets never competes with TCP connections for a slot. An entry leaves
/// when its socket is released (no TCP callbacks fire for UDP).
#[map]
static SOCKETS_UDP: HashMap<u64, SockEntry> = HashMap::with_max_entries(MAX_TRACKED_UDP_SOCKETS, 0);

/// (VIP, server) → live established connections, per CPU (sum them).
#[map]
static CONNECTIONS: PerCpuHashMap<ConnKey, i64> =
    PerCpuHashMap::with_max_entries(MAX_SERVER_PAIRS, 0);

/// `Event`s for the daemon: a connect established, failed or timed out.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);

/// One word per CPU for `unknown_to_verifier`; kernel-only, never pinned.
#[map]
static SCRATCH: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Two flags (`lb_common::UNMARKED_KERNEL`, `UNMARKED_REPLACED`): this
/// kernel does not let connect4 mark the sockets it records
/// (`mark_tracked`, Linux 6.12+), so sock_ops looks every connecting socket
/// up; these programs replaced running ones, so a connect may have its
/// entry in `SOCKETS` already. Kernel-only, never pinned.
#[map]
static UNMARKED: Array<u32> = Array::with_max_entries(UNMARKED_SLOTS, 0);

/// Per-CPU counters of every decision, indexed by `lb_common::Reason`.
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Reason::COUNT as u32, 0);

/// The pinned maps' layout version (`lb_common::LAYOUT_VERSION`), written by
/// the daemon at attach and checked before it adopts pins. The programs
/// never read it.
#[map]
static META: Array<u32> = Array::with_max_entries(META_SLOTS, 0);

const AF_INET: u32 = 2;
const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;

/// `E2BIG`: a hash map update failed because the map is full.
const E2BIG: i32 = 7;

/// `bpf_setsockopt` level and option for a TCP socket's sock_ops callback
/// flags (`include/uapi/linux/bpf.h`, Linux 6.12+).
const SOL_TCP: i32 = 6;
const TCP_BPF_SOCK_OPS_CB_FLAGS: i32 = 1008;

/// TCP states as `bpf_sock::state` holds them (`include/net/tcp_states.h`).
const TCP_SYN_SENT: u32 = 2;
const TCP_CLOSE: u32 = 7;

/// Verdicts of cgroup sock_addr programs.
const ALLOW: i32 = 1;
const REFUSE: i32 = 0;

#[inline(always)]
fn count(reason: Reason) {
    if let Some(counter) = COUNTERS.get_ptr_mut(reason.index()) {
        // SAFETY: a u64 map value, valid for the whole program run.
        unsafe { atomic_add(counter, 1) };
    }
}

/// Adds `delta` to the u64 at `value`, a per-CPU map value, atomically. A
/// per-CPU slot is not a program's own: a cgroup program runs with
/// migration disabled but can be preempted (by a program for another
/// socket, in process context) or interrupted (by sock_ops in softirq) on
/// its CPU, and a plain read-modify-write would then lose one of the two
/// increments.
///
/// One BPF atomic add without fetch (`BPF_XADD`), which every kernel lb
/// supports. Written out: the BPF target has no atomic read-modify-write
/// in `core` (it has no compare-and-swap before CPU v3), and the
/// compiler's intrinsic is unstable in name and shape.
///
/// # Safety
/// `value` is a valid, 8-byte aligned map value for the whole program run.
#[inline(always)]
unsafe fn atomic_add(value: *mut u64, delta: u64) {
    // SAFETY: the caller's; the instruction touches only those 8 bytes.
    unsafe {
        core::arch::asm!(
            "lock *(u64 *)({value} + 0) += {delta}",
            value = in(reg) value,
            delta = in(reg) delta,
            options(nostack),
        );
    }
}

// `bpf_sock_addr` fields must be read and written as whole, volatile 4-byte
// accesses: the verifier rejects narrower or merged loads and stores of the
// context, which the compiler would otherwise be free to emit.
macro_rules! ctx_read {
    ($ctx:expr, $($field:tt)+) => {
        // SAFETY: the context pointer is valid for the whole program run.
        unsafe { core::ptr::read_volatile(&raw const (*$ctx.sock_addr).$($field)+) }
    };
}
macro_rules! ctx_write {
    ($ctx:expr, $value:expr, $($field:tt)+) => {
        // SAFETY: as in `ctx_read`; these fields are writable in connect and
        // getpeername programs.
        unsafe { core::ptr::write_volatile(&raw mut (*$ctx.sock_addr).$($field)+, $value) }
    };
}

fn read_ip6(ctx: &SockAddrContext) -> [u32; 4] {
    [
        ctx_read!(ctx, user_ip6[0]),
        ctx_read!(ctx, user_ip6[1]),
        ctx_read!(ctx, user_ip6[2]),
        ctx_read!(ctx, user_ip6[3]),
    ]
}

fn write_ip6(ctx: &SockAddrContext, addr: &[u32; 4]) {
    ctx_write!(ctx, addr[0], user_ip6[0]);
    ctx_write!(ctx, addr[1], user_ip6[1]);
    ctx_write!(ctx, addr[2], user_ip6[2]);
    ctx_write!(ctx, addr[3], user_ip6[3]);
}

/// `user_port` holds the port in network byte order in its low 16 bits.
fn read_port(ctx: &SockAddrContext) -> u16 {
    ctx_read!(ctx, user_port) as u16
}

fn write_port(ctx: &SockAddrContext, port_be: u16) {
    ctx_write!(ctx, u32::from(port_be), user_port);
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    let dst = Endpoint::from_v4_raw(ctx_read!(ctx, user_ip4), read_port(&ctx));
    match try_connect(&ctx, &dst, true) {
        Ok(None) => ALLOW,
        Ok(Some(server)) => {
            // `try_connect` returns only IPv4 servers to an IPv4 socket.
            ctx_write!(ctx, server.addr[3], user_ip4);
            write_port(&ctx, server.port);
            ALLOW
        }
        Err(Refuse) => REFUSE,
    }
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    // An IPv4-mapped destination arrives here in mapped form and finds the
    // IPv4 VIP's entry, because the map stores IPv4 mapped too.
    let dst = Endpoint { addr: read_ip6(&ctx), port: read_port(&ctx), _pad: [0; 2] };
    match try_connect(&ctx, &dst, false) {
        Ok(None) => ALLOW,
        Ok(Some(server)) => {
            write_ip6(&ctx, &server.addr);
            write_port(&ctx, server.port);
            ALLOW
        }
        Err(Refuse) => REFUSE,
    }
}

/// The connect must fail (EPERM): its VIP's service has no server.
struct Refuse;

// `try_connect` masks a server index with `MAX_SERVERS - 1`.
const _: () = assert!(MAX_SERVERS.is_power_of_two());

/// `value`, read back from map memory, so that the verifier no longer knows
/// it; `None` only if the per-CPU slot is missing, which cannot happen.
///
/// Verifier workaround: `usable_mask` is built on up to 2^16 paths (one
/// branch per server), each with its own constant mask. The choice then
/// indexes `servers` with a value computed from the mask, and the verifier
/// marks every value that flows into a pointer offset as precise, back
/// through all the arithmetic to the mask; paths with different precise
/// masks never merge, and it would verify the rest of the program once per
/// mask, far beyond its limit of a million instructions. A value loaded
/// from a map is unknown to the verifier and ends that chain, so the paths
/// merge right here. Arithmetic or the stack cannot do this: the verifier
/// tracks values through both.
#[inline(always)]
fn unknown_to_verifier(value: u32) -> Option<u32> {
    let slot = SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot, used only here, between these two accesses;
    // volatile so that the compiler does not forward the value past the map.
    unsafe {
        core::ptr::write_volatile(slot, value);
        Some(core::ptr::read_volatile(slot))
    }
}

/// Decide a connect to `dst` from a socket of the family `ipv4_socket`
/// says: `Ok(None)` leaves it alone, `Ok(Some(server))` rewrites it to
/// `server` (tracked in `SOCKETS`), `Err(Refuse)` refuses it.
#[inline(always)]
fn try_connect(
    ctx: &SockAddrContext,
    dst: &Endpoint,
    ipv4_socket: bool,
) -> Result<Option<Endpoint>, Refuse> {
    // SAFETY: the value is only read; the daemon replaces values whole.
    let Some(service) = (unsafe { SERVICES.get(dst) }) else {
        count(Reason::ConnectNotVip);
        return Ok(None);
    };
    let protocol = ctx_read!(ctx, protocol);
    if protocol != IPPROTO_TCP && protocol != IPPROTO_UDP {
        count(Reason::ConnectOtherProtocol);
        return Ok(None);
    }
    if !in_scope(ctx, service.netns_cookie) {
        count(Reason::ConnectOtherNetns);
        return Ok(None);
    }

    // SAFETY: plain helper calls without arguments.
    let (now, random) = unsafe { (bpf_ktime_get_ns(), bpf_get_prandom_u32()) };
    let usable = |server: &Endpoint| {
        // SAFETY: `FAILED_AT` values are single u64 timestamps.
        match unsafe { FAILED_AT.get(server) } {
            Some(&failed_at) => now.wrapping_sub(failed_at) >= service.hold_down_ns,
            None => true,
        }
    };
    let Some(mask) = unknown_to_verifier(usable_mask(service, usable)) else {
        count(Reason::MapError);
        return Ok(None);
    };
    let index = match choose_from_mask(service, mask, random) {
        Choice::NoServer => {
            count(Reason::ConnectNoServer);
            return Err(Refuse);
        }
        Choice::Server { index, skipped_failed, all_failed } => {
            if skipped_failed {
                count(Reason::ConnectSkippedFailed);
            }
            if all_failed {
                count(Reason::ConnectAllFailed);
            }
            index
        }
    };
    // `index < MAX_SERVERS` already (see `Choice`); the mask says so to the
    // compiler, so the access has no bounds check, whose panic path the
    // verifier would refuse.
    let server = service.servers[index & (MAX_SERVERS - 1)];

    // Before tracking: an IPv6 server cannot be reached from an IPv4
    // socket. Leave the connect alone (it goes to the VIP itself) and keep
    // it out of `SOCKETS`, so sock_ops and getpeername never see it as ours.
    if ipv4_socket && !server.is_v4() {
        count(Reason::ConnectFamilyMismatch);
        return Ok(None);
    }

    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let entry = SockEntry { vip: *dst, server, flags: 0, released: 0 };
    // BPF_ANY: a socket may connect again (UDP at will, TCP after a connect
    // that failed on the spot); its entry is replaced.
    if protocol == IPPROTO_TCP {
        // Tracked only once its SYN goes (`on_connect`).
        if CONNECTING.insert(cookie, entry, u64::from(BPF_ANY)).is_err() {
            count(Reason::MapError);
        } else {
            mark_tracked(ctx);
        }
    } else if SOCKETS_UDP.insert(cookie, entry, u64::from(BPF_ANY)).is_err() {
        count(Reason::ConnectUntrackedUdp);
    }
    count(Reason::ConnectRewritten);
    debug!(ctx, "connect rewritten to server {}", index);
    Ok(Some(server))
}

/// Sets the retransmission-timeout flag among the socket's sock_ops
/// callback flags, which `on_connect` reads as "tracked": so sock_ops skips
/// every other connecting socket of the cgroup without looking it up (a
/// lookup that misses, some 150 ns, on every connect that is not to a
/// VIP). The flag is one the socket wants anyway, and its callback cannot
/// come before the SYN is sent, after `on_connect`. A kernel that refuses
/// (before 6.12) is noted in `UNMARKED`, before this socket's own
/// `on_connect` runs.
#[inline(always)]
fn mark_tracked(ctx: &SockAddrContext) {
    let mut flags: i32 = 0;
    // Every access goes through this pointer: the helpers write and read
    // `flags` behind the compiler's back.
    let flags = &raw mut flags;
    // SAFETY: the helpers read and write the 4 bytes of `flags` and the
    // socket behind the context, whose lock the connect hook holds.
    let marked = unsafe {
        bpf_getsockopt(ctx.as_ptr(), SOL_TCP, TCP_BPF_SOCK_OPS_CB_FLAGS, flags.cast(), 4) == 0 && {
            flags.write(flags.read() | BPF_SOCK_OPS_RTO_CB_FLAG as i32);
            bpf_setsockopt(ctx.as_ptr(), SOL_TCP, TCP_BPF_SOCK_OPS_CB_FLAGS, flags.cast(), 4) == 0
        }
    };
    if !marked && let Some(unmarked) = UNMARKED.get_ptr_mut(UNMARKED_KERNEL) {
        // SAFETY: a single word, only ever set to 1.
        unsafe { core::ptr::write_volatile(unmarked, 1) };
    }
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    let peer = Endpoint::from_v4_raw(ctx_read!(ctx, user_ip4), read_port(&ctx));
    if let Some(vip) = vip_of_peer(&ctx, &peer) {
        ctx_write!(ctx, vip.addr[3], user_ip4);
        write_port(&ctx, vip.port);
    }
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    let peer = Endpoint { addr: read_ip6(&ctx), port: read_port(&ctx), _pad: [0; 2] };
    if let Some(vip) = vip_of_peer(&ctx, &peer) {
        write_ip6(&ctx, &vip.addr);
        write_port(&ctx, vip.port);
    }
    ALLOW
}

/// Whether a connect from the socket behind `ctx` is rewritten for a
/// service whose value holds `netns_cookie`: from any network namespace
/// (`NETNS_ANY`), or only from the one the value names (`NETNS_INITIAL`:
/// the initial one). The daemon picked the value once at start; no feature
/// is probed here.
#[inline(always)]
fn in_scope(ctx: &SockAddrContext, netns_cookie: u64) -> bool {
    if netns_cookie == NETNS_ANY {
        return true;
    }
    // SAFETY: the helper only reads the socket behind the context; with a
    // null context (ARG_PTR_TO_CTX_OR_NULL) it returns the initial network
    // namespace's cookie (Linux 5.7+, as the helper itself).
    let (mine, host) = unsafe {
        let mine = bpf_get_netns_cookie(ctx.as_ptr());
        let host = if netns_cookie == NETNS_INITIAL {
            bpf_get_netns_cookie(core::ptr::null_mut())
        } else {
            netns_cookie
        };
        (mine, host)
    };
    mine == host
}

/// The VIP a socket dialled, if it connected through one and its peer is
/// still the server it was sent to (a UDP socket may have re-connected).
#[inline(always)]
fn vip_of_peer(ctx: &SockAddrContext, peer: &Endpoint) -> Option<Endpoint> {
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let udp = ctx_read!(ctx, protocol) == IPPROTO_UDP;
    // SAFETY: entries are written whole by connect4/6 and sock_ops.
    let entry = unsafe {
        if udp {
            SOCKETS_UDP.get(cookie)
        } else {
            // A Fast Open socket is connected before its SYN goes.
            SOCKETS.get(cookie).or_else(|| CONNECTING.get(cookie))
        }
    };
    match entry {
        Some(entry) if entry.server == *peer && (peer.is_v4() == entry.vip.is_v4()) => {
            count(Reason::GetpeernameRewritten);
            Some(entry.vip)
        }
        _ => {
            count(Reason::GetpeernameUntouched);
            None
        }
    }
}

#[cgroup_sock(sock_release)]
pub fn lb_sock_release(ctx: SockContext) -> i32 {
    count(try_release(&ctx));
    // sock_release cannot refuse; 1 is the only verdict it takes.
    1
}

// `bpf_sock` fields are read whole, like `ctx_read!` for `bpf_sock_addr`.
macro_rules! sock_read {
    ($ctx:expr, $field:ident) => {
        // SAFETY: the context pointer is valid for the whole program run.
        unsafe { core::ptr::read_volatile(&raw const (*$ctx.sock).$field) }
    };
}

/// Untracks a released socket, or marks it; returns what it did. This runs
/// in the application's close(), before TCP closes the socket.
///
/// A socket whose connect never sent its SYN (still in `CONNECTING`: a
/// connect that failed on the spot, a `TCP_FASTOPEN_CONNECT` socket closed
/// before its first write), or that TCP already closed, leaves the tables
/// at once: no callback will come.
/// A connect still in SYN_SENT is marked `released` (not removed: a SYN-ACK
/// may be processed on another CPU right now, and its establishment must
/// stay counted until the close uncounts it); the close that follows at
/// once (sock_ops, SYN_SENT→CLOSE) then untracks it with no failure mark
/// and no event. A refused, reset or timed-out connect closed while the
/// application still held the socket: sock_ops has already marked the
/// server and removed the entry.
#[inline(always)]
fn try_release(ctx: &SockContext) -> Reason {
    let protocol = sock_read!(ctx, protocol);
    if protocol == IPPROTO_UDP {
        // SAFETY: the helper only reads the socket behind the context.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        // Most UDP sockets never connected to a VIP: the miss is normal.
        // Looked up first: a lookup takes no lock, a removal takes the
        // bucket's lock even when it finds nothing.
        // SAFETY: only tested for presence.
        let tracked = unsafe { SOCKETS_UDP.get(cookie) }.is_some();
        return if tracked && SOCKETS_UDP.remove(cookie).is_ok() {
            Reason::ReleaseUdp
        } else {
            Reason::ReleaseUntouched
        };
    }
    // Only a socket that never established can need anything here; one
    // that did (any other state) stays tracked until sock_ops sees it
    // close, so the count stays exact. Checking the state first spares
    // every established socket a lookup.
    let state = sock_read!(ctx, state);
    if protocol != IPPROTO_TCP || (state != TCP_SYN_SENT && state != TCP_CLOSE) {
        return Reason::ReleaseUntouched;
    }
    // SAFETY: as above.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // SAFETY: only tested for presence.
    if unsafe { CONNECTING.get(cookie) }.is_some() && CONNECTING.remove(cookie).is_ok() {
        return Reason::ReleaseCancelled;
    }
    let Some(entry) = SOCKETS.get_ptr_mut(cookie) else { return Reason::ReleaseUntouched };
    // SAFETY: the entry is this socket's; its connect callback, the only
    // writer of this flag, cannot run concurrently with its release. Only
    // entries of the programs before `CONNECTING` have it (see the flag).
    let pending =
        unsafe { core::ptr::read_volatile(&raw const (*entry).flags) } & SOCK_CONNECT_PENDING != 0;
    if state == TCP_CLOSE || pending {
        // TCP is done with it, or its connect never sent a SYN (a
        // `TCP_FASTOPEN_CONNECT` socket closed before its first send: no
        // state callback was ever asked for): no callback will come.
        // Ignoring the error is right: it was just found.
        let _ = SOCKETS.remove(cookie);
        return Reason::ReleaseCancelled;
    }
    // SAFETY: the entry is this socket's; this program is its only writer
    // of `released` (sock_ops writes only `flags`).
    unsafe { core::ptr::write_volatile(&raw mut (*entry).released, 1) };
    Reason::ReleaseCancelled
}

#[sock_ops]
pub fn lb_sock_ops(ctx: SockOpsContext) -> u32 {
    sock_ops::handle(&ctx);
    // sock_ops programs return 1; the reply, if any, goes through set_reply.
    1
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable call to this; it must stay dead code.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
