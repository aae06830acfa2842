/* An MPI test that checks its results: allreduce, alltoall, a ring of
 * point-to-point messages from 1 byte to 4 MiB, and (with --rma) MPI
 * one-sided operations in passive-target epochs. Every rank verifies what
 * it received; any mismatch aborts the job with a message naming it.
 * Prints "mpi-check: ok (N ranks, ...)" from rank 0 when all passed.
 * Build: mpicc -O2 -o mpi_check mpi_check.c */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, size;

static void fail(const char *what, long at, long got, long want)
{
    fprintf(stderr, "mpi-check: rank %d: %s: at %ld got %ld, want %ld\n", rank, what, at, got,
            want);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* A byte every rank can predict: message `tag` from `src`, offset `i`. */
static unsigned char pattern(int src, int tag, size_t i)
{
    return (unsigned char)(src * 31 + tag * 7 + i * 13 + (i >> 10));
}

static void allreduce(void)
{
    /* 8 B, then 1 MiB of doubles: element i sums to sum over ranks of
     * (rank + i), exact in double. */
    size_t counts[] = {1, 131072};
    for (int c = 0; c < 2; c++) {
        size_t n = counts[c];
        double *in = malloc(n * sizeof *in), *out = malloc(n * sizeof *out);
        for (size_t i = 0; i < n; i++)
            in[i] = rank + (double)i;
        MPI_Allreduce(in, out, (int)n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        double ranks = (double)size * (size - 1) / 2;
        for (size_t i = 0; i < n; i++)
            if (out[i] != ranks + (double)i * size)
                fail("allreduce", (long)i, (long)out[i], (long)(ranks + (double)i * size));
        free(in);
        free(out);
    }
    long mx, mine = rank * 3 + 1;
    MPI_Allreduce(&mine, &mx, 1, MPI_LONG, MPI_MAX, MPI_COMM_WORLD);
    if (mx != (size - 1) * 3 + 1)
        fail("allreduce max", 0, mx, (size - 1) * 3 + 1);
}

static void alltoall(void)
{
    /* 4 ints and 16 KiB per peer. */
    int per[] = {4, 4096};
    for (int c = 0; c < 2; c++) {
        int n = per[c];
        int *out = malloc((size_t)n * size * sizeof *out);
        int *in = malloc((size_t)n * size * sizeof *in);
        for (int d = 0; d < size; d++)
            for (int i = 0; i < n; i++)
                out[d * n + i] = rank * 1000000 + d * 1000 + i % 1000;
        MPI_Alltoall(out, n, MPI_INT, in, n, MPI_INT, MPI_COMM_WORLD);
        for (int s = 0; s < size; s++)
            for (int i = 0; i < n; i++) {
                int want = s * 1000000 + rank * 1000 + i % 1000;
                if (in[s * n + i] != want)
                    fail("alltoall", s * n + i, in[s * n + i], want);
            }
        free(out);
        free(in);
    }
}

static void ring(void)
{
    /* Each size goes once around the ring: rank sends to rank+1 and
     * receives from rank-1, with Isend/Recv so no rank waits on another. */
    size_t max = 4u << 20;
    unsigned char *sbuf = malloc(max), *rbuf = malloc(max);
    int next = (rank + 1) % size, prev = (rank + size - 1) % size, tag = 0;
    for (size_t n = 1; n <= max; n *= 4, tag++) {
        for (size_t i = 0; i < n; i++)
            sbuf[i] = pattern(rank, tag, i);
        memset(rbuf, 0xee, n);
        MPI_Request req;
        MPI_Status st;
        MPI_Isend(sbuf, (int)n, MPI_BYTE, next, tag, MPI_COMM_WORLD, &req);
        MPI_Recv(rbuf, (int)n, MPI_BYTE, prev, tag, MPI_COMM_WORLD, &st);
        MPI_Wait(&req, MPI_STATUS_IGNORE);
        int got;
        MPI_Get_count(&st, MPI_BYTE, &got);
        if ((size_t)got != n)
            fail("ring count", tag, got, (long)n);
        for (size_t i = 0; i < n; i++)
            if (rbuf[i] != pattern(prev, tag, i))
                fail("ring data", (long)i, rbuf[i], pattern(prev, tag, i));
    }
    free(sbuf);
    free(rbuf);
}

static void one_sided(void)
{
    /* A window per rank: [0] a counter on rank 0, [1] a CAS word,
     * [2..2+N) a block the left neighbour puts into. */
    enum { N = 4096 };
    int64_t *base;
    MPI_Win win;
    MPI_Win_allocate((2 + N) * sizeof(int64_t), sizeof(int64_t), MPI_INFO_NULL, MPI_COMM_WORLD,
                     &base, &win);
    MPI_Win_lock(MPI_LOCK_EXCLUSIVE, rank, 0, win);
    memset(base, 0, (2 + N) * sizeof(int64_t));
    base[1] = -1;
    MPI_Win_unlock(rank, win);
    MPI_Barrier(MPI_COMM_WORLD);

    int next = (rank + 1) % size;
    int64_t blk[N], back[N];
    for (int i = 0; i < N; i++)
        blk[i] = (int64_t)rank << 32 | i;
    MPI_Win_lock(MPI_LOCK_SHARED, next, 0, win);
    MPI_Put(blk, N, MPI_INT64_T, next, 2, N, MPI_INT64_T, win);
    MPI_Win_unlock(next, win);

    /* Every rank adds rank+1 to rank 0's counter; the old values it sees
     * are distinct partial sums. */
    int64_t add = rank + 1, old;
    MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
    MPI_Fetch_and_op(&add, &old, MPI_INT64_T, 0, 0, MPI_SUM, win);
    MPI_Win_unlock(0, win);
    if (old < 0 || old > (int64_t)size * (size + 1) / 2 - add)
        fail("fetch_and_op old", 0, (long)old, 0);

    /* Compare-and-swap: exactly one rank swaps -1 for its rank. */
    int64_t mine = rank, expect = -1, was;
    MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
    MPI_Compare_and_swap(&mine, &expect, &was, MPI_INT64_T, 0, 1, win);
    MPI_Win_unlock(0, win);
    int won = was == -1, winners;
    MPI_Allreduce(&won, &winners, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (winners != 1)
        fail("compare_and_swap winners", 0, winners, 1);
    MPI_Barrier(MPI_COMM_WORLD);

    /* Read back through MPI_Get what the left neighbour put here, and
     * rank 0's counter. */
    int prev = (rank + size - 1) % size;
    MPI_Win_lock(MPI_LOCK_SHARED, rank, 0, win);
    MPI_Get(back, N, MPI_INT64_T, rank, 2, N, MPI_INT64_T, win);
    MPI_Win_unlock(rank, win);
    for (int i = 0; i < N; i++)
        if (back[i] != ((int64_t)prev << 32 | i))
            fail("put/get", i, (long)back[i], (long)((int64_t)prev << 32 | i));
    int64_t counter, owner;
    MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
    MPI_Get(&counter, 1, MPI_INT64_T, 0, 0, 1, MPI_INT64_T, win);
    MPI_Get(&owner, 1, MPI_INT64_T, 0, 1, 1, MPI_INT64_T, win);
    MPI_Win_unlock(0, win);
    if (counter != (int64_t)size * (size + 1) / 2)
        fail("fetch_and_op total", 0, (long)counter, (long)size * (size + 1) / 2);
    if (owner < 0 || owner >= size || (owner == rank) != won)
        fail("compare_and_swap owner", 0, (long)owner, won ? rank : -2);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Win_free(&win);
}

int main(int argc, char **argv)
{
    int rma = argc > 1 && strcmp(argv[1], "--rma") == 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    allreduce();
    alltoall();
    ring();
    if (rma)
        one_sided();
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0)
        printf("mpi-check: ok (%d ranks: allreduce, alltoall, ring 1 B..4 MiB%s)\n", size,
               rma ? ", put/get/fetch_and_op/compare_and_swap" : "");
    MPI_Finalize();
    return 0;
}
