//! Listening ids: a thread per id takes the connections whose MPA Request
//! the provider's listener has read whole and queues CONNECT_REQUEST events
//! carrying them; the child id is made when the application takes the
//! event.
//!
//! A listener on a port the application named is not closed at once when
//! its id goes: it is retired for [`HANDOVER_GRACE`](super::listener::HANDOVER_GRACE), holding what arrives,
//! and an id of this process that binds the same address meanwhile takes it
//! over with what it held. perftest (`-R`) needs this: its server destroys
//! the listener of its first connection, exchanges a message over that
//! connection, then binds the same port again, while its client connects as
//! soon as it has the message; a connect that came first was refused, and
//! Debian's perftest (4.5-0.17) cannot recover (its retry reuses the ids
//! and channel it just destroyed). What no id takes over is refused when
//! the grace ends (an MPA reject: REJECTED with -ECONNREFUSED, the status a
//! refused TCP connect gives), only later than the kernel would.

use std::any::Any;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use provider::device::{Listener, SETUP_TIMEOUT};
use provider::wire::mpa::IRD_ORD_NO_NEGOTIATION;
use tracing::debug;

use super::addr::{local_ip_for, set_src, unmap};
use super::id::{Id, Op, Pending, Phase};
use super::listener::{Incoming, ListenHandle, Target};
use super::{lock, CmResult};
use crate::ffi;
use provider::thread::SpawnMasked;

/// The listening id as a listener's [`Target`] holds it.
fn target_id(id: &Arc<Id>) -> std::sync::Weak<dyn Any + Send + Sync> {
    let any: Arc<dyn Any + Send + Sync> = id.clone();
    Arc::downgrade(&any)
}

/// `rdma_listen`.
pub(crate) fn listen(id: &Arc<Id>) -> CmResult<()> {
    let mut st = id.state();
    if !st.phase.allows(Op::Listen) {
        return Err(libc::EINVAL);
    }
    if st.phase == Phase::Listening {
        return Ok(());
    }
    let (listener, key) = match st.reservation.take() {
        // A destroyed id's listener on this address: deliver here what it
        // held and what comes.
        Some(mut r) if r.retired.is_some() => {
            let handle = r.retired.take().ok_or(libc::EINVAL)?;
            let (local, target) = (handle.local, handle.target.clone());
            debug!(%local, "rdma_cm: listening (taken over)");
            st.listener = Some(handle);
            st.src = Some(local);
            st.phase = Phase::Listening;
            drop(st);
            // SAFETY: application thread inside rdma_listen on `id`.
            set_src(unsafe { id.c() }, Some(&local));
            // The id's lock is released: the listener thread takes the
            // target's, then the id's.
            let mut t = lock(&target);
            t.id = target_id(id);
            let held = std::mem::take(&mut t.held);
            let back: Vec<_> = held
                .into_iter()
                .filter_map(|inc| deliver(id, inc))
                .collect();
            // Destroyed meanwhile: its teardown retires or closes the
            // listener, which holds these.
            t.held.extend(back);
            return Ok(());
        }
        // The bound socket listens since rdma_bind_addr (a shared port's
        // from now on): take it over with the connections queued meanwhile
        // and the options it was bound with.
        Some(r) => {
            let key = (r.addr.port() != 0 && r.named).then_some((r.addr, r.afonly));
            (Listener::adopt(r.into_listener()?, SETUP_TIMEOUT), key)
        }
        None => (
            Listener::bind(
                st.src
                    .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)),
            ),
            None,
        ),
    };
    let listener = listener.map_err(|e| crate::errno::of_cm(&e))?;
    let local = listener.local_addr().map_err(|e| crate::errno::of_cm(&e))?;
    let stop = Arc::new(AtomicBool::new(false));
    let (done_tx, done) = mpsc::channel();
    let listener = Arc::new(listener);
    let target = Arc::new(Mutex::new(Target {
        id: target_id(id),
        held: Vec::new(),
    }));
    // One thread suffices: the listener reads MPA Requests in the
    // background and hands over only whole ones, so no peer holds up
    // another.
    let spawned = {
        let (listener, target, stop) = (listener.clone(), target.clone(), stop.clone());
        std::thread::Builder::new()
            .name(format!("stag-cm-listen-{}", local.port()))
            .spawn_masked(move || {
                run(&listener, local, &target, &stop);
                drop(listener);
                let _ = done_tx.send(());
            })
    };
    if spawned.is_err() {
        return Err(libc::EAGAIN);
    }
    let handle = ListenHandle {
        stop,
        listener,
        done,
        target,
        local,
        key,
    };
    debug!(%local, "rdma_cm: listening");
    st.listener = Some(handle);
    st.src = Some(local);
    st.phase = Phase::Listening;
    drop(st);
    // SAFETY: application thread inside rdma_listen on `id`.
    set_src(unsafe { id.c() }, Some(&local));
    Ok(())
}

/// The IRD/ORD word of a request as the `u8`s rdma_cm reports.
fn clamp(v: u16) -> u8 {
    if v == IRD_ORD_NO_NEGOTIATION {
        u8::MAX
    } else {
        v.min(u8::MAX as u16) as u8
    }
}

fn run(listener: &Listener, local: SocketAddr, target: &Mutex<Target>, stop: &AtomicBool) {
    loop {
        let r = listener.accept();
        if stop.load(Ordering::Acquire) {
            return;
        }
        let req = match r {
            Ok(req) => req,
            Err(e) => {
                // Peers that close, time out or speak no MPA never reach
                // here; this is the listener's own end.
                debug!(error = %e, "rdma_cm: listener ended");
                return;
            }
        };
        let peer = unmap(req.peer_addr());
        let local_ip = if local.ip().is_unspecified() {
            local_ip_for(peer.ip()).unwrap_or(local.ip())
        } else {
            local.ip()
        };
        let local = unmap(SocketAddr::new(local_ip, local.port()));
        let inc = Incoming { req, local };
        let mut t = lock(target);
        match t.id.upgrade().and_then(|a| a.downcast::<Id>().ok()) {
            Some(id) => {
                if let Some(inc) = deliver(&id, inc) {
                    // Its id is being destroyed: the listener is retired
                    // or closed, and either decides.
                    t.held.push(inc);
                }
            }
            None => t.held.push(inc),
        }
    }
}

/// Queue a CONNECT_REQUEST for `inc` on `id`; the request back if the id
/// was destroyed.
fn deliver(id: &Arc<Id>, inc: Incoming) -> Option<Incoming> {
    let r = inc.req.request();
    let (ird, ord) = match r.ird_ord {
        Some(w) => (clamp(w.ird), clamp(w.ord)),
        None => (u8::MAX, u8::MAX),
    };
    let peer = unmap(inc.req.peer_addr());
    debug!(%peer, local = %inc.local, ird, ord, len = r.private_data.len(), "rdma_cm: connect request");
    let mut p = Pending::new(id.clone(), ffi::RDMA_CM_EVENT_CONNECT_REQUEST, 0);
    p.private_data = r.private_data.clone();
    // The peer's ORD is what we must answer (our responder resources), its
    // IRD what we may ask of it.
    p.responder_resources = ord;
    p.initiator_depth = ird;
    p.incoming = Some(inc);
    id.push(p).and_then(|p| p.incoming)
}
