//! A completion queue on tokio's reactor, and the futures of posted work.

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tracing::debug;

use super::OpError;
use crate::cq::{Completion, CompletionQueue};
use crate::error::Result;
use crate::qp::QueuePair;

/// The CQ's fd, for tokio's reactor (which wants `AsRawFd`).
struct CqFd(CompletionQueue);

impl AsRawFd for CqFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// A [`CompletionQueue`] whose completions wake tokio tasks.
///
/// Whoever polls a future of this CQ drains it: takes every completion,
/// hands each to the future waiting for its `wr_id`, and, when its own
/// has not come, arms the CQ and sleeps on its fd. The readiness protocol
/// arm-then-look: after a drain that found nothing the CQ is armed
/// (`req_notify`, which itself reports completions that came before it)
/// and only then does the task sleep on the fd, so a completion that
/// lands between the drain and the arm is seen. There is no driver task and no extra thread: on a current-thread
/// runtime over stag's userspace provider the polling task itself makes
/// the QP's progress.
///
/// Only one task at a time sleeps on the fd (tokio keeps one reader
/// waker); when that task's future finishes or is dropped, it wakes
/// another waiting future to take over, so no future is left without
/// someone watching the CQ.
///
/// # Spinning (opt-in)
///
/// Sleeping costs a wake-up per completion: the device (on stag0, its
/// engine thread) must notice the arrival, signal the fd, and tokio's
/// reactor must wake the task, some microseconds each time, where a busy
/// poller finds the completion at once (and, on stag0, makes the QP's
/// progress on its own thread, with no engine hand-off at all).
/// [`AsyncCompletionQueue::with_spin`] trades CPU for that latency: a
/// task that finds the CQ empty yields to the runtime and looks again,
/// without arming, until the CQ has been empty for the spin time; only
/// then does it arm and sleep. The runtime stays cooperative (other
/// tasks run between looks), but its thread never idles while a spin
/// lasts: use it where a core is given to the runtime, as with busy
/// polling.
///
/// A spinning task also yields its thread (`sched_yield`) between looks,
/// because the thread that will produce the completion may be waiting for
/// this very core. Over loopback the scheduler often puts both processes of
/// a ping-pong on one core (the peer's Send wakes the sleeping side from
/// the sender's core, and the wake-up places it there), and then a spin
/// that kept the core for 20 µs before yielding made every half round trip
/// cost those 20 µs: this was the "bimodal" ~31 µs mode of session 7,
/// measured (`taskset -c 0` on both sides: 31 µs; every run in the mode
/// whenever a CPU hog held the other core). So a spin yields at every empty
/// look, which on a core of its own is one cheap syscall. The other
/// neighbour is a thread that runs until preempted (another program's
/// busy loop, a compiler): a yield to it can cost a whole time slice
/// (hundreds of microseconds to milliseconds). A yield that kept the core
/// away 200 µs or more is a slow yield ([`slow_yields`] counts them), and
/// two things follow from it:
///
/// - the spin yields less often: at most once per 25 µs, doubling at each
///   further slow yield up to 200 µs, and back to every look as yields
///   that let a short-lived thread run (3-200 µs: the peer, the engine)
///   halve the gap (`YIELD_GAP_MIN` in the source says why): the kernel's
///   scheduler (EEVDF) pushes a yielder's deadline out at each yield, and
///   a thread yielding at every look beside a `nice -n 19` busy loop lost
///   nearly all of its core to it;
/// - the time it lost is charged to the CQ's spin budget: spinning goes
///   on while the time lost to slow yields, decaying exponentially (20 ms
///   time constant), stays under 1 ms, that is while spinning loses the
///   waiter under about 5 % of the core; over it, waiters sleep at once
///   until it has decayed (`SPIN_BUDGET` in the source says what rule it
///   replaced). A single slow yield (the peer's 1 MiB copy, a neighbour's
///   turn) costs the wait it happened in and nothing more; a core taken
///   again and again (a compiler beside the runtime) keeps waiters
///   asleep, as on a contended core a spin takes the time the peer, the
///   engine or the runtime's other tasks need (the tail of tonic over
///   `RdmaStream` under load, session 9).
#[derive(Clone)]
pub struct AsyncCompletionQueue {
    pub(super) shared: Arc<Shared>,
}

