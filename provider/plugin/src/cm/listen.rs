//! Listening ids: a thread per id takes the connections whose MPA Request
//! the provider's listener has read whole and queues CONNECT_REQUEST events
//! carrying them; the child id is made when the application takes the
//! event.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Weak};
use std::time::Duration;

use provider::device::{Listener, SETUP_TIMEOUT};
use provider::wire::mpa::IRD_ORD_NO_NEGOTIATION;
use tracing::debug;

use super::addr::{local_ip_for, set_src, unmap};
use super::channel::{Incoming, Pending};
use super::conn::{errno_of, refuse};
use super::id::{Id, Op, Phase};
use super::CmResult;
use crate::ffi;
use provider::thread::SpawnMasked;

/// A running listener; dropping it stops its thread and closes the port.
#[derive(Debug)]
pub(crate) struct ListenHandle {
    stop: Arc<AtomicBool>,
    listener: Arc<Listener>,
    done: mpsc::Receiver<()>,
}

impl Drop for ListenHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // The port closes and the thread's accept returns.
        self.listener.shutdown();
        if self.done.recv_timeout(Duration::from_secs(2)).is_err() {
            debug!("rdma_cm: the listener thread did not stop within 2 s");
        }
    }
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
    let listener = match st.reservation.take() {
        // The bound socket listens since rdma_bind_addr (a shared port's
        // from now on): take it over with the connections queued meanwhile
        // and the options it was bound with.
        Some(r) => Listener::adopt(r.into_listener()?, SETUP_TIMEOUT),
        None => Listener::bind(
            st.src
                .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)),
        ),
    }
    .map_err(|e| errno_of(&e))?;
    let local = listener.local_addr().map_err(|e| errno_of(&e))?;
    let stop = Arc::new(AtomicBool::new(false));
    let (done_tx, done) = mpsc::channel();
    let listener = Arc::new(listener);
    // One thread suffices: the listener reads MPA Requests in the
    // background and hands over only whole ones, so no peer holds up
    // another.
    let spawned = {
        let (listener, weak, stop) = (listener.clone(), Arc::downgrade(id), stop.clone());
        std::thread::Builder::new()
            .name(format!("stag-cm-listen-{}", local.port()))
            .spawn_masked(move || {
                run(&listener, local, &weak, &stop);
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

fn run(listener: &Listener, local: SocketAddr, id: &Weak<Id>, stop: &AtomicBool) {
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
        let Some(id) = id.upgrade() else { return };
        let peer = unmap(req.peer_addr());
        let local_ip = if local.ip().is_unspecified() {
            local_ip_for(peer.ip()).unwrap_or(local.ip())
        } else {
            local.ip()
        };
        let local = unmap(SocketAddr::new(local_ip, local.port()));
        let r = req.request();
        let (ird, ord) = match r.ird_ord {
            Some(w) => (clamp(w.ird), clamp(w.ord)),
            None => (u8::MAX, u8::MAX),
        };
        debug!(%peer, %local, ird, ord, len = r.private_data.len(), "rdma_cm: connect request");
        let mut p = Pending::new(id.clone(), ffi::RDMA_CM_EVENT_CONNECT_REQUEST, 0);
        p.private_data = r.private_data.clone();
        // The peer's ORD is what we must answer (our responder
        // resources), its IRD what we may ask of it.
        p.responder_resources = ord;
        p.initiator_depth = ird;
        p.incoming = Some(Incoming { req, local });
        if let Some(p) = id.push(p) {
            if let Some(inc) = p.incoming {
                refuse(inc);
            }
            return;
        }
    }
}
