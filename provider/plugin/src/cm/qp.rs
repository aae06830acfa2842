//! QPs, SRQs and endpoints through the cm: `rdma_create_qp(_ex)`,
//! `rdma_destroy_qp`, `rdma_create_srq(_ex)`, `rdma_init_qp_attr`,
//! `rdma_create_ep`/`rdma_destroy_ep` and `rdma_get_request`, all through
//! libibverbs' public calls as librdmacm makes them.

use std::sync::Arc;

use tracing::{error, warn};

use super::conn::get_event;
use super::event::ack_held;
use super::id::Id;
use super::verbs::{self, create_cqs, destroy_cqs};
use super::{is_stag_context, ops, CmResult, StagQp};
use crate::ffi;
use crate::handle::from_raw;

/// The QP access rights the cm gives a connected QP (iWARP's cm grants
/// remote read and write; stag adds RFC 7306 atomics).
const ACCESS: u32 = ffi::IBV_ACCESS_LOCAL_WRITE
    | ffi::IBV_ACCESS_REMOTE_WRITE
    | ffi::IBV_ACCESS_REMOTE_READ
    | ffi::IBV_ACCESS_REMOTE_ATOMIC;

/// `rdma_init_qp_attr`: the attributes for moving a QP of `_id` to
/// `qp_attr.qp_state`, as the kernel's iWARP cm gives them (the same for
/// every id: port 1, pkey 0, remote access).
pub(crate) fn init_qp_attr(
    _id: &Id,
    attr: &mut ffi::ibv_qp_attr,
    mask: &mut std::os::raw::c_int,
) -> CmResult<()> {
    let m = match attr.qp_state {
        ffi::IBV_QPS_INIT => {
            attr.qp_access_flags = ACCESS;
            attr.port_num = 1;
            attr.pkey_index = 0;
            ffi::IBV_QP_STATE | ffi::IBV_QP_ACCESS_FLAGS | ffi::IBV_QP_PORT | ffi::IBV_QP_PKEY_INDEX
        }
        ffi::IBV_QPS_RTR => {
            attr.qp_access_flags = ACCESS;
            ffi::IBV_QP_STATE | ffi::IBV_QP_ACCESS_FLAGS
        }
        ffi::IBV_QPS_RTS => ffi::IBV_QP_STATE,
        _ => return Err(libc::EINVAL),
    };
    *mask = m as std::os::raw::c_int;
    Ok(())
}

/// Move a new QP to INIT as librdmacm does (`ucma_init_conn_qp`).
///
/// # Safety
/// `qp` is a live QP.
unsafe fn init_conn_qp(id: &Id, qp: *mut ffi::ibv_qp) -> CmResult<()> {
    let mut attr = ffi::ibv_qp_attr {
        qp_state: ffi::IBV_QPS_INIT,
        ..Default::default()
    };
    let mut mask = 0;
    init_qp_attr(id, &mut attr, &mut mask)?;
    // SAFETY: live QP (caller), valid attributes.
    let rc = unsafe { ffi::ibv_modify_qp(qp, &mut attr, mask) };
    if rc == 0 {
        return Ok(());
    }
    // The QP is stag0's; record INIT through the verbs half directly.
    // SAFETY: live QP (caller).
    match unsafe { from_raw::<StagQp>(qp) }.map(StagQp::handle) {
        Some(h) => {
            warn!(
                rc,
                "rdma_cm: ibv_modify_qp(INIT) refused; recording INIT directly"
            );
            h.set_state(ffi::IBV_QPS_INIT);
            Ok(())
        }
        None => Err(if rc > 0 { rc } else { libc::EINVAL }),
    }
}

