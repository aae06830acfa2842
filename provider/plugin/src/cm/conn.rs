//! Connections: `rdma_connect` (the MPA exchange runs on its own thread
//! and ends in ESTABLISHED, REJECTED, UNREACHABLE or CONNECT_ERROR),
//! child ids for connection requests, `rdma_accept`/`rdma_reject`,
//! `rdma_disconnect`, and the watcher that turns a stream that closed
//! (peer disconnect, peer gone, QP destroyed) into DISCONNECTED.

use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex, Once, Weak};
use std::time::Duration;

use provider::device::{DeviceError, QueuePair};
use provider::setup::MpaParams;
use tracing::{debug, error, warn};

use super::addr::{set_dst, set_src};
use super::channel::Channel;
use super::event::{self, Delivery};
use super::id::EventQueue;
use super::id::{Id, IdState, Op, Pending, Phase};
use super::listener::Incoming;
use super::verbs::{self, Stag};
use super::{lock, CmResult, StagQp};
use crate::ffi;
use crate::handle::from_raw;
use provider::thread::SpawnMasked;

/// How long the watcher sleeps at most between two looks at the connected
/// QPs. It is woken when a QP queues a connection event (the stream
/// closed, a Terminate) and at `rdma_disconnect`; this is the backstop for
/// a stream that died without one.
const WATCH_BACKSTOP: Duration = Duration::from_millis(200);

/// The event (and status) a failed connect ends in, as the kernel's
/// iWARP cm reports them.
fn failure_event(e: &DeviceError) -> (ffi::rdma_cm_event_type, i32) {
    let errno = crate::errno::of_cm(e);
    match errno {
        libc::ECONNREFUSED => (ffi::RDMA_CM_EVENT_REJECTED, -libc::ECONNREFUSED),
        libc::ETIMEDOUT | libc::EHOSTUNREACH | libc::ENETUNREACH => {
            (ffi::RDMA_CM_EVENT_UNREACHABLE, -errno)
        }
        _ => (ffi::RDMA_CM_EVENT_CONNECT_ERROR, -errno),
    }
}

/// The application's conn_param: IRD, ORD and private data, with
/// RDMA_MAX_RESP_RES / RDMA_MAX_INIT_DEPTH (255) meaning "the most the
/// peer and device allow".
fn mpa_params(
    param: Option<&ffi::rdma_conn_param>,
    stag: &Stag,
    peer: Option<(u8, u8)>,
    fallback_data: &[u8],
) -> MpaParams {
    // peer: (its IRD, its ORD) for a responder.
    let (peer_ird, peer_ord) = peer.unwrap_or((u8::MAX, u8::MAX));
    let default_ird = stag.max_ird.min(peer_ord);
    let default_ord = stag.max_ord.min(peer_ird);
    let (ird, ord, data) = match param {
        Some(p) => {
            let ird = if p.responder_resources == ffi::RDMA_MAX_RESP_RES as u8 {
                default_ird
            } else {
                p.responder_resources.min(stag.max_ird)
            };
            let ord = if p.initiator_depth == ffi::RDMA_MAX_INIT_DEPTH as u8 {
                default_ord
            } else {
                p.initiator_depth.min(stag.max_ord)
            };
            let data = if p.private_data.is_null() || p.private_data_len == 0 {
                fallback_data.to_vec()
            } else {
                // SAFETY: the application says `private_data` holds
                // `private_data_len` bytes.
                unsafe {
                    std::slice::from_raw_parts(
                        p.private_data as *const u8,
                        p.private_data_len as usize,
                    )
                }
                .to_vec()
            };
            (ird, ord, data)
        }
        None => (default_ird, default_ord, fallback_data.to_vec()),
    };
    MpaParams {
        ird: ird as u16,
        ord: ord as u16,
        private_data: data,
        ..MpaParams::default()
    }
}

/// The id's QP, when its stream is still the one the cm connected: the
/// provider QP behind `id->qp` and the one held weakly in the state.
fn live_qp(st: &IdState) -> Option<Arc<QueuePair>> {
    st.qp.as_ref().and_then(Weak::upgrade)
}

