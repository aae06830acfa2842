/*
 * rdma_cm under load on stag0, one process, one thread, through the
 * unmodified librdmacm API (run under `stag run`):
 *
 *   cc -Wall -Wextra -Werror -O1 -o cm_stress cm_stress.c -lrdmacm -libverbs
 *   stag run -- ./cm_stress [CYCLES]
 *
 * - CYCLES (default 2000) sequential connect/accept/disconnect cycles;
 * - 64 connects in flight at once to one listener;
 * - a listener destroyed and re-created on the same port, in a loop, with
 *   a connect to the port while no listener is there (perftest's order:
 *   it must be served by the re-created listener);
 * - a listener destroyed and not re-created: a connect is refused once
 *   the grace for a re-bind (3 s) has passed;
 * - a re-bind of the port as that grace ends: never EADDRINUSE;
 * - a connect that arrives between rdma_bind_addr and rdma_listen (qperf's
 *   order), which must wait for the listener;
 * - rdma_reject with private data;
 * - a connect to a port nobody listens on.
 *
 * Every connect must end ESTABLISHED, or REJECTED with status
 * -ECONNREFUSED where the peer rejected or nothing listened (what the
 * kernel's iWARP cm reports for both); nothing is retried. Prints
 * "cm_stress: N passed, M failed" and the time of each part.
 */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <rdma/rdma_cma.h>

#define CONCURRENT 64
#define LISTENER_LOOPS 100
#define GONE_LOOPS 1
#define REBIND_LOOPS 4
/* How long a destroyed listener waits for a re-bind (HANDOVER_GRACE in
 * provider/plugin/src/cm/listen.rs). */
#define GRACE_US 3000000L

#define TEST_NAME "cm_stress"
#include "stag_test.h"

static struct ibv_qp_init_attr qp_attr(void)
{
	struct ibv_qp_init_attr attr = {
		.cap = { .max_send_wr = 2, .max_recv_wr = 2,
			 .max_send_sge = 1, .max_recv_sge = 1 },
		.qp_type = IBV_QPT_RC,
	};
	return attr;
}

static void destroy(struct rdma_cm_id *id)
{
	if (id->qp)
		rdma_destroy_qp(id);
	rdma_destroy_id(id);
}

/* A client id with a QP, resolved to `dst`, not yet connected. */
static struct rdma_cm_id *client_id(struct rdma_event_channel *ch,
				    struct sockaddr_in *dst)
{
	struct ibv_qp_init_attr attr = qp_attr();
	struct rdma_cm_id *id;

	if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
		return NULL;
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)dst, 2000) ||
	    !check_event(ch, RDMA_CM_EVENT_ADDR_RESOLVED, NULL) ||
	    rdma_resolve_route(id, 2000) ||
	    !check_event(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, NULL) ||
	    rdma_create_qp(id, NULL, &attr)) {
		rdma_destroy_id(id);
		return NULL;
	}
	return id;
}

/* A listening id on 127.0.0.1:`port` (0: any), its port in *bound. */
static struct rdma_cm_id *listener(struct rdma_event_channel *ch, int port,
				   struct sockaddr_in *bound)
{
	struct sockaddr_in a = { .sin_family = AF_INET,
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
				 .sin_port = htons(port) };
	struct rdma_cm_id *id;

	if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
		return NULL;
	if (rdma_bind_addr(id, (struct sockaddr *)&a) || rdma_listen(id, 128)) {
		fprintf(stderr, "bind/listen on port %d: %s\n", port,
			strerror(errno));
		rdma_destroy_id(id);
		return NULL;
	}
	*bound = a;
	bound->sin_port = rdma_get_src_port(id);
	return id;
}

/* Accept the request of `ev` (acked here); the child id, or NULL. */
static struct rdma_cm_id *accept_request(struct rdma_cm_event *ev)
{
	struct ibv_qp_init_attr attr = qp_attr();
	struct rdma_cm_id *child = ev->id;
	struct rdma_conn_param p = { .responder_resources = 1,
				     .initiator_depth = 1 };
	int ok = !rdma_create_qp(child, NULL, &attr) && !rdma_accept(child, &p);

	rdma_ack_cm_event(ev);
	if (!ok) {
		destroy(child);
		return NULL;
	}
	return child;
}

/* One connection through listener channel `lch`: client connects, server
 * accepts, both see ESTABLISHED, client disconnects, both see
 * DISCONNECTED, both ids go. Returns 1 when all of it held. */
static int cycle(struct rdma_event_channel *lch, struct rdma_event_channel *cch,
		 struct sockaddr_in *dst)
{
	struct rdma_conn_param p = { .responder_resources = 1,
				     .initiator_depth = 1 };
	struct rdma_cm_id *c = client_id(cch, dst), *s = NULL;
	struct rdma_cm_event *ev;
	int ok = 0;

