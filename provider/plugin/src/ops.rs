//! The plugin's two tables, in the manner of the bottom of rdma-core's
//! `siw.c`: the verbs ops a context answers with (and the context's own
//! life, `alloc_context`/`free_context`, which installs them), and the
//! rdma_cm exports (librdmacm's public names bound to `cm/exports.rs`).
//!
//! This is the top of the plugin: it names every verb; nothing below
//! names it but the driver, which reaches `alloc_context` here.
//! The context's state hangs off libibverbs' `verbs_context`
//! ([`handle::StagContext`]); all contexts in a process share one
//! userspace RNIC, so registrations, QPs and the progress engine are per
//! process, as with a kernel device.

use std::ffi::c_int;
use std::os::fd::{FromRawFd, OwnedFd};
use std::ptr;
use std::sync::{Arc, OnceLock};

use provider::device::Device;
use provider::identity;

use crate::async_events::AsyncEvents;
use crate::errno::{self, guard};
use crate::ffi::*;
use crate::handle::{self, ContextState, StagContext};

// ---- the context ----

/// The process's RNIC, started by the first `ibv_open_device`.
///
/// Its engine and connection threads live in the process that started it:
/// a child made by `fork()` has none of them, so there stag0 does not open
/// (`ENODEV`); a child that wants RDMA execs first.
fn device() -> Result<Device, provider::device::DeviceError> {
    static DEVICE: OnceLock<(u32, Device)> = OnceLock::new();
    let pid = std::process::id();
    let (owner, dev) = match DEVICE.get() {
        Some(d) => d,
        None => {
            let dev = Device::open(identity::DEVICE_NAME)?;
            DEVICE.get_or_init(|| (pid, dev))
        }
    };
    if *owner != pid {
        return Err(nix::Error::ENODEV.into());
    }
    Ok(dev.clone())
}

pub(crate) unsafe extern "C" fn alloc_context(
    ibdev: *mut ibv_device,
    cmd_fd: c_int,
    _private: *mut std::ffi::c_void,
) -> *mut verbs_context {
    guard("alloc_context", ptr::null_mut(), || {
        // SAFETY: libibverbs passes the device our driver matched.
        unsafe { handle::adopt_device(ibdev) };
        let device = match device() {
            Ok(d) => d,
            Err(provider::device::DeviceError::Sys(nix::Error::ENODEV)) => {
                tracing::error!("stag0: not available in a child made by fork() (exec first)");
                errno::set(libc::ENODEV);
                return ptr::null_mut();
            }
            Err(e) => {
                tracing::error!("stag0: cannot start the userspace RNIC: {e}");
                errno::set(errno::of_device(&e));
                return ptr::null_mut();
            }
        };
        let mut fds = [0; 2];
        // A socket pair rather than a pipe: sends take MSG_NOSIGNAL, so an
        // event posted after the application closed the context raises no
        // SIGPIPE. libibverbs read()s and polls it like the kernel's fd.
        // SAFETY: socketpair fills two fds.
        if unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        } != 0
        {
            return ptr::null_mut();
        }
        // SAFETY: fresh fds we own; fds[0] becomes async_fd, which
        // verbs_uninit_context closes.
        let async_tx = unsafe { OwnedFd::from_raw_fd(fds[1]) };
        // Our own handle on the application's end, to take a destroyed
        // object's unread events back out.
        // SAFETY: fds[0] is open; the duplicate is ours.
        let rx = unsafe { libc::fcntl(fds[0], libc::F_DUPFD_CLOEXEC, 0) };
        if rx < 0 {
            // SAFETY: our fd, not handed out.
            unsafe { libc::close(fds[0]) };
            return ptr::null_mut();
        }
        // SAFETY: the fresh duplicate.
        let async_events = Arc::new(AsyncEvents::new(async_tx, unsafe {
            OwnedFd::from_raw_fd(rx)
        }));
        // SAFETY: libibverbs allocates size_of::<StagContext>() zeroed
        // bytes and initialises the verbs_context at the offset we give.
        let sc = unsafe {
            _verbs_init_and_alloc_context(
                ibdev,
                cmd_fd,
                std::mem::size_of::<StagContext>(),
                std::mem::offset_of!(StagContext, vctx) as *mut verbs_context,
                0,
            )
        }
        .cast::<StagContext>();
        if sc.is_null() {
            // SAFETY: our fd, not handed out.
            unsafe { libc::close(fds[0]) };
            return ptr::null_mut();
        }
        // SAFETY: sc is the fresh allocation; OPS lives for the process.
        unsafe {
            (*sc).vctx.context.async_fd = fds[0];
            (*sc).vctx.context.num_comp_vectors = 1;
            verbs_set_ops(&mut (*sc).vctx, &VERBS_OPS.0);
            let events = async_events.clone();
            let fatal: Arc<provider::fatal::FatalHook> =
                Arc::new(move || events.post_device(1, IBV_EVENT_DEVICE_FATAL));
            provider::fatal::on_device_fatal(&fatal);
            (*sc).state = Box::into_raw(Box::new(ContextState {
                device,
                async_events,
                _fatal: fatal,
            }));
            &mut (*sc).vctx
        }
    })
}

