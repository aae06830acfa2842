/*
 * Faults over stag0's libibverbs plugin: what a C program sees when its
 * peer dies or it tears things down with work in flight, run under
 * `stag run` (scripts/gate/rdma-core-apps.sh does). Each case connects to a
 * peer process (this program re-executed with --peer CASE) through
 * rdma_cm, and checks the completions and errnos verbs promises; the
 * program must survive every case (no signal, no crash).
 *
 *   faults [CASE...]      (no CASE: all of them)
 *
 * Prints "faults: N passed, M failed".
 *
 * Cases:
 *   sigpipe        a raw TCP peer stops us (SIGSTOP), sends a bad FPDU,
 *                  FIN and RST, and resumes us: stag answers the FPDU with
 *                  a Terminate, written to a socket that holds EPIPE. On a
 *                  plugin without MSG_NOSIGNAL that raises SIGPIPE every
 *                  time (exit 141); here the QP goes to Error instead.
 *   peer_close     the peer disconnects and exits while we stream RDMA
 *                  Writes: completions end in errors, posts after that
 *                  flush, and no signal kills us. (Whether stag writes
 *                  after the reset here depends on timing: `sigpipe` is
 *                  the deterministic check of MSG_NOSIGNAL.)
 *   kill_recv      the peer is killed while it streams RDMA Writes to us:
 *                  our posted Receives complete with IBV_WC_WR_FLUSH_ERR.
 *   dereg_inflight 16 x 4 MiB Sends posted while the peer is stopped,
 *                  then ibv_dereg_mr and munmap: the framed output leaves
 *                  as it was, the WR that cannot be sent completes with
 *                  IBV_WC_LOC_PROT_ERR, the rest flush; the peer receives
 *                  every message we saw succeed, intact (no CRC error).
 *   full_sq        posting beyond max_send_wr fails with ENOMEM.
 *   post_error     after the QP went to Error (ibv_modify_qp), posts
 *                  succeed and complete with IBV_WC_WR_FLUSH_ERR.
 *   destroy_clean  ibv_destroy_qp with completions queued and a Receive
 *                  posted: none of them is polled afterwards (mlx5's CQ
 *                  clean; libfabric's rxm counts on it).
 *   destroy_qp     ibv_destroy_qp with 16 x 4 MiB Writes in flight, then
 *                  dereg and munmap: nothing touches the memory again.
 *   async          ibv_get_async_event on a polled async_fd: COMM_EST once
 *                  connected, QP_FATAL when the peer sends a Terminate.
 *   async_destroy  ibv_destroy_qp waits for the ack of an event the
 *                  application read, and drops the QP's unread events.
 *   async_reset    the peer killed with our data unread resets the stream:
 *                  IBV_EVENT_QP_FATAL.
 *   async_disconnect  the peer's rdma_disconnect: DISCONNECTED, no QP_FATAL.
 *   async_last_wqe an SRQ QP moved to Error: IBV_EVENT_QP_LAST_WQE_REACHED,
 *                  once.
 *   async_cq_err   more completions than the CQ holds: IBV_EVENT_CQ_ERR.
 *   async_srq_limit  ibv_modify_srq(IBV_SRQ_LIMIT) arms the limit: once
 *                  fewer WRs remain, IBV_EVENT_SRQ_LIMIT_REACHED, disarmed.
 *   async_device_fatal  stag0's engine thread dies (a panic, injected with
 *                  STAG_FAULT_INJECT=engine-panic): IBV_EVENT_DEVICE_FATAL.
 *   fork           a child after fork(), without and with ibv_fork_init,
 *                  while Writes are in flight: the child has its copy of
 *                  registered memory (none with ibv_fork_init), stag0 does
 *                  not open in it, and the parent's connection carries on.
 *   exit_dirty     the peer exits with everything open: it exits promptly,
 *                  and we see DISCONNECTED and flushed Receives.
 *   busy           EBUSY from ibv_dealloc_pd with MRs/QPs/SRQs on it,
 *                  ibv_destroy_cq and ibv_destroy_srq while a QP uses them.
 *   log_flood      1001 identical warnings (STAG_LOG=warn) reach stderr
 *                  as the first 10, then one a second, each after a line
 *                  counting those suppressed.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TEST_NAME "faults"
#include "stag_test.h"

#define BIG (4u << 20) /* one large message */
#define NBIG 16

/* What the peer offers in its accept's private data. */
struct offer {
	uint64_t addr;
	uint32_t rkey;
};

/* One end of a connection. */
struct end {
	struct test_conn c; /* channel, ids, PD and CQ */
	struct offer peer;
	uint32_t sq_depth; /* max_send_wr as created */
	int want_srq;	   /* make_qp: the QP receives from a new SRQ */
	int cq_size;	   /* make_qp: the CQ's size (0: 4 x depth) */
	struct ibv_srq *srq;
};

static void make_qp(struct end *e, int depth)
{
	e->c.pd = ibv_alloc_pd(e->c.id->verbs);
	e->c.cq = ibv_create_cq(e->c.id->verbs, e->cq_size ? e->cq_size : 4 * depth, NULL, NULL, 0);
	if (e->want_srq && e->c.pd) {
		struct ibv_srq_init_attr sa = { .attr = { .max_wr = 16, .max_sge = 1 } };
		e->srq = ibv_create_srq(e->c.pd, &sa);
		if (!e->srq)
			DIE("create srq");
	}
	struct ibv_qp_init_attr qa = { .send_cq = e->c.cq, .recv_cq = e->c.cq, .srq = e->srq,
				       .qp_type = IBV_QPT_RC, .cap = { depth, depth, 1, 1, 0 } };
	if (!e->c.pd || !e->c.cq || rdma_create_qp(e->c.id, e->c.pd, &qa))
		DIE("create qp");
	e->sq_depth = qa.cap.max_send_wr;
}

/* Peer side: listen on an ephemeral port, print it, take one connection. */
static void peer_listen(struct end *e)
{
	printf("port %u\n", test_conn_listen(&e->c));
	fflush(stdout);
	test_conn_take_request(&e->c, &e->peer, sizeof e->peer);
}

static void peer_accept(struct end *e, struct offer o)
{
	struct rdma_conn_param cp = { .private_data = &o, .private_data_len = sizeof o,
				      .responder_resources = 8, .initiator_depth = 8 };
	if (rdma_accept(e->c.id, &cp))
		DIE("accept");
	test_conn_established(&e->c, NULL, 0);
}

static void connect_to_offering(struct end *e, uint16_t port, int depth, struct ibv_mr *(*reg)(struct ibv_pd *))
{
	test_conn_resolve(&e->c, port);
	make_qp(e, depth);
	struct rdma_conn_param cp = { .responder_resources = 8, .initiator_depth = 8 };
	struct offer o;
	if (reg) {
		struct ibv_mr *mr = reg(e->c.pd);
		o = (struct offer){ (uintptr_t)mr->addr, mr->rkey };
		cp.private_data = &o;
		cp.private_data_len = sizeof o;
	}
	if (rdma_connect(e->c.id, &cp))
		DIE("connect");
	test_conn_established(&e->c, &e->peer, sizeof e->peer);
}

static void connect_to(struct end *e, uint16_t port, int depth)
{
	connect_to_offering(e, port, depth, NULL);
}

/* ---- the peer process ---- */

