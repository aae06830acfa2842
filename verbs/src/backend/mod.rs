//! The devices behind the safe API: one set of traits, implemented once by
//! stag's userspace provider ([`user`]) and once by libibverbs/librdmacm
//! ([`ibverbs`]).
//!
//! The public types hold trait objects and never learn which device runs
//! them; a backend never sees an application's wr_id, only the tokens of
//! the tracker ([`crate::tracker`]). Posting
//! takes [`SendPost`]/[`RecvPost`], which only the tracker makes, for
//! memory the tracker holds until the completion: that is what makes a
//! backend's `post` safe to call from safe code.

pub(crate) mod ibverbs;
pub(crate) mod user;

use std::any::Any;
use std::fmt::Debug;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use provider::mem::Access;
use provider::region::Region;
use provider::setup::RtrModes;
use provider::wr::WcStatus;
use serde::Serialize;

use crate::caps::Capabilities;
use crate::error::Result;
use crate::mr::MrOps;
pub(crate) use crate::tracker::{RecvPost, SendPost};
pub use provider::engine::Progress;

/// The name of the userspace provider's device.
pub const USERSPACE_DEVICE: &str = "stag0";

/// Which implementation runs a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// stag's userspace iWARP provider over TCP.
    Userspace,
    /// A libibverbs device (physical RNIC, rxe, siw, …).
    Ibverbs,
}

/// A device as listed by [`crate::devices`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// Name to open it by.
    pub name: String,
    /// Who runs it.
    pub backend: Backend,
    /// Transport as the device reports it.
    pub transport: String,
}

/// Options for opening a device.
#[derive(Debug, Clone, Default)]
pub struct ContextOptions {
    /// Run these operations through the emulation layer even where the
    /// device has them natively (for tests and cost measurements).
    pub force_emulation: Vec<crate::OpKind>,
    /// Post with `ibv_post_send` even where the provider has the extended
    /// `ibv_wr_*` API (to compare the two paths).
    pub legacy_post: bool,
    /// Userspace provider only: run as an RFC 5040 RNIC, as kernel siw
    /// does — no Atomics, Immediate Data or Commit on the wire (they are
    /// emulated as on siw, and peers' requests for them are refused with a
    /// Terminate). Lets one machine test what a siw peer means.
    pub rfc5040_only: bool,
    /// Userspace provider only: how its progress engine waits for input
    /// (`None`: `$STAG_PROGRESS`, else adaptive). See [`Progress`].
    pub progress: Option<Progress>,
}

/// A completion as a backend reports it, before the emulation layer gives
/// it meaning.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawCompletion {
    pub token: u64,
    pub status: WcStatus,
    pub byte_len: u32,
    pub imm: Option<u64>,
    pub qp_num: u32,
    pub vendor_err: u32,
    pub solicited: bool,
    pub invalidated: Option<u32>,
}

/// What opening a device gives: its context and what it can do.
pub(crate) struct Opened {
    pub context: Arc<dyn ContextOps>,
    pub caps: Capabilities,
}

/// Open `name` on whichever backend runs it.
pub(crate) fn open(name: &str, options: &ContextOptions) -> Result<Opened> {
    if name == USERSPACE_DEVICE {
        user::open(name, options)
    } else {
        ibverbs::open(name, options)
    }
}

/// Every device the backends know: libibverbs' first, then the userspace
/// provider's.
pub(crate) fn devices() -> Vec<DeviceInfo> {
    let mut out = ibverbs::devices();
    out.push(user::device_info());
    out
}

/// `struct ibv_context`.
pub(crate) trait ContextOps: Send + Sync + Debug {
    fn kind(&self) -> Backend;
    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>>;
    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CqOps>>;
    fn listen(&self, addr: SocketAddr) -> Result<Box<dyn ListenerOps>>;
}

/// `struct ibv_pd`, and what is made on one.
pub(crate) trait PdOps: Send + Sync + Debug {
    fn as_any(&self) -> &dyn Any;
    /// Register `region`, which the registration owns from now on: it is
    /// unmapped only after the device let go of it.
    fn register(&self, region: Region, access: Access) -> Result<Box<dyn MrOps>>;
    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Arc<dyn SrqOps>>;
    /// An RC QP for a connection to `addr` (created, not yet connected).
    fn connector(&self, qp: QpRequest<'_>, addr: SocketAddr) -> Result<Box<dyn Connecting>>;
}

/// What a QP is created and connected with.
pub(crate) struct QpRequest<'a> {
    pub send_cq: &'a Arc<dyn CqOps>,
    pub recv_cq: &'a Arc<dyn CqOps>,
    pub srq: Option<&'a Arc<dyn SrqOps>>,
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_sge: u32,
    /// Inbound Read/atomic/Commit requests accepted at once (IRD).
    pub responder_resources: u8,
    /// Outbound ones kept outstanding (ORD).
    pub initiator_depth: u8,
    /// Userspace provider: MPA CRC, peer-to-peer RTR models.
    pub crc: bool,
    pub peer_to_peer: Option<RtrModes>,
    /// The private data to send (stag's header and the application's).
    pub private_data: Vec<u8>,
}

