//! `stag bw <op>`: bandwidth and message rate.
//!
//! The client keeps up to `--tx-depth` operations outstanding (16 for
//! Reads, atomics and Commits: the connection's ORD) and records when each
//! was posted and completed; average bandwidth is all bytes over first
//! post to last completion, peak the best rate over any run of
//! max(tx depth, iterations / 10) consecutive completions. Send, Immediate Data and Write with
//! Immediate consume receives at the server, so the client spends credits
//! the server returns in batches once it has reposted (iWARP has no RNR
//! retry: a message without a receive would kill the connection).

use std::io::Write as _;
use std::net::SocketAddr;
use std::time::Instant;

use serde::Serialize;
use tracing::debug;

use stag::{Completion, CompletionKind, Context, Listener, OpKind};

use super::lat::{is_main_completion, post_op};
use super::stats::BwStats;
use super::{
    accept_rest, accept_server, connect_client, consumes_recv, sizes, BenchError, CommonArgs, Ctrl,
    Endpoint, Plan, Result, RunInfo, Test, CREDIT_BATCH, RD_ATOMIC, RX_DEPTH,
};

/// `stag bw`.
#[derive(Debug, Clone, clap::Args)]
pub struct BwArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Report bandwidth in Gb/s instead of MB/s.
    #[arg(long = "report_gbits", alias = "report-gbits")]
    pub report_gbits: bool,
    /// Operations kept outstanding (per QP).
    #[arg(short = 't', long = "tx-depth", default_value_t = 128)]
    pub tx_depth: u32,
    /// Queue pairs (on stag0: TCP connections) the client opens and drives
    /// from its one thread; -n is per QP, the report aggregates them all.
    #[arg(long, default_value_t = 1)]
    pub qps: u16,
}

/// Default iterations (perftest's).
pub const DEFAULT_ITERS: u32 = 5000;

/// Default message size (perftest's).
pub const DEFAULT_SIZE: u32 = 65536;

#[derive(Debug, Serialize)]
struct Report<'a> {
    #[serde(flatten)]
    info: &'a RunInfo,
    tx_depth: u32,
    qps: u16,
    results: &'a [BwStats],
}

fn plan_of(args: &BwArgs) -> Result<Plan> {
    let c = &args.common;
    let iters = c.iters.unwrap_or(DEFAULT_ITERS);
    if iters == 0 {
        return Err(BenchError::Args("-n must be at least 1".into()));
    }
    if !(1..=4096).contains(&args.tx_depth) {
        return Err(BenchError::Args("--tx-depth must be in 1..=4096".into()));
    }
    if args.qps == 0 {
        return Err(BenchError::Args("--qps must be at least 1".into()));
    }
    if args.qps > 1 && consumes_recv(c.op) {
        // Their credit return is per connection; the server serves one.
        return Err(BenchError::Args(format!(
            "--qps > 1 runs operations that consume no receive (write, read, atomics, \
             commit), not {}",
            c.op
        )));
    }
    if args.qps > 1 && c.blocking {
        // cq.wait sleeps on one CQ; each QP here has its own.
        return Err(BenchError::Args(
            "--qps > 1 busy-polls its QPs; drop --blocking".into(),
        ));
    }
    Ok(Plan {
        test: Test::Bw,
        op: c.op,
        sizes: sizes(c.op, c.size, c.all, DEFAULT_SIZE)?,
        iters,
        tx_depth: args.tx_depth,
        commit_to_memory: c.commit_to_memory,
        qps: args.qps,
        mpa_crc: !c.no_crc,
    })
}

/// Operations outstanding at once.
fn window(plan: &Plan) -> u32 {
    match plan.op {
        OpKind::Send | OpKind::Write | OpKind::WriteImm | OpKind::Imm => plan.tx_depth,
        _ => plan.tx_depth.min(u32::from(RD_ATOMIC)),
    }
}

