/* allreduce_time: the time of one MPI_Allreduce (sum of doubles) at 8 B
 * and 1 MiB, for scripts/bench/bench-cluster.sh.
 *
 * Each size: a warm-up, then ITERS allreduces in a row between barriers;
 * the time is the slowest rank's mean per call. The result is checked
 * (every element is the sum of the ranks' values), so a transport that
 * loses data cannot look fast. Rank 0 prints one line per size:
 *   allreduce BYTES B: USEC us
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int run(size_t bytes, int iters, int rank, int size)
{
	size_t n = bytes / sizeof(double);
	double *in = malloc(n * sizeof(double)), *out = malloc(n * sizeof(double));
	if (!in || !out)
		return 1;
	for (size_t i = 0; i < n; i++)
		in[i] = (double)(rank + 1) * (double)(i % 7 + 1);
	for (int w = 0; w < 3; w++)
		MPI_Allreduce(in, out, (int)n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
	MPI_Barrier(MPI_COMM_WORLD);
	double start = MPI_Wtime();
	for (int i = 0; i < iters; i++)
		MPI_Allreduce(in, out, (int)n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
	double mine = (MPI_Wtime() - start) / iters, slowest;
	MPI_Reduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
	double ranks = (double)size * (size + 1) / 2;
	int bad = 0, anybad;
	for (size_t i = 0; i < n; i++)
		if (out[i] != ranks * (double)(i % 7 + 1))
			bad = 1;
	MPI_Allreduce(&bad, &anybad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
	if (rank == 0) {
		if (anybad)
			fprintf(stderr, "allreduce %zu B: wrong result\n", bytes);
		else
			printf("allreduce %zu B: %.2f us\n", bytes, slowest * 1e6);
	}
	free(in);
	free(out);
	return anybad;
}

int main(int argc, char **argv)
{
	int rank, size, bad = 0;
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	bad |= run(8, 200, rank, size);
	bad |= run(1 << 20, 20, rank, size);
	MPI_Finalize();
	return bad;
}
