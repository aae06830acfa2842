//! librdmacm: event channel, `rdma_create_id`, bind/listen/accept with
//! private data, `rdma_resolve_addr`/`rdma_resolve_route`, `rdma_connect`,
//! QP creation on the id (`rdma_create_qp_ex`), `rdma_disconnect`.

use super::cq::CompletionQueue;
use super::device::Context;
use super::pd::ProtectionDomain;
use super::qp::{QpInitAttr, QueuePair, Via};
use super::srq::SharedReceiveQueue;
use super::{check_errno, IbvError, Result};
use rdma_sys_ext as ffi;
use std::any::Any;
use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};
use std::sync::{Arc, OnceLock};

/// `struct rdma_event_channel`.
pub struct EventChannel {
    ch: *mut ffi::rdma_event_channel,
}

impl std::fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventChannel")
            .field("ch", &self.ch)
            .finish()
    }
}

// SAFETY: librdmacm event channels may be used from any thread; the
// handle is immutable.
unsafe impl Send for EventChannel {}
// SAFETY: as above.
unsafe impl Sync for EventChannel {}

/// `enum rdma_cm_event_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmEventType {
    /// `RDMA_CM_EVENT_ADDR_RESOLVED`
    AddrResolved,
    /// `RDMA_CM_EVENT_ADDR_ERROR`
    AddrError,
    /// `RDMA_CM_EVENT_ROUTE_RESOLVED`
    RouteResolved,
    /// `RDMA_CM_EVENT_ROUTE_ERROR`
    RouteError,
    /// `RDMA_CM_EVENT_CONNECT_REQUEST`
    ConnectRequest,
    /// `RDMA_CM_EVENT_CONNECT_RESPONSE`
    ConnectResponse,
    /// `RDMA_CM_EVENT_CONNECT_ERROR`
    ConnectError,
    /// `RDMA_CM_EVENT_UNREACHABLE`
    Unreachable,
    /// `RDMA_CM_EVENT_REJECTED`
    Rejected,
    /// `RDMA_CM_EVENT_ESTABLISHED`
    Established,
    /// `RDMA_CM_EVENT_DISCONNECTED`
    Disconnected,
    /// `RDMA_CM_EVENT_DEVICE_REMOVAL`
    DeviceRemoval,
    /// `RDMA_CM_EVENT_TIMEWAIT_EXIT`
    TimewaitExit,
    /// Any other value.
    Other(u32),
}

impl CmEventType {
    fn from_raw(v: u32) -> Self {
        use CmEventType::*;
        match v {
            ffi::RDMA_CM_EVENT_ADDR_RESOLVED => AddrResolved,
            ffi::RDMA_CM_EVENT_ADDR_ERROR => AddrError,
            ffi::RDMA_CM_EVENT_ROUTE_RESOLVED => RouteResolved,
            ffi::RDMA_CM_EVENT_ROUTE_ERROR => RouteError,
            ffi::RDMA_CM_EVENT_CONNECT_REQUEST => ConnectRequest,
            ffi::RDMA_CM_EVENT_CONNECT_RESPONSE => ConnectResponse,
            ffi::RDMA_CM_EVENT_CONNECT_ERROR => ConnectError,
            ffi::RDMA_CM_EVENT_UNREACHABLE => Unreachable,
            ffi::RDMA_CM_EVENT_REJECTED => Rejected,
            ffi::RDMA_CM_EVENT_ESTABLISHED => Established,
            ffi::RDMA_CM_EVENT_DISCONNECTED => Disconnected,
            ffi::RDMA_CM_EVENT_DEVICE_REMOVAL => DeviceRemoval,
            ffi::RDMA_CM_EVENT_TIMEWAIT_EXIT => TimewaitExit,
            o => Other(o),
        }
    }
}

/// A CM event, copied out of `struct rdma_cm_event` and already acked.
#[derive(Debug)]
pub struct CmEvent {
    /// `event`.
    pub kind: CmEventType,
    /// `status` (errno-like for error events; reject reason for REJECTED).
    pub status: i32,
    /// `param.conn.private_data` (copied).
    pub private_data: Vec<u8>,
    /// `param.conn.responder_resources`.
    pub responder_resources: u8,
    /// `param.conn.initiator_depth`.
    pub initiator_depth: u8,
    /// For [`CmEventType::ConnectRequest`]: the new id for this connection.
    pub new_id: Option<CmId>,
    id: *mut ffi::rdma_cm_id,
}