static int peer_main(const char *cas)
{
	struct end e = { 0 };
	peer_listen(&e);
	make_qp(&e, NBIG);
	size_t len = (size_t)BIG * NBIG;
	char *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (buf == MAP_FAILED)
		DIE("mmap");
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, buf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!mr)
		DIE("peer reg_mr");
	if (!strcmp(cas, "async_srq_limit")) {
		struct ibv_sge s = { (uintptr_t)buf, 64, mr->lkey };
		struct ibv_recv_wr w = { .wr_id = 100, .sg_list = &s, .num_sge = 1 }, *bad;
		if (ibv_post_recv(e.c.id->qp, &w, &bad))
			DIE("post_recv");
	}
	if (!strcmp(cas, "dereg_inflight")) {
		for (int i = 0; i < NBIG; i++) {
			struct ibv_sge s = { (uintptr_t)(buf + (size_t)i * BIG), BIG, mr->lkey };
			struct ibv_recv_wr w = { .wr_id = i, .sg_list = &s, .num_sge = 1 }, *bad;
			if (ibv_post_recv(e.c.id->qp, &w, &bad))
				DIE("post_recv");
		}
	}
	peer_accept(&e, (struct offer){ (uintptr_t)buf, mr->rkey });
	if (!strcmp(cas, "dereg_inflight")) {
		/* Every Receive completes; a successful one holds the whole
		 * message, each octet (i + 1). */
		struct ibv_wc wc[NBIG];
		int n = poll_cq_for(e.c.cq, wc, NBIG, 30, 100), ok = 0, bad = 0;
		for (int i = 0; i < n; i++) {
			if (wc[i].status != IBV_WC_SUCCESS) {
				if (wc[i].status != IBV_WC_WR_FLUSH_ERR)
					bad++;
				continue;
			}
			const char *m = buf + wc[i].wr_id * BIG;
			int intact = wc[i].byte_len == BIG;
			for (size_t k = 0; intact && k < BIG; k++)
				intact = m[k] == (char)(wc[i].wr_id + 1);
			intact ? ok++ : bad++;
		}
		printf("peer %d %d %d\n", n, ok, bad);
		fflush(stdout);
		return 0;
	}
	if (!strcmp(cas, "kill_recv")) {
		/* Stream 1 MiB RDMA Writes into the client's buffer (offered in
		 * its connect's private data) until killed. */
		struct ibv_sge s = { (uintptr_t)buf, 1 << 20, mr->lkey };
		memset(buf, 0xab, 1 << 20);
		for (uint64_t i = 0;; i++) {
			struct ibv_send_wr w = { .wr_id = i, .sg_list = &s, .num_sge = 1,
						 .opcode = IBV_WR_RDMA_WRITE,
						 .send_flags = IBV_SEND_SIGNALED,
						 .wr.rdma = { e.peer.addr, e.peer.rkey } },
					   *bad;
			if (ibv_post_send(e.c.id->qp, &w, &bad) == 0) {
				struct ibv_wc wc;
				poll_cq_for(e.c.cq, &wc, 1, 1, 100);
			}
		}
	}
	if (!strcmp(cas, "peer_close")) {
		/* Close our end while the client streams: FIN, then (once the
		 * process is gone) RST to a client in CLOSE_WAIT, whose next
		 * write fails with EPIPE, which raises SIGPIPE without
		 * MSG_NOSIGNAL. */
		usleep(100000);
		rdma_disconnect(e.c.id);
		usleep(100000);
		_exit(0);
	}
	if (!strcmp(cas, "async_srq_limit")) {
		/* On the client's Send, five Sends back: its SRQ goes from 8
		 * posted WRs to 3. */
		struct ibv_wc wc[5];
		if (poll_cq_for(e.c.cq, wc, 1, 30, 100) != 1 || wc[0].status != IBV_WC_SUCCESS)
			return 1;
		for (int i = 0; i < 5; i++) {
			struct ibv_sge s = { (uintptr_t)buf, 64, mr->lkey };
			struct ibv_send_wr w = { .wr_id = i, .sg_list = &s, .num_sge = 1,
						 .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED },
					   *bad;
			if (ibv_post_send(e.c.id->qp, &w, &bad))
				return 1;
		}
		poll_cq_for(e.c.cq, wc, 5, 10, 100);
		struct rdma_cm_event *ev;
		while (rdma_get_cm_event(e.c.ch, &ev) == 0)
			rdma_ack_cm_event(ev);
		return 0;
	}
	if (!strcmp(cas, "exit_dirty")) {
		/* Exit with the connection, QP, MR and all open. */
		usleep(100000);
		exit(0);
	}
	if (!strcmp(cas, "async_disconnect")) {
		/* A clean disconnect from our side. */
		usleep(100000);
		rdma_disconnect(e.c.id);
		rdma_ack_cm_event(expect_event(e.c.ch, RDMA_CM_EVENT_DISCONNECTED));
		return 0;
	}
	/* Otherwise: stay until killed or the client disconnects. */
	struct rdma_cm_event *ev;
	while (rdma_get_cm_event(e.c.ch, &ev) == 0) {
		int done = ev->event == RDMA_CM_EVENT_DISCONNECTED;
		rdma_ack_cm_event(ev);
		if (done)
			break;
	}
	return 0;
}

/* ---- the client side ---- */

static const char *self_exe;

struct peer {
	pid_t pid;
	FILE *out;
	uint16_t port;
};

static struct peer spawn_peer(const char *cas)
{
	int fds[2];
	if (pipe(fds))
		DIE("pipe");
	struct peer p = { 0 };
	p.pid = fork();
	if (p.pid < 0)
		DIE("fork");
	if (p.pid == 0) {
		dup2(fds[1], 1);
		close(fds[0]);
		close(fds[1]);
		execl(self_exe, self_exe, "--peer", cas, (char *)NULL);
		_exit(127);
	}
	close(fds[1]);
	p.out = fdopen(fds[0], "r");
	unsigned port = 0;
	if (!p.out || fscanf(p.out, "port %u", &port) != 1)
		DIE("peer did not start");
	p.port = port;
	return p;
}

static int reap(struct peer *p)
{
	int st = 0;
	waitpid(p->pid, &st, 0);
	fclose(p->out);
	return st;
}

static void *map_big(size_t len, int fill_by_message)
{
	char *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (buf == MAP_FAILED)
		DIE("mmap");
	for (size_t i = 0; i < len; i++)
		buf[i] = fill_by_message ? (char)(i / BIG + 1) : (char)i;
	return buf;
}

static int post_write(struct end *e, struct ibv_mr *mr, char *src, uint32_t len, uint64_t id,
		      uint64_t remote_off)
{
	struct ibv_sge s = { (uintptr_t)src, len, mr->lkey };
	struct ibv_send_wr w = { .wr_id = id, .sg_list = &s, .num_sge = 1,
				 .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED,
				 .wr.rdma = { e->peer.addr + remote_off, e->peer.rkey } },
			   *bad;
	return ibv_post_send(e->c.id->qp, &w, &bad);
}

