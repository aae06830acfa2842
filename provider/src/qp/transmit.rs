//! The transmit direction: the send queue, the responses we owe to inbound
//! requests, and the framing of both into the stream.
//!
//! Responses are produced strictly in the order their requests arrived
//! (RFC 5040 §5.3, RFC 7306 §7): the head of `inbound` is answered before
//! anything behind it, and a Commit at the head holds the rest back until
//! the driver has performed it ([`Connection::poll_durability`]).

use tracing::warn;

use super::inline::InlineSlots;
use super::output::Piece;
use super::{
    CommitProgress, Connection, Env, InFlight, Inbound, Phase, TxCursor, MAX_HEADER_LEN,
    QN_REQUEST, QN_RESPONSE, QN_SEND,
};
use crate::mem::{MrTable, PdId, ReadScope};
use crate::setup::Rtr;
use crate::wire::atomic::AtomicOpcode;
use crate::wire::ddp::{SegmentSpan, Segments};
use crate::wire::rdmap::{RdmapRepr, SendKind};
use crate::wr::{sge_spans, Remote, SendOp, SendWr, Sge, WcStatus};

/// Payloads up to this size are copied into the output rather than
/// gathered from registered memory at write time.
const SNAPSHOT_MAX: usize = 4096;

/// A Commit the driver performs outside the sans-IO core (it may block in
/// `msync`), then reports with [`Connection::handle_commit_done`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitJob {
    /// The request's ID, to hand back with the status.
    pub req_id: u32,
    /// The target region.
    pub stag: u32,
    /// The QP's protection domain.
    pub pd: PdId,
    /// Start of the range.
    pub to: u64,
    /// Length of the range.
    pub len: u32,
}

impl CommitJob {
    /// Perform the commit against `mem` (msync for a file-backed region)
    /// and return the status for the Commit Response: 0 on success. A
    /// failing commit answers with a status, never a Terminate.
    pub fn run(&self, mem: &MrTable) -> u32 {
        match mem.commit(self.stag, self.pd, self.to, self.len as u64) {
            Ok(()) => 0,
            Err(e) => {
                warn!(req_id = self.req_id, error = %e, "commit failed");
                e.status()
            }
        }
    }
}

/// The header length of each kind of segmented message.
const TAGGED: usize = crate::wire::ddp::TAGGED_HEADER_LEN;
const UNTAGGED: usize = crate::wire::ddp::UNTAGGED_HEADER_LEN;

impl Connection {
    /// Append up to about `max` bytes of framed stream data to `out`.
    /// Returns whether anything was added. (A copying convenience over
    /// [`prepare_transmit`](Self::prepare_transmit) and
    /// [`write_transmit`](Self::write_transmit), which drivers use.)
    pub fn poll_transmit(&mut self, env: &Env, out: &mut Vec<u8>, max: usize) -> bool {
        let start = out.len();
        self.prepare_transmit(env, max);
        self.tx.drain_into(env.mem, self.pd, out);
        self.deliver_completions();
        out.len() > start
    }

    /// Frame output until about `max` octets wait to be written. Returns
    /// whether anything was added.
    pub fn prepare_transmit(&mut self, env: &Env, max: usize) -> bool {
        let before = self.tx.len();
        self.transmit_into(env, max);
        self.tx.len() > before
    }

    /// Whether framed output waits for [`write_transmit`](Self::write_transmit).
    pub fn has_queued_tx(&self) -> bool {
        !self.tx.is_empty()
    }

