//! Queue pairs: posting work and polling what it did.
//!
//! Every posted WR is an entry of the QP's tracker until its completion is
//! taken: the entry holds the slices it names (and so their regions), so
//! safe code can never unmap memory the device may still touch. The
//! emulation core (the crate's `emulation` module) routes each WR natively or to a
//! strategy, and its completions come out in posting order.

use std::sync::Arc;
use std::time::Duration;

use provider::wr::{Remote, WcStatus};

use crate::caps::{Capabilities, OpKind, OpSet, PostPath};
use crate::device::Context;
use crate::emulation::QpCore;
use crate::error::{Error, Result};
use crate::mr::Slice;

pub use crate::wr::{EmulationCounters, PeerAtomics, WorkRequest, MAX_INLINE};

/// Which row of the capability matrix an operation falls in
/// (`OpKind::from(op)`).
pub fn op_kind(op: &provider::wr::SendOp) -> OpKind {
    OpKind::from(op)
}

/// Limits of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per WR.
    pub max_sge: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_sge: 4,
        }
    }
}

/// An RC queue pair.
#[derive(Debug, Clone)]
pub struct QueuePair {
    pub(crate) core: Arc<QpCore>,
}

/// A post list stopped at a work request that failed.
#[derive(Debug, thiserror::Error)]
#[error("work request {posted} of the list failed: {source}")]
pub struct PostListError {
    /// Work requests of the list that were posted (they complete as usual).
    pub posted: usize,
    /// Why the next one failed.
    #[source]
    pub source: Error,
}

impl QueuePair {
    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.core.qp_num()
    }

    /// What this connection runs natively, emulated or not at all: the
    /// device's matrix resolved against the peer's device (a stag peer
    /// says in its connection header what its device executes).
    pub fn capabilities(&self) -> &Capabilities {
        self.core.caps()
    }

    /// What the peer's device executes natively, from its stag header;
    /// `None` when the peer runs no stag (then see
    /// [`QueuePair::probe_atomics`]).
    pub fn peer_native(&self) -> Option<OpSet> {
        self.core.peer_native()
    }

    /// Whether the peer executes RFC 7306 atomics. A stag peer said so in
    /// its connection header, and nothing is sent. Otherwise this is
    /// RFC 7306 §1.1's probe: a FetchAdd of 0 at `target` (8 aligned bytes
    /// the peer advertised; their value does not change), answered by a
    /// completion or refused by the peer — which, on iWARP as on IB, takes
    /// the connection down ([`PeerAtomics::Refused`]). Other completions
    /// that arrive meanwhile stay queued for the application.
    pub fn probe_atomics(&self, target: Remote, timeout: Duration) -> Result<PeerAtomics> {
        if let Some(native) = self.peer_native() {
            return Ok(if native.contains(OpKind::FetchAdd) {
                PeerAtomics::Native
            } else {
                PeerAtomics::Agent
            });
        }
        let ctx = self.core.context();
        if !ctx.native_ops().contains(OpKind::FetchAdd) {
            return Err(Error::Unsupported {
                op: OpKind::FetchAdd,
                device: ctx.name().to_owned(),
                why: "the device cannot send atomics, and the peer runs no stag agent to \
                      run them for it"
                    .into(),
            });
        }
        if !target.addr.is_multiple_of(8) {
            return Err(Error::InvalidRequest("an atomic target is 8-byte aligned"));
        }
        let (status, vendor_err) = self.core.probe(target, timeout)?;
        Ok(if status == WcStatus::Success {
            PeerAtomics::Native
        } else {
            PeerAtomics::Refused { status, vendor_err }
        })
    }

    /// What the emulation layer has done on this connection so far.
    pub fn emulation_counters(&self) -> EmulationCounters {
        self.core.counters()
    }

    /// How this QP posts: the userspace provider's queue, the extended
    /// `ibv_wr_*` API or `ibv_post_send`.
    pub fn post_path(&self) -> PostPath {
        self.core.post_path()
    }

    /// `ibv_post_send`, natively or through the emulation layer as the
    /// capability matrix says; an operation the device cannot do at all
    /// fails here with [`Error::Unsupported`], a full send queue with
    /// [`Error::QueueFull`].
    pub fn post_send(&self, wr: WorkRequest<'_>) -> Result<()> {
        self.core
            .post_list(std::slice::from_ref(&wr))
            .map_err(|(e, _)| e)
    }

    /// `ibv_post_send` with a list: posts `wrs` in order with one doorbell
    /// — one `ibv_wr_start`/`ibv_wr_complete` batch on a libibverbs device,
    /// one write to the socket on the userspace provider. An emulated WR
    /// in the list runs on its own path in its place. Stops at the first
    /// WR that fails: those before it are posted and complete as usual, it
    /// and the rest are not ([`PostListError::posted`] says how many were).
    pub fn post_send_list(
        &self,
        wrs: &[WorkRequest<'_>],
    ) -> std::result::Result<(), PostListError> {
        self.core
            .post_list(wrs)
            .map_err(|(source, posted)| PostListError { posted, source })
    }

    /// `ibv_post_recv`.
    pub fn post_recv(&self, wr_id: u64, local: &[Slice]) -> Result<()> {
        self.core.post_recv(wr_id, local)
    }

    /// Move to Error: every outstanding WR completes with a flush error.
    pub fn set_error(&self) -> Result<()> {
        self.core.set_error()
    }

    /// Drive the QP from this thread (userspace provider; a no-op on
    /// libibverbs devices, where the hardware or kernel makes progress).
    pub fn progress(&self) {
        self.core.progress();
    }

    /// The socket an event loop may sleep on itself, not through the
    /// engine (stag's userspace provider; `None` elsewhere or while the
    /// engine must watch it), with whether writability is wanted too.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn socket_wait_fd(&self) -> Option<(std::os::fd::BorrowedFd<'_>, bool)> {
        self.core.socket_wait_fd()
    }

    /// An event loop starts (`true`) or stops sleeping on
    /// [`socket_wait_fd`](Self::socket_wait_fd): paired, one stop per start.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn socket_wait(&self, on: bool) {
        self.core.socket_wait(on);
    }

    /// WRs posted and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.core.outstanding()
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        self.core.context()
    }
}
