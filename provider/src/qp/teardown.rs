//! Teardown: Terminate (ours and the peer's), the flush of every queue, and
//! the application's move to Error.

use tracing::warn;

use super::{Connection, CqSide, Event, InFlight, Phase, TxCursor, QN_TERMINATE};
use crate::wire::rdmap::RdmapRepr;
use crate::wire::terminate::TerminateRepr;
use crate::wire::{Error, ErrorType, TerminateCause};
use crate::wr::{WcOpcode, WcStatus};

impl Connection {
    /// Move to Error by the application's request (`ibv_modify_qp` to ERR):
    /// flush everything and close the stream.
    pub fn set_error(&mut self) {
        if !self.phase.is_error() {
            self.fail_stream();
        }
    }

    /// A local error (bad SGE at post): the QP goes to Error and the peer
    /// learns of it through a Terminate.
    pub(super) fn fail_local(&mut self) {
        self.terminate(Error::Catastrophic, &[]);
    }

    /// Move to Error without a word to the peer: flush, then close once
    /// what is framed has drained.
    pub(super) fn fail_stream(&mut self) {
        self.phase = Phase::Closing;
        self.flush();
    }

    /// Send a Terminate for `err` (copying the offending `header`), move to
    /// Error and flush.
    pub(super) fn terminate(&mut self, err: Error, header: &[u8]) {
        if self.phase.is_error() {
            return;
        }
        let cause = err.terminate_cause();
        warn!(qp = self.qp_num, error = %err, ?cause, "terminating stream");
        let mut term = TerminateRepr::for_error(&err, (!header.is_empty()).then_some(header));
        term.msn = self.next_msn(QN_TERMINATE);
        self.frame(&RdmapRepr::Terminate(term), &[]);
        self.events.push_back(Event::TerminateSent(cause));
        // The WR at the head failed because of what the peer did; the
        // statuses of the rest say they were flushed.
        self.fail_stream();
    }

    /// The peer terminated the stream.
    pub(super) fn peer_terminated(&mut self, cause: TerminateCause) {
        if self.phase.is_error() {
            return;
        }
        warn!(qp = self.qp_num, ?cause, "peer terminated the stream");
        self.events.push_back(Event::TerminateReceived(cause));
        // The oldest outstanding request is the one the peer refused.
        if let Some(head) = self.in_flight.iter_mut().find(|f| f.status.is_none()) {
            head.status = Some(status_for_remote(cause));
            head.vendor_err = pack_cause(cause);
        } else if let Some(wr) = self.sq.pop_front().map(|q| q.wr) {
            let status = status_for_remote(cause);
            self.in_flight.push_back(InFlight {
                wr_id: wr.wr_id,
                op: wr.op,
                sg_list: wr.sg_list,
                signaled: true,
                status: Some(status),
                byte_len: 0,
                vendor_err: pack_cause(cause),
                req_id: 0,
                tx_mark: 0,
            });
        }
        self.fail_stream();
    }

    /// Complete every outstanding WR: finished ones as they finished, the
    /// rest with `IBV_WC_WR_FLUSH_ERR`, each exactly once. Owed responses
    /// and commits not yet performed are dropped.
    pub(super) fn flush(&mut self) {
        let written = self.tx.written_total();
        // A segment half-placed is never finished: nothing completes it.
        self.placing = None;
        // Nor is a message that waited for a Receive.
        self.held = None;
        for f in self.in_flight.iter_mut() {
            // A Send or Write whose octets did not all reach the socket did
            // not happen as far as anyone can tell: flushed too.
            if f.status.is_none() || f.tx_mark > written {
                f.status = Some(WcStatus::WrFlushErr);
            }
            f.tx_mark = 0;
        }
        self.deliver_completions();
        while let Some(wr) = self.sq.pop_front().map(|q| q.wr) {
            self.complete_send(&wr.op, wr.wr_id, WcStatus::WrFlushErr, 0, 0);
        }
        self.cursor = TxCursor::default();
        if let Some(wr) = self.receiving.take() {
            let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
            self.completions.push_back((CqSide::Recv, wc));
        }
        while let Some(wr) = self.rq.pop_front() {
            let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
            self.completions.push_back((CqSide::Recv, wc));
        }
        self.inbound.clear();
        self.durability.clear();
        self.ord_used = 0;
    }
}

/// How a remote Terminate shows in the failed WR's status.
fn status_for_remote(cause: TerminateCause) -> WcStatus {
    match cause.etype {
        ErrorType::RdmapRemoteProtection | ErrorType::DdpTagged => WcStatus::RemAccessErr,
        ErrorType::DdpUntagged => WcStatus::RemInvReqErr,
        ErrorType::RdmapRemoteOperation => WcStatus::RemOpErr,
        _ => WcStatus::FatalErr,
    }
}

/// `layer << 16 | etype << 8 | ecode`, the WC's vendor_err for a Terminate.
fn pack_cause(cause: TerminateCause) -> u32 {
    (cause.layer() as u32) << 16 | (cause.etype.value() as u32) << 8 | cause.ecode as u32
}
