//! Harness for lb's privileged integration tests: throwaway cgroups, loopback
//! backends that say who they are, a client that runs inside the cgroup, and
//! a daemon under test, and [`ServiceBuilder`] for the services of its
//! config. Everything cleans up on drop, also when a test fails or panics.
//!
//! Leaks fail the test. Each guard ([`TestCgroup`], [`Client`], [`Daemon`],
//! the bpffs mount, [`in_new_netns`]) first does all the cleanup it can, then
//! checks that nothing is left (a cgroup, pins, a process, a process in the
//! namespace) and, if something is, panics with what and where; when the
//! test is already failing it prints the leak instead (a second panic
//! would abort the process and hide the first).
//!
//! Addresses: every test owns `127.77.<id>.0/24` (VIPs and backends), or
//! lives in a network namespace it created. Nothing leaves loopback.

use std::{
    collections::HashMap,
    ffi::CString,
    fmt,
    fs::File,
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::unix::{
        ffi::{OsStrExt as _, OsStringExt as _},
        fs::MetadataExt as _,
        process::CommandExt as _,
    },
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

pub mod hardening;
pub mod load;

/// Whether privileged tests can run here. Without root they are skipped with
/// a printed reason, except under `CI=true`, where that is a failure.
pub fn privileged() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("privileged integration tests need root, and CI=true forbids skipping them");
    }
    eprintln!(
        "SKIPPED: this test needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN); run `cargo xtask test` as root"
    );
    false
}

/// Reports what a guard found left behind *after* it did all the cleanup it
/// could: a panic that fails the test, naming the leak; or, if the thread is
/// already panicking (the test failed, the guard runs while unwinding), a
/// printed line, since a panic during a panic aborts the whole test binary
/// and hides the test's own failure.
#[track_caller]
fn leaked(guard: &str, problems: &[String]) {
    if problems.is_empty() {
        return;
    }
    let what = problems.join("; ");
    if thread::panicking() {
        eprintln!("LEAK ({guard}, while the test was already failing): {what}");
    } else {
        panic!("LEAK ({guard}): {what}");
    }
}

/// The `lb` binary under test: `$LB_BIN`, or the workspace's debug build.
pub fn lb_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("LB_BIN") {
        return PathBuf::from(path);
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let path = workspace.join("target/debug/lb");
    assert!(
        path.exists(),
        "{} not found: build it (`cargo build -p lb-user`) or set LB_BIN",
        path.display()
    );
    path
}

/// Where the cgroup2 file system is mounted (from `/proc/self/mountinfo`).
/// Also used by `cargo xtask demo`.
pub fn cgroup2_root() -> std::io::Result<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    mountinfo
        .lines()
        .find_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let mount_point = before.split_whitespace().nth(4)?;
            (after.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount_point))
        })
        .ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "no cgroup2 file system is mounted")
        })
}

/// Makes `cmd` start inside the cgroup directory `cgroup`: the child moves
/// itself there between fork and exec, so not one instruction of the
/// program runs outside it. Also used by `cargo xtask demo`.
pub fn start_in_cgroup(cmd: &mut Command, cgroup: &Path) {
    // A path from the file system has no NUL byte.
    let procs = CString::new(cgroup.join("cgroup.procs").into_os_string().into_vec())
        .expect("a path without NUL bytes");
    // SAFETY: between fork and exec only async-signal-safe calls (open,
    // write, close) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // "0" moves the writing process itself.
            let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
            libc::close(fd);
            if ok { Ok(()) } else { Err(std::io::Error::last_os_error()) }
        });
    }
}

/// A throwaway child cgroup of the cgroup2 root. On drop, every process in
/// it is killed and the directory removed.
pub struct TestCgroup {
    pub path: PathBuf,
}

impl TestCgroup {
    pub fn new(name: &str) -> Self {
        let root =
            cgroup2_root().unwrap_or_else(|e| panic!("privileged tests need cgroup v2: {e}"));
        let path = root.join(format!("lb-test-{}-{name}", std::process::id()));
        if path.exists() {
            kill_members(&path);
            let _ = std::fs::remove_dir(&path);
        }
        std::fs::create_dir(&path)
            .unwrap_or_else(|e| panic!("creating cgroup {}: {e}", path.display()));
        Self { path }
    }
}

