/*
 * stagdv_demo: every stagdv.h operation between two RC QPs of stag0,
 * connected through rdma_cm, each result checked. One process, two
 * threads (responder and requester), over 127.0.0.1.
 *
 *   stag run -- target/stagdv_demo        # prints "stagdv_demo: N passed, 0 failed"
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

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "stagdv.h"

static int passed, failed;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

#define CHECK(cond, ...)                                                       \
	do {                                                                   \
		int ok_ = (cond);                                              \
		pthread_mutex_lock(&lock);                                     \
		if (ok_) {                                                     \
			passed++;                                              \
		} else {                                                       \
			failed++;                                              \
			fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
			fprintf(stderr, __VA_ARGS__);                          \
			fputc('\n', stderr);                                   \
		}                                                              \
		pthread_mutex_unlock(&lock);                                   \
	} while (0)

#define DIE(...)                                                               \
	do {                                                                   \
		fprintf(stderr, "stagdv_demo: " __VA_ARGS__);                  \
		fprintf(stderr, " (errno %d: %s)\n", errno, strerror(errno));  \
		exit(1);                                                       \
	} while (0)

struct offer {
	uint64_t target_addr;
	uint32_t target_rkey;
	uint32_t log_rkey;
	uint64_t log_addr;
};

enum { LOG_LEN = 4096, RECVS = 4 };

static uint16_t port;
static pthread_mutex_t port_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t port_cond = PTHREAD_COND_INITIALIZER;

static struct rdma_cm_event *expect_event(struct rdma_event_channel *ch,
					  enum rdma_cm_event_type type)
{
	struct rdma_cm_event *ev;

	if (rdma_get_cm_event(ch, &ev))
		DIE("rdma_get_cm_event");
	if (ev->event != type)
		DIE("expected %s, got %s (status %d)", rdma_event_str(type),
		    rdma_event_str(ev->event), ev->status);
	return ev;
}

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
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *listen_id, *id;
	struct sockaddr_in sin = { .sin_family = AF_INET };
	struct rdma_cm_event *ev;

	if (!ch || rdma_create_id(ch, &listen_id, NULL, RDMA_PS_TCP))
		DIE("responder: create id");
	sin.sin_addr.s_addr = htonl(0x7f000001);
	if (rdma_bind_addr(listen_id, (struct sockaddr *)&sin) || rdma_listen(listen_id, 1))
		DIE("responder: bind/listen");
	pthread_mutex_lock(&port_lock);
	port = ntohs(rdma_get_src_port(listen_id));
	pthread_cond_signal(&port_cond);
	pthread_mutex_unlock(&port_lock);

	ev = expect_event(ch, RDMA_CM_EVENT_CONNECT_REQUEST);
	id = ev->id;
	rdma_ack_cm_event(ev);
	CHECK(stagdv_is_stag_context(id->verbs), "the cm id's context is stag0's");

	struct ibv_pd *pd = ibv_alloc_pd(id->verbs);
	struct ibv_cq *cq = ibv_create_cq(id->verbs, 64, NULL, NULL, 0);
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
	rdma_ack_cm_event(expect_event(ch, RDMA_CM_EVENT_ESTABLISHED));

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

	rdma_ack_cm_event(expect_event(ch, RDMA_CM_EVENT_DISCONNECTED));
	rdma_destroy_qp(id);
	ibv_dereg_mr(tmr);
	ibv_dereg_mr(lmr);
	ibv_dereg_mr(rmr);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	rdma_destroy_id(id);
	rdma_destroy_id(listen_id);
	rdma_destroy_event_channel(ch);
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
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *id;
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001) };
	struct rdma_cm_event *ev;

	pthread_mutex_lock(&port_lock);
	while (!port)
		pthread_cond_wait(&port_cond, &port_lock);
	sin.sin_port = htons(port);
	pthread_mutex_unlock(&port_lock);

	if (!ch || rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
		DIE("requester: create id");
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&sin, 2000))
		DIE("requester: resolve_addr");
	rdma_ack_cm_event(expect_event(ch, RDMA_CM_EVENT_ADDR_RESOLVED));
	if (rdma_resolve_route(id, 2000))
		DIE("requester: resolve_route");
	rdma_ack_cm_event(expect_event(ch, RDMA_CM_EVENT_ROUTE_RESOLVED));

	struct ibv_pd *pd = ibv_alloc_pd(id->verbs);
	struct ibv_cq *cq = ibv_create_cq(id->verbs, 64, NULL, NULL, 0);
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
	ev = expect_event(ch, RDMA_CM_EVENT_ESTABLISHED);
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
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	rdma_destroy_id(id);
	rdma_destroy_event_channel(ch);
	free(local);
}

int main(void)
{
	pthread_t t;

	if (pthread_create(&t, NULL, responder, NULL))
		DIE("pthread_create");
	requester();
	pthread_join(t, NULL);
	printf("stagdv_demo: %d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
