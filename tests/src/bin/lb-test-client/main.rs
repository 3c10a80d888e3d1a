//! A client the integration tests run *inside* the test cgroup, so that its
//! connects go through the datapath. It reads commands on stdin and answers
//! one line each on stdout:
//!
//! - `connect ADDR` → `ok ID PEER GREETING` or `err MESSAGE`: TCP connect,
//!   then `getpeername` (what the application sees) and the server's answer
//!   to `who` (which server really accepted);
//! - `pod VIP SERVER` → `ok ID PEER GREETING` or `err MESSAGE`: as
//!   `connect VIP`, made from a network namespace of its own (a pod's)
//!   where a listener on SERVER answers `pod-server`; `alive`, `peer` and
//!   `close` then work on it as on any connection;
//! - `udp ADDR` → `ok ID PEER GREETING`: connected UDP, one datagram each way;
//! - `sendto ADDR N` and `churn-sendto ADDR N`: DNS queries on unconnected
//!   UDP sockets (see `dns.rs`); the last `sendto` socket stays open until
//!   the next `sendto`;
//! - `alive ID` → `alive` or `dead MESSAGE`: is TCP connection ID still open;
//! - `close ID` → `closed`;
//! - `storm ADDR THREADS MILLIS STOPFILE` → `storm total=N failed=N
//!   last_ok=N names=NAME:N,... latest=NAME:NS,... errors=WHAT:N,...`:
//!   THREADS threads connect, ask `who` and close, in a loop, until
//!   STOPFILE exists (at most MILLIS ms); then each makes one final
//!   connect, and `last_ok` counts those that worked; `latest` is, per
//!   server, the CLOCK_MONOTONIC time at which the latest connect that
//!   landed there *started*; `errors` counts the failures by what failed
//!   (`MESSAGE/connect:KIND`, `no_greeting:KIND`, ...).
//! - `chaos ADDR[,ADDR...] THREADS MILLIS STOPFILE OUTFILE` → `chaos
//!   attempts=N`: as `storm` (thread i uses the i-th address, round robin),
//!   but every attempt is written to OUTFILE as one line `ADDRINDEX START_NS
//!   END_NS FINAL OUTCOME` (CLOCK_MONOTONIC; FINAL is 1 for the attempt
//!   after the stop; OUTCOME is the greeting, or `!refused`, `!reset`
//!   (reset or EOF before the greeting, `connect` included), `!aborted`
//!   (ECONNABORTED before the greeting, `connect` included),
//!   `!other:WHAT`);
//! - `hold ADDR COUNT THREADS` → `held ok=N failed=N names=NAME:N,...
//!   errors=WHAT:N,...`: opens COUNT connections (raising RLIMIT_NOFILE as
//!   needed), reads each greeting and keeps them open;
//! - `held` → `held alive=N dead=N kinds=KIND:N,...`: the state of the held
//!   connections (`kinds`: how each dead one was first seen dead: `eof`,
//!   `connection_aborted`, ...);
//! - `release` → `released`: closes the held connections;
//! - `peer ID` → `peer ADDR`: getpeername of connection ID, now;
//! - `once ADDR` → `ok PEER GREETING` or `err MESSAGE`: as `connect`, but
//!   closed at once;
//! - `churn-udp ADDR N` / `churn-tcp ADDR N` → `churned ok=K failed=F`: N
//!   sockets one after the other, each connected to ADDR, asked who it is,
//!   and closed;
//! - `cancel ADDR SOURCE N WAIT_MS [HOW]` → `cancelled total=N syn_sent=S
//!   other=O`: N non-blocking connects to ADDR from the address SOURCE (any
//!   port), all given up on by the application WAIT_MS after the last
//!   started, by HOW: `close` (the default), `shutdown` (SHUT_RDWR, then
//!   close) or `unspec` (`connect(AF_UNSPEC)`, then close); `syn_sent`
//!   counts those still in SYN_SENT then (connects the application gave
//!   up on).
//! - `failfast VIP N` → `failfast total=N unreachable=U`: N IPv6-only
//!   sockets dial the IPv4 VIP IPv4-mapped, which fails on the spot
//!   (`ENETUNREACH`, counted in U); the sockets stay open until `unstick`
//!   → `unstuck`;
//! - `reuse VIP OTHER` → `reuse first=ERRNO second=OUTCOME`: one such
//!   socket then connects to the IPv6 OTHER (blocking; OUTCOME `ok` or the
//!   error's kind) and is closed.
//! - `fastopen ADDR N` → `fastopen total=N syn_sent=S`: N sockets with
//!   `TCP_FASTOPEN_CONNECT` connected to ADDR and closed without writing,
//!   from a thread in a network namespace of its own that allows Fast Open
//!   without a cookie (`net.ipv4.tcp_fastopen = 5` there), so each
//!   connect sends nothing until the first write; `syn_sent` counts those
//!   in SYN_SENT at the close.
//!
//! And one job from the command line, in a network namespace of its own:
//! `lb-test-client netns VIP SERVER` unshares a new network namespace,
//! listens there on VIP (answering `pod-vip`) and on SERVER (answering
//! `pod-server`), connects to VIP and prints `ok PEER GREETING` or
//! `err MESSAGE`. The namespace goes with the process.
//!
//! Every read has a timeout, so a test can never hang on it.

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, ErrorKind, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::OwnedFd,
    time::Duration,
};

