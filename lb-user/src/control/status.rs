//! `lb status --json`: what the daemon answers to [`Request::Status`](super::Request::Status).
//! Fields are only ever added, never changed; a field added later has
//! `#[serde(default)]`, so a client reads an older daemon's answer.

use std::{collections::BTreeMap, net::SocketAddr};

use serde::{Deserialize, Serialize};

/// `lb status --json`. Fields are only ever added, never changed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// Every service, in the config's order.
    pub services: Vec<ServiceStatus>,
    /// The kernel side: where it is attached, its counters and features.
    #[serde(default)]
    pub datapath: DatapathStatus,
    /// The config file and its last reload.
    #[serde(default)]
    pub config: ConfigStatus,
    /// The LoadBalancer Services the nodes serve, when the config has
    /// pools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balancers: Option<LoadBalancersStatus>,
    /// The BGP speaker, when the config has `[bgp]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bgp: Option<BgpStatus>,
}

/// The BGP speaker (`[bgp]`): its sessions as BIRD says, and the VIPs it
/// was last told to announce.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgpStatus {
    /// Each peer's session.
    pub sessions: Vec<BgpSession>,
    /// The VIPs whose host routes this node announces.
    pub announced: Vec<std::net::IpAddr>,
}

/// One BGP session.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgpSession {
    /// lb's name for it (`lb_peer0` for the first `[[bgp.peer]]`).
    pub name: String,
    /// The peer's address (`[[bgp.peer]] address`).
    #[serde(default)]
    pub peer: String,
    /// BIRD's state (`up`, `start`...).
    pub state: String,
    /// BIRD's info (`Established`, `Idle Error: BFD session down`...).
    pub info: String,
    /// The BFD session's state with the peer (`Up`, `Down`, `Init`), if
    /// BFD watches the session and BIRD has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bfd: Option<String>,
}

/// LoadBalancer Services (`[[pool]]`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadBalancersStatus {
    /// This node gives the Services their addresses now (one node does).
    pub allocating: bool,
    /// Each Service with an address, by namespace and name.
    pub services: Vec<LoadBalancerStatus>,
}

/// One LoadBalancer Service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadBalancerStatus {
    /// `namespace/name`.
    pub service: String,
    /// Its addresses (its status's, in a pool).
    pub addresses: Vec<std::net::IpAddr>,
    /// The pool of its first address.
    pub pool: Option<String>,
    /// Its port numbers.
    pub ports: Vec<u16>,
    /// Its traffic policy as served (`Cluster`).
    pub traffic_policy: String,
    /// The services serving it (in `services`, one per address and port).
    pub served_as: Vec<String>,
}

/// The config file the daemon runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigStatus {
    /// Its path, as the daemon was given it.
    pub path: String,
    /// The last reload (SIGHUP or `lb reload`), if any.
    pub last_reload: Option<ReloadStatus>,
}

/// How a reload went.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadStatus {
    /// The new config was applied.
    pub ok: bool,
    /// Why it failed (the old config keeps serving), or `null`.
    pub error: Option<String>,
    /// Seconds since the Unix epoch.
    pub at: u64,
}

/// One service: the balancer's view and the kernel's, side by side.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceStatus {
    /// Its name in the config.
    pub name: String,
    /// The address clients connect to.
    pub vip: SocketAddr,
    /// `failover` or `spread`.
    pub policy: String,
    /// The selection in the kernel, best first.
    pub selected: Vec<SocketAddr>,
    /// Every server of the service, in the list's order.
    pub servers: Vec<ServerStatus>,
    /// Whose connects are rewritten: `host` (this network namespace) or `all`.
    #[serde(default)]
    pub scope: String,
    /// The discovery source, if the service has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discovery: Option<DiscoveryStatus>,
    /// Its `[service.external]`: the VIP served to other machines.
    #[serde(default)]
    pub external: Option<ServiceExternal>,
}

/// A service's external path, as `lb status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceExternal {
    /// Where clients' packets arrive.
    pub interfaces: Vec<String>,
    /// How the VIP is announced: `none` or `arp`.
    pub announce: String,
    /// Whether the node announces the VIP now (always false for `none`).
    pub announcing: bool,
    /// Its election, with `lease = { .. }`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseStatus>,
}

