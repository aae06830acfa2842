//! The receive direction: ULPDUs out of the deframer, dispatched to one
//! handler per RDMAP message.
//!
//! Every handler validates before it touches memory or queues, so that an
//! error leaves the state as it was and draws a Terminate that names the
//! offending message (RFC 5040 §7, RFC 5041 §7).

use tracing::{debug, trace};

use super::held_input::HeldInput;
use super::{
    CommitProgress, Connection, CqSide, Env, Event, Inbound, Phase, QN_REQUEST, QN_RESPONSE,
};
use crate::mem::{Access, AtomicOp, MrTable, PdId};
use crate::setup::Rtr;
use crate::wire::atomic::AtomicOpcode;
use crate::wire::ddp::{Control, Segments};
use crate::wire::rdmap::{Opcode, RdmapRepr, SendKind};
use crate::wire::stream::Deframer;
use crate::wire::{Error, TerminateCause};
use crate::wr::{sge_spans, RecvWr, SendOp, Sge, WcOpcode, WcStatus};

/// Why processing an inbound ULPDU stopped the stream.
pub(super) enum RxFail {
    /// We found an error: send a Terminate.
    Local(Error),
    /// The peer sent a Terminate.
    Remote(TerminateCause),
}

impl From<Error> for RxFail {
    fn from(e: Error) -> Self {
        RxFail::Local(e)
    }
}

type RxResult = Result<(), RxFail>;

/// How long a message may wait for a Receive before it becomes the
/// Terminate that iWARP gives it at once (`Held`). Counted from its
/// arrival, or from the last `post_recv` that let held input move on; a
/// receiver that posts no more (qperf's server when its timer ended) must
/// not keep the sender's close from it for longer. InfiniBand's RNR
/// retries wait up to about 3.4 s with a finite retry count (7 × 491 ms).
pub const HOLD_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Octets a QP reads past a message that waits for a Receive before it
/// stops reading its socket (`Held`).
pub const HELD_INPUT_MAX: usize = 16 << 20;

// The spare chunks the process keeps cover one hold's worth of input.
const _: () = assert!(super::held_input::SPARE_MAX >= HELD_INPUT_MAX);

/// Input held back because a message on QN 0 (a Send, or Immediate Data)
/// found no Receive posted: that message, whole and checked, and the
/// stream octets that followed it, not yet deframed.
///
/// InfiniBand answers such a message with an RNR NAK and the sender
/// retries; iWARP has no RNR (RFC 5041 §7.2 makes it a Terminate), so
/// programs written for InfiniBand (qperf's bandwidth tests, fio's send
/// verb) that let a sender run ahead of the Receives its peer re-posts
/// failed on stag0 with "WR flush failure". Instead, the message waits
/// for the next `post_recv` here while the driver stops reading the
/// socket: TCP's window holds the sender back, as RNR retries would.
/// Nothing of this shows on the wire. A QP on an SRQ is not held (its
/// posts do not reach the QP): it terminates as before.
///
/// The driver keeps reading into `input` up to [`HELD_INPUT_MAX`] first:
/// a peer that closes after a burst (qperf's client at the end of a
/// bandwidth test) has its FIN queued behind the burst, and a receiver
/// that stopped reading at once would never learn of the close (nor
/// report DISCONNECTED). The socket buffers of both ends together stay
/// below that on Linux (`tcp_rmem`/`tcp_wmem` maxima: 6 and 4 MiB).
#[derive(Debug)]
pub(super) struct Held {
    /// What the message drew: the Terminate it becomes if no Receive
    /// comes in time ([`Connection::expire_held`]).
    error: Error,
    ulpdu: Vec<u8>,
    /// The input behind it: a resume that holds again keeps it (and its
    /// chunks) rather than copying what is left of it (a held burst is
    /// taken one Receive at a time).
    input: HeldInput,
    /// The stream ended after `input` (the close was reported).
    eof: bool,
}

