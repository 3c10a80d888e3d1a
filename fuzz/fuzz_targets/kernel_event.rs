//! What the kernel hands the daemon, from any bytes: a ring-buffer record
//! decoded as the daemon decodes it (`Event::from_bytes`), its kind, its
//! endpoints as socket addresses; a `COUNTERS` index as a
//! `Reason`; and the kernel's own choice of server (`choose_server`) for a
//! service of any shape, which must never index past its selection.
#![no_main]

use std::{cell::Cell, mem::size_of, net::SocketAddr};

use lb_common::{
    Endpoint, Event, EventKind, MAX_SERVERS, Reason, Service,
    choose::{Choice, choose_from_mask, choose_server},
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    event(data);
    reason(data);
    choice(data);
});

/// The record as the daemon reads it off the ring buffer.
fn event(data: &[u8]) {
    let Some(event) = Event::from_bytes(data) else {
        assert!(data.len() < size_of::<Event>(), "{} bytes hold a record", data.len());
        return;
    };
    match event.kind() {
        Ok(kind) => {
            assert_eq!(u32::from(kind), event.kind);
            assert_eq!(EventKind::try_from(event.kind), Ok(kind));
        }
        Err(unknown) => {
            assert_eq!(unknown.0, event.kind);
            assert!(!unknown.to_string().is_empty());
        }
    }
    for endpoint in [event.vip, event.server] {
        let addr = SocketAddr::from(endpoint);
        assert_eq!(addr.is_ipv4(), endpoint.is_v4(), "{endpoint:?} is {addr}");
        assert_eq!(endpoint.ipv4().is_some(), endpoint.is_v4());
        // The daemon looks services and servers up by address: the
        // conversion loses only the padding.
        assert_eq!(Endpoint::from(addr), Endpoint { _pad: [0; 2], ..endpoint }, "{addr}");
        let _ = addr.to_string();
    }
}

/// A counter index, as the daemon names the `COUNTERS` entries.
fn reason(data: &[u8]) {
    let Some(value) = u32_at(data, 0) else { return };
    match Reason::try_from(value) {
        Ok(reason) => {
            assert_eq!(reason.index(), value);
            assert_eq!(Reason::ALL[value as usize], reason);
            assert!(!reason.name().is_empty());
        }
        Err(unknown) => {
            assert!(value as usize >= Reason::COUNT);
            assert_eq!(unknown.0, value);
        }
    }
}

/// `choose_server` for a service whose count, spread, usable servers and
/// random value come from the bytes; its servers too, duplicates allowed.
fn choice(data: &[u8]) {
    let (Some(count), Some(spread), Some(mask), Some(random)) =
        (u32_at(data, 0), u32_at(data, 4), u32_at(data, 8), u32_at(data, 12))
    else {
        return;
    };
    let mut service = Service { count, spread, hold_down_ns: 0, ..Service::default() };
    for (i, server) in service.servers.iter_mut().enumerate() {
        let at = 16 + i * 6;
        if let (Some(addr), Some(port)) = (u32_at(data, at), data.get(at + 4..at + 6)) {
            *server = Endpoint::from_v4_raw(addr, u16::from_ne_bytes([port[0], port[1]]));
        }
    }
    // `usable` of the n-th call is bit n of the mask: the kernel asks once
    // per valid server, in order, whatever the servers' addresses.
    let asked = Cell::new(0usize);
    let usable = |_: &Endpoint| {
        let n = asked.get();
        asked.set(n + 1);
        n < 32 && mask & (1 << n) != 0
    };
    let choice = choose_server(&service, usable, random);
    let len = (count as usize).min(MAX_SERVERS);
    assert_eq!(asked.get(), len, "usable asked {} times for {len} servers", asked.get());
    let valid = if len == 32 { u32::MAX } else { (1u32 << len) - 1 };
    assert_eq!(choose_from_mask(&service, mask, random), choice);
    assert_eq!(choose_from_mask(&service, mask & valid, random), choice);
    match choice {
        Choice::NoServer => assert_eq!(len, 0, "a service with servers refused"),
        Choice::Server { index, skipped_failed, all_failed } => {
            assert!(len > 0, "a service without servers chose {index}");
            assert!(index < len, "index {index} of {len} servers");
            assert_eq!(choice.index(), Some(index));
            if mask & valid == 0 {
                // Never black-hole: every server failed, the first is used.
                assert!(all_failed && skipped_failed && index == 0);
            } else {
                assert!(
                    !all_failed && mask & (1 << index) != 0,
                    "{choice:?} with usable mask {mask:#x}"
                );
                let group = (spread as usize).clamp(1, len);
                if index >= group {
                    // Past the group only when none of the group is usable,
                    // and then the first usable after it.
                    assert_eq!(
                        mask & valid & ((1 << index) - 1),
                        0,
                        "{choice:?} skipped a usable server"
                    );
                }
                assert_eq!(
                    skipped_failed,
                    index >= group || (0..group).any(|i| mask & (1 << i) == 0)
                );
            }
        }
    }
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    data.get(at..at + 4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}
