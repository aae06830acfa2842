//! The device's progress engine: one thread per device that drives the
//! connected QPs no application thread is driving, so responder work (Read
//! Responses, atomics, Commits, placement of inbound Writes) goes on while
//! the application does something else — a hardware RNIC's responder never
//! waits for the host.
//!
//! # Glossary
//!
//! One vocabulary for "run a QP's I/O", used across the provider, `verbs`
//! and the rdma-core plugin:
//!
//! - **drive** (internal, once): take the QP's lock and run its I/O one
//!   time: write what is framed, read and process what the socket has
//!   (bounded, so one QP cannot starve the others), write the answers,
//!   deliver completions and events (`QpShared::drive`). Whoever holds
//!   the lock drives; the byte stream stays in order whoever that is.
//! - **ring** (the doorbell): a write-only drive from the posting thread,
//!   once per post list (`device::PostGuard::post`). Input is left to
//!   whoever polls.
//! - **progress** (the public verb): drive from the calling thread on the
//!   application's behalf: `QueuePair::progress`, `try_progress` (unless
//!   another thread is driving), and every CQ poll or wait, which
//!   progresses the CQ's QPs.
//! - **progress mode** ([`Progress`]: `Busy`, `Adaptive`, `Blocking`):
//!   how the engine waits for input on the QPs it owns, and whether a
//!   thread waiting on a CQ sleeps on the sockets itself (`Blocking`).
//! - **owner**: who is expected to drive a QP (`Ownership`): the
//!   engine (the socket armed in its epoll set) or an application thread
//!   (it polled a CQ with no notification armed).
//! - **park**: the engine finds input on a QP an application thread owns
//!   (or, polling, finds the thread driving it): it disarms the socket
//!   (a busy engine that found the thread driving it takes the socket
//!   out of its epoll set, and so does any engine once a park has lasted
//!   a recheck period) and looks again every [`PARK_RECHECK`],
//!   taking the QP back once the application stops driving it
//!   (`Device::engine_parks` counts the parks on an arrival,
//!   `Device::engine_idle_parks` the others).
//! - **release**: an application thread hands its QPs back to the engine
//!   at once (arming a CQ's notification, `QueuePair::release_to_engine`).
//! - **wait**: a thread asleep on a CQ polls the QPs' sockets itself; the
//!   sockets leave the engine's epoll set until it wakes.
//! - **hold**: a thread woken in a completion channel wait keeps the
//!   sockets out of the engine's set for its next wait; the engine takes
//!   them back at its next recheck unless a thread sleeps on them again
//!   (`Engine::hold`). A wait woken often for nothing of its own (it only
//!   answers the peer) hands its sockets back to a polling engine instead
//!   (`Engine::polls_after_traffic`).
//!
//! Two policies of a thread that polls a CQ (`Device::poll_cq`, which
//! the rdma-core plugin's `poll_cq` calls), in these words, over the device's one QP registry
//! (`registry.rs`): the **sweep** is a poll that finds its CQ empty
//! progressing (with `try_progress`) the device's QPs whose CQs nobody
//! polls, so that thread owns them and the engine parks them; the
//! **assist** (`assist.rs`) is a poll that reaps an RDMA Write's completion
//! progressing that QP for a short adaptive window until the peer's answer
//! is read, and releasing it to the engine when the window finds none.
//!
//! How the engine waits for input is the device's [`Progress`] mode: it
//! polls (`Busy`), polls for a while after traffic and then sleeps in
//! `epoll_wait` (`Adaptive`, the default), or always sleeps (`Blocking`).
//! A request that reaches a polling engine is answered at once; one that
//! reaches a sleeping engine first pays a thread wake-up.
//!
//! Application threads drive QPs too: a post writes its request from the
//! posting thread, polling an empty CQ reads the sockets from the polling
//! thread, and a thread in `CompletionQueue::wait` (`Blocking` mode) or
//! `CompletionQueue::wait_notified` (the plugin's `ibv_get_cq_event`)
//! sleeps in `poll(2)` on the sockets itself (one wake-up per completion,
//! as on a plain socket). While it sleeps there the socket is out of the
//! engine's epoll set, and it goes back in when the thread wakes: the
//! arrival wakes one thread, and no timer is involved. A wait (a channel
//! wait, or `CompletionQueue::wait`) on a QP whose input is due (a Read
//! at the ORD limit with more posted behind it, or a message part-way in)
//! polls that QP for the adaptive window first: the input is coming, and
//! a sleep would put a wake-up on its path.
//!
//! The engine and a spinning application thread must not fight over a
//! socket either: on two cores an engine woken for every message that a
//! spinning application thread then finds already handled costs a wake-up
//! and a context switch per message. So when an event fires while an
//! application thread is driving that QP (it polled a CQ with no
//! notification armed since the engine last looked), the engine disarms
//! the socket in its epoll set ("parks" it; a busy engine also parks,
//! every `SCAN_EVERY` (100 µs), the QPs it finds driven, without waiting for an
//! arrival to catch, and takes their sockets out of the set) and looks again every
//! [`PARK_RECHECK`]; once the application has stopped driving it, the
//! engine drives the QP and re-arms. That recheck is the one timer left:
//! it matters only to a program that polls a CQ unarmed and then stops
//! without arming or waiting, or that leaves a completion channel wait
//! and does not come back to the provider (a held QP). While the engine owns a QP its socket stays
//! armed, level-triggered: no `epoll_ctl` per message. An application
//! that arms a CQ's notifications or sleeps on the CQ in the polling modes
//! hands its QPs back at once (`Ownership::release`), and a poll of an
//! armed CQ does not take them back.

use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::thread::SpawnMasked;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::{debug, warn};

/// The environment variable that picks the progress mode of devices opened
/// without an explicit one (`busy`, `adaptive`, `adaptive:<µs>`,
/// `blocking`).
pub const PROGRESS_ENV: &str = "STAG_PROGRESS";

/// How long an adaptive engine polls after traffic by default: a few
/// round trips on loopback, so that back-to-back requests never meet a
/// sleeping responder, and short enough that an idle device costs nothing.
pub const DEFAULT_ADAPTIVE_SPIN: Duration = Duration::from_micros(200);

/// How often the engine looks at the QPs it left to application threads
/// (the longest an inbound request waits when the application stops
/// driving its QP without arming notifications or waiting on the CQ).
pub const PARK_RECHECK: Duration = Duration::from_millis(1);

/// Nanoseconds since the first call (a monotonic stamp that fits an
/// atomic).
pub(crate) fn mono_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    epoch.elapsed().as_nanos() as u64
}

/// How often a busy engine that found nothing looks for the QPs an
/// application thread drives, to park them without waiting for an
/// arrival to race that thread for ([`Run::park_app_driven`]). Not an
/// adaptive one: its window opens only on traffic it handled itself, and
/// a park there would cost a program on a completion channel, which
/// polls its CQ unarmed between an event and its next arm, a recheck
/// wake-up at the arm.
const SCAN_EVERY: Duration = Duration::from_micros(100);

/// How many passes of a busy engine that drives one QP read its socket
/// directly ([`Run::poll_sole`]) between two `epoll_wait(0)`s, which see
/// the other sockets, hang-ups and the wake-up eventfd: at most this many
/// passes (a few microseconds) late.
const SOLE_POLLS: u32 = 8;

/// The epoll token of the engine's wake-up eventfd.
const WAKE_TOKEN: u64 = u64::MAX;

/// How a device's engine waits for input on the QPs it drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Poll without sleeping while it drives any QP: the lowest latency,
    /// at the cost of one core per device whenever a QP is connected.
    Busy,
    /// Poll for `spin` after each burst of traffic, then sleep. The poll
    /// window shrinks (down to none) when the engine finds itself
    /// preempted while polling — a sign that its core is needed by other
    /// threads, as on a 2-core machine where the application spins too —
    /// and grows back when polling is uncontended.
    Adaptive {
        /// The longest poll window.
        spin: Duration,
    },
    /// Always sleep in `epoll_wait`: no CPU when idle, a thread wake-up per
    /// request the engine answers. Threads waiting on a CQ sleep on its
    /// QPs' sockets themselves.
    Blocking,
}

impl Default for Progress {
    /// Adaptive: it answers at polling speed under load on a many-core
    /// server, backs off where polling would steal the application's core,
    /// and sleeps when idle.
    fn default() -> Self {
        Progress::Adaptive {
            spin: DEFAULT_ADAPTIVE_SPIN,
        }
    }
}

impl Progress {
    /// The mode `$STAG_PROGRESS` names, or the default when it is unset.
    /// A value that does not parse is logged and ignored.
    pub fn from_env() -> Progress {
        match std::env::var(PROGRESS_ENV) {
            Ok(v) if !v.is_empty() => v.parse().unwrap_or_else(|e| {
                warn!(value = %v, error = %e, "ignoring {PROGRESS_ENV}");
                Progress::default()
            }),
            _ => Progress::default(),
        }
    }

