//! Queue pairs: posting work and giving completions their meaning, with
//! the emulation layer for what a device lacks.
//!
//! Every posted WR gets an internal token as its device wr_id; the token
//! maps to the application's wr_id, the operation and the slices it names.
//! The slices (and so their regions) stay alive in that table until the
//! completion is polled, so safe code can never unmap memory the device may
//! still touch.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tracing::warn;

use provider::wr::{Remote, SendOp, Sge, WcStatus};

use crate::agent::{Agent, AgentOp, FLUSH_TARGET};
use crate::caps::{Capabilities, Emulation, OpKind, OpSet, PostPath, Support};
use crate::cq::{Completion, CompletionKind, CompletionQueue, RawCompletion};
use crate::device::{Context, ProtectionDomain};
use crate::error::{Error, Result};
use crate::ibv;
use crate::mr::{Access, MemoryRegion, Slice};
use crate::srq::SharedReceiveQueue;

/// A send work request.
#[derive(Debug, Clone)]
pub struct WorkRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local buffers: gathered for Send/Write, scattered for Read, one
    /// 8-byte slice for an atomic's original value, none for Immediate
    /// Data and Commit.
    pub local: Vec<Slice>,
    /// Produce a completion on success (errors always complete).
    pub signaled: bool,
    /// Wait for earlier Reads and atomics before this one starts.
    pub fence: bool,
}

impl WorkRequest {
    /// A signaled WR without fence.
    pub fn new(wr_id: u64, op: SendOp, local: Vec<Slice>) -> WorkRequest {
        WorkRequest {
            wr_id,
            op,
            local,
            signaled: true,
            fence: false,
        }
    }
}

/// Which row of the capability matrix an operation falls in.
pub fn op_kind(op: &SendOp) -> OpKind {
    match *op {
        SendOp::Send {
            invalidate: None, ..
        } => OpKind::Send,
        SendOp::Send {
            invalidate: Some(_),
            ..
        } => OpKind::SendInvalidate,
        SendOp::Write { .. } => OpKind::Write,
        SendOp::WriteImm { .. } => OpKind::WriteImm,
        SendOp::Read { .. } => OpKind::Read,
        SendOp::Imm { .. } => OpKind::Imm,
        SendOp::FetchAdd { mask: 0, .. } => OpKind::FetchAdd,
        SendOp::FetchAdd { .. } => OpKind::MaskedFetchAdd,
        SendOp::CmpSwap {
            compare_mask: u64::MAX,
            swap_mask: u64::MAX,
            ..
        } => OpKind::CmpSwap,
        SendOp::CmpSwap { .. } => OpKind::MaskedCmpSwap,
        SendOp::Swap { .. } => OpKind::Swap,
        SendOp::Commit { .. } => OpKind::Commit,
        SendOp::AtomicWrite { .. } => OpKind::AtomicWrite,
    }
}

/// Limits of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per WR.
    pub max_sge: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_sge: 4,
        }
    }
}

/// An RC queue pair.
#[derive(Debug, Clone)]
pub struct QueuePair {
    pub(crate) inner: Arc<QpInner>,
}

/// A post list stopped at a work request that failed.
#[derive(Debug, thiserror::Error)]
#[error("work request {posted} of the list failed: {source}")]
pub struct PostListError {
    /// Work requests of the list that were posted (they complete as usual).
    pub posted: usize,
    /// Why the next one failed.
    #[source]
    pub source: Error,
}

pub(crate) struct QpInner {
    ctx: Context,
    send_cq: CompletionQueue,
    /// The agent channel, when this connection has one.
    pub(crate) agent: OnceLock<Arc<Agent>>,
    /// The matrix of this connection (set when it is established) and the
    /// peer's native set (`None`: the peer runs no stag).
    connection: OnceLock<(Capabilities, Option<OpSet>)>,
    backend: QpBackend,
    qp_num: u32,
    pending: Mutex<HashMap<u64, Pending>>,
    /// The SRQ its receives come from, if any.
    srq: Option<SharedReceiveQueue>,
    /// Answers to probes, by token.
    probes: Mutex<HashMap<u64, (WcStatus, u32)>>,
    /// 8-byte slots for emulation steps' results.
    scratch: MemoryRegion,
    free_slots: Mutex<Vec<usize>>,
    /// The peer's regions (by rkey) its agent said are device FLUSH
    /// targets: a Commit into one is a device FLUSH alone.
    flush_targets: Mutex<HashSet<u32>>,
    /// Work requests the CmpSwap loop has posted (Reads and CmpSwaps).
    cas_steps: AtomicU64,
    /// Posted WRs that wait for the responder (EmulationCounters).
    device_round_trips: AtomicU64,
    /// Post lists in progress: while non-zero, native posts on the
    /// userspace provider are framed but written at the list's end.
    lists: AtomicUsize,
}

impl std::fmt::Debug for QpInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpInner")
            .field("qp_num", &self.qp_num)
            .finish_non_exhaustive()
    }
}

