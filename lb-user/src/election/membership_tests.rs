use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

#[path = "membership_sim.rs"]
mod sim;

use sim::{Cluster, Latencies};

const TIMINGS: Timings = Timings {
    duration: Duration::from_millis(1_200),
    renew: Duration::from_millis(700),
    retry: Duration::from_millis(200),
    hold_down: Duration::from_millis(2_400),
};

const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

fn vips(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("198.18.1.{}", 10 + i)).collect()
}

/// Three nodes, each eligible for `n` VIPs, run until they have settled.
fn settled(n: usize, seed: u64) -> Cluster {
    let mut cluster = Cluster::new(&NODES, TIMINGS, Latencies::LAN, seed);
    for i in 0..NODES.len() {
        cluster.set_eligible(i, &vips(n));
    }
    let calm = cluster.at(5_000);
    cluster.run_until(calm);
    cluster
}

/// The node placement puts `vip` on among `nodes`.
fn placed(vip: &str, nodes: &[usize]) -> usize {
    let first = placement::first(vip, nodes.iter().map(|i| NODES[*i])).unwrap();
    NODES.iter().position(|n| *n == first).unwrap()
}

#[test]
fn fifty_vips_are_answered_once_each_spread_as_placed() {
    let cluster = settled(50, 1);
    for vip in vips(50) {
        assert_eq!(cluster.answering(&vip), vec![placed(&vip, &[0, 1, 2])], "{vip}");
    }
    let held = cluster.held();
    assert!(held.iter().all(|h| h.len() >= 8), "{held:?}");
}

#[test]
fn nodes_started_together_stay_placed_as_they_settle() {
    // Placed at once; the hold-downs run out at slightly different times
    // in each node's eyes, which must move nothing and write nothing more
    // than the renewals.
    let mut cluster = Cluster::new(&NODES, TIMINGS, Latencies::LAN, 9);
    for i in 0..NODES.len() {
        cluster.set_eligible(i, &vips(50));
    }
    let placed_at = cluster.at(1_000);
    cluster.run_until(placed_at);
    let before = cluster.answered_by.clone();
    assert_eq!(before.len(), 50);
    let writes = cluster.writes.clone();
    let later = placed_at + TIMINGS.hold_down * 2;
    cluster.run_until(later);
    assert_eq!(cluster.answered_by, before);
    let renewals = (TIMINGS.hold_down * 2).as_millis() / TIMINGS.renew.as_millis();
    for (i, (after, before)) in cluster.writes.iter().zip(writes).enumerate() {
        assert!(after - before <= renewals as u64 + 1, "node {i}: {} writes", after - before);
    }
}

/// A node's daemon killed and started again (its old fence run out, or
/// not yet counted gone by the others): after its hold-down it answers
/// exactly its share again, every VIP where placement puts it.
#[test]
fn a_restarted_node_takes_back_all_of_its_share() {
    for (seed, away) in [(3, 1_100), (4, 1_500), (5, 3_000), (6, 1_100), (7, 2_000)] {
        let mut cluster = settled(200, seed);
        cluster.kill(1);
        let back = cluster.now + Duration::from_millis(away);
        cluster.run_until(back);
        cluster.restart(1, &[]);
        // Its checks come up a few at a time, as a daemon's do.
        for k in (10..=200).step_by(10) {
            let at = cluster.now + Duration::from_millis(50);
            cluster.run_until(at);
            cluster.set_eligible(1, &vips(200)[..k]);
        }
        let later = back + TIMINGS.hold_down + TIMINGS.duration * 3;
        cluster.run_until(later);
        for vip in vips(200) {
            let holder = placed(&vip, &[0, 1, 2]);
            assert_eq!(cluster.answering(&vip), vec![holder], "{vip}, seed {seed}, away {away} ms");
        }
    }
}

