//! The sans-IO RDMAP stream: one reliable-connected queue pair over one
//! byte stream.
//!
//! No sockets, no threads, no clock: bytes come in through
//! [`Connection::handle_bytes`], bytes to send come out of
//! [`Connection::poll_transmit`], and the results appear through
//! [`Connection::poll_completion`] and [`Connection::poll_event`]. Memory is
//! reached only through the [`MrTable`] passed in each call. Work that may
//! block (a Commit's `msync`) is handed to the driver through
//! [`Connection::poll_durability`] and its outcome fed back with
//! [`Connection::handle_commit_done`]. Drivers drain the outputs in that
//! order after every input (quinn-proto's contract).
//!
//! Ordering follows RFC 5040 §5 and RFC 7306 §7: messages leave in posting
//! order; send-queue completions are delivered in posting order, so a Write
//! posted after a Read completes after it; inbound Read, atomic and Commit
//! requests are answered in the order they arrived.
//!
//! The code is split by direction: this file holds the connection, its
//! phase and the application's commands; `transmit` the send queue, the
//! responses and framing; `receive` the dispatch of inbound ULPDUs, one
//! function per RDMAP message; `teardown` Terminate, flush and close.

mod held_input;
mod inline;
mod output;
mod place;
mod receive;
mod teardown;
mod transmit;

#[cfg(test)]
mod place_tests;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;

use crate::mem::{MrTable, PdId};
use crate::setup::{Negotiated, Rtr};
use crate::srq::{PostRecvError, Spent, Srq};
use crate::wire::ddp::{Segments, UntaggedReassembly};
use crate::wire::stream::{Deframer, DeframerConfig, Framer, FramerConfig};
use crate::wire::TerminateCause;
use crate::wr::{
    keep_sge_list, InlineWr, RecvWr, SendOp, SendWr, SendWrRef, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};

pub use inline::MAX_INLINE;
pub use place::{PlaceRequest, HEADER_PEEK};
pub use receive::{HELD_INPUT_MAX, HOLD_LIMIT};
pub use transmit::CommitJob;

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
    /// The byte stream failed (reset by the peer, or a socket error) while
    /// the QP was not already in error: unlike a clean close, a fault.
    /// [`Closed`](Self::Closed) follows.
    StreamFailed,
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

/// A send WR in the send queue.
#[derive(Debug)]
struct Queued {
    wr: SendWr,
    /// The payload is in the QP's inline slots: `wr.sg_list` is one SGE
    /// whose `addr` is the offset there ([`inline::InlineSlots::get`]),
    /// not memory of a region.
    inline: bool,
}

impl std::ops::Deref for Queued {
    type Target = SendWr;
    fn deref(&self) -> &SendWr {
        &self.wr
    }
}

/// Where the stream is in its life. One value instead of a set of flags,
/// so that no impossible mix (an RTR both awaited and to send, a close
/// pending in RTS) can be represented.
///
/// ```text
///            initiator, p2p            responder, p2p
///   SendRtr ───────────┐            AwaitRtr
///    │ Write/Send RTR  │ Read RTR       │ RTR frame arrives
///    │                 ▼                │
///    │          AwaitRtrResponse        │
///    │                 │ its response   │
///    ▼                 ▼                ▼
///   Running ◄─────────────────────────── (client-server: from the start)
///    │ Terminate sent/received, ibv_modify_qp(ERR)
///    ▼
///   Closing ── tx drained ──► (driver closes)
///    │ stream closed
///    ▼
///   Closed
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Initiator in peer-to-peer mode: the RTR frame goes out before
    /// anything else (RFC 6581 §4). RTS already: WRs may be posted.
    SendRtr(Rtr),
    /// Responder in peer-to-peer mode: nothing is sent until the
    /// initiator's RTR frame, of this model, has arrived.
    AwaitRtr(Rtr),
    /// Initiator: our zero-length Read RTR is out and holds one ORD
    /// credit; the first Read Response answers it, whatever the
    /// application posted since (responses come in request order).
    AwaitRtrResponse,
    /// Fully operational.
    Running,
    /// Error: the WRs are flushed; what is framed (a Terminate) drains,
    /// then the driver closes the stream.
    Closing,
    /// Error, and the byte stream is gone: nothing more is sent.
    Closed,
}

