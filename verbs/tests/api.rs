//! The application API: memory the application owns, inline sends,
//! separate send and receive CQs, per-operation constructors. Runs on
//! `$STAG_DEVICE` (stag0 by default; rxe0 and siw0 in the VM suite).

mod common;

use std::time::Duration;

use common::*;
use verbs::{
    CompletionKind, ConnectOptions, Context, ContextOptions, DeregisterError, Listener, OpKind,
    Owned, SendOp, WcStatus, WorkRequest,
};

/// A peer's Write lands in a `Vec` the application registered in place,
/// and deregistration gives the same allocation back with the bytes in
/// it — but not while a posted work request (or any handle) holds it.
#[test]
fn application_memory_is_registered_in_place_and_given_back() {
    let (c, s) = pair();
    let buf = vec![0u8; 4096];
    let addr = buf.as_ptr() as u64;
    let app = s.pd.register(buf, ALL).unwrap();
    assert_eq!(app.remote(0).addr, addr, "no copy: the Vec's own bytes");
    c.mr.write_at(0, b"in place").unwrap();
    c.post(1, SendOp::write(app.remote(100)), &[(0, 8)]);
    assert!(c.wait().is_ok());
    // A Send behind the Write: once it arrives, the Write is placed.
    c.post(2, SendOp::send(), &[]);
    assert!(c.wait().is_ok());
    let got = s.wait();
    assert!(
        matches!(got.kind, CompletionKind::Recv { len: 0, .. }),
        "{got:?}"
    );
    let held = app.slice(0, 8).unwrap();
    let app = match app.deregister() {
        Err(DeregisterError::InUse(mr)) => mr,
        other => panic!("a held slice keeps the region registered: {other:?}"),
    };
    drop(held);
    match app.deregister() {
        Ok(Owned::Boxed(b)) => {
            assert_eq!(b.as_ptr() as u64, addr);
            assert_eq!(&b[100..108], b"in place");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        s.pd.register(Vec::new(), ALL),
        Err(verbs::Error::InvalidRequest(_))
    ));
}

/// An inline Send carries the bytes the buffer held at post time: the
/// application may rewrite the buffer as soon as the post returns.
#[test]
fn an_inline_send_carries_the_bytes_of_post_time() {
    let (c, s) = pair();
    c.mr.write_at(0, &[0xaa; 64]).unwrap();
    let local = [c.mr.slice(0, 64).unwrap()];
    c.qp.post_send(WorkRequest::new(7, SendOp::send(), &local).inlined())
        .unwrap();
    c.mr.write_at(0, &[0xbb; 64]).unwrap();
    let done = c.wait();
    assert_eq!((done.wr_id, done.status), (7, WcStatus::Success));
    let got = s.wait();
    assert!(
        matches!(got.kind, CompletionKind::Recv { len: 64, .. }),
        "{got:?}"
    );
    // The receive posted at setup is 4096 bytes at 512 KiB.
    assert_eq!(s.mr.to_vec(512 * 1024, 64).unwrap(), [0xaa; 64]);
    // Too big, or not a Send/Write: refused at post.
    let big = [c.mr.slice(0, verbs::MAX_INLINE + 1).unwrap()];
    assert!(c
        .qp
        .post_send(WorkRequest::new(8, SendOp::send(), &big).inlined())
        .is_err());
    let eight = [c.mr.slice(0, 8).unwrap()];
    assert!(c
        .qp
        .post_send(WorkRequest::new(9, SendOp::read(s.mr.remote(0)), &eight).inlined())
        .is_err());
}

/// Inline Writes, more than the send queue has slots (on a libibverbs
/// device each goes from a bounce slot that its completion frees), each
/// landing with the bytes of its post time.
#[test]
fn inline_writes_land_with_the_bytes_of_post_time() {
    let (c, s) = pair();
    let depth = verbs::QpCaps::default().max_send_wr as u64;
    let local = [c.mr.slice(0, 8).unwrap()];
    for i in 1..=3 * depth {
        c.mr.write_at(0, &i.to_le_bytes()).unwrap();
        let op = SendOp::write(s.mr.remote(4096));
        c.qp.post_send(WorkRequest::new(i, op, &local).inlined())
            .unwrap_or_else(|e| panic!("inline Write {i}: {e}"));
        c.mr.write_at(0, &[0xff; 8]).unwrap();
        let done = c.wait();
        assert_eq!((done.wr_id, done.status), (i, WcStatus::Success));
        // An iWARP Write completes once sent: wait for it to land,
        // driving the target's QP meanwhile.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut out = Vec::new();
        loop {
            let landed = s.mr.load_u64(4096).unwrap();
            if landed == i {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "Write {i} never landed: the target holds {landed:#x}"
            );
            s.cq.poll(&mut out, 8).unwrap();
        }
    }
}

