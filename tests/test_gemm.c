/* tests/test_gemm.c: the thread pool (dtr__pool_*) and the SGEMM (dtr__gemm) against a
 * double-precision reference: odd and prime shapes, K = 0, all four transpose combinations
 * through strides, sliced views with non-unit strides in both dimensions, alpha and beta,
 * beta = 0 over NaN, bitwise identical results for 1, 2, 3 and 4 threads (a project rule:
 * the reduction order of every element is independent of the thread count), and no
 * allocation-callback call once the pool's scratch has grown; dtr__gemm_on (the serial
 * product of a pool task) and dtr__gemm_packed (B packed ahead) match dtr__gemm bitwise, and
 * dtr__gemm_on_gen (B made by a producer block by block) matches dtr__gemm_on bitwise.
 *
 * The GEMM cases run once for each kernel this CPU has (avx512, avx2, neon, generic), forced
 * with dtr__gemm_force; DTR_TEST_KERNELS (names, comma-separated) keeps only those named: the
 * ARM64 part of make test, under qemu, runs the NEON kernel only (the portable one is the same C
 * the x86-64 run checks). */
#define DTRAIN_INTERNAL_API
#include "test.h"
#include "test_util.h"

/* ---- helpers ---- */

static uint64_t tg_state = 0x9E3779B97F4A7C15ull;

