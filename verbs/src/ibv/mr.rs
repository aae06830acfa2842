//! Memory regions: `ibv_reg_mr` / `ibv_dereg_mr`.

use super::pd::ProtectionDomain;
use super::{IbvError, Result};
use rdma_sys_ext as ffi;
use std::ops::{BitOr, BitOrAssign};
use std::sync::Arc;

/// `enum ibv_access_flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct AccessFlags(pub u32);

impl AccessFlags {
    /// No access beyond local read.
    pub const EMPTY: Self = AccessFlags(0);
    /// `IBV_ACCESS_LOCAL_WRITE`.
    pub const LOCAL_WRITE: Self = AccessFlags(ffi::IBV_ACCESS_LOCAL_WRITE);
    /// `IBV_ACCESS_REMOTE_WRITE`.
    pub const REMOTE_WRITE: Self = AccessFlags(ffi::IBV_ACCESS_REMOTE_WRITE);
    /// `IBV_ACCESS_REMOTE_READ`.
    pub const REMOTE_READ: Self = AccessFlags(ffi::IBV_ACCESS_REMOTE_READ);
    /// `IBV_ACCESS_REMOTE_ATOMIC`.
    pub const REMOTE_ATOMIC: Self = AccessFlags(ffi::IBV_ACCESS_REMOTE_ATOMIC);
    /// `IBV_ACCESS_RELAXED_ORDERING` (optional: ignored if unsupported).
    pub const RELAXED_ORDERING: Self = AccessFlags(ffi::IBV_ACCESS_RELAXED_ORDERING);
    /// `IBV_ACCESS_FLUSH_GLOBAL` (device must report flush_global).
    pub const FLUSH_GLOBAL: Self = AccessFlags(ffi::IBV_ACCESS_FLUSH_GLOBAL);
    /// `IBV_ACCESS_FLUSH_PERSISTENT` (device must report flush_persistent).
    pub const FLUSH_PERSISTENT: Self = AccessFlags(ffi::IBV_ACCESS_FLUSH_PERSISTENT);

    /// Whether every bit of `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for AccessFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        AccessFlags(self.0 | rhs.0)
    }
}

impl BitOrAssign for AccessFlags {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}

/// A registered memory region, holding its [`ProtectionDomain`].
///
/// The region does not own the memory: the layer above must keep the
/// buffer alive (and not move it) until this is dropped.
pub struct MemoryRegion {
    mr: *mut ffi::ibv_mr,
    pd: Arc<ProtectionDomain>,
    access: AccessFlags,
}

// SAFETY: the ibv_mr is only read (lkey/rkey/addr/length) after creation;
// dereg happens once in Drop.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl ProtectionDomain {
    /// `ibv_reg_mr` over `[addr, addr + len)`.
    ///
    /// Flush access flags are refused with `EOPNOTSUPP` unless the device
    /// reports the matching `device_cap_flags_ex` bit.
    ///
    /// # Safety
    /// The range must be valid memory of this process that stays mapped
    /// (and, for remote or local write access, writable and not otherwise
    /// aliased by Rust references that assume immutability) until the
    /// returned region is dropped.
    pub unsafe fn reg_mr(
        self: &Arc<Self>,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(IbvError::invalid("ibv_reg_mr"));
        }
        let wants_global = access.contains(AccessFlags::FLUSH_GLOBAL);
        let wants_persistent = access.contains(AccessFlags::FLUSH_PERSISTENT);
        if wants_global || wants_persistent {
            let attr = self.context().query_device()?;
            if (wants_global && !attr.flush_global) || (wants_persistent && !attr.flush_persistent)
            {
                return Err(IbvError::unsupported("ibv_reg_mr"));
            }
        }
        // SAFETY: pd is live; the caller guarantees the range per the
        // contract above.
        let mr = unsafe { ffi::stag_ibv_reg_mr(self.pd, addr.cast(), len, access.0) };
        if mr.is_null() {
            return Err(IbvError::last("ibv_reg_mr"));
        }
        let mr = MemoryRegion {
            mr,
            pd: Arc::clone(self),
            access,
        };
        tracing::trace!(?mr, "reg_mr");
        Ok(mr)
    }
}

impl MemoryRegion {
    fn raw(&self) -> &ffi::ibv_mr {
        // SAFETY: mr is live until Drop; the fields read are immutable.
        unsafe { &*self.mr }
    }

    /// `lkey`.
    pub fn lkey(&self) -> u32 {
        self.raw().lkey
    }

    /// `rkey`.
    pub fn rkey(&self) -> u32 {
        self.raw().rkey
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.raw().addr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.raw().length
    }

    /// Never true (zero-length registrations are refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Access flags requested at registration.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// The parent PD.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: mr came from ibv_reg_mr and is deregistered once.
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_dereg_mr failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_values() {
        let a = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        assert_eq!(a.0, 1 | 4);
        assert!(a.contains(AccessFlags::REMOTE_READ));
        assert!(!a.contains(AccessFlags::REMOTE_WRITE));
        assert_eq!(AccessFlags::FLUSH_GLOBAL.0, 1 << 8);
        assert_eq!(AccessFlags::FLUSH_PERSISTENT.0, 1 << 9);
    }
}
