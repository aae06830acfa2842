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

use stag::{CompletionKind, Context, Listener, OpKind};

use super::lat::{is_main_completion, post_op};
use super::stats::BwStats;
use super::{
    accept_server, connect_client, consumes_recv, sizes, BenchError, CommonArgs, Ctrl, Endpoint,
    Plan, Result, RunInfo, Test, CREDIT_BATCH, RD_ATOMIC, RX_DEPTH,
};

/// `stag bw`.
#[derive(Debug, Clone, clap::Args)]
pub struct BwArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Report bandwidth in Gb/s instead of MB/s.
    #[arg(long = "report_gbits", alias = "report-gbits")]
    pub report_gbits: bool,
    /// Operations kept outstanding.
    #[arg(short = 't', long = "tx-depth", default_value_t = 128)]
    pub tx_depth: u32,
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
    Ok(Plan {
        test: Test::Bw,
        op: c.op,
        sizes: sizes(c.op, c.size, c.all, DEFAULT_SIZE)?,
        iters,
        tx_depth: args.tx_depth,
        commit_to_memory: c.commit_to_memory,
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
    let common = args.common.clone();
    let op = common.op;
    let blocking = common.blocking;
    let server = move |ctx: Context, listener: Listener| -> Result<()> {
        let (mut ep, plan) = accept_server(&ctx, &listener, Test::Bw, op, blocking)?;
        serve(&mut ep, &plan)
    };
    let client = |ctx: Context, addr: SocketAddr| -> Result<(RunInfo, Vec<BwStats>)> {
        let mut ep = connect_client(&ctx, &plan, common.all, addr, blocking)?;
        let results = measure(&mut ep, &plan)?;
        Ok((RunInfo::new(&ctx, &ep.qp, &common, Test::Bw), results))
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
            results: &results,
        };
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        let extra = format!(" TX depth       : {}\n", window(&plan));
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

/// The client: stream every size.
fn measure(ep: &mut Endpoint, plan: &Plan) -> Result<Vec<BwStats>> {
    let op = plan.op;
    let window = window(plan);
    let credited = consumes_recv(op);
    let iters = plan.iters as usize;
    let mut out = Vec::new();
    for (idx, &size) in plan.sizes.iter().enumerate() {
        ep.barrier(idx as u32)?;
        let mut posted_at = vec![0u64; iters];
        let mut completed_at = vec![0u64; iters];
        let (mut posted, mut done) = (0usize, 0usize);
        // One receive stays in reserve for the next READY.
        let mut credits = RX_DEPTH - 1;
        let mut credit_msgs = 0u32;
        let origin = Instant::now();
        while done < iters {
            while posted < iters && posted - done < window as usize && (!credited || credits > 0) {
                let slot = posted % window as usize;
                let use_n = (posted / window as usize) as u64;
                // Stamped before the post: a post may move much of the
                // message itself (see stats::best_per_message_ns).
                posted_at[posted] = origin.elapsed().as_nanos() as u64;
                post_op(ep, op, size, posted as u64, slot, use_n)?;
                posted += 1;
                if credited {
                    credits -= 1;
                }
            }
            let c = ep.next("waiting for completions")?;
            if let Some(n) = ep.ctrl_of(&c, Ctrl::Credit)? {
                credits += n;
                credit_msgs += 1;
                continue;
            }
            if is_main_completion(op, c.wr_id, &c.kind) {
                let i = (c.wr_id >> 1) as usize;
                if i < iters {
                    completed_at[i] = origin.elapsed().as_nanos() as u64;
                    done += 1;
                }
            } else if let CompletionKind::Recv { len, .. } = c.kind {
                return Err(BenchError::Protocol(format!(
                    "unexpected {len}-byte message during the run"
                )));
            }
        }
        if credited {
            // The server credits every CREDIT_BATCH receives; take them all
            // so none is left for the next size's handshake.
            while credit_msgs < plan.iters / CREDIT_BATCH {
                let c = ep.next("waiting for the server's credits")?;
                if ep.ctrl_of(&c, Ctrl::Credit)?.is_some() {
                    credit_msgs += 1;
                }
            }
        }
        let stats =
            BwStats::from_times(u64::from(size), &posted_at, &completed_at, window as usize);
        debug!(?stats, "size done");
        out.push(stats);
    }
    ep.finish()?;
    Ok(out)
}

/// The server: take the messages of receive-consuming operations and
/// return credit; otherwise only keep pace.
fn serve(ep: &mut Endpoint, plan: &Plan) -> Result<()> {
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
    }

    #[test]
    fn table_units() {
        let s = BwStats::from_times(1 << 20, &[0, 0], &[1_000_000, 2_000_000], 1);
        assert!(table_header(false).contains("BW peak[MB/sec]"));
        assert!(table_header(true).contains("BW average[Gb/sec]"));
        assert!(table_row(&s, false).contains("1000.00"));
    }
}