unsafe extern "C" fn free_context(ctx: *mut ibv_context) {
    guard("free_context", (), || {
        if !handle::is_stag_context(ctx) {
            return;
        }
        // SAFETY: one of our contexts (checked); libibverbs calls this once.
        unsafe {
            let sc = handle::stag_context(ctx);
            drop(Box::from_raw((*sc).state));
            verbs_uninit_context(&mut (*sc).vctx);
            libc::free(sc.cast());
        }
    })
}

/// libibverbs' `ibv_get_cq_event` read an event of `cq` (without `stag
/// run`'s interposed one): counted for `destroy_cq`.
unsafe extern "C" fn cq_event(cq: *mut ibv_cq) {
    // SAFETY: libibverbs passes the CQ the record named, one of ours.
    unsafe { crate::cq::count_event(cq) }
}

/// The `async_event` op: libibverbs read `event` from `ctx`'s `async_fd`.
unsafe extern "C" fn async_event(ctx: *mut ibv_context, event: *mut ibv_async_event) {
    guard("async_event", (), || {
        if event.is_null() {
            return;
        }
        // SAFETY: libibverbs passes its live context and the event it filled.
        let (Some(st), ev) = (unsafe { handle::context(ctx) }, unsafe { &*event }) else {
            return;
        };
        if !crate::async_events::names_object(ev.event_type) {
            return;
        }
        // SAFETY: for these types libibverbs stored the object pointer;
        // the QP, CQ, SRQ and WQ members are pointers in the same place.
        let element = unsafe { ev.element.qp } as usize as u64;
        st.async_events.note_read(element, ev.event_type);
    })
}

// ---- the verbs table ----

/// The verbs table: the context's ops; NULL entries keep libibverbs' EOPNOTSUPP stubs.
#[repr(transparent)]
struct VerbsOps(verbs_context_ops);

// SAFETY: immutable table of function pointers.
unsafe impl Sync for VerbsOps {}

static VERBS_OPS: VerbsOps = VerbsOps(verbs_context_ops {
    alloc_pd: Some(crate::mr::alloc_pd),
    dealloc_pd: Some(crate::mr::dealloc_pd),
    reg_mr: Some(crate::mr::reg_mr),
    dereg_mr: Some(crate::mr::dereg_mr),
    create_cq: Some(crate::cq::create_cq),
    destroy_cq: Some(crate::cq::destroy_cq),
    poll_cq: Some(crate::cq::poll_cq),
    req_notify_cq: Some(crate::cq::req_notify_cq),
    resize_cq: Some(crate::cq::resize_cq),
    cq_event: Some(cq_event),
    create_qp: Some(crate::qp::create_qp),
    create_qp_ex: Some(crate::qp::create_qp_ex),
    modify_qp: Some(crate::qp::modify_qp),
    query_qp: Some(crate::qp::query_qp),
    destroy_qp: Some(crate::qp::destroy_qp),
    post_send: Some(crate::qp::post_send),
    post_recv: Some(crate::qp::post_recv),
    create_srq: Some(crate::srq::create_srq),
    modify_srq: Some(crate::srq::modify_srq),
    query_srq: Some(crate::srq::query_srq),
    destroy_srq: Some(crate::srq::destroy_srq),
    post_srq_recv: Some(crate::srq::post_srq_recv),
    query_device_ex: Some(crate::query::query_device_ex),
    query_port: Some(crate::query::query_port),
    async_event: Some(async_event),
    free_context: Some(free_context),
    ..ZERO_OPS
});

