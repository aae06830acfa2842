//! RC queue pairs: `ibv_create_qp(_ex)`, legacy `ibv_post_send` /
//! `ibv_post_recv`, and the extended `ibv_wr_*` API (incl. atomic write and
//! flush through `rdma-sys-ext`, gated on the installed rdma-core).

use super::cq::CompletionQueue;
use super::device::Context;
use super::mr::MemoryRegion;
use super::pd::ProtectionDomain;
use super::srq::SharedReceiveQueue;
use super::{check, check_errno, IbvError, Result};
use rdma_sys_ext as ffi;
use std::any::Any;
use std::ops::BitOr;
use std::sync::{Arc, Mutex, MutexGuard};

/// `struct ibv_sge`: a raw local address range in a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// `lkey` of the region containing the range.
    pub lkey: u32,
}

impl Sge {
    /// `[mr.addr + offset, + len)`, or `None` if that leaves the region.
    pub fn from_mr(mr: &MemoryRegion, offset: usize, len: u32) -> Option<Sge> {
        let end = offset.checked_add(len as usize)?;
        (end <= mr.len()).then(|| Sge {
            addr: mr.addr() + offset as u64,
            length: len,
            lkey: mr.lkey(),
        })
    }

    pub(super) fn raw(&self) -> ffi::ibv_sge {
        ffi::ibv_sge {
            addr: self.addr,
            length: self.length,
            lkey: self.lkey,
        }
    }
}

/// A send-queue operation (`enum ibv_wr_opcode`). Immediate data is given
/// in host order and sent in network order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// `IBV_WR_SEND`
    Send,
    /// `IBV_WR_SEND_WITH_INV`: the responder invalidates `invalidate_rkey`
    /// before the receive completes.
    SendWithInv {
        /// The peer's STag to invalidate.
        invalidate_rkey: u32,
    },
    /// `IBV_WR_SEND_WITH_IMM`
    SendWithImm {
        /// Immediate data (host order).
        imm: u32,
    },
    /// `IBV_WR_RDMA_WRITE`
    RdmaWrite {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        remote_addr: u64,
    },
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`
    RdmaWriteWithImm {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        remote_addr: u64,
        /// Immediate data (host order).
        imm: u32,
    },
    /// `IBV_WR_RDMA_READ`
    RdmaRead {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        remote_addr: u64,
    },
    /// `IBV_WR_ATOMIC_FETCH_AND_ADD` (one 8-byte SGE receives the old value)
    FetchAdd {
        /// Remote key.
        rkey: u32,
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Addend.
        add: u64,
    },
    /// `IBV_WR_ATOMIC_CMP_AND_SWP` (one 8-byte SGE receives the old value)
    CmpSwap {
        /// Remote key.
        rkey: u32,
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Compare value.
        compare: u64,
        /// Swap value.
        swap: u64,
    },
}

impl SendOp {
    fn is_atomic(&self) -> bool {
        matches!(self, SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. })
    }

    fn remote_addr(&self) -> Option<u64> {
        match *self {
            SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => None,
            SendOp::RdmaWrite { remote_addr, .. }
            | SendOp::RdmaWriteWithImm { remote_addr, .. }
            | SendOp::RdmaRead { remote_addr, .. }
            | SendOp::FetchAdd { remote_addr, .. }
            | SendOp::CmpSwap { remote_addr, .. } => Some(remote_addr),
        }
    }

    fn required_op(&self) -> SendOps {
        match self {
            SendOp::Send => SendOps::SEND,
            SendOp::SendWithImm { .. } => SendOps::SEND_WITH_IMM,
            SendOp::SendWithInv { .. } => SendOps::SEND_WITH_INV,
            SendOp::RdmaWrite { .. } => SendOps::RDMA_WRITE,
            SendOp::RdmaWriteWithImm { .. } => SendOps::RDMA_WRITE_WITH_IMM,
            SendOp::RdmaRead { .. } => SendOps::RDMA_READ,
            SendOp::FetchAdd { .. } => SendOps::ATOMIC_FETCH_AND_ADD,
            SendOp::CmpSwap { .. } => SendOps::ATOMIC_CMP_AND_SWP,
        }
    }
}

/// `enum ibv_send_flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(pub u32);

impl SendFlags {
    /// No flags.
    pub const EMPTY: Self = SendFlags(0);
    /// `IBV_SEND_FENCE`
    pub const FENCE: Self = SendFlags(ffi::IBV_SEND_FENCE);
    /// `IBV_SEND_SIGNALED`
    pub const SIGNALED: Self = SendFlags(ffi::IBV_SEND_SIGNALED);
    /// `IBV_SEND_SOLICITED`
    pub const SOLICITED: Self = SendFlags(ffi::IBV_SEND_SOLICITED);
    /// `IBV_SEND_INLINE`: the provider copies the SGE data at post time.
    pub const INLINE: Self = SendFlags(ffi::IBV_SEND_INLINE);
}

impl BitOr for SendFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        SendFlags(self.0 | rhs.0)
    }
}

/// `enum ibv_qp_create_send_ops_flags` (`IBV_QP_EX_WITH_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendOps(pub u64);

