//! FFI to the libibverbs / librdmacm surface stag uses, including what
//! `rdma-sys` 0.3 lacks: `ibv_wr_flush`, `ibv_wr_atomic_write`, the
//! `device_cap_flags_ex` flush/atomic-write bits, `IBV_ACCESS_FLUSH_*`,
//! `IBV_QP_EX_WITH_*`, `IBV_FLUSH_*`, and out-of-line copies of the
//! static-inline verbs (`ibv_post_send`, `ibv_poll_cq`, `ibv_wr_*`, ...).
//!
//! # Layout
//!
//! - [`sys`] (re-exported at the root): bindgen output over the installed
//!   `infiniband/verbs.h` and `rdma/rdma_cma.h`, generated at build time with
//!   an allowlist. Enums are plain constants (`IBV_WR_SEND: ibv_wr_opcode`).
//! - The root defines the feature constants that older headers lack, with
//!   the upstream rdma-core / kernel uapi values. When the installed headers
//!   do have them, a compile-time assertion checks the two agree.
//! - `ibv_*` functions at the root (e.g. [`ibv_wr_flush`]) call the C
//!   wrappers in `wrappers.c`; they return `Err(Errno::UNSUPPORTED)` instead
//!   of calling a NULL provider pointer or a verb the headers lack.
//!
//! # Gates
//!
//! `build.rs` compiles small probes against the installed headers and sets
//! `cfg(has_ibv_wr_flush)`, `cfg(has_ibv_wr_atomic_write)`,
//! `cfg(has_ibv_access_flush)`, `cfg(has_ib_uverbs_device_flush)`,
//! `cfg(has_ib_uverbs_device_atomic_write)`. Callers do not need these cfgs:
//! they read [`HAS_WR_FLUSH`], [`HAS_WR_ATOMIC_WRITE`], ... and every
//! function exists in every configuration.
//!
//! # Versioned structs
//!
//! `struct ibv_qp_ex` grows with rdma-core releases (`wr_atomic_write` in
//! 44-ish, `wr_flush` after it). The wrappers check the function pointer for
//! NULL, but they cannot know how large the runtime library's struct is. A
//! caller must therefore only use [`ibv_wr_atomic_write`] / [`ibv_wr_flush`]
//! on a QP created by `ibv_create_qp_ex` with `IBV_QP_EX_WITH_ATOMIC_WRITE` /
//! [`IBV_QP_EX_WITH_FLUSH`] in `send_ops_flags`: a provider that accepted the
//! flag knows the field, so the runtime struct has it.
#![warn(clippy::undocumented_unsafe_blocks)]

use std::ffi::c_void;
use std::fmt;

/// Generated bindings (bindgen over the installed headers).
#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    missing_docs,
    clippy::all,
    clippy::undocumented_unsafe_blocks,
    clippy::missing_safety_doc,
    unsafe_op_in_unsafe_fn
)]
pub mod sys {
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}

pub use sys::*;

// ---------------------------------------------------------------------------
// Gates
// ---------------------------------------------------------------------------

/// The installed headers declare `ibv_wr_flush`, `IBV_QP_EX_WITH_FLUSH`,
/// `IBV_WR_FLUSH` and `struct ibv_qp_ex::wr_flush` (rdma-core >= 45).
pub const HAS_WR_FLUSH: bool = cfg!(has_ibv_wr_flush);
/// The installed headers declare `ibv_wr_atomic_write`,
/// `IBV_QP_EX_WITH_ATOMIC_WRITE` and `struct ibv_qp_ex::wr_atomic_write`.
pub const HAS_WR_ATOMIC_WRITE: bool = cfg!(has_ibv_wr_atomic_write);
/// The installed headers define `IBV_ACCESS_FLUSH_GLOBAL/PERSISTENT`.
pub const HAS_ACCESS_FLUSH: bool = cfg!(has_ibv_access_flush);
/// The installed kernel uapi headers define `IB_UVERBS_DEVICE_FLUSH_*`.
pub const HAS_DEVICE_FLUSH_BITS: bool = cfg!(has_ib_uverbs_device_flush);
/// The installed kernel uapi headers define `IB_UVERBS_DEVICE_ATOMIC_WRITE`.
pub const HAS_DEVICE_ATOMIC_WRITE_BIT: bool = cfg!(has_ib_uverbs_device_atomic_write);

