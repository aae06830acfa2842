//! A connected pair on the device named by `$STAG_DEVICE` (default: the
//! userspace provider), so the same tests run on rxe0/siw0 in the VM.
//! `$STAG_ADDR` gives the address to listen on for libibverbs devices
//! (the device's netdev address); the userspace provider uses loopback.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use verbs::{
    Access, Completion, CompletionQueue, ConnectOptions, Context, ContextOptions, Listener,
    MemoryRegion, OpKind, ProtectionDomain, QueuePair, SendOp, WorkRequest,
};

pub const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC)
    .union(Access::FLUSH_PERSISTENT);

pub fn device() -> String {
    std::env::var("STAG_DEVICE").unwrap_or_else(|_| verbs::device::USERSPACE_DEVICE.to_owned())
}

/// How many times a soak loop goes round: `n`, or `n / $STAG_SOAK_DIVISOR`
/// (at least 1) where the suite runs under emulation. scripts/vm/suite.sh
/// sets 5: under QEMU's TCG a small message on rxe0 or siw0 costs 5-13 ms
/// where stag0 on the host takes ~10 µs, and the soak loops were four
/// fifths of the whole VM suite (1-4 minutes of a 5-minute limit per test
/// binary). Fewer rounds still take every path a loop covers (rings wrap
/// hundreds of times, streams sleep and wake hundreds of times); the host
/// runs the full count on stag0.
pub fn soak(n: usize) -> usize {
    let divisor = std::env::var("STAG_SOAK_DIVISOR")
        .ok()
        .map(|d| d.parse::<usize>().expect("STAG_SOAK_DIVISOR is a count"))
        .unwrap_or(1)
        .max(1);
    (n / divisor).max(1)
}

pub fn listen_addr() -> SocketAddr {
    match std::env::var("STAG_ADDR") {
        Ok(a) => format!("{a}:0")
            .parse()
            .expect("STAG_ADDR is an IP address"),
        Err(_) => "127.0.0.1:0".parse().unwrap(),
    }
}

pub struct End {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub mr: MemoryRegion,
    pub qp: QueuePair,
}

impl End {
    pub fn post(&self, wr_id: u64, op: SendOp, local: &[(usize, usize)]) {
        let local: Vec<_> = local
            .iter()
            .map(|&(o, l)| self.mr.slice(o, l).unwrap())
            .collect();
        self.qp
            .post_send(WorkRequest::new(wr_id, op, &local))
            .unwrap();
    }

    pub fn recv(&self, wr_id: u64, offset: usize, len: usize) {
        self.qp
            .post_recv(wr_id, &[self.mr.slice(offset, len).unwrap()])
            .unwrap();
    }

    pub fn wait(&self) -> Completion {
        wait_one(&self.cq)
    }
}

pub fn wait_one(cq: &CompletionQueue) -> Completion {
    cq.poll_one(Duration::from_secs(20))
        .unwrap()
        .expect("a completion within 20 s")
}

/// Two connected ends; `recvs` receives are posted on each before the
/// connection exists.
pub fn pair_with(options: &ContextOptions, recvs: usize) -> (End, End) {
    pair_between(&device(), options, options, recvs)
}

/// Two connected ends on device `name`, the client's context opened with
/// `client`, the server's with `server`.
pub fn pair_between(
    name: &str,
    client: &ContextOptions,
    server: &ContextOptions,
    recvs: usize,
) -> (End, End) {
    pair_across(
        (name, client),
        (name, server),
        recvs,
        &ConnectOptions::default(),
    )
}

/// Two connected ends, each on its own device with its own options.
pub fn pair_across(
    client: (&str, &ContextOptions),
    server: (&str, &ContextOptions),
    recvs: usize,
    opts: &ConnectOptions,
) -> (End, End) {
    let make = |(name, options): (&str, &ContextOptions)| {
        let ctx = Context::open_with(name, options).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(1024).unwrap();
        let mr = pd.alloc_mr(1 << 20, ALL).unwrap();
        (ctx, pd, cq, mr)
    };
    let (sctx, spd, scq, smr) = make(server);
    let (cctx, cpd, ccq, cmr) = make(client);
    let listener = Listener::bind(&sctx, listen_addr()).unwrap();
    let addr = listener.local_addr().unwrap();
    let post = |mr: &MemoryRegion| {
        let mr = mr.clone();
        move |qp: &QueuePair| {
            for i in 0..recvs {
                qp.post_recv(1000 + i as u64, &[mr.slice(512 * 1024 + 4096 * i, 4096)?])?;
            }
            Ok(())
        }
    };
    let (server_qp, client_qp) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let req = listener.get_request().unwrap();
            req.accept_with(&spd, &scq, &ConnectOptions::default(), post(&smr))
                .unwrap()
        });
        let (qp, _) = verbs::connect_with(&cpd, &ccq, addr, opts, post(&cmr)).unwrap();
        (h.join().unwrap(), qp)
    });
    (
        End {
            ctx: cctx,
            pd: cpd,
            cq: ccq,
            mr: cmr,
            qp: client_qp,
        },
        End {
            ctx: sctx,
            pd: spd,
            cq: scq,
            mr: smr,
            qp: server_qp,
        },
    )
}

