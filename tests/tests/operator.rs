//! What an operator relies on: live reload that applies only the
//! difference, an invalid reload that changes nothing, metrics that match
//! what happened, and `lb status`. Needs root; see `lb_tests::privileged`.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use lb_tests::{
    Backend, Check, Client, Connect, Daemon, Policy, ServiceBuilder, TestCgroup, addr,
    privileged_test, wait_until,
};

fn client(cgroup: &TestCgroup) -> Client {
    Client::start(env!("CARGO_BIN_EXE_lb-test-client"), Some(cgroup))
}

/// The services here are checked over TCP every 200 ms (timeout 150 ms),
/// so states settle fast enough to assert on them and on their metrics.
const TCP_EVERY_200MS: Check = Check::Tcp { interval: Duration::from_millis(200) };

fn scrape(metrics: SocketAddr) -> String {
    let mut stream =
        TcpStream::connect_timeout(&metrics, Duration::from_secs(5)).expect("metrics endpoint");
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response.split_once("\r\n\r\n").unwrap().1.to_owned()
}

/// The value of the sample `name{labels}` in a scrape, if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The services `lb status` lists, by name, in its order.
fn service_names(status: &serde_json::Value) -> Vec<&str> {
    status["services"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect()
}

#[privileged_test]
fn reload_applies_only_the_difference_under_live_connections() {
    let cgroup = TestCgroup::new("reload");
    let one = Backend::start("one", addr(30, 1, 0));
    let two = Backend::start("two", addr(30, 2, 0));
    let three = Backend::start("three", addr(30, 3, 0));
    let (kept_vip, changed_vip, removed_vip, added_vip) =
        (addr(30, 100, 80), addr(30, 101, 80), addr(30, 102, 80), addr(30, 103, 80));
    let before =
        ServiceBuilder::new("kept", kept_vip).servers(&[one.addr]).check(TCP_EVERY_200MS).toml()
            + &ServiceBuilder::new("changed", changed_vip)
                .servers(&[two.addr])
                .check(TCP_EVERY_200MS)
                .toml()
            + &ServiceBuilder::new("removed", removed_vip)
                .servers(&[three.addr])
                .check(TCP_EVERY_200MS)
                .toml();
    let daemon = Daemon::start("reload", &cgroup, &before);
    if !daemon.has_feature("sock_destroy") {
        return;
    }
    let mut inside = client(&cgroup);
    let kept = inside.connect(kept_vip);
    assert_eq!(kept.landed(), "one");
    let changed = inside.connect(changed_vip);
    assert_eq!(changed.landed(), "two");
    let removed = inside.connect(removed_vip);
    assert_eq!(removed.landed(), "three");
    let kept_state_before = daemon.status()["services"][0].clone();

    let after =
        ServiceBuilder::new("kept", kept_vip).servers(&[one.addr]).check(TCP_EVERY_200MS).toml()
            + &ServiceBuilder::new("changed", changed_vip)
                .servers(&[two.addr, three.addr])
                .check(TCP_EVERY_200MS)
                .policy(Policy::Spread)
                .toml()
            + &ServiceBuilder::new("added", added_vip)
                .servers(&[three.addr])
                .check(TCP_EVERY_200MS)
                .toml();
    daemon.write_config(&cgroup, &after);
    assert_eq!(daemon.lb(&["reload"]).trim(), "config reloaded");
    // Only the tables whose text changed were parsed: "kept" was not.
    assert!(daemon.log().contains("tables_parsed=2"), "{}", daemon.log());

    let status = daemon.status();
    let names = service_names(&status);
    assert_eq!(names, ["kept", "changed", "added"]);
    assert_eq!(
        status["services"][0], kept_state_before,
        "an unchanged service keeps its state and counts"
    );
    assert_eq!(status["services"][1]["policy"], "spread");
    assert!(inside.alive(kept.id()), "an unchanged service keeps its connections");
    assert!(
        inside.alive(changed.id()),
        "a changed service keeps connections to servers it still has"
    );
    assert!(
        wait_until(Duration::from_secs(5), || !inside.alive(removed.id())),
        "a removed service's VIP connections must be closed"
    );
    assert_eq!(inside.connect(added_vip).landed(), "three");
    // The removed VIP is not rewritten any more: nothing listens on it.
    assert!(matches!(inside.connect(removed_vip), Connect::Err(e) if e.contains("refused")));
    assert_eq!(status["config"]["last_reload"]["ok"], true);
    // The changed service's new server is health checked: it leaves
    // "unchecked" only at its first passing check.
    assert!(
        wait_until(Duration::from_secs(5), || {
            let status = daemon.status();
            let servers = status["services"][1]["servers"].as_array().cloned().unwrap_or_default();
            servers.len() == 2
                && servers.iter().all(|s| s["state"] != "unchecked" && s["healthy"] == true)
        }),
        "the changed service's servers: {}",
        daemon.status()["services"][1]["servers"]
    );

    // A reload that reorders the services and changes only the health
    // settings of one: its checks restart with them, nothing else changes.
    let every_300ms = Check::Tcp { interval: Duration::from_millis(300) };
    let reordered = ServiceBuilder::new("added", added_vip)
        .servers(&[three.addr])
        .check(TCP_EVERY_200MS)
        .toml()
        + &ServiceBuilder::new("kept", kept_vip).servers(&[one.addr]).check(every_300ms).toml()
        + &ServiceBuilder::new("changed", changed_vip)
            .servers(&[two.addr, three.addr])
            .check(TCP_EVERY_200MS)
            .policy(Policy::Spread)
            .toml();
    daemon.write_config(&cgroup, &reordered);
    assert_eq!(daemon.lb(&["reload"]).trim(), "config reloaded");
    let status = daemon.status();
    let names = service_names(&status);
    assert_eq!(names, ["added", "kept", "changed"]);
    assert_eq!(inside.connect(kept_vip).landed(), "one");
    assert!(inside.alive(kept.id()), "a reordered service keeps its connections");
    // Its restarted check sees its server go (nothing else would: no
    // client connects to it any more).
    drop(one);
    assert!(
        wait_until(
            Duration::from_secs(5),
            || daemon.status()["services"][1]["servers"][0]["healthy"] == false
        ),
        "the check of a service whose health settings changed did not run: {}",
        daemon.status()["services"][1]
    );
}

#[privileged_test]
fn an_invalid_reload_keeps_serving_the_old_config_and_says_so() {
    let cgroup = TestCgroup::new("badreload");
    let one = Backend::start("one", addr(31, 1, 0));
    let vip = addr(31, 100, 80);
    let daemon = Daemon::start(
        "badreload",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[one.addr]).check(TCP_EVERY_200MS).toml(),
    );
    let mut inside = client(&cgroup);
    let open = inside.connect(vip);
    assert_eq!(open.landed(), "one");

    // A typo'd key and a bad address: rejected as a whole.
    let bad = ServiceBuilder::new("api", vip)
        .servers(&["127.77.31.2:0".parse().unwrap()])
        .check(TCP_EVERY_200MS)
        .raw("polcy = \"spread\"");
    daemon.write_config(&cgroup, &bad.toml());
    let error = daemon.try_lb(&["reload"]).expect_err("an invalid reload must fail");
    assert!(error.contains("polcy"), "{error}");
    // SIGHUP takes the same path.
    daemon.signal(libc::SIGHUP);
    assert!(
        wait_until(Duration::from_secs(5), || daemon.log().matches("reload failed").count() >= 2),
        "{}",
        daemon.log()
    );

    let status = daemon.status();
    assert_eq!(status["config"]["last_reload"]["ok"], false);
    assert!(status["config"]["last_reload"]["error"].as_str().unwrap().contains("polcy"));
    assert_eq!(status["services"][0]["servers"][0]["address"], one.addr.to_string());
    assert!(daemon.lb(&["status"]).contains("LAST RELOAD FAILED"));
    assert!(inside.alive(open.id()));
    assert_eq!(inside.connect(vip).landed(), "one");

    // Fixed: the next reload reads the whole file (a failed reload may
    // have applied part of its change) and applies it.
    let fixed = ServiceBuilder::new("api", vip)
        .servers(&[one.addr])
        .check(TCP_EVERY_200MS)
        .policy(Policy::Spread);
    daemon.write_config(&cgroup, &fixed.toml());
    assert_eq!(daemon.lb(&["reload"]).trim(), "config reloaded");
    assert!(daemon.log().contains("tables_parsed=all"), "{}", daemon.log());
    let status = daemon.status();
    assert_eq!(status["config"]["last_reload"]["ok"], true);
    assert_eq!(status["services"][0]["policy"], "spread");
    assert!(inside.alive(open.id()));
}

