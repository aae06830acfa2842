//! The CmpSwap loop: an atomic the responder lacks, run as a Read of the
//! target and CmpSwaps until one sticks. Pure: it says what to post next.

use provider::wr::{Remote, SendOp};

/// One emulated atomic in flight.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CasLoop {
    pub remote: Remote,
    /// The 8-byte scratch slot the steps land in.
    pub slot: usize,
    /// The value the last CmpSwap expected (None while the Read is out).
    pub expected: Option<u64>,
}

/// What a step's result means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Done: the target held `original`, and the operation took effect.
    Done { original: u64 },
    /// Another writer got there first, or the Read came back: post this.
    Post(SendOp),
}

impl CasLoop {
    pub fn start(remote: Remote, slot: usize) -> (CasLoop, SendOp) {
        (
            CasLoop {
                remote,
                slot,
                expected: None,
            },
            SendOp::Read { remote },
        )
    }

    /// The step landed `current` in the slot; `op` is the application's.
    pub fn step(&mut self, op: &SendOp, current: u64) -> Next {
        if self.expected == Some(current) {
            // The CmpSwap stuck: `expected` was the original value.
            return Next::Done { original: current };
        }
        let new = match *op {
            SendOp::FetchAdd { add, mask, .. } => {
                provider::wire::atomic::fetch_add(current, add, mask)
            }
            SendOp::CmpSwap {
                compare,
                compare_mask,
                swap,
                swap_mask,
                ..
            } => provider::wire::atomic::cmp_swap(current, compare, compare_mask, swap, swap_mask),
            SendOp::Swap { swap, .. } => swap,
            SendOp::AtomicWrite { value, .. } => value,
            _ => current,
        };
        if new == current {
            // Nothing to write (a failed masked compare, an add of zero):
            // the value read is a valid linearisation point.
            return Next::Done { original: current };
        }
        self.expected = Some(current);
        Next::Post(SendOp::CmpSwap {
            remote: self.remote,
            compare: current,
            compare_mask: u64::MAX,
            swap: new,
            swap_mask: u64::MAX,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: Remote = Remote { addr: 8, rkey: 1 };

    #[test]
    fn a_masked_add_reads_then_swaps_then_is_done() {
        let op = SendOp::masked_fetch_add(R, 1, 1 << 8);
        let (mut l, first) = CasLoop::start(R, 0);
        assert_eq!(first, SendOp::Read { remote: R });
        // The Read found 0xff: the masked add carries no further than bit 8.
        assert_eq!(
            l.step(&op, 0xff),
            Next::Post(SendOp::cmp_swap(R, 0xff, 0x100))
        );
        // Someone else wrote 5 first: go again from 5.
        assert_eq!(l.step(&op, 5), Next::Post(SendOp::cmp_swap(R, 5, 6)));
        assert_eq!(l.step(&op, 5), Next::Done { original: 5 });
    }

    #[test]
    fn a_failed_compare_is_done_without_a_write() {
        let op = SendOp::masked_cmp_swap(R, 1, 0xf, 9, u64::MAX);
        let (mut l, _) = CasLoop::start(R, 0);
        assert_eq!(l.step(&op, 0x20), Next::Done { original: 0x20 });
    }
}
