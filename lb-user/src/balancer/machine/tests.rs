//! The balancer contract of `design.md`, one named test per behaviour, plus
//! the k3s rework's own sequence and property tests of the invariants. All
//! with simulated time.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use proptest::prelude::*;

use super::*;

fn a(n: u8) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, n], 6443))
}

const CHECKS: Checks = Checks { rise: 1, fall: 1, passive_only: false };

/// A balancer under test with its clock.
struct Sim {
    lb: Balancer,
    now: Instant,
    effects: Vec<Effect>,
}

impl Sim {
    fn new(
        policy: Policy,
        checks: Checks,
        servers: &[SocketAddr],
        default: Option<SocketAddr>,
    ) -> Self {
        let now = Instant::now();
        let (lb, effects) = Balancer::new(policy, checks, servers, default, now);
        Self { lb, now, effects }
    }

    fn failover(servers: &[SocketAddr]) -> Self {
        Self::new(Policy::Failover, CHECKS, servers, None)
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
        self.effects = self.lb.on_tick(self.now);
    }

    fn pass(&mut self, server: SocketAddr) -> &[Effect] {
        self.effects = self.lb.on_health(server, Health::Pass, self.now);
        &self.effects
    }

    fn fail(&mut self, server: SocketAddr) -> &[Effect] {
        self.effects = self.lb.on_health(server, Health::Fail("HTTP 500".into()), self.now);
        &self.effects
    }

    fn kernel(&mut self, server: SocketAddr, event: KernelReport) -> &[Effect] {
        self.effects = self.lb.on_kernel_report(server, event, self.now);
        &self.effects
    }

    fn set(&mut self, servers: &[SocketAddr], default: Option<SocketAddr>) -> &[Effect] {
        self.effects = self.lb.set_servers(servers, default, self.now);
        &self.effects
    }

    fn state(&self, server: SocketAddr) -> State {
        self.lb.server(server).map_or(State::Invalid, |s| s.state)
    }

    /// Where the next connection goes (with no kernel hold-down active).
    fn target(&self) -> Option<SocketAddr> {
        self.lb.selection().servers.first().copied()
    }

    fn closed(&self) -> Vec<SocketAddr> {
        closed(&self.effects)
    }
}

fn closed(effects: &[Effect]) -> Vec<SocketAddr> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::CloseConnections { server, .. } => Some(*server),
            _ => None,
        })
        .collect()
}

/// How many new selections `effects` write (a write of the servers'
/// states alone sends no connect elsewhere).
fn writes(effects: &[Effect]) -> usize {
    effects.iter().filter(|e| matches!(e, Effect::WriteSelection { reordered: true, .. })).count()
}

/// The selection `effects` write last, if any.
fn written(effects: &[Effect]) -> Option<&Selection> {
    effects.iter().rev().find_map(|e| match e {
        Effect::WriteSelection { value, .. } => Some(&value.selection),
        _ => None,
    })
}

#[test]
fn new_servers_are_unchecked_and_the_first_selection_is_written() {
    let sim = Sim::failover(&[a(1), a(2)]);
    assert_eq!(sim.state(a(1)), State::Unchecked);
    assert_eq!(writes(&sim.effects), 1);
    assert_eq!(sim.lb.selection().servers, [a(1), a(2)]);
}

