//! The userspace RNIC: device, protection domains, registrations, QPs and
//! the TCP driver that moves bytes between sockets and the sans-IO
//! [`Connection`].
//!
//! Progress happens in two places: a per-device engine thread blocked in
//! epoll (so responder-side work — Read Responses, atomics, commits,
//! placement — goes on while the application does something else), and the
//! application's own thread when it posts (the request leaves at once),
//! polls a CQ that is empty (it reads the sockets itself, so busy polling
//! costs no thread hand-off) or blocks in [`CompletionQueue::wait`] (it
//! sleeps in `poll(2)` on the sockets themselves, so a blocking round trip
//! costs one wake-up, as on a plain socket). A QP's connection sits behind
//! one mutex, so the byte stream is processed in order whoever drives it.
//!
//! The two must not fight over a socket: on two cores, an engine woken for
//! every message that a spinning application thread then finds already
//! handled costs a wake-up and a context switch per message. So when an
//! event fires while an application thread is driving that QP (it polled
//! since the engine last looked, or it is blocked in `wait`), the engine
//! disarms the socket in its epoll set ("parks" it) and looks again every
//! [`PARK_RECHECK`]; once the application has stopped driving it, the
//! engine drives the QP and re-arms. While the engine owns a QP its socket
//! stays armed, level-triggered: no epoll_ctl per message.
//! [`CompletionQueue::req_notify`] hands the QPs back at once, since an
//! application that arms notifications is about to sleep.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::{debug, warn};

use crate::cq::CompletionQueue;
use crate::mem::{Access, MrTable, PdId, RegisterError};
use crate::qp::{Connection, CqSide, Env, Event, PostError, QpCaps, QpState};
use crate::setup::{Answer, Initiator, MpaParams, Negotiated, Request};
use crate::srq::Srq;
use crate::wr::{RecvWr, SendWr, WcOpcode, WcStatus, WorkCompletion};

