//! Where a client's packet goes once it is rewritten for its server: the
//! route the kernel's FIB gives (`bpf_fib_lookup`), which each CPU keeps
//! for a while per server (`ROUTES`), so that the packets of a flow are
//! not routed one by one.
//!
//! Asking the FIB was a fifth of an established packet's program time
//! (35-40 ns of about 160). A kept route is taken only by a packet to the
//! same server (address and port) over the same protocol, from the same
//! node address, arriving on the same interface, no longer than the
//! packet it was found for (so it fits the route's MTU), within
//! [`ROUTE_KEPT_TICKS`] of the lookup (policy rules may route TCP and UDP
//! apart, `ip rule ... ipproto`). A route or neighbour entry that changes
//! (the server's MAC, the interface toward it) is followed at most that
//! much later. Policy rules that match
//! the source port (a flow's NAT port) are asked for one flow of a server,
//! and its route kept for the server's other flows too.

use core::mem::size_of;

use aya_ebpf::{
    EbpfContext as _,
    bindings::bpf_fib_lookup,
    helpers::{bpf_fib_lookup as fib_lookup, bpf_jiffies64},
    programs::XdpContext,
};
use lb_common::{Endpoint, Flow, Reason};

use crate::{
    consts::{AF_INET, AF_INET6},
    maps::{ROUTES, count_xdp},
    packet::set_link,
    scratch::{KeptRoute, Packet, ROUTE_SLOTS},
};

/// `BPF_FIB_LKUP_RET_SUCCESS`: the FIB found the route and the neighbour.
const FIB_SUCCESS: i64 = 0;
/// `BPF_FIB_LKUP_RET_FRAG_NEEDED`: the packet exceeds the route's MTU.
const FIB_FRAG_NEEDED: i64 = 8;

/// How long a CPU keeps a route the FIB gave, in ticks of the kernel's
/// clock (jiffies): 10 to 100 ms, as the kernel's `HZ` is 1000 to 100.
/// Jiffies, not nanoseconds: the clock the route is kept by is read for
/// every packet, and reading the nanosecond one costs some 15 ns.
pub(crate) const ROUTE_KEPT_TICKS: u64 = 10;

/// Where the FIB sends a packet from `src` to `dst` (the client's packet
/// as it will leave, rewritten), as `route` finds it.
pub(crate) enum Route {
    /// Out of this interface: the next hop's MAC address is written into
    /// the packet, and its TTL goes down by one.
    Via(u32),
    /// The packet is larger than the route's MTU (this one, from Linux
    /// 5.12; before, the packet's own length): untouched. A u32 holding a
    /// u16: with payloads of one size, LLVM merges the variants without
    /// shifting a stale register into the value, which the verifier
    /// refused (it held a pointer).
    TooBig(u32),
    /// No route or no neighbour entry (counted): untouched.
    Unreachable,
}

/// Where the packet goes once rewritten to leave from `src` to `dst`: the
/// route this CPU keeps for `dst`, if it may take it, or the FIB's. The
/// packet cannot go up the kernel's stack instead: its source will be an
/// address of the node's own, which the stack drops as martian.
#[inline(always)]
pub(crate) fn route(ctx: &XdpContext, p: &Packet, src: &Endpoint, dst: &Endpoint) -> Route {
    // SAFETY: the context's fields are valid for the whole program run.
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_jiffies64() };
    let Some(kept) = ROUTES.get_ptr_mut(slot(dst, ingress)) else {
        count_xdp(Reason::MapError);
        return Route::Unreachable;
    };
    // SAFETY: this CPU's slot, used by this program run alone (see
    // `PACKET` in maps.rs); valid for the whole run.
    let kept = unsafe { &mut *kept };
    if takes(kept, p, src, dst, ingress, now) {
        if !set_link(ctx, p, kept.macs) {
            return Route::Unreachable;
        }
        return Route::Via(kept.ifindex);
    }
    count_xdp(Reason::XdpFibLookup);
    // SAFETY: a plain C struct of integers, for which zero is valid.
    let mut fib: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    fib.family = (if p.ipv6 { AF_INET6 } else { AF_INET }) as u8;
    fib.l4_protocol = p.protocol;
    fib.sport = src.port;
    fib.dport = dst.port;
    fib.__bindgen_anon_1.tot_len = p.ip_len as u16;
    fib.ifindex = ingress;
    if p.ipv6 {
        fib.__bindgen_anon_3.ipv6_src = src.addr;
        fib.__bindgen_anon_4.ipv6_dst = dst.addr;
    } else {
        fib.__bindgen_anon_3.ipv4_src = src.addr[3];
        fib.__bindgen_anon_4.ipv4_dst = dst.addr[3];
    }
    // SAFETY: `fib` is a valid, writable `bpf_fib_lookup` of its full size.
    let found =
        unsafe { fib_lookup(ctx.as_ptr(), &raw mut fib, size_of::<bpf_fib_lookup>() as i32, 0) };
    if found == FIB_FRAG_NEEDED {
        // SAFETY: a u16 either way; the FIB wrote the MTU there (5.12+).
        return Route::TooBig(u32::from(unsafe { fib.__bindgen_anon_1.mtu_result }));
    }
    if found != FIB_SUCCESS {
        kept.found_at = 0;
        count_xdp(Reason::XdpNoRoute);
        return Route::Unreachable;
    }
    kept.server = *dst;
    kept.node = src.addr;
    kept.ingress = ingress;
    kept.protocol = u32::from(p.protocol);
    kept.ifindex = fib.ifindex;
    kept.macs[..6].copy_from_slice(&fib.dmac);
    kept.macs[6..].copy_from_slice(&fib.smac);
    kept.fits = p.ip_len;
    kept.found_at = now;
    kept.vip = Endpoint::default();
    if !set_link(ctx, p, kept.macs) {
        return Route::Unreachable;
    }
    Route::Via(fib.ifindex)
}

