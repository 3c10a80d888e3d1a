//! `lb_sock_ops`: when a connect connect4 recorded sends its SYN (to the
//! server it chose), track it in `SOCKETS`; then, for tracked TCP sockets,
//! count live connections per (VIP, server), mark a server failed the
//! moment it refuses a connect or leaves its SYN unanswered, and tell the
//! daemon through `EVENTS` when a connect establishes after failures,
//! fails or times out.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_ANY, BPF_NOEXIST, BPF_SOCK_OPS_RTO_CB, BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB,
        BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB, BPF_TCP_CLOSE,
        BPF_TCP_ESTABLISHED, BPF_TCP_SYN_SENT,
    },
    helpers::bpf_get_socket_cookie,
    programs::SockOpsContext,
};
use lb_common::{
    ConnKey, Endpoint, EventKind, Reason, SOCK_CONNECT_PENDING, SOCK_ESTABLISHED,
    SOCK_FAILURE_REPORTED, SOCK_UNCOUNTED, SockEntry, UNMARKED_KERNEL, UNMARKED_REPLACED,
};

use crate::{
    consts::{AF_INET, E2BIG},
    maps::{CONNECTING, CONNECTIONS, FAILED_AT, SOCKETS, UNMARKED, atomic_add, count},
    report::{emit, mark_failed},
};

/// Runs the callback `ctx` is for.
#[inline(always)]
pub(crate) fn on_callback(ctx: &SockOpsContext) {
    // Only `TCP_CONNECT_CB` runs for every socket of the cgroup; the other
    // callbacks handled here are the ones `on_connect` asks for, so only
    // tracked sockets pay for them. Establishment is seen as a state change
    // (SYN_SENT -> ESTABLISHED), not as `ACTIVE_ESTABLISHED_CB`, which the
    // kernel calls for every socket and would cost every connect that is
    // not to a VIP a second socket-table lookup.
    match ctx.op() {
        BPF_SOCK_OPS_TCP_CONNECT_CB => on_connect(ctx),
        BPF_SOCK_OPS_RTO_CB => on_retransmit_timeout(ctx),
        BPF_SOCK_OPS_STATE_CB => match ctx.arg(1) {
            BPF_TCP_ESTABLISHED => on_established(ctx),
            BPF_TCP_CLOSE => on_close(ctx),
            _ => {}
        },
        _ => {}
    }
}

// `bpf_sock_ops` fields are read whole, like `ctx_read!` for
// `bpf_sock_addr` (the compiler would merge `remote_ip6`'s words).
macro_rules! ops_read {
    ($ctx:expr, $($field:tt)+) => {
        // SAFETY: the context pointer is valid for the whole program run.
        unsafe { core::ptr::read_volatile(&raw const (*$ctx.ops).$($field)+) }
    };
}

/// The tracked entry for this socket, if it connected through a VIP.
#[inline(always)]
fn tracked(ctx: &SockOpsContext) -> Option<(u64, *mut SockEntry)> {
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    match SOCKETS.get_ptr_mut(cookie) {
        Some(entry) => Some((cookie, entry)),
        None => {
            count(Reason::SockopsUntracked);
            None
        }
    }
}

/// Whether `UNMARKED[slot]` is set.
#[inline(always)]
fn unmarked(slot: u32) -> bool {
    // SAFETY: a single word, read whole.
    UNMARKED.get_ptr(slot).is_some_and(|u| unsafe { core::ptr::read_volatile(u) } != 0)
}

