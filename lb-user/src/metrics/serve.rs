//! The metrics endpoint: `GET /metrics` on the configured address, each
//! scrape answered by the owner task, within [`Limits`]. Scrapes less than
//! [`SHARED_FOR`] apart get the same answer: a client asking back to back
//! costs the owner task one answer a second, not one per request.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use http_body_util::Full;
use hyper::{Request, Response, body::Bytes, server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tracing::{debug, info, warn};

/// A scrape: the owner task answers with the encoded metrics.
pub type ScrapeRequest = oneshot::Sender<String>;

/// How long one answer of the owner task serves every scrape.
pub const SHARED_FOR: Duration = Duration::from_secs(1);

/// The last answer and when the owner task gave it. Locked across the
/// request to the owner task, so scrapes that arrive together ask once.
type LastAnswer = Arc<tokio::sync::Mutex<Option<(Instant, Bytes)>>>;

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
    let last: LastAnswer = Arc::default();
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
            let last = Arc::clone(&last);
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                    let (scrapes, last) = (scrapes.clone(), Arc::clone(&last));
                    async move {
                        Ok::<_, Infallible>(answer(request.uri().path(), &scrapes, &last).await)
                    }
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

async fn answer(
    path: &str,
    scrapes: &mpsc::Sender<ScrapeRequest>,
    last: &LastAnswer,
) -> Response<Full<Bytes>> {
    let response = |status: u16, body: Bytes, content_type: &str| {
        Response::builder()
            .status(status)
            .header("content-type", content_type)
            .body(Full::new(body))
            .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
    };
    let metrics =
        |text| response(200, text, "application/openmetrics-text; version=1.0.0; charset=utf-8");
    let unavailable =
        || response(503, Bytes::from_static(b"the daemon is shutting down\n"), "text/plain");
    if path != "/metrics" {
        return response(404, Bytes::from_static(b"see /metrics\n"), "text/plain");
    }
    let mut last = last.lock().await;
    if let Some((at, text)) = last.as_ref()
        && at.elapsed() < SHARED_FOR
    {
        return metrics(text.clone());
    }
    let (tx, rx) = oneshot::channel();
    if scrapes.send(tx).await.is_err() {
        return unavailable();
    }
    match rx.await {
        Ok(text) => {
            let text = Bytes::from(text);
            *last = Some((Instant::now(), text.clone()));
            metrics(text)
        }
        Err(_) => unavailable(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One `GET /metrics` on a connection of its own: the whole answer.
    async fn get_metrics(addr: SocketAddr) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
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
        answer
    }

    /// A flood of idle connections holds at most `limits.connections` of
    /// the daemon's descriptors, and only until the header timeout; scrapes
    /// work again right after.
    #[tokio::test]
    async fn idle_connections_cannot_hold_the_endpoint() {
        use tokio::io::AsyncReadExt as _;
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
        let answer = get_metrics(addr).await;
        assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("lb_up 1"), "{answer}");
    }

    /// Scrapes back to back cannot keep the owner task from the kernel's
    /// reports: they cost it one answer per [`SHARED_FOR`], and each gets
    /// that answer whole.
    #[tokio::test]
    async fn scrapes_back_to_back_share_one_answer_a_second() {
        use std::sync::atomic::{AtomicUsize, Ordering};

        let (tx, mut rx) = mpsc::channel::<ScrapeRequest>(4);
        let asked = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&asked);
        tokio::spawn(async move {
            while let Some(reply) = rx.recv().await {
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                let _ = reply.send(format!("lb_answer {n}\n"));
            }
        });
        let addr = serve("127.0.0.1:0".parse().unwrap(), Limits::default(), tx).await.unwrap();
        let start = Instant::now();
        for _ in 0..100 {
            let answer = get_metrics(addr).await;
            assert!(answer.contains("lb_answer "), "{answer}");
        }
        let seconds = start.elapsed().as_secs() as usize;
        let asked = asked.load(Ordering::SeqCst);
        assert!(
            asked >= 1 && asked <= seconds + 1,
            "{asked} answers in {seconds} s for 100 scrapes"
        );
    }
}