/// Where this node stands in a VIP's election by lease.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseStatus {
    /// The Lease, `namespace/name`.
    pub lease: String,
    /// This node's name.
    pub node: String,
    /// This node's identity in the lease: its name and its token.
    #[serde(default)]
    pub identity: Option<String>,
    /// `holder`, `candidate`, `not eligible` or `starting`.
    pub role: String,
    /// Why the node is not eligible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// The holder as last read (`None`: released or not read yet).
    #[serde(default)]
    pub holder: Option<String>,
    /// How long ago the lease last changed, as this node saw it.
    #[serde(default)]
    pub changed_ms_ago: Option<u64>,
    /// The last time this node took the lease.
    #[serde(default)]
    pub last_takeover: Option<TakeoverStatus>,
    /// The last request's failure, until one succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A takeover of a lease by this node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakeoverStatus {
    /// How long ago.
    pub ms_ago: u64,
    /// From the previous holder's last renewal seen (or from when this
    /// node began to wait) to the lease being this node's.
    pub took_ms: u64,
    /// The previous holder.
    pub from: Option<String>,
}

/// How a service's discovery is going.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiscoveryStatus {
    /// `kubernetes` or `dns`.
    pub source: String,
    /// Seconds since the Unix epoch of the last successful sync, or `null`.
    pub last_success: Option<u64>,
    /// Why the last sync failed, or why its result was not applied (an
    /// empty list keeps the last one); `null` when the last sync applied.
    pub last_error: Option<String>,
    /// Endpoints left out of the last list: a service holds at most 16.
    pub truncated: usize,
}

/// One server of a service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerStatus {
    /// Where its connections go.
    pub address: SocketAddr,
    /// Live connections through the VIP to this server.
    pub connections: i64,
    /// `active`, `preferred`, `healthy`, `recovering`, `unchecked`,
    /// `standby`, `failed` (see the balancer).
    pub state: String,
    /// Result of the last health check; `null` until one is known.
    pub healthy: Option<bool>,
    /// Error of the last failed health check, or `null`.
    pub last_check: Option<String>,
    /// `ready`, `serving` (drained) or `terminating`.
    pub readiness: String,
    /// It is the service's default (preferred while healthy).
    pub default: bool,
    /// A connect to it through a VIP failed within the hold-down; the
    /// kernel skips it while another server is usable.
    pub recently_failed: bool,
}

/// The kernel programs and maps.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatapathStatus {
    /// The cgroup the programs are attached to.
    pub cgroup: String,
    /// Where the programs and maps are pinned.
    pub bpffs: String,
    /// The programs were already attached when this daemon started.
    pub adopted: bool,
    /// The kernel's per-reason decision counters.
    pub counters: BTreeMap<String, u64>,
    /// Optional kernel features and whether this kernel has them.
    #[serde(default)]
    pub features: Features,
    /// Sockets the kernel tracks as connected through a VIP, by table.
    #[serde(default)]
    pub tracked_sockets: TrackedSockets,
    /// The external path (XDP), when a service has `[service.external]`.
    #[serde(default)]
    pub external: Option<ExternalStatus>,
}

/// The external path: where its program runs, its tables, its traffic.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExternalStatus {
    /// The interfaces it runs on (or should and cannot).
    pub interfaces: Vec<InterfaceStatus>,
    /// Flows in the flow tables (client → VIP).
    pub flows: usize,
    /// Of `flows`, the established TCP flows (in their own table, which
    /// new flows never evict).
    pub established_flows: usize,
    /// Each flow table's size (`[daemon] flow_table`).
    pub flow_capacity: usize,
    /// NAT ports in use (one per flow), of `nat_port_capacity` per server.
    pub nat_ports: usize,
    /// NAT ports each (server, node address) pair has.
    pub nat_port_capacity: usize,
    /// Packets and bytes forwarded to each server since the pins were made.
    pub traffic: Vec<TrafficStatus>,
    /// Whether the kernel forwards IP packets here (`net.ipv4.ip_forward`,
    /// `net.ipv6.conf.all.forwarding`): without it the kernel's FIB refuses
    /// the XDP program's lookups and nothing is forwarded.
    pub forwarding: bool,
}

