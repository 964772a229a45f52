/* bench/allreduce_mpi.c: Open MPI's MPI_Allreduce, the peer of bench/allreduce.c.
 *
 *   mpirun -np N build/bench/allreduce_mpi [--provider LABEL] [--min BYTES] [--max BYTES]
 *                                          [--iters K]
 * As root: mpirun --allow-run-as-root --oversubscribe -np 2 --mca btl self,vader ...
 * (bench/run-allreduce.sh runs it that way).
 *
 * Prints, on rank 0, one JSON line per message size in the format of bench/allreduce.c:
 *   {"bench":"allreduce","impl":"mpi","transport":"mpi","provider":"vader","world":2,
 *    "algo":"auto","bytes":4096,"us":3.1,"algbw_gbps":1.32,"busbw_gbps":1.32}
 * and measures the same way: sizes from --min (4 KiB) to --max (64 MiB), doubling; an
 * in-place MPI_FLOAT MPI_SUM all-reduce (MPI_IN_PLACE) over a buffer of ones; 2 warm-up
 * calls, a barrier, then the mean time of K calls on rank 0 (default: about 256 MiB of
 * traffic, between 5 and 1000 calls); algbw = bytes / us, busbw = algbw * 2(N-1)/N.
 * "algo":"auto" is Open MPI's own choice (coll/tuned's decision rules). --provider only
 * labels the line: the transport is chosen by mpirun's --mca options, and "vader" (the
 * shared-memory BTL) is what Open MPI 4 uses between ranks of one machine.
 *
 * Built by the Makefile with mpicc when mpicc exists (libopenmpi-dev; `make bench-deps`);
 * it uses nothing of dtrain. */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    const char *provider = "vader";
    size_t min_bytes = (size_t)4 << 10, max_bytes = (size_t)64 << 20, bytes, i, maxn;
    int opt_iters = 0, rank, N, k, rc = MPI_SUCCESS;
    float *buf;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &N);
    for (k = 1; k < argc; k++) {
        const char *a = argv[k], *v = k + 1 < argc ? argv[k + 1] : NULL;
        if (!v) {
            if (rank == 0) fprintf(stderr, "allreduce_mpi: %s needs a value (see the top of bench/allreduce_mpi.c)\n", a);
            MPI_Finalize();
            return 2;
        }
        k++;
        if (!strcmp(a, "--provider")) provider = v;
        else if (!strcmp(a, "--iters")) opt_iters = atoi(v);
        else if (!strcmp(a, "--min")) min_bytes = (size_t)strtoull(v, NULL, 10);
        else if (!strcmp(a, "--max")) max_bytes = (size_t)strtoull(v, NULL, 10);
        else {
            if (rank == 0) fprintf(stderr, "allreduce_mpi: unknown option %s\n", a);
            MPI_Finalize();
            return 2;
        }
    }
    if (min_bytes < sizeof(float) || max_bytes < min_bytes || max_bytes / sizeof(float) > (size_t)0x7fffffff) {
        if (rank == 0) fprintf(stderr, "allreduce_mpi: need 4 <= --min <= --max < 8 GiB\n");
        MPI_Finalize();
        return 2;
    }
    maxn = max_bytes / sizeof(float);
    buf = (float *)malloc(maxn * sizeof(float));
    if (!buf) {
        fprintf(stderr, "allreduce_mpi: rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
        return 1;
    }
    /* Errors come back as codes (the default handler would abort without a word). */
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    for (bytes = min_bytes; bytes <= max_bytes && rc == MPI_SUCCESS; bytes *= 2) {
        int n = (int)(bytes / sizeof(float));
        size_t budget = ((size_t)256 << 20) / bytes;   /* about 256 MiB of traffic per size */
        int iters = opt_iters > 0 ? opt_iters : budget < 5 ? 5 : budget > 1000 ? 1000 : (int)budget;
        double t0, us, algbw;
        for (i = 0; i < (size_t)n; i++) buf[i] = 1.0f;
        for (k = 0; k < 2 && rc == MPI_SUCCESS; k++)
            rc = MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        if (rc == MPI_SUCCESS) rc = MPI_Barrier(MPI_COMM_WORLD);
        t0 = now_s();
        for (k = 0; k < iters && rc == MPI_SUCCESS; k++)
            rc = MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        us = (now_s() - t0) * 1e6 / iters;
        if (rc != MPI_SUCCESS) break;
        algbw = (double)bytes / us * 1e-3;
        if (rank == 0) {
            printf("{\"bench\":\"allreduce\",\"impl\":\"mpi\",\"transport\":\"mpi\",\"provider\":\"%s\",\"world\":%d,"
                   "\"algo\":\"auto\",\"bytes\":%zu,\"us\":%.2f,\"algbw_gbps\":%.3f,\"busbw_gbps\":%.3f}\n",
                   provider, N, bytes, us, algbw, algbw * 2.0 * (N - 1) / N);
            fflush(stdout);
        }
    }
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(rc, msg, &len);
        fprintf(stderr, "allreduce_mpi: rank %d: MPI_Allreduce failed: %s\n", rank, msg);
    }
    free(buf);
    MPI_Finalize();
    return rc == MPI_SUCCESS ? 0 : 1;
}
