//! `struct rdma_cm_event`s handed to the application: made from a
//! [`Pending`] on the application's thread (`rdma_get_cm_event`), owned
//! with their private data copy until `rdma_ack_cm_event`, and the
//! synchronous ids' wait for their own events (librdmacm's
//! `ucma_complete`).

use std::collections::HashSet;
use std::ffi::CStr;
use std::sync::{Arc, Mutex};

use super::id::{EventQueue, Id, Pending};
use super::listener::Incoming;
use super::{lock, CmResult};
use crate::ffi;

/// An event and what it owns; `ev` first, so the C pointer is the box's.
#[repr(C)]
struct EventBox {
    ev: ffi::rdma_cm_event,
    /// `ev.param.conn.private_data` points here.
    private: Vec<u8>,
    /// Keep `ev.id` (and `ev.listen_id`) valid until the ack, even past
    /// `rdma_destroy_id`.
    _id: Arc<Id>,
    _listen: Option<Arc<Id>>,
}

/// Events handed out and not acked yet.
static OUTSTANDING: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

/// What taking an event does to the connections (`conn.rs`, which calls
/// down into this module and hands itself in as `D`).
pub(crate) trait Delivery {
    /// A CONNECT_REQUEST taken: the child id of `incoming` on `listen`,
    /// or None (refused) when nobody can take it.
    fn make_child(
        listen: &Arc<Id>,
        incoming: Incoming,
        peer_ird: u8,
        peer_ord: u8,
    ) -> Option<Arc<Id>>;
    /// Any other event of `id` taken.
    fn on_deliver(id: &Arc<Id>, kind: ffi::rdma_cm_event_type);
}

/// Make the C event for `p`; None when it no longer has a receiver (its
/// id, or the listening id of a request, went away meanwhile).
fn deliver<D: Delivery>(p: Pending) -> Option<*mut ffi::rdma_cm_event> {
    let Pending {
        id,
        kind,
        status,
        private_data,
        responder_resources,
        initiator_depth,
        incoming,
    } = p;
    let (target, listen) = if kind == ffi::RDMA_CM_EVENT_CONNECT_REQUEST {
        let child = D::make_child(&id, incoming?, initiator_depth, responder_resources)?;
        (child, Some(id))
    } else {
        if id.state().destroyed {
            return None;
        }
        D::on_deliver(&id, kind);
        (id, None)
    };
    let mut b = Box::new(EventBox {
        ev: ffi::rdma_cm_event {
            id: target.raw(),
            listen_id: listen.as_ref().map_or(std::ptr::null_mut(), |l| l.raw()),
            event: kind,
            status,
            ..Default::default()
        },
        private: private_data,
        _id: target,
        _listen: listen,
    });
    let conn = ffi::rdma_conn_param {
        private_data: if b.private.is_empty() {
            std::ptr::null()
        } else {
            b.private.as_ptr().cast()
        },
        private_data_len: b.private.len().min(u8::MAX as usize) as u8,
        responder_resources,
        initiator_depth,
        ..Default::default()
    };
    b.ev.param.conn = conn;
    let ptr = Box::into_raw(b);
    lock(&OUTSTANDING)
        .get_or_insert_with(HashSet::new)
        .insert(ptr as usize);
    Some(ptr.cast())
}

/// `rdma_get_cm_event`: the next event of `channel` (blocking unless its
/// fd is non-blocking).
pub(crate) fn get_event<D: Delivery>(
    channel: &dyn EventQueue,
) -> CmResult<*mut ffi::rdma_cm_event> {
    loop {
        let p = channel.pop()?;
        if let Some(ev) = deliver::<D>(p) {
            return Ok(ev);
        }
    }
}

/// `rdma_ack_cm_event`.
pub(crate) fn ack(ev: *mut ffi::rdma_cm_event) -> CmResult<()> {
    if ev.is_null() {
        return Err(libc::EINVAL);
    }
    let known = lock(&OUTSTANDING)
        .as_mut()
        .is_some_and(|s| s.remove(&(ev as usize)));
    if !known {
        return Err(libc::EINVAL);
    }
    // SAFETY: `ev` was made by Box::into_raw in `deliver` (the registry
    // says so) and is freed once, here.
    drop(unsafe { Box::from_raw(ev as *mut EventBox) });
    Ok(())
}

/// librdmacm's `ucma_complete`: for a synchronous id, ack the event it
/// holds, wait for the next one and keep it in `id->event`; its status
/// becomes the call's errno.
pub(crate) fn complete<D: Delivery>(id: &Arc<Id>) -> CmResult<()> {
    let (sync, channel) = {
        let st = id.state();
        (st.sync, st.channel.clone())
    };
    if !sync {
        return Ok(());
    }
    ack_held(id);
    let ev = get_event::<D>(&*channel)?;
    // SAFETY: application thread inside a cm call on `id`.
    unsafe { id.c() }.event = ev;
    // SAFETY: `ev` is a live event we just made.
    let e = unsafe { &*ev };
    match e.status {
        0 => Ok(()),
        _ if e.event == ffi::RDMA_CM_EVENT_REJECTED => Err(libc::ECONNREFUSED),
        s => Err(s.abs()),
    }
}

