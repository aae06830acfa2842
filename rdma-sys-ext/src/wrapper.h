/*
 * Header bindgen reads: the installed rdma-core headers plus the prototypes
 * of the out-of-line C wrappers in wrappers.c (static-inline verbs and
 * features that are gated on the installed rdma-core version).
 *
 * Every stag_* function that dispatches through a provider function pointer
 * checks that pointer for NULL first and returns EOPNOTSUPP instead of
 * calling it.
 */
#ifndef STAG_RDMA_SYS_EXT_WRAPPER_H
#define STAG_RDMA_SYS_EXT_WRAPPER_H

#include <stddef.h>
#include <stdint.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

/* ---- gates: what the headers this was compiled against provide ---- */
int stag_has_ibv_wr_flush(void);
int stag_has_ibv_wr_atomic_write(void);

/* ---- device / context ---- */
struct ibv_device **stag_ibv_get_device_list(int *num_devices);
int stag_ibv_query_port(struct ibv_context *context, uint8_t port_num,
			struct ibv_port_attr *port_attr);
/*
 * ibv_query_device_ex with NULL input (comp_mask 0) and sizeof(*attr) as the
 * attribute size. attr is zeroed first, so fields the runtime library or the
 * kernel did not fill stay 0. *extended is set to 1 when the extended verb
 * answered, 0 when only the legacy ibv_query_device part (orig_attr) is valid.
 */
int stag_ibv_query_device_ex(struct ibv_context *context,
			     struct ibv_device_attr_ex *attr, int *extended);

/* ---- memory ---- */
struct ibv_mr *stag_ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length,
			       unsigned int access);

/* ---- CQ ---- */
int stag_ibv_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
int stag_ibv_req_notify_cq(struct ibv_cq *cq, int solicited_only);

/* ---- QP, legacy path ---- */
int stag_ibv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr,
		       struct ibv_send_wr **bad_wr);
int stag_ibv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr,
		       struct ibv_recv_wr **bad_wr);

/* ---- shared receive queues ---- */
/* Returns 0 or an errno; EOPNOTSUPP if the provider has no post_srq_recv. */
int stag_ibv_post_srq_recv(struct ibv_srq *srq, struct ibv_recv_wr *wr,
			   struct ibv_recv_wr **bad_wr);

/* ---- QP, extended (ibv_wr_*) path ---- */
struct ibv_qp *stag_ibv_create_qp_ex(struct ibv_context *context,
				     struct ibv_qp_init_attr_ex *attr);
struct ibv_qp_ex *stag_ibv_qp_to_qp_ex(struct ibv_qp *qp);

int stag_ibv_wr_start(struct ibv_qp_ex *qp);
/* Returns 0 or an errno; EOPNOTSUPP if the provider has no wr_complete. */
int stag_ibv_wr_complete(struct ibv_qp_ex *qp);
int stag_ibv_wr_abort(struct ibv_qp_ex *qp);

int stag_ibv_wr_send(struct ibv_qp_ex *qp);
int stag_ibv_wr_send_imm(struct ibv_qp_ex *qp, __be32 imm_data);
int stag_ibv_wr_send_inv(struct ibv_qp_ex *qp, uint32_t invalidate_rkey);
int stag_ibv_wr_rdma_write(struct ibv_qp_ex *qp, uint32_t rkey,
			   uint64_t remote_addr);
int stag_ibv_wr_rdma_write_imm(struct ibv_qp_ex *qp, uint32_t rkey,
			       uint64_t remote_addr, __be32 imm_data);
int stag_ibv_wr_rdma_read(struct ibv_qp_ex *qp, uint32_t rkey,
			  uint64_t remote_addr);
int stag_ibv_wr_atomic_fetch_add(struct ibv_qp_ex *qp, uint32_t rkey,
				 uint64_t remote_addr, uint64_t add);
int stag_ibv_wr_atomic_cmp_swp(struct ibv_qp_ex *qp, uint32_t rkey,
			       uint64_t remote_addr, uint64_t compare,
			       uint64_t swap);
/* EOPNOTSUPP when built against rdma-core without ibv_wr_atomic_write. */
int stag_ibv_wr_atomic_write(struct ibv_qp_ex *qp, uint32_t rkey,
			     uint64_t remote_addr, const void *atomic_wr);
/* EOPNOTSUPP when built against rdma-core without ibv_wr_flush. */
int stag_ibv_wr_flush(struct ibv_qp_ex *qp, uint32_t rkey,
		      uint64_t remote_addr, size_t len, uint8_t type,
		      uint8_t level);

int stag_ibv_wr_set_sge(struct ibv_qp_ex *qp, uint32_t lkey, uint64_t addr,
			uint32_t length);
int stag_ibv_wr_set_sge_list(struct ibv_qp_ex *qp, size_t num_sge,
			     const struct ibv_sge *sg_list);
int stag_ibv_wr_set_inline_data(struct ibv_qp_ex *qp, void *addr,
				size_t length);

/* ---- librdmacm static inlines ---- */
struct sockaddr *stag_rdma_get_local_addr(struct rdma_cm_id *id);
struct sockaddr *stag_rdma_get_peer_addr(struct rdma_cm_id *id);

#endif