static void case_peer_close(void)
{
	struct peer p = spawn_peer("peer_close");
	struct end e = { 0 };
	connect_to(&e, p.port, NBIG);
	size_t len = (size_t)BIG * NBIG;
	char *buf = map_big(len, 0);
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		DIE("reg_mr");
	/* Keep NBIG 1 MiB Writes in flight while the peer closes and exits,
	 * until the QP fails. */
	int inflight = 0, done = 0, errors = 0, post_failed = 0;
	uint64_t next = 0;
	double end = now_s() + 20;
	while (!errors && now_s() < end) {
		while (inflight < NBIG) {
			if (post_write(&e, mr, buf + (next % NBIG) * (1u << 20), 1u << 20, next,
				       (next % NBIG) * (1u << 20))) {
				post_failed++;
				break;
			}
			next++;
			inflight++;
		}
		struct ibv_wc wc[NBIG];
		int n = ibv_poll_cq(e.c.cq, NBIG, wc);
		for (int i = 0; i < n; i++) {
			inflight--;
			if (wc[i].status == IBV_WC_SUCCESS)
				done++;
			else
				errors++;
		}
		if (!n)
			usleep(50);
	}
	CHECK(errors > 0, "peer_close: Writes to a closed peer end in error completions (%d ok, %d errors)",
	      done, errors);
	CHECK(post_failed == 0, "peer_close: posts are accepted while the QP fails (%d refused)", post_failed);
	/* Drain, then one more post: it flushes. */
	struct ibv_wc wc[NBIG];
	poll_cq_for(e.c.cq, wc, inflight, 5, 100);
	CHECK(post_write(&e, mr, buf, 4096, 999, 0) == 0, "peer_close: post after the error: %s",
	      strerror(errno));
	CHECK(poll_cq_for(e.c.cq, wc, 1, 5, 100) == 1 && wc[0].wr_id == 999 &&
		      wc[0].status == IBV_WC_WR_FLUSH_ERR,
	      "peer_close: a post after the error completes with WR_FLUSH_ERR");
	reap(&p);
	rdma_destroy_qp(e.c.id);
	CHECK(ibv_dereg_mr(mr) == 0, "peer_close: dereg_mr");
	munmap(buf, len);
	test_conn_destroy(&e.c);
}

/* Whether process `pid` is stopped (state T in /proc/PID/stat). */
static int is_stopped(pid_t pid)
{
	char path[64], buf[256];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return 0;
	size_t n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[n] = 0;
	char *p = strrchr(buf, ')');
	return p && p[1] == ' ' && p[2] == 'T';
}

/* The raw TCP peer of `sigpipe` (a forked child: plain socket calls,
 * then _exit). It connects with an enhanced MPA Request as kernel siw
 * sends it (rev 2, IRD/ORD 16) and reads the Reply. On "g" from `ctl` it
 * stops the application (SIGSTOP), sends an FPDU stag must refuse,
 * then FIN, then RST (SO_LINGER 0), and lets the application go on
 * (SIGCONT). So whichever of its threads drives the QP first reads the
 * bad FPDU before anything else, and answers it with a Terminate: a
 * write to a stream that is already reset, after the FIN, which leaves
 * EPIPE (not ECONNRESET) on the socket: without MSG_NOSIGNAL that write
 * raises SIGPIPE, every time. */
static void raw_peer_reset(uint16_t port, int ctl)
{
	static const unsigned char request[24] = {
		'M', 'P', 'A', ' ', 'I', 'D', ' ', 'R', 'e', 'q', ' ', 'F', 'r', 'a', 'm', 'e',
		0x10, 0x02, 0x00, 0x04, 0x00, 0x10, 0x00, 0x10,
	};
	/* MPA length 18, an untagged DDP header with DV 0, no pad, CRC 0:
	 * refused whether or not CRCs were negotiated. */
	static const unsigned char bad_fpdu[24] = { 0x00, 18, 0x40, 0x40 };
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port),
				   .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	char reply[512], go;
	pid_t app = getppid();
	int s = socket(AF_INET, SOCK_STREAM, 0);
	if (s < 0 || connect(s, (struct sockaddr *)&sin, sizeof sin) ||
	    write(s, request, sizeof request) != sizeof request || read(s, reply, sizeof reply) < 20 ||
	    read(ctl, &go, 1) != 1)
		_exit(2);
	kill(app, SIGSTOP);
	double end = now_s() + 10;
	while (!is_stopped(app) && now_s() < end)
		usleep(1000);
	/* FIN first: the application's end is in CLOSE_WAIT when the RST
	 * arrives, so the kernel records EPIPE on it. */
	struct linger lg = { 1, 0 };
	int ok = is_stopped(app) && write(s, bad_fpdu, sizeof bad_fpdu) == sizeof bad_fpdu &&
		 !shutdown(s, SHUT_WR) && !setsockopt(s, SOL_SOCKET, SO_LINGER, &lg, sizeof lg) &&
		 !close(s);
	/* Loopback delivers within the calls above; settle before resuming. */
	usleep(20000);
	kill(app, SIGCONT);
	_exit(ok && write(ctl, "r", 1) == 1 ? 0 : 2);
}

static void case_sigpipe(void)
{
	struct end e = { 0 };
	uint16_t port = test_conn_listen(&e.c);
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
		DIE("socketpair");
	pid_t pid = fork();
	if (pid < 0)
		DIE("fork");
	if (pid == 0) {
		close(sv[0]);
		raw_peer_reset(port, sv[1]);
	}
	close(sv[1]);
	test_conn_take_request(&e.c, NULL, 0);
	make_qp(&e, 8);
	struct rdma_conn_param cp = { .responder_resources = 8, .initiator_depth = 8 };
	if (rdma_accept(e.c.id, &cp))
		DIE("accept");
	test_conn_established(&e.c, NULL, 0);
	/* This thread sleeps in read() while the peer does its part. */
	char r = 0;
	CHECK(write(sv[0], "g", 1) == 1 && read(sv[0], &r, 1) == 1 && r == 'r',
	      "sigpipe: the peer stopped us, sent a bad FPDU, FIN and RST");
	int st = 0;
	waitpid(pid, &st, 0);
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "sigpipe: the raw peer ran (status %#x)", st);
	/* Still alive: the Terminate's write returned EPIPE, not a signal.
	 * Posts now flush: the QP is in Error. */
	struct ibv_wc wc;
	struct ibv_recv_wr rw = { .wr_id = 5 }, *rbad;
	CHECK(ibv_post_recv(e.c.id->qp, &rw, &rbad) == 0 && poll_cq_for(e.c.cq, &wc, 1, 5, 100) == 1 &&
		      wc.wr_id == 5 && wc.status == IBV_WC_WR_FLUSH_ERR,
	      "sigpipe: the QP is in Error: a Receive flushes");
	close(sv[0]);
	test_conn_destroy(&e.c);
}

static char *kill_recv_buf;
static struct ibv_mr *kill_recv_reg(struct ibv_pd *pd)
{
	kill_recv_buf = calloc(1, 1 << 20);
	struct ibv_mr *mr = ibv_reg_mr(pd, kill_recv_buf, 1 << 20,
				       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!mr)
		DIE("reg_mr");
	return mr;
}

static void case_kill_recv(void)
{
	struct peer p = spawn_peer("kill_recv");
	struct end e = { 0 };
	connect_to_offering(&e, p.port, 8, kill_recv_reg);
	char *rbuf = calloc(8, 4096);
	struct ibv_mr *rmr = ibv_reg_mr(e.c.pd, rbuf, 8 * 4096, IBV_ACCESS_LOCAL_WRITE);
	for (int i = 0; i < 8; i++) {
		struct ibv_sge s = { (uintptr_t)(rbuf + 4096 * i), 4096, rmr->lkey };
		struct ibv_recv_wr w = { .wr_id = i, .sg_list = &s, .num_sge = 1 }, *bad;
		if (ibv_post_recv(e.c.id->qp, &w, &bad))
			DIE("post_recv");
	}
	/* Wait until the peer's Writes land, let them stream, kill it. */
	double end = now_s() + 10;
	while (((volatile char *)kill_recv_buf)[(1 << 20) - 1] != (char)0xab && now_s() < end)
		usleep(100);
	usleep(50000);
	kill(p.pid, SIGKILL);
	struct ibv_wc wc[8];
	int n = poll_cq_for(e.c.cq, wc, 8, 10, 100), flushed = 0;
	for (int i = 0; i < n; i++)
		flushed += wc[i].status == IBV_WC_WR_FLUSH_ERR;
	CHECK(kill_recv_buf[(1 << 20) - 1] == (char)0xab && n == 8 && flushed == 8,
	      "kill_recv: the peer's Writes arrived, then its death flushed our 8 Receives (%d completions, %d flushed)",
	      n, flushed);
	reap(&p);
	rdma_destroy_qp(e.c.id);
	ibv_dereg_mr(rmr);
	test_conn_destroy(&e.c);
}

