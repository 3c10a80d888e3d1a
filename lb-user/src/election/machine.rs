//! One node's side of one election, as a pure state machine over simulated
//! time: what it knows of the Lease, whether it may compete, and what to
//! do next ([`Machine::next`]). The task in `mod.rs` carries the steps out
//! against the API and feeds the outcomes back.
//!
//! The rules:
//! - **Compete only when eligible, and settled**: the node has had a usable
//!   server for the service for [`Timings::settle`] without a break, so
//!   readiness that flaps does not make the lease move back and forth. A
//!   holder that stops being eligible releases at once; one that finds the
//!   lease its own when it starts (its daemon restarted: a crash, an
//!   upgrade, a rollout; a stopping daemon keeps its leases) renews it at
//!   once if it is eligible, and waits up to a lease duration for its
//!   servers' first verdict if it is not yet, before it lets the lease go.
//! - **Expiry by the candidate's own clock, and its own eyes**: a record
//!   is expired when it has not changed for its `leaseDurationSeconds`
//!   since this node saw it change (as client-go does): the nodes' wall
//!   clocks never meet. Only time this node could see counts: after a
//!   failed request it starts counting again from its next successful
//!   read, so an API server stall that blinds every node (and keeps the
//!   holder from renewing) expires nobody's lease; the holder renews once
//!   the API answers again, within a duration of the others seeing it.
//! - **Fencing**: the holder may answer until `sent + duration - duration/4`,
//!   where `sent` is when its last successful claim or renewal was *sent*.
//!   Another node sees that write only after it was sent, and waits a
//!   whole duration from then: the holder has fallen silent a quarter of
//!   a duration before anyone else may claim.
//! - **A lease given is a takeover**: a read that finds the lease newly
//!   naming this node, written by someone else (an edit, a write of its
//!   own that landed after it gave up on it), makes it the holder only a
//!   whole duration later, when the holder before it has fallen silent
//!   whatever it last renewed. Found naming this node at its first read,
//!   the lease is its own from before a restart (the identity's token is
//!   this node's alone), renewed at once.
//! - **Optimistic concurrency**: every write carries the resourceVersion
//!   read; a conflict means someone else wrote first, and the node reads
//!   again (and, if it held, has lost the lease at once).

use std::time::{Duration, Instant};

/// The election's timings (`config::Election`, plus the settling time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timings {
    pub duration: Duration,
    pub renew: Duration,
    pub retry: Duration,
    /// How long a node must have been eligible before it competes.
    pub settle: Duration,
}

impl Timings {
    /// How long before its lease runs out the holder falls silent.
    pub(crate) fn margin(&self) -> Duration {
        self.duration / 4
    }
}

/// The Lease as last read or written: what the machine decides by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    /// `spec.holderIdentity`; `None` or empty: released.
    pub holder: Option<String>,
    /// `spec.leaseDurationSeconds`.
    pub duration: Duration,
    /// `metadata.resourceVersion`: changes with every write.
    pub version: String,
}

/// What to do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Read the Lease.
    Read,
    /// Create it, held by this node.
    Create,
    /// Write this node as its holder over the record read (acquire or
    /// renew).
    Claim,
    /// Write it released (no holder) over the record read.
    Release,
    /// Nothing until then (`None`: until an input changes).
    Wait(Option<Instant>),
}

/// This node's part in the election.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// It holds the lease and may answer until `fence`.
    Holder { fence: Instant },
    /// It competes: the lease is someone else's, or being claimed.
    Candidate,
    /// It does not compete, and why.
    NotEligible(&'static str),
}

/// A change of holder this node made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Takeover {
    pub at: Instant,
    /// From when the previous holder was last seen renewing (or this node
    /// began to compete) to the lease being this node's.
    pub took: Duration,
    /// The previous holder, if there was one.
    pub from: Option<String>,
}

