//! librdmacm's API as this library exports it.
//!
//! Each function is defined as `stag_cm_<name>` and given its public name
//! with librdmacm's symbol version by `.symver` below (`librdmacm.map`
//! declares the versions); rustc's own version script keeps the
//! `stag_cm_` names and the plugin's other exports. So an application
//! linked against librdmacm.so.1 binds here whether the library is
//! preloaded or stands in as librdmacm.so.1 itself.
//!
//! Every entry point checks its pointers (NULL, and ids, channels and
//! events must be ones this library made), catches panics, and fails as
//! librdmacm does: -1 (or NULL) with `errno`. The rsocket API and
//! multicast, which stag0 has no use for, fail with ENOSYS.

#![allow(clippy::missing_safety_doc)]

use std::os::raw::{c_char, c_int, c_void};

use tracing::{debug, error};

use super::addr;
use super::channel::Channel;
use super::event;
use super::id::Id;
use super::{conn, listen, ops, qp, verbs};
use crate::errno::{self, cm_int, cm_ptr, guard};
use crate::ffi;

/// `&T` from a pointer the application handed us, or EINVAL.
///
/// # Safety
/// `p` is NULL or valid for the call.
unsafe fn opt_ref<'a, T>(p: *const T) -> Option<&'a T> {
    // SAFETY: NULL or valid (caller).
    unsafe { p.as_ref() }
}

/// `&mut T` from a pointer the application handed us, or EINVAL.
///
/// # Safety
/// `p` is NULL or valid and unaliased for the call.
unsafe fn need_mut<'a, T>(p: *mut T) -> Result<&'a mut T, c_int> {
    // SAFETY: NULL or valid (caller).
    unsafe { p.as_mut() }.ok_or(libc::EINVAL)
}

