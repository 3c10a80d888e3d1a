//! A Kubernetes Service, read as the allocator's [`Wish`]: whether it is
//! lb's to serve (`spec.type`, `spec.loadBalancerClass`), the addresses
//! and pool it asks for (lb's annotations, or MetalLB's, so that a cluster
//! moves from MetalLB without editing its Services), its sharing key, its
//! families, its ports and what its status already shows.
//!
//! A Service is untrusted input: whatever its annotations say, reading it
//! ends in a [`Wish`] or a [`Refusal`] that names the field, never in a
//! panic.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;

use super::{
    Served, ServedPort,
    allocate::{Families, PortKey, Refusal, ServiceRef, Wish},
    pools::{Family, Pool},
};

/// The `spec.loadBalancerClass` of the Services lb serves.
pub const CLASS: &str = "lb.dev/lb";

/// lb's annotation for the addresses a Service asks for: a comma-separated
/// list, at most one per family.
pub const IPS: &str = "lb.dev/load-balancer-ips";
/// lb's annotation naming the pool a Service draws from.
pub const POOL: &str = "lb.dev/address-pool";
/// lb's annotation with a sharing key: Services with the same key may
/// share an address when no port clashes.
pub const SHARING: &str = "lb.dev/allow-shared-ip";

/// MetalLB's annotations, read with the same meaning as lb's.
pub const METALLB_IPS: &str = "metallb.universe.tf/loadBalancerIPs";
/// MetalLB's pool annotation.
pub const METALLB_POOL: &str = "metallb.universe.tf/address-pool";
/// MetalLB's sharing annotation.
pub const METALLB_SHARING: &str = "metallb.universe.tf/allow-shared-ip";

/// Whether `service` is a LoadBalancer Service lb serves: of lb's class,
/// or of no class when `default_class` (`[kubernetes] default_class`).
pub fn is_ours(service: &Service, default_class: bool) -> bool {
    let Some(spec) = &service.spec else { return false };
    spec.type_.as_deref() == Some("LoadBalancer")
        && match spec.load_balancer_class.as_deref() {
            Some(class) => class == CLASS,
            None => default_class,
        }
}

/// What `service` asks of the allocator.
pub fn wish(service: &Service) -> Result<Wish, Refusal> {
    let meta = &service.metadata;
    let (Some(namespace), Some(name)) = (&meta.namespace, &meta.name) else {
        return Err(unreadable("the Service has no namespace or name"));
    };
    let spec = service.spec.as_ref().ok_or_else(|| unreadable("the Service has no spec"))?;
    let created = meta.creation_timestamp.as_ref().map_or(0, |t| t.0.as_second());

    let mut requested = match annotation(service, IPS, METALLB_IPS)? {
        Some(list) => parse_ips(&list)?,
        None => Vec::new(),
    };
    if let Some(ip) = spec.load_balancer_ip.as_deref().filter(|ip| !ip.is_empty()) {
        if !requested.is_empty() {
            return Err(unreadable(&format!(
                "spec.loadBalancerIP and the {IPS} annotation both ask for addresses: keep one"
            )));
        }
        requested = parse_ips(ip)
            .map_err(|_| unreadable(&format!("spec.loadBalancerIP {ip:?} is not an IP address")))?;
    }

    let mut ports = Vec::new();
    for port in spec.ports.iter().flatten() {
        let udp = match port.protocol.as_deref().unwrap_or("TCP") {
            "TCP" => false,
            "UDP" => true,
            other => {
                return Err(unreadable(&format!(
                    "port {} is {other}: lb serves TCP and UDP",
                    port.port
                )));
            }
        };
        let number = u16::try_from(port.port)
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| unreadable(&format!("port {} is not a port number", port.port)))?;
        ports.push(PortKey { udp, port: number });
    }
    if ports.is_empty() {
        return Err(unreadable("the Service has no ports"));
    }

    Ok(Wish {
        service: ServiceRef { namespace: namespace.clone(), name: name.clone() },
        created,
        families: families(spec.ip_families.as_deref(), spec.ip_family_policy.as_deref())?,
        requested,
        pool: annotation(service, POOL, METALLB_POOL)?,
        sharing: annotation(service, SHARING, METALLB_SHARING)?,
        ports,
        held: ingress_ips(service),
    })
}

