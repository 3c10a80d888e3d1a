//! The kernel half of `lb`: rewrite connects to a VIP to a chosen server, in
//! the kernel, and report what became of them.
//!
//! - `lb_connect4` / `lb_connect6` (cgroup/connect4, cgroup/connect6,
//!   `connect.rs`): if the destination is a VIP, pick a server from the
//!   service's selection (`select.rs`, over `lb_common::choose`, tested on
//!   the host) and rewrite the destination. Record a TCP socket's choice in
//!   `CONNECTING` and mark it for sock_ops (`mark_tracked`); track a UDP
//!   one in `SOCKETS_UDP` and `UDP_PEERS`.
//! - `lb_getpeername4` / `lb_getpeername6`: a tracked socket reports the VIP
//!   as its peer, so the application sees the address it dialled.
//! - `lb_sendmsg4` / `lb_sendmsg6` (`udp.rs`): an unconnected UDP send to a
//!   VIP goes to a server chosen as for a connect, the same one for the
//!   socket's later sends while it is usable and preferred; the socket's
//!   (VIP, server) pairs are kept in `UDP_PEERS`.
//! - `lb_recvmsg4` / `lb_recvmsg6` (`udp.rs`): a datagram from such a
//!   server (or from the server of a UDP socket connected through a VIP)
//!   is shown as from the VIP.
//! - `lb_sock_ops` (its callbacks are in `sock_ops.rs`): when a recorded
//!   connect sends its SYN (to the server connect4 chose), track it in
//!   `SOCKETS`; for tracked TCP sockets, count live connections per (VIP,
//!   server), mark a server failed the moment the server refuses a connect
//!   or leaves its SYN unanswered, and tell the daemon through the `EVENTS`
//!   ring buffer when a connect establishes, fails or times out (a close is
//!   only counted).
//! - `lb_sock_release` (cgroup sock_release, `release.rs`): a released
//!   socket leaves the socket tables (UDP at once; TCP as its state says).
//! - `lb_xdp` (XDP, on the interfaces of external VIPs; `forward.rs` over
//!   `packet/`): packets from other machines to an external VIP go to a
//!   server chosen as for a connect, with NAT; the servers' replies are
//!   translated back, and ICMP errors about the flows both ways
//!   (`icmp.rs`). Failure marks and events are shared (`report.rs`). A
//!   client's packet of an established flow goes the short way
//!   (`established.rs`) once the full path has judged its VIP and server.
//!
//! The programs are dumb and fast: the daemon decides the selection; the
//! kernel only skips servers whose connect failed within the hold-down.
//! Each entry point is thin; every early return is counted in `COUNTERS`.
//!
//! This file holds only the entry points. Below them: every map and the
//! counters in `maps.rs`, the kernel's numbers in `consts.rs`, the per-CPU
//! working values in `scratch.rs`, the sock_addr context in `ctx.rs`; no
//! module imports from this one.
#![no_std]
// Built for the BPF target by lb-user's build script; on the host (e.g.
// `cargo test --workspace`) it compiles to an empty program.
#![cfg_attr(target_arch = "bpf", no_main)]
// `asm!` for the BPF target (`atomic_add`); the eBPF build is on nightly.
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

use aya_ebpf::{
    bindings::xdp_action,
    macros::{cgroup_sock, cgroup_sock_addr, sock_ops, xdp},
    programs::{SockAddrContext, SockContext, SockOpsContext, XdpContext},
};
use lb_common::{Endpoint, Reason};

// The programs' modules: each uses only modules below it in ARCHITECTURE.md's
// list (`maps`, `consts`, `scratch` and `ctx` use none of them).
mod announce;
mod connect;
mod consts;
mod ctx;
mod established;
mod flows;
mod forward;
mod icmp;
mod maps;
mod packet;
mod per_second;
mod release;
mod reply;
mod report;
mod reset;
mod route;
mod scratch;
mod select;
mod sock_ops;
mod too_big;
mod traffic;
mod udp;

