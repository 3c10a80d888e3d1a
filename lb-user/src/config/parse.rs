//! The parser: the whole file into a [`Config`], every `[[service]]` table
//! checked on its own and then against the others (names, VIPs, servers
//! that are VIPs), each problem at its line.

use std::{collections::HashMap, net::SocketAddr, path::Path};

use lb_common::{MAX_SERVICES, MAX_TRACKED_SOCKETS};

use crate::{nat_addresses, nat_ports};
use toml::Spanned;

use super::{
    ConfigError,
    bgp::parse_bgp,
    election::{parse_election, parse_membership, parse_node_name},
    external_service::{mixed_elections, parse_external},
    load_balancers::parse_load_balancers,
    model::{
        Config, DEFAULT_BPFFS, DEFAULT_CONTROL_SOCKET, DEFAULT_FLOW_TABLE, DEFAULT_HOLD_DOWN,
        DEFAULT_NEW_FLOWS_PER_CPU, DEFAULT_STATE_DIR, Daemon, FLOW_TABLE_SIZES, HealthConfig,
        NEW_FLOWS_PER_CPU, Policy, SOCKET_TABLE_SIZES, Scope, Service,
    },
    problems::{Key, Problem},
    raw::{RawConfig, RawService},
    read_text,
    servers::{Slot, check_servers},
    values::{parse_addr, parse_discovery, parse_duration, parse_endpoint, parse_health},
};

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
    pub(super) fn parse_tables(text: &str, path: &Path) -> Result<(Self, Vec<usize>), ConfigError> {
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
        let election = parse_election(&raw.daemon, &mut problems);
        let bgp_given = raw.bgp.is_some();
        let load_balancers = parse_load_balancers(
            raw.kubernetes.as_ref(),
            raw.pool,
            bgp_given,
            &|span| lines.of_span(span),
            &mut problems,
        );
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
            socket_table: bounded(
                raw.daemon.socket_table,
                (SOCKET_TABLE_SIZES, MAX_TRACKED_SOCKETS),
                "daemon.socket_table",
                "TCP connections through VIPs tracked at once",
                &mut problems,
            ),
            flow_table: bounded(
                raw.daemon.flow_table,
                (FLOW_TABLE_SIZES, DEFAULT_FLOW_TABLE),
                "daemon.flow_table",
                "flows the external path keeps",
                &mut problems,
            ),
            new_flows_per_cpu: bounded(
                raw.daemon.new_flows_per_cpu,
                (NEW_FLOWS_PER_CPU, DEFAULT_NEW_FLOWS_PER_CPU),
                "daemon.new_flows_per_cpu",
                "new external flows per CPU per second; 0: no limit",
                &mut problems,
            ),
            nat_ports: match raw.daemon.nat_ports.as_deref().map(nat_ports::parse) {
                None => nat_ports::DEFAULT,
                Some(Ok(range)) => range,
                Some(Err(why)) => {
                    problems.push(Problem::new(None, "daemon.nat_ports", why));
                    nat_ports::DEFAULT
                }
            },
            nat_addresses: nat_addresses::parse(&raw.daemon.nat_addresses.unwrap_or_default())
                .unwrap_or_else(|why| {
                    problems.push(Problem::new(None, "daemon.nat_addresses", why));
                    Vec::new()
                }),
            election,
            node_name: parse_node_name(raw.daemon.node_name, &mut problems),
            membership: parse_membership(raw.kubernetes, election.retry, &mut problems),
            load_balancers,
            bgp: raw.bgp.and_then(|bgp| parse_bgp(bgp, &mut problems)),
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
        let (services, starts) =
            read_services(raw.service, &lines, daemon.membership.by_default, &mut problems);
        let elected = services
            .iter()
            .any(|s| s.external.as_ref().is_some_and(|e| e.lease.is_some() || e.elect));
        if elected && ["localhost", "localhost.localdomain"].contains(&daemon.node_name.as_str()) {
            problems.push(Problem::new(
                None,
                "daemon.node_name",
                format!(
                    "{:?} names no node in particular: with elections, every node so named would \
                     hold its leases, or write one membership Lease, at once; set [daemon] node_name \
                     (or LB_NODE_NAME, as the DaemonSet does from spec.nodeName) to this node's own \
                     name",
                    daemon.node_name
                ),
            ));
        }
        let by_bgp = services.iter().position(|s| {
            s.external.as_ref().is_some_and(|e| e.announce == crate::config::Announce::Bgp)
        });
        if let Some(i) = by_bgp
            && !bgp_given
        {
            problems.push(Problem::new(
                Some(lines.of_span(starts[i]..starts[i])),
                Key::service(i, &services[i].name).table("external.").at("announce"),
                "\"bgp\" needs a [bgp] table: the AS number and the routers to announce to",
            ));
        }
        if problems.is_empty() {
            Ok((Self { daemon, services }, starts))
        } else {
            Err(ConfigError { file: path.to_owned(), problems })
        }
    }
}