impl SendOps {
    /// `IBV_QP_EX_WITH_RDMA_WRITE`
    pub const RDMA_WRITE: Self = SendOps(ffi::IBV_QP_EX_WITH_RDMA_WRITE as u64);
    /// `IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM`
    pub const RDMA_WRITE_WITH_IMM: Self = SendOps(ffi::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM as u64);
    /// `IBV_QP_EX_WITH_SEND`
    pub const SEND: Self = SendOps(ffi::IBV_QP_EX_WITH_SEND as u64);
    /// `IBV_QP_EX_WITH_SEND_WITH_IMM`
    pub const SEND_WITH_IMM: Self = SendOps(ffi::IBV_QP_EX_WITH_SEND_WITH_IMM as u64);
    /// `IBV_QP_EX_WITH_SEND_WITH_INV`
    pub const SEND_WITH_INV: Self = SendOps(ffi::IBV_QP_EX_WITH_SEND_WITH_INV as u64);
    /// `IBV_QP_EX_WITH_RDMA_READ`
    pub const RDMA_READ: Self = SendOps(ffi::IBV_QP_EX_WITH_RDMA_READ as u64);
    /// `IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP`
    pub const ATOMIC_CMP_AND_SWP: Self = SendOps(ffi::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP as u64);
    /// `IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD`
    pub const ATOMIC_FETCH_AND_ADD: Self = SendOps(ffi::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD as u64);
    /// `IBV_QP_EX_WITH_FLUSH` (needs [`super::HAS_WR_FLUSH`])
    pub const FLUSH: Self = SendOps(ffi::IBV_QP_EX_WITH_FLUSH as u64);
    /// `IBV_QP_EX_WITH_ATOMIC_WRITE` (needs [`super::HAS_WR_ATOMIC_WRITE`])
    pub const ATOMIC_WRITE: Self = SendOps(ffi::IBV_QP_EX_WITH_ATOMIC_WRITE as u64);
    /// Send, send-with-imm, write, write-with-imm, read.
    pub const BASIC: Self = SendOps(
        Self::SEND.0
            | Self::SEND_WITH_IMM.0
            | Self::RDMA_WRITE.0
            | Self::RDMA_WRITE_WITH_IMM.0
            | Self::RDMA_READ.0,
    );
    /// [`SendOps::BASIC`] plus fetch-add and compare-swap.
    pub const BASIC_ATOMICS: Self =
        SendOps(Self::BASIC.0 | Self::ATOMIC_CMP_AND_SWP.0 | Self::ATOMIC_FETCH_AND_ADD.0);

    /// No flag set (the QP has no `ibv_wr_*` API).
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether every bit of `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for SendOps {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        SendOps(self.0 | rhs.0)
    }
}

/// `enum ibv_placement_type`: what a flush guarantees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushType {
    /// `IBV_FLUSH_GLOBAL`: globally visible.
    Global,
    /// `IBV_FLUSH_PERSISTENT`: persistent.
    Persistent,
}

/// `enum ibv_selectivity_level`: what a flush covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushLevel {
    /// `IBV_FLUSH_RANGE`: the given range.
    Range,
    /// `IBV_FLUSH_MR`: the whole region.
    Mr,
}

/// `enum ibv_qp_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// `IBV_QPS_RESET`
    Reset,
    /// `IBV_QPS_INIT`
    Init,
    /// `IBV_QPS_RTR`
    Rtr,
    /// `IBV_QPS_RTS`
    Rts,
    /// `IBV_QPS_SQD`
    Sqd,
    /// `IBV_QPS_SQE`
    Sqe,
    /// `IBV_QPS_ERR`
    Err,
    /// `IBV_QPS_UNKNOWN` or a newer value
    Unknown,
}

impl QpState {
    fn from_raw(v: u32) -> Self {
        match v {
            ffi::IBV_QPS_RESET => QpState::Reset,
            ffi::IBV_QPS_INIT => QpState::Init,
            ffi::IBV_QPS_RTR => QpState::Rtr,
            ffi::IBV_QPS_RTS => QpState::Rts,
            ffi::IBV_QPS_SQD => QpState::Sqd,
            ffi::IBV_QPS_SQE => QpState::Sqe,
            ffi::IBV_QPS_ERR => QpState::Err,
            _ => QpState::Unknown,
        }
    }
}

/// Creation parameters of an RC QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInitAttr {
    /// `cap.max_send_wr`
    pub max_send_wr: u32,
    /// `cap.max_recv_wr`
    pub max_recv_wr: u32,
    /// `cap.max_send_sge`
    pub max_send_sge: u32,
    /// `cap.max_recv_sge`
    pub max_recv_sge: u32,
    /// `cap.max_inline_data`
    pub max_inline_data: u32,
    /// `sq_sig_all`: every send WR generates a completion.
    pub sq_sig_all: bool,
    /// `Some(ops)`: create through `ibv_create_qp_ex` with these
    /// `send_ops_flags`, enabling [`QueuePair::start_wr`]. `None`: legacy
    /// `ibv_create_qp` (post_send/post_recv only).
    pub send_ops: Option<SendOps>,
}

impl Default for QpInitAttr {
    fn default() -> Self {
        QpInitAttr {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
            send_ops: None,
        }
    }
}

