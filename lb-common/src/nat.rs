//! When the external path may give a NAT port to a new flow while the
//! port's `NAT_REPLIES` entry still exists: flows are never removed one
//! by one (a close is not followed to its end), so without reuse every
//! port toward a server would be spent after its first 4,536 flows.
//!
//! The program keeps in each entry's flags (`NatReply::flags`) how the
//! flow ended, if it did (the bits below, beside
//! [`crate::NAT_REPLY_ESTABLISHED`] and [`crate::NAT_REPLY_SYN`]), and when a packet of
//! it last passed, in ticks of 2^20 ns (about 1 ms) in the flags' top 24
//! bits ([`stamp`]): a wrapping clock of 4.9 hours. A new flow whose
//! random port is taken may have it ([`reusable`]) once the old flow is:
//! - reset, or closed by the client first (both FINs seen, the client's
//!   first), for [`CLOSED_WAIT_TICKS`]: the server then keeps nothing of
//!   it (the client's side holds TIME_WAIT, on its own port);
//! - closed by the server first, for [`TIME_WAIT_TICKS`]: the server holds
//!   the flow's addresses and ports in TIME_WAIT for 60 s, and a new SYN
//!   on them may be refused meanwhile (as conntrack's NAT waits 120 s).
//!   When no port is free otherwise (`pressed`), after
//!   [`CLOSED_WAIT_TICKS`] too: Linux takes a new SYN in TIME_WAIT if its
//!   sequence number or timestamp is ahead, and otherwise answers with an
//!   ACK that the client resets, so its SYN sent again a second later is
//!   taken; refusing the flow would cost it that second every time;
//! - an established TCP flow (the client acknowledged the server's
//!   answer) idle for [`ESTABLISHED_IDLE_TICKS`] (2 h);
//! - a half-open TCP flow (a SYN never answered, or answered for a
//!   client that never acknowledged) [`HALF_OPEN_TICKS`] (10 s) after the
//!   client's SYN (or the server's first answer), and when no port is
//!   free otherwise: [`ANSWERED_PRESSED_TICKS`] (250 ms) after the
//!   server's first answer, which a client acknowledges one round trip
//!   later and a forged address never does, or
//!   [`HALF_OPEN_PRESSED_TICKS`] (1 s) after a SYN the server has not
//!   answered. So a flood from forged addresses holds a port a quarter of
//!   a second, not a minute, and refuses new flows only past about four
//!   SYNs a second per port. The server's SYN-ACKs sent again do not stamp
//!   it ([`stamp_reply`]): it lives from its first answer, whatever the
//!   server sends after. A server still holding the old half-open
//!   connection on those ports answers the new flow's SYN with an ACK that
//!   the client resets, and takes its SYN sent again a second later, as
//!   for TIME_WAIT below;
//! - any other flow idle for [`IDLE_TICKS`] (30 s, conntrack's UDP
//!   timeout): UDP.
//!
//! The program stamps an entry on the server's packets (each reply, but
//! not those of a half-open flow) and on the client's FINs and resets and
//! the packet that completes its handshake; a flow whose server sends
//! nothing for those times is counted idle.

use crate::flow_tables::NAT_REPLY_ESTABLISHED;

/// `NatReply::flags`: the client sent a FIN.
pub const NAT_REPLY_CLIENT_FIN: u32 = 1 << 2;
/// `NatReply::flags`: the server sent a FIN.
pub const NAT_REPLY_SERVER_FIN: u32 = 1 << 3;
/// `NatReply::flags`: the server's FIN came before the client's: the
/// server holds the flow in TIME_WAIT.
pub const NAT_REPLY_SERVER_CLOSED_FIRST: u32 = 1 << 4;
/// `NatReply::flags`: a reset was seen, either way.
pub const NAT_REPLY_RESET: u32 = 1 << 5;
/// `NatReply::flags`: the client sent a packet after its SYN (the ACK
/// that completes the handshake): the TCP flow is established.
pub const NAT_REPLY_CLIENT_ACKED: u32 = 1 << 6;
/// The bits that say how a flow ended; a new connection on the same
/// addresses and ports (the server's SYN-ACK) clears them.
pub const NAT_REPLY_ENDED: u32 =
    NAT_REPLY_CLIENT_FIN | NAT_REPLY_SERVER_FIN | NAT_REPLY_SERVER_CLOSED_FIRST | NAT_REPLY_RESET;

