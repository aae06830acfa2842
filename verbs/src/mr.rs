//! Memory regions: memory registered with a device, owned by the region.
//!
//! The device writes a region whenever a peer's message lands, so safe code
//! never holds a `&mut [u8]` (or a `&[u8]`) the device could write behind
//! its back. Bytes go in and out by copy (`read_at`, `write_at`), 64-bit
//! words by atomic access (`load_u64`, `store_u64`), and the zero-copy view
//! is a slice of atomic bytes ([`MemoryRegion::as_atomic_bytes`]), which
//! stays sound under concurrent writes. Memory the application already
//! owns is registered in place ([`ProtectionDomain::register`]) and given
//! back by [`MemoryRegion::deregister`].
//!
//! A [`Slice`] names bytes of a region for a work request and keeps the
//! region alive: the queue pair holds every posted WR's slices until its
//! completion is polled, so memory the device may still touch is never
//! unmapped or handed back.
//!
//! [`ProtectionDomain::register`]: crate::ProtectionDomain::register

use std::collections::HashMap;
use std::sync::atomic::AtomicU8;
use std::sync::{Arc, Mutex, Weak};

use provider::region::{Owned, Region};
use provider::wr::{Remote, Sge};

use crate::error::{Error, Result};

pub use provider::mem::Access;

/// A registration (`struct ibv_mr`) as a backend makes it, owning the
/// memory it registered.
pub(crate) trait MrOps: Send + Sync + std::fmt::Debug {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
    fn region(&self) -> &Region;
    /// The device executes a peer's FLUSH into it.
    fn device_flush(&self) -> bool {
        false
    }
    /// Deregister and give the memory back (on failure the memory stays
    /// mapped: the device may still hold it).
    fn into_region(self: Box<Self>) -> Result<Region>;
}

/// A registered memory region. Cloning is cheap (shared ownership).
#[derive(Debug, Clone)]
pub struct MemoryRegion {
    inner: Arc<MrInner>,
}

#[derive(Debug)]
pub(crate) struct MrInner {
    /// The registration, which owns the memory (deregistered before it is
    /// unmapped or given back).
    ops: Box<dyn MrOps>,
    access: Access,
    pd_key: usize,
}

/// A context's live regions by rkey, for its agent executing a peer's
/// requests.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    by_rkey: Mutex<Rkeys>,
}

#[derive(Debug, Default)]
struct Rkeys {
    map: HashMap<u32, Weak<MrInner>>,
    /// Registrations left before the next prune of dead entries. Pruning
    /// at every registration made n registrations cost n² (3 % of the
    /// client of a 1024-QP run); once the map may have doubled keeps it
    /// amortised O(1).
    until_prune: usize,
}

/// The fewest registrations between two prunes.
const MIN_PRUNE_GAP: usize = 16;

impl Registry {
    fn remember(&self, mr: &MemoryRegion) {
        let mut m = self.by_rkey.lock().unwrap_or_else(|p| p.into_inner());
        if m.until_prune == 0 {
            m.map.retain(|_, w| w.strong_count() > 0);
            m.until_prune = m.map.len().max(MIN_PRUNE_GAP);
        } else {
            m.until_prune -= 1;
        }
        m.map.insert(mr.rkey(), Arc::downgrade(&mr.inner));
    }

    /// The live region with this rkey, if any.
    pub fn get(&self, rkey: u32) -> Option<MemoryRegion> {
        let m = self.by_rkey.lock().unwrap_or_else(|p| p.into_inner());
        m.map
            .get(&rkey)
            .and_then(Weak::upgrade)
            .map(|inner| MemoryRegion { inner })
    }
}

impl MemoryRegion {
    /// A region over a registration made by a PD's backend.
    pub(crate) fn new(
        ops: Box<dyn MrOps>,
        access: Access,
        pd_key: usize,
        registry: &Registry,
    ) -> MemoryRegion {
        let mr = MemoryRegion {
            inner: Arc::new(MrInner {
                ops,
                access,
                pd_key,
            }),
        };
        registry.remember(&mr);
        mr
    }

    pub(crate) fn pd_key(&self) -> usize {
        self.inner.pd_key
    }

    /// Whether the device executes a peer's FLUSH into it, which is then
    /// its whole Commit (a memory region on a FLUSH-capable device).
    pub(crate) fn device_flush(&self) -> bool {
        self.inner.ops.device_flush()
    }

