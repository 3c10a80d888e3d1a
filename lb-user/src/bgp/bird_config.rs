//! The BIRD 2 config lb writes (pure: settings and routes in, text out):
//! one BGP session per `[[bgp.peer]]`, exporting only the VIP host routes
//! lb gives it (static blackhole routes inside BIRD: BIRD has no kernel
//! protocol here, so it never touches the node's own routing table), BFD
//! on the sessions that ask for it, and nothing imported.

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr},
};

use crate::config::Bgp;

/// BFD's transmit interval and detection multiplier on lb's side: a peer
/// silent for 3 × 100 ms is down (within the 1 s the routers must
/// withdraw a dead node in).
pub const BFD_INTERVAL_MS: u32 = 100;
/// See [`BFD_INTERVAL_MS`].
pub const BFD_MULTIPLIER: u32 = 3;
/// The BGP protocols' names: `lb_peer0` for the first `[[bgp.peer]]`.
pub const PEER_PREFIX: &str = "lb_peer";

/// The config for `bgp` with `router_id`, announcing `routes` (each VIP's
/// host route: /32, /128). IPv4 routes go to IPv4 peers, IPv6 routes to
/// IPv6 peers.
pub fn render(bgp: &Bgp, router_id: Ipv4Addr, routes: &BTreeSet<IpAddr>) -> String {
    let mut text =
        String::from("# Written by lb for the BIRD it runs; rewritten at every change.\n");
    let _ = writeln!(text, "router id {router_id};");
    text.push_str("protocol device {}\n");
    if bgp.peers.iter().any(|p| p.bfd) {
        let _ = writeln!(
            text,
            "protocol bfd lb_bfd {{ interface \"*\" {{ interval {BFD_INTERVAL_MS} ms; multiplier {BFD_MULTIPLIER}; }}; }}"
        );
    }
    for (family, suffix) in [("ipv4", "32"), ("ipv6", "128")] {
        let _ = writeln!(text, "protocol static lb_vips_{family} {{");
        let _ = writeln!(text, "  {family};");
        for ip in routes.iter().filter(|ip| ip.is_ipv4() == (family == "ipv4")) {
            let _ = writeln!(text, "  route {ip}/{suffix} blackhole;");
        }
        text.push_str("}\n");
    }
    for (i, peer) in bgp.peers.iter().enumerate() {
        let family = if peer.address.is_ipv4() { "ipv4" } else { "ipv6" };
        let _ = writeln!(text, "protocol bgp {PEER_PREFIX}{i} {{");
        let _ = writeln!(text, "  local as {};", bgp.asn);
        let _ = writeln!(text, "  neighbor {} as {};", peer.address, peer.asn);
        if peer.bfd {
            text.push_str("  bfd on;\n");
        }
        // Back soon after a failure (BFD down, a reset): BIRD's defaults
        // wait 60 s to 300 s.
        text.push_str("  error wait time 1, 30;\n  connect retry time 5;\n");
        let _ = writeln!(
            text,
            "  {family} {{ import none; export where proto = \"lb_vips_{family}\"; next hop self; }};"
        );
        text.push_str("}\n");
    }
    text
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::config::BgpPeer;

    #[test]
    fn each_family_goes_to_its_peers_and_bfd_where_asked() {
        let bgp = Bgp {
            asn: 64_512,
            router_id: None,
            peers: vec![
                BgpPeer { address: "198.18.10.1".parse().unwrap(), asn: 64_500, bfd: true },
                BgpPeer { address: "2001:2:0:10::1".parse().unwrap(), asn: 64_500, bfd: false },
            ],
            speaker: PathBuf::from("/usr/sbin/bird"),
            routes_outlive_daemon: std::time::Duration::from_secs(30),
        };
        let routes: BTreeSet<IpAddr> =
            ["198.18.1.100", "2001:2:0:1::100"].iter().map(|a| a.parse().unwrap()).collect();
        let text = render(&bgp, "198.18.10.2".parse().unwrap(), &routes);
        assert!(text.contains("router id 198.18.10.2;"), "{text}");
        assert!(
            text.contains(
                "protocol static lb_vips_ipv4 {\n  ipv4;\n  route 198.18.1.100/32 blackhole;\n}"
            ),
            "{text}"
        );
        assert!(text.contains("route 2001:2:0:1::100/128 blackhole;"), "{text}");
        assert!(text.contains("protocol bgp lb_peer0 {\n  local as 64512;\n  neighbor 198.18.10.1 as 64500;\n  bfd on;\n  error wait time 1, 30;\n  connect retry time 5;\n  ipv4 { import none; export where proto = \"lb_vips_ipv4\"; next hop self; };"), "{text}");
        assert!(
            text.contains("neighbor 2001:2:0:10::1 as 64500;\n  error wait time 1, 30;"),
            "no BFD asked: {text}"
        );
        assert!(text.contains("interval 100 ms; multiplier 3;"));
        assert!(!text.contains("protocol kernel"), "BIRD must not touch the node's routes");
        // Nothing to announce: the sessions stay, with no route.
        let empty = render(&bgp, "198.18.10.2".parse().unwrap(), &BTreeSet::new());
        assert!(!empty.contains("route "), "{empty}");
    }
}
