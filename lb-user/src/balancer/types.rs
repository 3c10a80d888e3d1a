//! The vocabulary of a service's balancer (`machine.rs`): server states
//! and readiness, what a check or the kernel says, why connections are
//! closed, the selection the kernel gets, and the effects the daemon
//! carries out. Plain data.

use std::{fmt, net::SocketAddr, time::Instant};

use crate::config::Policy;

/// Server states, in increasing order of preference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// See the module's table for what each means.
pub enum State {
    /// Removed (seen only in logs).
    Invalid,
    /// Failed its checks, or a confirmed failed connect.
    Failed,
    /// The default server outside the server list: a last resort.
    Standby,
    /// Just added, no check result yet.
    Unchecked,
    /// Passing again since it failed, not yet `rise` in a row.
    Recovering,
    /// Passes its checks.
    Healthy,
    /// Recently back or new: first choice in an election.
    Preferred,
    /// Failover: the one server new connections go to.
    Active,
}

impl State {
    /// The name in status, logs and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Invalid => "invalid",
            Self::Failed => "failed",
            Self::Standby => "standby",
            Self::Unchecked => "unchecked",
            Self::Recovering => "recovering",
            Self::Healthy => "healthy",
            Self::Preferred => "preferred",
            Self::Active => "active",
        }
    }

    /// The encoding kept in the kernel (`Service::daemon_states`); 0 is
    /// "unknown".
    pub const fn code(self) -> u8 {
        match self {
            Self::Invalid => 0,
            Self::Failed => lb_common::DAEMON_STATE_FAILED,
            Self::Standby => 2,
            Self::Unchecked => 3,
            Self::Recovering => 4,
            Self::Healthy => 5,
            Self::Preferred => 6,
            Self::Active => 7,
        }
    }

    /// The state a [`Self::code`] names, if any.
    pub const fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            lb_common::DAEMON_STATE_FAILED => Self::Failed,
            2 => Self::Standby,
            3 => Self::Unchecked,
            4 => Self::Recovering,
            5 => Self::Healthy,
            6 => Self::Preferred,
            7 => Self::Active,
            _ => return None,
        })
    }

    const fn is_healthy_class(self) -> bool {
        matches!(self, Self::Active | Self::Preferred | Self::Healthy)
    }

    /// States that share a spread group: the healthy class is one group.
    const fn group(self) -> u8 {
        match self {
            Self::Active | Self::Preferred | Self::Healthy => 3,
            Self::Recovering => 2,
            Self::Unchecked => 1,
            Self::Standby | Self::Failed | Self::Invalid => 0,
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Readiness an endpoint declares (as Kubernetes EndpointSlice conditions
/// say), judged per endpoint address, never per host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Readiness {
    /// Not serving (terminating and not serving): last resort.
    Terminating,
    /// Not ready but still serving (terminating gracefully): used only
    /// when no ready endpoint is usable.
    Serving,
    /// Ready: the normal case.
    #[default]
    Ready,
}

/// A health check result. Unknown (the check could not run) changes nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// The check passed.
    Pass,
    /// The check failed, and why.
    Fail(String),
    /// The check could not run: it changes nothing.
    Unknown,
}

/// What the kernel reported about a connect through the VIP (its
/// `lb_common::EventKind`, decoded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelReport {
    /// A connect to a server with a failure mark established: it answers again.
    Established,
    /// Refused or reset before establishing.
    ConnectFailed,
    /// The SYN went unanswered for a retransmission timeout.
    ConnectTimeout,
    /// A flow of the external path was refused, or its client's SYN came
    /// again unanswered. Packets from the network shape this (a client
    /// decides when to send its SYN again): only ever grounds for a check,
    /// never a failure by itself.
    ExternalFailure,
}

impl KernelReport {
    /// The report of an event of `kind` about a connection whose socket
    /// cookie is `cookie` (`lb_common::EXTERNAL_FLOW_COOKIE` for a flow of
    /// the external path).
    pub fn of(kind: lb_common::EventKind, cookie: u64) -> Self {
        match kind {
            lb_common::EventKind::Established => Self::Established,
            _ if cookie == lb_common::EXTERNAL_FLOW_COOKIE => Self::ExternalFailure,
            lb_common::EventKind::ConnectFailed => Self::ConnectFailed,
            lb_common::EventKind::ConnectTimeout => Self::ConnectTimeout,
        }
    }
}

/// Why a server's connections are closed. The discriminants are the
/// positions in [`CloseReason::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// The server failed and there is somewhere better to go.
    Failed = 0,
    /// A server came back to the healthy class: off the last resorts.
    FailBack = 1,
    /// The server left the service.
    Removed = 2,
    /// `lb close-connections` asked (never a balancer's effect).
    Manual = 3,
}

impl CloseReason {
    /// Every reason, in the order metrics list them.
    pub const ALL: [Self; 4] = [Self::Failed, Self::FailBack, Self::Removed, Self::Manual];

    /// The name in logs and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Removed => "removed",
            Self::Failed => "failed",
            Self::FailBack => "fail_back",
            Self::Manual => "manual",
        }
    }
}

