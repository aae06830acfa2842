//! Every operation of the API once, on `$STAG_DEVICE`, through whatever
//! the capability matrix says (native or emulated), with its result.

mod common;

use common::*;
use std::time::{Duration, Instant};

use verbs::{CompletionKind, OpKind, PostPath, SendOp, Support, WcStatus, WorkRequest};

#[test]
fn send_and_receive() {
    let (c, s) = pair();
    c.mr.write_at(0, b"hello verbs").unwrap();
    c.post(
        1,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        &[(0, 11)],
    );
    let sent = c.wait();
    assert_eq!(
        (sent.wr_id, sent.status, sent.kind),
        (1, WcStatus::Success, CompletionKind::Send)
    );
    let got = s.wait();
    assert_eq!(got.wr_id, 1000);
    assert!(
        matches!(
            got.kind,
            CompletionKind::Recv {
                len: 11,
                imm: None,
                ..
            }
        ),
        "{got:?}"
    );
    assert_eq!(s.mr.to_vec(512 * 1024, 11).unwrap(), b"hello verbs");
}

#[test]
fn write_and_read() {
    let (c, s) = pair();
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    c.mr.write_at(0, &data).unwrap();
    c.post(
        1,
        SendOp::Write {
            remote: s.mr.remote(4096),
        },
        &[(0, data.len())],
    );
    assert_eq!(c.wait().kind, CompletionKind::Write);
    c.post(
        2,
        SendOp::Read {
            remote: s.mr.remote(4096),
        },
        &[(200_000, data.len())],
    );
    let r = c.wait();
    assert_eq!(
        (r.wr_id, r.status, r.kind),
        (2, WcStatus::Success, CompletionKind::Read)
    );
    assert_eq!(s.mr.to_vec(4096, data.len()).unwrap(), data);
    assert_eq!(c.mr.to_vec(200_000, data.len()).unwrap(), data);
}

#[test]
fn immediate_data_and_write_with_immediate() {
    let (c, s) = pair();
    c.mr.write_at(0, b"12345678").unwrap();
    c.post(
        1,
        SendOp::WriteImm {
            remote: s.mr.remote(64),
            imm: 0xfeed_face_cafe_beef,
        },
        &[(0, 8)],
    );
    c.post(
        2,
        SendOp::Imm {
            imm: 42,
            solicited: true,
        },
        &[],
    );
    assert_eq!(c.wait().kind, CompletionKind::Write);
    assert_eq!(c.wait().kind, CompletionKind::Imm);
    let first = s.wait();
    assert!(
        matches!(
            first.kind,
            CompletionKind::Recv {
                imm: Some(0xfeed_face_cafe_beef),
                ..
            }
        ),
        "{first:?}"
    );
    let second = s.wait();
    assert!(
        matches!(
            second.kind,
            CompletionKind::Recv {
                imm: Some(42),
                solicited: true,
                ..
            }
        ),
        "{second:?}"
    );
    assert_eq!(s.mr.to_vec(64, 8).unwrap(), b"12345678");
}

