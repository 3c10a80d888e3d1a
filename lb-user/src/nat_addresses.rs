//! The external path's NAT source addresses beyond the node's own
//! address toward each server (`[daemon] nat_addresses`).
//!
//! A flow forwarded to a server leaves from one of the node's addresses
//! and one of its NAT ports (`nat_ports`); the ports of each address are
//! a pool of their own, so each address added is another pool as large
//! toward every server it can reach. An address serves a server if the
//! kernel would send to the server from it through the interface the
//! node reaches the server by (`ip route get SERVER from ADDRESS`): it
//! must be an address of this node, and the server's replies to it come
//! back where `lb_xdp` takes them. `lb_xdp` picks among a server's
//! addresses at random for each new flow (`NODE_ADDRESSES`).

use std::net::IpAddr;

use lb_common::MAX_NAT_ADDRESSES;

use crate::routes::{self, Route};

/// `[daemon] nat_addresses`: the addresses, or what is wrong with them.
/// At most [`MAX_NAT_ADDRESSES`] of each family; each a unicast address
/// (not loopback, unspecified or multicast), none twice.
pub fn parse(list: &[String]) -> Result<Vec<IpAddr>, String> {
    let mut addresses: Vec<IpAddr> = Vec::new();
    for text in list {
        let ip: IpAddr =
            text.trim().parse().map_err(|_| format!("{text:?} is not an IP address"))?;
        if ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() {
            return Err(format!("{ip} is not a unicast address another machine can answer"));
        }
        if addresses.contains(&ip) {
            return Err(format!("{ip} is listed twice"));
        }
        addresses.push(ip);
    }
    for (family, v4) in [("IPv4", true), ("IPv6", false)] {
        if addresses.iter().filter(|ip| ip.is_ipv4() == v4).count() > MAX_NAT_ADDRESSES {
            return Err(format!("more than {MAX_NAT_ADDRESSES} {family} addresses"));
        }
    }
    Ok(addresses)
}

/// Which of `configured` can be NAT sources toward `server`, reached by
/// `route`: those of its family, other than the route's own source, from
/// which the kernel would send to it through the same interface; and why
/// each of the others of its family cannot.
pub fn toward(
    server: IpAddr,
    route: &Route,
    configured: &[IpAddr],
) -> (Vec<IpAddr>, Vec<(IpAddr, String)>) {
    let (mut usable, mut not) = (Vec::new(), Vec::new());
    for &address in configured {
        if address.is_ipv4() != server.is_ipv4() || address == route.source {
            continue;
        }
        match routes::route_from(server, address) {
            Ok(from) if from.ifindex == route.ifindex => usable.push(address),
            Ok(_) => not.push((address, "the kernel sends from it by another interface".into())),
            Err(e) => not.push((address, e.to_string())),
        }
    }
    (usable, not)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nat_addresses_are_unicast_distinct_and_bounded() {
        let list = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            parse(&list(&["198.18.2.10", "2001:2::10"])),
            Ok(vec!["198.18.2.10".parse().unwrap(), "2001:2::10".parse().unwrap()])
        );
        assert_eq!(parse(&[]), Ok(vec![]));
        for (bad, says) in [
            (vec!["nope"], "not an IP address"),
            (vec!["127.0.0.2"], "not a unicast"),
            (vec!["0.0.0.0"], "not a unicast"),
            (vec!["ff02::1"], "not a unicast"),
            (vec!["198.18.2.10", "198.18.2.10"], "twice"),
        ] {
            let why = parse(&list(&bad)).expect_err(says);
            assert!(why.contains(says), "{bad:?}: {why}");
        }
        let eight: Vec<String> = (10..18).map(|i| format!("198.18.2.{i}")).collect();
        assert!(parse(&eight).unwrap_err().contains("more than 7 IPv4"));
    }

    #[test]
    fn only_addresses_the_kernel_sends_from_by_the_same_interface_serve() {
        let server: IpAddr = [127, 0, 0, 1].into();
        let route = routes::route_to(server).unwrap();
        let configured: Vec<IpAddr> = vec![
            [127, 0, 0, 1].into(),
            [127, 0, 0, 9].into(),
            [198, 19, 255, 1].into(),
            "::1".parse().unwrap(),
        ];
        let (usable, not) = toward(server, &route, &configured);
        // Loopback's own source is skipped, another loopback address
        // serves, an address that is not the node's does not, and IPv6 is
        // another family.
        assert_eq!(usable, vec![IpAddr::from([127, 0, 0, 9])]);
        assert_eq!(not.len(), 1, "{not:?}");
        assert_eq!(not[0].0, IpAddr::from([198, 19, 255, 1]));
    }
}