/// One send work request for the legacy [`QueuePair::post_send`].
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Operation.
    pub op: SendOp,
    /// Local data (source for send/write, destination for read/atomics).
    pub sges: &'a [Sge],
    /// `send_flags`.
    pub flags: SendFlags,
}

/// One receive work request.
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Destination ranges.
    pub sges: &'a [Sge],
}

/// How a QP was created, hence how it is destroyed.
enum Owner {
    /// `ibv_create_qp(_ex)`: `ibv_destroy_qp`.
    Verbs,
    /// `rdma_create_qp(_ex)` on this cm_id: `rdma_destroy_qp`; the Arc keeps
    /// the id alive.
    Cm(*mut ffi::rdma_cm_id, Arc<dyn Any + Send + Sync>),
}

/// An RC `struct ibv_qp`, holding its PD and CQs.
pub struct QueuePair {
    qp: *mut ffi::ibv_qp,
    /// `ibv_qp_to_qp_ex(qp)` when created with `send_ops`, else NULL.
    qpx: *mut ffi::ibv_qp_ex,
    /// `send_ops_flags` the provider accepted (0 for legacy QPs).
    send_ops: SendOps,
    owner: Owner,
    /// Serialises the (non-thread-safe) `ibv_wr_*` batches.
    wr_lock: Mutex<()>,
    pd: Arc<ProtectionDomain>,
    send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
    /// The SRQ its receives come from (kept alive while the QP exists).
    srq: Option<Arc<SharedReceiveQueue>>,
}

// SAFETY: legacy post_send/post_recv are thread-safe in libibverbs
// providers; the extended API is serialised by wr_lock; other state is
// immutable after creation.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num())
            .field("send_ops", &self.send_ops)
            .finish_non_exhaustive()
    }
}

pub(crate) enum Via {
    Verbs,
    Cm(*mut ffi::rdma_cm_id, Arc<dyn Any + Send + Sync>),
}

impl QueuePair {
    /// Creates an RC QP with `ibv_create_qp` (or `ibv_create_qp_ex` when
    /// `caps.send_ops` is set). It starts in RESET; connect it with
    /// librdmacm (see [`super::cm::CmId::create_qp`]) or modify it yourself.
    pub fn create(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        caps: &QpInitAttr,
    ) -> Result<QueuePair> {
        Self::create_via(pd, send_cq, recv_cq, caps, None, Via::Verbs)
    }