    /// Whether threads waiting on a CQ sleep on its QPs' sockets (and so
    /// drive them) rather than leaving them to the engine.
    pub fn waiters_take_sockets(self) -> bool {
        self == Progress::Blocking
    }
}

/// A progress mode that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown progress mode {0:?} (expected busy, adaptive, adaptive:<µs> or blocking)")]
pub struct ParseProgressError(String);

impl FromStr for Progress {
    type Err = ParseProgressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ParseProgressError(s.to_owned());
        match s.trim().to_ascii_lowercase().as_str() {
            "busy" | "poll" => Ok(Progress::Busy),
            "blocking" | "block" => Ok(Progress::Blocking),
            "adaptive" => Ok(Progress::default()),
            other => {
                let us = other.strip_prefix("adaptive:").ok_or_else(bad)?;
                let us: u64 = us.trim_end_matches("us").parse().map_err(|_| bad())?;
                Ok(Progress::Adaptive {
                    spin: Duration::from_micros(us),
                })
            }
        }
    }
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Progress::Busy => f.write_str("busy"),
            Progress::Blocking => f.write_str("blocking"),
            Progress::Adaptive { spin } if *spin == DEFAULT_ADAPTIVE_SPIN => {
                f.write_str("adaptive")
            }
            Progress::Adaptive { spin } => write!(f, "adaptive:{}", spin.as_micros()),
        }
    }
}

/// Who drives a QP right now: the bookkeeping its application threads and
/// the engine share (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Ownership {
    /// Bumped each time an application thread drives the QP.
    app_polls: AtomicU64,
    /// Application threads asleep in `poll(2)` on this QP's socket.
    app_waiters: AtomicU32,
    /// The application handed the QP to the engine.
    released: AtomicBool,
    /// Engine only: `app_polls` when the engine last looked.
    engine_seen: AtomicU64,
    /// Engine only: in the engine's parked list.
    parked: AtomicBool,
    /// Engine only: parked with the socket out of the epoll set
    /// ([`park_out`]) rather than disarmed in it, until the take-back.
    out_of_set: AtomicBool,
    /// A thread's wait on the socket ended and the socket stayed out of
    /// the engine's set for that thread's next wait: in the engine's
    /// held list until its recheck ([`Engine::hold`]).
    held: AtomicBool,
    /// When a thread's wait on the socket last ended ([`mono_ns`]): a
    /// held QP whose thread keeps coming back stays held, without the
    /// engine taking the lock that thread wants ([`Ownership::hold_until`]).
    wait_ended: AtomicU64,
    /// The socket's epoll registration is armed. Set by the driver (under
    /// its QP's lock, so the flags match its state); cleared by the engine
    /// when it parks the QP.
    pub(crate) armed: AtomicBool,
}

impl Ownership {
    /// An application thread is driving this QP: the engine keeps off.
    pub(crate) fn note_app(&self) {
        // A load and a store, as `PollMark::bump`: the engine asks only
        // whether the count moved since it looked.
        let polls = self.app_polls.load(Ordering::Relaxed);
        self.app_polls
            .store(polls.wrapping_add(1), Ordering::Relaxed);
        if self.released.load(Ordering::Relaxed) {
            self.released.store(false, Ordering::Relaxed);
        }
    }

    /// Engine only: whether an application thread drove the QP since the
    /// engine last looked (and did not hand it back). A thread asleep on
    /// the socket does not count: it took the socket out of the engine's
    /// set itself and gives it back when it wakes.
    fn app_active(&self) -> bool {
        let polls = self.app_polls.load(Ordering::Relaxed);
        let seen = self.engine_seen.swap(polls, Ordering::Relaxed);
        polls != seen && !self.released.load(Ordering::Relaxed)
    }

    /// Engine only: [`app_active`](Self::app_active) without taking
    /// the look, for a check that leaves the decision to the next event.
    fn app_drove_unseen(&self) -> bool {
        self.app_polls.load(Ordering::Relaxed) != self.engine_seen.load(Ordering::Relaxed)
            && !self.released.load(Ordering::Relaxed)
    }

    /// The engine takes a parked QP back (under the QP's io lock): whether
    /// to re-arm its socket now, which waits for the last thread asleep on
    /// it to wake ([`end_wait`](Self::end_wait) re-arms it then).
    pub(crate) fn unpark(&self) -> bool {
        self.out_of_set.store(false, Ordering::Relaxed);
        self.parked.store(false, Ordering::SeqCst);
        !self.waited_on()
    }

    /// An application thread starts sleeping on the socket (counted
    /// before it takes the QP's io lock, which it skips when the socket
    /// is [`kept_quiet`](Self::kept_quiet)): whether it is the first, which takes the socket
    /// out of the engine's epoll set so that an arrival wakes the waiter
    /// alone.
    pub(crate) fn begin_wait(&self) -> bool {
        self.app_waiters.fetch_add(1, Ordering::SeqCst) == 0
    }

    /// An application thread stops sleeping on the socket (under the
    /// QP's io lock): whether it was the last and the engine should watch
    /// the socket again at once (it is not parked for a polling thread).
    pub(crate) fn end_wait(&self) -> bool {
        self.app_waiters.fetch_sub(1, Ordering::SeqCst) == 1 && !self.parked.load(Ordering::SeqCst)
    }

    /// The last application thread sleeping on the socket stops, and it
    /// keeps the socket for its next wait (without the QP's io lock):
    /// whether the QP must join the engine's held list (it is neither
    /// parked nor held already, and nobody else sleeps on it).
    pub(crate) fn end_wait_holding(&self) -> bool {
        self.wait_ended.store(mono_ns(), Ordering::Relaxed);
        self.app_waiters.fetch_sub(1, Ordering::SeqCst) == 1
            && !self.parked.load(Ordering::SeqCst)
            && !self.held.swap(true, Ordering::SeqCst)
    }

    /// Whether the socket is held for a waiter and out of the engine's
    /// epoll set: a thread starting a wait (counted already by
    /// [`begin_wait`](Self::begin_wait)) then has no flag to change. The
    /// engine clears `held` before it looks for waiters, under the QP's
    /// lock, so it cannot re-arm the socket once this saw `held`.
    pub(crate) fn kept_quiet(&self) -> bool {
        self.held.load(Ordering::SeqCst) && !self.armed.load(Ordering::SeqCst)
    }

    /// The engine's recheck of a held QP, before it takes the QP's lock:
    /// the time of the next recheck while a thread sleeps on the socket,
    /// or its last wait ended less than [`PARK_RECHECK`] ago (an event
    /// loop that comes back to the socket; the QP stays held, and the
    /// thread's next wait costs the engine no wake-up and no lock). `None`:
    /// take it back now ([`unhold`](Self::unhold), under the lock).
    pub(crate) fn hold_until(&self, now: Instant) -> Option<Instant> {
        if self.waited_on() {
            return Some(now + PARK_RECHECK);
        }
        let ended = self.wait_ended.load(Ordering::Relaxed);
        let since = Duration::from_nanos(mono_ns().saturating_sub(ended));
        (since < PARK_RECHECK).then(|| now + (PARK_RECHECK - since))
    }

    /// The engine takes a held QP back (under the QP's io lock): whether
    /// to re-arm its socket now (nobody sleeps on it and it is not
    /// parked for a polling thread).
    pub(crate) fn unhold(&self) -> bool {
        self.held.store(false, Ordering::SeqCst);
        !self.waited_on() && !self.parked.load(Ordering::SeqCst)
    }

    /// Whether a thread's channel wait keeps the socket: it sleeps on it,
    /// or held it when its last wait ended (and the engine has not taken
    /// it back).
    pub(crate) fn kept_by_waiter(&self) -> bool {
        self.held.load(Ordering::SeqCst) || self.waited_on()
    }

    /// Whether an application thread sleeps on the socket (and drives
    /// the QP when it wakes).
    fn waited_on(&self) -> bool {
        self.app_waiters.load(Ordering::SeqCst) > 0
    }

    /// Hand the QP to the engine now (the application is going to sleep
    /// on a CQ or a completion channel); wakes the engine if it had parked
    /// the QP.
    pub(crate) fn release(&self, engine: Option<&Engine>) {
        self.released.store(true, Ordering::Relaxed);
        if self.parked.load(Ordering::Relaxed) {
            if let Some(engine) = engine {
                engine.kick();
            }
        }
    }
}

