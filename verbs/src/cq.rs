//! Completion queues and typed completions.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::warn;

use provider::qpn_map::QpnMap;

use crate::backend::{CqOps, RawCompletion};
use crate::device::Context;
use crate::error::Result;

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

/// What a completion queue hands raw completions to: the QP (its
/// emulation core) that gives them their meaning. Completions a raw one
/// releases (several, when it unblocks a send queue's order) go to `out`.
pub(crate) trait CompletionSink: Send + Sync {
    /// `run`: consecutive raw completions of this sink's QP, in the
    /// device's order (handed over together so that what each one takes,
    /// the tracker's and the order's locks, is taken once for the run).
    fn complete(&self, run: &[RawCompletion], out: &mut Vec<Completion>);
}

/// A completion queue, shared by any number of QPs of one device.
#[derive(Debug, Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

pub(crate) struct CqInner {
    ctx: Context,
    pub(crate) ops: Arc<dyn CqOps>,
    sinks: Mutex<QpnMap<Weak<dyn CompletionSink>>>,
    /// Bumped (under `sinks`' lock) whenever `sinks` changes: a poll's
    /// cached sink stands while it has not moved.
    sinks_changed: AtomicU64,
    /// Completions given meaning but not yet handed out (a raw batch can
    /// hold more than the caller asked for).
    ready: ReadyQueue,
    /// Held while completions are taken from the device and given their
    /// meaning, so that concurrent pollers keep the device's order (the
    /// mailbox numbers a QP's zero-length receives in that order); holds
    /// the buffers that round uses, so a poll allocates nothing.
    taking: Mutex<Scratch>,
    /// Readable after a completion was queued outside a poll (the device
    /// knows nothing of those).
    ready_fd: EventFd,
    /// Readable when `ready_fd` or the device's notification fd is: what
    /// [`CompletionQueue::as_fd`] hands to an event loop.
    epoll: Epoll,
}

impl std::fmt::Debug for CqInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CqInner")
            .field("ops", &self.ops)
            .finish_non_exhaustive()
    }
}

/// The completions ready for the application, with their count beside
/// them: a poll looks at the count before it takes the lock, so the
/// usual poll, which finds none waiting, takes no lock here (a spinning
/// poller's every empty poll locked and unlocked it, and a poll that
/// found a completion did so three times).
#[derive(Default)]
struct ReadyQueue {
    queue: Mutex<VecDeque<Completion>>,
    /// `queue.len()`, stored under the lock after every change.
    len: AtomicUsize,
}

impl ReadyQueue {
    fn lock(&self) -> ReadyGuard<'_> {
        ReadyGuard {
            queue: self.queue.lock().unwrap_or_else(|p| p.into_inner()),
            len: &self.len,
        }
    }

    /// Whether none is queued. A completion queued while this looks is
    /// seen by the next look, as if this one had come a moment earlier;
    /// one queued before it (on any thread, under the lock) is seen.
    fn is_empty(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0
    }

    /// Hand a poll round's completions (`done`) out behind what is
    /// queued: up to `max` to `out`, the rest onto the queue, all under one
    /// lock (before, `done` went onto the queue under one lock and came off
    /// it under another); how many went to `out`. Only under the CQ's
    /// `taking`, so that a concurrent poll's round cannot come between.
    fn hand_out(&self, done: &mut Vec<Completion>, out: &mut Vec<Completion>, max: usize) -> usize {
        if done.is_empty() && self.is_empty() {
            return 0;
        }
        let mut ready = self.lock();
        if ready.queue.is_empty() {
            // Nothing ahead of them (the usual case): straight out.
            if done.len() <= max {
                let n = done.len();
                out.append(done);
                return n;
            }
            out.extend(done.drain(..max));
            ready.queue.extend(done.drain(..));
            return max;
        }
        if !done.is_empty() {
            ready.queue.extend(done.drain(..));
        }
        ready.move_to(out, max)
    }

    /// Move up to `max` to `out`; how many.
    fn take(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        if max == 0 || self.is_empty() {
            return 0;
        }
        self.lock().move_to(out, max)
    }
}

