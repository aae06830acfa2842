//! The TCP driver of one connection: moves bytes between a QP's socket and
//! its sans-IO [`Connection`], delivers the completions and events the
//! connection produces, and performs what the core leaves to IO. It
//! decides nothing about the protocol.
//!
//! A QP's connection sits behind one mutex, so the byte stream is processed
//! in order whoever drives it: the device's [`Engine`], a posting thread
//! (write only), or a thread polling or waiting on one of its CQs.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use nix::errno::Errno;
use nix::sys::socket::{self, getsockopt, sockopt, MsgFlags};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use tracing::debug;

use crate::cq::{CompletionQueue, CqQp};
use crate::engine::{Engine, EngineQp, Input, Ownership, Progress};
use crate::error::DeviceError;
use crate::linger::{CloseWatch, Stall};
use crate::mem::{MrTable, PdId};
use crate::nosignal::send_vectored;
use crate::qp::{Connection, CqSide, Env, Event, PostError, QpCaps, QpState, HOLD_LIMIT};
use crate::setup::Negotiated;
use crate::srq::Srq;
use crate::wr::{
    InlineWr, ListWr, RecvWr, SendOp, SendWrRef, Sge, WcOpcode, WcStatus, WorkCompletion,
};

/// Size of the socket read buffer.
const READ_CHUNK: usize = 256 * 1024;

thread_local! {
    /// The socket read buffer of every QP this thread drives. The core
    /// takes what a read returned within the same drive (a partial FPDU
    /// stays in its deframer), so no byte of it outlives the drive, and
    /// one buffer per thread serves every QP: a QP at rest holds none
    /// (a thousand idle QPs held 256 KiB each when every QP had its own).
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Octets read after a directly placed payload's trailer: the length field
/// and tagged header of the next FPDU, so that a stream of large Writes
/// stays on the direct path without a read buffer in between; before them
/// room for an Immediate Data FPDU, which follows each Write of a Write
/// with Immediate (RdmaStream's data), so that it comes in the same
/// syscall as the payload and not in one of its own (`strace -c` of a
/// stream's reader, 4096 messages of 64 KiB: 5729 `recvfrom` without it).
/// Where a Write follows instead, its first payload octets come in the
/// read buffer and are copied from there.
const PEEK: usize = IMMEDIATE_FPDU_LEN + crate::qp::HEADER_PEEK;

/// An Immediate Data FPDU: length field, untagged header, the 8 data
/// octets (no pad), CRC field.
const IMMEDIATE_FPDU_LEN: usize = crate::wire::fpdu::LENGTH_LEN
    + crate::wire::ddp::UNTAGGED_HEADER_LEN
    + crate::wire::rdmap::IMMEDIATE_DATA_LEN
    + crate::wire::fpdu::CRC_LEN;

/// Bytes a QP frames per drive before letting the socket catch up.
const TX_BUDGET: usize = 512 * 1024;

/// Whether doorbells hold a short last segment back ([`crate::tail`]):
/// on unless `STAG_TX_TAIL_HOLD=0` (to measure what it saves).
fn tail_hold_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var_os("STAG_TX_TAIL_HOLD").is_none_or(|v| v != "0"))
}

/// The socket side of a QP, under its lock.
#[derive(Debug, Default)]
pub(crate) struct QpIo {
    pub(crate) conn: Option<Connection>,
    /// Receives posted before the connection exists.
    pub(crate) early_recv: VecDeque<RecvWr>,
    /// Moved to Error before any connection: posts flush at once, and no
    /// connection may start on it.
    pub(crate) errored_early: bool,
    writable_wanted: bool,
    /// What the socket is armed for on the input side (not readability
    /// while input waits for a Receive: [`Connection::rx_blocked`]).
    input: Input,
    /// Since when a message has waited for a Receive ([`HOLD_LIMIT`]);
    /// cleared by a `post_recv` that let it move on.
    pub(crate) held_since: Option<Instant>,
    /// The engine's deadline for this QP's hold, while one is pending.
    hold_timer: Option<Instant>,
    /// In Error with octets still for the peer: whether it takes them
    /// ([`CloseWatch`]).
    close_watch: CloseWatch,
    /// The engine's deadline for that stall, while one is pending.
    close_timer: Option<Instant>,
    /// The engine's deadline for a held tail ([`crate::tail`]), while one
    /// is pending.
    tail_timer: Option<Instant>,
    /// The stream's segment size as last read, and when: TCP bounds it by
    /// half the peer's largest window, so it grows as the window opens
    /// (32,768 on loopback at first, 65,483 once the stream runs).
    tail_mss: Option<(usize, Instant)>,
    /// Whether the last tail held went out in front of the next post (the
    /// program streams posts), and posts left before another is held when
    /// it did not ([`crate::tail::Streak`]).
    tail_streak: crate::tail::Streak,
    /// Our end of the stream is shut (in Error, everything written); the
    /// peer's input is read and discarded until it closes too.
    fin_sent: bool,
    pub(crate) closed: bool,
    pub(crate) events: VecDeque<Event>,
    /// Socket reads that returned bytes (how a caller tells whether a
    /// drive found input).
    pub(crate) rx_reads: u64,
    /// Socket reads that placed payload straight into registered memory.
    rx_placed: u64,
    /// The drive leaves its completions on the connection: the polling
    /// thread that drives takes them itself ([`CqQp::try_progress_into`]).
    defer_push: bool,
}

