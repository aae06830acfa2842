//! The emulation layer: one core per queue pair ([`QpCore`]) that routes
//! each work request to the device or to a strategy for what the device
//! (or the peer's) lacks, tracks every posted WR, and gives completions
//! their meaning in RC order.
//!
//! - routing: [`Route`], a plain enum resolved from the connection's
//!   capability matrix (its text is for display only);
//! - strategies, each a `post` and a step on its completions: the CmpSwap
//!   loop ([`cas`]), the peer's agent for atomics and Commit (`remote`,
//!   over the channel of [`agent`]), Immediate Data through the mailbox
//!   (`mailbox`); inline sends (`inline`) and RFC 7306 §1.1's probe
//!   (`probe`) beside them;
//! - tracking: [`crate::tracker`], one table for every path;
//! - ordering: [`order::SendOrder`]: a send queue's completions come out
//!   in posting order whatever path each WR took.

pub(crate) mod agent;
pub(crate) mod cas;
mod inline;
mod mailbox;
pub(crate) mod order;
mod probe;
mod remote;
pub(crate) mod srq;

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use smallvec::{smallvec, SmallVec};
use tracing::warn;

use provider::wr::{Remote, SendOp, WcStatus};

use self::agent::Agent;
use self::cas::CasLoop;
use self::inline::Gathered;
use self::order::SendOrder;
use self::srq::SrqCore;
use crate::backend::{QpOps, RawCompletion, SendPost};
use crate::caps::{Capabilities, Emulation, OpKind, OpSet, PostPath, Support};
use crate::cq::{Completion, CompletionKind, CompletionQueue, CompletionSink};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion, Slice};
use crate::pd::ProtectionDomain;
use crate::tracker::{Held, Table, Ticket, Tracker};
use crate::wr::{EmulationCounters, WorkRequest};

/// The token of a failure before any entry was made.
const NO_TOKEN: u64 = u64::MAX;

/// Emulation slots per QP (outstanding emulated atomics).
const SCRATCH_SLOTS: usize = 64;

/// How one work request runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// The device does it.
    Native,
    /// Read + CmpSwap until one sticks.
    CasLoop,
    /// The peer's agent (atomics; Commit after an ordering Read).
    Agent,
    /// A Write of the mailbox entry and a zero-length Send.
    Mailbox,
}

/// A posted work request awaiting its completion.
#[derive(Debug)]
pub(crate) struct Pending {
    wr_id: u64,
    what: What,
}

#[derive(Debug, Clone, Copy)]
enum What {
    Send {
        /// The application's operation (what its completion reports).
        op: SendOp,
        /// Its place in the send queue's order.
        seq: u64,
        signaled: bool,
        step: Step,
        /// The inline bounce slot it holds.
        bounce: Option<usize>,
    },
    /// RFC 7306 §1.1's FetchAdd of 0; its result goes to the prober.
    Probe { slot: usize },
}

/// The application's send WR a step belongs to.
#[derive(Debug, Clone, Copy)]
struct SendRef {
    wr_id: u64,
    op: SendOp,
    seq: u64,
    signaled: bool,
}

impl SendRef {
    /// The application's `wr`, at place `seq` of the send queue.
    fn of(wr: &WorkRequest<'_>, seq: u64) -> SendRef {
        SendRef {
            wr_id: wr.wr_id,
            op: wr.op,
            seq,
            signaled: wr.signaled,
        }
    }

    /// Its table entry for `step`.
    fn pending(&self, step: Step) -> Pending {
        self.holding(step, None)
    }

    /// Its table entry for `step`, which holds inline bounce slot
    /// `bounce` (freed when the entry goes): only the one entry whose
    /// slices are the bounce slot's may.
    fn holding(&self, step: Step, bounce: Option<usize>) -> Pending {
        Pending {
            wr_id: self.wr_id,
            what: What::Send {
                op: self.op,
                seq: self.seq,
                signaled: self.signaled,
                step,
                bounce,
            },
        }
    }
}

/// How a send WR ended.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    status: WcStatus,
    /// The target's value before an atomic.
    original: Option<u64>,
    vendor_err: u32,
}

impl Outcome {
    /// As the device reported it (no atomic's result read yet).
    fn of(rc: &RawCompletion) -> Outcome {
        Outcome {
            status: rc.status,
            original: None,
            vendor_err: rc.vendor_err,
        }
    }

    fn done(original: Option<u64>) -> Outcome {
        Outcome {
            status: WcStatus::Success,
            original,
            vendor_err: 0,
        }
    }

