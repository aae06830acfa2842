//! Completion notifications end to end: an application that sleeps on a
//! CQ's notification (the event fd, as a completion channel) is woken by
//! the arrival itself, in every progress mode, with nobody polling; the
//! engine never leaves such an arrival to the sleeping thread (no park);
//! solicited-only arming wakes only for solicited (or failed) completions;
//! and the drain / arm / drain / sleep loop loses no wake-up.
//!
//! No timing is asserted: a missed wake-up shows as a sleep that ends
//! without the fd readable (after 10 s).

mod common;

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use provider::cq::CompletionQueue;
use provider::device::Device;
use provider::engine::Progress;
use provider::setup::MpaParams;
use provider::wr::{SendOp, WcOpcode, WcStatus, WorkCompletion};

const MODES: [Progress; 3] = [
    Progress::Busy,
    Progress::Adaptive {
        spin: Duration::from_micros(200),
    },
    Progress::Blocking,
];

fn pair_in(mode: Progress) -> (Side, Side) {
    let a = Side::on(&Device::open_with("client", mode).unwrap(), None);
    let b = Side::on(&Device::open_with("server", mode).unwrap(), None);
    connect_with(&a, &b, MpaParams::default(), MpaParams::default());
    (a, b)
}

/// Whether the CQ's event fd becomes readable within `ms`.
fn readable(cq: &CompletionQueue, ms: u16) -> bool {
    let mut fds = [PollFd::new(cq.as_fd(), PollFlags::POLLIN)];
    nix::poll::poll(&mut fds, PollTimeout::from(ms)).unwrap() == 1
}

fn send(side: &Side, wr_id: u64, solicited: bool) {
    side.post(
        wr_id,
        SendOp::Send {
            solicited,
            invalidate: None,
        },
        vec![side.mr.sge(0, 8)],
    );
}

/// The event loop of a program on a completion channel (qperf's): arm,
/// poll once, sleep on the fd while that found nothing, take the event.
/// Returns the completions.
fn event_wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::BLANK; 4];
    while out.len() < n {
        cq.req_notify(false);
        let got = cq.poll(&mut buf[..(n - out.len()).min(4)]);
        out.extend_from_slice(&buf[..got]);
        if got == 0 {
            assert!(
                readable(cq, 10_000),
                "no notification within 10 s ({} of {n})",
                out.len()
            );
            cq.ack_events();
        }
    }
    out
}

/// Both sides sleep on their notifications (a poll of the armed CQ that
/// finds nothing drives its QPs but leaves them with the engine): every
/// message wakes its receiver, and the engine never parks a QP for an
/// application thread that is in fact asleep.
#[test]
fn an_application_asleep_on_notifications_is_woken_by_each_arrival() {
    for mode in MODES {
        let (a, b) = pair_in(mode);
        let rounds = 200u64;
        for i in 0..rounds {
            b.recv(100 + i, 4096, 64);
            a.recv(300 + i, 4096, 64);
        }
        // Setting up the connection drove the QPs from this thread; arming
        // hands them to the engines before the first message can arrive.
        a.cq.req_notify(false);
        b.cq.req_notify(false);
        std::thread::scope(|s| {
            let b = &b;
            s.spawn(move || {
                for i in 0..rounds {
                    let c = event_wait(&b.cq, 1);
                    assert_eq!((c[0].wr_id, c[0].opcode), (100 + i, WcOpcode::Recv));
                    send(b, 200 + i, false);
                    let c = event_wait(&b.cq, 1);
                    assert_eq!((c[0].wr_id, c[0].status), (200 + i, WcStatus::Success));
                }
            });
            for i in 0..rounds {
                send(&a, 400 + i, false);
                let mut got = event_wait(&a.cq, 2);
                got.sort_by_key(|c| c.wr_id);
                assert_eq!((got[0].wr_id, got[1].wr_id), (300 + i, 400 + i), "{mode}");
            }
        });
        assert_eq!(a.dev.engine_parks(), 0, "{mode}: client arrivals parked");
        assert_eq!(b.dev.engine_parks(), 0, "{mode}: server arrivals parked");
    }
}

/// A thread in `wait_notified` on the armed CQ's fd sleeps on the QP's
/// socket itself: the peer's Send wakes it, it delivers the completion
/// and the notification, and returns; a Read request meanwhile is
/// answered by it or the engine without any completion on its side.
#[test]
fn wait_notified_drives_the_sockets_of_armed_cqs() {
    for mode in MODES {
        let (a, b) = pair_in(mode);
        for i in 0..100u64 {
            b.recv(100 + i, 4096, 64);
        }
        for i in 0..100u64 {
            b.mr.region().store_u64(64, i).unwrap();
            let (armed_tx, armed_rx) = std::sync::mpsc::channel();
            std::thread::scope(|s| {
                let b = &b;
                let waiter = s.spawn(move || {
                    b.cq.req_notify(false);
                    armed_tx.send(()).unwrap();
                    CompletionQueue::wait_notified(
                        b.cq.as_fd(),
                        std::slice::from_ref(&b.cq),
                        Some(Duration::from_secs(10)),
                        &|| false,
                    )
                    .unwrap()
                });
                // Armed before anything is sent: the Send's completion
                // must fire it, whoever delivers it.
                armed_rx.recv().unwrap();
                a.post(
                    1,
                    SendOp::Read {
                        remote: b.mr.remote(64),
                    },
                    vec![a.mr.sge(0, 8)],
                );
                send(&a, 2, false);
                assert!(waiter.join().unwrap(), "{mode}: no notification in 10 s");
            });
            b.cq.ack_events();
            let c = wait_cq(&b.cq, 1);
            assert_eq!(
                (c[0].wr_id, c[0].opcode),
                (100 + i, WcOpcode::Recv),
                "{mode}"
            );
            let c = wait_cq(&a.cq, 2);
            assert!(
                c.iter().all(|c| c.status == WcStatus::Success),
                "{mode}: {c:?}"
            );
            assert_eq!(a.mr.region().load_u64(0).unwrap(), i, "{mode}");
        }
    }
}

