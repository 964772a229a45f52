/* bench/gemm.c: SGEMM throughput of dtrain's dtr__gemm against OpenBLAS cblas_sgemm, in the
 * same process, on square sizes and on the shapes a training step runs (MLP forward,
 * input gradient with a transposed B, weight gradient with a transposed A, conv im2col).
 *
 * Prints one JSON line per shape and implementation:
 *   {"bench":"gemm","impl":"dtrain","kernel":"avx512","shape":"mlp_fwd","m":64,"n":256,
 *    "k":784,"ta":0,"tb":0,"threads":1,"gflops":123.4}
 * and a last line with the ratio dtrain/openblas per shape:
 *   {"bench":"gemm","summary":"ratio","threads":1,"ratios":{"mlp_fwd":0.97,...},"geomean":..}
 * Each number is the best of several timed rounds after a warm-up; rounds of the two
 * implementations alternate so that a noisy machine affects both alike.
 *
 * Build (the Makefile does this against the amalgamated implementation):
 *   cc -O2 bench/gemm.c build/dtrain_impl.o -lopenblas -lpthread -lm -o build/bench_gemm
 * Run:
 *   build/bench_gemm [--threads T] [--rounds R] [--quick]
 * OpenBLAS worker threads spin for a while after each call; with T > 1 the bench pauses
 * between rounds so that they do not steal cycles from dtrain's workers (and vice versa).
 */
#define _POSIX_C_SOURCE 199309L
#define DTRAIN_INTERNAL_API
#include "../dtrain.h"
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- shapes ---- */

typedef struct bench_shape {
    const char *name;
    int64_t m, n, k;
    int ta, tb;   /* A stored (K, M) / B stored (N, K) */
} bench_shape;

static const bench_shape bench_shapes[] = {
    { "sq256", 256, 256, 256, 0, 0 },
    { "sq512", 512, 512, 512, 0, 0 },
    { "sq1024", 1024, 1024, 1024, 0, 0 },
    { "sq2048", 2048, 2048, 2048, 0, 0 },
    { "mlp_fwd", 64, 256, 784, 0, 0 },     /* X (64, 784) W (784, 256) */
    { "mlp_dx", 64, 784, 256, 0, 1 },      /* dY (64, 256) W^T */
    { "mlp_dw", 784, 256, 64, 1, 0 },      /* X^T dY */
    { "conv1", 32, 676, 9, 0, 0 },         /* 32 filters 3x3x1 over 26x26 */
    { "conv2", 64, 121, 288, 0, 0 },       /* 64 filters 3x3x32 over 11x11 */
};
#define BENCH_NSHAPES ((int)(sizeof(bench_shapes) / sizeof(bench_shapes[0])))

/* ---- timing ---- */

static double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void bench_sleep_ms(int ms) {
    struct timespec ts;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (long)(ms % 1000) * 1000000L;
    nanosleep(&ts, NULL);
}

typedef struct bench_args {
    const bench_shape *s;
    const float *a, *b;
    float *c;
    dtr__pool *pool;
} bench_args;

static void bench_call(const bench_args *x, int impl) {
    const bench_shape *s = x->s;
    int64_t rsa = s->ta ? 1 : s->k, csa = s->ta ? s->m : 1;
    int64_t rsb = s->tb ? 1 : s->n, csb = s->tb ? s->k : 1;
    if (impl == 0) {
        dtr__gemm(x->pool, s->m, s->n, s->k, 1.0f, x->a, rsa, csa, x->b, rsb, csb, 0.0f, x->c, s->n);
    } else {
        cblas_sgemm(CblasRowMajor, s->ta ? CblasTrans : CblasNoTrans, s->tb ? CblasTrans : CblasNoTrans,
                    (int)s->m, (int)s->n, (int)s->k, 1.0f, x->a, s->ta ? (int)s->m : (int)s->k,
                    x->b, s->tb ? (int)s->k : (int)s->n, 0.0f, x->c, (int)s->n);
    }
}

/** Seconds per call averaged over `iters` calls. */
static double bench_time(const bench_args *x, int impl, int iters) {
    double t0 = bench_now();
    int i;
    for (i = 0; i < iters; i++) bench_call(x, impl);
    return (bench_now() - t0) / iters;
}

