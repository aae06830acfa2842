//! Shared receive queues: one pool of receive buffers serving several QPs
//! (the RDDP architecture's receive buffers posted on several streams).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::device::{PdBackend, ProtectionDomain};
use crate::error::{Error, Result};
use crate::mr::Slice;
use crate::qp::next_token;

/// A shared receive queue. Cloning is cheap (shared ownership).
#[derive(Debug, Clone)]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
}

#[derive(Debug)]
pub(crate) struct SrqInner {
    pub(crate) backend: Arc<provider::srq::Srq>,
    pd_key: usize,
    /// Posted receives by token: the application's wr_id and the slices
    /// they keep alive.
    pending: Mutex<HashMap<u64, (u64, Vec<Slice>)>>,
}

impl SharedReceiveQueue {
    /// `ibv_create_srq` for at most `max_wr` receives of `max_sge` slices.
    pub fn new(pd: &ProtectionDomain, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        match pd.backend() {
            PdBackend::User(_) => Ok(SharedReceiveQueue {
                inner: Arc::new(SrqInner {
                    backend: Arc::new(provider::srq::Srq::new(max_wr as usize, max_sge as usize)),
                    pd_key: pd.key(),
                    pending: Mutex::new(HashMap::new()),
                }),
            }),
            PdBackend::Ibv(_) => Err(Error::NotImplemented(
                "shared receive queues on libibverbs devices",
            )),
        }
    }

    /// `ibv_post_srq_recv`.
    pub fn post_recv(&self, wr_id: u64, local: Vec<Slice>) -> Result<()> {
        let token = next_token();
        let sg_list = local.iter().map(Slice::sge).collect();
        self.inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, (wr_id, local));
        let posted = self.inner.backend.post_recv(provider::wr::RecvWr {
            wr_id: token,
            sg_list,
        });
        if let Err(e) = posted {
            self.inner
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&token);
            return Err(Error::Provider(provider::device::DeviceError::Post(
                e.into(),
            )));
        }
        Ok(())
    }

    /// Receives posted and not yet consumed.
    pub fn len(&self) -> usize {
        self.inner.backend.len()
    }

    /// Whether no receive is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn pd_key(&self) -> usize {
        self.inner.pd_key
    }
}

impl SrqInner {
    /// The receive a completion consumed.
    pub(crate) fn take(&self, token: u64) -> Option<(u64, Vec<Slice>)> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&token)
    }
}
