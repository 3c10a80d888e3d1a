//! Which XDP program an interface runs, asked over netlink (`RTM_GETLINK`,
//! what `ip link show` reports as `prog/xdp id`): a pinned XDP link of
//! lb's whose interface went away, or was renamed, or was created anew
//! under the same name, must be found out, not trusted by its pin's name.

use std::io;

use netlink_packet_core::{NLM_F_REQUEST, NetlinkPayload};
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{LinkAttribute, LinkMessage, LinkXdp},
};

use crate::routes;

/// The id of the XDP program interface `name` runs (natively or
/// generically), `None` if it runs none; an error of kind `NotFound` if
/// there is no such interface.
pub fn xdp_program_id(name: &str) -> io::Result<Option<u32>> {
    let index = routes::ifindex(name)
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no interface {name}")))?;
    let mut message = LinkMessage::default();
    message.header.index = index;
    let get = RouteNetlinkMessage::GetLink(message);
    let link = match routes::request(NLM_F_REQUEST, get, "RTM_GETLINK")? {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => link,
        other => return Err(routes::unexpected("RTM_GETLINK", &other)),
    };
    let xdp = link.attributes.into_iter().filter_map(|attribute| match attribute {
        LinkAttribute::Xdp(xdp) => Some(xdp),
        _ => None,
    });
    Ok(xdp.flatten().find_map(|nla| match nla {
        LinkXdp::ProgId(id) | LinkXdp::DrvProgId(id) | LinkXdp::SkbProgId(id) if id != 0 => {
            Some(id)
        }
        _ => None,
    }))
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
