//! Completion queues: a bounded FIFO of work completions that any number of
//! QPs feed, with an eventfd that is readable while completions are waiting
//! and notifications are armed (for epoll users, like a completion channel).
//!
//! Polling an empty CQ drives its QPs from the polling thread. Waiting on
//! it sleeps on an internal eventfd that completions delivered by other
//! threads write; in the `Blocking` progress mode the waiter also sleeps in
//! `poll(2)` on its QPs' sockets (so the thread that will consume the
//! completion is the one the kernel wakes), while in the polling modes it
//! leaves them to the device's engine, which answers the peer's requests
//! without waking it.

use std::collections::VecDeque;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use smallvec::SmallVec;
use tracing::error;

use crate::wr::{WcStatus, WorkCompletion};

/// What a CQ needs of the QPs that feed it.
pub(crate) trait CqQp: Send + Sync {
    /// Drive the QP once from this (application) thread, unless another
    /// thread is at it. `claim`: the thread keeps driving it (it polls a
    /// CQ whose notifications are not armed), so the device's engine
    /// stands back; a thread polling an armed CQ is about to sleep on
    /// its notification and leaves the QP with the engine.
    fn try_progress(&self, claim: bool);
    /// [`try_progress`](Self::try_progress) with `claim`, from a thread
    /// polling `cq` (not armed): the completions for `cq` the drive makes
    /// go straight to `take`, up to `max`, while `cq` has none queued
    /// (see [`CompletionQueue::poll_each`]); how many went. The rest is
    /// queued as a drive queues it.
    fn try_progress_into(
        &self,
        cq: &CompletionQueue,
        max: usize,
        take: &mut dyn FnMut(WorkCompletion),
    ) -> usize {
        let _ = (cq, max, take);
        self.try_progress(true);
        0
    }
    /// Drive the QP from a waiter whose sleep on its socket just ended
    /// with the socket ready, waiting for the lock if another thread holds
    /// it (the input is still unread behind that thread).
    fn drive_woken(&self);
    /// The socket to sleep on in [`CompletionQueue::wait`], with whether
    /// to wait for writability too; `None` before connection, after
    /// close, and unless `always` when waiters leave the QP to the
    /// device's engine (the polling progress modes).
    fn wait_fd(&self, always: bool) -> Option<(BorrowedFd<'_>, bool)>;
    /// An application thread starts (`true`) or stops sleeping on the
    /// socket. While one does, the engine does not watch it: the arrival
    /// wakes the waiter alone, which drives the QP.
    fn set_waiting(&self, on: bool);
    /// An application thread stops sleeping on the socket in an event
    /// loop: it keeps the socket out of the engine's set for its next
    /// wait, and the engine takes the QP back at its next recheck unless
    /// a thread sleeps on it again ([`crate::engine::Engine::hold`]).
    fn end_wait_holding(&self);
    /// Hand the QP to the device's engine: the application is going to
    /// sleep without driving it.
    fn release_to_engine(&self);
    /// Write the tail a post held back ([`crate::tail`]), if one is: a
    /// thread is about to sleep, and the held octets (and the completion
    /// of the WR they belong to) would otherwise wait for the engine's
    /// deadline.
    fn write_held_tail(&self);
    /// Whether a channel wait keeps the QP's socket (a thread sleeps on
    /// it, or its last wait held it) and the QP has no output waiting for
    /// room: that wait reads the socket first thing when it comes back.
    fn kept_by_waiter(&self) -> bool;
    /// Whether the device's engine answers this QP's requests without a
    /// wake-up now (it polls after traffic).
    fn engine_polls(&self) -> bool;
    /// How long a wait polls this QP before it sleeps: `Some`
    /// while input is known to be coming without the application (a
    /// request on the wire awaits its response with posted requests
    /// behind it, `Connection::pipelined`; or a message is part-way in,
    /// `Connection::input_under_way`) and the progress mode polls at all.
    /// `None` otherwise, and while another thread holds the QP.
    fn poll_window(&self) -> Option<Duration>;
}

/// How many socket wake-ups without a notification a channel wait
/// ([`CompletionQueue::wait_notified`]) takes before it leaves the
/// sockets that woke it to the device's engine: a thread woken that often
/// for nothing of its own is answering the peer's requests, which the
/// engine does without a wake-up while it polls. Several, so that a
/// message arriving in a few reads is still read by its waiter.
const CEDE_AFTER_DRY_WAKES: u32 = 8;

/// How many QPs a wait (a channel wait, or [`CompletionQueue::wait`]) keeps
/// on the stack; more spill to the heap.
const WAIT_INLINE: usize = 4;

/// Notification arming (`ibv_req_notify_cq`).
const ARM_NONE: u8 = 0;
const ARM_ANY: u8 = 1;
const ARM_SOLICITED: u8 = 2;

/// What a fired notification calls instead of writing the event fd: the
/// plugin writes its completion channel's record from the thread that
/// delivered the completion, so the sleeping application is the one
/// thread woken (no relay thread in between).
pub struct NotifySink(Box<dyn Fn() + Send + Sync>);

impl NotifySink {
    /// A sink calling `f` once per fired notification.
    pub fn new(f: impl Fn() + Send + Sync + 'static) -> NotifySink {
        NotifySink(Box::new(f))
    }
}

impl fmt::Debug for NotifySink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NotifySink")
    }
}

