//! stag0 as the cm sees it: one `ibv_context` opened through libibverbs
//! (which calls the plugin), a default PD, and the libibverbs calls
//! librdmacm makes for `rdma_create_qp` & co.

use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::sync::Mutex;

use tracing::{debug, error, warn};

use super::{lock, CmResult};
use crate::ffi;

// libibverbs' public calls the bindings do not declare.
extern "C" {
    fn ibv_create_comp_channel(context: *mut ffi::ibv_context) -> *mut ffi::ibv_comp_channel;
    fn ibv_destroy_comp_channel(channel: *mut ffi::ibv_comp_channel) -> c_int;
    fn ibv_create_cq(
        context: *mut ffi::ibv_context,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: *mut ffi::ibv_comp_channel,
        comp_vector: c_int,
    ) -> *mut ffi::ibv_cq;
    fn ibv_destroy_cq(cq: *mut ffi::ibv_cq) -> c_int;
    fn ibv_create_srq(pd: *mut ffi::ibv_pd, attr: *mut ffi::ibv_srq_init_attr)
        -> *mut ffi::ibv_srq;
    fn ibv_destroy_srq(srq: *mut ffi::ibv_srq) -> c_int;
}

/// stag0, opened once per process.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stag {
    /// The context every cm id hands out as `id->verbs`.
    pub ctx: *mut ffi::ibv_context,
    /// The default PD (`id->pd` until a QP says otherwise).
    pub pd: *mut ffi::ibv_pd,
    /// Inbound RDMA Reads the device holds per QP (max IRD).
    pub max_ird: u8,
    /// Outbound RDMA Reads per QP (max ORD).
    pub max_ord: u8,
}

// SAFETY: the context and PD are libibverbs objects meant to be used from
// any thread; the cm only passes the pointers to libibverbs and C.
unsafe impl Send for Stag {}
// SAFETY: as above; nothing here is mutated after the open.
unsafe impl Sync for Stag {}

static STAG: Mutex<Option<Stag>> = Mutex::new(None);

/// stag0's context, opening it on first use.
pub(crate) fn stag() -> CmResult<Stag> {
    let mut slot = lock(&STAG);
    if let Some(s) = *slot {
        return Ok(s);
    }
    let s = open()?;
    *slot = Some(s);
    Ok(s)
}

fn open() -> CmResult<Stag> {
    let mut n: c_int = 0;
    // SAFETY: libibverbs' public call; `n` is a valid out-pointer.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        error!(
            "rdma_cm: ibv_get_device_list failed: no stag device visible (run under `stag run`)"
        );
        return Err(libc::ENODEV);
    }
    let mut ctx = std::ptr::null_mut();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: `dev` comes from the list; the name is a NUL-terminated
        // string owned by libibverbs.
        let name = unsafe { ffi::ibv_get_device_name(dev) };
        if name.is_null() {
            continue;
        }
        // SAFETY: non-NULL, NUL-terminated (above).
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        if !name.starts_with("stag") {
            continue;
        }
        // SAFETY: `dev` is a valid device of the list, still allocated.
        ctx = unsafe { ffi::ibv_open_device(dev) };
        if ctx.is_null() {
            error!(device = %name, errno = %std::io::Error::last_os_error(), "rdma_cm: ibv_open_device failed");
        } else {
            debug!(device = %name, "rdma_cm: opened");
        }
        break;
    }
    // SAFETY: the list came from ibv_get_device_list; opened contexts stay
    // valid after it is freed.
    unsafe { ffi::ibv_free_device_list(list) };
    if ctx.is_null() {
        error!(
            "rdma_cm: no stag device among libibverbs' devices (is SYSFS_PATH set by `stag run`?)"
        );
        return Err(libc::ENODEV);
    }
    if !super::is_stag_context(ctx) {
        warn!("rdma_cm: the opened stag device is not the plugin's context");
    }
    // SAFETY: `ctx` is an open context.
    let pd = unsafe { ffi::ibv_alloc_pd(ctx) };
    if pd.is_null() {
        error!("rdma_cm: ibv_alloc_pd on stag0 failed");
        // SAFETY: opened above, nothing else refers to it yet.
        unsafe { ffi::ibv_close_device(ctx) };
        return Err(libc::ENOMEM);
    }
    let mut attr = ffi::ibv_device_attr::default();
    // SAFETY: `ctx` is open and `attr` a valid out-pointer.
    let rc = unsafe { ffi::ibv_query_device(ctx, &mut attr) };
    let clamp = |v: c_int| v.clamp(1, 255) as u8;
    let (max_ird, max_ord) = if rc == 0 {
        (clamp(attr.max_qp_rd_atom), clamp(attr.max_qp_init_rd_atom))
    } else {
        (16, 16)
    };
    Ok(Stag {
        ctx,
        pd,
        max_ird,
        max_ord,
    })
}

