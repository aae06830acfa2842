//! Completion queues and typed completions.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::warn;

use crate::device::{Context, ContextBackend};
use crate::error::Result;
use crate::ibv;
use crate::qp::QpInner;

pub use provider::wr::WcStatus;

/// What a completion reports, by operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionKind {
    /// A Send went out.
    Send,
    /// An RDMA Write completed (also Write with Immediate).
    Write,
    /// An RDMA Read completed; its bytes are in the local slices.
    Read,
    /// Immediate Data went out.
    Imm,
    /// FetchAdd (plain or masked) and the value before it.
    FetchAdd {
        /// The target's original value.
        original: u64,
    },
    /// CmpSwap (plain or masked), the original value and whether it swapped.
    CmpSwap {
        /// The target's original value.
        original: u64,
        /// The compare matched and the swap was written.
        swapped: bool,
    },
    /// Swap and the value it replaced.
    Swap {
        /// The target's original value.
        original: u64,
    },
    /// A Commit completed: the responder made the range durable.
    Commit,
    /// An Atomic Write completed: the value is in place.
    AtomicWrite,
    /// A message arrived in a posted receive.
    Recv {
        /// Bytes placed.
        len: u32,
        /// The 8-byte Immediate Data, for Immediate Data and Write with
        /// Immediate (RFC 7306 §6; both look alike at the receiver).
        imm: Option<u64>,
        /// The STag the peer's Send with Invalidate invalidated.
        invalidated: Option<u32>,
        /// The sender asked for a solicited event.
        solicited: bool,
    },
}

/// A typed work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// Outcome; when not `Success`, `kind` still says which operation failed.
    pub status: WcStatus,
    /// The QP.
    pub qp_num: u32,
    /// What completed, with its results.
    pub kind: CompletionKind,
    /// Device detail: a failed Commit's status, or the Terminate cause.
    pub vendor_err: u32,
}

impl Completion {
    /// `status == Success`.
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }
}

/// A completion as a backend reports it, before the QP gives it meaning.
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

