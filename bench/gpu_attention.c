/* bench/gpu_attention.c: the self-attention of the GPTs of bench/gpu.c and of two encoders on a
 * backend, as JSON lines ("impl":"dtrain"; bench/gpu_attention_torch.py prints the same lines
 * for PyTorch's scaled_dot_product_attention on the same GPU):
 *   gpt2: batch 4, context 1024, 12 heads of 64 (GPT-2 small); gpt: batch 8, context 256, 6 heads of 64;
 *   d128: batch 2, context 2048, 16 heads of 128 (a 1B Llama's attention), all causal;
 *   vit: batch 32, 197 tokens, 12 heads of 64 (ViT-B/16 on 224 x 224 images), bert: batch 8,
 *   512 tokens, 12 heads of 64 (BERT-base), not causal (dtr_attention_ex, "causal":0)
 * Per shape two lines: "pass":"fwd" (2 B H T^2 D flops causal, the causal half of the two
 * products, 4 B H T^2 D not) and "pass":"fwd_bwd" (forward, sum, backward: 3.5 times the
 * forward's, backward's five products counted as 2.5 forwards). q, k and v are f32 parameters cast to bf16 first with
 * --bf16 (bf16 activations and products), as the GPT does; without it, f32 (--tf32 allows TF32).
 * The fused kernels take every shape here; DTR_CUDA_FLASH=0 in the environment takes the tiled
 * ones ("kernels":"tiled" in the lines). Each figure is the best of --rounds rounds of --iters
 * after a warm-up, the device synchronised by a read at the end of a round.
 * Usage: gpu_attention [--backend cuda|cpu] [--shape gpt2|gpt|d128|vit|bert|all] [--iters N] [--rounds N] [--bf16] [--tf32]
 * Build: make build/bench/gpu_attention (links dtrain_cuda.o). */
#define _POSIX_C_SOURCE 200809L
#include "../dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct att_shape { const char *name; int64_t b, t, h, d; int causal; } att_shape;

static const att_shape SHAPES[] = {{"gpt2", 4, 1024, 12, 64, 1}, {"gpt", 8, 256, 6, 64, 1}, {"d128", 2, 2048, 16, 128, 1},
                                   {"vit", 32, 197, 12, 64, 0}, {"bert", 8, 512, 12, 64, 0}};
#define NSHAPES ((int)(sizeof SHAPES / sizeof SHAPES[0]))

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int g_bf16;

/* 1 when DTR_CUDA_FLASH=0 makes the CUDA backend take its tiled attention kernels */
static int tiled(void) {
    const char *e = getenv("DTR_CUDA_FLASH");
    return e && strcmp(e, "0") == 0;
}

static dtr_tensor *act(dtr_context *ctx, dtr_tensor *x) { return g_bf16 ? dtr_cast(ctx, x, DTR_BF16) : x; }

/* one attention (fwd) or attention, sum and backward; the tape reset after */
static dtr_result one(dtr_context *ctx, dtr_tensor **qkv, const att_shape *s, int bwd) {
    dtr_attention_config cfg = dtr_attention_config_init((int)s->h, s->causal);
    dtr_tensor *y = dtr_attention_ex(ctx, act(ctx, qkv[0]), act(ctx, qkv[1]), act(ctx, qkv[2]), &cfg);
    dtr_result r = y ? DTR_OK : dtr_context_status(ctx);
    if (r == DTR_OK && bwd) r = dtr_backward(ctx, dtr_sum_all(ctx, g_bf16 ? dtr_cast(ctx, y, DTR_F32) : y));
    dtr_context_reset(ctx);
    return r;
}

static dtr_result time_pass(dtr_context *ctx, dtr_tensor **qkv, const att_shape *s, int bwd, int iters, int rounds, double *best) {
    dtr_result r = one(ctx, qkv, s, bwd);   /* warm-up */
    int i, k;
    *best = 1e30;
    for (k = 0; r == DTR_OK && k < rounds; k++) {
        double t0 = now_s(), dt;
        for (i = 0; r == DTR_OK && i < iters; i++) r = one(ctx, qkv, s, bwd);
        (void)dtr_tensor_get(qkv[0], 0);      /* waits for the stream */
        dt = (now_s() - t0) / iters;
        if (dt < *best) *best = dt;
    }
    return r;
}