/// What the nodes serve for `service` (one of lb's), if anything: `None`
/// while its status shows no address of `pools`.
pub fn served(service: &Service, pools: &[Pool]) -> Option<Served> {
    let meta = &service.metadata;
    let service_ref = ServiceRef { namespace: meta.namespace.clone()?, name: meta.name.clone()? };
    let addresses: Vec<IpAddr> = ingress_ips(service)
        .into_iter()
        .filter(|&ip| pools.iter().any(|p| p.contains(ip)))
        .collect();
    let mut ports: Vec<ServedPort> = Vec::new();
    for port in service.spec.as_ref()?.ports.iter().flatten() {
        let Some(number) = u16::try_from(port.port).ok().filter(|&p| p != 0) else { continue };
        if !ports.iter().any(|p| p.port == number) {
            ports.push(ServedPort { name: port.name.clone().unwrap_or_default(), port: number });
        }
    }
    let spec = service.spec.as_ref()?;
    let local = spec.external_traffic_policy.as_deref() == Some("Local");
    let health_check_node_port = spec
        .health_check_node_port
        .and_then(|p| u16::try_from(p).ok())
        .filter(|&p| local && p != 0);
    (!addresses.is_empty() && !ports.is_empty()).then_some(Served {
        service: service_ref,
        addresses,
        ports,
        local,
        health_check_node_port,
        client_affinity: spec.session_affinity.as_deref() == Some("ClientIP"),
    })
}

/// The addresses `service`'s status shows. An entry lb did not write (a
/// hostname, an address that does not parse) is not one it holds.
pub fn ingress_ips(service: &Service) -> Vec<IpAddr> {
    service
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|ingress| ingress.ip.as_deref()?.parse().ok())
        .collect()
}

fn unreadable(why: &str) -> Refusal {
    Refusal::Unreadable(why.to_owned())
}

/// lb's annotation `ours`, else MetalLB's `theirs`; both set and differing
/// is an error (which one the user meant is not ours to guess).
fn annotation(service: &Service, ours: &str, theirs: &str) -> Result<Option<String>, Refusal> {
    let annotations = service.metadata.annotations.as_ref();
    let read = |key: &str| annotations.and_then(|a| a.get(key)).map(|v| v.trim().to_owned());
    match (read(ours), read(theirs)) {
        (Some(a), Some(b)) if a != b => Err(unreadable(&format!(
            "annotations {ours} ({a:?}) and {theirs} ({b:?}) disagree: keep one"
        ))),
        (Some(value), _) | (None, Some(value)) if value.is_empty() => {
            Err(unreadable(&format!("annotation {ours} is empty")))
        }
        (Some(value), _) | (None, Some(value)) => Ok(Some(value)),
        (None, None) => Ok(None),
    }
}

/// A comma-separated list of addresses, at most one per family.
fn parse_ips(list: &str) -> Result<Vec<IpAddr>, Refusal> {
    let mut ips: Vec<IpAddr> = Vec::new();
    for text in list.split(',').map(str::trim) {
        let ip: IpAddr = text.parse().map_err(|_| {
            unreadable(&format!("{text:?} in the requested addresses is not an IP address"))
        })?;
        if ips.iter().any(|&other| Family::of(other) == Family::of(ip)) {
            return Err(unreadable(&format!(
                "the requested addresses {list:?} name two {} addresses: one per family",
                Family::of(ip)
            )));
        }
        ips.push(ip);
    }
    Ok(ips)
}

