//! cm ids: the `struct rdma_cm_id` handed to C, the state behind it, the
//! registry that maps one to the other, and the state machine.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::raw::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use provider::device::{ConnRequest, QueuePair};

use super::addr::Reservation;
use super::listener::{Incoming, ListenHandle};
use super::{lock, CmResult};
use crate::ffi;

/// Where an id is in its life (the kernel's `enum rdma_cm_state`, cut to
/// what iWARP over TCP needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Created.
    Idle,
    /// `rdma_bind_addr` done.
    Bound,
    /// ADDR_RESOLVED queued.
    AddrResolved,
    /// ROUTE_RESOLVED queued.
    RouteResolved,
    /// `rdma_listen` done.
    Listening,
    /// A child id whose CONNECT_REQUEST awaits accept or reject.
    Requested,
    /// The MPA exchange runs (active side).
    Connecting,
    /// The stream is up.
    Connected,
    /// `rdma_disconnect` closed the stream; DISCONNECTED comes once it is
    /// down (as the kernel reports it when the TCP close completes).
    Disconnecting,
    /// Disconnected (either side); DISCONNECTED queued.
    Disconnected,
    /// Rejected, unreachable, or setup failed.
    Failed,
}

/// The operations the state machine judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Bind,
    ResolveAddr,
    ResolveRoute,
    Listen,
    Connect,
    Accept,
    Reject,
    Disconnect,
}

impl Phase {
    /// Whether `op` is allowed in this phase (EINVAL otherwise, as the
    /// kernel's rdma_cm answers).
    pub fn allows(self, op: Op) -> bool {
        use Phase::*;
        match op {
            Op::Bind => self == Idle,
            Op::ResolveAddr => matches!(self, Idle | Bound | AddrResolved),
            Op::ResolveRoute => matches!(self, AddrResolved | RouteResolved),
            Op::Listen => matches!(self, Idle | Bound | Listening),
            Op::Connect => self == RouteResolved,
            Op::Accept | Op::Reject => self == Requested,
            Op::Disconnect => matches!(self, Connecting | Connected | Disconnecting | Disconnected),
        }
    }
}

/// `rdma_set_option` values an id keeps.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Options {
    pub tos: Option<u8>,
    pub reuseaddr: bool,
    pub afonly: bool,
    pub ack_timeout: Option<u8>,
}

/// An event waiting in a channel (not yet handed to the application).
#[derive(Debug)]
pub(crate) struct Pending {
    /// The id it is for (the listening id for CONNECT_REQUEST).
    pub id: Arc<Id>,
    /// `enum rdma_cm_event_type`.
    pub kind: ffi::rdma_cm_event_type,
    /// 0 or a negative errno, as the kernel reports.
    pub status: c_int,
    /// The peer's private data.
    pub private_data: Vec<u8>,
    /// `param.conn.responder_resources`.
    pub responder_resources: u8,
    /// `param.conn.initiator_depth`.
    pub initiator_depth: u8,
    /// CONNECT_REQUEST only.
    pub incoming: Option<Incoming>,
}

impl Pending {
    /// An event with no connection parameters.
    pub fn new(id: Arc<Id>, kind: ffi::rdma_cm_event_type, status: c_int) -> Pending {
        Pending {
            id,
            kind,
            status,
            private_data: Vec::new(),
            responder_resources: 0,
            initiator_depth: 0,
            incoming: None,
        }
    }
}

/// Where an id's events go: its event channel (`channel::Channel`, which
/// names ids; ids name only this).
pub(crate) trait EventQueue: Send + Sync + std::fmt::Debug {
    /// The C struct.
    fn raw(&self) -> *mut ffi::rdma_event_channel;
    /// Queue an event and wake the channel's readers.
    fn push(&self, p: Pending);
    /// Take the next event (see `Channel::pop`).
    fn pop(&self) -> CmResult<Pending>;
    /// Withdraw the queued events `f` selects, returning them.
    fn withdraw(&self, f: &mut dyn FnMut(&Pending) -> bool) -> Vec<Pending>;
    /// Whether an event for `id` is queued.
    fn has_event_for(&self, id: &Arc<Id>) -> bool;
}

