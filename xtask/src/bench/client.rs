//! `xtask bench-client`: the benchmark's own client, a separate process so
//! that it can start inside a cgroup (every connect of a process in the
//! attached cgroup goes through lb's programs).
//!
//! - `connect ADDR N`: N connects, each waiting for the server to close;
//!   prints the nanoseconds it took.
//! - `bulk ADDR BYTES`: reads BYTES from one connection (fewer or more is an
//!   error); prints the nanoseconds it took.
//! - `agent`: reads commands on stdin, answers one line each:
//!   - `land ADDR` → `ok NAME` (the greeting line of the server that
//!     accepted) or `err WHAT`;
//!   - `until ADDR WANT LIMIT_MS PAUSE_US` (WANT: `=NAME` or `!NAME`) →
//!     connects in a loop, pausing PAUSE_US between attempts, until one is
//!     answered by server NAME (or any but NAME); then `ok AT_NS ATTEMPTS
//!     FAILED` (AT_NS: CLOCK_MONOTONIC when that greeting arrived), or
//!     `timeout ATTEMPTS LAST` after LIMIT_MS.

use std::{
    io::{BufRead as _, BufReader, ErrorKind, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

pub fn client_main(args: &[String]) -> anyhow::Result<()> {
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    match words.as_slice() {
        ["connect", addr, n] => timed(|| connects(parse(addr)?, n.parse()?)),
        ["bulk", addr, bytes] => timed(|| bulk(parse(addr)?, bytes.parse()?)),
        ["agent"] => agent(),
        _ => bail!("usage: bench-client connect ADDR N | bulk ADDR BYTES | agent"),
    }
}

fn parse(addr: &str) -> anyhow::Result<SocketAddr> {
    addr.parse().with_context(|| format!("bad address {addr}"))
}

fn timed(work: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
    let started = Instant::now();
    work()?;
    println!("{}", started.elapsed().as_nanos());
    Ok(())
}

fn connects(addr: SocketAddr, n: u64) -> anyhow::Result<()> {
    let mut buf = [0u8; 512];
    for _ in 0..n {
        let mut stream = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
        // The server closes first, so the TIME_WAIT is its own.
        while stream.read(&mut buf)? > 0 {}
    }
    Ok(())
}

fn bulk(addr: SocketAddr, bytes: u64) -> anyhow::Result<()> {
    let mut buf = vec![0u8; 256 << 10];
    let mut stream = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
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

fn agent() -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
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
    let (mut attempts, mut failed) = (0u64, 0u64);
    let mut last = String::from("-");
    while Instant::now() < deadline {
        attempts += 1;
        match greeting(addr) {
            Ok(name) if accept(&name) => {
                return format!("ok {} {attempts} {failed}", lb_tests::monotonic_ns());
            }
            Ok(name) => last = name,
            Err(e) => {
                failed += 1;
                last = e.kind().to_string().replace(' ', "_");
            }
        }
        thread::sleep(pause);
    }
    format!("timeout {attempts} {last}")
}