/// Whether a packet rewritten to leave from `src` to `dst`, arriving on
/// `ingress`, may take the route `kept`.
#[inline(always)]
fn takes(
    kept: &KeptRoute,
    p: &Packet,
    src: &Endpoint,
    dst: &Endpoint,
    ingress: u32,
    now: u64,
) -> bool {
    kept.found_at != 0
        && now.wrapping_sub(kept.found_at) < ROUTE_KEPT_TICKS
        && p.ip_len <= kept.fits
        && kept.server == *dst
        && kept.node == src.addr
        && kept.ingress == ingress
        && kept.protocol == u32::from(p.protocol)
}

/// The route this CPU keeps for `flow`'s packet `p` (a client's, of an
/// established TCP flow), if it also keeps the verdict that such packets
/// go on to the flow's server: reached in this `epoch` by the full path
/// (`keep_verdict`), for `p`'s VIP, and for frames sent to `to_mac`.
/// Nothing is written: the caller rewrites and sends the packet.
#[inline(always)]
pub(crate) fn kept_verdict(
    ingress: u32,
    p: &Packet,
    flow: &Flow,
    to_mac: [u8; 6],
    epoch: u32,
    now: u64,
) -> Option<&'static KeptRoute> {
    // SAFETY: this CPU's slot, used by this program run alone (see
    // `PACKET` in maps.rs); only read.
    let kept = unsafe { &*ROUTES.get_ptr(slot(&flow.server, ingress))? };
    let holds = kept.epoch == epoch && kept.vip == p.dst && kept.to_mac == to_mac;
    (holds && takes(kept, p, &flow.node, &flow.server, ingress, now)).then_some(kept)
}

/// Keeps beside the route to `server` of packets arriving on `ingress`
/// the verdict that the established TCP flows of `vip` to it go on to
/// it, reached in `epoch` by the full path for a frame sent to `to_mac`
/// (`forward::forward`): their packets may take `established.rs`'s way
/// until the epoch or the route changes. The route must be the one the
/// packet just took.
#[inline(always)]
pub(crate) fn keep_verdict(
    server: &Endpoint,
    ingress: u32,
    vip: &Endpoint,
    epoch: u32,
    to_mac: [u8; 6],
) {
    let Some(kept) = ROUTES.get_ptr_mut(slot(server, ingress)) else { return };
    // SAFETY: as in `route`.
    let kept = unsafe { &mut *kept };
    if kept.found_at == 0 || kept.server != *server || kept.ingress != ingress {
        return;
    }
    kept.vip = *vip;
    kept.epoch = epoch;
    kept.to_mac = to_mac;
}

/// The slot of `ROUTES` that keeps the route to `server` of packets
/// arriving on `ingress`.
#[inline(always)]
fn slot(server: &Endpoint, ingress: u32) -> u32 {
    server.slot(ingress.rotate_left(16), ROUTE_SLOTS)
}

const _: () = assert!(ROUTE_SLOTS.is_power_of_two());