/// What the engine, the CQs and the QP handle hold of a QP.
#[derive(Debug)]
pub(crate) struct QpShared {
    pub(crate) qpn: u32,
    pub(crate) pd: PdId,
    pub(crate) caps: QpCaps,
    /// This QP, for the engine's deadline ([`Engine::drive_at`]).
    me: Weak<QpShared>,
    mem: Arc<MrTable>,
    engine: Weak<Engine>,
    progress: Progress,
    pub(crate) send_cq: Arc<CompletionQueue>,
    pub(crate) recv_cq: Arc<CompletionQueue>,
    pub(crate) srq: Option<Arc<Srq>>,
    io: Mutex<QpIo>,
    /// The stream, once connected. Reads and writes go through `&TcpStream`
    /// under the `io` lock; outside it the socket is only polled.
    sock: OnceLock<TcpStream>,
    own: Ownership,
    /// Framed output waits for the socket to become writable.
    tx_blocked: AtomicBool,
    /// A post's doorbell held its output's tail back.
    tail_held: AtomicBool,
    /// Input waits for a Receive and the socket is not read: a thread
    /// that sleeps on readability would spin ([`CqQp::wait_fd`]).
    rx_paused: AtomicBool,
    /// The stream is closed: nothing more to read.
    closed: AtomicBool,
    /// Called (under the QP's lock) when connection events were queued.
    event_hook: OnceLock<fn()>,
    /// Called (under the QP's lock) with each connection event as it
    /// happens: the plugin's asynchronous events.
    async_hook: OnceLock<AsyncHook>,
}

/// See [`QueuePair::set_async_hook`](crate::device::QueuePair::set_async_hook).
pub(crate) struct AsyncHook(pub(crate) Box<dyn Fn(&Event) + Send + Sync>);

impl std::fmt::Debug for AsyncHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AsyncHook")
    }
}

