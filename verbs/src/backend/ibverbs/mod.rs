//! libibverbs and librdmacm as a backend: physical RNICs, rxe, siw, and
//! stag0 through stag's own rdma-core plugin.
//!
//! The only place above the FFI wrapper ([`crate::ibv`]) that touches it;
//! its `unsafe` is posting, whose contract [`SendPost`]/[`RecvPost`] keep
//! (the tracker holds the memory until the completion), and registering
//! memory the registration owns.

mod caps;
mod cm_watch;

use std::any::Any;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::eventfd::{EfdFlags, EventFd};
use provider::mem::Access;
use provider::region::Region;
use provider::wr::{SendOp, Sge};
use tracing::debug;

use super::{
    Backend, Connecting, ContextOps, ContextOptions, CqOps, DeviceInfo, IncomingOps, ListenerOps,
    Opened, PdOps, QpOps, QpRequest, RawCompletion, RecvPost, SendPost, SrqOps,
};
use crate::caps::{OpKind, PostPath, Support};
use crate::error::{Error, Result};
use crate::ibv;
use crate::mr::MrOps;

pub(crate) use caps::capabilities;

/// How long address and route resolution may take.
const RESOLVE_MS: i32 = 5000;

/// Raw completions taken per call.
const BATCH: usize = 32;

pub(crate) fn devices() -> Vec<DeviceInfo> {
    match ibv::devices() {
        Ok(list) => list
            .into_iter()
            .map(|d| DeviceInfo {
                name: d.name,
                backend: Backend::Ibverbs,
                transport: format!("{:?}", d.transport),
            })
            .collect(),
        Err(e) => {
            debug!(error = %e, "no libibverbs devices");
            Vec::new()
        }
    }
}

pub(crate) fn open(name: &str, options: &ContextOptions) -> Result<Opened> {
    // librdmacm's own context, so that QPs created on rdma_cm ids share it
    // with our PDs and CQs.
    let ctx = ibv::Context::open_for_cm(name).map_err(|e| {
        if e.errno == libc::ENODEV {
            Error::NoDevice(name.to_owned())
        } else {
            e.into()
        }
    })?;
    let attr = ctx.query_device()?;
    let wr = ibv::probe_wr_api(&ctx);
    let mut caps = capabilities(name, &attr, &wr);
    let mut ops = wr.ops;
    if caps.get(OpKind::AtomicWrite) == &Support::Native {
        ops = ops | ibv::SendOps::ATOMIC_WRITE;
    }
    if caps.get(OpKind::Commit).is_native() {
        ops = ops | ibv::SendOps::FLUSH;
    }
    let mut wr_ops = wr.available().then_some(ops);
    if options.legacy_post && caps.post_path == PostPath::Extended {
        caps.on_legacy_post();
        wr_ops = None;
    }
    let flush_target = caps.get(OpKind::Commit).is_native();
    Ok(Opened {
        context: Arc::new(IbvContext {
            ctx,
            wr_ops,
            flush_target,
        }),
        caps,
    })
}

#[derive(Debug)]
struct IbvContext {
    ctx: Arc<ibv::Context>,
    /// The `send_ops_flags` its QPs are created with (`None`: legacy
    /// `ibv_create_qp` and `ibv_post_send`).
    wr_ops: Option<ibv::SendOps>,
    flush_target: bool,
}

impl ContextOps for IbvContext {
    fn kind(&self) -> Backend {
        Backend::Ibverbs
    }

    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        Ok(Arc::new(IbvPd {
            pd: self.ctx.alloc_pd()?,
            wr_ops: self.wr_ops,
            flush_target: self.flush_target,
        }))
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CqOps>> {
        let channel = self.ctx.create_comp_channel()?;
        // Events are taken only when there are some (readable), and
        // `req_notify` drains them without blocking.
        channel.set_nonblocking(true)?;
        let cq = self.ctx.create_cq(depth, Some(&channel), 0)?;
        let wake = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(std::io::Error::from)?;
        Ok(Arc::new(IbvCq { cq, channel, wake }))
    }

    fn listen(&self, addr: SocketAddr) -> Result<Box<dyn ListenerOps>> {
        let channel = ibv::EventChannel::new()?;
        let id = ibv::CmId::new(&channel)?;
        id.bind_addr(addr)?;
        id.listen(16)?;
        Ok(Box::new(IbvListener { channel, id }))
    }
}

#[derive(Debug)]
struct IbvPd {
    pd: Arc<ibv::ProtectionDomain>,
    wr_ops: Option<ibv::SendOps>,
    flush_target: bool,
}

