//! Fakes of what discovery talks to, for the tests that need them: a
//! Kubernetes API server that speaks the real list and watch protocol for
//! EndpointSlices, and a DNS server. Test-only: they are dev-dependencies,
//! so the harness library (which xtask uses) does not carry them.
// Each test binary that includes the fakes uses a different part of them.
#![allow(dead_code, reason = "each test binary that includes the fakes uses a part of them")]

pub mod apiserver;
pub mod dns;
