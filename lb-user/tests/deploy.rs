//! The packaging in `deploy/` parses and carries the settings it must.

use std::path::{Path, PathBuf};

use lb_user::config::Config;
use serde::Deserialize as _;

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(path)
}

fn yaml(path: &str) -> serde_yaml::Value {
    let text = std::fs::read_to_string(deploy(path)).unwrap();
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn example_config_is_valid() {
    let config = Config::load(&deploy("config.toml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.services[0].name, "apiserver");
    assert!(config.daemon.metrics.is_some());
    assert!(
        config.services.iter().all(|s| !s.health.insecure_skip_verify),
        "the shipped example must verify certificates"
    );
}

#[test]
fn systemd_unit_is_type_notify_and_keeps_what_bpf_needs() {
    let unit = std::fs::read_to_string(deploy("lb.service")).unwrap();
    let settings: Vec<(&str, &str)> =
        unit.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split_once('=')).collect();
    let get = |key: &str| settings.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
    assert_eq!(get("Type"), Some("notify"));
    assert!(get("ExecStart").unwrap().ends_with("lb run --config /etc/lb/config.toml"));
    assert_eq!(get("ExecReload"), Some("/bin/kill -HUP $MAINPID"));
    let caps = get("CapabilityBoundingSet").unwrap();
    for cap in ["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"] {
        assert!(caps.contains(cap), "{cap} missing from CapabilityBoundingSet");
    }
    assert!(
        !caps.contains("CAP_SYS_ADMIN"),
        "bpffs is mounted by ExecStartPre=+, the daemon needs no CAP_SYS_ADMIN"
    );
    assert!(get("WatchdogSec").is_some(), "the daemon pings the watchdog from its owner loop");
    assert_eq!(
        get("ReadWritePaths"),
        Some("/sys/fs/bpf"),
        "pins must stay writable under ProtectSystem=strict"
    );
    assert!(
        get("RestrictAddressFamilies").unwrap().contains("AF_NETLINK"),
        "SOCK_DESTROY needs netlink"
    );
}

#[test]
fn daemonset_runs_on_the_host_network_with_only_the_capabilities_it_needs() {
    let ds = yaml("kubernetes/daemonset.yaml");
    assert_eq!(ds["kind"], "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    let container = &pod["containers"][0];
    let security = &container["securityContext"];
    assert_eq!(security["privileged"], false);
    assert_eq!(security["capabilities"]["drop"][0], "ALL");
    let added: Vec<&str> = security["capabilities"]["add"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|c| c.as_str())
        .collect();
    assert_eq!(added, ["BPF", "PERFMON", "NET_ADMIN"]);
    assert_eq!(security["seccompProfile"]["type"], "RuntimeDefault");
    let mounts: Vec<&str> = container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|m| m["mountPath"].as_str())
        .collect();
    for path in ["/sys/fs/bpf", "/sys/fs/cgroup", "/etc/lb"] {
        assert!(mounts.contains(&path), "{path} is not mounted");
    }
    let host_paths: Vec<&str> = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    assert!(host_paths.contains(&"/sys/fs/bpf") && host_paths.contains(&"/sys/fs/cgroup"));
    assert!(container["args"].as_sequence().unwrap().iter().any(|a| a == "run"));
}

#[test]
fn rbac_allows_only_listing_and_watching_endpointslices() {
    let text = std::fs::read_to_string(deploy("kubernetes/rbac.yaml")).unwrap();
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_yaml::Value::deserialize(d).unwrap())
        .collect();
    let role = docs.iter().find(|d| d["kind"] == "ClusterRole").expect("a ClusterRole");
    let rules = role["rules"].as_sequence().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0]["apiGroups"][0], "discovery.k8s.io");
    assert_eq!(rules[0]["resources"].as_sequence().unwrap().len(), 1);
    assert_eq!(rules[0]["resources"][0], "endpointslices");
    let verbs: Vec<&str> =
        rules[0]["verbs"].as_sequence().unwrap().iter().filter_map(|v| v.as_str()).collect();
    assert_eq!(verbs, ["list", "watch"]);
    let ds = yaml("kubernetes/daemonset.yaml");
    let account = docs.iter().find(|d| d["kind"] == "ServiceAccount").expect("a ServiceAccount");
    assert_eq!(ds["spec"]["template"]["spec"]["serviceAccountName"], account["metadata"]["name"]);
}

#[test]
fn configmap_carries_a_valid_config() {
    let cm = yaml("kubernetes/configmap.yaml");
    assert_eq!(cm["kind"], "ConfigMap");
    let text = cm["data"]["config.toml"].as_str().unwrap();
    Config::parse(text, Path::new("configmap.yaml:config.toml")).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn containerfile_builds_the_binary() {
    let text = std::fs::read_to_string(deploy("Containerfile")).unwrap();
    assert!(
        text.contains("cargo xtask build-ebpf"),
        "the toolchain is installed by xtask, not the build script"
    );
    assert!(text.contains("cargo build --release --package lb-user"));
    assert!(text.contains("rust-src"));
}
