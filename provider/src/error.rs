//! The device-level verbs' one error type.
//!
//! Its own module so that the driver, the listener and the handles in
//! [`crate::device`] all return it without depending on each other.

use crate::mem::RegisterError;
use crate::qp::PostError;

/// Errors of the device-level verbs.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A socket or system call failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The MPA exchange failed or the peer spoke something else.
    #[error("MPA: {0}")]
    Mpa(#[from] crate::wire::Error),
    /// The peer rejected the connection, with its private data.
    #[error("connection rejected by peer")]
    Rejected(Vec<u8>),
    /// The MPA exchange did not finish in time.
    #[error("connection setup timed out")]
    Timeout,
    /// The QP is not in a state that allows this.
    #[error("QP in wrong state for this")]
    InvalidState,
    /// Posting failed.
    #[error(transparent)]
    Post(#[from] PostError),
    /// Registration failed.
    #[error(transparent)]
    Register(#[from] RegisterError),
    /// epoll/eventfd failed.
    #[error("system: {0}")]
    Sys(#[from] nix::Error),
    /// The listener was shut down.
    #[error("listener shut down")]
    ListenerClosed,
}