    /// Hand the framed output to `write` as one gather list: the headers
    /// and trailers the core owns, the payloads in place in registered
    /// memory (borrowed for the call only, under the table's read lock).
    /// `write` returns how many octets it took, as `writev` does; the rest
    /// stays queued for the next call.
    pub fn write_transmit(
        &mut self,
        env: &Env,
        write: impl FnOnce(&[std::io::IoSlice<'_>]) -> std::io::Result<usize>,
    ) -> std::io::Result<usize> {
        let n = self.tx.write_with(env.mem, self.pd, write)?;
        // Sends whose octets all left complete now.
        self.deliver_completions();
        Ok(n)
    }

    /// The next Commit for the driver to perform. Its response, and every
    /// response behind it, waits for
    /// [`handle_commit_done`](Self::handle_commit_done).
    pub fn poll_durability(&mut self) -> Option<CommitJob> {
        self.durability.pop_front()
    }

    /// The driver performed the Commit `req_id` with `status` (0 =
    /// success; see [`CommitJob::run`]). Its response goes out with the
    /// next [`poll_transmit`](Self::poll_transmit). Unknown or stale IDs
    /// (the stream was torn down meanwhile) are ignored.
    pub fn handle_commit_done(&mut self, req_id: u32, status: u32) {
        if let Some(Inbound::Commit {
            req_id: id,
            progress,
            ..
        }) = self.inbound.front_mut()
        {
            if *id == req_id && *progress == CommitProgress::Issued {
                *progress = CommitProgress::Done(status);
            }
        }
    }

    /// Whether the connection has work it could transmit now.
    pub fn has_pending_tx(&self) -> bool {
        !self.tx.is_empty() || self.has_to_frame()
    }

    /// Whether [`prepare_transmit`](Self::prepare_transmit) would frame
    /// anything: an RTR to send, a response owed, or a send queue that
    /// can move.
    pub fn has_to_frame(&self) -> bool {
        if matches!(self.phase, Phase::SendRtr(_)) {
            return true;
        }
        let rts = matches!(self.phase, Phase::Running | Phase::AwaitRtrResponse);
        rts && (self.inbound_ready() || self.sq_can_progress())
    }

    /// Whether the send queue runs on without the application: a request
    /// is on the wire awaiting its response (a Read, an atomic) and posted
    /// requests wait behind it, so that response's arrival sends the next
    /// one (a Read stream at the ORD limit: qperf rc_rdma_read_bw, fio's
    /// rdma reads). Whoever reads the socket first keeps the stream going.
    pub fn pipelined(&self) -> bool {
        self.ord_used > 0 && !self.sq.is_empty()
    }

    /// The head of the responses can be worked on (it is not a Commit
    /// waiting for the driver).
    fn inbound_ready(&self) -> bool {
        match self.inbound.front() {
            None => false,
            Some(Inbound::Commit { progress, .. }) => *progress != CommitProgress::Issued,
            Some(_) => true,
        }
    }

    fn sq_can_progress(&self) -> bool {
        match self.sq.front() {
            None => false,
            Some(wr) => {
                !(wr.op.needs_response() && self.ord_used >= self.neg.ord && self.cursor.at_start())
            }
        }
    }

    /// [`prepare_transmit`](Self::prepare_transmit)'s work: frame until
    /// `tx` holds `max` octets.
    fn transmit_into(&mut self, env: &Env, max: usize) {
        match self.phase {
            Phase::Closing | Phase::Closed | Phase::AwaitRtr(_) => return,
            Phase::SendRtr(rtr) => self.send_rtr(rtr),
            Phase::AwaitRtrResponse | Phase::Running => {}
        }
        while self.tx.len() < max && !self.phase.is_error() {
            if !(self.transmit_inbound(env) || self.transmit_sq(env)) {
                break;
            }
        }
        self.deliver_completions();
    }

    /// Frame one ULPDU (header from `repr`, then `payload`) into `tx`.
    pub(super) fn frame(&mut self, repr: &RdmapRepr, payload: &[u8]) {
        let hlen = repr.header_len();
        let mut header = [0u8; MAX_HEADER_LEN];
        repr.emit(&mut header[..hlen]);
        let start = self.tx.bytes.len();
        match self
            .framer
            .frame(&[&header[..hlen], payload], &mut self.tx.bytes)
        {
            Ok(()) => self.tx.push_bytes(start),
            Err(e) => self.frame_failed(e),
        }
    }

    /// [`frame`](Self::frame) with a payload that `payload` appends, in
    /// place behind the header (no markers: see [`Framer::frame_appending`]).
    fn frame_with(&mut self, repr: &RdmapRepr, payload: impl FnOnce(&mut Vec<u8>)) {
        let hlen = repr.header_len();
        let mut header = [0u8; MAX_HEADER_LEN];
        repr.emit(&mut header[..hlen]);
        let start = self.tx.bytes.len();
        let framed = self
            .framer
            .frame_appending(&header[..hlen], &mut self.tx.bytes, |out| {
                payload(out);
                Ok::<(), std::convert::Infallible>(())
            });
        match framed {
            Ok(_) => self.tx.push_bytes(start),
            Err(e) => self.frame_failed(e),
        }
    }

    /// Frame one ULPDU whose payload is `self.pieces` (read in place from
    /// registered memory, never copied, unless markers are in use). If a
    /// piece's region is gone (deregistered, or invalidated by the peer,
    /// since the WR was checked), nothing is framed and the error says why.
    fn frame_pieces(&mut self, env: &Env, repr: &RdmapRepr) -> Result<(), crate::wire::Error> {
        let hlen = repr.header_len();
        let mut header = [0u8; MAX_HEADER_LEN];
        repr.emit(&mut header[..hlen]);
        let payload_len: usize = self.pieces.iter().map(|p| p.len()).sum();
        let pd = self.pd;
        let inline = self
            .pieces
            .iter()
            .any(|p| matches!(p, Piece::Inline { .. }));
        let markers = self.framer.config().markers;
        if !markers && (payload_len <= SNAPSHOT_MAX || inline) {
            // A small payload is copied: as cheap as an iovec, and the
            // octets sent are those the CRC covers even if the memory
            // changes before the socket takes them. It is copied once,
            // straight into the output behind its header, and the CRC
            // runs over the whole FPDU in one call.
            let start = self.tx.bytes.len();
            let (pieces, slots, tx, framer) =
                (&self.pieces, &self.inline, &mut self.tx, &mut self.framer);
            let framed = env.mem.read_scope(|scope| {
                framer.frame_appending(&header[..hlen], &mut tx.bytes, |out| {
                    append_pieces(pieces, slots, scope, pd, out)
                })
            });
            self.pieces.clear();
            return match framed {
                Ok(Ok(())) => {
                    self.tx.push_bytes(start);
                    Ok(())
                }
                Ok(Err(gone)) => Err(gone),
                Err(e) => {
                    self.frame_failed(e);
                    Ok(())
                }
            };
        }
        if markers {
            // Markers fall inside payloads every 512 octets: copy (rare;
            // siw does not ask for them by default).
            let mut payload = std::mem::take(&mut self.scratch);
            payload.clear();
            let (pieces, slots) = (&self.pieces, &self.inline);
            let copied = env
                .mem
                .read_scope(|scope| append_pieces(pieces, slots, scope, pd, &mut payload));
            self.pieces.clear();
            if copied.is_ok() {
                self.frame(repr, &payload);
            }
            self.scratch = payload;
            return copied;
        }
        let start = self.tx.bytes.len();
        let (pieces, tx, framer) = (&mut self.pieces, &mut self.tx, &mut self.framer);
        // One read scope for the check and the CRC: no region can go in
        // between, and queued pieces are copied out by a deregistration
        // (TxQueue::detach) before their region goes.
        let framed = env.mem.read_scope(|scope| {
            for piece in pieces.iter() {
                piece.try_payload(scope, pd)?;
            }
            Ok(
                framer.frame_gather(&header[..hlen], payload_len, &mut tx.bytes, |crc| {
                    for piece in pieces.iter() {
                        crc.update(piece.payload(scope, pd));
                    }
                }),
            )
        });
        match framed {
            Err(gone) => {
                self.pieces.clear();
                return Err(gone);
            }
            Ok(Ok(trailer)) => {
                self.tx.push_bytes(start);
                for piece in self.pieces.drain(..) {
                    self.tx.push_payload(piece);
                }
                let start = self.tx.bytes.len();
                self.tx.bytes.extend_from_slice(trailer.as_bytes());
                self.tx.push_bytes(start);
            }
            Ok(Err(e)) => self.frame_failed(e),
        }
        Ok(())
    }

    /// The region `stag` is being deregistered: copy what framed output
    /// still reads from it (see [`MrTable::revoke`]). Returns how many
    /// payload pieces were copied.
    pub fn detach_region(&mut self, env: &Env, stag: u32) -> usize {
        self.tx.detach(env.mem, stag)
    }

    /// A region the head WR reads went away after the WR was posted (it
    /// was deregistered with the WR in flight): the WR completes with
    /// `IBV_WC_LOC_PROT_ERR`, as on an RNIC, and the QP goes to Error.
    fn fail_head_local(&mut self) {
        self.cursor = TxCursor::default();
        match self.sq.pop_front() {
            Some(head) => self.failed_local(head.wr),
            None => self.fail_local(),
        }
    }

    /// [`fail_head_local`](Self::fail_head_local) of `wr`.
    fn failed_local(&mut self, wr: SendWr) {
        self.in_flight.push_back(InFlight {
            wr_id: wr.wr_id,
            op: wr.op,
            sg_list: wr.sg_list,
            signaled: true,
            status: Some(WcStatus::LocProtErr),
            byte_len: 0,
            vendor_err: 0,
            req_id: 0,
            tx_mark: 0,
        });
        self.fail_local();
    }

    fn frame_failed(&mut self, e: crate::wire::Error) {
        // Segments are sized below the framer's limit; reaching this is a
        // bug, and the stream cannot continue without the frame.
        warn!(qp = self.qp_num, error = %e, "cannot frame a ULPDU");
        self.fail_stream();
    }

    /// The RTR frame of RFC 6581 §4, first thing on the stream.
    fn send_rtr(&mut self, rtr: Rtr) {
        self.phase = Phase::Running;
        match rtr {
            Rtr::ZeroLengthWrite => {
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
            Rtr::ZeroLengthRead => {
                let msn = self.next_msn(QN_REQUEST);
                self.phase = Phase::AwaitRtrResponse;
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
            Rtr::ZeroLengthSend => {
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
        }
    }

    pub(super) fn next_msn(&mut self, qn: usize) -> u32 {
        let m = self.tx_msn[qn];
        self.tx_msn[qn] = m.wrapping_add(1);
        m
    }

    /// Answer the oldest inbound request (or the next segment of it).
    /// Returns whether anything happened.
    fn transmit_inbound(&mut self, env: &Env) -> bool {
        let pd = self.pd;
        let Some(head) = self.inbound.front_mut() else {
            return false;
        };
        match head {
            Inbound::Read {
                sink_stag,
                sink_to,
                src_stag,
                src_to,
                segments,
            } => {
                let Some(span) = segments.next() else {
                    // Cannot happen: the last segment pops the request.
                    self.inbound.pop_front();
                    return true;
                };
                // The sink TO is the peer's to check (it draws a tagged
                // TO-wrap or bounds error there); it may wrap here.
                let off = span.offset as u64;
                let (sink_stag, to, src_stag, src) = (
                    *sink_stag,
                    sink_to.wrapping_add(off),
                    *src_stag,
                    src_to.wrapping_add(off),
                );
                let access = crate::mem::Access::REMOTE_READ;
                if let Err(e) = env
                    .mem
                    .check_remote(src_stag, pd, src, span.len as u64, access)
                {
                    // Checked on arrival; it can only fail now if the region
                    // was deregistered meanwhile.
                    self.terminate(e, &[]);
                    return true;
                }
                self.pieces.clear();
                self.pieces.push(Piece::Remote {
                    stag: src_stag,
                    to: src,
                    len: span.len,
                });
                let framed = self.frame_pieces(
                    env,
                    &RdmapRepr::ReadResponse {
                        last: span.last,
                        stag: sink_stag,
                        to,
                    },
                );
                if let Err(e) = framed {
                    // Deregistered (or invalidated) since the check above.
                    self.terminate(e, &[]);
                    return true;
                }
                if span.last {
                    self.inbound.pop_front();
                }
            }
            Inbound::Atomic {
                req_id,
                stag,
                to,
                op,
            } => {
                if self.tx.has_gathered() {
                    // A queued Read Response (or Send) is still to be read
                    // from memory this atomic may change: its CRC covers
                    // what is there now, and RC order says it reads the
                    // value before the atomic. The atomic runs once the
                    // output is written.
                    return false;
                }
                let (req_id, stag, to, op) = (*req_id, *stag, *to, *op);
                self.inbound.pop_front();
                match env.mem.atomic(stag, pd, to, op) {
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
                progress,
            } => match *progress {
                CommitProgress::Queued => {
                    // The msync may block: the driver performs it, and the
                    // responses behind this one wait for it.
                    *progress = CommitProgress::Issued;
                    let job = CommitJob {
                        req_id: *req_id,
                        stag: *stag,
                        pd,
                        to: *to,
                        len: *len,
                    };
                    self.durability.push_back(job);
                    return false;
                }
                CommitProgress::Issued => return false,
                CommitProgress::Done(status) => {
                    let req_id = *req_id;
                    self.inbound.pop_front();
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
            },
        }
        true
    }

    /// The next segment of the head WR's message, planning its segments
    /// at the first one. `header_len` is the DDP+RDMAP header each
    /// segment carries.
    fn next_span(&mut self, total: u64, header_len: usize) -> Option<SegmentSpan> {
        if self.cursor.segments.is_none() {
            // post_send refuses messages of 2^32 bytes or more.
            let msg_len = u32::try_from(total).unwrap_or(u32::MAX);
            let mulpdu = self.caps.max_segment as usize + header_len;
            self.cursor.segments = Segments::new(msg_len, mulpdu, header_len);
        }
        let span = self.cursor.segments.as_mut().and_then(Iterator::next);
        if span.is_none() {
            // max_segment is at least 1, so planning cannot fail.
            warn!(qp = self.qp_num, "no segment to send");
            self.fail_stream();
        }
        span
    }

    /// Push the send queue's head (or its next segment) out.
    fn transmit_sq(&mut self, env: &Env) -> bool {
        let Some(wr) = self.sq.front() else {
            return false;
        };
        if self.cursor.at_start() && !self.may_start(wr) {
            return false;
        }
        let op = wr.op;
        let total = wr.total_len();
        let sink = wr.read_sink();
        match op {
            SendOp::Send {
                solicited,
                invalidate,
            } => {
                let kind = SendKind::of(solicited, invalidate.is_some());
                let Some(span) = self.next_span(total, UNTAGGED) else {
                    return true;
                };
                let msn = self.tx_msn[QN_SEND];
                if span.last {
                    self.tx_msn[QN_SEND] = msn.wrapping_add(1);
                }
                self.collect_pieces(span);
                let framed = self.frame_pieces(
                    env,
                    &RdmapRepr::Send {
                        kind,
                        last: span.last,
                        msn,
                        mo: span.offset,
                        invalidate_stag: invalidate.unwrap_or(0),
                    },
                );
                if framed.is_err() {
                    self.fail_head_local();
                    return true;
                }
                if span.last {
                    self.finish_head(total);
                }
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
                self.finish_head(total);
            }
            SendOp::Imm { imm, solicited } => {
                let msn = self.next_msn(QN_SEND);
                self.frame(
                    &RdmapRepr::ImmediateData { se: solicited, msn },
                    &imm.to_be_bytes(),
                );
                self.finish_head(0);
            }
            SendOp::Read { .. }
            | SendOp::FetchAdd { .. }
            | SendOp::CmpSwap { .. }
            | SendOp::Swap { .. }
            | SendOp::AtomicWrite { .. }
            | SendOp::Commit { .. } => {
                if let Some(req_id) = self.frame_request(op, sink, total) {
                    self.start_response_wait(req_id);
                }
            }
        }
        true
    }

    /// Frame `wr` now instead of queueing it, when nothing is ahead of it
    /// (no queued WR, no response owed, nothing waiting for the socket)
    /// and it leaves in one FPDU: a request, or a Send or Write of at most
    /// one segment, copied. The send queue would frame it next the same
    /// way, through its entry, its cursor and a segment plan: an 8-octet
    /// post's longest steps after the system call. `data` is an inline
    /// WR's payload (not copied into the slots first). A Send's or
    /// Write's SGEs need no check before: each is checked as its octets
    /// are copied, and one naming no region it may read fails the WR
    /// (`LocProtErr`) with nothing framed. Hands `wr` back when it must
    /// queue.
    pub(super) fn frame_at_once(
        &mut self,
        env: &Env,
        wr: SendWr,
        data: Option<&[&[u8]]>,
    ) -> Result<(), SendWr> {
        if self.phase != Phase::Running
            || !self.sq.is_empty()
            || !self.tx.is_empty()
            || !self.inbound.is_empty()
            || self.framer.config().markers
            || !self.may_start(&wr)
        {
            return Err(wr);
        }
        let total = wr.total_len();
        if wr.op.needs_response() {
            let Some(req_id) = self.frame_request(wr.op, wr.read_sink(), total) else {
                return Err(wr);
            };
            self.framed_at_once(wr, total, Some(req_id));
            return Ok(());
        }
        if total > u64::from(self.caps.max_segment).min(SNAPSHOT_MAX as u64) {
            return Err(wr);
        }
        let repr = match wr.op {
            SendOp::Send {
                solicited,
                invalidate,
            } => RdmapRepr::Send {
                kind: SendKind::of(solicited, invalidate.is_some()),
                last: true,
                msn: self.next_msn(QN_SEND),
                mo: 0,
                invalidate_stag: invalidate.unwrap_or(0),
            },
            SendOp::Write { remote } => RdmapRepr::Write {
                last: true,
                stag: remote.rkey,
                to: remote.addr,
            },
            // Two FPDUs (a Write with Immediate), or rare.
            _ => return Err(wr),
        };
        let framed = match data {
            Some(data) => {
                self.frame_with(&repr, |out| {
                    data.iter().for_each(|d| out.extend_from_slice(d))
                });
                Ok(())
            }
            None => {
                self.pieces.clear();
                local_pieces(&wr.sg_list, 0, total as u32, &mut self.pieces);
                self.frame_pieces(env, &repr)
            }
        };
        if framed.is_err() {
            // An SGE names no region it may read (a bad lkey, an access
            // out of bounds, a region gone).
            self.failed_local(wr);
            return Ok(());
        }
        self.framed_at_once(wr, total, None);
        Ok(())
    }

    /// `wr`, framed by [`frame_at_once`](Self::frame_at_once), is out:
    /// it waits for its response `req_id`, or completes once written.
    /// Should the framing have failed the stream, it is flushed.
    fn framed_at_once(&mut self, wr: SendWr, total: u64, req_id: Option<u32>) {
        if self.phase.is_error() {
            self.complete_send(&wr.op, wr.wr_id, WcStatus::WrFlushErr, 0, 0);
            self.recycle_sges(wr.sg_list);
            return;
        }
        match req_id {
            Some(req_id) => self.awaits_response(wr, req_id),
            None => self.framed_whole(wr, total),
        }
    }

    /// Frame the request of `op`, whose local buffer is `sink` (`total`
    /// octets in all); returns the ID its response will carry (0 for a
    /// Read's, which carries none), or `None` for an operation that needs
    /// no response (nothing framed).
    fn frame_request(&mut self, op: SendOp, sink: Sge, total: u64) -> Option<u32> {
        let req_id = match op {
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
                0
            }
            SendOp::FetchAdd { remote, add, mask } => {
                self.send_atomic(AtomicOpcode::FetchAdd, remote, add, mask, 0, 0)
            }
            SendOp::CmpSwap {
                remote,
                compare,
                compare_mask,
                swap,
                swap_mask,
            } => self.send_atomic(
                AtomicOpcode::CmpSwap,
                remote,
                swap,
                swap_mask,
                compare,
                compare_mask,
            ),
            SendOp::Swap { remote, swap } => {
                self.send_atomic(AtomicOpcode::Swap, remote, swap, 0, 0, 0)
            }
            SendOp::AtomicWrite { remote, value } => {
                self.send_atomic(AtomicOpcode::Swap, remote, value, 0, 0, 0)
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
                req_id
            }
            SendOp::Send { .. }
            | SendOp::Write { .. }
            | SendOp::WriteImm { .. }
            | SendOp::Imm { .. } => return None,
        };
        Some(req_id)
    }

    /// The next segment of an RDMA Write (of a Write with Immediate when
    /// `imm_follows`, whose Immediate Data goes out after the last one).
    fn write_segment(&mut self, env: &Env, remote: Remote, total: u64, imm_follows: bool) {
        let Some(span) = self.next_span(total, TAGGED) else {
            return;
        };
        self.collect_pieces(span);
        let framed = self.frame_pieces(
            env,
            &RdmapRepr::Write {
                last: span.last,
                stag: remote.rkey,
                to: remote.addr.wrapping_add(span.offset as u64),
            },
        );
        if framed.is_err() {
            self.fail_head_local();
            return;
        }
        if !span.last {
            return;
        }
        if imm_follows {
            self.cursor = TxCursor {
                segments: None,
                write_done: true,
            };
        } else {
            self.finish_head(total);
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
    ) -> u32 {
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
        req_id
    }

    /// The head WR's request is out: it now waits for its response.
    fn start_response_wait(&mut self, req_id: u32) {
        let Some(wr) = self.sq.pop_front().map(|q| q.wr) else {
            return;
        };
        self.cursor = TxCursor::default();
        self.awaits_response(wr, req_id);
    }

    /// `wr`'s request is framed: it waits for its response `req_id`.
    fn awaits_response(&mut self, wr: SendWr, req_id: u32) {
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
            tx_mark: 0,
        });
    }

    /// The head WR's last segment is out: it is done.
    fn finish_head(&mut self, total: u64) {
        self.cursor = TxCursor::default();
        if let Some(wr) = self.sq.pop_front().map(|q| q.wr) {
            self.framed_whole(wr, total);
        }
    }

    /// `wr`'s last octet is framed: it completes once that is written.
    fn framed_whole(&mut self, wr: SendWr, total: u64) {
        self.in_flight.push_back(InFlight {
            wr_id: wr.wr_id,
            op: wr.op,
            sg_list: wr.sg_list,
            signaled: wr.signaled,
            status: Some(WcStatus::Success),
            byte_len: total.min(u32::MAX as u64) as u32,
            vendor_err: 0,
            req_id: 0,
            tx_mark: self.tx.queued_total(),
        });
    }

    /// The pieces of `span` in the head WR's SGEs, into `self.pieces`.
    fn collect_pieces(&mut self, span: SegmentSpan) {
        self.pieces.clear();
        let Some(wr) = self.sq.front() else {
            return;
        };
        if wr.inline {
            // The one SGE `post_inline` made names the slot.
            let start = wr.sg_list[0].addr as u32 + span.offset;
            self.pieces.push(Piece::Inline {
                start,
                len: span.len,
            });
            return;
        }
        local_pieces(&wr.sg_list, span.offset, span.len, &mut self.pieces);
    }

    /// Whether `wr` may start leaving now: a request needs an ORD credit,
    /// and a fenced WR waits for the Reads and atomics before it.
    fn may_start(&self, wr: &SendWr) -> bool {
        let out_of_credit = wr.op.needs_response() && self.ord_used >= self.neg.ord;
        let fenced = wr.fence && self.ord_used > 0;
        !(out_of_credit || fenced)
    }
}

/// The pieces of `sg_list` in the `len` octets from `offset`, onto `out`.
fn local_pieces(sg_list: &[Sge], offset: u32, len: u32, out: &mut Vec<Piece>) {
    // Checked at post time (or as a WR framed at once is copied); should
    // the region go away before the segment is framed, the WR fails (see
    // fail_head_local).
    for (sge, off, n) in sge_spans(sg_list, offset.into(), len.into()) {
        out.push(Piece::Local {
            lkey: sge.lkey,
            addr: sge.addr + off,
            // At most `len`.
            len: n as u32,
        });
    }
}

/// Append the payload octets of `pieces` to `out`: inline ones from
/// `slots`, the others read from registered memory under `scope`. Fails if
/// a piece's region is gone.
fn append_pieces(
    pieces: &[Piece],
    slots: &InlineSlots,
    scope: &ReadScope<'_>,
    pd: PdId,
    out: &mut Vec<u8>,
) -> Result<(), crate::wire::Error> {
    pieces.iter().try_for_each(|piece| {
        match *piece {
            Piece::Inline { start, len } => out.extend_from_slice(slots.get(start, len)),
            _ => out.extend_from_slice(piece.try_payload(scope, pd)?),
        }
        Ok(())
    })
}
