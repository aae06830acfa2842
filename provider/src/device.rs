//! The userspace RNIC's verbs objects: device, protection domains,
//! registrations, QPs, and the passive side of connection setup.
//!
//! Each connected QP is a sans-IO [`Connection`](crate::qp::Connection)
//! under a TCP driver (`driver.rs`, which also holds what a QP does
//! before it is connected); a [`QueuePair`] is a handle onto it, as
//! quinn's `Connection` is over quinn-proto. The device's progress engine
//! ([`crate::engine`]) drives the QPs no application thread is driving,
//! in the device's [`Progress`] mode.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::cq::CompletionQueue;
use crate::driver::QpShared;
use crate::engine::{Engine, Progress};
pub use crate::error::DeviceError;
pub use crate::listener::Listener;
use crate::mem::{Access, MrTable, PdId};
use crate::nosignal::NoSignal;
use crate::qp::{Event, QpCaps, QpState};
use crate::region::Region;
use crate::setup::{Answer, Initiator, MpaParams, Negotiated, Request};
use crate::srq::Srq;
use crate::wr::{RecvWr, Remote, SendWr, SendWrRef, Sge};

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

    /// `ibv_reg_mr` of memory the registration owns (sideway's
    /// `reg_managed_mr`): `region`'s bytes are visible to SGEs and peers at
    /// `iova..iova + len` (pass `region.addr(0)` for the usual
    /// virtual-address registration), and dropping the [`MemoryRegion`]
    /// deregisters them before the memory is unmapped.
    pub fn register(
        &self,
        region: Region,
        iova: u64,
        access: Access,
    ) -> Result<MemoryRegion, DeviceError> {
        // SAFETY: the MemoryRegion built below owns `region` and
        // deregisters the STag (Drop or `into_region`) before it drops or
        // hands back the memory; every safe access to a Region is a raw
        // copy or an atomic, so the device writing it meanwhile is sound.
        let stag = unsafe {
            self.device.inner.mem.register(
                self.id,
                region.as_ptr(),
                iova,
                region.len() as u64,
                access,
                region.is_durable(),
            )
        }?;
        Ok(MemoryRegion {
            pd: self.clone(),
            stag,
            iova,
            region: Some(region),
        })
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

/// A registration that owns its memory, from
/// [`ProtectionDomain::register`]: deregistered when dropped, and only
/// then is the memory unmapped.
#[derive(Debug)]
pub struct MemoryRegion {
    pd: ProtectionDomain,
    stag: u32,
    iova: u64,
    /// `None` once handed back by [`into_region`](Self::into_region).
    region: Option<Region>,
}

impl MemoryRegion {
    /// The STag, used as both lkey and rkey.
    pub fn stag(&self) -> u32 {
        self.stag
    }

    /// The address of byte 0 for SGEs and peers.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// The registered memory.
    pub fn region(&self) -> &Region {
        self.region
            .as_ref()
            .expect("a registration has its region until into_region")
    }

    /// A local SGE over `len` bytes at `offset`.
    pub fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge {
            addr: self.iova + offset as u64,
            length: len,
            lkey: self.stag,
        }
    }

    /// What a peer needs to reach `offset` (address and rkey).
    pub fn remote(&self, offset: usize) -> Remote {
        Remote {
            addr: self.iova + offset as u64,
            rkey: self.stag,
        }
    }

    /// Deregister and give the memory back. If deregistration fails the
    /// STag stays in the table, so the memory stays mapped for good (it
    /// is leaked, never freed under the device) and the error returned.
    pub fn into_region(mut self) -> Result<Region, DeviceError> {
        let region = self.region.take().expect("taken once");
        match self.pd.dereg_mr(self.stag) {
            Ok(()) => Ok(region),
            Err(e) => {
                std::mem::forget(region);
                Err(e)
            }
        }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            if self.pd.dereg_mr(self.stag).is_err() {
                // Still in the table: the memory must stay mapped.
                std::mem::forget(region);
            }
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
        self.shared.state()
    }

    /// Whether the stream ended (the peer closed it, or it was shut),
    /// even while messages read before the end still wait for Receives
    /// (the QP stays in RTS until they are taken).
    pub fn stream_ended(&self) -> bool {
        let io = self.shared.lock();
        io.closed
            || io
                .conn
                .as_ref()
                .is_some_and(|c| c.state() == QpState::Error)
    }

    /// What the MPA exchange settled, once connected.
    pub fn negotiated(&self) -> Option<Negotiated> {
        self.shared.negotiated()
    }

    /// Connection events so far (Established, Terminate sent/received, Closed).
    pub fn take_events(&self) -> Vec<Event> {
        self.shared.take_events()
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

    /// Start a post list (`ibv_post_send` with a chain, or
    /// `ibv_wr_start`): each [`PostGuard::push`] queues and frames one WR,
    /// and [`PostGuard::post`] (or dropping the guard) rings the doorbell
    /// once, so that the list leaves in one write.
    pub fn start_post(&self) -> PostGuard<'_> {
        PostGuard {
            qp: &self.shared,
            pushed: false,
        }
    }

    /// `ibv_post_send` of one WR: [`start_post`](Self::start_post),
    /// [`push`](PostGuard::push), [`post`](PostGuard::post).
    pub fn post_send(&self, wr: impl AsSendWr) -> Result<(), DeviceError> {
        let mut post = self.start_post();
        post.push(wr)?;
        post.post();
        Ok(())
    }

    /// `ibv_post_recv`. Allowed before the connection exists.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), DeviceError> {
        self.shared.post_recv(wr)
    }

    /// `ibv_destroy_qp`: close the stream now (nothing of this QP is
    /// placed or completed after it) and take the QP's completions out of
    /// its CQs, as hardware providers do (mlx5's CQ clean), so that a
    /// program that frees what its WR ids point at once the QP is gone
    /// (libfabric's rxm does) never reads one. Dropping the last handle
    /// later only finishes the close.
    pub fn retire(&self) {
        let mut io = self.shared.lock();
        self.shared.shut(&mut io);
        drop(io);
        let n = self.shared.send_cq.discard_qp(self.shared.qpn)
            + if Arc::ptr_eq(&self.shared.send_cq, &self.shared.recv_cq) {
                0
            } else {
                self.shared.recv_cq.discard_qp(self.shared.qpn)
            };
        if n > 0 {
            tracing::debug!(
                qpn = self.shared.qpn,
                n,
                "destroyed QP's completions discarded"
            );
        }
    }

    /// Move the QP to Error (`ibv_modify_qp(IBV_QPS_ERR)`): outstanding WRs
    /// complete with a flush error and the stream closes.
    pub fn set_error(&self) {
        self.shared.set_error();
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
                self.shared.start(sock, neg, &leftover)?;
                Ok(private)
            }
        }
    }
}

