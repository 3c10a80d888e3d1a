//! `cargo xtask bench`: what the datapath costs an application, as ratios
//! against baselines measured in the same run on the same machine (absolute
//! figures depend on the machine and its load; the ratios much less).
//!
//! - connect + close: a client in the datapath's cgroup connecting to the
//!   VIP, against the same client outside it connecting to the server; and
//!   that client connecting to the server from inside the cgroup, which is
//!   what the programs cost connects that are not to a VIP;
//! - bulk transfer: the same two, and, for contrast, through a userspace
//!   proxy on loopback (what per-node proxies do: every byte crosses user
//!   space twice).
//!
//! Everything is on loopback: the server on 127.78.0.1, the proxy on
//! 127.78.0.2, the VIP 127.78.0.100. The daemon, its cgroup and its pins
//! are the integration tests' (`lb-tests`), removed on every path.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    path::Path,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use lb_tests::{Daemon, TestCgroup, wait_until};

const SERVER: [u8; 4] = [127, 78, 0, 1];
const PROXY: [u8; 4] = [127, 78, 0, 2];
const VIP: &str = "127.78.0.100:80";
const BULK_VIP: &str = "127.78.0.100:81";
/// Connects per round.
const CONNECTS: usize = 3000;
/// Bytes per bulk transfer.
const BULK: u64 = 1 << 30;
/// Rounds per figure; the median is reported.
const ROUNDS: usize = 5;

pub fn run() -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("the benchmark attaches the datapath to a cgroup: run it as root");
    }
    // The daemon is off the data path, but it does handle an event per
    // connection on the same CPUs: measured as shipped, optimized.
    crate::cargo(&["build", "--release", "--package", "lb-user"])?;
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("LB_BIN", crate::target_dir().join("release/lb")) };
    let sink = Sink::start()?;
    let source = start_source()?;
    let proxy = start_proxy(source)?;
    let cgroup = TestCgroup::new("bench");
    let services = format!(
        "[[service]]\nname = \"bench\"\nvip = \"{VIP}\"\nservers = [\"{}\"]\n[service.health]\ncheck = \"none\"\n\
         [[service]]\nname = \"bench-bulk\"\nvip = \"{BULK_VIP}\"\nservers = [\"{}\"]\n[service.health]\ncheck = \"none\"\n",
        sink.addr, source
    );
    let daemon = Daemon::start("bench", &cgroup, &services);
    let active = |status: &serde_json::Value| (0..2).all(|i| status["services"][i]["servers"][0]["state"] == "active");
    if !wait_until(Duration::from_secs(10), || active(&daemon.status())) {
        bail!("the daemon did not make the servers active; its log:\n{}", daemon.log());
    }
    let vip: SocketAddr = VIP.parse()?;
    let bulk_vip: SocketAddr = BULK_VIP.parse()?;
    let inside = Some(cgroup.path.as_path());

    println!("==> connect + close, {CONNECTS} per round, median of {ROUNDS} rounds");
    let routes = [
        Route { label: "direct to the server", cgroup: None, addr: sink.addr },
        Route { label: "direct, in the cgroup", cgroup: inside, addr: sink.addr },
        Route { label: "through the VIP", cgroup: inside, addr: vip },
    ];
    let times = measure(&routes, "connect", CONNECTS as u64, Some(&sink))?;
    report(&routes, &times, "connects/s", |elapsed| CONNECTS as f64 / elapsed.as_secs_f64());

    println!("==> bulk transfer, {} MiB per round, median of {ROUNDS} rounds", BULK >> 20);
    let routes = [
        Route { label: "direct to the server", cgroup: None, addr: source },
        Route { label: "through the VIP", cgroup: inside, addr: bulk_vip },
        Route { label: "through a user proxy", cgroup: None, addr: proxy },
    ];
    let times = measure(&routes, "bulk", BULK, None)?;
    report(&routes, &times, "GB/s", |elapsed| BULK as f64 / elapsed.as_secs_f64() / 1e9);
    Ok(())
}

/// Where a benchmark client connects from and to.
struct Route<'a> {
    label: &'static str,
    /// The cgroup the client runs in; `None`: outside the datapath's.
    cgroup: Option<&'a Path>,
    addr: SocketAddr,
}

/// Runs the client `mode` over every route, the routes interleaved round
/// after round so that a change in the machine's load hits them alike.
/// Returns each route's median time. With `sink`, checks that every one
/// of the `amount` connects reached the server.
fn measure(routes: &[Route], mode: &str, amount: u64, sink: Option<&Sink>) -> anyhow::Result<Vec<Duration>> {
    let mut samples = vec![Vec::new(); routes.len()];
    for _ in 0..ROUNDS {
        for (route, samples) in routes.iter().zip(&mut samples) {
            let before = sink.map(Sink::accepted);
            samples.push(client(route.cgroup, mode, route.addr, amount)?);
            if let (Some(sink), Some(before)) = (sink, before)
                && (sink.accepted() - before) as u64 != amount
            {
                bail!("{amount} connects {}, but the server accepted {}", route.label, sink.accepted() - before);
            }
        }
    }
    Ok(samples.iter_mut().map(|samples| median(samples)).collect())
}