/// `spec.ipFamilies` and `spec.ipFamilyPolicy` (the API server fills both;
/// a Service without them is IPv4, single-stack).
fn families(listed: Option<&[String]>, policy: Option<&str>) -> Result<Families, Refusal> {
    let mut families = Vec::new();
    for name in listed.unwrap_or_default() {
        families.push(match name.as_str() {
            "IPv4" => Family::V4,
            "IPv6" => Family::V6,
            other => return Err(unreadable(&format!("spec.ipFamilies has {other:?}"))),
        });
    }
    let first = families.first().copied().unwrap_or(Family::V4);
    let other = match first {
        Family::V4 => Family::V6,
        Family::V6 => Family::V4,
    };
    match policy.unwrap_or("SingleStack") {
        "SingleStack" => Ok(Families::Single(first)),
        "PreferDualStack" if families.len() < 2 => Ok(Families::Single(first)),
        "PreferDualStack" => Ok(Families::PreferDual(first, other)),
        "RequireDualStack" => Ok(Families::RequireDual(first, other)),
        other => Err(unreadable(&format!("spec.ipFamilyPolicy {other:?} is not a policy"))),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::core::v1::{
            LoadBalancerIngress, LoadBalancerStatus, ServicePort, ServiceSpec, ServiceStatus,
        },
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    fn service(annotations: &[(&str, &str)], spec: ServiceSpec) -> Service {
        Service {
            metadata: ObjectMeta {
                namespace: Some("shop".into()),
                name: Some("web".into()),
                annotations: Some(
                    annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                ),
                ..Default::default()
            },
            spec: Some(spec),
            status: None,
        }
    }

    fn spec() -> ServiceSpec {
        ServiceSpec {
            type_: Some("LoadBalancer".into()),
            ports: Some(vec![
                ServicePort { port: 80, ..Default::default() },
                ServicePort { port: 53, protocol: Some("UDP".into()), ..Default::default() },
            ]),
            ..Default::default()
        }
    }

    fn refused(service: &Service) -> String {
        wish(service).unwrap_err().to_string()
    }

    #[test]
    fn only_load_balancer_services_of_our_class_or_none_by_choice_are_ours() {
        let plain = service(&[], spec());
        assert!(is_ours(&plain, true) && !is_ours(&plain, false));
        let ours = service(&[], ServiceSpec { load_balancer_class: Some(CLASS.into()), ..spec() });
        assert!(is_ours(&ours, false));
        let metallb =
            service(&[], ServiceSpec { load_balancer_class: Some("metallb".into()), ..spec() });
        assert!(!is_ours(&metallb, true), "another balancer's class is never ours");
        let cluster_ip = service(&[], ServiceSpec { type_: Some("ClusterIP".into()), ..spec() });
        assert!(!is_ours(&cluster_ip, true));
    }

    #[test]
    fn a_service_is_read_with_its_ports_families_and_status() {
        let mut svc = service(
            &[(METALLB_POOL, "default"), (SHARING, "dns")],
            ServiceSpec {
                ip_families: Some(vec!["IPv6".into(), "IPv4".into()]),
                ip_family_policy: Some("PreferDualStack".into()),
                ..spec()
            },
        );
        svc.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(vec![
                    LoadBalancerIngress { ip: Some("198.18.1.100".into()), ..Default::default() },
                    LoadBalancerIngress {
                        hostname: Some("lb.example".into()),
                        ..Default::default()
                    },
                ]),
            }),
            ..Default::default()
        });
        let wish = wish(&svc).unwrap();
        assert_eq!(wish.service.to_string(), "shop/web");
        assert_eq!(wish.families, Families::PreferDual(Family::V6, Family::V4));
        assert_eq!(wish.pool.as_deref(), Some("default"), "MetalLB's annotation is read");
        assert_eq!(wish.sharing.as_deref(), Some("dns"));
        assert_eq!(wish.ports, [PortKey { udp: false, port: 80 }, PortKey { udp: true, port: 53 }]);
        assert_eq!(wish.held, ["198.18.1.100".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn requested_addresses_come_from_either_annotation_or_the_spec_but_one() {
        let dual = service(&[(METALLB_IPS, "198.18.1.105, fd00:198:18::105")], spec());
        assert_eq!(wish(&dual).unwrap().requested.len(), 2);
        let legacy =
            service(&[], ServiceSpec { load_balancer_ip: Some("198.18.1.106".into()), ..spec() });
        assert_eq!(wish(&legacy).unwrap().requested, ["198.18.1.106".parse::<IpAddr>().unwrap()]);
        let both = service(
            &[(IPS, "198.18.1.105")],
            ServiceSpec { load_balancer_ip: Some("198.18.1.106".into()), ..spec() },
        );
        assert!(refused(&both).contains("both ask for addresses"), "{}", refused(&both));
        let same = service(&[(IPS, "198.18.1.105"), (METALLB_IPS, "198.18.1.105")], spec());
        assert!(wish(&same).is_ok(), "lb's and MetalLB's may say the same");
    }

    #[test]
    fn only_addresses_of_a_pool_are_served_each_port_number_once() {
        let pools = [Pool::new("default", &["198.18.1.100/30"]).unwrap()];
        let ingress = |ips: &[&str]| ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(
                    ips.iter()
                        .map(|ip| LoadBalancerIngress {
                            ip: Some((*ip).into()),
                            ..Default::default()
                        })
                        .collect(),
                ),
            }),
            ..Default::default()
        };
        let mut svc = service(&[], spec());
        svc.spec.as_mut().unwrap().ports.as_mut().unwrap().push(ServicePort {
            name: Some("dns-tcp".into()),
            port: 53,
            ..Default::default()
        });
        assert_eq!(served(&svc, &pools), None, "no address yet");
        // One written by hand outside every pool: never served.
        svc.status = Some(ingress(&["198.18.1.101", "203.0.113.7"]));
        let served = served(&svc, &pools).unwrap();
        assert_eq!(served.addresses, ["198.18.1.101".parse::<IpAddr>().unwrap()]);
        let ports: Vec<(&str, u16)> =
            served.ports.iter().map(|p| (p.name.as_str(), p.port)).collect();
        assert_eq!(ports, [("", 80), ("", 53)], "53 once, for TCP and UDP, by its first name");
        assert!(
            !served.local && !served.client_affinity && served.health_check_node_port.is_none()
        );
        // The traffic policies, read; a health port only with `Local`.
        let spec = svc.spec.as_mut().unwrap();
        spec.health_check_node_port = Some(31_000);
        spec.session_affinity = Some("ClientIP".into());
        assert_eq!(super::served(&svc, &pools).unwrap().health_check_node_port, None, "Cluster");
        svc.spec.as_mut().unwrap().external_traffic_policy = Some("Local".into());
        let local = super::served(&svc, &pools).unwrap();
        assert!(local.local && local.client_affinity);
        assert_eq!(local.health_check_node_port, Some(31_000));
        svc.spec.as_mut().unwrap().health_check_node_port = Some(70_000);
        assert_eq!(super::served(&svc, &pools).unwrap().health_check_node_port, None, "no port");
        svc.status = Some(ingress(&["203.0.113.7"]));
        assert_eq!(super::served(&svc, &pools), None);
    }

    #[test]
    fn malformed_services_are_refused_with_the_field_never_a_panic() {
        for (annotations, spec, why) in [
            (vec![(IPS, "198.18.1.1, 198.18.1.2")], spec(), "two IPv4 addresses"),
            (vec![(IPS, "not-an-ip")], spec(), "\"not-an-ip\" in the requested addresses"),
            (vec![(IPS, "")], spec(), "annotation lb.dev/load-balancer-ips is empty"),
            (vec![(POOL, "a"), (METALLB_POOL, "b")], spec(), "disagree"),
            (
                vec![],
                ServiceSpec { load_balancer_ip: Some("x".into()), ..spec() },
                "spec.loadBalancerIP \"x\"",
            ),
            (
                vec![],
                ServiceSpec { ip_family_policy: Some("Both".into()), ..spec() },
                "spec.ipFamilyPolicy \"Both\"",
            ),
            (
                vec![],
                ServiceSpec { ip_families: Some(vec!["IPv5".into()]), ..spec() },
                "spec.ipFamilies has \"IPv5\"",
            ),
            (
                vec![],
                ServiceSpec {
                    ports: Some(vec![ServicePort {
                        port: 9,
                        protocol: Some("SCTP".into()),
                        ..Default::default()
                    }]),
                    ..spec()
                },
                "port 9 is SCTP",
            ),
            (
                vec![],
                ServiceSpec {
                    ports: Some(vec![ServicePort { port: 70_000, ..Default::default() }]),
                    ..spec()
                },
                "port 70000 is not a port number",
            ),
            (vec![], ServiceSpec { ports: None, ..spec() }, "no ports"),
        ] {
            let svc = service(&annotations, spec);
            assert!(refused(&svc).contains(why), "{why}: {}", refused(&svc));
        }
        let mut nameless = service(&[], spec());
        nameless.metadata.name = None;
        assert!(refused(&nameless).contains("no namespace or name"));
    }
}
