//! What the bench measured: plain data that the measurement modules fill
//! in and [`report`](super::report) writes out.

use std::time::Duration;

use super::{
    args::{Args, Part},
    format::{ms, services},
    paths::Route,
};

/// One route's figure in one workload (medians of its runs).
#[derive(Clone, Copy, Debug)]
pub struct Figure {
    /// Requests/s, connects/s or GB/s.
    pub value: f64,
    /// wrk's 99th percentile latency.
    pub p99_ms: Option<f64>,
    /// The median of this route's ratios to the direct route, run by run
    /// (each over the direct run of the same round).
    pub ratio: f64,
    /// The interquartile range of those ratios: how much they moved.
    pub spread: (f64, f64),
}

impl Figure {
    pub fn describe(&self) -> String {
        let value = if self.value >= 1000.0 {
            format!("{:.1}k", self.value / 1000.0)
        } else {
            format!("{:.2}", self.value)
        };
        match self.p99_ms {
            Some(p99) => format!("{value:>8}  p99 {p99:.2} ms"),
            None => format!("{value:>8}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    KeepAlive,
    NewConnection,
    Connect,
    Bulk,
}

impl Workload {
    pub const fn label(self) -> &'static str {
        match self {
            Self::KeepAlive => "wrk keep-alive",
            Self::NewConnection => "wrk new conn. per request",
            Self::Connect => "connect + close",
            Self::Bulk => "bulk 1 GiB",
        }
    }

    pub const fn unit(self) -> &'static str {
        match self {
            Self::KeepAlive | Self::NewConnection => "req/s",
            Self::Connect => "conn/s",
            Self::Bulk => "GB/s",
        }
    }
}

/// One lb program's cost per connect on one route.
pub struct KernelCost {
    pub route: Route,
    pub program: String,
    pub runs_per_connect: f64,
    pub ns_per_connect: f64,
}

/// All lb programs during one wrk keep-alive run through the VIP, with
/// `bpf_stats`.
#[derive(Clone, Copy, Debug)]
pub struct KeepAliveCost {
    pub requests: u64,
    pub runs: u64,
    pub ns: u64,
}

/// One daemon start; `None`: no status answer within the harness's 60 s.
pub struct Startup {
    pub services: usize,
    /// From starting `lb run` to its first status answer.
    pub answered: Option<Duration>,
    /// From starting `lb run` to a status listing every service with a selection.
    pub ready: Option<Duration>,
    /// VmRSS then, bytes.
    pub rss: Option<u64>,
}

impl Startup {
    pub fn describe(&self) -> String {
        match (self.answered, self.ready, self.rss) {
            (Some(answered), Some(ready), Some(rss)) => {
                format!(
                    "{}: first status answer {}, all listed with selections {}, RSS {:.0} MB",
                    services(self.services),
                    ms(answered),
                    ms(ready),
                    rss as f64 / 1e6
                )
            }
            _ => format!("{}: no status answer within 60 s", services(self.services)),
        }
    }
}

#[derive(Default)]
pub struct Scale {
    pub startups: Vec<Startup>,
    /// Connects/s through one VIP: (1 service, 1,000 services).
    pub connects: Option<(f64, f64)>,
    pub reload_ms: Vec<f64>,
}

pub struct Failover {
    /// Kernel path: from the kill to a connect answered elsewhere.
    pub kernel_ms: Vec<f64>,
    /// Kernel path: from the refused connect's return to that answer.
    pub reaction_ms: Vec<f64>,
    /// Kernel path: the most connects that failed in one kill.
    pub failed_max: u64,
    pub daemon_ms: Vec<f64>,
}

/// How long kernel reports waited for the daemon's decision: (reports,
/// p50 ms, p99 ms), idle and under load.
pub struct OwnerLoop {
    pub idle: (usize, f64, f64),
    pub loaded: (usize, f64, f64),
    /// Sockets in the table during the loaded phase.
    pub tracked: u64,
    /// Scrapes and status requests answered during the loaded phase.
    pub scrapes: usize,
    pub statuses: usize,
}

/// A way to the DNS server in the DNS part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DnsRoute {
    Direct,
    Vip,
    Forwarder,
}

impl DnsRoute {
    pub fn label(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Vip => "lb VIP",
            Self::Forwarder => "dnsmasq forwarder",
        }
    }
}

/// The DNS part: queries per second (medians), the VIP's ratio to direct
/// (median of the paired ratios), queries lost, how the VIP's sends were
/// rewritten (counter deltas), and per lb program its runs and run time
/// per query (name, runs, ns) over `queries_for_programs` queries.
/// The external path: `lb_xdp`'s program time per packet, IPv4 then
/// IPv6, beside the reference forwarder's; the pass-through program's
/// single run (the kernel's timing overhead, taken off every case) and
/// its time per packet over repeats, in nanoseconds.
/// And per route (plain routing first, then lb, IPVS, haproxy) connects
/// and requests per second, with their ratios to plain routing; routes
/// that could not run, with why.
pub struct External {
    pub program: Vec<ProgramTime>,
    pub overhead_ns: f64,
    pub pass_ns: f64,
    /// lb_xdp's average run time per packet on real traffic (the kernel's
    /// statistics) in the throughput bench's lb runs: connects, requests.
    pub live_connects_ns: f64,
    pub live_requests_ns: f64,
    pub routes: Vec<ExternalRoute>,
    pub skipped: Vec<(String, String)>,
    /// The SYN flood bench, rate by rate.
    pub flood: Option<Flood>,
}

