//! The election machine on simulated time.

use std::time::{Duration, Instant};

use super::{Machine, Record, Role, Step, Timings};

const MS: Duration = Duration::from_millis(1);

fn timings() -> Timings {
    Timings { duration: 1000 * MS, renew: 200 * MS, retry: 200 * MS, settle: 1000 * MS }
}

fn held_by(holder: &str, version: u32) -> Record {
    Record { holder: Some(holder.to_owned()), duration: 1000 * MS, version: version.to_string() }
}

fn released(version: u32) -> Record {
    Record { holder: None, duration: 1000 * MS, version: version.to_string() }
}

/// A node eligible since `t0`, settled at `t0 + settle`.
fn eligible(me: &str, t0: Instant) -> Machine {
    let mut m = Machine::new(me.to_owned(), timings());
    m.set_eligible(None, t0);
    m
}

#[test]
fn a_settled_node_creates_a_missing_lease_and_renews_it() {
    let t0 = Instant::now();
    let mut m = eligible("a", t0);
    assert_eq!(m.next(t0), Step::Read, "it looks before it is settled");
    m.on_read(None, t0);
    assert_eq!(m.next(t0 + 100 * MS), Step::Wait(Some(t0 + 200 * MS)), "not settled yet");
    let t1 = t0 + 1000 * MS;
    assert_eq!(m.next(t1), Step::Create);
    m.on_claimed(held_by("a", 2), t1, t1 + 5 * MS);
    assert_eq!(m.role(t1 + 5 * MS), Role::Holder { fence: t1 + 750 * MS });
    assert_eq!(m.next(t1 + 10 * MS), Step::Wait(Some(t1 + 200 * MS)));
    assert_eq!(m.next(t1 + 200 * MS), Step::Claim, "renews");
    m.on_claimed(held_by("a", 3), t1 + 200 * MS, t1 + 210 * MS);
    assert_eq!(m.role(t1 + 900 * MS), Role::Holder { fence: t1 + 950 * MS });
    assert_eq!(m.role(t1 + 950 * MS), Role::Candidate, "past its fence it is silent");
    assert!(m.last_takeover().is_some_and(|t| t.from.is_none()));
}

#[test]
fn a_candidate_claims_only_a_whole_duration_after_the_last_change_it_saw() {
    let t0 = Instant::now();
    let mut m = eligible("b", t0);
    let t1 = t0 + 1000 * MS;
    m.on_read(Some(held_by("a", 7)), t1);
    assert_eq!(m.next(t1 + 100 * MS), Step::Wait(Some(t1 + 200 * MS)));
    // The holder renews: a new version, seen at t1 + 200 ms.
    m.on_read(Some(held_by("a", 8)), t1 + 200 * MS);
    // Then it dies: the record stays as it was.
    for k in 2..6 {
        assert_eq!(m.next(t1 + k * 200 * MS), Step::Read);
        m.on_read(Some(held_by("a", 8)), t1 + k * 200 * MS);
        assert_eq!(m.role(t1 + k * 200 * MS), Role::Candidate);
    }
    assert_eq!(m.next(t1 + 1199 * MS), Step::Wait(Some(t1 + 1200 * MS)));
    assert_eq!(m.next(t1 + 1200 * MS), Step::Claim, "expired by its own clock");
    m.on_claimed(held_by("b", 9), t1 + 1200 * MS, t1 + 1210 * MS);
    let takeover = m.last_takeover().unwrap();
    assert_eq!(takeover.from.as_deref(), Some("a"));
    assert_eq!(takeover.took, 1010 * MS, "from the last renewal seen");
}

/// The guarantee: whatever the latencies, a holder's fence passes before
/// another node may claim the lease it last renewed.
#[test]
fn the_holders_fence_passes_before_anyone_else_may_claim() {
    let t0 = Instant::now();
    for (write_latency, read_lag) in [(0, 0), (5, 1), (150, 0), (0, 199), (400, 150), (700, 10)] {
        let (write_latency, read_lag) = (write_latency * MS, read_lag * MS);
        let mut holder = eligible("a", t0);
        let mut other = eligible("b", t0);
        let sent = t0 + 2000 * MS;
        // The write is applied at the API somewhere in [sent, sent + latency].
        holder.on_claimed(held_by("a", 5), sent, sent + write_latency);
        let applied = sent + write_latency / 2;
        other.on_read(Some(held_by("a", 4)), t0 + 1500 * MS);
        other.on_read(Some(held_by("a", 5)), applied + read_lag);
        let Role::Holder { fence } = holder.role(sent) else { panic!("a holds") };
        let mut t = applied;
        while other.next(t) != Step::Claim {
            t += MS;
        }
        assert!(fence < t, "fence {fence:?} not before the claim at {t:?}");
        assert!(t - fence >= 250 * MS, "a quarter of the duration apart");
    }
}

