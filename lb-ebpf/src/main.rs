//! The kernel half of `lb`: rewrite connects to a VIP to a chosen server, in
//! the kernel, and report what became of them.
//!
//! - `lb_connect4` / `lb_connect6` (cgroup/connect4, cgroup/connect6,
//!   `connect.rs`): if the destination is a VIP, pick a server from the
//!   service's selection (`select.rs`, over `lb_common::choose`, tested on
//!   the host) and rewrite the destination. Record a TCP socket's choice in
//!   `CONNECTING` and mark it for sock_ops (`mark_tracked`); track a UDP
//!   one in `SOCKETS_UDP` and `UDP_PEERS`.
//! - `lb_getpeername4` / `lb_getpeername6`: a tracked socket reports the VIP
//!   as its peer, so the application sees the address it dialled.
//! - `lb_sendmsg4` / `lb_sendmsg6` (`udp.rs`): an unconnected UDP send to a
//!   VIP goes to a server chosen as for a connect, the same one for the
//!   socket's later sends while it is usable and preferred; the socket's
//!   (VIP, server) pairs are kept in `UDP_PEERS`.
//! - `lb_recvmsg4` / `lb_recvmsg6` (`udp.rs`): a datagram from such a
//!   server (or from the server of a UDP socket connected through a VIP)
//!   is shown as from the VIP.
//! - `lb_sock_ops` (its callbacks are in `sock_ops.rs`): when a recorded
//!   connect sends its SYN (to the server connect4 chose), track it in
//!   `SOCKETS`; for tracked TCP sockets, count live connections per (VIP,
//!   server), mark a server failed the moment the server refuses a connect
//!   or leaves its SYN unanswered, and tell the daemon through the `EVENTS`
//!   ring buffer when a connect establishes, fails or times out (a close is
//!   only counted).
//! - `lb_sock_release` (cgroup sock_release, `release.rs`): a released
//!   socket leaves the socket tables (UDP at once; TCP as its state says).
//! - `lb_xdp` (XDP, on the interfaces of external VIPs; `external.rs` over
//!   `packet.rs`): packets from other machines to an external VIP go to a
//!   server chosen as for a connect, with NAT; the servers' replies are
//!   translated back, and ICMP errors about the flows both ways
//!   (`icmp.rs`). Failure marks and events are shared (`report.rs`).
//!
//! The programs are dumb and fast: the daemon decides the selection; the
//! kernel only skips servers whose connect failed within the hold-down.
//! Each entry point is thin; every early return is counted in `COUNTERS`.
#![no_std]
// Built for the BPF target by lb-user's build script; on the host (e.g.
// `cargo test --workspace`) it compiles to an empty program.
#![cfg_attr(target_arch = "bpf", no_main)]
// `asm!` for the BPF target (`atomic_add`); the eBPF build is on nightly.
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    bindings::xdp_action,
    macros::{cgroup_sock, cgroup_sock_addr, map, sock_ops, xdp},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{SockAddrContext, SockContext, SockOpsContext, XdpContext},
};
use lb_common::{
    AnnounceKey, AnnounceValue, COUNTER_SLOTS, ConnKey, EVENTS_BYTES, Endpoint, Flow, FlowKey,
    MARK_SLOTS, MAX_CONNECTING_SOCKETS, MAX_EXTERNAL_FLOWS, MAX_FAILED_SERVERS, MAX_LINKS,
    MAX_SERVER_PAIRS, MAX_SERVICES, MAX_TRACKED_SOCKETS, MAX_TRACKED_UDP_SOCKETS,
    MAX_UDP_PEER_SOCKETS, META_SLOTS, NatKey, NatReply, Reason, Service, SockEntry,
    TRAFFIC_SLOT_COUNT, Traffic, TrafficSlot, UNMARKED_SLOTS, UdpPeers, maglev::Maglev,
};

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
static SERVICES: HashMap<Endpoint, Service> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// Server → `bpf_ktime_get_ns()` of the last connect to it that failed
/// before establishing. Written by `sock_ops`, cleared on an established
/// connect; read by connect4/6 to skip servers within the hold-down.
#[map]
static FAILED_AT: HashMap<Endpoint, u64> = HashMap::with_max_entries(MAX_FAILED_SERVERS, 0);

/// Socket cookie → the VIP and server of a TCP connect through a VIP whose
/// SYN went out (moved here from `CONNECTING` by `on_connect`). A plain
/// hash map, not an LRU: nothing is evicted behind anyone's back. An entry
/// leaves when sock_ops sees the socket close, or at release if it never
/// established (`lb_sock_release`); a full table is counted
/// (`connect_untracked`).
#[map]
static SOCKETS: HashMap<u64, SockEntry> = HashMap::with_max_entries(MAX_TRACKED_SOCKETS, 0);

