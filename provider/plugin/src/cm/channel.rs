//! Event channels: `struct rdma_event_channel` and the events queued in it.
//!
//! `channel->fd` is the read end of a pipe that holds one byte per queued
//! event, so the application can poll it, and whatever `O_NONBLOCK` it set
//! decides whether `rdma_get_cm_event` blocks or fails with EAGAIN. The
//! events themselves wait in a queue beside the pipe; a byte is written
//! after its event is queued, so a byte read always finds an event unless
//! the event was withdrawn (its id destroyed, or moved to another channel
//! by `rdma_migrate_id`), in which case the reader reads on.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use tracing::warn;

use super::id::{EventQueue, Id, Pending};
use super::{lock, CmResult};
use crate::ffi;

/// The C struct, owned here.
#[derive(Debug)]
struct RawChannel(NonNull<ffi::rdma_event_channel>);

// SAFETY: the struct is only written at creation; C reads its fd.
unsafe impl Send for RawChannel {}
// SAFETY: as above.
unsafe impl Sync for RawChannel {}

/// An event channel.
#[derive(Debug)]
pub(crate) struct Channel {
    raw: RawChannel,
    rfd: OwnedFd,
    wfd: OwnedFd,
    queue: Mutex<VecDeque<Pending>>,
}

static CHANNELS: Mutex<Option<HashMap<usize, Arc<Channel>>>> = Mutex::new(None);

/// The C pointers of the channels destroyed last (at most
/// [`DESTROYED_KEPT`]), for [`Channel::was_destroyed`].
static DESTROYED: Mutex<VecDeque<usize>> = Mutex::new(VecDeque::new());

/// How many destroyed channels [`DESTROYED`] remembers.
const DESTROYED_KEPT: usize = 1024;

