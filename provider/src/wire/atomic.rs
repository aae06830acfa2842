//! RFC 7306 atomic arithmetic (§5.1) and draft-ietf-storm-rdmap-ext-03's
//! Swap, as pure functions on the 64-bit target value.
//!
//! The responder reads the original value, computes the new one here, writes
//! it back and returns the original in the Atomic Response; the caller holds
//! whatever lock makes that read-modify-write atomic (RFC 7306 §5.3).

use super::{Error, Result};

/// Atomic Operation Code (AOpCode, the low 4 bits of the first word of the
/// Atomic Request header, RFC 7306 §5.2.1 Figure 5 / §10.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum AtomicOpcode {
    /// 0x0: masked FetchAdd (RFC 7306 §5.1.1).
    FetchAdd = 0x0,
    /// 0x1: Swap (draft-ietf-storm-rdmap-ext-03 §5.1.2; RFC 7306 reserves
    /// 0x1, we keep the draft's meaning as an extension).
    Swap = 0x1,
    /// 0x2: masked CmpSwap (RFC 7306 §5.1.2).
    CmpSwap = 0x2,
}

impl AtomicOpcode {
    /// Decode the 4-bit AOpCode; anything else is unsupported (RFC 7306
    /// §5.2.1 rule 4: surfaced as an error).
    pub fn from_u8(value: u8) -> Result<AtomicOpcode> {
        match value {
            0x0 => Ok(AtomicOpcode::FetchAdd),
            0x1 => Ok(AtomicOpcode::Swap),
            0x2 => Ok(AtomicOpcode::CmpSwap),
            other => Err(Error::InvalidAtomicOpcode(u32::from(other))),
        }
    }
}

/// Masked FetchAdd, RFC 7306 §5.1.1: add `add` to `original` independently
/// in each field of `add_mask`. A set mask bit marks the most significant
/// bit of a field: the carry out of that bit is discarded. A zero mask is a
/// plain 64-bit wrapping add. Returns the value to write back.
pub fn fetch_add(original: u64, add: u64, add_mask: u64) -> u64 {
    // Clearing each field's top bit in both operands lets the carry from
    // below land in that bit and stop there; the top bit's own sum is then
    // restored by XOR, which is exactly "sum without carry out".
    let low = (original & !add_mask).wrapping_add(add & !add_mask);
    low ^ ((original ^ add) & add_mask)
}

/// Masked CmpSwap, RFC 7306 §5.1.2: if `original` equals `compare` under
/// `compare_mask`, replace the bits of `swap_mask` with those of `swap`;
/// otherwise leave it. Returns the value to write back.
pub fn cmp_swap(original: u64, compare: u64, compare_mask: u64, swap: u64, swap_mask: u64) -> u64 {
    if (compare ^ original) & compare_mask == 0 {
        (original & !swap_mask) | (swap & swap_mask)
    } else {
        original
    }
}

/// Swap, draft-ietf-storm-rdmap-ext-03 §5.1.2: write `swap` unconditionally
/// (the Swap Mask is "N/A" for Swap). Returns the value to write back.
pub fn swap(_original: u64, swap: u64) -> u64 {
    swap
}

/// Apply an Atomic Request's operation to the original value, taking the
/// request header's four operand fields as they appear on the wire.
pub fn apply(
    opcode: AtomicOpcode,
    original: u64,
    add_swap: u64,
    add_swap_mask: u64,
    compare: u64,
    compare_mask: u64,
) -> u64 {
    match opcode {
        AtomicOpcode::FetchAdd => fetch_add(original, add_swap, add_swap_mask),
        AtomicOpcode::Swap => swap(original, add_swap),
        AtomicOpcode::CmpSwap => cmp_swap(original, compare, compare_mask, add_swap, add_swap_mask),
    }
}