/// What the engine needs of a QP's driver.
pub(crate) trait EngineQp: Send + Sync {
    /// The QP's ownership bookkeeping.
    fn ownership(&self) -> &Ownership;
    /// The QP's socket, while it has one.
    fn fd(&self) -> Option<BorrowedFd<'_>>;
    /// Read, process and write what is due, from the engine thread; then,
    /// if `rearm` (the QP was parked), take it back
    /// ([`Ownership::unpark`]) and re-arm the socket.
    fn engine_drive(&self, rearm: bool);
    /// A polling engine's poll of the one QP it drives
    /// ([`Run::poll_sole`]): drive it (a read of its socket, which an idle
    /// QP answers with `EAGAIN`) unless another thread drives it now;
    /// whether the drive read input. `None`: its socket waits for
    /// something other than input (closed, input blocked on a Receive,
    /// output blocked on room), which only its epoll events tell.
    fn engine_poll(&self) -> Option<bool>;
    /// Under the QP's io lock, while the socket is armed (no thread
    /// asleep on it, not parked) and the QP open: take the socket out of
    /// the epoll set for a busy engine's direct polls (`watched` false;
    /// whether it did, which it skips if another thread holds the lock),
    /// or put it back armed for the QP's state (`watched` true).
    fn engine_watch(&self, watched: bool) -> bool;
    /// Take a held QP back ([`Engine::hold`]): drive it and re-arm its
    /// socket unless a thread sleeps on it again ([`Ownership::unhold`]).
    /// `Some(at)`: the QP stays held until a recheck at `at` (its thread
    /// still uses it: [`Ownership::hold_until`]).
    fn engine_unhold(&self) -> Option<Instant>;
}

/// How many times the engine parked a QP, on an arrival or found idle.
#[derive(Debug, Default)]
struct ParkCounts {
    on_arrival: AtomicU64,
    idle: AtomicU64,
}

/// The registered QPs, by epoll token.
type QpMap = Mutex<HashMap<u64, Weak<dyn EngineQp>>>;

/// QPs to drive at a time of their choosing ([`Engine::drive_at`]).
type Timers = Mutex<Vec<(Instant, Weak<dyn EngineQp>)>>;

/// QPs handed to the engine by [`Engine::hold`], and whether the engine
/// knows it has held QPs to look at (else the next hold wakes it).
type Held = Mutex<(Vec<Weak<dyn EngineQp>>, bool)>;