#[cfg(test)]
impl ExternalStatus {
    /// An external path for the tests of what shows it: eth1 attached,
    /// eth9 not, 3 flows, one server's traffic; IP forwarding as given.
    pub(crate) fn sample(forwarding: bool) -> Self {
        Self {
            interfaces: vec![
                InterfaceStatus {
                    name: "eth1".into(),
                    role: "clients".into(),
                    mode: Some("native".into()),
                    error: None,
                },
                InterfaceStatus {
                    name: "eth9".into(),
                    role: "clients".into(),
                    mode: None,
                    error: Some("no such interface".into()),
                },
            ],
            flows: 3,
            established_flows: 2,
            flow_capacity: 16_384,
            nat_ports: 3,
            nat_port_capacity: 4_536,
            traffic: vec![TrafficStatus {
                server: "198.18.2.2:8080".parse().unwrap(),
                packets: 10,
                bytes: 600,
            }],
            forwarding,
        }
    }
}

/// One interface of the external path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterfaceStatus {
    /// Its name.
    pub name: String,
    /// Why it is used: `clients` (listed in `[service.external]`),
    /// `servers` (replies arrive there), or both.
    pub role: String,
    /// `native` (in the driver) or `generic` (after the stack's skb is
    /// made: slower); `None` when not attached.
    pub mode: Option<String>,
    /// Why it is not attached.
    pub error: Option<String>,
}

/// What the external path forwarded to one server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrafficStatus {
    /// The server.
    pub server: SocketAddr,
    /// Packets forwarded to it.
    pub packets: u64,
    /// Their bytes (IP headers and payload).
    pub bytes: u64,
}

/// Sockets in the kernel's socket tables.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrackedSockets {
    /// TCP sockets that connected through a VIP and are not closed yet.
    pub tcp: usize,
    /// Connected UDP sockets (tracked apart: they never take TCP's slots).
    pub udp: usize,
    /// How many TCP sockets the table holds (`[daemon] socket_table` at
    /// attach).
    #[serde(default)]
    pub tcp_capacity: usize,
    /// How many connected UDP sockets the table holds.
    #[serde(default)]
    pub udp_capacity: usize,
    /// The TCP table is full: connects through VIPs are still rewritten,
    /// but not tracked (`connect_untracked` counts them).
    #[serde(default)]
    pub tcp_full: bool,
    /// UDP sockets that sent or connected to a VIP (`UDP_PEERS`): what
    /// their servers send back is shown as from the VIP.
    #[serde(default)]
    pub udp_peers: usize,
    /// How many UDP sockets `UDP_PEERS` holds.
    #[serde(default)]
    pub udp_peers_capacity: usize,
    /// The reverse mapping: how many of those sockets see each server as
    /// its VIP.
    #[serde(default)]
    pub udp_reverse: Vec<UdpReverse>,
}

/// One row of the UDP reverse mapping in `lb status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UdpReverse {
    /// The VIP the sockets sent to.
    pub vip: SocketAddr,
    /// The server that got their datagrams; what it sends back to them
    /// comes from `vip`.
    pub server: SocketAddr,
    /// How many sockets.
    pub sockets: usize,
}

/// Optional kernel features.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Features {
    /// getpeername hooks (Linux 5.8+): applications see the VIP as peer.
    pub getpeername: bool,
    /// Netlink SOCK_DESTROY (CONFIG_INET_DIAG_DESTROY): closing connections.
    pub sock_destroy: bool,
    /// `scope = "host"` can tell network namespaces apart (Linux 5.14+, or
    /// the daemon in the initial namespace); without it, host acts as all.
    #[serde(default)]
    pub netns_scope: bool,
    /// lb may enter other network namespaces (CAP_SYS_ADMIN), so it closes
    /// the connections pods made through `scope = "all"` VIPs too.
    #[serde(default)]
    pub close_in_pods: bool,
}