#[test]
fn a_killed_nodes_vips_move_within_a_duration_and_no_other_moves() {
    let mut cluster = settled(50, 2);
    let before = cluster.answered_by.clone();
    let killed_at = cluster.now;
    cluster.kill(0);
    let later = cluster.at(10_000);
    cluster.run_until(later);
    let mut slowest = Duration::ZERO;
    for vip in vips(50) {
        let (holder, since) = cluster.answered_by[&vip];
        if before[&vip].0 == 0 {
            assert_eq!(holder, placed(&vip, &[1, 2]), "{vip}");
            slowest = slowest.max(since.duration_since(killed_at));
        } else {
            assert_eq!(cluster.answered_by[&vip], before[&vip], "{vip} moved");
        }
        assert_eq!(cluster.answering(&vip), vec![holder]);
    }
    // The dead node's last write is at most a renewal old, and the others
    // wait a whole duration from their sight of it, then claim.
    assert!(slowest > TIMINGS.duration - TIMINGS.renew, "took over after {slowest:?}");
    assert!(slowest <= TIMINGS.duration + Duration::from_millis(60), "took {slowest:?}");
}

#[test]
fn a_stopping_node_hands_over_within_a_few_round_trips() {
    let mut cluster = settled(50, 3);
    let before = cluster.answered_by.clone();
    let stopped_at = cluster.now;
    cluster.stop(0);
    let later = cluster.at(7_000);
    cluster.run_until(later);
    assert!(cluster.held()[0].is_empty());
    for vip in vips(50).iter().filter(|v| before[*v].0 == 0) {
        let (holder, since) = cluster.answered_by[vip];
        assert_eq!(holder, placed(vip, &[1, 2]), "{vip}");
        assert!(since.duration_since(stopped_at) <= Duration::from_millis(60), "{vip}");
    }
}

#[test]
fn a_vip_no_longer_eligible_on_its_holder_moves_alone() {
    let mut cluster = settled(50, 4);
    let before = cluster.answered_by.clone();
    let moved = vips(50).into_iter().find(|v| before[v].0 == 0).unwrap();
    let rest: Vec<String> = vips(50).into_iter().filter(|v| *v != moved).collect();
    let at = cluster.now;
    cluster.set_eligible(0, &rest);
    let later = cluster.at(7_000);
    cluster.run_until(later);
    let (holder, since) = cluster.answered_by[&moved];
    assert_eq!(holder, placed(&moved, &[1, 2]));
    assert!(since.duration_since(at) <= Duration::from_millis(60));
    for vip in &rest {
        assert_eq!(cluster.answered_by[vip], before[vip], "{vip} moved");
    }
}

#[test]
fn a_node_cut_from_the_api_falls_silent_then_takes_back_its_share_after_the_hold_down() {
    let mut cluster = settled(30, 5);
    let mine: Vec<String> = vips(30).into_iter().filter(|v| placed(v, &[0, 1, 2]) == 0).collect();
    let cut_at = cluster.now;
    let back = cluster.at(9_000);
    cluster.cut(0, back, back);
    // Its fence runs out an eighth of a duration before the others'
    // count of it does (the check between events says never both).
    let moved = cluster.at(8_900);
    cluster.run_until(moved);
    for vip in &mine {
        let (holder, since) = cluster.answered_by[vip];
        assert_ne!(holder, 0, "{vip}");
        assert!(since.duration_since(cut_at) <= TIMINGS.duration + Duration::from_millis(60));
    }
    // Back: a member again at once, but its share comes back only after
    // the hold-down.
    let early = back + TIMINGS.hold_down - Duration::from_millis(200);
    cluster.run_until(early);
    assert!(cluster.held()[0].is_empty(), "{:?}", cluster.held()[0]);
    let late = back + TIMINGS.hold_down + Duration::from_millis(1_000);
    cluster.run_until(late);
    let held: BTreeSet<String> = mine.iter().cloned().collect();
    assert_eq!(cluster.held()[0], held);
}

/// The API server stalls for every node (writes refused, watches
/// blind): every fence runs out and nobody answers meanwhile; when it
/// answers again, every VIP comes back on the node that held it. A node
/// counts another gone only after a whole duration of its own writes
/// landing: silence it could not have seen is no sign of death.
#[test]
fn an_api_stall_for_every_node_moves_no_vip() {
    for (seed, stall) in [(11, 2_000), (12, 5_000), (13, 1_300)] {
        let mut cluster = settled(60, seed);
        let before = cluster.answered_by.clone();
        let back = cluster.now + Duration::from_millis(stall);
        for i in 0..NODES.len() {
            cluster.cut(i, back, back);
        }
        let until = back + TIMINGS.hold_down + TIMINGS.duration * 3;
        // Bounded: one step per 20 ms of simulated time.
        while cluster.now < until {
            let next = cluster.now + Duration::from_millis(20);
            cluster.run_until(next);
            for (vip, (holder, _)) in &before {
                let answering = cluster.answering(vip);
                assert!(
                    answering.iter().all(|i| i == holder),
                    "{vip}, held by {holder}, answered by {answering:?} {:?} after the stall \
                     of {stall} ms (seed {seed})",
                    cluster.now.duration_since(back)
                );
            }
        }
        for (vip, (holder, _)) in &before {
            assert_eq!(
                cluster.answering(vip),
                vec![*holder],
                "{vip} after the stall of {stall} ms"
            );
        }
    }
}

