//! Closing connections: netlink `SOCK_DESTROY` (what `ss -K` does) on the
//! sockets whose cookies the datapath tracked as connected through a VIP.
//!
//! The caller picks the cookies (from the `SOCKETS` map), so a direct
//! connection to the same server is never touched: it has no entry there.
//! Needs CAP_NET_ADMIN and `CONFIG_INET_DIAG_DESTROY`. [`destroy`] acts in
//! the caller's network namespace; [`destroy_everywhere`] also in the
//! node's others, where pods connect through a VIP with `scope = "all"`.

use std::{collections::HashSet, io};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::{
    AF_INET, AF_INET6, IPPROTO_TCP, SockDiagDestroy, SockDiagMessage,
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

use crate::netns;

/// The TCP states in which a connection is destroyed: not LISTEN or
/// TIME_WAIT, and not SYN_SENT: destroying a connect in flight would make
/// sock_ops report a failed connect and wrongly mark its server failed.
fn live_states() -> StateFlags {
    StateFlags::all() - StateFlags::LISTEN - StateFlags::TIME_WAIT - StateFlags::SYN_SENT
}

/// Resets every TCP socket in this network namespace whose cookie is in
/// `cookies`, with one dump of the namespace's sockets however many there
/// are. Returns the cookies of those destroyed.
pub fn destroy(cookies: &HashSet<u64>) -> io::Result<Vec<u64>> {
    if cookies.is_empty() {
        return Ok(Vec::new());
    }
    let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut targets = Vec::new();
    for family in [AF_INET, AF_INET6] {
        for (family, id) in dump(&socket, family)? {
            if cookies.contains(&u64::from_ne_bytes(id.cookie)) {
                targets.push((family, id));
            }
        }
    }
    let mut destroyed = Vec::new();
    for (family, id) in targets {
        let cookie = u64::from_ne_bytes(id.cookie);
        match destroy_one(&socket, family, id) {
            Ok(()) => destroyed.push(cookie),
            // Closed on its own between the dump and now.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(destroyed)
}

/// What [`destroy_everywhere`] did.
#[derive(Debug, Default)]
pub struct Destroyed {
    /// The cookies of the sockets reset, in any namespace.
    pub cookies: Vec<u64>,
    /// Why the other namespaces could not all be searched, and how many
    /// sockets were still not found then.
    pub not_searched: Option<(io::Error, usize)>,
}

/// [`destroy`] in this network namespace and then, while some `cookies`
/// are still not found and `other_namespaces` is set, in each of the
/// node's other namespaces ([`netns::for_each_other`]). Sockets are looked
/// for where they are: a cookie is unique on the node.
pub fn destroy_everywhere(cookies: &HashSet<u64>, other_namespaces: bool) -> io::Result<Destroyed> {
    let mut done = Destroyed { cookies: destroy(cookies)?, ..Destroyed::default() };
    let mut left: HashSet<u64> = cookies.iter().copied().collect();
    for cookie in &done.cookies {
        left.remove(cookie);
    }
    if !other_namespaces || left.is_empty() {
        return Ok(done);
    }
    let mut failed = None;
    let walked = netns::for_each_other(|| {
        match destroy(&left) {
            Ok(found) => {
                for cookie in found {
                    left.remove(&cookie);
                    done.cookies.push(cookie);
                }
            }
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
        !left.is_empty()
    });
    if let Err(e) = walked {
        failed = Some(e);
    }
    done.not_searched = failed.map(|e| (e, left.len()));
    Ok(done)
}

/// Whether this kernel can destroy sockets (`CONFIG_INET_DIAG_DESTROY`):
/// asks to destroy a socket that cannot exist; "no such socket" means yes.
pub fn supported() -> bool {
    let probe = || -> io::Result<()> {
        let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        let mut id = SocketId::new_v4();
        id.cookie = [0xfe; 8];
        destroy_one(&socket, AF_INET, id)
    };
    match probe() {
        Ok(()) => true,
        Err(e) => e.raw_os_error() == Some(libc::ENOENT),
    }
}

fn request(family: u8, socket_id: SocketId) -> SockDiagMessage {
    SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        states: live_states(),
        socket_id,
    })
}

fn send<T: netlink_packet_core::NetlinkSerializable>(
    socket: &Socket,
    flags: u16,
    payload: T,
) -> io::Result<()> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    let mut message = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(payload));
    message.finalize();
    let mut buf = vec![0; message.buffer_len()];
    message.serialize(&mut buf);
    socket.send(&buf, 0)?;
    Ok(())
}

/// Lists the live TCP sockets of one address family: (family, id with cookie).
fn dump(socket: &Socket, family: u8) -> io::Result<Vec<(u8, SocketId)>> {
    let any = if family == AF_INET { SocketId::new_v4() } else { SocketId::new_v6() };
    send(socket, NLM_F_REQUEST | NLM_F_DUMP, request(family, any))?;
    let mut found = Vec::new();
    loop {
        let (buf, _) = socket.recv_from_full()?;
        let mut offset = 0;
        while offset < buf.len() {
            let message =
                NetlinkMessage::<SockDiagMessage>::deserialize(&buf[offset..]).map_err(|e| {
                    io::Error::new(io::ErrorKind::InvalidData, format!("sock_diag dump: {e}"))
                })?;
            let len = message.header.length as usize;
            match message.payload {
                NetlinkPayload::Done(_) => return Ok(found),
                NetlinkPayload::Error(e) => return Err(e.to_io()),
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                    found.push((response.header.family, response.header.socket_id));
                }
                _ => {}
            }
            if len == 0 {
                break;
            }
            offset += len;
        }
    }
}

fn destroy_one(socket: &Socket, family: u8, id: SocketId) -> io::Result<()> {
    send(socket, NLM_F_REQUEST | NLM_F_ACK, SockDiagDestroy::new(request(family, id)))?;
    let (buf, _) = socket.recv_from_full()?;
    let message = NetlinkMessage::<SockDiagMessage>::deserialize(&buf).map_err(|e| {
        io::Error::new(io::ErrorKind::InvalidData, format!("sock_diag destroy: {e}"))
    })?;
    match message.payload {
        NetlinkPayload::Error(e) if e.code.is_some() => Err(e.to_io()),
        _ => Ok(()),
    }
}
