/*
 * rdma_cm behaviours stag's cm lacked (#19), one process, one thread, run
 * under `stag run`:
 *
 *   cc -Wall -Wextra -Werror -I../../../tests/c -o cm_gaps cm_gaps.c -lrdmacm -libverbs
 *   stag run -- ./cm_gaps
 *
 * - qp_num: both sides connect a QP made with ibv_create_qp (id->qp NULL),
 *   naming it by conn_param->qp_num, and move it through INIT/RTR/RTS
 *   themselves, as with the kernel's cm; a Send crosses it. A qp_num that
 *   names no QP is EINVAL.
 * - disconnect-connecting: rdma_disconnect while the peer has not answered
 *   the connect (a TCP listener that never speaks MPA): DISCONNECTED still
 *   arrives, at once, and nothing else after it.
 *
 * `cm_gaps route-timeout ADDR CMD`: ADDR's next hop resolves (a
 * permanent neighbour entry) and never answers ARP; CMD, run between
 * rdma_resolve_addr and rdma_resolve_route, deletes the entry: route
 * resolution then waits for ARP and ends in ROUTE_ERROR (-ETIMEDOUT) once
 * its timeout passes (root, in a network namespace of its own).
 *
 * Prints "cm_gaps: N passed, M failed".
 */
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <rdma/rdma_cma.h>

#define TEST_NAME "cm_gaps"
#include "stag_test.h"

static double now_ms(void)
{
	return now_s() * 1e3;
}

/* The next event of `ch` within `ms`, or NULL. */
static struct rdma_cm_event *event_within(struct rdma_event_channel *ch, int ms)
{
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	struct rdma_cm_event *ev;

	if (poll(&pfd, 1, ms) != 1)
		return NULL;
	if (rdma_get_cm_event(ch, &ev))
		return NULL;
	return ev;
}

/* Wait for an event of `type` (5 s); kept in *out if asked, else acked. */
static int expect(struct rdma_event_channel *ch, enum rdma_cm_event_type type,
		  struct rdma_cm_event **out)
{
	struct rdma_cm_event *ev = event_within(ch, 5000);

	if (!ev) {
		fprintf(stderr, "no event (wanted %s)\n", rdma_event_str(type));
		return -1;
	}
	if (ev->event != type) {
		fprintf(stderr, "got %s (status %d), wanted %s\n",
			rdma_event_str(ev->event), ev->status, rdma_event_str(type));
		rdma_ack_cm_event(ev);
		return -1;
	}
	if (out)
		*out = ev;
	else
		rdma_ack_cm_event(ev);
	return 0;
}

static struct rdma_event_channel *channel(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();

	if (ch)
		fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK);
	return ch;
}

static struct sockaddr_in loopback(int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };

	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	return a;
}

/* Resolve `id` to 127.0.0.1:port. */
static int resolve(struct rdma_cm_id *id, struct rdma_event_channel *ch, int port)
{
	struct sockaddr_in dst = loopback(port);

	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) ||
	    expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, NULL))
		return -1;
	if (rdma_resolve_route(id, 2000) ||
	    expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, NULL))
		return -1;
	return 0;
}

/* What one side made itself: PD, CQ, QP and a registered buffer. */
struct side {
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	char buf[64];
};

static int make_side(struct side *s, struct ibv_context *verbs)
{
	struct ibv_qp_init_attr init = { .qp_type = IBV_QPT_RC,
					 .cap = { .max_send_wr = 4,
						  .max_recv_wr = 4,
						  .max_send_sge = 1,
						  .max_recv_sge = 1 } };

	s->pd = ibv_alloc_pd(verbs);
	s->cq = s->pd ? ibv_create_cq(verbs, 8, NULL, NULL, 0) : NULL;
	if (!s->cq)
		return -1;
	init.send_cq = init.recv_cq = s->cq;
	s->qp = ibv_create_qp(s->pd, &init);
	s->mr = s->qp ? ibv_reg_mr(s->pd, s->buf, sizeof(s->buf),
				   IBV_ACCESS_LOCAL_WRITE) :
			NULL;
	return s->mr ? 0 : -1;
}

static void free_side(struct side *s)
{
	if (s->mr)
		ibv_dereg_mr(s->mr);
	if (s->qp)
		ibv_destroy_qp(s->qp);
	if (s->cq)
		ibv_destroy_cq(s->cq);
	if (s->pd)
		ibv_dealloc_pd(s->pd);
}

/* Move the QP to `state` with the attributes the cm gives for it. */
static int move_qp(struct rdma_cm_id *id, struct ibv_qp *qp, enum ibv_qp_state state)
{
	struct ibv_qp_attr a = { .qp_state = state };
	int mask;

	if (rdma_init_qp_attr(id, &a, &mask))
		return -1;
	return ibv_modify_qp(qp, &a, mask) ? -1 : 0;
}

/* One completion of `cq` within 5 s, with status success. */
static int one_completion(struct ibv_cq *cq, struct ibv_wc *wc)
{
	double end = now_ms() + 5000;

	while (now_ms() < end) {
		int n = ibv_poll_cq(cq, 1, wc);

		if (n < 0)
			return -1;
		if (n == 1)
			return wc->status == IBV_WC_SUCCESS ? 0 : -1;
		usleep(100);
	}
	return -1;
}