static void case_dereg_inflight(void)
{
	struct peer p = spawn_peer("dereg_inflight");
	struct end e = { 0 };
	connect_to(&e, p.port, NBIG);
	size_t len = (size_t)BIG * NBIG;
	char *buf = map_big(len, 1);
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		DIE("reg_mr");
	/* The peer stops reading, so the Sends back up in our queue. */
	kill(p.pid, SIGSTOP);
	for (int i = 0; i < NBIG; i++) {
		struct ibv_sge s = { (uintptr_t)(buf + (size_t)i * BIG), BIG, mr->lkey };
		struct ibv_send_wr w = { .wr_id = i, .sg_list = &s, .num_sge = 1,
					 .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED },
				   *bad;
		if (ibv_post_send(e.c.id->qp, &w, &bad))
			DIE("post_send");
	}
	usleep(20000);
	CHECK(ibv_dereg_mr(mr) == 0, "dereg_inflight: dereg_mr with Sends in flight");
	/* Anything stag still read from here on would fault. */
	munmap(buf, len);
	kill(p.pid, SIGCONT);
	struct ibv_wc wc[NBIG];
	int n = poll_cq_for(e.c.cq, wc, NBIG, 30, 100), ok = 0, prot = 0, flush = 0, other = 0;
	for (int i = 0; i < n; i++) {
		switch (wc[i].status) {
		case IBV_WC_SUCCESS: ok++; break;
		case IBV_WC_LOC_PROT_ERR: prot++; break;
		case IBV_WC_WR_FLUSH_ERR: flush++; break;
		default: other++;
		}
	}
	CHECK(n == NBIG && other == 0 && prot == 1 && ok + prot + flush == NBIG,
	      "dereg_inflight: %d completions: %d ok, one LOC_PROT_ERR (%d), %d flushed, %d other", n, ok,
	      prot, flush, other);
	int pn = -1, pok = -1, pbad = -1;
	CHECK(fscanf(p.out, " peer %d %d %d", &pn, &pok, &pbad) == 3 && pn == NBIG && pbad == 0 &&
		      pok >= ok,
	      "dereg_inflight: the peer got every message we saw succeed, intact (%d receives: %d intact, %d bad; we saw %d ok)",
	      pn, pok, pbad, ok);
	reap(&p);
	rdma_destroy_qp(e.c.id);
	test_conn_destroy(&e.c);
}

static void case_full_sq(void)
{
	struct peer p = spawn_peer("full_sq");
	struct end e = { 0 };
	connect_to(&e, p.port, 8);
	char *buf = map_big(BIG, 0);
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, buf, BIG, IBV_ACCESS_LOCAL_WRITE);
	kill(p.pid, SIGSTOP); /* nothing drains: the Writes stay queued */
	/* A WR leaves the queue once its octets are in the socket, which
	 * takes a few MiB while the peer sleeps: the queue is full after
	 * max_send_wr posts plus those few. */
	int d = (int)e.sq_depth, k = 0, rc = 0;
	while (k < d + 8 && (rc = post_write(&e, mr, buf, BIG, k, 0)) == 0)
		k++;
	CHECK(d >= 8 && d <= 32 && rc == ENOMEM && k >= d && k < d + 8,
	      "full_sq: ENOMEM once max_send_wr (%d) WRs are outstanding (after %d posts, rc %d)", d, k, rc);
	kill(p.pid, SIGCONT);
	struct ibv_wc wc[40];
	int n = poll_cq_for(e.c.cq, wc, k, 20, 100), ok = 0;
	for (int i = 0; i < n; i++)
		ok += wc[i].status == IBV_WC_SUCCESS;
	CHECK(n == k && ok == k, "full_sq: all %d complete once the peer reads (%d, %d ok)", k, n, ok);
	CHECK(post_write(&e, mr, buf, 4096, 99, 0) == 0 && poll_cq_for(e.c.cq, wc, 1, 5, 100) == 1 &&
		      wc[0].status == IBV_WC_SUCCESS,
	      "full_sq: room again after the completions");
	rdma_disconnect(e.c.id);
	reap(&p);
	rdma_destroy_qp(e.c.id);
	ibv_dereg_mr(mr);
	test_conn_destroy(&e.c);
}

static void case_post_error(void)
{
	struct peer p = spawn_peer("post_error");
	struct end e = { 0 };
	connect_to(&e, p.port, 8);
	char *buf = map_big(4096, 0);
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	CHECK(ibv_modify_qp(e.c.id->qp, &a, IBV_QP_STATE) == 0, "post_error: modify to ERR");
	struct ibv_sge s = { (uintptr_t)buf, 64, mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 7, .sg_list = &s, .num_sge = 1 }, *rbad;
	CHECK(post_write(&e, mr, buf, 64, 6, 0) == 0 && ibv_post_recv(e.c.id->qp, &rw, &rbad) == 0,
	      "post_error: posts are accepted in Error");
	struct ibv_wc wc[2];
	int n = poll_cq_for(e.c.cq, wc, 2, 5, 100);
	CHECK(n == 2 && wc[0].status == IBV_WC_WR_FLUSH_ERR && wc[1].status == IBV_WC_WR_FLUSH_ERR,
	      "post_error: both complete with WR_FLUSH_ERR (%d completions)", n);
	rdma_disconnect(e.c.id);
	reap(&p);
	rdma_destroy_qp(e.c.id);
	ibv_dereg_mr(mr);
	test_conn_destroy(&e.c);
}

static void case_destroy_qp(void)
{
	struct peer p = spawn_peer("destroy_qp");
	struct end e = { 0 };
	connect_to(&e, p.port, NBIG);
	size_t len = (size_t)BIG * NBIG;
	char *buf = map_big(len, 0);
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
	kill(p.pid, SIGSTOP);
	int ok = 0;
	for (int i = 0; i < NBIG; i++)
		ok += post_write(&e, mr, buf + (size_t)i * BIG, BIG, i, 0) == 0;
	CHECK(ok == NBIG, "destroy_qp: 16 x 4 MiB Writes posted");
	/* ibv_destroy_qp directly (rdma_destroy_qp would too). */
	CHECK(ibv_destroy_qp(e.c.id->qp) == 0, "destroy_qp: destroy with Writes in flight");
	e.c.id->qp = NULL;
	CHECK(ibv_dereg_mr(mr) == 0, "destroy_qp: dereg after");
	munmap(buf, len);
	kill(p.pid, SIGCONT);
	struct ibv_wc wc[NBIG];
	CHECK(ibv_destroy_cq(e.c.cq) == 0 || errno == EBUSY, "destroy_qp: destroy_cq");
	(void)wc;
	kill(p.pid, SIGKILL);
	reap(&p);
	ibv_dealloc_pd(e.c.pd);
	rdma_destroy_id(e.c.id);
	rdma_destroy_event_channel(e.c.ch);
}