/// A `[daemon]` number within `range` (its default if absent); outside
/// it, a problem naming `key` and `what` it counts, and the default.
fn bounded(
    value: Option<i64>,
    (range, default): (std::ops::RangeInclusive<i64>, u32),
    key: &'static str,
    what: &str,
    problems: &mut Vec<Problem>,
) -> u32 {
    match value {
        None => default,
        Some(n) if range.contains(&n) => u32::try_from(n).unwrap_or(default),
        Some(n) => {
            problems.push(Problem::new(
                None,
                key,
                format!("{n} is outside {}..={} ({what})", range.start(), range.end()),
            ));
            default
        }
    }
}

/// Where each line of a text starts, found once: a value's line is then a
/// binary search, not a count from the top of the file (which made parsing
/// quadratic in the number of services).
pub(super) struct Lines(Vec<usize>);

impl Lines {
    pub(super) fn of(text: &str) -> Self {
        Self(text.bytes().enumerate().filter(|(_, b)| *b == b'\n').map(|(i, _)| i).collect())
    }

    /// The 1-based line of the value at `span`.
    pub(super) fn of_span(&self, span: std::ops::Range<usize>) -> usize {
        self.0.partition_point(|&at| at < span.start) + 1
    }
}

/// The `[[service]]` tables of a file, each checked on its own and then
/// against the others; and where each header starts. Problems are added to
/// `problems`; the services are only meaningful if none were.
pub(super) fn read_services(
    tables: Vec<Spanned<RawService>>,
    lines: &Lines,
    elect_by_default: bool,
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
            Some(("none", span)) => {
                if raw.external.is_none() {
                    problems.push(Problem::new(
                        at(span),
                        key.at("scope"),
                        "\"none\" rewrites no local connect, so the service needs [service.external] \
                         for its clients on other machines"
                            .to_owned(),
                    ));
                }
                Scope::None
            }
            None if vip.is_some_and(|v| v.ip().is_loopback()) => Scope::Host,
            None => Scope::All,
            Some((other, span)) => {
                problems.push(Problem::new(
                    at(span),
                    key.at("scope"),
                    format!("{other:?} is not a scope; use \"host\", \"all\" or \"none\""),
                ));
                Scope::Host
            }
        };
        let external = raw.external.map(|e| {
            let line = at(e.span());
            let at = key.table("external.");
            parse_external(e.into_inner(), vip, line, at, elect_by_default, problems)
        });
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
                    external,
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
    for (k, why) in mixed_elections(parsed.iter().map(|p| &p.service)) {
        let p = &parsed[k];
        let key = Key::service(p.index, &p.service.name).table("external.").at("elect");
        problems.push(Problem::new(Some(p.list_line), key, why));
    }
    parsed.into_iter().map(|p| (p.service, p.start)).unzip()
}