    fn failed(status: WcStatus, vendor_err: u32) -> Outcome {
        Outcome {
            status,
            original: None,
            vendor_err,
        }
    }
}

/// What a send WR's completion means.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// The application's WR itself.
    Final,
    /// An inner step (the mailbox's Writes): silent on success; its
    /// failure is the WR's.
    Silent,
    /// A step of the CmpSwap loop.
    Cas(CasLoop),
    /// The zero-length Read that orders a Commit after earlier Writes;
    /// then the agent's msync.
    CommitRead { remote: Remote, len: u32 },
    /// Waiting for the peer's agent (never posted to the device).
    Agent,
}

/// The per-QP core.
pub(crate) struct QpCore {
    /// Itself, for the strategies that hand an `Arc` of it to the agent.
    me: Weak<QpCore>,
    // The backend QP goes first: once it is destroyed the device touches
    // nothing the tracker's entries hold.
    backend: Arc<dyn QpOps>,
    ctx: Context,
    pd: ProtectionDomain,
    qp_num: u32,
    send_cq: CompletionQueue,
    tracker: Tracker<Pending>,
    /// The QP's own posted receives, by token: a wr_id and slices each.
    receives: Tracker<u64>,
    order: Mutex<SendOrder>,
    srq: Option<Arc<SrqCore>>,
    /// The agent channel, when this connection has one.
    agent: OnceLock<Arc<Agent>>,
    /// The matrix of this connection (set when it is established) and the
    /// peer's native set (`None`: the peer runs no stag).
    connection: OnceLock<(Capabilities, Option<OpSet>)>,
    /// 8-byte slots for emulation steps' results.
    scratch: MemoryRegion,
    free_slots: Mutex<Vec<usize>>,
    bounce: OnceLock<inline::Bounce>,
    /// Answers to probes, by token.
    probes: Mutex<HashMap<u64, (WcStatus, u32)>>,
    /// The peer's regions (by rkey) its agent said are device FLUSH
    /// targets: a Commit into one is a device FLUSH alone.
    flush_targets: Mutex<HashSet<u32>>,
    /// A completion failed: the QP is in Error, and what finishes later
    /// finishes flushed, as RC has it.
    errored: AtomicBool,
    cas_steps: AtomicU64,
    device_round_trips: AtomicU64,
    max_send_wr: u32,
}

impl std::fmt::Debug for QpCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpCore")
            .field("qp_num", &self.qp_num)
            .finish_non_exhaustive()
    }
}

impl From<Emulation> for Route {
    fn from(method: Emulation) -> Route {
        match method {
            Emulation::CasLoop => Route::CasLoop,
            Emulation::Agent => Route::Agent,
            Emulation::ImmMailbox => Route::Mailbox,
        }
    }
}

/// A native post waiting for the batch it goes out in.
struct Queued {
    ticket: Ticket,
    op: SendOp,
    fence: bool,
    seq: u64,
    /// Its payload, for a backend that copies inline data. Boxed: a
    /// `Queued` moves several times on its way to the backend, and the
    /// 264 octets of an `Inline` made every WR's moves memory copies (10 %
    /// of the posting thread at 1024 QPs), inline or not.
    inline: Option<Gathered>,
}

impl Queued {
    fn post(&self) -> SendPost<'_> {
        match &self.inline {
            Some(data) => self.ticket.send_inline(self.op, self.fence, data.bytes()),
            None => self.ticket.send(self.op, self.fence),
        }
    }
}

/// Native WRs of one list that go to the backend together, on the stack
/// (a post allocates nothing). The doorbell rings once per list, not per
/// batch ([`QpOps::post_send_held`]): on stag0 a ring is a socket write,
/// and with a ring per eight WRs, a 32-WR list of 8-byte Writes was four
/// `sendmsg` calls of 224 octets, most of the client's time at 64 QPs
/// (`stag bw --qps 64`).
const BATCH: usize = 8;

/// Most raw completions of a run whose tracker entries are taken under one
/// lock (and whose sends are released under one lock of the order).
const CQ_RUN: usize = 8;

/// A send WR's end, noted under the tracker's lock and released after it
/// ([`QpCore::release_ends`]).
struct SendEnd {
    /// Its place in the order, to release (`None`: a silent step's
    /// success, which releases nothing).
    seq: Option<u64>,
    completion: Option<Completion>,
    bounce: Option<usize>,
}

type Batch = SmallVec<[Queued; BATCH]>;

