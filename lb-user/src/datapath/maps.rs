//! The pinned maps as the daemon reads and writes them: a VIP's kernel
//! value, the live counts, the failure marks, the sockets followed through
//! a VIP, the counters; and the cleaning of what no service has any more
//! (decided by [`to_forget`], over plain data).

use std::{collections::HashSet, net::SocketAddr, path::Path, sync::Arc, time::Duration};

use anyhow::Context as _;
use aya::maps::{HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap};
use lb_common::{ConnKey, Endpoint, MAX_SERVERS, NETNS_ANY, Reason, Service as ServiceValue, maps};

use super::{
    pins::open_pinned_map,
    sockets::SocketTables,
    sys::monotonic_now_ns,
    upgrade::{check_layout, read_layout_version},
};
use crate::{
    balancer::{KernelValue, Selection},
    config::Scope,
};

/// Handles to the pinned maps the daemon reads and writes (all but the ring
/// buffer). [`super::Datapath`] holds one; [`PinnedMaps::open`] opens another on a
/// pin directory without its lock, to inspect it (tests, tools).
pub struct PinnedMaps {
    services: HashMap<MapData, Endpoint, ServiceValue>,
    failed_at: HashMap<MapData, Endpoint, u64>,
    sockets: Arc<SocketTables>,
    connections: PerCpuHashMap<MapData, ConnKey, i64>,
    counters: PerCpuArray<MapData, u64>,
}

/// What [`PinnedMaps::forget`] removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forgotten {
    /// `FAILED_AT` entries of servers in no service.
    pub failure_marks: usize,
    /// `CONNECTIONS` entries of (VIP, server) pairs no longer configured,
    /// with no live connection.
    pub connection_counts: usize,
}

/// What one VIP gets in the kernel: the balancer's value (selection and
/// states) and the service's settings the kernel applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VipEntry {
    /// The address clients connect to.
    pub vip: SocketAddr,
    /// The servers, best first, the spread, and the daemon's state of each
    /// (`Service::daemon_states`, kept in the kernel for a restarted daemon).
    pub value: KernelValue,
    /// How long the kernel skips a server after a connect to it failed.
    pub hold_down: Duration,
    /// Whose connects are rewritten: this network namespace's, or all.
    pub scope: Scope,
}

impl VipEntry {
    /// The kernel's value; `host_netns` is what `Scope::Host` writes
    /// ([`super::Datapath`] probed it at start).
    pub(super) fn to_value(&self, host_netns: u64) -> ServiceValue {
        let mut value = ServiceValue::default();
        let KernelValue { selection, states } = &self.value;
        let servers = &selection.servers;
        for (slot, server) in value.servers.iter_mut().zip(servers.iter().take(MAX_SERVERS)) {
            *slot = Endpoint::from(*server);
        }
        value.count = servers.len().min(MAX_SERVERS) as u32;
        value.spread = selection.spread.clamp(1, MAX_SERVERS) as u32;
        value.hold_down_ns = u64::try_from(self.hold_down.as_nanos()).unwrap_or(u64::MAX);
        for (slot, state) in value.daemon_states.iter_mut().zip(states) {
            *slot = *state;
        }
        value.netns_cookie = match self.scope {
            Scope::Host => host_netns,
            Scope::All => NETNS_ANY,
            Scope::None => lb_common::NETNS_NONE,
        };
        value
    }
}

impl PinnedMaps {
    /// Opens the maps pinned under `bpffs` without taking its lock, to look
    /// at them (or, in tests, to call [`forget`](Self::forget) as a daemon
    /// would). Fails if they are not of this lb's layout.
    pub fn open(bpffs: &Path) -> anyhow::Result<Self> {
        check_layout(bpffs, read_layout_version(bpffs)?)?;
        Self::from_maps(|name| open_pinned_map(bpffs, name))
    }

    pub(super) fn from_maps(
        mut map: impl FnMut(&str) -> anyhow::Result<Map>,
    ) -> anyhow::Result<Self> {
        macro_rules! typed {
            ($kind:ident, $name:expr) => {
                $kind::try_from(map($name)?)
                    .with_context(|| format!("map {} has an unexpected type or size", $name))?
            };
        }
        let sockets =
            SocketTables::new(map(maps::SOCKETS)?, map(maps::SOCKETS_UDP)?, map(maps::UDP_PEERS)?)?;
        Ok(Self {
            services: typed!(HashMap, maps::SERVICES),
            failed_at: typed!(HashMap, maps::FAILED_AT),
            sockets: Arc::new(sockets),
            connections: typed!(PerCpuHashMap, maps::CONNECTIONS),
            counters: typed!(PerCpuArray, maps::COUNTERS),
        })
    }