/// An ops table with every entry NULL.
// SAFETY: all-zero is a valid verbs_context_ops (every field is a nullable
// pointer).
const ZERO_OPS: verbs_context_ops = unsafe { std::mem::zeroed() };

// ---- the rdma_cm table ----
//
// librdmacm's public names and versions, each bound to its `stag_cm_`
// entry point in `cm/exports.rs`. Kept in step with `cm/librdmacm.map`
// (the test below checks both against each other).
//
// The assembler binds a `name@@VERSION` only to a symbol defined in the
// same object, so the table is emitted where the entry points are:
// `cm/exports.rs` expands this macro.
macro_rules! rdma_cm_table {
    () => {
        #[cfg(not(test))]
        std::arch::global_asm!(
            ".symver stag_cm_rdma_create_event_channel, rdma_create_event_channel@@RDMACM_1.0",
            ".symver stag_cm_rdma_destroy_event_channel, rdma_destroy_event_channel@@RDMACM_1.0",
            ".symver stag_cm_rdma_create_id, rdma_create_id@@RDMACM_1.0",
            ".symver stag_cm_rdma_destroy_id, rdma_destroy_id@@RDMACM_1.0",
            ".symver stag_cm_rdma_bind_addr, rdma_bind_addr@@RDMACM_1.0",
            ".symver stag_cm_rdma_resolve_addr, rdma_resolve_addr@@RDMACM_1.0",
            ".symver stag_cm_rdma_resolve_route, rdma_resolve_route@@RDMACM_1.0",
            ".symver stag_cm_rdma_create_qp, rdma_create_qp@@RDMACM_1.0",
            ".symver stag_cm_rdma_destroy_qp, rdma_destroy_qp@@RDMACM_1.0",
            ".symver stag_cm_rdma_connect, rdma_connect@@RDMACM_1.0",
            ".symver stag_cm_rdma_listen, rdma_listen@@RDMACM_1.0",
            ".symver stag_cm_rdma_accept, rdma_accept@@RDMACM_1.0",
            ".symver stag_cm_rdma_reject, rdma_reject@@RDMACM_1.0",
            ".symver stag_cm_rdma_notify, rdma_notify@@RDMACM_1.0",
            ".symver stag_cm_rdma_disconnect, rdma_disconnect@@RDMACM_1.0",
            ".symver stag_cm_rdma_get_cm_event, rdma_get_cm_event@@RDMACM_1.0",
            ".symver stag_cm_rdma_ack_cm_event, rdma_ack_cm_event@@RDMACM_1.0",
            ".symver stag_cm_rdma_get_src_port, rdma_get_src_port@@RDMACM_1.0",
            ".symver stag_cm_rdma_get_dst_port, rdma_get_dst_port@@RDMACM_1.0",
            ".symver stag_cm_rdma_join_multicast, rdma_join_multicast@@RDMACM_1.0",
            ".symver stag_cm_rdma_leave_multicast, rdma_leave_multicast@@RDMACM_1.0",
            ".symver stag_cm_rdma_get_devices, rdma_get_devices@@RDMACM_1.0",
            ".symver stag_cm_rdma_free_devices, rdma_free_devices@@RDMACM_1.0",
            ".symver stag_cm_rdma_event_str, rdma_event_str@@RDMACM_1.0",
            ".symver stag_cm_rdma_set_option, rdma_set_option@@RDMACM_1.0",
            ".symver stag_cm_rdma_migrate_id, rdma_migrate_id@@RDMACM_1.0",
            ".symver stag_cm_rdma_getaddrinfo, rdma_getaddrinfo@@RDMACM_1.0",
            ".symver stag_cm_rdma_freeaddrinfo, rdma_freeaddrinfo@@RDMACM_1.0",
            ".symver stag_cm_rdma_get_request, rdma_get_request@@RDMACM_1.0",
            ".symver stag_cm_rdma_create_ep, rdma_create_ep@@RDMACM_1.0",
            ".symver stag_cm_rdma_destroy_ep, rdma_destroy_ep@@RDMACM_1.0",
            ".symver stag_cm_rdma_create_srq, rdma_create_srq@@RDMACM_1.0",
            ".symver stag_cm_rdma_destroy_srq, rdma_destroy_srq@@RDMACM_1.0",
            ".symver stag_cm_rdma_create_srq_ex, rdma_create_srq_ex@@RDMACM_1.0",
            ".symver stag_cm_rdma_create_qp_ex, rdma_create_qp_ex@@RDMACM_1.0",
            ".symver stag_cm_rsocket, rsocket@@RDMACM_1.0",
            ".symver stag_cm_rbind, rbind@@RDMACM_1.0",
            ".symver stag_cm_rlisten, rlisten@@RDMACM_1.0",
            ".symver stag_cm_raccept, raccept@@RDMACM_1.0",
            ".symver stag_cm_rconnect, rconnect@@RDMACM_1.0",
            ".symver stag_cm_rshutdown, rshutdown@@RDMACM_1.0",
            ".symver stag_cm_rclose, rclose@@RDMACM_1.0",
            ".symver stag_cm_rrecv, rrecv@@RDMACM_1.0",
            ".symver stag_cm_rrecvfrom, rrecvfrom@@RDMACM_1.0",
            ".symver stag_cm_rrecvmsg, rrecvmsg@@RDMACM_1.0",
            ".symver stag_cm_rsend, rsend@@RDMACM_1.0",
            ".symver stag_cm_rsendto, rsendto@@RDMACM_1.0",
            ".symver stag_cm_rsendmsg, rsendmsg@@RDMACM_1.0",
            ".symver stag_cm_rread, rread@@RDMACM_1.0",
            ".symver stag_cm_rreadv, rreadv@@RDMACM_1.0",
            ".symver stag_cm_rwrite, rwrite@@RDMACM_1.0",
            ".symver stag_cm_rwritev, rwritev@@RDMACM_1.0",
            ".symver stag_cm_rpoll, rpoll@@RDMACM_1.0",
            ".symver stag_cm_rselect, rselect@@RDMACM_1.0",
            ".symver stag_cm_rgetpeername, rgetpeername@@RDMACM_1.0",
            ".symver stag_cm_rgetsockname, rgetsockname@@RDMACM_1.0",
            ".symver stag_cm_rsetsockopt, rsetsockopt@@RDMACM_1.0",
            ".symver stag_cm_rgetsockopt, rgetsockopt@@RDMACM_1.0",
            ".symver stag_cm_rfcntl, rfcntl@@RDMACM_1.0",
            ".symver stag_cm_riomap, riomap@@RDMACM_1.0",
            ".symver stag_cm_riounmap, riounmap@@RDMACM_1.0",
            ".symver stag_cm_riowrite, riowrite@@RDMACM_1.0",
            ".symver stag_cm_rdma_join_multicast_ex, rdma_join_multicast_ex@@RDMACM_1.1",
            ".symver stag_cm_rdma_establish, rdma_establish@@RDMACM_1.2",
            ".symver stag_cm_rdma_init_qp_attr, rdma_init_qp_attr@@RDMACM_1.2",
            ".symver stag_cm_rdma_get_remote_ece, rdma_get_remote_ece@@RDMACM_1.3",
            ".symver stag_cm_rdma_reject_ece, rdma_reject_ece@@RDMACM_1.3",
            ".symver stag_cm_rdma_set_local_ece, rdma_set_local_ece@@RDMACM_1.3",
        );
    };
}
pub(crate) use rdma_cm_table;

#[cfg(test)]
mod tests {
    /// Every `.symver` names a function of the map under the same
    /// version, and every map entry has its `.symver`.
    #[test]
    fn symver_and_map_agree() {
        let src = include_str!("ops.rs");
        let map = include_str!("cm/librdmacm.map");
        let mut from_src: Vec<(String, String)> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("\".symver stag_cm_"))
            .map(|l| {
                let (_, rest) = l.split_once(", ").unwrap();
                let rest = rest.trim_end_matches("\",");
                let (name, ver) = rest.split_once("@@").unwrap();
                (name.to_owned(), ver.to_owned())
            })
            .collect();
        let mut from_map = Vec::new();
        let mut ver = String::new();
        for l in map.lines() {
            let l = l.trim();
            if let Some(v) = l.strip_suffix('{').map(str::trim) {
                ver = v.to_owned();
            } else if l.ends_with(';') && !l.starts_with("local") && !l.starts_with('}') {
                if let Some(name) = l.strip_suffix(';').filter(|n| !n.contains(':')) {
                    from_map.push((name.trim().to_owned(), ver.clone()));
                }
            }
        }
        from_src.sort();
        from_map.sort();
        assert_eq!(from_src.len(), 68);
        assert_eq!(from_src, from_map);
    }
}