impl std::fmt::Debug for AsyncCompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCompletionQueue")
            .field("cq", &self.shared.fd.get_ref().0)
            .finish_non_exhaustive()
    }
}

pub(super) struct Shared {
    fd: AsyncFd<CqFd>,
    next_id: AtomicU64,
    state: Mutex<State>,
    /// How long the CQ may be found empty before a waiter sleeps (zero:
    /// sleep at once).
    spin: Duration,
    /// The current spin, and the time slow yields lost lately.
    spin_state: Mutex<SpinState>,
}

/// A CQ's spinning waiters: since when the CQ has been empty, and the
/// spin budget's debt ([`SPIN_BUDGET`]).
#[derive(Default)]
struct SpinState {
    /// Since when every look found the CQ empty (while spinning).
    idle_since: Option<Instant>,
    /// This wait found the budget spent: it sleeps, not spinning again
    /// until a look finds completions.
    spent: bool,
    /// Time lost to slow yields, in seconds, as of `debt_at`; it decays
    /// with the time constant [`DEBT_DECAY`].
    debt: f64,
    debt_at: Option<Instant>,
    /// The least time between two yields of the spin (zero, or from
    /// [`YIELD_GAP_MIN`] to [`YIELD_GAP_MAX`]), and when the next may come.
    yield_gap: Duration,
    next_yield: Option<Instant>,
}

impl SpinState {
    /// The debt as of `now`.
    fn debt_at(&mut self, now: Instant) -> f64 {
        let Some(at) = self.debt_at else {
            return 0.0;
        };
        let age = now.saturating_duration_since(at).as_secs_f64();
        let debt = self.debt * (-age / DEBT_DECAY.as_secs_f64()).exp();
        if debt < 1e-7 {
            self.debt_at = None;
            self.debt = 0.0;
            return 0.0;
        }
        debt
    }

    /// Whether the spin yields its thread at this look (`now`).
    fn yield_due(&self, now: Instant) -> bool {
        self.next_yield.is_none_or(|at| now >= at)
    }

    /// A yield, back at `back`, kept the core away for `gone`: space the yields
    /// out after a slow one, closer after one that let a short-lived
    /// thread run (the peer's task, the engine), as they are for.
    fn yielded(&mut self, back: Instant, gone: Duration) {
        if gone >= YIELD_SLOW {
            self.charge(back, gone);
            self.yield_gap = (self.yield_gap * 2).clamp(YIELD_GAP_MIN, YIELD_GAP_MAX);
        } else if gone >= YIELD_USEFUL {
            self.yield_gap /= 2;
            if self.yield_gap < YIELD_GAP_MIN {
                self.yield_gap = Duration::ZERO;
            }
        }
        self.next_yield = (!self.yield_gap.is_zero()).then(|| back + self.yield_gap);
    }

    /// A slow yield lost `lost` at `now`.
    fn charge(&mut self, now: Instant, lost: Duration) {
        self.debt = self.debt_at(now) + lost.as_secs_f64();
        self.debt_at = Some(now);
    }
}

#[derive(Default)]
struct State {
    /// Posted work of this CQ's futures, by `wr_id`.
    slots: HashMap<u64, Slot>,
    /// The future whose waker the fd holds, if any.
    watcher: Option<u64>,
    /// Completions taken in one drain.
    scratch: Vec<Completion>,
    /// QPs that completed work with an error, and the first such status:
    /// an RC QP is in Error from then on, and work posted to it may never
    /// complete on some devices (kernel siw), so it is refused instead.
    failed: HashMap<u32, crate::cq::WcStatus>,
}

