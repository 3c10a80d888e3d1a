//! What the outside asks of the daemon: control requests (`lb servers`,
//! `lb drain`, `lb status`, whose kernel side is read on the census thread:
//! `status` is data in, data out) and metrics scrapes. `lb close-connections` is
//! in `closing`, `lb reload` in `reload`.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::bail;
use tokio::sync::oneshot;
use tracing::info;

use super::owner::Daemon;
use crate::{
    balancer::{Balancer, Readiness},
    config,
    control::{
        ConfigStatus, DatapathStatus, DiscoveryStatus, Features, Response, Status, TrackedSockets,
    },
    datapath::{self, Datapath, PinnedMaps},
    state::SavedList,
    status::{self, KernelView},
};

/// The kernel as one `lb status` reads it: selections and live counts by
/// lookup, the failure marks in one pass taken at the start (`FAILED_AT`
/// holds only the marked servers, so that is a few reads instead of one per
/// server of every service).
struct KernelSnapshot<'a> {
    maps: &'a PinnedMaps,
    failure_times: HashMap<SocketAddr, u64>,
    now_ns: u64,
}

impl<'a> KernelSnapshot<'a> {
    /// The failure marks of `maps` now; the rest is read on demand.
    fn of(maps: &'a PinnedMaps) -> Self {
        Self { maps, failure_times: maps.failure_times(), now_ns: datapath::monotonic_now_ns() }
    }
}

impl KernelView for KernelSnapshot<'_> {
    fn selection(&self, vip: SocketAddr) -> Vec<SocketAddr> {
        self.maps.selection(vip)
    }
    fn connections(&self, vip: SocketAddr, server: SocketAddr) -> i64 {
        self.maps.connections(vip, server)
    }
    fn recently_failed(&self, server: SocketAddr, hold_down: Duration) -> bool {
        self.failure_times
            .get(&server)
            .is_some_and(|&at| datapath::failed_within(at, self.now_ns, hold_down))
    }
}

/// The datapath as `lb status` shows it: where it is attached and what
/// this kernel offers; the decision counters and the socket tables' fill
/// are read on the census thread and filled in there.
fn datapath_status(
    datapath: &Datapath,
    cgroup: &Path,
    bpffs: &Path,
    sock_destroy: bool,
    close_in_pods: bool,
) -> DatapathStatus {
    DatapathStatus {
        cgroup: cgroup.display().to_string(),
        bpffs: bpffs.display().to_string(),
        adopted: datapath.adopted,
        counters: BTreeMap::new(),
        features: Features {
            getpeername: datapath.getpeername,
            sock_destroy,
            netns_scope: datapath.netns_scope,
            close_in_pods,
        },
        tracked_sockets: TrackedSockets::default(),
        external: None,
    }
}

impl Daemon {
    /// `lb servers`: checked with the same rules as the config file, and
    /// answered once the list is in the state file.
    pub(super) fn set_servers(
        &mut self,
        name: &str,
        servers: &[SocketAddr],
        default: Option<SocketAddr>,
        reply: oneshot::Sender<Response>,
    ) {
        if let Err(e) = self.apply_servers(name, servers, default) {
            let _ = reply.send(Response::Error { error: format!("{e:#}") });
            return;
        }
        info!(service = name, ?servers, ?default, "server list set");
        let done = move |result: Result<(), String>| {
            let _ = reply.send(match result {
                Ok(()) => Response::Ok,
                Err(e) => Response::Error {
                    error: format!("saving the server list to the state directory: {e}"),
                },
            });
        };
        self.workers.saver.save(self.saved.clone(), Some(Box::new(done)));
    }

    /// `lb servers`' list, checked and applied.
    fn apply_servers(
        &mut self,
        name: &str,
        servers: &[SocketAddr],
        default: Option<SocketAddr>,
    ) -> anyhow::Result<()> {
        let i = self.services.index(name)?;
        let vip = self.services[i].config.vip;
        config::validate_servers(vip, servers, default, |addr| self.services.vip_owner(addr))
            .map_err(anyhow::Error::msg)?;
        let effects = self.services[i].balancer.set_servers(servers, default, Instant::now());
        self.apply(i, effects);
        let config = &self.services[i].config;
        self.saved.services.insert(
            name.to_owned(),
            SavedList {
                servers: servers.to_vec(),
                default,
                configured: config.servers.clone(),
                configured_default: config.default,
                drained: Vec::new(),
                discovered_at: None,
            },
        );
        self.forget_stale();
        Ok(())
    }