static int run_shape(dtr_context *ctx, const att_shape *s, const char *bname, int tf32, int iters, int rounds) {
    int64_t shape[3] = {s->b, s->t, s->h * s->d};
    const char *names[3] = {"q", "k", "v"};
    dtr_tensor *qkv[3] = {NULL, NULL, NULL};
    dtr_model *m = NULL;
    dtr_result r = dtr_model_create(ctx, 1, &m);
    double t[2] = {0, 0}, f = (s->causal ? 1.0 : 2.0) * (double)s->b * s->h * s->t * s->t * s->d;
    int i, pass;
    for (i = 0; i < 3 && r == DTR_OK; i++)
        if (!(qkv[i] = dtr_model_param(m, names[i], 3, shape, DTR_INIT_UNIFORM, 1.0f))) r = dtr_context_status(ctx);
    if (r == DTR_OK) r = dtr_model_build(m);
    for (pass = 0; pass < 2 && r == DTR_OK; pass++) r = time_pass(ctx, qkv, s, pass, iters, rounds, &t[pass]);
    if (r != DTR_OK) {
        printf("{\"bench\":\"gpu_attention\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"shape\":\"%s\",\"error\":\"%s\"}\n", bname,
               s->name, dtr_context_last_error(ctx));
        dtr_model_destroy(m);
        return 0;
    }
    for (pass = 0; pass < 2; pass++)
        printf("{\"bench\":\"gpu_attention\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"shape\":\"%s\",\"batch\":%lld,\"context\":%lld,"
               "\"heads\":%lld,\"head_dim\":%lld,\"causal\":%d,\"pass\":\"%s\",\"bf16\":%d,\"tf32\":%d,\"kernels\":\"%s\","
               "\"ms\":%.4f,\"tflops\":%.2f}\n",
               bname, s->name, (long long)s->b, (long long)s->t, (long long)s->h, (long long)s->d, s->causal, pass ? "fwd_bwd" : "fwd", g_bf16,
               tf32, tiled() ? "tiled" : "fused", t[pass] * 1e3, (pass ? 7.0 : 2.0) * f / t[pass] / 1e12);
    fflush(stdout);
    dtr_model_destroy(m);
    return 1;
}

int main(int argc, char **argv) {
    const char *backend = "cuda", *shape = "all";
    int iters = 20, rounds = 5, tf32 = 0, i, ok = 1, ran = 0;
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) shape = argv[++i];
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--bf16")) g_bf16 = 1;
        else if (!strcmp(argv[i], "--tf32")) tf32 = 1;
        else {
            fprintf(stderr, "usage: %s [--backend cuda|cpu] [--shape gpt2|gpt|d128|vit|bert|all] [--iters N] [--rounds N] [--bf16] [--tf32]\n", argv[0]);
            return 2;
        }
    }
    if (iters < 1 || rounds < 1) return 2;
    cc.backend = strcmp(backend, "cpu") ? dtr_cuda_backend() : NULL;
    cc.allow_tf32 = tf32;
    cc.matmul_precision = g_bf16 ? DTR_MATMUL_BF16 : DTR_MATMUL_F32;
    cc.activation_dtype = g_bf16 ? DTR_BF16 : DTR_F32;
    if (dtr_context_create(&cc, &ctx) != DTR_OK) {
        printf("{\"bench\":\"gpu_attention\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"skipped\":\"%s\"}\n", backend,
               dtr_context_create_error());
        return 0;
    }
    for (i = 0; i < NSHAPES; i++) {
        if (strcmp(shape, "all") && strcmp(shape, SHAPES[i].name)) continue;
        ok &= run_shape(ctx, &SHAPES[i], backend, tf32, iters, rounds);
        ran++;
    }
    dtr_context_destroy(ctx);
    if (!ran) fprintf(stderr, "gpu_attention: no shape named '%s'\n", shape);
    return ok && ran ? 0 : 1;
}