#[privileged_test]
fn metrics_match_what_happened() {
    let cgroup = TestCgroup::new("metrics");
    let one = Backend::start("one", addr(32, 1, 0));
    let dead = addr(32, 9, one.addr.port());
    let vip = addr(32, 100, 80);
    let metrics = addr(32, 200, 9464);
    // A second service judged by kernel reports only, whose first server
    // is dead: the connect through it fails and is counted.
    let passive_vip = addr(32, 101, 80);
    let passive =
        ServiceBuilder::new("passive", passive_vip).servers(&[dead, one.addr]).check(Check::None);
    let daemon = Daemon::start_with(
        "metrics",
        &cgroup,
        &format!("metrics = \"{metrics}\"\n"),
        &(ServiceBuilder::new("api", vip)
            .servers(&[dead, one.addr])
            .check(TCP_EVERY_200MS)
            .hold_down(Duration::from_secs(60))
            .toml()
            + &passive.toml()),
    );
    if !daemon.has_feature("sock_destroy") {
        return;
    }

    let mut inside = client(&cgroup);
    // The dead server fails its checks; the live one becomes active.
    assert!(
        wait_until(
            Duration::from_secs(10),
            || daemon.status()["services"][0]["servers"][1]["state"] == "active"
        ),
        "{}",
        daemon.log()
    );
    let ids: Vec<u32> = (0..3)
        .map(|_| inside.connect(vip))
        .inspect(|a| assert_eq!(a.landed(), "one"))
        .map(|a| a.id())
        .collect();
    let said = daemon.lb(&["close-connections", &one.addr.to_string()]);
    assert!(said.contains("closed 3 connections"), "{said}");
    for id in &ids {
        assert!(wait_until(Duration::from_secs(5), || !inside.alive(*id)));
    }
    let still_open = inside.connect(vip);
    assert!(
        matches!(inside.connect(passive_vip), Connect::Err(_)),
        "the passive service's first server is dead"
    );
    daemon.try_lb(&["reload"]).unwrap();

    let server = |s: SocketAddr| format!("service=\"api\",server=\"{s}\"");
    assert!(
        wait_until(Duration::from_secs(5), || sample(
            &scrape(metrics),
            &format!("lb_server_connections{{{}}}", server(one.addr))
        ) == Some(1.0)),
        "{}",
        scrape(metrics)
    );
    let text = scrape(metrics);
    assert_eq!(
        sample(&text, &format!("lb_server_state{{{},state=\"active\"}}", server(one.addr))),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, &format!("lb_server_state{{{},state=\"failed\"}}", server(dead))),
        Some(1.0),
        "{text}"
    );
    assert_eq!(sample(&text, &format!("lb_server_healthy{{{}}}", server(one.addr))), Some(1.0));
    assert_eq!(sample(&text, &format!("lb_server_healthy{{{}}}", server(dead))), Some(0.0));
    assert_eq!(
        sample(
            &text,
            &format!("lb_connections_closed_total{{{},reason=\"manual\"}}", server(one.addr))
        ),
        Some(3.0),
        "{text}"
    );
    assert_eq!(sample(&text, "lb_config_reloads_total{result=\"success\"}"), Some(1.0), "{text}");
    assert!(sample(&text, "lb_selection_changes_total{service=\"api\"}").unwrap() >= 1.0);
    assert!(
        sample(&text, "lb_datapath_decisions_total{reason=\"connect_rewritten\"}").unwrap() >= 4.0,
        "{text}"
    );
    assert!(
        sample(&text, &format!("lb_health_check_duration_seconds_count{{{}}}", server(one.addr)))
            .unwrap()
            >= 1.0,
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            &format!("lb_connect_failures_total{{service=\"passive\",server=\"{dead}\"}}")
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            &format!("lb_server_state{{service=\"passive\",server=\"{dead}\",state=\"failed\"}}")
        ),
        Some(1.0),
        "{text}"
    );

    // A server that leaves: its connection is closed as `removed`, counted
    // after it left; its gauges go, its counters stay.
    let still_open = still_open.id();
    daemon.lb(&["servers", "api", &dead.to_string()]);
    assert!(wait_until(Duration::from_secs(5), || !inside.alive(still_open)));
    let removed = format!("lb_connections_closed_total{{{},reason=\"removed\"}}", server(one.addr));
    assert!(
        wait_until(Duration::from_secs(5), || sample(&scrape(metrics), &removed) == Some(1.0)),
        "{}",
        scrape(metrics)
    );
    let text = scrape(metrics);
    assert_eq!(
        sample(&text, &format!("lb_server_state{{{},state=\"active\"}}", server(one.addr))),
        None,
        "{text}"
    );
}

