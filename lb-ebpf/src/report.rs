//! What the kernel learns about a server, for the socket path (sock_ops)
//! and the external path (XDP) alike: a failure mark in `FAILED_AT`,
//! which the next choice skips for the service's hold-down, and an event
//! for the daemon, which confirms or clears it with its own checks.
//!
//! A mark also stamps the server's slot of `MARKED_AT` (one of
//! `MARK_SLOTS`, by a hash of the server): a server whose slot has not
//! been stamped within its service's hold-down has no mark that counts,
//! and the external path, which asks for every packet, skips the
//! `FAILED_AT` lookup (`select::unmarked_lately`).

use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::{bpf_jiffies64, bpf_ktime_get_ns},
};
use lb_common::{Endpoint, Event, EventKind, MARK_SLOTS, Reason};

use crate::{
    consts::E2BIG,
    maps::{EVENTS, FAILED_AT, MARKED_AT, count},
};

/// Marks `server` failed now: its slot of `MARKED_AT` first, so that a
/// program that finds the mark in `FAILED_AT` finds the slot stamped too.
#[inline(always)]
pub(crate) fn mark_failed(server: &Endpoint) {
    if let Some(slot) = MARKED_AT.get_ptr_mut(mark_slot(server)) {
        // SAFETY: a u64 map value, valid for the whole program run; a
        // plain helper call without arguments.
        unsafe { *slot = bpf_jiffies64() };
    }
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Err(e) = FAILED_AT.insert(server, now, u64::from(BPF_ANY)) {
        count(if e == -E2BIG { Reason::FailedAtFull } else { Reason::MapError });
    }
}

/// How long after a server's failure mark the external path tells the
/// daemon of another: a burst of flows failing together is one report,
/// and a flood of them cannot crowd the ring buffer.
const REPORT_AGAIN_NS: u64 = 1_000_000_000;

/// Marks `server` failed now, as [`mark_failed`]; whether the daemon
/// should hear of it: not if it was marked less than
/// [`REPORT_AGAIN_NS`] ago.
#[inline(always)]
pub(crate) fn mark_failed_reporting(server: &Endpoint) -> bool {
    // SAFETY: a copy of a u64 value; a plain helper call.
    let (last, now) = (unsafe { FAILED_AT.get(server) }.copied(), unsafe { bpf_ktime_get_ns() });
    mark_failed(server);
    last.is_none_or(|at| now.wrapping_sub(at) >= REPORT_AGAIN_NS)
}

/// The slot of `MARKED_AT` that `server`'s marks stamp.
#[inline(always)]
pub(crate) fn mark_slot(server: &Endpoint) -> u32 {
    server.slot(0, MARK_SLOTS)
}

const _: () = assert!(MARK_SLOTS.is_power_of_two());

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