/// One node's side of one election.
#[derive(Debug)]
pub(crate) struct Machine {
    me: String,
    timings: Timings,
    /// The record as last known; `None` before the first read and after a
    /// conflict.
    record: Option<Record>,
    /// The Lease does not exist (the last read said so).
    absent: bool,
    /// When the record last changed, by this node's reading.
    seen_at: Option<Instant>,
    last_read: Option<Instant>,
    /// When this node first read the Lease (its daemon's start).
    first_read: Option<Instant>,
    /// When this node's last successful claim was sent; `fence` follows.
    claimed_at: Option<Instant>,
    fence: Option<Instant>,
    eligible_since: Option<Instant>,
    ineligible_why: &'static str,
    stopping: bool,
    last_takeover: Option<Takeover>,
    /// When this node began to wait for the current holder.
    waiting_since: Option<Instant>,
    /// After a failed request: nothing is sent again before then.
    backoff_until: Option<Instant>,
    /// The lease was given to this node by someone else's write: it
    /// answers from then on, not before.
    answer_from: Option<Instant>,
    /// A request failed since the last successful read: what happened to
    /// the Lease meanwhile is unknown, and that time does not count
    /// towards its expiry.
    blind: bool,
}

impl Machine {
    pub(crate) fn new(me: String, timings: Timings) -> Self {
        Self {
            me,
            timings,
            record: None,
            absent: false,
            seen_at: None,
            last_read: None,
            first_read: None,
            claimed_at: None,
            fence: None,
            eligible_since: None,
            ineligible_why: "no usable server",
            stopping: false,
            last_takeover: None,
            waiting_since: None,
            backoff_until: None,
            answer_from: None,
            blind: false,
        }
    }

    /// Whether the node may compete: `None`, or why not.
    pub(crate) fn set_eligible(&mut self, why_not: Option<&'static str>, now: Instant) {
        match why_not {
            None => {
                self.eligible_since.get_or_insert(now);
            }
            Some(why) => {
                self.eligible_since = None;
                self.ineligible_why = why;
            }
        }
    }

    /// The node is stopping (SIGTERM, `lb detach`, the service removed):
    /// it releases a lease it holds and competes no more.
    pub(crate) fn stop(&mut self) {
        self.stopping = true;
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping
    }

    fn holds(&self) -> bool {
        self.record.as_ref().is_some_and(|r| r.holder.as_deref() == Some(&self.me))
    }

    fn settled(&self, now: Instant) -> bool {
        !self.stopping && self.eligible_since.is_some_and(|t| now >= t + self.timings.settle)
    }

    /// What to do at `now`.
    pub(crate) fn next(&self, now: Instant) -> Step {
        match (self.decide(now), self.backoff_until) {
            (Step::Wait(until), Some(backoff)) if backoff > now => {
                Step::Wait(Some(until.map_or(backoff, |u| u.max(backoff))))
            }
            (_, Some(backoff)) if backoff > now => Step::Wait(Some(backoff)),
            (step, _) => step,
        }
    }

    fn decide(&self, now: Instant) -> Step {
        let read_due = self.last_read.map(|t| t + self.timings.retry);
        let read_or_wait = |until: Option<Instant>| match read_due {
            Some(due) if due > now => Step::Wait(Some(until.map_or(due, |u| u.min(due)))),
            _ => Step::Read,
        };
        if self.holds() {
            // Settling is for taking a lease; one held (a daemon restarted
            // after a crash finds the lease still its own) is renewed at
            // once while the node is eligible.
            if !self.stopping && self.eligible_since.is_none() && self.claimed_at.is_none() {
                // Found its own at start: its servers may have no verdict
                // yet. It neither renews nor lets go for a lease duration
                // (its kernel's fence runs out meanwhile, as it would).
                let grace = self.first_read.map(|t| t + self.timings.duration);
                if let Some(grace) = grace.filter(|g| *g > now) {
                    return Step::Wait(Some(grace));
                }
            }
            if self.stopping || self.eligible_since.is_none() {
                return Step::Release;
            }
            let due = self.claimed_at.map_or(now, |t| t + self.timings.renew);
            // Wake when it may answer, too: its role changes then.
            let wake = self.answer_from.filter(|a| *a > now).map_or(due, |a| a.min(due));
            return if due <= now { Step::Claim } else { Step::Wait(Some(wake)) };
        }
        if !self.settled(now) {
            if self.stopping {
                return Step::Wait(None);
            }
            // Eligible soon: look again then; else keep the view fresh.
            return read_or_wait(self.eligible_since.map(|t| t + self.timings.settle));
        }
        if self.absent {
            return Step::Create;
        }
        let Some(record) = &self.record else { return Step::Read };
        if record.holder.as_deref().is_none_or(str::is_empty) {
            return Step::Claim;
        }
        if self.blind {
            // Only a successful read tells whether it changed meanwhile.
            return read_or_wait(None);
        }
        let expires = self.seen_at.map(|t| t + record.duration);
        if expires.is_some_and(|e| e <= now) {
            return Step::Claim;
        }
        read_or_wait(expires)
    }

