//! Queue pairs: creation, state, and posting (legacy `ibv_post_send` /
//! `ibv_post_recv` and the extended `ibv_wr_*` API).
//!
//! stag0 is an iWARP RNIC: an RC QP gets its stream from the connection
//! manager (rdma_cm, [`crate::cm`]), which runs the MPA exchange on the
//! RNIC's QP and moves the QP to RTS. Until then receives may be posted and
//! sends fail with `ENOTCONN`, as on siw.

use std::collections::HashMap;
use std::ffi::{c_int, c_uint};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use provider::device::{PostGuard, QueuePair};
use provider::qp::{QpCaps, QpState};
use provider::wr::{InlineWr, Remote, SendOp, SendWrRef};

use crate::async_events::AsyncSource;
use crate::c_list::{post_chain, sge_list, SgeList};
use crate::cq::StagCq;
use crate::errno::{self, guard};
use crate::ffi::*;
use crate::handle::{self, from_raw, Object};
use crate::mr::StagPd;
use crate::srq::StagSrq;
use crate::wr::{HasBatch, WrBatch};
use provider::identity::LIMITS;

/// `verbs_qp` as libibverbs lays it out (`ibv_qp_ex` first, then
/// `comp_mask`), then ours.
///
/// rdma-core 45 appended `wr_flush` to `ibv_qp_ex`, which moved
/// `verbs_qp::comp_mask` 8 bytes on; libibverbs' `ibv_qp_to_qp_ex` reads
/// it to decide whether the QP is extended. `VERBS_QP_EX` is set at both
/// places so that either library generation sees it.
#[repr(C)]
pub(crate) struct StagQp {
    qpx: ibv_qp_ex,
    comp_mask: u32,
    /// The newer layout's `comp_mask` (and `xrcd`), or this layout's `xrcd`.
    tail: [u64; 3],
    shared: Arc<QpShared>,
    /// Its PD, CQs and SRQ stay (EBUSY) until the QP is destroyed.
    _uses: Vec<crate::users::Use>,
}

const VERBS_QP_EX: u32 = 1 << 1;

/// What the QP, its posts and the connection manager share.
pub(crate) struct QpShared {
    prov: Arc<QueuePair>,
    /// The QP's `ibv_qp_state` as verbs sees it.
    state: AtomicU32,
    /// `ibv_qp.state` to mirror into, NULL once destroyed.
    ibv: Mutex<*mut ibv_qp>,
    sq_sig_all: bool,
    caps: QpCaps,
    max_inline: u32,
    access: AtomicU32,
    /// The `ibv_wr_*` batch under construction.
    batch: Mutex<Batch>,
    has_srq: bool,
    send_ops: u64,
    /// Where the QP's async events go, once it has its `ibv_qp`.
    events: OnceLock<Arc<QpEvents>>,
}

/// A QP's asynchronous events, from its connection's events.
struct QpEvents {
    source: Arc<AsyncSource>,
    /// The QP receives from an SRQ: it reports its last WQE.
    on_srq: bool,
    last_wqe_reported: AtomicBool,
}

impl QpEvents {
    fn on(&self, ev: &provider::qp::Event) {
        use provider::qp::Event;
        match ev {
            Event::Established => self.source.post(IBV_EVENT_COMM_EST),
            // A Terminate either way, or the stream broke (a reset, not an
            // orderly close): the QP is in Error by a fault.
            Event::TerminateSent(_) | Event::TerminateReceived(_) | Event::StreamFailed => {
                self.source.post(IBV_EVENT_QP_FATAL);
                self.entered_error();
            }
            // A clean close (the peer's disconnect) is no fault: the
            // connection manager reports it (RDMA_CM_EVENT_DISCONNECTED).
            Event::Closed => self.entered_error(),
        }
    }

    /// The QP is in Error: nothing more is taken from its SRQ, which the
    /// kernel reports once as IBV_EVENT_QP_LAST_WQE_REACHED.
    fn entered_error(&self) {
        if self.on_srq && !self.last_wqe_reported.swap(true, Ordering::AcqRel) {
            self.source.post(IBV_EVENT_QP_LAST_WQE_REACHED);
        }
    }
}

