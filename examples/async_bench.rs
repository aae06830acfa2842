//! The async API's benchmark, one side per process (scripts/bench/bench-async.sh
//! runs both and compares against `stag lat`/`stag bw` and plain TCP in
//! the same run). Every figure is printed as one JSON line.
//!
//!     async_bench server lat <send|write-imm|fetch-add> PORT
//!     async_bench client lat <send|write-imm|fetch-add> HOST:PORT ITERS
//!     async_bench server stream PORT        (RdmaStream sink)
//!     async_bench client stream HOST:PORT MIB
//!     async_bench server stream-slots PORT  (RdmaStream sink, slot path)
//!     async_bench client stream-slots HOST:PORT MIB
//!     async_bench server tcp PORT           (tokio TcpStream sink)
//!     async_bench client tcp HOST:PORT MIB
//!
//! Latency runs on a current-thread runtime (with `ASYNC_BENCH_SPIN_US`
//! set, its CQ spins that long before sleeping); send and write-imm are
//! ping-pongs reporting half the round trip (as `stag lat` does): the
//! ping is posted, and the task awaits the peer's answer on the CQ's fd
//! (`AsyncCompletionQueue::poll_drain`, whose drain also takes the ping's
//! own completion). fetch-add is the full round trip of one `Op` future. Throughput: the client
//! writes MIB MiB in 1 MiB writes; the sink answers one byte at the end,
//! and the figure is bytes over the time until that byte arrives.
//! `stream-slots` moves the same MiB through the stream's zero-copy path
//! (`send_slot`/`recv_slot`), each MiB as the same messages a 1 MiB write
//! makes (full slots, then the rest); neither side copies the payload (as
//! `stag bw write` does not): the writer stamps each message's first 8
//! bytes with its number, and the reader checks the stamps (order).

use std::error::Error;
use std::net::SocketAddr;
use std::time::Instant;

use stag::verbs::r#async::{
    self, AsyncCompletionQueue, AsyncListener, AsyncQueuePair, RdmaStream, StreamOptions,
};
use stag::verbs::{self, Access, ConnectOptions, Context, MemoryRegion};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Res<T> = Result<T, Box<dyn Error>>;

const RIGHTS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);
const MIB: usize = 1 << 20;
/// Receives kept posted on each side of a ping-pong.
const DEPTH: usize = 16;

fn usage() -> Box<dyn Error> {
    "usage: async_bench server|client lat OP|stream|stream-slots|tcp ADDR [ITERS|MIB]".into()
}

struct Side {
    qp: AsyncQueuePair,
    mr: MemoryRegion,
    cq: AsyncCompletionQueue,
}

/// `ASYNC_BENCH_SPIN_US`: the CQ's spin before sleeping
/// (`AsyncCompletionQueue::with_spin`); unset or 0, sleep at once.
fn spin() -> Res<std::time::Duration> {
    let us: u64 = match std::env::var("ASYNC_BENCH_SPIN_US") {
        Ok(v) => v.parse()?,
        Err(_) => 0,
    };
    Ok(std::time::Duration::from_micros(us))
}

/// `ASYNC_BENCH_SLOT_KIB` / `ASYNC_BENCH_SLOTS`: the RdmaStream's shape
/// (both sides must agree); unset, `StreamOptions::default()`. Its CQ
/// spins `ASYNC_BENCH_SPIN_US` (unset: the default spin);
/// `ASYNC_BENCH_SENDS` set: data as Sends, not Writes with Immediate.
fn stream_options() -> Res<StreamOptions> {
    let mut o = StreamOptions::default();
    if std::env::var_os("ASYNC_BENCH_SPIN_US").is_some() {
        o.spin = spin()?;
    }
    if let Ok(v) = std::env::var("ASYNC_BENCH_SLOT_KIB") {
        o.slot_size = v.parse::<usize>()? * 1024;
    }
    if let Ok(v) = std::env::var("ASYNC_BENCH_SLOTS") {
        o.slots = v.parse()?;
    }
    if std::env::var_os("ASYNC_BENCH_SENDS").is_some() {
        o.write_imm = false;
    }
    Ok(o)
}

async fn open(ctx: &Context) -> Res<(verbs::ProtectionDomain, AsyncCompletionQueue, MemoryRegion)> {
    let pd = ctx.alloc_pd()?;
    let cq = AsyncCompletionQueue::with_spin(ctx.create_cq(256)?, spin()?)?;
    let mr = pd.alloc_mr(1 << 16, RIGHTS)?;
    Ok((pd, cq, mr))
}

