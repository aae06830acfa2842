//! perftest-style microbenchmarks: `stag lat <op> [HOST]` and
//! `stag bw <op> [HOST]`.
//!
//! Without HOST a process is the server (it waits for one client, serves
//! one test and exits); with HOST it is the client, which chooses the
//! parameters, measures and reports. `--loopback` runs both in one process.
//!
//! The two sides agree through the connection's private data (a
//! `STGB` hello, [`stag::bench_wire::hello`]: test, operation, sizes, iterations, and each side's target
//! buffer as address + rkey) and then synchronise every message size with
//! small control Sends on the same QP (`READY` from the client, `GO` from
//! the server, `CREDIT`s for receive-consuming bandwidth tests, `DONE` at
//! the end). Every receive lands in one landing buffer and is reposted as
//! soon as its completion is taken, so the peer never finds the receive
//! queue empty.

pub mod bw;
pub mod floor;
pub mod lat;
pub mod plot;
pub mod scale;
pub mod stats;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{debug, info, warn};

use stag::{
    Access, Completion, CompletionKind, CompletionQueue, ConnectOptions, Context, ContextOptions,
    Listener, MemoryRegion, OpKind, ProtectionDomain, QpCaps, QueuePair, Remote, SendOp, Support,
    WorkRequest,
};

pub use bw::run_bw;
pub use lat::run_lat;

/// perftest's default port.
pub const DEFAULT_PORT: u16 = 18515;

/// Largest message of `-a/--all` (perftest: 2^23).
pub const MAX_ALL_SIZE: u32 = 1 << 23;

/// Receives each side keeps posted.
pub(crate) const RX_DEPTH: u32 = 128;

/// A receive-consuming bandwidth test's server returns credit after this
/// many receives.
pub(crate) const CREDIT_BATCH: u32 = RX_DEPTH / 2;

/// Outstanding Reads/atomics/Commits a side allows (IRD = ORD).
pub(crate) const RD_ATOMIC: u8 = 16;

/// Completions taken from a CQ per poll call.
const POLL_BATCH: usize = 32;

/// How long a side waits for the peer before giving up.
pub(crate) const STALL: Duration = Duration::from_secs(30);

/// How long a server waits for the client to finish one size.
pub(crate) const PASSIVE_STALL: Duration = Duration::from_secs(600);

/// Everything a benchmark can fail with.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A verbs call failed.
    #[error(transparent)]
    Verbs(#[from] stag::Error),
    /// The command line does not make sense.
    #[error("invalid arguments: {0}")]
    Args(String),
    /// The device cannot run the operation.
    #[error("{op} cannot run on {device}: {why}")]
    Unsupported {
        /// The operation.
        op: OpKind,
        /// The device.
        device: String,
        /// Why.
        why: String,
    },
    /// The peer said something unexpected.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A work request completed with an error.
    #[error("work request {wr_id:#x} ({kind:?}) failed: {status}")]
    Completion {
        /// Its id.
        wr_id: u64,
        /// What it was.
        kind: CompletionKind,
        /// Status text.
        status: &'static str,
    },
    /// The peer went silent.
    #[error("no progress for {0:?} while {1}")]
    Stalled(Duration, &'static str),
    /// The peer address does not resolve.
    #[error("cannot resolve {0}: {1}")]
    Resolve(String, String),
    /// Writing output failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// JSON output failed.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// Drawing the plot failed.
    #[error("plot: {0}")]
    Plot(String),
    /// The in-process server of `--loopback` failed or panicked.
    #[error("loopback server: {0}")]
    Loopback(String),
}

/// Result of the benchmark code.
pub type Result<T> = std::result::Result<T, BenchError>;

fn parse_op(s: &str) -> std::result::Result<OpKind, String> {
    match OpKind::from_name(s) {
        Some(OpKind::SendInvalidate) => {
            Err("send-inv is not benchmarked (it is a Send plus an invalidation)".into())
        }
        Some(k) => Ok(k),
        None => Err(format!(
            "unknown operation {s:?}; one of: {}",
            BENCH_OPS.map(OpKind::name).join(", ")
        )),
    }
}

fn parse_progress(s: &str) -> std::result::Result<stag::Progress, String> {
    s.parse::<stag::Progress>().map_err(|e| e.to_string())
}

fn parse_op_kind(s: &str) -> std::result::Result<OpKind, String> {
    OpKind::from_name(s).ok_or_else(|| {
        format!(
            "unknown operation {s:?}; one of: {}",
            OpKind::ALL.map(OpKind::name).join(", ")
        )
    })
}

/// The operations `lat` and `bw` measure.
pub const BENCH_OPS: [OpKind; 12] = [
    OpKind::Send,
    OpKind::Write,
    OpKind::Read,
    OpKind::WriteImm,
    OpKind::Imm,
    OpKind::FetchAdd,
    OpKind::CmpSwap,
    OpKind::Swap,
    OpKind::MaskedFetchAdd,
    OpKind::MaskedCmpSwap,
    OpKind::AtomicWrite,
    OpKind::Commit,
];

/// Flags both `lat` and `bw` take (perftest's common ones and ours).
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// Operation: send, write, read, write-imm, imm, fetch-add, cmp-swap,
    /// swap, masked-fetch-add, masked-cmp-swap, atomic-write, commit.
    #[arg(value_parser = parse_op)]
    pub op: OpKind,
    /// Server to connect to (client mode). Without it, wait for one client
    /// (server mode).
    pub host: Option<String>,
    /// Device name (default: $STAG_DEVICE, else the first libibverbs
    /// device, else the userspace provider stag0).
    #[arg(short = 'd', long = "ib-dev")]
    pub ib_dev: Option<String>,
    /// Message size in bytes (atomics and imm: always 8).
    #[arg(short = 's', long)]
    pub size: Option<u32>,
    /// Run sizes 2 to 2^23 (powers of two).
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Iterations per size.
    #[arg(short = 'n', long)]
    pub iters: Option<u32>,
    /// TCP/CM port to listen on or connect to.
    #[arg(short = 'p', long, default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Accepted for perftest compatibility: connections always go through
    /// the connection manager.
    #[arg(short = 'R', long = "rdma_cm", alias = "rdma-cm")]
    pub rdma_cm: bool,
    /// Print results as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Wait for completions with cq.wait (event-driven) instead of
    /// busy-polling.
    #[arg(long)]
    pub blocking: bool,
    /// Force these operations through the emulation layer
    /// (comma-separated), to compare native and emulated cost.
    #[arg(long, value_delimiter = ',', value_parser = parse_op_kind)]
    pub emulate: Vec<OpKind>,
    /// Run server and client in this process (two threads).
    #[arg(long)]
    pub loopback: bool,
    /// Userspace provider: how QPs make progress (busy, adaptive or
    /// blocking; default: $STAG_PROGRESS, else the provider's default).
    /// Each side sets its own.
    #[arg(long, value_name = "MODE", value_parser = parse_progress)]
    pub progress: Option<stag::Progress>,
    /// libibverbs devices: post with ibv_post_send even where the provider
    /// has the extended ibv_wr_* API (to compare the two paths).
    #[arg(long)]
    pub legacy_post: bool,
    /// Userspace provider: run as an RFC 5040 RNIC, as kernel siw does (no
    /// Atomics, Immediate Data or Commit on the wire: they are emulated).
    #[arg(long)]
    pub rfc5040: bool,
    /// Commit: target a memory region at the server instead of a file
    /// (a device FLUSH commits memory alone; a file also needs the
    /// server's msync). The client's choice; the server follows it.
    #[arg(long)]
    pub commit_to_memory: bool,
    /// Userspace provider (MPA): do not ask for CRC32c on the wire (the
    /// server follows the client). Kernel siw asks for none by default;
    /// stag does, and on loopback the CRC is most of its per-byte cost.
    #[arg(long)]
    pub no_crc: bool,
    /// Address the server listens on (default 0.0.0.0; 127.0.0.1 with
    /// --loopback). libibverbs devices need the device's own address.
    #[arg(long)]
    pub bind: Option<IpAddr>,
}