// SAFETY: the raw ibv_qp pointer is only dereferenced under its mutex while
// the QP is alive (destroy_qp nulls it first); everything else is Sync.
unsafe impl Send for QpShared {}
// SAFETY: as above.
unsafe impl Sync for QpShared {}

/// A handle the connection manager keeps on a QP.
#[derive(Clone)]
pub(crate) struct QpHandle(Arc<QpShared>);

/// A weak [`QpHandle`]: what an id keeps of the QP whose state it
/// mirrors, so that a thread other than the application's call on the id
/// (the one taking its events) never reads `id->qp`, which the application
/// may be destroying meanwhile (`rdma_destroy_qp`).
#[derive(Clone, Debug)]
pub(crate) struct WeakQpHandle(Weak<QpShared>);

impl WeakQpHandle {
    /// The QP, while its `QpShared` lives (after `ibv_destroy_qp` its
    /// state mirror goes nowhere: `ibv` is NULL).
    pub(crate) fn upgrade(&self) -> Option<QpHandle> {
        self.0.upgrade().map(QpHandle)
    }
}

/// The live QPs by number: the connection manager finds a QP the
/// application made with `ibv_create_qp` by its `conn_param->qp_num`.
fn by_num_table() -> std::sync::MutexGuard<'static, HashMap<u32, Weak<QpShared>>> {
    static BY_NUM: OnceLock<Mutex<HashMap<u32, Weak<QpShared>>>> = OnceLock::new();
    BY_NUM
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// The QP numbered `qpn`, if it is live.
pub(crate) fn by_num(qpn: u32) -> Option<QpHandle> {
    by_num_table()
        .get(&qpn)
        .and_then(Weak::upgrade)
        .map(QpHandle)
}

impl QpHandle {
    /// The handle held weakly.
    pub(crate) fn downgrade(&self) -> WeakQpHandle {
        WeakQpHandle(Arc::downgrade(&self.0))
    }

    /// The userspace RNIC's QP behind the ibv_qp.
    pub(crate) fn provider(&self) -> &Arc<QueuePair> {
        &self.0.prov
    }

    /// Record a state change made by the connection manager.
    pub(crate) fn set_state(&self, state: ibv_qp_state) {
        self.0.set_state(state);
    }
}

impl QpShared {
    fn set_state(&self, state: ibv_qp_state) {
        let ibv = *self.ibv.lock().unwrap_or_else(|p| p.into_inner());
        self.state.store(state, Ordering::Release);
        if !ibv.is_null() {
            // SAFETY: non-NULL only while the QP is alive (destroy_qp nulls
            // it under this lock before freeing).
            unsafe { (*ibv).state = state };
        }
    }

    /// The state, with what the stream did since (a Terminate or a closed
    /// stream moved the RNIC's QP to Error).
    fn state(&self) -> ibv_qp_state {
        let s = self.state.load(Ordering::Acquire);
        if matches!(s, IBV_QPS_RTS | IBV_QPS_RTR | IBV_QPS_SQD)
            && self.prov.state() == QpState::Error
        {
            return IBV_QPS_ERR;
        }
        s
    }
}

// SAFETY: repr(C), starts with its ibv_qp_ex, whose first member is the
// ibv_qp; create makes every ibv_qp of a stag context.
unsafe impl Object for StagQp {
    type C = ibv_qp;
}

impl StagQp {
    /// What the QP's posts and the connection manager share.
    pub(crate) fn shared(&self) -> &Arc<QpShared> {
        &self.shared
    }

    /// A handle for the connection manager, which may outlive the call.
    pub(crate) fn handle(&self) -> QpHandle {
        QpHandle(self.shared.clone())
    }
}

/// One `ibv_wr_*` request being built.
struct PendingWr {
    wr_id: u64,
    flags: c_uint,
    op: SendOp,
    sges: SgeList,
    inline: Option<Vec<u8>>,
}

#[derive(Default)]
struct Batch {
    wrs: Vec<PendingWr>,
    /// The first error a `wr_*` call met; `wr_complete` returns it.
    error: Option<c_int>,
}