/// A region's place, as connection private data.
fn place(mr: &MemoryRegion) -> Vec<u8> {
    let r = mr.remote(0);
    let mut v = r.addr.to_le_bytes().to_vec();
    v.extend_from_slice(&r.rkey.to_le_bytes());
    v
}

fn remote_of(private: &[u8]) -> Res<verbs::Remote> {
    if private.len() < 12 {
        return Err("the peer sent no region in its private data".into());
    }
    Ok(verbs::Remote {
        addr: u64::from_le_bytes(private[..8].try_into()?),
        rkey: u32::from_le_bytes(private[8..12].try_into()?),
    })
}

/// Receives posted before the connection exists (the peer may send first).
fn pre_post(
    mr: &MemoryRegion,
) -> Res<impl FnOnce(&verbs::QueuePair) -> verbs::Result<()> + Send + 'static> {
    let slice = mr.slice(0, 8)?;
    Ok(move |qp: &verbs::QueuePair| {
        (0..DEPTH as u64).try_for_each(|i| qp.post_recv(i, std::slice::from_ref(&slice)))
    })
}

async fn lat_server(op: &str, port: u16) -> Res<()> {
    let ctx = Context::open(&verbs::default_device())?;
    let (pd, cq, mr) = open(&ctx).await?;
    let listener = AsyncListener::bind(&ctx, SocketAddr::from(([0, 0, 0, 0], port)))?;
    let opts = ConnectOptions {
        private_data: place(&mr),
        ..ConnectOptions::default()
    };
    let (qp, private) = listener
        .accept_with(&pd, &cq, &opts, pre_post(&mr)?)
        .await?;
    let peer = remote_of(&private)?;
    let side = Side { qp, mr, cq };
    if op == "fetch-add" {
        // Passive: the client's goodbye is the only message.
        return next_message(&side).await;
    }
    pong(&side, op, false, peer, u64::MAX).await?;
    Ok(())
}

/// The next message into one of the receives posted before connecting
/// (kept on the raw CQ: `poll_drain`), reposted at once.
async fn next_message(side: &Side) -> Res<()> {
    loop {
        let mut out = Vec::with_capacity(1);
        std::future::poll_fn(|cx| side.cq.poll_drain(cx, &mut out, 1)).await?;
        let Some(c) = out.pop() else { continue };
        if !c.is_ok() {
            return Err(format!("{:?}", c.status).into());
        }
        if matches!(c.kind, verbs::CompletionKind::Recv { .. }) {
            side.qp.qp().post_recv(c.wr_id, &[side.mr.slice(0, 8)?])?;
            return Ok(());
        }
    }
}

/// Ping-pong: `first` sends first and times; the other answers.
async fn pong(
    side: &Side,
    op: &str,
    first: bool,
    peer: verbs::Remote,
    iters: u64,
) -> Res<Vec<f64>> {
    let slice = side.mr.slice(8, 8)?;
    let mut samples = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        if first {
            ping(side, op, peer, &slice)?;
        }
        if next_message(side).await.is_err() {
            break;
        }
        if first {
            samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        } else {
            ping(side, op, peer, &slice)?;
        }
    }
    Ok(samples)
}

/// Post the ping unsignaled-in-spirit: its send completion is taken (and
/// dropped) by the next drain.
fn ping(side: &Side, op: &str, peer: verbs::Remote, slice: &verbs::Slice) -> Res<()> {
    let wr = match op {
        "send" => verbs::SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        "write-imm" => verbs::SendOp::WriteImm {
            remote: verbs::Remote {
                addr: peer.addr + 8,
                rkey: peer.rkey,
            },
            imm: 1,
        },
        _ => return Err(usage()),
    };
    side.qp.qp().post_send(verbs::WorkRequest::new(
        u64::MAX,
        wr,
        std::slice::from_ref(slice),
    ))?;
    Ok(())
}

