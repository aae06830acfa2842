//! A queue pair whose operations are futures.

use provider::wr::{Remote, SendOp};

use super::cq::{AsyncCompletionQueue, Op};
use super::OpError;
use crate::mr::Slice;
use crate::qp::{QueuePair, WorkRequest};

/// A [`QueuePair`] whose every operation returns an [`Op`] future.
///
/// Each call posts its work request at once, in call order (so several
/// `Op`s may be in flight, and their completions come in RC order: the
/// order they were posted, as on the blocking API); awaiting the `Op`
/// gives the typed completion. Send work completes on `cq`, receives on
/// `recv_cq` (the same CQ unless the connection was made with
/// `ConnectOptions::recv_cq`).
#[derive(Debug, Clone)]
pub struct AsyncQueuePair {
    qp: QueuePair,
    cq: AsyncCompletionQueue,
    recv_cq: AsyncCompletionQueue,
}

impl AsyncQueuePair {
    /// Wrap a connected QP whose send and receive completions go to `cq`.
    pub fn new(qp: QueuePair, cq: AsyncCompletionQueue) -> AsyncQueuePair {
        AsyncQueuePair {
            qp,
            recv_cq: cq.clone(),
            cq,
        }
    }

    /// Wrap a connected QP with its receive completions on another CQ.
    pub fn with_recv_cq(
        qp: QueuePair,
        cq: AsyncCompletionQueue,
        recv_cq: AsyncCompletionQueue,
    ) -> AsyncQueuePair {
        AsyncQueuePair { qp, cq, recv_cq }
    }

    /// The QP underneath (capabilities, counters, `set_error`).
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The send CQ.
    pub fn cq(&self) -> &AsyncCompletionQueue {
        &self.cq
    }

    /// Post any send work request (signaled, as every `Op` is).
    pub fn post(&self, op: SendOp, local: &[Slice]) -> Op {
        self.post_wr(op, local, |wr| wr)
    }

    /// Post with `shape` applied to the work request (`fenced`, `inlined`).
    pub fn post_wr(
        &self,
        op: SendOp,
        local: &[Slice],
        shape: impl FnOnce(WorkRequest<'_>) -> WorkRequest<'_>,
    ) -> Op {
        if let Some(op) = self.refuse(&self.cq) {
            return op;
        }
        let id = self.cq.register();
        let wr = shape(WorkRequest::new(id, op, local));
        let wr = WorkRequest {
            signaled: true,
            ..wr
        };
        match self.qp.post_send(wr) {
            Ok(()) => Op::posted(&self.cq, id, self.qp.clone()),
            Err(e) => {
                self.cq.unregister(id);
                Op::failed(&self.cq, e.into())
            }
        }
    }

    /// An `Op` that fails at once when this QP already completed work with
    /// an error (it is in Error): posting would flush at best, and on some
    /// devices (kernel siw) work posted to a QP in Error never completes.
    fn refuse(&self, on: &AsyncCompletionQueue) -> Option<Op> {
        let qp_num = self.qp.qp_num();
        let status = self
            .cq
            .failed(qp_num)
            .or_else(|| self.recv_cq.failed(qp_num))?;
        Some(Op::failed(on, OpError::QpFailed { qp_num, status }))
    }

    /// RDMA Write of `local` to `remote`.
    pub fn write(&self, local: &[Slice], remote: Remote) -> Op {
        self.post(SendOp::Write { remote }, local)
    }

    /// RDMA Write with Immediate: the peer's receive completes with `imm`.
    pub fn write_imm(&self, local: &[Slice], remote: Remote, imm: u64) -> Op {
        self.post(SendOp::WriteImm { remote, imm }, local)
    }

    /// RDMA Read of `remote` into `local`.
    pub fn read(&self, local: &[Slice], remote: Remote) -> Op {
        self.post(SendOp::Read { remote }, local)
    }

    /// Send `local` to the peer's next receive.
    pub fn send(&self, local: &[Slice]) -> Op {
        self.post(
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            local,
        )
    }

    /// Post a receive into `local`; the `Op` resolves when a message
    /// lands (`CompletionKind::Recv`).
    pub fn recv(&self, local: &[Slice]) -> Op {
        if let Some(op) = self.refuse(&self.recv_cq) {
            return op;
        }
        let id = self.recv_cq.register();
        match self.qp.post_recv(id, local) {
            Ok(()) => Op::posted(&self.recv_cq, id, self.qp.clone()),
            Err(e) => {
                self.recv_cq.unregister(id);
                Op::failed(&self.recv_cq, e.into())
            }
        }
    }

    /// RFC 7306 Immediate Data: 8 bytes to the peer's next receive.
    pub fn imm(&self, imm: u64) -> Op {
        self.post(
            SendOp::Imm {
                imm,
                solicited: false,
            },
            &[],
        )
    }

    /// FetchAdd: adds `add` at `remote`; the original value lands in
    /// `result` (8 bytes) and in `CompletionKind::FetchAdd`.
    pub fn fetch_add(&self, result: &Slice, remote: Remote, add: u64) -> Op {
        self.masked_fetch_add(result, remote, add, 0)
    }

    /// RFC 7306 Masked FetchAdd: `mask` bits end the carries.
    pub fn masked_fetch_add(&self, result: &Slice, remote: Remote, add: u64, mask: u64) -> Op {
        self.post(
            SendOp::FetchAdd { remote, add, mask },
            std::slice::from_ref(result),
        )
    }

    /// CmpSwap: writes `swap` at `remote` when it holds `compare`.
    pub fn cmp_swap(&self, result: &Slice, remote: Remote, compare: u64, swap: u64) -> Op {
        self.masked_cmp_swap(result, remote, compare, u64::MAX, swap, u64::MAX)
    }

    /// RFC 7306 Masked CmpSwap.
    pub fn masked_cmp_swap(
        &self,
        result: &Slice,
        remote: Remote,
        compare: u64,
        compare_mask: u64,
        swap: u64,
        swap_mask: u64,
    ) -> Op {
        self.post(
            SendOp::CmpSwap {
                remote,
                compare,
                compare_mask,
                swap,
                swap_mask,
            },
            std::slice::from_ref(result),
        )
    }

    /// Swap: writes `swap` at `remote`, the original into `result`.
    pub fn swap(&self, result: &Slice, remote: Remote, swap: u64) -> Op {
        self.post(SendOp::Swap { remote, swap }, std::slice::from_ref(result))
    }

    /// RDMA Commit: the responder makes `len` bytes at `remote` durable.
    pub fn commit(&self, remote: Remote, len: u32) -> Op {
        self.post(SendOp::Commit { remote, len }, &[])
    }

    /// RFC 7306-era Atomic Write: `value` replaces the 8 bytes at `remote`.
    pub fn atomic_write(&self, remote: Remote, value: u64) -> Op {
        self.post(SendOp::AtomicWrite { remote, value }, &[])
    }
}
