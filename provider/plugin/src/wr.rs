//! The extended post API (`ibv_qp_ex`'s `ibv_wr_*` function pointers).
//!
//! `ibv_wr_start` opens a batch, each `ibv_wr_<op>` adds a request with the
//! QP's current `wr_id`/`wr_flags`, `ibv_wr_set_sge*`/`set_inline_data*`
//! give it its data, and `ibv_wr_complete` posts the batch (or returns the
//! first error any call met, posting nothing).

use std::ffi::{c_int, c_uint, c_void};

use provider::wr::{Remote, SendOp, Sge};

use crate::c_list::SgeList;
use crate::ffi::*;
use crate::handle::{from_raw, Object};

/// Send operations beyond the basic set that this build can offer.
#[cfg(has_wr_flush)]
pub(crate) const EXTRA_SEND_OPS: u64 = (IBV_QP_EX_WITH_ATOMIC_WRITE | IBV_QP_EX_WITH_FLUSH) as u64;
/// Send operations beyond the basic set that this build can offer.
#[cfg(not(has_wr_flush))]
pub(crate) const EXTRA_SEND_OPS: u64 = IBV_QP_EX_WITH_ATOMIC_WRITE as u64;

/// Fill in the function pointers of a new extended QP.
pub(crate) fn install<Q: HasBatch>(q: &mut ibv_qp_ex) {
    q.wr_start = Some(wr_start::<Q>);
    q.wr_complete = Some(wr_complete::<Q>);
    q.wr_abort = Some(wr_abort::<Q>);
    q.wr_send = Some(wr_send::<Q>);
    q.wr_send_imm = Some(wr_send_imm::<Q>);
    q.wr_send_inv = Some(wr_send_inv::<Q>);
    q.wr_rdma_write = Some(wr_rdma_write::<Q>);
    q.wr_rdma_write_imm = Some(wr_rdma_write_imm::<Q>);
    q.wr_rdma_read = Some(wr_rdma_read::<Q>);
    q.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp::<Q>);
    q.wr_atomic_fetch_add = Some(wr_atomic_fetch_add::<Q>);
    q.wr_atomic_write = Some(wr_atomic_write::<Q>);
    q.wr_set_sge = Some(wr_set_sge::<Q>);
    q.wr_set_sge_list = Some(wr_set_sge_list::<Q>);
    q.wr_set_inline_data = Some(wr_set_inline_data::<Q>);
    q.wr_set_inline_data_list = Some(wr_set_inline_data_list::<Q>);
    #[cfg(has_wr_flush)]
    {
        q.wr_flush = Some(wr_flush::<Q>);
    }
}

/// The batch the `ibv_wr_*` calls build on a QP, posted by `wr_complete`.
pub(crate) trait WrBatch {
    /// `wr_start`: a new batch.
    fn batch_start(&self);
    /// A `wr_<op>` call: a new request, with the QP's current
    /// wr_id/flags; `op_flag` is its `IBV_QP_EX_WITH_*` bit.
    fn batch_push(&self, wr_id: u64, flags: c_uint, op: SendOp, op_flag: u64);
    /// `wr_set_sge*` / `wr_set_inline_data*` on the last request.
    fn batch_set_data(&self, sges: crate::c_list::SgeList, inline: Option<Vec<u8>>);
    /// Record an error for `wr_complete` to return.
    fn batch_fail(&self, e: c_int);
    /// `wr_complete`: post the batch, or nothing if a call failed.
    fn batch_complete(&self) -> c_int;
    /// `wr_abort`: drop the batch.
    fn batch_abort(&self);
}

/// A QP object with a [`WrBatch`]: what [`install`] is instantiated for.
pub(crate) trait HasBatch: Object<C = ibv_qp> {
    type Batch: WrBatch;
    fn batch(&self) -> &Self::Batch;
}

/// Run a `wr_*` body on one of our QPs (others are ignored: libibverbs
/// only calls these through pointers we installed).
fn with<Q: HasBatch>(qp: *mut ibv_qp_ex, what: &'static str, f: impl FnOnce(&Q::Batch, u64, u32)) {
    crate::errno::guard(what, (), || {
        // SAFETY: libibverbs' inline wrappers pass the QP they were called
        // on (or NULL); an ibv_qp_ex starts with its ibv_qp.
        let Some(q) = (unsafe { from_raw::<Q>(qp.cast::<ibv_qp>()) }) else {
            return;
        };
        // SAFETY: a live ibv_qp_ex; wr_id and wr_flags are set by the caller.
        let (id, flags) = unsafe { ((*qp).wr_id, (*qp).wr_flags) };
        f(q.batch(), id, flags)
    })
}