/// Where the last-seen tick starts in `NatReply::flags`.
const SEEN_SHIFT: u32 = 8;
/// The tick: 2^20 ns.
const TICK_SHIFT: u32 = 20;
/// The 24 bits of the last-seen tick.
const TICK_MASK: u32 = (1 << 24) - 1;

/// Ticks in `seconds` (rounded up).
const fn ticks(seconds: u64) -> u32 {
    ((seconds * 1_000_000_000).div_ceil(1 << TICK_SHIFT)) as u32
}

/// How long after its last packet a reset flow, or one the client closed
/// first, keeps its port: time for the client's last ACK to reach the
/// server on any LAN. A port taken sooner than a slow client's last ACK
/// (the server still in LAST_ACK) costs the new flow one retransmitted
/// SYN; it is taken only when the random port tried is that one.
pub const CLOSED_WAIT_TICKS: u32 = 64;
/// How long after its last packet a flow the server closed first keeps
/// its port: the server's TIME_WAIT (60 s) and a margin.
pub const TIME_WAIT_TICKS: u32 = ticks(64);
/// How long an established TCP flow may be idle before its port may go.
pub const ESTABLISHED_IDLE_TICKS: u32 = ticks(7_200);
/// How long after the client's SYN a half-open TCP flow keeps its port.
pub const HALF_OPEN_TICKS: u32 = ticks(10);
/// As [`HALF_OPEN_TICKS`], when no port is free otherwise and the server
/// has not answered: a server answers a SYN it can take sooner.
pub const HALF_OPEN_PRESSED_TICKS: u32 = ticks(1);
/// As [`HALF_OPEN_TICKS`], when no port is free otherwise and the server
/// has answered: its answer's age. A client acknowledges it one round
/// trip (client to node and back) later; one farther than 250 ms away
/// loses its flow only while a flood keeps every port taken, when
/// without this no new flow would open at all.
pub const ANSWERED_PRESSED_TICKS: u32 = (250_000_000u64.div_ceil(1 << TICK_SHIFT)) as u32;
/// How long any other flow may be idle before its port may go.
pub const IDLE_TICKS: u32 = ticks(30);

/// How far, either way, a server's sequence number may be from the one
/// an established flow's entry last noted (`NatReply::syn_seq`: the
/// server's SYN-ACK's, then moved along) for its reset, FIN or SYN to
/// count: a megabyte. The node sees every segment the server sends on
/// the flow, each a few kilobytes ahead of the last at most, and sent
/// again ones behind; a sender of forged segments who never saw the flow
/// guesses within it once in 2,048 tries, per port.
pub const SERVER_WINDOW: u32 = 1 << 20;

/// Whether a server's segment with sequence number `seq` is within
/// [`SERVER_WINDOW`] of `noted`, and what to note now: `seq` once it is
/// half a window ahead (so the entry is written once per half a
/// megabyte of the server's data, not per packet), else `noted`.
#[inline(always)]
pub const fn server_window(noted: u32, seq: u32) -> (bool, u32) {
    let ahead = seq.wrapping_sub(noted);
    let behind = noted.wrapping_sub(seq);
    if ahead < SERVER_WINDOW {
        (true, if ahead >= SERVER_WINDOW / 2 { seq } else { noted })
    } else {
        (behind < SERVER_WINDOW, noted)
    }
}

