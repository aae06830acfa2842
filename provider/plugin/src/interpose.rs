//! The few libc and libibverbs calls the plugin must answer itself when
//! `stag run` preloads it (a library dlopened by libibverbs interposes
//! nothing, and needs none of this once `stag install` made the device
//! node):
//!
//! - `stat`/`open` of `/dev/infiniband/uverbs64`: discovery checks that the
//!   device node exists, and the context opens it as its command fd. Without
//!   root there is no node; `/dev/null` (the rdev the tree announces)
//!   stands in. Only that path, and only when it does not exist.
//! - `socket(AF_NETLINK, …, NETLINK_RDMA)` fails when `stag run` asks
//!   (`STAG_RUN_HIDE_NETLINK=1`, set where the kernel has RDMA devices), so
//!   libibverbs discovers through the device tree, which lists the kernel's
//!   devices next to stag0.
//! - `ibv_create_comp_channel`/`ibv_destroy_comp_channel` on stag0: libibverbs
//!   would ask the kernel for the channel's fd through the command fd.
//! - `ibv_get_cq_event` on a stag0 channel: the waiting thread sleeps on the
//!   QPs' sockets too, so the peer's message wakes it directly
//!   ([`crate::cq::get_cq_event`]). Without the preload, libibverbs' own
//!   reads the pipe, which the engine writes: one thread hand-off more.
//! - `poll`, `ppoll`, `select`, `pselect` (and glibc's fortified
//!   `__poll_chk`/`__ppoll_chk`) and `epoll_ctl` on a stag0 channel fd:
//!   the channel's event records, kept in memory while nobody could be
//!   watching the fd, go to its pipe from then on
//!   ([`crate::comp_channel`]). Every other call passes straight through.
//! - `fcntl`/`fcntl64` with `F_SETFL` and `ioctl` with `FIONBIO` on a
//!   stag0 channel fd: the channel notes whether it is non-blocking, so
//!   that `ibv_get_cq_event` need not ask the kernel on every wait
//!   ([`crate::comp_channel::saw_nonblocking`]). The call itself passes
//!   straight through, as every other.

use std::ffi::{c_char, c_int, CStr};
use std::sync::OnceLock;

use crate::ffi::{ibv_comp_channel, ibv_context, ibv_cq};
use crate::handle::comp_channels;

/// `dlsym(RTLD_NEXT, name)`, cached per call site.
macro_rules! next {
    ($name:literal, $ty:ty) => {{
        static NEXT: OnceLock<usize> = OnceLock::new();
        let p = *NEXT.get_or_init(|| {
            // SAFETY: a NUL-terminated literal; RTLD_NEXT looks past us.
            unsafe { libc::dlsym(libc::RTLD_NEXT, concat!($name, "\0").as_ptr().cast()) as usize }
        });
        if p == 0 {
            None
        } else {
            // SAFETY: the symbol named has this C signature.
            Some(unsafe { std::mem::transmute::<usize, $ty>(p) })
        }
    }};
}

fn device_path() -> &'static CStr {
    static PATH: OnceLock<std::ffi::CString> = OnceLock::new();
    PATH.get_or_init(|| {
        std::ffi::CString::new(format!(
            "/dev/infiniband/{}",
            provider::identity::UVERBS_NAME
        ))
        .expect("no NUL in the path")
    })
}

/// Whether `path` is our device node and that node does not exist.
///
/// # Safety
/// `path` must be NULL or a NUL-terminated string.
unsafe fn stands_in(path: *const c_char) -> bool {
    if path.is_null() {
        return false;
    }
    // SAFETY: forwarded.
    let p = unsafe { CStr::from_ptr(path) };
    // SAFETY: access on a valid path.
    p == device_path() && unsafe { libc::access(path, libc::F_OK) } != 0
}

const DEV_NULL: &CStr = c"/dev/null";

