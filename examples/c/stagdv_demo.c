/*
 * stagdv_demo: every stagdv.h operation between two RC QPs of stag0,
 * connected through rdma_cm, each result checked. One process, two
 * threads (responder and requester), over 127.0.0.1.
 *
 *   cc -Iprovider/plugin/include -Iprovider/plugin/tests/c -o stagdv_demo \
 *      examples/c/stagdv_demo.c -Ltarget/debug -Wl,-rpath,$PWD/target/debug \
 *      -lstag_rdmav34 -lrdmacm -libverbs
 *   stag run -- ./stagdv_demo        # prints "stagdv_demo: N passed, 0 failed"
 *
 * The responder offers a 64-byte target region (atomics, Writes) and a
 * durable log region (a shared mapping of a file, registered with
 * STAGDV_ACCESS_DURABLE), and passes their address and rkey in the
 * rdma_accept private data. The requester runs masked FetchAdd, masked
 * CmpSwap, Swap, Atomic Write, Immediate Data with and without Solicited
 * Event, Write with 8-byte Immediate Data and Commit, and checks each
 * original value and completion; the responder checks what arrived.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "stagdv.h"
/* CHECK, DIE and the rdma_cm connection over 127.0.0.1 that every stag C
 * test program shares (provider/plugin/tests/c/stag_test.h). */
#define TEST_NAME "stagdv_demo"
#include "stag_test.h"

struct offer {
	uint64_t target_addr;
	uint32_t target_rkey;
	uint32_t log_rkey;
	uint64_t log_addr;
};

enum { LOG_LEN = 4096, RECVS = 4 };

/* Poll one completion (busy), with the stagdv extension. */
static void poll_one(struct ibv_cq *cq, struct ibv_wc *wc, struct stagdv_wc_ext *ext)
{
	for (long spins = 0;; spins++) {
		int n = stagdv_poll_cq(cq, 1, wc, ext);
		if (n < 0)
			DIE("stagdv_poll_cq");
		if (n == 1)
			return;
		if (spins > 2000000000L)
			DIE("no completion");
	}
}

