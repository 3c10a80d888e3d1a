//! Reading the kernel for `lb status` and counting the socket tables, off
//! the owner loop: a walk of a full table takes tens of milliseconds, a
//! status of thousands of services reads thousands of map entries, and a
//! kernel report must wait behind neither. One thread, with its own
//! handles on the pinned maps, does both on request: a fresh count and
//! the rest of the kernel's side for `lb status` (which it then answers),
//! a count at most once a second for metrics scrapes, which get the latest.

use std::{
    path::Path,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use tracing::warn;

use crate::{
    control::{TrackedSockets, UdpReverse},
    datapath::{PinnedMaps, SocketTables},
};

/// The oldest count a scrape is given without asking for a new one.
const FRESH_FOR: Duration = Duration::from_secs(1);

/// What answers `lb status` with the maps and a fresh count.
type Answer = Box<dyn FnOnce(&PinnedMaps, TrackedSockets) + Send>;

/// What the counting thread is asked to do.
enum Job {
    /// Count, for the next scrapes.
    Refresh,
    /// Count, then hand the maps and the count to this (which answers
    /// `lb status`).
    Then(Answer),
}

/// The latest count and when it was made.
#[derive(Default)]
struct Latest {
    tracked: TrackedSockets,
    at: Option<Instant>,
}

/// The owner loop's handle on the counting thread, which ends with it.
pub(super) struct Census {
    jobs: mpsc::Sender<Job>,
    latest: Arc<Mutex<Latest>>,
    refreshing: Arc<AtomicBool>,
}

/// One count of the socket tables.
fn count(tables: &SocketTables) -> TrackedSockets {
    let (tcp, udp) = tables.count();
    let (tcp_capacity, udp_capacity) = tables.capacity();
    let (udp_peers, pairs) = tables.udp_peers();
    let udp_reverse = pairs
        .into_iter()
        .map(|p| UdpReverse { vip: p.vip, server: p.server, sockets: p.sockets })
        .collect();
    TrackedSockets {
        tcp,
        udp,
        tcp_capacity,
        udp_capacity,
        tcp_full: tcp >= tcp_capacity,
        udp_peers,
        udp_peers_capacity: tables.peers_capacity(),
        udp_reverse,
    }
}

impl Census {
    /// Starts the thread, with its own handles on the maps pinned under
    /// `bpffs`.
    pub(super) fn start(bpffs: &Path) -> anyhow::Result<Self> {
        let maps = PinnedMaps::open(bpffs)?;
        let tables = maps.socket_tables();
        let (jobs, queue) = mpsc::channel();
        let latest = Arc::new(Mutex::new(Latest::default()));
        let refreshing = Arc::new(AtomicBool::new(false));
        let (shared, flag) = (Arc::clone(&latest), Arc::clone(&refreshing));
        std::thread::Builder::new().name("lb-census".into()).spawn(move || {
            // Ends when the owner loop's handle is dropped.
            for job in queue {
                let tracked = count(&tables);
                let mut latest = shared.lock().unwrap_or_else(PoisonError::into_inner);
                *latest = Latest { tracked: tracked.clone(), at: Some(Instant::now()) };
                drop(latest);
                match job {
                    Job::Refresh => flag.store(false, Ordering::Release),
                    Job::Then(answer) => answer(&maps, tracked),
                }
            }
        })?;
        Ok(Self { jobs, latest, refreshing })
    }

    /// Counts now, then calls `answer` with the maps and the count (on the
    /// census thread). If that thread is gone (it never ends before the
    /// daemon), `answer` is dropped: its request gets no answer.
    pub(super) fn then(&self, answer: impl FnOnce(&PinnedMaps, TrackedSockets) + Send + 'static) {
        if self.jobs.send(Job::Then(Box::new(answer))).is_err() {
            warn!("the census thread is gone; a status request goes unanswered");
        }
    }

    /// The latest count (zero before the first); asks for a new one if it
    /// is older than [`FRESH_FOR`].
    pub(super) fn latest(&self) -> TrackedSockets {
        let latest = self.latest.lock().unwrap_or_else(PoisonError::into_inner);
        let stale = latest.at.is_none_or(|at| at.elapsed() >= FRESH_FOR);
        let tracked = latest.tracked.clone();
        drop(latest);
        if stale && !self.refreshing.swap(true, Ordering::AcqRel) {
            let _ = self.jobs.send(Job::Refresh);
        }
        tracked
    }
}
