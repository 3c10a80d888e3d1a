//! Every map of the kernel programs, and the counters every early return
//! goes to. The programs' modules use these; this module uses none of
//! them (the per-CPU working values it holds are `scratch.rs`'s types).
//!
//! The pinned ones (`lb_common::maps` names them) are shared with the
//! daemon and with programs loaded apart; the kernel-only ones say so.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf},
};
use lb_common::{
    AnnounceKey, AnnounceValue, COUNTER_SLOTS, ConnKey, EVENTS_BYTES, Endpoint, Flow, FlowKey,
    LIMIT_SLOTS, MARK_SLOTS, MAX_CONNECTING_SOCKETS, MAX_EXTERNAL_FLOWS, MAX_FAILED_SERVERS,
    MAX_LINKS, MAX_SERVER_PAIRS, MAX_SERVICES, MAX_TRACKED_SOCKETS, MAX_TRACKED_UDP_SOCKETS,
    MAX_UDP_PEER_SOCKETS, META_SLOTS, NatKey, NatReply, Reason, Service, SockEntry,
    TRAFFIC_SLOT_COUNT, Traffic, TrafficSlot, UNMARKED_SLOTS, UdpPeers, VIP_PORT_WORDS,
    maglev::Maglev, udp_flow_table, vip_port_bit,
};

use crate::consts::IPPROTO_UDP;
use crate::scratch::{KeptRoute, LINK_SLOTS, NewFlow, Packet, ROUTE_SLOTS, SeenLink, Spent};

/// VIP → service (its selection). Written only by the daemon, one whole
/// value per update.
///
/// Not preallocated: in a preallocated hash map an update puts the value it
/// replaces back on the CPU's free list at once, and the next update (of
/// any VIP) may overwrite it while connect4 on another CPU still reads it,
/// so a connect could read another VIP's servers. Without preallocation
/// the replaced value is freed only after an RCU grace period, when no
/// program can still hold it: every read is of one whole value.
#[map]
pub(crate) static SERVICES: HashMap<Endpoint, Service> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// Server → `bpf_ktime_get_ns()` of the last connect to it that failed
/// before establishing. Written by `sock_ops`, cleared on an established
/// connect; read by connect4/6 to skip servers within the hold-down.
#[map]
pub(crate) static FAILED_AT: HashMap<Endpoint, u64> =
    HashMap::with_max_entries(MAX_FAILED_SERVERS, 0);

/// Socket cookie → the VIP and server of a TCP connect through a VIP whose
/// SYN went out (moved here from `CONNECTING` by `on_connect`). A plain
/// hash map, not an LRU: nothing is evicted behind anyone's back. An entry
/// leaves when sock_ops sees the socket close, or at release if it never
/// established (`lb_sock_release`); a full table is counted
/// (`connect_untracked`).
#[map]
pub(crate) static SOCKETS: HashMap<u64, SockEntry> =
    HashMap::with_max_entries(MAX_TRACKED_SOCKETS, 0);

/// Socket cookie → the choice connect4 made for a TCP socket, until its SYN
/// goes (`on_connect`). Apart from `SOCKETS` because a connect can fail on
/// the spot after connect4 ran (a taken 4-tuple: `EADDRNOTAVAIL`; an
/// IPv6-only socket dialling an IPv4 VIP: `ENETUNREACH`): no callback ever
/// comes for it, and any process could hold thousands of such sockets
/// open. Here they cannot fill the table of real connections, and the LRU
/// evicts them; a socket that connects again elsewhere is not taken for
/// the VIP's (`on_connect` checks where the SYN goes). Kernel-only.
#[map]
pub(crate) static CONNECTING: LruHashMap<u64, SockEntry> =
    LruHashMap::with_max_entries(MAX_CONNECTING_SOCKETS, 0);

/// As `SOCKETS`, for connected UDP sockets: apart, so that a churn of UDP
/// sockets never competes with TCP connections for a slot. An entry leaves
/// when its socket is released (no TCP callbacks fire for UDP).
#[map]
pub(crate) static SOCKETS_UDP: HashMap<u64, SockEntry> =
    HashMap::with_max_entries(MAX_TRACKED_UDP_SOCKETS, 0);

