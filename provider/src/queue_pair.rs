//! The application's handle on a QP: a [`QueuePair`] is to the QP's
//! driver (`driver.rs`, which owns the socket and the sans-IO
//! [`Connection`](crate::qp::Connection)) what quinn's `Connection` is to
//! quinn-proto's: every method delegates, and none holds protocol state.
//! Connecting one is [`crate::establish`]'s.

use std::sync::Arc;

use crate::assist::Assist;
use crate::driver::QpShared;
use crate::engine::Engine;
use crate::error::DeviceError;
use crate::qp::{Event, QpState};
use crate::setup::Negotiated;
use crate::wr::{InlineWr, ListWr, RecvWr, SendWr, SendWrRef, Sge};

/// An RC queue pair.
#[derive(Debug)]
pub struct QueuePair {
    shared: Arc<QpShared>,
    /// Keeps the device's engine alive while the QP is.
    _engine: Arc<Engine>,
    /// Its receive assist, which counts the post lists started.
    assist: Arc<Assist>,
}

impl QueuePair {
    /// The handle on a QP `ProtectionDomain::create_qp` made.
    pub(crate) fn new(
        shared: Arc<QpShared>,
        engine: Arc<Engine>,
        assist: Arc<Assist>,
    ) -> QueuePair {
        QueuePair {
            shared,
            _engine: engine,
            assist,
        }
    }

    /// The driver under the handle, for connection setup.
    pub(crate) fn shared(&self) -> &Arc<QpShared> {
        &self.shared
    }

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
        self.assist.posted();
        PostGuard {
            qp: &self.shared,
            pushed: false,
        }
    }

    /// A whole post list, queued and written under one lock of the QP:
    /// what [`start_post`](Self::start_post), [`PostGuard::push_list`] and
    /// [`PostGuard::post`] do, for a caller that has the list in hand
    /// (the guard takes the lock once to queue and once more to ring, so
    /// that a program may run between its pushes). On a refused WR, its
    /// error and how many went before it, which still leave.
    pub fn post_list<'w>(
        &self,
        wrs: impl IntoIterator<Item = ListWr<'w>>,
    ) -> Result<(), (DeviceError, usize)> {
        self.assist.posted();
        self.shared.post_list(wrs)
    }

    /// `ibv_post_send` of one WR: [`start_post`](Self::start_post),
    /// [`push`](PostGuard::push), [`post`](PostGuard::post).
    pub fn post_send(&self, wr: impl AsSendWr) -> Result<(), DeviceError> {
        let mut post = self.start_post();
        post.push(wr)?;
        post.post();
        Ok(())
    }

    /// The doorbell alone: write what [`PostGuard::hold`] left queued.
    pub fn ring(&self) {
        self.shared.ring();
    }

    /// `ibv_post_recv`. Allowed before the connection exists.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), DeviceError> {
        self.shared.post_recv(wr)
    }

    /// `ibv_post_recv` of a borrowed SGE list: the QP copies it into a
    /// list recycled from a completed receive, so that reposting the
    /// receive a message took allocates nothing.
    pub fn post_recv_ref(&self, wr_id: u64, sg_list: &[Sge]) -> Result<(), DeviceError> {
        self.shared.post_recv_ref(wr_id, sg_list)
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

    /// The QP's socket, for an event loop that sleeps on it in its own
    /// poller (an async runtime's reactor) as [`CompletionQueue::wait`]
    /// does in `poll(2)`, and whether writability is wanted as well;
    /// `None` while the engine must watch it (before the connection, after
    /// close, while input is paused).
    ///
    /// [`CompletionQueue::wait`]: crate::cq::CompletionQueue::wait
    pub fn socket_wait_fd(&self) -> Option<(std::os::fd::BorrowedFd<'_>, bool)> {
        crate::cq::CqQp::wait_fd(&*self.shared, true)
    }

    /// An event loop goes to sleep on [`socket_wait_fd`](Self::socket_wait_fd):
    /// the engine stops watching the socket, so an arrival wakes the loop
    /// alone, which then drives the QP. Pair each with
    /// [`end_socket_wait`](Self::end_socket_wait).
    pub fn begin_socket_wait(&self) {
        crate::cq::CqQp::set_waiting(&*self.shared, true);
    }

    /// The event loop woke: it keeps the socket for its next sleep, and
    /// the engine takes the QP back at its next recheck (1 ms) unless the
    /// loop sleeps on it again (`Engine::hold`, as a
    /// completion channel's waiter).
    pub fn end_socket_wait(&self) {
        crate::cq::CqQp::end_wait_holding(&*self.shared);
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

    /// Queue a list of WRs, framed or inline, under one lock of the QP
    /// (pushing them one by one takes it for each). On a refused WR, its
    /// error and how many were queued before it, which stay queued.
    pub fn push_list<'w>(
        &mut self,
        wrs: impl IntoIterator<Item = ListWr<'w>>,
    ) -> Result<(), (DeviceError, usize)> {
        let res = self.qp.queue_list(wrs);
        if crate::driver::queued_any(&res) {
            self.pushed = true;
        }
        res
    }

    /// Queue one inline WR (`IBV_SEND_INLINE`): its payload is copied
    /// into the QP now, so `wr.data` may be reused as soon as this
    /// returns. Allocates nothing in steady state.
    pub fn push_inline(&mut self, wr: InlineWr<'_>) -> Result<(), DeviceError> {
        self.qp.queue_inline(wr)?;
        self.pushed = true;
        Ok(())
    }

    /// Ring the doorbell: write what was pushed, from the calling thread.
    pub fn post(mut self) {
        self.ring();
    }

    /// End the guard without ringing: what was pushed stays queued for
    /// the next [`QueuePair::ring`] (or any drive of the QP, whichever
    /// comes first). For a caller that posts one list in several guards
    /// and rings once at its end.
    pub fn hold(mut self) {
        self.pushed = false;
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
