//! The server state machine of one service: which servers are usable, in
//! what order the kernel should try them, and which connections must move.
//!
//! Sans-I/O: a `Balancer` is a plain value. Every input is a method that
//! takes `now` and returns the effects for the daemon to carry out (write
//! the selection, close a server's connections, log a state change). Tests
//! drive it with simulated time.
//!
//! # States, best first
//!
//! | state        | meaning |
//! |--------------|---------|
//! | `active`     | failover: the one server new connections go to |
//! | `preferred`  | recently passed its checks after being down or new; first choice when an active server must be elected |
//! | `healthy`    | passes its checks |
//! | `recovering` | passed at least one check (or accepted a connection) since it failed, not yet `rise` in a row |
//! | `unchecked`  | just added, no check result yet |
//! | `standby`    | the default server when it is not in the server list: a last resort, never marked failed |
//! | `failed`     | failed `fall` checks in a row, or a connect through the VIP to it failed and that was confirmed |
//! | `invalid`    | removed (only ever seen in logs: removed servers are forgotten) |
//!
//! # Transitions
//!
//! | from \ input                    | check passes (`rise` in a row) | check fails (`fall` in a row, or once after a kernel report) | connect via VIP fails (kernel report) | connection via VIP established |
//! |---------------------------------|-------------------------------|-------------------------------|-----------------------|-------------------------------|
//! | unchecked                       | preferred (recovering before `rise`) | failed                 | - (suspect: check now) | -                            |
//! | recovering                      | preferred                     | failed                        | - (suspect: check now) | -                            |
//! | failed                          | preferred (recovering before `rise`) | -                      | - (hold-down renewed in the kernel) | recovering      |
//! | preferred, healthy, active      | -                             | failed                        | - (suspect: check now) | -                            |
//! | standby                         | -                             | -                             | -                     | -                             |
//!
//! A kernel report of a failed connect (refused, reset, SYN timeout) is
//! ambiguous: one lost SYN, or a client's own slow path, looks the same.
//! The kernel already steers the next connects away for the hold-down; the
//! balancer only makes the server *suspect* and asks for an immediate check
//! ([`Effect::CheckNow`]). The first failing check after that confirms it
//! (whatever `fall` says); a passing one clears it. So one report never
//! resets a healthy server's connections. With `check = "none"` there is no
//! check to ask: `fall` reports in a row (with no established connection
//! between them) confirm instead.
//!
//! Also: `preferred` becomes `healthy` after [`PREFERRED_FOR`] without being
//! elected. An unknown check result changes nothing. With `check = "none"`,
//! new servers start `healthy` and an established connection counts as a
//! passed check.
//!
//! # Selection and closing connections
//!
//! The selection written to the kernel is every server, best first
//! ([`Selection::of`]): failed servers are a last resort, not excluded.
//!
//! The *healthy class* is the ready servers in `active`, `preferred` or
//! `healthy`. With `failover`, when no server is `active`, the best of the
//! healthy class is elected (best state, then the default, then configured
//! order); an active server stays active while it is healthy (no flapping
//! back). The first election of a service waits (at most
//! [`FIRST_ELECTION_WAIT`]) for the servers that would win it and have no
//! result yet, so that with every server healthy the default, then the
//! first configured server, is active after every start, whichever check
//! happened to answer first. Connections are closed:
//! - of a removed server, always;
//! - of a server that leaves the healthy class by failing, when there is
//!   somewhere better to go (a server in the healthy class, or a standby
//!   default whose checks pass);
//! - of every `standby`, `failed` or `recovering` server when the healthy
//!   class goes from empty to non-empty (fail-back, e.g. off the default).

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use super::{
    decide, membership,
    types::{
        Checks, Effect, Health, KernelReport, KernelValue, Readiness, Selection, Server, State,
    },
};
use crate::config::Policy;

/// How long a server stays `preferred` before it is merely `healthy`.
pub const PREFERRED_FOR: Duration = Duration::from_secs(60);

/// The longest the first election waits for better-ranked servers' first
/// results (their checks normally answer within one timeout).
pub const FIRST_ELECTION_WAIT: Duration = Duration::from_secs(10);