    pub(crate) fn create_via(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        caps: &QpInitAttr,
        srq: Option<&Arc<SharedReceiveQueue>>,
        via: Via,
    ) -> Result<QueuePair> {
        let same_ctx = |cq: &CompletionQueue| cq.context().as_raw() == pd.context().as_raw();
        if !same_ctx(send_cq) || !same_ctx(recv_cq) {
            return Err(IbvError::invalid("ibv_create_qp"));
        }
        if srq.is_some_and(|s| s.pd().as_raw() != pd.as_raw()) {
            return Err(IbvError::invalid("ibv_create_qp"));
        }
        if let Some(ops) = caps.send_ops {
            if ops.contains(SendOps::FLUSH) && !ffi::HAS_WR_FLUSH {
                return Err(IbvError::unsupported("ibv_create_qp_ex"));
            }
            if ops.contains(SendOps::ATOMIC_WRITE) && !ffi::HAS_WR_ATOMIC_WRITE {
                return Err(IbvError::unsupported("ibv_create_qp_ex"));
            }
        }
        let cap = ffi::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            max_inline_data: caps.max_inline_data,
        };
        let mut attr = ffi::ibv_qp_init_attr_ex {
            send_cq: send_cq.as_raw(),
            recv_cq: recv_cq.as_raw(),
            cap,
            qp_type: ffi::IBV_QPT_RC,
            sq_sig_all: i32::from(caps.sq_sig_all),
            comp_mask: ffi::IBV_QP_INIT_ATTR_PD,
            pd: pd.as_raw(),
            // With an SRQ the QP has no receive queue of its own.
            srq: srq.map_or(std::ptr::null_mut(), |s| s.as_raw()),
            ..Default::default()
        };
        if srq.is_some() {
            attr.cap.max_recv_wr = 0;
            attr.cap.max_recv_sge = 0;
        }
        if let Some(ops) = caps.send_ops {
            attr.comp_mask |= ffi::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
            attr.send_ops_flags = ops.0;
        }
        let (call, qp, owner) = match via {
            Via::Verbs => {
                // SAFETY: ctx, pd and CQs are live (held by Arcs); attr is
                // fully initialised with the comp_mask describing it.
                let qp = unsafe { ffi::stag_ibv_create_qp_ex(pd.context().as_raw(), &mut attr) };
                ("ibv_create_qp_ex", qp, Owner::Verbs)
            }
            Via::Cm(id, keep) => {
                // SAFETY: id is a live cm_id (kept alive by `keep`) bound to
                // the same device as pd; attr is fully initialised.
                let ret = unsafe { ffi::rdma_create_qp_ex(id, &mut attr) };
                let qp = if ret == 0 {
                    // SAFETY: on success librdmacm stored the QP in id->qp.
                    unsafe { (*id).qp }
                } else {
                    std::ptr::null_mut()
                };
                ("rdma_create_qp_ex", qp, Owner::Cm(id, keep))
            }
        };
        if qp.is_null() {
            return Err(IbvError::last(call));
        }
        let (qpx, send_ops) = match caps.send_ops {
            Some(ops) => {
                // SAFETY: qp was created with IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
                // so the provider embeds an ibv_qp_ex.
                let qpx = unsafe { ffi::stag_ibv_qp_to_qp_ex(qp) };
                (qpx, ops)
            }
            None => (std::ptr::null_mut(), SendOps(0)),
        };
        let qp = QueuePair {
            qp,
            qpx,
            send_ops,
            owner,
            wr_lock: Mutex::new(()),
            pd: Arc::clone(pd),
            send_cq: Arc::clone(send_cq),
            recv_cq: Arc::clone(recv_cq),
            srq: srq.cloned(),
        };
        tracing::debug!(?qp, "created RC QP");
        Ok(qp)
    }

    /// `qp_num`.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: qp is live; qp_num is immutable.
        unsafe { (*self.qp).qp_num }
    }

    /// The `send_ops_flags` this QP was created with (0 for legacy).
    pub fn send_ops(&self) -> SendOps {
        self.send_ops
    }

    /// Whether [`QueuePair::start_wr`] is available.
    pub fn has_wr_api(&self) -> bool {
        !self.qpx.is_null()
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The send CQ.
    pub fn send_cq(&self) -> &Arc<CompletionQueue> {
        &self.send_cq
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> &Arc<CompletionQueue> {
        &self.recv_cq
    }

    /// The shared receive queue, if the QP takes its receives from one.
    pub fn srq(&self) -> Option<&Arc<SharedReceiveQueue>> {
        self.srq.as_ref()
    }

    /// Raw pointer (stays owned by `self`).
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.qp
    }

    /// `ibv_query_qp` for the current state.
    pub fn state(&self) -> Result<QpState> {
        let mut attr = ffi::ibv_qp_attr::default();
        let mut init = ffi::ibv_qp_init_attr::default();
        // SAFETY: qp is live; out-structs are valid.
        let ret =
            unsafe { ffi::ibv_query_qp(self.qp, &mut attr, ffi::IBV_QP_STATE as i32, &mut init) };
        check("ibv_query_qp", ret)?;
        Ok(QpState::from_raw(attr.qp_state))
    }

    /// `ibv_modify_qp` to ERR: outstanding WRs complete with
    /// `IBV_WC_WR_FLUSH_ERR`.
    pub fn to_error(&self) -> Result<()> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_ERR,
            ..Default::default()
        };
        // SAFETY: qp is live; attr carries the state named by the mask.
        let ret = unsafe { ffi::ibv_modify_qp(self.qp, &mut attr, ffi::IBV_QP_STATE as i32) };
        check_errno("ibv_modify_qp", ret)
    }

    /// Legacy `ibv_post_send` of a chain of work requests.
    ///
    /// Errors carry the errno normalised to positive (siw returns `-EINVAL`)
    /// and, in `Err((err, index))`, the index of the first WR not posted.
    ///
    /// # Safety
    /// Every SGE must describe memory inside a live region registered on
    /// this QP's PD with the `lkey` given, which stays valid and is not
    /// accessed in conflicting ways until the WR completes (unless
    /// `INLINE`, where the data is copied at post time).
    pub unsafe fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), (IbvError, usize)> {
        if wrs.is_empty() {
            return Ok(());
        }
        for (i, wr) in wrs.iter().enumerate() {
            validate_send(wr).map_err(|e| (e, i))?;
        }
        let mut sges: Vec<ffi::ibv_sge> = wrs
            .iter()
            .flat_map(|w| w.sges.iter().map(Sge::raw))
            .collect();
        let mut raw: Vec<ffi::ibv_send_wr> = Vec::with_capacity(wrs.len());
        let mut off = 0;
        for wr in wrs {
            let n = wr.sges.len();
            // Sub-slice pointer into the stable `sges` buffer.
            let sg_list = if n == 0 {
                std::ptr::null_mut()
            } else {
                sges[off..].as_mut_ptr()
            };
            off += n;
            raw.push(raw_send_wr(wr, sg_list, n));
        }
        let base = raw.as_mut_ptr();
        for i in 0..raw.len().saturating_sub(1) {
            // SAFETY: i + 1 < len; pointers into the same live Vec.
            raw[i].next = unsafe { base.add(i + 1) };
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: qp is live; the WR chain and SGE arrays live until the call
        // returns (the provider copies them); the caller guarantees the
        // memory they describe.
        let ret = unsafe { ffi::stag_ibv_post_send(self.qp, base, &mut bad) };
        if ret == 0 {
            return Ok(());
        }
        let idx = if bad.is_null() {
            0
        } else {
            // SAFETY: bad points into `raw` per the ibv_post_send contract.
            usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
        };
        Err((IbvError::new("ibv_post_send", ret), idx))
    }

    /// Legacy `ibv_post_recv` of a chain of receive requests.
    ///
    /// # Safety
    /// Every SGE must describe writable memory inside a live region
    /// registered on this QP's PD with `LOCAL_WRITE`, which stays valid and
    /// unaliased until the WR completes.
    pub unsafe fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), (IbvError, usize)> {
        // SAFETY: qp is live; the chain and its SGEs live for the call (the
        // provider copies them); the memory they name is the caller's
        // obligation (see # Safety).
        unsafe {
            post_recv_chain("ibv_post_recv", wrs, |head, bad| {
                ffi::stag_ibv_post_recv(self.qp, head, bad)
            })
        }
    }

    /// Starts an extended-API batch (`ibv_wr_start`). Only for QPs created
    /// with `send_ops`; the batch is posted by [`WrBatch::commit`]
    /// (`ibv_wr_complete`) and discarded on drop (`ibv_wr_abort`).
    pub fn start_wr(&self) -> Result<WrBatch<'_>> {
        if self.qpx.is_null() {
            return Err(IbvError::unsupported("ibv_wr_start"));
        }
        let guard = self.wr_lock.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: qpx is live and serialised by wr_lock.
        unsafe { ffi::ibv_wr_start(self.qpx) }.map_err(|e| IbvError::from(("ibv_wr_start", e)))?;
        Ok(WrBatch {
            qp: self,
            _guard: guard,
            open: true,
        })
    }
}

