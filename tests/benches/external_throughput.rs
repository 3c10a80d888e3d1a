//! The external path's throughput, for `cargo xtask bench` (its `external`
//! part): connects and requests per second from a client namespace to one
//! server in another, through the node (this thread's namespace, the
//! external path's test topology), by each route:
//!
//! - `plain`: the server's own address, forwarded by the node's kernel
//!   routing: the baseline;
//! - `lb`: the external VIP (`lb_xdp`, NAT);
//! - `ipvs`: a VIP of IPVS in NAT mode (kube-proxy's IPVS mode), where the
//!   kernel has IPVS and `ipvsadm` is installed;
//! - `haproxy`: `mode tcp` on the node, where haproxy is installed.
//!
//! Workloads, [`CLIENTS`] client threads each: `connect` (connect, one
//! byte each way, the client closes: a new connection per request) and
//! `requests` (one byte each way on connections held open). Runs of
//! [`SECONDS`]; [`ROUNDS`] rounds alternate the routes' order, and a
//! route's ratio is the median of its rounds' ratios to plain routing in
//! the same round. Prints one JSON line; a route that cannot run is
//! listed with why. A connect or request that fails fails the bench.
//! Needs root and `LB_BIN`.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use lb_tests::{Daemon, TestCgroup, in_new_netns, privileged, sh, topology::Topology};

/// Client threads per run (connections held, for `requests`).
const CLIENTS: usize = 2;
/// Server threads: one connection each at a time.
const SERVER_THREADS: usize = 4;
/// Seconds per run.
const SECONDS: f64 = 1.0;
/// Rounds over every route.
const ROUNDS: usize = 5;
const SERVER: &str = "198.18.2.2:8080";
const LB_VIP: &str = "198.18.1.100:80";
const HAPROXY_VIP: &str = "198.18.1.101:80";
const IPVS_VIP: &str = "198.18.1.102:80";

/// What one run measured: operations per second.
type Rate = f64;

fn main() {
    if !privileged() {
        return;
    }
    let report = in_new_netns(run);
    println!("{report}");
}

