//! Temporary stand-in for the verbs half's interface (`crate::context`,
//! `crate::qp`) until main is merged into `cm`. Same signatures, no bodies.

#![allow(dead_code, clippy::missing_safety_doc)]

use std::sync::Arc;

use crate::ffi;

pub(crate) fn is_stag_context(_ctx: *const ffi::ibv_context) -> bool {
    todo!("verbs half not merged yet")
}

pub(crate) struct QpHandle {
    qp: Arc<provider::device::QueuePair>,
}

/// None when `qp` is NULL or not a stag0 QP.
pub(crate) unsafe fn qp_handle(_qp: *mut ffi::ibv_qp) -> Option<QpHandle> {
    todo!("verbs half not merged yet")
}

impl QpHandle {
    pub(crate) fn provider(&self) -> &Arc<provider::device::QueuePair> {
        &self.qp
    }

    pub(crate) fn set_state(&self, _state: ffi::ibv_qp_state) {
        todo!("verbs half not merged yet")
    }
}
