//! The discovery part (issue 11): how fast EndpointSlice changes reach the
//! kernel.
//!
//! - latency: one service whose one endpoint alternates between two
//!   servers; a client in the cgroup connects through the VIP in a loop
//!   (200 µs apart); the time from the change at the API server to the first
//!   connect answered by the new endpoint. [`CHANGES`] changes, p50/p99.
//!   The service's `debounce` is 1 ms (the default, 1 s, would be all there
//!   is to see).
//! - throughput: 1,000 services × 10 endpoints; one endpoint of every
//!   service replaced at once; the time until the daemon's status shows
//!   all 1,000 new selections. Updates/s = 1,000 / that time (median of
//!   [`WAVES`] waves, or of fewer when one takes over 5 s). Also the initial sync: from `lb run` until every service has
//!   its 10 endpoints.
//!
//! The API server is [`FakeApiServer`] below: a minimal copy of the serving
//! part of the tests' fake (`tests/tests/fakes/apiserver.rs`, which is
//! test-only), on plain threads: list and watch of `discovery.k8s.io/v1`
//! EndpointSlices by label selector, chunked watch streams, resourceVersions,
//! no 410s or bookmarks. Loopback only (`127.78.6.1`).

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
        mpsc,
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use lb_tests::{Daemon, ServiceBuilder, TestCgroup};
use serde_json::{Value, json};

use super::{
    Agent, Want, check_stop, median, ms_between,
    paths::Who,
    poll,
    report::{Discovery, Results},
};

pub const CHANGES: usize = 200;
pub const SERVICES: usize = 1_000;
pub const ENDPOINTS: usize = 10;
const WAVES: usize = 3;
/// The port of every endpoint in the throughput services (nothing listens:
/// `check = "none"` and no client).
const PORT: u16 = 8443;