impl ReadyGuard<'_> {
    /// Move up to `max` from the front to `out`; how many. One alone (a
    /// ping-pong's poll) is popped and pushed: `VecDeque::drain`'s ring
    /// handling cost a Read's completion 26 more instructions (#20); a
    /// batch goes through `drain`, which moves it in one or two copies
    /// where popping each cost a batch poll of 64 QPs' Writes 3-5 % of
    /// its message rate.
    fn move_to(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let n = max.min(self.queue.len());
        if n == 1 {
            if let Some(c) = self.queue.pop_front() {
                out.push(c);
            }
        } else {
            out.extend(self.queue.drain(..n));
        }
        n
    }
}

/// The locked ready queue; its count follows it when the lock goes.
struct ReadyGuard<'a> {
    queue: std::sync::MutexGuard<'a, VecDeque<Completion>>,
    len: &'a AtomicUsize,
}

impl Drop for ReadyGuard<'_> {
    fn drop(&mut self) {
        self.len.store(self.queue.len(), Ordering::Release);
    }
}

#[derive(Default)]
struct Scratch {
    raw: Vec<RawCompletion>,
    done: Vec<Completion>,
    /// The sink of the QP the last round found completions of, as of
    /// `sinks_changed`: a CQ of one QP (or a run of polls on one) finds
    /// its sink without the map's lock or lookup.
    sink: Option<CachedSink>,
}

struct CachedSink {
    qp_num: u32,
    changed: u64,
    sink: Weak<dyn CompletionSink>,
}

/// Raw completions taken from the backend per round.
const BATCH: usize = 32;

impl Context {
    /// `ibv_create_cq` with room for `depth` completions.
    pub fn create_cq(&self, depth: u32) -> Result<CompletionQueue> {
        CompletionQueue::new(self, depth)
    }
}

impl CompletionQueue {
    fn new(ctx: &Context, depth: u32) -> Result<CompletionQueue> {
        let ops = ctx.ops().create_cq(depth)?;
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
        if let Some(fd) = ops.notify_fd() {
            watch(fd)?;
        }
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                ctx: ctx.clone(),
                ops,
                sinks: Mutex::new(QpnMap::default()),
                sinks_changed: AtomicU64::new(0),
                ready: ReadyQueue::default(),
                taking: Mutex::new(Scratch {
                    raw: Vec::with_capacity(BATCH),
                    done: Vec::with_capacity(BATCH),
                    sink: None,
                }),
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
        if self.inner.ops.req_notify()? {
            return Ok(true);
        }
        // A completion that arrived before arming raised no event.
        self.drive()?;
        Ok(!self.inner.ready.is_empty())
    }