impl QpShared {
    /// A QP not yet connected, attached to its CQs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        qpn: u32,
        pd: PdId,
        caps: QpCaps,
        mem: Arc<MrTable>,
        engine: &Arc<Engine>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        srq: Option<&Arc<Srq>>,
    ) -> Arc<QpShared> {
        let shared = Arc::new_cyclic(|me| QpShared {
            qpn,
            pd,
            caps,
            me: me.clone(),
            mem,
            engine: Arc::downgrade(engine),
            progress: engine.progress(),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            srq: srq.cloned(),
            io: Mutex::new(QpIo::default()),
            sock: OnceLock::new(),
            own: Ownership::default(),
            tx_blocked: AtomicBool::new(false),
            tail_held: AtomicBool::new(false),
            rx_paused: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            event_hook: OnceLock::new(),
            async_hook: OnceLock::new(),
        });
        let weak: Weak<dyn CqQp> = Arc::downgrade(&shared) as Weak<dyn CqQp>;
        send_cq.attach(weak.clone());
        if !Arc::ptr_eq(send_cq, recv_cq) {
            recv_cq.attach(weak);
        }
        shared
    }

    /// The QP's socket-side state, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, QpIo> {
        self.io.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`lock`](Self::lock) unless another thread holds the lock now.
    fn try_lock(&self) -> Option<MutexGuard<'_, QpIo>> {
        match self.io.try_lock() {
            Ok(io) => Some(io),
            Err(std::sync::TryLockError::WouldBlock) => None,
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        }
    }

    /// What the connection may touch: the registrations and the SRQ.
    pub(crate) fn env(&self) -> Env<'_> {
        Env {
            mem: &self.mem,
            srq: self.srq.as_deref(),
        }
    }

    /// Drive the QP: read what the socket has, process it, write what is
    /// due, deliver completions.
    pub(crate) fn progress(&self) {
        self.own.note_app();
        let mut io = self.lock();
        self.drive(&mut io);
    }

    /// Take the connected stream: register it with the engine and drive
    /// once (the connection is already in `io`).
    fn attach_socket(self: &Arc<Self>, io: &mut QpIo, sock: TcpStream) -> Result<(), nix::Error> {
        let sock = self.sock.get_or_init(|| sock);
        if let Some(engine) = self.engine.upgrade() {
            let weak: Weak<dyn EngineQp> = Arc::downgrade(self) as Weak<dyn EngineQp>;
            engine.register(self.qpn as u64, weak, &self.own, sock.as_fd())?;
        }
        self.drive(io);
        Ok(())
    }

    /// Install the hook [`QueuePair::set_event_hook`] describes.
    pub(crate) fn set_event_hook(&self, hook: fn()) -> bool {
        self.event_hook.set(hook).is_ok()
    }

    /// Install the hook [`QueuePair::set_async_hook`] describes.
    pub(crate) fn set_async_hook(&self, hook: AsyncHook) -> bool {
        self.async_hook.set(hook).is_ok()
    }

    /// The stream, once connected.
    pub(crate) fn sock(&self) -> Option<&TcpStream> {
        self.sock.get()
    }

    /// Close the stream and stop watching it (the QP handle is dropped).
    pub(crate) fn shut(&self, io: &mut QpIo) {
        if let Some(sock) = self.sock.get() {
            let _ = sock.shutdown(Shutdown::Both);
            if let Some(engine) = self.engine.upgrade() {
                engine.deregister(self.qpn as u64, sock.as_fd());
            }
        }
        io.closed = true;
        self.closed.store(true, Ordering::Release);
        io.conn = None;
    }

    pub(crate) fn drive(&self, io: &mut QpIo) {
        self.drive_with(io, true);
    }

    /// Drive; `read`: also read the socket (a post only writes: reading is
    /// for whoever polls, so a thread that only posts never delays its
    /// request behind a read syscall, nor keeps the engine off the QP).
    pub(crate) fn drive_with(&self, io: &mut QpIo, read: bool) {
        if !read {
            return self.drive_on(io, false, &mut []);
        }
        READ_BUF.with(|cell| match cell.try_borrow_mut() {
            Ok(mut buf) => {
                if buf.is_empty() {
                    buf.resize(READ_CHUNK, 0);
                }
                self.drive_on(io, true, &mut buf)
            }
            // A drive on this thread is under way already (a hook that
            // drove another QP): this one reads into a buffer of its own.
            Err(_) => self.drive_on(io, true, &mut vec![0; READ_CHUNK]),
        })
    }

    /// [`Self::drive_with`], reading (when `read`) into `rbuf`.
    fn drive_on(&self, io: &mut QpIo, read: bool, rbuf: &mut [u8]) {
        let env = self.env();
        let QpIo {
            conn,
            writable_wanted,
            input,
            held_since,
            hold_timer,
            close_watch,
            close_timer,
            tail_timer,
            tail_mss,
            tail_streak,
            fin_sent,
            closed,
            events,
            rx_reads,
            rx_placed,
            defer_push,
            ..
        } = io;
        let (Some(conn), Some(mut sock)) = (conn.as_mut(), self.sock.get()) else {
            return;
        };
        // What was posted leaves before we look for input: a post's
        // request is on the wire one read syscall sooner.
        let mut idle = read && !*writable_wanted && !*closed && *input == Input::Read;
        if idle && conn.has_pending_tx() {
            idle = false;
            Self::flush(conn, &mut sock, &env);
        }
        idle &= hold_timer.is_none() && close_timer.is_none();
        // Bounded so that one busy QP cannot starve the others.
        for turn in 0..if read { 64 } else { 0 } {
            // Input that waits for a Receive, with all the input it may
            // hold behind it, stops the reading, unless the peer closed:
            // then the rest is read (it is finite) to learn of the close.
            if *closed || (conn.rx_blocked() && !peer_closed(sock)) {
                break;
            }
            if let Some(req) = conn.placement() {
                // The payload straight into registered memory, its trailer
                // and the next header into our buffer: one syscall.
                let tail = (req.trailer + PEEK).min(rbuf.len());
                let want = req.target.len() as usize + tail;
                let mut crc = req.crc;
                match env.mem.recv_placed(
                    sock.as_fd(),
                    &req.target,
                    &mut rbuf[..tail],
                    crc.as_mut(),
                ) {
                    Err(e) => conn.handle_place_failed(e),
                    Ok(Ok(0)) => {
                        conn.handle_closed();
                        *closed = true;
                    }
                    Ok(Ok(n)) => {
                        *rx_placed += 1;
                        let placed = n.min(req.target.len() as usize);
                        conn.handle_placed(placed, crc);
                        if n > placed {
                            conn.handle_bytes(&rbuf[..n - placed], &env);
                        }
                        Self::flush(conn, &mut sock, &env);
                        if n < want {
                            break;
                        }
                    }
                    Ok(Err(e)) if e.kind() == ErrorKind::WouldBlock => break,
                    Ok(Err(e)) if e.kind() == ErrorKind::Interrupted => {}
                    Ok(Err(e)) => {
                        debug!(qpn = self.qpn, error = %e, "socket read failed");
                        conn.handle_stream_failed();
                        *closed = true;
                    }
                }
                continue;
            }
            // Input held for a Receive is read straight in behind it, a
            // read buffer's worth at a time (no header-by-header reads:
            // nothing is placed directly while it waits).
            let (want, got, direct) = match conn.held_room(rbuf.len()) {
                Some(room) => (
                    room.len(),
                    socket::recv(sock.as_raw_fd(), room, MsgFlags::empty()),
                    true,
                ),
                None => {
                    let want = conn.read_hint().unwrap_or(rbuf.len()).min(rbuf.len());
                    // `recv` through nix: the errno as a plain value, no
                    // `io::Error` to build, classify and drop per empty poll.
                    let got = socket::recv(sock.as_raw_fd(), &mut rbuf[..want], MsgFlags::empty());
                    (want, got, false)
                }
            };
            match got {
                Ok(0) => {
                    conn.handle_closed();
                    *closed = true;
                }
                Ok(n) => {
                    *rx_reads += 1;
                    if direct {
                        conn.held_filled(n);
                    } else {
                        conn.handle_bytes(&rbuf[..n], &env);
                    }
                    // Let responses and new requests out between reads.
                    Self::flush(conn, &mut sock, &env);
                    if n < want {
                        break;
                    }
                }
                Err(Errno::EAGAIN) => {
                    // The common empty poll of a spinning application:
                    // nothing was sent, nothing came and nothing waits in
                    // the connection, so the rest of the drive (a second
                    // flush, the hold and close checks, the flags, the
                    // queues) would find nothing either.
                    if idle
                        && turn == 0
                        && !conn.rx_held()
                        && !conn.has_output()
                        && !conn.wants_close()
                        && conn.state() != QpState::Error
                    {
                        return;
                    }
                    break;
                }
                Err(Errno::EINTR) => {}
                Err(e) => {
                    debug!(qpn = self.qpn, error = %e, "socket read failed");
                    conn.handle_stream_failed();
                    *closed = true;
                }
            }
        }
        // The engine is upgraded where it is needed, not per drive: an
        // empty poll's drive needs none (an atomic pair on a count the
        // engine thread shares, per poll).
        if conn.rx_held() || hold_timer.is_some() {
            let now = Instant::now();
            if hold_timer.is_some_and(|at| at <= now) {
                // Fired (or about to): the engine forgets it.
                *hold_timer = None;
            }
            if !conn.rx_held() {
                *held_since = None;
            } else {
                let since = *held_since.get_or_insert(now);
                if now.duration_since(since) >= HOLD_LIMIT {
                    conn.expire_held();
                    *held_since = None;
                } else if hold_timer.is_none() {
                    // Nobody may drive the QP when the limit comes (the
                    // application waits for the close the held input
                    // keeps from it): the engine does. One deadline per
                    // QP at a time: a hold that a post_recv ended and a
                    // new one began looks again when it comes.
                    let at = since + HOLD_LIMIT;
                    *hold_timer = Some(at);
                    if let Some(engine) = self.engine.upgrade() {
                        engine.drive_at(at, self.me.clone() as Weak<dyn EngineQp>);
                    }
                }
            }
        }
        // A tail held until now goes out: in front of this post's octets
        // (the program streams), or alone (it waits: a ping-pong, the end
        // of a stream).
        let was_held = self.tail_held.load(Ordering::Acquire);
        let (pending, held) = if read {
            if was_held {
                tail_streak.ended();
            }
            (Self::flush(conn, &mut sock, &env), false)
        } else {
            if was_held {
                tail_streak.merged();
            }
            // Only with an engine, which writes the tail if nobody does.
            let may_hold = tail_hold_enabled() && self.engine.strong_count() > 0;
            let stream: &TcpStream = sock;
            Self::flush_posted(conn, &mut sock, &env, |queued| {
                // No segment is shorter than TCP's minimum MSS: a small
                // post needs no look at the clock or the socket.
                if may_hold && queued > crate::tail::MIN_MSS && tail_streak.may_hold() {
                    Self::segment_size(tail_mss, stream)
                } else {
                    0
                }
            })
        };
        if held != was_held {
            // Stored only when it changes: a store per drive would dirty
            // a line that every wait reads.
            self.tail_held.store(held, Ordering::Release);
        }
        if tail_timer.is_some_and(|at| at <= Instant::now()) {
            // Fired (or about to): the engine forgets it.
            *tail_timer = None;
        }
        if held {
            if let Some(engine) = self.engine.upgrade() {
                engine.note_tail_held();
                if tail_timer.is_none() {
                    // Nobody may post or poll again: the engine writes the
                    // tail then. One deadline per QP at a time; a stream of
                    // posts merges its tails meanwhile, and the deadline
                    // writes whichever is held when it comes.
                    let at = Instant::now() + crate::tail::TAIL_LIMIT;
                    *tail_timer = Some(at);
                    engine.drive_at(at, self.me.clone() as Weak<dyn EngineQp>);
                }
            }
        }
        if conn.state() == QpState::Error {
            // Moved to Error (`rdma_disconnect`, `ibv_modify_qp`) with
            // octets still for a peer that reads no more: the stream and
            // its socket would be held until the QP is destroyed. As siw
            // after its close timeout, it is reset instead once the peer
            // has taken nothing for `LINGER_LIMIT`.
            let now = Instant::now();
            match close_watch.check(sock, conn.tx_written(), pending, now) {
                Stall::None => {}
                Stall::Until(at) => {
                    if close_timer.is_none_or(|t| t <= now) {
                        *close_timer = Some(at);
                        if let Some(engine) = self.engine.upgrade() {
                            engine.drive_at(at, self.me.clone() as Weak<dyn EngineQp>);
                        }
                    }
                }
                Stall::Reset => {
                    debug!(
                        qpn = self.qpn,
                        "in Error, the peer takes nothing: stream reset"
                    );
                    conn.handle_stream_failed();
                    *closed = true;
                }
            }
        }
        // A stream that ended may stay registered while what it carried
        // waits for Receives: nothing more to read from it.
        let want = if *closed {
            Input::Nothing
        } else if conn.rx_blocked() {
            Input::CloseOnly
        } else {
            Input::Read
        };
        if pending != *writable_wanted || want != *input {
            *writable_wanted = pending;
            *input = want;
            self.tx_blocked.store(pending, Ordering::Release);
            self.rx_paused.store(want != Input::Read, Ordering::Release);
            // A parked socket is re-armed with the right flags when the
            // engine takes it back; application waiters poll for output
            // through `tx_blocked`.
            if let Some(engine) = self.engine.upgrade() {
                if self.own.armed.load(Ordering::Relaxed) {
                    engine.arm(self.qpn as u64, sock.as_fd(), want, pending);
                }
            }
        }
        if !*defer_push {
            self.push_completions(conn);
        }
        let mut evented = false;
        while let Some(ev) = conn.poll_event() {
            debug!(qpn = self.qpn, ?ev, "event");
            if let Some(hook) = self.async_hook.get() {
                (hook.0)(&ev);
            }
            events.push_back(ev);
            evented = true;
        }
        if evented {
            if let Some(hook) = self.event_hook.get() {
                hook();
            }
        }
        if *closed && conn.state() == QpState::Error {
            let _ = sock.shutdown(Shutdown::Both);
            if let Some(engine) = self.engine.upgrade() {
                engine.deregister(self.qpn as u64, sock.as_fd());
            }
            self.closed.store(true, Ordering::Release);
        } else if conn.wants_close() && !*fin_sent {
            // In Error, with all it framed written: our FIN goes, and the
            // socket is still read until the peer's own close, what comes
            // discarded (a QP in Error places nothing), as siw reads on
            // after its QP went to Error. Shut for reading too, the
            // socket would answer a peer still sending with a reset
            // (RFC 1122 §4.2.2.13) instead of letting it meet the FIN.
            let _ = sock.shutdown(Shutdown::Write);
            *fin_sent = true;
        }
    }

    /// The stream's segment size (`TCP_MAXSEG`), read again when the last
    /// read is older than [`crate::tail::MSS_REFRESH`]; 0 if unknown.
    fn segment_size(cached: &mut Option<(usize, Instant)>, sock: &TcpStream) -> usize {
        let now = Instant::now();
        match *cached {
            Some((mss, at)) if now.duration_since(at) < crate::tail::MSS_REFRESH => mss,
            _ => {
                let mss = getsockopt(sock, sockopt::TcpMaxSeg).map_or(0, |m| m as usize);
                *cached = Some((mss, now));
                mss
            }
        }
    }

    /// A post's doorbell: write what the connection has to send, but hold
    /// back a short last segment ([`crate::tail`]) when the rest is whole
    /// segments of `mss(queued)` octets (0: hold nothing) and nothing else
    /// is to be framed. Returns whether bytes are still waiting for the
    /// socket, and whether a tail is held.
    fn flush_posted(
        conn: &mut Connection,
        sock: &mut &TcpStream,
        env: &Env,
        mss: impl FnOnce(usize) -> usize,
    ) -> (bool, bool) {
        if conn.state() != QpState::Rts {
            return (Self::flush(conn, sock, env), false);
        }
        conn.prepare_transmit(env, TX_BUDGET);
        let hold = crate::tail::tail_to_hold(conn.queued_tx(), mss(conn.queued_tx()));
        if hold == 0 {
            return (Self::flush(conn, sock, env), false);
        }
        let keep = conn.queued_tx() - hold;
        let wrote = conn.write_transmit(env, |iov| {
            let mut out = [IoSlice::new(&[]); crate::tail::IOV_CAP];
            let n = crate::tail::cut(iov, keep, &mut out);
            send_vectored(sock, &out[..n])
        });
        match wrote {
            // Held: unless the socket took less, or more is to be framed
            // (a list longer than the budget).
            Ok(n) if n == keep && !conn.prepare_transmit(env, TX_BUDGET) => (false, true),
            // The usual flush writes the rest, and meets a full or failed
            // socket again and handles it as it always does.
            _ => (Self::flush(conn, sock, env), false),
        }
    }

    /// Write what the connection has to send; returns whether bytes are
    /// still waiting for the socket. Payloads go from registered memory
    /// straight into `writev` (the core keeps only headers and CRCs).
    fn flush(conn: &mut Connection, sock: &mut &TcpStream, env: &Env) -> bool {
        // Nothing framed, nothing to frame and no Commit to perform: most
        // flushes after a read that brought a completion or a Write, or
        // nothing. (The input delivered its completions as it came.)
        if !conn.has_pending_tx() && !conn.has_commit_job() {
            return false;
        }
        loop {
            if !conn.has_queued_tx() && !conn.prepare_transmit(env, TX_BUDGET) {
                // A Commit holds the responses back until it is done:
                // msync here, outside the core, then frame again.
                let Some(job) = conn.poll_durability() else {
                    return false;
                };
                conn.handle_commit_done(job.req_id, job.run(env.mem));
                continue;
            }
            match conn.write_transmit(env, |iov| send_vectored(sock, iov)) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    debug!(error = %e, "socket write failed");
                    conn.handle_stream_failed();
                    return false;
                }
            }
        }
    }
}

