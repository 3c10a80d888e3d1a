//! Which address each LoadBalancer Service gets: a pure function from the
//! pools and every Service's wishes to every Service's outcome.
//!
//! The record of what was given is the Services' own status (what they
//! were answered before, [`Wish::held`]): [`plan`] first gives every
//! Service what it holds if that is still a valid answer (oldest Service
//! first, so that of two Services claiming one address the elder keeps
//! it), and only then assigns the rest, in order of creation. So a restart,
//! a new allocator after an election, or a replan after any change moves
//! no address that is still valid, and the same inputs always give the
//! same outcome. Two Services get one address only when both ask to share
//! (the same sharing key) and no port of one is a port of the other.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use super::pools::{Family, Pool, number};

/// A Service, by namespace and name.
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct ServiceRef {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
}

impl fmt::Display for ServiceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A port of a Service as sharing sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortKey {
    /// TCP or UDP.
    pub udp: bool,
    /// The port number.
    pub port: u16,
}

impl fmt::Display for PortKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.port, if self.udp { "UDP" } else { "TCP" })
    }
}

/// Which families a Service's addresses are of (`spec.ipFamilies`,
/// `spec.ipFamilyPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Families {
    /// One address of this family (`SingleStack`).
    Single(Family),
    /// The first family's address, and the second's when the pool has one
    /// (`PreferDualStack`).
    PreferDual(Family, Family),
    /// One address of each family (`RequireDualStack`).
    RequireDual(Family, Family),
}

impl Families {
    fn required(self) -> Vec<Family> {
        match self {
            Self::Single(f) | Self::PreferDual(f, _) => vec![f],
            Self::RequireDual(a, b) => vec![a, b],
        }
    }

    fn wanted(self) -> Vec<Family> {
        match self {
            Self::Single(f) => vec![f],
            Self::PreferDual(a, b) | Self::RequireDual(a, b) => vec![a, b],
        }
    }

    /// Whether `addresses` are an answer: each family at most once, all
    /// wanted, every required one there.
    fn fit(self, addresses: &[IpAddr]) -> bool {
        let families: Vec<Family> = addresses.iter().map(|&ip| Family::of(ip)).collect();
        let once = families.iter().collect::<BTreeSet<_>>().len() == families.len();
        once && !families.is_empty()
            && families.iter().all(|f| self.wanted().contains(f))
            && self.required().iter().all(|f| families.contains(f))
    }
}

/// What a Service asks of the allocator, read from its spec, annotations
/// and status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wish {
    /// The Service.
    pub service: ServiceRef,
    /// Its `metadata.creationTimestamp` as seconds: the elder goes first.
    pub created: i64,
    /// Its families.
    pub families: Families,
    /// Addresses asked for by name (`spec.loadBalancerIP`, the IPs
    /// annotation): exactly these or none.
    pub requested: Vec<IpAddr>,
    /// The pool asked for by name (the pool annotation).
    pub pool: Option<String>,
    /// The sharing key (the allow-shared-ip annotation).
    pub sharing: Option<String>,
    /// Its ports.
    pub ports: Vec<PortKey>,
    /// The addresses its status shows: what it was given before.
    pub held: Vec<IpAddr>,
}

/// A Service's addresses and the pool they are from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assigned {
    /// One per family, in the order of the Service's families.
    pub addresses: Vec<IpAddr>,
    /// The pool's name.
    pub pool: String,
}

