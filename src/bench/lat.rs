//! `stag lat <op>`: latency.
//!
//! Ping-pong operations (send, imm, write-imm, write) report half the
//! round trip, as perftest does; for write each side polls the last byte
//! of its own buffer for the peer's Write, driving the userspace provider
//! with `qp.progress()` while it spins. Read, the atomics and Commit report
//! the full round trip of one operation; Commit's is a Write of `size`
//! bytes followed by a Commit of them (time until the Commit completes:
//! the bytes are durable at the responder).

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;
use tracing::debug;

use stag::{CompletionKind, Context, Listener, OpKind, Remote, SendOp};

use super::stats::{to_usec, LatStats};
use super::{
    accept_server, connect_client, shape, sizes, BenchError, CommonArgs, Endpoint, Plan, Result,
    RunInfo, Shape, Test,
};

/// `stag lat`.
#[derive(Debug, Clone, clap::Args)]
pub struct LatArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Draw a latency histogram and CDF to this PNG file (client side).
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// Post Sends and Writes of at most this many bytes inline
    /// (IBV_SEND_INLINE), as perftest's -I; 0 posts none inline. Default
    /// on the userspace provider, as perftest's latency tests: 220 for
    /// Writes, 236 for Sends; 0 on libibverbs devices (stag copies an
    /// inline payload into a bounce slot there). Each side sets its own
    #[arg(short = 'I', long = "inline-size", value_name = "BYTES")]
    pub inline_size: Option<u32>,
}

/// The inline size `-I` defaults to: perftest's for its latency tests
/// (`DEF_INLINE_WRITE`, `DEF_INLINE_SEND_RC_UC`) where the device takes
/// the payload at post time itself (stag0 copies it into the QP's inline
/// slots, and frames it ~220 instructions cheaper than a gather, #20);
/// none on a libibverbs device, where stag's inline is a copy into a
/// registered bounce slot posted as an ordinary WR.
fn inline_default(op: OpKind, backend: stag::Backend) -> u32 {
    if backend != stag::Backend::Userspace {
        return 0;
    }
    match op {
        OpKind::Send => 236,
        OpKind::Write | OpKind::WriteImm => 220,
        _ => 0,
    }
}

/// One size's statistics and its samples (µs, for the plot).
type Measured = (LatStats, Vec<f64>);

/// Default iterations (perftest's).
pub const DEFAULT_ITERS: u32 = 1000;

/// The JSON report.
#[derive(Debug, Serialize)]
struct Report<'a> {
    #[serde(flatten)]
    info: &'a RunInfo,
    results: Vec<&'a LatStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    plot: Option<String>,
}

fn plan_of(args: &LatArgs) -> Result<Plan> {
    let c = &args.common;
    if c.blocking && c.op == OpKind::Write {
        return Err(BenchError::Args(
            "write latency detects the peer's Write by polling memory (as perftest's \
             ib_write_lat, which has no event mode); use write-imm with --blocking"
                .into(),
        ));
    }
    let iters = c.iters.unwrap_or(DEFAULT_ITERS);
    if iters == 0 {
        return Err(BenchError::Args("-n must be at least 1".into()));
    }
    Ok(Plan {
        test: Test::Lat,
        op: c.op,
        sizes: sizes(c.op, c.size, c.all, 2)?,
        iters,
        tx_depth: 1,
        commit_to_memory: c.commit_to_memory,
        qps: 1,
        mpa_crc: !c.no_crc,
    })
}

