//! Announcing by BGP (issue 42): lb never speaks BGP itself. It runs BIRD
//! 2 (the distribution's `bird2`: a maintained speaker with BFD and a
//! control socket made for programs, which FRR's vtysh is not, and without
//! GoBGP's gRPC stack), in the node's network namespace, with a config it
//! writes (`bird_config.rs`) under `state_dir/bird/`, and drives it through
//! that socket (`control.rs`, `bird.rs`): `configure` after each change of
//! the routes, `show protocols` for status, `down` on `lb detach`. That
//! I/O runs on a thread of its own, fed the routes by the owner loop and
//! answering status from its last look: the owner loop never waits on
//! BIRD.
//!
//! Every node with a usable server for a VIP announced by BGP gives BIRD
//! the VIP's host route; the routers spread its traffic over those nodes
//! (ECMP). BIRD outlives the daemon (fail-static, as the pinned programs
//! do): a restarted daemon adopts the one that answers on the socket, and
//! starts one if none does. It runs under `lb bgp-speaker`
//! (`supervisor.rs`), which stops it once the daemon has not renewed its
//! routes for `[bgp] routes_outlive_daemon`.

mod bird;
pub mod bird_config;
pub mod control;
pub mod supervisor;

use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use tracing::warn;

use crate::{config::Bgp, control::BgpStatus};

/// How often the daemon renews its routes (`supervisor::RENEWED`); it is
/// asked at every sync and at least every second.
const RENEW_EVERY: Duration = Duration::from_millis(500);
/// How often the speaker's thread looks at BIRD (whether it runs, its
/// sessions) when no new routes come.
const LOOK_EVERY: Duration = Duration::from_secs(1);
/// How long the speaker's thread may go without a look at BIRD before the
/// renewals stop (a look may wait on BIRD for a few of
/// `control::TIMEOUT`, or for a start).
const THREAD_SILENT: Duration = Duration::from_secs(20);
/// How long `lb detach` waits for the speaker's thread to stop BIRD.
const STOP_WITHIN: Duration = Duration::from_secs(15);
/// How long BIRD has to be gone after `down`.
const GONE_WITHIN: Duration = Duration::from_secs(5);

/// BIRD's config, control socket and pid file, in `state_dir/bird/`.
pub const CONF: &str = "bird.conf";
/// See [`CONF`].
pub const SOCKET: &str = "bird.ctl";
/// See [`CONF`].
pub const PID: &str = "bird.pid";
/// What `lb bgp-speaker` and BIRD say on stderr (startup errors, the
/// supervisor's few lines; BIRD logs to syslog), new at each start.
const LOG: &str = "speaker.log";

/// What the owner loop and the speaker's thread share: what to do (only
/// the latest routes matter), and what the thread last saw.
#[derive(Default)]
struct Shared {
    /// Routes to announce, not yet taken by the thread.
    routes: Option<BTreeSet<IpAddr>>,
    /// `lb detach`: stop BIRD, then say so here and end.
    stop: bool,
    stopped: bool,
    /// The thread's last look at BIRD, and when it ended.
    status: BgpStatus,
    looked_at: Option<Instant>,
}

/// The shared state and its signal (new orders for the thread; the
/// thread's end for `stop`).
type Slot = Arc<(Mutex<Shared>, Condvar)>;

fn lock(slot: &Slot) -> MutexGuard<'_, Shared> {
    slot.0.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The owner loop's handle on the speaker: what to announce goes to its
/// thread, status comes from the thread's last look; the daemon's
/// renewals (`supervisor.rs`) are written from here, so that they stop
/// when the owner loop does, and only while the thread looks at BIRD (a
/// thread stuck or gone would leave BIRD announcing stale routes).
pub struct Speaker {
    dir: PathBuf,
    outlive: Duration,
    slot: Slot,
    /// The routes last handed to the thread.
    sent: Option<BTreeSet<IpAddr>>,
    /// How many times the routes were renewed, and when last.
    renewals: u64,
    renewed_at: Option<Instant>,
    /// A problem with the renewals or the thread, told once.
    renewal_problem: Option<String>,
}

impl Speaker {
    /// The speaker for `bgp`, its files under `state_dir/bird/`, and its
    /// thread. Nothing is started before the first [`Self::announce`].
    pub fn new(bgp: Bgp, state_dir: &Path) -> Self {
        let dir = state_dir.join("bird");
        let outlive = bgp.routes_outlive_daemon;
        let slot: Slot = Arc::default();
        let theirs = Arc::clone(&slot);
        let bird = bird::Bird::new(bgp, dir.clone());
        let spawned = std::thread::Builder::new()
            .name("bgp-speaker".into())
            .spawn(move || drive(bird, &theirs));
        if let Err(e) = spawned {
            warn!("bgp: cannot start the speaker's thread: {e}; nothing will be announced");
        }
        Self {
            dir,
            outlive,
            slot,
            sent: None,
            renewals: 0,
            renewed_at: None,
            renewal_problem: None,
        }
    }

