//! The async API over tokio (feature `tokio`): completion queues on
//! tokio's reactor, every operation as a future, async connection setup,
//! and [`RdmaStream`], a byte stream over one RC QP.
//!
//! ```no_run
//! # async fn demo(ctx: verbs::Context, addr: std::net::SocketAddr) -> Result<(), Box<dyn std::error::Error>> {
//! use verbs::r#async::{connect, AsyncCompletionQueue};
//! let pd = ctx.alloc_pd()?;
//! let cq = AsyncCompletionQueue::new(ctx.create_cq(256)?)?;
//! let mr = pd.alloc_mr(4096, verbs::Access::LOCAL_WRITE)?;
//! let (qp, _) = connect(&pd, &cq, addr, &Default::default()).await?;
//! mr.write_at(0, b"hello")?;
//! qp.send(&[mr.slice(0, 5)?]).await?;
//! # Ok(()) }
//! ```
//!
//! # Posting and ordering
//!
//! An operation of [`AsyncQueuePair`] posts its work request when it is
//! called, not when its [`Op`] is first polled: the calls' order is the
//! posting order, and completions keep RC order (the send queue's
//! completions come in posting order, emulated or native). Any number of
//! `Op`s may be in flight on one QP, up to its send queue depth (beyond
//! it, the `Op` resolves to [`crate::Error::QueueFull`]).
//!
//! # Cancellation
//!
//! Work once posted cannot be taken back from an RDMA device, so dropping
//! an `Op` cancels nothing:
//!
//! - the work request still runs, and its effect on the peer (bytes
//!   written, an atomic applied, a message delivered) happens as if the
//!   future had been awaited; its completion is discarded on arrival;
//! - the slices it names stay alive, held by the QP's tracker (a clone of
//!   each `Slice` handle, and so of its region) until that completion is
//!   taken: a region can be dropped, or deregistered only after that
//!   (`MemoryRegion::deregister` gives it back when no work holds it), so
//!   no memory the device may still touch is freed or reused;
//! - a dropped receive `Op` leaves its receive posted: the next message
//!   lands in it and is thrown away with its completion (withdraw receives
//!   by moving the QP to error, `qp().set_error()`, which flushes them);
//! - [`connect`] and [`AsyncListener::accept`] run the blocking setup on
//!   a thread of their own: dropping their future abandons the connection
//!   they make (it is closed when made), and a runtime can shut down while
//!   an accept still waits for a peer.
//!
//! # Errors and disconnects
//!
//! An `Op` resolves to `Ok(Completion)` on success, to
//! [`OpError::Failed`] with the completion when the work completed with
//! an error, and to [`OpError::Verbs`] when it could not be posted. When
//! the connection fails (the peer disconnects or dies), the QP goes to
//! Error and every outstanding work request completes with a flush error:
//! every `Op` in flight resolves to `OpError::Failed`, none waits forever.
//! Once a QP's CQ has handed out an error completion for it, its later
//! operations fail at once with [`OpError::QpFailed`] instead of being
//! posted (kernel siw never completes work posted to a QP in Error).
//!
//! A QP with nothing in flight learns of a lost peer too: stag0 and siw
//! see their TCP connection close, and on IB/RoCE (rxe, RNICs) the
//! libibverbs backend acts on rdma_cm's DISCONNECTED (and the other
//! events that end a connection) by moving the QP to Error. Kernel 6.1's
//! rxe did not deliver that DISCONNECTED within 30 s in our VM (6.12
//! does at once): there an idle QP hears of the gone peer only from the
//! transport retries of the next work it sends.

mod cq;
#[cfg(feature = "grpc")]
pub mod grpc;
mod qp;
mod stream;

use std::net::SocketAddr;
use std::sync::Arc;

pub use cq::{slow_yields, spent_budget_waits, AsyncCompletionQueue, Op};
pub use qp::AsyncQueuePair;
pub use stream::{RdmaStream, RecvSlot, SendSlot, StreamOptions};

use crate::cm::{ConnectOptions, Listener};
use crate::cq::Completion;
use crate::device::Context;
use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;
use crate::qp::QueuePair;

/// Why an [`Op`] did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// The work request was not posted, or the CQ failed.
    #[error(transparent)]
    Verbs(#[from] Error),
    /// The work request completed with an error status (a flushed one when
    /// the connection went down).
    #[error("work request {} failed: {}", .0.wr_id, .0.status.as_str())]
    Failed(Completion),
    /// Not posted: the QP already completed work with this error status,
    /// so it is in Error (the connection failed).
    #[error("QP {qp_num} is in error after a completion with {}", .status.as_str())]
    QpFailed {
        /// The QP.
        qp_num: u32,
        /// The first error status it completed work with.
        status: crate::cq::WcStatus,
    },
    /// The `Op` was polled again after it resolved.
    #[error("the operation's future was polled after it finished")]
    Finished,
}

