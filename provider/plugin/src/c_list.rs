//! The two list shapes verbs hands a provider: SGE arrays and WR chains.

use std::ffi::c_int;

use provider::wr::Sge;
use smallvec::SmallVec;

use crate::ffi::{ibv_recv_wr, ibv_send_wr, ibv_sge};
use provider::identity::LIMITS;

/// A WR's SGEs, on the stack for the usual few: a post of one WR
/// allocates nothing for them.
pub(crate) type SgeList = SmallVec<[Sge; 4]>;

/// Copy a C SGE array (`n` entries, at most the device's `max_sge`).
///
/// # Safety
/// `list` must point to `n` readable `ibv_sge`s when `n > 0`.
pub(crate) unsafe fn sge_list(list: *const ibv_sge, n: c_int) -> Result<SgeList, c_int> {
    if !(0..=(LIMITS.max_sge as i32)).contains(&n) || (n > 0 && list.is_null()) {
        return Err(libc::EINVAL);
    }
    if n == 0 {
        return Ok(SgeList::new());
    }
    // Read each entry unaligned: C callers may keep the array inside a
    // packed struct (libiscsi's iSER initiator does), which x86 C reads
    // fine and a Rust slice may not be made over.
    Ok((0..n as usize)
        .map(|i| {
            // SAFETY: entry `i` of `n` readable ones (forwarded contract);
            // read_unaligned has no alignment requirement.
            let g = unsafe { list.add(i).read_unaligned() };
            Sge {
                addr: g.addr,
                length: g.length,
                lkey: g.lkey,
            }
        })
        .collect())
}

/// A WR that links to the next one.
pub(crate) trait Chained {
    fn next(&self) -> *mut Self;
}

impl Chained for ibv_send_wr {
    fn next(&self) -> *mut Self {
        self.next
    }
}

impl Chained for ibv_recv_wr {
    fn next(&self) -> *mut Self {
        self.next
    }
}

/// Post a WR chain one by one; at the first failure `*bad` names that WR
/// (verbs' contract: the ones before it were posted) and its errno is
/// returned.
///
/// # Safety
/// `first` must be NULL or a valid chain; `bad` NULL or writable.
pub(crate) unsafe fn post_chain<W: Chained>(
    first: *mut W,
    bad: *mut *mut W,
    mut post: impl FnMut(&W) -> Result<(), c_int>,
) -> c_int {
    let mut cur = first;
    while !cur.is_null() {
        // SAFETY: the caller's chain.
        let w = unsafe { &*cur };
        if let Err(e) = post(w) {
            if !bad.is_null() {
                // SAFETY: the caller's out pointer.
                unsafe { *bad = cur };
            }
            return e;
        }
        cur = w.next();
    }
    0
}
