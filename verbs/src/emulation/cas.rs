//! The CmpSwap loop: an atomic the responder lacks, run as a Read of the
//! target and CmpSwaps until one sticks. Pure: it says what to post next.

use std::sync::atomic::Ordering;

use tracing::warn;

use provider::wr::{Remote, SendOp, WcStatus};

use super::{Outcome, Pending, QpCore, SendRef, Step, What, NO_TOKEN};
use crate::backend::RawCompletion;
use crate::error::{Error, Result};
use crate::tracker::Held;
use crate::wr::WorkRequest;

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

/// The loop's posting and its steps' completions, on the QP's core.
impl QpCore {
    pub(super) fn start_cas_loop(
        &self,
        wr: &WorkRequest<'_>,
        w: SendRef,
        held: Held,
    ) -> std::result::Result<(), (Error, u64)> {
        let remote = match wr.op {
            SendOp::FetchAdd { remote, .. }
            | SendOp::CmpSwap { remote, .. }
            | SendOp::Swap { remote, .. }
            | SendOp::AtomicWrite { remote, .. } => remote,
            _ => {
                return Err((
                    Error::InvalidRequest("only atomics are emulated by a CmpSwap loop"),
                    NO_TOKEN,
                ))
            }
        };
        let slot = self.take_slot().map_err(|e| (e, NO_TOKEN))?;
        let (cas, first) = CasLoop::start(remote, slot);
        self.post_slot_step(slot, w.pending(Step::Cas(cas)), held, first, wr.fence)
    }

    /// Post `step` with scratch slot `slot` as its one SGE (the WR's own
    /// slices held alongside); on failure the slot is freed and the token
    /// returned for the rollback.
    pub(super) fn post_slot_step(
        &self,
        slot: usize,
        pending: Pending,
        mut held: Held,
        step: SendOp,
        fence: bool,
    ) -> std::result::Result<(), (Error, u64)> {
        if matches!(
            pending.what,
            What::Send {
                step: Step::Cas(_),
                ..
            }
        ) {
            self.cas_steps.fetch_add(1, Ordering::Relaxed);
        }
        let scratch = match self.scratch.slice(slot * 8, 8) {
            Ok(s) => s,
            Err(e) => {
                self.free_slot(slot);
                return Err((e, NO_TOKEN));
            }
        };
        // The scratch slot is the SGE; the application's slices follow in
        // `held` (kept alive, not posted).
        held.insert(0, scratch);
        let ticket = self.tracker.insert(pending, held);
        self.backend
            .post_send(&[ticket.send_prefix(1, step, fence)])
            .map_err(|(e, _)| {
                self.free_slot(slot);
                (e, ticket.token())
            })?;
        self.count_round_trip(&step);
        Ok(())
    }

    /// One step of a CmpSwap loop completed.
    pub(super) fn cas_step(
        &self,
        rc: &RawCompletion,
        w: SendRef,
        mut cas: CasLoop,
        held: Held,
        wake: bool,
    ) {
        if rc.status != WcStatus::Success {
            self.free_slot(cas.slot);
            return self.finish_send(&w, Outcome::failed(rc.status, rc.vendor_err), wake);
        }
        let current = self.scratch.load_u64(cas.slot * 8).unwrap_or(0);
        match cas.step(&w.op, current) {
            Next::Done { original } => {
                self.free_slot(cas.slot);
                // The application's 8-byte slice follows the scratch slot.
                if let Some(s) = held.get(1) {
                    let _ = s.mr().write_at(s.offset(), &original.to_ne_bytes());
                }
                self.finish_send(&w, Outcome::done(Some(original)), wake)
            }
            Next::Post(step) => {
                let pending = w.pending(Step::Cas(cas));
                let app: Held = held.into_iter().skip(1).collect();
                if let Err((e, token)) = self.post_slot_step(cas.slot, pending, app, step, false) {
                    warn!(qp = self.qp_num, error = %e, "emulation step could not be posted");
                    self.tracker.remove(token);
                    self.finish_send(&w, Outcome::failed(WcStatus::LocQpOpErr, 0), wake);
                }
            }
        }
    }

    /// An 8-byte scratch slot for an emulation step's result.
    pub(super) fn take_slot(&self) -> Result<usize> {
        self.free_slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or(Error::InvalidRequest(
                "too many emulated atomics outstanding on this QP",
            ))
    }

    pub(super) fn free_slot(&self, slot: usize) {
        self.free_slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(slot);
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
