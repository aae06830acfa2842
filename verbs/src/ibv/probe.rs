//! What a device's provider takes of the extended `ibv_wr_*` API, found by
//! creating QPs: a provider refuses `send_ops_flags` it does not know.

use super::device::{Context, DeviceAttr};
use super::qp::{QpInitAttr, QueuePair};
use super::wr::SendOps;
use rdma_sys_ext as ffi;
use std::sync::Arc;

/// What `ibv_create_qp_ex` with `send_ops_flags` accepts on a device (the
/// `ibv_wr_*` API), as found by creating QPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WrApi {
    /// The widest `send_ops_flags` set of the operations stag posts that
    /// the provider accepted; empty when it has no `ibv_wr_*` API (siw,
    /// irdma, cxgb4, erdma) and QPs post with `ibv_post_send`.
    pub ops: SendOps,
    /// ... plus `IBV_QP_EX_WITH_ATOMIC_WRITE` (needs
    /// [`super::HAS_WR_ATOMIC_WRITE`] at build time).
    pub atomic_write: bool,
    /// ... plus `IBV_QP_EX_WITH_FLUSH` (needs [`super::HAS_WR_FLUSH`]).
    pub flush: bool,
}

impl WrApi {
    /// The provider creates RC QPs through `ibv_create_qp_ex` with
    /// `send_ops_flags`, i.e. supports the `ibv_wr_*` API.
    pub fn available(&self) -> bool {
        !self.ops.is_empty()
    }

    /// Commit can run as one `ibv_wr_flush(IBV_FLUSH_GLOBAL)` on `attr`'s
    /// device: it advertises FLUSH global (as a responder it executes one
    /// into a region registered with `IBV_ACCESS_FLUSH_GLOBAL`) and its
    /// provider library took `IBV_QP_EX_WITH_FLUSH` (so it can post one).
    pub fn commit_by_flush(&self, attr: &DeviceAttr) -> bool {
        attr.flush_global && self.flush
    }
}

/// Probes which `send_ops_flags` `ctx`'s provider takes, widest first: a
/// provider refuses flags it does not know, so a QP created with a flag is
/// also the run-time proof that the library's `ibv_qp_ex` has the member
/// that flag's `ibv_wr_*` calls through. Creates and destroys a PD, a CQ
/// and a handful of QPs.
pub fn probe_wr_api(ctx: &Arc<Context>) -> WrApi {
    let Ok(pd) = ctx.alloc_pd() else {
        return WrApi::default();
    };
    let Ok(cq) = ctx.create_cq(4, None, 0) else {
        return WrApi::default();
    };
    let try_ops = |ops: SendOps| {
        let caps = QpInitAttr {
            max_send_wr: 1,
            max_recv_wr: 1,
            send_ops: Some(ops),
            ..QpInitAttr::default()
        };
        match QueuePair::create(&pd, &cq, &cq, &caps) {
            Ok(qp) => qp.has_wr_api(),
            Err(e) => {
                tracing::debug!(?ops, %e, "create_qp_ex probe refused");
                false
            }
        }
    };
    let candidates = [
        SendOps::BASIC_ATOMICS | SendOps::SEND_WITH_INV,
        SendOps::BASIC_ATOMICS,
        SendOps::BASIC | SendOps::SEND_WITH_INV,
        SendOps::BASIC,
    ];
    let Some(ops) = candidates.into_iter().find(|&ops| try_ops(ops)) else {
        return WrApi::default();
    };
    WrApi {
        ops,
        atomic_write: ffi::HAS_WR_ATOMIC_WRITE && try_ops(ops | SendOps::ATOMIC_WRITE),
        flush: ffi::HAS_WR_FLUSH && try_ops(ops | SendOps::FLUSH),
    }
}
