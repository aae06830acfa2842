/*
 * Completion channels on stag0, between two RC QPs connected through
 * rdma_cm in one process, the responder sleeping on its channel while no
 * other thread of it polls:
 *   1. armed solicited-only, in ibv_get_cq_event: each group of three
 *      plain Sends and one IBV_SEND_SOLICITED Send wakes it exactly once,
 *      and the event finds all four receives completed;
 *   2. armed for any completion, in poll(2) on the channel fd, then
 *      ibv_get_cq_event: every Send wakes it, and its own reply's
 *      completion does too.
 *   3. ibv_destroy_cq waits until every event read is acked, as
 *      rdma-core's ibv_cmd_destroy_cq does (comp_events_completed);
 *   4. a thread asleep in ibv_get_cq_event: a signal whose handler has
 *      SA_RESTART does not end the wait (libibverbs' read(2) restarts),
 *      one without SA_RESTART ends it with EINTR.
 *   5. a channel fd made non-blocking (as libfabric's verbs provider
 *      does before it reads events until EAGAIN): ibv_get_cq_event on an
 *      empty channel fails at once with EAGAIN, returns the event once
 *      poll(2) says the fd is readable, then fails with EAGAIN again.
 *   6. an event the waiting thread fires itself (stag keeps it in memory
 *      while nobody can be watching the fd): ibv_get_cq_event from another
 *      thread returns it; poll(2), select(2) and epoll on a blocking channel
 *      fd, each asked after the event fired, see the fd readable; and a
 *      thread already asleep in poll(2) on the fd is woken by the next one.
 * The requester waits for a reply before each group, so every wake-up is
 * caused by an arrival that came while the responder slept. A missed
 * wake-up fails a 10 s poll (or the 60 s alarm). Run under `stag run`.
 * Prints "cq_events: N passed, M failed".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TEST_NAME "cq_events"
#include "stag_test.h"

#define GROUPS 50
#define PINGS 50

static void post_recv(struct ibv_qp *qp, struct ibv_mr *mr, uint64_t id)
{
	struct ibv_sge s = { (uintptr_t)mr->addr, 64, mr->lkey };
	struct ibv_recv_wr w = { .wr_id = id, .sg_list = &s, .num_sge = 1 }, *bad;
	if (ibv_post_recv(qp, &w, &bad))
		DIE("post_recv");
}

static void post_send(struct ibv_qp *qp, struct ibv_mr *mr, uint64_t id, int flags)
{
	struct ibv_sge s = { (uintptr_t)mr->addr, 8, mr->lkey };
	struct ibv_send_wr w = { .wr_id = id, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND,
				 .send_flags = IBV_SEND_SIGNALED | flags }, *bad;
	if (ibv_post_send(qp, &w, &bad))
		DIE("post_send");
}

/* Take one event of `cq` from `ch` and acknowledge it. */
static int take_event(struct ibv_comp_channel *ch, struct ibv_cq *cq)
{
	struct ibv_cq *ev_cq;
	void *ctx;
	if (ibv_get_cq_event(ch, &ev_cq, &ctx))
		return 0;
	ibv_ack_cq_events(ev_cq, 1);
	return ev_cq == cq && ctx == (void *)0x5e;
}

/* Drain `cq` into counts: receives, sends. */
static void drain(struct ibv_cq *cq, int *recvs, int *sends, int *bad)
{
	struct ibv_wc wc[8];
	int n;
	while ((n = ibv_poll_cq(cq, 8, wc)) > 0)
		for (int i = 0; i < n; i++) {
			if (wc[i].status != IBV_WC_SUCCESS)
				(*bad)++;
			else if (wc[i].opcode == IBV_WC_RECV)
				(*recvs)++;
			else
				(*sends)++;
		}
}

