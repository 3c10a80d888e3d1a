//! The external path's pinned maps as the daemon reads and writes them:
//! which VIPs it serves (`EXTERNAL`), the node's address toward each
//! server (`NODE_ADDRESSES`), the addresses it announces (`ANNOUNCE`,
//! and the fences of elected ones, `ANNOUNCE_UNTIL`), and what it counts:
//! flows, NAT ports, traffic per server.

use std::{
    collections::{BTreeMap, HashMap as StdHashMap, HashSet},
    net::{IpAddr, SocketAddr},
    sync::{Mutex, PoisonError},
};

use anyhow::Context as _;
use aya::maps::{HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap};
use lb_common::{
    AnnounceKey, AnnounceValue, Endpoint, Flow, FlowKey, MAX_SERVICES, NatKey, NatReply, Traffic,
    TrafficSlot, maglev::Maglev, maps,
};

use super::{fast_path::FastPathMaps, sockets::max_entries};

/// Handles to the external path's pinned maps.
pub struct ExternalMaps {
    vips: HashMap<MapData, Endpoint, u32>,
    node_addresses: HashMap<MapData, Endpoint, Endpoint>,
    flows: HashMap<MapData, FlowKey, Flow>,
    nat: HashMap<MapData, NatKey, NatReply>,
    opening_flows: HashMap<MapData, FlowKey, Flow>,
    opening_nat: HashMap<MapData, NatKey, NatReply>,
    udp_flows: HashMap<MapData, FlowKey, Flow>,
    udp_nat: HashMap<MapData, NatKey, NatReply>,
    traffic: PerCpuHashMap<MapData, Endpoint, Traffic>,
    traffic_slots: PerCpuArray<MapData, TrafficSlot>,
    /// What `traffic` last said, per server: its figures never go down.
    traffic_reported: Mutex<BTreeMap<SocketAddr, Forwarded>>,
    announce: HashMap<MapData, AnnounceKey, AnnounceValue>,
    maglev: HashMap<MapData, Endpoint, Maglev>,
    announce_until: HashMap<MapData, [u32; 4], u64>,
    link_macs: HashMap<MapData, u32, AnnounceValue>,
    /// `FLOWS`' size (`[daemon] flow_table` when it was attached).
    flow_capacity: usize,
    /// `EPOCH` and `VIP_PORTS`, for the established flows' short way.
    fast_path: FastPathMaps,
}

/// The external VIPs, as `ExternalMaps::set_vips` tells `lb_xdp`.
#[derive(Debug, Default)]
pub struct ExternalVips {
    /// Every external VIP.
    pub vips: HashSet<SocketAddr>,
    /// Those whose flows keep the client's address (destination NAT only).
    pub keeping: HashSet<SocketAddr>,
    /// Those whose new flows are placed by the client's address alone.
    pub by_address: HashSet<SocketAddr>,
    /// The ports of the servers of those: their replies go to the client's
    /// own port, and are looked up by their source port.
    pub server_ports: HashSet<u16>,
}

/// An address announced on one interface: (interface index, address).
pub type Announced = (u32, IpAddr);

/// What the external path forwarded to one server, over every CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forwarded {
    /// Packets.
    pub packets: u64,
    /// Their bytes (IP header and payload).
    pub bytes: u64,
}