// ---------------------------------------------------------------------------
// Constants older headers lack (upstream values; checked when present)
// ---------------------------------------------------------------------------

/// `IB_UVERBS_DEVICE_FLUSH_GLOBAL` (`rdma/ib_user_verbs.h`): bit 38 of
/// `ibv_device_attr_ex::device_cap_flags_ex`.
pub const IB_UVERBS_DEVICE_FLUSH_GLOBAL: u64 = 1 << 38;
/// `IB_UVERBS_DEVICE_FLUSH_PERSISTENT`: bit 39 of `device_cap_flags_ex`.
pub const IB_UVERBS_DEVICE_FLUSH_PERSISTENT: u64 = 1 << 39;
/// `IB_UVERBS_DEVICE_ATOMIC_WRITE`: bit 40 of `device_cap_flags_ex`.
pub const IB_UVERBS_DEVICE_ATOMIC_WRITE: u64 = 1 << 40;
/// Alias of [`IB_UVERBS_DEVICE_FLUSH_GLOBAL`] (rdma-core has no `IBV_` name).
pub const IBV_DEVICE_FLUSH_GLOBAL: u64 = IB_UVERBS_DEVICE_FLUSH_GLOBAL;
/// Alias of [`IB_UVERBS_DEVICE_FLUSH_PERSISTENT`].
pub const IBV_DEVICE_FLUSH_PERSISTENT: u64 = IB_UVERBS_DEVICE_FLUSH_PERSISTENT;
/// Alias of [`IB_UVERBS_DEVICE_ATOMIC_WRITE`].
pub const IBV_DEVICE_ATOMIC_WRITE: u64 = IB_UVERBS_DEVICE_ATOMIC_WRITE;

/// `IBV_ACCESS_FLUSH_GLOBAL` (`enum ibv_access_flags`).
pub const IBV_ACCESS_FLUSH_GLOBAL: ibv_access_flags = 1 << 8;
/// `IBV_ACCESS_FLUSH_PERSISTENT` (`enum ibv_access_flags`).
pub const IBV_ACCESS_FLUSH_PERSISTENT: ibv_access_flags = 1 << 9;

/// `IBV_QP_EX_WITH_FLUSH` (`enum ibv_qp_create_send_ops_flags`).
pub const IBV_QP_EX_WITH_FLUSH: ibv_qp_create_send_ops_flags = 1 << 11;
/// `IBV_QP_EX_WITH_ATOMIC_WRITE` (`enum ibv_qp_create_send_ops_flags`).
pub const IBV_QP_EX_WITH_ATOMIC_WRITE: ibv_qp_create_send_ops_flags = 1 << 12;

/// `IBV_WR_FLUSH` (`enum ibv_wr_opcode`).
pub const IBV_WR_FLUSH: ibv_wr_opcode = 14;
/// `IBV_WR_ATOMIC_WRITE` (`enum ibv_wr_opcode`).
pub const IBV_WR_ATOMIC_WRITE: ibv_wr_opcode = 15;
/// `IBV_WC_FLUSH` (`enum ibv_wc_opcode`).
pub const IBV_WC_FLUSH: ibv_wc_opcode = 8;
/// `IBV_WC_ATOMIC_WRITE` (`enum ibv_wc_opcode`).
pub const IBV_WC_ATOMIC_WRITE: ibv_wc_opcode = 9;

/// `IBV_FLUSH_GLOBAL` (`enum ibv_placement_type`), the `type` of a flush.
pub const IBV_FLUSH_GLOBAL: u8 = 1 << 0;
/// `IBV_FLUSH_PERSISTENT` (`enum ibv_placement_type`).
pub const IBV_FLUSH_PERSISTENT: u8 = 1 << 1;
/// `IBV_FLUSH_RANGE` (`enum ibv_selectivity_level`), the `level` of a flush.
pub const IBV_FLUSH_RANGE: u8 = 0;
/// `IBV_FLUSH_MR` (`enum ibv_selectivity_level`).
pub const IBV_FLUSH_MR: u8 = 1;

