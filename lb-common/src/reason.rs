//! Why a program did what it did: [`Reason`], the index of a per-CPU
//! counter in `COUNTERS`, with its stable name for metrics and `lb status`.

/// Declares [`Reason`] from one table (variant, counter index, stable name),
/// so that `ALL`, `COUNT` and `name` cannot disagree with the enum.
macro_rules! reasons {
    ($($(#[doc = $doc:literal])* $variant:ident = $index:literal => $name:literal,)*) => {
        /// Why a program did what it did: the index of a per-CPU counter in
        /// the `COUNTERS` array (the kernel counts `Reason::X as u32`). Every
        /// early return of every program is counted.
        ///
        /// The values are the counters' indexes and [`Reason::name`] their
        /// stable names in metrics and `lb status`: append new reasons, never
        /// renumber or rename.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Reason {
            $($(#[doc = $doc])* $variant = $index,)*
        }

        impl Reason {
            /// Number of reasons: the `COUNTERS` array's size.
            pub const COUNT: usize = [$($index),*].len();

            /// Every reason, in counter-index order (`Reason::ALL[i] as usize == i`).
            pub const ALL: [Reason; Self::COUNT] = [$(Self::$variant),*];

            /// The stable name in metrics (`reason` label) and `lb status`.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)*
                }
            }
        }
    };
}

reasons! {
    /// connect: destination was a VIP and was rewritten.
    ConnectRewritten = 0 => "connect_rewritten",
    /// connect: destination is not a VIP; untouched.
    ConnectNotVip = 1 => "connect_not_vip",
    /// connect: the VIP's service has no server; connect refused (EPERM).
    ConnectNoServer = 2 => "connect_no_server",
    /// connect: every server failed recently; the first was used anyway.
    ConnectAllFailed = 3 => "connect_all_failed",
    /// connect: a recently failed server was skipped.
    ConnectSkippedFailed = 4 => "connect_skipped_failed",
    /// connect: protocol is neither TCP nor UDP; untouched.
    ConnectOtherProtocol = 5 => "connect_other_protocol",
    /// connect4: the selected server is IPv6, unreachable from an IPv4
    /// socket; untouched and not tracked (the daemon's config check
    /// prevents this).
    ConnectFamilyMismatch = 6 => "connect_family_mismatch",
    /// connect: the TCP socket table was full; rewritten but not tracked.
    ConnectUntracked = 7 => "connect_untracked",
    /// getpeername: the VIP was reported instead of the server.
    GetpeernameRewritten = 8 => "getpeername_rewritten",
    /// getpeername: not a socket connected through a VIP; untouched.
    GetpeernameUntouched = 9 => "getpeername_untouched",
    /// sock_ops: a tracked connect established.
    SockopsEstablished = 10 => "sockops_established",
    /// sock_ops: a tracked connect failed before establishing.
    SockopsConnectFailed = 11 => "sockops_connect_failed",
    /// sock_ops: a tracked connect's SYN timed out once.
    SockopsConnectTimeout = 12 => "sockops_connect_timeout",
    /// sock_ops: a tracked, established connection closed.
    SockopsClosed = 13 => "sockops_closed",
    /// sock_ops: a socket looked up in the socket table and not found
    /// (a connect where connect4 cannot mark the sockets it tracks, or a
    /// callback of an untracked socket); ignored.
    SockopsUntracked = 14 => "sockops_untracked",
    /// sock_ops: the event ring buffer was full; the event was dropped
    /// (counts and failure marks are still updated).
    EventDropped = 15 => "event_dropped",
    /// Any program: a map update (or a lookup that cannot miss) failed.
    MapError = 16 => "map_error",
    /// connect: the socket is in another network namespace than the
    /// daemon's, and the service's scope is `host`; untouched.
    ConnectOtherNetns = 17 => "connect_other_netns",
    /// connect: the connected-UDP socket table was full; rewritten but
    /// not tracked (getpeername shows the server).
    ConnectUntrackedUdp = 18 => "connect_untracked_udp",
    /// sock_release: a TCP connect through a VIP was released by its
    /// application before it established (a cancelled connect): marked so
    /// that its close is no server failure (or untracked, if TCP is done
    /// with it).
    ReleaseCancelled = 19 => "release_cancelled",
    /// sock_release: a connected-UDP socket through a VIP was released;
    /// untracked.
    ReleaseUdp = 20 => "release_udp",
    /// sock_release: nothing to untrack (not a VIP socket, or an
    /// established TCP connection, untracked by sock_ops when it closes).
    ReleaseUntouched = 21 => "release_untouched",
    /// sock_ops: `FAILED_AT` was full; a failed server was not marked, so
    /// the kernel does not skip it.
    FailedAtFull = 22 => "failed_at_full",
    /// sock_ops: `CONNECTIONS` was full; an established connection was not
    /// counted.
    ConnectionsFull = 23 => "connections_full",
    /// sock_ops: a connect its application gave up on (released before it
    /// established) closed: untracked, with no failure mark and no event.
    SockopsCancelled = 24 => "sockops_cancelled",
    /// sendmsg: an unconnected UDP send to a VIP went to a newly chosen
    /// server (the socket's first send to the VIP, or its server is no
    /// longer usable or preferred), recorded for its answers.
    SendmsgRewritten = 25 => "sendmsg_rewritten",
    /// sendmsg: a send to a VIP went to the server the socket's earlier
    /// sends to it went to.
    SendmsgKept = 26 => "sendmsg_kept",
    /// sendmsg: destination is not a VIP; untouched.
    SendmsgNotVip = 27 => "sendmsg_not_vip",
    /// sendmsg: not UDP (UDP-Lite); untouched.
    SendmsgOtherProtocol = 28 => "sendmsg_other_protocol",
    /// sendmsg: the socket is in another network namespace than the
    /// daemon's, and the service's scope is `host`; untouched.
    SendmsgOtherNetns = 29 => "sendmsg_other_netns",
    /// sendmsg: the VIP's service has no server; the send is refused
    /// (EPERM).
    SendmsgNoServer = 30 => "sendmsg_no_server",
    /// sendmsg: a recently failed server was skipped.
    SendmsgSkippedFailed = 31 => "sendmsg_skipped_failed",
    /// sendmsg: every server failed recently; the first was used anyway.
    SendmsgAllFailed = 32 => "sendmsg_all_failed",
    /// sendmsg: the chosen server's family cannot be sent to from this
    /// socket (an IPv6 server from an IPv4 socket; an IPv4 server for an
    /// IPv6 VIP, which the kernel refuses to rewrite a send to); untouched.
    SendmsgFamilyMismatch = 33 => "sendmsg_family_mismatch",
    /// connect or sendmsg: `UDP_PEERS` was full; the UDP socket's traffic
    /// is rewritten, but what comes back shows the server's address.
    UdpPeersFull = 34 => "udp_peers_full",
    /// recvmsg: a datagram from a server the socket sent to through a VIP
    /// is shown as from the VIP.
    RecvmsgRewritten = 35 => "recvmsg_rewritten",
    /// recvmsg: not from a server the socket sent to through a VIP;
    /// untouched.
    RecvmsgUntouched = 36 => "recvmsg_untouched",
    /// xdp: the first packet of a flow to an external VIP went to a newly
    /// chosen server (NAT port allocated).
    XdpNewFlow = 37 => "xdp_new_flow",
    /// xdp: a packet of a known flow went to its server.
    XdpForwarded = 38 => "xdp_forwarded",
    /// xdp: a server's reply to a forwarded flow was translated back to
    /// its client.
    XdpReplied = 39 => "xdp_replied",
    /// xdp: not IPv4 or IPv6 (ARP, VLAN-tagged...); passed untouched.
    XdpNotIp = 40 => "xdp_not_ip",
    /// xdp: an IP packet too short for its headers; passed untouched.
    XdpTruncated = 41 => "xdp_truncated",
    /// xdp: IPv4 options or IPv6 extension headers, or a fragment; passed
    /// untouched.
    XdpUnparsed = 42 => "xdp_unparsed",
    /// xdp: neither TCP nor UDP; passed untouched.
    XdpOtherProtocol = 43 => "xdp_other_protocol",
    /// xdp: neither for an external VIP and port nor a reply to a
    /// forwarded flow; passed untouched.
    XdpNotOurs = 44 => "xdp_not_ours",
    /// xdp: the external VIP's service has no server; dropped.
    XdpNoServer = 45 => "xdp_no_server",
    /// xdp: a recently failed server was skipped.
    XdpSkippedFailed = 46 => "xdp_skipped_failed",
    /// xdp: every server failed recently; the first was used anyway.
    XdpAllFailed = 47 => "xdp_all_failed",
    /// xdp: the chosen server is of the other IP family than the VIP
    /// (NAT does not translate between families); dropped.
    XdpFamilyMismatch = 48 => "xdp_family_mismatch",
    /// xdp: the daemon has not said which address of the node reaches the
    /// chosen server (`NODE_ADDRESSES`); dropped.
    XdpNoNodeAddress = 49 => "xdp_no_node_address",
    /// xdp: every NAT port tried for a new flow was in use; the flow is
    /// refused (dropped).
    XdpNatPortsExhausted = 50 => "xdp_nat_ports_exhausted",
    /// xdp: a flow's server is no longer usable (failed, or gone from the
    /// selection); the flow was given a new one.
    XdpFlowMoved = 51 => "xdp_flow_moved",
    /// xdp: a reset answered a forwarded SYN: the server is marked failed.
    XdpServerReset = 52 => "xdp_server_reset",
    /// xdp: a forwarded SYN was sent again (its server did not answer):
    /// the server is marked failed and the flow moves.
    XdpSynRetransmitted = 53 => "xdp_syn_retransmitted",
    /// xdp: the packet's TTL or hop limit would run out; passed untouched
    /// to the kernel, which answers with an ICMP error.
    XdpTtlExceeded = 54 => "xdp_ttl_exceeded",
    /// xdp: the kernel's FIB has no route or no neighbour entry for a
    /// packet rewritten toward a server (the node has not resolved the
    /// server's address yet; its health checks do); dropped.
    XdpNoRoute = 55 => "xdp_no_route",
    /// xdp: the rewritten packet was sent out by redirect.
    XdpRedirected = 56 => "xdp_redirected",
    /// xdp: an ARP request for an announced VIP, answered with the
    /// interface's MAC.
    XdpArpAnswered = 57 => "xdp_arp_answered",
    /// xdp: a neighbour solicitation for an announced VIP, answered with a
    /// neighbour advertisement.
    XdpNdpAnswered = 58 => "xdp_ndp_answered",
    /// xdp: a `spread` service's new flow took its server from the
    /// service's consistent-hash (Maglev) table.
    XdpConsistent = 59 => "xdp_consistent",
    /// xdp: an ICMP error about a forwarded flow (unreachable, too big,
    /// time exceeded), from the servers' side, was translated back to its
    /// client.
    XdpIcmpToClient = 60 => "xdp_icmp_to_client",
    /// xdp: an ICMP error about a reply, from the clients' side, was
    /// translated to the flow's server.
    XdpIcmpToServer = 61 => "xdp_icmp_to_server",
    /// xdp: a new flow took a NAT port whose last flow had ended (or
    /// idled out), and that flow's entry went (`lb_common::nat`).
    XdpNatPortReused = 62 => "xdp_nat_port_reused",
    /// xdp: a client's packet too big for the route toward its server was
    /// answered with the node's own "fragmentation needed" / "packet too
    /// big", carrying the route's MTU.
    XdpTooBig = 63 => "xdp_too_big",
    /// xdp: a client's packet too big for the route toward its server was
    /// dropped unanswered: IPv4 that allows fragmenting (XDP cannot
    /// fragment), or a kernel whose FIB does not say the MTU (before
    /// Linux 5.12).
    XdpTooBigDropped = 64 => "xdp_too_big_dropped",
    /// xdp: an ARP request or neighbour solicitation for an announced VIP
    /// went unanswered: the node's lease for it has run out
    /// (`ANNOUNCE_UNTIL`), and another node may hold it now.
    XdpAnnounceFenced = 65 => "xdp_announce_fenced",
    /// xdp: a packet for an external VIP or a flow, in a frame sent to
    /// another machine's MAC address (a switch floods frames for an
    /// address it has not learned, such as a dead node's, to every port):
    /// passed to the kernel, which drops it. Only the node it was sent to
    /// forwards it.
    XdpOtherHost = 66 => "xdp_other_host",
    /// xdp: a packet to a server was routed by asking the kernel's FIB;
    /// this CPU's next packets to that server take the route it gave, for
    /// 10 jiffies (10-100 ms; the others are not counted apart).
    XdpFibLookup = 67 => "xdp_fib_lookup",
    /// xdp: a client's SYN came again unanswered, but it was not one a
    /// server must answer (flags other than SYN, a bad header length or
    /// checksum, or data): it fails no server, and its flow stays.
    XdpSynMalformed = 68 => "xdp_syn_malformed",
    /// xdp: an established TCP flow's server has a failure mark; the flow
    /// stays (only the server leaving the selection, or the daemon
    /// confirming the failure, moves it: under NAT a moved flow is reset).
    XdpKeptEstablished = 69 => "xdp_kept_established",
    /// xdp: a client's TCP packet other than a SYN, of no flow (one never
    /// opened, or whose server left): it opens none, and is answered with
    /// the node's reset unless it is one (`xdp_reset_sent`).
    XdpNoFlow = 70 => "xdp_no_flow",
    /// xdp: the node answered a client's TCP packet with a reset from the
    /// VIP, as a host answers a segment of no connection.
    XdpResetSent = 71 => "xdp_reset_sent",
    /// xdp: a packet from a server's address to a NAT port arrived on an
    /// interface other than the one the flow's packets to that server
    /// leave by: not the server's (forged, or the route changed); dropped.
    XdpReplyElsewhere = 72 => "xdp_reply_elsewhere",
    /// xdp: a packet to an external VIP's address on a port or protocol
    /// lb does not serve there (or a fragment): never handed to the
    /// kernel, which does not own the address; TCP is answered with the
    /// node's reset (`xdp_reset_sent`), anything else dropped.
    XdpUnserved = 73 => "xdp_unserved",
    /// xdp: a TCP flow's client acknowledged its server's answer: the flow
    /// moved to the established tables, where new flows never evict it.
    XdpPromoted = 74 => "xdp_promoted",
    /// xdp: a TCP flow's client sent its first packet after its SYN, but
    /// not acknowledging the server's answer (none came, or it was not
    /// seen: a forged address), or the established tables refused it: the
    /// flow stays with the opening ones.
    XdpNotPromoted = 75 => "xdp_not_promoted",
    /// xdp: a new flow refused because this CPU has opened `[daemon]
    /// new_flows_per_cpu` this second already (a flood): what a flood
    /// costs stays bounded; established flows are not touched.
    XdpNewFlowLimited = 76 => "xdp_new_flow_limited",
    /// xdp: an answer of the node's own (a TCP reset, a "too big", a
    /// defence against a duplicate address probe) not sent because this
    /// CPU has sent `lb_common::ANSWERS_PER_CPU` this second already (a
    /// flood of forged packets): the packet is dropped unanswered.
    XdpAnswerLimited = 77 => "xdp_answer_limited",
    /// xdp: an ICMP error about a reply (quoting VIP → client) that did
    /// not arrive where the flow's client packets arrive: not from the
    /// client's side (forged on the servers' side, or the route changed);
    /// dropped.
    XdpIcmpElsewhere = 78 => "xdp_icmp_elsewhere",
    /// xdp: a "too big" about a reply saying an MTU below the least a path
    /// may have (IPv4 552, Linux's `min_pmtu`; IPv6 1280): forged, since
    /// no real path says it; dropped, so that no client can lower a
    /// server's path MTU toward the node below that floor.
    XdpTooBigBelowFloor = 79 => "xdp_too_big_below_floor",
    /// xdp: a reset, FIN or SYN from an established flow's server whose
    /// sequence number is outside the server's window
    /// (`lb_common::nat::server_window`): sent on to the client, whose
    /// stack judges it, but it ends nothing and frees no NAT port (forged
    /// blind on the servers' side).
    XdpServerOutOfWindow = 80 => "xdp_server_out_of_window",
    /// xdp: a client's packet of an established flow went to its server
    /// the short way (`established.rs` in lb-ebpf), on the verdict an
    /// earlier packet of the flow's VIP and server left in this epoch;
    /// counted here instead of `xdp_forwarded`.
    XdpForwardedShort = 81 => "xdp_forwarded_short",
    /// xdp: a client's first packet to a VIP that keeps the client's
    /// address (`lb_common::EXTERNAL_KEEP_CLIENT`) came from the node's
    /// own address toward the chosen server: forged (its flow would hold
    /// one of the node's NAT ports); dropped.
    XdpClientIsNode = 82 => "xdp_client_is_node",
}

impl Reason {
    /// The index of this reason's counter in `COUNTERS`.
    pub const fn index(self) -> u32 {
        self as u32
    }
}

/// A counter index that names no [`Reason`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownReason(pub u32);

impl core::fmt::Display for UnknownReason {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "unknown counter reason {}", self.0)
    }
}

