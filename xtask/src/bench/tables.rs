//! The bench's tables, one function per part (the parts that did not run
//! have none), each rendered as aligned text or as Markdown.

use super::{
    discovery, dns,
    external_tables::external,
    format::{count, millis, ms, services},
    owner,
    paths::Route,
    results::{DnsRoute, KeepAliveCost, Membership, Results, Workload},
    stats::{median, percentile},
    table::Table,
    workloads::CONNECTS,
};

fn rate(workload: Workload, value: f64) -> String {
    match workload {
        Workload::Bulk => format!("{value:.2} GB/s"),
        _ => format!("{:.1}k/s", value / 1000.0),
    }
}

/// Every part's tables, in the order of the parts, for the parts that ran.
pub(super) fn tables(r: &Results) -> Vec<Table> {
    let mut tables = Vec::new();
    for part in [
        paths,
        daemon_cpu,
        kernel_cost,
        keepalive_cost,
        scale,
        failover,
        owner_loop,
        external,
        election,
        load_balancers,
        bgp,
        dns,
        discovery,
    ] {
        part(r, &mut tables);
    }
    tables
}

fn paths(r: &Results, tables: &mut Vec<Table>) {
    if !r.paths.is_empty() {
        let workloads: Vec<Workload> = r.paths.iter().map(|(w, _)| *w).collect();
        let headers: Vec<String> =
            workloads.iter().map(|w| format!("{} ({})", w.label(), w.unit())).collect();
        let mut columns = vec!["path"];
        columns.extend(headers.iter().map(String::as_str));
        let mut t = Table::new(
            "Throughput by path: × direct [interquartile range of the paired ratios] (absolute figure; wrk: p99 latency)",
            &columns,
        );
        for route in Route::ALL {
            let mut row = vec![route.label().to_owned()];
            for w in &workloads {
                let Some(f) = r.figure(*w, route) else {
                    row.push("-".to_owned());
                    continue;
                };
                let ratio = if route == Route::Direct {
                    "1".to_owned()
                } else {
                    format!("{:.2} [{:.2}–{:.2}]", f.ratio, f.spread.0, f.spread.1)
                };
                let p99 = f.p99_ms.map(|p99| format!(", p99 {p99:.2} ms")).unwrap_or_default();
                row.push(format!("{ratio} ({}{p99})", rate(*w, f.value)));
            }
            t.row(row);
        }
        tables.push(t);
    }
}

fn daemon_cpu(r: &Results, tables: &mut Vec<Table>) {
    if !r.daemon_cpu.is_empty() {
        let mut t = Table::new(
            "Daemon CPU (utime + stime of `lb run`, in clock ticks: 10 ms steps)",
            &["during", "connects", "CPU", "per 10,000 connects", "per connect"],
        );
        for (what, cpu, n) in &r.daemon_cpu {
            let per = |k: f64| if *n == 0 { f64::NAN } else { cpu.as_secs_f64() * k / *n as f64 };
            t.row(vec![
                what.clone(),
                count(*n as usize),
                ms(*cpu),
                format!("{:.1} ms", per(1e7)),
                format!("{:.1} µs", per(1e6)),
            ]);
        }
        tables.push(t);
    }
}

fn kernel_cost(r: &Results, tables: &mut Vec<Table>) {
    if !r.kernel_cost.is_empty() {
        let mut t = Table::new(
            &format!(
                "Kernel cost per connect (bpf_stats, one round of {} connects each)",
                count(CONNECTS as usize)
            ),
            &["program", "VIP: runs", "VIP: ns", "in cgroup, not a VIP: runs", "in cgroup: ns"],
        );
        // Programs that ran (getpeername runs only when a client asks).
        let mut programs: Vec<&str> = r
            .kernel_cost
            .iter()
            .filter(|c| c.runs_per_connect > 0.0)
            .map(|c| c.program.as_str())
            .collect();
        programs.sort_unstable();
        programs.dedup();
        let cell = |program: Option<&str>, route: Route| {
            let costs = r
                .kernel_cost
                .iter()
                .filter(|c| c.route == route && program.is_none_or(|p| c.program == p));
            let (runs, ns) = costs.fold((0.0, 0.0), |(runs, ns), c| {
                (runs + c.runs_per_connect, ns + c.ns_per_connect)
            });
            [format!("{runs:.2}"), format!("{ns:.0}")]
        };
        for program in programs.iter().map(|p| Some(*p)).chain([None]) {
            let mut row = vec![program.unwrap_or("all lb programs").to_owned()];
            row.extend(cell(program, Route::Vip));
            row.extend(cell(program, Route::Cgroup));
            t.row(row);
        }
        tables.push(t);
    }
}