static void *responder(void *arg)
{
	(void)arg;
	struct test_conn c = { 0 };
	test_conn_serve_one(&c);
	struct rdma_cm_id *id = c.id;
	CHECK(stagdv_is_stag_context(id->verbs), "the cm id's context is stag0's");

	struct ibv_pd *pd = c.pd = ibv_alloc_pd(id->verbs);
	struct ibv_cq *cq = c.cq = ibv_create_cq(id->verbs, 64, NULL, NULL, 0);
	struct ibv_qp_init_attr qa = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	if (!pd || !cq || rdma_create_qp(id, pd, &qa))
		DIE("responder: pd/cq/qp");

	uint64_t *target = aligned_alloc(64, 64);
	memset(target, 0, 64);
	target[0] = 0x00000001ffffffffULL; /* masked FetchAdd: two 32-bit fields */
	target[1] = 0x1122334455667788ULL; /* masked CmpSwap */
	target[2] = 7;                     /* Swap */
	target[3] = 0;                     /* Atomic Write */
	struct ibv_mr *tmr = ibv_reg_mr(pd, target, 64,
					IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
						IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	char path[] = "/tmp/stagdv-demo-XXXXXX";
	int fd = mkstemp(path);
	if (fd < 0 || ftruncate(fd, LOG_LEN))
		DIE("responder: log file");
	char *log = mmap(NULL, LOG_LEN, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (log == MAP_FAILED)
		DIE("responder: mmap");
	struct ibv_mr *lmr = ibv_reg_mr(pd, log, LOG_LEN,
					IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
						STAGDV_ACCESS_DURABLE);
	uint64_t *rbuf = calloc(RECVS, 64);
	struct ibv_mr *rmr = ibv_reg_mr(pd, rbuf, RECVS * 64, IBV_ACCESS_LOCAL_WRITE);
	if (!tmr || !lmr || !rmr)
		DIE("responder: reg_mr");
	for (int i = 0; i < RECVS; i++) {
		struct ibv_sge sge = { (uintptr_t)(rbuf + i * 8), 64, rmr->lkey };
		struct ibv_recv_wr wr = { .wr_id = 100 + i, .sg_list = &sge, .num_sge = 1 }, *bad;
		if (ibv_post_recv(id->qp, &wr, &bad))
			DIE("responder: post_recv");
	}
	struct offer offer = { (uintptr_t)target, tmr->rkey, lmr->rkey, (uintptr_t)log };
	struct rdma_conn_param cp = { .private_data = &offer, .private_data_len = sizeof offer,
				      .responder_resources = 16, .initiator_depth = 16 };
	if (rdma_accept(id, &cp))
		DIE("responder: accept");
	test_conn_established(&c, NULL, 0);

	/* Immediate Data, Immediate Data with SE, Write with Immediate, then
	 * the requester's closing Send. */
	struct ibv_wc wc;
	struct stagdv_wc_ext ext;
	poll_one(cq, &wc, &ext);
	CHECK(wc.status == IBV_WC_SUCCESS && (wc.wc_flags & IBV_WC_WITH_IMM) &&
		      ext.imm == 0x0123456789abcdefULL && wc.byte_len == 0,
	      "Immediate Data arrives whole: status %d imm %#" PRIx64, wc.status, ext.imm);
	poll_one(cq, &wc, &ext);
	CHECK(wc.status == IBV_WC_SUCCESS && ext.imm == 0xfedcba9876543210ULL,
	      "Immediate Data with SE: imm %#" PRIx64, ext.imm);
	poll_one(cq, &wc, &ext);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM &&
		      ext.imm == 0xa5a5a5a55a5a5a5aULL,
	      "Write with Immediate: opcode %d imm %#" PRIx64, wc.opcode, ext.imm);
	CHECK(target[4] == 0x5752495445494d4dULL, "the Write before the Immediate Data landed: %#" PRIx64,
	      target[4]);
	poll_one(cq, &wc, &ext);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.byte_len == 4,
	      "closing Send: status %d opcode %d len %u", wc.status, wc.opcode, wc.byte_len);

	CHECK(target[0] == 0x0000000200000000ULL,
	      "masked FetchAdd kept the carry inside the low field: %#" PRIx64, target[0]);
	CHECK(target[1] == 0x11223344aabbccddULL, "masked CmpSwap swapped the low half: %#" PRIx64,
	      target[1]);
	CHECK(target[2] == 99, "Swap stored 99: %" PRIu64, target[2]);
	CHECK(target[3] == 0xc0ffee, "Atomic Write stored the value: %#" PRIx64, target[3]);
	char ondisk[32] = { 0 };
	CHECK(pread(fd, ondisk, 14, 0) == 14 && memcmp(ondisk, "durable record", 14) == 0,
	      "the committed log record is in the file: '%s'", ondisk);

	rdma_ack_cm_event(expect_event(c.ch, RDMA_CM_EVENT_DISCONNECTED));
	rdma_destroy_qp(id);
	ibv_dereg_mr(tmr);
	ibv_dereg_mr(lmr);
	ibv_dereg_mr(rmr);
	test_conn_destroy(&c);
	munmap(log, LOG_LEN);
	close(fd);
	unlink(path);
	free(target);
	free(rbuf);
	return NULL;
}

/* Post with `post`, then check the one completion. */
#define RUN(post, what)                                                       \
	do {                                                                  \
		int rc_ = (post);                                             \
		if (rc_) {                                                    \
			errno = rc_;                                          \
			DIE("%s: post", what);                                \
		}                                                             \
		poll_one(cq, &wc, &ext);                                      \
		CHECK(wc.status == IBV_WC_SUCCESS, "%s completes: %s (vendor %#x)", what, \
		      ibv_wc_status_str(wc.status), wc.vendor_err);            \
	} while (0)