#[test]
fn state_transition_table() {
    use State::*;
    // (start state reached by setup, input, expected state)
    type Input = fn(&mut Sim, SocketAddr);
    let pass: Input = |s, x| {
        s.pass(x);
    };
    let fail: Input = |s, x| {
        s.fail(x);
    };
    let refused: Input = |s, x| {
        s.kernel(x, KernelReport::ConnectFailed);
    };
    let refused_then_fail: Input = |s, x| {
        s.kernel(x, KernelReport::ConnectFailed);
        s.fail(x);
    };
    let established: Input = |s, x| {
        s.kernel(x, KernelReport::Established);
    };
    let unknown: Input = |s, x| {
        s.effects = s.lb.on_health(x, Health::Unknown, s.now);
    };
    let to_failed: Input = |s, x| {
        s.fail(x);
    };
    let to_active: Input = |s, x| {
        s.pass(x);
    };
    let none: Input = |_, _| {};
    let rows: [(&str, Input, Input, State); 17] = [
        ("unchecked + pass", none, pass, Active),
        ("unchecked + fail", none, fail, Failed),
        ("unchecked + refused (suspect)", none, refused, Unchecked),
        ("unchecked + refused, confirmed", none, refused_then_fail, Failed),
        ("unchecked + established", none, established, Unchecked),
        ("unchecked + unknown", none, unknown, Unchecked),
        ("failed + pass", to_failed, pass, Active),
        ("failed + established", to_failed, established, Recovering),
        ("failed + fail", to_failed, fail, Failed),
        ("failed + unknown", to_failed, unknown, Failed),
        ("active + pass", to_active, pass, Active),
        ("active + fail", to_active, fail, Failed),
        ("active + refused (suspect)", to_active, refused, Active),
        ("active + refused, confirmed", to_active, refused_then_fail, Failed),
        ("failed + refused", to_failed, refused, Failed),
        ("active + established", to_active, established, Active),
        ("active + unknown", to_active, unknown, Active),
    ];
    for (name, setup, input, expected) in rows {
        let mut sim = Sim::failover(&[a(1)]);
        setup(&mut sim, a(1));
        input(&mut sim, a(1));
        assert_eq!(sim.state(a(1)), expected, "{name}");
    }
}

#[test]
fn rise_and_fall_count_in_a_row() {
    let checks = Checks { rise: 3, fall: 2, passive_only: false };
    let mut sim = Sim::new(Policy::Failover, checks, &[a(1)], None);
    sim.pass(a(1));
    assert_eq!(sim.state(a(1)), State::Recovering);
    sim.pass(a(1));
    sim.fail(a(1));
    assert_eq!(sim.state(a(1)), State::Recovering, "one failure is below fall = 2");
    sim.pass(a(1));
    sim.pass(a(1));
    assert_eq!(sim.state(a(1)), State::Recovering, "the failure reset the passes");
    sim.pass(a(1));
    assert_eq!(sim.state(a(1)), State::Active);
    sim.fail(a(1));
    assert_eq!(sim.state(a(1)), State::Active);
    sim.fail(a(1));
    assert_eq!(sim.state(a(1)), State::Failed);
}

#[test]
fn preferred_ages_into_healthy() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    sim.pass(a(2));
    assert_eq!((sim.state(a(1)), sim.state(a(2))), (State::Active, State::Preferred));
    sim.advance(PREFERRED_FOR);
    assert_eq!(sim.state(a(2)), State::Healthy);
    assert_eq!(writes(&sim.effects), 0, "the order did not change");
}

#[test]
fn a_failover_service_with_no_healthy_server_leaves_no_deadline_in_the_past() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.fail(a(1));
    sim.fail(a(2));
    assert_eq!(sim.lb.next_deadline(), Some(sim.now + FIRST_ELECTION_WAIT));
    sim.advance(FIRST_ELECTION_WAIT);
    assert_eq!(sim.lb.next_deadline(), None, "the wait is over, though no one was elected");
}

#[test]
fn the_next_deadline_is_when_a_tick_has_something_to_do() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    sim.pass(a(2));
    assert_eq!(sim.state(a(2)), State::Preferred);
    let deadline = sim.lb.next_deadline().expect("a preferred server ages");
    assert_eq!(deadline, sim.now + PREFERRED_FOR);
    sim.advance(PREFERRED_FOR - Duration::from_millis(1));
    assert!(sim.effects.is_empty(), "{:?}", sim.effects);
    assert_eq!(sim.state(a(2)), State::Preferred);
    sim.advance(Duration::from_millis(1));
    assert_eq!(sim.state(a(2)), State::Healthy);
    assert_eq!(sim.lb.next_deadline(), None, "nothing left to age, the election is over");
}

#[test]
fn behaviour_1_never_black_hole_failed_servers_are_a_last_resort() {
    // k3s 10240: every health check fails, yet connects must still go somewhere.
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.fail(a(1));
    sim.fail(a(2));
    assert_eq!(sim.lb.selection().servers, [a(1), a(2)], "failed servers stay selectable");
    // Only a service with no server at all has an empty selection.
    sim.set(&[], None);
    assert_eq!(sim.lb.selection().servers, Vec::<SocketAddr>::new());
}

