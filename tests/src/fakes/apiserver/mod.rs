//! A fake Kubernetes API server for discovery, election and LoadBalancer
//! tests: EndpointSlices, Leases, Services and Events, over plain HTTP/1.1, speaking the real list
//! and watch protocol, with JSON built from `k8s-openapi` types.
//!
//! - `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=k=v`
//!   lists (an `EndpointSliceList` with `metadata.resourceVersion`);
//! - the same with `watch=true&resourceVersion=N` streams, chunked, one
//!   `{"type":"ADDED|MODIFIED|DELETED|BOOKMARK|ERROR","object":...}` per line:
//!   first every change after `N`, then changes as the test makes them;
//! - `/apis/coordination.k8s.io/v1/namespaces/{ns}/leases[/{name}]`: get,
//!   create, update (`409 Conflict` on a stale resourceVersion) and delete
//!   Leases (`leases.rs`), and list and watch them as slices are;
//!   [`FakeApiServer::lease`] shows one.
//!
//! - `/api/v1/services` (every namespace) and
//!   `/api/v1/namespaces/{ns}/services`: listed and watched as slices
//!   are; a Service's `status` patched, and Events (`events.k8s.io/v1`)
//!   created and patched (`services.rs`); [`FakeApiServer::apply_service`],
//!   [`FakeApiServer::service`], [`FakeApiServer::events`].
//!
//! The test drives it step by step: [`FakeApiServer::apply`],
//! [`FakeApiServer::delete`], [`FakeApiServer::bookmark`],
//! [`FakeApiServer::expire`] (compaction: watches from before it get
//! `410 Gone`, as an `ERROR` event or, with [`FakeApiServer::set_gone_as_http`],
//! as an HTTP 410, and open streams are ended with it),
//! [`FakeApiServer::cut_streams`] (connections dropped mid-stream), and
//! [`FakeApiServer::stop_listener`] / [`FakeApiServer::restart_listener`]
//! (one apiserver of several dies and comes back: several listeners on
//! different loopback ports serve the same store, like apiservers sharing
//! etcd), [`FakeApiServer::stall_leases`] (no Lease request answered for a
//! while). [`FakeApiServer::requests`] says who asked what.
//!
//! It runs on the tokio runtime of the test that starts it.

mod leases;
mod objects;
mod responses;
mod serve;
mod services;
mod store;

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

/// The objects the fake serves, as its callers build them.
pub use k8s_openapi::api::{
    coordination::v1::Lease,
    discovery::v1::{Endpoint, EndpointSlice},
};
pub use k8s_openapi::api::{core::v1::Service, events::v1::Event};
pub use objects::{
    Condition, Kubeconfig, SERVICE_NAME_LABEL, endpoint, endpoint_slice, ingress_ip,
    load_balancer_service,
};
use serve::accept_loop;
use store::{Kind, Object, Shared, State};
pub use store::{LeaseRequest, Race, RequestLog, ServiceWrite};
use tokio::{
    net::TcpListener,
    sync::watch,
    task::{JoinHandle, JoinSet},
};

struct Listener {
    accept: JoinHandle<()>,
    connections: Arc<Mutex<JoinSet<()>>>,
}

/// The fake API server. Dropping it stops every listener.
pub struct FakeApiServer {
    shared: Arc<Shared>,
    listeners: Mutex<HashMap<SocketAddr, Listener>>,
    order: Mutex<Vec<SocketAddr>>,
}

impl FakeApiServer {
    /// Starts with one listener on `127.0.0.1`, an empty store at
    /// resourceVersion 1.
    pub async fn start() -> Self {
        Self::start_at("127.0.0.1:0".parse().unwrap()).await
    }

