//! The configuration file (TOML): parsing, defaults and validation.
//!
//! Every error names the file, the key and what is wrong. Validation never
//! touches the kernel, so `lb check-config` and a reload can run it safely.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use lb_common::{MAX_SERVERS, MAX_SERVICES};
use serde::Deserialize;
use toml::Spanned;

mod reparse;
pub use reparse::{Read, Source};

/// The config file when `--config` is not given.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/lb/config.toml";
/// `daemon.bpffs`: where the programs and maps are pinned.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/lb";
/// `daemon.control_socket`.
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/lb/lb.sock";
/// `daemon.state_dir`: server lists set at runtime, kept across restarts.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/lb";
/// A service's `hold_down`.
pub const DEFAULT_HOLD_DOWN: Duration = Duration::from_secs(5);
/// How long discovery waits for a burst of changes to settle (an apiserver
/// adds, removes and re-adds itself while it starts): short enough that a
/// rolling update still moves within about a second.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_secs(1);
/// Bounds of DNS re-resolution: the records' TTL, clamped to these.
pub const DEFAULT_DNS_REFRESH_MIN: Duration = Duration::from_secs(5);
/// See [`DEFAULT_DNS_REFRESH_MIN`].
pub const DEFAULT_DNS_REFRESH_MAX: Duration = Duration::from_secs(300);

/// A validated configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The `[daemon]` table.
    pub daemon: Daemon,
    /// The `[[service]]` tables, in the file's order.
    pub services: Vec<Service>,
}

/// The `[daemon]` table: where the daemon attaches, pins and listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Daemon {
    /// cgroup v2 directory to attach to; `None`: the root of the cgroup2 mount.
    pub cgroup: Option<PathBuf>,
    /// Where the programs and maps are pinned (on a BPF filesystem).
    pub bpffs: PathBuf,
    /// The control socket of `lb status` and the other client commands.
    pub control_socket: PathBuf,
    /// Where server lists set at runtime are kept across restarts.
    pub state_dir: PathBuf,
    /// Where to serve Prometheus metrics; off when `None`.
    pub metrics: Option<SocketAddr>,
    /// The kubeconfig for Kubernetes discovery; `None`: in-cluster (the
    /// pod's service account), when any service uses it.
    pub kubeconfig: Option<PathBuf>,
}

/// How a service spreads its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// One server at a time: the first usable one.
    Failover,
    /// Every usable server, chosen at random per connection.
    Spread,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Failover => "failover",
            Self::Spread => "spread",
        })
    }
}

/// One `[[service]]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    /// Unique in the file; names the service in commands, status and metrics.
    pub name: String,
    /// The address clients connect to.
    pub vip: SocketAddr,
    /// The servers, in order of preference.
    pub servers: Vec<SocketAddr>,
    /// The server preferred while healthy, if any (a last resort when it is
    /// not in `servers`).
    pub default: Option<SocketAddr>,
    /// How connections spread over the servers.
    pub policy: Policy,
    /// How long the kernel skips a server after a connect to it failed.
    pub hold_down: Duration,
    /// The `[service.health]` table.
    pub health: HealthConfig,
    /// Where the server list comes from besides `servers` (which are then
    /// the bootstrap list); `None`: only `servers` and `lb servers`.
    pub discovery: Option<Discovery>,
    /// Whose connects to the VIP are rewritten.
    pub scope: Scope,
}

/// Whose connects to a VIP are rewritten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Only sockets in the daemon's network namespace: a pod dialling its
    /// own loopback reaches its own loopback. The default for loopback VIPs.
    Host,
    /// Sockets in every network namespace of the attached cgroups: for a
    /// VIP that pods must reach too. The default for other VIPs.
    All,
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Host => "host",
            Self::All => "all",
        })
    }
}

/// A source of a service's server list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Discovery {
    /// The endpoints of a Kubernetes Service (its EndpointSlices), per
    /// endpoint and its conditions.
    Kubernetes {
        /// The Service's namespace.
        namespace: String,
        /// The Service's name.
        service: String,
        /// Which of its ports the servers listen on.
        port: PortRef,
        /// How long a burst of changes settles before it applies.
        debounce: Duration,
    },
    /// The A (IPv4 VIP) or AAAA (IPv6 VIP) records of `name`, re-resolved
    /// at their TTL clamped to `refresh_min..=refresh_max`.
    Dns {
        /// The name to resolve.
        name: String,
        /// The port of every server found.
        port: u16,
        /// How long a burst of changes settles before it applies.
        debounce: Duration,
        /// The shortest time between two resolutions.
        refresh_min: Duration,
        /// The longest time between two resolutions.
        refresh_max: Duration,
    },
}

/// A Service port, by name (`"https"`) or number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortRef {
    /// The port's name in the Service (and its EndpointSlices).
    Name(String),
    /// The port number.
    Number(u16),
}

/// What a health check does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckKind {
    /// A TCP connect.
    Tcp,
    /// An HTTP GET of `path`; a status in `status` passes.
    Http,
    /// The same over TLS.
    Https,
    /// No active check: the kernel's connection reports are the only signal.
    None,
}

/// The `[service.health]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthConfig {
    /// What a check does.
    pub check: CheckKind,
    /// The path an HTTP(S) check gets.
    pub path: String,
    /// Time between two checks of a server.
    pub interval: Duration,
    /// How long one check may take before it fails.
    pub timeout: Duration,
    /// Passes in a row that make a server usable again.
    pub rise: u32,
    /// Failures in a row that make a server failed.
    pub fall: u32,
    /// Passing HTTP statuses, inclusive.
    pub status: (u16, u16),
    /// CA bundle to verify HTTPS servers with; the system's when `None`.
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for HTTPS checks, with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// Client key (PEM) of `cert_file`.
    pub key_file: Option<PathBuf>,
    /// TLS server name to verify instead of the server's IP address.
    pub server_name: Option<String>,
    /// Do not verify HTTPS servers' certificates at all.
    pub insecure_skip_verify: bool,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            check: CheckKind::Tcp,
            path: "/".to_owned(),
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            rise: 1,
            fall: 1,
            status: (200, 399),
            ca_file: None,
            cert_file: None,
            key_file: None,
            server_name: None,
            insecure_skip_verify: false,
        }
    }
}