impl ExternalMaps {
    pub(super) fn from_maps(
        mut map: impl FnMut(&str) -> anyhow::Result<Map>,
    ) -> anyhow::Result<Self> {
        macro_rules! typed {
            ($kind:ident, $name:expr) => {
                $kind::try_from(map($name)?)
                    .with_context(|| format!("map {} has an unexpected type or size", $name))?
            };
        }
        let fast_path = FastPathMaps::from_maps(&mut map)?;
        let flows = map(maps::FLOWS)?;
        let flow_capacity = max_entries(&flows, maps::FLOWS)?;
        Ok(Self {
            fast_path,
            flow_capacity,
            flows: HashMap::try_from(flows)
                .with_context(|| format!("map {} has an unexpected type or size", maps::FLOWS))?,
            vips: typed!(HashMap, maps::EXTERNAL),
            node_addresses: typed!(HashMap, maps::NODE_ADDRESSES),
            nat: typed!(HashMap, maps::NAT_REPLIES),
            opening_flows: typed!(HashMap, maps::OPENING_FLOWS),
            opening_nat: typed!(HashMap, maps::OPENING_REPLIES),
            udp_flows: typed!(HashMap, maps::UDP_FLOWS),
            udp_nat: typed!(HashMap, maps::UDP_REPLIES),
            traffic: typed!(PerCpuHashMap, maps::TRAFFIC),
            traffic_slots: typed!(PerCpuArray, maps::TRAFFIC_SLOTS),
            traffic_reported: Mutex::default(),
            announce: typed!(HashMap, maps::ANNOUNCE),
            maglev: typed!(HashMap, maps::MAGLEV),
            announce_until: typed!(HashMap, maps::ANNOUNCE_UNTIL),
            link_macs: typed!(HashMap, maps::LINK_MACS),
        })
    }

    /// How many flows `FLOWS` (and `NAT_REPLIES`) can hold.
    pub fn flow_capacity(&self) -> usize {
        self.flow_capacity
    }

    /// Ends the verdicts `lb_xdp` keeps for established flows (a new
    /// `EPOCH`): after a change to `SERVICES`.
    pub fn new_epoch(&mut self) -> anyhow::Result<()> {
        self.fast_path.new_epoch()
    }

    /// Makes `EXTERNAL` hold exactly `vips` (with the flag of those that
    /// keep the client's address), and each of their addresses with port
    /// 0: `lb_xdp` answers or drops what arrives for a VIP's address that
    /// it does not serve, rather than hand it to a kernel that does not
    /// own the address; and `VIP_PORTS` their ports and the ports of the
    /// servers of those that keep the client's address.
    /// Returns how many entries of `EXTERNAL` changed.
    pub fn set_vips(&mut self, vips: &ExternalVips) -> anyhow::Result<usize> {
        let addresses = vips.vips.iter().map(|vip| (SocketAddr::new(vip.ip(), 0), 0));
        let flags = |vip: &SocketAddr| {
            let flag = |set: &HashSet<SocketAddr>, flag| if set.contains(vip) { flag } else { 0 };
            flag(&vips.keeping, lb_common::EXTERNAL_KEEP_CLIENT)
                | flag(&vips.by_address, lb_common::EXTERNAL_CLIENT_AFFINITY)
        };
        let wanted: StdHashMap<Endpoint, u32> = vips
            .vips
            .iter()
            .map(|vip| (*vip, flags(vip)))
            .chain(addresses)
            .map(|(vip, flags)| (Endpoint::from(vip), flags))
            .collect();
        if wanted.len() > MAX_SERVICES as usize {
            anyhow::bail!(
                "{} external VIPs and their {} addresses are more than EXTERNAL holds ({MAX_SERVICES})",
                vips.vips.len(),
                wanted.len() - vips.vips.len()
            );
        }
        let present: StdHashMap<Endpoint, u32> = self.vips.iter().filter_map(Result::ok).collect();
        let mut changed = 0;
        for (vip, &flags) in &wanted {
            if present.get(vip) != Some(&flags) {
                self.vips
                    .insert(vip, flags, 0)
                    .with_context(|| format!("writing {} to EXTERNAL", SocketAddr::from(*vip)))?;
                changed += 1;
            }
        }
        for vip in present.keys().filter(|vip| !wanted.contains_key(vip)) {
            remove(&mut self.vips, vip).context("removing a VIP from EXTERNAL")?;
            changed += 1;
        }
        if changed > 0 {
            self.fast_path.new_epoch()?;
        }
        // Ports after the VIPs: a port is looked up among the established
        // flows first only while some VIP has it, and no flow is
        // established before its VIP is in `EXTERNAL`.
        let ports = vips.vips.iter().map(SocketAddr::port).chain(vips.server_ports.iter().copied());
        self.fast_path.set_ports(ports)?;
        Ok(changed)
    }

