//! [`RdmaStream`]: a byte stream (`AsyncRead + AsyncWrite`) over one RC QP.
//!
//! # Protocol
//!
//! Data goes as RDMA Writes with Immediate into a ring of slots the
//! peer registered (its address and rkey travel in the connection's
//! private data, 20 bytes, little endian: address, rkey, then the ring's
//! `slots` and `slot_size`, which both ends must share: a stream whose
//! peer's differ fails at once with an error that says so), where the
//! connection runs Write with Immediate natively (stag0 to stag0), and as
//! Sends into the peer's posted receives where it does not (libibverbs
//! devices, whose 4-byte immediate stag emulates with three work
//! requests and an agent: a Send is cheaper there). Each side registers
//! one region holding `slots` ring slots (written by the peer), `slots`
//! send slots where a message is staged, `slots` + [`CONTROL_SLOTS`]
//! receive slots (each `slot_size` bytes) and small control buffers. A
//! ring slot is the sender's choice, in turn (0, 1, ..., `slots - 1`,
//! 0, ...), and the Immediate Data names it; the Immediate consumes a
//! receive, which is reposted at once. Credit updates are Sends of a bare
//! header. A message is a 16-byte header then its payload:
//!
//! | bytes | field |
//! |---|---|
//! | 0 | kind: 1 data, 2 credit update, 3 close |
//! | 4..8 | data credits returned (little endian) |
//! | 8..12 | control credits returned |
//! | 12..16 | payload length |
//!
//! **Credits.** A side may have at most `slots` data messages (ring
//! slots, or receives) and [`CONTROL_SLOTS`] control messages (credit
//! updates) unanswered. The reader empties ring slots in the order they
//! were written (RC order), so a credit says which slot is free next:
//! the oldest one. A data message's credit goes back once the reader has
//! taken all its bytes (a receive that held them is reposted then), on
//! the next message of any kind; a side with nothing to send returns
//! credits in a credit update once half the window is free, spending a
//! control credit (whose receive the peer reposts at once and returns on
//! its next message). So returning credits never needs data credits, and
//! two writers that both stopped reading block each other only as two
//! TCP sockets with full buffers do. The receives outnumber what may be
//! outstanding (`slots` data plus [`CONTROL_SLOTS`] control), so a
//! message always finds one.
//!
//! **Backpressure.** `poll_write` is pending while the peer has no free
//! receive (no data credit) or every send slot is still in flight.
//!
//! **Zero copy.** [`RdmaStream::send_slot`] and [`RdmaStream::recv_slot`]
//! lend the registered slots themselves, beside the traits and on the
//! same ring, credits and close (module `slots`): the caller writes a
//! message in place and reads it where it landed, where the traits copy
//! in and out.
//!
//! **Close.** `poll_shutdown` sends a close message behind the data and
//! waits until every Send completed; the peer's reads return the bytes
//! before it, then end of stream. A stream dropped without shutdown
//! drops the connection: the peer's reads fail with `ConnectionReset`.
//!
//! **Why Writes with Immediate, where native.** Both cost one message
//! and one receive per chunk, but on stag0 a Send's payload is read from
//! the socket into a buffer of the driver and copied again into the
//! receive (only tagged segments, RDMA Writes, are placed straight from
//! the socket into registered memory). Session 8's profile of the reader
//! (`perf record -g`, 1 MiB writes, Sends) had 29% of its samples in the
//! engine thread's `memmove` into the receive, more than its socket reads
//! (`_copy_to_iter`, 8%); with Writes that copy is gone (4% left).
//! Session 10 saw Sends ahead in one run (0.94× against 0.73× of tokio's
//! TcpStream); session 11 measured both again, alternating in the same
//! rounds (1 MiB writes, 512 MiB, `async_bench`): over 7-8 rounds in each
//! of 5 runs at load 7-16 (two with a `nice -n 19` loop per core), Sends
//! beat Writes with Immediate in 5 of the 10 paired comparisons and lost
//! in 5 (medians of each round's stream/TCP 0.63-1.20 against 0.68-0.91),
//! and in `bench-async.sh` at load 8-12, 1873 against 1736 MB/s: a coin
//! toss at these loads, not a win, so Writes with Immediate stay the
//! default (and keep the engine's copy out at low load, above).
//!
//! **Waking.** A stream that finds nothing to do sleeps on its CQ (armed)
//! and, on stag0, on its QP's socket as well, which the device's engine
//! then leaves alone (`QueuePair::begin_socket_wait` in the provider, as a
//! thread in a blocking CQ wait does). The peer's next message wakes the
//! task from tokio's reactor and the task reads it itself: one wake-up per
//! message, as a TCP socket costs, where through the engine it cost two
//! (the engine thread's, then the task's through the CQ's fd). Session 9,
//! tonic unary calls over one stream (CQ spin 0, 2000 calls, medians of 3
//! alternating rounds at load 10-14): 154-197 µs through the engine,
//! 127 µs woken by the socket, tonic over TCP 57-63; the server's engine
//! thread woke 8578 times in 4400 calls before, 1298 after.
//!
//! **Where the time goes** (session 12, `perf record -g` of both ends,
//! 2 GiB in 1 MiB writes, Writes with Immediate, load 3-4). The writer:
//! its copy into the send slots 18% of its samples, the socket send's
//! copy 13%, CRC32c 8%, the rest TCP and scheduling. The reader: socket
//! reads 34% (the kernel's copy 17%), the copy out to the caller 12%,
//! CRC32c 6%, and 5.6% copying payload out of the provider's read
//! buffer: after each Write's Immediate Data the provider went back to
//! reading all there was, so the next Write's payload came through its
//! buffer instead of straight into the ring, and a 64 KiB slot was two
//! DDP segments, 65024 + 512 bytes, the second read on its own. Both are
//! gone (slots of [`StreamOptions::DEFAULT_SLOT_SIZE`], and the provider
//! keeps reading header by header across an Immediate): every payload is
//! placed straight from the socket, and the reader makes 0.5 `recvfrom`
//! per message where it made 1.7. `stag bw write`, which the stream is
//! held against, copies nothing on either side: the two copies here are
//! what `AsyncRead`/`AsyncWrite` ask for (the caller's buffers are not
//! registered, and may be reused or dropped once a call returns).

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context as TaskContext, Poll, Waker};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