#[test]
fn a_node_whose_writes_come_back_before_its_watch_answers_nothing_it_has_not_seen() {
    let mut cluster = settled(30, 7);
    let mine = cluster.held()[0].clone();
    // Its writes fail for 3 s: its fence runs out and the others take its
    // VIPs over. Then its writes land again while its watch still shows
    // the cluster as it was: its claims, seen before the lapse, are no
    // warrant (the others' claims since are not in what it saw).
    let writes = cluster.now + Duration::from_millis(3_000);
    let watch = cluster.now + Duration::from_millis(6_000);
    cluster.cut(0, writes, watch);
    let back = writes + Duration::from_millis(500);
    cluster.run_until(back);
    assert!(cluster.held()[0].is_empty());
    for vip in &mine {
        assert_ne!(cluster.answering(vip), vec![0], "{vip}");
    }
    let later = watch + TIMINGS.hold_down * 2;
    cluster.run_until(later);
    assert_eq!(cluster.held()[0], mine);
}

/// One machine alone, its writes acknowledged and seen at once.
fn alone(vips: &[String], now: Instant) -> Machine {
    let mut machine = Machine::new("node-a".into(), "node-a_t".into(), TIMINGS, None);
    machine.set_eligible(vips.iter().cloned().collect(), now);
    for version in ["1", "2"] {
        assert!(matches!(machine.poll(now), Step::Write(_)));
        machine.on_written(version.into(), now);
        machine.on_watched(Watched::Applied(own(version, vips)), now);
    }
    machine
}

fn own(version: &str, claims: &[String]) -> Lease {
    let claims: BTreeSet<String> = claims.iter().cloned().collect();
    Lease {
        node: "node-a".into(),
        identity: "node-a_t".into(),
        version: version.into(),
        content: Content { eligible: claims.clone(), claims },
    }
}

#[test]
fn a_renewal_acknowledged_after_the_fence_ran_out_is_no_warrant_for_the_claims_before() {
    let start = Instant::now();
    let v = vips(1);
    let mut machine = alone(&v, start);
    assert!(machine.answering(start).is_some());
    // A renewal goes, and its acknowledgement is slow: the fence runs out.
    let renewal = start + TIMINGS.renew;
    assert!(matches!(machine.poll(renewal), Step::Write(_)));
    let lapsed = start + TIMINGS.duration - TIMINGS.margin();
    assert!(matches!(machine.poll(lapsed), Step::Wait(_)), "one write at a time");
    assert_eq!(machine.answering(lapsed), None);
    // It lands: the fence is renewed, but another node may have taken the
    // VIP meanwhile, and what this one saw before says nothing of that.
    let acked = lapsed + Duration::from_millis(50);
    machine.on_written("3".into(), acked);
    assert_eq!(machine.answering(acked), None);
    machine.on_watched(Watched::Applied(own("3", &v)), acked);
    assert_eq!(machine.answering(acked), None);
    // A claim written after the lapse, and seen, with no other claim.
    assert!(matches!(machine.poll(acked), Step::Write(_)));
    machine.on_written("4".into(), acked);
    machine.on_watched(Watched::Applied(own("4", &v)), acked);
    assert!(machine.answering(acked).is_some());
}

