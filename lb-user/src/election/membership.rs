//! One node's side of the elections by membership, as a pure state
//! machine over simulated time: one Lease per node (named after it, in
//! lb's namespace), renewed by that node, carrying what the node can
//! serve (`eligible`) and which VIPs it takes (`claims`); every node
//! watches every membership Lease and places each VIP by the same rule
//! (`placement`). The cost to the API server is one write per node per
//! renewal and one watch event per write per watching node, whatever the
//! number of VIPs.
//!
//! The rules:
//! - **Membership**: a node is a member, by its own clock, while its
//!   fence holds: the last write of its Lease that the API acknowledged
//!   was *sent* less than `duration - margin` ago. Another node counts it
//!   a member while it has seen its Lease change within `duration`, by
//!   that node's clock: the nodes' wall clocks never meet.
//! - **Placement**: a VIP's holder is the first, by `placement::first`,
//!   of the members eligible for it; but while that first has been a
//!   member for less than `hold_down` and a member that has been one for
//!   longer claims the VIP, the first of those longer members. So a node
//!   that comes back (or starts beside running ones) takes back its share
//!   only after the hold-down, and a node that flaps moves nothing; nodes
//!   that start together place at once, and stay placed as they settle.
//! - **Claim before answering, stop before unclaiming**: a node answers a
//!   VIP only after a write claiming it has come back to it through the
//!   watch (the watch is one stream in the API server's order: everything
//!   it delivered before that write landed first), while its fence holds,
//!   and if, at that point, no other node's Lease claims the VIP, except a
//!   node whose membership had run out before that write was *sent*. A
//!   node that no longer places a VIP on itself stops answering it before
//!   it writes the claim away (the daemon applies `Machine::answering`
//!   to the kernel before it carries out the next `Step`). A claim seen
//!   after a node began answering the VIP is later than its own: the
//!   other node waits.
//! - **A lapse starts over**: a node whose fence ran out (its writes
//!   failed or were slow) stops answering everything, and answers again
//!   only through a claim written after that; a write of someone else's
//!   to its Lease (a second daemon with its name) silences it for a whole
//!   duration after the last such write.
//!
//! Why that is safe: a node answering a VIP has its fence from a write
//! that landed before the fence ran out. A node that takes the VIP over
//! because that membership ran out sent its claim at least `duration`
//! after it last saw the Lease change, so any write that renewed the
//! membership before its fence landed before that claim, and was seen
//! before its echo: the taker then finds the membership alive and waits.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

pub(crate) use super::membership_record::{Content, Lease};
use super::{
    membership_peers::{Candidate, Peers},
    placement,
};

/// The serial of the claims a restarted daemon adopts from its previous
/// one: seen already, never sent by this one.
const ADOPTED: u64 = 0;

/// The timings of the membership elections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timings {
    /// How long a membership lasts: from a write's sending, less
    /// `Timings::margin`, for its node; from its sight, for the others.
    pub duration: Duration,
    /// How often a node writes its Lease when nothing changes.
    pub renew: Duration,
    /// How long after a failed write the next one goes.
    pub retry: Duration,
    /// How long a node must have been a member before it takes a VIP from
    /// a node that has been one for longer.
    pub hold_down: Duration,
}

impl Timings {
    /// How long before the others may count it gone a node falls silent.
    /// The others count from their sight of its write, which comes after
    /// its sending, so the margin covers only the clocks' drift and the
    /// kernel's fence taking hold: an eighth leaves a renewal that takes
    /// longer than usual room before it silences the node.
    pub(crate) fn margin(&self) -> Duration {
        self.duration / 8
    }
}

/// What the watch over the membership Leases delivers, in its order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Watched {
    /// A Lease created or written.
    Applied(Lease),
    /// A Lease deleted (its node's name). Its node's claims stand until
    /// its membership runs out: a deletion renews nothing.
    Deleted(String),
    /// The watch started again: every Lease there is.
    Listed(Vec<Lease>),
}

/// What to do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Write this node's Lease (create it if there is none), then report
    /// `Machine::on_written` or `Machine::on_write_failed`.
    Write(Content),
    /// Nothing until then (`None`: until an input).
    Wait(Option<Instant>),
}

/// A write of this node's, sent.
#[derive(Clone, Debug)]
struct Sent {
    serial: u64,
    at: Instant,
    content: Content,
}

