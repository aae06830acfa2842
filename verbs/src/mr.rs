//! Memory regions: owned memory registered with a device.
//!
//! The device writes a region whenever a peer's message lands, so safe code
//! reaches the bytes only by copy (`read_at`, `write_at`) or by atomic
//! 64-bit access (`load_u64`, `store_u64`); it never holds a `&mut [u8]`
//! the device could write behind its back. A [`Slice`] names bytes of a
//! region for a work request and keeps the region alive: the queue pair
//! holds every posted WR's slices until its completion is polled, so memory
//! the device may still touch is never unmapped.

use std::path::Path;
use std::sync::Arc;

use provider::region::Region;
use provider::wr::{Remote, Sge};

use crate::device::{PdBackend, ProtectionDomain};
use crate::error::{Error, Result};
use crate::ibv;

pub use provider::mem::Access;

/// A registered memory region. Cloning is cheap (shared ownership).
#[derive(Debug, Clone)]
pub struct MemoryRegion {
    inner: Arc<MrInner>,
}

/// The shared part of a region (named for the registry's weak links).
pub(crate) type MrInnerPub = MrInner;

#[derive(Debug)]
pub(crate) struct MrInner {
    // Held for its Drop (deregistration). Declared before `region`: fields
    // drop in order, so the registration is gone before the memory is
    // unmapped.
    #[allow(dead_code)]
    registration: Registration,
    region: Region,
    lkey: u32,
    rkey: u32,
    access: Access,
    pd_key: usize,
    /// The device may execute a peer's FLUSH into it
    /// (`IBV_ACCESS_FLUSH_GLOBAL`): then a device FLUSH is its whole
    /// Commit, and the agent says so to a peer that asks.
    device_flush: bool,
}

#[derive(Debug)]
enum Registration {
    User {
        pd: provider::device::ProtectionDomain,
        stag: u32,
    },
    // Held for its Drop (ibv_dereg_mr).
    Ibv(#[allow(dead_code)] ibv::MemoryRegion),
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Registration::User { pd, stag } = self {
            let _ = pd.dereg_mr(*stag);
        }
    }
}

fn ibv_access(access: Access) -> ibv::AccessFlags {
    let mut flags = ibv::AccessFlags::EMPTY;
    for (ours, theirs) in [
        (Access::LOCAL_WRITE, ibv::AccessFlags::LOCAL_WRITE),
        (Access::REMOTE_WRITE, ibv::AccessFlags::REMOTE_WRITE),
        (Access::REMOTE_READ, ibv::AccessFlags::REMOTE_READ),
        (Access::REMOTE_ATOMIC, ibv::AccessFlags::REMOTE_ATOMIC),
    ] {
        if access.contains(ours) {
            flags |= theirs;
        }
    }
    // libibverbs requires Local Write with Remote Write or Remote Atomic
    // (ibv_reg_mr(3): EINVAL otherwise); the userspace provider does not.
    // Granting it keeps one Access meaning on every device.
    if access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC) {
        flags |= ibv::AccessFlags::LOCAL_WRITE;
    }
    flags
}

impl MemoryRegion {
    pub(crate) fn register(
        pd: &ProtectionDomain,
        region: Region,
        access: Access,
    ) -> Result<MemoryRegion> {
        let mut device_flush = false;
        let (registration, lkey, rkey) = match pd.backend() {
            PdBackend::User(upd) => {
                // SAFETY: the region is owned by the MrInner built below and
                // outlives the registration (field order), and every access
                // to it from safe code is a raw copy or an atomic.
                let stag = unsafe {
                    upd.reg_mr(region.as_ptr(), region.len(), access, region.is_durable())
                }?;
                (
                    Registration::User {
                        pd: upd.clone(),
                        stag,
                    },
                    stag,
                    stag,
                )
            }
            PdBackend::Ibv(ipd) => {
                // Commit rights become the device's FLUSH right where a
                // device FLUSH is the whole Commit: memory, not a
                // file-backed region (its file needs the agent's msync; a
                // peer's FLUSH to it then fails instead of claiming
                // durability). Elsewhere they are the agent's business.
                let mut flags = ibv_access(access);
                device_flush = !region.is_durable()
                    && (access.contains(Access::FLUSH_GLOBAL)
                        || access.contains(Access::FLUSH_PERSISTENT))
                    && pd.context().flush_target();
                if device_flush {
                    flags |= ibv::AccessFlags::FLUSH_GLOBAL;
                }
                // SAFETY: as above; the device may DMA into the mapping
                // until the ibv MR is dropped, which happens first.
                let mr =
                    unsafe { ipd.reg_mr(region.as_ptr().as_ptr().cast(), region.len(), flags) }?;
                let (l, r) = (mr.lkey(), mr.rkey());
                (Registration::Ibv(mr), l, r)
            }
        };
        let mr = MemoryRegion {
            inner: Arc::new(MrInner {
                registration,
                region,
                lkey,
                rkey,
                access,
                pd_key: pd.key(),
                device_flush,
            }),
        };
        pd.context().remember_mr(&mr);
        Ok(mr)
    }