fn kill_members(path: &Path) {
    let _ = std::fs::write(path.join("cgroup.kill"), "1");
    for _ in 0..100 {
        let procs = std::fs::read_to_string(path.join("cgroup.procs")).unwrap_or_default();
        if procs.trim().is_empty() {
            return;
        }
        for pid in procs.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
            // SAFETY: sending a signal has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for TestCgroup {
    /// Kills every member and removes the directory; a cgroup that is still
    /// there after a second is a leak.
    fn drop(&mut self) {
        kill_members(&self.path);
        let mut error = None;
        for _ in 0..50 {
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(e) => error = Some(e),
            }
            thread::sleep(Duration::from_millis(20));
        }
        let members = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
        let members: Vec<&str> = members.split_whitespace().collect();
        leaked(
            "TestCgroup",
            &[format!(
                "cgroup {} could not be removed ({}); processes still in it: {members:?}",
                self.path.display(),
                error.map_or_else(|| "no error".to_owned(), |e| e.to_string())
            )],
        );
    }
}

/// A TCP (and UDP) server on one address that answers `who` with its
/// name, so a test knows which server a connection really reached, and
/// answers `GET /...` (a health check) with a status the test controls.
pub struct Backend {
    pub name: String,
    pub addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    last_accept: Arc<Mutex<Option<Instant>>>,
    health_status: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
}

