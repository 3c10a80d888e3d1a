//! Closing VIP connections: the sockets are picked from the kernel's table
//! (only those made through a VIP), destroyed with netlink `SOCK_DESTROY`
//! on a blocking thread (in lb's network namespace and, for `scope = "all"`,
//! in pods'), and the outcome comes back to the owner loop as a
//! message to log, count and answer.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
};

use tokio::sync::oneshot;
use tracing::{error, info, warn};

use super::owner::{Close, Counts, Daemon, Message};
use crate::{balancer::CloseReason, config::Scope, control::Response, sock_destroy};

/// Why nothing can be closed on this kernel.
const NO_SOCK_DESTROY: &str = "this kernel cannot destroy sockets (it lacks CONFIG_INET_DIAG_DESTROY, or the tcp_diag module is not loaded)";

impl Daemon {
    /// Resets, in the background, the VIP connections that
    /// `wanted(vip, server)` picks; `close` says what to do with the
    /// outcome ([`Self::close_done`]). The netlink socket dump and the
    /// destroys run on a blocking thread: with thousands of connections
    /// they take a while, and the owner loop must keep answering kernel
    /// reports, checks and `lb status` meanwhile. The sockets are picked
    /// there too (a walk of the `SOCKETS` map), after the new selection is
    /// written.
    ///
    /// Without socket destroy (said once at start) a balancer's closes are
    /// dropped quietly (the connections end on their own); a request is
    /// answered with the reason.
    pub(super) fn close(
        &self,
        wanted: impl Fn(SocketAddr, SocketAddr) -> bool + Send + 'static,
        close: Close,
    ) {
        if !self.sock_destroy {
            if let Close::Requested { .. } = close {
                self.close_done(close, Err(NO_SOCK_DESTROY.to_owned()));
            }
            return;
        }
        let tables = self.datapath.maps().socket_tables();
        // Pods' connections are in their own namespaces: searched only when
        // some VIP rewrites connects there.
        let other_namespaces =
            self.close_in_pods && self.services.iter().any(|s| s.config.scope == Scope::All);
        let tx = self.tx.clone();
        tokio::task::spawn_blocking(move || {
            let sockets: HashMap<u64, (SocketAddr, SocketAddr)> = tables
                .vip_sockets()
                .filter(|s| wanted(s.vip, s.server))
                .map(|s| (s.cookie, (s.vip, s.server)))
                .collect();
            let cookies = sockets.keys().copied().collect();
            let result = sock_destroy::destroy_everywhere(&cookies, other_namespaces)
                .map(|destroyed| {
                    if let Some((e, left)) = destroyed.not_searched {
                        warn!(
                            left,
                            "closing connections: {left} were not found in lb's network namespace, and the others could not all be searched ({e}); entering pods' namespaces needs CAP_SYS_ADMIN"
                        );
                    }
                    let mut counts = Counts::new();
                    for cookie in destroyed.cookies {
                        *counts.entry(sockets[&cookie]).or_default() += 1;
                    }
                    counts
                })
                .map_err(|e| format!("destroying sockets with netlink SOCK_DESTROY: {e}"));
            let _ = tx.blocking_send(Message::CloseDone { close, result });
        });
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
            .map(|name| self.index(name).map(|i| self.services[i].config.vip))
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
                            if let Some(&i) = self.by_vip.get(&vip) {
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