/// One thing wrong with a config file: where (line, when known) and under
/// which key, and what. Collected while parsing and rendered once, by
/// [`ConfigError`], as `FILE:LINE: KEY: WHAT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line of the value, when the parser knows it.
    pub line: Option<usize>,
    /// The key, e.g. `service[0] ("api"): servers[1]`; empty for the file
    /// as a whole.
    pub key: String,
    /// What is wrong, and what would be right.
    pub what: String,
}

impl Problem {
    fn new(line: Option<usize>, key: impl fmt::Display, what: impl fmt::Display) -> Self {
        Self { line, key: key.to_string(), what: what.to_string() }
    }
}

/// A [`Problem`]'s key (`service[3] ("api"): health.interval`,
/// `daemon.metrics`), kept as its parts and written out only for a problem:
/// almost every value has none, and a config may hold 16,384 services.
#[derive(Clone, Copy)]
struct Key<'a> {
    /// The service's index and name, if the key is in one.
    service: Option<(usize, &'a str)>,
    /// The table, with its dot (`health.`), or "".
    table: &'a str,
    name: &'a str,
    /// The element, in a list (`servers[2]`).
    index: Option<usize>,
}

impl<'a> Key<'a> {
    /// A key outside services (`daemon.metrics`).
    const fn top(name: &'a str) -> Self {
        Self { service: None, table: "", name, index: None }
    }

    /// The `i`th service, named `name`.
    const fn service(i: usize, name: &'a str) -> Self {
        Self { service: Some((i, name)), table: "", name: "", index: None }
    }

    /// Key `name`, in this key's service and table.
    const fn at(self, name: &'a str) -> Self {
        Self { name, index: None, ..self }
    }

    /// The keys of `table` (with its dot), in this key's service.
    const fn table(self, table: &'a str) -> Self {
        Self { table, name: "", index: None, ..self }
    }

    /// Element `index` of this key's list.
    const fn nth(self, index: usize) -> Self {
        Self { index: Some(index), ..self }
    }
}

impl fmt::Display for Key<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((i, name)) = self.service {
            write!(f, "service[{i}] ({name:?})")?;
            if self.table.is_empty() && self.name.is_empty() {
                return Ok(());
            }
            f.write_str(": ")?;
        }
        write!(f, "{}{}", self.table, self.name)?;
        if let Some(index) = self.index {
            write!(f, "[{index}]")?;
        }
        Ok(())
    }
}

/// A configuration error: one or more problems in one file.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    /// The config file.
    pub file: PathBuf,
    /// Everything wrong with it, in the file's order.
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let file = self.file.display();
        for (i, Problem { line, key, what }) in self.problems.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            match line {
                Some(line) => write!(f, "{file}:{line}: ")?,
                None => write!(f, "{file}: ")?,
            }
            if !key.is_empty() {
                write!(f, "{key}: ")?;
            }
            f.write_str(what)?;
        }
        Ok(())
    }
}

impl ConfigError {
    fn unreadable(path: &Path, error: &std::io::Error) -> Self {
        Self {
            file: path.to_owned(),
            problems: vec![Problem::new(None, "", format!("cannot read the config file: {error}"))],
        }
    }
}

/// Where in a server set a [`ServerProblem`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// `servers[i]`.
    Server(usize),
    /// `default`.
    Default,
    /// The set as a whole.
    Set,
}

/// Why a server list (with its default) cannot serve a VIP. The same rules
/// and words for the config file, `lb servers`, the state file and
/// discovered lists: [`check_servers`] is the one place they are decided.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ServerProblem {
    /// A server without a port.
    #[error("{0} has port 0")]
    PortZero(SocketAddr),
    /// A server at 0.0.0.0 or `::`.
    #[error("{0} is the unspecified address")]
    Unspecified(SocketAddr),
    /// The same server twice.
    #[error("{0} is listed twice")]
    Duplicate(SocketAddr),
    /// A server of the other address family than the VIP.
    #[error(
        "{addr} is {} but the VIP {vip} is {}; a socket dialling the VIP cannot reach it",
        family(addr),
        family(vip)
    )]
    Family {
        /// The server.
        addr: SocketAddr,
        /// The service's VIP.
        vip: SocketAddr,
    },
    /// A server that is some service's VIP.
    #[error("{addr} is the VIP of {owner}; using it as a server would loop")]
    IsVip {
        /// The server.
        addr: SocketAddr,
        /// The service whose VIP it is.
        owner: String,
    },
    /// More servers than the kernel's selection holds.
    #[error("{count} servers (with the default), at most {MAX_SERVERS} are supported")]
    TooMany {
        /// How many there are, with the default.
        count: usize,
    },
}

/// Checks a server list and default for the service at `vip`.
/// `vip_owner(addr)` names the service whose VIP `addr` is, if any.
pub fn check_servers(
    vip: SocketAddr,
    servers: &[SocketAddr],
    default: Option<SocketAddr>,
    vip_owner: impl Fn(SocketAddr) -> Option<String>,
) -> Vec<(Slot, ServerProblem)> {
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    let slots = servers
        .iter()
        .enumerate()
        .map(|(i, a)| (Slot::Server(i), *a))
        .chain(default.map(|d| (Slot::Default, d)));
    for (slot, addr) in slots {
        if addr.port() == 0 {
            problems.push((slot, ServerProblem::PortZero(addr)));
        } else if addr.ip().is_unspecified() {
            problems.push((slot, ServerProblem::Unspecified(addr)));
        } else if addr.is_ipv4() != vip.is_ipv4() {
            problems.push((slot, ServerProblem::Family { addr, vip }));
        } else if let Some(owner) = vip_owner(addr) {
            problems.push((slot, ServerProblem::IsVip { addr, owner }));
        }
        // The default may also be in the list; a server twice may not.
        if !seen.insert(addr) && slot != Slot::Default {
            problems.push((slot, ServerProblem::Duplicate(addr)));
        }
    }
    if seen.len() > MAX_SERVERS {
        problems.push((Slot::Set, ServerProblem::TooMany { count: seen.len() }));
    }
    problems
}

