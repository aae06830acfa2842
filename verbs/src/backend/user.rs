//! The userspace iWARP provider as a backend. No `unsafe`: registrations
//! are the provider's owning [`provider::device::MemoryRegion`]s.

use std::any::Any;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use provider::device::{ConnRequest, DeviceError};
use provider::mem::Access;
use provider::qp::PostError;
use provider::region::Region;
use provider::setup::MpaParams;
use provider::wr::{InlineWr, ListWr, SendWrRef, WorkCompletion};

use super::{
    Backend, Connecting, ContextOps, ContextOptions, CqOps, DeviceInfo, IncomingOps, ListenerOps,
    Opened, PdOps, Progress, QpOps, QpRequest, RawCompletion, RecvPost, SendPost, SrqOps,
};
use crate::caps::{Capabilities, PostPath};
use crate::error::{Error, Result};
use crate::mr::MrOps;

/// Raw completions taken per call.
const BATCH: usize = 32;

pub(crate) fn device_info() -> DeviceInfo {
    DeviceInfo {
        name: super::USERSPACE_DEVICE.to_owned(),
        backend: Backend::Userspace,
        transport: "iWARP (userspace)".to_owned(),
    }
}

pub(crate) fn open(name: &str, options: &ContextOptions) -> Result<Opened> {
    let progress = options.progress.unwrap_or_else(Progress::from_env);
    let dev = provider::device::Device::open_with(name, progress)?;
    let caps = if options.rfc5040_only {
        Capabilities::userspace_rfc5040(name)
    } else {
        Capabilities::userspace(name)
    };
    Ok(Opened {
        context: Arc::new(UserContext {
            dev,
            extensions: !options.rfc5040_only,
        }),
        caps,
    })
}

/// A full send queue is [`Error::QueueFull`] on every backend.
fn post_error(e: DeviceError) -> Error {
    match e {
        DeviceError::Post(PostError::SendQueueFull(_)) => Error::QueueFull,
        other => other.into(),
    }
}

#[derive(Debug)]
struct UserContext {
    dev: provider::device::Device,
    /// Its QPs run RFC 7306 and Commit on the wire.
    extensions: bool,
}

impl ContextOps for UserContext {
    fn kind(&self) -> Backend {
        Backend::Userspace
    }

    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        Ok(Arc::new(UserPd {
            pd: self.dev.alloc_pd(),
            extensions: self.extensions,
        }))
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CqOps>> {
        Ok(Arc::new(UserCq {
            cq: provider::cq::CompletionQueue::new(depth as usize)?,
            dev: self.dev.clone(),
        }))
    }

    fn listen(&self, addr: SocketAddr) -> Result<Box<dyn ListenerOps>> {
        Ok(Box::new(UserListener(provider::device::Listener::bind(
            addr,
        )?)))
    }
}

#[derive(Debug)]
struct UserPd {
    pd: provider::device::ProtectionDomain,
    extensions: bool,
}

impl UserPd {
    fn create_qp(&self, req: &QpRequest<'_>) -> Result<Arc<UserQp>> {
        let cq = |c: &Arc<dyn CqOps>| {
            c.as_any()
                .downcast_ref::<UserCq>()
                .map(|c| c.cq.clone())
                .ok_or(Error::Mismatch)
        };
        let (send_cq, recv_cq) = (cq(req.send_cq)?, cq(req.recv_cq)?);
        let srq = match req.srq {
            None => None,
            Some(s) => Some(
                s.as_any()
                    .downcast_ref::<UserSrq>()
                    .map(|s| s.0.clone())
                    .ok_or(Error::Mismatch)?,
            ),
        };
        let caps = provider::qp::QpCaps {
            rdmap_extensions: self.extensions,
            max_send_wr: req.max_send_wr,
            max_recv_wr: req.max_recv_wr,
            max_send_sge: req.max_sge,
            max_recv_sge: req.max_sge,
            ..provider::qp::QpCaps::default()
        };
        Ok(Arc::new(UserQp(self.pd.create_qp(
            caps,
            &send_cq,
            &recv_cq,
            srq.as_ref(),
        ))))
    }
}

