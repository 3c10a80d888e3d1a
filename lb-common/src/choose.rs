//! The kernel's choice of a server for one connect to a VIP, as a pure
//! function: `lb-ebpf` calls it with the service from `SERVICES`, a
//! `usable` test backed by `FAILED_AT` and the hold-down, and a
//! `bpf_get_prandom_u32()`; the host tests it with unit and property tests.
//!
//! Written for the verifier: every loop runs over the constant
//! `0..MAX_SERVERS`, `usable` is evaluated once per valid server into a
//! bitmask ([`usable_mask`]) that the choice ([`choose_from_mask`]) then
//! reads (one snapshot: a failure mark that changes meanwhile cannot make
//! the two disagree), there is no division that can fault or panic (the
//! modulus is a [`NonZeroU32`]) and no index that needs a bounds check.
//! Between the two halves the kernel hides the mask's value from the
//! verifier (`unknown_to_verifier` in `lb-ebpf`), which would otherwise
//! follow up to 2^16 masks separately.

use core::num::NonZeroU32;

use crate::{Endpoint, MAX_SERVERS, Service};

// One bit per server in a `u32` mask.
const _: () = assert!(MAX_SERVERS <= 32);

/// What [`choose_server`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The service has no server (`count` is 0): refuse the connect.
    NoServer,
    /// Use `service.servers[index]`; `index < min(count, MAX_SERVERS)`.
    Server {
        /// Where the server is in `service.servers`.
        index: usize,
        /// A server failed within the hold-down was passed over: some of
        /// the `spread` group was not usable (`connect_skipped_failed`).
        /// Also set when every server had failed.
        skipped_failed: bool,
        /// Every server had failed within the hold-down; the first is used
        /// anyway, never black-hole (`connect_all_failed`).
        all_failed: bool,
    },
}

impl Choice {
    /// The chosen server's index, if any.
    pub const fn index(&self) -> Option<usize> {
        match *self {
            Self::NoServer => None,
            Self::Server { index, .. } => Some(index),
        }
    }
}

/// Choose the server for a connect to `service`'s VIP.
///
/// Within the first `spread` servers (clamped to `1..=count`), a usable one
/// picked by `random`, uniformly over the usable ones (up to the modulo bias
/// of `random % n`); failing that, the first usable server after that group;
/// failing that (every server failed within the hold-down), the first: never
/// black-hole. Only a service with no server gets [`Choice::NoServer`].
///
/// `usable` is called once per valid server, in order. This is
/// [`usable_mask`] followed by [`choose_from_mask`]; the kernel calls the
/// two itself, to hide the mask from the verifier in between.
#[inline(always)]
pub fn choose_server(service: &Service, usable: impl Fn(&Endpoint) -> bool, random: u32) -> Choice {
    choose_from_mask(service, usable_mask(service, usable), random)
}

/// The number of valid servers: `count`, at most `MAX_SERVERS`.
#[inline(always)]
const fn valid_servers(service: &Service) -> usize {
    if (service.count as usize) < MAX_SERVERS { service.count as usize } else { MAX_SERVERS }
}

/// Bit `i` set: server `i` is valid (`i < count`) and `usable`. `usable` is
/// called once per valid server, in order.
#[inline(always)]
pub fn usable_mask(service: &Service, usable: impl Fn(&Endpoint) -> bool) -> u32 {
    let len = valid_servers(service);
    let mut mask = 0u32;
    // `servers[i]` with `i` from the constant range needs no bounds check.
    for i in 0..MAX_SERVERS {
        if i < len && usable(&service.servers[i]) {
            mask |= 1 << i;
        }
    }
    mask
}

/// [`choose_server`] given the [`usable_mask`]. Bits of servers beyond
/// `count` are ignored.
#[inline(always)]
pub fn choose_from_mask(service: &Service, usable_mask: u32, random: u32) -> Choice {
    let len = valid_servers(service);
    if len == 0 {
        return Choice::NoServer;
    }
    let spread = service.spread as usize;
    let group = if spread < 1 {
        1
    } else if spread > len {
        len
    } else {
        spread
    };
    // `group <= len <= MAX_SERVERS <= 32`; shifted in u64 so 32 cannot overflow.
    let group_mask = ((1u64 << group) - 1) as u32;
    let valid_mask = ((1u64 << len) - 1) as u32;
    let usable_mask = usable_mask & valid_mask;

    let in_group = usable_mask & group_mask;
    if let Some(usable_in_group) = NonZeroU32::new(count_ones(in_group)) {
        return Choice::Server {
            index: nth_set_bit(in_group, random % usable_in_group),
            skipped_failed: usable_in_group.get() < group as u32,
            all_failed: false,
        };
    }
    let after_group = usable_mask & !group_mask;
    if after_group != 0 {
        return Choice::Server {
            index: nth_set_bit(after_group, 0),
            skipped_failed: true,
            all_failed: false,
        };
    }
    Choice::Server { index: 0, skipped_failed: true, all_failed: true }
}