enum Slot {
    /// Posted; the waker of the task awaiting it.
    Waiting(Option<Waker>),
    /// Completed, not yet taken by its future.
    Done(Completion),
    /// Its future was dropped: the completion is thrown away on arrival.
    Abandoned,
}

/// A yield that kept the core away this long gave it to a thread that
/// runs until preempted (a time slice is milliseconds), not to a thread
/// that had a few microseconds of work, such as the peer's spinning task
/// answering a ping.
///
/// A stream's peer taking a 1 MiB message (copies of some hundred
/// microseconds) trips it too ([`slow_yields`] counts): session 10, 7
/// alternating rounds at load 2.3-2.8, rounds of `async_bench ... stream`
/// with 2-5 slow yields ran 1955-3386 MB/s, the one with none 4618 (under
/// the 50 ms hold of [`SPIN_BUDGET`]'s history). A 1 ms threshold was
/// tried (9+9 alternating rounds against this one): fewer slow yields
/// (0-2 a run against 1-5), stream/TCP 0.83 against 0.78 at load 2.4-3.0
/// but 0.86 against 0.92 at load 1.2, and rounds with none still as slow
/// as 0.57-0.67: not shown better, not taken.
const YIELD_SLOW: Duration = Duration::from_micros(200);

/// How much time lost to slow yields (decayed, [`DEBT_DECAY`]) a CQ's
/// spin may have on its account and still spin: 1 ms, about 5 % of the
/// 20 ms time constant, so spinning goes on while it loses its waiter
/// under about 5 % of the core.
///
/// Why a budget. On a core shared with a thread that runs until preempted
/// a yield often gives a time slice away: a task spinning on
/// `sched_yield` beside a `nice -n 19` busy loop on one core (6.18
/// kernel, load 9) lost the core in 883 of 68864 yields, for 421 µs
/// (median) every 0.6 ms (median gap); beside a nice 0 loop in 390 of
/// 1045, 8 ms each. Waiters must stop spinning there. But most slow
/// yields of a benchmark are single (the peer's copy of a 1 MiB message,
/// a neighbour's turn), and the rule before this one (session 9) stopped
/// spinning for 50 ms after any of them: a 5000-iteration ping-pong takes
/// about 30 ms, so one slow yield turned a round into sleeping waits
/// (session 10, async send with spin per round at load 3.3-4.8: no slow
/// yield 5.4 µs, 1-2 of them 10.1-10.2, 6 of them 21.4), and the stream's
/// rounds with 2-5 of them ran at half the rate. A 1 ms threshold (above)
/// and a hold of 2 ms doubling to 50 ms while slow yields follow (session
/// 10: stream 1990 against 2583 MB/s, tonic with spin 165 against 128 µs
/// at load 18-21) were tried before. The budget charges each slow yield
/// what it cost, so a lone one stops no spin, while a core taken every
/// few milliseconds stops spinning until the losses have decayed: under
/// a steady loss of 0.4 ms per 0.6 ms of spinning, a waiter spins about
/// 0.6 ms in every 7 ms; under 8 ms slices, about one in 50 ms.
const SPIN_BUDGET: Duration = Duration::from_millis(1);

/// A yield that kept the core away this long (and less than
/// [`YIELD_SLOW`]) let a short-lived thread run: the peer's task on this
/// core, the device's engine; the yields are worth making at every look.
const YIELD_USEFUL: Duration = Duration::from_micros(3);

/// After a slow yield, the spin yields at most once per this gap, doubling
/// at each further slow yield up to [`YIELD_GAP_MAX`] and halving at each
/// useful one ([`YIELD_USEFUL`]) down to none: on a 6.18 kernel (EEVDF) a
/// yield pushes the yielder's deadline a whole slice out, so a thread
/// yielding at every look of its spin beside a `nice -n 19` busy loop
/// lost 96 % of the core to it (the same loop that never yields lost
/// 42 %, the share the other programs on that core took; yielding every
/// 20 µs 64 %, every 100 µs 41 %).
const YIELD_GAP_MIN: Duration = Duration::from_micros(25);

