/* bench/gpu.c: training throughput of five models on a backend, as JSON lines
 * ("impl":"dtrain"; bench/gpu_torch.py prints the same lines for PyTorch on the same GPU).
 *   mlp      Fashion-MNIST's MLP shape: 784-256-128-10, batch 256 (random inputs)
 *   cnn      conv 1->16 k3 p1, pool 2, conv 16->32 k3 p1, pool 2, linear 1568->10, batch 256
 *   gpt      6 layers, width 384, 6 heads, context 256, vocabulary 50257, batch 8
 *   gpt2     GPT-2 small's shape: 12 layers, width 768, 12 heads, context 1024, batch 4
 *   llama    a small Llama (dtr_llama_block): 8 layers, width 512, 8 heads over 2 kv heads,
 *            SwiGLU of 1408, RoPE, context 512, vocabulary 32000, batch 8
 * Each model: AdamW steps after warm-up, the step time, samples (tokens) per second, and for
 * the language models the model FLOP utilisation against --peak-tflops (6 N per token plus attention's
 * 12 L T C per token, as llm.c counts). Random data: throughput, not learning.
 * Usage: gpu [--backend cuda|cpu] [--model mlp|cnn|gpt|gpt2|llama|all] [--steps N] [--warmup N]
 *            [--peak-tflops F] [--threads N] [--trace PREFIX] [--tf32] [--bf16] [--retain-grads]
 *            [--release-activations] [--graph] [--bf16-act] [--lora R] [--dropout P]
 * --dropout P: the GPT blocks' dropout (dtr_gpt_block.dropout: attention weights and both
 * residual branches) and the Llama blocks' attention_dropout, beside gpu_torch.py --dropout P
 * (nanoGPT's dropout; SDPA's dropout_p): what drawing the masks costs.
 * --lora R: fine-tuning with LoRA adapters of rank R (alpha 2R) on the attention's input
 * projections (GPT: qkv; Llama: q and v, PEFT's defaults) and everything else frozen, beside
 * gpu_torch.py --lora R (the same adapters on PyTorch modules); optimizer_state_mb: AdamW's
 * moments. cuda_vmm: 1 on CUDA unless DTR_CUDA_VMM=0 (the frozen parameters' gradients then
 * take the device memory they take without the driver's virtual memory calls; docs/gpu.md).
 * --bf16: the matrix products on bf16 tensor cores (matmul_precision DTR_MATMUL_BF16; tensors
 * stay f32), beside PyTorch's torch.autocast(bfloat16) in gpu_torch.py --bf16.
 * --bf16-act: the ops' outputs stored in bf16 (activation_dtype DTR_BF16: half the activation
 * memory; parameters, gradients and optimizer state f32); with --bf16 the closest match of
 * autocast (whose products' outputs are bf16).
 * peak_mem_mb: the device's peak (dtr_cuda_memory; 0 on the CPU); arena_peak_mb: the step
 * arena's (activations, saved state, gradients of intermediates: every backend).
 * --retain-grads keeps every intermediate's gradient to the end of the step (the behaviour
 * before intermediates' gradients were released during backward); --release-activations
 * releases each op's output and saved state once its backward ran (dtr_context_config).
 * --graph captures forward and backward once (dtr_graph_capture: a CUDA graph) and launches it
 * each step, the inputs made once (the optimizer step stays eager; the first step is the capture).
 * --trace writes PREFIX.<model>.json (Perfetto); run with CUDA_LAUNCH_BLOCKING=1 for kernel times.
 * Build: make bench-gpu (links dtrain_cuda.o); --backend cpu works without a GPU. */
#define _POSIX_C_SOURCE 200809L
#include "../dtrain.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static float g_dropout;       /* --dropout P: the blocks' dropout while training */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct bench_model {
    const char *name;
    int kind;                 /* 0 mlp, 1 cnn, 2 gpt, 3 llama */
    int64_t batch, layers, dim, heads, context, vocab, kv_heads, hidden;
} bench_model;

static const bench_model MODELS[] = {
    {"mlp", 0, 256, 0, 0, 0, 0, 10, 0, 0},
    {"cnn", 1, 256, 0, 0, 0, 0, 10, 0, 0},
    {"gpt", 2, 8, 6, 384, 6, 256, 50257, 0, 0},
    {"gpt2", 2, 4, 12, 768, 12, 1024, 50257, 0, 0},
    {"llama", 3, 8, 8, 512, 8, 512, 32000, 2, 1408},
};

