//! The control socket, both ends: a Unix stream socket (mode 0600)
//! carrying one JSON request and one JSON response per line. The client
//! ([`call`]) is used by `lb status`, `lb detach` and the other client
//! subcommands; the server ([`bind`], [`serve`]) hands each request to the
//! daemon's owner task through a channel of [`Call`]s and writes back the
//! answer, so this module never needs to know the daemon.
//!
//! The requests and answers below are the wire format (and `lb status
//! --json`).

use std::{
    net::SocketAddr,
    os::unix::fs::{DirBuilderExt as _, FileTypeExt as _, PermissionsExt as _},
    path::Path,
    time::Duration,
};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader},
    net::{UnixListener, UnixStream},
    sync::{mpsc, oneshot},
};
use tracing::debug;

/// Longest request line the server reads; a longer one is refused and the
/// connection closed (a request is a few hundred bytes; `lb servers` with
/// the most servers allowed is under 2 KiB).
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;
/// How long the server waits for a client's next request line before it
/// closes the connection.
pub const CLIENT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// A request line: `{"command": "status"}` and so on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum Request {
    /// Every service with its servers and the datapath ([`Status`]).
    Status,
    /// Reset the connections made through a VIP to `server` (of one service
    /// when `service` is set; of every service otherwise).
    CloseConnections {
        /// The server whose VIP connections are reset.
        server: SocketAddr,
        /// Only the connections through this service's VIP.
        service: Option<String>,
    },
    /// Replace a service's server list (and default). Unchanged sets are a no-op.
    SetServers {
        /// The service's name.
        service: String,
        /// The new list, in order of preference.
        servers: Vec<SocketAddr>,
        /// The server preferred while healthy (one of `servers`), if any.
        default: Option<SocketAddr>,
    },
    /// Drain a server (no new connections unless nothing else is usable;
    /// existing ones stay), or undo that.
    Drain {
        /// The service's name.
        service: String,
        /// One of its servers.
        server: SocketAddr,
        /// Undo an earlier drain instead.
        undo: bool,
    },
    /// Re-read the config file (as SIGHUP does) and say how it went.
    Reload,
    /// Exit, leaving the datapath pinned and working.
    Shutdown,
    /// Exit for `lb detach`: as `Shutdown`, answered once the daemon has let
    /// go of the pins, and the daemon exits with
    /// [`EXIT_DETACHED`](crate::detach::EXIT_DETACHED) so that a supervisor
    /// does not start it again.
    Detach,
}

/// An answer line: `{"result": "ok"}` and so on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    /// The answer to [`Request::Status`] (boxed: the other answers are
    /// small).
    Status(Box<Status>),
    /// The answer to [`Request::CloseConnections`], once they are reset.
    Closed {
        /// How many connections were reset.
        closed: u64,
    },
    /// The request was carried out.
    Ok,
    /// The request was refused or failed; nothing changed.
    Error {
        /// What went wrong, for a person.
        error: String,
    },
}

mod status;

pub use status::{
    BgpSession, BgpStatus, ConfigStatus, DatapathStatus, DiscoveryStatus, ExternalStatus, Features,
    InterfaceStatus, LeaseStatus, LoadBalancerStatus, LoadBalancersStatus, ReloadStatus,
    ServerStatus, ServiceExternal, ServiceStatus, Status, TakeoverStatus, TrackedSockets,
    TrafficStatus, UdpReverse,
};

/// Sends one request to the daemon behind `socket` and returns its answer.
pub async fn call(socket: &Path, request: &Request) -> anyhow::Result<Response> {
    let stream = tokio::time::timeout(Duration::from_secs(5), UnixStream::connect(socket))
        .await
        .with_context(|| format!("timed out connecting to {}", socket.display()))?
        .with_context(|| {
            format!(
                "cannot reach the lb daemon at {} (is `lb run` running with this config?)",
                socket.display()
            )
        })?;
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_string(request)?;
    line.push('\n');
    write.write_all(line.as_bytes()).await?;
    let mut answer = String::new();
    let mut reader = BufReader::new(read);
    tokio::time::timeout(Duration::from_secs(30), reader.read_line(&mut answer))
        .await
        .context("the daemon did not answer within 30 s")??;
    if answer.is_empty() {
        bail!("the daemon closed the control connection without answering");
    }
    serde_json::from_str(&answer)
        .with_context(|| format!("unexpected answer from the daemon: {answer}"))
}

/// A request on its way to the daemon, with where to send the answer.
pub type Call = (Request, oneshot::Sender<Response>);

/// Binds the control socket at `path` (mode 0600), creating its directory.
/// A live socket there means another daemon runs: an error naming it. A
/// stale socket is replaced; anything that is not a socket is left alone
/// and refused, so a mistyped path can never delete a file.
///
/// The socket is bound in a private (0700) staging directory beside
/// `path`, made private, and only then linked into place: under a loose
/// umask it is never reachable at `path` with a mode that lets others in.
pub async fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(path).await.is_ok() {
                bail!("another lb daemon is already listening on {}", path.display());
            }
            std::fs::remove_file(path)
                .with_context(|| format!("removing stale socket {}", path.display()))?;
        }
        Ok(_) => bail!(
            "{} exists and is not a socket; refusing to replace it (check daemon.control_socket)",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("inspecting {}", path.display())),
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // Unique to this bind: two daemons (pid 1 of two containers sharing the
    // directory, say) never share one.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let staging = dir.join(format!(".lb-control-{}-{nanos}", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&staging)
        .with_context(|| format!("creating {}", staging.display()))?;
    let bound = bind_private(&staging.join("lb.sock"), path);
    let _ = std::fs::remove_dir_all(&staging);
    bound
}