impl EngineQp for QpShared {
    fn ownership(&self) -> &Ownership {
        &self.own
    }

    fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.sock.get().map(AsFd::as_fd)
    }

    fn engine_drive(&self, rearm: bool) {
        let mut io = self.lock();
        self.drive(&mut io);
        if !rearm || !self.own.unpark() || io.closed {
            return;
        }
        self.arm_for(&io);
    }

    fn engine_poll(&self) -> Option<bool> {
        // Another thread drives it right now: nothing to read here.
        let Some(mut io) = self.try_lock() else {
            return Some(false);
        };
        if io.closed || io.conn.is_none() || io.input != Input::Read || io.writable_wanted {
            // Not a plain read: its socket's events say when to drive.
            return None;
        }
        let before = (io.rx_reads, io.rx_placed);
        self.drive(&mut io);
        Some((io.rx_reads, io.rx_placed) != before)
    }

    fn engine_watch(&self, watched: bool) -> bool {
        // Under the io lock, as every change of the socket's epoll flags;
        // a take-out is skipped rather than waited for.
        let io = if watched {
            self.lock()
        } else {
            match self.try_lock() {
                Some(io) => io,
                None => return false,
            }
        };
        if io.closed || !self.own.armed.load(Ordering::Relaxed) {
            // Whoever disarmed it (a park, a thread asleep on the socket)
            // re-arms it when that ends.
            return false;
        }
        if watched {
            return self.arm_for(&io);
        }
        let (Some(engine), Some(sock)) = (self.engine.upgrade(), self.sock.get()) else {
            return false;
        };
        engine.unwatch(self.qpn as u64, sock.as_fd());
        true
    }

    fn engine_unhold(&self) -> Option<Instant> {
        // A thread that keeps waiting on the socket keeps it: no lock
        // taken here, which that thread would wait for (a futex pair per
        // recheck on both sides, measured in qperf rc_lat), and no
        // re-arm it would undo at its next wait. Unless output waits for
        // room: the engine keeps the stream full while that thread is
        // away (fio's rdma writes at iodepth 16).
        if !self.tx_blocked.load(Ordering::Acquire) {
            if let Some(at) = self.own.hold_until(Instant::now()) {
                return Some(at);
            }
        }
        let mut io = self.lock();
        if !self.own.unhold() {
            // A thread sleeps on the socket again (it reads what comes,
            // and writes when its poll says the socket is writable), or a
            // polling thread drives the QP (parked): a drive here would
            // only find the socket empty, under the lock that thread
            // wants.
            return None;
        }
        self.drive(&mut io);
        if !io.closed {
            self.arm_for(&io);
        }
        None
    }
}

