//! Completion queues and channels: `ibv_create_cq`, `ibv_poll_cq`,
//! `ibv_req_notify_cq`, `ibv_create_comp_channel`, `ibv_get_cq_event`.

use super::device::Context;
use super::{check, IbvError, Result};
use rdma_sys_ext as ffi;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

/// `enum ibv_wc_status`: the one status type of the crate, whose
/// discriminants are the C values (checked against the header below).
pub use provider::wr::WcStatus;

/// `enum ibv_wc_opcode` (C values as discriminants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcOpcode {
    /// `IBV_WC_SEND`
    Send = 0,
    /// `IBV_WC_RDMA_WRITE`
    RdmaWrite = 1,
    /// `IBV_WC_RDMA_READ`
    RdmaRead = 2,
    /// `IBV_WC_COMP_SWAP`
    CompSwap = 3,
    /// `IBV_WC_FETCH_ADD`
    FetchAdd = 4,
    /// `IBV_WC_BIND_MW`
    BindMw = 5,
    /// `IBV_WC_LOCAL_INV`
    LocalInv = 6,
    /// `IBV_WC_TSO`
    Tso = 7,
    /// `IBV_WC_FLUSH`
    Flush = 8,
    /// `IBV_WC_ATOMIC_WRITE`
    AtomicWrite = 9,
    /// `IBV_WC_RECV`
    Recv = 128,
    /// `IBV_WC_RECV_RDMA_WITH_IMM`
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
    /// Decodes a raw opcode.
    pub fn from_raw(v: u32) -> Option<Self> {
        use WcOpcode::*;
        Some(match v {
            0 => Send,
            1 => RdmaWrite,
            2 => RdmaRead,
            3 => CompSwap,
            4 => FetchAdd,
            5 => BindMw,
            6 => LocalInv,
            7 => Tso,
            8 => Flush,
            9 => AtomicWrite,
            128 => Recv,
            129 => RecvRdmaWithImm,
            _ => return None,
        })
    }
}

/// One polled `struct ibv_wc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// `wr_id` of the work request.
    pub wr_id: u64,
    /// `status`.
    pub status: WcStatus,
    /// Raw `status` (for values newer than this crate).
    pub raw_status: u32,
    /// `opcode`; `None` when the status is an error (the field is then
    /// undefined) or the value is unknown.
    pub opcode: Option<WcOpcode>,
    /// `byte_len` (receives, RDMA READ, atomics).
    pub byte_len: u32,
    /// Immediate data, host order, when `IBV_WC_WITH_IMM` is set.
    pub imm: Option<u32>,
    /// `qp_num`.
    pub qp_num: u32,
    /// `vendor_err`.
    pub vendor_err: u32,
    /// `wc_flags`.
    pub wc_flags: u32,
    /// The local STag the peer's Send with Invalidate invalidated
    /// (`IBV_WC_WITH_INV`).
    pub invalidated_rkey: Option<u32>,
}

impl WorkCompletion {
    fn from_raw(wc: &ffi::ibv_wc) -> Self {
        let status = WcStatus::from_raw(wc.status);
        let ok = status == WcStatus::Success;
        let imm = (ok && wc.wc_flags & ffi::IBV_WC_WITH_IMM != 0).then(|| {
            // SAFETY: the union holds imm_data when IBV_WC_WITH_IMM is set;
            // both members are plain u32.
            u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data })
        });
        // SAFETY: both members of the union are plain u32, so the read is
        // defined whichever was written; it means something only with
        // IBV_WC_WITH_INV, which the condition checks.
        let inv = unsafe { wc.__bindgen_anon_1.invalidated_rkey };
        let invalidated_rkey = (ok && wc.wc_flags & ffi::IBV_WC_WITH_INV != 0).then_some(inv);
        WorkCompletion {
            wr_id: wc.wr_id,
            status,
            raw_status: wc.status,
            invalidated_rkey,
            opcode: if ok {
                WcOpcode::from_raw(wc.opcode)
            } else {
                None
            },
            byte_len: wc.byte_len,
            imm,
            qp_num: wc.qp_num,
            vendor_err: wc.vendor_err,
            wc_flags: wc.wc_flags,
        }
    }

    /// `status == Success`.
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }
}

/// `struct ibv_comp_channel`: an fd that becomes readable when a CQ armed
/// with [`CompletionQueue::req_notify`] gets a completion.
pub struct CompletionChannel {
    ch: *mut ffi::ibv_comp_channel,
    ctx: Arc<Context>,
}

// SAFETY: the channel is an fd plus libibverbs bookkeeping protected by the
// library; get_cq_event may be called from any thread.
unsafe impl Send for CompletionChannel {}
// SAFETY: as above.
unsafe impl Sync for CompletionChannel {}

impl Context {
    /// `ibv_create_comp_channel`.
    pub fn create_comp_channel(self: &Arc<Self>) -> Result<Arc<CompletionChannel>> {
        // SAFETY: ctx is live while self is.
        let ch = unsafe { ffi::ibv_create_comp_channel(self.ctx) };
        if ch.is_null() {
            return Err(IbvError::last("ibv_create_comp_channel"));
        }
        Ok(Arc::new(CompletionChannel {
            ch,
            ctx: Arc::clone(self),
        }))
    }