/// Run `stag lat`: server, client or both (`--loopback`).
pub fn run_lat(args: LatArgs) -> Result<()> {
    let plan = plan_of(&args)?;
    let common = args.common.clone();
    let op = common.op;
    let blocking = common.blocking;
    let inline_size = args.inline_size;
    let inline =
        move |ctx: &Context| inline_size.unwrap_or_else(|| inline_default(op, ctx.backend_kind()));
    let server = move |ctx: Context, listener: Listener| -> Result<()> {
        let (mut ep, plan) = accept_server(&ctx, &listener, Test::Lat, op, blocking)?;
        ep.post_inline_up_to(inline(&ctx));
        serve(&mut ep, &plan)
    };
    let client = |ctx: Context, addr: SocketAddr| -> Result<(RunInfo, Vec<Measured>)> {
        let mut ep = connect_client(&ctx, &plan, common.all, addr, blocking)?;
        ep.post_inline_up_to(inline(&ctx));
        let results = measure(&mut ep, &plan)?;
        let mut info = RunInfo::new(&ctx, &ep.qp, &common, Test::Lat);
        info.inline_up_to = ep.inline_up_to(op);
        let ops = u64::from(plan.warmup() + plan.iters) * plan.sizes.len() as u64;
        info.round_trips = Some(super::RoundTrips::of(ep.qp.emulation_counters(), ops));
        Ok((info, results))
    };
    let Some((info, results)) = super::run_roles(&common, server, client)? else {
        eprintln!("# {} latency server done", op);
        return Ok(());
    };
    if let Some(path) = &args.plot {
        let series: Vec<(u32, &[f64])> = results
            .iter()
            .map(|(s, v)| (s.bytes as u32, v.as_slice()))
            .collect();
        super::plot::latency_png(path, &info, &series)?;
    }
    let mut out = std::io::stdout().lock();
    if common.json {
        let report = Report {
            info: &info,
            results: results.iter().map(|(s, _)| s).collect(),
            plot: args.plot.as_ref().map(|p| p.display().to_string()),
        };
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        out.write_all(info.banner(plan.iters, "").as_bytes())?;
        out.write_all(table_header().as_bytes())?;
        for (s, _) in &results {
            out.write_all(table_row(s).as_bytes())?;
        }
        out.write_all("-".repeat(95).as_bytes())?;
        writeln!(out)?;
        if let Some(p) = &args.plot {
            writeln!(out, " plot: {}", p.display())?;
        }
    }
    Ok(())
}

pub(crate) fn table_header() -> String {
    format!(
        " {:<8} {:<12} {:>11} {:>11} {:>15} {:>11} {:>13} {:>20} {:>22}\n",
        "#bytes",
        "#iterations",
        "t_min[usec]",
        "t_max[usec]",
        "t_typical[usec]",
        "t_avg[usec]",
        "t_stdev[usec]",
        "99% percentile[usec]",
        "99.9% percentile[usec]"
    )
}

pub(crate) fn table_row(s: &LatStats) -> String {
    format!(
        " {:<8} {:<12} {:>11.2} {:>11.2} {:>15.2} {:>11.2} {:>13.2} {:>20.2} {:>22.2}\n",
        s.bytes,
        s.iterations,
        s.t_min_us,
        s.t_max_us,
        s.t_typical_us,
        s.t_avg_us,
        s.t_stdev_us,
        s.p99_us,
        s.p999_us
    )
}

/// Marker value of iteration `i` (never 0, so a cleared buffer never
/// matches).
fn seq(i: u32) -> u8 {
    (i % 255) as u8 + 1
}

/// Where the last byte of a `size`-byte message sits: the 8-byte word
/// holding it and its index in that word (so it can be read atomically).
fn marker(size: u32) -> (usize, usize) {
    let last = size as usize - 1;
    (last & !7, last & 7)
}

fn word_with(byte: usize, value: u8) -> u64 {
    let mut b = [0u8; 8];
    b[byte] = value;
    u64::from_ne_bytes(b)
}

/// The atomic of iteration `i` on `remote` (slot `k`-th use `n`).
pub(crate) fn atomic_op(op: OpKind, remote: Remote, n: u64) -> SendOp {
    match op {
        OpKind::FetchAdd => SendOp::FetchAdd {
            remote,
            add: 1,
            mask: 0,
        },
        // Two 32-bit lanes: no carry out of bit 31.
        OpKind::MaskedFetchAdd => SendOp::FetchAdd {
            remote,
            add: (1 << 32) | 1,
            mask: 1 << 31,
        },
        // The target counts uses, so every compare matches.
        OpKind::CmpSwap => SendOp::CmpSwap {
            remote,
            compare: n,
            compare_mask: u64::MAX,
            swap: n + 1,
            swap_mask: u64::MAX,
        },
        OpKind::MaskedCmpSwap => SendOp::CmpSwap {
            remote,
            compare: n & 0xffff_ffff,
            compare_mask: 0xffff_ffff,
            swap: (n + 1) & 0xffff_ffff,
            swap_mask: 0xffff_ffff,
        },
        OpKind::Swap => SendOp::Swap { remote, swap: n },
        OpKind::AtomicWrite => SendOp::AtomicWrite { remote, value: n },
        other => unreachable!("{other} is not an atomic"),
    }
}

