//! The election tests' topology: one LAN (a bridge in the test's own
//! network namespace, where the fake API server listens too), a client
//! namespace and N nodes on it, each node with a server namespace of its
//! own behind it (the same server address on every node: each node
//! forwards to its own server, which answers with the node's name).
//!
//! ```text
//!             [test ns: br0 198.18.0.250, the fake API server]
//!              |            |                     |
//!  [client] c0 198.18.0.10  ext0 [node1] srv0 ─ s0 [server1]
//!  on-link route to         198.18.0.1   198.18.2.1  198.18.2.2:8080 "node1"
//!  198.18.1.0/24 (it        ext0 [node2] srv0 ─ s0 [server2]
//!  asks who has the VIP)    198.18.0.2   ...         198.18.2.2:8080 "node2"
//! ```
//!
//! A veth that an XDP program redirects into needs NAPI on its peer: the
//! bridge's ports toward the nodes and the servers' s0 carry `lb_xdp` on
//! empty maps, which passes every packet.

use std::{
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use crate::{
    Backend, Daemon, Namespace, TestCgroup, fakes::apiserver::FakeApiServer, sh, topology,
    wait_until,
};

pub use topology::{mac_of, neighbour, pass_through, tx_checksums_off, who};

pub const VIP: &str = "198.18.1.100:80";
pub const VIP_IP: &str = "198.18.1.100";
/// Where the fake API server listens, on the bridge.
pub const API: &str = "198.18.0.250";
pub const LEASE: (&str, &str) = ("lb-system", "web");
/// How long the nodes may take to first serve a LoadBalancer Service's
/// address: each attaches `lb_xdp` when its first external VIP appears,
/// all of them at once, and under a guest's software emulation on Linux
/// 5.10 the verifier takes some 20 s per program (`topology::SERVING_WITHIN`
/// is one node's) on two shared CPUs.
pub const FIRST_SERVING: Duration = Duration::from_secs(120);

/// One node: its namespace, its server's, the server, its daemon.
pub struct Node {
    pub name: String,
    /// `[daemon] node_name` of its daemon: its `name`, unless a test gives
    /// two nodes one name.
    pub node_name: String,
    /// The test's tag: daemons and cgroups of tests running side by side
    /// have names of their own.
    tag: String,
    pub ns: Namespace,
    pub servers: Namespace,
    pub server: Option<Backend>,
    /// Its MAC address on the LAN (ext0).
    pub mac: String,
    daemon: Option<Daemon>,
    cgroup: Option<TestCgroup>,
}

/// The LAN; the calling thread (the test body) holds the bridge.
pub struct Lan {
    pub client: Namespace,
    pub nodes: Vec<Node>,
    _peers: Vec<crate::pass_xdp::PassThrough>,
}

impl Lan {
    /// A LAN with `n` nodes, for the test `tag`; each node's server
    /// answers with the node's name. No daemon runs yet.
    pub fn new(tag: &str, n: usize) -> Self {
        sh(&["ip", "link", "add", "br0", "type", "bridge"]);
        sh(&["ip", "addr", "add", &format!("{API}/24"), "dev", "br0"]);
        sh(&["ip", "link", "set", "br0", "up"]);
        let client = Namespace::new();
        let mut peers = Vec::new();
        let port = |name: &str, peer: &str, ns: &Namespace| {
            sh(&[
                "ip",
                "link",
                "add",
                name,
                "type",
                "veth",
                "peer",
                "name",
                peer,
                "netns",
                &ns.tid.to_string(),
            ]);
            sh(&["ip", "link", "set", name, "master", "br0"]);
            sh(&["ip", "link", "set", name, "up"]);
        };
        port("pc", "c0", &client);
        client.sh(&["ip", "addr", "add", "198.18.0.10/24", "dev", "c0"]);
        client.sh(&["ip", "link", "set", "c0", "up"]);
        client.sh(&["ip", "route", "add", "198.18.1.0/24", "dev", "c0"]);
        client.run(|| tx_checksums_off("c0"));
        let mut nodes = Vec::new();
        for k in 1..=n {
            let name = format!("node{k}");
            let ns = Namespace::new();
            let servers = Namespace::new();
            let bridge_port = format!("p{k}");
            port(&bridge_port, "ext0", &ns);
            peers.push(pass_through(&bridge_port));
            let s = servers.tid.to_string();
            ns.sh(&[
                "ip", "link", "add", "srv0", "type", "veth", "peer", "name", "s0", "netns", &s,
            ]);
            ns.sh(&["ip", "addr", "add", &format!("198.18.0.{k}/24"), "dev", "ext0"]);
            ns.sh(&["ip", "addr", "add", "198.18.2.1/24", "dev", "srv0"]);
            for dev in ["ext0", "srv0"] {
                ns.sh(&["ip", "link", "set", dev, "up"]);
            }
            ns.sh(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
            servers.sh(&["ip", "addr", "add", "198.18.2.2/24", "dev", "s0"]);
            servers.sh(&["ip", "link", "set", "s0", "up"]);
            servers.run(|| tx_checksums_off("s0"));
            peers.push(servers.run(|| pass_through("s0")));
            let mac = ns.run(|| mac_of("ext0"));
            let server = Some(serve(&servers, &name));
            nodes.push(Node {
                node_name: name.clone(),
                name,
                tag: tag.to_owned(),
                ns,
                servers,
                server,
                mac,
                daemon: None,
                cgroup: None,
            });
        }
        Self { client, nodes, _peers: peers }
    }

    /// Which node's server a new connection to the VIP reaches, or why none.
    pub fn ask(&self) -> Result<String, String> {
        self.ask_within(Duration::from_millis(500))
    }

    /// As [`Self::ask`], the connect given up after `timeout`.
    pub fn ask_within(&self, timeout: Duration) -> Result<String, String> {
        self.ask_at(VIP.parse().unwrap(), timeout)
    }

    /// As [`Self::ask_within`], to the address `to`.
    pub fn ask_at(&self, to: SocketAddr, timeout: Duration) -> Result<String, String> {
        self.client.run(move || {
            let stream = TcpStream::connect_timeout(&to, timeout).map_err(|e| e.to_string())?;
            who(&stream)
        })
    }

    /// The node that holds the lease (not `not`), once exactly one says so
    /// and the Lease agrees; panics after 20 s.
    #[track_caller]
    pub fn wait_holder(&self, api: &FakeApiServer, not: Option<usize>) -> usize {
        let mut found = None;
        let mut roles = Vec::new();
        let one = wait_until(Duration::from_secs(20), || {
            roles = self.nodes.iter().map(Node::role).collect();
            let holders: Vec<usize> =
                (0..roles.len()).filter(|&k| roles[k].as_deref() == Some("holder")).collect();
            let lease = api.lease(LEASE.0, LEASE.1);
            let named = lease.and_then(|l| l.spec?.holder_identity);
            match holders[..] {
                [k] if Some(k) != not && named == self.nodes[k].identity() => {
                    found = Some(k);
                    true
                }
                _ => false,
            }
        });
        let logs: Vec<String> =
            self.nodes.iter().map(|n| format!("--- {}:\n{}", n.name, n.daemon().log())).collect();
        assert!(one, "not exactly one holder: {roles:?}\n{}", logs.join("\n"));
        found.unwrap()
    }

    /// The MAC address the client's neighbour table holds for the VIP.
    pub fn client_neighbour(&self) -> Option<String> {
        neighbour(&self.client, VIP_IP)
    }
}

/// The server behind a node, answering with the node's name.
pub fn serve(servers: &Namespace, name: &str) -> Backend {
    let name = name.to_owned();
    servers.run(move || Backend::start(&name, "198.18.2.2:8080".parse().unwrap()))
}

/// Where a node's servers come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Servers {
    /// The config: its own server.
    Static,
    /// The Service `default/web`'s EndpointSlices, port `http`.
    Discovered,
}

/// The service every node runs: the VIP, its node's server, announced by
/// ARP on ext0 while the node holds the lease.
pub fn services(servers: Servers) -> String {
    let source = match servers {
        Servers::Static => "servers = [\"198.18.2.2:8080\"]\n".to_owned(),
        Servers::Discovered => String::new(),
    };
    let discovery = match servers {
        Servers::Static => String::new(),
        Servers::Discovered => "[service.discovery]\n\
             kubernetes = { namespace = \"default\", service = \"web\", port = \"http\" }\n\
             debounce = \"100ms\"\n"
            .to_owned(),
    };
    format!(
        "[[service]]\nname = \"web\"\nvip = \"{VIP}\"\n{source}hold_down = \"60s\"\n\
         [service.health]\ncheck = \"tcp\"\ninterval = \"100ms\"\ntimeout = \"100ms\"\nrise = 1\nfall = 1\n\
         {discovery}[service.external]\ninterfaces = [\"ext0\"]\nannounce = \"arp\"\n\
         lease = {{ namespace = \"{}\", name = \"{}\" }}\n",
        LEASE.0, LEASE.1
    )
}

impl Node {
    /// Starts (or restarts) the node's daemon, in its namespace, with
    /// `kubeconfig` and the `services` tables.
    pub fn start(&mut self, kubeconfig: &std::path::Path, services: &str) {
        self.start_with(kubeconfig, "", services);
    }

    /// As [`Self::start`], with more `[daemon]` settings (lines of TOML).
    pub fn start_with(&mut self, kubeconfig: &std::path::Path, daemon: &str, services: &str) {
        if let Some(mut daemon) = self.daemon.take() {
            self.daemon = Some(self.ns.run(move || {
                daemon.restart();
                daemon
            }));
            return;
        }
        let (name, settings) = (
            format!("{}-{}", self.tag, self.name),
            format!("node_name = \"{}\"\nkubeconfig = {:?}\n{daemon}", self.node_name, kubeconfig),
        );
        let cgroup = TestCgroup::new(&name);
        let services = services.to_owned();
        let (daemon, cgroup) = self.ns.run(move || {
            let daemon = Daemon::start_with(&name, &cgroup, &settings, &services);
            (daemon, cgroup)
        });
        self.daemon = Some(daemon);
        self.cgroup = Some(cgroup);
    }

    /// A rolling update of the node: its daemon stopped as a pod is
    /// (SIGTERM: it keeps its leases and membership for the next), then
    /// started again with the `services` tables.
    pub fn roll(&mut self, services: &str) {
        let (daemon, cgroup) = (self.daemon.as_mut().unwrap(), self.cgroup.as_ref().unwrap());
        daemon.signal(libc::SIGTERM);
        assert!(daemon.wait_exit(Duration::from_secs(10)), "{} did not stop", self.name);
        daemon.write_config(cgroup, services);
        let mut daemon = self.daemon.take().unwrap();
        self.daemon = Some(self.ns.run(move || {
            daemon.restart();
            daemon
        }));
    }

    pub fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().expect("the node's daemon was started")
    }

    pub fn daemon_mut(&mut self) -> &mut Daemon {
        self.daemon.as_mut().expect("the node's daemon was started")
    }

    /// This node's role in the election, as its `lb status` says (`None`
    /// while its daemon does not answer).
    pub fn role(&self) -> Option<String> {
        self.lease_status("role")
    }

    /// This node's identity in the Lease (its node name and its token), as
    /// its `lb status` says.
    pub fn identity(&self) -> Option<String> {
        self.lease_status("identity")
    }

    fn lease_status(&self, field: &str) -> Option<String> {
        let status = self.daemon.as_ref()?.try_lb(&["status", "--json"]).ok()?;
        let status: serde_json::Value = serde_json::from_str(&status).ok()?;
        let value = status["services"][0]["external"]["lease"][field].as_str()?;
        Some(value.to_owned())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Stopped and detached in its own namespace, where its interfaces are.
        if let Some(daemon) = self.daemon.take() {
            self.ns.run(move || drop(daemon));
        }
        drop(self.cgroup.take());
    }
}

