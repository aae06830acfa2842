//! Every operation once on the default device (`$STAG_DEVICE`, else the
//! first RDMA device, else stag's userspace provider), printing what each
//! one did and whether it ran natively or emulated.
//!
//! Both ends run in this process: a server thread accepts one connection,
//! the main thread connects and drives the operations. On a libibverbs
//! device set `STAG_ADDR` to the device's IP address.
//!
//!     cargo run --release --example quickstart

use std::error::Error;
use std::net::SocketAddr;
use std::time::Duration;

use stag::verbs::{
    self, Access, CompletionQueue, ConnectOptions, Context, Listener, MemoryRegion, OpKind, SendOp,
    Support, WorkRequest,
};

type Res<T> = Result<T, Box<dyn Error>>;

const RIGHTS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC)
    .union(Access::FLUSH_PERSISTENT);

fn wait(cq: &CompletionQueue) -> Res<verbs::Completion> {
    let c = cq
        .poll_one(Duration::from_secs(10))?
        .ok_or("no completion within 10 s")?;
    if !c.is_ok() {
        return Err(format!("work request {} failed: {}", c.wr_id, c.status.as_str()).into());
    }
    Ok(c)
}

fn main() -> Res<()> {
    let device = verbs::default_device();
    let addr: SocketAddr = match std::env::var("STAG_ADDR") {
        Ok(a) => format!("{a}:0").parse()?,
        Err(_) => "127.0.0.1:0".parse()?,
    };
    let server_ctx = Context::open(&device)?;
    let client_ctx = Context::open(&device)?;
    println!(
        "device {} — {}",
        device,
        client_ctx.capabilities().transport
    );

    // Server side: a region for the client to write, read and operate on,
    // and a durable file-backed region for Commit.
    let spd = server_ctx.alloc_pd()?;
    let scq = server_ctx.create_cq(256)?;
    let smr = spd.alloc_mr(1 << 16, RIGHTS)?;
    let log_path = std::env::temp_dir().join(format!("stag-quickstart-{}.log", std::process::id()));
    let durable = spd.alloc_file_mr(&log_path, 1 << 16, RIGHTS)?;
    let listener = Listener::bind(&server_ctx, addr)?;
    let addr = listener.local_addr()?;

    let cpd = client_ctx.alloc_pd()?;
    let ccq = client_ctx.create_cq(256)?;
    let cmr = cpd.alloc_mr(1 << 16, RIGHTS)?;

    let opts = ConnectOptions::default();
    let recv_slot = |mr: &MemoryRegion, i: usize| mr.slice(32768 + 256 * i, 256);
    let (sqp, cqp) = std::thread::scope(|s| -> Res<_> {
        let server = s.spawn(|| {
            listener.get_request().and_then(|req| {
                req.accept_with(&spd, &scq, &opts, |qp| {
                    for i in 0..4 {
                        qp.post_recv(i as u64, &[recv_slot(&smr, i)?])?;
                    }
                    Ok(())
                })
            })
        });
        let (cqp, _) = verbs::connect(&cpd, &ccq, addr, &opts)?;
        let sqp = server.join().map_err(|_| "server thread panicked")??;
        Ok((sqp, cqp))
    })?;
    println!(
        "connected: client QP {} ↔ server QP {}\n",
        cqp.qp_num(),
        sqp.qp_num()
    );

    // This connection's matrix: the device's, resolved against the peer's.
    let caps = cqp.capabilities().clone();
    let support = |op: OpKind| match caps.get(op) {
        Support::Native => "native".to_owned(),
        other => other.to_string(),
    };
    let post =
        |wr_id: u64, op: SendOp, local: Vec<verbs::Slice>| -> Res<Option<verbs::Completion>> {
            let kind = verbs::op_kind(&op);
            match cqp.post_send(WorkRequest::new(wr_id, op, &local)) {
                Ok(()) => Ok(Some(wait(&ccq)?)),
                Err(verbs::Error::Unsupported { why, .. }) => {
                    println!("{:<17} unsupported here: {why}", kind.name());
                    Ok(None)
                }
                Err(e) => Err(e.into()),
            }
        };

    // Send → the server's first receive.
    cmr.write_at(0, b"hello, RDMA")?;
    if post(
        1,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![cmr.slice(0, 11)?],
    )?
    .is_some()
    {
        let r = wait(&scq)?;
        let text = smr.to_vec(32768, 11)?;
        println!(
            "{:<17} [{}] server received {:?} ({:?})",
            "send",
            support(OpKind::Send),
            String::from_utf8_lossy(&text),
            r.kind
        );
    }

    // RDMA Write, then Read it back. A Write completes at the requester
    // once it is sent; the Read behind it on the same QP sees its bytes.
    cmr.write_at(64, b"written by RDMA Write")?;
    if post(
        2,
        SendOp::Write {
            remote: smr.remote(1024),
        },
        vec![cmr.slice(64, 21)?],
    )?
    .is_some()
    {
        println!(
            "{:<17} [{}] 21 bytes to the server",
            "write",
            support(OpKind::Write)
        );
    }
    if post(
        3,
        SendOp::Read {
            remote: smr.remote(1024),
        },
        vec![cmr.slice(128, 21)?],
    )?
    .is_some()
    {
        println!(
            "{:<17} [{}] client read back {:?}",
            "read",
            support(OpKind::Read),
            String::from_utf8_lossy(&cmr.to_vec(128, 21)?)
        );
    }

    // Immediate Data and Write with Immediate (8 bytes, RFC 7306).
    if post(
        4,
        SendOp::Imm {
            imm: 0x0123_4567_89ab_cdef,
            solicited: true,
        },
        vec![],
    )?
    .is_some()
    {
        let r = wait(&scq)?;
        println!(
            "{:<17} [{}] server got {:?}",
            "imm",
            support(OpKind::Imm),
            r.kind
        );
    }
    if post(
        5,
        SendOp::WriteImm {
            remote: smr.remote(2048),
            imm: 7,
        },
        vec![cmr.slice(64, 7)?],
    )?
    .is_some()
    {
        let r = wait(&scq)?;
        println!(
            "{:<17} [{}] server got {:?} after {:?} landed",
            "write-imm",
            support(OpKind::WriteImm),
            r.kind,
            String::from_utf8_lossy(&smr.to_vec(2048, 7)?)
        );
    }

    // Atomics on a counter at offset 0 of the server region.
    smr.store_u64(0, 40)?;
    let counter = smr.remote(0);
    let result = || cmr.slice(256, 8);
    let ops: [(OpKind, SendOp); 5] = [
        (
            OpKind::FetchAdd,
            SendOp::FetchAdd {
                remote: counter,
                add: 2,
                mask: 0,
            },
        ),
        (
            OpKind::CmpSwap,
            SendOp::CmpSwap {
                remote: counter,
                compare: 42,
                compare_mask: u64::MAX,
                swap: 0x0000_0001_ffff_ffff,
                swap_mask: u64::MAX,
            },
        ),
        (
            OpKind::MaskedFetchAdd,
            SendOp::FetchAdd {
                remote: counter,
                add: 0x0000_0001_0000_0001,
                mask: 0x8000_0000_8000_0000,
            },
        ),
        (
            OpKind::MaskedCmpSwap,
            SendOp::CmpSwap {
                remote: counter,
                compare: 0x2_0000_0000,
                compare_mask: 0xffff_ffff_0000_0000,
                swap: 0xaa,
                swap_mask: 0xff,
            },
        ),
        (
            OpKind::Swap,
            SendOp::Swap {
                remote: counter,
                swap: 99,
            },
        ),
    ];
    for (i, (kind, op)) in ops.into_iter().enumerate() {
        if let Some(c) = post(10 + i as u64, op, vec![result()?])? {
            println!(
                "{:<17} [{}] {:?}; counter now {:#x}",
                kind.name(),
                support(kind),
                c.kind,
                smr.load_u64(0)?
            );
        }
    }

    // Atomic Write: the value replaces the counter whole; nothing returns.
    if post(
        16,
        SendOp::AtomicWrite {
            remote: counter,
            value: 0x0123_4567_89ab_cdef,
        },
        vec![],
    )?
    .is_some()
    {
        println!(
            "{:<17} [{}] counter now {:#x}",
            "atomic-write",
            support(OpKind::AtomicWrite),
            smr.load_u64(0)?
        );
    }

    // Write + Commit to the durable region: the bytes reach the file.
    cmr.write_at(512, b"durable record")?;
    if post(
        20,
        SendOp::Write {
            remote: durable.remote(0),
        },
        vec![cmr.slice(512, 14)?],
    )?
    .is_some()
        && post(
            21,
            SendOp::Commit {
                remote: durable.remote(0),
                len: 14,
            },
            vec![],
        )?
        .is_some()
    {
        let on_disk = std::fs::read(&log_path)?;
        println!(
            "{:<17} [{}] file {} starts with {:?}",
            "commit",
            support(OpKind::Commit),
            log_path.display(),
            String::from_utf8_lossy(&on_disk[..14])
        );
    }
    drop(durable);
    let _ = std::fs::remove_file(&log_path);
    println!("\nall done");
    Ok(())
}