/// Armed for solicited completions only: an unsolicited Send's completion
/// is queued without an event, a solicited one fires it.
#[test]
fn solicited_only_arming_wakes_only_for_solicited_sends() {
    for mode in MODES {
        let (a, b) = pair_in(mode);
        for i in 0..4u64 {
            b.recv(100 + i, 4096, 64);
        }
        b.cq.req_notify(true);
        send(&a, 1, false);
        // Nobody on b polls: its engine (or nobody, in blocking mode with
        // no waiter) delivers. Watch the queue without driving.
        let deadline = Instant::now() + Duration::from_secs(10);
        while b.cq.is_empty() {
            assert!(Instant::now() < deadline, "{mode}: Send never delivered");
            std::thread::yield_now();
        }
        assert!(!readable(&b.cq, 0), "{mode}: fired for an unsolicited Send");
        assert!(b.cq.is_armed(), "{mode}");
        send(&a, 2, true);
        assert!(
            readable(&b.cq, 10_000),
            "{mode}: no event for a solicited Send"
        );
        assert_eq!(b.cq.ack_events(), 1, "{mode}");
        assert!(!b.cq.is_armed(), "{mode}: one event per arming");
        let c = wait_cq(&b.cq, 2);
        assert!(c[1].solicited && !c[0].solicited, "{mode}: {c:?}");
        // Disarmed: further completions fire nothing until re-armed.
        send(&a, 3, true);
        let _ = wait_cq(&b.cq, 1);
        assert!(!readable(&b.cq, 0), "{mode}: fired while disarmed");
    }
}

/// A sender as fast as it can go against the drain / arm / drain / sleep
/// loop: whatever lands between the drain and the arming is caught by the
/// second drain or fires the event; none is left behind a sleep.
#[test]
fn no_wake_up_is_lost_between_drain_and_arm() {
    for mode in MODES {
        let (a, b) = pair_in(mode);
        // Every receive posted up front (iWARP has no receiver-not-ready
        // retry). The sender sends a burst, then waits until the consumer
        // has armed and is about to sleep: each burst races the consumer's
        // drain and arming, and every burst's end meets a sleeper.
        let total = 1000u64;
        let burst = 64u64;
        let b = Arc::new(b);
        for i in 0..total {
            b.recv(i, 4096, 64);
        }
        let idle = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let consumer = {
            let b = b.clone();
            let idle = idle.clone();
            std::thread::spawn(move || {
                let mut got = 0u64;
                let mut sleeps = 0u64;
                let mut buf = [WorkCompletion::BLANK; 16];
                while got < total {
                    let n = b.cq.poll(&mut buf) as u64;
                    for c in &buf[..n as usize] {
                        assert_eq!((c.wr_id, c.status), (got, WcStatus::Success));
                        got += 1;
                    }
                    if n > 0 {
                        continue;
                    }
                    b.cq.req_notify(false);
                    if !b.cq.is_empty() {
                        continue;
                    }
                    idle.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    assert!(
                        readable(&b.cq, 10_000),
                        "lost wake-up after {got} of {total}"
                    );
                    b.cq.ack_events();
                    sleeps += 1;
                }
                sleeps
            })
        };
        let mut sent = 0u64;
        while sent < total {
            let seen = idle.load(std::sync::atomic::Ordering::SeqCst);
            let n = burst.min(total - sent);
            for _ in 0..n {
                send(&a, sent, false);
                sent += 1;
            }
            wait_cq(&a.cq, n as usize);
            let deadline = Instant::now() + Duration::from_secs(10);
            while sent < total && idle.load(std::sync::atomic::Ordering::SeqCst) == seen {
                assert!(
                    Instant::now() < deadline,
                    "{mode}: the consumer never went idle"
                );
                std::thread::yield_now();
            }
        }
        let sleeps = consumer.join().unwrap();
        assert!(sleeps >= total / burst - 1, "{mode}: slept {sleeps} times");
    }
}