pub fn run(dir: &Path, results: &mut Results) -> anyhow::Result<()> {
    let api = FakeApiServer::start(SocketAddr::from(([127, 78, 6, 1], 0)))?;
    let kubeconfig = dir.join("kubeconfig.yaml");
    std::fs::write(&kubeconfig, kubeconfig_text(&format!("http://{}", api.addr)))?;
    let settings = format!("kubeconfig = {kubeconfig:?}\n");
    let mut discovery = Discovery::default();

    println!("==> discovery: {CHANGES} EndpointSlice changes to the kernel's selection");
    let port = shared_port(&[[127, 78, 6, 11], [127, 78, 6, 12]])?;
    let servers = [
        Who::start("e1", SocketAddr::from(([127, 78, 6, 11], port)))?,
        Who::start("e2", SocketAddr::from(([127, 78, 6, 12], port)))?,
    ];
    let ip = |who: &Who| match who.addr {
        SocketAddr::V4(a) => *a.ip(),
        SocketAddr::V6(_) => unreachable!("IPv4 servers"),
    };
    api.apply("web", &[ip(&servers[0])], port);
    let vip = SocketAddr::from(([127, 78, 6, 100], 443));
    let cgroup = TestCgroup::new("bench-disc");
    let daemon = Daemon::start_with_env(
        "bench-disc",
        &cgroup,
        &settings,
        &[("RUST_LOG", "info")],
        &discovered("web", vip),
    );
    let mut agent = Agent::start(&cgroup.path)?;
    agent.until(vip, &Want::Name("e1"), Duration::from_secs(20), Duration::from_millis(5))?;
    agent.until_done().context("the first EndpointSlice list never reached the kernel")?;
    let mut latencies = Vec::new();
    for i in 0..CHANGES {
        check_stop()?;
        let to = &servers[(i + 1) % 2];
        agent.until(
            vip,
            &Want::Name(&to.name),
            Duration::from_secs(10),
            Duration::from_micros(200),
        )?;
        let changed = lb_tests::monotonic_ns();
        api.apply("web", &[ip(to)], port);
        let landed =
            agent.until_done().with_context(|| format!("EndpointSlice change {}", i + 1))?.at_ns;
        latencies.push(ms_between(changed, landed));
    }
    discovery.latency_ms = latencies;
    println!("  change to kernel: p50 {:.1} ms", median(&discovery.latency_ms));
    drop((agent, daemon, cgroup, servers));

    println!("==> discovery: {SERVICES} services × {ENDPOINTS} endpoints");
    let endpoints = |i: usize, wave: usize| -> Vec<Ipv4Addr> {
        (0..ENDPOINTS)
            .map(|j| {
                let k = i * ENDPOINTS + j;
                // Odd waves move endpoint 0 of every service elsewhere.
                if j == 0 && wave % 2 == 1 {
                    Ipv4Addr::new(127, 83, (i / 250) as u8, (i % 250 + 1) as u8)
                } else {
                    Ipv4Addr::new(127, 82, (k / 250) as u8, (k % 250 + 1) as u8)
                }
            })
            .collect()
    };
    for i in 0..SERVICES {
        api.apply(&format!("svc-{i}"), &endpoints(i, 0), PORT);
    }
    let toml: String = (0..SERVICES)
        .map(|i| {
            discovered(
                &format!("svc-{i}"),
                SocketAddr::from(([127, 84, (i / 250) as u8, (i % 250 + 1) as u8], 443)),
            )
        })
        .collect();
    let cgroup = TestCgroup::new("bench-disc-1k");
    let started = Instant::now();
    let daemon =
        Daemon::start_with_env("bench-disc-1k", &cgroup, &settings, &[("RUST_LOG", "info")], &toml);
    // How many services the kernel shows with the endpoints of `wave`.
    let showing = |wave: usize| -> anyhow::Result<usize> {
        let status = super::status(&daemon)?;
        let services = status["services"].as_array().map_or(&[][..], Vec::as_slice);
        Ok(services
            .iter()
            .filter(|s| {
                let Some(i) = s["name"]
                    .as_str()
                    .and_then(|n| n.strip_prefix("svc-"))
                    .and_then(|i| i.parse::<usize>().ok())
                else {
                    return false;
                };
                let mut want: Vec<String> = endpoints(i, wave)
                    .iter()
                    .map(|ip| SocketAddr::from((*ip, PORT)).to_string())
                    .collect();
                let mut got: Vec<String> = s["selected"]
                    .as_array()
                    .map(|l| l.iter().filter_map(|a| Some(a.as_str()?.to_owned())).collect())
                    .unwrap_or_default();
                want.sort();
                got.sort();
                want == got
            })
            .count())
    };
    let all_show = |wave: usize| Ok(showing(wave)? == SERVICES);
    if !poll(Duration::from_secs(90), Duration::from_millis(20), || all_show(0))? {
        bail!(
            "{SERVICES} discovered services did not all get their {ENDPOINTS} endpoints within 90 s; the daemon's log:\n{}",
            super::tail(&daemon.log())
        );
    }
    discovery.initial_sync = Some(started.elapsed());
    // Every service's watch is open before the changes start.
    if !poll(Duration::from_secs(30), Duration::from_millis(20), || Ok(api.watching() >= SERVICES))?
    {
        bail!("only {} of {SERVICES} watches are open", api.watching());
    }
    let mut rates = Vec::new();
    for wave in 1..=WAVES {
        check_stop()?;
        let started = Instant::now();
        for i in 0..SERVICES {
            api.apply(&format!("svc-{i}"), &endpoints(i, wave), PORT);
        }
        if !poll(Duration::from_secs(60), Duration::from_millis(20), || all_show(wave))? {
            bail!(
                "wave {wave}: {SERVICES} changes did not all reach the kernel within 60 s: {} did; the daemon's log ends:\n{}",
                showing(wave)?,
                super::tail(&daemon.log())
            );
        }
        rates.push(SERVICES as f64 / started.elapsed().as_secs_f64());
        // Slow waves: one is figure enough (the bench stays short).
        if started.elapsed() > Duration::from_secs(5) {
            break;
        }
    }
    discovery.updates_per_second = Some(median(&rates));
    println!(
        "  initial sync {:.2} s; {:.0} updates/s applied",
        discovery.initial_sync.unwrap_or_default().as_secs_f64(),
        discovery.updates_per_second.unwrap_or(f64::NAN)
    );
    drop((daemon, cgroup));
    results.discovery = Some(discovery);
    Ok(())
}