/// The state machine of one service's servers; see the module.
#[derive(Clone, Debug)]
pub struct Balancer {
    policy: Policy,
    checks: Checks,
    /// List servers in configured order, then the standby default if any.
    servers: Vec<Server>,
    /// What the kernel holds for this service, as far as the balancer knows.
    written: Option<KernelValue>,
    /// When the balancer was made, and whether an active server was ever
    /// elected: the first election waits for better-ranked first results.
    created: Instant,
    elected_once: bool,
    /// The first election's wait ([`FIRST_ELECTION_WAIT`]) is over, with or
    /// without an election: no deadline for it any more.
    first_wait_over: bool,
    /// After adopting a running datapath: the kernel's selection stays
    /// (no write) until every listed server has a first result, something
    /// must be closed, or this deadline passes.
    hold_writes_until: Option<Instant>,
    /// After adopting: the server the kernel sent connections to first; it
    /// wins the first election among equals (no needless move).
    adopted_first: Option<SocketAddr>,
}

impl Balancer {
    /// A service with `servers` (and `default`), all unchecked. The effects
    /// include the first selection.
    pub fn new(
        policy: Policy,
        checks: Checks,
        servers: &[SocketAddr],
        default: Option<SocketAddr>,
        now: Instant,
    ) -> (Self, Vec<Effect>) {
        let mut balancer = Self {
            policy,
            checks,
            servers: Vec::new(),
            written: None,
            created: now,
            elected_once: false,
            first_wait_over: false,
            hold_writes_until: None,
            adopted_first: None,
        };
        let effects = balancer.set_servers(servers, default, now);
        (balancer, effects)
    }

    /// The list servers in configured order, then the standby default.
    pub fn servers(&self) -> &[Server] {
        &self.servers
    }

    /// The server at `addr`, if the service has it.
    pub fn server(&self, addr: SocketAddr) -> Option<&Server> {
        self.servers.iter().find(|s| s.addr == addr)
    }

    /// `failover` or `spread`.
    pub const fn policy(&self) -> Policy {
        self.policy
    }

    /// The list servers (as last set) and the default: what a state file keeps.
    pub fn list(&self) -> (Vec<SocketAddr>, Option<SocketAddr>) {
        let list = self.servers.iter().filter(|s| s.in_list).map(|s| s.addr).collect();
        (list, self.servers.iter().find(|s| s.is_default).map(|s| s.addr))
    }

    /// A reload changed the policy or the check settings.
    pub fn set_policy(&mut self, policy: Policy, checks: Checks, now: Instant) -> Vec<Effect> {
        let mut step = Step::begin(self);
        self.policy = policy;
        self.checks = checks;
        if policy == Policy::Spread {
            for i in 0..self.servers.len() {
                if self.servers[i].state == State::Active {
                    self.transition(i, State::Healthy, "policy is spread", now, &mut step.effects);
                }
            }
        }
        self.settle(step, now)
    }

    /// Replaces the server list and the default. An unchanged set is a
    /// no-op; servers that stay keep their state and readiness.
    pub fn set_servers(
        &mut self,
        list: &[SocketAddr],
        default: Option<SocketAddr>,
        now: Instant,
    ) -> Vec<Effect> {
        let mut step = Step::begin(self);
        self.replace_servers(list, default, now, &mut step);
        self.settle(step, now)
    }

    /// A discovered list: the servers with the readiness their source
    /// declares for each (per endpoint address), in one step, so that the
    /// kernel sees one new selection.
    pub fn set_endpoints(
        &mut self,
        list: &[(SocketAddr, Readiness)],
        default: Option<SocketAddr>,
        now: Instant,
    ) -> Vec<Effect> {
        let mut step = Step::begin(self);
        let addrs: Vec<SocketAddr> = list.iter().map(|(addr, _)| *addr).collect();
        self.replace_servers(&addrs, default, now, &mut step);
        for &(addr, readiness) in list {
            if let Some(i) = self.index(addr) {
                self.servers[i].readiness = readiness;
            }
        }
        self.settle(step, now)
    }