fn keepalive_cost(r: &Results, tables: &mut Vec<Table>) {
    if let Some(KeepAliveCost { requests, runs, ns }) = r.keepalive_cost {
        let mut t = Table::new(
            "Kernel cost of keep-alive requests through the VIP (bpf_stats, one wrk run: its 16 connects and then requests on them)",
            &["requests", "lb program runs", "run time", "per request"],
        );
        t.row(vec![
            count(requests as usize),
            count(runs as usize),
            format!("{:.1} µs", ns as f64 / 1e3),
            format!(
                "{:.4} runs, {:.2} ns",
                runs as f64 / requests as f64,
                ns as f64 / requests as f64
            ),
        ]);
        tables.push(t);
    }
}

fn scale(r: &Results, tables: &mut Vec<Table>) {
    if let Some(s) = &r.scale {
        let mut t = Table::new("Scale (check = \"none\")", &["measure", "value"]);
        for st in &s.startups {
            t.row(vec![
                format!(
                    "{}: `lb run` to a status answer / to all listed with selections; RSS",
                    services(st.services)
                ),
                match (st.answered, st.ready, st.rss) {
                    (Some(answered), Some(ready), Some(rss)) => {
                        format!("{} / {}; {:.0} MB", ms(answered), ms(ready), rss as f64 / 1e6)
                    }
                    _ => "> 60 s (no answer)".to_owned(),
                },
            ]);
        }
        if let Some((one, many)) = s.connects {
            t.row(vec![
                "connect + close through one VIP, 1 service".to_owned(),
                format!("{:.1}k/s", one / 1000.0),
            ]);
            t.row(vec![
                "connect + close through one VIP, 1,000 services".to_owned(),
                format!("{:.1}k/s ({:.2} × 1 service)", many / 1000.0, many / one),
            ]);
        }
        if !s.reload_ms.is_empty() {
            t.row(vec![
                format!(
                    "reload changing 1 of 10,000 services, SIGHUP to kernel (median of {})",
                    s.reload_ms.len()
                ),
                format!(
                    "{} (max {})",
                    millis(median(&s.reload_ms)),
                    millis(percentile(&s.reload_ms, 100.0))
                ),
            ]);
        }
        tables.push(t);
    }
}

fn failover(r: &Results, tables: &mut Vec<Table>) {
    if let Some(f) = &r.failover {
        let mut t = Table::new(
            "Failover: server killed (listener closed) → first connect elsewhere",
            &["path", "kills", "p50", "p99", "max"],
        );
        for (what, samples) in [
            ("kernel (refused connect marks the server; checks every 60 s)", &f.kernel_ms),
            ("kernel: from the refused connect's return", &f.reaction_ms),
            ("daemon (TCP checks every 100 ms; until status' selection changes)", &f.daemon_ms),
        ] {
            t.row(vec![
                what.to_owned(),
                samples.len().to_string(),
                millis(median(samples)),
                millis(percentile(samples, 99.0)),
                millis(percentile(samples, 100.0)),
            ]);
        }
        tables.push(t);
    }
}

fn owner_loop(r: &Results, tables: &mut Vec<Table>) {
    if let Some(o) = &r.owner_loop {
        let mut t = Table::new(
            "Owner loop: a kernel report (a refused connect through a VIP) → the daemon's decision",
            &["load", "reports", "p50", "p99"],
        );
        let loaded = format!(
            "socket table full ({} of {} sockets); {} scrapes and {} status requests answered meanwhile",
            count(o.tracked as usize),
            count(owner::TABLE),
            count(o.scrapes),
            count(o.statuses)
        );
        for (what, (n, p50, p99)) in [("idle".to_owned(), o.idle), (loaded, o.loaded)] {
            t.row(vec![what, n.to_string(), millis(p50), millis(p99)]);
        }
        tables.push(t);
    }
}

