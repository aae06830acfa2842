//! `stag scale [HOST]`: what many connected QPs cost when they sit idle.
//!
//! The client connects `--qps` QPs one after another through
//! [`stag::connect`] (the rate a program that opens a full mesh sees), all
//! on one PD and one CQ, then both sides sit idle for `--idle` seconds and
//! measure:
//! - the connection rate (QPs per second, over the whole sequence);
//! - the resident memory each connected QP added to the process (RSS
//!   after minus RSS before, over N: the user-space share only, since the
//!   kernel's socket buffers are not in RSS);
//! - the CPU the whole process burned while every QP was idle (user +
//!   system time over wall time; the userspace provider's engine threads
//!   included), which must be about zero: idle sockets are not polled.
//!
//! Then every QP proves it is still alive: the client sends 8 bytes on
//! each and the server, which posted one receive per QP before accepting
//! it, must see all of them. Each side prints its own figures (`--json`:
//! one object each; the server's on its stdout).
//!
//! The plan travels in the first connection's private data as a
//! [`stag::bench_wire::scale`] message (after stag's own header).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{debug, info};

use stag::{
    Access, CompletionQueue, ConnectOptions, Context, Listener, QpCaps, QueuePair, SendOp,
    WorkRequest,
};

use stag::bench_wire::scale as hello;

use super::{open_context_on, resolve, BenchError, Result};

/// `stag scale`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// Server to connect to (client mode). Without it, wait for one client
    /// (server mode).
    pub host: Option<String>,
    /// Device name (default: $STAG_DEVICE, else the first libibverbs
    /// device, else the userspace provider stag0).
    #[arg(short = 'd', long = "ib-dev")]
    pub ib_dev: Option<String>,
    /// TCP/CM port to listen on or connect to.
    #[arg(short = 'p', long, default_value_t = 18516)]
    pub port: u16,
    /// Address the server listens on (default 0.0.0.0).
    #[arg(long)]
    pub bind: Option<std::net::IpAddr>,
    /// Queue pairs to connect (the client's choice; the server follows).
    #[arg(long, default_value_t = 1024)]
    pub qps: u16,
    /// Seconds every QP sits idle before the liveness check (the client's
    /// choice).
    #[arg(long, default_value_t = 5.0)]
    pub idle: f64,
    /// Send and receive queue depth of every QP (the verbs default, 256,
    /// unless given).
    #[arg(long)]
    pub queue_depth: Option<u32>,
    /// Userspace provider: how QPs make progress (busy, adaptive or
    /// blocking; default: $STAG_PROGRESS, else the provider's default).
    #[arg(long, value_name = "MODE", value_parser = super::parse_progress)]
    pub progress: Option<stag::Progress>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What one side measured.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    pub test: &'static str,
    /// `client` or `server`.
    pub role: &'static str,
    pub device: String,
    pub qps: u16,
    pub queue_depth: u32,
    /// First connect's start to last connect's return (the server: first
    /// request to last accept).
    pub connect_s: f64,
    pub connects_per_s: f64,
    pub rss_before_kib: u64,
    pub rss_after_kib: u64,
    /// (after - before) / qps.
    pub rss_per_qp_kib: f64,
    pub idle_s: f64,
    /// Process CPU (user + system) over idle wall time, in percent of one
    /// core.
    pub idle_cpu_pct: f64,
    /// QPs that carried the 8-byte message after the idle period.
    pub alive: u16,
}

impl ScaleReport {
    /// The report of `qps` QPs of `queue_depth` that took `connect` to
    /// set up, grew the RSS from `rss_before_kib` to `rss_after_kib`,
    /// burned `idle_cpu_pct` over `idle`, and of which `alive` carried
    /// their message after it.
    #[allow(clippy::too_many_arguments)]
    fn new(
        role: &'static str,
        ctx: &Context,
        qps: u16,
        queue_depth: u32,
        connect: Duration,
        (rss_before_kib, rss_after_kib): (u64, u64),
        (idle, idle_cpu_pct): (Duration, f64),
        alive: usize,
    ) -> ScaleReport {
        let n = f64::from(qps.max(1));
        ScaleReport {
            test: "scale",
            role,
            device: ctx.name().to_owned(),
            qps,
            queue_depth,
            connect_s: connect.as_secs_f64(),
            connects_per_s: n / connect.as_secs_f64().max(1e-9),
            rss_before_kib,
            rss_after_kib,
            rss_per_qp_kib: rss_after_kib.saturating_sub(rss_before_kib) as f64 / n,
            idle_s: idle.as_secs_f64(),
            idle_cpu_pct,
            alive: u16::try_from(alive).unwrap_or(u16::MAX),
        }
    }
}

