//! Shared receive queue: one pool of receive buffers serving many QPs
//! (draft-ietf-rddp-arch-03: receive buffers posted on several streams).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::wr::{RecvWr, Sge};

/// At most this many spare SGE lists wait in an SRQ for
/// [`Srq::post_recv_ref`]: a poster reposts as completions come, so the
/// spares are the few receives taken and not yet reposted.
const SPARE_MAX: usize = 64;

/// At most this many lists of completed receives wait in a QP for its
/// next [`Srq::take`], which hands them to the SRQ (see [`Spent`]).
const SPENT_MAX: usize = 8;

/// Why a receive WR was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PostRecvError {
    /// The queue already holds its maximum number of WRs.
    #[error("receive queue full ({0} WRs)")]
    Full(usize),
    /// More SGEs than the queue allows.
    #[error("too many SGEs: {0} > {1}")]
    TooManySges(usize, usize),
}

/// A shared receive queue.
#[derive(Debug)]
pub struct Srq {
    queue: Mutex<Posted>,
    max_wr: usize,
    max_sge: usize,
    /// The armed limit (`ibv_modify_srq` with `IBV_SRQ_LIMIT`), 0 when
    /// disarmed: when fewer WRs than this remain, the limit hook runs once
    /// and the limit disarms, as verbs specifies.
    limit: AtomicUsize,
    limit_hook: OnceLock<LimitHook>,
}

/// The posted receives, and spare SGE lists for posts by reference:
/// under one lock, so that taking a receive also takes back the lists
/// of receives that completed.
#[derive(Debug)]
struct Posted {
    wrs: VecDeque<RecvWr>,
    spare: Vec<Vec<Sge>>,
}

/// The SGE lists of a QP's completed SRQ receives, on their way back to
/// the SRQ: kept by the QP (no lock of the SRQ per completion) and handed
/// over at its next [`Srq::take`], which holds the lock anyway.
#[derive(Debug, Default)]
pub struct Spent(Vec<Vec<Sge>>);

impl Spent {
    /// Keep `list` for the SRQ, unless enough wait already (the SRQ
    /// decides at its take which it keeps).
    pub fn keep(&mut self, list: Vec<Sge>) {
        if self.0.len() < SPENT_MAX {
            self.0.push(list);
        }
    }
}

/// What [`Srq::set_limit_hook`] installs.
struct LimitHook(Box<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for LimitHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LimitHook")
    }
}

impl Srq {
    /// A queue of at most `max_wr` WRs with at most `max_sge` SGEs each.
    pub fn new(max_wr: usize, max_sge: usize) -> Srq {
        Srq {
            queue: Mutex::new(Posted {
                wrs: VecDeque::with_capacity(max_wr.min(4096)),
                spare: Vec::new(),
            }),
            max_wr,
            max_sge,
            limit: AtomicUsize::new(0),
            limit_hook: OnceLock::new(),
        }
    }

    /// Arm the limit (0 disarms): the hook runs once fewer than `limit`
    /// WRs remain.
    pub fn arm_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Release);
    }

    /// The armed limit; 0 once it fired, or when never armed.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Acquire)
    }

    /// Have `hook` called (from the thread that took the WR, no lock of
    /// the SRQ held) when the armed limit is reached: how the rdma-core
    /// plugin raises `IBV_EVENT_SRQ_LIMIT_REACHED`. One per SRQ; returns
    /// false if one was already set.
    pub fn set_limit_hook(&self, hook: impl Fn() + Send + Sync + 'static) -> bool {
        self.limit_hook.set(LimitHook(Box::new(hook))).is_ok()
    }

    /// `ibv_post_srq_recv`.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), PostRecvError> {
        self.admit(wr.sg_list.len())?.wrs.push_back(wr);
        Ok(())
    }

    /// `ibv_post_srq_recv` of a borrowed SGE list, copied into a list
    /// that a completed receive gave back: with receives completing as
    /// posted, a repost allocates nothing.
    pub fn post_recv_ref(&self, wr_id: u64, sg_list: &[Sge]) -> Result<(), PostRecvError> {
        let mut q = self.admit(sg_list.len())?;
        let mut list = q.spare.pop().unwrap_or_default();
        list.extend_from_slice(sg_list);
        q.wrs.push_back(RecvWr {
            wr_id,
            sg_list: list,
        });
        Ok(())
    }

    /// Take the oldest posted WR for an arriving message, taking back the
    /// lists of the taker's completed receives (`spent`) as spares.
    pub fn take(&self, spent: &mut Spent) -> Option<RecvWr> {
        let mut q = self.lock();
        let wr = q.wrs.pop_front();
        let left = q.wrs.len();
        // As a QP keeps its own: lists of an unusual size, or beyond the
        // spares' bound, go.
        let max_sge = u32::try_from(self.max_sge).unwrap_or(u32::MAX);
        for list in spent.0.drain(..) {
            crate::wr::keep_sge_list(&mut q.spare, list, max_sge, SPARE_MAX);
        }
        drop(q);
        let limit = self.limit.load(Ordering::Acquire);
        if wr.is_some()
            && limit > 0
            && left < limit
            && self
                .limit
                .compare_exchange(limit, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            if let Some(hook) = self.limit_hook.get() {
                (hook.0)();
            }
        }
        wr
    }

    /// How many WRs are posted.
    pub fn len(&self) -> usize {
        self.lock().wrs.len()
    }

    /// The queue, locked, if it takes one more WR of `sges` SGEs.
    fn admit(&self, sges: usize) -> Result<std::sync::MutexGuard<'_, Posted>, PostRecvError> {
        if sges > self.max_sge {
            return Err(PostRecvError::TooManySges(sges, self.max_sge));
        }
        let q = self.lock();
        if q.wrs.len() >= self.max_wr {
            return Err(PostRecvError::Full(self.max_wr));
        }
        Ok(q)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Posted> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether no WR is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;

    fn wr(id: u64) -> RecvWr {
        RecvWr {
            wr_id: id,
            sg_list: Vec::new(),
        }
    }

    #[test]
    fn the_limit_fires_once_below_it_then_disarms() {
        let srq = Srq::new(16, 1);
        let fired = Arc::new(AtomicU32::new(0));
        let f = fired.clone();
        assert!(srq.set_limit_hook(move || {
            f.fetch_add(1, Ordering::Relaxed);
        }));
        for i in 0..8 {
            srq.post_recv(wr(i)).unwrap();
        }
        srq.arm_limit(4);
        // 8 -> 4 left: not below the limit yet.
        let mut spent = Spent::default();
        for _ in 0..4 {
            srq.take(&mut spent).unwrap();
        }
        assert_eq!(fired.load(Ordering::Relaxed), 0);
        assert_eq!(srq.limit(), 4);
        // 3 left: fires, and disarms.
        srq.take(&mut spent).unwrap();
        assert_eq!(fired.load(Ordering::Relaxed), 1);
        assert_eq!(srq.limit(), 0);
        srq.take(&mut spent).unwrap();
        assert_eq!(fired.load(Ordering::Relaxed), 1);
        // Armed again above what is left: fires at the next take.
        srq.arm_limit(8);
        srq.take(&mut spent).unwrap();
        assert_eq!(fired.load(Ordering::Relaxed), 2);
    }
}