async fn lat_client(op: &str, addr: SocketAddr, iters: u64) -> Res<()> {
    let ctx = Context::open(&verbs::default_device())?;
    let (pd, cq, mr) = open(&ctx).await?;
    let opts = ConnectOptions {
        private_data: place(&mr),
        ..ConnectOptions::default()
    };
    let (qp, private) = verbs::r#async::connect_with(&pd, &cq, addr, &opts, pre_post(&mr)?).await?;
    let server = remote_of(&private)?;
    let side = Side { qp, mr, cq };
    let warm = iters / 10;
    let mut samples = match op {
        "fetch-add" => {
            let result = side.mr.slice(16, 8)?;
            let mut s = Vec::with_capacity((warm + iters) as usize);
            for _ in 0..warm + iters {
                let t = Instant::now();
                side.qp.fetch_add(&result, server, 1).await?;
                s.push(t.elapsed().as_secs_f64() * 1e6);
            }
            s.split_off(warm as usize)
        }
        "send" | "write-imm" => {
            let mut s = pong(&side, op, true, server, warm + iters).await?;
            s.split_off((warm as usize).min(s.len()))
        }
        _ => return Err(usage()),
    };
    // Goodbye: ends a passive (fetch-add) server's wait.
    ping(&side, "send", server, &side.mr.slice(8, 8)?)?;
    samples.sort_by(|a, b| a.total_cmp(b));
    let median = samples.get(samples.len() / 2).copied().unwrap_or(f64::NAN);
    let p99 = samples
        .get(samples.len() * 99 / 100)
        .copied()
        .unwrap_or(f64::NAN);
    println!(
        "{{\"test\":\"async-lat\",\"op\":\"{op}\",\"iterations\":{},\"t_typical_us\":{median:.3},\"p99_us\":{p99:.3},\"slow_yields\":{},\"spent_budget_waits\":{}}}",
        samples.len(),
        r#async::slow_yields(),
        r#async::spent_budget_waits()
    );
    // Let the goodbye leave before the QP goes.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    Ok(())
}

async fn sink<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(mut s: S) -> Res<()> {
    let mut buf = vec![0u8; MIB];
    let mut len = [0u8; 8];
    s.read_exact(&mut len).await?;
    let mut left = u64::from_le_bytes(len);
    while left > 0 {
        let n = s.read(&mut buf[..(left.min(MIB as u64) as usize)]).await?;
        if n == 0 {
            return Err("the client went away early".into());
        }
        left -= n as u64;
    }
    s.write_all(&[1]).await?;
    s.flush().await?;
    // Wait for the client's close.
    let _ = s.read(&mut buf[..1]).await;
    // For the bench's log (the client's JSON has its own).
    eprintln!(
        "server slow_yields {} spent_budget_waits {}",
        r#async::slow_yields(),
        r#async::spent_budget_waits()
    );
    Ok(())
}

async fn source<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut s: S,
    kind: &str,
    mib: u64,
) -> Res<()> {
    let buf: Vec<u8> = (0..MIB).map(|i| i as u8).collect();
    let t = Instant::now();
    s.write_all(&(mib * MIB as u64).to_le_bytes()).await?;
    for _ in 0..mib {
        s.write_all(&buf).await?;
    }
    s.flush().await?;
    let mut done = [0u8; 1];
    s.read_exact(&mut done).await?;
    let secs = t.elapsed().as_secs_f64();
    let _ = s.shutdown().await;
    print_stream_result(kind, mib, secs);
    Ok(())
}

/// One stream run's JSON line: `mib` MiB moved in `secs`.
fn print_stream_result(kind: &str, mib: u64, secs: f64) {
    let mb_s = (mib * MIB as u64) as f64 / secs / 1e6;
    println!(
        "{{\"test\":\"{kind}\",\"bytes\":{MIB},\"mib\":{mib},\"bw_avg_mb_s\":{mb_s:.1},\"slow_yields\":{},\"spent_budget_waits\":{}}}",
        r#async::slow_yields(),
        r#async::spent_budget_waits()
    );
}

/// The sink of `stream-slots`: the length by `read_exact`, then slots
/// until that many bytes came, each stamp checked.
async fn slot_sink(mut s: RdmaStream) -> Res<()> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len).await?;
    let mut left = u64::from_le_bytes(len);
    let mut seq = 0u64;
    while left > 0 {
        let Some(slot) = s.recv_slot().await? else {
            return Err("the client went away early".into());
        };
        if slot.len() >= 8 && slot[..8] != seq.to_le_bytes() {
            return Err(format!("slot {seq} arrived out of order").into());
        }
        seq += 1;
        left = left.saturating_sub(slot.len() as u64);
    }
    s.write_all(&[1]).await?;
    let _ = s.read(&mut len[..1]).await;
    eprintln!(
        "server slow_yields {} spent_budget_waits {}",
        r#async::slow_yields(),
        r#async::spent_budget_waits()
    );
    Ok(())
}

