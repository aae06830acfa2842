//! The sans-IO RDMAP stream: one reliable-connected queue pair over one
//! byte stream.
//!
//! No sockets, no threads, no clock: bytes come in through
//! [`Connection::handle_bytes`], bytes to send come out of
//! [`Connection::poll_transmit`], and the results appear through
//! [`Connection::poll_completion`] and [`Connection::poll_event`]. Memory is
//! reached only through the [`MrTable`] passed in each call. Drivers drain
//! the outputs in that order after every input (quinn-proto's contract).
//!
//! Ordering follows RFC 5040 §5 and RFC 7306 §7: messages leave in posting
//! order; send-queue completions are delivered in posting order, so a Write
//! posted after a Read completes after it; inbound Read, atomic and Commit
//! requests are answered in the order they arrived.

use std::collections::VecDeque;

use tracing::{debug, trace, warn};

use crate::mem::{AtomicOp, MrTable, PdId};
use crate::setup::{Negotiated, Rtr};
use crate::srq::{PostRecvError, Srq};
use crate::wire::atomic::AtomicOpcode;
use crate::wire::marker::{Deframer, DeframerConfig, Framer, FramerConfig};
use crate::wire::rdmap::{RdmapRepr, SendKind};
use crate::wire::terminate::TerminateRepr;
use crate::wire::{Error, ErrorType, TerminateCause};
use crate::wr::{RecvWr, Remote, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion};

/// Queue pair states (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// `IBV_QPS_RTR`: the MPA exchange is under way or the RTR frame has not
    /// arrived yet; receives may be posted, nothing is sent.
    Rtr,
    /// `IBV_QPS_RTS`: fully operational.
    Rts,
    /// `IBV_QPS_ERR`: terminated; every WR completes with a flush error.
    Error,
}

/// Limits of one queue pair (`struct ibv_qp_cap` plus iWARP's IRD/ORD).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send WR.
    pub max_send_sge: u32,
    /// SGEs per receive WR.
    pub max_recv_sge: u32,
    /// Largest ULPDU payload we put in one FPDU (an MULPDU).
    pub max_segment: u32,
    /// Execute and send the RDMAP extensions: RFC 7306 Atomics and
    /// Immediate Data, and Commit (opcodes 0x8–0xD). `false` makes the QP
    /// an RFC 5040 RNIC, as kernel siw is: posting one fails, and an
    /// inbound one draws a Terminate (RDMAP, remote operation, Unexpected
    /// OpCode) — what RFC 7306 §1.1's probe of a peer meets.
    pub rdmap_extensions: bool,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 1024,
            max_recv_wr: 1024,
            max_send_sge: 8,
            max_recv_sge: 8,
            // ULPDU_Length is 16 bits: keep the whole ULPDU (header and
            // payload) below 64 KiB, as siw does with its MSS-sized FPDUs.
            max_segment: 65536 - 512,
            rdmap_extensions: true,
        }
    }
}

/// Which completion queue a completion belongs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqSide {
    /// The send CQ.
    Send,
    /// The receive CQ.
    Recv,
}

/// Connection-level events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The stream is in RTS.
    Established,
    /// We sent a Terminate: our side found the error.
    TerminateSent(TerminateCause),
    /// The peer sent a Terminate.
    TerminateReceived(TerminateCause),
    /// The byte stream closed (by the peer or after a Terminate).
    Closed,
}

/// Why a post was refused outright (nothing was queued).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PostError {
    /// The send queue is full.
    #[error("send queue full ({0} WRs)")]
    SendQueueFull(u32),
    /// A receive error.
    #[error(transparent)]
    Recv(#[from] PostRecvError),
    /// More SGEs than the queue allows.
    #[error("too many SGEs: {0} > {1}")]
    TooManySges(usize, u32),
    /// The QP takes its receives from an SRQ.
    #[error("QP uses a shared receive queue")]
    HasSrq,
    /// An atomic or Immediate Data with the wrong local buffer size.
    #[error("invalid work request: {0}")]
    Invalid(&'static str),
}

/// A send WR that left (or is leaving) and waits to complete in order.
#[derive(Debug)]
struct InFlight {
    wr_id: u64,
    op: SendOp,
    sg_list: Vec<Sge>,
    signaled: bool,
    /// `Some` once its outcome is known.
    status: Option<WcStatus>,
    byte_len: u32,
    vendor_err: u32,
    /// Responses only: which request this is, and for Reads how many bytes
    /// have been placed.
    req_id: u32,
    placed: u64,
}

/// The send queue's progress on the WR at its head.
#[derive(Debug, Default, Clone, Copy)]
struct TxCursor {
    /// Bytes of the current message already segmented.
    offset: u64,
    /// For WriteImm: the Write part is done, the Immediate Data is next.
    write_done: bool,
}

/// An inbound request we owe a response to.
#[derive(Debug)]
enum Inbound {
    Read {
        sink_stag: u32,
        sink_to: u64,
        src_stag: u32,
        src_to: u64,
        size: u32,
        sent: u32,
    },
    Atomic {
        req_id: u32,
        stag: u32,
        to: u64,
        op: AtomicOp,
    },
    Commit {
        req_id: u32,
        stag: u32,
        to: u64,
        len: u32,
    },
}

/// A receive in progress on QN 0.
#[derive(Debug)]
struct Receiving {
    msn: u32,
    wr: RecvWr,
    capacity: u64,
    /// Highest byte end placed so far.
    len: u64,
}

/// One RDMAP stream and its queues.
#[derive(Debug)]
pub struct Connection {
    qp_num: u32,
    pd: PdId,
    caps: QpCaps,
    state: QpState,
    neg: Negotiated,
    /// Peer-to-peer responder: the RTR frame is still to come.
    await_rtr: bool,
    /// Initiator in peer-to-peer mode: the RTR frame is still to send.
    rtr_to_send: bool,
    deframer: Deframer,
    framer: Framer,
    /// Framed bytes not yet handed to the driver.
    tx: Vec<u8>,
    /// Reused for building headers and gathering payloads.
    scratch: Vec<u8>,

    sq: VecDeque<SendWr>,
    cursor: TxCursor,
    in_flight: VecDeque<InFlight>,
    /// Requests awaiting a response (ORD credits in use).
    ord_used: u16,
    next_req_id: u32,
    /// Internal zero-length Read (RTR) awaiting its response.
    rtr_read_pending: bool,

    rq: VecDeque<RecvWr>,
    has_srq: bool,
    receiving: Option<Receiving>,

    inbound: VecDeque<Inbound>,

    // Next MSN to send on QN 0, 1, 3 and to expect on them.
    tx_msn: [u32; 4],
    rx_msn: [u32; 4],

    completions: VecDeque<(CqSide, WorkCompletion)>,
    events: VecDeque<Event>,
    /// The stream should be closed once `tx` is drained.
    close_after_tx: bool,
}

/// Everything outside the connection it may touch.
pub struct Env<'a> {
    /// The device's registrations.
    pub mem: &'a MrTable,
    /// The SRQ this QP draws receives from, if any.
    pub srq: Option<&'a Srq>,
}

