//! A shared receive queue serving several QPs.

mod common;

use common::*;
use verbs::{CompletionKind, ConnectOptions, Context, Listener, SendOp, SharedReceiveQueue};

#[test]
fn one_pool_of_receives_serves_several_connections() {
    let ctx = Context::open(&device()).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    // Every device stag supports has SRQs (rxe, siw, RNICs, stag0): a
    // device without them fails here rather than skipping the test.
    let srq = SharedReceiveQueue::new(&pd, 64, 1)
        .unwrap_or_else(|e| panic!("ibv_create_srq on {}: {e}", device()));
    let cq = ctx.create_cq(256).unwrap();
    let pool = pd.alloc_mr(64 * 64, ALL).unwrap();
    for i in 0..6 {
        srq.post_recv(100 + i, &[pool.slice(64 * i as usize, 64).unwrap()])
            .unwrap();
    }
    let listener = Listener::bind(&ctx, listen_addr()).unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = ConnectOptions {
        srq: Some(srq.clone()),
        ..ConnectOptions::default()
    };
    let mut clients = Vec::new();
    let mut server_qps = Vec::new();
    for i in 0..3u8 {
        let cctx = Context::open(&device()).unwrap();
        let cpd = cctx.alloc_pd().unwrap();
        let ccq = cctx.create_cq(64).unwrap();
        let cmr = cpd.alloc_mr(4096, ALL).unwrap();
        cmr.write_at(0, &[i; 16]).unwrap();
        let (sqp, cqp) = std::thread::scope(|s| {
            let h = s.spawn(|| listener.accept(&pd, &cq, &opts).unwrap().0);
            let (q, _) = verbs::connect(&cpd, &ccq, addr, &ConnectOptions::default()).unwrap();
            (h.join().unwrap(), q)
        });
        // A QP on an SRQ has no receive queue of its own.
        assert!(matches!(
            sqp.post_recv(1, &[pool.slice(0, 8).unwrap()]),
            Err(verbs::Error::InvalidRequest(_))
        ));
        server_qps.push(sqp);
        clients.push((ccq, cmr, cqp));
    }
    for (ccq, cmr, cqp) in &clients {
        for n in 0..2 {
            let local = [cmr.slice(0, 16).unwrap()];
            let wr = verbs::WorkRequest::new(
                n,
                SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                &local,
            );
            cqp.post_send(wr).unwrap();
            assert!(wait_one(ccq).is_ok());
        }
    }
    let mut ids = Vec::new();
    for _ in 0..6 {
        let c = wait_one(&cq);
        assert!(
            matches!(c.kind, CompletionKind::Recv { len: 16, .. }),
            "{c:?}"
        );
        assert!(server_qps.iter().any(|q| q.qp_num() == c.qp_num));
        ids.push(c.wr_id);
    }
    ids.sort_unstable();
    assert_eq!(ids, (100..106).collect::<Vec<_>>());
    assert!(srq.is_empty());
}