    /// How many sockets the tables can hold: (TCP, connected UDP).
    pub fn socket_capacity(&self) -> (usize, usize) {
        self.sockets.capacity()
    }

    /// The socket tables, to walk off the owner loop.
    pub fn socket_tables(&self) -> Arc<SocketTables> {
        Arc::clone(&self.sockets)
    }

    /// The kernel's count of connects that were rewritten but not tracked
    /// because the TCP socket table was full (`connect_untracked`).
    pub fn untracked_connects(&self) -> u64 {
        self.counter(Reason::ConnectUntracked)
    }

    /// The kernel's count of packets the external path dropped for want of
    /// a route or a resolved neighbour (`xdp_no_route`).
    pub fn unrouted_packets(&self) -> u64 {
        self.counter(Reason::XdpNoRoute)
    }

    /// One kernel decision counter, summed over the CPUs (0 if unreadable).
    fn counter(&self, reason: Reason) -> u64 {
        self.counters.get(&reason.index(), 0).map(|v| v.iter().sum()).unwrap_or(0)
    }

    /// Makes the `SERVICES` map equal `desired`, writing only what changed.
    /// Returns how many entries were written or removed.
    pub(super) fn reconcile(
        &mut self,
        desired: &[VipEntry],
        host_netns: u64,
    ) -> anyhow::Result<usize> {
        let wanted: std::collections::HashMap<Endpoint, ServiceValue> = desired
            .iter()
            .map(|entry| (Endpoint::from(entry.vip), entry.to_value(host_netns)))
            .collect();
        let services = &mut self.services;
        let existing: Vec<Endpoint> =
            services.keys().collect::<Result<_, _>>().context("listing SERVICES")?;
        let mut changes = 0;
        for vip in existing {
            if !wanted.contains_key(&vip) {
                services
                    .remove(&vip)
                    .with_context(|| format!("removing VIP {}", SocketAddr::from(vip)))?;
                changes += 1;
            }
        }
        for (vip, value) in wanted {
            if services.get(&vip, 0).ok() != Some(value) {
                // One update replaces the whole value: the kernel never sees
                // a half-written selection.
                services
                    .insert(vip, value, 0)
                    .with_context(|| format!("writing VIP {}", SocketAddr::from(vip)))?;
                changes += 1;
            }
        }
        Ok(changes)
    }

    /// Writes one VIP's entry (one whole-value update) unless it is unchanged.
    /// Whether it wrote.
    pub(super) fn write(&mut self, entry: &VipEntry, host_netns: u64) -> anyhow::Result<bool> {
        let (vip, value) = (Endpoint::from(entry.vip), entry.to_value(host_netns));
        let services = &mut self.services;
        if services.get(&vip, 0).ok() == Some(value) {
            return Ok(false);
        }
        services.insert(vip, value, 0).with_context(|| format!("writing VIP {}", entry.vip))?;
        Ok(true)
    }