pub(crate) enum QpBackend {
    User(provider::device::QueuePair),
    Ibv {
        qp: ibv::QueuePair,
        // Kept for the connection's lifetime (the QP lives on the id).
        id: ibv::CmId,
    },
}

/// A device wr_id no other WR of this process has (QPs and SRQs share the
/// space, since an SRQ's completions arrive on QPs).
pub(crate) fn next_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Emulation slots per QP (outstanding emulated atomics).
const SCRATCH_SLOTS: usize = 64;

/// A posted WR awaiting its completion.
struct Pending {
    wr_id: u64,
    /// `None` for a receive.
    op: Option<SendOp>,
    local: Vec<Slice>,
    signaled: bool,
    emulation: Option<Emu>,
}

/// What an emulated WR is waiting for.
#[derive(Debug, Clone, Copy)]
enum Emu {
    /// A step of the CmpSwap loop.
    Cas(CasLoop),
    /// The peer agent's answer.
    Agent,
    /// The zero-length Read that orders a Commit after earlier Writes;
    /// then the agent's msync.
    CommitAfterRead { remote: Remote, len: u32 },
    /// RFC 7306 §1.1's FetchAdd of 0; its result goes to the prober.
    Probe { slot: usize },
}

/// What the emulation layer has done on one connection: with all three at
/// zero, every operation so far ran natively on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct EmulationCounters {
    /// Requests this side sent to the peer's stag agent (emulated atomics
    /// and Commits).
    pub agent_requests: u64,
    /// The peer's requests this side's agent ran.
    pub agent_served: u64,
    /// Work requests the CmpSwap loop posted (its Reads and CmpSwaps).
    pub cas_steps: u64,
    /// Work requests posted to the device that wait for the responder's
    /// answer: Reads (also a Commit's ordering Read), atomics (also the
    /// CmpSwap loop's), Atomic Writes and FLUSHes. With `agent_requests`,
    /// the round trips the operations cost.
    pub device_round_trips: u64,
}

/// What RFC 7306 §1.1's probe learnt of the peer's atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerAtomics {
    /// The peer's device executes them: its stag header says so, or a
    /// FetchAdd of 0 completed.
    Native,
    /// A stag peer whose device lacks them: its agent runs them (nothing
    /// was sent).
    Agent,
    /// The peer refused the FetchAdd of 0 (RFC 7306 §1.1: "Remote Operation
    /// Error or Unexpected OpCode"). The refusal took the connection down,
    /// as any refused request does (an iWARP Terminate, an IB NAK): the QP
    /// is in Error and its other work completes with flush errors.
    Refused {
        /// The probe's completion status.
        status: WcStatus,
        /// The device's vendor error.
        vendor_err: u32,
    },
}

/// An atomic emulated by a CmpSwap retry loop: read the target, compute
/// the new value, CmpSwap it in; if another writer got there first, the
/// CmpSwap returns the newer value and the loop goes again.
#[derive(Debug, Clone, Copy)]
struct CasLoop {
    remote: Remote,
    slot: usize,
    /// The value the last CmpSwap expected (None while the Read is out).
    expected: Option<u64>,
}

impl QpInner {
    fn new(
        ctx: &Context,
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        srq: Option<SharedReceiveQueue>,
        backend: QpBackend,
        qp_num: u32,
    ) -> Result<QpInner> {
        let scratch = pd.alloc_mr(SCRATCH_SLOTS * 8, Access::LOCAL_WRITE)?;
        Ok(QpInner {
            ctx: ctx.clone(),
            send_cq: send_cq.clone(),
            agent: OnceLock::new(),
            connection: OnceLock::new(),
            backend,
            qp_num,
            pending: Mutex::new(HashMap::new()),
            probes: Mutex::new(HashMap::new()),
            srq,
            scratch,
            free_slots: Mutex::new((0..SCRATCH_SLOTS).rev().collect()),
            flush_targets: Mutex::new(HashSet::new()),
            cas_steps: AtomicU64::new(0),
            device_round_trips: AtomicU64::new(0),
            lists: AtomicUsize::new(0),
        })
    }
    fn token(&self) -> u64 {
        next_token()
    }

    pub(crate) fn set_connection(&self, caps: Capabilities, peer_native: Option<OpSet>) {
        tracing::debug!(qp = self.qp_num, ?peer_native, "connection matrix:\n{caps}");
        let _ = self.connection.set((caps, peer_native));
    }

    /// The matrix this QP posts by: its connection's, else the device's.
    fn caps(&self) -> &Capabilities {
        self.connection
            .get()
            .map_or_else(|| self.ctx.capabilities(), |(c, _)| c)
    }