/// UDP socket cookie → the VIPs it sent to (or connected to) and the
/// servers that got them (`udp.rs`): the reverse mapping that shows what a
/// server sends back as from the VIP. A plain hash map, as `SOCKETS_UDP`:
/// an entry leaves when its socket is released; a full table is counted
/// (`udp_peers_full`).
#[map]
pub(crate) static UDP_PEERS: HashMap<u64, UdpPeers> =
    HashMap::with_max_entries(MAX_UDP_PEER_SOCKETS, 0);

/// (VIP, server) → live established connections, per CPU (sum them).
#[map]
pub(crate) static CONNECTIONS: PerCpuHashMap<ConnKey, i64> =
    PerCpuHashMap::with_max_entries(MAX_SERVER_PAIRS, 0);

/// `Event`s for the daemon: a connect established, failed or timed out.
#[map]
pub(crate) static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);

/// Settings the daemon writes into the object it loads
/// (`lb_common::LIMIT_NEW_FLOWS`, `LIMIT_ANSWERS`): kernel-only, never
/// pinned.
#[map]
pub(crate) static LIMITS: Array<u32> = Array::with_max_entries(LIMIT_SLOTS, 0);

/// Per CPU and `LIMITS` slot, what was spent of it this second
/// (`per_second.rs`). Kernel-only, never pinned.
#[map]
pub(crate) static PER_SECOND: PerCpuArray<Spent> = PerCpuArray::with_max_entries(LIMIT_SLOTS, 0);

/// One word per CPU for `unknown_to_verifier`; kernel-only, never pinned.
#[map]
pub(crate) static SCRATCH: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Two flags (`lb_common::UNMARKED_KERNEL`, `UNMARKED_REPLACED`): this
/// kernel does not let connect4 mark the sockets it records
/// (`mark_tracked`, Linux 6.12+), so sock_ops looks every connecting socket
/// up; these programs replaced running ones, so a connect may have its
/// entry in `SOCKETS` already. Kernel-only, never pinned.
#[map]
pub(crate) static UNMARKED: Array<u32> = Array::with_max_entries(UNMARKED_SLOTS, 0);

/// The jiffy at which a server hashed to each slot was last marked failed
/// (`report.rs`), or `lb_common::MARKED_UNKNOWN`, written by the daemon:
/// lets the external path skip `FAILED_AT` (`select::unmarked_lately`).
/// Pinned: sock_ops and `lb_xdp`, loaded apart, stamp the same slots.
#[map]
pub(crate) static MARKED_AT: Array<u64> = Array::with_max_entries(MARK_SLOTS, 0);

/// External VIP → 0: the VIPs whose packets from the network `lb_xdp`
/// forwards (their selections are in `SERVICES`), and each of their
/// addresses with port 0, for what arrives there that lb does not serve
/// (`forward::unserved`). Written by the daemon.
#[map]
pub(crate) static EXTERNAL: HashMap<Endpoint, u32> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// A server's address (port 0) → the node's own address toward it: the
/// source of packets forwarded to it, with in its port how many more
/// source addresses the server has (`[daemon] nat_addresses`), each
/// under the server's address with ports 1 to that number
/// (`lb_common::MAX_NAT_ADDRESSES`). Written by the daemon, from the
/// kernel's routes.
#[map]
pub(crate) static NODE_ADDRESSES: HashMap<Endpoint, Endpoint> =
    HashMap::with_max_entries(MAX_FAILED_SERVERS, BPF_F_NO_PREALLOC);

/// The external path's established TCP flows, client → VIP, and where
/// they go (`forward.rs`): only flows whose client acknowledged its
/// server's answer come here (`forward::promote`), so new flows, however
/// many, never evict one.
#[map]
pub(crate) static FLOWS: LruHashMap<FlowKey, Flow> =
    LruHashMap::with_max_entries(MAX_EXTERNAL_FLOWS, 0);

/// The same flows as their replies carry them (server → NAT port), and
/// whom to send those back to. An entry holds its NAT port.
#[map]
pub(crate) static NAT_REPLIES: LruHashMap<NatKey, NatReply> =
    LruHashMap::with_max_entries(MAX_EXTERNAL_FLOWS, 0);

/// As `FLOWS`, for TCP flows until their handshake completes. Where a
/// TCP flow opens; a flood of new flows evicts only these.
#[map]
pub(crate) static OPENING_FLOWS: LruHashMap<FlowKey, Flow> =
    LruHashMap::with_max_entries(MAX_EXTERNAL_FLOWS, 0);

