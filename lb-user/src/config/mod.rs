//! The configuration file (TOML): parsing, defaults and validation.
//!
//! Every error names the file, the key and what is wrong. Validation never
//! touches the kernel, so `lb check-config` and a reload can run it safely.
//!
//! The rooms, each using only those listed after it:
//! - `reparse`: a reload's parse of only the service tables that changed;
//! - `parse`: the file and its `[[service]]` tables, checked each on its
//!   own and then against one another; `values`: one value or sub-table
//!   (durations, addresses, `[service.health]`, `[service.discovery]`),
//!   `external`: `[service.external]`; `load_balancers`: `[[pool]]` and
//!   the LoadBalancer keys of `[kubernetes]`;
//! - `raw`: the file as written (serde); `paths`: the paths a client
//!   command needs, read leniently;
//! - `servers`: the one set of rules for a server list, whatever its
//!   source; `problems`: what is wrong with a file, and how it is worded;
//! - `model`: the validated configuration and its defaults.

mod bgp;
mod election;
mod external_service;
mod load_balancers;
mod model;
mod parse;
mod paths;
mod problems;
mod raw;
mod reparse;
mod servers;
mod values;

use std::path::Path;

pub use bgp::DEFAULT_ROUTES_OUTLIVE_DAEMON;
pub use model::{
    Announce, Bgp, BgpPeer, CheckKind, Config, DEFAULT_BPFFS, DEFAULT_CONFIG_PATH,
    DEFAULT_CONTROL_SOCKET, DEFAULT_DEBOUNCE, DEFAULT_DNS_REFRESH_MAX, DEFAULT_DNS_REFRESH_MIN,
    DEFAULT_HOLD_DOWN, DEFAULT_STATE_DIR, Daemon, Discovery, Election, External, HealthConfig,
    LeaseRef, LoadBalancers, Policy, PortRef, Scope, Service,
};
pub use paths::ClientPaths;
pub use problems::{ConfigError, Problem};
pub use reparse::{Read, Source};
pub use servers::{ServerProblem, Slot, check_servers, validate_servers};

/// The text of the config file `path`.
fn read_text(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError::unreadable(path, &e))
}

/// What the tests of several rooms share: a good file, and parsing one.
#[cfg(test)]
mod testing {
    use std::path::Path;

    use super::{Config, ConfigError};

    pub(super) fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("test.toml"))
    }

    pub(super) fn problems(text: &str) -> String {
        parse(text).expect_err("config should be rejected").to_string()
    }

    pub(super) const GOOD: &str = r#"
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
}