/// Mirror a state change into the `ibv_qp` the cm connected (`id->qp`
/// then), when its stream is still the one the cm connected. With the
/// id's lock held, on whichever thread takes the event.
///
/// Neither `id->qp` nor the `ibv_qp` is read here: the thread taking an
/// event is often not the one that owns the id (cmtime takes them on a
/// thread of its own while its main thread calls `rdma_disconnect` and
/// `rdma_destroy_qp`), so `id->qp` may be being freed meanwhile. Reading
/// it raced with that free: a `StagQp` whose last `Arc` was being dropped
/// was cloned back to life and dropped twice, which corrupted cmtime's
/// heap (1 run in 3 to 25 with 1024 connections). The id holds the QP's
/// shared part weakly instead ([`IdState::mirror`]), whose mirror into
/// `ibv_qp.state` is locked against `ibv_destroy_qp`.
fn mirror_state(st: &IdState, state: ffi::ibv_qp_state, set_error: bool) {
    let Some(qp) = live_qp(st) else { return };
    if st.phase == Phase::Connecting {
        if set_error {
            qp.set_error();
        }
        return;
    }
    if let Some(h) = st.mirror.as_ref().and_then(super::WeakQpHandle::upgrade) {
        if Arc::ptr_eq(h.provider(), &qp) {
            h.set_state(state);
        }
    }
    if set_error {
        qp.set_error();
    }
}

/// The connections' part in handing out events ([`Delivery`]).
pub(crate) struct ConnDelivery;

impl Delivery for ConnDelivery {
    fn make_child(
        listen: &Arc<Id>,
        incoming: Incoming,
        peer_ird: u8,
        peer_ord: u8,
    ) -> Option<Arc<Id>> {
        make_child(listen, incoming, peer_ird, peer_ord)
    }
    fn on_deliver(id: &Arc<Id>, kind: ffi::rdma_cm_event_type) {
        on_deliver(id, kind)
    }
}

/// `rdma_get_cm_event` on `channel`.
pub(crate) fn get_event(channel: &dyn EventQueue) -> CmResult<*mut ffi::rdma_cm_event> {
    event::get_event::<ConnDelivery>(channel)
}

/// A synchronous id's wait for its own event (librdmacm's
/// `ucma_complete`, [`event::complete`]).
pub(crate) fn complete(id: &Arc<Id>) -> CmResult<()> {
    event::complete::<ConnDelivery>(id)
}

/// Hook run when the application takes an event (its thread).
fn on_deliver(id: &Arc<Id>, kind: ffi::rdma_cm_event_type) {
    let st = id.state();
    match kind {
        ffi::RDMA_CM_EVENT_ESTABLISHED => mirror_state(&st, ffi::IBV_QPS_RTS, false),
        // librdmacm moves the QP to error on a rejection.
        ffi::RDMA_CM_EVENT_REJECTED
        | ffi::RDMA_CM_EVENT_UNREACHABLE
        | ffi::RDMA_CM_EVENT_CONNECT_ERROR => mirror_state(&st, ffi::IBV_QPS_ERR, true),
        ffi::RDMA_CM_EVENT_DISCONNECTED => {
            mirror_state(&st, ffi::IBV_QPS_ERR, false);
            if timewait_exit_wanted() && !st.sync {
                // Behind the DISCONNECTED the application is taking now,
                // so it always comes last; an id destroyed first never
                // gets it (its queued events are dropped).
                st.channel.push(Pending::new(
                    id.clone(),
                    ffi::RDMA_CM_EVENT_TIMEWAIT_EXIT,
                    0,
                ));
            }
        }
        _ => {}
    }
}

/// Whether the application asked for RDMA_CM_EVENT_TIMEWAIT_EXIT after
/// each DISCONNECTED (`STAG_CM_TIMEWAIT_EXIT=1`). The kernel's rdma_cm
/// raises it only on InfiniBand and RoCE (the IB CM's timewait state);
/// its iWARP cm, which kernel siw uses, never does, and neither does
/// stag0 by default: programs written against iWARP read events in a loop
/// and some take any event they did not expect as an error (qperf's
/// `cm_expect_event`) or report it on stderr (rping). Some written for IB
/// wait for it before freeing a connection: tgt's iSER transport holds a
/// reference to each connection until TIMEWAIT_EXIT, so without it a
/// session outlives its initiator and tgtd cannot be stopped cleanly.
fn timewait_exit_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var_os("STAG_CM_TIMEWAIT_EXIT").is_some_and(|v| v == "1"))
}

