//! Work requests and work completions, shaped after libibverbs'
//! `ibv_send_wr`, `ibv_recv_wr` and `ibv_wc` so that the provider maps onto
//! rdma-core's objects, with the RFC 7306 and Commit operations added.

/// A scatter/gather element: `length` bytes at `addr` inside the region
/// whose lkey is `lkey` (`struct ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Address as registered (the region's iova plus an offset).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// The lkey of the region.
    pub lkey: u32,
}

/// The parts of a message's octets `offset..offset + len` in its SGE list
/// `sg_list`, in order: each SGE they touch, the offset into it and how
/// many octets there. Ends with the list if the list is shorter; the
/// caller tells that from the lengths it was given.
pub(crate) fn sge_spans(
    sg_list: &[Sge],
    offset: u64,
    len: u64,
) -> impl Iterator<Item = (&Sge, u64, u64)> {
    let (mut skip, mut left) = (offset, len);
    sg_list
        .iter()
        .map_while(move |sge| {
            if left == 0 {
                return None;
            }
            let l = u64::from(sge.length);
            if skip >= l {
                skip -= l;
                return Some(None);
            }
            let (off, n) = (skip, (l - skip).min(left));
            skip = 0;
            left -= n;
            Some(Some((sge, off, n)))
        })
        .flatten()
}

/// Keep a finished WR's SGE list in `pool`, emptied, for a post by
/// reference to fill: while the pool holds fewer than `limit`, and only a
/// list of a usual size (some room allocated, and no more than for
/// `max_sge` SGEs, or 4 if that is more).
pub(crate) fn keep_sge_list(
    pool: &mut Vec<Vec<Sge>>,
    mut list: Vec<Sge>,
    max_sge: u32,
    limit: usize,
) {
    if list.capacity() != 0 && list.capacity() <= (max_sge as usize).max(4) && pool.len() < limit {
        list.clear();
        pool.push(list);
    }
}

/// A remote buffer: address and rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remote {
    /// Remote address (the TO on the wire).
    pub addr: u64,
    /// Remote STag.
    pub rkey: u32,
}