impl QpShared {
    /// Arm the socket in the engine's set for the QP's state in `io`
    /// (under its lock, so the flags match it); whether there were an
    /// engine and a socket to arm.
    fn arm_for(&self, io: &QpIo) -> bool {
        let (Some(engine), Some(sock)) = (self.engine.upgrade(), self.sock.get()) else {
            return false;
        };
        self.own.armed.store(true, Ordering::Relaxed);
        engine.arm(self.qpn as u64, sock.as_fd(), io.input, io.writable_wanted);
        true
    }
}

impl QpShared {
    /// Drive the QP from an application thread unless another thread is
    /// at it; whether this drive read input.
    pub(crate) fn try_progress_reading(&self) -> bool {
        self.own.note_app();
        let Some(mut io) = self.try_lock() else {
            return false;
        };
        let before = io.rx_reads;
        self.drive(&mut io);
        io.rx_reads != before
    }
}

impl CqQp for QpShared {
    fn try_progress(&self, claim: bool) {
        if claim {
            self.own.note_app();
        }
        if let Some(mut io) = self.try_lock() {
            self.drive(&mut io);
        }
    }

    fn try_progress_into(
        &self,
        cq: &CompletionQueue,
        max: usize,
        take: &mut dyn FnMut(WorkCompletion),
    ) -> usize {
        self.own.note_app();
        let Some(mut io) = self.try_lock() else {
            return 0;
        };
        io.defer_push = true;
        self.drive(&mut io);
        io.defer_push = false;
        let Some(conn) = io.conn.as_mut() else {
            return 0;
        };
        // Under the QP's lock: no other thread queues this QP's
        // completions meanwhile (see `CompletionQueue::drive_qps_into`).
        // A CQ armed meanwhile (another thread means to sleep on it) gets
        // its completions queued, which fires its event.
        let mut n = 0;
        while let Some((side, wc)) = conn.poll_completion() {
            let to = self.cq_of(side);
            if n < max && std::ptr::eq(to, cq) && cq.nothing_queued() && !cq.is_armed() {
                take(wc);
                n += 1;
            } else {
                to.push(wc);
            }
        }
        n
    }

