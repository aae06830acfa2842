//! Acting on a connected QP's rdma_cm events: a peer that disconnects or
//! dies moves the QP to Error.
//!
//! An iWARP QP (siw, stag0) learns of a gone peer from its TCP
//! connection and flushes its work at once. An IB/RoCE QP (rxe, RNICs)
//! hears of it only from rdma_cm (the peer's DREQ, or the kernel's
//! clean-up when the peer process dies): without acting on that event,
//! receives posted on an idle QP would wait forever, and only work in
//! flight would fail, after its transport retries. So each connection's
//! event channel (its own after `finish`) is watched by a thread that
//! moves the QP to Error on a terminal event, as `ibv_modify_qp` to ERR
//! does for the application: outstanding work completes with flush
//! errors.

use std::os::fd::AsFd;
use std::sync::{Arc, Weak};
use std::thread::{JoinHandle, ThreadId};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::debug;

use super::IbvQp;
use crate::error::Result;
use crate::ibv::{CmEventType, EventChannel};

/// The watching thread of one connection; stopped and joined on drop.
#[derive(Debug)]
pub(super) struct CmWatch {
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    thread_id: ThreadId,
}

/// Whether `kind`, on an established connection, means the connection is
/// over.
fn is_terminal(kind: CmEventType) -> bool {
    matches!(
        kind,
        CmEventType::Disconnected
            | CmEventType::DeviceRemoval
            | CmEventType::ConnectError
            | CmEventType::Unreachable
            | CmEventType::Rejected
            | CmEventType::TimewaitExit
    )
}

impl CmWatch {
    /// Watch `channel` (the connection's own) for `qp`.
    pub(super) fn start(channel: Arc<EventChannel>, qp: Weak<IbvQp>) -> Result<CmWatch> {
        let stop = Arc::new(
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(std::io::Error::from)?,
        );
        let thread_stop = stop.clone();
        let thread = std::thread::Builder::new()
            .name("stag-cm-watch".into())
            .spawn(move || watch(&channel, &thread_stop, &qp))?;
        Ok(CmWatch {
            stop,
            thread_id: thread.thread().id(),
            thread: Some(thread),
        })
    }
}

impl Drop for CmWatch {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        // The watcher itself may hold the last reference to the QP (for a
        // moment, while it moves it to Error): it cannot join itself.
        if std::thread::current().id() == self.thread_id {
            return;
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: wait for an event or the stop signal; on a terminal event
/// move the QP to Error (once), then keep reading (and acking) events
/// until stopped, so that destroying the id never waits on an unacked one.
fn watch(channel: &Arc<EventChannel>, stop: &EventFd, qp: &Weak<IbvQp>) {
    let mut failed = false;
    loop {
        let mut fds = [
            PollFd::new(channel.as_fd(), PollFlags::POLLIN),
            PollFd::new(stop.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                debug!(error = %e, "cm watch: poll failed, watch ends");
                return;
            }
        }
        let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
        if ready(&fds[1]) {
            return;
        }
        if !ready(&fds[0]) {
            continue;
        }
        let ev = match channel.get_event() {
            Ok(ev) => ev,
            Err(e) => {
                debug!(error = %e, "cm watch: no event, watch ends");
                return;
            }
        };
        if failed || !is_terminal(ev.kind) {
            continue;
        }
        failed = true;
        let Some(qp) = qp.upgrade() else { return };
        debug!(qp_num = qp.qp.qp_num(), kind = ?ev.kind, "peer gone: QP to Error");
        if let Err(e) = qp.qp.to_error() {
            debug!(error = %e, "cm watch: QP to Error failed");
        }
    }
}