/// Run `stag bw`: server, client or both (`--loopback`).
pub fn run_bw(args: BwArgs) -> Result<()> {
    let plan = plan_of(&args)?;
    if plan.qps > 1 {
        super::raise_fd_limit();
    }
    let common = args.common.clone();
    let op = common.op;
    let blocking = common.blocking;
    let server = move |ctx: Context, listener: Listener| -> Result<()> {
        let (first, plan) = accept_server(&ctx, &listener, Test::Bw, op, blocking)?;
        let mut eps = vec![first];
        eps.extend(accept_rest(&ctx, &listener, &plan, blocking)?);
        serve(&mut eps, &plan)
    };
    let client = |ctx: Context, addr: SocketAddr| -> Result<(RunInfo, Vec<BwStats>)> {
        let mut eps = (0..plan.qps)
            .map(|_| connect_client(&ctx, &plan, common.all, addr, blocking))
            .collect::<Result<Vec<_>>>()?;
        let results = measure(&mut eps, &plan)?;
        Ok((RunInfo::new(&ctx, &eps[0].qp, &common, Test::Bw), results))
    };
    let Some((info, results)) = super::run_roles(&common, server, client)? else {
        eprintln!("# {op} bandwidth server done");
        return Ok(());
    };
    let mut out = std::io::stdout().lock();
    if common.json {
        let report = Report {
            info: &info,
            tx_depth: window(&plan),
            qps: plan.qps,
            results: &results,
        };
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        let mut extra = format!(" TX depth       : {} per QP\n", window(&plan));
        if plan.qps > 1 {
            extra += &format!(" QPs            : {} (one polling thread)\n", plan.qps);
        }
        out.write_all(info.banner(plan.iters, &extra).as_bytes())?;
        out.write_all(table_header(args.report_gbits).as_bytes())?;
        for s in &results {
            out.write_all(table_row(s, args.report_gbits).as_bytes())?;
        }
        out.write_all("-".repeat(95).as_bytes())?;
        writeln!(out)?;
    }
    Ok(())
}

pub(crate) fn table_header(gbits: bool) -> String {
    let unit = if gbits { "Gb/sec" } else { "MB/sec" };
    format!(
        " {:<8} {:<12} {:>18} {:>21} {:>15}\n",
        "#bytes",
        "#iterations",
        format!("BW peak[{unit}]"),
        format!("BW average[{unit}]"),
        "MsgRate[Mpps]"
    )
}

pub(crate) fn table_row(s: &BwStats, gbits: bool) -> String {
    let (peak, avg) = if gbits {
        (s.bw_peak_gbit_s, s.bw_avg_gbit_s)
    } else {
        (s.bw_peak_mb_s, s.bw_avg_mb_s)
    };
    format!(
        " {:<8} {:<12} {:>18.2} {:>21.2} {:>15.6}\n",
        s.bytes, s.iterations, peak, avg, s.msg_rate_mpps
    )
}

/// One size's run over all QPs: what each QP has posted and completed,
/// and when every message was posted and completed (indexed by the order
/// of posting across QPs, which is also the wr_id, so the peak window of
/// [`BwStats::from_times`] spans consecutive posts whichever QP took them).
struct Run {
    origin: Instant,
    posted_at: Vec<u64>,
    completed_at: Vec<u64>,
    posted: Vec<u32>,
    done: Vec<u32>,
    posts: usize,
    completions: usize,
    /// Receive-consuming operations (one QP): messages the server can take.
    credits: u32,
    credit_msgs: u32,
}

impl Run {
    fn new(qps: usize, iters: u32) -> Run {
        let total = qps * iters as usize;
        Run {
            origin: Instant::now(),
            posted_at: vec![0; total],
            completed_at: vec![0; total],
            posted: vec![0; qps],
            done: vec![0; qps],
            posts: 0,
            completions: 0,
            // One receive stays in reserve for the next READY.
            credits: RX_DEPTH - 1,
            credit_msgs: 0,
        }
    }

