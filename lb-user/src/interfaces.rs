//! Which XDP program an interface runs, asked over netlink (`RTM_GETLINK`,
//! what `ip link show` reports as `prog/xdp id`): a pinned XDP link of
//! lb's whose interface went away, or was renamed, or was created anew
//! under the same name, must be found out, not trusted by its pin's name.

use std::io;

use netlink_packet_core::{NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{LinkAttribute, LinkMessage, LinkXdp},
};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_ROUTE};

use crate::routes;

/// The id of the XDP program interface `name` runs (natively or
/// generically), `None` if it runs none; an error of kind `NotFound` if
/// there is no such interface.
pub fn xdp_program_id(name: &str) -> io::Result<Option<u32>> {
    let index = routes::ifindex(name)
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no interface {name}")))?;
    let mut message = LinkMessage::default();
    message.header.index = index;
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&NetlinkAddr::new(0, 0))?;
    routes::send(&socket, NLM_F_REQUEST, RouteNetlinkMessage::GetLink(message))?;
    let (buf, _) = socket.recv_from_full()?;
    let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("RTM_GETLINK: {e}")))?;
    let link = match reply.payload {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => link,
        NetlinkPayload::Error(e) => return Err(e.to_io()),
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("RTM_GETLINK answered with {other:?}"),
            ));
        }
    };
    let mut id = None;
    for attribute in link.attributes {
        if let LinkAttribute::Xdp(xdp) = attribute {
            for nla in xdp {
                match nla {
                    LinkXdp::ProgId(p) | LinkXdp::DrvProgId(p) | LinkXdp::SkbProgId(p)
                        if p != 0 =>
                    {
                        id = Some(p);
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_runs_no_xdp_and_a_missing_interface_is_not_found() {
        assert_eq!(xdp_program_id("lo").unwrap(), None);
        let missing = xdp_program_id("no-such-if").unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
    }
}
