//! The routes a connection can take, and what is at their ends.
//!
//! Addresses (loopback only):
//! - `127.78.0.1`: the origins: nginx serving a small HTTP response (the wrk
//!   workloads), a Rust sink that accepts and closes (connect + close) and a
//!   Rust source that sends 1 GiB (bulk);
//! - `127.78.0.2`: haproxy, mode tcp, one `listen` per origin;
//! - `127.78.0.3`: nginx, `stream` module, one `server` per origin;
//! - `127.78.0.100`: lb's VIPs, ports 80 (nginx origin), 81 (sink), 82 (source).
//!
//! The proxies are configured as node-local proxies in front of an
//! apiserver are (kubespray's haproxy and nginx-proxy: tcp mode, least
//! connections, an upstream per port, no health checks here), with the
//! packages' defaults otherwise. Each runs in the foreground (`haproxy
//! -db`, nginx `daemon off`) on the paths part's one CPU (`paths_cpu`;
//! haproxy then starts one thread, nginx still its two workers) with its
//! config, pid, logs and temp files under `target/bench/`, in a process
//! group of its own, and is stopped by its guard ([`Proc`]).

use std::{
    io::Write as _,
    net::{SocketAddr, TcpListener, TcpStream},
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{
    host::{free_port, paths_cpu, set_affinity, start_on_cpu},
    limits::check_stop,
};

pub const ORIGIN_IP: [u8; 4] = [127, 78, 0, 1];
const HAPROXY_IP: [u8; 4] = [127, 78, 0, 2];
const NGINX_IP: [u8; 4] = [127, 78, 0, 3];
pub const VIP_IP: [u8; 4] = [127, 78, 0, 100];
/// Bytes per bulk transfer.
pub const BULK: u64 = 1 << 30;

/// Debian packages the paths part needs (the stream module is a package of
/// its own; bpftool reads the kernel programs' run counts and times).
const PACKAGES: [&str; 5] = ["wrk", "haproxy", "nginx", "libnginx-mod-stream", "bpftool"];

/// Installs what is missing of [`PACKAGES`], as the tests install what
/// they need. Only adds packages. The packages' own services are never
/// used (nor started by the bench): it runs its own processes.
pub fn ensure_packages() -> anyhow::Result<()> {
    crate::cmd::install_missing_packages(&PACKAGES)
}

/// `haproxy -v`, `nginx -v`, `wrk -v`: the first line each prints.
pub fn versions() -> Vec<(String, String)> {
    [("haproxy", "-v"), ("nginx", "-v"), ("wrk", "-v")]
        .into_iter()
        .map(|(tool, flag)| {
            let text = Command::new(tool).arg(flag).output().map_or_else(
                |e| format!("not runnable: {e}"),
                |out| {
                    let all = format!(
                        "{}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                    all.lines().next().unwrap_or("").trim().to_owned()
                },
            );
            (tool.to_owned(), text)
        })
        .collect()
}

/// A way from a client to an origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// Client outside the attached cgroup, to the origin.
    Direct,
    /// Client inside the attached cgroup, to the origin (not a VIP): what the
    /// programs cost connects they leave alone.
    Cgroup,
    /// Client inside the attached cgroup, to lb's VIP.
    Vip,
    /// Client outside, to haproxy in front of the origin.
    Haproxy,
    /// Client outside, to nginx (stream) in front of the origin.
    Nginx,
}

impl Route {
    pub const ALL: [Self; 5] = [Self::Direct, Self::Cgroup, Self::Vip, Self::Haproxy, Self::Nginx];

    pub const fn label(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Cgroup => "direct, in the cgroup",
            Self::Vip => "lb VIP",
            Self::Haproxy => "haproxy (tcp)",
            Self::Nginx => "nginx (stream)",
        }
    }

    /// Whether the client runs inside the attached cgroup.
    pub const fn in_cgroup(self) -> bool {
        matches!(self, Self::Cgroup | Self::Vip)
    }

    /// The address a client on this route connects to for `origin`
    /// (`origin` is the origin's own address, on [`ORIGIN_IP`]); the VIP
    /// ports are the origins' rank (0: http, 1: sink, 2: source) plus 80.
    pub fn target(self, origin: SocketAddr, rank: u16) -> SocketAddr {
        let ip = match self {
            Self::Direct | Self::Cgroup => return origin,
            Self::Vip => return SocketAddr::from((VIP_IP, 80 + rank)),
            Self::Haproxy => HAPROXY_IP,
            Self::Nginx => NGINX_IP,
        };
        SocketAddr::from((ip, origin.port()))
    }
}