    /// Makes `NODE_ADDRESSES` hold exactly `addresses`: each server's NAT
    /// sources, the node's address toward it first, then at most
    /// `lb_common::MAX_NAT_ADDRESSES` more (under the server's address
    /// with ports 1 to their number, which the first entry's port says).
    /// Returns how many entries changed.
    pub fn set_node_addresses(
        &mut self,
        addresses: &StdHashMap<IpAddr, Vec<IpAddr>>,
    ) -> anyhow::Result<usize> {
        let at = |ip: IpAddr, port: usize| Endpoint::from(SocketAddr::new(ip, port as u16));
        let mut wanted: StdHashMap<Endpoint, Endpoint> = StdHashMap::new();
        for (&server, sources) in addresses {
            let sources = &sources[..sources.len().min(lb_common::MAX_NAT_ADDRESSES + 1)];
            for (k, &source) in sources.iter().enumerate() {
                let more = if k == 0 { sources.len() - 1 } else { 0 };
                wanted.insert(at(server, k), at(source, more));
            }
        }
        let present: StdHashMap<Endpoint, Endpoint> =
            self.node_addresses.iter().filter_map(Result::ok).collect();
        let mut changed = 0;
        for (server, node) in &wanted {
            if present.get(server) != Some(node) {
                self.node_addresses.insert(server, node, 0).with_context(|| {
                    format!("writing {} to NODE_ADDRESSES", SocketAddr::from(*server).ip())
                })?;
                changed += 1;
            }
        }
        for server in present.keys().filter(|s| !wanted.contains_key(s)) {
            remove(&mut self.node_addresses, server)
                .context("removing a server from NODE_ADDRESSES")?;
            changed += 1;
        }
        Ok(changed)
    }

    /// Makes `ANNOUNCE` hold exactly `wanted` (each address on its
    /// interface, with that interface's MAC) and `ANNOUNCE_UNTIL` exactly
    /// `fences` (each elected address, with the `CLOCK_MONOTONIC`
    /// nanosecond its answers stop at: the holder's lease fence). Returns
    /// the entries added or changed: their neighbours are told at once.
    ///
    /// In the one order that never has an elected address answered
    /// unfenced, even by a daemon killed between two writes: the fences
    /// written first, then `ANNOUNCE`, and only then the fences of the
    /// addresses no longer elected removed (an address withdrawn keeps its
    /// fence until it is out of `ANNOUNCE`; a fence left by a crash fences
    /// an address nobody announces).
    pub fn set_announced_fenced(
        &mut self,
        wanted: &StdHashMap<Announced, [u8; 6]>,
        fences: &StdHashMap<IpAddr, u64>,
    ) -> anyhow::Result<Vec<Announced>> {
        self.write_fences(fences)?;
        let added = self.set_announced(wanted)?;
        self.remove_fences_but(fences)?;
        Ok(added)
    }

    /// Makes `ANNOUNCE` hold exactly `wanted`; see
    /// [`Self::set_announced_fenced`].
    fn set_announced(
        &mut self,
        wanted: &StdHashMap<Announced, [u8; 6]>,
    ) -> anyhow::Result<Vec<Announced>> {
        let key = |(ifindex, ip): Announced| AnnounceKey {
            ifindex,
            addr: Endpoint::from(SocketAddr::new(ip, 0)).addr,
        };
        let present: StdHashMap<AnnounceKey, AnnounceValue> =
            self.announce.iter().filter_map(Result::ok).collect();
        let mut added = Vec::new();
        for (&announced, &mac) in wanted {
            let value = AnnounceValue { mac, _pad: [0; 2] };
            if present.get(&key(announced)) != Some(&value) {
                self.announce.insert(key(announced), value, 0).with_context(|| {
                    format!("announcing {} on interface {}", announced.1, announced.0)
                })?;
                added.push(announced);
            }
        }
        let wanted_keys: HashSet<AnnounceKey> = wanted.keys().map(|a| key(*a)).collect();
        for gone in present.keys().filter(|k| !wanted_keys.contains(k)) {
            remove(&mut self.announce, gone).context("withdrawing an announced VIP")?;
        }
        Ok(added)
    }