fn caps_of(cap: &ibv_qp_cap) -> Result<(QpCaps, u32), c_int> {
    if cap.max_send_wr > LIMITS.max_qp_wr
        || cap.max_recv_wr > LIMITS.max_qp_wr
        || cap.max_send_sge > LIMITS.max_sge
        || cap.max_recv_sge > LIMITS.max_sge
        || cap.max_inline_data > LIMITS.max_inline
    {
        return Err(libc::EINVAL);
    }
    let caps = QpCaps {
        max_send_wr: cap.max_send_wr.max(1),
        max_recv_wr: cap.max_recv_wr.max(1),
        max_send_sge: cap.max_send_sge.max(1),
        max_recv_sge: cap.max_recv_sge.max(1),
        ..QpCaps::default()
    };
    Ok((caps, cap.max_inline_data))
}

/// The send operations the `ibv_wr_*` API offers on stag0.
fn supported_send_ops() -> u64 {
    let mut ops = (IBV_QP_EX_WITH_RDMA_WRITE
        | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
        | IBV_QP_EX_WITH_SEND
        | IBV_QP_EX_WITH_SEND_WITH_IMM
        | IBV_QP_EX_WITH_RDMA_READ
        | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
        | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
        | IBV_QP_EX_WITH_SEND_WITH_INV) as u64;
    ops |= crate::wr::EXTRA_SEND_OPS;
    ops
}

/// Both creation verbs: `init` is `ibv_qp_init_attr`, the prefix
/// `ibv_qp_init_attr_ex` shares; its `cap` gets what the QP has.
///
/// # Safety
/// `ctx`, `pd` and the objects `init` names come from libibverbs.
unsafe fn create(
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    init: &mut ibv_qp_init_attr,
    send_ops: Option<u64>,
) -> *mut ibv_qp {
    // SAFETY: forwarded.
    unsafe { try_create(ctx, pd, init, send_ops) }.unwrap_or_else(|e| {
        errno::set(e);
        ptr::null_mut()
    })
}

