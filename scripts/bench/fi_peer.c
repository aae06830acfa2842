/* libfabric's figures for bench-peers' rows that fi_pingpong cannot give:
 * RMA Write and Read, FetchAdd, and 1 MiB Write/Read bandwidth, written
 * against libfabric-dev the way an application would use it.
 *
 *   fi_peer -p PROV -b PORT ADDR [-m MODE]            (server: one client, then exits)
 *   fi_peer -p PROV -P PORT ADDR OP [-s SIZE] [-n ITERS] [-w WINDOW] [-m MODE] [--json]
 *
 * OP is one of
 *   write      SIZE-byte RMA Write ping-pong; each side spins on the last 8
 *              bytes of its own buffer for the peer's Write (perftest's
 *              ib_write_lat, stag lat write); reports half the round trip.
 *   read       one SIZE-byte RMA Read at a time: the full round trip.
 *   fetch-add  one fi_fetch_atomic(FI_SUM, FI_UINT64, +1) at a time: the
 *              round trip; every fetched value is checked (0, 1, 2, ...).
 *   bw-write   ITERS RMA Writes of SIZE bytes, WINDOW in flight: MiB/s.
 *   bw-read    the same with RMA Reads.
 *
 * Endpoint: FI_EP_RDM (reliable datagram), as the benchmarks' users get
 * it from libfabric: "tcp;ofi_rxm" over TCP and "verbs;ofi_rxm" over an
 * RNIC (stag0 under `stag run`). rxm passes RMA to the connected endpoint
 * beneath it (native RDMA Write/Read on verbs, the tcp provider's RMA
 * protocol on tcp) and carries atomics as messages that the target's
 * progress applies; the verbs provider gives FI_EP_MSG no atomics on
 * iWARP, so RDM is the one type on which every operation exists on both.
 *
 * Progress (-m, each side its own): busy (the default) polls the CQ with
 * fi_cq_read in a loop, which is what drives both providers (manual
 * progress); blocking waits in fi_cq_sread on the CQ's wait object, as
 * stag's and the floor's blocking modes wait in the kernel (not for write:
 * its ping-pong polls memory). The server does nothing but progress until
 * the client says done. In blocking mode libfabric 1.17's verbs provider
 * (vrb_cq_trywait) drains the completion channel, which it made
 * O_NONBLOCK, with ibv_get_cq_event until that fails with EAGAIN; stag's
 * plugin once slept in it there (fixed, cq_events.c case 5).
 * Latencies are medians of the per-operation
 * times after 100 untimed warm-up operations. The client's stdout is one
 * line (JSON with stag's keys under --json: t_typical_us, t_avg_us,
 * t_min_us, p99_us, or bw_avg_mb_s, counted until a message sent after
 * the last operation has been answered). A completion error is fatal, and
 * so is a peer that does not answer for 30 s, except for the server while
 * the client runs (one-sided operations complete nothing on the server,
 * so it waits for the client's done without a limit); the exit status is
 * then 1.
 *
 * Build: cc -O2 -Wall -o fi_peer fi_peer.c -lfabric (Debian: libfabric-dev) */
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <rdma/fabric.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define MAGIC 0x73746167u /* "stag" */
#define WARMUP 100
#define STALL_NS 30e9
#define MAX_NAME 256
#define MAX_WINDOW 256
#define SREAD_MS 100

static int blocking; /* -m blocking: wait in fi_cq_sread */

enum op { OP_WRITE, OP_READ, OP_FETCH_ADD, OP_BW_WRITE, OP_BW_READ, OP_DONE };
static const char *const OP_NAMES[] = {"write", "read", "fetch-add", "bw-write", "bw-read"};

/* The client's first message: what to run, where its buffer is, and its
 * address for the server's address vector (RDM receives carry no source). */
struct hello {
    uint32_t magic, op;
    uint64_t size, iters, addr, key, name_len;
    uint8_t name[MAX_NAME];
};
/* The server's answer, and the closing pair (client: OP_DONE; server:
 * status 0 and, after a FetchAdd run, its counter). */
