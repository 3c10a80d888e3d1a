//! A `spread` VIP with client affinity (`EXTERNAL_CLIENT_AFFINITY`, what
//! `sessionAffinity: ClientIP` asks for): a client's new flows, whatever
//! their ports, go to one server; without it they spread by port.

use std::{collections::BTreeSet, net::SocketAddr};

use aya::maps::HashMap;
use lb_common::{EXTERNAL_CLIENT_AFFINITY, Endpoint, maps};
use lb_tests::privileged_test;

use lb_tests::xdp_node::*;

/// The servers the first SYNs of `ports` flows from `f`'s client reach.
fn servers_reached(node: &Node, f: &Family, ports: std::ops::Range<u16>) -> BTreeSet<SocketAddr> {
    ports.map(|port| forwarded(node, f, SocketAddr::new(f.client.ip(), port), 1).dst).collect()
}

#[privileged_test]
fn a_clients_flows_go_to_one_server_with_client_affinity() {
    both_families(|node, f| {
        node.serve_spread(f, &f.servers);
        assert_eq!(servers_reached(node, f, 40_000..40_032).len(), 2, "spread by port");
        let mut external: HashMap<_, Endpoint, u32> =
            HashMap::try_from(node.ebpf.map_mut(maps::EXTERNAL).unwrap()).unwrap();
        external.insert(Endpoint::from(f.vip), EXTERNAL_CLIENT_AFFINITY, 0).unwrap();
        node.new_epoch();
        assert_eq!(servers_reached(node, f, 41_000..41_032).len(), 1, "one server per client");
    });
}
