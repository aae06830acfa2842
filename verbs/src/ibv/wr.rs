//! Work requests as libibverbs takes them: `struct ibv_sge`, the send
//! operations and flags, `send_ops_flags`, and the `ibv_send_wr` /
//! `ibv_recv_wr` chains the legacy post verbs read.

use super::mr::MemoryRegion;
use super::{IbvError, Result};
use rdma_sys_ext as ffi;
use std::ops::BitOr;

/// `struct ibv_sge`: a raw local address range in a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// `lkey` of the region containing the range.
    pub lkey: u32,
}

impl Sge {
    /// `[mr.addr + offset, + len)`, or `None` if that leaves the region.
    pub fn from_mr(mr: &MemoryRegion, offset: usize, len: u32) -> Option<Sge> {
        let end = offset.checked_add(len as usize)?;
        (end <= mr.len()).then(|| Sge {
            addr: mr.addr() + offset as u64,
            length: len,
            lkey: mr.lkey(),
        })
    }

    pub(super) fn raw(&self) -> ffi::ibv_sge {
        ffi::ibv_sge {
            addr: self.addr,
            length: self.length,
            lkey: self.lkey,
        }
    }
}

/// A send-queue operation (`enum ibv_wr_opcode`). Immediate data is given
/// in host order and sent in network order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// `IBV_WR_SEND`
    Send,
    /// `IBV_WR_SEND_WITH_INV`: the responder invalidates `invalidate_rkey`
    /// before the receive completes.
    SendWithInv {
        /// The peer's STag to invalidate.
        invalidate_rkey: u32,
    },
    /// `IBV_WR_SEND_WITH_IMM`
    SendWithImm {
        /// Immediate data (host order).
        imm: u32,
    },
    /// `IBV_WR_RDMA_WRITE`
    RdmaWrite {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        remote_addr: u64,
    },
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`
    RdmaWriteWithImm {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        remote_addr: u64,
        /// Immediate data (host order).
        imm: u32,
    },
    /// `IBV_WR_RDMA_READ`
    RdmaRead {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        remote_addr: u64,
    },
    /// `IBV_WR_ATOMIC_FETCH_AND_ADD` (one 8-byte SGE receives the old value)
    FetchAdd {
        /// Remote key.
        rkey: u32,
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Addend.
        add: u64,
    },
    /// `IBV_WR_ATOMIC_CMP_AND_SWP` (one 8-byte SGE receives the old value)
    CmpSwap {
        /// Remote key.
        rkey: u32,
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Compare value.
        compare: u64,
        /// Swap value.
        swap: u64,
    },
}

impl SendOp {
    pub(super) fn is_atomic(&self) -> bool {
        matches!(self, SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. })
    }

    fn remote_addr(&self) -> Option<u64> {
        match *self {
            SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => None,
            SendOp::RdmaWrite { remote_addr, .. }
            | SendOp::RdmaWriteWithImm { remote_addr, .. }
            | SendOp::RdmaRead { remote_addr, .. }
            | SendOp::FetchAdd { remote_addr, .. }
            | SendOp::CmpSwap { remote_addr, .. } => Some(remote_addr),
        }
    }

    pub(super) fn required_op(&self) -> SendOps {
        match self {
            SendOp::Send => SendOps::SEND,
            SendOp::SendWithImm { .. } => SendOps::SEND_WITH_IMM,
            SendOp::SendWithInv { .. } => SendOps::SEND_WITH_INV,
            SendOp::RdmaWrite { .. } => SendOps::RDMA_WRITE,
            SendOp::RdmaWriteWithImm { .. } => SendOps::RDMA_WRITE_WITH_IMM,
            SendOp::RdmaRead { .. } => SendOps::RDMA_READ,
            SendOp::FetchAdd { .. } => SendOps::ATOMIC_FETCH_AND_ADD,
            SendOp::CmpSwap { .. } => SendOps::ATOMIC_CMP_AND_SWP,
        }
    }
}

/// `enum ibv_send_flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(pub u32);

