//! Harness for lb's privileged integration tests: throwaway cgroups, loopback
//! backends that say who they are, a client that runs inside the cgroup, and
//! a daemon under test. Everything cleans up on drop, also when a test fails
//! or panics.
//!
//! Addresses: every test owns `127.77.<id>.0/24` (VIPs and backends), or
//! lives in a network namespace it created. Nothing leaves loopback.

use std::{
    collections::HashMap,
    ffi::CString,
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::unix::{ffi::OsStringExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

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
    eprintln!("SKIPPED: this test needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN); run `cargo xtask test` as root");
    false
}

/// The `lb` binary under test: `$LB_BIN`, or the workspace's debug build.
pub fn lb_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("LB_BIN") {
        return PathBuf::from(path);
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let path = workspace.join("target/debug/lb");
    assert!(path.exists(), "{} not found: build it (`cargo build -p lb-user`) or set LB_BIN", path.display());
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
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no cgroup2 file system is mounted"))
}

/// Makes `cmd` start inside the cgroup directory `cgroup`: the child moves
/// itself there between fork and exec, so not one instruction of the
/// program runs outside it. Also used by `cargo xtask demo`.
pub fn start_in_cgroup(cmd: &mut Command, cgroup: &Path) {
    // A path from the file system has no NUL byte.
    let procs = CString::new(cgroup.join("cgroup.procs").into_os_string().into_vec()).expect("a path without NUL bytes");
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
        let root = cgroup2_root().unwrap_or_else(|e| panic!("privileged tests need cgroup v2: {e}"));
        let path = root.join(format!("lb-test-{}-{name}", std::process::id()));
        if path.exists() {
            kill_members(&path);
            let _ = std::fs::remove_dir(&path);
        }
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("creating cgroup {}: {e}", path.display()));
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
    fn drop(&mut self) {
        kill_members(&self.path);
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
        eprintln!("warning: could not remove cgroup {}", self.path.display());
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
        let listener = TcpListener::bind(addr).unwrap_or_else(|e| panic!("backend {name}: bind {addr}: {e}"));
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let udp = UdpSocket::bind(addr).unwrap_or_else(|e| panic!("backend {name}: bind udp {addr}: {e}"));
        udp.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let (accepted, stop, conns) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(HashMap::new())));
        let health_status = Arc::new(AtomicUsize::new(200));
        let last_accept = Arc::new(Mutex::new(None));
        let tcp_thread = {
            let (name, accepted, stop, conns, health_status) = (name.to_owned(), accepted.clone(), stop.clone(), conns.clone(), health_status.clone());
            let last_accept = last_accept.clone();
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            let (name, accepted, conns, health_status) = (name.clone(), accepted.clone(), conns.clone(), health_status.clone());
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
        Self { name: name.to_owned(), addr, accepted, last_accept, health_status, stop, threads: vec![tcp_thread, udp_thread], conns }
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
fn serve(mut stream: TcpStream, name: &str, conns: &Mutex<HashMap<u64, TcpStream>>, health_status: &AtomicUsize, on_client: impl FnOnce()) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut first = String::new();
    if BufReader::new(&stream).read_line(&mut first).is_err() || first.is_empty() {
        return; // a TCP health check: connect and close
    }
    if first.starts_with("GET ") {
        let status = health_status.load(Ordering::Relaxed);
        let _ = write!(stream, "HTTP/1.1 {status} Status\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
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
    Ok { id: u32, peer: SocketAddr, greeting: String },
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
}

/// `lb-test-client` running in a cgroup (or outside any test cgroup).
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
        let bin = std::env::var_os("LB_TEST_CLIENT").map_or_else(|| PathBuf::from(bin), PathBuf::from);
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

    fn ask(&mut self, command: &str) -> String {
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
    pub fn storm(&mut self, addr: SocketAddr, threads: usize, limit: Duration, stop_file: &Path) -> String {
        self.ask(&format!("storm {addr} {threads} {} {}", limit.as_millis(), stop_file.display()))
    }

    pub fn close(&mut self, id: u32) {
        assert_eq!(self.ask(&format!("close {id}")), "closed");
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The daemon under test, with its own config, pins and control socket.
/// On drop it is killed and `lb detach` removes everything it attached.
pub struct Daemon {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub bpffs: PathBuf,
    /// Extra lines for the `[daemon]` section.
    daemon_settings: String,
    child: Option<Child>,
}

impl Daemon {
    /// Writes a config (the `[daemon]` section is added here) and starts
    /// `lb run`; returns once the control socket answers.
    pub fn start(name: &str, cgroup: &TestCgroup, services_toml: &str) -> Self {
        Self::start_with(name, cgroup, "", services_toml)
    }

    /// As `start`, with extra lines for the `[daemon]` section.
    pub fn start_with(name: &str, cgroup: &TestCgroup, daemon_settings: &str, services_toml: &str) -> Self {
        let tag = format!("lb-test-{}-{name}", std::process::id());
        let dir = std::env::temp_dir().join(&tag);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let bpffs = PathBuf::from("/sys/fs/bpf").join(&tag);
        let config = dir.join("config.toml");
        let mut daemon = Self { dir, config, bpffs, daemon_settings: daemon_settings.to_owned(), child: None };
        daemon.write_config(cgroup, services_toml);
        daemon.restart();
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
        assert!(self.child.is_none(), "daemon already running");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("lb.log")).unwrap();
        let child = Command::new(lb_bin())
            .args(["run", "--config"])
            .arg(&self.config)
            .args(args)
            .env("RUST_LOG", "info,lb_user=debug")
            .env("NO_COLOR", "1")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting lb run");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                panic!("lb run exited with {status}:\n{}", self.log());
            }
            if self.try_lb(&["status", "--json"]).is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "lb run did not answer within 60 s:\n{}", self.log());
            thread::sleep(Duration::from_millis(50));
        }
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
        let exited = wait_until(timeout, || self.child.as_mut().is_none_or(|c| c.try_wait().ok().flatten().is_some()));
        if exited {
            self.child = None;
        }
        exited
    }

    /// Sends a signal to the running daemon.
    pub fn signal(&self, signal: i32) {
        let pid = self.child.as_ref().expect("daemon not running").id() as i32;
        // SAFETY: sending a signal has no memory-safety preconditions.
        unsafe { libc::kill(pid, signal) };
    }

    /// Runs an `lb` client subcommand with this daemon's config.
    pub fn try_lb(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(lb_bin()).args(args).arg("--config").arg(&self.config).output().unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    #[track_caller]
    pub fn lb(&self, args: &[&str]) -> String {
        self.try_lb(args).unwrap_or_else(|e| panic!("lb {args:?} failed: {e}\ndaemon log:\n{}", self.log()))
    }

    /// `lb status --json`.
    pub fn status(&self) -> serde_json::Value {
        serde_json::from_str(&self.lb(&["status", "--json"])).unwrap()
    }

    /// Whether this kernel has the optional feature `name` (as
    /// `lb status` reports it). Without it, says the test is skipped and why;
    /// with `LB_TEST_REQUIRE_FEATURES=1` (the host run in CI) that is a failure.
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
        let service = status["services"].as_array().unwrap().iter().find(|s| s["name"] == service).expect("service in status");
        let server = service["servers"].as_array().unwrap().iter().find(|s| s["address"] == server.to_string()).expect("server in status");
        server["connections"].as_i64().unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
        // `lb detach` reads only the paths from the config, so a test that
        // left a broken config behind still cleans up.
        if let Err(e) = self.try_lb(&["detach"]) {
            eprintln!("warning: lb detach failed: {e}");
        }
        let _ = std::fs::remove_dir_all(&self.dir);
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
/// disappears when the body's processes and the thread are gone.
pub fn in_new_netns<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    thread::spawn(move || {
        // SAFETY: unshare(CLONE_NEWNET) affects only this thread.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
        set_loopback_up();
        body()
    })
    .join()
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

fn set_loopback_up() {
    // SAFETY: plain socket/ioctl calls on a zeroed, correctly sized ifreq.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        assert!(fd >= 0);
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        assert_eq!(libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut ifr), 0);
        ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        assert_eq!(libc::ioctl(fd, libc::SIOCSIFFLAGS, &mut ifr), 0, "bringing lo up: {}", std::io::Error::last_os_error());
        libc::close(fd);
    }
}