/// Room for the longest DDP+RDMAP header (an Atomic Request, or a
/// Terminate with copied headers).
const MAX_HEADER_LEN: usize = 128;

/// The largest payload per FPDU: the 16-bit ULPDU_Length less the longest
/// header that carries a payload.
const MAX_SEGMENT: u32 = u16::MAX as u32 - MAX_HEADER_LEN as u32;

const QN_SEND: usize = 0;
const QN_REQUEST: usize = 1;
const QN_TERMINATE: usize = 2;
const QN_RESPONSE: usize = 3;

impl Connection {
    /// A connection whose MPA exchange has completed with `neg`; `leftover`
    /// are stream bytes that followed the MPA frame.
    pub fn new(
        qp_num: u32,
        pd: PdId,
        mut caps: QpCaps,
        neg: Negotiated,
        has_srq: bool,
    ) -> Connection {
        // A zero segment size would never make progress (and loop in
        // poll_transmit); above the 16-bit ULPDU limit every frame fails.
        caps.max_segment = caps.max_segment.clamp(1, MAX_SEGMENT);
        let mut c = Connection {
            qp_num,
            pd,
            caps,
            state: QpState::Rtr,
            deframer: Deframer::new(DeframerConfig {
                crc: neg.crc,
                markers: neg.markers_rx,
                // Peers (siw among them) may send FPDUs up to the 16-bit
                // ULPDU_Length limit whatever we segment at ourselves.
                max_ulpdu_len: u16::MAX,
            }),
            framer: Framer::new(FramerConfig {
                crc: neg.crc,
                markers: neg.markers_tx,
            }),
            await_rtr: !neg.initiator && neg.rtr.is_some(),
            rtr_to_send: neg.initiator && neg.rtr.is_some(),
            neg,
            tx: Vec::with_capacity(64 * 1024),
            scratch: Vec::with_capacity(64 * 1024),
            sq: VecDeque::new(),
            cursor: TxCursor::default(),
            in_flight: VecDeque::new(),
            ord_used: 0,
            next_req_id: 1,
            rtr_read_pending: false,
            rq: VecDeque::new(),
            has_srq,
            receiving: None,
            inbound: VecDeque::new(),
            tx_msn: [1; 4],
            rx_msn: [1; 4],
            completions: VecDeque::new(),
            events: VecDeque::new(),
            close_after_tx: false,
        };
        if !c.await_rtr {
            c.state = QpState::Rts;
            c.events.push_back(Event::Established);
        }
        c
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// What the MPA exchange settled.
    pub fn negotiated(&self) -> &Negotiated {
        &self.neg
    }

    /// Whether the driver should close the stream once it has written
    /// everything [`poll_transmit`](Self::poll_transmit) gave it.
    pub fn wants_close(&self) -> bool {
        self.close_after_tx && self.tx.is_empty()
    }

    // ---- application commands ----

    /// `ibv_post_send`. In Error state the WR is accepted and completes with
    /// a flush error, as libibverbs does.
    pub fn post_send(&mut self, wr: SendWr, env: &Env) -> Result<(), PostError> {
        if wr.sg_list.len() > self.caps.max_send_sge as usize {
            return Err(PostError::TooManySges(
                wr.sg_list.len(),
                self.caps.max_send_sge,
            ));
        }
        if self.sq.len() + self.in_flight.len() >= self.caps.max_send_wr as usize {
            return Err(PostError::SendQueueFull(self.caps.max_send_wr));
        }
        let atomic = matches!(
            wr.op,
            SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. } | SendOp::Swap { .. }
        );
        if matches!(wr.op, SendOp::AtomicWrite { .. }) && !wr.sg_list.is_empty() {
            return Err(PostError::Invalid(
                "an Atomic Write carries its value in the WR, not in SGEs",
            ));
        }
        let extension = atomic
            || matches!(
                wr.op,
                SendOp::Imm { .. }
                    | SendOp::WriteImm { .. }
                    | SendOp::Commit { .. }
                    | SendOp::AtomicWrite { .. }
            );
        if extension && !self.caps.rdmap_extensions {
            return Err(PostError::Invalid(
                "this QP runs RFC 5040 only (no Atomics, Immediate Data or Commit)",
            ));
        }
        if atomic && (wr.sg_list.len() != 1 || wr.sg_list[0].length != 8) {
            return Err(PostError::Invalid(
                "an atomic needs one 8-byte SGE for the result",
            ));
        }
        let total: u64 = wr.sg_list.iter().map(|s| s.length as u64).sum();
        if total > u32::MAX as u64 {
            return Err(PostError::Invalid(
                "a message is at most 2^32 - 1 bytes long",
            ));
        }
        if matches!(wr.op, SendOp::Imm { .. } | SendOp::Commit { .. }) && !wr.sg_list.is_empty() {
            return Err(PostError::Invalid(
                "Immediate Data and Commit carry no SGEs",
            ));
        }
        if wr.op.needs_response() && self.neg.ord == 0 && self.state != QpState::Error {
            return Err(PostError::Invalid(
                "the connection negotiated ORD 0: no Read, atomic or Commit",
            ));
        }
        if self.state == QpState::Error {
            self.complete_send(&wr.op, wr.wr_id, WcStatus::WrFlushErr, 0, 0);
            return Ok(());
        }
        // Local protection is checked at post time so that a bad SGE fails
        // its own WR before anything of it reaches the wire.
        let write = matches!(
            wr.op,
            SendOp::Read { .. }
                | SendOp::FetchAdd { .. }
                | SendOp::CmpSwap { .. }
                | SendOp::Swap { .. }
        );
        for sge in &wr.sg_list {
            if env
                .mem
                .check_local(sge.lkey, self.pd, sge.addr, sge.length as u64, write)
                .is_err()
            {
                self.complete_send(&wr.op, wr.wr_id, WcStatus::LocProtErr, 0, 0);
                self.fail_local();
                return Ok(());
            }
        }
        self.sq.push_back(wr);
        Ok(())
    }