/// `struct ibv_cq`.
pub(crate) trait CqOps: Send + Sync + Debug {
    fn as_any(&self) -> &dyn Any;
    /// Append up to `max` completions (the userspace provider also makes
    /// progress on its QPs from this thread).
    fn poll(&self, out: &mut Vec<RawCompletion>, max: usize) -> Result<()>;
    /// Append up to `max` completions already queued, driving no QP (no
    /// socket read): for an event loop that sleeps on the QP's socket
    /// itself and knows it has no input. Devices whose poll drives
    /// nothing poll as usual.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    fn poll_queued(&self, out: &mut Vec<RawCompletion>, max: usize) -> Result<()> {
        self.poll(out, max)
    }
    /// Whether completions may be queued already (a look without
    /// driving anything); devices that cannot tell say true.
    fn has_queued(&self) -> bool {
        true
    }
    /// Arm the notification; whether completions are already waiting.
    fn req_notify(&self) -> Result<bool>;
    /// The fd that becomes readable on a notification.
    fn notify_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>>;
    /// Sleep until completions may be waiting, [`CqOps::interrupt`] or
    /// `timeout` (after [`CqOps::req_notify`] and a poll that found
    /// nothing).
    fn wait(&self, timeout: Duration) -> Result<()>;
    /// Wake a thread in [`CqOps::wait`] (a completion was queued above the
    /// backend).
    fn interrupt(&self);
}

/// An RC queue pair.
pub(crate) trait QpOps: Send + Sync + Debug {
    fn qp_num(&self) -> u32;
    /// Post `wrs` as one batch (one doorbell, one `ibv_wr_start` batch).
    /// On failure, how many were posted and why the next one was not.
    fn post_send(&self, wrs: &[SendPost<'_>]) -> std::result::Result<(), (crate::Error, usize)>;
    /// [`post_send`](Self::post_send) of a batch that a longer list
    /// continues: a device whose doorbell is a socket write may hold the
    /// WRs for the [`ring`](Self::ring) that ends the list.
    fn post_send_held(
        &self,
        wrs: &[SendPost<'_>],
    ) -> std::result::Result<(), (crate::Error, usize)> {
        self.post_send(wrs)
    }
    /// Ring for the WRs [`post_send_held`](Self::post_send_held) held.
    fn ring(&self) {}
    fn post_recv(&self, wr: &RecvPost<'_>) -> Result<()>;
    /// Go to Error: outstanding work completes with flush errors.
    fn set_error(&self) -> Result<()>;
    /// Drive the QP from this thread (userspace provider).
    fn progress(&self) {}
    fn post_path(&self) -> crate::caps::PostPath;
    /// The socket an event loop may sleep on instead of the engine
    /// (userspace provider), with whether writability is wanted too.
    fn socket_wait_fd(&self) -> Option<(std::os::fd::BorrowedFd<'_>, bool)> {
        None
    }
    /// An event loop starts (`true`) or stops sleeping on that socket.
    fn socket_wait(&self, _on: bool) {}
    /// Whether `post_send` copies an inline payload ([`SendPost::inline`])
    /// into the QP itself; otherwise the emulation layer posts it from a
    /// registered bounce slot.
    fn copies_inline(&self) -> bool {
        false
    }
}

/// A shared receive queue.
pub(crate) trait SrqOps: Send + Sync + Debug {
    fn as_any(&self) -> &dyn Any;
    fn post_recv(&self, wr: &RecvPost<'_>) -> Result<()>;
    /// Receives posted and not consumed, if the device knows.
    fn len(&self) -> Option<usize>;
}

/// A QP created for a connection, not yet connected: the application posts
/// its first receives on [`Connecting::qp`] before [`Connecting::finish`].
pub(crate) trait Connecting: Send {
    fn qp(&self) -> &Arc<dyn QpOps>;
    /// Connect; the peer's private data.
    fn finish(self: Box<Self>) -> Result<(Arc<dyn QpOps>, Vec<u8>)>;
}

/// A passive endpoint.
pub(crate) trait ListenerOps: Send + Sync + Debug {
    fn local_addr(&self) -> Result<SocketAddr>;
    /// The next connection request (blocking).
    fn next(&self) -> Result<Box<dyn IncomingOps>>;
}

/// A connection request.
pub(crate) trait IncomingOps: Send + Debug {
    fn private_data(&self) -> &[u8];
    /// A QP to accept onto, with the reply's private data.
    fn acceptor(self: Box<Self>, pd: &dyn PdOps, qp: QpRequest<'_>) -> Result<Box<dyn Connecting>>;
    fn reject(self: Box<Self>, private_data: &[u8]) -> Result<()>;
}