/// Number of set bits. A plain loop: the BPF target has no population-count
/// instruction, and this keeps the generated code obvious.
#[inline(always)]
fn count_ones(mask: u32) -> u32 {
    let mut n = 0;
    for i in 0..MAX_SERVERS {
        n += (mask >> i) & 1;
    }
    n
}

/// Index of the `nth` set bit of `mask` (counting from 0, lowest first).
/// Callers pass `nth < count_ones(mask)`; otherwise the answer is 0, which
/// is still a valid server index.
#[inline(always)]
fn nth_set_bit(mask: u32, nth: u32) -> usize {
    let mut index = 0;
    let mut seen = 0;
    for i in 0..MAX_SERVERS {
        if (mask >> i) & 1 != 0 {
            if seen == nth {
                index = i;
            }
            seen += 1;
        }
    }
    index
}

#[cfg(test)]
mod tests {
    extern crate std;

    use std::{collections::BTreeSet, vec::Vec};

    use proptest::prelude::*;

    use super::*;

    fn server(i: usize) -> Endpoint {
        Endpoint::from_v4_raw(u32::from_ne_bytes([127, 0, 0, 10 + i as u8]), 6443u16.to_be())
    }

    fn service(count: u32, spread: u32) -> Service {
        let mut s = Service { count, spread, ..Service::default() };
        for (i, ep) in s.servers.iter_mut().enumerate() {
            *ep = server(i);
        }
        s
    }