/// RFC 7306 §5.1.1/§5.1.2/§8.2: an atomic target must be 64-bit aligned; a
/// misaligned one draws a Terminate and leaves memory untouched.
///
/// `address` is the responder's ULP buffer address the STag and TO resolve
/// to (the TO alone may be arbitrary, RFC 7306 §5.2.1).
pub fn check_alignment(address: u64) -> Result<()> {
    if address & 7 == 0 {
        Ok(())
    } else {
        Err(Error::AtomicMisaligned)
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::wire::{ErrorType, TerminateCause};
    use proptest::prelude::*;

    /// Direct transcription of the RFC 7306 §5.1.1 pseudocode.
    fn fetch_add_rfc(original: u64, add_data: u64, add_mask: u64) -> u64 {
        let mut bit_location: u64 = 1;
        let mut carry: u64 = 0;
        let mut remote: u64 = 0;
        for bit in 0..64 {
            if bit != 0 {
                bit_location <<= 1;
            }
            let val1 = (original & bit_location) >> bit;
            let val2 = (add_data & bit_location) >> bit;
            let mut sum = carry + val1 + val2;
            carry = (sum & 2) >> 1;
            sum &= 1;
            if sum != 0 {
                remote |= bit_location;
            }
            carry = u64::from(carry != 0 && (add_mask & bit_location) == 0);
        }
        remote
    }

    /// Direct transcription of the RFC 7306 §5.1.2 pseudocode.
    fn cmp_swap_rfc(
        original: u64,
        compare: u64,
        compare_mask: u64,
        swap: u64,
        swap_mask: u64,
    ) -> u64 {
        if ((compare ^ original) & compare_mask) == 0 {
            (original & !swap_mask) | (swap & swap_mask)
        } else {
            original
        }
    }

    #[test]
    fn test_fetch_add_vectors() {
        // RFC 7306 §5.1.1: mask 0 is a plain 64-bit add (wrapping).
        assert_eq!(fetch_add(1, 2, 0), 3);
        assert_eq!(fetch_add(u64::MAX, 1, 0), 0);
        // RFC 7306 §1 (discovery): FetchAdd of 0 leaves memory unchanged.
        assert_eq!(fetch_add(0xdead_beef, 0, 0), 0xdead_beef);
        // Two 32-bit fields (mask bits at 31 and 63): the low field wraps
        // without carrying into the high one.
        let mask = 0x8000_0000_8000_0000;
        assert_eq!(
            fetch_add(0x0000_0001_ffff_ffff, 1, mask),
            0x0000_0001_0000_0000
        );
        assert_eq!(
            fetch_add(0x0000_0001_0000_0002, 0x0000_0001_0000_0003, mask),
            0x0000_0002_0000_0005
        );
        // Eight byte-wide counters.
        let mask = 0x8080_8080_8080_8080;
        assert_eq!(
            fetch_add(0x01ff_0000_0000_00ff, 0x0101_0101_0101_0101, mask),
            0x0200_0101_0101_0100
        );
        // Every bit its own field: addition degenerates to XOR.
        assert_eq!(fetch_add(0b1100, 0b1010, u64::MAX), 0b0110);
    }

    #[test]
    fn test_cmp_swap_vectors() {
        // Full masks: the classic compare-and-swap.
        assert_eq!(cmp_swap(5, 5, u64::MAX, 9, u64::MAX), 9);
        assert_eq!(cmp_swap(5, 6, u64::MAX, 9, u64::MAX), 5);
        // Compare only the low byte, swap only the high byte.
        assert_eq!(
            cmp_swap(
                0x1100_0000_0000_0042,
                0xff42,
                0xff,
                0xab00_0000_0000_0000,
                0xff00_0000_0000_0000
            ),
            0xab00_0000_0000_0042
        );
        // Zero compare mask always matches.
        assert_eq!(cmp_swap(1, 2, 0, 7, u64::MAX), 7);
    }

    #[test]
    fn test_swap_and_apply() {
        assert_eq!(swap(1, 2), 2);
        assert_eq!(apply(AtomicOpcode::Swap, 1, 2, u64::MAX, 0, u64::MAX), 2);
        assert_eq!(apply(AtomicOpcode::FetchAdd, 1, 2, 0, 0, u64::MAX), 3);
        assert_eq!(apply(AtomicOpcode::CmpSwap, 1, 2, u64::MAX, 1, u64::MAX), 2);
    }

    #[test]
    fn test_opcode() {
        assert_eq!(AtomicOpcode::from_u8(0), Ok(AtomicOpcode::FetchAdd));
        assert_eq!(AtomicOpcode::from_u8(1), Ok(AtomicOpcode::Swap));
        assert_eq!(AtomicOpcode::from_u8(2), Ok(AtomicOpcode::CmpSwap));
        let err = AtomicOpcode::from_u8(3).unwrap_err();
        assert_eq!(err, Error::InvalidAtomicOpcode(3));
        // RFC 7306 §1: an unsupported atomic draws Remote Operation Error /
        // Unexpected OpCode (0x0/0x2/0x06).
        assert_eq!(
            err.terminate_cause(),
            TerminateCause {
                etype: ErrorType::RdmapRemoteOperation,
                ecode: 0x06
            }
        );
    }

    #[test]
    fn test_alignment() {
        assert_eq!(check_alignment(0x1000), Ok(()));
        let err = check_alignment(0x1004).unwrap_err();
        assert_eq!(err, Error::AtomicMisaligned);
        // RFC 7306 §8.2: Remote Operation Error, "Catastrophic error,
        // localized to RDMAP Stream" (0x0/0x2/0x07).
        assert_eq!(
            err.terminate_cause(),
            TerminateCause {
                etype: ErrorType::RdmapRemoteOperation,
                ecode: 0x07
            }
        );
    }

    proptest! {
        #[test]
        fn prop_fetch_add_matches_rfc(original: u64, add: u64, mask: u64) {
            prop_assert_eq!(fetch_add(original, add, mask), fetch_add_rfc(original, add, mask));
        }

        #[test]
        fn prop_fetch_add_sparse_masks(original: u64, add: u64, bits in proptest::collection::vec(0u32..64, 0..4)) {
            let mask = bits.iter().fold(0u64, |m, b| m | 1 << b);
            prop_assert_eq!(fetch_add(original, add, mask), fetch_add_rfc(original, add, mask));
        }

        #[test]
        fn prop_cmp_swap_matches_rfc(original: u64, compare: u64, cmask: u64, swap: u64, smask: u64, equal: bool) {
            // Half the cases compare equal so the swap branch is exercised.
            let compare = if equal { original } else { compare };
            prop_assert_eq!(
                cmp_swap(original, compare, cmask, swap, smask),
                cmp_swap_rfc(original, compare, cmask, swap, smask)
            );
        }
    }
}
