/* The raw-TCP floor in plain C, to check `stag floor` against: the same
 * measurements with nothing between the program and the socket calls.
 *
 *   floor_check lat server|client PORT SIZE ITERS [busy|blocking]
 *   floor_check bw  server|client PORT SIZE ITERS [busy|blocking]
 *
 * lat: SIZE-byte ping-pong, 100 warm-up rounds (as stag), prints the
 * median one-way (RTT/2) and round trip. bw: ITERS sends of SIZE bytes,
 * the receiver draining in reads of up to 1 MiB, closed by a 1-byte ack;
 * prints MiB/s and messages/s. busy: non-blocking sockets and spin loops.
 * Client output is one JSON line with stag's keys. Client connects to
 * 127.0.0.1. Build: cc -O2 -o floor_check floor_check.c */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (1 << 20)

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

/* Move exactly n bytes (rd: recv, else send), spinning on EAGAIN. */
static void full(int fd, char *b, size_t n, int rd) {
    size_t d = 0;
    while (d < n) {
        ssize_t k = rd ? recv(fd, b + d, n - d, 0) : send(fd, b + d, n - d, MSG_NOSIGNAL);
        if (k > 0) {
            d += (size_t)k;
        } else if (k == 0) {
            fprintf(stderr, "peer closed\n");
            exit(1);
        } else if (errno != EAGAIN && errno != EINTR) {
            die(rd ? "recv" : "send");
        }
    }
}

static void drain(int fd, char *b, unsigned long long total) {
    while (total > 0) {
        size_t want = total < CHUNK ? (size_t)total : CHUNK;
        ssize_t k = recv(fd, b, want, 0);
        if (k > 0) {
            total -= (unsigned long long)k;
        } else if (k == 0) {
            fprintf(stderr, "peer closed\n");
            exit(1);
        } else if (errno != EAGAIN && errno != EINTR) {
            die("recv");
        }
    }
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 6 || argc > 7) {
        fprintf(stderr, "usage: %s lat|bw server|client PORT SIZE ITERS [busy|blocking]\n", argv[0]);
        return 2;
    }
    int bw = !strcmp(argv[1], "bw"), server = !strcmp(argv[2], "server");
    int port = atoi(argv[3]);
    size_t size = (size_t)atol(argv[4]);
    long iters = atol(argv[5]);
    int busy = argc < 7 || !strcmp(argv[6], "busy");
    if (size == 0 || iters <= 0) return 2;
    char *buf = calloc(1, size > CHUNK ? size : CHUNK);
    int one = 1, fd;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port)};
    if (server) {
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        int l = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (void *)&a, sizeof a) || listen(l, 1)) die("listen");
        fd = accept(l, 0, 0);
        if (fd < 0) die("accept");
        close(l);
    } else {
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int tries = 0;
        for (;;) {
            fd = socket(AF_INET, SOCK_STREAM, 0);
            if (!connect(fd, (void *)&a, sizeof a)) break;
            if (++tries > 500) die("connect");
            close(fd);
            usleep(20000);
        }
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (busy) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    if (bw) {
        if (server) {
            drain(fd, buf, (unsigned long long)size * (unsigned long long)iters);
            full(fd, buf, 1, 0);
        } else {
            double t0 = now_ns();
            for (long i = 0; i < iters; i++) full(fd, buf, size, 0);
            full(fd, buf, 1, 1);
            double s = (now_ns() - t0) / 1e9;
            printf("{\"test\": \"bw\", \"mode\": \"%s\", \"results\": [{\"bytes\": %zu, "
                   "\"iterations\": %ld, \"bw_avg_mb_s\": %.3f, \"msg_rate_mpps\": %.6f}]}\n",
                   busy ? "busy" : "blocking", size, iters,
                   (double)size * (double)iters / s / 1048576.0, (double)iters / s / 1e6);
        }
        return 0;
    }
    long warm = iters < 100 ? iters : 100;
    double *t = calloc((size_t)iters, sizeof *t);
    for (long i = 0; i < warm + iters; i++) {
        double t0 = now_ns();
        if (server) {
            full(fd, buf, size, 1);
            full(fd, buf, size, 0);
        } else {
            full(fd, buf, size, 0);
            full(fd, buf, size, 1);
        }
        if (i >= warm) t[i - warm] = (now_ns() - t0) / 1e3;
    }
    if (!server) {
        double sum = 0;
        for (long i = 0; i < iters; i++) sum += t[i];
        qsort(t, (size_t)iters, sizeof *t, cmp);
        double med = iters % 2 ? t[iters / 2] : (t[iters / 2 - 1] + t[iters / 2]) / 2;
        printf("{\"test\": \"lat\", \"mode\": \"%s\", \"results\": [{\"bytes\": %zu, "
               "\"iterations\": %ld, \"t_typical_us\": %.3f, \"t_avg_us\": %.3f, "
               "\"rtt_typical_us\": %.3f, \"rtt_avg_us\": %.3f}]}\n",
               busy ? "busy" : "blocking", size, iters, med / 2, sum / iters / 2, med, sum / iters);
    }
    return 0;
}
