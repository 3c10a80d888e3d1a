//! `healthCheckNodePort`, answered as kube-proxy answers it: for each
//! LoadBalancer Service with `externalTrafficPolicy: Local`, an HTTP
//! server on the Service's port on every address of the node says how
//! many of the Service's endpoints this node serves from: `200` with
//! `localEndpoints` > 0, `503` with none, whatever the request's path or
//! method, so that a balancer in front of the nodes sends only to those
//! that can serve it. The answers come from the daemon ([`HealthPorts::set`]),
//! which counts the ready local endpoints; the listeners only read them.
//! Bounded as the metrics endpoint is (`metrics::serve::Limits`):
//! connections at once, the time to send a request, a connection's life.

use std::{
    collections::{BTreeMap, HashMap},
    convert::Infallible,
    net::{Ipv6Addr, SocketAddr},
    sync::Arc,
};

use http_body_util::Full;
use hyper::{Request, Response, body::Bytes, server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    sync::{Semaphore, watch},
    task::JoinHandle,
};
use tracing::{debug, info, warn};

use super::allocate::ServiceRef;
use crate::metrics::Limits;

/// What one port answers: the Service and its endpoints on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    /// The Service whose `healthCheckNodePort` it is.
    pub service: ServiceRef,
    /// Its ready endpoints this node serves from.
    pub local_endpoints: usize,
}

/// The listeners, one per port, and the answers they give.
#[derive(Default)]
pub struct HealthPorts {
    answers: watch::Sender<BTreeMap<u16, Health>>,
    listeners: HashMap<u16, JoinHandle<()>>,
    /// Ports that could not be bound, and why: told once, tried again at
    /// each call.
    unbound: HashMap<u16, String>,
    limits: Limits,
}

impl HealthPorts {
    /// Answers `wanted` from now on: listens on the ports new to it,
    /// stops listening on those it no longer has. A port that cannot be
    /// bound (another program has it) is logged and tried again at the
    /// next call.
    pub fn set(&mut self, wanted: BTreeMap<u16, Health>) {
        self.listeners.retain(|port, task| {
            let keep = wanted.contains_key(port) && !task.is_finished();
            if !keep {
                task.abort();
                info!(port, "healthCheckNodePort no longer answered");
            }
            keep
        });
        for &port in wanted.keys() {
            if self.listeners.contains_key(&port) {
                continue;
            }
            match bind(port) {
                Ok(listener) => {
                    info!(port, "answering a healthCheckNodePort");
                    self.unbound.remove(&port);
                    let answers = self.answers.subscribe();
                    let task = tokio::spawn(serve(listener, port, answers, self.limits));
                    self.listeners.insert(port, task);
                }
                Err(e) => {
                    let why = e.to_string();
                    if self.unbound.get(&port) != Some(&why) {
                        warn!(
                            port,
                            "healthCheckNodePort: binding [::]:{port}: {why}; trying again each second"
                        );
                    }
                    self.unbound.insert(port, why);
                }
            }
        }
        self.unbound.retain(|port, _| wanted.contains_key(port));
        self.answers.send_if_modified(|now| std::mem::replace(now, wanted.clone()) != wanted);
    }
}

impl Drop for HealthPorts {
    fn drop(&mut self) {
        for task in self.listeners.values() {
            task.abort();
        }
    }
}

/// A listener on every address of the node, both families where the node
/// has IPv6 (`[::]` takes IPv4 too, as mapped addresses), else IPv4's.
fn bind(port: u16) -> std::io::Result<tokio::net::TcpListener> {
    let any6 = SocketAddr::from((Ipv6Addr::UNSPECIFIED, port));
    let listener = std::net::TcpListener::bind(any6)
        .or_else(|_| std::net::TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], port))))?;
    listener.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(listener)
}