/// The Rust origins, in this process for the whole run: the sink
/// (connect + close) and the source (bulk).
pub struct Origins {
    pub sink: Sink,
    pub source: SocketAddr,
}

impl Origins {
    pub fn start() -> anyhow::Result<Self> {
        Ok(Self { sink: Sink::start()?, source: start_source()? })
    }
}

/// Accepts connections and closes them at once, counting them.
pub struct Sink {
    pub addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
}

impl Sink {
    fn start() -> anyhow::Result<Self> {
        let listener =
            TcpListener::bind(SocketAddr::from((ORIGIN_IP, 0))).context("binding the sink")?;
        let addr = listener.local_addr()?;
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        spawn_on_paths_cpu("the sink", move || {
            for stream in listener.incoming() {
                if stream.is_ok() {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
        })?;
        Ok(Self { addr, accepted })
    }

    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }
}

/// A server that sends [`BULK`] bytes on every connection, then closes it.
fn start_source() -> anyhow::Result<SocketAddr> {
    let listener =
        TcpListener::bind(SocketAddr::from((ORIGIN_IP, 0))).context("binding the source")?;
    let addr = listener.local_addr()?;
    // Each connection's thread inherits the listener thread's CPU.
    spawn_on_paths_cpu("the source", move || {
        for mut stream in listener.incoming().filter_map(Result::ok) {
            thread::spawn(move || {
                let chunk = vec![0x5au8; 256 << 10];
                let mut left = BULK;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    if stream.write_all(&chunk[..n]).is_err() {
                        return;
                    }
                    left -= n as u64;
                }
            });
        }
    })?;
    Ok(addr)
}

/// Runs `serve` on a thread of its own, on the paths part's one CPU
/// ([`paths_cpu`]); the threads it starts inherit that CPU. The
/// thread ends with the process.
fn spawn_on_paths_cpu(what: &str, serve: impl FnOnce() + Send + 'static) -> anyhow::Result<()> {
    let cpu = paths_cpu()?;
    let (pinned_tx, pinned) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let pinning = set_affinity(&[cpu]);
        let ok = pinning.is_ok();
        let _ = pinned_tx.send(pinning);
        if ok {
            serve();
        }
    });
    pinned
        .recv()
        .with_context(|| format!("{what}'s thread ended"))?
        .with_context(|| format!("pinning {what} to CPU {cpu}"))
}

/// A server that answers every connection with its name (one line) and
/// closes it; can be killed (its listener closed: connects are refused) and
/// started again on the same address.
pub struct Who {
    pub name: String,
    pub addr: SocketAddr,
    running: Option<(Arc<AtomicBool>, i32, JoinHandle<()>)>,
}

impl Who {
    pub fn start(name: &str, addr: SocketAddr) -> anyhow::Result<Self> {
        let mut who = Self { name: name.to_owned(), addr, running: None };
        who.restart()?;
        Ok(who)
    }

    /// Listens again (on the same address once it was bound).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(2);
        let listener = loop {
            match TcpListener::bind(self.addr) {
                Ok(l) => break l,
                Err(e) if Instant::now() > deadline => {
                    return Err(e).with_context(|| format!("binding {} again", self.addr));
                }
                Err(_) => thread::sleep(Duration::from_millis(5)),
            }
        };
        self.addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let fd = listener.as_raw_fd();
        let line = format!("{}\n", self.name);
        let stopped = stop.clone();
        let thread = thread::spawn(move || {
            for stream in listener.incoming() {
                if stopped.load(Ordering::Relaxed) {
                    break;
                }
                if let Ok(mut stream) = stream {
                    let _ = stream.write_all(line.as_bytes());
                }
            }
        });
        self.running = Some((stop, fd, thread));
        Ok(())
    }

    /// Closes the listener: from now on connects to it are refused.
    pub fn kill(&mut self) {
        if let Some((stop, fd, thread)) = self.running.take() {
            stop.store(true, Ordering::Relaxed);
            // Takes the socket out of LISTEN at once (new SYNs get a reset)
            // and wakes the blocked accept; the thread then drops it.
            // SAFETY: `fd` is the listener the thread still owns.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            let _ = thread.join();
        }
    }
}