/* 1 for the language models (token ids in, a token's targets out) */
static int is_lm(const bench_model *b) { return b->kind >= 2; }

typedef struct net {
    dtr_model *m;
    dtr_linear_layer l1, l2, l3, head;
    dtr_conv2d_layer c1, c2;
    dtr_embedding_layer wte, wpe;
    dtr_gpt_block h[12];
    dtr_llama_block lh[8];
    dtr_layernorm_layer ln_f;
    dtr_rmsnorm_layer norm;
} net;

static dtr_result net_init(net *n, const bench_model *b) {
    dtr_model *m = n->m;
    dtr_result r = DTR_OK;
    int i;
    char name[32];
    if (b->kind == 0) {
        r = dtr_linear_layer_init(&n->l1, m, "l1", 784, 256, 1, DTR_INIT_TORCH_DEFAULT);
        if (r == DTR_OK) r = dtr_linear_layer_init(&n->l2, m, "l2", 256, 128, 1, DTR_INIT_TORCH_DEFAULT);
        if (r == DTR_OK) r = dtr_linear_layer_init(&n->l3, m, "l3", 128, 10, 1, DTR_INIT_TORCH_DEFAULT);
        return r;
    }
    if (b->kind == 1) {
        r = dtr_conv2d_layer_init(&n->c1, m, "c1", 1, 16, 3, 1, 1, DTR_INIT_TORCH_DEFAULT);
        if (r == DTR_OK) r = dtr_conv2d_layer_init(&n->c2, m, "c2", 16, 32, 3, 1, 1, DTR_INIT_TORCH_DEFAULT);
        if (r == DTR_OK) r = dtr_linear_layer_init(&n->l1, m, "fc", 32 * 7 * 7, 10, 1, DTR_INIT_TORCH_DEFAULT);
        return r;
    }
    r = dtr_embedding_layer_init(&n->wte, m, "wte", b->vocab, b->dim);
    for (i = 0; r == DTR_OK && b->kind == 3 && i < b->layers; i++) {
        snprintf(name, sizeof name, "layers.%d", i);
        r = dtr_llama_block_init(&n->lh[i], m, name, b->dim, (int)b->heads, (int)b->kv_heads, b->hidden);
        n->lh[i].attention_dropout = g_dropout;
    }
    if (b->kind == 3) {
        if (r == DTR_OK) r = dtr_rmsnorm_layer_init(&n->norm, m, "norm", b->dim);
        return r == DTR_OK ? dtr_linear_layer_init(&n->head, m, "head", b->dim, b->vocab, 0, DTR_INIT_TORCH_DEFAULT) : r;
    }
    if (r == DTR_OK) r = dtr_embedding_layer_init(&n->wpe, m, "wpe", b->context, b->dim);
    for (i = 0; r == DTR_OK && i < b->layers; i++) {
        snprintf(name, sizeof name, "h.%d", i);
        r = dtr_gpt_block_init(&n->h[i], m, name, b->dim, (int)b->heads);
        n->h[i].dropout = g_dropout;
    }
    if (r == DTR_OK) r = dtr_layernorm_layer_init(&n->ln_f, m, "ln_f", b->dim);
    if (r == DTR_OK) r = dtr_linear_layer_init(&n->head, m, "head", b->dim, b->vocab, 0, DTR_INIT_TORCH_DEFAULT);
    return r;
}

/* One batch of random data on the device: x (floats for mlp/cnn) or ids and pos (token ids
 * for the GPTs), and the targets y. */
typedef struct batch {
    dtr_tensor *x, *ids, *pos, *y;
} batch;

static batch batch_from(dtr_context *ctx, const bench_model *b, const float *x, const int32_t *ids, const int32_t *pos,
                        const int32_t *y) {
    int64_t B = b->batch, T = b->context;
    int64_t xs[4] = {B, 784, 0, 0}, cs[4] = {B, 1, 28, 28}, is[2] = {B, T}, ys[1] = {is_lm(b) ? B * T : B};
    batch t = {NULL, NULL, NULL, NULL};
    if (!is_lm(b)) t.x = b->kind == 0 ? dtr_tensor_from(ctx, DTR_F32, 2, xs, x) : dtr_tensor_from(ctx, DTR_F32, 4, cs, x);
    if (is_lm(b)) t.ids = dtr_tensor_from(ctx, DTR_I32, 2, is, ids);
    if (b->kind == 2) t.pos = dtr_tensor_from(ctx, DTR_I32, 2, is, pos);
    t.y = dtr_tensor_from(ctx, DTR_I32, 1, ys, y);
    return t;
}

