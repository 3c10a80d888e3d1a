//! What a Service's EndpointSlices say its servers are: the slices merged
//! into one list (`endpoints_of`):
//! - only slices whose `addressType` is the VIP's family (a dual-stack
//!   Service has one slice per family), and of each slice the port named
//!   (or numbered) in the config. A slice lists the endpoints' own
//!   (target) ports, so a number is matched against those, not against the
//!   Service's port (`default/kubernetes` has port 443 named `https`, its
//!   slice lists 6443 named `https`): a name follows a Service port;
//! - each endpoint judged by its own conditions, never by its node (MetalLB
//!   474), which counts only for a Service whose traffic stays on the
//!   node that receives it (`externalTrafficPolicy: Local`: the node's
//!   own endpoints, and no other): `ready` (nil counts as ready) → [`Readiness::Ready`]; not ready
//!   but `serving` (nil: as ready) → [`Readiness::Serving`] (terminating,
//!   drained); not serving → left out. Of an endpoint's addresses only the
//!   first is used, as kube-proxy does;
//! - ranked and cut to the best 16 by `super::forward::rank`.

use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointSlice};

use super::{Endpoint, forward::rank};
use crate::{balancer::Readiness, config::PortRef};

/// The Service's endpoints, merged over all its slices: those of the VIP's
/// family, on the configured port, by their conditions (and on `node`
/// alone, if given: `externalTrafficPolicy: Local`); ranked, at most 16,
/// and how many more were left out.
pub(crate) fn endpoints_of<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    vip: SocketAddr,
    port: &PortRef,
    node: Option<&str>,
) -> (Vec<Endpoint>, usize) {
    let family = if vip.is_ipv4() { "IPv4" } else { "IPv6" };
    let mut found = Vec::new();
    for slice in slices {
        if slice.address_type != family {
            continue;
        }
        let Some(port) = port_of(slice, port) else {
            continue;
        };
        for endpoint in &slice.endpoints {
            if node.is_some_and(|node| endpoint.node_name.as_deref() != Some(node)) {
                continue;
            }
            let Some(readiness) = readiness_of(endpoint.conditions.as_ref()) else {
                continue;
            };
            // Only the first address has a meaning (the API says so;
            // kube-proxy uses only it).
            let Some(ip) = endpoint.addresses.first().and_then(|a| a.parse::<IpAddr>().ok()) else {
                continue;
            };
            if ip.is_ipv4() != vip.is_ipv4() || ip.is_unspecified() {
                continue;
            }
            found.push(Endpoint { addr: SocketAddr::new(ip, port), readiness });
        }
    }
    rank(found)
}

/// What an endpoint's conditions mean for it: `None` when it is not
/// serving (it leaves the list).
pub(crate) fn readiness_of(conditions: Option<&EndpointConditions>) -> Option<Readiness> {
    let Some(c) = conditions else {
        return Some(Readiness::Ready);
    };
    let ready = c.ready.unwrap_or(true);
    if ready {
        return Some(Readiness::Ready);
    }
    c.serving.unwrap_or(ready).then_some(Readiness::Serving)
}

