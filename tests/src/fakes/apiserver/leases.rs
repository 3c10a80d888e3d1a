//! `coordination.k8s.io/v1` Leases, as the apiserver serves them to an
//! election: get, create (`409 AlreadyExists`), update over a
//! resourceVersion (`409 Conflict` when it is stale, `404` when there is
//! no such Lease) and delete. Each write takes the next resourceVersion of
//! the store the slices share, and is in the history watches stream from
//! (lists and watches of Leases are served with the slices', `serve.rs`).
//! While stalled, a request waits for the stall's end and is answered
//! `504 Timeout`, nothing written.

use std::net::SocketAddr;

use http_body_util::BodyExt as _;
use hyper::{Method, Request, Response, StatusCode, body::Incoming};
use k8s_openapi::api::coordination::v1::Lease;

use super::{
    responses::{ChannelBody, json_response, status_response},
    store::{Kind, LeaseRequest, Object, Shared},
};

/// The path prefix of Leases: `{PREFIX}{namespace}/leases[/{name}]`.
pub(super) const PREFIX: &str = "/apis/coordination.k8s.io/v1/namespaces/";

/// Whether a request is a list or watch of Leases (a GET of the
/// collection), which `serve.rs` answers as it does slices'.
pub(super) fn is_collection_get(method: &Method, path: &str) -> bool {
    method == Method::GET && path.strip_prefix(PREFIX).is_some_and(|rest| rest.ends_with("/leases"))
}

/// Answers a request under [`PREFIX`], at the listener `via`.
pub(super) async fn handle(
    shared: &Shared,
    via: SocketAddr,
    request: Request<Incoming>,
) -> Response<ChannelBody> {
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    let rest = path.strip_prefix(PREFIX).unwrap_or_default();
    let mut parts = rest.splitn(3, '/');
    let (Some(namespace), Some("leases")) = (parts.next(), parts.next()) else {
        return status_response(404, "NotFound", &format!("no such path {path}"));
    };
    let namespace = namespace.to_owned();
    let name = parts.next().map(str::to_owned);
    let body = match request.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) => return status_response(400, "BadRequest", &format!("reading the body: {e}")),
    };
    let mut stalled = shared.leases_stalled.subscribe();
    if *stalled.borrow_and_update() {
        let _ = stalled.wait_for(|stalled| !stalled).await;
        shared.state.lock().unwrap().leases.log.push(LeaseRequest {
            method: method.to_string(),
            name: name.unwrap_or_default(),
            status: StatusCode::GATEWAY_TIMEOUT.as_u16(),
            via,
        });
        return status_response(
            504,
            "Timeout",
            "the server was unable to return a response in the time allotted",
        );
    }
    let parsed = || serde_json::from_slice::<Lease>(&body);
    let mut state = shared.state.lock().unwrap();
    let response = match (&method, name) {
        (&Method::GET, Some(name)) => {
            match state.leases.items.get(&(namespace.clone(), name.clone())) {
                Some(lease) => (StatusCode::OK, serde_json::to_vec(lease).unwrap(), name),
                None => not_found(&name),
            }
        }
        (&Method::POST, None) => match parsed() {
            Err(e) => bad(&e.to_string()),
            Ok(mut lease) => {
                let name = lease.metadata.name.clone().unwrap_or_default();
                let key = (namespace.clone(), name.clone());
                if state.leases.items.contains_key(&key) {
                    conflict("AlreadyExists", &format!("leases {name:?} already exists"), name)
                } else {
                    state.rv += 1;
                    lease.metadata.namespace = Some(namespace.clone());
                    lease.metadata.resource_version = Some(state.rv.to_string());
                    state.leases.items.insert(key, lease.clone());
                    state.record(Kind::Added, Object::Lease(lease.clone()));
                    (StatusCode::CREATED, serde_json::to_vec(&lease).unwrap(), name)
                }
            }
        },
        (&Method::PUT, Some(name)) => match parsed() {
            Err(e) => bad(&e.to_string()),
            Ok(mut lease) => {
                let key = (namespace.clone(), name.clone());
                let current =
                    state.leases.items.get(&key).and_then(|l| l.metadata.resource_version.clone());
                match current {
                    None => not_found(&name),
                    Some(rv) if lease.metadata.resource_version.as_deref() != Some(rv.as_str()) => {
                        conflict(
                            "Conflict",
                            &format!(
                                "Operation cannot be fulfilled on leases.coordination.k8s.io {name:?}: \
                                 the object has been modified; please apply your changes to the latest \
                                 version and try again"
                            ),
                            name,
                        )
                    }
                    Some(_) => {
                        state.rv += 1;
                        lease.metadata.resource_version = Some(state.rv.to_string());
                        lease.metadata.namespace = Some(namespace.clone());
                        state.leases.items.insert(key, lease.clone());
                        state.record(Kind::Modified, Object::Lease(lease.clone()));
                        (StatusCode::OK, serde_json::to_vec(&lease).unwrap(), name)
                    }
                }
            }
        },
        (&Method::DELETE, Some(name)) => {
            match state.leases.items.remove(&(namespace.clone(), name.clone())) {
                Some(mut lease) => {
                    state.rv += 1;
                    lease.metadata.resource_version = Some(state.rv.to_string());
                    state.record(Kind::Deleted, Object::Lease(lease.clone()));
                    (StatusCode::OK, serde_json::to_vec(&lease).unwrap(), name)
                }
                None => not_found(&name),
            }
        }
        _ => (StatusCode::METHOD_NOT_ALLOWED, b"{}".to_vec(), format!("{method} {path}")),
    };
    let (status, body, name) = response;
    state.leases.log.push(LeaseRequest {
        method: method.to_string(),
        name,
        status: status.as_u16(),
        via,
    });
    drop(state);
    if status.is_success() {
        json_response(status, body)
    } else {
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        status_response(
            status.as_u16(),
            value["reason"].as_str().unwrap_or("Error"),
            value["message"].as_str().unwrap_or(""),
        )
    }
}

type Answer = (StatusCode, Vec<u8>, String);

fn failure(code: StatusCode, reason: &str, message: &str, name: String) -> Answer {
    let body = serde_json::json!({ "reason": reason, "message": message });
    (code, serde_json::to_vec(&body).unwrap(), name)
}

fn not_found(name: &str) -> Answer {
    failure(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("leases.coordination.k8s.io {name:?} not found"),
        name.to_owned(),
    )
}

fn conflict(reason: &str, message: &str, name: String) -> Answer {
    failure(StatusCode::CONFLICT, reason, message, name)
}

fn bad(message: &str) -> Answer {
    failure(StatusCode::BAD_REQUEST, "BadRequest", message, String::new())
}