    fn wait_fd(&self, always: bool) -> Option<(BorrowedFd<'_>, bool)> {
        if !(always || self.progress.waiters_take_sockets())
            || self.closed.load(Ordering::Acquire)
            || self.rx_paused.load(Ordering::Acquire)
        {
            // The engine watches it (for the peer's close, while paused).
            return None;
        }
        let sock = self.sock.get()?;
        Some((sock.as_fd(), self.tx_blocked.load(Ordering::Acquire)))
    }

    fn drive_woken(&self) {
        // Blocking, unlike `try_progress`: a thread that posts holds the
        // lock for its write, and the waiter's input is still unread
        // behind it. Skipping the drive would send the waiter straight
        // back into `poll(2)` on a socket that is still readable (a spin
        // on one core while the poster is preempted); waiting on the
        // lock is one futex pair, and only when the two actually meet.
        let mut io = self.lock();
        self.drive(&mut io);
    }

    fn set_waiting(&self, on: bool) {
        if on {
            let first = self.own.begin_wait();
            // The common case in an event loop: the thread's last wait
            // kept the socket (held) and nobody re-armed it since. Then
            // there is no epoll flag to change and no lock to take: the
            // lock would meet a thread that is posting (measured in
            // rping, a futex pair per wait on both threads). Counted as
            // a waiter first, so that the engine's unhold (which clears
            // `held` and then looks for waiters, under the lock) cannot
            // re-arm the socket behind this look.
            if self.own.kept_quiet() {
                return;
            }
            // Under the io lock, as every change of the socket's epoll
            // flags.
            let _io = self.lock();
            if first && self.own.armed.swap(false, Ordering::Relaxed) {
                if let (Some(engine), Some(sock)) = (self.engine.upgrade(), self.sock.get()) {
                    engine.disarm(self.qpn as u64, sock.as_fd());
                }
            }
            return;
        }
        // Under the io lock, as every change of the socket's epoll flags.
        let io = self.lock();
        let (Some(engine), Some(sock)) = (self.engine.upgrade(), self.sock.get()) else {
            self.own.end_wait();
            return;
        };
        if self.own.end_wait() && !io.closed {
            // Back to the engine the moment nobody sleeps on the socket:
            // input that arrives while the application does something
            // else is answered at once.
            self.own.armed.store(true, Ordering::Relaxed);
            engine.arm(self.qpn as u64, sock.as_fd(), io.input, io.writable_wanted);
        }
    }

    fn end_wait_holding(&self) {
        // No lock: holding changes no epoll flag (the socket stays out of
        // the engine's set), and joining the engine's held list needs
        // only the QP's weak reference. The engine's unhold takes the
        // lock and re-reads the waiters, so a hold racing it at worst
        // leaves the QP both armed and held until its next recheck; the
        // thread's next wait disarms it (`set_waiting`). Otherwise
        // another thread still sleeps on the socket, or the engine
        // parked or holds the QP already: nothing to hand over.
        if self.own.end_wait_holding() && !self.closed.load(Ordering::Acquire) {
            match self.engine.upgrade() {
                Some(engine) => engine.hold(self.me.clone() as Weak<dyn EngineQp>),
                None => {
                    self.own.unhold();
                }
            }
        }
    }

    fn release_to_engine(&self) {
        self.own.release(self.engine.upgrade().as_deref());
    }

    fn write_held_tail(&self) {
        if self.tail_held.load(Ordering::Acquire) {
            // A drive that reads writes all there is.
            let mut io = self.lock();
            self.drive(&mut io);
        }
    }

    fn kept_by_waiter(&self) -> bool {
        // Output waiting for room is written by whoever gets there first,
        // as before: a sender's empty poll still pushes the stream.
        self.own.kept_by_waiter() && !self.tx_blocked.load(Ordering::Acquire)
    }

    fn engine_polls(&self) -> bool {
        self.engine
            .upgrade()
            .is_some_and(|engine| engine.polls_after_traffic())
    }

    fn poll_window(&self) -> Option<Duration> {
        let spin = match self.progress {
            Progress::Blocking => return None,
            Progress::Adaptive { spin } => spin,
            Progress::Busy => crate::engine::DEFAULT_ADAPTIVE_SPIN,
        };
        // Another thread drives it: nothing to poll for here.
        let io = self.try_lock()?;
        let conn = io.conn.as_ref()?;
        (conn.pipelined() || conn.input_under_way()).then_some(spin)
    }
}

/// The verbs of a QP handle ([`crate::device::QueuePair`]), including what
/// they do before the connection exists: receives wait in `early_recv`, a
/// QP moved to Error flushes what is posted, and a send needs the stream.
impl QpShared {
    /// The current state (RTR before the connection is up).
    pub(crate) fn state(&self) -> QpState {
        let io = self.lock();
        io.conn
            .as_ref()
            .map(Connection::state)
            .unwrap_or(QpState::Rtr)
    }

