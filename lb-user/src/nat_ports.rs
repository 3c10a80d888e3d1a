//! The external path's NAT ports kept from the node's own connections.
//!
//! `lb_xdp` takes packets to the node's address on a NAT port
//! (`[daemon] nat_ports`, by default [`DEFAULT`]) as replies to its flows. A
//! connection the node itself makes from one of those ports (its
//! ephemeral range, `net.ipv4.ip_local_port_range`, reaching that far)
//! would have its replies taken for a flow's, or lost. So while lb serves
//! an external VIP, the ports are reserved in the node's network namespace
//! (`net.ipv4.ip_local_reserved_ports`, which IPv6 follows too): the
//! kernel skips them when it picks an ephemeral port. An overlapping
//! ephemeral range is warned about, as it leaves the node fewer ports.
//! The reservation is added to whatever the list held, and stays when lb
//! stops (flows may outlive the daemon: fail-static).

use std::ops::RangeInclusive;

use lb_common::NAT_PORT_FIRST;

/// Where the reserved ports are listed.
const RESERVED: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";
/// The node's ephemeral port range.
const EPHEMERAL: &str = "/proc/sys/net/ipv4/ip_local_port_range";

/// The NAT ports by default: the ports above Linux's default ephemeral
/// range (32768-60999), 4,536 per server and node address.
pub const DEFAULT: RangeInclusive<u16> = NAT_PORT_FIRST..=u16::MAX;
/// The fewest NAT ports `[daemon] nat_ports` may name: fewer would refuse
/// flows at a few hundred a second.
pub const MIN_COUNT: u32 = 1_024;
/// The lowest port `[daemon] nat_ports` may start at: ports below are
/// servers' (privileged, or well known).
pub const MIN_FIRST: u16 = 1_024;

/// `[daemon] nat_ports`, `"FIRST-LAST"` as `ip_local_port_range` reads:
/// the range, or what is wrong with it.
pub fn parse(text: &str) -> Result<RangeInclusive<u16>, String> {
    let (first, last) = text
        .split_once('-')
        .map(|(a, b)| (a.trim().parse::<u16>(), b.trim().parse::<u16>()))
        .ok_or_else(|| format!("{text:?} is not a range \"FIRST-LAST\" (as \"61000-65535\")"))?;
    let (Ok(first), Ok(last)) = (first, last) else {
        return Err(format!("{text:?}: each end must be a port number (0-65535)"));
    };
    if first < MIN_FIRST {
        return Err(format!("{text:?} starts below {MIN_FIRST}: those ports are servers'"));
    }
    if u32::from(last) + 1 < u32::from(first) + MIN_COUNT {
        return Err(format!(
            "{text:?} names fewer than {MIN_COUNT} ports (per server and node address)"
        ));
    }
    Ok(first..=last)
}

/// What [`reserve`] found and did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// Whether it added the NAT ports to the reserved list (false: they
    /// were reserved already).
    pub added: bool,
    /// The node's ephemeral range, if it overlaps the NAT ports.
    pub overlap: Option<RangeInclusive<u16>>,
}

/// Reserves the NAT ports `nat` in this network namespace if they are not
/// yet, and says whether the ephemeral range overlaps them.
pub fn reserve(nat: &RangeInclusive<u16>) -> anyhow::Result<Reservation> {
    use anyhow::Context as _;
    let listed =
        std::fs::read_to_string(RESERVED).with_context(|| format!("reading {RESERVED}"))?;
    let ranges = parse_list(&listed).with_context(|| format!("{RESERVED}: {:?}", listed.trim()))?;
    let added = !covers(&ranges, nat);
    if added {
        let written = with_nat_ports(&ranges, nat);
        std::fs::write(RESERVED, &written)
            .with_context(|| format!("writing {written:?} to {RESERVED}"))?;
    }
    let ephemeral =
        std::fs::read_to_string(EPHEMERAL).with_context(|| format!("reading {EPHEMERAL}"))?;
    let ephemeral =
        parse_range(&ephemeral).with_context(|| format!("{EPHEMERAL}: {:?}", ephemeral.trim()))?;
    let overlap =
        (ephemeral.start() <= nat.end() && nat.start() <= ephemeral.end()).then_some(ephemeral);
    Ok(Reservation { added, overlap })
}