/// The mutable state of an id.
#[derive(Debug)]
pub(crate) struct IdState {
    /// Where its events go.
    pub channel: Arc<dyn EventQueue>,
    /// Synchronous id (created with a NULL channel): its channel is
    /// private and the calls wait for their own events.
    pub sync: bool,
    pub ps: ffi::rdma_port_space,
    pub qp_type: ffi::ibv_qp_type,
    pub phase: Phase,
    /// Our address (bound or resolved).
    pub src: Option<SocketAddr>,
    /// The peer's address.
    pub dst: Option<SocketAddr>,
    /// The bound TCP port, held until `rdma_listen` listens on it.
    pub reservation: Option<Reservation>,
    pub listener: Option<ListenHandle>,
    /// Child id: the connection waiting for accept/reject.
    pub request: Option<ConnRequest>,
    /// The peer's IRD/ORD from its MPA Request (child id).
    pub peer_ird: u8,
    pub peer_ord: u8,
    /// The connection's QP, held weakly: `ibv_destroy_qp` closes it.
    pub qp: Option<Weak<QueuePair>>,
    /// The `ibv_qp` whose state the cm mirrors (`id->qp` when the
    /// connection was made or accepted; none for a QP the application
    /// named by `conn_param->qp_num` and moves itself), held weakly. Event
    /// delivery runs on whichever thread takes the event, maybe while the
    /// application destroys `id->qp` on another, so it goes through this
    /// and never through `id->qp`.
    pub mirror: Option<super::WeakQpHandle>,
    /// `rdma_create_ep` on a passive endpoint: the QP attributes for the
    /// ids `rdma_get_request` returns.
    pub qp_init_attr: Option<EpAttr>,
    /// `rdma_addrinfo.ai_connect`: private data for `rdma_connect`.
    pub connect_data: Vec<u8>,
    pub options: Options,
    /// `rdma_set_local_ece` (vendor id, options).
    pub local_ece: (u32, u32),
    /// `rdma_destroy_id` was called: no further events.
    pub destroyed: bool,
}

/// QP attributes kept by a passive endpoint (`rdma_create_ep`).
#[derive(Clone, Copy)]
pub(crate) struct EpAttr(pub ffi::ibv_qp_init_attr);

// SAFETY: the pointers inside (CQs, SRQ, context) are the application's
// libibverbs objects, only passed back to libibverbs on its own thread.
unsafe impl Send for EpAttr {}

impl std::fmt::Debug for EpAttr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpAttr")
            .field("qp_type", &self.0.qp_type)
            .finish_non_exhaustive()
    }
}

/// The C struct, owned by its [`Id`].
#[derive(Debug)]
struct RawId(NonNull<ffi::rdma_cm_id>);

// SAFETY: the struct is written only on application threads inside cm
// calls (see the module docs of `cm`); other threads only carry the
// pointer.
unsafe impl Send for RawId {}
// SAFETY: as above.
unsafe impl Sync for RawId {}

/// A cm id.
#[derive(Debug)]
pub(crate) struct Id {
    raw: RawId,
    st: Mutex<IdState>,
}

static IDS: Mutex<Option<HashMap<usize, Arc<Id>>>> = Mutex::new(None);

impl Id {
    /// A new id on `channel` (registered).
    pub fn create(
        channel: Arc<dyn EventQueue>,
        sync: bool,
        context: *mut c_void,
        ps: ffi::rdma_port_space,
        qp_type: ffi::ibv_qp_type,
    ) -> Arc<Id> {
        let raw = Box::new(ffi::rdma_cm_id {
            channel: channel.raw(),
            context,
            ps,
            qp_type,
            ..Default::default()
        });
        let id = Arc::new(Id {
            // SAFETY: Box::into_raw is never NULL.
            raw: RawId(unsafe { NonNull::new_unchecked(Box::into_raw(raw)) }),
            st: Mutex::new(IdState {
                channel,
                sync,
                ps,
                qp_type,
                phase: Phase::Idle,
                src: None,
                dst: None,
                reservation: None,
                listener: None,
                request: None,
                peer_ird: 0,
                peer_ord: 0,
                qp: None,
                mirror: None,
                qp_init_attr: None,
                connect_data: Vec::new(),
                options: Options::default(),
                local_ece: (0, 0),
                destroyed: false,
            }),
        });
        lock(&IDS)
            .get_or_insert_with(HashMap::new)
            .insert(id.raw() as usize, id.clone());
        id
    }