/// A completion queue.
#[derive(Debug)]
pub struct CompletionQueue {
    queue: Mutex<VecDeque<WorkCompletion>>,
    /// The queue's length, written under its lock: a poll that finds it
    /// zero takes no lock (a spinning poller's empty polls are most of
    /// them).
    queued: AtomicUsize,
    capacity: usize,
    event_fd: EventFd,
    armed: AtomicU8,
    overrun: AtomicBool,
    /// Called once, at the first overrun (`IBV_EVENT_CQ_ERR`).
    overrun_hook: OnceLock<OverrunHook>,
    /// QPs that feed this CQ, so that polling can drive them.
    qps: RwLock<Vec<Weak<dyn CqQp>>>,
    /// Readable when a completion arrived while a thread sleeps in
    /// [`wait`](Self::wait).
    wake: EventFd,
    /// Threads asleep in [`wait`](Self::wait).
    waiters: AtomicU32,
    /// Set by [`interrupt_wait`](Self::interrupt_wait): the next (or
    /// current) wait returns early.
    interrupted: AtomicBool,
    /// Replaces the event fd when set ([`set_notify_sink`](Self::set_notify_sink)).
    sink: OnceLock<NotifySink>,
    /// Counts [`Device::poll_cq`](crate::device::Device::poll_cq) calls,
    /// for the sweep ([`crate::registry`]).
    mark: Arc<PollMark>,
}

/// A CQ's count of polls through the device's policies, and whether the
/// last one found it empty.
#[derive(Debug, Default)]
pub(crate) struct PollMark {
    polls: AtomicU64,
    empty: AtomicBool,
    /// The registry's generation when a sweep from this CQ last found
    /// every QP of the device on this CQ (nothing to sweep until a QP is
    /// created); 0 = never ([`crate::registry::QpRegistry::sweep`]).
    pub(crate) all_mine_at: AtomicU64,
}

impl PollMark {
    /// A poll of the CQ. A load and a store, not an atomic add: the count
    /// only tells a reader that polls happened since it last looked, which
    /// two polls racing to store the same value still tell, and a locked
    /// add on every poll of a spinning thread cost more than the rest of
    /// this bookkeeping together.
    pub(crate) fn bump(&self) {
        let polls = self.polls.load(Ordering::Relaxed);
        self.polls.store(polls.wrapping_add(1), Ordering::Relaxed);
    }

    /// Polls so far.
    pub(crate) fn get(&self) -> u64 {
        self.polls.load(Ordering::Relaxed)
    }

    /// A poll found the CQ empty: whether the one before it did too (a
    /// thread spins on this CQ).
    pub(crate) fn empty_again(&self) -> bool {
        // Stored only when it changes (no locked exchange per empty poll).
        let again = self.empty.load(Ordering::Relaxed);
        if !again {
            self.empty.store(true, Ordering::Relaxed);
        }
        again
    }

    /// A poll found completions.
    pub(crate) fn found(&self) {
        if self.empty.load(Ordering::Relaxed) {
            self.empty.store(false, Ordering::Relaxed);
        }
    }
}

impl CompletionQueue {
    /// A CQ for at most `capacity` completions.
    pub fn new(capacity: usize) -> std::io::Result<Arc<CompletionQueue>> {
        let event_fd =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        let wake =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        Ok(Arc::new(CompletionQueue {
            queue: Mutex::new(VecDeque::with_capacity(capacity.min(65536))),
            queued: AtomicUsize::new(0),
            capacity,
            event_fd,
            armed: AtomicU8::new(ARM_NONE),
            overrun: AtomicBool::new(false),
            overrun_hook: OnceLock::new(),
            qps: RwLock::new(Vec::new()),
            wake,
            waiters: AtomicU32::new(0),
            interrupted: AtomicBool::new(false),
            sink: OnceLock::new(),
            mark: Arc::default(),
        }))
    }

    /// The CQ's poll count.
    pub(crate) fn mark(&self) -> &Arc<PollMark> {
        &self.mark
    }

    pub(crate) fn attach(&self, qp: Weak<dyn CqQp>) {
        let mut qps = self.qps.write().unwrap_or_else(|p| p.into_inner());
        qps.retain(|w| w.strong_count() > 0);
        qps.push(qp);
    }

