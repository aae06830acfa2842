/*
 * Out-of-line wrappers for the static-inline parts of libibverbs, built by
 * build.rs with `cc`. build.rs defines STAG_HAVE_WR_FLUSH and
 * STAG_HAVE_WR_ATOMIC_WRITE to 1 when its probes found those features in the
 * installed headers; without them the wrappers compile to EOPNOTSUPP stubs.
 *
 * Each wrapper that calls a provider function pointer in struct ibv_qp_ex,
 * struct ibv_cq or struct ibv_qp's context ops checks the pointer for NULL
 * first: providers leave operations they do not implement unset.
 */
#include <errno.h>
#include <string.h>

#include "wrapper.h"

#ifndef STAG_HAVE_WR_FLUSH
#define STAG_HAVE_WR_FLUSH 0
#endif
#ifndef STAG_HAVE_WR_ATOMIC_WRITE
#define STAG_HAVE_WR_ATOMIC_WRITE 0
#endif

int stag_has_ibv_wr_flush(void)
{
	return STAG_HAVE_WR_FLUSH;
}

int stag_has_ibv_wr_atomic_write(void)
{
	return STAG_HAVE_WR_ATOMIC_WRITE;
}

struct ibv_device **stag_ibv_get_device_list(int *num_devices)
{
	return ibv_get_device_list(num_devices);
}

int stag_ibv_query_port(struct ibv_context *context, uint8_t port_num,
			struct ibv_port_attr *port_attr)
{
	return ibv_query_port(context, port_num, port_attr);
}

int stag_ibv_query_device_ex(struct ibv_context *context,
			     struct ibv_device_attr_ex *attr, int *extended)
{
	struct verbs_context *vctx;
	int ret;

	memset(attr, 0, sizeof(*attr));
	*extended = 0;

	/*
	 * verbs_get_ctx_op checks the runtime verbs_context size (vctx->sz)
	 * before touching the op, so an older library is never read past its
	 * end. The op itself is told our attr size and fills at most that.
	 */
	vctx = verbs_get_ctx_op(context, query_device_ex);
	if (vctx && vctx->query_device_ex) {
		ret = vctx->query_device_ex(context, NULL, attr, sizeof(*attr));
		if (ret == 0) {
			*extended = 1;
			return 0;
		}
		if (ret != EOPNOTSUPP && ret != ENOSYS)
			return ret;
		memset(attr, 0, sizeof(*attr));
	}
	return ibv_query_device(context, &attr->orig_attr);
}

struct ibv_mr *stag_ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length,
			       unsigned int access)
{
	/* The macro picks ibv_reg_mr_iova2 when optional access bits are set. */
	return ibv_reg_mr(pd, addr, length, access);
}

int stag_ibv_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
	if (!cq->context->ops.poll_cq)
		return -EOPNOTSUPP;
	return ibv_poll_cq(cq, num_entries, wc);
}

int stag_ibv_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
	if (!cq->context->ops.req_notify_cq)
		return EOPNOTSUPP;
	return ibv_req_notify_cq(cq, solicited_only);
}

int stag_ibv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr,
		       struct ibv_send_wr **bad_wr)
{
	if (!qp->context->ops.post_send) {
		*bad_wr = wr;
		return EOPNOTSUPP;
	}
	return ibv_post_send(qp, wr, bad_wr);
}

int stag_ibv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr,
		       struct ibv_recv_wr **bad_wr)
{
	if (!qp->context->ops.post_recv) {
		*bad_wr = wr;
		return EOPNOTSUPP;
	}
	return ibv_post_recv(qp, wr, bad_wr);
}

int stag_ibv_post_srq_recv(struct ibv_srq *srq, struct ibv_recv_wr *wr,
			   struct ibv_recv_wr **bad_wr)
{
	if (!srq->context->ops.post_srq_recv) {
		*bad_wr = wr;
		return EOPNOTSUPP;
	}
	return ibv_post_srq_recv(srq, wr, bad_wr);
}

struct ibv_qp *stag_ibv_create_qp_ex(struct ibv_context *context,
				     struct ibv_qp_init_attr_ex *attr)
{
	return ibv_create_qp_ex(context, attr);
}

struct ibv_qp_ex *stag_ibv_qp_to_qp_ex(struct ibv_qp *qp)
{
	return ibv_qp_to_qp_ex(qp);
}

#define STAG_CHECK(qp, op)                                                     \
	do {                                                                   \
		if (!(qp) || !(qp)->op)                                        \
			return EOPNOTSUPP;                                     \
	} while (0)

int stag_ibv_wr_start(struct ibv_qp_ex *qp)
{
	STAG_CHECK(qp, wr_start);
	qp->wr_start(qp);
	return 0;
}

int stag_ibv_wr_complete(struct ibv_qp_ex *qp)
{
	STAG_CHECK(qp, wr_complete);
	return qp->wr_complete(qp);
}

