//! Completion queues: a bounded FIFO of work completions that any number of
//! QPs feed, with an eventfd that is readable while completions are waiting
//! and notifications are armed (for epoll users, like a completion channel).

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::error;

use crate::device::QpShared;
use crate::wr::{WcStatus, WorkCompletion};

/// Notification arming (`ibv_req_notify_cq`).
const ARM_NONE: u8 = 0;
const ARM_ANY: u8 = 1;
const ARM_SOLICITED: u8 = 2;

/// A completion queue.
#[derive(Debug)]
pub struct CompletionQueue {
    queue: Mutex<VecDeque<WorkCompletion>>,
    ready: Condvar,
    capacity: usize,
    event_fd: EventFd,
    armed: AtomicU8,
    overrun: AtomicBool,
    /// QPs that feed this CQ, so that polling can drive them.
    qps: Mutex<Vec<Weak<QpShared>>>,
}

impl CompletionQueue {
    /// A CQ for at most `capacity` completions.
    pub fn new(capacity: usize) -> std::io::Result<Arc<CompletionQueue>> {
        let event_fd =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        Ok(Arc::new(CompletionQueue {
            queue: Mutex::new(VecDeque::with_capacity(capacity.min(65536))),
            ready: Condvar::new(),
            capacity,
            event_fd,
            armed: AtomicU8::new(ARM_NONE),
            overrun: AtomicBool::new(false),
            qps: Mutex::new(Vec::new()),
        }))
    }

    pub(crate) fn attach(&self, qp: Weak<QpShared>) {
        let mut qps = self.qps.lock().unwrap_or_else(|p| p.into_inner());
        qps.retain(|w| w.strong_count() > 0);
        qps.push(qp);
    }

    /// Queue a completion (called by the progress engine).
    pub(crate) fn push(&self, wc: WorkCompletion) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= self.capacity {
            // An overrun CQ is an error in verbs; keep the completion (losing
            // one would be worse) and report the overrun.
            if !self.overrun.swap(true, Ordering::Relaxed) {
                error!(capacity = self.capacity, "completion queue overrun");
            }
        }
        let solicited = wc.solicited || wc.status != WcStatus::Success;
        q.push_back(wc);
        drop(q);
        self.ready.notify_all();
        let arm = self.armed.load(Ordering::Acquire);
        if arm == ARM_ANY || (arm == ARM_SOLICITED && solicited) {
            self.armed.store(ARM_NONE, Ordering::Release);
            let _ = self.event_fd.write(1);
        }
    }

    /// Take up to `out.len()` completions without driving any QP.
    pub fn try_poll(&self, out: &mut [WorkCompletion]) -> usize {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let n = out.len().min(q.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        n
    }

    /// `ibv_poll_cq`: take up to `out.len()` completions. When none is
    /// waiting, the calling thread drives the QPs on this CQ once (reads
    /// their sockets), so busy polling needs no other thread.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        let n = self.try_poll(out);
        if n > 0 || out.is_empty() {
            return n;
        }
        let qps: Vec<Arc<QpShared>> = {
            let qps = self.qps.lock().unwrap_or_else(|p| p.into_inner());
            qps.iter().filter_map(Weak::upgrade).collect()
        };
        for qp in qps {
            qp.try_progress();
        }
        self.try_poll(out)
    }

    /// Block until a completion is waiting or `timeout` passes; then poll.
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        while q.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                return 0;
            }
            q = self
                .ready
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(q);
        self.try_poll(out)
    }

    /// `ibv_req_notify_cq`: make the event fd readable at the next
    /// completion (only solicited ones and errors if `solicited_only`).
    pub fn req_notify(&self, solicited_only: bool) {
        self.armed.store(
            if solicited_only {
                ARM_SOLICITED
            } else {
                ARM_ANY
            },
            Ordering::Release,
        );
        // A completion that arrived before arming must not be missed.
        if !solicited_only
            && !self
                .queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
        {
            self.armed.store(ARM_NONE, Ordering::Release);
            let _ = self.event_fd.write(1);
        }
    }

    /// Consume the event fd's pending notifications (`ibv_get_cq_event` +
    /// `ibv_ack_cq_events`); returns how many there were.
    pub fn ack_events(&self) -> u64 {
        self.event_fd.read().unwrap_or(0)
    }

    /// Completions waiting.
    pub fn len(&self) -> usize {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no completion is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether more completions arrived than the CQ holds.
    pub fn overrun(&self) -> bool {
        self.overrun.load(Ordering::Relaxed)
    }
}

impl AsFd for CompletionQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.event_fd.as_fd()
    }
}