pub use stag::bench_wire::hello::Test;

/// How an operation's latency is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Both sides send; one-way latency is half the round trip.
    PingPong,
    /// Only the client posts; the responder answers in its RNIC/provider.
    RoundTrip,
}

/// Whether `op` carries Immediate Data or is a Send (consumes a receive).
pub(crate) fn consumes_recv(op: OpKind) -> bool {
    matches!(op, OpKind::Send | OpKind::Imm | OpKind::WriteImm)
}

/// Whether `op` has a fixed 8-byte size.
pub(crate) fn fixed_eight(op: OpKind) -> bool {
    op == OpKind::Imm || op.is_atomic()
}

pub(crate) fn shape(op: OpKind) -> Shape {
    match op {
        OpKind::Send | OpKind::Write | OpKind::WriteImm | OpKind::Imm => Shape::PingPong,
        _ => Shape::RoundTrip,
    }
}

/// perftest-style title of a test.
pub(crate) fn title(op: OpKind) -> &'static str {
    match op {
        OpKind::Send | OpKind::SendInvalidate => "Send",
        OpKind::Write => "RDMA_Write",
        OpKind::Read => "RDMA_Read",
        OpKind::WriteImm => "RDMA_Write_with_Immediate",
        OpKind::Imm => "Immediate_Data",
        OpKind::FetchAdd => "Atomic_FetchAdd",
        OpKind::MaskedFetchAdd => "Atomic_Masked_FetchAdd",
        OpKind::CmpSwap => "Atomic_CmpSwap",
        OpKind::MaskedCmpSwap => "Atomic_Masked_CmpSwap",
        OpKind::Swap => "Atomic_Swap",
        OpKind::Commit => "RDMA_Commit",
        OpKind::AtomicWrite => "Atomic_Write",
    }
}

/// The sizes a run covers.
pub(crate) fn sizes(op: OpKind, size: Option<u32>, all: bool, default: u32) -> Result<Vec<u32>> {
    if fixed_eight(op) {
        if size.is_some_and(|s| s != 8) {
            warn!(%op, "{op} always moves 8 bytes; -s ignored");
        }
        return Ok(vec![8]);
    }
    if all {
        if size.is_some() {
            return Err(BenchError::Args("-s and -a exclude each other".into()));
        }
        return Ok((1..=MAX_ALL_SIZE.trailing_zeros())
            .map(|e| 1u32 << e)
            .collect());
    }
    let s = size.unwrap_or(default);
    if s == 0 || s > (1 << 30) {
        return Err(BenchError::Args(format!("size {s} is not in 1..=2^30")));
    }
    Ok(vec![s])
}

/// Validated settings shared by both sides (the client's choice wins).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub test: Test,
    pub op: OpKind,
    pub sizes: Vec<u32>,
    pub iters: u32,
    /// Outstanding WRs for bandwidth tests.
    pub tx_depth: u32,
    /// Commit: the server's target is memory, not a file.
    pub commit_to_memory: bool,
    /// Queue pairs (connections) the client drives at once (bandwidth).
    pub qps: u16,
    /// Ask for MPA CRC (client side; the server follows the client's
    /// request, as MPA lets a responder without its own wish do).
    pub mpa_crc: bool,
}

impl Plan {
    pub fn max_size(&self) -> u32 {
        self.sizes.iter().copied().max().unwrap_or(8)
    }

    /// Unmeasured warm-up iterations before each size (latency).
    pub fn warmup(&self) -> u32 {
        match self.test {
            Test::Lat => self.iters.min(100),
            Test::Bw => 0,
        }
    }