/// A post list on one QP, from [`QueuePair::start_post`]: WRs are queued
/// and framed as they are pushed, and written to the socket once, at
/// [`post`](Self::post) or when the guard is dropped (a list that stops at
/// a failing WR still sends the WRs before it, as `ibv_post_send` does).
/// The guard holds no lock between pushes.
#[derive(Debug)]
#[must_use = "the WRs leave at post() or when the guard is dropped"]
pub struct PostGuard<'q> {
    qp: &'q QpShared,
    /// A WR was queued since the last ring.
    pushed: bool,
}

impl PostGuard<'_> {
    /// Queue one send WR. Its SGE list is copied into storage the QP
    /// recycles from completed WRs, so posting a [`SendWrRef`] allocates
    /// nothing in steady state. A refused WR leaves the earlier ones
    /// queued.
    pub fn push(&mut self, wr: impl AsSendWr) -> Result<(), DeviceError> {
        self.qp.queue_send(wr.as_send_wr())?;
        self.pushed = true;
        Ok(())
    }

    /// Ring the doorbell: write what was pushed, from the calling thread.
    pub fn post(mut self) {
        self.ring();
    }

    fn ring(&mut self) {
        if std::mem::take(&mut self.pushed) {
            self.qp.ring();
        }
    }
}

impl Drop for PostGuard<'_> {
    fn drop(&mut self) {
        self.ring();
    }
}

/// A send WR, owned ([`SendWr`]) or with a borrowed SGE list
/// ([`SendWrRef`]): what [`PostGuard::push`] takes.
pub trait AsSendWr {
    /// The WR, borrowed.
    fn as_send_wr(&self) -> SendWrRef<'_>;
}

impl AsSendWr for SendWrRef<'_> {
    fn as_send_wr(&self) -> SendWrRef<'_> {
        *self
    }
}

impl AsSendWr for SendWr {
    fn as_send_wr(&self) -> SendWrRef<'_> {
        SendWrRef {
            wr_id: self.wr_id,
            op: self.op,
            sg_list: &self.sg_list,
            signaled: self.signaled,
            fence: self.fence,
        }
    }
}

impl AsSendWr for &SendWr {
    fn as_send_wr(&self) -> SendWrRef<'_> {
        (*self).as_send_wr()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let mut io = self.shared.lock();
        self.shared.shut(&mut io);
        drop(io);
        // The peer learns of the end even if it reads no more (see
        // `linger`): a bounded wait, outside the lock, then a reset when
        // the socket closes with the last reference.
        if let Some(sock) = self.shared.sock() {
            crate::linger::drain_or_reset(sock);
        }
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
        qp.shared.start(self.sock, neg, &self.leftover)
    }

    /// Reject with private data, then close.
    pub fn reject(self, private_data: &[u8]) -> Result<(), DeviceError> {
        let reply = self.request.reject(private_data)?;
        NoSignal(&self.sock).write_all(&reply)?;
        let _ = self.sock.shutdown(Shutdown::Write);
        Ok(())
    }
}