/// # Safety
/// As [`create`].
unsafe fn try_create(
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    init: &mut ibv_qp_init_attr,
    send_ops: Option<u64>,
) -> Result<*mut ibv_qp, c_int> {
    let (qp_type, send_cq, recv_cq, srq) = (init.qp_type, init.send_cq, init.recv_cq, init.srq);
    let (sq_sig_all, qp_context) = (init.sq_sig_all != 0, init.qp_context);
    let cap = &mut init.cap;
    // SAFETY: callers pass libibverbs' objects.
    let Some(spd) = (unsafe { from_raw::<StagPd>(pd) }) else {
        return Err(libc::EINVAL);
    };
    let prov_pd = &spd.inner;
    if qp_type != IBV_QPT_RC {
        // What kernel siw answers for anything but RC.
        tracing::warn!("stag0: only RC QPs are supported (asked for type {qp_type})");
        return Err(libc::EOPNOTSUPP);
    }
    // SAFETY: as above.
    let (Some(send), Some(recv)) = (unsafe { from_raw::<StagCq>(send_cq) }, unsafe {
        from_raw::<StagCq>(recv_cq)
    }) else {
        return Err(libc::EINVAL);
    };
    let (scq, rcq) = (&send.inner, &recv.inner);
    let on_srq = if srq.is_null() {
        None
    } else {
        // SAFETY: as above.
        Some(unsafe { from_raw::<StagSrq>(srq) }.ok_or(libc::EINVAL)?)
    };
    let prov_srq = on_srq.map(|s| s.inner.clone());
    let uses = [&spd.users, &send.users, &recv.users]
        .into_iter()
        .chain(on_srq.map(|s| &s.users))
        .map(|u| u.hold())
        .collect::<Vec<_>>();
    if let Some(ops) = send_ops {
        let unsupported = ops & !supported_send_ops();
        if unsupported != 0 {
            tracing::warn!("stag0: send_ops_flags {unsupported:#x} not supported");
            return Err(libc::EOPNOTSUPP);
        }
    }
    let (caps, max_inline) = caps_of(cap)?;
    let prov = Arc::new(prov_pd.create_qp(caps, scq, rcq, prov_srq.as_ref()));
    let qpn = prov.qp_num();
    let shared = Arc::new(QpShared {
        prov,
        state: AtomicU32::new(IBV_QPS_RESET),
        ibv: Mutex::new(ptr::null_mut()),
        sq_sig_all,
        caps,
        max_inline,
        access: AtomicU32::new(0),
        batch: Mutex::new(Batch::default()),
        has_srq: !srq.is_null(),
        send_ops: send_ops.unwrap_or(0),
        events: OnceLock::new(),
    });
    by_num_table().insert(qpn, Arc::downgrade(&shared));
    // SAFETY: all-zero is valid for the C part (pointers NULL, counters 0);
    // the mutex and cond are initialised in place below, once boxed.
    let mut qpx: ibv_qp_ex = unsafe { std::mem::zeroed() };
    qpx.qp_base.context = ctx;
    qpx.qp_base.qp_context = qp_context;
    qpx.qp_base.pd = pd;
    qpx.qp_base.send_cq = send_cq;
    qpx.qp_base.recv_cq = recv_cq;
    qpx.qp_base.srq = srq;
    qpx.qp_base.handle = qpn;
    qpx.qp_base.qp_num = qpn;
    qpx.qp_base.state = IBV_QPS_RESET;
    qpx.qp_base.qp_type = IBV_QPT_RC;
    if send_ops.is_some() {
        crate::wr::install::<StagQp>(&mut qpx);
    }
    let raw = Box::into_raw(Box::new(StagQp {
        qpx,
        comp_mask: if send_ops.is_some() { VERBS_QP_EX } else { 0 },
        tail: [
            if send_ops.is_some() {
                VERBS_QP_EX as u64
            } else {
                0
            },
            0,
            0,
        ],
        shared: shared.clone(),
        _uses: uses,
    }));
    // SAFETY: raw is the fresh allocation; the pthread objects are
    // initialised where they will stay.
    unsafe {
        let base = ptr::addr_of_mut!((*raw).qpx.qp_base);
        libc::pthread_mutex_init(ptr::addr_of_mut!((*base).mutex).cast(), ptr::null());
        libc::pthread_cond_init(ptr::addr_of_mut!((*base).cond).cast(), ptr::null());
        *shared.ibv.lock().unwrap_or_else(|p| p.into_inner()) = base;
    }
    // SAFETY: ctx is the pd's live context (libibverbs passes both).
    if let Some(st) = unsafe { handle::context(ctx) } {
        // The kernel's user handle for a QP is the ibv_qp pointer.
        let events = Arc::new(QpEvents {
            source: AsyncSource::new(st.async_events.clone(), raw as usize as u64),
            on_srq: !srq.is_null(),
            last_wqe_reported: AtomicBool::new(false),
        });
        let _ = shared.events.set(events.clone());
        shared.prov.set_async_hook(move |ev| events.on(ev));
    }
    cap.max_send_wr = caps.max_send_wr;
    cap.max_recv_wr = caps.max_recv_wr;
    cap.max_send_sge = caps.max_send_sge;
    cap.max_recv_sge = caps.max_recv_sge;
    cap.max_inline_data = max_inline;
    Ok(raw.cast())
}

pub(crate) unsafe extern "C" fn create_qp(
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    guard("create_qp", ptr::null_mut(), || {
        if pd.is_null() || attr.is_null() {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        }
        // SAFETY: libibverbs passes the caller's attr and pd.
        unsafe { create((*pd).context, pd, &mut *attr, None) }
    })
}

