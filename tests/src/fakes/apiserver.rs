//! A fake Kubernetes API server for discovery tests: EndpointSlices only,
//! over plain HTTP/1.1 on loopback, speaking the real list and watch
//! protocol, with JSON built from `k8s-openapi` types.
//!
//! - `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=k=v`
//!   lists (an `EndpointSliceList` with `metadata.resourceVersion`);
//! - the same with `watch=true&resourceVersion=N` streams, chunked, one
//!   `{"type":"ADDED|MODIFIED|DELETED|BOOKMARK|ERROR","object":...}` per line:
//!   first every change after `N`, then changes as the test makes them.
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
//! etcd). [`FakeApiServer::requests`] says who asked what.
//!
//! It runs on the tokio runtime of the test that starts it.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use hyper::{
    Request, Response, StatusCode,
    body::{Bytes, Frame, Incoming},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::TokioIo;
/// The objects the fake serves, as its callers build them.
pub use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use k8s_openapi::{
    List,
    api::discovery::v1::{EndpointConditions, EndpointPort},
    apimachinery::pkg::apis::meta::v1::{ListMeta, ObjectMeta, Status, WatchEvent},
};
use tokio::{
    net::TcpListener,
    sync::{mpsc, watch},
    task::{JoinHandle, JoinSet},
};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

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
enum Kind {
    Added,
    Modified,
    Deleted,
}

struct Change {
    rv: u64,
    kind: Kind,
    slice: EndpointSlice,
}

#[derive(Default)]
struct State {
    rv: u64,
    slices: BTreeMap<(String, String), EndpointSlice>,
    /// Changes after `compacted`.
    history: Vec<Change>,
    /// Watches from a resourceVersion older than this get 410 Gone.
    compacted: u64,
    gone_as_http: bool,
    /// Bumped by `bookmark()`.
    bookmarks: u64,
    /// Bumped by `expire()`: open streams end with 410.
    expiries: u64,
    /// Open streams hold their events back (a slow watch cache).
    paused: bool,
    requests: Vec<RequestLog>,
    /// The open watch streams: what each watches, and how to wake it when
    /// a slice in its scope changes.
    watches: Vec<WatchScope>,
}

/// What one open watch stream watches. A change to a slice wakes only
/// the streams whose scope it is in (with a thousand watches, waking every
/// one on every change would make the fake, not the client, the
/// bottleneck).
struct WatchScope {
    namespace: String,
    wanted: Vec<(String, String)>,
    wake: watch::Sender<()>,
}

impl State {
    /// Wakes the watch streams whose scope `slice` is in; forgets closed ones.
    fn wake_watchers_of(&mut self, slice: &EndpointSlice) {
        self.watches.retain(|w| !w.wake.is_closed());
        for w in &self.watches {
            if in_scope(slice, &w.namespace, &w.wanted) {
                w.wake.send_replace(());
            }
        }
    }
}

