//! The file as written (serde), before any value is checked. Unknown keys
//! are errors: a typo must not silently fall back to a default.

use std::path::PathBuf;

use serde::Deserialize;
use toml::Spanned;

/// The whole file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) daemon: RawDaemon,
    /// `[kubernetes]`.
    pub(super) kubernetes: Option<RawKubernetesSettings>,
    #[serde(default)]
    pub(super) service: Vec<Spanned<RawService>>,
    /// `[[pool]]`.
    #[serde(default)]
    pub(super) pool: Vec<Spanned<RawPool>>,
    /// `[bgp]`.
    pub(super) bgp: Option<RawBgp>,
}

/// `[bgp]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBgp {
    pub(super) asn: i64,
    pub(super) router_id: Option<String>,
    pub(super) speaker: Option<PathBuf>,
    pub(super) routes_outlive_daemon: Option<String>,
    #[serde(default)]
    pub(super) peer: Vec<RawBgpPeer>,
}

/// One `[[bgp.peer]]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBgpPeer {
    pub(super) address: String,
    pub(super) asn: i64,
    pub(super) bfd: Option<bool>,
}

/// One `[[pool]]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPool {
    pub(super) name: String,
    #[serde(default)]
    pub(super) addresses: Vec<String>,
    pub(super) auto_assign: Option<bool>,
    pub(super) namespaces: Option<Vec<String>>,
    pub(super) announce: Option<String>,
}

/// `[daemon]`.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDaemon {
    pub(super) cgroup: Option<PathBuf>,
    pub(super) bpffs: Option<PathBuf>,
    pub(super) control_socket: Option<PathBuf>,
    pub(super) state_dir: Option<PathBuf>,
    pub(super) metrics: Option<String>,
    pub(super) kubeconfig: Option<PathBuf>,
    pub(super) socket_table: Option<i64>,
    pub(super) flow_table: Option<i64>,
    pub(super) new_flows_per_cpu: Option<i64>,
    pub(super) nat_ports: Option<String>,
    pub(super) nat_addresses: Option<Vec<String>>,
    pub(super) node_name: Option<String>,
    pub(super) lease_duration: Option<String>,
    pub(super) lease_renew: Option<String>,
    pub(super) lease_retry: Option<String>,
}

/// One `[[service]]` table, each value with where it is in the text.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawService {
    pub(super) name: Spanned<String>,
    pub(super) vip: Spanned<String>,
    pub(super) servers: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) default: Option<Spanned<String>>,
    pub(super) policy: Option<Spanned<String>>,
    pub(super) hold_down: Option<Spanned<String>>,
    pub(super) health: Option<Spanned<RawHealth>>,
    pub(super) discovery: Option<Spanned<RawDiscovery>>,
    pub(super) scope: Option<Spanned<String>>,
    pub(super) external: Option<Spanned<RawExternal>>,
}

/// `[service.external]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawExternal {
    pub(super) interfaces: Vec<String>,
    pub(super) announce: Option<String>,
    pub(super) lease: Option<RawLease>,
    pub(super) elect: Option<bool>,
    pub(super) keep_client_address: Option<bool>,
    pub(super) client_affinity: Option<bool>,
}

/// `[kubernetes]`: where lb keeps what it shares with the other nodes.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKubernetesSettings {
    pub(super) namespace: Option<String>,
    pub(super) membership_duration: Option<String>,
    pub(super) membership_renew: Option<String>,
    pub(super) default_class: Option<bool>,
    pub(super) interfaces: Option<Vec<String>>,
}

/// `[service.external] lease`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLease {
    pub(super) namespace: String,
    pub(super) name: String,
}

/// `[service.discovery]`.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDiscovery {
    pub(super) kubernetes: Option<RawKubernetes>,
    pub(super) dns: Option<RawDns>,
    pub(super) debounce: Option<String>,
    pub(super) refresh_min: Option<String>,
    pub(super) refresh_max: Option<String>,
}

/// `[service.discovery] kubernetes = { .. }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKubernetes {
    pub(super) namespace: String,
    pub(super) service: String,
    pub(super) port: RawPort,
}

/// A Service port, by number or name, before it is checked.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum RawPort {
    Number(i64),
    Name(String),
}

/// `[service.discovery] dns = { .. }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDns {
    pub(super) name: String,
    pub(super) port: i64,
}

/// `[service.health]`.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHealth {
    pub(super) check: Option<String>,
    pub(super) path: Option<String>,
    pub(super) interval: Option<String>,
    pub(super) timeout: Option<String>,
    pub(super) rise: Option<u32>,
    pub(super) fall: Option<u32>,
    pub(super) status: Option<String>,
    pub(super) ca_file: Option<PathBuf>,
    pub(super) cert_file: Option<PathBuf>,
    pub(super) key_file: Option<PathBuf>,
    pub(super) server_name: Option<String>,
    pub(super) insecure_skip_verify: Option<bool>,
    pub(super) query: Option<String>,
    pub(super) query_type: Option<String>,
}