fn election(r: &Results, tables: &mut Vec<Table>) {
    if let Some(e) = &r.election {
        let mut t = Table::new(
            &format!(
                "The announcing node dies ({} nodes; lease {:.0} ms, renew and retry {:.0}/{:.0} ms; {} deaths, {} not taken over within 10 s)",
                e.nodes, e.lease_duration_ms, e.renew_ms, e.retry_ms, e.rounds, e.failed_rounds
            ),
            &["from the death to", "p50", "p99"],
        );
        for (what, samples) in [
            ("a client's connect answered by another node", &e.takeover_connect_ms),
            ("the new holder's first ARP answer", &e.takeover_arp_ms),
        ] {
            t.row(vec![
                what.to_owned(),
                millis(median(samples)),
                millis(percentile(samples, 99.0)),
            ]);
        }
        t.row(vec![
            "Lease requests per second for the VIP, steady state (all nodes)".to_owned(),
            format!("{:.1}", e.api_requests_per_s),
            String::new(),
        ]);
        tables.push(t);
        if let Some(m) = &e.membership {
            membership(m, tables);
        }
    }
}

fn load_balancers(r: &Results, tables: &mut Vec<Table>) {
    let Some(l) = &r.load_balancers else { return };
    let mut t = Table::new(
        &format!(
            "LoadBalancer Services, {} nodes: {} Services created one after another",
            l.nodes, l.services
        ),
        &["from a Service's creation to", "p50", "p99"],
    );
    for (what, (p50, p99)) in [
        ("its address in its status", l.to_status_ms),
        ("a node claiming the address", l.to_claim_ms),
        ("the first connect from another machine answered", l.to_connect_ms),
    ] {
        t.row(vec![what.to_owned(), millis(p50), millis(p99)]);
    }
    tables.push(t);
    let mut t = Table::new(
        &format!(
            "What {} LoadBalancer Services cost the API server, {} nodes together, steady state",
            l.services, l.nodes
        ),
        &["what", "per second"],
    );
    for (what, value) in [
        ("Lease requests (membership renewals)", l.lease_requests_per_s),
        ("lists and watch requests", l.lists_and_watches_per_s),
        ("Service status writes", l.status_writes_per_s),
        ("watch events sent", l.watch_events_per_s),
    ] {
        t.row(vec![what.to_owned(), format!("{value:.1}")]);
    }
    t.row(vec!["watches open (not per second)".to_owned(), l.watches_open.to_string()]);
    tables.push(t);
}

fn bgp(r: &Results, tables: &mut Vec<Table>) {
    let Some(b) = &r.bgp else { return };
    let mut t = Table::new(
        &format!(
            "Connects through the VIP, {} client threads, {:.0} s per step (one machine: the nodes share its CPUs)",
            b.clients, b.measure_s
        ),
        &["announced by", "connects/s", "vs 1 node by ARP", "answered by"],
    );
    let baseline = b.steps.first().map_or(0.0, |s| s.connects_per_s);
    for step in &b.steps {
        let answered: Vec<String> = step.answered.iter().map(|(n, c)| format!("{n} {c}")).collect();
        t.row(vec![
            step.what.to_owned(),
            format!("{:.0}", step.connects_per_s),
            format!("{:.2} ×", step.connects_per_s / baseline.max(f64::MIN_POSITIVE)),
            answered.join(", "),
        ]);
    }
    tables.push(t);
    let mut t = Table::new(
        &format!(
            "A node dies (its link down), BFD 100 ms × 3: {} deaths, {} not withdrawn within 10 s",
            b.rounds, b.failed_rounds
        ),
        &["from the death to", "p50", "p99"],
    );
    t.row(vec![
        "the router withdrawing its route".to_owned(),
        millis(median(&b.withdrawn_ms)),
        millis(percentile(&b.withdrawn_ms, 99.0)),
    ]);
    tables.push(t);
}