/// `verbs_get_ctx_op`: the extended context behind `ctx` when it has the
/// operation at `op`'s offset.
///
/// # Safety
/// `ctx` is a valid open context.
unsafe fn verbs_ctx(ctx: *mut ffi::ibv_context) -> Option<*mut ffi::verbs_context> {
    // SAFETY: valid context (caller); abi_compat is a plain field.
    let compat = unsafe { (*ctx).abi_compat };
    // libibverbs marks extended contexts with (void *)-1.
    if compat as isize != -1 {
        return None;
    }
    let off = std::mem::offset_of!(ffi::verbs_context, context);
    // SAFETY: an extended context is the `context` member of a
    // verbs_context (container_of).
    let vctx = unsafe { (ctx as *mut u8).sub(off) } as *mut ffi::verbs_context;
    Some(vctx)
}

/// `ibv_create_qp_ex` (a static inline of verbs.h).
///
/// # Safety
/// `ctx` is an open context and `attr` a valid attribute block whose
/// pointers are libibverbs objects of that context.
pub(crate) unsafe fn create_qp_ex(
    ctx: *mut ffi::ibv_context,
    attr: *mut ffi::ibv_qp_init_attr_ex,
) -> CmResult<*mut ffi::ibv_qp> {
    // SAFETY: valid attribute block (caller).
    let a = unsafe { &mut *attr };
    let qp = if a.comp_mask == ffi::IBV_QP_INIT_ATTR_PD {
        // SAFETY: ibv_qp_init_attr is the leading part of the _ex block.
        unsafe { ffi::ibv_create_qp(a.pd, attr as *mut ffi::ibv_qp_init_attr) }
    } else {
        // SAFETY: open context (caller).
        let vctx = unsafe { verbs_ctx(ctx) }.ok_or(libc::EOPNOTSUPP)?;
        let need = std::mem::size_of::<ffi::verbs_context>()
            - std::mem::offset_of!(ffi::verbs_context, create_qp_ex);
        // SAFETY: vctx is the extended context; `sz` says how much of it
        // the provider filled, checked before reading the op.
        let op = unsafe { ((*vctx).sz >= need).then(|| (*vctx).create_qp_ex).flatten() };
        let op = op.ok_or(libc::EOPNOTSUPP)?;
        // SAFETY: the provider's op, called as libibverbs would.
        unsafe { op(ctx, attr) }
    };
    if qp.is_null() {
        Err(last_errno(libc::ENOMEM))
    } else {
        Ok(qp)
    }
}

/// `ibv_create_srq_ex` (a static inline of verbs.h).
///
/// # Safety
/// As [`create_qp_ex`].
pub(crate) unsafe fn create_srq_ex(
    ctx: *mut ffi::ibv_context,
    attr: *mut ffi::ibv_srq_init_attr_ex,
) -> CmResult<*mut ffi::ibv_srq> {
    // SAFETY: valid attribute block (caller).
    let a = unsafe { &mut *attr };
    let basic = ffi::IBV_SRQ_INIT_ATTR_PD | ffi::IBV_SRQ_INIT_ATTR_TYPE;
    let mask = a.comp_mask;
    let srq = if mask & !basic == 0
        && mask & ffi::IBV_SRQ_INIT_ATTR_PD != 0
        && (mask & ffi::IBV_SRQ_INIT_ATTR_TYPE == 0 || a.srq_type == ffi::IBV_SRQT_BASIC)
    {
        // SAFETY: ibv_srq_init_attr is the leading part of the _ex block.
        unsafe { ibv_create_srq(a.pd, attr as *mut ffi::ibv_srq_init_attr) }
    } else {
        // SAFETY: open context (caller).
        let vctx = unsafe { verbs_ctx(ctx) }.ok_or(libc::EOPNOTSUPP)?;
        let need = std::mem::size_of::<ffi::verbs_context>()
            - std::mem::offset_of!(ffi::verbs_context, create_srq_ex);
        // SAFETY: as in create_qp_ex.
        let op = unsafe {
            ((*vctx).sz >= need)
                .then(|| (*vctx).create_srq_ex)
                .flatten()
        };
        let op = op.ok_or(libc::EOPNOTSUPP)?;
        // SAFETY: the provider's op, called as libibverbs would.
        unsafe { op(ctx, attr) }
    };
    if srq.is_null() {
        Err(last_errno(libc::ENOMEM))
    } else {
        Ok(srq)
    }
}

