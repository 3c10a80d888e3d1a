//! What the kernel learns about a server, for the socket path (sock_ops)
//! and the external path (XDP) alike: a failure mark in `FAILED_AT`,
//! which the next choice skips for the service's hold-down, and an event
//! for the daemon, which confirms or clears it with its own checks.

use aya_ebpf::{bindings::BPF_ANY, helpers::bpf_ktime_get_ns};
use lb_common::{Endpoint, Event, EventKind, Reason};

use crate::{E2BIG, EVENTS, FAILED_AT, count};

/// Marks `server` failed now.
#[inline(always)]
pub(crate) fn mark_failed(server: &Endpoint) {
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Err(e) = FAILED_AT.insert(server, now, u64::from(BPF_ANY)) {
        count(if e == -E2BIG { Reason::FailedAtFull } else { Reason::MapError });
    }
}

/// Tells the daemon what became of a connection to `server` through
/// `vip` (`cookie`: its socket's, or 0 for a flow of the external path).
#[inline(always)]
pub(crate) fn emit(cookie: u64, vip: &Endpoint, server: &Endpoint, kind: EventKind) {
    let Some(mut slot) = EVENTS.reserve::<Event>(0) else {
        count(Reason::EventDropped);
        return;
    };
    // SAFETY: plain helper call without arguments.
    let time_ns = unsafe { bpf_ktime_get_ns() };
    slot.write(Event { cookie, time_ns, vip: *vip, server: *server, kind: kind as u32, _pad: 0 });
    slot.submit(0);
}
