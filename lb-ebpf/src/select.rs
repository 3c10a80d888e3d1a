//! The choice of a server for a connect or a send to a VIP, shared by the
//! connect and sendmsg programs and the external path (XDP): find the VIP's service, check the
//! socket's protocol and network namespace, and pick a server from the
//! selection (`lb_common::choose`), skipping servers whose connects failed
//! within the hold-down.

use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_ns},
    programs::SockAddrContext,
};
use lb_common::{
    Endpoint, MARKED_UNKNOWN, MAX_SERVERS, NETNS_ANY, NETNS_INITIAL, Reason, Service,
    choose::{Choice, choose_from_mask, usable_mask},
};

use crate::{
    consts::{IPPROTO_TCP, IPPROTO_UDP},
    ctx::ctx_read,
    maps::{FAILED_AT, MARKED_AT, SCRATCH, SERVICES, count},
    report::mark_slot,
};

/// The connect or send must fail (EPERM): its VIP's service has no server.
pub(crate) struct Refuse;

/// The counters one hook counts its decisions in, and what it rewrites.
pub(crate) struct Hook {
    /// Whether TCP sockets are rewritten (UDP always is).
    pub(crate) tcp: bool,
    pub(crate) not_vip: Reason,
    pub(crate) other_protocol: Reason,
    pub(crate) other_netns: Reason,
    pub(crate) no_server: Reason,
    pub(crate) skipped_failed: Reason,
    pub(crate) all_failed: Reason,
}

/// connect4/6: TCP and UDP.
pub(crate) const CONNECT: Hook = Hook {
    tcp: true,
    not_vip: Reason::ConnectNotVip,
    other_protocol: Reason::ConnectOtherProtocol,
    other_netns: Reason::ConnectOtherNetns,
    no_server: Reason::ConnectNoServer,
    skipped_failed: Reason::ConnectSkippedFailed,
    all_failed: Reason::ConnectAllFailed,
};

/// sendmsg4/6: unconnected UDP sends (the hooks run for UDP and UDP-Lite).
pub(crate) const SENDMSG: Hook = Hook {
    tcp: false,
    not_vip: Reason::SendmsgNotVip,
    other_protocol: Reason::SendmsgOtherProtocol,
    other_netns: Reason::SendmsgOtherNetns,
    no_server: Reason::SendmsgNoServer,
    skipped_failed: Reason::SendmsgSkippedFailed,
    all_failed: Reason::SendmsgAllFailed,
};

/// xdp: packets from the network to an external VIP (no socket: the
/// protocol and scope checks do not apply).
pub(crate) const XDP: Hook = Hook {
    tcp: true,
    not_vip: Reason::XdpNotOurs,
    other_protocol: Reason::XdpOtherProtocol,
    other_netns: Reason::XdpNotOurs,
    no_server: Reason::XdpNoServer,
    skipped_failed: Reason::XdpSkippedFailed,
    all_failed: Reason::XdpAllFailed,
};

/// The service of the VIP `dst`, if the socket behind `ctx` is one whose
/// traffic to it is rewritten: of a protocol `hook` rewrites, in the
/// service's scope. Every miss is counted.
#[inline(always)]
pub(crate) fn service_for(
    ctx: &SockAddrContext,
    dst: &Endpoint,
    hook: &Hook,
) -> Option<&'static Service> {
    // SAFETY: the value is only read; the daemon replaces values whole.
    let Some(service) = (unsafe { SERVICES.get(dst) }) else {
        count(hook.not_vip);
        return None;
    };
    let protocol = ctx_read!(ctx, protocol);
    if protocol != IPPROTO_UDP && !(hook.tcp && protocol == IPPROTO_TCP) {
        count(hook.other_protocol);
        return None;
    }
    if !in_scope(ctx, service.netns_cookie) {
        count(hook.other_netns);
        return None;
    }
    Some(service)
}

// `choose_server` masks a server index with `MAX_SERVERS - 1`.
const _: () = assert!(MAX_SERVERS.is_power_of_two());

/// Picks a server of `service`'s selection: the first usable one, or at
/// random among the usable ones of the first `spread`. A service with no
/// server refuses.
#[inline(always)]
pub(crate) fn choose_server(service: &Service, hook: &Hook) -> Result<Endpoint, Refuse> {
    // SAFETY: plain helper call without arguments.
    let random = unsafe { bpf_get_prandom_u32() };
    let Some(mask) = unknown_to_verifier(usable_mask(service, |s| usable(service, s))) else {
        count(Reason::MapError);
        return Err(Refuse);
    };
    match choose_from_mask(service, mask, random) {
        Choice::NoServer => {
            count(hook.no_server);
            Err(Refuse)
        }
        Choice::Server { index, skipped_failed, all_failed } => {
            if skipped_failed {
                count(hook.skipped_failed);
            }
            if all_failed {
                count(hook.all_failed);
            }
            // `index < MAX_SERVERS` already (see `Choice`); the mask says so
            // to the compiler, so the access has no bounds check, whose
            // panic path the verifier would refuse.
            Ok(service.servers[index & (MAX_SERVERS - 1)])
        }
    }
}

