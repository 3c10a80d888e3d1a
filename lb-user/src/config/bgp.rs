//! `[bgp]` and its `[[bgp.peer]]` tables: the BGP speaker lb runs (BIRD)
//! to announce the VIPs of services with `announce = "bgp"`.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    time::Duration,
};

use super::{
    model::{Bgp, BgpPeer},
    problems::{Key, Problem},
    raw::RawBgp,
    values::parse_duration,
};

/// Where lb finds BIRD when `[bgp] speaker` does not say.
pub const DEFAULT_SPEAKER: &str = "/usr/sbin/bird";
/// `[bgp] routes_outlive_daemon` when not set: longer than a restart by
/// systemd or a container runtime takes, short enough that a node whose
/// daemon is gone stops attracting traffic it no longer checks.
pub const DEFAULT_ROUTES_OUTLIVE_DAEMON: Duration = Duration::from_secs(30);
/// The shortest `routes_outlive_daemon`: the daemon renews every second.
const SHORTEST_ROUTES_OUTLIVE_DAEMON: Duration = Duration::from_secs(2);

/// The `[bgp]` settings, or the problems with them.
pub(super) fn parse_bgp(raw: RawBgp, problems: &mut Vec<Problem>) -> Option<Bgp> {
    let before = problems.len();
    let mut problem = |key: String, what: String| problems.push(Problem::new(None, key, what));
    let asn = as_number(raw.asn, "bgp.asn".to_owned(), &mut problem);
    let router_id = raw.router_id.as_deref().and_then(|text| match text.parse::<Ipv4Addr>() {
        Ok(id) if !id.is_unspecified() => Some(id),
        _ => {
            problem(
                "bgp.router_id".to_owned(),
                format!("{text:?} is not a router ID: write an IPv4 address, e.g. \"198.18.10.2\""),
            );
            None
        }
    });
    if raw.peer.is_empty() {
        problem(
            "bgp.peer".to_owned(),
            "lists no peer: add a [[bgp.peer]] with the router's address and AS number".to_owned(),
        );
    }
    let mut peers: Vec<BgpPeer> = Vec::with_capacity(raw.peer.len());
    for (i, peer) in raw.peer.into_iter().enumerate() {
        let key = |at: &str| format!("bgp.peer[{i}].{at}");
        let address = match peer.address.parse::<IpAddr>() {
            Ok(a) if !(a.is_unspecified() || a.is_multicast() || a.is_loopback()) => Some(a),
            _ => {
                problem(key("address"), format!("{:?} is not a peer's address", peer.address));
                None
            }
        };
        let asn = as_number(peer.asn, key("asn"), &mut problem);
        if let Some(address) = address {
            if peers.iter().any(|p| p.address == address) {
                problem(key("address"), format!("{address} is listed twice"));
            }
            peers.push(BgpPeer { address, asn, bfd: peer.bfd.unwrap_or(true) });
        }
    }
    let speaker = raw.speaker.unwrap_or_else(|| PathBuf::from(DEFAULT_SPEAKER));
    if !speaker.is_absolute() {
        problem(
            "bgp.speaker".to_owned(),
            format!("{} is not an absolute path (e.g. {DEFAULT_SPEAKER})", speaker.display()),
        );
    }
    let key = Key::top("bgp.routes_outlive_daemon");
    let routes_outlive_daemon = match raw.routes_outlive_daemon {
        None => DEFAULT_ROUTES_OUTLIVE_DAEMON,
        Some(text) => match parse_duration(&text, None, key, problems) {
            Some(d) if d < SHORTEST_ROUTES_OUTLIVE_DAEMON => {
                problems.push(Problem::new(
                    None,
                    key,
                    format!(
                        "{text:?} is shorter than {SHORTEST_ROUTES_OUTLIVE_DAEMON:?}: the daemon renews its routes every second"
                    ),
                ));
                Duration::ZERO
            }
            d => d.unwrap_or_default(),
        },
    };
    (problems.len() == before).then_some(Bgp {
        asn,
        router_id,
        peers,
        speaker,
        routes_outlive_daemon,
    })
}

/// A 4-byte AS number (RFC 6793), never 0 or the reserved 23456 and
/// 4294967295.
fn as_number(value: i64, key: String, problem: &mut impl FnMut(String, String)) -> u32 {
    match u32::try_from(value) {
        Ok(asn) if asn != 0 && asn != 23_456 && asn != u32::MAX => asn,
        _ => {
            problem(key, format!("{value} is not an AS number (1-4294967294, not 23456)"));
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Announce, Config};

    const SERVICE: &str = "[[service]]\nname = \"web\"\nvip = \"198.18.1.100:80\"\n\
        servers = [\"198.18.2.2:8080\"]\n[service.external]\ninterfaces = [\"eth1\"]\nannounce = \"bgp\"\n";

    fn parse(bgp: &str) -> Result<Config, String> {
        Config::parse(&format!("{bgp}{SERVICE}"), std::path::Path::new("test.toml"))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_bgp_table_with_its_defaults() {
        let config =
            parse("[bgp]\nasn = 64512\n[[bgp.peer]]\naddress = \"198.18.10.1\"\nasn = 64500\n")
                .unwrap();
        let bgp = config.daemon.bgp.unwrap();
        assert_eq!((bgp.asn, bgp.router_id), (64_512, None));
        assert_eq!(bgp.peers.len(), 1);
        assert!(bgp.peers[0].bfd, "BFD by default");
        assert_eq!(bgp.speaker, std::path::PathBuf::from(super::DEFAULT_SPEAKER));
        assert_eq!(bgp.routes_outlive_daemon, super::DEFAULT_ROUTES_OUTLIVE_DAEMON);
        assert_eq!(config.services[0].external.as_ref().unwrap().announce, Announce::Bgp);
    }

    #[test]
    fn bad_bgp_settings_are_named() {
        let text = parse(
            "[bgp]\nasn = 0\nrouter_id = \"fd00::1\"\nspeaker = \"bird\"\nroutes_outlive_daemon = \"1s\"\n\
             [[bgp.peer]]\naddress = \"nowhere\"\nasn = 4294967295\n\
             [[bgp.peer]]\naddress = \"198.18.10.1\"\nasn = 64500\n\
             [[bgp.peer]]\naddress = \"198.18.10.1\"\nasn = 64500\n",
        )
        .unwrap_err();
        for expected in [
            "bgp.asn: 0 is not an AS number",
            "bgp.router_id: \"fd00::1\" is not a router ID",
            "bgp.speaker: bird is not an absolute path",
            "bgp.peer[0].address: \"nowhere\" is not a peer's address",
            "bgp.peer[0].asn: 4294967295 is not an AS number",
            "bgp.peer[2].address: 198.18.10.1 is listed twice",
            "bgp.routes_outlive_daemon: \"1s\" is shorter than 2s",
        ] {
            assert!(text.contains(expected), "{expected:?} not in {text}");
        }
        let none = parse("[bgp]\nasn = 64512\n").unwrap_err();
        assert!(none.contains("bgp.peer: lists no peer"), "{none}");
        assert!(!none.contains("needs a [bgp] table"), "told twice: {none}");
        let never = parse(
            "[bgp]\nasn = 64512\nroutes_outlive_daemon = \"forever\"\n\
             [[bgp.peer]]\naddress = \"198.18.10.1\"\nasn = 64500\n",
        )
        .unwrap_err();
        assert!(
            never.contains("bgp.routes_outlive_daemon: \"forever\" is not a duration"),
            "{never}"
        );
    }
}
