//! The passive side of connection setup: a listening socket whose MPA
//! Requests a thread of its own reads, every handshake non-blocking and on
//! its own deadline ([`SETUP_TIMEOUT`]). A client that connects and says
//! nothing, sends garbage or stops halfway costs a `tracing` record and its
//! socket, and delays nobody: [`Listener::accept`] hands the application
//! only requests that arrived whole, and fails only when the listener
//! itself does (or is shut down).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::{debug, warn};

use crate::error::DeviceError;
use crate::establish::{ConnRequest, SETUP_TIMEOUT};
use crate::setup::Request;
use crate::thread::SpawnMasked;
use crate::wire::mpa::FrameReader;

/// Requests read whole and not yet taken by [`Listener::accept`]; a
/// handshake that completes beyond this is dropped (a full backlog).
const READY_BACKLOG: usize = 128;

/// Handshakes read at once; connections beyond this are closed on arrival.
const MAX_HANDSHAKES: usize = 1024;

/// A passive endpoint: accepts TCP connections and reads their MPA
/// Requests in the background.
#[derive(Debug)]
pub struct Listener {
    local: SocketAddr,
    ready: Mutex<Receiver<ConnRequest>>,
    stop: Arc<EventFd>,
    /// Why the handshake thread ended, if it failed.
    failure: Arc<Mutex<Option<std::io::Error>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Listener {
    /// Listen on `addr` (port 0 picks one).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<Listener, DeviceError> {
        Self::bind_with(addr, SETUP_TIMEOUT)
    }

    /// Listen on `addr`, giving each handshake `timeout` to deliver its
    /// MPA Request.
    pub fn bind_with(addr: impl ToSocketAddrs, timeout: Duration) -> Result<Listener, DeviceError> {
        Self::adopt(TcpListener::bind(addr)?, timeout)
    }