/// One family's program time per packet, in nanoseconds: `lb_xdp`'s, and
/// the reference forwarder's on the same frames (medians of single runs,
/// each less the pass-through's beside it; the packet not the VIP's: an
/// average of repeats).
pub struct ProgramTime {
    pub family: &'static str,
    pub first_ns: f64,
    pub established_ns: f64,
    pub reply_ns: f64,
    pub not_ours_ns: f64,
    pub reference_established_ns: f64,
    pub reference_reply_ns: f64,
}

impl ProgramTime {
    /// `lb_xdp`'s cases beside their yardsticks, each with its goal.
    pub fn cases(&self, pass_ns: f64) -> [Yardstick; 4] {
        let case =
            |what, lb_ns, yardstick_ns, at_most| Yardstick { what, lb_ns, yardstick_ns, at_most };
        [
            case(
                "an established flow's packet",
                self.established_ns,
                self.reference_established_ns,
                1.3,
            ),
            case("a server's reply", self.reply_ns, self.reference_reply_ns, 1.3),
            case(
                "a flow's first packet (choice, NAT port, inserts)",
                self.first_ns,
                self.reference_established_ns,
                4.0,
            ),
            case(
                "a packet not lb's (yardstick: a pass-through program)",
                self.not_ours_ns,
                pass_ns,
                1.1,
            ),
        ]
    }
}

/// One of `lb_xdp`'s cases beside what it is measured against: it must
/// take at most `at_most` times the yardstick's time.
pub struct Yardstick {
    pub what: &'static str,
    pub lb_ns: f64,
    pub yardstick_ns: f64,
    pub at_most: f64,
}

impl Yardstick {
    pub fn ratio(&self) -> f64 {
        if self.yardstick_ns > 0.0 { self.lb_ns / self.yardstick_ns } else { f64::INFINITY }
    }
}

/// The external path under forged SYNs (`tests/benches/syn_flood.rs`):
/// the flow tables' size and memory, and for each `[daemon] nat_ports`
/// tried, one row per rate.
pub struct Flood {
    pub flow_table: u64,
    pub flow_tables_bytes: u64,
    pub held: u64,
    pub configs: Vec<(String, Vec<FloodRate>)>,
}

/// One rate of the SYN flood bench.
pub struct FloodRate {
    /// Asked of the generator (0: as fast as it goes), and what it sent.
    pub asked_per_s: u64,
    pub sent_per_s: f64,
    /// Legitimate connects that reached a server, of those tried.
    pub connected: u64,
    pub connects: u64,
    /// Held connections that still carry data after this rate.
    pub held_alive: u64,
    /// What the node did with new flows meanwhile: opened, refused by the
    /// new-flow guard, refused for want of a NAT port.
    pub new_flows: u64,
    pub guard_refused: u64,
    pub ports_exhausted: u64,
}

/// One route of the external throughput bench.
pub struct ExternalRoute {
    pub name: String,
    pub connects_per_s: f64,
    pub connects_ratio: f64,
    pub requests_per_s: f64,
    pub requests_ratio: f64,
}

impl External {
    pub fn route(&self, name: &str) -> Option<&ExternalRoute> {
        self.routes.iter().find(|r| r.name == name)
    }
}

/// The elections: the holder's death to the first connect answered by
/// another node, and to its first ARP answer (ms, one per round); the
/// Lease requests per second the nodes make for one VIP in steady state.
pub struct Election {
    pub nodes: usize,
    pub rounds: usize,
    pub failed_rounds: usize,
    pub lease_duration_ms: f64,
    pub renew_ms: f64,
    pub retry_ms: f64,
    pub takeover_connect_ms: Vec<f64>,
    pub takeover_arp_ms: Vec<f64>,
    pub api_requests_per_s: f64,
    /// The elections by membership beside per-VIP Leases
    /// (`tests/benches/membership.rs`).
    pub membership: Option<Membership>,
}