fn ibv_access(access: Access) -> ibv::AccessFlags {
    let mut flags = ibv::AccessFlags::EMPTY;
    for (ours, theirs) in [
        (Access::LOCAL_WRITE, ibv::AccessFlags::LOCAL_WRITE),
        (Access::REMOTE_WRITE, ibv::AccessFlags::REMOTE_WRITE),
        (Access::REMOTE_READ, ibv::AccessFlags::REMOTE_READ),
        (Access::REMOTE_ATOMIC, ibv::AccessFlags::REMOTE_ATOMIC),
    ] {
        if access.contains(ours) {
            flags |= theirs;
        }
    }
    // libibverbs requires Local Write with Remote Write or Remote Atomic
    // (ibv_reg_mr(3): EINVAL otherwise); the userspace provider does not.
    // Granting it keeps one Access meaning on every device.
    if access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC) {
        flags |= ibv::AccessFlags::LOCAL_WRITE;
    }
    flags
}

impl IbvPd {
    fn create_qp(&self, id: &ibv::CmId, req: &QpRequest<'_>) -> Result<ibv::QueuePair> {
        let cq = |c: &Arc<dyn CqOps>| {
            c.as_any()
                .downcast_ref::<IbvCq>()
                .map(|c| c.cq.clone())
                .ok_or(Error::Mismatch)
        };
        let (send_cq, recv_cq) = (cq(req.send_cq)?, cq(req.recv_cq)?);
        let srq = match req.srq {
            None => None,
            Some(s) => Some(
                s.as_any()
                    .downcast_ref::<IbvSrq>()
                    .map(|s| s.srq.clone())
                    .ok_or(Error::Mismatch)?,
            ),
        };
        let caps = ibv::QpInitAttr {
            max_send_wr: req.max_send_wr,
            max_recv_wr: req.max_recv_wr,
            max_send_sge: req.max_sge,
            max_recv_sge: req.max_sge,
            send_ops: self.wr_ops,
            ..ibv::QpInitAttr::default()
        };
        Ok(id.create_qp_with_srq(&self.pd, &send_cq, &recv_cq, &caps, srq.as_ref())?)
    }
}

/// Transport retries of an RC QP (`retry_cnt`) after the local ACK
/// timeout (2.1 s on rxe: rdma_cm's RoCE packet lifetime). rdma_cm hands
/// the QP what the connect and accept ask for, and zero meant none: one ack
/// later than the timeout put the sender in Error with
/// IBV_WC_RETRY_EXC_ERR, and everything after it was lost. A QEMU/TCG guest
/// on a loaded host stalls that long (the rxe0 VM-suite failure of
/// `mailbox_survives_concurrent_pollers`, reproduced by freezing the VM
/// 2.5 s at a time: rxe's `retry_exceeded_err` +1); a real fabric drops
/// packets. 6, not the IB maximum 7, which rxe takes as "retry forever": a
/// peer that is gone still ends the connection, after 7 timeouts in a row
/// (the count restarts whenever an ack makes progress).
const TRANSPORT_RETRIES: u8 = 6;

/// RNR retries (`rnr_retry`): none. A Send that finds no posted Receive
/// ends the connection, as on iWARP (siw, stag0), which has no RNR (RFC
/// 5041 §7.2): an application behaves the same on every device.
const RNR_RETRIES: u8 = 0;

fn conn_param(req: &QpRequest<'_>) -> ibv::ConnParam {
    ibv::ConnParam {
        private_data: req.private_data.clone(),
        responder_resources: req.responder_resources,
        initiator_depth: req.initiator_depth,
        retry_count: TRANSPORT_RETRIES,
        rnr_retry_count: RNR_RETRIES,
    }
}

impl PdOps for IbvPd {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn register(&self, region: Region, access: Access) -> Result<Box<dyn MrOps>> {
        // Commit rights become the device's FLUSH right where a device
        // FLUSH is the whole Commit: memory, not a file-backed region (its
        // file needs the agent's msync; a peer's FLUSH to it then fails
        // instead of claiming durability). Elsewhere they are the agent's
        // business.
        let mut flags = ibv_access(access);
        let device_flush = !region.is_durable()
            && (access.contains(Access::FLUSH_GLOBAL) || access.contains(Access::FLUSH_PERSISTENT))
            && self.flush_target;
        if device_flush {
            flags |= ibv::AccessFlags::FLUSH_GLOBAL;
        }
        // SAFETY: the region is owned by the IbvMr built below, which drops
        // the ibv MR (ibv_dereg_mr, after which the device no longer DMAs
        // into it) before the region; safe code reaches the bytes only by
        // raw copies and atomics.
        let mr = unsafe {
            self.pd
                .reg_mr(region.as_ptr().as_ptr().cast(), region.len(), flags)
        }?;
        Ok(Box::new(IbvMr {
            mr: Some(mr),
            region: Some(region),
            device_flush,
        }))
    }

    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Arc<dyn SrqOps>> {
        Ok(Arc::new(IbvSrq {
            srq: Arc::new(ibv::SharedReceiveQueue::new(&self.pd, max_wr, max_sge)?),
        }))
    }