impl From<&provider::wr::WorkCompletion> for RawCompletion {
    fn from(wc: &provider::wr::WorkCompletion) -> Self {
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
}

impl From<&ibv::WorkCompletion> for RawCompletion {
    fn from(wc: &ibv::WorkCompletion) -> Self {
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
}

/// A completion queue, shared by any number of QPs of one device.
#[derive(Debug, Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

#[derive(Debug)]
pub(crate) struct CqInner {
    ctx: Context,
    pub(crate) backend: CqBackend,
    qps: Mutex<HashMap<u32, Weak<QpInner>>>,
    /// Completions given meaning but not yet handed out (a raw batch can
    /// hold more than the caller asked for).
    ready: Mutex<VecDeque<Completion>>,
    /// Held while completions are taken from the device and given their
    /// meaning, so that concurrent pollers keep the device's order (the
    /// mailbox numbers a QP's zero-length receives in that order).
    taking: Mutex<()>,
    /// Readable after an emulation thread queued a completion (the device
    /// knows nothing of those).
    ready_fd: EventFd,
    /// Readable when `ready_fd` or the device's notification fd is: what
    /// [`CompletionQueue::as_fd`] hands to an event loop.
    epoll: Epoll,
}

#[derive(Debug)]
pub(crate) enum CqBackend {
    User(Arc<provider::cq::CompletionQueue>),
    Ibv(Arc<ibv::CompletionQueue>),
}

/// Raw completions taken from the backend per round.
const BATCH: usize = 32;

impl CompletionQueue {
    pub(crate) fn new(ctx: &Context, depth: u32) -> Result<CompletionQueue> {
        let backend = match ctx.backend() {
            ContextBackend::User(_) => {
                CqBackend::User(provider::cq::CompletionQueue::new(depth as usize)?)
            }
            ContextBackend::Ibv(ictx) => {
                let channel = ictx.create_comp_channel()?;
                CqBackend::Ibv(ictx.create_cq(depth, Some(&channel), 0)?)
            }
        };
        let ready_fd =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(std::io::Error::from)?;
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(std::io::Error::from)?;
        let watch = |fd: BorrowedFd<'_>| {
            epoll
                .add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 0))
                .map_err(std::io::Error::from)
        };
        watch(ready_fd.as_fd())?;
        match &backend {
            CqBackend::User(cq) => watch(cq.as_fd())?,
            CqBackend::Ibv(cq) => {
                if let Some(ch) = cq.channel() {
                    // Events are taken only when there are some (readable),
                    // and `req_notify` drains them without blocking.
                    ch.set_nonblocking(true)?;
                    watch(ch.as_fd())?;
                }
            }
        }
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                ctx: ctx.clone(),
                backend,
                qps: Mutex::new(HashMap::new()),
                ready: Mutex::new(VecDeque::new()),
                taking: Mutex::new(()),
                ready_fd,
                epoll,
            }),
        })
    }

    /// Arm the completion notification of [`as_fd`](AsFd::as_fd)
    /// (`ibv_req_notify_cq`, after taking the events that woke the caller,
    /// as `ibv_get_cq_event` + `ibv_ack_cq_events` do). Returns whether
    /// completions are already waiting: then poll instead of sleeping. The
    /// event-loop pattern is
    ///
    /// ```text
    /// loop {
    ///     while cq.poll(&mut out, 16)? > 0 { /* handle out */ }
    ///     if !cq.req_notify()? { /* sleep until cq.as_fd() is readable */ }
    /// }
    /// ```
    ///
    /// Completions the emulation layer makes on its own threads (agent
    /// answers) make the fd readable too.
    pub fn req_notify(&self) -> Result<bool> {
        let _ = self.inner.ready_fd.read();
        match &self.inner.backend {
            CqBackend::User(cq) => {
                cq.ack_events();
                cq.req_notify(false);
                if !cq.is_empty() {
                    return Ok(true);
                }
            }
            CqBackend::Ibv(cq) => {
                if let Some(ch) = cq.channel() {
                    while ch.get_event().is_ok() {}
                }
                cq.req_notify(false)?;
                // A completion that arrived before arming raised no event.
                self.drive()?;
            }
        }
        Ok(!self
            .inner
            .ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty())
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    pub(crate) fn attach(&self, qp_num: u32, qp: Weak<QpInner>) {
        let mut qps = self.inner.qps.lock().unwrap_or_else(|p| p.into_inner());
        qps.retain(|_, w| w.strong_count() > 0);
        qps.insert(qp_num, qp);
    }

    /// Take raw completions from the backend (driving the userspace
    /// provider's QPs from this thread when none is waiting).
    fn poll_raw(&self, out: &mut Vec<RawCompletion>) -> Result<()> {
        match &self.inner.backend {
            CqBackend::User(cq) => {
                let mut buf = [provider::wr::WorkCompletion::BLANK; BATCH];
                let n = cq.poll(&mut buf);
                out.extend(buf[..n].iter().map(RawCompletion::from));
            }
            CqBackend::Ibv(cq) => {
                while out.len() < BATCH {
                    match cq.poll_one()? {
                        Some(wc) => out.push(RawCompletion::from(&wc)),
                        None => break,
                    }
                }
            }
        }
        Ok(())
    }

    /// Turn raw completions into the application's, running emulation
    /// steps on the way (they may post follow-up work and yield nothing),
    /// onto the ready queue.
    fn process(&self, raw: Vec<RawCompletion>) {
        for rc in raw {
            let qp = {
                let qps = self.inner.qps.lock().unwrap_or_else(|p| p.into_inner());
                qps.get(&rc.qp_num).and_then(Weak::upgrade)
            };
            match qp {
                Some(qp) => {
                    if let Some(c) = qp.complete(rc) {
                        self.inner
                            .ready
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push_back(c);
                    }
                }
                None => warn!(qp = rc.qp_num, "completion for an unknown QP dropped"),
            }
        }
    }

    /// One round of taking raw completions and giving them their meaning;
    /// the application's stay queued for its next poll.
    pub(crate) fn drive(&self) -> Result<()> {
        let _taking = self.inner.taking.lock().unwrap_or_else(|p| p.into_inner());
        self.take_raw()?;
        Ok(())
    }

    /// Take a batch from the device and give it meaning (onto the ready
    /// queue); whether there was any. Only under `taking`.
    fn take_raw(&self) -> Result<bool> {
        let mut raw = Vec::new();
        self.poll_raw(&mut raw)?;
        let any = !raw.is_empty();
        self.process(raw);
        Ok(any)
    }

    /// Queue a completion produced outside a poll (by the agent thread).
    pub(crate) fn push_ready(&self, c: Completion) {
        self.inner
            .ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(c);
        let _ = self.inner.ready_fd.write(1);
        // A thread blocked in `wait` on the provider must look at it.
        if let CqBackend::User(cq) = &self.inner.backend {
            cq.interrupt_wait();
        }
    }

    /// Move up to `max` ready completions to `out`.
    fn take_ready(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut ready = self.inner.ready.lock().unwrap_or_else(|p| p.into_inner());
        let n = max.min(ready.len());
        out.extend(ready.drain(..n));
        n
    }

    /// `ibv_poll_cq`: append up to `max` completions to `out`; returns how
    /// many. Never blocks; on the userspace provider the calling thread
    /// also makes progress on this CQ's QPs.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut n = self.take_ready(out, max);
        // Emulated operations may consume several raw completions before
        // one surfaces; a few rounds keep a busy poller's latency low
        // without looping unboundedly.
        for _ in 0..4 {
            if n >= max {
                break;
            }
            // Another poller is taking a batch: what it finds lands on the
            // ready queue, in order; never wait for it here.
            let Ok(_taking) = self.inner.taking.try_lock() else {
                break;
            };
            if !self.take_raw()? {
                break;
            }
            n += self.take_ready(out, max - n);
        }
        Ok(n)
    }

    /// Poll until one completion arrives or `timeout` passes, busy-polling.
    pub fn poll_one(&self, timeout: Duration) -> Result<Option<Completion>> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(1);
        loop {
            if self.poll(&mut out, 1)? > 0 {
                return Ok(out.into_iter().next());
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::hint::spin_loop();
        }
    }

    /// Block (without spinning) until completions arrive or `timeout`
    /// passes; then poll like [`poll`](Self::poll).
    pub fn wait(&self, out: &mut Vec<Completion>, max: usize, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.poll(out, max)?;
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(0);
            }
            match &self.inner.backend {
                // The provider's wait also returns when the emulation layer
                // queues a completion (`push_ready` interrupts it).
                CqBackend::User(cq) => {
                    // Sleep until the provider has some; `poll` takes them
                    // (under `taking`, in order).
                    cq.wait_ready(left);
                }
                // The completion channel and the emulation layer's eventfd
                // together, through the epoll fd.
                CqBackend::Ibv(_) => {
                    if !self.req_notify()? {
                        wait_readable(self.as_fd(), left)?;
                    }
                }
            }
        }
    }
}

impl AsFd for CompletionQueue {
    /// Readable when completions may be waiting, once armed with
    /// [`CompletionQueue::req_notify`] (an epoll fd over the device's
    /// notification fd and the emulation layer's): for `poll(2)`, epoll or
    /// an async runtime's fd readiness.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.epoll.0.as_fd()
    }
}

/// poll(2) one fd for readability.
fn wait_readable(fd: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    let ms = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    match poll(&mut fds, ms) {
        Ok(n) => Ok(n > 0),
        Err(nix::errno::Errno::EINTR) => Ok(false),
        Err(e) => Err(std::io::Error::from(e).into()),
    }
}
