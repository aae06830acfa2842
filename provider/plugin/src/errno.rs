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
