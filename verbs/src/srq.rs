//! Shared receive queues: one pool of receive buffers serving several QPs
//! (the RDDP architecture's receive buffers posted on several streams).

use std::sync::Arc;

use crate::emulation::srq::SrqCore;
use crate::error::Result;
use crate::mr::Slice;
use crate::pd::ProtectionDomain;

/// A shared receive queue. Cloning is cheap (shared ownership).
#[derive(Debug, Clone)]
pub struct SharedReceiveQueue {
    pub(crate) core: Arc<SrqCore>,
}

impl SharedReceiveQueue {
    /// `ibv_create_srq` for at most `max_wr` receives of `max_sge` slices.
    pub fn new(pd: &ProtectionDomain, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        let ops = pd.ops().create_srq(max_wr, max_sge)?;
        Ok(SharedReceiveQueue {
            core: Arc::new(SrqCore::new(
                ops,
                pd.key(),
                pd.alloc_mr(8, crate::mr::Access::LOCAL_WRITE)?,
            )),
        })
    }

    /// `ibv_post_srq_recv`.
    pub fn post_recv(&self, wr_id: u64, local: &[Slice]) -> Result<()> {
        self.core.post_recv(wr_id, local)
    }

    /// Receives posted and not yet consumed.
    pub fn len(&self) -> usize {
        self.core.len()
    }

    /// Whether no receive is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn pd_key(&self) -> usize {
        self.core.pd_key
    }
}