/// Socket cookie → the choice connect4 made for a TCP socket, until its SYN
/// goes (`on_connect`). Apart from `SOCKETS` because a connect can fail on
/// the spot after connect4 ran (a taken 4-tuple: `EADDRNOTAVAIL`; an
/// IPv6-only socket dialling an IPv4 VIP: `ENETUNREACH`): no callback ever
/// comes for it, and any process could hold thousands of such sockets
/// open. Here they cannot fill the table of real connections, and the LRU
/// evicts them; a socket that connects again elsewhere is not taken for
/// the VIP's (`on_connect` checks where the SYN goes). Kernel-only.
#[map]
static CONNECTING: LruHashMap<u64, SockEntry> =
    LruHashMap::with_max_entries(MAX_CONNECTING_SOCKETS, 0);

/// As `SOCKETS`, for connected UDP sockets: apart, so that a churn of UDP
/// sockets never competes with TCP connections for a slot. An entry leaves
/// when its socket is released (no TCP callbacks fire for UDP).
#[map]
static SOCKETS_UDP: HashMap<u64, SockEntry> = HashMap::with_max_entries(MAX_TRACKED_UDP_SOCKETS, 0);

/// UDP socket cookie → the VIPs it sent to (or connected to) and the
/// servers that got them (`udp.rs`): the reverse mapping that shows what a
/// server sends back as from the VIP. A plain hash map, as `SOCKETS_UDP`:
/// an entry leaves when its socket is released; a full table is counted
/// (`udp_peers_full`).
#[map]
static UDP_PEERS: HashMap<u64, UdpPeers> = HashMap::with_max_entries(MAX_UDP_PEER_SOCKETS, 0);

/// (VIP, server) → live established connections, per CPU (sum them).
#[map]
static CONNECTIONS: PerCpuHashMap<ConnKey, i64> =
    PerCpuHashMap::with_max_entries(MAX_SERVER_PAIRS, 0);

/// `Event`s for the daemon: a connect established, failed or timed out.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);

/// One word per CPU for `unknown_to_verifier`; kernel-only, never pinned.
#[map]
static SCRATCH: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Two flags (`lb_common::UNMARKED_KERNEL`, `UNMARKED_REPLACED`): this
/// kernel does not let connect4 mark the sockets it records
/// (`mark_tracked`, Linux 6.12+), so sock_ops looks every connecting socket
/// up; these programs replaced running ones, so a connect may have its
/// entry in `SOCKETS` already. Kernel-only, never pinned.
#[map]
static UNMARKED: Array<u32> = Array::with_max_entries(UNMARKED_SLOTS, 0);

/// The jiffy at which a server hashed to each slot was last marked failed
/// (`report.rs`), or `lb_common::MARKED_UNKNOWN`, written by the daemon:
/// lets the external path skip `FAILED_AT` (`select::unmarked_lately`).
/// Pinned: sock_ops and `lb_xdp`, loaded apart, stamp the same slots.
#[map]
static MARKED_AT: Array<u64> = Array::with_max_entries(MARK_SLOTS, 0);

/// External VIP → 0: the VIPs whose packets from the network `lb_xdp`
/// forwards (their selections are in `SERVICES`). Written by the daemon.
#[map]
static EXTERNAL: HashMap<Endpoint, u32> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// A server's address (port 0) → the node's own address toward it (port
/// 0): the source of packets forwarded to it. Written by the daemon, from
/// the kernel's routes.
#[map]
static NODE_ADDRESSES: HashMap<Endpoint, Endpoint> =
    HashMap::with_max_entries(MAX_FAILED_SERVERS, BPF_F_NO_PREALLOC);

/// The external path's flows, client → VIP, and where they go (`external.rs`).
#[map]
static FLOWS: LruHashMap<FlowKey, Flow> = LruHashMap::with_max_entries(MAX_EXTERNAL_FLOWS, 0);

/// The same flows as their replies carry them (server → NAT port), and
/// whom to send those back to. An entry holds its NAT port.
#[map]
static NAT_REPLIES: LruHashMap<NatKey, NatReply> =
    LruHashMap::with_max_entries(MAX_EXTERNAL_FLOWS, 0);

/// Server → packets and bytes the external path forwarded to it, per CPU.
#[map]
static TRAFFIC: PerCpuHashMap<Endpoint, Traffic> =
    PerCpuHashMap::with_max_entries(MAX_FAILED_SERVERS, 0);

/// Per CPU, slots of what the external path forwarded to servers, found
/// by a hash of the server (`lb_common::TrafficSlot`).
#[map]
static TRAFFIC_SLOTS: PerCpuArray<TrafficSlot> =
    PerCpuArray::with_max_entries(TRAFFIC_SLOT_COUNT, 0);

