//! The targets the bench checks (speed, and the owner loop's latency):
//! PASS/MISS lines; a miss is reported, never an error.

use super::{
    format::{count, millis, ms},
    paths::Route,
    results::{DnsRoute, Results, Workload},
    stats::{median, percentile},
};

/// The targets that this run measured: (PASS, line).
pub fn targets(r: &Results) -> Vec<(bool, String)> {
    let mut lines = Vec::new();
    let mut ratio = |what: &str, workload: Workload, route: Route, at_least: f64| {
        if let Some(f) = r.figure(workload, route) {
            lines.push((
                f.ratio >= at_least,
                format!(
                    "{what} ≥ {at_least:.2} × direct: {:.2} (interquartile {:.2}–{:.2})",
                    f.ratio, f.spread.0, f.spread.1
                ),
            ));
        }
    };
    ratio(
        "new connection per request (wrk) through the VIP",
        Workload::NewConnection,
        Route::Vip,
        0.95,
    );
    ratio("connect + close through the VIP", Workload::Connect, Route::Vip, 0.95);
    ratio(
        "new connection per request (wrk) from inside the cgroup, not a VIP",
        Workload::NewConnection,
        Route::Cgroup,
        0.98,
    );
    ratio(
        "connect + close from inside the cgroup, not a VIP",
        Workload::Connect,
        Route::Cgroup,
        0.98,
    );
    ratio("keep-alive requests (wrk) through the VIP", Workload::KeepAlive, Route::Vip, 0.98);
    ratio("bulk transfer through the VIP", Workload::Bulk, Route::Vip, 0.98);
    if let Some((_, cpu, n)) = r
        .daemon_cpu
        .iter()
        .find(|(what, _, n)| what.starts_with("connect + close through the VIP") && *n > 0)
    {
        let per_10k = cpu.as_secs_f64() * 1e7 / *n as f64;
        lines.push((per_10k < 10.0, format!("daemon CPU per 10,000 VIP connects close to zero (read here as < 10 ms, 1 µs per connect): {per_10k:.1} ms")));
    }
    if let Some(s) = &r.scale {
        for (n, limit) in [(10_000, 1.0), (16_384, 2.0)] {
            if let Some(st) = s.startups.iter().find(|st| st.services == n) {
                let took = st.ready.map_or_else(|| "> 60 s".to_owned(), ms);
                lines.push((
                    st.ready.is_some_and(|r| r.as_secs_f64() < limit),
                    format!(
                        "{} services ready (all listed with selections) < {limit:.0} s: {took}",
                        count(n)
                    ),
                ));
            }
        }
        if let Some(rss) = s.startups.iter().find(|st| st.services == 10_000).and_then(|st| st.rss)
        {
            lines.push((
                rss < 40_000_000,
                format!("RSS at 10,000 services < 40 MB: {:.0} MB", rss as f64 / 1e6),
            ));
        }
        if !s.reload_ms.is_empty() {
            let m = median(&s.reload_ms);
            lines.push((
                m < 100.0,
                format!("a reload changing one service of 10,000 applies < 100 ms: {}", millis(m)),
            ));
        }
    }
    if let Some(f) = &r.failover {
        let p99 = percentile(&f.reaction_ms, 99.0);
        lines.push((
            p99 < 10.0 && f.failed_max <= 2,
            format!(
                "a refused connect moves the next connect within milliseconds (read here as: p99 < 10 ms from the refusal to a connect answered elsewhere, and at most 2 failed connects per kill, the refused one and one reset in the closing listener's queue): {p99:.2} ms, at most {} failed",
                f.failed_max
            ),
        ));
    }
    if let Some(e) = &r.external {
        for p in &e.program {
            for case in p.cases(e.pass_ns) {
                let ratio = case.ratio();
                lines.push((
                    ratio <= case.at_most,
                    format!(
                        "lb_xdp, {} ({}) ≤ {:.1} × the yardstick: {ratio:.2} ({:.0} vs {:.0} ns)",
                        case.what, p.family, case.at_most, case.lb_ns, case.yardstick_ns
                    ),
                ));
            }
        }
        if let Some(lb) = e.route("lb") {
            for (what, ratio) in [("connects", lb.connects_ratio), ("requests", lb.requests_ratio)]
            {
                lines.push((
                    ratio >= 0.95,
                    format!(
                        "external {what} per second through lb ≥ 0.95 × plain routing: {ratio:.2}"
                    ),
                ));
            }
            for other in ["ipvs", "haproxy"] {
                if let Some(o) = e.route(other) {
                    lines.push((
                        lb.connects_per_s > o.connects_per_s && lb.requests_per_s > o.requests_per_s,
                        format!(
                            "external lb ahead of {other}: connects/s {:.0} vs {:.0}, requests/s {:.0} vs {:.0}",
                            lb.connects_per_s, o.connects_per_s, lb.requests_per_s, o.requests_per_s
                        ),
                    ));
                }
            }
        }
    }
    if let Some(e) = &r.election {
        let p99 = percentile(&e.takeover_connect_ms, 99.0);
        lines.push((
            e.failed_rounds == 0 && p99 <= 2_000.0,
            format!(
                "clients move within 2 s of the announcing node's death (elections): p99 {}, p50 {}, {} of {} deaths not taken over",
                millis(p99),
                millis(median(&e.takeover_connect_ms)),
                e.failed_rounds,
                e.rounds
            ),
        ));
    }
    if let Some(m) = r.election.as_ref().and_then(|e| e.membership.as_ref()) {
        let handovers = [
            ("a SIGKILLed node", "1.5 s", 1_500.0, &m.takeover_ms, m.takeover_rounds),
            ("a detached node (lb detach)", "0.3 s", 300.0, &m.graceful_ms, m.graceful_rounds),
        ];
        for (whose, goal, goal_ms, samples, rounds) in handovers {
            let p99 = percentile(samples, 99.0);
            lines.push((
                samples.len() == rounds && p99 <= goal_ms,
                format!(
                    "by membership, every VIP of {whose} taken over within {goal} ({} VIPs): p99 {}, p50 {}, {} of {rounds} measured",
                    m.takeover_vips,
                    millis(p99),
                    millis(median(samples)),
                    samples.len(),
                ),
            ));
        }
        if let Some((_, n, most)) =
            m.load.iter().filter(|(w, ..)| *w == "membership").max_by_key(|(_, n, _)| *n)
        {
            lines.push((
                most.per_node() <= 6.0,
                format!(
                    "by membership, ≤ 6 API requests per second per node, watch events included, at {n} VIPs: {:.1}",
                    most.per_node()
                ),
            ));
        }
    }
    if let Some(d) = &r.dns {
        let (vip, forwarder) = (d.qps(DnsRoute::Vip), d.qps(DnsRoute::Forwarder));
        lines.push((
            d.vip_ratio >= 0.95 && vip > forwarder,
            format!(
                "DNS queries per second through the VIP ≥ 0.95 × direct, ahead of a dnsmasq forwarder: {:.2} × direct; {vip:.0} vs {forwarder:.0} queries/s",
                d.vip_ratio
            ),
        ));
    }
    if let Some(o) = &r.owner_loop {
        let (_, _, p99) = o.loaded;
        lines.push((
            p99 < 10.0,
            format!(
                "a kernel report waits < 10 ms (p99) for the daemon's decision with a full socket table and a flood of scrapes (owner loop): {}",
                millis(p99)
            ),
        ));
    }
    lines
}