impl CmEvent {
    /// Whether this event is for `id` (the listener, for connect requests).
    pub fn is_for(&self, id: &CmId) -> bool {
        self.id == id.inner.id
    }
}

impl EventChannel {
    /// `rdma_create_event_channel`.
    pub fn new() -> Result<Arc<EventChannel>> {
        // SAFETY: no preconditions.
        let ch = unsafe { ffi::rdma_create_event_channel() };
        if ch.is_null() {
            return Err(IbvError::last("rdma_create_event_channel"));
        }
        Ok(Arc::new(EventChannel { ch }))
    }

    /// The channel fd (poll it for readability, then [`Self::get_event`]).
    pub fn fd(&self) -> i32 {
        // SAFETY: ch is live; fd is immutable.
        unsafe { (*self.ch).fd }
    }

    /// `rdma_get_cm_event` (blocking unless the fd is non-blocking), copy,
    /// `rdma_ack_cm_event`.
    pub fn get_event(self: &Arc<Self>) -> Result<CmEvent> {
        let mut ev: *mut ffi::rdma_cm_event = std::ptr::null_mut();
        // SAFETY: ch is live; ev is a valid out-pointer.
        let ret = unsafe { ffi::rdma_get_cm_event(self.ch, &mut ev) };
        check_errno("rdma_get_cm_event", ret)?;
        // SAFETY: ev is a live event until acked below; we copy everything
        // we need (private data included) before the ack.
        let out = unsafe {
            let e = &*ev;
            let kind = CmEventType::from_raw(e.event);
            let conn = e.param.conn;
            let private_data = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    conn.private_data_len.into(),
                )
                .to_vec()
            };
            let new_id = (kind == CmEventType::ConnectRequest)
                .then(|| CmId::from_raw(e.id, Arc::clone(self)));
            let id = if kind == CmEventType::ConnectRequest {
                e.listen_id
            } else {
                e.id
            };
            CmEvent {
                kind,
                status: e.status,
                private_data,
                responder_resources: conn.responder_resources,
                initiator_depth: conn.initiator_depth,
                new_id,
                id,
            }
        };
        // SAFETY: ev came from rdma_get_cm_event and is acked once; the new
        // id (if any) stays valid after the ack.
        unsafe { ffi::rdma_ack_cm_event(ev) };
        tracing::debug!(kind = ?out.kind, status = out.status, "cm event");
        Ok(out)
    }

    /// Gets the next event and checks it is `kind` with status 0; otherwise
    /// an error naming `rdma_get_cm_event` (`ECONNREFUSED` for REJECTED,
    /// the event's status if negative, else `EPROTO`).
    pub fn expect(self: &Arc<Self>, kind: CmEventType) -> Result<CmEvent> {
        let ev = self.get_event()?;
        if ev.kind == kind && ev.status == 0 {
            return Ok(ev);
        }
        tracing::warn!(expected = ?kind, got = ?ev.kind, status = ev.status, "unexpected cm event");
        let errno = match ev.kind {
            CmEventType::Rejected => libc::ECONNREFUSED,
            _ if ev.status < 0 => -ev.status,
            _ => libc::EPROTO,
        };
        Err(IbvError {
            call: "rdma_get_cm_event",
            errno,
        })
    }
}

impl std::os::fd::AsFd for EventChannel {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the channel's fd is open until rdma_destroy_event_channel
        // in drop, so for as long as `self` is borrowed.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd()) }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every CmId holds an Arc to this channel, so none remains.
        unsafe { ffi::rdma_destroy_event_channel(self.ch) };
    }
}

struct CmIdInner {
    id: *mut ffi::rdma_cm_id,
    channel: Arc<EventChannel>,
    verbs: OnceLock<Arc<Context>>,
}