/// One node's side of the membership elections.
#[derive(Debug)]
pub(crate) struct Machine {
    node: String,
    identity: String,
    timings: Timings,
    /// What the daemon last said the node can serve; `None` before its
    /// first word (nothing is written before it).
    eligible: Option<BTreeSet<String>>,
    stopping: bool,
    peers: Peers,
    next_serial: u64,
    in_flight: Option<Sent>,
    last_sent: Option<Sent>,
    /// The last write failed: the next goes after `backoff_until`.
    failed: bool,
    backoff_until: Option<Instant>,
    /// Writes acknowledged and not yet seen in the watch, by version.
    unseen: Vec<(String, Sent)>,
    /// The latest write of this node seen in the watch.
    echoed: Option<Sent>,
    /// The version of this node's Lease the watch delivered last: a write
    /// acknowledged after the watch delivered it is seen already.
    own_version: Option<String>,
    /// The serial of the first write of the unbroken run of writes that
    /// claim each VIP (since the last lapse).
    claimed_since: BTreeMap<String, u64>,
    fence: Option<Instant>,
    member_since: Option<Instant>,
    /// Since when its writes have landed without a break (its fence held
    /// throughout): it counts the others' silence only from then.
    sighted_since: Option<Instant>,
    /// The VIPs it answers (while the fence holds).
    answering: BTreeSet<String>,
    /// The last write to its Lease by someone else, seen.
    foreign_at: Option<Instant>,
    /// A fence kept from before a restart, and the VIPs it covered:
    /// adopted when the node's own Lease is first seen.
    kept: Option<(Instant, BTreeSet<String>)>,
}

impl Machine {
    /// `kept`: the fence the kernel still holds from this node's previous
    /// daemon (a restart), with the VIPs it answers; they stay answered if
    /// the node's Lease, first seen, still claims them in its identity.
    pub(crate) fn new(
        node: String,
        identity: String,
        timings: Timings,
        kept: Option<(Instant, BTreeSet<String>)>,
    ) -> Self {
        Self {
            node,
            identity,
            timings,
            eligible: None,
            stopping: false,
            peers: Peers::new(timings.duration, timings.hold_down),
            next_serial: 1,
            in_flight: None,
            last_sent: None,
            failed: false,
            backoff_until: None,
            unseen: Vec::new(),
            echoed: None,
            own_version: None,
            claimed_since: BTreeMap::new(),
            fence: None,
            member_since: None,
            sighted_since: None,
            answering: BTreeSet::new(),
            foreign_at: None,
            kept,
        }
    }

    /// The VIPs the node can serve now.
    pub(crate) fn set_eligible(&mut self, vips: BTreeSet<String>, now: Instant) {
        self.eligible = Some(vips);
        self.settle(now);
    }

    /// The node is stopping: it stops answering and writes that it can
    /// serve nothing, so the others take over at once.
    pub(crate) fn stop(&mut self, now: Instant) {
        self.stopping = true;
        self.settle(now);
    }

    /// The VIPs this node answers, and until when: the kernel's fence.
    pub(crate) fn answering(&self, now: Instant) -> Option<(Instant, &BTreeSet<String>)> {
        let fence = self.fence.filter(|f| *f > now)?;
        (!self.answering.is_empty()).then_some((fence, &self.answering))
    }

    fn holds_fence(&self, now: Instant) -> bool {
        self.fence.is_some_and(|f| f > now)
    }

    fn quiet(&self, now: Instant) -> bool {
        self.foreign_at.is_none_or(|t| t + self.timings.duration <= now)
    }