#[test]
fn behaviour_2_a_removed_server_is_never_selected_again_and_its_connections_close() {
    // k3s 9882, 7193.
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    sim.pass(a(2));
    sim.set(&[a(2)], None);
    assert_eq!(sim.closed(), [a(1)]);
    assert!(!sim.lb.selection().servers.contains(&a(1)));
    assert_eq!(sim.target(), Some(a(2)));
    // Late reports about the removed server change nothing.
    assert!(sim.pass(a(1)).is_empty());
    assert!(sim.kernel(a(1), KernelReport::Established).is_empty());
}

#[test]
fn behaviour_2_a_removed_default_stays_as_standby_until_another_default_is_set() {
    let mut sim = Sim::new(Policy::Failover, CHECKS, &[a(1), a(2)], Some(a(1)));
    sim.set(&[a(2)], Some(a(1)));
    assert_eq!(sim.state(a(1)), State::Standby);
    assert!(sim.lb.selection().servers.contains(&a(1)), "standby is a last resort");
    sim.set(&[a(2)], Some(a(3)));
    assert_eq!(sim.state(a(1)), State::Invalid);
    assert!(sim.closed().contains(&a(1)));
    assert_eq!(sim.state(a(3)), State::Standby);
}

#[test]
fn behaviour_3_a_server_failing_its_check_loses_traffic_and_connections_to_a_healthy_peer() {
    // k3s 9910, rke2 6376: accepts TCP, but /readyz says 500.
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    sim.pass(a(2));
    assert_eq!(sim.target(), Some(a(1)));
    sim.fail(a(1));
    assert_eq!(sim.closed(), [a(1)]);
    assert_eq!(sim.target(), Some(a(2)));
    assert_eq!(sim.state(a(2)), State::Active);
}

#[test]
fn connections_close_only_after_the_new_selection_is_written() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    sim.pass(a(2));
    for effects in [sim.fail(a(1)).to_vec(), sim.set(&[a(1)], None).to_vec()] {
        let write = effects
            .iter()
            .position(|e| matches!(e, Effect::WriteSelection { .. }))
            .expect("a new selection");
        let close = effects
            .iter()
            .position(|e| matches!(e, Effect::CloseConnections { .. }))
            .expect("a close");
        assert!(write < close, "{effects:?}");
    }
}

#[test]
fn behaviour_3_without_a_healthy_peer_connections_stay() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    sim.fail(a(2));
    sim.fail(a(1));
    assert_eq!(sim.closed(), Vec::<SocketAddr>::new(), "nowhere better to go");
    // As soon as a peer is healthy, the failed server's connections move.
    sim.pass(a(2));
    assert_eq!(sim.closed(), [a(1)]);
    assert_eq!(sim.target(), Some(a(2)));
}

/// The kernel itself steers the next connect away (its hold-down, tested
/// in `choose` and the integration tests); the balancer asks for a check at
/// once and fails the server when the check confirms it, whatever `fall`.
#[test]
fn behaviour_4_a_failed_connect_is_confirmed_at_once_then_moves_everything() {
    let checks = Checks { rise: 1, fall: 3, passive_only: false };
    let mut sim = Sim::new(Policy::Failover, checks, &[a(1), a(2)], None);
    sim.pass(a(1));
    sim.pass(a(2));
    assert_eq!(sim.kernel(a(1), KernelReport::ConnectFailed), [Effect::CheckNow { server: a(1) }]);
    assert_eq!(sim.state(a(1)), State::Active, "one report is not yet a failure");
    assert_eq!(sim.kernel(a(1), KernelReport::ConnectFailed), [], "already being checked");
    let effects = sim.fail(a(1)).to_vec();
    assert_eq!(sim.state(a(1)), State::Failed, "the check confirmed it, fall = 3 notwithstanding");
    assert_eq!(
        written(&effects),
        Some(&Selection { servers: vec![a(2), a(1)], spread: 1 }),
        "{effects:?}"
    );
    assert_eq!(closed(&effects), [a(1)]);
    sim.kernel(a(2), KernelReport::ConnectTimeout);
    assert_eq!(sim.state(a(2)), State::Active);
    sim.fail(a(2));
    assert_eq!(sim.state(a(2)), State::Failed);
}

