//! The socket tables: `SOCKETS` (TCP) and `SOCKETS_UDP` (connected UDP),
//! every live socket that connected through a VIP, by cookie; and
//! `UDP_PEERS`, every live UDP socket that sent (or connected) to a VIP,
//! with the servers whose answers it sees as from the VIP.
//!
//! A full table is 65,536 entries by default and a walk of it costs two
//! system calls per entry (tens of milliseconds), so the daemon never walks
//! one on its owner loop: [`SocketTables`] is shared (`Arc`) with the
//! threads that count and close sockets.

use std::{collections::BTreeMap, net::SocketAddr};

use anyhow::Context as _;
use aya::maps::{HashMap, Map, MapData};
use lb_common::{SockEntry, UdpPeers, maps};

/// Read handles to the socket tables, and their sizes.
pub struct SocketTables {
    tcp: HashMap<MapData, u64, SockEntry>,
    udp: HashMap<MapData, u64, SockEntry>,
    peers: HashMap<MapData, u64, UdpPeers>,
    /// The sizes of `tcp` and `udp`, fixed at attach.
    capacity: (usize, usize),
    /// The size of `peers`.
    peers_capacity: usize,
}

/// The UDP sockets that see what `server` sends them as from `vip`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdpPeerCount {
    /// The VIP they sent to.
    pub vip: SocketAddr,
    /// The server that got it.
    pub server: SocketAddr,
    /// How many sockets.
    pub sockets: usize,
}

/// A live socket that connected through a VIP (from the kernel's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VipSocket {
    /// The socket's cookie (what SOCK_DESTROY is asked to close).
    pub cookie: u64,
    /// The VIP it dialled.
    pub vip: SocketAddr,
    /// The server it was sent to.
    pub server: SocketAddr,
}

/// The size of a hash map (a socket table, a flow table) as the kernel
/// made it.
pub(super) fn max_entries(map: &Map, name: &str) -> anyhow::Result<usize> {
    let (Map::HashMap(data) | Map::LruHashMap(data)) = map else {
        anyhow::bail!("map {name} is not a hash map")
    };
    let info = data.info().with_context(|| format!("reading map {name}'s size"))?;
    Ok(info.max_entries() as usize)
}

fn table<V: aya::Pod>(map: Map, name: &str) -> anyhow::Result<HashMap<MapData, u64, V>> {
    HashMap::try_from(map).with_context(|| format!("map {name} has an unexpected type or size"))
}

impl SocketTables {
    /// The tables from the pinned `SOCKETS`, `SOCKETS_UDP` and `UDP_PEERS`.
    pub(super) fn new(tcp: Map, udp: Map, peers: Map) -> anyhow::Result<Self> {
        let capacity = (max_entries(&tcp, maps::SOCKETS)?, max_entries(&udp, maps::SOCKETS_UDP)?);
        Ok(Self {
            peers_capacity: max_entries(&peers, maps::UDP_PEERS)?,
            tcp: table(tcp, maps::SOCKETS)?,
            udp: table(udp, maps::SOCKETS_UDP)?,
            peers: table(peers, maps::UDP_PEERS)?,
            capacity,
        })
    }

    /// How many UDP sockets `UDP_PEERS` can hold.
    pub fn peers_capacity(&self) -> usize {
        self.peers_capacity
    }

    /// The UDP sockets in `UDP_PEERS` (a walk), and how many of them see
    /// each (VIP, server) pair, by VIP then server.
    pub fn udp_peers(&self) -> (usize, Vec<UdpPeerCount>) {
        let mut sockets = 0;
        let mut pairs: BTreeMap<(SocketAddr, SocketAddr), usize> = BTreeMap::new();
        for (_, peers) in self.peers.iter().filter_map(Result::ok) {
            sockets += 1;
            for peer in peers.peers.iter().filter(|p| p.vip.port != 0) {
                let key = (SocketAddr::from(peer.vip), SocketAddr::from(peer.server));
                *pairs.entry(key).or_default() += 1;
            }
        }
        let pairs = pairs
            .into_iter()
            .map(|((vip, server), sockets)| UdpPeerCount { vip, server, sockets })
            .collect();
        (sockets, pairs)
    }

    /// How many sockets the tables can hold: (TCP, connected UDP).
    pub fn capacity(&self) -> (usize, usize) {
        self.capacity
    }

    /// The live TCP sockets that connected through a VIP (a walk).
    pub fn vip_sockets(&self) -> impl Iterator<Item = VipSocket> + '_ {
        self.tcp.iter().filter_map(Result::ok).map(|(cookie, e)| VipSocket {
            cookie,
            vip: SocketAddr::from(e.vip),
            server: SocketAddr::from(e.server),
        })
    }

    /// How many sockets the kernel tracks: (TCP, connected UDP) (a walk).
    pub fn count(&self) -> (usize, usize) {
        (
            self.tcp.keys().filter(Result::is_ok).count(),
            self.udp.keys().filter(Result::is_ok).count(),
        )
    }
}
