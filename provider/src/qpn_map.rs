//! Maps keyed by QP number, with a hash that costs one multiplication.
//!
//! The standard map hashes with SipHash, which resists keys chosen to
//! collide. QP numbers are handed out by this process, never chosen by a
//! peer, so they need none of that; and a QP-number lookup sits on every
//! message's path (a CQ finding the QP a completion belongs to). SipHash
//! was about 230 instructions of an 8-octet Write's round trip, for two
//! such lookups (#20).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map from QP number to `V`.
pub type QpnMap<V> = HashMap<u32, V, BuildHasherDefault<QpnHasher>>;

/// Fibonacci hashing: the key times 2⁶⁴/φ. The product's high bits (the
/// map's tag) depend on every bit of the key, and its low bits (the
/// bucket) are a bijection of the key's low bits, so consecutive numbers
/// land in distinct buckets.
#[derive(Debug, Default, Clone, Copy)]
pub struct QpnHasher(u64);

const PHI: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hasher for QpnHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(32) ^ n).wrapping_mul(PHI);
    }

    /// Any other key type: byte by byte (not used for QP numbers).
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn consecutive_numbers_spread_over_buckets_and_tags() {
        let build = BuildHasherDefault::<QpnHasher>::default();
        let hashes: Vec<u64> = (1u32..=1024).map(|n| build.hash_one(n)).collect();
        // Buckets: the low 10 bits of 1024 consecutive keys are all distinct.
        let mut low: Vec<u64> = hashes.iter().map(|h| h & 1023).collect();
        low.sort_unstable();
        low.dedup();
        assert_eq!(low.len(), 1024);
        // Tags: the top 7 bits take many values, not one.
        let mut top: Vec<u64> = hashes.iter().map(|h| h >> 57).collect();
        top.sort_unstable();
        top.dedup();
        assert!(top.len() > 100, "{} distinct tags", top.len());
    }

    #[test]
    fn a_map_finds_what_it_holds() {
        let mut m: QpnMap<u32> = QpnMap::default();
        for n in 0..5000u32 {
            m.insert(n.wrapping_mul(7919), n);
        }
        for n in 0..5000u32 {
            assert_eq!(m.get(&n.wrapping_mul(7919)), Some(&n));
        }
        assert_eq!(m.get(&1), None);
    }
}