/// The per-device progress engine.
pub(crate) struct Engine {
    progress: Progress,
    epoll: Arc<Epoll>,
    wake: Arc<EventFd>,
    qps: Arc<QpMap>,
    timers: Arc<Timers>,
    held: Arc<Held>,
    /// QPs registered (armed or parked).
    registered: Arc<AtomicUsize>,
    /// QPs the engine left to an application thread (parks).
    parks: Arc<ParkCounts>,
    /// Whether the engine polls after traffic now ([`Spinner::would_poll`]).
    polls: Arc<AtomicBool>,
    /// Tails the QPs' doorbells held back ([`crate::tail`]).
    tails_held: AtomicU64,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("progress", &self.progress)
            .field("registered", &self.registered.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Start the engine thread of device `name`.
    pub(crate) fn start(name: &str, progress: Progress) -> nix::Result<Engine> {
        let epoll = Arc::new(Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?);
        let wake = Arc::new(EventFd::from_value_and_flags(
            0,
            EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC,
        )?);
        epoll.add(
            wake.as_fd(),
            EpollEvent::new(EpollFlags::EPOLLIN, WAKE_TOKEN),
        )?;
        let qps: Arc<QpMap> = Arc::default();
        let timers: Arc<Timers> = Arc::default();
        let held: Arc<Held> = Arc::default();
        let registered = Arc::new(AtomicUsize::new(0));
        let parks = Arc::new(ParkCounts::default());
        let spinner = Spinner::new(progress);
        let polls = Arc::new(AtomicBool::new(spinner.would_poll()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let run = Run {
                epoll: epoll.clone(),
                wake: wake.clone(),
                qps: qps.clone(),
                timers: timers.clone(),
                held: held.clone(),
                holds: Vec::new(),
                registered: registered.clone(),
                parks: parks.clone(),
                polls: polls.clone(),
                stop: stop.clone(),
                spinner,
                parked: Vec::new(),
                last_check: Instant::now(),
                last_scan: Instant::now(),
                sole: None,
                sole_out: false,
                sole_polls: 0,
            };
            let thread_name = format!("{name}-engine");
            std::thread::Builder::new()
                .name(thread_name.clone())
                .spawn_masked(move || crate::fatal::run_guarded(&thread_name, || run.run()))
                .map_err(|e| {
                    nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::EAGAIN))
                })?
        };
        Ok(Engine {
            progress,
            epoll,
            wake,
            qps,
            timers,
            held,
            registered,
            parks,
            polls,
            tails_held: AtomicU64::new(0),
            stop,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The engine's progress mode.
    pub(crate) fn progress(&self) -> Progress {
        self.progress
    }

    /// Whether a request reaching a QP the engine drives is answered
    /// without a wake-up: the engine polls after traffic (busy, or an
    /// adaptive window that contention has not closed).
    pub(crate) fn polls_after_traffic(&self) -> bool {
        self.polls.load(Ordering::Relaxed)
    }

    /// A QP's doorbell held its output's tail back ([`crate::tail`]).
    pub(crate) fn note_tail_held(&self) {
        self.tails_held.fetch_add(1, Ordering::Relaxed);
    }

    /// How many tails the QPs' doorbells held back.
    pub(crate) fn tails_held(&self) -> u64 {
        self.tails_held.load(Ordering::Relaxed)
    }

    /// How many times an arrival found an application thread driving its
    /// QP, so that the engine left it alone (parked the QP).
    pub(crate) fn parks(&self) -> u64 {
        self.parks.on_arrival.load(Ordering::Relaxed)
    }

    /// How many times a polling engine found an application thread
    /// driving a QP, with no arrival, and parked it.
    pub(crate) fn idle_parks(&self) -> u64 {
        self.parks.idle.load(Ordering::Relaxed)
    }

    /// Start watching a connected QP's socket under `token`, armed.
    pub(crate) fn register(
        &self,
        token: u64,
        qp: Weak<dyn EngineQp>,
        own: &Ownership,
        sock: BorrowedFd<'_>,
    ) -> nix::Result<()> {
        self.qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, qp);
        own.armed.store(true, Ordering::Relaxed);
        self.epoll
            .add(sock, EpollEvent::new(Self::flags(false), token))?;
        self.registered.fetch_add(1, Ordering::Relaxed);
        // A sleeping engine must learn that it has a QP to poll.
        self.kick();
        Ok(())
    }

    fn flags(write: bool) -> EpollFlags {
        let mut flags = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
        if write {
            flags |= EpollFlags::EPOLLOUT;
        }
        flags
    }

    /// (Re-)arm a QP's socket for `input`, with writability if `write`.
    /// Called with the QP's io lock held, so the flags match its state.
    pub(crate) fn arm(&self, token: u64, sock: BorrowedFd<'_>, input: Input, write: bool) {
        let mut flags = match input {
            Input::Read => Self::flags(false),
            // The peer's close still wakes: the driver then reads to the
            // end of the stream.
            Input::CloseOnly => EpollFlags::EPOLLRDHUP,
            Input::Nothing => EpollFlags::empty(),
        };
        if write {
            flags |= EpollFlags::EPOLLOUT;
        }
        rearm(&self.epoll, sock, EpollEvent::new(flags, token));
    }

    /// Take a QP's socket out of the epoll set altogether: a busy engine
    /// polls it directly ([`EngineQp::engine_watch`]). Called with the QP's
    /// io lock held; [`arm`](Self::arm) adds it back.
    pub(crate) fn unwatch(&self, token: u64, sock: BorrowedFd<'_>) {
        park_out(&self.epoll, token, sock);
    }

    /// Take a QP's socket out of the epoll set (an application thread
    /// sleeps on it). Called with the QP's io lock held.
    pub(crate) fn disarm(&self, token: u64, sock: BorrowedFd<'_>) {
        disarm(&self.epoll, token, sock);
    }

    /// Drive `qp` from the engine thread once `at` has come (a deadline of
    /// the QP's own: a held message's [`HOLD_LIMIT`](crate::qp::HOLD_LIMIT)),
    /// whoever else drives it meanwhile.
    pub(crate) fn drive_at(&self, at: Instant, qp: Weak<dyn EngineQp>) {
        self.timers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((at, qp));
        // A sleeping engine must shorten its sleep.
        self.kick();
    }

    /// A thread's wait on `qp`'s socket ended and the socket stays out of
    /// the epoll set ([`Ownership::end_wait_holding`]): the thread is
    /// about to take the completion it woke for and, in an event loop,
    /// to sleep on the socket again. An arrival in between would
    /// otherwise wake the engine, which would race that thread for the
    /// QP's lock and hand the completion over through the channel's pipe:
    /// two more wake-ups per message than the thread reading it itself.
    /// The engine takes the QP back at its next recheck, within
    /// [`PARK_RECHECK`] (the longest an inbound request waits when the
    /// thread does not come back), unless a thread sleeps on it again.
    /// At most one wake-up of the engine per recheck period.
    pub(crate) fn hold(&self, qp: Weak<dyn EngineQp>) {
        let kick = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            held.0.push(qp);
            !std::mem::replace(&mut held.1, true)
        };
        if kick {
            self.kick();
        }
    }

    /// Make the engine look at its parked QPs now.
    pub(crate) fn kick(&self) {
        let _ = self.wake.write(1);
    }

    /// Stop watching a QP's socket.
    pub(crate) fn deregister(&self, token: u64, sock: BorrowedFd<'_>) {
        let _ = self.epoll.delete(sock);
        if self
            .qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&token)
            .is_some()
        {
            self.registered.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            // The engine thread itself may hold the last reference (a QP it
            // drives upgrades its weak one while the application drops the
            // device): it cannot join itself, and it stops at its next
            // look at `stop`.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// The adaptive poll window (and the fixed policies of the other modes).
#[derive(Debug)]
struct Spinner {
    progress: Progress,
    /// Adaptive: the current window, between zero and the mode's `spin`.
    budget: Duration,
    /// Adaptive: the end of the window in progress.
    until: Option<Instant>,
    /// Adaptive: this thread's involuntary context switches when the
    /// window opened.
    preempted_at_open: i64,
    /// Reads the engine thread's involuntary context switches (replaced
    /// in tests).
    switches: fn() -> i64,
    /// Whether more threads are runnable than there are cores (replaced
    /// in tests).
    contended: fn() -> bool,
    /// The last eight looks at the run queue, newest in bit 0 (set: the
    /// cores were taken).
    looks: u8,
    /// Adaptive: polls since contention was last looked at.
    polls: u32,
    /// When the run queue was last read, and how far apart two reads must
    /// be ([`LOOK_EVERY`]; zero in tests).
    looked_at: Option<Instant>,
    look_every: Duration,
}

/// The least time between two reads of `/proc/loadavg`. Each wake-up of a
/// busy engine opens a window and looks: at 1024 QPs the reads (a
/// `pread64`, a few microseconds) were 3 % of the server. A look sooner
/// than this keeps the verdict of the last eight, adding none: eight looks
/// within one instant would make one passing thread count eight times.
const LOOK_EVERY: Duration = Duration::from_millis(1);

/// How many polls of a window pass between two looks at the run queue
/// (a look reads `/proc/loadavg`, a few microseconds).
const CONTENTION_EVERY: u32 = 256;

/// How many of the last eight looks must find the cores taken before the
/// engine stops polling. A single look often catches a thread that is
/// runnable for a moment (about a quarter of the looks while two
/// processes ping-pong on two cores); an application spinning beside the
/// engine shows in nearly every look.
const CONTENDED_LOOKS: u32 = 6;

impl Spinner {
    fn new(progress: Progress) -> Spinner {
        let budget = match progress {
            Progress::Adaptive { spin } => spin,
            _ => Duration::ZERO,
        };
        Spinner {
            progress,
            budget,
            until: None,
            preempted_at_open: 0,
            switches: involuntary_switches,
            contended: cores_contended,
            looks: 0,
            polls: 0,
            looked_at: None,
            look_every: LOOK_EVERY,
        }
    }

    /// Whether traffic opens a poll window now that catches the next
    /// request of a stream: busy, or adaptive with at least half its
    /// window left (preemption shrinks it: the core is wanted) and the
    /// cores not taken by most recent looks.
    fn would_poll(&self) -> bool {
        match self.progress {
            Progress::Busy => true,
            Progress::Blocking => false,
            Progress::Adaptive { spin } => {
                self.budget >= spin / 2 && self.looks.count_ones() < CONTENDED_LOOKS
            }
        }
    }

    /// Whether to poll (rather than sleep) now, given whether the engine
    /// drives any QP.
    fn polling(&mut self, owns_qps: bool, now: Instant) -> bool {
        if !owns_qps {
            self.close();
            return false;
        }
        match self.progress {
            Progress::Busy => true,
            Progress::Blocking => false,
            Progress::Adaptive { .. } => match self.until {
                Some(until) if now < until => {
                    self.polls += 1;
                    if self.polls >= CONTENTION_EVERY {
                        self.polls = 0;
                        if self.look_contended(now) {
                            // Someone waits for a core this loop holds.
                            self.until = None;
                            return false;
                        }
                    }
                    true
                }
                Some(_) => {
                    self.close();
                    false
                }
                None => false,
            },
        }
    }

    /// The engine handled traffic: (re)open the poll window.
    fn traffic(&mut self, now: Instant) {
        let Progress::Adaptive { spin } = self.progress else {
            return;
        };
        if self.until.is_none() {
            if self.budget.is_zero() {
                // Probe again now and then: the contention may be gone.
                self.budget = (spin / 16).max(Duration::from_micros(1));
                return;
            }
            // A polling engine on a full machine holds a core that a
            // runnable thread (the application, its peer) is waiting for:
            // every request would then wait for the window to end.
            if self.look_contended(now) {
                return;
            }
            self.polls = 0;
            self.preempted_at_open = (self.switches)();
        }
        self.until = Some(now + self.budget);
    }

    /// Look at the run queue: whether the cores are taken, by most of the
    /// recent looks ([`CONTENDED_LOOKS`]). Reads it at most once per
    /// `look_every`.
    fn look_contended(&mut self, now: Instant) -> bool {
        let fresh = self
            .looked_at
            .is_none_or(|at| now.saturating_duration_since(at) >= self.look_every);
        if fresh {
            self.looked_at = Some(now);
            self.looks = (self.looks << 1) | u8::from((self.contended)());
        }
        self.looks.count_ones() >= CONTENDED_LOOKS
    }

    /// The window ends: shrink it if the engine was preempted while
    /// polling (its core is wanted elsewhere), grow it back otherwise.
    fn close(&mut self) {
        let Progress::Adaptive { spin } = self.progress else {
            return;
        };
        if self.until.take().is_none() {
            return;
        }
        if (self.switches)() > self.preempted_at_open {
            self.budget /= 2;
            if self.budget < Duration::from_micros(2) {
                self.budget = Duration::ZERO;
            }
        } else {
            self.budget = (self.budget * 2).min(spin);
        }
    }
}

/// This thread's involuntary context switches so far.
fn involuntary_switches() -> i64 {
    nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_THREAD)
        .map(|u| u.involuntary_context_switches())
        .unwrap_or(0)
}

/// Whether the machine has more runnable threads than this process may
/// use cores: the running count of `/proc/loadavg` (which includes the
/// caller) against the CPU affinity. Unknown counts as uncontended.
fn cores_contended() -> bool {
    use std::os::unix::fs::FileExt as _;
    use std::sync::OnceLock;
    static CORES: OnceLock<usize> = OnceLock::new();
    static LOADAVG: OnceLock<Option<std::fs::File>> = OnceLock::new();
    let cores = *CORES.get_or_init(|| {
        std::thread::available_parallelism()
            .map(usize::from)
            .unwrap_or(1)
    });
    // Kept open: a read at offset 0 regenerates the line, and an open per
    // look would cost as much as the read.
    let Some(file) = LOADAVG.get_or_init(|| std::fs::File::open("/proc/loadavg").ok()) else {
        return false;
    };
    let mut buf = [0u8; 128];
    let Ok(n) = file.read_at(&mut buf, 0) else {
        return false;
    };
    running_threads(&buf[..n]).is_some_and(|running| running > cores)
}

/// The running count of a `/proc/loadavg` line (`0.74 1.23 1.52 4/101 7031`).
fn running_threads(loadavg: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(loadavg).ok()?;
    let field = text.split_ascii_whitespace().nth(3)?;
    field.split('/').next()?.parse().ok()
}

/// The engine thread's state.
struct Run {
    epoll: Arc<Epoll>,
    wake: Arc<EventFd>,
    qps: Arc<QpMap>,
    timers: Arc<Timers>,
    held: Arc<Held>,
    /// Held QPs and when to take each back.
    holds: Vec<(Instant, Weak<dyn EngineQp>)>,
    registered: Arc<AtomicUsize>,
    parks: Arc<ParkCounts>,
    /// [`Engine::polls_after_traffic`], kept up to date by the loop.
    polls: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    spinner: Spinner,
    /// QPs whose socket is disarmed, or out of the set, because an
    /// application thread drives them.
    parked: Vec<Parked>,
    last_check: Instant,
    /// When a polling engine last looked for application-driven QPs.
    last_scan: Instant,
    /// While polling: the one QP the engine drives, whose socket it reads
    /// directly on most passes ([`Run::poll_sole`]).
    sole: Option<Weak<dyn EngineQp>>,
    /// The sole QP's socket is out of the epoll set while it is polled
    /// directly ([`Run::end_sole`] puts it back).
    sole_out: bool,
    /// Passes since the last `epoll_wait`.
    sole_polls: u32,
}

impl Run {
    fn run(mut self) {
        let mut events = vec![EpollEvent::empty(); 64];
        while !self.stop.load(Ordering::Acquire) {
            let now = Instant::now();
            self.take_holds(now);
            let owns = self.registered.load(Ordering::Relaxed) > self.parked.len();
            let timeout = if self.spinner.polling(owns, now) {
                EpollTimeout::ZERO
            } else if self.parked.is_empty() {
                EpollTimeout::NONE
            } else {
                EpollTimeout::try_from(PARK_RECHECK).unwrap_or(EpollTimeout::ZERO)
            };
            let next = match (
                self.next_timer(),
                self.holds.iter().map(|(at, _)| *at).min(),
            ) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let timeout = match next {
                Some(at) => {
                    // Rounded up: a wake-up a little late, not a spin.
                    let left = at.saturating_duration_since(now) + Duration::from_micros(999);
                    let left = EpollTimeout::try_from(left).unwrap_or(EpollTimeout::MAX);
                    if timeout == EpollTimeout::NONE {
                        left
                    } else {
                        timeout.min(left)
                    }
                }
                None => timeout,
            };
            let n = if timeout == EpollTimeout::ZERO && self.poll_sole() {
                0
            } else {
                self.sole_polls = 0;
                if timeout != EpollTimeout::ZERO {
                    // A sleep must be woken by the sole QP's input too.
                    self.end_sole();
                }
                match self.epoll.wait(&mut events, timeout) {
                    Ok(n) => n,
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => {
                        warn!(error = %e, "epoll_wait failed; engine stops");
                        return;
                    }
                }
            };
            let sole_candidate = self.drives_one_qp_polling();
            let mut recheck = false;
            let mut traffic = false;
            for ev in &events[..n] {
                let token = ev.data();
                if token == WAKE_TOKEN {
                    let _ = self.wake.read();
                    recheck = true;
                    continue;
                }
                let qp = self
                    .qps
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&token)
                    .and_then(Weak::upgrade);
                let Some(qp) = qp else { continue };
                let own = qp.ownership();
                if own.waited_on() {
                    // A thread asleep on the socket took it out of the
                    // set (this event raced with that): it is woken by
                    // the same arrival and drives the QP.
                    continue;
                }
                if own.parked.load(Ordering::Relaxed) || own.app_active() {
                    // Disarmed here (again, if a racing application
                    // thread re-armed it) until the recheck.
                    own.armed.store(false, Ordering::Relaxed);
                    if let Some(fd) = qp.fd() {
                        if own.out_of_set.load(Ordering::Relaxed) {
                            // Added back by its driver during a long park.
                            park_out(&self.epoll, token, fd);
                        } else {
                            disarm(&self.epoll, token, fd);
                        }
                    }
                    if !own.parked.swap(true, Ordering::Relaxed) {
                        self.add_parked(&qp, token, true);
                    }
                } else {
                    qp.engine_drive(false);
                    traffic = true;
                    if sole_candidate && self.sole.is_none() {
                        self.sole = Some(Arc::downgrade(&qp));
                    }
                }
            }
            let now = Instant::now();
            self.fire_timers(now);
            self.fire_holds(now);
            if traffic {
                self.spinner.traffic(now);
            } else if n == 0
                && self.spinner.progress == Progress::Busy
                && timeout == EpollTimeout::ZERO
                && now.duration_since(self.last_scan) >= SCAN_EVERY
            {
                self.last_scan = now;
                self.park_app_driven();
            }
            // For channel waiters deciding whether to leave their sockets
            // to the engine (`CompletionQueue::wait_notified`).
            self.polls
                .store(self.spinner.would_poll(), Ordering::Relaxed);
            if !self.parked.is_empty()
                && (recheck || now.duration_since(self.last_check) >= PARK_RECHECK)
            {
                self.last_check = now;
                let epoll = &self.epoll;
                self.parked.retain(|p| {
                    let Some(qp) = p.qp.upgrade() else {
                        return false;
                    };
                    let own = qp.ownership();
                    if own.app_active() {
                        if now.duration_since(p.since) >= PARK_RECHECK {
                            p.take_out(epoll, &*qp);
                        }
                        return true;
                    }
                    qp.engine_drive(true);
                    false
                });
            }
        }
    }
}

impl Run {
    /// A polling mode (busy, or adaptive in its window: the callers ask
    /// while the engine polls), with exactly one registered QP not
    /// parked: the case [`poll_sole`](Self::poll_sole) serves.
    fn drives_one_qp_polling(&self) -> bool {
        self.spinner.progress != Progress::Blocking
            && self.registered.load(Ordering::Relaxed) == self.parked.len() + 1
    }

