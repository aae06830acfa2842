//! [`RdmaStream`]: a byte stream (`AsyncRead + AsyncWrite`) over one RC QP.
//!
//! # Protocol
//!
//! Data goes as Sends into receives the peer posted in advance: each side
//! registers one region holding `slots` receive slots, `slots` send slots
//! (each `slot_size` bytes) and a few control slots. A message is a
//! 16-byte header then its payload:
//!
//! | bytes | field |
//! |---|---|
//! | 0 | kind: 1 data, 2 credit update, 3 close |
//! | 4..8 | data credits returned (little endian) |
//! | 8..12 | control credits returned |
//! | 12..16 | payload length |
//!
//! **Credits.** A side may have at most `slots` data messages and
//! [`CONTROL_SLOTS`] control messages (credit updates) unanswered: the
//! peer posted that many receives. A receive slot of data is reposted
//! when the reader has taken all its bytes, and its credit goes back on
//! the next message of any kind; a side with nothing to send returns
//! credits in a credit update once half the window is free, spending a
//! control credit (whose receive the peer reposts at once and returns on
//! its next message). So returning credits never needs data credits, and
//! two writers that both stopped reading block each other only as two
//! TCP sockets with full buffers do.
//!
//! **Backpressure.** `poll_write` is pending while the peer has no free
//! receive (no data credit) or every send slot is still in flight.
//!
//! **Close.** `poll_shutdown` sends a close message behind the data and
//! waits until every Send completed; the peer's reads return the bytes
//! before it, then end of stream. A stream dropped without shutdown
//! drops the connection: the peer's reads fail with `ConnectionReset`.
//!
//! **Why Sends, not Writes with Immediate.** Both cost one message and
//! one receive per chunk; Write with Immediate saves the receiver a copy
//! only if the application reads from the ring in place, which
//! `AsyncRead`'s caller-owned buffer does not allow, and on devices that
//! lack Write with Immediate it is emulated (two work requests). Sends
//! run natively everywhere and keep the ring management on the receiver.
//!
//! **Where the time goes** (session 7, stag0, `perf record -g` of both
//! sides of `async_bench ... stream`, 1 MiB writes). Under load (load
//! average 13) the writer spent 84% in the kernel, mostly the TCP send's
//! copy; the stream's own copy into a send slot (`memmove`) was 8% and
//! CRC32c 2%. On a quieter machine (load 3) the stream ran at 0.37-0.55x
//! of a tokio TcpStream while `stag bw write` ran above TCP, so there the
//! stream's own costs matter: on the reader's side the device's engine
//! thread does the socket reads (41% of the samples: `_copy_to_iter`) and
//! hands each message's completion to the reading task, which wakes
//! (`finish_task_switch` in both threads) and copies the bytes out again
//! (`memmove` 6%). Next steps, not done: let the reader drive the QP
//! itself (a spinning CQ, `StreamOptions::spin`, gained little: 1420 vs
//! 1272 MB/s medians of 4), fewer and larger messages (256 KiB slots
//! beat 64 KiB in one quiet run, 1799 vs 1272 MB/s, all samples apart,
//! but not clearly in a second, so the default stays 16 x 64 KiB, about
//! 2 MiB registered per side), and Writes with Immediate read in place.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context as TaskContext, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::cq::AsyncCompletionQueue;
use super::AsyncListener;
use crate::cm::ConnectOptions;
use crate::cq::{Completion, CompletionKind, WcStatus};
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion};
use crate::pd::ProtectionDomain;
use crate::qp::{QpCaps, QueuePair, WorkRequest};
use provider::wr::SendOp;

/// Control slots per side (credit updates in flight).
pub const CONTROL_SLOTS: usize = 2;

const HEADER: usize = 16;
const KIND_DATA: u8 = 1;
const KIND_CREDIT: u8 = 2;
const KIND_CLOSE: u8 = 3;

/// `wr_id` tags: which queue a completion belongs to (low bits: slot).
const TAG_RECV: u64 = 1 << 40;
const TAG_SEND: u64 = 2 << 40;
const TAG_CONTROL: u64 = 3 << 40;
const TAG_MASK: u64 = 0xff << 40;

/// The shape of a stream's buffers (both sides should agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamOptions {
    /// Receive slots (the window in messages); send slots as many.
    pub slots: usize,
    /// Bytes per slot, header included.
    pub slot_size: usize,
    /// The stream's CQ spins this long before sleeping
    /// ([`AsyncCompletionQueue::with_spin`]); zero by default. Local:
    /// the peer's may differ.
    pub spin: std::time::Duration,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            slots: 16,
            slot_size: 64 * 1024,
            spin: std::time::Duration::ZERO,
        }
    }
}