/// Resident set size of this process, in KiB.
fn rss_kib() -> Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| BenchError::Protocol(format!("unreadable /proc/self/statm: {statm}")))?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Ok(pages * u64::try_from(page).unwrap_or(4096) / 1024)
}

/// CPU time (user + system) this process has used so far.
fn cpu_time() -> Duration {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the buffer we own; RUSAGE_SELF
    // is always valid.
    let ru = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr());
        ru.assume_init()
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Sit idle for `idle` and return the process CPU over it, in percent.
fn idle_cpu(idle: Duration) -> f64 {
    let (c0, t0) = (cpu_time(), Instant::now());
    std::thread::sleep(idle);
    let (cpu, wall) = (cpu_time() - c0, t0.elapsed());
    100.0 * cpu.as_secs_f64() / wall.as_secs_f64().max(1e-9)
}

fn options(depth: Option<u32>, private_data: Vec<u8>) -> ConnectOptions {
    let mut o = ConnectOptions {
        private_data,
        ..ConnectOptions::default()
    };
    if let Some(d) = depth {
        o.caps = QpCaps {
            max_send_wr: d,
            max_recv_wr: d,
            ..o.caps
        };
    }
    o
}

/// Wait for `n` successful completions on `cq`.
fn reap(cq: &CompletionQueue, n: usize, what: &'static str) -> Result<usize> {
    let mut out = Vec::with_capacity(64);
    let mut ok = 0;
    let mut seen = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen < n {
        out.clear();
        cq.wait(&mut out, 64, Duration::from_millis(100))?;
        for c in &out {
            seen += 1;
            if c.is_ok() {
                ok += 1;
            } else {
                debug!(?c, "scale: failed completion");
            }
        }
        if Instant::now() > deadline {
            return Err(BenchError::Stalled(Duration::from_secs(60), what));
        }
    }
    Ok(ok)
}

/// The next connection request and its plan (a stranger is rejected).
fn next_request(listener: &Listener) -> Result<(stag::Incoming, hello::Repr)> {
    let req = listener.get_request()?;
    match hello::Repr::decode(req.private_data()) {
        Ok(h) => Ok((req, h)),
        Err(e) => {
            let _ = req.reject(b"not a stag scale client");
            Err(BenchError::Protocol(e.to_string()))
        }
    }
}

fn report(r: &ScaleReport, json: bool) -> Result<()> {
    if json {
        println!(
            "{}",
            serde_json::to_string(r).map_err(|e| BenchError::Protocol(e.to_string()))?
        );
    } else {
        println!(
            " {} on {}: {} QPs connected in {:.3} s ({:.0}/s); {:.1} KiB RSS per QP \
             ({} -> {} KiB); idle {:.1} s at {:.2} % CPU; {} of {} QPs alive after it",
            r.role,
            r.device,
            r.qps,
            r.connect_s,
            r.connects_per_s,
            r.rss_per_qp_kib,
            r.rss_before_kib,
            r.rss_after_kib,
            r.idle_s,
            r.idle_cpu_pct,
            r.alive,
            r.qps
        );
    }
    Ok(())
}

/// Run `stag scale`: the server without HOST, else the client.
pub fn run_scale(a: ScaleArgs) -> Result<()> {
    super::raise_fd_limit();
    let ctx = open_context_on(a.ib_dev.clone(), a.progress)?;
    match &a.host {
        Some(host) => client(&a, &ctx, resolve(host, a.port)?),
        None => server(&a, &ctx),
    }
}