/// `rdma_create_qp_ex`.
///
/// # Safety
/// `attr` is a valid attribute block whose pointers are the application's
/// libibverbs objects or NULL.
pub(crate) unsafe fn create_qp_ex(
    id: &Arc<Id>,
    attr: &mut ffi::ibv_qp_init_attr_ex,
) -> CmResult<()> {
    // SAFETY: application thread inside a cm call on `id`.
    let c = unsafe { id.c() };
    if !c.qp.is_null() {
        return Err(libc::EINVAL);
    }
    if attr.comp_mask & ffi::IBV_QP_INIT_ATTR_PD == 0 || attr.pd.is_null() {
        if c.pd.is_null() {
            c.pd = verbs::stag()?.pd;
        }
        attr.comp_mask |= ffi::IBV_QP_INIT_ATTR_PD;
        attr.pd = c.pd;
    } else {
        // SAFETY: a PD of the application (caller).
        let ctx = unsafe { (*attr.pd).context };
        if c.verbs.is_null() && is_stag_context(ctx) {
            c.verbs = ctx;
            c.port_num = 1;
        } else if c.verbs != ctx {
            error!("rdma_cm: rdma_create_qp: the PD is not of the id's device");
            return Err(libc::EINVAL);
        }
    }
    if c.verbs.is_null() {
        c.verbs = verbs::stag()?.ctx;
        c.port_num = 1;
    }
    if (!c.recv_cq.is_null() && !attr.recv_cq.is_null() && c.recv_cq != attr.recv_cq)
        || (!c.send_cq.is_null() && !attr.send_cq.is_null() && c.send_cq != attr.send_cq)
    {
        return Err(libc::EINVAL);
    }
    let send = if attr.send_cq.is_null() && c.send_cq.is_null() {
        attr.cap.max_send_wr
    } else {
        0
    };
    let recv = if attr.recv_cq.is_null() && c.recv_cq.is_null() {
        attr.cap.max_recv_wr
    } else {
        0
    };
    let raw = id.raw();
    // SAFETY: a live id with verbs set.
    unsafe { create_cqs(raw, send, recv) }?;
    // SAFETY: re-borrow after create_cqs wrote the CQ fields.
    let c = unsafe { id.c() };
    if attr.send_cq.is_null() {
        attr.send_cq = c.send_cq;
    }
    if attr.recv_cq.is_null() {
        attr.recv_cq = c.recv_cq;
    }
    if !c.srq.is_null() && attr.srq.is_null() {
        attr.srq = c.srq;
    }
    // SAFETY: open context; attributes checked above.
    let qp = match unsafe { verbs::create_qp_ex(c.verbs, attr) } {
        Ok(qp) => qp,
        Err(e) => {
            // SAFETY: the id's own CQs.
            unsafe { destroy_cqs(raw) };
            return Err(e);
        }
    };
    // SAFETY: the QP just created.
    if let Err(e) = unsafe { init_conn_qp(id, qp) } {
        // SAFETY: our QP and CQs, unused by anyone yet.
        unsafe {
            ffi::ibv_destroy_qp(qp);
            destroy_cqs(raw);
        }
        return Err(e);
    }
    // SAFETY: as above.
    let c = unsafe { id.c() };
    // SAFETY: a live QP.
    c.pd = unsafe { (*qp).pd };
    c.qp = qp;
    Ok(())
}

/// `rdma_create_qp`.
///
/// # Safety
/// As [`create_qp_ex`], for a plain attribute block.
pub(crate) unsafe fn create_qp(
    id: &Arc<Id>,
    pd: *mut ffi::ibv_pd,
    init: &mut ffi::ibv_qp_init_attr,
) -> CmResult<()> {
    // SAFETY: application thread inside rdma_create_qp.
    let id_pd = unsafe { id.c() }.pd;
    let mut ex = ffi::ibv_qp_init_attr_ex {
        qp_context: init.qp_context,
        send_cq: init.send_cq,
        recv_cq: init.recv_cq,
        srq: init.srq,
        cap: init.cap,
        qp_type: init.qp_type,
        sq_sig_all: init.sq_sig_all,
        comp_mask: ffi::IBV_QP_INIT_ATTR_PD,
        pd: if pd.is_null() { id_pd } else { pd },
        ..Default::default()
    };
    // SAFETY: forwarded contract.
    let r = unsafe { create_qp_ex(id, &mut ex) };
    init.send_cq = ex.send_cq;
    init.recv_cq = ex.recv_cq;
    init.srq = ex.srq;
    init.cap = ex.cap;
    init.qp_type = ex.qp_type;
    r
}

/// `rdma_destroy_qp`.
pub(crate) fn destroy_qp(id: &Arc<Id>) {
    // SAFETY: application thread inside rdma_destroy_qp.
    let c = unsafe { id.c() };
    if !c.qp.is_null() {
        // SAFETY: the id's QP, made by rdma_create_qp; destroyed once
        // (the field is cleared).
        let rc = unsafe { ffi::ibv_destroy_qp(c.qp) };
        if rc != 0 {
            warn!(rc, "rdma_cm: ibv_destroy_qp failed");
        }
        c.qp = std::ptr::null_mut();
    }
    // SAFETY: the id's own CQs.
    unsafe { destroy_cqs(id.raw()) };
}

