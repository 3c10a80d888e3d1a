//! The external path's flows through an upgrade from layout 9, whose UDP
//! flows lived in TCP's opening tables (`OPENING_FLOWS`,
//! `OPENING_REPLIES`): the UDP tables are made at the size an attach
//! gives them, and the UDP flows moved there, so that each keeps its
//! server and its NAT port.

use std::path::Path;

use anyhow::Context as _;
use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, MapData},
};
use lb_common::{Flow, FlowKey, NatKey, NatReply, maps, udp_flow_table};

use super::{pins::open_pinned_map, sockets::max_entries};

/// `IPPROTO_UDP`.
const UDP: u8 = 17;
/// `BPF_NOEXIST`: an update that adds an entry, never replaces one.
const BPF_NOEXIST: u64 = 1;
/// The most entries one walk of a table reads: twice the largest
/// `[daemon] flow_table`, a bound on a walk that the running programs'
/// removals restart.
const WALK_LIMIT: usize = 1 << 23;

/// Sizes the UDP flow tables the pins under `bpffs` lack, which `loader`
/// creates, from the pinned `FLOWS` (`[daemon] flow_table` when it was
/// attached), as an attach sizes them.
pub(super) fn size_udp_tables(loader: &mut EbpfLoader, bpffs: &Path) -> anyhow::Result<()> {
    let flows = open_pinned_map(bpffs, maps::FLOWS)?;
    let size = udp_flow_table(u32::try_from(max_entries(&flows, maps::FLOWS)?)?);
    loader.map_max_entries(maps::UDP_FLOWS, size);
    loader.map_max_entries(maps::UDP_REPLIES, size);
    Ok(())
}

/// Moves the UDP flows of the opening tables into the UDP tables, an
/// entry already there (a flow the new programs opened) kept. Returns how
/// many flows moved. Run before the new programs replace the old ones,
/// and again after, for the flows the old ones opened meanwhile.
pub(super) fn move_udp_flows(ebpf: &mut Ebpf) -> anyhow::Result<usize> {
    let moved = move_entries::<FlowKey, Flow>(ebpf, maps::OPENING_FLOWS, maps::UDP_FLOWS, |k| {
        k.protocol == UDP
    })?;
    move_entries::<NatKey, NatReply>(ebpf, maps::OPENING_REPLIES, maps::UDP_REPLIES, |k| {
        k.protocol == UDP
    })?;
    Ok(moved)
}

/// Moves the entries of `from` whose key is `wanted` to `to`.
fn move_entries<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut Ebpf,
    from: &str,
    to: &str,
    wanted: impl Fn(&K) -> bool,
) -> anyhow::Result<usize> {
    let taken: Vec<(K, V)> = {
        let table: HashMap<&MapData, K, V> = HashMap::try_from(
            ebpf.map(from).with_context(|| format!("map {from} missing from the eBPF object"))?,
        )
        .with_context(|| format!("map {from} has an unexpected type or size"))?;
        // An entry the running programs remove between two reads ends
        // the walk early: what it missed stays there, as a new flow.
        table.iter().take(WALK_LIMIT).map_while(Result::ok).filter(|(key, _)| wanted(key)).collect()
    };
    let mut target: HashMap<&mut MapData, K, V> = HashMap::try_from(
        ebpf.map_mut(to).with_context(|| format!("map {to} missing from the eBPF object"))?,
    )
    .with_context(|| format!("map {to} has an unexpected type or size"))?;
    let mut moved = 0;
    for (key, value) in &taken {
        // BPF_NOEXIST: the new programs' entry, if any, is the live one.
        if target.insert(key, value, BPF_NOEXIST).is_ok() {
            moved += 1;
        }
    }
    let mut source: HashMap<&mut MapData, K, V> = HashMap::try_from(
        ebpf.map_mut(from).with_context(|| format!("map {from} missing from the eBPF object"))?,
    )
    .with_context(|| format!("map {from} has an unexpected type or size"))?;
    for (key, _) in &taken {
        let _ = source.remove(key);
    }
    Ok(moved)
}