/// [`check_servers`] as one error for a request or a file that is not the
/// config (`lb servers`, the state file): the problems joined by "; ".
pub fn validate_servers(
    vip: SocketAddr,
    servers: &[SocketAddr],
    default: Option<SocketAddr>,
    vip_owner: impl Fn(SocketAddr) -> Option<String>,
) -> Result<(), String> {
    let problems = check_servers(vip, servers, default, vip_owner);
    if problems.is_empty() {
        return Ok(());
    }
    let words: Vec<String> = problems
        .iter()
        .map(|(slot, problem)| match slot {
            Slot::Server(i) => format!("servers[{i}]: {problem}"),
            Slot::Default => format!("default: {problem}"),
            Slot::Set => format!("servers: {problem}"),
        })
        .collect();
    Err(words.join("; "))
}

// The file as written. Unknown keys are errors: a typo must not silently
// fall back to a default.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    daemon: RawDaemon,
    #[serde(default)]
    service: Vec<Spanned<RawService>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDaemon {
    cgroup: Option<PathBuf>,
    bpffs: Option<PathBuf>,
    control_socket: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    metrics: Option<String>,
    kubeconfig: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawService {
    name: Spanned<String>,
    vip: Spanned<String>,
    servers: Option<Spanned<Vec<Spanned<String>>>>,
    default: Option<Spanned<String>>,
    policy: Option<Spanned<String>>,
    hold_down: Option<Spanned<String>>,
    health: Option<Spanned<RawHealth>>,
    discovery: Option<Spanned<RawDiscovery>>,
    scope: Option<Spanned<String>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDiscovery {
    kubernetes: Option<RawKubernetes>,
    dns: Option<RawDns>,
    debounce: Option<String>,
    refresh_min: Option<String>,
    refresh_max: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKubernetes {
    namespace: String,
    service: String,
    port: RawPort,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawPort {
    Number(i64),
    Name(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDns {
    name: String,
    port: i64,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHealth {
    check: Option<String>,
    path: Option<String>,
    interval: Option<String>,
    timeout: Option<String>,
    rise: Option<u32>,
    fall: Option<u32>,
    status: Option<String>,
    ca_file: Option<PathBuf>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    server_name: Option<String>,
    insecure_skip_verify: Option<bool>,
}

/// The paths a client subcommand needs (control socket, pins), read
/// leniently: `lb reload` and `lb detach` must work even when the file on
/// disk has just been broken (that is when an operator needs them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientPaths {
    /// `daemon.control_socket`, or its default.
    pub control_socket: PathBuf,
    /// `daemon.bpffs`, or its default.
    pub bpffs: PathBuf,
}

/// The text of the config file `path`.
fn read_text(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError::unreadable(path, &e))
}

impl ClientPaths {
    /// Reads them from the config file at `path`: only an unreadable file
    /// is an error; anything unparsable gives the defaults.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Ok(Self::of_text(&read_text(path)?))
    }

    /// The `[daemon]` table usually comes first: then only the text before
    /// the first line that opens an array of tables (`[[service]]`) is
    /// parsed, so that a client command against 10,000 services does not
    /// wait for the whole file. A head that does not parse (the cut fell
    /// inside a multi-line value) or has no `[daemon]` falls back to the
    /// whole file.
    fn of_text(text: &str) -> Self {
        let services_start = text
            .match_indices('\n')
            .map(|(i, _)| i + 1)
            .find(|&start| text[start..].trim_start_matches([' ', '\t']).starts_with("[["));
        if let Some(head) = services_start.map(|end| &text[..end])
            && let Some(paths) = Self::of_document(head)
        {
            return paths;
        }
        Self::of_document(text).unwrap_or_else(|| Self::of_values(None, None))
    }

    /// The paths of a TOML document with a `[daemon]` table; only the two
    /// keys are read into values (the rest is parsed, not built).
    fn of_document(text: &str) -> Option<Self> {
        #[derive(Deserialize)]
        struct File {
            daemon: Option<Paths>,
        }
        // Values, not paths: a key of the wrong type gives its default
        // without losing the other.
        #[derive(Deserialize)]
        struct Paths {
            control_socket: Option<toml::Value>,
            bpffs: Option<toml::Value>,
        }
        let paths = toml::from_str::<File>(text).ok()?.daemon?;
        Some(Self::of_values(paths.control_socket, paths.bpffs))
    }

    /// The strings given, each defaulted when missing or not a string.
    fn of_values(control_socket: Option<toml::Value>, bpffs: Option<toml::Value>) -> Self {
        let get = |value: Option<toml::Value>, default: &str| {
            PathBuf::from(value.as_ref().and_then(toml::Value::as_str).unwrap_or(default))
        };
        Self {
            control_socket: get(control_socket, DEFAULT_CONTROL_SOCKET),
            bpffs: get(bpffs, DEFAULT_BPFFS),
        }
    }
}

/// A service as read, before the checks that need every service (VIPs used
/// as servers) have run.
struct Parsed {
    service: Service,
    /// Line of each server, of the default, and of the list.
    server_lines: Vec<usize>,
    default_line: Option<usize>,
    list_line: usize,
    /// The service's index in the file.
    index: usize,
    /// Where its `[[service]]` header starts in the text.
    start: usize,
}

impl Config {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = read_text(path)?;
        Self::parse(&text, path)
    }

    /// Parses and validates `text`; `path` only names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        Self::parse_tables(text, path).map(|(config, _)| config)
    }

    /// [`Config::parse`], and where each service's `[[service]]` header
    /// starts in `text`.
    fn parse_tables(text: &str, path: &Path) -> Result<(Self, Vec<usize>), ConfigError> {
        let lines = Lines::of(text);
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError {
            file: path.to_owned(),
            problems: vec![Problem::new(
                e.span().map(|s| lines.of_span(s)),
                "",
                e.message().trim_end(),
            )],
        })?;
        let mut problems = Vec::new();
        let metrics = raw
            .daemon
            .metrics
            .as_deref()
            .and_then(|m| parse_endpoint(m, None, Key::top("daemon.metrics"), &mut problems));
        let daemon = Daemon {
            cgroup: raw.daemon.cgroup,
            bpffs: raw.daemon.bpffs.unwrap_or_else(|| DEFAULT_BPFFS.into()),
            control_socket: raw
                .daemon
                .control_socket
                .unwrap_or_else(|| DEFAULT_CONTROL_SOCKET.into()),
            state_dir: raw.daemon.state_dir.unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
            metrics,
            kubeconfig: raw.daemon.kubeconfig,
        };
        for (key, value) in [
            ("bpffs", Some(&daemon.bpffs)),
            ("cgroup", daemon.cgroup.as_ref()),
            ("control_socket", Some(&daemon.control_socket)),
            ("kubeconfig", daemon.kubeconfig.as_ref()),
        ] {
            if value.is_some_and(|p| !p.is_absolute()) {
                problems.push(Problem::new(
                    None,
                    format!("daemon.{key}"),
                    "must be an absolute path",
                ));
            }
        }

        if raw.service.len() > MAX_SERVICES as usize {
            problems.push(Problem::new(
                None,
                "service",
                format!(
                    "{} services configured, at most {MAX_SERVICES} are supported",
                    raw.service.len()
                ),
            ));
        }
        let (services, starts) = read_services(raw.service, &lines, &mut problems);
        if problems.is_empty() {
            Ok((Self { daemon, services }, starts))
        } else {
            Err(ConfigError { file: path.to_owned(), problems })
        }
    }
}

/// Where each line of a text starts, found once: a value's line is then a
/// binary search, not a count from the top of the file (which made parsing
/// quadratic in the number of services).
struct Lines(Vec<usize>);

impl Lines {
    fn of(text: &str) -> Self {
        Self(text.bytes().enumerate().filter(|(_, b)| *b == b'\n').map(|(i, _)| i).collect())
    }

    /// The 1-based line of the value at `span`.
    fn of_span(&self, span: std::ops::Range<usize>) -> usize {
        self.0.partition_point(|&at| at < span.start) + 1
    }
}

/// The `[[service]]` tables of a file, each checked on its own and then
/// against the others; and where each header starts. Problems are added to
/// `problems`; the services are only meaningful if none were.
fn read_services(
    tables: Vec<Spanned<RawService>>,
    lines: &Lines,
    problems: &mut Vec<Problem>,
) -> (Vec<Service>, Vec<usize>) {
    let line_of = |span| lines.of_span(span);
    let mut parsed = Vec::with_capacity(tables.len());
    let mut names = HashMap::with_capacity(tables.len());
    let mut vips = HashMap::with_capacity(tables.len());
    for (i, table) in tables.into_iter().enumerate() {
        let start = table.span().start;
        let raw = table.into_inner();
        let name = raw.name.get_ref().clone();
        let key = Key::service(i, &name);
        let at = |span: std::ops::Range<usize>| Some(line_of(span));
        if name.is_empty() {
            problems.push(Problem::new(at(raw.name.span()), key.at("name"), "must not be empty"));
        }
        if let Some(first) = names.insert(name.clone(), i) {
            problems.push(Problem::new(
                at(raw.name.span()),
                key.at("name"),
                format!("duplicate of service[{first}]"),
            ));
        }
        let vip = parse_endpoint(raw.vip.get_ref(), at(raw.vip.span()), key.at("vip"), problems);
        if let Some(vip) = vip
            && let Some(first) = vips.insert(vip, i)
        {
            problems.push(Problem::new(
                at(raw.vip.span()),
                key.at("vip"),
                format!("{vip} is already the VIP of service[{first}]"),
            ));
        }
        let mut servers = Vec::new();
        let mut server_lines = Vec::new();
        for (j, s) in raw.servers.iter().flat_map(Spanned::get_ref).enumerate() {
            if let Some(addr) =
                parse_addr(s.get_ref(), at(s.span()), key.at("servers").nth(j), problems)
            {
                servers.push(addr);
                server_lines.push(line_of(s.span()));
            }
        }
        let default = raw
            .default
            .as_ref()
            .and_then(|d| parse_addr(d.get_ref(), at(d.span()), key.at("default"), problems));
        let policy = match raw.policy.as_ref().map(|p| (p.get_ref().as_str(), p.span())) {
            None | Some(("failover", _)) => Policy::Failover,
            Some(("spread", _)) => Policy::Spread,
            Some((other, span)) => {
                problems.push(Problem::new(
                    at(span),
                    key.at("policy"),
                    format!("{other:?} is not a policy; use \"failover\" or \"spread\""),
                ));
                Policy::Failover
            }
        };
        let hold_down = raw
            .hold_down
            .as_ref()
            .and_then(|text| {
                parse_duration(text.get_ref(), at(text.span()), key.at("hold_down"), problems)
            })
            .unwrap_or(DEFAULT_HOLD_DOWN);
        let health = match raw.health {
            Some(health) => {
                let line = at(health.span());
                parse_health(health.into_inner(), line, key.table("health."), problems)
            }
            None => HealthConfig::default(),
        };
        let discovery = raw.discovery.map(|d| {
            let line = at(d.span());
            parse_discovery(d.into_inner(), line, key.table("discovery."), problems)
        });
        let discovery = discovery.flatten();
        let scope = match raw.scope.as_ref().map(|p| (p.get_ref().as_str(), p.span())) {
            Some(("host", _)) => Scope::Host,
            Some(("all", _)) => Scope::All,
            None if vip.is_some_and(|v| v.ip().is_loopback()) => Scope::Host,
            None => Scope::All,
            Some((other, span)) => {
                problems.push(Problem::new(
                    at(span),
                    key.at("scope"),
                    format!("{other:?} is not a scope; use \"host\" or \"all\""),
                ));
                Scope::Host
            }
        };
        if servers.is_empty() && default.is_none() && discovery.is_none() {
            problems.push(Problem::new(
                at(raw.name.span()),
                key.at("servers"),
                "a service needs servers, a default, or a [service.discovery] source",
            ));
        }
        if let Some(vip) = vip {
            parsed.push(Parsed {
                service: Service {
                    name,
                    vip,
                    servers,
                    default,
                    policy,
                    hold_down,
                    health,
                    discovery,
                    scope,
                },
                server_lines,
                default_line: raw.default.as_ref().map(|d| line_of(d.span())),
                list_line: line_of(raw.servers.as_ref().map_or(raw.name.span(), Spanned::span)),
                index: i,
                start,
            });
        }
    }
    // Now that every VIP is known: the server sets, by the one set of
    // rules every other source of servers is held to.
    for p in &parsed {
        let s = &p.service;
        let owner = |addr: SocketAddr| vips.get(&addr).map(|i| format!("service[{i}]"));
        let key = Key::service(p.index, &s.name);
        for (slot, problem) in check_servers(s.vip, &s.servers, s.default, owner) {
            let (line, key) = match slot {
                Slot::Server(j) => (p.server_lines[j], key.at("servers").nth(j)),
                Slot::Default => (p.default_line.unwrap_or(p.list_line), key.at("default")),
                Slot::Set => (p.list_line, key.at("servers")),
            };
            problems.push(Problem::new(Some(line), key, problem));
        }
    }
    parsed.into_iter().map(|p| (p.service, p.start)).unzip()
}

fn parse_duration(
    text: &str,
    line: Option<usize>,
    key: Key,
    problems: &mut Vec<Problem>,
) -> Option<Duration> {
    let what = match humantime::parse_duration(text) {
        Ok(d) if d.is_zero() => "must be more than zero".to_owned(),
        Ok(d) if d.as_nanos() > u128::from(u64::MAX) => format!("{text:?} is too long"),
        Ok(d) => return Some(d),
        Err(e) => format!("{text:?} is not a duration like \"5s\" or \"500ms\": {e}"),
    };
    problems.push(Problem::new(line, key, what));
    None
}

fn parse_discovery(
    raw: RawDiscovery,
    line: Option<usize>,
    at: Key,
    problems: &mut Vec<Problem>,
) -> Option<Discovery> {
    let mut duration = |key: &str, text: Option<String>, default: Duration| {
        text.and_then(|t| parse_duration(&t, line, at.at(key), problems)).unwrap_or(default)
    };
    let debounce = duration("debounce", raw.debounce, DEFAULT_DEBOUNCE);
    let refresh = (raw.refresh_min.is_some() || raw.refresh_max.is_some()).then(|| {
        (
            duration("refresh_min", raw.refresh_min, DEFAULT_DNS_REFRESH_MIN),
            duration("refresh_max", raw.refresh_max, DEFAULT_DNS_REFRESH_MAX),
        )
    });
    let mut problem = |key: &str, what: &str| {
        problems.push(Problem::new(line, at.at(key), what));
        None
    };
    let port = |value: i64| u16::try_from(value).ok().filter(|p| *p != 0);
    match (raw.kubernetes, raw.dns) {
        (Some(_), Some(_)) => problem("kubernetes", "give one source: kubernetes or dns, not both"),
        (None, None) => problem(
            "kubernetes",
            "give a source: kubernetes = { namespace, service, port } or dns = { name, port }",
        ),
        (Some(k), None) => {
            if refresh.is_some() {
                return problem("refresh_min", "only applies to dns discovery");
            }
            if k.namespace.is_empty() || k.service.is_empty() {
                return problem("kubernetes", "namespace and service must not be empty");
            }
            let port = match k.port {
                RawPort::Name(name) if !name.is_empty() => PortRef::Name(name),
                RawPort::Number(n) => match port(n) {
                    Some(p) => PortRef::Number(p),
                    None => {
                        return problem("kubernetes.port", &format!("{n} is not a port (1-65535)"));
                    }
                },
                RawPort::Name(_) => {
                    return problem("kubernetes.port", "must be a port name or number");
                }
            };
            Some(Discovery::Kubernetes {
                namespace: k.namespace,
                service: k.service,
                port,
                debounce,
            })
        }
        (None, Some(d)) => {
            let (refresh_min, refresh_max) =
                refresh.unwrap_or((DEFAULT_DNS_REFRESH_MIN, DEFAULT_DNS_REFRESH_MAX));
            if refresh_min > refresh_max {
                return problem(
                    "refresh_min",
                    &format!("{refresh_min:?} is longer than refresh_max {refresh_max:?}"),
                );
            }
            if d.name.is_empty() || d.name.parse::<std::net::IpAddr>().is_ok() {
                return problem("dns.name", &format!("{:?} is not a DNS name", d.name));
            }
            let Some(port) = port(d.port) else {
                return problem("dns.port", &format!("{} is not a port (1-65535)", d.port));
            };
            Some(Discovery::Dns { name: d.name, port, debounce, refresh_min, refresh_max })
        }
    }
}

fn parse_health(
    raw: RawHealth,
    line: Option<usize>,
    at: Key,
    problems: &mut Vec<Problem>,
) -> HealthConfig {
    let mut problem = |key: &str, what: String| problems.push(Problem::new(line, at.at(key), what));
    let check = match raw.check.as_deref() {
        None | Some("tcp") => CheckKind::Tcp,
        Some("http") => CheckKind::Http,
        Some("https") => CheckKind::Https,
        Some("none") => CheckKind::None,
        Some(other) => {
            problem(
                "check",
                format!("{other:?} is not a check; use \"tcp\", \"http\", \"https\" or \"none\""),
            );
            CheckKind::Tcp
        }
    };
    let mut health = HealthConfig { check, ..HealthConfig::default() };
    if let Some(path) = raw.path {
        if !path.starts_with('/') {
            problem("path", format!("{path:?} must start with \"/\""));
        }
        health.path = path;
    }
    for (key, text, slot) in [
        ("interval", raw.interval, &mut health.interval),
        ("timeout", raw.timeout, &mut health.timeout),
    ] {
        if let Some(d) = text.as_deref().and_then(|t| parse_duration(t, line, at.at(key), problems))
        {
            *slot = d;
        }
    }
    let mut problem = |key: &str, what: String| problems.push(Problem::new(line, at.at(key), what));
    if health.timeout > health.interval {
        problem(
            "timeout",
            format!("{:?} is longer than the interval {:?}", health.timeout, health.interval),
        );
    }
    for (key, value, slot) in
        [("rise", raw.rise, &mut health.rise), ("fall", raw.fall, &mut health.fall)]
    {
        match value {
            Some(0) => problem(key, "must be at least 1".to_owned()),
            Some(n) if n > 100 => problem(key, format!("{n} is more than 100")),
            Some(n) => *slot = n,
            None => {}
        }
    }
    if health.check == CheckKind::None && health.rise > 1 {
        problem("rise", "only applies to active checks: with check = \"none\" a failed server is usable again at its first established connection".to_owned());
    }
    if let Some(text) = raw.status {
        let range = text.split_once('-').unwrap_or((text.as_str(), text.as_str()));
        match (range.0.trim().parse::<u16>(), range.1.trim().parse::<u16>()) {
            (Ok(lo), Ok(hi)) if (100..=599).contains(&lo) && (lo..=599).contains(&hi) => {
                health.status = (lo, hi);
            }
            _ => problem("status", format!("{text:?} is not a status range like \"200-399\"")),
        }
    }
    let tls_keys = [
        ("ca_file", raw.ca_file.is_some()),
        ("cert_file", raw.cert_file.is_some()),
        ("key_file", raw.key_file.is_some()),
        ("server_name", raw.server_name.is_some()),
        ("insecure_skip_verify", raw.insecure_skip_verify.is_some()),
    ];
    if health.check != CheckKind::Https {
        for (key, set) in tls_keys {
            if set {
                problem(key, "only applies to check = \"https\"".to_owned());
            }
        }
    }
    if raw.cert_file.is_some() != raw.key_file.is_some() {
        problem("cert_file", "a client certificate needs both cert_file and key_file".to_owned());
    }
    health.ca_file = raw.ca_file;
    health.cert_file = raw.cert_file;
    health.key_file = raw.key_file;
    health.server_name = raw.server_name;
    health.insecure_skip_verify = raw.insecure_skip_verify.unwrap_or(false);
    health
}

const fn family(addr: &SocketAddr) -> &'static str {
    if addr.is_ipv4() { "IPv4" } else { "IPv6" }
}

