//! The agent strategy: an atomic or a Commit the peer's device lacks,
//! run by the peer's agent ([`super::agent`]); a Commit first orders
//! itself after earlier Writes with a zero-length Read.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use tracing::warn;

use provider::wr::{Remote, SendOp, WcStatus};

use super::agent::{AgentClient, FLUSH_TARGET};
use super::{Outcome, QpCore, SendRef, Step, What, NO_TOKEN};
use crate::backend::RawCompletion;
use crate::error::Error;
use crate::tracker::Held;
use crate::wire::agent::AgentOp;
use crate::wr::WorkRequest;

impl QpCore {
    /// An atomic or Commit through the peer's agent.
    pub(super) fn post_agent(
        self: &Arc<Self>,
        wr: &WorkRequest<'_>,
        w: SendRef,
        held: Held,
    ) -> std::result::Result<(), (Error, u64)> {
        let agent = self.agent.get().cloned().ok_or((
            Error::InvalidRequest("no agent channel on this connection"),
            NO_TOKEN,
        ))?;
        let (remote, op) = match wr.op {
            SendOp::FetchAdd { remote, add, mask } => (remote, AgentOp::FetchAdd { add, mask }),
            SendOp::CmpSwap {
                remote,
                compare,
                compare_mask,
                swap,
                swap_mask,
            } => (
                remote,
                AgentOp::CmpSwap {
                    compare,
                    compare_mask,
                    swap,
                    swap_mask,
                },
            ),
            SendOp::Swap { remote, swap } => (remote, AgentOp::Swap { swap }),
            // The agent's Swap, its original value dropped.
            SendOp::AtomicWrite { remote, value } => (remote, AgentOp::Swap { swap: value }),
            SendOp::Commit { remote, len } => {
                // Read-after-write: a zero-length Read returns only after
                // every earlier Write on this QP is placed; then msync.
                let ticket = self
                    .tracker
                    .insert(w.pending(Step::CommitRead { remote, len }), held);
                return self
                    .post_one(&ticket, SendOp::Read { remote }, wr.fence)
                    .map_err(|e| (e, ticket.token()));
            }
            _ => {
                return Err((
                    Error::InvalidRequest("the agent runs atomics and Commit only"),
                    NO_TOKEN,
                ))
            }
        };
        let ticket = self.tracker.insert(w.pending(Step::Agent), held);
        let client: Weak<dyn AgentClient> = Arc::downgrade(self) as Weak<QpCore>;
        agent
            .request(client, ticket.token(), remote, op)
            .map_err(|e| (e, ticket.token()))
    }

    /// The ordering Read of an emulated Commit completed: ask the agent.
    pub(super) fn commit_step(
        self: &Arc<Self>,
        rc: &RawCompletion,
        w: SendRef,
        target: (Remote, u32),
        wake: bool,
    ) {
        if rc.status != WcStatus::Success {
            return self.finish_send(&w, Outcome::failed(rc.status, rc.vendor_err), wake);
        }
        let Some(agent) = self.agent.get().cloned() else {
            return self.finish_send(&w, Outcome::failed(WcStatus::LocQpOpErr, 0), wake);
        };
        let ticket = self.tracker.insert(w.pending(Step::Agent), Held::new());
        let client: Weak<dyn AgentClient> = Arc::downgrade(self) as Weak<QpCore>;
        let (remote, len) = target;
        if let Err(e) = agent.request(client, ticket.token(), remote, AgentOp::Commit { len }) {
            warn!(qp = self.qp_num, error = %e, "commit request could not be sent");
            self.tracker.remove(ticket.token());
            self.finish_send(&w, Outcome::failed(WcStatus::LocQpOpErr, 0), wake);
        }
    }
}

impl AgentClient for QpCore {
    fn finish_agent(&self, token: u64, status: WcStatus, original: u64, vendor_err: u32) {
        let Some((p, held)) = self.tracker.remove(token) else {
            return;
        };
        let What::Send {
            op, seq, signaled, ..
        } = p.what
        else {
            return;
        };
        let mut status = status;
        if status == WcStatus::Success && self.errored.load(Ordering::Acquire) {
            // RC: once the QP is in Error, what finishes is flushed.
            status = WcStatus::WrFlushErr;
        }
        let ok = status == WcStatus::Success;
        if let SendOp::Commit { remote, .. } = op {
            if ok && original == FLUSH_TARGET {
                tracing::debug!(
                    qp = self.qp_num,
                    rkey = remote.rkey,
                    "the peer's region is a FLUSH target: later Commits are device FLUSHes"
                );
                self.flush_targets
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(remote.rkey);
            }
        }
        if ok {
            if let Some(s) = held.first() {
                let _ = s.mr().write_at(s.offset(), &original.to_ne_bytes());
            }
        }
        let w = SendRef {
            wr_id: p.wr_id,
            op,
            seq,
            signaled,
        };
        let outcome = Outcome {
            status,
            original: Some(original),
            vendor_err,
        };
        self.finish_send(&w, outcome, true);
    }
}