    pub(crate) fn downgrade(&self) -> std::sync::Weak<MrInnerPub> {
        Arc::downgrade(&self.inner)
    }

    pub(crate) fn upgrade(w: &std::sync::Weak<MrInnerPub>) -> Option<MemoryRegion> {
        w.upgrade().map(|inner| MemoryRegion { inner })
    }

    pub(crate) fn pd_key(&self) -> usize {
        self.inner.pd_key
    }

    /// Whether the device executes a peer's FLUSH into it, which is then
    /// its whole Commit (a memory region on a FLUSH-capable device).
    pub(crate) fn device_flush(&self) -> bool {
        self.inner.device_flush
    }

    /// The access rights it was registered with.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// The offset of `[addr, addr+len)` if the region holds it.
    pub(crate) fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let base = self.inner.region.addr(0);
        let off = addr.checked_sub(base)?;
        let end = off.checked_add(len)?;
        (end <= self.len() as u64).then_some(off as usize)
    }

    pub(crate) fn region(&self) -> &Region {
        &self.inner.region
    }

    /// Allocate `len` zeroed bytes and register them.
    pub fn alloc(pd: &ProtectionDomain, len: usize, access: Access) -> Result<MemoryRegion> {
        Self::register(pd, Region::anonymous(len)?, access)
    }

    /// Map `len` bytes of the file at `path` (created if needed) and
    /// register them as a durable region: a Commit makes written bytes
    /// reach the file.
    pub fn alloc_file(
        pd: &ProtectionDomain,
        path: &Path,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        Self::register(pd, Region::file_backed(path, len)?, access)
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.region.len()
    }

    /// Whether the region has no bytes (never).
    pub fn is_empty(&self) -> bool {
        self.inner.region.is_empty()
    }

    /// Whether it is file-backed.
    pub fn is_durable(&self) -> bool {
        self.inner.region.is_durable()
    }

    /// The address and rkey a peer uses for byte `offset`.
    pub fn remote(&self, offset: usize) -> Remote {
        Remote {
            addr: self.inner.region.addr(offset),
            rkey: self.inner.rkey,
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

    /// Copy `data` in at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        Ok(self.inner.region.write_at(offset, data)?)
    }

    /// Copy bytes at `offset` out.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        Ok(self.inner.region.read_at(offset, out)?)
    }

    /// A copy of `len` bytes at `offset`.
    pub fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        Ok(self.inner.region.to_vec(offset, len)?)
    }

    /// Atomically load the host-order `u64` at `offset` (8-byte aligned).
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        Ok(self.inner.region.load_u64(offset)?)
    }

    /// Atomically store a host-order `u64` at `offset` (8-byte aligned).
    pub fn store_u64(&self, offset: usize, value: u64) -> Result<()> {
        Ok(self.inner.region.store_u64(offset, value)?)
    }

    /// msync the whole region to its file (durable regions).
    pub fn sync(&self) -> Result<()> {
        Ok(self.inner.region.sync()?)
    }
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
            addr: self.mr.inner.region.addr(self.offset),
            length: self.len,
            lkey: self.mr.inner.lkey,
        }
    }
}
