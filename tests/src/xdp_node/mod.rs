//! The node of the XDP packet fixtures (see `xdp_fixtures/`): a network
//! namespace whose routes and neighbours the test sets, `lb_xdp` loaded on
//! maps of its own, and the frames the fixtures send it. Shared by the
//! fixtures and the program-time benchmark (`benches/xdp_program_time.rs`).

use std::{
    net::{IpAddr, SocketAddr},
    process::Command,
};

use crate::{
    in_new_netns,
    packets::{Mac, Segment},
};
mod frames;
mod program;

use aya::{
    maps::{Array, HashMap, PerCpuArray, PerCpuHashMap, PerCpuValues},
    programs::Xdp,
};
use lb_common::{
    Endpoint, Flow, FlowKey, MARK_SLOTS, MARKED_UNKNOWN, MAX_SERVERS, NatKey, NatReply, Reason,
    Service, Traffic, TrafficSlot, maglev::Maglev, maps, nat, programs, traffic_slot, vip_port_bit,
};

pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;

/// Loopback's interface index, in every network namespace.
pub const LOOPBACK: u32 = 1;

/// The size of the fixtures' opening flow tables, TCP's and UDP's (the
/// established ones are of the object's size,
/// `lb_common::MAX_EXTERNAL_FLOWS`): small, so that a test turns them
/// over with a few thousand packets.
pub const OPENING_FLOWS: u32 = 1_024;

/// The NAT tables: established flows', opening ones', UDP's.
pub const NAT_TABLES: [&str; 3] = [maps::NAT_REPLIES, maps::OPENING_REPLIES, maps::UDP_REPLIES];

/// The client's router, as the node sees it.
pub const CLIENT_MAC: Mac = [2, 0, 0, 0, 0, 1];
/// The node's interface toward clients (`ext0`).
pub const EXT_MAC: Mac = [2, 0, 0, 0, 0, 2];
/// The node's interface toward servers (`srv0`).
pub const SRV_MAC: Mac = [2, 0, 0, 0, 2, 1];
/// The servers' MACs, by their last address byte.
pub const SERVER_MACS: [(u8, Mac); 2] = [(2, [2, 0, 0, 0, 2, 2]), (3, [2, 0, 0, 0, 2, 3])];

/// One family's addresses.
pub struct Family {
    pub vip: SocketAddr,
    pub servers: [SocketAddr; 2],
    /// The node's address toward the servers (the NAT source).
    pub node: IpAddr,
    pub client: SocketAddr,
}

pub fn v4() -> Family {
    Family {
        vip: "198.18.1.100:80".parse().unwrap(),
        servers: ["198.18.2.2:8080".parse().unwrap(), "198.18.2.3:8080".parse().unwrap()],
        node: "198.18.2.1".parse().unwrap(),
        client: "198.18.0.10:40000".parse().unwrap(),
    }
}

pub fn v6() -> Family {
    Family {
        vip: "[2001:2:0:1::100]:80".parse().unwrap(),
        servers: ["[2001:2:0:2::2]:8080".parse().unwrap(), "[2001:2:0:2::3]:8080".parse().unwrap()],
        node: "2001:2:0:2::1".parse().unwrap(),
        client: "[2001:2::10]:40000".parse().unwrap(),
    }
}

