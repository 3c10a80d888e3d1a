//! sock_release: a released socket leaves the socket tables. UDP at once
//! (`SOCKETS_UDP`, `UDP_PEERS`); TCP that never sent its SYN (a connect
//! that failed on the spot, a Fast Open connect closed before its first
//! write) at once; TCP that never established is marked released (the
//! application gave up on the connect), so that its close untracks it as
//! no server failure. Established TCP stays tracked until sock_ops sees it
//! close.

use aya_ebpf::{EbpfContext as _, helpers::bpf_get_socket_cookie, programs::SockContext};
use lb_common::{Reason, SOCK_CONNECT_PENDING};

use crate::{
    consts::{IPPROTO_TCP, IPPROTO_UDP},
    maps::{CONNECTING, SOCKETS, SOCKETS_UDP, UDP_PEERS},
};

/// TCP states as `bpf_sock::state` holds them (`include/net/tcp_states.h`).
const TCP_SYN_SENT: u32 = 2;
const TCP_CLOSE: u32 = 7;

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
pub(crate) fn try_release(ctx: &SockContext) -> Reason {
    let protocol = sock_read!(ctx, protocol);
    if protocol == IPPROTO_UDP {
        // SAFETY: the helper only reads the socket behind the context.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        // Most UDP sockets never connected or sent to a VIP: the misses are
        // normal.
        // Looked up first: a lookup takes no lock, a removal takes the
        // bucket's lock even when it finds nothing.
        // SAFETY: only tested for presence.
        let connected = unsafe { SOCKETS_UDP.get(cookie) }.is_some();
        let connected = connected && SOCKETS_UDP.remove(cookie).is_ok();
        // SAFETY: as above.
        let sent = unsafe { UDP_PEERS.get(cookie) }.is_some();
        let sent = sent && UDP_PEERS.remove(cookie).is_ok();
        return if connected || sent { Reason::ReleaseUdp } else { Reason::ReleaseUntouched };
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
