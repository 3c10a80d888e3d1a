//! A membership Lease as the rules read it (`membership.rs`): who wrote
//! it, its version, and what it says. Plain data, shared by the rules,
//! their view of the other members (`membership_peers.rs`) and the
//! Lease's format (`membership_lease.rs`).

use std::collections::BTreeSet;

/// What a node writes in its membership Lease.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Content {
    /// The VIPs it can serve.
    pub eligible: BTreeSet<String>,
    /// The VIPs it places on itself and answers, or will once seen.
    pub claims: BTreeSet<String>,
}

/// A membership Lease as the watch delivers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Lease {
    /// Its node (the Lease's name).
    pub node: String,
    /// Who wrote it (`spec.holderIdentity`): the node's name and its
    /// daemon's token (`identity.rs`).
    pub identity: String,
    /// `metadata.resourceVersion`: it changes with every write.
    pub version: String,
    pub content: Content,
}
