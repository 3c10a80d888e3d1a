//! A router for the BGP tests: BIRD 2 (the distribution's `bird2`) in a
//! network namespace of its own on the LAN's bridge (`lan.rs`), at
//! 198.18.0.254, peering with the nodes (AS 64500 to their 64512), with
//! BFD, installing what it learns into its own routing table with every
//! next hop (ECMP, hashed on ports too, so one client's connections
//! spread). It offers the nodes routes of its own ([`OFFERED`] and a
//! default route), as a router may. The client routes the VIPs' subnet
//! through it. BIRD is stopped and the namespace removed when the router
//! is dropped.
//! Dual-stack: [`Router::start`] gives the LAN IPv6 too (`2001:2::/64`,
//! the servers `2001:2:0:2::/64`), and the router an IPv6 session with
//! each node, for IPv6 VIPs.
//!
//! ```text
//!  [client] c0 198.18.0.10 ── br0 ── [router] r0 198.18.0.254 (BIRD)
//!  2001:2::10                 │               2001:2::fe
//!  VIPs via the router        ├── ext0 [node1] 198.18.0.1 2001:2::1 (lb + its BIRD)
//!                             └── ext0 [node2] 198.18.0.2 2001:2::2
//! ```

use std::{net::IpAddr, path::PathBuf, process::Command};

use crate::{Namespace, lan::Lan, pass_xdp::PassThrough, sh, topology::pass_through};

/// The router's address on the LAN.
pub const ROUTER: &str = "198.18.0.254";
/// Its IPv6 address there.
pub const ROUTER6: &str = "2001:2::fe";
/// The address of the IPv6 server behind each node.
pub const SERVER6: &str = "[2001:2:0:2::2]:8080";
/// A network the router offers every node (with a default route, in
/// each family): lb imports nothing, so neither reaches a node's BIRD
/// tables or its kernel's.
pub const OFFERED: &str = "198.18.3.0";
/// The IPv6 network it offers.
pub const OFFERED6: &str = "2001:2:0:3::";
/// The router's AS number.
pub const ROUTER_ASN: u32 = 64_500;
/// The nodes' AS number.
pub const NODE_ASN: u32 = 64_512;

/// The router and its BIRD.
pub struct Router {
    pub ns: Namespace,
    dir: PathBuf,
    _port: PassThrough,
}

