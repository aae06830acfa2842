//! The device's progress modes end to end: in every mode the responder
//! answers Reads and atomics and places Writes while its application never
//! drives the QP, and a thread waiting on a CQ gets its completion whether
//! it sleeps on the sockets itself (blocking) or leaves them to the engine
//! (busy, adaptive).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use provider::cq::CompletionQueue;
use provider::device::Device;
use provider::engine::{Progress, PARK_RECHECK};
use provider::setup::MpaParams;
use provider::wr::{SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion};

const MODES: [Progress; 4] = [
    Progress::Busy,
    Progress::Adaptive {
        spin: Duration::from_micros(200),
    },
    // A window so short that every request meets a sleeping engine.
    Progress::Adaptive {
        spin: Duration::from_micros(1),
    },
    Progress::Blocking,
];

fn pair_in(client: Progress, server: Progress) -> (Side, Side) {
    let a = Side::on(&Device::open_with("client", client).unwrap(), None);
    let b = Side::on(&Device::open_with("server", server).unwrap(), None);
    assert_eq!(b.dev.progress(), server);
    connect_with(&a, &b, MpaParams::default(), MpaParams::default());
    (a, b)
}

/// The server's application only holds its objects: every answer comes
/// from its engine.
#[test]
fn the_engine_answers_while_the_application_sleeps_in_every_mode() {
    for mode in MODES {
        let (a, b) = pair_in(Progress::Blocking, mode);
        for i in 0..200u64 {
            b.mr.region().store_u64(64, i * 3).unwrap();
            a.post(
                1,
                SendOp::Read {
                    remote: b.mr.remote(64),
                },
                vec![a.mr.sge(0, 8)],
            );
            a.post(
                2,
                SendOp::FetchAdd {
                    remote: b.mr.remote(128),
                    add: 1,
                    mask: 0,
                },
                vec![a.mr.sge(8, 8)],
            );
            let c = a.wait(2);
            assert!(
                c.iter().all(|c| c.status == WcStatus::Success),
                "{mode}: {c:?}"
            );
            assert_eq!(a.mr.region().load_u64(0).unwrap(), i * 3, "{mode}");
            assert_eq!(a.mr.region().load_u64(8).unwrap(), i, "{mode}");
            // Now and then let the engine's poll window run out.
            if i % 50 == 49 {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        assert_eq!(b.mr.region().load_u64(128).unwrap(), 200, "{mode}");
    }
}

/// A thread blocked in `wait` on the receiving side gets each Send's
/// completion, and its own replies' completions, in every mode.
#[test]
fn a_waiting_thread_gets_its_completions_in_every_mode() {
    for mode in MODES {
        let (a, b) = pair_in(mode, mode);
        let rounds = 100u64;
        // iWARP has no receiver-not-ready retry: a Send that finds no
        // receive kills the stream, so every receive is posted up front.
        for i in 0..rounds {
            b.recv(100 + i, 0, 64);
            a.recv(300 + i, 4096, 64);
        }
        std::thread::scope(|s| {
            let b = &b;
            s.spawn(move || {
                for i in 0..rounds {
                    let c = wait_blocking(&b.cq, 1);
                    assert_eq!((c[0].wr_id, c[0].opcode), (100 + i, WcOpcode::Recv));
                    b.post(
                        200 + i,
                        SendOp::Send {
                            solicited: false,
                            invalidate: None,
                        },
                        vec![b.mr.sge(0, 8)],
                    );
                    let c = wait_blocking(&b.cq, 1);
                    assert_eq!((c[0].wr_id, c[0].status), (200 + i, WcStatus::Success));
                }
            });
            for i in 0..rounds {
                a.mr.region().store_u64(0, i).unwrap();
                a.post(
                    400 + i,
                    SendOp::Send {
                        solicited: false,
                        invalidate: None,
                    },
                    vec![a.mr.sge(0, 8)],
                );
                let mut got = wait_blocking(&a.cq, 2);
                got.sort_by_key(|c| c.wr_id);
                assert_eq!(
                    (got[0].wr_id, got[0].byte_len, got[1].wr_id),
                    (300 + i, 8, 400 + i),
                    "{mode}"
                );
                assert_eq!(a.mr.region().load_u64(4096).unwrap(), i, "{mode}");
            }
        });
    }
}

/// A Write longer than a TCP segment, posted alone by a program that then
/// neither posts nor polls (it waits for the peer in memory, or
/// elsewhere): the doorbell holds its short last segment back for a next
/// post that never comes, and the engine's deadline writes it, in every
/// mode. Without that deadline the peer never sees the Write's last
/// octets.
#[test]
fn a_held_tail_reaches_the_peer_when_nobody_posts_or_polls_again() {
    const LEN: usize = 65536;
    for mode in MODES {
        let (a, b) = pair_in(mode, mode);
        let before = a.dev.tails_held();
        for round in 1..=20u64 {
            a.mr.region().store_u64(LEN - 8, round).unwrap();
            a.post(
                round,
                SendOp::Write {
                    remote: b.mr.remote(0),
                },
                vec![a.mr.sge(0, LEN as u32)],
            );
            let start = Instant::now();
            while b.mr.region().load_u64(LEN - 8).unwrap() != round {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "{mode}: round {round}: the Write's last octets never came"
                );
                std::hint::spin_loop();
            }
            let c = a.wait(1);
            assert_eq!((c[0].wr_id, c[0].status), (round, WcStatus::Success));
        }
        assert!(
            a.dev.tails_held() > before,
            "{mode}: no doorbell held a tail (nothing was tested)"
        );
    }
}

/// A stream of Writes posted one at a time: each doorbell's held tail goes
/// out in front of the next post's octets, and every Write lands whole.
#[test]
fn a_stream_of_single_posts_lands_whole_with_tails_held() {
    const LEN: usize = 65536;
    let (a, b) = pair_in(Progress::Blocking, Progress::Blocking);
    let before = a.dev.tails_held();
    let n = 200u64;
    for i in 1..=n {
        // Each Write to its own slot: the last 8 octets say which.
        let slot = (i % 8) as usize * LEN;
        a.mr.region().store_u64(slot + LEN - 8, i).unwrap();
        a.post(
            i,
            SendOp::Write {
                remote: b.mr.remote(slot),
            },
            vec![a.mr.sge(slot, LEN as u32)],
        );
        if i % 8 == 0 {
            let c = a.wait(8);
            assert!(c.iter().all(|c| c.status == WcStatus::Success), "{c:?}");
            for k in 0..8u64 {
                let slot = k as usize * LEN;
                let want = i - 8 + if k == 0 { 8 } else { k };
                let start = Instant::now();
                while b.mr.region().load_u64(slot + LEN - 8).unwrap() != want {
                    assert!(start.elapsed() < Duration::from_secs(10), "write {want}");
                    std::hint::spin_loop();
                }
            }
        }
    }
    assert!(a.dev.tails_held() > before, "no doorbell held a tail");
}

/// `n` completions through `CompletionQueue::wait` only.
fn wait_blocking(cq: &Arc<CompletionQueue>, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::BLANK; 4];
    while out.len() < n {
        let got = cq.wait(&mut buf[..n - out.len()], Duration::from_secs(10));
        assert!(got > 0, "no completion within 10 s ({} of {n})", out.len());
        out.extend_from_slice(&buf[..got]);
    }
    out
}

