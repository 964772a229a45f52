/* bench/gpu_gemm.c: the matrix products of a training step on a backend, as JSON lines
 * ("impl":"dtrain"; bench/gpu_gemm_torch.py prints the same lines for PyTorch on the same GPU):
 * dtr_linear (y = x W^T, no bias) on the linear layers of the GPTs of bench/gpu.c, tokens
 * batch x context:
 *   gpt2_qkv 4096 x 768 -> 2304, gpt2_proj 768 -> 768, gpt2_fc 768 -> 3072,
 *   gpt2_fcproj 3072 -> 768, gpt2_head 768 -> 50257; gpt_fc 2048 x 384 -> 1536, gpt_head 384 -> 50257
 * Per shape two lines: "pass":"fwd" (the forward product, 2 M K N flops) and "pass":"fwd_bwd"
 * (forward, sum, backward: the input and the weight gradients, 6 M K N flops, plus the sum's
 * element-wise pass that PyTorch's side does too). Each figure is the best of --rounds rounds of
 * --iters products after a warm-up, the device synchronised by a read at the end of a round.
 * --bf16 rounds the f32 operands to bf16 inside cuBLAS; --bf16 --bf16-act casts x to bf16 first
 * (bf16 activations: the product reads it as stored, writes y in bf16), as torch.autocast does.
 * Usage: gpu_gemm [--backend cuda|cpu] [--shape NAME|all] [--iters N] [--rounds N] [--tf32] [--bf16]
 *                 [--bf16-act] [--threads N]   (--backend cpu runs the small shapes only: a CPU check)
 * Build: make build/bench/gpu_gemm (links dtrain_cuda.o). */
#define _POSIX_C_SOURCE 200809L
#include "../dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct gemm_shape { const char *name; int64_t m, k, n; } gemm_shape;

static const gemm_shape SHAPES[] = {
    {"gpt2_qkv", 4096, 768, 2304},  {"gpt2_proj", 4096, 768, 768},   {"gpt2_fc", 4096, 768, 3072},
    {"gpt2_fcproj", 4096, 3072, 768}, {"gpt2_head", 4096, 768, 50257}, {"gpt_fc", 2048, 384, 1536},
    {"gpt_head", 2048, 384, 50257},
};
#define NSHAPES ((int)(sizeof SHAPES / sizeof SHAPES[0]))

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int g_act16;   /* --bf16-act */

/* one product (fwd) or product, sum and backward (bwd); the own tape reset after */
static dtr_result one(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, int bwd) {
    dtr_tensor *y = dtr_linear(ctx, g_act16 ? dtr_cast(ctx, x, DTR_BF16) : x, w, NULL);
    dtr_result r = y ? DTR_OK : dtr_context_status(ctx);
    if (r == DTR_OK && bwd) r = dtr_backward(ctx, dtr_sum_all(ctx, y));
    dtr_context_reset(ctx);
    return r;
}

/* the best seconds per product over `rounds` rounds of `iters` */
static dtr_result time_pass(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, int bwd, int iters, int rounds, double *best) {
    dtr_result r = one(ctx, x, w, bwd);   /* warm-up: cuBLAS's first call, the arena's chunks */
    int i, k;
    *best = 1e30;
    for (k = 0; r == DTR_OK && k < rounds; k++) {
        double t0 = now_s(), dt;
        for (i = 0; r == DTR_OK && i < iters; i++) r = one(ctx, x, w, bwd);
        (void)dtr_tensor_get(w, 0);       /* waits for the stream */
        dt = (now_s() - t0) / iters;
        if (dt < *best) *best = dt;
    }
    return r;
}

static int run_shape(dtr_context *ctx, const gemm_shape *s, const char *bname, int tf32, int bf16, int iters, int rounds) {
    int64_t xs[2] = {s->m, s->k}, ws[2] = {s->n, s->k};
    dtr_model *m = NULL;
    dtr_tensor *x = NULL, *w = NULL;
    dtr_result r = dtr_model_create(ctx, 1, &m);
    double t[2] = {0, 0};
    int pass;
    /* x and W are parameters of a model: their gradients (both products of backward) live in its buffers */
    if (r == DTR_OK) x = dtr_model_param(m, "x", 2, xs, DTR_INIT_UNIFORM, 1.0f);
    if (r == DTR_OK) w = dtr_model_param(m, "w", 2, ws, DTR_INIT_UNIFORM, 1.0f);
    if (x && w) r = dtr_model_build(m);
    for (pass = 0; pass < 2 && x && w && r == DTR_OK; pass++) r = time_pass(ctx, x, w, pass, iters, rounds, &t[pass]);
    if (!x || !w || r != DTR_OK) {
        printf("{\"bench\":\"gpu_gemm\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"shape\":\"%s\",\"error\":\"%s\"}\n", bname,
               s->name, dtr_context_last_error(ctx));
        dtr_model_destroy(m);
        return 0;
    }
    for (pass = 0; pass < 2; pass++)
        printf("{\"bench\":\"gpu_gemm\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"shape\":\"%s\",\"m\":%lld,\"k\":%lld,"
               "\"n\":%lld,\"pass\":\"%s\",\"tf32\":%d,\"bf16\":%d,\"bf16_act\":%d,\"ms\":%.4f,\"tflops\":%.2f}\n",
               bname, s->name, (long long)s->m, (long long)s->k, (long long)s->n, pass ? "fwd_bwd" : "fwd", tf32, bf16, g_act16,
               t[pass] * 1e3, (pass ? 6.0 : 2.0) * (double)s->m * (double)s->k * (double)s->n / t[pass] / 1e12);
    fflush(stdout);
    dtr_model_destroy(m);
    return 1;
}

int main(int argc, char **argv) {
    const char *backend = "cuda", *shape = "all";
    int iters = 20, rounds = 5, tf32 = 0, bf16 = 0, threads = 0, i, ok = 1, ran = 0;
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) shape = argv[++i];
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tf32")) tf32 = 1;
        else if (!strcmp(argv[i], "--bf16")) bf16 = 1;
        else if (!strcmp(argv[i], "--bf16-act")) g_act16 = 1;
        else {
            fprintf(stderr, "usage: %s [--backend cuda|cpu] [--shape NAME|all] [--iters N] [--rounds N] [--tf32] "
                            "[--bf16] [--bf16-act] [--threads N]\n", argv[0]);
            return 2;
        }
    }
    if (iters < 1 || rounds < 1) return 2;
    cc.backend = strcmp(backend, "cpu") ? dtr_cuda_backend() : NULL;
    cc.threads = threads;
    cc.allow_tf32 = tf32;
    cc.matmul_precision = bf16 ? DTR_MATMUL_BF16 : DTR_MATMUL_F32;
    cc.activation_dtype = g_act16 ? DTR_BF16 : DTR_F32;
    if (dtr_context_create(&cc, &ctx) != DTR_OK) {
        printf("{\"bench\":\"gpu_gemm\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"skipped\":\"%s\"}\n", backend,
               dtr_context_create_error());
        return 0;
    }
    for (i = 0; i < NSHAPES; i++) {
        if (strcmp(shape, "all") ? strcmp(shape, SHAPES[i].name) != 0 : (!cc.backend && SHAPES[i].n > 4096)) continue;
        ok &= run_shape(ctx, &SHAPES[i], backend, tf32, bf16, iters, rounds);
        ran++;
    }
    dtr_context_destroy(ctx);
    if (!ran) fprintf(stderr, "gpu_gemm: no shape named '%s'\n", shape);
    return ok && ran ? 0 : 1;
}