fn remote(rkey: u32, addr: u64) -> Remote {
    Remote { addr, rkey }
}

unsafe extern "C" fn wr_start<Q: HasBatch>(qp: *mut ibv_qp_ex) {
    with::<Q>(qp, "wr_start", |sh, _, _| sh.batch_start());
}

unsafe extern "C" fn wr_complete<Q: HasBatch>(qp: *mut ibv_qp_ex) -> c_int {
    let mut rc = libc::EINVAL;
    with::<Q>(qp, "wr_complete", |sh, _, _| rc = sh.batch_complete());
    rc
}

unsafe extern "C" fn wr_abort<Q: HasBatch>(qp: *mut ibv_qp_ex) {
    with::<Q>(qp, "wr_abort", |sh, _, _| sh.batch_abort());
}

unsafe extern "C" fn wr_send<Q: HasBatch>(qp: *mut ibv_qp_ex) {
    with::<Q>(qp, "wr_send", |sh, id, fl| {
        let op = SendOp::Send {
            solicited: fl & IBV_SEND_SOLICITED != 0,
            invalidate: None,
        };
        sh.batch_push(id, fl, op, IBV_QP_EX_WITH_SEND as u64)
    });
}

unsafe extern "C" fn wr_send_imm<Q: HasBatch>(qp: *mut ibv_qp_ex, imm: __be32) {
    with::<Q>(qp, "wr_send_imm", |sh, id, fl| {
        let op = SendOp::Imm {
            imm: u32::from_be(imm) as u64,
            solicited: fl & IBV_SEND_SOLICITED != 0,
        };
        sh.batch_push(id, fl, op, IBV_QP_EX_WITH_SEND_WITH_IMM as u64)
    });
}

unsafe extern "C" fn wr_send_inv<Q: HasBatch>(qp: *mut ibv_qp_ex, rkey: u32) {
    with::<Q>(qp, "wr_send_inv", |sh, id, fl| {
        let op = SendOp::Send {
            solicited: fl & IBV_SEND_SOLICITED != 0,
            invalidate: Some(rkey),
        };
        sh.batch_push(id, fl, op, IBV_QP_EX_WITH_SEND_WITH_INV as u64)
    });
}

unsafe extern "C" fn wr_rdma_write<Q: HasBatch>(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    with::<Q>(qp, "wr_rdma_write", |sh, id, fl| {
        let op = SendOp::Write {
            remote: remote(rkey, addr),
        };
        sh.batch_push(id, fl, op, IBV_QP_EX_WITH_RDMA_WRITE as u64)
    });
}

unsafe extern "C" fn wr_rdma_write_imm<Q: HasBatch>(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    addr: u64,
    imm: __be32,
) {
    with::<Q>(qp, "wr_rdma_write_imm", |sh, id, fl| {
        let op = SendOp::WriteImm {
            remote: remote(rkey, addr),
            imm: u32::from_be(imm) as u64,
        };
        sh.batch_push(id, fl, op, IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM as u64)
    });
}

unsafe extern "C" fn wr_rdma_read<Q: HasBatch>(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    with::<Q>(qp, "wr_rdma_read", |sh, id, fl| {
        let op = SendOp::Read {
            remote: remote(rkey, addr),
        };
        sh.batch_push(id, fl, op, IBV_QP_EX_WITH_RDMA_READ as u64)
    });
}

unsafe extern "C" fn wr_atomic_cmp_swp<Q: HasBatch>(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    addr: u64,
    compare: u64,
    swap: u64,
) {
    with::<Q>(qp, "wr_atomic_cmp_swp", |sh, id, fl| {
        let op = SendOp::CmpSwap {
            remote: remote(rkey, addr),
            compare,
            compare_mask: u64::MAX,
            swap,
            swap_mask: u64::MAX,
        };
        sh.batch_push(id, fl, op, IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP as u64)
    });
}