pub fn pair() -> (End, End) {
    pair_with(&ContextOptions::default(), 4)
}

pub fn emulating(ops: &[OpKind]) -> ContextOptions {
    ContextOptions {
        force_emulation: ops.to_vec(),
        ..ContextOptions::default()
    }
}

/// One server region and `n` clients, each connected to the server over
/// its own QP (and its own device context).
pub struct Star {
    pub server_mr: MemoryRegion,
    pub server_qps: Vec<QueuePair>,
    pub server_cq: CompletionQueue,
    pub clients: Vec<End>,
}

pub fn star(options: &ContextOptions, n: usize) -> Star {
    let name = device();
    let sctx = Context::open_with(&name, options).unwrap();
    let spd = sctx.alloc_pd().unwrap();
    let scq = sctx.create_cq(4096).unwrap();
    let smr = spd.alloc_mr(1 << 16, ALL).unwrap();
    let listener = Listener::bind(&sctx, listen_addr()).unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = ConnectOptions::default();
    let mut server_qps = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..n {
        let ctx = Context::open_with(&name, options).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4096).unwrap();
        let mr = pd.alloc_mr(1 << 16, ALL).unwrap();
        let (sqp, cqp) = std::thread::scope(|s| {
            let h = s.spawn(|| listener.accept(&spd, &scq, &opts).unwrap().0);
            let (qp, _) = verbs::connect(&pd, &cq, addr, &opts).unwrap();
            (h.join().unwrap(), qp)
        });
        server_qps.push(sqp);
        clients.push(End {
            ctx,
            pd,
            cq,
            mr,
            qp: cqp,
        });
    }
    Star {
        server_mr: smr,
        server_qps,
        server_cq: scq,
        clients,
    }
}

/// Every RFC 7306 operation and Commit from `c` to `s`, checked.
pub fn run_extensions(c: &End, s: &End) {
    use verbs::{CompletionKind, WcStatus};
    s.mr.write_at(0, &100u64.to_ne_bytes()).unwrap();
    c.post(
        1,
        SendOp::FetchAdd {
            remote: s.mr.remote(0),
            add: 5,
            mask: 0,
        },
        &[(64, 8)],
    );
    let r = c.wait();
    assert_eq!(
        (r.status, r.kind),
        (
            WcStatus::Success,
            CompletionKind::FetchAdd { original: 100 }
        )
    );
    c.post(
        2,
        SendOp::CmpSwap {
            remote: s.mr.remote(0),
            compare: 105,
            compare_mask: u64::MAX,
            swap: 7,
            swap_mask: u64::MAX,
        },
        &[(64, 8)],
    );
    assert!(matches!(
        c.wait().kind,
        CompletionKind::CmpSwap {
            original: 105,
            swapped: true
        }
    ));
    c.post(
        3,
        SendOp::FetchAdd {
            remote: s.mr.remote(0),
            add: 0x0101,
            mask: 0x00ff,
        },
        &[(64, 8)],
    );
    assert_eq!(
        c.wait().kind,
        CompletionKind::FetchAdd { original: 7 },
        "masked"
    );
    c.post(
        4,
        SendOp::Swap {
            remote: s.mr.remote(0),
            swap: 42,
        },
        &[(64, 8)],
    );
    let sw = c.wait();
    assert_eq!(sw.status, WcStatus::Success);
    assert_eq!(s.mr.load_u64(0).unwrap(), 42);
    c.post(
        41,
        SendOp::AtomicWrite {
            remote: s.mr.remote(0),
            value: 0xa70_0000_0000_0001,
        },
        &[],
    );
    let aw = c.wait();
    assert_eq!(
        (aw.status, aw.kind),
        (WcStatus::Success, CompletionKind::AtomicWrite)
    );
    assert_eq!(s.mr.load_u64(0).unwrap(), 0xa70_0000_0000_0001);

    c.post(
        5,
        SendOp::Imm {
            imm: 0xfeed_f00d_0000_0001,
            solicited: false,
        },
        &[],
    );
    assert_eq!(c.wait().kind, CompletionKind::Imm);
    match s.wait().kind {
        CompletionKind::Recv { imm, .. } => assert_eq!(imm, Some(0xfeed_f00d_0000_0001)),
        other => panic!("{other:?}"),
    }

    static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let run = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("stag-peers-{}-{run}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("durable.bin");
    let durable = s.pd.alloc_file_mr(&path, 4096, ALL).unwrap();
    c.mr.write_at(128, b"committed").unwrap();
    c.post(
        6,
        SendOp::Write {
            remote: durable.remote(8),
        },
        &[(128, 9)],
    );
    c.post(
        7,
        SendOp::Commit {
            remote: durable.remote(8),
            len: 9,
        },
        &[],
    );
    assert_eq!(c.wait().kind, CompletionKind::Write);
    let done = c.wait();
    assert_eq!(
        (done.status, done.kind),
        (WcStatus::Success, CompletionKind::Commit)
    );
    assert_eq!(&std::fs::read(&path).unwrap()[8..17], b"committed");
    drop(durable);
    let _ = std::fs::remove_dir_all(&dir);
}
