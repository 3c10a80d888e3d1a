//! The elections by membership end to end (`[service.external] elect =
//! true`): one Lease per node, every VIP placed by rendezvous hashing.
//! Three daemons on the LAN and six VIPs: each VIP answered by exactly
//! the node placement puts it on; a node SIGKILLed, its VIPs answered by
//! the others (never two answering one VIP, as the capture sees it) and
//! every other VIP untouched; started again, it takes back its share.

use std::{net::Ipv4Addr, time::Duration};

use lb_tests::{
    arp::Watch,
    fakes::apiserver::Kubeconfig,
    in_new_netns,
    lan::{Lan, Node},
    privileged_test, wait_until,
};
use lb_user::election::placement;

use super::{ASK_EVERY, TAKEOVER, lan_and_api, one_at_a_time};

const VIPS: usize = 6;

fn vip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1, 101 + k as u8)
}

/// Six services, each on a VIP of its own, elected by membership.
fn services() -> String {
    let mut text = "[kubernetes]\nnamespace = \"lb-system\"\n".to_owned();
    for k in 0..VIPS {
        text.push_str(&format!(
            "[[service]]\nname = \"web{k}\"\nvip = \"{}:80\"\nservers = [\"198.18.2.2:8080\"]\n\
             [service.health]\ncheck = \"tcp\"\ninterval = \"100ms\"\ntimeout = \"100ms\"\nrise = 1\nfall = 1\n\
             [service.external]\ninterfaces = [\"ext0\"]\nannounce = \"arp\"\nelect = true\n",
            vip(k)
        ));
    }
    text
}

/// The node placement puts VIP `k` on, among `nodes`.
fn placed(lan: &Lan, k: usize, nodes: &[usize]) -> usize {
    let names = nodes.iter().map(|i| lan.nodes[*i].node_name.as_str());
    let first = placement::first(&vip(k).to_string(), names).unwrap();
    lan.nodes.iter().position(|n| n.node_name == first).unwrap()
}

/// Service `k`'s role on `node`, as its `lb status` says.
fn role(node: &Node, k: usize) -> Option<String> {
    let status = node.daemon().status();
    let lease = &status["services"][k]["external"]["lease"];
    lease["role"].as_str().map(str::to_owned)
}

/// Whether every VIP's holder is the node placement puts it on among
/// `nodes` (by their `lb status`), and no other of them holds it.
fn placed_as_ruled(lan: &Lan, nodes: &[usize]) -> bool {
    (0..VIPS).all(|k| {
        let holder = placed(lan, k, nodes);
        nodes
            .iter()
            .all(|&i| (role(&lan.nodes[i], k).as_deref() == Some("holder")) == (i == holder))
    })
}

#[privileged_test]
fn vips_spread_by_membership_and_a_killed_nodes_move_alone() {
    let _serial = one_at_a_time();
    in_new_netns(|| {
        let (mut lan, rt, api) = lan_and_api("el-member", 3);
        let kubeconfig = Kubeconfig::write(&api.url());
        for node in &mut lan.nodes {
            node.start(kubeconfig.path(), &services());
        }
        let logs = |lan: &Lan| {
            let logs = lan.nodes.iter().map(|n| format!("--- {}:\n{}", n.name, n.daemon().log()));
            logs.collect::<Vec<_>>().join("\n")
        };
        assert!(
            wait_until(Duration::from_secs(20), || placed_as_ruled(&lan, &[0, 1, 2])),
            "not placed as ruled\n{}",
            logs(&lan)
        );
        // One Lease per node, whatever the number of VIPs.
        for node in &lan.nodes {
            assert!(api.lease("lb-system", &node.node_name).is_some(), "{}", node.node_name);
        }
        assert!(api.lease("lb-system", "web0").is_none());
        let vips: Vec<Ipv4Addr> = (0..VIPS).map(vip).collect();
        let watch = Watch::start_for(&lan.client, "pc", ASK_EVERY, vips);
        std::thread::sleep(Duration::from_secs(1));
        for k in 0..VIPS {
            let turns = watch.turns_of(vip(k));
            assert_eq!(turns.len(), 1, "{}: one MAC answers: {turns:?}", vip(k));
            assert_eq!(turns[0].0, lan.nodes[placed(&lan, k, &[0, 1, 2])].mac, "{}", vip(k));
        }

        // The node holding the most VIPs is killed: only its daemon dies,
        // its kernel answers until its fence.
        let held = |i: usize| (0..VIPS).filter(|&k| placed(&lan, k, &[0, 1, 2]) == i).count();
        let killed = (0..3).max_by_key(|&i| held(i)).unwrap();
        let rest: Vec<usize> = (0..3).filter(|&i| i != killed).collect();
        let killed_at = watch.started.elapsed();
        lan.nodes[killed].daemon_mut().kill();
        let others_ruled = || {
            (0..VIPS).all(|k| {
                let holder = placed(&lan, k, &rest);
                rest.iter().all(|&i| {
                    (role(&lan.nodes[i], k).as_deref() == Some("holder")) == (i == holder)
                })
            })
        };
        assert!(wait_until(Duration::from_secs(20), others_ruled), "{}", logs(&lan));
        std::thread::sleep(Duration::from_secs(1));
        for k in 0..VIPS {
            let turns = watch.turns_of(vip(k));
            let before = placed(&lan, k, &[0, 1, 2]);
            if before != killed {
                assert_eq!(turns.len(), 1, "{} moved: {turns:?}", vip(k));
                continue;
            }
            assert_eq!(turns.len(), 2, "{}: the old holder, then the new one: {turns:?}", vip(k));
            let (old, new) = (&turns[0], &turns[1]);
            assert_eq!(old.0, lan.nodes[killed].mac);
            assert_eq!(new.0, lan.nodes[placed(&lan, k, &rest)].mac);
            assert!(old.2 < new.1, "{}: the old holder fell silent first: {turns:?}", vip(k));
            assert!(new.1 - killed_at <= TAKEOVER, "{}: {:?}", vip(k), new.1 - killed_at);
            println!(
                "{}: SIGKILL takeover, the old holder's last answer {:?} after the kill, the new one's first {:?}",
                vip(k),
                old.2.saturating_sub(killed_at),
                new.1 - killed_at
            );
        }
        // Back: after its hold-down it takes back its share, and only that.
        lan.nodes[killed].start(kubeconfig.path(), &services());
        assert!(
            wait_until(Duration::from_secs(20), || placed_as_ruled(&lan, &[0, 1, 2])),
            "the restarted node did not take its share back\n{}",
            logs(&lan)
        );
        drop(watch);
        drop(lan);
        drop(api);
        drop(rt);
    });
}
