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
//! Not wired into the daemon yet: electing the node that allocates, and
//! serving the addresses (each Service port an external VIP following its
//! EndpointSlices). A daemon given `[[pool]]` says so at start.

pub mod allocate;
#[cfg(feature = "kubernetes")]
pub mod allocator;
pub mod pools;
#[cfg(feature = "kubernetes")]
pub mod service;
