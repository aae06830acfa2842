//! The mailbox strategy: 8-byte Immediate Data (RFC 7306) where the
//! device has none, as a Write of a mailbox entry the peer's agent reads
//! and a zero-length Send that consumes the peer's receive.

use smallvec::{smallvec, SmallVec};

use provider::wr::{SendOp, WcStatus};

use super::inline::Inline;
use super::{QpCore, SendRef, Step, NO_TOKEN};
use crate::backend::RawCompletion;
use crate::cq::{Completion, CompletionKind};
use crate::error::Error;
use crate::tracker::{Held, Ticket};
use crate::wr::WorkRequest;

/// One device WR of an emulated Immediate Data.
struct Part<'a> {
    op: SendOp,
    held: Held,
    /// The inline bounce slot this part's entry frees.
    bounce: Option<usize>,
    /// The inline payload it carries, for a backend that copies it.
    inline: Option<&'a Inline>,
    /// It carries the application's completion.
    last: bool,
}

impl QpCore {
    /// 8-byte Immediate Data through the peer's mailbox: (the Write, for
    /// Write with Immediate,) the mailbox entry, then a zero-length Send
    /// that consumes the peer's receive. The last one carries the WR's
    /// completion; the others complete silently unless they fail. All
    /// three share the WR's place in the send queue's order.
    pub(super) fn post_imm(
        &self,
        wr: &WorkRequest<'_>,
        w: SendRef,
        held: Held,
        bounce: Option<usize>,
        inline: Option<&Inline>,
    ) -> std::result::Result<(), (Error, u64)> {
        let agent = self.agent.get().cloned().ok_or((
            Error::InvalidRequest("no agent channel on this connection"),
            NO_TOKEN,
        ))?;
        let (imm, solicited) = match wr.op {
            SendOp::Imm { imm, solicited } => (imm, solicited),
            SendOp::WriteImm { imm, .. } => (imm, false),
            _ => {
                return Err((
                    Error::InvalidRequest("only Immediate Data goes through the mailbox"),
                    NO_TOKEN,
                ))
            }
        };
        let mut steps: SmallVec<[Part; 3]> = SmallVec::new();
        if let SendOp::WriteImm { remote, .. } = wr.op {
            // The Write carries the application's bytes: an inline bounce
            // slot is its to free, an inline payload its to post.
            steps.push(Part {
                op: SendOp::Write { remote },
                held,
                bounce,
                inline,
                last: false,
            });
        }
        // Numbered among all zero-length Sends, under the lock that keeps
        // the numbering in wire order.
        let mut zero_sends = agent.zero_sends.lock().unwrap_or_else(|p| p.into_inner());
        let (entry, mailbox) = agent
            .stage_imm(*zero_sends, imm, solicited)
            .map_err(|e| (e, NO_TOKEN))?;
        steps.push(Part {
            op: SendOp::Write { remote: mailbox },
            held: smallvec![entry],
            bounce: None,
            inline: None,
            last: false,
        });
        steps.push(Part {
            op: SendOp::Send {
                solicited,
                invalidate: None,
            },
            held: Held::new(),
            bounce: None,
            inline: None,
            last: true,
        });
        let mut tickets: SmallVec<[(Ticket, SendOp, Option<&Inline>); 3]> = SmallVec::new();
        for part in steps {
            let kind = if part.last { Step::Final } else { Step::Silent };
            let ticket = self.tracker.insert(w.holding(kind, part.bounce), part.held);
            tickets.push((ticket, part.op, part.inline));
        }
        let posts: SmallVec<[_; 3]> = tickets
            .iter()
            .map(|(t, op, inline)| match inline {
                Some(data) => t.send_inline(*op, wr.fence, data.bytes()),
                None => t.send(*op, wr.fence),
            })
            .collect();
        if let Err((e, n)) = self.backend.post_send(&posts) {
            // Those posted complete (silently, or flushed); the rest go.
            for (t, _, _) in tickets.iter().skip(n + 1) {
                self.tracker.remove(t.token());
            }
            return Err((e, tickets[n].0.token()));
        }
        *zero_sends += 1;
        Ok(())
    }

    /// A receive completed.
    pub(super) fn recv_completion(&self, wr_id: u64, rc: &RawCompletion) -> Completion {
        let ok = rc.status == WcStatus::Success;
        // A zero-length receive may be Immediate Data that came through
        // the mailbox.
        let (imm, solicited) = match (rc.imm, self.agent.get()) {
            (None, Some(agent)) if ok && rc.byte_len == 0 => match agent.zero_length_recv() {
                Some((imm, solicited)) => (Some(imm), solicited || rc.solicited),
                None => (None, rc.solicited),
            },
            (imm, _) => (imm, rc.solicited),
        };
        self.completion(
            wr_id,
            rc.status,
            CompletionKind::Recv {
                len: rc.byte_len,
                imm,
                invalidated: rc.invalidated,
                solicited,
            },
            rc.vendor_err,
        )
    }
}
