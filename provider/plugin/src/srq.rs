//! Shared receive queues.

use std::ffi::c_int;
use std::ptr;
use std::sync::Arc;

use provider::srq::Srq;

use crate::async_events::AsyncSource;
use crate::c_list::{post_chain, sge_list};
use crate::errno::{self, guard};
use crate::ffi::*;
use crate::handle::{self, from_raw, Object};
use crate::mr::StagPd;
use crate::users::{Use, Users};
use provider::identity::LIMITS;

/// `verbs_srq` first, then the RNIC's queue.
#[repr(C)]
pub(crate) struct StagSrq {
    vsrq: verbs_srq,
    pub(crate) inner: Arc<Srq>,
    max_wr: u32,
    max_sge: u32,
    /// The QPs receiving from this SRQ.
    pub(crate) users: Arc<Users>,
    /// Keeps the PD from being deallocated while the SRQ lives.
    _on_pd: Use,
    /// Where its IBV_EVENT_SRQ_LIMIT_REACHED goes.
    events: Option<Arc<AsyncSource>>,
}

// SAFETY: repr(C), starts with its verbs_srq, whose first member is the
// ibv_srq; create_srq makes every ibv_srq of a stag context.
unsafe impl Object for StagSrq {
    type C = ibv_srq;
}

pub(crate) unsafe extern "C" fn create_srq(
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    guard("create_srq", ptr::null_mut(), || {
        // SAFETY: libibverbs passes a pd of this context.
        let Some(StagPd {
            users: pd_users, ..
        }) = (unsafe { from_raw::<StagPd>(pd) })
        else {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        };
        if attr.is_null() {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        }
        // SAFETY: the caller's attr.
        let a = unsafe { &mut *attr };
        if a.attr.max_wr == 0
            || a.attr.max_wr > LIMITS.max_srq_wr
            || a.attr.max_sge > LIMITS.max_sge
        {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        }
        let max_sge = a.attr.max_sge.max(1);
        let inner = Arc::new(Srq::new(a.attr.max_wr as usize, max_sge as usize));
        // SAFETY: all-zero is valid for the C part; pthread objects are
        // initialised in place below.
        let mut vsrq: verbs_srq = unsafe { std::mem::zeroed() };
        // SAFETY: pd is live.
        vsrq.srq.context = unsafe { (*pd).context };
        vsrq.srq.srq_context = a.srq_context;
        vsrq.srq.pd = pd;
        vsrq.srq_type = IBV_SRQT_BASIC;
        let raw = Box::into_raw(Box::new(StagSrq {
            vsrq,
            inner,
            max_wr: a.attr.max_wr,
            max_sge,
            users: Users::new(),
            _on_pd: pd_users.hold(),
            events: None,
        }));
        // SAFETY: pd is live, and so its context.
        if let Some(st) = unsafe { handle::context((*pd).context) } {
            // The kernel's user handle for an SRQ is the ibv_srq pointer.
            let source = AsyncSource::new(st.async_events.clone(), raw as u64);
            let s = source.clone();
            // SAFETY: the fresh allocation, not handed out yet.
            unsafe {
                (*raw)
                    .inner
                    .set_limit_hook(move || s.post(IBV_EVENT_SRQ_LIMIT_REACHED));
                (*raw).events = Some(source);
            }
        }
        // SAFETY: fresh allocation; initialised where they stay.
        unsafe {
            libc::pthread_mutex_init(ptr::addr_of_mut!((*raw).vsrq.srq.mutex).cast(), ptr::null());
            libc::pthread_cond_init(ptr::addr_of_mut!((*raw).vsrq.srq.cond).cast(), ptr::null());
        }
        a.attr.max_sge = max_sge;
        raw.cast()
    })
}

pub(crate) unsafe extern "C" fn modify_srq(
    srq: *mut ibv_srq,
    attr: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    guard("modify_srq", libc::EIO, || {
        // SAFETY: libibverbs passes an srq of this context.
        let Some(s) = (unsafe { from_raw::<StagSrq>(srq) }) else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        if mask as u32 & IBV_SRQ_MAX_WR != 0 {
            tracing::warn!("stag0: resizing an SRQ is not supported");
            return libc::EOPNOTSUPP;
        }
        if mask as u32 & IBV_SRQ_LIMIT != 0 {
            // SAFETY: the caller's attr (checked non-NULL).
            let limit = unsafe { (*attr).srq_limit };
            if limit > s.max_wr {
                return libc::EINVAL;
            }
            // Armed: IBV_EVENT_SRQ_LIMIT_REACHED once fewer WRs remain.
            s.inner.arm_limit(limit as usize);
        }
        0
    })
}

pub(crate) unsafe extern "C" fn query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    guard("query_srq", libc::EIO, || {
        // SAFETY: libibverbs passes an srq of this context.
        let Some(s) = (unsafe { from_raw::<StagSrq>(srq) }) else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: the caller's attr (checked non-NULL).
        unsafe {
            *attr = ibv_srq_attr {
                max_wr: s.max_wr,
                max_sge: s.max_sge,
                srq_limit: s.inner.limit() as u32,
            };
        }
        0
    })
}

pub(crate) unsafe extern "C" fn destroy_srq(srq: *mut ibv_srq) -> c_int {
    guard("destroy_srq", libc::EIO, || {
        // SAFETY: libibverbs passes an srq of this context.
        let Some(s) = (unsafe { from_raw::<StagSrq>(srq) }) else {
            return libc::EINVAL;
        };
        if s.users.in_use() {
            return libc::EBUSY;
        }
        // As for a QP: its unread events dropped, the read ones acked.
        if let Some(events) = &s.events {
            let reported = events.retire();
            // SAFETY: the live srq's own members.
            unsafe {
                crate::async_events::wait_acked(
                    ptr::addr_of_mut!((*srq).mutex).cast(),
                    ptr::addr_of_mut!((*srq).cond).cast(),
                    ptr::addr_of!((*srq).events_completed),
                    reported,
                )
            };
        }
        // SAFETY: ours, freed once.
        unsafe {
            libc::pthread_mutex_destroy(ptr::addr_of_mut!((*srq).mutex).cast());
            libc::pthread_cond_destroy(ptr::addr_of_mut!((*srq).cond).cast());
            drop(Box::from_raw(srq.cast::<StagSrq>()));
        }
        0
    })
}

pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    guard("post_srq_recv", libc::EIO, || {
        // SAFETY: libibverbs passes an srq of this context.
        let Some(StagSrq { inner, .. }) = (unsafe { from_raw::<StagSrq>(srq) }) else {
            return libc::EINVAL;
        };
        // SAFETY: the caller's chain, its SGE arrays and out pointer.
        unsafe {
            post_chain(wr, bad, |w| {
                let sg_list = sge_list(w.sg_list, w.num_sge)?;
                inner.post_recv_ref(w.wr_id, &sg_list).map_err(|e| match e {
                    provider::srq::PostRecvError::Full(_) => libc::ENOMEM,
                    _ => libc::EINVAL,
                })
            })
        }
    })
}
