//! Where a VIP goes among the nodes: rendezvous (highest random weight)
//! hashing. Every node ranks the nodes for a VIP by a weight that depends
//! only on the VIP's and the node's names, so every node that knows the
//! same nodes computes the same holder, with nothing exchanged but the
//! membership itself. The VIPs spread evenly over the nodes; a node that
//! leaves moves only the VIPs it held (each to the next node in its own
//! ranking), and a node that comes back takes back only those.
//!
//! The weight is a stable hash (FNV-1a, then a 64-bit finalizer so that
//! names differing in one character land far apart): the same on every
//! node, in every build and on every architecture.

/// A node's weight for a VIP: the node with the highest weight among the
/// candidates holds the VIP.
pub fn weight(vip: &str, node: &str) -> u64 {
    let hash = crate::maglev::fnv1a(0xcbf2_9ce4_8422_2325, vip);
    // A separator no name holds: ("a", "bc") and ("ab", "c") differ.
    let hash = (hash ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    let hash = node.bytes().fold(hash, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    finalize(hash)
}

/// The 64-bit finalizer of MurmurHash3 (`fmix64`): every input bit
/// flips each output bit with probability about one half.
fn finalize(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The first of `nodes` for `vip`: the highest weight, ties (64-bit
/// collisions) broken by the name, so the choice never depends on the
/// order the nodes are given in.
pub fn first<'a>(vip: &str, nodes: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    nodes.into_iter().max_by_key(|node| (weight(vip, node), *node))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn vips(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("198.18.{}.{}", 1 + i / 250, 1 + i % 250)).collect()
    }

    const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

    #[test]
    fn the_weight_is_the_same_in_every_build() {
        // Fixed values: a change here moves VIPs between nodes of two
        // versions during a rolling update.
        assert_eq!(weight("198.18.1.100", "node-a"), 11_727_118_249_180_527_088);
        assert_eq!(weight("198.18.1.100", "node-b"), 10_818_472_495_257_204_642);
    }

    #[test]
    fn two_hundred_vips_spread_evenly_over_three_nodes() {
        let mut held: BTreeMap<&str, usize> = BTreeMap::new();
        for vip in vips(200) {
            *held.entry(first(&vip, NODES).unwrap()).or_default() += 1;
        }
        // An even share is 66.7; a binomial spread's 3 sigma is about 20.
        for node in NODES {
            let n = held.get(node).copied().unwrap_or(0);
            assert!((50..=84).contains(&n), "{node} holds {n} of 200: {held:?}");
        }
    }

    #[test]
    fn fifty_vips_give_every_one_of_three_nodes_a_share() {
        let mut held: BTreeMap<&str, usize> = BTreeMap::new();
        for vip in vips(50) {
            *held.entry(first(&vip, NODES).unwrap()).or_default() += 1;
        }
        assert_eq!(held.len(), 3, "{held:?}");
        assert!(held.values().all(|n| *n >= 8), "{held:?}");
    }

    #[test]
    fn no_node_no_holder() {
        assert_eq!(first("198.18.1.100", []), None);
    }

    proptest! {
        /// A node leaving moves only its own VIPs; coming back, it takes
        /// back exactly those.
        #[test]
        fn a_node_leaving_moves_only_its_vips(
            names in prop::collection::btree_set("[a-z]{1,8}", 2..7),
            gone in any::<prop::sample::Index>(),
        ) {
            let nodes: Vec<&str> = names.iter().map(String::as_str).collect();
            let leaving = nodes[gone.index(nodes.len())];
            let rest: Vec<&str> = nodes.iter().copied().filter(|n| *n != leaving).collect();
            for vip in vips(100) {
                let before = first(&vip, nodes.iter().copied()).unwrap();
                let after = first(&vip, rest.iter().copied()).unwrap();
                if before != leaving {
                    prop_assert_eq!(before, after, "{} moved", vip);
                }
            }
        }

        /// The holder does not depend on the order the nodes are listed in.
        #[test]
        fn the_order_of_the_nodes_does_not_matter(
            names in prop::collection::vec("[a-z]{1,8}", 1..7),
        ) {
            let forward: Vec<&str> = names.iter().map(String::as_str).collect();
            let backward: Vec<&str> = forward.iter().rev().copied().collect();
            for vip in vips(20) {
                prop_assert_eq!(
                    first(&vip, forward.iter().copied()),
                    first(&vip, backward.iter().copied())
                );
            }
        }
    }
}
