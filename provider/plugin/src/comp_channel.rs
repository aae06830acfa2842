//! Completion channels: a pipe whose read end is `ibv_comp_channel.fd`,
//! and the records that need not pass through it.
//!
//! libibverbs' `ibv_get_cq_event` reads an 8-byte record naming the CQ
//! from the channel fd, and a program may sleep on that fd in `poll(2)`,
//! `select(2)` or epoll. But most event-driven programs (qperf, rping's
//! CQ thread, ibacm) only ever call `ibv_get_cq_event`, and the thread
//! that posts a Send often fires its own CQ's notification (the Send
//! completes as it leaves): writing that record to the pipe, then
//! polling and reading it back, is three system calls the thread spends
//! on a message to itself.
//!
//! So a record is kept in memory ([`Channel::deliver`]) while nobody can
//! be watching the fd, and is written to the pipe only when someone may
//! be:
//! - a thread asleep in our `ibv_get_cq_event` on the channel
//!   ([`Channel::begin_sleep`]): records then go to the pipe, which it
//!   polls;
//! - the fd handed to `poll`/`ppoll`/`select`/`pselect` or added to an
//!   epoll set ([`interpose`](crate::interpose) sees those calls and
//!   [`saw_fds`] marks the channel): from then on, for good, every record
//!   goes to the pipe, and the ones kept in memory are written first.
//!
//! `ibv_get_cq_event` takes the records kept in memory before it looks at
//! the pipe. Not seen: a `dup` of the fd polled instead of the fd itself,
//! or an `io_uring` poll of it; a program that does either waits for the
//! next record written to the pipe.
//!
//! Whether the fd is non-blocking (libfabric's verbs provider makes it so,
//! then reads events until `EAGAIN`) is tracked here too
//! ([`saw_nonblocking`], from the interposed `fcntl(F_SETFL)` and
//! `ioctl(FIONBIO)`), so that `ibv_get_cq_event` knows whether it may
//! sleep without an `fcntl(F_GETFL)` of its own on every wait. Not seen
//! either: the flag changed through a `dup` of the fd, or by a raw
//! system call.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A completion channel of this plugin.
#[derive(Debug)]
pub(crate) struct Channel {
    /// The read end, `ibv_comp_channel.fd` (closed by [`Channel::close`]).
    rx: RawFd,
    /// The write end, non-blocking: when the pipe is full the application
    /// has records to read anyway.
    tx: OwnedFd,
    state: Mutex<State>,
    /// Its slot in [`UNWATCHED`], while it has one.
    slot: Option<usize>,
    /// The application made the read end non-blocking ([`saw_nonblocking`];
    /// the pipe is made blocking, as the kernel's channel fd is).
    nonblocking: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    /// Records nobody could have been waiting for in the fd, oldest first.
    kept: VecDeque<u64>,
    /// Threads asleep in `ibv_get_cq_event` on the pipe.
    sleepers: u32,
    /// The fd was handed to poll, select or epoll: every record goes to
    /// the pipe.
    watched: bool,
}

/// The read ends of channels not yet watched (-1: a free slot), looked up
/// without a lock by every interposed `poll`. A channel made when all are
/// taken starts watched (its records always go to the pipe).
static UNWATCHED: [AtomicI32; 64] = [const { AtomicI32::new(-1) }; 64];
/// How many slots are taken: 0 lets every `poll` pass straight through.
static TAKEN: AtomicUsize = AtomicUsize::new(0);
/// One past the highest slot ever taken: a look scans only those (one or
/// two for most programs), not all 64 for each fd polled.
static HIGH: AtomicUsize = AtomicUsize::new(0);
/// Channels open: 0 lets every interposed `fcntl`/`ioctl` pass straight
/// through.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// The live channels by read end, for [`saw_fds`].
fn by_fd() -> &'static Mutex<Vec<Arc<Channel>>> {
    static CHANNELS: Mutex<Vec<Arc<Channel>>> = Mutex::new(Vec::new());
    &CHANNELS
}