fn validate_send(wr: &SendWr<'_>) -> Result<()> {
    if wr.op.is_atomic() {
        let ok_sge = wr.sges.len() == 1 && wr.sges[0].length == 8;
        let ok_addr = wr.op.remote_addr().is_some_and(|a| a & 7 == 0);
        if !ok_sge || !ok_addr || wr.flags.0 & ffi::IBV_SEND_INLINE != 0 {
            return Err(IbvError::invalid("ibv_post_send"));
        }
    }
    if matches!(wr.op, SendOp::RdmaRead { .. }) && wr.flags.0 & ffi::IBV_SEND_INLINE != 0 {
        return Err(IbvError::invalid("ibv_post_send"));
    }
    if i32::try_from(wr.sges.len()).is_err() {
        return Err(IbvError::invalid("ibv_post_send"));
    }
    Ok(())
}

fn raw_send_wr(wr: &SendWr<'_>, sg_list: *mut ffi::ibv_sge, n: usize) -> ffi::ibv_send_wr {
    let mut r = ffi::ibv_send_wr {
        wr_id: wr.wr_id,
        sg_list,
        num_sge: n as i32,
        send_flags: wr.flags.0,
        ..Default::default()
    };
    match wr.op {
        SendOp::Send => r.opcode = ffi::IBV_WR_SEND,
        SendOp::SendWithInv { invalidate_rkey } => {
            r.opcode = ffi::IBV_WR_SEND_WITH_INV;
            r.__bindgen_anon_1.invalidate_rkey = invalidate_rkey;
            // libsiw takes the STag to invalidate from `wr.rdma.rkey`, not
            // from `invalidate_rkey` (its SQE has one rkey field for both);
            // a Send ignores `wr.rdma` on every other provider.
            r.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: 0,
                rkey: invalidate_rkey,
            };
        }
        SendOp::SendWithImm { imm } => {
            r.opcode = ffi::IBV_WR_SEND_WITH_IMM;
            r.__bindgen_anon_1.imm_data = imm.to_be();
        }
        SendOp::RdmaWrite { rkey, remote_addr } => {
            r.opcode = ffi::IBV_WR_RDMA_WRITE;
            r.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        }
        SendOp::RdmaWriteWithImm {
            rkey,
            remote_addr,
            imm,
        } => {
            r.opcode = ffi::IBV_WR_RDMA_WRITE_WITH_IMM;
            r.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
            r.__bindgen_anon_1.imm_data = imm.to_be();
        }
        SendOp::RdmaRead { rkey, remote_addr } => {
            r.opcode = ffi::IBV_WR_RDMA_READ;
            r.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        }
        SendOp::FetchAdd {
            rkey,
            remote_addr,
            add,
        } => {
            r.opcode = ffi::IBV_WR_ATOMIC_FETCH_AND_ADD;
            r.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                remote_addr,
                compare_add: add,
                swap: 0,
                rkey,
            };
        }
        SendOp::CmpSwap {
            rkey,
            remote_addr,
            compare,
            swap,
        } => {
            r.opcode = ffi::IBV_WR_ATOMIC_CMP_AND_SWP;
            r.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                remote_addr,
                compare_add: compare,
                swap,
                rkey,
            };
        }
    }
    r
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        match &self.owner {
            Owner::Verbs => {
                // SAFETY: qp came from ibv_create_qp(_ex) and is destroyed
                // once; its PD and CQs outlive this call (held by Arcs).
                let ret = unsafe { ffi::ibv_destroy_qp(self.qp) };
                if ret != 0 {
                    tracing::warn!(ret, "ibv_destroy_qp failed");
                }
            }
            Owner::Cm(id, _keep) => {
                // SAFETY: the QP was created on this live cm_id (kept alive
                // by _keep) and is destroyed once.
                unsafe { ffi::rdma_destroy_qp(*id) };
            }
        }
    }
}