/// What a send work request does (`ibv_wr_opcode` plus the extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// `IBV_WR_SEND`: Send, Send with SE (`solicited`), Send with Invalidate
    /// and Send with SE and Invalidate (`invalidate`).
    Send {
        /// Ask the peer to raise a solicited event.
        solicited: bool,
        /// STag the peer invalidates on receipt (`IBV_WR_SEND_WITH_INV`).
        invalidate: Option<u32>,
    },
    /// `IBV_WR_RDMA_WRITE`.
    Write {
        /// Where the data goes.
        remote: Remote,
    },
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`: an RDMA Write followed by Immediate
    /// Data carrying 8 bytes (RFC 7306 §6).
    WriteImm {
        /// Where the data goes.
        remote: Remote,
        /// The 8-byte Immediate Data.
        imm: u64,
    },
    /// `IBV_WR_RDMA_READ`: the local SGEs receive the data.
    Read {
        /// Where the data comes from.
        remote: Remote,
    },
    /// RFC 7306 Immediate Data (with SE when `solicited`): 8 bytes that
    /// consume a receive buffer at the peer.
    Imm {
        /// The 8-byte Immediate Data.
        imm: u64,
        /// Immediate Data with Solicited Event.
        solicited: bool,
    },
    /// RFC 7306 masked FetchAdd (`mask` 0 = plain 64-bit add). The original
    /// value lands in the first SGE (8 bytes).
    FetchAdd {
        /// The 8-byte aligned target.
        remote: Remote,
        /// Add Data.
        add: u64,
        /// Add Mask.
        mask: u64,
    },
    /// RFC 7306 masked CmpSwap (masks all ones = plain CmpSwap).
    CmpSwap {
        /// The 8-byte aligned target.
        remote: Remote,
        /// Compare Data.
        compare: u64,
        /// Compare Mask.
        compare_mask: u64,
        /// Swap Data.
        swap: u64,
        /// Swap Mask.
        swap_mask: u64,
    },
    /// Swap (draft-ietf-storm-rdmap-ext-03 §5.1.2, AOpCode 1): write `swap`
    /// and return the original. The draft gives Swap no mask.
    Swap {
        /// The 8-byte aligned target.
        remote: Remote,
        /// Swap Data.
        swap: u64,
    },
    /// RDMA Commit (draft-talpey-rdma-commit): make `len` bytes at `remote`
    /// durable at the responder; completes with the responder's status.
    Commit {
        /// Start of the range.
        remote: Remote,
        /// Length of the range.
        len: u32,
    },
    /// 64-bit Atomic Write (`IBV_WR_ATOMIC_WRITE`; the commit draft's "log
    /// update" after a Commit): store `value` at the 8-byte aligned
    /// `remote` as one atomic operation. iWARP has no opcode for it, so
    /// the provider sends draft-03's Swap and drops the original value.
    /// No local SGE.
    AtomicWrite {
        /// The 8-byte aligned target.
        remote: Remote,
        /// The value stored.
        value: u64,
    },
}

/// One constructor per operation, so that a plain atomic and its masked
/// form cannot be confused (a plain FetchAdd has a zero Add Mask, a plain
/// CmpSwap all-ones masks).
impl SendOp {
    /// Send.
    pub const fn send() -> SendOp {
        SendOp::Send {
            solicited: false,
            invalidate: None,
        }
    }
    /// Send with Solicited Event.
    pub const fn send_solicited() -> SendOp {
        SendOp::Send {
            solicited: true,
            invalidate: None,
        }
    }
    /// Send with Invalidate of the peer's `rkey`.
    pub const fn send_invalidate(rkey: u32) -> SendOp {
        SendOp::Send {
            solicited: false,
            invalidate: Some(rkey),
        }
    }
    /// RDMA Write.
    pub const fn write(remote: Remote) -> SendOp {
        SendOp::Write { remote }
    }
    /// RDMA Write with 8-byte Immediate Data.
    pub const fn write_imm(remote: Remote, imm: u64) -> SendOp {
        SendOp::WriteImm { remote, imm }
    }
    /// RDMA Read.
    pub const fn read(remote: Remote) -> SendOp {
        SendOp::Read { remote }
    }
    /// 8-byte Immediate Data.
    pub const fn imm(imm: u64) -> SendOp {
        SendOp::Imm {
            imm,
            solicited: false,
        }
    }
    /// 8-byte Immediate Data with Solicited Event.
    pub const fn imm_solicited(imm: u64) -> SendOp {
        SendOp::Imm {
            imm,
            solicited: true,
        }
    }
    /// 64-bit FetchAdd.
    pub const fn fetch_add(remote: Remote, add: u64) -> SendOp {
        SendOp::FetchAdd {
            remote,
            add,
            mask: 0,
        }
    }
    /// RFC 7306 masked FetchAdd.
    pub const fn masked_fetch_add(remote: Remote, add: u64, mask: u64) -> SendOp {
        SendOp::FetchAdd { remote, add, mask }
    }
    /// 64-bit CmpSwap.
    pub const fn cmp_swap(remote: Remote, compare: u64, swap: u64) -> SendOp {
        SendOp::CmpSwap {
            remote,
            compare,
            compare_mask: u64::MAX,
            swap,
            swap_mask: u64::MAX,
        }
    }
    /// RFC 7306 masked CmpSwap.
    pub const fn masked_cmp_swap(
        remote: Remote,
        compare: u64,
        compare_mask: u64,
        swap: u64,
        swap_mask: u64,
    ) -> SendOp {
        SendOp::CmpSwap {
            remote,
            compare,
            compare_mask,
            swap,
            swap_mask,
        }
    }
    /// Swap.
    pub const fn swap(remote: Remote, swap: u64) -> SendOp {
        SendOp::Swap { remote, swap }
    }
    /// RDMA Commit of `len` bytes at `remote`.
    pub const fn commit(remote: Remote, len: u32) -> SendOp {
        SendOp::Commit { remote, len }
    }
    /// 64-bit Atomic Write.
    pub const fn atomic_write(remote: Remote, value: u64) -> SendOp {
        SendOp::AtomicWrite { remote, value }
    }
}

impl SendOp {
    /// Whether the operation sends the bytes its local SGEs name (Send,
    /// Write, Write with Immediate): the operations whose payload may go
    /// inline (`IBV_SEND_INLINE`).
    pub fn sends_payload(&self) -> bool {
        matches!(
            self,
            SendOp::Send { .. } | SendOp::Write { .. } | SendOp::WriteImm { .. }
        )
    }

    /// Whether the operation consumes ORD credit (it waits for a response).
    pub fn needs_response(&self) -> bool {
        matches!(
            self,
            SendOp::Read { .. }
                | SendOp::FetchAdd { .. }
                | SendOp::CmpSwap { .. }
                | SendOp::Swap { .. }
                | SendOp::AtomicWrite { .. }
                | SendOp::Commit { .. }
        )
    }

    /// The opcode its completion reports.
    pub fn wc_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Send { .. } => WcOpcode::Send,
            SendOp::Write { .. } => WcOpcode::RdmaWrite,
            SendOp::WriteImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::Imm { .. } => WcOpcode::Imm,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
            SendOp::CmpSwap { .. } => WcOpcode::CmpSwap,
            SendOp::Swap { .. } => WcOpcode::Swap,
            SendOp::Commit { .. } => WcOpcode::Commit,
            SendOp::AtomicWrite { .. } => WcOpcode::AtomicWrite,
        }
    }
}

/// A send work request (`struct ibv_send_wr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Local buffers (gather for Send/Write, scatter for Read, the 8-byte
    /// result for atomics).
    pub sg_list: Vec<Sge>,
    /// `IBV_SEND_SIGNALED`: produce a completion on success.
    pub signaled: bool,
    /// `IBV_SEND_FENCE`: wait for earlier Reads/atomics to complete first.
    pub fence: bool,
}

