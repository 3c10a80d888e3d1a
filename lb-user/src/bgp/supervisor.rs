//! `lb bgp-speaker` (started by the daemon, never by hand): runs BIRD in
//! the foreground as its child, in a session of its own so that it
//! outlives the daemon (fail-static: a restarted daemon adopts it), and
//! stops it once the daemon has not renewed its routes for `[bgp]
//! routes_outlive_daemon`. So a daemon killed, frozen or stopped for
//! good leaves its routes on the routers for that long at most: the
//! kernel serves on meanwhile with the last selection, but nothing checks
//! the servers any more.
//!
//! The daemon renews by rewriting [`RENEWED`] (a count and the bound)
//! every second; this process reads it every 200 ms and judges
//! by its own monotonic clock, never by the file's time: a wall clock
//! stepped neither withdraws early nor holds on. BIRD dies with this
//! process (`PR_SET_PDEATHSIG`), so it never runs unwatched.

use std::{
    os::unix::process::CommandExt as _,
    path::Path,
    process::{Child, Command},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use tracing::{info, warn};

use super::{CONF, PID, SOCKET, control};
use crate::config::DEFAULT_ROUTES_OUTLIVE_DAEMON;

/// The file the daemon rewrites to renew its routes (`bird/renewed`).
pub const RENEWED: &str = "renewed";
/// How often the supervisor reads [`RENEWED`] and looks at BIRD.
const LOOK_EVERY: Duration = Duration::from_millis(200);
/// How long BIRD has to exit after `down`, before it is killed.
const STOP_WITHIN: Duration = Duration::from_secs(5);

/// What the daemon writes to [`RENEWED`]: its `count`-th renewal, how
/// long the routes may outlive it, and its pid (two daemons one after the
/// other never write the same text).
pub fn renewal(count: u64, outlive: Duration) -> String {
    format!("{count} {} {}\n", outlive.as_millis(), std::process::id())
}

/// The supervisor's judgement, pure: whether the routes may stay, from
/// what [`RENEWED`] said at each look.
#[derive(Debug)]
pub struct Renewals {
    /// What the file said when it last changed.
    last: Option<String>,
    /// When it last changed (or the supervisor started).
    at: Instant,
}

impl Renewals {
    /// No renewal seen yet, at `now`: the default bound runs from here.
    pub fn new(now: Instant) -> Self {
        Self { last: None, at: now }
    }

    /// Whether the routes may stay at `now`, the file saying `text`
    /// (`None`: gone or unreadable, which renews nothing). The bound is
    /// the last renewal's (a daemon started with another config may change
    /// it), or the default.
    pub fn may_stay(&mut self, text: Option<&str>, now: Instant) -> bool {
        if let Some(text) = text
            && self.last.as_deref() != Some(text)
        {
            self.last = Some(text.to_owned());
            self.at = now;
        }
        now.saturating_duration_since(self.at) < self.bound()
    }

    /// How long the routes may outlive the last renewal.
    pub fn bound(&self) -> Duration {
        self.last
            .as_deref()
            .and_then(|text| text.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map_or(DEFAULT_ROUTES_OUTLIVE_DAEMON, Duration::from_millis)
    }
}

/// Runs BIRD (`speaker`) on the files in `dir` until it exits or the
/// daemon stops renewing; then returns BIRD's exit status (stopped for
/// want of renewals: success), BIRD gone either way.
pub fn run(dir: &Path, speaker: &Path) -> anyhow::Result<std::process::ExitStatus> {
    let mut bird = Command::new(speaker);
    bird.arg("-f")
        .arg("-c")
        .arg(dir.join(CONF))
        .arg("-s")
        .arg(dir.join(SOCKET))
        .arg("-P")
        .arg(dir.join(PID));
    let parent = std::process::id();
    // SAFETY: prctl, getppid and _exit are async-signal-safe and touch no
    // memory of ours.
    unsafe {
        bird.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The supervisor gone before the line above: no BIRD unwatched.
            if u32::try_from(libc::getppid()).ok() != Some(parent) {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let mut child = bird.spawn().with_context(|| format!("starting {}", speaker.display()))?;
    info!(pid = child.id(), "BIRD started, watched for the daemon's renewals");
    let mut renewals = Renewals::new(Instant::now());
    loop {
        if let Some(status) = child.try_wait().context("waiting for BIRD")? {
            info!(%status, "BIRD exited");
            return Ok(status);
        }
        let text = std::fs::read_to_string(dir.join(RENEWED)).ok();
        if !renewals.may_stay(text.as_deref(), Instant::now()) {
            warn!(
                bound = ?renewals.bound(),
                "the daemon has not renewed its routes within the bound: stopping BIRD, \
                 the routers withdraw them"
            );
            stop(&mut child, &dir.join(SOCKET));
            return Ok(std::process::ExitStatus::default());
        }
        std::thread::sleep(LOOK_EVERY);
    }
}

/// Stops BIRD: `down` on its socket (it closes its sessions, so the
/// routers withdraw at once), killed if it has not exited within
/// [`STOP_WITHIN`].
fn stop(child: &mut Child, socket: &Path) {
    let _ = control::command(socket, "down");
    let deadline = Instant::now() + STOP_WITHIN;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_stay_while_renewed_and_go_after_the_bound() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut renewals = Renewals::new(start);
        // Nothing written yet: the default bound runs from the start.
        assert!(renewals.may_stay(None, at(1_000)));
        assert_eq!(renewals.bound(), DEFAULT_ROUTES_OUTLIVE_DAEMON);
        let outlive = Duration::from_secs(3);
        for k in 0..10 {
            let text = renewal(k, outlive);
            assert!(renewals.may_stay(Some(&text), at(2_000 + 1_000 * k)), "renewed at {k}");
        }
        assert_eq!(renewals.bound(), outlive);
        // The last renewal at 11 s; the same text read again renews nothing.
        let last = renewal(9, outlive);
        assert!(renewals.may_stay(Some(&last), at(13_900)));
        assert!(!renewals.may_stay(Some(&last), at(14_000)));
        // The file gone renews nothing either.
        assert!(!renewals.may_stay(None, at(20_000)));
        // A renewal after all: the routes may stay (the supervisor has
        // stopped BIRD by then; the daemon starts another).
        assert!(renewals.may_stay(Some(&renewal(10, outlive)), at(21_000)));
    }

    #[test]
    fn an_unreadable_renewal_keeps_the_default_bound() {
        let start = Instant::now();
        let mut renewals = Renewals::new(start);
        assert!(renewals.may_stay(Some("garbage"), start));
        assert_eq!(renewals.bound(), DEFAULT_ROUTES_OUTLIVE_DAEMON);
        let later = start + DEFAULT_ROUTES_OUTLIVE_DAEMON;
        assert!(!renewals.may_stay(Some("garbage"), later));
    }
}