/// An open `ibv_wr_start` batch on a [`QueuePair`]; one at a time per QP.
///
/// Each builder sets `wr_id`/`wr_flags`, the operation, then its data, as
/// `ibv_wr_post(3)` prescribes. [`WrBatch::commit`] posts everything
/// (`ibv_wr_complete`); dropping the batch discards it (`ibv_wr_abort`).
pub struct WrBatch<'q> {
    qp: &'q QueuePair,
    _guard: MutexGuard<'q, ()>,
    open: bool,
}

impl WrBatch<'_> {
    fn begin(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        need: SendOps,
    ) -> Result<*mut ffi::ibv_qp_ex> {
        if !self.qp.send_ops.contains(need) {
            return Err(IbvError::unsupported("ibv_wr_*"));
        }
        let qpx = self.qp.qpx;
        // SAFETY: qpx is live and exclusively ours (wr_lock held); wr_id and
        // wr_flags exist in every ibv_qp_ex version.
        unsafe {
            (*qpx).wr_id = wr_id;
            (*qpx).wr_flags = flags.0;
        }
        Ok(qpx)
    }

    /// Adds `op` with data from `sges` (`ibv_wr_<op>` + `ibv_wr_set_sge_list`).
    ///
    /// # Safety
    /// As for [`QueuePair::post_send`].
    pub unsafe fn push(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        op: SendOp,
        sges: &[Sge],
    ) -> Result<()> {
        validate_send(&SendWr {
            wr_id,
            op,
            sges,
            flags,
        })?;
        let qpx = self.begin(wr_id, flags, op.required_op())?;
        // SAFETY: qpx is live, in an open batch, created with the op's flag.
        unsafe { wr_op(qpx, op) }?;
        let raw: Vec<ffi::ibv_sge> = sges.iter().map(Sge::raw).collect();
        // SAFETY: raw holds raw.len() entries; the provider copies them; the
        // caller guarantees the memory described.
        unsafe { ffi::ibv_wr_set_sge_list(qpx, raw.len(), raw.as_ptr()) }
            .map_err(|e| IbvError::from(("ibv_wr_set_sge_list", e)))
    }

    /// Adds a send / write (with or without imm) whose payload is copied now
    /// (`ibv_wr_set_inline_data`); needs `max_inline_data >= data.len()`.
    pub fn push_inline(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        op: SendOp,
        data: &[u8],
    ) -> Result<()> {
        if matches!(op, SendOp::RdmaRead { .. }) || op.is_atomic() {
            return Err(IbvError::invalid("ibv_wr_set_inline_data"));
        }
        let qpx = self.begin(wr_id, flags | SendFlags::INLINE, op.required_op())?;
        // SAFETY: qpx is live, in an open batch, created with the op's flag.
        unsafe { wr_op(qpx, op) }?;
        // SAFETY: the provider copies `data` before returning; it never
        // writes through the pointer despite the C `void *`.
        unsafe { ffi::ibv_wr_set_inline_data(qpx, data.as_ptr().cast_mut().cast(), data.len()) }
            .map_err(|e| IbvError::from(("ibv_wr_set_inline_data", e)))
    }

    /// `ibv_wr_atomic_write`: write 8 bytes atomically at `remote_addr`.
    /// Needs a QP created with [`SendOps::ATOMIC_WRITE`].
    pub fn atomic_write(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        rkey: u32,
        remote_addr: u64,
        value: [u8; 8],
    ) -> Result<()> {
        if remote_addr & 7 != 0 {
            return Err(IbvError::invalid("ibv_wr_atomic_write"));
        }
        let qpx = self.begin(wr_id, flags, SendOps::ATOMIC_WRITE)?;
        // SAFETY: qpx was created with IBV_QP_EX_WITH_ATOMIC_WRITE, so the
        // runtime struct has wr_atomic_write; the provider copies value.
        unsafe { ffi::ibv_wr_atomic_write(qpx, rkey, remote_addr, &value) }
            .map_err(|e| IbvError::from(("ibv_wr_atomic_write", e)))
    }

    /// `ibv_wr_flush` of `len` bytes at `remote_addr`. Needs a QP created
    /// with [`SendOps::FLUSH`] (so needs [`super::HAS_WR_FLUSH`]).
    #[allow(clippy::too_many_arguments)]
    pub fn flush(
        &mut self,
        wr_id: u64,
        flags: SendFlags,
        rkey: u32,
        remote_addr: u64,
        len: usize,
        ty: FlushType,
        level: FlushLevel,
    ) -> Result<()> {
        let qpx = self.begin(wr_id, flags, SendOps::FLUSH)?;
        let ty = match ty {
            FlushType::Global => ffi::IBV_FLUSH_GLOBAL,
            FlushType::Persistent => ffi::IBV_FLUSH_PERSISTENT,
        };
        let level = match level {
            FlushLevel::Range => ffi::IBV_FLUSH_RANGE,
            FlushLevel::Mr => ffi::IBV_FLUSH_MR,
        };
        // SAFETY: qpx was created with IBV_QP_EX_WITH_FLUSH, so the runtime
        // struct has wr_flush; no local memory is involved.
        unsafe { ffi::ibv_wr_flush(qpx, rkey, remote_addr, len, ty, level) }
            .map_err(|e| IbvError::from(("ibv_wr_flush", e)))
    }

    /// `ibv_wr_complete`: post the batch.
    pub fn commit(mut self) -> Result<()> {
        self.open = false;
        // SAFETY: qpx is live and in an open batch we own.
        unsafe { ffi::ibv_wr_complete(self.qp.qpx) }
            .map_err(|e| IbvError::from(("ibv_wr_complete", e)))
    }
}