#[test]
fn atomics_native_or_emulated() {
    let (c, s) = pair();
    s.mr.store_u64(0, 10).unwrap();
    let r = s.mr.remote(0);
    c.post(
        1,
        SendOp::FetchAdd {
            remote: r,
            add: 5,
            mask: 0,
        },
        &[(0, 8)],
    );
    assert_eq!(c.wait().kind, CompletionKind::FetchAdd { original: 10 });
    c.post(
        2,
        SendOp::CmpSwap {
            remote: r,
            compare: 15,
            compare_mask: u64::MAX,
            swap: 100,
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
    c.post(
        3,
        SendOp::CmpSwap {
            remote: r,
            compare: 15,
            compare_mask: u64::MAX,
            swap: 7,
            swap_mask: u64::MAX,
        },
        &[(16, 8)],
    );
    assert_eq!(
        c.wait().kind,
        CompletionKind::CmpSwap {
            original: 100,
            swapped: false
        }
    );
    c.post(
        4,
        SendOp::Swap {
            remote: r,
            swap: 0x1_0000_0001,
        },
        &[(24, 8)],
    );
    assert_eq!(c.wait().kind, CompletionKind::Swap { original: 100 });
    // Two 32-bit lanes: the low lane's carry must not reach the high one.
    c.post(
        5,
        SendOp::FetchAdd {
            remote: r,
            add: 0xffff_ffff,
            mask: 0x8000_0000_8000_0000,
        },
        &[(32, 8)],
    );
    assert_eq!(
        c.wait().kind,
        CompletionKind::FetchAdd {
            original: 0x1_0000_0001
        }
    );
    assert_eq!(s.mr.load_u64(0).unwrap(), 0x1_0000_0000);
    // Masked CmpSwap: compare the high lane only, swap the low lane only.
    c.post(
        6,
        SendOp::CmpSwap {
            remote: r,
            compare: 0x1_dead_beef,
            compare_mask: 0xffff_ffff_0000_0000,
            swap: 0x9999_0000_0000_0077,
            swap_mask: 0xffff_ffff,
        },
        &[(40, 8)],
    );
    let done = c.wait();
    assert!(
        matches!(done.kind, CompletionKind::CmpSwap { swapped: true, .. }),
        "{done:?}"
    );
    assert_eq!(s.mr.load_u64(0).unwrap(), 0x1_0000_0077);
    // The original values also landed in the local slices, as in verbs.
    assert_eq!(c.mr.load_u64(0).unwrap(), 10);
    assert_eq!(c.mr.load_u64(24).unwrap(), 100);
    // Atomic Write: the value lands whole; no local slice.
    c.post(
        7,
        SendOp::AtomicWrite {
            remote: r,
            value: 0x0123_4567_89ab_cdef,
        },
        &[],
    );
    let done = c.wait();
    assert_eq!(
        (done.wr_id, done.status, done.kind),
        (7, WcStatus::Success, CompletionKind::AtomicWrite)
    );
    assert_eq!(s.mr.load_u64(0).unwrap(), 0x0123_4567_89ab_cdef);
    // ... and is refused with one.
    let err =
        c.qp.post_send(verbs::WorkRequest::new(
            8,
            SendOp::AtomicWrite {
                remote: r,
                value: 1,
            },
            &[c.mr.slice(48, 8).unwrap()],
        ))
        .unwrap_err();
    assert!(matches!(err, verbs::Error::InvalidRequest(_)), "{err}");
}

#[test]
fn commit_makes_written_bytes_durable() {
    let (c, s) = pair();
    let dir = std::env::temp_dir().join(format!("stag-verbs-commit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("durable.bin");
    let durable = s.pd.alloc_file_mr(&path, 1 << 16, ALL).unwrap();
    c.mr.write_at(0, b"on stable storage").unwrap();
    c.post(
        1,
        SendOp::Write {
            remote: durable.remote(100),
        },
        &[(0, 17)],
    );
    c.post(
        2,
        SendOp::Commit {
            remote: durable.remote(100),
            len: 17,
        },
        &[],
    );
    assert_eq!(c.wait().kind, CompletionKind::Write);
    let done = c.wait();
    assert_eq!(
        (done.status, done.kind),
        (WcStatus::Success, CompletionKind::Commit)
    );
    assert_eq!(
        &std::fs::read(&path).unwrap()[100..117],
        b"on stable storage"
    );
    drop(durable);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The operations every device must offer, natively or emulated: Send,
/// Write, Read, the RFC 7306 operations and Commit.
const REQUIRED: [OpKind; 12] = [
    OpKind::Send,
    OpKind::Write,
    OpKind::Read,
    OpKind::WriteImm,
    OpKind::Imm,
    OpKind::FetchAdd,
    OpKind::MaskedFetchAdd,
    OpKind::CmpSwap,
    OpKind::MaskedCmpSwap,
    OpKind::Swap,
    OpKind::AtomicWrite,
    OpKind::Commit,
];

#[test]
fn every_required_operation_is_available() {
    let ctx = verbs::Context::open(&device()).unwrap();
    let caps = ctx.capabilities();
    assert_eq!(caps.ops.len(), OpKind::ALL.len());
    for op in REQUIRED {
        let support = caps.get(op);
        assert!(support.is_available(), "{op} on {}: {support}", ctx.name());
    }
    // Send with Invalidate is not required (RFC 7306 and Commit are), but
    // it is either native or refused with the device's reason, never
    // emulated behind the application's back.
    match caps.get(OpKind::SendInvalidate) {
        Support::Native => {}
        Support::Unsupported { why } => assert!(
            why.contains("memory windows") && why.contains("user MRs"),
            "send-inv on {}: the reason should name the device limitation: {why}",
            ctx.name()
        ),
        other => panic!("send-inv on {}: {other}", ctx.name()),
    }
    if ctx.name() == verbs::device::USERSPACE_DEVICE {
        assert!(caps.ops.iter().all(|(_, s)| *s == Support::Native));
    }
}

#[test]
fn send_with_invalidate_where_native() {
    let (c, s) = pair();
    if *c.ctx.capabilities().get(OpKind::SendInvalidate) != Support::Native {
        // every_required_operation_is_available checks the reason.
        return;
    }
    let victim =
        s.pd.alloc_mr(4096, ALL.union(verbs::Access::REMOTE_INVALIDATE))
            .unwrap();
    let rkey = victim.rkey();
    c.mr.write_at(0, b"invalidate").unwrap();
    c.post(
        1,
        SendOp::Send {
            solicited: false,
            invalidate: Some(rkey),
        },
        &[(0, 10)],
    );
    let sent = c.wait();
    assert_eq!(
        (sent.status, sent.kind),
        (WcStatus::Success, CompletionKind::Send)
    );
    let got = s.wait();
    assert!(got.is_ok(), "{got:?}");
    let CompletionKind::Recv {
        len: 10,
        invalidated,
        ..
    } = got.kind
    else {
        panic!("{got:?}")
    };
    if s.ctx.backend_kind() == verbs::Backend::Userspace {
        assert_eq!(invalidated, Some(rkey));
    } else {
        // libsiw never sets IBV_WC_WITH_INV: the STag may go unreported,
        // but it is never a different one.
        assert!(invalidated.is_none_or(|k| k == rkey), "{got:?}");
    }
    assert_eq!(s.mr.to_vec(512 * 1024, 10).unwrap(), b"invalidate");
    // The STag is gone: a Read of it fails (a Write would complete
    // locally on iWARP before the peer refused it).
    c.post(
        2,
        SendOp::Read {
            remote: victim.remote(0),
        },
        &[(64, 8)],
    );
    let r = c.wait();
    assert_ne!(r.status, WcStatus::Success, "{r:?}");
}

/// A WR the device refuses (more SGEs than it takes) leaves nothing
/// behind: no table entry, and no place in the send queue's order that
/// would hold back the completions of the WRs after it.
#[test]
fn a_refused_post_leaves_no_entry_and_holds_back_nothing() {
    let (c, s) = pair();
    // A device may give a QP more SGEs than asked for (siw takes 6 on a QP
    // that asked for 4); 64 is beyond siw's, rxe's and stag0's limits.
    let many: Vec<_> = (0..64).map(|i| c.mr.slice(i * 8, 8).unwrap()).collect();
    let before = c.qp.outstanding();
    let op = SendOp::Write {
        remote: s.mr.remote(0),
    };
    let refused = c.qp.post_send(WorkRequest::new(1, op, &many));
    assert!(refused.is_err(), "64 SGEs: {refused:?}");
    assert_eq!(c.qp.outstanding(), before, "the refused WR's entry is gone");
    c.post(2, op, &[(0, 8)]);
    let done = c.wait();
    assert_eq!((done.wr_id, done.status), (2, WcStatus::Success));
    assert_eq!(c.qp.outstanding(), before);
}

/// A receive holds an entry (and its memory) from its post until its
/// completion is taken, in the receive table beside the send WRs', and a
/// receive the device refuses leaves none behind.
#[test]
fn a_receive_is_outstanding_until_its_completion_and_a_refused_one_leaves_nothing() {
    let (c, s) = pair();
    let setup = s.qp.outstanding();
    assert_eq!(setup, 4, "the receives posted at setup");
    let many: Vec<_> = (0..64).map(|i| s.mr.slice(i * 8, 8).unwrap()).collect();
    assert!(s.qp.post_recv(1, &many).is_err(), "64 SGEs");
    assert_eq!(
        s.qp.outstanding(),
        setup,
        "the refused receive's entry is gone"
    );
    s.recv(2, 0, 64);
    assert_eq!(s.qp.outstanding(), setup + 1);
    let send = SendOp::Send {
        solicited: false,
        invalidate: None,
    };
    let mut taken = Vec::new();
    for i in 0..5u64 {
        c.post(10 + i, send, &[(0, 8)]);
        assert_eq!(c.wait().wr_id, 10 + i);
        let r = s.wait();
        assert_eq!(r.status, WcStatus::Success, "{r:?}");
        taken.push(r.wr_id);
        assert_eq!(s.qp.outstanding(), setup - i as usize, "{taken:?}");
    }
    assert_eq!(taken, [1000, 1001, 1002, 1003, 2], "in the order posted");
    assert_eq!(c.qp.outstanding(), 4, "the client's own receives only");
}

#[test]
fn unsignaled_success_is_silent_but_errors_are_not() {
    let (c, s) = pair();
    let local = [c.mr.slice(0, 8).unwrap()];
    let mut wr = verbs::WorkRequest::new(
        1,
        SendOp::Write {
            remote: s.mr.remote(0),
        },
        &local,
    );
    wr.signaled = false;
    // The receives posted at setup are outstanding too.
    let before = c.qp.outstanding();
    c.qp.post_send(wr).unwrap();
    c.post(
        2,
        SendOp::Read {
            remote: s.mr.remote(0),
        },
        &[(64, 8)],
    );
    assert_eq!(
        c.wait().wr_id,
        2,
        "the unsignaled Write produced no completion"
    );
    assert_eq!(
        c.qp.outstanding(),
        before,
        "its table entry was released all the same"
    );
    let mut out = Vec::new();
    assert_eq!(c.cq.poll(&mut out, 8).unwrap(), 0);
}

#[test]
fn buffers_outlive_their_handles_while_posted() {
    let (c, s) = pair();
    // Post a receive on a region and drop every handle to it: the posted
    // WR keeps the memory mapped and registered until it completes.
    let mr = s.pd.alloc_mr(4096, ALL).unwrap();
    s.qp.post_recv(7, &[mr.slice(0, 64).unwrap()]).unwrap();
    drop(mr);
    // The first four receives were posted at setup; use them up first.
    for i in 0..4 {
        c.post(
            i,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            &[(0, 1)],
        );
        c.wait();
        s.wait();
    }
    c.mr.write_at(0, b"still here").unwrap();
    c.post(
        9,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        &[(0, 10)],
    );
    c.wait();
    let got = s.wait();
    assert_eq!(got.wr_id, 7);
    assert!(matches!(got.kind, CompletionKind::Recv { len: 10, .. }));
}

#[test]
fn peer_error_flushes_outstanding_receives() {
    let (c, s) = pair();
    // A Write to an STag the peer never registered: the peer terminates.
    let bogus = verbs::Remote {
        addr: s.mr.remote(0).addr,
        rkey: s.mr.rkey() ^ 0x5a,
    };
    c.post(1, SendOp::Write { remote: bogus }, &[(0, 8)]);
    let mut flushed = 0;
    for _ in 0..4 {
        let w = s.wait();
        assert_eq!(w.status, WcStatus::WrFlushErr, "{w:?}");
        flushed += 1;
    }
    assert_eq!(flushed, 4);
    let first = c.wait();
    assert_eq!(first.wr_id, 1);
}

/// QPs post the way the device's report says (the extended `ibv_wr_*` API
/// where the provider has it), and `legacy_post` moves them to
/// `ibv_post_send`; Send, Write, Read and an atomic work on either path.
#[test]
fn both_post_paths_carry_the_operations() {
    for legacy_post in [false, true] {
        let options = verbs::ContextOptions {
            legacy_post,
            ..verbs::ContextOptions::default()
        };
        let (c, s) = pair_with(&options, 1);
        let reported = c.ctx.capabilities().post_path;
        assert_eq!(c.qp.post_path(), reported, "legacy_post={legacy_post}");
        assert_eq!(s.qp.post_path(), reported, "legacy_post={legacy_post}");
        match c.ctx.backend_kind() {
            verbs::Backend::Userspace => assert_eq!(reported, PostPath::Userspace),
            verbs::Backend::Ibverbs if legacy_post => assert_eq!(reported, PostPath::Legacy),
            verbs::Backend::Ibverbs => {}
        }
        // The VM suite says which path each kernel device must take.
        if let Ok(want) = std::env::var("STAG_EXPECT_POST_PATH") {
            let want = match want.as_str() {
                "extended" => PostPath::Extended,
                "legacy" => PostPath::Legacy,
                other => panic!("STAG_EXPECT_POST_PATH={other}"),
            };
            if !legacy_post {
                assert_eq!(reported, want, "{}", c.ctx.name());
            }
        }

        c.mr.write_at(0, b"path").unwrap();
        c.post(
            1,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            &[(0, 4)],
        );
        assert_eq!(c.wait().status, WcStatus::Success);
        assert!(matches!(s.wait().kind, CompletionKind::Recv { len: 4, .. }));
        assert_eq!(s.mr.to_vec(512 * 1024, 4).unwrap(), b"path");

        c.post(
            2,
            SendOp::Write {
                remote: s.mr.remote(64),
            },
            &[(0, 4)],
        );
        assert_eq!(c.wait().kind, CompletionKind::Write);
        c.post(
            3,
            SendOp::Read {
                remote: s.mr.remote(64),
            },
            &[(128, 4)],
        );
        assert_eq!(c.wait().kind, CompletionKind::Read);
        assert_eq!(c.mr.to_vec(128, 4).unwrap(), b"path");

        s.mr.write_at(256, &7u64.to_ne_bytes()).unwrap();
        c.post(
            4,
            SendOp::FetchAdd {
                remote: s.mr.remote(256),
                add: 5,
                mask: 0,
            },
            &[(320, 8)],
        );
        let fa = c.wait();
        assert_eq!(
            (fa.status, fa.kind),
            (WcStatus::Success, CompletionKind::FetchAdd { original: 7 })
        );
        assert_eq!(s.mr.load_u64(256).unwrap(), 12);

        // Native only through ibv_wr_atomic_write: on ibv_post_send the
        // matrix moves it to the CmpSwap loop, and either way it lands.
        let aw = c.qp.capabilities().get(OpKind::AtomicWrite).clone();
        if legacy_post && c.ctx.backend_kind() == verbs::Backend::Ibverbs {
            assert_ne!(aw, Support::Native);
        }
        c.post(
            5,
            SendOp::AtomicWrite {
                remote: s.mr.remote(256),
                value: 99,
            },
            &[],
        );
        assert_eq!(c.wait().kind, CompletionKind::AtomicWrite, "{aw}");
        assert_eq!(s.mr.load_u64(256).unwrap(), 99);
    }
}

/// A thread sleeping in poll(2) on the CQ's fd wakes for a device
/// completion and for one the emulation layer makes on its own thread (a
/// FetchAdd answered by the peer's agent).
#[test]
fn completion_fd_wakes_a_sleeping_thread() {
    use std::os::fd::AsFd;
    for forced in [vec![], vec![OpKind::FetchAdd]] {
        let (c, s) = pair_with(&emulating(&forced), 1);
        s.mr.store_u64(0, 31).unwrap();
        let cq = c.cq.clone();
        let waiter = std::thread::spawn(move || {
            let mut wakes = 0;
            loop {
                let mut out = Vec::new();
                if cq.poll(&mut out, 4).unwrap() > 0 {
                    return (out, wakes);
                }
                if cq.req_notify().unwrap() {
                    continue;
                }
                let mut fds = [nix::poll::PollFd::new(
                    cq.as_fd(),
                    nix::poll::PollFlags::POLLIN,
                )];
                let n = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(20_000u16)).unwrap();
                assert!(n > 0, "the fd did not become readable ({forced:?})");
                wakes += 1;
            }
        });
        // Let the waiter reach poll(2) before anything can complete.
        std::thread::sleep(std::time::Duration::from_millis(200));
        c.post(
            1,
            SendOp::FetchAdd {
                remote: s.mr.remote(0),
                add: 1,
                mask: 0,
            },
            &[(0, 8)],
        );
        let (got, wakes) = waiter.join().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].kind, CompletionKind::FetchAdd { original: 31 });
        assert!(wakes >= 1, "the completion came without a wake-up");
        assert_eq!(s.mr.load_u64(0).unwrap(), 32);
    }
}

/// The emulation counters of both ends of a pair.
fn counters(c: &End, s: &End) -> (verbs::EmulationCounters, verbs::EmulationCounters) {
    (c.qp.emulation_counters(), s.qp.emulation_counters())
}

/// Operations `STAG_EXPECT_NATIVE` (comma-separated names) says must run
/// natively here: the VM suite sets it where the kernel and rdma-core have
/// them (rxe on Linux 6.12 with rdma-core 55: commit, atomic-write), so
/// that a matrix that silently fell back to emulation fails.
fn expected_native() -> Vec<OpKind> {
    std::env::var("STAG_EXPECT_NATIVE")
        .unwrap_or_default()
        .split(',')
        .filter(|n| !n.is_empty())
        .map(|n| OpKind::from_name(n).unwrap_or_else(|| panic!("STAG_EXPECT_NATIVE: {n}?")))
        .collect()
}

/// Write `data` at `remote`, then Commit it; both complete successfully.
fn write_and_commit(c: &End, remote: verbs::Remote, data: &[u8], wr_id: u64) {
    c.mr.write_at(0, data).unwrap();
    c.post(wr_id, SendOp::Write { remote }, &[(0, data.len())]);
    c.post(
        wr_id + 1,
        SendOp::Commit {
            remote,
            len: data.len() as u32,
        },
        &[],
    );
    let w = c.wait();
    assert_eq!(
        (w.status, w.kind),
        (WcStatus::Success, CompletionKind::Write)
    );
    let done = c.wait();
    assert_eq!(
        (done.wr_id, done.status, done.kind),
        (wr_id + 1, WcStatus::Success, CompletionKind::Commit)
    );
}

/// Commit takes the path the connection's matrix gives it, and the
/// emulation counters prove which one ran: a device FLUSH alone for a
/// memory region where Commit is native (after one question to the
/// responder's agent, which says the region is a FLUSH target), the
/// agent's msync for every Commit to a file-backed region, the agent for
/// everything where Commit is emulated.
#[test]
fn commit_takes_the_path_the_matrix_says() {
    let (c, s) = pair();
    let support = c.qp.capabilities().get(OpKind::Commit).clone();
    if expected_native().contains(&OpKind::Commit) {
        assert!(support.is_native(), "commit on {}: {support}", c.ctx.name());
    }
    let mem = s.mr.remote(8192);
    write_and_commit(&c, mem, b"commit round 0", 10);
    let (c0, s0) = counters(&c, &s);
    for round in 1..=5u64 {
        let data = format!("commit round {round}");
        write_and_commit(&c, mem, data.as_bytes(), 10 + 2 * round);
        assert_eq!(s.mr.to_vec(8192, data.len()).unwrap(), data.as_bytes());
    }
    let (c1, s1) = counters(&c, &s);
    let agent_asked = c1.agent_requests - c0.agent_requests;
    let agent_ran = s1.agent_served - s0.agent_served;
    match &support {
        // The device's Commit (stag0's RDMA Commit, or a FLUSH into a
        // region the agent named a FLUSH target after the first Commit):
        // one device round trip each, and no agent at either end.
        Support::Native | Support::NativeExcept { .. } => {
            assert_eq!((agent_asked, agent_ran), (0, 0), "{support}");
            assert_eq!(c1.device_round_trips - c0.device_round_trips, 5);
        }
        // The ordering Read, then the agent: two round trips each.
        Support::Emulated { .. } => {
            assert_eq!((agent_asked, agent_ran), (5, 5), "{support}");
            assert_eq!(c1.device_round_trips - c0.device_round_trips, 5);
        }
        Support::Unsupported { .. } => unreachable!("Commit is required"),
    }

    // A file-backed region reaches its file only by the responder's
    // msync: every Commit to one asks the agent, even where Commit is
    // native for memory (a device FLUSH reaches the page cache only).
    let dir = std::env::temp_dir().join(format!("stag-verbs-paths-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("durable.bin");
    let durable = s.pd.alloc_file_mr(&path, 1 << 16, ALL).unwrap();
    let (c0, s0) = counters(&c, &s);
    for round in 0..3u64 {
        let data = format!("durable round {round}");
        write_and_commit(&c, durable.remote(512), data.as_bytes(), 100 + 2 * round);
        assert_eq!(
            &std::fs::read(&path).unwrap()[512..512 + data.len()],
            data.as_bytes()
        );
    }
    let (c1, s1) = counters(&c, &s);
    let expect = if support == Support::Native { 0 } else { 3 };
    assert_eq!(
        (
            c1.agent_requests - c0.agent_requests,
            s1.agent_served - s0.agent_served
        ),
        (expect, expect),
        "{support}"
    );
    drop(durable);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Atomic Write takes the path the matrix gives it: natively no agent
/// request and no CmpSwap-loop step, one device round trip each.
#[test]
fn atomic_write_takes_the_path_the_matrix_says() {
    let (c, s) = pair();
    let support = c.qp.capabilities().get(OpKind::AtomicWrite).clone();
    if expected_native().contains(&OpKind::AtomicWrite) {
        assert_eq!(support, Support::Native, "atomic-write on {}", c.ctx.name());
    }
    let (c0, s0) = counters(&c, &s);
    for round in 1..=5u64 {
        let value = 0x5eed_0000_0000_0000 | round;
        c.post(
            round,
            SendOp::AtomicWrite {
                remote: s.mr.remote(128),
                value,
            },
            &[],
        );
        let done = c.wait();
        assert_eq!(
            (done.status, done.kind),
            (WcStatus::Success, CompletionKind::AtomicWrite)
        );
        assert_eq!(s.mr.load_u64(128).unwrap(), value);
    }
    let (c1, s1) = counters(&c, &s);
    let delta = (
        c1.agent_requests - c0.agent_requests,
        s1.agent_served - s0.agent_served,
        c1.cas_steps - c0.cas_steps,
        c1.device_round_trips - c0.device_round_trips,
    );
    match support.emulation() {
        None => assert_eq!(delta, (0, 0, 0, 5), "{support}"),
        // A Read and a CmpSwap each (no other writer races it here).
        Some(verbs::Emulation::CasLoop) => assert_eq!(delta, (0, 0, 10, 10), "{support}"),
        Some(_) => assert_eq!(delta, (5, 5, 0, 0), "{support}"),
    }
}

/// A post list leaves as the WRs would one by one: in order, each
/// completing, the data in place; a WR that fails stops the list there,
/// after the ones before it were posted.
#[test]
fn post_lists_post_in_order_and_stop_at_a_bad_work_request() {
    let (c, s) = pair();
    for i in 0..64u8 {
        c.mr.write_at(usize::from(i) * 16, &[i; 16]).unwrap();
    }
    let slices: Vec<_> = (0..64usize)
        .map(|i| c.mr.slice(i * 16, 16).unwrap())
        .collect();
    let writes: Vec<_> = (0..64u64)
        .map(|i| {
            WorkRequest::new(
                i,
                SendOp::Write {
                    remote: s.mr.remote(8192 + i as usize * 16),
                },
                std::slice::from_ref(&slices[i as usize]),
            )
        })
        .collect();
    c.qp.post_send_list(&writes).unwrap();
    for i in 0..64u64 {
        let done = c.wait();
        assert_eq!((done.wr_id, done.status), (i, WcStatus::Success));
    }
    // A Write's completion says it left; a Read behind it returns once the
    // Writes before it are placed (RDMAP ordering).
    c.post(
        99,
        SendOp::Read {
            remote: s.mr.remote(8192),
        },
        &[(65536, 8)],
    );
    assert_eq!(c.wait().wr_id, 99);
    for i in 0..64u8 {
        assert_eq!(
            s.mr.to_vec(8192 + usize::from(i) * 16, 16).unwrap(),
            [i; 16]
        );
    }

    // The second WR is an atomic with a 4-byte result buffer: refused at
    // post; the first was posted, the third not.
    let eight = [c.mr.slice(0, 8).unwrap()];
    let four = [c.mr.slice(4096, 4).unwrap()];
    let list = [
        WorkRequest::new(
            100,
            SendOp::Write {
                remote: s.mr.remote(0),
            },
            &eight,
        ),
        WorkRequest::new(101, SendOp::fetch_add(s.mr.remote(64), 1), &four),
        WorkRequest::new(
            102,
            SendOp::Write {
                remote: s.mr.remote(0),
            },
            &eight,
        ),
    ];
    let err = c.qp.post_send_list(&list).unwrap_err();
    assert_eq!(err.posted, 1, "{err}");
    assert_eq!(c.wait().wr_id, 100);
    assert!(
        c.cq.poll_one(Duration::from_millis(200)).unwrap().is_none(),
        "only the first WR was posted"
    );
}

/// A list longer than the send queue: the provider refuses the WR that
/// finds it full, past the emulation layer's first batches. The WRs before
/// it leave by themselves, with no poll of the CQ to push them (on stag0
/// the batches of a list wait for one doorbell at its end, and the failure
/// must ring it too). Kernel siw and rxe free a send queue slot once its
/// WR is processed, not once it is polled, so there the whole list may
/// fit: then every WR of it must leave the same way.
#[test]
fn a_list_that_overflows_the_send_queue_still_sends_what_fit() {
    const LIST: usize = 600;
    let (c, s) = pair();
    for i in 0..LIST {
        c.mr.write_at(i * 16, &(i as u128 + 1).to_le_bytes())
            .unwrap();
    }
    let slices: Vec<_> = (0..LIST).map(|i| c.mr.slice(i * 16, 16).unwrap()).collect();
    let list: Vec<_> = (0..LIST)
        .map(|i| {
            WorkRequest::new(
                i as u64,
                SendOp::Write {
                    remote: s.mr.remote(65536 + i * 16),
                },
                std::slice::from_ref(&slices[i]),
            )
        })
        .collect();
    let posted = match c.qp.post_send_list(&list) {
        Ok(()) => LIST,
        Err(err) => {
            assert!((64..LIST).contains(&err.posted), "{err}");
            err.posted
        }
    };
    if c.qp.post_path() == PostPath::Userspace {
        // stag0 holds a slot until its completion is polled: the list is
        // cut, which is the case under test.
        assert!(posted < LIST, "stag0's send queue took all {LIST} WRs");
    }
    // The last Write posted lands at the server while nobody polls the
    // client's CQ.
    let last = 65536 + (posted - 1) * 16;
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.mr.to_vec(last, 16).unwrap() != (posted as u128).to_le_bytes() {
        assert!(
            Instant::now() < deadline,
            "the {posted} Writes that fit never left"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    for i in 0..posted as u64 {
        let done = c.wait();
        assert_eq!((done.wr_id, done.status), (i, WcStatus::Success));
    }
    assert!(
        c.cq.poll_one(Duration::from_millis(200)).unwrap().is_none(),
        "nothing past the full queue was posted"
    );
}
