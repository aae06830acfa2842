//! Protection domains and memory regions.
//!
//! A region is registered with the RNIC's table as it is: the application's
//! own memory, STag = lkey = rkey. `IBV_ACCESS_FLUSH_PERSISTENT` makes it a
//! durable region, whose Commit (`ibv_wr_flush`, `stagdv_post_commit`)
//! msyncs the range: register a shared file mapping for that.

use std::ffi::{c_int, c_void};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use provider::device::ProtectionDomain;
use provider::mem::Access;

use crate::errno::{self, guard};
use crate::ffi::*;
use crate::handle::{self, from_raw, Object};
use crate::users::{Use, Users};

/// `ibv_pd` first, then the RNIC's PD.
#[repr(C)]
pub(crate) struct StagPd {
    pd: ibv_pd,
    pub(crate) inner: ProtectionDomain,
    /// MRs, QPs and SRQs on this PD.
    pub(crate) users: Arc<Users>,
}

// SAFETY: repr(C), starts with its ibv_pd; alloc_pd makes every ibv_pd
// of a stag context.
unsafe impl Object for StagPd {
    type C = ibv_pd;
}

pub(crate) unsafe extern "C" fn alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    guard("alloc_pd", ptr::null_mut(), || {
        // SAFETY: libibverbs passes its context.
        let Some(st) = (unsafe { handle::context(ctx) }) else {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        };
        let inner = st.device.alloc_pd();
        let pd = Box::new(StagPd {
            pd: ibv_pd {
                context: ctx,
                handle: inner.id(),
            },
            inner,
            users: Users::new(),
        });
        Box::into_raw(pd).cast()
    })
}

pub(crate) unsafe extern "C" fn dealloc_pd(pd: *mut ibv_pd) -> c_int {
    guard("dealloc_pd", libc::EIO, || {
        // SAFETY: libibverbs passes the pd it got from alloc_pd.
        let Some(spd) = (unsafe { from_raw::<StagPd>(pd) }) else {
            return libc::EINVAL;
        };
        if spd.users.in_use() {
            return libc::EBUSY;
        }
        // SAFETY: ours (checked), freed once.
        drop(unsafe { Box::from_raw(pd.cast::<StagPd>()) });
        0
    })
}

/// `verbs_mr` first, then what deregistration needs.
#[repr(C)]
struct StagMr {
    vmr: verbs_mr,
    pd: ProtectionDomain,
    /// Keeps the PD from being deallocated while the MR lives.
    _on_pd: Use,
}

// SAFETY: repr(C), starts with its verbs_mr, whose first member is the
// ibv_mr; reg_mr makes every ibv_mr of a stag context.
unsafe impl Object for StagMr {
    type C = ibv_mr;
}

/// libibverbs access bits the RNIC understands; the rest (zero-based,
/// on-demand, hugetlb, relaxed ordering) change nothing here.
fn access_of(bits: c_int) -> Access {
    let mut a = Access::from_bits_truncate(bits as u32);
    // iWARP: a peer may invalidate a remotely reachable STag with Send with
    // Invalidate (RFC 5040 §6.10.1), as siw allows.
    if bits as u32 & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)
        != 0
    {
        a = a | Access::REMOTE_INVALIDATE;
    }
    a
}

pub(crate) unsafe extern "C" fn reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    hca_va: u64,
    access: c_int,
) -> *mut ibv_mr {
    guard("reg_mr", ptr::null_mut(), || {
        // SAFETY: libibverbs passes a pd of this context.
        let Some(StagPd { inner, users, .. }) = (unsafe { from_raw::<StagPd>(pd) }) else {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        };
        let Some(base) = NonNull::new(addr.cast::<u8>()) else {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        };
        // Remote write or atomic rights need local write (IB spec 10.6.3.1,
        // enforced by every rdma-core provider).
        let bits = access as u32;
        if bits & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0
            && bits & IBV_ACCESS_LOCAL_WRITE == 0
        {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        }
        let durable = bits & IBV_ACCESS_FLUSH_PERSISTENT_BIT != 0;
        let dev = inner.device();
        // SAFETY: the application keeps addr..addr+length mapped until it
        // deregisters (ibv_reg_mr's contract); the RNIC only touches it
        // through checked table lookups, never past the bounds registered.
        let stag = match unsafe {
            dev.mem().register(
                inner.id(),
                base,
                hca_va,
                length as u64,
                access_of(access),
                durable,
            )
        } {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("stag0: ibv_reg_mr refused: {e}");
                errno::set(libc::EINVAL);
                return ptr::null_mut();
            }
        };
        let mr = Box::new(StagMr {
            vmr: verbs_mr {
                ibv_mr: ibv_mr {
                    // SAFETY: pd is live.
                    context: unsafe { (*pd).context },
                    pd,
                    addr,
                    length,
                    handle: stag,
                    lkey: stag,
                    rkey: stag,
                },
                mr_type: STAG_MR_TYPE_MR,
                access,
            },
            pd: inner.clone(),
            _on_pd: users.hold(),
        });
        // SAFETY: vmr is the first member, ibv_mr the first of it.
        unsafe { ptr::addr_of_mut!((*Box::into_raw(mr)).vmr.ibv_mr) }
    })
}

pub(crate) unsafe extern "C" fn dereg_mr(vmr: *mut verbs_mr) -> c_int {
    guard("dereg_mr", libc::EIO, || {
        // SAFETY: libibverbs passes a verbs_mr, whose first member is its
        // ibv_mr.
        let Some(mr) = (unsafe { from_raw::<StagMr>(vmr.cast::<ibv_mr>()) }) else {
            return libc::EINVAL;
        };
        if let Err(e) = mr.pd.dereg_mr(mr.vmr.ibv_mr.lkey) {
            tracing::warn!("stag0: ibv_dereg_mr: {e}");
            return libc::EINVAL;
        }
        // SAFETY: ours, freed once.
        drop(unsafe { Box::from_raw(vmr.cast::<StagMr>()) });
        0
    })
}

/// `IBV_ACCESS_FLUSH_PERSISTENT` (rdma-core ≥ 45; the value is the
/// kernel's, the same whatever headers this is built against).
const IBV_ACCESS_FLUSH_PERSISTENT_BIT: u32 = 1 << 9;