struct Shared {
    state: Mutex<State>,
    /// Pinged on every bookmark, expiry or resume: what concerns every
    /// open watch (a change to a slice wakes only the watches of its scope).
    changed: watch::Sender<()>,
    /// Watch streams open now.
    watching: AtomicUsize,
}

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
        state.wake_watchers_of(&slice);
        state.history.push(Change { rv, kind, slice });
        rv
    }

    /// Deletes a slice; returns the new resourceVersion (`None`: no such slice).
    pub fn delete(&self, namespace: &str, name: &str) -> Option<u64> {
        let mut state = self.shared.state.lock().unwrap();
        let mut slice = state.slices.remove(&(namespace.to_owned(), name.to_owned()))?;
        state.rv += 1;
        let rv = state.rv;
        slice.metadata.resource_version = Some(rv.to_string());
        state.wake_watchers_of(&slice);
        state.history.push(Change { rv, kind: Kind::Deleted, slice });
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

    /// Watch streams open now (on every listener).
    pub fn watching(&self) -> usize {
        self.shared.watching.load(Ordering::Relaxed)
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn accept_loop(
    listener: TcpListener,
    via: SocketAddr,
    shared: Arc<Shared>,
    connections: Arc<Mutex<JoinSet<()>>>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let shared = shared.clone();
        let mut set = connections.lock().unwrap();
        while set.try_join_next().is_some() {}
        set.spawn(async move {
            let service = service_fn(move |request| {
                let shared = shared.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(&shared, via, request)) }
            });
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// A response body: chunks from a channel, ended when the sender is dropped.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response<ChannelBody> {
    let (tx, rx) = mpsc::channel(1);
    tx.try_send(Bytes::from(body)).unwrap();
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(ChannelBody(rx))
        .unwrap()
}

fn status(code: u16, reason: &str, message: &str) -> Status {
    Status {
        code: Some(i32::from(code)),
        message: Some(message.to_owned()),
        reason: Some(reason.to_owned()),
        status: Some("Failure".to_owned()),
        metadata: ListMeta::default(),
        ..Status::default()
    }
}

fn status_response(code: u16, reason: &str, message: &str) -> Response<ChannelBody> {
    let mut body = serde_json::to_value(status(code, reason, message)).unwrap();
    body["kind"] = "Status".into();
    body["apiVersion"] = "v1".into();
    json_response(StatusCode::from_u16(code).unwrap(), serde_json::to_vec(&body).unwrap())
}

fn gone_message(rv: u64) -> String {
    format!("too old resource version: {rv}")
}

fn handle(
    shared: &Arc<Shared>,
    via: SocketAddr,
    request: Request<Incoming>,
) -> Response<ChannelBody> {
    let path = request.uri().path();
    let query = parse_query(request.uri().query().unwrap_or(""));
    let Some(namespace) = path
        .strip_prefix("/apis/discovery.k8s.io/v1/namespaces/")
        .and_then(|rest| rest.strip_suffix("/endpointslices"))
        .map(str::to_owned)
    else {
        return status_response(
            404,
            "NotFound",
            &format!("the fake apiserver serves EndpointSlices only, not {path}"),
        );
    };
    let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let selector = query.get("labelSelector").cloned();
    let wanted = parse_selector(selector.as_deref().unwrap_or(""));
    let resource_version = query.get("resourceVersion").cloned();
    let mut state = shared.state.lock().unwrap();
    let mut log = RequestLog {
        via,
        watch,
        resource_version: resource_version.clone(),
        label_selector: selector,
        gone: false,
    };
    if !watch {
        let items: Vec<EndpointSlice> =
            state.slices.values().filter(|s| in_scope(s, &namespace, &wanted)).cloned().collect();
        let list = List {
            items,
            metadata: ListMeta {
                resource_version: Some(state.rv.to_string()),
                ..ListMeta::default()
            },
        };
        state.requests.push(log);
        return json_response(StatusCode::OK, serde_json::to_vec(&list).unwrap());
    }
    // A watch. "0" or none: from now.
    let from = match resource_version.as_deref() {
        None | Some("" | "0") => state.rv,
        Some(rv) => match rv.parse::<u64>() {
            Ok(rv) => rv,
            Err(_) => {
                state.requests.push(log);
                return status_response(
                    400,
                    "BadRequest",
                    &format!("invalid resourceVersion {rv:?}"),
                );
            }
        },
    };
    let gone = from < state.compacted;
    log.gone = gone;
    state.requests.push(log);
    if gone && state.gone_as_http {
        return status_response(410, "Expired", &gone_message(from));
    }
    let timeout = query.get("timeoutSeconds").and_then(|t| t.parse::<u64>().ok()).unwrap_or(1800);
    let (tx, rx) = mpsc::channel(64);
    let expiries = state.expiries;
    drop(state);
    tokio::spawn(stream_watch(
        shared.clone(),
        namespace,
        wanted,
        from,
        gone,
        expiries,
        Duration::from_secs(timeout),
        tx,
    ));
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(ChannelBody(rx))
        .unwrap()
}

fn line<T: serde::Serialize>(event: &T) -> Bytes {
    let mut bytes = serde_json::to_vec(event).unwrap();
    bytes.push(b'\n');
    Bytes::from(bytes)
}

#[expect(clippy::too_many_arguments, reason = "one watch's whole context")]
async fn stream_watch(
    shared: Arc<Shared>,
    namespace: String,
    wanted: Vec<(String, String)>,
    mut cursor: u64,
    gone: bool,
    mut expiries: u64,
    timeout: Duration,
    tx: mpsc::Sender<Bytes>,
) {
    if gone {
        let _ = tx
            .send(line(&WatchEvent::<EndpointSlice>::ErrorStatus(status(
                410,
                "Expired",
                &gone_message(cursor),
            ))))
            .await;
        return;
    }
    let mut changed = shared.changed.subscribe();
    let (wake, mut woken) = watch::channel(());
    let mut bookmarks = {
        let mut state = shared.state.lock().unwrap();
        state.watches.push(WatchScope {
            namespace: namespace.clone(),
            wanted: wanted.clone(),
            wake,
        });
        state.bookmarks
    };
    let _open = Open::count(&shared.watching);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let mut out = Vec::new();
        let mut end = false;
        {
            let state = shared.state.lock().unwrap();
            if state.expiries != expiries {
                expiries = state.expiries;
                if cursor < state.compacted {
                    // As an ERROR event; or, when 410 is an HTTP status,
                    // the stream ends and the re-watch gets it.
                    if !state.gone_as_http {
                        out.push(line(&WatchEvent::<EndpointSlice>::ErrorStatus(status(
                            410,
                            "Expired",
                            &gone_message(cursor),
                        ))));
                    }
                    end = true;
                }
            }
            if !end && !state.paused {
                // The history is in resourceVersion order.
                let first = state.history.partition_point(|c| c.rv <= cursor);
                for change in &state.history[first..] {
                    if in_scope(&change.slice, &namespace, &wanted) {
                        let slice = change.slice.clone();
                        out.push(line(&match change.kind {
                            Kind::Added => WatchEvent::Added(slice),
                            Kind::Modified => WatchEvent::Modified(slice),
                            Kind::Deleted => WatchEvent::Deleted(slice),
                        }));
                    }
                }
                cursor = cursor.max(state.rv);
                if state.bookmarks != bookmarks {
                    bookmarks = state.bookmarks;
                    out.push(bookmark(cursor));
                }
            }
        }
        for chunk in out {
            if tx.send(chunk).await.is_err() {
                return;
            }
        }
        if end {
            return;
        }
        tokio::select! {
            r = changed.changed() => if r.is_err() { return },
            r = woken.changed() => if r.is_err() { return },
            () = tx.closed() => return,
            // The apiserver's timeoutSeconds: the stream ends cleanly.
            () = tokio::time::sleep_until(deadline) => return,
        }
    }
}

/// One open watch stream, counted in [`FakeApiServer::watching`] while
/// it lives.
struct Open<'a>(&'a AtomicUsize);