/// A service discovered from the EndpointSlices of the Kubernetes
/// Service of the same name (port `https`), debounce 1 ms.
fn discovered(name: &str, vip: SocketAddr) -> String {
    ServiceBuilder::new(name, vip)
        .raw("[service.discovery]")
        .raw(&format!(
            "kubernetes = {{ namespace = \"default\", service = \"{name}\", port = \"https\" }}"
        ))
        .raw("debounce = \"1ms\"")
        .toml()
}

fn kubeconfig_text(server: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: bench\n  cluster:\n    server: {server}\n\
         contexts:\n- name: bench\n  context:\n    cluster: bench\n    user: bench\n    namespace: default\n\
         current-context: bench\nusers:\n- name: bench\n  user: {{}}\n"
    )
}

/// A port free on every one of `ips` (endpoints of a slice share its port).
fn shared_port(ips: &[[u8; 4]]) -> anyhow::Result<u16> {
    for _ in 0..50 {
        let port = super::free_port(ips[0])?;
        let held: Vec<_> =
            ips.iter().map(|ip| TcpListener::bind(SocketAddr::from((*ip, port)))).collect();
        if held.iter().all(Result::is_ok) {
            return Ok(port);
        }
    }
    bail!("no port free on every one of {ips:?}")
}

/// The EndpointSlice `<service>-1` of a Service: IPv4, port `https`, every
/// endpoint ready.
fn slice(service: &str, ips: &[Ipv4Addr], port: u16, rv: u64) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{service}-1"),
            "namespace": "default",
            "resourceVersion": rv.to_string(),
            "labels": { "kubernetes.io/service-name": service },
        },
        "addressType": "IPv4",
        "ports": [{ "name": "https", "port": port, "protocol": "TCP" }],
        "endpoints": ips.iter().map(|ip| json!({
            "addresses": [ip.to_string()],
            "conditions": { "ready": true, "serving": true, "terminating": false },
        })).collect::<Vec<_>>(),
    })
}

#[derive(Default)]
struct Service {
    /// The one slice, as last applied.
    slice: Option<Value>,
    /// Watch event lines by resourceVersion (the last few), for watches
    /// that start from an older resourceVersion than the newest.
    history: Vec<(u64, String)>,
    watchers: Vec<mpsc::Sender<String>>,
}

#[derive(Default)]
struct State {
    rv: u64,
    services: HashMap<String, Service>,
}

struct Shared {
    state: Mutex<State>,
    stop: AtomicBool,
    watching: AtomicUsize,
    /// Every open connection, to be shut down on drop.
    connections: Mutex<Vec<TcpStream>>,
}

/// The fake API server (see the module's documentation). Dropping it
/// closes the listener and every connection.
struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    listener_fd: i32,
    accept: Option<JoinHandle<()>>,
}

