//! The userspace RNIC: device, protection domains, registrations, QPs and
//! the TCP driver that moves bytes between sockets and the sans-IO
//! [`Connection`].
//!
//! Progress happens in two places, whichever comes first: a per-device
//! engine thread blocked in epoll (so responder-side work — Read Responses,
//! atomics, commits, placement — goes on while the application does
//! something else), and the application's own thread when it posts (the
//! request leaves at once) or polls a CQ that is empty (it reads the
//! sockets itself, so busy polling costs no thread hand-off). A QP's socket
//! and connection sit behind one mutex, so the byte stream is processed in
//! order whoever drives it.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
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
        while !stop.load(Ordering::Acquire) {
            let n = match epoll.wait(&mut events, EpollTimeout::NONE) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    warn!(error = %e, "epoll_wait failed; engine stops");
                    return;
                }
            };
            for ev in &events[..n] {
                let token = ev.data();
                if token == WAKE_TOKEN {
                    let _ = wake.read();
                    continue;
                }
                let qp = qps
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&token)
                    .and_then(Weak::upgrade);
                if let Some(qp) = qp {
                    qp.progress();
                }
            }
        }
    }

    fn register(&self, qp: &Arc<QpShared>, sock: &TcpStream) -> Result<(), DeviceError> {
        let token = qp.qpn as u64;
        self.qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, Arc::downgrade(qp));
        self.epoll.add(
            sock.as_fd(),
            EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP, token),
        )?;
        Ok(())
    }

    /// Ask for (or stop asking for) writability of a QP's socket.
    fn want_write(&self, qpn: u32, sock: &TcpStream, on: bool) {
        let mut flags = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
        if on {
            flags |= EpollFlags::EPOLLOUT;
        }
        let mut ev = EpollEvent::new(flags, qpn as u64);
        if let Err(e) = self.epoll.modify(sock.as_fd(), &mut ev) {
            debug!(qpn, error = %e, "epoll modify failed");
        }
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
    sock: Option<TcpStream>,
    /// Framed bytes not yet written, from `out_pos`.
    out: Vec<u8>,
    out_pos: usize,
    rbuf: Vec<u8>,
    /// Receives posted before the connection exists.
    early_recv: VecDeque<RecvWr>,
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
}

impl QpShared {
    /// Drive the QP: read what the socket has, process it, write what is
    /// due, deliver completions.
    pub(crate) fn progress(&self) {
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        self.drive(&mut io);
    }

    /// Like [`progress`](Self::progress), unless another thread is at it.
    pub(crate) fn try_progress(&self) {
        if let Ok(mut io) = self.io.try_lock() {
            self.drive(&mut io);
        }
    }

    fn drive(&self, io: &mut QpIo) {
        let Some(dev) = self.device.upgrade() else {
            return;
        };
        let env = Env {
            mem: &dev.mem,
            srq: self.srq.as_deref(),
        };
        let QpIo {
            conn,
            sock,
            out,
            out_pos,
            rbuf,
            writable_wanted,
            closed,
            events,
            ..
        } = io;
        let (Some(conn), Some(sock)) = (conn.as_mut(), sock.as_mut()) else {
            return;
        };
        if rbuf.is_empty() {
            rbuf.resize(READ_CHUNK, 0);
        }
        // Bounded so that one busy QP cannot starve the others.
        for _ in 0..64 {
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
                    Self::flush(conn, sock, out, out_pos, &env);
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
        let pending = Self::flush(conn, sock, out, out_pos, &env);
        if pending != *writable_wanted {
            *writable_wanted = pending;
            dev.engine.want_write(self.qpn, sock, pending);
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
        }
    }

    /// Write what the connection has to send; returns whether bytes are
    /// still waiting for the socket.
    fn flush(
        conn: &mut Connection,
        sock: &mut TcpStream,
        out: &mut Vec<u8>,
        out_pos: &mut usize,
        env: &Env,
    ) -> bool {
        loop {
            if *out_pos == out.len() {
                out.clear();
                *out_pos = 0;
                if !conn.poll_transmit(env, out, TX_BUDGET) {
                    return false;
                }
            }
            match sock.write(&out[*out_pos..]) {
                Ok(0) => return true,
                Ok(n) => *out_pos += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    debug!(error = %e, "socket write failed");
                    conn.handle_closed();
                    out.clear();
                    *out_pos = 0;
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
    /// thread.
    pub fn post_send(&self, wr: SendWr) -> Result<(), DeviceError> {
        let dev = &self.device.inner;
        let env = Env {
            mem: &dev.mem,
            srq: self.shared.srq.as_deref(),
        };
        let mut io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        let Some(conn) = io.conn.as_mut() else {
            return Err(DeviceError::InvalidState);
        };
        conn.post_send(wr, &env)?;
        self.shared.drive(&mut io);
        Ok(())
    }

    /// `ibv_post_recv`. Allowed before the connection exists.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), DeviceError> {
        if self.shared.srq.is_some() {
            return Err(PostError::HasSrq.into());
        }
        let mut io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        match io.conn.as_mut() {
            Some(conn) => conn.post_recv(wr)?,
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
        if io.conn.is_some() {
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
        dev.engine.register(&self.shared, &sock)?;
        io.conn = Some(conn);
        io.sock = Some(sock);
        self.shared.drive(&mut io);
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let mut io = self.shared.io.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(sock) = io.sock.take() {
            let _ = sock.shutdown(Shutdown::Both);
            self.device.inner.engine.deregister(self.shared.qpn, &sock);
        }
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