    /// Bytes of each side's target/source buffers.
    pub fn buf_len(&self) -> usize {
        (self.max_size() as usize)
            .max(8 * self.tx_depth as usize)
            .max(4096)
            .next_multiple_of(4096)
    }
}

/// What the two sides tell each other in the connection's private data
/// (`STGB`, [`stag::bench_wire::hello`]).
pub(crate) type BenchHello = stag::bench_wire::hello::Repr;

/// Parse a peer's hello.
fn decode_hello(b: &[u8]) -> Result<BenchHello> {
    BenchHello::decode(b).map_err(|e| BenchError::Protocol(format!("bad hello from the peer: {e}")))
}

/// Control messages (`STGC`, [`stag::bench_wire::ctrl`]).
pub(crate) use stag::bench_wire::ctrl::Kind as Ctrl;
use stag::bench_wire::ctrl::{Repr as CtrlMsg, LEN as CTRL_LEN};

/// wr_id bit of control Sends (never reported to the benchmark loops).
const CTRL_WR: u64 = 1 << 63;
/// wr_id of every receive.
pub(crate) const RECV_WR: u64 = 1 << 62;

pub(crate) const ALL_ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC)
    .union(Access::FLUSH_PERSISTENT);

/// Which side of the test a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Server,
    Client,
}

/// One connected side with its buffers.
pub(crate) struct Endpoint {
    pub role: Role,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    /// The buffer the peer writes/reads/targets (file-backed for Commit).
    pub data: MemoryRegion,
    /// Source of Writes/Sends, destination of Reads and atomic results.
    pub local: MemoryRegion,
    /// Where every receive lands.
    rx: MemoryRegion,
    /// Outgoing control messages.
    ctl: MemoryRegion,
    /// The peer's `data`.
    pub peer: Remote,
    pub blocking: bool,
    stash: VecDeque<Completion>,
    batch: Vec<Completion>,
    durable: Option<PathBuf>,
    /// While a post list is open ([`Endpoint::open_list`]), the WRs
    /// [`Endpoint::post`] collects for it.
    list: RefCell<Option<Vec<Listed>>>,
    /// Receives taken but not yet posted again, while reposts wait for
    /// the next post ([`Endpoint::repost_after_posts`]).
    owed_recvs: Cell<u32>,
    repost_after_posts: bool,
    /// Sends and Writes of at most this many octets are posted inline
    /// ([`Endpoint::post_inline_up_to`]); 0: none.
    inline_max: u32,
    // Held so the PD outlives the QP and regions.
    _pd: ProtectionDomain,
}

/// A WR collected for a post list: id, operation, local bytes.
type Listed = (u64, SendOp, Option<stag::Slice>);

/// Buffers made before the connection exists.
struct Buffers {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    data: MemoryRegion,
    local: MemoryRegion,
    rx: MemoryRegion,
    ctl: MemoryRegion,
    durable: Option<PathBuf>,
}

impl Buffers {
    fn new(ctx: &Context, plan: &Plan, role: Role) -> Result<Buffers> {
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(4 * (RX_DEPTH + 2 * plan.tx_depth) + 64)?;
        let len = plan.buf_len();
        let (data, durable) =
            if plan.op == OpKind::Commit && role == Role::Server && !plan.commit_to_memory {
                let path = std::env::temp_dir().join(format!(
                    "stag-bench-commit-{}-{}.bin",
                    std::process::id(),
                    ctx.name()
                ));
                let mr = pd.alloc_file_mr(&path, len, ALL_ACCESS)?;
                (mr, Some(path))
            } else {
                (pd.alloc_mr(len, ALL_ACCESS)?, None)
            };
        let local = pd.alloc_mr(len, ALL_ACCESS)?;
        let rx = pd.alloc_mr((plan.max_size() as usize).max(64), ALL_ACCESS)?;
        let ctl = pd.alloc_mr(64, ALL_ACCESS)?;
        Ok(Buffers {
            pd,
            cq,
            data,
            local,
            rx,
            ctl,
            durable,
        })
    }

    /// Post the receive queue full (before the peer can send).
    fn pre_post(&self) -> impl FnOnce(&QueuePair) -> stag::Result<()> {
        let rx = self.rx.clone();
        move |qp: &QueuePair| {
            for _ in 0..RX_DEPTH {
                qp.post_recv(RECV_WR, &[rx.slice(0, rx.len())?])?;
            }
            Ok(())
        }
    }

    fn into_endpoint(self, role: Role, qp: QueuePair, peer: Remote, blocking: bool) -> Endpoint {
        Endpoint {
            role,
            cq: self.cq,
            qp,
            data: self.data,
            local: self.local,
            rx: self.rx,
            ctl: self.ctl,
            peer,
            blocking,
            stash: VecDeque::new(),
            batch: Vec::with_capacity(32),
            durable: self.durable,
            list: RefCell::new(None),
            owed_recvs: Cell::new(0),
            repost_after_posts: false,
            inline_max: 0,
            _pd: self.pd,
        }
    }
}

