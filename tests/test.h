/* tests/test.h: a tiny test harness. Each test program is built against the amalgamated
 * dtrain.h (the implementation lives in build/dtrain_impl.o), runs its cases with RUN(),
 * and ends with `return test_summary();`, which prints "<file>: N passed, N failed" and
 * exits non-zero on any failure. tests/run.sh adds the counts of all programs. */
#ifndef DTRAIN_TEST_H
#define DTRAIN_TEST_H
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../dtrain.h"

static int test__passed, test__failed, test__case_failed;
static const char *test__case;

#define CHECK(cond) do { if (!(cond)) { \
    fprintf(stderr, "  FAIL %s:%d in %s: %s\n", __FILE__, __LINE__, test__case, #cond); \
    test__case_failed = 1; } } while (0)
#define CHECK_MSG(cond, ...) do { if (!(cond)) { \
    fprintf(stderr, "  FAIL %s:%d in %s: %s: ", __FILE__, __LINE__, test__case, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); test__case_failed = 1; } } while (0)
#define CHECK_EQ_INT(a, b) do { long long test__a = (long long)(a), test__b = (long long)(b); \
    if (test__a != test__b) { fprintf(stderr, "  FAIL %s:%d in %s: %s == %s (%lld vs %lld)\n", \
    __FILE__, __LINE__, test__case, #a, #b, test__a, test__b); test__case_failed = 1; } } while (0)
#define CHECK_NEAR(a, b, tol) do { double test__a = (double)(a), test__b = (double)(b); \
    if (!(fabs(test__a - test__b) <= (tol))) { fprintf(stderr, "  FAIL %s:%d in %s: %s ~ %s (%.9g vs %.9g, tol %g)\n", \
    __FILE__, __LINE__, test__case, #a, #b, test__a, test__b, (double)(tol)); test__case_failed = 1; } } while (0)
/* Checks a dtr_result and prints the context's message when it is not DTR_OK. */
#define CHECK_OK(ctx, expr) do { dtr_result test__r = (expr); if (test__r != DTR_OK) { \
    fprintf(stderr, "  FAIL %s:%d in %s: %s -> %s (%s)\n", __FILE__, __LINE__, test__case, #expr, \
    dtr_result_string(test__r), (ctx) ? dtr_context_last_error(ctx) : ""); test__case_failed = 1; } } while (0)

#define RUN(fn) do { test__case = #fn; test__case_failed = 0; fn(); \
    if (test__case_failed) { test__failed++; fprintf(stderr, "FAIL %s\n", #fn); } \
    else { test__passed++; printf("ok   %s\n", #fn); } fflush(stdout); } while (0)

static int test__summary(const char *file) {
    const char *name = strrchr(file, '/');
    printf("%s: %d passed, %d failed\n", name ? name + 1 : file, test__passed, test__failed);
    return test__failed ? 1 : 0;
}
#define test_summary() test__summary(__FILE__)

/* the largest |a - b| / (1 + |b|) over n floats; NaN when either side holds a NaN, so that a
   check `gap < tol` fails on it (fmax would drop it) */
static inline double test_rel_gap(const float *a, const float *b, int64_t n) {
    double worst = 0.0;
    int64_t i;
    for (i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]) / (1.0 + fabs((double)b[i]));
        if (d > worst || d != d) worst = d;
        if (worst != worst) break;
    }
    return worst;
}

/* the bytes of an optimizer's moment buffers (its state entries "m" and "v") */
static inline size_t test_moment_bytes(dtr_optimizer *o) {
    dtr_state_entry e;
    size_t b = 0;
    int i;
    for (i = 3; dtr_optimizer_state(o, i, &e) == DTR_OK; i++)
        if (!strcmp(e.name, "m") || !strcmp(e.name, "v")) b += e.bytes;
    return b;
}

/* A context with defaults and `threads` threads; aborts the test program if it cannot be made. */
static dtr_context *test_ctx(int threads) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    cfg.threads = threads;
    if (dtr_context_create(&cfg, &ctx) != DTR_OK) { fprintf(stderr, "cannot create context\n"); exit(2); }
    return ctx;
}
#endif