/// Errors of the device-level verbs.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A socket or system call failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The MPA exchange failed or the peer spoke something else.
    #[error("MPA: {0}")]
    Mpa(#[from] crate::wire::Error),
    /// The peer rejected the connection, with its private data.
    #[error("connection rejected by peer")]
    Rejected(Vec<u8>),
    /// The MPA exchange did not finish in time.
    #[error("connection setup timed out")]
    Timeout,
    /// The QP is not in a state that allows this.
    #[error("QP in wrong state for this")]
    InvalidState,
    /// Posting failed.
    #[error(transparent)]
    Post(#[from] PostError),
    /// Registration failed.
    #[error(transparent)]
    Register(#[from] RegisterError),
    /// epoll/eventfd failed.
    #[error("system: {0}")]
    Sys(#[from] nix::Error),
}

/// How long connection setup may take before it fails.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Size of a QP's socket read buffer.
const READ_CHUNK: usize = 256 * 1024;

/// Bytes a QP frames per drive before letting the socket catch up.
const TX_BUDGET: usize = 512 * 1024;

/// The epoll token of the engine's wake-up eventfd.
const WAKE_TOKEN: u64 = u64::MAX;

/// How often the engine looks at the QPs it left to application threads
/// (the longest an inbound request waits when the application stops
/// driving its QP without arming notifications).
pub const PARK_RECHECK: Duration = Duration::from_millis(1);

/// A userspace iWARP device.
#[derive(Debug, Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    name: String,
    pub(crate) mem: MrTable,
    next_pd: AtomicU32,
    next_qpn: AtomicU32,
    engine: Engine,
}

/// The per-device progress thread: epoll over every connected QP's socket.
#[derive(Debug)]
struct Engine {
    epoll: Arc<Epoll>,
    wake: Arc<EventFd>,
    qps: Arc<Mutex<HashMap<u64, Weak<QpShared>>>>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Engine {
    fn start(name: &str) -> Result<Engine, DeviceError> {
        let epoll = Arc::new(Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?);
        let wake = Arc::new(EventFd::from_value_and_flags(
            0,
            EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC,
        )?);
        epoll.add(
            wake.as_fd(),
            EpollEvent::new(EpollFlags::EPOLLIN, WAKE_TOKEN),
        )?;
        let qps: Arc<Mutex<HashMap<u64, Weak<QpShared>>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (epoll, wake, qps, stop) = (epoll.clone(), wake.clone(), qps.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("{name}-engine"))
                .spawn(move || Engine::run(&epoll, &wake, &qps, &stop))?
        };
        Ok(Engine {
            epoll,
            wake,
            qps,
            stop,
            thread: Mutex::new(Some(thread)),
        })
    }

    fn run(
        epoll: &Epoll,
        wake: &EventFd,
        qps: &Mutex<HashMap<u64, Weak<QpShared>>>,
        stop: &AtomicBool,
    ) {
        let mut events = vec![EpollEvent::empty(); 64];
        // QPs whose socket is disarmed because an application thread
        // drives them.
        let mut parked: Vec<Weak<QpShared>> = Vec::new();
        let mut last_check = Instant::now();
        while !stop.load(Ordering::Acquire) {
            let timeout = if parked.is_empty() {
                EpollTimeout::NONE
            } else {
                EpollTimeout::try_from(PARK_RECHECK).unwrap_or(EpollTimeout::ZERO)
            };
            let n = match epoll.wait(&mut events, timeout) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    warn!(error = %e, "epoll_wait failed; engine stops");
                    return;
                }
            };
            let mut recheck = false;
            for ev in &events[..n] {
                let token = ev.data();
                if token == WAKE_TOKEN {
                    let _ = wake.read();
                    recheck = true;
                    continue;
                }
                let qp = qps
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&token)
                    .and_then(Weak::upgrade);
                let Some(qp) = qp else { continue };
                if qp.parked.load(Ordering::Relaxed) || qp.app_active() {
                    // Disarmed here (again, if a racing application
                    // thread re-armed it) until the recheck.
                    qp.armed.store(false, Ordering::Relaxed);
                    if let Some(sock) = qp.sock.get() {
                        Self::disarm(epoll, qp.qpn, sock);
                    }
                    if !qp.parked.swap(true, Ordering::Relaxed) {
                        parked.push(Arc::downgrade(&qp));
                    }
                } else {
                    qp.engine_drive(false);
                }
            }
            if !parked.is_empty() && (recheck || last_check.elapsed() >= PARK_RECHECK) {
                last_check = Instant::now();
                parked.retain(|w| {
                    let Some(qp) = w.upgrade() else {
                        return false;
                    };
                    if qp.app_active() {
                        return true;
                    }
                    qp.parked.store(false, Ordering::Relaxed);
                    qp.engine_drive(true);
                    false
                });
            }
        }
    }

    fn register(&self, qp: &Arc<QpShared>, sock: &TcpStream) -> Result<(), DeviceError> {
        let token = qp.qpn as u64;
        self.qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, Arc::downgrade(qp));
        qp.armed.store(true, Ordering::Relaxed);
        self.epoll
            .add(sock.as_fd(), EpollEvent::new(Self::flags(false), token))?;
        Ok(())
    }

    fn flags(write: bool) -> EpollFlags {
        let mut flags = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
        if write {
            flags |= EpollFlags::EPOLLOUT;
        }
        flags
    }

    /// Stop watching a QP's socket. One-shot with no events: an error or
    /// hang-up (always reported) wakes the engine once at most.
    fn disarm(epoll: &Epoll, qpn: u32, sock: &TcpStream) {
        let mut ev = EpollEvent::new(EpollFlags::EPOLLONESHOT, qpn as u64);
        if let Err(e) = epoll.modify(sock.as_fd(), &mut ev) {
            debug!(qpn, error = %e, "epoll modify failed");
        }
    }

    /// (Re-)arm a QP's socket, with writability if `write`. Called with the
    /// QP's io lock held, so the flags match its state.
    fn arm(&self, qpn: u32, sock: &TcpStream, write: bool) {
        let mut ev = EpollEvent::new(Self::flags(write), qpn as u64);
        if let Err(e) = self.epoll.modify(sock.as_fd(), &mut ev) {
            debug!(qpn, error = %e, "epoll modify failed");
        }
    }

    /// Make the engine look at its parked QPs now.
    fn kick(&self) {
        let _ = self.wake.write(1);
    }

    fn deregister(&self, qpn: u32, sock: &TcpStream) {
        let _ = self.epoll.delete(sock.as_fd());
        self.qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(qpn as u64));
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Device {
    /// Open a userspace device named `name` (e.g. `"stag0"`).
    pub fn open(name: &str) -> Result<Device, DeviceError> {
        Ok(Device {
            inner: Arc::new(DeviceInner {
                name: name.to_owned(),
                mem: MrTable::new(),
                next_pd: AtomicU32::new(1),
                next_qpn: AtomicU32::new(1),
                engine: Engine::start(name)?,
            }),
        })
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&self) -> ProtectionDomain {
        ProtectionDomain {
            device: self.clone(),
            id: self.inner.next_pd.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The registration table.
    pub fn mem(&self) -> &MrTable {
        &self.inner.mem
    }
}

/// A protection domain.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    device: Device,
    id: PdId,
}

impl ProtectionDomain {
    /// The PD's id.
    pub fn id(&self) -> PdId {
        self.id
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `ibv_reg_mr` over raw memory. Returns the STag (lkey = rkey).
    ///
    /// # Safety
    /// See [`MrTable::register`]: the memory stays valid until
    /// [`ProtectionDomain::dereg_mr`] returns, and the device may write it
    /// at any time meanwhile.
    pub unsafe fn reg_mr(
        &self,
        base: NonNull<u8>,
        len: usize,
        access: Access,
        durable: bool,
    ) -> Result<u32, DeviceError> {
        // SAFETY: forwarded contract.
        let stag = unsafe {
            self.device.inner.mem.register(
                self.id,
                base,
                base.as_ptr() as u64,
                len as u64,
                access,
                durable,
            )
        }?;
        Ok(stag)
    }

    /// `ibv_dereg_mr`.
    pub fn dereg_mr(&self, stag: u32) -> Result<(), DeviceError> {
        Ok(self.device.inner.mem.deregister(stag)?)
    }

    /// `ibv_create_qp` for an RC QP.
    pub fn create_qp(
        &self,
        caps: QpCaps,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        srq: Option<&Arc<Srq>>,
    ) -> QueuePair {
        let qpn = self.device.inner.next_qpn.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(QpShared {
            qpn,
            pd: self.id,
            caps,
            device: Arc::downgrade(&self.device.inner),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            srq: srq.cloned(),
            io: Mutex::new(QpIo::default()),
            sock: OnceLock::new(),
            app_polls: AtomicU64::new(0),
            app_waiters: AtomicU32::new(0),
            released: AtomicBool::new(false),
            engine_seen: AtomicU64::new(0),
            parked: AtomicBool::new(false),
            armed: AtomicBool::new(false),
            tx_blocked: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        });
        send_cq.attach(Arc::downgrade(&shared));
        if !Arc::ptr_eq(send_cq, recv_cq) {
            recv_cq.attach(Arc::downgrade(&shared));
        }
        QueuePair {
            shared,
            device: self.device.clone(),
        }
    }
}

/// The socket side of a QP.
#[derive(Debug, Default)]
struct QpIo {
    conn: Option<Connection>,
    rbuf: Vec<u8>,
    /// Receives posted before the connection exists.
    early_recv: VecDeque<RecvWr>,
    /// Moved to Error before any connection: posts flush at once, and no
    /// connection may start on it.
    errored_early: bool,
    writable_wanted: bool,
    closed: bool,
    events: VecDeque<Event>,
}

/// What the engine and the CQs hold of a QP.
#[derive(Debug)]
pub struct QpShared {
    qpn: u32,
    pd: PdId,
    caps: QpCaps,
    device: Weak<DeviceInner>,
    send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
    srq: Option<Arc<Srq>>,
    io: Mutex<QpIo>,
    /// The stream, once connected. Reads and writes go through `&TcpStream`
    /// under the `io` lock; outside it the socket is only polled.
    sock: OnceLock<TcpStream>,
    /// Bumped each time an application thread drives the QP.
    app_polls: AtomicU64,
    /// Application threads asleep in `poll(2)` on this QP's socket.
    app_waiters: AtomicU32,
    /// The application handed the QP to the engine (it armed a CQ).
    released: AtomicBool,
    /// Engine only: `app_polls` when the engine last looked.
    engine_seen: AtomicU64,
    /// Engine only: in the engine's parked list.
    parked: AtomicBool,
    /// The socket's epoll registration is armed. Set only under the `io`
    /// lock; cleared by the engine when it parks the QP.
    armed: AtomicBool,
    /// Framed output waits for the socket to become writable.
    tx_blocked: AtomicBool,
    /// The stream is closed: nothing more to read.
    closed: AtomicBool,
}

impl QpShared {
    /// Drive the QP: read what the socket has, process it, write what is
    /// due, deliver completions.
    pub(crate) fn progress(&self) {
        self.note_app();
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        self.drive(&mut io);
    }

    /// Like [`progress`](Self::progress), unless another thread is at it.
    pub(crate) fn try_progress(&self) {
        self.note_app();
        if let Ok(mut io) = self.io.try_lock() {
            self.drive(&mut io);
        }
    }

    /// An application thread is driving this QP: the engine keeps off.
    fn note_app(&self) {
        self.app_polls.fetch_add(1, Ordering::Relaxed);
        if self.released.load(Ordering::Relaxed) {
            self.released.store(false, Ordering::Relaxed);
        }
    }

    /// Engine only: whether an application thread drove the QP since the
    /// engine last looked, or sleeps on its socket.
    fn app_active(&self) -> bool {
        let polls = self.app_polls.load(Ordering::Relaxed);
        let seen = self.engine_seen.swap(polls, Ordering::Relaxed);
        self.app_waiters.load(Ordering::SeqCst) > 0
            || (polls != seen && !self.released.load(Ordering::Relaxed))
    }

    /// Hand the QP to the engine now (the application is going to sleep
    /// on a completion channel).
    pub(crate) fn release_to_engine(&self) {
        self.released.store(true, Ordering::Relaxed);
        if self.parked.load(Ordering::Relaxed) {
            if let Some(dev) = self.device.upgrade() {
                dev.engine.kick();
            }
        }
    }

    /// Engine only: drive, then re-arm the socket if `rearm`.
    fn engine_drive(&self, rearm: bool) {
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        self.drive(&mut io);
        if io.closed || !rearm {
            return;
        }
        let (Some(dev), Some(sock)) = (self.device.upgrade(), self.sock.get()) else {
            return;
        };
        self.armed.store(true, Ordering::Relaxed);
        dev.engine.arm(self.qpn, sock, io.writable_wanted);
    }

    /// The socket to sleep on in [`CompletionQueue::wait`], with whether
    /// to wait for writability too; `None` before connection and after
    /// close.
    pub(crate) fn wait_fd(&self) -> Option<(std::os::fd::BorrowedFd<'_>, bool)> {
        if self.closed.load(Ordering::Acquire) {
            return None;
        }
        let sock = self.sock.get()?;
        Some((sock.as_fd(), self.tx_blocked.load(Ordering::Acquire)))
    }

    /// An application thread starts (`true`) or stops sleeping on the
    /// socket.
    pub(crate) fn set_waiting(&self, on: bool) {
        if on {
            self.app_waiters.fetch_add(1, Ordering::SeqCst);
        } else {
            self.app_waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn drive(&self, io: &mut QpIo) {
        self.drive_with(io, true);
    }

    /// Drive; `read`: also read the socket (a post only writes: reading is
    /// for whoever polls, so a thread that only posts never delays its
    /// request behind a read syscall, nor keeps the engine off the QP).
    fn drive_with(&self, io: &mut QpIo, read: bool) {
        let Some(dev) = self.device.upgrade() else {
            return;
        };
        let env = Env {
            mem: &dev.mem,
            srq: self.srq.as_deref(),
        };
        let QpIo {
            conn,
            rbuf,
            writable_wanted,
            closed,
            events,
            ..
        } = io;
        let (Some(conn), Some(mut sock)) = (conn.as_mut(), self.sock.get()) else {
            return;
        };
        if rbuf.is_empty() {
            rbuf.resize(READ_CHUNK, 0);
        }
        // What was posted leaves before we look for input: a post's
        // request is on the wire one read syscall sooner.
        if read && !*writable_wanted && conn.has_pending_tx() {
            Self::flush(conn, &mut sock, &env);
        }
        // Bounded so that one busy QP cannot starve the others.
        for _ in 0..if read { 64 } else { 0 } {
            if *closed {
                break;
            }
            match sock.read(rbuf) {
                Ok(0) => {
                    conn.handle_closed();
                    *closed = true;
                }
                Ok(n) => {
                    conn.handle_bytes(&rbuf[..n], &env);
                    // Let responses and new requests out between reads.
                    Self::flush(conn, &mut sock, &env);
                    if n < rbuf.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    debug!(qpn = self.qpn, error = %e, "socket read failed");
                    conn.handle_closed();
                    *closed = true;
                }
            }
        }
        let pending = Self::flush(conn, &mut sock, &env);
        if pending != *writable_wanted {
            *writable_wanted = pending;
            self.tx_blocked.store(pending, Ordering::Release);
            // A parked socket is re-armed with the right flags when the
            // engine takes it back; application waiters poll for output
            // through `tx_blocked`.
            if self.armed.load(Ordering::Relaxed) {
                dev.engine.arm(self.qpn, sock, pending);
            }
        }
        while let Some((side, wc)) = conn.poll_completion() {
            match side {
                CqSide::Send => self.send_cq.push(wc),
                CqSide::Recv => self.recv_cq.push(wc),
            }
        }
        while let Some(ev) = conn.poll_event() {
            debug!(qpn = self.qpn, ?ev, "event");
            events.push_back(ev);
        }
        if conn.wants_close() || (*closed && conn.state() == QpState::Error) {
            let _ = sock.shutdown(Shutdown::Both);
            dev.engine.deregister(self.qpn, sock);
            *closed = true;
            self.closed.store(true, Ordering::Release);
        }
    }

    /// Write what the connection has to send; returns whether bytes are
    /// still waiting for the socket. Payloads go from registered memory
    /// straight into `writev` (the core keeps only headers and CRCs).
    fn flush(conn: &mut Connection, sock: &mut &TcpStream, env: &Env) -> bool {
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
            match conn.write_transmit(env, |iov| sock.write_vectored(iov)) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    debug!(error = %e, "socket write failed");
                    conn.handle_closed();
                    return false;
                }
            }
        }
    }
}

/// An RC queue pair.
#[derive(Debug)]
pub struct QueuePair {
    shared: Arc<QpShared>,
    device: Device,
}

impl QueuePair {
    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.shared.qpn
    }

    /// The current state (RTR before the connection is up).
    pub fn state(&self) -> QpState {
        let io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        io.conn
            .as_ref()
            .map(Connection::state)
            .unwrap_or(QpState::Rtr)
    }

    /// What the MPA exchange settled, once connected.
    pub fn negotiated(&self) -> Option<Negotiated> {
        let io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        io.conn.as_ref().map(|c| c.negotiated().clone())
    }

    /// Connection events so far (Established, Terminate sent/received, Closed).
    pub fn take_events(&self) -> Vec<Event> {
        let mut io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        io.events.drain(..).collect()
    }

    /// `ibv_post_send`. The request is framed and written from the calling
    /// thread (which does not read the socket: input is for whoever polls,
    /// the device's engine when nobody does).
    pub fn post_send(&self, wr: SendWr) -> Result<(), DeviceError> {
        let dev = &self.device.inner;
        let env = Env {
            mem: &dev.mem,
            srq: self.shared.srq.as_deref(),
        };
        let mut io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        if io.conn.is_none() && io.errored_early {
            // A QP in Error completes what is posted with a flush error.
            self.shared.send_cq.push(WorkCompletion {
                wr_id: wr.wr_id,
                status: WcStatus::WrFlushErr,
                opcode: wr.op.wc_opcode(),
                qp_num: self.shared.qpn,
                ..WorkCompletion::BLANK
            });
            return Ok(());
        }
        let Some(conn) = io.conn.as_mut() else {
            return Err(DeviceError::InvalidState);
        };
        conn.post_send(wr, &env)?;
        self.shared.drive_with(&mut io, false);
        Ok(())
    }

    /// `ibv_post_recv`. Allowed before the connection exists.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), DeviceError> {
        if self.shared.srq.is_some() {
            return Err(PostError::HasSrq.into());
        }
        let mut io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        let errored_early = io.errored_early;
        match io.conn.as_mut() {
            Some(conn) => conn.post_recv(wr)?,
            None if errored_early => self.shared.recv_cq.push(WorkCompletion {
                wr_id: wr.wr_id,
                status: WcStatus::WrFlushErr,
                opcode: WcOpcode::Recv,
                qp_num: self.shared.qpn,
                ..WorkCompletion::BLANK
            }),
            None => {
                if wr.sg_list.len() > self.shared.caps.max_recv_sge as usize {
                    return Err(PostError::TooManySges(
                        wr.sg_list.len(),
                        self.shared.caps.max_recv_sge,
                    )
                    .into());
                }
                if io.early_recv.len() >= self.shared.caps.max_recv_wr as usize {
                    return Err(PostError::Recv(crate::srq::PostRecvError::Full(
                        self.shared.caps.max_recv_wr as usize,
                    ))
                    .into());
                }
                io.early_recv.push_back(wr);
            }
        }
        Ok(())
    }

    /// Move the QP to Error (`ibv_modify_qp(IBV_QPS_ERR)`): outstanding WRs
    /// complete with a flush error and the stream closes.
    pub fn set_error(&self) {
        let mut io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(conn) = io.conn.as_mut() {
            conn.set_error();
        } else {
            io.errored_early = true;
            let flushed: Vec<_> = io.early_recv.drain(..).collect();
            for wr in flushed {
                self.shared.recv_cq.push(WorkCompletion {
                    wr_id: wr.wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: WcOpcode::Recv,
                    byte_len: 0,
                    imm: None,
                    invalidated_rkey: None,
                    qp_num: self.shared.qpn,
                    vendor_err: 0,
                    solicited: false,
                });
            }
        }
        self.shared.drive(&mut io);
    }

    /// Drive this QP once from the calling thread.
    pub fn progress(&self) {
        self.shared.progress();
    }

    /// Active side: connect to `addr` and run the MPA exchange.
    /// Returns the responder's private data.
    pub fn connect(
        &self,
        addr: impl ToSocketAddrs,
        params: &MpaParams,
    ) -> Result<Vec<u8>, DeviceError> {
        let addr = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::new(ErrorKind::InvalidInput, "no address"))?;
        let mut sock = TcpStream::connect_timeout(&addr, SETUP_TIMEOUT)?;
        sock.set_nodelay(true)?;
        let (mut initiator, request) = Initiator::new(params.clone())?;
        sock.write_all(&request)?;
        let (answer, leftover) = read_until(&mut sock, |input| initiator.handle_bytes(input))?;
        match answer {
            Answer::Rejected(pd) => Err(DeviceError::Rejected(pd)),
            Answer::Accepted(neg) => {
                let private = neg.peer_private_data.clone();
                self.start(sock, neg, &leftover)?;
                Ok(private)
            }
        }
    }

    /// Turn a finished MPA exchange into a running stream.
    fn start(&self, sock: TcpStream, neg: Negotiated, leftover: &[u8]) -> Result<(), DeviceError> {
        sock.set_nonblocking(true)?;
        let mut conn = Connection::new(
            self.shared.qpn,
            self.shared.pd,
            self.shared.caps,
            neg,
            self.shared.srq.is_some(),
        );
        let mut io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        if io.conn.is_some() || io.errored_early {
            return Err(DeviceError::InvalidState);
        }
        for wr in io.early_recv.drain(..) {
            conn.post_recv(wr)?;
        }
        let dev = &self.device.inner;
        if !leftover.is_empty() {
            let env = Env {
                mem: &dev.mem,
                srq: self.shared.srq.as_deref(),
            };
            conn.handle_bytes(leftover, &env);
        }
        let sock = self.shared.sock.get_or_init(|| sock);
        dev.engine.register(&self.shared, sock)?;
        io.conn = Some(conn);
        self.shared.drive(&mut io);
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let mut io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(sock) = self.shared.sock.get() {
            let _ = sock.shutdown(Shutdown::Both);
            self.device.inner.engine.deregister(self.shared.qpn, sock);
        }
        io.closed = true;
        self.shared.closed.store(true, Ordering::Release);
        io.conn = None;
    }
}