int stag_ibv_wr_abort(struct ibv_qp_ex *qp)
{
	STAG_CHECK(qp, wr_abort);
	qp->wr_abort(qp);
	return 0;
}

int stag_ibv_wr_send(struct ibv_qp_ex *qp)
{
	STAG_CHECK(qp, wr_send);
	qp->wr_send(qp);
	return 0;
}

int stag_ibv_wr_send_imm(struct ibv_qp_ex *qp, __be32 imm_data)
{
	STAG_CHECK(qp, wr_send_imm);
	qp->wr_send_imm(qp, imm_data);
	return 0;
}

int stag_ibv_wr_send_inv(struct ibv_qp_ex *qp, uint32_t invalidate_rkey)
{
	STAG_CHECK(qp, wr_send_inv);
	qp->wr_send_inv(qp, invalidate_rkey);
	return 0;
}

int stag_ibv_wr_rdma_write(struct ibv_qp_ex *qp, uint32_t rkey,
			   uint64_t remote_addr)
{
	STAG_CHECK(qp, wr_rdma_write);
	qp->wr_rdma_write(qp, rkey, remote_addr);
	return 0;
}

int stag_ibv_wr_rdma_write_imm(struct ibv_qp_ex *qp, uint32_t rkey,
			       uint64_t remote_addr, __be32 imm_data)
{
	STAG_CHECK(qp, wr_rdma_write_imm);
	qp->wr_rdma_write_imm(qp, rkey, remote_addr, imm_data);
	return 0;
}

int stag_ibv_wr_rdma_read(struct ibv_qp_ex *qp, uint32_t rkey,
			  uint64_t remote_addr)
{
	STAG_CHECK(qp, wr_rdma_read);
	qp->wr_rdma_read(qp, rkey, remote_addr);
	return 0;
}

int stag_ibv_wr_atomic_fetch_add(struct ibv_qp_ex *qp, uint32_t rkey,
				 uint64_t remote_addr, uint64_t add)
{
	STAG_CHECK(qp, wr_atomic_fetch_add);
	qp->wr_atomic_fetch_add(qp, rkey, remote_addr, add);
	return 0;
}

int stag_ibv_wr_atomic_cmp_swp(struct ibv_qp_ex *qp, uint32_t rkey,
			       uint64_t remote_addr, uint64_t compare,
			       uint64_t swap)
{
	STAG_CHECK(qp, wr_atomic_cmp_swp);
	qp->wr_atomic_cmp_swp(qp, rkey, remote_addr, compare, swap);
	return 0;
}

int stag_ibv_wr_atomic_write(struct ibv_qp_ex *qp, uint32_t rkey,
			     uint64_t remote_addr, const void *atomic_wr)
{
#if STAG_HAVE_WR_ATOMIC_WRITE
	STAG_CHECK(qp, wr_atomic_write);
	qp->wr_atomic_write(qp, rkey, remote_addr, atomic_wr);
	return 0;
#else
	(void)qp;
	(void)rkey;
	(void)remote_addr;
	(void)atomic_wr;
	return EOPNOTSUPP;
#endif
}

int stag_ibv_wr_flush(struct ibv_qp_ex *qp, uint32_t rkey,
		      uint64_t remote_addr, size_t len, uint8_t type,
		      uint8_t level)
{
#if STAG_HAVE_WR_FLUSH
	STAG_CHECK(qp, wr_flush);
	qp->wr_flush(qp, rkey, remote_addr, len, type, level);
	return 0;
#else
	(void)qp;
	(void)rkey;
	(void)remote_addr;
	(void)len;
	(void)type;
	(void)level;
	return EOPNOTSUPP;
#endif
}

int stag_ibv_wr_set_sge(struct ibv_qp_ex *qp, uint32_t lkey, uint64_t addr,
			uint32_t length)
{
	STAG_CHECK(qp, wr_set_sge);
	qp->wr_set_sge(qp, lkey, addr, length);
	return 0;
}

int stag_ibv_wr_set_sge_list(struct ibv_qp_ex *qp, size_t num_sge,
			     const struct ibv_sge *sg_list)
{
	STAG_CHECK(qp, wr_set_sge_list);
	qp->wr_set_sge_list(qp, num_sge, sg_list);
	return 0;
}

int stag_ibv_wr_set_inline_data(struct ibv_qp_ex *qp, void *addr,
				size_t length)
{
	STAG_CHECK(qp, wr_set_inline_data);
	qp->wr_set_inline_data(qp, addr, length);
	return 0;
}

struct sockaddr *stag_rdma_get_local_addr(struct rdma_cm_id *id)
{
	return rdma_get_local_addr(id);
}

struct sockaddr *stag_rdma_get_peer_addr(struct rdma_cm_id *id)
{
	return rdma_get_peer_addr(id);
}