	if (!c)
		return 0;
	if (rdma_connect(c, &p))
		goto out;
	if (!check_event(lch, RDMA_CM_EVENT_CONNECT_REQUEST, &ev))
		goto out;
	s = accept_request(ev);
	if (!s || !check_event(cch, RDMA_CM_EVENT_ESTABLISHED, NULL) ||
	    !check_event(lch, RDMA_CM_EVENT_ESTABLISHED, NULL))
		goto out;
	if (rdma_disconnect(c) || !check_event(cch, RDMA_CM_EVENT_DISCONNECTED, NULL) ||
	    !check_event(lch, RDMA_CM_EVENT_DISCONNECTED, NULL))
		goto out;
	ok = 1;
out:
	if (s)
		destroy(s);
	destroy(c);
	return ok;
}

/* A connect to `dst` must end REJECTED with -ECONNREFUSED, carrying
 * `data` (of `len`) when set. */
static int refused(struct rdma_event_channel *cch, struct sockaddr_in *dst,
		   struct rdma_event_channel *lch, const char *data, int len)
{
	struct rdma_conn_param p = { .responder_resources = 1,
				     .initiator_depth = 1 };
	struct rdma_cm_id *c = client_id(cch, dst);
	struct rdma_cm_event *ev;
	int ok = 0;

	if (!c)
		return 0;
	if (rdma_connect(c, &p))
		goto out;
	if (lch) {
		/* The listener rejects with private data. */
		if (!check_event(lch, RDMA_CM_EVENT_CONNECT_REQUEST, &ev))
			goto out;
		struct rdma_cm_id *child = ev->id;
		int r = rdma_reject(child, data, len);

		rdma_ack_cm_event(ev);
		rdma_destroy_id(child);
		if (r)
			goto out;
	}
	if (!check_event(cch, RDMA_CM_EVENT_REJECTED, &ev))
		goto out;
	ok = ev->status == -ECONNREFUSED;
	if (!ok)
		fprintf(stderr, "REJECTED with status %d\n", ev->status);
	if (data) {
		ok = ok && ev->param.conn.private_data_len >= len &&
		     memcmp(ev->param.conn.private_data, data, len) == 0;
		if (!ok)
			fprintf(stderr, "rejection's private data lost\n");
	}
	rdma_ack_cm_event(ev);
out:
	destroy(c);
	return ok;
}

/* The order qperf uses: the port goes to the peer after rdma_bind_addr
 * and before rdma_listen, so the connect may arrive first. It must wait
 * for the listener, not be refused. */
static int connect_before_listen(struct rdma_event_channel *lch,
				 struct rdma_event_channel *cch)
{
	struct sockaddr_in a = { .sin_family = AF_INET,
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct rdma_conn_param p = { .responder_resources = 1,
				     .initiator_depth = 1 };
	struct timespec pause = { .tv_nsec = 20 * 1000 * 1000 };
	struct rdma_cm_id *l, *c = NULL, *s = NULL;
	struct rdma_cm_event *ev;
	int ok = 0;

	if (rdma_create_id(lch, &l, NULL, RDMA_PS_TCP))
		return 0;
	if (rdma_bind_addr(l, (struct sockaddr *)&a))
		goto out;
	a.sin_port = rdma_get_src_port(l);
	c = client_id(cch, &a);
	if (!c || rdma_connect(c, &p))
		goto out;
	/* Let the connect reach the port first. */
	nanosleep(&pause, NULL);
	if (rdma_listen(l, 0) ||
	    !check_event(lch, RDMA_CM_EVENT_CONNECT_REQUEST, &ev))
		goto out;
	s = accept_request(ev);
	ok = s && check_event(cch, RDMA_CM_EVENT_ESTABLISHED, NULL) &&
	     check_event(lch, RDMA_CM_EVENT_ESTABLISHED, NULL) &&
	     !rdma_disconnect(c) &&
	     check_event(cch, RDMA_CM_EVENT_DISCONNECTED, NULL) &&
	     check_event(lch, RDMA_CM_EVENT_DISCONNECTED, NULL);
out:
	if (s)
		destroy(s);
	if (c)
		destroy(c);
	rdma_destroy_id(l);
	return ok;
}

/* CONCURRENT connects in flight at once: every one ESTABLISHED on both
 * sides. */
static int concurrent(struct rdma_event_channel *lch,
		      struct rdma_event_channel *cch, struct sockaddr_in *dst)
{
	struct rdma_conn_param p = { .responder_resources = 1,
				     .initiator_depth = 1 };
	struct rdma_cm_id *c[CONCURRENT] = { 0 }, *s[CONCURRENT] = { 0 };
	int n = 0, accepted = 0, s_est = 0, c_est = 0, c_disc = 0, s_disc = 0;
	int ok = 1, i;