/// Why a Service got no address: the text of its Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Its pool annotation names no `[[pool]]`.
    UnknownPool(String),
    /// Its pool does not serve its namespace.
    PoolNotForNamespace {
        /// The pool.
        pool: String,
        /// The Service's namespace.
        namespace: String,
    },
    /// No pool it may draw from has an address of this family left (or
    /// at all).
    Exhausted {
        /// The family that is missing.
        family: Family,
        /// Its pool, if it named one.
        pool: Option<String>,
    },
    /// An address it asked for is in no pool it may draw from.
    NotInPool(IpAddr),
    /// The addresses it asked for do not fit its families.
    WrongFamilies(Vec<IpAddr>),
    /// An address it asked for is another Service's, which does not share.
    Taken {
        /// The address.
        address: IpAddr,
        /// The Service holding it.
        by: ServiceRef,
    },
    /// It may share the address, but a port clashes.
    PortClash {
        /// The address.
        address: IpAddr,
        /// The port both have.
        port: PortKey,
        /// The Service that has it.
        with: ServiceRef,
    },
    /// What its spec or annotations say cannot be read (from
    /// [`super::service`]).
    Unreadable(String),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownPool(pool) => write!(f, "no address pool is named {pool:?}"),
            Self::PoolNotForNamespace { pool, namespace } => {
                write!(f, "pool {pool:?} does not serve namespace {namespace:?}")
            }
            Self::Exhausted { family, pool: Some(pool) } => {
                write!(f, "pool {pool:?} has no {family} address left")
            }
            Self::Exhausted { family, pool: None } => {
                write!(f, "no pool this Service may draw from has an {family} address left")
            }
            Self::NotInPool(ip) => write!(f, "{ip} is in no pool this Service may draw from"),
            Self::WrongFamilies(ips) => {
                let ips: Vec<String> = ips.iter().map(ToString::to_string).collect();
                write!(f, "the requested addresses [{}] do not fit spec.ipFamilies", ips.join(", "))
            }
            Self::Taken { address, by } => {
                write!(f, "{address} is taken by {by}, which does not share it with this Service")
            }
            Self::PortClash { address, port, with } => {
                write!(f, "{address} is shared with {with}, which already has port {port}")
            }
            Self::Unreadable(why) => f.write_str(why),
        }
    }
}

/// A Service's outcome.
pub type Outcome = Result<Assigned, Refusal>;

/// Who holds one address.
struct Holder {
    sharing: Option<String>,
    users: Vec<(ServiceRef, Vec<PortKey>)>,
}

/// The addresses given so far in one [`plan`].
#[derive(Default)]
struct Book {
    holders: BTreeMap<IpAddr, Holder>,
    used: BTreeMap<Family, BTreeSet<u128>>,
}

impl Book {
    /// Whether `wish` may have `ip`: free, or shared on purpose without a
    /// port in common.
    fn may_take(&self, wish: &Wish, ip: IpAddr) -> Result<(), Refusal> {
        let Some(holder) = self.holders.get(&ip) else { return Ok(()) };
        let by = holder.users[0].0.clone();
        if wish.sharing.is_none() || holder.sharing != wish.sharing {
            return Err(Refusal::Taken { address: ip, by });
        }
        for (with, ports) in &holder.users {
            if let Some(&port) = wish.ports.iter().find(|p| ports.contains(p)) {
                return Err(Refusal::PortClash { address: ip, port, with: with.clone() });
            }
        }
        Ok(())
    }

    fn take(&mut self, wish: &Wish, ip: IpAddr) {
        self.used.entry(Family::of(ip)).or_default().insert(number(ip));
        let holder = self
            .holders
            .entry(ip)
            .or_insert_with(|| Holder { sharing: wish.sharing.clone(), users: Vec::new() });
        holder.users.push((wish.service.clone(), wish.ports.clone()));
    }

    /// An address of `family` in `pool` for `wish`: one it may share
    /// first (a shared key is asked for to be used), else the lowest
    /// free one.
    fn find(&self, pool: &Pool, family: Family, wish: &Wish) -> Option<IpAddr> {
        if wish.sharing.is_some() {
            let shared = self.holders.keys().find(|&&ip| {
                Family::of(ip) == family && pool.contains(ip) && self.may_take(wish, ip).is_ok()
            });
            if let Some(&ip) = shared {
                return Some(ip);
            }
        }
        let used = self.used.get(&family).cloned().unwrap_or_default();
        pool.ranges.iter().filter(|r| r.family() == family).find_map(|r| r.first_free(&used))
    }
}

/// Every Service's outcome. `wishes` may come in any order.
pub fn plan(pools: &[Pool], wishes: &[Wish]) -> BTreeMap<ServiceRef, Outcome> {
    let mut order: Vec<&Wish> = wishes.iter().collect();
    order.sort_by(|a, b| (a.created, &a.service).cmp(&(b.created, &b.service)));
    let mut book = Book::default();
    let mut outcomes = BTreeMap::new();
    // First what each holds, if it is still an answer to what it asks.
    for wish in &order {
        if let Some(assigned) = keep(pools, &book, wish) {
            for &ip in &assigned.addresses {
                book.take(wish, ip);
            }
            outcomes.insert(wish.service.clone(), Ok(assigned));
        }
    }
    // Then the rest.
    for wish in &order {
        if outcomes.contains_key(&wish.service) {
            continue;
        }
        let outcome = assign(pools, &book, wish);
        if let Ok(assigned) = &outcome {
            for &ip in &assigned.addresses {
                book.take(wish, ip);
            }
        }
        outcomes.insert(wish.service.clone(), outcome);
    }
    outcomes
}

