//! The emulation layer, forced on a device that would not need it, so that
//! its correctness (not just its presence) is tested everywhere: masked
//! atomics and Swap by CmpSwap retry loops, under contention.

mod common;

use std::sync::Barrier;

use common::*;
use verbs::{CompletionKind, OpKind, SendOp, Support};

const EMULATED: [OpKind; 3] = [OpKind::MaskedFetchAdd, OpKind::MaskedCmpSwap, OpKind::Swap];

#[test]
fn forced_emulation_shows_in_the_matrix() {
    let ctx = verbs::Context::open_with(&device(), &emulating(&EMULATED)).unwrap();
    for op in EMULATED {
        assert!(
            matches!(ctx.capabilities().get(op), Support::Emulated { .. }),
            "{op}"
        );
    }
    assert_eq!(ctx.capabilities().get(OpKind::FetchAdd), &Support::Native);
}

#[test]
fn emulated_masked_fetch_add_and_swap_are_exact() {
    let (c, s) = pair_with(&emulating(&EMULATED), 0);
    s.mr.store_u64(0, 0x0000_0001_ffff_ffff).unwrap();
    c.post(
        1,
        SendOp::FetchAdd {
            remote: s.mr.remote(0),
            add: 0x0000_0001_0000_0001,
            mask: 0x8000_0000_8000_0000,
        },
        &[(0, 8)],
    );
    assert_eq!(
        c.wait().kind,
        CompletionKind::FetchAdd {
            original: 0x0000_0001_ffff_ffff
        }
    );
    assert_eq!(s.mr.load_u64(0).unwrap(), 0x0000_0002_0000_0000);
    assert_eq!(
        c.mr.load_u64(0).unwrap(),
        0x0000_0001_ffff_ffff,
        "original in the local slice"
    );
    c.post(
        2,
        SendOp::Swap {
            remote: s.mr.remote(0),
            swap: 77,
        },
        &[(8, 8)],
    );
    assert_eq!(
        c.wait().kind,
        CompletionKind::Swap {
            original: 0x0000_0002_0000_0000
        }
    );
    assert_eq!(s.mr.load_u64(0).unwrap(), 77);
    // A masked compare that fails writes nothing and reports the value.
    c.post(
        3,
        SendOp::CmpSwap {
            remote: s.mr.remote(0),
            compare: 1,
            compare_mask: 0xff,
            swap: 0,
            swap_mask: u64::MAX,
        },
        &[(16, 8)],
    );
    assert_eq!(
        c.wait().kind,
        CompletionKind::CmpSwap {
            original: 77,
            swapped: false
        }
    );
    assert_eq!(s.mr.load_u64(0).unwrap(), 77);
}

/// Several clients, each on its own connection, hammer one counter with
/// emulated masked FetchAdds racing native plain ones; the CmpSwap loop
/// must lose no update.
#[test]
fn emulated_counter_is_exact_under_contention() {
    const CLIENTS: usize = 4;
    const ADDS: u64 = 150;
    let star = star(&emulating(&EMULATED), CLIENTS);
    let counter = star.server_mr.remote(0);
    let barrier = Barrier::new(CLIENTS);
    let originals: Vec<u64> = std::thread::scope(|scope| {
        let handles: Vec<_> = star
            .clients
            .iter()
            .enumerate()
            .map(|(t, c)| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    let mut seen = Vec::new();
                    for i in 0..ADDS {
                        // Half masked (emulated), half plain (native): the
                        // emulation must also survive native writers.
                        let mask = if (i + t as u64).is_multiple_of(2) {
                            1 << 63
                        } else {
                            0
                        };
                        c.post(
                            i,
                            SendOp::FetchAdd {
                                remote: counter,
                                add: 1,
                                mask,
                            },
                            &[(0, 8)],
                        );
                        let w = c.wait();
                        assert!(w.is_ok(), "{w:?}");
                        let CompletionKind::FetchAdd { original } = w.kind else {
                            panic!("{w:?}")
                        };
                        seen.push(original);
                    }
                    seen
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    assert_eq!(star.server_mr.load_u64(0).unwrap(), CLIENTS as u64 * ADDS);
    // Every add saw a distinct value: each was applied exactly once.
    let mut sorted = originals;
    sorted.sort_unstable();
    assert_eq!(sorted, (0..CLIENTS as u64 * ADDS).collect::<Vec<_>>());
}

/// A spin lock built on emulated masked CmpSwap: mutual exclusion holds.
#[test]
fn emulated_cmp_swap_lock_excludes() {
    let (c, s) = pair_with(&emulating(&EMULATED), 0);
    let lock = s.mr.remote(0);
    let mut acquisitions = 0;
    for round in 0..50u64 {
        // Acquire: compare the low byte with 0 (free), set it to 1.
        let mut tries = 0;
        loop {
            tries += 1;
            c.post(
                round,
                SendOp::CmpSwap {
                    remote: lock,
                    compare: 0,
                    compare_mask: 0xff,
                    swap: 1,
                    swap_mask: 0xff,
                },
                &[(0, 8)],
            );
            let w = c.wait();
            if let CompletionKind::CmpSwap { swapped: true, .. } = w.kind {
                break;
            }
            assert!(tries < 1000, "lock never became free");
        }
        acquisitions += 1;
        // While held, the high bytes carry a generation count the holder
        // bumps with a masked add that must not touch the lock byte.
        c.post(
            round,
            SendOp::FetchAdd {
                remote: lock,
                add: 1 << 8,
                mask: 1 << 63,
            },
            &[(8, 8)],
        );
        c.wait();
        assert_eq!(s.mr.load_u64(0).unwrap() & 0xff, 1, "held");
        // Release: swap the low byte back to 0.
        c.post(
            round,
            SendOp::CmpSwap {
                remote: lock,
                compare: 1,
                compare_mask: 0xff,
                swap: 0,
                swap_mask: 0xff,
            },
            &[(16, 8)],
        );
        assert!(matches!(
            c.wait().kind,
            CompletionKind::CmpSwap { swapped: true, .. }
        ));
    }
    assert_eq!(s.mr.load_u64(0).unwrap(), acquisitions << 8);
}