	for (i = 0; i < CONCURRENT; i++) {
		c[i] = client_id(cch, dst);
		if (!c[i] || rdma_connect(c[i], &p)) {
			fprintf(stderr, "concurrent connect %d: %s\n", i,
				strerror(errno));
			ok = 0;
			break;
		}
		n++;
	}
	/* Serve both channels until every connect is established. */
	while (ok && (s_est < n || c_est < n)) {
		struct pollfd pfd[2] = { { .fd = lch->fd, .events = POLLIN },
					 { .fd = cch->fd, .events = POLLIN } };
		struct rdma_cm_event *ev;

		if (poll(pfd, 2, 10000) <= 0) {
			fprintf(stderr, "concurrent: stuck at %d/%d/%d of %d\n",
				accepted, s_est, c_est, n);
			ok = 0;
			break;
		}
		if ((pfd[0].revents & POLLIN) && !rdma_get_cm_event(lch, &ev)) {
			if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST &&
			    accepted < n) {
				s[accepted] = accept_request(ev);
				ok = ok && s[accepted];
				accepted++;
			} else {
				if (ev->event == RDMA_CM_EVENT_ESTABLISHED)
					s_est++;
				else {
					fprintf(stderr, "listener: %s\n",
						rdma_event_str(ev->event));
					ok = 0;
				}
				rdma_ack_cm_event(ev);
			}
		}
		if ((pfd[1].revents & POLLIN) && !rdma_get_cm_event(cch, &ev)) {
			if (ev->event == RDMA_CM_EVENT_ESTABLISHED)
				c_est++;
			else {
				fprintf(stderr, "client: %s (status %d)\n",
					rdma_event_str(ev->event), ev->status);
				ok = 0;
			}
			rdma_ack_cm_event(ev);
		}
	}
	/* Every client disconnects; both sides see each go. */
	for (i = 0; ok && i < n; i++)
		ok = !rdma_disconnect(c[i]);
	while (ok && (c_disc < n || s_disc < n)) {
		struct rdma_event_channel *ch = c_disc < n ? cch : lch;

		ok = check_event(ch, RDMA_CM_EVENT_DISCONNECTED, NULL);
		if (ch == cch)
			c_disc++;
		else
			s_disc++;
	}
	for (i = 0; i < CONCURRENT; i++) {
		if (c[i])
			destroy(c[i]);
		if (s[i])
			destroy(s[i]);
	}
	return ok && s_est == CONCURRENT && c_est == CONCURRENT;
}

