//! errno and the C boundary: every entry point runs inside [`guard`], so a
//! bug becomes an errno and a failed call, never an unwind into C.

use provider::device::DeviceError;
use provider::qp::PostError;

/// Set the calling thread's `errno`.
pub(crate) fn set(code: i32) {
    // SAFETY: __errno_location returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() = code };
}

/// Run an entry point's body; a panic is logged and turned into
/// `on_panic` with errno `EIO`.
pub(crate) fn guard<R>(what: &'static str, on_panic: R, body: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(_) => {
            tracing::error!(
                verb = what,
                "internal error (panic) in stag's rdma-core plugin"
            );
            set(libc::EIO);
            on_panic
        }
    }
}

/// The errno rdma-core's providers give for a device-level failure.
pub(crate) fn of_device(e: &DeviceError) -> i32 {
    match e {
        DeviceError::Io(io) => io.raw_os_error().unwrap_or(libc::EIO),
        DeviceError::Mpa(_) => libc::ECONNRESET,
        DeviceError::Rejected(_) => libc::ECONNREFUSED,
        DeviceError::Timeout => libc::ETIMEDOUT,
        // siw: a post on a QP that is not (yet) RTS.
        DeviceError::InvalidState => libc::ENOTCONN,
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
