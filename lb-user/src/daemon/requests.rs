//! What the outside asks of the daemon: control requests (`lb servers`,
//! `lb drain`, `lb status`) and metrics scrapes. `lb close-connections` is
//! in `closing`, `lb reload` in `reload`.

use std::{net::SocketAddr, time::Instant};

use anyhow::{Context as _, bail};
use tracing::info;

use super::Daemon;
use crate::{
    balancer::Readiness,
    config,
    control::{ConfigStatus, Status},
    state::SavedList,
    status::{self, KernelSnapshot},
};

impl Daemon {
    /// `lb servers`: checked with the same rules as the config file.
    pub(super) fn set_servers(
        &mut self,
        name: &str,
        servers: &[SocketAddr],
        default: Option<SocketAddr>,
    ) -> anyhow::Result<()> {
        let i = self.index(name)?;
        let vip = self.services[i].config.vip;
        config::validate_servers(vip, servers, default, |addr| self.vip_owner(addr))
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
        self.saved
            .save(&self.settings.state_dir)
            .context("saving the server list to the state directory")?;
        info!(service = name, ?servers, ?default, "server list set");
        Ok(())
    }

    /// `lb drain` (and `--undo`): the server declares itself serving only.
    pub(super) fn drain(
        &mut self,
        name: &str,
        server: SocketAddr,
        undo: bool,
    ) -> anyhow::Result<()> {
        let i = self.index(name)?;
        if self.services[i].balancer.server(server).is_none() {
            bail!("{server} is not a server of {name:?}");
        }
        let readiness = if undo { Readiness::Ready } else { Readiness::Serving };
        let effects = self.services[i].balancer.set_readiness(server, readiness, Instant::now());
        self.apply(i, effects);
        info!(service = name, %server, drained = !undo, "drain changed");
        Ok(())
    }

    /// `lb status`.
    pub(super) fn status(&self) -> Status {
        let kernel = KernelSnapshot::of(self.datapath.maps());
        Status {
            services: self
                .services
                .iter()
                .map(|s| {
                    status::service(
                        &s.config,
                        &s.balancer,
                        s.discovery.as_ref().map(|d| &d.status),
                        &kernel,
                    )
                })
                .collect(),
            config: ConfigStatus {
                path: self.config_path.display().to_string(),
                last_reload: self.last_reload.clone(),
            },
            datapath: status::datapath(
                &self.datapath,
                &self.cgroup,
                &self.settings.bpffs,
                self.sock_destroy,
            ),
        }
    }

    /// A metrics scrape: refresh what lives in the kernel, then encode.
    pub(super) fn scrape(&mut self) -> String {
        let maps = self.datapath.maps();
        for service in &self.services {
            for server in service.balancer.servers() {
                let count = maps.connections(service.config.vip, server.addr);
                self.metrics.set_connections(&service.config.name, server.addr, count);
            }
        }
        self.metrics.record_decisions(&maps.counters());
        self.metrics.encode()
    }
}