/// A client that gives up on its connects (or a lost SYN) must not fail a
/// healthy server or reset its connections.
#[test]
fn behaviour_4_one_ambiguous_report_never_resets_a_healthy_server() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    sim.pass(a(2));
    for _ in 0..100 {
        let effects = sim.kernel(a(1), KernelReport::ConnectTimeout).to_vec();
        assert!(closed(&effects).is_empty() && writes(&effects) == 0, "{effects:?}");
    }
    sim.pass(a(1));
    assert_eq!(sim.state(a(1)), State::Active);
    assert!(!sim.lb.server(a(1)).unwrap().suspect, "a passing check clears the report");
    assert_eq!(
        sim.kernel(a(1), KernelReport::ConnectFailed),
        [Effect::CheckNow { server: a(1) }],
        "a new report asks again"
    );
}

/// A restarted daemon keeps the kernel's selection (server 3 down, left out
/// of the spread group) until its own checks say otherwise, instead of
/// writing the configured order with every server unchecked, which would
/// put server 3 back among the servers the kernel picks from (found by the
/// chaos test, with an outage longer than the hold-down: no failure mark is
/// left to protect it).
#[test]
fn adopting_keeps_the_kernels_selection_until_every_server_has_a_result() {
    let mut sim = Sim::new(Policy::Spread, CHECKS, &[a(1), a(2), a(3), a(4)], None);
    let kernel = Selection { servers: vec![a(1), a(2), a(4), a(3)], spread: 3 };
    assert_eq!(sim.lb.adopt(kernel.clone(), &[], &[], sim.now), []);
    sim.advance(Duration::from_secs(1));
    assert_eq!(writes(&sim.effects), 0, "the first tick keeps the kernel's selection");
    sim.pass(a(1));
    sim.pass(a(2));
    sim.pass(a(4));
    assert_eq!(writes(&sim.effects), 0, "server 3 has no result yet");
    let effects = sim.fail(a(3)).to_vec();
    assert_eq!(
        writes(&effects),
        0,
        "every server has a result and the order is the kernel's: {effects:?}"
    );
    assert_eq!(sim.lb.selection(), kernel);
}

#[test]
fn adopting_failover_keeps_the_kernels_active_server() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    let kernel = Selection { servers: vec![a(2), a(1)], spread: 1 };
    assert_eq!(sim.lb.adopt(kernel, &[], &[a(1)], sim.now), [Effect::CheckNow { server: a(1) }]);
    assert_eq!(writes(sim.pass(a(1))), 0, "server 2 has no result yet");
    let effects = sim.pass(a(2)).to_vec();
    assert_eq!(
        sim.state(a(2)),
        State::Active,
        "the kernel's first server wins among equals: {effects:?}"
    );
    assert_eq!(writes(&effects), 0);
    // Nor is the hold forever.
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.lb.adopt(Selection { servers: vec![a(2), a(1)], spread: 1 }, &[], &[], sim.now);
    sim.pass(a(1));
    sim.advance(FIRST_ELECTION_WAIT);
    assert_eq!(writes(&sim.effects), 1, "{:?}", sim.effects);
}

#[test]
fn adopting_with_passive_checks_fails_what_the_kernel_marked() {
    let checks = Checks { rise: 1, fall: 3, passive_only: true };
    let mut sim = Sim::new(Policy::Failover, checks, &[a(1), a(2)], None);
    let effects =
        sim.lb.adopt(Selection { servers: vec![a(2), a(1)], spread: 1 }, &[], &[a(1)], sim.now);
    assert_eq!(sim.state(a(1)), State::Failed, "{effects:?}");
    assert_eq!(sim.lb.selection().servers, [a(2), a(1)]);
}