pub(crate) unsafe extern "C" fn create_qp_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    guard("create_qp_ex", ptr::null_mut(), || {
        if attr.is_null() {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        }
        // SAFETY: libibverbs passes the caller's attr.
        let a = unsafe { &mut *attr };
        let known = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || a.comp_mask & !known != 0 {
            tracing::warn!(
                "stag0: ibv_create_qp_ex: comp_mask {:#x} not supported (PD and send_ops_flags are)",
                a.comp_mask
            );
            errno::set(libc::EOPNOTSUPP);
            return ptr::null_mut();
        }
        let send_ops =
            (a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0).then_some(a.send_ops_flags);
        let mut init = ibv_qp_init_attr {
            qp_context: a.qp_context,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            cap: a.cap,
            qp_type: a.qp_type,
            sq_sig_all: a.sq_sig_all,
        };
        // SAFETY: libibverbs passes the caller's attr and context.
        let qp = unsafe { create(ctx, a.pd, &mut init, send_ops) };
        a.cap = init.cap;
        qp
    })
}

pub(crate) unsafe extern "C" fn destroy_qp(qp: *mut ibv_qp) -> c_int {
    guard("destroy_qp", libc::EIO, || {
        // SAFETY: libibverbs passes a qp of this context.
        let Some(sh) = unsafe { from_raw::<StagQp>(qp) }.map(StagQp::shared) else {
            return libc::EINVAL;
        };
        // As the kernel does: no more events, the unread ones dropped, and
        // the ones the application read acked before the ibv_qp goes (an
        // ack locks and counts on it).
        if let Some(events) = sh.events.get() {
            let reported = events.source.retire();
            // SAFETY: the live qp's own members.
            unsafe {
                crate::async_events::wait_acked(
                    ptr::addr_of_mut!((*qp).mutex).cast(),
                    ptr::addr_of_mut!((*qp).cond).cast(),
                    ptr::addr_of!((*qp).events_completed),
                    reported,
                )
            };
        }
        *sh.ibv.lock().unwrap_or_else(|p| p.into_inner()) = ptr::null_mut();
        by_num_table().remove(&sh.prov.qp_num());
        // The stream closes now, even while the connection manager still
        // holds a handle for the length of a call, and the QP's
        // completions leave its CQs (mlx5's CQ clean): verbs has no
        // completions for a destroyed QP, and the application may already
        // have freed what its WRs' ids point at. libfabric's rxm does: a
        // receive completion of a connection it had closed made it repost
        // on the freed endpoint (a SIGSEGV in fi_pingpong).
        sh.prov.retire();
        // SAFETY: ours, freed once; the pthread objects die with it.
        unsafe {
            libc::pthread_mutex_destroy(ptr::addr_of_mut!((*qp).mutex).cast());
            libc::pthread_cond_destroy(ptr::addr_of_mut!((*qp).cond).cast());
            drop(Box::from_raw(qp.cast::<StagQp>()));
        }
        0
    })
}

/// Whether verbs allows going from `from` to `to` (IB spec 10.3.1, as
/// rdma-core's providers check it); Error and Reset are always reachable.
fn transition_ok(from: ibv_qp_state, to: ibv_qp_state) -> bool {
    matches!(
        (from, to),
        (_, IBV_QPS_RESET)
            | (_, IBV_QPS_ERR)
            | (IBV_QPS_RESET, IBV_QPS_INIT)
            | (IBV_QPS_INIT, IBV_QPS_INIT)
            | (IBV_QPS_INIT, IBV_QPS_RTR)
            | (IBV_QPS_RTR, IBV_QPS_RTS)
            | (IBV_QPS_RTS, IBV_QPS_RTS)
            | (IBV_QPS_RTS, IBV_QPS_SQD)
            | (IBV_QPS_SQD, IBV_QPS_RTS)
            | (IBV_QPS_SQD, IBV_QPS_SQD)
            | (IBV_QPS_SQE, IBV_QPS_RTS)
    )
}

