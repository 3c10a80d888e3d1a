//! The store the fake's listeners share: the slices and Leases, their
//! history of changes with resourceVersions, the open watches and the
//! request log.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{Mutex, atomic::AtomicUsize},
};

use k8s_openapi::{
    api::{
        coordination::v1::Lease, core::v1::Service, discovery::v1::EndpointSlice, events::v1::Event,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use tokio::sync::watch;

/// One request the server answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestLog {
    /// The listener (apiserver) that answered.
    pub via: SocketAddr,
    /// A watch (`watch=true`), not a list.
    pub watch: bool,
    /// Its `resourceVersion` parameter.
    pub resource_version: Option<String>,
    /// Its `labelSelector` parameter.
    pub label_selector: Option<String>,
    /// Answered with 410 Gone.
    pub gone: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Added,
    Modified,
    Deleted,
}

/// The kinds of object the fake lists and watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Resource {
    Slices,
    Leases,
    Services,
}

/// An object of either kind, as a change carries it.
#[derive(Clone)]
pub(super) enum Object {
    Slice(EndpointSlice),
    Lease(Lease),
    Service(Box<Service>),
}

impl Object {
    pub(super) fn metadata(&self) -> &ObjectMeta {
        match self {
            Self::Slice(slice) => &slice.metadata,
            Self::Lease(lease) => &lease.metadata,
            Self::Service(service) => &service.metadata,
        }
    }

    pub(super) fn resource(&self) -> Resource {
        match self {
            Self::Slice(_) => Resource::Slices,
            Self::Lease(_) => Resource::Leases,
            Self::Service(_) => Resource::Services,
        }
    }
}

pub(super) struct Change {
    pub(super) rv: u64,
    pub(super) kind: Kind,
    pub(super) object: Object,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) rv: u64,
    pub(super) slices: BTreeMap<(String, String), EndpointSlice>,
    /// Changes after `compacted`.
    pub(super) history: Vec<Change>,
    /// Watches from a resourceVersion older than this get 410 Gone.
    pub(super) compacted: u64,
    pub(super) gone_as_http: bool,
    /// Bumped by `bookmark()`.
    pub(super) bookmarks: u64,
    /// Bumped by `expire()`: open streams end with 410.
    pub(super) expiries: u64,
    /// Open streams hold their events back (a slow watch cache).
    pub(super) paused: bool,
    pub(super) requests: Vec<RequestLog>,
    /// The open watch streams: what each watches, and how to wake it when
    /// a slice in its scope changes.
    pub(super) watches: Vec<WatchScope>,
    /// The Leases (`leases.rs`).
    pub(super) leases: Leases,
    /// The Services, by (namespace, name) (`services.rs`).
    pub(super) services: BTreeMap<(String, String), Service>,
    /// Every write to a Service's status.
    pub(super) service_writes: Vec<ServiceWrite>,
    /// The Events created, as last patched.
    pub(super) events: Vec<Event>,
    /// Services whose next status write meets a race first
    /// (`FakeApiServer::race_next_status_write`).
    pub(super) races: BTreeMap<String, Race>,
}

/// What happens to a Service just before its next status write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Race {
    /// Another client edits it (a label): the write names a stale
    /// resourceVersion and gets `409 Conflict`.
    Edited,
    /// It is deleted: the write gets `404 Not Found`.
    Deleted,
}

/// One write to a Service's status that the fake answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceWrite {
    /// The listener (apiserver) that answered.
    pub via: SocketAddr,
    /// The Service's name.
    pub name: String,
    /// `merge` or `apply`.
    pub patch: &'static str,
    /// The HTTP status of the answer.
    pub status: u16,
}

impl ServiceWrite {
    pub(super) fn new(via: SocketAddr, name: &str, patch: &'static str, status: u16) -> Self {
        Self { via, name: name.to_owned(), patch, status }
    }
}

/// What one open watch stream watches. A change to an object wakes only
/// the streams whose scope it is in (with a thousand watches, waking every
/// one on every change would make the fake, not the client, the
/// bottleneck).
pub(super) struct WatchScope {
    pub(super) resource: Resource,
    pub(super) namespace: String,
    pub(super) wanted: Vec<(String, String)>,
    pub(super) wake: watch::Sender<()>,
}

impl State {
    /// Records a change to `object`, whose resourceVersion is the current
    /// one, and wakes the watch streams whose scope it is in (forgetting
    /// closed ones).
    pub(super) fn record(&mut self, kind: Kind, object: Object) {
        self.watches.retain(|w| !w.wake.is_closed());
        for w in &self.watches {
            if w.resource == object.resource()
                && in_scope(object.metadata(), &w.namespace, &w.wanted)
            {
                w.wake.send_replace(());
            }
        }
        self.history.push(Change { rv: self.rv, kind, object });
    }
}

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    /// Pinged on every bookmark, expiry or resume: what concerns every
    /// open watch (a change to a slice wakes only the watches of its scope).
    pub(super) changed: watch::Sender<()>,
    /// Watch streams open now.
    pub(super) watching: AtomicUsize,
    /// Watch events sent (ADDED, MODIFIED, DELETED), on every stream.
    pub(super) events: AtomicUsize,
    /// `true` while Lease requests are stalled
    /// ([`super::FakeApiServer::stall_leases`]).
    pub(super) leases_stalled: watch::Sender<bool>,
}

pub(super) fn in_scope(
    metadata: &ObjectMeta,
    namespace: &str,
    wanted: &[(String, String)],
) -> bool {
    // "": every namespace (a cluster-wide list or watch).
    (namespace.is_empty() || metadata.namespace.as_deref() == Some(namespace))
        && wanted.iter().all(|(k, v)| metadata.labels.as_ref().and_then(|l| l.get(k)) == Some(v))
}

/// The Leases, by (namespace, name), and what was asked of them.
#[derive(Default)]
pub(super) struct Leases {
    pub(super) items: BTreeMap<(String, String), Lease>,
    pub(super) log: Vec<LeaseRequest>,
}

/// One Lease request the fake answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRequest {
    /// `GET`, `POST`, `PUT`, `DELETE`.
    pub method: String,
    /// The Lease's name.
    pub name: String,
    /// The HTTP status of the answer.
    pub status: u16,
    /// The listener (apiserver) that answered.
    pub via: SocketAddr,
}