use lb_tests::{loopback_up, monotonic_ns};

mod dns;
mod sockets;

use sockets::{cancel, failfast, fastopen, pod, reuse};

const TIMEOUT: Duration = Duration::from_secs(5);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("netns") {
        let answer = match (args.get(2), args.get(3)) {
            (Some(vip), Some(server)) => netns(vip, server).unwrap_or_else(|e| format!("err {e}")),
            _ => "err usage: netns VIP SERVER".to_owned(),
        };
        println!("{answer}");
        return;
    }
    let mut conns: HashMap<u32, TcpStream> = HashMap::new();
    // Held connections, with how each was first seen dead (a pending
    // error is reported once; after it a peek sees EOF).
    let mut held: Vec<(TcpStream, Option<String>)> = Vec::new();
    // Sockets whose connect failed on the spot, kept open (`failfast`).
    let mut stuck: Vec<OwnedFd> = Vec::new();
    // The socket of the last `sendto`, open until the next one.
    let mut _last_sendto: Option<UdpSocket> = None;
    let mut next_id = 0u32;
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace();
        let answer = match (words.next(), words.next()) {
            (Some("connect"), Some(addr)) => match connect(addr) {
                Ok((stream, peer, greeting)) => {
                    next_id += 1;
                    conns.insert(next_id, stream);
                    format!("ok {next_id} {peer} {greeting}")
                }
                Err(e) => format!("err {e}"),
            },
            (Some("pod"), Some(vip)) => match pod(vip, words.next()) {
                Ok((stream, peer, greeting)) => {
                    next_id += 1;
                    conns.insert(next_id, stream);
                    format!("ok {next_id} {peer} {greeting}")
                }
                Err(e) => format!("err {e}"),
            },
            (Some("udp"), Some(addr)) => match udp(addr) {
                Ok((peer, greeting)) => format!("ok 0 {peer} {greeting}"),
                Err(e) => format!("err {e}"),
            },
            (Some("alive"), Some(id)) => match id.parse().ok().and_then(|id: u32| conns.get(&id)) {
                Some(stream) => alive(stream),
                None => "err no such connection".to_owned(),
            },
            (Some("close"), Some(id)) => {
                id.parse().ok().and_then(|id: u32| conns.remove(&id));
                "closed".to_owned()
            }
            (Some("storm"), Some(addr)) => {
                let threads = words.next().and_then(|w| w.parse().ok()).unwrap_or(1);
                let millis = words.next().and_then(|w| w.parse().ok()).unwrap_or(1000);
                let stop_file = words.next().unwrap_or("/nonexistent").to_owned();
                storm(addr, threads, Duration::from_millis(millis), &stop_file)
            }
            (Some("chaos"), Some(addrs)) => {
                let threads = words.next().and_then(|w| w.parse().ok()).unwrap_or(1);
                let millis = words.next().and_then(|w| w.parse().ok()).unwrap_or(1000);
                let stop_file = words.next().unwrap_or("/nonexistent").to_owned();
                let out = words.next().unwrap_or("/dev/null").to_owned();
                chaos(addrs, threads, Duration::from_millis(millis), &stop_file, &out)
            }
            (Some("hold"), Some(addr)) => {
                let count = words.next().and_then(|w| w.parse().ok()).unwrap_or(1);
                let threads = words.next().and_then(|w| w.parse().ok()).unwrap_or(1);
                hold(addr, count, threads, &mut held)
            }
            (Some("held"), _) => held_report(&mut held),
            (Some("release"), _) => {
                held.clear();
                "released".to_owned()
            }
            (Some("peer"), Some(id)) => match id.parse().ok().and_then(|id: u32| conns.get(&id)) {
                Some(stream) => {
                    stream.peer_addr().map_or_else(|e| format!("err {e}"), |p| format!("peer {p}"))
                }
                None => "err no such connection".to_owned(),
            },
            (Some("once"), Some(addr)) => match connect(addr) {
                Ok((_, peer, greeting)) => format!("ok {peer} {greeting}"),
                Err(e) => format!("err {e}"),
            },
            (Some("churn-udp"), Some(addr)) => churn(words.next(), || udp(addr).map(drop)),
            (Some("churn-tcp"), Some(addr)) => churn(words.next(), || connect(addr).map(drop)),
            (Some("sendto"), Some(addr)) => match dns::sendto(addr, words.next()) {
                Ok((answer, socket)) => {
                    _last_sendto = Some(socket);
                    answer
                }
                Err(e) => format!("err {e}"),
            },
            (Some("churn-sendto"), Some(addr)) => {
                dns::churn_sendto(addr, words.next()).unwrap_or_else(|e| format!("err {e}"))
            }
            (Some("cancel"), Some(addr)) => {
                let rest: Vec<&str> = words.collect();
                let answer = match rest.as_slice() {
                    [source, n, wait_ms] => cancel(addr, source, n, wait_ms, "close"),
                    [source, n, wait_ms, how] => cancel(addr, source, n, wait_ms, how),
                    _ => Err("usage: cancel ADDR SOURCE N WAIT_MS [close|shutdown|unspec]".into()),
                };
                answer.unwrap_or_else(|e| format!("err {e}"))
            }
            (Some("fastopen"), Some(addr)) => {
                fastopen(addr, words.next()).unwrap_or_else(|e| format!("err {e}"))
            }
            (Some("failfast"), Some(vip)) => {
                let n = words.next();
                // The sockets stay open: more than the usual 1,024.
                raise_nofile(n.and_then(|n| n.parse::<u64>().ok()).unwrap_or(0) + 256);
                failfast(vip, n, &mut stuck).unwrap_or_else(|e| format!("err {e}"))
            }
            (Some("unstick"), _) => {
                stuck.clear();
                "unstuck".to_owned()
            }
            (Some("reuse"), Some(vip)) => {
                reuse(vip, words.next()).unwrap_or_else(|e| format!("err {e}"))
            }
            (Some("exit"), _) => break,
            _ => format!("err bad command {line:?}"),
        };
        let mut out = stdout.lock();
        let _ = writeln!(out, "{answer}");
        let _ = out.flush();
    }
}

