//! RC queue pairs: `ibv_create_qp(_ex)`, legacy `ibv_post_send` /
//! `ibv_post_recv`, and the extended `ibv_wr_*` API (incl. atomic write and
//! flush through `rdma-sys-ext`, gated on the installed rdma-core).

use super::cq::CompletionQueue;
use super::pd::ProtectionDomain;
use super::srq::SharedReceiveQueue;
use super::wr::{
    post_recv_chain, raw_send_wr, validate_send, FlushLevel, FlushType, RecvWr, SendFlags, SendOp,
    SendOps, SendWr, Sge,
};
use super::{check, check_errno, IbvError, Result};
use rdma_sys_ext as ffi;
use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard};

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_state_decode() {
        assert_eq!(QpState::from_raw(ffi::IBV_QPS_RTS), QpState::Rts);
        assert_eq!(QpState::from_raw(ffi::IBV_QPS_ERR), QpState::Err);
        assert_eq!(QpState::from_raw(42), QpState::Unknown);
    }
}