mod slots;

pub use slots::{RecvSlot, SendSlot};

use super::cq::AsyncCompletionQueue;
use super::AsyncListener;
use crate::caps::OpKind;
use crate::cm::ConnectOptions;
use crate::cq::{Completion, CompletionKind, WcStatus};
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion};
use crate::pd::ProtectionDomain;
use crate::qp::{QpCaps, QueuePair, WorkRequest};
use provider::wr::{Remote, SendOp};

/// Control slots per side (credit updates in flight).
pub const CONTROL_SLOTS: usize = 2;

/// Data messages per post list: a large write goes out in pieces, so the
/// peer starts reading the first while this side still copies the rest
/// into its send slots (one post list for a whole 1 MiB write left the
/// reader idle for the copy).
const POST_BATCH: usize = 4;

const HEADER: usize = 16;
const KIND_DATA: u8 = 1;
const KIND_CREDIT: u8 = 2;
const KIND_CLOSE: u8 = 3;

/// `wr_id` tags: which queue a completion belongs to (low bits: slot).
const TAG_RECV: u64 = 1 << 40;
const TAG_SEND: u64 = 2 << 40;
const TAG_CONTROL: u64 = 3 << 40;
const TAG_MASK: u64 = 0xff << 40;

/// The shape of a stream's buffers. `slots` and `slot_size` must be the
/// same on both ends (each says its own when they connect, and a stream
/// whose peer's differ fails with an error); the rest is local.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamOptions {
    /// Receive slots (the window in messages); send slots as many.
    pub slots: usize,
    /// Bytes per slot, header included.
    pub slot_size: usize,
    /// The stream's CQ spins this long before sleeping
    /// ([`AsyncCompletionQueue::with_spin`]);
    /// [`DEFAULT_SPIN`](Self::DEFAULT_SPIN) by default, zero to sleep at
    /// once. Local: the peer's may differ.
    pub spin: std::time::Duration,
    /// Send data as Writes with Immediate into the peer's ring where the
    /// connection runs them natively (true by default); false: always as
    /// Sends. Local: the peer reads either.
    pub write_imm: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            slots: 16,
            slot_size: StreamOptions::DEFAULT_SLOT_SIZE,
            spin: StreamOptions::DEFAULT_SPIN,
            write_imm: true,
        }
    }
}

impl StreamOptions {
    /// The size of a slot by default, header included: a message that
    /// fills one is one DDP segment on stag0 (whose segments carry at
    /// most 65536 - 512 bytes). A 64 KiB slot went as a 65024-byte
    /// segment and a 512-byte one, which the peer reads with a syscall of
    /// its own and copies out of its read buffer (`strace -c` of the
    /// reader, 256 MiB in 1 MiB writes: see `DEFAULT_SLOT_SIZE`'s commit).
    pub const DEFAULT_SLOT_SIZE: usize = 65536 - 512;

