//! What reaches the owner loop: kernel reports, health results and the
//! outcome of background closes ([`Message`]), why a close is done
//! ([`Close`]) and what it closed ([`Counts`]), and the work a burst of
//! discovered lists calls for ([`After`]). Plain data: every room of the
//! daemon may use it, and it uses none of them.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use lb_common::Event;
use tokio::sync::oneshot;

use crate::{
    balancer::{CloseReason, Health},
    control::Response,
};

/// What reaches the owner task from the kernel, the health checks and its
/// own background work. (Control requests come on their own channel, as
/// `control::Call`s; discovered lists on theirs.)
pub(super) enum Message {
    Kernel(Event),
    Health {
        service: String,
        server: SocketAddr,
        result: Health,
        took: Duration,
    },
    /// A background close is done (`Daemon::close`).
    CloseDone {
        close: Close,
        result: Result<Counts, String>,
    },
}

/// How many VIP connections were closed, per (VIP, server).
pub(super) type Counts = BTreeMap<(SocketAddr, SocketAddr), u64>;

/// A close: why it is done, which says what to do with its outcome.
pub(super) enum Close {
    /// One step of a service's balancer moved traffic off these servers.
    Moved { service: String, vip: SocketAddr, servers: Vec<(SocketAddr, CloseReason)> },
    /// `lb close-connections`: the client waits for the total.
    Requested { server: SocketAddr, reply: oneshot::Sender<Response> },
    /// A reload removed these VIPs.
    RemovedVips,
}

/// Work that applied lists call for, done once for a burst of them
/// (`Daemon::after_discovered`).
#[derive(Default)]
pub(super) struct After {
    /// A list changed: write the state file.
    pub(super) save: bool,
    /// A server left: clean the kernel's maps of it.
    pub(super) forget: bool,
}