/// The tick of `now_ns` (`bpf_ktime_get_ns()`).
#[inline(always)]
pub const fn tick(now_ns: u64) -> u32 {
    (now_ns >> TICK_SHIFT) as u32 & TICK_MASK
}

/// `flags` with its last-seen tick set to `tick`.
#[inline(always)]
pub const fn stamp(flags: u32, tick: u32) -> u32 {
    (flags & ((1 << SEEN_SHIFT) - 1)) | (tick << SEEN_SHIFT)
}

/// The flags of an entry that had `before` after a server's packet made
/// them `after`, at `tick`: stamped, unless the flow is a half-open TCP
/// one (the client never acknowledged) that the server had answered
/// before: a server sending its SYN-ACK again, to a forged address, must
/// not keep the port. Its first answer is stamped: a client acknowledges
/// within a round trip of it ([`ANSWERED_PRESSED_TICKS`]).
#[inline(always)]
pub const fn stamp_reply(before: u32, after: u32, tcp: bool, tick: u32) -> u32 {
    let first_answer = before & NAT_REPLY_ESTABLISHED == 0 && after & NAT_REPLY_ESTABLISHED != 0;
    if tcp && after & NAT_REPLY_CLIENT_ACKED == 0 && !first_answer {
        return stamp(after, before >> SEEN_SHIFT);
    }
    stamp(after, tick)
}

/// `flags` after a TCP packet of the flow with `fin`, `rst` or `syn`
/// set, from the server (`from_server`) or the client.
#[inline(always)]
pub const fn after_tcp(flags: u32, from_server: bool, syn: bool, fin: bool, rst: bool) -> u32 {
    let mut flags = flags;
    if syn && from_server {
        // The server answers a new connection on these ports.
        flags &= !(NAT_REPLY_ENDED | NAT_REPLY_CLIENT_ACKED);
    }
    if !syn && !from_server {
        flags |= NAT_REPLY_CLIENT_ACKED;
    }
    if rst {
        flags |= NAT_REPLY_RESET;
    }
    if fin && from_server {
        if flags & NAT_REPLY_CLIENT_FIN == 0 {
            flags |= NAT_REPLY_SERVER_CLOSED_FIRST;
        }
        flags |= NAT_REPLY_SERVER_FIN;
    }
    if fin && !from_server {
        flags |= NAT_REPLY_CLIENT_FIN;
    }
    flags
}