/// A connect is about to send its SYN. If connect4 recorded it (in
/// `CONNECTING`) and the SYN goes to the server it chose, track it in
/// `SOCKETS` and ask for state changes (to see it establish, fail or close)
/// and retransmission timeouts (to see a SYN go unanswered). A socket that
/// connect4 did not mark is not looked up, unless this kernel cannot mark
/// (`mark_tracked`).
fn on_connect(ctx: &SockOpsContext) {
    // `UNMARKED` is read only for a socket without the mark.
    if ctx.cb_flags() & BPF_SOCK_OPS_RTO_CB_FLAG == 0 && !unmarked(UNMARKED_KERNEL) {
        return;
    }
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // SAFETY: entries are written whole by connect4/6; copied out.
    let Some(entry) = (unsafe { CONNECTING.get(cookie) }).copied() else {
        if unmarked(UNMARKED_REPLACED) {
            adopt_connecting(ctx);
        } else {
            count(Reason::SockopsUntracked);
        }
        return;
    };
    // Ignoring the error is right: the entry was just found, and only this
    // socket's connect and release (serialized) write it.
    let _ = CONNECTING.remove(cookie);
    if !sends_to(ctx, &entry.server) {
        // An entry left by a connect that failed on the spot; this socket
        // now connects elsewhere, not through the VIP.
        count(Reason::SockopsUntracked);
        return;
    }
    if let Err(e) = SOCKETS.insert(cookie, entry, u64::from(BPF_ANY)) {
        count(if e == -E2BIG { Reason::ConnectUntracked } else { Reason::MapError });
        return;
    }
    ask_for_callbacks(ctx);
}

/// A connect that ran the connect4 of the programs these replaced: its
/// entry is in `SOCKETS` already, maybe with `SOCK_CONNECT_PENDING`.
#[inline(always)]
fn adopt_connecting(ctx: &SockOpsContext) {
    if let Some((_, entry)) = tracked(ctx) {
        // SAFETY: the entry is this socket's; its callbacks run under the
        // socket lock, and sock_release (the only other writer) writes
        // `released` alone.
        unsafe { (*entry).flags &= !SOCK_CONNECT_PENDING };
        ask_for_callbacks(ctx);
    }
}

#[inline(always)]
fn ask_for_callbacks(ctx: &SockOpsContext) {
    let flags = ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG;
    if ctx.set_cb_flags(flags as i32).is_err() {
        count(Reason::MapError);
    }
}

/// Whether the socket's SYN goes to `server`. `remote_port` holds the
/// port in network byte order in its *high* 16 bits, unlike `user_port`.
#[inline(always)]
fn sends_to(ctx: &SockOpsContext, server: &Endpoint) -> bool {
    if (ops_read!(ctx, remote_port) >> 16) as u16 != server.port {
        return false;
    }
    if ops_read!(ctx, family) == AF_INET {
        return server.is_v4() && ops_read!(ctx, remote_ip4) == server.addr[3];
    }
    ops_read!(ctx, remote_ip6[0]) == server.addr[0]
        && ops_read!(ctx, remote_ip6[1]) == server.addr[1]
        && ops_read!(ctx, remote_ip6[2]) == server.addr[2]
        && ops_read!(ctx, remote_ip6[3]) == server.addr[3]
}

fn on_established(ctx: &SockOpsContext) {
    let Some((cookie, entry)) = tracked(ctx) else { return };
    // SAFETY: the entry belongs to this socket; its callbacks run under the
    // socket lock, so nothing else writes it concurrently.
    let entry = unsafe { &mut *entry };
    entry.flags |= SOCK_ESTABLISHED;
    // A retransmission timeout is no news once established
    // (`on_retransmit_timeout` ignores it): stop asking, so that a lossy
    // long-lived connection does not run this program at every timeout.
    // Keep the state changes, for its close.
    let flags = ctx.cb_flags() & !BPF_SOCK_OPS_RTO_CB_FLAG;
    if ctx.set_cb_flags(flags as i32).is_err() {
        count(Reason::MapError);
    }
    // The server answers again: lift its hold-down. Only a server that had
    // a failure mark is news to the daemon (it recovers); every other
    // establishment is counted in CONNECTIONS and not reported, so a VIP
    // whose servers are fine costs the daemon nothing per connection.
    // Looked up first: a lookup is lock-free, a removal takes the bucket's
    // lock, and almost every server has no mark.
    // SAFETY: only tested for presence.
    let recovered =
        unsafe { FAILED_AT.get(entry.server) }.is_some() && FAILED_AT.remove(entry.server).is_ok();
    if !add_connection(&ConnKey { vip: entry.vip, server: entry.server }, 1) {
        entry.flags |= SOCK_UNCOUNTED;
    }
    count(Reason::SockopsEstablished);
    if recovered {
        emit(cookie, &entry.vip, &entry.server, EventKind::Established);
    }
}