    /// The spin of a stream's CQ by default ([`spin`](Self::spin)): while
    /// bytes flow, the task reading or writing finds the next completion
    /// itself, driving the QP from its own thread (on stag0 it reads the
    /// socket), rather than sleeping until the device's engine thread has
    /// read it and signalled the CQ: a hand-off and a wake-up per message.
    /// Session 8, `async_bench ... stream`, 1 MiB writes, 6 alternating
    /// rounds at load 4-5, medians: no spin 1416 MB/s, 50 µs 2056, 200 µs
    /// 2879, 1 ms 1874, tokio's TcpStream 3005. An idle stream spins once,
    /// this long, then sleeps.
    pub const DEFAULT_SPIN: std::time::Duration = std::time::Duration::from_micros(200);

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

    /// Region layout: ring slots (the peer writes them), send slots,
    /// receive buffers, control headers.
    fn ring_offset(&self, i: usize) -> usize {
        i * self.slot_size
    }

    fn send_offset(&self, i: usize) -> usize {
        (self.slots + i) * self.slot_size
    }

    fn recv_offset(&self, i: usize) -> usize {
        (2 * self.slots + i) * self.slot_size
    }

    fn control_offset(&self, i: usize) -> usize {
        self.recv_offset(self.recv_slots()) + i * HEADER
    }

    fn region_len(&self) -> usize {
        self.control_offset(CONTROL_SLOTS)
    }

