//! The kernel half of `lb`: rewrite connects to a VIP to a chosen server, in
//! the kernel, and report what became of them.
//!
//! - `lb_connect4` / `lb_connect6` (cgroup/connect4, cgroup/connect6): if the
//!   destination is a VIP, pick a server from the service's selection and
//!   rewrite the destination. Track the socket by cookie.
//! - `lb_getpeername4` / `lb_getpeername6`: a tracked socket reports the VIP
//!   as its peer, so the application sees the address it dialled.
//! - `lb_sock_ops`: for tracked TCP sockets, count live connections per
//!   (VIP, server), mark a server failed the moment a connect to it fails,
//!   and tell the daemon through the `EVENTS` ring buffer.
//!
//! The programs are dumb and fast: the daemon decides the selection; the
//! kernel only skips servers whose connect failed within the hold-down.
//! Each entry point is thin; every early return is counted in `COUNTERS`.
#![no_std]
// Built for the BPF target by lb-user's build script; on the host (e.g.
// `cargo test --workspace`) it compiles to an empty program.
#![cfg_attr(target_arch = "bpf", no_main)]

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_ANY, BPF_NOEXIST, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_RTO_CB,
        BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_SOCK_OPS_TCP_CONNECT_CB, BPF_TCP_CLOSE, BPF_TCP_SYN_SENT,
    },
    helpers::{bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_ns},
    macros::{cgroup_sock_addr, map, sock_ops},
    maps::{HashMap, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{SockAddrContext, SockOpsContext},
};
use aya_log_ebpf::debug;
use lb_common::{
    ConnKey, EVENTS_BYTES, EVENT_CLOSED, EVENT_CONNECT_FAILED, EVENT_CONNECT_TIMEOUT,
    EVENT_ESTABLISHED, Endpoint, Event, MAX_FAILED_SERVERS, MAX_SERVER_PAIRS, MAX_SERVERS,
    MAX_SERVICES, MAX_TRACKED_SOCKETS, SOCK_ESTABLISHED, SOCK_FAILURE_REPORTED,
    Service, SockEntry, reason,
};

/// VIP → service (its selection). Written only by the daemon, one whole
/// value per update.
#[map]
static SERVICES: HashMap<Endpoint, Service> = HashMap::with_max_entries(MAX_SERVICES, 0);

/// Server → `bpf_ktime_get_ns()` of the last connect to it that failed
/// before establishing. Written by `sock_ops`, cleared on an established
/// connect; read by connect4/6 to skip servers within the hold-down.
#[map]
static FAILED_AT: HashMap<Endpoint, u64> = HashMap::with_max_entries(MAX_FAILED_SERVERS, 0);

/// Socket cookie → the VIP and server of a connect that went through a VIP.
/// LRU so that sockets never closed through TCP (connected UDP) age out.
#[map]
static SOCKETS: LruHashMap<u64, SockEntry> = LruHashMap::with_max_entries(MAX_TRACKED_SOCKETS, 0);

/// (VIP, server) → live established connections, per CPU (sum them).
#[map]
static CONNECTIONS: PerCpuHashMap<ConnKey, i64> = PerCpuHashMap::with_max_entries(MAX_SERVER_PAIRS, 0);

/// Established / failed / closed reports for the daemon.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);

/// Per-CPU counters of every decision, indexed by `lb_common::reason`.
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(reason::COUNT, 0);

const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;

/// Verdicts of cgroup sock_addr programs.
const ALLOW: i32 = 1;
const REFUSE: i32 = 0;

