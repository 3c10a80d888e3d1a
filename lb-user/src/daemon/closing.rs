//! Closing VIP connections: which to close, decided here; the sockets are
//! picked from the kernel's table (only those made through a VIP) and
//! destroyed with netlink `SOCK_DESTROY` on the closing thread (`close_worker`;
//! in lb's network namespace and, for `scope = "all"`, in pods'), and the
//! outcome comes back to the owner loop as a message to log, count and
//! answer.

use std::{collections::HashSet, net::SocketAddr};

use tokio::sync::oneshot;
use tracing::{error, info};

use super::{
    close_worker::Job,
    messages::{Close, Counts},
    owner::Daemon,
};
use crate::{balancer::CloseReason, config::Scope, control::Response};

/// Why nothing can be closed on this kernel.
const NO_SOCK_DESTROY: &str = "this kernel cannot destroy sockets (it lacks CONFIG_INET_DIAG_DESTROY, or the tcp_diag module is not loaded)";

impl Daemon {
    /// Resets, in the background, the VIP connections that
    /// `wanted(vip, server)` picks; `close` says what to do with the
    /// outcome ([`Self::close_done`]). The walk of the `SOCKETS` map that
    /// picks them, the netlink socket dump and the destroys run on the
    /// closing thread (`close_worker`), after the new selection is written: with
    /// thousands of connections they take a while, and the owner loop must
    /// keep answering kernel reports, checks and `lb status` meanwhile.
    ///
    /// Without socket destroy (said once at start) a balancer's closes are
    /// dropped quietly (the connections end on their own); a request is
    /// answered with the reason.
    pub(super) fn close(
        &self,
        wanted: impl Fn(SocketAddr, SocketAddr) -> bool + Send + 'static,
        close: Close,
    ) {
        if !self.kernel.sock_destroy {
            if let Close::Requested { .. } = close {
                self.close_done(close, Err(NO_SOCK_DESTROY.to_owned()));
            }
            return;
        }
        // Pods' connections are in their own namespaces: searched only when
        // some VIP rewrites connects there.
        let other_namespaces =
            self.kernel.close_in_pods && self.services.iter().any(|s| s.config.scope == Scope::All);
        self.workers.closer.close(Job { wanted: Box::new(wanted), close, other_namespaces });
    }

    /// Closes what one balancer step moved traffic away from
    /// ([`Close::Moved`]: its VIP's connections to those servers).
    pub(super) fn close_moved(&self, close: Close) {
        let Close::Moved { vip, servers, .. } = &close else {
            // Only `carry_out` makes these, and only `Moved` ones.
            return;
        };
        let (vip, servers): (SocketAddr, HashSet<SocketAddr>) =
            (*vip, servers.iter().map(|(s, _)| *s).collect());
        // Most moves (a server refused a connect, failed its checks) leave
        // no connection behind: the kernel's live counts say so without a
        // walk of the socket table.
        let maps = self.datapath.maps();
        if servers.iter().all(|&server| maps.connections(vip, server) <= 0) {
            return self.close_done(close, Ok(Counts::new()));
        }
        self.close(move |v, server| v == vip && servers.contains(&server), close);
    }

    /// `lb close-connections`: resets the connections made through a VIP
    /// (of `service`, or of any service) to `server`, and answers with how
    /// many once done. Direct connections to it are left alone. Counted
    /// with reason `manual`.
    pub(super) fn close_on_request(
        &self,
        server: SocketAddr,
        service: Option<&str>,
        reply: oneshot::Sender<Response>,
    ) {
        let vip = match service
            .map(|name| self.services.index(name).map(|i| self.services[i].config.vip))
            .transpose()
        {
            Ok(vip) => vip,
            Err(e) => return drop(reply.send(Response::Error { error: format!("{e:#}") })),
        };
        self.close(
            move |v, s| s == server && vip.is_none_or(|vip| vip == v),
            Close::Requested { server, reply },
        );
    }

    /// A background close is done: log it, count it, answer who asked.
    pub(super) fn close_done(&self, close: Close, result: Result<Counts, String>) {
        match (close, result) {
            (Close::Moved { service, vip, servers }, Ok(counts)) => {
                for (server, reason) in servers {
                    let n = counts.get(&(vip, server)).copied().unwrap_or(0);
                    info!(service = %service, %server, closed = n, reason = reason.name(), "closed VIP connections");
                    self.metrics.count_closed(&service, server, reason, n);
                }
            }
            (Close::Moved { service, .. }, Err(e)) => {
                error!(service = %service, "closing connections failed: {e}");
            }
            (Close::Requested { server, reply }, result) => {
                let response = match result {
                    Ok(counts) => {
                        for (&(vip, server), &n) in &counts {
                            if let Some(&i) = self.services.by_vip.get(&vip) {
                                let service = &self.services[i].config.name;
                                self.metrics.count_closed(service, server, CloseReason::Manual, n);
                            }
                        }
                        let total = counts.values().sum();
                        info!(%server, closed = total, "closed VIP connections on request");
                        Response::Closed { closed: total }
                    }
                    Err(e) => {
                        Response::Error { error: format!("closing connections to {server}: {e}") }
                    }
                };
                let _ = reply.send(response);
            }
            (Close::RemovedVips, Ok(counts)) => info!(
                closed = counts.values().sum::<u64>(),
                "closed the connections of removed VIPs"
            ),
            (Close::RemovedVips, Err(e)) => {
                error!("closing the connections of removed VIPs failed: {e}");
            }
        }
    }
}
