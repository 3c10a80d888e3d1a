//! Address pools (`[[pool]]`): named sets of addresses that LoadBalancer
//! Services draw from. A pool is a list of ranges, each written as a CIDR
//! (`198.18.5.0/28`), a first-last range (`198.18.1.100-198.18.1.110`) or
//! one address; a range holds one family. Addresses are handled as
//! numbers (`u128`), so that a pool of an IPv6 /64 costs no more than one
//! of four addresses: nothing here walks a range address by address.

use std::{
    collections::BTreeSet,
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;

/// An address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// The family of `ip`.
    pub fn of(ip: IpAddr) -> Self {
        if ip.is_ipv4() { Self::V4 } else { Self::V6 }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        })
    }
}

/// A range of addresses of one family, both ends included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressRange {
    family: Family,
    first: u128,
    last: u128,
}

impl AddressRange {
    /// Parses `198.18.5.0/28`, `198.18.1.100-198.18.1.110` or one address.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if let Some((first, last)) = text.split_once('-') {
            let first = parse_ip(first)?;
            let last = parse_ip(last)?;
            if Family::of(first) != Family::of(last) {
                return Err(format!("{text:?} mixes IPv4 and IPv6"));
            }
            let range = Self::between(first, last);
            if range.first > range.last {
                return Err(format!("{text:?} ends before it starts"));
            }
            return Ok(range);
        }
        if text.contains('/') {
            let net: IpNet = text.parse().map_err(|_| format!("{text:?} is not a CIDR"))?;
            if net.network() != net.addr() {
                return Err(format!(
                    "{text:?} has host bits set: write {} or a first-last range",
                    net.trunc()
                ));
            }
            return Ok(Self::between(net.network(), net.broadcast()));
        }
        let ip = parse_ip(text)?;
        Ok(Self::between(ip, ip))
    }

    fn between(first: IpAddr, last: IpAddr) -> Self {
        Self { family: Family::of(first), first: number(first), last: number(last) }
    }

    /// The range's family.
    pub fn family(&self) -> Family {
        self.family
    }

    /// Whether `ip` is in the range.
    pub fn contains(&self, ip: IpAddr) -> bool {
        Family::of(ip) == self.family && (self.first..=self.last).contains(&number(ip))
    }

    /// Whether the two ranges share an address.
    pub fn overlaps(&self, other: &Self) -> bool {
        self.family == other.family && self.first <= other.last && other.first <= self.last
    }

    /// The lowest address of the range not in `used` (addresses of this
    /// family as numbers), or `None` when every one is. Costs the number of
    /// used addresses in the range, never the range's size.
    pub fn first_free(&self, used: &BTreeSet<u128>) -> Option<IpAddr> {
        let mut candidate = self.first;
        for &taken in used.range(self.first..=self.last) {
            if taken != candidate {
                break;
            }
            if candidate == self.last {
                return None;
            }
            candidate += 1;
        }
        Some(address(self.family, candidate))
    }
}

impl fmt::Display for AddressRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let first = address(self.family, self.first);
        if self.first == self.last {
            write!(f, "{first}")
        } else {
            write!(f, "{first}-{}", address(self.family, self.last))
        }
    }
}

