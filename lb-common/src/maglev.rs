//! Consistent hashing for the external path's `spread` (Maglev, Eisenbud
//! et al., NSDI 2016): a table of [`MAGLEV_SLOTS`] slots, each naming one
//! server of the service's spread group, built by the daemon
//! (`lb-user/src/maglev.rs`) so that every server owns nearly the same
//! number of slots and a change of servers moves few slots besides those
//! of the server that changed. A new flow's slot is [`slot`] of its
//! [`flow_hash`]; the kernel and the host compute both with this code.

use crate::{Endpoint, MAX_SERVERS};

/// Slots in a table: a prime, so that every server's permutation visits
/// every slot; about 64 per server at the most servers a service has.
pub const MAGLEV_SLOTS: usize = 1021;
/// The power of two above [`MAGLEV_SLOTS`]: a mask the verifier reads as
/// a bound.
const SLOTS_BOUND: usize = 1024;
const _: () = assert!(MAGLEV_SLOTS < SLOTS_BOUND && SLOTS_BOUND.is_power_of_two());

/// `MAGLEV`'s value: one service's table.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Maglev {
    /// The servers the slots name (the first `count`).
    pub servers: [Endpoint; MAX_SERVERS],
    /// How many of `servers` are valid.
    pub count: u32,
    /// Each slot's server, an index into `servers`.
    pub slots: [u8; MAGLEV_SLOTS],
    /// Zero.
    pub _pad: [u8; 3],
}

impl Default for Maglev {
    fn default() -> Self {
        Self {
            servers: [Endpoint::default(); MAX_SERVERS],
            count: 0,
            slots: [0; MAGLEV_SLOTS],
            _pad: [0; 3],
        }
    }
}

const _: () = assert!(MAX_SERVERS <= u8::MAX as usize);
const _: () = assert!(size_of::<Maglev>() == MAX_SERVERS * 20 + 4 + MAGLEV_SLOTS + 3);

/// A flow's hash: its client's address and port and its protocol (the
/// VIP is the table's), mixed so that neighbouring ports spread.
#[inline(always)]
pub fn flow_hash(client: &Endpoint, protocol: u8) -> u32 {
    let mut h = 0x9e37_79b9u32 ^ u32::from(protocol);
    let words =
        [client.addr[0], client.addr[1], client.addr[2], client.addr[3], u32::from(client.port)];
    let mut i = 0;
    while i < words.len() {
        h = mix(h ^ words[i]);
        i += 1;
    }
    h
}

/// A 32-bit finalizer (murmur3's fmix32).
#[inline(always)]
const fn mix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// The slot of a flow with `hash`.
#[inline(always)]
pub const fn slot(hash: u32) -> usize {
    hash as usize % MAGLEV_SLOTS
}

/// The server `table` gives a flow with `hash`, if the slot names a valid
/// one.
#[inline(always)]
pub fn server_for(table: &Maglev, hash: u32) -> Option<Endpoint> {
    // Verifier workaround: the compiler divides by multiplying, which the
    // verifier cannot bound, and drops any bound after it as redundant
    // (`slot < MAGLEV_SLOTS` already). Read back through a volatile load,
    // the slot is opaque to the compiler, and the mask bounds it for the
    // verifier; it changes nothing (`MAGLEV_SLOTS < 1024`).
    let slot = slot(hash);
    // SAFETY: a read of a local.
    let slot = unsafe { core::ptr::read_volatile(&raw const slot) } & (SLOTS_BOUND - 1);
    let index = usize::from(*table.slots.get(slot)?);
    if index >= table.count as usize {
        return None;
    }
    table.servers.get(index).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_ports_spread_over_the_slots() {
        let mut seen = [false; MAGLEV_SLOTS];
        for port in 40_000u16..41_000 {
            let client = Endpoint::from_v4_raw(u32::from_ne_bytes([198, 18, 0, 10]), port.to_be());
            seen[slot(flow_hash(&client, 6))] = true;
        }
        let used = seen.iter().filter(|s| **s).count();
        // 1,000 ports thrown at 1,021 slots at random fill about 63% of them.
        assert!(used > 550, "only {used} slots used");
    }
}
