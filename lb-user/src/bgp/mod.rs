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
    sync::{
        Arc, Mutex, PoisonError,
        mpsc::{self, RecvTimeoutError},
    },
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

/// What the owner loop sends the speaker's thread.
enum Order {
    /// Announce exactly these routes.
    Routes(BTreeSet<IpAddr>),
    /// Stop BIRD (`lb detach`), then say so and end.
    Stop(mpsc::Sender<()>),
}

/// The owner loop's handle on the speaker: what to announce goes to its
/// thread, status comes from the thread's last look; the daemon's
/// renewals (`supervisor.rs`) are written from here, so that they stop
/// when the owner loop does.
pub struct Speaker {
    dir: PathBuf,
    outlive: Duration,
    orders: mpsc::Sender<Order>,
    /// The routes last sent to the thread.
    sent: Option<BTreeSet<IpAddr>>,
    /// The thread's last look at BIRD.
    status: Arc<Mutex<BgpStatus>>,
    /// How many times the routes were renewed, and when last.
    renewals: u64,
    renewed_at: Option<Instant>,
}

impl Speaker {
    /// The speaker for `bgp`, its files under `state_dir/bird/`, and its
    /// thread. Nothing is started before the first [`Self::announce`].
    pub fn new(bgp: Bgp, state_dir: &Path) -> Self {
        let dir = state_dir.join("bird");
        let outlive = bgp.routes_outlive_daemon;
        let (orders, received) = mpsc::channel();
        let status = Arc::new(Mutex::new(BgpStatus::default()));
        let seen = Arc::clone(&status);
        let bird = bird::Bird::new(bgp, dir.clone());
        let spawned = std::thread::Builder::new()
            .name("bgp-speaker".into())
            .spawn(move || drive(bird, &received, &seen));
        if let Err(e) = spawned {
            warn!("bgp: cannot start the speaker's thread: {e}; nothing will be announced");
        }
        Self { dir, outlive, orders, sent: None, status, renewals: 0, renewed_at: None }
    }

    /// Makes BIRD announce exactly `routes` (host routes of VIPs), soon
    /// (its thread starts or adopts BIRD, and reconfigures it), and renews
    /// them. The owner loop calls this at every sync and at least every
    /// second; it never waits on BIRD.
    pub fn announce(&mut self, routes: &BTreeSet<IpAddr>) {
        self.renew();
        if self.sent.as_ref() != Some(routes) {
            let _ = self.orders.send(Order::Routes(routes.clone()));
            self.sent = Some(routes.clone());
        }
    }

    /// Tells `lb bgp-speaker` the daemon still means its routes (at most
    /// every [`RENEW_EVERY`]). Best effort: a renewal that cannot be
    /// written (before BIRD's directory exists) only brings the bound
    /// nearer.
    fn renew(&mut self) {
        if self.renewed_at.is_some_and(|at| at.elapsed() < RENEW_EVERY) {
            return;
        }
        self.renewals += 1;
        let text = supervisor::renewal(self.renewals, self.outlive);
        if std::fs::write(self.dir.join(supervisor::RENEWED), text).is_ok() {
            self.renewed_at = Some(Instant::now());
        }
    }

    /// The sessions and announced routes as the thread last saw them (at
    /// most a second old).
    pub fn status(&self) -> BgpStatus {
        self.status.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Stops BIRD (`lb detach`): its sessions close, and the routers
    /// withdraw every route it announced. Waits for it, bounded.
    pub fn stop(&mut self) {
        let (done, stopped) = mpsc::channel();
        if self.orders.send(Order::Stop(done)).is_ok() && stopped.recv_timeout(STOP_WITHIN).is_err()
        {
            warn!("bgp: BIRD did not stop within {STOP_WITHIN:?}");
        }
        self.sent = None;
    }
}

/// The speaker's thread: BIRD made to announce the latest routes ordered,
/// looked at every [`LOOK_EVERY`], its status published; until stopped,
/// or until the owner's handle is gone (the daemon exiting: BIRD stays).
fn drive(mut bird: bird::Bird, orders: &mpsc::Receiver<Order>, status: &Mutex<BgpStatus>) {
    let mut routes: Option<BTreeSet<IpAddr>> = None;
    let mut looked: Option<Instant> = None;
    loop {
        let mut next = match orders.recv_timeout(LOOK_EVERY) {
            Ok(order) => Some(order),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        // Only the latest routes of a burst of orders matter.
        while let Some(order) = next {
            match order {
                Order::Routes(newest) => routes = Some(newest),
                Order::Stop(done) => {
                    bird.stop();
                    *status.lock().unwrap_or_else(PoisonError::into_inner) = bird.status();
                    let _ = done.send(());
                    return;
                }
            }
            next = orders.try_recv().ok();
        }
        let Some(routes) = &routes else { continue };
        bird.announce(routes);
        if looked.is_none_or(|at| at.elapsed() >= LOOK_EVERY) {
            let now = bird.status();
            *status.lock().unwrap_or_else(PoisonError::into_inner) = now;
            looked = Some(Instant::now());
        }
    }
}

/// Stops the BIRD whose socket is under `state_dir` (`bird/bird.ctl`), if
/// one answers there, and waits (bounded) for it to be gone: whether one
/// did.
pub fn stop_speaker(state_dir: &Path) -> bool {
    let socket = state_dir.join("bird").join(SOCKET);
    if control::command(&socket, "down").is_err() {
        return false;
    }
    let deadline = Instant::now() + GONE_WITHIN;
    while control::command(&socket, "show status").is_ok() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}
