//! The kernel's routes, asked over netlink (`RTM_GETROUTE`, what `ip route
//! get` does): which interface a server is reached through, and the node's
//! own address toward it. The external path's NAT uses that address as the
//! source of what it forwards, and the XDP program must run on that
//! interface, where the server's replies arrive.

use std::{
    ffi::{CStr, CString},
    io,
    net::{IpAddr, SocketAddr, UdpSocket},
};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload, NetlinkSerializable,
};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    neighbour::{
        NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
    },
    route::{RouteAddress, RouteAttribute, RouteMessage},
};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_ROUTE};

/// Where the kernel sends packets to one address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// The interface they leave by.
    pub ifindex: u32,
    /// The node's source address for them.
    pub source: IpAddr,
    /// Whose link-layer address they are sent to: the route's gateway, or
    /// the address itself when it is on the link.
    pub next_hop: IpAddr,
}

/// The kernel's route to `to`, from this network namespace's tables.
pub fn route_to(to: IpAddr) -> io::Result<Route> {
    ask_route(to, None)
}

/// The kernel's route to `to` for packets from `from` (`ip route get TO
/// from FROM`): an error if `from` is no address of this node, or the
/// kernel would not send from it there.
pub fn route_from(to: IpAddr, from: IpAddr) -> io::Result<Route> {
    ask_route(to, Some(from))
}

fn ask_route(to: IpAddr, from: Option<IpAddr>) -> io::Result<Route> {
    let mut message = RouteMessage::default();
    message.header.address_family =
        if to.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    message.header.destination_prefix_length = if to.is_ipv4() { 32 } else { 128 };
    message.attributes.push(RouteAttribute::Destination(RouteAddress::from(to)));
    if let Some(from) = from {
        message.header.source_prefix_length = if from.is_ipv4() { 32 } else { 128 };
        message.attributes.push(RouteAttribute::Source(RouteAddress::from(from)));
    }
    let get = RouteNetlinkMessage::GetRoute(message);
    let route = match request(NLM_F_REQUEST, get, "RTM_GETROUTE")? {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(route)) => route,
        other => return Err(unexpected("RTM_GETROUTE", &other)),
    };
    let mut ifindex = None;
    let mut source = None;
    let mut next_hop = to;
    for attribute in route.attributes {
        match attribute {
            RouteAttribute::Oif(index) => ifindex = Some(index),
            RouteAttribute::Gateway(RouteAddress::Inet(a)) => next_hop = IpAddr::V4(a),
            RouteAttribute::Gateway(RouteAddress::Inet6(a)) => next_hop = IpAddr::V6(a),
            RouteAttribute::PrefSource(RouteAddress::Inet(a)) => source = Some(IpAddr::V4(a)),
            RouteAttribute::PrefSource(RouteAddress::Inet6(a)) => source = Some(IpAddr::V6(a)),
            _ => {}
        }
    }
    let ifindex = ifindex.ok_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, format!("the route to {to} has no interface"))
    })?;
    let source = match source {
        Some(source) => source,
        None => source_toward(to)?,
    };
    Ok(Route { ifindex, source, next_hop })
}

/// Asks the kernel to resolve `route`'s next hop's link-layer address
/// now (a neighbour entry with `NTF_USE`, as a packet sent there would),
/// and to keep it fresh: the XDP program's FIB lookup finds only resolved
/// neighbours and does not start a resolution itself. An entry that is
/// already there is only used, not changed.
pub fn resolve_next_hop(route: &Route) -> io::Result<()> {
    let mut message = NeighbourMessage::default();
    message.header.family =
        if route.next_hop.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    message.header.ifindex = route.ifindex;
    message.header.state = NeighbourState::None;
    message.header.flags = NeighbourFlags::Use;
    message.attributes.push(NeighbourAttribute::Destination(match route.next_hop {
        IpAddr::V4(a) => NeighbourAddress::Inet(a),
        IpAddr::V6(a) => NeighbourAddress::Inet6(a),
    }));
    let flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE;
    request(flags, RouteNetlinkMessage::NewNeighbour(message), "RTM_NEWNEIGH")?;
    Ok(())
}

/// The source address the kernel gives a socket that dials `to`: a UDP
/// socket's connect sends nothing.
fn source_toward(to: IpAddr) -> io::Result<IpAddr> {
    let any: IpAddr = if to.is_ipv4() { [0, 0, 0, 0].into() } else { [0u16; 8].into() };
    let socket = UdpSocket::bind(SocketAddr::new(any, 0))?;
    socket.connect(SocketAddr::new(to, 9))?;
    Ok(socket.local_addr()?.ip())
}

/// The index of the interface `name` in this network namespace, if any.
pub fn ifindex(name: &str) -> Option<u32> {
    let name = CString::new(name).ok()?;
    // SAFETY: a valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
}

/// The name of the interface `index` in this network namespace, if any.
pub fn ifname(index: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` holds IF_NAMESIZE bytes, as if_indextoname requires.
    let name = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if name.is_null() {
        return None;
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into `buf`.
    Some(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

/// Sends `payload` (with `flags`; `what` names it in errors) to this
/// network namespace's routing netlink and returns the kernel's answer.
/// An error the kernel answers with is returned as an error; an
/// acknowledgement (an error message without a code) is an answer.
pub(crate) fn request<T: NetlinkSerializable>(
    flags: u16,
    payload: T,
    what: &str,
) -> io::Result<NetlinkPayload<RouteNetlinkMessage>> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&NetlinkAddr::new(0, 0))?;
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    let mut message = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(payload));
    message.finalize();
    let mut buf = vec![0; message.buffer_len()];
    message.serialize(&mut buf);
    socket.send(&buf, 0)?;
    let (buf, _) = socket.recv_from_full()?;
    let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{what}: {e}")))?;
    match reply.payload {
        NetlinkPayload::Error(e) if e.code.is_some() => Err(e.to_io()),
        payload => Ok(payload),
    }
}

/// An answer to `what` that is not the one expected.
pub(crate) fn unexpected(what: &str, answer: &NetlinkPayload<RouteNetlinkMessage>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{what} answered with {answer:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_reached_through_lo_from_itself() {
        let route = route_to([127, 0, 0, 1].into()).unwrap();
        assert_eq!(ifname(route.ifindex).as_deref(), Some("lo"));
        assert_eq!(route.source, IpAddr::from([127, 0, 0, 1]));
        assert_eq!(route.next_hop, IpAddr::from([127, 0, 0, 1]));
        assert_eq!(ifindex("lo"), Some(route.ifindex));
        assert_eq!(ifindex("no-such-if"), None);
        let from = route_from([127, 0, 0, 1].into(), [127, 0, 0, 2].into()).unwrap();
        assert_eq!(from.ifindex, route.ifindex);
    }
}