static void requester(void)
{
	struct test_conn c = { 0 };
	test_conn_resolve(&c, wait_port());
	struct rdma_cm_id *id = c.id;
	struct rdma_cm_event *ev;

	struct ibv_pd *pd = c.pd = ibv_alloc_pd(id->verbs);
	struct ibv_cq *cq = c.cq = ibv_create_cq(id->verbs, 64, NULL, NULL, 0);
	struct ibv_qp_init_attr qa = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1,
		.cap = { .max_send_wr = 16, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	if (!pd || !cq || rdma_create_qp(id, pd, &qa))
		DIE("requester: pd/cq/qp");
	uint64_t *local = aligned_alloc(64, 64);
	memset(local, 0, 64);
	struct ibv_mr *mr = ibv_reg_mr(pd, local, 64, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		DIE("requester: reg_mr");

	struct rdma_conn_param cp = { .responder_resources = 16, .initiator_depth = 16 };
	if (rdma_connect(id, &cp))
		DIE("requester: connect");
	ev = expect_event(c.ch, RDMA_CM_EVENT_ESTABLISHED);
	struct offer offer;
	CHECK(ev->param.conn.private_data_len >= sizeof offer, "the responder's offer arrives (%u bytes)",
	      ev->param.conn.private_data_len);
	memcpy(&offer, ev->param.conn.private_data, sizeof offer);
	rdma_ack_cm_event(ev);

	struct ibv_qp *qp = id->qp;
	struct ibv_sge res = { (uintptr_t)&local[0], 8, mr->lkey };
	struct ibv_wc wc;
	struct stagdv_wc_ext ext;
	uint64_t t = offer.target_addr;

	/* Two 32-bit counters in one word: the mask bit at 31 stops the low
	 * field's carry, so 0x1_ffffffff + 1 gives 0x2_00000000 only through
	 * the high field's own add. */
	RUN(stagdv_post_masked_fetch_add(qp, 1, IBV_SEND_SIGNALED, &res, t, offer.target_rkey,
					 0x0000000100000001ULL, 0x0000000080000000ULL),
	    "masked FetchAdd");
	CHECK(local[0] == 0x00000001ffffffffULL, "masked FetchAdd returns the original: %#" PRIx64,
	      local[0]);
	RUN(stagdv_post_masked_cmp_swap(qp, 2, IBV_SEND_SIGNALED, &res, t + 8, offer.target_rkey,
					0x0000000055667788ULL, 0x00000000ffffffffULL,
					0xffffffffaabbccddULL, 0x00000000ffffffffULL),
	    "masked CmpSwap");
	CHECK(local[0] == 0x1122334455667788ULL, "masked CmpSwap returns the original: %#" PRIx64,
	      local[0]);
	RUN(stagdv_post_swap(qp, 3, IBV_SEND_SIGNALED, &res, t + 16, offer.target_rkey, 99), "Swap");
	CHECK(local[0] == 7, "Swap returns the original: %" PRIu64, local[0]);
	RUN(stagdv_post_atomic_write(qp, 4, IBV_SEND_SIGNALED, t + 24, offer.target_rkey, 0xc0ffee),
	    "Atomic Write");
	RUN(stagdv_post_imm(qp, 5, IBV_SEND_SIGNALED, 0x0123456789abcdefULL), "Immediate Data");
	RUN(stagdv_post_imm(qp, 6, IBV_SEND_SIGNALED | IBV_SEND_SOLICITED, 0xfedcba9876543210ULL),
	    "Immediate Data with SE");
	local[1] = 0x5752495445494d4dULL;
	struct ibv_sge wsge = { (uintptr_t)&local[1], 8, mr->lkey };
	RUN(stagdv_post_write_imm(qp, 7, IBV_SEND_SIGNALED, &wsge, 1, t + 32, offer.target_rkey,
				  0xa5a5a5a55a5a5a5aULL),
	    "Write with Immediate");

	/* A log record, made durable by Commit. */
	memcpy(&local[2], "durable record", 14);
	struct ibv_sge lsge = { (uintptr_t)&local[2], 14, mr->lkey };
	struct ibv_send_wr w = { .wr_id = 8, .sg_list = &lsge, .num_sge = 1,
				 .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED }, *bad;
	w.wr.rdma.remote_addr = offer.log_addr;
	w.wr.rdma.rkey = offer.log_rkey;
	RUN(ibv_post_send(qp, &w, &bad), "log Write");
	RUN(stagdv_post_commit(qp, 9, IBV_SEND_SIGNALED, offer.log_addr, offer.log_rkey, 14),
	    "Commit");
	CHECK(ext.commit_status == 0, "Commit status 0 (durable): %u", ext.commit_status);
	/* The closing Send: the responder checks its memory on receipt. */
	memcpy(&local[4], "done", 4);
	struct ibv_sge dsge = { (uintptr_t)&local[4], 4, mr->lkey };
	struct ibv_send_wr d = { .wr_id = 10, .sg_list = &dsge, .num_sge = 1,
				 .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
	RUN(ibv_post_send(qp, &d, &bad), "closing Send");
	/* A Commit past the durable region's end fails with the responder's
	 * status: durability is reported, not assumed. */
	int rc = stagdv_post_commit(qp, 11, IBV_SEND_SIGNALED, offer.log_addr + LOG_LEN,
				    offer.log_rkey, 8);
	CHECK(rc == 0, "post of an out-of-bounds Commit: %d", rc);
	poll_one(cq, &wc, &ext);
	CHECK(wc.status != IBV_WC_SUCCESS, "an out-of-bounds Commit fails: %s",
	      ibv_wc_status_str(wc.status));
	(void)bad;
	rdma_disconnect(id);
	rdma_destroy_qp(id);
	ibv_dereg_mr(mr);
	test_conn_destroy(&c);
	free(local);
}

int main(void)
{
	pthread_t t;

	if (pthread_create(&t, NULL, responder, NULL))
		DIE("pthread_create");
	requester();
	pthread_join(t, NULL);
	return test_summary();
}
