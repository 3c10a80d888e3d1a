//! Real DNS software for the UDP tests: dnsmasq (Debian's `dnsmasq-base`)
//! as the DNS servers behind a VIP, and three resolvers, each run inside
//! the test cgroup, in a mount namespace of its own whose
//! `/etc/resolv.conf` names only the VIP:
//! - glibc's, through `getent hosts` (a connected UDP socket);
//! - bind9's `dig` (`bind9-dnsutils`);
//! - musl's, through a static musl binary (`tests/musl/resolve.c`, built by
//!   `tests/build.rs` with `musl-tools`): `sendto()` on an unconnected
//!   socket, and only answers from the address it asked count.
//!
//! Each server answers `web.lb.test` with an address of its own, so an
//! answer says which server gave it.

use std::{
    fs,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use crate::{TestCgroup, cgroup::start_in_cgroup, wait_until};

/// The name the servers answer.
pub const NAME: &str = "web.lb.test";

/// The static musl resolver, if `musl-gcc` was there at build time.
const MUSL_RESOLVE: Option<&str> = option_env!("LB_MUSL_RESOLVE");

/// What the resolver tests need and this machine lacks, by package.
pub fn missing_tools() -> Vec<&'static str> {
    let mut missing = Vec::new();
    for (tool, package) in
        [("dnsmasq", "dnsmasq-base"), ("dig", "bind9-dnsutils"), ("getent", "libc-bin")]
    {
        let found = Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            missing.push(package);
        }
    }
    if MUSL_RESOLVE.is_none() {
        missing.push("musl-tools");
    }
    missing
}

/// Whether the resolver tests can run: they are skipped with a printed
/// reason when a tool is missing, except with `LB_TEST_REQUIRE_FEATURES=1`
/// (`cargo xtask test` installs them), where that is a failure.
pub fn resolvers_present() -> bool {
    let missing = missing_tools();
    if missing.is_empty() {
        return true;
    }
    if std::env::var("LB_TEST_REQUIRE_FEATURES").is_ok_and(|v| v == "1") {
        panic!(
            "the resolver tests need {}, and LB_TEST_REQUIRE_FEATURES=1 forbids skipping",
            missing.join(" ")
        );
    }
    eprintln!("SKIPPED: the resolver tests need {} (Debian packages)", missing.join(" "));
    false
}

/// A dnsmasq process serving DNS on one address; killed on drop.
pub struct Dnsmasq {
    child: Option<Child>,
    /// Where it listens (UDP and TCP).
    pub addr: SocketAddr,
    /// What it answers for [`NAME`].
    pub answer: Ipv4Addr,
}

impl Dnsmasq {
    /// Starts dnsmasq on `addr`, answering [`NAME`] with `answer` and
    /// refusing everything else (it has no upstream); returns once it
    /// answers.
    pub fn start(addr: SocketAddr, answer: Ipv4Addr) -> Self {
        Self::spawn(addr, answer, &format!("--address=/{NAME}/{answer}"))
    }

    /// Starts dnsmasq on `addr` as a forwarding proxy without a cache: it
    /// asks `upstream` (a [`Dnsmasq::start`] answering `answer`) for every
    /// query. What a node-local DNS proxy does, for the bench.
    pub fn forwarder(addr: SocketAddr, upstream: SocketAddr, answer: Ipv4Addr) -> Self {
        Self::spawn(addr, answer, &format!("--server={}#{}", upstream.ip(), upstream.port()))
    }

    fn spawn(addr: SocketAddr, answer: Ipv4Addr, role: &str) -> Self {
        let child = Command::new("dnsmasq")
            .args([
                "--keep-in-foreground",
                "--conf-file",
                "--pid-file",
                "--no-resolv",
                "--no-hosts",
                "--no-poll",
                "--bind-interfaces",
                "--cache-size=0",
                "--log-facility=-",
            ])
            .arg(format!("--listen-address={}", addr.ip()))
            .arg(format!("--port={}", addr.port()))
            .arg(role)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting dnsmasq");
        let server = Self { child: Some(child), addr, answer };
        assert!(
            wait_until(Duration::from_secs(10), || dig_direct(addr).as_deref()
                == Ok(&answer.to_string())),
            "dnsmasq on {addr} does not answer"
        );
        server
    }