impl<'a> Open<'a> {
    fn count(watching: &'a AtomicUsize) -> Self {
        watching.fetch_add(1, Ordering::Relaxed);
        Self(watching)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A BOOKMARK as apiservers send it: the object is of the watched kind
/// (with `apiVersion` and `kind`, which clients require) with only its
/// resourceVersion set. (`WatchEvent::Bookmark` of k8s-openapi leaves
/// `apiVersion` and `kind` out.)
fn bookmark(rv: u64) -> Bytes {
    let object = EndpointSlice {
        metadata: ObjectMeta { resource_version: Some(rv.to_string()), ..ObjectMeta::default() },
        ..EndpointSlice::default()
    };
    line(&serde_json::json!({ "type": "BOOKMARK", "object": object }))
}

fn in_scope(slice: &EndpointSlice, namespace: &str, wanted: &[(String, String)]) -> bool {
    slice.metadata.namespace.as_deref() == Some(namespace)
        && wanted
            .iter()
            .all(|(k, v)| slice.metadata.labels.as_ref().and_then(|l| l.get(k)) == Some(v))
}

/// `k=v,k2==v2`: equality requirements only.
fn parse_selector(selector: &str) -> Vec<(String, String)> {
    selector
        .split(',')
        .filter(|s| !s.is_empty())
        .filter_map(|req| {
            let (k, v) = req.split_once("==").or_else(|| req.split_once('='))?;
            Some((k.trim().to_owned(), v.trim().to_owned()))
        })
        .collect()
}

fn parse_query(query: &str) -> HashMap<String, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A kubeconfig file for a server URL, removed on drop.
pub struct Kubeconfig {
    path: PathBuf,
}

impl Kubeconfig {
    /// Writes a kubeconfig whose one cluster is `server`
    /// (e.g. `http://127.0.0.1:PORT`), with namespace `default`.
    pub fn write(server: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "lb-test-kubeconfig-{}-{}.yaml",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {server}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
        );
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        Self { path }
    }

    /// The kubeconfig file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Kubeconfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// An endpoint's conditions, as the EndpointSlice controller sets them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    /// ready, serving, not terminating.
    Ready,
    /// Not ready (starting, failing its readiness probe), not terminating.
    NotReady,
    /// Terminating but still serving (graceful shutdown).
    TerminatingServing,
    /// Terminating and no longer serving.
    TerminatingNotServing,
    /// No conditions at all (nil: ready).
    Unset,
}

/// An endpoint at `ip` on `node` with `condition`.
pub fn endpoint(ip: &str, node: &str, condition: Condition) -> Endpoint {
    let conditions = match condition {
        Condition::Ready => Some((true, true, false)),
        Condition::NotReady => Some((false, false, false)),
        Condition::TerminatingServing => Some((false, true, true)),
        Condition::TerminatingNotServing => Some((false, false, true)),
        Condition::Unset => None,
    }
    .map(|(ready, serving, terminating)| EndpointConditions {
        ready: Some(ready),
        serving: Some(serving),
        terminating: Some(terminating),
    });
    Endpoint {
        addresses: vec![ip.to_owned()],
        conditions,
        node_name: Some(node.to_owned()),
        ..Endpoint::default()
    }
}

/// An EndpointSlice `name` of the Service `service` in `default`, of
/// `address_type` (`IPv4`, `IPv6`), with `ports` (name, number).
pub fn endpoint_slice(
    name: &str,
    service: &str,
    address_type: &str,
    ports: &[(&str, u16)],
    endpoints: Vec<Endpoint>,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some("default".to_owned()),
            labels: Some(BTreeMap::from([(SERVICE_NAME_LABEL.to_owned(), service.to_owned())])),
            ..ObjectMeta::default()
        },
        address_type: address_type.to_owned(),
        ports: Some(
            ports
                .iter()
                .map(|(name, port)| EndpointPort {
                    name: Some((*name).to_owned()),
                    port: Some(i32::from(*port)),
                    protocol: Some("TCP".to_owned()),
                    ..EndpointPort::default()
                })
                .collect(),
        ),
        endpoints,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_and_selectors_decode() {
        let q = parse_query(
            "&watch=true&labelSelector=kubernetes.io%2Fservice-name%3Dweb&resourceVersion=5",
        );
        assert_eq!(q["watch"], "true");
        assert_eq!(q["labelSelector"], "kubernetes.io/service-name=web");
        assert_eq!(
            parse_selector(&q["labelSelector"]),
            [("kubernetes.io/service-name".to_owned(), "web".to_owned())]
        );
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("%41%42"), "AB");
    }
}
