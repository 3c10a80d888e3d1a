//! The packaging in `deploy/` parses and carries the settings it must.

use std::path::{Path, PathBuf};

use lb_user::config::{Config, Discovery};
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
    // `lb detach` is final: the daemon it stops is not restarted.
    assert_eq!(get("Restart"), Some("always"));
    assert_eq!(
        get("RestartPreventExitStatus"),
        Some(lb_user::detach::EXIT_DETACHED.to_string().as_str())
    );
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
    for path in ["/sys/fs/bpf/lb", "/sys/fs/cgroup", "/etc/lb"] {
        assert!(mounts.contains(&path), "{path} is not mounted");
    }
    let host_paths: Vec<&str> = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    assert!(host_paths.contains(&"/sys/fs/cgroup"));
    // Least privilege: lb's own folder of the host's bpffs, not all of it
    // (other programs' pins are none of lb's business), and the one the
    // config pins under.
    assert!(!host_paths.contains(&"/sys/fs/bpf"), "all of the host's bpffs is mounted");
    let config = configmap_config();
    let bpffs = config.daemon.bpffs.to_str().unwrap();
    assert!(host_paths.contains(&bpffs) && mounts.contains(&bpffs), "{bpffs} is not mounted");
    assert!(container["args"].as_sequence().unwrap().iter().any(|a| a == "run"));
    // Without the host's PID 1, lb cannot tell its network namespace is the
    // host's on 5.10-5.13, and scope = "host" acts as "all".
    assert_eq!(pod["hostPID"], true);
    let probe = &container["livenessProbe"];
    assert!(
        probe["timeoutSeconds"].as_u64().is_some_and(|t| t >= 5),
        "the liveness probe's timeout (default 1 s) restarts a busy, healthy lb: {probe:?}"
    );
}

/// Least privilege: a Role and RoleBinding in each namespace the shipped
/// config's discovery names, and nothing cluster-wide. Besides, for the
/// elections by lease, one Role for their Leases: get and update on the
/// Leases it names (never an empty list of names, which means all of
/// them), create (which Kubernetes cannot scope by name), no delete,
/// nothing else; for the elections by membership, one Role in lb's
/// namespace: list, watch, create and update its Leases, no get, no
/// delete.
#[test]
fn rbac_allows_only_listing_and_watching_endpointslices_where_discovery_looks() {
    let text = std::fs::read_to_string(deploy("kubernetes/rbac.yaml")).unwrap();
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_yaml::Value::deserialize(d).unwrap())
        .collect();
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert!(
        !kinds.iter().any(|k| k.starts_with("Cluster")),
        "cluster-wide rights where the config's namespaces do: {kinds:?}"
    );
    let of_kind = |kind: &'static str| docs.iter().filter(move |d| d["kind"] == kind);
    let namespace = |d: &serde_yaml::Value| d["metadata"]["namespace"].as_str().unwrap().to_owned();
    let (mut leases, mut membership) = (0, 0);
    let verbs = |rule: &serde_yaml::Value| -> Vec<String> {
        rule["verbs"]
            .as_sequence()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .map(str::to_owned)
            .collect()
    };
    for role in of_kind("Role") {
        let rules = role["rules"].as_sequence().unwrap();
        for rule in rules {
            assert_eq!(rule["resources"].as_sequence().unwrap().len(), 1);
        }
        if rules[0]["apiGroups"][0] == "coordination.k8s.io"
            && role["metadata"]["name"] == "lb-membership"
        {
            // The membership Leases: each node's own, in lb's namespace.
            assert_eq!(rules.len(), 1);
            assert_eq!(rules[0]["resources"][0], "leases");
            assert_eq!(verbs(&rules[0]), ["list", "watch", "create", "update"]);
            membership += 1;
            continue;
        }
        if rules[0]["apiGroups"][0] == "coordination.k8s.io" {
            assert_eq!(rules.len(), 2);
            for rule in rules {
                assert_eq!(rule["apiGroups"][0], "coordination.k8s.io");
                assert_eq!(rule["resources"][0], "leases");
            }
            assert_eq!(verbs(&rules[0]), ["get", "update"]);
            let names = rules[0]["resourceNames"].as_sequence().map_or(0, Vec::len);
            assert!(names > 0, "get and update on every Lease: {:?}", rules[0]);
            assert_eq!(verbs(&rules[1]), ["create"]);
            leases += 1;
            continue;
        }
        assert_eq!(rules.len(), 1);
        let verbs = verbs(&rules[0]);
        assert_eq!(rules[0]["apiGroups"][0], "discovery.k8s.io");
        assert_eq!(rules[0]["resources"][0], "endpointslices");
        assert_eq!(verbs, ["list", "watch"]);
    }
    assert_eq!(leases, 1, "one Role for the elections' Leases");
    assert_eq!(membership, 1, "one Role for the membership Leases");
    let ds = yaml("kubernetes/daemonset.yaml");
    let account = docs.iter().find(|d| d["kind"] == "ServiceAccount").expect("a ServiceAccount");
    assert_eq!(ds["spec"]["template"]["spec"]["serviceAccountName"], account["metadata"]["name"]);
    let bound: Vec<String> = of_kind("RoleBinding")
        .filter(|b| {
            b["roleRef"]["kind"] == "Role"
                && b["subjects"][0]["name"] == account["metadata"]["name"]
                && b["subjects"][0]["namespace"] == account["metadata"]["namespace"]
                && of_kind("Role").any(|r| {
                    r["metadata"]["name"] == b["roleRef"]["name"] && namespace(r) == namespace(b)
                })
        })
        .map(namespace)
        .collect();
    let wanted: Vec<String> = configmap_config()
        .services
        .iter()
        .filter_map(|s| match &s.discovery {
            Some(Discovery::Kubernetes { namespace, .. }) => Some(namespace.clone()),
            _ => None,
        })
        .collect();
    assert!(!wanted.is_empty(), "the shipped config follows the apiservers");
    for namespace in wanted {
        assert!(bound.contains(&namespace), "no Role bound to lb in {namespace}: {bound:?}");
    }
}