    /// Kills it (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Asks `server` directly, from outside the test cgroup.
fn dig_direct(server: SocketAddr) -> Result<String, String> {
    let out = Command::new("dig")
        .args(["+short", "+tries=1", "+time=1", "-p", &server.port().to_string()])
        .arg(format!("@{}", server.ip()))
        .arg(NAME)
        .output()
        .map_err(|e| format!("dig: {e}"))?;
    first_line(&out.stdout).ok_or_else(|| String::from_utf8_lossy(&out.stderr).into_owned())
}

fn first_line(bytes: &[u8]) -> Option<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .next()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
}

/// A resolver of the tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolver {
    /// glibc: `getent hosts` (nss `dns`; `gethostbyname2`, AAAA then A).
    /// Not `getent ahosts`: getaddrinfo's `AI_ADDRCONFIG` finds no IPv4
    /// lookup worth making on a machine with loopback alone (the VMs).
    Glibc,
    /// bind9's `dig`.
    Dig,
    /// musl's `getaddrinfo`, in a static binary.
    Musl,
}

impl Resolver {
    /// Every resolver.
    pub const ALL: [Resolver; 3] = [Resolver::Glibc, Resolver::Dig, Resolver::Musl];
}

/// A directory with the `resolv.conf` and `nsswitch.conf` the resolvers
/// see; removed on drop.
pub struct ResolverEnv {
    dir: PathBuf,
}

impl ResolverEnv {
    /// Files naming `nameserver` alone (`name` makes the directory unique).
    pub fn new(name: &str, nameserver: IpAddr) -> Self {
        let dir =
            std::env::temp_dir().join(format!("lb-test-resolv-{name}-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("creating the resolver directory");
        // Short timeouts: a resolver that gets no answer fails in seconds.
        fs::write(
            dir.join("resolv.conf"),
            format!("nameserver {nameserver}\noptions timeout:1 attempts:2\n"),
        )
        .expect("writing resolv.conf");
        fs::write(dir.join("nsswitch.conf"), "hosts: dns\n").expect("writing nsswitch.conf");
        Self { dir }
    }

    /// Runs `resolver` for [`NAME`] inside `cgroup`, with these files as
    /// `/etc/resolv.conf` and `/etc/nsswitch.conf` (bind mounts in a
    /// mount namespace of its own): the address it found, or what it said.
    pub fn resolve(&self, resolver: Resolver, cgroup: &TestCgroup) -> Result<String, String> {
        let program: Vec<String> = match resolver {
            Resolver::Glibc => vec!["getent".into(), "hosts".into(), NAME.into()],
            Resolver::Dig => {
                // dig reads resolv.conf too; +search off, one try.
                ["dig", "+short", "+tries=2", "+time=1", NAME].map(String::from).to_vec()
            }
            Resolver::Musl => vec![MUSL_RESOLVE.expect("resolvers_present()").into(), NAME.into()],
        };
        let script = format!(
            "mount --bind {} /etc/resolv.conf && mount --bind {} /etc/nsswitch.conf && exec \"$@\"",
            self.dir.join("resolv.conf").display(),
            self.dir.join("nsswitch.conf").display()
        );
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "private", "sh", "-c", &script, "resolver"])
            .args(&program)
            .stdin(Stdio::null());
        start_in_cgroup(&mut cmd, &cgroup.path);
        let out = cmd.output().map_err(|e| format!("running {program:?}: {e}"))?;
        // getent prints "ADDRESS  NAME"; the others the address alone.
        let found = first_line(&out.stdout)
            .and_then(|line| line.split_whitespace().next().map(str::to_owned));
        match found {
            Some(address) if out.status.success() => Ok(address),
            _ => Err(format!(
                "{resolver:?} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )),
        }
    }

    /// The directory (for a test's messages).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for ResolverEnv {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}