impl Phase {
    /// The verbs state this phase shows as.
    fn qp_state(self) -> QpState {
        match self {
            Phase::AwaitRtr(_) => QpState::Rtr,
            Phase::SendRtr(_) | Phase::AwaitRtrResponse | Phase::Running => QpState::Rts,
            Phase::Closing | Phase::Closed => QpState::Error,
        }
    }

    fn is_error(self) -> bool {
        matches!(self, Phase::Closing | Phase::Closed)
    }
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
    /// Responses only: which request this is.
    req_id: u32,
    /// Its last octet is the `tx_mark`-th ever queued: it completes once
    /// that much was written (its buffer may be reused after that only).
    tx_mark: u64,
}

/// The send queue's progress on the WR at its head.
#[derive(Debug, Default, Clone)]
struct TxCursor {
    /// The segments of the current message still to go; `None` before its
    /// first segment.
    segments: Option<Segments>,
    /// For WriteImm: the Write part is done, the Immediate Data is next.
    write_done: bool,
}

impl TxCursor {
    /// Nothing of the head WR has left yet.
    fn at_start(&self) -> bool {
        self.segments.is_none() && !self.write_done
    }
}

/// Where a Commit at the head of the responses stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CommitProgress {
    /// Not yet handed to the driver.
    Queued,
    /// Handed out by [`Connection::poll_durability`]; the responses behind
    /// it wait.
    Issued,
    /// Done with this status: the response can go.
    Done(u32),
}

/// An inbound request we owe a response to.
#[derive(Debug)]
enum Inbound {
    Read {
        sink_stag: u32,
        sink_to: u64,
        src_stag: u32,
        src_to: u64,
        /// The Read Response segments still to send.
        segments: Segments,
    },
    Atomic {
        req_id: u32,
        stag: u32,
        to: u64,
        op: crate::mem::AtomicOp,
    },
    Commit {
        req_id: u32,
        stag: u32,
        to: u64,
        len: u32,
        progress: CommitProgress,
    },
}

/// One RDMAP stream and its queues.
#[derive(Debug)]
pub struct Connection {
    qp_num: u32,
    pd: PdId,
    caps: QpCaps,
    phase: Phase,
    neg: Negotiated,
    /// Boxed, so that [`deframe`](Self::deframe) lends it out of `self`
    /// and takes it back by moving a pointer (moving the deframer itself
    /// out, a fresh one in, and back, was ~70 instructions of every
    /// drive that read octets, #20); `None` only while it is lent.
    deframer: Option<Box<Deframer>>,
    framer: Framer,
    /// Framed output not yet written (payloads stay in registered memory).
    tx: output::TxQueue,
    /// Reused for gathering payloads when markers force a copy.
    scratch: Vec<u8>,
    /// Reused for the payload pieces of one segment.
    pieces: Vec<output::Piece>,

    sq: VecDeque<Queued>,
    /// Inline payloads of queued WRs ([`inline`]).
    inline: inline::InlineSlots,
    /// SGE lists of completed send WRs, emptied, for
    /// [`Connection::post_send_ref`] to fill instead of allocating.
    sge_pool: Vec<Vec<Sge>>,
    /// The same for receives, for [`Connection::post_recv_ref`].
    recv_sge_pool: Vec<Vec<Sge>>,
    /// The lists of completed SRQ receives, for the SRQ's next take.
    srq_spent: Spent,
    cursor: TxCursor,
    in_flight: VecDeque<InFlight>,
    /// Requests awaiting a response (ORD credits in use).
    ord_used: u16,
    next_req_id: u32,

