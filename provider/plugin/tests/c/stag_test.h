/*
 * stag_test.h: the setup and teardown stag's C test programs share (the
 * programs in provider/plugin/tests/c and provider/plugin/src/cm/tests,
 * and examples/c/stagdv_demo.c): result counting, fatal errors, rdma_cm
 * events, and one connection's listen/resolve/tear-down over 127.0.0.1.
 * What each program tests stays in the program.
 *
 * Define TEST_NAME (a string literal) before including: it starts DIE's
 * messages and the summary line the gate scripts match,
 * "TEST_NAME: N passed, M failed". Build with -Iprovider/plugin/tests/c.
 * Everything here is static: one program, one translation unit.
 */
#ifndef STAG_TEST_H
#define STAG_TEST_H

#ifndef TEST_NAME
#error "define TEST_NAME before including stag_test.h"
#endif
/* How long check_event waits for an event (milliseconds). */
#ifndef CM_EVENT_TIMEOUT_MS
#define CM_EVENT_TIMEOUT_MS 10000
#endif

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

/* ---- results ---- */

#define STAG_TEST_UNUSED __attribute__((unused))

static int passed STAG_TEST_UNUSED, failed STAG_TEST_UNUSED;
static pthread_mutex_t check_lock STAG_TEST_UNUSED = PTHREAD_MUTEX_INITIALIZER;

/* CHECK(cond, fmt, ...): count one check. A failing one prints its line,
 * errno as `cond` left it, and the message. Any thread may check. */
#define CHECK(cond, ...)                                                             \
	do {                                                                         \
		int ok_ = !!(cond);                                                  \
		int errno_ = errno;                                                  \
		pthread_mutex_lock(&check_lock);                                     \
		if (ok_) {                                                           \
			passed++;                                                    \
		} else {                                                             \
			failed++;                                                    \
			fprintf(stderr, "FAILED line %d (errno %d): ", __LINE__, errno_); \
			fprintf(stderr, __VA_ARGS__);                                \
			fputc('\n', stderr);                                         \
		}                                                                    \
		pthread_mutex_unlock(&check_lock);                                   \
	} while (0)

/* DIE("literal format", ...): a failure the program cannot go on from:
 * the message and errno's text on stderr, exit status 1. */
#define DIE(...)                                                     \
	do {                                                         \
		int errno_ = errno;                                  \
		fprintf(stderr, TEST_NAME ": " __VA_ARGS__);         \
		fprintf(stderr, ": %s\n", strerror(errno_));         \
		exit(1);                                             \
	} while (0)

/* Print the summary line; the program's exit status (0: all passed). */
static inline int test_summary(void)
{
	pthread_mutex_lock(&check_lock);
	printf("%s: %d passed, %d failed\n", TEST_NAME, passed, failed);
	int rc = failed != 0;
	pthread_mutex_unlock(&check_lock);
	return rc;
}

/* Monotonic seconds. */
static inline double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* ---- devices ---- */

/* stag0's context, opened by name without rdma_cm; fatal if it cannot be. */
static inline struct ibv_context *open_stag0(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	struct ibv_context *ctx = NULL;
	for (int i = 0; list && i < n && !ctx; i++)
		if (!strcmp(ibv_get_device_name(list[i]), "stag0"))
			ctx = ibv_open_device(list[i]);
	if (list)
		ibv_free_device_list(list);
	if (!ctx)
		DIE("open stag0");
	return ctx;
}

/* ---- rdma_cm events ---- */

/* The next event of `ch`, which must be `type` (blocking, as a program
 * that trusts its peer waits); anything else is fatal. The caller acks. */
static inline struct rdma_cm_event *expect_event(struct rdma_event_channel *ch,
						 enum rdma_cm_event_type type)
{
	struct rdma_cm_event *ev;
	if (rdma_get_cm_event(ch, &ev))
		DIE("rdma_get_cm_event (wanted %s)", rdma_event_str(type));
	if (ev->event != type) {
		fprintf(stderr, TEST_NAME ": expected %s, got %s (status %d)\n", rdma_event_str(type),
			rdma_event_str(ev->event), ev->status);
		exit(1);
	}
	return ev;
}

/* The next event of `ch` within CM_EVENT_TIMEOUT_MS, or NULL. */
static inline struct rdma_cm_event *next_event(struct rdma_event_channel *ch)
{
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	struct rdma_cm_event *ev;
	if (poll(&pfd, 1, CM_EVENT_TIMEOUT_MS) != 1)
		return NULL;
	if (rdma_get_cm_event(ch, &ev))
		return NULL;
	return ev;
}

/* 1 if the next event of `ch` (within CM_EVENT_TIMEOUT_MS) is `type`,
 * else 0 with what came instead on stderr. The event is returned unacked
 * in *out when `out` is set, else acked. */
static inline int check_event(struct rdma_event_channel *ch, enum rdma_cm_event_type type,
			      struct rdma_cm_event **out)
{
	struct rdma_cm_event *ev = next_event(ch);
	if (!ev) {
		fprintf(stderr, "no event within %d ms (wanted %s)\n", CM_EVENT_TIMEOUT_MS,
			rdma_event_str(type));
		return 0;
	}
	if (ev->event != type) {
		fprintf(stderr, "got %s (status %d), wanted %s\n", rdma_event_str(ev->event), ev->status,
			rdma_event_str(type));
		rdma_ack_cm_event(ev);
		return 0;
	}
	if (out)
		*out = ev;
	else
		rdma_ack_cm_event(ev);
	return 1;
}

/* ---- two threads of one program: the passive side hands its port over ---- */

