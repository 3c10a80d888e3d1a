//! Elections by Lease: of the nodes that can serve an external VIP, one
//! announces it. Each leased service has a task here that competes for
//! its Lease while the daemon says the node is eligible, and tells the
//! daemon where it stands (`Update`); the daemon announces the VIP only
//! while the task says this node holds the lease, with the kernel fenced
//! at the holder's deadline (`ANNOUNCE_UNTIL`), so that a node whose
//! daemon dies or cannot renew falls silent by itself.
//!
//! - `machine`: the rules, pure, tested with simulated time;
//! - `lease`: the Lease's reads and writes through kube-rs;
//! - `identity`: this node's name in the Leases, with a token of its own.
//!
//! The elections by membership (`elect = true`), one Lease per node
//! whatever the number of VIPs: `membership` (the rules, pure, with
//! `membership_sim` for their tests; `membership_peers`, what a node
//! knows of the others; `membership_record`, a Lease as they read it),
//! `placement` (rendezvous hashing), `membership_lease` (the Lease's
//! format) and `membership_task` (the task, through kube-rs, which the
//! daemon's `membership.rs` drives).
//!
//! The daemon keeps the order that makes a handover safe: it withdraws a
//! VIP from the kernel *before* it tells the task that the node is no
//! longer eligible (or stopping), and only then does the task release.
#![cfg_attr(
    not(feature = "kubernetes"),
    allow(dead_code, reason = "without Kubernetes no election runs: the config refuses a lease")
)]

pub(crate) mod identity;
#[cfg(feature = "kubernetes")]
mod lease;
pub(crate) mod machine;
pub mod membership;
#[cfg(feature = "kubernetes")]
mod membership_lease;
mod membership_peers;
mod membership_record;
pub mod membership_task;
pub mod placement;

use std::{
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};

pub(crate) use self::machine::{Role, Takeover, Timings};
use crate::config::LeaseRef;

/// Where one node stands in one election, as its task last said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Standing {
    pub role: Role,
    /// The holder as last read (`None`: released, or not read yet).
    pub holder: Option<String>,
    /// When the record last changed, by this node's reading.
    pub changed_at: Option<Instant>,
    pub last_takeover: Option<Takeover>,
    /// The last request's failure, until one succeeds.
    pub error: Option<String>,
}

/// A task's news for the daemon.
pub(crate) struct Update {
    pub service: String,
    pub standing: Standing,
}

/// How the task reaches the API server: the kubeconfig's address, or,
/// when a service discovers the apiservers themselves (`default/kubernetes`),
/// through that service's usable servers first (as its discovery does).
pub(crate) struct Reach {
    pub kubeconfig: Option<PathBuf>,
    /// The VIP of the apiservers' service, if a service discovers them.
    pub apiservers: Option<SocketAddr>,
    /// That service's configured servers.
    pub seeds: Vec<SocketAddr>,
    /// That service's usable servers, best first.
    pub usable: watch::Receiver<Vec<SocketAddr>>,
}

impl Reach {
    /// Reaches the API server with no apiservers' service: through the
    /// kubeconfig's address (`None`: the in-cluster settings).
    pub(crate) fn kubeconfig(kubeconfig: Option<PathBuf>) -> Self {
        Self {
            kubeconfig,
            apiservers: None,
            seeds: Vec::new(),
            usable: watch::channel(Vec::new()).1,
        }
    }

    /// A client of the API server, for `who` (named in the log).
    #[cfg(feature = "kubernetes")]
    pub(crate) async fn client(&self, who: &str) -> Result<kube::Client, String> {
        let rule = crate::discovery::dial::DialRule {
            vip: self.apiservers.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0))),
            apiserver_service: self.apiservers.is_some(),
        };
        crate::discovery::kubernetes::client_with(
            rule,
            self.seeds.clone(),
            self.kubeconfig.as_deref(),
            self.usable.clone(),
            who,
        )
        .await
    }
}