    fn connector(&self, req: QpRequest<'_>, addr: SocketAddr) -> Result<Box<dyn Connecting>> {
        let channel = ibv::EventChannel::new()?;
        let id = ibv::CmId::new(&channel)?;
        id.resolve_addr(None, addr, RESOLVE_MS)?;
        channel.expect(ibv::CmEventType::AddrResolved)?;
        id.resolve_route(RESOLVE_MS)?;
        channel.expect(ibv::CmEventType::RouteResolved)?;
        let qp = self.create_qp(&id, &req)?;
        let qp: Arc<IbvQp> = Arc::new(IbvQp {
            watch: std::sync::OnceLock::new(),
            qp,
            id,
        });
        Ok(Box::new(IbvConnecting {
            ops: qp.clone(),
            qp,
            channel,
            param: conn_param(&req),
            active: true,
        }))
    }
}

/// An ibv MR and the region it registers; the MR goes first.
#[derive(Debug)]
struct IbvMr {
    mr: Option<ibv::MemoryRegion>,
    region: Option<Region>,
    device_flush: bool,
}

impl Drop for IbvMr {
    fn drop(&mut self) {
        // ibv_dereg_mr before the region is unmapped.
        drop(self.mr.take());
    }
}

impl MrOps for IbvMr {
    fn lkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, ibv::MemoryRegion::lkey)
    }
    fn rkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, ibv::MemoryRegion::rkey)
    }
    fn region(&self) -> &Region {
        self.region
            .as_ref()
            .expect("a registration has its region until into_region")
    }
    fn device_flush(&self) -> bool {
        self.device_flush
    }
    fn into_region(mut self: Box<Self>) -> Result<Region> {
        // The wrapper's Drop runs ibv_dereg_mr (and reports a failure); a
        // registration is gone from the process once it returns.
        drop(self.mr.take());
        Ok(self.region.take().expect("taken once"))
    }
}

struct IbvCq {
    cq: Arc<ibv::CompletionQueue>,
    channel: Arc<ibv::CompletionChannel>,
    /// Written by [`CqOps::interrupt`]: wakes a waiter for completions
    /// queued above the device.
    wake: EventFd,
}

impl std::fmt::Debug for IbvCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvCq").field("cq", &self.cq).finish()
    }
}

fn raw(wc: &ibv::WorkCompletion) -> RawCompletion {
    RawCompletion {
        token: wc.wr_id,
        status: wc.status,
        byte_len: wc.byte_len,
        imm: wc.imm.map(u64::from),
        qp_num: wc.qp_num,
        vendor_err: wc.vendor_err,
        // libibverbs does not report the Solicited Event bit.
        solicited: false,
        invalidated: wc.invalidated_rkey,
    }
}

impl CqOps for IbvCq {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn poll(&self, out: &mut Vec<RawCompletion>, max: usize) -> Result<()> {
        let mut n = 0;
        while n < max.clamp(1, BATCH) {
            match self.cq.poll_one()? {
                Some(wc) => out.push(raw(&wc)),
                None => break,
            }
            n += 1;
        }
        Ok(())
    }

    fn req_notify(&self) -> Result<bool> {
        while self.channel.get_event().is_ok() {}
        self.cq.req_notify(false)?;
        // A completion that arrived before arming raised no event: the
        // caller polls once.
        Ok(false)
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.channel.as_fd())
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [
            PollFd::new(self.channel.as_fd(), PollFlags::POLLIN),
            PollFd::new(self.wake.as_fd(), PollFlags::POLLIN),
        ];
        let ms = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, ms) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(std::io::Error::from(e).into()),
        }
        let _ = self.wake.read();
        Ok(())
    }

    fn interrupt(&self) {
        let _ = self.wake.write(1);
    }
}

#[derive(Debug)]
struct IbvQp {
    /// Moves the QP to Error when rdma_cm reports the connection over;
    /// stopped first, before the QP and id go.
    watch: std::sync::OnceLock<cm_watch::CmWatch>,
    // Dropped before the id it lives on.
    qp: ibv::QueuePair,
    id: ibv::CmId,
}

fn sges(s: &[Sge]) -> smallvec::SmallVec<[ibv::Sge; 4]> {
    s.iter()
        .map(|s| ibv::Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })
        .collect()
}