    rq: VecDeque<RecvWr>,
    has_srq: bool,
    /// QN 0 (Send, Immediate Data): MSN and MO checks of RFC 5041 §5.3.
    rx_send: UntaggedReassembly,
    /// The receive the message in progress on QN 0 fills.
    receiving: Option<RecvWr>,
    /// The tagged segment whose payload is being placed directly.
    placing: Option<place::Placing>,
    /// Input held back while a message on QN 0 waits for a Receive
    /// ([`Connection::rx_held`]).
    held: Option<receive::Held>,
    /// Large tagged segments are arriving (the last one was placed
    /// directly): the driver reads header by header ([`Connection::read_hint`]).
    streaming: bool,

    inbound: VecDeque<Inbound>,
    /// Commits for the driver to perform.
    durability: VecDeque<CommitJob>,

    /// Next MSN to send on QN 0..=3.
    tx_msn: [u32; 4],
    /// Next MSN to expect on QN 1 and 3 (QN 0 is `rx_send`'s).
    rx_msn: [u32; 4],

    completions: VecDeque<(CqSide, WorkCompletion)>,
    events: VecDeque<Event>,
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

/// Completed receives' SGE lists kept for reuse, at most.
const RECV_POOL_MAX: usize = 64;

const QN_SEND: usize = 0;
const QN_REQUEST: usize = 1;
const QN_TERMINATE: usize = 2;
const QN_RESPONSE: usize = 3;

impl Connection {
    /// A connection whose MPA exchange has completed with `neg`.
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
        let phase = match (neg.rtr, neg.initiator) {
            (Some(rtr), true) => Phase::SendRtr(rtr),
            (Some(rtr), false) => Phase::AwaitRtr(rtr),
            (None, _) => Phase::Running,
        };
        let mut events = VecDeque::new();
        if phase.qp_state() == QpState::Rts {
            events.push_back(Event::Established);
        }
        Connection {
            qp_num,
            pd,
            caps,
            phase,
            deframer: Some(Box::new(Deframer::new(DeframerConfig {
                crc: neg.crc,
                markers: neg.markers_rx,
                // Peers (siw among them) may send FPDUs up to the 16-bit
                // ULPDU_Length limit whatever we segment at ourselves.
                max_ulpdu_len: u16::MAX,
            }))),
            framer: Framer::new(FramerConfig {
                crc: neg.crc,
                markers: neg.markers_tx,
            }),
            neg,
            tx: output::TxQueue::with_capacity(16 * 1024),
            scratch: Vec::new(),
            pieces: Vec::new(),
            sq: VecDeque::new(),
            inline: inline::InlineSlots::default(),
            sge_pool: Vec::new(),
            recv_sge_pool: Vec::new(),
            srq_spent: Spent::default(),
            cursor: TxCursor::default(),
            in_flight: VecDeque::new(),
            ord_used: 0,
            next_req_id: 1,
            rq: VecDeque::new(),
            has_srq,
            rx_send: UntaggedReassembly::new(),
            receiving: None,
            placing: None,
            held: None,
            streaming: false,
            inbound: VecDeque::new(),
            durability: VecDeque::new(),
            tx_msn: [1; 4],
            rx_msn: [1; 4],
            completions: VecDeque::new(),
            events,
        }
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.phase.qp_state()
    }

    /// What the MPA exchange settled.
    pub fn negotiated(&self) -> &Negotiated {
        &self.neg
    }

    /// Octets framed and not yet written.
    pub fn queued_tx(&self) -> usize {
        self.tx.len()
    }

    /// Octets of the stream written to the socket so far.
    pub fn tx_written(&self) -> u64 {
        self.tx.written_total()
    }

    /// Whether the driver should close the stream (everything framed has
    /// been written).
    pub fn wants_close(&self) -> bool {
        match self.phase {
            Phase::Closing => self.tx.is_empty(),
            Phase::Closed => true,
            _ => false,
        }
    }

    // ---- application commands ----

    /// `ibv_post_send`. In Error state the WR is accepted and completes with
    /// a flush error, as libibverbs does.
    pub fn post_send(&mut self, wr: SendWr, env: &Env) -> Result<(), PostError> {
        self.post_queued(wr, None, env)
    }