    /// An unregistered id for unit tests.
    #[cfg(test)]
    pub fn new_for_test(channel: &Arc<super::channel::Channel>) -> Arc<Id> {
        let id = Id::create(
            channel.clone(),
            false,
            std::ptr::null_mut(),
            ffi::RDMA_PS_TCP,
            ffi::IBV_QPT_RC,
        );
        Id::unregister(id.raw());
        id
    }

    /// The id behind a C pointer handed to the application.
    pub fn lookup(ptr: *mut ffi::rdma_cm_id) -> CmResult<Arc<Id>> {
        if ptr.is_null() {
            return Err(libc::EINVAL);
        }
        lock(&IDS)
            .as_ref()
            .and_then(|m| m.get(&(ptr as usize)).cloned())
            .ok_or(libc::EINVAL)
    }

    /// Forget the id's C pointer (`rdma_destroy_id`).
    pub fn unregister(ptr: *mut ffi::rdma_cm_id) -> Option<Arc<Id>> {
        lock(&IDS).as_mut()?.remove(&(ptr as usize))
    }

    /// The C struct.
    pub fn raw(&self) -> *mut ffi::rdma_cm_id {
        self.raw.0.as_ptr()
    }

    /// The C struct, for an application thread inside a cm call.
    ///
    /// # Safety
    /// Only on the application's thread, inside a cm call on this id (the
    /// application does not write the struct meanwhile); no other
    /// reference to it is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn c(&self) -> &mut ffi::rdma_cm_id {
        // SAFETY: the Box lives as long as self; exclusivity per the
        // caller's contract.
        unsafe { &mut *self.raw.0.as_ptr() }
    }

    /// The state.
    pub fn state(&self) -> MutexGuard<'_, IdState> {
        lock(&self.st)
    }

    /// Queue an event on the id's channel unless it was destroyed (then
    /// the event comes back).
    #[must_use]
    pub fn push(self: &Arc<Self>, p: Pending) -> Option<Pending> {
        let st = self.state();
        if st.destroyed {
            return Some(p);
        }
        st.channel.push(p);
        None
    }
}

impl Drop for Id {
    fn drop(&mut self) {
        // SAFETY: allocated by Box in `create`, freed once, when the last
        // reference (registry, unacked event, queued event, thread) goes.
        drop(unsafe { Box::from_raw(self.raw.0.as_ptr()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cm::channel::Channel;

    #[test]
    fn active_side_walks_addr_route_connect() {
        let mut p = Phase::Idle;
        assert!(!p.allows(Op::Connect));
        assert!(p.allows(Op::ResolveAddr));
        p = Phase::AddrResolved;
        assert!(!p.allows(Op::Connect));
        assert!(p.allows(Op::ResolveRoute));
        p = Phase::RouteResolved;
        assert!(p.allows(Op::Connect));
        assert!(!p.allows(Op::Bind));
        assert!(!p.allows(Op::Accept));
    }

    #[test]
    fn passive_side_listens_then_children_accept_once() {
        assert!(Phase::Bound.allows(Op::Listen));
        assert!(Phase::Idle.allows(Op::Listen));
        assert!(!Phase::Listening.allows(Op::Accept));
        assert!(Phase::Requested.allows(Op::Accept));
        assert!(Phase::Requested.allows(Op::Reject));
        assert!(!Phase::Connected.allows(Op::Accept));
        assert!(!Phase::Failed.allows(Op::Reject));
    }

    #[test]
    fn disconnect_only_after_connecting() {
        assert!(!Phase::Idle.allows(Op::Disconnect));
        assert!(!Phase::Requested.allows(Op::Disconnect));
        assert!(Phase::Connected.allows(Op::Disconnect));
        assert!(Phase::Disconnected.allows(Op::Disconnect));
    }

    #[test]
    fn registry_maps_pointers_to_ids() {
        let ch = Channel::new().unwrap();
        let id = Id::create(
            ch.clone(),
            false,
            std::ptr::null_mut(),
            ffi::RDMA_PS_TCP,
            ffi::IBV_QPT_RC,
        );
        assert!(Arc::ptr_eq(&Id::lookup(id.raw()).unwrap(), &id));
        // SAFETY: test thread, no other user.
        let c = unsafe { id.c() };
        assert_eq!(c.channel, ch.raw());
        assert_eq!(c.ps, ffi::RDMA_PS_TCP);
        assert!(Id::unregister(id.raw()).is_some());
        assert_eq!(Id::lookup(id.raw()).unwrap_err(), libc::EINVAL);
    }
}