/// The daemon's end of one election task.
pub(crate) struct Election {
    pub lease: LeaseRef,
    /// This node's holder identity in the Lease.
    pub identity: String,
    task: JoinHandle<()>,
    /// `None`: eligible; else why not.
    eligible: watch::Sender<Option<&'static str>>,
    stop: watch::Sender<bool>,
    /// The last standing the task sent.
    pub standing: Option<Standing>,
}

impl Election {
    /// Starts competing for `lease` as `me` on behalf of `service`.
    pub(crate) fn start(
        service: String,
        lease: LeaseRef,
        me: String,
        timings: Timings,
        reach: Reach,
        updates: mpsc::Sender<Update>,
    ) -> Self {
        let (eligible, eligible_rx) = watch::channel(Some("not judged yet"));
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(run(Task {
            service,
            lease: lease.clone(),
            me: me.clone(),
            timings,
            reach,
            eligible: eligible_rx,
            stop: stop_rx,
            updates,
        }));
        Self { lease, identity: me, task, eligible, stop, standing: None }
    }

    /// Whether the node may compete: `None`, or why not. Called after the
    /// kernel has stopped announcing the VIP, when it has.
    pub(crate) fn set_eligible(&self, why_not: Option<&'static str>) {
        self.eligible.send_if_modified(|old| {
            let changed = *old != why_not;
            *old = why_not;
            changed
        });
    }

    /// The CLOCK_MONOTONIC deadline this node may answer until, if it
    /// holds the lease now.
    pub(crate) fn fence(&self, now: Instant) -> Option<Instant> {
        match self.standing.as_ref()?.role {
            Role::Holder { fence } if fence > now => Some(fence),
            _ => None,
        }
    }

    /// Ends the task without a word to the API server: a lease held stays
    /// this node's until it runs out, and the kernel's fence with it. A
    /// daemon that comes back within it renews the lease (`machine.rs`):
    /// a restart moves no VIP.
    pub(crate) fn keep(self) {
        self.task.abort();
    }

    /// Releases the lease if held and ends the task, waiting up to `wait`.
    /// Called after the kernel has stopped announcing the VIP. (Dropped
    /// instead, when its service goes, the task does the same by itself.)
    pub(crate) async fn resign(self, wait: Duration) {
        self.stop.send_replace(true);
        let mut task = self.task;
        if tokio::time::timeout(wait, &mut task).await.is_err() {
            task.abort();
        }
    }
}

struct Task {
    service: String,
    lease: LeaseRef,
    me: String,
    timings: Timings,
    reach: Reach,
    eligible: watch::Receiver<Option<&'static str>>,
    stop: watch::Receiver<bool>,
    updates: mpsc::Sender<Update>,
}

#[cfg(not(feature = "kubernetes"))]
async fn run(task: Task) {
    // `Config::parse` refuses a lease in a build without Kubernetes.
    let standing = Standing {
        role: Role::NotEligible("lb was built without the `kubernetes` feature"),
        holder: None,
        changed_at: None,
        last_takeover: None,
        error: None,
    };
    let _ = (task.lease, task.me, task.timings, task.reach, task.eligible, task.stop);
    let _ = task.updates.send(Update { service: task.service, standing }).await;
}