#[privileged_test]
fn sigterm_leaves_the_datapath_working_unless_detach_on_exit() {
    let cgroup = TestCgroup::new("sigterm");
    let one = Backend::start("one", addr(33, 1, 0));
    let vip = addr(33, 100, 80);
    let mut daemon = Daemon::start(
        "sigterm",
        &cgroup,
        &ServiceBuilder::new("api", vip).servers(&[one.addr]).check(TCP_EVERY_200MS).toml(),
    );
    let mut inside = client(&cgroup);
    let open = inside.connect(vip);
    assert_eq!(open.landed(), "one");

    daemon.signal(libc::SIGTERM);
    assert!(daemon.wait_exit(Duration::from_secs(10)), "SIGTERM did not stop the daemon");
    assert!(daemon.bpffs.join("links").exists(), "the datapath must stay pinned");
    assert_eq!(inside.connect(vip).landed(), "one", "fail-static: the VIP still works");
    assert!(inside.alive(open.id()));

    daemon.restart_with(&["--detach-on-exit"]);
    assert_eq!(daemon.status()["datapath"]["adopted"], true);
    daemon.signal(libc::SIGTERM);
    assert!(daemon.wait_exit(Duration::from_secs(10)));
    assert!(!daemon.bpffs.exists(), "--detach-on-exit must remove every pin");
    assert!(
        matches!(inside.connect(vip), Connect::Err(e) if e.contains("refused")),
        "nothing rewrites after --detach-on-exit"
    );
}