impl Connection {
    /// The byte stream broke (a reset or a socket error, not an orderly
    /// close): as [`handle_closed`](Self::handle_closed), and a fault for
    /// a QP that was running ([`Event::StreamFailed`]).
    pub fn handle_stream_failed(&mut self) {
        // Unlike an orderly close, a reset does not wait for held messages
        // to find Receives: the peer gave up on the stream (the driver's
        // bounded disconnect ends in one), so flush now.
        self.held = None;
        if !self.phase.is_error() {
            self.events.push_back(Event::StreamFailed);
        }
        self.handle_closed();
    }

    /// The byte stream closed or broke.
    pub fn handle_closed(&mut self) {
        if let Some(held) = self.held.as_mut() {
            if !held.eof && !self.phase.is_error() {
                // The messages that arrived whole before the close are
                // still delivered as Receives are posted (as the sender's
                // completions said they were sent); the close is reported
                // now, the flush follows the last of them.
                held.eof = true;
                self.events.push_back(Event::Closed);
                return;
            }
        }
        self.close_stream(true);
    }

    /// The stream is over: flush, and report it unless `report` is false
    /// (already reported while held input was still delivered).
    fn close_stream(&mut self, report: bool) {
        self.held = None;
        if !self.phase.is_error() {
            debug!(qp = self.qp_num, "stream closed by peer");
            self.flush();
        }
        self.phase = super::Phase::Closed;
        self.tx.clear();
        if report && !self.events.contains(&Event::Closed) {
            self.events.push_back(Event::Closed);
        }
    }

    /// Whether input waits for a Receive (`Held`).
    pub fn rx_held(&self) -> bool {
        self.held.is_some()
    }

    /// Whether the driver should read no more: input waits for a Receive
    /// and [`HELD_INPUT_MAX`] octets are already held behind it. Reading
    /// resumes once [`resume_held`](Self::resume_held) took them.
    pub fn rx_blocked(&self) -> bool {
        self.held
            .as_ref()
            .is_some_and(|h| h.input.len() >= HELD_INPUT_MAX)
    }

    /// Whether the rest of a message is on its way: an FPDU, or a Send of
    /// several segments, is part-way in, and nothing holds it back (no
    /// input waits for a Receive, no error). The peer's stream brings the
    /// rest whatever the application does.
    pub fn input_under_way(&self) -> bool {
        !self.phase.is_error()
            && self.held.is_none()
            && self.deframer.as_ref().is_some_and(|d| {
                d.error().is_none() && (!d.is_idle() || self.rx_send.in_progress())
            })
    }

    /// Room to read up to `want` stream octets into directly while input
    /// is held (`None` when it is not): the octets go behind the held
    /// input without a copy; [`held_filled`](Self::held_filled) says how
    /// many came.
    pub fn held_room(&mut self, want: usize) -> Option<&mut [u8]> {
        Some(self.held.as_mut()?.input.room(want))
    }

    /// `n` octets were read into the last [`held_room`](Self::held_room).
    pub fn held_filled(&mut self, n: usize) {
        if let Some(held) = self.held.as_mut() {
            held.input.filled(n);
        }
    }

    /// After a Receive was posted: process the held message and the input
    /// behind it (which may be held again at the next message without a
    /// Receive).
    pub fn resume_held(&mut self, env: &Env) {
        if self.rq.is_empty() || self.phase.is_error() {
            return;
        }
        let Some(mut held) = self.held.take() else {
            return;
        };
        match self.process_ulpdu(&held.ulpdu, env) {
            Ok(()) => {
                self.deliver_completions();
                // Chunk by chunk, until a message finds no Receive again:
                // it keeps the rest.
                loop {
                    let front = held.input.front();
                    if front.is_empty() {
                        break;
                    }
                    let taken = front.len();
                    let left = self.deframe(front, env).len();
                    held.input.consume(taken - left);
                    if let Some(again) = self.held.as_mut() {
                        again.input = std::mem::take(&mut held.input);
                        break;
                    }
                }
            }
            Err(fail) => self.fail_ulpdu(fail, &held.ulpdu),
        }
        if held.eof {
            match self.held.as_mut() {
                // Held again: the end still follows it.
                Some(again) => again.eof = true,
                None => self.close_stream(false),
            }
        }
    }