    /// Take over `tcp`, a socket the caller bound and made listen (with
    /// socket options `bind` does not set, such as `IPV6_V6ONLY`): the
    /// connections the kernel queued in its backlog before this call are
    /// served like later ones. (rdma_cm listens at `rdma_bind_addr`, so
    /// that a peer told the port before `rdma_listen` is queued, not
    /// refused.)
    pub fn adopt(tcp: TcpListener, timeout: Duration) -> Result<Listener, DeviceError> {
        tcp.set_nonblocking(true)?;
        let local = tcp.local_addr()?;
        let stop = Arc::new(EventFd::from_value_and_flags(
            0,
            EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC,
        )?);
        let (tx, rx) = mpsc::sync_channel(READY_BACKLOG);
        let failure = Arc::new(Mutex::new(None));
        let thread = {
            let mut run = Handshakes {
                tcp,
                local,
                stop: stop.clone(),
                ready: tx,
                pending: VecDeque::new(),
                timeout,
            };
            let failure = failure.clone();
            std::thread::Builder::new()
                .name(format!("stag-listen-{}", local.port()))
                .spawn_masked(move || {
                    if let Err(e) = run.run() {
                        warn!(%local, error = %e, "listener failed");
                        *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    }
                })?
        };
        Ok(Listener {
            local,
            ready: Mutex::new(rx),
            stop,
            failure,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, DeviceError> {
        Ok(self.local)
    }

    /// Wait for the next connection whose MPA Request arrived whole.
    /// Fails only when the listener failed or was [shut
    /// down](Self::shutdown).
    pub fn accept(&self) -> Result<ConnRequest, DeviceError> {
        let ready = self.ready.lock().unwrap_or_else(|p| p.into_inner());
        match ready.recv() {
            Ok(req) => Ok(req),
            Err(mpsc::RecvError) => Err(self.ended()),
        }
    }

    /// Like [`accept`](Self::accept), but `Ok(None)` when no request
    /// arrived within `timeout`.
    pub fn accept_timeout(&self, timeout: Duration) -> Result<Option<ConnRequest>, DeviceError> {
        let ready = self.ready.lock().unwrap_or_else(|p| p.into_inner());
        match ready.recv_timeout(timeout) {
            Ok(req) => Ok(Some(req)),
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(self.ended()),
        }
    }

    /// Stop listening: the port closes, handshakes in progress are dropped,
    /// and [`accept`](Self::accept) (pending or later) fails once the
    /// requests already read are taken.
    pub fn shutdown(&self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }

    /// The error for an `accept` after the handshake thread ended.
    fn ended(&self) -> DeviceError {
        match self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            Some(e) => DeviceError::Io(e),
            None => DeviceError::ListenerClosed,
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One connection whose MPA Request is still arriving.
struct Handshake {
    sock: TcpStream,
    peer: SocketAddr,
    reader: FrameReader,
    deadline: Instant,
}

/// The handshake thread's state.
struct Handshakes {
    tcp: TcpListener,
    local: SocketAddr,
    stop: Arc<EventFd>,
    ready: SyncSender<ConnRequest>,
    pending: VecDeque<Handshake>,
    timeout: Duration,
}

/// What reading a handshake's socket came to.
enum Step {
    /// More octets are needed.
    Waiting,
    /// The Request is whole, with the stream octets that followed it.
    Done(Request, Vec<u8>),
    /// Drop the connection, for this reason.
    Drop(String),
}

impl Handshakes {
    fn run(&mut self) -> std::io::Result<()> {
        loop {
            let now = Instant::now();
            self.expire(now);
            let timeout = self
                .pending
                .iter()
                .map(|h| h.deadline.saturating_duration_since(now))
                .min()
                // Round up so that a short remainder still sleeps.
                .map(|d| {
                    PollTimeout::try_from(d + Duration::from_millis(1)).unwrap_or(PollTimeout::MAX)
                })
                .unwrap_or(PollTimeout::NONE);
            let (stop, accept, readable) = {
                let mut fds = Vec::with_capacity(self.pending.len() + 2);
                fds.push(PollFd::new(self.stop.as_fd(), PollFlags::POLLIN));
                fds.push(PollFd::new(self.tcp.as_fd(), PollFlags::POLLIN));
                for h in &self.pending {
                    fds.push(PollFd::new(h.sock.as_fd(), PollFlags::POLLIN));
                }
                match nix::poll::poll(&mut fds, timeout) {
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => return Err(e.into()),
                }
                let ready = |f: &PollFd| f.any().unwrap_or(false);
                let readable: Vec<bool> = fds[2..].iter().map(ready).collect();
                (ready(&fds[0]), ready(&fds[1]), readable)
            };
            if stop {
                return Ok(());
            }
            // Read first: the indices of `readable` are those of `pending`
            // before new connections join it.
            let mut i = 0;
            let mut kept = VecDeque::with_capacity(self.pending.len());
            while let Some(mut h) = self.pending.pop_front() {
                let step = if readable.get(i).copied().unwrap_or(false) {
                    Self::read(&mut h)
                } else {
                    Step::Waiting
                };
                i += 1;
                match step {
                    Step::Waiting => kept.push_back(h),
                    Step::Done(request, leftover) => {
                        // The reply is written and the stream started with
                        // blocking calls, as on a connection the
                        // application made itself.
                        match h.sock.set_nonblocking(false) {
                            Ok(()) => {
                                self.hand_over(ConnRequest::new(h.sock, h.peer, request, leftover))
                            }
                            Err(e) => {
                                debug!(peer = %h.peer, error = %e, "dropping a connection after its MPA Request");
                            }
                        }
                    }
                    Step::Drop(why) => {
                        debug!(peer = %h.peer, local = %self.local, "dropping a connection before its MPA Request: {why}");
                    }
                }
            }
            self.pending = kept;
            if accept {
                self.accept_all()?;
            }
        }
    }

    /// Take every connection waiting in the kernel's backlog.
    fn accept_all(&mut self) -> std::io::Result<()> {
        loop {
            let (sock, peer) = match self.tcp.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if is_transient(&e) => {
                    // Out of descriptors or buffers, or a connection that
                    // went away in the backlog: the listener itself is fine.
                    debug!(local = %self.local, error = %e, "accept failed; the listener goes on");
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            if self.pending.len() >= MAX_HANDSHAKES {
                warn!(%peer, local = %self.local, "{MAX_HANDSHAKES} handshakes in progress: closing a new connection");
                continue;
            }
            if let Err(e) = sock
                .set_nonblocking(true)
                .and_then(|()| sock.set_nodelay(true))
            {
                debug!(%peer, error = %e, "cannot set up an accepted socket");
                continue;
            }
            self.pending.push_back(Handshake {
                sock,
                peer,
                reader: Request::reader(),
                deadline: Instant::now() + self.timeout,
            });
        }
    }

    /// Read what a handshake's socket has.
    fn read(h: &mut Handshake) -> Step {
        let mut buf = [0u8; 2048];
        loop {
            let n = match (&h.sock).read(&mut buf) {
                Ok(0) => return Step::Drop("closed by the peer".into()),
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Waiting,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Step::Drop(e.to_string()),
            };
            let mut input = &buf[..n];
            let request = match h.reader.read(&mut input) {
                Ok(Some(repr)) => Request::from_repr(&repr),
                Ok(None) => continue,
                Err(e) => return Step::Drop(format!("not an MPA Request: {e}")),
            };
            return Step::Done(request, input.to_vec());
        }
    }

    fn hand_over(&self, req: ConnRequest) {
        match self.ready.try_send(req) {
            Ok(()) => {}
            Err(TrySendError::Full(req)) => {
                warn!(peer = %req.peer_addr(), local = %self.local, "{READY_BACKLOG} requests wait for accept: dropping one");
            }
            // Nobody will accept: the listener is going away.
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    /// Drop handshakes past their deadline.
    fn expire(&mut self, now: Instant) {
        let local = self.local;
        self.pending.retain(|h| {
            let alive = h.deadline > now;
            if !alive {
                debug!(peer = %h.peer, %local, "dropping a connection: no MPA Request within the setup timeout");
            }
            alive
        });
    }
}

/// Accept errors that leave the listening socket usable.
fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::ECONNABORTED
                | libc::EPROTO
                | libc::EPERM
        )
    )
}