/// As `NAT_REPLIES`, for the flows of `OPENING_FLOWS`. The two are evicted
/// apart: a hit in `OPENING_FLOWS` is checked against its entry here
/// (`forward::known`). A NAT port is in use while either table holds it.
#[map]
pub(crate) static OPENING_REPLIES: LruHashMap<NatKey, NatReply> =
    LruHashMap::with_max_entries(MAX_EXTERNAL_FLOWS, 0);

/// As `OPENING_FLOWS`, for UDP flows, which never move: a flood of TCP
/// flows evicts none of them.
#[map]
pub(crate) static UDP_FLOWS: LruHashMap<FlowKey, Flow> =
    LruHashMap::with_max_entries(udp_flow_table(MAX_EXTERNAL_FLOWS), 0);

/// As `OPENING_REPLIES`, for the flows of `UDP_FLOWS`.
#[map]
pub(crate) static UDP_REPLIES: LruHashMap<NatKey, NatReply> =
    LruHashMap::with_max_entries(udp_flow_table(MAX_EXTERNAL_FLOWS), 0);

/// The table a new flow of `protocol` opens in, and stays in until it is
/// established (TCP, `flows::promote`): `OPENING_FLOWS` for TCP,
/// `UDP_FLOWS` for UDP.
#[inline(always)]
pub(crate) fn opening_flows(protocol: u8) -> &'static LruHashMap<FlowKey, Flow> {
    if u32::from(protocol) == IPPROTO_UDP { &UDP_FLOWS } else { &OPENING_FLOWS }
}

/// `opening_flows`' companion: `OPENING_REPLIES` or `UDP_REPLIES`.
#[inline(always)]
pub(crate) fn opening_replies(protocol: u8) -> &'static LruHashMap<NatKey, NatReply> {
    if u32::from(protocol) == IPPROTO_UDP { &UDP_REPLIES } else { &OPENING_REPLIES }
}

/// Server → packets and bytes the external path forwarded to it, per CPU.
#[map]
pub(crate) static TRAFFIC: PerCpuHashMap<Endpoint, Traffic> =
    PerCpuHashMap::with_max_entries(MAX_FAILED_SERVERS, 0);

/// Per CPU, slots of what the external path forwarded to servers, found
/// by a hash of the server (`lb_common::TrafficSlot`).
#[map]
pub(crate) static TRAFFIC_SLOTS: PerCpuArray<TrafficSlot> =
    PerCpuArray::with_max_entries(TRAFFIC_SLOT_COUNT, 0);

/// (Interface, address) → the interface's MAC: the VIPs whose ARP
/// requests and neighbour solicitations `lb_xdp` answers there
/// (`announce.rs`). Written by the daemon.
#[map]
pub(crate) static ANNOUNCE: HashMap<AnnounceKey, AnnounceValue> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// An announced address → when its answers stop (`CLOCK_MONOTONIC` ns):
/// an elected node's fence (`announce.rs`). Written by the daemon.
#[map]
pub(crate) static ANNOUNCE_UNTIL: HashMap<[u32; 4], u64> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// Interface index → its MAC address: `lb_xdp` forwards only frames sent
/// to the node (`packet::for_this_node`). Written by the daemon for every
/// interface it attaches to.
#[map]
pub(crate) static LINK_MACS: HashMap<u32, AnnounceValue> =
    HashMap::with_max_entries(MAX_LINKS, BPF_F_NO_PREALLOC);

/// External VIP → its consistent-hash table (`lb_common::maglev`), for
/// a `spread` service's new flows. Written by the daemon.
#[map]
pub(crate) static MAGLEV: HashMap<Endpoint, Maglev> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// The daemon's epoch (`lb_common::maps::EPOCH`): bumped after every
/// change to `SERVICES`, `EXTERNAL` or `LINK_MACS`, which end the
/// verdicts `ROUTES` keeps (`route::keep_verdict`).
#[map]
pub(crate) static EPOCH: Array<u32> = Array::with_max_entries(1, 0);

/// A bit per port, set for the ports of external VIPs (`lb_common::
/// vip_port_bit`) and of the servers of those that keep the client's
/// address: only a packet to one is looked up among the established
/// flows first (`established.rs`) or among the external VIPs
/// (`forward.rs`). Written by the daemon.
#[map]
pub(crate) static VIP_PORTS: Array<u64> = Array::with_max_entries(VIP_PORT_WORDS, 0);