/// The most time between two yields of a spin: a peer put on this core
/// waits this long at most for it.
const YIELD_GAP_MAX: Duration = Duration::from_micros(200);

/// The time constant of the spin budget's debt ([`SPIN_BUDGET`]).
const DEBT_DECAY: Duration = Duration::from_millis(20);

/// Slow yields in this process so far ([`slow_yields`]).
static SLOW_YIELDS: AtomicU64 = AtomicU64::new(0);

/// Waits that slept at once, not spinning, because the spin budget was
/// spent ([`spent_budget_waits`]).
static SPENT_BUDGET_WAITS: AtomicU64 = AtomicU64::new(0);

/// How many times, in this process, a spinning waiter's yield kept the
/// core away 200 µs or longer (a slow yield, charged to its CQ's spin
/// budget: see "Spinning" at [`AsyncCompletionQueue`]): a diagnostic for
/// benchmarks.
pub fn slow_yields() -> u64 {
    SLOW_YIELDS.load(Ordering::Relaxed)
}

/// How many waits, in this process, found their CQ's spin budget spent
/// and slept without spinning (see "Spinning" at
/// [`AsyncCompletionQueue`]): a diagnostic for benchmarks, whose rounds
/// with many such waits run at the rate of no spin.
pub fn spent_budget_waits() -> u64 {
    SPENT_BUDGET_WAITS.load(Ordering::Relaxed)
}

/// Completions taken from the CQ per round.
const DRAIN: usize = 64;

impl AsyncCompletionQueue {
    /// Put `cq` on the current tokio runtime's reactor. Must be called
    /// from inside a runtime. The CQ serves this wrapper alone from now
    /// on: a completion with no future waiting is dropped.
    /// Fails outside a runtime; the runtime needs its IO driver
    /// (`enable_io`/`enable_all`, as `#[tokio::main]` has).
    pub fn new(cq: CompletionQueue) -> Result<AsyncCompletionQueue> {
        Self::with_spin(cq, Duration::ZERO)
    }

    /// As [`new`](Self::new), with waiters that keep looking at the CQ
    /// (yielding to the runtime between looks) until it has been empty
    /// for `spin`, and only then sleep: see "Spinning" above.
    ///
    /// On stag0, measured with `scripts/bench/bench-async.sh` (8-byte send
    /// ping-pong, two processes, 2 cores): 5-7 µs a half round trip when
    /// the two processes run on two cores (as `stag lat` busy polling),
    /// about 10 µs when the scheduler puts them on one core (both pinned
    /// with `taskset -c 0`; `stag lat` busy polling costs a time slice,
    /// 4 ms, there). A spin of 1 ms works well there: the CQ of a
    /// ping-pong is never empty that long.
    #[allow(unsafe_code)]
    pub fn with_spin(cq: CompletionQueue, spin: Duration) -> Result<AsyncCompletionQueue> {
        tokio::runtime::Handle::try_current().map_err(std::io::Error::other)?;
        // SAFETY: the fd is the CQ's epoll fd, owned by the `CqInner` that
        // `CqFd` keeps alive through its `CompletionQueue` (an `Arc`): it
        // stays open, and is never replaced, while the `AsyncFd` lives;
        // `as_raw_fd` returns that same fd on every call.
        let fd = unsafe { AsyncFd::register_with_interest(CqFd(cq), Interest::READABLE) }
            .map_err(std::io::Error::from)?;
        Ok(AsyncCompletionQueue {
            shared: Arc::new(Shared {
                fd,
                next_id: AtomicU64::new(1),
                state: Mutex::new(State::default()),
                spin,
                spin_state: Mutex::new(SpinState::default()),
            }),
        })
    }

    /// The CQ underneath.
    pub fn cq(&self) -> &CompletionQueue {
        &self.shared.fd.get_ref().0
    }