#[test]
fn a_holder_that_loses_its_servers_releases_at_once() {
    let t0 = Instant::now();
    let mut m = eligible("a", t0);
    let t1 = t0 + 1000 * MS;
    m.on_read(None, t1);
    m.on_claimed(held_by("a", 2), t1, t1);
    m.set_eligible(Some("no usable server"), t1 + 50 * MS);
    assert_eq!(m.next(t1 + 50 * MS), Step::Release);
    m.on_released(released(3), t1 + 60 * MS);
    assert_eq!(m.role(t1 + 60 * MS), Role::NotEligible("no usable server"));
    assert_eq!(m.holder(), None);
    assert!(matches!(m.next(t1 + 60 * MS), Step::Wait(_)), "it does not claim again");
}

#[test]
fn a_released_lease_is_claimed_at_once() {
    let t0 = Instant::now();
    let mut m = eligible("b", t0);
    let t1 = t0 + 3000 * MS;
    m.on_read(Some(held_by("a", 4)), t1 - 100 * MS);
    m.on_read(Some(released(5)), t1);
    assert_eq!(m.next(t1), Step::Claim);
    m.on_claimed(held_by("b", 6), t1, t1 + 3 * MS);
    let takeover = m.last_takeover().unwrap();
    assert_eq!(takeover.from, None);
}

#[test]
fn flapping_readiness_never_competes() {
    let t0 = Instant::now();
    let mut m = Machine::new("b".to_owned(), timings());
    m.on_read(Some(released(3)), t0);
    let mut t = t0;
    for i in 0..40 {
        let why = if i % 2 == 0 { None } else { Some("no usable server") };
        m.set_eligible(why, t);
        for _ in 0..30 {
            let step = m.next(t);
            assert!(matches!(step, Step::Read | Step::Wait(_)), "{step:?} at {:?}", t - t0);
            if step == Step::Read {
                m.on_read(Some(released(3)), t);
            }
            t += 10 * MS;
        }
    }
    // Steady for the settling time: it competes.
    m.set_eligible(None, t);
    assert_eq!(m.next(t + 1000 * MS), Step::Claim);
}

#[test]
fn a_conflict_loses_the_lease_at_once_and_reads_again() {
    let t0 = Instant::now();
    let mut m = eligible("a", t0);
    let t1 = t0 + 1000 * MS;
    m.on_read(None, t1);
    m.on_claimed(held_by("a", 2), t1, t1);
    m.on_conflict();
    assert_eq!(m.role(t1 + 10 * MS), Role::Candidate);
    assert_eq!(m.next(t1 + 10 * MS), Step::Read);
}

#[test]
fn a_holder_that_cannot_renew_falls_silent_at_its_fence_and_keeps_trying() {
    let t0 = Instant::now();
    let mut m = eligible("a", t0);
    let t1 = t0 + 1000 * MS;
    m.on_read(None, t1);
    m.on_claimed(held_by("a", 2), t1, t1);
    let mut t = t1 + 200 * MS;
    let mut tries = 0;
    while t < t1 + 2000 * MS {
        match m.next(t) {
            Step::Claim => {
                tries += 1;
                m.on_failed(t);
            }
            Step::Wait(Some(until)) => assert!(until > t),
            other => panic!("{other:?}"),
        }
        t += 10 * MS;
    }
    assert!((8..=11).contains(&tries), "one try per retry interval, not a loop: {tries}");
    assert_eq!(m.role(t1 + 749 * MS), Role::Holder { fence: t1 + 750 * MS });
    assert_eq!(m.role(t1 + 750 * MS), Role::Candidate);
}

