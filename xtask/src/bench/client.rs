//! `xtask bench-client`: the benchmark's own client, a separate process so
//! that it can start inside a cgroup (every connect of a process in the
//! attached cgroup goes through lb's programs).
//!
//! `xtask bench-client agent` reads commands on stdin and answers one line
//! each, so that one process (started once, outside or inside a cgroup)
//! serves a whole part of the bench; each command is over in bounded time
//! (every connect and read has a time limit):
//!   - `connect ADDR N` → `ok NS`: N connects, each waiting for the server
//!     to close, in NS nanoseconds; or `err WHAT`;
//!   - `bulk ADDR BYTES` → `ok NS`: BYTES read from one connection (fewer or
//!     more is an error) in NS nanoseconds; or `err WHAT`;
//!   - `cgroup DIR` → `ok`: the agent moves itself into cgroup DIR (its
//!     sockets from then on are that cgroup's); or `err WHAT`;
//!   - `cpu N` → `ok`: the agent runs only on CPU N from then on; or
//!     `err WHAT`;
//!   - `land ADDR` → `ok NAME` (the greeting line of the server that
//!     accepted) or `err WHAT`;
//!   - `until ADDR WANT LIMIT_MS PAUSE_US` (WANT: `=NAME` or `!NAME`) →
//!     connects in a loop, pausing PAUSE_US between attempts, until one is
//!     answered by server NAME (or any but NAME); then `ok AT_NS ATTEMPTS
//!     FAILED FAILED_NS` (AT_NS: CLOCK_MONOTONIC when that greeting
//!     arrived; FAILED_NS: when the last failed attempt returned, 0 if none
//!     failed), or `timeout ATTEMPTS LAST` after LIMIT_MS;
//!   - `hold ADDR[,ADDR...] N` → `ok HELD`: N connections, to the addresses
//!     in turn, opened and kept (the agent's open-file limit raised as far
//!     as it may be first); or `err WHAT` (those opened are kept);
//!   - `release` → `ok`: closes the held connections.

use std::{
    io::{BufRead as _, BufReader, ErrorKind, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::Path,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::host::set_affinity;

/// How long one connect, or one read, may take.
const IO_LIMIT: Duration = Duration::from_secs(2);

pub fn client_main(args: &[String]) -> anyhow::Result<()> {
    match args {
        [agent] if agent == "agent" => agent_loop(),
        _ => bail!("usage: bench-client agent (commands on stdin)"),
    }
}

fn parse(addr: &str) -> anyhow::Result<SocketAddr> {
    addr.parse().with_context(|| format!("bad address {addr}"))
}

/// `ok NS` (the nanoseconds `work` took) or `err WHAT`.
fn timed(work: impl FnOnce() -> anyhow::Result<()>) -> String {
    let started = Instant::now();
    match work() {
        Ok(()) => format!("ok {}", started.elapsed().as_nanos()),
        Err(e) => format!("err {e:#}"),
    }
}

/// A connection to `addr`, its reads limited to [`IO_LIMIT`].
fn open(addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let stream =
        TcpStream::connect_timeout(&addr, IO_LIMIT).with_context(|| format!("connect {addr}"))?;
    stream.set_read_timeout(Some(IO_LIMIT))?;
    Ok(stream)
}

fn connects(addr: SocketAddr, n: u64) -> anyhow::Result<()> {
    let mut buf = [0u8; 512];
    for _ in 0..n {
        let mut stream = open(addr)?;
        // The server closes first, so the TIME_WAIT is its own.
        while stream.read(&mut buf).with_context(|| format!("reading from {addr}"))? > 0 {}
    }
    Ok(())
}

fn bulk(addr: SocketAddr, bytes: u64) -> anyhow::Result<()> {
    let mut buf = vec![0u8; 256 << 10];
    let mut stream = open(addr)?;
    let mut got = 0u64;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got += n as u64,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(e).with_context(|| format!("reading from {addr} after {got} bytes"));
            }
        }
    }
    if got != bytes {
        bail!("read {got} bytes from {addr}, expected {bytes}");
    }
    Ok(())
}

/// One connect: the server's greeting line.
fn greeting(addr: SocketAddr) -> std::io::Result<String> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "closed before its greeting"));
    }
    Ok(line.trim().to_owned())
}

/// `hold`: opens `n` connections to `addrs` in turn into `held`.
fn hold(addrs: &str, n: usize, held: &mut Vec<TcpStream>) -> anyhow::Result<usize> {
    let addrs: Vec<SocketAddr> = addrs.split(',').map(parse).collect::<Result<_, _>>()?;
    // As many as this process may have (its hard limit, without
    // CAP_SYS_RESOURCE).
    lb_tests::load::raise_nofile(1 << 20);
    for i in 0..n {
        let addr = addrs[i % addrs.len()];
        held.push(
            TcpStream::connect_timeout(&addr, IO_LIMIT)
                .with_context(|| format!("connect {addr} (after {} held)", held.len()))?,
        );
    }
    Ok(held.len())
}

fn agent_loop() -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    let mut held = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["connect", addr, n] => timed(|| connects(parse(addr)?, n.parse()?)),
            ["bulk", addr, bytes] => timed(|| bulk(parse(addr)?, bytes.parse()?)),
            ["cgroup", dir] => match std::fs::write(Path::new(dir).join("cgroup.procs"), "0") {
                Ok(()) => "ok".to_owned(),
                Err(e) => format!("err moving into {dir}: {e}"),
            },
            ["cpu", cpu] => match set_affinity(&[cpu.parse()?]) {
                Ok(()) => "ok".to_owned(),
                Err(e) => format!("err cpu {cpu}: {e}"),
            },
            ["land", addr] => match greeting(parse(addr)?) {
                Ok(name) => format!("ok {name}"),
                Err(e) => format!("err {e}"),
            },
            ["until", addr, want, limit_ms, pause_us] => {
                let (addr, limit, pause) = (
                    parse(addr)?,
                    Duration::from_millis(limit_ms.parse()?),
                    Duration::from_micros(pause_us.parse()?),
                );
                let accept = |name: &str| match want.split_at(1) {
                    ("=", wanted) => name == wanted,
                    ("!", unwanted) => name != unwanted,
                    _ => false,
                };
                until(addr, accept, limit, pause)
            }
            ["hold", addrs, n] => match hold(addrs, n.parse()?, &mut held) {
                Ok(count) => format!("ok {count}"),
                Err(e) => format!("err {e:#}"),
            },
            ["release"] => {
                held.clear();
                "ok".to_owned()
            }
            _ => format!("err unknown command {line:?}"),
        };
        writeln!(out, "{answer}")?;
        out.flush()?;
    }
    Ok(())
}

fn until(
    addr: SocketAddr,
    accept: impl Fn(&str) -> bool,
    limit: Duration,
    pause: Duration,
) -> String {
    let deadline = Instant::now() + limit;
    let (mut attempts, mut failed, mut failed_ns) = (0u64, 0u64, 0u64);
    let mut last = String::from("-");
    while Instant::now() < deadline {
        attempts += 1;
        match greeting(addr) {
            Ok(name) if accept(&name) => {
                return format!("ok {} {attempts} {failed} {failed_ns}", lb_tests::monotonic_ns());
            }
            Ok(name) => last = name,
            Err(e) => {
                failed += 1;
                failed_ns = lb_tests::monotonic_ns();
                last = e.kind().to_string().replace(' ', "_");
            }
        }
        thread::sleep(pause);
    }
    format!("timeout {attempts} {last}")
}