impl Backend {
    /// Listens on `addr` (port 0: any free port).
    pub fn start(name: &str, addr: SocketAddr) -> Self {
        let listener =
            TcpListener::bind(addr).unwrap_or_else(|e| panic!("backend {name}: bind {addr}: {e}"));
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let udp = UdpSocket::bind(addr)
            .unwrap_or_else(|e| panic!("backend {name}: bind udp {addr}: {e}"));
        udp.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let (accepted, stop, conns) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new(HashMap::new())),
        );
        let health_status = Arc::new(AtomicUsize::new(200));
        let last_accept = Arc::new(Mutex::new(None));
        let tcp_thread = {
            let (name, accepted, stop, conns, health_status) = (
                name.to_owned(),
                accepted.clone(),
                stop.clone(),
                conns.clone(),
                health_status.clone(),
            );
            let last_accept = last_accept.clone();
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            let (name, accepted, conns, health_status) = (
                                name.clone(),
                                accepted.clone(),
                                conns.clone(),
                                health_status.clone(),
                            );
                            let last_accept = last_accept.clone();
                            thread::spawn(move || {
                                serve(stream, &name, &conns, &health_status, || {
                                    accepted.fetch_add(1, Ordering::Relaxed);
                                    *last_accept.lock().unwrap() = Some(Instant::now());
                                });
                            });
                        }
                        Err(_) => thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        let udp_thread = {
            let (name, stop) = (name.to_owned(), stop.clone());
            thread::spawn(move || {
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((_, from)) = udp.recv_from(&mut buf) {
                        let _ = udp.send_to(name.as_bytes(), from);
                    }
                }
            })
        };
        Self {
            name: name.to_owned(),
            addr,
            accepted,
            last_accept,
            health_status,
            stop,
            threads: vec![tcp_thread, udp_thread],
            conns,
        }
    }

    /// Client connections this backend answered so far (not health checks).
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    /// When this backend last answered a client connection.
    pub fn last_accept(&self) -> Option<Instant> {
        *self.last_accept.lock().unwrap()
    }

    /// The HTTP status its health endpoint answers from now on.
    pub fn set_health(&self, status: u16) {
        self.health_status.store(usize::from(status), Ordering::Relaxed);
    }

    /// Stops listening (new connects are refused) and closes its connections.
    pub fn stop(mut self) -> SocketAddr {
        self.shutdown();
        self.addr
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for (_, conn) in self.conns.lock().unwrap().drain() {
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// One accepted connection: a health check gets an HTTP answer and is
/// closed; a client gets the backend's name (then `on_client` runs) and is
/// held until it closes, or until `stop` shuts it down.
fn serve(
    mut stream: TcpStream,
    name: &str,
    conns: &Mutex<HashMap<u64, TcpStream>>,
    health_status: &AtomicUsize,
    on_client: impl FnOnce(),
) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut first = String::new();
    if BufReader::new(&stream).read_line(&mut first).is_err() || first.is_empty() {
        return; // a TCP health check: connect and close
    }
    if first.starts_with("GET ") {
        let status = health_status.load(Ordering::Relaxed);
        let _ = write!(
            stream,
            "HTTP/1.1 {status} Status\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        return;
    }
    let _ = writeln!(stream, "{name}");
    on_client();
    let id = NEXT.fetch_add(1, Ordering::Relaxed) as u64;
    if let Ok(clone) = stream.try_clone() {
        conns.lock().unwrap().insert(id, clone);
    }
    let _ = stream.set_read_timeout(None);
    let mut sink = [0u8; 64];
    while matches!(std::io::Read::read(&mut stream, &mut sink), Ok(n) if n > 0) {}
    conns.lock().unwrap().remove(&id);
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The answer to a `connect`/`udp` command of the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Connect {
    /// Connection id, the peer the application saw, the server's greeting.
    Ok {
        id: u32,
        peer: SocketAddr,
        greeting: String,
    },
    Err(String),
}

impl Connect {
    /// The greeting (which backend accepted), or a panic with the error.
    #[track_caller]
    pub fn landed(&self) -> &str {
        match self {
            Self::Ok { greeting, .. } => greeting,
            Self::Err(e) => panic!("connect failed: {e}"),
        }
    }

    #[track_caller]
    pub fn id(&self) -> u32 {
        match self {
            Self::Ok { id, .. } => *id,
            Self::Err(e) => panic!("connect failed: {e}"),
        }
    }

    /// The peer the application saw (getpeername), or a panic with the error.
    #[track_caller]
    pub fn peer(&self) -> SocketAddr {
        match self {
            Self::Ok { peer, .. } => *peer,
            Self::Err(e) => panic!("connect failed: {e}"),
        }
    }
}

/// The test client binary: `bin` (`env!("CARGO_BIN_EXE_lb-test-client")` in
/// a test), or `$LB_TEST_CLIENT` (a VM's copy of it).
pub fn client_bin(bin: &str) -> PathBuf {
    std::env::var_os("LB_TEST_CLIENT").map_or_else(|| PathBuf::from(bin), PathBuf::from)
}

/// `lb-test-client` running in a cgroup (or outside any test cgroup): one
/// process answering one line per command (see the binary for them). The
/// commands of the load and hardening tests are in `load` and `hardening`.
pub struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    /// Starts the client binary `bin` (`env!("CARGO_BIN_EXE_lb-test-client")`
    /// in a test, overridden by `$LB_TEST_CLIENT`) inside `cgroup`, or in
    /// the test's own cgroup if `None`.
    pub fn start(bin: &str, cgroup: Option<&TestCgroup>) -> Self {
        let bin = client_bin(bin);
        let mut cmd = Command::new(&bin);
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        if let Some(cgroup) = cgroup {
            start_in_cgroup(&mut cmd, &cgroup.path);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Self { child, stdin, stdout }
    }

    /// Sends one command and returns its one-line answer. Every command of
    /// the client is bounded in time (its own deadlines and 5 s socket
    /// timeouts), so this cannot hang for ever.
    pub fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").expect("client died");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("client died");
        assert!(!line.is_empty(), "client exited on {command:?}");
        line.trim().to_owned()
    }

    fn parse(answer: &str) -> Connect {
        let mut words = answer.splitn(4, ' ');
        match words.next() {
            Some("ok") => Connect::Ok {
                id: words.next().unwrap().parse().unwrap(),
                peer: words.next().unwrap().parse().unwrap(),
                greeting: words.next().unwrap_or("").to_owned(),
            },
            _ => Connect::Err(answer.to_owned()),
        }
    }

    pub fn connect(&mut self, addr: SocketAddr) -> Connect {
        Self::parse(&self.ask(&format!("connect {addr}")))
    }

    pub fn udp(&mut self, addr: SocketAddr) -> Connect {
        Self::parse(&self.ask(&format!("udp {addr}")))
    }

    pub fn alive(&mut self, id: u32) -> bool {
        let answer = self.ask(&format!("alive {id}"));
        assert!(!answer.starts_with("err"), "{answer}");
        answer == "alive"
    }

    /// `threads` threads connecting in a loop until `stop_file` exists (at
    /// most `limit`), then once more each; returns the client's `storm ...`
    /// summary line.
    pub fn storm(
        &mut self,
        addr: SocketAddr,
        threads: usize,
        limit: Duration,
        stop_file: &Path,
    ) -> String {
        self.ask(&format!("storm {addr} {threads} {} {}", limit.as_millis(), stop_file.display()))
    }

    pub fn close(&mut self, id: u32) {
        assert_eq!(self.ask(&format!("close {id}")), "closed");
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Client {
    /// Kills and reaps the client; one that cannot be reaped is a leak.
    fn drop(&mut self) {
        let _ = self.child.kill();
        if let Err(e) = self.child.wait() {
            leaked(
                "Client",
                &[format!("lb-test-client (pid {}) could not be reaped: {e}", self.child.id())],
            );
        }
    }
}

/// The daemon under test, with its own config, pins and control socket.
/// On drop it is killed and `lb detach` removes everything it attached;
/// an `lb` process still running with its config, or a pin left under its
/// `bpffs` directory, is then a leak (the test fails).
pub struct Daemon {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub bpffs: PathBuf,
    /// Extra lines for the `[daemon]` section.
    daemon_settings: String,
    /// Extra environment variables of `lb run`, for every (re)start.
    env: Vec<(String, String)>,
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
            child: None,
            _bpffs_mount,
        };
        daemon.write_config(cgroup, services_toml);
        daemon
    }

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
        let child = Command::new(lb_bin())
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

/// Every file below `dir` (pins, on bpffs), relative to it.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(next) = todo.pop() {
        for entry in std::fs::read_dir(&next).into_iter().flatten().flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(path);
            } else {
                files.push(path.strip_prefix(dir).unwrap_or(&path).to_path_buf());
            }
        }
    }
    files.sort();
    files
}

