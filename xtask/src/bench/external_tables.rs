//! The external path's part of the bench's tables (`tables.rs` has the
//! others).

use super::{
    results::{Flood, FloodRate, Results},
    table::Table,
};

/// The external path's tables: program time, clients through the node,
/// the SYN flood.
pub(super) fn external(r: &Results, tables: &mut Vec<Table>) {
    if let Some(e) = &r.external {
        let mut t = Table::new(
            &format!(
                "lb_xdp's program time per packet beside a reference NAT forwarder's on the same frames \
                 (BPF_PROG_TEST_RUN; medians of samples of single runs, each less a pass-through \
                 program's run beside it, which takes {:.0} ns with the kernel's timing overhead; a packet \
                 not lb's: an average of repeats, against the pass-through program's {:.0} ns)",
                e.overhead_ns, e.pass_ns
            ),
            &["packet", "family", "lb_xdp ns", "yardstick ns", "ratio", "goal"],
        );
        for p in &e.program {
            for case in p.cases(e.pass_ns) {
                t.row(vec![
                    case.what.to_owned(),
                    p.family.to_owned(),
                    format!("{:.0}", case.lb_ns),
                    format!("{:.0}", case.yardstick_ns),
                    format!("{:.2}", case.ratio()),
                    format!("≤ {:.1}", case.at_most),
                ]);
            }
        }
        tables.push(t);
        let mut t = Table::new(
            "lb_xdp's average run time per packet on real traffic (the kernel's run-time statistics)",
            &["traffic", "ns"],
        );
        for (what, ns) in [
            (
                "live traffic, connects (kernel run-time stats, with their clock reads)",
                e.live_connects_ns,
            ),
            ("live traffic, requests (established packets and replies)", e.live_requests_ns),
        ] {
            t.row(vec![what.to_owned(), format!("{ns:.0}")]);
        }
        tables.push(t);
        let mut t = Table::new(
            "External clients through the node (client namespace → node → server namespace; \
             medians of alternated rounds, ratios to plain routing in the same round)",
            &["route", "connects/s", "vs plain", "requests/s", "vs plain"],
        );
        for r in &e.routes {
            t.row(vec![
                r.name.clone(),
                format!("{:.0}", r.connects_per_s),
                format!("{:.2}", r.connects_ratio),
                format!("{:.0}", r.requests_per_s),
                format!("{:.2}", r.requests_ratio),
            ]);
        }
        for (name, why) in &e.skipped {
            t.row(vec![
                name.clone(),
                format!("not run: {why}"),
                String::new(),
                String::new(),
                String::new(),
            ]);
        }
        tables.push(t);
        if let Some(flood) = &e.flood {
            flood_table(flood, tables);
        }
    }
}

fn flood_table(f: &Flood, tables: &mut Vec<Table>) {
    let mut t = Table::new(
        &format!(
            "Forged SYNs from the client's namespace at rising rates (each for 3 s, one after \
             another), a legitimate client connecting meanwhile, {} connections held through the \
             VIP; flow tables of {} entries each (UDP's a quarter), {:.1} MB of kernel memory \
             for the six",
            f.held,
            f.flow_table,
            f.flow_tables_bytes as f64 / 1e6
        ),
        &[
            "nat_ports",
            "forged SYNs/s asked",
            "sent",
            "legitimate connects",
            "held alive",
            "flows opened",
            "refused by the guard",
            "no NAT port",
        ],
    );
    for (nat_ports, rates) in &f.configs {
        for r in rates {
            t.row(flood_row(nat_ports, r, f.held));
        }
    }
    tables.push(t);
}

/// One rate of the SYN flood bench, as its table shows it.
fn flood_row(nat_ports: &str, r: &FloodRate, held: u64) -> Vec<String> {
    let asked = if r.asked_per_s == 0 {
        "as fast as it goes".to_owned()
    } else {
        r.asked_per_s.to_string()
    };
    let share = if r.connects == 0 { 0.0 } else { 100.0 * r.connected as f64 / r.connects as f64 };
    vec![
        nat_ports.to_owned(),
        asked,
        format!("{:.0}", r.sent_per_s),
        format!("{}/{} ({share:.1} %)", r.connected, r.connects),
        format!("{}/{held}", r.held_alive),
        r.new_flows.to_string(),
        r.guard_refused.to_string(),
        r.ports_exhausted.to_string(),
    ]
}