unsafe extern "C" fn wr_atomic_fetch_add<Q: HasBatch>(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    addr: u64,
    add: u64,
) {
    with::<Q>(qp, "wr_atomic_fetch_add", |sh, id, fl| {
        let op = SendOp::FetchAdd {
            remote: remote(rkey, addr),
            add,
            mask: 0,
        };
        sh.batch_push(id, fl, op, IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD as u64)
    });
}

unsafe extern "C" fn wr_atomic_write<Q: HasBatch>(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    addr: u64,
    value: *const c_void,
) {
    with::<Q>(qp, "wr_atomic_write", |sh, id, fl| {
        if value.is_null() {
            sh.batch_fail(libc::EINVAL);
            return;
        }
        // SAFETY: verbs passes 8 bytes (the value to store, in the
        // responder's byte order: the bytes go as they are).
        let v = unsafe { std::ptr::read_unaligned(value.cast::<u64>()) };
        let op = SendOp::AtomicWrite {
            remote: remote(rkey, addr),
            value: v,
        };
        sh.batch_push(id, fl, op, IBV_QP_EX_WITH_ATOMIC_WRITE as u64)
    });
}

#[cfg(has_wr_flush)]
unsafe extern "C" fn wr_flush<Q: HasBatch>(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    addr: u64,
    len: usize,
    _ptype: u8,
    _level: u8,
) {
    with::<Q>(qp, "wr_flush", |sh, id, fl| {
        let op = SendOp::Commit {
            remote: remote(rkey, addr),
            len: len.min(u32::MAX as usize) as u32,
        };
        sh.batch_push(id, fl, op, IBV_QP_EX_WITH_FLUSH as u64)
    });
}

unsafe extern "C" fn wr_set_sge<Q: HasBatch>(
    qp: *mut ibv_qp_ex,
    lkey: u32,
    addr: u64,
    length: u32,
) {
    with::<Q>(qp, "wr_set_sge", |sh, _, _| {
        sh.batch_set_data(smallvec::smallvec![Sge { addr, length, lkey }], None)
    });
}

unsafe extern "C" fn wr_set_sge_list<Q: HasBatch>(
    qp: *mut ibv_qp_ex,
    n: usize,
    list: *const ibv_sge,
) {
    with::<Q>(qp, "wr_set_sge_list", |sh, _, _| {
        let n = c_int::try_from(n).unwrap_or(c_int::MAX);
        // SAFETY: the caller's array of n SGEs.
        match unsafe { crate::c_list::sge_list(list, n) } {
            Ok(sges) => sh.batch_set_data(sges, None),
            Err(e) => sh.batch_fail(e),
        }
    });
}

unsafe extern "C" fn wr_set_inline_data<Q: HasBatch>(
    qp: *mut ibv_qp_ex,
    addr: *mut c_void,
    length: usize,
) {
    with::<Q>(qp, "wr_set_inline_data", |sh, _, _| {
        if length > 0 && addr.is_null() {
            sh.batch_fail(libc::EINVAL);
            return;
        }
        let data = if length == 0 {
            Vec::new()
        } else {
            // SAFETY: the caller's buffer, valid during the call; copied now.
            unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), length) }.to_vec()
        };
        sh.batch_set_data(SgeList::new(), Some(data))
    });
}

unsafe extern "C" fn wr_set_inline_data_list<Q: HasBatch>(
    qp: *mut ibv_qp_ex,
    n: usize,
    list: *const ibv_data_buf,
) {
    with::<Q>(qp, "wr_set_inline_data_list", |sh, _, _| {
        if n > 0 && list.is_null() {
            sh.batch_fail(libc::EINVAL);
            return;
        }
        let mut data = Vec::new();
        if n > 0 {
            // SAFETY: the caller's array of n buffers.
            for b in unsafe { std::slice::from_raw_parts(list, n) } {
                if b.length > 0 {
                    if b.addr.is_null() {
                        sh.batch_fail(libc::EINVAL);
                        return;
                    }
                    // SAFETY: the caller's buffer, valid during the call.
                    data.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(b.addr.cast::<u8>(), b.length)
                    });
                }
            }
        }
        sh.batch_set_data(SgeList::new(), Some(data))
    });
}
