//! Low-level safe backend over libibverbs and librdmacm (via
//! `rdma-sys-ext`), one module per verbs object, sideway-style:
//!
//! - [`device`]: device list, [`Context`], [`DeviceAttr`]
//! - [`pd`]: [`ProtectionDomain`]
//! - [`mr`]: [`MemoryRegion`], [`AccessFlags`] (`reg_mr` is `unsafe`)
//! - [`cq`]: [`CompletionQueue`], [`CompletionChannel`], [`WorkCompletion`]
//! - [`qp`]: [`QueuePair`] (RC), legacy `post_send`/`post_recv`, and the
//!   extended `ibv_wr_*` batch ([`WrBatch`]) incl. atomic write and flush
//! - [`srq`]: [`SharedReceiveQueue`] (`post_recv` is `unsafe`)
//! - [`cm`]: librdmacm [`EventChannel`], [`CmId`], [`CmEvent`]
//!
//! Every child holds an `Arc` to its parent and its `Drop` calls the
//! destroy verb, so teardown order holds by construction. All FFI `unsafe`
//! of the verbs crate lives in this module.
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod cm;
pub mod cq;
pub mod device;
pub mod mr;
pub mod pd;
pub mod probe;
pub mod qp;
pub mod srq;
pub mod wr;

pub use cm::{CmEvent, CmEventType, CmId, ConnParam, EventChannel};
pub use cq::{CompletionChannel, CompletionQueue, WcOpcode, WcStatus, WorkCompletion};
pub use device::{devices, AtomicCap, Context, DeviceAttr, DeviceInfo, NodeType, Transport};
pub use mr::{AccessFlags, MemoryRegion};
pub use pd::ProtectionDomain;
pub use probe::{probe_wr_api, WrApi};
pub use qp::{QpInitAttr, QpState, QueuePair, WrBatch};
pub use srq::SharedReceiveQueue;
pub use wr::{FlushLevel, FlushType, RecvWr, SendFlags, SendOp, SendOps, SendWr, Sge};

/// Whether the installed rdma-core has `ibv_wr_flush` (build-time probe).
pub const HAS_WR_FLUSH: bool = rdma_sys_ext::HAS_WR_FLUSH;
/// Whether the installed rdma-core has `ibv_wr_atomic_write`.
pub const HAS_WR_ATOMIC_WRITE: bool = rdma_sys_ext::HAS_WR_ATOMIC_WRITE;

/// A failed verb: which call, and the positive errno it reported.
///
/// Providers disagree on sign (siw's `post_send` returns `-EINVAL` for an
/// unsupported opcode, others `EINVAL`); `errno` is always positive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {} (errno {errno})", std::io::Error::from_raw_os_error(*errno))]
pub struct IbvError {
    /// The C verb (or the Rust entry point that validated arguments).
    pub call: &'static str,
    /// Positive errno.
    pub errno: i32,
}

impl IbvError {
    /// Builds an error from a verbs return code of either sign.
    pub fn new(call: &'static str, ret: i32) -> Self {
        let errno = ret.saturating_abs();
        let err = IbvError {
            call,
            errno: if errno == 0 { libc::EIO } else { errno },
        };
        tracing::debug!(call, errno = err.errno, "verb failed");
        err
    }

    /// Builds an error from the thread's current `errno` (verbs that return
    /// NULL or -1).
    pub fn last(call: &'static str) -> Self {
        let e = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        Self::new(call, e)
    }

    /// `EOPNOTSUPP` for `call`.
    pub fn unsupported(call: &'static str) -> Self {
        IbvError {
            call,
            errno: libc::EOPNOTSUPP,
        }
    }

    /// `EINVAL` for `call`.
    pub fn invalid(call: &'static str) -> Self {
        IbvError {
            call,
            errno: libc::EINVAL,
        }
    }

    /// The installed rdma-core or the provider lacks the operation.
    pub fn is_unsupported(&self) -> bool {
        self.errno == libc::EOPNOTSUPP || self.errno == libc::ENOSYS
    }
}

impl From<(&'static str, rdma_sys_ext::Errno)> for IbvError {
    fn from((call, e): (&'static str, rdma_sys_ext::Errno)) -> Self {
        IbvError::new(call, e.0)
    }
}

/// Result alias for this module.
pub type Result<T, E = IbvError> = std::result::Result<T, E>;

/// Maps a verbs int return (0 = ok, else ±errno) to a `Result`.
pub(crate) fn check(call: &'static str, ret: i32) -> Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(IbvError::new(call, ret))
    }
}

/// Maps a verbs int return where failure is -1 + errno.
pub(crate) fn check_errno(call: &'static str, ret: i32) -> Result<()> {
    if ret == 0 {
        Ok(())
    } else if ret == -1 {
        Err(IbvError::last(call))
    } else {
        Err(IbvError::new(call, ret))
    }
}

/// Copies a NUL-terminated C char array into a `String`.
pub(crate) fn c_chars(buf: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_normalises_sign() {
        assert_eq!(IbvError::new("ibv_post_send", -22).errno, libc::EINVAL);
        assert_eq!(IbvError::new("ibv_post_send", 22).errno, libc::EINVAL);
        assert!(IbvError::new("x", -libc::EOPNOTSUPP).is_unsupported());
        let s = IbvError::new("ibv_post_send", -22).to_string();
        assert!(s.starts_with("ibv_post_send: "), "{s}");
        assert!(s.contains("errno 22"), "{s}");
    }

    #[test]
    fn check_helpers() {
        assert!(check("a", 0).is_ok());
        assert_eq!(check("a", -5).unwrap_err().errno, 5);
        assert_eq!(check_errno("a", 12).unwrap_err().errno, 12);
    }
}
