//! The membership elections' task: the rules (`membership.rs`) carried
//! out against the API server through kube-rs. One watch over every
//! membership Lease of lb's namespace feeds the machine; its writes of
//! this node's Lease go one at a time, each over the version last seen
//! (a write of someone else's in between gets `409 Conflict`, and the
//! watch shows it to the machine). What the node may answer goes to the
//! daemon as [`Answering`]; a write that gives up a VIP waits until the
//! daemon has applied its withdrawal to the kernel, so a VIP given up is
//! silent before the write that gives it up can reach another node.

use std::{collections::BTreeSet, path::PathBuf, time::Duration};

use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};

use super::{Reach, membership::Timings};

/// What the node may answer, as the task last said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answering {
    /// The VIPs (addresses) it answers.
    pub vips: BTreeSet<String>,
    /// Until when (`None`: nothing).
    pub fence: Option<std::time::Instant>,
    /// Counts the changes: the daemon acknowledges each once applied.
    pub generation: u64,
    /// The last request's failure, until one succeeds.
    pub error: Option<String>,
}

/// The daemon's end of the task.
pub struct Membership {
    /// This node's holder identity in its Lease.
    pub identity: String,
    eligible: watch::Sender<Option<BTreeSet<String>>>,
    stop: watch::Sender<bool>,
    applied: watch::Sender<u64>,
    task: JoinHandle<()>,
}

/// Where the task works, and as whom.
pub struct Settings {
    /// lb's namespace, where the membership Leases are.
    pub namespace: String,
    /// This node's name: its Lease's.
    pub node: String,
    /// This node's holder identity (`identity.rs`).
    pub identity: String,
    /// The membership's timings.
    pub timings: Timings,
}

impl Membership {
    /// Starts the task, reaching the API server through `kubeconfig`
    /// (`None`: the in-cluster settings); it sends what the node may
    /// answer to `answering`.
    pub fn start(
        settings: Settings,
        kubeconfig: Option<PathBuf>,
        answering: mpsc::Sender<Answering>,
    ) -> Self {
        Self::start_with(settings, Reach::kubeconfig(kubeconfig), answering)
    }

    /// As [`Self::start`], reaching the API server as `reach` says.
    pub(crate) fn start_with(
        settings: Settings,
        reach: Reach,
        answering: mpsc::Sender<Answering>,
    ) -> Self {
        let (eligible, eligible_rx) = watch::channel(None);
        let (stop, stop_rx) = watch::channel(false);
        let (applied, applied_rx) = watch::channel(0);
        let identity = settings.identity.clone();
        let inputs = Inputs { eligible: eligible_rx, stop: stop_rx, applied: applied_rx };
        let task = tokio::spawn(run(reach, settings, inputs, answering));
        Self { identity, eligible, stop, applied, task }
    }

    /// The VIPs the node can serve now.
    pub fn set_eligible(&self, vips: BTreeSet<String>) {
        self.eligible.send_if_modified(|old| {
            let changed = old.as_ref() != Some(&vips);
            *old = Some(vips);
            changed
        });
    }

    /// The kernel follows [`Answering`] of this generation.
    pub fn applied(&self, generation: u64) {
        self.applied.send_replace(generation);
    }

    /// The node stops serving: the task withdraws every VIP (once the
    /// daemon has applied that), writes that the node serves nothing, so
    /// that the others take its VIPs at once, and ends.
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }

    /// As [`Self::stop`], waiting up to `wait` for the task to end.
    pub async fn resign(self, wait: Duration) {
        self.stop.send_replace(true);
        let mut task = self.task;
        if tokio::time::timeout(wait, &mut task).await.is_err() {
            task.abort();
        }
    }

    /// Ends the task without a word: the claims stand until the node's
    /// membership runs out, and the kernel's fence with them; a daemon
    /// back within it renews them.
    pub fn keep(self) {
        self.task.abort();
    }
}

