//! What the daemon under bench says: its status on the control socket,
//! a service's selection in it, the end of its log.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    os::unix::net::UnixStream,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use lb_tests::Daemon;
use serde_json::Value;

/// The daemon's status, asked on its control socket directly (one JSON
/// line each way, what `lb status --json` asks): cheaper than starting
/// `lb`, so polls disturb the daemon less.
pub fn status(daemon: &Daemon) -> anyhow::Result<Value> {
    status_received(daemon).map(|(status, _)| status)
}

/// [`status`], and when its answer had been read (before it was parsed).
pub fn status_received(daemon: &Daemon) -> anyhow::Result<(Value, Instant)> {
    status_at(&daemon.dir.join("lb.sock"))
}

/// [`status_received`] from the daemon behind the control socket `socket`.
pub fn status_at(socket: &Path) -> anyhow::Result<(Value, Instant)> {
    let mut stream = UnixStream::connect(socket)
        .with_context(|| format!("connecting to {}", socket.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    stream.write_all(b"{\"command\":\"status\"}\n")?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    let received = Instant::now();
    let answer: Value = serde_json::from_str(&line)
        .with_context(|| format!("the daemon's answer is not JSON: {line:.200}"))?;
    if answer["result"] != "status" {
        bail!("the daemon answered a status request with {line:.300}");
    }
    Ok((answer, received))
}

/// The selection of service `name` in the kernel, from `status`.
pub fn selected(status: &Value, name: &str) -> Vec<String> {
    status["services"]
        .as_array()
        .and_then(|services| services.iter().find(|s| s["name"] == name))
        .and_then(|s| s["selected"].as_array())
        .map(|list| list.iter().filter_map(|a| Some(a.as_str()?.to_owned())).collect())
        .unwrap_or_default()
}

/// The last lines of a long log.
pub fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