/// Post the ping of iteration `i` (wr_id `i << 1`; a Commit's Write is
/// `i << 1 | 1`).
pub(crate) fn post_op(
    ep: &Endpoint,
    op: OpKind,
    size: u32,
    i: u64,
    slot: usize,
    n: u64,
) -> Result<()> {
    let sz = size as usize;
    let wr = i << 1;
    let remote = ep.peer;
    match op {
        OpKind::Send => ep.post(
            wr,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            Some((0, sz)),
        ),
        OpKind::Write => ep.post(wr, SendOp::Write { remote }, Some((0, sz))),
        OpKind::WriteImm => ep.post(wr, SendOp::WriteImm { remote, imm: i }, Some((0, sz))),
        OpKind::Imm => ep.post(
            wr,
            SendOp::Imm {
                imm: i,
                solicited: false,
            },
            None,
        ),
        OpKind::Read => ep.post(wr, SendOp::Read { remote }, Some((0, sz))),
        OpKind::Commit => {
            ep.post(wr | 1, SendOp::Write { remote }, Some((0, sz)))?;
            ep.post(wr, SendOp::Commit { remote, len: size }, None)
        }
        k if k.is_atomic() => {
            let target = Remote {
                addr: remote.addr + 8 * slot as u64,
                rkey: remote.rkey,
            };
            // An Atomic Write carries its value; the others return one.
            let local = (k != OpKind::AtomicWrite).then_some((8 * slot, 8));
            ep.post(wr, atomic_op(k, target, n), local)
        }
        other => Err(BenchError::Args(format!("{other} is not benchmarked"))),
    }
}

/// Whether `kind` is the completion the client waits for after posting
/// `op` (a Commit's Write completes first and is not it).
pub(crate) fn is_main_completion(op: OpKind, wr_id: u64, kind: &CompletionKind) -> bool {
    if wr_id & 1 == 1 || matches!(kind, CompletionKind::Recv { .. }) {
        return false;
    }
    matches!(
        (op, kind),
        (OpKind::Send, CompletionKind::Send)
            | (OpKind::Write | OpKind::WriteImm, CompletionKind::Write)
            | (OpKind::Imm, CompletionKind::Imm)
            | (OpKind::Read, CompletionKind::Read)
            | (
                OpKind::FetchAdd | OpKind::MaskedFetchAdd,
                CompletionKind::FetchAdd { .. }
            )
            | (
                OpKind::CmpSwap | OpKind::MaskedCmpSwap,
                CompletionKind::CmpSwap { .. }
            )
            | (OpKind::Swap, CompletionKind::Swap { .. })
            | (OpKind::AtomicWrite, CompletionKind::AtomicWrite)
            | (OpKind::Commit, CompletionKind::Commit)
    )
}

/// Spin until the peer's Write of iteration `i` has landed in our buffer.
fn wait_marker(ep: &mut Endpoint, size: u32, i: u32) -> Result<()> {
    let (word, byte) = marker(size);
    let want = seq(i);
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if ep.data.load_u64(word)?.to_ne_bytes()[byte] == want {
            return Ok(());
        }
        // Reap our own Write completions so the send queue drains; polling
        // an empty CQ also drives the QP (reads the socket), as perftest's
        // ibv_poll_cq between its looks at memory does. One read per look:
        // a second (an explicit progress call) only delays the look.
        ep.reap(|_| {})?;
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) && start.elapsed() > super::STALL {
            return Err(BenchError::Stalled(
                super::STALL,
                "waiting for the peer's Write",
            ));
        }
    }
}

/// Wait for the next data receive (the peer's ping or pong).
fn wait_recv(ep: &mut Endpoint) -> Result<()> {
    loop {
        let c = ep.next("waiting for the peer's message")?;
        if let CompletionKind::Recv { .. } = c.kind {
            return Ok(());
        }
    }
}

/// Clear the marker word a size's Writes will set.
fn prepare(ep: &Endpoint, op: OpKind, size: u32) -> Result<()> {
    if op == OpKind::Write {
        let (word, _) = marker(size);
        ep.data.store_u64(word, 0)?;
    }
    Ok(())
}

/// One ping (and, for ping-pong, the wait for its pong).
fn ping(ep: &mut Endpoint, op: OpKind, size: u32, i: u32) -> Result<()> {
    match op {
        OpKind::Write => {
            let (word, byte) = marker(size);
            ep.local.store_u64(word, word_with(byte, seq(i)))?;
            post_op(ep, op, size, u64::from(i), 0, 0)?;
            wait_marker(ep, size, i)
        }
        OpKind::Send | OpKind::Imm | OpKind::WriteImm => {
            post_op(ep, op, size, u64::from(i), 0, 0)?;
            wait_recv(ep)
        }
        _ => {
            post_op(ep, op, size, u64::from(i), 0, u64::from(i))?;
            loop {
                let c = ep.next("waiting for the operation to complete")?;
                if is_main_completion(op, c.wr_id, &c.kind) {
                    if let CompletionKind::CmpSwap { swapped: false, .. } = c.kind {
                        debug!(i, "CmpSwap did not swap");
                    }
                    return Ok(());
                }
            }
        }
    }
}