/// A thread woken in `wait_notified` by its socket keeps that socket for
/// its next wait (the engine holds the QP until its recheck); when it
/// does not come back, the engine still answers the peer: 50 Reads
/// posted after the waiter left, with nobody on the responder's side
/// polling or waiting, all complete (in every mode; a held QP that the
/// engine never took back would leave them unanswered for 10 s).
#[test]
fn a_socket_kept_after_a_wait_goes_back_to_the_engine() {
    for mode in MODES {
        let (a, b) = pair_in(mode);
        b.recv(100, 4096, 64);
        b.mr.region().store_u64(64, 7).unwrap();
        let (armed_tx, armed_rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            let b = &b;
            let waiter = s.spawn(move || {
                b.cq.req_notify(false);
                armed_tx.send(()).unwrap();
                CompletionQueue::wait_notified(
                    b.cq.as_fd(),
                    std::slice::from_ref(&b.cq),
                    Some(Duration::from_secs(10)),
                    &|| false,
                )
                .unwrap()
            });
            armed_rx.recv().unwrap();
            send(&a, 1, false);
            assert!(waiter.join().unwrap(), "{mode}: no notification in 10 s");
        });
        b.cq.ack_events();
        // The waiter has gone; b's QP is not polled again.
        for i in 0..50u64 {
            a.post(
                10 + i,
                SendOp::Read {
                    remote: b.mr.remote(64),
                },
                vec![a.mr.sge(0, 8)],
            );
            let c = wait_cq(&a.cq, if i == 0 { 2 } else { 1 });
            assert!(
                c.iter().all(|c| c.status == WcStatus::Success),
                "{mode}: {c:?}"
            );
            assert_eq!(a.mr.region().load_u64(0).unwrap(), 7, "{mode}");
        }
        assert_eq!(b.cq.len(), 1, "{mode}: only the Receive completed on b");
    }
}

/// rping's pattern, on b: one thread posts Sends while another sleeps on
/// the CQ's notifications, and the peer's Read Requests and Sends arrive
/// on the socket that sleeper keeps. The sleeper starts and ends its
/// waits without the QP's lock when the socket stays held, and drives a
/// socket that woke it under the lock, behind the posting thread: every
/// Read is answered, every Send and Receive completes, in every mode.
#[test]
fn a_thread_posting_beside_a_channel_sleeper_loses_nothing() {
    const ROUNDS: u64 = 300;
    for mode in MODES {
        let (a, b) = pair_in(mode);
        for i in 0..4u64 {
            a.recv(1000 + i, 4096, 64);
            b.recv(2000 + i, 4096, 64);
        }
        let (recv_tx, recv_rx) = std::sync::mpsc::channel::<u64>();
        std::thread::scope(|s| {
            let b = &b;
            // b's completion thread: arm, poll, sleep on the notification
            // (its QP's socket too), and hand each Receive to b's poster.
            s.spawn(move || {
                let mut got = 0;
                let mut sends = 0;
                let mut buf = [WorkCompletion::BLANK; 4];
                while got < ROUNDS || sends < ROUNDS {
                    b.cq.req_notify(false);
                    let n = b.cq.poll(&mut buf);
                    for wc in &buf[..n] {
                        assert_eq!(wc.status, WcStatus::Success, "{mode}: {wc:?}");
                        match wc.opcode {
                            WcOpcode::Recv => {
                                b.recv(wc.wr_id, 4096, 64);
                                got += 1;
                                recv_tx.send(got).unwrap();
                            }
                            _ => sends += 1,
                        }
                    }
                    if n == 0 {
                        let woke = CompletionQueue::wait_notified(
                            b.cq.as_fd(),
                            std::slice::from_ref(&b.cq),
                            Some(Duration::from_secs(10)),
                            &|| false,
                        )
                        .unwrap();
                        assert!(woke, "{mode}: no notification in 10 s");
                        b.cq.ack_events();
                    }
                }
            });
            // a: wait for b's Send, read b's memory, answer with a Send.
            s.spawn(|| {
                for i in 0..ROUNDS {
                    let c = wait_cq(&a.cq, 1);
                    assert_eq!(c[0].opcode, WcOpcode::Recv, "{mode}: {c:?}");
                    a.recv(c[0].wr_id, 4096, 64);
                    a.post(
                        1,
                        SendOp::Read {
                            remote: b.mr.remote(64),
                        },
                        vec![a.mr.sge(0, 8)],
                    );
                    let c = wait_cq(&a.cq, 1);
                    assert_eq!(c[0].status, WcStatus::Success, "{mode}: {c:?}");
                    assert_eq!(a.mr.region().load_u64(0).unwrap(), i, "{mode}");
                    send(&a, 2, false);
                    let c = wait_cq(&a.cq, 1);
                    assert_eq!(c[0].status, WcStatus::Success, "{mode}: {c:?}");
                }
            });
            // b's poster: a Send per round, then wait for a's answer.
            for i in 0..ROUNDS {
                b.mr.region().store_u64(64, i).unwrap();
                send(b, 3, false);
                let got = recv_rx
                    .recv_timeout(Duration::from_secs(10))
                    .unwrap_or_else(|_| panic!("{mode}: round {i}: no answer in 10 s"));
                assert_eq!(got, i + 1, "{mode}");
            }
        });
    }
}