/// An address as written (`127.0.0.1:6443`, `[::1]:6443`); whether it can
/// be used is for the caller to check.
fn parse_addr(
    text: &str,
    line: Option<usize>,
    key: Key,
    problems: &mut Vec<Problem>,
) -> Option<SocketAddr> {
    text.parse::<SocketAddr>()
        .inspect_err(|_| {
            problems.push(Problem::new(
                line,
                key,
                format!("{text:?} is not an address like \"127.0.0.1:6443\" or \"[::1]:6443\""),
            ));
        })
        .ok()
}

/// An address to listen on or to dial (a VIP, the metrics address): not
/// port 0, not the unspecified address.
fn parse_endpoint(
    text: &str,
    line: Option<usize>,
    key: Key,
    problems: &mut Vec<Problem>,
) -> Option<SocketAddr> {
    let addr = parse_addr(text, line, key, problems)?;
    let what = if addr.port() == 0 {
        ServerProblem::PortZero(addr)
    } else if addr.ip().is_unspecified() {
        ServerProblem::Unspecified(addr)
    } else {
        return Some(addr);
    };
    problems.push(Problem::new(line, key, what));
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("test.toml"))
    }

    fn problems(text: &str) -> String {
        parse(text).expect_err("config should be rejected").to_string()
    }

    const GOOD: &str = r#"
        [daemon]
        cgroup = "/sys/fs/cgroup/unified/lb-demo"
        bpffs = "/sys/fs/bpf/lb-demo"
        [[service]]
        name = "api"
        vip = "127.0.0.1:6444"
        servers = ["127.0.0.1:16443", "127.0.0.2:16443"]
        default = "127.0.0.3:16443"
        hold_down = "500ms"
    "#;

    #[test]
    fn parses_a_full_config_with_defaults() {
        let config = parse(GOOD).unwrap();
        assert_eq!(config.daemon.bpffs, PathBuf::from("/sys/fs/bpf/lb-demo"));
        assert_eq!(config.daemon.control_socket, PathBuf::from(DEFAULT_CONTROL_SOCKET));
        let api = &config.services[0];
        assert_eq!(api.policy, Policy::Failover);
        assert_eq!(api.hold_down, Duration::from_millis(500));
        assert_eq!(api.default, Some("127.0.0.3:16443".parse().unwrap()));
        assert_eq!(api.servers.len(), 2);
    }

    #[test]
    fn unknown_key_is_named() {
        let msg = problems(&GOOD.replace("hold_down", "holddown"));
        assert!(msg.starts_with("test.toml:10: ") && msg.contains("holddown"), "{msg}");
    }

    #[test]
    fn keys_read_as_written() {
        let service = Key::service(3, "api");
        assert_eq!(service.to_string(), "service[3] (\"api\")");
        assert_eq!(service.at("servers").nth(2).to_string(), "service[3] (\"api\"): servers[2]");
        assert_eq!(
            service.table("health.").at("interval").to_string(),
            "service[3] (\"api\"): health.interval"
        );
        assert_eq!(Key::top("daemon.metrics").to_string(), "daemon.metrics");
    }

    #[test]
    fn bad_address_names_the_key() {
        let msg = problems(&GOOD.replace("127.0.0.2:16443", "127.0.0.2"));
        assert!(
            msg.contains(
                "test.toml:8: service[0] (\"api\"): servers[1]: \"127.0.0.2\" is not an address"
            ),
            "{msg}"
        );
    }

    #[test]
    fn port_zero_is_rejected() {
        let msg = problems(&GOOD.replace("127.0.0.1:6444", "127.0.0.1:0"));
        assert!(
            msg.contains("test.toml:7: service[0] (\"api\"): vip: 127.0.0.1:0 has port 0"),
            "{msg}"
        );
    }

    #[test]
    fn mixed_families_are_rejected_with_a_reason() {
        let msg = problems(&GOOD.replace("127.0.0.2:16443", "[::1]:16443"));
        assert!(
            msg.contains("servers[1]: [::1]:16443 is IPv6 but the VIP 127.0.0.1:6444 is IPv4"),
            "{msg}"
        );
    }

    #[test]
    fn duplicate_names_and_vips_are_rejected() {
        let twice = format!(
            "{GOOD}\n[[service]]\nname = \"api\"\nvip = \"127.0.0.1:6444\"\nservers = [\"127.0.0.9:1\"]\n"
        );
        let msg = problems(&twice);
        assert!(msg.contains("name: duplicate of service[0]"), "{msg}");
        assert!(msg.contains("vip: 127.0.0.1:6444 is already the VIP of service[0]"), "{msg}");
    }

    #[test]
    fn vip_as_a_server_is_a_loop() {
        let msg = problems(&GOOD.replace("127.0.0.2:16443", "127.0.0.1:6444"));
        assert!(msg.contains("servers[1]: 127.0.0.1:6444 is the VIP of service[0]; using it as a server would loop"), "{msg}");
    }

    #[test]
    fn bad_duration_and_policy_are_named() {
        let msg = problems(
            &GOOD.replace("500ms", "soon").replace("hold_down", "policy = \"random\"\nhold_down"),
        );
        assert!(msg.contains("hold_down: \"soon\" is not a duration"), "{msg}");
        assert!(msg.contains("policy: \"random\" is not a policy"), "{msg}");
    }

    #[test]
    fn health_section_parses_with_defaults() {
        let text = format!(
            "{GOOD}[service.health]\ncheck = \"https\"\npath = \"/readyz\"\ninterval = \"5s\"\nfall = 3\nca_file = \"/etc/lb/ca.pem\"\n"
        );
        let health = &parse(&text).unwrap().services[0].health;
        assert_eq!(health.check, CheckKind::Https);
        assert_eq!(health.path, "/readyz");
        assert_eq!(health.interval, Duration::from_secs(5));
        assert_eq!(health.timeout, Duration::from_secs(1));
        assert_eq!((health.rise, health.fall), (1, 3));
        assert_eq!(health.status, (200, 399));
        assert_eq!(parse(GOOD).unwrap().services[0].health, HealthConfig::default());
    }

    #[test]
    fn bad_health_settings_are_named() {
        let text = format!(
            "{GOOD}[service.health]\ncheck = \"icmp\"\nrise = 0\nstatus = \"2xx\"\ninterval = \"1s\"\ntimeout = \"2s\"\n"
        );
        let msg = problems(&text);
        for expected in [
            "health.check: \"icmp\" is not a check",
            "health.rise: must be at least 1",
            "health.status: \"2xx\"",
            "health.timeout: 2s is longer",
        ] {
            assert!(msg.contains(expected), "{expected:?} missing from:\n{msg}");
        }
        let msg = problems(&format!("{GOOD}[service.health]\ncheck = \"tcp\"\nca_file = \"/x\"\n"));
        assert!(msg.contains("health.ca_file: only applies to check = \"https\""), "{msg}");
        let msg = problems(&format!("{GOOD}[service.health]\ncheck = \"none\"\nrise = 2\n"));
        assert!(msg.contains("health.rise: only applies to active checks"), "{msg}");
    }

    #[test]
    fn client_paths_survive_a_broken_config() {
        let dir = std::env::temp_dir().join(format!("lb-client-paths-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.toml");
        std::fs::write(
            &path,
            "[daemon]\ncontrol_socket = \"/tmp/x.sock\"\n[[service]]\npolcy = 1\n",
        )
        .unwrap();
        let paths = ClientPaths::load(&path).unwrap();
        assert_eq!(
            paths,
            ClientPaths { control_socket: "/tmp/x.sock".into(), bpffs: DEFAULT_BPFFS.into() }
        );
        std::fs::remove_dir_all(&dir).unwrap();

        let defaults = ClientPaths {
            control_socket: DEFAULT_CONTROL_SOCKET.into(),
            bpffs: DEFAULT_BPFFS.into(),
        };
        assert_eq!(ClientPaths::of_text("not toml at all ["), defaults);
        assert_eq!(ClientPaths::of_text(""), defaults);
        assert_eq!(
            ClientPaths::of_text("[daemon]\nbpffs = 3\ncontrol_socket = \"/run/x.sock\"\n"),
            ClientPaths { control_socket: "/run/x.sock".into(), bpffs: DEFAULT_BPFFS.into() },
            "a key of the wrong type gives its default, not the other's"
        );
        assert_eq!(
            ClientPaths::of_text(
                "[[service]]\nname = \"a\"\n[daemon]\nbpffs = \"/sys/fs/bpf/x\"\nmetrics = 1\n"
            ),
            ClientPaths {
                control_socket: DEFAULT_CONTROL_SOCKET.into(),
                bpffs: "/sys/fs/bpf/x".into()
            },
            "[daemon] after the services, other keys of any type"
        );
        let tricky =
            "[daemon]\nbpffs = \"\"\"\n[[service]]\n\"\"\"\ncontrol_socket = \"/run/y.sock\"\n";
        assert_eq!(
            ClientPaths::of_text(tricky).control_socket,
            PathBuf::from("/run/y.sock"),
            "a header-like line inside a string: the whole file decides"
        );
    }

    #[test]
    fn too_many_servers_is_rejected() {
        let servers: Vec<String> = (1..=17).map(|i| format!("\"127.0.1.{i}:80\"")).collect();
        let text = format!(
            "[[service]]\nname = \"big\"\nvip = \"127.0.0.1:80\"\nservers = [{}]\n",
            servers.join(",")
        );
        assert!(
            problems(&text).contains(
                "test.toml:4: service[0] (\"big\"): servers: 17 servers (with the default)"
            )
        );
    }

    #[test]
    fn a_server_twice_is_named_where_it_repeats() {
        let msg = problems(&GOOD.replace("127.0.0.2:16443", "127.0.0.1:16443"));
        assert!(
            msg.contains(
                "test.toml:8: service[0] (\"api\"): servers[1]: 127.0.0.1:16443 is listed twice"
            ),
            "{msg}"
        );
    }

    #[test]
    fn one_server_check_for_every_source() {
        let vip: SocketAddr = "127.0.0.1:6444".parse().unwrap();
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let none = |_| None;
        assert_eq!(
            validate_servers(
                vip,
                &[a("127.0.0.1:1"), a("127.0.0.2:1")],
                Some(a("127.0.0.1:1")),
                none
            ),
            Ok(()),
            "the default may be listed"
        );
        let err = validate_servers(
            vip,
            &[a("127.0.0.1:0"), a("[::1]:1"), a("127.0.0.3:1"), a("127.0.0.3:1")],
            None,
            none,
        )
        .unwrap_err();
        assert_eq!(
            err,
            "servers[0]: 127.0.0.1:0 has port 0; servers[1]: [::1]:1 is IPv6 but the VIP 127.0.0.1:6444 is IPv4; a socket dialling the VIP cannot reach it; servers[3]: 127.0.0.3:1 is listed twice"
        );
        let err = validate_servers(vip, &[a("127.0.0.9:80")], None, |addr| {
            (addr == a("127.0.0.9:80")).then(|| "service \"db\"".to_owned())
        })
        .unwrap_err();
        assert_eq!(
            err,
            "servers[0]: 127.0.0.9:80 is the VIP of service \"db\"; using it as a server would loop"
        );
        let many: Vec<SocketAddr> =
            (1..=17).map(|i| SocketAddr::from(([127, 0, 1, i], 80))).collect();
        assert!(validate_servers(vip, &many, None, none).unwrap_err().contains("17 servers"));
    }

    #[test]
    fn scope_defaults_to_host_for_loopback_vips_only() {
        assert_eq!(parse(GOOD).unwrap().services[0].scope, Scope::Host);
        // A non-loopback VIP, parsed only (nothing dials it), for its default.
        let cluster = GOOD
            .replace("127.0.0.1:6444", "[fd00::1]:6444")
            .replace("127.0.0.", "[fd00::")
            .replace(":16443", "]:16443");
        assert_eq!(parse(&cluster).unwrap().services[0].scope, Scope::All, "{cluster}");
        let with =
            |scope: &str| GOOD.replace("hold_down", &format!("scope = \"{scope}\"\nhold_down"));
        assert_eq!(parse(&with("all")).unwrap().services[0].scope, Scope::All);
        assert!(problems(&with("pods")).contains("scope: \"pods\" is not a scope"));
    }

    #[test]
    fn discovery_sources_parse_with_defaults() {
        let k8s = "[[service]]\nname = \"api\"\nvip = \"127.0.0.1:6444\"\n[service.discovery]\nkubernetes = { namespace = \"default\", service = \"kubernetes\", port = \"https\" }\n";
        let service = &parse(k8s).unwrap().services[0];
        assert!(service.servers.is_empty(), "servers are optional with discovery");
        assert_eq!(
            service.discovery,
            Some(Discovery::Kubernetes {
                namespace: "default".into(),
                service: "kubernetes".into(),
                port: PortRef::Name("https".into()),
                debounce: DEFAULT_DEBOUNCE
            })
        );
        let dns = format!(
            "{GOOD}[service.discovery]\ndns = {{ name = \"api.example.internal\", port = 2379 }}\ndebounce = \"3s\"\nrefresh_max = \"1m\"\n"
        );
        assert_eq!(
            parse(&dns).unwrap().services[0].discovery,
            Some(Discovery::Dns {
                name: "api.example.internal".into(),
                port: 2379,
                debounce: Duration::from_secs(3),
                refresh_min: DEFAULT_DNS_REFRESH_MIN,
                refresh_max: Duration::from_secs(60)
            })
        );
    }

    #[test]
    fn bad_discovery_settings_are_named() {
        let base = format!("{GOOD}[service.discovery]\n");
        for (body, expected) in [
            ("", "test.toml:11: service[0] (\"api\"): discovery.kubernetes: give a source"),
            (
                "dns = { name = \"x\", port = 1 }\nkubernetes = { namespace = \"a\", service = \"b\", port = 1 }\n",
                "not both",
            ),
            (
                "kubernetes = { namespace = \"a\", service = \"b\", port = 0 }\n",
                "discovery.kubernetes.port: 0 is not a port",
            ),
            (
                "dns = { name = \"127.10.0.1\", port = 53 }\n",
                "discovery.dns.name: \"127.10.0.1\" is not a DNS name",
            ),
            ("dns = { name = \"x\", port = 70000 }\n", "discovery.dns.port: 70000 is not a port"),
            (
                "dns = { name = \"x\", port = 1 }\nrefresh_min = \"10m\"\nrefresh_max = \"1m\"\n",
                "discovery.refresh_min: 600s is longer than refresh_max 60s",
            ),
            (
                "kubernetes = { namespace = \"a\", service = \"b\", port = \"https\" }\nrefresh_min = \"1s\"\n",
                "only applies to dns",
            ),
            (
                "dns = { name = \"x\", port = 1 }\ndebounce = \"never\"\n",
                "discovery.debounce: \"never\" is not a duration",
            ),
        ] {
            let msg = problems(&format!("{base}{body}"));
            assert!(msg.contains(expected), "{expected:?} missing from:\n{msg}");
        }
        let msg = problems("[[service]]\nname = \"x\"\nvip = \"127.0.0.1:1\"\n");
        assert!(
            msg.contains(
                "servers: a service needs servers, a default, or a [service.discovery] source"
            ),
            "{msg}"
        );
    }

    #[test]
    fn lines_are_counted_right_to_the_last_service() {
        let many: String = (0..300)
            .map(|i| format!("[[service]]\nname = \"s{i}\"\nvip = \"127.1.0.{}:{}\"\nservers = [\"127.2.0.1:80\"]\n", i % 200 + 1, 1000 + i))
            .collect();
        let msg = problems(&format!(
            "{many}[[service]]\nname = \"last\"\nvip = \"127.1.9.9:0\"\nservers = [\"127.2.0.1:80\"]\n"
        ));
        assert!(
            msg.starts_with(&format!("test.toml:{}: service[300] (\"last\"): vip:", 300 * 4 + 3)),
            "{msg}"
        );
    }

    #[test]
    fn toml_syntax_error_names_the_file() {
        let msg = problems("[[service]\n");
        assert!(msg.starts_with("test.toml:"), "{msg}");
    }
}