impl Channel {
    /// A new channel (not registered: see [`Channel::register`]).
    pub fn new() -> CmResult<Arc<Channel>> {
        let mut fds = [0 as c_int; 2];
        // SAFETY: `fds` is a valid array of two ints.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(super::verbs::last_errno(libc::EMFILE));
        }
        // SAFETY: pipe2 returned two fresh descriptors that we now own.
        let (rfd, wfd) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // Only the write end is non-blocking; the read end is the
        // application's to configure.
        // SAFETY: fcntl on our own descriptor.
        unsafe {
            let fl = libc::fcntl(wfd.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(wfd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        let raw = Box::new(ffi::rdma_event_channel {
            fd: rfd.as_raw_fd(),
        });
        Ok(Arc::new(Channel {
            // SAFETY: Box::into_raw is never NULL.
            raw: RawChannel(unsafe { NonNull::new_unchecked(Box::into_raw(raw)) }),
            rfd,
            wfd,
            queue: Mutex::new(VecDeque::new()),
        }))
    }

    /// Make the channel reachable through its C pointer.
    pub fn register(self: &Arc<Self>) {
        // The address may be one a destroyed channel had.
        lock(&DESTROYED).retain(|p| *p != self.raw() as usize);
        lock(&CHANNELS)
            .get_or_insert_with(HashMap::new)
            .insert(self.raw() as usize, self.clone());
    }

    /// Forget the channel's C pointer (`rdma_destroy_event_channel`).
    pub fn unregister(ptr: *mut ffi::rdma_event_channel) -> Option<Arc<Channel>> {
        let ch = lock(&CHANNELS).as_mut()?.remove(&(ptr as usize))?;
        let mut destroyed = lock(&DESTROYED);
        if destroyed.len() == DESTROYED_KEPT {
            destroyed.pop_front();
        }
        destroyed.push_back(ptr as usize);
        Some(ch)
    }

    /// Whether `ptr` is a channel the application destroyed (and no
    /// channel made since has its address).
    pub fn was_destroyed(ptr: *mut ffi::rdma_event_channel) -> bool {
        lock(&DESTROYED).contains(&(ptr as usize))
    }

    /// The channel behind a C pointer handed to the application.
    pub fn lookup(ptr: *mut ffi::rdma_event_channel) -> CmResult<Arc<Channel>> {
        if ptr.is_null() {
            return Err(libc::EINVAL);
        }
        lock(&CHANNELS)
            .as_ref()
            .and_then(|m| m.get(&(ptr as usize)).cloned())
            .ok_or(libc::EINVAL)
    }

    /// The C struct.
    pub fn raw(&self) -> *mut ffi::rdma_event_channel {
        self.raw.0.as_ptr()
    }

    /// The descriptor the application polls.
    #[cfg(test)]
    pub fn fd(&self) -> c_int {
        self.rfd.as_raw_fd()
    }

    /// Queue an event and wake the channel's readers.
    pub fn push(&self, p: Pending) {
        let mut q = lock(&self.queue);
        q.push_back(p);
        let b = 1u8;
        // SAFETY: writing one byte from a valid buffer to our own pipe.
        let n = unsafe { libc::write(self.wfd.as_raw_fd(), (&b as *const u8).cast(), 1) };
        if n != 1 {
            warn!(
                queued = q.len(),
                error = %std::io::Error::last_os_error(),
                "rdma_cm: event channel pipe full; the event waits for the next wake-up"
            );
        }
    }

    /// Take the next event, waiting for one unless the application made
    /// the fd non-blocking (then EAGAIN). Other errors of read(2) (EINTR)
    /// are returned as they are.
    pub fn pop(&self) -> CmResult<Pending> {
        loop {
            let mut b = 0u8;
            // SAFETY: reading one byte into a valid buffer from our own
            // pipe; blocking follows the fd's flags.
            let n = unsafe { libc::read(self.rfd.as_raw_fd(), (&mut b as *mut u8).cast(), 1) };
            if n < 0 {
                return Err(super::verbs::last_errno(libc::EIO));
            }
            if n == 0 {
                return Err(libc::EIO);
            }
            if let Some(p) = lock(&self.queue).pop_front() {
                return Ok(p);
            }
            // A withdrawn event's byte: read on.
        }
    }

    /// Withdraw the queued events `f` selects, returning them.
    pub fn withdraw(&self, mut f: impl FnMut(&Pending) -> bool) -> Vec<Pending> {
        let mut q = lock(&self.queue);
        let mut out = Vec::new();
        let mut keep = VecDeque::with_capacity(q.len());
        for p in q.drain(..) {
            if f(&p) {
                out.push(p);
            } else {
                keep.push_back(p);
            }
        }
        *q = keep;
        out
    }

    /// Whether an event for `id` is queued.
    pub fn has_event_for(&self, id: &Arc<Id>) -> bool {
        lock(&self.queue).iter().any(|p| Arc::ptr_eq(&p.id, id))
    }

    /// Number of queued events.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        lock(&self.queue).len()
    }
}

impl EventQueue for Channel {
    fn raw(&self) -> *mut ffi::rdma_event_channel {
        Channel::raw(self)
    }
    fn push(&self, p: Pending) {
        Channel::push(self, p)
    }
    fn pop(&self) -> CmResult<Pending> {
        Channel::pop(self)
    }
    fn withdraw(&self, f: &mut dyn FnMut(&Pending) -> bool) -> Vec<Pending> {
        Channel::withdraw(self, f)
    }
    fn has_event_for(&self, id: &Arc<Id>) -> bool {
        Channel::has_event_for(self, id)
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: allocated by Box in `new`, freed once here; the
        // application gave it up with rdma_destroy_event_channel (only
        // then can the last reference go).
        drop(unsafe { Box::from_raw(self.raw.0.as_ptr()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nonblocking(ch: &Channel) {
        // SAFETY: fcntl on the channel's read end, as an application would.
        unsafe {
            let fl = libc::fcntl(ch.fd(), libc::F_GETFL);
            libc::fcntl(ch.fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }

    fn readable(ch: &Channel) -> bool {
        let mut pfd = libc::pollfd {
            fd: ch.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, 0) == 1 }
    }

    #[test]
    fn nonblocking_empty_is_eagain_and_poll_follows_queue() {
        let ch = Channel::new().unwrap();
        nonblocking(&ch);
        assert!(!readable(&ch));
        assert_eq!(ch.pop().unwrap_err(), libc::EAGAIN);
        let id = Id::new_for_test(&ch);
        ch.push(Pending::new(
            id.clone(),
            ffi::RDMA_CM_EVENT_ADDR_RESOLVED,
            0,
        ));
        ch.push(Pending::new(id, ffi::RDMA_CM_EVENT_ROUTE_RESOLVED, 0));
        assert!(readable(&ch));
        assert_eq!(ch.pop().unwrap().kind, ffi::RDMA_CM_EVENT_ADDR_RESOLVED);
        assert!(readable(&ch));
        assert_eq!(ch.pop().unwrap().kind, ffi::RDMA_CM_EVENT_ROUTE_RESOLVED);
        assert!(!readable(&ch));
        assert_eq!(ch.pop().unwrap_err(), libc::EAGAIN);
    }

    #[test]
    fn withdrawn_events_are_skipped() {
        let ch = Channel::new().unwrap();
        nonblocking(&ch);
        let a = Id::new_for_test(&ch);
        let b = Id::new_for_test(&ch);
        ch.push(Pending::new(a.clone(), ffi::RDMA_CM_EVENT_ESTABLISHED, 0));
        ch.push(Pending::new(b.clone(), ffi::RDMA_CM_EVENT_DISCONNECTED, 0));
        assert!(ch.has_event_for(&a));
        let gone = ch.withdraw(|p| Arc::ptr_eq(&p.id, &a));
        assert_eq!(gone.len(), 1);
        assert!(!ch.has_event_for(&a));
        let p = ch.pop().unwrap();
        assert!(Arc::ptr_eq(&p.id, &b));
        assert_eq!(ch.pop().unwrap_err(), libc::EAGAIN);
        assert_eq!(ch.len(), 0);
    }

    #[test]
    fn blocking_pop_waits_for_a_push() {
        let ch = Channel::new().unwrap();
        let id = Id::new_for_test(&ch);
        let ch2 = ch.clone();
        let t = std::thread::spawn(move || ch2.pop().map(|p| p.kind));
        std::thread::sleep(std::time::Duration::from_millis(50));
        ch.push(Pending::new(id, ffi::RDMA_CM_EVENT_DISCONNECTED, 0));
        assert_eq!(t.join().unwrap(), Ok(ffi::RDMA_CM_EVENT_DISCONNECTED));
    }

    #[test]
    fn registry_finds_registered_channels_only() {
        let ch = Channel::new().unwrap();
        assert_eq!(Channel::lookup(ch.raw()).unwrap_err(), libc::EINVAL);
        ch.register();
        assert!(Arc::ptr_eq(&Channel::lookup(ch.raw()).unwrap(), &ch));
        assert!(Channel::unregister(ch.raw()).is_some());
        assert_eq!(Channel::lookup(ch.raw()).unwrap_err(), libc::EINVAL);
        assert_eq!(
            Channel::lookup(std::ptr::null_mut()).unwrap_err(),
            libc::EINVAL
        );
    }
}
