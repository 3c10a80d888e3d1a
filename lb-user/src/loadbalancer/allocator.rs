//! The LoadBalancer task: watches every Service (one cluster-wide watch,
//! kube-runtime's reflector); says, on every node, what lb's LoadBalancer
//! Services ask the nodes to serve ([`Served`]: the addresses their status
//! shows, from the pools); and while this node leads, gives them their
//! addresses ([`super::allocate::plan`]) and writes them to
//! `status.loadBalancer.ingress` (`ipMode: VIP`), with an Event for each
//! assignment, release and refusal.
//!
//! The status is the record: every plan starts from what the Services'
//! status shows, so a restart or a new leader moves nothing. A write
//! names the resourceVersion it was planned from (a merge patch with
//! `metadata.resourceVersion`): if the Service changed meanwhile it gets
//! `409 Conflict`, and the watch brings the new version and a new plan.
//! Nothing is written when the status is already right, so in a steady
//! state the allocator costs the API server its one watch, whatever the
//! number of Services. A refusal is told once per reason (an Event), not
//! at every plan.
//!
//! Who leads is the caller's: exactly one node should (the daemon elects
//! it); two that both believe they lead compute the same plan from the
//! same Services, and the resourceVersion keeps either from writing over
//! what it has not seen.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf, pin::pin, time::Duration};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Service;
use kube::{
    Api, Client, Resource as _,
    api::{Patch, PatchParams},
    runtime::{
        WatchStreamExt as _,
        events::{Event, EventType, Recorder, Reporter},
        reflector::{self, Store},
        watcher,
    },
};
use tokio::{sync::watch, task::JoinHandle, time::Instant};
use tracing::{info, warn};

use super::{
    Served,
    allocate::{Outcome, ServiceRef, Wish, plan},
    service::{CLASS, ingress_ips, is_ours, served, wish},
};
use crate::{config::LoadBalancers, discovery::chain, election::Reach};

/// After a failed write, the plan is tried again this much later.
const RETRY: Duration = Duration::from_secs(1);

/// The task's ends, for whoever starts it.
pub struct Channels {
    /// Whether this node allocates (the caller's election).
    pub leading: watch::Receiver<bool>,
    /// Where the task says what to serve, sorted by Service, after every
    /// change.
    pub served: watch::Sender<Vec<Served>>,
    /// The task ends when this turns true or its sender is dropped.
    pub stop: watch::Receiver<bool>,
}

/// Starts the task, reaching the API server through `kubeconfig` (`None`:
/// in-cluster); `node` names this node in Events.
pub fn spawn(
    kubeconfig: Option<PathBuf>,
    settings: LoadBalancers,
    node: String,
    channels: Channels,
) -> JoinHandle<()> {
    spawn_with(Reach::kubeconfig(kubeconfig), settings, node, channels)
}

/// [`spawn`], reaching the API server as `reach` says.
pub(crate) fn spawn_with(
    reach: Reach,
    settings: LoadBalancers,
    node: String,
    channels: Channels,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let client = match reach.client("LoadBalancer Services").await {
            Ok(client) => client,
            Err(why) => {
                warn!(%why, "LoadBalancer Services: no client of the API server; none served");
                return;
            }
        };
        Allocator::new(client, settings, node).run(channels).await;
    })
}

/// The allocator's state between plans.
struct Allocator {
    client: Client,
    settings: LoadBalancers,
    recorder: Recorder,
    /// The refusal last told of each Service, so that it is told once.
    told: BTreeMap<ServiceRef, String>,
}

impl Allocator {
    fn new(client: Client, settings: LoadBalancers, node: String) -> Self {
        let reporter = Reporter { controller: CLASS.to_owned(), instance: Some(node) };
        let recorder = Recorder::new(client.clone(), reporter);
        Self { client, settings, recorder, told: BTreeMap::new() }
    }

    async fn run(mut self, channels: Channels) {
        let Channels { mut leading, served, mut stop } = channels;
        let (store, writer) = reflector::store();
        let services =
            watcher(Api::<Service>::all(self.client.clone()), watcher::Config::default())
                .default_backoff();
        let mut events = pin!(reflector::reflector(writer, services));
        let mut retry_at: Option<Instant> = None;
        // The store is whole once the first list is in.
        let mut listed = false;
        loop {
            let mut replan = false;
            tokio::select! {
                event = events.next() => match event {
                    Some(Ok(event)) => {
                        listed |= matches!(event, watcher::Event::InitDone);
                        replan = true;
                    }
                    Some(Err(e)) => warn!(error = %chain(&e), "LoadBalancer allocator: watching Services"),
                    None => return,
                },
                changed = leading.changed() => match changed {
                    Ok(()) => replan = true,
                    Err(_) => return,
                },
                () = sleep_until(retry_at) => {
                    retry_at = None;
                    replan = true;
                }
                _ = stop.wait_for(|stop| *stop) => return,
            }
            // Take every event that is already there before planning once.
            while let Some(Some(event)) = futures::FutureExt::now_or_never(events.next()) {
                match event {
                    Ok(event) => listed |= matches!(event, watcher::Event::InitDone),
                    Err(e) => {
                        warn!(error = %chain(&e), "LoadBalancer allocator: watching Services");
                    }
                }
            }
            if !(replan && listed) {
                continue;
            }
            let now = self.served(&store);
            served.send_if_modified(|before| {
                let changed = *before != now;
                *before = now;
                changed
            });
            if *leading.borrow() && !self.allocate(&store).await {
                retry_at = Some(Instant::now() + RETRY);
            }
        }
    }

