//! RFC 7306 §1.1's probe of a peer without stag: a FetchAdd of 0.

use std::time::{Duration, Instant};

use smallvec::smallvec;

use provider::wr::{Remote, SendOp, WcStatus};

use super::{Pending, QpCore, What};
use crate::error::{Error, Result};

impl QpCore {
    /// Post a native FetchAdd of 0 at `target` and drive the send CQ until
    /// it completes (other completions stay queued for the application).
    pub fn probe(&self, target: Remote, timeout: Duration) -> Result<(WcStatus, u32)> {
        let slot = self.take_slot()?;
        let op = SendOp::fetch_add(target, 0);
        let pending = Pending {
            wr_id: 0,
            what: What::Probe { slot },
        };
        let scratch = self
            .scratch
            .slice(slot * 8, 8)
            .inspect_err(|_| self.free_slot(slot))?;
        let ticket = self.tracker.insert(pending, smallvec![scratch]);
        let token = ticket.token();
        if let Err(e) = self.post_one(&ticket, op, false) {
            self.tracker.remove(token);
            self.free_slot(slot);
            return Err(e);
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self
                .probes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&token)
            {
                return Ok(r);
            }
            if Instant::now() >= deadline {
                // The entry stays: a late completion still frees the slot.
                return Err(Error::Timeout("the peer did not answer the atomics probe"));
            }
            self.send_cq.drive()?;
            std::thread::yield_now();
        }
    }
}