#[test]
fn loadbalancer_rbac_is_cluster_wide_but_no_wider_than_the_job() {
    let text = std::fs::read_to_string(deploy("kubernetes/rbac-loadbalancer.yaml")).unwrap();
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_yaml::Value::deserialize(d).unwrap())
        .collect();
    let role = docs.iter().find(|d| d["kind"] == "ClusterRole").expect("a ClusterRole");
    let rules: Vec<(String, String, Vec<String>)> = role["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|rule| {
            let one = |key: &str| {
                let list = rule[key].as_sequence().unwrap();
                assert_eq!(list.len(), 1, "one {key} per rule: {rule:?}");
                list[0].as_str().unwrap().to_owned()
            };
            assert!(rule.get("resourceNames").is_none());
            let verbs = rule["verbs"].as_sequence().unwrap();
            (
                one("apiGroups"),
                one("resources"),
                verbs.iter().map(|v| v.as_str().unwrap().to_owned()).collect(),
            )
        })
        .collect();
    let rule = |group: &str, resource: &str, verbs: &[&str]| {
        (group.to_owned(), resource.to_owned(), verbs.iter().map(|v| (*v).to_owned()).collect())
    };
    assert_eq!(
        rules,
        [
            rule("", "services", &["list", "watch"]),
            rule("", "services/status", &["patch"]),
            rule("events.k8s.io", "events", &["create", "patch"]),
            rule("discovery.k8s.io", "endpointslices", &["list", "watch"]),
        ]
    );
    let binding = docs.iter().find(|d| d["kind"] == "ClusterRoleBinding").expect("a binding");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    let ds = yaml("kubernetes/daemonset.yaml");
    assert_eq!(
        binding["subjects"][0]["name"],
        ds["spec"]["template"]["spec"]["serviceAccountName"]
    );
}

/// The config the DaemonSet runs (`configmap.yaml`).
fn configmap_config() -> Config {
    let cm = yaml("kubernetes/configmap.yaml");
    let text = cm["data"]["config.toml"].as_str().unwrap();
    Config::parse(text, Path::new("configmap.yaml:config.toml")).unwrap_or_else(|e| panic!("{e}"))
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
