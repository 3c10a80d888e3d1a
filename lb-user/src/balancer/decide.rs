//! Decisions of one balancer step as functions over the servers: who wins
//! an election among servers in the healthy class, whether the first
//! election must still wait, and whose connections to close. The machine
//! (`machine.rs`) applies what these say.

use std::{net::SocketAddr, time::Instant};

use super::types::{CloseReason, Effect, Readiness, Server, State};

/// Who wins an election among servers of the same state: after an
/// adoption the server the kernel used first (`adopted_first`), then the
/// default, then the configured order.
pub(super) fn election_rank(
    servers: &[Server],
    adopted_first: Option<SocketAddr>,
    i: usize,
) -> (bool, bool, std::cmp::Reverse<usize>) {
    let server = &servers[i];
    (adopted_first == Some(server.addr), server.is_default, std::cmp::Reverse(i))
}

/// The server of the healthy class an election picks: the best state,
/// then [`election_rank`].
pub(super) fn elected(servers: &[Server], adopted_first: Option<SocketAddr>) -> Option<usize> {
    servers
        .iter()
        .enumerate()
        .filter(|(_, s)| s.in_healthy_class())
        .max_by_key(|(i, s)| (s.state, election_rank(servers, adopted_first, *i)))
        .map(|(i, _)| i)
}

/// Whether the first election must still wait for server `candidate`'s
/// betters: a ready listed server that ranks above it and has no result
/// yet (unchecked, or recovering towards its first pass).
pub(super) fn first_election_pending(
    servers: &[Server],
    adopted_first: Option<SocketAddr>,
    candidate: usize,
) -> bool {
    let rank = election_rank(servers, adopted_first, candidate);
    servers.iter().enumerate().any(|(i, s)| {
        s.in_list
            && s.readiness == Readiness::Ready
            && matches!(s.state, State::Unchecked | State::Recovering)
            && election_rank(servers, adopted_first, i) > rank
    })
}

/// Whether connections moved off `addr` have somewhere better to go: a
/// server of the healthy class, or a ready standby default whose checks
/// pass (or that has no checks: `passive_only`).
pub(super) fn has_alternative_to(servers: &[Server], passive_only: bool, addr: SocketAddr) -> bool {
    servers.iter().any(|s| {
        s.addr != addr
            && (s.in_healthy_class()
                || (s.state == State::Standby
                    && s.readiness == Readiness::Ready
                    && (s.healthy == Some(true) || passive_only)))
    })
}

/// The closes a step calls for, added to `effects`: each `demoted` server
/// that left the healthy class when there is an alternative; and, when the
/// healthy class goes from empty (`healthy_before` false) to non-empty,
/// every standby, failed or recovering server not already closed
/// (fail-back).
pub(super) fn closes(
    servers: &[Server],
    passive_only: bool,
    demoted: &[SocketAddr],
    healthy_before: bool,
    effects: &mut Vec<Effect>,
) {
    for &addr in demoted {
        let left = servers.iter().find(|s| s.addr == addr).is_some_and(|s| !s.in_healthy_class());
        if left && has_alternative_to(servers, passive_only, addr) {
            effects.push(Effect::CloseConnections { server: addr, reason: CloseReason::Failed });
        }
    }
    if healthy_before || !servers.iter().any(Server::in_healthy_class) {
        return;
    }
    for s in servers {
        let closed = effects
            .iter()
            .any(|e| matches!(e, Effect::CloseConnections { server, .. } if *server == s.addr));
        if matches!(s.state, State::Standby | State::Failed | State::Recovering) && !closed {
            effects
                .push(Effect::CloseConnections { server: s.addr, reason: CloseReason::FailBack });
        }
    }
}

/// Whether an adopted selection held until `until` may be written now:
/// every listed server has a first result, something is being closed, or
/// the hold ran out.
pub(super) fn hold_over(
    servers: &[Server],
    effects: &[Effect],
    until: Instant,
    now: Instant,
) -> bool {
    let informed = servers.iter().all(|s| !s.in_list || s.state != State::Unchecked);
    let closing = effects.iter().any(|e| matches!(e, Effect::CloseConnections { .. }));
    informed || closing || now >= until
}
