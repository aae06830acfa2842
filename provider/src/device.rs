//! The userspace RNIC's verbs objects: device, protection domains,
//! registrations, QPs, and the passive side of connection setup.
//!
//! Each connected QP is a sans-IO [`Connection`] under a TCP driver
//! ([`crate::driver`]); the device's progress engine ([`crate::engine`])
//! drives the QPs no application thread is driving, in the device's
//! [`Progress`] mode.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::cq::CompletionQueue;
use crate::driver::QpShared;
use crate::engine::{Engine, Progress};
pub use crate::listener::Listener;
use crate::mem::{Access, MrTable, PdId, RegisterError};
use crate::nosignal::NoSignal;
use crate::qp::{Connection, Event, PostError, QpCaps, QpState};
use crate::setup::{Answer, Initiator, MpaParams, Negotiated, Request};
use crate::srq::Srq;
use crate::wr::{RecvWr, SendWr, SendWrRef, WcOpcode, WcStatus, WorkCompletion};

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
    /// The listener was shut down.
    #[error("listener shut down")]
    ListenerClosed,
}

/// How long connection setup may take before it fails.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// A userspace iWARP device.
#[derive(Debug, Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    name: String,
    mem: Arc<MrTable>,
    next_pd: AtomicU32,
    next_qpn: AtomicU32,
    engine: Arc<Engine>,
    /// Every QP made on the device, for deregistration to find the output
    /// that still reads a region.
    qps: Mutex<Vec<Weak<QpShared>>>,
}

impl Device {
    /// Open a userspace device named `name` (e.g. `"stag0"`), in the
    /// progress mode `$STAG_PROGRESS` names (else the default).
    pub fn open(name: &str) -> Result<Device, DeviceError> {
        Self::open_with(name, Progress::from_env())
    }

