//! The elections by membership over a real API protocol: three
//! membership tasks (`lb_user::election::membership_task`, driven
//! directly: no daemon, no kernel, no root) against the fake API server
//! on loopback, which lists and watches their Leases as an apiserver
//! does. The test stands in for the three daemons: it applies what each
//! task says the node answers (acknowledging it, as a daemon does once
//! its kernel follows) and checks, at every change, that no VIP is
//! answered by two nodes, counting a killed node's VIPs as answered
//! until its fence.
//!
//! Every wait is bounded; nothing leaves loopback (the VIPs are data).

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use lb_tests::fakes::apiserver::{FakeApiServer, Kubeconfig};
use lb_user::election::{
    membership::Timings,
    membership_task::{Answering, Membership, Settings},
    placement,
};
use tokio::sync::mpsc;

const NAMESPACE: &str = "lb-system";
const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
const TIMINGS: Timings = Timings {
    duration: Duration::from_secs(2),
    renew: Duration::from_millis(500),
    retry: Duration::from_millis(200),
    hold_down: Duration::from_secs(2),
};
/// The longest anything expected may take.
const WAIT: Duration = Duration::from_secs(30);

fn vips(n: usize) -> BTreeSet<String> {
    (0..n).map(|i| format!("198.18.{}.{}", 1 + i / 200, 10 + i % 200)).collect()
}

/// The three nodes' tasks, and what each answers.
struct Cluster {
    api: FakeApiServer,
    _kubeconfig: Kubeconfig,
    tasks: Vec<Option<Membership>>,
    updates: Vec<mpsc::Receiver<Answering>>,
    answering: Vec<Answering>,
    /// When each VIP's answering node last changed, and to which.
    holder: BTreeMap<String, (usize, Instant)>,
}

impl Cluster {
    async fn start(n: usize) -> Self {
        let api = FakeApiServer::start().await;
        let kubeconfig = Kubeconfig::write(&api.url());
        let mut tasks = Vec::new();
        let mut updates = Vec::new();
        for node in NODES {
            let (tx, rx) = mpsc::channel(64);
            let settings = Settings {
                namespace: NAMESPACE.to_owned(),
                node: node.to_owned(),
                identity: format!("{node}_test"),
                timings: TIMINGS,
            };
            let task = Membership::start(settings, Some(kubeconfig.path().to_owned()), tx);
            task.set_eligible(vips(n));
            tasks.push(Some(task));
            updates.push(rx);
        }
        Self {
            api,
            _kubeconfig: kubeconfig,
            tasks,
            updates,
            answering: vec![Answering::default(); NODES.len()],
            holder: BTreeMap::new(),
        }
    }

    /// Who answers `vip` now (a killed node until its fence).
    fn answering(&self, vip: &str) -> Vec<usize> {
        let now = Instant::now();
        let answers = |a: &Answering| a.vips.contains(vip) && a.fence.is_some_and(|f| f > now);
        (0..NODES.len()).filter(|i| answers(&self.answering[*i])).collect()
    }