impl Channel {
    /// A new channel: its pipe, and its read end watched for polls.
    pub(crate) fn open() -> std::io::Result<Arc<Channel>> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two fds.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own; the read end stays raw (the channel
        // struct names it, closed in `close`).
        let tx = unsafe { OwnedFd::from_raw_fd(fds[1]) };
        // SAFETY: fcntl on the write end we own.
        if unsafe { libc::fcntl(fds[1], libc::F_SETFL, libc::O_NONBLOCK) } != 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: ours, not handed out.
            unsafe { libc::close(fds[0]) };
            return Err(e);
        }
        let slot = UNWATCHED.iter().position(|s| {
            s.compare_exchange(-1, fds[0], Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        });
        let watched = slot.is_none();
        if let Some(i) = slot {
            HIGH.fetch_max(i + 1, Ordering::SeqCst);
            TAKEN.fetch_add(1, Ordering::SeqCst);
        }
        let ch = Arc::new(Channel {
            rx: fds[0],
            tx,
            state: Mutex::new(State {
                watched,
                ..State::default()
            }),
            slot,
            nonblocking: AtomicBool::new(false),
        });
        by_fd()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(ch.clone());
        LIVE.fetch_add(1, Ordering::SeqCst);
        Ok(ch)
    }

    /// The read end (`ibv_comp_channel.fd`).
    pub(crate) fn fd(&self) -> RawFd {
        self.rx
    }

    /// Whether the application made the read end non-blocking: a wait
    /// only looks, and an empty channel answers `EAGAIN`.
    pub(crate) fn nonblocking(&self) -> bool {
        self.nonblocking.load(Ordering::SeqCst)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One event record: into the pipe if anyone may be watching it, else
    /// kept for the next `ibv_get_cq_event`.
    pub(crate) fn deliver(&self, token: u64) {
        let mut st = self.state();
        if st.watched || st.sleepers > 0 {
            drop(st);
            self.write(token);
        } else {
            st.kept.push_back(token);
        }
    }

    fn write(&self, token: u64) {
        let desc = token.to_ne_bytes();
        // SAFETY: writes 8 bytes from a local buffer to our pipe.
        let _ = unsafe { libc::write(self.tx.as_raw_fd(), desc.as_ptr().cast(), desc.len()) };
    }

    /// A thread is about to sleep on the pipe: the oldest record kept, if
    /// there is one (then it does not sleep), else it counts as a sleeper
    /// while the [`Sleeper`] lives, and records go to the pipe.
    pub(crate) fn begin_sleep(&self) -> Result<u64, Sleeper<'_>> {
        let mut st = self.state();
        match st.kept.pop_front() {
            Some(token) => Ok(token),
            None => {
                st.sleepers += 1;
                Err(Sleeper(self))
            }
        }
    }

    /// The thread counted by [`begin_sleep`](Self::begin_sleep) woke
    /// (called by [`Sleeper`]'s drop, however the wait ended).
    fn end_sleep(&self) {
        let mut st = self.state();
        st.sleepers = st.sleepers.saturating_sub(1);
    }

    /// Drop the records naming `token`, kept or already in the pipe (its
    /// CQ is being destroyed; no new record of it comes), as the kernel
    /// drops a destroyed CQ's unread events (`ib_uverbs_release_ucq`): a
    /// record left in the pipe would hand the application a freed
    /// `ibv_cq` from a later `ibv_get_cq_event`, and keep the fd readable
    /// with nothing to read for a poller.
    pub(crate) fn forget(&self, token: u64) {
        let mut st = self.state();
        st.kept.retain(|t| *t != token);
        // Held across the read-back, so that the kept records do not move
        // to the pipe meanwhile (mark_watched); other CQs' records written
        // meanwhile may pass those put back, and order between CQs is not
        // kept by the kernel either.
        self.withdraw_piped(token);
        drop(st);
    }