static void *responder(void *arg)
{
	(void)arg;
	struct test_conn c = { 0 };
	test_conn_serve_one(&c);
	struct rdma_cm_id *id = c.id;
	struct ibv_pd *pd = c.pd = ibv_alloc_pd(id->verbs);
	struct ibv_comp_channel *cc = ibv_create_comp_channel(id->verbs);
	struct ibv_cq *cq = c.cq = cc ? ibv_create_cq(id->verbs, 512, (void *)0x5e, cc, 0) : NULL;
	struct ibv_qp_init_attr qa = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
				       .cap = { 16, 4 * GROUPS + PINGS, 1, 1, 0 } };
	if (!pd || !cq || rdma_create_qp(id, pd, &qa))
		DIE("responder qp");
	char *buf = calloc(1, 64);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 64, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		DIE("reg_mr");
	for (int i = 0; i < 4 * GROUPS + PINGS; i++)
		post_recv(id->qp, mr, i);
	/* Armed before the connection exists: the first group must wake us. */
	if (ibv_req_notify_cq(cq, 1))
		DIE("req_notify");
	struct rdma_conn_param cp = { .responder_resources = 1, .initiator_depth = 1 };
	if (rdma_accept(id, &cp))
		DIE("accept");
	test_conn_established(&c, NULL, 0);

	/* 1: solicited-only, sleeping in ibv_get_cq_event. */
	int recvs = 0, sends = 0, bad = 0, wakes = 0, short_wakes = 0;
	for (int g = 0; g < GROUPS; g++) {
		CHECK(take_event(cc, cq), "group %d: an event naming our CQ", g);
		wakes++;
		if (ibv_req_notify_cq(cq, 1))
			DIE("req_notify");
		int before = recvs;
		drain(cq, &recvs, &sends, &bad);
		/* All four are complete when the solicited one is. */
		if (recvs - before != 4)
			short_wakes++;
		post_send(id->qp, mr, 1000 + g, 0);
	}
	CHECK(wakes == GROUPS && short_wakes == 0 && bad == 0,
	      "solicited-only: %d wake-ups for %d groups, %d short, %d errors", wakes, GROUPS,
	      short_wakes, bad);
	/* Reap the replies' completions (they fired nothing while armed
	 * solicited-only: a successful send is not solicited). */
	struct pollfd pfd = { .fd = cc->fd, .events = POLLIN };
	CHECK(poll(&pfd, 1, 0) == 0, "no event for the replies' completions");
	drain(cq, &recvs, &sends, &bad);

	/* 2: any completion, in poll(2) on the channel fd. */
	if (ibv_req_notify_cq(cq, 0))
		DIE("req_notify");
	/* A ping that came before the arming fired nothing: poll once. Every
	 * ping received is answered once, whichever drain found it. */
	drain(cq, &recvs, &sends, &bad);
	int replied = 0;
	for (; replied < recvs - 4 * GROUPS; replied++)
		post_send(id->qp, mr, 2000 + replied, 0);
	int want = 4 * GROUPS + PINGS, missed = 0;
	while (recvs < want) {
		pfd.revents = 0;
		if (poll(&pfd, 1, 10000) != 1) {
			/* Tell a completion that fired nothing from one that
			 * was never delivered. */
			int queued = recvs;
			drain(cq, &recvs, &sends, &bad);
			fprintf(stderr, "cq_events: no event in 10 s; %d receives were queued\n",
				recvs - queued);
			missed++;
			break;
		}
		if (!take_event(cc, cq))
			bad++;
		if (ibv_req_notify_cq(cq, 0))
			DIE("req_notify");
		drain(cq, &recvs, &sends, &bad);
		for (; replied < recvs - 4 * GROUPS; replied++)
			post_send(id->qp, mr, 2000 + replied, 0);
	}
	CHECK(missed == 0 && recvs == want && bad == 0,
	      "any completion: %d of %d receives, %d missed wake-ups, %d errors", recvs, want,
	      missed, bad);
	rdma_ack_cm_event(expect_event(c.ch, RDMA_CM_EVENT_DISCONNECTED));
	rdma_destroy_qp(id);
	drain(cq, &recvs, &sends, &bad);
	ibv_dereg_mr(mr);
	ibv_destroy_cq(cq);
	c.cq = NULL;
	CHECK(ibv_destroy_comp_channel(cc) == 0, "destroy_comp_channel");
	test_conn_destroy(&c);
	free(buf);
	return NULL;
}

/* 3 and 4: a channel and an RC QP of their own, no connection: the QP in
 * Error flushes each receive posted, a completion that fires the armed
 * CQ. */
struct chan {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_comp_channel *cc;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	char buf[64];
};