    /// `ibv_create_cq` with at least `cqe` entries. `cq_context` is returned
    /// by [`CompletionChannel::get_event`] for events on this CQ.
    pub fn create_cq(
        self: &Arc<Self>,
        cqe: u32,
        channel: Option<&Arc<CompletionChannel>>,
        cq_context: u64,
    ) -> Result<Arc<CompletionQueue>> {
        let n = i32::try_from(cqe).map_err(|_| IbvError::invalid("ibv_create_cq"))?;
        if n == 0 {
            return Err(IbvError::invalid("ibv_create_cq"));
        }
        if let Some(ch) = channel {
            if !Arc::ptr_eq(&ch.ctx, self) && ch.ctx.ctx != self.ctx {
                return Err(IbvError::invalid("ibv_create_cq"));
            }
        }
        let chp = channel.map_or(std::ptr::null_mut(), |c| c.ch);
        // SAFETY: ctx and the optional channel are live; cq_context is an
        // opaque value libibverbs hands back unchanged.
        let cq = unsafe { ffi::ibv_create_cq(self.ctx, n, cq_context as usize as *mut _, chp, 0) };
        if cq.is_null() {
            return Err(IbvError::last("ibv_create_cq"));
        }
        Ok(Arc::new(CompletionQueue {
            cq,
            ctx: Arc::clone(self),
            channel: channel.cloned(),
        }))
    }
}

impl CompletionChannel {
    /// Blocks (unless the fd is non-blocking) for one CQ event, acks it and
    /// returns the `cq_context` given to [`Context::create_cq`].
    ///
    /// The CQ must be re-armed with [`CompletionQueue::req_notify`] for
    /// further events.
    pub fn get_event(&self) -> Result<u64> {
        let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
        let mut cq_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: ch is live; out-pointers are valid.
        let ret = unsafe { ffi::ibv_get_cq_event(self.ch, &mut cq, &mut cq_ctx) };
        if ret != 0 {
            return Err(IbvError::last("ibv_get_cq_event"));
        }
        // SAFETY: cq was just returned by ibv_get_cq_event and cannot be
        // destroyed before its events are acked, which happens here.
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Ok(cq_ctx as usize as u64)
    }

    /// Sets `O_NONBLOCK` on the channel fd (then `get_event` returns
    /// `EAGAIN` instead of blocking).
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<()> {
        let fd = self.as_raw_fd();
        // SAFETY: fcntl on an fd owned by the channel.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(IbvError::last("fcntl"));
        }
        let flags = if nonblocking {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        // SAFETY: as above.
        let ret = unsafe { libc::fcntl(fd, libc::F_SETFL, flags) };
        if ret < 0 {
            return Err(IbvError::last("fcntl"));
        }
        Ok(())
    }
}

impl std::os::fd::AsFd for CompletionChannel {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the channel's fd stays open until the channel is dropped,
        // which the borrow of `self` prevents.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: ch is live; fd is immutable after creation.
        unsafe { (*self.ch).fd }
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: ch came from ibv_create_comp_channel; CQs using it hold an
        // Arc to self, so none remains.
        let ret = unsafe { ffi::ibv_destroy_comp_channel(self.ch) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_destroy_comp_channel failed");
        }
    }
}

/// `struct ibv_cq`, holding its [`Context`] and optional channel.
pub struct CompletionQueue {
    pub(crate) cq: *mut ffi::ibv_cq,
    ctx: Arc<Context>,
    channel: Option<Arc<CompletionChannel>>,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("cq", &self.cq)
            .finish_non_exhaustive()
    }
}