    /// Writes each of `fences` into `ANNOUNCE_UNTIL` where it differs.
    fn write_fences(&mut self, fences: &StdHashMap<IpAddr, u64>) -> anyhow::Result<()> {
        let present: StdHashMap<[u32; 4], u64> =
            self.announce_until.iter().filter_map(Result::ok).collect();
        for (&ip, &until) in fences {
            if present.get(&fence_key(ip)) != Some(&until) {
                self.announce_until
                    .insert(fence_key(ip), until, 0)
                    .with_context(|| format!("writing the fence of {ip} to ANNOUNCE_UNTIL"))?;
            }
        }
        Ok(())
    }

    /// Removes from `ANNOUNCE_UNTIL` every fence but those of `fences`.
    fn remove_fences_but(&mut self, fences: &StdHashMap<IpAddr, u64>) -> anyhow::Result<()> {
        let present: Vec<[u32; 4]> = self.announce_until.keys().filter_map(Result::ok).collect();
        let wanted: HashSet<[u32; 4]> = fences.keys().map(|ip| fence_key(*ip)).collect();
        for gone in present.iter().filter(|k| !wanted.contains(*k)) {
            remove(&mut self.announce_until, gone).context("removing a fence")?;
        }
        Ok(())
    }

    /// Makes `LINK_MACS` hold exactly `macs` (interface index → its MAC),
    /// the interfaces `lb_xdp` runs on: it forwards only frames sent to
    /// the interface's own address.
    pub fn set_link_macs(&mut self, macs: &StdHashMap<u32, [u8; 6]>) -> anyhow::Result<()> {
        let present: StdHashMap<u32, AnnounceValue> =
            self.link_macs.iter().filter_map(Result::ok).collect();
        let mut changed = false;
        for (&ifindex, &mac) in macs {
            let value = AnnounceValue { mac, _pad: [0; 2] };
            if present.get(&ifindex) != Some(&value) {
                self.link_macs
                    .insert(ifindex, value, 0)
                    .with_context(|| format!("writing interface {ifindex}'s MAC to LINK_MACS"))?;
                changed = true;
            }
        }
        for gone in present.keys().filter(|i| !macs.contains_key(*i)) {
            remove(&mut self.link_macs, gone).context("removing an interface from LINK_MACS")?;
            changed = true;
        }
        if changed {
            self.fast_path.new_epoch()?;
        }
        Ok(())
    }

    /// Makes `MAGLEV` hold exactly `tables` (VIP → its table), writing
    /// only what changed. Returns how many entries changed.
    pub fn set_maglev(&mut self, tables: &StdHashMap<SocketAddr, Maglev>) -> anyhow::Result<usize> {
        let wanted: StdHashMap<Endpoint, &Maglev> =
            tables.iter().map(|(vip, table)| (Endpoint::from(*vip), table)).collect();
        let present: StdHashMap<Endpoint, Maglev> =
            self.maglev.iter().filter_map(Result::ok).collect();
        let mut changed = 0;
        for (vip, table) in &wanted {
            if present.get(vip) != Some(*table) {
                self.maglev.insert(vip, *table, 0).with_context(|| {
                    format!("writing the Maglev table of {}", SocketAddr::from(*vip))
                })?;
                changed += 1;
            }
        }
        for vip in present.keys().filter(|v| !wanted.contains_key(v)) {
            remove(&mut self.maglev, vip).context("removing a Maglev table")?;
            changed += 1;
        }
        Ok(changed)
    }

    /// Flows in the flow tables: (established, every one). Established:
    /// TCP flows whose client acknowledged the server's answer, which new
    /// flows never evict. Each table is walked once.
    pub fn flows(&self) -> (usize, usize) {
        let established = self.flows.keys().filter(Result::is_ok).count();
        let others = self.opening_flows.keys().filter(Result::is_ok).count()
            + self.udp_flows.keys().filter(Result::is_ok).count();
        (established, established + others)
    }