    /// Takes the next update of any node, applies and acknowledges it,
    /// and checks that no VIP is answered twice; false if none came
    /// before `deadline`.
    async fn step(&mut self, deadline: tokio::time::Instant) -> bool {
        let next = async {
            loop {
                for (i, rx) in self.updates.iter_mut().enumerate() {
                    if let Ok(update) = rx.try_recv() {
                        return (i, update);
                    }
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        };
        let Ok((i, update)) = tokio::time::timeout_at(deadline, next).await else {
            return false;
        };
        if let Some(task) = &self.tasks[i] {
            task.applied(update.generation);
        }
        self.answering[i] = update;
        let all: BTreeSet<String> = self.answering.iter().flat_map(|a| a.vips.clone()).collect();
        for vip in all {
            let nodes = self.answering(&vip);
            assert!(nodes.len() <= 1, "{vip} answered by {nodes:?}");
            if let [node] = nodes[..]
                && self.holder.get(&vip).is_none_or(|(h, _)| *h != node)
            {
                self.holder.insert(vip, (node, Instant::now()));
            }
        }
        true
    }

    /// Runs until `done` holds (checking every update), at most `WAIT`.
    async fn until(&mut self, what: &str, done: impl Fn(&Self) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !done(self) {
            if !self.step(deadline).await && !done(self) {
                panic!("{what}: not within {WAIT:?}; answering: {:?}", self.answering);
            }
        }
    }

    /// Runs for `period`, checking every update.
    async fn run_for(&mut self, period: Duration) {
        let deadline = tokio::time::Instant::now() + period;
        while self.step(deadline).await {}
    }

    /// Every VIP answered by exactly one node, as placement puts it among
    /// `nodes`.
    fn placed(&self, n: usize, nodes: &[usize]) -> bool {
        vips(n).iter().all(|vip| self.answering(vip) == [place(vip, nodes)])
    }
}

/// The node rendezvous hashing puts `vip` on among `nodes`.
fn place(vip: &str, nodes: &[usize]) -> usize {
    let first = placement::first(vip, nodes.iter().map(|i| NODES[*i])).unwrap();
    NODES.iter().position(|n| *n == first).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_vips_spread_over_three_nodes_and_a_killed_nodes_move_alone() {
    let mut cluster = Cluster::start(50).await;
    cluster.until("50 VIPs placed on 3 nodes", |c| c.placed(50, &[0, 1, 2])).await;
    for (i, node) in NODES.iter().enumerate() {
        let held = cluster.answering[i].vips.len();
        assert!(held >= 8, "{node} answers {held} of 50");
    }
    // Steady: every VIP stays where it is, and the API server sees one
    // write per node per renewal, whatever the number of VIPs (the
    // watches are three streams, opened once).
    let before = cluster.holder.clone();
    let (writes, watches) = (cluster.api.lease_requests().len(), cluster.api.requests().len());
    cluster.run_for(TIMINGS.duration).await;
    assert_eq!(cluster.holder, before);
    let writes = cluster.api.lease_requests().len() - writes;
    let per_node = (TIMINGS.duration.as_millis() / TIMINGS.renew.as_millis()) as usize;
    assert!((3 * (per_node - 1)..=3 * (per_node + 1)).contains(&writes), "{writes} writes");
    assert_eq!(cluster.api.requests().len(), watches, "no list or watch again");

    // node-a's daemon is killed: not a word to the API; its kernel answers
    // until its fence.
    let killed = Instant::now();
    cluster.tasks[0].take().unwrap().keep();
    cluster.until("node-a's VIPs answered by the others", |c| c.placed(50, &[1, 2])).await;
    let mut slowest = Duration::ZERO;
    for vip in vips(50) {
        if before[&vip].0 == 0 {
            slowest = slowest.max(cluster.holder[&vip].1.duration_since(killed));
        } else {
            assert_eq!(cluster.holder[&vip], before[&vip], "{vip} moved");
        }
    }
    // Within a duration of its last renewal, plus a claim's round trip.
    assert!(slowest <= TIMINGS.duration + Duration::from_millis(500), "took {slowest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vip_its_holder_can_no_longer_serve_moves_alone_at_once() {
    let mut cluster = Cluster::start(12).await;
    cluster.until("12 VIPs placed", |c| c.placed(12, &[0, 1, 2])).await;
    let before = cluster.holder.clone();
    let moved = vips(12).into_iter().find(|v| before[v].0 == 1).unwrap();
    let mut rest = vips(12);
    rest.remove(&moved);
    let at = Instant::now();
    cluster.tasks[1].as_ref().unwrap().set_eligible(rest.clone());
    let to = place(&moved, &[0, 2]);
    cluster.until("the VIP moved", |c| c.answering(&moved) == [to]).await;
    let took = cluster.holder[&moved].1.duration_since(at);
    assert!(took <= Duration::from_millis(500), "took {took:?}");
    cluster.run_for(Duration::from_millis(500)).await;
    for vip in &rest {
        assert_eq!(cluster.holder[vip], before[vip], "{vip} moved");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resigning_node_hands_over_at_once() {
    let mut cluster = Cluster::start(12).await;
    cluster.until("12 VIPs placed", |c| c.placed(12, &[0, 1, 2])).await;
    let at = Instant::now();
    cluster.tasks[2].as_ref().unwrap().stop();
    cluster.until("node-c's VIPs answered by the others", |c| c.placed(12, &[0, 1])).await;
    let took = cluster.holder.values().map(|(_, t)| t.saturating_duration_since(at)).max().unwrap();
    assert!(took <= Duration::from_millis(800), "took {took:?}");
    let lease = cluster.api.lease(NAMESPACE, "node-c").unwrap();
    let annotations = lease.metadata.annotations.unwrap();
    assert_eq!(
        (annotations["lb.dev/eligible"].as_str(), annotations["lb.dev/claims"].as_str()),
        ("", "")
    );
    cluster.tasks[2].take().unwrap().resign(Duration::from_secs(5)).await;
}
