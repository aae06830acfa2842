//! A closed stream's bounded wait for its peer: the end of a QP's stream
//! with a deadline that ends in a reset.
//!
//! A QP's stream is shut with octets still queued for the peer (Sends that
//! completed when the socket took them, then the FIN). A peer that reads
//! gets them and the close at once. A peer that reads no more (a stag0
//! receiver holding a message that waits for a Receive, or a program that
//! stopped) never reaches the FIN behind them, and so never learns of the
//! disconnect: once the peer has taken nothing for [`LINGER_LIMIT`], the
//! stream is reset instead, which it sees whether it reads or not.
//!
//! The same holds for a QP moved to Error (`rdma_disconnect`) and not
//! destroyed: its driver watches the stream ([`CloseWatch`]) and resets it
//! in place ([`reset_now`]), as siw does when its close times out, so the
//! connection is not held until the QP is destroyed.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use nix::sys::socket::{setsockopt, sockopt};
use tracing::debug;

/// How long a shut stream may go without the peer taking any of what is
/// queued for it before it is reset.
pub(crate) const LINGER_LIMIT: Duration = Duration::from_secs(1);

/// Wait (blocking) until the peer has acknowledged everything queued on
/// `sock`, FIN included, or has taken nothing for [`LINGER_LIMIT`]; in
/// that case arm a reset for when the socket is closed. Returns whether
/// it did.
pub(crate) fn drain_or_reset(sock: &TcpStream) -> bool {
    if sock.peer_addr().is_err() {
        // Reset already ([`reset_now`]), or never connected.
        return false;
    }
    let Ok(mut left) = unacked(sock) else {
        return false;
    };
    let mut progress = Instant::now();
    // On loopback the peer's kernel acknowledges within microseconds:
    // start short, so that a destroy is not made slower than that.
    let mut nap = Duration::from_micros(10);
    while left > 0 {
        if progress.elapsed() >= LINGER_LIMIT {
            debug!(left, "the peer takes nothing more: reset on close");
            let reset = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            return setsockopt(sock, sockopt::Linger, &reset).is_ok();
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(10));
        match unacked(sock) {
            Ok(now) if now < left => {
                left = now;
                progress = Instant::now();
            }
            Ok(_) => {}
            // No longer a connected stream (the peer reset it).
            Err(_) => return false,
        }
    }
    false
}

/// What [`CloseWatch::check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stall {
    /// Nothing is waiting for the peer (or the stream is gone).
    None,
    /// The peer has taken nothing lately: look again at this instant.
    Until(Instant),
    /// It took nothing for [`LINGER_LIMIT`]: the stream was reset.
    Reset,
}

/// The watch over a stream in Error that still has octets for its peer.
#[derive(Debug, Default)]
pub(crate) struct CloseWatch {
    /// Since when the peer took nothing, and how much it had taken then.
    stalled: Option<(Instant, u64)>,
    reset: bool,
}

impl CloseWatch {
    /// Look at `sock`, on which the QP has written `written` octets so
    /// far, with more still queued above it if `pending`; reset the
    /// stream once the peer has taken nothing for [`LINGER_LIMIT`].
    pub(crate) fn check(
        &mut self,
        sock: &TcpStream,
        written: u64,
        pending: bool,
        now: Instant,
    ) -> Stall {
        if self.reset {
            return Stall::None;
        }
        let outq = match unacked(sock) {
            Ok(n) if pending || n > 0 => n as u64,
            _ => {
                self.stalled = None;
                return Stall::None;
            }
        };
        let taken = written.wrapping_sub(outq);
        match self.stalled {
            Some((since, was)) if was == taken => {
                if now.duration_since(since) < LINGER_LIMIT {
                    return Stall::Until(since + LINGER_LIMIT);
                }
                self.reset = true;
                reset_now(sock);
                Stall::Reset
            }
            _ => {
                self.stalled = Some((now, taken));
                Stall::Until(now + LINGER_LIMIT)
            }
        }
    }
}

/// Reset the stream now and keep the descriptor (the QP still names it
/// until it is destroyed): `connect(AF_UNSPEC)` disconnects a TCP socket,
/// with a reset to a peer in any synchronized state.
pub(crate) fn reset_now(sock: &TcpStream) {
    // SAFETY: an all-zero sockaddr is a valid value of the plain C struct.
    let mut unspec: libc::sockaddr = unsafe { std::mem::zeroed() };
    unspec.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
    // SAFETY: connect(2) on a socket descriptor this borrow keeps open,
    // reading `size_of::<sockaddr>()` bytes of a live local.
    let rc = unsafe {
        libc::connect(
            sock.as_raw_fd(),
            &unspec,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        debug!(error = %io::Error::last_os_error(), "stream reset failed");
    }
}

/// Octets (and a FIN) the peer has not acknowledged yet (`SIOCOUTQ`).
fn unacked(sock: &TcpStream) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) on a socket descriptor this borrow keeps
    // open writes one c_int, through a pointer to a live local.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n.max(0) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener};

    /// A peer that reads everything: no reset, its read ends at the FIN.
    #[test]
    fn a_reading_peer_gets_the_data_and_the_close() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            s.read_to_end(&mut all).map(|_| all.len())
        });
        c.write_all(&vec![7u8; 8 << 20]).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        assert!(!drain_or_reset(&c));
        drop(c);
        assert_eq!(reader.join().unwrap().unwrap(), 8 << 20);
    }

    /// A peer that reads nothing: the close reaches it as a reset, after
    /// the limit, although it never reads to the FIN.
    #[test]
    fn a_peer_that_reads_nothing_is_reset() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        c.set_nonblocking(true).unwrap();
        // Fill both socket buffers.
        let chunk = vec![7u8; 1 << 20];
        while (&c).write(&chunk).is_ok() {}
        c.shutdown(Shutdown::Write).unwrap();
        let t0 = Instant::now();
        assert!(drain_or_reset(&c), "the peer read nothing");
        assert!(t0.elapsed() >= LINGER_LIMIT);
        drop(c);
        let mut buf = vec![0u8; 1 << 20];
        let end = loop {
            match s.read(&mut buf) {
                Ok(0) => break Ok(()),
                Ok(_) => {}
                Err(e) => break Err(e.kind()),
            }
        };
        assert_eq!(end, Err(io::ErrorKind::ConnectionReset));
    }
}