impl SendWr {
    /// The octets its SGEs name, in all.
    pub fn total_len(&self) -> u64 {
        self.sg_list.iter().map(|s| u64::from(s.length)).sum()
    }

    /// The data sink a Read names: its first SGE (the responses are
    /// placed across all its SGEs by offset); a zero SGE if it has none.
    pub fn read_sink(&self) -> Sge {
        self.sg_list.first().copied().unwrap_or(Sge {
            addr: 0,
            length: 0,
            lkey: 0,
        })
    }
}

/// A send work request whose SGE list is borrowed: what a caller that
/// keeps its SGEs on the stack posts with
/// [`PostGuard::push`](crate::device::PostGuard::push),
/// so that posting allocates nothing (the QP copies the list into storage
/// it recycles from completed WRs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWrRef<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Local buffers, as in [`SendWr::sg_list`].
    pub sg_list: &'a [Sge],
    /// `IBV_SEND_SIGNALED`.
    pub signaled: bool,
    /// `IBV_SEND_FENCE`.
    pub fence: bool,
}

/// A Send or Write whose payload is given as bytes (`IBV_SEND_INLINE`):
/// [`PostGuard::push_inline`](crate::device::PostGuard::push_inline) copies
/// them into the QP before it returns, so no registration is needed and the
/// buffers may be reused at once. At most
/// [`MAX_INLINE`](crate::qp::MAX_INLINE) octets in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InlineWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The operation: a Send, Write or Write with Immediate.
    pub op: SendOp,
    /// The payload, gathered in order (a C caller's SGEs).
    pub data: &'a [&'a [u8]],
    /// `IBV_SEND_SIGNALED`.
    pub signaled: bool,
    /// `IBV_SEND_FENCE`.
    pub fence: bool,
}

/// One WR of a post list ([`PostGuard::push_list`]): framed from its
/// SGEs, or inline.
///
/// [`PostGuard::push_list`]: crate::device::PostGuard::push_list
#[derive(Debug, Clone, Copy)]
pub enum ListWr<'a> {
    /// Framed from registered memory.
    Send(SendWrRef<'a>),
    /// Copied into the QP now (`IBV_SEND_INLINE`).
    Inline(InlineWr<'a>),
}

impl ListWr<'_> {
    /// Its WR id and operation (what a flush completion reports).
    pub(crate) fn id_and_op(&self) -> (u64, SendOp) {
        match self {
            ListWr::Send(w) => (w.wr_id, w.op),
            ListWr::Inline(w) => (w.wr_id, w.op),
        }
    }
}

/// A receive work request (`struct ibv_recv_wr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where an incoming Send lands.
    pub sg_list: Vec<Sge>,
}