/// What the kernel should get for this service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// Every server, best first.
    pub servers: Vec<SocketAddr>,
    /// The kernel picks at random among the usable servers of the first
    /// `spread` entries (1: strict order).
    pub spread: usize,
}

impl Selection {
    /// Every server of `servers`, ordered by tier (healthy class,
    /// recovering, unchecked; within each, declared ready before
    /// drained/serving; then the last resorts: standby, failed,
    /// terminating), then state, then configured order. The kernel takes
    /// the first that has not failed within the hold-down, so it never
    /// black-holes while a server exists. With `spread`, it picks at
    /// random within the leading group of equally good servers.
    pub fn of(servers: &[Server], policy: Policy) -> Self {
        let mut order: Vec<(usize, &Server)> = servers.iter().enumerate().collect();
        order.sort_by_key(|(i, s)| (std::cmp::Reverse((s.tier(), s.state)), *i));
        let spread = match (policy, order.first()) {
            (Policy::Spread, Some((_, best))) => {
                order.iter().take_while(|(_, s)| s.tier() == best.tier()).count()
            }
            _ => 1,
        };
        Self { servers: order.into_iter().map(|(_, s)| s.addr).collect(), spread }
    }
}

/// What the kernel holds for a service, as one value: the selection and,
/// beside it, the state of each selected server ([`State::code`], in the
/// selection's order), which a restarted daemon starts from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelValue {
    /// The servers, best first, and the spread.
    pub selection: Selection,
    /// The state code of each server of `selection`.
    pub states: Vec<u8>,
}

/// What the daemon must do after an input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Write this value to the kernel, one whole-value update (emitted
    /// only when it changed).
    WriteSelection {
        /// The service's whole kernel value.
        value: KernelValue,
        /// The selection itself changed (not only the states beside it):
        /// connects go elsewhere from now on.
        reordered: bool,
    },
    /// Reset the connections made through the VIP to `server`.
    CloseConnections {
        /// Whose connections.
        server: SocketAddr,
        /// Why, for logs and metrics.
        reason: CloseReason,
    },
    /// A server changed state (for logs and metrics).
    StateChanged {
        /// Which server.
        server: SocketAddr,
        /// Its state before.
        from: State,
        /// Its state now.
        to: State,
        /// What made it change, in a few words.
        why: &'static str,
    },
    /// Check `server` now, out of turn: the kernel reported a failed
    /// connect and the result confirms or clears it.
    CheckNow {
        /// Which server.
        server: SocketAddr,
    },
}

impl Effect {
    /// Where the effect goes among one step's, in the order they are
    /// carried out: the new selection must be in the kernel before
    /// connections are closed, so that a client that reconnects at once
    /// does not land on the server it was just moved off.
    pub fn order(&self) -> u8 {
        match self {
            Self::StateChanged { .. } => 0,
            Self::WriteSelection { .. } => 1,
            Self::CloseConnections { .. } => 2,
            Self::CheckNow { .. } => 3,
        }
    }
}

/// Health check settings the state machine needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checks {
    /// Passes in a row that make a server usable again.
    pub rise: u32,
    /// Failures in a row that make a server failed.
    pub fall: u32,
    /// No active checks (`check = "none"`): the kernel's connection reports
    /// are the only health signal.
    pub passive_only: bool,
}

/// One server as the state machine knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Server {
    /// Where its connections go.
    pub addr: SocketAddr,
    /// See [`State`].
    pub state: State,
    /// In the server list (false: the default kept as `standby`).
    pub in_list: bool,
    /// The service's default (preferred while healthy).
    pub is_default: bool,
    /// What the endpoint declares (discovery); `Ready` otherwise.
    pub readiness: Readiness,
    /// Last check result: `None` until one is known.
    pub healthy: Option<bool>,
    /// Error of the last failed check.
    pub last_error: Option<String>,
    /// When `state` was entered.
    pub since: Instant,
    /// The kernel reported a failed connect that no check has confirmed or
    /// cleared yet.
    pub suspect: bool,
    pub(super) passes: u32,
    pub(super) failures: u32,
}

impl Server {
    pub(super) fn new(addr: SocketAddr, state: State, in_list: bool, now: Instant) -> Self {
        Self {
            addr,
            state,
            in_list,
            is_default: false,
            readiness: Readiness::Ready,
            healthy: None,
            last_error: None,
            since: now,
            suspect: false,
            passes: 0,
            failures: 0,
        }
    }

    /// How good a choice this server is, before its exact state: the
    /// healthy class first, then recovering, then unchecked, each ready
    /// before drained (serving); last resorts (standby, failed,
    /// terminating) last. Servers of one tier form one spread group.
    pub(super) const fn tier(&self) -> u8 {
        let group = self.state.group();
        match self.readiness {
            _ if group == 0 => 0,
            Readiness::Terminating => 0,
            Readiness::Serving => 2 * group - 1,
            Readiness::Ready => 2 * group,
        }
    }

    pub(super) fn in_healthy_class(&self) -> bool {
        self.readiness == Readiness::Ready && self.state.is_healthy_class()
    }
}