impl SendFlags {
    /// No flags.
    pub const EMPTY: Self = SendFlags(0);
    /// `IBV_SEND_FENCE`
    pub const FENCE: Self = SendFlags(ffi::IBV_SEND_FENCE);
    /// `IBV_SEND_SIGNALED`
    pub const SIGNALED: Self = SendFlags(ffi::IBV_SEND_SIGNALED);
    /// `IBV_SEND_SOLICITED`
    pub const SOLICITED: Self = SendFlags(ffi::IBV_SEND_SOLICITED);
    /// `IBV_SEND_INLINE`: the provider copies the SGE data at post time.
    pub const INLINE: Self = SendFlags(ffi::IBV_SEND_INLINE);
}

impl BitOr for SendFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        SendFlags(self.0 | rhs.0)
    }
}

/// `enum ibv_qp_create_send_ops_flags` (`IBV_QP_EX_WITH_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendOps(pub u64);

impl SendOps {
    /// `IBV_QP_EX_WITH_RDMA_WRITE`
    pub const RDMA_WRITE: Self = SendOps(ffi::IBV_QP_EX_WITH_RDMA_WRITE as u64);
    /// `IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM`
    pub const RDMA_WRITE_WITH_IMM: Self = SendOps(ffi::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM as u64);
    /// `IBV_QP_EX_WITH_SEND`
    pub const SEND: Self = SendOps(ffi::IBV_QP_EX_WITH_SEND as u64);
    /// `IBV_QP_EX_WITH_SEND_WITH_IMM`
    pub const SEND_WITH_IMM: Self = SendOps(ffi::IBV_QP_EX_WITH_SEND_WITH_IMM as u64);
    /// `IBV_QP_EX_WITH_SEND_WITH_INV`
    pub const SEND_WITH_INV: Self = SendOps(ffi::IBV_QP_EX_WITH_SEND_WITH_INV as u64);
    /// `IBV_QP_EX_WITH_RDMA_READ`
    pub const RDMA_READ: Self = SendOps(ffi::IBV_QP_EX_WITH_RDMA_READ as u64);
    /// `IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP`
    pub const ATOMIC_CMP_AND_SWP: Self = SendOps(ffi::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP as u64);
    /// `IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD`
    pub const ATOMIC_FETCH_AND_ADD: Self = SendOps(ffi::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD as u64);
    /// `IBV_QP_EX_WITH_FLUSH` (needs [`super::HAS_WR_FLUSH`])
    pub const FLUSH: Self = SendOps(ffi::IBV_QP_EX_WITH_FLUSH as u64);
    /// `IBV_QP_EX_WITH_ATOMIC_WRITE` (needs [`super::HAS_WR_ATOMIC_WRITE`])
    pub const ATOMIC_WRITE: Self = SendOps(ffi::IBV_QP_EX_WITH_ATOMIC_WRITE as u64);
    /// Send, send-with-imm, write, write-with-imm, read.
    pub const BASIC: Self = SendOps(
        Self::SEND.0
            | Self::SEND_WITH_IMM.0
            | Self::RDMA_WRITE.0
            | Self::RDMA_WRITE_WITH_IMM.0
            | Self::RDMA_READ.0,
    );
    /// [`SendOps::BASIC`] plus fetch-add and compare-swap.
    pub const BASIC_ATOMICS: Self =
        SendOps(Self::BASIC.0 | Self::ATOMIC_CMP_AND_SWP.0 | Self::ATOMIC_FETCH_AND_ADD.0);

