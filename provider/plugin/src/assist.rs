//! Receive assist after an RDMA Write completes.
//!
//! A program that waits for its peer's RDMA Write by spinning on memory
//! (perftest's `ib_write_lat`, any ring-buffer protocol) never enters the
//! provider while it waits, so the device's engine has to read the socket
//! and place the Write. When every core is taken by such spinning threads
//! (two processes on a two-core machine) that is a thread wake-up, and
//! often a cross-core interrupt, per message: two to four times the
//! latency of a program that polls its CQ while it waits.
//!
//! Such a program does enter the provider once per message: it reaps its
//! own Write's completion. So when `poll_cq` hands out a successful RDMA
//! Write completion and leaves the CQ empty, and the program posted at
//! most once to that QP since the last such reap (a sender that keeps
//! its queue full posts many times per reap), the polling thread keeps
//! driving that QP for a short while, until input arrives (the peer's
//! answer, placed by this thread) or the window ends. The window adapts
//! per QP: it grows towards twice the wait that found input, and halves
//! on each miss down to none, after which only one reap in
//! [`PROBE_EVERY`] tries a short window. A miss also hands the QP back to
//! the engine at once. So a program that waits for the peer gets its
//! answer placed without a wake-up, and one that does not (a bandwidth
//! sender, a program that sleeps on a channel) loses a few windows and
//! then nearly nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use provider::device::QueuePair;

/// The longest window.
const MAX_WINDOW: Duration = Duration::from_micros(50);

/// A window shorter than this is no window.
const MIN_WINDOW: Duration = Duration::from_micros(2);

/// The window a QP starts with and probes with.
const PROBE_WINDOW: Duration = Duration::from_micros(20);

/// With no window, one Write reap in this many probes.
pub(crate) const PROBE_EVERY: u32 = 32;

/// One QP's assist state.
pub(crate) struct QpAssist {
    qp: Weak<QueuePair>,
    /// The current window in ns (0: none).
    window_ns: AtomicU64,
    /// Reaps since the window closed.
    skipped: AtomicU32,
    /// `ibv_post_send` calls since the last assisted reap.
    posts: AtomicU32,
}

impl QpAssist {
    /// The program posted to this QP.
    pub(crate) fn posted(&self) {
        self.posts.fetch_add(1, Ordering::Relaxed);
    }
}

/// What one assist did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// No window now.
    Skipped,
    /// Input arrived within the window.
    Hit,
    /// The window ended without input.
    Miss,
}

/// The QPs by number.
#[derive(Default)]
pub(crate) struct Assists(RwLock<HashMap<u32, Arc<QpAssist>>>);

/// The process's assists.
pub(crate) fn assists() -> &'static Assists {
    static A: std::sync::OnceLock<Assists> = std::sync::OnceLock::new();
    A.get_or_init(Assists::default)
}

impl Assists {
    /// A new QP; its state, for counting its posts.
    pub(crate) fn register(&self, qp: &Arc<QueuePair>) -> Arc<QpAssist> {
        let a = Arc::new(QpAssist {
            qp: Arc::downgrade(qp),
            window_ns: AtomicU64::new(PROBE_WINDOW.as_nanos() as u64),
            skipped: AtomicU32::new(0),
            posts: AtomicU32::new(0),
        });
        let mut m = self.0.write().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, a| a.qp.strong_count() > 0);
        m.insert(qp.qp_num(), a.clone());
        a
    }

    /// The polling thread just reaped a Write of QP `qpn` and left its CQ
    /// empty: drive the QP until input arrives or the window ends.
    pub(crate) fn after_write(&self, qpn: u32) -> Outcome {
        let Some(a) = self
            .0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&qpn)
            .cloned()
        else {
            return Outcome::Skipped;
        };
        if a.posts.swap(0, Ordering::Relaxed) > 1 {
            // More than one post per reap: a sender keeping its queue
            // full, not a program waiting for an answer.
            return Outcome::Skipped;
        }
        let Some(qp) = a.qp.upgrade() else {
            return Outcome::Skipped;
        };
        a.run(|| qp.try_progress_reading(), || qp.release_to_engine())
    }
}