/// Inline Write with Immediate through the mailbox (forced here; the only
/// way on libibverbs devices): each WR's bounce slot comes back with its
/// completion, so more inline WRs than the send queue has slots all go.
#[test]
fn inline_writes_through_the_mailbox_give_their_bounce_slots_back() {
    let (c, s) = pair_with(&emulating(&[OpKind::WriteImm]), 0);
    let depth = verbs::QpCaps::default().max_send_wr as u64;
    let local = [c.mr.slice(0, 16).unwrap()];
    for i in 0..depth + 44 {
        s.recv(5000 + i, 512 * 1024, 64);
        c.mr.write_at(0, &i.to_le_bytes()).unwrap();
        let op = SendOp::write_imm(s.mr.remote(4096), i);
        c.qp.post_send(WorkRequest::new(i, op, &local).inlined())
            .unwrap_or_else(|e| panic!("inline WR {i}: {e}"));
        let done = c.wait();
        assert_eq!((done.wr_id, done.status), (i, WcStatus::Success));
        let got = s.wait();
        assert!(
            matches!(got.kind, CompletionKind::Recv { imm: Some(v), .. } if v == i),
            "{got:?}"
        );
        assert_eq!(s.mr.load_u64(4096).unwrap(), i, "the Write's bytes");
    }
}

/// With a receive CQ of its own, a QP's receive completions go there and
/// its send completions to the send CQ.
#[test]
fn receive_completions_go_to_the_receive_cq() {
    let open = || {
        let ctx = Context::open_with(&device(), &ContextOptions::default()).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.alloc_mr(1 << 16, ALL).unwrap();
        (ctx, pd, mr)
    };
    let (sctx, spd, smr) = open();
    let (cctx, cpd, cmr) = open();
    let scq = sctx.create_cq(64).unwrap();
    let csend = cctx.create_cq(64).unwrap();
    let crecv = cctx.create_cq(64).unwrap();
    let listener = Listener::bind(&sctx, listen_addr()).unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = ConnectOptions {
        recv_cq: Some(crecv.clone()),
        ..ConnectOptions::default()
    };
    let recv_slice = [cmr.slice(0, 64).unwrap()];
    let sq_slice = [smr.slice(0, 64).unwrap()];
    let (sqp, cqp) = std::thread::scope(|t| {
        let h = t.spawn(|| {
            let req = listener.get_request().unwrap();
            req.accept(&spd, &scq, &ConnectOptions::default()).unwrap()
        });
        let (qp, _) = verbs::connect_with(&cpd, &csend, addr, &opts, |qp| {
            qp.post_recv(11, &recv_slice)
        })
        .unwrap();
        (h.join().unwrap(), qp)
    });
    smr.write_at(0, b"to the receive cq").unwrap();
    sqp.post_send(WorkRequest::new(1, SendOp::send(), &sq_slice))
        .unwrap();
    assert!(wait_one(&scq).is_ok());
    let r = wait_one(&crecv);
    assert_eq!(r.wr_id, 11);
    assert!(matches!(r.kind, CompletionKind::Recv { len: 64, .. }));
    assert_eq!(cmr.to_vec(0, 17).unwrap(), b"to the receive cq");
    let eight = [cmr.slice(64, 8).unwrap()];
    cqp.post_send(WorkRequest::new(2, SendOp::write(smr.remote(128)), &eight))
        .unwrap();
    let w = wait_one(&csend);
    assert_eq!((w.wr_id, w.kind), (2, CompletionKind::Write));
    assert!(
        crecv
            .poll_one(Duration::from_millis(100))
            .unwrap()
            .is_none(),
        "nothing else on the receive CQ"
    );
}

/// One constructor per operation; each falls in its own row of the
/// capability matrix (a plain atomic is not its masked form).
#[test]
fn constructors_name_their_operation() {
    let r = verbs::Remote { addr: 8, rkey: 1 };
    for (op, kind) in [
        (SendOp::send(), OpKind::Send),
        (SendOp::send_solicited(), OpKind::Send),
        (SendOp::send_invalidate(3), OpKind::SendInvalidate),
        (SendOp::write(r), OpKind::Write),
        (SendOp::write_imm(r, 1), OpKind::WriteImm),
        (SendOp::read(r), OpKind::Read),
        (SendOp::imm(1), OpKind::Imm),
        (SendOp::imm_solicited(1), OpKind::Imm),
        (SendOp::fetch_add(r, 1), OpKind::FetchAdd),
        (SendOp::masked_fetch_add(r, 1, 2), OpKind::MaskedFetchAdd),
        (SendOp::cmp_swap(r, 1, 2), OpKind::CmpSwap),
        (
            SendOp::masked_cmp_swap(r, 1, 0xf, 2, 0xf),
            OpKind::MaskedCmpSwap,
        ),
        (SendOp::swap(r, 1), OpKind::Swap),
        (SendOp::commit(r, 8), OpKind::Commit),
        (SendOp::atomic_write(r, 1), OpKind::AtomicWrite),
    ] {
        assert_eq!(OpKind::from(&op), kind, "{op:?}");
    }
}