/// Whether `VIP_PORTS` has `port` (host byte order). An array lookup,
/// which the verifier inlines: no hash.
#[inline(always)]
pub(crate) fn in_vip_ports(port: u16) -> bool {
    let (word, bit) = vip_port_bit(port);
    VIP_PORTS.get(word).copied().unwrap_or(0) & bit != 0
}

/// The new flow `forward::choose` and `forward::new_flow` build, per
/// CPU (`scratch::NewFlow`): kept off the stack, as `PACKET` is.
/// Kernel-only, never pinned.
#[map]
pub(crate) static NEW_FLOW: PerCpuArray<NewFlow> = PerCpuArray::with_max_entries(1, 0);

/// One parsed packet per CPU (`packet::Packet`) for `lb_xdp`: kept off the
/// stack, which holds 512 bytes for the whole call chain (Linux 5.10
/// refused the program with it on the stack). Kernel-only, never pinned.
#[map]
pub(crate) static PACKET: PerCpuArray<Packet> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's copies of `LINK_MACS` entries, each good for the epoch it
/// was read in (`packet::for_this_node`): an array slot instead of a hash
/// lookup for most packets the external path forwards. Kernel-only, never
/// pinned.
#[map]
pub(crate) static LINKS_SEEN: PerCpuArray<SeenLink> = PerCpuArray::with_max_entries(LINK_SLOTS, 0);

/// The routes the FIB gave for the external path's packets, kept a
/// while per server on each CPU (`route.rs`). Kernel-only, never pinned.
#[map]
pub(crate) static ROUTES: PerCpuArray<KeptRoute> = PerCpuArray::with_max_entries(ROUTE_SLOTS, 0);

/// Per-CPU counters of every decision, indexed by `lb_common::Reason`.
#[map]
pub(crate) static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// The pinned maps' layout version (`lb_common::LAYOUT_VERSION`), written by
/// the daemon at attach and checked before it adopts pins. The programs
/// never read it.
#[map]
pub(crate) static META: Array<u32> = Array::with_max_entries(META_SLOTS, 0);

/// Counts `reason`, from any program (`atomic_add`).
#[inline(always)]
pub(crate) fn count(reason: Reason) {
    if let Some(counter) = COUNTERS.get_ptr_mut(reason.index()) {
        // SAFETY: a u64 map value, valid for the whole program run.
        unsafe { atomic_add(counter, 1) };
    }
}

/// Counts `reason` from `lb_xdp`, with a plain add: an atomic one costs
/// several nanoseconds a packet. XDP runs in softirq, or with bottom
/// halves off, where nothing on the CPU interrupts it to run a program
/// that adds to the same slot; a cgroup program it interrupts adds with a
/// single atomic instruction, never caught halfway. The same holds for
/// `TRAFFIC` and `TRAFFIC_SLOTS`, which only `lb_xdp` writes. Not under
/// `BPF_PROG_TEST_RUN`, which older kernels run preemptible: the tests
/// and benchmarks that use it load maps of their own.
#[inline(always)]
pub(crate) fn count_xdp(reason: Reason) {
    if let Some(counter) = COUNTERS.get_ptr_mut(reason.index()) {
        // SAFETY: a u64 map value, valid for the whole program run.
        unsafe { *counter += 1 };
    }
}

/// Adds `delta` to the u64 at `value`, a per-CPU map value, atomically. A
/// per-CPU slot is not a program's own: a cgroup program runs with
/// migration disabled but can be preempted (by a program for another
/// socket, in process context) or interrupted (by sock_ops in softirq) on
/// its CPU, and a plain read-modify-write would then lose one of the two
/// increments.
///
/// One BPF atomic add without fetch (`BPF_XADD`), which every kernel lb
/// supports. Written out: the BPF target has no atomic read-modify-write
/// in `core` (it has no compare-and-swap before CPU v3), and the
/// compiler's intrinsic is unstable in name and shape.
///
/// # Safety
/// `value` is a valid, 8-byte aligned map value for the whole program run.
#[inline(always)]
pub(crate) unsafe fn atomic_add(value: *mut u64, delta: u64) {
    // SAFETY: the caller's; the instruction touches only those 8 bytes.
    unsafe {
        core::arch::asm!(
            "lock *(u64 *)({value} + 0) += {delta}",
            value = in(reg) value,
            delta = in(reg) delta,
            options(nostack),
        );
    }
}