    /// Take completions that are already there, without waiting: append
    /// up to `max` to `out` or, when none are waiting, arm the CQ and
    /// register `cx` to be woken when some may be. For a stream that owns
    /// the CQ and keeps its own per-`wr_id` state (mixing it with the
    /// operation futures of [`AsyncQueuePair`](super::AsyncQueuePair) on
    /// one CQ takes their completions away from them).
    pub fn poll_drain(
        &self,
        cx: &mut TaskContext<'_>,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> Poll<Result<usize>> {
        self.shared.poll_drain(cx, out, max, false, &mut false)
    }

    /// [`poll_drain`](Self::poll_drain), telling on Pending whether the
    /// task sleeps (the CQ is armed and `cx` registered on its fd), not
    /// spinning. `own_socket`: the caller sleeps on the QP's socket too,
    /// so arming need not drive the QP for input that came before it
    /// ([`CompletionQueue::req_notify_undriven`]).
    pub(super) fn poll_drain_asleep(
        &self,
        cx: &mut TaskContext<'_>,
        out: &mut Vec<Completion>,
        max: usize,
        own_socket: bool,
        asleep: &mut bool,
    ) -> Poll<Result<usize>> {
        self.shared.poll_drain(cx, out, max, own_socket, asleep)
    }

    /// The quiet look of a task that went to sleep on this CQ (its last
    /// [`poll_drain_asleep`](Self::poll_drain_asleep) armed it) and is
    /// polled again before the fd woke it (hyper polls its reads after
    /// every write): `None` when tokio saw the fd readable (look as
    /// usual); otherwise `cx` stays registered on the fd and up to `max`
    /// completions already queued are taken without driving any QP and
    /// without touching the fd: no syscall (`Some(0)`: still asleep).
    ///
    /// Nothing is missed: while the CQ is armed, a completion fires the
    /// fd; once it fired, the fd's notification is pending and tokio
    /// reports it, and the full look that follows arms again.
    pub(super) fn look_asleep(
        &self,
        cx: &mut TaskContext<'_>,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> Result<Option<usize>> {
        // The fd fired (the stream's own Sends complete as they are
        // written, and fire it): take the notification and arm again,
        // driving nothing, then take what is queued. A completion after
        // this arm fires the fd anew.
        while let Poll::Ready(guard) = self.shared.fd.poll_read_ready(cx) {
            let Ok(mut guard) = guard else {
                return Ok(None);
            };
            guard.clear_ready();
            self.cq().req_notify_undriven()?;
        }
        let n = self.cq().poll_queued(out, max)?;
        if n > 0 {
            self.shared.found();
        }
        Ok(Some(n))
    }

    /// A fresh `wr_id`, and a slot waiting for its completion. The slot
    /// exists before the work is posted, so a completion cannot outrun it.
    pub(super) fn register(&self) -> u64 {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        self.shared.lock().slots.insert(id, Slot::Waiting(None));
        id
    }

    /// The error status QP `qp_num` completed work with, if it did.
    pub(super) fn failed(&self, qp_num: u32) -> Option<crate::cq::WcStatus> {
        self.shared.lock().failed.get(&qp_num).copied()
    }