/* The next async event of `ctx` of type `type`, waiting on async_fd with
 * poll() as an event loop would (at most `ms` for each); 0 if one came.
 * Events of other types are acked and skipped (a destroy waits for the
 * acks of the events it reported). */
static int next_async(struct ibv_context *ctx, enum ibv_event_type type,
		      struct ibv_async_event *ev, int ms)
{
	for (;;) {
		struct pollfd pfd = { .fd = ctx->async_fd, .events = POLLIN };
		if (poll(&pfd, 1, ms) != 1 || ibv_get_async_event(ctx, ev))
			return -1;
		if (ev->event_type == type)
			return 0;
		ibv_ack_async_event(ev);
	}
}

/* Connect to a new peer running `cas`, and take the COMM_EST the
 * connection raises if it comes within 5 s (the async cases that do not
 * test COMM_EST itself). */
static struct peer connect_past_comm_est(struct end *e, const char *cas)
{
	struct peer p = spawn_peer(cas);
	connect_to(e, p.port, 8);
	struct ibv_async_event ev;
	if (next_async(e->c.id->verbs, IBV_EVENT_COMM_EST, &ev, 5000) == 0)
		ibv_ack_async_event(&ev);
	return p;
}

/* Post n 64-byte Receives of buf (n x 64 bytes, registered as mr) to the
 * SRQ when `srq` is set, else to the QP; wr_id i for the i-th. */
static void post_recvs(struct end *e, char *buf, struct ibv_mr *mr, int n, struct ibv_srq *srq)
{
	for (int i = 0; i < n; i++) {
		struct ibv_sge s = { (uintptr_t)(buf + 64 * i), 64, mr->lkey };
		struct ibv_recv_wr w = { .wr_id = i, .sg_list = &s, .num_sge = 1 }, *bad;
		if (srq ? ibv_post_srq_recv(srq, &w, &bad) : ibv_post_recv(e->c.id->qp, &w, &bad))
			DIE("post_recv");
	}
}

struct destroyer {
	struct ibv_qp *qp;
	volatile int done, rc;
};

static void *destroy_thread(void *arg)
{
	struct destroyer *d = arg;
	d->rc = ibv_destroy_qp(d->qp);
	d->done = 1;
	return NULL;
}

static void case_destroy_clean(void)
{
	struct peer p = spawn_peer("destroy_clean");
	struct end e = { 0 };
	connect_to(&e, p.port, 8);
	char *buf = map_big(4096, 0);
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	int ok = 0;
	for (int i = 0; i < 4; i++)
		ok += post_write(&e, mr, buf, 64, 10 + i, 0) == 0;
	struct ibv_sge s = { (uintptr_t)buf, 64, mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 20, .sg_list = &s, .num_sge = 1 }, *rbad;
	ok += ibv_post_recv(e.c.id->qp, &rw, &rbad) == 0;
	CHECK(ok == 5, "destroy_clean: 4 Writes and a Receive posted");
	/* Let the Writes complete into the CQ, unpolled. */
	usleep(300 * 1000);
	CHECK(ibv_destroy_qp(e.c.id->qp) == 0, "destroy_clean: destroy with completions queued");
	e.c.id->qp = NULL;
	/* As on mlx5: no completion of a destroyed QP is polled afterwards,
	 * neither those queued before nor a flush of its Receive (libfabric's
	 * rxm frees what their ids point at once the QP is gone). */
	struct ibv_wc wc[8];
	int n = 0;
	for (int t = 0; t < 20; t++) {
		n += ibv_poll_cq(e.c.cq, 8, wc);
		usleep(10 * 1000);
	}
	CHECK(n == 0, "destroy_clean: no completion of the destroyed QP (%d polled)", n);
	kill(p.pid, SIGKILL);
	reap(&p);
	ibv_dereg_mr(mr);
	munmap(buf, 4096);
	test_conn_destroy(&e.c);
}

static void case_async_destroy(void)
{
	/* An event read and not acked: destroy waits for the ack. */
	struct peer p = spawn_peer("async_destroy");
	struct end e = { 0 };
	connect_to(&e, p.port, 8);
	struct ibv_context *ctx = e.c.id->verbs;
	struct ibv_async_event ev;
	CHECK(next_async(ctx, IBV_EVENT_COMM_EST, &ev, 5000) == 0 && ev.element.qp == e.c.id->qp,
	      "async_destroy: COMM_EST read");
	struct destroyer d = { .qp = e.c.id->qp };
	pthread_t t;
	if (pthread_create(&t, NULL, destroy_thread, &d))
		DIE("pthread_create");
	usleep(200000);
	CHECK(!d.done, "async_destroy: ibv_destroy_qp waits while a read event is not acked");
	ibv_ack_async_event(&ev);
	double end = now_s() + 5;
	while (!d.done && now_s() < end)
		usleep(1000);
	CHECK(d.done && d.rc == 0, "async_destroy: the ack lets ibv_destroy_qp return (rc %d)", d.rc);
	if (d.done)
		pthread_join(t, NULL);
	e.c.id->qp = NULL;
	kill(p.pid, SIGKILL);
	reap(&p);
	test_conn_destroy(&e.c);

	/* An event not read yet: destroy drops it, and returns at once. */
	p = spawn_peer("async_destroy");
	memset(&e, 0, sizeof e);
	connect_to(&e, p.port, 8);
	ctx = e.c.id->verbs;
	struct pollfd pfd = { .fd = ctx->async_fd, .events = POLLIN };
	CHECK(poll(&pfd, 1, 5000) == 1, "async_destroy: COMM_EST waiting on async_fd");
	double t0 = now_s();
	CHECK(ibv_destroy_qp(e.c.id->qp) == 0 && now_s() - t0 < 2,
	      "async_destroy: ibv_destroy_qp with an unread event returns");
	e.c.id->qp = NULL;
	pfd.revents = 0;
	CHECK(poll(&pfd, 1, 200) == 0, "async_destroy: the destroyed QP's unread event is gone");
	kill(p.pid, SIGKILL);
	reap(&p);
	test_conn_destroy(&e.c);
}

static void case_async(void)
{
	struct peer p = spawn_peer("async");
	struct end e = { 0 };
	connect_to(&e, p.port, 8);
	struct ibv_async_event ev;
	CHECK(next_async(e.c.id->verbs, IBV_EVENT_COMM_EST, &ev, 5000) == 0 && ev.element.qp == e.c.id->qp,
	      "async: IBV_EVENT_COMM_EST for our QP once connected");
	ibv_ack_async_event(&ev);
	char *buf = map_big(4096, 0);
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	/* A Write to an STag the peer never gave: it answers with a
	 * Terminate, and our QP goes to Error. */
	e.peer.rkey ^= 0x80;
	CHECK(post_write(&e, mr, buf, 64, 1, 0) == 0, "async: post a Write with a bad rkey");
	struct ibv_wc wc;
	/* iWARP completes a Write once it is sent (success); the peer's
	 * refusal comes after. */
	CHECK(poll_cq_for(e.c.cq, &wc, 1, 5, 100) == 1, "async: the Write completes");
	CHECK(next_async(e.c.id->verbs, IBV_EVENT_QP_FATAL, &ev, 5000) == 0 && ev.element.qp == e.c.id->qp,
	      "async: the peer's Terminate raises IBV_EVENT_QP_FATAL on our QP");
	ibv_ack_async_event(&ev);
	kill(p.pid, SIGKILL);
	reap(&p);
	rdma_destroy_qp(e.c.id);
	ibv_dereg_mr(mr);
	test_conn_destroy(&e.c);
}