    /// Take the records naming `token` out of the pipe and put the others
    /// back. The application's read end may be blocking and other threads
    /// may read it meanwhile, so they are read through a non-blocking
    /// description of the pipe of our own (`/proc/self/fd`): never
    /// blocking, and a record another thread takes first is simply not
    /// seen here.
    fn withdraw_piped(&self, token: u64) {
        let path = format!("/proc/self/fd/{}\0", self.rx);
        // SAFETY: a NUL-terminated path; a new descriptor closed below.
        let rx = unsafe {
            libc::open(
                path.as_ptr().cast(),
                libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if rx < 0 {
            tracing::debug!(
                errno = std::io::Error::last_os_error().raw_os_error(),
                "stag0: destroy_cq: the channel's records could not be read back"
            );
            return;
        }
        // SAFETY: the descriptor just opened, ours to close.
        let rx = unsafe { OwnedFd::from_raw_fd(rx) };
        let mut others = Vec::new();
        loop {
            let mut desc = [0u8; 8];
            // SAFETY: reads at most 8 bytes into a local buffer; never blocks.
            let n = unsafe { libc::read(rx.as_raw_fd(), desc.as_mut_ptr().cast(), desc.len()) };
            // Records go in and out whole (8-octet pipe writes are atomic):
            // no short read; EAGAIN ends it.
            if n != desc.len() as isize {
                break;
            }
            let t = u64::from_ne_bytes(desc);
            if t != token {
                others.push(t);
            }
        }
        for t in others {
            self.write(t);
        }
    }

    /// The fd is (about to be) watched: the kept records go to the pipe,
    /// and every later one too.
    fn mark_watched(&self) {
        let mut st = self.state();
        if !st.watched {
            st.watched = true;
            for token in st.kept.drain(..) {
                self.write(token);
            }
        }
        drop(st);
        self.free_slot();
    }

    fn free_slot(&self) {
        if let Some(i) = self.slot {
            if UNWATCHED[i]
                .compare_exchange(self.rx, -1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                TAKEN.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// `ibv_destroy_comp_channel`: forget the channel and close its read
    /// end (the write end closes with the last reference).
    pub(crate) fn close(self: &Arc<Self>) {
        self.free_slot();
        let mut chans = by_fd().lock().unwrap_or_else(|p| p.into_inner());
        let before = chans.len();
        chans.retain(|c| !Arc::ptr_eq(c, self));
        if chans.len() < before {
            LIVE.fetch_sub(1, Ordering::SeqCst);
        }
        drop(chans);
        // SAFETY: the read end, ours, closed once here.
        unsafe { libc::close(self.rx) };
    }
}

/// A thread counted as asleep on a channel's pipe
/// ([`Channel::begin_sleep`]) until dropped.
#[derive(Debug)]
pub(crate) struct Sleeper<'a>(&'a Channel);

impl Drop for Sleeper<'_> {
    fn drop(&mut self) {
        self.0.end_sleep();
    }
}

/// Whether `fd` may be the read end of a channel not yet watched (one
/// lock-free look; true only for channel fds).
fn unwatched(fd: RawFd) -> bool {
    let high = HIGH.load(Ordering::SeqCst).min(UNWATCHED.len());
    fd >= 0
        && UNWATCHED[..high]
            .iter()
            .any(|s| s.load(Ordering::SeqCst) == fd)
}

thread_local! {
    /// Set while this thread polls inside our own `ibv_get_cq_event`,
    /// which sleeps on the pipe as a counted sleeper, not as a watcher.
    static INSIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f` (our own wait on a channel fd) without marking the channel
/// watched.
pub(crate) fn inside<R>(f: impl FnOnce() -> R) -> R {
    /// Clears the mark however `f` ends (a panic is caught further up,
    /// and the thread goes on polling).
    struct Unmark;
    impl Drop for Unmark {
        fn drop(&mut self) {
            INSIDE.with(|i| i.set(false));
        }
    }
    INSIDE.with(|i| i.set(true));
    let _unmark = Unmark;
    f()
}

/// The application is about to wait on these fds (poll, select, epoll):
/// each unwatched channel among them becomes watched before it does.
pub(crate) fn saw_fds(fds: impl Iterator<Item = RawFd>) {
    if TAKEN.load(Ordering::SeqCst) == 0 || INSIDE.with(|i| i.get()) {
        return;
    }
    let seen: Vec<RawFd> = fds.filter(|fd| unwatched(*fd)).collect();
    if seen.is_empty() {
        return;
    }
    let chans: Vec<Arc<Channel>> = by_fd()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|c| seen.contains(&c.rx))
        .cloned()
        .collect();
    for ch in chans {
        ch.mark_watched();
    }
}

/// The application set `fd`'s `O_NONBLOCK` to `on` (an `fcntl(F_SETFL)`
/// or `ioctl(FIONBIO)` that succeeded): if `fd` is a channel's read end,
/// its waits follow.
pub(crate) fn saw_nonblocking(fd: RawFd, on: bool) {
    if LIVE.load(Ordering::SeqCst) == 0 || fd < 0 {
        return;
    }
    let chans = by_fd().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(ch) = chans.iter().find(|c| c.rx == fd) {
        ch.nonblocking.store(on, Ordering::SeqCst);
    }
}

/// The channel fds among the first `nfds` of a `select` set, as
/// [`saw_fds`] wants them.
///
/// # Safety
/// `set` must be NULL or a valid `fd_set`.
pub(crate) unsafe fn in_fd_set(nfds: i32, set: *const libc::fd_set) -> Vec<RawFd> {
    if set.is_null() || TAKEN.load(Ordering::SeqCst) == 0 {
        return Vec::new();
    }
    let high = HIGH.load(Ordering::SeqCst).min(UNWATCHED.len());
    UNWATCHED[..high]
        .iter()
        .map(|s| s.load(Ordering::SeqCst))
        .filter(|&fd| {
            fd >= 0
                && fd < nfds
                && (fd as usize) < libc::FD_SETSIZE
                // SAFETY: reads the caller's valid set, within FD_SETSIZE.
                && unsafe { libc::FD_ISSET(fd, set) }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: one valid pollfd and timespec. The system call itself:
        // `poll` here would be this crate's interposer, which marks.
        unsafe {
            libc::syscall(
                libc::SYS_ppoll,
                &mut p as *mut libc::pollfd,
                1,
                &zero as *const libc::timespec,
                std::ptr::null::<libc::sigset_t>(),
                0,
            ) == 1
        }
    }

    /// A record nobody can be watching for stays in memory; once the fd
    /// is seen by a poll it is in the pipe, and so is every later one; a
    /// sleeper makes records go to the pipe too.
    #[test]
    fn records_reach_the_pipe_once_someone_may_watch() {
        let a = Channel::open().unwrap();
        a.deliver(1);
        assert!(!readable(a.fd()), "kept in memory");
        assert_eq!(a.begin_sleep().ok(), Some(1));
        // Now a sleeper: the next one goes to the pipe.
        let sleeper = a.begin_sleep().expect_err("nothing kept");
        a.deliver(2);
        assert!(readable(a.fd()));
        drop(sleeper);
        let mut buf = [0u8; 8];
        // SAFETY: reads 8 bytes into a local buffer from our pipe.
        assert_eq!(unsafe { libc::read(a.fd(), buf.as_mut_ptr().cast(), 8) }, 8);
        assert_eq!(u64::from_ne_bytes(buf), 2);

        a.deliver(3);
        a.deliver(4);
        a.forget(3);
        inside(|| saw_fds([a.fd()].into_iter()));
        assert!(!readable(a.fd()), "our own wait does not mark it");
        saw_fds([a.fd()].into_iter());
        assert!(readable(a.fd()), "the kept record is written when watched");
        // SAFETY: as above.
        assert_eq!(unsafe { libc::read(a.fd(), buf.as_mut_ptr().cast(), 8) }, 8);
        assert_eq!(u64::from_ne_bytes(buf), 4);
        a.deliver(5);
        assert!(readable(a.fd()), "watched for good");
        assert!(a.begin_sleep().is_err(), "nothing kept");
        a.close();
    }
}