    /// Post one WR to the device under `token` (the pending entry must
    /// already be in the table: the completion may beat this call back).
    fn post_raw(&self, token: u64, op: SendOp, sges: &[Sge], fence: bool) -> Result<()> {
        self.post_raw_to_device(token, op, sges, fence)?;
        if !matches!(
            op,
            SendOp::Send { .. }
                | SendOp::Write { .. }
                | SendOp::WriteImm { .. }
                | SendOp::Imm { .. }
        ) {
            self.device_round_trips.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn post_raw_to_device(&self, token: u64, op: SendOp, sges: &[Sge], fence: bool) -> Result<()> {
        match &self.backend {
            QpBackend::User(qp) => {
                let wr = provider::wr::SendWr {
                    wr_id: token,
                    op,
                    sg_list: sges.to_vec(),
                    // Always signaled underneath: the table entry (and the
                    // memory it keeps alive) is released by the completion.
                    signaled: true,
                    fence,
                };
                if self.lists.load(Ordering::Acquire) > 0 {
                    qp.post_send_unrung(wr)?;
                } else {
                    qp.post_send(wr)?;
                }
            }
            QpBackend::Ibv { qp, .. } => {
                let mut flags = ibv::SendFlags::SIGNALED;
                if fence {
                    flags = ibv::SendFlags(flags.0 | ibv::SendFlags::FENCE.0);
                }
                if let SendOp::Commit { remote, len } = op {
                    // Only through ibv_wr_flush (the matrix says native
                    // only on a QP created with its flag). Global: what a
                    // FLUSH target needs (see caps::native_flush_commit).
                    let mut batch = qp.start_wr()?;
                    batch.flush(
                        token,
                        flags,
                        remote.rkey,
                        remote.addr,
                        len as usize,
                        ibv::FlushType::Global,
                        ibv::FlushLevel::Range,
                    )?;
                    batch.commit()?;
                    return Ok(());
                }
                if let SendOp::AtomicWrite { remote, value } = op {
                    // Only through ibv_wr_atomic_write (the matrix says
                    // native only on a QP created with its flag).
                    let mut batch = qp.start_wr()?;
                    batch.atomic_write(
                        token,
                        flags,
                        remote.rkey,
                        remote.addr,
                        value.to_ne_bytes(),
                    )?;
                    batch.commit()?;
                    return Ok(());
                }
                let iop = ibv_op(&op)
                    .ok_or(Error::InvalidRequest("operation has no libibverbs opcode"))?;
                let isges = ibv_sges(sges);
                if let SendOp::Send {
                    solicited: true, ..
                } = op
                {
                    flags = ibv::SendFlags(flags.0 | ibv::SendFlags::SOLICITED.0);
                }
                if qp.has_wr_api() {
                    let mut batch = qp.start_wr()?;
                    // SAFETY: every SGE names a slice of a registered
                    // region that the pending table keeps alive until this
                    // WR's completion is polled.
                    unsafe { batch.push(token, flags, iop, &isges) }?;
                    batch.commit()?;
                } else {
                    let wr = ibv::SendWr {
                        wr_id: token,
                        op: iop,
                        sges: &isges,
                        flags,
                    };
                    // SAFETY: as above.
                    unsafe { qp.post_send(&[wr]) }.map_err(|(e, _)| e)?;
                }
            }
        }
        Ok(())
    }

    fn insert(&self, token: u64, p: Pending) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, p);
    }