// SAFETY: librdmacm calls on one id are serialised by the library where
// needed; the pointer itself is immutable.
unsafe impl Send for CmIdInner {}
// SAFETY: as above.
unsafe impl Sync for CmIdInner {}

impl Drop for CmIdInner {
    fn drop(&mut self) {
        // SAFETY: id came from rdma_create_id or a connect request; QPs and
        // borrowed contexts on it hold Arcs to self, so none remains; all
        // its events were acked in get_event.
        let ret = unsafe { ffi::rdma_destroy_id(self.id) };
        if ret != 0 {
            tracing::warn!(ret, "rdma_destroy_id failed");
        }
    }
}

/// Connection parameters (`struct rdma_conn_param`).
#[derive(Debug, Clone, Default)]
pub struct ConnParam {
    /// Private data (at most 56 bytes on connect, 196 on accept for IB;
    /// iWARP allows up to 512 minus headers).
    pub private_data: Vec<u8>,
    /// `responder_resources`: incoming RDMA READ/atomic depth.
    pub responder_resources: u8,
    /// `initiator_depth`: outgoing RDMA READ/atomic depth.
    pub initiator_depth: u8,
    /// `retry_count`.
    pub retry_count: u8,
    /// `rnr_retry_count` (7 = infinite).
    pub rnr_retry_count: u8,
}

impl ConnParam {
    fn raw(&self) -> Result<ffi::rdma_conn_param> {
        let len = u8::try_from(self.private_data.len())
            .map_err(|_| IbvError::invalid("rdma_conn_param"))?;
        Ok(ffi::rdma_conn_param {
            private_data: if len == 0 {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len: len,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            ..Default::default()
        })
    }
}

/// `struct rdma_cm_id` (RC, `RDMA_PS_TCP`), holding its event channel.
#[derive(Clone)]
pub struct CmId {
    inner: Arc<CmIdInner>,
}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmId").field("id", &self.inner.id).finish()
    }
}

/// A `sockaddr_in`/`sockaddr_in6` built from a `SocketAddr`.
enum RawAddr {
    V4(libc::sockaddr_in),
    V6(libc::sockaddr_in6),
}

impl RawAddr {
    fn new(a: SocketAddr) -> Self {
        match a {
            SocketAddr::V4(v4) => RawAddr::V4(libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            }),
            SocketAddr::V6(v6) => RawAddr::V6(libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            }),
        }
    }

    fn as_ptr(&mut self) -> *mut ffi::sockaddr {
        match self {
            RawAddr::V4(a) => (a as *mut libc::sockaddr_in).cast(),
            RawAddr::V6(a) => (a as *mut libc::sockaddr_in6).cast(),
        }
    }
}