    /// Whether this node places `vip` on itself now.
    fn places_here(&self, vip: &str, now: Instant) -> bool {
        let eligible = self.eligible.as_ref().is_some_and(|e| e.contains(vip));
        if self.stopping || !eligible || !self.holds_fence(now) || !self.quiet(now) {
            return false;
        }
        // Each candidate: its name, whether it has been a member for the
        // hold-down, whether it claims the VIP now.
        let mine = Candidate {
            node: &self.node,
            settled: self.member_since.is_some_and(|t| t + self.timings.hold_down <= now),
            claims: self.last_sent.as_ref().is_some_and(|s| s.content.claims.contains(vip)),
        };
        let sighted = self.sighted_since.unwrap_or(now);
        let candidates: Vec<Candidate> =
            std::iter::once(mine).chain(self.peers.candidates(vip, now, sighted)).collect();
        let first = placement::first(vip, candidates.iter().map(|c| c.node));
        // The first of all, unless it is new and a settled member holds the
        // VIP: then the first of the settled (the holder keeps it).
        let new = candidates.iter().any(|c| Some(c.node) == first && !c.settled);
        let held = candidates.iter().any(|c| c.settled && c.claims);
        let pool = candidates.iter().filter(|c| c.settled || !(new && held)).map(|c| c.node);
        placement::first(vip, pool) == Some(self.node.as_str())
    }

    /// What this node writes now.
    fn content(&self, now: Instant) -> Content {
        // Stopping, or silenced by another's write: it can serve nothing,
        // and says so, so that the others take its VIPs at once.
        let eligible = match &self.eligible {
            Some(eligible) if !self.stopping && self.quiet(now) => eligible.clone(),
            _ => BTreeSet::new(),
        };
        let claims = eligible.iter().filter(|v| self.places_here(v, now)).cloned().collect();
        Content { eligible, claims }
    }

    /// Brings what it answers up to date at `now`: a lapse or a foreign
    /// write silences it; a VIP no longer placed here is dropped; a VIP
    /// placed here, claimed and seen claimed, with no other claim in the
    /// way, is answered.
    fn settle(&mut self, now: Instant) {
        if !self.holds_fence(now) || !self.quiet(now) {
            if !self.answering.is_empty() || self.fence.is_some() {
                // Every claim must be seen again, in a write sent from now.
                let restart = self.next_serial;
                self.claimed_since.values_mut().for_each(|s| *s = restart);
            }
            self.answering.clear();
            return;
        }
        let placed: Vec<String> = self.answering.iter().cloned().collect();
        for vip in placed {
            if !self.places_here(&vip, now) {
                self.answering.remove(&vip);
            }
        }
        let Some(echoed) = &self.echoed else { return };
        let mut verified = Vec::new();
        for (vip, since) in &self.claimed_since {
            if self.answering.contains(vip) || *since > echoed.serial {
                continue;
            }
            if !echoed.content.claims.contains(vip) || !self.places_here(vip, now) {
                continue;
            }
            if !self.peers.in_the_way(vip, echoed.at) {
                verified.push(vip.clone());
            }
        }
        self.answering.extend(verified);
    }

    /// Whether a claim waits only on members that have run out since this
    /// node's last write was sent: a fresh write's echo settles it.
    fn needs_fresh_echo(&self, now: Instant) -> bool {
        let Some(sent) = &self.last_sent else { return false };
        let waiting = self.claimed_since.keys().filter(|v| !self.answering.contains(*v));
        waiting.into_iter().any(|vip| self.peers.ran_out_since(vip, sent.at, now))
    }

    /// What to do at `now`. A write it asks for counts as sent at `now`.
    pub(crate) fn poll(&mut self, now: Instant) -> Step {
        self.settle(now);
        if self.eligible.is_none() {
            return Step::Wait(None);
        }
        if self.in_flight.is_some() {
            return Step::Wait(self.wake(now));
        }
        if let Some(backoff) = self.backoff_until.filter(|b| *b > now) {
            return Step::Wait(Some(backoff));
        }
        let content = self.content(now);
        let due = self.last_sent.as_ref().is_none_or(|s| {
            // An adopted claim is renewed at once: its fence is the old
            // daemon's.
            s.serial == ADOPTED || s.at + self.timings.renew <= now
        });
        let changed = self.last_sent.as_ref().is_none_or(|s| s.content != content);
        // After a lapse every claim waits for a write not sent yet.
        let restarted = self.claimed_since.values().any(|s| *s >= self.next_serial);
        if !(due || changed || restarted || self.failed || self.needs_fresh_echo(now)) {
            return Step::Wait(self.wake(now));
        }
        let serial = self.next_serial;
        self.next_serial += 1;
        let before = self.last_sent.as_ref().map(|s| &s.content.claims);
        let mut since = BTreeMap::new();
        for vip in &content.claims {
            let kept = before.is_some_and(|b| b.contains(vip));
            let kept = self.claimed_since.get(vip).filter(|_| kept).copied();
            since.insert(vip.clone(), kept.unwrap_or(serial));
        }
        self.claimed_since = since;
        let sent = Sent { serial, at: now, content: content.clone() };
        self.in_flight = Some(sent.clone());
        self.last_sent = Some(sent);
        self.failed = false;
        Step::Write(content)
    }

