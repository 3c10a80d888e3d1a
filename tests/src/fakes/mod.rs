//! Fakes of what discovery talks to: a Kubernetes API server that speaks
//! the real list and watch protocol for EndpointSlices ([`apiserver`]), and
//! a DNS server ([`dns`]). The discovery tests use them, and so does
//! `cargo xtask bench` (its discovery part). Both run on the tokio runtime
//! of whoever starts them.

pub mod apiserver;
pub mod dns;

/// A runtime for the fakes, for a caller whose own thread stays blocking
/// (a privileged test, the bench): one worker thread. Declare it before
/// the fakes started on it, so that it is dropped after them.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}