    /// `ibv_post_send` with `IBV_SEND_INLINE`: a Send or Write whose
    /// payload, `wr.data` (at most [`MAX_INLINE`] octets), is copied into
    /// the QP now (`inline`), so the caller's buffers are free when this
    /// returns. Allocates nothing in steady state.
    pub fn post_inline(&mut self, wr: InlineWr<'_>, env: &Env) -> Result<(), PostError> {
        if !wr.op.sends_payload() {
            return Err(PostError::Invalid(
                "only Sends and Writes carry inline data",
            ));
        }
        let total: usize = wr.data.iter().map(|d| d.len()).sum();
        if total > MAX_INLINE {
            return Err(PostError::Invalid(
                "inline data over the device's max_inline_data",
            ));
        }
        // One SGE, whose address is set to the slot once the WR is
        // admitted: the WR's length wherever the queue sums its SGEs.
        let mut sg_list = self.sge_pool.pop().unwrap_or_default();
        sg_list.push(Sge {
            addr: 0,
            length: total as u32,
            lkey: 0,
        });
        let queued = SendWr {
            wr_id: wr.wr_id,
            op: wr.op,
            sg_list,
            signaled: wr.signaled,
            fence: wr.fence,
        };
        self.post_queued(queued, Some(wr.data), env)
    }

    /// Admit one send WR; `inline` is its payload when it has no SGEs of
    /// its own (then `wr.sg_list` is the one SGE `post_inline` made).
    fn post_queued(
        &mut self,
        mut wr: SendWr,
        inline: Option<&[&[u8]]>,
        env: &Env,
    ) -> Result<(), PostError> {
        if inline.is_none() && wr.sg_list.len() > self.caps.max_send_sge as usize {
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
        if wr.total_len() > u32::MAX as u64 {
            return Err(PostError::Invalid(
                "a message is at most 2^32 - 1 bytes long",
            ));
        }
        if matches!(wr.op, SendOp::Imm { .. } | SendOp::Commit { .. }) && !wr.sg_list.is_empty() {
            return Err(PostError::Invalid(
                "Immediate Data and Commit carry no SGEs",
            ));
        }
        let errored = self.phase.is_error();
        if wr.op.needs_response() && self.neg.ord == 0 && !errored {
            return Err(PostError::Invalid(
                "the connection negotiated ORD 0: no Read, atomic or Commit",
            ));
        }
        if errored {
            self.complete_send(&wr.op, wr.wr_id, WcStatus::WrFlushErr, 0, 0);
            return Ok(());
        }
        if let Some(data) = inline {
            wr = match self.frame_at_once(env, wr, Some(data)) {
                Ok(()) => return Ok(()),
                Err(wr) => wr,
            };
            let slots = self.caps.max_send_wr as usize;
            let (start, _) = self.inline.copy_in(slots, data);
            wr.sg_list[0].addr = start as u64;
            self.sq.push_back(Queued { wr, inline: true });
            return Ok(());
        }
        // Local protection is checked before anything of a WR reaches the
        // wire, so that a bad SGE fails its own WR: a Send's or Write's as
        // `frame_at_once` copies its payload, when it frames it at once;
        // otherwise, and for the WRs whose local SGEs are written (Reads,
        // atomics), by the look below, at post time.
        let write = matches!(
            wr.op,
            SendOp::Read { .. }
                | SendOp::FetchAdd { .. }
                | SendOp::CmpSwap { .. }
                | SendOp::Swap { .. }
        );
        if !write {
            // A payload framed at once is checked as it is copied, under the
            // region table's one lock (a second lookup of the region, and a
            // second lock, per post before): a bad SGE fails its WR as the
            // check below would, and nothing of it is framed.
            wr = match self.frame_at_once(env, wr, None) {
                Ok(()) => return Ok(()),
                Err(wr) => wr,
            };
        }
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
        if !write {
            self.sq.push_back(Queued { wr, inline: false });
        } else if let Err(wr) = self.frame_at_once(env, wr, None) {
            self.sq.push_back(Queued { wr, inline: false });
        }
        Ok(())
    }

    /// [`post_send`](Self::post_send) with a borrowed SGE list, copied into
    /// a list recycled from a completed WR: in steady state (as many WRs
    /// completing as posted) nothing is allocated.
    pub fn post_send_ref(&mut self, wr: SendWrRef<'_>, env: &Env) -> Result<(), PostError> {
        let mut sg_list = self.sge_pool.pop().unwrap_or_default();
        sg_list.extend_from_slice(wr.sg_list);
        self.post_send(
            SendWr {
                wr_id: wr.wr_id,
                op: wr.op,
                sg_list,
                signaled: wr.signaled,
                fence: wr.fence,
            },
            env,
        )
    }

    /// Keep a finished WR's SGE list for [`post_send_ref`](Self::post_send_ref)
    /// (at most a send queue's worth, none of an unusual size).
    fn recycle_sges(&mut self, list: Vec<Sge>) {
        let limit = self.caps.max_send_wr as usize;
        keep_sge_list(&mut self.sge_pool, list, self.caps.max_send_sge, limit);
    }

    /// [`post_recv`](Self::post_recv) of a borrowed SGE list, copied into
    /// a list recycled from a completed receive: with receives completing
    /// as posted, a repost allocates nothing (a Send ping-pong reposts
    /// one per message, between the message and its answer).
    pub fn post_recv_ref(&mut self, wr_id: u64, sg_list: &[Sge]) -> Result<(), PostError> {
        let mut list = self.recv_sge_pool.pop().unwrap_or_default();
        list.extend_from_slice(sg_list);
        self.post_recv(RecvWr {
            wr_id,
            sg_list: list,
        })
    }

    /// Keep a completed receive's SGE list for
    /// [`post_recv_ref`](Self::post_recv_ref) (as [`recycle_sges`](Self::recycle_sges)
    /// does for sends), at most [`RECV_POOL_MAX`] of them: a receiver
    /// reposts as it takes completions, so the pool holds the few taken
    /// and not yet reposted, and a pool that had to grow to the receive
    /// queue's depth would allocate (and hold memory) for nothing.
    fn recycle_recv_sges(&mut self, list: Vec<Sge>) {
        // An SRQ's receives are posted to the SRQ, never here: its lists
        // go back to it.
        if self.has_srq {
            self.srq_spent.keep(list);
        } else {
            let limit = RECV_POOL_MAX.min(self.caps.max_recv_wr as usize);
            keep_sge_list(&mut self.recv_sge_pool, list, self.caps.max_recv_sge, limit);
        }
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
        if self.phase.is_error() {
            self.completions.push_back((
                CqSide::Recv,
                self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0),
            ));
            return Ok(());
        }
        self.rq.push_back(wr);
        Ok(())
    }

