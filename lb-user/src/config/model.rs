//! The validated configuration: what the rest of lb reads, every value
//! checked and every default filled in, and the defaults themselves.

use std::{fmt, net::SocketAddr, path::PathBuf, time::Duration};

/// The config file when `--config` is not given.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/lb/config.toml";
/// `daemon.bpffs`: where the programs and maps are pinned.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/lb";
/// `daemon.control_socket`.
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/lb/lb.sock";
/// `daemon.state_dir`: server lists set at runtime, kept across restarts.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/lb";
/// The sizes `[daemon] socket_table` takes (the default is
/// `lb_common::MAX_TRACKED_SOCKETS`). Small tables are for tests; the
/// largest is some 100 MB of kernel memory.
pub const SOCKET_TABLE_SIZES: std::ops::RangeInclusive<i64> = 64..=1 << 20;
/// `daemon.flow_table`: the external path's flows (`FLOWS`,
/// `NAT_REPLIES`, `OPENING_FLOWS`, `OPENING_REPLIES`, each this size; UDP's
/// `UDP_FLOWS` and `UDP_REPLIES` a quarter of it:
/// `lb_common::udp_flow_table`). Preallocated LRU maps of about 344 bytes
/// an entry each (their `memlock`, measured by
/// `tests/benches/syn_flood.rs`): some 101 MB for the six at this size, on
/// every node.
pub const DEFAULT_FLOW_TABLE: u32 = 65_536;
/// The sizes `[daemon] flow_table` takes. Small tables are for tests; the
/// largest is some 5.8 GB of kernel memory.
pub const FLOW_TABLE_SIZES: std::ops::RangeInclusive<i64> = 1_024..=1 << 22;
/// `daemon.new_flows_per_cpu`: new flows the external path opens per CPU
/// per second, at most. A new flow costs `lb_xdp` under a microsecond, so
/// this bounds what a flood of them costs a CPU to about a tenth; a node
/// that opens more flows than this legitimately raises it.
pub const DEFAULT_NEW_FLOWS_PER_CPU: u32 = 100_000;
/// The values `[daemon] new_flows_per_cpu` takes; 0: no limit.
pub const NEW_FLOWS_PER_CPU: std::ops::RangeInclusive<i64> = 0..=100_000_000;
/// A service's `hold_down`.
pub const DEFAULT_HOLD_DOWN: Duration = Duration::from_secs(5);
/// How long discovery waits for a burst of changes to settle (an apiserver
/// adds, removes and re-adds itself while it starts): short enough that a
/// rolling update still moves within about a second.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_secs(1);
/// Bounds of DNS re-resolution: the records' TTL, clamped to these.
pub const DEFAULT_DNS_REFRESH_MIN: Duration = Duration::from_secs(5);
/// The shortest `refresh_min` a DNS source takes: a record with a TTL of 0
/// must not make it ask in a loop.
pub const MIN_DNS_REFRESH: Duration = Duration::from_secs(1);
/// See [`DEFAULT_DNS_REFRESH_MIN`].
pub const DEFAULT_DNS_REFRESH_MAX: Duration = Duration::from_secs(300);

/// A validated configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The `[daemon]` table.
    pub daemon: Daemon,
    /// The `[[service]]` tables, in the file's order.
    pub services: Vec<Service>,
}