struct reply {
    uint32_t magic, op;
    uint64_t addr, key, status, counter;
};

/* One registered buffer: a control page, then SIZE bytes where the peer's
 * Writes land (and Reads are read from), then SIZE bytes this side's
 * Writes are sent from. */
struct layout {
    uint64_t ping;    /* the write ping-pong lands here (data's last 8 bytes when SIZE >= 8) */
    uint64_t pad0[7];
    uint64_t counter; /* FetchAdd target */
    uint64_t pad1[7];
    uint64_t operand, result;
    uint64_t pad2[6];
    struct hello hello_in, hello_out;
    struct reply reply_in, reply_out;
};
#define CTRL 4096
_Static_assert(sizeof(struct layout) <= CTRL, "the control page holds the layout");

struct peer {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    struct fid_mr *mr;
    void *desc;
    uint8_t *buf; /* CTRL + 2 * size bytes */
    struct layout *ctl;
    size_t size;
    fi_addr_t remote;
    uint64_t remote_addr, remote_key; /* of the peer's buffer (its start) */
    struct fi_context2 rx_ctx, msg_ctx, ctx[MAX_WINDOW];
    uint64_t rx_done, tx_done;
};

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fi_peer: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void check(int rc, const char *what) {
    if (rc)
        die("%s: %s (%d)", what, fi_strerror(-rc), rc);
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

/* Reap what the CQ has (this is also what makes the provider progress),
 * in blocking mode waiting up to SREAD_MS for something; a completion
 * error is fatal. Returns how many completions it took. */
static int progress(struct peer *p) {
    struct fi_cq_entry e[16];
    ssize_t n = blocking ? fi_cq_sread(p->cq, e, 16, NULL, SREAD_MS) : fi_cq_read(p->cq, e, 16);
    if (n == -FI_EAGAIN)
        return 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry err = {0};
        fi_cq_readerr(p->cq, &err, 0);
        die("completion error: %s (prov_errno %d: %s)", fi_strerror(err.err), err.prov_errno,
            fi_cq_strerror(p->cq, err.prov_errno, err.err_data, NULL, 0));
    }
    if (n < 0)
        check((int)n, "fi_cq_read");
    for (ssize_t i = 0; i < n; i++) {
        if (e[i].op_context == &p->rx_ctx)
            p->rx_done++;
        else
            p->tx_done++;
    }
    return (int)n;
}

/* Spin until *count reaches want, failing after STALL_NS without a
 * completion (the peer is gone or stuck). */
static void wait_count(struct peer *p, const uint64_t *count, uint64_t want, const char *what) {
    double last = now_ns();
    while (*count < want) {
        if (progress(p) > 0)
            last = now_ns();
        else if (now_ns() - last > STALL_NS)
            die("no completion for 30 s while waiting for %s", what);
    }
}

/* Post with fi_* call EXPR, progressing while the provider says EAGAIN. */
#define POST(p, what, expr)                                                                     \
    do {                                                                                        \
        ssize_t rc_;                                                                            \
        double t0_ = now_ns();                                                                  \
        while ((rc_ = (expr)) == -FI_EAGAIN) {                                                  \
            progress(p);                                                                        \
            if (now_ns() - t0_ > STALL_NS)                                                      \
                die("%s: queue full for 30 s", what);                                           \
        }                                                                                       \
        check((int)rc_, what);                                                                  \
    } while (0)