impl StreamOptions {
    fn check(&self) -> Result<()> {
        if self.slots < 2 || self.slot_size <= HEADER || self.slot_size > u32::MAX as usize {
            return Err(Error::InvalidRequest(
                "a stream needs 2 or more slots of more than 16 bytes",
            ));
        }
        Ok(())
    }

    fn recv_slots(&self) -> usize {
        self.slots + CONTROL_SLOTS
    }

    /// Region layout: receive slots, send slots, control headers.
    fn recv_offset(&self, i: usize) -> usize {
        i * self.slot_size
    }

    fn send_offset(&self, i: usize) -> usize {
        (self.recv_slots() + i) * self.slot_size
    }

    fn control_offset(&self, i: usize) -> usize {
        (self.recv_slots() + self.slots) * self.slot_size + i * HEADER
    }

    fn region_len(&self) -> usize {
        self.control_offset(CONTROL_SLOTS)
    }

    fn connect_options(&self) -> ConnectOptions {
        let depth = (self.slots + CONTROL_SLOTS + 1) as u32;
        ConnectOptions {
            caps: QpCaps {
                max_send_wr: depth,
                max_recv_wr: depth,
                max_sge: 1,
            },
            ..ConnectOptions::default()
        }
    }
}

/// A byte stream over one RC QP: tokio's `AsyncRead + AsyncWrite`.
///
/// Reads and writes may come from different tasks
/// (`tokio::io::split`); whichever polls drains the stream's CQ and wakes
/// the other when its state changed.
pub struct RdmaStream {
    shared: Arc<StreamShared>,
}

impl std::fmt::Debug for RdmaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaStream")
            .field("qp_num", &self.shared.qp.qp_num())
            .finish_non_exhaustive()
    }
}

struct StreamShared {
    qp: QueuePair,
    cq: AsyncCompletionQueue,
    mr: MemoryRegion,
    opts: StreamOptions,
    state: Mutex<StreamState>,
}

#[derive(Default)]
struct StreamState {
    /// Received data not yet read: (receive slot, next byte, end).
    inbox: VecDeque<(usize, usize, usize)>,
    /// The peer sent close: after `inbox`, end of stream.
    peer_closed: bool,
    /// The connection failed (a flushed or failed completion).
    broken: Option<WcStatus>,
    /// Data messages the peer can take now.
    data_credits: usize,
    /// Credit updates the peer can take now.
    control_credits: usize,
    /// Credits owed to the peer (receives reposted since the last return).
    data_owed: u32,
    control_owed: u32,
    /// Send slots free to fill, and control slots.
    free_send: Vec<usize>,
    free_control: Vec<usize>,
    /// Sends posted and not completed.
    in_flight: usize,
    /// Close sent.
    closed: bool,
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
    scratch: Vec<Completion>,
}

enum Side {
    Read,
    Write,
}

impl RdmaStream {
    /// Connect to an [`RdmaStream::accept`]ing listener at `addr`.
    pub async fn connect(
        pd: &ProtectionDomain,
        addr: SocketAddr,
        opts: StreamOptions,
    ) -> Result<RdmaStream> {
        let (mr, cq) = Self::resources(pd, &opts)?;
        let pre = Self::pre_post(mr.clone(), opts);
        let (qp, _) = super::connect_with(pd, &cq, addr, &opts.connect_options(), pre).await?;
        Ok(Self::started(qp.qp().clone(), cq, mr, opts))
    }

    /// Accept the next connection of `listener` as a stream.
    pub async fn accept(
        listener: &AsyncListener,
        pd: &ProtectionDomain,
        opts: StreamOptions,
    ) -> Result<RdmaStream> {
        let (mr, cq) = Self::resources(pd, &opts)?;
        let pre = Self::pre_post(mr.clone(), opts);
        let (qp, _) = listener
            .accept_with(pd, &cq, &opts.connect_options(), pre)
            .await?;
        Ok(Self::started(qp.qp().clone(), cq, mr, opts))
    }

    fn resources(
        pd: &ProtectionDomain,
        opts: &StreamOptions,
    ) -> Result<(MemoryRegion, AsyncCompletionQueue)> {
        opts.check()?;
        let mr = pd.alloc_mr(opts.region_len(), Access::LOCAL_WRITE)?;
        let depth = 2 * (opts.slots + CONTROL_SLOTS) as u32 + 2;
        let cq = AsyncCompletionQueue::with_spin(pd.context().create_cq(depth)?, opts.spin)?;
        Ok((mr, cq))
    }