/// Completion status: every `enum ibv_wc_status`, with its discriminant,
/// so that `status as u32` is the C value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`.
    Success = 0,
    /// `IBV_WC_LOC_LEN_ERR`: the message did not fit the receive buffer.
    LocLenErr = 1,
    /// `IBV_WC_LOC_QP_OP_ERR`.
    LocQpOpErr = 2,
    /// `IBV_WC_LOC_EEC_OP_ERR`.
    LocEecOpErr = 3,
    /// `IBV_WC_LOC_PROT_ERR`: an SGE failed its lkey/PD/bounds check.
    LocProtErr = 4,
    /// `IBV_WC_WR_FLUSH_ERR`: the QP went to Error before this WR finished.
    WrFlushErr = 5,
    /// `IBV_WC_MW_BIND_ERR`.
    MwBindErr = 6,
    /// `IBV_WC_BAD_RESP_ERR`.
    BadRespErr = 7,
    /// `IBV_WC_LOC_ACCESS_ERR`.
    LocAccessErr = 8,
    /// `IBV_WC_REM_INV_REQ_ERR`: the peer found the request invalid.
    RemInvReqErr = 9,
    /// `IBV_WC_REM_ACCESS_ERR`: the peer refused the STag/bounds/rights.
    RemAccessErr = 10,
    /// `IBV_WC_REM_OP_ERR`: the peer failed the operation (also a failed Commit).
    RemOpErr = 11,
    /// `IBV_WC_RETRY_EXC_ERR`: on RoCE/IB, how a vanished peer shows.
    RetryExcErr = 12,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`.
    RnrRetryExcErr = 13,
    /// `IBV_WC_LOC_RDD_VIOL_ERR`.
    LocRddViolErr = 14,
    /// `IBV_WC_REM_INV_RD_REQ_ERR`.
    RemInvRdReqErr = 15,
    /// `IBV_WC_REM_ABORT_ERR`.
    RemAbortErr = 16,
    /// `IBV_WC_INV_EECN_ERR`.
    InvEecnErr = 17,
    /// `IBV_WC_INV_EEC_STATE_ERR`.
    InvEecStateErr = 18,
    /// `IBV_WC_FATAL_ERR`.
    FatalErr = 19,
    /// `IBV_WC_RESP_TIMEOUT_ERR`.
    RespTimeoutErr = 20,
    /// `IBV_WC_GENERAL_ERR`.
    GeneralErr = 21,
    /// `IBV_WC_TM_ERR`.
    TmErr = 22,
    /// `IBV_WC_TM_RNDV_INCOMPLETE`.
    TmRndvIncomplete = 23,
}

impl WcStatus {
    /// Every status, indexed by its discriminant.
    pub const ALL: [WcStatus; 24] = [
        WcStatus::Success,
        WcStatus::LocLenErr,
        WcStatus::LocQpOpErr,
        WcStatus::LocEecOpErr,
        WcStatus::LocProtErr,
        WcStatus::WrFlushErr,
        WcStatus::MwBindErr,
        WcStatus::BadRespErr,
        WcStatus::LocAccessErr,
        WcStatus::RemInvReqErr,
        WcStatus::RemAccessErr,
        WcStatus::RemOpErr,
        WcStatus::RetryExcErr,
        WcStatus::RnrRetryExcErr,
        WcStatus::LocRddViolErr,
        WcStatus::RemInvRdReqErr,
        WcStatus::RemAbortErr,
        WcStatus::InvEecnErr,
        WcStatus::InvEecStateErr,
        WcStatus::FatalErr,
        WcStatus::RespTimeoutErr,
        WcStatus::GeneralErr,
        WcStatus::TmErr,
        WcStatus::TmRndvIncomplete,
    ];

    /// The status of a raw `ibv_wc_status`; values beyond rdma-core's
    /// (a newer library) are `GeneralErr`.
    pub fn from_raw(raw: u32) -> WcStatus {
        Self::ALL
            .get(raw as usize)
            .copied()
            .unwrap_or(WcStatus::GeneralErr)
    }

    /// rdma-core's `ibv_wc_status_str` wording.
    pub fn as_str(self) -> &'static str {
        match self {
            WcStatus::Success => "success",
            WcStatus::LocLenErr => "local length error",
            WcStatus::LocQpOpErr => "local QP operation error",
            WcStatus::LocEecOpErr => "local EE context operation error",
            WcStatus::LocProtErr => "local protection error",
            WcStatus::WrFlushErr => "Work Request Flushed Error",
            WcStatus::MwBindErr => "memory management operation error",
            WcStatus::BadRespErr => "bad response error",
            WcStatus::LocAccessErr => "local access error",
            WcStatus::RemInvReqErr => "remote invalid request error",
            WcStatus::RemAccessErr => "remote access error",
            WcStatus::RemOpErr => "remote operation error",
            WcStatus::RetryExcErr => "transport retry counter exceeded",
            WcStatus::RnrRetryExcErr => "RNR retry counter exceeded",
            WcStatus::LocRddViolErr => "local RDD violation error",
            WcStatus::RemInvRdReqErr => "remote invalid RD request",
            WcStatus::RemAbortErr => "aborted error",
            WcStatus::InvEecnErr => "invalid EE context number",
            WcStatus::InvEecStateErr => "invalid EE context state",
            WcStatus::FatalErr => "fatal error",
            WcStatus::RespTimeoutErr => "response timeout error",
            WcStatus::GeneralErr => "general error",
            WcStatus::TmErr => "TM error",
            WcStatus::TmRndvIncomplete => "TM software rendezvous",
        }
    }
}

/// What completed (`enum ibv_wc_opcode` plus the extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// `IBV_WC_SEND`.
    Send,
    /// `IBV_WC_RDMA_WRITE` (also Write with Immediate at the requester).
    RdmaWrite,
    /// `IBV_WC_RDMA_READ`.
    RdmaRead,
    /// `IBV_WC_COMP_SWAP`.
    CmpSwap,
    /// `IBV_WC_FETCH_ADD`.
    FetchAdd,
    /// Swap (draft-03).
    Swap,
    /// RDMA Commit.
    Commit,
    /// Atomic Write (`IBV_WC_ATOMIC_WRITE`).
    AtomicWrite,
    /// Immediate Data sent.
    Imm,
    /// `IBV_WC_RECV`: a Send (or Immediate Data) arrived.
    Recv,
    /// Immediate Data arrived (RFC 7306 §6), alone or after an RDMA Write
    /// (Write with Immediate; the wire does not tell them apart). libibverbs
    /// reports the latter as `IBV_WC_RECV_RDMA_WITH_IMM`.
    RecvImm,
}

/// A work completion (`struct ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The WR's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Bytes received (receive side) or transferred.
    pub byte_len: u32,
    /// Immediate Data, when the message carried it.
    pub imm: Option<u64>,
    /// The STag the peer invalidated (`IBV_WC_WITH_INV`).
    pub invalidated_rkey: Option<u32>,
    /// The QP it belongs to.
    pub qp_num: u32,
    /// Provider detail: the Commit status, or the Terminate cause
    /// `(layer << 16 | etype << 8 | ecode)` that failed the WR.
    pub vendor_err: u32,
    /// The message asked for a solicited event.
    pub solicited: bool,
}