fn connect_options(plan: &Plan, private_data: Vec<u8>) -> ConnectOptions {
    ConnectOptions {
        caps: QpCaps {
            max_send_wr: 2 * plan.tx_depth + 16,
            max_recv_wr: RX_DEPTH + 16,
            max_sge: 1,
        },
        private_data,
        responder_resources: RD_ATOMIC,
        initiator_depth: RD_ATOMIC,
        crc: plan.mpa_crc,
        ..ConnectOptions::default()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(p) = self.durable.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Endpoint {
    /// Take the next completion (other than a control Send's), reposting
    /// receives as they are taken. Busy-polls, or blocks in `cq.wait` with
    /// `--blocking`. Fails after [`STALL`] without one.
    pub fn next(&mut self, what: &'static str) -> Result<Completion> {
        self.next_within(what, STALL)
    }

    /// [`next`](Self::next) with a custom limit.
    pub fn next_within(&mut self, what: &'static str, limit: Duration) -> Result<Completion> {
        self.next_with(what, limit, self.blocking)
    }

    /// [`next`](Self::next), blocking in `cq.wait` when `block` whatever
    /// `--blocking` says.
    fn next_with(
        &mut self,
        what: &'static str,
        limit: Duration,
        block: bool,
    ) -> Result<Completion> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(c) = self.take_stashed()? {
                return Ok(c);
            }
            self.fill(block)?;
            if !self.stash.is_empty() {
                continue;
            }
            spins = spins.wrapping_add(1);
            if (block || spins.is_multiple_of(1024)) && start.elapsed() > limit {
                return Err(BenchError::Stalled(limit, what));
            }
            std::hint::spin_loop();
        }
    }

    /// Move completions from the CQ to the stash (waiting a little when
    /// `block`).
    fn fill(&mut self, block: bool) -> Result<()> {
        self.fill_up_to(block, POLL_BATCH)?;
        Ok(())
    }

    /// [`fill`](Self::fill), taking at most `max`; how many it took.
    fn fill_up_to(&mut self, block: bool, max: usize) -> Result<usize> {
        self.batch.clear();
        if block {
            self.cq
                .wait(&mut self.batch, max, Duration::from_millis(200))?;
        } else {
            self.cq.poll(&mut self.batch, max)?;
        }
        let n = self.batch.len();
        self.stash.extend(self.batch.drain(..));
        Ok(n)
    }

    /// The next stashed completion that is not a control Send's, checked
    /// and with its receive reposted.
    fn take_stashed(&mut self) -> Result<Option<Completion>> {
        while let Some(c) = self.stash.pop_front() {
            if !c.is_ok() {
                return Err(BenchError::Completion {
                    wr_id: c.wr_id,
                    kind: c.kind,
                    status: c.status.as_str(),
                });
            }
            if let CompletionKind::Recv { .. } = c.kind {
                self.owed_recvs.set(self.owed_recvs.get() + 1);
                if !self.repost_after_posts || self.owed_recvs.get() >= RX_DEPTH / 2 {
                    self.repost_owed()?;
                }
            }
            if c.wr_id & CTRL_WR != 0 {
                continue;
            }
            return Ok(Some(c));
        }
        Ok(None)
    }

    /// From now on a taken receive is posted again after this side's next
    /// post rather than before the completion is handed out: a ping-pong
    /// answers first and reposts while the peer's answer is on its way,
    /// as UCX reposts its receives in batches off the message's path.
    /// At least half the receive queue stays posted (a peer that sends
    /// more than that before an answer would find no receive).
    pub fn repost_after_posts(&mut self) {
        self.repost_after_posts = true;
    }

    /// Post the receives taken since the last repost again.
    fn repost_owed(&self) -> Result<()> {
        while self.owed_recvs.get() > 0 {
            self.qp
                .post_recv(RECV_WR, &[self.rx.slice(0, self.rx.len())?])?;
            self.owed_recvs.set(self.owed_recvs.get() - 1);
        }
        Ok(())
    }

    /// Take the completions already there without waiting, handing data
    /// completions to `f`.
    pub fn reap(&mut self, mut f: impl FnMut(&Completion)) -> Result<()> {
        // All of them: a QP visited once per turn over many QPs refills
        // its whole window as one list (one doorbell) instead of a poll
        // batch's worth.
        while self.fill_up_to(false, POLL_BATCH)? == POLL_BATCH {}
        while let Some(c) = self.take_stashed()? {
            f(&c);
        }
        Ok(())
    }

    /// Send a control message.
    pub fn send_ctrl(&mut self, kind: Ctrl, arg: u32) -> Result<()> {
        self.ctl.write_at(0, &CtrlMsg { kind, arg }.encode())?;
        self.qp.post_send(WorkRequest::new(
            CTRL_WR | kind as u64,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            &[self.ctl.slice(0, CTRL_LEN)?],
        ))?;
        self.repost_owed()
    }

    /// Whether a receive completion is a control message of `kind`; its
    /// argument if so.
    pub fn ctrl_of(&self, c: &Completion, kind: Ctrl) -> Result<Option<u32>> {
        let CompletionKind::Recv { len, .. } = c.kind else {
            return Ok(None);
        };
        if len as usize != CTRL_LEN {
            return Ok(None);
        }
        let mut m = [0u8; CTRL_LEN];
        self.rx.read_at(0, &mut m)?;
        let Some(msg) =
            CtrlMsg::decode(&m).map_err(|e| BenchError::Protocol(format!("from the peer: {e}")))?
        else {
            return Ok(None);
        };
        if msg.kind != kind {
            return Err(BenchError::Protocol(format!(
                "expected control message {kind:?}, got {:?}",
                msg.kind
            )));
        }
        Ok(Some(msg.arg))
    }

    /// Wait for the control message `kind`, reaping data completions on the
    /// way; a data receive here is a protocol error.
    pub fn expect_ctrl(&mut self, kind: Ctrl, what: &'static str) -> Result<u32> {
        // The server waits as long as the client's run of one size takes,
        // and sleeps meanwhile: its responder work is the provider's (or
        // the RNIC's), and a spinning idle server would only steal a core
        // from the client it is measuring against.
        let (limit, block) = match self.role {
            Role::Client => (STALL, self.blocking),
            Role::Server => (PASSIVE_STALL, true),
        };
        loop {
            let c = self.next_with(what, limit, block)?;
            if let Some(arg) = self.ctrl_of(&c, kind)? {
                return Ok(arg);
            }
            if let CompletionKind::Recv { len, .. } = c.kind {
                return Err(BenchError::Protocol(format!(
                    "a {len}-byte message while {what}"
                )));
            }
        }
    }

    /// Per-size barrier: the client says READY(i), the server answers GO.
    pub fn barrier(&mut self, index: u32) -> Result<()> {
        match self.role {
            Role::Client => {
                self.send_ctrl(Ctrl::Ready, index)?;
                self.expect_ctrl(Ctrl::Go, "waiting for the server's GO")?;
            }
            Role::Server => {
                let got = self.expect_ctrl(Ctrl::Ready, "waiting for the client's READY")?;
                if got != index {
                    return Err(BenchError::Protocol(format!(
                        "client is at size #{got}, server at #{index}"
                    )));
                }
                self.send_ctrl(Ctrl::Go, index)?;
            }
        }
        Ok(())
    }

    /// End of the test: the client says DONE once its last operation has
    /// completed; the server waits for it (so its buffers stay registered
    /// until then).
    pub fn finish(&mut self) -> Result<()> {
        match self.role {
            Role::Client => {
                self.send_ctrl(Ctrl::Done, 0)?;
                // Let the DONE leave before the QP goes away. The server
                // closes once it has it, which flushes our receives: from
                // here on completions other than the DONE's do not matter.
                let deadline = Instant::now() + Duration::from_secs(5);
                let done_id = CTRL_WR | Ctrl::Done as u64;
                'wait: while Instant::now() < deadline {
                    self.fill(false)?;
                    while let Some(c) = self.stash.pop_front() {
                        if c.wr_id == done_id {
                            break 'wait;
                        }
                    }
                    std::hint::spin_loop();
                }
            }
            Role::Server => {
                self.expect_ctrl(Ctrl::Done, "waiting for the client's DONE")?;
            }
        }
        Ok(())
    }

    /// Post a signaled WR on `local` bytes.
    pub fn post(&self, wr_id: u64, op: SendOp, local: Option<(usize, usize)>) -> Result<()> {
        let slice = match local {
            Some((off, len)) => Some(self.local.slice(off, len)?),
            None => None,
        };
        if let Some(list) = self.list.borrow_mut().as_mut() {
            list.push((wr_id, op, slice));
            return Ok(());
        }
        let local = slice.as_slice();
        let mut wr = WorkRequest::new(wr_id, op, local);
        wr.inline = self.inline_max > 0
            && op.sends_payload()
            && local.iter().map(|s| s.len()).sum::<u32>() <= self.inline_max;
        self.qp.post_send(wr)?;
        self.repost_owed()
    }

    /// Post Sends and Writes of up to `max` octets inline (`IBV_SEND_INLINE`:
    /// copied at post time), as perftest's latency tests do (`-I`).
    pub fn post_inline_up_to(&mut self, max: u32) {
        self.inline_max = max.min(stag::MAX_INLINE as u32);
    }

    /// [`post_inline_up_to`](Self::post_inline_up_to)'s size, for the
    /// report of an operation that carries a payload.
    pub fn inline_up_to(&self, op: OpKind) -> Option<u32> {
        let carries = matches!(op, OpKind::Send | OpKind::Write | OpKind::WriteImm);
        (carries && self.inline_max > 0).then_some(self.inline_max)
    }

    /// Collect what [`post`](Self::post) is given until
    /// [`post_list`](Self::post_list) posts it as one list (one doorbell),
    /// as perftest's `-l` does.
    pub fn open_list(&self) {
        *self.list.borrow_mut() = Some(Vec::new());
    }

    /// Post the list [`open_list`](Self::open_list) started.
    pub fn post_list(&self) -> Result<()> {
        let Some(list) = self.list.borrow_mut().take() else {
            return Ok(());
        };
        if !list.is_empty() {
            let wrs: Vec<WorkRequest<'_>> = list
                .iter()
                .map(|(wr_id, op, slice)| WorkRequest::new(*wr_id, *op, slice.as_slice()))
                .collect();
            self.qp
                .post_send_list(&wrs)
                .map_err(|e| BenchError::from(e.source))?;
        }
        Ok(())
    }
}