    /// `ring`: this side's ring, for the peer (private data).
    fn connect_options(&self, ring: &MemoryRegion) -> ConnectOptions {
        let depth = (self.slots + CONTROL_SLOTS + 1) as u32;
        let place = ring.remote(0);
        let mut private_data = place.addr.to_le_bytes().to_vec();
        private_data.extend_from_slice(&place.rkey.to_le_bytes());
        private_data.extend_from_slice(&(self.slots as u32).to_le_bytes());
        private_data.extend_from_slice(&(self.slot_size as u32).to_le_bytes());
        ConnectOptions {
            caps: QpCaps {
                max_send_wr: depth,
                max_recv_wr: depth,
                max_sge: 1,
            },
            private_data,
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
    /// The peer's ring (its slot 0).
    peer_ring: Remote,
    /// Data goes as Writes with Immediate into `peer_ring` (this
    /// connection runs them natively), else as Sends.
    write_imm: bool,
    opts: StreamOptions,
    /// The QP's socket (a duplicate) on this runtime's reactor, where the
    /// device has one (stag0): a stream that sleeps sleeps on it as well
    /// as on the CQ, so the peer's next message wakes the task itself,
    /// which reads it, and not first the device's engine thread, which
    /// would read it and then signal the CQ (see "Waking" above).
    sock: Option<AsyncFd<OwnedFd>>,
    state: Mutex<StreamState>,
}

#[derive(Default)]
struct StreamState {
    /// Received data not yet read, oldest first: (the receive it came
    /// in, for a Send; next byte, end) in the region.
    inbox: VecDeque<(Option<usize>, usize, usize)>,
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
    /// The peer's ring slot the next data message goes to.
    ring_next: usize,
    /// Send slots free to fill, and control slots.
    free_send: Vec<usize>,
    free_control: Vec<usize>,
    /// This side's close, as `shutdown` tracks it.
    close: Close,
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
    /// Tasks waiting in `send_slot` or `recv_slot` (which take `&self`,
    /// so several may wait at once).
    slot_wakers: Vec<Waker>,
    /// Messages handed out as [`RecvSlot`]s, oldest first: (the receive
    /// it came in, for a Send; the guard was dropped). Their credits go
    /// back in this order (the peer refills the oldest ring slot first).
    recv_held: VecDeque<(Option<usize>, bool)>,
    /// The sequence number of `recv_held`'s front.
    recv_held_first: u64,
    scratch: Vec<Completion>,
    /// The engine left the socket to this stream's sleep
    /// (`QueuePair::socket_wait(true)`, undone at the next poll).
    sock_waiting: bool,
}

enum Side {
    Read,
    Write,
    /// A `send_slot` or `recv_slot` future.
    Slot,
}

/// This side's close. `shutdown` succeeds once the close's own completion
/// comes back without error: a QP completes its Sends in order, so every
/// byte written before it left too. Sends posted after it (credit returns
/// for what this side still reads) are none of `shutdown`'s business: the
/// peer, having read the close, may drop its end and flush them, and that
/// is the reading side's end of stream, not a failed close.
#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
enum Close {
    #[default]
    Open,
    /// Posted as the work request with this id.
    Posted(u64),
    /// Its completion came back without error.
    Sent,
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
        let (qp, private) =
            super::connect_with(pd, &cq, addr, &opts.connect_options(&mr), pre).await?;
        Self::started(qp.qp().clone(), cq, mr, &private, opts)
    }

    /// Accept the next connection of `listener` as a stream.
    pub async fn accept(
        listener: &AsyncListener,
        pd: &ProtectionDomain,
        opts: StreamOptions,
    ) -> Result<RdmaStream> {
        let (mr, cq) = Self::resources(pd, &opts)?;
        let pre = Self::pre_post(mr.clone(), opts);
        let (qp, private) = listener
            .accept_with(pd, &cq, &opts.connect_options(&mr), pre)
            .await?;
        Self::started(qp.qp().clone(), cq, mr, &private, opts)
    }

    fn resources(
        pd: &ProtectionDomain,
        opts: &StreamOptions,
    ) -> Result<(MemoryRegion, AsyncCompletionQueue)> {
        opts.check()?;
        let mr = pd.alloc_mr(
            opts.region_len(),
            Access::LOCAL_WRITE.union(Access::REMOTE_WRITE),
        )?;
        let depth = 2 * (opts.slots + CONTROL_SLOTS) as u32 + 2;
        let cq = AsyncCompletionQueue::with_spin(pd.context().create_cq(depth)?, opts.spin)?;
        Ok((mr, cq))
    }

    /// Post every receive before the connection exists.
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
        private: &[u8],
        opts: StreamOptions,
    ) -> Result<RdmaStream> {
        let (Some(addr), Some(rkey)) = (private.get(..8), private.get(8..12)) else {
            // Dropping the QP disconnects: the peer's stream fails.
            return Err(Error::InvalidRequest(
                "the peer sent no ring in its private data: not an RdmaStream",
            ));
        };
        let peer_ring = Remote {
            addr: u64::from_le_bytes(addr.try_into().unwrap_or_default()),
            rkey: u32::from_le_bytes(rkey.try_into().unwrap_or_default()),
        };
        // Each side computes where the other's ring slots lie from its
        // own options: a peer with another geometry would write across
        // slot boundaries (or past the ring), so it is refused here.
        let word = |at: usize| {
            private
                .get(at..at + 4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        };
        match (word(12), word(16)) {
            (Some(slots), Some(slot_size))
                if slots == opts.slots && slot_size == opts.slot_size => {}
            (Some(_), Some(_)) => {
                return Err(Error::InvalidRequest(
                    "the peer's RdmaStream has other slots or slot_size \
                     (StreamOptions must match on both ends)",
                ))
            }
            _ => {
                return Err(Error::InvalidRequest(
                    "the peer's RdmaStream did not say its slots and slot_size \
                     (an older build?)",
                ))
            }
        }
        let state = StreamState {
            data_credits: opts.slots,
            control_credits: CONTROL_SLOTS,
            free_send: (0..opts.slots).rev().collect(),
            free_control: (0..CONTROL_SLOTS).collect(),
            ..StreamState::default()
        };
        let write_imm = opts.write_imm && qp.capabilities().get(OpKind::WriteImm).is_native();
        // Without it the stream sleeps on the CQ alone (libibverbs devices).
        let sock = qp
            .socket_wait_fd()
            .and_then(|(fd, _)| fd.try_clone_to_owned().ok())
            .and_then(watch_socket);
        Ok(RdmaStream {
            shared: Arc::new(StreamShared {
                qp,
                cq,
                mr,
                peer_ring,
                write_imm,
                opts,
                sock,
                state: Mutex::new(state),
            }),
        })
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
        let polled = match self.look_asleep(st, cx, &mut batch) {
            Some(polled) => polled,
            None => {
                if std::mem::take(&mut st.sock_waiting) {
                    self.qp.socket_wait(false);
                }
                loop {
                    let mut asleep = false;
                    // It will sleep on its socket (see `sleep_on_socket`).
                    let own_socket =
                        self.sock.is_some() && matches!(self.qp.socket_wait_fd(), Some((_, false)));
                    match self
                        .cq
                        .poll_drain_asleep(cx, &mut batch, 64, own_socket, &mut asleep)
                    {
                        // The socket has input. This task is the waiter
                        // that kept it, and a look at an armed CQ leaves
                        // such a QP to its waiter (the provider's
                        // `kept_by_waiter`, which saves a channel waiter an
                        // empty read): drive it here, then look again.
                        Poll::Pending if asleep && self.sleep_on_socket(st, cx) => {
                            self.qp.progress();
                            continue;
                        }
                        polled => break polled,
                    }
                }
            }
        };
        let r = match polled {
            Poll::Pending => {
                let w = cx.waker();
                match side {
                    Side::Read => st.read_waker = Some(w.clone()),
                    Side::Write => st.write_waker = Some(w.clone()),
                    Side::Slot => {
                        if !st.slot_wakers.iter().any(|o| o.will_wake(w)) {
                            st.slot_wakers.push(w.clone());
                        }
                    }
                }
                Poll::Pending
            }
            Poll::Ready(Err(e)) => {
                // Every other waiter meets the error when it looks.
                Self::wake_others(st, &side);
                Poll::Ready(Err(io_err(e)))
            }
            Poll::Ready(Ok(_)) => {
                for c in batch.drain(..) {
                    self.apply(st, c);
                }
                // The others may be waiting for what arrived (or for the
                // fd's watch this task took over: the reactor wakes only
                // the last task that registered on it).
                Self::wake_others(st, &side);
                Poll::Ready(self.return_credits(st, false).map_err(io_err))
            }
        };
        st.scratch = batch;
        r
    }

    /// Wake the tasks waiting on the stream other than `side`'s own (a
    /// slot future wakes the other slot futures too).
    fn wake_others(st: &mut StreamState, side: &Side) {
        let read = (!matches!(side, Side::Read)).then(|| st.read_waker.take());
        let write = (!matches!(side, Side::Write)).then(|| st.write_waker.take());
        for w in read.into_iter().chain(write).flatten() {
            w.wake();
        }
        for w in st.slot_wakers.drain(..) {
            w.wake();
        }
    }

    /// A stream asleep on its socket and its CQ, polled again before
    /// either woke it (hyper polls its read after each write, and again
    /// when its other futures wake the task): tokio's reactor has not
    /// seen the socket readable, so no input waits, and a look at the CQ
    /// as usual would only drive the QP for nothing (a `recvfrom` that
    /// fails with EAGAIN), acknowledge an event fd that has no event (a
    /// `read`), re-arm and `poll(2)` the socket: session 9 counted 13
    /// `recvfrom` and 10 `read` per tonic call, 1 of each over TCP. So
    /// take what the CQ already holds, driving nothing, and stay asleep
    /// (`cx` registered on both fds) when that is nothing; as a TCP
    /// socket whose readiness is clear returns Pending without a syscall.
    /// `None`: not asleep on the socket, or it (or the CQ) may have
    /// something: the full look.
    fn look_asleep(
        &self,
        st: &StreamState,
        cx: &mut TaskContext<'_>,
        batch: &mut Vec<Completion>,
    ) -> Option<Poll<Result<usize>>> {
        if !st.sock_waiting {
            return None;
        }
        let sock = self.sock.as_ref()?;
        // Output left waiting for the socket to drain: the engine must
        // watch it for writing (the full look leaves it to the engine).
        if !matches!(self.qp.socket_wait_fd(), Some((_, false))) {
            return None;
        }
        if sock.poll_read_ready(cx).is_ready() {
            return None;
        }
        match self.cq.look_asleep(cx, batch, 64) {
            Err(e) => Some(Poll::Ready(Err(e))),
            Ok(None) => None,
            Ok(Some(0)) => Some(Poll::Pending),
            Ok(Some(n)) => Some(Poll::Ready(Ok(n))),
        }
    }

    /// The task sleeps on the CQ (armed, `cx` registered on its fd): have
    /// it sleep on the QP's socket too, which the engine then leaves
    /// alone. True when the socket has input now (the caller drives the QP
    /// and looks again), false when asleep on both (or on the CQ alone:
    /// no socket, or one that waits to be writable, which the engine
    /// watches).
    fn sleep_on_socket(&self, st: &mut StreamState, cx: &mut TaskContext<'_>) -> bool {
        let Some(sock) = &self.sock else {
            return false;
        };
        if !matches!(self.qp.socket_wait_fd(), Some((_, false))) {
            return false;
        }
        self.qp.socket_wait(true);
        st.sock_waiting = true;
        loop {
            let Poll::Ready(Ok(mut ready)) = sock.poll_read_ready(cx) else {
                // Pending: asleep. An error: the CQ still wakes the task.
                return false;
            };
            // The reactor's readiness may be older than the last read
            // (every look at the CQ drives the QP): ask the socket itself.
            // Input that comes after this look sets the readiness again.
            if readable_now(sock.get_ref()) {
                self.qp.socket_wait(false);
                st.sock_waiting = false;
                return true;
            }
            ready.clear_ready();
        }
    }

    fn apply(&self, st: &mut StreamState, c: Completion) {
        let slot = (c.wr_id & !TAG_MASK) as usize;
        if !c.is_ok() {
            if st.broken.is_none() {
                st.broken = Some(c.status);
            }
            return;
        }
        match (c.wr_id & TAG_MASK, c.kind) {
            (TAG_SEND, _) => {
                if st.close == Close::Posted(c.wr_id) {
                    st.close = Close::Sent;
                }
                st.free_send.push(slot);
            }
            (TAG_CONTROL, _) => st.free_control.push(slot),
            (
                TAG_RECV,
                CompletionKind::Recv {
                    imm: Some(ring), ..
                },
            ) => {
                self.repost(st, slot);
                self.received(st, ring as usize);
            }
            (TAG_RECV, CompletionKind::Recv { len, .. }) => {
                self.send_received(st, slot, len as usize)
            }
            _ => {}
        }
    }

    /// Read a 16-byte header at `at`: (kind, data credits, control
    /// credits, payload length).
    fn read_header(&self, at: usize) -> Result<(u8, usize, usize, usize)> {
        let mut h = [0u8; HEADER];
        self.mr.read_at(at, &mut h)?;
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]) as usize;
        Ok((h[0], word(4), word(8), word(12)))
    }

    /// A data (or close) message landed in ring slot `ring`.
    fn received(&self, st: &mut StreamState, ring: usize) {
        let base = self.opts.ring_offset(ring);
        let header = (ring < self.opts.slots)
            .then(|| self.read_header(base).ok())
            .flatten();
        let Some((kind, data, control, len)) = header else {
            st.broken.get_or_insert(WcStatus::LocLenErr);
            return;
        };
        st.data_credits += data;
        st.control_credits += control;
        let payload = len.min(self.opts.slot_size - HEADER);
        match kind {
            KIND_DATA if payload > 0 => {
                st.inbox
                    .push_back((None, base + HEADER, base + HEADER + payload))
            }
            KIND_CLOSE => {
                st.peer_closed = true;
                st.data_owed += 1;
            }
            // The slot is empty: free at once.
            _ => st.data_owed += 1,
        }
    }

    /// A Send landed in receive `slot`: a credit update, or data (or a
    /// close) from a peer whose connection has no native Write with
    /// Immediate.
    fn send_received(&self, st: &mut StreamState, slot: usize, len: usize) {
        let base = self.opts.recv_offset(slot);
        let header = (len >= HEADER)
            .then(|| self.read_header(base).ok())
            .flatten();
        let Some((kind, data, control, payload)) = header else {
            st.broken.get_or_insert(WcStatus::LocLenErr);
            return;
        };
        st.data_credits += data;
        st.control_credits += control;
        let payload = payload.min(len - HEADER);
        match kind {
            // Reposted once read.
            KIND_DATA if payload > 0 => {
                st.inbox
                    .push_back((Some(slot), base + HEADER, base + HEADER + payload))
            }
            KIND_CREDIT => {
                self.repost(st, slot);
                st.control_owed += 1;
            }
            KIND_CLOSE => {
                st.peer_closed = true;
                self.repost(st, slot);
                st.data_owed += 1;
            }
            _ => {
                self.repost(st, slot);
                st.data_owed += 1;
            }
        }
    }

    /// A message read to its end frees its place: the receive it came in
    /// (a Send's) goes back to the QP, and the peer is owed a data credit.
    fn release_read(&self, st: &mut StreamState, recv: Option<usize>) {
        if let Some(slot) = recv {
            self.repost(st, slot);
        }
        st.data_owed += 1;
    }

    /// Give receive `slot` back to the QP (its credit, if any, is the
    /// caller's to count).
    fn repost(&self, st: &mut StreamState, slot: usize) {
        let posted = self
            .mr
            .slice(self.opts.recv_offset(slot), self.opts.slot_size)
            .and_then(|s| self.qp.post_recv(TAG_RECV | slot as u64, &[s]));
        if posted.is_err() {
            st.broken.get_or_insert(WcStatus::LocQpOpErr);
        }
    }

    /// Send a credit update when half the window is owed (or `force`).
    fn return_credits(&self, st: &mut StreamState, force: bool) -> Result<()> {
        // A peer that closed sends no more data: data credits would be a
        // Send for nothing, racing the peer's teardown. It may still need
        // control credits, to return ours while this side writes on.
        if st.peer_closed {
            st.data_owed = 0;
        }
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

    /// Post as much of `payload` as the free send slots and data credits
    /// take, one message of `kind` per slot (a close: one empty message),
    /// each a Write with Immediate into the peer's next ring slot, in post
    /// lists of at most [`POST_BATCH`] (on stag0 one write to the socket
    /// each). The bytes posted, or `None` when no slot or credit is free.
    fn send_messages(
        &self,
        st: &mut StreamState,
        kind: u8,
        payload: &[IoSlice<'_>],
    ) -> Result<Option<usize>> {
        let total: usize = payload.iter().map(|b| b.len()).sum();
        // Where the next byte comes from: buffer, offset in it.
        let mut cursor = (0, 0);
        let mut sent = 0;
        let mut messages = 0;
        while sent < total || messages == 0 {
            match self.send_batch(st, kind, payload, &mut cursor, total - sent) {
                Ok(Some((n, k))) => {
                    sent += n;
                    messages += k;
                    // A short list: out of slots or credits, or a post
                    // failed part way (`cursor` is past bytes not posted).
                    if k < POST_BATCH {
                        break;
                    }
                }
                Ok(None) => break,
                // What went before was posted: report it, and the error
                // comes back at the next write.
                Err(_) if messages > 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok((messages > 0).then_some(sent))
    }

    /// One post list of [`send_messages`](Self::send_messages): up to
    /// [`POST_BATCH`] messages holding the next at most `left` bytes of
    /// `payload` from `cursor` on. (bytes, messages) posted, or `None`
    /// when no slot or credit is free.
    fn send_batch(
        &self,
        st: &mut StreamState,
        kind: u8,
        payload: &[IoSlice<'_>],
        cursor: &mut (usize, usize),
        left: usize,
    ) -> Result<Option<(usize, usize)>> {
        let room = self.opts.slot_size - HEADER;
        let mut slices = Vec::new();
        let mut slots = Vec::new();
        let mut at_byte = 0;
        while (slots.is_empty() || at_byte < left) && slots.len() < st.data_credits.min(POST_BATCH)
        {
            let Some(i) = st.free_send.pop() else {
                break;
            };
            slots.push(i);
            let n = (left - at_byte).min(room);
            let at = self.opts.send_offset(i);
            // The first message returns every owed credit, the rest none.
            let header = if slices.is_empty() {
                self.header(st, kind, n)
            } else {
                plain_header(kind, n)
            };
            let filled = self
                .mr
                .write_at(at, &header)
                .and_then(|()| self.gather(at + HEADER, n, payload, cursor))
                .and_then(|()| self.mr.slice(at, HEADER + n));
            match filled {
                Ok(slice) => slices.push(slice),
                Err(e) => {
                    st.free_send.extend(slots);
                    return Err(e);
                }
            }
            at_byte += n;
        }
        if slices.is_empty() {
            st.free_send.extend(slots);
            return Ok(None);
        }
        let wrs: Vec<WorkRequest<'_>> = slices
            .iter()
            .zip(&slots)
            .enumerate()
            .map(|(k, (slice, &i))| {
                let op = self.data_op((st.ring_next + k) % self.opts.slots);
                WorkRequest::new(TAG_SEND | i as u64, op, std::slice::from_ref(slice))
            })
            .collect();
        let (posted, failed) = match self.qp.post_send_list(&wrs) {
            Ok(()) => (wrs.len(), None),
            Err(e) => (e.posted, Some(e.source)),
        };
        // Slots past the posted ones were never handed to the device.
        st.free_send.extend(slots.drain(posted..));
        if posted == 0 {
            return Err(failed.unwrap_or(Error::InvalidRequest("nothing posted")));
        }
        st.ring_next = (st.ring_next + posted) % self.opts.slots;
        st.data_credits -= posted;
        if kind == KIND_CLOSE {
            st.close = Close::Posted(TAG_SEND | slots[0] as u64);
        }
        st.data_owed = 0;
        st.control_owed = 0;
        let bytes = slices[..posted]
            .iter()
            .map(|s| s.len() as usize - HEADER)
            .sum();
        Ok(Some((bytes, posted)))
    }

    /// How a data message for the peer's ring slot `ring` goes: a Write
    /// with Immediate into it, or a Send.
    fn data_op(&self, ring: usize) -> SendOp {
        if self.write_imm {
            SendOp::WriteImm {
                remote: Remote {
                    addr: self.peer_ring.addr + self.opts.ring_offset(ring) as u64,
                    rkey: self.peer_ring.rkey,
                },
                imm: ring as u64,
            }
        } else {
            send_op()
        }
    }

    /// Copy the next `n` bytes of `bufs`, from `cursor` (buffer, offset
    /// in it) on, to `at` in the region; `cursor` moves past them.
    fn gather(
        &self,
        mut at: usize,
        mut n: usize,
        bufs: &[IoSlice<'_>],
        cursor: &mut (usize, usize),
    ) -> Result<()> {
        while n > 0 {
            let Some(buf) = bufs.get(cursor.0) else {
                break;
            };
            let piece = &buf[cursor.1..];
            let k = piece.len().min(n);
            self.mr.write_at(at, &piece[..k])?;
            at += k;
            n -= k;
            if k == piece.len() {
                *cursor = (cursor.0 + 1, 0);
            } else {
                cursor.1 += k;
            }
        }
        Ok(())
    }

    fn broken_error(st: &StreamState) -> io::Error {
        let status = st.broken.map(|s| s.as_str()).unwrap_or("unknown");
        io::Error::new(
            io::ErrorKind::ConnectionReset,
            format!("the RDMA stream's connection failed ({status})"),
        )
    }
}

/// `fd` on the current runtime's reactor, for input.
#[allow(unsafe_code)]
fn watch_socket(fd: OwnedFd) -> Option<AsyncFd<OwnedFd>> {
    // SAFETY: the `AsyncFd` owns `fd` (a duplicate of the QP's socket,
    // whose own descriptor the provider may close first): it stays open,
    // and is the same descriptor, for as long as it is registered.
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.ok()
}

/// Whether `fd` has input (or an error or hang-up) right now.
fn readable_now(fd: &OwnedFd) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    // An error of poll(2) itself: look again, as if readable.
    poll(&mut fds, PollTimeout::ZERO).map_or(true, |n| n > 0)
}

impl Drop for StreamShared {
    fn drop(&mut self) {
        let waiting = self
            .state
            .get_mut()
            .map_or_else(|p| p.into_inner().sock_waiting, |st| st.sock_waiting);
        if waiting {
            self.qp.socket_wait(false);
        }
    }
}

/// A header returning no credits.
fn plain_header(kind: u8, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = kind;
    h[12..16].copy_from_slice(&(len as u32).to_le_bytes());
    h
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
            // As much as `buf` takes, across the messages that arrived.
            let mut took = false;
            while let Some(&(recv, at, end)) = st.inbox.front() {
                if buf.remaining() == 0 {
                    break;
                }
                let n = (end - at).min(buf.remaining());
                let dst = buf.initialize_unfilled_to(n);
                sh.mr.read_at(at, dst).map_err(io_err)?;
                buf.advance(n);
                took = true;
                if at + n == end {
                    // Ring slots empty in the order they were written.
                    st.inbox.pop_front();
                    sh.release_read(&mut st, recv);
                    // Half the window free: return it now, not after the
                    // copy of what else arrived, so the writer refills
                    // those slots while this side copies on.
                    sh.return_credits(&mut st, false).map_err(io_err)?;
                } else if let Some(front) = st.inbox.front_mut() {
                    front.1 = at + n;
                }
            }
            if took {
                sh.return_credits(&mut st, false).map_err(io_err)?;
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
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    /// Gathers `bufs` into as few messages as the slots hold: a caller
    /// that writes several frames at once (hyper's HTTP/2 codec) sends one
    /// message for them, where one `poll_write` each would send one each.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        loop {
            if st.broken.is_some() {
                return Poll::Ready(Err(StreamShared::broken_error(&st)));
            }
            if st.close != Close::Open {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "write after shutdown",
                )));
            }
            if bufs.iter().all(|b| b.is_empty()) {
                return Poll::Ready(Ok(0));
            }
            if let Some(n) = sh.send_messages(&mut st, KIND_DATA, bufs).map_err(io_err)? {
                return Poll::Ready(Ok(n));
            }
            if sh.poll_progress(&mut st, cx, Side::Write)?.is_pending() {
                return Poll::Pending;
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        // Every write posted its message: nothing is buffered here.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        loop {
            // The close left, and all before it (see `Close`), even when
            // the connection failed since.
            if st.close == Close::Sent {
                return Poll::Ready(Ok(()));
            }
            if st.broken.is_some() {
                return Poll::Ready(Err(StreamShared::broken_error(&st)));
            }
            if st.close == Close::Open {
                sh.send_messages(&mut st, KIND_CLOSE, &[]).map_err(io_err)?;
            }
            if sh.poll_progress(&mut st, cx, Side::Write)?.is_pending() {
                return Poll::Pending;
            }
        }
    }
}