/// Binds at `staging`, makes the socket private (0600) and links it at
/// `path`: a link never replaces what is there, so of two daemons starting
/// at once only one gets the path, as with a plain bind.
fn bind_private(staging: &Path, path: &Path) -> anyhow::Result<UnixListener> {
    let listener = UnixListener::bind(staging)
        .with_context(|| format!("binding control socket {}", staging.display()))?;
    std::fs::set_permissions(staging, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} private (mode 0600)", staging.display()))?;
    match std::fs::hard_link(staging, path) {
        Ok(()) => Ok(listener),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            bail!("another lb daemon is already listening on {}", path.display())
        }
        Err(e) => {
            Err(e).with_context(|| format!("linking the control socket at {}", path.display()))
        }
    }
}

/// Accepts clients for ever, each in its own task, and sends their requests
/// to `calls`. Returns when the receiving side is gone.
pub async fn serve(listener: UnixListener, calls: mpsc::Sender<Call>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                debug!("control socket accept: {e}");
                // E.g. out of file descriptors: don't spin.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if calls.is_closed() {
            return;
        }
        let calls = calls.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_client(stream, &calls).await {
                debug!("control client: {e:#}");
            }
        });
    }
}

/// One client: request lines in, answer lines out, until it hangs up, goes
/// quiet for [`CLIENT_IDLE_TIMEOUT`] or sends a line over [`MAX_REQUEST_BYTES`].
async fn serve_client(stream: UnixStream, calls: &mpsc::Sender<Call>) -> anyhow::Result<()> {
    let (read, mut write) = stream.into_split();
    // One byte over the limit tells a long line from one that just fits.
    let mut reader = BufReader::new(read.take(0));
    let mut line = Vec::new();
    loop {
        line.clear();
        reader.get_mut().set_limit(MAX_REQUEST_BYTES as u64 + 1);
        let read = tokio::time::timeout(CLIENT_IDLE_TIMEOUT, reader.read_until(b'\n', &mut line))
            .await
            .context("client idle too long")??;
        if read == 0 {
            return Ok(());
        }
        if line.len() > MAX_REQUEST_BYTES {
            let refusal =
                Response::Error { error: format!("request longer than {MAX_REQUEST_BYTES} bytes") };
            write_line(&mut write, &refusal).await?;
            bail!("request line over {MAX_REQUEST_BYTES} bytes");
        }
        let response = match serde_json::from_slice::<Request>(&line) {
            Ok(request) => {
                let (reply_tx, reply_rx) = oneshot::channel();
                calls.send((request, reply_tx)).await.context("daemon is shutting down")?;
                reply_rx.await.context("daemon is shutting down")?
            }
            Err(e) => Response::Error {
                error: format!("bad request {:?}: {e}", String::from_utf8_lossy(&line).trim_end()),
            },
        };
        write_line(&mut write, &response).await?;
    }
}

async fn write_line(
    write: &mut (impl tokio::io::AsyncWrite + Unpin),
    response: &Response,
) -> anyhow::Result<()> {
    let mut out = serde_json::to_string(response)?;
    out.push('\n');
    write.write_all(out.as_bytes()).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn socket_path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir()
            .join(format!("lb-control-{name}-{}", std::process::id()))
            .join("lb.sock")
    }

    /// A server whose "daemon" answers every request with `Ok`.
    async fn answering(path: &Path) {
        let listener = bind(path).await.unwrap();
        let (tx, mut rx) = mpsc::channel::<Call>(4);
        tokio::spawn(serve(listener, tx));
        tokio::spawn(async move {
            while let Some((_, reply)) = rx.recv().await {
                let _ = reply.send(Response::Ok);
            }
        });
    }

    #[tokio::test]
    async fn a_request_gets_its_answer_and_garbage_an_error() {
        let path = socket_path("answer");
        answering(&path).await;
        assert_eq!(call(&path, &Request::Reload).await.unwrap(), Response::Ok);
        let mut stream = UnixStream::connect(&path).await.unwrap();
        stream.write_all(b"{\"command\":\"explode\"}\n").await.unwrap();
        let mut answer = String::new();
        BufReader::new(&mut stream).read_line(&mut answer).await.unwrap();
        assert!(answer.contains("bad request") && answer.contains("explode"), "{answer}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[tokio::test]
    async fn an_endless_line_is_refused_without_reading_it_all() {
        let path = socket_path("long");
        answering(&path).await;
        let mut stream = UnixStream::connect(&path).await.unwrap();
        let junk = vec![b'x'; MAX_REQUEST_BYTES + 10];
        // The server may close before all of it is written.
        let _ = stream.write_all(&junk).await;
        let mut answer = String::new();
        BufReader::new(&mut stream).read_line(&mut answer).await.unwrap();
        assert!(answer.contains("request longer than"), "{answer}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[tokio::test]
    async fn a_file_at_the_socket_path_is_never_removed() {
        let path = socket_path("file");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "precious").unwrap();
        let err = bind(&path).await.unwrap_err();
        assert!(format!("{err:#}").contains("is not a socket"), "{err:#}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "precious");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[tokio::test]
    async fn the_socket_is_private_when_it_appears_and_nothing_is_left_beside_it() {
        let path = socket_path("private");
        answering(&path).await;
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let beside: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(beside, [std::ffi::OsString::from("lb.sock")], "the staging directory must go");
        assert_eq!(call(&path, &Request::Reload).await.unwrap(), Response::Ok);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[tokio::test]
    async fn a_second_server_on_a_live_socket_is_refused() {
        let path = socket_path("twice");
        answering(&path).await;
        let err = bind(&path).await.unwrap_err();
        assert!(format!("{err:#}").contains("another lb daemon is already listening"), "{err:#}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