fn mpa(req: &QpRequest<'_>) -> MpaParams {
    MpaParams {
        ird: u16::from(req.responder_resources),
        ord: u16::from(req.initiator_depth),
        crc: req.crc,
        p2p: req.peer_to_peer,
        private_data: req.private_data.clone(),
        ..MpaParams::default()
    }
}

impl PdOps for UserPd {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn register(&self, region: Region, access: Access) -> Result<Box<dyn MrOps>> {
        let iova = region.addr(0);
        Ok(Box::new(self.pd.register(region, iova, access)?))
    }

    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Arc<dyn SrqOps>> {
        Ok(Arc::new(UserSrq(Arc::new(provider::srq::Srq::new(
            max_wr as usize,
            max_sge as usize,
        )))))
    }

    fn connector(&self, req: QpRequest<'_>, addr: SocketAddr) -> Result<Box<dyn Connecting>> {
        let qp = self.create_qp(&req)?;
        Ok(Box::new(UserConnecting {
            ops: qp.clone(),
            qp,
            how: How::Connect(addr, mpa(&req)),
        }))
    }
}

/// A registration on the provider's MR table, owning its region.
impl MrOps for provider::device::MemoryRegion {
    fn lkey(&self) -> u32 {
        self.stag()
    }
    fn rkey(&self) -> u32 {
        self.stag()
    }
    fn region(&self) -> &Region {
        provider::device::MemoryRegion::region(self)
    }
    fn into_region(self: Box<Self>) -> Result<Region> {
        Ok((*self).into_region()?)
    }
}

/// A CQ, polled through its device so that a program polling it gets the
/// device's progress policies ([`provider::device::Device::poll_cq`]), as
/// a C program polling through the plugin does.
#[derive(Debug)]
struct UserCq {
    cq: Arc<provider::cq::CompletionQueue>,
    dev: provider::device::Device,
}

fn raw(wc: &WorkCompletion) -> RawCompletion {
    RawCompletion {
        token: wc.wr_id,
        status: wc.status,
        byte_len: wc.byte_len,
        imm: wc.imm,
        qp_num: wc.qp_num,
        vendor_err: wc.vendor_err,
        solicited: wc.solicited,
        invalidated: wc.invalidated_rkey,
    }
}

impl CqOps for UserCq {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn poll(&self, out: &mut Vec<RawCompletion>, max: usize) -> Result<()> {
        // Straight into `out`: a blank-filled batch array per poll was the
        // largest user-space cost of a spinning poller's empty polls.
        self.dev
            .poll_cq_each(&self.cq, max.clamp(1, BATCH), |wc| out.push(raw(&wc)));
        Ok(())
    }

    fn poll_queued(&self, out: &mut Vec<RawCompletion>, max: usize) -> Result<()> {
        self.cq
            .try_poll_each(max.clamp(1, BATCH), |wc| out.push(raw(&wc)));
        Ok(())
    }

    fn has_queued(&self) -> bool {
        !self.cq.is_empty()
    }

    fn req_notify(&self) -> Result<bool> {
        self.cq.ack_events();
        self.cq.req_notify(false);
        Ok(!self.cq.is_empty())
    }

    fn notify_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        Some(self.cq.as_fd())
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        // Completions stay in the provider's queue for the next poll.
        self.cq.wait_ready(timeout);
        Ok(())
    }

    fn interrupt(&self) {
        self.cq.interrupt_wait();
    }
}

#[derive(Debug)]
struct UserQp(provider::device::QueuePair);

fn send_wr<'a>(p: &SendPost<'a>) -> SendWrRef<'a> {
    SendWrRef {
        wr_id: p.token(),
        op: p.op(),
        sg_list: p.sges(),
        // Always signaled underneath: the tracker entry (and the memory it
        // holds) is released by the completion.
        signaled: true,
        fence: p.fence(),
    }
}

/// `wrs` as the provider's post list: an inline payload is copied into
/// the QP's inline slots as it is queued, the others framed from their
/// SGEs.
fn list_wrs<'a>(wrs: &'a [SendPost<'a>]) -> impl Iterator<Item = ListWr<'a>> + 'a {
    wrs.iter().map(|p| match p.inline() {
        Some(_) => ListWr::Inline(InlineWr {
            wr_id: p.token(),
            op: p.op(),
            data: p.inline_parts(),
            signaled: true,
            fence: p.fence(),
        }),
        None => ListWr::Send(send_wr(p)),
    })
}

