//! [`Daemon`]: an `lb run` under test, with its own config, pins and
//! control socket, and the `lb` client commands that talk to it.

use std::{
    net::SocketAddr,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    process::{Child, Command},
    thread,
    time::{Duration, Instant},
};

use crate::{
    bpffs::{BPFFS_ROOT, BpffsMount, files_under},
    cgroup::TestCgroup,
    env::lb_bin,
    leak::leaked,
    wait::wait_until,
};

/// The daemon under test, with its own config, pins and control socket.
/// On drop it is killed and `lb detach` removes everything it attached;
/// an `lb` process still running with its config, or a pin left under its
/// `bpffs` directory, is then a leak (the test fails).
pub struct Daemon {
    /// Its own directory: config, log, control socket, state.
    pub dir: PathBuf,
    /// Its config file.
    pub config: PathBuf,
    /// Where it pins, under the bpffs.
    pub bpffs: PathBuf,
    /// Extra lines for the `[daemon]` section.
    daemon_settings: String,
    /// Extra environment variables of `lb run`, for every (re)start.
    env: Vec<(String, String)>,
    /// The `lb` that `lb run` starts, if not this version's
    /// ([`Daemon::use_bin`]).
    bin: Option<PathBuf>,
    child: Option<Child>,
    /// Dropped after `Daemon::drop` has removed the pins.
    _bpffs_mount: BpffsMount,
}

impl Daemon {
    /// Writes a config (the `[daemon]` section is added here) and starts
    /// `lb run`; returns once the control socket answers.
    pub fn start(name: &str, cgroup: &TestCgroup, services_toml: &str) -> Self {
        Self::start_with(name, cgroup, "", services_toml)
    }

    /// As `start`, with extra lines for the `[daemon]` section.
    pub fn start_with(
        name: &str,
        cgroup: &TestCgroup,
        daemon_settings: &str,
        services_toml: &str,
    ) -> Self {
        Self::start_with_env(name, cgroup, daemon_settings, &[], services_toml)
    }

    /// As `start_with`, with extra environment variables for `lb run`
    /// (e.g. `LB_DNS_SERVER`), kept for every restart.
    pub fn start_with_env(
        name: &str,
        cgroup: &TestCgroup,
        daemon_settings: &str,
        env: &[(&str, &str)],
        services_toml: &str,
    ) -> Self {
        let mut daemon = Self::prepare(name, cgroup, daemon_settings, env, services_toml);
        daemon.restart();
        daemon
    }

    /// As `start_with_env`, without starting `lb run`: for a caller that
    /// times the start itself ([`Daemon::spawn_with`]).
    pub fn prepare(
        name: &str,
        cgroup: &TestCgroup,
        daemon_settings: &str,
        env: &[(&str, &str)],
        services_toml: &str,
    ) -> Self {
        // First: if this panics, nothing else has been made yet.
        let _bpffs_mount = BpffsMount::acquire();
        let tag = format!("lb-test-{}-{name}", std::process::id());
        let dir = std::env::temp_dir().join(&tag);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let bpffs = Path::new(BPFFS_ROOT).join(&tag);
        let config = dir.join("config.toml");
        let env = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        let daemon = Self {
            dir,
            config,
            bpffs,
            daemon_settings: daemon_settings.to_owned(),
            env,
            bin: None,
            child: None,
            _bpffs_mount,
        };
        daemon.write_config(cgroup, services_toml);
        daemon
    }