    /// When something may change by itself: a renewal due, a membership
    /// running out or settling, the fence, the end of a foreign write's
    /// silence.
    fn wake(&self, now: Instant) -> Option<Instant> {
        let t = &self.timings;
        let renew = self.last_sent.as_ref().map(|s| s.at + t.renew);
        let peers = self.peers.changes();
        let own = [
            self.fence,
            self.member_since.map(|m| m + t.hold_down),
            self.sighted_since.map(|s| s + t.duration),
            self.foreign_at.map(|f| f + t.duration),
        ];
        renew.into_iter().chain(peers).chain(own.into_iter().flatten()).filter(|w| *w > now).min()
    }

    /// The write in flight landed as `version`, at `now`.
    pub(crate) fn on_written(&mut self, version: String, now: Instant) {
        let Some(sent) = self.in_flight.take() else { return };
        let fence = sent.at + self.timings.duration - self.timings.margin();
        // A member since then if its membership never ran out between.
        let continuous = self.holds_fence(now);
        if !continuous || self.member_since.is_none() {
            self.member_since = Some(sent.at);
            self.sighted_since = Some(now);
        }
        if fence > now {
            self.fence = Some(fence);
        }
        if self.own_version.as_ref() == Some(&version) {
            self.unseen.clear();
            self.echoed = Some(sent);
        } else {
            self.unseen.push((version, sent));
            // Bounded: versions the watch never delivered (a relist skipped
            // them) are of no use once later ones are.
            if self.unseen.len() > 16 {
                self.unseen.remove(0);
            }
        }
        self.settle(now);
    }

    /// The write in flight failed (refused, a conflict, a timeout) at
    /// `now`: the fence runs out by itself; the next write goes after the
    /// retry interval.
    pub(crate) fn on_write_failed(&mut self, now: Instant) {
        self.in_flight = None;
        self.failed = true;
        self.backoff_until = Some(now + self.timings.retry);
        self.settle(now);
    }

    /// What the watch delivered, at `now`.
    pub(crate) fn on_watched(&mut self, watched: Watched, now: Instant) {
        match watched {
            Watched::Applied(lease) => self.apply(lease, now),
            Watched::Deleted(_) => {}
            Watched::Listed(leases) => {
                // Its own Lease last: everything else listed landed before
                // the write of its that the list shows.
                let (own, others): (Vec<Lease>, Vec<Lease>) =
                    leases.into_iter().partition(|l| l.node == self.node);
                for lease in others.into_iter().chain(own) {
                    self.apply(lease, now);
                }
            }
        }
        self.settle(now);
    }

    fn apply(&mut self, lease: Lease, now: Instant) {
        if lease.node != self.node {
            self.peers.apply(lease, now);
            return;
        }
        if lease.identity != self.identity {
            self.foreign_at = Some(now);
            self.kept = None;
            return;
        }
        if let Some((fence, vips)) = self.kept.take()
            && fence > now
        {
            // Its previous daemon's claims, still answered by the kernel:
            // nobody can have taken them before that fence.
            self.fence = Some(fence);
            // A member from before: settled.
            self.member_since = Some(now.checked_sub(self.timings.hold_down).unwrap_or(now));
            self.answering = vips.intersection(&lease.content.claims).cloned().collect();
            let claims = self.answering.iter().map(|v| (v.clone(), ADOPTED));
            self.claimed_since = claims.collect();
            let content = Content { eligible: BTreeSet::new(), claims: self.answering.clone() };
            self.last_sent = Some(Sent { serial: ADOPTED, at: now, content });
        }
        self.own_version = Some(lease.version.clone());
        if let Some(at) = self.unseen.iter().position(|(v, _)| *v == lease.version) {
            let sent = self.unseen.drain(..=at).next_back().map(|(_, s)| s);
            self.echoed = sent;
        }
    }
}

#[cfg(test)]
#[path = "membership_tests.rs"]
mod tests;
