//! Listening ids: a thread per id accepts TCP connections, reads their MPA
//! Requests and queues CONNECT_REQUEST events carrying them; the child id
//! is made when the application takes the event.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Weak};
use std::time::Duration;

use provider::device::{DeviceError, Listener};
use provider::wire::mpa::IRD_ORD_NO_NEGOTIATION;
use tracing::debug;

use super::addr::{local_ip_for, set_src, unmap};
use super::channel::{Incoming, Pending};
use super::conn::{errno_of, refuse};
use super::id::{Id, Op, Phase};
use super::CmResult;
use crate::ffi;

/// Threads accepting on one listening id. `Listener::accept` reads the
/// MPA Request before it returns, so one peer slow to send it would hold
/// up every connection behind it on a single thread.
const ACCEPTORS: usize = 4;

/// A running listener; dropping it stops the threads and closes the port.
#[derive(Debug)]
pub(crate) struct ListenHandle {
    stop: Arc<AtomicBool>,
    wake: SocketAddr,
    threads: usize,
    done: mpsc::Receiver<()>,
}

impl Drop for ListenHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // The threads sit in accept(2): a connection that closes at once
        // wakes one.
        for _ in 0..self.threads {
            let _ = TcpStream::connect_timeout(&self.wake, Duration::from_millis(500));
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        for _ in 0..self.threads {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if self.done.recv_timeout(left).is_err() {
                // One is still reading a slow peer's MPA Request; it stops
                // (and the port closes) when that ends.
                debug!(addr = %self.wake, "rdma_cm: a listener thread is still reading a peer");
                break;
            }
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
    let addr = match st.reservation.take() {
        // Give the port up to the listening socket (SO_REUSEADDR both).
        Some(r) => r.addr,
        None => st
            .src
            .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)),
    };
    let listener = Listener::bind(addr).map_err(|e| errno_of(&e))?;
    let local = listener.local_addr().map_err(|e| errno_of(&e))?;
    let wake = SocketAddr::new(
        match local.ip() {
            IpAddr::V4(a) if a.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(a) if a.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        },
        local.port(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let (done_tx, done) = mpsc::channel();
    let listener = Arc::new(listener);
    let mut handle = ListenHandle {
        stop: stop.clone(),
        wake,
        threads: 0,
        done,
    };
    for i in 0..ACCEPTORS {
        let (listener, weak, stop, done_tx) = (
            listener.clone(),
            Arc::downgrade(id),
            stop.clone(),
            done_tx.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name(format!("stag-cm-listen-{}-{i}", local.port()))
            .spawn(move || {
                run(&listener, local, &weak, &stop);
                drop(listener);
                let _ = done_tx.send(());
            });
        match spawned {
            Ok(_) => handle.threads += 1,
            Err(_) if handle.threads > 0 => break,
            Err(_) => return Err(libc::EAGAIN),
        }
    }
    debug!(%local, threads = handle.threads, "rdma_cm: listening");
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
            Err(DeviceError::Io(e)) if is_transient(&e) => {
                debug!(error = %e, "rdma_cm: accept failed; retrying");
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => {
                // A peer that closed, timed out or spoke no MPA: its
                // business, not the listener's.
                debug!(error = %e, "rdma_cm: incoming connection dropped before its MPA Request");
                continue;
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

fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM | libc::EINTR)
    )
}