/// The child id of a connection request, made on the application's thread
/// when it takes the CONNECT_REQUEST event.
fn make_child(listen: &Arc<Id>, incoming: Incoming, peer_ird: u8, peer_ord: u8) -> Option<Arc<Id>> {
    let (sync, channel, ps, qp_type, options) = {
        let st = listen.state();
        if st.destroyed {
            incoming.refuse();
            return None;
        }
        (st.sync, st.channel.clone(), st.ps, st.qp_type, st.options)
    };
    let stag = match verbs::stag() {
        Ok(s) => s,
        Err(_) => {
            error!("rdma_cm: connection request refused: stag0 cannot be opened");
            incoming.refuse();
            return None;
        }
    };
    let channel = if sync {
        // A synchronous listener's children are synchronous too.
        match Channel::new() {
            Ok(c) => {
                c.register();
                c
            }
            Err(_) => {
                incoming.refuse();
                return None;
            }
        }
    } else {
        channel
    };
    // SAFETY: application thread inside rdma_get_cm_event; reading the
    // listening id's context pointer.
    let context = unsafe { listen.c() }.context;
    let child = Id::create(channel, sync, context, ps, qp_type);
    let peer = incoming.req.peer_addr();
    let peer = super::addr::unmap(peer);
    {
        // SAFETY: the child is new and only this thread knows it.
        let c = unsafe { child.c() };
        c.verbs = stag.ctx;
        c.pd = stag.pd;
        c.port_num = 1;
        set_src(c, Some(&incoming.local));
        set_dst(c, Some(&peer));
    }
    let mut st = child.state();
    st.phase = Phase::Requested;
    st.src = Some(incoming.local);
    st.dst = Some(peer);
    st.request = Some(incoming.req);
    st.peer_ird = peer_ird;
    st.peer_ord = peer_ord;
    st.options = options;
    drop(st);
    Some(child)
}

/// The QP a connect or accept is for.
struct CallQp {
    handle: super::QpHandle,
    /// It is `id->qp` (`rdma_create_qp`), whose state the cm moves; else
    /// the application made it and names it by `conn_param->qp_num`, and
    /// moves it through INIT/RTR/RTS itself, as with the kernel's cm.
    owned_by_id: bool,
}

/// The stag QP behind `id->qp`, or when that is NULL the one
/// `conn_param->qp_num` names; EINVAL (with why) if neither is one.
fn id_qp(id: &Id, call: &str, param: Option<&ffi::rdma_conn_param>) -> CmResult<CallQp> {
    // SAFETY: application thread inside a cm call on `id`.
    let qp = unsafe { id.c() }.qp;
    if !qp.is_null() {
        // SAFETY: id->qp is the application's QP; from_raw checks.
        return match unsafe { from_raw::<StagQp>(qp) } {
            Some(q) => Ok(CallQp {
                handle: q.handle(),
                owned_by_id: true,
            }),
            None => {
                error!(call, "rdma_cm: id->qp is not a stag0 QP");
                Err(libc::EINVAL)
            }
        };
    }
    let qpn = param.map(|p| p.qp_num);
    match qpn.and_then(crate::qp::by_num) {
        Some(handle) => Ok(CallQp {
            handle,
            owned_by_id: false,
        }),
        None => {
            error!(
                call,
                ?qpn,
                "rdma_cm: the id has no QP and conn_param->qp_num names no stag0 QP \
                 (create one with rdma_create_qp or ibv_create_qp)"
            );
            Err(libc::EINVAL)
        }
    }
}