/// The `[daemon]` table: where the daemon attaches, pins and listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Daemon {
    /// cgroup v2 directory to attach to; `None`: the root of the cgroup2 mount.
    pub cgroup: Option<PathBuf>,
    /// Where the programs and maps are pinned (on a BPF filesystem).
    pub bpffs: PathBuf,
    /// The control socket of `lb status` and the other client commands.
    pub control_socket: PathBuf,
    /// Where server lists set at runtime are kept across restarts.
    pub state_dir: PathBuf,
    /// Where to serve Prometheus metrics; off when `None`.
    pub metrics: Option<SocketAddr>,
    /// The kubeconfig for Kubernetes discovery; `None`: in-cluster (the
    /// pod's service account), when any service uses it.
    pub kubeconfig: Option<PathBuf>,
    /// How many TCP connections through VIPs the kernel tracks at once
    /// (`SOCKETS`' size, fixed when the datapath is attached).
    pub socket_table: u32,
    /// How many flows the external path keeps (`FLOWS` and `NAT_REPLIES`
    /// each, fixed when the datapath is attached).
    pub flow_table: u32,
    /// How many new flows the external path opens per CPU per second, at
    /// most (0: no limit), fixed when its programs are loaded.
    pub new_flows_per_cpu: u32,
    /// The external path's NAT ports, fixed when its programs are loaded
    /// (`crate::nat_ports`).
    pub nat_ports: std::ops::RangeInclusive<u16>,
    /// The external path's NAT source addresses beside the node's own
    /// address toward each server (`crate::nat_addresses`).
    pub nat_addresses: Vec<std::net::IpAddr>,
    /// This node's name: its identity in the leases it holds (default: the
    /// hostname).
    pub node_name: String,
    /// The timings of the elections by lease.
    pub election: Election,
    /// The elections by membership (`[kubernetes]`).
    pub membership: Membership,
    /// LoadBalancer Services (`[kubernetes] default_class`, `interfaces`,
    /// `[[pool]]`).
    pub load_balancers: LoadBalancers,
    /// `[bgp]`: the speaker that announces `announce = "bgp"` VIPs.
    pub bgp: Option<Bgp>,
}

/// `[bgp]`: lb runs BIRD (`speaker`) with this AS number and router ID,
/// peering with `peers`, and gives it the host routes of the VIPs this
/// node can serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bgp {
    /// This node's AS number.
    pub asn: u32,
    /// Its router ID; `None`: its address toward the first peer.
    pub router_id: Option<std::net::Ipv4Addr>,
    /// The routers it announces to.
    pub peers: Vec<BgpPeer>,
    /// The BIRD 2 binary.
    pub speaker: PathBuf,
    /// How long BIRD keeps announcing after the daemon last renewed its
    /// routes (a daemon killed, frozen or stopped for good): the kernel
    /// serves on with the last selection meanwhile, but nothing checks
    /// the servers any more.
    pub routes_outlive_daemon: Duration,
}

/// One `[[bgp.peer]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BgpPeer {
    /// The router's address (directly connected).
    pub address: std::net::IpAddr,
    /// Its AS number.
    pub asn: u32,
    /// Whether BFD watches the session (sub-second withdrawal).
    pub bfd: bool,
}

/// LoadBalancer Services: which lb serves and the pools their addresses
/// come from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadBalancers {
    /// `[kubernetes] default_class`: also serve LoadBalancer Services that
    /// name no `spec.loadBalancerClass` (default false: only lb's class).
    pub default_class: bool,
    /// `[kubernetes] interfaces`: where their addresses are announced.
    pub interfaces: Vec<String>,
    /// `[[pool]]`, in the file's order (the order addresses are drawn in).
    pub pools: Vec<crate::loadbalancer::pools::Pool>,
}

/// The elections by membership (`[kubernetes] namespace`,
/// `membership_duration`, `membership_renew`): where the nodes' Leases are
/// and how often each node renews its own. Every node must have the same
/// timings: a node counts another gone after its own `duration`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Membership {
    /// lb's namespace (default `lb-system`).
    pub namespace: String,
    /// How long a node stays a member for the others after they last saw
    /// its Lease change; it answers until an eighth of it before that.
    pub duration: Duration,
    /// How often a node writes its Lease when nothing changes.
    pub renew: Duration,
    /// `[kubernetes]` is in the config: a VIP announced by ARP with no
    /// lease of its own is elected by membership unless it says `elect =
    /// false`.
    pub by_default: bool,
}

impl Default for Membership {
    /// Chosen so that a dead node's VIPs move within 1.5 s (about a
    /// duration) and a node costs the API server at most 6 requests and
    /// watch events a second on three nodes: one write per renewal, seen by
    /// each of the three watches (4 / 0.7 s = 5.7).
    fn default() -> Self {
        Self {
            namespace: "lb-system".to_owned(),
            duration: Duration::from_millis(1_200),
            renew: Duration::from_millis(700),
            by_default: false,
        }
    }
}

