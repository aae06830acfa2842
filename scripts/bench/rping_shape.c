/*
 * rping's shape over plain TCP: what one `rping -C` iteration costs when
 * every step is as cheap as the transport allows, so that stag0's rping
 * row (#19: "rping ≤ 6× the blocking TCP round trip") can be set beside
 * what rping's own design needs, measured in the same run.
 *
 * rping (librdmacm/examples/rping.c) runs two threads per process: its main
 * thread posts and waits on a semaphore, its CQ thread sleeps on the
 * completion channel and posts that semaphore for each completion that
 * moves the test on. One iteration is six messages in sequence, each on
 * the critical path:
 *
 *   client main   Send READ_ADV                       -> server CQ thread, sem_post
 *   server main   RDMA Read request                   -> client "RNIC" answers
 *   client        Read Response                       -> server CQ thread, sem_post
 *   server main   Send GO                             -> client CQ thread, sem_post
 *   client main   Send WRITE_ADV                      -> server CQ thread, sem_post
 *   server main   RDMA Write, then its completion     -> server CQ thread, sem_post
 *   server main   Send GO                             -> client CQ thread, sem_post
 *
 * Here each message is 16 bytes on a blocking TCP socket; a CQ thread is
 * a thread asleep in poll(2) on the socket and an eventfd; a completion
 * raised locally (the Write's, and with -e every signaled Send's, as a
 * verbs device reports them to rping's armed CQ) is an eventfd write that
 * wakes it; the Read responder is the client's CQ thread, as on a
 * software RNIC (stag0 answers a Read Request from whichever thread is
 * awake). Nothing else: no RDMA protocol, no CRC, no copies to speak of.
 *
 *   rping_shape server PORT ITERS [-e]
 *   rping_shape client HOST PORT ITERS [-e]   prints us per iteration
 *
 * Not a test: scripts/bench/bench-apps.sh measures it beside rping.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum msg { READ_ADV = 1, READ_REQ, READ_RESP, GO, WRITE_ADV, WRITE_DATA };
enum { MSG_LEN = 16 };

static int sock, evfd, server, send_events;
static long iters;
static sem_t sem;
static volatile int stop;

static void die(const char *what)
{
	perror(what);
	exit(1);
}

static void put(enum msg m)
{
	unsigned char b[MSG_LEN] = { (unsigned char)m };
	size_t off = 0;
	while (off < MSG_LEN) {
		ssize_t n = send(sock, b + off, MSG_LEN - off, MSG_NOSIGNAL);
		if (n < 0 && errno != EINTR)
			die("send");
		if (n > 0)
			off += (size_t)n;
	}
}

/* A completion raised locally: the CQ thread's channel fires. */
static void complete_locally(uint64_t what)
{
	if (write(evfd, &what, sizeof what) != sizeof what)
		die("eventfd write");
}

/* A Send posted by the main thread, signaled as rping's are. */
static void post_send(enum msg m)
{
	put(m);
	if (send_events)
		complete_locally(1);
}

/* The CQ thread: sleeps on the socket and the eventfd. */
static void *cq_thread(void *arg)
{
	unsigned char buf[4096];
	size_t have = 0;
	(void)arg;
	while (!stop) {
		struct pollfd p[2] = { { sock, POLLIN, 0 }, { evfd, POLLIN, 0 } };
		if (poll(p, 2, -1) < 0) {
			if (errno == EINTR)
				continue;
			die("poll");
		}
		if (p[1].revents & POLLIN) {
			uint64_t v;
			if (read(evfd, &v, sizeof v) != sizeof v)
				die("eventfd read");
			/* The server's Write completion (2) moves it on; a Send's
			 * completion (1) is only reaped, as rping does. */
			if (server && v >= 2)
				sem_post(&sem);
		}
		if (!(p[0].revents & (POLLIN | POLLHUP)))
			continue;
		ssize_t n = recv(sock, buf + have, sizeof buf - have, 0);
		if (n <= 0)
			return NULL;
		have += (size_t)n;
		size_t at = 0;
		for (; have - at >= MSG_LEN; at += MSG_LEN) {
			switch (buf[at]) {
			case READ_REQ:
				put(READ_RESP); /* the RNIC's answer */
				break;
			case WRITE_DATA:
				break; /* placed; no completion at the target */
			default:
				sem_post(&sem);
			}
		}
		memmove(buf, buf + at, have - at);
		have -= at;
	}
	return NULL;
}

static void run_server(void)
{
	for (long i = 0; i < iters; i++) {
		sem_wait(&sem); /* READ_ADV */
		put(READ_REQ);
		sem_wait(&sem); /* the Read's completion */
		post_send(GO);
		sem_wait(&sem); /* WRITE_ADV */
		put(WRITE_DATA);
		complete_locally(2);
		sem_wait(&sem); /* the Write's completion */
		post_send(GO);
	}
}

static void run_client(void)
{
	for (long i = 0; i < iters; i++) {
		post_send(READ_ADV);
		sem_wait(&sem); /* GO */
		post_send(WRITE_ADV);
		sem_wait(&sem); /* GO after the Write */
	}
}

int main(int argc, char **argv)
{
	if (argc < 4)
		goto usage;
	server = strcmp(argv[1], "server") == 0;
	if (!server && (strcmp(argv[1], "client") != 0 || argc < 5))
		goto usage;
	const char *host = server ? "0.0.0.0" : argv[2];
	int port = atoi(argv[server ? 2 : 3]);
	iters = atol(argv[server ? 3 : 4]);
	send_events = strcmp(argv[argc - 1], "-e") == 0;

	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
	if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
		goto usage;
	int one = 1;
	if (server) {
		int l = socket(AF_INET, SOCK_STREAM, 0);
		setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
		if (bind(l, (void *)&a, sizeof a) || listen(l, 1))
			die("listen");
		sock = accept(l, NULL, NULL);
		close(l);
	} else {
		sock = socket(AF_INET, SOCK_STREAM, 0);
		struct timespec pause = { 0, 10000000 };
		for (int tries = 0; connect(sock, (void *)&a, sizeof a); tries++) {
			if (tries == 300)
				die("connect");
			nanosleep(&pause, NULL);
		}
	}
	if (sock < 0)
		die("socket");
	setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	evfd = eventfd(0, EFD_CLOEXEC);
	if (evfd < 0 || sem_init(&sem, 0, 0))
		die("eventfd/sem_init");
	pthread_t t;
	if (pthread_create(&t, NULL, cq_thread, NULL))
		die("pthread_create");

	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	if (server)
		run_server();
	else
		run_client();
	clock_gettime(CLOCK_MONOTONIC, &t1);
	stop = 1;
	if (!server) {
		double us = (double)(t1.tv_sec - t0.tv_sec) * 1e6 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e3;
		printf("%.3f\n", us / (double)iters);
	}
	shutdown(sock, SHUT_RDWR);
	pthread_join(t, NULL);
	return 0;
usage:
	fprintf(stderr, "usage: rping_shape server PORT ITERS [-e] | client HOST PORT ITERS [-e]\n");
	return 2;
}
