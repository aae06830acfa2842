//! errno and the C boundary: every entry point runs inside one of the
//! guards below, so a bug becomes an errno and a failed call, never an
//! unwind into C. Two conventions, one map:
//!
//! - a verb (`ibv_*` op) returns its errno, or sets it and returns NULL
//!   ([`guard`]);
//! - an rdma_cm call returns -1 (or NULL) and sets errno ([`cm_int`],
//!   [`cm_ptr`]; [`guard`] for the calls that return a value).
//!
//! A `DeviceError` becomes an errno in one place ([`of_device`],
//! [`of_cm`]).

use std::ffi::c_int;

use provider::device::DeviceError;
use provider::qp::PostError;

/// An errno value.
pub(crate) type Errno = c_int;

/// Set the calling thread's `errno`.
pub(crate) fn set(code: Errno) {
    // SAFETY: __errno_location returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() = code };
}

/// Run an entry point's body; a panic is logged and turned into
/// `on_panic` with errno `EIO`.
pub(crate) fn guard<R>(what: &'static str, on_panic: R, body: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(_) => {
            tracing::error!(function = what, "internal error (panic) in stag's plugin");
            set(libc::EIO);
            on_panic
        }
    }
}

/// An rdma_cm call returning `int`: 0, or -1 with errno set.
pub(crate) fn cm_int(what: &'static str, body: impl FnOnce() -> Result<(), Errno>) -> c_int {
    crate::log::init();
    match guard(what, Err(libc::EIO), body) {
        Ok(()) => 0,
        Err(e) => {
            set(e);
            -1
        }
    }
}

/// An rdma_cm call returning a pointer: it, or NULL with errno set.
pub(crate) fn cm_ptr<T>(
    what: &'static str,
    body: impl FnOnce() -> Result<*mut T, Errno>,
) -> *mut T {
    crate::log::init();
    match guard(what, Err(libc::EIO), body) {
        Ok(p) => p,
        Err(e) => {
            set(e);
            std::ptr::null_mut()
        }
    }
}

/// The errno a verb (`ibv_*`, returned or set) gives for a device-level
/// failure, as rdma-core's providers do.
pub(crate) fn of_device(e: &DeviceError) -> i32 {
    // siw: a post on a QP that is not (yet) RTS.
    of(e, libc::ENOTCONN)
}

/// The errno an rdma_cm call (`-1` and errno set) gives for the same
/// failure, as librdmacm does. One difference from the verbs: an id or
/// QP in the wrong state for the call is EINVAL there.
pub(crate) fn of_cm(e: &DeviceError) -> i32 {
    of(e, libc::EINVAL)
}

/// The one map, but for the wrong-state errno of the caller's convention.
fn of(e: &DeviceError, invalid_state: i32) -> i32 {
    use std::io::ErrorKind;
    match e {
        DeviceError::Io(io) => io.raw_os_error().unwrap_or(match io.kind() {
            ErrorKind::TimedOut | ErrorKind::WouldBlock => libc::ETIMEDOUT,
            ErrorKind::ConnectionRefused => libc::ECONNREFUSED,
            ErrorKind::AddrInUse => libc::EADDRINUSE,
            ErrorKind::AddrNotAvailable => libc::EADDRNOTAVAIL,
            _ => libc::EIO,
        }),
        // The stream ended under the MPA exchange; anything else the peer
        // sent there broke the protocol.
        DeviceError::Mpa(provider::wire::Error::LlpClosed) => libc::ECONNRESET,
        DeviceError::Mpa(_) => libc::EPROTO,
        DeviceError::Rejected(_) => libc::ECONNREFUSED,
        DeviceError::Timeout => libc::ETIMEDOUT,
        DeviceError::InvalidState => invalid_state,
        DeviceError::Post(p) => of_post(p),
        DeviceError::Register(_) => libc::EINVAL,
        DeviceError::Sys(errno) => *errno as i32,
        DeviceError::ListenerClosed => libc::EINVAL,
    }
}

/// The errno for a refused post: a full queue is ENOMEM as in every
/// rdma-core provider; a malformed WR is EINVAL.
pub(crate) fn of_post(e: &PostError) -> i32 {
    match e {
        PostError::SendQueueFull(_) => libc::ENOMEM,
        PostError::Recv(provider::srq::PostRecvError::Full(_)) => libc::ENOMEM,
        _ => libc::EINVAL,
    }
}
