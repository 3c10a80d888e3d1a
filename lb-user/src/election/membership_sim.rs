//! A cluster of membership machines over simulated time, for the tests:
//! an API server that applies writes in one order and delivers them to
//! every node's watch in that order, each after its own delay; writes
//! that land late, acknowledgements lost, nodes killed (their kernel
//! keeps answering until its fence) or cut from the API server. After
//! every event it checks that no VIP is answered by two nodes at once.

use std::{
    cmp::Reverse,
    collections::{BTreeMap, BTreeSet, BinaryHeap},
    time::{Duration, Instant},
};

use super::{Content, Lease, Machine, Step, Timings, Watched};

/// How long things take, drawn evenly between the bounds, in milliseconds.
#[derive(Clone, Copy, Debug)]
pub(super) struct Latencies {
    /// From a write's sending to its landing in the API server.
    pub land: (u64, u64),
    /// From its landing to its acknowledgement.
    pub ack: (u64, u64),
    /// From a landing to its delivery to a watch.
    pub watch: (u64, u64),
    /// Out of 1,000 writes, how many land but lose their acknowledgement.
    pub lost_acks: u64,
}

impl Latencies {
    pub(super) const LAN: Self = Self { land: (1, 5), ack: (1, 5), watch: (1, 10), lost_acks: 0 };
}

#[derive(Clone, Debug)]
enum Event {
    Wake(usize),
    Land { node: usize, identity: String, content: Content, acked: bool },
    Ack { node: usize, version: Option<String> },
    Deliver { node: usize, entry: usize },
}

pub(super) struct Node {
    pub name: String,
    pub identity: String,
    pub machine: Machine,
    /// Killed: its machine no longer runs; its kernel answers what it
    /// answered until its fence.
    pub dead: bool,
    /// Cut from the API server: its writes fail until the first, and its
    /// watch delivers nothing before the second.
    pub cut_until: (Option<Instant>, Option<Instant>),
    /// When the last delivery to its watch is due (they keep the order).
    watch_at: Instant,
    /// The wake-up its machine asked for last (earlier ones are stale).
    wake_at: Option<Instant>,
    /// The first write its watch delivers: a restarted daemon's watch
    /// starts with a list of what landed before.
    watch_from: usize,
}

pub(super) struct Cluster {
    pub start: Instant,
    pub now: Instant,
    pub nodes: Vec<Node>,
    pub latencies: Latencies,
    timings: Timings,
    /// Every write that landed, in order.
    log: Vec<Lease>,
    next_version: u64,
    /// Events by when they are due, then by when they were scheduled.
    queue: BinaryHeap<Reverse<(Instant, u64)>>,
    events: BTreeMap<u64, Event>,
    seq: u64,
    rng: u64,
    /// For each VIP, who answered it last and when that began.
    pub answered_by: BTreeMap<String, (usize, Instant)>,
    /// API writes that landed, by node.
    pub writes: Vec<u64>,
}

impl Cluster {
    pub(super) fn new(names: &[&str], timings: Timings, latencies: Latencies, seed: u64) -> Self {
        let start = Instant::now();
        let nodes = names
            .iter()
            .map(|name| Node {
                name: (*name).to_owned(),
                identity: format!("{name}_token"),
                machine: Machine::new((*name).to_owned(), format!("{name}_token"), timings, None),
                dead: false,
                cut_until: (None, None),
                watch_at: start,
                wake_at: None,
                watch_from: 0,
            })
            .collect();
        Self {
            start,
            now: start,
            nodes,
            latencies,
            timings,
            log: Vec::new(),
            next_version: 1,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            seq: 0,
            rng: seed | 1,
            answered_by: BTreeMap::new(),
            writes: vec![0; names.len()],
        }
    }

    /// `millis` after the start.
    pub(super) fn at(&self, millis: u64) -> Instant {
        self.start + Duration::from_millis(millis)
    }

    fn random(&mut self, (low, high): (u64, u64)) -> u64 {
        // xorshift64*: a fixed sequence per seed.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        low + r % (high - low + 1)
    }

