//! The BIRD lb runs, driven through its control socket: started (under
//! `lb bgp-speaker`) or adopted, configured with the routes it is given,
//! asked for its sessions, stopped. Blocking I/O, bounded by
//! `control::TIMEOUT`: it runs on the speaker's thread (`mod.rs`).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use tracing::{info, warn};

use super::{CONF, LOG, PID, SOCKET, bird_config, control};
use crate::{
    config::Bgp,
    control::{BgpSession, BgpStatus},
};

/// How long a BIRD just started has to answer on its socket.
const START_WITHIN: Duration = Duration::from_secs(5);
/// How often BIRD is asked whether it runs while its routes stay the
/// same (a BIRD that died is started again within this).
const RECHECK: Duration = Duration::from_secs(5);
/// The wait before starting BIRD again after a failed start (BIRD
/// missing, its config refused), doubling up to [`RETRY_AT_MOST`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
/// See [`RETRY_FIRST`].
const RETRY_AT_MOST: Duration = Duration::from_secs(30);

/// The BIRD lb runs, and what it was last told: driven from the
/// speaker's own thread ([`super::Speaker`]), never the owner loop.
pub(super) struct Bird {
    bgp: Bgp,
    dir: PathBuf,
    /// The routes BIRD's config holds, once written and read by it.
    routes: Option<BTreeSet<IpAddr>>,
    /// When BIRD last answered on its socket.
    answered_at: Option<Instant>,
    /// The last failure, told once.
    failing: Option<String>,
    /// The `lb bgp-speaker` this daemon started, reaped when it exits.
    supervisor: Option<Child>,
    /// After a failed start, no new start before this; the wait doubles
    /// with each failed start in a row, up to [`RETRY_AT_MOST`]. Only
    /// starts wait: a BIRD that answers is told every change at once.
    start_at: Option<Instant>,
    start_after: Duration,
}

impl Bird {
    /// BIRD for `bgp`, its files in `dir`. Nothing is started before the
    /// first [`Self::announce`].
    pub(super) fn new(bgp: Bgp, dir: PathBuf) -> Self {
        Self {
            bgp,
            dir,
            routes: None,
            answered_at: None,
            failing: None,
            supervisor: None,
            start_at: None,
            start_after: RETRY_FIRST,
        }
    }

    /// BIRD's control socket.
    fn socket(&self) -> PathBuf {
        self.dir.join(SOCKET)
    }

    fn conf(&self) -> PathBuf {
        self.dir.join(CONF)
    }

    /// Makes BIRD announce exactly `routes` (host routes of VIPs), starting
    /// it (or adopting the one that answers) if needed. Failures are
    /// logged once each and tried again at the next call.
    pub(super) fn announce(&mut self, routes: &BTreeSet<IpAddr>) {
        if let Some(supervisor) = &mut self.supervisor
            && !matches!(supervisor.try_wait(), Ok(None))
        {
            self.supervisor = None;
        }
        match self.try_announce(routes) {
            Ok(true) => {
                if self.failing.take().is_some() {
                    info!("bgp: BIRD announces again");
                }
            }
            // A start deferred (after a failed one): nothing new to say.
            Ok(false) => {}
            Err(e) => {
                let why = format!("{e:#}");
                if self.failing.as_ref() != Some(&why) {
                    warn!("bgp: {why}; trying again (a start after 1 s, then less often)");
                }
                self.failing = Some(why);
                self.routes = None;
                self.answered_at = None;
            }
        }
    }

    /// Whether BIRD now announces `routes` (`false`: not yet, its start
    /// deferred after a failed one).
    fn try_announce(&mut self, routes: &BTreeSet<IpAddr>) -> anyhow::Result<bool> {
        let unchanged = self.routes.as_ref() == Some(routes);
        if unchanged && self.answered_at.is_some_and(|at| at.elapsed() < RECHECK) {
            return Ok(true);
        }
        let running = control::command(&self.socket(), "show status").is_ok();
        if running {
            self.answered_at = Some(Instant::now());
        }
        if running && unchanged {
            return Ok(true);
        }
        if !running && self.start_at.is_some_and(|at| Instant::now() < at) {
            return Ok(false);
        }
        let router_id = self.router_id()?;
        let text = bird_config::render(&self.bgp, router_id, routes);
        private_dir(&self.dir)?;
        let temporary = self.dir.join("bird.conf.new");
        std::fs::write(&temporary, text)
            .with_context(|| format!("writing {}", temporary.display()))?;
        std::fs::rename(&temporary, self.conf())
            .with_context(|| format!("writing {}", self.conf().display()))?;
        if running {
            control::command(&self.socket(), "configure")?;
        } else if let Err(e) = self.start() {
            self.start_at = Some(Instant::now() + self.start_after);
            self.start_after = (self.start_after * 2).min(RETRY_AT_MOST);
            return Err(e);
        } else {
            self.start_at = None;
            self.start_after = RETRY_FIRST;
        }
        self.answered_at = Some(Instant::now());
        let added: Vec<&IpAddr> = match &self.routes {
            Some(before) => routes.difference(before).collect(),
            None => routes.iter().collect(),
        };
        for vip in added {
            info!(%vip, "announcing by BGP");
        }
        if let Some(before) = &self.routes {
            for vip in before.difference(routes) {
                info!(%vip, "withdrawn from BGP");
            }
        }
        self.routes = Some(routes.clone());
        Ok(true)
    }

