//! One's-complement checksum arithmetic (RFC 1071) for headers the datapath builds itself, and
//! incremental updates (RFC 1624) for rewrites in XDP and of the IPv4 header on TC, where the
//! checksum is complete. L4 checksums of skbs on TC have two forms: complete (`l4_update`), or,
//! for a CHECKSUM_PARTIAL skb (what a pod's own stack sends with checksum offload), only the
//! pseudo-header sum (`pseudo_header`, `partial_update`), which the device or the kernel
//! completes later. Which one a packet holds is the skb's business; see the TC datapath's
//! `nat` module for how it tells them apart.

/// Folds a 64-bit one's-complement accumulator to 16 bits. Written without a data-dependent loop
/// so the verifier sees straight-line code.
#[inline(always)]
pub const fn fold(sum: u64) -> u16 {
    let s = (sum & 0xffff_ffff) + (sum >> 32);
    let s = (s & 0xffff_ffff) + (s >> 32);
    let s = (s & 0xffff) + (s >> 16);
    let s = (s & 0xffff) + (s >> 16);
    let s = (s & 0xffff) + (s >> 16);
    s as u16
}

/// Adds big-endian 16-bit words of `bytes` (length must be even) to `acc`.
#[inline(always)]
pub fn add_be_words(mut acc: u64, bytes: &[u8]) -> u64 {
    let mut i = 0;
    while i + 1 < bytes.len() {
        acc += u64::from(u16::from_be_bytes([bytes[i], bytes[i + 1]]));
        i += 2;
    }
    acc
}

// The functions below sum in the machine's byte order: the one's-complement sum does not
// depend on it (RFC 1071 §2(B)), as long as the result is stored in the same order, so fields
// and addresses are read with `from_ne_bytes` and written with `to_ne_bytes`, and no word is
// byte-swapped. Addresses are added as 32-bit words: a 32-bit word is congruent to the sum of
// its two 16-bit halves modulo 0xffff, and so is its complement to the sum of their
// complements. This is the datapath's per-packet arithmetic; the byte-swapping form took three
// times as many instructions.

/// A 2-byte field as a native-order word.
#[inline(always)]
fn w16(b: [u8; 2]) -> u64 {
    u64::from(u16::from_ne_bytes(b))
}

/// The complement of a 2-byte field, as a native-order word.
#[inline(always)]
fn not16(b: [u8; 2]) -> u64 {
    u64::from(!u16::from_ne_bytes(b))
}

/// A 4-byte field as a native-order word.
#[inline(always)]
fn w32(b: [u8; 4]) -> u64 {
    u64::from(u32::from_ne_bytes(b))
}

/// The complement of a 4-byte field, as a native-order word.
#[inline(always)]
fn not32(b: [u8; 4]) -> u64 {
    u64::from(!u32::from_ne_bytes(b))
}

/// An address as the checksum sees it: the sum of its words, and of their complements. IPv4
/// addresses are one 32-bit word, IPv6 addresses four.
pub trait Words: Copy {
    fn sum(self) -> u64;
    fn not_sum(self) -> u64;
}

impl Words for [u8; 4] {
    #[inline(always)]
    fn sum(self) -> u64 {
        w32(self)
    }
    #[inline(always)]
    fn not_sum(self) -> u64 {
        not32(self)
    }
}

impl Words for crate::Ip6 {
    #[inline(always)]
    fn sum(self) -> u64 {
        let [a, b, c, d] = self.0;
        u64::from(a) + u64::from(b) + u64::from(c) + u64::from(d)
    }
    #[inline(always)]
    fn not_sum(self) -> u64 {
        let [a, b, c, d] = self.0;
        u64::from(!a) + u64::from(!b) + u64::from(!c) + u64::from(!d)
    }
}

