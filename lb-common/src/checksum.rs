//! Incremental updates of the Internet checksum (RFC 1071; RFC 1624,
//! equation 3: `HC' = ~(~HC + ~m + m')`), for the XDP path's address and
//! port rewrites: only the changed words are summed, never the payload.
//!
//! Words are taken exactly as they lie in the packet and loaded in the
//! machine's byte order, and so is the checksum field: a one's complement
//! sum is the same in either byte order as long as every word and the
//! field are loaded alike. A 32-bit word may be added whole, because
//! `2^16 ≡ 1 (mod 0xffff)`: its halves add up to the same residue.

/// Folds a sum of words into 16 bits with end-around carries.
#[inline(always)]
pub const fn fold(sum: u64) -> u16 {
    let sum = (sum & 0xffff_ffff) + (sum >> 32);
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// `check` after a 32-bit word it covers changed from `old` to `new`.
#[inline(always)]
pub const fn replace32(check: u16, old: u32, new: u32) -> u16 {
    !fold(!check as u64 + !old as u64 + new as u64)
}

/// `check` after a 16-bit word it covers changed from `old` to `new`.
#[inline(always)]
pub const fn replace16(check: u16, old: u16, new: u16) -> u16 {
    !fold(!check as u64 + !old as u64 + new as u64)
}

/// `header`, an IPv4 header without options written whole (its checksum
/// field zero), with its checksum in place: for the packets the XDP path
/// makes itself (a reset, a "too big").
#[inline(always)]
pub fn seal_ipv4_header(header: &mut [u8; 20]) {
    let mut sum = 0u64;
    for i in 0..10 {
        sum += u64::from(u16::from_ne_bytes([header[2 * i], header[2 * i + 1]]));
    }
    let check = (!fold(sum)).to_ne_bytes();
    header[10] = check[0];
    header[11] = check[1];
}

/// A UDP checksum as it must be written: a computed 0 is sent as
/// `0xffff`, because 0 in the field means "no checksum" (RFC 768).
#[inline(always)]
pub const fn udp_field(check: u16) -> u16 {
    if check == 0 { 0xffff } else { check }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The checksum of `bytes` computed from scratch, loaded as the kernel
    /// programs load words (native order), for comparison.
    fn full(bytes: &[u8]) -> u16 {
        let sum: u64 = bytes
            .chunks(2)
            .map(|w| u64::from(u16::from_ne_bytes([w[0], *w.get(1).unwrap_or(&0)])))
            .sum();
        !fold(sum)
    }

    #[test]
    fn a_sealed_ipv4_header_sums_to_all_ones() {
        // 198.18.1.100 -> 198.18.0.10, TCP, 40 bytes, DF, TTL 64.
        let mut header =
            [0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0, 198, 18, 1, 100, 198, 18, 0, 10];
        seal_ipv4_header(&mut header);
        assert_eq!(full(&header), 0, "a header with its checksum sums to all ones");
        assert_eq!(u16::from_be_bytes([header[10], header[11]]), 0xad3d, "as worked by hand");
    }

    fn word32(bytes: &[u8], at: usize) -> u32 {
        u32::from_ne_bytes(bytes[at..at + 4].try_into().unwrap())
    }

    fn word16(bytes: &[u8], at: usize) -> u16 {
        u16::from_ne_bytes(bytes[at..at + 2].try_into().unwrap())
    }

    #[test]
    fn a_known_ipv4_header() {
        // The example header of RFC 1071's usual illustration (checksum
        // field zero): 0xb1e6 in network order.
        let header = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(full(&header).to_ne_bytes(), [0xb8, 0x61]);
    }

    proptest! {
        #[test]
        fn replacing_words_matches_a_full_recomputation(
            mut bytes in proptest::collection::vec(any::<u8>(), 8..64),
            word in 0usize..16,
            new32 in any::<u32>(),
            new16 in any::<u16>(),
        ) {
            let len = bytes.len() & !3;
            let at = (word * 4) % (len - 4);
            let check = full(&bytes);
            let old = word32(&bytes, at);
            bytes[at..at + 4].copy_from_slice(&new32.to_ne_bytes());
            let check = replace32(check, old, new32);
            // Equal as one's complement values: 0x0000 and 0xffff both
            // stand for zero.
            let expected = full(&bytes);
            prop_assert!(check == expected || (check | expected) == 0xffff && check ^ expected == 0xffff);

            let at16 = at + 2;
            let old16 = word16(&bytes, at16);
            bytes[at16..at16 + 2].copy_from_slice(&new16.to_ne_bytes());
            let check = replace16(check, old16, new16);
            let expected = full(&bytes);
            prop_assert!(check == expected || (check | expected) == 0xffff && check ^ expected == 0xffff);
        }

        #[test]
        fn a_header_with_its_checksum_sums_to_zero_after_updates(
            mut bytes in proptest::collection::vec(any::<u8>(), 20..21),
            new_addr in any::<u32>(),
        ) {
            // An IPv4-like header: checksum at 10, an address at 16.
            bytes[10] = 0;
            bytes[11] = 0;
            let check = full(&bytes);
            bytes[10..12].copy_from_slice(&check.to_ne_bytes());
            let old = word32(&bytes, 16);
            bytes[16..20].copy_from_slice(&new_addr.to_ne_bytes());
            let check = replace32(word16(&bytes, 10), old, new_addr);
            bytes[10..12].copy_from_slice(&check.to_ne_bytes());
            // A receiver's verification: the sum over the header, checksum
            // included, is all ones (`full` then gives zero).
            prop_assert!(full(&bytes) == 0 || full(&bytes) == 0xffff);
        }
    }

    #[test]
    fn udp_never_sends_a_zero_checksum() {
        assert_eq!(udp_field(0), 0xffff);
        assert_eq!(udp_field(0x1234), 0x1234);
    }
}