#[test]
fn a_lease_listed_again_unchanged_renews_no_membership() {
    // node-b outranks node-a for `v` and claims it; then it dies, and a
    // relist (the watch starting over) shows its Lease as it was: that is
    // no sign of life, and node-a takes `v` when node-b has run out.
    let v =
        vips(20).into_iter().find(|v| placement::first(v, ["node-a", "node-b"]) == Some("node-b"));
    let v = vec![v.unwrap()];
    let start = Instant::now();
    let mut b_lease = own("10", &v);
    b_lease.node = "node-b".into();
    b_lease.identity = "node-b_t".into();
    let mut a = Machine::new("node-a".into(), "node-a_t".into(), TIMINGS, None);
    a.set_eligible(v.iter().cloned().collect(), start);
    a.on_watched(Watched::Applied(b_lease.clone()), start);
    let Step::Write(_) = a.poll(start) else { panic!("no first write") };
    a.on_written("11".into(), start);
    a.on_watched(Watched::Applied(own("11", &[])), start);
    // node-a renews meanwhile.
    let at = start + TIMINGS.renew;
    let Step::Write(_) = a.poll(at) else { panic!("no renewal") };
    a.on_written("12".into(), at);
    a.on_watched(Watched::Applied(own("12", &[])), at);
    let relisted = start + TIMINGS.duration - Duration::from_millis(100);
    a.on_watched(Watched::Listed(vec![b_lease, own("12", &[])]), relisted);
    let after = start + TIMINGS.duration + Duration::from_millis(1);
    let Step::Write(claim) = a.poll(after) else { panic!("no claim once node-b ran out") };
    assert_eq!(claim.claims, v.iter().cloned().collect::<BTreeSet<_>>());
}

#[test]
fn a_claim_seen_late_still_waits_for_a_member_alive_when_it_was_sent() {
    // node-b outranks node-a for `v`, and node-a holds it: node-b claims
    // it and must wait until node-a lets go.
    let v =
        vips(20).into_iter().find(|v| placement::first(v, ["node-a", "node-b"]) == Some("node-b"));
    let v = vec![v.unwrap()];
    let start = Instant::now();
    let mut b = Machine::new("node-b".into(), "node-b_t".into(), TIMINGS, None);
    b.set_eligible(v.iter().cloned().collect(), start);
    let holder = |version: &str| {
        let mut lease = own(version, &v);
        lease.node = "node-a".into();
        lease.identity = "node-a_t".into();
        Watched::Applied(lease)
    };
    b.on_watched(holder("1"), start);
    let Step::Write(first) = b.poll(start) else { panic!("no first write") };
    assert!(first.claims.is_empty(), "no claim before it is a member");
    b.on_written("2".into(), start);
    let mut lease = own("2", &[]);
    lease.node = "node-b".into();
    lease.identity = "node-b_t".into();
    b.on_watched(Watched::Applied(lease.clone()), start);
    // Its claim goes; node-a renews just before it lands.
    let sent = start + Duration::from_millis(10);
    let Step::Write(claim) = b.poll(sent) else { panic!("no claim") };
    assert_eq!(claim.claims.len(), 1);
    b.on_written("4".into(), sent);
    b.on_watched(holder("3"), sent);
    // Its watch stalls; it renews; the claim and the renewal come back
    // much later, when node-a's renewal is older than a duration by the
    // clock, though node-a was alive when they went: it may still be
    // answering.
    let renewed = sent + TIMINGS.renew;
    let Step::Write(renewal) = b.poll(renewed) else { panic!("no renewal") };
    b.on_written("6".into(), renewed);
    let late = sent + TIMINGS.duration + Duration::from_millis(50);
    for (version, content) in [("4", claim), ("6", renewal)] {
        lease.version = version.into();
        lease.content = content;
        b.on_watched(Watched::Applied(lease.clone()), late);
        assert_eq!(b.answering(late), None);
    }
    // A fresh claim, sent now node-a has run out, settles it.
    let Step::Write(again) = b.poll(late) else { panic!("no fresh write") };
    b.on_written("7".into(), late);
    lease.version = "7".into();
    lease.content = again;
    b.on_watched(Watched::Applied(lease), late);
    assert!(b.answering(late).is_some());
}

#[test]
fn a_write_to_its_lease_by_another_daemon_silences_a_node_for_a_duration() {
    let mut cluster = settled(30, 6);
    let mine = cluster.held()[0].clone();
    assert!(!mine.is_empty());
    cluster.foreign_write(0);
    let seen = cluster.now + Duration::from_millis(20);
    cluster.run_until(seen);
    assert!(cluster.held()[0].is_empty());
    let later = cluster.now + TIMINGS.duration * 3;
    cluster.run_until(later);
    assert_eq!(cluster.held()[0], mine);
}

