//! Protection domains: `ibv_alloc_pd` / `ibv_dealloc_pd`.

use super::device::Context;
use super::{IbvError, Result};
use rdma_sys_ext as ffi;
use std::sync::Arc;

/// `struct ibv_pd`, holding its [`Context`].
pub struct ProtectionDomain {
    pub(crate) pd: *mut ffi::ibv_pd,
    ctx: Arc<Context>,
}

// SAFETY: PDs are immutable handles; libibverbs verbs on them are
// thread-safe.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("ctx", &self.ctx)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// `ibv_alloc_pd`.
    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<ProtectionDomain>> {
        // SAFETY: ctx is live while self is.
        let pd = unsafe { ffi::ibv_alloc_pd(self.ctx) };
        if pd.is_null() {
            return Err(IbvError::last("ibv_alloc_pd"));
        }
        Ok(Arc::new(ProtectionDomain {
            pd,
            ctx: Arc::clone(self),
        }))
    }
}

impl ProtectionDomain {
    /// The parent context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Raw pointer (stays owned by `self`).
    pub fn as_raw(&self) -> *mut ffi::ibv_pd {
        self.pd
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: pd came from ibv_alloc_pd; MRs and QPs hold an Arc to
        // self, so none remains.
        let ret = unsafe { ffi::ibv_dealloc_pd(self.pd) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_dealloc_pd failed");
        }
    }
}