#[inline(always)]
fn count(reason: u32) {
    if let Some(counter) = COUNTERS.get_ptr_mut(reason) {
        // SAFETY: a per-CPU slot is only touched by programs on this CPU,
        // and a program is not preempted by another on the same CPU here.
        unsafe { *counter += 1 };
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
    match try_connect(&ctx, &dst) {
        Ok(None) => ALLOW,
        Ok(Some(server)) => {
            if !server.is_v4() {
                count(reason::CONNECT_FAMILY_MISMATCH);
                return ALLOW;
            }
            ctx_write!(ctx, server.addr[3], user_ip4);
            write_port(&ctx, server.port);
            ALLOW
        }
        Err(()) => REFUSE,
    }
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    // An IPv4-mapped destination arrives here in mapped form and finds the
    // IPv4 VIP's entry, because the map stores IPv4 mapped too.
    let dst = Endpoint { addr: read_ip6(&ctx), port: read_port(&ctx), _pad: [0; 2] };
    match try_connect(&ctx, &dst) {
        Ok(None) => ALLOW,
        Ok(Some(server)) => {
            write_ip6(&ctx, &server.addr);
            write_port(&ctx, server.port);
            ALLOW
        }
        Err(()) => REFUSE,
    }
}

/// Decide a connect to `dst`: `Ok(None)` leaves it alone, `Ok(Some(server))`
/// rewrites it to `server`, `Err(())` refuses it (a service with no server).
#[inline(always)]
fn try_connect(ctx: &SockAddrContext, dst: &Endpoint) -> Result<Option<Endpoint>, ()> {
    // SAFETY: the value is only read; the daemon replaces values whole.
    let Some(service) = (unsafe { SERVICES.get(dst) }) else {
        count(reason::CONNECT_NOT_VIP);
        return Ok(None);
    };
    let protocol = ctx_read!(ctx, protocol);
    if protocol != IPPROTO_TCP && protocol != IPPROTO_UDP {
        count(reason::CONNECT_OTHER_PROTOCOL);
        return Ok(None);
    }
    let Some(index) = choose_server(service) else {
        count(reason::CONNECT_NO_SERVER);
        return Err(());
    };
    let Some(server) = service.servers.get(index) else {
        count(reason::CONNECT_NO_SERVER);
        return Err(());
    };

    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let entry = SockEntry { vip: *dst, server: *server, flags: 0, _pad: 0 };
    if SOCKETS.insert(cookie, entry, u64::from(BPF_ANY)).is_err() {
        count(reason::CONNECT_UNTRACKED);
    }
    count(reason::CONNECT_REWRITTEN);
    debug!(ctx, "connect rewritten to server {}", index);
    Ok(Some(*server))
}

/// Index of the server to use, or `None` for a service with no server.
///
/// Within the first `spread` servers, a random usable one; failing that,
/// the first usable server after them; failing that (every server failed
/// within the hold-down), the first: never black-hole.
#[inline(always)]
fn choose_server(service: &Service) -> Option<usize> {
    let len = (service.count as usize).min(MAX_SERVERS);
    if len == 0 {
        return None;
    }
    let group = (service.spread as usize).clamp(1, len);
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let usable = |server: &Endpoint| {
        // SAFETY: `FAILED_AT` values are single u64 timestamps.
        match unsafe { FAILED_AT.get(server) } {
            Some(&failed_at) => now.wrapping_sub(failed_at) >= service.hold_down_ns,
            None => true,
        }
    };

    let mut usable_in_group = 0u32;
    for (i, server) in service.servers.iter().enumerate() {
        if i >= group {
            break;
        }
        if usable(server) {
            usable_in_group += 1;
        }
    }
    if usable_in_group > 0 {
        if (usable_in_group as usize) < group {
            count(reason::CONNECT_SKIPPED_FAILED);
        }
        if group == 1 {
            return Some(0);
        }
        // SAFETY: plain helper call without arguments.
        let mut nth = unsafe { bpf_get_prandom_u32() } % usable_in_group;
        for (i, server) in service.servers.iter().enumerate() {
            if i >= group {
                break;
            }
            if usable(server) {
                if nth == 0 {
                    return Some(i);
                }
                nth -= 1;
            }
        }
        // A server's mark changed between the two passes.
        return Some(0);
    }
    count(reason::CONNECT_SKIPPED_FAILED);
    for (i, server) in service.servers.iter().enumerate() {
        if i >= len {
            break;
        }
        if i >= group && usable(server) {
            return Some(i);
        }
    }
    count(reason::CONNECT_ALL_FAILED);
    Some(0)
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

/// The VIP a socket dialled, if it connected through one and its peer is
/// still the server it was sent to (a UDP socket may have re-connected).
#[inline(always)]
fn vip_of_peer(ctx: &SockAddrContext, peer: &Endpoint) -> Option<Endpoint> {
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // SAFETY: entries are written whole by connect4/6 and sock_ops.
    match unsafe { SOCKETS.get(&cookie) } {
        Some(entry) if entry.server == *peer && (peer.is_v4() == entry.vip.is_v4()) => {
            count(reason::GETPEERNAME_REWRITTEN);
            Some(entry.vip)
        }
        _ => {
            count(reason::GETPEERNAME_UNTOUCHED);
            None
        }
    }
}

#[sock_ops]
pub fn lb_sock_ops(ctx: SockOpsContext) -> u32 {
    match ctx.op() {
        BPF_SOCK_OPS_TCP_CONNECT_CB => on_connect(&ctx),
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => on_established(&ctx),
        BPF_SOCK_OPS_RTO_CB => on_retransmit_timeout(&ctx),
        BPF_SOCK_OPS_STATE_CB => {
            if ctx.arg(1) == BPF_TCP_CLOSE {
                on_close(&ctx);
            }
        }
        _ => {}
    }
    // sock_ops programs return 1; the reply, if any, goes through set_reply.
    1
}

/// The tracked entry for this socket, if it connected through a VIP.
#[inline(always)]
fn tracked(ctx: &SockOpsContext) -> Option<(u64, *mut SockEntry)> {
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    match SOCKETS.get_ptr_mut(&cookie) {
        Some(entry) => Some((cookie, entry)),
        None => {
            count(reason::SOCKOPS_UNTRACKED);
            None
        }
    }
}

/// A tracked connect is about to send its SYN: ask for state changes (to see
/// it fail or close) and retransmission timeouts (to see a SYN go unanswered).
fn on_connect(ctx: &SockOpsContext) {
    if tracked(ctx).is_some() {
        let flags = ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG;
        if ctx.set_cb_flags(flags as i32).is_err() {
            count(reason::MAP_ERROR);
        }
    }
}

fn on_established(ctx: &SockOpsContext) {
    let Some((cookie, entry)) = tracked(ctx) else { return };
    // SAFETY: the entry belongs to this socket; its callbacks run under the
    // socket lock, so nothing else writes it concurrently.
    let entry = unsafe { &mut *entry };
    entry.flags |= SOCK_ESTABLISHED;
    // The server answers again: lift its hold-down. Ignoring the error is
    // right: most servers have no failure mark.
    let _ = FAILED_AT.remove(&entry.server);
    add_connection(&ConnKey { vip: entry.vip, server: entry.server }, 1);
    count(reason::SOCKOPS_ESTABLISHED);
    emit(cookie, entry, EVENT_ESTABLISHED);
}

/// The SYN (or a later segment) was not answered in time. Before the
/// connection is established this marks the server failed at once, so the
/// next connects skip it; this connect itself may still succeed.
fn on_retransmit_timeout(ctx: &SockOpsContext) {
    let Some((cookie, entry)) = tracked(ctx) else { return };
    // SAFETY: as in `on_established`.
    let entry = unsafe { &mut *entry };
    if entry.flags & (SOCK_ESTABLISHED | SOCK_FAILURE_REPORTED) != 0 {
        return;
    }
    entry.flags |= SOCK_FAILURE_REPORTED;
    mark_failed(&entry.server);
    count(reason::SOCKOPS_CONNECT_TIMEOUT);
    emit(cookie, entry, EVENT_CONNECT_TIMEOUT);
}

fn on_close(ctx: &SockOpsContext) {
    let Some((cookie, entry)) = tracked(ctx) else { return };
    // SAFETY: as in `on_established`; the entry is copied out before removal.
    let entry = unsafe { *entry };
    if entry.flags & SOCK_ESTABLISHED != 0 {
        add_connection(&ConnKey { vip: entry.vip, server: entry.server }, -1);
        count(reason::SOCKOPS_CLOSED);
        emit(cookie, &entry, EVENT_CLOSED);
    } else if ctx.arg(0) == BPF_TCP_SYN_SENT {
        mark_failed(&entry.server);
        count(reason::SOCKOPS_CONNECT_FAILED);
        emit(cookie, &entry, EVENT_CONNECT_FAILED);
    }
    // Ignoring the error is right: LRU eviction may have removed it already.
    let _ = SOCKETS.remove(&cookie);
}

fn mark_failed(server: &Endpoint) {
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if FAILED_AT.insert(server, now, u64::from(BPF_ANY)).is_err() {
        count(reason::MAP_ERROR);
    }
}

fn add_connection(key: &ConnKey, delta: i64) {
    if let Some(value) = CONNECTIONS.get_ptr_mut(key) {
        // SAFETY: this CPU's slot; see `count`.
        unsafe { *value += delta };
        return;
    }
    // First connection of this pair on any CPU: create the entry (the other
    // CPUs' slots start at zero). Losing a race to another CPU is fine; then
    // the entry exists and we add to our slot.
    if CONNECTIONS.insert(key, delta, u64::from(BPF_NOEXIST)).is_ok() {
        return;
    }
    match CONNECTIONS.get_ptr_mut(key) {
        // SAFETY: as above.
        Some(value) => unsafe { *value += delta },
        None => count(reason::MAP_ERROR),
    }
}

fn emit(cookie: u64, entry: &SockEntry, kind: u32) {
    let Some(mut slot) = EVENTS.reserve::<Event>(0) else {
        count(reason::EVENT_DROPPED);
        return;
    };
    // SAFETY: plain helper call without arguments.
    let time_ns = unsafe { bpf_ktime_get_ns() };
    slot.write(Event { cookie, time_ns, vip: entry.vip, server: entry.server, kind, _pad: 0 });
    slot.submit(0);
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
