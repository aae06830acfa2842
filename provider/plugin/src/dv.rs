//! `stagdv.h`: the RFC 7306 and Commit operations verbs has no words for,
//! for C programs on stag0 (the way mlx5dv extends verbs for mlx5).

use std::ffi::{c_int, c_uint};

use provider::wr::{Remote, SendOp, WorkCompletion};

use crate::c_list::SgeList;
use crate::cq::StagCq;
use crate::errno::guard;
use crate::ffi::*;
use crate::handle::from_raw;
use crate::qp::StagQp;

/// `struct stagdv_wc_ext`.
#[repr(C)]
pub struct StagdvWcExt {
    imm: u64,
    commit_status: u32,
    reserved: u32,
}

/// Run a post on one of our QPs.
fn post(qp: *mut ibv_qp, wr_id: u64, flags: c_uint, op: SendOp, sges: SgeList) -> c_int {
    guard("stagdv_post", libc::EIO, || {
        // SAFETY: the caller's QP, NULL-checked and checked to be ours.
        match unsafe { from_raw::<StagQp>(qp).map(StagQp::shared) } {
            Some(sh) => sh.post_dv(wr_id, flags, op, sges),
            None => libc::EINVAL,
        }
    })
}

/// Post an atomic whose original value lands in the one SGE `res`.
///
/// # Safety
/// `res` must be NULL or point to an `ibv_sge`.
unsafe fn post_atomic(
    qp: *mut ibv_qp,
    wr_id: u64,
    flags: c_uint,
    res: *const ibv_sge,
    op: SendOp,
) -> c_int {
    // SAFETY: forwarded.
    match unsafe { crate::c_list::sge_list(res, 1) } {
        Ok(sges) => post(qp, wr_id, flags, op, sges),
        Err(e) => e,
    }
}

#[no_mangle]
pub extern "C" fn stagdv_is_stag_context(ctx: *mut ibv_context) -> c_int {
    crate::handle::is_stag_context(ctx) as c_int
}

/// # Safety
/// C contract of `stagdv.h`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stagdv_post_masked_fetch_add(
    qp: *mut ibv_qp,
    wr_id: u64,
    flags: c_uint,
    res: *const ibv_sge,
    remote_addr: u64,
    rkey: u32,
    add: u64,
    add_mask: u64,
) -> c_int {
    let op = SendOp::FetchAdd {
        remote: Remote {
            addr: remote_addr,
            rkey,
        },
        add,
        mask: add_mask,
    };
    // SAFETY: the caller's SGE.
    unsafe { post_atomic(qp, wr_id, flags, res, op) }
}

/// # Safety
/// C contract of `stagdv.h`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stagdv_post_masked_cmp_swap(
    qp: *mut ibv_qp,
    wr_id: u64,
    flags: c_uint,
    res: *const ibv_sge,
    remote_addr: u64,
    rkey: u32,
    compare: u64,
    compare_mask: u64,
    swap: u64,
    swap_mask: u64,
) -> c_int {
    let op = SendOp::CmpSwap {
        remote: Remote {
            addr: remote_addr,
            rkey,
        },
        compare,
        compare_mask,
        swap,
        swap_mask,
    };
    // SAFETY: the caller's SGE.
    unsafe { post_atomic(qp, wr_id, flags, res, op) }
}

/// # Safety
/// C contract of `stagdv.h`.
#[no_mangle]
pub unsafe extern "C" fn stagdv_post_swap(
    qp: *mut ibv_qp,
    wr_id: u64,
    flags: c_uint,
    res: *const ibv_sge,
    remote_addr: u64,
    rkey: u32,
    swap: u64,
) -> c_int {
    let op = SendOp::Swap {
        remote: Remote {
            addr: remote_addr,
            rkey,
        },
        swap,
    };
    // SAFETY: the caller's SGE.
    unsafe { post_atomic(qp, wr_id, flags, res, op) }
}

#[no_mangle]
pub extern "C" fn stagdv_post_imm(qp: *mut ibv_qp, wr_id: u64, flags: c_uint, imm: u64) -> c_int {
    let op = SendOp::Imm {
        imm,
        solicited: flags & IBV_SEND_SOLICITED != 0,
    };
    post(qp, wr_id, flags, op, SgeList::new())
}

/// # Safety
/// C contract of `stagdv.h`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stagdv_post_write_imm(
    qp: *mut ibv_qp,
    wr_id: u64,
    flags: c_uint,
    sg_list: *const ibv_sge,
    num_sge: c_int,
    remote_addr: u64,
    rkey: u32,
    imm: u64,
) -> c_int {
    // SAFETY: the caller's array of num_sge SGEs.
    let sges = match unsafe { crate::c_list::sge_list(sg_list, num_sge) } {
        Ok(s) => s,
        Err(e) => return e,
    };
    let op = SendOp::WriteImm {
        remote: Remote {
            addr: remote_addr,
            rkey,
        },
        imm,
    };
    post(qp, wr_id, flags, op, sges)
}

#[no_mangle]
pub extern "C" fn stagdv_post_commit(
    qp: *mut ibv_qp,
    wr_id: u64,
    flags: c_uint,
    remote_addr: u64,
    rkey: u32,
    length: u32,
) -> c_int {
    let op = SendOp::Commit {
        remote: Remote {
            addr: remote_addr,
            rkey,
        },
        len: length,
    };
    post(qp, wr_id, flags, op, SgeList::new())
}

#[no_mangle]
pub extern "C" fn stagdv_post_atomic_write(
    qp: *mut ibv_qp,
    wr_id: u64,
    flags: c_uint,
    remote_addr: u64,
    rkey: u32,
    value: u64,
) -> c_int {
    let op = SendOp::AtomicWrite {
        remote: Remote {
            addr: remote_addr,
            rkey,
        },
        value,
    };
    post(qp, wr_id, flags, op, SgeList::new())
}

/// # Safety
/// C contract of `stagdv.h`: `wc` (and `ext`, if not NULL) hold `num`
/// entries.
#[no_mangle]
pub unsafe extern "C" fn stagdv_poll_cq(
    cq: *mut ibv_cq,
    num: c_int,
    wc: *mut ibv_wc,
    ext: *mut StagdvWcExt,
) -> c_int {
    guard("stagdv_poll_cq", -1, || {
        // SAFETY: the caller's CQ, checked to be ours.
        let Some(StagCq { inner, .. }) = (unsafe { from_raw::<StagCq>(cq) }) else {
            crate::errno::set(libc::EINVAL);
            return -1;
        };
        if num <= 0 {
            return 0;
        }
        if wc.is_null() {
            crate::errno::set(libc::EINVAL);
            return -1;
        }
        let mut buf = [WorkCompletion::BLANK; 32];
        let want = (num as usize).min(buf.len());
        let n = inner.poll(&mut buf[..want]);
        for (i, c) in buf[..n].iter().enumerate() {
            // SAFETY: room for num ≥ n entries in each array.
            unsafe {
                std::ptr::write(wc.add(i), crate::cq::to_ibv_wc(c));
                if !ext.is_null() {
                    std::ptr::write(
                        ext.add(i),
                        StagdvWcExt {
                            imm: c.imm.unwrap_or(0),
                            commit_status: if c.opcode == provider::wr::WcOpcode::Commit {
                                c.vendor_err
                            } else {
                                0
                            },
                            reserved: 0,
                        },
                    );
                }
            }
        }
        n as c_int
    })
}