#[test]
fn a_write_by_another_daemon_withdraws_no_claim_of_the_node() {
    let mut cluster = settled(30, 8);
    let mine = cluster.held()[0].clone();
    // Another daemon with node-a's name writes its Lease claiming nothing,
    // while node-a's watch lags: node-a goes on answering until it sees
    // the write, so nobody may take its VIPs on the strength of it.
    let watch = cluster.now + Duration::from_millis(500);
    let now = cluster.now;
    cluster.cut(0, now, watch);
    cluster.foreign_write(0);
    let seen = watch - Duration::from_millis(10);
    cluster.run_until(seen);
    assert_eq!(cluster.held()[0], mine);
    // Seen: node-a falls silent and says so; the others take over.
    let later = watch + Duration::from_millis(200);
    cluster.run_until(later);
    assert!(cluster.held()[0].is_empty());
    for vip in &mine {
        assert_eq!(cluster.answering(vip).len(), 1, "{vip}");
    }
}

#[test]
fn a_restarted_daemon_keeps_answering_what_its_lease_claims() {
    let start = Instant::now();
    let fence = start + Duration::from_millis(600);
    let kept: BTreeSet<String> = vips(2).into_iter().collect();
    let mut machine =
        Machine::new("node-a".into(), "node-a_t".into(), TIMINGS, Some((fence, kept.clone())));
    machine.set_eligible(kept.clone(), start);
    let claims = Content { eligible: kept.clone(), claims: kept.clone() };
    let lease = Lease {
        node: "node-a".into(),
        identity: "node-a_t".into(),
        version: "7".into(),
        content: claims.clone(),
    };
    machine.on_watched(Watched::Listed(vec![lease]), start);
    assert_eq!(machine.answering(start), Some((fence, &kept)));
    // It renews at once, and keeps its claims.
    assert_eq!(machine.poll(start), Step::Write(claims));
    let acked = start + Duration::from_millis(5);
    machine.on_written("8".into(), acked);
    let (renewed, vips) = machine.answering(acked).unwrap();
    assert_eq!(vips, &kept);
    assert_eq!(renewed, start + TIMINGS.duration - TIMINGS.margin());
}

#[test]
fn a_restarted_daemon_whose_fence_ran_out_starts_over() {
    let start = Instant::now();
    let kept: BTreeSet<String> = vips(2).into_iter().collect();
    let mut machine =
        Machine::new("node-a".into(), "node-a_t".into(), TIMINGS, Some((start, kept.clone())));
    machine.set_eligible(kept.clone(), start);
    let lease = Lease {
        node: "node-a".into(),
        identity: "node-a_t".into(),
        version: "7".into(),
        content: Content { eligible: kept.clone(), claims: kept },
    };
    let now = start + Duration::from_millis(1);
    machine.on_watched(Watched::Listed(vec![lease]), now);
    assert_eq!(machine.answering(now), None);
}

#[test]
fn nothing_is_written_before_the_daemon_says_what_the_node_can_serve() {
    let start = Instant::now();
    let mut machine = Machine::new("node-a".into(), "node-a_t".into(), TIMINGS, None);
    assert_eq!(machine.poll(start), Step::Wait(None));
    machine.set_eligible(BTreeSet::new(), start);
    assert_eq!(machine.poll(start), Step::Write(Content::default()));
}

#[derive(Clone, Debug)]
enum Action {
    Kill(usize),
    /// Writes and watch cut, for so many milliseconds each.
    Cut(usize, u64, u64),
    Eligible(usize, Vec<bool>),
    Stop(usize),
    Foreign(usize),
}