fn connect(addr: &str) -> Result<(TcpStream, SocketAddr, String), String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let stream = TcpStream::connect_timeout(&addr, TIMEOUT)
        .map_err(|e| format!("{}/connect:{:?}", e.to_string().replace(' ', "_"), e.kind()))?;
    let peer = stream.peer_addr().map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    (&stream).write_all(b"who\n").map_err(|e| format!("send:{:?}", e.kind()))?;
    let mut greeting = String::new();
    let mut reader = BufReader::new(&stream);
    reader.read_line(&mut greeting).map_err(|e| format!("no_greeting:{:?}", e.kind()))?;
    Ok((stream, peer, greeting.trim().to_owned()))
}

fn storm(addr: &str, threads: usize, duration: Duration, stop_file: &str) -> String {
    let deadline = std::time::Instant::now() + duration;
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let addr = addr.to_owned();
            let stop_file = std::path::PathBuf::from(stop_file);
            std::thread::spawn(move || {
                let (mut total, mut failed) = (0usize, 0usize);
                let mut last_ok;
                let mut names: HashMap<String, usize> = HashMap::new();
                let mut latest: HashMap<String, u64> = HashMap::new();
                let mut errors: HashMap<String, usize> = HashMap::new();
                // Bounded by time; the attempt after the stop is the final one.
                let mut stopping = false;
                loop {
                    total += 1;
                    let started = monotonic_ns();
                    match connect(&addr) {
                        Ok((_, _, name)) => {
                            *names.entry(name.clone()).or_default() += 1;
                            let slot = latest.entry(name).or_default();
                            *slot = (*slot).max(started);
                            last_ok = true;
                        }
                        Err(error) => {
                            failed += 1;
                            *errors.entry(error.replace(' ', "_")).or_default() += 1;
                            last_ok = false;
                        }
                    }
                    if stopping {
                        break;
                    }
                    stopping = std::time::Instant::now() >= deadline || stop_file.exists();
                }
                (total, failed, last_ok, names, latest, errors)
            })
        })
        .collect();
    let (mut total, mut failed, mut last_ok) = (0, 0, 0);
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut latest: HashMap<String, u64> = HashMap::new();
    let mut errors: HashMap<String, usize> = HashMap::new();
    for worker in workers {
        let (t, f, ok, n, l, e) = worker.join().unwrap_or_default();
        total += t;
        failed += f;
        last_ok += usize::from(ok);
        for (name, count) in n {
            *names.entry(name).or_default() += count;
        }
        for (name, at) in l {
            let slot = latest.entry(name).or_default();
            *slot = (*slot).max(at);
        }
        for (error, count) in e {
            *errors.entry(error).or_default() += count;
        }
    }
    let latest: Vec<String> = latest.into_iter().map(|(n, at)| format!("{n}:{at}")).collect();
    format!(
        "storm total={total} failed={failed} last_ok={last_ok} names={} latest={} errors={}",
        counts(names),
        latest.join(","),
        counts(errors)
    )
}

