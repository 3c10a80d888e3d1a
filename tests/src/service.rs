//! [`ServiceBuilder`]: one `[[service]]` of a test's config, as TOML.

use std::{fmt, net::SocketAddr, time::Duration};

use toml::{Table, Value};

/// How the daemon judges a service's servers, besides the kernel's reports
/// of connects through the VIP (which every check also gets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    /// `check = "none"`: no probes; only the kernel's reports.
    None,
    /// `check = "tcp"`: connect and close, every `interval`.
    Tcp { interval: Duration },
    /// `check = "http"`: `GET path` every `interval`; a [`Backend`](crate::Backend) answers
    /// with the status set by [`Backend::set_health`](crate::Backend::set_health).
    Http { path: &'static str, interval: Duration },
    /// `check = "dns"`: a query for `query` (type A) every `interval`; a
    /// [`FakeDns`](crate::fakes::dns::FakeDns) answers as its mode says.
    Dns { query: &'static str, interval: Duration },
}

/// A service's `policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The first usable server.
    Failover,
    /// Any usable server, at random.
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

    /// A line of TOML for the `[[service]]` table, e.g. a deliberately
    /// misspelt key: a `key = value`, or a `[service.TABLE]` header whose
    /// keys are the raw lines after it (e.g. `[service.discovery]`).
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
        let mut service = Table::new();
        service.insert("name".to_owned(), name.clone().into());
        service.insert("vip".to_owned(), vip.to_string().into());
        service.insert(
            "servers".to_owned(),
            servers.iter().map(ToString::to_string).collect::<Vec<_>>().into(),
        );
        if let Some(default) = default {
            service.insert("default".to_owned(), default.to_string().into());
        }
        if let Some(policy) = policy {
            let policy = match policy {
                Policy::Failover => "failover",
                Policy::Spread => "spread",
            };
            service.insert("policy".to_owned(), policy.into());
        }
        if let Some(hold_down) = hold_down {
            service.insert("hold_down".to_owned(), toml_duration(*hold_down).into());
        }
        let mut health = Table::new();
        let interval = match check {
            Check::None => {
                assert!(
                    timeout.is_none(),
                    "service {name}: a timeout needs a check that probes, not Check::None"
                );
                health.insert("check".to_owned(), "none".into());
                None
            }
            Check::Tcp { interval } => {
                health.insert("check".to_owned(), "tcp".into());
                Some(*interval)
            }
            Check::Http { path, interval } => {
                health.insert("check".to_owned(), "http".into());
                health.insert("path".to_owned(), (*path).into());
                Some(*interval)
            }
            Check::Dns { query, interval } => {
                health.insert("check".to_owned(), "dns".into());
                health.insert("query".to_owned(), (*query).into());
                Some(*interval)
            }
        };
        if let Some(interval) = interval {
            let timeout =
                timeout.unwrap_or_else(|| (interval * 3 / 4).max(Duration::from_millis(50)));
            health.insert("interval".to_owned(), toml_duration(interval).into());
            health.insert("timeout".to_owned(), toml_duration(timeout).into());
        }
        if let Some(rise) = rise {
            health.insert("rise".to_owned(), i64::from(*rise).into());
        }
        if let Some(fall) = fall {
            health.insert("fall".to_owned(), i64::from(*fall).into());
        }
        service.insert("health".to_owned(), health.into());
        add_raw(&mut service, name, raw);
        let mut config = Table::new();
        config.insert("service".to_owned(), vec![Value::Table(service)].into());
        toml::to_string(&config).unwrap_or_else(|e| panic!("service {name} as TOML: {e}"))
    }
}

/// Adds the [`ServiceBuilder::raw`] lines to the table of service `name`:
/// keys before any header to the table itself, a `[service.TABLE]` and the
/// keys after it as its sub-table `TABLE`. A key that is there already
/// would have been a duplicate key in the config file: a mistake of the
/// test, which panics.
fn add_raw(service: &mut Table, name: &str, raw: &[String]) {
    let text = raw.join("\n");
    let mut parsed: Table = text
        .parse()
        .unwrap_or_else(|e| panic!("service {name}: raw lines {text:?} are not TOML: {e}"));
    let nested = match parsed.remove("service") {
        None => Table::new(),
        Some(Value::Table(nested)) => nested,
        Some(other) => panic!("service {name}: raw `service = {other}` is not a table"),
    };
    for (key, value) in parsed.into_iter().chain(nested) {
        assert!(!service.contains_key(&key), "service {name}: raw key {key:?} is set twice");
        service.insert(key, value);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Table {
        text.parse().unwrap_or_else(|e| panic!("{e}:\n{text}"))
    }

    /// What the daemon reads is what the hand-written TOML of the earlier
    /// `format!` version said, for every setting and the raw lines.
    #[test]
    fn renders_every_setting() {
        let vip: SocketAddr = "127.77.1.100:6444".parse().unwrap();
        let (one, two) = ("127.77.1.1:80".parse().unwrap(), "[::1]:81".parse().unwrap());
        let full = ServiceBuilder::new("api", vip)
            .servers(&[one, two])
            .default(two)
            .policy(Policy::Spread)
            .hold_down(Duration::from_secs(5))
            .check(Check::Http { path: "/readyz", interval: Duration::from_millis(200) })
            .rise(2)
            .fall(3)
            .raw("polcy = \"spread\"")
            .raw("[service.discovery]")
            .raw("kubernetes = { namespace = \"default\", service = \"api\", port = \"https\" }")
            .raw("debounce = \"1ms\"");
        assert_eq!(
            parsed(&full.toml()),
            parsed(
                "[[service]]\nname = \"api\"\nvip = \"127.77.1.100:6444\"\n\
                 servers = [\"127.77.1.1:80\", \"[::1]:81\"]\ndefault = \"[::1]:81\"\n\
                 policy = \"spread\"\nhold_down = \"5s\"\npolcy = \"spread\"\n\
                 [service.discovery]\n\
                 kubernetes = { namespace = \"default\", service = \"api\", port = \"https\" }\n\
                 debounce = \"1ms\"\n[service.health]\ncheck = \"http\"\npath = \"/readyz\"\n\
                 interval = \"200ms\"\ntimeout = \"150ms\"\nrise = 2\nfall = 3\n"
            )
        );
        let bare = ServiceBuilder::new("db", vip)
            .check(Check::Tcp { interval: Duration::from_millis(40) });
        assert_eq!(
            parsed(&bare.toml()),
            parsed(
                "[[service]]\nname = \"db\"\nvip = \"127.77.1.100:6444\"\nservers = []\n\
                 [service.health]\ncheck = \"tcp\"\ninterval = \"40ms\"\ntimeout = \"50ms\"\n"
            )
        );
        let none = ServiceBuilder::new("x", vip).servers(&[one]).timeout(Duration::ZERO);
        assert!(std::panic::catch_unwind(|| none.toml()).is_err(), "a timeout without probes");
    }

    /// Services rendered one after another make one config of several.
    #[test]
    fn services_concatenate() {
        let vip: SocketAddr = "127.77.1.100:6444".parse().unwrap();
        let text = ServiceBuilder::new("a", vip).toml() + &ServiceBuilder::new("b", vip).toml();
        let config = parsed(&text);
        let services = config["service"].as_array().unwrap();
        assert_eq!(services.len(), 2);
        assert_eq!(services[1]["name"].as_str(), Some("b"));
        assert_eq!(services[1]["health"]["check"].as_str(), Some("none"));
    }
}
