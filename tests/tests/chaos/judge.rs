//! The chaos test's judge: every connect attempt of the client loop held
//! against the log of what the test did (kills, restarts, list changes),
//! and the daemon's own log of failures held against the outages.

use std::{
    collections::{BTreeMap, HashSet},
    net::SocketAddr,
};

use lb_tests::load::{Attempt, Outcome};

use super::{FAILOVER, Log, NAMES, S2, SPREAD, max_failed_per_kill};

/// What the record shows.
pub(super) struct Report {
    /// Per VIP: server name → successful connects.
    pub(super) landed: [BTreeMap<String, usize>; 2],
    /// Successful connects made entirely while the daemon was dead.
    pub(super) while_dead: usize,
    pub(super) violations: Vec<String>,
    pub(super) summary: String,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.summary)
    }
}

/// The servers (indexes) of VIP `vip`'s list (s2 counts for the failover
/// VIP: it is in its list half of the time).
fn list_of(vip: usize) -> &'static [usize] {
    if vip == 0 { &SPREAD } else { &FAILOVER }
}

/// Judges every attempt:
/// - a success landed on a server of its VIP's list (s2 not on the failover
///   VIP while it was certainly out of that list) that was alive: not an
///   attempt that began after the server's listener closed and ended
///   before it listened again;
/// - a failure is caused by a kill of a server of its VIP's list. A
///   refusal: a kill that began before it ended and was not yet restored
///   when it began, and the refused connect began no later than the end
///   of that kill's first refusal (from then on the kernel skips the
///   server: a later one means the kernel was sent to a server known to
///   be dead). A reset or an abort: it was connected before the listener
///   of such a kill closed (it reached the server before it died). Each is
///   counted against the latest such kill, and a kill fails at most
///   [`max_failed_per_kill`] connects. Anything else (a timeout, EPERM, a
///   failure no kill explains) is a violation.
pub(super) fn judge(attempts: &[Attempt], log: &Log) -> Report {
    let mut violations = Vec::new();
    let mut landed: [BTreeMap<String, usize>; 2] = [BTreeMap::new(), BTreeMap::new()];
    let mut while_dead = 0;
    // The kills that can explain a failed attempt.
    let candidates = |a: &Attempt| -> Vec<usize> {
        (0..log.kills.len())
            .filter(|&k| {
                let kill = &log.kills[k];
                list_of(a.vip).contains(&kill.server)
                    && kill.began <= a.end
                    && match a.outcome {
                        Outcome::Refused => kill.restored > a.start,
                        _ => a.start <= kill.closed,
                    }
            })
            .collect()
    };
    let mut assigned: Vec<Vec<&Attempt>> = vec![Vec::new(); log.kills.len()];
    let mut refused: Vec<(&Attempt, Vec<usize>)> = Vec::new();
    for a in attempts {
        match &a.outcome {
            Outcome::Server(name) => {
                let Some(i) = NAMES.iter().position(|n| n == name) else {
                    violations.push(format!(
                        "a connect through VIP {} reached {name:?}, not a server",
                        a.vip
                    ));
                    continue;
                };
                *landed[a.vip].entry(name.clone()).or_default() += 1;
                if log
                    .restarts
                    .iter()
                    .any(|(killed, restarted)| a.start >= *killed && a.end <= *restarted)
                {
                    while_dead += 1;
                }
                violations.extend(wrongly_landed(a, i, log));
            }
            Outcome::Other(what) => violations.push(format!(
                "a connect through VIP {} failed: {what} ({})",
                a.vip,
                context(log, a)
            )),
            Outcome::Refused | Outcome::Reset | Outcome::Aborted => {
                let candidates = candidates(a);
                let Some(&latest) = candidates.iter().max_by_key(|k| log.kills[**k].began) else {
                    violations.push(format!(
                        "a connect through VIP {} failed ({:?}) and no kill explains it ({})",
                        a.vip,
                        a.outcome,
                        context(log, a)
                    ));
                    continue;
                };
                assigned[latest].push(a);
                if a.outcome == Outcome::Refused {
                    refused.push((a, candidates));
                }
            }
        }
    }
    // When each kill's first refusal returned: the kernel skips the server from then on.
    let first_refusal_end: Vec<Option<u64>> = assigned
        .iter()
        .map(|failed| failed.iter().filter(|a| a.outcome == Outcome::Refused).map(|a| a.end).min())
        .collect();
    violations.extend(late_refusals(&refused, &first_refusal_end, log));
    let most = max_failed_per_kill();
    let mut summary = String::from(
        "kill  server  daemon  refused  reset/aborted  first refusal after the listener closed\n",
    );
    for (k, (kill, failed)) in log.kills.iter().zip(&assigned).enumerate() {
        let refusals = failed.iter().filter(|a| a.outcome == Outcome::Refused).count();
        if failed.len() > most {
            violations.push(format!(
                "kill {k} ({}) failed {} connects (at most {most})",
                NAMES[kill.server],
                failed.len()
            ));
        }
        summary += &format!(
            "{k:>4}  {:>6}  {:>6}  {refusals:>7}  {:>13}  {}\n",
            NAMES[kill.server],
            if kill.daemon_down { "dead" } else { "up" },
            failed.len() - refusals,
            first_refusal_end[k].map_or_else(
                || "-".to_owned(),
                |end| format!("{:.1} ms", ms_since(end, kill.closed))
            )
        );
    }
    let seen: HashSet<&str> = landed.iter().flat_map(|m| m.keys().map(String::as_str)).collect();
    summary += &format!(
        "landed: spread {:?}, failover {:?}; servers seen {}; {while_dead} while the daemon was dead\n",
        landed[0],
        landed[1],
        seen.len()
    );
    Report { landed, while_dead, violations, summary }
}