#[test]
fn a_stopping_holder_releases_and_then_waits() {
    let t0 = Instant::now();
    let mut m = eligible("a", t0);
    let t1 = t0 + 1000 * MS;
    m.on_read(None, t1);
    m.on_claimed(held_by("a", 2), t1, t1);
    m.stop();
    assert_eq!(m.next(t1 + MS), Step::Release);
    m.on_released(released(3), t1 + 2 * MS);
    assert_eq!(m.next(t1 + 3 * MS), Step::Wait(None));
    assert_eq!(m.role(t1 + 3 * MS), Role::NotEligible("stopping"));
}

#[test]
fn a_restarted_holder_renews_its_lease_at_once() {
    // The daemon crashed and came back within the lease: the record still
    // names this node. Eligible (its servers adopted as usable), it
    // renews without waiting to settle, and is the holder again.
    let t0 = Instant::now();
    let mut m = eligible("a", t0);
    m.on_read(Some(held_by("a", 9)), t0 + 5 * MS);
    assert_eq!(m.next(t0 + 5 * MS), Step::Claim);
    m.on_claimed(held_by("a", 10), t0 + 5 * MS, t0 + 8 * MS);
    assert_eq!(m.role(t0 + 8 * MS), Role::Holder { fence: t0 + 755 * MS });
    assert!(m.last_takeover().is_none(), "it held the lease all along");
    // Not eligible yet when it comes back (its servers' first checks
    // under way): it waits a lease duration for them, renewing nothing,
    // then lets the lease go.
    let mut m = Machine::new("a".to_owned(), timings());
    m.set_eligible(Some("no usable server"), t0);
    m.on_read(Some(held_by("a", 9)), t0 + 5 * MS);
    assert_eq!(m.next(t0 + 5 * MS), Step::Wait(Some(t0 + 1005 * MS)));
    assert_eq!(m.role(t0 + 5 * MS), Role::NotEligible("no usable server"));
    assert_eq!(m.next(t0 + 1005 * MS), Step::Release);
    // Its first check passes within the wait: it renews, no takeover.
    let mut m = Machine::new("a".to_owned(), timings());
    m.set_eligible(Some("no usable server"), t0);
    m.on_read(Some(held_by("a", 9)), t0 + 5 * MS);
    m.set_eligible(None, t0 + 300 * MS);
    assert_eq!(m.next(t0 + 300 * MS), Step::Claim);
    m.on_claimed(held_by("a", 10), t0 + 300 * MS, t0 + 305 * MS);
    assert!(m.last_takeover().is_none(), "it held the lease all along");
}

#[test]
fn a_holder_that_loses_its_servers_after_renewing_at_start_releases_at_once() {
    // The wait is for a lease found at start, never for one this run has
    // renewed: losing its servers then lets the lease go at once.
    let t0 = Instant::now();
    let mut m = eligible("a", t0);
    m.on_read(Some(held_by("a", 9)), t0 + 5 * MS);
    m.on_claimed(held_by("a", 10), t0 + 5 * MS, t0 + 8 * MS);
    m.set_eligible(Some("no usable server"), t0 + 100 * MS);
    assert_eq!(m.next(t0 + 100 * MS), Step::Release);
}

/// The Lease at a simulated API server, and nodes that act on it: each
/// request is answered at once, or fails while the API is stalled; a
/// write succeeds only over the resourceVersion its node read.
struct Api {
    record: Record,
}

impl Api {
    /// Carries out `m`'s next step at `t`; returns it.
    fn serve(&mut self, m: &mut Machine, t: Instant, stalled: bool) -> Step {
        let step = m.next(t);
        match step {
            Step::Wait(_) => {}
            _ if stalled => m.on_failed(t),
            Step::Read => m.on_read(Some(self.record.clone()), t),
            Step::Claim if m.record.as_ref().map(|r| &r.version) == Some(&self.record.version) => {
                let version: u32 = self.record.version.parse().unwrap();
                self.record = held_by(&m.me, version + 1);
                m.on_claimed(self.record.clone(), t, t);
            }
            Step::Claim => m.on_conflict(),
            Step::Create | Step::Release => panic!("{step:?} was not expected here"),
        }
        step
    }
}

