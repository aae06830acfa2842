/*
 * The rate at which one core's writes reach another core: a probe of the
 * machine, not of stag. A thread on CPU 0 fills a 256 KiB buffer, a thread
 * on CPU 1 reads it all, and they take turns through one flag; the probe
 * prints the median MB/s of its 100 ms windows over SECONDS.
 *
 * Every loopback byte stag0 (or plain TCP) moves between two processes on
 * two cores makes this trip. On this 2-vCPU VM the rate flips between
 * about 5000 and 1500 MB/s in phases of 0.5-4 s, with no process of ours
 * involved (the host moves the vCPUs); a bandwidth figure measured in a
 * slow phase is about 2.5x lower for that reason alone.
 * scripts/bench/bench-apps.sh prints it per round beside its rows.
 *
 *   core_copy [SECONDS] [-v]    (default 1 s; -v prints every window)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { LEN = 256 * 1024, MAX_WINDOWS = 100000 };

static unsigned char *buf;
static atomic_int turn; /* 0: the writer's, 1: the reader's */
static atomic_int done;
static volatile unsigned long sink;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int pin(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *reader(void *arg)
{
    (void)arg;
    if (pin(1) != 0) {
        fprintf(stderr, "core_copy: cannot run on CPU 1\n");
        exit(1);
    }
    unsigned long sum = 0;
    while (!atomic_load(&done)) {
        if (atomic_load_explicit(&turn, memory_order_acquire) != 1)
            continue;
        const unsigned long *words = (const unsigned long *)buf;
        for (size_t i = 0; i < LEN / sizeof *words; i++)
            sum += words[i];
        sink = sum;
        atomic_store_explicit(&turn, 0, memory_order_release);
    }
    return NULL;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 1.0;
    int verbose = argc > 2 && strcmp(argv[2], "-v") == 0;
    static double rates[MAX_WINDOWS];
    size_t windows = 0;
    pthread_t thread;

    buf = aligned_alloc(4096, LEN);
    if (!buf || pin(0) != 0) {
        fprintf(stderr, "core_copy: needs two CPUs and %d bytes\n", LEN);
        return 1;
    }
    memset(buf, 0, LEN);
    if (pthread_create(&thread, NULL, reader, NULL) != 0)
        return 1;
    double start = now(), window = start;
    long copies = 0;
    for (int fill = 1; now() - start < secs; fill++) {
        memset(buf, fill, LEN);
        atomic_store_explicit(&turn, 1, memory_order_release);
        while (atomic_load_explicit(&turn, memory_order_acquire) != 0)
            ;
        copies++;
        double t = now();
        if (t - window >= 0.1 && windows < MAX_WINDOWS) {
            rates[windows] = copies * (double)LEN / (t - window) / 1e6;
            if (verbose)
                fprintf(stderr, "%.0f ", rates[windows]);
            windows++;
            copies = 0;
            window = t;
        }
    }
    atomic_store(&done, 1);
    pthread_join(thread, NULL);
    if (verbose)
        fputc('\n', stderr);
    if (windows == 0)
        return 1;
    qsort(rates, windows, sizeof *rates, cmp);
    printf("%.0f\n", rates[windows / 2]);
    return 0;
}