/// (Interface, address) → the interface's MAC: the VIPs whose ARP
/// requests and neighbour solicitations `lb_xdp` answers there
/// (`announce.rs`). Written by the daemon.
#[map]
static ANNOUNCE: HashMap<AnnounceKey, AnnounceValue> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// An announced address → when its answers stop (`CLOCK_MONOTONIC` ns):
/// an elected node's fence (`announce.rs`). Written by the daemon.
#[map]
static ANNOUNCE_UNTIL: HashMap<[u32; 4], u64> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// Interface index → its MAC address: `lb_xdp` forwards only frames sent
/// to the node (`packet::for_this_node`). Written by the daemon for every
/// interface it attaches to.
#[map]
static LINK_MACS: HashMap<u32, AnnounceValue> =
    HashMap::with_max_entries(MAX_LINKS, BPF_F_NO_PREALLOC);

/// External VIP → its consistent-hash table (`lb_common::maglev`), for
/// a `spread` service's new flows. Written by the daemon.
#[map]
static MAGLEV: HashMap<Endpoint, Maglev> =
    HashMap::with_max_entries(MAX_SERVICES, BPF_F_NO_PREALLOC);

/// The new flow `external::choose` and `external::new_flow` build, per
/// CPU (`external::NewFlow`): kept off the stack, as `PACKET` is.
/// Kernel-only, never pinned.
#[map]
static NEW_FLOW: PerCpuArray<external::NewFlow> = PerCpuArray::with_max_entries(1, 0);

/// One parsed packet per CPU (`packet::Packet`) for `lb_xdp`: kept off the
/// stack, which holds 512 bytes for the whole call chain (Linux 5.10
/// refused the program with it on the stack). Kernel-only, never pinned.
#[map]
static PACKET: PerCpuArray<packet::Packet> = PerCpuArray::with_max_entries(1, 0);

/// The routes the FIB gave for the external path's packets, kept a
/// while per server on each CPU (`route.rs`). Kernel-only, never pinned.
#[map]
static ROUTES: PerCpuArray<route::KeptRoute> = PerCpuArray::with_max_entries(route::ROUTE_SLOTS, 0);

/// Per-CPU counters of every decision, indexed by `lb_common::Reason`.
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// The pinned maps' layout version (`lb_common::LAYOUT_VERSION`), written by
/// the daemon at attach and checked before it adopts pins. The programs
/// never read it.
#[map]
static META: Array<u32> = Array::with_max_entries(META_SLOTS, 0);

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;
const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;

/// `E2BIG`: a hash map update failed because the map is full.
const E2BIG: i32 = 7;

/// Verdicts of cgroup sock_addr programs.
const ALLOW: i32 = 1;
const REFUSE: i32 = 0;