pub(crate) unsafe extern "C" fn modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    guard("modify_qp", libc::EIO, || {
        // SAFETY: libibverbs passes a qp of this context.
        let Some(sh) = unsafe { from_raw::<StagQp>(qp) }.map(StagQp::shared) else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: the caller's attr.
        let a = unsafe { &*attr };
        let mask = mask as u32;
        if mask & IBV_QP_ACCESS_FLAGS != 0 {
            sh.access.store(a.qp_access_flags, Ordering::Relaxed);
        }
        if mask & IBV_QP_STATE != 0 {
            let from = if mask & IBV_QP_CUR_STATE != 0 {
                a.cur_qp_state
            } else {
                sh.state()
            };
            let to = a.qp_state;
            if !transition_ok(from, to) {
                return libc::EINVAL;
            }
            if to == IBV_QPS_ERR
                || (to == IBV_QPS_RESET && from != IBV_QPS_RESET && from != IBV_QPS_INIT)
            {
                sh.prov.set_error();
                if let Some(events) = sh.events.get() {
                    events.entered_error();
                }
            }
            sh.set_state(to);
        }
        0
    })
}

pub(crate) unsafe extern "C" fn query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    guard("query_qp", libc::EIO, || {
        // SAFETY: libibverbs passes a qp of this context.
        let Some(sh) = unsafe { from_raw::<StagQp>(qp) }.map(StagQp::shared) else {
            return libc::EINVAL;
        };
        if attr.is_null() || init.is_null() {
            return libc::EINVAL;
        }
        let cap = ibv_qp_cap {
            max_send_wr: sh.caps.max_send_wr,
            max_recv_wr: sh.caps.max_recv_wr,
            max_send_sge: sh.caps.max_send_sge,
            max_recv_sge: sh.caps.max_recv_sge,
            max_inline_data: sh.max_inline,
        };
        let (ird, ord) = sh
            .prov
            .negotiated()
            .map(|n| (n.ird, n.ord))
            .unwrap_or((LIMITS.max_rd_atom as u16, LIMITS.max_rd_atom as u16));
        let state = sh.state();
        // SAFETY: the caller's structs; qp is live.
        unsafe {
            ptr::write(
                attr,
                ibv_qp_attr {
                    qp_state: state,
                    cur_qp_state: state,
                    path_mtu: IBV_MTU_4096,
                    qp_access_flags: sh.access.load(Ordering::Relaxed),
                    cap,
                    max_rd_atomic: ord.min(255) as u8,
                    max_dest_rd_atomic: ird.min(255) as u8,
                    port_num: 1,
                    ..Default::default()
                },
            );
            ptr::write(
                init,
                ibv_qp_init_attr {
                    qp_context: (*qp).qp_context,
                    send_cq: (*qp).send_cq,
                    recv_cq: (*qp).recv_cq,
                    srq: (*qp).srq,
                    cap,
                    qp_type: IBV_QPT_RC,
                    sq_sig_all: sh.sq_sig_all as c_int,
                },
            );
        }
        0
    })
}

/// Push one request onto `post`. Inline data (`IBV_SEND_INLINE`, or
/// `ibv_wr_set_inline_data*`) is copied into the QP by the push itself, so
/// the caller may reuse its buffers once the post returns. What is pushed
/// is framed now and written when the caller posts the list (one write for
/// a chain or an `ibv_wr_*` batch).
fn post_one(sh: &QpShared, post: &mut PostGuard<'_>, p: PendingWr) -> Result<(), c_int> {
    const MAX_SGE: usize = LIMITS.max_sge as usize;
    let signaled = sh.sq_sig_all || p.flags & IBV_SEND_SIGNALED != 0;
    let fence = p.flags & IBV_SEND_FENCE != 0;
    let pushed = if let Some(data) = &p.inline {
        post.push_inline(InlineWr {
            wr_id: p.wr_id,
            op: p.op,
            data: &[data],
            signaled,
            fence,
        })
    } else if p.flags & IBV_SEND_INLINE != 0 && !p.sges.is_empty() && p.op.sends_payload() {
        if p.sges.len() > MAX_SGE {
            return Err(libc::EINVAL);
        }
        let mut bufs: [&[u8]; MAX_SGE] = [&[]; MAX_SGE];
        for (buf, s) in bufs.iter_mut().zip(&p.sges) {
            if s.length > 0 {
                // SAFETY: for IBV_SEND_INLINE the SGEs are plain pointers
                // into the caller's memory, valid for the duration of the
                // post (verbs' contract; the lkey is ignored), and the push
                // copies them before the post returns.
                *buf =
                    unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
            }
        }
        post.push_inline(InlineWr {
            wr_id: p.wr_id,
            op: p.op,
            data: &bufs[..p.sges.len()],
            signaled,
            fence,
        })
    } else {
        post.push(SendWrRef {
            wr_id: p.wr_id,
            op: p.op,
            sg_list: &p.sges,
            signaled,
            fence,
        })
    };
    pushed.map_err(|e| {
        tracing::debug!("stag0: post_send refused: {e}");
        errno::of_device(&e)
    })
}