    fn schedule(&mut self, at: Instant, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq)));
        self.events.insert(self.seq, event);
    }

    /// Tells node `i` what it may serve now.
    pub(super) fn set_eligible(&mut self, i: usize, vips: &[String]) {
        let now = self.now;
        self.nodes[i].machine.set_eligible(vips.iter().cloned().collect(), now);
        self.drive(i);
    }

    pub(super) fn stop(&mut self, i: usize) {
        let now = self.now;
        self.nodes[i].machine.stop(now);
        self.drive(i);
    }

    pub(super) fn kill(&mut self, i: usize) {
        self.nodes[i].dead = true;
    }

    /// Starts killed node `i` again, eligible for `vips`: a new daemon,
    /// whose watch begins with a list of every Lease as it is now. Its
    /// kernel's old fence is the new daemon's to keep or drop, so a test
    /// restarts a node only once its old fence has run out.
    pub(super) fn restart(&mut self, i: usize, vips: &[String]) {
        let now = self.now;
        let node = &self.nodes[i];
        let mut machine =
            Machine::new(node.name.clone(), node.identity.clone(), self.timings, None);
        let mut latest: BTreeMap<&str, &Lease> = BTreeMap::new();
        for lease in &self.log {
            latest.insert(&lease.node, lease);
        }
        machine.on_watched(Watched::Listed(latest.into_values().cloned().collect()), now);
        machine.set_eligible(vips.iter().cloned().collect(), now);
        let node = &mut self.nodes[i];
        (node.machine, node.dead, node.wake_at, node.watch_from) =
            (machine, false, None, self.log.len());
        self.drive(i);
    }

    /// Cuts node `i` from the API server: its writes until `writes`, its
    /// watch until `watch`.
    pub(super) fn cut(&mut self, i: usize, writes: Instant, watch: Instant) {
        self.nodes[i].cut_until = (Some(writes), Some(watch));
    }

    /// A second daemon with node `i`'s name (another token) writes its
    /// Lease once, claiming nothing.
    pub(super) fn foreign_write(&mut self, i: usize) {
        let identity = format!("{}_other", self.nodes[i].name);
        let at = self.now;
        self.schedule(
            at,
            Event::Land { node: i, identity, content: Content::default(), acked: false },
        );
    }

    /// Runs node `i`'s machine until it waits, carrying out its writes.
    fn drive(&mut self, i: usize) {
        if self.nodes[i].dead {
            return;
        }
        // Bounded: a poll asks for one write, and none while it is in flight.
        for _ in 0..3 {
            let now = self.now;
            let step = self.nodes[i].machine.poll(now);
            // The kernel follows `answering` before the write goes.
            self.check();
            match step {
                Step::Write(content) => {
                    let cut = self.nodes[i].cut_until.0.is_some_and(|c| c > now);
                    if cut {
                        let failed = now + Duration::from_millis(self.random((100, 1_000)));
                        self.schedule(failed, Event::Ack { node: i, version: None });
                        continue;
                    }
                    let land = now + Duration::from_millis(self.random(self.latencies.land));
                    let acked = self.random((1, 1_000)) > self.latencies.lost_acks;
                    let identity = self.nodes[i].identity.clone();
                    self.schedule(land, Event::Land { node: i, identity, content, acked });
                }
                Step::Wait(Some(at)) => {
                    if self.nodes[i].wake_at.is_none_or(|w| at < w || w <= now) {
                        self.nodes[i].wake_at = Some(at);
                        self.schedule(at, Event::Wake(i));
                    }
                    return;
                }
                Step::Wait(None) => return,
            }
        }
    }

    /// Runs the events due until `until`.
    pub(super) fn run_until(&mut self, until: Instant) {
        // Bounded: each event schedules a bounded number of others, and
        // time moves forward.
        for _ in 0..10_000_000 {
            let Some(Reverse((at, _))) = self.queue.peek() else { break };
            if *at > until {
                break;
            }
            let Reverse((at, seq)) = self.queue.pop().unwrap();
            let event = self.events.remove(&seq).unwrap();
            self.now = at;
            self.handle(event);
            self.check();
        }
        self.now = until;
        self.check();
    }

    fn handle(&mut self, event: Event) {
        let now = self.now;
        match event {
            Event::Wake(i) => {
                // Only the wake-up asked for last: one per node pending.
                if self.nodes[i].wake_at == Some(now) {
                    self.nodes[i].wake_at = None;
                    self.drive(i);
                }
            }
            Event::Land { node, identity, content, acked } => {
                let version = self.next_version.to_string();
                self.next_version += 1;
                let name = self.nodes[node].name.clone();
                self.log.push(Lease { node: name, identity, version: version.clone(), content });
                self.writes[node] += 1;
                let entry = self.log.len() - 1;
                for i in 0..self.nodes.len() {
                    let delay = Duration::from_millis(self.random(self.latencies.watch));
                    let cut = self.nodes[i].cut_until.1.filter(|c| *c > now).unwrap_or(now);
                    let due = (now + delay).max(self.nodes[i].watch_at).max(cut);
                    self.nodes[i].watch_at = due;
                    self.schedule(due, Event::Deliver { node: i, entry });
                }
                let ack = now + Duration::from_millis(self.random(self.latencies.ack));
                let version = acked.then_some(version);
                if self.nodes[node].identity == self.log[entry].identity {
                    let timeout = ack + Duration::from_millis(500);
                    let at = if version.is_some() { ack } else { timeout };
                    self.schedule(at, Event::Ack { node, version });
                }
            }
            Event::Ack { node, version } => {
                if self.nodes[node].dead {
                    return;
                }
                match version {
                    Some(version) => self.nodes[node].machine.on_written(version, now),
                    None => self.nodes[node].machine.on_write_failed(now),
                }
                self.drive(node);
            }
            Event::Deliver { node, entry } => {
                if self.nodes[node].dead || entry < self.nodes[node].watch_from {
                    return;
                }
                let lease = self.log[entry].clone();
                self.nodes[node].machine.on_watched(Watched::Applied(lease), now);
                self.drive(node);
            }
        }
    }

    /// Who answers `vip` now.
    pub(super) fn answering(&self, vip: &str) -> Vec<usize> {
        let answers =
            |n: &Node| n.machine.answering(self.now).is_some_and(|(_, v)| v.contains(vip));
        (0..self.nodes.len()).filter(|i| answers(&self.nodes[*i])).collect()
    }

    /// Never two nodes answering one VIP; notes who answers what.
    fn check(&mut self) {
        let mut by_vip: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, node) in self.nodes.iter().enumerate() {
            if let Some((_, vips)) = node.machine.answering(self.now) {
                for vip in vips {
                    by_vip.entry(vip.clone()).or_default().push(i);
                }
            }
        }
        for (vip, nodes) in by_vip {
            assert!(
                nodes.len() == 1,
                "{vip} answered by {nodes:?} at {:?}",
                self.now.duration_since(self.start)
            );
            let changed = self.answered_by.get(&vip).is_none_or(|(i, _)| *i != nodes[0]);
            if changed {
                self.answered_by.insert(vip, (nodes[0], self.now));
            }
        }
    }

    /// The VIPs each node answers now.
    pub(super) fn held(&self) -> Vec<BTreeSet<String>> {
        let now = self.now;
        let held = |n: &Node| n.machine.answering(now).map(|(_, v)| v.clone()).unwrap_or_default();
        self.nodes.iter().map(held).collect()
    }
}
