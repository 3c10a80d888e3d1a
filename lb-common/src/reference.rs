//! The one map of the bench's reference forwarder
//! (`lb-ebpf/src/bin/reference_forwarder.rs`), not part of lb: the least
//! a NAT forwarder must do for a packet of a known flow, timed beside
//! `lb_xdp` so that its program time is read as a ratio.

use crate::Endpoint;

/// The name of its flow table: keyed by [`crate::FlowKey`] (the packet's
/// source, destination and protocol), valued by [`ReferenceRewrite`].
pub const REFERENCE_FLOWS: &str = "REFERENCE_FLOWS";

/// What a packet of the flow leaves as.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReferenceRewrite {
    /// Its new source address and port.
    pub src: Endpoint,
    /// Its new destination address and port.
    pub dst: Endpoint,
    /// The interface it is redirected to.
    pub ifindex: u32,
    /// Its link layer: destination MAC, then source MAC.
    pub macs: [u8; 12],
}

const _: () = assert!(size_of::<ReferenceRewrite>() == 56);