/// Translate one legacy send WR.
///
/// # Safety
/// `wr` must be a valid `ibv_send_wr`.
unsafe fn translate(wr: &ibv_send_wr) -> Result<PendingWr, c_int> {
    // SAFETY: forwarded.
    let sges = unsafe { sge_list(wr.sg_list, wr.num_sge) }?;
    let solicited = wr.send_flags & IBV_SEND_SOLICITED != 0;
    // SAFETY: the unions are plain integers; which one counts depends on
    // the opcode, as in every provider.
    let (rdma, atomic, imm, inv) = unsafe {
        (
            wr.wr.rdma,
            wr.wr.atomic,
            u32::from_be(wr.__bindgen_anon_1.imm_data) as u64,
            wr.__bindgen_anon_1.invalidate_rkey,
        )
    };
    let op = match wr.opcode {
        IBV_WR_SEND => SendOp::Send {
            solicited,
            invalidate: None,
        },
        IBV_WR_SEND_WITH_INV => SendOp::Send {
            solicited,
            invalidate: Some(inv),
        },
        IBV_WR_SEND_WITH_IMM => {
            // iWARP's Immediate Data (RFC 7306 §6) is a message of its own
            // with no payload; a Send with both has no wire form.
            if sges.iter().any(|s| s.length > 0) {
                tracing::warn!("stag0: IBV_WR_SEND_WITH_IMM with a payload has no iWARP form (RFC 7306 Immediate Data carries no data); post a Send and a zero-length Send with Immediate");
                return Err(libc::EINVAL);
            }
            return Ok(PendingWr {
                wr_id: wr.wr_id,
                flags: wr.send_flags,
                op: SendOp::Imm { imm, solicited },
                sges: SgeList::new(),
                inline: None,
            });
        }
        IBV_WR_RDMA_WRITE => SendOp::Write {
            remote: Remote {
                addr: rdma.remote_addr,
                rkey: rdma.rkey,
            },
        },
        IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::WriteImm {
            remote: Remote {
                addr: rdma.remote_addr,
                rkey: rdma.rkey,
            },
            imm,
        },
        IBV_WR_RDMA_READ => SendOp::Read {
            remote: Remote {
                addr: rdma.remote_addr,
                rkey: rdma.rkey,
            },
        },
        IBV_WR_ATOMIC_CMP_AND_SWP => SendOp::CmpSwap {
            remote: Remote {
                addr: atomic.remote_addr,
                rkey: atomic.rkey,
            },
            compare: atomic.compare_add,
            compare_mask: u64::MAX,
            swap: atomic.swap,
            swap_mask: u64::MAX,
        },
        IBV_WR_ATOMIC_FETCH_AND_ADD => SendOp::FetchAdd {
            remote: Remote {
                addr: atomic.remote_addr,
                rkey: atomic.rkey,
            },
            add: atomic.compare_add,
            mask: 0,
        },
        other => {
            tracing::warn!("stag0: ibv_post_send opcode {other} is not supported on stag0");
            return Err(libc::EINVAL);
        }
    };
    Ok(PendingWr {
        wr_id: wr.wr_id,
        flags: wr.send_flags,
        op,
        sges,
        inline: None,
    })
}

fn posting_allowed(sh: &QpShared) -> Result<(), c_int> {
    match sh.state() {
        IBV_QPS_RESET | IBV_QPS_INIT | IBV_QPS_RTR => Err(libc::ENOTCONN),
        _ => Ok(()),
    }
}