    /// Queue a completion (called by the progress engine).
    pub(crate) fn push(&self, wc: WorkCompletion) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let mut first_overrun = false;
        if q.len() >= self.capacity {
            // An overrun CQ is an error in verbs; keep the completion (losing
            // one would be worse) and report the overrun.
            if !self.overrun.swap(true, Ordering::Relaxed) {
                error!(capacity = self.capacity, "completion queue overrun");
                first_overrun = true;
            }
        }
        let solicited = wc.solicited || wc.status != WcStatus::Success;
        q.push_back(wc);
        self.queued.store(q.len(), Ordering::Release);
        drop(q);
        if first_overrun {
            if let Some(hook) = self.overrun_hook.get() {
                (hook.0)();
            }
        }
        // Pairs with the SeqCst increment in `wait` before its last look
        // at the queue: either it sees this completion or we see it.
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _ = self.wake.write(1);
        }
        let arm = self.armed.load(Ordering::SeqCst);
        if (arm == ARM_ANY || (arm == ARM_SOLICITED && solicited))
            && self
                .armed
                .compare_exchange(arm, ARM_NONE, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            self.fire();
        }
    }

    /// Take every queued completion of QP `qpn` out of the queue; returns
    /// how many there were. What `ibv_destroy_qp` does on hardware
    /// providers (mlx5's CQ clean): the application may free what those
    /// completions' ids point at as soon as the QP is gone.
    pub(crate) fn discard_qp(&self, qpn: u32) -> usize {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let before = q.len();
        q.retain(|wc| wc.qp_num != qpn);
        self.queued.store(q.len(), Ordering::Release);
        before - q.len()
    }

    /// A notification fires: once per arming.
    fn fire(&self) {
        match self.sink.get() {
            Some(sink) => (sink.0)(),
            None => {
                let _ = self.event_fd.write(1);
            }
        }
    }

    /// Deliver fired notifications to `sink` instead of the event fd
    /// ([`AsFd`]); false if a sink was set already.
    pub fn set_notify_sink(&self, sink: NotifySink) -> bool {
        self.sink.set(sink).is_ok()
    }

    /// Whether notifications are armed ([`req_notify`](Self::req_notify)
    /// and no completion fired them yet): the application means to sleep
    /// on them.
    pub fn is_armed(&self) -> bool {
        self.armed.load(Ordering::SeqCst) != ARM_NONE
    }

    /// Take up to `out.len()` completions without driving any QP.
    pub fn try_poll(&self, out: &mut [WorkCompletion]) -> usize {
        let (max, take) = fill(out);
        self.try_poll_each(max, take)
    }

    /// Hand up to `max` completions to `take`, in order, without driving
    /// any QP; returns how many. `take` runs under the queue's lock: it
    /// only stores the completion (a caller's own buffer needs no
    /// blank-filled array in between).
    #[inline]
    pub fn try_poll_each(&self, max: usize, mut take: impl FnMut(WorkCompletion)) -> usize {
        // A push stores the length after queuing, under the lock: a
        // completion this look misses was pushed after it began, as if the
        // poll had come a moment earlier.
        if max == 0 || self.queued.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let n = max.min(q.len());
        if n == 1 {
            // A ping-pong's poll: `drain`'s ring handling cost it more
            // than the move (#20).
            if let Some(wc) = q.pop_front() {
                take(wc);
            }
        } else {
            // A batch: popping each cost a batch poll 15 % more (64 QPs'
            // Writes, callgrind).
            for wc in q.drain(..n) {
                take(wc);
            }
        }
        self.queued.store(q.len(), Ordering::Release);
        n
    }

    /// `ibv_poll_cq`: take up to `out.len()` completions. When none is
    /// waiting, the calling thread drives the QPs on this CQ once (reads
    /// their sockets), so busy polling needs no other thread.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        let (max, take) = fill(out);
        self.poll_each(max, take)
    }

    /// [`poll`](Self::poll), handing up to `max` completions to `take`
    /// ([`try_poll_each`](Self::try_poll_each)).
    pub fn poll_each(&self, max: usize, mut take: impl FnMut(WorkCompletion)) -> usize {
        let n = self.try_poll_each(max, &mut take);
        if n > 0 || max == 0 {
            return n;
        }
        if self.is_armed() {
            // A thread polling an armed CQ found it empty: it is about to
            // sleep on the notification, so it drives without taking the
            // QPs from the engine (which would then leave an arrival to a
            // thread that is asleep). A QP whose socket a channel wait
            // keeps is left alone: that wait polls the socket first thing,
            // and a drive here mostly found it empty (a `recvfrom` EAGAIN
            // per event in rping's CQ thread, whose last poll of each
            // event is empty) under the lock a posting thread wants.
            let qps = self.qps.read().unwrap_or_else(|p| p.into_inner());
            for qp in qps.iter().filter_map(Weak::upgrade) {
                if !qp.kept_by_waiter() {
                    qp.try_progress(false);
                }
            }
        } else {
            // The thread drives the QPs and takes what they complete for
            // this CQ straight from them, not through the queue (a lock
            // and a queue's push and pop per completion, #20).
            let n = self.drive_qps_into(max, &mut take);
            if n > 0 {
                return n + self.try_poll_each(max - n, take);
            }
        }
        self.try_poll_each(max, take)
    }

    /// Whether no completion is queued, without the lock: one queued
    /// while this looks is seen by the next look.
    pub(crate) fn nothing_queued(&self) -> bool {
        self.queued.load(Ordering::Acquire) == 0
    }

    /// Drive the CQ's QPs once from this polling thread, handing what
    /// they complete for this CQ to `take` ([`CqQp::try_progress_into`]);
    /// how many went to it.
    ///
    /// A QP's completions keep their order: one goes to `take` only while
    /// nothing is queued here, looked at under the QP's lock, which every
    /// push of that QP's completions holds; once one of them is queued,
    /// the rest follow it onto the queue. Completions of different QPs
    /// have no order between them.
    fn drive_qps_into(&self, max: usize, take: &mut dyn FnMut(WorkCompletion)) -> usize {
        let qps = self.qps.read().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        for qp in qps.iter().filter_map(Weak::upgrade) {
            n += qp.try_progress_into(self, max - n, take);
        }
        n
    }

    /// Block until a completion is waiting or `timeout` passes; then poll.
    ///
    /// The calling thread drives the CQ's QPs itself, sleeping in `poll(2)`
    /// on their sockets in between, so a completion caused by the peer
    /// costs one wake-up of this thread (the device's engine leaves those
    /// sockets alone meanwhile). Before its first sleep it polls the QPs
    /// whose input is due, as a channel wait does (`poll_due_input`).
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> usize {
        if out.is_empty() {
            return 0;
        }
        // The sleep drives the QPs whose sockets woke it, leaving them
        // with the engine (the waiter goes back to sleep if that brought
        // nothing).
        self.sleep_until(timeout, || self.try_poll(out))
    }

    /// Like [`wait`](Self::wait), but leave the completions queued: returns
    /// how many are waiting (0 after `timeout` or an
    /// [`interrupt_wait`](Self::interrupt_wait)). For a layer above that
    /// must take completions under its own lock, in CQ order.
    pub fn wait_ready(&self, timeout: Duration) -> usize {
        self.sleep_until(timeout, || self.len())
    }

    /// The sleeping loop of [`wait`](Self::wait): `check()` looks and
    /// returns how many completions it found; the loop drives the QPs
    /// whose sockets woke it before it looks again.
    fn sleep_until(&self, timeout: Duration, mut check: impl FnMut() -> usize) -> usize {
        let deadline = Instant::now() + timeout;
        // Whether this wait polled the QPs whose input is due already
        // (once, before its first sleep), as a channel wait does.
        let mut spun = false;
        // Drive only after a socket woke us: input already waiting makes
        // `poll(2)` return at once, so a read beforehand would be a wasted
        // syscall in the common case (the peer has not answered yet).
        loop {
            let n = check();
            if n > 0 {
                return n;
            }
            if self.interrupted.swap(false, Ordering::SeqCst) {
                return 0;
            }
            let now = Instant::now();
            if now >= deadline {
                return 0;
            }
            // On the stack for the usual few QPs, as in a channel wait.
            let qps: SmallVec<[Arc<dyn CqQp>; WAIT_INLINE]> = {
                let qps = self.qps.read().unwrap_or_else(|p| p.into_inner());
                qps.iter().filter_map(Weak::upgrade).collect()
            };
            if !spun {
                spun = true;
                let mut found = 0;
                let done = || {
                    found = check();
                    found > 0 || self.interrupted.load(Ordering::SeqCst)
                };
                if Self::poll_due_input(&qps, Some(deadline), done) {
                    if found > 0 {
                        return found;
                    }
                    // Interrupted: the look above says so.
                    continue;
                }
            }
            // A tail a post held back goes out before the sleep, with the
            // completion it may bring.
            for qp in &qps {
                qp.write_held_tail();
            }
            let n = check();
            if n > 0 {
                return n;
            }
            let mut fds: SmallVec<[PollFd; WAIT_INLINE + 1]> = SmallVec::new();
            fds.push(PollFd::new(self.wake.as_fd(), PollFlags::POLLIN));
            let mut sleeping: SmallVec<[(&Arc<dyn CqQp>, bool); WAIT_INLINE]> = SmallVec::new();
            for qp in &qps {
                if let Some((fd, write)) = qp.wait_fd(false) {
                    let mut ev = PollFlags::POLLIN;
                    if write {
                        ev |= PollFlags::POLLOUT;
                    }
                    fds.push(PollFd::new(fd, ev));
                    sleeping.push((qp, write));
                } else {
                    // The engine drives it while we sleep on `wake`.
                    qp.release_to_engine();
                }
            }
            self.waiters.fetch_add(1, Ordering::SeqCst);
            for (qp, _) in &sleeping {
                qp.set_waiting(true);
            }
            // A completion pushed before we counted ourselves is in the
            // queue now; one pushed after will write `wake`. The same holds
            // for an interruption.
            if self.is_empty() && !self.interrupted.load(Ordering::SeqCst) {
                // Round up so that a short remainder still sleeps.
                let left = deadline.saturating_duration_since(now) + Duration::from_micros(999);
                let ms = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
                let _ = nix::poll::poll(&mut fds, ms);
            }
            // A QP whose input woke us stays held (`Engine::hold`) while
            // this thread drives it and sleeps again: handed back before
            // that drive, the unread input woke the engine too, and the
            // two threads raced for it. That cost every blocking-mode round
            // trip (the responder answering a Read from its wait) an extra
            // wake-up, futexes and two epoll_ctl: 18.9 → 32.5 µs for
            // `stag lat read --progress blocking` (alternating rounds).
            // A QP with output still waiting for room goes back to the
            // engine, which keeps the stream full while this thread is
            // away (held, 1 MiB Writes fell to 0.77×), and so does one
            // that stayed quiet.
            for ((qp, write), f) in sleeping.iter().zip(&fds[1..]) {
                let revents = f.revents().unwrap_or(PollFlags::empty());
                if revents.contains(PollFlags::POLLIN) && !write {
                    qp.end_wait_holding();
                } else {
                    qp.set_waiting(false);
                }
            }
            self.waiters.fetch_sub(1, Ordering::SeqCst);
            if fds[0].any().unwrap_or(false) {
                let _ = self.wake.read();
            }
            // The QPs whose sockets woke us, waiting for a thread that
            // holds one (`drive_woken`). The others have nothing to read:
            // the engine drives those we did not sleep on.
            for ((qp, _), f) in sleeping.iter().zip(&fds[1..]) {
                if f.any().unwrap_or(false) {
                    qp.drive_woken();
                }
            }
        }
    }

    /// Sleep until `fd` is readable or `timeout` passes (forever with
    /// `None`); whether it is. A signal ends the sleep with `EINTR`, as
    /// it would end a `read` of `fd` (a C program may be waiting for it). `fd` is what the notifications of `cqs`
    /// make readable (a completion channel). The calling thread sleeps on
    /// the sockets of the QPs feeding the armed CQs among them as well,
    /// and drives a QP when its socket wakes it (without taking it from
    /// the engine): the arrival wakes this one thread, which delivers
    /// the completion, fires the notification and returns, or does the
    /// responder work the arrival asked for and sleeps again.
    ///
    /// `delivered` tells whether a notification reached the caller some
    /// other way (a sink that hands this thread's own notifications to it
    /// directly): looked at after each drive, it ends the sleep too.
    pub fn wait_notified(
        fd: BorrowedFd<'_>,
        cqs: &[Arc<CompletionQueue>],
        timeout: Option<Duration>,
        delivered: &dyn Fn() -> bool,
    ) -> nix::Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        // A look without sleeping (a non-blocking channel): the caller goes
        // on to sleep elsewhere (poll(2) on the channel fd), not on these
        // sockets, so they go back to the engine at once, not held.
        let look = timeout.is_some_and(|t| t.is_zero());
        // Socket wake-ups of this wait that delivered nothing, and the
        // QPs it left to the engine after too many of them.
        let mut dry_wakes = 0u32;
        let mut ceded: Vec<Arc<dyn CqQp>> = Vec::new();
        // Whether this wait polled the QPs whose input is due already
        // (once, before its first sleep).
        let mut spun = false;
        loop {
            if delivered() {
                return Ok(true);
            }
            // An engine that stopped polling (the cores are taken) would
            // pay the wake-up itself: the socket comes back to this wait.
            let before = ceded.len();
            ceded.retain(|qp| qp.engine_polls());
            if ceded.len() != before {
                dry_wakes = 0;
            }
            // On the stack for the usual few QPs: a wait per message
            // allocates nothing.
            let mut qps: SmallVec<[Arc<dyn CqQp>; WAIT_INLINE]> = SmallVec::new();
            for cq in cqs.iter().filter(|cq| cq.is_armed()) {
                let feeding = cq.qps.read().unwrap_or_else(|p| p.into_inner());
                qps.extend(feeding.iter().filter_map(Weak::upgrade));
            }
            if !look && !spun {
                spun = true;
                // Another thread's completion on these CQs writes `fd`.
                let notified = || {
                    let mut channel = [PollFd::new(fd, PollFlags::POLLIN)];
                    delivered()
                        || nix::poll::poll(&mut channel, PollTimeout::ZERO).is_ok_and(|n| n > 0)
                };
                if Self::poll_due_input(&qps, deadline, notified) {
                    return Ok(true);
                }
            }
            // A tail a post held back goes out before the sleep; the
            // completion it brings may be this thread's own notification.
            for qp in &qps {
                qp.write_held_tail();
            }
            if delivered() {
                return Ok(true);
            }
            let mut fds: SmallVec<[PollFd; WAIT_INLINE + 1]> = SmallVec::new();
            fds.push(PollFd::new(fd, PollFlags::POLLIN));
            let mut sleeping: SmallVec<[&Arc<dyn CqQp>; WAIT_INLINE]> = SmallVec::new();
            for qp in &qps {
                if ceded.iter().any(|c| Arc::ptr_eq(c, qp)) {
                    continue;
                }
                if let Some((sock, write)) = qp.wait_fd(true) {
                    let mut ev = PollFlags::POLLIN;
                    if write {
                        ev |= PollFlags::POLLOUT;
                    }
                    fds.push(PollFd::new(sock, ev));
                    sleeping.push(qp);
                }
            }
            for qp in &sleeping {
                qp.set_waiting(true);
            }
            // Input that arrived before we took the sockets keeps them
            // readable, and a notification fired meanwhile is in `fd`:
            // nothing is lost between the look and the sleep.
            let left = match deadline {
                None => PollTimeout::NONE,
                Some(_) if look => PollTimeout::ZERO,
                Some(d) => {
                    // Round up so that a short remainder still sleeps.
                    let left =
                        d.saturating_duration_since(Instant::now()) + Duration::from_micros(999);
                    PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX)
                }
            };
            let polled = nix::poll::poll(&mut fds, left);
            // A sleeping wait keeps the sockets for the thread's next one
            // (`Engine::hold`). Handing them back at once instead (an
            // epoll_ctl each way per wait, and the engine racing the thread
            // for arrivals in between) measured qperf rc_lat 12 → 22 µs
            // one way (6 alternating rounds, load 12).
            //
            // Unless the thread only does the peer's work there: a wait
            // that its sockets woke CEDE_AFTER_DRY_WAKES times without a
            // notification (a Read responder, fio's rdma server asleep
            // for its whole run) pays a wake-up per request that a
            // polling engine answers without one. The sockets that woke
            // it go back to such an engine for the rest of this wait (its
            // next wait takes them again).
            let cede_due = !look && dry_wakes + 1 >= CEDE_AFTER_DRY_WAKES;
            let cedes: SmallVec<[bool; WAIT_INLINE]> = if cede_due {
                sleeping
                    .iter()
                    .zip(&fds[1..])
                    .map(|(qp, f)| f.any().unwrap_or(false) && qp.engine_polls())
                    .collect()
            } else {
                SmallVec::new()
            };
            let cede_of = |i: usize| cedes.get(i).copied().unwrap_or(false);
            for (i, qp) in sleeping.iter().enumerate() {
                let cede = cede_of(i);
                if look || cede {
                    qp.set_waiting(false);
                } else {
                    qp.end_wait_holding();
                }
            }
            if fds[0].any().unwrap_or(false) {
                return Ok(true);
            }
            polled?;
            let mut woken = false;
            for (i, (qp, f)) in sleeping.iter().zip(&fds[1..]).enumerate() {
                let cede = cede_of(i);
                if f.any().unwrap_or(false) {
                    qp.drive_woken();
                    woken = true;
                    if cede {
                        ceded.push(Arc::clone(qp));
                    }
                }
            }
            if woken && !delivered() {
                dry_wakes += 1;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
        }
    }

    /// Poll the QPs among `qps` whose input is due ([`CqQp::poll_window`])
    /// for their window (cut at `deadline`) before a wait sleeps, a
    /// channel wait or [`wait`](Self::wait): whether `done()` said what
    /// the wait waits for came.
    ///
    /// A Read stream at the ORD limit (qperf rc_rdma_read_bw, fio's rdma
    /// reads: one Read on the wire, the rest posted behind it) sends its
    /// next request when a response is placed. Slept on, every response
    /// waits for a thread's wake-up before the next request leaves; on
    /// this VM a wake-up from an idle core is ~25 µs against ~40 µs for
    /// the 64 KiB Read itself (qperf at 0.72x of a polling `stag bw read
    /// -t 1`). Handing the socket to a polling engine instead was no
    /// better: the engine and the woken application then share the
    /// application's core (measured 1.03-1.08 GB/s against 1.17 asleep).
    /// A receiver that sleeps with a message part-way in is woken by the
    /// sender's next segment, and the sender pays for that wake-up in its
    /// send (qperf rc_bw's client: 11 % of its samples in the wake-up, its
    /// core the bottleneck). In both cases the input is known to be
    /// coming, so the wait polls for it within the progress mode's
    /// window, as the adaptive engine does after traffic; a blocking
    /// device never polls.
    fn poll_due_input(
        qps: &[Arc<dyn CqQp>],
        deadline: Option<Instant>,
        mut done: impl FnMut() -> bool,
    ) -> bool {
        let spins: Vec<(&Arc<dyn CqQp>, Duration)> = qps
            .iter()
            .filter_map(|qp| qp.poll_window().map(|d| (qp, d)))
            .collect();
        let Some(window) = spins.iter().map(|(_, d)| *d).max() else {
            return false;
        };
        let mut until = Instant::now() + window;
        if let Some(deadline) = deadline {
            until = until.min(deadline);
        }
        loop {
            for (qp, _) in &spins {
                qp.try_progress(false);
            }
            if done() {
                return true;
            }
            if Instant::now() >= until || !spins.iter().any(|(qp, _)| qp.poll_window().is_some()) {
                return false;
            }
        }
    }

    /// Make a [`wait`](Self::wait) in progress, or else the next one,
    /// return at once (with what it has): for a layer above that queues
    /// completions of its own and needs the waiter to look at them.
    pub fn interrupt_wait(&self) {
        self.interrupted.store(true, Ordering::SeqCst);
        let _ = self.wake.write(1);
    }

    /// `ibv_req_notify_cq`: make the event fd readable at the next
    /// completion (only solicited ones and errors if `solicited_only`);
    /// completions already queued do not count.
    ///
    /// An application that arms notifications is about to sleep on them:
    /// the device's engine takes over driving this CQ's QPs at once.
    pub fn req_notify(&self, solicited_only: bool) {
        {
            let qps = self.qps.read().unwrap_or_else(|p| p.into_inner());
            for qp in qps.iter().filter_map(Weak::upgrade) {
                qp.release_to_engine();
            }
        }
        let arm = if solicited_only {
            ARM_SOLICITED
        } else {
            ARM_ANY
        };
        // Completions already queued fire nothing, as on a kernel device
        // (`ibv_req_notify_cq` has no "report missed events"): the caller
        // polls once after arming. Firing here would leave the CQ unarmed
        // while the program sleeps on a spurious event's successor.
        self.armed.store(arm, Ordering::SeqCst);
    }

    /// Consume the event fd's pending notifications (`ibv_get_cq_event` +
    /// `ibv_ack_cq_events`); returns how many there were.
    pub fn ack_events(&self) -> u64 {
        self.event_fd.read().unwrap_or(0)
    }

    /// Completions waiting (under the queue's lock: a waiter's last look
    /// before it sleeps pairs with the push's wake-up through it).
    pub fn len(&self) -> usize {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no completion is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether more completions arrived than the CQ holds.
    pub fn overrun(&self) -> bool {
        self.overrun.load(Ordering::Relaxed)
    }

    /// Have `hook` called at the first overrun (from the thread that
    /// pushed the completion, with no lock of the CQ held): how the
    /// rdma-core plugin raises `IBV_EVENT_CQ_ERR`. One per CQ; returns
    /// false if one was already set.
    pub fn set_overrun_hook(&self, hook: impl Fn() + Send + Sync + 'static) -> bool {
        self.overrun_hook.set(OverrunHook(Box::new(hook))).is_ok()
    }
}