static uint16_t shared_port STAG_TEST_UNUSED;
static pthread_mutex_t shared_port_lock STAG_TEST_UNUSED = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t shared_port_cond STAG_TEST_UNUSED = PTHREAD_COND_INITIALIZER;

static inline void publish_port(uint16_t port)
{
	pthread_mutex_lock(&shared_port_lock);
	shared_port = port;
	pthread_cond_broadcast(&shared_port_cond);
	pthread_mutex_unlock(&shared_port_lock);
}

static inline uint16_t wait_port(void)
{
	pthread_mutex_lock(&shared_port_lock);
	while (!shared_port)
		pthread_cond_wait(&shared_port_cond, &shared_port_lock);
	uint16_t port = shared_port;
	pthread_mutex_unlock(&shared_port_lock);
	return port;
}

/* ---- one connection over 127.0.0.1 ---- */

/* One end of a connection; what a program adds (MRs, an SRQ, a
 * completion channel) it frees itself before test_conn_destroy. */
struct test_conn {
	struct rdma_event_channel *ch;
	struct rdma_cm_id *listen; /* the passive side's listening id */
	struct rdma_cm_id *id;	   /* the connected id */
	struct ibv_pd *pd;
	struct ibv_cq *cq;
};

/* Passive side: a new channel and an id listening on 127.0.0.1, port 0
 * (the kernel picks one). Returns the port. */
static inline uint16_t test_conn_listen(struct test_conn *c)
{
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	c->ch = rdma_create_event_channel();
	if (!c->ch || rdma_create_id(c->ch, &c->listen, NULL, RDMA_PS_TCP) ||
	    rdma_bind_addr(c->listen, (struct sockaddr *)&sin) || rdma_listen(c->listen, 1))
		DIE("listen");
	return ntohs(rdma_get_src_port(c->listen));
}

/* Passive side: take the next CONNECT_REQUEST as c->id. Up to `len`
 * bytes of its private data are copied to `priv` (when it holds that
 * many; else `priv` is left as it is). */
static inline void test_conn_take_request(struct test_conn *c, void *priv, size_t len)
{
	struct rdma_cm_event *ev = expect_event(c->ch, RDMA_CM_EVENT_CONNECT_REQUEST);
	c->id = ev->id;
	if (priv && ev->param.conn.private_data_len >= len)
		memcpy(priv, ev->param.conn.private_data, len);
	rdma_ack_cm_event(ev);
}

/* Passive side in a two-thread program: listen (test_conn_listen),
 * hand the port to the other thread (publish_port), take its request. */
static inline void test_conn_serve_one(struct test_conn *c)
{
	publish_port(test_conn_listen(c));
	test_conn_take_request(c, NULL, 0);
}

/* Active side: a new channel and id, its address and route resolved to
 * 127.0.0.1:port (2 s each). */
static inline void test_conn_resolve(struct test_conn *c, uint16_t port)
{
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port),
				   .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	c->ch = rdma_create_event_channel();
	if (!c->ch || rdma_create_id(c->ch, &c->id, NULL, RDMA_PS_TCP) ||
	    rdma_resolve_addr(c->id, NULL, (struct sockaddr *)&sin, 2000))
		DIE("resolve");
	rdma_ack_cm_event(expect_event(c->ch, RDMA_CM_EVENT_ADDR_RESOLVED));
	if (rdma_resolve_route(c->id, 2000))
		DIE("route");
	rdma_ack_cm_event(expect_event(c->ch, RDMA_CM_EVENT_ROUTE_RESOLVED));
}

/* Wait for ESTABLISHED (after rdma_accept or rdma_connect); up to `len`
 * bytes of its private data go to `priv`, as in test_conn_take_request. */
static inline void test_conn_established(struct test_conn *c, void *priv, size_t len)
{
	struct rdma_cm_event *ev = expect_event(c->ch, RDMA_CM_EVENT_ESTABLISHED);
	if (priv && ev->param.conn.private_data_len >= len)
		memcpy(priv, ev->param.conn.private_data, len);
	rdma_ack_cm_event(ev);
}

/* Tear one end down in the order verbs requires: the QP (unless the
 * program destroyed it already, to free its MRs first), the CQ, the PD,
 * the ids, the channel. Whatever is NULL is skipped. */
static inline void test_conn_destroy(struct test_conn *c)
{
	if (c->id && c->id->qp)
		rdma_destroy_qp(c->id);
	if (c->cq)
		ibv_destroy_cq(c->cq);
	if (c->pd)
		ibv_dealloc_pd(c->pd);
	if (c->id)
		rdma_destroy_id(c->id);
	if (c->listen)
		rdma_destroy_id(c->listen);
	if (c->ch)
		rdma_destroy_event_channel(c->ch);
	memset(c, 0, sizeof *c);
}

/* ---- completions ---- */

/* Poll `cq` until n completions are in wc or `secs` have passed; returns
 * how many. idle_us = 0 polls busy (a requester measuring nothing else);
 * otherwise it sleeps idle_us whenever the CQ is empty (long waits for a
 * peer). A poll error is fatal. */
static inline int poll_cq_for(struct ibv_cq *cq, struct ibv_wc *wc, int n, double secs, unsigned idle_us)
{
	int got = 0;
	double end = now_s() + secs;
	while (got < n && now_s() < end) {
		int r = ibv_poll_cq(cq, n - got, wc + got);
		if (r < 0)
			DIE("ibv_poll_cq");
		got += r;
		if (!r && idle_us)
			usleep(idle_us);
	}
	return got;
}

#endif /* STAG_TEST_H */
