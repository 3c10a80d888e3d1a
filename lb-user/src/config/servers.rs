//! The one set of rules a server list (with its default) must follow to
//! serve a VIP, whatever its source: the config file, `lb servers`, the
//! state file, discovery.

use std::{collections::HashSet, net::SocketAddr};

use lb_common::MAX_SERVERS;

/// Where in a server set a [`ServerProblem`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// `servers[i]`.
    Server(usize),
    /// `default`.
    Default,
    /// The set as a whole.
    Set,
}

/// Why a server list (with its default) cannot serve a VIP. The same rules
/// and words for the config file, `lb servers`, the state file and
/// discovered lists: [`check_servers`] is the one place they are decided.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ServerProblem {
    /// A server without a port.
    #[error("{0} has port 0")]
    PortZero(SocketAddr),
    /// A server at 0.0.0.0 or `::`.
    #[error("{0} is the unspecified address")]
    Unspecified(SocketAddr),
    /// The same server twice.
    #[error("{0} is listed twice")]
    Duplicate(SocketAddr),
    /// A server of the other address family than the VIP.
    #[error(
        "{addr} is {} but the VIP {vip} is {}; a socket dialling the VIP cannot reach it",
        family(addr),
        family(vip)
    )]
    Family {
        /// The server.
        addr: SocketAddr,
        /// The service's VIP.
        vip: SocketAddr,
    },
    /// A server that is some service's VIP.
    #[error("{addr} is the VIP of {owner}; using it as a server would loop")]
    IsVip {
        /// The server.
        addr: SocketAddr,
        /// The service whose VIP it is.
        owner: String,
    },
    /// More servers than the kernel's selection holds.
    #[error("{count} servers (with the default), at most {MAX_SERVERS} are supported")]
    TooMany {
        /// How many there are, with the default.
        count: usize,
    },
}

/// Checks a server list and default for the service at `vip`.
/// `vip_owner(addr)` names the service whose VIP `addr` is, if any.
pub fn check_servers(
    vip: SocketAddr,
    servers: &[SocketAddr],
    default: Option<SocketAddr>,
    vip_owner: impl Fn(SocketAddr) -> Option<String>,
) -> Vec<(Slot, ServerProblem)> {
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    let slots = servers
        .iter()
        .enumerate()
        .map(|(i, a)| (Slot::Server(i), *a))
        .chain(default.map(|d| (Slot::Default, d)));
    for (slot, addr) in slots {
        if addr.port() == 0 {
            problems.push((slot, ServerProblem::PortZero(addr)));
        } else if addr.ip().is_unspecified() {
            problems.push((slot, ServerProblem::Unspecified(addr)));
        } else if addr.is_ipv4() != vip.is_ipv4() {
            problems.push((slot, ServerProblem::Family { addr, vip }));
        } else if let Some(owner) = vip_owner(addr) {
            problems.push((slot, ServerProblem::IsVip { addr, owner }));
        }
        // The default may also be in the list; a server twice may not.
        if !seen.insert(addr) && slot != Slot::Default {
            problems.push((slot, ServerProblem::Duplicate(addr)));
        }
    }
    if seen.len() > MAX_SERVERS {
        problems.push((Slot::Set, ServerProblem::TooMany { count: seen.len() }));
    }
    problems
}

/// [`check_servers`] as one error for a request or a file that is not the
/// config (`lb servers`, the state file): the problems joined by "; ".
pub fn validate_servers(
    vip: SocketAddr,
    servers: &[SocketAddr],
    default: Option<SocketAddr>,
    vip_owner: impl Fn(SocketAddr) -> Option<String>,
) -> Result<(), String> {
    let problems = check_servers(vip, servers, default, vip_owner);
    if problems.is_empty() {
        return Ok(());
    }
    let words: Vec<String> = problems
        .iter()
        .map(|(slot, problem)| match slot {
            Slot::Server(i) => format!("servers[{i}]: {problem}"),
            Slot::Default => format!("default: {problem}"),
            Slot::Set => format!("servers: {problem}"),
        })
        .collect();
    Err(words.join("; "))
}

const fn family(addr: &SocketAddr) -> &'static str {
    if addr.is_ipv4() { "IPv4" } else { "IPv6" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_server_check_for_every_source() {
        let vip: SocketAddr = "127.0.0.1:6444".parse().unwrap();
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let none = |_| None;
        assert_eq!(
            validate_servers(
                vip,
                &[a("127.0.0.1:1"), a("127.0.0.2:1")],
                Some(a("127.0.0.1:1")),
                none
            ),
            Ok(()),
            "the default may be listed"
        );
        let err = validate_servers(
            vip,
            &[a("127.0.0.1:0"), a("[::1]:1"), a("127.0.0.3:1"), a("127.0.0.3:1")],
            None,
            none,
        )
        .unwrap_err();
        assert_eq!(
            err,
            "servers[0]: 127.0.0.1:0 has port 0; servers[1]: [::1]:1 is IPv6 but the VIP 127.0.0.1:6444 is IPv4; a socket dialling the VIP cannot reach it; servers[3]: 127.0.0.3:1 is listed twice"
        );
        let err = validate_servers(vip, &[a("127.0.0.9:80")], None, |addr| {
            (addr == a("127.0.0.9:80")).then(|| "service \"db\"".to_owned())
        })
        .unwrap_err();
        assert_eq!(
            err,
            "servers[0]: 127.0.0.9:80 is the VIP of service \"db\"; using it as a server would loop"
        );
        let many: Vec<SocketAddr> =
            (1..=17).map(|i| SocketAddr::from(([127, 0, 1, i], 80))).collect();
        assert!(validate_servers(vip, &many, None, none).unwrap_err().contains("17 servers"));
    }
}
