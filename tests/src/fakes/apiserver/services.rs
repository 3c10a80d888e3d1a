//! Services and Events, as the apiserver serves them to a LoadBalancer
//! controller: a Service is read (`GET .../services/{name}`) and its
//! `status` subresource patched, by JSON merge patch or server-side apply
//! (`PATCH .../services/{name}/status`); only `status` changes, whatever
//! else the patch says, and a patch naming a stale
//! `metadata.resourceVersion` gets `409 Conflict`. Lists and watches of
//! Services (`/api/v1/services`, cluster-wide, or per namespace) are
//! served with the slices' (`serve.rs`). Events (`events.k8s.io/v1`) are
//! created and patched (a series), and kept for the test to read.

use std::net::SocketAddr;

use http_body_util::BodyExt as _;
use hyper::{Method, Request, Response, StatusCode, body::Incoming};
use k8s_openapi::api::{core::v1::Service, events::v1::Event};

use super::{
    responses::{ChannelBody, json_response, status_response},
    store::{Kind, Object, Race, ServiceWrite, Shared},
};

/// Services of one namespace: `{SERVICES}{namespace}/services[/{name}[/status]]`.
pub(super) const SERVICES: &str = "/api/v1/namespaces/";
/// Events of one namespace: `{EVENTS}{namespace}/events[/{name}]`.
pub(super) const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/";

/// Whether this module answers the request: a Service by name or an
/// Event (a list or watch of Services is `serve.rs`'s).
pub(super) fn answers(path: &str) -> bool {
    path.starts_with(EVENTS)
        || path.strip_prefix(SERVICES).is_some_and(|rest| {
            let parts: Vec<&str> = rest.split('/').collect();
            parts.len() >= 3 && parts[1] == "services"
        })
}

/// Answers a request [`answers`] said is this module's.
pub(super) async fn handle(
    shared: &Shared,
    via: SocketAddr,
    request: Request<Incoming>,
) -> Response<ChannelBody> {
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    let content_type = request
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = match request.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) => return status_response(400, "BadRequest", &format!("reading the body: {e}")),
    };
    if let Some(rest) = path.strip_prefix(EVENTS) {
        return event(shared, &method, rest, &body);
    }
    let rest = path.strip_prefix(SERVICES).unwrap_or_default();
    let parts: Vec<&str> = rest.split('/').collect();
    match (&method, parts.as_slice()) {
        (&Method::GET, [namespace, "services", name]) => {
            let state = shared.state.lock().unwrap();
            match state.services.get(&((*namespace).to_owned(), (*name).to_owned())) {
                Some(service) => {
                    json_response(StatusCode::OK, serde_json::to_vec(service).unwrap())
                }
                None => not_found(name),
            }
        }
        (&Method::PATCH, [namespace, "services", name, "status"]) => {
            patch_status(shared, via, namespace, name, &content_type, &body)
        }
        _ => status_response(
            405,
            "MethodNotAllowed",
            &format!("the fake apiserver does not answer {method} {path}"),
        ),
    }
}

fn not_found(name: &str) -> Response<ChannelBody> {
    status_response(404, "NotFound", &format!("services {name:?} not found"))
}

