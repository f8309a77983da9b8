/* A minimal timing loop around Open MPI's MPI_Allreduce (float sum), or MPI_Alltoall when
 * MPI_BENCH_OP=alltoall (equal blocks of the size's bytes split over the ranks), or
 * MPI_Allgather when MPI_BENCH_OP=allgather (the size is the gathered output's, as nccl-tests and
 * `symmem bench all-gather` count it: each rank gives an equal block of it), or
 * MPI_Reduce_scatter_block when MPI_BENCH_OP=reducescatter (the size is each rank's input, float
 * sum; each rank receives an equal block), or MPI_Bcast from rank 0 when MPI_BENCH_OP=bcast
 * (the size is the buffer's; the time the slowest rank's), or MPI_Barrier when
 * MPI_BENCH_OP=barrier (one row, of size 0, whatever sizes are given), or, when
 * MPI_BENCH_OP=alltoallv, what an all-to-all-v with splits known only to their senders takes
 * (symmem's all_to_all_vdev, or PyTorch's all_to_all_single of the splits then of the rows):
 * MPI_Alltoall of the counts, then MPI_Alltoallv of the data (equal counts), printing the
 * same JSON fields as `symmem bench all-reduce --json` (size, count, time_us median, p99_us; the
 * bandwidths follow from them), measured on rank 0 over back-to-back calls, after a warm-up.
 * Build: mpicc -O2 -o mpi_allreduce bench/mpi_allreduce.c
 * Run:   mpirun --allow-run-as-root --oversubscribe -np 2 ./mpi_allreduce 8 4096 65536 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const char *op = getenv("MPI_BENCH_OP");
    int a2av = op && strcmp(op, "alltoallv") == 0;
    int a2a = a2av || (op && strcmp(op, "alltoall") == 0);
    int ag = op && strcmp(op, "allgather") == 0;
    int rs = op && strcmp(op, "reducescatter") == 0;
    int bc = op && strcmp(op, "bcast") == 0;
    int bar = op && strcmp(op, "barrier") == 0;
    int *scount = calloc(size, sizeof(int)), *rcount = calloc(size, sizeof(int));
    int *sdispl = calloc(size, sizeof(int)), *rdispl = calloc(size, sizeof(int));
    for (int a = 1; a < (bar && argc > 2 ? 2 : argc); a++) {
        long bytes = atol(argv[a]);
        long count = bytes / 4 < 1 ? 1 : bytes / 4;
        if (a2a || ag || rs) count = (count + size - 1) / size * size;
        float *in = calloc(count, 4), *out = calloc(count, 4);
        long budget = (256L << 20) / (count * 4);
        int iters = budget < 10 ? 10 : budget > 2000 ? 2000 : (int)budget;
        double *lat = malloc(sizeof(double) * iters);
        for (int i = 0; i < 100 + iters; i++) {
            if (i == 100) MPI_Barrier(MPI_COMM_WORLD);
            double t = MPI_Wtime();
            if (a2av) {
                for (int r = 0; r < size; r++) scount[r] = (int)(count / size), sdispl[r] = r * (int)(count / size);
                MPI_Alltoall(scount, 1, MPI_INT, rcount, 1, MPI_INT, MPI_COMM_WORLD);
                for (int r = 0, at = 0; r < size; r++) rdispl[r] = at, at += rcount[r];
                MPI_Alltoallv(in, scount, sdispl, MPI_FLOAT, out, rcount, rdispl, MPI_FLOAT, MPI_COMM_WORLD);
            } else if (bar)
                MPI_Barrier(MPI_COMM_WORLD);
            else if (bc)
                MPI_Bcast(in, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
            else if (rs)
                MPI_Reduce_scatter_block(in, out, (int)(count / size), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else if (ag)
                MPI_Allgather(in, (int)(count / size), MPI_FLOAT, out, (int)(count / size), MPI_FLOAT, MPI_COMM_WORLD);
            else if (a2a)
                MPI_Alltoall(in, (int)(count / size), MPI_FLOAT, out, (int)(count / size), MPI_FLOAT, MPI_COMM_WORLD);
            else
                MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            if (i >= 100) lat[i - 100] = (MPI_Wtime() - t) * 1e6;
        }
        qsort(lat, iters, sizeof(double), cmp);
        double median = lat[(iters - 1) / 2], p99 = lat[(int)((iters - 1) * 0.99)];
        if (bc) {
            /* The root returns as soon as its sends are out (eagerly, for small messages): the
             * broadcast's time is the slowest rank's. */
            double mine[2] = {median, p99}, worst[2];
            MPI_Reduce(mine, worst, 2, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            median = worst[0], p99 = worst[1];
        }
        if (rank == 0)
            printf("{\"bench\":\"%s\",\"ranks\":%d,\"hosts\":1,\"size\":%ld,\"count\":%ld,\"dtype\":\"float32\","
                   "\"iters\":%d,\"time_us\":%.3f,\"p99_us\":%.3f,\"algbw\":null,\"busbw\":null,"
                   "\"note\":\"baseline: Open MPI %s\"}\n",
                   a2av ? "mpi_alltoallv"
                   : bar ? "mpi_barrier"
                   : bc  ? "mpi_bcast"
                   : a2a ? "mpi_alltoall"
                   : ag  ? "mpi_allgather"
                   : rs  ? "mpi_reduce_scatter"
                         : "mpi_allreduce",
                   size, bar ? 0 : count * 4,
                   bar ? 0 : count, iters, median, p99,
                   a2av ? "MPI_Alltoall of the counts, then MPI_Alltoallv"
                   : bar ? "MPI_Barrier"
                   : bc  ? "MPI_Bcast (the slowest rank's median)"
                   : a2a ? "MPI_Alltoall"
                   : ag  ? "MPI_Allgather"
                   : rs  ? "MPI_Reduce_scatter_block"
                         : "MPI_Allreduce");
        fflush(stdout);
        free(in);
        free(out);
        free(lat);
    }
    free(scount);
    free(rcount);
    free(sdispl);
    free(rdispl);
    MPI_Finalize();
    return 0;
}
