//! The elections by membership end to end (`[service.external] elect =
//! true`): one Lease per node, every VIP placed by rendezvous hashing,
//! three daemons on the LAN.
//!
//! - Fifty VIPs: each answered by exactly the node placement puts it on,
//!   and a client's connects to every VIP land on that node's server; a
//!   node SIGKILLed, its VIPs answered by the others (never two answering
//!   one VIP, as the capture sees it), its VIPs' connects following them
//!   and every other VIP's connects untouched; started again, it takes
//!   back its share.
//! - One VIP's servers going unready on its holder moves that VIP alone;
//!   a node cut from the API server falls silent for each of its VIPs
//!   before any other node answers it, and only its VIPs move.
//! - An API server stall of 5 s moves no VIP.
//! - A cluster moves from a Lease per VIP to membership by two rolling
//!   updates, never answering a VIP twice.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use lb_tests::{
    Backend,
    arp::Watch,
    fakes::apiserver::{FakeApiServer, Kubeconfig},
    in_new_netns,
    lan::{API, Lan, Node, lan_and_api, one_at_a_time},
    privileged_test, wait_until,
};
use lb_user::election::placement;

use super::TAKEOVER;

/// How often the client asks who has each VIP (fifty of them each time).
const ASK_EVERY: Duration = Duration::from_millis(50);

fn vip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1, 101 + k as u8)
}

/// How the services' VIPs are elected.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// `lease = { .. }`: a Lease per VIP.
    Lease,
    /// Both: a cluster moving from the one to the other.
    Both,
    /// `elect = true`.
    Membership,
}

/// `n` services, each on a VIP of its own, elected by membership; VIP
/// `k`'s server listens on `port(k)` behind each node.
fn services(n: usize, port: impl Fn(usize) -> u16) -> String {
    services_elected(n, port, Way::Membership)
}

/// As [`services`], elected `way`.
fn services_elected(n: usize, port: impl Fn(usize) -> u16, way: Way) -> String {
    let mut text = "[kubernetes]\nnamespace = \"lb-system\"\n".to_owned();
    for k in 0..n {
        let elect = match way {
            Way::Lease => format!("lease = {{ namespace = \"lb-system\", name = \"web{k}\" }}\n"),
            Way::Both => format!(
                "elect = true\nlease = {{ namespace = \"lb-system\", name = \"web{k}\" }}\n"
            ),
            Way::Membership => "elect = true\n".to_owned(),
        };
        text.push_str(&format!(
            "[[service]]\nname = \"web{k}\"\nvip = \"{}:80\"\nservers = [\"198.18.2.2:{}\"]\n\
             [service.health]\ncheck = \"tcp\"\ninterval = \"200ms\"\ntimeout = \"200ms\"\nrise = 1\nfall = 1\n\
             [service.external]\ninterfaces = [\"ext0\"]\nannounce = \"arp\"\n{elect}",
            vip(k),
            port(k)
        ));
    }
    text
}

/// The node placement puts VIP `k` on, among `nodes`.
fn placed(lan: &Lan, k: usize, nodes: &[usize]) -> usize {
    let names = nodes.iter().map(|i| lan.nodes[*i].node_name.as_str());
    let first = placement::first(&vip(k).to_string(), names).unwrap();
    lan.nodes.iter().position(|n| n.node_name == first).unwrap()
}

/// Each service's role on `node`, as one `lb status` says (empty while
/// its daemon does not answer).
fn roles(node: &Node) -> Vec<Option<String>> {
    let Ok(status) = node.daemon().try_lb(&["status", "--json"]) else { return Vec::new() };
    let Ok(status) = serde_json::from_str::<serde_json::Value>(&status) else { return Vec::new() };
    let services = status["services"].as_array().cloned().unwrap_or_default();
    services.iter().map(|s| s["external"]["lease"]["role"].as_str().map(str::to_owned)).collect()
}