pub(crate) unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    guard("post_send", libc::EIO, || {
        // SAFETY: libibverbs passes a qp of this context.
        let Some(sh) = unsafe { from_raw::<StagQp>(qp) }.map(StagQp::shared) else {
            return libc::EINVAL;
        };
        // The chain's WRs (those before a failing one) leave together.
        let mut post = sh.prov.start_post();
        // SAFETY: the caller's chain and out pointer.
        let rc = unsafe {
            post_chain(wr, bad, |w| {
                posting_allowed(sh)
                    .and_then(|()| translate(w))
                    .and_then(|p| post_one(sh, &mut post, p))
            })
        };
        post.post();
        rc
    })
}

pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    guard("post_recv", libc::EIO, || {
        // SAFETY: libibverbs passes a qp of this context.
        let Some(sh) = unsafe { from_raw::<StagQp>(qp) }.map(StagQp::shared) else {
            return libc::EINVAL;
        };
        // SAFETY: the caller's chain, its SGE arrays and out pointer.
        unsafe {
            post_chain(wr, bad, |w| {
                if sh.has_srq || sh.state() == IBV_QPS_RESET {
                    return Err(libc::EINVAL);
                }
                let sg_list = sge_list(w.sg_list, w.num_sge)?;
                sh.prov
                    .post_recv_ref(w.wr_id, &sg_list)
                    .map_err(|e| errno::of_device(&e))
            })
        }
    })
}

impl HasBatch for StagQp {
    type Batch = QpShared;
    fn batch(&self) -> &QpShared {
        &self.shared
    }
}

impl WrBatch for QpShared {
    fn batch_start(&self) {
        let mut b = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        b.wrs.clear();
        b.error = None;
    }

    /// A `wr_<op>` call: a new request, with the QP's current wr_id/flags.
    fn batch_push(&self, wr_id: u64, flags: c_uint, op: SendOp, op_flag: u64) {
        let mut b = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        if self.send_ops & op_flag == 0 {
            tracing::warn!("stag0: ibv_wr_* operation not enabled in send_ops_flags");
            b.error.get_or_insert(libc::EINVAL);
            return;
        }
        b.wrs.push(PendingWr {
            wr_id,
            flags,
            op,
            sges: SgeList::new(),
            inline: None,
        });
    }

    /// `wr_set_sge*` / `wr_set_inline_data*` on the last request.
    fn batch_set_data(&self, sges: SgeList, inline: Option<Vec<u8>>) {
        let mut b = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        match b.wrs.last_mut() {
            Some(w) => {
                w.sges = sges;
                w.inline = inline;
            }
            None => {
                b.error.get_or_insert(libc::EINVAL);
            }
        }
    }

    /// Record an error for `wr_complete` to return.
    fn batch_fail(&self, e: c_int) {
        let mut b = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        b.error.get_or_insert(e);
    }

    /// `wr_complete`: post the batch, or nothing if a call failed.
    fn batch_complete(&self) -> c_int {
        let (wrs, error) = {
            let mut b = self.batch.lock().unwrap_or_else(|p| p.into_inner());
            (std::mem::take(&mut b.wrs), b.error.take())
        };
        if let Some(e) = error {
            return e;
        }
        if let Err(e) = posting_allowed(self) {
            return e;
        }
        let mut post = self.prov.start_post();
        let rc = wrs
            .into_iter()
            .try_for_each(|w| post_one(self, &mut post, w));
        post.post();
        rc.err().unwrap_or(0)
    }

    /// `wr_abort`: drop the batch.
    fn batch_abort(&self) {
        let mut b = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        b.wrs.clear();
        b.error = None;
    }
}

impl QpShared {
    /// Post a stagdv operation (RFC 7306 / Commit) through the legacy path.
    pub(crate) fn post_dv(&self, wr_id: u64, flags: c_uint, op: SendOp, sges: SgeList) -> c_int {
        if let Err(e) = posting_allowed(self) {
            return e;
        }
        let mut post = self.prov.start_post();
        let rc = post_one(
            self,
            &mut post,
            PendingWr {
                wr_id,
                flags,
                op,
                sges,
                inline: None,
            },
        );
        post.post();
        rc.err().unwrap_or(0)
    }
}