/// Ack the event a synchronous id holds in `id->event`, if any.
pub(crate) fn ack_held(id: &Id) {
    // SAFETY: application thread inside a cm call on `id`.
    let c = unsafe { id.c() };
    if !c.event.is_null() {
        let _ = ack(c.event);
        c.event = std::ptr::null_mut();
    }
}

/// `rdma_event_str`.
pub(crate) fn event_str(kind: ffi::rdma_cm_event_type) -> &'static CStr {
    match kind {
        ffi::RDMA_CM_EVENT_ADDR_RESOLVED => c"RDMA_CM_EVENT_ADDR_RESOLVED",
        ffi::RDMA_CM_EVENT_ADDR_ERROR => c"RDMA_CM_EVENT_ADDR_ERROR",
        ffi::RDMA_CM_EVENT_ROUTE_RESOLVED => c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        ffi::RDMA_CM_EVENT_ROUTE_ERROR => c"RDMA_CM_EVENT_ROUTE_ERROR",
        ffi::RDMA_CM_EVENT_CONNECT_REQUEST => c"RDMA_CM_EVENT_CONNECT_REQUEST",
        ffi::RDMA_CM_EVENT_CONNECT_RESPONSE => c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        ffi::RDMA_CM_EVENT_CONNECT_ERROR => c"RDMA_CM_EVENT_CONNECT_ERROR",
        ffi::RDMA_CM_EVENT_UNREACHABLE => c"RDMA_CM_EVENT_UNREACHABLE",
        ffi::RDMA_CM_EVENT_REJECTED => c"RDMA_CM_EVENT_REJECTED",
        ffi::RDMA_CM_EVENT_ESTABLISHED => c"RDMA_CM_EVENT_ESTABLISHED",
        ffi::RDMA_CM_EVENT_DISCONNECTED => c"RDMA_CM_EVENT_DISCONNECTED",
        ffi::RDMA_CM_EVENT_DEVICE_REMOVAL => c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        ffi::RDMA_CM_EVENT_MULTICAST_JOIN => c"RDMA_CM_EVENT_MULTICAST_JOIN",
        ffi::RDMA_CM_EVENT_MULTICAST_ERROR => c"RDMA_CM_EVENT_MULTICAST_ERROR",
        ffi::RDMA_CM_EVENT_ADDR_CHANGE => c"RDMA_CM_EVENT_ADDR_CHANGE",
        ffi::RDMA_CM_EVENT_TIMEWAIT_EXIT => c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
        _ => c"UNKNOWN EVENT",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cm::channel::Channel;
    use crate::cm::conn::ConnDelivery;

    #[test]
    fn events_own_private_data_until_acked() {
        let ch = Channel::new().unwrap();
        let id = Id::new_for_test(&ch);
        let mut p = Pending::new(id.clone(), ffi::RDMA_CM_EVENT_REJECTED, -libc::ECONNREFUSED);
        p.private_data = b"busy".to_vec();
        ch.push(p);
        let ev = get_event::<ConnDelivery>(&*ch).unwrap();
        // SAFETY: a live event.
        let e = unsafe { &*ev };
        assert_eq!(e.event, ffi::RDMA_CM_EVENT_REJECTED);
        assert_eq!(e.status, -libc::ECONNREFUSED);
        assert_eq!(e.id, id.raw());
        assert!(e.listen_id.is_null());
        // SAFETY: the conn member is the one written; private data valid
        // until the ack.
        let pd = unsafe {
            let c = e.param.conn;
            std::slice::from_raw_parts(c.private_data as *const u8, c.private_data_len as usize)
        };
        assert_eq!(pd, b"busy");
        ack(ev).unwrap();
        assert_eq!(ack(ev).unwrap_err(), libc::EINVAL);
        assert_eq!(ack(std::ptr::null_mut()).unwrap_err(), libc::EINVAL);
    }

    #[test]
    fn events_of_destroyed_ids_are_dropped() {
        let ch = Channel::new().unwrap();
        // SAFETY: fcntl on the channel's read end.
        unsafe {
            libc::fcntl(ch.fd(), libc::F_SETFL, libc::O_NONBLOCK);
        }
        let id = Id::new_for_test(&ch);
        ch.push(Pending::new(id.clone(), ffi::RDMA_CM_EVENT_ESTABLISHED, 0));
        id.state().destroyed = true;
        assert_eq!(get_event::<ConnDelivery>(&*ch).unwrap_err(), libc::EAGAIN);
    }

    #[test]
    fn names() {
        assert_eq!(
            event_str(ffi::RDMA_CM_EVENT_ESTABLISHED).to_str().unwrap(),
            "RDMA_CM_EVENT_ESTABLISHED"
        );
        assert_eq!(event_str(99).to_str().unwrap(), "UNKNOWN EVENT");
    }
}