impl FakeApiServer {
    fn start(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr).context("binding the fake API server")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State { rv: 1, ..State::default() }),
            stop: AtomicBool::new(false),
            watching: AtomicUsize::new(0),
            connections: Mutex::new(Vec::new()),
        });
        let listener_fd = listener.as_raw_fd();
        let accepting = shared.clone();
        let accept = thread::spawn(move || {
            for stream in listener.incoming() {
                if accepting.stop.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                if let Ok(clone) = stream.try_clone() {
                    accepting.connections.lock().unwrap().push(clone);
                }
                let shared = accepting.clone();
                // Many watches at once: small stacks.
                let _ = thread::Builder::new().stack_size(128 << 10).spawn(move || {
                    let _ = serve(&shared, stream);
                });
            }
        });
        Ok(Self { addr, shared, listener_fd, accept: Some(accept) })
    }

    /// Creates or replaces the slice of `service`; the change goes to its
    /// open watches at once.
    fn apply(&self, service: &str, ips: &[Ipv4Addr], port: u16) {
        let mut state = self.shared.state.lock().unwrap();
        state.rv += 1;
        let rv = state.rv;
        let object = slice(service, ips, port, rv);
        let entry = state.services.entry(service.to_owned()).or_default();
        let kind = if entry.slice.is_some() { "MODIFIED" } else { "ADDED" };
        let line = json!({ "type": kind, "object": object }).to_string() + "\n";
        entry.slice = Some(object);
        entry.history.push((rv, line.clone()));
        if entry.history.len() > 16 {
            entry.history.remove(0);
        }
        entry.watchers.retain(|w| w.send(line.clone()).is_ok());
    }

    /// Watch streams open now.
    fn watching(&self) -> usize {
        self.shared.watching.load(Ordering::Relaxed)
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        // SAFETY: the listener the accept thread still owns; shutting it
        // down wakes its accept.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        for conn in self.shared.connections.lock().unwrap().drain(..) {
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
        // Watches end at their next wake-up (at most 100 ms).
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.watching() > 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
    }
}

/// One connection: requests until the client closes it; a watch keeps it
/// until the stream ends.
fn serve(shared: &Shared, stream: TcpStream) -> anyhow::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut out = stream;
    loop {
        let mut request = String::new();
        if reader.read_line(&mut request)? == 0 {
            return Ok(());
        }
        // The headers: nothing in them matters here.
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
                break;
            }
        }
        let target = request.split_whitespace().nth(1).unwrap_or("/").to_owned();
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let query: HashMap<String, String> = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (decode(k), decode(v))
            })
            .collect();
        if path != "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices" {
            let body = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}).to_string();
            write!(
                out,
                "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )?;
            continue;
        }
        let service = query
            .get("labelSelector")
            .and_then(|s| s.strip_prefix("kubernetes.io/service-name="))
            .unwrap_or("")
            .to_owned();
        if query.get("watch").is_some_and(|w| w == "true" || w == "1") {
            let from: u64 =
                query.get("resourceVersion").and_then(|rv| rv.parse().ok()).unwrap_or(0);
            let timeout = Duration::from_secs(
                query.get("timeoutSeconds").and_then(|t| t.parse().ok()).unwrap_or(290),
            );
            return watch(shared, out, &service, from, timeout);
        }
        let state = shared.state.lock().unwrap();
        let items: Vec<Value> =
            state.services.get(&service).and_then(|s| s.slice.clone()).into_iter().collect();
        let body = json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSliceList",
            "metadata": { "resourceVersion": state.rv.to_string() },
            "items": items,
        })
        .to_string();
        drop(state);
        write!(
            out,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
    }
}

/// A watch stream: every change after `from`, then changes as they come,
/// one JSON event per line, chunked, until `timeout` or the server stops.
fn watch(
    shared: &Shared,
    mut out: TcpStream,
    service: &str,
    from: u64,
    timeout: Duration,
) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel();
    {
        let mut state = shared.state.lock().unwrap();
        let entry = state.services.entry(service.to_owned()).or_default();
        for (rv, line) in &entry.history {
            if *rv > from {
                let _ = tx.send(line.clone());
            }
        }
        entry.watchers.push(tx);
    }
    write!(
        out,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )?;
    shared.watching.fetch_add(1, Ordering::Relaxed);
    let deadline = Instant::now() + timeout;
    let result = (|| {
        while !shared.stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => write!(out, "{:x}\r\n{line}\r\n", line.len())?,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        write!(out, "0\r\n\r\n")?;
        anyhow::Ok(())
    })();
    shared.watching.fetch_sub(1, Ordering::Relaxed);
    result
}

/// Percent-decoding of a query component (`+` is a space).
fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match u8::from_str_radix(
                std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("zz"),
                16,
            ) {
                Ok(b) => {
                    out.push(b);
                    i += 3;
                }
                Err(_) => {
                    out.push(b'%');
                    i += 1;
                }
            },
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