/// The multi-node tests time takeovers to their bounds on a machine of
/// two cores: they run one at a time, each with its two or three daemons.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A LAN of `n` nodes for the test `tag`, and the fake API server on its
/// bridge (on the runtime returned, which must outlive it).
pub fn lan_and_api(tag: &str, n: usize) -> (Lan, tokio::runtime::Runtime, FakeApiServer) {
    let lan = Lan::new(tag, n);
    let rt = crate::fakes::runtime();
    let api = rt.block_on(FakeApiServer::start_at(format!("{API}:0").parse().unwrap()));
    (lan, rt, api)
}

/// Makes every node its server's gateway, as in a cluster: a server's
/// replies to a client's own address (`externalTrafficPolicy: Local`)
/// go back through its node.
pub fn nodes_are_gateways(lan: &Lan) {
    for node in &lan.nodes {
        node.servers.sh(&["ip", "route", "add", "198.18.0.0/24", "via", "198.18.2.1"]);
    }
}

/// Puts the Service `web`'s one endpoint (198.18.2.2:8080, port `http`,
/// ready) on `node`, replacing where it was.
pub fn place_web(api: &FakeApiServer, node: &str) {
    use crate::fakes::apiserver::{Condition, endpoint, endpoint_slice};
    let pod = endpoint("198.18.2.2", node, Condition::Ready);
    api.apply(endpoint_slice("web-1", "web", "IPv4", &[("http", 8080)], vec![pod]));
}