    /// No flag set (the QP has no `ibv_wr_*` API).
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether every bit of `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for SendOps {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        SendOps(self.0 | rhs.0)
    }
}

/// `enum ibv_placement_type`: what a flush guarantees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushType {
    /// `IBV_FLUSH_GLOBAL`: globally visible.
    Global,
    /// `IBV_FLUSH_PERSISTENT`: persistent.
    Persistent,
}

/// `enum ibv_selectivity_level`: what a flush covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushLevel {
    /// `IBV_FLUSH_RANGE`: the given range.
    Range,
    /// `IBV_FLUSH_MR`: the whole region.
    Mr,
}

/// One send work request for the legacy [`super::QueuePair::post_send`].
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Operation.
    pub op: SendOp,
    /// Local data (source for send/write, destination for read/atomics).
    pub sges: &'a [Sge],
    /// `send_flags`.
    pub flags: SendFlags,
}

/// One receive work request.
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Destination ranges.
    pub sges: &'a [Sge],
}

pub(super) fn validate_send(wr: &SendWr<'_>) -> Result<()> {
    if wr.op.is_atomic() {
        let ok_sge = wr.sges.len() == 1 && wr.sges[0].length == 8;
        let ok_addr = wr.op.remote_addr().is_some_and(|a| a & 7 == 0);
        if !ok_sge || !ok_addr || wr.flags.0 & ffi::IBV_SEND_INLINE != 0 {
            return Err(IbvError::invalid("ibv_post_send"));
        }
    }
    if matches!(wr.op, SendOp::RdmaRead { .. }) && wr.flags.0 & ffi::IBV_SEND_INLINE != 0 {
        return Err(IbvError::invalid("ibv_post_send"));
    }
    if i32::try_from(wr.sges.len()).is_err() {
        return Err(IbvError::invalid("ibv_post_send"));
    }
    Ok(())
}

pub(super) fn raw_send_wr(
    wr: &SendWr<'_>,
    sg_list: *mut ffi::ibv_sge,
    n: usize,
) -> ffi::ibv_send_wr {
    let mut r = ffi::ibv_send_wr {
        wr_id: wr.wr_id,
        sg_list,
        num_sge: n as i32,
        send_flags: wr.flags.0,
        ..Default::default()
    };
    match wr.op {
        SendOp::Send => r.opcode = ffi::IBV_WR_SEND,
        SendOp::SendWithInv { invalidate_rkey } => {
            r.opcode = ffi::IBV_WR_SEND_WITH_INV;
            r.__bindgen_anon_1.invalidate_rkey = invalidate_rkey;
            // libsiw takes the STag to invalidate from `wr.rdma.rkey`, not
            // from `invalidate_rkey` (its SQE has one rkey field for both);
            // a Send ignores `wr.rdma` on every other provider.
            r.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: 0,
                rkey: invalidate_rkey,
            };
        }
        SendOp::SendWithImm { imm } => {
            r.opcode = ffi::IBV_WR_SEND_WITH_IMM;
            r.__bindgen_anon_1.imm_data = imm.to_be();
        }
        SendOp::RdmaWrite { rkey, remote_addr } => {
            r.opcode = ffi::IBV_WR_RDMA_WRITE;
            r.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        }
        SendOp::RdmaWriteWithImm {
            rkey,
            remote_addr,
            imm,
        } => {
            r.opcode = ffi::IBV_WR_RDMA_WRITE_WITH_IMM;
            r.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
            r.__bindgen_anon_1.imm_data = imm.to_be();
        }
        SendOp::RdmaRead { rkey, remote_addr } => {
            r.opcode = ffi::IBV_WR_RDMA_READ;
            r.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        }
        SendOp::FetchAdd {
            rkey,
            remote_addr,
            add,
        } => {
            r.opcode = ffi::IBV_WR_ATOMIC_FETCH_AND_ADD;
            r.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                remote_addr,
                compare_add: add,
                swap: 0,
                rkey,
            };
        }
        SendOp::CmpSwap {
            rkey,
            remote_addr,
            compare,
            swap,
        } => {
            r.opcode = ffi::IBV_WR_ATOMIC_CMP_AND_SWP;
            r.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                remote_addr,
                compare_add: compare,
                swap,
                rkey,
            };
        }
    }
    r
}

/// Build the `ibv_recv_wr` chain for `wrs` and hand it to `post` (a QP's
/// or an SRQ's post verb); on failure, the error and the index of the
/// first request not posted.
///
/// # Safety
/// As for the verb `post` calls: every SGE names writable memory of a live
/// region that stays valid until its WR completes.
pub(crate) unsafe fn post_recv_chain(
    call: &'static str,
    wrs: &[RecvWr<'_>],
    post: impl FnOnce(*mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> i32,
) -> Result<(), (IbvError, usize)> {
    if wrs.is_empty() {
        return Ok(());
    }
    let mut sges: Vec<ffi::ibv_sge> = wrs
        .iter()
        .flat_map(|w| w.sges.iter().map(Sge::raw))
        .collect();
    let mut raw: Vec<ffi::ibv_recv_wr> = Vec::with_capacity(wrs.len());
    let mut off = 0;
    for (i, wr) in wrs.iter().enumerate() {
        let n = wr.sges.len();
        let num_sge = i32::try_from(n).map_err(|_| (IbvError::invalid(call), i))?;
        let sg_list = if n == 0 {
            std::ptr::null_mut()
        } else {
            sges[off..].as_mut_ptr()
        };
        off += n;
        raw.push(ffi::ibv_recv_wr {
            wr_id: wr.wr_id,
            next: std::ptr::null_mut(),
            sg_list,
            num_sge,
        });
    }
    let base = raw.as_mut_ptr();
    for i in 0..raw.len().saturating_sub(1) {
        // SAFETY: i + 1 < len; pointers into the same live Vec.
        raw[i].next = unsafe { base.add(i + 1) };
    }
    let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
    let ret = post(base, &mut bad);
    if ret == 0 {
        return Ok(());
    }
    let idx = if bad.is_null() {
        0
    } else {
        // SAFETY: bad points into `raw` per the post verbs' contract.
        usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
    };
    Err((IbvError::new(call, ret), idx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_ops_values() {
        assert_eq!(SendOps::RDMA_WRITE.0, 1);
        assert_eq!(SendOps::ATOMIC_FETCH_AND_ADD.0, 1 << 6);
        assert_eq!(SendOps::FLUSH.0, 1 << 11);
        assert_eq!(SendOps::ATOMIC_WRITE.0, 1 << 12);
        assert!(SendOps::BASIC_ATOMICS.contains(SendOps::BASIC));
        assert!(!SendOps::BASIC.contains(SendOps::ATOMIC_CMP_AND_SWP));
    }

    #[test]
    fn atomic_wr_validation() {
        let sge8 = [Sge {
            addr: 0x1000,
            length: 8,
            lkey: 1,
        }];
        let sge4 = [Sge {
            addr: 0x1000,
            length: 4,
            lkey: 1,
        }];
        let fa = |addr, sges| SendWr {
            wr_id: 1,
            op: SendOp::FetchAdd {
                rkey: 2,
                remote_addr: addr,
                add: 1,
            },
            sges,
            flags: SendFlags::SIGNALED,
        };
        assert!(validate_send(&fa(0x2000, &sge8)).is_ok());
        assert_eq!(
            validate_send(&fa(0x2004, &sge8)).unwrap_err().errno,
            libc::EINVAL
        );
        assert_eq!(
            validate_send(&fa(0x2000, &sge4)).unwrap_err().errno,
            libc::EINVAL
        );
        assert_eq!(
            validate_send(&fa(0x2000, &[])).unwrap_err().errno,
            libc::EINVAL
        );
        let rd = SendWr {
            wr_id: 1,
            op: SendOp::RdmaRead {
                rkey: 2,
                remote_addr: 0,
            },
            sges: &sge4,
            flags: SendFlags::INLINE,
        };
        assert!(validate_send(&rd).is_err());
    }

    #[test]
    fn raw_send_wr_encoding() {
        let sge = [Sge {
            addr: 0x1000,
            length: 8,
            lkey: 1,
        }];
        let wr = SendWr {
            wr_id: 9,
            op: SendOp::CmpSwap {
                rkey: 5,
                remote_addr: 0x2000,
                compare: 3,
                swap: 4,
            },
            sges: &sge,
            flags: SendFlags::SIGNALED | SendFlags::FENCE,
        };
        let r = raw_send_wr(&wr, std::ptr::null_mut(), 1);
        assert_eq!(r.opcode, ffi::IBV_WR_ATOMIC_CMP_AND_SWP);
        assert_eq!(r.send_flags, ffi::IBV_SEND_SIGNALED | ffi::IBV_SEND_FENCE);
        // SAFETY: the atomic member was just written.
        let a = unsafe { r.wr.atomic };
        assert_eq!(
            (a.remote_addr, a.compare_add, a.swap, a.rkey),
            (0x2000, 3, 4, 5)
        );
        let wr = SendWr {
            op: SendOp::SendWithImm { imm: 0x0102_0304 },
            ..wr
        };
        let r = raw_send_wr(&wr, std::ptr::null_mut(), 1);
        assert_eq!(r.opcode, ffi::IBV_WR_SEND_WITH_IMM);
        // SAFETY: imm_data was just written.
        let imm = unsafe { r.__bindgen_anon_1.imm_data };
        assert_eq!(imm, 0x0102_0304u32.to_be());
    }
}