/// What [`CompletionQueue::set_overrun_hook`] installs.
struct OverrunHook(Box<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for OverrunHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OverrunHook")
    }
}

impl AsFd for CompletionQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.event_fd.as_fd()
    }
}

/// The `take` of the `*_each` polls for a caller with a slice: stores the
/// completions in `out` in order; with how many it can hold.
pub(crate) fn fill(out: &mut [WorkCompletion]) -> (usize, impl FnMut(WorkCompletion) + '_) {
    let mut slots = out.iter_mut();
    (slots.len(), move |wc| {
        if let Some(slot) = slots.next() {
            *slot = wc;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A waiter blocked for 60 s comes back when interrupted, with nothing;
    /// an interruption with nobody waiting ends the next wait at once.
    #[test]
    fn interrupt_ends_a_wait_in_progress_or_the_next() {
        let cq = CompletionQueue::new(4).unwrap();
        let waiter = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                let start = Instant::now();
                let n = cq.wait(&mut [WorkCompletion::BLANK], Duration::from_secs(60));
                (n, start.elapsed())
            })
        };
        while cq.waiters.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        cq.interrupt_wait();
        let (n, took) = waiter.join().unwrap();
        assert_eq!(n, 0);
        assert!(took < Duration::from_secs(30), "{took:?}");

        cq.interrupt_wait();
        let start = Instant::now();
        assert_eq!(
            cq.wait(&mut [WorkCompletion::BLANK], Duration::from_secs(60)),
            0
        );
        assert!(start.elapsed() < Duration::from_secs(30));
        // Consumed: a completion is what ends the wait after that.
        cq.push(WorkCompletion {
            wr_id: 7,
            ..WorkCompletion::BLANK
        });
        let mut out = [WorkCompletion::BLANK];
        assert_eq!(cq.wait(&mut out, Duration::from_secs(60)), 1);
        assert_eq!(out[0].wr_id, 7);
    }

    /// A QP as a channel wait sees it: its socket, what its engine and
    /// its input window say, and a count of each call the wait makes.
    struct FakeQp {
        sock: std::os::unix::net::UnixStream,
        engine_polls: bool,
        poll_window: Option<Duration>,
        /// `try_progress` calls (polls before a sleep).
        progressed: AtomicU32,
        /// `drive_woken` calls (drives after its socket woke the wait).
        drives: AtomicU32,
        /// `set_waiting(true)` calls (sleeps on its socket).
        slept: AtomicU32,
        /// `set_waiting(false)` calls (the socket handed back).
        handed_back: AtomicU32,
        /// A CQ to which its `n`th `try_progress` delivers a completion.
        completes: std::sync::OnceLock<(Arc<CompletionQueue>, u32)>,
    }

    impl FakeQp {
        fn new(
            sock: std::os::unix::net::UnixStream,
            engine_polls: bool,
            poll_window: Option<Duration>,
        ) -> Arc<FakeQp> {
            Arc::new(FakeQp {
                sock,
                engine_polls,
                poll_window,
                progressed: AtomicU32::new(0),
                drives: AtomicU32::new(0),
                slept: AtomicU32::new(0),
                handed_back: AtomicU32::new(0),
                completes: std::sync::OnceLock::new(),
            })
        }
    }

    impl CqQp for FakeQp {
        fn try_progress(&self, _claim: bool) {
            let n = self.progressed.fetch_add(1, Ordering::SeqCst) + 1;
            if let Some((cq, at)) = self.completes.get() {
                if n == *at {
                    cq.push(WorkCompletion {
                        wr_id: u64::from(n),
                        ..WorkCompletion::BLANK
                    });
                }
            }
        }
        fn drive_woken(&self) {
            self.drives.fetch_add(1, Ordering::SeqCst);
        }
        fn wait_fd(&self, _always: bool) -> Option<(BorrowedFd<'_>, bool)> {
            Some((self.sock.as_fd(), false))
        }
        fn set_waiting(&self, on: bool) {
            let count = if on { &self.slept } else { &self.handed_back };
            count.fetch_add(1, Ordering::SeqCst);
        }
        fn end_wait_holding(&self) {}
        fn release_to_engine(&self) {}
        fn write_held_tail(&self) {}
        fn kept_by_waiter(&self) -> bool {
            false
        }
        fn engine_polls(&self) -> bool {
            self.engine_polls
        }
        fn poll_window(&self) -> Option<Duration> {
            self.poll_window
        }
    }

    /// A channel wait woken by its QP's socket CEDE_AFTER_DRY_WAKES times
    /// with nothing delivered hands that socket back to a polling engine
    /// and sleeps on the channel alone; with an engine that does not poll
    /// it keeps the socket.
    #[test]
    fn a_wait_woken_for_nothing_leaves_its_socket_to_a_polling_engine() {
        use std::io::Write as _;
        use std::os::unix::net::UnixStream;
        for engine_polls in [true, false] {
            let (sock, mut peer) = UnixStream::pair().unwrap();
            peer.write_all(b"x").unwrap();
            // A responder's socket: always readable, and its drives
            // complete nothing.
            let qp = FakeQp::new(sock, engine_polls, None);
            let cq = CompletionQueue::new(4).unwrap();
            let weak: Weak<dyn CqQp> = Arc::downgrade(&qp) as Weak<dyn CqQp>;
            cq.attach(weak);
            cq.req_notify(false);
            let (channel, _channel_peer) = UnixStream::pair().unwrap();
            // The wait ends at the first look after a hand-back, or once
            // the socket woke it well past the limit.
            let enough = || {
                qp.handed_back.load(Ordering::SeqCst) > 0
                    || qp.drives.load(Ordering::SeqCst) >= CEDE_AFTER_DRY_WAKES + 4
            };
            let woke = CompletionQueue::wait_notified(
                channel.as_fd(),
                std::slice::from_ref(&cq),
                None,
                &enough,
            )
            .unwrap();
            assert!(woke);
            let drives = qp.drives.load(Ordering::SeqCst);
            let handed_back = qp.handed_back.load(Ordering::SeqCst);
            if engine_polls {
                assert_eq!((drives, handed_back), (CEDE_AFTER_DRY_WAKES, 1));
            } else {
                assert_eq!((drives, handed_back), (CEDE_AFTER_DRY_WAKES + 4, 0));
            }
        }
    }

    /// A channel wait on a QP whose input is due polls it before sleeping
    /// and returns as soon as a drive delivers, without sleeping; past its
    /// window it sleeps, and a QP with no input due is never polled.
    #[test]
    fn a_wait_polls_a_qp_whose_input_is_due_for_its_window_before_it_sleeps() {
        use std::os::unix::net::UnixStream;
        let cases = [
            // (window, the poll that delivers, expect delivered, slept)
            (Some(Duration::from_secs(30)), 5, true, false),
            (Some(Duration::from_millis(2)), u32::MAX, false, true),
            (None, 1, false, true),
        ];
        for (spin, respond_after, want_delivered, want_slept) in cases {
            // A Read on the wire and more posted behind it: its socket
            // stays quiet, and its `respond_after`th poll delivers.
            let (sock, _peer) = UnixStream::pair().unwrap();
            let qp = FakeQp::new(sock, false, spin);
            let cq = CompletionQueue::new(4).unwrap();
            cq.attach(Arc::downgrade(&qp) as Weak<dyn CqQp>);
            cq.req_notify(false);
            let (channel, _channel_peer) = UnixStream::pair().unwrap();
            let delivered = || qp.progressed.load(Ordering::SeqCst) >= respond_after;
            let woke = CompletionQueue::wait_notified(
                channel.as_fd(),
                std::slice::from_ref(&cq),
                Some(Duration::from_millis(20)),
                &delivered,
            )
            .unwrap();
            let polls = qp.progressed.load(Ordering::SeqCst);
            let slept = qp.slept.load(Ordering::SeqCst) > 0;
            assert_eq!((woke, slept), (want_delivered, want_slept), "{spin:?}");
            match spin {
                Some(_) if want_delivered => assert_eq!(polls, respond_after),
                Some(_) => assert!(polls > 1, "polled for its window: {polls}"),
                None => assert_eq!(polls, 0),
            }
        }
    }

    /// [`wait`](CompletionQueue::wait) (verbs' `CompletionQueue::wait`)
    /// follows the same rule: it polls a QP whose input is due and returns
    /// the completion its 5th poll delivers without sleeping; past the
    /// window it sleeps until its timeout, and a QP with no input due is
    /// never polled.
    #[test]
    fn a_cq_wait_polls_a_qp_whose_input_is_due_for_its_window_before_it_sleeps() {
        use std::os::unix::net::UnixStream;
        let cases = [
            // (window, the poll that completes, expect completions, slept)
            (Some(Duration::from_secs(30)), 5, 1, false),
            (Some(Duration::from_millis(2)), u32::MAX, 0, true),
            (None, 1, 0, true),
        ];
        for (spin, complete_at, want_n, want_slept) in cases {
            let (sock, _peer) = UnixStream::pair().unwrap();
            let qp = FakeQp::new(sock, false, spin);
            let cq = CompletionQueue::new(4).unwrap();
            cq.attach(Arc::downgrade(&qp) as Weak<dyn CqQp>);
            qp.completes.set((cq.clone(), complete_at)).unwrap();
            let mut out = [WorkCompletion::BLANK];
            let n = cq.wait(&mut out, Duration::from_millis(20));
            let polls = qp.progressed.load(Ordering::SeqCst);
            let slept = qp.slept.load(Ordering::SeqCst) > 0;
            assert_eq!((n, slept), (want_n, want_slept), "{spin:?}");
            match spin {
                Some(_) if want_n > 0 => {
                    assert_eq!((polls, out[0].wr_id), (complete_at, u64::from(complete_at)))
                }
                Some(_) => assert!(polls > 1, "polled for its window: {polls}"),
                None => assert_eq!(polls, 0),
            }
        }
    }
}