/// `ASYNC_BENCH_SLOT_BATCH`: the most slots the `stream-slots` source
/// fills before it posts them with one `commit_all` (it waits for the
/// first, and takes the rest only if free at once; default 4, as the
/// traits' post lists; 1: one message per post).
fn slot_batch() -> Res<usize> {
    Ok(match std::env::var("ASYNC_BENCH_SLOT_BATCH") {
        Ok(v) => v.parse::<usize>()?.max(1),
        Err(_) => 4,
    })
}

/// The source of `stream-slots` (see the module doc).
async fn slot_source(mut s: RdmaStream, mib: u64) -> Res<()> {
    let t = Instant::now();
    s.write_all(&(mib * MIB as u64).to_le_bytes()).await?;
    let mut seq = 0u64;
    let batch = slot_batch()?;
    for _ in 0..mib {
        let mut left = MIB;
        while left > 0 {
            let mut filled = Vec::with_capacity(batch);
            // Wait for one slot only: slots held while waiting for more
            // could be the whole window (see `send_slot`).
            let mut next = Some(s.send_slot().await?);
            while let Some(mut slot) = next.take() {
                let n = left.min(slot.capacity());
                if n >= 8 {
                    slot[..8].copy_from_slice(&seq.to_le_bytes());
                }
                filled.push((slot, n));
                seq += 1;
                left -= n;
                if left > 0 && filled.len() < batch {
                    next = s.try_send_slot()?;
                }
            }
            s.commit_all(filled)?;
        }
    }
    let mut done = [0u8; 1];
    s.read_exact(&mut done).await?;
    let secs = t.elapsed().as_secs_f64();
    let _ = s.shutdown().await;
    print_stream_result("rdma-stream-slots", mib, secs);
    Ok(())
}

async fn run(args: &[String]) -> Res<()> {
    let arg = |i: usize| args.get(i).map(String::as_str).ok_or_else(usage);
    match (arg(1)?, arg(2)?) {
        ("server", "lat") => lat_server(arg(3)?, arg(4)?.parse()?).await,
        ("client", "lat") => lat_client(arg(3)?, arg(4)?.parse()?, arg(5)?.parse()?).await,
        ("server", "stream") => {
            let ctx = Context::open(&verbs::default_device())?;
            let pd = ctx.alloc_pd()?;
            let port: u16 = arg(3)?.parse()?;
            let l = AsyncListener::bind(&ctx, SocketAddr::from(([0, 0, 0, 0], port)))?;
            sink(RdmaStream::accept(&l, &pd, stream_options()?).await?).await
        }
        ("client", "stream") => {
            let ctx = Context::open(&verbs::default_device())?;
            let pd = ctx.alloc_pd()?;
            let s = RdmaStream::connect(&pd, arg(3)?.parse()?, stream_options()?).await?;
            source(s, "rdma-stream", arg(4)?.parse()?).await
        }
        ("server", "stream-slots") => {
            let ctx = Context::open(&verbs::default_device())?;
            let pd = ctx.alloc_pd()?;
            let port: u16 = arg(3)?.parse()?;
            let l = AsyncListener::bind(&ctx, SocketAddr::from(([0, 0, 0, 0], port)))?;
            slot_sink(RdmaStream::accept(&l, &pd, stream_options()?).await?).await
        }
        ("client", "stream-slots") => {
            let ctx = Context::open(&verbs::default_device())?;
            let pd = ctx.alloc_pd()?;
            let s = RdmaStream::connect(&pd, arg(3)?.parse()?, stream_options()?).await?;
            slot_source(s, arg(4)?.parse()?).await
        }
        ("server", "tcp") => {
            let l = tokio::net::TcpListener::bind(("0.0.0.0", arg(3)?.parse::<u16>()?)).await?;
            let (s, _) = l.accept().await?;
            s.set_nodelay(true)?;
            sink(s).await
        }
        ("client", "tcp") => {
            let s = tokio::net::TcpStream::connect(arg(3)?.parse::<SocketAddr>()?).await?;
            s.set_nodelay(true)?;
            source(s, "tcp-stream", arg(4)?.parse()?).await
        }
        _ => Err(usage()),
    }
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(&args))
}