static void qp_num(void)
{
	struct rdma_event_channel *sch = channel(), *cch = channel();
	struct rdma_cm_id *listen = NULL, *client = NULL, *child = NULL;
	struct sockaddr_in any = loopback(0);
	struct side srv = { 0 }, cli = { 0 };
	struct rdma_cm_event *ev;
	struct rdma_conn_param cp = { .responder_resources = 1, .initiator_depth = 1 };
	struct ibv_sge sge;
	struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad_r;
	struct ibv_send_wr swr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1,
				   .opcode = IBV_WR_SEND,
				   .send_flags = IBV_SEND_SIGNALED },
			   *bad_s;
	struct ibv_wc wc;
	int port;

	if (!sch || !cch || rdma_create_id(sch, &listen, NULL, RDMA_PS_TCP) ||
	    rdma_bind_addr(listen, (struct sockaddr *)&any) || rdma_listen(listen, 4)) {
		CHECK(0, "qp_num: listener");
		return;
	}
	port = ntohs(rdma_get_src_port(listen));
	if (rdma_create_id(cch, &client, NULL, RDMA_PS_TCP) || resolve(client, cch, port) ||
	    make_side(&cli, client->verbs)) {
		CHECK(0, "qp_num: client id and QP");
		goto out;
	}
	CHECK(client->qp == NULL, "qp_num: the id has no QP of its own");
	CHECK(move_qp(client, cli.qp, IBV_QPS_INIT) == 0, "qp_num: client QP to INIT");

	cp.qp_num = cli.qp->qp_num + 1000;
	errno = 0;
	CHECK(rdma_connect(client, &cp) == -1 && errno == EINVAL,
	      "qp_num: a number that names no QP is EINVAL");

	cp.qp_num = cli.qp->qp_num;
	CHECK(rdma_connect(client, &cp) == 0, "qp_num: rdma_connect with the client's qp_num");
	if (expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST, &ev)) {
		CHECK(0, "qp_num: CONNECT_REQUEST");
		goto out;
	}
	child = ev->id;
	rdma_ack_cm_event(ev);
	if (make_side(&srv, child->verbs)) {
		CHECK(0, "qp_num: server QP");
		goto out;
	}
	CHECK(move_qp(child, srv.qp, IBV_QPS_INIT) == 0, "qp_num: server QP to INIT");
	sge = (struct ibv_sge){ .addr = (uintptr_t)srv.buf, .length = sizeof(srv.buf),
				.lkey = srv.mr->lkey };
	CHECK(ibv_post_recv(srv.qp, &rwr, &bad_r) == 0, "qp_num: server posts a Receive");
	cp.qp_num = srv.qp->qp_num;
	CHECK(rdma_accept(child, &cp) == 0, "qp_num: rdma_accept with the server's qp_num");
	CHECK(expect(cch, RDMA_CM_EVENT_ESTABLISHED, NULL) == 0, "qp_num: client ESTABLISHED");
	CHECK(expect(sch, RDMA_CM_EVENT_ESTABLISHED, NULL) == 0, "qp_num: server ESTABLISHED");
	/* The cm left the states to the application, as the kernel's does. */
	CHECK(move_qp(client, cli.qp, IBV_QPS_RTR) == 0 &&
		      move_qp(client, cli.qp, IBV_QPS_RTS) == 0,
	      "qp_num: client QP through RTR to RTS");
	CHECK(move_qp(child, srv.qp, IBV_QPS_RTR) == 0 &&
		      move_qp(child, srv.qp, IBV_QPS_RTS) == 0,
	      "qp_num: server QP through RTR to RTS");

	strcpy(cli.buf, "sent on a QP named by qp_num");
	sge = (struct ibv_sge){ .addr = (uintptr_t)cli.buf, .length = strlen(cli.buf) + 1,
				.lkey = cli.mr->lkey };
	CHECK(ibv_post_send(cli.qp, &swr, &bad_s) == 0, "qp_num: client posts a Send");
	CHECK(one_completion(cli.cq, &wc) == 0 && wc.wr_id == 2, "qp_num: the Send completes");
	CHECK(one_completion(srv.cq, &wc) == 0 && wc.wr_id == 1 &&
		      !strcmp(srv.buf, "sent on a QP named by qp_num"),
	      "qp_num: the server receives it");

	CHECK(rdma_disconnect(client) == 0, "qp_num: rdma_disconnect");
	CHECK(expect(cch, RDMA_CM_EVENT_DISCONNECTED, NULL) == 0, "qp_num: client DISCONNECTED");
	CHECK(expect(sch, RDMA_CM_EVENT_DISCONNECTED, NULL) == 0, "qp_num: server DISCONNECTED");
out:
	free_side(&cli);
	free_side(&srv);
	if (child)
		rdma_destroy_id(child);
	if (client)
		rdma_destroy_id(client);
	if (listen)
		rdma_destroy_id(listen);
	if (cch)
		rdma_destroy_event_channel(cch);
	if (sch)
		rdma_destroy_event_channel(sch);
}

