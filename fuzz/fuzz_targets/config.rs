//! `Config::parse` on any UTF-8 text: never panics. An error names at
//! least one problem, each at a line of the text; a config that parses
//! holds the invariants the daemon relies on without checking again.
#![no_main]

use std::{collections::HashSet, net::SocketAddr, path::Path};

use lb_user::config::{CheckKind, Config, Policy, validate_servers};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let config = match Config::parse(text, Path::new("fuzz.toml")) {
        Ok(config) => config,
        Err(error) => {
            assert!(!error.problems.is_empty(), "an error without a problem");
            let lines = text.bytes().filter(|b| *b == b'\n').count() + 1;
            for problem in &error.problems {
                assert!(
                    problem.line.is_none_or(|line| (1..=lines).contains(&line)),
                    "{problem:?} is past the end of the text"
                );
            }
            let _ = error.to_string();
            return;
        }
    };
    for path in [&config.daemon.bpffs, &config.daemon.control_socket] {
        assert!(path.is_absolute(), "{path:?}");
    }
    if let Some(metrics) = config.daemon.metrics {
        assert!(usable_endpoint(metrics), "metrics {metrics}");
    }
    let vips: Vec<SocketAddr> = config.services.iter().map(|s| s.vip).collect();
    let names: HashSet<&str> = config.services.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names.len(), config.services.len(), "duplicate service names");
    assert_eq!(vips.iter().collect::<HashSet<_>>().len(), vips.len(), "duplicate VIPs");
    for service in &config.services {
        assert!(!service.name.is_empty());
        assert!(usable_endpoint(service.vip), "VIP {}", service.vip);
        assert!(
            !service.servers.is_empty() || service.default.is_some() || service.discovery.is_some(),
            "{} has no source of servers",
            service.name
        );
        // The one check every other source of servers (`lb servers`, the
        // state file, discovery) is held to passes for the config's own.
        let owner = |addr: SocketAddr| vips.contains(&addr).then(|| "a VIP".to_owned());
        if let Err(e) = validate_servers(service.vip, &service.servers, service.default, owner) {
            panic!("service {:?} parsed, but its servers fail validate_servers: {e}", service.name);
        }
        assert!(!service.hold_down.is_zero());
        assert!(
            u64::try_from(service.hold_down.as_nanos()).is_ok(),
            "hold_down does not fit the kernel's u64"
        );
        let health = &service.health;
        assert!(
            !health.interval.is_zero()
                && !health.timeout.is_zero()
                && health.timeout <= health.interval
        );
        assert!((1..=100).contains(&health.rise) && (1..=100).contains(&health.fall));
        assert!(
            100 <= health.status.0 && health.status.0 <= health.status.1 && health.status.1 <= 599
        );
        assert!(health.path.starts_with('/'));
        if health.check != CheckKind::Https {
            assert!(
                health.ca_file.is_none()
                    && health.cert_file.is_none()
                    && health.server_name.is_none()
                    && !health.insecure_skip_verify
            );
        }
        assert_eq!(health.cert_file.is_some(), health.key_file.is_some());
        let _ = (service.policy == Policy::Spread, service.scope.to_string());
    }
});

/// An address one can dial or listen on: neither port 0 nor unspecified.
fn usable_endpoint(addr: SocketAddr) -> bool {
    addr.port() != 0 && !addr.ip().is_unspecified()
}