use crate::{
    connect::{try_connect, vip_of_peer},
    consts::{ALLOW, REFUSE},
    ctx::{ctx_read, ctx_write, read_endpoint6, read_port, write_endpoint6, write_port},
    established::Short,
    maps::{PACKET, count},
    packet::Parsed,
    release::try_release,
    select::Refuse,
    udp::{try_sendmsg, vip_of_source},
};
#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    let dst = Endpoint::from_v4_raw(ctx_read!(ctx, user_ip4), read_port(&ctx));
    // `try_connect` returns only IPv4 servers to an IPv4 socket.
    rewrite_v4(&ctx, try_connect(&ctx, &dst, true))
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    // An IPv4-mapped destination arrives here in mapped form and finds the
    // IPv4 VIP's entry, because the map stores IPv4 mapped too.
    let dst = read_endpoint6(&ctx);
    rewrite_v6(&ctx, try_connect(&ctx, &dst, false))
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    // An IPv6 socket's send to an IPv4-mapped address comes here too.
    let dst = Endpoint::from_v4_raw(ctx_read!(ctx, user_ip4), read_port(&ctx));
    rewrite_v4(&ctx, try_sendmsg(&ctx, &dst, true))
}

#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
    let dst = read_endpoint6(&ctx);
    rewrite_v6(&ctx, try_sendmsg(&ctx, &dst, false))
}

/// Writes the IPv4 server of a decision to the context: the verdict.
#[inline(always)]
fn rewrite_v4(ctx: &SockAddrContext, decision: Result<Option<Endpoint>, Refuse>) -> i32 {
    match decision {
        Ok(None) => ALLOW,
        Ok(Some(server)) => {
            ctx_write!(ctx, server.addr[3], user_ip4);
            write_port(ctx, server.port);
            ALLOW
        }
        Err(Refuse) => REFUSE,
    }
}

/// Writes the server of a decision to an IPv6 context: the verdict.
#[inline(always)]
fn rewrite_v6(ctx: &SockAddrContext, decision: Result<Option<Endpoint>, Refuse>) -> i32 {
    match decision {
        Ok(None) => ALLOW,
        Ok(Some(server)) => {
            write_endpoint6(ctx, &server);
            ALLOW
        }
        Err(Refuse) => REFUSE,
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
    let peer = read_endpoint6(&ctx);
    if let Some(vip) = vip_of_peer(&ctx, &peer) {
        write_endpoint6(&ctx, &vip);
    }
    ALLOW
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    let src = Endpoint::from_v4_raw(ctx_read!(ctx, user_ip4), read_port(&ctx));
    if let Some(vip) = vip_of_source(&ctx, &src, true) {
        ctx_write!(ctx, vip.addr[3], user_ip4);
        write_port(&ctx, vip.port);
    }
    // recvmsg cannot refuse; 1 is the only verdict it takes.
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn lb_recvmsg6(ctx: SockAddrContext) -> i32 {
    // A datagram from an IPv4 server to an IPv6 socket comes IPv4-mapped.
    let src = read_endpoint6(&ctx);
    if let Some(vip) = vip_of_source(&ctx, &src, false) {
        write_endpoint6(&ctx, &vip);
    }
    // As for recvmsg4.
    ALLOW
}

#[cgroup_sock(sock_release)]
pub fn lb_sock_release(ctx: SockContext) -> i32 {
    count(try_release(&ctx));
    // sock_release cannot refuse; 1 is the only verdict it takes.
    1
}

#[sock_ops]
pub fn lb_sock_ops(ctx: SockOpsContext) -> u32 {
    sock_ops::on_callback(&ctx);
    // sock_ops programs return 1; the reply, if any, goes through set_reply.
    1
}

/// The external path: a client's packet of an established flow the short
/// way (`established.rs`); any other packet from the network to an
/// external VIP goes to a server, a server's reply back to its client
/// (`forward.rs`); one to
/// a VIP's address that lb does not serve is answered or dropped
/// (`forward::unserved`); anything else passes untouched.
#[xdp]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    let Some(slot) = PACKET.get_ptr_mut(0) else {
        count(Reason::MapError);
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's slot, used by this program run alone (XDP runs
    // with preemption off: one packet per CPU at a time).
    let p = unsafe { &mut *slot };
    // The short way first; what it does not take goes the full way.
    let short = match established::short_way(&ctx, p) {
        Short::Sent(verdict) => Some(verdict),
        Short::Reply => reply::reply(&ctx, p),
        Short::Full => None,
    };
    if let Some(verdict) = short {
        return verdict;
    }
    let answered = announce::answer(&ctx);
    if answered != announce::NOT_ASKED {
        return answered;
    }
    match packet::parse(&ctx, p) {
        Parsed::Packet => forward::forward(&ctx, p).unwrap_or(xdp_action::XDP_PASS),
        Parsed::Unbalanced => forward::unserved(&ctx, p).unwrap_or(xdp_action::XDP_PASS),
        Parsed::Other => xdp_action::XDP_PASS,
    }
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