/// `rdma_connect`.
pub(crate) fn connect(id: &Arc<Id>, param: Option<&ffi::rdma_conn_param>) -> CmResult<()> {
    if !id.state().phase.allows(Op::Connect) {
        return Err(libc::EINVAL);
    }
    let CallQp {
        handle: h,
        owned_by_id,
    } = id_qp(id, "rdma_connect", param)?;
    let stag = verbs::stag()?;
    let qp = h.provider().clone();
    let mut st = id.state();
    if !st.phase.allows(Op::Connect) {
        return Err(libc::EINVAL);
    }
    let dst: SocketAddr = st.dst.ok_or(libc::EINVAL)?;
    let params = mpa_params(param, &stag, None, &st.connect_data);
    st.connect_data.clear();
    st.phase = Phase::Connecting;
    st.qp = Some(Arc::downgrade(&qp));
    st.mirror = owned_by_id.then(|| h.downgrade());
    // A source port the application named is where the connection leaves
    // from (on the resolved source address); else the TCP connection
    // picks its own and the reservation goes.
    let from = match st
        .reservation
        .as_mut()
        .and_then(|r| r.release_for_connect())
    {
        Some(bound) => Some(match st.src {
            Some(s) if bound.ip().is_unspecified() => SocketAddr::new(s.ip(), bound.port()),
            _ => bound,
        }),
        None => {
            st.reservation = None;
            None
        }
    };
    drop(st);
    debug!(%dst, ?from, ird = params.ird, ord = params.ord, len = params.private_data.len(), "rdma_cm: connecting");
    let id2 = id.clone();
    let spawned = std::thread::Builder::new()
        .name("stag-cm-connect".into())
        .spawn_masked(move || {
            let r = match from {
                Some(src) => super::addr::dial_from(src, dst, provider::device::SETUP_TIMEOUT)
                    .map_err(DeviceError::from)
                    .and_then(|sock| qp.connect_stream(sock, &params)),
                None => qp.connect(dst, &params),
            };
            finish_connect(&id2, qp, r);
        });
    if spawned.is_err() {
        let mut st = id.state();
        st.phase = Phase::RouteResolved;
        st.qp = None;
        st.mirror = None;
        return Err(libc::EAGAIN);
    }
    drop(h);
    complete(id)
}

/// The connect thread's end: queue the outcome. The thread's reference
/// to the QP goes before the id's lock does, so that once the outcome is
/// visible only the application's `ibv_qp` keeps the QP alive (see
/// [`mirror_state`]).
fn finish_connect(id: &Arc<Id>, qp: Arc<QueuePair>, r: Result<Vec<u8>, DeviceError>) {
    let mut st = id.state();
    if st.destroyed || st.phase != Phase::Connecting {
        // Disconnected or destroyed meanwhile: nobody wants the stream.
        if r.is_ok() {
            qp.set_error();
        }
        drop(qp);
        return;
    }
    match r {
        Ok(private_data) => {
            let neg = qp.negotiated();
            debug!(?neg, "rdma_cm: connected");
            st.phase = Phase::Connected;
            let mut p = Pending::new(id.clone(), ffi::RDMA_CM_EVENT_ESTABLISHED, 0);
            p.private_data = private_data;
            if let Some(n) = neg {
                p.responder_resources = n.ird.min(u8::MAX as u16) as u8;
                p.initiator_depth = n.ord.min(u8::MAX as u16) as u8;
            }
            st.channel.push(p);
            drop(qp);
            drop(st);
            watch(id);
        }
        Err(e) => {
            let (kind, status) = failure_event(&e);
            debug!(error = %e, status, "rdma_cm: connect failed");
            st.phase = Phase::Failed;
            let mut p = Pending::new(id.clone(), kind, status);
            if let DeviceError::Rejected(pd) = e {
                p.private_data = pd;
            }
            st.channel.push(p);
            drop(qp);
        }
    }
}

/// `rdma_accept`.
pub(crate) fn accept(id: &Arc<Id>, param: Option<&ffi::rdma_conn_param>) -> CmResult<()> {
    if !id.state().phase.allows(Op::Accept) {
        return Err(libc::EINVAL);
    }
    let CallQp {
        handle: h,
        owned_by_id,
    } = id_qp(id, "rdma_accept", param)?;
    let stag = verbs::stag()?;
    let qp = h.provider().clone();
    let mut st = id.state();
    if !st.phase.allows(Op::Accept) {
        return Err(libc::EINVAL);
    }
    let req = st.request.take().ok_or(libc::EINVAL)?;
    let params = mpa_params(param, &stag, Some((st.peer_ird, st.peer_ord)), &[]);
    debug!(
        ird = params.ird,
        ord = params.ord,
        len = params.private_data.len(),
        "rdma_cm: accepting"
    );
    if let Err(e) = req.accept(&qp, &params) {
        warn!(error = %e, "rdma_cm: accept failed");
        st.phase = Phase::Failed;
        return Err(crate::errno::of_cm(&e));
    }
    st.phase = Phase::Connected;
    st.qp = Some(Arc::downgrade(&qp));
    st.mirror = owned_by_id.then(|| h.downgrade());
    if owned_by_id {
        h.set_state(ffi::IBV_QPS_RTS);
    }
    let mut p = Pending::new(id.clone(), ffi::RDMA_CM_EVENT_ESTABLISHED, 0);
    if let Some(n) = qp.negotiated() {
        p.responder_resources = n.ird.min(u8::MAX as u16) as u8;
        p.initiator_depth = n.ord.min(u8::MAX as u16) as u8;
    }
    st.channel.push(p);
    drop(st);
    drop(h);
    watch(id);
    complete(id)
}

