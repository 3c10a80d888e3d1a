//! One value or sub-table of a file at a time: durations, addresses,
//! `[service.health]`, `[service.discovery]`. Each reads what was written,
//! adds a [`Problem`] naming its key for anything wrong, and gives the
//! value (or the default) it could read.

use std::{net::SocketAddr, time::Duration};

use super::{
    model::{
        CheckKind, DEFAULT_DEBOUNCE, DEFAULT_DNS_REFRESH_MAX, DEFAULT_DNS_REFRESH_MIN, Discovery,
        HealthConfig, MIN_DNS_REFRESH, PortRef,
    },
    problems::{Key, Problem},
    raw::{RawDiscovery, RawHealth, RawPort},
    servers::ServerProblem,
};

/// A duration like `"5s"` or `"500ms"`: more than zero, and short
/// enough for the kernel's nanoseconds in a `u64`.
pub(super) fn parse_duration(
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

/// `[service.discovery]` (`at`: its table's key). A source that this
/// build of lb lacks is read and checked like any other (every build runs
/// the same checks), then refused by name.
pub(super) fn parse_discovery(
    raw: RawDiscovery,
    line: Option<usize>,
    at: Key,
    problems: &mut Vec<Problem>,
) -> Option<Discovery> {
    let discovery = read_discovery(raw, line, at, problems)?;
    if !discovery.is_built() {
        let feature = discovery.feature();
        problems.push(Problem::new(
            line,
            at.at(feature),
            format!("lb was built without the `{feature}` feature"),
        ));
    }
    Some(discovery)
}

/// [`parse_discovery`], whichever sources this build has.
fn read_discovery(
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
                node: None,
            })
        }
        (None, Some(d)) => {
            let (refresh_min, refresh_max) =
                refresh.unwrap_or((DEFAULT_DNS_REFRESH_MIN, DEFAULT_DNS_REFRESH_MAX));
            if refresh_min < MIN_DNS_REFRESH {
                return problem(
                    "refresh_min",
                    &format!(
                        "{refresh_min:?} is shorter than {MIN_DNS_REFRESH:?} (a record with a TTL of 0 would be asked for in a loop)"
                    ),
                );
            }
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

/// `[service.health]` (`at`: its table's key), over the defaults.
pub(super) fn parse_health(
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
        Some("dns") => CheckKind::Dns,
        Some("none") => CheckKind::None,
        Some(other) => {
            problem(
                "check",
                format!(
                    "{other:?} is not a check; use \"tcp\", \"http\", \"https\", \"dns\" or \"none\""
                ),
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
    parse_dns_question(&mut health, raw.query, raw.query_type, &mut problem);
    health
}

/// `query` and `query_type` of a DNS check: a name is required (a fully
/// qualified one: a trailing dot is added), the type is one of DNS's
/// (`A` by default). Either key set for another check is a problem.
fn parse_dns_question(
    health: &mut HealthConfig,
    query: Option<String>,
    query_type: Option<String>,
    problem: &mut impl FnMut(&str, String),
) {
    if health.check != CheckKind::Dns {
        for (key, set) in [("query", query.is_some()), ("query_type", query_type.is_some())] {
            if set {
                problem(key, "only applies to check = \"dns\"".to_owned());
            }
        }
        return;
    }
    match query {
        None => problem(
            "query",
            "check = \"dns\" needs the name to ask for, e.g. query = \"kubernetes.default.svc.cluster.local\"".to_owned(),
        ),
        Some(name) => match hickory_proto::rr::Name::from_ascii(&name) {
            Ok(parsed) if !name.is_empty() => {
                let mut parsed = parsed;
                parsed.set_fqdn(true);
                health.query = parsed.to_ascii();
            }
            _ => problem("query", format!("{name:?} is not a DNS name")),
        },
    }
    if let Some(text) = query_type {
        match text.to_ascii_uppercase().parse::<hickory_proto::rr::RecordType>() {
            Ok(hickory_proto::rr::RecordType::Unknown(_)) | Err(_) => {
                problem("query_type", format!("{text:?} is not a DNS record type like \"A\""));
            }
            Ok(record_type) => health.query_type = record_type.to_string(),
        }
    }
}

/// An address as written (`127.0.0.1:6443`, `[::1]:6443`); whether it can
/// be used is for the caller to check.
pub(super) fn parse_addr(
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
pub(super) fn parse_endpoint(
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
    use super::{
        super::testing::{GOOD, parse, problems},
        *,
    };

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
    fn a_dns_check_needs_a_name_and_takes_a_record_type() {
        let text = format!(
            "{GOOD}[service.health]\ncheck = \"dns\"\nquery = \"kube-dns.kube-system.svc.cluster.local\"\n"
        );
        let health = &parse(&text).unwrap().services[0].health;
        assert_eq!(health.check, CheckKind::Dns);
        assert_eq!(health.query, "kube-dns.kube-system.svc.cluster.local.");
        assert_eq!(health.query_type, "A");
        let text = format!(
            "{GOOD}[service.health]\ncheck = \"dns\"\nquery = \"example.org.\"\nquery_type = \"aaaa\"\n"
        );
        assert_eq!(parse(&text).unwrap().services[0].health.query_type, "AAAA");

        let msg = problems(&format!("{GOOD}[service.health]\ncheck = \"dns\"\n"));
        assert!(msg.contains("health.query: check = \"dns\" needs the name to ask for"), "{msg}");
        let msg = problems(&format!(
            "{GOOD}[service.health]\ncheck = \"dns\"\nquery = \"a..b\"\nquery_type = \"QQQ\"\n"
        ));
        assert!(msg.contains("health.query: \"a..b\" is not a DNS name"), "{msg}");
        assert!(msg.contains("health.query_type: \"QQQ\" is not a DNS record type"), "{msg}");
        let msg = problems(&format!("{GOOD}[service.health]\ncheck = \"tcp\"\nquery = \"x.\"\n"));
        assert!(msg.contains("health.query: only applies to check = \"dns\""), "{msg}");
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
    #[cfg(all(feature = "kubernetes", feature = "dns"))]
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
                debounce: DEFAULT_DEBOUNCE,
                node: None,
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
                "dns = { name = \"x\", port = 1 }\nrefresh_min = \"1ns\"\n",
                "discovery.refresh_min: 1ns is shorter than 1s",
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
    fn a_source_this_build_lacks_is_named() {
        for (source, built, table) in [
            (
                "kubernetes",
                cfg!(feature = "kubernetes"),
                "kubernetes = { namespace = \"default\", service = \"kubernetes\", port = \"https\" }",
            ),
            (
                "dns",
                cfg!(feature = "dns"),
                "dns = { name = \"api.example.internal\", port = 2379 }",
            ),
        ] {
            let result = parse(&format!("{GOOD}[service.discovery]\n{table}\n"));
            if built {
                assert_eq!(
                    result.unwrap().services[0].discovery.as_ref().unwrap().feature(),
                    source
                );
            } else {
                assert_eq!(
                    result.unwrap_err().to_string(),
                    format!(
                        "test.toml:11: service[0] (\"api\"): discovery.{source}: lb was built without the `{source}` feature"
                    )
                );
            }
        }
    }
}