    /// Post every receive slot before the connection exists.
    fn pre_post(
        mr: MemoryRegion,
        opts: StreamOptions,
    ) -> impl FnOnce(&QueuePair) -> Result<()> + Send + 'static {
        move |qp| {
            for i in 0..opts.recv_slots() {
                qp.post_recv(
                    TAG_RECV | i as u64,
                    &[mr.slice(opts.recv_offset(i), opts.slot_size)?],
                )?;
            }
            Ok(())
        }
    }

    fn started(
        qp: QueuePair,
        cq: AsyncCompletionQueue,
        mr: MemoryRegion,
        opts: StreamOptions,
    ) -> RdmaStream {
        let state = StreamState {
            data_credits: opts.slots,
            control_credits: CONTROL_SLOTS,
            free_send: (0..opts.slots).rev().collect(),
            free_control: (0..CONTROL_SLOTS).collect(),
            ..StreamState::default()
        };
        RdmaStream {
            shared: Arc::new(StreamShared {
                qp,
                cq,
                mr,
                opts,
                state: Mutex::new(state),
            }),
        }
    }

    /// The QP underneath.
    pub fn qp(&self) -> &QueuePair {
        &self.shared.qp
    }
}

fn io_err(e: Error) -> io::Error {
    match e {
        Error::Io(e) => e,
        e => io::Error::other(e),
    }
}

impl StreamShared {
    fn lock(&self) -> MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take what the CQ has (registering `cx` when it has nothing) and
    /// apply it; Ready when something was applied.
    fn poll_progress(
        &self,
        st: &mut StreamState,
        cx: &mut TaskContext<'_>,
        side: Side,
    ) -> Poll<io::Result<()>> {
        let mut batch = std::mem::take(&mut st.scratch);
        let polled = self.cq.poll_drain(cx, &mut batch, 64);
        let r = match polled {
            Poll::Pending => {
                let w = Some(cx.waker().clone());
                match side {
                    Side::Read => st.read_waker = w,
                    Side::Write => st.write_waker = w,
                }
                Poll::Pending
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(io_err(e))),
            Poll::Ready(Ok(_)) => {
                for c in batch.drain(..) {
                    self.apply(st, c);
                }
                // The other side may be waiting for what arrived (or for
                // the fd's watch this task took over).
                let other = match side {
                    Side::Read => st.write_waker.take(),
                    Side::Write => st.read_waker.take(),
                };
                if let Some(w) = other {
                    w.wake();
                }
                Poll::Ready(self.return_credits(st, false).map_err(io_err))
            }
        };
        st.scratch = batch;
        r
    }

    fn apply(&self, st: &mut StreamState, c: Completion) {
        let slot = (c.wr_id & !TAG_MASK) as usize;
        if !c.is_ok() {
            if st.broken.is_none() {
                st.broken = Some(c.status);
            }
            match c.wr_id & TAG_MASK {
                TAG_SEND | TAG_CONTROL => st.in_flight = st.in_flight.saturating_sub(1),
                _ => {}
            }
            return;
        }
        match (c.wr_id & TAG_MASK, c.kind) {
            (TAG_SEND, _) => {
                st.in_flight -= 1;
                st.free_send.push(slot);
            }
            (TAG_CONTROL, _) => {
                st.in_flight -= 1;
                st.free_control.push(slot);
            }
            (TAG_RECV, CompletionKind::Recv { len, .. }) => self.received(st, slot, len as usize),
            _ => {}
        }
    }

    /// A message landed in receive slot `slot`.
    fn received(&self, st: &mut StreamState, slot: usize, len: usize) {
        let base = self.opts.recv_offset(slot);
        let mut h = [0u8; HEADER];
        if len < HEADER || self.mr.read_at(base, &mut h).is_err() {
            st.broken = Some(WcStatus::LocLenErr);
            return;
        }
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        st.data_credits += word(4) as usize;
        st.control_credits += word(8) as usize;
        let payload = (word(12) as usize).min(len - HEADER);
        match h[0] {
            KIND_DATA if payload > 0 => {
                st.inbox
                    .push_back((slot, base + HEADER, base + HEADER + payload))
            }
            KIND_CLOSE => {
                st.peer_closed = true;
                self.repost(st, slot, true);
            }
            KIND_CREDIT => self.repost(st, slot, false),
            _ => self.repost(st, slot, true),
        }
    }

    /// Give receive slot `slot` back to the QP; its credit is owed.
    fn repost(&self, st: &mut StreamState, slot: usize, data: bool) {
        let posted = self
            .mr
            .slice(self.opts.recv_offset(slot), self.opts.slot_size)
            .and_then(|s| self.qp.post_recv(TAG_RECV | slot as u64, &[s]));
        if posted.is_err() {
            st.broken.get_or_insert(WcStatus::LocQpOpErr);
            return;
        }
        if data {
            st.data_owed += 1;
        } else {
            st.control_owed += 1;
        }
    }