    /// The post of `id` failed: nothing will complete.
    pub(super) fn unregister(&self, id: u64) {
        self.shared.lock().slots.remove(&id);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cq(&self) -> &CompletionQueue {
        &self.fd.get_ref().0
    }

    fn poll_drain(
        &self,
        cx: &mut TaskContext<'_>,
        out: &mut Vec<Completion>,
        max: usize,
        own_socket: bool,
        asleep: &mut bool,
    ) -> Poll<Result<usize>> {
        *asleep = false;
        loop {
            let n = self.cq().poll(out, max)?;
            if n > 0 {
                self.found();
                return Poll::Ready(Ok(n));
            }
            if self.keep_spinning(cx) {
                return Poll::Pending;
            }
            if self.arm_and_sleep(cx, own_socket)?.is_pending() {
                *asleep = true;
                return Poll::Pending;
            }
        }
    }

    /// After a look that found nothing: whether to look again soon instead
    /// of sleeping (the spin time is not over); then the task is already
    /// woken, to be polled again after the runtime's other ready tasks.
    fn keep_spinning(&self, cx: &mut TaskContext<'_>) -> bool {
        if self.spin.is_zero() {
            return false;
        }
        let now = Instant::now();
        {
            let mut spin = self.spin_state();
            let since = *spin.idle_since.get_or_insert(now);
            if spin.spent || now.duration_since(since) >= self.spin {
                return false;
            }
            if spin.debt_at(now) >= SPIN_BUDGET.as_secs_f64() {
                // Yields lately gave the core away for time slices, again
                // and again: another program wants it. Spinning on would
                // keep taking it from the threads this task waits for;
                // sleep until a completion.
                spin.spent = true;
                SPENT_BUDGET_WAITS.fetch_add(1, Ordering::Relaxed);
                return false;
            }
        }
        // Let this core's other runnable threads in (see "Spinning"
        // above): the peer's spinning task when the scheduler put both on
        // this core, or the device's engine. How long the core was gone
        // says which kind of neighbour it was.
        if self.spin_state().yield_due(now) {
            std::thread::yield_now();
            let back = Instant::now();
            let gone = back.duration_since(now);
            if gone >= YIELD_SLOW {
                SLOW_YIELDS.fetch_add(1, Ordering::Relaxed);
            }
            self.spin_state().yielded(back, gone);
        }
        cx.waker().wake_by_ref();
        true
    }

    fn spin_state(&self) -> MutexGuard<'_, SpinState> {
        self.spin_state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A look found completions: the next empty look starts a new spin.
    fn found(&self) {
        if !self.spin.is_zero() {
            let mut spin = self.spin_state();
            spin.idle_since = None;
            spin.spent = false;
        }
    }

    /// After a drain that found nothing: arm the CQ and register `cx` on
    /// its fd. Pending: asleep, woken by the next completion. Ready: look
    /// again (completions came before the arm, or after it).
    ///
    /// Arming comes first, whatever tokio last saw of the fd: the fd
    /// turns readable only for completions after an arm. A readiness
    /// tokio reports now may be older than the arm (the notification it
    /// stood for was taken by the arm's acknowledgement: typically the
    /// task's own Send, completed as it was written): it is cleared, and
    /// when nothing is queued the task sleeps, with no second drive. A
    /// completion after this arm makes the fd readable again (tokio
    /// clears only the readiness the guard saw), or is queued when
    /// [`CompletionQueue::has_queued`] looks.
    ///
    /// `undriven`: arm without driving the QP (the caller sleeps on its
    /// socket as well, which tells of input that came before the arm).
    fn arm_and_sleep(&self, cx: &mut TaskContext<'_>, undriven: bool) -> Result<Poll<()>> {
        let waiting = if undriven {
            self.cq().req_notify_undriven()?
        } else {
            self.cq().req_notify()?
        };
        if waiting {
            return Ok(Poll::Ready(()));
        }
        loop {
            match self.fd.poll_read_ready(cx) {
                Poll::Pending => return Ok(Poll::Pending),
                Poll::Ready(guard) => {
                    guard?.clear_ready();
                    if self.cq().has_queued() {
                        return Ok(Poll::Ready(()));
                    }
                }
            }
        }
    }

    /// Hand every completion the CQ has to its slot, waking its task.
    fn dispatch(&self, state: &mut State) -> Result<()> {
        loop {
            let mut batch = std::mem::take(&mut state.scratch);
            let n = self.cq().poll(&mut batch, DRAIN)?;
            if n > 0 {
                self.found();
            }
            for c in batch.drain(..) {
                self.deliver(state, c);
            }
            state.scratch = batch;
            if n < DRAIN {
                return Ok(());
            }
        }
    }

    fn deliver(&self, state: &mut State, c: Completion) {
        if !c.is_ok() {
            state.failed.entry(c.qp_num).or_insert(c.status);
        }
        match state.slots.get_mut(&c.wr_id) {
            Some(slot @ Slot::Waiting(_)) => {
                if let Slot::Waiting(Some(w)) = std::mem::replace(slot, Slot::Done(c)) {
                    w.wake();
                }
            }
            Some(Slot::Abandoned) => {
                state.slots.remove(&c.wr_id);
            }
            Some(Slot::Done(_)) | None => {
                debug!(wr_id = c.wr_id, "completion no future waits for, dropped");
            }
        }
    }

    /// The future `id` is done with the CQ: when it was the one the fd
    /// would wake, hand that watch to another waiting future.
    fn hand_over(&self, state: &mut State, id: u64) {
        if state.watcher != Some(id) {
            return;
        }
        state.watcher = None;
        let next = state.slots.values().find_map(|s| match s {
            Slot::Waiting(Some(w)) => Some(w.clone()),
            _ => None,
        });
        if let Some(w) = next {
            w.wake();
        }
    }

    /// Poll the future of work request `id`.
    fn poll_op(&self, cx: &mut TaskContext<'_>, id: u64) -> Poll<Result<Completion>> {
        let mut state = self.lock();
        loop {
            if let Some(Slot::Done(_)) = state.slots.get(&id) {
                if let Some(Slot::Done(c)) = state.slots.remove(&id) {
                    self.hand_over(&mut state, id);
                    return Poll::Ready(Ok(c));
                }
            }
            self.dispatch(&mut state)?;
            match state.slots.get_mut(&id) {
                Some(Slot::Done(_)) => continue,
                Some(Slot::Waiting(w)) => match w {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => *w = Some(cx.waker().clone()),
                },
                // Only an `Op` holds `id`, and it polls no more once done.
                _ => {
                    return Poll::Ready(Err(crate::error::Error::InvalidRequest(
                        "the operation's completion was already taken",
                    )))
                }
            }
            if self.keep_spinning(cx) {
                return Poll::Pending;
            }
            if self.arm_and_sleep(cx, false)?.is_pending() {
                state.watcher = Some(id);
                return Poll::Pending;
            }
        }
    }

    /// The future of `id` was dropped before it finished.
    fn abandon(&self, id: u64) {
        let mut state = self.lock();
        match state.slots.get_mut(&id) {
            Some(Slot::Done(_)) => {
                state.slots.remove(&id);
            }
            Some(slot) => *slot = Slot::Abandoned,
            None => {}
        }
        self.hand_over(&mut state, id);
    }
}

/// The future of one posted work request: resolves to its completion, or
/// to the error that kept it from being posted or that it completed with.
///
/// Dropping it does not cancel the work: see the module's cancellation
/// rules ([`r#async`](super)).
#[must_use = "the work is posted; awaiting the future gives its completion"]
pub struct Op {
    cq: Arc<Shared>,
    state: OpState,
    /// The QP stays alive while its work may complete.
    _qp: Option<QueuePair>,
}

enum OpState {
    Posted(u64),
    Failed(OpError),
    Finished,
}

impl Op {
    pub(super) fn posted(cq: &AsyncCompletionQueue, id: u64, qp: QueuePair) -> Op {
        Op {
            cq: cq.shared.clone(),
            state: OpState::Posted(id),
            _qp: Some(qp),
        }
    }

