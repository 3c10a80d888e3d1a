//! The external path under a flood of forged SYNs, for `cargo xtask
//! bench` (its `external` part). From the client's namespace, raw frames
//! (`lb_tests::raw::Sender`: `sendmmsg` on an `AF_PACKET` socket):
//! SYNs to the VIP from forged sources in 198.19.0.0/16 (the
//! benchmarking range), at rising rates for [`SECONDS`] each, the last as
//! fast as the generator goes. Meanwhile a legitimate client connects
//! through the VIP, one connection after another (each asks its server's
//! name), and [`HELD`] connections opened before the flood idle.
//!
//! Twice: with the default `[daemon] nat_ports` and with a wide range.
//! Per rate: the forged SYNs sent per second, the share of legitimate
//! connects that reached a server, how many held connections still carry
//! data after it, and what the node did with the forged SYNs (flows
//! opened, refused by the new-flow guard, refused for want of a NAT
//! port). Also the kernel memory of the four flow tables at the default
//! `[daemon] flow_table` (the maps' `memlock`). Prints one JSON line.
//! Needs root and `LB_BIN`.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use lb_tests::{
    Daemon, TestCgroup, in_new_netns,
    packets::{Flags, Mac, Segment},
    privileged, raw,
    topology::{Topology, VIP4, mac_of, who},
    wait_until,
};
use serde_json::json;

/// Forged SYNs per second asked of the generator, step by step; 0: as
/// fast as it goes.
const RATES: [u64; 5] = [1_000, 10_000, 50_000, 200_000, 0];
/// Seconds per rate.
const SECONDS: f64 = 3.0;
/// Connections held through the VIP across the flood.
const HELD: usize = 100;
/// Distinct forged sources, sent round after round.
const SOURCES: u32 = 1 << 17;
/// `[daemon] nat_ports`: the default (4,536 ports), and a wide range
/// (32,768).
const NAT_PORTS: [&str; 2] = ["61000-65535", "32768-65535"];
/// The default `[daemon] flow_table`.
const FLOW_TABLE: u64 = 65_536;

fn main() {
    if !privileged() {
        return;
    }
    let mut memory = 0;
    let configs: Vec<serde_json::Value> = NAT_PORTS
        .iter()
        .map(|&nat_ports| {
            let (rows, bytes) = in_new_netns(move || run(nat_ports));
            memory = bytes;
            json!({ "nat_ports": nat_ports, "rates": rows })
        })
        .collect();
    let report = json!({
        "flow_table": FLOW_TABLE,
        "flow_tables_bytes": memory,
        "held": HELD,
        "seconds": SECONDS,
        "configs": configs,
    });
    println!("{report}");
}

/// The rates, one after another, against a node whose NAT ports are
/// `nat_ports`: a row for each, and the flow tables' memory.
fn run(nat_ports: &str) -> (Vec<serde_json::Value>, u64) {
    // The node's own ephemeral ports below the widest range, as its
    // operator would set them (the daemon reserves the NAT ports).
    std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "20000 32767")
        .expect("setting the ephemeral range");
    let net = Topology::new();
    let (_s1, _s2) = (net.server("s1", "198.18.2.2:8080"), net.server("s2", "198.18.2.3:8080"));
    let cgroup = TestCgroup::new("bench-flood");
    let services = "[[service]]\nname = \"web4\"\nvip = \"198.18.1.100:80\"\n\
                    servers = [\"198.18.2.2:8080\", \"198.18.2.3:8080\"]\n\
                    [service.health]\ncheck = \"tcp\"\ninterval = \"500ms\"\ntimeout = \"500ms\"\n\
                    [service.external]\ninterfaces = [\"ext0\"]\nannounce = \"none\"\n";
    let daemon = Daemon::start_with(
        "bench-flood",
        &cgroup,
        &format!("nat_ports = \"{nat_ports}\""),
        services,
    );
    assert!(
        wait_until(Duration::from_secs(10), || net.ask(VIP4).is_ok()),
        "the VIP never answered:\n{}",
        daemon.log()
    );
    let held: Vec<TcpStream> = (0..HELD)
        .map(|_| {
            let stream = net.connect(VIP4).expect("a held connection");
            who(&stream).expect("a held connection's server");
            stream
        })
        .collect();
    let macs = (raw::parse_mac(&mac_of("ext0")), net.client.run(|| raw::parse_mac(&mac_of("c0"))));
    let forged = Arc::new(forged_syns(macs));
    let mut rows = Vec::new();
    let mut next = 0usize;
    for rate in RATES {
        let before = counters(&daemon);
        let stop = Arc::new(AtomicBool::new(false));
        let client = {
            let stop = Arc::clone(&stop);
            net.client.spawn(move || connect_until(&stop))
        };
        let generator = {
            let forged = Arc::clone(&forged);
            net.client.spawn(move || flood(&forged, next, rate))
        };
        let (sent, seconds) = generator.join().expect("the generator");
        stop.store(true, Ordering::Relaxed);
        let (connected, connects) = client.join().expect("the legitimate client");
        next += sent;
        let after = counters(&daemon);
        let alive = carrying_data(&held);
        let delta = |i: usize| after[i] - before[i];
        rows.push(json!({
            "asked_per_s": rate,
            "sent_per_s": sent as f64 / seconds,
            "connects": connects,
            "connected": connected,
            "held_alive": alive,
            "new_flows": delta(0),
            "guard_refused": delta(1),
            "ports_exhausted": delta(2),
        }));
        // The half-open flows' ports come free before the next rate.
        std::thread::sleep(Duration::from_secs(2));
    }
    let memory = daemon.pid().map_or(0, flow_tables_memlock);
    drop(daemon);
    (rows, memory)
}