impl Drop for WrBatch<'_> {
    fn drop(&mut self) {
        if self.open {
            // SAFETY: qpx is live and in an open batch we own.
            if let Err(e) = unsafe { ffi::ibv_wr_abort(self.qp.qpx) } {
                tracing::warn!(?e, "ibv_wr_abort failed");
            }
        }
    }
}

/// Calls the `ibv_wr_<op>` for `op`.
///
/// # Safety
/// `qpx` must be live, inside an open batch, created with the op's flag.
unsafe fn wr_op(qpx: *mut ffi::ibv_qp_ex, op: SendOp) -> Result<()> {
    // SAFETY: per the function contract.
    let r = unsafe {
        match op {
            SendOp::Send => ffi::ibv_wr_send(qpx),
            SendOp::SendWithImm { imm } => ffi::ibv_wr_send_imm(qpx, imm.to_be()),
            SendOp::SendWithInv { invalidate_rkey } => ffi::ibv_wr_send_inv(qpx, invalidate_rkey),
            SendOp::RdmaWrite { rkey, remote_addr } => {
                ffi::ibv_wr_rdma_write(qpx, rkey, remote_addr)
            }
            SendOp::RdmaWriteWithImm {
                rkey,
                remote_addr,
                imm,
            } => ffi::ibv_wr_rdma_write_imm(qpx, rkey, remote_addr, imm.to_be()),
            SendOp::RdmaRead { rkey, remote_addr } => ffi::ibv_wr_rdma_read(qpx, rkey, remote_addr),
            SendOp::FetchAdd {
                rkey,
                remote_addr,
                add,
            } => ffi::ibv_wr_atomic_fetch_add(qpx, rkey, remote_addr, add),
            SendOp::CmpSwap {
                rkey,
                remote_addr,
                compare,
                swap,
            } => ffi::ibv_wr_atomic_cmp_swp(qpx, rkey, remote_addr, compare, swap),
        }
    };
    r.map_err(|e| IbvError::from(("ibv_wr_*", e)))
}

/// What `ibv_create_qp_ex` with `send_ops_flags` accepts on a device (the
/// `ibv_wr_*` API), as found by creating QPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WrApi {
    /// The widest `send_ops_flags` set of the operations stag posts that
    /// the provider accepted; empty when it has no `ibv_wr_*` API (siw,
    /// irdma, cxgb4, erdma) and QPs post with `ibv_post_send`.
    pub ops: SendOps,
    /// ... plus `IBV_QP_EX_WITH_ATOMIC_WRITE` (needs
    /// [`super::HAS_WR_ATOMIC_WRITE`] at build time).
    pub atomic_write: bool,
    /// ... plus `IBV_QP_EX_WITH_FLUSH` (needs [`super::HAS_WR_FLUSH`]).
    pub flush: bool,
}

/// Probes which `send_ops_flags` `ctx`'s provider takes, widest first: a
/// provider refuses flags it does not know, so a QP created with a flag is
/// also the run-time proof that the library's `ibv_qp_ex` has the member
/// that flag's `ibv_wr_*` calls through. Creates and destroys a PD, a CQ
/// and a handful of QPs.
pub(crate) fn probe_wr_api(ctx: &Arc<Context>) -> WrApi {
    let Ok(pd) = ctx.alloc_pd() else {
        return WrApi::default();
    };
    let Ok(cq) = ctx.create_cq(4, None, 0) else {
        return WrApi::default();
    };
    let try_ops = |ops: SendOps| {
        let caps = QpInitAttr {
            max_send_wr: 1,
            max_recv_wr: 1,
            send_ops: Some(ops),
            ..QpInitAttr::default()
        };
        match QueuePair::create(&pd, &cq, &cq, &caps) {
            Ok(qp) => qp.has_wr_api(),
            Err(e) => {
                tracing::debug!(?ops, %e, "create_qp_ex probe refused");
                false
            }
        }
    };
    let candidates = [
        SendOps::BASIC_ATOMICS | SendOps::SEND_WITH_INV,
        SendOps::BASIC_ATOMICS,
        SendOps::BASIC | SendOps::SEND_WITH_INV,
        SendOps::BASIC,
    ];
    let Some(ops) = candidates.into_iter().find(|&ops| try_ops(ops)) else {
        return WrApi::default();
    };
    WrApi {
        ops,
        atomic_write: ffi::HAS_WR_ATOMIC_WRITE && try_ops(ops | SendOps::ATOMIC_WRITE),
        flush: ffi::HAS_WR_FLUSH && try_ops(ops | SendOps::FLUSH),
    }
}