    /// Makes BIRD announce exactly `routes` (host routes of VIPs), soon
    /// (its thread starts or adopts BIRD, and reconfigures it), and renews
    /// them. The owner loop calls this at every sync and at least every
    /// second; it never waits on BIRD.
    pub fn announce(&mut self, routes: &BTreeSet<IpAddr>) {
        if self.sent.as_ref() != Some(routes) {
            lock(&self.slot).routes = Some(routes.clone());
            self.slot.1.notify_all();
            self.sent = Some(routes.clone());
        }
        self.renew();
    }

    /// Tells `lb bgp-speaker` the daemon still means its routes (at most
    /// every [`RENEW_EVERY`]), while the thread looks at BIRD. A renewal
    /// is written whole (a new file renamed over the old).
    fn renew(&mut self) {
        if self.renewed_at.is_some_and(|at| at.elapsed() < RENEW_EVERY) {
            return;
        }
        let looked_at = lock(&self.slot).looked_at;
        let problem = match looked_at {
            // Not started yet: nothing to renew.
            None => return,
            Some(at) if at.elapsed() > THREAD_SILENT => Some(format!(
                "the speaker's thread has not looked at BIRD for {:?}: no longer renewing, \
                 BIRD withdraws within {:?}",
                at.elapsed(),
                self.outlive
            )),
            Some(_) => {
                self.renewals += 1;
                let text = supervisor::renewal(self.renewals, self.outlive);
                let path = self.dir.join(supervisor::RENEWED);
                let temporary = self.dir.join(format!("{}.new", supervisor::RENEWED));
                match std::fs::write(&temporary, text)
                    .and_then(|()| std::fs::rename(&temporary, &path))
                {
                    Ok(()) => {
                        self.renewed_at = Some(Instant::now());
                        None
                    }
                    Err(e) => Some(format!(
                        "cannot renew the routes in {}: {e}; BIRD withdraws within {:?}",
                        path.display(),
                        self.outlive
                    )),
                }
            }
        };
        if problem.is_some() && problem != self.renewal_problem {
            warn!("bgp: {}", problem.as_deref().unwrap_or_default());
        }
        self.renewal_problem = problem;
    }

    /// The sessions and announced routes as the thread last saw them (at
    /// most a second old while BIRD answers).
    pub fn status(&self) -> BgpStatus {
        lock(&self.slot).status.clone()
    }

    /// Stops BIRD (`lb detach`): its sessions close, and the routers
    /// withdraw every route it announced. Waits for it, bounded.
    pub fn stop(&mut self) {
        let deadline = Instant::now() + STOP_WITHIN;
        let mut shared = lock(&self.slot);
        shared.stop = true;
        self.slot.1.notify_all();
        while !shared.stopped {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                warn!("bgp: BIRD did not stop within {STOP_WITHIN:?}");
                break;
            }
            shared =
                self.slot.1.wait_timeout(shared, left).unwrap_or_else(PoisonError::into_inner).0;
        }
        self.sent = None;
    }
}

/// The speaker's thread: BIRD made to announce the latest routes handed
/// over, looked at every [`LOOK_EVERY`], its status published; until
/// stopped. When the daemon exits without `lb detach`, BIRD stays.
fn drive(mut bird: bird::Bird, slot: &Slot) {
    let mut routes: Option<BTreeSet<IpAddr>> = None;
    loop {
        let mut shared = lock(slot);
        if shared.routes.is_none() && !shared.stop {
            shared =
                slot.1.wait_timeout(shared, LOOK_EVERY).unwrap_or_else(PoisonError::into_inner).0;
        }
        if shared.stop {
            drop(shared);
            bird.stop();
            let mut shared = lock(slot);
            shared.status = bird.status();
            shared.stopped = true;
            slot.1.notify_all();
            return;
        }
        if let Some(newest) = shared.routes.take() {
            routes = Some(newest);
        }
        drop(shared);
        let Some(routes) = &routes else { continue };
        bird.announce(routes);
        let now = bird.status();
        let mut shared = lock(slot);
        shared.status = now;
        shared.looked_at = Some(Instant::now());
    }
}

/// Stops the BIRD lb runs for `state_dir` (`bird/bird.ctl`): see
/// [`stop_bird`].
pub fn stop_speaker(state_dir: &Path) -> bool {
    stop_bird(&state_dir.join("bird"))
}

/// Stops the BIRD whose control socket and pid file are in `dir`
/// ([`SOCKET`], [`PID`]), if one answers there, and waits (bounded) for it
/// to be gone: whether one did.
pub fn stop_bird(dir: &Path) -> bool {
    let socket = dir.join(SOCKET);
    let asked = control::command(&socket, "down").is_ok();
    let deadline = Instant::now() + GONE_WITHIN;
    while asked && control::command(&socket, "show status").is_ok() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Not answering (frozen), or not gone: the process of its pid file,
    // if it is a BIRD, is killed.
    let Some(pid) = bird::running_bird(&dir.join(PID), None) else { return asked };
    let Ok(pid) = i32::try_from(pid) else { return asked };
    warn!(pid, "bgp: BIRD did not stop when asked: killing it");
    // SAFETY: sending signals has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, libc::SIGCONT);
        libc::kill(pid, libc::SIGKILL);
    }
    true
}