impl QpAssist {
    /// One assist: `drive` drives the QP and tells whether it read input;
    /// `release` hands it back to the engine.
    fn run(&self, mut drive: impl FnMut() -> bool, release: impl FnOnce()) -> Outcome {
        let mut window = Duration::from_nanos(self.window_ns.load(Ordering::Relaxed));
        let probing = window.is_zero();
        if probing {
            if self.skipped.fetch_add(1, Ordering::Relaxed) % PROBE_EVERY != PROBE_EVERY - 1 {
                return Outcome::Skipped;
            }
            window = PROBE_WINDOW;
        }
        let start = Instant::now();
        loop {
            if drive() {
                let took = start.elapsed();
                let next = window.max(took * 2).min(MAX_WINDOW);
                self.window_ns
                    .store(next.as_nanos() as u64, Ordering::Relaxed);
                self.skipped.store(0, Ordering::Relaxed);
                return Outcome::Hit;
            }
            if start.elapsed() >= window {
                break;
            }
            std::hint::spin_loop();
        }
        // Nothing came: the engine must not wait for this thread to come
        // back before it reads the socket again.
        release();
        let next = window / 2;
        let next = if probing || next < MIN_WINDOW {
            Duration::ZERO
        } else {
            next
        };
        self.window_ns
            .store(next.as_nanos() as u64, Ordering::Relaxed);
        Outcome::Miss
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assist() -> QpAssist {
        QpAssist {
            qp: Weak::new(),
            window_ns: AtomicU64::new(PROBE_WINDOW.as_nanos() as u64),
            skipped: AtomicU32::new(0),
            posts: AtomicU32::new(0),
        }
    }

    /// A QP whose peer answers keeps its window (and the drive that found
    /// input ends it); one whose peer never does loses it in a few misses,
    /// each handing the QP back to the engine, then probes once in
    /// PROBE_EVERY reaps; a probe that hits opens the window again.
    #[test]
    fn window_follows_the_peer() {
        let a = assist();
        let mut calls = 0;
        assert_eq!(
            a.run(
                || {
                    calls += 1;
                    calls == 3
                },
                || panic!("released on a hit")
            ),
            Outcome::Hit
        );
        assert_eq!(calls, 3, "stops at the drive that read input");
        // A hit keeps the window, or widens it to twice the wait it took
        // (a preempted test thread waits longer), never past the cap.
        let w = a.window_ns.load(Ordering::Relaxed);
        assert!(
            (PROBE_WINDOW.as_nanos() as u64..=MAX_WINDOW.as_nanos() as u64).contains(&w),
            "{w}"
        );

        let mut released = 0;
        let mut misses = 0;
        while a.window_ns.load(Ordering::Relaxed) > 0 {
            assert_eq!(a.run(|| false, || released += 1), Outcome::Miss);
            misses += 1;
            assert!(misses < 10, "the window never closes");
        }
        assert_eq!(released, misses);
        assert!(misses >= 2, "{misses}");
        let outcomes: Vec<Outcome> = (0..PROBE_EVERY * 2)
            .map(|_| a.run(|| false, || {}))
            .collect();
        let probes = outcomes.iter().filter(|o| **o == Outcome::Miss).count();
        assert_eq!(probes, 2, "one probe per PROBE_EVERY reaps");
        let hit = (0..PROBE_EVERY)
            .map(|_| a.run(|| true, || {}))
            .find(|o| *o == Outcome::Hit);
        assert_eq!(hit, Some(Outcome::Hit));
        assert!(a.window_ns.load(Ordering::Relaxed) >= PROBE_WINDOW.as_nanos() as u64);
    }

    /// Through the registry: a reap after one post assists (and misses
    /// on a QP with no peer), a reap after several posts does not; an
    /// unknown QP is skipped.
    #[test]
    fn only_one_post_per_reap_is_assisted() {
        use provider::device::Device;
        use provider::qp::QpCaps;

        let dev = Device::open("assist-test").unwrap();
        let pd = dev.alloc_pd();
        let cq = provider::cq::CompletionQueue::new(4).unwrap();
        let qp = Arc::new(pd.create_qp(QpCaps::default(), &cq, &cq, None));
        let reg = Assists::default();
        let a = reg.register(&qp);
        a.posted();
        assert_eq!(reg.after_write(qp.qp_num()), Outcome::Miss);
        a.posted();
        a.posted();
        assert_eq!(reg.after_write(qp.qp_num()), Outcome::Skipped);
        assert_eq!(reg.after_write(qp.qp_num() + 1000), Outcome::Skipped);
    }
}