/// Where the daemons under test pin, each in its own directory.
const BPFFS_ROOT: &str = "/sys/fs/bpf";

/// This test process's use of the bpffs at `/sys/fs/bpf`, held by each
/// [`Daemon`]. If nothing is mounted there when a daemon is about to start,
/// the harness mounts it itself (not left to the daemon's own fallback:
/// two daemons starting at once could stack two mounts), and unmounts it
/// when the last daemon of this process is gone, so a test run leaves the
/// host's mounts as it found them. A bpffs that was already mounted is
/// never touched.
///
/// It stays mounted, with a printed note, if it then holds anything this
/// process did not create (say, a second test run that started while the
/// mount was there): unmounting would drop that run's pins and detach its
/// programs. Pins this process left there are removed and are a leak.
struct BpffsMount(());

struct BpffsUsers {
    users: usize,
    /// Set while the mount is this process's: what a fresh mount holds by
    /// itself (`maps.debug`, `progs.debug` with `CONFIG_BPF_PRELOAD`).
    mounted_here: Option<Vec<PathBuf>>,
}

static BPFFS_USERS: Mutex<BpffsUsers> = Mutex::new(BpffsUsers { users: 0, mounted_here: None });

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).collect();
    entries.sort();
    entries
}

impl BpffsMount {
    fn acquire() -> Self {
        let mut state = BPFFS_USERS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let root = Path::new(BPFFS_ROOT);
        if state.users == 0 && !is_bpffs(root) {
            let target = CString::new(BPFFS_ROOT).unwrap();
            // SAFETY: valid NUL-terminated strings; no data.
            let rc = unsafe {
                libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null())
            };
            assert_eq!(
                rc,
                0,
                "mounting bpffs at {BPFFS_ROOT}: {}",
                std::io::Error::last_os_error()
            );
            eprintln!(
                "(mounted bpffs at {BPFFS_ROOT}; unmounted again after the last daemon of this test process)"
            );
            state.mounted_here = Some(entries(root));
        }
        state.users += 1;
        Self(())
    }
}