    /// What lb's Services ask the nodes to serve now, by Service.
    fn served(&self, store: &Store<Service>) -> Vec<Served> {
        let mut all: Vec<Served> = store
            .state()
            .iter()
            .filter(|s| is_ours(s, self.settings.default_class))
            .filter_map(|s| served(s, &self.settings.pools))
            .collect();
        all.sort_by(|a, b| a.service.cmp(&b.service));
        all
    }

    /// Plans and writes what differs; false if a write failed (other than
    /// a conflict, which the watch resolves).
    async fn allocate(&mut self, store: &Store<Service>) -> bool {
        let services = store.state();
        let mut ours = BTreeMap::new();
        let mut wishes: Vec<Wish> = Vec::new();
        let mut unreadable = BTreeMap::new();
        for service in &services {
            if !is_ours(service, self.settings.default_class) {
                continue;
            }
            let (Some(namespace), Some(name)) =
                (&service.metadata.namespace, &service.metadata.name)
            else {
                continue;
            };
            let at = ServiceRef { namespace: namespace.clone(), name: name.clone() };
            match wish(service) {
                Ok(wish) => wishes.push(wish),
                Err(refusal) => {
                    unreadable.insert(at.clone(), Err(refusal));
                }
            }
            ours.insert(at, service.clone());
        }
        let mut outcomes = plan(&self.settings.pools, &wishes);
        outcomes.append(&mut unreadable);
        self.told.retain(|at, _| outcomes.contains_key(at));
        let mut all_written = true;
        for (at, outcome) in &outcomes {
            if let Some(service) = ours.get(at) {
                all_written &= self.settle(at, service, outcome).await;
            }
        }
        all_written
    }

    /// Writes one Service's outcome if its status differs, and tells it.
    async fn settle(&mut self, at: &ServiceRef, service: &Service, outcome: &Outcome) -> bool {
        let held = ingress_ips(service);
        let wanted = outcome.as_ref().map(|a| a.addresses.clone()).unwrap_or_default();
        if held != wanted {
            match self.write(at, service, &wanted).await {
                Ok(()) => {}
                Err(Write::Conflict) => return true,
                Err(Write::Failed(why)) => {
                    warn!(service = %at, %why, "LoadBalancer allocator: writing the status");
                    return false;
                }
            }
            let list = |ips: &[IpAddr]| ips.iter().map(ToString::to_string).collect::<Vec<_>>();
            if let Ok(assigned) = outcome {
                let note = format!("{} from pool {:?}", list(&wanted).join(", "), assigned.pool);
                info!(service = %at, addresses = %note, "LoadBalancer address assigned");
                self.tell(service, EventType::Normal, "AddressAssigned", note).await;
            } else if !held.is_empty() {
                let note = format!("{} released", list(&held).join(", "));
                info!(service = %at, %note, "LoadBalancer address released");
                self.tell(service, EventType::Normal, "AddressReleased", note).await;
            }
        }
        match outcome {
            Ok(_) => {
                self.told.remove(at);
            }
            Err(refusal) => {
                let why = refusal.to_string();
                if self.told.get(at) != Some(&why) {
                    warn!(service = %at, %why, "LoadBalancer Service left pending");
                    self.tell(service, EventType::Warning, "AllocationFailed", why.clone()).await;
                    self.told.insert(at.clone(), why);
                }
            }
        }
        true
    }

    async fn write(&self, at: &ServiceRef, service: &Service, ips: &[IpAddr]) -> Result<(), Write> {
        let ingress: Vec<serde_json::Value> = ips
            .iter()
            .map(|ip| serde_json::json!({ "ip": ip.to_string(), "ipMode": "VIP" }))
            .collect();
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": service.metadata.resource_version },
            "status": { "loadBalancer": {
                "ingress": if ingress.is_empty() { serde_json::Value::Null } else { ingress.into() },
            } },
        });
        let api = Api::<Service>::namespaced(self.client.clone(), &at.namespace);
        match api.patch_status(&at.name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 || status.code == 404 => {
                Err(Write::Conflict)
            }
            Err(e) => Err(Write::Failed(chain(&e))),
        }
    }

    async fn tell(&self, service: &Service, type_: EventType, reason: &str, note: String) {
        let event = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note),
            action: "Allocate".to_owned(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &service.object_ref(&())).await {
            warn!(error = %chain(&e), reason, "LoadBalancer allocator: publishing an Event");
        }
    }
}

/// Why a status write did not happen.
enum Write {
    /// The Service changed or went since it was read: the watch brings
    /// what to plan from.
    Conflict,
    /// Anything else; tried again after [`RETRY`].
    Failed(String),
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