/// Whether `server` may be chosen now: no connect to it failed within
/// `service`'s hold-down. The clock is read only for a server with a
/// failure mark.
#[inline(always)]
pub(crate) fn usable(service: &Service, server: &Endpoint) -> bool {
    // SAFETY: `FAILED_AT` values are single u64 timestamps.
    let Some(&failed_at) = (unsafe { FAILED_AT.get(server) }) else { return true };
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    now.wrapping_sub(failed_at) >= service.hold_down_ns
}

/// Whether `server` surely has no failure mark within `service`'s
/// hold-down, without a `FAILED_AT` lookup: no mark stamped its slot of
/// `MARKED_AT` within it (`report.rs`). The external path asks this
/// before `usable` for every packet of a flow; the connect programs,
/// whose stack has no room for it on Linux 5.10, ask `usable` alone.
#[inline(always)]
pub(crate) fn unmarked_lately(service: &Service, server: &Endpoint) -> bool {
    !stamped_within(mark_slot(server), service.hold_down_ns)
}

/// Jiffies added to a hold-down before a stamp counts as older (see
/// `stamped_within`).
const STAMP_MARGIN_TICKS: u64 = 4;

/// Whether slot `slot` of `MARKED_AT` may have been stamped less than
/// `hold_down_ns` ago. The slots count in jiffies, whose length this
/// program does not know: a jiffy lasts at least a millisecond (the
/// kernel's `HZ` is at most 1000), so a stamp older than the hold-down in
/// milliseconds, plus `STAMP_MARGIN_TICKS` for the jiffy under way and a
/// tick or two that jiffies may lag behind, is surely older than the
/// hold-down. A slot of `MARKED_UNKNOWN` becomes a stamp of now.
#[inline(always)]
fn stamped_within(slot: u32, hold_down_ns: u64) -> bool {
    let Some(stamp) = MARKED_AT.get_ptr_mut(slot) else { return true };
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_jiffies64() };
    // SAFETY: a u64 map value, valid for the whole program run.
    let stamped = unsafe { *stamp };
    if stamped == MARKED_UNKNOWN {
        // SAFETY: as above; any CPU may do the same, with the same effect.
        unsafe { *stamp = now };
        return true;
    }
    let ticks = hold_down_ns.div_ceil(1_000_000) + STAMP_MARGIN_TICKS;
    stamped != 0 && now.wrapping_sub(stamped) <= ticks
}

/// Whether `server` is one a choice prefers now: among the first `spread`
/// of the selection (the first one, for failover). The selection holds
/// every server, failed ones last; one past `spread` is chosen only when
/// none of those is usable.
#[inline(always)]
pub(crate) fn preferred(service: &Service, server: &Endpoint) -> bool {
    let first = service.spread.max(1).min(service.count);
    if first <= 1 {
        // Failover: the one server a choice prefers.
        return first == 1 && service.servers[0] == *server;
    }
    let mut found = false;
    for i in 0..MAX_SERVERS {
        found |= (i as u32) < first && service.servers[i] == *server;
    }
    found
}

/// The daemon's state of `server` (`Service::daemon_states`) if it is
/// still in `service`'s selection; `None` if the daemon removed it.
#[inline(always)]
pub(crate) fn daemon_state(service: &Service, server: &Endpoint) -> Option<u8> {
    for i in 0..MAX_SERVERS {
        if i as u32 >= service.count {
            return None;
        }
        if service.servers[i] == *server {
            return Some(service.daemon_states[i]);
        }
    }
    None
}

/// `value`, read back from map memory, so that the verifier no longer knows
/// it; `None` only if the per-CPU slot is missing, which cannot happen.
///
/// Verifier workaround: `usable_mask` is built on up to 2^16 paths (one
/// branch per server), each with its own constant mask. The choice then
/// indexes `servers` with a value computed from the mask, and the verifier
/// marks every value that flows into a pointer offset as precise, back
/// through all the arithmetic to the mask; paths with different precise
/// masks never merge, and it would verify the rest of the program once per
/// mask, far beyond its limit of a million instructions. A value loaded
/// from a map is unknown to the verifier and ends that chain, so the paths
/// merge right here. Arithmetic or the stack cannot do this: the verifier
/// tracks values through both.
#[inline(always)]
fn unknown_to_verifier(value: u32) -> Option<u32> {
    let slot = SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot, used only here, between these two accesses;
    // volatile so that the compiler does not forward the value past the map.
    unsafe {
        core::ptr::write_volatile(slot, value);
        Some(core::ptr::read_volatile(slot))
    }
}

/// Whether traffic from the socket behind `ctx` is rewritten for a service
/// whose value holds `netns_cookie`: from any network namespace
/// (`NETNS_ANY`), or only from the one the value names (`NETNS_INITIAL`:
/// the initial one). The daemon picked the value once at start; no feature
/// is probed here.
#[inline(always)]
fn in_scope(ctx: &SockAddrContext, netns_cookie: u64) -> bool {
    if netns_cookie == NETNS_ANY {
        return true;
    }
    // SAFETY: the helper only reads the socket behind the context; with a
    // null context (ARG_PTR_TO_CTX_OR_NULL) it returns the initial network
    // namespace's cookie (Linux 5.7+, as the helper itself).
    let (mine, host) = unsafe {
        let mine = bpf_get_netns_cookie(ctx.as_ptr());
        let host = if netns_cookie == NETNS_INITIAL {
            bpf_get_netns_cookie(core::ptr::null_mut())
        } else {
            netns_cookie
        };
        (mine, host)
    };
    mine == host
}