    fn remove(&self, token: u64) -> Option<Pending> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&token)
    }

    fn post_send(self: &Arc<Self>, wr: WorkRequest) -> Result<()> {
        let kind = op_kind(&wr.op);
        if kind.is_atomic() {
            // The same answer whichever path runs it (the CmpSwap loop and
            // the agent rely on this check).
            check_atomic_local(&wr)?;
        }
        let mut support = self.caps().get(kind).clone();
        if let Support::NativeExcept { method, .. } = support {
            // Commit: the device's FLUSH where the peer's agent said the
            // region is a FLUSH target (or there is no agent to ask: a
            // peer without stag), else the emulation, whose answer says.
            let flush_target = match wr.op {
                SendOp::Commit { remote, .. } => self
                    .flush_targets
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .contains(&remote.rkey),
                _ => false,
            };
            support = if flush_target || self.agent.get().is_none() {
                Support::Native
            } else {
                method.support_for(kind)
            };
        }
        match support {
            Support::Native => {
                // With an agent channel, zero-length Sends are numbered so
                // the peer can tell them from mailbox Immediate Data.
                let zero_send =
                    matches!(wr.op, SendOp::Send { .. }) && wr.local.iter().all(|s| s.is_empty());
                let agent = self.agent.get().filter(|_| zero_send);
                let mut zero_sends =
                    agent.map(|a| a.zero_sends.lock().unwrap_or_else(|p| p.into_inner()));
                let token = self.token();
                let sges: Vec<Sge> = wr.local.iter().map(Slice::sge).collect();
                self.insert(
                    token,
                    Pending {
                        wr_id: wr.wr_id,
                        op: Some(wr.op),
                        local: wr.local,
                        signaled: wr.signaled,
                        emulation: None,
                    },
                );
                if let Err(e) = self.post_raw(token, wr.op, &sges, wr.fence) {
                    self.remove(token);
                    return Err(e);
                }
                if let Some(n) = zero_sends.as_deref_mut() {
                    *n += 1;
                }
                Ok(())
            }
            Support::Emulated {
                method: Emulation::CasLoop,
                ..
            } => self.start_cas_loop(wr),
            Support::Emulated { method, .. } => {
                let Some(agent) = self.agent.get().cloned() else {
                    return Err(Error::Unsupported {
                        op: kind,
                        device: self.ctx.name().to_owned(),
                        why: "emulated through the peer's stag agent, and this peer runs none"
                            .into(),
                    });
                };
                if method == Emulation::ImmMailbox {
                    self.post_imm(&agent, wr)
                } else {
                    self.post_agent(&agent, wr)
                }
            }
            Support::Unsupported { why } => Err(Error::Unsupported {
                op: kind,
                device: self.ctx.name().to_owned(),
                why,
            }),
            Support::NativeExcept { .. } => unreachable!("resolved above"),
        }
    }

    fn start_cas_loop(&self, wr: WorkRequest) -> Result<()> {
        let remote = match wr.op {
            SendOp::FetchAdd { remote, .. }
            | SendOp::CmpSwap { remote, .. }
            | SendOp::Swap { remote, .. }
            | SendOp::AtomicWrite { remote, .. } => remote,
            _ => {
                return Err(Error::InvalidRequest(
                    "only atomics are emulated by a CmpSwap loop",
                ))
            }
        };
        let slot = self.take_slot()?;
        let pending = Pending {
            wr_id: wr.wr_id,
            op: Some(wr.op),
            local: wr.local,
            signaled: wr.signaled,
            emulation: Some(Emu::Cas(CasLoop {
                remote,
                slot,
                expected: None,
            })),
        };
        self.post_slot_step(slot, pending, SendOp::Read { remote }, wr.fence)?;
        Ok(())
    }

    /// Post `step` with scratch slot `slot` as its one SGE, under a new
    /// token whose table entry is `pending`; returns the token. If it
    /// cannot be posted, the entry and the slot are released.
    fn post_slot_step(
        &self,
        slot: usize,
        pending: Pending,
        step: SendOp,
        fence: bool,
    ) -> Result<u64> {
        if matches!(pending.emulation, Some(Emu::Cas(_))) {
            self.cas_steps.fetch_add(1, Ordering::Relaxed);
        }
        let posted = self.scratch.slice(slot * 8, 8).and_then(|s| {
            let token = self.token();
            self.insert(token, pending);
            self.post_raw(token, step, &[s.sge()], fence)
                .map(|()| token)
                .inspect_err(|_| {
                    self.remove(token);
                })
        });
        if posted.is_err() {
            self.free_slot(slot);
        }
        posted
    }

    /// Post a native FetchAdd of 0 at `target` and drive the send CQ until
    /// it completes (other completions stay queued for the application).
    fn probe(&self, target: Remote, timeout: Duration) -> Result<(WcStatus, u32)> {
        let slot = self.take_slot()?;
        let op = SendOp::FetchAdd {
            remote: target,
            add: 0,
            mask: 0,
        };
        let pending = Pending {
            wr_id: 0,
            op: Some(op),
            local: Vec::new(),
            signaled: true,
            emulation: Some(Emu::Probe { slot }),
        };
        let token = self.post_slot_step(slot, pending, op, false)?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self
                .probes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&token)
            {
                return Ok(r);
            }
            if Instant::now() >= deadline {
                // The entry stays: a late completion still frees the slot.
                return Err(Error::Timeout("the peer did not answer the atomics probe"));
            }
            self.send_cq.drive()?;
            std::thread::yield_now();
        }
    }

    /// An 8-byte scratch slot for an emulation step's result.
    fn take_slot(&self) -> Result<usize> {
        self.free_slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or(Error::InvalidRequest(
                "too many emulated atomics outstanding on this QP",
            ))
    }

    fn free_slot(&self, slot: usize) {
        self.free_slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(slot);
    }
    fn post_recv(&self, wr_id: u64, local: Vec<Slice>) -> Result<()> {
        if self.srq.is_some() {
            return Err(Error::InvalidRequest(
                "this QP takes its receives from a shared receive queue",
            ));
        }
        let token = self.token();
        let sges: Vec<Sge> = local.iter().map(Slice::sge).collect();
        self.insert(
            token,
            Pending {
                wr_id,
                op: None,
                local,
                signaled: true,
                emulation: None,
            },
        );
        let res = match &self.backend {
            QpBackend::User(qp) => qp
                .post_recv(provider::wr::RecvWr {
                    wr_id: token,
                    sg_list: sges,
                })
                .map_err(Error::from),
            QpBackend::Ibv { qp, .. } => {
                let mut isges = ibv_sges(&sges);
                if isges.is_empty() {
                    // libsiw refuses a receive without SGEs (EINVAL); one
                    // zero-length SGE of a live region means the same.
                    isges = ibv_sges(&[self.scratch.slice(0, 0)?.sge()]);
                }
                let wr = ibv::RecvWr {
                    wr_id: token,
                    sges: &isges,
                };
                // SAFETY: the slices stay alive in the pending table until
                // the receive completes.
                unsafe { qp.post_recv(&[wr]) }.map_err(|(e, _)| Error::from(e))
            }
        };
        if res.is_err() {
            self.remove(token);
        }
        res
    }

    /// Give a raw completion its meaning; `None` when it was an internal
    /// step or an unsignaled success.
    pub(crate) fn complete(self: &Arc<Self>, rc: RawCompletion) -> Option<Completion> {
        let Some(p) = self.remove(rc.token).or_else(|| self.srq_receive(rc.token)) else {
            warn!(
                qp = self.qp_num,
                token = rc.token,
                "completion for an unknown WR"
            );
            return None;
        };
        match p.emulation {
            Some(Emu::Cas(cas)) => return self.cas_step(rc, p, cas),
            Some(Emu::CommitAfterRead { remote, len }) => {
                return self.commit_step(rc, p, remote, len)
            }
            Some(Emu::Probe { slot }) => {
                self.free_slot(slot);
                self.probes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(rc.token, (rc.status, rc.vendor_err));
                return None;
            }
            Some(Emu::Agent) | None => {}
        }
        let ok = rc.status == WcStatus::Success;
        let kind = match p.op {
            None => {
                // A zero-length receive may be Immediate Data that came
                // through the mailbox.
                let (imm, solicited) = match (rc.imm, self.agent.get()) {
                    (None, Some(agent)) if ok && rc.byte_len == 0 => {
                        match agent.zero_length_recv() {
                            Some((imm, solicited)) => (Some(imm), solicited || rc.solicited),
                            None => (None, rc.solicited),
                        }
                    }
                    (imm, _) => (imm, rc.solicited),
                };
                CompletionKind::Recv {
                    len: rc.byte_len,
                    imm,
                    invalidated: rc.invalidated,
                    solicited,
                }
            }
            Some(op) => self.send_kind(&op, &p.local, ok),
        };
        (p.signaled || !ok || p.op.is_none()).then_some(Completion {
            wr_id: p.wr_id,
            status: rc.status,
            qp_num: self.qp_num,
            kind,
            vendor_err: rc.vendor_err,
        })
    }
    /// A receive this QP drew from its SRQ.
    fn srq_receive(&self, token: u64) -> Option<Pending> {
        let (wr_id, local) = self.srq.as_ref()?.inner.take(token)?;
        Some(Pending {
            wr_id,
            op: None,
            local,
            signaled: true,
            emulation: None,
        })
    }

    fn original(local: &[Slice]) -> u64 {
        let mut b = [0u8; 8];
        if let Some(s) = local.first() {
            let _ = s.mr().read_at(s.offset(), &mut b);
        }
        u64::from_ne_bytes(b)
    }

    fn send_kind(&self, op: &SendOp, local: &[Slice], ok: bool) -> CompletionKind {
        let original = if ok { Self::original(local) } else { 0 };
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

    /// One step of a CmpSwap loop.
    fn cas_step(&self, rc: RawCompletion, p: Pending, mut cas: CasLoop) -> Option<Completion> {
        let op = p.op.expect("emulated WRs are sends");
        let fail = |status| {
            Some(Completion {
                wr_id: p.wr_id,
                status,
                qp_num: self.qp_num,
                kind: self.send_kind(&op, &p.local, false),
                vendor_err: rc.vendor_err,
            })
        };
        if rc.status != WcStatus::Success {
            self.free_slot(cas.slot);
            return fail(rc.status);
        }
        let current = self.scratch.load_u64(cas.slot * 8).unwrap_or(0);
        if let Some(expected) = cas.expected {
            if current == expected {
                // The CmpSwap stuck: `expected` was the original value.
                return self.cas_done(p, op, cas.slot, expected);
            }
        }
        let new = match op {
            SendOp::FetchAdd { add, mask, .. } => {
                provider::wire::atomic::fetch_add(current, add, mask)
            }
            SendOp::CmpSwap {
                compare,
                compare_mask,
                swap,
                swap_mask,
                ..
            } => provider::wire::atomic::cmp_swap(current, compare, compare_mask, swap, swap_mask),
            SendOp::Swap { swap, .. } => swap,
            SendOp::AtomicWrite { value, .. } => value,
            _ => current,
        };
        if new == current {
            // Nothing to write (a failed masked compare, or an add of
            // zero): the value read is a valid linearisation point.
            return self.cas_done(p, op, cas.slot, current);
        }
        cas.expected = Some(current);
        let step = SendOp::CmpSwap {
            remote: cas.remote,
            compare: current,
            compare_mask: u64::MAX,
            swap: new,
            swap_mask: u64::MAX,
        };
        let pending = Pending {
            wr_id: p.wr_id,
            op: Some(op),
            local: p.local.clone(),
            signaled: p.signaled,
            emulation: Some(Emu::Cas(cas)),
        };
        if let Err(e) = self.post_slot_step(cas.slot, pending, step, false) {
            warn!(qp = self.qp_num, error = %e, "emulation step could not be posted");
            return fail(WcStatus::LocQpOpErr);
        }
        None
    }

    /// An atomic or Commit through the peer's agent.
    fn post_agent(self: &Arc<Self>, agent: &Arc<Agent>, wr: WorkRequest) -> Result<()> {
        let token = self.token();
        let (remote, op) = match wr.op {
            SendOp::FetchAdd { remote, add, mask } => (remote, AgentOp::FetchAdd { add, mask }),
            SendOp::CmpSwap {
                remote,
                compare,
                compare_mask,
                swap,
                swap_mask,
            } => (
                remote,
                AgentOp::CmpSwap {
                    compare,
                    compare_mask,
                    swap,
                    swap_mask,
                },
            ),
            SendOp::Swap { remote, swap } => (remote, AgentOp::Swap { swap }),
            // The agent's Swap, its original value dropped.
            SendOp::AtomicWrite { remote, value } => (remote, AgentOp::Swap { swap: value }),
            SendOp::Commit { remote, len } => {
                // Read-after-write: a zero-length Read returns only after
                // every earlier Write on this QP is placed; then msync.
                self.insert(
                    token,
                    Pending {
                        wr_id: wr.wr_id,
                        op: Some(wr.op),
                        local: Vec::new(),
                        signaled: wr.signaled,
                        emulation: Some(Emu::CommitAfterRead { remote, len }),
                    },
                );
                if let Err(e) = self.post_raw(token, SendOp::Read { remote }, &[], wr.fence) {
                    self.remove(token);
                    return Err(e);
                }
                return Ok(());
            }
            _ => {
                return Err(Error::InvalidRequest(
                    "the agent runs atomics and Commit only",
                ))
            }
        };
        self.insert(
            token,
            Pending {
                wr_id: wr.wr_id,
                op: Some(wr.op),
                local: wr.local,
                signaled: wr.signaled,
                emulation: Some(Emu::Agent),
            },
        );
        if let Err(e) = agent.request(self, token, remote, op) {
            self.remove(token);
            return Err(e);
        }
        Ok(())
    }

    /// The ordering Read of an emulated Commit completed: ask the agent.
    fn commit_step(
        self: &Arc<Self>,
        rc: RawCompletion,
        p: Pending,
        remote: Remote,
        len: u32,
    ) -> Option<Completion> {
        let op = p.op.expect("emulated WRs are sends");
        let fail = |status, vendor_err| {
            Some(Completion {
                wr_id: p.wr_id,
                status,
                qp_num: self.qp_num,
                kind: CompletionKind::Commit,
                vendor_err,
            })
        };
        if rc.status != WcStatus::Success {
            return fail(rc.status, rc.vendor_err);
        }
        let Some(agent) = self.agent.get().cloned() else {
            return fail(WcStatus::LocQpOpErr, 0);
        };
        let token = self.token();
        self.insert(
            token,
            Pending {
                wr_id: p.wr_id,
                op: Some(op),
                local: Vec::new(),
                signaled: p.signaled,
                emulation: Some(Emu::Agent),
            },
        );
        if let Err(e) = agent.request(self, token, remote, AgentOp::Commit { len }) {
            warn!(qp = self.qp_num, error = %e, "commit request could not be sent");
            self.remove(token);
            return fail(WcStatus::LocQpOpErr, 0);
        }
        None
    }

    /// The agent answered for `token`.
    pub(crate) fn finish_agent(
        &self,
        token: u64,
        status: WcStatus,
        original: u64,
        vendor_err: u32,
    ) {
        let Some(p) = self.remove(token) else { return };
        let Some(op) = p.op else { return };
        let ok = status == WcStatus::Success;
        if let SendOp::Commit { remote, .. } = op {
            if ok && original == FLUSH_TARGET {
                tracing::debug!(
                    qp = self.qp_num,
                    rkey = remote.rkey,
                    "the peer's region is a FLUSH target: later Commits are device FLUSHes"
                );
                self.flush_targets
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(remote.rkey);
            }
        }
        if ok {
            if let Some(s) = p.local.first() {
                let _ = s.mr().write_at(s.offset(), &original.to_ne_bytes());
            }
        }
        if ok && !p.signaled {
            return;
        }
        let kind = self.send_kind(&op, &p.local, ok);
        self.send_cq.push_ready(Completion {
            wr_id: p.wr_id,
            status,
            qp_num: self.qp_num,
            kind,
            vendor_err,
        });
    }

    /// 8-byte Immediate Data through the peer's mailbox: (the Write, for
    /// Write with Immediate,) the mailbox entry, then a zero-length Send
    /// that consumes the peer's receive. The last one carries the WR's
    /// completion; the others complete silently unless they fail.
    fn post_imm(&self, agent: &Arc<Agent>, wr: WorkRequest) -> Result<()> {
        let (imm, solicited) = match wr.op {
            SendOp::Imm { imm, solicited } => (imm, solicited),
            SendOp::WriteImm { imm, .. } => (imm, false),
            _ => {
                return Err(Error::InvalidRequest(
                    "only Immediate Data goes through the mailbox",
                ))
            }
        };
        let mut steps: Vec<(SendOp, Vec<Slice>, bool)> = Vec::new();
        if let SendOp::WriteImm { remote, .. } = wr.op {
            steps.push((SendOp::Write { remote }, wr.local.clone(), false));
        }
        // Numbered among all zero-length Sends, under the lock that keeps
        // the numbering in wire order.
        let mut zero_sends = agent.zero_sends.lock().unwrap_or_else(|p| p.into_inner());
        let seq = *zero_sends;
        let (entry, mailbox) = agent.stage_imm(seq, imm, solicited)?;
        steps.push((SendOp::Write { remote: mailbox }, vec![entry], false));
        steps.push((
            SendOp::Send {
                solicited,
                invalidate: None,
            },
            Vec::new(),
            true,
        ));
        for (step, local, last) in steps {
            let token = self.token();
            let sges: Vec<Sge> = local.iter().map(Slice::sge).collect();
            self.insert(
                token,
                Pending {
                    wr_id: wr.wr_id,
                    // The last step reports as the application's operation.
                    op: Some(if last { wr.op } else { step }),
                    local,
                    signaled: last && wr.signaled,
                    emulation: None,
                },
            );
            if let Err(e) = self.post_raw(token, step, &sges, wr.fence) {
                self.remove(token);
                return Err(e);
            }
        }
        *zero_sends += 1;
        Ok(())
    }

    fn cas_done(&self, p: Pending, op: SendOp, slot: usize, original: u64) -> Option<Completion> {
        self.free_slot(slot);
        if let Some(s) = p.local.first() {
            let _ = s.mr().write_at(s.offset(), &original.to_ne_bytes());
        }
        let kind = self.send_kind(&op, &p.local, true);
        p.signaled.then_some(Completion {
            wr_id: p.wr_id,
            status: WcStatus::Success,
            qp_num: self.qp_num,
            kind,
            vendor_err: 0,
        })
    }
}

