//! A sender that outruns the Receives its peer posts (what InfiniBand
//! absorbs with RNR retries): on stag0 the message waits for its Receive
//! while the socket is not read, for at most `HOLD_LIMIT`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use provider::qp::{Event, QpState, HOLD_LIMIT};
use provider::wr::{SendOp, WcStatus};

const SEND: SendOp = SendOp::Send {
    solicited: false,
    invalidate: None,
};

/// 256 Sends of 16 KiB against a receiver that posts 8 Receives at a time
/// and re-posts only after it took their completions: every Send lands,
/// in order and intact, and no Terminate is sent.
#[test]
fn a_burst_waits_for_receives_and_arrives_whole() {
    const N: u64 = 256;
    const LEN: usize = 16 << 10;
    let (a, b) = pair();
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..N {
                // Message i carries its number in every octet, from one of
                // 64 slots of the 1 MiB MR, refilled only after the Send
                // that used it completed.
                let off = (i as usize % 64) * LEN;
                a.mr.region().write_at(off, &[i as u8; LEN]).unwrap();
                a.post(i, SEND, vec![a.mr.sge(off, LEN as u32)]);
                if i % 64 == 63 {
                    let wcs = a.wait(64);
                    assert!(
                        wcs.iter().all(|wc| wc.status == WcStatus::Success),
                        "{wcs:?}"
                    );
                }
            }
        });
        let mut next = 0u64;
        while next < N {
            let batch = (N - next).min(8);
            for k in 0..batch {
                let slot = ((next + k) % 8) as usize * LEN;
                b.recv(next + k, slot, LEN as u32);
            }
            let wcs = b.wait(batch as usize);
            for (k, wc) in wcs.iter().enumerate() {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                assert_eq!(wc.wr_id, next + k as u64, "in order");
                assert_eq!(wc.byte_len as usize, LEN);
                let slot = ((next + k as u64) % 8) as usize * LEN;
                let got = b.mr.region().to_vec(slot, LEN).unwrap();
                assert!(
                    got.iter().all(|&x| x == (next + k as u64) as u8),
                    "message {} intact",
                    next + k as u64
                );
            }
            next += batch;
            // A receiver that is slower than its sender.
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
    let evs = b.qp.take_events();
    assert!(
        !evs.iter().any(|e| matches!(e, Event::TerminateSent(_))),
        "{evs:?}"
    );
}

/// A receiver that posts no more Receives: the message that waits for
/// one becomes the no-buffer Terminate once `HOLD_LIMIT` passed, from the
/// engine (nobody drives the receiver), so that both sides end. The limit
/// counts from the last `post_recv` that let held input move on: a
/// Receive posted 1 s into a hold gives the next message its own 2 s.
#[test]
fn a_message_no_receive_takes_becomes_the_terminate_at_the_limit() {
    let (a, b) = pair();
    b.recv(1, 0, 64);
    for i in 1..=3 {
        a.post(i, SEND, vec![a.mr.sge(0, 64)]);
    }
    let wcs = a.wait(3);
    assert!(
        wcs.iter().all(|wc| wc.status == WcStatus::Success),
        "{wcs:?}"
    );
    assert_eq!(b.wait(1)[0].status, WcStatus::Success);
    std::thread::sleep(HOLD_LIMIT / 2);
    b.recv(2, 0, 64);
    assert_eq!(b.wait(1)[0].status, WcStatus::Success);
    let t0 = Instant::now();
    let ev = a.wait_event(|e| matches!(e, Event::TerminateReceived(_)));
    let waited = t0.elapsed();
    assert!(
        waited + Duration::from_millis(300) >= HOLD_LIMIT,
        "terminated {waited:?} after the second Receive: {ev:?}"
    );
    assert_eq!(b.qp.state(), QpState::Error);
    assert!(b
        .qp
        .take_events()
        .iter()
        .any(|e| matches!(e, Event::TerminateSent(_))));
}
