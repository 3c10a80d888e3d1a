//! sendmsg4/6 and recvmsg4/6: an unconnected UDP send to a VIP goes to a
//! chosen server, and what a server sends back to a socket that sent to it
//! through a VIP comes from the VIP, so the application only ever sees the
//! VIP (resolvers drop answers from an address they did not ask).
//!
//! The reverse mapping is per socket, in `UDP_PEERS` (cookie → up to four
//! (VIP, server) pairs, `lb_common::UdpPeers`), removed whole when the
//! socket is released (`release.rs`). A socket's sends to a VIP all go to
//! the server in its pair while that server is usable and preferred (among
//! the first `spread` of the selection), as a connected socket's would;
//! then the next send chooses again and the pair follows.

use aya_ebpf::{
    EbpfContext as _, bindings::BPF_ANY, helpers::bpf_get_socket_cookie, programs::SockAddrContext,
};
use lb_common::{Endpoint, Reason, UDP_PEERS_PER_SOCKET, UdpPeers};

use crate::{
    consts::E2BIG,
    maps::{UDP_PEERS, count},
    select::{Refuse, SENDMSG, choose_server, preferred, service_for, usable},
};

// `try_sendmsg` masks a slot index with `UDP_PEERS_PER_SOCKET - 1`.
const _: () = assert!(UDP_PEERS_PER_SOCKET.is_power_of_two());

/// Decide an unconnected UDP send to `dst` from the hook of the family
/// `ipv4_hook` says (sendmsg4 writes only IPv4 destinations; sendmsg6 only
/// IPv6 ones, as the kernel refuses a send rewritten to an IPv4-mapped
/// address): `Ok(None)` leaves it alone, `Ok(Some(server))` rewrites it to
/// `server` (recorded in `UDP_PEERS`), `Err(Refuse)` refuses it.
#[inline(always)]
pub(crate) fn try_sendmsg(
    ctx: &SockAddrContext,
    dst: &Endpoint,
    ipv4_hook: bool,
) -> Result<Option<Endpoint>, Refuse> {
    let Some(service) = service_for(ctx, dst, &SENDMSG) else { return Ok(None) };
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let peers = UDP_PEERS.get_ptr_mut(cookie);
    if let Some(peers) = peers {
        // SAFETY: this socket's entry, written only under its lock, which
        // the sendmsg hook holds.
        let peers = unsafe { &*peers };
        if let Some(slot) = peers.slot_of_vip(dst) {
            let server = peers.peers[slot & (UDP_PEERS_PER_SOCKET - 1)].server;
            if usable(service, &server) && preferred(service, &server) {
                count(Reason::SendmsgKept);
                return Ok(Some(server));
            }
        }
    }
    let server = choose_server(service, &SENDMSG)?;
    if server.is_v4() != ipv4_hook {
        count(Reason::SendmsgFamilyMismatch);
        return Ok(None);
    }
    match peers {
        // SAFETY: as above.
        Some(peers) => unsafe { (*peers).set(dst, &server) },
        None => insert_peer(cookie, dst, &server),
    }
    count(Reason::SendmsgRewritten);
    Ok(Some(server))
}

/// Records that the UDP socket `cookie` sends to `vip` through `server`
/// (connect4/6 of a UDP socket: its answers come from the VIP too).
#[inline(always)]
pub(crate) fn remember_peer(cookie: u64, vip: &Endpoint, server: &Endpoint) {
    match UDP_PEERS.get_ptr_mut(cookie) {
        // SAFETY: this socket's entry, written only under its lock, which
        // the connect hook holds.
        Some(peers) => unsafe { (*peers).set(vip, server) },
        None => insert_peer(cookie, vip, server),
    }
}

#[inline(always)]
fn insert_peer(cookie: u64, vip: &Endpoint, server: &Endpoint) {
    let mut peers = UdpPeers::default();
    peers.set(vip, server);
    if let Err(e) = UDP_PEERS.insert(cookie, peers, u64::from(BPF_ANY)) {
        count(if e == -E2BIG { Reason::UdpPeersFull } else { Reason::MapError });
    }
}

/// The VIP to show as the source of a datagram from `src` to the socket
/// behind `ctx`, if the socket sent to `src` through one. The recvmsg4
/// hook (`ipv4_hook`) can only show an IPv4 VIP.
#[inline(always)]
pub(crate) fn vip_of_source(
    ctx: &SockAddrContext,
    src: &Endpoint,
    ipv4_hook: bool,
) -> Option<Endpoint> {
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // SAFETY: this socket's entry, written only under its lock, which the
    // recvmsg hook holds.
    let vip = unsafe { UDP_PEERS.get(cookie) }.and_then(|peers| peers.vip_of_server(src));
    match vip {
        Some(vip) if vip.is_v4() || !ipv4_hook => {
            count(Reason::RecvmsgRewritten);
            Some(vip)
        }
        _ => {
            count(Reason::RecvmsgUntouched);
            None
        }
    }
}