    /// As [`Self::start`], the first listener at `addr` (port 0: any).
    pub async fn start_at(addr: SocketAddr) -> Self {
        let server = Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State { rv: 1, compacted: 1, ..State::default() }),
                changed: watch::channel(()).0,
                watching: AtomicUsize::new(0),
                events: AtomicUsize::new(0),
                leases_stalled: watch::channel(false).0,
            }),
            listeners: Mutex::new(HashMap::new()),
            order: Mutex::new(Vec::new()),
        };
        server.listen(addr).await;
        server
    }

    /// Adds a listener (another apiserver on the same store) at `addr`
    /// (port 0: any); returns its address.
    pub async fn listen(&self, addr: SocketAddr) -> SocketAddr {
        // A listener just stopped at the same address is closed by its
        // aborted task a moment later: retry briefly on "in use".
        let mut tries = 0;
        let listener = loop {
            match TcpListener::bind(addr).await {
                Ok(listener) => break listener,
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("fake apiserver: bind {addr}: {e}"),
            }
        };
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(Mutex::new(JoinSet::new()));
        let accept =
            tokio::spawn(accept_loop(listener, addr, self.shared.clone(), connections.clone()));
        self.listeners.lock().unwrap().insert(addr, Listener { accept, connections });
        let mut order = self.order.lock().unwrap();
        if !order.contains(&addr) {
            order.push(addr);
        }
        addr
    }

    /// The first listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.order.lock().unwrap()[0]
    }

    /// `http://ADDR` of the first listener.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr())
    }

    /// Creates or replaces a slice (namespace `default` when unset);
    /// returns the new resourceVersion.
    pub fn apply(&self, mut slice: EndpointSlice) -> u64 {
        let mut state = self.shared.state.lock().unwrap();
        state.rv += 1;
        let rv = state.rv;
        let namespace =
            slice.metadata.namespace.get_or_insert_with(|| "default".to_owned()).clone();
        let name = slice.metadata.name.clone().expect("an EndpointSlice needs a name");
        slice.metadata.resource_version = Some(rv.to_string());
        let key = (namespace, name);
        let kind = if state.slices.contains_key(&key) { Kind::Modified } else { Kind::Added };
        state.slices.insert(key, slice.clone());
        state.record(kind, Object::Slice(slice));
        rv
    }

    /// Deletes a slice; returns the new resourceVersion (`None`: no such slice).
    pub fn delete(&self, namespace: &str, name: &str) -> Option<u64> {
        let mut state = self.shared.state.lock().unwrap();
        let mut slice = state.slices.remove(&(namespace.to_owned(), name.to_owned()))?;
        state.rv += 1;
        let rv = state.rv;
        slice.metadata.resource_version = Some(rv.to_string());
        state.record(Kind::Deleted, Object::Slice(slice));
        Some(rv)
    }

    /// Sends a BOOKMARK (the current resourceVersion) on every open watch.
    pub fn bookmark(&self) {
        self.shared.state.lock().unwrap().bookmarks += 1;
        self.shared.changed.send_replace(());
    }

    /// Compacts the history: the resourceVersion moves on (other objects
    /// changed in etcd), every watch from an older resourceVersion gets
    /// `410 Gone`, and open watches that had not caught up end with it (an
    /// `ERROR` event; with [`Self::set_gone_as_http`], the stream ends and
    /// the re-watch is answered 410). Only a relist recovers.
    pub fn expire(&self) {
        let mut state = self.shared.state.lock().unwrap();
        state.rv += 1;
        state.compacted = state.rv;
        state.history.clear();
        state.expiries += 1;
        drop(state);
        self.shared.changed.send_replace(());
    }

    /// The resourceVersion moves on with no change to a slice (other
    /// objects changed); returns it. A [`Self::bookmark`] then carries it.
    pub fn advance(&self) -> u64 {
        let mut state = self.shared.state.lock().unwrap();
        state.rv += 1;
        state.rv
    }

    /// Open watches deliver nothing until [`Self::resume_watches`] (a
    /// watch cache that fell behind): changes made meanwhile reach a
    /// watcher only by a relist once [`Self::expire`] compacts them away.
    pub fn pause_watches(&self) {
        self.shared.state.lock().unwrap().paused = true;
    }

    /// Open watches deliver again, everything they held back first.
    pub fn resume_watches(&self) {
        self.shared.state.lock().unwrap().paused = false;
        self.shared.changed.send_replace(());
    }

    /// `true`: 410 Gone is an HTTP status answering the watch request;
    /// `false` (default): an `ERROR` event in a 200 stream, as apiservers
    /// usually do.
    pub fn set_gone_as_http(&self, http: bool) {
        self.shared.state.lock().unwrap().gone_as_http = http;
    }

    /// Drops every open connection, mid-stream, on every listener; they
    /// keep accepting.
    pub fn cut_streams(&self) {
        for listener in self.listeners.lock().unwrap().values() {
            listener.connections.lock().unwrap().abort_all();
        }
    }

    /// Someone else (an admin's edit, another controller) writes the Lease
    /// `namespace/name` over to `holder`: an update at the next
    /// resourceVersion, which it returns. Panics if there is no such Lease.
    pub fn write_lease_holder(&self, namespace: &str, name: &str, holder: &str) -> u64 {
        let mut state = self.shared.state.lock().unwrap();
        state.rv += 1;
        let rv = state.rv;
        let key = (namespace.to_owned(), name.to_owned());
        let lease = state.leases.items.get_mut(&key).expect("no such Lease to write");
        lease.metadata.resource_version = Some(rv.to_string());
        lease.spec.get_or_insert_with(Default::default).holder_identity = Some(holder.to_owned());
        let lease = lease.clone();
        state.record(Kind::Modified, Object::Lease(lease));
        rv
    }

    /// Every apiserver stops answering Lease requests (an etcd that fell
    /// behind, an apiserver overloaded): each waits until
    /// [`Self::end_lease_stall`], then is answered `504 Timeout` with
    /// nothing written. Connections stay up.
    pub fn stall_leases(&self) {
        self.shared.leases_stalled.send_replace(true);
    }

    /// Lease requests are answered again.
    pub fn end_lease_stall(&self) {
        self.shared.leases_stalled.send_replace(false);
    }

    /// The apiserver at `addr` dies: its connections drop and connects are
    /// refused.
    pub fn stop_listener(&self, addr: SocketAddr) {
        if let Some(listener) = self.listeners.lock().unwrap().remove(&addr) {
            listener.accept.abort();
            listener.connections.lock().unwrap().abort_all();
        }
    }

    /// The apiserver at `addr` comes back on the same address.
    pub async fn restart_listener(&self, addr: SocketAddr) {
        self.stop_listener(addr);
        // The aborted accept task lets go of the socket when it is dropped.
        for _ in 0..50 {
            if TcpListener::bind(addr).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.listen(addr).await;
    }

    /// Every apiserver dies.
    pub fn stop(&self) {
        let addrs: Vec<SocketAddr> = self.listeners.lock().unwrap().keys().copied().collect();
        for addr in addrs {
            self.stop_listener(addr);
        }
    }

    /// Every apiserver that was started comes back.
    pub async fn restart(&self) {
        let addrs = self.order.lock().unwrap().clone();
        for addr in addrs {
            self.restart_listener(addr).await;
        }
    }

    /// The requests answered so far.
    pub fn requests(&self) -> Vec<RequestLog> {
        self.shared.state.lock().unwrap().requests.clone()
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.state.lock().unwrap().rv
    }

    /// The Lease `namespace/name`, as stored now.
    pub fn lease(&self, namespace: &str, name: &str) -> Option<Lease> {
        let state = self.shared.state.lock().unwrap();
        state.leases.items.get(&(namespace.to_owned(), name.to_owned())).cloned()
    }

    /// Creates or replaces a Service's spec and metadata (namespace
    /// `default` when unset; a new one gets a creationTimestamp of now);
    /// its status is kept, as the apiserver keeps it on an update. Returns
    /// the new resourceVersion.
    pub fn apply_service(&self, mut service: Service) -> u64 {
        let mut state = self.shared.state.lock().unwrap();
        state.rv += 1;
        let rv = state.rv;
        let namespace =
            service.metadata.namespace.get_or_insert_with(|| "default".to_owned()).clone();
        let name = service.metadata.name.clone().expect("a Service needs a name");
        let key = (namespace, name);
        let before = state.services.get(&key).cloned();
        if let Some(before) = &before {
            service.status.clone_from(&before.status);
            service.metadata.creation_timestamp.clone_from(&before.metadata.creation_timestamp);
        } else if service.metadata.creation_timestamp.is_none() {
            // Seconds, as the API keeps them (jiff's `now` needs its `std`
            // feature, which xtask's build of this crate goes without).
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
            let now = i64::try_from(now.as_secs()).unwrap();
            service.metadata.creation_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::from_second(now).unwrap(),
                ));
        }
        service.metadata.resource_version = Some(rv.to_string());
        let kind = if before.is_some() { Kind::Modified } else { Kind::Added };
        state.services.insert(key, service.clone());
        state.record(kind, Object::Service(Box::new(service)));
        rv
    }

    /// Deletes a Service; returns the new resourceVersion (`None`: no such
    /// Service).
    pub fn delete_service(&self, namespace: &str, name: &str) -> Option<u64> {
        let mut state = self.shared.state.lock().unwrap();
        let mut service = state.services.remove(&(namespace.to_owned(), name.to_owned()))?;
        state.rv += 1;
        service.metadata.resource_version = Some(state.rv.to_string());
        state.record(Kind::Deleted, Object::Service(Box::new(service)));
        Some(state.rv)
    }

    /// The Service `namespace/name`, as stored now.
    pub fn service(&self, namespace: &str, name: &str) -> Option<Service> {
        let state = self.shared.state.lock().unwrap();
        state.services.get(&(namespace.to_owned(), name.to_owned())).cloned()
    }

    /// Makes the next status write to the Service `name` meet `race`
    /// first, as if another client had just changed it.
    pub fn race_next_status_write(&self, name: &str, race: Race) {
        self.shared.state.lock().unwrap().races.insert(name.to_owned(), race);
    }

    /// The writes to Services' status answered so far.
    pub fn service_writes(&self) -> Vec<ServiceWrite> {
        self.shared.state.lock().unwrap().service_writes.clone()
    }

    /// The Events created so far, as last patched.
    pub fn events(&self) -> Vec<Event> {
        self.shared.state.lock().unwrap().events.clone()
    }

    /// The Lease requests answered so far.
    pub fn lease_requests(&self) -> Vec<LeaseRequest> {
        self.shared.state.lock().unwrap().leases.log.clone()
    }

    /// Watch streams open now (on every listener).
    pub fn watching(&self) -> usize {
        self.shared.watching.load(Ordering::Relaxed)
    }

    /// Watch events (ADDED, MODIFIED, DELETED) sent so far, on every
    /// stream: what the watchers cost the server beside their requests.
    pub fn watch_events(&self) -> usize {
        self.shared.events.load(Ordering::Relaxed)
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}
