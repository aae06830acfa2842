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