/// The timings of the elections by lease (`[daemon] lease_*`), chosen so
/// that a VIP moves within 2 s of its holder's death.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Election {
    /// How long a lease lasts unrenewed (`leaseDurationSeconds`: whole
    /// seconds). The holder stops answering a quarter of it before then.
    pub duration: Duration,
    /// How often the holder renews.
    pub renew: Duration,
    /// How often the other nodes look at the lease.
    pub retry: Duration,
}

impl Default for Election {
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(1),
            renew: Duration::from_millis(200),
            retry: Duration::from_millis(200),
        }
    }
}

/// How a service spreads its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// One server at a time: the first usable one.
    Failover,
    /// Every usable server, chosen at random per connection.
    Spread,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Failover => "failover",
            Self::Spread => "spread",
        })
    }
}

/// One `[[service]]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    /// Unique in the file; names the service in commands, status and metrics.
    pub name: String,
    /// The address clients connect to.
    pub vip: SocketAddr,
    /// The servers, in order of preference.
    pub servers: Vec<SocketAddr>,
    /// The server preferred while healthy, if any (a last resort when it is
    /// not in `servers`).
    pub default: Option<SocketAddr>,
    /// How connections spread over the servers.
    pub policy: Policy,
    /// How long the kernel skips a server after a connect to it failed.
    pub hold_down: Duration,
    /// The `[service.health]` table.
    pub health: HealthConfig,
    /// Where the server list comes from besides `servers` (which are then
    /// the bootstrap list); `None`: only `servers` and `lb servers`.
    pub discovery: Option<Discovery>,
    /// Whose connects to the VIP are rewritten.
    pub scope: Scope,
    /// The `[service.external]` table: the VIP is also served to clients
    /// on other machines (the XDP path); `None`: to local clients only.
    pub external: Option<External>,
}

/// The `[service.external]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct External {
    /// Where clients' packets to the VIP arrive (the XDP program is
    /// attached there, and on the interfaces toward the servers).
    pub interfaces: Vec<String>,
    /// How other machines learn that the VIP is here.
    pub announce: Announce,
    /// The lease that elects the one node announcing the VIP; `None`:
    /// this node announces alone, or by membership (`elect`).
    pub lease: Option<LeaseRef>,
    /// One node among those that can serve the VIP announces it, placed
    /// by the elections by membership (`crate::election::membership`).
    /// With `lease` too, a cluster moving from a Lease per VIP: the node
    /// announces only while it holds both (docs/elections.md).
    pub elect: bool,
    /// The servers see the client's own address: destination NAT only
    /// (`externalTrafficPolicy: Local`). Their replies must pass through
    /// this node (it is their gateway), where they are translated back.
    pub keep_client_address: bool,
    /// With `policy = "spread"`, a client's flows from other machines go
    /// to one server, placed by its address alone, while the servers stay
    /// the same (`sessionAffinity: ClientIP`).
    pub client_affinity: bool,
}

/// A `coordination.k8s.io/v1` Lease.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl fmt::Display for LeaseRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// How the node tells its neighbours that a VIP is here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Announce {
    /// Not at all: routing the VIP to the node is the operator's job.
    None,
    /// ARP replies (IPv4) and neighbour advertisements (IPv6) for the VIP
    /// on the listed interfaces, while the service has a usable server.
    Arp,
    /// The VIP's host route, given to the BGP speaker (`[bgp]`) while the
    /// service has a usable server: every such node announces it, and the
    /// routers spread its traffic over them (ECMP).
    Bgp,
}

impl fmt::Display for Announce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Arp => "arp",
            Self::Bgp => "bgp",
        })
    }
}