static void chan_open(struct chan *c)
{
	c->ctx = open_stag0();
	c->pd = ibv_alloc_pd(c->ctx);
	c->cc = ibv_create_comp_channel(c->ctx);
	c->cq = c->cc ? ibv_create_cq(c->ctx, 16, (void *)0x5e, c->cc, 0) : NULL;
	if (!c->pd || !c->cq)
		DIE("channel cq");
	struct ibv_qp_init_attr qa = { .send_cq = c->cq, .recv_cq = c->cq,
				       .qp_type = IBV_QPT_RC, .cap = { 4, 4, 1, 1, 0 } };
	c->qp = ibv_create_qp(c->pd, &qa);
	c->mr = ibv_reg_mr(c->pd, c->buf, sizeof c->buf, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	if (!c->qp || !c->mr || ibv_modify_qp(c->qp, &a, IBV_QP_STATE))
		DIE("qp in error");
}

/* Arm the CQ and complete one (flushed) receive: one event. */
static void chan_fire(struct chan *c)
{
	if (ibv_req_notify_cq(c->cq, 0))
		DIE("req_notify");
	post_recv(c->qp, c->mr, 77);
}

static void chan_close(struct chan *c)
{
	ibv_destroy_qp(c->qp);
	ibv_dereg_mr(c->mr);
	ibv_destroy_cq(c->cq);
	ibv_destroy_comp_channel(c->cc);
	ibv_dealloc_pd(c->pd);
	ibv_close_device(c->ctx);
}

static volatile sig_atomic_t destroyed, handled;
static int destroy_rc = -1;

static void *destroy_thread(void *arg)
{
	destroy_rc = ibv_destroy_cq(arg);
	destroyed = 1;
	return NULL;
}

static void sleep_ms(int ms)
{
	struct timespec t = { ms / 1000, (ms % 1000) * 1000000L };
	nanosleep(&t, NULL);
}

/* 3: the event read, not acked: ibv_destroy_cq returns only after the ack. */
static void destroy_waits_for_ack(void)
{
	struct chan c;
	struct ibv_cq *ev_cq;
	struct ibv_wc wc;
	void *ctx;
	chan_open(&c);
	chan_fire(&c);
	CHECK(ibv_get_cq_event(c.cc, &ev_cq, &ctx) == 0 && ev_cq == c.cq,
	      "destroy_cq: an event read");
	while (ibv_poll_cq(c.cq, 1, &wc) == 1)
		;
	ibv_destroy_qp(c.qp);
	pthread_t t;
	if (pthread_create(&t, NULL, destroy_thread, c.cq))
		DIE("thread");
	/* Not a timing test: a destroy that did not wait returns at once. */
	sleep_ms(300);
	CHECK(!destroyed, "destroy_cq: waits while an event read is not acked");
	ibv_ack_cq_events(ev_cq, 1);
	pthread_join(t, NULL);
	CHECK(destroyed && destroy_rc == 0, "destroy_cq: returns 0 once it is acked (%d)",
	      destroy_rc);
	ibv_dereg_mr(c.mr);
	ibv_destroy_comp_channel(c.cc);
	ibv_dealloc_pd(c.pd);
	ibv_close_device(c.ctx);
}

static void on_signal(int sig)
{
	(void)sig;
	handled++;
}

static struct chan *waiting_on;
static volatile sig_atomic_t wait_done;
static int wait_rc, wait_errno;

static void *wait_thread(void *arg)
{
	(void)arg;
	struct ibv_cq *ev_cq;
	void *ctx;
	wait_rc = ibv_get_cq_event(waiting_on->cc, &ev_cq, &ctx);
	wait_errno = errno;
	if (wait_rc == 0)
		ibv_ack_cq_events(ev_cq, 1);
	wait_done = 1;
	return NULL;
}

/* 4: SA_RESTART restarts the wait; without it, EINTR. */
static void signal_during_wait(void)
{
	struct chan c;
	struct ibv_wc wc;
	struct sigaction sa = { .sa_handler = on_signal, .sa_flags = SA_RESTART };
	pthread_t t;
	chan_open(&c);
	waiting_on = &c;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGUSR1, &sa, NULL);
	if (ibv_req_notify_cq(c.cq, 0))
		DIE("req_notify");
	wait_done = 0;
	if (pthread_create(&t, NULL, wait_thread, NULL))
		DIE("thread");
	sleep_ms(100);
	pthread_kill(t, SIGUSR1);
	sleep_ms(300);
	CHECK(handled == 1 && !wait_done,
	      "SA_RESTART: the handler ran (%d) and ibv_get_cq_event still waits (rc %d, %s)",
	      (int)handled, wait_rc, wait_done ? strerror(wait_errno) : "-");
	post_recv(c.qp, c.mr, 78);
	pthread_join(t, NULL);
	CHECK(wait_rc == 0, "SA_RESTART: then the completion's event (rc %d)", wait_rc);
	while (ibv_poll_cq(c.cq, 1, &wc) == 1)
		;

	sa.sa_flags = 0;
	sigaction(SIGUSR2, &sa, NULL);
	if (ibv_req_notify_cq(c.cq, 0))
		DIE("req_notify");
	wait_done = 0;
	if (pthread_create(&t, NULL, wait_thread, NULL))
		DIE("thread");
	sleep_ms(100);
	pthread_kill(t, SIGUSR2);
	pthread_join(t, NULL);
	CHECK(handled == 2 && wait_rc == -1 && wait_errno == EINTR,
	      "no SA_RESTART: ibv_get_cq_event fails with EINTR (rc %d, %s)", wait_rc,
	      strerror(wait_errno));
	signal(SIGUSR1, SIG_DFL);
	signal(SIGUSR2, SIG_DFL);
	chan_close(&c);
}