/// The server's answer to ping `i`.
fn pong(ep: &mut Endpoint, op: OpKind, size: u32, i: u32) -> Result<()> {
    match op {
        OpKind::Write => {
            wait_marker(ep, size, i)?;
            let (word, byte) = marker(size);
            ep.local.store_u64(word, word_with(byte, seq(i)))?;
            post_op(ep, op, size, u64::from(i), 0, 0)
        }
        _ => {
            wait_recv(ep)?;
            post_op(ep, op, size, u64::from(i), 0, 0)
        }
    }
}

/// The client: every size, warm-up then measured iterations.
fn measure(ep: &mut Endpoint, plan: &Plan) -> Result<Vec<Measured>> {
    let op = plan.op;
    let factor = match shape(op) {
        Shape::PingPong => 2.0,
        Shape::RoundTrip => 1.0,
    };
    let warmup = plan.warmup();
    if shape(op) == Shape::PingPong {
        // A ping-pong: each side answers before it reposts.
        ep.repost_after_posts();
    }
    let mut out = Vec::new();
    for (idx, &size) in plan.sizes.iter().enumerate() {
        prepare(ep, op, size)?;
        ep.barrier(idx as u32)?;
        let mut ns = Vec::with_capacity(plan.iters as usize);
        for i in 0..warmup + plan.iters {
            let t0 = Instant::now();
            ping(ep, op, size, i)?;
            let dt = t0.elapsed();
            if i >= warmup {
                ns.push(dt.as_nanos() as u64);
            }
        }
        let us = to_usec(&ns, factor);
        let stats = LatStats::from_samples(u64::from(size), &us);
        debug!(?stats, "size done");
        out.push((stats, us));
    }
    ep.finish()?;
    Ok(out)
}

/// The server: answer pings (ping-pong operations) or just keep pace.
fn serve(ep: &mut Endpoint, plan: &Plan) -> Result<()> {
    let op = plan.op;
    if shape(op) == Shape::PingPong {
        ep.repost_after_posts();
    }
    for (idx, &size) in plan.sizes.iter().enumerate() {
        prepare(ep, op, size)?;
        ep.barrier(idx as u32)?;
        if shape(op) == Shape::PingPong {
            for i in 0..plan.warmup() + plan.iters {
                pong(ep, op, size, i)?;
            }
        }
    }
    ep.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers() {
        assert_eq!(marker(1), (0, 0));
        assert_eq!(marker(2), (0, 1));
        assert_eq!(marker(8), (0, 7));
        assert_eq!(marker(9), (8, 0));
        assert_eq!(marker(65536), (65528, 7));
        assert_eq!(word_with(1, 7).to_ne_bytes(), [0, 7, 0, 0, 0, 0, 0, 0]);
        assert!((0..1000).all(|i| seq(i) != 0));
        assert_ne!(seq(254), seq(255));
    }

    #[test]
    fn atomics_map_to_their_capability_rows() {
        let r = Remote { addr: 0, rkey: 1 };
        for op in [
            OpKind::FetchAdd,
            OpKind::MaskedFetchAdd,
            OpKind::CmpSwap,
            OpKind::MaskedCmpSwap,
            OpKind::Swap,
            OpKind::AtomicWrite,
        ] {
            assert_eq!(stag::op_kind(&atomic_op(op, r, 5)), op);
        }
    }

    #[test]
    fn blocking_write_latency_is_refused() {
        use clap::Parser;
        #[derive(Parser)]
        struct C {
            #[command(flatten)]
            a: LatArgs,
        }
        let a = C::try_parse_from(["lat", "write", "--blocking"]).unwrap().a;
        assert!(matches!(plan_of(&a), Err(BenchError::Args(_))));
        let a = C::try_parse_from(["lat", "write-imm", "--blocking", "-n", "5"])
            .unwrap()
            .a;
        let p = plan_of(&a).unwrap();
        assert_eq!((p.iters, p.sizes.clone()), (5, vec![2]));
        let a = C::try_parse_from(["lat", "read", "-n", "0"]).unwrap().a;
        assert!(plan_of(&a).is_err());
    }
}
