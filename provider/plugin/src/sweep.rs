//! Responder work done by a thread that spins on an idle CQ.
//!
//! A hardware RNIC answers RDMA Reads and atomics without the host; here
//! the QP's socket has to be read by some thread. Polling a CQ drives the
//! QPs that feed it, and the device's engine drives the rest. A program
//! that busy-polls one CQ while a QP on another CQ does the responder work
//! (perftest's READ/ATOMIC latency server spins on the CQ of its rdma_cm
//! side channel while its test QP only answers) then needs three running
//! threads on a two-process loopback test: the two spinning application
//! threads and the server's engine. On two cores the engine is the one
//! that waits for a core, and every request pays for it.
//!
//! So a `poll_cq` that finds its CQ empty also drives, once, the QPs of
//! this process that nobody polls: those whose CQs no `poll_cq` touched
//! since this thread last looked. The spinning thread becomes the
//! responder and the engine parks those QPs (it sees an application
//! thread driving them). QPs whose CQs another thread polls are left to
//! that thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};

use provider::device::QueuePair;

/// A CQ's count of `poll_cq` calls.
#[derive(Debug, Default)]
pub(crate) struct PollMark(AtomicU64);

impl PollMark {
    /// A `poll_cq` on this CQ.
    pub(crate) fn bump(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// One QP as the sweep sees it.
struct Entry {
    qp: Weak<QueuePair>,
    send: Arc<PollMark>,
    recv: Arc<PollMark>,
    /// Its CQs' poll counts at the previous sweep.
    seen: AtomicU64,
}

/// The QPs a sweep may drive.
#[derive(Default)]
pub(crate) struct Registry(RwLock<Vec<Entry>>);

/// The process's registry (one RNIC per process).
pub(crate) fn registry() -> &'static Registry {
    static QPS: Registry = Registry(RwLock::new(Vec::new()));
    &QPS
}

impl Registry {
    /// Make a new QP (fed by the CQs with marks `send` and `recv`) known
    /// to the sweep. Forgotten once the QP is gone.
    pub(crate) fn register(&self, qp: &Arc<QueuePair>, send: Arc<PollMark>, recv: Arc<PollMark>) {
        let mut qps = self.0.write().unwrap_or_else(|p| p.into_inner());
        qps.retain(|e| e.qp.strong_count() > 0);
        qps.push(Entry {
            qp: Arc::downgrade(qp),
            send,
            recv,
            // Matches no real count at first: a new QP is swept only
            // after its CQs have been seen idle for a whole sweep.
            seen: AtomicU64::new(u64::MAX),
        });
    }

    /// The thread polling the CQ with mark `polling` found it empty:
    /// drive the QPs on other CQs that no thread polled since the last
    /// sweep. Returns how many QPs it drove.
    pub(crate) fn sweep(&self, polling: &Arc<PollMark>) -> usize {
        let qps = self.0.read().unwrap_or_else(|p| p.into_inner());
        let mut driven = 0;
        for e in qps.iter() {
            if Arc::ptr_eq(&e.send, polling) || Arc::ptr_eq(&e.recv, polling) {
                // Polling this CQ already drove it.
                continue;
            }
            let marks = e.send.get().wrapping_add(e.recv.get());
            if e.seen.swap(marks, Ordering::Relaxed) != marks {
                // Someone polls its CQs (or it is new): theirs to drive.
                continue;
            }
            if let Some(qp) = e.qp.upgrade() {
                qp.try_progress();
                driven += 1;
            }
        }
        driven
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use provider::device::Device;
    use provider::qp::QpCaps;

    /// A QP on CQs nobody polls is driven by a sweep from another CQ's
    /// poller once its CQs have been seen idle; not while its own CQ is
    /// being polled, never from a poller of its own CQ, and not after it
    /// is gone.
    #[test]
    fn sweeps_only_qps_nobody_polls() {
        let dev = Device::open("sweep-test").unwrap();
        let pd = dev.alloc_pd();
        let cq = provider::cq::CompletionQueue::new(4).unwrap();
        let qp = Arc::new(pd.create_qp(QpCaps::default(), &cq, &cq, None));
        let reg = Registry::default();
        let (mine, theirs) = (Arc::new(PollMark::default()), Arc::new(PollMark::default()));
        reg.register(&qp, theirs.clone(), theirs.clone());
        assert_eq!(reg.sweep(&mine), 0, "new: its CQs not yet seen idle");
        assert_eq!(reg.sweep(&mine), 1, "idle since the last sweep");
        assert_eq!(reg.sweep(&mine), 1);
        theirs.bump();
        assert_eq!(reg.sweep(&mine), 0, "its CQ was polled meanwhile");
        assert_eq!(reg.sweep(&mine), 1, "idle again");
        assert_eq!(reg.sweep(&theirs), 0, "its own poller never sweeps it");
        drop(qp);
        assert_eq!(reg.sweep(&mine), 0, "gone");
        let other = Arc::new(pd.create_qp(QpCaps::default(), &cq, &cq, None));
        reg.register(&other, mine.clone(), theirs.clone());
        assert_eq!(reg.0.read().unwrap().len(), 1, "the dead entry was pruned");
    }
}