/// The previous daemon's states, kept in the kernel beside the selection,
/// bring back a server's failure after its kernel mark expired, and its
/// active server.
#[test]
fn adopting_restores_the_previous_daemons_failed_and_active_servers() {
    let checks = Checks { rise: 1, fall: 1, passive_only: true };
    let mut sim = Sim::new(Policy::Failover, checks, &[a(1), a(2), a(3)], None);
    let kernel = Selection { servers: vec![a(3), a(2), a(1)], spread: 1 };
    let states = [State::Active.code(), State::Healthy.code(), State::Failed.code()];
    let effects = sim.lb.adopt(kernel.clone(), &states, &[], sim.now);
    assert_eq!(sim.state(a(1)), State::Failed, "{effects:?}");
    assert_eq!(sim.state(a(3)), State::Active, "{effects:?}");
    assert_eq!(writes(&effects), 0, "{effects:?}");
    assert_eq!(sim.lb.selection(), kernel);
    assert_eq!(sim.lb.state_codes(&[a(1), a(9)]), [State::Failed.code(), 0]);
    for state in [
        State::Failed,
        State::Standby,
        State::Unchecked,
        State::Recovering,
        State::Healthy,
        State::Preferred,
        State::Active,
    ] {
        assert_eq!(State::from_code(state.code()), Some(state));
    }
}

#[test]
fn passive_only_needs_fall_reports_in_a_row() {
    let checks = Checks { rise: 1, fall: 2, passive_only: true };
    let mut sim = Sim::new(Policy::Failover, checks, &[a(1), a(2)], None);
    sim.kernel(a(1), KernelReport::ConnectFailed);
    assert_eq!(sim.state(a(1)), State::Active);
    sim.kernel(a(1), KernelReport::Established);
    sim.kernel(a(1), KernelReport::ConnectFailed);
    assert_eq!(
        sim.state(a(1)),
        State::Active,
        "an established connection in between resets the count"
    );
    sim.kernel(a(1), KernelReport::ConnectTimeout);
    assert_eq!(sim.state(a(1)), State::Failed);
    assert_eq!(sim.target(), Some(a(2)));
}

/// With every server healthy, the first active server is the default, then
/// the first configured, whatever order the checks answer in.
#[test]
fn the_first_election_is_the_default_then_configured_order_whoever_answers_first() {
    let orders: [[u8; 3]; 6] = [[1, 2, 3], [1, 3, 2], [2, 1, 3], [2, 3, 1], [3, 1, 2], [3, 2, 1]];
    for order in orders {
        let mut sim = Sim::failover(&[a(1), a(2), a(3)]);
        for n in order {
            sim.pass(a(n));
        }
        assert_eq!(sim.state(a(1)), State::Active, "checks answered in the order {order:?}");
        let mut sim = Sim::new(Policy::Failover, CHECKS, &[a(1), a(2), a(3)], Some(a(3)));
        for n in order {
            sim.pass(a(n));
        }
        assert_eq!(
            sim.state(a(3)),
            State::Active,
            "the default wins; checks answered in the order {order:?}"
        );
    }
    // A better-ranked server that fails does not hold the election up.
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(2));
    assert_eq!(sim.state(a(2)), State::Preferred, "waits for server 1's first result");
    assert_eq!(sim.target(), Some(a(2)), "but new connections already go to a healthy server");
    sim.fail(a(1));
    assert_eq!(sim.state(a(2)), State::Active);
    // Nor one that never answers.
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(2));
    sim.advance(FIRST_ELECTION_WAIT);
    assert_eq!(sim.state(a(2)), State::Active);
}

#[test]
fn behaviour_5_fail_back_off_the_default_closes_its_connections() {
    // k3s 11311.
    let mut sim = Sim::new(Policy::Failover, CHECKS, &[a(1)], Some(a(9)));
    sim.fail(a(1));
    assert_eq!(sim.target(), Some(a(9)), "the standby default is the last resort");
    sim.pass(a(1));
    assert_eq!(sim.target(), Some(a(1)));
    assert!(sim.closed().contains(&a(9)), "{:?}", sim.effects);
}

#[test]
fn behaviour_5_no_flapping_back_among_real_servers() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    sim.pass(a(2));
    sim.fail(a(1));
    assert_eq!(sim.target(), Some(a(2)));
    sim.pass(a(1));
    assert_eq!(sim.state(a(1)), State::Preferred);
    assert_eq!(sim.target(), Some(a(2)), "the healthy active server stays");
    assert_eq!(sim.closed(), Vec::<SocketAddr>::new());
}