/* 5: a non-blocking channel answers EAGAIN instead of sleeping. */
static void nonblocking_channel(void)
{
	struct chan c;
	struct ibv_cq *ev_cq = NULL;
	void *ctx;
	chan_open(&c);
	int fl = fcntl(c.cc->fd, F_GETFL);
	if (fl < 0 || fcntl(c.cc->fd, F_SETFL, fl | O_NONBLOCK))
		DIE("O_NONBLOCK");
	if (ibv_req_notify_cq(c.cq, 0))
		DIE("req_notify");
	/* A blocking wait here would hang until the 60 s alarm. */
	errno = 0;
	int rc = ibv_get_cq_event(c.cc, &ev_cq, &ctx);
	CHECK(rc == -1 && errno == EAGAIN, "non-blocking: an empty channel gives EAGAIN (%d, %s)",
	      rc, strerror(errno));
	post_recv(c.qp, c.mr, 77); /* flushed: one completion, one event */
	struct pollfd pfd = { .fd = c.cc->fd, .events = POLLIN };
	int got = -1;
	for (int i = 0; i < 100 && got != 0; i++) {
		poll(&pfd, 1, 100);
		got = ibv_get_cq_event(c.cc, &ev_cq, &ctx);
		CHECK(got == 0 || errno == EAGAIN, "non-blocking: only EAGAIN while waiting (%s)",
		      strerror(errno));
	}
	CHECK(got == 0 && ev_cq == c.cq, "non-blocking: the event arrives");
	if (got == 0)
		ibv_ack_cq_events(ev_cq, 1);
	struct ibv_wc wc;
	CHECK(ibv_poll_cq(c.cq, 1, &wc) == 1 && wc.status == IBV_WC_WR_FLUSH_ERR,
	      "non-blocking: its completion is there");
	errno = 0;
	rc = ibv_get_cq_event(c.cc, &ev_cq, &ctx);
	CHECK(rc == -1 && errno == EAGAIN, "non-blocking: drained, EAGAIN again (%d)", rc);
	chan_close(&c);
}

/*
 * 5b: the channel's blocking mode follows every change the program makes:
 * ioctl(FIONBIO) makes it non-blocking, and clearing O_NONBLOCK again
 * makes ibv_get_cq_event sleep until the event comes (stag tracks the
 * flag instead of asking the kernel on every wait).
 */