    /// [`req_notify`](Self::req_notify) without its last drive: for an
    /// event loop that sleeps on the QP's socket itself, so that input
    /// which came before the arm wakes it anyway (on stag0 the drive is
    /// a socket read, usually failing with EAGAIN).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn req_notify_undriven(&self) -> Result<bool> {
        let _ = self.inner.ready_fd.read();
        Ok(self.inner.ops.req_notify()? || !self.inner.ready.is_empty())
    }

    /// Whether completions may be queued (without driving anything):
    /// false only when none is, on a device that can tell.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn has_queued(&self) -> bool {
        !self.inner.ready.is_empty() || self.inner.ops.has_queued()
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    pub(crate) fn attach(&self, qp_num: u32, sink: Weak<dyn CompletionSink>) {
        let mut sinks = self.inner.sinks.lock().unwrap_or_else(|p| p.into_inner());
        sinks.retain(|_, w| w.strong_count() > 0);
        sinks.insert(qp_num, sink);
        self.inner.sinks_changed.fetch_add(1, Ordering::Release);
    }

    /// The live sink of QP `qp_num`, from `cache` while the map has not
    /// changed since it was filled, else from the map (then cached).
    fn sink_of(
        &self,
        qp_num: u32,
        cache: &mut Option<CachedSink>,
    ) -> Option<Arc<dyn CompletionSink>> {
        let changed = self.inner.sinks_changed.load(Ordering::Acquire);
        if let Some(c) = cache {
            if c.qp_num == qp_num && c.changed == changed {
                return c.sink.upgrade();
            }
        }
        let sink = self
            .inner
            .sinks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&qp_num)
            .cloned()?;
        let live = sink.upgrade();
        *cache = Some(CachedSink {
            qp_num,
            changed,
            sink,
        });
        live
    }

    /// Give raw completions their meaning, running emulation steps on the
    /// way (they may post follow-up work and yield nothing): into
    /// `scratch.done` for [`ReadyQueue::hand_out`], and what a send
    /// queue's order releases straight onto the ready queue.
    fn process(&self, scratch: &mut Scratch) {
        let Scratch { raw, done, sink } = scratch;
        let mut last: Option<(u32, Arc<dyn CompletionSink>)> = None;
        let mut rest = &raw[..];
        while let Some(first) = rest.first() {
            let qp_num = first.qp_num;
            let len = rest.iter().take_while(|rc| rc.qp_num == qp_num).count();
            let (run, after) = rest.split_at(len);
            rest = after;
            if last.as_ref().is_none_or(|(qpn, _)| *qpn != qp_num) {
                last = self.sink_of(qp_num, sink).map(|s| (qp_num, s));
            }
            match &last {
                Some((_, s)) => s.complete(run, done),
                None => warn!(
                    qp = qp_num,
                    dropped = run.len(),
                    "completions for an unknown QP dropped"
                ),
            }
        }
        raw.clear();
    }

    /// One round of taking raw completions and giving them their meaning;
    /// the application's stay queued for its next poll.
    pub(crate) fn drive(&self) -> Result<()> {
        let mut scratch = self.inner.taking.lock().unwrap_or_else(|p| p.into_inner());
        if self.take_raw(&mut scratch)? {
            let Scratch { done, .. } = &mut *scratch;
            self.inner.ready.hand_out(done, &mut Vec::new(), 0);
        }
        Ok(())
    }

    /// Take a batch from the device and give it meaning (into
    /// `scratch.done`, and what a send queue's order released onto the
    /// ready queue); whether there was any. Only under `taking`.
    fn take_raw(&self, scratch: &mut Scratch) -> Result<bool> {
        self.inner.ops.poll(&mut scratch.raw, BATCH)?;
        if scratch.raw.is_empty() {
            return Ok(false);
        }
        self.process(scratch);
        Ok(true)
    }

    /// Queue what `release` puts at the back of the ready queue: a QP's
    /// send order releasing its finished WRs in order, straight in (its
    /// caller holds the order's lock, so that releases on two threads
    /// cannot swap places). `wake`: released outside a poll, where a
    /// thread may be asleep on the CQ.
    pub(crate) fn release_with(&self, wake: bool, release: impl FnOnce(&mut VecDeque<Completion>)) {
        let mut ready = self.inner.ready.lock();
        let before = ready.queue.len();
        release(&mut ready.queue);
        if !wake || ready.queue.len() == before {
            return;
        }
        drop(ready);
        let _ = self.inner.ready_fd.write(1);
        // A thread blocked in `wait` must look at it.
        self.inner.ops.interrupt();
    }

    /// `ibv_poll_cq`: append up to `max` completions to `out`; returns how
    /// many. Never blocks; on the userspace provider the calling thread
    /// also makes progress on this CQ's QPs.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut n = self.inner.ready.take(out, max);
        // Emulated operations may consume several raw completions before
        // one surfaces; a few rounds keep a busy poller's latency low
        // without looping unboundedly. Once one has surfaced it goes to
        // the caller: another round would find the device's queue empty
        // and, on stag0, read the QP's socket (an empty `recvfrom`, ~1 µs)
        // before a ping-pong could post its answer (#20: `stag lat send`
        // paid one per message; a Write's poller, finding no completion,
        // did not).
        for _ in 0..4 {
            if n > 0 || max == 0 {
                break;
            }
            // Another poller is taking a batch: what it finds lands on the
            // ready queue, in order; never wait for it here.
            let Ok(mut scratch) = self.inner.taking.try_lock() else {
                break;
            };
            if !self.take_raw(&mut scratch)? {
                break;
            }
            let Scratch { done, .. } = &mut *scratch;
            n += self.inner.ready.hand_out(done, out, max - n);
        }
        Ok(n)
    }

    /// As [`poll`](Self::poll), but driving no QP: only what the device
    /// has queued already. On stag0 a poll that finds nothing reads the
    /// QP's socket (a `recvfrom`); an event loop that sleeps on that
    /// socket itself, and has not been told it is readable, knows the
    /// read would find nothing (the async stream's quiet look).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn poll_queued(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut n = self.inner.ready.take(out, max);
        if n < max {
            if let Ok(mut scratch) = self.inner.taking.try_lock() {
                self.inner.ops.poll_queued(&mut scratch.raw, BATCH)?;
                self.process(&mut scratch);
                let Scratch { done, .. } = &mut *scratch;
                n += self.inner.ready.hand_out(done, out, max - n);
            }
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
            if n > 0 || max == 0 {
                return Ok(n);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(0);
            }
            // Arm, then look once more: a completion that arrived before
            // arming raised no event. Never sleep holding `taking`: busy
            // pollers of this CQ keep going meanwhile.
            if self.req_notify()? {
                continue;
            }
            // The provider's wait also returns when the emulation layer
            // queues a completion (`release_with` interrupts it).
            self.inner.ops.wait(left)?;
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A successful Send completion of QP 1 with id `wr_id`.
    pub(crate) fn c(wr_id: u64) -> Completion {
        Completion {
            wr_id,
            status: WcStatus::Success,
            qp_num: 1,
            kind: CompletionKind::Send,
            vendor_err: 0,
        }
    }

    /// The ids of `v`, in order.
    pub(crate) fn ids(v: &[Completion]) -> Vec<u64> {
        v.iter().map(|c| c.wr_id).collect()
    }

    /// A round's completions go out behind those queued before it, as
    /// many as asked for; the rest wait on the queue, in order, and its
    /// count (what a poll looks at before it locks) follows.
    #[test]
    fn handed_out_completions_keep_their_order_behind_the_queue() {
        let ready = ReadyQueue::default();
        assert!(ready.is_empty());
        ready.lock().queue.extend([c(1), c(2)]);
        assert!(!ready.is_empty());
        let mut done = vec![c(3), c(4), c(5)];
        let mut out = Vec::new();
        assert_eq!(ready.hand_out(&mut done, &mut out, 2), 2);
        assert_eq!(ids(&out), [1, 2]);
        assert!(done.is_empty(), "the rest is queued, not left behind");
        assert_eq!(ready.len.load(Ordering::Relaxed), 3);
        out.clear();
        assert_eq!(ready.take(&mut out, 8), 3);
        assert_eq!(ids(&out), [3, 4, 5]);
        assert!(ready.is_empty());
    }

    /// With nothing queued, a round goes straight out up to `max`, and
    /// what does not fit is queued for the next poll.
    #[test]
    fn a_round_larger_than_asked_queues_its_rest() {
        let ready = ReadyQueue::default();
        let mut done = vec![c(1), c(2), c(3)];
        let mut out = Vec::new();
        assert_eq!(ready.hand_out(&mut done, &mut out, 1), 1);
        assert_eq!(ids(&out), [1]);
        assert!(!ready.is_empty());
        let mut more = vec![c(4)];
        out.clear();
        assert_eq!(ready.hand_out(&mut more, &mut out, 8), 3);
        assert_eq!(ids(&out), [2, 3, 4]);
        assert!(ready.is_empty());
        assert_eq!(ready.hand_out(&mut Vec::new(), &mut out, 8), 0);
        assert_eq!(ready.take(&mut out, 0), 0);
    }
}
