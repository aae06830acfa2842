//! Shared receive queues: `ibv_create_srq`, `ibv_post_srq_recv` (through
//! the `stag_ibv_post_srq_recv` wrapper: it is static inline),
//! `ibv_destroy_srq`.

use super::pd::ProtectionDomain;
use super::wr::{post_recv_chain, RecvWr};
use super::{IbvError, Result};
use rdma_sys_ext as ffi;
use std::sync::Arc;

/// `struct ibv_srq`, holding its PD.
pub struct SharedReceiveQueue {
    srq: *mut ffi::ibv_srq,
    max_wr: u32,
    max_sge: u32,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: ibv_post_srq_recv is thread-safe in libibverbs providers; the
// handle is immutable after creation.
unsafe impl Send for SharedReceiveQueue {}
// SAFETY: as above.
unsafe impl Sync for SharedReceiveQueue {}

impl std::fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("srq", &self.srq)
            .field("max_wr", &self.max_wr)
            .field("max_sge", &self.max_sge)
            .finish_non_exhaustive()
    }
}

impl SharedReceiveQueue {
    /// `ibv_create_srq` for at least `max_wr` receives of `max_sge` SGEs.
    pub fn new(pd: &Arc<ProtectionDomain>, max_wr: u32, max_sge: u32) -> Result<Self> {
        let mut attr = ffi::ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: ffi::ibv_srq_attr {
                max_wr,
                max_sge,
                srq_limit: 0,
            },
        };
        // SAFETY: pd is live (held by the Arc); attr is fully initialised
        // and only read/updated during the call.
        let srq = unsafe { ffi::ibv_create_srq(pd.as_raw(), &mut attr) };
        if srq.is_null() {
            return Err(IbvError::last("ibv_create_srq"));
        }
        Ok(SharedReceiveQueue {
            srq,
            max_wr: attr.attr.max_wr,
            max_sge: attr.attr.max_sge,
            pd: Arc::clone(pd),
        })
    }

    /// The receives the device granted (≥ what was asked).
    pub fn max_wr(&self) -> u32 {
        self.max_wr
    }

    /// The SGEs per receive the device granted.
    pub fn max_sge(&self) -> u32 {
        self.max_sge
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// Raw pointer (stays owned by `self`).
    pub fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.srq
    }

    /// `ibv_post_srq_recv` of a chain of receive requests; on failure, the
    /// error and the index of the first request not posted.
    ///
    /// # Safety
    /// Every SGE must describe writable memory inside a live region
    /// registered on this SRQ's PD with `LOCAL_WRITE`, which stays valid
    /// and unaliased until the WR completes.
    pub unsafe fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), (IbvError, usize)> {
        // SAFETY: srq is live; the chain and its SGEs live for the call (the
        // provider copies them); the memory they name is the caller's
        // obligation (see # Safety).
        unsafe {
            post_recv_chain("ibv_post_srq_recv", wrs, |head, bad| {
                ffi::stag_ibv_post_srq_recv(self.srq, head, bad)
            })
        }
    }
}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        // SAFETY: srq came from ibv_create_srq and is destroyed once; QPs
        // using it hold an Arc to self, so none remains.
        let ret = unsafe { ffi::ibv_destroy_srq(self.srq) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_destroy_srq failed");
        }
    }
}