    /// A read's answer (`None`: there is no Lease), at `now`.
    pub(crate) fn on_read(&mut self, record: Option<Record>, now: Instant) {
        self.last_read = Some(now);
        let first = self.first_read.is_none();
        self.first_read.get_or_insert(now);
        self.absent = record.is_none();
        let changed =
            self.record.as_ref().map(|r| &r.version) != record.as_ref().map(|r| &r.version);
        if changed || self.blind {
            // Unchanged across a blind spell: it counts from now.
            self.seen_at = Some(now);
        }
        self.blind = false;
        let was_mine = self.holds();
        let before = self.record.as_ref().and_then(|r| r.holder.clone()).filter(|h| !h.is_empty());
        self.record = record;
        if was_mine && !self.holds() {
            // Someone else wrote it (released for us, or an edit).
            self.fence = None;
            self.answer_from = None;
        }
        if changed && !was_mine && self.holds() && !first {
            // Given by someone else's write: whoever held it before may
            // answer until its own fence, at most a duration from now.
            self.answer_from = Some(now + self.timings.duration);
            self.last_takeover = Some(Takeover { at: now, took: Duration::ZERO, from: before });
        }
        if !self.holds() && self.waiting_since.is_none() {
            self.waiting_since = Some(now);
        }
    }

    /// This node's claim (or creation), sent at `sent`, was written as
    /// `record`.
    pub(crate) fn on_claimed(&mut self, record: Record, sent: Instant, now: Instant) {
        let took_over = !self.holds();
        if took_over {
            let from =
                self.record.as_ref().and_then(|r| r.holder.clone()).filter(|h| !h.is_empty());
            let since = if from.is_some() { self.seen_at } else { self.waiting_since };
            self.last_takeover = Some(Takeover {
                at: now,
                took: now.saturating_duration_since(since.unwrap_or(sent)),
                from,
            });
        }
        self.waiting_since = None;
        self.record = Some(record);
        self.absent = false;
        self.seen_at = Some(now);
        self.claimed_at = Some(sent);
        self.fence = Some(sent + self.timings.duration - self.timings.margin());
        self.blind = false;
    }

    /// The release was written as `record`.
    pub(crate) fn on_released(&mut self, record: Record, now: Instant) {
        self.fence = None;
        self.answer_from = None;
        self.claimed_at = None;
        self.record = Some(record);
        self.seen_at = Some(now);
        self.last_read = Some(now);
        self.waiting_since = None;
        self.blind = false;
    }

    /// A write was refused because the record changed (409), or the Lease
    /// exists already or is gone: read again. A holder has lost it.
    pub(crate) fn on_conflict(&mut self) {
        self.fence = None;
        self.claimed_at = None;
        self.record = None;
        self.absent = false;
        self.last_read = None;
    }

    /// A request failed (the API unreachable, a timeout) at `now`: the
    /// fence stays as it was and runs out by itself; the next read waits
    /// for the retry interval, and the Lease's expiry counts again from
    /// the next successful read.
    pub(crate) fn on_failed(&mut self, now: Instant) {
        self.backoff_until = Some(now + self.timings.retry.min(self.timings.renew));
        self.blind = true;
    }

    /// This node's role at `now`.
    pub(crate) fn role(&self, now: Instant) -> Role {
        if let Some(fence) = self.fence.filter(|f| *f > now)
            && self.holds()
            && self.answer_from.is_none_or(|a| a <= now)
        {
            return Role::Holder { fence };
        }
        if self.stopping {
            return Role::NotEligible("stopping");
        }
        if self.eligible_since.is_none() {
            return Role::NotEligible(self.ineligible_why);
        }
        Role::Candidate
    }

    /// The holder as last known (empty: released).
    pub(crate) fn holder(&self) -> Option<&str> {
        self.record.as_ref()?.holder.as_deref().filter(|h| !h.is_empty())
    }

    /// How long ago the record last changed.
    pub(crate) fn record_age(&self, now: Instant) -> Option<Duration> {
        self.seen_at.map(|t| now.saturating_duration_since(t))
    }

    pub(crate) fn last_takeover(&self) -> Option<&Takeover> {
        self.last_takeover.as_ref()
    }
}

#[cfg(test)]
#[path = "machine_tests.rs"]
mod tests;