    /// A polling engine (busy, or adaptive in its window) that drives one
    /// QP reads its socket directly instead
    /// of asking `epoll_wait(0)` first: a request then costs the responder
    /// the read that brings it, as on a plain polling socket, and not an
    /// `epoll_wait` that reports it, a map lookup and then the read. Every
    /// [`SOLE_POLLS`] passes the engine waits on its epoll set as before
    /// (the other sockets, hang-ups, its wake-up eventfd). Whether it
    /// polled the QP: not when there is no such QP, or it is no longer
    /// the engine's alone (parked, waited on, disarmed, driven by an
    /// application thread since the engine last looked, or another QP
    /// joined); the next event decides then, as without this.
    fn poll_sole(&mut self) -> bool {
        let Some(weak) = &self.sole else {
            return false;
        };
        if self.sole_polls >= SOLE_POLLS {
            return false;
        }
        if !self.drives_one_qp_polling() {
            self.end_sole();
            return false;
        }
        let Some(qp) = weak.upgrade() else {
            self.end_sole();
            return false;
        };
        let own = qp.ownership();
        if !own.armed.load(Ordering::Relaxed)
            || own.parked.load(Ordering::Relaxed)
            || own.waited_on()
            || own.app_drove_unseen()
        {
            self.end_sole();
            return false;
        }
        match qp.engine_poll() {
            None => {
                self.end_sole();
                return false;
            }
            // Traffic keeps an adaptive engine's window open, as an
            // event's drive does.
            Some(true) => self.spinner.traffic(Instant::now()),
            Some(false) => {}
        }
        if !self.sole_out {
            // Read directly, the socket need not be in the set: there its
            // epoll entry costs every arrival the wait queue's lock and
            // epoll's callback, inside the sender's softirq and before
            // the socket's lock is free for this read (~90 ns a message
            // on loopback here, measured on plain TCP).
            self.sole_out = qp.engine_watch(false);
        }
        self.sole_polls += 1;
        true
    }

    /// The engine stops polling the sole QP directly: its socket goes
    /// back into the epoll set (unless parked, waited on or closed
    /// meanwhile, whose own ends re-arm it), so its events tell again.
    fn end_sole(&mut self) {
        let sole = self.sole.take();
        if std::mem::take(&mut self.sole_out) {
            if let Some(qp) = sole.and_then(|w| w.upgrade()) {
                qp.engine_watch(true);
            }
        }
    }

    /// Park every armed QP an application thread drove since the engine
    /// last looked. A polling engine otherwise parks a QP only when it
    /// catches an arrival before the application's own poll reads it, and
    /// spins meanwhile: on two cores with a spinning application in each
    /// of two processes, those are four spinning threads for two cores
    /// (a busy engine took as much CPU as the application it served, and
    /// busy-mode latency went bimodal). A parked QP comes back at the
    /// recheck ([`PARK_RECHECK`]) once the application stops driving it,
    /// as after a park on an arrival.
    fn park_app_driven(&mut self) {
        // Walked under the map's lock, which registrations alone contend
        // for: no Vec of every QP per scan (every 100 µs while idle).
        let Run {
            qps,
            epoll,
            parked,
            parks,
            last_check,
            spinner,
            ..
        } = self;
        let map = qps.lock().unwrap_or_else(|p| p.into_inner());
        for (&token, w) in map.iter() {
            let Some(qp) = w.upgrade() else { continue };
            let own = qp.ownership();
            if !own.armed.load(Ordering::Relaxed)
                || own.parked.load(Ordering::Relaxed)
                || own.waited_on()
                || !own.app_active()
            {
                continue;
            }
            own.armed.store(false, Ordering::Relaxed);
            own.out_of_set.store(true, Ordering::Relaxed);
            if let Some(fd) = qp.fd() {
                park_out(epoll, token, fd);
            }
            own.parked.store(true, Ordering::Relaxed);
            Self::push_parked(
                parked,
                last_check,
                spinner.progress,
                &parks.idle,
                &qp,
                token,
            );
        }
    }

    /// Put a QP just parked on the parked list. The first one starts the
    /// recheck period: with the list empty the last recheck may be long
    /// past, and a recheck right away (in the same turn of the loop)
    /// found the application idle, because the park itself had just taken
    /// its drive count ([`Ownership::app_active`]). The engine then took
    /// the QP back at once, racing the application for its lock and its
    /// socket on every arrival it caught, and kept spinning.
    ///
    /// Busy engines only for now: in adaptive mode (where that immediate
    /// take-back makes the engine wake and drive on every arrival it
    /// catches) keeping the QP parked showed no gain on `stag lat send`
    /// (alternating rounds, medians: 6.75 against 5.91 µs in one run of
    /// five, 5.93 against 5.88 and 5.87 in two of seven), so it is left
    /// as it was until measured.
    fn add_parked(&mut self, qp: &Arc<dyn EngineQp>, token: u64, on_arrival: bool) {
        let count = if on_arrival {
            &self.parks.on_arrival
        } else {
            &self.parks.idle
        };
        Self::push_parked(
            &mut self.parked,
            &mut self.last_check,
            self.spinner.progress,
            count,
            qp,
            token,
        );
    }

