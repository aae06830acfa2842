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
//! A program that polls the QP's CQs while it waits (`stag lat write` reaps
//! between its looks at memory, as many Rust and C programs do) needs no
//! assist: its own polls drive the QP. For it a window only costs: the
//! reaped Write's completion is handed out after the peer's answer instead
//! of before, so the program handles it on the answer's critical path (the
//! verbs emulation's completion work, ~0.5 µs a side, 1.10-1.46× on
//! `stag lat write`). So the assist watches the CQs' poll counts: a program
//! that polled them between a Write reap and its next post list waits by
//! polling, and is not assisted. A program that is being assisted gets no
//! chance to show that (the answer is there when the window ends), so one
//! reap in `look_gap` is left unassisted to look; each look that finds the
//! program spinning on memory doubles the gap, up to [`MAX_LOOK_GAP`].
//!
//! [`Device::poll_cq`]: crate::device::Device::poll_cq

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cq::PollMark;

/// The longest window.
const MAX_WINDOW: Duration = Duration::from_micros(50);

/// A window shorter than this is no window.
const MIN_WINDOW: Duration = Duration::from_micros(2);

/// The window a QP starts with and probes with.
const PROBE_WINDOW: Duration = Duration::from_micros(20);

/// With no window, one Write reap in this many probes.
pub(crate) const PROBE_EVERY: u32 = 32;

/// Reaps between two looks at whether an assisted program polls, at first
/// (doubled by the first look that finds it spinning).
const FIRST_LOOK_GAP: u32 = 16;

/// The longest gap between two looks.
pub(crate) const MAX_LOOK_GAP: u32 = 1024;

/// One QP's assist state.
#[derive(Debug)]
pub(crate) struct Assist {
    /// The current window in ns (0: none).
    window_ns: AtomicU64,
    /// Reaps since the window closed.
    skipped: AtomicU32,
    /// Post lists started since the last assisted reap.
    posts: AtomicU32,
    /// The poll counts of the QP's send and receive CQs.
    send: Arc<PollMark>,
    recv: Arc<PollMark>,
    /// Their sum at the last Write reap, and at the last post list.
    reaped_at: AtomicU64,
    posted_at: AtomicU64,
    /// The last reap was left unassisted to look whether the program polls.
    looking: AtomicBool,
    /// Reaps between two looks, and until the next.
    look_gap: AtomicU32,
    until_look: AtomicU32,
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
    /// The assist of a QP whose CQs count their polls in `send`, `recv`.
    pub(crate) fn new(send: Arc<PollMark>, recv: Arc<PollMark>) -> Assist {
        Assist {
            window_ns: AtomicU64::new(PROBE_WINDOW.as_nanos() as u64),
            skipped: AtomicU32::new(0),
            posts: AtomicU32::new(0),
            send,
            recv,
            reaped_at: AtomicU64::new(0),
            posted_at: AtomicU64::new(0),
            looking: AtomicBool::new(false),
            look_gap: AtomicU32::new(FIRST_LOOK_GAP),
            // The first reap looks.
            until_look: AtomicU32::new(1),
        }
    }

    fn polls(&self) -> u64 {
        self.send.get().wrapping_add(self.recv.get())
    }

    /// The program started a post list on this QP.
    pub(crate) fn posted(&self) {
        self.posts.fetch_add(1, Ordering::Relaxed);
        self.posted_at.store(self.polls(), Ordering::Relaxed);
    }

    /// The polling thread just reaped a Write of this QP and left its CQ
    /// empty: unless the program posted more than once since the last
    /// reap, or waits by polling, [`run`](Self::run).
    pub(crate) fn after_write(
        &self,
        drive: impl FnMut() -> bool,
        release: impl FnOnce(),
    ) -> Outcome {
        let now = self.polls();
        let reaped_at = self.reaped_at.swap(now, Ordering::Relaxed);
        // Polled between the last reap and the post that followed it.
        let polled = self.posted_at.load(Ordering::Relaxed) > reaped_at;
        if self.posts.swap(0, Ordering::Relaxed) > 1 {
            // More than one post per reap: a sender keeping its queue
            // full, not a program waiting for an answer.
            return Outcome::Skipped;
        }
        let looked = self.looking.swap(false, Ordering::Relaxed);
        if polled {
            // Its own polls drive the QP while it waits. Should it turn
            // to spinning on memory, the next reap sees no poll.
            self.look_gap.store(FIRST_LOOK_GAP, Ordering::Relaxed);
            self.until_look.store(1, Ordering::Relaxed);
            return Outcome::Skipped;
        }
        if looked {
            // Left alone, it still did not poll: it spins on memory.
            let gap = (self.look_gap.load(Ordering::Relaxed) * 2).min(MAX_LOOK_GAP);
            self.look_gap.store(gap, Ordering::Relaxed);
            self.until_look.store(gap, Ordering::Relaxed);
        } else {
            let until = self.until_look.load(Ordering::Relaxed);
            self.until_look
                .store(until.saturating_sub(1), Ordering::Relaxed);
            if until <= 1 {
                self.looking.store(true, Ordering::Relaxed);
                return Outcome::Skipped;
            }
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

/// An assist on CQs of its own (tests).
#[cfg(test)]
impl Default for Assist {
    fn default() -> Self {
        Assist::new(Arc::default(), Arc::default())
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
        a.until_look.store(u32::MAX, Ordering::Relaxed);
        a.posted();
        assert_eq!(a.after_write(|| false, || {}), Outcome::Miss);
        a.posted();
        a.posted();
        assert_eq!(
            a.after_write(|| panic!("driven"), || panic!("released")),
            Outcome::Skipped
        );
    }

    /// One Write ping-pong step of a program: post, reap its Write (one
    /// poll), then wait for the answer by polling the CQ `polls` times
    /// (0: it spins on memory), as the assist sees it.
    fn step(a: &Assist, polls: u32) -> Outcome {
        a.posted();
        a.send.bump();
        let o = a.after_write(|| true, || {});
        for _ in 0..polls {
            a.send.bump();
        }
        o
    }

    /// A program that polls its CQ while it waits for the answer is not
    /// assisted (its polls drive the QP; a window would only hand it its
    /// Write's completion late). One that spins on memory is, but for one
    /// look in a gap that doubles each time it shows it still spins; when
    /// it turns to polling, assisting stops at once, and when it turns
    /// back to spinning, it starts again after one look.
    #[test]
    fn a_program_that_polls_while_it_waits_is_not_assisted() {
        let a = Assist::default();
        let outcomes: Vec<Outcome> = (0..1000).map(|_| step(&a, 5)).collect();
        assert_eq!(outcomes[0], Outcome::Skipped, "the first reap looks");
        assert!(outcomes.iter().all(|o| *o == Outcome::Skipped));

        let b = Assist::default();
        let outcomes: Vec<Outcome> = (0..3000).map(|_| step(&b, 0)).collect();
        let looks: Vec<usize> = outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| **o == Outcome::Skipped)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(
            looks,
            [0, 33, 98, 227, 484, 997, 2022],
            "a look, then gaps of 32, 64, ... up to MAX_LOOK_GAP"
        );
        assert!(outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Skipped | Outcome::Hit)));

        // It turns to polling: the next reap after a polled wait skips.
        assert_eq!(step(&b, 3), Outcome::Hit, "its wait is not yet seen");
        assert_eq!(step(&b, 0), Outcome::Skipped, "it polled in that wait");
        // And back to spinning: one look (that wait was polled-free), then
        // assisted.
        assert_eq!(step(&b, 0), Outcome::Skipped, "a look");
        assert_eq!(step(&b, 0), Outcome::Hit);
    }
}