/// Open the device with the requested emulation.
/// Open a device with default options but for the progress mode.
pub(crate) fn open_context_on(
    ib_dev: Option<String>,
    progress: Option<stag::Progress>,
) -> Result<Context> {
    let opts = ContextOptions {
        progress,
        ..ContextOptions::default()
    };
    open_named(ib_dev, &opts)
}

/// Open `ib_dev`, else the default device, with `opts`.
fn open_named(ib_dev: Option<String>, opts: &ContextOptions) -> Result<Context> {
    let name = ib_dev.unwrap_or_else(stag::default_device);
    Ok(Context::open_with(&name, opts)?)
}

/// Raise this process's soft limit on open files to its hard limit: on
/// stag0 every QP is a TCP socket, so a benchmark with a thousand QPs needs
/// more than the usual soft limit of 1024. A failure only leaves the
/// limit as it was (the connects then fail with EMFILE, which says so).
pub fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write one rlimit we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                debug!("could not raise RLIMIT_NOFILE");
            }
        }
    }
}

pub(crate) fn open_context(common: &CommonArgs) -> Result<Context> {
    let opts = ContextOptions {
        force_emulation: common.emulate.clone(),
        legacy_post: common.legacy_post,
        rfc5040_only: common.rfc5040,
        progress: common.progress,
    };
    let ctx = open_named(common.ib_dev.clone(), &opts)?;
    for &k in &common.emulate {
        if ctx.capabilities().get(k).is_native() {
            warn!(op = %k, "no emulation exists for {k}; it stays native");
        }
    }
    Ok(ctx)
}

/// Fail early when the device cannot run `op` at all.
pub(crate) fn check_support(ctx: &Context, op: OpKind) -> Result<Support> {
    let s = ctx.capabilities().get(op).clone();
    if let Support::Unsupported { why } = &s {
        return Err(BenchError::Unsupported {
            op,
            device: ctx.name().to_owned(),
            why: why.clone(),
        });
    }
    Ok(s)
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| BenchError::Resolve(host.to_owned(), e.to_string()))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| BenchError::Resolve(host.to_owned(), "no addresses".into()))
}

