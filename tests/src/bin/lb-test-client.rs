//! A client the integration tests run *inside* the test cgroup, so that its
//! connects go through the datapath. It reads commands on stdin and answers
//! one line each on stdout:
//!
//! - `connect ADDR` → `ok ID PEER GREETING` or `err MESSAGE`: TCP connect,
//!   then `getpeername` (what the application sees) and the server's answer
//!   to `who` (which server really accepted);
//! - `udp ADDR` → `ok ID PEER GREETING`: connected UDP, one datagram each way;
//! - `alive ID` → `alive` or `dead MESSAGE`: is TCP connection ID still open;
//! - `close ID` → `closed`;
//! - `storm ADDR THREADS MILLIS STOPFILE` → `storm total=N failed=N
//!   last_ok=N names=NAME:N,...`: THREADS threads connect, ask `who` and
//!   close, in a loop, until STOPFILE exists (at most MILLIS ms); then each
//!   makes one final connect, and `last_ok` counts those that worked; `latest=NAME:NS,...` is, per server, the CLOCK_MONOTONIC time
//!   at which the latest connect that landed there *started*.
//!
//! Every read has a timeout, so a test can never hang on it.

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, ErrorKind, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

const TIMEOUT: Duration = Duration::from_secs(5);

fn main() {
    let mut conns: HashMap<u32, TcpStream> = HashMap::new();
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
    let stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| e.to_string().replace(' ', "_"))?;
    let peer = stream.peer_addr().map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    (&stream).write_all(b"who\n").map_err(|e| format!("send:{}", e.kind()))?;
    let mut greeting = String::new();
    let mut reader = BufReader::new(&stream);
    reader.read_line(&mut greeting).map_err(|e| format!("no_greeting:{}", e.kind()))?;
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
                        Err(_) => {
                            failed += 1;
                            last_ok = false;
                        }
                    }
                    if stopping {
                        break;
                    }
                    stopping = std::time::Instant::now() >= deadline || stop_file.exists();
                }
                (total, failed, last_ok, names, latest)
            })
        })
        .collect();
    let (mut total, mut failed, mut last_ok) = (0, 0, 0);
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut latest: HashMap<String, u64> = HashMap::new();
    for worker in workers {
        let (t, f, ok, n, l) = worker.join().unwrap_or_default();
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
    }
    let mut names: Vec<String> = names.into_iter().map(|(n, c)| format!("{n}:{c}")).collect();
    names.sort();
    let latest: Vec<String> = latest.into_iter().map(|(n, at)| format!("{n}:{at}")).collect();
    format!("storm total={total} failed={failed} last_ok={last_ok} names={} latest={}", names.join(","), latest.join(","))
}

/// CLOCK_MONOTONIC in nanoseconds: comparable across processes.
fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime fills the struct we pass.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid clock id and out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn udp(addr: &str) -> Result<(SocketAddr, String), String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("bad address: {e}"))?;
    let bind: SocketAddr = if addr.is_ipv4() { "0.0.0.0:0".parse().unwrap() } else { "[::]:0".parse().unwrap() };
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
