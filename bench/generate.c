/* bench/generate.c: generation speed of a causal language model through a key/value cache
 * (dtr_kv_cache), against the same model without one (each step runs the whole sequence
 * again), as JSON lines ("impl":"dtrain"; bench/generate_torch.py prints the same lines for
 * PyTorch with a cache of its own tensors).
 *   gpt    bench/gpu's small GPT: 6 layers, width 384, 6 heads, vocabulary 50257
 *   llama  bench/gpu's small Llama: 8 layers, width 512, 8 heads over 2 kv heads, SwiGLU of
 *          1408, vocabulary 32000
 * Random weights (seed 1), a prompt of random tokens, greedy decoding (dtr_sample, temperature
 * 0). Per model and cache setting, the best of --repeat runs: prefill_ms (the prompt's forward
 * pass and the first token), decode_ms_per_token and decode_tokens_per_s (the --tokens - 1
 * steps after it, B tokens a step); "same_tokens" says whether the cached run chose the
 * uncached run's tokens.
 * Usage: generate [--backend cpu|cuda] [--model gpt|llama|all] [--prompt P] [--tokens N]
 *                 [--batch B] [--threads N] [--repeat R] [--no-uncached]
 * Build: make bench (CPU); make bench-gpu builds it with CUDA as build/bench/gpu_generate. */
#define _POSIX_C_SOURCE 200809L
#include "../dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct lm {
    const char *name;
    int llama;
    int64_t layers, dim, heads, kv_heads, hidden, vocab;
} lm;

static const lm MODELS[] = {
    {"gpt", 0, 6, 384, 6, 6, 0, 50257},
    {"llama", 1, 8, 512, 8, 2, 1408, 32000},
};

typedef struct net {
    dtr_model *m;
    dtr_embedding_layer wte, wpe;
    dtr_gpt_block h[8];
    dtr_llama_block l[8];
    dtr_layernorm_layer ln;
    dtr_rmsnorm_layer norm;
    dtr_linear_layer head;
} net;

static dtr_result net_init(net *n, const lm *b, int64_t positions) {
    dtr_result r = dtr_embedding_layer_init(&n->wte, n->m, "wte", b->vocab, b->dim);
    char name[32];
    int i;
    if (r == DTR_OK && !b->llama) r = dtr_embedding_layer_init(&n->wpe, n->m, "wpe", positions, b->dim);
    for (i = 0; r == DTR_OK && i < b->layers; i++) {
        snprintf(name, sizeof name, "h.%d", i);
        r = b->llama ? dtr_llama_block_init(&n->l[i], n->m, name, b->dim, (int)b->heads, (int)b->kv_heads, b->hidden)
                     : dtr_gpt_block_init(&n->h[i], n->m, name, b->dim, (int)b->heads);
    }
    if (r == DTR_OK) r = b->llama ? dtr_rmsnorm_layer_init(&n->norm, n->m, "norm", b->dim) : dtr_layernorm_layer_init(&n->ln, n->m, "ln", b->dim);
    if (r == DTR_OK) r = dtr_linear_layer_init(&n->head, n->m, "head", b->dim, b->vocab, 0, DTR_INIT_TORCH_DEFAULT);
    return r == DTR_OK ? dtr_model_build(n->m) : r;
}

/* logits (B, T, V) of ids (B, T) at positions at .. at + T - 1, through kv (NULL: the plain pass) */
static dtr_tensor *net_forward(dtr_context *ctx, const net *n, const lm *b, const int32_t *ids, int64_t B, int64_t T, int64_t at,
                               dtr_kv_cache *kv) {
    int64_t s[2] = {B, T}, i;
    dtr_tensor *h = dtr_embedding_layer_forward(ctx, &n->wte, dtr_tensor_from(ctx, DTR_I32, 2, s, ids));
    if (!b->llama) {
        int32_t *pos = (int32_t *)malloc(sizeof(int32_t) * (size_t)(B * T));
        for (i = 0; pos && i < B * T; i++) pos[i] = (int32_t)(at + i % T);
        h = pos ? dtr_add(ctx, h, dtr_embedding_layer_forward(ctx, &n->wpe, dtr_tensor_from(ctx, DTR_I32, 2, s, pos))) : NULL;
        free(pos);
    }
    for (i = 0; i < b->layers; i++)
        h = b->llama ? dtr_llama_block_forward_cached(ctx, &n->l[i], h, kv, (int)i) : dtr_gpt_block_forward_cached(ctx, &n->h[i], h, kv, (int)i);
    h = b->llama ? dtr_rmsnorm_layer_forward(ctx, &n->norm, h) : dtr_layernorm_layer_forward(ctx, &n->ln, h);
    return dtr_linear_layer_forward(ctx, &n->head, h);
}

/* One generation: the prompt (seq's first P tokens of each item's row of P + N), then N tokens
   greedily into seq; the first forward pass (and token) and the rest timed. */
static int run_once(dtr_context *ctx, const net *n, const lm *b, int64_t B, int64_t P, int64_t N, dtr_kv_cache *kv, int32_t *seq,
                    double *prefill_s, double *decode_s) {
    dtr_sample_config sc = dtr_sample_config_init();
    int32_t *in = (int32_t *)malloc(sizeof(int32_t) * (size_t)(B * (P + N))), next[64];
    int64_t len, at = 0, i, k;
    double t0 = now_s(), t1 = t0;
    uint64_t rng = 1;
    int ok = in != NULL;
    sc.temperature = 0.0f;
    dtr_kv_cache_reset(kv);
    for (len = P; ok && len < P + N; len++) {
        int64_t from = kv ? at : 0, T = len - from;   /* the positions this step feeds */
        dtr_tensor *logits;
        for (k = 0; k < B; k++) memcpy(in + k * T, seq + k * (P + N) + from, sizeof(int32_t) * (size_t)T);
        logits = net_forward(ctx, n, b, in, B, T, from, kv);
        ok = logits && dtr_sample(ctx, logits, &sc, &rng, next) == DTR_OK;
        for (i = 0; ok && i < B; i++) seq[i * (P + N) + len] = next[i];
        dtr_context_reset(ctx);
        at = len;
        if (len == P) t1 = now_s();
    }
    *prefill_s = t1 - t0;
    *decode_s = now_s() - t1;
    free(in);
    return ok;
}