impl From<OpError> for std::io::Error {
    fn from(e: OpError) -> std::io::Error {
        match e {
            OpError::Verbs(Error::Io(e)) => e,
            OpError::Failed(c) if c.status == crate::cq::WcStatus::WrFlushErr => {
                std::io::Error::new(std::io::ErrorKind::ConnectionReset, OpError::Failed(c))
            }
            e => std::io::Error::other(e),
        }
    }
}

/// Run blocking connection setup on a thread of its own, not on tokio's
/// blocking pool: an accept waits for a peer for as long as it takes, and
/// a runtime shutting down waits for its pool's tasks, so an accept still
/// pending there (a server's next connection) would keep the runtime's
/// drop from returning. A thread of its own is left to finish alone.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("stag-async-setup".into())
        .spawn(move || {
            let _ = tx.send(f());
        })?;
    rx.await
        .map_err(|_| Error::Connect("the connection thread failed".into()))?
}

/// [`crate::connect`] as a future: connect to the listener at `addr`,
/// completions on `cq`; the QP and the peer's private data.
pub async fn connect(
    pd: &ProtectionDomain,
    cq: &AsyncCompletionQueue,
    addr: SocketAddr,
    opts: &ConnectOptions,
) -> Result<(AsyncQueuePair, Vec<u8>)> {
    connect_with(pd, cq, addr, opts, |_| Ok(())).await
}

/// [`crate::connect_with`] as a future: `pre_post` runs on the QP before
/// the connection exists (to post the receives the peer's first messages
/// need). `opts.recv_cq` must be `None`: receives complete on `cq`.
pub async fn connect_with(
    pd: &ProtectionDomain,
    cq: &AsyncCompletionQueue,
    addr: SocketAddr,
    opts: &ConnectOptions,
    pre_post: impl FnOnce(&QueuePair) -> Result<()> + Send + 'static,
) -> Result<(AsyncQueuePair, Vec<u8>)> {
    if opts.recv_cq.is_some() {
        return Err(Error::InvalidRequest(
            "the async connect takes its receive CQ from AsyncQueuePair",
        ));
    }
    let (pd, raw_cq, opts) = (pd.clone(), cq.cq().clone(), opts.clone());
    let (qp, private) =
        blocking(move || crate::cm::connect_with(&pd, &raw_cq, addr, &opts, pre_post)).await?;
    Ok((AsyncQueuePair::new(qp, cq.clone()), private))
}

/// A [`Listener`] whose accept is a future.
#[derive(Debug, Clone)]
pub struct AsyncListener {
    listener: Arc<Listener>,
}

impl AsyncListener {
    /// Listen on `addr` for the device of `ctx`.
    pub fn bind(ctx: &Context, addr: SocketAddr) -> Result<AsyncListener> {
        Ok(AsyncListener {
            listener: Arc::new(Listener::bind(ctx, addr)?),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accept the next connection: the QP and the initiator's private data.
    pub async fn accept(
        &self,
        pd: &ProtectionDomain,
        cq: &AsyncCompletionQueue,
        opts: &ConnectOptions,
    ) -> Result<(AsyncQueuePair, Vec<u8>)> {
        self.accept_with(pd, cq, opts, |_| Ok(())).await
    }

    /// Accept, running `pre_post` on the QP before the peer learns of the
    /// acceptance. `opts.recv_cq` must be `None`.
    pub async fn accept_with(
        &self,
        pd: &ProtectionDomain,
        cq: &AsyncCompletionQueue,
        opts: &ConnectOptions,
        pre_post: impl FnOnce(&QueuePair) -> Result<()> + Send + 'static,
    ) -> Result<(AsyncQueuePair, Vec<u8>)> {
        if opts.recv_cq.is_some() {
            return Err(Error::InvalidRequest(
                "the async accept takes its receive CQ from AsyncQueuePair",
            ));
        }
        let listener = self.listener.clone();
        let (pd, raw_cq, opts) = (pd.clone(), cq.cq().clone(), opts.clone());
        let (qp, private) = blocking(move || {
            let req = listener.get_request()?;
            let private = req.private_data().to_vec();
            Ok((req.accept_with(&pd, &raw_cq, &opts, pre_post)?, private))
        })
        .await?;
        Ok((AsyncQueuePair::new(qp, cq.clone()), private))
    }
}