fn run() -> String {
    let net = Topology::new();
    // Plain routing and IPVS's NAT need the servers' replies to the
    // client to come back through the node.
    net.servers.sh(&["ip", "route", "add", "198.18.0.0/24", "via", "198.18.2.1"]);
    net.client.sh(&["ip", "route", "add", "198.18.2.0/24", "via", "198.18.0.1"]);
    // The client closes first and keeps TIME_WAIT: let it reuse its ports.
    net.client.sh(&["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"]);
    net.client.sh(&["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"]);
    // So may haproxy, which closes its side toward the server first; its
    // ports stay below lb's NAT ports (61000 and up).
    sh(&["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"]);
    sh(&["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 60999"]);
    let stop = Arc::new(AtomicBool::new(false));
    let listener = net.servers.run(|| TcpListener::bind(SERVER).expect("binding the server"));
    let servers: Vec<_> = (0..SERVER_THREADS)
        .map(|_| {
            let (listener, stop) = (listener.try_clone().unwrap(), stop.clone());
            thread::spawn(move || serve(&listener, &stop))
        })
        .collect();

    let cgroup = TestCgroup::new("bench-external");
    let config = format!(
        "[[service]]\nname = \"web\"\nvip = \"{LB_VIP}\"\nservers = [\"{SERVER}\"]\n\
         [service.health]\ncheck = \"none\"\n[service.external]\ninterfaces = [\"ext0\"]\n"
    );
    let daemon = Daemon::start("bench-external", &cgroup, &config);
    let mut routes: Vec<(&str, &str)> = vec![("plain", SERVER), ("lb", LB_VIP)];
    let mut skipped: Vec<(&str, String)> = Vec::new();
    match ipvs() {
        Ok(()) => routes.push(("ipvs", IPVS_VIP)),
        Err(why) => skipped.push(("ipvs", why)),
    }
    let haproxy = haproxy();
    match &haproxy {
        Ok(_) => routes.push(("haproxy", HAPROXY_VIP)),
        Err(why) => skipped.push(("haproxy", why.clone())),
    }

    // connects[route][round], requests[route][round]
    let mut connects = vec![Vec::new(); routes.len()];
    let mut requests = vec![Vec::new(); routes.len()];
    // lb_xdp's runs and run time in the lb route's runs (the kernel's
    // statistics, on while this is held).
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("BPF_ENABLE_STATS");
    let (mut connect_runs, mut request_runs) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let mut order: Vec<usize> = (0..routes.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let to: SocketAddr = routes[i].1.parse().unwrap();
            let lb = routes[i].0 == "lb";
            let before = lb.then(xdp_runs);
            connects[i].push(measure(&net, to, connect_loop));
            let between = lb.then(xdp_runs);
            requests[i].push(measure(&net, to, request_loop));
            if let (Some(before), Some(between)) = (before, between) {
                connect_runs.push(between.since(before));
                request_runs.push(xdp_runs().since(between));
            }
        }
    }
    let counters = daemon.status()["datapath"]["counters"].clone();
    drop(daemon);
    drop(cgroup);
    if let Ok(mut child) = haproxy {
        let _ = child.kill();
        let _ = child.wait();
    }
    stop.store(true, Ordering::Relaxed);
    for server in servers {
        let _ = server.join();
    }

    let rows: Vec<String> = routes
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            format!(
                "{{\"route\":\"{name}\",\"connects_per_s\":{:.0},\"connects_ratio\":{:.3},\"requests_per_s\":{:.0},\"requests_ratio\":{:.3}}}",
                median(connects[i].clone()),
                median_ratio(&connects[i], &connects[0]),
                median(requests[i].clone()),
                median_ratio(&requests[i], &requests[0]),
            )
        })
        .collect();
    let skipped: Vec<String> = skipped
        .iter()
        .map(|(name, why)| format!("{{\"route\":\"{name}\",\"why\":{}}}", serde_json::json!(why)))
        .collect();
    format!(
        "{{\"clients\":{CLIENTS},\"seconds\":{SECONDS},\"rounds\":{ROUNDS},\"routes\":[{}],\"skipped\":[{}],\"nat_ports_exhausted\":{},\"xdp_ns_per_packet_connects\":{:.0},\"xdp_ns_per_packet_requests\":{:.0}}}",
        rows.join(","),
        skipped.join(","),
        counters["xdp_nat_ports_exhausted"],
        median(connect_runs.iter().map(Runs::ns_per_run).collect()),
        median(request_runs.iter().map(Runs::ns_per_run).collect()),
    )
}

/// Runs `work` on [`CLIENTS`] threads in the client's namespace for
/// [`SECONDS`]: operations per second, all of them.
fn measure(net: &Topology, to: SocketAddr, work: fn(SocketAddr, Instant) -> u64) -> Rate {
    let until = Instant::now() + Duration::from_secs_f64(SECONDS);
    let started = Instant::now();
    let threads: Vec<_> = (0..CLIENTS).map(|_| net.client.spawn(move || work(to, until))).collect();
    let done: u64 = threads.into_iter().map(|t| t.join().expect("a client thread")).sum();
    done as f64 / started.elapsed().as_secs_f64()
}

/// New connections until `until`, each one byte each way, closed by the
/// client. Panics on a failure: the figure would not be one.
fn connect_loop(to: SocketAddr, until: Instant) -> u64 {
    let mut done = 0;
    while Instant::now() < until {
        let mut stream = TcpStream::connect_timeout(&to, Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("connecting to {to}: {e}"));
        exchange(&mut stream, to);
        done += 1;
    }
    done
}

/// One byte each way on one connection, until `until`.
fn request_loop(to: SocketAddr, until: Instant) -> u64 {
    let mut stream = TcpStream::connect_timeout(&to, Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("connecting to {to}: {e}"));
    let mut done = 0;
    while Instant::now() < until {
        exchange(&mut stream, to);
        done += 1;
    }
    done
}

fn exchange(stream: &mut TcpStream, to: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut byte = [0u8; 1];
    stream.write_all(b"x").unwrap_or_else(|e| panic!("sending to {to}: {e}"));
    stream.read_exact(&mut byte).unwrap_or_else(|e| panic!("answer from {to}: {e}"));
}