#[cfg(has_ib_uverbs_device_flush)]
const _: () = {
    assert!(IB_UVERBS_DEVICE_FLUSH_GLOBAL == sys::IB_UVERBS_DEVICE_FLUSH_GLOBAL as u64);
    assert!(IB_UVERBS_DEVICE_FLUSH_PERSISTENT == sys::IB_UVERBS_DEVICE_FLUSH_PERSISTENT as u64);
};
#[cfg(has_ib_uverbs_device_atomic_write)]
const _: () = assert!(IB_UVERBS_DEVICE_ATOMIC_WRITE == sys::IB_UVERBS_DEVICE_ATOMIC_WRITE as u64);
#[cfg(has_ibv_access_flush)]
const _: () = {
    assert!(IBV_ACCESS_FLUSH_GLOBAL == sys::IBV_ACCESS_FLUSH_GLOBAL);
    assert!(IBV_ACCESS_FLUSH_PERSISTENT == sys::IBV_ACCESS_FLUSH_PERSISTENT);
};
#[cfg(has_ibv_wr_flush)]
const _: () = {
    assert!(IBV_QP_EX_WITH_FLUSH == sys::IBV_QP_EX_WITH_FLUSH);
    assert!(IBV_WR_FLUSH == sys::IBV_WR_FLUSH);
    assert!(IBV_WC_FLUSH == sys::IBV_WC_FLUSH);
    assert!(IBV_FLUSH_GLOBAL as u32 == sys::IBV_FLUSH_GLOBAL);
    assert!(IBV_FLUSH_PERSISTENT as u32 == sys::IBV_FLUSH_PERSISTENT);
    assert!(IBV_FLUSH_RANGE as u32 == sys::IBV_FLUSH_RANGE);
    assert!(IBV_FLUSH_MR as u32 == sys::IBV_FLUSH_MR);
};
#[cfg(has_ibv_wr_atomic_write)]
const _: () = {
    assert!(IBV_QP_EX_WITH_ATOMIC_WRITE == sys::IBV_QP_EX_WITH_ATOMIC_WRITE);
    assert!(IBV_WR_ATOMIC_WRITE == sys::IBV_WR_ATOMIC_WRITE);
    assert!(IBV_WC_ATOMIC_WRITE == sys::IBV_WC_ATOMIC_WRITE);
};

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// A positive errno returned by a wrapper.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Errno(pub i32);

impl Errno {
    /// `EOPNOTSUPP`: the headers lack the verb, or the provider left the
    /// function pointer NULL.
    pub const UNSUPPORTED: Errno = Errno(libc::EOPNOTSUPP);

    /// Normalises a verbs return code: some providers (siw's `post_send`)
    /// return `-errno`, others `errno`.
    pub fn from_ret(ret: i32) -> Errno {
        Errno(ret.saturating_abs())
    }

    /// Whether this is [`Errno::UNSUPPORTED`].
    pub fn is_unsupported(self) -> bool {
        self == Self::UNSUPPORTED
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Errno({}: {})",
            self.0,
            std::io::Error::from_raw_os_error(self.0)
        )
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&std::io::Error::from_raw_os_error(self.0), f)
    }
}

impl std::error::Error for Errno {}

fn check(ret: i32) -> Result<(), Errno> {
    if ret == 0 {
        Ok(())
    } else {
        Err(Errno::from_ret(ret))
    }
}

// ---------------------------------------------------------------------------
// Rust entry points for the C wrappers
// ---------------------------------------------------------------------------

/// `ibv_get_device_list`, treating "no RDMA stack in this kernel" as an
/// empty list.
///
/// libibverbs returns NULL (errno `ENOSYS`/`ENOENT`) rather than an empty
/// list when `/sys/class/infiniband_verbs` does not exist, i.e. no
/// `ib_uverbs` module and so no devices. That case returns
/// `Ok((null, 0))`; any other NULL return is an error.
///
/// # Safety
/// A non-NULL list must be released exactly once with
/// [`ibv_free_device_list`], after the last use of its device pointers that
/// were not opened.
pub unsafe fn ibv_get_device_list() -> Result<(*mut *mut ibv_device, usize), Errno> {
    let mut n: i32 = 0;
    // SAFETY: n is a valid out-pointer; ownership of the list passes to the
    // caller per the contract.
    let list = unsafe { stag_ibv_get_device_list(&mut n) };
    if list.is_null() {
        let err = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        let no_stack = !std::path::Path::new("/sys/class/infiniband_verbs").exists();
        if no_stack && (err == libc::ENOSYS || err == libc::ENOENT || err == 0) {
            return Ok((std::ptr::null_mut(), 0));
        }
        return Err(Errno(if err == 0 { libc::ENODEV } else { err }));
    }
    Ok((list, usize::try_from(n).unwrap_or(0)))
}