    /// The access rights it was registered with.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// The offset of `[addr, addr+len)` if the region holds it.
    pub(crate) fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let base = self.region().addr(0);
        let off = addr.checked_sub(base)?;
        let end = off.checked_add(len)?;
        (end <= self.len() as u64).then_some(off as usize)
    }

    pub(crate) fn region(&self) -> &Region {
        self.inner.ops.region()
    }

    /// Deregister (`ibv_dereg_mr`) and give the memory back, bytes as the
    /// device left them. Only the last handle can: while a clone or a
    /// posted work request's [`Slice`] still holds the region, it comes
    /// back unchanged in [`DeregisterError::InUse`].
    pub fn deregister(self) -> std::result::Result<Owned, DeregisterError> {
        match Arc::try_unwrap(self.inner) {
            Ok(inner) => inner
                .ops
                .into_region()
                .map(Region::into_owned)
                .map_err(DeregisterError::Failed),
            Err(inner) => Err(DeregisterError::InUse(MemoryRegion { inner })),
        }
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.inner.ops.lkey()
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.inner.ops.rkey()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region().len()
    }

    /// Whether the region has no bytes (never).
    pub fn is_empty(&self) -> bool {
        self.region().is_empty()
    }

    /// Whether it is file-backed.
    pub fn is_durable(&self) -> bool {
        self.region().is_durable()
    }

    /// The address and rkey a peer uses for byte `offset`.
    pub fn remote(&self, offset: usize) -> Remote {
        Remote {
            addr: self.region().addr(offset),
            rkey: self.rkey(),
        }
    }

    /// `len` bytes at `offset`, for a work request.
    pub fn slice(&self, offset: usize, len: usize) -> Result<Slice> {
        let len32 =
            u32::try_from(len).map_err(|_| Error::InvalidRequest("an SGE is at most 4 GiB"))?;
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(Slice {
                mr: self.clone(),
                offset,
                len: len32,
            }),
            _ => Err(provider::region::RegionError::OutOfBounds {
                offset,
                len,
                size: self.len(),
            }
            .into()),
        }
    }

    /// The whole region, for a work request.
    pub fn all(&self) -> Slice {
        Slice {
            mr: self.clone(),
            offset: 0,
            len: u32::try_from(self.len()).unwrap_or(u32::MAX),
        }
    }

    /// Copy `data` in at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        Ok(self.region().write_at(offset, data)?)
    }

    /// Copy bytes at `offset` out.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        Ok(self.region().read_at(offset, out)?)
    }

    /// A copy of `len` bytes at `offset`.
    pub fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        Ok(self.region().to_vec(offset, len)?)
    }

    /// Atomically load the host-order `u64` at `offset` (8-byte aligned).
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        Ok(self.region().load_u64(offset)?)
    }

    /// Atomically store a host-order `u64` at `offset` (8-byte aligned).
    pub fn store_u64(&self, offset: usize, value: u64) -> Result<()> {
        Ok(self.region().store_u64(offset, value)?)
    }

    /// The region's bytes in place, as atomics: zero-copy access that is
    /// sound while the device or a peer writes them. Relaxed loads and
    /// stores compile to plain byte moves; order them against the
    /// completion that announced the data with the completion itself
    /// (polling it is an Acquire).
    pub fn as_atomic_bytes(&self) -> &[AtomicU8] {
        self.region().as_atomic_bytes()
    }

    /// msync the whole region to its file (durable regions).
    pub fn sync(&self) -> Result<()> {
        Ok(self.region().sync()?)
    }
}

/// Why [`MemoryRegion::deregister`] gave nothing back.
#[derive(Debug, thiserror::Error)]
pub enum DeregisterError {
    /// Another handle or a posted work request still holds the region.
    #[error("the region is still in use")]
    InUse(MemoryRegion),
    /// The device refused to let go; its memory stays mapped (leaked)
    /// rather than freed under it.
    #[error("deregistration failed: {0}")]
    Failed(Error),
}

/// Bytes of a region named by a work request. Holds the region alive.
#[derive(Debug, Clone)]
pub struct Slice {
    mr: MemoryRegion,
    offset: usize,
    len: u32,
}

impl Slice {
    /// The region.
    pub fn mr(&self) -> &MemoryRegion {
        &self.mr
    }

    /// Offset in the region.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The SGE the device sees.
    pub(crate) fn sge(&self) -> Sge {
        Sge {
            addr: self.mr.region().addr(self.offset),
            length: self.len,
            lkey: self.mr.lkey(),
        }
    }
}