/* Events of `type` on the object at `elem` (a QP, CQ or SRQ: the union's
 * pointers share their place) that arrive within `ms`, acking each. */
static int count_async(struct ibv_context *ctx, const void *elem, enum ibv_event_type type, int ms)
{
	int n = 0;
	double end = now_s() + ms / 1e3;
	struct ibv_async_event ev;
	while (now_s() < end) {
		struct pollfd pfd = { .fd = ctx->async_fd, .events = POLLIN };
		if (poll(&pfd, 1, 10) != 1 || ibv_get_async_event(ctx, &ev))
			continue;
		n += ev.event_type == type && (const void *)ev.element.qp == elem;
		ibv_ack_async_event(&ev);
	}
	return n;
}

static void teardown(struct end *e, struct peer *p)
{
	if (p) {
		kill(p->pid, SIGKILL);
		reap(p);
	}
	rdma_destroy_qp(e->c.id);
	if (e->srq)
		ibv_destroy_srq(e->srq);
	test_conn_destroy(&e->c);
}

static void case_async_reset(void)
{
	struct end e = { 0 };
	struct peer p = connect_past_comm_est(&e, "async");
	struct ibv_async_event ev;
	char *buf = map_big(1 << 16, 0);
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, buf, 1 << 16, IBV_ACCESS_LOCAL_WRITE);
	/* The peer never reads this Write: killed with it unread, its kernel
	 * resets the connection (RST), as for any process killed mid-stream. */
	kill(p.pid, SIGSTOP);
	double end = now_s() + 5;
	while (!is_stopped(p.pid) && now_s() < end)
		usleep(1000);
	struct ibv_wc wc;
	CHECK(post_write(&e, mr, buf, 1 << 16, 1, 0) == 0 && poll_cq_for(e.c.cq, &wc, 1, 5, 100) == 1 &&
		      wc.status == IBV_WC_SUCCESS,
	      "async_reset: a Write sent to the stopped peer");
	kill(p.pid, SIGKILL);
	reap(&p);
	CHECK(next_async(e.c.id->verbs, IBV_EVENT_QP_FATAL, &ev, 5000) == 0 && ev.element.qp == e.c.id->qp,
	      "async_reset: the peer's reset raises IBV_EVENT_QP_FATAL");
	ibv_ack_async_event(&ev);
	ibv_dereg_mr(mr);
	munmap(buf, 1 << 16);
	teardown(&e, NULL);
}

static void case_async_disconnect(void)
{
	struct peer p = spawn_peer("async_disconnect");
	struct end e = { 0 };
	connect_to(&e, p.port, 8);
	struct ibv_async_event ev;
	CHECK(next_async(e.c.id->verbs, IBV_EVENT_COMM_EST, &ev, 5000) == 0, "async_disconnect: COMM_EST");
	ibv_ack_async_event(&ev);
	rdma_ack_cm_event(expect_event(e.c.ch, RDMA_CM_EVENT_DISCONNECTED));
	CHECK(count_async(e.c.id->verbs, e.c.id->qp, IBV_EVENT_QP_FATAL, 300) == 0,
	      "async_disconnect: the peer's clean disconnect raises no QP_FATAL");
	reap(&p);
	teardown(&e, NULL);
}

static void case_async_last_wqe(void)
{
	struct end e = { .want_srq = 1 };
	struct peer p = connect_past_comm_est(&e, "async");
	struct ibv_async_event ev;
	CHECK(count_async(e.c.id->verbs, e.c.id->qp, IBV_EVENT_QP_LAST_WQE_REACHED, 100) == 0,
	      "async_last_wqe: none while the QP runs");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	CHECK(ibv_modify_qp(e.c.id->qp, &a, IBV_QP_STATE) == 0, "async_last_wqe: modify to ERR");
	CHECK(next_async(e.c.id->verbs, IBV_EVENT_QP_LAST_WQE_REACHED, &ev, 5000) == 0 &&
		      ev.element.qp == e.c.id->qp,
	      "async_last_wqe: an SRQ QP in Error raises IBV_EVENT_QP_LAST_WQE_REACHED");
	ibv_ack_async_event(&ev);
	CHECK(count_async(e.c.id->verbs, e.c.id->qp, IBV_EVENT_QP_LAST_WQE_REACHED, 300) == 0,
	      "async_last_wqe: once");
	teardown(&e, &p);
}

static void case_async_cq_err(void)
{
	struct end e = { .cq_size = 2 };
	struct peer p = connect_past_comm_est(&e, "async");
	struct ibv_async_event ev;
	static char rbuf[4 * 64];
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, rbuf, sizeof rbuf, IBV_ACCESS_LOCAL_WRITE);
	post_recvs(&e, rbuf, mr, 4, NULL);
	/* Four flushed Receives into a CQ of two: an overrun. */
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	CHECK(ibv_modify_qp(e.c.id->qp, &a, IBV_QP_STATE) == 0, "async_cq_err: modify to ERR");
	CHECK(next_async(e.c.id->verbs, IBV_EVENT_CQ_ERR, &ev, 5000) == 0 && ev.element.cq == e.c.cq,
	      "async_cq_err: the overrun raises IBV_EVENT_CQ_ERR on our CQ");
	ibv_ack_async_event(&ev);
	struct ibv_wc wc[4];
	poll_cq_for(e.c.cq, wc, 4, 1, 100);
	ibv_dereg_mr(mr);
	teardown(&e, &p);
}

static void case_async_srq_limit(void)
{
	struct end e = { .want_srq = 1 };
	struct peer p = connect_past_comm_est(&e, "async_srq_limit");
	struct ibv_async_event ev;
	static char rbuf[8 * 64];
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, rbuf, sizeof rbuf, IBV_ACCESS_LOCAL_WRITE);
	post_recvs(&e, rbuf, mr, 8, e.srq);
	struct ibv_srq_attr sa = { .srq_limit = 4 };
	CHECK(ibv_modify_srq(e.srq, &sa, IBV_SRQ_LIMIT) == 0, "async_srq_limit: arm the limit at 4");
	sa.srq_limit = 17;
	CHECK(ibv_modify_srq(e.srq, &sa, IBV_SRQ_LIMIT) == EINVAL,
	      "async_srq_limit: a limit above max_wr is EINVAL");
	CHECK(ibv_query_srq(e.srq, &sa) == 0 && sa.srq_limit == 4, "async_srq_limit: armed at 4");
	CHECK(count_async(e.c.id->verbs, e.srq, IBV_EVENT_SRQ_LIMIT_REACHED, 100) == 0,
	      "async_srq_limit: nothing while 8 are posted");
	/* Our Send tells the peer to send five: 3 WRs left. */
	struct ibv_sge s = { (uintptr_t)rbuf, 8, mr->lkey };
	struct ibv_send_wr w = { .wr_id = 50, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND,
				 .send_flags = IBV_SEND_SIGNALED },
			   *bad;
	CHECK(ibv_post_send(e.c.id->qp, &w, &bad) == 0, "async_srq_limit: post the go Send");
	struct ibv_wc wc[6];
	int n = poll_cq_for(e.c.cq, wc, 6, 10, 100);
	CHECK(n == 6, "async_srq_limit: our Send and the peer's five complete (%d)", n);
	CHECK(next_async(e.c.id->verbs, IBV_EVENT_SRQ_LIMIT_REACHED, &ev, 5000) == 0 &&
		      ev.element.srq == e.srq,
	      "async_srq_limit: below the limit: IBV_EVENT_SRQ_LIMIT_REACHED on our SRQ");
	ibv_ack_async_event(&ev);
	CHECK(ibv_query_srq(e.srq, &sa) == 0 && sa.srq_limit == 0, "async_srq_limit: then disarmed");
	ibv_dereg_mr(mr);
	teardown(&e, &p);
}