/// Whether each of the `n` VIPs is held by `holder(k)` alone among `nodes`
/// (by their `lb status`).
fn held_as(lan: &Lan, n: usize, nodes: &[usize], holder: impl Fn(usize) -> usize) -> bool {
    let roles: BTreeMap<usize, Vec<Option<String>>> =
        nodes.iter().map(|&i| (i, roles(&lan.nodes[i]))).collect();
    (0..n).all(|k| {
        nodes.iter().all(|i| {
            let role = roles[i].get(k).cloned().flatten();
            (role.as_deref() == Some("holder")) == (*i == holder(k))
        })
    })
}

fn logs(lan: &Lan) -> String {
    let logs = lan.nodes.iter().map(|n| format!("--- {}:\n{}", n.name, n.daemon().log()));
    logs.collect::<Vec<_>>().join("\n")
}

/// What one connect saw: when (since the loop began), to which VIP, and
/// which node's server answered (or why none did).
type Connect = (Duration, usize, Result<String, String>);

/// A client connecting to every VIP in turn, asking each server who it is.
struct Connects {
    started: Instant,
    seen: Arc<Mutex<Vec<Connect>>>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Connects {
    fn start(lan: &Lan, n: usize) -> Self {
        let started = Instant::now();
        let (seen, stop) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicBool::new(false)));
        let (se, st) = (seen.clone(), stop.clone());
        let thread = lan.client.spawn(move || {
            // Bounded: at most ten minutes of connects.
            while !st.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(600) {
                for k in 0..n {
                    let answer = ask(SocketAddr::from((vip(k), 80)));
                    se.lock().unwrap().push((started.elapsed(), k, answer));
                }
                thread::sleep(Duration::from_millis(20));
            }
        });
        Self { started, seen, stop, thread: Some(thread) }
    }

    /// What the connects saw so far.
    fn seen(&self) -> Vec<Connect> {
        self.seen.lock().unwrap().clone()
    }

    fn stop(mut self) -> Vec<Connect> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        self.seen()
    }
}