    /// The held message waited too long for a Receive (the driver's bound,
    /// [`HOLD_LIMIT`]): it draws the Terminate it would have drawn on
    /// arrival, and the input behind it is dropped with the connection.
    pub fn expire_held(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        debug!(qp = self.qp_num, "no Receive came for a held message");
        // A close read behind it was reported already, and the driver
        // shuts the errored stream.
        self.fail_ulpdu(RxFail::Local(held.error), &held.ulpdu);
    }

    /// Feed bytes received from the stream. Every byte is consumed (kept
    /// in `Held` while a message waits for a Receive).
    pub fn handle_bytes(&mut self, mut input: &[u8], env: &Env) {
        if self.held.is_none() {
            input = self.deframe(input, env);
        }
        if let Some(held) = self.held.as_mut() {
            held.input.push(input);
        }
    }

    /// Process `input`; returns what is left of it when a message came to
    /// wait for a Receive (empty otherwise).
    fn deframe<'a>(&mut self, mut input: &'a [u8], env: &Env) -> &'a [u8] {
        // The ULPDU may borrow the deframer's buffer: lend the deframer out
        // of `self` for the loop so that the handlers can take `&mut self`.
        let Some(mut deframer) = self.deframer.take() else {
            // Lent already: nothing in `receive` feeds octets back in, so
            // this is never reached; were it, the input would be kept
            // whole rather than lost.
            return input;
        };
        self.receive(&mut deframer, &mut input, env);
        self.deframer = Some(deframer);
        if self.held.is_some() {
            input
        } else {
            &[]
        }
    }

    fn receive(&mut self, deframer: &mut Deframer, input: &mut &[u8], env: &Env) {
        while !self.phase.is_error() && !input.is_empty() {
            if self.placing.is_some() {
                if deframer.external_remaining() > 0 {
                    self.place_from_input(deframer, input, env);
                    continue;
                }
            } else if self.try_begin_direct(deframer, input, env) {
                continue;
            }
            let ulpdu = match deframer.poll(input) {
                Ok(Some(u)) => u,
                Ok(None) => break,
                Err(e) => {
                    // A segment placed directly whose CRC fails is never
                    // finished (RFC 5044 §8: the stream ends here).
                    self.placing = None;
                    self.terminate(e, &[]);
                    break;
                }
            };
            if ulpdu.first().is_some_and(|c| c & 0x80 == 0) && !is_immediate_data(&ulpdu) {
                // An untagged message: back to reading all there is. Not
                // for the Immediate Data that ends a Write with Immediate:
                // a stream of those is a stream of large Writes, and
                // reading all there is after each would take the next
                // Write's payload into the read buffer and copy it out
                // again (RdmaStream's reader: 5.6% of its samples in that
                // copy, a third of what its own copy to the user costs).
                self.streaming = false;
            }
            if let Some(placing) = self.placing.take() {
                // Its trailer is in and the CRC passed: `ulpdu` is the
                // segment's header.
                self.finish_direct(placing, &ulpdu);
                self.deliver_completions();
                continue;
            }
            if let Err(fail) = self.process_ulpdu(&ulpdu, env) {
                if let (RxFail::Local(error @ Error::NoBuffer(_)), None) = (&fail, env.srq) {
                    // Wait for a Receive (see `Held`): the message was
                    // checked and changed nothing, so it is processed
                    // again as it is.
                    trace!(qp = self.qp_num, "a message waits for a Receive");
                    self.held = Some(Held {
                        error: *error,
                        ulpdu: ulpdu.to_vec(),
                        // The rest of `input` goes here (the caller's).
                        input: HeldInput::default(),
                        eof: false,
                    });
                    break;
                }
                self.fail_ulpdu(fail, &ulpdu);
                break;
            }
            self.deliver_completions();
        }
    }

    /// `ulpdu` failed: Terminate for our error, or the peer's Terminate.
    fn fail_ulpdu(&mut self, fail: RxFail, ulpdu: &[u8]) {
        match fail {
            RxFail::Local(e) => {
                // A Terminate copies the offending headers.
                let header = ulpdu.get(..ulpdu.len().min(64)).unwrap_or(&[]);
                self.terminate(e, header);
            }
            RxFail::Remote(cause) => self.peer_terminated(cause),
        }
    }

    fn process_ulpdu(&mut self, ulpdu: &[u8], env: &Env) -> RxResult {
        if !self.caps.rdmap_extensions {
            // An RFC 5040 RNIC knows opcodes 0x0–0x7 only and looks at the
            // opcode (RDMAP control, byte 1) before anything else.
            if let Some(op) = ulpdu.get(1).map(|b| b & 0x0f).filter(|op| *op >= 0x8) {
                return Err(Error::UnexpectedOpcode(op).into());
            }
        }
        let (repr, payload) = RdmapRepr::parse(ulpdu)?;
        trace!(qp = self.qp_num, ?repr, len = payload.len(), "rx");
        if let Phase::AwaitRtr(rtr) = self.phase {
            if !matches!(repr, RdmapRepr::Terminate(_)) {
                return self.on_rtr(rtr, repr, payload);
            }
        }
        match repr {
            RdmapRepr::Write { stag, to, .. } => {
                env.mem.place_tagged(stag, self.pd, to, payload)?;
                Ok(())
            }
            RdmapRepr::ReadResponse { last, stag, to } => {
                self.on_read_response(env.mem, last, stag, to, payload)
            }
            RdmapRepr::Send {
                kind,
                last,
                msn,
                mo,
                invalidate_stag,
            } => self.on_send(env, kind, last, msn, mo, invalidate_stag, payload),
            RdmapRepr::ImmediateData { se, msn } => self.on_immediate(env, se, msn, payload),
            RdmapRepr::ReadRequest {
                msn,
                sink_stag,
                sink_to,
                size,
                src_stag,
                src_to,
            } => {
                self.take_request_msn(msn)?;
                env.mem.check_remote(
                    src_stag,
                    self.pd,
                    src_to,
                    size as u64,
                    Access::REMOTE_READ,
                )?;
                self.queue_read(sink_stag, sink_to, src_stag, src_to, size);
                Ok(())
            }
            RdmapRepr::AtomicRequest {
                msn,
                opcode,
                req_id,
                stag,
                to,
                add_swap,
                add_swap_mask,
                compare,
                compare_mask,
            } => {
                self.take_request_msn(msn)?;
                let op = match opcode {
                    AtomicOpcode::FetchAdd => AtomicOp::FetchAdd {
                        add: add_swap,
                        mask: add_swap_mask,
                    },
                    AtomicOpcode::CmpSwap => AtomicOp::CmpSwap {
                        compare,
                        compare_mask,
                        swap: add_swap,
                        swap_mask: add_swap_mask,
                    },
                    AtomicOpcode::Swap => AtomicOp::Swap { swap: add_swap },
                };
                // Validate now so that the Terminate names this request;
                // execution waits for its turn among the responses.
                if to % 8 != 0 {
                    return Err(Error::AtomicMisaligned.into());
                }
                env.mem
                    .check_remote(stag, self.pd, to, 8, Access::REMOTE_ATOMIC)?;
                self.inbound.push_back(Inbound::Atomic {
                    req_id,
                    stag,
                    to,
                    op,
                });
                Ok(())
            }
            RdmapRepr::CommitRequest {
                msn,
                req_id,
                stag,
                len,
                to,
                ..
            } => {
                self.take_request_msn(msn)?;
                // A failing commit answers with a status, never a
                // Terminate: nothing is checked here.
                self.inbound.push_back(Inbound::Commit {
                    req_id,
                    stag,
                    to,
                    len,
                    progress: CommitProgress::Queued,
                });
                Ok(())
            }
            RdmapRepr::AtomicResponse {
                msn,
                req_id,
                original,
            } => self.on_atomic_response(env.mem, msn, req_id, original),
            RdmapRepr::CommitResponse {
                msn,
                req_id,
                status,
            } => self.on_commit_response(msn, req_id, status),
            RdmapRepr::Terminate(term) => Err(RxFail::Remote(term.cause)),
        }
    }

    /// Peer-to-peer responder: the first frame must be the negotiated RTR
    /// (RFC 6581 §4); it moves us to RTS.
    fn on_rtr(&mut self, rtr: Rtr, repr: RdmapRepr, payload: &[u8]) -> RxResult {
        let ok = match (rtr, &repr) {
            (Rtr::ZeroLengthWrite, RdmapRepr::Write { .. }) => payload.is_empty(),
            (Rtr::ZeroLengthRead, RdmapRepr::ReadRequest { size: 0, .. }) => true,
            (Rtr::ZeroLengthSend, RdmapRepr::Send { .. }) => payload.is_empty(),
            _ => false,
        };
        if !ok {
            return Err(Error::NoMatchingRtr.into());
        }
        self.phase = Phase::Running;
        self.events.push_back(Event::Established);
        match repr {
            RdmapRepr::ReadRequest {
                msn,
                sink_stag,
                sink_to,
                ..
            } => {
                self.take_msn(QN_REQUEST, msn)?;
                // Answered like any Read: a zero-length Read Response.
                self.queue_read(sink_stag, sink_to, 0, 0, 0);
            }
            RdmapRepr::Send { msn, .. } => {
                // Consumes its MSN but no receive buffer.
                self.rx_send.accept(msn, 0, 0, true, || Some(0))?;
            }
            _ => {}
        }
        Ok(())
    }

    /// A Read Response segment: placed across the head Read's SGEs.
    fn on_read_response(
        &mut self,
        mem: &MrTable,
        last: bool,
        stag: u32,
        to: u64,
        payload: &[u8],
    ) -> RxResult {
        if self.phase == Phase::AwaitRtrResponse {
            // The RTR Read went out before any WR, so the first Read
            // Response answers it.
            if !(last && payload.is_empty()) {
                return Err(Error::DdpBaseBounds.into());
            }
            self.phase = Phase::Running;
            self.ord_used = self.ord_used.saturating_sub(1);
            return Ok(());
        }
        let pd = self.pd;
        let head = self.response_head().ok_or(Error::UnexpectedOpcode(2))?;
        let SendOp::Read { .. } = head.op else {
            return Err(Error::UnexpectedOpcode(2).into());
        };
        let (sink_stag, sink_to) = head
            .sg_list
            .first()
            .map(|s| (s.lkey, s.addr))
            .unwrap_or((0, 0));
        if stag != sink_stag && !payload.is_empty() {
            return Err(Error::DdpInvalidStag(stag).into());
        }
        let off = to.checked_sub(sink_to).ok_or(Error::DdpBaseBounds)?;
        let end = off
            .checked_add(payload.len() as u64)
            .ok_or(Error::DdpToWrap)?;
        if end > head.byte_len as u64 {
            return Err(Error::DdpBaseBounds.into());
        }
        scatter(mem, pd, &head.sg_list, off, payload).map_err(|_| Error::DdpBaseBounds)?;
        if last {
            head.status = Some(WcStatus::Success);
            self.ord_used = self.ord_used.saturating_sub(1);
        }
        Ok(())
    }

    /// A Send segment (any of the four kinds): placed into the receive the
    /// message consumes; the last one completes it.
    #[allow(clippy::too_many_arguments)]
    fn on_send(
        &mut self,
        env: &Env,
        kind: SendKind,
        last: bool,
        msn: u32,
        mo: u32,
        invalidate_stag: u32,
        payload: &[u8],
    ) -> RxResult {
        let len = u32::try_from(payload.len()).map_err(|_| Error::MessageTooLong)?;
        let placement = self.accept_untagged(env, msn, mo, len, last)?;
        let Some(wr) = self.receiving.as_ref() else {
            return Err(Error::Catastrophic.into());
        };
        scatter(
            env.mem,
            self.pd,
            &wr.sg_list,
            placement.offset as u64,
            payload,
        )
        .map_err(|_| Error::Catastrophic)?;
        if !last {
            return Ok(());
        }
        // Invalidate before taking the receive out: if it fails, the
        // receive stays in progress and the flush completes it (it must
        // not vanish without a completion).
        let invalidates = matches!(kind, SendKind::SendInvalidate | SendKind::SendSeInvalidate);
        if invalidates {
            env.mem.remote_invalidate(invalidate_stag, self.pd)?;
        }
        let Some(wr) = self.receiving.take() else {
            return Err(Error::Catastrophic.into());
        };
        self.recycle_recv_sges(wr.sg_list);
        let mut wc = self.wc(
            wr.wr_id,
            WcStatus::Success,
            WcOpcode::Recv,
            placement.message_len,
        );
        wc.solicited = matches!(kind, SendKind::SendSe | SendKind::SendSeInvalidate);
        if invalidates {
            wc.invalidated_rkey = Some(invalidate_stag);
        }
        self.completions.push_back((CqSide::Recv, wc));
        Ok(())
    }

    /// RFC 7306 Immediate Data: 8 bytes that consume a receive (and place
    /// nothing in it).
    fn on_immediate(&mut self, env: &Env, se: bool, msn: u32, payload: &[u8]) -> RxResult {
        let imm: [u8; 8] = payload
            .try_into()
            .map_err(|_| Error::RdmapMalformed("Immediate Data must carry 8 bytes"))?;
        if self.rx_send.in_progress() {
            // A Send is half-way: messages are not interleaved.
            return Err(Error::MsnRange(msn).into());
        }
        self.accept_untagged(env, msn, 0, 0, true)?;
        let Some(wr) = self.receiving.take() else {
            return Err(Error::Catastrophic.into());
        };
        self.recycle_recv_sges(wr.sg_list);
        let mut wc = self.wc(wr.wr_id, WcStatus::Success, WcOpcode::RecvImm, 0);
        wc.imm = Some(u64::from_be_bytes(imm));
        wc.solicited = se;
        self.completions.push_back((CqSide::Recv, wc));
        Ok(())
    }

    /// Check one segment on QN 0 (MSN, MO, room in the buffer); its first
    /// segment takes a receive into `receiving`.
    fn accept_untagged(
        &mut self,
        env: &Env,
        msn: u32,
        mo: u32,
        len: u32,
        last: bool,
    ) -> Result<crate::wire::ddp::Placement, Error> {
        let (rq, spent) = (&mut self.rq, &mut self.srq_spent);
        let mut taken: Option<RecvWr> = None;
        let placement = self.rx_send.accept(msn, mo, len, last, || {
            let wr = match env.srq {
                Some(srq) => srq.take(spent),
                None => rq.pop_front(),
            }?;
            let capacity: u64 = wr.sg_list.iter().map(|s| s.length as u64).sum();
            taken = Some(wr);
            Some(u32::try_from(capacity).unwrap_or(u32::MAX))
        });
        // A receive taken by a failing first segment belongs to the failed
        // message: the flush completes it.
        if let Some(wr) = taken {
            self.receiving = Some(wr);
        }
        placement
    }

    /// An Atomic Response: the original value lands in the head atomic's
    /// SGE (an Atomic Write, sent as Swap, drops it).
    fn on_atomic_response(
        &mut self,
        mem: &MrTable,
        msn: u32,
        req_id: u32,
        original: u64,
    ) -> RxResult {
        self.take_msn(QN_RESPONSE, msn)?;
        let pd = self.pd;
        let head = self.response_head().ok_or(Error::UnexpectedOpcode(0xb))?;
        let is_atomic = matches!(
            head.op,
            SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. } | SendOp::Swap { .. }
        );
        let is_write = matches!(head.op, SendOp::AtomicWrite { .. });
        if !(is_atomic || is_write) || head.req_id != req_id {
            return Err(Error::UnexpectedOpcode(0xb).into());
        }
        if is_atomic {
            // The original value lands in host order, as libibverbs
            // delivers it.
            scatter(mem, pd, &head.sg_list, 0, &original.to_ne_bytes())
                .map_err(|_| Error::Catastrophic)?;
            head.byte_len = 8;
        }
        head.status = Some(WcStatus::Success);
        self.ord_used = self.ord_used.saturating_sub(1);
        Ok(())
    }

    /// A Commit Response: the head Commit completes with its status.
    fn on_commit_response(&mut self, msn: u32, req_id: u32, status: u32) -> RxResult {
        self.take_msn(QN_RESPONSE, msn)?;
        let head = self.response_head().ok_or(Error::UnexpectedOpcode(0xd))?;
        if !matches!(head.op, SendOp::Commit { .. }) || head.req_id != req_id {
            return Err(Error::UnexpectedOpcode(0xd).into());
        }
        head.status = Some(if status == 0 {
            WcStatus::Success
        } else {
            WcStatus::RemOpErr
        });
        head.vendor_err = status;
        head.byte_len = 0;
        self.ord_used = self.ord_used.saturating_sub(1);
        Ok(())
    }

    /// Queue a Read's responses (the request was checked).
    fn queue_read(&mut self, sink_stag: u32, sink_to: u64, src_stag: u32, src_to: u64, size: u32) {
        // A zero payload per segment never happens: max_segment >= 1.
        let mulpdu = self.caps.max_segment as usize + crate::wire::ddp::TAGGED_HEADER_LEN;
        let Some(segments) = Segments::new(size, mulpdu, crate::wire::ddp::TAGGED_HEADER_LEN)
        else {
            return;
        };
        self.inbound.push_back(Inbound::Read {
            sink_stag,
            sink_to,
            src_stag,
            src_to,
            segments,
        });
    }

    /// Check and advance the expected MSN of QN 1, and the IRD: one more
    /// request must fit.
    fn take_request_msn(&mut self, msn: u32) -> Result<(), Error> {
        self.take_msn(QN_REQUEST, msn)?;
        if self.inbound.len() >= self.neg.ird as usize {
            return Err(Error::IrdExceeded);
        }
        Ok(())
    }

    /// Check and advance the expected MSN of QN 1 or 3.
    fn take_msn(&mut self, qn: usize, msn: u32) -> Result<(), Error> {
        if msn != self.rx_msn[qn] {
            return Err(Error::MsnRange(msn));
        }
        self.rx_msn[qn] = msn.wrapping_add(1);
        Ok(())
    }

    /// The response at the head of the outstanding requests.
    pub(super) fn response_head(&mut self) -> Option<&mut super::InFlight> {
        self.in_flight.iter_mut().find(|f| f.status.is_none())
    }
}

/// Scatter `data` at message offset `off` across `sges`.
fn scatter(mem: &MrTable, pd: PdId, sges: &[Sge], off: u64, mut data: &[u8]) -> Result<(), Error> {
    for (sge, off, n) in sge_spans(sges, off, data.len() as u64) {
        // At most `data.len()`.
        let (part, rest) = data.split_at(n as usize);
        mem.write_local(sge.lkey, pd, sge.addr + off, part)?;
        data = rest;
    }
    if data.is_empty() {
        Ok(())
    } else {
        Err(Error::MessageTooLong)
    }
}

/// Whether `ulpdu` (untagged) is an Immediate Data message (RFC 7306).
fn is_immediate_data(ulpdu: &[u8]) -> bool {
    let [a, b, ..] = *ulpdu else {
        return false;
    };
    let opcode = Control::from_bytes([a, b]).opcode();
    opcode == Opcode::ImmediateData as u8 || opcode == Opcode::ImmediateDataSe as u8
}