    /// Stops rewriting connects to `vip` (removes its entry, if any).
    /// Whether there was one.
    pub(super) fn remove(&mut self, vip: SocketAddr) -> anyhow::Result<bool> {
        match self.services.remove(&Endpoint::from(vip)) {
            Ok(()) => Ok(true),
            Err(MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(e).with_context(|| format!("removing VIP {vip}")),
        }
    }

    /// The selection currently in the kernel for `vip`.
    pub fn selection(&self, vip: SocketAddr) -> Vec<SocketAddr> {
        match self.services.get(&Endpoint::from(vip), 0) {
            Ok(value) => value
                .servers
                .iter()
                .take(value.count as usize)
                .map(|e| SocketAddr::from(*e))
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    /// The whole value the kernel holds for `vip` (what an adopting daemon
    /// starts from): the selection, its spread, and the previous daemon's
    /// state of each selected server.
    pub fn kernel_value(&self, vip: SocketAddr) -> Option<KernelValue> {
        let value = self.services.get(&Endpoint::from(vip), 0).ok()?;
        let count = (value.count as usize).min(MAX_SERVERS);
        Some(KernelValue {
            selection: Selection {
                servers: value.servers[..count].iter().map(|e| SocketAddr::from(*e)).collect(),
                spread: value.spread.max(1) as usize,
            },
            states: value.daemon_states[..count].to_vec(),
        })
    }

    /// Live connections through `vip` to `server`.
    pub fn connections(&self, vip: SocketAddr, server: SocketAddr) -> i64 {
        let key = ConnKey { vip: vip.into(), server: server.into() };
        self.connections.get(&key, 0).map(|per_cpu| per_cpu.iter().sum()).unwrap_or(0)
    }

    /// Whether a connect to `server` failed less than `hold_down` ago.
    pub fn recently_failed(&self, server: SocketAddr, hold_down: Duration) -> bool {
        self.failed_at
            .get(&Endpoint::from(server), 0)
            .is_ok_and(|at| failed_within(at, monotonic_now_ns(), hold_down))
    }

    /// Every failure mark: server → when its connect failed.
    pub fn failure_times(&self) -> std::collections::HashMap<SocketAddr, u64> {
        self.failed_at
            .iter()
            .filter_map(Result::ok)
            .map(|(server, at)| (SocketAddr::from(server), at))
            .collect()
    }

    /// Every server with a failure mark in `FAILED_AT`.
    pub fn failure_marks(&self) -> Vec<SocketAddr> {
        self.failure_times().into_keys().collect()
    }

    /// Every (VIP, server) pair in `CONNECTIONS`, with its count.
    pub fn connection_counts(&self) -> Vec<(SocketAddr, SocketAddr, i64)> {
        self.connections
            .iter()
            .filter_map(Result::ok)
            .map(|(key, per_cpu)| {
                (SocketAddr::from(key.vip), SocketAddr::from(key.server), per_cpu.iter().sum())
            })
            .collect()
    }

    /// The kernel's decision counters, summed over CPUs, by reason name.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        Reason::ALL.into_iter().map(|reason| (reason.name(), self.counter(reason))).collect()
    }

    /// How many sockets the kernel tracks: (TCP, connected UDP).
    /// A walk of both tables: not for the owner loop.
    pub fn tracked_sockets(&self) -> (usize, usize) {
        self.sockets.count()
    }

    /// Removes what the kernel keeps about servers and pairs that are gone:
    /// the `FAILED_AT` mark of every server in no service of `live`, and
    /// the `CONNECTIONS` count of every (VIP, server) pair not in `live`
    /// once it has no live connection. `live` lists every service's VIP
    /// with all its servers (configured, runtime and default).
    pub fn forget(&mut self, live: &[(SocketAddr, Vec<SocketAddr>)]) -> anyhow::Result<Forgotten> {
        // Read first, remove after: removing while walking a hash map makes
        // the walk start over.
        let marks: Vec<Endpoint> =
            self.failed_at.keys().collect::<Result<_, _>>().context("listing FAILED_AT")?;
        let counts: Vec<(ConnKey, i64)> = self
            .connections
            .iter()
            .map(|entry| entry.map(|(key, per_cpu)| (key, per_cpu.iter().sum())))
            .collect::<Result<_, _>>()
            .context("reading CONNECTIONS")?;
        let (marks, counts) = to_forget(live, &marks, &counts);
        let mut forgotten = Forgotten::default();
        for server in marks {
            let what = || format!("removing the failure mark of {}", SocketAddr::from(server));
            forgotten.failure_marks +=
                usize::from(removed(self.failed_at.remove(&server)).with_context(what)?);
        }
        for key in counts {
            // A connect chosen before the pair left the selection may
            // establish between the read above and this removal; its close
            // then counts -1 on a fresh entry, which a later `forget`
            // removes once it nets to zero again. A race, not a leak.
            let what = || {
                format!(
                    "removing the count of {} via {}",
                    SocketAddr::from(key.server),
                    SocketAddr::from(key.vip)
                )
            };
            forgotten.connection_counts +=
                usize::from(removed(self.connections.remove(&key)).with_context(what)?);
        }
        Ok(forgotten)
    }
}

/// What [`PinnedMaps::forget`] removes, from plain data: the failure marks
/// (`marks`, from `FAILED_AT`) of servers in no service of `live`, and the
/// counts (`counts`, from `CONNECTIONS`, summed over CPUs) of (VIP, server)
/// pairs not in `live` that have no live connection. A pair that still
/// counts connections keeps its entry until they close: the kernel uncounts
/// them there.
fn to_forget(
    live: &[(SocketAddr, Vec<SocketAddr>)],
    marks: &[Endpoint],
    counts: &[(ConnKey, i64)],
) -> (Vec<Endpoint>, Vec<ConnKey>) {
    let servers: HashSet<Endpoint> =
        live.iter().flat_map(|(_, servers)| servers.iter().map(|s| Endpoint::from(*s))).collect();
    let pairs: HashSet<ConnKey> = live
        .iter()
        .flat_map(|(vip, servers)| {
            servers
                .iter()
                .map(|s| ConnKey { vip: Endpoint::from(*vip), server: Endpoint::from(*s) })
        })
        .collect();
    let marks = marks.iter().copied().filter(|server| !servers.contains(server)).collect();
    let counts = counts
        .iter()
        .filter(|(key, live)| *live == 0 && !pairs.contains(key))
        .map(|(key, _)| *key)
        .collect();
    (marks, counts)
}

/// Whether a map removal removed something: a key that is already gone
/// (the kernel removed it meanwhile) is not an error.
fn removed(result: Result<(), MapError>) -> Result<bool, MapError> {
    match result {
        Ok(()) => Ok(true),
        Err(MapError::KeyNotFound) => Ok(false),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Whether a failure mark set at `at_ns` is less than `hold_down` older
/// than `now_ns` (both `CLOCK_MONOTONIC`, as `bpf_ktime_get_ns`). A mark
/// from after `now_ns` (set while the caller read the clock) is recent.
pub fn failed_within(at_ns: u64, now_ns: u64, hold_down: Duration) -> bool {
    now_ns.saturating_sub(at_ns) < hold_down.as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_mark_is_recent_for_its_hold_down_only() {
        let second = 1_000_000_000;
        let hold_down = Duration::from_secs(5);
        assert!(failed_within(10 * second, 14 * second, hold_down));
        assert!(!failed_within(10 * second, 15 * second, hold_down), "hold-down over");
        assert!(!failed_within(10 * second, 20 * second, hold_down));
        assert!(failed_within(15 * second, 14 * second, hold_down), "marked after the read");
        assert!(!failed_within(10 * second, 10 * second, Duration::ZERO), "no hold-down");
    }

    #[test]
    fn selection_value_is_whole_and_ordered() {
        let entry = VipEntry {
            vip: "127.0.0.1:80".parse().unwrap(),
            value: KernelValue {
                selection: Selection {
                    servers: vec!["127.0.0.2:80".parse().unwrap(), "127.0.0.3:81".parse().unwrap()],
                    spread: 2,
                },
                states: vec![7, 1],
            },
            hold_down: Duration::from_millis(1500),
            scope: Scope::Host,
        };
        let value = entry.to_value(42);
        assert_eq!(value.netns_cookie, 42, "host scope: the daemon's namespace");
        assert_eq!(
            VipEntry { scope: Scope::All, ..entry.clone() }.to_value(42).netns_cookie,
            NETNS_ANY
        );
        assert_eq!(value.count, 2);
        assert_eq!(value.spread, 2);
        assert_eq!(value.hold_down_ns, 1_500_000_000);
        assert_eq!(SocketAddr::from(value.servers[1]), "127.0.0.3:81".parse().unwrap());
        assert_eq!(value.servers[2], Endpoint::default());
        assert_eq!(value.daemon_states[..3], [7, 1, 0]);
    }

    #[test]
    fn forget_takes_only_what_no_service_has() {
        let a = |s: &str| -> SocketAddr { s.parse().unwrap() };
        let (vip1, vip2) = (a("127.0.0.1:80"), a("127.0.0.1:81"));
        let (s1, s2, s3) = (a("127.10.0.1:80"), a("127.10.0.2:80"), a("127.10.0.3:80"));
        let pair =
            |vip, server| ConnKey { vip: Endpoint::from(vip), server: Endpoint::from(server) };
        let live = [(vip1, vec![s1]), (vip2, vec![s2])];
        let marks = [s1, s2, s3].map(Endpoint::from);
        let counts = [
            (pair(vip1, s1), 0), // configured: stays
            (pair(vip1, s2), 0), // s2 is only vip2's now: goes, though s2's mark stays
            (pair(vip1, s3), 2), // removed, but two connections still open: stays
            (pair(vip2, s3), 0), // removed and idle: goes
        ];
        let (marks, counts) = to_forget(&live, &marks, &counts);
        assert_eq!(marks, vec![Endpoint::from(s3)]);
        assert_eq!(counts, vec![pair(vip1, s2), pair(vip2, s3)]);
        assert_eq!(to_forget(&live, &[], &[]), (vec![], vec![]));
    }
}