    /// Fill QP `q`'s window.
    fn post(&mut self, ep: &Endpoint, q: usize, plan: &Plan, size: u32) -> Result<()> {
        let window = window(plan);
        let credited = consumes_recv(plan.op);
        // The window's posts go as one list: one write to the socket on
        // stag0, as an RNIC takes a list with one doorbell.
        ep.open_list();
        let filled = self.fill(ep, q, plan, size, window, credited);
        let posted = ep.post_list();
        filled.and(posted)
    }

    fn fill(
        &mut self,
        ep: &Endpoint,
        q: usize,
        plan: &Plan,
        size: u32,
        window: u32,
        credited: bool,
    ) -> Result<()> {
        // Stamped before the list is posted: a post may move much of the
        // message itself (see stats::best_per_message_ns). One reading of
        // the clock for the list: a reading per message was 6 % of the
        // client's time at 64 QPs of 8-byte Writes.
        let now = self.origin.elapsed().as_nanos() as u64;
        while self.posted[q] < plan.iters
            && self.posted[q] - self.done[q] < window
            && (!credited || self.credits > 0)
        {
            let n = self.posted[q];
            let slot = (n % window) as usize;
            self.posted_at[self.posts] = now;
            post_op(
                ep,
                plan.op,
                size,
                self.posts as u64,
                slot,
                u64::from(n / window),
            )?;
            self.posted[q] += 1;
            self.posts += 1;
            if credited {
                self.credits -= 1;
            }
        }
        Ok(())
    }