fn udp(addr: &str) -> Result<(SocketAddr, String), String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let bind: SocketAddr =
        if addr.is_ipv4() { "0.0.0.0:0".parse().unwrap() } else { "[::]:0".parse().unwrap() };
    let socket = UdpSocket::bind(bind).map_err(|e| e.to_string())?;
    socket.connect(addr).map_err(|e| e.to_string().replace(' ', "_"))?;
    let peer = socket.peer_addr().map_err(|e| e.to_string())?;
    socket.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    socket.send(b"hello").map_err(|e| e.to_string())?;
    let mut buf = [0u8; 64];
    let n = socket.recv(&mut buf).map_err(|e| format!("no_reply:{}", e.kind()))?;
    Ok((peer, String::from_utf8_lossy(&buf[..n]).trim().to_owned()))
}

/// Open means: no EOF and no error pending (a destroyed socket reports
/// ECONNABORTED, a reset one ECONNRESET).
fn alive(stream: &TcpStream) -> String {
    let _ = stream.set_nonblocking(true);
    let mut buf = [0u8; 1];
    let result = stream.peek(&mut buf);
    let _ = stream.set_nonblocking(false);
    match result {
        Err(e) if e.kind() == ErrorKind::WouldBlock => "alive".to_owned(),
        Ok(0) => "dead eof".to_owned(),
        Ok(_) => "alive".to_owned(),
        Err(e) => format!("dead {}", e.kind()),
    }
}