    /// What the MPA exchange settled, once connected.
    pub(crate) fn negotiated(&self) -> Option<Negotiated> {
        let io = self.lock();
        io.conn.as_ref().map(|c| c.negotiated().clone())
    }

    /// Connection events queued so far.
    pub(crate) fn take_events(&self) -> Vec<Event> {
        let mut io = self.lock();
        io.events.drain(..).collect()
    }

    /// Queue and frame one send WR; it reaches the socket at the next
    /// [`ring`](Self::ring) (or whichever drive of the QP comes first).
    pub(crate) fn queue_send(&self, wr: SendWrRef<'_>) -> Result<(), DeviceError> {
        self.queue_with(wr.wr_id, wr.op, |conn, env| conn.post_send_ref(wr, env))
    }

    /// [`queue_send`](Self::queue_send) of an inline WR: its payload is
    /// copied into the connection before this returns.
    pub(crate) fn queue_inline(&self, wr: InlineWr<'_>) -> Result<(), DeviceError> {
        self.queue_with(wr.wr_id, wr.op, |conn, env| conn.post_inline(wr, env))
    }

    /// Queue a post list under one lock of the QP (not one per WR): at
    /// 1024 QPs the lock per WR was a tenth of the posting thread. On a
    /// refused WR, its error and how many were queued before it (which
    /// stay queued).
    pub(crate) fn queue_list<'w>(
        &self,
        wrs: impl IntoIterator<Item = ListWr<'w>>,
    ) -> Result<(), (DeviceError, usize)> {
        let mut io = self.lock();
        self.queue_list_locked(&mut io, wrs)
    }

    /// [`queue_list`](Self::queue_list) and the [`ring`](Self::ring)
    /// after it, under one lock of the QP instead of two. What was queued
    /// before a refused WR leaves too.
    pub(crate) fn post_list<'w>(
        &self,
        wrs: impl IntoIterator<Item = ListWr<'w>>,
    ) -> Result<(), (DeviceError, usize)> {
        let mut io = self.lock();
        let res = self.queue_list_locked(&mut io, wrs);
        if queued_any(&res) {
            self.drive_posted(&mut io);
        }
        res
    }

    /// A post's drive: frame and write what was posted. When all of it
    /// left at once and the post changed nothing else (the small post of
    /// a ping-pong), only the completions it made are delivered: the rest
    /// of a drive (the tail, hold and close checks, the arming, the
    /// events) would find what the last drive left. Anything else (a
    /// socket that took less, a tail to hold, an error, an event) gets the
    /// whole drive, which picks up from where this one stopped.
    fn drive_posted(&self, io: &mut QpIo) {
        if !self.wrote_posted(io) {
            self.drive_with(io, false);
        }
    }

    /// [`drive_posted`](Self::drive_posted)'s short way; whether it was
    /// enough.
    fn wrote_posted(&self, io: &mut QpIo) -> bool {
        let QpIo {
            conn: Some(conn),
            writable_wanted: false,
            closed: false,
            fin_sent: false,
            ..
        } = io
        else {
            return false;
        };
        let Some(sock) = self.sock.get() else {
            return false;
        };
        // A held tail goes out in front of this post through the whole
        // drive, which keeps the streak's count.
        if conn.state() != QpState::Rts || self.tail_held.load(Ordering::Acquire) {
            return false;
        }
        let env = self.env();
        // What the post framed at once is framed already; the send queue
        // is walked only when the post queued a WR, or a response is owed
        // (the walk was 86 instructions of an 8-octet Write's post, #20).
        if conn.has_to_frame() {
            conn.prepare_transmit(&env, TX_BUDGET);
        }
        // Longer output may hold back its tail ([`Self::flush_posted`]).
        if conn.queued_tx() > crate::tail::MIN_MSS {
            return false;
        }
        match conn.write_transmit(&env, |iov| send_vectored(sock, iov)) {
            Ok(_) if !conn.has_queued_tx() => {}
            // Written in part, or failed: the whole drive writes again and
            // meets the full or failed socket as it always does.
            _ => return false,
        }
        if conn.state() != QpState::Rts || conn.has_pending_tx() || conn.has_events_or_jobs() {
            return false;
        }
        self.push_completions(conn);
        true
    }

    /// Hand the connection's completions to their CQs.
    fn push_completions(&self, conn: &mut Connection) {
        while let Some((side, wc)) = conn.poll_completion() {
            self.cq_of(side).push(wc);
        }
    }

    /// The CQ a completion of `side` belongs on.
    fn cq_of(&self, side: CqSide) -> &CompletionQueue {
        match side {
            CqSide::Send => &self.send_cq,
            CqSide::Recv => &self.recv_cq,
        }
    }

    fn queue_list_locked<'w>(
        &self,
        io: &mut QpIo,
        wrs: impl IntoIterator<Item = ListWr<'w>>,
    ) -> Result<(), (DeviceError, usize)> {
        let env = self.env();
        for (queued, wr) in wrs.into_iter().enumerate() {
            let res = match io.conn.as_mut() {
                Some(conn) => match wr {
                    ListWr::Send(w) => conn.post_send_ref(w, &env),
                    ListWr::Inline(w) => conn.post_inline(w, &env),
                }
                .map_err(DeviceError::from),
                None => self.queue_unconnected(io, wr.id_and_op()),
            };
            res.map_err(|e| (e, queued))?;
        }
        Ok(())
    }

    /// Post onto the connection with `post`, or, on a QP that never
    /// connected, refuse (not yet connected) or flush (errored early).
    fn queue_with(
        &self,
        wr_id: u64,
        op: SendOp,
        post: impl FnOnce(&mut Connection, &Env) -> Result<(), PostError>,
    ) -> Result<(), DeviceError> {
        let env = self.env();
        let mut io = self.lock();
        if let Some(conn) = io.conn.as_mut() {
            return Ok(post(conn, &env)?);
        }
        self.queue_unconnected(&io, (wr_id, op))
    }

    /// A WR posted on a QP that never connected: refused (not yet
    /// connected), or completed with a flush error (errored early).
    fn queue_unconnected(&self, io: &QpIo, (wr_id, op): (u64, SendOp)) -> Result<(), DeviceError> {
        if !io.errored_early {
            return Err(DeviceError::InvalidState);
        }
        // A QP in Error completes what is posted with a flush error.
        self.send_cq.push(WorkCompletion {
            wr_id,
            status: WcStatus::WrFlushErr,
            opcode: op.wc_opcode(),
            qp_num: self.qpn,
            ..WorkCompletion::BLANK
        });
        Ok(())
    }

    /// The doorbell: write what was queued, from the calling thread
    /// (which does not read the socket: input is for whoever polls, the
    /// device's engine when nobody does).
    pub(crate) fn ring(&self) {
        let mut io = self.lock();
        self.drive_posted(&mut io);
    }

    /// `ibv_post_recv`; allowed before the connection exists.
    pub(crate) fn post_recv(&self, wr: RecvWr) -> Result<(), DeviceError> {
        self.post_recv_of(wr.wr_id, Cow::Owned(wr.sg_list))
    }

    /// [`post_recv`](Self::post_recv) of a borrowed SGE list, which a
    /// running connection copies into a recycled one (nothing allocated).
    pub(crate) fn post_recv_ref(&self, wr_id: u64, sg_list: &[Sge]) -> Result<(), DeviceError> {
        self.post_recv_of(wr_id, Cow::Borrowed(sg_list))
    }

    fn post_recv_of(&self, wr_id: u64, sg_list: Cow<'_, [Sge]>) -> Result<(), DeviceError> {
        if self.srq.is_some() {
            return Err(PostError::HasSrq.into());
        }
        let mut io = self.lock();
        let errored_early = io.errored_early;
        match io.conn.as_mut() {
            Some(conn) => {
                match sg_list {
                    Cow::Owned(sg_list) => conn.post_recv(RecvWr { wr_id, sg_list }),
                    Cow::Borrowed(sg_list) => conn.post_recv_ref(wr_id, sg_list),
                }?;
                if conn.rx_held() {
                    // A message waited for this Receive: take it and the
                    // input behind it, hand out what completed and read
                    // the socket again.
                    conn.resume_held(&self.env());
                    // The next message held waits its own HOLD_LIMIT.
                    io.held_since = None;
                    self.drive_with(&mut io, false);
                }
            }
            None if errored_early => self.recv_cq.push(WorkCompletion {
                wr_id,
                status: WcStatus::WrFlushErr,
                opcode: WcOpcode::Recv,
                qp_num: self.qpn,
                ..WorkCompletion::BLANK
            }),
            None => {
                if sg_list.len() > self.caps.max_recv_sge as usize {
                    return Err(
                        PostError::TooManySges(sg_list.len(), self.caps.max_recv_sge).into(),
                    );
                }
                if io.early_recv.len() >= self.caps.max_recv_wr as usize {
                    return Err(PostError::Recv(crate::srq::PostRecvError::Full(
                        self.caps.max_recv_wr as usize,
                    ))
                    .into());
                }
                io.early_recv.push_back(RecvWr {
                    wr_id,
                    sg_list: sg_list.into_owned(),
                });
            }
        }
        Ok(())
    }

    /// Move the QP to Error: outstanding WRs complete with a flush error
    /// and the stream closes.
    pub(crate) fn set_error(&self) {
        let mut io = self.lock();
        if let Some(conn) = io.conn.as_mut() {
            conn.set_error();
        } else {
            io.errored_early = true;
            let flushed: Vec<_> = io.early_recv.drain(..).collect();
            for wr in flushed {
                self.recv_cq.push(WorkCompletion {
                    wr_id: wr.wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: WcOpcode::Recv,
                    qp_num: self.qpn,
                    ..WorkCompletion::BLANK
                });
            }
        }
        self.drive(&mut io);
    }

    /// Turn a finished MPA exchange into a running stream: the connection
    /// takes the receives posted early and the bytes that followed the
    /// exchange, then the engine takes the socket.
    pub(crate) fn start(
        self: &Arc<Self>,
        sock: TcpStream,
        neg: Negotiated,
        leftover: &[u8],
    ) -> Result<(), DeviceError> {
        sock.set_nonblocking(true)?;
        let mut conn = Connection::new(self.qpn, self.pd, self.caps, neg, self.srq.is_some());
        let mut io = self.lock();
        if io.conn.is_some() || io.errored_early {
            return Err(DeviceError::InvalidState);
        }
        for wr in io.early_recv.drain(..) {
            conn.post_recv(wr)?;
        }
        if !leftover.is_empty() {
            conn.handle_bytes(leftover, &self.env());
        }
        io.conn = Some(conn);
        self.attach_socket(&mut io, sock)?;
        Ok(())
    }
}

/// Whether the peer shut its side of `sock` down (or the socket failed).
fn peer_closed(sock: &TcpStream) -> bool {
    let mut fds = [nix::poll::PollFd::new(
        sock.as_fd(),
        nix::poll::PollFlags::from_bits_retain(libc::POLLRDHUP),
    )];
    match nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO) {
        Ok(n) => n > 0,
        Err(_) => true,
    }
}

/// Whether a post list that ended with `res` ([`QpShared::queue_list`])
/// queued anything to ring for: all of it, or the WRs before a refused one.
pub(crate) fn queued_any(res: &Result<(), (DeviceError, usize)>) -> bool {
    matches!(res, Ok(()) | Err((_, 1..)))
}