async fn serve(
    listener: tokio::net::TcpListener,
    port: u16,
    answers: watch::Receiver<BTreeMap<u16, Health>>,
    limits: Limits,
) {
    let slots = Arc::new(Semaphore::new(limits.connections));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                debug!(port, "healthCheckNodePort accept: {e}");
                // E.g. out of file descriptors: don't spin.
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        // Over the limit: closed at once (dropped), holding nothing.
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else { continue };
        let answers = answers.clone();
        tokio::spawn(async move {
            let service = service_fn(move |_: Request<hyper::body::Incoming>| {
                let health = answers.borrow().get(&port).cloned();
                async move { Ok::<_, Infallible>(answer(health.as_ref())) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(stream), service);
            if let Ok(Err(e)) = tokio::time::timeout(limits.lifetime, connection).await {
                debug!(port, "healthCheckNodePort connection: {e}");
            }
            drop(slot);
        });
    }
}

/// kube-proxy's answer: the Service, its local endpoints, and `200` only
/// if it has some (no answer known yet: `503`, none).
fn answer(health: Option<&Health>) -> Response<Full<Bytes>> {
    let (status, body) = match health {
        Some(h) => (
            if h.local_endpoints > 0 { 200 } else { 503 },
            serde_json::json!({
                "service": { "namespace": h.service.namespace, "name": h.service.name },
                "localEndpoints": h.local_endpoints,
                "serviceProxyHealthy": true,
            }),
        ),
        None => (503, serde_json::json!({ "localEndpoints": 0, "serviceProxyHealthy": true })),
    };
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("x-content-type-options", "nosniff")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(n: usize) -> Health {
        Health {
            service: ServiceRef { namespace: "shop".into(), name: "web".into() },
            local_endpoints: n,
        }
    }

    #[test]
    fn it_answers_as_kube_proxy_does() {
        let ok = answer(Some(&health(2)));
        assert_eq!(ok.status(), 200);
        assert_eq!(ok.headers()["content-type"], "application/json");
        let none = answer(Some(&health(0)));
        assert_eq!(none.status(), 503);
        assert_eq!(answer(None).status(), 503);
    }

    /// An abuser's connections, opened and left silent, hold at most
    /// `Limits::connections` slots, each for at most the header timeout:
    /// past the limit a connection is closed at once, and once theirs
    /// time out the port answers again.
    #[tokio::test]
    async fn silent_connections_cannot_hold_the_port() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = free.local_addr().unwrap().port();
        drop(free);
        let limits = Limits {
            connections: 4,
            header_timeout: std::time::Duration::from_millis(300),
            lifetime: std::time::Duration::from_secs(5),
        };
        let mut ports = HealthPorts::default();
        ports.limits = limits;
        ports.set(BTreeMap::from([(port, health(1))]));
        let mut silent = Vec::new();
        for _ in 0..limits.connections {
            silent.push(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let ask = || async {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.ok()?;
            let mut text = String::new();
            s.read_to_string(&mut text).await.ok()?;
            (!text.is_empty()).then_some(text)
        };
        assert_eq!(ask().await, None, "answered past the limit");
        // Their header timeout runs out: the slots are free again.
        tokio::time::sleep(limits.header_timeout * 2).await;
        let text = ask().await.expect("no answer once the silent ones timed out");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        drop(silent);
    }

    #[tokio::test]
    async fn a_port_answers_its_service_and_stops_when_it_goes() {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = free.local_addr().unwrap().port();
        drop(free);
        let mut ports = HealthPorts::default();
        ports.set(BTreeMap::from([(port, health(0))]));
        let get = |port: u16| async move {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .ok()?;
            let mut text = String::new();
            s.read_to_string(&mut text).await.ok()?;
            Some(text)
        };
        let text = get(port).await.expect("an answer");
        assert!(text.starts_with("HTTP/1.1 503"), "{text}");
        assert!(text.contains(r#""localEndpoints":0"#), "{text}");
        ports.set(BTreeMap::from([(port, health(1))]));
        let text = get(port).await.expect("an answer");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(
            text.contains(r#""namespace":"shop""#) && text.contains(r#""name":"web""#),
            "{text}"
        );
        ports.set(BTreeMap::new());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(get(port).await.is_none(), "still answered after the Service went");
    }
}