    fn replace_servers(
        &mut self,
        list: &[SocketAddr],
        default: Option<SocketAddr>,
        now: Instant,
        step: &mut Step,
    ) {
        let first = if self.checks.passive_only { State::Healthy } else { State::Unchecked };
        let servers = std::mem::take(&mut self.servers);
        self.servers = membership::replaced(
            servers,
            list,
            default,
            first,
            now,
            &mut step.effects,
            &mut step.demoted,
        );
    }

    /// A health check result for `addr`.
    pub fn on_health(&mut self, addr: SocketAddr, health: Health, now: Instant) -> Vec<Effect> {
        let Some(i) = self.index(addr) else { return Vec::new() };
        let mut step = Step::begin(self);
        match health {
            Health::Unknown => return Vec::new(),
            Health::Pass => {
                let server = &mut self.servers[i];
                server.healthy = Some(true);
                server.last_error = None;
                server.suspect = false;
                server.failures = 0;
                server.passes = server.passes.saturating_add(1);
                self.on_pass(i, "passed health checks", now, &mut step.effects);
            }
            Health::Fail(error) => {
                let server = &mut self.servers[i];
                server.healthy = Some(false);
                server.last_error = Some(error);
                server.passes = 0;
                server.failures = server.failures.saturating_add(1);
                let confirmed = std::mem::take(&mut server.suspect);
                if confirmed {
                    self.fail(
                        i,
                        "a check confirmed the kernel's report of a failed connect",
                        now,
                        &mut step,
                    );
                } else if server.failures >= self.checks.fall {
                    self.fail(i, "failed health checks", now, &mut step);
                }
            }
        }
        self.settle(step, now)
    }

    /// A report from the kernel about a connect through the VIP to `addr`.
    pub fn on_kernel_report(
        &mut self,
        addr: SocketAddr,
        report: KernelReport,
        now: Instant,
    ) -> Vec<Effect> {
        let Some(i) = self.index(addr) else { return Vec::new() };
        let mut step = Step::begin(self);
        match report {
            // The kernel reports only the first establishment after failures
            // (see `EventKind::Established`): with no check, that is the
            // server passing, whatever `rise` (the config allows only 1).
            KernelReport::Established if self.checks.passive_only => {
                let server = &mut self.servers[i];
                server.failures = 0;
                server.passes = server.passes.saturating_add(1).max(self.checks.rise);
                self.on_pass(i, "a connection through the VIP established", now, &mut step.effects);
            }
            KernelReport::Established => {
                if self.servers[i].state == State::Failed {
                    self.transition(
                        i,
                        State::Recovering,
                        "a connection through the VIP established",
                        now,
                        &mut step.effects,
                    );
                }
            }
            KernelReport::ExternalFailure => {
                // With checks, a check decides; without, the kernel's
                // hold-down alone steers new flows away for a while.
                let server = &mut self.servers[i];
                if !self.checks.passive_only
                    && !server.suspect
                    && !matches!(server.state, State::Failed | State::Standby)
                {
                    server.suspect = true;
                    step.effects.push(Effect::CheckNow { server: addr });
                }
            }
            KernelReport::ConnectFailed | KernelReport::ConnectTimeout => {
                let why = if report == KernelReport::ConnectFailed {
                    "connects through the VIP failed (confirmed by `fall` reports in a row)"
                } else {
                    "connects through the VIP timed out (confirmed by `fall` reports in a row)"
                };
                let fall = self.checks.fall;
                let server = &mut self.servers[i];
                server.passes = 0;
                if matches!(server.state, State::Failed | State::Standby) {
                    // Nothing to confirm: already out, or never failed.
                } else if self.checks.passive_only {
                    server.failures = server.failures.saturating_add(1);
                    if server.failures >= fall {
                        self.fail(i, why, now, &mut step);
                    }
                } else if !server.suspect {
                    server.suspect = true;
                    step.effects.push(Effect::CheckNow { server: addr });
                }
            }
        }
        self.settle(step, now)
    }

    /// The readiness `addr` declares (only that endpoint, never its host).
    pub fn set_readiness(
        &mut self,
        addr: SocketAddr,
        readiness: Readiness,
        now: Instant,
    ) -> Vec<Effect> {
        let Some(i) = self.index(addr) else { return Vec::new() };
        let step = Step::begin(self);
        self.servers[i].readiness = readiness;
        self.settle(step, now)
    }