/// `rdma_create_srq_ex`.
///
/// # Safety
/// `attr` is a valid attribute block.
pub(crate) unsafe fn create_srq_ex(
    id: &Arc<Id>,
    attr: &mut ffi::ibv_srq_init_attr_ex,
) -> CmResult<()> {
    if attr.comp_mask & ffi::IBV_SRQ_INIT_ATTR_TYPE == 0 {
        return Err(libc::EINVAL);
    }
    if attr.srq_type != ffi::IBV_SRQT_BASIC {
        error!("rdma_cm: only basic SRQs: stag0 has no XRC");
        return Err(libc::EOPNOTSUPP);
    }
    // SAFETY: application thread inside a cm call on `id`.
    let c = unsafe { id.c() };
    if c.verbs.is_null() {
        c.verbs = verbs::stag()?.ctx;
    }
    if attr.comp_mask & ffi::IBV_SRQ_INIT_ATTR_PD == 0 || attr.pd.is_null() {
        if c.pd.is_null() {
            c.pd = verbs::stag()?.pd;
        }
        attr.pd = c.pd;
        attr.comp_mask |= ffi::IBV_SRQ_INIT_ATTR_PD;
    }
    // SAFETY: open context, valid attributes.
    let srq = unsafe { verbs::create_srq_ex(c.verbs, attr) }?;
    if c.pd.is_null() {
        c.pd = attr.pd;
    }
    c.srq = srq;
    Ok(())
}

/// `rdma_create_srq`.
///
/// # Safety
/// `attr` is a valid attribute block.
pub(crate) unsafe fn create_srq(
    id: &Arc<Id>,
    pd: *mut ffi::ibv_pd,
    attr: &mut ffi::ibv_srq_init_attr,
) -> CmResult<()> {
    let mut ex = ffi::ibv_srq_init_attr_ex {
        srq_context: attr.srq_context,
        attr: attr.attr,
        comp_mask: ffi::IBV_SRQ_INIT_ATTR_TYPE | ffi::IBV_SRQ_INIT_ATTR_PD,
        srq_type: ffi::IBV_SRQT_BASIC,
        pd,
        ..Default::default()
    };
    // SAFETY: forwarded contract.
    let r = unsafe { create_srq_ex(id, &mut ex) };
    attr.attr = ex.attr;
    r
}

/// `rdma_destroy_srq`.
pub(crate) fn destroy_srq(id: &Arc<Id>) {
    // SAFETY: application thread inside rdma_destroy_srq.
    let c = unsafe { id.c() };
    if !c.srq.is_null() {
        // SAFETY: the id's SRQ; destroyed once (the field is cleared).
        let rc = unsafe { verbs::destroy_srq(c.srq) };
        if rc != 0 {
            warn!(rc, "rdma_cm: ibv_destroy_srq failed");
        }
        c.srq = std::ptr::null_mut();
    }
}

/// `rdma_get_request`: the next connection request of a synchronous
/// listening id, with a QP made from the endpoint's attributes.
pub(crate) fn get_request(listen: &Arc<Id>) -> CmResult<*mut ffi::rdma_cm_id> {
    let (sync, channel, init) = {
        let st = listen.state();
        (st.sync, st.channel.clone(), st.qp_init_attr)
    };
    if !sync {
        return Err(libc::EINVAL);
    }
    ack_held(listen);
    let ev = get_event(&*channel)?;
    // SAFETY: a live event we just made.
    let e = unsafe { &*ev };
    let fail = |err| {
        // SAFETY: application thread inside rdma_get_request.
        unsafe { listen.c() }.event = ev;
        Err(err)
    };
    if e.event == ffi::RDMA_CM_EVENT_REJECTED {
        return fail(libc::ECONNREFUSED);
    }
    if e.status != 0 {
        return fail(e.status.abs());
    }
    if e.event != ffi::RDMA_CM_EVENT_CONNECT_REQUEST {
        return fail(libc::EINVAL);
    }
    let child = Id::lookup(e.id)?;
    if let Some(super::id::EpAttr(mut attr)) = init {
        // SAFETY: application thread; the listener's PD.
        let pd = unsafe { listen.c() }.pd;
        // SAFETY: the stored attributes came from the application's
        // rdma_create_ep; pointers in it are its objects.
        if let Err(err) = unsafe { create_qp(&child, pd, &mut attr) } {
            return fail(err);
        }
    }
    // SAFETY: application thread; the child is handed out now.
    unsafe { child.c() }.event = ev;
    Ok(child.raw())
}

