//! This CPU's budgets per second (`LIMITS`, 0: no limit), so that what a
//! flood costs stays bounded: the new flows `lb_xdp` opens
//! (`LIMIT_NEW_FLOWS`, `[daemon] new_flows_per_cpu`), and the packets of
//! the node's own it sends in answer to packets it did not ask for
//! (`LIMIT_ANSWERS`): a TCP reset to a segment of no flow, a "too big",
//! an advertisement to all nodes defending a VIP against a duplicate
//! address probe. Each answer is no larger than its question, but each is
//! work, and a probe's goes to every node on the link.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use lb_common::{LIMIT_ANSWERS, LIMIT_NEW_FLOWS, Reason};

use crate::maps::{LIMITS, PER_SECOND, count_xdp};

/// What a packet may spend.
#[derive(Clone, Copy)]
pub(crate) enum Budget {
    /// A new flow (refused past it: `xdp_new_flow_limited`).
    NewFlow,
    /// An answer of the node's own (dropped unanswered past it:
    /// `xdp_answer_limited`).
    Answer,
}

/// Whether this CPU may spend one more of `budget` this second, counted
/// if so; counted as refused if not. Flows already open are never
/// touched.
#[inline(never)]
pub(crate) fn spend(budget: Budget) -> bool {
    let (slot, refused) = match budget {
        Budget::NewFlow => (LIMIT_NEW_FLOWS, Reason::XdpNewFlowLimited),
        Budget::Answer => (LIMIT_ANSWERS, Reason::XdpAnswerLimited),
    };
    let limit = LIMITS.get(slot).copied().unwrap_or(0);
    if limit == 0 {
        return true;
    }
    let Some(spent) = PER_SECOND.get_ptr_mut(slot) else { return true };
    // SAFETY: this CPU's slot, used by this program run alone (see
    // `PACKET` in maps.rs).
    let spent = unsafe { &mut *spent };
    // SAFETY: plain helper call without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if now.wrapping_sub(spent.since_ns) >= 1_000_000_000 {
        spent.since_ns = now;
        spent.count = 0;
    }
    if spent.count >= limit {
        count_xdp(refused);
        return false;
    }
    spent.count += 1;
    true
}
