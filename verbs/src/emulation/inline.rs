//! Inline sends: the payload is copied into a bounce slot of the QP at
//! post time, so the application may rewrite its buffer at once.

use std::sync::Mutex;

use provider::wr::SendOp;

use super::QpCore;
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion, Slice};
use crate::wr::{WorkRequest, MAX_INLINE};

/// Inline payloads are copied here at post time.
pub(super) struct Bounce {
    pub(super) mr: MemoryRegion,
    pub(super) free: Mutex<Vec<usize>>,
}

impl QpCore {
    /// Copy an inline WR's payload into a bounce slot.
    pub(super) fn bounce_copy(&self, wr: &WorkRequest<'_>) -> Result<(Slice, usize)> {
        if !matches!(
            wr.op,
            SendOp::Send { .. } | SendOp::Write { .. } | SendOp::WriteImm { .. }
        ) {
            return Err(Error::InvalidRequest("only Sends and Writes go inline"));
        }
        let len: usize = wr.local.iter().map(|s| s.len() as usize).sum();
        if len > MAX_INLINE {
            return Err(Error::InvalidRequest(
                "inline payload over MAX_INLINE bytes",
            ));
        }
        let bounce = match self.bounce.get() {
            Some(b) => b,
            None => {
                let slots = self.max_send_wr.max(1) as usize;
                let mr = self.pd.alloc_mr(slots * MAX_INLINE, Access::LOCAL_WRITE)?;
                let _ = self.bounce.set(Bounce {
                    mr,
                    free: Mutex::new((0..slots).rev().collect()),
                });
                self.bounce.get().expect("just set")
            }
        };
        let slot = bounce
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or(Error::QueueFull)?;
        let mut at = slot * MAX_INLINE;
        let mut buf = [0u8; MAX_INLINE];
        for s in wr.local {
            let n = s.len() as usize;
            s.mr().read_at(s.offset(), &mut buf[..n])?;
            bounce.mr.write_at(at, &buf[..n])?;
            at += n;
        }
        Ok((bounce.mr.slice(slot * MAX_INLINE, len)?, slot))
    }

    pub(super) fn free_bounce(&self, slot: usize) {
        if let Some(b) = self.bounce.get() {
            b.free.lock().unwrap_or_else(|p| p.into_inner()).push(slot);
        }
    }
}