static float tg_rand(void) {   /* uniform in [-1, 1) */
    tg_state = tg_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(tg_state >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

static float *tg_alloc_rand(int64_t n) {
    float *p = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    int64_t i;
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    for (i = 0; i < n; i++) p[i] = tg_rand();
    return p;
}

/** One GEMM problem with its operands laid out through strides. */
typedef struct tg_case {
    int64_t M, N, K;
    int ta, tb;          /* A stored (K, M) / B stored (N, K) */
    int64_t pad;         /* extra row pitch and column step (sliced views) when > 0 */
    float alpha, beta;
} tg_case;

static int tg_no_reference;   /* 1: tg_run skips the double reference (the caller compares bits with a checked run) */

/** Runs `tc` with pool p and compares with the double reference. Returns 1 when it passed;
 *  C_out (optional, M*N) receives the result for bitwise comparisons. */
static int tg_run(dtr__pool *p, const tg_case *tc, float *C_out) {
    int64_t M = tc->M, N = tc->N, K = tc->K, step = tc->pad > 0 ? 2 : 1, pitch, i, j, k;
    int64_t rsa, csa, rsb, csb, ldc = N + (tc->pad > 0 ? tc->pad : 0), na, nb;
    float *A, *B, *C, *C0;
    int ok = 1;
    /* A (M, K): element (i, k) at i*rsa + k*csa */
    if (!tc->ta) { pitch = K * step + tc->pad; rsa = pitch; csa = step; na = M * pitch + 1; }
    else { pitch = M * step + tc->pad; rsa = step; csa = pitch; na = K * pitch + 1; }
    if (!tc->tb) { pitch = N * step + tc->pad; rsb = pitch; csb = step; nb = K * pitch + 1; }
    else { pitch = K * step + tc->pad; rsb = step; csb = pitch; nb = N * pitch + 1; }
    A = tg_alloc_rand(na);
    B = tg_alloc_rand(nb);
    C = tg_alloc_rand(M * ldc);
    C0 = (float *)malloc(sizeof(float) * (size_t)(M * ldc));
    if (!C0) exit(2);
    if (tc->beta == 0.0f)
        for (i = 0; i < M * ldc; i++) C[i] = NAN;   /* must be ignored */
    memcpy(C0, C, sizeof(float) * (size_t)(M * ldc));
    dtr__gemm(p, M, N, K, tc->alpha, A, rsa, csa, B, rsb, csb, tc->beta, C, ldc);
    for (i = 0; i < M && ok && !tg_no_reference; i++) {
        for (j = 0; j < ldc && ok; j++) {
            double ref = 0.0, mag = 0.0, got = C[i * ldc + j], tol;
            if (j >= N) {   /* padding between rows must be untouched */
                if (memcmp(&C[i * ldc + j], &C0[i * ldc + j], sizeof(float)) != 0) {
                    CHECK_MSG(0, "M=%lld N=%lld K=%lld: padding (%lld, %lld) written", (long long)M,
                              (long long)N, (long long)K, (long long)i, (long long)j);
                    ok = 0;
                }
                continue;
            }
            for (k = 0; k < K; k++) {
                double t = (double)A[i * rsa + k * csa] * (double)B[k * rsb + j * csb];
                ref += t;
                mag += fabs(t);
            }
            ref *= tc->alpha;
            mag *= fabs(tc->alpha);
            if (tc->beta != 0.0f) {
                ref += (double)tc->beta * C0[i * ldc + j];
                mag += fabs((double)tc->beta * C0[i * ldc + j]);
            }
            tol = 1e-5 * (double)(K > 1 ? K : 1) * (mag > 1e-30 ? mag : 1e-30);
            if (!(fabs(got - ref) <= tol)) {
                CHECK_MSG(0, "M=%lld N=%lld K=%lld ta=%d tb=%d pad=%lld alpha=%g beta=%g: C(%lld,%lld) = %.9g, "
                          "reference %.9g", (long long)M, (long long)N, (long long)K, tc->ta, tc->tb,
                          (long long)tc->pad, (double)tc->alpha, (double)tc->beta, (long long)i, (long long)j,
                          got, ref);
                ok = 0;
            }
        }
    }
    if (C_out)
        for (i = 0; i < M; i++) memcpy(C_out + i * N, C + i * ldc, sizeof(float) * (size_t)N);
    free(A); free(B); free(C); free(C0);
    return ok;
}

/* ---- thread pool ---- */

typedef struct tg_cover {
    int *hits;
    int bad_worker;
    int threads;
} tg_cover;

static void tg_cover_fn(void *arg, int64_t begin, int64_t end, int worker) {
    tg_cover *c = (tg_cover *)arg;
    int64_t i;
    if (worker < 0 || worker >= c->threads) c->bad_worker = 1;
    for (i = begin; i < end; i++) c->hits[i]++;   /* ranges are disjoint: no race */
}

static void test_pool_coverage(void) {
    int threads, t;
    int64_t n, grain;
    for (threads = 1; threads <= 4; threads++) {
        dtr__pool *p = NULL;
        CHECK(dtr__pool_create(NULL, threads, &p) == DTR_OK);
        if (!p) return;
        CHECK_EQ_INT(dtr__pool_threads(p), threads);
        for (n = 0; n <= 40; n++) {
            for (grain = 1; grain <= 7; grain += 3) {
                tg_cover c;
                int hits[64];
                memset(hits, 0, sizeof(hits));
                c.hits = hits; c.bad_worker = 0; c.threads = threads;
                dtr__pool_run(p, n, grain, tg_cover_fn, &c);
                for (t = 0; t < 64; t++) CHECK_EQ_INT(hits[t], t < n ? 1 : 0);
                CHECK(!c.bad_worker);
            }
        }
        dtr__pool_destroy(p);
    }
    {   /* NULL pool: serial */
        tg_cover c;
        int hits[64];
        memset(hits, 0, sizeof(hits));
        c.hits = hits; c.bad_worker = 0; c.threads = 1;
        dtr__pool_run(NULL, 50, 1, tg_cover_fn, &c);
        for (t = 0; t < 64; t++) CHECK_EQ_INT(hits[t], t < 50 ? 1 : 0);
        CHECK_EQ_INT(dtr__pool_threads(NULL), 1);
    }
}

typedef struct tg_chunks {
    int64_t begin[8], end[8];
} tg_chunks;

static void tg_chunks_fn(void *arg, int64_t begin, int64_t end, int worker) {
    tg_chunks *c = (tg_chunks *)arg;
    c->begin[worker] = begin;
    c->end[worker] = end;
}

/* Chunk i runs on worker i, chunks are contiguous and at least `grain` long, and small n
 * runs on the caller alone. */
static void test_pool_chunks(void) {
    dtr__pool *p = NULL;
    tg_chunks c;
    int i;
    CHECK(dtr__pool_create(NULL, 4, &p) == DTR_OK);
    if (!p) return;
    memset(&c, 0xff, sizeof(c));
    dtr__pool_run(p, 10, 1, tg_chunks_fn, &c);   /* 4 chunks: 3, 3, 2, 2 */
    CHECK_EQ_INT(c.begin[0], 0); CHECK_EQ_INT(c.end[0], 3);
    CHECK_EQ_INT(c.begin[1], 3); CHECK_EQ_INT(c.end[1], 6);
    CHECK_EQ_INT(c.begin[2], 6); CHECK_EQ_INT(c.end[2], 8);
    CHECK_EQ_INT(c.begin[3], 8); CHECK_EQ_INT(c.end[3], 10);
    memset(&c, 0xff, sizeof(c));
    dtr__pool_run(p, 10, 4, tg_chunks_fn, &c);   /* at most 10/4 = 2 chunks */
    CHECK_EQ_INT(c.begin[0], 0); CHECK_EQ_INT(c.end[0], 5);
    CHECK_EQ_INT(c.begin[1], 5); CHECK_EQ_INT(c.end[1], 10);
    CHECK_EQ_INT(c.begin[2], -1);
    memset(&c, 0xff, sizeof(c));
    dtr__pool_run(p, 5, 5, tg_chunks_fn, &c);    /* one chunk: inline on worker 0 */
    CHECK_EQ_INT(c.begin[0], 0); CHECK_EQ_INT(c.end[0], 5);
    for (i = 1; i < 4; i++) CHECK_EQ_INT(c.begin[i], -1);
    dtr__pool_destroy(p);
}

typedef struct tg_nest {
    dtr__pool *p;
    int64_t sum[4];
} tg_nest;

static void tg_inner_fn(void *arg, int64_t begin, int64_t end, int worker) {
    int64_t *acc = (int64_t *)arg, i;
    (void)worker;
    for (i = begin; i < end; i++) *acc += i;
}

static void tg_outer_fn(void *arg, int64_t begin, int64_t end, int worker) {
    tg_nest *c = (tg_nest *)arg;
    int64_t i;
    for (i = begin; i < end; i++) {
        int64_t acc = 0;
        dtr__pool_run(c->p, 100, 1, tg_inner_fn, &acc);   /* nested: runs inline */
        c->sum[worker] += acc;
    }
}

static void test_pool_nested(void) {
    dtr__pool *p = NULL;
    tg_nest c;
    CHECK(dtr__pool_create(NULL, 2, &p) == DTR_OK);
    if (!p) return;
    memset(&c, 0, sizeof(c));
    c.p = p;
    dtr__pool_run(p, 10, 1, tg_outer_fn, &c);
    CHECK_EQ_INT(c.sum[0] + c.sum[1], 10 * 4950);
    dtr__pool_destroy(p);
}

static void tg_add_fn(void *arg, int64_t begin, int64_t end, int worker) {
    int64_t *v = (int64_t *)arg, i;
    for (i = begin; i < end; i++) v[i] += worker + 1;
}

/* Many small back-to-back jobs: wake-up races would lose or repeat chunks. */
static void test_pool_stress(void) {
    dtr__pool *p = NULL;
    int64_t v[16];
    int r, i;
    CHECK(dtr__pool_create(NULL, 3, &p) == DTR_OK);
    if (!p) return;
    memset(v, 0, sizeof(v));
    for (r = 0; r < 20000; r++) dtr__pool_run(p, 16, 1, tg_add_fn, v);
    /* chunks of 16 over 3 workers: 6, 5, 5 -> worker 0, 1, 2 */
    for (i = 0; i < 16; i++) CHECK_EQ_INT(v[i], 20000 * (i < 6 ? 1 : i < 11 ? 2 : 3));
    dtr__pool_destroy(p);
    /* create and destroy right away, and while the workers may still be spinning */
    for (r = 0; r < 50; r++) {
        p = NULL;
        CHECK(dtr__pool_create(NULL, 2, &p) == DTR_OK);
        if (r & 1) dtr__pool_run(p, 16, 1, tg_add_fn, v);
        dtr__pool_destroy(p);
    }
}

static void test_pool_scratch(void) {
    dtr_allocation_callbacks cb;
    dtr__pool *p = NULL;
    void *a, *b;
    long before;
    count_alloc c = {0, 0, 0, 0, 0, 0};
    cb = count_alloc_callbacks(&c);
    CHECK(dtr__pool_create(&cb, 2, &p) == DTR_OK);
    if (!p) return;
    CHECK(count_alloc_total(&c) > 0);   /* the pool itself went through the callbacks */
    a = dtr__pool_scratch(p, 1, 1000);
    CHECK(a != NULL);
    CHECK(((uintptr_t)a & 63) == 0);
    before = count_alloc_total(&c);
    b = dtr__pool_scratch(p, 1, 500);   /* smaller: same buffer, no allocation */
    CHECK(a == b);
    CHECK_EQ_INT(count_alloc_total(&c), before);
    b = dtr__pool_scratch(p, 1, 100000);   /* larger: grows */
    CHECK(b != NULL);
    CHECK(((uintptr_t)b & 63) == 0);
    memset(b, 1, 100000);
    CHECK(dtr__pool_scratch(p, 2, 10) == NULL);   /* no worker 2 */
    CHECK(dtr__pool_scratch(p, -1, 10) == NULL);
    CHECK(dtr__pool_scratch(NULL, 0, 10) == NULL);
    dtr__pool_destroy(p);
    CHECK_EQ_INT(count_alloc_total(&c) % 2, 0);   /* every malloc freed (this test makes no realloc) */
    dtr__pool_destroy(NULL);
}

/* ---- GEMM ---- */

static void test_gemm_kernel_name(void) {
    const char *k = dtr__gemm_kernel_name();
    CHECK(k != NULL);
    if (k) {
        CHECK(strcmp(k, "avx512") == 0 || strcmp(k, "avx2") == 0 || strcmp(k, "neon") == 0 ||
              strcmp(k, "generic") == 0 || strcmp(k, "cblas") == 0);
        printf("     kernel: %s\n", k);
    }
    CHECK(!dtr__gemm_force("sse9"));               /* unknown: nothing changes */
    CHECK(strcmp(dtr__gemm_kernel_name(), k) == 0);
    CHECK(dtr__gemm_force("generic"));             /* every CPU runs the portable one */
    CHECK(strcmp(k, "cblas") == 0 || strcmp(dtr__gemm_kernel_name(), "generic") == 0);
    CHECK(dtr__gemm_force(NULL));
    CHECK(strcmp(dtr__gemm_kernel_name(), k) == 0);
}

static void test_gemm_shapes(void) {
    static const int64_t shapes[][3] = {
        { 1, 1, 1 }, { 1, 1, 5 }, { 1, 7, 1 }, { 5, 1, 3 }, { 2, 3, 4 }, { 17, 31, 7 }, { 127, 65, 33 },
        { 8, 32, 16 }, { 9, 33, 17 }, { 7, 31, 15 }, { 16, 64, 8 }, { 24, 48, 300 }, { 31, 97, 513 },
        { 64, 256, 78 }, { 3, 200, 2 }, { 200, 3, 9 }, { 13, 13, 1000 }, { 70, 70, 70 }
    };
    static const float ab[][2] = { { 1.0f, 0.0f }, { 1.0f, 1.0f }, { -0.5f, 2.0f }, { 2.5f, 0.0f }, { 1.0f, -1.0f } };
    int s, t, v;
    dtr__pool *p = NULL;
    CHECK(dtr__pool_create(NULL, 2, &p) == DTR_OK);
    for (s = 0; s < (int)(sizeof(shapes) / sizeof(shapes[0])); s++) {
        for (t = 0; t < 4; t++) {
            for (v = 0; v < 5; v++) {
                tg_case tc;
                tc.M = shapes[s][0]; tc.N = shapes[s][1]; tc.K = shapes[s][2];
                tc.ta = t & 1; tc.tb = t >> 1; tc.pad = 0;
                tc.alpha = ab[v][0]; tc.beta = ab[v][1];
                if (!tg_run(v & 1 ? NULL : p, &tc, NULL)) goto done;
            }
        }
    }
done:
    dtr__pool_destroy(p);
}

/* Sliced views: element steps of 2 in both dimensions plus extra pitch, and ldc > N. */
static void test_gemm_strided_views(void) {
    static const int64_t shapes[][3] = { { 1, 1, 1 }, { 17, 31, 7 }, { 127, 65, 33 }, { 40, 70, 300 }, { 9, 100, 20 } };
    int s, t;
    dtr__pool *p = NULL;
    CHECK(dtr__pool_create(NULL, 2, &p) == DTR_OK);
    for (s = 0; s < (int)(sizeof(shapes) / sizeof(shapes[0])); s++) {
        for (t = 0; t < 4; t++) {
            tg_case tc;
            tc.M = shapes[s][0]; tc.N = shapes[s][1]; tc.K = shapes[s][2];
            tc.ta = t & 1; tc.tb = t >> 1; tc.pad = 3;
            tc.alpha = 0.75f; tc.beta = t == 2 ? 0.0f : 0.5f;
            if (!tg_run(p, &tc, NULL)) goto done;
        }
    }
done:
    dtr__pool_destroy(p);
}

/* Training shapes: MLP forward, input and weight gradients, conv im2col products. */
static void test_gemm_training_shapes(void) {
    static const tg_case cases[] = {
        { 64, 256, 784, 0, 0, 0, 1.0f, 0.0f },
        { 64, 784, 256, 0, 1, 0, 1.0f, 0.0f },
        { 784, 256, 64, 1, 0, 0, 1.0f, 1.0f },
        { 32, 676, 9, 0, 0, 0, 1.0f, 0.0f },
        { 64, 121, 288, 0, 0, 0, 1.0f, 0.0f },
        { 288, 121, 64, 1, 0, 0, 1.0f, 0.0f },
    };
    int s;
    dtr__pool *p = NULL;
    CHECK(dtr__pool_create(NULL, 2, &p) == DTR_OK);
    for (s = 0; s < (int)(sizeof(cases) / sizeof(cases[0])); s++)
        if (!tg_run(p, &cases[s], NULL)) break;
    dtr__pool_destroy(p);
}

static void test_gemm_k0_alpha0_nan(void) {
    float C[6], A[6], B[6];
    int i;
    for (i = 0; i < 6; i++) { C[i] = (float)i; A[i] = NAN; B[i] = NAN; }
    dtr__gemm(NULL, 2, 3, 0, 1.0f, A, 0, 1, B, 3, 1, 2.0f, C, 3);   /* K = 0: C = beta C */
    for (i = 0; i < 6; i++) CHECK(C[i] == 2.0f * (float)i);
    for (i = 0; i < 6; i++) C[i] = NAN;
    dtr__gemm(NULL, 2, 3, 0, 1.0f, A, 0, 1, B, 3, 1, 0.0f, C, 3);   /* K = 0, beta = 0 over NaN */
    for (i = 0; i < 6; i++) CHECK(C[i] == 0.0f);
    for (i = 0; i < 6; i++) C[i] = (float)i;
    dtr__gemm(NULL, 2, 3, 2, 0.0f, A, 2, 1, B, 3, 1, 3.0f, C, 3);   /* alpha = 0: A, B unread */
    for (i = 0; i < 6; i++) CHECK(C[i] == 3.0f * (float)i);
    dtr__gemm(NULL, 0, 3, 2, 1.0f, A, 2, 1, B, 3, 1, 0.0f, C, 3);   /* empty: nothing written */
    dtr__gemm(NULL, 2, 0, 2, 1.0f, A, 2, 1, B, 3, 1, 0.0f, C, 3);
    for (i = 0; i < 6; i++) CHECK(C[i] == 3.0f * (float)i);
}

/* Results are bitwise identical for any thread count (and for the NULL pool): the NULL pool's
   run is checked against the double reference, the others against its bits. */
static void test_gemm_deterministic(void) {
    static const tg_case cases[] = {
        { 127, 65, 33, 0, 0, 0, 1.0f, 0.0f },
        { 64, 256, 784, 0, 0, 0, 1.0f, 0.0f },
        { 64, 784, 256, 0, 1, 0, 1.0f, 1.0f },
        { 784, 256, 64, 1, 0, 0, 0.5f, 1.0f },
        { 300, 40, 600, 1, 1, 0, 1.0f, 0.0f },   /* split over M */
        { 40, 300, 600, 0, 0, 2, 1.0f, 0.0f },   /* split over N, views */
        { 33, 45, 1100, 0, 0, 0, 1.0f, -1.0f },  /* several K blocks */
        { 64, 121, 288, 0, 0, 0, 1.0f, 0.0f },
    };
    int s, t;
    for (s = 0; s < (int)(sizeof(cases) / sizeof(cases[0])); s++) {
        const tg_case *tc = &cases[s];
        size_t bytes = sizeof(float) * (size_t)(tc->M * tc->N);
        float *ref = (float *)malloc(bytes), *got = (float *)malloc(bytes);
        if (!ref || !got) exit(2);
        tg_state = 12345u + (uint64_t)s;
        tg_run(NULL, tc, ref);
        for (t = 1; t <= 4; t++) {
            dtr__pool *p = NULL;
            CHECK(dtr__pool_create(NULL, t, &p) == DTR_OK);
            tg_state = 12345u + (uint64_t)s;
            tg_no_reference = 1;
            tg_run(p, tc, got);
            tg_no_reference = 0;
            CHECK_MSG(memcmp(ref, got, bytes) == 0, "case %d differs with %d threads", s, t);
            dtr__pool_destroy(p);
        }
        free(ref);
        free(got);
    }
}

/* dtr__gemm_on inside pool tasks (as convolutions use it: one product per sample, each on
 * the worker's own scratch) gives bitwise the results of dtr__gemm, and so does the NULL pool. */
typedef struct tg_on_job {
    dtr__pool *p;
    const float *A, *B;
    float *C;
    int64_t M, N, K;
} tg_on_job;

static void tg_on_fn(void *arg, int64_t begin, int64_t end, int worker) {
    const tg_on_job *j = (const tg_on_job *)arg;
    int64_t s;
    for (s = begin; s < end; s++)   /* sample s: C_s = A_s B (B transposed view) */
        dtr__gemm_on(j->p, worker, j->M, j->N, j->K, 1.0f, j->A + s * j->M * j->K, j->K, 1,
                     j->B, 1, j->K, 0.0f, j->C + s * j->M * j->N, j->N);
}

static void test_gemm_on(void) {
    const int64_t S = 6, M = 37, N = 121, K = 75;
    float *A = tg_alloc_rand(S * M * K), *B = tg_alloc_rand(N * K);
    float *ref = (float *)malloc(sizeof(float) * (size_t)(S * M * N));
    float *got = (float *)malloc(sizeof(float) * (size_t)(S * M * N));
    tg_on_job j;
    dtr__pool *p = NULL;
    int64_t s;
    int t;
    if (!ref || !got) exit(2);
    for (s = 0; s < S; s++)
        dtr__gemm(NULL, M, N, K, 1.0f, A + s * M * K, K, 1, B, 1, K, 0.0f, ref + s * M * N, N);
    for (t = 1; t <= 3; t++) {
        CHECK(dtr__pool_create(NULL, t, &p) == DTR_OK);
        if (!p) break;
        memset(got, 0, sizeof(float) * (size_t)(S * M * N));
        j.p = p; j.A = A; j.B = B; j.C = got; j.M = M; j.N = N; j.K = K;
        dtr__pool_run(p, S, 1, tg_on_fn, &j);
        CHECK_MSG(memcmp(ref, got, sizeof(float) * (size_t)(S * M * N)) == 0, "%d threads", t);
        dtr__pool_destroy(p);
    }
    /* NULL pool, and a worker index the pool does not have: private buffers */
    memset(got, 0, sizeof(float) * (size_t)(M * N));
    dtr__gemm_on(NULL, 0, M, N, K, 1.0f, A, K, 1, B, 1, K, 0.0f, got, N);
    CHECK(memcmp(ref, got, sizeof(float) * (size_t)(M * N)) == 0);
    CHECK(dtr__pool_create(NULL, 1, &p) == DTR_OK);
    memset(got, 0, sizeof(float) * (size_t)(M * N));
    dtr__gemm_on(p, 5, M, N, K, 1.0f, A, K, 1, B, 1, K, 0.0f, got, N);
    CHECK(memcmp(ref, got, sizeof(float) * (size_t)(M * N)) == 0);
    dtr__pool_destroy(p);
    free(A); free(B); free(ref); free(got);
}

/* dtr__gemm_packed (B packed once, as an LSTM's recurrent weight) gives dtr__gemm's bits: B
   stored (K, N) or transposed, K past one K block, N past one N block (the AVX kernels' 1024
   and NEON's 1536), beta 0 and 1, no pool and 1-3 threads, on one worker, and with no packing
   memory (mem NULL: each call packs its own) */
static void test_gemm_packed(void) {
    static const int64_t shapes[][3] = {{33, 512, 128}, {7, 1031, 700}, {3, 1600, 300}, {64, 40, 1500}, {1, 17, 3}};
    size_t i;
    for (i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        int64_t M = shapes[i][0], N = shapes[i][1], K = shapes[i][2];
        float *A = tg_alloc_rand(M * K), *B = tg_alloc_rand(K * N), *C0 = tg_alloc_rand(M * N);
        float *ref = (float *)malloc(sizeof(float) * (size_t)(M * N)), *got = (float *)malloc(sizeof(float) * (size_t)(M * N));
        float *mem = (float *)malloc(sizeof(float) * dtr__gemm_bpack_floats(K, N));
        int tb, t, beta, packed;
        if (!ref || !got || !mem) exit(2);
        for (tb = 0; tb < 2; tb++)
            for (t = 0; t <= 3; t++)
                for (beta = 0; beta < 2; beta++)
                    for (packed = 0; packed < 2; packed++) {
                        dtr__pool *p = NULL;
                        dtr__gemm_bpack bp;
                        int64_t rsb = tb ? 1 : N, csb = tb ? K : 1;
                        if (t) CHECK(dtr__pool_create(NULL, t, &p) == DTR_OK);
                        memcpy(ref, C0, sizeof(float) * (size_t)(M * N)), memcpy(got, C0, sizeof(float) * (size_t)(M * N));
                        dtr__gemm(p, M, N, K, 0.75f, A, K, 1, B, rsb, csb, (float)beta, ref, N);
                        dtr__gemm_bpack_fill(&bp, B, rsb, csb, K, N, packed ? mem : NULL);
                        dtr__gemm_packed(p, -1, M, 0.75f, A, K, 1, &bp, (float)beta, got, N);
                        CHECK_MSG(memcmp(ref, got, sizeof(float) * (size_t)(M * N)) == 0, "%lld x %lld x %lld, B %s, %d threads, beta %d%s",
                                  (long long)M, (long long)N, (long long)K, tb ? "transposed" : "as stored", t, beta, packed ? "" : ", unpacked");
                        memcpy(got, C0, sizeof(float) * (size_t)(M * N));   /* on one worker, the last */
                        dtr__gemm_packed(p, t ? t - 1 : 0, M, 0.75f, A, K, 1, &bp, (float)beta, got, N);
                        CHECK_MSG(memcmp(ref, got, sizeof(float) * (size_t)(M * N)) == 0, "on a worker: %lld x %lld x %lld, %d threads",
                                  (long long)M, (long long)N, (long long)K, t);
                        if (p) dtr__pool_destroy(p);
                    }
        free(A); free(B); free(C0); free(ref); free(got); free(mem);
    }
}

/* a B (K, N) stored with strides, made block by block as a producer (dtr__gemm_bgen) makes it:
   through the kernel's own packing (dtr__gemm_pack_panels), or element by element */
typedef struct tg_bgen { const float *B; int64_t rsb, csb; int calls, own; } tg_bgen;

static void tg_gen(void *user, int64_t k0, int64_t kb, int64_t j0, int64_t nb, int nr, float *dst) {
    tg_bgen *u = (tg_bgen *)user;
    int64_t p, k, j;
    u->calls++;
    if (u->own) { dtr__gemm_pack_panels(u->B + k0 * u->rsb + j0 * u->csb, u->rsb, u->csb, kb, nb, dst); return; }
    for (p = 0; p < nb; p += nr, dst += (int64_t)nr * kb)
        for (k = 0; k < kb; k++)
            for (j = 0; j < nr; j++) dst[k * nr + j] = p + j < nb ? u->B[(k0 + k) * u->rsb + (j0 + p + j) * u->csb] : 0.0f;
}

/* dtr__gemm_on_gen (a convolution's columns made as the product packs them) gives dtr__gemm_on's
   bits over the B it makes: B as stored or transposed, K past one K block, N past one N block
   (NEON's is 1536 wide), beta 0 and 1, a pool's worker and no pool, panels made by hand or by
   the kernel's packing. Quick runs (DTR_TEST_QUICK: the ARM64 part under qemu) take the first
   shape with fewer rows and a shorter K, which still crosses every block boundary */
static void test_gemm_on_gen(void) {
    static const int64_t shapes[][3] = {{64, 3136, 576}, {7, 1031, 700}, {33, 40, 9}, {1, 17, 3}};
    const int quick = getenv("DTR_TEST_QUICK") != NULL;
    size_t i;
    for (i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        int64_t M = i == 0 && quick ? 9 : shapes[i][0], N = shapes[i][1], K = i == 0 && quick ? 300 : shapes[i][2];
        float *A = tg_alloc_rand(M * K), *B = tg_alloc_rand(K * N), *C0 = tg_alloc_rand(M * N);
        float *ref = (float *)malloc(sizeof(float) * (size_t)(M * N)), *got = (float *)malloc(sizeof(float) * (size_t)(M * N));
        dtr__pool *p = NULL;
        int tb, beta, own;
        if (!ref || !got || dtr__pool_create(NULL, 2, &p) != DTR_OK) exit(2);
        for (tb = 0; tb < 2; tb++)
            for (beta = 0; beta < 2; beta++)
                for (own = 0; own < 2; own++) {
                    tg_bgen u;
                    u.B = B, u.rsb = tb ? 1 : N, u.csb = tb ? K : 1, u.calls = 0, u.own = own;
                    memcpy(ref, C0, sizeof(float) * (size_t)(M * N)), memcpy(got, C0, sizeof(float) * (size_t)(M * N));
                    dtr__gemm_on(p, 1, M, N, K, 0.75f, A, K, 1, B, u.rsb, u.csb, (float)beta, ref, N);
                    dtr__gemm_on_gen(p, 1, M, N, K, 0.75f, A, K, 1, tg_gen, &u, (float)beta, got, N);
                    CHECK_MSG(u.calls > 0 && memcmp(ref, got, sizeof(float) * (size_t)(M * N)) == 0, "%lld x %lld x %lld, B %s, "
                              "beta %d, %s panels", (long long)M, (long long)N, (long long)K, tb ? "transposed" : "as stored", beta,
                              own ? "the kernel's" : "hand-made");
                    memcpy(got, C0, sizeof(float) * (size_t)(M * N));
                    dtr__gemm_on_gen(NULL, 0, M, N, K, 0.75f, A, K, 1, tg_gen, &u, (float)beta, got, N);
                    CHECK(memcmp(ref, got, sizeof(float) * (size_t)(M * N)) == 0);
                }
        dtr__pool_destroy(p);
        free(A); free(B); free(C0); free(ref); free(got);
    }
}

/* After a warm-up call, GEMMs of the same or smaller sizes make no allocation-callback call. */
static void test_gemm_no_steady_state_alloc(void) {
    dtr_allocation_callbacks cb;
    dtr__pool *p = NULL;
    float *A = tg_alloc_rand(256 * 784), *B = tg_alloc_rand(784 * 256), *C = tg_alloc_rand(256 * 256);
    long before;
    int r;
    count_alloc c = {0, 0, 0, 0, 0, 0};
    cb = count_alloc_callbacks(&c);
    CHECK(dtr__pool_create(&cb, 2, &p) == DTR_OK);
    if (!p) return;
    dtr__gemm(p, 256, 256, 784, 1.0f, A, 784, 1, B, 256, 1, 0.0f, C, 256);
    dtr__gemm(p, 256, 256, 784, 1.0f, A, 1, 256, B, 1, 784, 0.0f, C, 256);
    before = count_alloc_total(&c);
    for (r = 0; r < 5; r++) {
        dtr__gemm(p, 64, 256, 784, 1.0f, A, 784, 1, B, 256, 1, 0.0f, C, 256);
        dtr__gemm(p, 64, 200, 256, 1.0f, A, 256, 1, B, 1, 256, 1.0f, C, 256);
        dtr__gemm(p, 200, 256, 64, 1.0f, A, 1, 200, B, 256, 1, 1.0f, C, 256);
        dtr__gemm(p, 256, 256, 784, 1.0f, A, 784, 1, B, 256, 1, 0.0f, C, 256);
        dtr__gemm_on(p, 1, 32, 100, 9, 1.0f, A, 9, 1, B, 100, 1, 0.0f, C, 100);
    }
    CHECK_EQ_INT(count_alloc_total(&c), before);
    dtr__pool_destroy(p);
    free(A); free(B); free(C);
}

/* 1 when kernel `name` is to be tested: DTR_TEST_KERNELS is unset or names it */
static int kernel_wanted(const char *name) {
    const char *list = getenv("DTR_TEST_KERNELS"), *at;
    size_t n = strlen(name);
    if (!list || !*list) return 1;
    for (at = strstr(list, name); at; at = strstr(at + 1, name))
        if ((at == list || at[-1] == ',') && (at[n] == ',' || at[n] == '\0')) return 1;
    return 0;
}

int main(void) {
    static const char *const kernels[4] = { "avx512", "avx2", "neon", "generic" };
    int k;
    (void)test_ctx;   /* from test.h; these tests need no context */
    RUN(test_pool_coverage);
    RUN(test_pool_chunks);
    RUN(test_pool_nested);
    RUN(test_pool_stress);
    RUN(test_pool_scratch);
    RUN(test_gemm_kernel_name);
    for (k = 0; k < 4; k++) {   /* every kernel this CPU runs */
        if (!kernel_wanted(kernels[k])) printf("     kernel %s: not in DTR_TEST_KERNELS, not run here\n", kernels[k]);
        if (!kernel_wanted(kernels[k]) || !dtr__gemm_force(kernels[k])) continue;
        printf("     kernel %s:\n", dtr__gemm_kernel_name());
        RUN(test_gemm_shapes);
        RUN(test_gemm_strided_views);
        RUN(test_gemm_training_shapes);
        RUN(test_gemm_k0_alpha0_nan);
        RUN(test_gemm_deterministic);
        RUN(test_gemm_on);
        RUN(test_gemm_packed);
        RUN(test_gemm_on_gen);
        RUN(test_gemm_no_steady_state_alloc);
    }
    dtr__gemm_force(NULL);
    return test_summary();
}