/// `lb detach` wins over a supervisor, under the shipped privileges.
/// `lb run` runs in a restart loop (systemd's `Restart=always` with the
/// unit's `RestartPreventExitStatus=3`) without CAP_SYS_ADMIN, as does
/// `lb detach`. A crash is restarted; `lb detach` stops the daemon, which
/// exits with 3 and is not started again, and when `lb detach` returns
/// nothing rewrites connects to the VIP any more. Before, the daemon was
/// told to shut down (exit 0) and restarted a second later.
#[privileged_test]
fn detach_is_final_under_a_restart_loop_without_cap_sys_admin() {
    let cgroup = TestCgroup::new("detach-loop");
    let one = Backend::start("one", addr(35, 1, 0));
    let vip = addr(35, 100, 80);
    let daemon = Daemon::prepare(
        "detach-loop",
        &cgroup,
        "",
        &[],
        &ServiceBuilder::new("api", vip).servers(&[one.addr]).toml(),
    );
    let answers = || daemon.try_lb(&["status"]).is_ok();
    let mut supervisor = lb_tests::supervisor::RestartLoop::start(
        &daemon.config,
        daemon.dir.join("lb.log"),
        Duration::from_secs(120),
    );
    assert!(wait_until(Duration::from_secs(30), answers), "lb run: {}", daemon.log());
    let mut inside = client(&cgroup);
    assert_eq!(inside.connect(vip).landed(), "one");

    // A crash: the supervisor starts it again, and it adopts the pins.
    supervisor.kill();
    assert!(
        wait_until(Duration::from_secs(30), || supervisor.exits().len() == 1 && answers()),
        "the supervisor did not restart lb: {:?}\n{}",
        supervisor.exits(),
        daemon.log()
    );
    assert_eq!(daemon.status()["datapath"]["adopted"], true);

    let mut detach = std::process::Command::new(lb_tests::lb_bin());
    detach.args(["detach", "--config"]).arg(&daemon.config);
    lb_tests::supervisor::without_cap_sys_admin(&mut detach);
    let out = detach.output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    // (Whether it says it stopped the daemon depends on the daemon's
    // answer reaching it; the loop's record below is the proof.)
    assert!(out.status.success(), "lb detach: {said}{}", String::from_utf8_lossy(&out.stderr));
    // The wait for the links to go works without CAP_SYS_ADMIN: nothing
    // rewrites right after `lb detach` returns.
    assert!(
        matches!(inside.connect(vip), Connect::Err(e) if e.contains("refused")),
        "a connect right after lb detach was still rewritten"
    );
    assert!(
        supervisor.wait_end(Duration::from_secs(10)),
        "the loop goes on: {:?}",
        supervisor.exits()
    );
    assert_eq!(supervisor.exits(), [None, Some(3)], "killed, then exited for lb detach");
    std::thread::sleep(Duration::from_millis(1_500));
    assert!(!answers(), "a daemon answers after lb detach:\n{}", daemon.log());
    assert!(!daemon.bpffs.exists(), "pins are back after lb detach: {}", daemon.bpffs.display());
    assert!(
        matches!(inside.connect(vip), Connect::Err(e) if e.contains("refused")),
        "the VIP is rewritten again after lb detach"
    );
}

