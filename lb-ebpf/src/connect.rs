//! connect4/6 and getpeername4/6: a connect to a VIP goes to a chosen
//! server; the socket keeps seeing the VIP as its peer.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_ANY, BPF_SOCK_OPS_RTO_CB_FLAG},
    helpers::{bpf_get_socket_cookie, bpf_getsockopt, bpf_setsockopt},
    programs::SockAddrContext,
};
use aya_log_ebpf::debug;
use lb_common::{Endpoint, Reason, SockEntry, UNMARKED_KERNEL};

use crate::{
    consts::{IPPROTO_TCP, IPPROTO_UDP},
    ctx::ctx_read,
    maps::{CONNECTING, SOCKETS, SOCKETS_UDP, UNMARKED, count},
    select::{CONNECT, Refuse, choose_server, service_for},
    udp::remember_peer,
};

/// `bpf_setsockopt` level and option for a TCP socket's sock_ops callback
/// flags (`include/uapi/linux/bpf.h`, Linux 6.12+).
const SOL_TCP: i32 = 6;
const TCP_BPF_SOCK_OPS_CB_FLAGS: i32 = 1008;

/// Decide a connect to `dst` from a socket of the family `ipv4_socket`
/// says: `Ok(None)` leaves it alone, `Ok(Some(server))` rewrites it to
/// `server` (recorded: TCP in `CONNECTING` until its SYN goes, UDP in
/// `SOCKETS_UDP` and `UDP_PEERS`), `Err(Refuse)` refuses it.
#[inline(always)]
pub(crate) fn try_connect(
    ctx: &SockAddrContext,
    dst: &Endpoint,
    ipv4_socket: bool,
) -> Result<Option<Endpoint>, Refuse> {
    let Some(service) = service_for(ctx, dst, &CONNECT) else { return Ok(None) };
    let server = choose_server(service, &CONNECT)?;

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
    if ctx_read!(ctx, protocol) == IPPROTO_TCP {
        // Tracked only once its SYN goes (`on_connect`).
        if CONNECTING.insert(cookie, entry, u64::from(BPF_ANY)).is_err() {
            count(Reason::MapError);
        } else {
            mark_tracked(ctx);
        }
    } else {
        if SOCKETS_UDP.insert(cookie, entry, u64::from(BPF_ANY)).is_err() {
            count(Reason::ConnectUntrackedUdp);
        }
        // What the server sends back comes from the VIP (recvmsg), as for
        // an unconnected send.
        remember_peer(cookie, dst, &server);
    }
    count(Reason::ConnectRewritten);
    debug!(ctx, "connect rewritten to port {}", u16::from_be(server.port));
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

/// The VIP a socket dialled, if it connected through one and its peer is
/// still the server it was sent to (a UDP socket may have re-connected).
#[inline(always)]
pub(crate) fn vip_of_peer(ctx: &SockAddrContext, peer: &Endpoint) -> Option<Endpoint> {
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