/// The client side: connect, offering the plan and our target buffer.
pub(crate) fn connect_client(
    ctx: &Context,
    plan: &Plan,
    all: bool,
    addr: SocketAddr,
    blocking: bool,
) -> Result<Endpoint> {
    let bufs = Buffers::new(ctx, plan, Role::Client)?;
    let hello = BenchHello {
        test: plan.test,
        op: plan.op,
        all,
        size: if all { 0 } else { plan.sizes[0] },
        iters: plan.iters,
        tx_depth: plan.tx_depth as u16,
        commit_to_memory: plan.commit_to_memory,
        target: bufs.data.remote(0),
        qps: plan.qps,
    };
    let opts = connect_options(plan, hello.encode().to_vec());
    info!(%addr, op = %plan.op, "connecting");
    let (qp, private) = stag::connect_with(&bufs.pd, &bufs.cq, addr, &opts, bufs.pre_post())
        .map_err(|e| match e {
            stag::Error::Rejected(why) => BenchError::Protocol(format!(
                "the server rejected the connection: {}",
                String::from_utf8_lossy(&why)
            )),
            other => other.into(),
        })?;
    let reply = decode_hello(&private)?;
    debug!(?reply, "server hello");
    Ok(bufs.into_endpoint(Role::Client, qp, reply.target, blocking))
}

/// The server side: take one connection request, adopt the client's plan
/// (the operation and test must match ours), accept with our buffer.
pub(crate) fn accept_server(
    ctx: &Context,
    listener: &Listener,
    test: Test,
    op: OpKind,
    blocking: bool,
) -> Result<(Endpoint, Plan)> {
    let (req, hello) = next_request(listener)?;
    if hello.test != test || hello.op != op {
        let _ = req.reject(b"test mismatch");
        return Err(BenchError::Protocol(format!(
            "client runs {:?} {}, this server {:?} {}",
            hello.test, hello.op, test, op
        )));
    }
    let default = hello.size.max(1);
    let plan = Plan {
        test,
        op,
        sizes: sizes(op, (!hello.all).then_some(default), hello.all, default)?,
        iters: hello.iters,
        tx_depth: u32::from(hello.tx_depth).max(1),
        commit_to_memory: hello.commit_to_memory,
        qps: hello.qps.max(1),
        mpa_crc: false,
    };
    let ep = accept_request(ctx, req, hello, &plan, blocking)?;
    info!(op = %op, sizes = ?plan.sizes, iters = plan.iters, qps = plan.qps, "client connected");
    Ok((ep, plan))
}

/// The server side of a multi-QP test: accept the client's other
/// `plan.qps - 1` connections, which must announce the same plan.
pub(crate) fn accept_rest(
    ctx: &Context,
    listener: &Listener,
    plan: &Plan,
    blocking: bool,
) -> Result<Vec<Endpoint>> {
    (1..plan.qps)
        .map(|n| {
            let (req, hello) = next_request(listener)?;
            let first = plan.sizes[0];
            if (hello.test, hello.op, hello.iters, hello.qps, hello.size)
                != (plan.test, plan.op, plan.iters, plan.qps, first)
            {
                let _ = req.reject(b"plan mismatch");
                return Err(BenchError::Protocol(format!(
                    "QP #{n} announces {hello:?}, the first announced {plan:?}"
                )));
            }
            debug!(n, "further QP connected");
            accept_request(ctx, req, hello, plan, blocking)
        })
        .collect()
}

/// The next connection request and its [`BenchHello`] (a stranger is rejected).
fn next_request(listener: &Listener) -> Result<(stag::Incoming, BenchHello)> {
    let req = listener.get_request()?;
    match decode_hello(req.private_data()) {
        Ok(h) => Ok((req, h)),
        Err(e) => {
            let _ = req.reject(b"not a stag benchmark");
            Err(e)
        }
    }
}

/// Accept `req` with fresh buffers, answering with our target.
fn accept_request(
    ctx: &Context,
    req: stag::Incoming,
    hello: BenchHello,
    plan: &Plan,
    blocking: bool,
) -> Result<Endpoint> {
    let bufs = Buffers::new(ctx, plan, Role::Server)?;
    let ours = BenchHello {
        target: bufs.data.remote(0),
        ..hello
    };
    let opts = connect_options(plan, ours.encode().to_vec());
    let qp = req.accept_with(&bufs.pd, &bufs.cq, &opts, bufs.pre_post())?;
    Ok(bufs.into_endpoint(Role::Server, qp, hello.target, blocking))
}

/// Where the server listens.
pub(crate) fn bind_addr(common: &CommonArgs) -> SocketAddr {
    let ip = common.bind.unwrap_or(if common.loopback {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    });
    // Loopback picks a free port so that parallel runs do not collide.
    let port = if common.loopback { 0 } else { common.port };
    SocketAddr::new(ip, port)
}