static void open_peer(struct peer *p, const char *prov, const char *node, const char *service,
                      int server, size_t size) {
    struct fi_info *hints = fi_allocinfo();
    if (!hints)
        die("fi_allocinfo failed");
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA | FI_ATOMIC;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(prov);
    int rc = fi_getinfo(FI_VERSION(1, 9), node, service, server ? FI_SOURCE : 0, hints, &p->info);
    fi_freeinfo(hints);
    if (rc)
        die("fi_getinfo(%s, %s:%s): %s (%d)", prov, node, service, fi_strerror(-rc), rc);
    struct fi_info *fi = p->info;

    check(fi_fabric(fi->fabric_attr, &p->fabric, NULL), "fi_fabric");
    check(fi_domain(p->fabric, fi, &p->domain, NULL), "fi_domain");
    struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_CONTEXT, .size = 1024,
                                 .wait_obj = blocking ? FI_WAIT_UNSPEC : FI_WAIT_NONE};
    check(fi_cq_open(p->domain, &cq_attr, &p->cq, NULL), "fi_cq_open");
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE, .count = 2};
    check(fi_av_open(p->domain, &av_attr, &p->av, NULL), "fi_av_open");
    check(fi_endpoint(p->domain, fi, &p->ep, NULL), "fi_endpoint");
    check(fi_ep_bind(p->ep, &p->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    check(fi_ep_bind(p->ep, &p->av->fid, 0), "fi_ep_bind(av)");
    check(fi_enable(p->ep), "fi_enable");

    p->size = size;
    if (posix_memalign((void **)&p->buf, 4096, CTRL + 2 * size))
        die("out of memory");
    memset(p->buf, 0, CTRL + 2 * size);
    p->ctl = (struct layout *)p->buf;
    check(fi_mr_reg(p->domain, p->buf, CTRL + 2 * size,
                    FI_SEND | FI_RECV | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE, 0,
                    0x5a9, 0, &p->mr, NULL),
          "fi_mr_reg");
    p->desc = fi_mr_desc(p->mr);
}

/* This side's buffer as the peer addresses it. */
static uint64_t local_addr(const struct peer *p) {
    return (p->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)p->buf : 0;
}

static uint64_t remote_at(const struct peer *p, size_t off) { return p->remote_addr + off; }

static void send_msg(struct peer *p, void *msg, size_t len) {
    uint64_t want = p->tx_done + 1;
    POST(p, "fi_send", fi_send(p->ep, msg, len, p->desc, p->remote, &p->msg_ctx));
    wait_count(p, &p->tx_done, want, "a send");
}

static void post_recv(struct peer *p, void *msg, size_t len) {
    POST(p, "fi_recv", fi_recv(p->ep, msg, len, p->desc, FI_ADDR_UNSPEC, &p->rx_ctx));
}

/* Where the peer's Writes land, and where this side's are sent from. */
static uint8_t *landing(struct peer *p) { return p->buf + CTRL; }
static uint8_t *source(struct peer *p) { return p->buf + CTRL + p->size; }

/* Write ping-pong, one side: if `first`, write then wait, else wait then
 * write; the last 8 bytes of each Write carry its number. Stores the
 * round-trip times in rtt (the side that goes first). */
static void write_pingpong(struct peer *p, uint64_t iters, int first, double *rtt) {
    volatile uint64_t *mine = (volatile uint64_t *)(landing(p) + p->size - 8);
    uint64_t *out = (uint64_t *)(source(p) + p->size - 8);
    size_t inject = p->info->tx_attr->inject_size;
    for (uint64_t i = 1; i <= iters; i++) {
        double t0 = now_ns();
        if (!first) {
            double last = now_ns();
            while (*mine != i) {
                if (progress(p) > 0)
                    last = now_ns();
                else if (now_ns() - last > STALL_NS)
                    die("write %" PRIu64 ": no ping from the peer for 30 s", i);
            }
        }
        *out = i;
        if (p->size <= inject) {
            POST(p, "fi_inject_write",
                 fi_inject_write(p->ep, source(p), p->size, p->remote, remote_at(p, CTRL),
                                 p->remote_key));
        } else {
            uint64_t want = p->tx_done + 1;
            POST(p, "fi_write",
                 fi_write(p->ep, source(p), p->size, p->desc, p->remote, remote_at(p, CTRL),
                          p->remote_key, &p->ctx[0]));
            wait_count(p, &p->tx_done, want, "a write");
        }
        if (first) {
            double last = now_ns();
            while (*mine != i) {
                if (progress(p) > 0)
                    last = now_ns();
                else if (now_ns() - last > STALL_NS)
                    die("write %" PRIu64 ": no pong from the peer for 30 s", i);
            }
            if (rtt)
                rtt[i - 1] = now_ns() - t0;
        }
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void run_server(const char *prov, const char *node, const char *port) {
    struct peer p = {0};
    /* The data size is the client's choice: register for the largest
     * (1 MiB, bench-peers' bandwidth size) unless told otherwise. */
    const char *max = getenv("FI_PEER_MAX_SIZE");
    size_t size = max ? strtoull(max, NULL, 0) : (1 << 20);
    if (size < 8)
        size = 8;
    open_peer(&p, prov, node, port, 1, size);
    struct layout *c = p.ctl;

    post_recv(&p, &c->hello_in, sizeof c->hello_in);
    /* The client may come late: no stall limit on its hello. */
    while (p.rx_done < 1)
        progress(&p);
    struct hello *h = &c->hello_in;
    if (h->magic != MAGIC || h->name_len > MAX_NAME || h->op >= OP_DONE || h->size > size ||
        h->size < 8)
        die("bad hello (op %u, size %" PRIu64 ", this server's largest %zu)", h->op, h->size,
            size);
    p.size = h->size;
    if (fi_av_insert(p.av, h->name, 1, &p.remote, 0, NULL) != 1)
        die("fi_av_insert of the client's address failed");
    p.remote_addr = h->addr;
    p.remote_key = h->key;

    /* Receive OP_DONE from here on, before the reply lets the client start. */
    post_recv(&p, &c->reply_in, sizeof c->reply_in);
    c->reply_out = (struct reply){.magic = MAGIC, .op = h->op, .addr = local_addr(&p),
                                  .key = fi_mr_key(p.mr)};
    send_msg(&p, &c->reply_out, sizeof c->reply_out);

    if (h->op == OP_WRITE)
        write_pingpong(&p, h->iters + WARMUP, 0, NULL);
    /* Everything else is the client's: progress until it is done. One-sided
     * operations complete nothing here, so there is no stall limit: a
     * client that dies silently leaves this to its caller's timeout. */
    while (p.rx_done < 2)
        progress(&p);
    if (c->reply_in.magic != MAGIC || c->reply_in.op != OP_DONE)
        die("bad done message");
    c->reply_out = (struct reply){.magic = MAGIC, .op = OP_DONE, .counter = c->counter};
    send_msg(&p, &c->reply_out, sizeof c->reply_out);
}

static double median_of(double *v, size_t n) {
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void run_client(const char *prov, const char *node, const char *port, enum op op,
                       size_t size, uint64_t iters, unsigned window, int json) {
    struct peer p = {0};
    open_peer(&p, prov, node, port, 0, size);
    struct layout *c = p.ctl;
    if (fi_av_insert(p.av, p.info->dest_addr, 1, &p.remote, 0, NULL) != 1)
        die("fi_av_insert of the server's address failed");
    if (op == OP_FETCH_ADD) {
        size_t count = 0;
        if (fi_fetch_atomicvalid(p.ep, FI_UINT64, FI_SUM, &count) || count < 1)
            die("provider %s has no fetching FI_SUM on FI_UINT64", prov);
    }

    struct hello *h = &c->hello_out;
    *h = (struct hello){.magic = MAGIC, .op = op, .size = size, .iters = iters,
                        .addr = local_addr(&p), .key = fi_mr_key(p.mr)};
    size_t name_len = MAX_NAME;
    check(fi_getname(&p.ep->fid, h->name, &name_len), "fi_getname");
    h->name_len = name_len;
    post_recv(&p, &c->reply_in, sizeof c->reply_in);
    send_msg(&p, h, sizeof *h);
    wait_count(&p, &p.rx_done, 1, "the server's reply");
    if (c->reply_in.magic != MAGIC || c->reply_in.op != op)
        die("bad reply from the server");
    p.remote_addr = c->reply_in.addr;
    p.remote_key = c->reply_in.key;

    double *t = calloc(iters + WARMUP, sizeof *t);
    if (!t)
        die("out of memory");
    double bw = 0, bw_t0 = 0;
    size_t lat_factor = 1;
    switch (op) {
    case OP_WRITE:
        write_pingpong(&p, iters + WARMUP, 1, t);
        lat_factor = 2;
        break;
    case OP_READ:
    case OP_FETCH_ADD:
        c->operand = 1;
        for (uint64_t i = 0; i < iters + WARMUP; i++) {
            uint64_t want = p.tx_done + 1;
            double t0 = now_ns();
            if (op == OP_READ)
                POST(&p, "fi_read",
                     fi_read(p.ep, landing(&p), size, p.desc, p.remote, remote_at(&p, CTRL),
                             p.remote_key, &p.ctx[0]));
            else
                POST(&p, "fi_fetch_atomic",
                     fi_fetch_atomic(p.ep, &c->operand, 1, p.desc, &c->result, p.desc, p.remote,
                                     remote_at(&p, offsetof(struct layout, counter)),
                                     p.remote_key, FI_UINT64, FI_SUM, &p.ctx[0]));
            wait_count(&p, &p.tx_done, want, OP_NAMES[op]);
            t[i] = now_ns() - t0;
            if (op == OP_FETCH_ADD && c->result != i)
                die("fetch-add %" PRIu64 " fetched %" PRIu64, i, c->result);
        }
        break;
    case OP_BW_WRITE:
    case OP_BW_READ: {
        if (window < 1 || window > MAX_WINDOW)
            die("window must be 1..%d", MAX_WINDOW);
        /* The first WINDOW completions are the warm-up; the clock starts
         * when they are in, with the pipeline full. */
        uint64_t total = iters + window, posted = 0, base = p.tx_done;
        double t0 = 0;
        while (p.tx_done - base < total) {
            while (posted < total && posted - (p.tx_done - base) < window) {
                struct fi_context2 *ctx = &p.ctx[posted % window];
                if (op == OP_BW_WRITE)
                    POST(&p, "fi_write",
                         fi_write(p.ep, source(&p), size, p.desc, p.remote, remote_at(&p, CTRL),
                                  p.remote_key, ctx));
                else
                    POST(&p, "fi_read",
                         fi_read(p.ep, landing(&p), size, p.desc, p.remote, remote_at(&p, CTRL),
                                 p.remote_key, ctx));
                posted++;
            }
            double last = now_ns();
            while (progress(&p) == 0)
                if (now_ns() - last > STALL_NS)
                    die("%s: no completion for 30 s", OP_NAMES[op]);
            if (t0 == 0 && p.tx_done - base >= window)
                t0 = now_ns();
        }
        /* Timed: the ITERS operations after the warm-up window, until the
         * goodbye below has made its round trip: a Write's completion may
         * only mean its data left, but the server answers the done message
         * after every Write before it (RC order on verbs, one stream on tcp). */
        bw_t0 = t0;
        break;
    }
    default:
        die("unknown op");
    }

    post_recv(&p, &c->reply_in, sizeof c->reply_in);
    c->reply_out = (struct reply){.magic = MAGIC, .op = OP_DONE};
    send_msg(&p, &c->reply_out, sizeof c->reply_out);
    wait_count(&p, &p.rx_done, 2, "the server's goodbye");
    if (op == OP_BW_WRITE || op == OP_BW_READ)
        bw = (double)iters * (double)size / ((now_ns() - bw_t0) / 1e9) / 1048576.0;
    if (op == OP_FETCH_ADD && c->reply_in.counter != iters + WARMUP)
        die("the server's counter is %" PRIu64 " after %" PRIu64 " fetch-adds",
            c->reply_in.counter, iters + WARMUP);

    const char *name = OP_NAMES[op];
    if (op == OP_BW_WRITE || op == OP_BW_READ) {
        if (json)
            printf("{\"program\":\"fi_peer\",\"provider\":\"%s\",\"ep_type\":\"rdm\",\"mode\":\"%s\","
                   "\"results\":[{\"op\":\"%s\",\"bytes\":%zu,\"iterations\":%" PRIu64
                   ",\"window\":%u,\"bw_avg_mb_s\":%.2f}]}\n",
                   prov, blocking ? "blocking" : "busy", name, size, iters, window, bw);
        else
            printf("%s %s %zu B x %" PRIu64 " window %u: %.1f MiB/s\n", prov, name, size, iters,
                   window, bw);
        return;
    }
    double *v = t + WARMUP;
    double sum = 0;
    for (uint64_t i = 0; i < iters; i++) {
        v[i] /= 1e3 * (double)lat_factor;
        sum += v[i];
    }
    double med = median_of(v, iters);
    double p99 = v[(size_t)((double)(iters - 1) * 0.99)];
    if (json)
        printf("{\"program\":\"fi_peer\",\"provider\":\"%s\",\"ep_type\":\"rdm\",\"mode\":\"%s\","
               "\"results\":[{\"op\":\"%s\",\"bytes\":%zu,\"iterations\":%" PRIu64
               ",\"t_typical_us\":%.3f,\"t_avg_us\":%.3f,\"t_min_us\":%.3f,\"p99_us\":%.3f,"
               "\"latency\":\"%s\"}]}\n",
               prov, blocking ? "blocking" : "busy", name, size, iters, med, sum / (double)iters,
               v[0], p99,
               lat_factor == 2 ? "one-way (round trip / 2)" : "round trip");
    else
        printf("%s %s %zu B x %" PRIu64 ": typical %.2f us (%s), avg %.2f, min %.2f, p99 %.2f\n",
               prov, name, size, iters, med, lat_factor == 2 ? "one-way" : "round trip",
               sum / (double)iters, v[0], p99);
}

static void usage(void) {
    fprintf(stderr, "usage: fi_peer -p PROV -b PORT ADDR [-m busy|blocking]\n"
                    "       fi_peer -p PROV -P PORT ADDR write|read|fetch-add|bw-write|bw-read"
                    " [-s SIZE] [-n ITERS] [-w WINDOW] [-m busy|blocking] [--json]\n");
    exit(2);
}

int main(int argc, char **argv) {
    const char *prov = "tcp;ofi_rxm", *port = NULL, *addr = NULL, *opname = NULL;
    int server = -1, json = 0;
    size_t size = 8;
    uint64_t iters = 10000;
    unsigned window = 16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--json"))
            json = 1;
        else if (a[0] == '-' && a[1] && !a[2] && i + 1 < argc) {
            const char *v = argv[++i];
            switch (a[1]) {
            case 'p': prov = v; break;
            case 'b': server = 1; port = v; break;
            case 'P': server = 0; port = v; break;
            case 's': size = strtoull(v, NULL, 0); break;
            case 'n': iters = strtoull(v, NULL, 0); break;
            case 'w': window = (unsigned)strtoul(v, NULL, 0); break;
            case 'm':
                if (strcmp(v, "busy") && strcmp(v, "blocking"))
                    usage();
                blocking = !strcmp(v, "blocking");
                break;
            default: usage();
            }
        } else if (!addr)
            addr = a;
        else if (!opname)
            opname = a;
        else
            usage();
    }
    if (server < 0 || !addr || (server == 1) != (opname == NULL))
        usage();
    if (server) {
        run_server(prov, addr, port);
        return 0;
    }
    enum op op = OP_DONE;
    for (int i = 0; i < OP_DONE; i++)
        if (!strcmp(opname, OP_NAMES[i]))
            op = (enum op)i;
    if (op == OP_DONE)
        usage();
    if (size < 8 || iters < 1)
        die("SIZE must be at least 8 and ITERS at least 1");
    if (op == OP_FETCH_ADD)
        size = 8;
    if (op == OP_WRITE && blocking)
        die("write latency polls memory for the peer's Write (as ib_write_lat); use -m busy");
    run_client(prov, addr, port, op, size, iters, window, json);
    return 0;
}