/// An atomic names one 8-byte local slice for the original value; an
/// Atomic Write carries its value in the request and names none.
fn check_atomic_local(wr: &WorkRequest) -> Result<()> {
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

/// The SGEs as libibverbs takes them.
pub(crate) fn ibv_sges(sges: &[Sge]) -> Vec<ibv::Sge> {
    sges.iter()
        .map(|s| ibv::Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })
        .collect()
}

/// The libibverbs opcode for an operation the device runs natively.
fn ibv_op(op: &SendOp) -> Option<ibv::SendOp> {
    Some(match *op {
        SendOp::Send {
            invalidate: None, ..
        } => ibv::SendOp::Send,
        SendOp::Send {
            invalidate: Some(invalidate_rkey),
            ..
        } => ibv::SendOp::SendWithInv { invalidate_rkey },
        SendOp::Write { remote } => ibv::SendOp::RdmaWrite {
            rkey: remote.rkey,
            remote_addr: remote.addr,
        },
        SendOp::Read { remote } => ibv::SendOp::RdmaRead {
            rkey: remote.rkey,
            remote_addr: remote.addr,
        },
        SendOp::FetchAdd {
            remote,
            add,
            mask: 0,
        } => ibv::SendOp::FetchAdd {
            rkey: remote.rkey,
            remote_addr: remote.addr,
            add,
        },
        SendOp::CmpSwap {
            remote,
            compare,
            swap,
            compare_mask: u64::MAX,
            swap_mask: u64::MAX,
        } => ibv::SendOp::CmpSwap {
            rkey: remote.rkey,
            remote_addr: remote.addr,
            compare,
            swap,
        },
        _ => return None,
    })
}

