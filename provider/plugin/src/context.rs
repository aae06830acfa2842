//! The device context (`ibv_open_device`) and the queries on it.
//!
//! libibverbs allocates the context through `_verbs_init_and_alloc_context`
//! (it must own the `verbs_context` part); the plugin's state hangs off it.
//! All contexts in a process share one userspace RNIC, so registrations,
//! QPs and the progress engine are per process, as with a kernel device.

use std::ffi::c_int;
use std::os::fd::{FromRawFd, OwnedFd};
use std::ptr;
use std::sync::{Arc, OnceLock};

use provider::device::Device;
use provider::identity::{self, LIMITS};

use crate::async_events::AsyncEvents;
use crate::errno::{self, guard};
use crate::ffi::*;

/// The plugin's context: libibverbs' `verbs_context` first, then ours.
#[repr(C)]
pub(crate) struct StagContext {
    vctx: verbs_context,
    state: *mut ContextState,
}

/// What a context holds besides libibverbs' part.
pub(crate) struct ContextState {
    /// The process's userspace RNIC.
    pub(crate) device: Device,
    /// The async event queue (`context->async_fd` is its application
    /// end). Held by the objects that post events, so that `async_fd`
    /// never reads as EOF (readable forever to a poller) while they live.
    pub(crate) async_events: Arc<AsyncEvents>,
    /// Posts IBV_EVENT_DEVICE_FATAL if the RNIC breaks
    /// ([`provider::fatal`]); registered while the context lives.
    _fatal: Arc<provider::fatal::FatalHook>,
}

