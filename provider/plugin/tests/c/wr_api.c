/*
 * The extended post API (ibv_qp_ex / ibv_wr_*) and inline data on stag0,
 * between two RC QPs connected through rdma_cm in one process: a batch of
 * Write (SGE and inline), FetchAdd, CmpSwap, Atomic Write, Read and an
 * inline Send, checked by reading the target back; wr_abort posts
 * nothing; an operation left out of send_ops_flags fails wr_complete; a
 * legacy IBV_SEND_INLINE post needs no registered memory. Run under
 * `stag run`. Prints "wr_api: N passed, M failed".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TEST_NAME "wr_api"
#include "stag_test.h"

struct offer {
	uint64_t addr;
	uint32_t rkey;
};

static void *responder(void *arg)
{
	(void)arg;
	struct test_conn c = { 0 };
	test_conn_serve_one(&c);
	struct rdma_cm_id *id = c.id;
	struct ibv_pd *pd = c.pd = ibv_alloc_pd(id->verbs);
	struct ibv_cq *cq = c.cq = ibv_create_cq(id->verbs, 16, NULL, NULL, 0);
	struct ibv_qp_init_attr qa = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
				       .cap = { 4, 4, 1, 1, 0 } };
	if (!pd || !cq || rdma_create_qp(id, pd, &qa))
		DIE("responder qp");
	uint64_t *target = aligned_alloc(4096, 4096);
	memset(target, 0, 4096);
	target[16] = 100; /* +128: FetchAdd */
	struct ibv_mr *tmr = ibv_reg_mr(pd, target, 4096,
					IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
						IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	char *rbuf = calloc(2, 64);
	struct ibv_mr *rmr = ibv_reg_mr(pd, rbuf, 128, IBV_ACCESS_LOCAL_WRITE);
	for (int i = 0; i < 2; i++) {
		struct ibv_sge s = { (uintptr_t)(rbuf + 64 * i), 64, rmr->lkey };
		struct ibv_recv_wr w = { .wr_id = i, .sg_list = &s, .num_sge = 1 }, *bad;
		if (ibv_post_recv(id->qp, &w, &bad))
			DIE("post_recv");
	}
	struct offer o = { (uintptr_t)target, tmr->rkey };
	struct rdma_conn_param cp = { .private_data = &o, .private_data_len = sizeof o,
				      .responder_resources = 8, .initiator_depth = 8 };
	if (rdma_accept(id, &cp))
		DIE("accept");
	test_conn_established(&c, NULL, 0);
	struct ibv_wc wc[2];
	CHECK(poll_cq_for(cq, wc, 2, 20, 0) == 2 && wc[0].status == IBV_WC_SUCCESS && wc[1].status == IBV_WC_SUCCESS,
	      "two Sends arrive");
	CHECK(wc[0].byte_len == 3 && !memcmp(rbuf, "bye", 3), "ibv_wr_send with inline data");
	CHECK(wc[1].byte_len == 11 && !memcmp(rbuf + 64, "legacy text", 11),
	      "legacy IBV_SEND_INLINE from unregistered memory");
	rdma_ack_cm_event(expect_event(c.ch, RDMA_CM_EVENT_DISCONNECTED));
	rdma_destroy_qp(id);
	ibv_dereg_mr(tmr);
	ibv_dereg_mr(rmr);
	test_conn_destroy(&c);
	free(target);
	free(rbuf);
	return NULL;
}

