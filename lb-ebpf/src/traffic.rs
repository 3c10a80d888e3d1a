//! What the external path forwarded to each server, counted per CPU:
//! in the server's slot of `TRAFFIC_SLOTS` (found by a hash of the
//! server, no hash-map lookup) while it holds it, else in its `TRAFFIC`
//! entry (`lb_common::TrafficSlot`). The daemon sums both.

#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys and values go by reference: by value, each is one more copy on a stack that \
              holds 512 bytes for the whole call chain"
)]

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_jiffies64};
use lb_common::{Endpoint, Reason, TRAFFIC_SLOT_IDLE_TICKS, Traffic, TrafficSlot, traffic_slot};

use crate::maps::{TRAFFIC, TRAFFIC_SLOTS, count_xdp};

/// Counts a packet of `bytes` forwarded to `server`: in this CPU's slot
/// of `TRAFFIC_SLOTS` for it if the server holds it, or takes it (free,
/// or idle for `TRAFFIC_SLOT_IDLE_TICKS`, its counts moved to its holder's
/// `TRAFFIC` entry); else in `TRAFFIC` (`lb_common::TrafficSlot`).
#[inline(always)]
pub(crate) fn add_traffic(server: &Endpoint, bytes: u32) {
    // SAFETY: plain helper call without arguments.
    add_traffic_at(server, bytes, unsafe { bpf_jiffies64() });
}

/// As `add_traffic`, at `now` (`bpf_jiffies64()`), read by the caller.
#[inline(always)]
pub(crate) fn add_traffic_at(server: &Endpoint, bytes: u32, now: u64) {
    if let Some(slot) = TRAFFIC_SLOTS.get_ptr_mut(traffic_slot(server)) {
        // SAFETY: this CPU's slot, written only by `lb_xdp` on this CPU,
        // which runs one packet at a time (see `count_xdp`).
        let slot = unsafe { &mut *slot };
        if slot.server == *server || take_slot(slot, server, now) {
            slot.used_at = now;
            slot.traffic.packets += 1;
            slot.traffic.bytes += u64::from(bytes);
            return;
        }
    }
    let Some(traffic) = traffic_entry(server) else { return };
    // SAFETY: a per-CPU map value of two u64s, valid for the program run;
    // plain adds, as in `count_xdp`.
    unsafe {
        (*traffic).packets += 1;
        (*traffic).bytes += u64::from(bytes);
    }
}

/// Whether `server` may have `slot`, and has it now: the slot is free, or
/// its holder has not used it for `TRAFFIC_SLOT_IDLE_TICKS` and its counts
/// moved to the holder's `TRAFFIC` entry.
#[inline(always)]
fn take_slot(slot: &mut TrafficSlot, server: &Endpoint, now: u64) -> bool {
    if slot.server != Endpoint::default() {
        if now.wrapping_sub(slot.used_at) < TRAFFIC_SLOT_IDLE_TICKS {
            return false;
        }
        let Some(traffic) = traffic_entry(&slot.server) else { return false };
        // SAFETY: as in `add_traffic`.
        unsafe {
            (*traffic).packets += slot.traffic.packets;
            (*traffic).bytes += slot.traffic.bytes;
        }
    }
    *slot = TrafficSlot { server: *server, ..TrafficSlot::default() };
    true
}

/// This CPU's entry of `server` in `TRAFFIC`, as sock_ops counts
/// connections (`add_connection`): the first packet to a server on any
/// CPU creates its entry (the other CPUs' slots start at zero); one that
/// lost that race to another CPU adds to the entry it made. `None`
/// (counted) if the map is full.
#[inline(always)]
fn traffic_entry(server: &Endpoint) -> Option<*mut Traffic> {
    if TRAFFIC.get_ptr_mut(server).is_none() {
        let _ = TRAFFIC.insert(server, &Traffic::default(), u64::from(BPF_NOEXIST));
    }
    let entry = TRAFFIC.get_ptr_mut(server);
    if entry.is_none() {
        count_xdp(Reason::MapError);
    }
    entry
}