    /// `ibv_post_recv`.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        if self.has_srq {
            return Err(PostError::HasSrq);
        }
        if wr.sg_list.len() > self.caps.max_recv_sge as usize {
            return Err(PostRecvError::TooManySges(
                wr.sg_list.len(),
                self.caps.max_recv_sge as usize,
            )
            .into());
        }
        if self.rq.len() >= self.caps.max_recv_wr as usize {
            return Err(PostRecvError::Full(self.caps.max_recv_wr as usize).into());
        }
        if self.state == QpState::Error {
            self.completions.push_back((
                CqSide::Recv,
                self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0),
            ));
            return Ok(());
        }
        self.rq.push_back(wr);
        Ok(())
    }

    /// Move to Error by the application's request (`ibv_modify_qp` to ERR):
    /// flush everything and close the stream.
    pub fn set_error(&mut self) {
        if self.state != QpState::Error {
            self.state = QpState::Error;
            self.flush();
            self.close_after_tx = true;
        }
    }

    // ---- inputs ----

    /// The byte stream closed or broke.
    pub fn handle_closed(&mut self) {
        if self.state != QpState::Error {
            debug!(qp = self.qp_num, "stream closed by peer");
            self.state = QpState::Error;
            self.flush();
        }
        self.tx.clear();
        self.close_after_tx = true;
        if !self.events.contains(&Event::Closed) {
            self.events.push_back(Event::Closed);
        }
    }

    /// Feed bytes received from the stream. Every byte is consumed.
    pub fn handle_bytes(&mut self, mut input: &[u8], env: &Env) {
        while self.state != QpState::Error && !input.is_empty() {
            let ulpdu = match self.deframer.poll(&mut input) {
                Ok(Some(u)) => u,
                Ok(None) => break,
                Err(e) => {
                    self.terminate(e, &[]);
                    break;
                }
            };
            // The ULPDU may borrow the deframer's buffer; copy the header
            // aside only when a Terminate needs it.
            let res = Self::process_ulpdu(
                &ulpdu,
                ProcessCtx {
                    conn_pd: self.pd,
                    env,
                    extensions: self.caps.rdmap_extensions,
                },
                &mut RxState {
                    state: &mut self.state,
                    await_rtr: &mut self.await_rtr,
                    rx_msn: &mut self.rx_msn,
                    in_flight: &mut self.in_flight,
                    ord_used: &mut self.ord_used,
                    rtr_read_pending: &mut self.rtr_read_pending,
                    rq: &mut self.rq,
                    receiving: &mut self.receiving,
                    inbound: &mut self.inbound,
                    completions: &mut self.completions,
                    events: &mut self.events,
                    qp_num: self.qp_num,
                    ird: self.neg.ird,
                    rtr: self.neg.rtr,
                },
            );
            if let Err(fail) = res {
                let header: Vec<u8> = ulpdu.get(..ulpdu.len().min(64)).unwrap_or(&[]).to_vec();
                match fail {
                    RxFail::Local(e) => self.terminate(e, &header),
                    RxFail::Remote(cause) => self.peer_terminated(cause),
                }
                break;
            }
            self.deliver_completions();
        }
    }

    // ---- outputs ----

    /// Append up to about `max` bytes of framed stream data to `out`.
    /// Returns whether anything was added.
    pub fn poll_transmit(&mut self, env: &Env, out: &mut Vec<u8>, max: usize) -> bool {
        let start = out.len();
        // Frame straight into the caller's buffer rather than copying out
        // of `tx`: the two trade places for the call.
        let mut own = std::mem::replace(&mut self.tx, std::mem::take(out));
        self.tx.append(&mut own);
        self.transmit_into(env, start, max);
        *out = std::mem::replace(&mut self.tx, own);
        out.len() > start
    }

    /// [`poll_transmit`](Self::poll_transmit)'s work, framing into `tx`
    /// until it holds `max` bytes past `start`.
    fn transmit_into(&mut self, env: &Env, start: usize, max: usize) {
        if self.state == QpState::Error {
            return;
        }
        if self.rtr_to_send {
            self.rtr_to_send = false;
            self.send_rtr();
        }
        if self.await_rtr {
            return;
        }
        while self.tx.len() - start < max && self.state != QpState::Error {
            if !(self.transmit_inbound(env) || self.transmit_sq(env)) {
                break;
            }
        }
        self.deliver_completions();
    }

    /// The next completion, with the CQ it belongs on.
    pub fn poll_completion(&mut self) -> Option<(CqSide, WorkCompletion)> {
        self.completions.pop_front()
    }

    /// The next connection event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Whether the connection has work it could transmit now.
    pub fn has_pending_tx(&self) -> bool {
        !self.tx.is_empty()
            || self.rtr_to_send
            || (self.state == QpState::Rts && (!self.inbound.is_empty() || self.sq_can_progress()))
    }

    fn sq_can_progress(&self) -> bool {
        match self.sq.front() {
            None => false,
            Some(wr) => {
                !(wr.op.needs_response()
                    && self.ord_used >= self.neg.ord
                    && self.cursor.offset == 0)
            }
        }
    }

    // ---- transmit ----

    /// Frame one ULPDU (header from `repr`, then `payload`) into `tx`.
    fn frame(&mut self, repr: &RdmapRepr, payload: &[u8]) {
        let hlen = repr.header_len();
        let mut header = [0u8; MAX_HEADER_LEN];
        repr.emit(&mut header[..hlen]);
        if let Err(e) = self.framer.frame(&[&header[..hlen], payload], &mut self.tx) {
            // Segments are sized below the framer's limit; reaching this is
            // a bug, and the stream cannot continue without the frame.
            warn!(qp = self.qp_num, error = %e, "cannot frame a ULPDU");
            self.state = QpState::Error;
            self.flush();
            self.close_after_tx = true;
        }
    }

    fn send_rtr(&mut self) {
        match self.neg.rtr {
            Some(Rtr::ZeroLengthWrite) => {
                // siw sends its RTR as a zero-length Write to STag 1, TO 0.
                self.frame(
                    &RdmapRepr::Write {
                        last: true,
                        stag: 1,
                        to: 0,
                    },
                    &[],
                );
            }
            Some(Rtr::ZeroLengthRead) => {
                let msn = self.next_msn(QN_REQUEST);
                self.rtr_read_pending = true;
                self.ord_used += 1;
                self.frame(
                    &RdmapRepr::ReadRequest {
                        msn,
                        // As siw_qp_mpa_rts builds it: a zero-length SGE with
                        // lkey 0 is the sink, STag 1 the source.
                        sink_stag: 0,
                        sink_to: 0,
                        size: 0,
                        src_stag: 1,
                        src_to: 0,
                    },
                    &[],
                );
            }
            Some(Rtr::ZeroLengthSend) => {
                let msn = self.next_msn(QN_SEND);
                self.frame(
                    &RdmapRepr::Send {
                        kind: SendKind::Send,
                        last: true,
                        msn,
                        mo: 0,
                        invalidate_stag: 0,
                    },
                    &[],
                );
            }
            None => {}
        }
    }

    fn next_msn(&mut self, qn: usize) -> u32 {
        let m = self.tx_msn[qn];
        self.tx_msn[qn] = m.wrapping_add(1);
        m
    }

    /// Answer the oldest inbound request (or the next segment of it).
    fn transmit_inbound(&mut self, env: &Env) -> bool {
        let Some(head) = self.inbound.front_mut() else {
            return false;
        };
        match head {
            Inbound::Read {
                sink_stag,
                sink_to,
                src_stag,
                src_to,
                size,
                sent,
            } => {
                let chunk = (*size - *sent).min(self.caps.max_segment);
                let last = *sent + chunk == *size;
                // The sink TO is the peer's to check (it draws a tagged
                // TO-wrap or bounds error there); it may wrap here.
                let (sink_stag, to, src_stag, src) = (
                    *sink_stag,
                    sink_to.wrapping_add(*sent as u64),
                    *src_stag,
                    src_to.wrapping_add(*sent as u64),
                );
                *sent += chunk;
                let mut payload = std::mem::take(&mut self.scratch);
                fit(&mut payload, chunk as usize);
                if let Err(e) = env.mem.read_remote(src_stag, self.pd, src, &mut payload) {
                    // Checked on arrival; it can only fail now if the region
                    // was deregistered meanwhile.
                    self.scratch = payload;
                    self.terminate(e, &[]);
                    return true;
                }
                self.frame(
                    &RdmapRepr::ReadResponse {
                        last,
                        stag: sink_stag,
                        to,
                    },
                    &payload,
                );
                self.scratch = payload;
                if last {
                    self.inbound.pop_front();
                }
            }
            Inbound::Atomic {
                req_id,
                stag,
                to,
                op,
            } => {
                let (req_id, stag, to, op) = (*req_id, *stag, *to, *op);
                self.inbound.pop_front();
                match env.mem.atomic(stag, self.pd, to, op) {
                    Ok(original) => {
                        let msn = self.next_msn(QN_RESPONSE);
                        self.frame(
                            &RdmapRepr::AtomicResponse {
                                msn,
                                req_id,
                                original,
                            },
                            &[],
                        );
                    }
                    Err(e) => {
                        // RFC 7306 §8: an invalid atomic draws a Terminate
                        // and leaves memory untouched.
                        self.terminate(e, &[]);
                    }
                }
            }
            Inbound::Commit {
                req_id,
                stag,
                to,
                len,
            } => {
                let (req_id, stag, to, len) = (*req_id, *stag, *to, *len);
                self.inbound.pop_front();
                let status = match env.mem.commit(stag, self.pd, to, len as u64) {
                    Ok(()) => 0,
                    Err(e) => {
                        warn!(qp = self.qp_num, error = %e, "commit failed");
                        e.status()
                    }
                };
                let msn = self.next_msn(QN_RESPONSE);
                self.frame(
                    &RdmapRepr::CommitResponse {
                        msn,
                        req_id,
                        status,
                    },
                    &[],
                );
            }
        }
        true
    }

    /// Push the send queue's head (or its next segment) out.
    fn transmit_sq(&mut self, env: &Env) -> bool {
        let Some(wr) = self.sq.front() else {
            return false;
        };
        if self.cursor.offset == 0 && !self.cursor.write_done {
            if wr.op.needs_response() && self.ord_used >= self.neg.ord {
                return false;
            }
            if wr.fence && self.ord_used > 0 {
                return false;
            }
        }
        let op = wr.op;
        let total: u64 = wr.sg_list.iter().map(|s| s.length as u64).sum();
        // A Read names its first SGE as the data sink; the responses are
        // placed across all SGEs by offset.
        let sink = wr.sg_list.first().copied().unwrap_or(Sge {
            addr: 0,
            length: 0,
            lkey: 0,
        });
        match op {
            SendOp::Send {
                solicited,
                invalidate,
            } => {
                let kind = match (solicited, invalidate.is_some()) {
                    (false, false) => SendKind::Send,
                    (false, true) => SendKind::SendInvalidate,
                    (true, false) => SendKind::SendSe,
                    (true, true) => SendKind::SendSeInvalidate,
                };
                let mo = self.cursor.offset;
                let chunk = (total - mo).min(self.caps.max_segment as u64);
                let last = mo + chunk == total;
                let msn = self.tx_msn[QN_SEND];
                if last {
                    self.tx_msn[QN_SEND] = msn.wrapping_add(1);
                }
                let payload = self.gather(env, mo, chunk);
                self.frame(
                    &RdmapRepr::Send {
                        kind,
                        last,
                        msn,
                        mo: mo as u32,
                        invalidate_stag: invalidate.unwrap_or(0),
                    },
                    &payload,
                );
                self.scratch = payload;
                self.advance(chunk, last, total);
            }
            SendOp::Write { remote } => self.write_segment(env, remote, total, false),
            SendOp::WriteImm { remote, .. } if !self.cursor.write_done => {
                self.write_segment(env, remote, total, true)
            }
            SendOp::WriteImm { imm, .. } => {
                // The Write part is out; RFC 7306 §6: its Immediate Data follows.
                let msn = self.next_msn(QN_SEND);
                self.frame(
                    &RdmapRepr::ImmediateData { se: false, msn },
                    &imm.to_be_bytes(),
                );
                self.advance(0, true, total);
            }
            SendOp::Imm { imm, solicited } => {
                let msn = self.next_msn(QN_SEND);
                self.frame(
                    &RdmapRepr::ImmediateData { se: solicited, msn },
                    &imm.to_be_bytes(),
                );
                self.advance(0, true, 0);
            }
            SendOp::Read { remote } => {
                let msn = self.next_msn(QN_REQUEST);
                let size = total.min(u32::MAX as u64) as u32;
                self.frame(
                    &RdmapRepr::ReadRequest {
                        msn,
                        sink_stag: sink.lkey,
                        sink_to: sink.addr,
                        size,
                        src_stag: remote.rkey,
                        src_to: remote.addr,
                    },
                    &[],
                );
                self.start_response_wait(0);
            }
            SendOp::FetchAdd { remote, add, mask } => {
                self.send_atomic(AtomicOpcode::FetchAdd, remote, add, mask, 0, 0);
            }
            SendOp::CmpSwap {
                remote,
                compare,
                compare_mask,
                swap,
                swap_mask,
            } => {
                self.send_atomic(
                    AtomicOpcode::CmpSwap,
                    remote,
                    swap,
                    swap_mask,
                    compare,
                    compare_mask,
                );
            }
            SendOp::Swap { remote, swap } => {
                self.send_atomic(AtomicOpcode::Swap, remote, swap, 0, 0, 0);
            }
            SendOp::AtomicWrite { remote, value } => {
                self.send_atomic(AtomicOpcode::Swap, remote, value, 0, 0, 0);
            }
            SendOp::Commit { remote, len } => {
                let msn = self.next_msn(QN_REQUEST);
                let req_id = self.alloc_req_id();
                self.frame(
                    &RdmapRepr::CommitRequest {
                        msn,
                        req_id,
                        stag: remote.rkey,
                        len,
                        to: remote.addr,
                        invalidate_stag: 0,
                    },
                    &[],
                );
                self.start_response_wait(req_id);
            }
        }
        true
    }

    /// The next segment of an RDMA Write (of a Write with Immediate when
    /// `imm_follows`, whose Immediate Data goes out after the last one).
    fn write_segment(&mut self, env: &Env, remote: Remote, total: u64, imm_follows: bool) {
        let off = self.cursor.offset;
        let chunk = (total - off).min(self.caps.max_segment as u64);
        let last = off + chunk == total;
        let payload = self.gather(env, off, chunk);
        self.frame(
            &RdmapRepr::Write {
                last,
                stag: remote.rkey,
                to: remote.addr.wrapping_add(off),
            },
            &payload,
        );
        self.scratch = payload;
        if imm_follows && last {
            self.cursor.write_done = true;
            self.cursor.offset = 0;
        } else {
            self.advance(chunk, last, total);
        }
    }

    fn alloc_req_id(&mut self) -> u32 {
        let id = self.next_req_id;
        self.next_req_id = id.wrapping_add(1).max(1);
        id
    }

    fn send_atomic(
        &mut self,
        opcode: AtomicOpcode,
        remote: Remote,
        add_swap: u64,
        add_swap_mask: u64,
        compare: u64,
        compare_mask: u64,
    ) {
        let msn = self.next_msn(QN_REQUEST);
        let req_id = self.alloc_req_id();
        self.frame(
            &RdmapRepr::AtomicRequest {
                msn,
                opcode,
                req_id,
                stag: remote.rkey,
                to: remote.addr,
                add_swap,
                add_swap_mask,
                compare,
                compare_mask,
            },
            &[],
        );
        self.start_response_wait(req_id);
    }

    /// The head WR's request is out: it now waits for its response.
    fn start_response_wait(&mut self, req_id: u32) {
        let Some(wr) = self.sq.pop_front() else {
            return;
        };
        self.cursor = TxCursor::default();
        self.ord_used += 1;
        let byte_len = wr.sg_list.iter().map(|s| s.length).sum();
        self.in_flight.push_back(InFlight {
            wr_id: wr.wr_id,
            op: wr.op,
            sg_list: wr.sg_list,
            signaled: wr.signaled,
            status: None,
            byte_len,
            vendor_err: 0,
            req_id,
            placed: 0,
        });
    }

    /// Account for `chunk` bytes of the head WR; on the last one it is done.
    fn advance(&mut self, chunk: u64, last: bool, total: u64) {
        if !last {
            self.cursor.offset += chunk;
            return;
        }
        self.cursor = TxCursor::default();
        if let Some(wr) = self.sq.pop_front() {
            self.in_flight.push_back(InFlight {
                wr_id: wr.wr_id,
                op: wr.op,
                sg_list: wr.sg_list,
                signaled: wr.signaled,
                status: Some(WcStatus::Success),
                byte_len: total.min(u32::MAX as u64) as u32,
                vendor_err: 0,
                req_id: 0,
                placed: 0,
            });
        }
    }

    /// Gather `len` bytes at message offset `off` from the head WR's SGEs.
    fn gather(&mut self, env: &Env, mut off: u64, len: u64) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.scratch);
        fit(&mut buf, len as usize);
        let Some(wr) = self.sq.front() else {
            return buf;
        };
        let mut filled = 0usize;
        for sge in &wr.sg_list {
            if filled == buf.len() {
                break;
            }
            let l = sge.length as u64;
            if off >= l {
                off -= l;
                continue;
            }
            let n = ((l - off) as usize).min(buf.len() - filled);
            // Checked at post time; the region can only have gone away since
            // (deregistered under a posted WR), which the safe API prevents.
            if let Err(e) = env.mem.read_local(
                sge.lkey,
                self.pd,
                sge.addr + off,
                &mut buf[filled..filled + n],
            ) {
                warn!(qp = self.qp_num, error = %e, "gather failed");
                // `buf` is reused: never send a previous message's bytes.
                buf[filled..filled + n].fill(0);
            }
            filled += n;
            off = 0;
        }
        buf
    }

    // ---- completion bookkeeping ----

    fn wc(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode, byte_len: u32) -> WorkCompletion {
        completion(self.qp_num, wr_id, status, opcode, byte_len)
    }

    fn complete_send(
        &mut self,
        op: &SendOp,
        wr_id: u64,
        status: WcStatus,
        byte_len: u32,
        vendor_err: u32,
    ) {
        let mut wc = self.wc(wr_id, status, op.wc_opcode(), byte_len);
        wc.vendor_err = vendor_err;
        self.completions.push_back((CqSide::Send, wc));
    }

    /// Move finished WRs from the head of `in_flight` to the completion
    /// queue, in posting order.
    fn deliver_completions(&mut self) {
        while let Some(head) = self.in_flight.front() {
            let Some(status) = head.status else { break };
            let head = self.in_flight.pop_front().expect("front exists");
            if head.signaled || status != WcStatus::Success {
                self.complete_send(&head.op, head.wr_id, status, head.byte_len, head.vendor_err);
            }
        }
    }

    // ---- errors ----

    /// A local error (bad SGE at post): the QP goes to Error and the peer
    /// learns of it through a Terminate.
    fn fail_local(&mut self) {
        self.terminate(Error::Catastrophic, &[]);
    }

    /// Send a Terminate for `err` (copying the offending `header`), move to
    /// Error and flush.
    fn terminate(&mut self, err: Error, header: &[u8]) {
        if self.state == QpState::Error {
            return;
        }
        let cause = err.terminate_cause();
        warn!(qp = self.qp_num, error = %err, ?cause, "terminating stream");
        let mut term = TerminateRepr::for_error(&err, (!header.is_empty()).then_some(header));
        term.msn = self.next_msn(QN_TERMINATE);
        self.frame(&RdmapRepr::Terminate(term), &[]);
        self.state = QpState::Error;
        self.events.push_back(Event::TerminateSent(cause));
        // The WR at the head failed because of what the peer did; the
        // statuses of the rest say they were flushed.
        self.flush();
        self.close_after_tx = true;
    }

    /// The peer terminated the stream.
    fn peer_terminated(&mut self, cause: TerminateCause) {
        if self.state == QpState::Error {
            return;
        }
        warn!(qp = self.qp_num, ?cause, "peer terminated the stream");
        self.state = QpState::Error;
        self.events.push_back(Event::TerminateReceived(cause));
        // The oldest outstanding request is the one the peer refused.
        if let Some(head) = self.in_flight.iter_mut().find(|f| f.status.is_none()) {
            head.status = Some(status_for_remote(cause));
            head.vendor_err = pack_cause(cause);
        } else if let Some(wr) = self.sq.pop_front() {
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
                placed: 0,
            });
        }
        self.flush();
        self.close_after_tx = true;
    }

    /// Complete every outstanding WR: finished ones as they finished, the
    /// rest with `IBV_WC_WR_FLUSH_ERR`, each exactly once.
    fn flush(&mut self) {
        for f in self.in_flight.iter_mut() {
            if f.status.is_none() {
                f.status = Some(WcStatus::WrFlushErr);
            }
        }
        self.deliver_completions();
        while let Some(wr) = self.sq.pop_front() {
            self.complete_send(&wr.op, wr.wr_id, WcStatus::WrFlushErr, 0, 0);
        }
        self.cursor = TxCursor::default();
        if let Some(r) = self.receiving.take() {
            let wc = self.wc(r.wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
            self.completions.push_back((CqSide::Recv, wc));
        }
        while let Some(wr) = self.rq.pop_front() {
            let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
            self.completions.push_back((CqSide::Recv, wc));
        }
        self.inbound.clear();
        self.ord_used = 0;
    }
}