    pub(super) fn failed(cq: &AsyncCompletionQueue, e: OpError) -> Op {
        Op {
            cq: cq.shared.clone(),
            state: OpState::Failed(e),
            _qp: None,
        }
    }

    /// The `wr_id` the work was posted with (`None` when the post failed).
    pub fn wr_id(&self) -> Option<u64> {
        match self.state {
            OpState::Posted(id) => Some(id),
            _ => None,
        }
    }
}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Op").field("wr_id", &self.wr_id()).finish()
    }
}

impl Future for Op {
    type Output = std::result::Result<Completion, OpError>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let id = match std::mem::replace(&mut this.state, OpState::Finished) {
            OpState::Posted(id) => id,
            OpState::Failed(e) => return Poll::Ready(Err(e)),
            OpState::Finished => return Poll::Ready(Err(OpError::Finished)),
        };
        match this.cq.poll_op(cx, id) {
            Poll::Pending => {
                this.state = OpState::Posted(id);
                Poll::Pending
            }
            Poll::Ready(Err(e)) => {
                // The CQ itself failed: the work may still run, so its
                // slot stays (abandoned) until it completes.
                this.cq.abandon(id);
                Poll::Ready(Err(OpError::Verbs(e)))
            }
            Poll::Ready(Ok(c)) if c.is_ok() => Poll::Ready(Ok(c)),
            Poll::Ready(Ok(c)) => Poll::Ready(Err(OpError::Failed(c))),
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if let OpState::Posted(id) = self.state {
            self.cq.abandon(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spendable(s: &mut SpinState, at: Instant) -> bool {
        s.debt_at(at) < SPIN_BUDGET.as_secs_f64()
    }

    #[test]
    fn a_lone_slow_yield_leaves_the_budget_unspent() {
        let t0 = Instant::now();
        let mut s = SpinState::default();
        assert!(spendable(&mut s, t0));
        s.charge(t0, Duration::from_micros(500));
        assert!(spendable(&mut s, t0));
    }

    #[test]
    fn slow_yields_in_a_row_spend_the_budget_until_it_decays() {
        let t0 = Instant::now();
        let mut s = SpinState::default();
        // Three 400 µs losses 0.6 ms apart: 1.2 ms, less some decay.
        for k in 0..3 {
            s.charge(
                t0 + Duration::from_micros(600 * k),
                Duration::from_micros(400),
            );
        }
        let last = t0 + Duration::from_micros(1200);
        assert!(!spendable(&mut s, last));
        // e^(-t/20 ms) takes ~1.17 ms under 1 ms in ~3 ms, not in 1 ms.
        assert!(!spendable(&mut s, last + Duration::from_millis(1)));
        assert!(spendable(&mut s, last + Duration::from_millis(4)));
        // Long decayed: back to nothing.
        assert_eq!(s.debt_at(last + Duration::from_secs(2)), 0.0);
        assert!(s.debt_at.is_none());
    }

    #[test]
    fn slow_yields_space_the_yields_out_and_useful_ones_close_them_up() {
        let t0 = Instant::now();
        let mut s = SpinState::default();
        assert!(s.yield_due(t0));
        // A fast yield (nothing else ran) changes nothing.
        s.yielded(t0, Duration::from_nanos(500));
        assert!(s.yield_due(t0));
        let slow = Duration::from_micros(300);
        s.yielded(t0, slow);
        assert_eq!(s.yield_gap, YIELD_GAP_MIN);
        assert!(!s.yield_due(t0 + YIELD_GAP_MIN / 2));
        assert!(s.yield_due(t0 + YIELD_GAP_MIN));
        for _ in 0..10 {
            s.yielded(t0, slow);
        }
        assert_eq!(s.yield_gap, YIELD_GAP_MAX);
        // Useful yields halve the gap, then drop it: a yield at every look.
        let useful = Duration::from_micros(20);
        s.yielded(t0, useful);
        assert_eq!(s.yield_gap, YIELD_GAP_MAX / 2);
        for _ in 0..10 {
            s.yielded(t0, useful);
        }
        assert_eq!(s.yield_gap, Duration::ZERO);
        assert!(s.yield_due(t0));
    }

    #[test]
    fn one_time_slice_lost_holds_spinning_for_tens_of_milliseconds() {
        let t0 = Instant::now();
        let mut s = SpinState::default();
        s.charge(t0, Duration::from_millis(8));
        // 8 ms decays to 1 ms in 20 ms * ln 8 = 41.6 ms.
        assert!(!spendable(&mut s, t0 + Duration::from_millis(40)));
        assert!(spendable(&mut s, t0 + Duration::from_millis(43)));
    }
}