impl Drop for BpffsMount {
    fn drop(&mut self) {
        let mut state = BPFFS_USERS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.users -= 1;
        if state.users > 0 {
            return;
        }
        let Some(fresh) = state.mounted_here.take() else { return };
        let root = Path::new(BPFFS_ROOT);
        let ours = format!("lb-test-{}-", std::process::id());
        let (mine, theirs): (Vec<PathBuf>, Vec<PathBuf>) = entries(root)
            .into_iter()
            .filter(|p| !fresh.contains(p))
            .partition(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&ours)));
        let mut problems = Vec::new();
        for dir in &mine {
            let pins = files_under(dir);
            let removed = std::fs::remove_dir_all(dir)
                .map_or_else(|e| format!("removing it failed: {e}"), |()| "removed it".to_owned());
            problems.push(format!(
                "{} left on bpffs after every daemon was gone: {pins:?}; {removed}",
                dir.display()
            ));
        }
        if theirs.is_empty() {
            let target = CString::new(BPFFS_ROOT).unwrap();
            // SAFETY: a valid NUL-terminated path. No MNT_DETACH: if it is
            // busy, that is reported, not hidden.
            if unsafe { libc::umount2(target.as_ptr(), 0) } != 0 {
                problems.push(format!(
                    "unmounting the bpffs this test process mounted at {BPFFS_ROOT}: {}",
                    std::io::Error::last_os_error()
                ));
            }
        } else {
            eprintln!(
                "note: leaving the bpffs this test process mounted at {BPFFS_ROOT} in place: it now holds {theirs:?}, not created here"
            );
        }
        leaked("bpffs mount", &problems);
    }
}

fn is_bpffs(path: &Path) -> bool {
    let Ok(c_path) = CString::new(path.as_os_str().as_bytes()) else { return false };
    // SAFETY: statfs fills the zeroed struct we pass.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid path and out-pointer.
    (unsafe { libc::statfs(c_path.as_ptr(), &mut stat) }) == 0 && stat.f_type == libc::BPF_FS_MAGIC
}

/// How the daemon judges a service's servers, besides the kernel's reports
/// of connects through the VIP (which every check also gets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    /// `check = "none"`: no probes; only the kernel's reports.
    None,
    /// `check = "tcp"`: connect and close, every `interval`.
    Tcp { interval: Duration },
    /// `check = "http"`: `GET path` every `interval`; a [`Backend`] answers
    /// with the status set by [`Backend::set_health`].
    Http { path: &'static str, interval: Duration },
}

/// A service's `policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Failover,
    Spread,
}

/// One `[[service]]` of a test's config, rendered as TOML by
/// [`toml`](Self::toml) (or `Display`). Settings that are not set are left
/// out, so the daemon's own defaults apply, except for the health check:
///
/// **The default health setting is [`ServiceBuilder::DEFAULT_CHECK`],
/// `Check::None`**: the daemon sends no probes and judges servers by the
/// kernel's connect reports alone. A test then sees only what it caused
/// (the kernel's own choices, no check flipping a state behind its back,
/// no timing to wait for), and a test about health checks says which
/// check it runs and how often. (The daemon's own default, `tcp` every 2
/// s, would make every test slow and timing-dependent.)
///
/// ```
/// # use lb_tests::{Check, ServiceBuilder};
/// # use std::time::Duration;
/// let vip = "127.77.1.100:6444".parse().unwrap();
/// let toml = ServiceBuilder::new("api", vip)
///     .servers(&["127.77.1.1:80".parse().unwrap()])
///     .hold_down(Duration::from_secs(1))
///     .check(Check::Http { path: "/readyz", interval: Duration::from_millis(200) })
///     .toml();
/// assert!(toml.contains("timeout = \"150ms\""));
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct ServiceBuilder {
    name: String,
    vip: SocketAddr,
    servers: Vec<SocketAddr>,
    default: Option<SocketAddr>,
    policy: Option<Policy>,
    hold_down: Option<Duration>,
    check: Check,
    timeout: Option<Duration>,
    rise: Option<u32>,
    fall: Option<u32>,
    raw: Vec<String>,
}

impl ServiceBuilder {
    /// The health check of a service that does not set one; see the type's
    /// documentation for why.
    pub const DEFAULT_CHECK: Check = Check::None;