    /// NAT ports held (one per flow's reply key).
    pub fn nat_ports(&self) -> usize {
        self.nat.keys().filter(Result::is_ok).count()
            + self.opening_nat.keys().filter(Result::is_ok).count()
            + self.udp_nat.keys().filter(Result::is_ok).count()
    }

    /// What was forwarded to each server, summed over the CPUs: its
    /// `TRAFFIC` entry and the slots of `TRAFFIC_SLOTS` it holds
    /// (`lb_common::TrafficSlot`).
    ///
    /// `TRAFFIC` is read first. A slot that changes hands between the two
    /// reads moves its counts to its holder's entry, and they are in
    /// neither; such a reading is smaller than the one before, and the one
    /// before is reported instead: the figures only grow, as counters must.
    pub fn traffic(&self) -> BTreeMap<SocketAddr, Forwarded> {
        let mut found: BTreeMap<SocketAddr, Forwarded> = BTreeMap::new();
        let mut add = |server: Endpoint, t: &Traffic| {
            let sum = found.entry(SocketAddr::from(server)).or_default();
            sum.packets += t.packets;
            sum.bytes += t.bytes;
        };
        for (server, per_cpu) in self.traffic.iter().filter_map(Result::ok) {
            per_cpu.iter().for_each(|t| add(server, t));
        }
        for per_cpu in self.traffic_slots.iter().filter_map(Result::ok) {
            for slot in per_cpu.iter().filter(|slot| slot.server != Endpoint::default()) {
                add(slot.server, &slot.traffic);
            }
        }
        let mut reported = self.traffic_reported.lock().unwrap_or_else(PoisonError::into_inner);
        never_less(&mut found, &mut reported);
        found
    }
}

/// Raises each server's figures in `found` to at least those `reported`
/// before (adding the servers it lacks), and records them as reported.
fn never_less(
    found: &mut BTreeMap<SocketAddr, Forwarded>,
    reported: &mut BTreeMap<SocketAddr, Forwarded>,
) {
    for (server, now) in found.iter_mut() {
        let before = reported.entry(*server).or_default();
        now.packets = now.packets.max(before.packets);
        now.bytes = now.bytes.max(before.bytes);
        *before = *now;
    }
    // A server whose counts were all in transit is reported as before.
    for (server, before) in reported.iter() {
        found.entry(*server).or_insert(*before);
    }
}

/// Removes `key`; one already gone is no error.
fn remove<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    key: &K,
) -> Result<(), MapError> {
    match map.remove(key) {
        Err(MapError::KeyNotFound) | Ok(()) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The `ANNOUNCE_UNTIL` key of `ip`.
fn fence_key(ip: IpAddr) -> [u32; 4] {
    Endpoint::from(SocketAddr::new(ip, 0)).addr
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forwarded(packets: u64, bytes: u64) -> Forwarded {
        Forwarded { packets, bytes }
    }

    #[test]
    fn traffic_figures_never_go_down() {
        let a: SocketAddr = "198.18.2.2:8080".parse().unwrap();
        let b: SocketAddr = "198.18.2.3:8080".parse().unwrap();
        let mut reported = BTreeMap::new();
        let mut found = BTreeMap::from([(a, forwarded(10, 1000)), (b, forwarded(1, 100))]);
        never_less(&mut found, &mut reported);
        assert_eq!(found[&a], forwarded(10, 1000));
        // a's slot changed hands between the two reads: its counts were in
        // neither map.
        let mut found = BTreeMap::from([(a, forwarded(4, 400)), (b, forwarded(2, 200))]);
        never_less(&mut found, &mut reported);
        assert_eq!(found[&a], forwarded(10, 1000), "a went down");
        assert_eq!(found[&b], forwarded(2, 200), "b's growth was lost");
        // The next reading has them again, and more; b's counts are in
        // transit, in neither map.
        let mut found = BTreeMap::from([(a, forwarded(12, 1200))]);
        never_less(&mut found, &mut reported);
        assert_eq!(found[&a], forwarded(12, 1200));
        assert_eq!(found[&b], forwarded(2, 200), "b went missing");
    }
}