/* The loss of one batch. */
static dtr_tensor *net_loss(dtr_context *ctx, const net *n, const bench_model *b, const batch *t) {
    int64_t B = b->batch, T = b->context;
    if (b->kind == 0) {
        dtr_tensor *h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->l1, t->x));
        h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->l2, h));
        return dtr_cross_entropy(ctx, dtr_linear_layer_forward(ctx, &n->l3, h), t->y);
    }
    if (b->kind == 1) {
        int64_t fs[2] = {B, 32 * 7 * 7};
        dtr_tensor *h = dtr_maxpool2d(ctx, dtr_relu(ctx, dtr_conv2d_layer_forward(ctx, &n->c1, t->x)), 2, 2, 0);
        h = dtr_maxpool2d(ctx, dtr_relu(ctx, dtr_conv2d_layer_forward(ctx, &n->c2, h)), 2, 2, 0);
        return dtr_cross_entropy(ctx, dtr_linear_layer_forward(ctx, &n->l1, dtr_reshape(ctx, h, 2, fs)), t->y);
    }
    {
        int64_t ls[2] = {B * T, b->vocab};
        dtr_tensor *h = dtr_embedding_layer_forward(ctx, &n->wte, t->ids);
        int i;
        if (b->kind == 2) h = dtr_add(ctx, h, dtr_embedding_layer_forward(ctx, &n->wpe, t->pos));
        for (i = 0; i < b->layers; i++) h = b->kind == 3 ? dtr_llama_block_forward(ctx, &n->lh[i], h) : dtr_gpt_block_forward(ctx, &n->h[i], h);
        h = b->kind == 3 ? dtr_rmsnorm_layer_forward(ctx, &n->norm, h) : dtr_layernorm_layer_forward(ctx, &n->ln_f, h);
        return dtr_cross_entropy(ctx, dtr_reshape(ctx, dtr_linear_layer_forward(ctx, &n->head, h), 2, ls), t->y);
    }
}

/* --graph: the captured step (forward, backward) on inputs made once */
typedef struct captured {
    const net *n;
    const bench_model *b;
    batch in;
    dtr_tensor *loss;
} captured;

static dtr_result captured_step(dtr_context *ctx, void *user) {
    captured *c = (captured *)user;
    c->loss = net_loss(ctx, c->n, c->b, &c->in);
    return c->loss ? dtr_backward(ctx, c->loss) : dtr_context_status(ctx);
}

static const char *g_trace;   /* --trace PREFIX: a Perfetto timeline per model, PREFIX.<model>.json */
static int g_tf32;            /* --tf32: dtr_context_config.allow_tf32 */
static int g_bf16;            /* --bf16: dtr_context_config.matmul_precision DTR_MATMUL_BF16 */
static int g_retain;          /* --retain-grads: dtr_context_config.retain_grads (every intermediate's gradient kept) */
static int g_release;         /* --release-activations: dtr_context_config.release_activations */
static int g_graph;           /* --graph: forward and backward captured once (dtr_graph), then launched */
static int g_bf16_act;        /* --bf16-act: dtr_context_config.activation_dtype DTR_BF16 */
static int g_lora;            /* --lora R: LoRA adapters of rank R (alpha 2R) on the attention's input projections
                                 (GPT: qkv; Llama: q and v, PEFT's defaults), everything else frozen */

/* --lora: the adapters (before the build), then everything but them frozen (after it) */
static dtr_result net_lora(net *n, const bench_model *b, int built) {
    const char *ad[1] = {"*lora_"};
    dtr_result r = DTR_OK;
    int i;
    if (built) {
        r = dtr_model_set_trainable(n->m, NULL, 0, 0);
        return r == DTR_OK ? dtr_model_set_trainable(n->m, ad, 1, 1) : r;
    }
    for (i = 0; r == DTR_OK && i < b->layers; i++) {
        if (b->kind == 2) r = dtr_linear_layer_add_lora(&n->h[i].attn.qkv, n->m, g_lora, 2.0f * (float)g_lora);
        if (b->kind == 3) r = dtr_linear_layer_add_lora(&n->lh[i].q, n->m, g_lora, 2.0f * (float)g_lora);
        if (b->kind == 3 && r == DTR_OK) r = dtr_linear_layer_add_lora(&n->lh[i].v, n->m, g_lora, 2.0f * (float)g_lora);
    }
    return r;
}