/// The SYN (or a later segment) was not answered in time. Before the
/// connection is established this marks the server failed at once, so the
/// next connects skip it; this connect itself may still succeed.
fn on_retransmit_timeout(ctx: &SockOpsContext) {
    let Some((cookie, entry)) = tracked(ctx) else { return };
    // SAFETY: as in `on_established`.
    let entry = unsafe { &mut *entry };
    if entry.flags & (SOCK_ESTABLISHED | SOCK_FAILURE_REPORTED) != 0 || entry.released != 0 {
        return;
    }
    entry.flags |= SOCK_FAILURE_REPORTED;
    mark_failed(&entry.server);
    count(Reason::SockopsConnectTimeout);
    emit(cookie, &entry.vip, &entry.server, EventKind::ConnectTimeout);
}

fn on_close(ctx: &SockOpsContext) {
    let Some((cookie, entry)) = tracked(ctx) else { return };
    // SAFETY: as in `on_established`; the entry is copied out before removal.
    let entry = unsafe { *entry };
    if entry.flags & SOCK_ESTABLISHED != 0 {
        if entry.flags & SOCK_UNCOUNTED == 0 {
            add_connection(&ConnKey { vip: entry.vip, server: entry.server }, -1);
        }
        // Counted, not reported: the daemon reads live counts from
        // `CONNECTIONS`, and a ring-buffer record per closed connection
        // would only wake it for nothing.
        count(Reason::SockopsClosed);
    } else if entry.released != 0 {
        // Its application gave up on the connect: no server failure.
        count(Reason::SockopsCancelled);
    } else if ctx.arg(0) == BPF_TCP_SYN_SENT {
        if closed_by_tcp(ctx) {
            mark_failed(&entry.server);
            count(Reason::SockopsConnectFailed);
            emit(cookie, &entry.vip, &entry.server, EventKind::ConnectFailed);
        } else {
            // shutdown() or connect(AF_UNSPEC) in SYN_SENT: its application
            // gave up, as with close().
            count(Reason::SockopsCancelled);
        }
    }
    // Ignoring the error is right: the entry was just found, and only this
    // socket's callbacks (serialized by its lock) remove it.
    let _ = SOCKETS.remove(cookie);
}

/// Whether TCP itself closed a connect in SYN_SENT: a reset answered the
/// SYN, or its retransmissions timed out. Both empty the write queue (the
/// SYN) before the state changes; an application's `shutdown()` or
/// `connect(AF_UNSPEC)` (`tcp_disconnect`) changes the state first, with
/// the SYN still queued. Not told apart: an ICMP error closing the connect,
/// which empties the queue first only from Linux 6.10
/// (`tcp_done_with_error`); before, it counts as given up, and the health
/// checks see the server.
#[inline(always)]
fn closed_by_tcp(ctx: &SockOpsContext) -> bool {
    ops_read!(ctx, packets_out) == 0
}

/// Adds `delta` to this CPU's count of `key`; false if the pair could not
/// be counted (the map is full, or an error, both counted).
fn add_connection(key: &ConnKey, delta: i64) -> bool {
    if let Some(value) = CONNECTIONS.get_ptr_mut(key) {
        // SAFETY: an i64 map value, as in `count`; two's complement makes
        // the add of `delta` as u64 a signed one.
        unsafe { atomic_add(value.cast(), delta as u64) };
        return true;
    }
    // First connection of this pair on any CPU: create the entry (the other
    // CPUs' slots start at zero). Losing a race to another CPU is fine; then
    // the entry exists and we add to our slot.
    let full = match CONNECTIONS.insert(key, delta, u64::from(BPF_NOEXIST)) {
        Ok(()) => return true,
        Err(e) => e == -E2BIG,
    };
    match CONNECTIONS.get_ptr_mut(key) {
        Some(value) => {
            // SAFETY: as above.
            unsafe { atomic_add(value.cast(), delta as u64) };
            true
        }
        None => {
            count(if full { Reason::ConnectionsFull } else { Reason::MapError });
            false
        }
    }
}
