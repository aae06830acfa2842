//! Work requests and what the emulation layer reports of them.

use provider::wr::{SendOp, WcStatus};

use crate::mr::Slice;

/// A send work request (`struct ibv_send_wr`). It borrows its local
/// slices: posting clones the handles it must keep (a reference count
/// each, no allocation).
#[derive(Debug, Clone, Copy)]
pub struct WorkRequest<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local buffers: gathered for Send/Write, scattered for Read, one
    /// 8-byte slice for an atomic's original value, none for Immediate
    /// Data and Commit.
    pub local: &'a [Slice],
    /// Produce a completion on success (errors always complete).
    pub signaled: bool,
    /// Wait for earlier Reads and atomics before this one starts.
    pub fence: bool,
    /// `IBV_SEND_INLINE`: the payload is copied at post time, so the
    /// local slices may be rewritten as soon as the post returns (at most
    /// [`MAX_INLINE`] bytes; Send and Write only).
    pub inline: bool,
}

/// The largest inline payload (the provider's `max_inline_data`).
pub const MAX_INLINE: usize = provider::qp::MAX_INLINE;

impl<'a> WorkRequest<'a> {
    /// A signaled WR, without fence, not inline.
    pub fn new(wr_id: u64, op: SendOp, local: &'a [Slice]) -> WorkRequest<'a> {
        WorkRequest {
            wr_id,
            op,
            local,
            signaled: true,
            fence: false,
            inline: false,
        }
    }

    /// No completion on success.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// `IBV_SEND_FENCE`.
    pub fn fenced(mut self) -> Self {
        self.fence = true;
        self
    }

    /// `IBV_SEND_INLINE`.
    pub fn inlined(mut self) -> Self {
        self.inline = true;
        self
    }
}

/// What the emulation layer has done on one connection: with all three at
/// zero, every operation so far ran natively on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct EmulationCounters {
    /// Requests this side sent to the peer's stag agent (emulated atomics
    /// and Commits).
    pub agent_requests: u64,
    /// The peer's requests this side's agent ran.
    pub agent_served: u64,
    /// Work requests the CmpSwap loop posted (its Reads and CmpSwaps).
    pub cas_steps: u64,
    /// Work requests posted to the device that wait for the responder's
    /// answer: Reads (also a Commit's ordering Read), atomics (also the
    /// CmpSwap loop's), Atomic Writes and FLUSHes. With `agent_requests`,
    /// the round trips the operations cost.
    pub device_round_trips: u64,
}

/// What RFC 7306 §1.1's probe learnt of the peer's atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerAtomics {
    /// The peer's device executes them: its stag header says so, or a
    /// FetchAdd of 0 completed.
    Native,
    /// A stag peer whose device lacks them: its agent runs them (nothing
    /// was sent).
    Agent,
    /// The peer refused the FetchAdd of 0 (RFC 7306 §1.1: "Remote Operation
    /// Error or Unexpected OpCode"). The refusal took the connection down,
    /// as any refused request does (an iWARP Terminate, an IB NAK): the QP
    /// is in Error and its other work completes with flush errors.
    Refused {
        /// The probe's completion status.
        status: WcStatus,
        /// The device's vendor error.
        vendor_err: u32,
    },
}