    /// Time passing: `preferred` servers age into `healthy`, the first
    /// election stops waiting for better-ranked servers' first results, an
    /// adopted selection stops being held (see [`Self::next_deadline`]).
    pub fn on_tick(&mut self, now: Instant) -> Vec<Effect> {
        let mut step = Step::begin(self);
        for i in 0..self.servers.len() {
            let server = &self.servers[i];
            if server.state == State::Preferred
                && now.saturating_duration_since(server.since) >= PREFERRED_FOR
            {
                self.transition(i, State::Healthy, "preferred long enough", now, &mut step.effects);
            }
        }
        self.settle(step, now)
    }

    /// Adopting a running datapath: the kernel already holds `selection`
    /// for this service, with the previous daemon's `states` of its
    /// servers ([`State::code`]) and the failures it learned itself.
    ///
    /// Servers the previous daemon had failed start failed. The selection
    /// stays, unwritten, until every listed server has a first result of
    /// this daemon's own (or something must be closed, or
    /// [`FIRST_ELECTION_WAIT`] passes), instead of being overwritten at
    /// once by a fresh, all-unchecked order that would put a server that
    /// is down back in front. The previous active server (else the
    /// kernel's first) wins the first election among equals. Servers in
    /// `failed_recently` (the kernel's failure marks) are suspect and
    /// checked at once; with `check = "none"`, which has no check to ask,
    /// they start failed.
    pub fn adopt(
        &mut self,
        selection: Selection,
        states: &[u8],
        failed_recently: &[SocketAddr],
        now: Instant,
    ) -> Vec<Effect> {
        let previous = |addr: SocketAddr| {
            let slot = selection.servers.iter().position(|s| *s == addr)?;
            states.get(slot).copied().and_then(State::from_code)
        };
        let active =
            selection.servers.iter().copied().find(|s| previous(*s) == Some(State::Active));
        self.adopted_first = active.or_else(|| selection.servers.first().copied());
        let mut step = Step::begin(self);
        for i in 0..self.servers.len() {
            let server = &mut self.servers[i];
            if server.state == State::Standby {
                continue;
            }
            if previous(server.addr) == Some(State::Failed) {
                self.fail(
                    i,
                    "it had failed before this daemon started (kept in the kernel)",
                    now,
                    &mut step,
                );
            } else if failed_recently.contains(&server.addr) {
                if self.checks.passive_only {
                    self.fail(
                        i,
                        "the kernel marked it failed before this daemon started",
                        now,
                        &mut step,
                    );
                } else {
                    server.suspect = true;
                    step.effects.push(Effect::CheckNow { server: server.addr });
                }
            }
        }
        self.written = Some(KernelValue { selection, states: states.to_vec() });
        self.hold_writes_until = Some(now + FIRST_ELECTION_WAIT);
        self.settle(step, now)
    }

    /// The states of `servers` ([`State::code`]; 0 for one not here), to
    /// keep in the kernel beside the selection.
    pub fn state_codes(&self, servers: &[SocketAddr]) -> Vec<u8> {
        servers.iter().map(|addr| self.server(*addr).map_or(0, |s| s.state.code())).collect()
    }

    /// The kernel's value for this service as it follows from the states
    /// now: the selection and its servers' states.
    pub fn kernel_value(&self) -> KernelValue {
        let selection = self.selection();
        let states = self.state_codes(&selection.servers);
        KernelValue { selection, states }
    }

    /// The value the kernel holds for this service as far as the balancer
    /// knows: the last one it had written, or the one it adopted (which
    /// stays while it is held, unwritten).
    pub fn written(&self) -> Option<&KernelValue> {
        self.written.as_ref()
    }

    /// When [`Self::on_tick`] next has something to do, if ever: a
    /// `preferred` server ages into `healthy`, the first election stops
    /// waiting, or an adopted selection stops being held. The daemon
    /// sleeps until then instead of sweeping every service.
    pub fn next_deadline(&self) -> Option<Instant> {
        let aging = self
            .servers
            .iter()
            .filter(|s| s.state == State::Preferred)
            .map(|s| s.since + PREFERRED_FOR);
        let election =
            (!self.elected_once && !self.first_wait_over && self.policy == Policy::Failover)
                .then(|| self.created + FIRST_ELECTION_WAIT);
        aging.chain(election).chain(self.hold_writes_until).min()
    }