/// Poll `side`'s CQ (finding nothing) until its busy engine parks the
/// QP, leaving it to this thread.
fn poll_until_parked(side: &Side) {
    let mut buf = [WorkCompletion::BLANK; 4];
    let before = side.dev.engine_idle_parks();
    let start = Instant::now();
    while side.dev.engine_idle_parks() == before {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the polled QP was never parked"
        );
        assert_eq!(side.cq.poll(&mut buf), 0);
    }
}

/// A busy engine leaves a QP whose CQ the application spins on to that
/// thread without waiting for an arrival to race it for, and the QP stays
/// parked while the thread keeps polling: at most one park per recheck
/// period (it comes back only at a recheck that finds the thread idle,
/// preempted for a whole period). Without the look for driven QPs it was
/// never parked, and the engine spun beside the application; when the
/// first park's recheck came in the same turn of the engine's loop, it
/// was taken back at once and parked again at every look, ten times a
/// period.
#[test]
fn a_busy_engine_leaves_a_qp_the_application_polls_parked() {
    let (a, _b) = pair_in(Progress::Busy, Progress::Busy);
    let mut buf = [WorkCompletion::BLANK; 4];
    poll_until_parked(&a);
    let parked = a.dev.engine_idle_parks();
    let spin = Duration::from_millis(50);
    let start = Instant::now();
    while start.elapsed() < spin {
        assert_eq!(a.cq.poll(&mut buf), 0);
    }
    let again = a.dev.engine_idle_parks() - parked;
    let periods = (start.elapsed().as_micros() / PARK_RECHECK.as_micros()) as u64;
    assert!(
        again <= periods + 1,
        "parked {again} more times in {periods} recheck periods"
    );
}

/// A poll that drives in more completions than it may take hands the
/// first straight to its caller and queues the rest behind it, in order:
/// the receives of eight Sends that arrive in one read come out one per
/// poll, in posting order.
#[test]
fn a_drive_that_completes_more_than_the_poll_takes_keeps_their_order() {
    let (a, b) = pair_in(Progress::Busy, Progress::Busy);
    for i in 0..8u64 {
        b.recv(i, 64 * i as usize, 64);
    }
    // b's thread polls until its engine stands back, so that b's next
    // polls read the socket themselves.
    poll_until_parked(&b);
    let mut one = [WorkCompletion::BLANK; 1];
    // One list, one socket write: the eight arrive together.
    let mut post = a.qp.start_post();
    for i in 0..8u64 {
        a.mr.region().write_at(i as usize, &[i as u8]).unwrap();
        post.push(SendWr {
            wr_id: 100 + i,
            op: SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            sg_list: vec![a.mr.sge(i as usize, 1)],
            signaled: true,
            fence: false,
        })
        .unwrap();
    }
    post.post();
    let mut got = Vec::new();
    let start = Instant::now();
    while got.len() < 8 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "only {got:?} arrived"
        );
        if b.cq.poll(&mut one) == 1 {
            got.push((one[0].wr_id, one[0].status, one[0].opcode, one[0].byte_len));
        }
    }
    let want: Vec<_> = (0..8u64)
        .map(|i| (i, WcStatus::Success, WcOpcode::Recv, 1))
        .collect();
    assert_eq!(got, want);
    for i in 0..8u64 {
        assert_eq!(b.mr.region().to_vec(64 * i as usize, 1).unwrap(), [i as u8]);
    }
}