/// SYNs from [`SOURCES`] forged clients in 198.19.0.0/16 to the VIP.
fn forged_syns(macs: (Mac, Mac)) -> Vec<Vec<u8>> {
    let vip: SocketAddr = VIP4.parse().unwrap();
    (0..SOURCES)
        .map(|i| {
            let port = 1_024 + (i >> 16) as u16 * 7_919 + (i % 5) as u16;
            let forged = SocketAddr::from(([198, 19, (i >> 8) as u8, i as u8], port));
            Segment::tcp(macs, forged, vip, Flags::SYN, i, 0).frame()
        })
        .collect()
}

/// Sends the forged SYNs from `first` on (round after round) at `rate` a
/// second (0: as fast as it goes) for [`SECONDS`]; returns how many the
/// kernel took and the seconds it took.
fn flood(forged: &[Vec<u8>], first: usize, rate: u64) -> (usize, f64) {
    const BATCH: usize = 64;
    let sender = raw::Sender::new("c0");
    let started = Instant::now();
    let (mut sent, mut at) = (0usize, first % forged.len());
    while started.elapsed().as_secs_f64() < SECONDS {
        if rate > 0 {
            let due = Duration::from_secs_f64(sent as f64 / rate as f64);
            std::thread::sleep(due.saturating_sub(started.elapsed()));
        }
        let end = (at + BATCH).min(forged.len());
        sent += sender.send(&forged[at..end]);
        at = if end == forged.len() { 0 } else { end };
    }
    (sent, started.elapsed().as_secs_f64())
}

/// A legitimate client: one connection through the VIP after another,
/// each asking its server's name, until `stop`; how many reached a
/// server, of how many tried.
fn connect_until(stop: &AtomicBool) -> (u64, u64) {
    let vip: SocketAddr = VIP4.parse().unwrap();
    let (mut connected, mut tried) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        tried += 1;
        // Time for one SYN sent again (after 1 s), as any client allows.
        let answered = TcpStream::connect_timeout(&vip, Duration::from_secs(3))
            .map_err(|e| e.to_string())
            .and_then(|stream| who(&stream));
        if matches!(answered.as_deref(), Ok("s1" | "s2")) {
            connected += 1;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    (connected, tried)
}

/// How many of `held` still carry data: written to twice, neither reset
/// nor closed, with nothing to read (their servers said their names
/// already and only read since).
fn carrying_data(held: &[TcpStream]) -> usize {
    for _ in 0..2 {
        for mut stream in held {
            let _ = stream.write_all(b"still there\n");
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    held.iter()
        .filter(|stream| {
            stream.set_nonblocking(true).unwrap();
            let mut buf = [0u8; 16];
            let alive = matches!((&mut &**stream).read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            stream.set_nonblocking(false).unwrap();
            alive
        })
        .count()
}

/// The node's counters of what it did with new flows: opened, refused by
/// the new-flow guard, refused for want of a NAT port.
fn counters(daemon: &Daemon) -> [u64; 3] {
    ["xdp_new_flow", "xdp_new_flow_limited", "xdp_nat_ports_exhausted"]
        .map(|name| daemon.counter(name))
}

/// The kernel memory of the daemon's flow tables: the `memlock` of its
/// LRU hash maps with flow-table keys (`FlowKey`, `NatKey`: 44 bytes),
/// TCP's and UDP's, from `/proc/PID/fdinfo`.
fn flow_tables_memlock(pid: i32) -> u64 {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else { return 0 };
    fds.filter_map(|fd| std::fs::read_to_string(fd.ok()?.path()).ok())
        .filter(|info| {
            let field = |name: &str| {
                info.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_owned())
            };
            let udp = u64::from(lb_common::udp_flow_table(FLOW_TABLE as u32));
            let sizes = [FLOW_TABLE, udp].map(|n| n.to_string());
            field("map_type:").as_deref() == Some("9")
                && field("key_size:").as_deref() == Some("44")
                && field("max_entries:").is_some_and(|n| sizes.contains(&n))
        })
        .filter_map(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("memlock:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum()
}