/* ---- main ---- */

int main(int argc, char **argv) {
    int threads = 1, rounds = 5, quick = 0, i, r, impl;
    double ratio[BENCH_NSHAPES], logsum = 0.0;
    int nratio = 0;
    dtr__pool *pool = NULL;
    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (strcmp(argv[i], "--quick") == 0) quick = 1;
        else {
            fprintf(stderr, "usage: %s [--threads T] [--rounds R] [--quick]\n", argv[0]);
            return 2;
        }
    }
    if (threads < 1) threads = 1;
    if (rounds < 1) rounds = 1;
    if (dtr__pool_create(NULL, threads, &pool) != DTR_OK) {
        fprintf(stderr, "cannot create the thread pool\n");
        return 1;
    }
    openblas_set_num_threads(threads);

    for (i = 0; i < BENCH_NSHAPES; i++) {
        const bench_shape *s = &bench_shapes[i];
        bench_args x;
        double best[2] = { 1e30, 1e30 }, flop = 2.0 * (double)s->m * (double)s->n * (double)s->k;
        float *a, *b, *c;
        int64_t e;
        int iters;
        if (quick && s->m * s->n * s->k > (int64_t)1 << 29) continue;
        a = (float *)malloc(sizeof(float) * (size_t)(s->m * s->k));
        b = (float *)malloc(sizeof(float) * (size_t)(s->k * s->n));
        c = (float *)malloc(sizeof(float) * (size_t)(s->m * s->n));
        if (!a || !b || !c) { fprintf(stderr, "out of memory\n"); return 1; }
        for (e = 0; e < s->m * s->k; e++) a[e] = (float)((e * 7919) % 1000) / 1000.0f - 0.5f;
        for (e = 0; e < s->k * s->n; e++) b[e] = (float)((e * 104729) % 1000) / 1000.0f - 0.5f;
        memset(c, 0, sizeof(float) * (size_t)(s->m * s->n));
        x.s = s; x.a = a; x.b = b; x.c = c; x.pool = pool;
        /* warm-up, and enough calls per round for ~30 ms */
        bench_call(&x, 0);
        bench_call(&x, 1);
        iters = (int)(0.03 / bench_time(&x, 0, 1)) + 1;
        for (r = 0; r < rounds; r++) {
            for (impl = 0; impl < 2; impl++) {
                double t = bench_time(&x, impl, iters);
                if (t < best[impl]) best[impl] = t;
            }
            if (threads > 1) bench_sleep_ms(300);   /* let OpenBLAS's spinning threads sleep */
        }
        for (impl = 0; impl < 2; impl++) {
            printf("{\"bench\":\"gemm\",\"impl\":\"%s\",\"kernel\":\"%s\",\"shape\":\"%s\","
                   "\"m\":%lld,\"n\":%lld,\"k\":%lld,\"ta\":%d,\"tb\":%d,\"threads\":%d,\"gflops\":%.1f}\n",
                   impl ? "openblas" : "dtrain", impl ? openblas_get_corename() : dtr__gemm_kernel_name(),
                   s->name, (long long)s->m, (long long)s->n, (long long)s->k, s->ta, s->tb, threads,
                   flop / best[impl] * 1e-9);
        }
        fflush(stdout);
        ratio[i] = best[1] / best[0];
        logsum += log(ratio[i]);
        nratio++;
        free(a); free(b); free(c);
    }
    printf("{\"bench\":\"gemm\",\"summary\":\"ratio\",\"threads\":%d,\"ratios\":{", threads);
    for (i = 0, r = 0; i < BENCH_NSHAPES; i++) {
        if (quick && bench_shapes[i].m * bench_shapes[i].n * bench_shapes[i].k > (int64_t)1 << 29) continue;
        printf("%s\"%s\":%.3f", r++ ? "," : "", bench_shapes[i].name, ratio[i]);
    }
    printf("},\"geomean\":%.3f}\n", nratio ? exp(logsum / nratio) : 0.0);
    dtr__pool_destroy(pool);
    return 0;
}