/// The process's RNIC, started by the first `ibv_open_device`.
///
/// Its engine and connection threads live in the process that started it:
/// a child made by `fork()` has none of them, so there stag0 does not open
/// (`ENODEV`); a child that wants RDMA execs first.
pub(crate) fn device() -> Result<Device, provider::device::DeviceError> {
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

/// Whether `ctx` is a context of stag's device.
pub(crate) fn is_stag_context(ctx: *const ibv_context) -> bool {
    // SAFETY: a non-NULL ibv_context from libibverbs has a valid device.
    !ctx.is_null() && crate::driver::is_stag_device(unsafe { (*ctx).device })
}

/// The plugin state of one of our contexts.
///
/// # Safety
/// `ctx` must be NULL or a live `ibv_context` from libibverbs.
pub(crate) unsafe fn state<'a>(ctx: *const ibv_context) -> Option<&'a ContextState> {
    if !is_stag_context(ctx) {
        return None;
    }
    let off =
        std::mem::offset_of!(StagContext, vctx) + std::mem::offset_of!(verbs_context, context);
    // SAFETY: our contexts are StagContexts (alloc_context), and `context`
    // sits `off` bytes in; `state` is set before libibverbs sees it.
    unsafe {
        let sc = ctx.cast::<u8>().sub(off).cast::<StagContext>();
        (*sc).state.as_ref()
    }
}

pub(crate) unsafe extern "C" fn alloc_context(
    ibdev: *mut ibv_device,
    cmd_fd: c_int,
    _private: *mut std::ffi::c_void,
) -> *mut verbs_context {
    guard("alloc_context", ptr::null_mut(), || {
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
            verbs_set_ops(&mut (*sc).vctx, &OPS.0);
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
        if !is_stag_context(ctx) {
            return;
        }
        let off =
            std::mem::offset_of!(StagContext, vctx) + std::mem::offset_of!(verbs_context, context);
        // SAFETY: one of our contexts (checked); libibverbs calls this once.
        unsafe {
            let sc = ctx.cast::<u8>().sub(off).cast::<StagContext>();
            drop(Box::from_raw((*sc).state));
            verbs_uninit_context(&mut (*sc).vctx);
            libc::free(sc.cast());
        }
    })
}

/// Device capability bits (kernel uapi values, as `device_cap_flags_ex`
/// carries them) for FLUSH and Atomic Write.
const DEVICE_FLUSH_GLOBAL: u64 = 1 << 38;
const DEVICE_FLUSH_PERSISTENT: u64 = 1 << 39;
const DEVICE_ATOMIC_WRITE: u64 = 1 << 40;

fn fill_device_attr(a: &mut ibv_device_attr) {
    let fw = b"stag 0.1.0\0";
    for (d, s) in a.fw_ver.iter_mut().zip(fw.iter()) {
        *d = *s as _;
    }
    a.node_guid = identity::NODE_GUID.to_be();
    a.sys_image_guid = identity::NODE_GUID.to_be();
    a.max_mr_size = u64::MAX;
    a.page_size_cap = 4096;
    a.vendor_id = identity::VENDOR_ID;
    a.vendor_part_id = identity::VENDOR_PART_ID;
    a.hw_ver = 1;
    a.max_qp = LIMITS.max_qp as i32;
    a.max_qp_wr = LIMITS.max_qp_wr as i32;
    a.device_cap_flags =
        IBV_DEVICE_MEM_MGT_EXTENSIONS | IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_CHANGE_PHY_PORT;
    a.max_sge = LIMITS.max_sge as i32;
    a.max_sge_rd = LIMITS.max_sge as i32;
    a.max_cq = LIMITS.max_cq as i32;
    a.max_cqe = LIMITS.max_cqe as i32;
    a.max_mr = LIMITS.max_mr as i32;
    a.max_pd = LIMITS.max_pd as i32;
    a.max_qp_rd_atom = LIMITS.max_rd_atom as i32;
    a.max_ee_rd_atom = 0;
    a.max_res_rd_atom = (LIMITS.max_rd_atom as i32) * (LIMITS.max_qp as i32);
    a.max_qp_init_rd_atom = LIMITS.max_rd_atom as i32;
    a.max_ee_init_rd_atom = 0;
    // RFC 7306 atomics execute on the responder's RNIC (its engine), so
    // they are atomic with respect to every other stag0 atomic: HCA scope.
    a.atomic_cap = IBV_ATOMIC_HCA;
    a.max_srq = LIMITS.max_srq as i32;
    a.max_srq_wr = LIMITS.max_srq_wr as i32;
    a.max_srq_sge = LIMITS.max_sge as i32;
    a.max_pkeys = 1;
    a.local_ca_ack_delay = 0;
    a.phys_port_cnt = 1;
}

unsafe extern "C" fn query_device_ex(
    ctx: *mut ibv_context,
    _input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    guard("query_device_ex", libc::EIO, || {
        let orig = std::mem::size_of::<ibv_device_attr>();
        if !is_stag_context(ctx) || attr.is_null() || attr_size < orig {
            return libc::EINVAL;
        }
        // SAFETY: the caller provides attr_size writable bytes at attr.
        unsafe { ptr::write_bytes(attr.cast::<u8>(), 0, attr_size) };
        let mut a: ibv_device_attr = Default::default();
        fill_device_attr(&mut a);
        // SAFETY: orig_attr is the first member and fits (checked above).
        unsafe { ptr::write(attr.cast::<ibv_device_attr>(), a) };
        let caps_off = std::mem::offset_of!(ibv_device_attr_ex, device_cap_flags_ex);
        if attr_size >= caps_off + 8 {
            let caps = a.device_cap_flags as u64
                | DEVICE_FLUSH_GLOBAL
                | DEVICE_FLUSH_PERSISTENT
                | DEVICE_ATOMIC_WRITE;
            // SAFETY: inside attr_size (checked).
            unsafe { ptr::write_unaligned(attr.cast::<u8>().add(caps_off).cast::<u64>(), caps) };
        }
        0
    })
}

#[allow(clippy::needless_update)] // rdma-core ≥ 55 headers add members
unsafe extern "C" fn query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    guard("query_port", libc::EIO, || {
        if !is_stag_context(ctx) || attr.is_null() {
            return libc::EINVAL;
        }
        if port != 1 {
            return libc::EINVAL;
        }
        let a = ibv_port_attr {
            state: IBV_PORT_ACTIVE,
            max_mtu: IBV_MTU_4096,
            active_mtu: IBV_MTU_4096,
            gid_tbl_len: 1,
            port_cap_flags: 0,
            max_msg_sz: LIMITS.max_msg,
            bad_pkey_cntr: 0,
            qkey_viol_cntr: 0,
            pkey_tbl_len: 1,
            lid: 0,
            sm_lid: 0,
            lmc: 0,
            max_vl_num: 1,
            sm_sl: 0,
            subnet_timeout: 0,
            init_type_reply: 0,
            active_width: 1,
            active_speed: 32, // EDR-class: a loopback TCP stream's order of magnitude
            phys_state: 5,    // LinkUp
            link_layer: IBV_LINK_LAYER_ETHERNET as u8,
            flags: 0,
            port_cap_flags2: 0,
            ..Default::default()
        };
        // libibverbs hands us a buffer of *its* ibv_port_attr, which may
        // be older than the headers this was built with (rdma-core 55 added
        // active_speed_ex after port_cap_flags2): write only the members
        // every ABI-34 release has; libibverbs zeroed the rest.
        let len = std::mem::offset_of!(ibv_port_attr, port_cap_flags2) + 2;
        // SAFETY: the caller's buffer holds at least the ABI-34 members.
        unsafe {
            ptr::copy_nonoverlapping(
                (&a as *const ibv_port_attr).cast::<u8>(),
                attr.cast::<u8>(),
                len,
            )
        };
        0
    })
}

/// libibverbs' `ibv_get_cq_event` read an event of `cq` (without `stag
/// run`'s interposed one): counted for `destroy_cq`.
unsafe extern "C" fn cq_event(cq: *mut ibv_cq) {
    // SAFETY: libibverbs passes the CQ the record named, one of ours.
    unsafe { crate::cq::count_event(cq) }
}

/// The context's ops; NULL entries keep libibverbs' EOPNOTSUPP stubs.
#[repr(transparent)]
struct ContextOps(verbs_context_ops);

// SAFETY: immutable table of function pointers.
unsafe impl Sync for ContextOps {}

static OPS: ContextOps = ContextOps(verbs_context_ops {
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
    query_device_ex: Some(query_device_ex),
    query_port: Some(query_port),
    async_event: Some(crate::async_events::async_event),
    free_context: Some(free_context),
    ..ZERO_OPS
});

/// An ops table with every entry NULL.
// SAFETY: all-zero is a valid verbs_context_ops (every field is a nullable
// pointer).
const ZERO_OPS: verbs_context_ops = unsafe { std::mem::zeroed() };
