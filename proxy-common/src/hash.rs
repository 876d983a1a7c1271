//! Hashes both sides must agree on: the flow hash the datapath indexes Maglev tables with, and
//! the backend hashes user space builds those tables from. They are part of the ABI: every node
//! must compute the same values, or north-south flows would pick different backends on
//! different nodes.

/// One round of mixing a 32-bit word into the state (the MurmurHash3 block step).
#[inline(always)]
const fn mix(h: u32, w: u32) -> u32 {
    let k = w.wrapping_mul(0xcc9e_2d51).rotate_left(15).wrapping_mul(0x1b87_3593);
    (h ^ k).rotate_left(13).wrapping_mul(5).wrapping_add(0xe654_6b64)
}

/// Final avalanche (MurmurHash3 fmix32), so every input bit affects every output bit.
#[inline(always)]
const fn finish(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Hash of a flow's 5-tuple, as it arrives (fields in network order, as in the packet).
#[inline(always)]
pub const fn flow(saddr: [u8; 4], daddr: [u8; 4], sport: [u8; 2], dport: [u8; 2], proto: u8) -> u32 {
    let mut h = 0x5eed_1b0b;
    h = mix(h, u32::from_ne_bytes(saddr));
    h = mix(h, u32::from_ne_bytes(daddr));
    h = mix(h, u32::from_ne_bytes([sport[0], sport[1], dport[0], dport[1]]));
    h = mix(h, proto as u32);
    finish(h ^ 13)
}

/// The same for an IPv6 flow: each address is four words.
#[inline(always)]
pub const fn flow6(saddr: crate::Ip6, daddr: crate::Ip6, sport: [u8; 2], dport: [u8; 2], proto: u8) -> u32 {
    let mut h = 0x5eed_1b0b;
    let mut i = 0;
    while i < 4 {
        h = mix(h, saddr.0[i]);
        i += 1;
    }
    i = 0;
    while i < 4 {
        h = mix(h, daddr.0[i]);
        i += 1;
    }
    h = mix(h, u32::from_ne_bytes([sport[0], sport[1], dport[0], dport[1]]));
    h = mix(h, proto as u32);
    finish(h ^ 37)
}

/// Hash of a frontend (address, port and protocol, in network order as the maps hold them),
/// which places it in the frontend filter (`crate::filter`).
#[inline(always)]
pub const fn frontend(addr: [u8; 4], port: [u8; 2], proto: u8) -> u32 {
    frontend_word(u32::from_ne_bytes(addr), port, proto)
}

/// The same for an IPv6 frontend, its address folded to one word first: addresses that fold
/// alike only share a bit (a lookup more for one of them), and a Service range's addresses,
/// which differ in their last word, never do.
#[inline(always)]
pub const fn frontend6(addr: crate::Ip6, port: [u8; 2], proto: u8) -> u32 {
    frontend_word(addr.0[0] ^ addr.0[1] ^ addr.0[2] ^ addr.0[3], port, proto)
}

#[inline(always)]
const fn frontend_word(addr: u32, port: [u8; 2], proto: u8) -> u32 {
    let mut h = 0xf1e7_7e55;
    h = mix(h, addr);
    h = mix(h, u32::from_ne_bytes([port[0], port[1], proto, 0]));
    finish(h)
}

/// 64-bit hash of bytes (FNV-1a, then a 64-bit finaliser), seeded, for user space.
pub const fn bytes64(seed: u64, data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325 ^ seed;
    let mut i = 0;
    while i < data.len() {
        h ^= data[i] as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PINNED6: u32 = 0x5703_155c;

    #[test]
    fn flow_hash_is_stable_and_spreads() {
        // Pinned value: the hash is ABI, a change would move flows between backends.
        assert_eq!(flow([192, 168, 0, 1], [10, 0, 0, 1], [0x12, 0x34], [0, 80], 6), 0xf7e7_077e);
        let mut buckets = [0u32; 16];
        for port in 0..16_000u16 {
            buckets[(flow([192, 168, 0, 1], [10, 0, 0, 1], port.to_be_bytes(), [0, 80], 6) % 16) as usize] += 1;
        }
        assert!(buckets.iter().all(|b| (900..1100).contains(b)), "uneven: {buckets:?}");
        assert_ne!(flow([1, 2, 3, 4], [5, 6, 7, 8], [0, 1], [0, 2], 6), flow([1, 2, 3, 4], [5, 6, 7, 8], [0, 1], [0, 2], 17));
    }

    #[test]
    fn ipv6_flow_hash_is_stable_and_spreads() {
        let a = crate::Ip6::from_bytes([0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7]);
        let b = crate::Ip6::from_bytes([0xfd, 0, 0, 0x50, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        // Pinned value: the hash is ABI, a change would move flows between backends.
        assert_eq!(flow6(a, b, [0x12, 0x34], [0, 80], 6), PINNED6);
        let mut buckets = [0u32; 16];
        for port in 0..16_000u16 {
            buckets[(flow6(a, b, port.to_be_bytes(), [0, 80], 6) % 16) as usize] += 1;
        }
        assert!(buckets.iter().all(|b| (900..1100).contains(b)), "uneven: {buckets:?}");
        assert_ne!(flow6(a, b, [0, 1], [0, 2], 6), flow6(b, a, [0, 1], [0, 2], 6), "the direction counts");
    }

    /// Cluster IPs of a /16 Service range and IPv6 ones of a /112 take about as many bits as
    /// a uniform hash would give them, and pod addresses then meet a set bit about as often as
    /// the share of set bits says.
    #[test]
    fn frontend_hash_is_stable_and_spreads_a_service_range() {
        extern crate std;
        use crate::filter::{place, BITS_LOG2};
        // Pinned: the filter's words outlive the agent in their pin (`map_names::FILTER`); a
        // change of the hash must rename the map.
        assert_eq!(frontend([10, 96, 0, 10], 53u16.to_be_bytes(), 17), 0x497d_d487);
        let v6 = crate::Ip6::from_bytes([0xfd, 0, 0x10, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10]);
        assert_eq!(frontend6(v6, 53u16.to_be_bytes(), 17), 0xa035_38c9);
        let (n, bits) = (10_000u32, 1u64 << BITS_LOG2);
        let mut set = std::collections::BTreeSet::new();
        let mut set6 = std::collections::BTreeSet::new();
        for i in 0..n {
            let [a, b, c, d] = (0x0a60_0000 + i).to_be_bytes();
            set.insert(place([a, b, c, d], 443u16.to_be_bytes(), 6));
            let mut v6 = [0u8; 16];
            v6[..4].copy_from_slice(&[0xfd, 0, 0x10, 0x96]);
            v6[12..].copy_from_slice(&i.to_be_bytes());
            set6.insert(place(crate::Ip6::from_bytes(v6), 443u16.to_be_bytes(), 6));
        }
        // A uniform hash leaves bits * (1 - e^(-n/bits)) of them set: 9,817 here.
        let uniform = bits as f64 * (1.0 - (-(f64::from(n)) / bits as f64).exp());
        for (family, s) in [("IPv4", &set), ("IPv6", &set6)] {
            assert!(s.len() as f64 > uniform * 0.98, "{family}: {} distinct bits of {n} frontends", s.len());
        }
        let words: std::collections::BTreeMap<u32, u64> = set.iter().fold(Default::default(), |mut m, (w, b)| {
            *m.entry(*w).or_default() |= b;
            m
        });
        let hits = (0..100_000u32)
            .filter(|i| {
                let [a, b, c, d] = (0x0af4_0000 + i).to_be_bytes();
                let (w, bit) = place([a, b, c, d], 8080u16.to_be_bytes(), 6);
                words.get(&w).is_some_and(|v| v & bit != 0)
            })
            .count();
        let share = set.len() as f64 / bits as f64;
        assert!((hits as f64 / 100_000.0) < share * 1.3, "{hits} of 100,000 pod flows meet a set bit, {share:.3} of the bits are set");
    }

    #[test]
    fn byte_hash_depends_on_seed_and_data() {
        assert_ne!(bytes64(0, b"10.0.0.1:80"), bytes64(1, b"10.0.0.1:80"));
        assert_ne!(bytes64(0, b"10.0.0.1:80"), bytes64(0, b"10.0.0.2:80"));
    }
}