/// Read from a blocking socket until `step` yields a value or the setup
/// deadline passes; returns the value and the bytes that followed it.
fn read_until<T>(
    sock: &mut TcpStream,
    mut step: impl FnMut(&mut &[u8]) -> crate::wire::Result<Option<T>>,
) -> Result<(T, Vec<u8>), DeviceError> {
    let deadline = Instant::now() + SETUP_TIMEOUT;
    let mut buf = [0u8; 2048];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(DeviceError::Timeout);
        }
        sock.set_read_timeout(Some(left))?;
        let n = match sock.read(&mut buf) {
            Ok(0) => return Err(DeviceError::Mpa(crate::wire::Error::LlpClosed)),
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(DeviceError::Timeout)
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        let mut input = &buf[..n];
        if let Some(v) = step(&mut input)? {
            sock.set_read_timeout(None)?;
            return Ok((v, input.to_vec()));
        }
    }
}

/// A passive endpoint: accepts TCP connections and reads their MPA
/// Requests.
#[derive(Debug)]
pub struct Listener {
    tcp: TcpListener,
}

impl Listener {
    /// Listen on `addr` (port 0 picks one).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<Listener, DeviceError> {
        Ok(Listener {
            tcp: TcpListener::bind(addr)?,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, DeviceError> {
        Ok(self.tcp.local_addr()?)
    }

    /// Wait for a connection and its MPA Request.
    pub fn accept(&self) -> Result<ConnRequest, DeviceError> {
        let (mut sock, peer) = self.tcp.accept()?;
        sock.set_nodelay(true)?;
        let mut reader = Request::reader();
        let (request, leftover) = read_until(&mut sock, |input| {
            Ok(reader.read(input)?.map(|r| Request::from_repr(&r)))
        })?;
        Ok(ConnRequest {
            sock,
            peer,
            request,
            leftover,
        })
    }
}

/// A connection request waiting for the application's decision.
#[derive(Debug)]
pub struct ConnRequest {
    sock: TcpStream,
    peer: SocketAddr,
    request: Request,
    leftover: Vec<u8>,
}

impl ConnRequest {
    /// The initiator's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The MPA Request as received (revision, CRC/marker wishes, IRD/ORD,
    /// private data).
    pub fn request(&self) -> &Request {
        &self.request
    }

    /// Accept onto `qp` with `params` (our IRD/ORD, CRC wish, private data).
    /// If RFC 6581's rules leave no agreement, the request is rejected and
    /// the error returned.
    pub fn accept(mut self, qp: &QueuePair, params: &MpaParams) -> Result<(), DeviceError> {
        let (neg, reply) = match self.request.accept(params) {
            Ok(x) => x,
            Err(e) => {
                if let Ok(reply) = self.request.reject(&[]) {
                    let _ = self.sock.write_all(&reply);
                }
                return Err(e.into());
            }
        };
        self.sock.write_all(&reply)?;
        qp.start(self.sock, neg, &self.leftover)
    }

    /// Reject with private data, then close.
    pub fn reject(mut self, private_data: &[u8]) -> Result<(), DeviceError> {
        let reply = self.request.reject(private_data)?;
        self.sock.write_all(&reply)?;
        let _ = self.sock.shutdown(Shutdown::Write);
        Ok(())
    }
}
