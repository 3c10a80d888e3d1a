//! What a test builds for the fake: EndpointSlices and their endpoints,
//! LoadBalancer Services, and a kubeconfig that points at it.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use k8s_openapi::{
    api::{
        core::v1::{Service, ServicePort, ServiceSpec},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// A kubeconfig file for a server URL, removed on drop.
pub struct Kubeconfig {
    path: PathBuf,
}

impl Kubeconfig {
    /// Writes a kubeconfig whose one cluster is `server`
    /// (e.g. `http://127.0.0.1:PORT`), with namespace `default`.
    pub fn write(server: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "lb-test-kubeconfig-{}-{}.yaml",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {server}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
        );
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        Self { path }
    }

    /// The kubeconfig file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Kubeconfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// An endpoint's conditions, as the EndpointSlice controller sets them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    /// ready, serving, not terminating.
    Ready,
    /// Not ready (starting, failing its readiness probe), not terminating.
    NotReady,
    /// Terminating but still serving (graceful shutdown).
    TerminatingServing,
    /// Terminating and no longer serving.
    TerminatingNotServing,
    /// No conditions at all (nil: ready).
    Unset,
}

/// An endpoint at `ip` on `node` with `condition`.
pub fn endpoint(ip: &str, node: &str, condition: Condition) -> Endpoint {
    let conditions = match condition {
        Condition::Ready => Some((true, true, false)),
        Condition::NotReady => Some((false, false, false)),
        Condition::TerminatingServing => Some((false, true, true)),
        Condition::TerminatingNotServing => Some((false, false, true)),
        Condition::Unset => None,
    }
    .map(|(ready, serving, terminating)| EndpointConditions {
        ready: Some(ready),
        serving: Some(serving),
        terminating: Some(terminating),
    });
    Endpoint {
        addresses: vec![ip.to_owned()],
        conditions,
        node_name: Some(node.to_owned()),
        ..Endpoint::default()
    }
}

/// An EndpointSlice `name` of the Service `service` in `default`, of
/// `address_type` (`IPv4`, `IPv6`), with `ports` (name, number).
pub fn endpoint_slice(
    name: &str,
    service: &str,
    address_type: &str,
    ports: &[(&str, u16)],
    endpoints: Vec<Endpoint>,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some("default".to_owned()),
            labels: Some(BTreeMap::from([(SERVICE_NAME_LABEL.to_owned(), service.to_owned())])),
            ..ObjectMeta::default()
        },
        address_type: address_type.to_owned(),
        ports: Some(
            ports
                .iter()
                .map(|(name, port)| EndpointPort {
                    name: Some((*name).to_owned()),
                    port: Some(i32::from(*port)),
                    protocol: Some("TCP".to_owned()),
                    ..EndpointPort::default()
                })
                .collect(),
        ),
        endpoints,
    }
}

/// A LoadBalancer Service `name` in `default`, of no class, with TCP
/// `ports` (name, port, the pods' target port).
pub fn load_balancer_service(name: &str, ports: &[(&str, u16, u16)]) -> Service {
    Service {
        metadata: ObjectMeta {
            namespace: Some("default".into()),
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            ports: Some(
                ports
                    .iter()
                    .map(|&(port_name, port, target)| ServicePort {
                        name: Some(port_name.to_owned()),
                        port: i32::from(port),
                        target_port: Some(IntOrString::Int(i32::from(target))),
                        ..ServicePort::default()
                    })
                    .collect(),
            ),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// The first address `service`'s status shows, if any.
pub fn ingress_ip(service: &Service) -> Option<String> {
    let ingress = service.status.as_ref()?.load_balancer.as_ref()?.ingress.as_ref()?;
    ingress.first()?.ip.clone()
}