static void report(const lm *b, const char *backend, int cached, int64_t B, int64_t P, int64_t N, int threads, double prefill,
                   double decode, int same) {
    printf("{\"bench\":\"generate\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"model\":\"%s\",\"cache\":%d,\"batch\":%lld,\"prompt\":%lld,"
           "\"new_tokens\":%lld,\"threads\":%d,\"prefill_ms\":%.2f,\"decode_ms_per_token\":%.3f,\"decode_tokens_per_s\":%.1f",
           backend, b->name, cached, (long long)B, (long long)P, (long long)N, threads, prefill * 1e3, decode * 1e3 / (double)(N - 1),
           (double)(B * (N - 1)) / decode);
    if (same >= 0) printf(",\"same_tokens\":%s", same ? "true" : "false");
    printf("}\n");
    fflush(stdout);
}

static int run_model(const lm *b, const dtr_backend *be, const char *backend, int64_t B, int64_t P, int64_t N, int threads, int repeat,
                     int uncached) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_kv_cache *kv = NULL;
    int32_t *seq = (int32_t *)calloc((size_t)(B * (P + N)), sizeof(int32_t)), *ref = (int32_t *)calloc((size_t)(B * (P + N)), sizeof(int32_t));
    double best[2][2] = {{1e30, 1e30}, {1e30, 1e30}};
    net n;
    dtr_rng rng;
    int64_t i;
    int ok, c, r;
    memset(&n, 0, sizeof n);
    cc.backend = be, cc.threads = threads, cc.seed = 1;
    dtr_rng_seed(&rng, 5, 1);
    for (i = 0; seq && ref && i < B * (P + N); i++) seq[i] = ref[i] = (int32_t)(dtr_rng_u32(&rng) % (uint32_t)b->vocab);
    ok = seq && ref && dtr_context_create(&cc, &ctx) == DTR_OK && dtr_model_create(ctx, 1, &n.m) == DTR_OK && net_init(&n, b, P + N) == DTR_OK &&
         dtr_kv_cache_create(ctx, (int)b->layers, B, P + N, b->dim / b->heads * (b->llama ? b->kv_heads : b->heads), &kv) == DTR_OK;
    if (ok) dtr_context_set_grad_enabled(ctx, 0);
    for (r = 0; ok && r < repeat; r++)
        for (c = uncached ? 0 : 1; ok && c < 2; c++) {
            double pf, dec;
            ok = run_once(ctx, &n, b, B, P, N, c ? kv : NULL, c ? seq : ref, &pf, &dec);
            if (pf + dec < best[c][0] + best[c][1]) best[c][0] = pf, best[c][1] = dec;
        }
    for (c = uncached ? 0 : 1; ok && c < 2; c++)
        report(b, backend, c, B, P, N, threads, best[c][0], best[c][1], c && uncached ? !memcmp(seq, ref, sizeof(int32_t) * (size_t)(B * (P + N))) : -1);
    if (!ok)
        printf("{\"bench\":\"generate\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"model\":\"%s\",\"error\":\"%s\"}\n", backend, b->name,
               ctx ? dtr_context_last_error(ctx) : "out of memory");
    dtr_kv_cache_destroy(kv);
    dtr_model_destroy(n.m);
    dtr_context_destroy(ctx);
    free(seq);
    free(ref);
    return ok;
}

int main(int argc, char **argv) {
    const char *backend = "cpu", *model = "all";
    int64_t P = 128, N = 64, B = 1;
    int threads = 0, repeat = 2, uncached = 1, i, ok = 1;
    const dtr_backend *be = NULL;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
        else if (!strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc) P = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) N = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc) B = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-uncached")) uncached = 0;
        else {
            fprintf(stderr, "usage: generate [--backend cpu|cuda] [--model gpt|llama|all] [--prompt P] [--tokens N] [--batch B] "
                            "[--threads N] [--repeat R] [--no-uncached]\n");
            return 2;
        }
    }
    if (P < 1 || N < 2 || B < 1 || B > 64 || repeat < 1) {
        fprintf(stderr, "generate: --prompt >= 1, --tokens >= 2, --batch 1 to 64, --repeat >= 1\n");
        return 2;
    }
    if (!strcmp(backend, "cuda")) {
#ifdef GEN_CUDA
        if (dtr_cuda_device_count() > 0) be = dtr_cuda_backend();
#endif
        if (!be) {
            printf("{\"bench\":\"generate\",\"impl\":\"dtrain\",\"backend\":\"cuda\",\"skipped\":\"no GPU visible (or built without CUDA)\"}\n");
            return 0;
        }
    }
    for (i = 0; i < (int)(sizeof MODELS / sizeof MODELS[0]); i++)
        if (!strcmp(model, "all") || !strcmp(model, MODELS[i].name)) ok &= run_model(&MODELS[i], be, backend, B, P, N, threads, repeat, uncached);
    return ok ? 0 : 1;
}
