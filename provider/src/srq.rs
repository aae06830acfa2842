//! Shared receive queue: one pool of receive buffers serving many QPs
//! (draft-ietf-rddp-arch-03: receive buffers posted on several streams).

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::wr::RecvWr;

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
    queue: Mutex<VecDeque<RecvWr>>,
    max_wr: usize,
    max_sge: usize,
}

impl Srq {
    /// A queue of at most `max_wr` WRs with at most `max_sge` SGEs each.
    pub fn new(max_wr: usize, max_sge: usize) -> Srq {
        Srq {
            queue: Mutex::new(VecDeque::with_capacity(max_wr.min(4096))),
            max_wr,
            max_sge,
        }
    }

    /// `ibv_post_srq_recv`.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), PostRecvError> {
        if wr.sg_list.len() > self.max_sge {
            return Err(PostRecvError::TooManySges(wr.sg_list.len(), self.max_sge));
        }
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= self.max_wr {
            return Err(PostRecvError::Full(self.max_wr));
        }
        q.push_back(wr);
        Ok(())
    }

    /// Take the oldest posted WR for an arriving message.
    pub fn take(&self) -> Option<RecvWr> {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
    }

    /// How many WRs are posted.
    pub fn len(&self) -> usize {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no WR is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