/// The pools `wish` may draw from: the one it names (even if not
/// auto-assigned), or every auto-assigned pool serving its namespace.
fn pools_for<'p>(pools: &'p [Pool], wish: &Wish) -> Result<Vec<&'p Pool>, Refusal> {
    let namespace = &wish.service.namespace;
    match &wish.pool {
        Some(name) => {
            let pool = pools
                .iter()
                .find(|p| &p.name == name)
                .ok_or_else(|| Refusal::UnknownPool(name.clone()))?;
            if !pool.serves(namespace) {
                return Err(Refusal::PoolNotForNamespace {
                    pool: name.clone(),
                    namespace: namespace.clone(),
                });
            }
            Ok(vec![pool])
        }
        None => Ok(pools.iter().filter(|p| p.auto_assign && p.serves(namespace)).collect()),
    }
}

/// The pool holding every one of `addresses` that `wish` may draw from.
/// Addresses asked for by name may come from a pool that is not
/// auto-assigned.
fn pool_of<'p>(pools: &'p [Pool], wish: &Wish, addresses: &[IpAddr]) -> Result<&'p Pool, Refusal> {
    let allowed = |p: &&Pool| {
        p.serves(&wish.service.namespace) && wish.pool.as_ref().is_none_or(|n| n == &p.name)
    };
    let first = addresses[0];
    let pool = pools
        .iter()
        .filter(allowed)
        .find(|p| p.contains(first))
        .ok_or(Refusal::NotInPool(first))?;
    match addresses.iter().find(|&&ip| !pool.contains(ip)) {
        // Dual-stack addresses from two pools: each must still be allowed.
        Some(&other) if !pools.iter().filter(allowed).any(|p| p.contains(other)) => {
            Err(Refusal::NotInPool(other))
        }
        _ => Ok(pool),
    }
}

/// What `wish` holds, if it still answers what it asks.
fn keep(pools: &[Pool], book: &Book, wish: &Wish) -> Option<Assigned> {
    if wish.held.is_empty() || !wish.families.fit(&wish.held) {
        return None;
    }
    if !wish.requested.is_empty() && sorted(&wish.requested) != sorted(&wish.held) {
        return None;
    }
    let pool = pool_of(pools, wish, &wish.held).ok()?;
    if wish.held.iter().any(|&ip| book.may_take(wish, ip).is_err()) {
        return None;
    }
    Some(Assigned { addresses: wish.held.clone(), pool: pool.name.clone() })
}

fn sorted(ips: &[IpAddr]) -> Vec<IpAddr> {
    let mut ips = ips.to_vec();
    ips.sort();
    ips
}

/// A new answer for `wish`.
fn assign(pools: &[Pool], book: &Book, wish: &Wish) -> Outcome {
    if !wish.requested.is_empty() {
        if !wish.families.fit(&wish.requested) {
            return Err(Refusal::WrongFamilies(wish.requested.clone()));
        }
        let pool = pool_of(pools, wish, &wish.requested)?;
        for &ip in &wish.requested {
            book.may_take(wish, ip)?;
        }
        return Ok(Assigned { addresses: wish.requested.clone(), pool: pool.name.clone() });
    }
    let candidates = pools_for(pools, wish)?;
    // The first pool that gives every family wanted; else the first that
    // gives the required ones.
    let required = wish.families.required();
    let mut missing = required[0];
    for (families, last) in [(wish.families.wanted(), false), (required, true)] {
        for pool in &candidates {
            let found: Vec<Option<IpAddr>> =
                families.iter().map(|&f| book.find(pool, f, wish)).collect();
            match found.iter().position(Option::is_none) {
                None => {
                    return Ok(Assigned {
                        addresses: found.into_iter().flatten().collect(),
                        pool: pool.name.clone(),
                    });
                }
                Some(i) if last => missing = families[i],
                Some(_) => {}
            }
        }
    }
    Err(Refusal::Exhausted { family: missing, pool: wish.pool.clone() })
}

#[cfg(test)]
#[path = "allocate_tests.rs"]
mod tests;
