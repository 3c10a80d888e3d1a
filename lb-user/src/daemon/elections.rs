//! The elections of the leased external VIPs (`crate::election`) kept in
//! step with the services: a task per service with `[service.external]
//! lease`, told whether this node is eligible once the kernel has been
//! told what to announce; its news turned into announcements and the
//! kernel's fences (`ANNOUNCE_UNTIL`); every lease kept when the daemon
//! stops to start again, released when it is detached.

use std::{
    collections::HashMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use super::owner::Daemon;
use crate::{
    config,
    control::{LeaseStatus, TakeoverStatus},
    datapath::monotonic_now_ns,
    election::{self, Election, Reach, Role, Timings},
};

/// How long a stopping daemon waits for its leases to be released.
const RESIGN_WAIT: Duration = Duration::from_secs(1);

impl Daemon {
    /// Whether this node may announce service `i`'s VIP now: always
    /// without an election; with a lease, while it holds the lease;
    /// elected by membership, while the membership task says it answers
    /// it; with both (moving from a Lease per VIP to membership), while
    /// both say so.
    pub(super) fn may_announce(&self, i: usize) -> bool {
        let now = Instant::now();
        let by_membership = !self.elects(i) || self.membership_fence(i, now).is_some();
        let service = &self.services[i];
        let by_lease = service.config.external.as_ref().is_none_or(|e| e.lease.is_none())
            || self.elections.get(&service.config.name).is_some_and(|e| e.fence(now).is_some());
        by_membership && by_lease
    }

    /// Whether service `i` is elected both ways: by its Lease and by
    /// membership (a cluster moving from the one to the other).
    fn migrating(&self, i: usize) -> bool {
        self.elects(i)
            && self.services[i].config.external.as_ref().is_some_and(|e| e.lease.is_some())
    }

    /// The fences of the leased VIPs, for `ANNOUNCE_UNTIL`: the holder's
    /// deadline (`CLOCK_MONOTONIC` ns), or 0 (answer nothing) when this
    /// node does not hold the lease.
    pub(super) fn fences(&self, external: &[usize]) -> HashMap<IpAddr, u64> {
        let now = Instant::now();
        let now_ns = monotonic_now_ns();
        let mut fences = HashMap::new();
        for &i in external {
            let service = &self.services[i];
            let leased = service.config.external.as_ref().is_some_and(|e| e.lease.is_some());
            let by_lease = || self.elections.get(&service.config.name).and_then(|e| e.fence(now));
            let fence = match (self.elects(i), leased) {
                (false, false) => continue,
                (true, false) => self.membership_fence(i, now),
                (false, true) => by_lease(),
                // Moving between the two: the earlier fence of both.
                (true, true) => {
                    self.membership_fence(i, now).zip(by_lease()).map(|(m, l)| m.min(l))
                }
            };
            let until = fence.map_or(0, |fence| now_ns + (fence - now).as_nanos() as u64);
            // Two services on one address: the stricter fence.
            let entry = fences.entry(service.config.vip.ip()).or_insert(until);
            *entry = (*entry).min(until);
        }
        fences
    }

    /// Starts and stops election tasks to match the leased services, and
    /// tells each whether the node is eligible (`eligible`: service index →
    /// `None`, or why not). Called after the kernel's announcements are
    /// written: a node that is no longer eligible has already fallen silent
    /// when its task releases the lease.
    pub(super) fn sync_elections(&mut self, eligible: &HashMap<usize, Option<&'static str>>) {
        let mut wanted: HashMap<String, (usize, config::LeaseRef)> = HashMap::new();
        for (i, service) in self.services.iter().enumerate() {
            if let Some(lease) = service.config.external.as_ref().and_then(|e| e.lease.clone()) {
                wanted.insert(service.config.name.clone(), (i, lease));
            }
        }
        self.elections.retain(|name, election| {
            wanted.get(name).is_some_and(|(_, lease)| *lease == election.lease)
        });
        for (name, (i, lease)) in wanted {
            let migrating = self.migrating(i);
            let mut why = eligible.get(&i).copied().unwrap_or(Some("no usable server"));
            // Moving to membership: the node seeks the VIP's Lease only
            // while membership places the VIP on it, and gives it up when
            // it does not, so that the node membership places it on takes
            // it at once (no settling: membership's hold-down keeps a
            // flapping node from moving it).
            if why.is_none() && migrating && self.membership_fence(i, Instant::now()).is_none() {
                why = Some("membership places it on another node");
            }
            let election = self.elections.entry(name.clone()).or_insert_with(|| {
                let settings = &self.config.settings;
                Election::start(
                    name,
                    lease,
                    election::identity::load(&settings.node_name, &settings.state_dir),
                    Timings {
                        duration: settings.election.duration,
                        renew: settings.election.renew,
                        retry: settings.election.retry,
                        settle: if migrating { Duration::ZERO } else { settings.election.duration },
                    },
                    reach(&self.services, settings.kubeconfig.clone()),
                    self.senders.elections.clone(),
                )
            });
            election.set_eligible(why);
        }
        self.sync_membership(eligible);
    }

    /// An election task's news: announce or withdraw as it says.
    pub(super) fn on_election(&mut self, update: election::Update) {
        let Some(election) = self.elections.get_mut(&update.service) else { return };
        election.standing = Some(update.standing);
        self.reannounce();
    }

    /// The daemon stops to start again (a signal, an upgrade, a rollout):
    /// it keeps its leases and leaves the kernel's fences as they are. Back
    /// within a lease duration, it renews them and no VIP moves; not back,
    /// its fences run out and another node takes over, as after a crash.
    pub(super) fn keep_leases(&mut self) {
        self.keep_membership();
        let held = self.elections.values().filter(|e| e.fence(Instant::now()).is_some()).count();
        if held > 0 {
            tracing::info!(
                leases = held,
                duration = ?self.config.settings.election.duration,
                "keeping the leases held: a daemon started within their duration renews them"
            );
        }
        for (_, election) in self.elections.drain() {
            election.keep();
        }
    }

    /// The daemon stops for good (`lb detach`): its leased VIPs are
    /// withdrawn from the kernel, then their leases released, so that
    /// another node takes over at once.
    pub(super) async fn resign(&mut self) {
        self.resign_membership().await;
        if self.elections.is_empty() {
            return;
        }
        let elections: Vec<Election> = self.elections.drain().map(|(_, e)| e).collect();
        // No election: every leased VIP is fenced and withdrawn.
        self.reannounce();
        for election in elections {
            election.resign(RESIGN_WAIT).await;
        }
    }

    /// Service `i`'s election in `lb status`.
    pub(super) fn lease_status(&self, i: usize) -> Option<LeaseStatus> {
        if self.elects(i) && !self.migrating(i) {
            return self.membership_status(i);
        }
        let service = &self.services[i];
        let lease = service.config.external.as_ref()?.lease.as_ref()?;
        let now = Instant::now();
        let standing = self.elections.get(&service.config.name).and_then(|e| e.standing.as_ref());
        let (role, why) = match standing.map(|s| &s.role) {
            Some(Role::Holder { .. }) => ("holder", None),
            Some(Role::Candidate) => ("candidate", None),
            Some(Role::NotEligible(why)) => ("not eligible", Some((*why).to_owned())),
            None => ("starting", None),
        };
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Some(LeaseStatus {
            lease: lease.to_string(),
            node: self.config.settings.node_name.clone(),
            identity: self.elections.get(&service.config.name).map(|e| e.identity.clone()),
            role: role.to_owned(),
            why,
            holder: standing.and_then(|s| s.holder.clone()),
            changed_ms_ago: standing
                .and_then(|s| s.changed_at)
                .map(|at| ms(now.saturating_duration_since(at))),
            last_takeover: standing.and_then(|s| s.last_takeover.as_ref()).map(|t| {
                TakeoverStatus {
                    ms_ago: ms(now.saturating_duration_since(t.at)),
                    took_ms: ms(t.took),
                    from: t.from.clone(),
                }
            }),
            error: standing.and_then(|s| s.error.clone()),
        })
    }
}

/// How election tasks reach the API server: through the service that
/// discovers the apiservers (`default/kubernetes`), if one does, as its
/// own discovery does.
pub(super) fn reach(
    services: &[super::service::Service],
    kubeconfig: Option<std::path::PathBuf>,
) -> Reach {
    let apiservers = services.iter().find(|s| {
        matches!(&s.config.discovery, Some(config::Discovery::Kubernetes { namespace, service, .. })
            if namespace == "default" && service == "kubernetes")
    });
    match apiservers.and_then(|s| Some((s, s.discovery.as_ref()?))) {
        Some((service, discovery)) => Reach {
            kubeconfig,
            apiservers: Some(service.config.vip),
            seeds: service.config.servers.clone(),
            usable: discovery.usable.subscribe(),
        },
        None => Reach::kubeconfig(kubeconfig),
    }
}
