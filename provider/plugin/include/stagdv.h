/*
 * stagdv.h: direct verbs for stag0, stag's userspace iWARP RNIC.
 *
 * The operations RFC 7306 and draft-talpey-rdma-commit add to RDMAP, which
 * libibverbs has no verbs for: masked FetchAdd and CmpSwap, Swap
 * (draft-ietf-storm-rdmap-ext-03), 8-byte Immediate Data with and without
 * Solicited Event, RDMA Write with 8-byte Immediate Data, Commit with the
 * responder's status, and the 64-bit Atomic Write. They post on an RC QP of
 * a stag0 context like ibv_post_send does (same flags: IBV_SEND_SIGNALED,
 * IBV_SEND_FENCE, IBV_SEND_SOLICITED) and complete on its send CQ. Link
 * with -lstag_rdmav34 (or run under `stag run`, which preloads it).
 *
 * Every function returns 0 or an errno value (ibv_post_send's convention):
 * EINVAL for a QP that is not stag0's or a malformed request, ENOTCONN
 * before the connection is established, ENOMEM for a full send queue.
 */
#ifndef STAGDV_H
#define STAGDV_H

#include <stdint.h>
#include <infiniband/verbs.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Access flag of a durable region: its Commit msyncs the range (the value
 * of rdma-core's IBV_ACCESS_FLUSH_PERSISTENT, which older headers lack). */
#define STAGDV_ACCESS_DURABLE (1 << 9)

/* Whether ctx is a stag0 context (the functions below need one). */
int stagdv_is_stag_context(struct ibv_context *ctx);

/* RFC 7306 masked FetchAdd: add_mask's set bits end carry-propagation at
 * field boundaries; 0 is a plain 64-bit add. The original value lands in
 * `result` (one 8-byte SGE in memory registered with local write). */
int stagdv_post_masked_fetch_add(struct ibv_qp *qp, uint64_t wr_id, unsigned int flags,
				 const struct ibv_sge *result, uint64_t remote_addr,
				 uint32_t rkey, uint64_t add, uint64_t add_mask);

/* RFC 7306 masked CmpSwap: swaps the bits of swap_mask when
 * (target & compare_mask) == (compare & compare_mask). All-ones masks make
 * it verbs' CmpSwap. The original value lands in `result`. */
int stagdv_post_masked_cmp_swap(struct ibv_qp *qp, uint64_t wr_id, unsigned int flags,
				const struct ibv_sge *result, uint64_t remote_addr,
				uint32_t rkey, uint64_t compare, uint64_t compare_mask,
				uint64_t swap, uint64_t swap_mask);

/* Swap (draft-ietf-storm-rdmap-ext-03 §5.1.2): store `swap`, return the
 * original in `result`. */
int stagdv_post_swap(struct ibv_qp *qp, uint64_t wr_id, unsigned int flags,
		     const struct ibv_sge *result, uint64_t remote_addr, uint32_t rkey,
		     uint64_t swap);

/* RFC 7306 Immediate Data (with SE when flags has IBV_SEND_SOLICITED): 8
 * bytes that consume a receive WR at the peer, which completes with
 * IBV_WC_RECV_RDMA_WITH_IMM; stagdv_poll_cq gives all 8 bytes. */
int stagdv_post_imm(struct ibv_qp *qp, uint64_t wr_id, unsigned int flags, uint64_t imm);

/* RDMA Write followed by 8-byte Immediate Data (RFC 7306 §6). */
int stagdv_post_write_imm(struct ibv_qp *qp, uint64_t wr_id, unsigned int flags,
			  const struct ibv_sge *sg_list, int num_sge, uint64_t remote_addr,
			  uint32_t rkey, uint64_t imm);

/* RDMA Commit (draft-talpey-rdma-commit): make `length` bytes at
 * remote_addr durable at the responder (it msyncs regions registered with
 * IBV_ACCESS_FLUSH_PERSISTENT, which should be shared file mappings) once
 * every earlier Write has been placed. Completes with IBV_WC_SUCCESS, or
 * IBV_WC_REM_OP_ERR with the responder's status in
 * stagdv_wc_ext.commit_status. */
int stagdv_post_commit(struct ibv_qp *qp, uint64_t wr_id, unsigned int flags,
		       uint64_t remote_addr, uint32_t rkey, uint32_t length);

/* 64-bit Atomic Write: store `value` at the 8-byte aligned remote_addr as
 * one atomic operation (the commit draft's log-pointer update). */
int stagdv_post_atomic_write(struct ibv_qp *qp, uint64_t wr_id, unsigned int flags,
			     uint64_t remote_addr, uint32_t rkey, uint64_t value);

/* What ibv_wc cannot carry. */
struct stagdv_wc_ext {
	uint64_t imm;           /* all 8 bytes of Immediate Data (IBV_WC_WITH_IMM) */
	uint32_t commit_status; /* a Commit's responder status (0 = durable) */
	uint32_t reserved;
};

/* ibv_poll_cq, plus ext[i] for wc[i] (ext may be NULL). */
int stagdv_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc,
		   struct stagdv_wc_ext *ext);

#ifdef __cplusplus
}
#endif

#endif /* STAGDV_H */
