//! The metrics endpoint: `GET /metrics` on the configured address, each
//! scrape answered by the owner task, within [`Limits`].

use std::{convert::Infallible, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context as _;
use http_body_util::Full;
use hyper::{Request, Response, body::Bytes, server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tracing::{debug, info, warn};

/// A scrape: the owner task answers with the encoded metrics.
pub type ScrapeRequest = oneshot::Sender<String>;

/// Bounds of the metrics endpoint.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once; more are closed as soon as accepted.
    pub connections: usize,
    /// How long a connection may take to send its request headers.
    pub header_timeout: Duration,
    /// How long one connection may live, keep-alive included.
    pub lifetime: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connections: 16,
            header_timeout: Duration::from_secs(5),
            lifetime: Duration::from_secs(60),
        }
    }
}

/// Serves `GET /metrics` on `addr`; each scrape goes to the owner task.
/// Returns the address bound (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    limits: Limits,
    scrapes: mpsc::Sender<ScrapeRequest>,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics address {addr}"))?;
    let bound = listener.local_addr().context("reading the metrics address")?;
    if !addr.ip().is_loopback() {
        warn!(%addr, "metrics are served beyond loopback; anyone who can reach {addr} can read them");
    }
    info!(addr = %bound, "serving metrics at /metrics");
    let slots = Arc::new(Semaphore::new(limits.connections));
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    debug!("metrics accept: {e}");
                    // E.g. out of file descriptors: don't spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            // Over the limit: closed at once (dropped), holding nothing.
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else { continue };
            let scrapes = scrapes.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                    let scrapes = scrapes.clone();
                    async move { Ok::<_, Infallible>(answer(request.uri().path(), &scrapes).await) }
                });
                let connection = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_timeout)
                    .serve_connection(TokioIo::new(stream), service);
                match tokio::time::timeout(limits.lifetime, connection).await {
                    Ok(Err(e)) => debug!("metrics connection: {e}"),
                    Err(_) => debug!("metrics connection closed after {:?}", limits.lifetime),
                    Ok(Ok(())) => {}
                }
                drop(slot);
            });
        }
    });
    Ok(bound)
}

async fn answer(path: &str, scrapes: &mpsc::Sender<ScrapeRequest>) -> Response<Full<Bytes>> {
    let response = |status: u16, body: String, content_type: &str| {
        Response::builder()
            .status(status)
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
    };
    if path != "/metrics" {
        return response(404, "see /metrics\n".to_owned(), "text/plain");
    }
    let (tx, rx) = oneshot::channel();
    if scrapes.send(tx).await.is_err() {
        return response(503, "the daemon is shutting down\n".to_owned(), "text/plain");
    }
    match rx.await {
        Ok(text) => {
            response(200, text, "application/openmetrics-text; version=1.0.0; charset=utf-8")
        }
        Err(_) => response(503, "the daemon is shutting down\n".to_owned(), "text/plain"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hardening #9: a flood of idle connections holds at most
    /// `limits.connections` of the daemon's descriptors, and only until the
    /// header timeout; scrapes work again right after.
    #[tokio::test]
    async fn idle_connections_cannot_hold_the_endpoint() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let limits = Limits {
            connections: 4,
            header_timeout: Duration::from_millis(300),
            lifetime: Duration::from_secs(5),
        };
        let (tx, mut rx) = mpsc::channel::<ScrapeRequest>(4);
        tokio::spawn(async move {
            while let Some(reply) = rx.recv().await {
                let _ = reply.send("lb_up 1\n".to_owned());
            }
        });
        let addr = serve("127.0.0.1:0".parse().unwrap(), limits, tx).await.unwrap();
        let mut idle = Vec::new();
        for _ in 0..200 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // Every idle connection is closed by the server: the ones over the
        // limit at once, the others at the header timeout.
        for (i, stream) in idle.iter_mut().enumerate() {
            let mut buf = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await;
            assert!(
                matches!(read, Ok(Ok(0) | Err(_))),
                "idle connection {i} was not closed: {read:?}"
            );
        }
        let mut scrape = tokio::net::TcpStream::connect(addr).await.unwrap();
        scrape
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), scrape.read_to_string(&mut answer))
            .await
            .unwrap()
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("lb_up 1"), "{answer}");
    }
}