impl WorkCompletion {
    /// A placeholder to fill poll buffers with; its status is an error so
    /// that a slot no poll filled never reads as a success.
    pub const BLANK: WorkCompletion = WorkCompletion {
        wr_id: 0,
        status: WcStatus::GeneralErr,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        invalidated_rkey: None,
        qp_num: 0,
        vendor_err: 0,
        solicited: false,
    };
}

#[cfg(test)]
mod span_tests {
    use super::*;

    fn sge(length: u32) -> Sge {
        Sge {
            addr: 0x1000 * u64::from(length),
            length,
            lkey: length,
        }
    }

    fn spans(list: &[Sge], offset: u64, len: u64) -> Vec<(u32, u64, u64)> {
        sge_spans(list, offset, len)
            .map(|(s, off, n)| (s.lkey, off, n))
            .collect()
    }

    /// A span skips the SGEs before its offset, starts part-way into one,
    /// crosses into the next, and stops where its length ends; past the
    /// list's end it simply ends (the octets it lacks are the caller's
    /// to notice).
    #[test]
    fn a_span_walks_the_sges_it_covers_and_no_others() {
        let list = [sge(4), sge(8), sge(16)];
        assert_eq!(spans(&list, 0, 28), [(4, 0, 4), (8, 0, 8), (16, 0, 16)]);
        assert_eq!(spans(&list, 6, 10), [(8, 2, 6), (16, 0, 4)]);
        assert_eq!(spans(&list, 4, 8), [(8, 0, 8)]);
        assert_eq!(spans(&list, 12, 0), []);
        assert_eq!(spans(&list, 20, 100), [(16, 8, 8)]);
        assert_eq!(spans(&list, 28, 1), []);
        let with_empty = [sge(4), sge(0), sge(8)];
        assert_eq!(spans(&with_empty, 2, 6), [(4, 2, 2), (8, 0, 4)]);
    }
}