    /// The selection for the kernel, as it follows from the states now.
    pub fn selection(&self) -> Selection {
        Selection::of(&self.servers, self.policy)
    }

    fn index(&self, addr: SocketAddr) -> Option<usize> {
        self.servers.iter().position(|s| s.addr == addr)
    }

    fn transition(
        &mut self,
        i: usize,
        to: State,
        why: &'static str,
        now: Instant,
        effects: &mut Vec<Effect>,
    ) {
        let server = &mut self.servers[i];
        if server.state != to {
            effects.push(Effect::StateChanged { server: server.addr, from: server.state, to, why });
            server.state = to;
            server.since = now;
        }
    }

    fn on_pass(&mut self, i: usize, why: &'static str, now: Instant, effects: &mut Vec<Effect>) {
        let server = &self.servers[i];
        if matches!(server.state, State::Unchecked | State::Failed | State::Recovering) {
            let to = if server.passes >= self.checks.rise {
                State::Preferred
            } else {
                State::Recovering
            };
            self.transition(i, to, why, now, effects);
        }
    }

    /// `servers[i]` failed (its checks, or a connect through the VIP).
    fn fail(&mut self, i: usize, why: &'static str, now: Instant, step: &mut Step) {
        let server = &self.servers[i];
        // A standby default is a last resort: never marked failed.
        if server.state == State::Standby {
            return;
        }
        if server.in_healthy_class() {
            step.demoted.push(server.addr);
        }
        self.transition(i, State::Failed, why, now, &mut step.effects);
    }

    /// Elects, decides which connections to close and emits the selection.
    fn settle(&mut self, mut step: Step, now: Instant) -> Vec<Effect> {
        if now.saturating_duration_since(self.created) >= FIRST_ELECTION_WAIT {
            self.first_wait_over = true;
        }
        // An active server that is no longer ready steps down gracefully:
        // no new connections, existing ones stay.
        for i in 0..self.servers.len() {
            if self.servers[i].state == State::Active
                && self.servers[i].readiness != Readiness::Ready
            {
                self.transition(
                    i,
                    State::Healthy,
                    "no longer declared ready",
                    now,
                    &mut step.effects,
                );
            }
        }
        if self.policy == Policy::Failover && !self.servers.iter().any(|s| s.state == State::Active)
        {
            let waiting = |i| {
                !self.elected_once
                    && now.saturating_duration_since(self.created) < FIRST_ELECTION_WAIT
                    && decide::first_election_pending(&self.servers, self.adopted_first, i)
            };
            if let Some(i) = decide::elected(&self.servers, self.adopted_first)
                && !waiting(i)
            {
                self.transition(i, State::Active, "elected active", now, &mut step.effects);
                self.elected_once = true;
            }
        }

        let passive_only = self.checks.passive_only;
        decide::closes(
            &self.servers,
            passive_only,
            &step.demoted,
            step.healthy_before,
            &mut step.effects,
        );
        if let Some(until) = self.hold_writes_until
            && decide::hold_over(&self.servers, &step.effects, until, now)
        {
            self.hold_writes_until = None;
        }
        let value = self.kernel_value();
        if self.hold_writes_until.is_none() && self.written.as_ref() != Some(&value) {
            let reordered =
                self.written.as_ref().is_none_or(|written| written.selection != value.selection);
            self.written = Some(value.clone());
            step.effects.push(Effect::WriteSelection { value, reordered });
        }
        step.effects.sort_by_key(Effect::order);
        step.effects
    }
}

/// Bookkeeping of one input: what held before it, what it changed.
struct Step {
    healthy_before: bool,
    /// Servers that left the healthy class (or the list) during this input.
    demoted: Vec<SocketAddr>,
    effects: Vec<Effect>,
}

impl Step {
    fn begin(balancer: &Balancer) -> Self {
        Self {
            healthy_before: balancer.servers.iter().any(Server::in_healthy_class),
            demoted: Vec::new(),
            effects: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests;
