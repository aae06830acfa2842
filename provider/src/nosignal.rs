//! Socket writes that never raise `SIGPIPE`.
//!
//! stag runs inside other people's programs (the rdma-core plugin), where
//! `SIGPIPE` keeps its default action: a plain `write`/`writev` to a stream
//! the peer has reset kills the whole process (exit 141). Every write to a
//! peer's socket goes through here with `MSG_NOSIGNAL`, so the error comes
//! back as `EPIPE` instead and the QP, not the program, fails. No signal
//! disposition is touched: the application's own stays as it set it.

use std::io::{self, IoSlice, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use nix::sys::socket::{send, sendmsg, MsgFlags};

/// `writev` with `MSG_NOSIGNAL`: returns how many octets the socket took.
///
/// A gather list of one slice (every FPDU whose payload is copied in: a
/// small message, a header alone) goes out through `send`, which skips
/// `sendmsg`'s copy and check of a `msghdr` and an iovec array: measured
/// at about a quarter of a microsecond per call here, on a path where an
/// 8-octet Write costs about five.
pub(crate) fn send_vectored(sock: &TcpStream, iov: &[IoSlice<'_>]) -> io::Result<usize> {
    let fd = sock.as_raw_fd();
    match iov {
        [one] => send(fd, one, MsgFlags::MSG_NOSIGNAL),
        _ => sendmsg::<()>(fd, iov, &[], MsgFlags::MSG_NOSIGNAL, None),
    }
    .map_err(io::Error::from)
}

/// A [`Write`] over a stream whose writes never raise `SIGPIPE` (for the
/// MPA exchange's `write_all`).
pub(crate) struct NoSignal<'a>(pub(crate) &'a TcpStream);

impl Write for NoSignal<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        send_vectored(self.0, &[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        send_vectored(self.0, bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Shutdown, TcpListener};

    /// A stream whose peer is gone: the writes fail with an errno. (The
    /// Rust test harness ignores SIGPIPE, so the signal itself is checked
    /// from C: `provider/plugin/tests/c/faults.c`, case `sigpipe`.)
    #[test]
    fn writes_to_a_reset_peer_return_epipe() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        // Unread data at close makes the kernel reset the connection.
        (&c).write_all(b"x").unwrap();
        s.shutdown(Shutdown::Both).unwrap();
        drop(s);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let mut w = NoSignal(&c);
        let mut last = Ok(0);
        for _ in 0..100 {
            last = w.write(&[0u8; 4096]);
            if last.is_err() {
                break;
            }
        }
        let err = last.expect_err("writes to a closed peer fail");
        assert!(
            matches!(
                err.raw_os_error(),
                Some(libc::EPIPE) | Some(libc::ECONNRESET)
            ),
            "{err}"
        );
    }
}