static void blocking_mode_follows_the_fd(void)
{
	struct chan c;
	struct ibv_cq *ev_cq = NULL;
	void *ctx;
	chan_open(&c);
	int on = 1;
	if (ioctl(c.cc->fd, FIONBIO, &on))
		DIE("FIONBIO");
	if (ibv_req_notify_cq(c.cq, 0))
		DIE("req_notify");
	errno = 0;
	int rc = ibv_get_cq_event(c.cc, &ev_cq, &ctx);
	CHECK(rc == -1 && errno == EAGAIN, "FIONBIO: an empty channel gives EAGAIN (%d, %s)", rc,
	      strerror(errno));
	int fl = fcntl(c.cc->fd, F_GETFL);
	if (fl < 0 || fcntl(c.cc->fd, F_SETFL, fl & ~O_NONBLOCK))
		DIE("clear O_NONBLOCK");
	/* Blocking again: the wait sleeps until the receive is flushed. */
	waiting_on = &c;
	wait_done = 0;
	pthread_t t;
	if (pthread_create(&t, NULL, wait_thread, NULL))
		DIE("thread");
	sleep_ms(100);
	CHECK(!wait_done, "blocking again: the wait sleeps on an empty channel (rc %d, %s)",
	      wait_rc, strerror(wait_errno));
	post_recv(c.qp, c.mr, 78); /* flushed: one completion, one event */
	pthread_join(t, NULL);
	CHECK(wait_rc == 0, "blocking again: the event wakes the wait (%d, %s)", wait_rc,
	      strerror(wait_errno));
	struct ibv_wc wc;
	CHECK(ibv_poll_cq(c.cq, 1, &wc) == 1 && wc.status == IBV_WC_WR_FLUSH_ERR,
	      "blocking again: its completion is there");
	on = 1;
	if (ioctl(c.cc->fd, FIONBIO, &on) || ibv_req_notify_cq(c.cq, 0))
		DIE("FIONBIO again");
	errno = 0;
	rc = ibv_get_cq_event(c.cc, &ev_cq, &ctx);
	CHECK(rc == -1 && errno == EAGAIN, "FIONBIO again: EAGAIN (%d, %s)", rc, strerror(errno));
	chan_close(&c);
}

static void *take_event_thread(void *arg)
{
	struct chan *c = arg;
	return (void *)(intptr_t)take_event(c->cc, c->cq);
}

static void *poll_thread(void *arg)
{
	struct chan *c = arg;
	struct pollfd pfd = { .fd = c->cc->fd, .events = POLLIN };
	return (void *)(intptr_t)(poll(&pfd, 1, 10000) == 1);
}

/* 6: events fired by the thread itself, then looked for elsewhere. */
static void own_events(void)
{
	struct chan c;
	void *r = NULL;
	pthread_t t;
	chan_open(&c);
	chan_fire(&c);
	if (pthread_create(&t, NULL, take_event_thread, &c) || pthread_join(t, &r))
		DIE("thread");
	CHECK(r != NULL, "own event: another thread's ibv_get_cq_event takes it");
	struct ibv_wc wc;
	while (ibv_poll_cq(c.cq, 1, &wc) == 1)
		;
	chan_close(&c);

	/* poll(2), select(2), epoll: each on a fresh channel, never watched. */
	for (int how = 0; how < 3; how++) {
		static const char *const name[] = { "poll", "select", "epoll" };
		chan_open(&c);
		chan_fire(&c);
		int seen = 0;
		if (how == 0) {
			struct pollfd pfd = { .fd = c.cc->fd, .events = POLLIN };
			seen = poll(&pfd, 1, 10000) == 1;
		} else if (how == 1) {
			fd_set rs;
			FD_ZERO(&rs);
			FD_SET(c.cc->fd, &rs);
			struct timeval tv = { 10, 0 };
			seen = select(c.cc->fd + 1, &rs, NULL, NULL, &tv) == 1;
		} else {
			int ep = epoll_create1(EPOLL_CLOEXEC);
			struct epoll_event ev = { .events = EPOLLIN }, out;
			seen = ep >= 0 && !epoll_ctl(ep, EPOLL_CTL_ADD, c.cc->fd, &ev) &&
			       epoll_wait(ep, &out, 1, 10000) == 1;
			if (ep >= 0)
				close(ep);
		}
		CHECK(seen, "own event: %s on the channel fd sees it", name[how]);
		CHECK(take_event(c.cc, c.cq), "own event: then ibv_get_cq_event returns it (%s)",
		      name[how]);
		while (ibv_poll_cq(c.cq, 1, &wc) == 1)
			;
		chan_close(&c);
	}

	/* A thread asleep in poll(2) first, then the event. */
	chan_open(&c);
	if (pthread_create(&t, NULL, poll_thread, &c))
		DIE("thread");
	sleep_ms(100);
	chan_fire(&c);
	if (pthread_join(t, &r))
		DIE("join");
	CHECK(r != NULL, "own event: wakes a thread already in poll(2)");
	CHECK(take_event(c.cc, c.cq), "own event: then ibv_get_cq_event returns it");
	chan_close(&c);
}

/* 7: a CQ destroyed with an event unread takes it along, as the kernel's
 * does: a later ibv_get_cq_event gives the live CQ's event, never the
 * freed one's, and the channel is not readable for the dropped one. */