/// Answers each byte with one, a connection at a time, until `stop`
/// (checked between connections and every 100 ms while none comes).
fn serve(listener: &TcpListener, stop: &AtomicBool) {
    listener.set_nonblocking(true).unwrap();
    while !stop.load(Ordering::Relaxed) {
        let Ok((mut stream, _)) = listener.accept() else {
            thread::sleep(Duration::from_micros(50));
            continue;
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
        let mut byte = [0u8; 1];
        loop {
            match stream.read(&mut byte) {
                Ok(1) if stream.write_all(&byte).is_ok() => {}
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        && !stop.load(Ordering::Relaxed) => {}
                _ => break,
            }
        }
    }
}

/// IPVS in NAT mode on the node for [`IPVS_VIP`], or why not.
fn ipvs() -> Result<(), String> {
    let _ = Command::new("modprobe").arg("ip_vs").stderr(Stdio::null()).status();
    if !std::path::Path::new("/proc/net/ip_vs").exists() {
        return Err("this kernel has no IPVS (ip_vs)".to_owned());
    }
    let vip = IPVS_VIP.split(':').next().unwrap();
    sh(&["ip", "addr", "add", &format!("{vip}/32"), "dev", "lo"]);
    let added = Command::new("ipvsadm").args(["-A", "-t", IPVS_VIP, "-s", "rr"]).status();
    if !added.is_ok_and(|s| s.success()) {
        return Err("ipvsadm is not installed or failed".to_owned());
    }
    sh(&["ipvsadm", "-a", "-t", IPVS_VIP, "-r", SERVER, "-m"]);
    Ok(())
}

/// haproxy (`mode tcp`) on the node for [`HAPROXY_VIP`], or why not.
fn haproxy() -> Result<Child, String> {
    let vip = HAPROXY_VIP.split(':').next().unwrap();
    sh(&["ip", "addr", "add", &format!("{vip}/32"), "dev", "lo"]);
    let dir = std::env::temp_dir().join(format!("lb-bench-external-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let config = dir.join("haproxy.cfg");
    std::fs::write(
        &config,
        format!(
            "global\n  maxconn 4000\ndefaults\n  mode tcp\n  timeout connect 5s\n  timeout client 30s\n  \
             timeout server 30s\nfrontend vip\n  bind {HAPROXY_VIP}\n  default_backend servers\n\
             backend servers\n  server s1 {SERVER}\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    let child = Command::new("haproxy")
        .arg("-db")
        .arg("-f")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("haproxy is not installed ({e})"))?;
    // Listening within two seconds, or it failed.
    let mut child = child;
    let to: SocketAddr = HAPROXY_VIP.parse().unwrap();
    let listening = (0..200).any(|_| {
        thread::sleep(Duration::from_millis(10));
        TcpStream::connect_timeout(&to, Duration::from_millis(10)).is_ok()
    });
    let _ = std::fs::remove_dir_all(&dir);
    if listening {
        return Ok(child);
    }
    let _ = child.kill();
    let _ = child.wait();
    Err("haproxy did not start listening".to_owned())
}

/// Runs of every loaded `lb_xdp` and their time, as the kernel counts
/// them while its statistics are on.
#[derive(Clone, Copy)]
struct Runs {
    count: u64,
    time: Duration,
}

impl Runs {
    fn since(self, earlier: Runs) -> Runs {
        Runs { count: self.count - earlier.count, time: self.time - earlier.time }
    }

    fn ns_per_run(&self) -> f64 {
        self.time.as_secs_f64() * 1e9 / self.count.max(1) as f64
    }
}

fn xdp_runs() -> Runs {
    let mut runs = Runs { count: 0, time: Duration::ZERO };
    for program in aya::programs::loaded_programs().flatten() {
        if program.name_as_str() == Some("lb_xdp") {
            runs.count += program.run_count();
            runs.time += program.run_time();
        }
    }
    runs
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The median of `values[i] / baseline[i]`.
fn median_ratio(values: &[f64], baseline: &[f64]) -> f64 {
    median(values.iter().zip(baseline).map(|(v, b)| v / b).collect())
}