impl QueuePair {
    pub(crate) fn from_backend(
        ctx: &Context,
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<SharedReceiveQueue>,
        backend: QpBackend,
        qp_num: u32,
    ) -> Result<QueuePair> {
        let inner = Arc::new(QpInner::new(ctx, pd, send_cq, srq, backend, qp_num)?);
        send_cq.attach(qp_num, Arc::downgrade(&inner));
        recv_cq.attach(qp_num, Arc::downgrade(&inner));
        Ok(QueuePair { inner })
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.inner.qp_num
    }

    /// What this connection runs natively, emulated or not at all: the
    /// device's matrix resolved against the peer's device (a stag peer
    /// says in its connection header what its device executes).
    pub fn capabilities(&self) -> &Capabilities {
        self.inner.caps()
    }

    /// What the peer's device executes natively, from its stag header;
    /// `None` when the peer runs no stag (then see
    /// [`QueuePair::probe_atomics`]).
    pub fn peer_native(&self) -> Option<OpSet> {
        self.inner.connection.get().and_then(|(_, p)| *p)
    }

    /// Whether the peer executes RFC 7306 atomics. A stag peer said so in
    /// its connection header, and nothing is sent. Otherwise this is
    /// RFC 7306 §1.1's probe: a FetchAdd of 0 at `target` (8 aligned bytes
    /// the peer advertised; their value does not change), answered by a
    /// completion or refused by the peer — which, on iWARP as on IB, takes
    /// the connection down ([`PeerAtomics::Refused`]). Other completions
    /// that arrive meanwhile stay queued for the application.
    pub fn probe_atomics(&self, target: Remote, timeout: Duration) -> Result<PeerAtomics> {
        if let Some(native) = self.peer_native() {
            return Ok(if native.contains(OpKind::FetchAdd) {
                PeerAtomics::Native
            } else {
                PeerAtomics::Agent
            });
        }
        if !self.inner.ctx.native_ops().contains(OpKind::FetchAdd) {
            return Err(Error::Unsupported {
                op: OpKind::FetchAdd,
                device: self.inner.ctx.name().to_owned(),
                why: "the device cannot send atomics, and the peer runs no stag agent to \
                      run them for it"
                    .into(),
            });
        }
        if !target.addr.is_multiple_of(8) {
            return Err(Error::InvalidRequest("an atomic target is 8-byte aligned"));
        }
        let (status, vendor_err) = self.inner.probe(target, timeout)?;
        Ok(if status == WcStatus::Success {
            PeerAtomics::Native
        } else {
            PeerAtomics::Refused { status, vendor_err }
        })
    }