#[cfg(feature = "kubernetes")]
async fn run(mut task: Task) {
    use self::{
        lease::{LeaseApi, WriteError},
        machine::{Machine, Step},
    };

    let mut machine = Machine::new(task.me.clone(), task.timings);
    let mut error: Option<String> = None;
    let mut last: Option<Standing> = None;
    let client = loop {
        match task.reach.client(&task.service).await {
            Ok(client) => break client,
            Err(e) => {
                tracing::warn!(service = %task.service, lease = %task.lease, "election: {e}");
                let standing = standing_of(&machine, Some(e), Instant::now());
                if task
                    .updates
                    .send(Update { service: task.service.clone(), standing })
                    .await
                    .is_err()
                    || *task.stop.borrow()
                {
                    return;
                }
                tokio::time::sleep(task.timings.duration).await;
            }
        }
    };
    // A request may take at most half the lease: a holder that waits
    // longer for its renewal has fallen silent anyway.
    let mut api = LeaseApi::new(client, task.lease.clone(), task.timings.duration / 2);
    loop {
        let now = Instant::now();
        machine.set_eligible(*task.eligible.borrow(), now);
        // Told to stop, or dropped by the daemon (its service is gone).
        if *task.stop.borrow() || task.stop.has_changed().is_err() {
            machine.stop();
        }
        let step = machine.next(now);
        let sent = Instant::now();
        match step {
            Step::Read => match api.read().await {
                Ok(record) => {
                    machine.on_read(record, Instant::now());
                    error = None;
                }
                Err(e) => {
                    machine.on_failed(Instant::now());
                    error = Some(e);
                }
            },
            Step::Create | Step::Claim => {
                let written = if step == Step::Create {
                    api.create(&task.me, task.timings.duration).await
                } else {
                    api.claim(&task.me, task.timings.duration).await
                };
                match written {
                    Ok(record) => {
                        machine.on_claimed(record, sent, Instant::now());
                        error = None;
                    }
                    Err(WriteError::Conflict) => machine.on_conflict(),
                    Err(WriteError::Failed(e)) => {
                        machine.on_failed(Instant::now());
                        error = Some(e);
                    }
                }
            }
            Step::Release => match api.release().await {
                Ok(record) => {
                    machine.on_released(record, Instant::now());
                    tracing::info!(service = %task.service, lease = %task.lease, "released the lease");
                    error = None;
                }
                Err(WriteError::Conflict) => machine.on_conflict(),
                Err(WriteError::Failed(e)) => {
                    machine.on_failed(Instant::now());
                    error = Some(e);
                }
            },
            Step::Wait(until) => {
                if machine.is_stopping() {
                    return;
                }
                // Wake at the fence too: the role changes then.
                let fence = match machine.role(now) {
                    Role::Holder { fence } => Some(fence),
                    _ => None,
                };
                let wake = match (until, fence) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                tokio::select! {
                    () = sleep_until(wake) => {}
                    Ok(()) = task.eligible.changed() => {}
                    Ok(()) = task.stop.changed() => {}
                }
            }
        }
        let standing = standing_of(&machine, error.clone(), Instant::now());
        if last.as_ref() != Some(&standing) {
            log_change(&task, last.as_ref(), &standing);
            if task
                .updates
                .send(Update { service: task.service.clone(), standing: standing.clone() })
                .await
                .is_err()
            {
                return;
            }
            last = Some(standing);
        }
    }
}

#[cfg(feature = "kubernetes")]
fn standing_of(machine: &machine::Machine, error: Option<String>, now: Instant) -> Standing {
    Standing {
        role: machine.role(now),
        holder: machine.holder().map(str::to_owned),
        changed_at: machine.record_age(now).map(|age| now - age),
        last_takeover: machine.last_takeover().cloned(),
        error,
    }
}

/// A log line for each change of holder or of this node's role.
#[cfg(feature = "kubernetes")]
fn log_change(task: &Task, before: Option<&Standing>, now: &Standing) {
    let (service, lease) = (&task.service, &task.lease);
    let was_holder = before.is_some_and(|b| matches!(b.role, Role::Holder { .. }));
    match &now.role {
        Role::Holder { .. } if !was_holder => {
            let took = now.last_takeover.as_ref().map(|t| t.took);
            tracing::info!(service = %service, lease = %lease, ?took, "this node holds the lease: announcing");
        }
        Role::Holder { .. } => {}
        role if was_holder => {
            tracing::warn!(service = %service, lease = %lease, ?role, "this node no longer holds the lease: not announcing");
        }
        _ => {}
    }
    if before.map(|b| &b.holder) != Some(&now.holder) {
        tracing::info!(service = %service, lease = %lease, holder = ?now.holder, "the lease's holder");
    }
    if let Some(e) = &now.error
        && before.and_then(|b| b.error.as_ref()) != Some(e)
    {
        tracing::warn!(service = %service, lease = %lease, "election: {e}");
    }
}

/// Sleeps until `deadline`, or for ever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}