/// The libibverbs opcode for an operation the device runs natively.
fn ibv_op(op: &SendOp) -> Option<ibv::SendOp> {
    Some(match *op {
        SendOp::Send {
            invalidate: None, ..
        } => ibv::SendOp::Send,
        SendOp::Send {
            invalidate: Some(invalidate_rkey),
            ..
        } => ibv::SendOp::SendWithInv { invalidate_rkey },
        SendOp::Write { remote } => ibv::SendOp::RdmaWrite {
            rkey: remote.rkey,
            remote_addr: remote.addr,
        },
        SendOp::Read { remote } => ibv::SendOp::RdmaRead {
            rkey: remote.rkey,
            remote_addr: remote.addr,
        },
        SendOp::FetchAdd {
            remote,
            add,
            mask: 0,
        } => ibv::SendOp::FetchAdd {
            rkey: remote.rkey,
            remote_addr: remote.addr,
            add,
        },
        SendOp::CmpSwap {
            remote,
            compare,
            swap,
            compare_mask: u64::MAX,
            swap_mask: u64::MAX,
        } => ibv::SendOp::CmpSwap {
            rkey: remote.rkey,
            remote_addr: remote.addr,
            compare,
            swap,
        },
        _ => return None,
    })
}

fn flags_of(p: &SendPost<'_>) -> ibv::SendFlags {
    // Always signaled underneath: the tracker entry is released by the
    // completion.
    let mut flags = ibv::SendFlags::SIGNALED;
    if p.fence() {
        flags = flags | ibv::SendFlags::FENCE;
    }
    if let SendOp::Send {
        solicited: true, ..
    } = p.op()
    {
        flags = flags | ibv::SendFlags::SOLICITED;
    }
    flags
}

/// A full send queue is [`Error::QueueFull`] on every backend.
fn post_error(e: ibv::IbvError) -> Error {
    if e.errno == libc::ENOMEM {
        Error::QueueFull
    } else {
        e.into()
    }
}

impl IbvQp {
    /// One batch of the extended API.
    fn post_batch(&self, wrs: &[SendPost<'_>]) -> std::result::Result<(), (Error, usize)> {
        let mut batch = self.qp.start_wr().map_err(|e| (e.into(), 0))?;
        for (i, p) in wrs.iter().enumerate() {
            let flags = flags_of(p);
            let pushed = match p.op() {
                // Only through ibv_wr_flush (the matrix says native only on
                // a QP created with its flag). Global: what a FLUSH target
                // needs (see caps::native_flush_commit).
                SendOp::Commit { remote, len } => batch.flush(
                    p.token(),
                    flags,
                    remote.rkey,
                    remote.addr,
                    len as usize,
                    ibv::FlushType::Global,
                    ibv::FlushLevel::Range,
                ),
                SendOp::AtomicWrite { remote, value } => batch.atomic_write(
                    p.token(),
                    flags,
                    remote.rkey,
                    remote.addr,
                    value.to_ne_bytes(),
                ),
                op => match ibv_op(&op) {
                    // SAFETY: every SGE names memory a tracker entry holds
                    // (registered, alive) until this WR's completion is
                    // taken: a SendPost is made only from such an entry.
                    Some(iop) => unsafe { batch.push(p.token(), flags, iop, &sges(p.sges())) },
                    None => Err(ibv::IbvError::unsupported("ibv_wr_*")),
                },
            };
            if let Err(e) = pushed {
                // Nothing of a failed batch is posted (ibv_wr_abort).
                let _ = i;
                return Err((post_error(e), 0));
            }
        }
        batch.commit().map_err(|e| (post_error(e), 0))
    }
}

impl QpOps for IbvQp {
    fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    fn post_send(&self, wrs: &[SendPost<'_>]) -> std::result::Result<(), (Error, usize)> {
        if self.qp.has_wr_api() {
            return self.post_batch(wrs);
        }
        for (i, p) in wrs.iter().enumerate() {
            let op = p.op();
            let iop = ibv_op(&op).ok_or((
                Error::InvalidRequest("operation has no libibverbs opcode"),
                i,
            ))?;
            let isges = sges(p.sges());
            let wr = ibv::SendWr {
                wr_id: p.token(),
                op: iop,
                sges: &isges,
                flags: flags_of(p),
            };
            // SAFETY: as in post_batch.
            unsafe { self.qp.post_send(&[wr]) }.map_err(|(e, _)| (post_error(e), i))?;
        }
        Ok(())
    }

    fn post_recv(&self, wr: &RecvPost<'_>) -> Result<()> {
        let isges = sges(wr.sges());
        let wr = ibv::RecvWr {
            wr_id: wr.token(),
            sges: &isges,
        };
        // SAFETY: as in post_batch: a RecvPost's memory is held by a
        // tracker entry until the receive completes.
        unsafe { self.qp.post_recv(&[wr]) }.map_err(|(e, _)| Error::from(e))
    }

    fn set_error(&self) -> Result<()> {
        Ok(self.qp.to_error()?)
    }

    fn post_path(&self) -> PostPath {
        if self.qp.has_wr_api() {
            PostPath::Extended
        } else {
            PostPath::Legacy
        }
    }
}

#[derive(Debug)]
struct IbvSrq {
    srq: Arc<ibv::SharedReceiveQueue>,
}

impl SrqOps for IbvSrq {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn post_recv(&self, wr: &RecvPost<'_>) -> Result<()> {
        let isges = sges(wr.sges());
        let wr = ibv::RecvWr {
            wr_id: wr.token(),
            sges: &isges,
        };
        // SAFETY: as for a QP's receive.
        unsafe { self.srq.post_recv(&[wr]) }.map_err(|(e, _)| Error::from(e))
    }