/// The unfolded change to a one's-complement sum when the address `old` becomes `new`. A
/// rewrite of several fields adds their changes (`word_change` for 16-bit ones) and folds once
/// (`apply`, `l4_apply`): XDP's rewrite of both addresses sums the address part once for the
/// IPv4 header and the L4 pseudo-header, where updating field by field folded five times.
#[inline(always)]
pub fn address_change<A: Words>(old: A, new: A) -> u64 {
    old.not_sum() + new.sum()
}

/// The unfolded change to a one's-complement sum when the 16-bit field `old` becomes `new`.
#[inline(always)]
pub fn word_change(old: [u8; 2], new: [u8; 2]) -> u64 {
    not16(old) + w16(new)
}

/// A checksum field after the covered data changed by `change` (RFC 1624, eqn. 3).
#[inline(always)]
pub fn apply(check: [u8; 2], change: u64) -> [u8; 2] {
    (!fold(not16(check) + change)).to_ne_bytes()
}

/// A complete TCP/UDP checksum after the change `change` to what it covers. For UDP
/// (`udp_zero`), zero means "no checksum" and stays zero, and a computed zero is sent as 0xffff
/// (RFC 768), as the kernel's helper does with BPF_F_MARK_MANGLED_0. Every complete-form update
/// below goes through it.
#[inline(always)]
pub fn l4_apply(field: [u8; 2], change: u64, udp_zero: bool) -> [u8; 2] {
    if udp_zero && field == [0, 0] {
        return field;
    }
    let c = apply(field, change);
    if udp_zero && c == [0, 0] {
        [0xff, 0xff]
    } else {
        c
    }
}

/// RFC 1624 (eqn. 3) incremental update: the checksum field after the 16-bit words `old` of the
/// covered data became `new`. Values are as the packet stores them (network order).
#[inline(always)]
pub fn update4(check: [u8; 2], old: [u8; 4], new: [u8; 4]) -> [u8; 2] {
    update_address(check, old, new)
}

/// As `update4`, for an address of either family (one word for IPv4, four for IPv6).
#[inline(always)]
pub fn update_address<A: Words>(check: [u8; 2], old: A, new: A) -> [u8; 2] {
    apply(check, address_change(old, new))
}

/// As `update4`, for one 16-bit word (a port, or the TTL/protocol word).
#[inline(always)]
pub fn update2(check: [u8; 2], old: [u8; 2], new: [u8; 2]) -> [u8; 2] {
    apply(check, word_change(old, new))
}

/// The TCP/UDP pseudo-header sum, folded and not complemented: what the checksum field of a
/// CHECKSUM_PARTIAL packet holds (as the kernel's `~csum_tcpudp_magic(...)`). IPv6's
/// pseudo-header (RFC 8200 §8.1) has a 32-bit length and next-header word, which sum to the
/// same as IPv4's 16-bit ones for lengths below 64 KiB.
#[inline(always)]
pub fn pseudo_header<A: Words>(saddr: A, daddr: A, proto: u8, l4_len: u16) -> [u8; 2] {
    fold(saddr.sum() + daddr.sum() + w16([0, proto]) + w16(l4_len.to_be_bytes())).to_ne_bytes()
}

/// The folded sum of a pseudo-header's two addresses: a flow's constant part of
/// `pseudo_header`, kept in its conntrack entry (`pseudo_header_with`). Never 0 unless both
/// addresses are all zeroes, so 0 can stand for "not computed".
#[inline(always)]
pub fn address_pair<A: Words>(saddr: A, daddr: A) -> [u8; 2] {
    fold(saddr.sum() + daddr.sum()).to_ne_bytes()
}

/// `pseudo_header` from the addresses' `address_pair`.
#[inline(always)]
pub fn pseudo_header_with(pair: [u8; 2], proto: u8, l4_len: u16) -> [u8; 2] {
    fold(w16(pair) + w16([0, proto]) + w16(l4_len.to_be_bytes())).to_ne_bytes()
}

