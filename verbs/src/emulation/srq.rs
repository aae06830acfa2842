//! A shared receive queue's posted receives.

use std::sync::Arc;

use crate::backend::SrqOps;
use crate::error::Result;
use crate::mr::{MemoryRegion, Slice};
use crate::tracker::{Held, Table, Tracker};

/// The SRQ's backend and its table of posted receives (their tokens are
/// of [`Table::Srq`], so a QP tells them from its own).
#[derive(Debug)]
pub(crate) struct SrqCore {
    pub ops: Arc<dyn SrqOps>,
    tracker: Tracker<u64>,
    pub pd_key: usize,
    /// A live region for the one zero-length SGE of a receive posted
    /// without slices (libsiw refuses receives without SGEs).
    scratch: MemoryRegion,
}

impl SrqCore {
    pub fn new(ops: Arc<dyn SrqOps>, pd_key: usize, scratch: MemoryRegion) -> SrqCore {
        SrqCore {
            ops,
            tracker: Tracker::new(Table::Srq),
            pd_key,
            scratch,
        }
    }

    pub fn post_recv(&self, wr_id: u64, local: &[Slice]) -> Result<()> {
        let held: Held = if local.is_empty() {
            smallvec::smallvec![self.scratch.slice(0, 0)?]
        } else {
            local.iter().cloned().collect()
        };
        let ticket = self.tracker.insert(wr_id, held);
        self.ops.post_recv(&ticket.recv()).inspect_err(|_| {
            self.tracker.remove(ticket.token());
        })
    }

    /// The receive a completion consumed: its wr_id and slices.
    pub fn take(&self, token: u64) -> Option<(u64, Held)> {
        self.tracker.remove(token)
    }

    pub fn len(&self) -> usize {
        self.ops.len().unwrap_or_else(|| self.tracker.len())
    }
}