#[test]
fn behaviour_6_recovers_from_a_total_outage_without_a_restart() {
    // k3s 11349: down and up, several rounds.
    let mut sim = Sim::failover(&[a(1), a(2)]);
    for round in 0..5 {
        sim.pass(a(1));
        sim.pass(a(2));
        assert!(sim.lb.servers().iter().any(|s| s.state == State::Active), "round {round}");
        sim.kernel(a(1), KernelReport::ConnectFailed);
        sim.fail(a(1));
        sim.fail(a(2));
        assert!(sim.lb.servers().iter().all(|s| s.state == State::Failed), "round {round}");
        assert_eq!(sim.lb.selection().servers.len(), 2, "round {round}: still selectable");
    }
}

#[test]
fn behaviour_8_readiness_is_per_endpoint_never_per_host() {
    // MetalLB 474: two endpoints on one address; one not ready.
    let ready = SocketAddr::from(([127, 0, 0, 1], 1001));
    let not_ready = SocketAddr::from(([127, 0, 0, 1], 1002));
    let mut sim = Sim::failover(&[not_ready, ready]);
    sim.pass(not_ready);
    sim.pass(ready);
    sim.effects = sim.lb.set_readiness(not_ready, Readiness::Terminating, sim.now);
    assert_eq!(sim.target(), Some(ready));
    assert_eq!(sim.state(ready), State::Active);
    assert_eq!(sim.lb.server(ready).unwrap().readiness, Readiness::Ready);
    assert_eq!(
        sim.closed(),
        Vec::<SocketAddr>::new(),
        "terminating endpoints keep their connections"
    );
}

#[test]
fn behaviour_8_serving_endpoints_are_a_fallback_before_terminating_ones() {
    let mut sim = Sim::failover(&[a(1), a(2), a(3)]);
    for n in 1..=3 {
        sim.pass(a(n));
    }
    sim.effects = sim.lb.set_readiness(a(1), Readiness::Terminating, sim.now);
    sim.effects = sim.lb.set_readiness(a(2), Readiness::Serving, sim.now);
    sim.fail(a(3));
    assert_eq!(sim.lb.selection().servers, [a(2), a(1), a(3)]);
}

#[test]
fn behaviour_9_an_unknown_result_changes_nothing() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    let before = sim.lb.servers().to_vec();
    let effects = sim.lb.on_health(a(1), Health::Unknown, sim.now);
    assert!(effects.is_empty());
    assert_eq!(sim.lb.servers(), &before[..]);
}

#[test]
fn unchanged_server_set_is_a_no_op() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    assert!(sim.set(&[a(1), a(2)], None).is_empty());
}

#[test]
fn spread_uses_the_whole_best_class_with_failover_behind_it() {
    let mut sim = Sim::new(Policy::Spread, CHECKS, &[a(1), a(2), a(3)], None);
    assert_eq!(sim.lb.selection().spread, 3, "all unchecked: one class");
    sim.pass(a(2));
    sim.pass(a(3));
    let selection = sim.lb.selection();
    assert_eq!(selection.spread, 2);
    assert_eq!(&selection.servers[2..], [a(1)]);
    assert!(
        sim.lb.servers().iter().all(|s| s.state != State::Active),
        "spread elects no active server"
    );
}

#[test]
fn passive_only_uses_kernel_reports_as_health() {
    let checks = Checks { rise: 1, fall: 1, passive_only: true };
    let mut sim = Sim::new(Policy::Failover, checks, &[a(1), a(2)], None);
    assert_eq!(sim.state(a(1)), State::Active);
    sim.kernel(a(1), KernelReport::ConnectFailed);
    assert_eq!(sim.target(), Some(a(2)), "fall = 1: one report is enough");
    sim.kernel(a(1), KernelReport::Established);
    assert_eq!(sim.state(a(1)), State::Preferred);
}

/// Reports from the external path are shaped by packets from the network:
/// with checks they ask for one (which decides); without, they never fail
/// a server, however many come (the kernel's hold-down alone steers new
/// flows away meanwhile).
#[test]
fn reports_from_the_external_path_fail_no_server_by_themselves() {
    let mut sim = Sim::failover(&[a(1), a(2)]);
    sim.pass(a(1));
    sim.pass(a(2));
    assert_eq!(
        sim.kernel(a(1), KernelReport::ExternalFailure),
        [Effect::CheckNow { server: a(1) }]
    );
    for _ in 0..100 {
        let effects = sim.kernel(a(1), KernelReport::ExternalFailure).to_vec();
        assert!(effects.is_empty(), "already being checked: {effects:?}");
    }
    assert_eq!(sim.state(a(1)), State::Active);
    sim.pass(a(1));
    assert_eq!(sim.state(a(1)), State::Active, "the check decided: it passes");

    let checks = Checks { rise: 1, fall: 1, passive_only: true };
    let mut sim = Sim::new(Policy::Failover, checks, &[a(1), a(2)], None);
    for _ in 0..100 {
        let effects = sim.kernel(a(1), KernelReport::ExternalFailure).to_vec();
        assert!(effects.is_empty(), "{effects:?}");
    }
    assert_eq!(sim.state(a(1)), State::Active, "check = \"none\": the network failed a server");
    assert_eq!(sim.target(), Some(a(1)));
}