static void destroyed_cq_takes_its_events(void)
{
	struct chan c;
	chan_open(&c);
	struct ibv_cq *cq2 = ibv_create_cq(c.ctx, 16, (void *)0x6e, c.cc, 0);
	struct ibv_qp_init_attr qa = { .send_cq = cq2, .recv_cq = cq2,
				       .qp_type = IBV_QPT_RC, .cap = { 4, 4, 1, 1, 0 } };
	struct ibv_qp *qp2 = cq2 ? ibv_create_qp(c.pd, &qa) : NULL;
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	if (!qp2 || ibv_modify_qp(qp2, &a, IBV_QP_STATE))
		DIE("second cq");
	chan_fire(&c); /* an event of c.cq, left unread */
	struct pollfd pfd = { .fd = c.cc->fd, .events = POLLIN };
	CHECK(poll(&pfd, 1, 5000) == 1, "destroyed cq: its event is in the channel");
	ibv_destroy_qp(c.qp);
	CHECK(ibv_destroy_cq(c.cq) == 0, "destroyed cq: destroyed with an event unread");
	CHECK(poll(&pfd, 1, 0) == 0, "destroyed cq: the channel is no longer readable");
	if (ibv_req_notify_cq(cq2, 0))
		DIE("req_notify");
	post_recv(qp2, c.mr, 78);
	struct ibv_cq *ev_cq = NULL;
	void *ctx = NULL;
	CHECK(ibv_get_cq_event(c.cc, &ev_cq, &ctx) == 0 && ev_cq == cq2 && ctx == (void *)0x6e,
	      "destroyed cq: the next event is the live cq's (%p, not %p)", (void *)ev_cq,
	      (void *)c.cq);
	if (ev_cq == cq2)
		ibv_ack_cq_events(cq2, 1);
	ibv_destroy_qp(qp2);
	ibv_dereg_mr(c.mr);
	ibv_destroy_cq(cq2);
	ibv_destroy_comp_channel(c.cc);
	ibv_dealloc_pd(c.pd);
	ibv_close_device(c.ctx);
}

int main(void)
{
	alarm(60);
	pthread_t t;
	if (pthread_create(&t, NULL, responder, NULL))
		DIE("thread");
	struct test_conn c = { 0 };
	test_conn_resolve(&c, wait_port());
	struct rdma_cm_id *id = c.id;
	struct ibv_pd *pd = c.pd = ibv_alloc_pd(id->verbs);
	struct ibv_cq *cq = c.cq = ibv_create_cq(id->verbs, 512, NULL, NULL, 0);
	struct ibv_qp_init_attr qa = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
				       .cap = { 16, GROUPS + PINGS, 1, 1, 0 } };
	if (!pd || !cq || rdma_create_qp(id, pd, &qa))
		DIE("create_qp");
	char *buf = calloc(1, 64);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 64, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		DIE("reg_mr");
	for (int i = 0; i < GROUPS + PINGS; i++)
		post_recv(id->qp, mr, 5000 + i);
	struct rdma_conn_param cp = { .responder_resources = 1, .initiator_depth = 1 };
	if (rdma_connect(id, &cp))
		DIE("connect");
	test_conn_established(&c, NULL, 0);

	struct ibv_wc wc[8];
	int ok = 1;
	for (int g = 0; g < GROUPS && ok; g++) {
		for (int k = 0; k < 4; k++)
			post_send(id->qp, mr, 10 * g + k, k == 3 ? IBV_SEND_SOLICITED : 0);
		/* Four send completions and the reply. */
		ok = poll_cq_for(cq, wc, 5, 30, 0) == 5;
		for (int i = 0; i < 5 && ok; i++)
			ok = wc[i].status == IBV_WC_SUCCESS;
	}
	CHECK(ok, "solicited groups answered");
	for (int p = 0; p < PINGS && ok; p++) {
		post_send(id->qp, mr, 100000 + p, 0);
		ok = poll_cq_for(cq, wc, 2, 30, 0) == 2 && wc[0].status == IBV_WC_SUCCESS &&
		     wc[1].status == IBV_WC_SUCCESS;
	}
	CHECK(ok, "pings answered");

	rdma_disconnect(id);
	pthread_join(t, NULL);
	rdma_destroy_qp(id);
	ibv_dereg_mr(mr);
	test_conn_destroy(&c);
	free(buf);
	destroy_waits_for_ack();
	signal_during_wait();
	nonblocking_channel();
	blocking_mode_follows_the_fd();
	own_events();
	destroyed_cq_takes_its_events();
	return test_summary();
}