    fn len(&self) -> Option<usize> {
        None
    }
}

struct IbvConnecting {
    qp: Arc<IbvQp>,
    ops: Arc<dyn QpOps>,
    channel: Arc<ibv::EventChannel>,
    param: ibv::ConnParam,
    active: bool,
}

impl Connecting for IbvConnecting {
    fn qp(&self) -> &Arc<dyn QpOps> {
        &self.ops
    }

    fn finish(self: Box<Self>) -> Result<(Arc<dyn QpOps>, Vec<u8>)> {
        if self.active {
            self.qp.id.connect(&self.param)?;
            let ev = self.channel.get_event()?;
            return match ev.kind {
                ibv::CmEventType::Established => {
                    self.watch()?;
                    Ok((self.ops, ev.private_data))
                }
                ibv::CmEventType::Rejected => Err(Error::Rejected(ev.private_data)),
                other => Err(Error::Connect(format!(
                    "rdma_cm event {other:?} instead of ESTABLISHED"
                ))),
            };
        }
        self.qp.id.accept(&self.param)?;
        self.channel.expect(ibv::CmEventType::Established)?;
        self.watch()?;
        Ok((self.ops, Vec::new()))
    }
}

impl IbvConnecting {
    /// The connection is established: from now on its channel carries
    /// only the events that end it, which the watch acts on.
    fn watch(&self) -> Result<()> {
        let watch = cm_watch::CmWatch::start(self.channel.clone(), Arc::downgrade(&self.qp))?;
        let _ = self.qp.watch.set(watch);
        Ok(())
    }
}

#[derive(Debug)]
struct IbvListener {
    channel: Arc<ibv::EventChannel>,
    id: ibv::CmId,
}

impl ListenerOps for IbvListener {
    fn local_addr(&self) -> Result<SocketAddr> {
        self.id
            .local_addr()
            .ok_or_else(|| Error::Connect("listener has no local address".into()))
    }

    fn next(&self) -> Result<Box<dyn IncomingOps>> {
        let ev = self.channel.expect(ibv::CmEventType::ConnectRequest)?;
        let id = ev
            .new_id
            .ok_or_else(|| Error::Connect("connect request without an id".into()))?;
        Ok(Box::new(IbvIncoming {
            id,
            private_data: ev.private_data,
        }))
    }
}

#[derive(Debug)]
struct IbvIncoming {
    id: ibv::CmId,
    private_data: Vec<u8>,
}

impl IncomingOps for IbvIncoming {
    fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    fn acceptor(
        self: Box<Self>,
        pd: &dyn PdOps,
        req: QpRequest<'_>,
    ) -> Result<Box<dyn Connecting>> {
        let pd = pd.as_any().downcast_ref::<IbvPd>().ok_or(Error::Mismatch)?;
        // Its own channel, so that its ESTABLISHED is not mixed up with
        // other requests arriving on the listener's.
        let channel = ibv::EventChannel::new()?;
        let id = self.id.migrate(&channel)?;
        let qp = pd.create_qp(&id, &req)?;
        let qp = Arc::new(IbvQp {
            watch: std::sync::OnceLock::new(),
            qp,
            id,
        });
        Ok(Box::new(IbvConnecting {
            ops: qp.clone(),
            qp,
            channel,
            param: conn_param(&req),
            active: false,
        }))
    }

    fn reject(self: Box<Self>, private_data: &[u8]) -> Result<()> {
        Ok(self.id.reject(private_data)?)
    }
}