/// An API server that answers nobody for 5 s (a stalled etcd, an
/// overloaded apiserver) moves no lease: the holder cannot renew and falls
/// silent at its fence, the other node cannot read and counts none of that
/// time towards the lease's expiry, and once the API answers again the
/// holder renews before the other has seen the lease unchanged for a whole
/// duration.
#[test]
fn a_stall_that_blinds_every_node_moves_no_lease() {
    let t0 = Instant::now();
    let (mut a, mut b) = (eligible("a", t0), eligible("b", t0));
    // `a` has held the lease since before `b` started.
    a.on_read(Some(held_by("a", 1)), t0);
    a.on_claimed(held_by("a", 2), t0, t0);
    let mut api = Api { record: held_by("a", 2) };
    let (stall_from, stall_to) = (t0 + 3000 * MS, t0 + 8000 * MS);
    let mut silent_at = None;
    for tick in 0..1200 {
        let t = t0 + tick * 10 * MS;
        let stalled = (stall_from..stall_to).contains(&t);
        api.serve(&mut a, t, stalled);
        let step = api.serve(&mut b, t, stalled);
        assert_ne!(step, Step::Claim, "b tried to take the lease at {:?}", t - t0);
        if silent_at.is_none() && a.role(t) == Role::Candidate {
            silent_at = Some(t - t0);
        }
    }
    assert_eq!(api.record.holder.as_deref(), Some("a"));
    let silent_at = silent_at.expect("a fell silent");
    assert!(
        silent_at > 3000 * MS && silent_at <= 3750 * MS,
        "a fell silent at its fence, within the stall: {silent_at:?}"
    );
    assert!(matches!(a.role(t0 + 11_990 * MS), Role::Holder { .. }), "and answers again");
}

/// A holder that dies while the API is stalled is still taken over: a
/// lease duration after the others can read again.
#[test]
fn a_holder_that_dies_during_a_stall_is_taken_over_after_it() {
    let t0 = Instant::now();
    let (mut a, mut b) = (eligible("a", t0), eligible("b", t0));
    a.on_read(Some(held_by("a", 1)), t0);
    a.on_claimed(held_by("a", 2), t0, t0);
    let mut api = Api { record: held_by("a", 2) };
    let (died, stall_to) = (t0 + 3000 * MS, t0 + 8000 * MS);
    let mut claimed_at = None;
    for tick in 0..1200 {
        let t = t0 + tick * 10 * MS;
        let stalled = (died..stall_to).contains(&t);
        if t < died {
            api.serve(&mut a, t, stalled);
        }
        if api.serve(&mut b, t, stalled) == Step::Claim && claimed_at.is_none() {
            claimed_at = Some(t);
        }
    }
    assert_eq!(api.record.holder.as_deref(), Some("b"));
    let after = claimed_at.unwrap() - stall_to;
    assert!(after >= 1000 * MS, "not before a whole duration of reads: {after:?}");
    assert!(after <= 1200 * MS, "a duration and a retry after the API came back: {after:?}");
}

/// Someone else writes the lease over to this node (an edit, a replayed
/// write): the node renews it, but answers only a whole duration later,
/// when the holder before it has fallen silent whatever it last renewed.
#[test]
fn a_lease_given_by_someone_else_is_answered_for_a_duration_later() {
    let t0 = Instant::now();
    let mut b = eligible("b", t0);
    let t1 = t0 + 1000 * MS;
    b.on_read(Some(held_by("a", 7)), t1);
    let t2 = t1 + 200 * MS;
    b.on_read(Some(held_by("b", 8)), t2);
    assert_eq!(b.next(t2), Step::Claim, "it makes the lease its own");
    b.on_claimed(held_by("b", 9), t2, t2 + 5 * MS);
    assert_eq!(b.role(t2 + 5 * MS), Role::Candidate, "the old holder may still answer");
    assert_eq!(b.next(t2 + 10 * MS), Step::Wait(Some(t2 + 200 * MS)));
    b.on_claimed(held_by("b", 10), t2 + 800 * MS, t2 + 800 * MS);
    assert_eq!(b.next(t2 + 810 * MS), Step::Wait(Some(t2 + 1000 * MS)), "wakes when it may answer");
    assert_eq!(b.role(t2 + 999 * MS), Role::Candidate);
    assert!(matches!(b.role(t2 + 1000 * MS), Role::Holder { .. }));
    let takeover = b.last_takeover().unwrap();
    assert_eq!((takeover.at, takeover.from.as_deref()), (t2, Some("a")));
    // Found its own at its first read (a restart): its own, at once.
    let mut a = eligible("a", t0);
    a.on_read(Some(held_by("a", 7)), t1);
    a.on_claimed(held_by("a", 8), t1, t1);
    assert!(matches!(a.role(t1), Role::Holder { .. }));
}