fn sockaddr_to_std(sa: *const ffi::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: sa points at a sockaddr_storage-sized field of rdma_cm_id's
    // route.addr; the family tells which layout is valid.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let a = &*sa.cast::<libc::sockaddr_in>();
                Some(SocketAddr::V4(SocketAddrV4::new(
                    u32::from_be(a.sin_addr.s_addr).into(),
                    u16::from_be(a.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let a = &*sa.cast::<libc::sockaddr_in6>();
                Some(SocketAddr::V6(SocketAddrV6::new(
                    a.sin6_addr.s6_addr.into(),
                    u16::from_be(a.sin6_port),
                    a.sin6_flowinfo,
                    a.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

impl CmId {
    /// `rdma_create_id(channel, RDMA_PS_TCP)`.
    pub fn new(channel: &Arc<EventChannel>) -> Result<CmId> {
        let mut id: *mut ffi::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: channel is live; id is a valid out-pointer.
        let ret = unsafe {
            ffi::rdma_create_id(channel.ch, &mut id, std::ptr::null_mut(), ffi::RDMA_PS_TCP)
        };
        check_errno("rdma_create_id", ret)?;
        Ok(Self::from_raw(id, Arc::clone(channel)))
    }

    fn from_raw(id: *mut ffi::rdma_cm_id, channel: Arc<EventChannel>) -> CmId {
        CmId {
            inner: Arc::new(CmIdInner {
                id,
                channel,
                verbs: OnceLock::new(),
            }),
        }
    }

    /// The event channel.
    pub fn channel(&self) -> &Arc<EventChannel> {
        &self.inner.channel
    }

    /// `rdma_migrate_id`: move this id's events to `channel` (an id from a
    /// connect request reports on the listener's channel until then).
    /// Only an id nobody else holds can move.
    pub fn migrate(self, channel: &Arc<EventChannel>) -> Result<CmId> {
        let mut inner =
            Arc::try_unwrap(self.inner).map_err(|_| IbvError::invalid("rdma_migrate_id"))?;
        // SAFETY: both the id and the channel are live; librdmacm moves the
        // id's pending events with it.
        check_errno("rdma_migrate_id", unsafe {
            ffi::rdma_migrate_id(inner.id, channel.ch)
        })?;
        inner.channel = channel.clone();
        Ok(CmId {
            inner: Arc::new(inner),
        })
    }

    /// `rdma_bind_addr`.
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<()> {
        let mut a = RawAddr::new(addr);
        // SAFETY: id is live; a is a valid sockaddr for the call.
        check_errno("rdma_bind_addr", unsafe {
            ffi::rdma_bind_addr(self.inner.id, a.as_ptr())
        })
    }

    /// `rdma_listen`.
    pub fn listen(&self, backlog: i32) -> Result<()> {
        // SAFETY: id is live.
        check_errno("rdma_listen", unsafe {
            ffi::rdma_listen(self.inner.id, backlog)
        })
    }

    /// Local address (`rdma_get_local_addr`), e.g. the port after binding
    /// to port 0.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: id is live; returns a pointer into the id.
        sockaddr_to_std(unsafe { ffi::stag_rdma_get_local_addr(self.inner.id) })
    }

    /// Peer address (`rdma_get_peer_addr`).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: id is live; returns a pointer into the id.
        sockaddr_to_std(unsafe { ffi::stag_rdma_get_peer_addr(self.inner.id) })
    }

    /// `rdma_resolve_addr`; wait for [`CmEventType::AddrResolved`].
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout_ms: i32,
    ) -> Result<()> {
        let mut s = src.map(RawAddr::new);
        let mut d = RawAddr::new(dst);
        let sp = s.as_mut().map_or(std::ptr::null_mut(), RawAddr::as_ptr);
        // SAFETY: id is live; addresses are valid for the call (copied).
        let ret = unsafe { ffi::rdma_resolve_addr(self.inner.id, sp, d.as_ptr(), timeout_ms) };
        check_errno("rdma_resolve_addr", ret)
    }

    /// `rdma_resolve_route`; wait for [`CmEventType::RouteResolved`].
    pub fn resolve_route(&self, timeout_ms: i32) -> Result<()> {
        // SAFETY: id is live.
        check_errno("rdma_resolve_route", unsafe {
            ffi::rdma_resolve_route(self.inner.id, timeout_ms)
        })
    }

    /// The device context the id is bound to (after bind/resolve or on a
    /// connect-request id). Owned by librdmacm; kept alive by this id.
    pub fn context(&self) -> Result<Arc<Context>> {
        if let Some(c) = self.inner.verbs.get() {
            return Ok(Arc::clone(c));
        }
        // SAFETY: id is live; verbs is set once the id is bound to a device.
        let v = unsafe { (*self.inner.id).verbs };
        if v.is_null() {
            return Err(IbvError {
                call: "rdma_cm_id.verbs",
                errno: libc::ENODEV,
            });
        }
        let owner: Arc<dyn Any + Send + Sync> = self.inner.clone();
        // SAFETY: librdmacm keeps id->verbs open while the id exists, and
        // the context holds the id via `owner`.
        let ctx = unsafe { Context::borrowed(v, owner) };
        Ok(Arc::clone(self.inner.verbs.get_or_init(|| ctx)))
    }

    /// `rdma_create_qp_ex`: an RC QP on this id, moved through its states
    /// by librdmacm during connect/accept.
    pub fn create_qp(
        &self,
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        caps: &QpInitAttr,
    ) -> Result<QueuePair> {
        self.create_qp_with_srq(pd, send_cq, recv_cq, caps, None)
    }

    /// [`Self::create_qp`], the QP taking its receives from `srq` when
    /// given (`init_attr.srq`; `caps.max_recv_*` are then ignored).
    pub fn create_qp_with_srq(
        &self,
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        caps: &QpInitAttr,
        srq: Option<&Arc<SharedReceiveQueue>>,
    ) -> Result<QueuePair> {
        let ctx = self.context()?;
        if pd.context().as_raw() != ctx.as_raw() {
            return Err(IbvError::invalid("rdma_create_qp_ex"));
        }
        // SAFETY: id is live.
        if !unsafe { (*self.inner.id).qp }.is_null() {
            return Err(IbvError {
                call: "rdma_create_qp_ex",
                errno: libc::EEXIST,
            });
        }
        let keep: Arc<dyn Any + Send + Sync> = self.inner.clone();
        QueuePair::create_via(
            pd,
            send_cq,
            recv_cq,
            caps,
            srq,
            Via::Cm(self.inner.id, keep),
        )
    }

    /// `rdma_connect`; wait for [`CmEventType::Established`].
    pub fn connect(&self, param: &ConnParam) -> Result<()> {
        let mut p = param.raw()?;
        // SAFETY: id is live; p and its private data live for the call
        // (librdmacm copies them).
        check_errno("rdma_connect", unsafe {
            ffi::rdma_connect(self.inner.id, &mut p)
        })
    }

    /// `rdma_accept` on a connect-request id.
    pub fn accept(&self, param: &ConnParam) -> Result<()> {
        let mut p = param.raw()?;
        // SAFETY: as in connect.
        check_errno("rdma_accept", unsafe {
            ffi::rdma_accept(self.inner.id, &mut p)
        })
    }

    /// `rdma_reject` with optional private data.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        let len = u8::try_from(private_data.len()).map_err(|_| IbvError::invalid("rdma_reject"))?;
        // SAFETY: id is live; private data is copied during the call.
        let ret = unsafe { ffi::rdma_reject(self.inner.id, private_data.as_ptr().cast(), len) };
        check_errno("rdma_reject", ret)
    }

    /// `rdma_disconnect`; both sides then see [`CmEventType::Disconnected`].
    pub fn disconnect(&self) -> Result<()> {
        // SAFETY: id is live.
        check_errno("rdma_disconnect", unsafe {
            ffi::rdma_disconnect(self.inner.id)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_type_decode() {
        assert_eq!(
            CmEventType::from_raw(ffi::RDMA_CM_EVENT_ESTABLISHED),
            CmEventType::Established
        );
        assert_eq!(
            CmEventType::from_raw(ffi::RDMA_CM_EVENT_CONNECT_REQUEST),
            CmEventType::ConnectRequest
        );
        assert_eq!(CmEventType::from_raw(99), CmEventType::Other(99));
    }

    #[test]
    fn sockaddr_round_trip() {
        for a in ["192.0.2.7:4791", "[2001:db8::1]:18515"] {
            let sa: SocketAddr = a.parse().unwrap();
            let mut raw = RawAddr::new(sa);
            assert_eq!(sockaddr_to_std(raw.as_ptr()), Some(sa));
        }
    }

    #[test]
    fn conn_param_limits() {
        let p = ConnParam {
            private_data: vec![0; 300],
            ..Default::default()
        };
        assert_eq!(p.raw().err().map(|e| e.errno), Some(libc::EINVAL));
        let p = ConnParam {
            private_data: vec![1, 2, 3],
            ..Default::default()
        };
        assert_eq!(p.raw().unwrap().private_data_len, 3);
    }

    #[test]
    fn cm_without_devices() {
        // Event channels and ids need only the rdma_cm char device; without
        // it (no RDMA stack) creation fails with an errno, never a crash.
        match EventChannel::new() {
            Ok(ch) => {
                if let Ok(id) = CmId::new(&ch) {
                    // Unbound id: no device context.
                    assert_eq!(id.context().unwrap_err().errno, libc::ENODEV);
                }
            }
            Err(e) => assert!(e.errno > 0, "{e}"),
        }
    }
}
