//! What a context answers about its device and port
//! (`ibv_query_device_ex`, `ibv_query_port`), from
//! [`provider::identity::LIMITS`].

use std::ffi::c_int;
use std::ptr;

use provider::identity::{self, LIMITS};

use crate::errno::guard;
use crate::ffi::*;
use crate::handle::is_stag_context;

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

pub(crate) unsafe extern "C" fn query_device_ex(
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
pub(crate) unsafe extern "C" fn query_port(
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