/// The external path's events carry the cookie no socket has: theirs
/// become `ExternalFailure`, whatever the kind of failure.
#[test]
fn an_event_of_the_external_path_is_an_external_report() {
    use lb_common::{EXTERNAL_FLOW_COOKIE, EventKind};
    assert_eq!(
        KernelReport::of(EventKind::ConnectFailed, EXTERNAL_FLOW_COOKIE),
        KernelReport::ExternalFailure
    );
    assert_eq!(
        KernelReport::of(EventKind::ConnectTimeout, EXTERNAL_FLOW_COOKIE),
        KernelReport::ExternalFailure
    );
    assert_eq!(KernelReport::of(EventKind::ConnectFailed, 7), KernelReport::ConnectFailed);
    assert_eq!(KernelReport::of(EventKind::ConnectTimeout, 7), KernelReport::ConnectTimeout);
    assert_eq!(
        KernelReport::of(EventKind::Established, EXTERNAL_FLOW_COOKIE),
        KernelReport::Established
    );
}

/// The sequence of k3s's own load balancer test (PR 11329), step by step.
#[test]
fn k3s_rework_sequence() {
    let default = a(1);
    let mut sim = Sim::new(Policy::Failover, CHECKS, &[], Some(default));
    assert_eq!(sim.target(), Some(default), "only the default: it is used");

    // A server is added and passes: it takes new connections; the default's close.
    sim.set(&[a(2)], Some(default));
    sim.pass(a(2));
    assert_eq!(sim.state(a(2)), State::Active);
    assert_eq!(sim.target(), Some(a(2)));
    assert!(sim.closed().contains(&default));

    // Its check fails: its connections close, new ones go to the (healthy) default.
    sim.pass(default);
    sim.fail(a(2));
    assert_eq!(sim.closed(), [a(2)]);
    assert_eq!(sim.target(), Some(default));

    // The list is replaced; the new server passes; fail-back closes the default's.
    sim.set(&[a(3)], Some(default));
    assert!(sim.closed().contains(&a(2)));
    sim.pass(a(3));
    assert_eq!(sim.target(), Some(a(3)));
    assert!(sim.closed().contains(&default));

    // The default is added as a real server.
    sim.set(&[a(3), default], Some(default));
    assert_eq!(sim.state(default), State::Unchecked);
    sim.pass(default);
    assert_eq!(sim.state(default), State::Preferred);
    assert_eq!(sim.target(), Some(a(3)), "no flapping to the default");

    // The default is removed from the list: it stays as the last resort.
    sim.set(&[a(3)], Some(default));
    assert_eq!(sim.state(default), State::Standby);
    assert_eq!(sim.lb.selection().servers, [a(3), default]);

    // Set-default to another server: the old default goes, the new one stands by.
    sim.set(&[a(3)], Some(a(4)));
    assert_eq!(sim.state(default), State::Invalid);
    assert_eq!(sim.state(a(4)), State::Standby);
    assert_eq!(sim.lb.selection().servers, [a(3), a(4)]);
}

#[derive(Clone, Debug)]
enum Op {
    Pass(u8),
    Fail(u8),
    Unknown(u8),
    Refused(u8),
    Established(u8),
    Readiness(u8, u8),
    SetServers(Vec<u8>, Option<u8>),
    Tick(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1..6u8).prop_map(Op::Pass),
        (1..6u8).prop_map(Op::Fail),
        (1..6u8).prop_map(Op::Unknown),
        (1..6u8).prop_map(Op::Refused),
        (1..6u8).prop_map(Op::Established),
        (1..6u8, 0..3u8).prop_map(|(s, r)| Op::Readiness(s, r)),
        (proptest::collection::vec(1..6u8, 0..5), proptest::option::of(1..6u8))
            .prop_map(|(l, d)| Op::SetServers(l, d)),
        (0..120u16).prop_map(Op::Tick),
    ]
}