static void disconnect_connecting(void)
{
	struct rdma_event_channel *ch = channel();
	struct rdma_cm_id *id = NULL;
	struct sockaddr_in any = loopback(0);
	socklen_t len = sizeof(any);
	struct ibv_qp_init_attr init = { .qp_type = IBV_QPT_RC,
					 .cap = { .max_send_wr = 1,
						  .max_recv_wr = 1,
						  .max_send_sge = 1,
						  .max_recv_sge = 1 } };
	struct rdma_conn_param cp = { .responder_resources = 1, .initiator_depth = 1 };
	struct rdma_cm_event *ev;
	double t0, took;
	/* Takes TCP connections (the kernel's backlog) and never answers. */
	int mute = socket(AF_INET, SOCK_STREAM, 0);

	if (mute < 0 || bind(mute, (struct sockaddr *)&any, sizeof(any)) ||
	    listen(mute, 4) || getsockname(mute, (struct sockaddr *)&any, &len)) {
		CHECK(0, "disconnect-connecting: a mute TCP listener");
		goto out;
	}
	if (!ch || rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) ||
	    resolve(id, ch, ntohs(any.sin_port)) || rdma_create_qp(id, NULL, &init)) {
		CHECK(0, "disconnect-connecting: id and QP");
		goto out;
	}
	CHECK(rdma_connect(id, &cp) == 0, "disconnect-connecting: rdma_connect");
	/* The TCP connection is up; the MPA Request gets no reply. */
	usleep(200 * 1000);
	CHECK(event_within(ch, 0) == NULL, "disconnect-connecting: no reply, no event yet");
	t0 = now_ms();
	CHECK(rdma_disconnect(id) == 0, "disconnect-connecting: rdma_disconnect");
	ev = event_within(ch, 3000);
	took = now_ms() - t0;
	CHECK(ev && ev->event == RDMA_CM_EVENT_DISCONNECTED,
	      "disconnect-connecting: DISCONNECTED arrives");
	CHECK(ev && took < 1000, "disconnect-connecting: at once (under 1 s)");
	if (ev) {
		if (ev->event != RDMA_CM_EVENT_DISCONNECTED)
			fprintf(stderr, "got %s (status %d)\n", rdma_event_str(ev->event),
				ev->status);
		rdma_ack_cm_event(ev);
	}
	/* The abandoned connect ends (the MPA timeout) without an event. */
	CHECK(event_within(ch, 500) == NULL, "disconnect-connecting: nothing after DISCONNECTED");
	rdma_destroy_qp(id);
out:
	if (id)
		rdma_destroy_id(id);
	if (ch)
		rdma_destroy_event_channel(ch);
	if (mute >= 0)
		close(mute);
}

static int route_timeout(const char *addr, const char *cmd)
{
	struct rdma_event_channel *ch = channel();
	struct rdma_cm_id *id = NULL;
	struct sockaddr_in dst = { .sin_family = AF_INET, .sin_port = htons(7471) };
	struct rdma_cm_event *ev;
	double t0, took;

	if (!ch || inet_pton(AF_INET, addr, &dst.sin_addr) != 1 ||
	    rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) {
		CHECK(0, "route-timeout: id");
		goto out;
	}
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0 &&
		      expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, NULL) == 0,
	      "route-timeout: the address resolves (its neighbour entry is valid)");
	CHECK(system(cmd) == 0, "route-timeout: the neighbour entry goes");
	t0 = now_ms();
	CHECK(rdma_resolve_route(id, 300) == 0, "route-timeout: rdma_resolve_route returns");
	ev = event_within(ch, 5000);
	took = now_ms() - t0;
	CHECK(ev && ev->event == RDMA_CM_EVENT_ROUTE_ERROR && ev->status == -ETIMEDOUT,
	      "route-timeout: ROUTE_ERROR with -ETIMEDOUT");
	CHECK(ev && took >= 290 && took < 3000, "route-timeout: once the timeout passed");
	if (ev) {
		if (ev->event != RDMA_CM_EVENT_ROUTE_ERROR)
			fprintf(stderr, "got %s (status %d) after %.0f ms\n",
				rdma_event_str(ev->event), ev->status, took);
		rdma_ack_cm_event(ev);
	}
	/* Back to address-resolved, as the kernel's id: a retry is allowed. */
	errno = 0;
	CHECK(rdma_resolve_route(id, 100) == 0, "route-timeout: a retry is allowed");
	ev = event_within(ch, 5000);
	CHECK(ev && ev->event == RDMA_CM_EVENT_ROUTE_ERROR, "route-timeout: and fails again");
	if (ev)
		rdma_ack_cm_event(ev);
out:
	if (id)
		rdma_destroy_id(id);
	if (ch)
		rdma_destroy_event_channel(ch);
	return test_summary();
}

int main(int argc, char **argv)
{
	if (argc == 4 && !strcmp(argv[1], "route-timeout"))
		return route_timeout(argv[2], argv[3]);
	qp_num();
	disconnect_connecting();
	return test_summary();
}