/// The slice's port that `wanted` names, when it has one.
fn port_of(slice: &EndpointSlice, wanted: &PortRef) -> Option<u16> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    let port = ports.iter().find(|p| match wanted {
        PortRef::Name(name) => p.name.as_deref().unwrap_or("") == name,
        PortRef::Number(number) => p.port == Some(i32::from(*number)),
    })?;
    u16::try_from(port.port?).ok().filter(|p| *p != 0)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::discovery::v1::{Endpoint as K8sEndpoint, EndpointPort},
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    fn port(name: &str, number: i32) -> EndpointPort {
        EndpointPort {
            name: Some(name.into()),
            port: Some(number),
            protocol: Some("TCP".into()),
            ..Default::default()
        }
    }

    fn conditions(
        ready: Option<bool>,
        serving: Option<bool>,
        terminating: Option<bool>,
    ) -> Option<EndpointConditions> {
        Some(EndpointConditions { ready, serving, terminating })
    }

    fn endpoint(addr: &str, node: &str, conditions: Option<EndpointConditions>) -> K8sEndpoint {
        K8sEndpoint {
            addresses: vec![addr.into()],
            conditions,
            node_name: Some(node.into()),
            ..Default::default()
        }
    }

    fn slice(
        name: &str,
        family: &str,
        ports: Vec<EndpointPort>,
        endpoints: Vec<K8sEndpoint>,
    ) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
            address_type: family.into(),
            ports: Some(ports),
            endpoints,
        }
    }

    fn ep(addr: &str, readiness: Readiness) -> Endpoint {
        Endpoint { addr: addr.parse().unwrap(), readiness }
    }

    const READY: Option<EndpointConditions> = Some(EndpointConditions {
        ready: Some(true),
        serving: Some(true),
        terminating: Some(false),
    });
    const NOT_READY: Option<EndpointConditions> = Some(EndpointConditions {
        ready: Some(false),
        serving: Some(false),
        terminating: Some(false),
    });
    const DRAINING: Option<EndpointConditions> = Some(EndpointConditions {
        ready: Some(false),
        serving: Some(true),
        terminating: Some(true),
    });
    const GOING: Option<EndpointConditions> = Some(EndpointConditions {
        ready: Some(false),
        serving: Some(false),
        terminating: Some(true),
    });

    fn vip4() -> SocketAddr {
        "127.0.0.1:6444".parse().unwrap()
    }

    fn https() -> PortRef {
        PortRef::Name("https".into())
    }

    #[test]
    fn conditions_map_to_readiness_per_the_api() {
        assert_eq!(readiness_of(None), Some(Readiness::Ready));
        assert_eq!(
            readiness_of(conditions(None, None, None).as_ref()),
            Some(Readiness::Ready),
            "nil ready counts as ready"
        );
        assert_eq!(readiness_of(READY.as_ref()), Some(Readiness::Ready));
        assert_eq!(readiness_of(DRAINING.as_ref()), Some(Readiness::Serving));
        assert_eq!(readiness_of(GOING.as_ref()), None);
        assert_eq!(readiness_of(NOT_READY.as_ref()), None);
        // Not ready, serving unset: serving follows ready.
        assert_eq!(readiness_of(conditions(Some(false), None, Some(true)).as_ref()), None);
        // Ready wins whatever else is said.
        assert_eq!(
            readiness_of(conditions(Some(true), Some(false), None).as_ref()),
            Some(Readiness::Ready)
        );
    }

    #[test]
    fn metallb_474_a_not_ready_endpoint_never_hides_a_ready_one_on_its_node() {
        // A rolling update: the new pod (not ready yet) landed on the node
        // of the remaining old, ready pod.
        let s = slice(
            "web-abc",
            "IPv4",
            vec![port("https", 8443)],
            vec![
                endpoint("127.10.0.1", "node-a", READY),
                endpoint("127.10.0.2", "node-a", NOT_READY),
            ],
        );
        let (list, truncated) = endpoints_of([&s], vip4(), &https(), None);
        assert_eq!(list, [ep("127.10.0.1:8443", Readiness::Ready)]);
        assert_eq!(truncated, 0);
        // And the other way round: a ready endpoint never lifts a not-ready
        // one on its node.
        let s = slice(
            "web-abc",
            "IPv4",
            vec![port("https", 8443)],
            vec![
                endpoint("127.10.0.2", "node-a", NOT_READY),
                endpoint("127.10.0.3", "node-a", DRAINING),
                endpoint("127.10.0.1", "node-a", READY),
            ],
        );
        let (list, _) = endpoints_of([&s], vip4(), &https(), None);
        assert_eq!(
            list,
            [ep("127.10.0.1:8443", Readiness::Ready), ep("127.10.0.3:8443", Readiness::Serving)]
        );
    }

    #[test]
    fn every_slice_of_the_service_is_merged() {
        let a = slice(
            "web-a",
            "IPv4",
            vec![port("https", 8443)],
            vec![endpoint("127.10.0.1", "n1", READY)],
        );
        let b = slice(
            "web-b",
            "IPv4",
            vec![port("https", 8443)],
            vec![endpoint("127.10.0.2", "n2", None)],
        );
        let (list, _) = endpoints_of([&a, &b], vip4(), &https(), None);
        assert_eq!(
            list,
            [ep("127.10.0.1:8443", Readiness::Ready), ep("127.10.0.2:8443", Readiness::Ready)]
        );
    }

    #[test]
    fn a_local_service_takes_only_this_nodes_endpoints() {
        let s = slice(
            "web-a",
            "IPv4",
            vec![port("https", 8443)],
            vec![
                endpoint("127.10.0.1", "n1", READY),
                endpoint("127.10.0.2", "n2", READY),
                endpoint("127.10.0.3", "n1", None),
            ],
        );
        let (list, _) = endpoints_of([&s], vip4(), &https(), Some("n1"));
        assert_eq!(
            list,
            [ep("127.10.0.1:8443", Readiness::Ready), ep("127.10.0.3:8443", Readiness::Ready)]
        );
        assert_eq!(endpoints_of([&s], vip4(), &https(), Some("n3")).0, [], "no endpoint here");
        let mut nameless = endpoint("127.10.0.4", "n1", READY);
        nameless.node_name = None;
        let s = slice("web-b", "IPv4", vec![port("https", 8443)], vec![nameless]);
        assert_eq!(endpoints_of([&s], vip4(), &https(), Some("n1")).0, [], "on no known node");
    }

    #[test]
    fn only_the_vips_family_is_taken() {
        let v4 = slice(
            "web-v4",
            "IPv4",
            vec![port("https", 8443)],
            vec![endpoint("127.10.0.1", "n1", READY)],
        );
        // fd00:: (and every address in these tests) is data only: nothing
        // here dials it.
        let v6 = slice(
            "web-v6",
            "IPv6",
            vec![port("https", 8443)],
            vec![endpoint("fd00::1", "n1", READY)],
        );
        let fqdn = slice(
            "web-fqdn",
            "FQDN",
            vec![port("https", 8443)],
            vec![endpoint("web.example", "n1", READY)],
        );
        let (list, _) = endpoints_of([&v4, &v6, &fqdn], vip4(), &https(), None);
        assert_eq!(list, [ep("127.10.0.1:8443", Readiness::Ready)]);
        let (list, _) =
            endpoints_of([&v4, &v6, &fqdn], "[::1]:6444".parse().unwrap(), &https(), None);
        assert_eq!(list, [ep("[fd00::1]:8443", Readiness::Ready)]);
        // A slice that says IPv4 but carries something else is skipped.
        let bad = slice(
            "web-bad",
            "IPv4",
            vec![port("https", 8443)],
            vec![endpoint("fd00::2", "n1", READY), endpoint("0.0.0.0", "n1", READY)],
        );
        assert_eq!(endpoints_of([&bad], vip4(), &https(), None).0, []);
    }

    #[test]
    fn the_port_is_found_by_name_or_number_per_slice() {
        // Two slices of one Service whose named port maps to different
        // container ports (pods of two versions).
        let old = slice(
            "web-old",
            "IPv4",
            vec![port("metrics", 9090), port("https", 8443)],
            vec![endpoint("127.10.0.1", "n1", READY)],
        );
        let new = slice(
            "web-new",
            "IPv4",
            vec![port("https", 9443)],
            vec![endpoint("127.10.0.2", "n2", READY)],
        );
        let (list, _) = endpoints_of([&old, &new], vip4(), &https(), None);
        assert_eq!(
            list,
            [ep("127.10.0.1:8443", Readiness::Ready), ep("127.10.0.2:9443", Readiness::Ready)]
        );
        let (list, _) = endpoints_of([&old, &new], vip4(), &PortRef::Number(9090), None);
        assert_eq!(list, [ep("127.10.0.1:9090", Readiness::Ready)]);
        // An unnamed port (a Service with one port) is the name "".
        let unnamed = slice(
            "web-u",
            "IPv4",
            vec![EndpointPort { port: Some(6443), ..Default::default() }],
            vec![endpoint("127.10.0.3", "n3", READY)],
        );
        assert_eq!(
            endpoints_of([&unnamed], vip4(), &PortRef::Name(String::new()), None).0,
            [ep("127.10.0.3:6443", Readiness::Ready)]
        );
        assert_eq!(endpoints_of([&unnamed], vip4(), &https(), None).0, []);
        // A slice without ports, or a port without a number, gives nothing.
        let mut none = unnamed.clone();
        none.ports = None;
        assert_eq!(endpoints_of([&none], vip4(), &PortRef::Number(6443), None).0, []);
    }

    /// UDP services: the cluster's DNS (`kube-system/kube-dns`, port `dns`)
    /// is UDP; a port is found by its name whatever its protocol.
    #[test]
    fn a_udp_port_is_found_by_its_name() {
        let udp = EndpointPort { protocol: Some("UDP".into()), ..port("dns", 53) };
        let s = slice(
            "kube-dns",
            "IPv4",
            vec![udp, port("dns-tcp", 53), port("metrics", 9153)],
            vec![endpoint("127.10.0.1", "n1", READY)],
        );
        assert_eq!(
            endpoints_of([&s], vip4(), &PortRef::Name("dns".into()), None).0,
            [ep("127.10.0.1:53", Readiness::Ready)]
        );
    }

    #[test]
    fn only_the_first_address_of_an_endpoint_counts() {
        let mut e = endpoint("127.10.0.1", "n1", READY);
        e.addresses.push("127.10.0.99".into());
        let s = slice("web", "IPv4", vec![port("https", 8443)], vec![e]);
        assert_eq!(
            endpoints_of([&s], vip4(), &https(), None).0,
            [ep("127.10.0.1:8443", Readiness::Ready)]
        );
    }

    #[test]
    fn more_than_sixteen_keeps_ready_first_then_by_address() {
        let mut endpoints: Vec<K8sEndpoint> =
            (1..=12).map(|i| endpoint(&format!("127.10.1.{i}"), "n", DRAINING)).collect();
        endpoints.extend((1..=12).map(|i| endpoint(&format!("127.10.2.{i}"), "n", READY)));
        let s = slice("web", "IPv4", vec![port("https", 443)], endpoints);
        let (list, truncated) = endpoints_of([&s], vip4(), &https(), None);
        assert_eq!(list.len(), 16);
        assert_eq!(truncated, 8);
        assert!(list[..12].iter().all(|e| e.readiness == Readiness::Ready));
        assert_eq!(list[12], ep("127.10.1.1:443", Readiness::Serving));
        assert_eq!(list[15], ep("127.10.1.4:443", Readiness::Serving));
    }
}