fn client(a: &ScaleArgs, ctx: &Context, addr: SocketAddr) -> Result<()> {
    if a.qps == 0 {
        return Err(BenchError::Args("--qps must be at least 1".into()));
    }
    if !(a.idle.is_finite() && (0.0..=3600.0).contains(&a.idle)) {
        return Err(BenchError::Args("--idle must be 0 to 3600 seconds".into()));
    }
    let n = usize::from(a.qps);
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(u32::from(a.qps).max(64))?;
    let mr = pd.alloc_mr(8 * n, Access::LOCAL_WRITE)?;
    let idle_ms = (a.idle * 1000.0) as u32;
    let before = rss_kib()?;
    let t0 = Instant::now();
    let qps = (0..a.qps)
        .map(|index| {
            let hello = hello::Repr {
                qps: a.qps,
                idle_ms,
                index,
            };
            let (qp, _) = stag::connect(
                &pd,
                &cq,
                addr,
                &options(a.queue_depth, hello.encode().to_vec()),
            )?;
            Ok(qp)
        })
        .collect::<Result<Vec<QueuePair>>>()?;
    let connect = t0.elapsed();
    let after = rss_kib()?;
    info!(qps = n, ?connect, "scale: connected");
    let idle = Duration::from_millis(u64::from(idle_ms));
    let idle_cpu_pct = idle_cpu(idle);
    for (i, qp) in qps.iter().enumerate() {
        let slice = [mr.slice(8 * i, 8)?];
        qp.post_send(WorkRequest::new(
            i as u64,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            &slice,
        ))?;
    }
    let alive = reap(&cq, n, "waiting for the sends after the idle period")?;
    let depth = options(a.queue_depth, Vec::new()).caps.max_send_wr;
    let r = ScaleReport::new(
        "client",
        ctx,
        a.qps,
        depth,
        connect,
        (before, after),
        (idle, idle_cpu_pct),
        alive,
    );
    report(&r, a.json)?;
    if alive != n {
        return Err(BenchError::Protocol(format!(
            "{} of {n} QPs failed their send after the idle period",
            n - alive
        )));
    }
    Ok(())
}

fn server(a: &ScaleArgs, ctx: &Context) -> Result<()> {
    let ip = a
        .bind
        .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
    let listener = Listener::bind(ctx, SocketAddr::new(ip, a.port))?;
    eprintln!(
        "# scale: waiting for a client on {} ({})",
        listener.local_addr()?,
        ctx.name()
    );
    let pd = ctx.alloc_pd()?;
    let before = rss_kib()?;
    let (req, plan) = next_request(&listener)?;
    if plan.index != 0 {
        let _ = req.reject(b"expected connection 0 first");
        return Err(BenchError::Protocol(format!(
            "first connection is #{}",
            plan.index
        )));
    }
    let t0 = Instant::now();
    let n = usize::from(plan.qps);
    let cq = ctx.create_cq(u32::from(plan.qps).max(64))?;
    let mr = pd.alloc_mr(8 * n, Access::LOCAL_WRITE)?;
    let opts = options(a.queue_depth, Vec::new());
    let mut qps: Vec<QueuePair> = Vec::with_capacity(n);
    let mut next = Some(req);
    while qps.len() < n {
        let (req, h) = match next.take() {
            Some(req) => (req, plan),
            None => next_request(&listener)?,
        };
        if h.qps != plan.qps || usize::from(h.index) != qps.len() {
            let _ = req.reject(b"plan mismatch");
            return Err(BenchError::Protocol(format!(
                "connection {h:?} after {} of {plan:?}",
                qps.len()
            )));
        }
        let slice = [mr.slice(8 * usize::from(h.index), 8)?];
        let qp = req.accept_with(&pd, &cq, &opts, |qp| {
            qp.post_recv(u64::from(h.index), &slice)
        })?;
        qps.push(qp);
    }
    let connect = t0.elapsed();
    let after = rss_kib()?;
    info!(qps = n, ?connect, "scale: all accepted");
    let idle = Duration::from_millis(u64::from(plan.idle_ms));
    let idle_cpu_pct = idle_cpu(idle);
    let alive = reap(&cq, n, "waiting for every QP's send")?;
    report(
        &ScaleReport::new(
            "server",
            ctx,
            plan.qps,
            opts.caps.max_recv_wr,
            connect,
            (before, after),
            (idle, idle_cpu_pct),
            alive,
        ),
        a.json,
    )?;
    if alive != n {
        return Err(BenchError::Protocol(format!(
            "{} of {n} receives failed",
            n - alive
        )));
    }
    Ok(())
}