    /// `usable` from the set of failed server indexes.
    fn failed(set: &[usize]) -> impl Fn(&Endpoint) -> bool + '_ {
        move |ep| !set.iter().any(|&i| server(i) == *ep)
    }

    fn pick(count: u32, spread: u32, failed_set: &[usize], random: u32) -> Choice {
        choose_server(&service(count, spread), failed(failed_set), random)
    }

    #[test]
    fn no_server_refuses() {
        assert_eq!(pick(0, 1, &[], 0), Choice::NoServer);
        assert_eq!(pick(0, 5, &[], 7), Choice::NoServer);
    }

    #[test]
    fn failover_takes_the_first_usable() {
        assert_eq!(
            pick(3, 1, &[], 99),
            Choice::Server { index: 0, skipped_failed: false, all_failed: false }
        );
        assert_eq!(
            pick(3, 1, &[0], 99),
            Choice::Server { index: 1, skipped_failed: true, all_failed: false }
        );
        assert_eq!(
            pick(3, 0, &[0, 1], 99),
            Choice::Server { index: 2, skipped_failed: true, all_failed: false }
        );
    }

    #[test]
    fn all_failed_uses_the_first() {
        assert_eq!(
            pick(3, 1, &[0, 1, 2], 5),
            Choice::Server { index: 0, skipped_failed: true, all_failed: true }
        );
        assert_eq!(
            pick(3, 3, &[0, 1, 2], 5),
            Choice::Server { index: 0, skipped_failed: true, all_failed: true }
        );
    }

    #[test]
    fn spread_picks_the_nth_usable_of_the_group() {
        // Group 0..3 with 1 failed: usable 0 and 2.
        assert_eq!(pick(4, 3, &[1], 0).index(), Some(0));
        assert_eq!(pick(4, 3, &[1], 1).index(), Some(2));
        assert_eq!(pick(4, 3, &[1], 2).index(), Some(0));
        assert_eq!(
            pick(4, 3, &[1], 0),
            Choice::Server { index: 0, skipped_failed: true, all_failed: false }
        );
        // Whole group failed: the first usable after it.
        assert_eq!(
            pick(4, 2, &[0, 1], 1),
            Choice::Server { index: 2, skipped_failed: true, all_failed: false }
        );
    }

    #[test]
    fn spread_and_count_are_clamped() {
        // spread > count is the whole list; count > MAX_SERVERS is MAX_SERVERS.
        assert_eq!(pick(2, 100, &[], 3).index(), Some(1));
        let mut all = BTreeSet::new();
        for r in 0..64 {
            all.insert(pick(1000, 1000, &[], r).index().unwrap());
        }
        assert_eq!(all, (0..MAX_SERVERS).collect());
    }

    #[test]
    fn usable_is_asked_once_per_valid_server() {
        let asked = core::cell::RefCell::new(Vec::new());
        let choice = choose_server(
            &service(5, 2),
            |ep| {
                asked.borrow_mut().push(*ep);
                false
            },
            0,
        );
        assert_eq!(choice, Choice::Server { index: 0, skipped_failed: true, all_failed: true });
        assert_eq!(*asked.borrow(), (0..5).map(server).collect::<Vec<_>>());
    }

    /// The kernel's choice as it was written before this module (two passes
    /// over the servers, counting as it goes), kept as the reference that
    /// `choose_server` must agree with, counts included.
    fn previous_kernel_choice(
        service: &Service,
        usable: impl Fn(&Endpoint) -> bool,
        random: u32,
    ) -> Choice {
        let len = (service.count as usize).min(MAX_SERVERS);
        if len == 0 {
            return Choice::NoServer;
        }
        let group = (service.spread as usize).clamp(1, len);
        let usable_in_group = service.servers[..group].iter().filter(|s| usable(s)).count() as u32;
        if usable_in_group > 0 {
            let skipped_failed = (usable_in_group as usize) < group;
            if group == 1 {
                return Choice::Server { index: 0, skipped_failed, all_failed: false };
            }
            let mut nth = random % usable_in_group;
            for (i, server) in service.servers[..group].iter().enumerate() {
                if usable(server) {
                    if nth == 0 {
                        return Choice::Server { index: i, skipped_failed, all_failed: false };
                    }
                    nth -= 1;
                }
            }
            unreachable!("usable changed between passes");
        }
        for i in group..len {
            if usable(&service.servers[i]) {
                return Choice::Server { index: i, skipped_failed: true, all_failed: false };
            }
        }
        Choice::Server { index: 0, skipped_failed: true, all_failed: true }
    }

    /// A service's shape and which of its servers are usable.
    fn case() -> impl Strategy<Value = (u32, u32, u32, u32)> {
        // count up to beyond MAX_SERVERS; spread including 0 and > count;
        // a usable bit per slot; a random value.
        (0u32..=20, 0u32..=20, any::<u32>(), any::<u32>())
    }

    proptest! {
        #[test]
        fn choice_is_always_a_valid_server((count, spread, usable_bits, random) in case()) {
            let usable = |ep: &Endpoint| (0..MAX_SERVERS).any(|i| server(i) == *ep && usable_bits & (1 << i) != 0);
            let len = (count as usize).min(MAX_SERVERS);
            match choose_server(&service(count, spread), usable, random) {
                Choice::NoServer => prop_assert_eq!(len, 0),
                Choice::Server { index, .. } => prop_assert!(index < len),
            }
        }

        #[test]
        fn agrees_with_the_previous_kernel_code((count, spread, usable_bits, random) in case()) {
            let usable = |ep: &Endpoint| (0..MAX_SERVERS).any(|i| server(i) == *ep && usable_bits & (1 << i) != 0);
            let svc = service(count, spread);
            prop_assert_eq!(choose_server(&svc, usable, random), previous_kernel_choice(&svc, usable, random));
        }

        #[test]
        fn mask_bits_beyond_count_are_ignored((count, spread, usable_bits, random) in case()) {
            let svc = service(count, spread);
            let valid = (0..valid_servers(&svc)).fold(0u32, |m, i| m | 1 << i);
            prop_assert_eq!(choose_from_mask(&svc, usable_bits, random), choose_from_mask(&svc, usable_bits & valid, random));
        }

        #[test]
        fn matches_the_rules((count, spread, usable_bits, random) in case()) {
            let len = (count as usize).min(MAX_SERVERS);
            prop_assume!(len > 0);
            let group = (spread as usize).clamp(1, len);
            let ok = |i: usize| usable_bits & (1 << i) != 0;
            let usable = |ep: &Endpoint| (0..len).any(|i| server(i) == *ep && ok(i));
            let Choice::Server { index, skipped_failed, all_failed } = choose_server(&service(count, spread), usable, random) else {
                return Err(TestCaseError::fail("a service with servers refused"));
            };
            let any_usable = (0..len).any(ok);
            let any_in_group = (0..group).any(ok);
            if !any_usable {
                // Every server failed: the first, never black-hole.
                prop_assert_eq!(index, 0);
                prop_assert!(all_failed && skipped_failed);
            } else if any_in_group {
                // Spread: only within the group, only a usable one.
                prop_assert!(index < group && ok(index));
                prop_assert!(!all_failed);
                prop_assert_eq!(skipped_failed, (0..group).any(|i| !ok(i)));
            } else {
                // Failover past the group: never a later server while an
                // earlier one is usable.
                prop_assert!(index >= group && ok(index));
                prop_assert!((group..index).all(|i| !ok(i)));
                prop_assert!(skipped_failed && !all_failed);
            }
        }

        #[test]
        fn random_reaches_every_usable_server_of_the_group(
            (count, spread, usable_bits, base) in (1u32..=16, 1u32..=16, any::<u32>(), 0..u32::MAX - 16),
        ) {
            let len = count as usize;
            let group = (spread as usize).min(len);
            let ok = |i: usize| usable_bits & (1 << i) != 0;
            let expected: BTreeSet<usize> = (0..group).filter(|&i| ok(i)).collect();
            prop_assume!(!expected.is_empty());
            let usable = |ep: &Endpoint| (0..len).any(|i| server(i) == *ep && ok(i));
            let svc = service(count, spread);
            // Any n consecutive random values reach each of the n usable
            // servers of the group exactly once.
            let n = expected.len() as u32;
            let picked: Vec<usize> = (base..base + n).map(|r| choose_server(&svc, usable, r).index().unwrap()).collect();
            let distinct: BTreeSet<usize> = picked.iter().copied().collect();
            prop_assert_eq!(picked.len(), distinct.len());
            prop_assert_eq!(distinct, expected);
        }
    }
}