    /// [`add_parked`](Self::add_parked) on the fields it touches (for a
    /// caller that holds the QP map's lock).
    fn push_parked(
        parked: &mut Vec<Parked>,
        last_check: &mut Instant,
        progress: Progress,
        count: &AtomicU64,
        qp: &Arc<dyn EngineQp>,
        token: u64,
    ) {
        let now = Instant::now();
        if parked.is_empty() && progress == Progress::Busy {
            *last_check = now;
        }
        count.fetch_add(1, Ordering::Relaxed);
        parked.push(Parked {
            qp: Arc::downgrade(qp),
            token,
            since: now,
        });
    }

    /// The earliest deadline of [`Engine::drive_at`].
    fn next_timer(&self) -> Option<Instant> {
        let timers = self.timers.lock().unwrap_or_else(|p| p.into_inner());
        timers.iter().map(|(at, _)| *at).min()
    }

    /// Move the QPs application threads held ([`Engine::hold`]) into the
    /// engine's list, each to be taken back a recheck period from now;
    /// with none held, the next hold wakes the engine.
    fn take_holds(&mut self, now: Instant) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let at = now + PARK_RECHECK;
        self.holds.extend(held.0.drain(..).map(|qp| (at, qp)));
        held.1 = !self.holds.is_empty();
    }

    /// Take back the held QPs whose recheck has come.
    fn fire_holds(&mut self, now: Instant) {
        if self.holds.iter().all(|(at, _)| *at > now) {
            return;
        }
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.holds)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.holds = later;
        for (_, weak) in due {
            let Some(qp) = weak.upgrade() else { continue };
            if let Some(at) = qp.engine_unhold() {
                self.holds.push((at, weak));
            }
        }
    }

    /// Drive the QPs whose deadline has come.
    fn fire_timers(&self, now: Instant) {
        let due: Vec<_> = {
            let mut timers = self.timers.lock().unwrap_or_else(|p| p.into_inner());
            if timers.iter().all(|(at, _)| *at > now) {
                return;
            }
            let (due, later) = std::mem::take(&mut *timers)
                .into_iter()
                .partition(|(at, _)| *at <= now);
            *timers = later;
            due
        };
        for (_, qp) in due {
            if let Some(qp) = qp.upgrade() {
                qp.engine_drive(false);
            }
        }
    }
}

/// A QP in the engine's parked list.
struct Parked {
    qp: Weak<dyn EngineQp>,
    token: u64,
    /// When it was parked.
    since: Instant,
}

impl Parked {
    /// An application thread still drives the QP a recheck period after
    /// the park: take its socket out of the epoll set ([`park_out`]) if
    /// it is only disarmed there. A disarmed socket's epoll entry stays
    /// on its wait queue, and every arrival then takes that queue's lock
    /// and runs epoll's callback for nothing, on both ends of a
    /// ping-pong whose threads spin on their QPs (the adaptive engine's
    /// park on an arrival; a busy engine's scan takes the socket out at
    /// once). A park this long is a spinning application's, which keeps
    /// it until it stops: the delete and the add at the take-back are
    /// paid once. A short park (an event-mode program polling between an
    /// event and its next arm) ends before this and keeps the one-shot
    /// disarm, which costs it less than a delete and an add per message.
    fn take_out(&self, epoll: &Epoll, qp: &dyn EngineQp) {
        let own = qp.ownership();
        if own.out_of_set.swap(true, Ordering::Relaxed) {
            return;
        }
        if let Some(fd) = qp.fd() {
            park_out(epoll, self.token, fd);
        }
    }
}

/// What a QP's socket is armed for on the input side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Input {
    /// Readability (and the peer's close): the usual.
    #[default]
    Read,
    /// Only the peer's close: input waits for a Receive, and a
    /// level-triggered readable socket would only spin the engine.
    CloseOnly,
    /// Nothing: the stream ended, what was read waits for Receives.
    Nothing,
}

/// Take the socket of a QP a busy engine found driven by an application
/// thread out of the epoll set altogether, until [`Engine::arm`] adds it
/// back. A socket in the set, even disarmed, has the epoll entry on its
/// wait queue, so every arrival takes that queue's lock (interrupts off)
/// and runs epoll's callback, which finds nothing to do: per message, on
/// both ends of a ping-pong whose application threads spin on their QPs.
/// A plain socket nobody sleeps on pays neither. Such a park lasts as
/// long as the application spins, so the add at the take-back is rare.
///
/// Only there: a park on an arrival (an event-mode program polls its CQ
/// unarmed between an event and its next arm, then hands the QP back)
/// and a thread's wait come and go with every message, and there the
/// delete and the add cost more than the one-shot [`disarm`]'s
/// `EPOLL_CTL_MOD`: rping, deleting on those parks too, was 1.13x slower
/// per iteration (4 alternating rounds, slower in every one).
fn park_out(epoll: &Epoll, token: u64, sock: BorrowedFd<'_>) {
    match epoll.delete(sock) {
        Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => debug!(token, error = %e, "epoll delete failed"),
    }
}

/// Watch a QP's socket for `ev` again: in the set, its events change;
/// out of it (parked by a busy engine, [`park_out`]), it is added back.
fn rearm(epoll: &Epoll, sock: BorrowedFd<'_>, mut ev: EpollEvent) {
    let armed = match epoll.modify(sock, &mut ev) {
        Err(nix::errno::Errno::ENOENT) => epoll.add(sock, ev),
        other => other,
    };
    if let Err(e) = armed {
        debug!(token = ev.data(), error = %e, "epoll arm failed");
    }
}