    /// `lb drain` (and `--undo`): the server declares itself serving only.
    pub(super) fn drain(
        &mut self,
        name: &str,
        server: SocketAddr,
        undo: bool,
    ) -> anyhow::Result<()> {
        let i = self.services.index(name)?;
        if self.services[i].balancer.server(server).is_none() {
            bail!("{server} is not a server of {name:?}");
        }
        let readiness = if undo { Readiness::Ready } else { Readiness::Serving };
        let effects = self.services[i].balancer.set_readiness(server, readiness, Instant::now());
        self.apply(i, effects);
        info!(service = name, %server, drained = !undo, "drain changed");
        Ok(())
    }

    /// `lb status`: the daemon's side (configs, balancers, discovery)
    /// copied here, the kernel's read and the answer given on the census
    /// thread. A status of thousands of services reads thousands of map
    /// entries (milliseconds), which no kernel report waits behind.
    pub(super) fn answer_status(&self, reply: oneshot::Sender<Response>) {
        let services: Vec<(config::Service, Balancer, Option<DiscoveryStatus>, _)> = self
            .services
            .iter()
            .enumerate()
            .map(|(i, s)| {
                (
                    s.config.clone(),
                    s.balancer.clone(),
                    s.discovery.as_ref().map(|d| d.status.clone()),
                    self.service_external(i),
                )
            })
            .collect();
        let config = ConfigStatus {
            path: self.config.path.display().to_string(),
            last_reload: self.last_reload.clone(),
        };
        let mut datapath = datapath_status(
            &self.datapath,
            &self.config.cgroup,
            &self.config.settings.bpffs,
            self.kernel.sock_destroy,
            self.kernel.close_in_pods,
        );
        datapath.external = self.external_status();
        let load_balancers = self.load_balancers_status();
        let bgp = self.bgp.as_ref().map(crate::bgp::Speaker::status);
        self.workers.census.then(move |maps, tracked| {
            let kernel = KernelSnapshot::of(maps);
            let services = services
                .iter()
                .map(|(config, balancer, discovery, external)| {
                    let mut service =
                        status::service(config, balancer, discovery.as_ref(), &kernel);
                    service.external = external.clone();
                    service
                })
                .collect();
            datapath.counters =
                maps.counters().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            datapath.tracked_sockets = tracked;
            let status = Status { services, config, datapath, load_balancers, bgp };
            let _ = reply.send(Response::Status(Box::new(status)));
        });
    }

    /// A metrics scrape: refresh what lives in the kernel, then encode.
    pub(super) fn scrape(&mut self) -> String {
        let maps = self.datapath.maps();
        for service in self.services.iter() {
            for server in service.balancer.servers() {
                let count = maps.connections(service.config.vip, server.addr);
                self.metrics.set_connections(&service.config.name, server.addr, count);
            }
        }
        self.metrics.record_decisions(&maps.counters());
        self.metrics.external.set(self.external_status());
        self.metrics.bgp.set(self.bgp.as_ref().map(crate::bgp::Speaker::status));
        let leases = (0..self.services.len())
            .filter_map(|i| Some((self.services[i].config.name.clone(), self.lease_status(i)?)))
            .collect();
        self.metrics.leases.set(leases);
        let tracked = self.workers.census.latest();
        self.metrics.set_tracked_sockets("tcp", tracked.tcp, tracked.tcp_capacity);
        self.metrics.set_tracked_sockets("udp", tracked.udp, tracked.udp_capacity);
        // Not a protocol: the UDP sockets with a reverse mapping.
        self.metrics.set_tracked_sockets(
            "udp_peers",
            tracked.udp_peers,
            tracked.udp_peers_capacity,
        );
        self.metrics.encode()
    }
}