/// What is wrong with a successful connect `a` that landed on server `i`:
/// not in its VIP's list, s2 on the failover VIP while certainly out of
/// its list, or a server that was down (the attempt began after its
/// listener closed and ended before it listened again).
fn wrongly_landed(a: &Attempt, i: usize, log: &Log) -> Vec<String> {
    let name = NAMES[i];
    let mut violations = Vec::new();
    if !list_of(a.vip).contains(&i) {
        violations.push(format!(
            "a connect through VIP {} reached {name}, which is not in its list",
            a.vip
        ));
    }
    if a.vip == 1 && i == S2 && log.s2_out.iter().any(|(from, to)| a.start >= *from && a.end <= *to)
    {
        violations.push(format!(
            "a connect through the failover VIP reached s2 while s2 was out of its list ({})",
            context(log, a)
        ));
    }
    if let Some(k) =
        log.kills.iter().find(|k| k.server == i && a.start >= k.closed && a.end <= k.restored)
    {
        violations.push(format!(
            "a connect reached {name} while it was down: began {:.1} ms after its listener closed ({})",
            ms_since(a.start, k.closed),
            context(log, a)
        ));
    }
    violations
}

/// Milliseconds from `since` to `ns`.
fn ms_since(ns: u64, since: u64) -> f64 {
    (ns as f64 - since as f64) / 1e6
}

/// The refused connects (each with the kills that could explain it) that
/// began after every such kill's first refusal had returned: from then on
/// the kernel skips the server, so such a refusal means the kernel was
/// sent to a server known to be dead.
fn late_refusals(
    refused: &[(&Attempt, Vec<usize>)],
    first_refusal_end: &[Option<u64>],
    log: &Log,
) -> Vec<String> {
    let mut violations = Vec::new();
    for (a, candidates) in refused {
        if !candidates.iter().any(|k| first_refusal_end[*k].is_some_and(|first| a.start <= first)) {
            let down: Vec<String> = candidates
                .iter()
                .map(|k| {
                    let since = first_refusal_end[*k].map_or_else(
                        || "no refusal".to_owned(),
                        |first| format!("{:.1} ms", ms_since(a.start, first)),
                    );
                    format!("{} (its first refusal {since} earlier)", NAMES[log.kills[*k].server])
                })
                .collect();
            violations.push(format!(
                "a connect through VIP {} was refused although every server of its list that was down then had already refused one: {}; \
                 the kernel was sent to a server known to be dead ({})",
                a.vip,
                down.join(", "),
                context(log, a)
            ));
        }
    }
    violations
}

/// When `a` happened (seconds from the start of the chaos), and the last
/// events before it.
fn context(log: &Log, a: &Attempt) -> String {
    let t0 = log.events.first().map_or(0, |e| e.0);
    let at = |ns: u64| (ns as f64 - t0 as f64) / 1e9;
    let before: Vec<String> = log
        .events
        .iter()
        .filter(|e| e.0 <= a.end)
        .rev()
        .take(3)
        .map(|(ns, what)| format!("{what} at {:.3} s", at(*ns)))
        .collect();
    format!("{:.3} s to {:.3} s; before: {}", at(a.start), at(a.end), before.join(", "))
}

/// Servers the daemons failed more often than their outages explain. A
/// daemon fails a server (a `-> failed` line) when its checks fail or
/// confirm a kernel report; so a server that was never down must never be
/// failed, and one outage can fail it at most once per service that has it
/// and per daemon that lived during the outage (the one running when it
/// died, and each restarted one), and in the failover service once more
/// per reload that put it (s2) back into the list during the outage. A
/// healthy server failed by mistake would lose its VIP connections.
///
/// A restarted daemon that finds a server failed in the kernel's states
/// starts it failed too (`Balancer::adopt`, "had failed before this daemon
/// started"): no judgement of its own, but its predecessor's, counted
/// already. It is not counted again: a restart soon after a restore, before
/// the dying daemon's checks saw the server back, adopts an outage that has
/// ended (the CI host once restarted 0.3 s after a restore).
pub(super) fn unexplained_failures(
    daemon_log: &str,
    log: &Log,
    addrs: &[SocketAddr],
) -> Vec<String> {
    let mut unexplained = Vec::new();
    for (i, server) in addrs.iter().enumerate() {
        let field = format!("server={server} ");
        for (service, members) in [("spread", &SPREAD[..]), ("failover", &FAILOVER[..])] {
            if !members.contains(&i) {
                continue;
            }
            let failed = daemon_log
                .lines()
                .filter(|l| {
                    l.contains(" -> failed:")
                        && !l.contains("had failed before this daemon started")
                        && l.contains(&format!("service={service} "))
                        && (l.contains(&field) || l.ends_with(&field[..field.len() - 1]))
                })
                .count();
            let budget: usize = log
                .kills
                .iter()
                .filter(|k| k.server == i)
                .map(|k| {
                    let during = |t: u64| t >= k.began && t <= k.restored;
                    let restarts =
                        log.restarts.iter().filter(|(_, restarted)| during(*restarted)).count();
                    let readds = if service == "failover" && i == S2 {
                        log.s2_added.iter().filter(|t| during(**t)).count()
                    } else {
                        0
                    };
                    1 + restarts + readds
                })
                .sum();
            if failed > budget {
                unexplained.push(format!("{service}: {} ({server}) failed {failed} times; its outages explain at most {budget}", NAMES[i]));
            }
        }
    }
    unexplained
}