    /// Open a userspace device whose engine runs in `progress` mode.
    pub fn open_with(name: &str, progress: Progress) -> Result<Device, DeviceError> {
        Ok(Device {
            inner: Arc::new(DeviceInner {
                name: name.to_owned(),
                mem: Arc::new(MrTable::new()),
                next_pd: AtomicU32::new(1),
                next_qpn: AtomicU32::new(1),
                engine: Arc::new(Engine::start(name, progress)?),
                qps: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The progress mode of the device's engine.
    pub fn progress(&self) -> Progress {
        self.inner.engine.progress()
    }

    /// How many times the engine found input for a QP that an application
    /// thread was driving (it polled a CQ with no notification armed) and
    /// left it to that thread. An application that sleeps on completion
    /// notifications never causes one: its arrivals are the engine's, or
    /// the sleeping thread's own.
    pub fn engine_parks(&self) -> u64 {
        self.inner.engine.parks()
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

    /// `ibv_dereg_mr`. Once it returns the region is never read or
    /// written again. Output already framed from it (a Send's segments,
    /// a Read Response, waiting for the socket) is copied first, so that
    /// it leaves exactly as its CRC says; a posted WR whose octets are not
    /// framed yet completes with `IBV_WC_LOC_PROT_ERR` and its QP goes to
    /// Error, as on an RNIC.
    pub fn dereg_mr(&self, stag: u32) -> Result<(), DeviceError> {
        let inner = &self.device.inner;
        // New checks of the STag fail from here on, so no QP frames more
        // output from it while the queued output is copied.
        inner.mem.revoke(stag)?;
        let qps: Vec<Arc<QpShared>> = {
            let mut list = inner.qps.lock().unwrap_or_else(|p| p.into_inner());
            list.retain(|w| w.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        for qp in qps.iter().filter(|qp| qp.pd == self.id) {
            let env = qp.env();
            let mut io = qp.lock();
            if let Some(conn) = io.conn.as_mut() {
                conn.detach_region(&env, stag);
            }
        }
        inner.mem.remove_revoked(stag);
        Ok(())
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
        let shared = QpShared::new(
            qpn,
            self.id,
            caps,
            self.device.inner.mem.clone(),
            &self.device.inner.engine,
            send_cq,
            recv_cq,
            srq,
        );
        {
            let mut list = self
                .device
                .inner
                .qps
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            list.retain(|w| w.strong_count() > 0);
            list.push(Arc::downgrade(&shared));
        }
        QueuePair {
            shared,
            _device: self.device.clone(),
        }
    }
}

/// An RC queue pair.
#[derive(Debug)]
pub struct QueuePair {
    shared: Arc<QpShared>,
    /// Keeps the device, and so its engine, alive while the QP is.
    _device: Device,
}

impl QueuePair {
    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.shared.qpn
    }

    /// The current state (RTR before the connection is up).
    pub fn state(&self) -> QpState {
        let io = self.shared.lock();
        io.conn
            .as_ref()
            .map(Connection::state)
            .unwrap_or(QpState::Rtr)
    }

    /// What the MPA exchange settled, once connected.
    pub fn negotiated(&self) -> Option<Negotiated> {
        let io = self.shared.lock();
        io.conn.as_ref().map(|c| c.negotiated().clone())
    }

    /// Connection events so far (Established, Terminate sent/received, Closed).
    pub fn take_events(&self) -> Vec<Event> {
        let mut io = self.shared.lock();
        io.events.drain(..).collect()
    }

    /// Have `hook` called whenever connection events are queued for
    /// [`take_events`](Self::take_events) (from whichever thread drives
    /// the QP, with the QP locked: it must only signal, e.g. wake a
    /// thread that then looks). One hook per QP; returns false if one was
    /// already set.
    pub fn set_event_hook(&self, hook: fn()) -> bool {
        self.shared.set_event_hook(hook)
    }

    /// Have `hook` called with each connection event as it happens (from
    /// whichever thread drives the QP, with the QP locked: it must not
    /// block or call back into the QP), besides queuing it for
    /// [`take_events`](Self::take_events): how the rdma-core plugin raises
    /// `ibv_get_async_event`'s events. One per QP; returns false if one was
    /// already set.
    pub fn set_async_hook(&self, hook: impl Fn(&Event) + Send + Sync + 'static) -> bool {
        self.shared
            .set_async_hook(crate::driver::AsyncHook(Box::new(hook)))
    }

    /// `ibv_post_send`. The request is framed and written from the calling
    /// thread (which does not read the socket: input is for whoever polls,
    /// the device's engine when nobody does).
    pub fn post_send(&self, wr: SendWr) -> Result<(), DeviceError> {
        self.post(wr, true)
    }

    /// One WR of a post list: queued and framed like
    /// [`post_send`](Self::post_send), but written to the socket only at
    /// the list's [`ring_doorbell`](Self::ring_doorbell) (or by whoever
    /// drives the QP first), so that a list leaves in one write.
    pub fn post_send_unrung(&self, wr: SendWr) -> Result<(), DeviceError> {
        self.post(wr, false)
    }

    /// [`post_send`](Self::post_send) (`ring`) or
    /// [`post_send_unrung`](Self::post_send_unrung) with a borrowed SGE
    /// list: the QP copies it into storage recycled from completed WRs, so
    /// a steady stream of posts allocates nothing.
    pub fn post_send_ref(&self, wr: SendWrRef<'_>, ring: bool) -> Result<(), DeviceError> {
        let env = self.shared.env();
        let mut io = self.shared.lock();
        match io.conn.as_mut() {
            Some(conn) => conn.post_send_ref(wr, &env)?,
            // Not connected (or errored early): the owned path handles it.
            None => {
                drop(io);
                let owned = SendWr {
                    wr_id: wr.wr_id,
                    op: wr.op,
                    sg_list: wr.sg_list.to_vec(),
                    signaled: wr.signaled,
                    fence: wr.fence,
                };
                return self.post(owned, ring);
            }
        }
        if ring {
            self.shared.drive_with(&mut io, false);
        }
        Ok(())
    }

    /// Write what [`post_send_unrung`](Self::post_send_unrung) queued.
    pub fn ring_doorbell(&self) {
        let mut io = self.shared.lock();
        self.shared.drive_with(&mut io, false);
    }

    fn post(&self, wr: SendWr, ring: bool) -> Result<(), DeviceError> {
        let env = self.shared.env();
        let mut io = self.shared.lock();
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
        if ring {
            self.shared.drive_with(&mut io, false);
        }
        Ok(())
    }

    /// `ibv_post_recv`. Allowed before the connection exists.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), DeviceError> {
        if self.shared.srq.is_some() {
            return Err(PostError::HasSrq.into());
        }
        let mut io = self.shared.lock();
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
        let mut io = self.shared.lock();
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

    /// Drive this QP once from the calling thread unless another thread
    /// is driving it right now (then that thread does the work): for a
    /// thread that polls on behalf of QPs it does not own and must not
    /// wait behind their engine.
    pub fn try_progress(&self) {
        crate::cq::CqQp::try_progress(&*self.shared, true);
    }

    /// [`try_progress`](Self::try_progress), telling whether it read
    /// input from the peer (false too when another thread held the QP).
    pub fn try_progress_reading(&self) -> bool {
        self.shared.try_progress_reading()
    }

    /// Hand the QP to the device's engine now: the calling thread, which
    /// drove it, stops doing so (otherwise the engine takes it back only
    /// after it sees no application drive for a while).
    pub fn release_to_engine(&self) {
        crate::cq::CqQp::release_to_engine(&*self.shared);
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
        let sock = TcpStream::connect_timeout(&addr, SETUP_TIMEOUT)?;
        self.connect_stream(sock, params)
    }

    /// Active side over `sock`, a TCP connection the caller made (rdma_cm
    /// binds it to the source port the application named): run the MPA
    /// exchange. Returns the responder's private data.
    pub fn connect_stream(
        &self,
        mut sock: TcpStream,
        params: &MpaParams,
    ) -> Result<Vec<u8>, DeviceError> {
        sock.set_nodelay(true)?;
        let (mut initiator, request) = Initiator::new(params.clone())?;
        NoSignal(&sock).write_all(&request)?;
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
        let mut io = self.shared.lock();
        if io.conn.is_some() || io.errored_early {
            return Err(DeviceError::InvalidState);
        }
        for wr in io.early_recv.drain(..) {
            conn.post_recv(wr)?;
        }
        if !leftover.is_empty() {
            conn.handle_bytes(leftover, &self.shared.env());
        }
        io.conn = Some(conn);
        self.shared.attach_socket(&mut io, sock)?;
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let mut io = self.shared.lock();
        self.shared.shut(&mut io);
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

/// A connection request waiting for the application's decision.
#[derive(Debug)]
pub struct ConnRequest {
    sock: TcpStream,
    peer: SocketAddr,
    request: Request,
    leftover: Vec<u8>,
}

impl ConnRequest {
    /// A request read whole from `sock` (blocking), with the stream bytes
    /// that followed it.
    pub(crate) fn new(
        sock: TcpStream,
        peer: SocketAddr,
        request: Request,
        leftover: Vec<u8>,
    ) -> ConnRequest {
        ConnRequest {
            sock,
            peer,
            request,
            leftover,
        }
    }

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
    pub fn accept(self, qp: &QueuePair, params: &MpaParams) -> Result<(), DeviceError> {
        let (neg, reply) = match self.request.accept(params) {
            Ok(x) => x,
            Err(e) => {
                if let Ok(reply) = self.request.reject(&[]) {
                    let _ = NoSignal(&self.sock).write_all(&reply);
                }
                return Err(e.into());
            }
        };
        NoSignal(&self.sock).write_all(&reply)?;
        qp.start(self.sock, neg, &self.leftover)
    }

    /// Reject with private data, then close.
    pub fn reject(self, private_data: &[u8]) -> Result<(), DeviceError> {
        let reply = self.request.reject(private_data)?;
        NoSignal(&self.sock).write_all(&reply)?;
        let _ = self.sock.shutdown(Shutdown::Write);
        Ok(())
    }
}
