//! Numbers the kernel programs share: address families, protocols,
//! errno values and verdicts, as the kernel's headers define them.

pub(crate) const AF_INET: u32 = 2;
pub(crate) const AF_INET6: u32 = 10;
pub(crate) const IPPROTO_TCP: u32 = 6;
pub(crate) const IPPROTO_UDP: u32 = 17;

/// `E2BIG`: a hash map update failed because the map is full.
pub(crate) const E2BIG: i32 = 7;

/// Verdicts of cgroup sock_addr programs.
pub(crate) const ALLOW: i32 = 1;
pub(crate) const REFUSE: i32 = 0;

// Packet headers, as the XDP program parses them.

/// An Ethernet header without a VLAN tag.
pub(crate) const ETH_HLEN: usize = 14;
/// EtherTypes, as the 16-bit field reads in network byte order.
pub(crate) const ETH_P_IP: u16 = 0x0800;
pub(crate) const ETH_P_IPV6: u16 = 0x86dd;
pub(crate) const IPV4_HLEN: usize = 20;
pub(crate) const IPV6_HLEN: usize = 40;
pub(crate) const TCP_HLEN: usize = 20;

/// TCP flags (byte 13 of the header).
pub(crate) const TCP_FIN: u8 = 0x01;
pub(crate) const TCP_SYN: u8 = 0x02;
pub(crate) const TCP_RST: u8 = 0x04;
pub(crate) const TCP_ACK: u8 = 0x10;

/// Where the IP header starts: right after Ethernet (no VLAN tag).
pub(crate) const L3: usize = ETH_HLEN;