    /// What the emulation layer has done on this connection so far.
    pub fn emulation_counters(&self) -> EmulationCounters {
        let (agent_requests, agent_served) = self.inner.agent.get().map_or((0, 0), |a| a.counts());
        EmulationCounters {
            agent_requests,
            agent_served,
            cas_steps: self.inner.cas_steps.load(Ordering::Relaxed),
            device_round_trips: self.inner.device_round_trips.load(Ordering::Relaxed),
        }
    }

    /// How this QP posts: the userspace provider's queue, the extended
    /// `ibv_wr_*` API or `ibv_post_send`.
    pub fn post_path(&self) -> PostPath {
        match &self.inner.backend {
            QpBackend::User(_) => PostPath::Userspace,
            QpBackend::Ibv { qp, .. } if qp.has_wr_api() => PostPath::Extended,
            QpBackend::Ibv { .. } => PostPath::Legacy,
        }
    }

    /// `ibv_post_send`, natively or through the emulation layer as the
    /// capability matrix says; an operation the device cannot do at all
    /// fails here with [`Error::Unsupported`].
    pub fn post_send(&self, wr: WorkRequest) -> Result<()> {
        self.inner.post_send(wr)
    }

    /// `ibv_post_send` with a list: posts `wrs` in order with one doorbell.
    /// On the userspace provider the list's requests leave in one write to
    /// the socket (posts by other threads meanwhile wait for it too); on a
    /// libibverbs device each is posted as it comes. Stops at the first WR
    /// that fails: those before it are posted and complete as usual, it and
    /// the rest are not ([`PostListError::posted`] says how many were).
    pub fn post_send_list(
        &self,
        wrs: impl IntoIterator<Item = WorkRequest>,
    ) -> std::result::Result<(), PostListError> {
        let inner = &self.inner;
        inner.lists.fetch_add(1, Ordering::AcqRel);
        let mut posted = 0;
        let mut failed = None;
        for wr in wrs {
            if let Err(source) = inner.post_send(wr) {
                failed = Some(source);
                break;
            }
            posted += 1;
        }
        inner.lists.fetch_sub(1, Ordering::AcqRel);
        if let QpBackend::User(qp) = &inner.backend {
            qp.ring_doorbell();
        }
        match failed {
            None => Ok(()),
            Some(source) => Err(PostListError { posted, source }),
        }
    }

    /// `ibv_post_recv`.
    pub fn post_recv(&self, wr_id: u64, local: Vec<Slice>) -> Result<()> {
        self.inner.post_recv(wr_id, local)
    }

    /// Move to Error: every outstanding WR completes with a flush error.
    pub fn set_error(&self) -> Result<()> {
        match &self.inner.backend {
            QpBackend::User(qp) => qp.set_error(),
            QpBackend::Ibv { qp, .. } => qp.to_error()?,
        }
        Ok(())
    }

    /// Drive the QP from this thread (userspace provider; a no-op on
    /// libibverbs devices, where the hardware or kernel makes progress).
    pub fn progress(&self) {
        if let QpBackend::User(qp) = &self.inner.backend {
            qp.progress();
        }
    }

    /// WRs posted and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    pub(crate) fn inner_backend(&self) -> &QpBackend {
        &self.inner.backend
    }

    pub(crate) fn cm_id(&self) -> Option<&ibv::CmId> {
        match &self.inner.backend {
            QpBackend::Ibv { id, .. } => Some(id),
            QpBackend::User(_) => None,
        }
    }
}