/// `errno` as left by the last failed call, or `fallback` when it is 0.
pub(crate) fn last_errno(fallback: c_int) -> c_int {
    match std::io::Error::last_os_error().raw_os_error() {
        Some(e) if e != 0 => e,
        _ => fallback,
    }
}

/// The CQs librdmacm creates for a QP whose attributes name none: a
/// completion channel and a CQ of `size` entries for each side that needs
/// one, stored in the id (`send_cq`/`recv_cq` and their channels).
///
/// # Safety
/// `id` is a live cm id with a valid `verbs`.
pub(crate) unsafe fn create_cqs(
    id: *mut ffi::rdma_cm_id,
    send_size: u32,
    recv_size: u32,
) -> CmResult<()> {
    // SAFETY: live id (caller).
    let raw = unsafe { &mut *id };
    let make = |size: u32| -> CmResult<(*mut ffi::ibv_comp_channel, *mut ffi::ibv_cq)> {
        // SAFETY: raw.verbs is an open context (caller).
        let ch = unsafe { ibv_create_comp_channel(raw.verbs) };
        if ch.is_null() {
            return Err(last_errno(libc::ENOMEM));
        }
        let cqe = size.min(c_int::MAX as u32) as c_int;
        // SAFETY: open context and channel; the CQ's context is the id, as
        // librdmacm sets it.
        let cq = unsafe { ibv_create_cq(raw.verbs, cqe, id as *mut c_void, ch, 0) };
        if cq.is_null() {
            let e = last_errno(libc::ENOMEM);
            // SAFETY: created above, unused.
            unsafe { ibv_destroy_comp_channel(ch) };
            return Err(e);
        }
        Ok((ch, cq))
    };
    if recv_size > 0 {
        let (ch, cq) = make(recv_size)?;
        raw.recv_cq_channel = ch;
        raw.recv_cq = cq;
    }
    if send_size > 0 {
        match make(send_size) {
            Ok((ch, cq)) => {
                raw.send_cq_channel = ch;
                raw.send_cq = cq;
            }
            Err(e) => {
                // SAFETY: live id (caller).
                unsafe { destroy_cqs(id) };
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Destroy the CQs and channels [`create_cqs`] stored in the id.
///
/// # Safety
/// `id` is a live cm id.
pub(crate) unsafe fn destroy_cqs(id: *mut ffi::rdma_cm_id) {
    // SAFETY: live id (caller).
    let raw = unsafe { &mut *id };
    // SAFETY: each call's CQ or channel was created by create_cqs and is
    // owned by the id; the fields are cleared so each is destroyed once.
    unsafe {
        if !raw.recv_cq.is_null() {
            ibv_destroy_cq(raw.recv_cq);
            if !raw.send_cq.is_null() && raw.send_cq != raw.recv_cq {
                ibv_destroy_cq(raw.send_cq);
            }
        } else if !raw.send_cq.is_null() {
            ibv_destroy_cq(raw.send_cq);
        }
        raw.recv_cq = std::ptr::null_mut();
        raw.send_cq = std::ptr::null_mut();
        if !raw.recv_cq_channel.is_null() {
            ibv_destroy_comp_channel(raw.recv_cq_channel);
            if !raw.send_cq_channel.is_null() && raw.send_cq_channel != raw.recv_cq_channel {
                ibv_destroy_comp_channel(raw.send_cq_channel);
            }
        } else if !raw.send_cq_channel.is_null() {
            ibv_destroy_comp_channel(raw.send_cq_channel);
        }
        raw.recv_cq_channel = std::ptr::null_mut();
        raw.send_cq_channel = std::ptr::null_mut();
    }
}

/// `ibv_destroy_srq`.
///
/// # Safety
/// `srq` is a live SRQ.
pub(crate) unsafe fn destroy_srq(srq: *mut ffi::ibv_srq) -> c_int {
    // SAFETY: live SRQ (caller).
    unsafe { ibv_destroy_srq(srq) }
}