static int run_model(const bench_model *b, const dtr_backend *backend, const char *bname, int steps, int warmup,
                     double peak_tflops, int threads) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 1e-4f);
    dtr_context *ctx = NULL;
    dtr_optimizer *opt = NULL;
    dtr_metrics *met = NULL;
    dtr_graph *graph = NULL;
    captured cap;
    dtr_rng rng;
    net n;
    int64_t nx = is_lm(b) ? 0 : b->batch * 784, nt = is_lm(b) ? b->batch * b->context : b->batch, i;
    float *x = (float *)calloc((size_t)(nx ? nx : 1), sizeof(float));
    int32_t *ids = (int32_t *)calloc((size_t)nt, sizeof(int32_t)), *pos = (int32_t *)calloc((size_t)nt, sizeof(int32_t));
    int32_t *y = (int32_t *)calloc((size_t)nt, sizeof(int32_t));
    double t0 = 0, dt, best = 1e30, params, flops_per_item = 0;
    size_t peak_bytes = 0;   /* the CUDA allocator's high-water mark (params, grads, optimizer, arena) */
    int s, ok = 1;
    memset(&n, 0, sizeof n);
    memset(&cap, 0, sizeof cap);
    cc.backend = backend;
    cc.threads = threads;
    cc.seed = 1;
    cc.allow_tf32 = g_tf32;
    cc.matmul_precision = g_bf16 ? DTR_MATMUL_BF16 : DTR_MATMUL_F32;
    cc.activation_dtype = g_bf16_act ? DTR_BF16 : DTR_F32;
    cc.retain_grads = g_retain;
    cc.release_activations = g_release;
    dtr_rng_seed(&rng, 7, 1);
    for (i = 0; i < nx; i++) x[i] = dtr_rng_uniform(&rng);
    for (i = 0; i < nt; i++) {
        ids[i] = (int32_t)(dtr_rng_u32(&rng) % (uint32_t)(is_lm(b) ? b->vocab : 10));
        y[i] = (int32_t)(dtr_rng_u32(&rng) % (uint32_t)b->vocab);
        pos[i] = (int32_t)(b->kind == 2 ? i % b->context : 0);
    }
    if (dtr_context_create(&cc, &ctx) != DTR_OK || dtr_model_create(ctx, 1, &n.m) != DTR_OK || net_init(&n, b) != DTR_OK ||
        (g_lora && is_lm(b) && net_lora(&n, b, 0) != DTR_OK) || dtr_model_build(n.m) != DTR_OK ||
        (g_lora && is_lm(b) && net_lora(&n, b, 1) != DTR_OK) || dtr_optimizer_create(n.m, &oc, &opt) != DTR_OK) {
        printf("{\"bench\":\"gpu\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"model\":\"%s\",\"error\":\"%s\"}\n", bname, b->name,
               ctx ? dtr_context_last_error(ctx) : "context");
        ok = 0;
    }
    if (ok && g_trace) {   /* op spans; with CUDA_LAUNCH_BLOCKING=1 they are the kernels' times */
        dtr_metrics_config mc = dtr_metrics_config_init();
        char path[512];
        snprintf(path, sizeof path, "%s.%s.json", g_trace, b->name);
        mc.trace_path = path;
        ok = dtr_metrics_create(ctx, &mc, &met) == DTR_OK;
    }
    if (ok && g_graph) {   /* the inputs stay (written before each launch in a real loop) */
        cap.n = &n;
        cap.b = b;
        cap.in = batch_from(ctx, b, x, ids, pos, y);
    }
    for (s = 0; ok && s < warmup + steps; s++) {
        dtr_tensor *loss = NULL;
        dtr_result r;
        float lv = 0.0f;
        double ts = now_s();
        if (s == warmup) t0 = ts;
        if (g_graph) {
            r = graph ? dtr_graph_launch(graph) : dtr_graph_capture(ctx, captured_step, &cap, &graph);
            loss = cap.loss;
        } else {
            batch in = batch_from(ctx, b, x, ids, pos, y);
            loss = net_loss(ctx, &n, b, &in);
            r = loss ? dtr_backward(ctx, loss) : dtr_context_status(ctx);
        }
        if (r != DTR_OK || dtr_optimizer_step(opt, NULL) != DTR_OK || dtr_tensor_read(loss, DTR_F32, &lv, 1) != DTR_OK) {
            printf("{\"bench\":\"gpu\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"model\":\"%s\",\"error\":\"%s\"}\n", bname,
                   b->name, dtr_context_last_error(ctx));
            ok = 0;
            break;
        }
        if (!g_graph) dtr_context_reset(ctx);
        dt = now_s() - ts;
        if (s >= warmup && dt < best) best = dt;
    }
    if (ok && backend) dtr_cuda_memory(ctx, NULL, &peak_bytes, NULL, 0);
    if (ok) {
        double total = now_s() - t0, per = total / steps, items = (double)nt;
        params = (double)dtr_model_numel(n.m);
        if (is_lm(b)) flops_per_item = 6.0 * params + 12.0 * (double)(b->layers * b->context * b->dim);
        printf("{\"bench\":\"gpu\",\"impl\":\"dtrain\",\"backend\":\"%s\",\"model\":\"%s\",\"params\":%.0f,\"batch\":%lld,"
               "\"tf32\":%d,\"bf16\":%d,\"bf16_act\":%d,\"graph\":%d,\"retain_grads\":%d,\"release_activations\":%d,\"step_ms\":%.3f,\"best_step_ms\":%.3f,\"%s_per_s\":%.1f,\"mfu\":%.4f,"
               "\"peak_mem_mb\":%.1f,\"arena_peak_mb\":%.1f,\"lora\":%d,\"dropout\":%.2f,\"optimizer_state_mb\":%.2f,\"cuda_vmm\":%d}\n",
               bname, b->name, params, (long long)b->batch, g_tf32, g_bf16, g_bf16_act, g_graph, g_retain, g_release, per * 1e3, best * 1e3, is_lm(b) ? "tokens" : "samples",
               items / per, flops_per_item > 0 && peak_tflops > 0 ? flops_per_item * items / per / (peak_tflops * 1e12) : 0.0,
               (double)peak_bytes / 1048576.0, (double)dtr_context_arena_peak(ctx, 0) / 1048576.0, is_lm(b) ? g_lora : 0, is_lm(b) ? (double)g_dropout : 0.0,
               (double)dtr_optimizer_state_bytes(opt) / 1048576.0, backend && !(getenv("DTR_CUDA_VMM") && !strcmp(getenv("DTR_CUDA_VMM"), "0")));
    }
    dtr_metrics_destroy(met);
    dtr_graph_destroy(graph);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(n.m);
    dtr_context_destroy(ctx);
    free(x);
    free(ids);
    free(pos);
    free(y);
    return ok;
}