    // ---- outputs ----

    /// Whether the driver has anything to take from the connection:
    /// completions, events or a Commit to perform. With nothing to send
    /// either ([`has_pending_tx`](Self::has_pending_tx)) and no input, a
    /// drive has nothing to do.
    pub fn has_output(&self) -> bool {
        !self.completions.is_empty() || self.has_events_or_jobs()
    }

    /// Whether the driver has an event or a Commit to take (the outputs
    /// other than completions).
    pub fn has_events_or_jobs(&self) -> bool {
        !self.events.is_empty() || self.has_commit_job()
    }

    /// Whether a Commit waits for the driver ([`poll_durability`](Self::poll_durability)).
    pub fn has_commit_job(&self) -> bool {
        !self.durability.is_empty()
    }

    /// The next completion, with the CQ it belongs on.
    pub fn poll_completion(&mut self) -> Option<(CqSide, WorkCompletion)> {
        self.completions.pop_front()
    }

    /// The next connection event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
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
        let written = self.tx.written_total();
        while let Some(head) = self.in_flight.front() {
            let Some(status) = head.status else { break };
            if head.tx_mark > written {
                // Still to be read from its buffer by `writev`.
                break;
            }
            let Some(head) = self.in_flight.pop_front() else {
                break;
            };
            if head.signaled || status != WcStatus::Success {
                self.complete_send(&head.op, head.wr_id, status, head.byte_len, head.vendor_err);
            }
            self.recycle_sges(head.sg_list);
        }
    }
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