/// One line per route: its figure, and the ratio to the first route's.
fn report(routes: &[Route], times: &[Duration], unit: &str, figure: impl Fn(Duration) -> f64) {
    let base = figure(times[0]);
    for (i, (route, time)) in routes.iter().zip(times).enumerate() {
        let value = figure(*time);
        let ratio = if i == 0 { String::new() } else { format!("   ratio {:.2}", value / base) };
        let value = if value >= 100.0 { format!("{value:.0}") } else { format!("{value:.2}") };
        println!("{}", format!("  {:<22} {value:>9} {unit:<10}{ratio}", route.label).trim_end());
    }
}

/// Runs `xtask bench-client MODE ADDR AMOUNT`, inside `cgroup` if given,
/// and returns the time it measured.
fn client(cgroup: Option<&Path>, mode: &str, addr: SocketAddr, amount: u64) -> anyhow::Result<Duration> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["bench-client", mode, &addr.to_string(), &amount.to_string()]);
    if let Some(cgroup) = cgroup {
        lb_tests::start_in_cgroup(&mut cmd, cgroup);
    }
    let out = cmd.output().context("running xtask bench-client")?;
    if !out.status.success() {
        bail!("bench-client {mode} {addr} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let nanos: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().context("bench-client printed no duration")?;
    Ok(Duration::from_nanos(nanos))
}

/// `xtask bench-client`: `connect ADDR N` connects N times, each waiting
/// for the server to close; `bulk ADDR BYTES` reads BYTES from one
/// connection. Prints the nanoseconds it took.
pub fn client_main(mode: &str, addr: &str, amount: u64) -> anyhow::Result<()> {
    let addr: SocketAddr = addr.parse().with_context(|| format!("bad address {addr}"))?;
    let mut buf = vec![0u8; 256 << 10];
    let started = Instant::now();
    match mode {
        "connect" => {
            for _ in 0..amount {
                let mut stream = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
                // The server closes first, so the TIME_WAIT is its own.
                while stream.read(&mut buf)? > 0 {}
            }
        }
        "bulk" => {
            let mut stream = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
            let mut got = 0u64;
            loop {
                match stream.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => got += n as u64,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if got != amount {
                bail!("read {got} bytes from {addr}, expected {amount}");
            }
        }
        other => bail!("unknown bench-client mode {other:?}"),
    }
    println!("{}", started.elapsed().as_nanos());
    Ok(())
}

fn median(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Accepts connections and closes them at once, counting them.
struct Sink {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
}

impl Sink {
    fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind(SocketAddr::from((SERVER, 0))).context("binding the bench server")?;
        let addr = listener.local_addr()?;
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        // Ends with the process.
        thread::spawn(move || {
            for stream in listener.incoming() {
                if stream.is_ok() {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Ok(Self { addr, accepted })
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }
}

/// A server that sends `BULK` bytes on every connection, then closes it.
fn start_source() -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(SocketAddr::from((SERVER, 0))).context("binding the bench server")?;
    let addr = listener.local_addr()?;
    thread::spawn(move || {
        for mut stream in listener.incoming().filter_map(Result::ok) {
            thread::spawn(move || {
                let chunk = vec![0x5au8; 256 << 10];
                let mut left = BULK;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    if stream.write_all(&chunk[..n]).is_err() {
                        return;
                    }
                    left -= n as u64;
                }
            });
        }
    });
    Ok(addr)
}

/// A userspace TCP proxy to `upstream`, copying with `std::io::copy` (which
/// splices between sockets on Linux, as Go's proxies do).
fn start_proxy(upstream: SocketAddr) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(SocketAddr::from((PROXY, 0))).context("binding the bench proxy")?;
    let addr = listener.local_addr()?;
    thread::spawn(move || {
        for downstream in listener.incoming().filter_map(Result::ok) {
            let Ok(upstream) = TcpStream::connect(upstream) else { continue };
            let (Ok(mut down_read), Ok(mut up_write)) = (downstream.try_clone(), upstream.try_clone()) else { continue };
            thread::spawn(move || {
                let _ = std::io::copy(&mut down_read, &mut up_write);
                let _ = up_write.shutdown(Shutdown::Write);
            });
            let (mut up_read, mut down_write) = (upstream, downstream);
            thread::spawn(move || {
                let _ = std::io::copy(&mut up_read, &mut down_write);
                let _ = down_write.shutdown(Shutdown::Write);
            });
        }
    });
    Ok(addr)
}
