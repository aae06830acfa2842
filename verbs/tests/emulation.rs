//! The emulation layer, forced on a device that would not need it, so that
//! its correctness (not just its presence) is tested everywhere: masked
//! atomics and Swap by CmpSwap retry loops, under contention.

mod common;

use std::sync::Barrier;

use common::*;
use verbs::{CompletionKind, OpKind, SendOp, Support};

extern crate provider;

const EMULATED: [OpKind; 4] = [
    OpKind::MaskedFetchAdd,
    OpKind::MaskedCmpSwap,
    OpKind::Swap,
    OpKind::AtomicWrite,
];

#[test]
fn forced_emulation_shows_in_the_matrix() {
    let plain = verbs::Context::open(&device()).unwrap();
    let ctx = verbs::Context::open_with(&device(), &emulating(&EMULATED)).unwrap();
    for op in EMULATED {
        assert!(
            matches!(ctx.capabilities().get(op), Support::Emulated { .. }),
            "{op}"
        );
    }
    // What was not forced stays as the device has it (native FetchAdd on
    // stag0 and rxe, the agent's on siw).
    assert_eq!(
        ctx.capabilities().get(OpKind::FetchAdd),
        plain.capabilities().get(OpKind::FetchAdd)
    );
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
    // Atomic Write through the loop: the value lands whole.
    c.post(
        4,
        SendOp::AtomicWrite {
            remote: s.mr.remote(0),
            value: u64::MAX - 1,
        },
        &[],
    );
    assert_eq!(c.wait().kind, CompletionKind::AtomicWrite);
    assert_eq!(s.mr.load_u64(0).unwrap(), u64::MAX - 1);
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

/// Everything the agent and the mailbox emulate, forced on both ends.
const AGENT: [OpKind; 5] = [
    OpKind::FetchAdd,
    OpKind::CmpSwap,
    OpKind::Commit,
    OpKind::Imm,
    OpKind::WriteImm,
];

#[test]
fn agent_runs_atomics_on_the_responder() {
    let (c, s) = pair_with(&emulating(&AGENT), 2);
    assert!(matches!(
        c.ctx.capabilities().get(OpKind::FetchAdd),
        Support::Emulated {
            method: verbs::Emulation::Agent,
            ..
        }
    ));
    s.mr.store_u64(8, 5).unwrap();
    c.post(
        1,
        SendOp::FetchAdd {
            remote: s.mr.remote(8),
            add: 10,
            mask: 0,
        },
        &[(0, 8)],
    );
    assert_eq!(c.wait().kind, CompletionKind::FetchAdd { original: 5 });
    c.post(
        2,
        SendOp::CmpSwap {
            remote: s.mr.remote(8),
            compare: 15,
            compare_mask: u64::MAX,
            swap: 1,
            swap_mask: u64::MAX,
        },
        &[(8, 8)],
    );
    assert_eq!(
        c.wait().kind,
        CompletionKind::CmpSwap {
            original: 15,
            swapped: true
        }
    );
    assert_eq!(s.mr.load_u64(8).unwrap(), 1);
    assert_eq!(
        c.mr.load_u64(0).unwrap(),
        5,
        "original lands in the local slice"
    );
    // The agent checks what an RNIC checks: misalignment and bounds.
    c.post(
        3,
        SendOp::FetchAdd {
            remote: s.mr.remote(12),
            add: 1,
            mask: 0,
        },
        &[(16, 8)],
    );
    let w = c.wait();
    assert_eq!(w.status, verbs::WcStatus::RemAccessErr, "{w:?}");
    c.post(
        4,
        SendOp::FetchAdd {
            remote: s.mr.remote((1 << 20) - 4),
            add: 1,
            mask: 0,
        },
        &[(16, 8)],
    );
    assert_eq!(c.wait().status, verbs::WcStatus::RemAccessErr);
    assert_eq!(
        s.mr.load_u64(8).unwrap(),
        1,
        "refused requests changed nothing"
    );
}

#[test]
fn agent_refuses_regions_of_another_pd() {
    let (c, s) = pair_with(&emulating(&AGENT), 0);
    let other_pd = s.ctx.alloc_pd().unwrap();
    let foreign = other_pd.alloc_mr(4096, ALL).unwrap();
    foreign.store_u64(0, 7).unwrap();
    c.post(
        1,
        SendOp::FetchAdd {
            remote: foreign.remote(0),
            add: 1,
            mask: 0,
        },
        &[(0, 8)],
    );
    assert_eq!(c.wait().status, verbs::WcStatus::RemAccessErr);
    assert_eq!(foreign.load_u64(0).unwrap(), 7);
}

#[test]
fn agent_counter_is_exact_under_contention() {
    const CLIENTS: usize = 3;
    const ADDS: u64 = 100;
    let star = star(&emulating(&AGENT), CLIENTS);
    let counter = star.server_mr.remote(0);
    std::thread::scope(|scope| {
        for c in &star.clients {
            scope.spawn(move || {
                for i in 0..ADDS {
                    c.post(
                        i,
                        SendOp::FetchAdd {
                            remote: counter,
                            add: 1,
                            mask: 0,
                        },
                        &[(0, 8)],
                    );
                    assert!(c.wait().is_ok());
                }
            });
        }
    });
    assert_eq!(star.server_mr.load_u64(0).unwrap(), CLIENTS as u64 * ADDS);
}

#[test]
fn agent_commit_reaches_the_file() {
    let (c, s) = pair_with(&emulating(&AGENT), 0);
    let dir = std::env::temp_dir().join(format!("stag-agent-commit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("d.bin");
    let durable = s.pd.alloc_file_mr(&path, 1 << 16, ALL).unwrap();
    c.mr.write_at(0, b"agent-committed").unwrap();
    c.post(
        1,
        SendOp::Write {
            remote: durable.remote(4096),
        },
        &[(0, 15)],
    );
    c.post(
        2,
        SendOp::Commit {
            remote: durable.remote(4096),
            len: 15,
        },
        &[],
    );
    assert_eq!(c.wait().kind, CompletionKind::Write);
    let done = c.wait();
    assert_eq!(
        (done.status, done.kind),
        (verbs::WcStatus::Success, CompletionKind::Commit)
    );
    assert_eq!(
        &std::fs::read(&path).unwrap()[4096..4111],
        b"agent-committed"
    );
    // Without flush rights the agent answers with a failure status.
    let plain = s.pd.alloc_mr(4096, verbs::Access::REMOTE_WRITE).unwrap();
    c.post(
        3,
        SendOp::Commit {
            remote: plain.remote(0),
            len: 8,
        },
        &[],
    );
    let failed = c.wait();
    assert_ne!(failed.status, verbs::WcStatus::Success);
    assert_ne!(failed.vendor_err, 0);
    drop(durable);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mailbox_immediate_data_is_told_apart_from_empty_sends() {
    let (c, s) = pair_with(&emulating(&AGENT), 0);
    for i in 0..4 {
        s.qp.post_recv(i, &[]).unwrap();
    }
    c.post(
        1,
        SendOp::Imm {
            imm: 0xabcd,
            solicited: true,
        },
        &[],
    );
    c.post(
        2,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        &[],
    );
    c.mr.write_at(0, b"payload").unwrap();
    c.post(
        3,
        SendOp::WriteImm {
            remote: s.mr.remote(100),
            imm: u64::MAX,
        },
        &[(0, 7)],
    );
    c.post(
        4,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        &[],
    );
    let kinds: Vec<CompletionKind> = (0..4).map(|_| c.wait().kind).collect();
    assert_eq!(
        kinds,
        [
            CompletionKind::Imm,
            CompletionKind::Send,
            CompletionKind::Write,
            CompletionKind::Send
        ]
    );
    let imms: Vec<Option<u64>> = (0..4)
        .map(|_| match s.wait().kind {
            CompletionKind::Recv { imm, len: 0, .. } => imm,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(imms, [Some(0xabcd), None, Some(u64::MAX), None]);
    assert_eq!(s.mr.to_vec(100, 7).unwrap(), b"payload");
}

#[test]
fn agent_emulation_against_a_peer_without_stag_is_refused() {
    // The peer is the bare userspace provider: no stag header, no agent.
    let dev = provider::device::Device::open("bare").unwrap();
    let pd = dev.alloc_pd();
    let pcq = provider::cq::CompletionQueue::new(64).unwrap();
    let pqp = pd.create_qp(provider::qp::QpCaps::default(), &pcq, &pcq, None);
    let listener = provider::device::Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let ctx =
        verbs::Context::open_with(verbs::device::USERSPACE_DEVICE, &emulating(&AGENT)).unwrap();
    let vpd = ctx.alloc_pd().unwrap();
    let vcq = ctx.create_cq(64).unwrap();
    let mr = vpd.alloc_mr(4096, ALL).unwrap();
    let qp = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let req = listener.accept().unwrap();
            req.accept(&pqp, &provider::setup::MpaParams::default())
                .unwrap();
        });
        let (qp, _) = verbs::connect(&vpd, &vcq, addr, &verbs::ConnectOptions::default()).unwrap();
        h.join().unwrap();
        qp
    });
    let local = [mr.slice(0, 8).unwrap()];
    let wr = verbs::WorkRequest::new(
        1,
        SendOp::FetchAdd {
            remote: verbs::Remote { addr: 0, rkey: 0 },
            add: 1,
            mask: 0,
        },
        &local,
    );
    match qp.post_send(wr) {
        Err(verbs::Error::Unsupported {
            op: OpKind::FetchAdd,
            ..
        }) => {}
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

/// Two threads polling the receiving CQ at once still pair every mailbox
/// entry with its own zero-length receive: Immediate Data and empty Sends,
/// interleaved, each arrive in the receive they consumed.
#[test]
fn mailbox_survives_concurrent_pollers() {
    const ROUNDS: u64 = 20;
    const N: u64 = 250;
    let (c, s) = pair_with(&emulating(&AGENT), 0);
    for round in 0..ROUNDS {
        mailbox_round(&c, &s, round * N..(round + 1) * N);
    }
}

/// Receive i is consumed by message i: Immediate Data 1000 + i when i is
/// even, an empty Send when odd. A failure names what was lost: the
/// receives that never completed and any send that failed at the client
/// (a send queue in Error loses everything after it).
fn mailbox_round(c: &End, s: &End, ids: std::ops::Range<u64>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    let expect = |i: u64| i.is_multiple_of(2).then_some(1000 + i);
    for i in ids.clone() {
        s.qp.post_recv(i, &[]).unwrap();
    }
    let n = ids.clone().count();
    let got = std::sync::Mutex::new(Vec::<verbs::Completion>::new());
    let send_errors = std::sync::Mutex::new(Vec::<verbs::Completion>::new());
    let sender_failed = AtomicBool::new(false);
    let missing = || {
        let got = got.lock().unwrap();
        let seen: std::collections::HashSet<u64> = got.iter().map(|r| r.wr_id).collect();
        let lost: Vec<u64> = ids.clone().filter(|i| !seen.contains(i)).collect();
        let errors = send_errors.lock().unwrap();
        format!(
            "round {ids:?}: {} of {n} receives completed; missing {lost:?}; \
             {} client send errors, the first: {:?}",
            got.len(),
            errors.len(),
            &errors[..errors.len().min(3)]
        )
    };
    // The client's completions: every one must be a success.
    let drain_client = |max: usize| {
        let mut out = Vec::new();
        c.cq.poll(&mut out, max).unwrap();
        let bad: Vec<_> = out.into_iter().filter(|r| !r.is_ok()).collect();
        if !bad.is_empty() {
            send_errors.lock().unwrap().extend(bad);
            sender_failed.store(true, Ordering::Release);
        }
    };
    std::thread::scope(|sc| {
        for _ in 0..2 {
            sc.spawn(|| {
                let deadline = Instant::now() + Duration::from_secs(60);
                let mut out = Vec::new();
                while got.lock().unwrap().len() < n && !sender_failed.load(Ordering::Acquire) {
                    assert!(Instant::now() < deadline, "receives missing: {}", missing());
                    out.clear();
                    s.cq.poll(&mut out, 3).unwrap();
                    got.lock().unwrap().extend(out.iter().copied());
                }
            });
        }
        for i in ids.clone() {
            if sender_failed.load(Ordering::Acquire) {
                break;
            }
            let op = match expect(i) {
                Some(imm) => SendOp::Imm {
                    imm,
                    solicited: false,
                },
                None => SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
            };
            c.qp.post_send(verbs::WorkRequest {
                signaled: false,
                ..verbs::WorkRequest::new(i, op, &[])
            })
            .unwrap();
            // Keep the send queue (and the mailbox) from overflowing.
            while c.qp.outstanding() > 64 {
                drain_client(16);
            }
        }
        // Every send acknowledged (or failed): nothing of the client's is
        // left behind for the next round.
        let deadline = Instant::now() + Duration::from_secs(60);
        while c.qp.outstanding() > 0 {
            assert!(
                Instant::now() < deadline,
                "sends outstanding: {}",
                missing()
            );
            drain_client(16);
        }
    });
    assert!(!sender_failed.load(Ordering::Acquire), "{}", missing());
    let got = got.into_inner().unwrap();
    assert_eq!(got.len(), n);
    for r in &got {
        match r.kind {
            CompletionKind::Recv { len: 0, imm, .. } => {
                assert_eq!(imm, expect(r.wr_id), "receive {}", r.wr_id)
            }
            other => panic!("{other:?}"),
        }
    }
}

/// RC's ordering rule across paths: native Writes, Swaps run by the
/// CmpSwap loop (two or more round trips), FetchAdds run by the peer's
/// agent (another connection) and Immediate Data through the mailbox (three
/// device WRs), posted interleaved on one QP, complete in posting order —
/// and each took effect.
#[test]
fn completions_leave_in_posting_order_whatever_path_each_took() {
    let (c, s) = pair_with(
        &emulating(&[OpKind::Swap, OpKind::FetchAdd, OpKind::Imm]),
        16,
    );
    assert!(matches!(
        c.qp.capabilities().get(OpKind::FetchAdd),
        Support::Emulated {
            method: verbs::Emulation::Agent,
            ..
        }
    ));
    const N: u64 = 40;
    let mut imms = 0;
    let mut adds = 0;
    for i in 0..N {
        let local = 1024 + i as usize * 8;
        match i % 4 {
            0 => {
                c.mr.store_u64(local, i).unwrap();
                c.post(
                    i,
                    SendOp::write(s.mr.remote(2048 + i as usize * 8)),
                    &[(local, 8)],
                );
            }
            1 => {
                adds += 1;
                c.post(i, SendOp::fetch_add(s.mr.remote(0), 1), &[(local, 8)]);
            }
            2 => c.post(i, SendOp::swap(s.mr.remote(8), i), &[(local, 8)]),
            _ => {
                imms += 1;
                c.post(i, SendOp::imm(i), &[]);
            }
        }
    }
    let order: Vec<(u64, verbs::WcStatus)> = (0..N)
        .map(|_| {
            let done = c.wait();
            (done.wr_id, done.status)
        })
        .collect();
    let expected: Vec<(u64, verbs::WcStatus)> =
        (0..N).map(|i| (i, verbs::WcStatus::Success)).collect();
    assert_eq!(order, expected, "completions in posting order");
    assert_eq!(s.mr.load_u64(0).unwrap(), adds);
    assert_eq!(s.mr.load_u64(8).unwrap(), N - 2, "the last Swap's value");
    for i in (0..N).step_by(4) {
        assert_eq!(s.mr.load_u64(2048 + i as usize * 8).unwrap(), i);
    }
    let arrived: Vec<Option<u64>> = (0..imms)
        .map(|_| match s.wait().kind {
            CompletionKind::Recv { imm, .. } => imm,
            other => panic!("{other:?}"),
        })
        .collect();
    let sent: Vec<Option<u64>> = (0..N).filter(|i| i % 4 == 3).map(Some).collect();
    assert_eq!(arrived, sent);
    // Each took the path the matrix names (on siw, whose device has no
    // atomics, the agent runs the Swaps too).
    let swaps = N / 4;
    let counters = c.qp.emulation_counters();
    match c.qp.capabilities().get(OpKind::Swap).emulation() {
        Some(verbs::Emulation::CasLoop) => {
            assert_eq!(counters.agent_requests, adds, "{counters:?}");
            assert!(counters.cas_steps >= 2 * swaps, "{counters:?}");
        }
        Some(verbs::Emulation::Agent) => {
            assert_eq!(counters.agent_requests, adds + swaps, "{counters:?}");
        }
        other => panic!("Swap forced through emulation, got {other:?}"),
    }
}