    /// A service `name` on `vip`, with no servers yet.
    pub fn new(name: &str, vip: SocketAddr) -> Self {
        Self {
            name: name.to_owned(),
            vip,
            servers: Vec::new(),
            default: None,
            policy: None,
            hold_down: None,
            check: Self::DEFAULT_CHECK,
            timeout: None,
            rise: None,
            fall: None,
            raw: Vec::new(),
        }
    }

    /// `servers`, in order.
    pub fn servers(mut self, servers: &[SocketAddr]) -> Self {
        self.servers = servers.to_vec();
        self
    }

    /// `default`: the last-resort server.
    pub fn default(mut self, server: SocketAddr) -> Self {
        self.default = Some(server);
        self
    }

    /// `policy`.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = Some(policy);
        self
    }

    /// `hold_down`: how long the kernel skips a server after a failed connect.
    pub fn hold_down(mut self, hold_down: Duration) -> Self {
        self.hold_down = Some(hold_down);
        self
    }

    /// The health check (`[service.health] check`, `path`, `interval`).
    pub fn check(mut self, check: Check) -> Self {
        self.check = check;
        self
    }

    /// `[service.health] timeout` of a probing check. Without it: 3/4 of
    /// the interval, at least 50 ms.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// `[service.health] rise`: passes in a row to be usable again.
    pub fn rise(mut self, rise: u32) -> Self {
        self.rise = Some(rise);
        self
    }

    /// `[service.health] fall`: failures (checks or kernel reports) in a
    /// row to be failed.
    pub fn fall(mut self, fall: u32) -> Self {
        self.fall = Some(fall);
        self
    }

    /// A line copied as it is into the `[[service]]` table, e.g. a
    /// deliberately misspelt key.
    pub fn raw(mut self, line: &str) -> Self {
        self.raw.push(line.to_owned());
        self
    }

    /// The `[[service]]` table, with its `[service.health]`.
    pub fn toml(&self) -> String {
        let Self {
            name,
            vip,
            servers,
            default,
            policy,
            hold_down,
            check,
            timeout,
            rise,
            fall,
            raw,
        } = self;
        let servers: Vec<String> = servers.iter().map(|s| format!("\"{s}\"")).collect();
        let mut t = format!(
            "[[service]]\nname = \"{name}\"\nvip = \"{vip}\"\nservers = [{}]\n",
            servers.join(", ")
        );
        if let Some(default) = default {
            t += &format!("default = \"{default}\"\n");
        }
        if let Some(policy) = policy {
            t += &format!(
                "policy = \"{}\"\n",
                match policy {
                    Policy::Failover => "failover",
                    Policy::Spread => "spread",
                }
            );
        }
        if let Some(hold_down) = hold_down {
            t += &format!("hold_down = \"{}\"\n", toml_duration(*hold_down));
        }
        for line in raw {
            t += line;
            t += "\n";
        }
        t += "[service.health]\n";
        let interval = match check {
            Check::None => {
                assert!(
                    timeout.is_none(),
                    "service {name}: a timeout needs a check that probes, not Check::None"
                );
                t += "check = \"none\"\n";
                None
            }
            Check::Tcp { interval } => {
                t += "check = \"tcp\"\n";
                Some(*interval)
            }
            Check::Http { path, interval } => {
                t += &format!("check = \"http\"\npath = \"{path}\"\n");
                Some(*interval)
            }
        };
        if let Some(interval) = interval {
            let timeout =
                timeout.unwrap_or_else(|| (interval * 3 / 4).max(Duration::from_millis(50)));
            t += &format!(
                "interval = \"{}\"\ntimeout = \"{}\"\n",
                toml_duration(interval),
                toml_duration(timeout)
            );
        }
        if let Some(rise) = rise {
            t += &format!("rise = {rise}\n");
        }
        if let Some(fall) = fall {
            t += &format!("fall = {fall}\n");
        }
        t
    }
}

impl fmt::Display for ServiceBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.toml())
    }
}