/// `rdma_create_ep`.
///
/// # Safety
/// `res` is a valid `rdma_addrinfo`; `init` NULL or valid.
pub(crate) unsafe fn create_ep(
    res: &ffi::rdma_addrinfo,
    pd: *mut ffi::ibv_pd,
    init: *mut ffi::ibv_qp_init_attr,
) -> CmResult<*mut ffi::rdma_cm_id> {
    let qp_type = (res.ai_qp_type != 0).then_some(res.ai_qp_type as ffi::ibv_qp_type);
    let id = ops::create_id(
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        res.ai_port_space as ffi::rdma_port_space,
        qp_type,
    )?;
    // SAFETY: forwarded contract.
    match unsafe { setup_ep(&id, res, pd, init) } {
        Ok(()) => Ok(id.raw()),
        Err(e) => {
            destroy_ep(&id);
            Err(e)
        }
    }
}

/// # Safety
/// As [`create_ep`].
unsafe fn setup_ep(
    id: &Arc<Id>,
    res: &ffi::rdma_addrinfo,
    pd: *mut ffi::ibv_pd,
    init: *mut ffi::ibv_qp_init_attr,
) -> CmResult<()> {
    // SAFETY: addresses of a valid addrinfo (caller).
    let src = unsafe { ops::opt_addr(res.ai_src_addr) }?;
    if res.ai_flags as u32 & ffi::RAI_PASSIVE != 0 {
        ops::bind(id, src.ok_or(libc::EINVAL)?)?;
        if !pd.is_null() {
            // SAFETY: application thread inside rdma_create_ep.
            unsafe { id.c() }.pd = pd;
        }
        if !init.is_null() {
            // SAFETY: valid (caller).
            let mut a = unsafe { *init };
            a.qp_type = res.ai_qp_type as ffi::ibv_qp_type;
            id.state().qp_init_attr = Some(super::id::EpAttr(a));
        }
        return Ok(());
    }
    // SAFETY: as above.
    let dst = unsafe { ops::opt_addr(res.ai_dst_addr) }?.ok_or(libc::EINVAL)?;
    // librdmacm's rdma_create_ep resolves with 2000 ms.
    ops::resolve_addr(id, src, dst, std::time::Duration::from_millis(2000))?;
    ops::resolve_route(id, std::time::Duration::from_millis(2000))?;
    if !init.is_null() {
        // SAFETY: valid (caller).
        let a = unsafe { &mut *init };
        a.qp_type = res.ai_qp_type as ffi::ibv_qp_type;
        // SAFETY: forwarded contract.
        unsafe { create_qp(id, pd, a) }?;
    }
    if res.ai_connect_len > 0 && !res.ai_connect.is_null() {
        // SAFETY: ai_connect holds ai_connect_len bytes (caller).
        let data =
            unsafe { std::slice::from_raw_parts(res.ai_connect as *const u8, res.ai_connect_len) };
        id.state().connect_data = data.to_vec();
    }
    Ok(())
}

/// `rdma_destroy_ep`.
pub(crate) fn destroy_ep(id: &Arc<Id>) {
    // SAFETY: application thread inside rdma_destroy_ep.
    let c = unsafe { id.c() };
    if !c.qp.is_null() {
        destroy_qp(id);
    }
    if !c.srq.is_null() {
        destroy_srq(id);
    }
    id.state().qp_init_attr = None;
    let _ = ops::destroy_id(id.raw());
}

/// `rdma_establish`: for a QP the application connects itself after
/// CONNECT_RESPONSE, which stag's cm never reports (it connects only the
/// id's own QP).
pub(crate) fn establish(id: &Arc<Id>) -> CmResult<()> {
    // SAFETY: application thread inside rdma_establish.
    if !unsafe { id.c() }.qp.is_null() {
        return Err(libc::EINVAL);
    }
    error!("rdma_cm: rdma_establish: stag's cm connects only QPs made with rdma_create_qp");
    Err(libc::EINVAL)
}

/// `rdma_notify` (the id is valid): an iWARP connection is established by
/// its stream, so there is nothing to tell it (the kernel's iWARP cm
/// answers 0 as well).
pub(crate) fn notify(_id: &Arc<Id>) -> CmResult<()> {
    Ok(())
}