// SAFETY: providers serialise ibv_poll_cq / ibv_req_notify_cq internally;
// the handle is immutable.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// `ibv_poll_cq` into `out`; returns how many entries were filled.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        const BATCH: usize = 16;
        let mut raw = [ffi::ibv_wc::default(); BATCH];
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(BATCH);
            // SAFETY: cq is live; raw has room for `want` entries.
            let n = unsafe { ffi::stag_ibv_poll_cq(self.cq, want as i32, raw.as_mut_ptr()) };
            if n < 0 {
                return Err(IbvError::new("ibv_poll_cq", n));
            }
            let n = n as usize;
            for (dst, src) in out[done..done + n].iter_mut().zip(&raw[..n]) {
                *dst = WorkCompletion::from_raw(src);
            }
            done += n;
            if n < want {
                break;
            }
        }
        Ok(done)
    }

    /// Polls one completion, if any.
    pub fn poll_one(&self) -> Result<Option<WorkCompletion>> {
        let mut raw = ffi::ibv_wc::default();
        // SAFETY: cq is live; raw has room for one entry.
        let n = unsafe { ffi::stag_ibv_poll_cq(self.cq, 1, &mut raw) };
        match n {
            0 => Ok(None),
            1 => Ok(Some(WorkCompletion::from_raw(&raw))),
            n => Err(IbvError::new("ibv_poll_cq", n)),
        }
    }

    /// `ibv_req_notify_cq`: arm the CQ so the next (solicited, if
    /// `solicited_only`) completion raises a channel event.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.channel.is_none() {
            return Err(IbvError::invalid("ibv_req_notify_cq"));
        }
        // SAFETY: cq is live.
        let ret = unsafe { ffi::stag_ibv_req_notify_cq(self.cq, i32::from(solicited_only)) };
        check("ibv_req_notify_cq", ret)
    }

    /// The completion channel, if any.
    pub fn channel(&self) -> Option<&Arc<CompletionChannel>> {
        self.channel.as_ref()
    }

    /// Actual number of CQEs (`cq->cqe`).
    pub fn cqe(&self) -> u32 {
        // SAFETY: cq is live; cqe is set at creation.
        u32::try_from(unsafe { (*self.cq).cqe }).unwrap_or(0)
    }

    /// The parent context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Raw pointer (stays owned by `self`).
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.cq
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: cq came from ibv_create_cq; QPs using it hold an Arc to
        // self; events are acked as soon as they are read.
        let ret = unsafe { ffi::ibv_destroy_cq(self.cq) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_destroy_cq failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every status has libibverbs' discriminant and `ibv_wc_status_str`
    /// wording: a fatal error is 19, a retry-exceeded 12, as the header
    /// says.
    #[test]
    fn statuses_are_libibverbs_statuses() {
        assert_eq!(WcStatus::Success as u32, ffi::IBV_WC_SUCCESS);
        assert_eq!(WcStatus::WrFlushErr as u32, ffi::IBV_WC_WR_FLUSH_ERR);
        assert_eq!(WcStatus::RemAccessErr as u32, ffi::IBV_WC_REM_ACCESS_ERR);
        assert_eq!(WcStatus::FatalErr as u32, ffi::IBV_WC_FATAL_ERR);
        assert_eq!(WcStatus::RetryExcErr as u32, ffi::IBV_WC_RETRY_EXC_ERR);
        assert_eq!(
            WcStatus::RnrRetryExcErr as u32,
            ffi::IBV_WC_RNR_RETRY_EXC_ERR
        );
        assert_eq!(WcStatus::GeneralErr as u32, ffi::IBV_WC_GENERAL_ERR);
        assert_eq!(
            WcStatus::TmRndvIncomplete as u32,
            ffi::IBV_WC_TM_RNDV_INCOMPLETE
        );
        for (i, s) in WcStatus::ALL.iter().enumerate() {
            assert_eq!(*s as u32, i as u32);
            assert_eq!(WcStatus::from_raw(i as u32), *s);
            // SAFETY: ibv_wc_status_str returns a static NUL-terminated
            // string for any value.
            let c = unsafe { std::ffi::CStr::from_ptr(ffi::ibv_wc_status_str(*s as u32)) };
            assert_eq!(s.as_str(), c.to_str().unwrap(), "{s:?}");
        }
        assert_eq!(WcStatus::from_raw(999), WcStatus::GeneralErr);
        assert!(WcStatus::WrFlushErr
            .as_str()
            .to_lowercase()
            .contains("flush"));
    }

    #[test]
    fn opcode_discriminants_match_c() {
        assert_eq!(WcOpcode::RdmaRead as u32, ffi::IBV_WC_RDMA_READ);
        assert_eq!(WcOpcode::FetchAdd as u32, ffi::IBV_WC_FETCH_ADD);
        assert_eq!(WcOpcode::Flush as u32, ffi::IBV_WC_FLUSH);
        assert_eq!(WcOpcode::AtomicWrite as u32, ffi::IBV_WC_ATOMIC_WRITE);
        assert_eq!(
            WcOpcode::RecvRdmaWithImm as u32,
            ffi::IBV_WC_RECV_RDMA_WITH_IMM
        );
        assert_eq!(WcOpcode::from_raw(200), None);
    }

    #[test]
    fn decode_wc_with_imm() {
        let mut wc = ffi::ibv_wc {
            wr_id: 7,
            status: ffi::IBV_WC_SUCCESS,
            opcode: ffi::IBV_WC_RECV_RDMA_WITH_IMM,
            byte_len: 16,
            wc_flags: ffi::IBV_WC_WITH_IMM,
            ..Default::default()
        };
        wc.__bindgen_anon_1.imm_data = 0x1234_5678u32.to_be();
        let c = WorkCompletion::from_raw(&wc);
        assert_eq!(c.imm, Some(0x1234_5678));
        assert_eq!(c.opcode, Some(WcOpcode::RecvRdmaWithImm));
        assert!(c.is_ok());
        let err = ffi::ibv_wc {
            status: ffi::IBV_WC_WR_FLUSH_ERR,
            opcode: 1,
            ..wc
        };
        let c = WorkCompletion::from_raw(&err);
        assert_eq!(
            (c.status, c.opcode, c.imm),
            (WcStatus::WrFlushErr, None, None)
        );
    }
}