/// The folded change an address rewrite from `old` to `new` makes to a checksum: a flow's
/// constant part of `partial_update` and `l4_update`, kept in its conntrack entry (the
/// `_with` forms). 0 only when `old` is all ones and `new` all zeroes.
#[inline(always)]
pub fn address_delta<A: Words>(old: A, new: A) -> [u8; 2] {
    fold(address_change(old, new)).to_ne_bytes()
}

/// A reply's `address_pair` and `address_delta` from its flow's forward ones: the reply
/// carries the backend's and the client's addresses, and its rewrite takes the backend's back
/// to the Service's, the forward change undone. (Summed from the addresses instead, a new IPv6
/// flow would add 16 words more.) A half is 0 ("not computed") where the forward's is, and the
/// delta also where the change is nil in the sum (its complement would read as 0).
#[inline(always)]
pub fn reply_sums(pair: [u8; 2], delta: [u8; 2]) -> ([u8; 2], [u8; 2]) {
    if pair == [0, 0] || delta == [0, 0] {
        return ([0, 0], [0, 0]);
    }
    // (The backend's words less the Service's, added to the client's and the Service's.)
    let pair = fold(w16(pair) + w16(delta)).to_ne_bytes();
    (pair, (!u16::from_ne_bytes(delta)).to_ne_bytes())
}

/// `partial_update` from the addresses' `address_delta`.
#[inline(always)]
pub fn partial_update_with(field: [u8; 2], delta: [u8; 2]) -> [u8; 2] {
    fold(w16(field) + w16(delta)).to_ne_bytes()
}

/// `l4_update` from the addresses' `address_delta`.
#[inline(always)]
pub fn l4_update_with(field: [u8; 2], delta: [u8; 2], old_port: [u8; 2], new_port: [u8; 2], udp_zero: bool) -> [u8; 2] {
    l4_apply(field, w16(delta) + word_change(old_port, new_port), udp_zero)
}

/// A pseudo-header sum (CHECKSUM_PARTIAL field) after an address in it changed from `old` to
/// `new`. Ports are not in it: their change needs nothing.
#[inline(always)]
pub fn partial_update<A: Words>(field: [u8; 2], old: A, new: A) -> [u8; 2] {
    fold(w16(field) + address_change(old, new)).to_ne_bytes()
}

/// A complete TCP/UDP checksum after an address of the pseudo-header and a port changed;
/// `udp_zero` as in `l4_apply`. (One sum for both changes: it folds to what
/// `update2(update4(..))` gives, as a fold is zero only for a zero sum.)
#[inline(always)]
pub fn l4_update<A: Words>(field: [u8; 2], old_addr: A, new_addr: A, old_port: [u8; 2], new_port: [u8; 2], udp_zero: bool) -> [u8; 2] {
    l4_apply(field, address_change(old_addr, new_addr) + word_change(old_port, new_port), udp_zero)
}

/// The change to add to a CHECKSUM_COMPLETE skb's `skb->csum` (a sum over the network header
/// and everything after it, in memory order) when a rewrite wrote a port (`old_port` to
/// `new_port`) and its L4 checksum field (`old_field` to `new_field`), and changed the IPv4
/// header only together with its checksum (which leaves the header's sum as it was). Folded,
/// for `bpf_csum_update`.
#[inline(always)]
pub fn covered_change(old_port: [u8; 2], new_port: [u8; 2], old_field: [u8; 2], new_field: [u8; 2]) -> u16 {
    fold(word_change(old_port, new_port) + word_change(old_field, new_field))
}