/// The port ranges of a reserved-ports list: `"8080,61000-65535"`; empty
/// for an empty list.
fn parse_list(text: &str) -> anyhow::Result<Vec<RangeInclusive<u16>>> {
    text.trim()
        .split(',')
        .filter(|part| !part.trim().is_empty())
        .map(|part| match part.trim().split_once('-') {
            Some((first, last)) => Ok(first.trim().parse()?..=last.trim().parse()?),
            None => {
                let port = part.trim().parse()?;
                Ok(port..=port)
            }
        })
        .collect()
}

/// The ephemeral range: two numbers apart by whitespace.
fn parse_range(text: &str) -> anyhow::Result<RangeInclusive<u16>> {
    let mut numbers = text.split_whitespace().map(str::parse::<u16>);
    match (numbers.next(), numbers.next(), numbers.next()) {
        (Some(first), Some(last), None) => Ok(first?..=last?),
        _ => anyhow::bail!("not two port numbers"),
    }
}

/// Whether `ranges` together hold every port of `wanted`.
fn covers(ranges: &[RangeInclusive<u16>], wanted: &RangeInclusive<u16>) -> bool {
    // Bounded by the number of ranges: each pass moves `next` past one.
    let mut next = u32::from(*wanted.start());
    for _ in 0..=ranges.len() {
        if next > u32::from(*wanted.end()) {
            return true;
        }
        let Some(range) =
            ranges.iter().find(|r| u32::from(*r.start()) <= next && next <= u32::from(*r.end()))
        else {
            return false;
        };
        next = u32::from(*range.end()) + 1;
    }
    next > u32::from(*wanted.end())
}

/// The list to write: `ranges` as they were, and the NAT ports `nat`.
fn with_nat_ports(ranges: &[RangeInclusive<u16>], nat: &RangeInclusive<u16>) -> String {
    ranges
        .iter()
        .chain(std::iter::once(nat))
        .map(|r| {
            if r.start() == r.end() {
                r.start().to_string()
            } else {
                format!("{}-{}", r.start(), r.end())
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserved_list_is_read_as_the_kernel_writes_it() {
        assert_eq!(parse_list("\n").unwrap(), vec![]);
        assert_eq!(parse_list("8080,61000-65535\n").unwrap(), vec![8080..=8080, 61000..=65535]);
        assert!(parse_list("80-x").is_err());
        assert_eq!(parse_range("32768\t60999\n").unwrap(), 32768..=60999);
        assert!(parse_range("32768").is_err());
        assert!(parse_range("1 2 3").is_err());
    }

    #[test]
    fn the_nat_ports_are_added_only_where_not_all_reserved() {
        let nat = DEFAULT;
        assert!(!covers(&[], &nat));
        assert!(covers(&[1..=65535], &nat));
        assert!(covers(&[61000..=62000, 62001..=65535], &nat));
        assert!(covers(&[62001..=65535, 50000..=62000], &nat));
        assert!(!covers(&[61000..=62000, 62002..=65535], &nat));
        assert_eq!(with_nat_ports(&[], &nat), "61000-65535");
        assert_eq!(with_nat_ports(&[8080..=8080, 100..=200], &nat), "8080,100-200,61000-65535");
        assert_eq!(with_nat_ports(&[], &(40000..=65535)), "40000-65535");
    }

    #[test]
    fn a_nat_port_range_is_read_as_first_dash_last_and_bounded() {
        assert_eq!(parse("61000-65535"), Ok(DEFAULT));
        assert_eq!(parse(" 32768 - 65535 "), Ok(32768..=65535));
        assert_eq!(parse("1024-2047"), Ok(1024..=2047));
        for (bad, says) in [
            ("61000", "not a range"),
            ("a-65535", "port number"),
            ("61000-70000", "port number"),
            ("1023-65535", "starts below 1024"),
            ("64000-65000", "fewer than 1024"),
            ("65535-61000", "fewer than 1024"),
        ] {
            let why = parse(bad).expect_err(bad);
            assert!(why.contains(says) && why.contains(bad), "{bad}: {why}");
        }
    }
}