    /// Send a credit update when half the window is owed (or `force`).
    fn return_credits(&self, st: &mut StreamState, force: bool) -> Result<()> {
        let due = st.data_owed as usize * 2 >= self.opts.slots
            || (force && st.data_owed + st.control_owed > 0);
        if !due || st.broken.is_some() || st.control_credits == 0 {
            return Ok(());
        }
        let Some(i) = st.free_control.pop() else {
            return Ok(());
        };
        let at = self.opts.control_offset(i);
        self.mr.write_at(at, &self.header(st, KIND_CREDIT, 0))?;
        let slice = self.mr.slice(at, HEADER)?;
        let wr = WorkRequest::new(
            TAG_CONTROL | i as u64,
            send_op(),
            std::slice::from_ref(&slice),
        );
        if let Err(e) = self.qp.post_send(wr) {
            st.free_control.push(i);
            return Err(e);
        }
        st.control_credits -= 1;
        st.in_flight += 1;
        st.data_owed = 0;
        st.control_owed = 0;
        Ok(())
    }

    /// A header returning every owed credit.
    fn header(&self, st: &StreamState, kind: u8, len: usize) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[0] = kind;
        h[4..8].copy_from_slice(&st.data_owed.to_le_bytes());
        h[8..12].copy_from_slice(&st.control_owed.to_le_bytes());
        h[12..16].copy_from_slice(&(len as u32).to_le_bytes());
        h
    }

    /// Post one data (or close) message of `payload`, when a send slot and
    /// a data credit are free; `None` when not.
    fn try_send(&self, st: &mut StreamState, kind: u8, payload: &[u8]) -> Result<Option<usize>> {
        if st.data_credits == 0 {
            return Ok(None);
        }
        let Some(i) = st.free_send.pop() else {
            return Ok(None);
        };
        let n = payload.len().min(self.opts.slot_size - HEADER);
        let at = self.opts.send_offset(i);
        let sent = (|| {
            self.mr.write_at(at, &self.header(st, kind, n))?;
            self.mr.write_at(at + HEADER, &payload[..n])?;
            let slice = self.mr.slice(at, HEADER + n)?;
            let wr = WorkRequest::new(TAG_SEND | i as u64, send_op(), std::slice::from_ref(&slice));
            self.qp.post_send(wr)
        })();
        if let Err(e) = sent {
            st.free_send.push(i);
            return Err(e);
        }
        st.data_credits -= 1;
        st.in_flight += 1;
        st.data_owed = 0;
        st.control_owed = 0;
        Ok(Some(n))
    }

    fn broken_error(st: &StreamState) -> io::Error {
        let status = st.broken.map(|s| s.as_str()).unwrap_or("unknown");
        io::Error::new(
            io::ErrorKind::ConnectionReset,
            format!("the RDMA stream's connection failed ({status})"),
        )
    }
}

fn send_op() -> SendOp {
    SendOp::Send {
        solicited: false,
        invalidate: None,
    }
}

impl AsyncRead for RdmaStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        loop {
            if let Some(&(slot, at, end)) = st.inbox.front() {
                let n = (end - at).min(buf.remaining());
                let dst = buf.initialize_unfilled_to(n);
                sh.mr.read_at(at, dst).map_err(io_err)?;
                buf.advance(n);
                if at + n == end {
                    st.inbox.pop_front();
                    sh.repost(&mut st, slot, true);
                    sh.return_credits(&mut st, false).map_err(io_err)?;
                } else if let Some(front) = st.inbox.front_mut() {
                    front.1 = at + n;
                }
                return Poll::Ready(Ok(()));
            }
            if st.peer_closed {
                return Poll::Ready(Ok(()));
            }
            if st.broken.is_some() {
                return Poll::Ready(Err(StreamShared::broken_error(&st)));
            }
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if sh.poll_progress(&mut st, cx, Side::Read)?.is_pending() {
                return Poll::Pending;
            }
        }
    }
}

impl AsyncWrite for RdmaStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        loop {
            if st.broken.is_some() {
                return Poll::Ready(Err(StreamShared::broken_error(&st)));
            }
            if st.closed {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "write after shutdown",
                )));
            }
            if buf.is_empty() {
                return Poll::Ready(Ok(0));
            }
            if let Some(n) = sh.try_send(&mut st, KIND_DATA, buf).map_err(io_err)? {
                return Poll::Ready(Ok(n));
            }
            if sh.poll_progress(&mut st, cx, Side::Write)?.is_pending() {
                return Poll::Pending;
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        // Every write posted its message: nothing is buffered here.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        loop {
            if st.broken.is_some() {
                return Poll::Ready(Err(StreamShared::broken_error(&st)));
            }
            if !st.closed
                && sh
                    .try_send(&mut st, KIND_CLOSE, &[])
                    .map_err(io_err)?
                    .is_some()
            {
                st.closed = true;
            }
            if st.closed && st.in_flight == 0 {
                return Poll::Ready(Ok(()));
            }
            if sh.poll_progress(&mut st, cx, Side::Write)?.is_pending() {
                return Poll::Pending;
            }
        }
    }
}