#[no_mangle]
pub unsafe extern "C" fn stat(path: *const c_char, buf: *mut libc::stat) -> c_int {
    type F = unsafe extern "C" fn(*const c_char, *mut libc::stat) -> c_int;
    let Some(real) = next!("stat", F) else {
        crate::errno::set(libc::ENOSYS);
        return -1;
    };
    // SAFETY: forwarded to libc with the caller's arguments (or /dev/null).
    unsafe {
        if stands_in(path) {
            real(DEV_NULL.as_ptr(), buf)
        } else {
            real(path, buf)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: libc::mode_t) -> c_int {
    type F = unsafe extern "C" fn(*const c_char, c_int, libc::mode_t) -> c_int;
    let Some(real) = next!("open", F) else {
        crate::errno::set(libc::ENOSYS);
        return -1;
    };
    // SAFETY: forwarded to libc with the caller's arguments (or /dev/null).
    unsafe {
        if stands_in(path) {
            real(DEV_NULL.as_ptr(), flags, mode)
        } else {
            real(path, flags, mode)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    type F = unsafe extern "C" fn(c_int, c_int, c_int) -> c_int;
    const NETLINK_RDMA: c_int = 20;
    if domain == libc::AF_NETLINK && protocol == NETLINK_RDMA && hide_netlink() {
        crate::errno::set(libc::EPROTONOSUPPORT);
        return -1;
    }
    let Some(real) = next!("socket", F) else {
        crate::errno::set(libc::ENOSYS);
        return -1;
    };
    // SAFETY: forwarded to libc.
    unsafe { real(domain, ty, protocol) }
}

fn hide_netlink() -> bool {
    static HIDE: OnceLock<bool> = OnceLock::new();
    *HIDE.get_or_init(|| std::env::var_os("STAG_RUN_HIDE_NETLINK").is_some_and(|v| v == "1"))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    type F = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel;
    if !crate::handle::is_stag_context(ctx) {
        return match next!("ibv_create_comp_channel", F) {
            // SAFETY: libibverbs' own, for its own devices.
            Some(real) => unsafe { real(ctx) },
            None => {
                crate::errno::set(libc::ENOSYS);
                std::ptr::null_mut()
            }
        };
    }
    crate::errno::guard("ibv_create_comp_channel", std::ptr::null_mut(), || {
        let chan = match crate::comp_channel::Channel::open() {
            Ok(chan) => chan,
            Err(e) => {
                crate::errno::set(e.raw_os_error().unwrap_or(libc::EMFILE));
                return std::ptr::null_mut();
            }
        };
        let ch = Box::into_raw(Box::new(ibv_comp_channel {
            context: ctx,
            fd: chan.fd(),
            refcnt: 0,
        }));
        comp_channels()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ch as usize, chan);
        ch
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    type F = unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int;
    let ours = !ch.is_null()
        && comp_channels()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&(ch as usize));
    if !ours {
        return match next!("ibv_destroy_comp_channel", F) {
            // SAFETY: libibverbs' own channel.
            Some(real) => unsafe { real(ch) },
            None => libc::ENOSYS,
        };
    }
    crate::errno::guard("ibv_destroy_comp_channel", libc::EIO, || {
        let mut chans = comp_channels().lock().unwrap_or_else(|p| p.into_inner());
        if !chans.contains_key(&(ch as usize)) {
            // Destroyed meanwhile by another thread.
            return libc::EINVAL;
        }
        // SAFETY: ours (registered), alive until now.
        if unsafe { (*ch).refcnt } != 0 {
            return libc::EBUSY;
        }
        if let Some(chan) = chans.remove(&(ch as usize)) {
            chan.close();
        }
        // SAFETY: ours, allocated by ibv_create_comp_channel, freed once.
        drop(unsafe { Box::from_raw(ch) });
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    ch: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut std::ffi::c_void,
) -> c_int {
    type F = unsafe extern "C" fn(
        *mut ibv_comp_channel,
        *mut *mut ibv_cq,
        *mut *mut std::ffi::c_void,
    ) -> c_int;
    // SAFETY: the caller's arguments, as libibverbs would take them.
    if let Some(rc) = unsafe { crate::cq::get_cq_event(ch, cq, cq_context) } {
        return rc;
    }
    match next!("ibv_get_cq_event", F) {
        // SAFETY: libibverbs' own, for its own channels.
        Some(real) => unsafe { real(ch, cq, cq_context) },
        None => {
            crate::errno::set(libc::ENOSYS);
            -1
        }
    }
}

type PollFn = unsafe extern "C" fn(*mut libc::pollfd, libc::nfds_t, c_int) -> c_int;

/// The fds of a `poll` array.
///
/// # Safety
/// `fds` must be NULL or point at `n` pollfds.
unsafe fn poll_fds<'a>(fds: *const libc::pollfd, n: libc::nfds_t) -> &'a [libc::pollfd] {
    if fds.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller's array of n entries (poll(2)'s contract).
    unsafe { std::slice::from_raw_parts(fds, n as usize) }
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    // SAFETY: poll(2)'s arguments.
    crate::comp_channel::saw_fds(unsafe { poll_fds(fds, n) }.iter().map(|p| p.fd));
    match next!("poll", PollFn) {
        // SAFETY: forwarded to libc with the caller's arguments.
        Some(real) => unsafe { real(fds, n, timeout) },
        None => {
            crate::errno::set(libc::ENOSYS);
            -1
        }
    }
}

/// glibc's `poll` under `_FORTIFY_SOURCE` (Debian builds with it).
#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: c_int,
    fdslen: usize,
) -> c_int {
    type F = unsafe extern "C" fn(*mut libc::pollfd, libc::nfds_t, c_int, usize) -> c_int;
    // SAFETY: poll(2)'s arguments.
    crate::comp_channel::saw_fds(unsafe { poll_fds(fds, n) }.iter().map(|p| p.fd));
    match next!("__poll_chk", F) {
        // SAFETY: forwarded to libc with the caller's arguments.
        Some(real) => unsafe { real(fds, n, timeout, fdslen) },
        None => {
            crate::errno::set(libc::ENOSYS);
            -1
        }
    }
}

type PpollFn = unsafe extern "C" fn(
    *mut libc::pollfd,
    libc::nfds_t,
    *const libc::timespec,
    *const libc::sigset_t,
) -> c_int;

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: ppoll(2)'s arguments.
    crate::comp_channel::saw_fds(unsafe { poll_fds(fds, n) }.iter().map(|p| p.fd));
    match next!("ppoll", PpollFn) {
        // SAFETY: forwarded to libc with the caller's arguments.
        Some(real) => unsafe { real(fds, n, timeout, mask) },
        None => {
            crate::errno::set(libc::ENOSYS);
            -1
        }
    }
}

/// glibc's `ppoll` under `_FORTIFY_SOURCE`.
#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: *const libc::timespec,
    mask: *const libc::sigset_t,
    fdslen: usize,
) -> c_int {
    type F = unsafe extern "C" fn(
        *mut libc::pollfd,
        libc::nfds_t,
        *const libc::timespec,
        *const libc::sigset_t,
        usize,
    ) -> c_int;
    // SAFETY: ppoll(2)'s arguments.
    crate::comp_channel::saw_fds(unsafe { poll_fds(fds, n) }.iter().map(|p| p.fd));
    match next!("__ppoll_chk", F) {
        // SAFETY: forwarded to libc with the caller's arguments.
        Some(real) => unsafe { real(fds, n, timeout, mask, fdslen) },
        None => {
            crate::errno::set(libc::ENOSYS);
            -1
        }
    }
}

/// The channel fds in any of `select`'s three sets.
///
/// # Safety
/// Each set must be NULL or a valid `fd_set`.
unsafe fn saw_fd_sets(nfds: c_int, sets: [*const libc::fd_set; 3]) {
    for set in sets {
        // SAFETY: forwarded.
        crate::comp_channel::saw_fds(
            unsafe { crate::comp_channel::in_fd_set(nfds, set) }.into_iter(),
        );
    }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    type F = unsafe extern "C" fn(
        c_int,
        *mut libc::fd_set,
        *mut libc::fd_set,
        *mut libc::fd_set,
        *mut libc::timeval,
    ) -> c_int;
    // SAFETY: select(2)'s arguments.
    unsafe { saw_fd_sets(nfds, [r, w, e].map(|s| s.cast_const())) };
    match next!("select", F) {
        // SAFETY: forwarded to libc with the caller's arguments.
        Some(real) => unsafe { real(nfds, r, w, e, timeout) },
        None => {
            crate::errno::set(libc::ENOSYS);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    timeout: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    type F = unsafe extern "C" fn(
        c_int,
        *mut libc::fd_set,
        *mut libc::fd_set,
        *mut libc::fd_set,
        *const libc::timespec,
        *const libc::sigset_t,
    ) -> c_int;
    // SAFETY: pselect(2)'s arguments.
    unsafe { saw_fd_sets(nfds, [r, w, e].map(|s| s.cast_const())) };
    match next!("pselect", F) {
        // SAFETY: forwarded to libc with the caller's arguments.
        Some(real) => unsafe { real(nfds, r, w, e, timeout, mask) },
        None => {
            crate::errno::set(libc::ENOSYS);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    event: *mut libc::epoll_event,
) -> c_int {
    type F = unsafe extern "C" fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int;
    if op != libc::EPOLL_CTL_DEL {
        crate::comp_channel::saw_fds(std::iter::once(fd));
    }
    match next!("epoll_ctl", F) {
        // SAFETY: forwarded to libc with the caller's arguments.
        Some(real) => unsafe { real(epfd, op, fd, event) },
        None => {
            crate::errno::set(libc::ENOSYS);
            -1
        }
    }
}

/// C's `fcntl(int fd, int cmd, ...)`, called through a variadic pointer
/// with the one argument every command takes at most (an int or a
/// pointer, both passed in one register).
type FcntlFn = unsafe extern "C" fn(c_int, c_int, ...) -> c_int;

/// After a successful `F_SETFL`, tell the channel `fd` may be.
fn after_fcntl(fd: c_int, cmd: c_int, arg: usize, rc: c_int) {
    if cmd == libc::F_SETFL && rc != -1 {
        // F_SETFL's argument is an int: only the low 32 bits are the
        // caller's.
        let flags = arg as u32 as c_int;
        crate::comp_channel::saw_nonblocking(fd, flags & libc::O_NONBLOCK != 0);
    }
}

/// glibc's `fcntl` (variadic in C; its one optional argument is taken
/// as a register-sized value and forwarded as it came).
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    let Some(real) = next!("fcntl", FcntlFn) else {
        crate::errno::set(libc::ENOSYS);
        return -1;
    };
    // SAFETY: forwarded to libc with the caller's arguments.
    let rc = unsafe { real(fd, cmd, arg) };
    after_fcntl(fd, cmd, arg, rc);
    rc
}

/// `fcntl` of a program built with `_FILE_OFFSET_BITS=64` (glibc ≥ 2.28
/// redirects it there).
#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    let Some(real) = next!("fcntl64", FcntlFn) else {
        crate::errno::set(libc::ENOSYS);
        return -1;
    };
    // SAFETY: forwarded to libc with the caller's arguments.
    let rc = unsafe { real(fd, cmd, arg) };
    after_fcntl(fd, cmd, arg, rc);
    rc
}

/// glibc's `ioctl(int fd, unsigned long request, ...)`; `FIONBIO` sets
/// or clears `O_NONBLOCK` as `fcntl(F_SETFL)` does.
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: libc::c_ulong, arg: usize) -> c_int {
    type F = unsafe extern "C" fn(c_int, libc::c_ulong, ...) -> c_int;
    let Some(real) = next!("ioctl", F) else {
        crate::errno::set(libc::ENOSYS);
        return -1;
    };
    // SAFETY: forwarded to libc with the caller's arguments.
    let rc = unsafe { real(fd, request, arg) };
    if request == libc::FIONBIO as libc::c_ulong && rc != -1 && arg != 0 {
        // SAFETY: FIONBIO's argument is a pointer to an int, which the
        // kernel just read successfully.
        let on = unsafe { *(arg as *const c_int) } != 0;
        crate::comp_channel::saw_nonblocking(fd, on);
    }
    rc
}