/// One attempt of `chaos`: connect, ask `who`, read the greeting, close.
/// The outcome says which server answered, or how it failed.
///
/// A reset or an abort counts the same whether `connect` itself or a later
/// step reports it. `connect` reports one when the handshake completed and
/// the connection was reset (a listener closed with it in its accept
/// queue) or destroyed before the connecting thread ran again: on a loaded
/// machine the handshake runs in ksoftirqd while that thread waits.
fn chaos_attempt(addr: SocketAddr) -> String {
    let failed = |step: &str, e: &std::io::Error| match e.kind() {
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => "!reset".to_owned(),
        ErrorKind::ConnectionAborted => "!aborted".to_owned(),
        kind => format!("!other:{step}:{kind:?}"),
    };
    let stream = match TcpStream::connect_timeout(&addr, TIMEOUT) {
        Ok(stream) => stream,
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => return "!refused".to_owned(),
        Err(e) => return failed("connect", &e),
    };
    if let Err(e) = stream.set_read_timeout(Some(TIMEOUT)) {
        return failed("timeout", &e);
    }
    if let Err(e) = (&stream).write_all(b"who\n") {
        return failed("send", &e);
    }
    let mut greeting = String::new();
    match BufReader::new(&stream).read_line(&mut greeting) {
        Ok(0) => "!reset".to_owned(),
        Ok(_) => greeting.trim().to_owned(),
        Err(e) => failed("greeting", &e),
    }
}

fn chaos(addrs: &str, threads: usize, duration: Duration, stop_file: &str, out: &str) -> String {
    let addrs: Vec<SocketAddr> = match addrs.split(',').map(str::parse).collect() {
        Ok(addrs) => addrs,
        Err(e) => return format!("err bad address: {e}"),
    };
    let deadline = std::time::Instant::now() + duration;
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let index = t % addrs.len();
            let addr = addrs[index];
            let stop_file = std::path::PathBuf::from(stop_file);
            std::thread::spawn(move || {
                let mut attempts: Vec<(usize, u64, u64, bool, String)> = Vec::new();
                let mut stopping = false;
                loop {
                    let started = monotonic_ns();
                    let outcome = chaos_attempt(addr);
                    attempts.push((index, started, monotonic_ns(), stopping, outcome));
                    if stopping {
                        break;
                    }
                    stopping = std::time::Instant::now() >= deadline || stop_file.exists();
                }
                attempts
            })
        })
        .collect();
    let mut file = match std::fs::File::create(out) {
        Ok(file) => std::io::BufWriter::new(file),
        Err(e) => return format!("err creating {out}: {e}"),
    };
    let mut total = 0;
    for worker in workers {
        for (index, started, ended, last, outcome) in worker.join().unwrap_or_default() {
            total += 1;
            let _ = writeln!(file, "{index} {started} {ended} {} {outcome}", u8::from(last));
        }
    }
    if let Err(e) = file.flush() {
        return format!("err writing {out}: {e}");
    }
    format!("chaos attempts={total}")
}

/// Raises the limit of open files to `want`, or as far as the hard limit
/// allows when it cannot be raised (no CAP_SYS_RESOURCE).
fn raise_nofile(want: u64) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit fill or read the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < want {
            let wanted = libc::rlimit { rlim_cur: want, rlim_max: limit.rlim_max.max(want) };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) != 0 {
                limit.rlim_cur = limit.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
            }
        }
    }
}