/// `rdma_reject`.
pub(crate) fn reject(id: &Arc<Id>, private_data: &[u8]) -> CmResult<()> {
    let mut st = id.state();
    if !st.phase.allows(Op::Reject) {
        return Err(libc::EINVAL);
    }
    let req = st.request.take().ok_or(libc::EINVAL)?;
    st.phase = Phase::Failed;
    drop(st);
    req.reject(private_data)
        .map_err(|e| crate::errno::of_cm(&e))
}

/// `rdma_disconnect`.
pub(crate) fn disconnect(id: &Arc<Id>) -> CmResult<()> {
    let mut st = id.state();
    if !st.phase.allows(Op::Disconnect) {
        return Err(libc::EINVAL);
    }
    match st.phase {
        Phase::Connected => {
            // The watcher (woken here) reports DISCONNECTED: an
            // application's cm thread meets it after the call returns, as
            // with the kernel.
            st.phase = Phase::Disconnecting;
            mirror_state(&st, ffi::IBV_QPS_ERR, true);
            drop(st);
            poke_watcher();
            complete(id)
        }
        Phase::Connecting => {
            // The peer has not answered the MPA Request (it may never:
            // a listener that does not speak MPA, a stopped process). The
            // connect is abandoned and DISCONNECTED reported now: the
            // application asked for the end of a connection it does not
            // have, and waiting for the connect's own deadline
            // (SETUP_TIMEOUT, 10 s, as siw's MPA timeout) would tell it
            // nothing more. The connect thread finds the phase changed
            // when that deadline or the reply comes, and drops the stream
            // without an event.
            st.phase = Phase::Disconnected;
            if let Some(qp) = live_qp(&st) {
                qp.set_error();
            }
            st.channel
                .push(Pending::new(id.clone(), ffi::RDMA_CM_EVENT_DISCONNECTED, 0));
            drop(st);
            complete(id)
        }
        _ => {
            // Already disconnected (the peer's close was seen): the event
            // is queued or taken; a synchronous id takes it now.
            let pending = st.sync && st.channel.has_event_for(id);
            drop(st);
            if pending {
                complete(id)
            } else {
                Ok(())
            }
        }
    }
}

/// Tear-down of an id's connection side at `rdma_destroy_id`: a connected
/// QP goes to error (the kernel's iWARP cm does the same), an unanswered
/// request (the id's own, or queued for a listener) is refused with an MPA
/// reject, the listener stops.
pub(crate) fn teardown(id: &Arc<Id>) {
    let mut st = id.state();
    st.destroyed = true;
    if matches!(
        st.phase,
        Phase::Connected | Phase::Connecting | Phase::Disconnecting
    ) {
        mirror_state(&st, ffi::IBV_QPS_ERR, true);
    }
    let listener = st.listener.take();
    let request = st.request.take();
    st.reservation = None;
    st.qp = None;
    st.mirror = None;
    let channel = st.channel.clone();
    drop(st);
    if let Some(h) = listener {
        super::listener::retire(h);
    }
    if let Some(req) = request {
        // Destroyed without an answer: refused.
        if let Err(e) = req.reject(&[]) {
            debug!(error = %e, "rdma_cm: refusing a connection request failed");
        }
    }
    for p in channel.withdraw(&mut |p: &Pending| Arc::ptr_eq(&p.id, id)) {
        if let Some(inc) = p.incoming {
            inc.refuse();
        }
    }
}

// ---- the watcher ----

/// The ids the watcher follows, and whether it should look now.
struct WatchState {
    ids: Vec<Weak<Id>>,
    poked: bool,
}

static WATCH: Mutex<WatchState> = Mutex::new(WatchState {
    ids: Vec::new(),
    poked: false,
});
static WATCH_WAKE: Condvar = Condvar::new();
static WATCHER: Once = Once::new();