/// The checksum field value for an IPv4 header whose checksum field is zero.
#[inline(always)]
pub fn ipv4_header(header: &[u8; 20]) -> [u8; 2] {
    (!fold(add_be_words(0, header))).to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simple generator keeps the tests deterministic without a dependency.
    fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    #[test]
    fn fold_carries_repeatedly() {
        assert_eq!(fold(0), 0);
        assert_eq!(fold(0xffff), 0xffff);
        assert_eq!(fold(0x1_0000), 1);
        assert_eq!(fold(0x1_fffe), 0xffff);
        assert_eq!(fold(u64::MAX), 0xffff);
    }

    #[test]
    fn incremental_update_matches_recomputation() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for _ in 0..10_000 {
            let mut h = [0u8; 20];
            h.iter_mut().for_each(|b| *b = next() as u8);
            h[10] = 0;
            h[11] = 0;
            let c = ipv4_header(&h);
            h[10] = c[0];
            h[11] = c[1];
            let new: [u8; 4] = (next() as u32).to_ne_bytes();
            let old: [u8; 4] = h[16..20].try_into().unwrap();
            let updated = update4(c, old, new);
            h[16..20].copy_from_slice(&new);
            h[10] = 0;
            h[11] = 0;
            let full = ipv4_header(&h);
            // One's complement has two zeros; both verify. Compare by verification.
            h[10] = updated[0];
            h[11] = updated[1];
            assert_eq!(fold(add_be_words(0, &h)), 0xffff, "updated {updated:?} vs recomputed {full:?}");
        }
    }

    /// RFC 1624 eqn. 3 over big-endian 16-bit words, one word at a time: the reference the
    /// native-order, 32-bit-word arithmetic must equal bit for bit.
    fn reference_update(check: [u8; 2], old: &[u8], new: &[u8]) -> [u8; 2] {
        let mut sum = u64::from(!u16::from_be_bytes(check));
        for (o, n) in old.chunks(2).zip(new.chunks(2)) {
            sum += u64::from(!u16::from_be_bytes([o[0], o[1]])) + u64::from(u16::from_be_bytes([n[0], n[1]]));
        }
        (!fold(sum)).to_be_bytes()
    }

    #[test]
    fn native_order_arithmetic_equals_the_big_endian_reference_bit_for_bit() {
        let mut next = xorshift(0x51_7cc1_b727_220a);
        // Random values, and the edges where one's complement has two zeros.
        let edges: [u64; 4] = [0, 0xffff_ffff, 0xffff, 0xffff_0000];
        for i in 0..100_000u32 {
            let pick = |r: u64, k: u32| if k % 7 < 4 { edges[(k % 7) as usize] } else { r };
            let check = (pick(next(), i) as u16).to_be_bytes();
            let old = (pick(next(), i / 7) as u32).to_be_bytes();
            let new = (pick(next(), i / 49) as u32).to_be_bytes();
            let (op, np) = ((next() as u16).to_be_bytes(), (pick(next(), i / 3) as u16).to_be_bytes());
            assert_eq!(update4(check, old, new), reference_update(check, &old, &new));
            assert_eq!(update2(check, op, np), reference_update(check, &op, &np));
            let both = reference_update(reference_update(check, &old, &new), &op, &np);
            assert_eq!(l4_update(check, old, new, op, np, false), both);
            assert_eq!(update4(l4_apply(check, word_change(op, np), false), old, new), both);
            assert_eq!(
                partial_update(check, old, new),
                (!u16::from_be_bytes(reference_update((!u16::from_be_bytes(check)).to_be_bytes(), &old, &new))).to_be_bytes()
            );
            let len = next() as u16;
            let mut ph = [0u8; 12];
            ph[..4].copy_from_slice(&old);
            ph[4..8].copy_from_slice(&new);
            ph[9] = 6;
            ph[10..].copy_from_slice(&len.to_be_bytes());
            assert_eq!(pseudo_header(old, new, 6, len), fold(add_be_words(0, &ph)).to_be_bytes());
        }
    }

    /// The same for IPv6's 16-byte addresses (eight 16-bit words, summed as four 32-bit ones),
    /// and its pseudo-header (RFC 8200 §8.1: addresses, a 32-bit length, three zero bytes and
    /// the next header).
    #[test]
    fn ipv6_address_arithmetic_equals_the_big_endian_reference() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        let edges: [u128; 3] = [0, u128::MAX, 0xffff];
        for i in 0..20_000u32 {
            let addr = |r: u128, k: u32| (if k % 5 < 3 { edges[(k % 5) as usize] } else { r }).to_be_bytes();
            let check = (next() as u16).to_be_bytes();
            let old = addr(u128::from(next()) << 64 | u128::from(next()), i);
            let new = addr(u128::from(next()) << 64 | u128::from(next()), i / 5);
            let (old6, new6) = (crate::Ip6::from_bytes(old), crate::Ip6::from_bytes(new));
            let (op, np) = ((next() as u16).to_be_bytes(), (next() as u16).to_be_bytes());
            let both = reference_update(reference_update(check, &old, &new), &op, &np);
            assert_eq!(l4_update(check, old6, new6, op, np, false), both);
            assert_eq!(
                partial_update(check, old6, new6),
                (!u16::from_be_bytes(reference_update((!u16::from_be_bytes(check)).to_be_bytes(), &old, &new))).to_be_bytes()
            );
            let len = next() as u16;
            let mut ph = [0u8; 40];
            ph[..16].copy_from_slice(&old);
            ph[16..32].copy_from_slice(&new);
            ph[34..36].copy_from_slice(&len.to_be_bytes());
            ph[39] = 17;
            assert_eq!(pseudo_header(old6, new6, 17, len), fold(add_be_words(0, &ph)).to_be_bytes());
        }
    }

    /// The conntrack entries' kept sums, a forward entry's and the reply's made from them
    /// (`reply_sums`), give, bit for bit, what summing the addresses gives (all-zero and
    /// all-ones addresses included, and a UDP checksum of zero).
    #[test]
    fn kept_address_sums_give_what_the_addresses_give() {
        fn check<A: Words>(next: &mut impl FnMut() -> u64, saddr: A, daddr: A, new: A) {
            let field = (next() as u16).to_ne_bytes();
            let field = if next().is_multiple_of(7) { [0, 0] } else { field };
            let (op, np, len) = ((next() as u16).to_ne_bytes(), (next() as u16).to_ne_bytes(), next() as u16);
            let (pair, delta) = (address_pair(saddr, daddr), address_delta(daddr, new));
            for proto in [6, 17] {
                assert_eq!(pseudo_header_with(pair, proto, len), pseudo_header(saddr, daddr, proto, len));
            }
            assert_eq!(partial_update_with(field, delta), partial_update(field, daddr, new));
            for udp in [false, true] {
                assert_eq!(l4_update_with(field, delta, op, np, udp), l4_update(field, daddr, new, op, np, udp));
            }
            // The reply's (from `new` to `saddr`, given `daddr` back), made from those: 0 only
            // where the forward's are, or the change is nil in the sum.
            let (rpair, rdelta) = reply_sums(pair, delta);
            if pair != [0, 0] && delta != [0, 0] {
                assert_ne!(rpair, [0, 0]);
                assert_eq!(rdelta == [0, 0], delta == [0xff, 0xff]);
            }
            if rpair != [0, 0] {
                for proto in [6, 17] {
                    assert_eq!(pseudo_header_with(rpair, proto, len), pseudo_header(new, saddr, proto, len));
                }
            }
            if rdelta != [0, 0] {
                assert_eq!(partial_update_with(field, rdelta), partial_update(field, new, daddr));
                for udp in [false, true] {
                    assert_eq!(l4_update_with(field, rdelta, op, np, udp), l4_update(field, new, daddr, op, np, udp));
                }
            }
        }
        let mut next = xorshift(0x1234_5678_9abc_def1);
        let edges: [u128; 3] = [0, u128::MAX, 0xffff_0000];
        for i in 0..30_000u32 {
            let mut addr = |k: u32| if k % 4 < 3 { edges[(k % 4) as usize] } else { u128::from(next()) << 64 | u128::from(next()) };
            let (s, d, n) = (addr(i), addr(i / 4), addr(i / 16));
            check(&mut next, (s as u32).to_ne_bytes(), (d as u32).to_ne_bytes(), (n as u32).to_ne_bytes());
            let ip6 = |v: u128| crate::Ip6::from_bytes(v.to_be_bytes());
            check(&mut next, ip6(s), ip6(d), ip6(n));
        }
    }

    #[test]
    fn word_update_matches_recomputation() {
        let mut h =
            [0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8, 0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7];
        let c = ipv4_header(&h);
        // Decrement the TTL (the TTL/protocol word).
        let updated = update2(c, [h[8], h[9]], [h[8] - 1, h[9]]);
        h[8] -= 1;
        assert_eq!(updated, ipv4_header(&h));
    }

    /// A TCP segment's complete checksum, computed from scratch (RFC 793), for the tests.
    fn tcp_checksum(saddr: [u8; 4], daddr: [u8; 4], segment: &[u8]) -> [u8; 2] {
        let sum = add_be_words(u64::from(u16::from_be_bytes(pseudo_header(saddr, daddr, 6, segment.len() as u16))), segment);
        (!fold(sum)).to_be_bytes()
    }

    #[test]
    fn l4_rewrites_in_both_checksum_forms_match_recomputation() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for _ in 0..10_000 {
            let saddr = (next() as u32).to_be_bytes();
            let (old_addr, new_addr) = ((next() as u32).to_be_bytes(), (next() as u32).to_be_bytes());
            let mut seg = [0u8; 40];
            seg.iter_mut().for_each(|b| *b = next() as u8);
            seg[16] = 0;
            seg[17] = 0;
            let old_port = [seg[2], seg[3]];
            let new_port = (next() as u16).to_be_bytes();
            let len = seg.len() as u16;
            // Complete form: the updated checksum verifies against the rewritten segment.
            let complete = tcp_checksum(saddr, old_addr, &seg);
            let updated = l4_update(complete, old_addr, new_addr, old_port, new_port, false);
            seg[2..4].copy_from_slice(&new_port);
            seg[16..18].copy_from_slice(&updated);
            let verify = add_be_words(u64::from(u16::from_be_bytes(pseudo_header(saddr, new_addr, 6, len))), &seg);
            assert_eq!(fold(verify), 0xffff, "complete form after the rewrite");
            // Partial form: the field is the new pseudo-header sum, whatever the port.
            let partial = pseudo_header(saddr, old_addr, 6, len);
            assert_eq!(partial_update(partial, old_addr, new_addr), pseudo_header(saddr, new_addr, 6, len));
        }
    }

    /// The skb's sum over an IPv4 header and a TCP or UDP segment (memory order, as
    /// `csum_partial` adds), before and after a reply's source address and port are rewritten
    /// the way the TC datapath does it (header checksum and L4 field by arithmetic): the sum
    /// moved by `covered_change` is the new bytes' sum.
    #[test]
    fn covered_change_keeps_a_complete_skb_sum_equal_to_the_rewritten_bytes_sum() {
        let sum_of = |bytes: &[u8]| bytes.chunks(2).fold(0u64, |a, w| a + u64::from(u16::from_ne_bytes([w[0], w[1]])));
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for round in 0..20_000 {
            let udp = round % 2 == 1;
            let mut pkt = [0u8; 20 + 28];
            pkt.iter_mut().for_each(|b| *b = next() as u8);
            (pkt[0], pkt[10], pkt[11]) = (0x45, 0, 0);
            let check = ipv4_header(pkt[..20].try_into().unwrap());
            pkt[10..12].copy_from_slice(&check);
            let csum_at = 20 + if udp { 6 } else { 16 };
            if udp && round % 6 == 1 {
                // No UDP checksum: it stays zero, and the port's change alone moves the sum.
                (pkt[csum_at], pkt[csum_at + 1]) = (0, 0);
            }
            let skb_before = fold(sum_of(&pkt));
            let (old_addr, new_addr): ([u8; 4], [u8; 4]) = (pkt[12..16].try_into().unwrap(), (next() as u32).to_be_bytes());
            let (old_port, new_port) = ([pkt[20], pkt[21]], (next() as u16).to_be_bytes());
            let old_field = [pkt[csum_at], pkt[csum_at + 1]];
            let new_field = l4_update(old_field, old_addr, new_addr, old_port, new_port, udp);
            let new_check = update4(check, old_addr, new_addr);
            pkt[12..16].copy_from_slice(&new_addr);
            pkt[10..12].copy_from_slice(&new_check);
            pkt[20..22].copy_from_slice(&new_port);
            pkt[csum_at..csum_at + 2].copy_from_slice(&new_field);
            let skb_after = fold(u64::from(skb_before) + u64::from(covered_change(old_port, new_port, old_field, new_field)));
            // Compared as residues mod 0xffff (0 and 0xffff are both zero).
            assert_eq!(u32::from(skb_after) % 0xffff, u32::from(fold(sum_of(&pkt))) % 0xffff, "round {round}, udp {udp}");
        }
    }

    /// XDP's one-fold rewrite of both addresses, both ports and the TTL gives what updating
    /// field by field gives, and what recomputing gives.
    #[test]
    fn a_rewrite_summed_once_matches_field_by_field_updates_and_recomputation() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for round in 0..20_000 {
            let mut h = [0u8; 20];
            h.iter_mut().for_each(|b| *b = next() as u8);
            (h[0], h[10], h[11]) = (0x45, 0, 0);
            let check = ipv4_header(&h);
            let (saddr, daddr): ([u8; 4], [u8; 4]) = (h[12..16].try_into().unwrap(), h[16..20].try_into().unwrap());
            let (nsaddr, ndaddr) = ((next() as u32).to_be_bytes(), (next() as u32).to_be_bytes());
            let ttl = [h[8].wrapping_sub(1), h[9]];
            let addrs = address_change(saddr, nsaddr) + address_change(daddr, ndaddr);
            let once = apply(check, addrs + word_change([h[8], h[9]], ttl));
            let by_field = update2(update4(update4(check, saddr, nsaddr), daddr, ndaddr), [h[8], h[9]], ttl);
            assert_eq!(once, by_field, "IPv4 header");
            h[8] = ttl[0];
            h[12..16].copy_from_slice(&nsaddr);
            h[16..20].copy_from_slice(&ndaddr);
            assert_eq!(once, ipv4_header(&h), "IPv4 header recomputed");
            // The L4 checksum, TCP and UDP (whose zero means none).
            let (sport, dport, nsport, ndport) = (
                (next() as u16).to_be_bytes(),
                (next() as u16).to_be_bytes(),
                (next() as u16).to_be_bytes(),
                (next() as u16).to_be_bytes(),
            );
            let mut field = (next() as u16).to_be_bytes();
            if round % 7 == 0 {
                field = [0, 0];
            }
            for udp in [false, true] {
                let change = addrs + word_change(sport, nsport) + word_change(dport, ndport);
                let by_field = l4_update(l4_update(field, saddr, nsaddr, sport, nsport, udp), daddr, ndaddr, dport, ndport, udp);
                assert_eq!(l4_apply(field, change, udp), by_field, "L4, udp {udp}");
            }
        }
        // IPv6 addresses (four words each): both addresses and both ports summed once give what
        // the field-by-field updates give.
        for _ in 0..20_000 {
            let mut ip6 = || crate::Ip6([next() as u32, next() as u32, next() as u32, next() as u32]);
            let (s, ns, d, nd) = (ip6(), ip6(), ip6(), ip6());
            let (sport, nsport, dport, ndport) = (
                (next() as u16).to_be_bytes(),
                (next() as u16).to_be_bytes(),
                (next() as u16).to_be_bytes(),
                (next() as u16).to_be_bytes(),
            );
            let field = (next() as u16).to_be_bytes();
            let change = address_change(s, ns) + address_change(d, nd) + word_change(sport, nsport) + word_change(dport, ndport);
            let by_field = l4_update(l4_update(field, s, ns, sport, nsport, false), d, nd, dport, ndport, false);
            assert_eq!(l4_apply(field, change, false), by_field, "IPv6");
        }
        // The L4 checksum against recomputation: a TCP segment with both addresses and ports
        // changed.
        for _ in 0..10_000 {
            let (saddr, daddr) = ((next() as u32).to_be_bytes(), (next() as u32).to_be_bytes());
            let (nsaddr, ndaddr) = ((next() as u32).to_be_bytes(), (next() as u32).to_be_bytes());
            let mut seg = [0u8; 40];
            seg.iter_mut().for_each(|b| *b = next() as u8);
            (seg[16], seg[17]) = (0, 0);
            let check = tcp_checksum(saddr, daddr, &seg);
            let (nsport, ndport) = ((next() as u16).to_be_bytes(), (next() as u16).to_be_bytes());
            let change = address_change(saddr, nsaddr)
                + address_change(daddr, ndaddr)
                + word_change([seg[0], seg[1]], nsport)
                + word_change([seg[2], seg[3]], ndport);
            let updated = l4_apply(check, change, false);
            seg[0..2].copy_from_slice(&nsport);
            seg[2..4].copy_from_slice(&ndport);
            seg[16..18].copy_from_slice(&updated);
            let verify = add_be_words(u64::from(u16::from_be_bytes(pseudo_header(nsaddr, ndaddr, 6, seg.len() as u16))), &seg);
            assert_eq!(fold(verify), 0xffff, "the rewritten segment verifies");
        }
        // UDP's special values: no checksum stays none, a computed zero is sent as ones.
        assert_eq!(l4_apply([0, 0], word_change([0, 53], [0, 54]), true), [0, 0]);
        assert_eq!(l4_apply([0, 1], word_change([0, 0], [0, 1]), false), [0, 0]);
        assert_eq!(l4_apply([0, 1], word_change([0, 0], [0, 1]), true), [0xff, 0xff]);
    }

    #[test]
    fn udp_zero_checksum_stays_zero_and_a_computed_zero_is_sent_as_ones() {
        assert_eq!(l4_update([0, 0], [10, 0, 0, 1], [10, 0, 0, 2], [0, 53], [0, 54], true), [0, 0]);
        // An update that computes to zero: the address grows by one from a field of 1.
        assert_eq!(l4_update([0, 1], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0], [0, 0], false), [0, 0]);
        assert_eq!(l4_update([0, 1], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0], [0, 0], true), [0xff, 0xff]);
        // A port-only change: the same rules.
        let port_only = |field, old, new, udp| l4_apply(field, word_change(old, new), udp);
        assert_eq!(port_only([0, 0], [0, 53], [0, 54], true), [0, 0], "no checksum stays none");
        assert_eq!(port_only([0, 1], [0, 0], [0, 1], false), [0, 0]);
        assert_eq!(port_only([0, 1], [0, 0], [0, 1], true), [0xff, 0xff], "a computed zero is sent as ones");
        assert_eq!(port_only([0x12, 0x34], [0, 53], [0, 54], true), port_only([0x12, 0x34], [0, 53], [0, 54], false));
    }

    #[test]
    fn ipv4_header_checksum_matches_rfc1071_example() {
        // Header from the classic worked example (Wikipedia "IPv4 header checksum").
        let mut h =
            [0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8, 0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7];
        assert_eq!(ipv4_header(&h), [0xb8, 0x61]);
        h[10] = 0xb8;
        h[11] = 0x61;
        assert_eq!(fold(add_be_words(0, &h)), 0xffff, "a valid header sums to all ones");
    }
}
