//! The quickstart on tokio: every operation as a future on the default
//! device (`$STAG_DEVICE`, else the first RDMA device, else stag's
//! userspace provider), both ends in this process on one current-thread
//! runtime. On a libibverbs device set `STAG_ADDR` to its IP address.
//!
//!     cargo run --release --example async_quickstart

use std::error::Error;
use std::net::SocketAddr;

use stag::verbs::r#async::{connect, AsyncCompletionQueue, AsyncListener};
use stag::verbs::{self, Access, ConnectOptions, Context};

type Res<T> = Result<T, Box<dyn Error>>;

const RIGHTS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC)
    .union(Access::FLUSH_PERSISTENT);

#[tokio::main(flavor = "current_thread")]
async fn main() -> Res<()> {
    let device = verbs::default_device();
    let addr: SocketAddr = match std::env::var("STAG_ADDR") {
        Ok(a) => format!("{a}:0").parse()?,
        Err(_) => "127.0.0.1:0".parse()?,
    };
    let (sctx, cctx) = (Context::open(&device)?, Context::open(&device)?);
    println!("device {device}");

    // The server: a region the client operates on, a durable one for Commit.
    let spd = sctx.alloc_pd()?;
    let scq = AsyncCompletionQueue::new(sctx.create_cq(64)?)?;
    let smr = spd.alloc_mr(1 << 16, RIGHTS)?;
    let log = std::env::temp_dir().join(format!("stag-async-quickstart-{}", std::process::id()));
    let durable = spd.alloc_file_mr(&log, 1 << 12, RIGHTS)?;
    let listener = AsyncListener::bind(&sctx, addr)?;
    let addr = listener.local_addr()?;

    // The client.
    let cpd = cctx.alloc_pd()?;
    let ccq = AsyncCompletionQueue::new(cctx.create_cq(64)?)?;
    let cmr = cpd.alloc_mr(1 << 16, RIGHTS)?;

    let opts = ConnectOptions::default();
    let (server, client) = tokio::join!(
        listener.accept(&spd, &scq, &opts),
        connect(&cpd, &ccq, addr, &opts)
    );
    let (sqp, _) = server?;
    let (qp, _) = client?;
    println!(
        "connected: QP {} ↔ QP {}",
        qp.qp().qp_num(),
        sqp.qp().qp_num()
    );

    // Send into a receive the server posted (its future completes with
    // the message).
    let incoming = sqp.recv(&[smr.slice(32768, 256)?]);
    cmr.write_at(0, b"hello, async RDMA")?;
    qp.send(&[cmr.slice(0, 17)?]).await?;
    let got = incoming.await?;
    println!(
        "send          server got {:?}: {:?}",
        got.kind,
        String::from_utf8_lossy(&smr.to_vec(32768, 17)?)
    );

    // Write, then Read it back: two futures in flight, RC order.
    cmr.write_at(64, b"written by RDMA Write")?;
    let w = qp.write(&[cmr.slice(64, 21)?], smr.remote(1024));
    let r = qp.read(&[cmr.slice(128, 21)?], smr.remote(1024));
    let (w, r) = tokio::join!(w, r);
    w?;
    r?;
    println!(
        "write + read  {:?}",
        String::from_utf8_lossy(&cmr.to_vec(128, 21)?)
    );

    // Immediate Data.
    let incoming = sqp.recv(&[]);
    qp.imm(0x0123_4567_89ab_cdef).await?;
    println!("imm           server got {:?}", incoming.await?.kind);

    // The atomics on a counter.
    smr.store_u64(0, 40)?;
    let (counter, result) = (smr.remote(0), cmr.slice(256, 8)?);
    println!(
        "fetch_add     {:?}",
        qp.fetch_add(&result, counter, 2).await?.kind
    );
    println!(
        "cmp_swap      {:?}",
        qp.cmp_swap(&result, counter, 42, 7).await?.kind
    );
    println!(
        "masked_cmp_swap {:?}",
        qp.masked_cmp_swap(&result, counter, 7, 0xff, 0x10, 0xf0)
            .await?
            .kind
    );
    println!(
        "swap          {:?}",
        qp.swap(&result, counter, 99).await?.kind
    );
    qp.atomic_write(counter, 0xfeed).await?;
    println!("atomic_write  counter now {:#x}", smr.load_u64(0)?);
    if smr.load_u64(0)? != 0xfeed {
        return Err("the atomic write did not land".into());
    }

    // Write + Commit: durable in the file once the Commit completes.
    cmr.write_at(512, b"durable record")?;
    qp.write(&[cmr.slice(512, 14)?], durable.remote(0)).await?;
    qp.commit(durable.remote(0), 14).await?;
    let on_disk = std::fs::read(&log)?;
    println!(
        "commit        file starts with {:?}",
        String::from_utf8_lossy(&on_disk[..14])
    );
    let ok = &on_disk[..14] == b"durable record";
    drop(durable);
    let _ = std::fs::remove_file(&log);
    if !ok {
        return Err("the committed bytes are not in the file".into());
    }
    println!("all done");
    Ok(())
}
