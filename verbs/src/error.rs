//! The verbs error type.

use crate::caps::OpKind;

/// Everything a verbs call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No device of that name.
    #[error("no RDMA device named {0:?}")]
    NoDevice(String),
    /// The device can do this neither natively nor through emulation.
    #[error("{op} is not supported on {device}: {why}")]
    Unsupported {
        /// The operation.
        op: OpKind,
        /// The device.
        device: String,
        /// Why not.
        why: String,
    },
    /// stag does not offer this on this kind of device yet.
    #[error("not implemented: {0}")]
    NotImplemented(&'static str),
    /// The send queue (or an emulation resource it needs) is full: the
    /// same error on every backend (`ENOMEM` from libibverbs).
    #[error("send queue full")]
    QueueFull,
    /// The work request is malformed (wrong SGE count or size, …).
    #[error("invalid work request: {0}")]
    InvalidRequest(&'static str),
    /// An object of one device or PD used with another.
    #[error("objects from different devices or protection domains")]
    Mismatch,
    /// The userspace provider refused.
    #[error(transparent)]
    Provider(#[from] provider::device::DeviceError),
    /// libibverbs or librdmacm refused.
    #[error(transparent)]
    Ibv(#[from] crate::ibv::IbvError),
    /// An access outside a memory region.
    #[error(transparent)]
    Region(#[from] provider::region::RegionError),
    /// A system call failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The connection could not be set up.
    #[error("connection failed: {0}")]
    Connect(String),
    /// No answer in time.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// The peer rejected the connection, with its private data.
    #[error("connection rejected by the peer")]
    Rejected(Vec<u8>),
}

/// The result of a verbs call.
pub type Result<T> = std::result::Result<T, Error>;