static void case_busy(void)
{
	struct ibv_context *ctx = open_stag0();
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_srq_init_attr sa = { .attr = { .max_wr = 8, .max_sge = 1 } };
	struct ibv_srq *srq = pd ? ibv_create_srq(pd, &sa) : NULL;
	static char buf[4096];
	struct ibv_mr *mr = pd ? ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE) : NULL;
	struct ibv_qp_init_attr qa = { .send_cq = cq, .recv_cq = cq, .srq = srq,
				       .qp_type = IBV_QPT_RC, .cap = { 8, 8, 1, 1, 0 } };
	struct ibv_qp *qp = pd && cq && srq ? ibv_create_qp(pd, &qa) : NULL;
	if (!qp || !mr)
		DIE("busy: objects");
	CHECK(ibv_dealloc_pd(pd) == EBUSY, "busy: ibv_dealloc_pd with a QP, an SRQ and an MR on it: EBUSY");
	CHECK(ibv_destroy_cq(cq) == EBUSY, "busy: ibv_destroy_cq while a QP uses it: EBUSY");
	CHECK(ibv_destroy_srq(srq) == EBUSY, "busy: ibv_destroy_srq while a QP uses it: EBUSY");
	/* Still whole: a post on the QP's SRQ works. */
	struct ibv_sge s = { (uintptr_t)buf, 64, mr->lkey };
	struct ibv_recv_wr w = { .wr_id = 1, .sg_list = &s, .num_sge = 1 }, *bad;
	CHECK(ibv_post_srq_recv(srq, &w, &bad) == 0, "busy: the SRQ still works after the refusal");
	CHECK(ibv_destroy_qp(qp) == 0, "busy: destroy the QP");
	CHECK(ibv_destroy_cq(cq) == 0, "busy: then ibv_destroy_cq succeeds");
	CHECK(ibv_destroy_srq(srq) == 0, "busy: then ibv_destroy_srq succeeds");
	CHECK(ibv_dealloc_pd(pd) == EBUSY, "busy: ibv_dealloc_pd with an MR on it: EBUSY");
	CHECK(ibv_dereg_mr(mr) == 0 && ibv_dealloc_pd(pd) == 0, "busy: dereg, then dealloc_pd succeeds");
	CHECK(ibv_close_device(ctx) == 0, "busy: close the device");
}

/* The child of `log_flood` (STAG_LOG=warn): 1000 calls that each log
 * the same warning, a pause longer than the limiter's period, one more. */
static int flood_main(void)
{
	struct ibv_context *ctx = open_stag0();
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	if (!cq)
		DIE("flood: create_cq");
	double t0 = now_s();
	for (int i = 0; i < 1000; i++)
		ibv_resize_cq(cq, 32); /* unsupported: a warning each time */
	double took = now_s() - t0;
	usleep(1100000);
	ibv_resize_cq(cq, 32);
	ibv_destroy_cq(cq);
	ibv_close_device(ctx);
	printf("flood %.3f\n", took);
	return 0;
}

/* This program re-executed as `self_exe MODE` with ENV=VALUE set: its
 * stdout comes back as *out, its stderr goes to err_fd (-1: ours). */
static pid_t spawn_self(const char *mode, const char *env, const char *value, int err_fd, FILE **out)
{
	int fds[2];
	if (pipe(fds))
		DIE("pipe");
	pid_t pid = fork();
	if (pid < 0)
		DIE("fork");
	if (pid == 0) {
		if (err_fd >= 0)
			dup2(err_fd, 2);
		dup2(fds[1], 1);
		close(fds[0]);
		close(fds[1]);
		setenv(env, value, 1);
		execl(self_exe, self_exe, mode, (char *)NULL);
		_exit(127);
	}
	close(fds[1]);
	*out = fdopen(fds[0], "r");
	return pid;
}

static void case_log_flood(void)
{
	char path[] = "/tmp/faults-flood-XXXXXX";
	int fd = mkstemp(path);
	if (fd < 0)
		DIE("mkstemp");
	unlink(path);
	FILE *o;
	pid_t pid = spawn_self("--flood", "STAG_LOG", "warn", fd, &o);
	double took = -1;
	if (!o || fscanf(o, "flood %lf", &took) != 1)
		took = -1;
	if (o)
		fclose(o);
	int st = 0;
	waitpid(pid, &st, 0);
	lseek(fd, 0, SEEK_SET);
	FILE *f = fdopen(fd, "r");
	char line[1024];
	int warned = 0, notes = 0, suppressed = -1;
	while (f && fgets(line, sizeof line, f)) {
		if (strstr(line, "ibv_resize_cq is not supported"))
			warned++;
		char *m = strstr(line, "stag0: ");
		if (m && sscanf(m, "stag0: %d more messages like the next one were suppressed",
				&suppressed) == 1)
			notes++;
	}
	if (f)
		fclose(f);
	/* The burst of 10, one a second while the flood lasted, then the
	 * one after the pause with the count of the rest. */
	int most = 10 + (int)took + 1;
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0 && took >= 0, "log_flood: the child ran (%#x)", st);
	CHECK(warned >= 11 && warned <= most + 1 && notes >= 1 && notes <= most - 9 &&
		      suppressed > 0 && suppressed + warned >= 1001 - notes,
	      "log_flood: 1001 identical warnings print as %d lines and %d suppression notes (last: %d suppressed; the flood took %.3f s)",
	      warned, notes, suppressed, took);
}

/* Wait at most `secs` for `pid` to exit; its status, or -1 if it did not. */
static int wait_exit(pid_t pid, double secs)
{
	double end = now_s() + secs;
	int st;
	while (now_s() < end) {
		if (waitpid(pid, &st, WNOHANG) == pid)
			return st;
		usleep(1000);
	}
	return -1;
}

/* One run of `fork` in a fresh process (`--fork-run FORK_INIT`):
 * ibv_fork_init must come before any registration. Prints "fork P F". */