/// The common shape of `run_lat`/`run_bw`: server, client or both.
pub(crate) fn run_roles<R: Send + 'static>(
    common: &CommonArgs,
    server: impl FnOnce(Context, Listener) -> Result<()> + Send + 'static,
    client: impl FnOnce(Context, SocketAddr) -> Result<R>,
) -> Result<Option<R>> {
    if common.loopback && common.host.is_some() {
        return Err(BenchError::Args(
            "--loopback runs both sides here; drop HOST".into(),
        ));
    }
    if common.loopback {
        let sctx = open_context(common)?;
        check_support(&sctx, common_op(common))?;
        let listener = Listener::bind(&sctx, bind_addr(common))?;
        let mut addr = listener.local_addr()?;
        if addr.ip().is_unspecified() {
            addr.set_ip(IpAddr::V4(Ipv4Addr::LOCALHOST));
        }
        let cctx = open_context(common)?;
        // Not scoped: if the client fails before connecting, the server
        // thread stays blocked in get_request and must not be joined.
        let h = std::thread::Builder::new()
            .name("stag-bench-server".into())
            .spawn(move || server(sctx, listener))?;
        let r = client(cctx, addr)?;
        match h.join() {
            Ok(Ok(())) => Ok(Some(r)),
            Ok(Err(e)) => Err(BenchError::Loopback(e.to_string())),
            Err(_) => Err(BenchError::Loopback("panicked".into())),
        }
    } else if let Some(host) = &common.host {
        let ctx = open_context(common)?;
        check_support(&ctx, common_op(common))?;
        let addr = resolve(host, common.port)?;
        Ok(Some(client(ctx, addr)?))
    } else {
        let ctx = open_context(common)?;
        check_support(&ctx, common_op(common))?;
        let listener = Listener::bind(&ctx, bind_addr(common))?;
        eprintln!(
            "# waiting for a client on {} ({} {} on {})",
            listener.local_addr()?,
            title(common.op),
            common.op,
            ctx.name()
        );
        server(ctx, listener)?;
        Ok(None)
    }
}

fn common_op(common: &CommonArgs) -> OpKind {
    common.op
}

/// Native or emulated on this connection, for the report (its matrix is
/// the device's resolved against the peer's).
pub(crate) fn support_label(qp: &QueuePair, op: OpKind) -> String {
    match qp.capabilities().get(op) {
        Support::Native => "native".into(),
        // Commit through a device FLUSH: which one ran depends on the
        // target, and the round-trip count says it.
        Support::NativeExcept { .. } => "native; file-backed targets emulated".into(),
        Support::Emulated { .. } => "emulated".into(),
        Support::Unsupported { .. } => "unsupported".into(),
    }
}

/// The progress mode a side runs: the flag's, else $STAG_PROGRESS's or
/// the provider's default (what `Context::open_with` picks).
pub(crate) fn progress_label(common: &CommonArgs) -> String {
    common
        .progress
        .unwrap_or_else(stag::Progress::from_env)
        .to_string()
}

/// The run's description, printed above the table and put in the JSON.
#[derive(Debug, Clone, Serialize)]
pub struct RunInfo {
    /// "lat" or "bw".
    pub test: Test,
    /// Operation name.
    pub op: String,
    /// Device.
    pub device: String,
    /// "userspace" or "ibverbs".
    pub backend: stag::Backend,
    /// "native" or "emulated".
    pub support: String,
    /// Operations forced through emulation.
    pub emulate: Vec<String>,
    /// Of those, the ones that have no emulation (they ran natively).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_emulated: Vec<String>,
    /// How work requests reach the device.
    pub post_path: stag::PostPath,
    /// "busy-poll" or "blocking".
    pub completions: &'static str,
    /// The userspace provider's progress mode: `--progress`, else
    /// $STAG_PROGRESS, else the provider's default.
    pub progress: String,
    /// 2 when one-way latency is half the round trip, else 1.
    pub latency_factor: u32,
    /// What the operations cost in round trips, counted (latency runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub round_trips: Option<RoundTrips>,
    /// Sends and Writes up to this many octets went inline (latency runs
    /// of those; `-I`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inline_up_to: Option<u32>,
}

/// The round trips a run's operations took, from the client QP's
/// counters: device work requests that wait for the responder (Reads,
/// atomics, Atomic Writes, FLUSHes; a Commit's Write does not wait) and
/// requests to the server's stag agent, per operation posted.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RoundTrips {
    /// Operations posted (warm-up included).
    pub ops: u64,
    /// The client QP's counters after the run.
    pub counters: stag::verbs::EmulationCounters,
    /// (device round trips + agent requests) / ops.
    pub per_op: f64,
}

impl RoundTrips {
    pub(crate) fn of(counters: stag::verbs::EmulationCounters, ops: u64) -> RoundTrips {
        let total = counters.device_round_trips + counters.agent_requests;
        RoundTrips {
            ops,
            counters,
            per_op: if ops == 0 {
                0.0
            } else {
                total as f64 / ops as f64
            },
        }
    }

    /// One line for the banner.
    pub(crate) fn line(&self) -> String {
        let per = |n: u64| n as f64 / self.ops.max(1) as f64;
        format!(
            " Round trips    : {:.2} per operation (device {:.2}, stag agent {:.2}; \
             CmpSwap-loop WRs {:.2})\n",
            self.per_op,
            per(self.counters.device_round_trips),
            per(self.counters.agent_requests),
            per(self.counters.cas_steps),
        )
    }
}

impl RunInfo {
    pub(crate) fn new(ctx: &Context, qp: &QueuePair, common: &CommonArgs, test: Test) -> RunInfo {
        RunInfo {
            test,
            op: common.op.name().to_owned(),
            device: ctx.name().to_owned(),
            backend: ctx.backend_kind(),
            support: support_label(qp, common.op),
            emulate: common.emulate.iter().map(|k| k.name().to_owned()).collect(),
            not_emulated: common
                .emulate
                .iter()
                .filter(|&&k| ctx.capabilities().get(k).is_native())
                .map(|k| k.name().to_owned())
                .collect(),
            post_path: ctx.capabilities().post_path,
            progress: progress_label(common),
            completions: if common.blocking {
                "blocking"
            } else {
                "busy-poll"
            },
            latency_factor: match shape(common.op) {
                Shape::PingPong => 2,
                Shape::RoundTrip => 1,
            },
            round_trips: None,
            inline_up_to: None,
        }
    }