#[cfg(not(feature = "kubernetes"))]
async fn run(reach: Reach, settings: Settings, inputs: Inputs, answering: mpsc::Sender<Answering>) {
    // `Config::parse` refuses `elect` in a build without Kubernetes.
    let _ = (reach, settings, inputs);
    let error = Some("lb was built without the `kubernetes` feature".to_owned());
    let _ = answering.send(Answering { error, ..Answering::default() }).await;
}

#[cfg(feature = "kubernetes")]
use {
    super::{
        membership::{Machine, Step, Watched},
        membership_lease,
    },
    crate::discovery::chain,
    futures::StreamExt as _,
    k8s_openapi::api::coordination::v1::Lease,
    kube::{
        Api,
        api::PostParams,
        runtime::{WatchStreamExt as _, watcher},
    },
    std::pin::pin,
    tokio::time::Instant,
};

/// What the daemon tells the task.
struct Inputs {
    eligible: watch::Receiver<Option<BTreeSet<String>>>,
    stop: watch::Receiver<bool>,
    applied: watch::Receiver<u64>,
}

#[cfg(feature = "kubernetes")]
async fn run(reach: Reach, settings: Settings, inputs: Inputs, answering: mpsc::Sender<Answering>) {
    let Inputs { mut eligible, mut stop, mut applied } = inputs;
    let client = loop {
        match reach.client(&settings.node).await {
            Ok(client) => break client,
            Err(e) => {
                // The daemon logs it (`Answering::error`).
                let failed = Answering { error: Some(e), ..Answering::default() };
                if answering.send(failed).await.is_err() || *stop.borrow() {
                    return;
                }
                tokio::time::sleep(settings.timings.duration).await;
            }
        }
    };
    let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
    let (watched_tx, mut watched) = mpsc::channel(64);
    let watching = tokio::spawn(watch_leases(api.clone(), watched_tx));
    let _stop_watching = AbortOnDrop(watching);
    let timeout = settings.timings.duration / 2;
    let mut machine =
        Machine::new(settings.node.clone(), settings.identity.clone(), settings.timings, None);
    // The version of this node's Lease last seen: the next write's base.
    let mut own_version: Option<String> = None;
    let mut told = Answering::default();
    // What the kernel may still answer: what the daemon applied last, and
    // what it was told since (by generation), until it says so.
    let mut kernel = Unapplied::default();
    let mut write: Option<JoinHandle<Result<String, String>>> = None;
    // A write asked for (its claims, and the Lease), waiting until the
    // kernel answers nothing the write gives up.
    let mut waiting: Option<(BTreeSet<String>, Lease)> = None;
    let mut error: Option<String> = None;
    // No write before the first list: it tells whether the Lease exists
    // (a create) and its version (an update), so a restarted daemon's
    // first write is not a create refused as a conflict.
    let mut listed = false;
    loop {
        let now = Instant::now().into_std();
        // Told to stop, or dropped by the daemon.
        if *stop.borrow() || stop.has_changed().is_err() {
            machine.stop(now);
        }
        let step = machine.poll(now);
        let (fence, vips) = match machine.answering(now) {
            Some((fence, vips)) => (Some(fence), vips.clone()),
            None => (None, BTreeSet::new()),
        };
        if (fence, &vips, &error) != (told.fence, &told.vips, &told.error) {
            told = Answering { vips, fence, generation: told.generation + 1, error: error.clone() };
            kernel.told(told.generation, &told.vips);
            if answering.send(told.clone()).await.is_err() {
                return;
            }
        }
        let mut wake = None;
        match step {
            Step::Write(content) => {
                tracing::debug!(
                    claims = content.claims.len(),
                    eligible = content.eligible.len(),
                    answering = told.vips.len(),
                    "membership: writing this node's Lease"
                );
                let lease = membership_lease::lease(
                    &settings.namespace,
                    &settings.node,
                    &settings.identity,
                    &content,
                    settings.timings.duration,
                );
                waiting = Some((content.claims, lease));
            }
            Step::Wait(until) => wake = until,
        }
        // The daemon gone, nothing of its is answered any more.
        let gone = applied.has_changed().is_err();
        kernel.applied(if gone { u64::MAX } else { *applied.borrow() });
        let silent = |claims: &BTreeSet<String>| kernel.may_answer().all(|v| claims.contains(v));
        if write.is_none()
            && listed
            && waiting.as_ref().is_some_and(|(claims, _)| silent(claims))
            && let Some((_, lease)) = waiting.take()
        {
            let (api, version) = (api.clone(), own_version.clone());
            write = Some(tokio::spawn(write_lease(api, lease, version, timeout)));
        }
        let stopping = *stop.borrow() || stop.has_changed().is_err();
        if stopping && write.is_none() && waiting.is_none() && fence.is_none() {
            return;
        }
        let sleep = async {
            match wake {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some(event) = watched.recv() => {
                if let Watched::Applied(lease) = &event && lease.node == settings.node {
                    own_version = Some(lease.version.clone());
                }
                if let Watched::Listed(leases) = &event {
                    listed = true;
                    own_version = leases.iter().find(|l| l.node == settings.node).map(|l| l.version.clone());
                }
                machine.on_watched(event, Instant::now().into_std());
            }
            Some(done) = async { match write.as_mut() { Some(w) => Some(w.await), None => None } }, if write.is_some() => {
                write = None;
                let now = Instant::now().into_std();
                match done {
                    Ok(Ok(version)) => {
                        own_version = Some(version.clone());
                        machine.on_written(version, now);
                        error = None;
                    }
                    Ok(Err(e)) => {
                        // The daemon logs it (`Answering::error`).
                        machine.on_write_failed(now);
                        error = Some(e);
                    }
                    Err(_) => machine.on_write_failed(now),
                }
            }
            Ok(()) = eligible.changed() => {
                if let Some(vips) = eligible.borrow_and_update().clone() {
                    machine.set_eligible(vips, Instant::now().into_std());
                }
            }
            Ok(()) = stop.changed() => {}
            Ok(()) = applied.changed() => {}
            () = sleep => {}
        }
    }
}

/// What the kernel may answer, as far as the task knows: the VIPs of the
/// last [`Answering`] the daemon acknowledged and of those it was sent
/// since. A write that gives up none of them goes at once (a renewal);
/// one that gives one up waits until the daemon has applied its
/// withdrawal.
#[derive(Default)]
struct Unapplied {
    applied: BTreeSet<String>,
    /// Sent and not yet acknowledged, by generation.
    pending: std::collections::VecDeque<(u64, BTreeSet<String>)>,
}

impl Unapplied {
    fn told(&mut self, generation: u64, vips: &BTreeSet<String>) {
        self.pending.push_back((generation, vips.clone()));
        // Bounded, for a daemon slow to acknowledge: the two oldest become
        // one, the later generation with both sets (more, never less).
        if self.pending.len() > 64
            && let (Some((_, mut first)), Some((generation, second))) =
                (self.pending.pop_front(), self.pending.pop_front())
        {
            first.extend(second);
            self.pending.push_front((generation, first));
        }
    }

    /// The daemon has applied everything up to `generation`.
    fn applied(&mut self, generation: u64) {
        while self.pending.front().is_some_and(|(g, _)| *g <= generation) {
            if let Some((_, vips)) = self.pending.pop_front() {
                self.applied = vips;
            }
        }
    }

    fn may_answer(&self) -> impl Iterator<Item = &String> {
        self.applied.iter().chain(self.pending.iter().flat_map(|(_, vips)| vips))
    }
}

/// Writes `lease` over `version` (none: creates it); its new version.
#[cfg(feature = "kubernetes")]
async fn write_lease(
    api: Api<Lease>,
    mut lease: Lease,
    version: Option<String>,
    timeout: Duration,
) -> Result<String, String> {
    let name = lease.metadata.name.clone().unwrap_or_default();
    let post = PostParams::default();
    let request = async {
        match version {
            Some(version) => {
                lease.metadata.resource_version = Some(version);
                api.replace(&name, &post, &lease).await
            }
            None => api.create(&post, &lease).await,
        }
    };
    match tokio::time::timeout(timeout, request).await {
        Err(_) => Err(format!("writing Lease {name}: no answer within {timeout:?}")),
        Ok(Err(e)) => Err(format!("writing Lease {name}: {}", chain(&e))),
        Ok(Ok(written)) => written
            .metadata
            .resource_version
            .ok_or_else(|| format!("writing Lease {name}: the answer has no resourceVersion")),
    }
}

/// Watches the membership Leases, for ever: a list, then changes; a list
/// again whenever the watch must start over.
#[cfg(feature = "kubernetes")]
async fn watch_leases(api: Api<Lease>, tx: mpsc::Sender<Watched>) {
    let (key, value) = membership_lease::LABEL;
    let config = watcher::Config::default().labels(&format!("{key}={value}"));
    let mut stream = pin!(watcher(api, config).default_backoff());
    let mut listing: Option<Vec<super::membership::Lease>> = None;
    while let Some(event) = stream.next().await {
        let watched = match event {
            Ok(watcher::Event::Init) => {
                listing = Some(Vec::new());
                continue;
            }
            Ok(watcher::Event::InitApply(lease)) => {
                listing.get_or_insert_default().extend(membership_lease::read(&lease));
                continue;
            }
            Ok(watcher::Event::InitDone) => Watched::Listed(listing.take().unwrap_or_default()),
            Ok(watcher::Event::Apply(lease)) => match membership_lease::read(&lease) {
                Some(lease) => Watched::Applied(lease),
                None => continue,
            },
            Ok(watcher::Event::Delete(lease)) => {
                Watched::Deleted(lease.metadata.name.clone().unwrap_or_default())
            }
            Err(e) => {
                tracing::warn!("membership: watching the Leases: {}", chain(&e));
                continue;
            }
        };
        if tx.send(watched).await.is_err() {
            return;
        }
    }
}

/// Aborts a task when dropped.
#[cfg(feature = "kubernetes")]
struct AbortOnDrop(JoinHandle<()>);

#[cfg(feature = "kubernetes")]
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(vips: &[&str]) -> BTreeSet<String> {
        vips.iter().map(|v| (*v).to_owned()).collect()
    }

    fn may_answer(kernel: &Unapplied) -> BTreeSet<String> {
        kernel.may_answer().cloned().collect()
    }

    #[test]
    fn a_vip_given_up_counts_as_answered_until_the_daemon_has_applied_it() {
        let mut kernel = Unapplied::default();
        kernel.told(1, &set(&["a", "b"]));
        kernel.applied(1);
        assert_eq!(may_answer(&kernel), set(&["a", "b"]));
        // Told to answer `a` alone: `b` may still be answered until the
        // daemon says it applied that.
        kernel.told(2, &set(&["a"]));
        kernel.applied(1);
        assert_eq!(may_answer(&kernel), set(&["a", "b"]));
        kernel.applied(2);
        assert_eq!(may_answer(&kernel), set(&["a"]));
    }

    #[test]
    fn a_daemon_slow_to_acknowledge_costs_bounded_memory_and_loses_no_vip() {
        let mut kernel = Unapplied::default();
        for generation in 1..=1_000u64 {
            kernel.told(generation, &set(&[&format!("v{}", generation % 100)]));
        }
        assert!(kernel.pending.len() <= 64);
        assert_eq!(may_answer(&kernel).len(), 100, "every VIP told since the last acknowledgement");
        kernel.applied(1_000);
        assert_eq!(may_answer(&kernel), set(&["v0"]));
    }
}