    /// (Re)writes the config file: the `[daemon]` section for `cgroup`,
    /// then `services_toml`. The daemon reads it at its next start or
    /// reload.
    pub fn write_config(&self, cgroup: &TestCgroup, services_toml: &str) {
        let text = format!(
            "[daemon]\ncgroup = {:?}\nbpffs = {:?}\ncontrol_socket = {:?}\nstate_dir = {:?}\n{}\n{services_toml}",
            cgroup.path,
            self.bpffs,
            self.dir.join("lb.sock"),
            self.dir.join("state"),
            self.daemon_settings,
        );
        std::fs::write(&self.config, text).unwrap();
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("lb.log")).unwrap_or_default()
    }

    /// Starts (again) the daemon process and waits until it answers.
    pub fn restart(&mut self) {
        self.restart_with(&[]);
    }

    /// As `restart`, with extra arguments for `lb run`.
    pub fn restart_with(&mut self, args: &[&str]) {
        self.spawn_with(args);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                panic!("lb run exited with {status}:\n{}", self.log());
            }
            if self.try_lb(&["status", "--json"]).is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "lb run did not answer within 60 s:\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts `lb run` (with extra arguments) and returns at once.
    pub fn spawn_with(&mut self, args: &[&str]) {
        assert!(self.child.is_none(), "daemon already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("lb.log"))
            .unwrap();
        let child = Command::new(self.bin.clone().unwrap_or_else(lb_bin))
            .args(["run", "--config"])
            .arg(&self.config)
            .args(args)
            .env("RUST_LOG", "info,lb_user=debug")
            .env("NO_COLOR", "1")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting lb run");
        self.child = Some(child);
    }

    /// Runs `bin` as `lb run` from the next (re)start on (`None`: this
    /// version's). The client commands (`lb status`, ...) stay this
    /// version's.
    pub fn use_bin(&mut self, bin: Option<PathBuf>) {
        self.bin = bin;
    }

    /// SIGKILL: the datapath must keep working without the daemon.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits up to `timeout` for the daemon to exit; whether it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> bool {
        let exited = wait_until(timeout, || {
            self.child.as_mut().is_none_or(|c| c.try_wait().ok().flatten().is_some())
        });
        if exited {
            self.child = None;
        }
        exited
    }

    /// The pid of the running `lb run` (`None` once it was killed or
    /// seen to exit).
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().and_then(|c| i32::try_from(c.id()).ok())
    }

    /// Sends a signal to the running daemon.
    pub fn signal(&self, signal: i32) {
        let pid = self.child.as_ref().expect("daemon not running").id() as i32;
        // SAFETY: sending a signal has no memory-safety preconditions.
        unsafe { libc::kill(pid, signal) };
    }

    /// Runs an `lb` client subcommand with this daemon's config.
    pub fn try_lb(&self, args: &[&str]) -> Result<String, String> {
        let out =
            Command::new(lb_bin()).args(args).arg("--config").arg(&self.config).output().unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// As [`Self::try_lb`]; a failure panics with the daemon's log.
    #[track_caller]
    pub fn lb(&self, args: &[&str]) -> String {
        self.try_lb(args)
            .unwrap_or_else(|e| panic!("lb {args:?} failed: {e}\ndaemon log:\n{}", self.log()))
    }

    /// `lb status --json`.
    pub fn status(&self) -> serde_json::Value {
        serde_json::from_str(&self.lb(&["status", "--json"])).unwrap()
    }

    /// Whether this kernel has the optional feature `name` (as
    /// `lb status` reports it). Without it, says the test is skipped and why;
    /// with `LB_TEST_REQUIRE_FEATURES=1` (`cargo xtask test` sets it for the
    /// host kernel, also in CI) that is a failure. `CI=true` alone does not
    /// forbid the skip: the VM runs set it on older kernels where a missing
    /// optional feature is expected, and `cargo xtask vmtest` lists every
    /// such skip with its reason, so it is never a silent pass.
    pub fn has_feature(&self, name: &str) -> bool {
        if self.status()["datapath"]["features"][name] == true {
            return true;
        }
        if std::env::var("LB_TEST_REQUIRE_FEATURES").is_ok_and(|v| v == "1") {
            panic!("this kernel lacks {name}, and LB_TEST_REQUIRE_FEATURES=1 forbids skipping");
        }
        eprintln!("SKIPPED: this test needs {name}, which this kernel lacks");
        false
    }

    /// A field of `server` in the first service of `lb status --json`
    /// (`null` if the server is not there).
    pub fn server_field(&self, server: SocketAddr, field: &str) -> serde_json::Value {
        let status = self.status();
        status["services"][0]["servers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["address"] == server.to_string())
            .map_or(serde_json::Value::Null, |s| s[field].clone())
    }

    /// A kernel decision counter from `lb status --json` (0 if absent).
    pub fn counter(&self, reason: &str) -> u64 {
        self.status()["datapath"]["counters"][reason].as_u64().unwrap_or(0)
    }

    /// Live connections through `vip` to `server`, from `lb status --json`.
    pub fn connections(&self, service: &str, server: SocketAddr) -> i64 {
        let status = self.status();
        let service = status["services"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == service)
            .expect("service in status");
        let server = service["servers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["address"] == server.to_string())
            .expect("server in status");
        server["connections"].as_i64().unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let mut problems = Vec::new();
        if let Some(mut child) = self.child.take() {
            let pid = child.id();
            let _ = child.kill();
            if let Err(e) = child.wait() {
                problems.push(format!("lb run (pid {pid}) could not be reaped: {e}"));
            }
        }
        // `lb detach` reads only the paths from the config, so a test that
        // left a broken config behind still cleans up.
        let mut detach = self.try_lb(&["detach"]);
        let stray = processes_with_arg(&self.config);
        if !stray.is_empty() {
            for (pid, _) in &stray {
                // SAFETY: sending a signal has no memory-safety preconditions.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
            problems.push(format!(
                "lb processes still running with {} (killed): {stray:?}",
                self.config.display()
            ));
            // A daemon that outlived the first detach may have pinned again.
            thread::sleep(Duration::from_millis(100));
            detach = self.try_lb(&["detach"]);
        }
        if self.bpffs.exists() {
            let pins = files_under(&self.bpffs);
            let removed = match std::fs::remove_dir_all(&self.bpffs) {
                Ok(()) => "removed them".to_owned(),
                Err(e) => format!("removing them failed: {e}"),
            };
            let detach = match &detach {
                Ok(out) => out.trim().to_owned(),
                Err(e) => format!("failed: {}", e.trim()),
            };
            problems.push(format!(
                "pins left under {} after `lb detach` ({detach}): {pins:?}; {removed}",
                self.bpffs.display()
            ));
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            problems.push(format!("could not remove {}: {e}", self.dir.display()));
        }
        leaked("Daemon", &problems);
    }
}

/// Other processes that have `arg` as one of their arguments, with their
/// names.
fn processes_with_arg(arg: &Path) -> Vec<(i32, String)> {
    let me = std::process::id() as i32;
    let Ok(proc) = std::fs::read_dir("/proc") else { return Vec::new() };
    proc.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter_map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            cmdline
                .split(|b| *b == 0)
                .any(|a| a == arg.as_os_str().as_bytes())
                .then(|| (pid, comm(pid)))
        })
        .collect()
}

fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map_or_else(|_| "?".to_owned(), |c| c.trim().to_owned())
}