    pub(crate) fn banner(&self, iters: u32, extra: &str) -> String {
        let line = "-".repeat(95);
        let kind = match self.test {
            Test::Lat => "Latency",
            Test::Bw => "BW",
        };
        let op = OpKind::from_name(&self.op).map(title).unwrap_or("?");
        let mut s = format!("{line}\n{:>30}{op} {kind} Test\n", "");
        s += &format!(" Device         : {} ({:?})\n", self.device, self.backend);
        s += &format!(" Operation      : {} ({})\n", self.op, self.support);
        if !self.not_emulated.is_empty() {
            s += &format!(
                " Note           : no emulation exists for {}; ran natively\n",
                self.not_emulated.join(", ")
            );
        }
        s += &format!(" Posting        : {}\n", self.post_path);
        s += &format!(" Completions    : {}\n", self.completions);
        s += &format!(" Progress       : {}\n", self.progress);
        s += &format!(" Iterations     : {iters}\n");
        if let Some(n) = self.inline_up_to {
            s += &format!(" Inline         : up to {n} bytes\n");
        }
        if self.test == Test::Lat {
            s += &format!(
                " Latency        : {}\n",
                if self.latency_factor == 2 {
                    "one-way (round trip / 2)"
                } else {
                    "round trip"
                }
            );
        }
        if let Some(rt) = &self.round_trips {
            s += &rt.line();
        }
        s += extra;
        s += &line;
        s.push('\n');
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(Debug, clap::Subcommand)]
    enum Cmd {
        Lat(lat::LatArgs),
        Bw(bw::BwArgs),
    }

    fn parse(args: &[&str]) -> std::result::Result<Cmd, clap::Error> {
        Cli::try_parse_from(std::iter::once("stag").chain(args.iter().copied())).map(|c| c.cmd)
    }

    #[test]
    fn lat_defaults_and_perftest_flags() {
        let Cmd::Lat(a) = parse(&["lat", "write"]).unwrap() else {
            panic!()
        };
        assert_eq!(a.common.op, OpKind::Write);
        assert_eq!(a.common.host, None);
        assert_eq!(a.common.port, DEFAULT_PORT);
        assert!(!a.common.blocking && !a.common.json && !a.common.loopback);
        assert!(a.common.progress.is_none());
        assert!(a.common.emulate.is_empty());
        assert!(a.plot.is_none());

        let Cmd::Lat(a) = parse(&[
            "lat",
            "read",
            "10.0.0.2",
            "-d",
            "rxe0",
            "-s",
            "64",
            "-n",
            "50",
            "-p",
            "9000",
            "-R",
            "--json",
            "--blocking",
            "--plot",
            "out.png",
        ])
        .unwrap() else {
            panic!()
        };
        assert_eq!(a.common.op, OpKind::Read);
        assert_eq!(a.common.host.as_deref(), Some("10.0.0.2"));
        assert_eq!(a.common.ib_dev.as_deref(), Some("rxe0"));
        assert_eq!(a.common.size, Some(64));
        assert_eq!(a.common.iters, Some(50));
        assert_eq!(a.common.port, 9000);
        assert!(a.common.rdma_cm && a.common.json && a.common.blocking);
        assert_eq!(a.plot, Some(PathBuf::from("out.png")));
    }

    #[test]
    fn bw_flags_and_emulate_list() {
        let Cmd::Bw(a) = parse(&[
            "bw",
            "swap",
            "--emulate",
            "swap,masked-fetch-add",
            "--report_gbits",
            "-a",
            "--loopback",
            "-t",
            "32",
        ])
        .unwrap() else {
            panic!()
        };
        assert_eq!(a.common.op, OpKind::Swap);
        assert_eq!(a.common.emulate, vec![OpKind::Swap, OpKind::MaskedFetchAdd]);
        assert!(a.report_gbits && a.common.all && a.common.loopback);
        assert_eq!(a.tx_depth, 32);
        let Cmd::Bw(a) = parse(&["bw", "write", "--rdma_cm", "--report-gbits"]).unwrap() else {
            panic!()
        };
        assert!(a.common.rdma_cm && a.report_gbits);
        assert_eq!(a.tx_depth, 128);
    }

    #[test]
    fn progress_modes_parse() {
        for mode in ["busy", "adaptive", "blocking"] {
            let Cmd::Bw(a) = parse(&["bw", "write", "--progress", mode]).unwrap() else {
                panic!()
            };
            assert_eq!(
                a.common.progress.map(|p| p.to_string()).as_deref(),
                Some(mode)
            );
        }
        assert!(parse(&["lat", "write", "--progress", "sometimes"]).is_err());
    }

    #[test]
    fn bad_ops_are_refused() {
        assert!(parse(&["lat", "frobnicate"]).is_err());
        assert!(parse(&["lat", "send-inv"]).is_err());
        assert!(parse(&["bw", "write", "--emulate", "nope"]).is_err());
        assert!(parse(&["lat", "write", "-s", "-3"]).is_err());
    }

    #[test]
    fn every_bench_op_parses() {
        for op in BENCH_OPS {
            assert_eq!(parse_op(op.name()), Ok(op));
        }
    }

    #[test]
    fn size_lists() {
        assert_eq!(sizes(OpKind::Write, None, false, 2).unwrap(), vec![2]);
        assert_eq!(
            sizes(OpKind::Write, Some(4096), false, 2).unwrap(),
            vec![4096]
        );
        let all = sizes(OpKind::Read, None, true, 2).unwrap();
        assert_eq!(all.len(), 23);
        assert_eq!((all[0], all[22]), (2, MAX_ALL_SIZE));
        assert_eq!(sizes(OpKind::FetchAdd, Some(4096), true, 2).unwrap(), [8]);
        assert_eq!(sizes(OpKind::Imm, None, false, 2).unwrap(), [8]);
        assert!(sizes(OpKind::Write, Some(0), false, 2).is_err());
        assert!(sizes(OpKind::Write, Some(64), true, 2).is_err());
    }
}
