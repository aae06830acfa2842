/*
 * What stag0's libibverbs plugin answers to requests it must refuse, and
 * the objects it must get right without a connection: run under
 * `stag run` (scripts/gate/rdma-core-apps.sh does). Prints
 * "verbs_errors: N passed, M failed".
 */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TEST_NAME "verbs_errors"
#include "stag_test.h"

int main(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	struct ibv_device *dev = NULL;

	for (int i = 0; list && i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), "stag0"))
			dev = list[i];
	CHECK(dev, "stag0 is listed");
	if (!dev)
		return 1;
	CHECK(dev->transport_type == IBV_TRANSPORT_IWARP, "transport iWARP: %d", dev->transport_type);
	struct ibv_context *ctx = ibv_open_device(dev);
	CHECK(ctx, "open: %s", strerror(errno));
	if (!ctx)
		return 1;

	struct ibv_device_attr da;
	CHECK(ibv_query_device(ctx, &da) == 0 && da.atomic_cap == IBV_ATOMIC_HCA &&
		      da.phys_port_cnt == 1,
	      "query_device: atomic_cap %d", da.atomic_cap);
	struct ibv_port_attr pa;
	CHECK(ibv_query_port(ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE, "port 1 active");
	CHECK(ibv_query_port(ctx, 2, &pa) != 0, "port 2 does not exist");
	union ibv_gid gid;
	/* Zero subnet prefix (libfabric lists no FI_SOCKADDR_IB address for
	 * it), non-zero interface id (ibv_devinfo shows it). */
	static const uint8_t want_gid[16] = { 0, 0, 0, 0, 0, 0, 0, 0,
					      0x02, 0x73, 0x74, 0xff, 0xfe, 0x61, 0x67, 0x00 };
	CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0 && !memcmp(gid.raw, want_gid, 16),
	      "GID 0 from the device tree");

	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd, "alloc_pd");
	char *buf = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(mr && mr->lkey == mr->rkey && mr->addr == buf && mr->length == 4096, "reg_mr");
	errno = 0;
	CHECK(!ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_REMOTE_WRITE) && errno == EINVAL,
	      "remote write without local write: EINVAL (%d)", errno);
	errno = 0;
	CHECK(!ibv_reg_mr(pd, NULL, 4096, IBV_ACCESS_LOCAL_WRITE) && errno == EINVAL,
	      "NULL address: EINVAL (%d)", errno);

	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch && ch->fd >= 0, "completion channel");
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, (void *)0x1234, ch, 0);
	CHECK(cq && cq->cq_context == (void *)0x1234 && cq->channel == ch, "create_cq with channel");
	errno = 0;
	CHECK(!ibv_create_cq(ctx, 0, NULL, NULL, 0) && errno == EINVAL, "cqe 0: EINVAL (%d)", errno);
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "a channel in use cannot go");
	struct ibv_wc wc;
	CHECK(ibv_poll_cq(cq, 1, &wc) == 0, "empty CQ polls 0");
	CHECK(ibv_req_notify_cq(cq, 0) == 0, "req_notify");
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	CHECK(poll(&pfd, 1, 50) == 0, "no event without a completion");

	struct ibv_qp_init_attr qa = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UD,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	errno = 0;
	CHECK(!ibv_create_qp(pd, &qa) && errno == EOPNOTSUPP, "UD QP: EOPNOTSUPP (%d)", errno);
	qa.qp_type = IBV_QPT_RC;
	qa.cap.max_send_wr = 1 << 20;
	errno = 0;
	CHECK(!ibv_create_qp(pd, &qa) && errno == EINVAL, "too deep: EINVAL (%d)", errno);
	qa.cap.max_send_wr = 4;
	qa.cap.max_inline_data = 64;
	struct ibv_qp *qp = ibv_create_qp(pd, &qa);
	CHECK(qp && qp->state == IBV_QPS_RESET && qp->qp_type == IBV_QPT_RC && qp->pd == pd &&
		      qp->send_cq == cq && qp->context == ctx,
	      "RC QP fields");
	CHECK(qa.cap.max_inline_data == 64, "inline room as asked");

	struct ibv_sge sge = { (uintptr_t)buf, 8, mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *rbad = NULL;
	CHECK(ibv_post_recv(qp, &rwr, &rbad) == EINVAL && rbad == &rwr, "post_recv in RESET: EINVAL");
	struct ibv_qp_attr at = { .qp_state = IBV_QPS_RTS };
	CHECK(ibv_modify_qp(qp, &at, IBV_QP_STATE) == EINVAL, "RESET -> RTS is not a transition");
	at.qp_state = IBV_QPS_INIT;
	at.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
	CHECK(ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS) == 0 &&
		      qp->state == IBV_QPS_INIT,
	      "RESET -> INIT");
	CHECK(ibv_post_recv(qp, &rwr, &rbad) == 0, "post_recv in INIT");
	struct ibv_send_wr swr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				   .send_flags = IBV_SEND_SIGNALED }, *sbad = NULL;
	CHECK(ibv_post_send(qp, &swr, &sbad) == ENOTCONN && sbad == &swr,
	      "post_send before the connection: ENOTCONN");
	struct ibv_qp_init_attr qi;
	CHECK(ibv_query_qp(qp, &at, IBV_QP_STATE, &qi) == 0 && at.qp_state == IBV_QPS_INIT &&
		      qi.cap.max_inline_data == 64 && at.qp_access_flags == IBV_ACCESS_REMOTE_WRITE,
	      "query_qp");
	/* To Error: the posted receive flushes, and the channel fires. */
	at.qp_state = IBV_QPS_ERR;
	CHECK(ibv_modify_qp(qp, &at, IBV_QP_STATE) == 0, "INIT -> ERR");
	int got = 0;
	for (int i = 0; i < 2000 && got == 0; i++) {
		got = ibv_poll_cq(cq, 1, &wc);
		if (!got)
			usleep(1000);
	}
	CHECK(got == 1 && wc.wr_id == 1 && wc.status == IBV_WC_WR_FLUSH_ERR,
	      "the receive flushes: got %d status %d", got, wc.status);
	CHECK(ibv_req_notify_cq(cq, 0) == 0, "re-arm");
	rwr.wr_id = 3;
	CHECK(ibv_post_recv(qp, &rwr, &rbad) == 0, "post_recv in ERR is accepted (and flushes)");
	struct ibv_cq *ev_cq = NULL;
	void *ev_ctx = NULL;
	pfd.revents = 0;
	if (poll(&pfd, 1, 2000) == 1) {
		CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq && ev_ctx == (void *)0x1234,
		      "completion event names the CQ");
		CHECK(ibv_poll_cq(cq, 1, &wc) == 1 && wc.wr_id == 3 && wc.status == IBV_WC_WR_FLUSH_ERR,
		      "the receive posted in ERR flushed");
		ibv_ack_cq_events(cq, 1);
	} else {
		CHECK(0, "no completion event after a flushed receive");
	}
	CHECK(ibv_destroy_qp(qp) == 0, "destroy_qp");
	CHECK(ibv_destroy_cq(cq) == 0, "destroy_cq");
	CHECK(ibv_destroy_comp_channel(ch) == 0, "destroy_comp_channel");
	CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
	CHECK(ibv_dealloc_pd(pd) == 0, "dealloc_pd");
	CHECK(ibv_close_device(ctx) == 0, "close_device");
	ibv_free_device_list(list);
	free(buf);
	return test_summary();
}