static int fork_run(int fork_init)
{
	const char *how = fork_init ? "fork (ibv_fork_init)" : "fork";
	if (fork_init)
		CHECK(ibv_fork_init() == 0, "%s: ibv_fork_init", how);
	struct peer p = spawn_peer("async");
	struct end e = { 0 };
	connect_to(&e, p.port, 8);
	size_t len = 1 << 16;
	char *buf = map_big(len, 0);
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_wc wc;
	CHECK(mr && post_write(&e, mr, buf, len, 1, 0) == 0 && poll_cq_for(e.c.cq, &wc, 1, 5, 100) == 1 &&
		      wc.status == IBV_WC_SUCCESS,
	      "%s: a Write before the fork", how);
	/* Writes in flight across the fork. */
	int posted = 0;
	for (int i = 0; i < 4; i++)
		posted += post_write(&e, mr, buf, len, 10 + i, 0) == 0;
	pid_t pid = fork();
	if (pid < 0)
		DIE("fork");
	if (pid == 0) {
		int code = 0;
		/* Without ibv_fork_init the child has its own copy of the
		 * registered memory; after it, the range may be absent from the
		 * child (libibverbs' MADV_DONTFORK) and must not be touched. */
		if (!fork_init) {
			for (size_t i = 0; i < len; i++)
				code |= buf[i] != (char)i;
			memset(buf, 0xee, len);
		}
		/* stag0 lives in the parent's threads: it does not open here. */
		int n = 0;
		struct ibv_device **list = ibv_get_device_list(&n);
		for (int i = 0; list && i < n; i++)
			if (!strcmp(ibv_get_device_name(list[i]), "stag0") && ibv_open_device(list[i]))
				code |= 2;
		exit(code); /* a normal exit, atexit handlers and all */
	}
	int st = wait_exit(pid, 10);
	CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
	      "%s: the child sees its copy of memory, stag0 refuses to open there, and it exits (status %#x)",
	      how, st);
	int intact = 1;
	for (size_t i = 0; i < len; i++)
		intact &= buf[i] == (char)i;
	CHECK(intact, "%s: the parent's registered memory is untouched by the child", how);
	struct ibv_wc w4[4];
	int n = poll_cq_for(e.c.cq, w4, posted, 10, 100), ok = 0;
	for (int i = 0; i < n; i++)
		ok += w4[i].status == IBV_WC_SUCCESS;
	CHECK(posted == 4 && ok == 4, "%s: the Writes in flight across the fork complete (%d of %d)", how,
	      ok, posted);
	CHECK(post_write(&e, mr, buf, len, 20, 0) == 0 && poll_cq_for(e.c.cq, &wc, 1, 5, 100) == 1 &&
		      wc.status == IBV_WC_SUCCESS,
	      "%s: the connection works after the child exited", how);
	ibv_dereg_mr(mr);
	munmap(buf, len);
	teardown(&e, &p);
	printf("fork %d %d\n", passed, failed);
	return 0;
}

static void case_fork(void)
{
	for (int fi = 0; fi < 2; fi++) {
		int fds[2];
		if (pipe(fds))
			DIE("pipe");
		pid_t pid = fork();
		if (pid < 0)
			DIE("fork");
		if (pid == 0) {
			dup2(fds[1], 1);
			close(fds[0]);
			close(fds[1]);
			execl(self_exe, self_exe, "--fork-run", fi ? "1" : "0", (char *)NULL);
			_exit(127);
		}
		close(fds[1]);
		FILE *f = fdopen(fds[0], "r");
		char line[256];
		int p = -1, q = -1;
		while (f && fgets(line, sizeof line, f))
			sscanf(line, "fork %d %d", &p, &q);
		if (f)
			fclose(f);
		int st = wait_exit(pid, 60);
		CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0 && p > 0 && q == 0,
		      "fork%s: %d passed, %d failed (status %#x)", fi ? " (ibv_fork_init)" : "", p, q, st);
		if (p > 0)
			passed += p - 1; /* the run's own checks, besides the one above */
	}
}

static void case_exit_dirty(void)
{
	struct peer p = spawn_peer("exit_dirty");
	struct end e = { 0 };
	connect_to(&e, p.port, 8);
	static char rbuf[4096];
	struct ibv_mr *mr = ibv_reg_mr(e.c.pd, rbuf, sizeof rbuf, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_sge s = { (uintptr_t)rbuf, 64, mr->lkey };
	struct ibv_recv_wr w = { .wr_id = 3, .sg_list = &s, .num_sge = 1 }, *bad;
	CHECK(ibv_post_recv(e.c.id->qp, &w, &bad) == 0, "exit_dirty: post a Receive");
	int st = wait_exit(p.pid, 10);
	CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
	      "exit_dirty: the peer exits with everything open, promptly (status %#x)", st);
	fclose(p.out);
	rdma_ack_cm_event(expect_event(e.c.ch, RDMA_CM_EVENT_DISCONNECTED));
	struct ibv_wc wc;
	CHECK(poll_cq_for(e.c.cq, &wc, 1, 5, 100) == 1 && wc.wr_id == 3 && wc.status == IBV_WC_WR_FLUSH_ERR,
	      "exit_dirty: we see DISCONNECTED and our Receive flushed");
	ibv_dereg_mr(mr);
	teardown(&e, NULL);
}

/* The child of `async_device_fatal` (STAG_FAULT_INJECT=engine-panic: the
 * engine thread dies as it starts): prints "fatal N" for N DEVICE_FATAL
 * events read from a fresh context within 5 s. */
static int device_fatal_main(void)
{
	struct ibv_context *ctx = open_stag0();
	int n = 0;
	struct ibv_async_event ev;
	double end = now_s() + 5;
	while (now_s() < end && !n) {
		struct pollfd pfd = { .fd = ctx->async_fd, .events = POLLIN };
		if (poll(&pfd, 1, 100) != 1 || ibv_get_async_event(ctx, &ev))
			continue;
		n += ev.event_type == IBV_EVENT_DEVICE_FATAL;
		ibv_ack_async_event(&ev);
	}
	printf("fatal %d\n", n);
	return 0;
}

static void case_async_device_fatal(void)
{
	FILE *o;
	pid_t pid = spawn_self("--device-fatal", "STAG_FAULT_INJECT", "engine-panic", -1, &o);
	int n = -1;
	if (!o || fscanf(o, "fatal %d", &n) != 1)
		n = -1;
	if (o)
		fclose(o);
	int st = wait_exit(pid, 10);
	CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0 && n == 1,
	      "async_device_fatal: the engine thread's death raises IBV_EVENT_DEVICE_FATAL (%d; status %#x)",
	      n, st);
}

static const struct {
	const char *name;
	void (*run)(void);
} cases[] = {
	{ "sigpipe", case_sigpipe },	     { "peer_close", case_peer_close },
	{ "kill_recv", case_kill_recv },
	{ "dereg_inflight", case_dereg_inflight }, { "full_sq", case_full_sq },
	{ "post_error", case_post_error },   { "destroy_qp", case_destroy_qp },
	{ "destroy_clean", case_destroy_clean },
	{ "async", case_async },	     { "async_destroy", case_async_destroy },
	{ "async_reset", case_async_reset }, { "async_disconnect", case_async_disconnect },
	{ "async_last_wqe", case_async_last_wqe }, { "async_cq_err", case_async_cq_err },
	{ "async_srq_limit", case_async_srq_limit }, { "async_device_fatal", case_async_device_fatal },
	{ "fork", case_fork },	     { "exit_dirty", case_exit_dirty },
	{ "busy", case_busy },	     { "log_flood", case_log_flood },
};

int main(int argc, char **argv)
{
	/* SIGPIPE as a C program started from a shell has it, whatever
	 * started us (a Rust parent may leave it ignored). */
	signal(SIGPIPE, SIG_DFL);
	if (argc == 3 && !strcmp(argv[1], "--peer"))
		return peer_main(argv[2]);
	if (argc == 2 && !strcmp(argv[1], "--flood"))
		return flood_main();
	if (argc == 2 && !strcmp(argv[1], "--device-fatal"))
		return device_fatal_main();
	static char exe[4096];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
	if (n <= 0)
		DIE("readlink");
	self_exe = exe;
	if (argc == 3 && !strcmp(argv[1], "--fork-run"))
		return fork_run(atoi(argv[2]));
	setvbuf(stdout, NULL, _IOLBF, 0);
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		int want = argc == 1;
		for (int a = 1; a < argc; a++)
			want |= !strcmp(argv[a], cases[i].name);
		if (!want)
			continue;
		int before = failed;
		cases[i].run();
		printf("%s %s\n", failed == before ? "ok  " : "FAIL", cases[i].name);
	}
	return test_summary();
}