/// Make `buf` `len` bytes long, zeroing only bytes it never held: the
/// caller overwrites all of them (a gather buffer need not be cleared).
fn fit(buf: &mut Vec<u8>, len: usize) {
    if buf.len() < len {
        buf.resize(len, 0);
    }
    buf.truncate(len);
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

/// Why processing an inbound ULPDU stopped the stream.
enum RxFail {
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

struct ProcessCtx<'a, 'e> {
    conn_pd: PdId,
    env: &'a Env<'e>,
    /// [`QpCaps::rdmap_extensions`].
    extensions: bool,
}

/// The parts of a connection the receive path mutates (split from the
/// deframer, which lends the ULPDU being processed).
struct RxState<'a> {
    state: &'a mut QpState,
    await_rtr: &'a mut bool,
    rx_msn: &'a mut [u32; 4],
    in_flight: &'a mut VecDeque<InFlight>,
    ord_used: &'a mut u16,
    rtr_read_pending: &'a mut bool,
    rq: &'a mut VecDeque<RecvWr>,
    receiving: &'a mut Option<Receiving>,
    inbound: &'a mut VecDeque<Inbound>,
    completions: &'a mut VecDeque<(CqSide, WorkCompletion)>,
    events: &'a mut VecDeque<Event>,
    qp_num: u32,
    ird: u16,
    rtr: Option<Rtr>,
}

/// A completion of QP `qp_num` with no Immediate Data, invalidation or
/// solicited event.
fn completion(
    qp_num: u32,
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode,
        byte_len,
        qp_num,
        ..WorkCompletion::BLANK
    }
}