impl QpOps for UserQp {
    fn qp_num(&self) -> u32 {
        self.0.qp_num()
    }

    fn post_send(&self, wrs: &[SendPost<'_>]) -> std::result::Result<(), (Error, usize)> {
        // Framed as they come and written in one go, under one lock of
        // the QP (after a refused WR, the ones before it still leave).
        self.0
            .post_list(list_wrs(wrs))
            .map_err(|(e, posted)| (post_error(e), posted))
    }

    fn post_send_held(&self, wrs: &[SendPost<'_>]) -> std::result::Result<(), (Error, usize)> {
        let mut post = self.0.start_post();
        post.push_list(list_wrs(wrs))
            .map_err(|(e, posted)| (post_error(e), posted))?;
        post.hold();
        Ok(())
    }

    fn ring(&self) {
        self.0.ring();
    }

    fn post_recv(&self, wr: &RecvPost<'_>) -> Result<()> {
        Ok(self.0.post_recv_ref(wr.token(), wr.sges())?)
    }

    fn set_error(&self) -> Result<()> {
        self.0.set_error();
        Ok(())
    }

    fn progress(&self) {
        self.0.progress();
    }

    fn post_path(&self) -> PostPath {
        PostPath::Userspace
    }

    fn socket_wait_fd(&self) -> Option<(std::os::fd::BorrowedFd<'_>, bool)> {
        self.0.socket_wait_fd()
    }

    fn socket_wait(&self, on: bool) {
        if on {
            self.0.begin_socket_wait();
        } else {
            self.0.end_socket_wait();
        }
    }

    fn copies_inline(&self) -> bool {
        true
    }
}

#[derive(Debug)]
struct UserSrq(Arc<provider::srq::Srq>);

impl SrqOps for UserSrq {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn post_recv(&self, wr: &RecvPost<'_>) -> Result<()> {
        self.0
            .post_recv_ref(wr.token(), wr.sges())
            .map_err(|e| Error::Provider(DeviceError::Post(e.into())))
    }

    fn len(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

enum How {
    Connect(SocketAddr, MpaParams),
    Accept(ConnRequest, MpaParams),
}

struct UserConnecting {
    qp: Arc<UserQp>,
    ops: Arc<dyn QpOps>,
    how: How,
}

impl Connecting for UserConnecting {
    fn qp(&self) -> &Arc<dyn QpOps> {
        &self.ops
    }

    fn finish(self: Box<Self>) -> Result<(Arc<dyn QpOps>, Vec<u8>)> {
        let private = match self.how {
            How::Connect(addr, mpa) => self.qp.0.connect(addr, &mpa).map_err(|e| match e {
                DeviceError::Rejected(pd) => Error::Rejected(pd),
                other => other.into(),
            })?,
            How::Accept(req, mpa) => {
                let private = req.request().private_data.clone();
                req.accept(&self.qp.0, &mpa)?;
                private
            }
        };
        Ok((self.ops, private))
    }
}

#[derive(Debug)]
struct UserListener(provider::device::Listener);

impl ListenerOps for UserListener {
    fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.0.local_addr()?)
    }

    fn next(&self) -> Result<Box<dyn IncomingOps>> {
        Ok(Box::new(UserIncoming(self.0.accept()?)))
    }
}

#[derive(Debug)]
struct UserIncoming(ConnRequest);

impl IncomingOps for UserIncoming {
    fn private_data(&self) -> &[u8] {
        &self.0.request().private_data
    }

    fn acceptor(
        self: Box<Self>,
        pd: &dyn PdOps,
        req: QpRequest<'_>,
    ) -> Result<Box<dyn Connecting>> {
        let pd = pd
            .as_any()
            .downcast_ref::<UserPd>()
            .ok_or(Error::Mismatch)?;
        let qp = pd.create_qp(&req)?;
        Ok(Box::new(UserConnecting {
            ops: qp.clone(),
            qp,
            how: How::Accept(self.0, mpa(&req)),
        }))
    }

    fn reject(self: Box<Self>, private_data: &[u8]) -> Result<()> {
        Ok(self.0.reject(private_data)?)
    }
}