// ---- event channels and events ----

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_create_event_channel() -> *mut ffi::rdma_event_channel {
    cm_ptr("rdma_create_event_channel", || {
        let ch = Channel::new()?;
        ch.register();
        Ok(ch.raw())
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_destroy_event_channel(channel: *mut ffi::rdma_event_channel) {
    guard("rdma_destroy_event_channel", (), || {
        // librdmacm's returns nothing and checks nothing. A channel destroyed
        // twice is what Debian's perftest (4.5-0.17) does after a refused
        // connect: its retry path destroys the channel, then its error path
        // destroys it again. EINVAL quietly (debug log), as for any other
        // handle this library does not know.
        if Channel::unregister(channel).is_none() {
            debug!(
                destroyed_before = Channel::was_destroyed(channel),
                "rdma_cm: rdma_destroy_event_channel: not a channel of this library"
            );
            errno::set(libc::EINVAL);
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_get_cm_event(
    channel: *mut ffi::rdma_event_channel,
    ev: *mut *mut ffi::rdma_cm_event,
) -> c_int {
    cm_int("rdma_get_cm_event", || {
        if ev.is_null() {
            return Err(libc::EINVAL);
        }
        let ch = match Channel::lookup(channel) {
            Ok(ch) => ch,
            // A thread that asks a channel another thread destroyed for
            // its next event sleeps, as it would on the kernel's rdma_cm
            // had it got there first (blocked in read(2) until exit):
            // rping's cm thread loops back here while its main thread
            // tears down, and an EINVAL made rping exit non-zero.
            Err(_) if Channel::was_destroyed(channel) => loop {
                std::thread::park();
            },
            Err(e) => return Err(e),
        };
        let e = conn::get_event(&*ch)?;
        // SAFETY: non-NULL out-pointer from the application.
        unsafe { *ev = e };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_ack_cm_event(ev: *mut ffi::rdma_cm_event) -> c_int {
    cm_int("rdma_ack_cm_event", || event::ack(ev))
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_event_str(kind: ffi::rdma_cm_event_type) -> *const c_char {
    guard("rdma_event_str", c"UNKNOWN EVENT".as_ptr(), || {
        event::event_str(kind).as_ptr()
    })
}

// ---- ids ----

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_create_id(
    channel: *mut ffi::rdma_event_channel,
    id: *mut *mut ffi::rdma_cm_id,
    context: *mut c_void,
    ps: ffi::rdma_port_space,
) -> c_int {
    cm_int("rdma_create_id", || {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        let new = ops::create_id(channel, context, ps, None)?;
        // SAFETY: non-NULL out-pointer from the application.
        unsafe { *id = new.raw() };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_destroy_id(id: *mut ffi::rdma_cm_id) -> c_int {
    cm_int("rdma_destroy_id", || ops::destroy_id(id))
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_bind_addr(
    id: *mut ffi::rdma_cm_id,
    addr: *mut ffi::sockaddr,
) -> c_int {
    cm_int("rdma_bind_addr", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's address.
        let a = unsafe { addr::from_c(addr) }?;
        ops::bind(&id, a)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_resolve_addr(
    id: *mut ffi::rdma_cm_id,
    src: *mut ffi::sockaddr,
    dst: *mut ffi::sockaddr,
    timeout_ms: c_int,
) -> c_int {
    cm_int("rdma_resolve_addr", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's addresses.
        let (src, dst) = unsafe { (ops::opt_addr(src)?, addr::from_c(dst)?) };
        debug!(?src, %dst, timeout_ms, "rdma_resolve_addr");
        let timeout = std::time::Duration::from_millis(timeout_ms.max(0) as u64);
        ops::resolve_addr(&id, src, dst, timeout)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_resolve_route(
    id: *mut ffi::rdma_cm_id,
    timeout_ms: c_int,
) -> c_int {
    cm_int("rdma_resolve_route", || {
        let timeout = std::time::Duration::from_millis(timeout_ms.max(0) as u64);
        ops::resolve_route(&Id::lookup(id)?, timeout)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_listen(id: *mut ffi::rdma_cm_id, _backlog: c_int) -> c_int {
    cm_int("rdma_listen", || {
        let id = Id::lookup(id)?;
        verbs::stag()?;
        listen::listen(&id)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_connect(
    id: *mut ffi::rdma_cm_id,
    param: *mut ffi::rdma_conn_param,
) -> c_int {
    cm_int("rdma_connect", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's parameters.
        conn::connect(&id, unsafe { opt_ref(param) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_accept(
    id: *mut ffi::rdma_cm_id,
    param: *mut ffi::rdma_conn_param,
) -> c_int {
    cm_int("rdma_accept", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's parameters.
        conn::accept(&id, unsafe { opt_ref(param) })
    })
}

/// Private data the application passes (NULL/0: none).
///
/// # Safety
/// NULL or `len` readable bytes.
unsafe fn bytes<'a>(p: *const c_void, len: u8) -> &'a [u8] {
    if p.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: `len` readable bytes (caller).
        unsafe { std::slice::from_raw_parts(p as *const u8, len as usize) }
    }
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_reject(
    id: *mut ffi::rdma_cm_id,
    private_data: *const c_void,
    len: u8,
) -> c_int {
    cm_int("rdma_reject", || {
        let id = Id::lookup(id)?;
        // SAFETY: the application's private data.
        conn::reject(&id, unsafe { bytes(private_data, len) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_reject_ece(
    id: *mut ffi::rdma_cm_id,
    private_data: *const c_void,
    len: u8,
) -> c_int {
    cm_int("rdma_reject_ece", || {
        let id = Id::lookup(id)?;
        // SAFETY: the application's private data.
        conn::reject(&id, unsafe { bytes(private_data, len) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_disconnect(id: *mut ffi::rdma_cm_id) -> c_int {
    cm_int("rdma_disconnect", || conn::disconnect(&Id::lookup(id)?))
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_establish(id: *mut ffi::rdma_cm_id) -> c_int {
    cm_int("rdma_establish", || qp::establish(&Id::lookup(id)?))
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_notify(
    id: *mut ffi::rdma_cm_id,
    _event: ffi::ibv_event_type,
) -> c_int {
    cm_int("rdma_notify", || qp::notify(&Id::lookup(id)?))
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_get_request(
    listen: *mut ffi::rdma_cm_id,
    id: *mut *mut ffi::rdma_cm_id,
) -> c_int {
    cm_int("rdma_get_request", || {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        let child = qp::get_request(&Id::lookup(listen)?)?;
        // SAFETY: non-NULL out-pointer from the application.
        unsafe { *id = child };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_migrate_id(
    id: *mut ffi::rdma_cm_id,
    channel: *mut ffi::rdma_event_channel,
) -> c_int {
    cm_int("rdma_migrate_id", || {
        ops::migrate(&Id::lookup(id)?, channel)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_set_option(
    id: *mut ffi::rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    cm_int("rdma_set_option", || {
        ops::set_option(&Id::lookup(id)?, level, optname, optval, optlen)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_get_src_port(id: *mut ffi::rdma_cm_id) -> u16 {
    guard("rdma_get_src_port", 0, || match Id::lookup(id) {
        // SAFETY: a live id; reading its address storage.
        Ok(id) => addr::port_be(unsafe { &(*id.raw()).route.addr.__bindgen_anon_1.src_storage }),
        Err(_) => 0,
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_get_dst_port(id: *mut ffi::rdma_cm_id) -> u16 {
    guard("rdma_get_dst_port", 0, || match Id::lookup(id) {
        // SAFETY: a live id; reading its address storage.
        Ok(id) => addr::port_be(unsafe { &(*id.raw()).route.addr.__bindgen_anon_2.dst_storage }),
        Err(_) => 0,
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_set_local_ece(
    id: *mut ffi::rdma_cm_id,
    ece: *mut ffi::ibv_ece,
) -> c_int {
    cm_int("rdma_set_local_ece", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's struct.
        let ece = unsafe { opt_ref(ece) }.ok_or(libc::EINVAL)?;
        // SAFETY: application thread inside a cm call on `id`.
        if !unsafe { id.c() }.qp.is_null() || ece.vendor_id == 0 || ece.comp_mask != 0 {
            return Err(libc::EINVAL);
        }
        id.state().local_ece = (ece.vendor_id, ece.options);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_get_remote_ece(
    id: *mut ffi::rdma_cm_id,
    ece: *mut ffi::ibv_ece,
) -> c_int {
    cm_int("rdma_get_remote_ece", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's struct.
        let ece = unsafe { need_mut(ece) }?;
        // SAFETY: application thread inside a cm call on `id`.
        if !unsafe { id.c() }.qp.is_null() {
            return Err(libc::EINVAL);
        }
        // MPA carries no ECE: the peer announced nothing.
        ece.vendor_id = 0;
        ece.options = 0;
        ece.comp_mask = 0;
        Ok(())
    })
}

// ---- QPs, SRQs, endpoints ----

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_create_qp(
    id: *mut ffi::rdma_cm_id,
    pd: *mut ffi::ibv_pd,
    attr: *mut ffi::ibv_qp_init_attr,
) -> c_int {
    cm_int("rdma_create_qp", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's attributes.
        let attr = unsafe { need_mut(attr) }?;
        // SAFETY: the application's attributes and PD.
        unsafe { qp::create_qp(&id, pd, attr) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_create_qp_ex(
    id: *mut ffi::rdma_cm_id,
    attr: *mut ffi::ibv_qp_init_attr_ex,
) -> c_int {
    cm_int("rdma_create_qp_ex", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's attributes.
        let attr = unsafe { need_mut(attr) }?;
        // SAFETY: the application's attributes.
        unsafe { qp::create_qp_ex(&id, attr) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_destroy_qp(id: *mut ffi::rdma_cm_id) {
    guard("rdma_destroy_qp", (), || {
        if let Ok(id) = Id::lookup(id) {
            qp::destroy_qp(&id)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_create_srq(
    id: *mut ffi::rdma_cm_id,
    pd: *mut ffi::ibv_pd,
    attr: *mut ffi::ibv_srq_init_attr,
) -> c_int {
    cm_int("rdma_create_srq", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's attributes.
        let attr = unsafe { need_mut(attr) }?;
        // SAFETY: the application's attributes and PD.
        unsafe { qp::create_srq(&id, pd, attr) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_create_srq_ex(
    id: *mut ffi::rdma_cm_id,
    attr: *mut ffi::ibv_srq_init_attr_ex,
) -> c_int {
    cm_int("rdma_create_srq_ex", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's attributes.
        let attr = unsafe { need_mut(attr) }?;
        // SAFETY: the application's attributes.
        unsafe { qp::create_srq_ex(&id, attr) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_destroy_srq(id: *mut ffi::rdma_cm_id) {
    guard("rdma_destroy_srq", (), || {
        if let Ok(id) = Id::lookup(id) {
            qp::destroy_srq(&id)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_init_qp_attr(
    id: *mut ffi::rdma_cm_id,
    attr: *mut ffi::ibv_qp_attr,
    mask: *mut c_int,
) -> c_int {
    cm_int("rdma_init_qp_attr", || {
        let id = Id::lookup(id)?;
        // SAFETY: NULL or the application's out-structs.
        let (attr, mask) = unsafe { (need_mut(attr)?, need_mut(mask)?) };
        qp::init_qp_attr(&id, attr, mask)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_create_ep(
    id: *mut *mut ffi::rdma_cm_id,
    res: *mut ffi::rdma_addrinfo,
    pd: *mut ffi::ibv_pd,
    attr: *mut ffi::ibv_qp_init_attr,
) -> c_int {
    cm_int("rdma_create_ep", || {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: NULL or the application's addrinfo.
        let res = unsafe { opt_ref(res) }.ok_or(libc::EINVAL)?;
        // SAFETY: the application's addrinfo, PD and attributes.
        let new = unsafe { qp::create_ep(res, pd, attr) }?;
        // SAFETY: non-NULL out-pointer from the application.
        unsafe { *id = new };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_destroy_ep(id: *mut ffi::rdma_cm_id) {
    guard("rdma_destroy_ep", (), || {
        if let Ok(id) = Id::lookup(id) {
            qp::destroy_ep(&id)
        }
    })
}

// ---- addresses and devices ----

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const ffi::rdma_addrinfo,
    res: *mut *mut ffi::rdma_addrinfo,
) -> c_int {
    guard("rdma_getaddrinfo", -1, || {
        // SAFETY: the application's strings, hints and out-pointer.
        match unsafe { addr::getaddrinfo(node, service, hints, res) } {
            Ok(()) => 0,
            Err(addr::GaiError::Gai(code)) => {
                // SAFETY: the application's strings.
                let (n, s) = unsafe { (addr::cstr_lossy(node), addr::cstr_lossy(service)) };
                debug!(node = %n, service = %s, code, "rdma_getaddrinfo: getaddrinfo failed");
                code
            }
            Err(addr::GaiError::Errno(e)) => {
                errno::set(e);
                -1
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_freeaddrinfo(res: *mut ffi::rdma_addrinfo) {
    // SAFETY: NULL or a list from rdma_getaddrinfo.
    guard("rdma_freeaddrinfo", (), || unsafe {
        addr::freeaddrinfo(res)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_get_devices(n: *mut c_int) -> *mut *mut ffi::ibv_context {
    let list = cm_ptr("rdma_get_devices", || {
        let stag = verbs::stag()?;
        let size = 2 * std::mem::size_of::<*mut ffi::ibv_context>();
        // SAFETY: plain malloc.
        let list = unsafe { libc::malloc(size) } as *mut *mut ffi::ibv_context;
        if list.is_null() {
            return Err(libc::ENOMEM);
        }
        // SAFETY: two slots just allocated.
        unsafe {
            *list = stag.ctx;
            *list.add(1) = std::ptr::null_mut();
        }
        Ok(list)
    });
    if !n.is_null() {
        // SAFETY: non-NULL out-pointer from the application.
        unsafe { *n = if list.is_null() { 0 } else { 1 } };
    }
    list
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_free_devices(list: *mut *mut ffi::ibv_context) {
    // SAFETY: NULL or a list from rdma_get_devices (malloc'd; the context
    // stays open for the process).
    guard("rdma_free_devices", (), || unsafe {
        libc::free(list.cast())
    })
}

// ---- not on stag0: multicast ----

fn no_multicast(call: &'static str) -> c_int {
    cm_int(call, || {
        error!(
            call,
            "rdma_cm: multicast needs UD QPs; stag0 (iWARP) has none"
        );
        Err(libc::ENOSYS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_join_multicast(
    _id: *mut ffi::rdma_cm_id,
    _addr: *mut ffi::sockaddr,
    _context: *mut c_void,
) -> c_int {
    no_multicast("rdma_join_multicast")
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_join_multicast_ex(
    _id: *mut ffi::rdma_cm_id,
    _attr: *mut ffi::rdma_cm_join_mc_attr_ex,
    _context: *mut c_void,
) -> c_int {
    no_multicast("rdma_join_multicast_ex")
}

#[no_mangle]
pub unsafe extern "C" fn stag_cm_rdma_leave_multicast(
    _id: *mut ffi::rdma_cm_id,
    _addr: *mut ffi::sockaddr,
) -> c_int {
    no_multicast("rdma_leave_multicast")
}

// ---- not on stag0: rsockets ----

/// An rsocket call: -1/ENOSYS (rsockets need librdmacm's own protocol
/// over RDMA, which stag does not provide).
fn no_rsocket(call: &'static str) -> c_int {
    cm_int(call, || {
        error!(call, "rdma_cm: rsockets are not provided by stag");
        Err(libc::ENOSYS)
    })
}

macro_rules! rsocket_stubs {
    ($($name:ident => $c:literal ( $($arg:ident : $ty:ty),* ) -> $ret:ty;)*) => {
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
                $(let _ = $arg;)*
                no_rsocket($c) as $ret
            }
        )*
    };
}

type Sa = *const libc::sockaddr;
type SaMut = *mut libc::sockaddr;
type Len = libc::socklen_t;

rsocket_stubs! {
    stag_cm_rsocket => "rsocket"(domain: c_int, ty: c_int, protocol: c_int) -> c_int;
    stag_cm_rbind => "rbind"(s: c_int, a: Sa, l: Len) -> c_int;
    stag_cm_rlisten => "rlisten"(s: c_int, backlog: c_int) -> c_int;
    stag_cm_raccept => "raccept"(s: c_int, a: SaMut, l: *mut Len) -> c_int;
    stag_cm_rconnect => "rconnect"(s: c_int, a: Sa, l: Len) -> c_int;
    stag_cm_rshutdown => "rshutdown"(s: c_int, how: c_int) -> c_int;
    stag_cm_rclose => "rclose"(s: c_int) -> c_int;
    stag_cm_rrecv => "rrecv"(s: c_int, b: *mut c_void, n: usize, f: c_int) -> isize;
    stag_cm_rrecvfrom => "rrecvfrom"(s: c_int, b: *mut c_void, n: usize, f: c_int, a: SaMut, l: *mut Len) -> isize;
    stag_cm_rrecvmsg => "rrecvmsg"(s: c_int, m: *mut libc::msghdr, f: c_int) -> isize;
    stag_cm_rsend => "rsend"(s: c_int, b: *const c_void, n: usize, f: c_int) -> isize;
    stag_cm_rsendto => "rsendto"(s: c_int, b: *const c_void, n: usize, f: c_int, a: Sa, l: Len) -> isize;
    stag_cm_rsendmsg => "rsendmsg"(s: c_int, m: *const libc::msghdr, f: c_int) -> isize;
    stag_cm_rread => "rread"(s: c_int, b: *mut c_void, n: usize) -> isize;
    stag_cm_rreadv => "rreadv"(s: c_int, v: *const libc::iovec, n: c_int) -> isize;
    stag_cm_rwrite => "rwrite"(s: c_int, b: *const c_void, n: usize) -> isize;
    stag_cm_rwritev => "rwritev"(s: c_int, v: *const libc::iovec, n: c_int) -> isize;
    stag_cm_rpoll => "rpoll"(f: *mut libc::pollfd, n: libc::nfds_t, t: c_int) -> c_int;
    stag_cm_rselect => "rselect"(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, t: *mut libc::timeval) -> c_int;
    stag_cm_rgetpeername => "rgetpeername"(s: c_int, a: SaMut, l: *mut Len) -> c_int;
    stag_cm_rgetsockname => "rgetsockname"(s: c_int, a: SaMut, l: *mut Len) -> c_int;
    stag_cm_rsetsockopt => "rsetsockopt"(s: c_int, lv: c_int, o: c_int, v: *const c_void, l: Len) -> c_int;
    stag_cm_rgetsockopt => "rgetsockopt"(s: c_int, lv: c_int, o: c_int, v: *mut c_void, l: *mut Len) -> c_int;
    // Variadic in C (`int rfcntl(int, int, ...)`); the fixed arguments
    // arrive in the same registers.
    stag_cm_rfcntl => "rfcntl"(s: c_int, cmd: c_int) -> c_int;
    stag_cm_riomap => "riomap"(s: c_int, b: *mut c_void, n: usize, prot: c_int, f: c_int, off: libc::off_t) -> libc::off_t;
    stag_cm_riounmap => "riounmap"(s: c_int, b: *mut c_void, n: usize) -> c_int;
    stag_cm_riowrite => "riowrite"(s: c_int, b: *const c_void, n: usize, off: libc::off_t, f: c_int) -> usize;
}

crate::ops::rdma_cm_table!();