fn membership(m: &Membership, tables: &mut Vec<Table>) {
    let mut t = Table::new(
        "What electing costs the API server, 3 nodes, steady state (a Lease per VIP: 1 s, renewed every 200 ms; membership: 1.2 s, every 700 ms)",
        &["way", "VIPs", "requests/s", "by verb", "watch events/s", "per node, events included"],
    );
    for (way, n, load) in &m.load {
        let verbs: Vec<String> = load.by_verb.iter().map(|(v, r)| format!("{v} {r:.1}")).collect();
        t.row(vec![
            (*way).to_owned(),
            n.to_string(),
            format!("{:.1}", load.requests_per_s),
            verbs.join(", "),
            format!("{:.1}", load.watch_events_per_s),
            format!("{:.1}", load.per_node()),
        ]);
    }
    tables.push(t);
    let mut t = Table::new(
        &format!(
            "By membership, {} VIPs on 3 nodes: until each VIP of the node holding the most is claimed by another",
            m.takeover_vips,
        ),
        &["the node", "times", "p50", "p99"],
    );
    for (what, samples) in [("SIGKILLed", &m.takeover_ms), ("detached (lb detach)", &m.graceful_ms)]
    {
        t.row(vec![
            what.to_owned(),
            samples.len().to_string(),
            millis(median(samples)),
            millis(percentile(samples, 99.0)),
        ]);
    }
    tables.push(t);
}

fn dns(r: &Results, tables: &mut Vec<Table>) {
    if let Some(d) = &r.dns {
        let mut t = Table::new(
            &format!(
                "DNS queries per second (dnsperf, {} clients, {} s runs, one dnsmasq server; median of {} rounds)",
                dns::CLIENTS,
                dns::SECONDS,
                d.rounds
            ),
            &["route", "queries/s", "vs direct", "lost"],
        );
        let direct = d.qps(DnsRoute::Direct);
        for (route, qps) in &d.qps {
            let ratio = match route {
                DnsRoute::Direct => "1.00".to_owned(),
                // The median of the paired ratios, as the paths part.
                DnsRoute::Vip => format!("{:.2}", d.vip_ratio),
                DnsRoute::Forwarder => format!("{:.2}", qps / direct),
            };
            let lost = d.lost.iter().find(|(r, _)| r == route).map_or(0, |(_, l)| *l);
            t.row(vec![route.label().to_owned(), format!("{qps:.0}"), ratio, lost.to_string()]);
        }
        tables.push(t);
        let mut t = Table::new(
            &format!(
                "lb's programs per DNS query through the VIP (bpf_stats, {} queries; rewrites during the rounds: {})",
                count(d.queries_for_programs as usize),
                d.rewritten
                    .iter()
                    .map(|(n, v)| format!("{n} {}", count(*v as usize)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            &["program", "runs per query", "ns per query"],
        );
        for (name, runs, ns) in &d.programs {
            t.row(vec![name.clone(), format!("{runs:.2}"), format!("{ns:.0}")]);
        }
        tables.push(t);
    }
}

fn discovery(r: &Results, tables: &mut Vec<Table>) {
    if let Some(d) = &r.discovery {
        let mut t = Table::new(
            "Discovery (fake API server on loopback, debounce 1 ms)",
            &["measure", "value"],
        );
        if !d.latency_ms.is_empty() {
            t.row(vec![
                format!(
                    "EndpointSlice change → kernel's selection, {} changes",
                    d.latency_ms.len()
                ),
                format!(
                    "p50 {}, p99 {}",
                    millis(median(&d.latency_ms)),
                    millis(percentile(&d.latency_ms, 99.0))
                ),
            ]);
        }
        if let Some(sync) = d.initial_sync {
            t.row(vec![
                format!(
                    "initial sync, {} services × {} endpoints",
                    count(discovery::SERVICES),
                    discovery::ENDPOINTS
                ),
                ms(sync),
            ]);
        }
        if let Some(ups) = d.updates_per_second {
            t.row(vec![
                format!("updates applied, {} services changed at once", count(discovery::SERVICES)),
                format!("{ups:.0}/s"),
            ]);
        }
        tables.push(t);
    }
}
