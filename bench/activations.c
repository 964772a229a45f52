/* bench/activations.c: element throughput of the activations (GELU tanh and erf forms, tanh,
 * sigmoid, ReLU, SiLU; forward and backward through the ops, one thread) beside the same formulas on the C
 * library's tanhf, erff and expf in a plain loop in the same process (what dtrain's kernels
 * called before they had their own exp, tanh and erf: src/core/formulas.h), and of
 * cross-entropy over rows of a GPT's 50257 logits ("op":"cross_entropy", ns per logit; its
 * libm column: the row's maximum, its sum of expf in double and the loss in a plain loop).
 *
 * Prints one JSON line per activation:
 *   {"bench":"activations","op":"gelu","n":4194304,"dtrain_fwd_ns":4.9,"dtrain_bwd_ns":7.6,
 *    "libm_fwd_ns":25.8,"speedup_fwd":5.3}
 * ns per element, best of --rounds rounds (the two alternate, so a noisy machine affects both).
 * Usage: build/bench/activations [--n N] [--rounds R] */
#define _POSIX_C_SOURCE 199309L
#include "../dtrain.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* the formulas on the C library's functions (GELU's constants as PyTorch's) */
static float libm_act(int op, float x) {
    switch (op) {
    case 0: return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
    case 1: return 0.5f * x * (1.0f + erff(x * 0.7071067812f));
    case 2: return tanhf(x);
    case 3: return 1.0f / (1.0f + expf(-x));
    case 5: return x / (1.0f + expf(-x));
    default: return x < 0.0f ? 0.0f : x;
    }
}

static dtr_tensor *dtr_act(dtr_context *ctx, int op, dtr_tensor *x) {
    switch (op) {
    case 0: return dtr_gelu(ctx, x);
    case 1: return dtr_gelu_erf(ctx, x);
    case 2: return dtr_tanh(ctx, x);
    case 3: return dtr_sigmoid(ctx, x);
    case 5: return dtr_silu(ctx, x);
    default: return dtr_relu(ctx, x);
    }
}

/* cross-entropy of n / 50257 rows of the logits v (random targets): one JSON line */
static void bench_xent(dtr_context *ctx, const float *v, int64_t n, int rounds) {
    int64_t K = 50257, R = n / K, shape[2] = {R, K}, i, k;
    int32_t *t = (int32_t *)malloc((size_t)(R ? R : 1) * sizeof(int32_t));
    double fwd = 1e30, bwd = 1e30, ref = 1e30;
    volatile double loss = 0.0;
    int r;
    if (!t || R < 1) return;
    for (i = 0; i < R; i++) t[i] = (int32_t)(rand() % K);
    for (r = 0; r < rounds; r++) {
        dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, shape, v)), *l;
        double t0 = now_s(), t1, t2;
        l = dtr_cross_entropy(ctx, x, dtr_tensor_from(ctx, DTR_I32, 1, &R, t));
        t1 = now_s();
        if (!l || dtr_backward(ctx, l) != DTR_OK) return;
        t2 = now_s();
        fwd = t1 - t0 < fwd ? t1 - t0 : fwd;
        bwd = t2 - t1 < bwd ? t2 - t1 : bwd;
        dtr_context_reset(ctx);
        t0 = now_s();
        for (i = 0; i < R; i++) {
            const float *x = v + i * K;
            float mx = -INFINITY;
            double sum = 0.0;
            for (k = 0; k < K; k++) mx = x[k] > mx ? x[k] : mx;
            for (k = 0; k < K; k++) sum += expf(x[k] - mx);
            loss += mx + log(sum) - x[t[i]];
        }
        t1 = now_s();
        ref = t1 - t0 < ref ? t1 - t0 : ref;
    }
    printf("{\"bench\":\"activations\",\"op\":\"cross_entropy\",\"n\":%lld,\"dtrain_fwd_ns\":%.2f,\"dtrain_bwd_ns\":%.2f,"
           "\"libm_fwd_ns\":%.2f,\"speedup_fwd\":%.2f}\n",
           (long long)(R * K), fwd * 1e9 / (double)(R * K), bwd * 1e9 / (double)(R * K), ref * 1e9 / (double)(R * K), ref / fwd);
    free(t);
}

int main(int argc, char **argv) {
    static const char *names[] = {"gelu", "gelu_erf", "tanh", "sigmoid", "relu", "silu"};
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    int64_t n = (int64_t)1 << 22, i;
    int rounds = 5, op, r, a;
    float *v, *out;
    volatile float sink = 0.0f;
    for (a = 1; a + 1 < argc; a += 2) {
        if (!strcmp(argv[a], "--n")) n = atoll(argv[a + 1]);
        else if (!strcmp(argv[a], "--rounds")) rounds = atoi(argv[a + 1]);
    }
    cfg.threads = 1;
    v = (float *)malloc((size_t)n * sizeof(float));
    out = (float *)malloc((size_t)n * sizeof(float));
    if (!v || !out || n <= 0 || dtr_context_create(&cfg, &ctx) != DTR_OK) return 1;
    srand(1);
    for (i = 0; i < n; i++) v[i] = (float)rand() / (float)RAND_MAX * 8.0f - 4.0f;
    for (op = 0; op < 6; op++) {
        double fwd = 1e30, bwd = 1e30, ref = 1e30;
        for (r = 0; r < rounds; r++) {
            dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, &n, v)), *y, *l;
            double t0 = now_s(), t1, t2, t3;
            y = dtr_act(ctx, op, x);
            t1 = now_s();
            l = dtr_sum_all(ctx, y);
            t2 = now_s();
            if (!y || !l || dtr_backward(ctx, l) != DTR_OK) return 1;
            t3 = now_s();
            fwd = t1 - t0 < fwd ? t1 - t0 : fwd;
            bwd = t3 - t2 < bwd ? t3 - t2 : bwd;
            dtr_context_reset(ctx);
            t0 = now_s();
            for (i = 0; i < n; i++) out[i] = libm_act(op, v[i]);
            t1 = now_s();
            sink += out[n / 2];
            ref = t1 - t0 < ref ? t1 - t0 : ref;
        }
        printf("{\"bench\":\"activations\",\"op\":\"%s\",\"n\":%lld,\"dtrain_fwd_ns\":%.2f,\"dtrain_bwd_ns\":%.2f,"
               "\"libm_fwd_ns\":%.2f,\"speedup_fwd\":%.2f}\n",
               names[op], (long long)n, fwd * 1e9 / (double)n, bwd * 1e9 / (double)n, ref * 1e9 / (double)n, ref / fwd);
    }
    bench_xent(ctx, v, n, rounds);
    dtr_context_destroy(ctx);
    free(v);
    free(out);
    return sink == 12345.0f;
}
