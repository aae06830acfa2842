//! Shared receive queues: one pool of receive buffers serving several QPs
//! (the RDDP architecture's receive buffers posted on several streams).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::device::{PdBackend, ProtectionDomain};
use crate::error::{Error, Result};
use crate::ibv;
use crate::mr::{Access, MemoryRegion, Slice};
use crate::qp::{ibv_sges, next_token};

/// A shared receive queue. Cloning is cheap (shared ownership).
#[derive(Debug, Clone)]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
}

#[derive(Debug)]
pub(crate) struct SrqInner {
    pub(crate) backend: SrqBackend,
    pd_key: usize,
    /// Posted receives by token: the application's wr_id and the slices
    /// they keep alive.
    pending: Mutex<HashMap<u64, (u64, Vec<Slice>)>>,
}

#[derive(Debug)]
pub(crate) enum SrqBackend {
    User(Arc<provider::srq::Srq>),
    Ibv {
        srq: Arc<ibv::SharedReceiveQueue>,
        /// A live region for the one zero-length SGE of a receive posted
        /// without slices (libsiw refuses receives without SGEs).
        scratch: MemoryRegion,
    },
}

impl SharedReceiveQueue {
    /// `ibv_create_srq` for at most `max_wr` receives of `max_sge` slices.
    pub fn new(pd: &ProtectionDomain, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        let backend = match pd.backend() {
            PdBackend::User(_) => SrqBackend::User(Arc::new(provider::srq::Srq::new(
                max_wr as usize,
                max_sge as usize,
            ))),
            PdBackend::Ibv(ipd) => SrqBackend::Ibv {
                srq: Arc::new(ibv::SharedReceiveQueue::new(ipd, max_wr, max_sge)?),
                scratch: pd.alloc_mr(8, Access::LOCAL_WRITE)?,
            },
        };
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                backend,
                pd_key: pd.key(),
                pending: Mutex::new(HashMap::new()),
            }),
        })
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
        let posted = match &self.inner.backend {
            SrqBackend::User(srq) => srq
                .post_recv(provider::wr::RecvWr {
                    wr_id: token,
                    sg_list,
                })
                .map_err(|e| Error::Provider(provider::device::DeviceError::Post(e.into()))),
            SrqBackend::Ibv { srq, scratch } => {
                let mut isges = ibv_sges(&sg_list);
                if isges.is_empty() {
                    isges = ibv_sges(&[scratch.slice(0, 0)?.sge()]);
                }
                let wr = ibv::RecvWr {
                    wr_id: token,
                    sges: &isges,
                };
                // SAFETY: the slices stay alive in the pending table until
                // the receive completes (or the SRQ is gone).
                unsafe { srq.post_recv(&[wr]) }.map_err(|(e, _)| Error::from(e))
            }
        };
        if let Err(e) = posted {
            self.inner
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&token);
            return Err(e);
        }
        Ok(())
    }

    /// Receives posted and not yet consumed.
    pub fn len(&self) -> usize {
        match &self.inner.backend {
            SrqBackend::User(srq) => srq.len(),
            SrqBackend::Ibv { .. } => self
                .inner
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len(),
        }
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