/// Whether the port of an entry with `flags` (of a TCP flow if `tcp`)
/// may go to a new flow at `now` (a [`tick`]); `pressed`: no port is free
/// otherwise.
#[inline(always)]
pub const fn reusable(flags: u32, tcp: bool, now: u32, pressed: bool) -> bool {
    let age = now.wrapping_sub(flags >> SEEN_SHIFT) & TICK_MASK;
    let both_fins = NAT_REPLY_CLIENT_FIN | NAT_REPLY_SERVER_FIN;
    let wait = if flags & NAT_REPLY_RESET != 0 {
        CLOSED_WAIT_TICKS
    } else if flags & both_fins == both_fins {
        if flags & NAT_REPLY_SERVER_CLOSED_FIRST != 0 && !pressed {
            TIME_WAIT_TICKS
        } else {
            CLOSED_WAIT_TICKS
        }
    } else if tcp && flags & NAT_REPLY_CLIENT_ACKED != 0 {
        ESTABLISHED_IDLE_TICKS
    } else if tcp && pressed && flags & NAT_REPLY_ESTABLISHED != 0 {
        ANSWERED_PRESSED_TICKS
    } else if tcp && pressed {
        HALF_OPEN_PRESSED_TICKS
    } else if tcp {
        HALF_OPEN_TICKS
    } else {
        IDLE_TICKS
    };
    age >= wait
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::flow_tables::NAT_REPLY_SYN;

    const SECOND: u64 = 1_000_000_000;

    /// An established TCP flow's flags, last seen at `at_ns`: answered by
    /// the server, acknowledged by the client.
    fn established(at_ns: u64) -> u32 {
        let answered = after_tcp(NAT_REPLY_SYN | NAT_REPLY_ESTABLISHED, true, true, false, false);
        stamp(after_tcp(answered, false, false, false, false), tick(at_ns))
    }

    #[test]
    fn a_flow_closed_by_the_client_first_frees_its_port_within_100_ms() {
        let flags = after_tcp(established(0), false, false, true, false);
        let flags = after_tcp(flags, true, false, true, false);
        assert!(!reusable(flags, true, tick(SECOND / 20), false));
        assert!(reusable(flags, true, tick(SECOND / 10), false));
    }

    #[test]
    fn a_flow_closed_by_the_server_first_keeps_its_port_past_time_wait_unless_pressed() {
        let flags = after_tcp(established(0), true, false, true, false);
        let flags = after_tcp(flags, false, false, true, false);
        assert!(!reusable(flags, true, tick(60 * SECOND), false));
        assert!(reusable(flags, true, tick(65 * SECOND), false));
        // With no other port free, it goes as a client-closed one does.
        assert!(!reusable(flags, true, tick(SECOND / 20), true));
        assert!(reusable(flags, true, tick(SECOND / 10), true));
    }

    #[test]
    fn a_reset_flow_frees_its_port_within_100_ms_either_way() {
        for from_server in [false, true] {
            let flags = after_tcp(established(0), from_server, false, false, true);
            assert!(reusable(flags, true, tick(SECOND / 10), false));
        }
    }

    #[test]
    fn a_half_closed_or_idle_flow_keeps_its_port() {
        let half = after_tcp(established(0), false, false, true, false);
        assert!(!reusable(half, true, tick(3_600 * SECOND), true));
        assert!(reusable(half, true, tick(7_201 * SECOND), false));
        assert!(!reusable(established(0), true, tick(3_600 * SECOND), true));
    }

    #[test]
    fn udp_flows_go_after_30_seconds() {
        let udp = stamp(NAT_REPLY_ESTABLISHED, tick(0));
        assert!(!reusable(udp, false, tick(29 * SECOND), false));
        assert!(!reusable(udp, false, tick(29 * SECOND), true));
        assert!(reusable(udp, false, tick(31 * SECOND), false));
    }

    #[test]
    fn half_open_flows_go_after_10_seconds_or_sooner_when_pressed() {
        let unanswered = stamp(NAT_REPLY_SYN, tick(0));
        // Answered at 0, but the client never acknowledged (a forged
        // address).
        let answered = after_tcp(NAT_REPLY_SYN | NAT_REPLY_ESTABLISHED, true, true, false, false);
        let half_open = stamp(answered, tick(0));
        for flags in [unanswered, half_open] {
            assert!(!reusable(flags, true, tick(9 * SECOND), false));
            assert!(reusable(flags, true, tick(11 * SECOND), false));
        }
        // Pressed: a second after an unanswered SYN, a quarter of a second
        // after the server's answer.
        assert!(!reusable(unanswered, true, tick(SECOND / 2), true));
        assert!(reusable(unanswered, true, tick(SECOND + SECOND / 10), true));
        assert!(!reusable(half_open, true, tick(SECOND / 5), true));
        assert!(reusable(half_open, true, tick(SECOND * 3 / 10), true));
    }

    #[test]
    fn a_servers_sequence_counts_within_a_window_that_follows_its_data() {
        let isn = u32::MAX - 1_000;
        assert_eq!(server_window(isn, isn.wrapping_add(1)), (true, isn));
        assert_eq!(server_window(isn, isn.wrapping_sub(SERVER_WINDOW - 1)), (true, isn));
        assert!(!server_window(isn, isn.wrapping_add(SERVER_WINDOW)).0);
        assert!(!server_window(isn, isn.wrapping_sub(SERVER_WINDOW)).0);
        assert!(!server_window(isn, isn.wrapping_add(1 << 31)).0);
        // Half a window ahead, the noted number moves (wrapping past 0).
        let moved = isn.wrapping_add(SERVER_WINDOW / 2);
        assert_eq!(server_window(isn, moved), (true, moved));
        // A flow's data, segment after segment, stays within it for ever.
        let mut noted = isn;
        for segment in 1..10_000u32 {
            let (inside, next) = server_window(noted, isn.wrapping_add(segment * 1_448));
            assert!(inside, "segment {segment}");
            noted = next;
        }
        assert!(server_window(noted, isn.wrapping_add(9_999 * 1_448 + 1)).0);
    }

    #[test]
    fn a_half_open_flow_is_stamped_at_its_servers_first_answer_only() {
        let syn = stamp(NAT_REPLY_SYN, tick(0));
        let answered = after_tcp(syn | NAT_REPLY_ESTABLISHED, true, true, false, false);
        let first = stamp_reply(syn, answered, true, tick(SECOND / 2));
        // A quarter of a second after the answer, not after the SYN.
        assert!(!reusable(first, true, tick(SECOND * 6 / 10), true));
        assert!(reusable(first, true, tick(SECOND * 8 / 10), true));
        // Sent again later, the answer stamps nothing.
        let again = stamp_reply(first, first, true, tick(SECOND * 7 / 10));
        assert_eq!(again, first);
    }

    #[test]
    fn a_servers_syn_ack_sent_again_keeps_no_half_open_port() {
        let first = stamp(NAT_REPLY_SYN, tick(0));
        let mut flags = first;
        // The server re-sends its SYN-ACK to a client that never answers,
        // at 1, 3, 7, 15 and 31 s.
        for at in [1, 3, 7, 15, 31] {
            let after = after_tcp(flags | NAT_REPLY_ESTABLISHED, true, true, false, false);
            flags = stamp_reply(flags, after, true, tick(at * SECOND));
        }
        assert!(reusable(flags, true, tick(11 * SECOND), false));
        // Once the client acknowledges, the server's packets keep it.
        let acked = after_tcp(flags, false, false, false, false);
        let flags = stamp_reply(acked, acked, true, tick(40 * SECOND));
        assert!(!reusable(flags, true, tick(3_600 * SECOND), true));
        // UDP replies always stamp.
        let udp = stamp_reply(stamp(0, tick(0)), NAT_REPLY_ESTABLISHED, false, tick(20 * SECOND));
        assert!(!reusable(udp, false, tick(40 * SECOND), false));
    }

    #[test]
    fn a_new_connection_on_the_same_ports_forgets_the_last_ones_end() {
        let closed = after_tcp(
            after_tcp(established(0), true, false, true, false),
            false,
            false,
            true,
            false,
        );
        let again = after_tcp(closed, true, true, false, false);
        assert_eq!(again & NAT_REPLY_ENDED, 0);
        // Not reusable as a closed flow's port (67 ms): a half-open one's.
        assert!(!reusable(stamp(again, tick(SECOND)), true, tick(SECOND + SECOND / 5), true));
    }

    proptest! {
        #[test]
        fn stamping_keeps_the_flags_and_the_clock_wraps(
            flags in 0u32..256,
            at in 0..u64::MAX / 2,
            later in 0u64..(4 * 3_600 * SECOND),
        ) {
            let stamped = stamp(flags, tick(at));
            prop_assert_eq!(stamped & 0xff, flags);
            // Across the clock's wrap too, the age is the time elapsed.
            let now = tick(at.wrapping_add(later));
            let age = now.wrapping_sub(stamped >> SEEN_SHIFT) & TICK_MASK;
            let expected = (later >> TICK_SHIFT) as u32;
            prop_assert!(age == expected || age == expected + 1, "age {} for {} ticks", age, expected);
        }
    }
}
