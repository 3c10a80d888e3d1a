//! The datapath's own health as the owner loop's one-second tick sees it
//! (`Daemon::watch_socket_table`, in `inputs`): a full TCP socket table is
//! logged, at most once a minute, with how many connects went untracked
//! since the last line.

use std::time::{Duration, Instant};

/// The shortest time between two log lines about a full socket table.
pub(super) const FULL_TABLE_LOG_EVERY: Duration = Duration::from_secs(60);

/// What the tick remembers of the kernel's `connect_untracked` counter.
#[derive(Debug, Default)]
pub(super) struct TableWatch {
    /// The counter as last read.
    seen: u64,
    /// Connects untracked since the last log line (or start).
    missed: u64,
    /// When the last line was logged.
    logged_at: Option<Instant>,
}

impl TableWatch {
    /// Starts from the counter as it is (an adopted datapath's counts are
    /// history).
    pub(super) fn new(untracked: u64) -> Self {
        Self { seen: untracked, ..Self::default() }
    }

    /// The counter read `now`: the connects untracked since the last log
    /// line, when one is due (there are some, and the last line is at
    /// least [`FULL_TABLE_LOG_EVERY`] old).
    pub(super) fn observe(&mut self, untracked: u64, now: Instant) -> Option<u64> {
        // A counter that went back (a fresh datapath) starts over.
        self.missed += untracked.checked_sub(self.seen).unwrap_or(untracked);
        self.seen = untracked;
        if self.missed == 0
            || self.logged_at.is_some_and(|at| now.duration_since(at) < FULL_TABLE_LOG_EVERY)
        {
            return None;
        }
        self.logged_at = Some(now);
        Some(std::mem::take(&mut self.missed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_table_is_logged_at_once_then_at_most_once_a_minute() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut watch = TableWatch::new(5);
        assert_eq!(watch.observe(5, at(1)), None, "counts from before the start are history");
        assert_eq!(watch.observe(8, at(2)), Some(3), "the first untracked connects: at once");
        assert_eq!(watch.observe(10, at(3)), None, "within the minute: held back");
        assert_eq!(watch.observe(12, at(61)), None);
        assert_eq!(watch.observe(12, at(62)), Some(4), "a minute on: the ones held back");
        assert_eq!(watch.observe(12, at(200)), None, "none since: nothing to say");
        assert_eq!(watch.observe(13, at(201)), Some(1));
        assert_eq!(watch.observe(2, at(300)), Some(2), "a counter that went back starts over");
    }
}
