//! Serving HTTP: list and watch requests answered from the store, watch
//! streams as chunked JSON lines, statuses such as 410 Gone.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use hyper::{
    Request, Response, StatusCode,
    body::{Bytes, Incoming},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use k8s_openapi::{
    List,
    api::{coordination::v1::Lease, core::v1::Service, discovery::v1::EndpointSlice},
    apimachinery::pkg::apis::meta::v1::{ListMeta, ObjectMeta, WatchEvent},
};
use tokio::{
    net::TcpListener,
    sync::{mpsc, watch},
    task::JoinSet,
};

use super::{
    leases,
    responses::{ChannelBody, json_response, status, status_response},
    services,
    store::{Kind, Object, RequestLog, Resource, Shared, WatchScope, in_scope},
};

/// Accepts connections on `listener` (the apiserver at `via`) and serves
/// each on a task of `connections`.
pub(super) async fn accept_loop(
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
                async move {
                    let path = request.uri().path();
                    let response = if path.starts_with(leases::PREFIX)
                        && !leases::is_collection_get(request.method(), path)
                    {
                        leases::handle(&shared, via, request).await
                    } else if services::answers(path) {
                        services::handle(&shared, via, request).await
                    } else {
                        handle(&shared, via, request)
                    };
                    Ok::<_, std::convert::Infallible>(response)
                }
            });
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
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
    let collection = |prefix: &str, suffix: &str| {
        path.strip_prefix(prefix).and_then(|rest| rest.strip_suffix(suffix)).map(str::to_owned)
    };
    let slices = collection("/apis/discovery.k8s.io/v1/namespaces/", "/endpointslices");
    let leases = collection(leases::PREFIX, "/leases");
    let services = collection(services::SERVICES, "/services")
        .or_else(|| (path == "/api/v1/services").then(String::new));
    let (resource, namespace) = match (slices, leases, services) {
        (Some(namespace), _, _) => (Resource::Slices, namespace),
        (_, Some(namespace), _) => (Resource::Leases, namespace),
        (_, _, Some(namespace)) => (Resource::Services, namespace),
        _ => {
            return status_response(
                404,
                "NotFound",
                &format!(
                    "the fake apiserver serves EndpointSlices, Leases, Services and Events only, \
                     not {path}"
                ),
            );
        }
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
        let metadata =
            ListMeta { resource_version: Some(state.rv.to_string()), ..ListMeta::default() };
        let body = match resource {
            Resource::Slices => {
                let items = state.slices.values();
                let items = items.filter(|s| in_scope(&s.metadata, &namespace, &wanted)).cloned();
                serde_json::to_vec(&List::<EndpointSlice> { items: items.collect(), metadata })
            }
            Resource::Leases => {
                let items = state.leases.items.values();
                let items = items.filter(|l| in_scope(&l.metadata, &namespace, &wanted)).cloned();
                serde_json::to_vec(&List::<Lease> { items: items.collect(), metadata })
            }
            Resource::Services => {
                let items = state.services.values();
                let items = items.filter(|s| in_scope(&s.metadata, &namespace, &wanted)).cloned();
                serde_json::to_vec(&List::<Service> { items: items.collect(), metadata })
            }
        };
        state.requests.push(log);
        return json_response(StatusCode::OK, body.unwrap());
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
        resource,
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
    resource: Resource,
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
            resource,
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
                    let object = &change.object;
                    if object.resource() == resource
                        && in_scope(object.metadata(), &namespace, &wanted)
                    {
                        out.push(event_line(change.kind, object));
                        shared.events.fetch_add(1, Ordering::Relaxed);
                    }
                }
                cursor = cursor.max(state.rv);
                if state.bookmarks != bookmarks {
                    bookmarks = state.bookmarks;
                    out.push(bookmark(resource, cursor));
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

/// One change as a watch event line.
fn event_line(kind: Kind, object: &Object) -> Bytes {
    fn event<T>(kind: Kind, object: T) -> WatchEvent<T> {
        match kind {
            Kind::Added => WatchEvent::Added(object),
            Kind::Modified => WatchEvent::Modified(object),
            Kind::Deleted => WatchEvent::Deleted(object),
        }
    }
    match object {
        Object::Slice(slice) => line(&event(kind, slice.clone())),
        Object::Lease(lease) => line(&event(kind, lease.clone())),
        Object::Service(service) => line(&event(kind, (**service).clone())),
    }
}

/// A BOOKMARK as apiservers send it: the object is of the watched kind
/// (with `apiVersion` and `kind`, which clients require) with only its
/// resourceVersion set. (`WatchEvent::Bookmark` of k8s-openapi leaves
/// `apiVersion` and `kind` out.)
fn bookmark(resource: Resource, rv: u64) -> Bytes {
    let metadata = ObjectMeta { resource_version: Some(rv.to_string()), ..ObjectMeta::default() };
    let object = match resource {
        Resource::Slices => serde_json::to_value(EndpointSlice { metadata, ..Default::default() }),
        Resource::Leases => serde_json::to_value(Lease { metadata, ..Default::default() }),
        Resource::Services => serde_json::to_value(Service { metadata, ..Default::default() }),
    };
    line(&serde_json::json!({ "type": "BOOKMARK", "object": object.unwrap() }))
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