/// The API load of the two ways of electing, at each VIP count, and the
/// takeovers by membership with the most VIPs.
pub struct Membership {
    /// (way, VIPs, figures), per VIP first.
    pub load: Vec<(&'static str, usize, ApiLoad)>,
    pub takeover_vips: usize,
    /// Node deaths: one figure each in `takeover_ms` unless one failed.
    pub takeover_rounds: usize,
    pub takeover_ms: Vec<f64>,
    /// The same node detached (`lb detach`) instead, one figure each.
    pub graceful_rounds: usize,
    pub graceful_ms: Vec<f64>,
}

/// One steady state's cost to the API server, three nodes together.
pub struct ApiLoad {
    pub requests_per_s: f64,
    pub watch_events_per_s: f64,
    /// Requests per second by verb (GET, PUT, LIST, WATCH...).
    pub by_verb: Vec<(String, f64)>,
}

impl ApiLoad {
    /// Requests and watch events per second, per node (of three).
    pub fn per_node(&self) -> f64 {
        (self.requests_per_s + self.watch_events_per_s) / 3.0
    }
}

/// LoadBalancer Services (`tests/benches/load_balancers.rs`): from a
/// Service's creation to each step, (p50, p99) in ms; the steady state's
/// API load with every Service served, three nodes together.
pub struct LoadBalancers {
    pub nodes: usize,
    pub services: usize,
    pub to_status_ms: (f64, f64),
    pub to_claim_ms: (f64, f64),
    pub to_connect_ms: (f64, f64),
    pub lease_requests_per_s: f64,
    pub lists_and_watches_per_s: f64,
    pub status_writes_per_s: f64,
    pub watch_events_per_s: f64,
    pub watches_open: usize,
}

/// Announcing by BGP (`tests/benches/bgp.rs`).
pub struct Bgp {
    pub clients: usize,
    pub measure_s: f64,
    pub steps: Vec<BgpStep>,
    pub rounds: usize,
    pub failed_rounds: usize,
    /// From a node's death to the router withdrawing it, each round.
    pub withdrawn_ms: Vec<f64>,
}

/// One step of the BGP part: how many nodes announce, and how.
pub struct BgpStep {
    pub what: &'static str,
    pub connects_per_s: f64,
    /// Connects answered by each node's server ("failed": none).
    pub answered: Vec<(String, u64)>,
}

pub struct Dns {
    pub rounds: u32,
    pub qps: Vec<(DnsRoute, f64)>,
    pub lost: Vec<(DnsRoute, u64)>,
    pub vip_ratio: f64,
    pub rewritten: Vec<(String, u64)>,
    pub programs: Vec<(String, f64, f64)>,
    pub queries_for_programs: u64,
}

impl Dns {
    pub fn qps(&self, route: DnsRoute) -> f64 {
        self.qps.iter().find(|(r, _)| *r == route).map_or(0.0, |(_, q)| *q)
    }
}

#[derive(Default)]
pub struct Discovery {
    pub latency_ms: Vec<f64>,
    pub initial_sync: Option<Duration>,
    pub updates_per_second: Option<f64>,
}

pub struct Results {
    pub rounds: u32,
    pub wrk_seconds: u64,
    pub parts: Vec<Part>,
    pub versions: Vec<(String, String)>,
    pub paths: Vec<(Workload, Vec<(Route, Figure)>)>,
    /// (what, daemon CPU time, connects or requests during it).
    pub daemon_cpu: Vec<(String, Duration, u64)>,
    pub kernel_cost: Vec<KernelCost>,
    pub keepalive_cost: Option<KeepAliveCost>,
    pub scale: Option<Scale>,
    pub failover: Option<Failover>,
    pub discovery: Option<Discovery>,
    pub owner_loop: Option<OwnerLoop>,
    pub dns: Option<Dns>,
    pub external: Option<External>,
    pub election: Option<Election>,
    pub load_balancers: Option<LoadBalancers>,
    pub bgp: Option<Bgp>,
    pub notes: Vec<String>,
    pub duration: Duration,
    /// The 1-minute load average when the run started: other work on the
    /// machine shows in the figures.
    pub load_at_start: String,
}

impl Results {
    pub fn new(args: &Args, parts: &[Part]) -> Self {
        Self {
            rounds: args.rounds,
            wrk_seconds: args.wrk_seconds,
            parts: parts.to_vec(),
            versions: Vec::new(),
            paths: Vec::new(),
            daemon_cpu: Vec::new(),
            kernel_cost: Vec::new(),
            keepalive_cost: None,
            scale: None,
            failover: None,
            discovery: None,
            owner_loop: None,
            dns: None,
            external: None,
            election: None,
            load_balancers: None,
            bgp: None,
            notes: Vec::new(),
            duration: Duration::ZERO,
            load_at_start: load_average(),
        }
    }

    pub fn figure(&self, workload: Workload, route: Route) -> Option<Figure> {
        let (_, figures) = self.paths.iter().find(|(w, _)| *w == workload)?;
        figures.iter().find(|(r, _)| *r == route).map(|(_, f)| *f)
    }

    /// `route`'s figure over the direct route's, in `workload` (the median
    /// of the paired ratios).
    pub fn ratio(&self, workload: Workload, route: Route) -> Option<f64> {
        Some(self.figure(workload, route)?.ratio)
    }
}

/// The 1-minute load average now.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_owned()
}
