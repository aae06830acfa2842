//! Protection domains, and the memory registered on them.

use std::path::Path;
use std::sync::Arc;

use provider::region::Region;

use crate::backend::PdOps;
use crate::device::Context;
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion};

/// A protection domain.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    ctx: Context,
    ops: Arc<dyn PdOps>,
}

impl Context {
    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        Ok(ProtectionDomain {
            ctx: self.clone(),
            ops: self.ops().alloc_pd()?,
        })
    }
}

impl ProtectionDomain {
    /// The device context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    pub(crate) fn ops(&self) -> &Arc<dyn PdOps> {
        &self.ops
    }

    /// Identifies the PD (regions remember it for the agent's PD check).
    pub(crate) fn key(&self) -> usize {
        Arc::as_ptr(&self.ops).cast::<()>() as usize
    }

    fn register_region(&self, region: Region, access: Access) -> Result<MemoryRegion> {
        let ops = self.ops.register(region, access)?;
        Ok(MemoryRegion::new(
            ops,
            access,
            self.key(),
            self.ctx.registry(),
        ))
    }

    /// Allocate and register `len` zeroed bytes.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        self.register_region(Region::anonymous(len)?, access)
    }

    /// Map `len` bytes of the file at `path` (created if needed) and
    /// register them as a durable region: a Commit makes written bytes
    /// reach the file.
    pub fn alloc_file_mr(&self, path: &Path, len: usize, access: Access) -> Result<MemoryRegion> {
        self.register_region(Region::file_backed(path, len)?, access)
    }

    /// `ibv_reg_mr` of memory the application owns, in place (no copy):
    /// a `Vec<u8>` or `Box<[u8]>`. The region owns it until
    /// [`MemoryRegion::deregister`] gives it back.
    pub fn register(&self, buf: impl Into<Box<[u8]>>, access: Access) -> Result<MemoryRegion> {
        let region = Region::from_boxed(buf.into())
            .map_err(|_| Error::InvalidRequest("cannot register an empty buffer"))?;
        self.register_region(region, access)
    }

    /// `ibv_reg_mr` of an application's mapping, in place (e.g. huge
    /// pages: `MmapOptions::new().huge(Some(21)).map_anon()`).
    pub fn register_mmap(&self, map: memmap2::MmapMut, access: Access) -> Result<MemoryRegion> {
        if map.is_empty() {
            return Err(Error::InvalidRequest("cannot register an empty mapping"));
        }
        self.register_region(Region::from_mmap(map), access)
    }
}
