//! The receive assist: a progress policy for a thread that reaps its own
//! RDMA Write's completion and then waits for the peer's answer in memory.
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
//! own Write's completion. So when a poll ([`Device::poll_cq`]) hands out a
//! successful RDMA Write completion and leaves the CQ empty, and the
//! program started at most one post list on that QP since the last such
//! reap (a sender that keeps its queue full posts many times per reap),
//! the polling thread keeps driving that QP for a short while, until input
//! arrives (the peer's answer, placed by this thread) or the window ends.
//! The window adapts per QP: it grows towards twice the wait that found
//! input, and halves on each miss down to none, after which only one reap
//! in [`PROBE_EVERY`] tries a short window. A miss also releases the QP to
//! the engine at once. So a program that waits for the peer gets its answer
//! placed without a wake-up, and one that does not (a bandwidth sender, a
//! program that sleeps on a channel) loses a few windows and then nearly
//! nothing.
//!
//! [`Device::poll_cq`]: crate::device::Device::poll_cq

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The longest window.
const MAX_WINDOW: Duration = Duration::from_micros(50);

/// A window shorter than this is no window.
const MIN_WINDOW: Duration = Duration::from_micros(2);

/// The window a QP starts with and probes with.
const PROBE_WINDOW: Duration = Duration::from_micros(20);

/// With no window, one Write reap in this many probes.
pub(crate) const PROBE_EVERY: u32 = 32;

/// One QP's assist state.
#[derive(Debug)]
pub(crate) struct Assist {
    /// The current window in ns (0: none).
    window_ns: AtomicU64,
    /// Reaps since the window closed.
    skipped: AtomicU32,
    /// Post lists started since the last assisted reap.
    posts: AtomicU32,
}

impl Default for Assist {
    fn default() -> Self {
        Assist {
            window_ns: AtomicU64::new(PROBE_WINDOW.as_nanos() as u64),
            skipped: AtomicU32::new(0),
            posts: AtomicU32::new(0),
        }
    }
}

/// What one assist did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// No window now, or not a program waiting for an answer.
    Skipped,
    /// Input arrived within the window.
    Hit,
    /// The window ended without input.
    Miss,
}

impl Assist {
    /// The program started a post list on this QP.
    pub(crate) fn posted(&self) {
        self.posts.fetch_add(1, Ordering::Relaxed);
    }

    /// The polling thread just reaped a Write of this QP and left its CQ
    /// empty: unless the program posted more than once since the last
    /// reap, [`run`](Self::run).
    pub(crate) fn after_write(
        &self,
        drive: impl FnMut() -> bool,
        release: impl FnOnce(),
    ) -> Outcome {
        if self.posts.swap(0, Ordering::Relaxed) > 1 {
            // More than one post per reap: a sender keeping its queue
            // full, not a program waiting for an answer.
            return Outcome::Skipped;
        }
        self.run(drive, release)
    }

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

    /// A QP whose peer answers keeps its window (and the drive that found
    /// input ends it); one whose peer never does loses it in a few misses,
    /// each handing the QP back to the engine, then probes once in
    /// PROBE_EVERY reaps; a probe that hits opens the window again.
    #[test]
    fn window_follows_the_peer() {
        let a = Assist::default();
        // A window no preemption of this thread can outlast: with the
        // default 20 µs, a test thread descheduled between two drives
        // ran out of it and was released before its hit (2 of 7 runs on
        // a loaded machine). The hit caps it at MAX_WINDOW again.
        a.window_ns
            .store(Duration::from_secs(10).as_nanos() as u64, Ordering::Relaxed);
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
        // A hit keeps the window, or widens it to twice the wait it took,
        // never past the cap.
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

    /// A reap after one post list assists, a reap after several does not.
    #[test]
    fn only_one_post_per_reap_is_assisted() {
        let a = Assist::default();
        a.posted();
        assert_eq!(a.after_write(|| false, || {}), Outcome::Miss);
        a.posted();
        a.posted();
        assert_eq!(
            a.after_write(|| panic!("driven"), || panic!("released")),
            Outcome::Skipped
        );
    }
}