/// Counts `reason`, from any program (`atomic_add`).
#[inline(always)]
fn count(reason: Reason) {
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
fn count_xdp(reason: Reason) {
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
unsafe fn atomic_add(value: *mut u64, delta: u64) {
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

// `bpf_sock_addr` fields must be read and written as whole, volatile 4-byte
// accesses: the verifier rejects narrower or merged loads and stores of the
// context, which the compiler would otherwise be free to emit.
macro_rules! ctx_read {
    ($ctx:expr, $($field:tt)+) => {
        // SAFETY: the context pointer is valid for the whole program run.
        unsafe { core::ptr::read_volatile(&raw const (*$ctx.sock_addr).$($field)+) }
    };
}
macro_rules! ctx_write {
    ($ctx:expr, $value:expr, $($field:tt)+) => {
        // SAFETY: as in `ctx_read`; these fields are writable in connect and
        // getpeername programs.
        unsafe { core::ptr::write_volatile(&raw mut (*$ctx.sock_addr).$($field)+, $value) }
    };
}

// Each module uses the macros above, so they are declared after them.
mod announce;
mod connect;
mod external;
mod icmp;
mod packet;
mod release;
mod report;
mod route;
mod select;
mod sock_ops;
mod too_big;
mod udp;

use crate::{
    connect::{try_connect, vip_of_peer},
    release::try_release,
    select::Refuse,
    udp::{try_sendmsg, vip_of_source},
};

/// The IPv6 address and port of the context (IPv4-mapped for IPv4).
fn read_endpoint6(ctx: &SockAddrContext) -> Endpoint {
    let addr = [
        ctx_read!(ctx, user_ip6[0]),
        ctx_read!(ctx, user_ip6[1]),
        ctx_read!(ctx, user_ip6[2]),
        ctx_read!(ctx, user_ip6[3]),
    ];
    Endpoint { addr, port: read_port(ctx), _pad: [0; 2] }
}

fn write_endpoint6(ctx: &SockAddrContext, ep: &Endpoint) {
    ctx_write!(ctx, ep.addr[0], user_ip6[0]);
    ctx_write!(ctx, ep.addr[1], user_ip6[1]);
    ctx_write!(ctx, ep.addr[2], user_ip6[2]);
    ctx_write!(ctx, ep.addr[3], user_ip6[3]);
    write_port(ctx, ep.port);
}

/// `user_port` holds the port in network byte order in its low 16 bits.
fn read_port(ctx: &SockAddrContext) -> u16 {
    ctx_read!(ctx, user_port) as u16
}

fn write_port(ctx: &SockAddrContext, port_be: u16) {
    ctx_write!(ctx, u32::from(port_be), user_port);
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    let dst = Endpoint::from_v4_raw(ctx_read!(ctx, user_ip4), read_port(&ctx));
    // `try_connect` returns only IPv4 servers to an IPv4 socket.
    rewrite_v4(&ctx, try_connect(&ctx, &dst, true))
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    // An IPv4-mapped destination arrives here in mapped form and finds the
    // IPv4 VIP's entry, because the map stores IPv4 mapped too.
    let dst = read_endpoint6(&ctx);
    rewrite_v6(&ctx, try_connect(&ctx, &dst, false))
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    // An IPv6 socket's send to an IPv4-mapped address comes here too.
    let dst = Endpoint::from_v4_raw(ctx_read!(ctx, user_ip4), read_port(&ctx));
    rewrite_v4(&ctx, try_sendmsg(&ctx, &dst, true))
}

#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
    let dst = read_endpoint6(&ctx);
    rewrite_v6(&ctx, try_sendmsg(&ctx, &dst, false))
}

/// Writes the IPv4 server of a decision to the context: the verdict.
#[inline(always)]
fn rewrite_v4(ctx: &SockAddrContext, decision: Result<Option<Endpoint>, Refuse>) -> i32 {
    match decision {
        Ok(None) => ALLOW,
        Ok(Some(server)) => {
            ctx_write!(ctx, server.addr[3], user_ip4);
            write_port(ctx, server.port);
            ALLOW
        }
        Err(Refuse) => REFUSE,
    }
}

/// Writes the server of a decision to an IPv6 context: the verdict.
#[inline(always)]
fn rewrite_v6(ctx: &SockAddrContext, decision: Result<Option<Endpoint>, Refuse>) -> i32 {
    match decision {
        Ok(None) => ALLOW,
        Ok(Some(server)) => {
            write_endpoint6(ctx, &server);
            ALLOW
        }
        Err(Refuse) => REFUSE,
    }
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    let peer = Endpoint::from_v4_raw(ctx_read!(ctx, user_ip4), read_port(&ctx));
    if let Some(vip) = vip_of_peer(&ctx, &peer) {
        ctx_write!(ctx, vip.addr[3], user_ip4);
        write_port(&ctx, vip.port);
    }
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    let peer = read_endpoint6(&ctx);
    if let Some(vip) = vip_of_peer(&ctx, &peer) {
        write_endpoint6(&ctx, &vip);
    }
    ALLOW
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    let src = Endpoint::from_v4_raw(ctx_read!(ctx, user_ip4), read_port(&ctx));
    if let Some(vip) = vip_of_source(&ctx, &src, true) {
        ctx_write!(ctx, vip.addr[3], user_ip4);
        write_port(&ctx, vip.port);
    }
    // recvmsg cannot refuse; 1 is the only verdict it takes.
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn lb_recvmsg6(ctx: SockAddrContext) -> i32 {
    // A datagram from an IPv4 server to an IPv6 socket comes IPv4-mapped.
    let src = read_endpoint6(&ctx);
    if let Some(vip) = vip_of_source(&ctx, &src, false) {
        write_endpoint6(&ctx, &vip);
    }
    // As for recvmsg4.
    ALLOW
}

#[cgroup_sock(sock_release)]
pub fn lb_sock_release(ctx: SockContext) -> i32 {
    count(try_release(&ctx));
    // sock_release cannot refuse; 1 is the only verdict it takes.
    1
}

#[sock_ops]
pub fn lb_sock_ops(ctx: SockOpsContext) -> u32 {
    sock_ops::handle(&ctx);
    // sock_ops programs return 1; the reply, if any, goes through set_reply.
    1
}

/// The external path: a packet from the network to an external VIP goes to
/// a server, a server's reply back to its client (`external.rs`);
/// anything else passes untouched.
#[xdp]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    let Some(slot) = PACKET.get_ptr_mut(0) else {
        count(Reason::MapError);
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's slot, used by this program run alone (XDP runs
    // with preemption off: one packet per CPU at a time).
    let p = unsafe { &mut *slot };
    let answered = announce::answer(&ctx);
    if answered != announce::NOT_ASKED {
        return answered;
    }
    if packet::parse(&ctx, p).is_none() {
        return xdp_action::XDP_PASS;
    }
    external::handle(&ctx, p).unwrap_or(xdp_action::XDP_PASS)
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable call to this; it must stay dead code.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