    /// The time to stamp the completions of one poll with.
    fn now(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    /// Account one completion taken from QP `q` at `now`.
    fn complete(
        &mut self,
        ep: &Endpoint,
        q: usize,
        op: OpKind,
        c: &Completion,
        now: u64,
    ) -> Result<()> {
        if let Some(n) = ep.ctrl_of(c, Ctrl::Credit)? {
            self.credits += n;
            self.credit_msgs += 1;
        } else if is_main_completion(op, c.wr_id, &c.kind) {
            let i = (c.wr_id >> 1) as usize;
            if i < self.completed_at.len() {
                self.completed_at[i] = now;
                self.done[q] += 1;
                self.completions += 1;
            }
        } else if let CompletionKind::Recv { len, .. } = c.kind {
            return Err(BenchError::Protocol(format!(
                "unexpected {len}-byte message during the run"
            )));
        }
        Ok(())
    }
}

/// The client: stream every size over every QP from this one thread.
fn measure(eps: &mut [Endpoint], plan: &Plan) -> Result<Vec<BwStats>> {
    let op = plan.op;
    let qps = eps.len();
    let mut out = Vec::new();
    let mut batch: Vec<Completion> = Vec::with_capacity(64);
    for (idx, &size) in plan.sizes.iter().enumerate() {
        // The first QP carries the control messages for all.
        eps[0].barrier(idx as u32)?;
        let mut run = Run::new(qps, plan.iters);
        let mut last_progress = Instant::now();
        while run.completions < run.completed_at.len() {
            let before = run.completions;
            for (q, ep) in eps.iter_mut().enumerate() {
                run.post(ep, q, plan, size)?;
                if qps == 1 {
                    // One QP: wait in `next` (busy or, with --blocking,
                    // in cq.wait; it fails on a stall itself).
                    let c = ep.next("waiting for completions")?;
                    run.complete(ep, q, op, &c, run.now())?;
                    // And whatever else is there, so that the next refill
                    // is a list rather than one WR.
                    batch.clear();
                    ep.reap(|c| batch.push(*c))?;
                    let now = run.now();
                    for c in &batch {
                        run.complete(ep, q, op, c, now)?;
                    }
                } else {
                    batch.clear();
                    ep.reap(|c| batch.push(*c))?;
                    if !batch.is_empty() {
                        let now = run.now();
                        for c in &batch {
                            run.complete(ep, q, op, c, now)?;
                        }
                    }
                }
            }
            if run.completions != before {
                last_progress = Instant::now();
            } else if last_progress.elapsed() > super::STALL {
                return Err(BenchError::Stalled(super::STALL, "waiting for completions"));
            }
        }
        if consumes_recv(op) {
            // The server credits every CREDIT_BATCH receives; take them all
            // so none is left for the next size's handshake (one QP only).
            while run.credit_msgs < plan.iters / CREDIT_BATCH {
                let c = eps[0].next("waiting for the server's credits")?;
                if eps[0].ctrl_of(&c, Ctrl::Credit)?.is_some() {
                    run.credit_msgs += 1;
                }
            }
        }
        let stats = BwStats::from_times(
            u64::from(size),
            &run.posted_at,
            &run.completed_at,
            window(plan) as usize * qps,
        );
        debug!(?stats, qps, "size done");
        out.push(stats);
    }
    // Every QP's operations have completed: one DONE ends them all.
    eps[0].finish()?;
    Ok(out)
}

/// The server: take the messages of receive-consuming operations and
/// return credit (one QP); otherwise only keep pace: the responder work of
/// every QP is the provider's (or the RNIC's).
fn serve(eps: &mut [Endpoint], plan: &Plan) -> Result<()> {
    let ep = &mut eps[0];
    for idx in 0..plan.sizes.len() {
        ep.barrier(idx as u32)?;
        if consumes_recv(plan.op) {
            let mut received = 0u32;
            while received < plan.iters {
                let c =
                    ep.next_within("waiting for the client's messages", super::PASSIVE_STALL)?;
                if let CompletionKind::Recv { .. } = c.kind {
                    received += 1;
                    if received.is_multiple_of(CREDIT_BATCH) {
                        ep.send_ctrl(Ctrl::Credit, CREDIT_BATCH)?;
                    }
                }
            }
        }
    }
    ep.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct C {
        #[command(flatten)]
        a: BwArgs,
    }

    #[test]
    fn defaults_and_windows() {
        let a = C::try_parse_from(["bw", "write"]).unwrap().a;
        let p = plan_of(&a).unwrap();
        assert_eq!(
            (p.iters, p.sizes.clone(), p.tx_depth),
            (5000, vec![65536], 128)
        );
        assert_eq!(window(&p), 128);
        let a = C::try_parse_from(["bw", "read", "-t", "64", "-s", "1024"])
            .unwrap()
            .a;
        let p = plan_of(&a).unwrap();
        assert_eq!(window(&p), u32::from(RD_ATOMIC));
        assert_eq!(p.sizes, vec![1024]);
        let a = C::try_parse_from(["bw", "write", "-t", "0"]).unwrap().a;
        assert!(plan_of(&a).is_err());
        let a = C::try_parse_from(["bw", "write", "-s", "8", "--qps", "64"])
            .unwrap()
            .a;
        assert_eq!(plan_of(&a).unwrap().qps, 64);
        // Credits are per connection: receive-consuming operations and
        // cq.wait stay single-QP.
        for bad in [
            &["bw", "send", "--qps", "2"][..],
            &["bw", "write-imm", "--qps", "2"],
            &["bw", "write", "--qps", "2", "--blocking"],
            &["bw", "write", "--qps", "0"],
        ] {
            let a = C::try_parse_from(bad).unwrap().a;
            assert!(matches!(plan_of(&a), Err(BenchError::Args(_))), "{bad:?}");
        }
    }

    #[test]
    fn table_units() {
        let s = BwStats::from_times(1 << 20, &[0, 0], &[1_000_000, 2_000_000], 1);
        assert!(table_header(false).contains("BW peak[MB/sec]"));
        assert!(table_header(true).contains("BW average[Gb/sec]"));
        assert!(table_row(&s, false).contains("1000.00"));
    }
}