/// Make the watcher look at its ids now. Called by the RNIC with a QP's
/// lock held ([`QueuePair::set_event_hook`]): it only takes the watch
/// lock, which the watcher never holds while it looks at a QP.
pub(crate) fn poke_watcher() {
    lock(&WATCH).poked = true;
    WATCH_WAKE.notify_one();
}

/// Watch a connected id's QP until its stream closes.
fn watch(id: &Arc<Id>) {
    if let Some(qp) = live_qp(&id.state()) {
        qp.set_event_hook(poke_watcher);
    }
    {
        let mut w = lock(&WATCH);
        w.ids.push(Arc::downgrade(id));
        // The stream may have closed before the hook was in place.
        w.poked = true;
    }
    WATCH_WAKE.notify_one();
    WATCHER.call_once(|| {
        if let Err(e) = std::thread::Builder::new()
            .name("stag-cm-watch".into())
            .spawn_masked(watcher)
        {
            error!(error = %e, "rdma_cm: cannot start the disconnect watcher");
        }
    });
}

fn watcher() {
    loop {
        let list: Vec<Weak<Id>> = {
            let mut w = lock(&WATCH);
            while w.ids.is_empty() || !w.poked {
                if w.ids.is_empty() {
                    w = WATCH_WAKE.wait(w).unwrap_or_else(|p| p.into_inner());
                } else {
                    let (g, timeout) = WATCH_WAKE
                        .wait_timeout(w, WATCH_BACKSTOP)
                        .unwrap_or_else(|p| p.into_inner());
                    w = g;
                    if timeout.timed_out() {
                        break;
                    }
                }
            }
            w.poked = false;
            w.ids.clone()
        };
        let mut done: Vec<*const Id> = Vec::new();
        for w in &list {
            let Some(id) = w.upgrade() else {
                done.push(w.as_ptr());
                continue;
            };
            let mut st = id.state();
            if st.destroyed || !matches!(st.phase, Phase::Connected | Phase::Disconnecting) {
                done.push(w.as_ptr());
                continue;
            }
            let closed = match live_qp(&st) {
                None => true,
                // Messages read before the end may still wait for
                // Receives: the stream's end is what disconnects.
                Some(qp) => qp.stream_ended(),
            } || st.phase == Phase::Disconnecting;
            if closed {
                debug!("rdma_cm: stream closed; DISCONNECTED");
                st.phase = Phase::Disconnected;
                st.channel
                    .push(Pending::new(id.clone(), ffi::RDMA_CM_EVENT_DISCONNECTED, 0));
                done.push(w.as_ptr());
            }
        }
        if !done.is_empty() {
            lock(&WATCH).ids.retain(|w| !done.contains(&w.as_ptr()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two RNIC QPs of a fresh device, connected to each other over
    /// loopback; the device comes along to keep its engine.
    fn connected_pair(
        name: &str,
    ) -> (
        provider::device::Device,
        provider::device::QueuePair,
        provider::device::QueuePair,
    ) {
        use provider::cq::CompletionQueue;
        use provider::listener::Listener;
        use provider::qp::QpCaps;
        use provider::setup::MpaParams;

        let dev = provider::device::Device::open(name).unwrap();
        let pd = dev.alloc_pd();
        let cq = CompletionQueue::new(8).unwrap();
        let (a, b) = (
            pd.create_qp(QpCaps::default(), &cq, &cq, None),
            pd.create_qp(QpCaps::default(), &cq, &cq, None),
        );
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                let req = l.accept().unwrap();
                req.accept(&b, &MpaParams::default()).unwrap();
            });
            a.connect(addr, &MpaParams::default()).unwrap();
        });
        (dev, a, b)
    }

    /// The hook the watcher sleeps on fires when the peer closes the
    /// stream, from the RNIC's engine (no application thread polls), and
    /// the QP is in Error by then: the watcher's look finds it closed.
    #[test]
    fn a_closing_peer_fires_the_event_hook() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::time::Instant;

        use provider::qp::QpState;

        static FIRED: AtomicUsize = AtomicUsize::new(0);
        fn hook() {
            FIRED.fetch_add(1, Ordering::SeqCst);
        }
        let (_dev, a, b) = connected_pair("hook-test");
        assert!(b.set_event_hook(hook));
        assert!(!b.set_event_hook(hook), "one hook per QP");
        let before = FIRED.load(Ordering::SeqCst);
        assert_ne!(b.state(), QpState::Error);
        drop(a);
        let start = Instant::now();
        while FIRED.load(Ordering::SeqCst) == before {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "no event hook call after the peer closed"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        assert_eq!(b.state(), QpState::Error);
    }

    /// Taking an event never reads `id->qp`: the application may be
    /// freeing it on another thread (cmtime takes DISCONNECTED on its event
    /// thread while its main thread calls `rdma_destroy_qp`, which once
    /// corrupted its heap). Here `id->qp` points at a page that cannot be
    /// read, so a read kills the test, while the connected QP behind the
    /// id is alive, as it is up to the end of a concurrent destroy.
    #[test]
    fn taking_an_event_never_reads_id_qp() {
        use provider::qp::QpState;

        let (_dev, a, _b) = connected_pair("mirror-test");
        let a = Arc::new(a);

        // SAFETY: a fresh anonymous mapping that nothing may touch.
        let fence = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(fence, libc::MAP_FAILED);
        let channel = super::super::channel::Channel::new().unwrap();
        let id = Id::new_for_test(&channel);
        {
            let mut st = id.state();
            st.phase = Phase::Connected;
            st.qp = Some(Arc::downgrade(&a));
        }
        // SAFETY: the test's own id, on this thread only.
        unsafe { id.c() }.qp = fence.cast();
        on_deliver(&id, ffi::RDMA_CM_EVENT_ESTABLISHED);
        on_deliver(&id, ffi::RDMA_CM_EVENT_DISCONNECTED);
        // A rejection moves the RNIC's QP to Error without `id->qp`.
        on_deliver(&id, ffi::RDMA_CM_EVENT_REJECTED);
        assert_eq!(a.state(), QpState::Error);
        // SAFETY: the test's own id; the mapping is unmapped once.
        unsafe {
            id.c().qp = std::ptr::null_mut();
            libc::munmap(fence, 4096);
        }
    }

    fn stag() -> Stag {
        Stag {
            ctx: std::ptr::null_mut(),
            pd: std::ptr::null_mut(),
            max_ird: 16,
            max_ord: 8,
        }
    }

    #[test]
    fn conn_param_maps_to_ird_ord_and_private_data() {
        let data = *b"hello";
        let p = ffi::rdma_conn_param {
            private_data: data.as_ptr().cast(),
            private_data_len: 5,
            responder_resources: 4,
            initiator_depth: 200,
            ..Default::default()
        };
        let m = mpa_params(Some(&p), &stag(), None, b"ignored");
        assert_eq!((m.ird, m.ord), (4, 8));
        assert_eq!(m.private_data, b"hello");
        assert_eq!(m.revision, 2);
    }

    #[test]
    fn max_values_follow_peer_and_device() {
        let p = ffi::rdma_conn_param {
            responder_resources: ffi::RDMA_MAX_RESP_RES as u8,
            initiator_depth: ffi::RDMA_MAX_INIT_DEPTH as u8,
            ..Default::default()
        };
        // The peer (IRD 2, ORD 3) asks 3 reads of us and takes 2.
        let m = mpa_params(Some(&p), &stag(), Some((2, 3)), b"");
        assert_eq!((m.ird, m.ord), (3, 2));
        let m = mpa_params(None, &stag(), None, b"ep");
        assert_eq!((m.ird, m.ord), (16, 8));
        assert_eq!(m.private_data, b"ep");
    }

    #[test]
    fn failures_map_to_kernel_events() {
        let refused = DeviceError::Io(std::io::Error::from_raw_os_error(libc::ECONNREFUSED));
        assert_eq!(
            failure_event(&refused),
            (ffi::RDMA_CM_EVENT_REJECTED, -libc::ECONNREFUSED)
        );
        assert_eq!(
            failure_event(&DeviceError::Rejected(vec![1])),
            (ffi::RDMA_CM_EVENT_REJECTED, -libc::ECONNREFUSED)
        );
        assert_eq!(
            failure_event(&DeviceError::Timeout),
            (ffi::RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT)
        );
        assert_eq!(
            failure_event(&DeviceError::Mpa(provider::wire::Error::LlpClosed)),
            (ffi::RDMA_CM_EVENT_CONNECT_ERROR, -libc::ECONNRESET)
        );
    }
}