pub fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().expect("running ip");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Runs `commands` (`ip` commands without the `ip`) in one `ip -batch`.
pub fn ip_batch(commands: &[String]) {
    use std::io::Write as _;
    let mut ip = Command::new("ip")
        .args(["-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running ip");
    ip.stdin
        .take()
        .expect("ip's stdin")
        .write_all(commands.join("\n").as_bytes())
        .expect("writing to ip");
    let out = ip.wait_with_output().expect("waiting for ip");
    assert!(
        out.status.success(),
        "ip -batch {commands:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn ifindex(name: &str) -> u32 {
    let c = std::ffi::CString::new(name).unwrap();
    // SAFETY: a valid C string.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    assert_ne!(index, 0, "no interface {name}");
    index
}

pub use self::{
    frames::{assert_reset, forwarded, from_client, from_server, server_mac},
    program::{Lent, Ran, test_run, time_run},
};

/// The node: the topology above in this thread's network namespace, and
/// the XDP program (loaded once per process, its maps emptied: see
/// [`Lent`]) with both families' services in its maps.
pub struct Node {
    pub ebpf: Lent,
    /// `srv0`: where packets to the servers leave, and replies arrive.
    pub srv0: u32,
    /// Whether this kernel takes the interface a test packet arrives on
    /// (an input `xdp_md`, Linux 5.14+); before, every one arrives on
    /// loopback.
    pub ingress: std::cell::Cell<Option<bool>>,
    /// Whether the flows' NAT entries now say their servers are behind
    /// loopback (see [`Node::run`]).
    servers_on_loopback: std::cell::Cell<bool>,
}

impl Node {
    #[expect(clippy::new_without_default, reason = "it builds a topology: not a default")]
    pub fn new() -> Self {
        // One `ip` for the whole topology: under a guest's software
        // emulation each process costs a good part of a second.
        let mut commands = vec![
            "link add ext0 address 02:00:00:00:00:02 type veth peer name srv0 address 02:00:00:00:02:01"
                .to_owned(),
            "link set ext0 up".to_owned(),
            "link set srv0 up".to_owned(),
            "addr add 198.18.0.1/24 dev ext0".to_owned(),
            "addr add 198.18.2.1/24 dev srv0".to_owned(),
            "addr add 2001:2::1/64 dev ext0 nodad".to_owned(),
            "addr add 2001:2:0:2::1/64 dev srv0 nodad".to_owned(),
        ];
        for (last, mac) in SERVER_MACS {
            let mac = mac.map(|b| format!("{b:02x}")).join(":");
            for ip in [format!("198.18.2.{last}"), format!("2001:2:0:2::{last}")] {
                commands.push(format!("neigh replace {ip} lladdr {mac} dev srv0 nud permanent"));
            }
        }
        ip_batch(&commands);
        // The FIB answers for forwarding only where forwarding is on.
        for path in
            ["/proc/sys/net/ipv4/conf/all/forwarding", "/proc/sys/net/ipv6/conf/all/forwarding"]
        {
            std::fs::write(path, "1").unwrap_or_else(|e| panic!("writing {path}: {e}"));
        }
        let ebpf = Lent::take();
        let mut node = Node {
            ebpf,
            srv0: ifindex("srv0"),
            ingress: std::cell::Cell::new(None),
            servers_on_loopback: std::cell::Cell::new(false),
        };
        for family in [v4(), v6()] {
            node.serve(&family, &family.servers);
            let mut addresses: HashMap<_, Endpoint, Endpoint> =
                HashMap::try_from(node.ebpf.map_mut(maps::NODE_ADDRESSES).unwrap()).unwrap();
            for server in family.servers {
                addresses.insert(host(server.ip()), host(family.node), 0).unwrap();
            }
        }
        node
    }

    /// Makes `family`'s VIP external with `servers` selected, in order.
    pub fn serve(&mut self, family: &Family, servers: &[SocketAddr]) {
        let mut service = Service {
            count: servers.len() as u32,
            hold_down_ns: 10_000_000_000,
            ..Service::default()
        };
        for (i, s) in servers.iter().enumerate().take(MAX_SERVERS) {
            service.servers[i] = Endpoint::from(*s);
        }
        let mut services: HashMap<_, Endpoint, Service> =
            HashMap::try_from(self.ebpf.map_mut(maps::SERVICES).unwrap()).unwrap();
        services.insert(Endpoint::from(family.vip), service, 0).unwrap();
        // The VIP, and its address with port 0, as the daemon writes them.
        let mut external: HashMap<_, Endpoint, u32> =
            HashMap::try_from(self.ebpf.map_mut(maps::EXTERNAL).unwrap()).unwrap();
        external.insert(Endpoint::from(family.vip), 0, 0).unwrap();
        external.insert(host(family.vip.ip()), 0, 0).unwrap();
        let mut ports: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut(maps::VIP_PORTS).unwrap()).unwrap();
        let (word, bit) = vip_port_bit(family.vip.port());
        let had = ports.get(&word, 0).unwrap();
        ports.set(word, had | bit, 0).unwrap();
        self.new_epoch();
    }

    /// Tells the program that ext0's MAC is [`EXT_MAC`], as the daemon
    /// writes `LINK_MACS` (with a new epoch), where test packets arrive:
    /// ext0, or loopback before Linux 5.14. Returns ext0's index.
    pub fn know_ext0_mac(&mut self) -> u32 {
        self.know_ext0_mac_as(EXT_MAC)
    }

    /// As [`Self::know_ext0_mac`], with `mac` as ext0's MAC address (the
    /// daemon writes an interface's new address over its old one).
    pub fn know_ext0_mac_as(&mut self, mac: [u8; 6]) -> u32 {
        let ext0 = ifindex("ext0");
        let arrives = if self.knows_ingress() { ext0 } else { 1 };
        let mut links: HashMap<_, u32, lb_common::AnnounceValue> =
            HashMap::try_from(self.ebpf.map_mut(maps::LINK_MACS).unwrap()).unwrap();
        links.insert(arrives, lb_common::AnnounceValue { mac, _pad: [0; 2] }, 0).unwrap();
        self.new_epoch();
        ext0
    }

    /// Ends the verdicts the program keeps for established flows, as the
    /// daemon does after every change to `SERVICES`, `EXTERNAL` or
    /// `LINK_MACS`: a test that writes one of them directly calls this.
    pub fn new_epoch(&mut self) {
        let mut epoch: Array<_, u32> =
            Array::try_from(self.ebpf.map_mut(maps::EPOCH).unwrap()).unwrap();
        let now = epoch.get(&0, 0).unwrap();
        epoch.set(0, now.wrapping_add(1), 0).unwrap();
    }

    /// As [`Self::serve`], with `policy = "spread"` over every server and
    /// the Maglev table the daemon would write for them.
    pub fn serve_spread(&mut self, family: &Family, servers: &[SocketAddr]) {
        self.serve(family, servers);
        let mut services: HashMap<_, Endpoint, Service> =
            HashMap::try_from(self.ebpf.map_mut(maps::SERVICES).unwrap()).unwrap();
        let vip = Endpoint::from(family.vip);
        let mut service = services.get(&vip, 0).unwrap();
        service.spread = servers.len() as u32;
        services.insert(vip, service, 0).unwrap();
        let mut tables: HashMap<_, Endpoint, Maglev> =
            HashMap::try_from(self.ebpf.map_mut(maps::MAGLEV).unwrap()).unwrap();
        tables.insert(vip, lb_user::maglev::table(servers), 0).unwrap();
        self.new_epoch();
    }

    /// Runs the program on `frame` as if it arrived on `ingress` (loopback
    /// when `None`): its verdict and the frame it left.
    ///
    /// A kernel that runs test packets on loopback alone (before Linux
    /// 5.14, [`Node::knows_ingress`]) cannot deliver a server's packet on
    /// `srv0`, where `lb_xdp` takes replies from. There the flows' NAT
    /// entries are made to say their servers are behind loopback for a
    /// packet meant to arrive on `srv0`, and `srv0` again for any other,
    /// so that a reply from elsewhere is still one from elsewhere; and
    /// their clients the other way round, so that an error about a reply
    /// from the servers' side is still not from the clients'.
    pub fn run(&self, frame: &[u8], ingress: Option<u32>) -> (u32, Vec<u8>) {
        let from_servers = ingress == Some(self.srv0);
        if (from_servers || self.servers_on_loopback.get()) && !self.knows_ingress() {
            self.servers_behind(if from_servers { LOOPBACK } else { self.srv0 });
            self.servers_on_loopback.set(from_servers);
        }
        let ingress = ingress.filter(|_| self.knows_ingress());
        self.try_run(frame, ingress).expect("BPF_PROG_TEST_RUN")
    }

    /// Makes every NAT entry that names `srv0` or loopback as where its
    /// server is name `ifindex`, and the other of the two as where its
    /// client is.
    fn servers_behind(&self, ifindex: u32) {
        let other = if ifindex == LOOPBACK { self.srv0 } else { LOOPBACK };
        let ours = [self.srv0, LOOPBACK];
        for table in NAT_TABLES {
            let map = self.ebpf.map(table).unwrap();
            let entries: HashMap<_, NatKey, NatReply> = HashMap::try_from(map).unwrap();
            let all: Vec<(NatKey, NatReply)> = entries.iter().map(Result::unwrap).collect();
            for (key, entry) in all {
                let mut moved = entry;
                if ours.contains(&entry.server_ifindex) {
                    moved.server_ifindex = ifindex;
                }
                if ours.contains(&entry.client_ifindex) {
                    moved.client_ifindex = other;
                }
                if moved != entry {
                    program::update(map, &key, &moved);
                }
            }
        }
    }

    /// Whether test packets can arrive on an interface of choice (Linux
    /// 5.14+ takes an input `xdp_md`; before, it refuses one).
    pub fn knows_ingress(&self) -> bool {
        if let Some(known) = self.ingress.get() {
            return known;
        }
        let probe =
            Segment::udp((EXT_MAC, CLIENT_MAC), v4().client, "198.18.9.9:9".parse().unwrap(), b"");
        let known = self.try_run(&probe.frame(), Some(self.srv0)).is_ok();
        if !known {
            eprintln!(
                "this kernel runs test packets on loopback only (an input xdp_md needs Linux 5.14)"
            );
        }
        self.ingress.set(Some(known));
        known
    }

    pub fn try_run(
        &self,
        frame: &[u8],
        ingress: Option<u32>,
    ) -> Result<(u32, Vec<u8>), aya::programs::ProgramError> {
        let program: &Xdp = self.ebpf.program(programs::XDP).unwrap().try_into().unwrap();
        test_run(program, frame, 1, ingress).map(|ran| (ran.verdict, ran.frame))
    }

    /// The program's time per run on `frame` arriving on `ingress`
    /// (loopback when `None`; Linux 5.14+), run `repeat` times on the same
    /// buffer (the kernel's measure under `BPF_PROG_TEST_RUN`: its
    /// average). Repeats see what the runs before them left of the frame.
    pub fn time(&self, frame: &[u8], repeat: u32, ingress: Option<u32>) -> std::time::Duration {
        let program: &Xdp = self.ebpf.program(programs::XDP).unwrap().try_into().unwrap();
        time_run(program, frame, repeat, ingress)
    }

    pub fn counter(&self, reason: Reason) -> u64 {
        let counters: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.ebpf.map(maps::COUNTERS).unwrap()).unwrap();
        counters.get(&reason.index(), 0).unwrap().iter().sum()
    }

    /// Moves every flow's SYN `by` into the past, as if the client had
    /// waited that long before sending it again.
    pub fn age_syns(&mut self, by: std::time::Duration) {
        for table in [maps::FLOWS, maps::OPENING_FLOWS, maps::UDP_FLOWS] {
            let mut flows: HashMap<_, FlowKey, Flow> =
                HashMap::try_from(self.ebpf.map_mut(table).unwrap()).unwrap();
            let all: Vec<(FlowKey, Flow)> = flows.iter().map(Result::unwrap).collect();
            for (key, mut flow) in all {
                flow.syn_at_ns = flow.syn_at_ns.saturating_sub(by.as_nanos() as u64);
                flows.insert(key, flow, 0).unwrap();
            }
        }
    }

    /// Moves every NAT entry's last-seen time `by` into the past, as if
    /// its flow had been quiet that long.
    pub fn age_nat(&mut self, by: std::time::Duration) {
        let ticks = nat::tick(by.as_nanos() as u64);
        for table in NAT_TABLES {
            let mut entries: HashMap<_, NatKey, NatReply> =
                HashMap::try_from(self.ebpf.map_mut(table).unwrap()).unwrap();
            let all: Vec<(NatKey, NatReply)> = entries.iter().map(Result::unwrap).collect();
            for (key, mut entry) in all {
                let seen = entry.flags >> 8;
                entry.flags = nat::stamp(entry.flags, seen.wrapping_sub(ticks) & 0xff_ffff);
                entries.insert(key, entry, 0).unwrap();
            }
        }
    }

    /// Packets forwarded to `server` as counted in its `TRAFFIC` entry and
    /// in the slots of `TRAFFIC_SLOTS` it holds, each over every CPU.
    pub fn traffic(&self, server: SocketAddr) -> TrafficParts {
        let server = Endpoint::from(server);
        let entries: PerCpuHashMap<_, Endpoint, Traffic> =
            PerCpuHashMap::try_from(self.ebpf.map(maps::TRAFFIC).unwrap()).unwrap();
        let entry = entries.get(&server, 0).map(|v| v.iter().map(|t| t.packets).sum());
        let slots: PerCpuArray<_, TrafficSlot> =
            PerCpuArray::try_from(self.ebpf.map(maps::TRAFFIC_SLOTS).unwrap()).unwrap();
        let per_cpu = slots.get(&traffic_slot(&server), 0).unwrap();
        let held = per_cpu.iter().filter(|slot| slot.server == server);
        TrafficParts { entry: entry.unwrap_or(0), slots: held.map(|s| s.traffic.packets).sum() }
    }

    /// Writes `slot` into slot `index` of `TRAFFIC_SLOTS` on every CPU.
    pub fn set_traffic_slot(&mut self, index: u32, slot: TrafficSlot) {
        let mut slots: PerCpuArray<_, TrafficSlot> =
            PerCpuArray::try_from(self.ebpf.map_mut(maps::TRAFFIC_SLOTS).unwrap()).unwrap();
        let cpus = aya::util::nr_cpus().unwrap();
        slots.set(index, PerCpuValues::try_from(vec![slot; cpus]).unwrap(), 0).unwrap();
    }

    /// The NAT entry of `key`, in either table.
    pub fn nat_entry(&self, key: &NatKey) -> Option<NatReply> {
        NAT_TABLES.iter().find_map(|table| self.nat_entry_in(table, key))
    }

    /// The NAT entry of `key` in `table` (one of [`NAT_TABLES`]).
    pub fn nat_entry_in(&self, table: &str, key: &NatKey) -> Option<NatReply> {
        let entries: HashMap<_, NatKey, NatReply> =
            HashMap::try_from(self.ebpf.map(table).unwrap()).unwrap();
        entries.get(key, 0).ok()
    }

    /// Sets `LIMITS[slot]` to `per_second` per CPU, as the daemon writes
    /// it (`lb_common::LIMIT_NEW_FLOWS`: `[daemon] new_flows_per_cpu`;
    /// `LIMIT_ANSWERS`: `ANSWERS_PER_CPU`); 0, as each case starts: none.
    pub fn set_limit(&mut self, slot: u32, per_second: u32) {
        let mut limits: Array<_, u32> =
            Array::try_from(self.ebpf.map_mut(maps::LIMITS).unwrap()).unwrap();
        limits.set(slot, per_second, 0).unwrap();
    }

    /// How many NAT ports are held (entries in either table).
    pub fn nat_entries(&self) -> usize {
        NAT_TABLES
            .iter()
            .map(|table| {
                let entries: HashMap<_, NatKey, NatReply> =
                    HashMap::try_from(self.ebpf.map(table).unwrap()).unwrap();
                entries.keys().count()
            })
            .sum()
    }

    /// Marks `server` failed now in `FAILED_AT` alone, as a program that
    /// did not stamp `MARKED_AT` would (one of an older lb).
    pub fn mark_without_stamp(&mut self, server: SocketAddr) {
        let mut failed: HashMap<_, Endpoint, u64> =
            HashMap::try_from(self.ebpf.map_mut(maps::FAILED_AT).unwrap()).unwrap();
        failed.insert(Endpoint::from(server), monotonic_ns(), 0).unwrap();
    }

    /// Says every failure mark is of unknown age, as the daemon does when
    /// its programs replace running ones.
    pub fn forget_marks(&mut self) {
        let mut marked: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut(maps::MARKED_AT).unwrap()).unwrap();
        for slot in 0..MARK_SLOTS {
            marked.set(slot, MARKED_UNKNOWN, 0).unwrap();
        }
    }

    pub fn failed(&self, server: SocketAddr) -> bool {
        let failed: HashMap<_, Endpoint, u64> =
            HashMap::try_from(self.ebpf.map(maps::FAILED_AT).unwrap()).unwrap();
        failed.get(&Endpoint::from(server), 0).is_ok()
    }
}