/// `ip` as a number, what [`AddressRange`] and the allocator order by.
pub fn number(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn address(family: Family, n: u128) -> IpAddr {
    match family {
        // Only ever called with numbers of an IPv4 range.
        Family::V4 => IpAddr::V4(Ipv4Addr::from(u32::try_from(n).unwrap_or(u32::MAX))),
        Family::V6 => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

fn parse_ip(text: &str) -> Result<IpAddr, String> {
    let ip: IpAddr =
        text.trim().parse().map_err(|_| format!("{:?} is not an IP address", text.trim()))?;
    if ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() {
        return Err(format!("{ip} is not a unicast address another machine can reach"));
    }
    Ok(ip)
}

/// One `[[pool]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    /// `name`: what Services name it by (annotations) and `lb status` shows.
    pub name: String,
    /// `addresses`.
    pub ranges: Vec<AddressRange>,
    /// `auto_assign` (default true): false keeps the pool for Services that
    /// name it or one of its addresses.
    pub auto_assign: bool,
    /// `namespaces`: the namespaces whose Services may draw from it; empty:
    /// every namespace.
    pub namespaces: Vec<String>,
    /// `announce = "bgp"`: its addresses are announced by BGP, by every
    /// node that can serve them; otherwise (`"arp"`, the default) by ARP
    /// and NDP, by one node elected.
    pub by_bgp: bool,
}

impl Pool {
    /// A pool named `name` of `ranges` (as `[[pool]] addresses` writes
    /// them), assigned automatically, to every namespace: the config's
    /// defaults.
    pub fn new(name: &str, ranges: &[&str]) -> Result<Self, String> {
        Ok(Self {
            name: name.to_owned(),
            ranges: ranges.iter().map(|r| AddressRange::parse(r)).collect::<Result<_, _>>()?,
            auto_assign: true,
            namespaces: Vec::new(),
            by_bgp: false,
        })
    }

    /// Whether `ip` is one of the pool's.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.ranges.iter().any(|r| r.contains(ip))
    }

    /// Whether Services of `namespace` may draw from the pool.
    pub fn serves(&self, namespace: &str) -> bool {
        self.namespaces.is_empty() || self.namespaces.iter().any(|n| n == namespace)
    }

    /// Whether the pool has addresses of `family`.
    pub fn has(&self, family: Family) -> bool {
        self.ranges.iter().any(|r| r.family == family)
    }
}

/// Checks a set of pools against each other: names unique, no address in
/// two pools (a Service's pool must be one answer). Returns what is wrong.
pub fn check_pools(pools: &[Pool]) -> Result<(), String> {
    for (i, pool) in pools.iter().enumerate() {
        for other in &pools[..i] {
            if other.name == pool.name {
                return Err(format!("two pools are named {:?}", pool.name));
            }
        }
        for (j, range) in pool.ranges.iter().enumerate() {
            for other in &pools[..=i] {
                let earlier =
                    if other.name == pool.name { &other.ranges[..j] } else { &other.ranges };
                if let Some(clash) = earlier.iter().find(|r| r.overlaps(range)) {
                    return Err(format!(
                        "{range} of pool {:?} overlaps {clash} of pool {:?}: an address must \
                         belong to one pool",
                        pool.name, other.name
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn ranges_are_read_in_three_forms_and_bad_ones_say_why() {
        let cidr = AddressRange::parse("198.18.5.0/30").unwrap();
        assert!(cidr.contains(ip("198.18.5.0")) && cidr.contains(ip("198.18.5.3")));
        assert!(!cidr.contains(ip("198.18.5.4")) && !cidr.contains(ip("fd00::1")));
        let dash = AddressRange::parse("198.18.1.100 - 198.18.1.110").unwrap();
        assert_eq!(dash.to_string(), "198.18.1.100-198.18.1.110");
        let one = AddressRange::parse("fd00:198:18::7").unwrap();
        assert_eq!(one.family(), Family::V6);
        assert_eq!(one.to_string(), "fd00:198:18::7");

        for (bad, why) in [
            ("198.18.1.10-198.18.1.1", "ends before it starts"),
            ("198.18.1.1-fd00::1", "mixes IPv4 and IPv6"),
            ("198.18.5.1/28", "host bits set: write 198.18.5.0/28"),
            ("198.18.5.0/33", "not a CIDR"),
            ("pool", "not an IP address"),
            ("127.0.0.1", "not a unicast address"),
            ("224.0.0.1-224.0.0.9", "not a unicast address"),
        ] {
            let error = AddressRange::parse(bad).unwrap_err();
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn the_first_free_address_costs_the_used_ones_not_the_range() {
        let huge = AddressRange::parse("fd00:198:18::/64").unwrap();
        let mut used = BTreeSet::new();
        assert_eq!(huge.first_free(&used), Some(ip("fd00:198:18::")));
        used.extend([number(ip("fd00:198:18::")), number(ip("fd00:198:18::1"))]);
        used.insert(number(ip("fd00:198:18::3")));
        assert_eq!(huge.first_free(&used), Some(ip("fd00:198:18::2")));

        let small = AddressRange::parse("198.18.1.1-198.18.1.2").unwrap();
        let mut used: BTreeSet<u128> = [number(ip("198.18.1.1"))].into();
        assert_eq!(small.first_free(&used), Some(ip("198.18.1.2")));
        used.insert(number(ip("198.18.1.2")));
        assert_eq!(small.first_free(&used), None, "full");
        let top = AddressRange::parse("255.255.255.254-255.255.255.255");
        assert!(top.is_ok(), "the last IPv4 address does not overflow");
    }

    #[test]
    fn pools_may_not_share_an_address_or_a_name() {
        let pool = |name: &str, ranges: &[&str]| Pool::new(name, ranges).unwrap();
        let a = pool("a", &["198.18.1.100-198.18.1.110", "fd00:198:18::100/124"]);
        let b = pool("b", &["198.18.5.0/28"]);
        assert_eq!(check_pools(&[a.clone(), b.clone()]), Ok(()));
        let error = check_pools(&[a.clone(), pool("c", &["198.18.1.110"])]).unwrap_err();
        assert!(error.contains("198.18.1.110 of pool \"c\" overlaps 198.18.1.100-198.18.1.110"));
        let error = check_pools(&[pool("d", &["198.18.5.0/28", "198.18.5.8"])]).unwrap_err();
        assert!(error.contains("overlaps"), "{error}");
        let error = check_pools(&[a.clone(), pool("a", &["198.18.9.1"])]).unwrap_err();
        assert!(error.contains("two pools are named \"a\""), "{error}");
    }
}
