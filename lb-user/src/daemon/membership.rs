//! The elections by membership (`crate::election::membership_task`) kept
//! in step with the services: one task for the node while a service
//! elects (`[service.external] elect = true`), told which VIP addresses
//! the node can serve once the kernel has been told what to announce;
//! what it says the node answers turned into announcements and the
//! kernel's fences, and acknowledged once they are written (the task
//! writes a VIP away only then). Kept when the daemon stops to start
//! again, resigned when it is detached.

use std::{
    collections::{BTreeSet, HashMap},
    time::{Duration, Instant},
};

use super::{load_balancer_task::ALLOCATOR, owner::Daemon};
use crate::{
    control::LeaseStatus,
    election::{
        self,
        membership::Timings,
        membership_task::{Answering, Membership, Settings},
    },
};

/// How long a stopping daemon waits for its task to write that the node
/// serves nothing.
const RESIGN_WAIT: Duration = Duration::from_secs(1);

impl Daemon {
    /// Whether service `i` is elected by membership.
    pub(super) fn elects(&self, i: usize) -> bool {
        self.services[i].config.external.as_ref().is_some_and(|e| e.elect)
    }

    /// The fence until which the membership lets this node answer service
    /// `i`'s VIP, if it does now.
    pub(super) fn membership_fence(&self, i: usize, now: Instant) -> Option<Instant> {
        let vip = self.services[i].config.vip.ip().to_string();
        let fence = self.answering.fence.filter(|f| *f > now)?;
        self.answering.vips.contains(&vip).then_some(fence)
    }

    /// Starts or stops the task to match the services that elect, and
    /// tells it the addresses the node can serve: an address whose every
    /// electing service is eligible (`eligible`: service index → `None`,
    /// or why not). Called after the kernel's announcements are written.
    pub(super) fn sync_membership(&mut self, eligible: &HashMap<usize, Option<&'static str>>) {
        let electing: Vec<usize> = (0..self.services.len()).filter(|&i| self.elects(i)).collect();
        if (electing.is_empty() && !self.allocates()) || self.membership_ended {
            if let Some(membership) = self.membership.take() {
                // No service elects any more: nothing is announced by it.
                membership.applied(u64::MAX);
                tokio::spawn(membership.resign(RESIGN_WAIT));
            }
            return;
        }
        let mut addresses: HashMap<String, bool> = HashMap::new();
        for &i in &electing {
            let ok = matches!(eligible.get(&i), Some(None));
            let address = self.services[i].config.vip.ip().to_string();
            *addresses.entry(address).or_insert(true) &= ok;
        }
        let mut can_serve: BTreeSet<String> =
            addresses.into_iter().filter(|(_, ok)| *ok).map(|(a, _)| a).collect();
        if self.allocates() {
            can_serve.insert(ALLOCATOR.to_owned());
        }
        let membership = self.membership.get_or_insert_with(|| {
            let settings = &self.config.settings;
            let timings = Timings {
                duration: settings.membership.duration,
                renew: settings.membership.renew,
                retry: settings.election.retry,
                hold_down: settings.membership.duration * 2,
            };
            let settings = Settings {
                namespace: settings.membership.namespace.clone(),
                node: settings.node_name.clone(),
                identity: election::identity::load(&settings.node_name, &settings.state_dir),
                timings,
            };
            let reach =
                super::elections::reach(&self.services, self.config.settings.kubeconfig.clone());
            Membership::start_with(settings, reach, self.senders.membership.clone())
        });
        membership.set_eligible(can_serve);
    }

    /// The task's word: announce and fence as it says, then acknowledge.
    pub(super) fn on_membership(&mut self, answering: Answering) {
        if answering.error != self.answering.error
            && let Some(e) = &answering.error
        {
            tracing::warn!("membership: {e}");
        }
        let generation = answering.generation;
        self.answering = answering;
        self.set_leading();
        self.reannounce();
        if let Some(membership) = &self.membership {
            membership.applied(generation);
        }
    }

    /// The daemon stops to start again: the task ends without a word, its
    /// claims stand until the node's membership runs out, and the kernel's
    /// fences with them.
    pub(super) fn keep_membership(&mut self) {
        self.membership_ended = true;
        if let Some(membership) = self.membership.take() {
            membership.keep();
        }
    }

    /// The daemon stops for good: every VIP the membership let it answer
    /// is withdrawn and fenced, then the task writes that the node serves
    /// nothing, so that the others take over at once.
    pub(super) async fn resign_membership(&mut self) {
        self.membership_ended = true;
        let Some(membership) = self.membership.take() else { return };
        self.answering = Answering::default();
        self.reannounce();
        // Withdrawn: whatever the task says next needs nothing more.
        membership.applied(u64::MAX);
        membership.resign(RESIGN_WAIT).await;
    }

    /// Service `i`'s election by membership in `lb status`.
    pub(super) fn membership_status(&self, i: usize) -> Option<LeaseStatus> {
        if !self.elects(i) {
            return None;
        }
        let settings = &self.config.settings;
        let (role, why) = match (self.membership_fence(i, Instant::now()), &self.membership) {
            (Some(_), _) => ("holder", None),
            (None, Some(_)) => ("candidate", None),
            (None, None) => ("not eligible", Some("no membership task".to_owned())),
        };
        Some(LeaseStatus {
            lease: format!("{}/{} (membership)", settings.membership.namespace, settings.node_name),
            node: settings.node_name.clone(),
            identity: self.membership.as_ref().map(|m| m.identity.clone()),
            role: role.to_owned(),
            why,
            holder: None,
            changed_ms_ago: None,
            last_takeover: None,
            error: self.answering.error.clone(),
        })
    }
}