proptest! {
    #[test]
    fn invariants_hold_under_any_sequence(
        spread in any::<bool>(),
        rise in 1..3u32,
        fall in 1..3u32,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let policy = if spread { Policy::Spread } else { Policy::Failover };
        let checks = Checks { rise, fall, passive_only: false };
        let mut now = Instant::now();
        let (mut lb, _) = Balancer::new(policy, checks, &[a(1), a(2)], Some(a(1)), now);
        let mut allowed: Vec<SocketAddr> = vec![a(1), a(2)];
        for op in ops {
            let active_before = lb.servers().iter().find(|s| s.state == State::Active).map(|s| s.addr);
            let effects = match &op {
                Op::Pass(n) => lb.on_health(a(*n), Health::Pass, now),
                Op::Fail(n) => lb.on_health(a(*n), Health::Fail("x".into()), now),
                Op::Unknown(n) => lb.on_health(a(*n), Health::Unknown, now),
                Op::Refused(n) => lb.on_kernel_report(a(*n), KernelReport::ConnectFailed, now),
                Op::Established(n) => lb.on_kernel_report(a(*n), KernelReport::Established, now),
                Op::Readiness(n, r) => {
                    let r = [Readiness::Terminating, Readiness::Serving, Readiness::Ready][*r as usize];
                    lb.set_readiness(a(*n), r, now)
                }
                Op::SetServers(list, default) => {
                    let list: Vec<SocketAddr> = list.iter().map(|n| a(*n)).collect();
                    let default = default.map(a);
                    allowed = list.clone();
                    allowed.extend(default);
                    lb.set_servers(&list, default, now)
                }
                Op::Tick(secs) => {
                    now += Duration::from_secs(u64::from(*secs));
                    lb.on_tick(now)
                }
            };
            let selection = lb.selection();
            // Never select a server that is not in the list or the default.
            for s in &selection.servers {
                prop_assert!(allowed.contains(s), "{s} selected after {op:?}; allowed {allowed:?}");
            }
            // Never select nothing while any server exists.
            prop_assert_eq!(selection.servers.is_empty(), lb.servers().is_empty());
            prop_assert!(selection.spread >= 1 && (selection.servers.is_empty() || selection.spread <= selection.servers.len()));
            // No invalid server is kept.
            prop_assert!(lb.servers().iter().all(|s| s.state != State::Invalid));
            // At most one active server; in failover exactly one when any is healthy and ready.
            let active = lb.servers().iter().filter(|s| s.state == State::Active).count();
            prop_assert!(active <= 1);
            if policy == Policy::Spread {
                prop_assert_eq!(active, 0);
            } else if lb.servers().iter().any(Server::in_healthy_class) && lb.elected_once {
                prop_assert_eq!(active, 1);
            }
            // A healthy active server is never replaced by an equally ranked one.
            if let Some(before) = active_before
                && let Some(s) = lb.server(before)
                    && s.in_healthy_class() {
                        prop_assert_eq!(s.state, State::Active, "active {} replaced after {:?}", before, op);
                    }
            // The selection written is the one in effect; writing is idempotent.
            if let Some(written) = written(&effects) {
                prop_assert_eq!(written, &selection);
            }
            // Ticks before the next deadline have nothing to do (the daemon
            // sleeps until it instead of ticking every service).
            if lb.next_deadline().is_none_or(|deadline| now < deadline) {
                prop_assert_eq!(lb.clone().on_tick(now), Vec::new(), "a tick before the deadline {:?} acted", lb.next_deadline());
            }
            let _ = lb.on_tick(now);
            prop_assert_eq!(lb.on_tick(now), Vec::new(), "a repeated input had effects again");
            // A tick spends every deadline it was due for: none stays in
            // the past (the owner loop would wake at once, for ever).
            prop_assert!(lb.next_deadline().is_none_or(|deadline| deadline > now), "deadline {:?} still due after a tick", lb.next_deadline());
        }
    }
}
