//! When each balancer next needs its clock ([`Balancer::next_deadline`]):
//! the owner loop sleeps until the earliest, then ticks only the services
//! that are due, instead of sweeping every balancer every second.
//!
//! [`Balancer::next_deadline`]: crate::balancer::Balancer::next_deadline

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    time::Instant,
};

/// Deadlines by service name. Each service has at most one that counts (the
/// earliest set since it was last due); superseded ones stay in the heap
/// and are skipped when they come up.
#[derive(Debug, Default)]
pub(super) struct Timers {
    heap: BinaryHeap<Reverse<(Instant, String)>>,
    due: HashMap<String, Instant>,
}

impl Timers {
    /// Service `name` needs its clock at `at` (`None`: not for now). An
    /// earlier deadline of the same service stands.
    pub(super) fn set(&mut self, name: &str, at: Option<Instant>) {
        let Some(at) = at else { return };
        if self.due.get(name).is_some_and(|&due| due <= at) {
            return;
        }
        self.due.insert(name.to_owned(), at);
        self.heap.push(Reverse((at, name.to_owned())));
    }

    /// The earliest deadline, if any (possibly superseded: ticking then
    /// finds nothing to do).
    pub(super) fn next(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// The services due at `now`, each once; their deadlines are spent (the
    /// caller sets the next ones after ticking them).
    pub(super) fn take_due(&mut self, now: Instant) -> Vec<String> {
        let mut names = Vec::new();
        while let Some(Reverse((at, _))) = self.heap.peek()
            && *at <= now
        {
            let Some(Reverse((at, name))) = self.heap.pop() else { break };
            if self.due.get(&name) == Some(&at) {
                self.due.remove(&name);
                names.push(name);
            }
        }
        names
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn services_come_due_once_each_at_their_earliest_deadline() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut timers = Timers::default();
        timers.set("a", Some(t0 + s(10)));
        timers.set("b", Some(t0 + s(5)));
        timers.set("a", Some(t0 + s(3))); // earlier: replaces 10
        timers.set("a", Some(t0 + s(20))); // later: the earlier stands
        timers.set("c", None);
        assert_eq!(timers.next(), Some(t0 + s(3)));
        assert_eq!(timers.take_due(t0 + s(2)), Vec::<String>::new());
        assert_eq!(timers.take_due(t0 + s(5)), ["a", "b"]);
        // a's superseded 10 s is skipped; nothing else is due.
        assert_eq!(timers.take_due(t0 + s(30)), Vec::<String>::new());
        assert_eq!(timers.next(), None);
        timers.set("a", Some(t0 + s(40)));
        assert_eq!(timers.take_due(t0 + s(40)), ["a"]);
    }
}