impl RxState<'_> {
    fn wc(&self, wr_id: u64, opcode: WcOpcode, byte_len: u32) -> WorkCompletion {
        completion(self.qp_num, wr_id, WcStatus::Success, opcode, byte_len)
    }

    /// Check and advance the expected MSN of an untagged queue.
    fn take_msn(&mut self, qn: usize, msn: u32) -> Result<(), Error> {
        if msn != self.rx_msn[qn] {
            return Err(Error::MsnRange(msn));
        }
        self.rx_msn[qn] = msn.wrapping_add(1);
        Ok(())
    }

    /// The response at the head of the outstanding requests.
    fn response_head(&mut self) -> Option<&mut InFlight> {
        self.in_flight.iter_mut().find(|f| f.status.is_none())
    }

    fn rtr_arrived(&mut self) {
        if *self.await_rtr {
            *self.await_rtr = false;
            *self.state = QpState::Rts;
            self.events.push_back(Event::Established);
        }
    }
}

impl Connection {
    fn process_ulpdu(ulpdu: &[u8], ctx: ProcessCtx, rx: &mut RxState) -> Result<(), RxFail> {
        if !ctx.extensions {
            // An RFC 5040 RNIC knows opcodes 0x0–0x7 only and looks at the
            // opcode (RDMAP control, byte 1) before anything else.
            if let Some(op) = ulpdu.get(1).map(|b| b & 0x0f).filter(|op| *op >= 0x8) {
                return Err(Error::UnexpectedOpcode(op).into());
            }
        }
        let (repr, payload) = RdmapRepr::parse(ulpdu)?;
        trace!(qp = rx.qp_num, ?repr, len = payload.len(), "rx");
        if *rx.await_rtr {
            // Peer-to-peer: the first frame must be the negotiated RTR.
            let ok = match (rx.rtr, &repr) {
                (Some(Rtr::ZeroLengthWrite), RdmapRepr::Write { .. }) => payload.is_empty(),
                (Some(Rtr::ZeroLengthRead), RdmapRepr::ReadRequest { size: 0, .. }) => true,
                (Some(Rtr::ZeroLengthSend), RdmapRepr::Send { .. }) => payload.is_empty(),
                (_, RdmapRepr::Terminate(_)) => true,
                _ => false,
            };
            if !ok {
                return Err(Error::NoMatchingRtr.into());
            }
            if !matches!(repr, RdmapRepr::Terminate(_)) {
                rx.rtr_arrived();
                match repr {
                    RdmapRepr::ReadRequest {
                        msn,
                        sink_stag,
                        sink_to,
                        ..
                    } => {
                        rx.take_msn(QN_REQUEST, msn)?;
                        rx.inbound.push_back(Inbound::Read {
                            sink_stag,
                            sink_to,
                            src_stag: 0,
                            src_to: 0,
                            size: 0,
                            sent: 0,
                        });
                    }
                    RdmapRepr::Send { msn, .. } => rx.take_msn(QN_SEND, msn)?,
                    _ => {}
                }
                return Ok(());
            }
        }
        let pd = ctx.conn_pd;
        let env = ctx.env;
        match repr {
            RdmapRepr::Write { stag, to, .. } => {
                env.mem.place_tagged(stag, pd, to, payload)?;
            }
            RdmapRepr::ReadResponse { last, stag, to } => {
                if *rx.rtr_read_pending {
                    // The RTR Read went out before any WR, so the first
                    // Read Response answers it, whatever the application
                    // has posted since (responses come in request order).
                    if !(last && payload.is_empty()) {
                        return Err(Error::DdpBaseBounds.into());
                    }
                    *rx.rtr_read_pending = false;
                    *rx.ord_used = rx.ord_used.saturating_sub(1);
                    return Ok(());
                }
                let head = rx.response_head().ok_or(Error::UnexpectedOpcode(2))?;
                let SendOp::Read { .. } = head.op else {
                    return Err(Error::UnexpectedOpcode(2).into());
                };
                let sink = head.sg_list.first().copied();
                let (sink_stag, sink_to) = sink.map(|s| (s.lkey, s.addr)).unwrap_or((0, 0));
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
                scatter(env.mem, pd, &head.sg_list, off, payload)
                    .map_err(|_| Error::DdpBaseBounds)?;
                head.placed += payload.len() as u64;
                if last {
                    head.status = Some(WcStatus::Success);
                    *rx.ord_used = rx.ord_used.saturating_sub(1);
                }
            }
            RdmapRepr::Send {
                kind,
                last,
                msn,
                mo,
                invalidate_stag,
            } => {
                Self::receive_untagged(rx, env, pd, msn, mo as u64, payload, last)?;
                if last {
                    // Invalidate before taking the receive out: if it fails,
                    // the receive stays in progress and the flush completes
                    // it (it must not vanish without a completion).
                    let invalidates =
                        matches!(kind, SendKind::SendInvalidate | SendKind::SendSeInvalidate);
                    if invalidates {
                        env.mem.remote_invalidate(invalidate_stag, pd)?;
                    }
                    let Some(r) = rx.receiving.take() else {
                        return Err(Error::Catastrophic.into());
                    };
                    let mut wc = rx.wc(r.wr.wr_id, WcOpcode::Recv, r.len as u32);
                    wc.solicited = matches!(kind, SendKind::SendSe | SendKind::SendSeInvalidate);
                    if invalidates {
                        wc.invalidated_rkey = Some(invalidate_stag);
                    }
                    rx.completions.push_back((CqSide::Recv, wc));
                }
            }
            RdmapRepr::ImmediateData { se, msn } => {
                if payload.len() != 8 {
                    return Err(Error::RdmapMalformed("Immediate Data must carry 8 bytes").into());
                }
                if rx.receiving.is_some() {
                    return Err(Error::MsnRange(msn).into());
                }
                rx.take_msn(QN_SEND, msn)?;
                let wr = Self::take_recv(rx, env).ok_or(Error::NoBuffer(msn))?;
                let mut imm = [0u8; 8];
                imm.copy_from_slice(payload);
                let mut wc = rx.wc(wr.wr_id, WcOpcode::RecvImm, 0);
                wc.imm = Some(u64::from_be_bytes(imm));
                wc.solicited = se;
                rx.completions.push_back((CqSide::Recv, wc));
            }
            RdmapRepr::ReadRequest {
                msn,
                sink_stag,
                sink_to,
                size,
                src_stag,
                src_to,
            } => {
                rx.take_msn(QN_REQUEST, msn)?;
                Self::check_ird(rx)?;
                env.mem.check_remote(
                    src_stag,
                    pd,
                    src_to,
                    size as u64,
                    crate::mem::Access::REMOTE_READ,
                )?;
                rx.inbound.push_back(Inbound::Read {
                    sink_stag,
                    sink_to,
                    src_stag,
                    src_to,
                    size,
                    sent: 0,
                });
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
                rx.take_msn(QN_REQUEST, msn)?;
                Self::check_ird(rx)?;
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
                    .check_remote(stag, pd, to, 8, crate::mem::Access::REMOTE_ATOMIC)?;
                rx.inbound.push_back(Inbound::Atomic {
                    req_id,
                    stag,
                    to,
                    op,
                });
            }
            RdmapRepr::CommitRequest {
                msn,
                req_id,
                stag,
                len,
                to,
                ..
            } => {
                rx.take_msn(QN_REQUEST, msn)?;
                Self::check_ird(rx)?;
                // A failing commit answers with a status, never a Terminate.
                rx.inbound.push_back(Inbound::Commit {
                    req_id,
                    stag,
                    to,
                    len,
                });
            }
            RdmapRepr::AtomicResponse {
                msn,
                req_id,
                original,
            } => {
                rx.take_msn(QN_RESPONSE, msn)?;
                let head = rx.response_head().ok_or(Error::UnexpectedOpcode(0xb))?;
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
                    scatter(env.mem, pd, &head.sg_list, 0, &original.to_ne_bytes())
                        .map_err(|_| Error::Catastrophic)?;
                    head.byte_len = 8;
                }
                head.status = Some(WcStatus::Success);
                *rx.ord_used = rx.ord_used.saturating_sub(1);
            }
            RdmapRepr::CommitResponse {
                msn,
                req_id,
                status,
            } => {
                rx.take_msn(QN_RESPONSE, msn)?;
                let head = rx.response_head().ok_or(Error::UnexpectedOpcode(0xd))?;
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
                *rx.ord_used = rx.ord_used.saturating_sub(1);
            }
            RdmapRepr::Terminate(term) => {
                return Err(RxFail::Remote(term.cause));
            }
        }
        Ok(())
    }

    fn check_ird(rx: &RxState) -> Result<(), Error> {
        if rx.inbound.len() >= rx.ird as usize {
            return Err(Error::IrdExceeded);
        }
        Ok(())
    }

    fn take_recv(rx: &mut RxState, env: &Env) -> Option<RecvWr> {
        match env.srq {
            Some(srq) => srq.take(),
            None => rx.rq.pop_front(),
        }
    }

    /// Place one untagged Send segment.
    fn receive_untagged(
        rx: &mut RxState,
        env: &Env,
        pd: PdId,
        msn: u32,
        mo: u64,
        payload: &[u8],
        _last: bool,
    ) -> Result<(), Error> {
        let current = rx.receiving.as_ref().map(|r| r.msn);
        if current != Some(msn) {
            if current.is_some() {
                // Messages on one stream are not interleaved by our peers
                // (siw neither); a new MSN before the last segment is out
                // of range.
                return Err(Error::MsnRange(msn));
            }
            rx.take_msn(QN_SEND, msn)?;
            let wr = Self::take_recv(rx, env).ok_or(Error::NoBuffer(msn))?;
            let capacity = wr.sg_list.iter().map(|s| s.length as u64).sum();
            *rx.receiving = Some(Receiving {
                msn,
                wr,
                capacity,
                len: 0,
            });
        }
        let r = rx.receiving.as_mut().expect("set above");
        let end = mo
            .checked_add(payload.len() as u64)
            .ok_or(Error::InvalidMo(mo as u32))?;
        if end > r.capacity {
            return Err(Error::MessageTooLong);
        }
        scatter(env.mem, pd, &r.wr.sg_list, mo, payload).map_err(|_| Error::Catastrophic)?;
        r.len = r.len.max(end);
        Ok(())
    }
}

/// Scatter `data` at message offset `off` across `sges`.
fn scatter(
    mem: &MrTable,
    pd: PdId,
    sges: &[Sge],
    mut off: u64,
    mut data: &[u8],
) -> Result<(), Error> {
    for sge in sges {
        if data.is_empty() {
            break;
        }
        let l = sge.length as u64;
        if off >= l {
            off -= l;
            continue;
        }
        let n = ((l - off) as usize).min(data.len());
        mem.write_local(sge.lkey, pd, sge.addr + off, &data[..n])?;
        data = &data[n..];
        off = 0;
    }
    if data.is_empty() {
        Ok(())
    } else {
        Err(Error::MessageTooLong)
    }
}