/// Whose connects to a VIP are rewritten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Only sockets in the daemon's network namespace: a pod dialling its
    /// own loopback reaches its own loopback. The default for loopback VIPs.
    Host,
    /// Sockets in every network namespace of the attached cgroups: for a
    /// VIP that pods must reach too. The default for other VIPs.
    All,
    /// No socket: only clients on other machines reach the VIP, through
    /// the external path; local ones are left to the host's routing (e.g.
    /// kube-proxy's rules for a LoadBalancer address).
    None,
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Host => "host",
            Self::All => "all",
            Self::None => "none",
        })
    }
}

/// A source of a service's server list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Discovery {
    /// The endpoints of a Kubernetes Service (its EndpointSlices), per
    /// endpoint and its conditions.
    Kubernetes {
        /// The Service's namespace.
        namespace: String,
        /// The Service's name.
        service: String,
        /// Which of its ports the servers listen on.
        port: PortRef,
        /// How long a burst of changes settles before it applies.
        debounce: Duration,
        /// Only the endpoints on this node (by the name EndpointSlices
        /// give it): `externalTrafficPolicy: Local`.
        node: Option<String>,
    },
    /// The A (IPv4 VIP) or AAAA (IPv6 VIP) records of `name`, re-resolved
    /// at their TTL clamped to `refresh_min..=refresh_max`.
    Dns {
        /// The name to resolve.
        name: String,
        /// The port of every server found.
        port: u16,
        /// How long a burst of changes settles before it applies.
        debounce: Duration,
        /// The shortest time between two resolutions.
        refresh_min: Duration,
        /// The longest time between two resolutions.
        refresh_max: Duration,
    },
}

impl Discovery {
    /// The source's key in `[service.discovery]` (`kubernetes`, `dns`),
    /// which is also the name of the cargo feature that builds it into lb.
    pub const fn feature(&self) -> &'static str {
        match self {
            Self::Kubernetes { .. } => "kubernetes",
            Self::Dns { .. } => "dns",
        }
    }

    /// Whether this build of lb can follow the source: its feature
    /// ([`Discovery::feature`]) was on.
    pub const fn is_built(&self) -> bool {
        match self {
            Self::Kubernetes { .. } => cfg!(feature = "kubernetes"),
            Self::Dns { .. } => cfg!(feature = "dns"),
        }
    }
}

/// A Service port, by name (`"https"`) or number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortRef {
    /// The port's name in the Service (and its EndpointSlices).
    Name(String),
    /// The port number.
    Number(u16),
}

/// What a health check does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckKind {
    /// A TCP connect.
    Tcp,
    /// An HTTP GET of `path`; a status in `status` passes.
    Http,
    /// The same over TLS.
    Https,
    /// A DNS query over UDP for `query` (`query_type`); any well-formed
    /// answer to it passes, NXDOMAIN included.
    Dns,
    /// No active check: the kernel's connection reports are the only signal.
    None,
}

/// The `[service.health]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthConfig {
    /// What a check does.
    pub check: CheckKind,
    /// The path an HTTP(S) check gets.
    pub path: String,
    /// Time between two checks of a server.
    pub interval: Duration,
    /// How long one check may take before it fails.
    pub timeout: Duration,
    /// Passes in a row that make a server usable again.
    pub rise: u32,
    /// Failures in a row that make a server failed.
    pub fall: u32,
    /// Passing HTTP statuses, inclusive.
    pub status: (u16, u16),
    /// CA bundle to verify HTTPS servers with; the system's when `None`.
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for HTTPS checks, with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// Client key (PEM) of `cert_file`.
    pub key_file: Option<PathBuf>,
    /// TLS server name to verify instead of the server's IP address.
    pub server_name: Option<String>,
    /// Do not verify HTTPS servers' certificates at all.
    pub insecure_skip_verify: bool,
    /// The name a DNS check asks for (fully qualified).
    pub query: String,
    /// The record type a DNS check asks for (`A`, `AAAA`, `SOA`, ...).
    pub query_type: String,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            check: CheckKind::Tcp,
            path: "/".to_owned(),
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            rise: 1,
            fall: 1,
            status: (200, 399),
            ca_file: None,
            cert_file: None,
            key_file: None,
            server_name: None,
            insecure_skip_verify: false,
            query: String::new(),
            query_type: "A".to_owned(),
        }
    }
}