/// Kernel events left unread in the pinned ring buffer across a restart are
/// history. While the daemon is down, 20 connects through the VIP are
/// refused by s1 (hold-down 1 ms: each tries s1 first), and s1 comes back.
/// The restarted daemon reads those 20 events at start and acts on none: s1
/// is not failed, no failure is counted, and connects go to s1.
#[privileged_test]
fn kernel_events_from_before_a_restart_are_history() {
    let cgroup = TestCgroup::new("history");
    let s1 = Backend::start("s1", addr(36, 1, 0));
    let s2 = Backend::start("s2", addr(36, 2, 0));
    let vip = addr(36, 100, 80);
    let service = ServiceBuilder::new("api", vip)
        .servers(&[s1.addr, s2.addr])
        .hold_down(Duration::from_millis(1))
        .toml();
    let mut daemon = Daemon::start("history", &cgroup, &service);
    let mut inside = client(&cgroup);
    assert_eq!(inside.connect(vip).landed(), "s1");
    let state = daemon.status()["services"][0]["servers"][0]["state"].clone();

    daemon.kill();
    let s1_addr = s1.stop();
    let mut refused = 0;
    for _ in 0..20 {
        // Each refused connect is an event in the ring buffer, unread.
        if matches!(inside.connect(vip), Connect::Err(e) if e.contains("refused")) {
            refused += 1;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(refused, 20, "the setup: every connect tried the stopped s1");
    let s1 = Backend::start("s1", s1_addr);
    daemon.restart();
    let ignored =
        || daemon.log().matches("ignoring a kernel event from before this daemon started").count();
    assert!(wait_until(Duration::from_secs(5), || ignored() >= 20), "{}", daemon.log());
    let status = daemon.status();
    let server = &status["services"][0]["servers"][0];
    assert_eq!((&server["address"], &server["state"]), (&s1_addr.to_string().into(), &state));
    assert!(
        !daemon.log().contains("connect through the VIP failed"),
        "the restarted daemon took history for news:\n{}",
        daemon.log()
    );
    assert_eq!(inside.connect(vip).landed(), "s1");
    drop(s1);
}