fn hold(
    addr: &str,
    count: usize,
    threads: usize,
    held: &mut Vec<(TcpStream, Option<String>)>,
) -> String {
    raise_nofile((held.len() + count) as u64 + 1024);
    let threads = threads.clamp(1, count.max(1));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let addr = addr.to_owned();
            let n = count / threads + usize::from(t < count % threads);
            std::thread::spawn(move || {
                let mut streams = Vec::with_capacity(n);
                let mut names: HashMap<String, usize> = HashMap::new();
                let mut errors: HashMap<String, usize> = HashMap::new();
                for _ in 0..n {
                    match connect(&addr) {
                        Ok((stream, _, name)) => {
                            *names.entry(name).or_default() += 1;
                            streams.push(stream);
                        }
                        Err(e) => *errors.entry(e).or_default() += 1,
                    }
                }
                (streams, names, errors)
            })
        })
        .collect();
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut errors: HashMap<String, usize> = HashMap::new();
    let mut ok = 0;
    for worker in workers {
        let Ok((streams, n, e)) = worker.join() else { continue };
        ok += streams.len();
        held.extend(streams.into_iter().map(|s| (s, None)));
        for (name, c) in n {
            *names.entry(name).or_default() += c;
        }
        for (error, c) in e {
            *errors.entry(error).or_default() += c;
        }
    }
    format!(
        "held ok={ok} failed={} names={} errors={}",
        errors.values().sum::<usize>(),
        counts(names),
        counts(errors)
    )
}

/// `KEY:N,...`, sorted by key.
fn counts(counts: HashMap<String, usize>) -> String {
    let mut v: Vec<String> = counts.into_iter().map(|(k, c)| format!("{k}:{c}")).collect();
    v.sort();
    v.join(",")
}

fn held_report(held: &mut [(TcpStream, Option<String>)]) -> String {
    let (mut alive, mut dead) = (0, 0);
    let mut kinds: HashMap<String, usize> = HashMap::new();
    for (stream, seen_dead) in held {
        if seen_dead.is_none() {
            let state = self::alive(stream);
            if state != "alive" {
                *seen_dead = Some(state.trim_start_matches("dead ").replace(' ', "_"));
            }
        }
        match seen_dead {
            None => alive += 1,
            Some(kind) => {
                dead += 1;
                *kinds.entry(kind.clone()).or_default() += 1;
            }
        }
    }
    let mut kinds: Vec<String> = kinds.into_iter().map(|(k, c)| format!("{k}:{c}")).collect();
    kinds.sort();
    format!("held alive={alive} dead={dead} kinds={}", kinds.join(","))
}

fn churn(n: Option<&str>, mut one: impl FnMut() -> Result<(), String>) -> String {
    let n: usize = n.and_then(|n| n.parse().ok()).unwrap_or(0);
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..n {
        if one().is_ok() { ok += 1 } else { failed += 1 }
    }
    format!("churned ok={ok} failed={failed}")
}

/// In a network namespace of its own: listeners on `vip` and `server`,
/// then one connect to `vip`.
fn netns(vip: &str, server: &str) -> Result<String, String> {
    let vip: SocketAddr = vip.parse().map_err(|e| format!("bad vip: {e}"))?;
    let server: SocketAddr = server.parse().map_err(|e| format!("bad server: {e}"))?;
    // SAFETY: unshare has no memory-safety preconditions; this process is
    // single-threaded here.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(format!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error()));
    }
    loopback_up().map_err(|e| format!("bringing lo up: {e}"))?;
    for (addr, name) in [(vip, "pod-vip"), (server, "pod-server")] {
        let listener =
            TcpListener::bind(addr).map_err(|e| format!("bind {addr} in the new netns: {e}"))?;
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = stream.set_read_timeout(Some(TIMEOUT));
                let mut line = String::new();
                let _ = BufReader::new(&stream).read_line(&mut line);
                let _ = writeln!(&stream, "{name}");
            }
        });
    }
    let (_, peer, greeting) = connect(&vip.to_string())?;
    Ok(format!("ok {peer} {greeting}"))
}