    /// Starts BIRD under `lb bgp-speaker` (this same executable, in a
    /// session of its own: it outlives the daemon) on the config written,
    /// and waits for its socket. Refuses while the BIRD of the pid file
    /// runs: alive but not answering (slow, or frozen), a second one on
    /// the same socket would peer beside it.
    fn start(&mut self) -> anyhow::Result<()> {
        if let Some(pid) = running_bird(&self.dir.join(PID), Some(&self.bgp.speaker)) {
            bail!(
                "BIRD (pid {pid}) runs but does not answer on {}: not starting a second one",
                self.socket().display()
            );
        }
        let log_path = self.dir.join(LOG);
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let mut command = Command::new("/proc/self/exe");
        command
            .arg0("lb")
            .arg("bgp-speaker")
            .arg("--dir")
            .arg(&self.dir)
            .arg("--speaker")
            .arg(&self.bgp.speaker)
            .stdin(Stdio::null())
            .stdout(log.try_clone().context("the speaker's log")?)
            .stderr(log);
        // SAFETY: setsid is async-signal-safe and touches no memory of ours.
        unsafe {
            command.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().context("starting lb bgp-speaker")?;
        // Kept (and reaped at the next announce) whatever happens next.
        let child = self.supervisor.insert(child);
        let (socket, conf, speaker) =
            (self.dir.join(SOCKET), self.dir.join(CONF), &self.bgp.speaker);
        let deadline = Instant::now() + START_WITHIN;
        while control::command(&socket, "show status").is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                // BIRD's own words (a config it refused, say): the lines
                // that are not the supervisor's, which start with a time.
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let said: Vec<&str> = log
                    .lines()
                    .filter(|l| !l.starts_with(|c: char| c.is_ascii_digit()))
                    .take(5)
                    .collect();
                bail!(
                    "{} -c {} exited with {status}: {} (see {})",
                    speaker.display(),
                    conf.display(),
                    said.join(" / "),
                    log_path.display()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "BIRD started but did not answer on {} within {START_WITHIN:?}",
                    socket.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        info!(socket = %self.socket().display(), "bgp: BIRD started");
        Ok(())
    }

    /// `[bgp] router_id`, else this node's IPv4 address toward the first
    /// peer.
    fn router_id(&self) -> anyhow::Result<Ipv4Addr> {
        if let Some(id) = self.bgp.router_id {
            return Ok(id);
        }
        let peer = self.bgp.peers.first().context("[bgp] has no peer")?;
        let route = crate::routes::route_to(peer.address)
            .map_err(|e| anyhow::anyhow!("no route to the peer {}: {e}", peer.address))?;
        match route.source {
            IpAddr::V4(id) => Ok(id),
            IpAddr::V6(_) => bail!("the first peer is IPv6: set [bgp] router_id (an IPv4 address)"),
        }
    }

    /// The sessions as BIRD says they are (none if it does not answer),
    /// each with its peer's address, and the VIPs it was last told to
    /// announce.
    pub(super) fn status(&self) -> BgpStatus {
        let sessions = control::command(&self.socket(), "show protocols")
            .map(|reply| control::sessions(&reply))
            .unwrap_or_default();
        let bfd = if self.bgp.peers.iter().any(|p| p.bfd) && !sessions.is_empty() {
            control::command(&self.socket(), "show bfd sessions")
                .map(|reply| control::bfd_sessions(&reply))
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let peer = |name: &str| {
            let i: usize = name.strip_prefix(bird_config::PEER_PREFIX)?.parse().ok()?;
            self.bgp.peers.get(i)
        };
        BgpStatus {
            sessions: sessions
                .into_iter()
                .map(|s| {
                    let peer = peer(&s.name);
                    let address = peer.map(|p| p.address);
                    BgpSession {
                        peer: address.map(|a| a.to_string()).unwrap_or_default(),
                        bfd: peer.filter(|p| p.bfd).and_then(|p| {
                            bfd.iter().find(|(a, _)| *a == p.address).map(|(_, s)| s.clone())
                        }),
                        name: s.name,
                        state: s.state,
                        info: s.info,
                    }
                })
                .collect(),
            announced: self.routes.iter().flatten().copied().collect(),
        }
    }

    /// Stops BIRD (`lb detach`): its sessions close, and the routers
    /// withdraw every route it announced.
    pub(super) fn stop(&mut self) {
        if super::stop_bird(&self.dir) {
            info!("bgp: BIRD stopped; its routes are withdrawn");
        }
        // Its supervisor follows BIRD within a look (200 ms): reaped if so.
        if let Some(mut supervisor) = self.supervisor.take() {
            let deadline = Instant::now() + Duration::from_secs(1);
            while matches!(supervisor.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.routes = None;
        self.answered_at = None;
    }
}

/// The pid in `pid_file`, if that process runs the BIRD binary `speaker`
/// (`None`: any binary named `bird`); a pid reused by another program is
/// not BIRD.
pub(super) fn running_bird(pid_file: &Path, speaker: Option<&Path>) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(pid_file).ok()?.trim().parse().ok()?;
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let is_bird = match speaker {
        Some(speaker) => std::fs::canonicalize(speaker).is_ok_and(|s| s == exe),
        None => exe.file_name().is_some_and(|n| n == "bird"),
    };
    is_bird.then_some(pid)
}

/// Creates `dir` (root's alone: 0700, whatever the umask), or makes it so:
/// BIRD's control socket in it takes any command (`down`, `configure`),
/// so no other user may reach it.
fn private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("making {} private", dir.display()))
}