/// Build the `ibv_recv_wr` chain for `wrs` and hand it to `post` (a QP's
/// or an SRQ's post verb); on failure, the error and the index of the
/// first request not posted.
///
/// # Safety
/// As for the verb `post` calls: every SGE names writable memory of a live
/// region that stays valid until its WR completes.
pub(crate) unsafe fn post_recv_chain(
    call: &'static str,
    wrs: &[RecvWr<'_>],
    post: impl FnOnce(*mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> i32,
) -> Result<(), (IbvError, usize)> {
    if wrs.is_empty() {
        return Ok(());
    }
    let mut sges: Vec<ffi::ibv_sge> = wrs
        .iter()
        .flat_map(|w| w.sges.iter().map(Sge::raw))
        .collect();
    let mut raw: Vec<ffi::ibv_recv_wr> = Vec::with_capacity(wrs.len());
    let mut off = 0;
    for (i, wr) in wrs.iter().enumerate() {
        let n = wr.sges.len();
        let num_sge = i32::try_from(n).map_err(|_| (IbvError::invalid(call), i))?;
        let sg_list = if n == 0 {
            std::ptr::null_mut()
        } else {
            sges[off..].as_mut_ptr()
        };
        off += n;
        raw.push(ffi::ibv_recv_wr {
            wr_id: wr.wr_id,
            next: std::ptr::null_mut(),
            sg_list,
            num_sge,
        });
    }
    let base = raw.as_mut_ptr();
    for i in 0..raw.len().saturating_sub(1) {
        // SAFETY: i + 1 < len; pointers into the same live Vec.
        raw[i].next = unsafe { base.add(i + 1) };
    }
    let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
    let ret = post(base, &mut bad);
    if ret == 0 {
        return Ok(());
    }
    let idx = if bad.is_null() {
        0
    } else {
        // SAFETY: bad points into `raw` per the post verbs' contract.
        usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
    };
    Err((IbvError::new(call, ret), idx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_ops_values() {
        assert_eq!(SendOps::RDMA_WRITE.0, 1);
        assert_eq!(SendOps::ATOMIC_FETCH_AND_ADD.0, 1 << 6);
        assert_eq!(SendOps::FLUSH.0, 1 << 11);
        assert_eq!(SendOps::ATOMIC_WRITE.0, 1 << 12);
        assert!(SendOps::BASIC_ATOMICS.contains(SendOps::BASIC));
        assert!(!SendOps::BASIC.contains(SendOps::ATOMIC_CMP_AND_SWP));
    }

    #[test]
    fn atomic_wr_validation() {
        let sge8 = [Sge {
            addr: 0x1000,
            length: 8,
            lkey: 1,
        }];
        let sge4 = [Sge {
            addr: 0x1000,
            length: 4,
            lkey: 1,
        }];
        let fa = |addr, sges| SendWr {
            wr_id: 1,
            op: SendOp::FetchAdd {
                rkey: 2,
                remote_addr: addr,
                add: 1,
            },
            sges,
            flags: SendFlags::SIGNALED,
        };
        assert!(validate_send(&fa(0x2000, &sge8)).is_ok());
        assert_eq!(
            validate_send(&fa(0x2004, &sge8)).unwrap_err().errno,
            libc::EINVAL
        );
        assert_eq!(
            validate_send(&fa(0x2000, &sge4)).unwrap_err().errno,
            libc::EINVAL
        );
        assert_eq!(
            validate_send(&fa(0x2000, &[])).unwrap_err().errno,
            libc::EINVAL
        );
        let rd = SendWr {
            wr_id: 1,
            op: SendOp::RdmaRead {
                rkey: 2,
                remote_addr: 0,
            },
            sges: &sge4,
            flags: SendFlags::INLINE,
        };
        assert!(validate_send(&rd).is_err());
    }

    #[test]
    fn raw_send_wr_encoding() {
        let sge = [Sge {
            addr: 0x1000,
            length: 8,
            lkey: 1,
        }];
        let wr = SendWr {
            wr_id: 9,
            op: SendOp::CmpSwap {
                rkey: 5,
                remote_addr: 0x2000,
                compare: 3,
                swap: 4,
            },
            sges: &sge,
            flags: SendFlags::SIGNALED | SendFlags::FENCE,
        };
        let r = raw_send_wr(&wr, std::ptr::null_mut(), 1);
        assert_eq!(r.opcode, ffi::IBV_WR_ATOMIC_CMP_AND_SWP);
        assert_eq!(r.send_flags, ffi::IBV_SEND_SIGNALED | ffi::IBV_SEND_FENCE);
        // SAFETY: the atomic member was just written.
        let a = unsafe { r.wr.atomic };
        assert_eq!(
            (a.remote_addr, a.compare_add, a.swap, a.rkey),
            (0x2000, 3, 4, 5)
        );
        let wr = SendWr {
            op: SendOp::SendWithImm { imm: 0x0102_0304 },
            ..wr
        };
        let r = raw_send_wr(&wr, std::ptr::null_mut(), 1);
        assert_eq!(r.opcode, ffi::IBV_WR_SEND_WITH_IMM);
        // SAFETY: imm_data was just written.
        let imm = unsafe { r.__bindgen_anon_1.imm_data };
        assert_eq!(imm, 0x0102_0304u32.to_be());
    }

    #[test]
    fn qp_state_decode() {
        assert_eq!(QpState::from_raw(ffi::IBV_QPS_RTS), QpState::Rts);
        assert_eq!(QpState::from_raw(ffi::IBV_QPS_ERR), QpState::Err);
        assert_eq!(QpState::from_raw(42), QpState::Unknown);
    }
}