/// `"5s"` or `"150ms"`: whole milliseconds only.
fn toml_duration(d: Duration) -> String {
    assert_eq!(d.subsec_nanos() % 1_000_000, 0, "{d:?}: test configs use whole milliseconds");
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Polls `check` every 20 ms until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// CLOCK_MONOTONIC in nanoseconds: comparable across processes (the
/// storm client reports in it).
pub fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime fills the struct we pass.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid clock id and out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// An address in this test's own loopback range `127.77.<test>.0/24`.
pub fn addr(test: u8, host: u8, port: u16) -> SocketAddr {
    SocketAddr::from(([127, 77, test, host], port))
}

/// Counts how many answers landed on each backend name.
pub fn tally<'a>(answers: impl IntoIterator<Item = &'a Connect>) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for answer in answers {
        *counts.entry(answer.landed().to_owned()).or_default() += 1;
    }
    counts
}

/// Runs `body` on a thread in a new network namespace with loopback up.
/// Every process the body starts lives in that namespace; the namespace
/// disappears when the body's processes and the thread are gone. A process
/// or thread still in it once the body is done is a leak (see [`NetnsGuard`]).
pub fn in_new_netns<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    let (ns_tx, ns_rx) = std::sync::mpsc::channel();
    let result = thread::spawn(move || {
        // SAFETY: unshare(CLONE_NEWNET) affects only this thread.
        assert_eq!(
            unsafe { libc::unshare(libc::CLONE_NEWNET) },
            0,
            "unshare(CLONE_NEWNET): {}",
            std::io::Error::last_os_error()
        );
        let ns = File::open("/proc/thread-self/ns/net").expect("opening /proc/thread-self/ns/net");
        let _ = ns_tx.send(NetnsGuard { ns });
        loopback_up().expect("bringing lo up in the new network namespace");
        body()
    })
    .join();
    // Declared before the body's panic is resumed, so it checks on that
    // path too (and then only prints).
    let _guard = ns_rx.try_recv().ok();
    result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// The network namespace of an [`in_new_netns`] body, after the body is
/// done. On drop it waits up to 5 s for every task to leave it (a
/// backend's connection thread may take a moment), then kills any process
/// still in it (by construction one the test started) and reports the
/// leak. The open namespace file keeps the namespace's inode from being
/// reused by another namespace while it looks.
///
/// Not checked: sockets still open in it, which also keep a namespace
/// alive; they belong to this process and go with its other guards.
pub struct NetnsGuard {
    ns: File,
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        let Ok(meta) = self.ns.metadata() else { return };
        let id = (meta.dev(), meta.ino());
        let mut left = Vec::new();
        if wait_until(Duration::from_secs(5), || {
            left = tasks_in_netns(id);
            left.is_empty()
        }) {
            return;
        }
        let me = std::process::id() as i32;
        let mut described = Vec::new();
        for (pid, tid, name) in &left {
            if *pid == me {
                described.push(format!("thread {tid} ({name}) of this test process"));
            } else {
                // SAFETY: sending a signal has no memory-safety preconditions.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
                described.push(format!("pid {pid} ({name}), killed"));
            }
        }
        described.dedup();
        leaked(
            "in_new_netns",
            &[format!(
                "the test's network namespace net:[{}] still has tasks in it: {}",
                id.1,
                described.join(", ")
            )],
        );
    }
}

/// Every task (pid, tid, name) whose network namespace is the nsfs inode `id`.
fn tasks_in_netns(id: (u64, u64)) -> Vec<(i32, i32, String)> {
    let mut tasks = Vec::new();
    for pid in std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
    {
        for tid in std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        {
            // metadata() follows the `net:[inode]` link to the namespace's nsfs inode.
            if std::fs::metadata(format!("/proc/{pid}/task/{tid}/ns/net"))
                .is_ok_and(|m| (m.dev(), m.ino()) == id)
            {
                let name = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                    .unwrap_or_default();
                tasks.push((pid, tid, name.trim().to_owned()));
            }
        }
    }
    tasks
}

/// Brings up `lo` in this thread's network namespace (a new one starts
/// with it down).
pub fn loopback_up() -> std::io::Result<()> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    // SAFETY: plain socket/ioctl calls on a zeroed, correctly sized ifreq;
    // the new descriptor is owned at once.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCSIFFLAGS, &mut ifr) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
