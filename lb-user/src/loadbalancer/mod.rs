//! LoadBalancer Services (issue 41): the address pools (`[[pool]]`), the
//! allocator that gives each Service its addresses, and how a Kubernetes
//! Service is read as what it asks for.
//!
//! - `pools`: `[[pool]]`'s address ranges, as numbers;
//! - `allocate`: who gets which address, a pure function of the pools and
//!   the Services (tested with properties: never one address twice unless
//!   shared on purpose, nothing held moves);
//! - `service`: a Kubernetes Service read as what it asks (lb's and
//!   MetalLB's annotations);
//! - `allocator`: the task that watches Services and writes each one's
//!   addresses to its status, with Events, while this node leads.
//!
//! The daemon (`daemon/load_balancers.rs`) starts the task, elects the
//! node that allocates, and serves what the task says (each address and
//! port an external VIP following the Service's EndpointSlices).

use std::net::IpAddr;

use allocate::ServiceRef;

pub mod allocate;
#[cfg(feature = "kubernetes")]
pub mod allocator;
pub mod health_check;
pub mod pools;
#[cfg(feature = "kubernetes")]
pub mod service;

/// What the nodes serve for one of lb's LoadBalancer Services: the
/// addresses its status shows that are in a pool (an address written
/// there by hand, or by anyone else, is never announced), on each of its
/// port numbers (a port number named twice, TCP and UDP, is one VIP:port
/// serving both).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Served {
    /// The Service.
    pub service: ServiceRef,
    /// Its addresses, in the order of its status.
    pub addresses: Vec<IpAddr>,
    /// Its ports, by number.
    pub ports: Vec<ServedPort>,
    /// `externalTrafficPolicy: Local`: each node serves it only from its
    /// own endpoints, keeping the client's address.
    #[serde(default)]
    pub local: bool,
    /// Its `healthCheckNodePort` (with `local`): each node answers there
    /// how many local endpoints it has, as kube-proxy does.
    #[serde(default)]
    pub health_check_node_port: Option<u16>,
    /// `sessionAffinity: ClientIP`: a client's flows go to one endpoint.
    #[serde(default)]
    pub client_affinity: bool,
}

/// A Service port as the nodes serve it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ServedPort {
    /// The port's name in the Service and its EndpointSlices ("" when it
    /// has one port and no name): what discovery finds the servers' port by.
    pub name: String,
    /// The port number clients connect to.
    pub port: u16,
}