/// `bpf_ktime_get_ns()` now: CLOCK_MONOTONIC.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// Packets forwarded to one server, where they were counted (see
/// [`Node::traffic`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrafficParts {
    /// In its `TRAFFIC` entry.
    pub entry: u64,
    /// In the slots of `TRAFFIC_SLOTS` it holds.
    pub slots: u64,
}

/// The kernel's jiffies now (`bpf_jiffies64()`), from /proc/timer_list.
pub fn jiffies() -> u64 {
    let list = std::fs::read_to_string("/proc/timer_list").expect("reading /proc/timer_list");
    let line = list.lines().find_map(|l| l.strip_prefix("jiffies: ")).expect("no jiffies line");
    line.trim().parse().expect("jiffies")
}

/// Keeps this thread on the CPU it runs on, so that what the program
/// keeps per CPU is the same from one run to the next.
pub fn stay_on_one_cpu() {
    // SAFETY: a zeroed cpu_set_t is a valid, empty set; CPU_SET and
    // sched_setaffinity only read and write it.
    unsafe {
        let cpu = usize::try_from(libc::sched_getcpu()).expect("sched_getcpu");
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        let pinned = libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
        assert_eq!(pinned, 0, "sched_setaffinity: {}", std::io::Error::last_os_error());
    }
}

/// The address alone, as `NODE_ADDRESSES` keys and values hold it.
pub fn host(ip: IpAddr) -> Endpoint {
    Endpoint::from(SocketAddr::new(ip, 0))
}

/// Runs `case` for IPv4 and for IPv6, each on a node of its own. The
/// caller is a `#[privileged_test]`.
pub fn both_families(case: fn(&mut Node, &Family)) {
    for family in [v4(), v6()] {
        in_new_netns(move || {
            let mut node = Node::new();
            case(&mut node, &family);
        });
    }
}