impl QpCore {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        pd: &ProtectionDomain,
        backend: Arc<dyn QpOps>,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<Arc<SrqCore>>,
        max_send_wr: u32,
    ) -> Result<Arc<QpCore>> {
        let scratch = pd.alloc_mr(SCRATCH_SLOTS * 8, Access::LOCAL_WRITE)?;
        let qp_num = backend.qp_num();
        let core = Arc::new_cyclic(|me| QpCore {
            me: me.clone(),
            backend,
            ctx: pd.context().clone(),
            pd: pd.clone(),
            qp_num,
            send_cq: send_cq.clone(),
            tracker: Tracker::new(Table::Qp),
            receives: Tracker::new(Table::Rq),
            order: Mutex::new(SendOrder::default()),
            srq,
            agent: OnceLock::new(),
            connection: OnceLock::new(),
            scratch,
            free_slots: Mutex::new((0..SCRATCH_SLOTS).rev().collect()),
            bounce: OnceLock::new(),
            probes: Mutex::new(HashMap::new()),
            flush_targets: Mutex::new(HashSet::new()),
            errored: AtomicBool::new(false),
            cas_steps: AtomicU64::new(0),
            device_round_trips: AtomicU64::new(0),
            max_send_wr,
        });
        let sink: Weak<dyn CompletionSink> = Arc::downgrade(&core) as Weak<QpCore>;
        send_cq.attach(qp_num, sink.clone());
        recv_cq.attach(qp_num, sink);
        Ok(core)
    }

    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    pub fn set_agent(&self, agent: Arc<Agent>) {
        let _ = self.agent.set(agent);
    }

    pub fn set_connection(&self, caps: Capabilities, peer_native: Option<OpSet>) {
        tracing::debug!(qp = self.qp_num, ?peer_native, "connection matrix:\n{caps}");
        let _ = self.connection.set((caps, peer_native));
    }

    /// The matrix this QP posts by: its connection's, else the device's.
    pub fn caps(&self) -> &Capabilities {
        self.connection
            .get()
            .map_or_else(|| self.ctx.capabilities(), |(c, _)| c)
    }

    pub fn peer_native(&self) -> Option<OpSet> {
        self.connection.get().and_then(|(_, p)| *p)
    }

    pub fn post_path(&self) -> PostPath {
        self.backend.post_path()
    }

    pub fn counters(&self) -> EmulationCounters {
        let (agent_requests, agent_served) = self.agent.get().map_or((0, 0), |a| a.counts());
        EmulationCounters {
            agent_requests,
            agent_served,
            cas_steps: self.cas_steps.load(Ordering::Relaxed),
            device_round_trips: self.device_round_trips.load(Ordering::Relaxed),
        }
    }

    pub fn outstanding(&self) -> usize {
        self.tracker.len() + self.receives.len()
    }

    pub fn set_error(&self) -> Result<()> {
        self.errored.store(true, Ordering::Release);
        self.backend.set_error()
    }

    pub fn progress(&self) {
        self.backend.progress();
    }

    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn socket_wait_fd(&self) -> Option<(std::os::fd::BorrowedFd<'_>, bool)> {
        self.backend.socket_wait_fd()
    }

    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn socket_wait(&self, on: bool) {
        self.backend.socket_wait(on);
    }

    /// The route of `wr` on this connection.
    fn route(&self, wr: &WorkRequest<'_>) -> Result<(OpKind, Route)> {
        let kind = OpKind::from(&wr.op);
        if kind.is_atomic() {
            // The same answer whichever path runs it.
            check_atomic_local(wr)?;
        }
        // Read from the matrix in place: a post clones none of its text.
        let route = match self.caps().get(kind) {
            Support::Native => Route::Native,
            Support::Emulated { method, .. } => Route::from(*method),
            Support::NativeExcept { method, .. } => {
                // Commit: the device's FLUSH where the peer's agent said
                // the region is a FLUSH target (or there is no agent to
                // ask: a peer without stag), else the emulation, whose
                // answer says.
                let flush_target = match wr.op {
                    SendOp::Commit { remote, .. } => self
                        .flush_targets
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .contains(&remote.rkey),
                    _ => false,
                };
                if flush_target || self.agent.get().is_none() {
                    Route::Native
                } else {
                    Route::from(*method)
                }
            }
            Support::Unsupported { why } => {
                return Err(Error::Unsupported {
                    op: kind,
                    device: self.ctx.name().to_owned(),
                    why: why.clone(),
                })
            }
        };
        if matches!(route, Route::Agent | Route::Mailbox) && self.agent.get().is_none() {
            return Err(Error::Unsupported {
                op: kind,
                device: self.ctx.name().to_owned(),
                why: "emulated through the peer's stag agent, and this peer runs none".into(),
            });
        }
        Ok((kind, route))
    }

    /// `ibv_post_send` of a list: native WRs go to the backend in batches
    /// (one `ibv_wr_start`), each emulated one on its own path in its
    /// place, and the doorbell rings once, at the end (on stag0 the list
    /// leaves in one socket write). Returns how many were posted before a
    /// failure.
    pub fn post_list(
        self: &Arc<Self>,
        wrs: &[WorkRequest<'_>],
    ) -> std::result::Result<(), (Error, usize)> {
        if let [wr] = wrs {
            // One WR, the usual post: no batch to gather it in.
            return self.post_single(wr).map_err(|e| (e, 0));
        }
        let mut held = false;
        let res = self.post_list_held(wrs, &mut held);
        if held {
            // Batches held for the end of the list, which a failure cut
            // short: the WRs before the failing one still leave.
            self.backend.ring();
        }
        res
    }

    /// [`post_list`](Self::post_list); `held` tells whether the backend
    /// holds WRs for a ring.
    fn post_list_held(
        self: &Arc<Self>,
        wrs: &[WorkRequest<'_>],
        held: &mut bool,
    ) -> std::result::Result<(), (Error, usize)> {
        let mut posted = 0;
        let mut rest = wrs;
        while let Some(wr) = rest.first() {
            let routed = self.route(wr);
            if matches!(routed, Ok((_, Route::Native))) && !self.numbered_zero_send(wr) {
                // A run of native WRs (up to a batch): prepared together,
                // taking the order's and the tracker's locks once for the
                // run rather than once per WR, and posted as one batch.
                let run = 1 + rest[1..]
                    .iter()
                    .take(BATCH - 1)
                    .take_while(|wr| self.batchable(wr))
                    .count();
                let mut batch = Batch::new();
                let failed = self.prepare_natives(&rest[..run], &mut batch);
                let more = failed.is_none() && run < rest.len();
                posted += self
                    .post_batch(&mut batch, more, held)
                    .map_err(|(e, n)| (e, posted + n))?;
                if let Some(e) = failed {
                    // The WRs before it are posted, as ibv_post_send's are
                    // before its bad_wr.
                    return Err((e, posted));
                }
                rest = &rest[run..];
                continue;
            }
            // What runs on its own path goes after the natives before it.
            posted += self
                .post_batch(&mut Batch::new(), false, held)
                .map_err(|(e, n)| (e, posted + n))?;
            match routed.and_then(|(_, route)| self.prepare(wr, route)) {
                Ok(Some(q)) => {
                    let mut batch = Batch::new();
                    batch.push(q);
                    posted += self
                        .post_batch(&mut batch, false, held)
                        .map_err(|(e, n)| (e, posted + n))?;
                }
                Ok(None) => posted += 1,
                Err(e) => return Err((e, posted)),
            }
            rest = &rest[1..];
        }
        Ok(())
    }

    /// A list of one WR. A native one goes straight to the backend: the
    /// batch machinery (arrays of a batch's payloads, tickets and posts on
    /// the stack, moved whole between its steps) was a fifth of an 8-octet
    /// Write's post, for nothing to gather (#20).
    fn post_single(self: &Arc<Self>, wr: &WorkRequest<'_>) -> Result<()> {
        let (_, route) = self.route(wr)?;
        match self.prepare(wr, route)? {
            None => Ok(()),
            Some(q) => self
                .post_queued(&q)
                .inspect_err(|_| self.rollback(q.ticket.token(), q.seq)),
        }
    }

    /// Whether `wr` goes to the backend in a batch of native WRs.
    fn batchable(&self, wr: &WorkRequest<'_>) -> bool {
        matches!(self.route(wr), Ok((_, Route::Native))) && !self.numbered_zero_send(wr)
    }

    /// Prepare a run of native WRs into `batch`: their payloads first,
    /// then their places in the order and their tracker entries, one lock
    /// of each for the run. The error of the first WR that could not be
    /// prepared; those before it are in `batch`.
    fn prepare_natives(&self, wrs: &[WorkRequest<'_>], batch: &mut Batch) -> Option<Error> {
        let mut helds: SmallVec<[(Held, Option<usize>); BATCH]> = SmallVec::new();
        let mut inlines: SmallVec<[Option<Gathered>; BATCH]> = SmallVec::new();
        let mut failed = None;
        for wr in wrs {
            match self.payload(wr) {
                Ok((held, bounce, inline)) => {
                    helds.push((held, bounce));
                    inlines.push(inline);
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let wrs = &wrs[..helds.len()];
        let first_seq = {
            let mut order = self.order.lock().unwrap_or_else(|p| p.into_inner());
            let first = order.next();
            for _ in 1..wrs.len() {
                order.next();
            }
            first
        };
        let mut inlines = inlines.into_iter();
        let mut seq = first_seq;
        let mut ticketed = wrs.iter();
        self.tracker.insert_all(
            wrs.iter()
                .zip(first_seq..)
                .zip(helds)
                .map(|((wr, seq), (held, bounce))| {
                    (SendRef::of(wr, seq).holding(Step::Final, bounce), held)
                }),
            |ticket| {
                let wr = ticketed.next().expect("one ticket per WR");
                batch.push(Queued {
                    ticket,
                    op: wr.op,
                    fence: wr.fence,
                    seq,
                    inline: inlines.next().flatten(),
                });
                seq += 1;
            },
        );
        failed
    }

    /// With an agent channel, zero-length Sends are numbered so the peer
    /// can tell them from mailbox Immediate Data: they are posted at once,
    /// in number order.
    fn numbered_zero_send(&self, wr: &WorkRequest<'_>) -> bool {
        self.agent.get().is_some()
            && matches!(wr.op, SendOp::Send { .. })
            && wr.local.iter().all(Slice::is_empty)
    }

    /// Post the batch of native WRs; how many went out. `hold`: the list
    /// goes on, and the backend may keep them for one doorbell at its end
    /// (`held` says it may have); otherwise ring for these and any held.
    fn post_batch(
        &self,
        batch: &mut Batch,
        hold: bool,
        held: &mut bool,
    ) -> std::result::Result<usize, (Error, usize)> {
        if batch.is_empty() {
            if !hold && std::mem::take(held) {
                self.backend.ring();
            }
            return Ok(0);
        }
        let res = {
            let posts: SmallVec<[_; BATCH]> = batch.iter().map(Queued::post).collect();
            if hold {
                *held = true;
                self.backend.post_send_held(&posts)
            } else {
                let res = self.backend.post_send(&posts);
                // A post that queued a WR rang for everything queued
                // before it too.
                if matches!(res, Ok(()) | Err((_, 1..))) {
                    *held = false;
                }
                res
            }
        };
        let n = match &res {
            Ok(()) => batch.len(),
            Err((_, n)) => *n,
        };
        for q in &batch[..n] {
            self.count_round_trip(&q.op);
        }
        for q in batch.drain(..).skip(n) {
            self.rollback(q.ticket.token(), q.seq);
        }
        res.map(|()| n)
    }

    fn count_round_trip(&self, op: &SendOp) {
        if op.needs_response() {
            self.device_round_trips.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A WR that was never posted: its entry goes, its place is released.
    fn rollback(&self, token: u64, seq: u64) {
        if let Some((p, _)) = self.tracker.remove(token) {
            if let What::Send {
                bounce: Some(b), ..
            } = p.what
            {
                self.free_bounce(b);
            }
        }
        self.finish(seq, None, false);
    }

    /// What a WR's entry holds: its slices, or its inline payload (copied
    /// now: for the backend to copy in turn, or into a bounce slot the
    /// entry holds).
    fn payload(&self, wr: &WorkRequest<'_>) -> Result<(Held, Option<usize>, Option<Gathered>)> {
        Ok(if !wr.inline {
            // Pushed one by one, as the tracker's SGEs are: `collect`'s
            // size hint, reserve and general extend were 40 instructions
            // of an 8-octet post, for the one or two slices a WR names.
            let mut held = Held::new();
            for s in wr.local {
                held.push(s.clone());
            }
            (held, None, None)
        } else if self.backend.copies_inline() {
            (Held::new(), None, Some(Gathered::gather(wr)?))
        } else {
            let (slice, slot) = self.bounce_copy(&*Gathered::gather(wr)?)?;
            (smallvec![slice], Some(slot), None)
        })
    }

    /// Post one routed WR: a native one comes back to be batched; an
    /// emulated one is posted on its path here.
    fn prepare(self: &Arc<Self>, wr: &WorkRequest<'_>, route: Route) -> Result<Option<Queued>> {
        // An inline payload is gathered now; the backend copies it into
        // its QP, or it goes from a bounce slot the WR's entry holds.
        let (held, bounce, inline) = self.payload(wr)?;
        let seq = self.order.lock().unwrap_or_else(|p| p.into_inner()).next();
        let w = SendRef::of(wr, seq);
        let posted = match route {
            Route::Native => {
                let ticket = self.tracker.insert(w.holding(Step::Final, bounce), held);
                let queued = Queued {
                    ticket,
                    op: wr.op,
                    fence: wr.fence,
                    seq,
                    inline,
                };
                if !self.numbered_zero_send(wr) {
                    return Ok(Some(queued));
                }
                let agent = self
                    .agent
                    .get()
                    .cloned()
                    .expect("numbered: there is an agent");
                let mut n = agent.zero_sends.lock().unwrap_or_else(|p| p.into_inner());
                let r = self.post_queued(&queued);
                if r.is_ok() {
                    *n += 1;
                }
                r.map_err(|e| (e, queued.ticket.token()))
            }
            Route::CasLoop => self.start_cas_loop(wr, w, held),
            Route::Agent => self.post_agent(wr, w, held),
            Route::Mailbox => self.post_imm(wr, w, held, bounce, inline.as_deref()),
        };
        match posted {
            Ok(()) => Ok(None),
            Err((e, token)) => {
                // The entry that failed goes, with the bounce slot if it
                // holds it; with no entry made, the slot goes here. The
                // place in the order is released.
                if token == NO_TOKEN {
                    if let Some(b) = bounce {
                        self.free_bounce(b);
                    }
                }
                self.rollback(token, seq);
                Err(e)
            }
        }
    }

    fn post_one(&self, ticket: &Ticket, op: SendOp, fence: bool) -> Result<()> {
        self.post_now(ticket.send(op, fence))
    }

    /// Post a native WR on its own, now.
    fn post_queued(&self, q: &Queued) -> Result<()> {
        self.post_now(q.post())
    }

    fn post_now(&self, post: SendPost<'_>) -> Result<()> {
        self.backend.post_send(&[post]).map_err(|(e, _)| e)?;
        self.count_round_trip(&post.op());
        Ok(())
    }

    /// `ibv_post_recv`.
    pub fn post_recv(&self, wr_id: u64, local: &[Slice]) -> Result<()> {
        if self.srq.is_some() {
            return Err(Error::InvalidRequest(
                "this QP takes its receives from a shared receive queue",
            ));
        }
        let held: Held = if local.is_empty() {
            // libsiw refuses a receive without SGEs (EINVAL); one
            // zero-length SGE of a live region means the same.
            smallvec![self.scratch.slice(0, 0)?]
        } else {
            local.iter().cloned().collect()
        };
        let ticket = self.receives.insert(wr_id, held);
        self.backend.post_recv(&ticket.recv()).inspect_err(|_| {
            self.receives.remove(ticket.token());
        })
    }

    /// WR `seq` finished: the completions now in order go onto the send
    /// CQ's ready queue, under the order's lock, so that a release on a
    /// polling thread and one on the agent's thread cannot swap places.
    /// `wake`: a thread may be asleep on the CQ (a release outside a poll).
    fn finish(&self, seq: u64, c: Option<Completion>, wake: bool) {
        let mut order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        self.send_cq
            .release_with(wake, |ready| order.finish(seq, c, ready));
    }

    fn completion(
        &self,
        wr_id: u64,
        status: WcStatus,
        kind: CompletionKind,
        vendor_err: u32,
    ) -> Completion {
        Completion {
            wr_id,
            status,
            qp_num: self.qp_num,
            kind,
            vendor_err,
        }
    }

    fn finish_send(&self, w: &SendRef, outcome: Outcome, wake: bool) {
        self.finish(w.seq, self.send_completion(w, &outcome), wake);
    }

    /// The one place a send WR's result becomes its completion (none for
    /// an unsignaled success).
    fn send_completion(&self, w: &SendRef, outcome: &Outcome) -> Option<Completion> {
        let ok = outcome.status == WcStatus::Success;
        (w.signaled || !ok).then(|| {
            self.completion(
                w.wr_id,
                outcome.status,
                send_kind(&w.op, outcome.original.unwrap_or(0), ok),
                outcome.vendor_err,
            )
        })
    }

    /// A run of raw completions of this QP, in order. The tracker's
    /// entries of a stretch of them are taken under one lock of it; each
    /// that is a send's end (most of them) only notes its place and
    /// completion there, and the stretch's notes are released in one lock
    /// of the order. Any other (a receive, whose entry is in another
    /// table, or an emulation step) ends the stretch: the notes before it
    /// are released, then it is handled on its own.
    fn complete_run(&self, run: &[RawCompletion], out: &mut Vec<Completion>) {
        if let [rc] = run {
            return self.complete_one(rc, out);
        }
        let mut rest = run;
        while let Some(first) = rest.first() {
            if Table::of(first.token) != Table::Qp {
                self.complete_recv(first, out);
                rest = &rest[1..];
                continue;
            }
            let mut ends: SmallVec<[SendEnd; CQ_RUN]> = SmallVec::new();
            let mut helds: SmallVec<[Held; CQ_RUN]> = SmallVec::new();
            let mut other = None;
            let stretch = rest
                .iter()
                .take_while(|rc| Table::of(rc.token) == Table::Qp)
                .take(CQ_RUN);
            let mut raws = stretch.clone();
            let taken = self
                .tracker
                .remove_each(stretch.map(|rc| rc.token), |entry| {
                    let rc = raws.next().expect("one raw completion per token");
                    self.note(rc, entry.is_some());
                    let Some((p, held)) = entry else {
                        return ControlFlow::Continue(());
                    };
                    match self.send_end(rc, &p) {
                        Some(end) => {
                            ends.push(end);
                            // The WR's completion is taken: its slices go,
                            // after the tracker's lock (dropping a region's
                            // last slice deregisters it).
                            helds.push(held);
                            ControlFlow::Continue(())
                        }
                        None => {
                            other = Some((*rc, p, held));
                            ControlFlow::Break(())
                        }
                    }
                });
            rest = &rest[taken..];
            drop(helds);
            self.release_ends(&ends);
            if let Some((rc, p, held)) = other {
                self.complete_entry(rc, p, held);
            }
        }
    }

    /// [`complete_run`](Self::complete_run) of a run of one, the usual
    /// poll of a ping-pong, where the completion (a Read's, an atomic's, a
    /// Receive's) is the round trip's turn: the same steps, without the
    /// arrays a stretch gathers its notes in.
    fn complete_one(&self, rc: &RawCompletion, out: &mut Vec<Completion>) {
        if Table::of(rc.token) != Table::Qp {
            return self.complete_recv(rc, out);
        }
        let entry = self.tracker.remove(rc.token);
        self.note(rc, entry.is_some());
        let Some((p, held)) = entry else {
            return;
        };
        match self.send_end(rc, &p) {
            Some(end) => {
                // Its slices go before the order's lock, as a stretch's do.
                drop(held);
                self.release_ends(std::slice::from_ref(&end));
            }
            None => self.complete_entry(*rc, p, held),
        }
    }

    /// Note the completion `rc`: an error's status, or (not `known`) that
    /// the tracker has no entry for its WR.
    fn note(&self, rc: &RawCompletion, known: bool) {
        if rc.status != WcStatus::Success {
            self.errored.store(true, Ordering::Release);
        }
        if !known {
            warn!(
                qp = self.qp_num,
                token = rc.token,
                "completion for an unknown WR"
            );
        }
    }

    /// What a send WR's completion `rc` of entry `p` releases, if it is
    /// the end of the WR with nothing more to do (no atomic's result to
    /// read, no emulation step to take); `None` for anything else.
    fn send_end(&self, rc: &RawCompletion, p: &Pending) -> Option<SendEnd> {
        let What::Send {
            op,
            seq,
            signaled,
            step,
            bounce,
        } = p.what
        else {
            return None;
        };
        let ok = rc.status == WcStatus::Success;
        let done = match step {
            Step::Final => !(ok && OpKind::from(&op).is_atomic()),
            Step::Silent => true,
            _ => false,
        };
        if !done {
            return None;
        }
        if matches!(step, Step::Silent) && ok {
            // An inner step's success releases nothing.
            return Some(SendEnd {
                seq: None,
                completion: None,
                bounce,
            });
        }
        let w = SendRef {
            wr_id: p.wr_id,
            op,
            seq,
            signaled,
        };
        Some(SendEnd {
            seq: Some(seq),
            completion: self.send_completion(&w, &Outcome::of(rc)),
            bounce,
        })
    }

    /// Release the sends of `ends`: their bounce slots, and their places
    /// in the order under one lock of it (see [`finish`](Self::finish)).
    fn release_ends(&self, ends: &[SendEnd]) {
        for b in ends.iter().filter_map(|e| e.bounce) {
            self.free_bounce(b);
        }
        if ends.iter().all(|e| e.seq.is_none()) {
            return;
        }
        let mut order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        self.send_cq.release_with(false, |ready| {
            for e in ends {
                if let Some(seq) = e.seq {
                    order.finish(seq, e.completion, ready);
                }
            }
        });
    }

    /// A receive's completion, from the QP's receive queue or its SRQ.
    fn complete_recv(&self, rc: &RawCompletion, out: &mut Vec<Completion>) {
        if rc.status != WcStatus::Success {
            self.errored.store(true, Ordering::Release);
        }
        let taken = match Table::of(rc.token) {
            Table::Srq => self.srq.as_ref().and_then(|s| s.take(rc.token)),
            _ => self.receives.remove(rc.token),
        };
        match taken {
            // Its slices go once the completion is made.
            Some((wr_id, _held)) => out.push(self.recv_completion(wr_id, rc)),
            None => warn!(
                qp = self.qp_num,
                token = rc.token,
                "completion for an unknown receive"
            ),
        }
    }

    /// A completion that is not a plain send's end (see
    /// [`send_end`](Self::send_end)), its entry taken from the tracker.
    fn complete_entry(&self, rc: RawCompletion, p: Pending, held: Held) {
        match p.what {
            What::Probe { slot } => {
                self.free_slot(slot);
                self.probes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(rc.token, (rc.status, rc.vendor_err));
            }
            What::Send {
                op,
                seq,
                signaled,
                step,
                bounce,
            } => {
                if let Some(b) = bounce {
                    self.free_bounce(b);
                }
                let w = SendRef {
                    wr_id: p.wr_id,
                    op,
                    seq,
                    signaled,
                };
                let outcome = Outcome::of(&rc);
                match step {
                    Step::Final => {
                        // Only an atomic's local slice holds a result.
                        let original = (rc.status == WcStatus::Success
                            && OpKind::from(&op).is_atomic())
                        .then(|| original_of(&held))
                        .flatten();
                        self.finish_send(
                            &w,
                            Outcome {
                                original,
                                ..outcome
                            },
                            false,
                        )
                    }
                    Step::Silent if rc.status == WcStatus::Success => {}
                    Step::Silent => self.finish_send(&w, outcome, false),
                    Step::Cas(cas) => self.cas_step(&rc, w, cas, held, false),
                    // The one step that posts through the agent, which
                    // takes an `Arc` of the core.
                    Step::CommitRead { remote, len } => match self.me.upgrade() {
                        Some(me) => me.commit_step(&rc, w, (remote, len), false),
                        None => warn!(qp = self.qp_num, "completion for a QP being dropped"),
                    },
                    Step::Agent => {
                        warn!(qp = self.qp_num, "device completion for an agent request")
                    }
                }
            }
        }
    }
}

/// What an atomic's local slice holds after the device wrote it.
fn original_of(held: &Held) -> Option<u64> {
    let s = held.first()?;
    let mut b = [0u8; 8];
    s.mr().read_at(s.offset(), &mut b).ok()?;
    Some(u64::from_ne_bytes(b))
}

fn send_kind(op: &SendOp, original: u64, ok: bool) -> CompletionKind {
    let original = if ok { original } else { 0 };
    match *op {
        SendOp::Send { .. } => CompletionKind::Send,
        SendOp::Write { .. } | SendOp::WriteImm { .. } => CompletionKind::Write,
        SendOp::Read { .. } => CompletionKind::Read,
        SendOp::Imm { .. } => CompletionKind::Imm,
        SendOp::FetchAdd { .. } => CompletionKind::FetchAdd { original },
        SendOp::CmpSwap {
            compare,
            compare_mask,
            ..
        } => CompletionKind::CmpSwap {
            original,
            swapped: ok && original & compare_mask == compare & compare_mask,
        },
        SendOp::Swap { .. } => CompletionKind::Swap { original },
        SendOp::Commit { .. } => CompletionKind::Commit,
        SendOp::AtomicWrite { .. } => CompletionKind::AtomicWrite,
    }
}

/// An atomic names one 8-byte local slice for the original value; an
/// Atomic Write carries its value in the request and names none.
fn check_atomic_local(wr: &WorkRequest<'_>) -> Result<()> {
    match wr.op {
        SendOp::AtomicWrite { .. } if !wr.local.is_empty() => Err(Error::InvalidRequest(
            "an Atomic Write carries its value in the request, not in local slices",
        )),
        SendOp::AtomicWrite { .. } => Ok(()),
        _ if wr.local.len() == 1 && wr.local[0].len() == 8 => Ok(()),
        _ => Err(Error::InvalidRequest(
            "an atomic needs one 8-byte local slice",
        )),
    }
}

impl CompletionSink for QpCore {
    fn complete(&self, run: &[RawCompletion], out: &mut Vec<Completion>) {
        // No `Arc` of the core per run (an atomic pair per poll that finds
        // a completion): the one step that needs one takes it.
        self.complete_run(run, out)
    }
}