/// `PATCH .../services/{name}/status`: a merge patch
/// (`application/merge-patch+json`) or an apply patch
/// (`application/apply-patch+yaml`, sent as JSON), applied to the stored
/// Service; only its status is kept from the result.
fn patch_status(
    shared: &Shared,
    via: SocketAddr,
    namespace: &str,
    name: &str,
    content_type: &str,
    body: &[u8],
) -> Response<ChannelBody> {
    let patch: serde_json::Value = match serde_json::from_slice(body) {
        Ok(patch) => patch,
        Err(e) => {
            return status_response(400, "BadRequest", &format!("the patch is not JSON: {e}"));
        }
    };
    let kind = if content_type.starts_with("application/merge-patch+json") {
        "merge"
    } else if content_type.starts_with("application/apply-patch+yaml") {
        "apply"
    } else {
        return status_response(
            415,
            "UnsupportedMediaType",
            &format!("the fake takes merge and apply patches, not {content_type:?}"),
        );
    };
    let mut state = shared.state.lock().unwrap();
    let key = (namespace.to_owned(), name.to_owned());
    match state.races.remove(name) {
        Some(Race::Edited) => {
            if let Some(mut edited) = state.services.get(&key).cloned() {
                state.rv += 1;
                edited.metadata.resource_version = Some(state.rv.to_string());
                let labels = edited.metadata.labels.get_or_insert_with(Default::default);
                labels.insert("edited-by".into(), "another-client".into());
                state.services.insert(key.clone(), edited.clone());
                state.record(Kind::Modified, Object::Service(Box::new(edited)));
            }
        }
        Some(Race::Deleted) => {
            if let Some(mut deleted) = state.services.remove(&key) {
                state.rv += 1;
                deleted.metadata.resource_version = Some(state.rv.to_string());
                state.record(Kind::Deleted, Object::Service(Box::new(deleted)));
            }
        }
        None => {}
    }
    let Some(stored) = state.services.get(&key).cloned() else {
        state.service_writes.push(ServiceWrite::new(via, name, kind, 404));
        return not_found(name);
    };
    let current = stored.metadata.resource_version.clone().unwrap_or_default();
    if let Some(asked) = patch.pointer("/metadata/resourceVersion").and_then(|v| v.as_str())
        && asked != current
    {
        state.service_writes.push(ServiceWrite::new(via, name, kind, 409));
        return status_response(
            409,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on services {name:?}: the object has been \
                 modified; please apply your changes to the latest version and try again"
            ),
        );
    }
    let mut merged = serde_json::to_value(&stored).unwrap();
    json_patch::merge(&mut merged, &patch);
    let patched: Service = match serde_json::from_value(merged) {
        Ok(service) => service,
        Err(e) => {
            state.service_writes.push(ServiceWrite::new(via, name, kind, 422));
            return status_response(
                422,
                "Invalid",
                &format!("the patched Service is invalid: {e}"),
            );
        }
    };
    let mut service = stored;
    service.status = patched.status;
    state.rv += 1;
    service.metadata.resource_version = Some(state.rv.to_string());
    state.services.insert(key, service.clone());
    state.record(Kind::Modified, Object::Service(Box::new(service.clone())));
    state.service_writes.push(ServiceWrite::new(via, name, kind, 200));
    json_response(StatusCode::OK, serde_json::to_vec(&service).unwrap())
}

/// `POST {EVENTS}{namespace}/events` and `PATCH .../events/{name}`.
fn event(shared: &Shared, method: &Method, rest: &str, body: &[u8]) -> Response<ChannelBody> {
    let parts: Vec<&str> = rest.split('/').collect();
    let mut state = shared.state.lock().unwrap();
    match (method, parts.as_slice()) {
        (&Method::POST, [namespace, "events"]) => match serde_json::from_slice::<Event>(body) {
            Ok(mut event) => {
                event.metadata.namespace = Some((*namespace).to_owned());
                state.rv += 1;
                event.metadata.resource_version = Some(state.rv.to_string());
                state.events.push(event.clone());
                json_response(StatusCode::CREATED, serde_json::to_vec(&event).unwrap())
            }
            Err(e) => status_response(400, "BadRequest", &format!("not an Event: {e}")),
        },
        (&Method::PATCH, [namespace, "events", name]) => {
            let found = state.events.iter_mut().find(|e| {
                e.metadata.namespace.as_deref() == Some(namespace)
                    && e.metadata.name.as_deref() == Some(name)
            });
            let Some(event) = found else {
                return status_response(404, "NotFound", &format!("events {name:?} not found"));
            };
            let mut value = serde_json::to_value(&*event).unwrap();
            let patch: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            json_patch::merge(&mut value, &patch);
            match serde_json::from_value(value) {
                Ok(patched) => {
                    *event = patched;
                    json_response(StatusCode::OK, serde_json::to_vec(&*event).unwrap())
                }
                Err(e) => status_response(422, "Invalid", &format!("the patched Event: {e}")),
            }
        }
        _ => status_response(405, "MethodNotAllowed", &format!("{method} {EVENTS}{rest}")),
    }
}