/// `ibv_query_device_ex(ctx, NULL, attr)` into a zeroed attr.
///
/// Returns the attributes and whether the extended verb answered (`false`:
/// only `orig_attr` is valid, every extended field is 0). Fields beyond what
/// the runtime library or kernel filled are 0, i.e. "absent".
///
/// # Safety
/// `ctx` must be a live context from `ibv_open_device`.
pub unsafe fn ibv_query_device_ex(
    ctx: *mut ibv_context,
) -> Result<(ibv_device_attr_ex, bool), Errno> {
    let mut attr = ibv_device_attr_ex::default();
    let mut extended = 0;
    // SAFETY: ctx is live per the contract; attr/extended are valid for
    // writes of their full size, which is the size the wrapper passes on.
    let ret = unsafe { stag_ibv_query_device_ex(ctx, &mut attr, &mut extended) };
    check(ret).map(|()| (attr, extended != 0))
}

macro_rules! wr_fn {
    ($(#[$m:meta])* $name:ident => $c:ident ( $($arg:ident : $ty:ty),* )) => {
        $(#[$m])*
        ///
        /// Returns `Err(Errno::UNSUPPORTED)` if the provider left the
        /// function pointer NULL.
        ///
        /// # Safety
        /// `qp` must come from `ibv_qp_to_qp_ex` on a live QP created with
        /// `ibv_create_qp_ex` and `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`, used from
        /// one thread between `ibv_wr_start` and `ibv_wr_complete`/`abort`;
        /// any addresses must be registered memory that outlives the work
        /// request.
        pub unsafe fn $name(qp: *mut ibv_qp_ex $(, $arg: $ty)*) -> Result<(), Errno> {
            // SAFETY: the caller upholds the contract above; the wrapper
            // checks qp and the provider pointer for NULL before calling it.
            check(unsafe { $c(qp $(, $arg)*) })
        }
    };
}

wr_fn!(
    /// `ibv_wr_start`: begin a batch of work requests.
    ibv_wr_start => stag_ibv_wr_start()
);
wr_fn!(
    /// `ibv_wr_complete`: post the batch (returns the provider's errno).
    ibv_wr_complete => stag_ibv_wr_complete()
);
wr_fn!(
    /// `ibv_wr_abort`: discard the batch.
    ibv_wr_abort => stag_ibv_wr_abort()
);
wr_fn!(
    /// `ibv_wr_send`.
    ibv_wr_send => stag_ibv_wr_send()
);
wr_fn!(
    /// `ibv_wr_send_imm` (`imm_data` in network byte order).
    ibv_wr_send_imm => stag_ibv_wr_send_imm(imm_data: __be32)
);
wr_fn!(
    /// `ibv_wr_send_inv` (Send with Invalidate of the peer's `invalidate_rkey`).
    ibv_wr_send_inv => stag_ibv_wr_send_inv(invalidate_rkey: u32)
);
wr_fn!(
    /// `ibv_wr_rdma_write`.
    ibv_wr_rdma_write => stag_ibv_wr_rdma_write(rkey: u32, remote_addr: u64)
);
wr_fn!(
    /// `ibv_wr_rdma_write_imm` (`imm_data` in network byte order).
    ibv_wr_rdma_write_imm => stag_ibv_wr_rdma_write_imm(rkey: u32, remote_addr: u64, imm_data: __be32)
);
wr_fn!(
    /// `ibv_wr_rdma_read`.
    ibv_wr_rdma_read => stag_ibv_wr_rdma_read(rkey: u32, remote_addr: u64)
);
wr_fn!(
    /// `ibv_wr_atomic_fetch_add`.
    ibv_wr_atomic_fetch_add => stag_ibv_wr_atomic_fetch_add(rkey: u32, remote_addr: u64, add: u64)
);
wr_fn!(
    /// `ibv_wr_atomic_cmp_swp`.
    ibv_wr_atomic_cmp_swp => stag_ibv_wr_atomic_cmp_swp(rkey: u32, remote_addr: u64, compare: u64, swap: u64)
);
wr_fn!(
    /// `ibv_wr_set_sge`.
    ibv_wr_set_sge => stag_ibv_wr_set_sge(lkey: u32, addr: u64, length: u32)
);
wr_fn!(
    /// `ibv_wr_set_sge_list` (`sg_list` must hold `num_sge` entries).
    ibv_wr_set_sge_list => stag_ibv_wr_set_sge_list(num_sge: usize, sg_list: *const ibv_sge)
);
wr_fn!(
    /// `ibv_wr_set_inline_data` (the provider copies `length` bytes at `addr`).
    ibv_wr_set_inline_data => stag_ibv_wr_set_inline_data(addr: *mut c_void, length: usize)
);

/// `ibv_wr_atomic_write`: 8 bytes at `*value` written atomically at
/// `remote_addr`.
///
/// Returns `Err(Errno::UNSUPPORTED)` when the headers lack it
/// ([`HAS_WR_ATOMIC_WRITE`] false) or the provider pointer is NULL.
///
/// # Safety
/// As for [`ibv_wr_send`], and the QP must have been created with
/// [`IBV_QP_EX_WITH_ATOMIC_WRITE`] (so the runtime `ibv_qp_ex` has the field).
pub unsafe fn ibv_wr_atomic_write(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    value: &[u8; 8],
) -> Result<(), Errno> {
    // SAFETY: contract above; the wrapper returns EOPNOTSUPP without
    // touching qp when built without atomic write, and checks NULL otherwise.
    check(unsafe { stag_ibv_wr_atomic_write(qp, rkey, remote_addr, value.as_ptr().cast()) })
}

/// `ibv_wr_flush`: make `len` bytes at `remote_addr` (placement `ty`:
/// [`IBV_FLUSH_GLOBAL`]/[`IBV_FLUSH_PERSISTENT`]; `level`:
/// [`IBV_FLUSH_RANGE`]/[`IBV_FLUSH_MR`]) visible/persistent at the target.
///
/// Returns `Err(Errno::UNSUPPORTED)` when the headers lack it
/// ([`HAS_WR_FLUSH`] false) or the provider pointer is NULL.
///
/// # Safety
/// As for [`ibv_wr_send`], and the QP must have been created with
/// [`IBV_QP_EX_WITH_FLUSH`] (so the runtime `ibv_qp_ex` has the field).
pub unsafe fn ibv_wr_flush(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    len: usize,
    ty: u8,
    level: u8,
) -> Result<(), Errno> {
    // SAFETY: contract above; the wrapper returns EOPNOTSUPP without
    // touching qp when built without flush, and checks NULL otherwise.
    check(unsafe { stag_ibv_wr_flush(qp, rkey, remote_addr, len, ty, level) })
}

/// Decoded `device_cap_flags_ex` bits stag cares about.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CapFlagsEx {
    /// `IB_UVERBS_DEVICE_FLUSH_GLOBAL`.
    pub flush_global: bool,
    /// `IB_UVERBS_DEVICE_FLUSH_PERSISTENT`.
    pub flush_persistent: bool,
    /// `IB_UVERBS_DEVICE_ATOMIC_WRITE`.
    pub atomic_write: bool,
}

impl CapFlagsEx {
    /// Decodes `ibv_device_attr_ex::device_cap_flags_ex`. The bits are read
    /// by value, so a newer kernel reporting them is seen even when the
    /// installed headers predate them.
    pub fn from_bits(flags: u64) -> Self {
        CapFlagsEx {
            flush_global: flags & IB_UVERBS_DEVICE_FLUSH_GLOBAL != 0,
            flush_persistent: flags & IB_UVERBS_DEVICE_FLUSH_PERSISTENT != 0,
            atomic_write: flags & IB_UVERBS_DEVICE_ATOMIC_WRITE != 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_normalises_negative() {
        assert_eq!(Errno::from_ret(-22), Errno(libc::EINVAL));
        assert_eq!(Errno::from_ret(22), Errno(libc::EINVAL));
        assert!(Errno::from_ret(-libc::EOPNOTSUPP).is_unsupported());
    }

    #[test]
    fn cap_flags_decode() {
        let f = CapFlagsEx::from_bits((1 << 38) | (1 << 40));
        assert!(f.flush_global && !f.flush_persistent && f.atomic_write);
        assert_eq!(CapFlagsEx::from_bits(0), CapFlagsEx::default());
    }
}