impl core::error::Error for UnknownReason {}

impl TryFrom<u32> for Reason {
    type Error = UnknownReason;

    fn try_from(value: u32) -> Result<Self, Self::Error> {
        match Self::ALL.get(value as usize) {
            Some(&reason) => Ok(reason),
            None => Err(UnknownReason(value)),
        }
    }
}

impl From<Reason> for u32 {
    fn from(reason: Reason) -> Self {
        reason as u32
    }
}

// Entry i of `Reason::ALL` must be reason i (the indexes are dense, from 0),
// or `TryFrom<u32>` and the daemon's counter read would name the wrong one.
const _: () = {
    let mut i = 0;
    while i < Reason::COUNT {
        assert!(Reason::ALL[i] as usize == i);
        i += 1;
    }
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_names_are_the_stable_interface() {
        // Metrics labels and `lb status` keys: changing one breaks dashboards.
        let names: [&str; Reason::COUNT] = Reason::ALL.map(Reason::name);
        assert_eq!(
            names,
            [
                "connect_rewritten",
                "connect_not_vip",
                "connect_no_server",
                "connect_all_failed",
                "connect_skipped_failed",
                "connect_other_protocol",
                "connect_family_mismatch",
                "connect_untracked",
                "getpeername_rewritten",
                "getpeername_untouched",
                "sockops_established",
                "sockops_connect_failed",
                "sockops_connect_timeout",
                "sockops_closed",
                "sockops_untracked",
                "event_dropped",
                "map_error",
                "connect_other_netns",
                "connect_untracked_udp",
                "release_cancelled",
                "release_udp",
                "release_untouched",
                "failed_at_full",
                "connections_full",
                "sockops_cancelled",
                "sendmsg_rewritten",
                "sendmsg_kept",
                "sendmsg_not_vip",
                "sendmsg_other_protocol",
                "sendmsg_other_netns",
                "sendmsg_no_server",
                "sendmsg_skipped_failed",
                "sendmsg_all_failed",
                "sendmsg_family_mismatch",
                "udp_peers_full",
                "recvmsg_rewritten",
                "recvmsg_untouched",
                "xdp_new_flow",
                "xdp_forwarded",
                "xdp_replied",
                "xdp_not_ip",
                "xdp_truncated",
                "xdp_unparsed",
                "xdp_other_protocol",
                "xdp_not_ours",
                "xdp_no_server",
                "xdp_skipped_failed",
                "xdp_all_failed",
                "xdp_family_mismatch",
                "xdp_no_node_address",
                "xdp_nat_ports_exhausted",
                "xdp_flow_moved",
                "xdp_server_reset",
                "xdp_syn_retransmitted",
                "xdp_ttl_exceeded",
                "xdp_no_route",
                "xdp_redirected",
                "xdp_arp_answered",
                "xdp_ndp_answered",
                "xdp_consistent",
                "xdp_icmp_to_client",
                "xdp_icmp_to_server",
                "xdp_nat_port_reused",
                "xdp_too_big",
                "xdp_too_big_dropped",
                "xdp_announce_fenced",
                "xdp_other_host",
                "xdp_fib_lookup",
                "xdp_syn_malformed",
                "xdp_kept_established",
                "xdp_no_flow",
                "xdp_reset_sent",
                "xdp_reply_elsewhere",
                "xdp_unserved",
                "xdp_promoted",
                "xdp_not_promoted",
                "xdp_new_flow_limited",
                "xdp_answer_limited",
                "xdp_icmp_elsewhere",
                "xdp_too_big_below_floor",
                "xdp_server_out_of_window",
                "xdp_forwarded_short",
                "xdp_client_is_node",
            ]
        );
    }

    #[test]
    fn reasons_round_trip_through_their_counter_index() {
        for (i, reason) in Reason::ALL.into_iter().enumerate() {
            assert_eq!(reason.index() as usize, i);
            assert_eq!(Reason::try_from(i as u32), Ok(reason));
        }
        assert_eq!(
            Reason::try_from(Reason::COUNT as u32),
            Err(UnknownReason(Reason::COUNT as u32))
        );
        assert_eq!(Reason::try_from(u32::MAX), Err(UnknownReason(u32::MAX)));
    }
}