fn action() -> impl Strategy<Value = (u64, Action)> {
    let node = 0..NODES.len();
    let what = prop_oneof![
        node.clone().prop_map(Action::Kill),
        (node.clone(), 0..4_000u64, 0..4_000u64).prop_map(|(n, w, r)| Action::Cut(n, w, r)),
        (node.clone(), prop::collection::vec(any::<bool>(), 8))
            .prop_map(|(n, e)| Action::Eligible(n, e)),
        node.clone().prop_map(Action::Stop),
        node.prop_map(Action::Foreign),
    ];
    (0..15_000u64, what)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Whatever the latencies, losses, kills, cuts and changes, no VIP is
    /// ever answered by two nodes (checked after every event); once the
    /// network is calm again, every VIP some live node can serve is
    /// answered, by the node placement puts it on.
    #[test]
    fn never_two_answering_and_every_vip_answered_once_calm(
        seed in any::<u64>(),
        land in (0..600u64, 0..600u64),
        ack in (0..600u64, 0..600u64),
        watch in (0..1_500u64, 0..1_500u64),
        lost_acks in 0..300u64,
        mut actions in prop::collection::vec(action(), 0..8),
    ) {
        let order = |(a, b): (u64, u64)| (a.min(b), a.max(b));
        let latencies =
            Latencies { land: order(land), ack: order(ack), watch: order(watch), lost_acks };
        let mut cluster = Cluster::new(&NODES, TIMINGS, latencies, seed);
        let all = vips(8);
        for i in 0..NODES.len() {
            cluster.set_eligible(i, &all);
        }
        let mut eligible = vec![all.clone(); NODES.len()];
        let mut gone = [false; 3];
        actions.sort_by_key(|(at, _)| *at);
        for (at, action) in actions {
            let at = cluster.at(at);
            cluster.run_until(at);
            match action {
                Action::Kill(i) => {
                    cluster.kill(i);
                    gone[i] = true;
                }
                Action::Cut(i, writes, watch) => {
                    let writes = cluster.now + Duration::from_millis(writes);
                    let watch = cluster.now + Duration::from_millis(watch);
                    cluster.cut(i, writes, watch);
                }
                Action::Eligible(i, which) => {
                    let vips: Vec<String> =
                        all.iter().zip(&which).filter(|(_, e)| **e).map(|(v, _)| v.clone()).collect();
                    eligible[i] = vips.clone();
                    cluster.set_eligible(i, &vips);
                }
                Action::Stop(i) => {
                    cluster.stop(i);
                    gone[i] = true;
                }
                Action::Foreign(i) => cluster.foreign_write(i),
            }
        }
        // Calm: LAN latencies, every cut over, time for the hold-downs.
        let calm = cluster.at(20_000);
        cluster.run_until(calm);
        cluster.latencies = Latencies::LAN;
        let settled = cluster.at(30_000);
        cluster.run_until(settled);
        for vip in &all {
            let serving: Vec<usize> =
                (0..NODES.len()).filter(|i| !gone[*i] && eligible[*i].contains(vip)).collect();
            let expected = if serving.is_empty() { vec![] } else { vec![placed(vip, &serving)] };
            prop_assert_eq!(cluster.answering(vip), expected, "{}", vip);
        }
    }
}

/// The LoadBalancer allocator's token (`0.0.0.0`, `daemon::
/// load_balancer_task::ALLOCATOR`) is placed as a VIP is: one node
/// answers it, and a forged write to that node's Lease (another daemon,
/// or an attacker, with its name) never makes two allocators, not for
/// one step of the simulation: the node falls silent first, another
/// takes the token, and it comes back to one.
#[test]
fn the_allocator_token_is_answered_once_and_a_forged_write_never_makes_two() {
    const TOKEN: &str = "0.0.0.0";
    let mut all = vips(10);
    all.push(TOKEN.to_owned());
    let mut cluster = Cluster::new(&NODES, TIMINGS, Latencies::LAN, 12);
    for i in 0..NODES.len() {
        cluster.set_eligible(i, &all);
    }
    let calm = cluster.at(5_000);
    cluster.run_until(calm);
    let holder = cluster.answering(TOKEN);
    assert_eq!(holder, vec![placed(TOKEN, &[0, 1, 2])]);
    cluster.foreign_write(holder[0]);
    let mut silent = false;
    for _ in 0..(TIMINGS.duration * 4).as_millis() / 10 {
        let next = cluster.now + Duration::from_millis(10);
        cluster.run_until(next);
        let now = cluster.answering(TOKEN);
        assert!(now.len() <= 1, "two allocators: {now:?}");
        silent |= !now.contains(&holder[0]);
    }
    assert!(silent, "the node whose Lease was written by another went on allocating");
    assert_eq!(cluster.answering(TOKEN).len(), 1, "nobody allocates");
}