impl Drop for Who {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A server process the bench started (nginx, haproxy), in a process group
/// of its own. On drop: SIGTERM to the group, up to 3 s to exit, then
/// SIGKILL to whatever of the group is left (nginx workers included).
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    /// Starts `cmd` on the paths part's one CPU (its threads and worker
    /// processes inherit it).
    fn spawn(name: &str, cmd: &mut Command, log: &Path) -> anyhow::Result<Self> {
        start_on_cpu(cmd, paths_cpu()?);
        let file =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {}", crate::cmd::describe(cmd)))?;
        Ok(Self { name: name.to_owned(), child, log: log.to_owned() })
    }

    /// Waits until every one of `addrs` accepts a connection.
    fn wait_listening(&mut self, addrs: &[SocketAddr]) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        for addr in addrs {
            while TcpStream::connect_timeout(addr, Duration::from_millis(200)).is_err() {
                if self.exited() || Instant::now() > deadline {
                    let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                    bail!(
                        "{} does not listen on {addr}; its log ({}):\n{log}",
                        self.name,
                        self.log.display()
                    );
                }
                check_stop()?;
                thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Whether the process has exited (left as a zombie, not reaped, so its
    /// id and group id stay ours until [`Drop`]).
    fn exited(&self) -> bool {
        // SAFETY: siginfo_t is plain data, for which all zeroes is valid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid fills the struct we pass; WNOWAIT leaves the child
        // to be reaped later.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                self.child.id(),
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        // SAFETY: si_pid is set by waitid (0 when the child still runs).
        rc != 0 || unsafe { info.si_pid() } != 0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let group = self.child.id() as i32;
        // SAFETY: signals to the group this guard's child leads; its id
        // cannot be reused before the child is reaped below.
        unsafe { libc::kill(-group, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(3);
        while !self.exited() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: as above; the leader, even exited, is not reaped yet.
        unsafe { libc::kill(-group, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// The origins and proxies of the paths part, with the ports that the
/// routes use (the same port on each proxy's address as on the origin's).
pub struct Servers {
    pub http: SocketAddr,
    pub sink: SocketAddr,
    pub source: SocketAddr,
    // Dropped in reverse order of start: proxies first.
    _procs: Vec<Proc>,
}

impl Servers {
    /// Starts the nginx origin, then haproxy and nginx in front of the
    /// three origins.
    pub fn start(dir: &Path, origins: &Origins) -> anyhow::Result<Self> {
        let http = SocketAddr::from((ORIGIN_IP, free_port(ORIGIN_IP)?));
        let upstreams = [("http", http), ("sink", origins.sink.addr), ("source", origins.source)];
        let mut procs = Vec::new();

        let origin_dir = dir.join("nginx-origin");
        std::fs::create_dir_all(origin_dir.join("tmp"))?;
        let conf = origin_dir.join("nginx.conf");
        std::fs::write(&conf, nginx_origin_conf(&origin_dir, http))?;
        let mut origin = Proc::spawn(
            "nginx (origin)",
            &mut nginx(&origin_dir, &conf),
            &origin_dir.join("stdout.log"),
        )?;
        origin.wait_listening(&[http])?;
        procs.push(origin);

        let haproxy_dir = dir.join("haproxy");
        std::fs::create_dir_all(&haproxy_dir)?;
        let conf = haproxy_dir.join("haproxy.cfg");
        std::fs::write(&conf, haproxy_conf(&upstreams))?;
        let mut haproxy = Proc::spawn(
            "haproxy",
            Command::new("haproxy").arg("-db").arg("-f").arg(&conf),
            &haproxy_dir.join("haproxy.log"),
        )?;
        haproxy.wait_listening(&upstreams.map(|(_, a)| Route::Haproxy.target(a, 0)))?;
        procs.push(haproxy);

        let proxy_dir = dir.join("nginx-proxy");
        std::fs::create_dir_all(&proxy_dir)?;
        let conf = proxy_dir.join("nginx.conf");
        std::fs::write(&conf, nginx_stream_conf(&proxy_dir, &stream_module()?, &upstreams))?;
        let mut proxy = Proc::spawn(
            "nginx (stream)",
            &mut nginx(&proxy_dir, &conf),
            &proxy_dir.join("stdout.log"),
        )?;
        proxy.wait_listening(&upstreams.map(|(_, a)| Route::Nginx.target(a, 0)))?;
        procs.push(proxy);

        procs.reverse();
        Ok(Self { http, sink: origins.sink.addr, source: origins.source, _procs: procs })
    }
}

/// nginx in the foreground with its own prefix, config and error log (the
/// compiled-in paths under /var are never opened).
fn nginx(prefix: &Path, conf: &Path) -> Command {
    let mut cmd = Command::new("nginx");
    cmd.arg("-p")
        .arg(prefix)
        .arg("-e")
        .arg(prefix.join("error.log"))
        .arg("-c")
        .arg(conf)
        .args(["-g", "daemon off;"]);
    cmd
}

fn stream_module() -> anyhow::Result<PathBuf> {
    let candidates = [
        "/usr/lib/nginx/modules/ngx_stream_module.so",
        "/usr/share/nginx/modules/ngx_stream_module.so",
    ];
    if let Some(found) = candidates.iter().map(PathBuf::from).find(|p| p.exists()) {
        return Ok(found);
    }
    let listing = Command::new("dpkg")
        .args(["-L", "libnginx-mod-stream"])
        .output()
        .context("dpkg -L libnginx-mod-stream")?;
    String::from_utf8_lossy(&listing.stdout)
        .lines()
        .find(|l| l.ends_with("/ngx_stream_module.so"))
        .map(PathBuf::from)
        .context("ngx_stream_module.so not found (package libnginx-mod-stream)")
}

/// The origin: a small static answer, as fast as nginx serves anything.
fn nginx_origin_conf(dir: &Path, listen: SocketAddr) -> String {
    let tmp = dir.join("tmp");
    let d = dir.display();
    let t = tmp.display();
    format!(
        "# Written by `cargo xtask bench`: the HTTP origin of the wrk workloads.\n\
         worker_processes auto;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  keepalive_requests 1000000;\n\
         \x20 client_body_temp_path {t}/body;\n  proxy_temp_path {t}/proxy;\n  fastcgi_temp_path {t}/fastcgi;\n\
         \x20 uwsgi_temp_path {t}/uwsgi;\n  scgi_temp_path {t}/scgi;\n\
         \x20 server {{\n    listen {listen};\n    location / {{ default_type text/plain; return 200 \"ok\\n\"; }}\n  }}\n}}\n"
    )
}

/// haproxy as kubespray configures it on every node (mode tcp, leastconn),
/// without its health checks.
fn haproxy_conf(upstreams: &[(&str, SocketAddr)]) -> String {
    let mut text = String::from(
        "# Written by `cargo xtask bench`: haproxy as a node-local TCP proxy.\n\
         global\n    maxconn 4000\n\
         defaults\n    mode tcp\n    timeout connect 5s\n    timeout client 1h\n    timeout server 1h\n",
    );
    for (name, addr) in upstreams {
        text += &format!(
            "listen {name}\n    bind {}\n    balance leastconn\n    server {name} {addr}\n",
            Route::Haproxy.target(*addr, 0)
        );
    }
    text
}

/// nginx as kubespray's nginx-proxy configures it (stream, least_conn).
fn nginx_stream_conf(dir: &Path, module: &Path, upstreams: &[(&str, SocketAddr)]) -> String {
    let d = dir.display();
    let mut text = format!(
        "# Written by `cargo xtask bench`: nginx as a node-local TCP proxy.\n\
         load_module {};\nworker_processes auto;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 4096; }}\nstream {{\n",
        module.display()
    );
    for (name, addr) in upstreams {
        text += &format!(
            "  upstream {name} {{ least_conn; server {addr}; }}\n  server {{ listen {}; proxy_pass {name}; proxy_timeout 10m; proxy_connect_timeout 1s; }}\n",
            Route::Nginx.target(*addr, 0)
        );
    }
    text + "}\n"
}