int main(int argc, char **argv)
{
	int cycles = argc > 1 ? atoi(argv[1]) : 2000;
	struct rdma_event_channel *lch = rdma_create_event_channel();
	struct rdma_event_channel *cch = rdma_create_event_channel();
	struct sockaddr_in dst;
	struct rdma_cm_id *l;
	double t;
	int i, ok;

	if (!lch || !cch) {
		fprintf(stderr, "rdma_create_event_channel: %s\n",
			strerror(errno));
		return 1;
	}
	l = listener(lch, 0, &dst);
	if (!l)
		return 1;

	t = now_s();
	for (i = 0, ok = 0; i < cycles; i++) {
		int r = cycle(lch, cch, &dst);

		ok += r;
		if (!r)
			fprintf(stderr, "cycle %d failed\n", i);
	}
	CHECK(ok == cycles, "sequential connect/disconnect cycles");
	printf("cm_stress: %d sequential cycles: %d ok in %.2f s\n", cycles, ok,
	       now_s() - t);

	t = now_s();
	CHECK(concurrent(lch, cch, &dst), "64 concurrent connects");
	printf("cm_stress: %d concurrent connects in %.2f s\n", CONCURRENT,
	       now_s() - t);

	t = now_s();
	for (i = 0, ok = 0; i < 20; i++)
		ok += connect_before_listen(lch, cch);
	CHECK(ok == 20, "a connect between rdma_bind_addr and rdma_listen");
	printf("cm_stress: 20 connects before rdma_listen: %d ok in %.2f s\n", ok,
	       now_s() - t);

	t = now_s();
	for (i = 0, ok = 0; i < 20; i++)
		ok += refused(cch, &dst, lch, "go away", 8);
	CHECK(ok == 20, "rdma_reject with private data");
	printf("cm_stress: 20 rejects with private data: %d ok in %.2f s\n", ok,
	       now_s() - t);

	/* The same port, its listener destroyed and made again: each time a
	 * connection through it, and one that arrives while no listener is
	 * there (perftest -R: its server destroys the listener of its first
	 * connection and listens again on the port only after a message
	 * exchange, while its client connects at once): it waits for the
	 * re-created listener, as a connect before rdma_listen does. */
	t = now_s();
	rdma_destroy_id(l);
	int port = ntohs(dst.sin_port), lok = 0, rok = 0, gok = 0, bok = 0;
	/* (The first listener's port was the kernel's pick; a listener bound
	 * to a port the program named is the one perftest re-creates.) */
	{
		struct sockaddr_in again;

		l = listener(lch, port, &again);
		CHECK(l != NULL, "listener on a named port");
		if (l)
			rdma_destroy_id(l);
	}

	for (i = 0; i < LISTENER_LOOPS; i++) {
		struct sockaddr_in again;
		struct rdma_conn_param p = { .responder_resources = 1,
					     .initiator_depth = 1 };
		struct rdma_cm_id *c = client_id(cch, &dst), *s = NULL;
		struct rdma_cm_event *ev;

		if (!c)
			break;
		/* The connect goes out while nobody listens (and, the first
		 * 20 times, has time to reach the port first). The first
		 * time the listener comes back only 1.3 s later: Debian's
		 * ib_write_bw -R sleeps 1 s between the destroy and its
		 * message exchange, then re-binds. */
		if (rdma_connect(c, &p)) {
			destroy(c);
			break;
		}
		if (i < 20) {
			struct timespec pause = { .tv_nsec = 20 * 1000 * 1000 };

			if (i == 0)
				pause = (struct timespec){ 1, 300 * 1000 * 1000 };
			nanosleep(&pause, NULL);
		}
		l = listener(lch, port, &again);
		if (!l) {
			destroy(c);
			break;
		}
		if (check_event(lch, RDMA_CM_EVENT_CONNECT_REQUEST, &ev))
			s = accept_request(ev);
		rok += s && check_event(cch, RDMA_CM_EVENT_ESTABLISHED, NULL) &&
		       check_event(lch, RDMA_CM_EVENT_ESTABLISHED, NULL) &&
		       !rdma_disconnect(c) &&
		       check_event(cch, RDMA_CM_EVENT_DISCONNECTED, NULL) &&
		       check_event(lch, RDMA_CM_EVENT_DISCONNECTED, NULL);
		if (s)
			destroy(s);
		destroy(c);
		lok += cycle(lch, cch, &dst);
		rdma_destroy_id(l);
	}
	CHECK(lok == LISTENER_LOOPS, "connect through a re-created listener");
	CHECK(rok == LISTENER_LOOPS,
	      "connect between a listener's destroy and its re-creation: ESTABLISHED");
	printf("cm_stress: %d listener re-creations: %d connected, %d connected while none listened in %.2f s\n",
	       LISTENER_LOOPS, lok, rok, now_s() - t);

	/* The listener gone for good: refused (after the grace a re-bind
	 * has). */
	t = now_s();
	for (i = 0; i < GONE_LOOPS; i++) {
		struct sockaddr_in again;

		l = listener(lch, port, &again);
		if (!l)
			break;
		rdma_destroy_id(l);
		gok += refused(cch, &dst, NULL, NULL, 0);
	}
	CHECK(gok == GONE_LOOPS, "connect with the listener gone: REJECTED");
	printf("cm_stress: %d connects with the listener gone: %d refused in %.2f s\n",
	       GONE_LOOPS, gok, now_s() - t);

	/* A re-bind as the grace ends (perftest's server, descheduled for
	 * about that long between its destroy and its re-bind): the retired
	 * listener is taken over, or its port is free; never EADDRINUSE (it
	 * was, when the re-bind came while the grace's end was closing the
	 * port). Around the grace's end, 1 ms apart. */
	t = now_s();
	for (i = 0; i < REBIND_LOOPS; i++) {
		struct sockaddr_in again;
		long us = GRACE_US - REBIND_LOOPS / 2 * 1000 + i * 1000;
		struct timespec pause = { us / 1000000, us % 1000000 * 1000 };

		l = listener(lch, port, &again);
		if (!l)
			break;
		rdma_destroy_id(l);
		nanosleep(&pause, NULL);
		l = listener(lch, port, &again);
		if (!l)
			break;
		rdma_destroy_id(l);
		bok++;
	}
	CHECK(bok == REBIND_LOOPS, "re-bind as the hand-over grace ends");
	printf("cm_stress: %d re-binds around the grace's end: %d bound in %.2f s\n",
	       REBIND_LOOPS, bok, now_s() - t);

	/* A port nobody listens on (nor bound). */
	{
		struct sockaddr_in none = dst;
		struct rdma_cm_id *probe;
		struct sockaddr_in b;

		/* A port that was just free: bind a listener, note it, drop it. */
		probe = listener(lch, 0, &b);
		CHECK(probe != NULL, "probe listener");
		if (probe) {
			none.sin_port = b.sin_port;
			rdma_destroy_id(probe);
			CHECK(refused(cch, &none, NULL, NULL, 0),
			      "connect to a port with no listener: REJECTED");
		}
	}

	rdma_destroy_event_channel(cch);
	rdma_destroy_event_channel(lch);
	return test_summary();
}