int main(void)
{
	pthread_t t;
	if (pthread_create(&t, NULL, responder, NULL))
		DIE("thread");
	struct test_conn c = { 0 };
	test_conn_resolve(&c, wait_port());
	struct rdma_cm_id *id = c.id;
	struct ibv_pd *pd = c.pd = ibv_alloc_pd(id->verbs);
	struct ibv_cq *cq = c.cq = ibv_create_cq(id->verbs, 32, NULL, NULL, 0);
	struct ibv_qp_init_attr_ex qa = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1, .pd = pd,
		.cap = { .max_send_wr = 16, .max_recv_wr = 1, .max_send_sge = 2, .max_recv_sge = 1,
			 .max_inline_data = 64 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_SEND |
				  IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
				  IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | IBV_QP_EX_WITH_ATOMIC_WRITE,
	};
	if (!pd || !cq || rdma_create_qp_ex(id, &qa))
		DIE("create_qp_ex");
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(id->qp);
	CHECK(qx != NULL, "ibv_qp_to_qp_ex finds the extended QP");
	if (!qx)
		return 1;
	uint64_t *local = aligned_alloc(4096, 4096);
	memset(local, 0, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, local, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct rdma_conn_param cp = { .responder_resources = 8, .initiator_depth = 8 };
	if (!mr || rdma_connect(id, &cp))
		DIE("connect");
	struct offer o = { 0 };
	test_conn_established(&c, &o, sizeof o);

	memcpy(local, "hello wr api", 12);
	uint64_t aw = 0x0123456789abcdefULL;
	ibv_wr_start(qx);
	qx->wr_id = 1;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qx, o.rkey, o.addr);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)local, 12);
	qx->wr_id = 2;
	ibv_wr_rdma_write(qx, o.rkey, o.addr + 64);
	ibv_wr_set_inline_data(qx, "inline!", 7);
	qx->wr_id = 3;
	ibv_wr_atomic_fetch_add(qx, o.rkey, o.addr + 128, 5);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)&local[64], 8);
	qx->wr_id = 4;
	ibv_wr_atomic_cmp_swp(qx, o.rkey, o.addr + 136, 0, 42);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)&local[65], 8);
	qx->wr_id = 5;
	ibv_wr_atomic_write(qx, o.rkey, o.addr + 144, &aw);
	qx->wr_id = 6;
	ibv_wr_rdma_read(qx, o.rkey, o.addr);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)&local[128], 160);
	qx->wr_id = 7;
	ibv_wr_send(qx);
	ibv_wr_set_inline_data(qx, "bye", 3);
	CHECK(ibv_wr_complete(qx) == 0, "wr_complete posts the batch");
	struct ibv_wc wc[8];
	int n = poll_cq_for(cq, wc, 7, 20, 0);
	CHECK(n == 7, "seven completions: %d", n);
	for (int i = 0; i < n; i++)
		CHECK(wc[i].status == IBV_WC_SUCCESS && wc[i].wr_id == (uint64_t)i + 1,
		      "completion %d: wr_id %" PRIu64 " status %s", i, wc[i].wr_id,
		      ibv_wc_status_str(wc[i].status));
	CHECK(local[64] == 100, "FetchAdd returns the original: %" PRIu64, local[64]);
	CHECK(local[65] == 0, "CmpSwap returns the original: %" PRIu64, local[65]);
	char *back = (char *)&local[128];
	uint64_t *backw = &local[128];
	CHECK(!memcmp(back, "hello wr api", 12), "the Read returns the SGE Write");
	CHECK(!memcmp(back + 64, "inline!", 7), "the Read returns the inline Write");
	CHECK(backw[16] == 105 && backw[17] == 42 && backw[18] == aw,
	      "atomics landed: %" PRIu64 " %" PRIu64 " %#" PRIx64, backw[16], backw[17], backw[18]);

	/* wr_abort posts nothing. */
	ibv_wr_start(qx);
	qx->wr_id = 50;
	ibv_wr_rdma_write(qx, o.rkey, o.addr + 512);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)local, 8);
	ibv_wr_abort(qx);
	usleep(50000);
	CHECK(ibv_poll_cq(cq, 1, wc) == 0, "an aborted batch completes nothing");
	/* An operation the QP was not created for fails the batch, which then
	 * posts nothing. */
	ibv_wr_start(qx);
	qx->wr_id = 60;
	ibv_wr_rdma_write(qx, o.rkey, o.addr + 512);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)local, 8);
	qx->wr_id = 61;
	ibv_wr_rdma_write_imm(qx, o.rkey, o.addr + 512, htonl(7));
	CHECK(ibv_wr_complete(qx) == EINVAL, "an op outside send_ops_flags: EINVAL");
	usleep(50000);
	CHECK(ibv_poll_cq(cq, 1, wc) == 0, "a failed batch completes nothing");

	/* Legacy inline: stack memory, no lkey. */
	char text[16] = "legacy text";
	struct ibv_sge s = { (uintptr_t)text, 11, 0 };
	struct ibv_send_wr w = { .wr_id = 70, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND,
				 .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED }, *bad;
	CHECK(ibv_post_send(id->qp, &w, &bad) == 0, "post inline Send");
	memset(text, 'X', sizeof text); /* reusable at once */
	CHECK(poll_cq_for(cq, wc, 1, 20, 0) == 1 && wc[0].wr_id == 70 && wc[0].status == IBV_WC_SUCCESS,
	      "inline Send completes");
	/* As on siw, inline data may go up to the device's maximum (256),
	 * whatever the QP asked for; past it: EINVAL. */
	char big[300];
	memset(big, 'b', sizeof big);
	s.addr = (uintptr_t)big;
	s.length = 257;
	w.wr_id = 71;
	CHECK(ibv_post_send(id->qp, &w, &bad) == EINVAL, "inline data past the device maximum: EINVAL");

	rdma_disconnect(id);
	pthread_join(t, NULL);
	rdma_destroy_qp(id);
	ibv_dereg_mr(mr);
	test_conn_destroy(&c);
	free(local);
	return test_summary();
}