impl Router {
    /// Starts the router on `lan`'s bridge, peering with each of its nodes
    /// over IPv4 and IPv6, and routes the client's traffic to the VIPs
    /// through it. Gives the LAN IPv6 addresses first.
    pub fn start(lan: &Lan, tag: &str) -> Self {
        dual_stack(lan);
        let ns = Namespace::new();
        sh(&[
            "ip",
            "link",
            "add",
            "pr",
            "type",
            "veth",
            "peer",
            "name",
            "r0",
            "netns",
            &ns.tid.to_string(),
        ]);
        sh(&["ip", "link", "set", "pr", "master", "br0"]);
        sh(&["ip", "link", "set", "pr", "up"]);
        let port = pass_through("pr");
        ns.sh(&["ip", "addr", "add", &format!("{ROUTER}/24"), "dev", "r0"]);
        ns.sh(&["ip", "addr", "add", &format!("{ROUTER6}/64"), "dev", "r0", "nodad"]);
        ns.sh(&["ip", "link", "set", "r0", "up"]);
        ns.sh(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        ns.sh(&["sysctl", "-qw", "net.ipv4.fib_multipath_hash_policy=1"]);
        ns.sh(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
        ns.sh(&["sysctl", "-qw", "net.ipv6.fib_multipath_hash_policy=1"]);
        // The client and the nodes share the router's link: a router that
        // sent the client an ICMP redirect to the node it chose would have
        // it bypass the router (and its ECMP, and any withdrawal) for that
        // VIP until the redirect aged out.
        for conf in ["all", "r0"] {
            ns.sh(&["sysctl", "-qw", &format!("net.ipv4.conf.{conf}.send_redirects=0")]);
        }
        lan.client.sh(&["ip", "route", "replace", "198.18.1.0/24", "via", ROUTER]);
        lan.client.sh(&["ip", "-6", "route", "replace", "2001:2:0:1::/64", "via", ROUTER6]);
        // IPv6 has no send_redirects: the client ignores them instead.
        lan.client.sh(&["sysctl", "-qw", "net.ipv6.conf.c0.accept_redirects=0"]);
        let dir = std::env::temp_dir().join(format!("lb-test-{}-{tag}-router", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut conf = format!(
            "router id {ROUTER};\nprotocol device {{}}\n\
             protocol bfd {{ interface \"r0\" {{ interval 100 ms; multiplier 3; }}; }}\n\
             protocol kernel {{ ipv4 {{ export where source = RTS_BGP; }}; merge paths on; }}\n\
             protocol kernel {{ ipv6 {{ export where source = RTS_BGP; }}; merge paths on; }}\n\
             protocol static offered4 {{ ipv4; route {OFFERED}/24 blackhole; route 0.0.0.0/0 blackhole; }}\n\
             protocol static offered6 {{ ipv6; route {OFFERED6}/64 blackhole; route ::/0 blackhole; }}\n\
             template bgp node {{ local as {ROUTER_ASN}; bfd on; error wait time 1, 5; connect retry time 1; ipv4 {{ import all; export where source = RTS_STATIC; }}; }}\n\
             template bgp node6 {{ local as {ROUTER_ASN}; bfd on; error wait time 1, 5; connect retry time 1; ipv6 {{ import all; export where source = RTS_STATIC; }}; }}\n"
        );
        for k in 1..=lan.nodes.len() {
            conf.push_str(&format!(
                "protocol bgp node{k} from node {{ neighbor 198.18.0.{k} as {NODE_ASN}; }}\n\
                 protocol bgp node{k}v6 from node6 {{ neighbor 2001:2::{k} as {NODE_ASN}; }}\n"
            ));
        }
        std::fs::write(dir.join("bird.conf"), conf).unwrap();
        let (conf, socket, pid) =
            (dir.join("bird.conf"), dir.join(lb_user::bgp::SOCKET), dir.join(lb_user::bgp::PID));
        let status = ns.run(move || {
            Command::new("bird")
                .arg("-c")
                .arg(conf)
                .arg("-s")
                .arg(socket)
                .arg("-P")
                .arg(pid)
                .status()
                .expect("running bird (the bird2 package)")
        });
        assert!(status.success(), "the router's BIRD did not start: {status}");
        Self { ns, dir, _port: port }
    }

    /// What the router's BIRD says of its sessions (`show protocols`), for
    /// a failure's message.
    pub fn protocols(&self) -> String {
        let socket = self.dir.join(lb_user::bgp::SOCKET);
        match lb_user::bgp::control::command(&socket, "show protocols") {
            Ok(reply) => reply.into_iter().map(|line| line.text).collect::<Vec<_>>().join("\n"),
            Err(e) => format!("the router's BIRD did not answer: {e:#}"),
        }
    }

    /// The next hops the router's routing table has for `vip` (sorted).
    pub fn next_hops(&self, vip: &str) -> Vec<IpAddr> {
        let vip = vip.to_owned();
        let family = if vip.contains(':') { "-6" } else { "-4" };
        let text = self.ns.run(move || {
            let out = Command::new("ip").args([family, "route", "show", &vip]).output().unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        });
        let words: Vec<&str> = text.split_whitespace().collect();
        let mut hops: Vec<IpAddr> =
            words.windows(2).filter(|w| w[0] == "via").filter_map(|w| w[1].parse().ok()).collect();
        hops.sort();
        hops
    }
}

/// Gives the LAN IPv6: the client 2001:2::10, node k 2001:2::k toward
/// the LAN and 2001:2:0:2::1 toward its server, the server 2001:2:0:2::2.
fn dual_stack(lan: &Lan) {
    lan.client.sh(&["ip", "addr", "add", "2001:2::10/64", "dev", "c0", "nodad"]);
    for (k, node) in lan.nodes.iter().enumerate() {
        let lan_address = format!("2001:2::{}/64", k + 1);
        node.ns.sh(&["ip", "addr", "add", &lan_address, "dev", "ext0", "nodad"]);
        node.ns.sh(&["ip", "addr", "add", "2001:2:0:2::1/64", "dev", "srv0", "nodad"]);
        node.ns.sh(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
        node.servers.sh(&["ip", "addr", "add", "2001:2:0:2::2/64", "dev", "s0", "nodad"]);
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        lb_user::bgp::stop_bird(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
