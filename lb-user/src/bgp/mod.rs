//! Announcing by BGP (issue 42): lb never speaks BGP itself. It runs BIRD
//! 2 (the distribution's `bird2`: a maintained speaker with BFD and a
//! control socket made for programs, which FRR's vtysh is not, and without
//! GoBGP's gRPC stack), in the node's network namespace, with a config it
//! writes (`bird_config.rs`) under `state_dir/bird/`, and drives it through
//! that socket (`control.rs`): `configure` after each change of the routes,
//! `show protocols` for status, `down` on `lb detach`.
//!
//! Every node with a usable server for a VIP announced by BGP gives BIRD
//! the VIP's host route; the routers spread its traffic over those nodes
//! (ECMP). BIRD outlives the daemon (fail-static, as the pinned programs
//! do): a restarted daemon adopts the one that answers on the socket, and
//! starts one if none does.

pub mod bird_config;
pub mod control;

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use tracing::{info, warn};

use crate::config::Bgp;

/// How long a BIRD just started has to answer on its socket.
const START_WITHIN: Duration = Duration::from_secs(5);
/// How often BIRD is asked whether it runs while its routes stay the
/// same (a BIRD that died is started again within this): `announce` runs
/// at every sync and every lease renewal, and must not cost a round trip
/// on the socket each time.
const RECHECK: Duration = Duration::from_secs(5);

/// The BIRD lb runs, and what it was last told.
pub struct Speaker {
    bgp: Bgp,
    dir: PathBuf,
    /// The routes BIRD's config holds, once written and read by it.
    routes: Option<BTreeSet<IpAddr>>,
    /// When BIRD last answered on its socket.
    answered_at: Option<Instant>,
    /// The last failure, told once.
    failing: Option<String>,
}

impl Speaker {
    /// The speaker for `bgp`, its files under `state_dir/bird/`. Nothing is
    /// started before the first [`Self::announce`].
    pub fn new(bgp: Bgp, state_dir: &Path) -> Self {
        Self { bgp, dir: state_dir.join("bird"), routes: None, answered_at: None, failing: None }
    }

    /// BIRD's control socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.join("bird.ctl")
    }

    fn conf(&self) -> PathBuf {
        self.dir.join("bird.conf")
    }

    /// Makes BIRD announce exactly `routes` (host routes of VIPs), starting
    /// it (or adopting the one that answers) if needed. Failures are
    /// logged once each and tried again at the next call.
    pub fn announce(&mut self, routes: &BTreeSet<IpAddr>) {
        match self.try_announce(routes) {
            Ok(()) => {
                if self.failing.take().is_some() {
                    info!("bgp: BIRD announces again");
                }
            }
            Err(e) => {
                let why = format!("{e:#}");
                if self.failing.as_ref() != Some(&why) {
                    warn!("bgp: {why}; trying again at the next sync");
                }
                self.failing = Some(why);
                self.routes = None;
                self.answered_at = None;
            }
        }
    }

    fn try_announce(&mut self, routes: &BTreeSet<IpAddr>) -> anyhow::Result<()> {
        let unchanged = self.routes.as_ref() == Some(routes);
        if unchanged && self.answered_at.is_some_and(|at| at.elapsed() < RECHECK) {
            return Ok(());
        }
        let running = control::command(&self.socket(), "show status").is_ok();
        if running {
            self.answered_at = Some(Instant::now());
        }
        if running && unchanged {
            return Ok(());
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
        } else {
            self.start()?;
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
        Ok(())
    }

    /// Starts BIRD on the config written (it forks into the background
    /// once the config has parsed) and waits for its socket.
    fn start(&self) -> anyhow::Result<()> {
        let status = Command::new(&self.bgp.speaker)
            .arg("-c")
            .arg(self.conf())
            .arg("-s")
            .arg(self.socket())
            .arg("-P")
            .arg(self.dir.join("bird.pid"))
            .status()
            .with_context(|| format!("starting {}", self.bgp.speaker.display()))?;
        if !status.success() {
            bail!(
                "{} -c {} exited with {status}",
                self.bgp.speaker.display(),
                self.conf().display()
            );
        }
        let deadline = Instant::now() + START_WITHIN;
        while control::command(&self.socket(), "show status").is_err() {
            if Instant::now() >= deadline {
                bail!(
                    "BIRD started but did not answer on {} within {START_WITHIN:?}",
                    self.socket().display()
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

    /// The BGP sessions as BIRD says they are (empty if it does not answer).
    pub fn sessions(&self) -> Vec<control::Session> {
        control::command(&self.socket(), "show protocols")
            .map(|reply| control::sessions(&reply))
            .unwrap_or_default()
    }

    /// What BIRD was last told to announce.
    pub fn announced(&self) -> Vec<IpAddr> {
        self.routes.iter().flatten().copied().collect()
    }

    /// Stops BIRD (`lb detach`): its sessions close, and the routers
    /// withdraw every route it announced.
    pub fn stop(&mut self) {
        if stop_speaker(self.dir.parent().unwrap_or(&self.dir)) {
            info!("bgp: BIRD stopped; its routes are withdrawn");
        }
        self.routes = None;
        self.answered_at = None;
    }
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

/// Stops the BIRD whose socket is under `state_dir` (`bird/bird.ctl`), if
/// one answers there, and waits (bounded) for it to be gone: whether one
/// did.
pub fn stop_speaker(state_dir: &Path) -> bool {
    let socket = state_dir.join("bird").join("bird.ctl");
    if control::command(&socket, "down").is_err() {
        return false;
    }
    let deadline = Instant::now() + START_WITHIN;
    while control::command(&socket, "show status").is_ok() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}