#[cfg(test)]
mod tests {
    use std::{path::PathBuf, time::Duration};

    use super::{
        super::testing::{GOOD, parse, problems},
        *,
    };

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
        assert_eq!(config.daemon.socket_table, MAX_TRACKED_SOCKETS);
    }

    #[test]
    fn the_socket_table_size_is_bounded() {
        let with = |n: &str| GOOD.replace("[daemon]\n", &format!("[daemon]\nsocket_table = {n}\n"));
        assert_eq!(parse(&with("256")).unwrap().daemon.socket_table, 256);
        for bad in ["0", "63", "1048577", "-1"] {
            let msg = problems(&with(bad));
            assert!(msg.contains("daemon.socket_table") && msg.contains("outside 64..="), "{msg}");
        }
    }

    #[test]
    fn the_new_flow_limit_is_bounded() {
        assert_eq!(parse(GOOD).unwrap().daemon.new_flows_per_cpu, DEFAULT_NEW_FLOWS_PER_CPU);
        let with =
            |n: &str| GOOD.replace("[daemon]\n", &format!("[daemon]\nnew_flows_per_cpu = {n}\n"));
        assert_eq!(parse(&with("0")).unwrap().daemon.new_flows_per_cpu, 0);
        for bad in ["-1", "100000001"] {
            let msg = problems(&with(bad));
            assert!(
                msg.contains("daemon.new_flows_per_cpu") && msg.contains("outside 0..="),
                "{msg}"
            );
        }
    }

    #[test]
    fn the_nat_ports_and_addresses_are_checked_naming_their_key() {
        assert_eq!(parse(GOOD).unwrap().daemon.nat_ports, nat_ports::DEFAULT);
        let with = |r: &str| GOOD.replace("[daemon]\n", &format!("[daemon]\nnat_ports = {r}\n"));
        assert_eq!(parse(&with("\"40000-65535\"")).unwrap().daemon.nat_ports, 40000..=65535);
        let msg = problems(&with("\"100-200\""));
        assert!(msg.contains("daemon.nat_ports") && msg.contains("starts below 1024"), "{msg}");
        let with =
            |list: &str| GOOD.replace("[daemon]\n", &format!("[daemon]\nnat_addresses = {list}\n"));
        let two = parse(&with(r#"["198.18.2.10", "2001:2::10"]"#)).unwrap();
        assert_eq!(two.daemon.nat_addresses.len(), 2);
        let msg = problems(&with(r#"["198.18.2.10", "x"]"#));
        assert!(msg.contains("daemon.nat_addresses") && msg.contains("\"x\""), "{msg}");
        let with = |r: &str| GOOD.replace("[daemon]\n", &format!("[daemon]\nnat_ports = {r}\n"));
        let msg = problems(&with("61000"));
        assert!(msg.contains(":3:") && msg.contains("expected a string"), "{msg}");
    }

    #[test]
    fn the_flow_table_size_is_bounded() {
        assert_eq!(parse(GOOD).unwrap().daemon.flow_table, DEFAULT_FLOW_TABLE);
        let with = |n: &str| GOOD.replace("[daemon]\n", &format!("[daemon]\nflow_table = {n}\n"));
        assert_eq!(parse(&with("4096")).unwrap().daemon.flow_table, 4096);
        for bad in ["0", "1023", "4194305", "-1"] {
            let msg = problems(&with(bad));
            assert!(msg.contains("daemon.flow_table") && msg.contains("outside 1024..="), "{msg}");
        }
    }

    #[test]
    fn unknown_key_is_named() {
        let msg = problems(&GOOD.replace("hold_down", "holddown"));
        assert!(msg.starts_with("test.toml:10: ") && msg.contains("holddown"), "{msg}");
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
        let none = problems(&with("none"));
        assert!(none.contains("scope: \"none\" rewrites no local connect"), "{none}");
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
