//! What one node knows of the other members (`membership.rs`): each
//! one's Lease as last seen through the watch, by this node's clock.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use super::membership_record::{Content, Lease};

/// The most writers of one Lease remembered (the oldest go first).
const WRITERS: usize = 8;

/// Another node, as its Lease was last seen.
#[derive(Clone, Debug)]
struct Peer {
    version: String,
    /// What its Lease says last, whoever wrote it.
    content: Content,
    /// When this node last saw the Lease change.
    seen_at: Instant,
    /// Since when it has been a member without a break, by this node's
    /// eyes.
    member_since: Instant,
    /// The claims of each identity that wrote the Lease lately, with when
    /// its last write was seen: only a write of the same identity takes
    /// them back. A write of another's (a second daemon with the node's
    /// name, a hand edit) neither withdraws nor renews the claims before
    /// it: they stand until they run out, and the node that made them,
    /// seeing the write, falls silent meanwhile.
    writers: BTreeMap<String, (BTreeSet<String>, Instant)>,
}

impl Peer {
    /// When each identity that claims `vip` in this Lease was last seen.
    fn claims<'a>(&'a self, vip: &'a str) -> impl Iterator<Item = Instant> + 'a {
        self.writers.values().filter(move |(c, _)| c.contains(vip)).map(|(_, seen)| *seen)
    }
}

/// The other members, by node name.
#[derive(Debug)]
pub(super) struct Peers {
    /// How long a membership lasts after its Lease was last seen to change.
    duration: Duration,
    hold_down: Duration,
    nodes: BTreeMap<String, Peer>,
}

/// A member that may hold a VIP, as placement weighs it.
pub(super) struct Candidate<'a> {
    pub node: &'a str,
    /// It has been a member for the hold-down.
    pub settled: bool,
    /// It claims the VIP.
    pub claims: bool,
}

impl Peers {
    pub(super) fn new(duration: Duration, hold_down: Duration) -> Self {
        Self { duration, hold_down, nodes: BTreeMap::new() }
    }

    /// Another node's Lease, seen at `now`. A Lease seen again unchanged
    /// (a list after a watch restarted) renews nothing.
    pub(super) fn apply(&mut self, lease: Lease, now: Instant) {
        let duration = self.duration;
        let Some(peer) = self.nodes.get_mut(&lease.node) else {
            let writers = [(lease.identity, (lease.content.claims.clone(), now))];
            let peer = Peer {
                version: lease.version,
                content: lease.content,
                seen_at: now,
                member_since: now,
                writers: writers.into_iter().collect(),
            };
            self.nodes.insert(lease.node, peer);
            return;
        };
        if peer.version == lease.version {
            return;
        }
        if peer.seen_at + duration <= now {
            peer.member_since = now;
        }
        peer.seen_at = now;
        peer.version = lease.version;
        peer.writers.retain(|_, (_, seen)| *seen + duration > now);
        peer.writers.insert(lease.identity, (lease.content.claims.clone(), now));
        while peer.writers.len() > WRITERS {
            let oldest = peer.writers.iter().min_by_key(|(_, (_, seen))| *seen);
            let Some(oldest) = oldest.map(|(identity, _)| identity.clone()) else { break };
            peer.writers.remove(&oldest);
        }
        peer.content = lease.content;
    }

    /// The members, at `now`, that can serve `vip`, counting silence only
    /// from `sighted` on: before then this node could not have seen their
    /// writes (its own were not landing), so their silence says nothing.
    pub(super) fn candidates<'a>(
        &'a self,
        vip: &'a str,
        now: Instant,
        sighted: Instant,
    ) -> impl Iterator<Item = Candidate<'a>> + 'a {
        let alive = move |seen: Instant| now < seen.max(sighted) + self.duration;
        let members = self.nodes.iter().filter(move |(_, p)| alive(p.seen_at));
        members.filter(|(_, p)| p.content.eligible.contains(vip)).map(move |(node, p)| Candidate {
            node,
            settled: p.member_since + self.hold_down <= now,
            claims: p.claims(vip).any(alive),
        })
    }

    /// Whether a claim of `vip` stands in the way of one made by a write
    /// sent at `sent`: its maker had not run out before then.
    pub(super) fn in_the_way(&self, vip: &str, sent: Instant) -> bool {
        self.nodes.values().flat_map(|p| p.claims(vip)).any(|seen| seen + self.duration > sent)
    }

    /// Whether `vip` is claimed only by members that have run out by
    /// `now`, some of them since `sent`: a write sent now settles it.
    pub(super) fn ran_out_since(&self, vip: &str, sent: Instant, now: Instant) -> bool {
        let mut claims = self.nodes.values().flat_map(|p| p.claims(vip)).peekable();
        claims.peek().is_some()
            && claims.all(|seen| seen + self.duration <= now && seen + self.duration > sent)
    }

    /// When a membership runs out or settles.
    pub(super) fn changes(&self) -> impl Iterator<Item = Instant> + '_ {
        self.nodes
            .values()
            .flat_map(|p| [p.seen_at + self.duration, p.member_since + self.hold_down])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whoever can write a node's Lease writes it as a thousand different
    /// identities, each claiming a VIP: the node's memory of writers stays
    /// at `WRITERS`, and the claims it keeps are the latest ones.
    #[test]
    fn a_flood_of_writers_to_one_lease_is_remembered_within_bounds() {
        let (duration, start) = (Duration::from_secs(60), Instant::now());
        let mut peers = Peers::new(duration, duration);
        for k in 0..1_000u32 {
            let vip = format!("198.18.1.{}", k % 250);
            let content = Content { eligible: [vip.clone()].into(), claims: [vip].into() };
            let lease = Lease {
                node: "node-b".into(),
                identity: format!("node-b_{k}"),
                version: k.to_string(),
                content,
            };
            peers.apply(lease, start + Duration::from_millis(u64::from(k)));
        }
        let peer = &peers.nodes["node-b"];
        assert_eq!(peer.writers.len(), WRITERS);
        assert!(peer.writers.contains_key("node-b_999"));
        assert!(!peer.writers.contains_key("node-b_0"));
    }
}
