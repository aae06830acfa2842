//! Connection establishment over TCP, both sides: the blocking socket IO
//! around [`crate::setup`]'s sans-IO MPA exchange. The active side
//! ([`QueuePair::connect`]) dials and runs the initiator; the passive side
//! is a [`ConnRequest`] that the [`Listener`](crate::listener::Listener)
//! read whole, which the application accepts onto a QP or rejects. Either
//! way the QP's driver then takes the socket (`QpShared::start`).

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::DeviceError;
use crate::nosignal::NoSignal;
use crate::queue_pair::QueuePair;
use crate::setup::{Answer, Initiator, MpaParams, Request};

/// How long connection setup may take before it fails.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

impl QueuePair {
    /// Active side: connect to `addr` and run the MPA exchange.
    /// Returns the responder's private data.
    pub fn connect(
        &self,
        addr: impl ToSocketAddrs,
        params: &MpaParams,
    ) -> Result<Vec<u8>, DeviceError> {
        let addr = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::new(ErrorKind::InvalidInput, "no address"))?;
        let sock = TcpStream::connect_timeout(&addr, SETUP_TIMEOUT)?;
        self.connect_stream(sock, params)
    }

    /// Active side over `sock`, a TCP connection the caller made (rdma_cm
    /// binds it to the source port the application named): run the MPA
    /// exchange. Returns the responder's private data.
    pub fn connect_stream(
        &self,
        mut sock: TcpStream,
        params: &MpaParams,
    ) -> Result<Vec<u8>, DeviceError> {
        sock.set_nodelay(true)?;
        let (mut initiator, request) = Initiator::new(params.clone())?;
        NoSignal(&sock).write_all(&request)?;
        let (answer, leftover) = read_until(&mut sock, |input| initiator.handle_bytes(input))?;
        match answer {
            Answer::Rejected(pd) => Err(DeviceError::Rejected(pd)),
            Answer::Accepted(neg) => {
                let private = neg.peer_private_data.clone();
                self.shared().start(sock, neg, &leftover)?;
                Ok(private)
            }
        }
    }
}

/// Read from a blocking socket until `step` yields a value or the setup
/// deadline passes; returns the value and the bytes that followed it.
fn read_until<T>(
    sock: &mut TcpStream,
    mut step: impl FnMut(&mut &[u8]) -> crate::wire::Result<Option<T>>,
) -> Result<(T, Vec<u8>), DeviceError> {
    let deadline = Instant::now() + SETUP_TIMEOUT;
    let mut buf = [0u8; 2048];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(DeviceError::Timeout);
        }
        sock.set_read_timeout(Some(left))?;
        let n = match sock.read(&mut buf) {
            Ok(0) => return Err(DeviceError::Mpa(crate::wire::Error::LlpClosed)),
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(DeviceError::Timeout)
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        let mut input = &buf[..n];
        if let Some(v) = step(&mut input)? {
            sock.set_read_timeout(None)?;
            return Ok((v, input.to_vec()));
        }
    }
}

/// A connection request waiting for the application's decision.
#[derive(Debug)]
pub struct ConnRequest {
    sock: TcpStream,
    peer: SocketAddr,
    request: Request,
    leftover: Vec<u8>,
}

impl ConnRequest {
    /// A request read whole from `sock` (blocking), with the stream bytes
    /// that followed it.
    pub(crate) fn new(
        sock: TcpStream,
        peer: SocketAddr,
        request: Request,
        leftover: Vec<u8>,
    ) -> ConnRequest {
        ConnRequest {
            sock,
            peer,
            request,
            leftover,
        }
    }

    /// The initiator's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The MPA Request as received (revision, CRC/marker wishes, IRD/ORD,
    /// private data).
    pub fn request(&self) -> &Request {
        &self.request
    }

    /// Accept onto `qp` with `params` (our IRD/ORD, CRC wish, private data).
    /// If RFC 6581's rules leave no agreement, the request is rejected and
    /// the error returned.
    pub fn accept(self, qp: &QueuePair, params: &MpaParams) -> Result<(), DeviceError> {
        let (neg, reply) = match self.request.accept(params) {
            Ok(x) => x,
            Err(e) => {
                if let Ok(reply) = self.request.reject(&[]) {
                    let _ = NoSignal(&self.sock).write_all(&reply);
                }
                return Err(e.into());
            }
        };
        NoSignal(&self.sock).write_all(&reply)?;
        qp.shared().start(self.sock, neg, &self.leftover)
    }

    /// Reject with private data, then close.
    pub fn reject(self, private_data: &[u8]) -> Result<(), DeviceError> {
        let reply = self.request.reject(private_data)?;
        NoSignal(&self.sock).write_all(&reply)?;
        let _ = self.sock.shutdown(Shutdown::Write);
        Ok(())
    }
}