impl Drop for Connects {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Which server answers a new connection to `to`, or why none does.
fn ask(to: SocketAddr) -> Result<String, String> {
    let mut stream = TcpStream::connect_timeout(&to, Duration::from_millis(300))
        .map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    stream.write_all(b"who\n").map_err(|e| format!("write: {e}"))?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(|e| format!("read: {e}"))?;
    Some(line.trim().to_owned()).filter(|l| !l.is_empty()).ok_or_else(|| "closed".to_owned())
}

/// Three nodes on a LAN for the test `tag`, each running `text`, and the
/// fake API server they share (on the runtime returned, which must outlive
/// it).
fn three_nodes(tag: &str, text: &str) -> (Lan, tokio::runtime::Runtime, FakeApiServer, Kubeconfig) {
    let (mut lan, rt, api) = lan_and_api(tag, 3);
    let kubeconfig = Kubeconfig::write(&api.url());
    for node in &mut lan.nodes {
        node.start(kubeconfig.path(), text);
    }
    (lan, rt, api, kubeconfig)
}

const FIFTY: usize = 50;

#[privileged_test]
fn fifty_vips_spread_by_membership_and_a_killed_nodes_move_alone() {
    let _serial = one_at_a_time();
    in_new_netns(|| {
        let text = services(FIFTY, |_| 8080);
        let (mut lan, rt, api, kubeconfig) = three_nodes("el-member", &text);
        let all = [0, 1, 2];
        let ruled = |lan: &Lan| held_as(lan, FIFTY, &all, |k| placed(lan, k, &all));
        assert!(
            wait_until(Duration::from_secs(30), || ruled(&lan)),
            "not placed as ruled\n{}",
            logs(&lan)
        );
        for i in all {
            let share = (0..FIFTY).filter(|&k| placed(&lan, k, &all) == i).count();
            assert!(share >= 8, "{}: {share} of {FIFTY} VIPs", lan.nodes[i].name);
        }
        // One Lease per node, whatever the number of VIPs.
        for node in &lan.nodes {
            assert!(api.lease("lb-system", &node.node_name).is_some(), "{}", node.node_name);
        }
        assert!(api.lease("lb-system", "web0").is_none());
        let watch = Watch::start_for(&lan.client, "pc", ASK_EVERY, (0..FIFTY).map(vip).collect());
        let connects = Connects::start(&lan, FIFTY);
        thread::sleep(Duration::from_secs(1));
        for k in 0..FIFTY {
            let turns = watch.turns_of(vip(k));
            assert_eq!(turns.len(), 1, "{}: one MAC answers: {turns:?}", vip(k));
            assert_eq!(turns[0].0, lan.nodes[placed(&lan, k, &all)].mac, "{}", vip(k));
        }

        // The node holding the most VIPs is killed: only its daemon dies,
        // its kernel answers until its fence and forwards on.
        let held = |i: usize| (0..FIFTY).filter(|&k| placed(&lan, k, &all) == i).count();
        let killed = (0..3).max_by_key(|&i| held(i)).unwrap();
        let rest: Vec<usize> = all.into_iter().filter(|&i| i != killed).collect();
        let killed_at = watch.started.elapsed();
        let killed_at_connects = connects.started.elapsed();
        lan.nodes[killed].daemon_mut().kill();
        let others_ruled = || held_as(&lan, FIFTY, &rest, |k| placed(&lan, k, &rest));
        assert!(wait_until(Duration::from_secs(20), others_ruled), "{}", logs(&lan));
        thread::sleep(Duration::from_secs(1));
        let mut answered_at: BTreeMap<usize, Duration> = BTreeMap::new();
        let mut slowest = Duration::ZERO;
        for k in 0..FIFTY {
            let turns = watch.turns_of(vip(k));
            if placed(&lan, k, &all) != killed {
                assert_eq!(turns.len(), 1, "{} moved: {turns:?}", vip(k));
                continue;
            }
            assert_eq!(turns.len(), 2, "{}: the old holder, then the new one: {turns:?}", vip(k));
            let (old, new) = (&turns[0], &turns[1]);
            assert_eq!(old.0, lan.nodes[killed].mac);
            assert_eq!(new.0, lan.nodes[placed(&lan, k, &rest)].mac);
            assert!(old.2 < new.1, "{}: the old holder fell silent first: {turns:?}", vip(k));
            assert!(new.1 - killed_at <= TAKEOVER, "{}: {:?}", vip(k), new.1 - killed_at);
            slowest = slowest.max(new.1 - killed_at);
            // On the connects' clock.
            answered_at.insert(k, new.1 - killed_at + killed_at_connects);
        }
        println!(
            "SIGKILL: {} VIPs of {} answered elsewhere within {slowest:?}",
            answered_at.len(),
            lan.nodes[killed].name
        );

        // What the client's connects saw: the untouched VIPs always on
        // their node; the moved ones on the killed node's server (its
        // kernel forwards on) or failing until their new holder answered,
        // then, within 2 s (the client's neighbour entry follows the new
        // holder's answers, no sooner than the ARP locktime of 1 s after
        // its last update), on the new holder's. The connects go on until
        // each moved VIP has been asked after that (slow machines).
        let settle = Duration::from_secs(2);
        let asked_after = |seen: &[Connect]| {
            let asked = |k: &usize, moved: &Duration| {
                seen.iter().any(|(at, j, _)| j == k && *at > *moved + settle)
            };
            answered_at.iter().all(|(k, moved)| asked(k, moved))
        };
        assert!(
            wait_until(Duration::from_secs(60), || asked_after(&connects.seen())),
            "the moved VIPs were not asked after they moved"
        );
        let seen = connects.stop();
        let mut failed = 0;
        for (at, k, answer) in &seen {
            let before = &lan.nodes[placed(&lan, *k, &all)].name;
            let Some(&moved) = answered_at.get(k) else {
                assert_eq!(answer.as_ref(), Ok(before), "{} at {at:?}", vip(*k));
                continue;
            };
            let after = &lan.nodes[placed(&lan, *k, &rest)].name;
            match answer {
                Ok(name) if *at > moved + settle => {
                    assert_eq!(name, after, "{} at {at:?}", vip(*k));
                }
                Ok(name) => {
                    assert!(name == before || name == after, "{} at {at:?}: {name}", vip(*k));
                }
                Err(e) => {
                    assert!(
                        *at >= killed_at_connects && *at <= moved + settle,
                        "{} at {at:?} (moved at {moved:?}): {e}",
                        vip(*k)
                    );
                    failed += 1;
                }
            }
        }
        let moved_connects = seen.iter().filter(|(_, k, _)| answered_at.contains_key(k)).count();
        println!(
            "connects: {} in all, {moved_connects} to moved VIPs, {failed} failed",
            seen.len()
        );
        let before_kill =
            |k: usize| seen.iter().any(|(at, j, _)| *j == k && *at < killed_at_connects);
        assert!((0..FIFTY).all(before_kill), "a VIP was not asked before the kill");

        // Back: after its hold-down it takes back its share, and only that.
        lan.nodes[killed].start(kubeconfig.path(), &text);
        assert!(
            wait_until(Duration::from_secs(30), || ruled(&lan)),
            "the restarted node did not take its share back\n{}",
            logs(&lan)
        );
        drop(watch);
        drop(lan);
        drop(api);
        drop(rt);
    });
}

const TWELVE: usize = 12;

#[privileged_test]
fn an_unready_vip_moves_alone_and_a_node_cut_from_the_api_falls_silent_first() {
    let _serial = one_at_a_time();
    in_new_netns(|| {
        let (mut lan, rt, api) = lan_and_api("el-member-cut", 3);
        // VIP 0's servers listen on a port of their own.
        let port = |k: usize| if k == 0 { 8081 } else { 8080 };
        let text = services(TWELVE, port);
        let mut vip0_servers: Vec<Option<Backend>> = Vec::new();
        // An API server listener of its own for each node: one can be cut
        // off alone.
        let mut reach = Vec::new();
        for node in &mut lan.nodes {
            let name = node.name.clone();
            vip0_servers.push(Some(
                node.servers.run(move || Backend::start(&name, "198.18.2.2:8081".parse().unwrap())),
            ));
            let addr = rt.block_on(api.listen(format!("{API}:0").parse().unwrap()));
            let kubeconfig = Kubeconfig::write(&format!("http://{addr}"));
            node.start(kubeconfig.path(), &text);
            reach.push((addr, kubeconfig));
        }
        let all = [0, 1, 2];
        let ruled = |lan: &Lan| held_as(lan, TWELVE, &all, |k| placed(lan, k, &all));
        assert!(wait_until(Duration::from_secs(30), || ruled(&lan)), "{}", logs(&lan));
        let watch = Watch::start_for(&lan.client, "pc", ASK_EVERY, (0..TWELVE).map(vip).collect());
        thread::sleep(Duration::from_millis(500));

        // VIP 0's server behind its holder stops: that node can no longer
        // serve VIP 0 and gives it up at once; nothing else moves.
        let first = placed(&lan, 0, &all);
        let others: Vec<usize> = all.into_iter().filter(|&i| i != first).collect();
        let stopped_at = watch.started.elapsed();
        vip0_servers[first].take().unwrap().stop();
        let holder =
            |k: usize| if k == 0 { placed(&lan, 0, &others) } else { placed(&lan, k, &all) };
        assert!(
            wait_until(Duration::from_secs(20), || held_as(&lan, TWELVE, &all, holder)),
            "VIP 0 did not move alone\n{}",
            logs(&lan)
        );
        thread::sleep(Duration::from_millis(500));
        let turns = watch.turns_of(vip(0));
        assert_eq!(turns.len(), 2, "{}: its holder, then another: {turns:?}", vip(0));
        assert_eq!((&turns[0].0, &turns[1].0), (&lan.nodes[first].mac, &lan.nodes[holder(0)].mac));
        assert!(turns[0].2 < turns[1].1, "the holder fell silent first: {turns:?}");
        println!("unready: {} answered elsewhere {:?} later", vip(0), turns[1].1 - stopped_at);
        for k in 1..TWELVE {
            let turns = watch.turns_of(vip(k));
            assert_eq!(turns.len(), 1, "{} moved: {turns:?}", vip(k));
        }

        // The node with the most VIPs now is cut off from the API server:
        // it falls silent for each of its VIPs (its fence) before another
        // node answers it.
        let count = |i: usize| (0..TWELVE).filter(|&k| holder(k) == i).count();
        let cut = (0..3).max_by_key(|&i| count(i)).unwrap();
        let rest: Vec<usize> = all.into_iter().filter(|&i| i != cut).collect();
        // Where each VIP goes: VIP 0 still not to `first`.
        let after = |k: usize| {
            let pool: Vec<usize> = rest.iter().copied().filter(|&i| k != 0 || i != first).collect();
            if pool.is_empty() { None } else { Some(placed(&lan, k, &pool)) }
        };
        let cut_at = watch.started.elapsed();
        api.stop_listener(reach[cut].0);
        let moved = || {
            held_as(&lan, TWELVE, &rest, |k| match after(k) {
                Some(i) if holder(k) == cut => i,
                _ if holder(k) == cut => usize::MAX,
                _ => holder(k),
            })
        };
        assert!(wait_until(Duration::from_secs(20), moved), "{}", logs(&lan));
        thread::sleep(Duration::from_millis(500));
        let mut slowest = Duration::ZERO;
        for k in 0..TWELVE {
            let turns = watch.turns_of(vip(k));
            let before = if k == 0 { 2 } else { 1 };
            if holder(k) != cut {
                assert_eq!(turns.len(), before, "{} moved: {turns:?}", vip(k));
                continue;
            }
            let Some(to) = after(k) else { continue };
            let (old, new) = (&turns[before - 1], &turns[before]);
            assert_eq!((&old.0, &new.0), (&lan.nodes[cut].mac, &lan.nodes[to].mac), "{turns:?}");
            assert!(old.2 < new.1, "{}: the cut node fell silent first: {turns:?}", vip(k));
            slowest = slowest.max(new.1 - cut_at);
        }
        println!(
            "API cut: {} VIPs of {} answered elsewhere within {slowest:?}",
            count(cut),
            lan.nodes[cut].name
        );
        drop(watch);
        drop(lan);
        drop(api);
        drop(rt);
    });
}

/// An API server that answers no Lease write for 5 s, for every node at
/// once: every node falls silent at its fence, and none counts the others'
/// silence it could not have seen; once the API answers, every VIP comes
/// back on the node that held it, and no other node ever answers one.
#[privileged_test]
fn an_api_stall_of_five_seconds_moves_no_vip_by_membership() {
    let _serial = one_at_a_time();
    in_new_netns(|| {
        let (lan, rt, api, _kubeconfig) =
            three_nodes("el-member-stall", &services(TWELVE, |_| 8080));
        let all = [0, 1, 2];
        let ruled = |lan: &Lan| held_as(lan, TWELVE, &all, |k| placed(lan, k, &all));
        assert!(wait_until(Duration::from_secs(30), || ruled(&lan)), "{}", logs(&lan));
        let watch = Watch::start_for(&lan.client, "pc", ASK_EVERY, (0..TWELVE).map(vip).collect());
        thread::sleep(Duration::from_millis(500));

        api.stall_leases();
        thread::sleep(Duration::from_secs(5));
        api.end_lease_stall();
        assert!(
            wait_until(Duration::from_secs(20), || ruled(&lan)),
            "not back as placed after the stall\n{}",
            logs(&lan)
        );
        thread::sleep(Duration::from_secs(3));
        for k in 0..TWELVE {
            let mac = &lan.nodes[placed(&lan, k, &all)].mac;
            let turns = watch.turns_of(vip(k));
            assert!(turns.iter().all(|t| t.0 == *mac), "{} moved: {turns:?}", vip(k));
            assert!(ruled(&lan), "{} no longer held as placed", vip(k));
        }
        drop(watch);
        drop(lan);
        drop(api);
        drop(rt);
    });
}

/// Whether each of the `n` VIPs has exactly one holder among the nodes
/// (by their `lb status`: the Lease's holder, or membership's).
fn one_holder_each(lan: &Lan, n: usize) -> bool {
    let roles: Vec<Vec<Option<String>>> = lan.nodes.iter().map(roles).collect();
    (0..n).all(|k| {
        let holders =
            roles.iter().filter(|r| r.get(k).cloned().flatten().as_deref() == Some("holder"));
        holders.count() == 1
    })
}

/// A cluster moves from a Lease per VIP to membership by two rolling
/// updates, a node at a time: first to both (`lease` and `elect`: a node
/// answers only while it holds both), then to membership alone. No VIP is
/// ever answered by two nodes, and none goes unanswered for long.
#[privileged_test]
fn a_cluster_moves_from_a_lease_per_vip_to_membership_by_rolling_updates() {
    let _serial = one_at_a_time();
    in_new_netns(|| {
        const N: usize = 6;
        let text = services_elected(N, |_| 8080, Way::Lease);
        let (mut lan, rt, api, _kubeconfig) = three_nodes("el-member-move", &text);
        assert!(wait_until(Duration::from_secs(30), || one_holder_each(&lan, N)), "{}", logs(&lan));
        let watch = Watch::start_for(&lan.client, "pc", ASK_EVERY, (0..N).map(vip).collect());
        thread::sleep(Duration::from_millis(500));
        for way in [Way::Both, Way::Membership] {
            for i in 0..3 {
                lan.nodes[i].roll(&services_elected(N, |_| 8080, way));
                assert!(
                    wait_until(Duration::from_secs(30), || one_holder_each(&lan, N)),
                    "{}",
                    logs(&lan)
                );
                // The hold-down: a node back takes its share after it.
                thread::sleep(Duration::from_secs(3));
            }
        }
        let all = [0, 1, 2];
        assert!(
            wait_until(Duration::from_secs(30), || held_as(&lan, N, &all, |k| placed(
                &lan, k, &all
            ))),
            "not placed as ruled once moved\n{}",
            logs(&lan)
        );
        thread::sleep(Duration::from_secs(1));
        // Never two at once: each node's run of answers ends before the
        // next one's begins; and the longest silence between answers.
        let mut longest = Duration::ZERO;
        for k in 0..N {
            let turns = watch.turns_of(vip(k));
            for pair in turns.windows(2) {
                assert!(pair[0].2 < pair[1].1, "{} answered by two: {turns:?}", vip(k));
            }
            let mut seen: Vec<Duration> =
                watch.seen().iter().filter(|s| s.vip == vip(k)).map(|s| s.at).collect();
            seen.sort();
            for pair in seen.windows(2) {
                longest = longest.max(pair[1] - pair[0]);
            }
            println!("{}: {} turns", vip(k), turns.len());
        }
        println!("moved to membership: the longest silence of a VIP {longest:?}");
        assert!(longest <= TAKEOVER, "a VIP unanswered for {longest:?}");
        drop(watch);
        drop(lan);
        drop(api);
        drop(rt);
    });
}