/// Stop watching a QP's socket. One-shot with no events: an error or
/// hang-up (always reported) wakes the engine once at most.
fn disarm(epoll: &Epoll, token: u64, sock: BorrowedFd<'_>) {
    let mut ev = EpollEvent::new(EpollFlags::EPOLLONESHOT, token);
    if let Err(e) = epoll.modify(sock, &mut ev) {
        debug!(token, error = %e, "epoll modify failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket a busy engine parked (out of the epoll set) reports
    /// nothing, and is watched again once re-armed, as a disarmed one is.
    #[test]
    fn a_parked_socket_is_added_back_when_rearmed() {
        use std::io::Write as _;
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).unwrap();
        let (ours, mut peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let readable = || EpollEvent::new(EpollFlags::EPOLLIN, 7);
        epoll.add(ours.as_fd(), readable()).unwrap();
        let ready = |epoll: &Epoll| {
            let mut events = [EpollEvent::empty(); 4];
            let n = epoll.wait(&mut events, EpollTimeout::ZERO).unwrap();
            events[..n].iter().map(|e| e.data()).collect::<Vec<_>>()
        };
        for park in [park_out, disarm] {
            park(&epoll, 7, ours.as_fd());
            peer.write_all(b"x").unwrap();
            assert_eq!(
                ready(&epoll),
                Vec::<u64>::new(),
                "a parked socket wakes nobody"
            );
            // Parking twice is harmless too (an arrival's park racing a scan's).
            park(&epoll, 7, ours.as_fd());
            rearm(&epoll, ours.as_fd(), readable());
            assert_eq!(ready(&epoll), vec![7], "re-armed, the waiting byte is seen");
            // Re-armed twice (a racing application thread): still one entry.
            rearm(&epoll, ours.as_fd(), readable());
            assert_eq!(ready(&epoll), vec![7]);
            let mut byte = [0u8; 1];
            std::io::Read::read_exact(&mut &ours, &mut byte).unwrap();
        }
    }

    /// A held QP stays held, with no lock taken, while a thread sleeps on
    /// its socket and for [`PARK_RECHECK`] after that thread's last wait
    /// ended (an event loop coming back); after that the engine takes it
    /// back.
    #[test]
    fn a_held_qp_stays_held_while_its_thread_keeps_waiting() {
        let own = Ownership::default();
        assert!(own.begin_wait());
        let now = Instant::now();
        assert_eq!(own.hold_until(now), Some(now + PARK_RECHECK));
        std::thread::sleep(PARK_RECHECK * 3);
        // Still asleep on it: however long that takes.
        let now = Instant::now();
        assert_eq!(own.hold_until(now), Some(now + PARK_RECHECK));
        assert!(own.end_wait_holding(), "the first hold joins the list");
        let now = Instant::now();
        let at = own.hold_until(now).expect("just came back from a wait");
        assert!(at > now && at <= now + PARK_RECHECK, "{at:?} {now:?}");
        // Held already: the next wait's end adds nothing to the list.
        assert!(own.begin_wait());
        assert!(!own.end_wait_holding());
        std::thread::sleep(PARK_RECHECK * 2);
        assert_eq!(own.hold_until(Instant::now()), None);
        assert!(own.unhold(), "nobody waits: the engine re-arms");
    }

    /// A wait that starts on a socket its thread's last wait kept (held,
    /// not re-armed) needs no lock ([`Ownership::kept_quiet`]); once that
    /// thread counts as a waiter, the engine's unhold does not re-arm the
    /// socket behind it; an armed or unheld socket takes the locked path.
    #[test]
    fn a_wait_on_a_kept_socket_starts_without_the_lock() {
        let own = Ownership::default();
        assert!(!own.kept_quiet(), "never held");
        assert!(own.begin_wait());
        assert!(own.end_wait_holding());
        assert!(own.kept_quiet(), "held by the last wait");
        // The next wait counts itself, then looks.
        assert!(own.begin_wait());
        assert!(own.kept_quiet());
        // The engine's recheck meanwhile: a waiter is counted, so it
        // leaves the socket out of its set.
        assert!(!own.unhold(), "a thread sleeps on it: no re-arm");
        assert!(!own.kept_quiet(), "no longer held: the next wait locks");
        // That wait ends holding again: back in the list, quiet.
        assert!(own.end_wait_holding());
        assert!(own.kept_quiet());
        // Armed by the engine: a wait must take the lock to disarm it.
        own.armed.store(true, Ordering::SeqCst);
        assert!(own.begin_wait());
        assert!(!own.kept_quiet());
    }

    /// A stand-in QP over a Unix socket pair: counts the engine's drives
    /// (after an epoll event) and direct polls, each reading what came.
    struct FakeQp {
        own: Ownership,
        sock: std::os::unix::net::UnixStream,
        drives: AtomicU32,
        polls: AtomicU32,
        /// Octets read from the socket.
        read: AtomicU32,
        /// An application thread drives the QP, as far as the engine can
        /// tell: it has, each time the engine looks ([`FakeQp::ownership`]).
        driving: AtomicBool,
        /// Set: the engine to re-arm the socket with at a take-back (as
        /// a real QP's driver does), under token 7.
        engine: std::sync::OnceLock<Arc<Engine>>,
    }

    impl FakeQp {
        /// A stand-in over `sock` (made non-blocking), with no engine.
        fn new(sock: std::os::unix::net::UnixStream) -> Arc<FakeQp> {
            sock.set_nonblocking(true).unwrap();
            Arc::new(FakeQp {
                own: Ownership::default(),
                sock,
                drives: AtomicU32::new(0),
                polls: AtomicU32::new(0),
                read: AtomicU32::new(0),
                driving: AtomicBool::new(false),
                engine: Default::default(),
            })
        }

        /// Start an engine in `progress` mode and register `qp` with it
        /// under token 7, the engine it re-arms its socket with.
        fn start_engine(qp: &Arc<FakeQp>, name: &str, progress: Progress) -> Arc<Engine> {
            let engine = Arc::new(Engine::start(name, progress).unwrap());
            let _ = qp.engine.set(engine.clone());
            qp.register(&engine, 7);
            engine
        }

        /// Register with `engine` under `token`.
        fn register(self: &Arc<Self>, engine: &Engine, token: u64) {
            let weak: Weak<dyn EngineQp> = Arc::downgrade(&(self.clone() as Arc<dyn EngineQp>));
            engine
                .register(token, weak, &self.own, self.sock.as_fd())
                .unwrap();
        }

        fn drain(&self) {
            use std::io::Read as _;
            let mut buf = [0u8; 64];
            while let Ok(n @ 1..) = (&self.sock).read(&mut buf) {
                self.read.fetch_add(n as u32, Ordering::SeqCst);
            }
        }
    }

    impl EngineQp for FakeQp {
        fn ownership(&self) -> &Ownership {
            // The engine looks right after this: the application thread
            // drove the QP in between, however the threads were scheduled.
            if self.driving.load(Ordering::SeqCst) {
                self.own.note_app();
            }
            &self.own
        }
        fn fd(&self) -> Option<BorrowedFd<'_>> {
            Some(self.sock.as_fd())
        }
        fn engine_drive(&self, rearm: bool) {
            self.drain();
            if rearm && self.own.unpark() {
                if let Some(engine) = self.engine.get() {
                    self.own.armed.store(true, Ordering::Relaxed);
                    engine.arm(7, self.sock.as_fd(), Input::Read, false);
                }
            }
            self.drives.fetch_add(1, Ordering::SeqCst);
        }
        fn engine_poll(&self) -> Option<bool> {
            let read = self.read.load(Ordering::SeqCst);
            self.drain();
            self.polls.fetch_add(1, Ordering::SeqCst);
            Some(self.read.load(Ordering::SeqCst) != read)
        }
        fn engine_unhold(&self) -> Option<Instant> {
            None
        }
        fn engine_watch(&self, watched: bool) -> bool {
            let Some(engine) = self.engine.get() else {
                return false;
            };
            if !self.own.armed.load(Ordering::Relaxed) {
                return false;
            }
            if watched {
                engine.arm(7, self.sock.as_fd(), Input::Read, false);
            } else {
                engine.unwatch(7, self.sock.as_fd());
            }
            true
        }
    }

    fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < until, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A busy engine that drives one QP, once an arrival made it drive
    /// that QP, reads its socket directly on most passes (no epoll_wait
    /// first), and still waits on its epoll set between; it stops once
    /// an application thread drives the QP. An adaptive engine polls that
    /// way within its window at most: once it sleeps, it polls no more,
    /// and the QP's socket is in its set, whose events drive the QP.
    #[test]
    fn a_busy_engine_polls_its_one_qp_directly_until_the_application_drives_it() {
        use std::io::Write as _;
        for progress in [Progress::Busy, Progress::default()] {
            let (ours, mut peer) = std::os::unix::net::UnixStream::pair().unwrap();
            let qp = FakeQp::new(ours);
            let engine = FakeQp::start_engine(&qp, "sole-test", progress);
            peer.write_all(b"x").unwrap();
            wait_for("the first drive", || qp.drives.load(Ordering::SeqCst) >= 1);
            if progress != Progress::Busy {
                // The window (200 µs at most) is long past.
                std::thread::sleep(Duration::from_millis(20));
                let polls = qp.polls.load(Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
                assert_eq!(qp.polls.load(Ordering::SeqCst), polls, "{progress}");
                use std::os::fd::AsRawFd as _;
                assert!(in_the_set(&engine, qp.sock.as_raw_fd()), "{progress}");
                let drives = qp.drives.load(Ordering::SeqCst);
                peer.write_all(b"y").unwrap();
                wait_for("a drive on the event", || {
                    qp.drives.load(Ordering::SeqCst) > drives
                });
                engine.deregister(7, qp.sock.as_fd());
                continue;
            }
            wait_for("direct polls", || qp.polls.load(Ordering::SeqCst) >= 1000);
            // What comes now is read by a direct poll, not an event's drive.
            let drives = qp.drives.load(Ordering::SeqCst);
            for _ in 0..20 {
                peer.write_all(b"y").unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
            assert!(
                qp.drives.load(Ordering::SeqCst) - drives < 20,
                "every arrival took an epoll event"
            );
            // An application thread drives the QP: the engine stops polling it.
            qp.own.note_app();
            std::thread::sleep(Duration::from_millis(20));
            let polls = qp.polls.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(qp.polls.load(Ordering::SeqCst), polls, "still polled");
            engine.deregister(7, qp.sock.as_fd());
        }
    }

    /// Whether the socket `fd` is in `engine`'s epoll set: a `tfd` line
    /// of that set's `/proc/self/fdinfo` naming both the descriptor and
    /// the socket's inode (the kernel's own account, which a disarmed
    /// registration keeps).
    fn in_the_set(engine: &Engine, fd: std::os::fd::RawFd) -> bool {
        use std::os::fd::AsRawFd as _;
        use std::os::unix::fs::MetadataExt as _;
        let ino = std::fs::metadata(format!("/proc/self/fd/{fd}"))
            .unwrap()
            .ino();
        let info =
            std::fs::read_to_string(format!("/proc/self/fdinfo/{}", engine.epoll.0.as_raw_fd()))
                .unwrap();
        info.lines().any(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words.first() == Some(&"tfd:")
                && words.get(1) == Some(&fd.to_string().as_str())
                && words.contains(&format!("ino:{ino:x}").as_str())
        })
    }

    /// An adaptive engine parks a QP on an arrival while an application
    /// thread drives it, disarming its socket; a recheck period later,
    /// with that thread still driving, the socket is out of the epoll set
    /// altogether (no epoll callback per arrival); once the thread stops,
    /// the engine takes the QP back.
    #[test]
    fn a_long_park_takes_the_socket_out_of_the_set() {
        use std::io::Write as _;
        use std::os::fd::AsRawFd as _;
        let (ours, mut peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = ours.as_raw_fd();
        let qp = FakeQp::new(ours);
        let engine = FakeQp::start_engine(&qp, "long-park-test", Progress::default());
        assert!(in_the_set(&engine, fd), "registered");
        // An application thread drives the QP from now on.
        qp.driving.store(true, Ordering::SeqCst);
        // Arrivals until one reaches the engine while the thread drives:
        // the engine parks the QP.
        wait_for("the park", || {
            peer.write_all(b"x").unwrap();
            qp.own.parked.load(Ordering::SeqCst)
        });
        let parked = engine.parks();
        wait_for("the socket out of the set", || !in_the_set(&engine, fd));
        // It stays out, and parked, while the thread drives it.
        std::thread::sleep(PARK_RECHECK * 20);
        assert!(!in_the_set(&engine, fd));
        assert!(qp.own.parked.load(Ordering::SeqCst));
        assert_eq!(engine.parks(), parked, "parked once");
        // The thread stops: the engine takes the QP back.
        qp.driving.store(false, Ordering::SeqCst);
        wait_for("the take-back", || !qp.own.parked.load(Ordering::SeqCst));
        assert!(!qp.own.out_of_set.load(Ordering::SeqCst));
        assert!(in_the_set(&engine, fd), "watched again");
        let drives = qp.drives.load(Ordering::SeqCst);
        peer.write_all(b"y").unwrap();
        wait_for("a drive on the next arrival", || {
            qp.drives.load(Ordering::SeqCst) > drives
        });
        engine.deregister(7, qp.sock.as_fd());
    }

    /// A busy engine polling its one QP directly keeps that QP's socket
    /// out of its epoll set (no epoll callback per arrival) and still
    /// reads what comes; once a second QP joins, the first QP's socket is
    /// back in the set and its arrivals are driven on their events.
    #[test]
    fn a_directly_polled_socket_is_out_of_the_set_until_another_qp_joins() {
        use std::io::Write as _;
        use std::os::fd::AsRawFd as _;
        let (ours, mut peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = ours.as_raw_fd();
        let qp = FakeQp::new(ours);
        let engine = FakeQp::start_engine(&qp, "sole-out-test", Progress::Busy);
        peer.write_all(b"x").unwrap();
        wait_for("direct polls", || qp.polls.load(Ordering::SeqCst) >= 100);
        assert!(!in_the_set(&engine, fd), "polled directly, yet in the set");
        // What comes is still read (by the direct polls).
        let read = qp.read.load(Ordering::SeqCst);
        peer.write_all(b"y").unwrap();
        wait_for("the octet read", || qp.read.load(Ordering::SeqCst) > read);
        // A second QP: the first is no longer the engine's alone.
        let (second_sock, _second_peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let second = FakeQp::new(second_sock);
        second.register(&engine, 8);
        wait_for("the socket back in the set", || in_the_set(&engine, fd));
        let drives = qp.drives.load(Ordering::SeqCst);
        peer.write_all(b"z").unwrap();
        wait_for("a drive on the event", || {
            qp.drives.load(Ordering::SeqCst) > drives
        });
        engine.deregister(8, second.sock.as_fd());
        engine.deregister(7, qp.sock.as_fd());
    }

    #[test]
    fn progress_parses_and_prints_every_mode() {
        for (text, mode) in [
            ("busy", Progress::Busy),
            ("Blocking", Progress::Blocking),
            ("adaptive", Progress::default()),
            (
                "adaptive:50",
                Progress::Adaptive {
                    spin: Duration::from_micros(50),
                },
            ),
        ] {
            let parsed: Progress = text.parse().unwrap();
            assert_eq!(parsed, mode, "{text}");
            assert_eq!(parsed.to_string().parse::<Progress>().unwrap(), mode);
        }
        assert!("spin".parse::<Progress>().is_err());
        assert!("adaptive:x".parse::<Progress>().is_err());
    }

    /// An adaptive window opens on traffic, ends at its deadline, and
    /// (uncontended) keeps its length; a busy engine polls only while it
    /// drives a QP; a blocking one never polls.
    #[test]
    fn loadavg_running_count() {
        assert_eq!(running_threads(b"0.74 1.23 1.52 4/101 7031\n"), Some(4));
        assert_eq!(running_threads(b"0.00 0.00 0.00 1/9 12"), Some(1));
        assert_eq!(running_threads(b"garbage"), None);
        assert_eq!(running_threads(b"1 2 3 x/5 6"), None);
    }

    /// On a machine whose cores are all taken, an adaptive window never
    /// opens (and one in progress closes at the next look); a thread that
    /// is runnable now and then does not stop the polling.
    #[test]
    fn no_poll_window_while_cores_are_contended() {
        let t0 = Instant::now();
        let mut s = Spinner::new(Progress::default());
        s.look_every = Duration::ZERO;
        s.contended = || true;
        // A few looks may catch passing threads.
        for _ in 1..CONTENDED_LOOKS {
            s.traffic(t0);
            assert!(s.polling(true, t0));
            s.until = None;
        }
        s.traffic(t0);
        assert!(!s.polling(true, t0), "taken at most looks: no window");
        s.contended = || false;
        let free_looks = (1..=8)
            .find(|_| {
                s.traffic(t0);
                s.polling(true, t0)
            })
            .unwrap();
        // Until the free ones outnumber the taken ones among the last eight.
        assert_eq!(free_looks, 8 - CONTENDED_LOOKS as usize + 1);
        s.contended = || true;
        let polled = (0..CONTENTION_EVERY * 16)
            .take_while(|_| s.polling(true, t0))
            .count() as u32;
        // The window closes once the taken looks are most of the last
        // eight again.
        assert!(polled < CONTENTION_EVERY * 8, "{polled}");

        // Taken at one look in four: it keeps polling.
        let mut s = Spinner::new(Progress::default());
        s.look_every = Duration::ZERO;
        s.contended = || {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            N.fetch_add(1, Ordering::Relaxed).is_multiple_of(4)
        };
        s.traffic(t0);
        assert!((0..CONTENTION_EVERY * 64).all(|_| s.polling(true, t0)));
    }

    /// The run queue is read at most once per `LOOK_EVERY`, however often
    /// the engine wakes; a look in between keeps the last verdict and adds
    /// no sample, so one passing thread still counts once.
    #[test]
    fn the_run_queue_is_read_at_most_once_per_look_interval() {
        static READS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let t0 = Instant::now();
        let mut s = Spinner::new(Progress::default());
        s.contended = || {
            READS.fetch_add(1, Ordering::Relaxed);
            true
        };
        for i in 0..1000u32 {
            // A thousand wake-ups within one interval.
            s.traffic(t0 + LOOK_EVERY * i / 1000);
            s.until = None;
        }
        assert_eq!(READS.load(Ordering::Relaxed), 1);
        assert!(!s.look_contended(t0), "one taken look is not most");
        let mut t = t0;
        for n in 2..=CONTENDED_LOOKS {
            t += LOOK_EVERY;
            s.until = None;
            s.traffic(t);
            assert_eq!(READS.load(Ordering::Relaxed), n);
        }
        assert!(s.look_contended(t), "taken at most of the spaced looks");
        assert!(!s.polling(true, t), "no window");
    }

    #[test]
    fn spinner_windows() {
        let t0 = Instant::now();
        let spin = Duration::from_micros(100);
        let mut s = Spinner::new(Progress::Adaptive { spin });
        s.contended = || false;
        assert!(!s.polling(true, t0), "no traffic yet");
        s.traffic(t0);
        assert!(s.polling(true, t0 + Duration::from_micros(50)));
        assert!(
            !s.polling(false, t0 + Duration::from_micros(60)),
            "owns nothing"
        );
        s.traffic(t0 + Duration::from_micros(70));
        assert!(
            !s.polling(true, t0 + Duration::from_micros(200)),
            "window over"
        );
        assert!(s.budget <= spin && !s.budget.is_zero());

        // Preempted in every window: it halves down to none, then probes
        // with a short window again.
        let mut s = Spinner::new(Progress::Adaptive { spin });
        s.contended = || false;
        s.switches = {
            fn rising() -> i64 {
                static N: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
                N.fetch_add(1, Ordering::Relaxed)
            }
            rising
        };
        let mut t = t0;
        let mut budgets = Vec::new();
        for _ in 0..8 {
            s.traffic(t);
            t += Duration::from_millis(1);
            assert!(!s.polling(true, t));
            budgets.push(s.budget.as_micros());
        }
        assert_eq!(&budgets[..7], &[50, 25, 12, 6, 3, 0, 6], "{budgets:?}");

        let mut busy = Spinner::new(Progress::Busy);
        assert!(busy.would_poll());
        assert!(busy.polling(true, t0));
        assert!(!busy.polling(false, t0));
        let mut blocking = Spinner::new(Progress::Blocking);
        blocking.traffic(t0);
        assert!(!blocking.would_poll());
        assert!(!blocking.polling(true, t0));
    }
}