int main(int argc, char **argv) {
    const char *backend = "cuda", *model = "all";
    int steps = 20, warmup = 3, threads = 0, i, ok = 1;
    double peak = 0.0;
    const dtr_backend *be = NULL;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
        else if (!strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--peak-tflops") && i + 1 < argc) peak = atof(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--trace") && i + 1 < argc) g_trace = argv[++i];
        else if (!strcmp(argv[i], "--tf32")) g_tf32 = 1;
        else if (!strcmp(argv[i], "--bf16")) g_bf16 = 1;
        else if (!strcmp(argv[i], "--retain-grads")) g_retain = 1;
        else if (!strcmp(argv[i], "--release-activations")) g_release = 1;
        else if (!strcmp(argv[i], "--graph")) g_graph = 1;
        else if (!strcmp(argv[i], "--bf16-act")) g_bf16_act = 1;
        else if (!strcmp(argv[i], "--lora") && i + 1 < argc) g_lora = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dropout") && i + 1 < argc) g_dropout = (float)atof(argv[++i]);
        else {
            fprintf(stderr, "usage: gpu [--backend cuda|cpu] [--model mlp|cnn|gpt|gpt2|llama|all] [--steps N] [--warmup N] "
                            "[--peak-tflops F] [--threads N] [--trace PREFIX] [--tf32] [--bf16] [--retain-grads] [--release-activations] [--graph] [--bf16-act] [--lora R] [--dropout P]\n");
            return 2;
        }
    }
    if (!strcmp(backend, "cuda")) {
        if (dtr_cuda_device_count() == 0) {
            printf("{\"bench\":\"gpu\",\"impl\":\"dtrain\",\"backend\":\"cuda\",\"skipped\":\"no GPU visible\"}\n");
            return 0;
        }
        be = dtr_cuda_backend();
        if (peak <= 0) peak = 494.7;   /* H100 SXM, dense TF32 tensor cores (a ceiling for FP32 GEMMs) */
    }
    for (i = 0; i < (int)(sizeof MODELS / sizeof MODELS[0]); i++)
        if (!strcmp(model, "all") || !strcmp(model, MODELS[i].name)) ok &= run_model(&MODELS[i], be, backend, steps, warmup, peak, threads);
    return ok ? 0 : 1;
}
