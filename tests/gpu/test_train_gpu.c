/* tests/gpu/test_train_gpu.c: training on the GPU against the CPU (make test-gpu). Every
 * optimizer (SGD with momentum, Adam, AdamW, LAMB, RMSprop with and without momentum,
 * Adagrad; with gradient clipping) takes the same steps on a small MLP on both backends and
 * must leave the same parameters (with bf16 activations: the CPU's bf16 run's, within 1e-2
 * on a GPU); the loss scaler
 * must skip, and report, a step whose gradients overflowed on the GPU, leaving the weights
 * alone
 * alone; weights saved from the GPU must load into a CPU model unchanged; a full-state
 * checkpoint of a GPU run must restore it bit for bit; two ranks sharing
 * the GPU, training data-parallel over the local transport (host memory: the gradients go
 * through the engine's host staging buffer), must end where one rank with the whole batch
 * does, with each bucket's copy to the host beside the stream; the model's buffers copy to and
 * from the host, FedProx on the device gives the CPU's gradients and a parameter server on the
 * device is refused; the loader's batches reach the device without a host wait and hold what
 * a plain loader hands out; dtr_model_lerp on the device gives the CPU's bits; a tiny GPT in bf16 (the fused attention kernels) and a Llama
 * block in f32 (grouped-query fused attention, RoPE, RMS norm, SwiGLU) train on the device as
 * on the CPU; a batch-norm layer's steps, running statistics and evaluation match the CPU's;
 * and both generate through a KV cache on the device with the CPU's logits. The
 * device runs release activations during backward
 * (release_activations), the CPU reference keeps them: the same parameters either way.
 * Without a GPU it says loudly that it skipped. */
#define _DEFAULT_SOURCE   /* mkstemp, MAP_ANONYMOUS (tests/devsim.h) */
#define DTRAIN_INTERNAL_API
#include <pthread.h>
#include <unistd.h>
#include "../test.h"
#ifdef TRAIN_DEVSIM   /* tests/test_devsim.c: the same checks on the simulated device, in make test */
#include "../devsim.h"
#define DEVICE_BACKEND() devsim_backend()
#define DEVICE_COUNT() 1
#else
#define DEVICE_BACKEND() dtr_cuda_backend()
#define DEVICE_COUNT() dtr_cuda_device_count()
#endif

#define IN 12
#define HID 16
#define OUT 4
#define ROWS 32
#define STEPS 4

typedef struct tnet { dtr_model *m; dtr_linear_layer l1, l2; } tnet;

static dtr_dtype g_act = DTR_F32;   /* the contexts' activation_dtype */
static dtr_matmul_precision g_products = DTR_MATMUL_F32;   /* the device context's matmul_precision */

static dtr_context *make_ctx(int gpu) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    cc.backend = gpu ? DEVICE_BACKEND() : NULL;
    cc.activation_dtype = g_act;
    cc.matmul_precision = gpu ? g_products : DTR_MATMUL_F32;
    cc.release_activations = gpu;   /* blocks reused within the step, in stream order */
    cc.threads = 1;
    cc.seed = 5;
    return dtr_context_create(&cc, &ctx) == DTR_OK ? ctx : NULL;
}

static int net_make(dtr_context *ctx, tnet *n) {
    return dtr_model_create(ctx, 3, &n->m) == DTR_OK &&
           dtr_linear_layer_init(&n->l1, n->m, "l1", IN, HID, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
           dtr_linear_layer_init(&n->l2, n->m, "l2", HID, OUT, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK && dtr_model_build(n->m) == DTR_OK;
}

/* the mean cross-entropy of rows [r0, r0 + rows) of the batch, scaled by `scale` */
static dtr_tensor *net_loss_rows(dtr_context *ctx, tnet *n, float scale, int64_t r0, int64_t rows) {
    float x[ROWS * IN];
    int32_t y[ROWS];
    int64_t xs[2] = {rows, IN}, i;
    dtr_rng rng;
    dtr_tensor *h, *loss;
    dtr_rng_seed(&rng, 17, 2);
    for (i = 0; i < ROWS * IN; i++) x[i] = 2.0f * dtr_rng_uniform(&rng) - 1.0f;
    for (i = 0; i < ROWS; i++) y[i] = (int32_t)(dtr_rng_u32(&rng) % OUT);
    h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->l1, dtr_tensor_from(ctx, DTR_F32, 2, xs, x + r0 * IN)));
    loss = dtr_cross_entropy(ctx, dtr_linear_layer_forward(ctx, &n->l2, h), dtr_tensor_from(ctx, DTR_I32, 1, &rows, y + r0));
    return scale == 1.0f ? loss : dtr_scale(ctx, loss, scale);
}

static dtr_tensor *net_loss(dtr_context *ctx, tnet *n, float scale) { return net_loss_rows(ctx, n, scale, 0, ROWS); }

/* every parameter of the model, concatenated, into out (dtr_model_numel floats) */
static int net_read(tnet *n, float *out) {
    int i;
    int64_t at = 0;
    for (i = 0; i < dtr_model_param_count(n->m); i++) {
        dtr_tensor *p = dtr_model_param_at(n->m, i);
        int64_t k = dtr_tensor_numel(p);
        if (dtr_tensor_read(p, DTR_F32, out + at, (size_t)k) != DTR_OK) return 0;
        at += k;
    }
    return 1;
}

/* STEPS steps of cfg on a fresh model; the parameters after them into out */
static int train(int gpu, const dtr_optimizer_config *oc, float *out, float *last_loss) {
    dtr_context *ctx = make_ctx(gpu);
    dtr_optimizer *opt = NULL;
    tnet n;
    int s, ok;
    memset(&n, 0, sizeof n);
    ok = ctx && net_make(ctx, &n) && dtr_optimizer_create(n.m, oc, &opt) == DTR_OK;
    for (s = 0; ok && s < STEPS; s++) {
        dtr_tensor *loss = net_loss(ctx, &n, 1.0f);
        ok = loss && dtr_backward(ctx, loss) == DTR_OK && dtr_optimizer_step(opt, NULL) == DTR_OK;
        if (ok) *last_loss = dtr_tensor_get(loss, 0);
        dtr_context_reset(ctx);
    }
    ok = ok && net_read(&n, out);
    if (!ok && ctx) fprintf(stderr, "  (%s: %s)\n", gpu ? "cuda" : "cpu", dtr_context_last_error(ctx));
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(n.m);
    dtr_context_destroy(ctx);
    return ok;
}

static double max_rel(const float *a, const float *b, int64_t n) {
    double worst = 0.0;
    int64_t i;
    for (i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]) / (1.0 + fabs((double)a[i]));
        if (d > worst || d != d) worst = d != d ? 1e30 : d;
    }
    return worst;
}

static void test_optimizers(void) {
    static const dtr_optimizer_kind kinds[7] = {DTR_OPT_SGD, DTR_OPT_ADAM, DTR_OPT_ADAMW, DTR_OPT_LAMB, DTR_OPT_RMSPROP, DTR_OPT_RMSPROP,
                                                DTR_OPT_ADAGRAD};
    static const char *names[7] = {"sgd", "adam", "adamw", "lamb", "rmsprop", "rmsprop with momentum", "adagrad"};
    int64_t n = (int64_t)(IN * HID + HID + HID * OUT + OUT);
    float *a = (float *)malloc((size_t)n * sizeof(float)), *b = (float *)malloc((size_t)n * sizeof(float)), la = 0, lb = 0;
    int k, clip;
    for (k = 0; k < 7; k++)
        for (clip = 0; clip < 2; clip++) {
            dtr_optimizer_config oc = dtr_optimizer_config_init(kinds[k], kinds[k] == DTR_OPT_SGD ? 0.1f : 0.01f);
            oc.momentum = kinds[k] == DTR_OPT_SGD || k == 5 ? 0.9f : 0.0f;
            oc.weight_decay = 0.01f;
            oc.clip_norm = clip ? 0.05f : 0.0f;   /* small: the clip acts */
            CHECK_MSG(train(0, &oc, a, &la) && train(1, &oc, b, &lb), "%s clip %d did not run", names[k], clip);
            CHECK_MSG(max_rel(a, b, n) < 1e-5, "%s clip %d: GPU parameters differ from the CPU's by %.3g", names[k], clip,
                      max_rel(a, b, n));
            CHECK_MSG(fabsf(la - lb) < 1e-5f, "%s: last loss %g on the CPU, %g on the GPU", names[k], la, lb);
        }
    free(a);
    free(b);
}

/* bf16 activations: AdamW steps on the device end where the CPU's bf16 run does (the same
   arithmetic, rounded at the same places; a rounding may flip on the GPU, whose f32 kernels sum
   in another order), and not where f32 ends (the rounding happened). */
static void test_narrow_activations(void) {
    int64_t n = (int64_t)(IN * HID + HID + HID * OUT + OUT);
    float *a = (float *)malloc((size_t)n * sizeof(float)), *b = (float *)malloc((size_t)n * sizeof(float));
    float *f = (float *)malloc((size_t)n * sizeof(float)), la = 0, lb = 0, lf = 0;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.01f);
#ifdef TRAIN_DEVSIM
    const double tol = 1e-6;
#else
    const double tol = 1e-2;
#endif
    CHECK(train(0, &oc, f, &lf));
    g_act = DTR_BF16;
    CHECK_MSG(train(0, &oc, a, &la) && train(1, &oc, b, &lb), "bf16 activations did not run");
    g_act = DTR_F32;
    CHECK_MSG(max_rel(a, b, n) <= tol, "bf16 activations: device parameters differ from the CPU's by %.3g", max_rel(a, b, n));
    CHECK_MSG(fabsf(la - lb) <= 1e-2f * fabsf(la), "bf16 activations: last loss %g on the CPU, %g on the device", la, lb);
    CHECK_MSG(max_rel(a, f, n) > 0.0 && fabsf(la - lf) < 2e-2f * fabsf(lf), "bf16 against f32: parameters %.3g apart, loss %g / %g",
              max_rel(a, f, n), la, lf);
#ifndef TRAIN_DEVSIM
    /* bf16 products on the bf16 activations (the linear layers' operands as stored, their
       weights and output gradients rounded to bf16, f32 sums): near the CPU's bf16 run */
    g_act = DTR_BF16;
    g_products = DTR_MATMUL_BF16;
    CHECK_MSG(train(1, &oc, b, &lb), "bf16 products on bf16 activations did not run");
    g_act = DTR_F32;
    g_products = DTR_MATMUL_F32;
    CHECK_MSG(max_rel(a, b, n) <= 3e-2, "bf16 products: device parameters differ from the CPU's bf16 run by %.3g", max_rel(a, b, n));
    CHECK_MSG(fabsf(la - lb) <= 2e-2f * fabsf(la), "bf16 products: last loss %g on the CPU, %g on the device", la, lb);
#endif
    free(a);
    free(b);
    free(f);
}

#ifndef TRAIN_DEVSIM
/* A tiny GPT (embedding, one block of 2 heads of 64, layer norm, head) in bf16 activations:
   SGD steps on the device with bf16 products (linear layers on operands as stored, the fused
   attention kernels: head width 64, 70 rows, a partial second block) end near the CPU's bf16
   run (f32 products): the model's layers composed on the device, within 5 times what the
   products' rounding gives through cuemu (parameters 2.0e-3 apart, losses 1.9e-4). The ops'
   own cases (tests/test_grad.c) are the sharp checks: at this initialisation attention's q
   and k gradients are small beside the rest (leaving out the fused forward's rescaling moves
   the last loss by 1.1e-3). */
#define GV 32
#define GC 128
#define GT 70
typedef struct tgpt {
    dtr_model *m;
    dtr_embedding_layer emb;
    dtr_gpt_block blk;
    dtr_llama_block lblk;   /* llama: this block (4 heads of 32 over 2 kv heads, RoPE, SwiGLU of 256) instead */
    dtr_layernorm_layer ln;
    dtr_linear_layer head;
} tgpt;

/* the block's layers on g.m, and its output for x */
static int gpt_block_init(tgpt *g, int llama) {
    return llama ? dtr_llama_block_init(&g->lblk, g->m, "blk", GC, 4, 2, 256) == DTR_OK : dtr_gpt_block_init(&g->blk, g->m, "blk", GC, 2) == DTR_OK;
}
static dtr_tensor *gpt_block(dtr_context *ctx, const tgpt *g, int llama, dtr_tensor *x) {
    return llama ? dtr_llama_block_forward(ctx, &g->lblk, x) : dtr_gpt_block_forward(ctx, &g->blk, x);
}

static int gpt_train(int gpu, int llama, float *out, int64_t *n_out, float *last_loss) {
    dtr_context *ctx = make_ctx(gpu);
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.5f);   /* steps in proportion to the gradients */
    dtr_optimizer *opt = NULL;
    int32_t ids[2 * GT], tgt[2 * GT];
    int64_t is[2] = {2, GT}, ts = 2 * GT, i;
    int s, ok, at = 0;
    tgpt g;
    memset(&g, 0, sizeof g);
    for (i = 0; i < 2 * GT; i++) ids[i] = (int32_t)((i * 7 + i / 5) % GV), tgt[i] = (int32_t)((i * 7 + 3) % GV);
    ok = ctx && dtr_model_create(ctx, 8, &g.m) == DTR_OK && dtr_embedding_layer_init(&g.emb, g.m, "emb", GV, GC) == DTR_OK &&
         gpt_block_init(&g, llama) && dtr_layernorm_layer_init(&g.ln, g.m, "ln", GC) == DTR_OK &&
         dtr_linear_layer_init(&g.head, g.m, "head", GC, GV, 0, DTR_INIT_TORCH_DEFAULT) == DTR_OK && dtr_model_build(g.m) == DTR_OK &&
         dtr_optimizer_create(g.m, &oc, &opt) == DTR_OK;
    for (s = 0; ok && s < 3; s++) {
        dtr_tensor *x = dtr_embedding_layer_forward(ctx, &g.emb, dtr_tensor_from(ctx, DTR_I32, 2, is, ids));
        dtr_tensor *h = dtr_layernorm_layer_forward(ctx, &g.ln, gpt_block(ctx, &g, llama, x));
        int64_t rows[2] = {2 * GT, GV};
        dtr_tensor *loss = dtr_cross_entropy(ctx, dtr_reshape(ctx, dtr_linear_layer_forward(ctx, &g.head, h), 2, rows),
                                             dtr_tensor_from(ctx, DTR_I32, 1, &ts, tgt));
        ok = loss && dtr_backward(ctx, loss) == DTR_OK && dtr_optimizer_step(opt, NULL) == DTR_OK;
        if (ok) *last_loss = dtr_tensor_get(loss, 0);
        dtr_context_reset(ctx);
    }
    for (i = 0; ok && i < dtr_model_param_count(g.m); i++) {
        dtr_tensor *p = dtr_model_param_at(g.m, (int)i);
        ok = dtr_tensor_read(p, DTR_F32, out + at, (size_t)dtr_tensor_numel(p)) == DTR_OK;
        at += (int)dtr_tensor_numel(p);
    }
    *n_out = at;
    if (!ok && ctx) fprintf(stderr, "  (%s: %s)\n", gpu ? "cuda" : "cpu", dtr_context_last_error(ctx));
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(g.m);
    dtr_context_destroy(ctx);
    return ok;
}

/* The block of `llama` trained on the CPU (cpu_act activations) and on the device (dev_act,
   dev_products): the parameters within tol and the last losses within loss_tol (relative);
   what it found printed after `label` */
static void gpt_compare(int llama, dtr_dtype cpu_act, dtr_dtype dev_act, dtr_matmul_precision dev_products, double tol, float loss_tol,
                        const char *label) {
    size_t cap = (size_t)(GV * GC * 2 + 12 * GC * GC + 16 * GC);
    float *a = (float *)malloc(cap * sizeof(float)), *b = (float *)malloc(cap * sizeof(float)), la = 0, lb = 0;
    int64_t na = 0, nb = 0;
    g_act = cpu_act;
    CHECK_MSG(gpt_train(0, llama, a, &na, &la), "%s on the CPU did not run", label);
    g_act = dev_act, g_products = dev_products;
    CHECK_MSG(gpt_train(1, llama, b, &nb, &lb), "%s on the device did not run", label);
    g_act = DTR_F32, g_products = DTR_MATMUL_F32;
    CHECK_EQ_INT(na, nb);
    CHECK(na > 0 && (size_t)na <= cap);
    CHECK_MSG(max_rel(a, b, na) <= tol, "%s: device parameters differ from the CPU's by %.3g", label, max_rel(a, b, na));
    CHECK_MSG(fabsf(la - lb) <= loss_tol * fabsf(la), "%s: last loss %g on the CPU, %g on the device", label, la, lb);
    printf("  %s, 3 SGD steps: loss %.6f on the CPU, %.6f on the device, parameters %.3g apart\n", label, la, lb, max_rel(a, b, na));
    free(a);
    free(b);
}

static void test_gpt_bf16(void) {
    gpt_compare(0, DTR_BF16, DTR_BF16, DTR_MATMUL_BF16, 1e-2, 1e-3f, "GPT (1 block, 2 heads of 64, 70 rows) in bf16");
}

/* A Llama block (RMS norms, RoPE on q and k, grouped-query attention on the fused f32 kernels:
   head width 32, 70 rows; SwiGLU) in f32: 3 SGD steps on the device end where the CPU's do,
   within the f32 kernels' rounding. */
static void test_llama_block(void) {
    gpt_compare(1, DTR_F32, DTR_F32, DTR_MATMUL_F32, 1e-4, 1e-5f, "Llama block (4 heads of 32 over 2 kv heads, 70 rows) in f32");
}

/* Generation on the device: the block's model (GPT: the fused kernels of head width 64; Llama:
   grouped-query heads of 32, RoPE) fed a prompt of GT positions, then one position a step, through
   a KV cache in device memory gives the CPU's logits of the whole sequence (plain forward pass) at
   every position (f32, 1e-4). out: (2, GN, GV). */
#define GN (GT + 6)
static int gen_logits(int gpu, int llama, int cached, float *out) {
    dtr_context *ctx = make_ctx(gpu);
    dtr_kv_cache *kv = NULL;
    int32_t ids[2 * GN], piece[2 * GN];
    int64_t at, T, b;
    int ok;
    tgpt g;
    memset(&g, 0, sizeof g);
    for (b = 0; b < 2 * GN; b++) ids[b] = (int32_t)((b * 7 + b / 5) % GV);
    ok = ctx && dtr_model_create(ctx, 8, &g.m) == DTR_OK && dtr_embedding_layer_init(&g.emb, g.m, "emb", GV, GC) == DTR_OK &&
         gpt_block_init(&g, llama) && dtr_layernorm_layer_init(&g.ln, g.m, "ln", GC) == DTR_OK &&
         dtr_linear_layer_init(&g.head, g.m, "head", GC, GV, 0, DTR_INIT_TORCH_DEFAULT) == DTR_OK && dtr_model_build(g.m) == DTR_OK &&
         dtr_kv_cache_create(ctx, 1, 2, GN + 2, llama ? GC / 2 : GC, &kv) == DTR_OK;
    dtr_context_set_grad_enabled(ctx, 0);
    for (at = 0; ok && at < GN; at += T) {
        float part[2 * GT * GV];
        dtr_tensor *x, *h;
        int64_t is[2];
        T = !cached ? GN : at ? 1 : GT;
        is[0] = 2, is[1] = T;
        for (b = 0; b < 2; b++) memcpy(piece + b * T, ids + b * GN + at, (size_t)T * sizeof(int32_t));
        x = dtr_embedding_layer_forward(ctx, &g.emb, dtr_tensor_from(ctx, DTR_I32, 2, is, cached ? piece : ids));
        h = llama ? dtr_llama_block_forward_cached(ctx, &g.lblk, x, cached ? kv : NULL, 0)
                  : dtr_gpt_block_forward_cached(ctx, &g.blk, x, cached ? kv : NULL, 0);
        h = dtr_linear_layer_forward(ctx, &g.head, dtr_layernorm_layer_forward(ctx, &g.ln, h));
        ok = !cached ? dtr_tensor_read(h, DTR_F32, out, (size_t)(2 * GN * GV)) == DTR_OK
                     : dtr_tensor_read(h, DTR_F32, part, (size_t)(2 * T * GV)) == DTR_OK;
        for (b = 0; ok && cached && b < 2; b++) memcpy(out + (b * GN + at) * GV, part + b * T * GV, (size_t)(T * GV) * sizeof(float));
        dtr_context_reset(ctx);
    }
    if (!ok && ctx) fprintf(stderr, "  (%s: %s)\n", gpu ? "cuda" : "cpu", dtr_context_last_error(ctx));
    dtr_kv_cache_destroy(kv);
    dtr_model_destroy(g.m);
    dtr_context_destroy(ctx);
    return ok;
}

static void test_generate(void) {
    static float whole[2 * GN * GV], dev[2 * GN * GV];
    int llama;
    for (llama = 0; llama < 2; llama++) {
        CHECK(gen_logits(0, llama, 0, whole) && gen_logits(1, llama, 1, dev));
        CHECK_MSG(max_rel(whole, dev, 2 * GN * GV) <= 1e-4, "%s: cached device logits differ from the CPU's by %.3g",
                  llama ? "Llama" : "GPT", max_rel(whole, dev, 2 * GN * GV));
        printf("  %s, a prompt of %d then 6 cached steps on the device: logits %.3g from the CPU's whole sequence\n",
               llama ? "Llama" : "GPT", GT, max_rel(whole, dev, 2 * GN * GV));
    }
}
#endif

/* A loss scaled past f32's range: inf gradients on the GPU; the step is skipped, reported,
   the weights untouched and the scale backed off; then a finite step goes through. */
static void test_loss_scaler_overflow(void) {
    dtr_context *ctx = make_ctx(1);
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.01f);
    dtr_loss_scaler_config lc = dtr_loss_scaler_config_init();
    dtr_loss_scaler *ls = NULL;
    dtr_optimizer *opt = NULL;
    int64_t n = (int64_t)(IN * HID + HID + HID * OUT + OUT);
    float *before = (float *)malloc((size_t)n * sizeof(float)), *after = (float *)malloc((size_t)n * sizeof(float));
    tnet net;
    int stepped = -1;
    memset(&net, 0, sizeof net);
    lc.init_scale = 1024.0f;
    CHECK(ctx && net_make(ctx, &net) && dtr_optimizer_create(net.m, &oc, &opt) == DTR_OK);
    CHECK(dtr_loss_scaler_create(&lc, &ls) == DTR_OK);
    if (ctx && opt && ls && net_read(&net, before)) {
        CHECK_OK(ctx, dtr_backward(ctx, dtr_loss_scaler_scale(ls, ctx, net_loss(ctx, &net, 1e37f))));
        CHECK_OK(ctx, dtr_loss_scaler_step(ls, net.m, opt, &stepped));
        CHECK_EQ_INT(stepped, 0);
        CHECK_EQ_INT((int)dtr_loss_scaler_skipped(ls), 1);
        CHECK(dtr_loss_scaler_value(ls) == 512.0f);
        CHECK(net_read(&net, after) && memcmp(before, after, (size_t)n * sizeof(float)) == 0);
        dtr_context_reset(ctx);
        CHECK_OK(ctx, dtr_backward(ctx, dtr_loss_scaler_scale(ls, ctx, net_loss(ctx, &net, 1.0f))));
        CHECK_OK(ctx, dtr_loss_scaler_step(ls, net.m, opt, &stepped));
        CHECK_EQ_INT(stepped, 1);
        CHECK(net_read(&net, after) && memcmp(before, after, (size_t)n * sizeof(float)) != 0);
    }
    dtr_loss_scaler_destroy(ls);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(net.m);
    dtr_context_destroy(ctx);
    free(before);
    free(after);
}

/* weights saved from a GPU model load into a CPU model bit for bit */
/* Batch norm on the device as on the CPU: 3 SGD steps of a batch-norm layer (x (4, 3, 5)),
   then the weights, the running statistics (moved by the device's kernel) and the evaluation
   output agree. */
static int bn_run(int gpu, float *out) {   /* out: 2 x 16 parameters, 2 x 16 buffers, 60 outputs */
    dtr_context *ctx = make_ctx(gpu);
    dtr_model *m = NULL;
    dtr_batchnorm_layer bn;
    dtr_optimizer *opt = NULL;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    float x[60], r[60];
    int64_t xs[3] = {4, 3, 5};
    int s, i, ok;
    for (i = 0; i < 60; i++) x[i] = (float)sin(0.37 * i) * (1.0f + (float)(i % 7)), r[i] = (float)cos(0.11 * i);
    ok = ctx && dtr_model_create(ctx, 3, &m) == DTR_OK && dtr_batchnorm_layer_init(&bn, m, "bn", 3) == DTR_OK &&
         dtr_optimizer_create(m, &oc, &opt) == DTR_OK;
    for (s = 0; ok && s < 3; s++) {
        dtr_tensor *y = dtr_batchnorm_layer_forward(ctx, &bn, dtr_tensor_from(ctx, DTR_F32, 3, xs, x));
        ok = dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, y, dtr_tensor_from(ctx, DTR_F32, 3, xs, r)))) == DTR_OK &&
             dtr_optimizer_step(opt, NULL) == DTR_OK;
        for (i = 0; i < 60; i++) x[i] = x[i] * 0.9f + 0.1f;
        dtr_context_reset(ctx);
    }
    dtr_context_set_training(ctx, 0);
    ok = ok && dtr_model_read(m, out, 32) == DTR_OK && dtr_model_read_buffers(m, out + 32, 32) == DTR_OK &&
         dtr_tensor_read(dtr_batchnorm_layer_forward(ctx, &bn, dtr_tensor_from(ctx, DTR_F32, 3, xs, x)), DTR_F32, out + 64, 60) ==
             DTR_OK;
    if (!ok && ctx) fprintf(stderr, "  (%s: %s)\n", gpu ? "device" : "cpu", dtr_context_last_error(ctx));
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    return ok;
}

static void test_batch_norm(void) {
    float cpu[124], dev[124];
    int ok = bn_run(0, cpu) && bn_run(1, dev);
    CHECK(ok);
    if (!ok) return;
    printf("    batch norm, device against the CPU: weights %.2g, running statistics %.2g, evaluation %.2g\n",
           max_rel(cpu, dev, 32), max_rel(cpu + 32, dev + 32, 32), max_rel(cpu + 64, dev + 64, 60));
    CHECK(max_rel(cpu, dev, 124) < 1e-5);
    CHECK(cpu[32] != 0.0f && cpu[48] != 1.0f);   /* the running statistics moved */
}

/* a model (on the device: tgpu 1) moved 30% toward another of other weights (dtr_model_lerp,
   a soft target update) on the same context, or on a context of its own (two: 1; sgpu its
   kind: a GPU model's average kept on the CPU, and the reverse) */
static int lerp_run(int tgpu, int sgpu, int two, float *out) {
    dtr_context *ctx = make_ctx(tgpu), *sctx = two ? make_ctx(sgpu) : ctx;
    tnet a, b;
    int ok;
    memset(&a, 0, sizeof a), memset(&b, 0, sizeof b);
    ok = ctx && sctx && net_make(ctx, &a) && dtr_model_create(sctx, 99, &b.m) == DTR_OK &&
         dtr_linear_layer_init(&b.l1, b.m, "l1", IN, HID, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
         dtr_linear_layer_init(&b.l2, b.m, "l2", HID, OUT, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK;
    ok = ok && dtr_model_lerp(a.m, b.m, 0.3f) == DTR_OK && net_read(&a, out);
    if (!ok && ctx) fprintf(stderr, "  (%s: %s)\n", tgpu ? "device" : "cpu", dtr_context_last_error(ctx));
    dtr_model_destroy(a.m);
    dtr_model_destroy(b.m);
    if (sctx != ctx) dtr_context_destroy(sctx);
    dtr_context_destroy(ctx);
    return ok;
}

static void test_model_lerp(void) {
    enum { N = IN * HID + HID + HID * OUT + OUT };
    float cpu[N], dev[N];
    int t, s;
    CHECK(lerp_run(0, 0, 0, cpu) && lerp_run(1, 1, 0, dev));
    CHECK(memcmp(cpu, dev, sizeof cpu) == 0);   /* a product and a sum per element: the same bits */
    for (t = 0; t < 2; t++)   /* across two contexts: host to device, device to host, device to device */
        for (s = 0; s < 2; s++) {
            memset(dev, 0, sizeof dev);
            CHECK_MSG(lerp_run(t, s, 1, dev) && memcmp(cpu, dev, sizeof cpu) == 0, "target on the %s, source on another %s context",
                      t ? "device" : "CPU", s ? "device" : "CPU");
        }
}

static void test_save_load(void) {
    dtr_context *g = make_ctx(1), *c = make_ctx(0);
    tnet a, b;
    int64_t n = (int64_t)(IN * HID + HID + HID * OUT + OUT);
    float *pa = (float *)malloc((size_t)n * sizeof(float)), *pb = (float *)malloc((size_t)n * sizeof(float));
    char path[] = "/tmp/dtr_gpu_saveXXXXXX";
    int fd = mkstemp(path);
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    CHECK(fd >= 0 && g && c && net_make(g, &a));
    if (fd >= 0) close(fd);
    CHECK(c && dtr_model_create(c, 99, &b.m) == DTR_OK);   /* another seed: other weights until loaded */
    CHECK(dtr_linear_layer_init(&b.l1, b.m, "l1", IN, HID, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
          dtr_linear_layer_init(&b.l2, b.m, "l2", HID, OUT, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK && dtr_model_build(b.m) == DTR_OK);
    CHECK_OK(g, dtr_model_save(a.m, path, DTR_F32));
    CHECK_OK(c, dtr_model_load(b.m, path));
    CHECK(net_read(&a, pa) && net_read(&b, pb) && memcmp(pa, pb, (size_t)n * sizeof(float)) == 0);
    unlink(path);
    dtr_model_destroy(a.m);
    dtr_model_destroy(b.m);
    dtr_context_destroy(g);
    dtr_context_destroy(c);
    free(pa);
    free(pb);
}

/* A full-state checkpoint of a device model: 3 AdamW steps, a checkpoint, 2 more steps, a
   restore; the weights and the next step are those of the checkpoint's moment, bit for bit
   (the checkpointer copies device entries through the backend). */
static void test_checkpoint(void) {
    dtr_context *ctx = make_ctx(1);
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.01f);
    dtr_ckpt_config kc = dtr_ckpt_config_init();
    dtr_optimizer *opt = NULL;
    dtr_ckpt *ck = NULL;
    int64_t n = (int64_t)(IN * HID + HID + HID * OUT + OUT), step = -1;
    float *at3 = (float *)malloc((size_t)n * sizeof(float)), *now = (float *)malloc((size_t)n * sizeof(float));
    float first[2] = {0, 0}, again[2] = {-1, -1};   /* the losses of steps 4 and 5, first time and resumed */
    char dir[] = "/tmp/dtr_gpu_ckptXXXXXX", path[512];
    tnet net;
    int s, ok;
    memset(&net, 0, sizeof net);
    ok = mkdtemp(dir) != NULL && ctx && net_make(ctx, &net) && dtr_optimizer_create(net.m, &oc, &opt) == DTR_OK;
    kc.dir = dir, kc.ctx = ctx, kc.model = net.m, kc.optimizer = opt, kc.sync = 1;
    ok = ok && dtr_ckpt_create(&kc, &ck) == DTR_OK;
    for (s = 0; ok && s < 5; s++) {
        dtr_tensor *loss = net_loss(ctx, &net, 1.0f);
        ok = loss && dtr_backward(ctx, loss) == DTR_OK && dtr_optimizer_step(opt, NULL) == DTR_OK;
        if (ok && s >= 3) first[s - 3] = dtr_tensor_get(loss, 0);
        dtr_context_reset(ctx);
        if (ok && s == 2) ok = net_read(&net, at3) && dtr_ckpt_save(ck, 3, NULL) == DTR_OK && dtr_ckpt_wait(ck) == DTR_OK;
    }
    CHECK_MSG(ok, "training or saving failed: %s | %s", ctx ? dtr_context_last_error(ctx) : "", ck ? dtr_ckpt_last_error(ck) : "");
    CHECK(ok && dtr_ckpt_latest(dir, &step, path, sizeof path) == DTR_OK && step == 3);
    CHECK_MSG(ok && dtr_ckpt_restore(ck, NULL, &step) == DTR_OK, "restore: %s", ck ? dtr_ckpt_last_error(ck) : "");
    CHECK(net_read(&net, now) && memcmp(now, at3, (size_t)n * sizeof(float)) == 0);
    for (s = 0; ok && s < 2; s++) {   /* steps 4 and 5 again: the same losses (the optimizer's moments came back too) */
        dtr_tensor *loss = net_loss(ctx, &net, 1.0f);
        CHECK(loss && dtr_backward(ctx, loss) == DTR_OK && dtr_optimizer_step(opt, NULL) == DTR_OK);
        if (loss) again[s] = dtr_tensor_get(loss, 0);
        dtr_context_reset(ctx);
    }
    CHECK_MSG(first[0] == again[0] && first[1] == again[1], "resumed losses %g %g, first time %g %g", again[0], again[1],
              first[0], first[1]);
    dtr_ckpt_destroy(ck);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(net.m);
    dtr_context_destroy(ctx);
    free(at3);
    free(now);
    {   /* the checkpoint folder */
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) fprintf(stderr, "  (could not remove %s)\n", dir);
    }
}

/* The model's buffers to and from the host (dtr_model_read / _write / _read_grads), FedProx
   on a device model (the CPU's gradients within 1e-5; through host copies), and a parameter
   server on the device refused (never touching its memory). */
static void test_device_engines(void) {
    enum { NP = IN * HID + HID + HID * OUT + OUT };
    dtr_context *ctx = make_ctx(1), *cpu = make_ctx(0);
    dtr_local_world *w = NULL;
    dtr_comm_config cc = dtr_comm_config_init();
    dtr_comm *c = NULL;
    dtr_ps *ps = NULL;
    dtr_ps_config pc = dtr_ps_config_init();
    static float global[4096], a[4096], b[4096], back[4096];
    char err[256];
    tnet net, ref;
    int64_t n = 0, i;
    memset(&net, 0, sizeof net);
    memset(&ref, 0, sizeof ref);
    CHECK(ctx && cpu && net_make(ctx, &net) && net_make(cpu, &ref));
    if (net.m) n = dtr_model_numel(net.m);
    CHECK(n >= NP && n <= 4096);
    for (i = 0; i < n; i++) global[i] = 0.01f * (float)(i % 13) - 0.05f;
    if (n >= NP && n <= 4096 && ref.m) {
        dtr_tensor *l1 = net_loss(ctx, &net, 1.0f), *l2 = net_loss(cpu, &ref, 1.0f);
        CHECK(l1 && l2 && dtr_backward(ctx, l1) == DTR_OK && dtr_backward(cpu, l2) == DTR_OK);
        CHECK_OK(ctx, dtr_fed_prox(net.m, global, 0.1f));
        CHECK_OK(cpu, dtr_fed_prox(ref.m, global, 0.1f));
        CHECK_OK(ctx, dtr_model_read_grads(net.m, a, n));
        CHECK_OK(cpu, dtr_model_read_grads(ref.m, b, n));
        CHECK_MSG(max_rel(b, a, n) < 1e-5, "FedProx on the device: gradients %.3g from the CPU's", max_rel(b, a, n));
        CHECK_OK(ctx, dtr_model_write(net.m, global, n));   /* and back out, bit for bit */
        CHECK_OK(ctx, dtr_model_read(net.m, back, n));
        CHECK(memcmp(back, global, (size_t)n * sizeof(float)) == 0);
        CHECK_EQ_INT(dtr_model_write(net.m, global, n - 1), DTR_SHAPE_MISMATCH);
        CHECK(strstr(dtr_context_last_error(ctx), "dtr_model_write") != NULL);
        dtr_context_clear_error(ctx);
        dtr_context_reset(ctx);
        dtr_context_reset(cpu);
    }
    CHECK(dtr_local_world_create(1, NULL, &w) == DTR_OK);
    cc.local.world = w;
    CHECK(dtr_comm_create(&cc, &c, err, sizeof err) == DTR_OK);
    CHECK_EQ_INT(dtr_ps_create(net.m, c, &pc, &ps), DTR_UNSUPPORTED);
    CHECK(ps == NULL && strstr(dtr_context_last_error(ctx), "a server keeps its range in host memory") != NULL);
    dtr_comm_destroy(c);
    dtr_local_world_destroy(w);
    dtr_model_destroy(net.m);
    dtr_model_destroy(ref.m);
    dtr_context_destroy(ctx);
    dtr_context_destroy(cpu);
}

/* ---- data parallel: two ranks on one GPU over the local transport ---- */

typedef struct dp_rank {
    dtr_local_world *w;
    int rank, world, ok;
    dtr_dp_config dc;          /* ZeRO, compression, local SGD: through the host staging buffer */
    dtr_optimizer_kind kind;   /* SGD with momentum 0.9 by default (0) */
    int plain;                 /* SGD without momentum */
    float params[IN * HID + HID + HID * OUT + OUT];
    dtr_dp_stats stats;
    size_t opt_bytes;          /* the optimizer's moments, on the device */
    int staged;                /* devsim: the engine's staging buffer came from the backend's host_alloc */
    char err[256];
} dp_rank;



static dtr_optimizer_config dp_optimizer(const dp_rank *d) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(d->kind, d->kind == DTR_OPT_SGD ? 0.1f : 0.01f);
    oc.momentum = d->kind == DTR_OPT_SGD && !d->plain ? 0.9f : 0.0f;
    oc.weight_decay = d->kind == DTR_OPT_ADAMW ? 0.01f : 0.0f;
    return oc;
}

/* STEPS steps on this rank's rows of the batch (all of them in a world of one) */
static void *dp_main(void *arg) {
    dp_rank *d = (dp_rank *)arg;
    dtr_comm_config cc = dtr_comm_config_init();
    dtr_optimizer_config oc = dp_optimizer(d);
    dtr_context *ctx = make_ctx(1);
    dtr_comm *c = NULL;
    dtr_dp *dp = NULL;
    dtr_optimizer *opt = NULL;
    tnet n;
    int64_t rows = ROWS / d->world;
    int s;
    memset(&n, 0, sizeof n);
    cc.local.world = d->w;
    cc.local.rank = d->rank;
    cc.timeout_ms = 20000;
    d->ok = ctx && net_make(ctx, &n) && dtr_comm_create(&cc, &c, d->err, sizeof d->err) == DTR_OK &&
            dtr_dp_create(n.m, c, &d->dc, &dp) == DTR_OK && dtr_dp_shard_optimizer(dp, &oc) == DTR_OK &&
            dtr_optimizer_create(n.m, &oc, &opt) == DTR_OK;
#ifdef TRAIN_DEVSIM
    d->staged = __atomic_load_n(&devsim_host_blocks, __ATOMIC_RELAXED) > 0;
#endif
    for (s = 0; d->ok && s < STEPS; s++) {
        dtr_tensor *loss = net_loss_rows(ctx, &n, 1.0f, d->rank * rows, rows);
        d->ok = loss && dtr_backward(ctx, loss) == DTR_OK && dtr_dp_finish(dp) == DTR_OK &&
                dtr_optimizer_step(opt, NULL) == DTR_OK && dtr_dp_step_done(dp) == DTR_OK;
        dtr_context_reset(ctx);
    }
    d->ok = d->ok && net_read(&n, d->params) && dtr_dp_get_stats(dp, &d->stats) == DTR_OK;
    if (d->ok) d->opt_bytes = test_moment_bytes(opt);
    if (!d->ok && ctx) snprintf(d->err, sizeof d->err, "%s | %s", dtr_context_last_error(ctx), c ? dtr_comm_last_error(c) : "");
    dtr_dp_destroy(dp);
    dtr_comm_destroy(c);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(n.m);
    dtr_context_destroy(ctx);
    return NULL;
}

/* `world` ranks of d[0]'s configuration */
static void dp_world(int world, dp_rank *d) {
    dtr_local_world *w = NULL;
    pthread_t tid[2];
    int i;
    CHECK(dtr_local_world_create(world, NULL, &w) == DTR_OK);
    for (i = 0; i < world; i++) {
        if (i) d[i].dc = d[0].dc, d[i].kind = d[0].kind, d[i].plain = d[0].plain;
        d[i].w = w;
        d[i].rank = i;
        d[i].world = world;
        pthread_create(&tid[i], NULL, dp_main, &d[i]);
    }
    for (i = 0; i < world; i++) pthread_join(tid[i], NULL);
    for (i = 0; i < world; i++) CHECK_MSG(d[i].ok, "rank %d of %d: %s", i, world, d[i].err);
    dtr_local_world_destroy(w);
}

/* two ranks of two[0]'s configuration end within tol of `ref`'s parameters, with the same weights on both */
static void dp_check(const dp_rank *ref, dp_rank *two, double tol, const char *what) {
    int64_t n = (int64_t)(IN * HID + HID + HID * OUT + OUT);
    dp_world(2, two);
    CHECK_MSG(memcmp(two[0].params, two[1].params, (size_t)n * sizeof(float)) == 0, "%s: the two ranks' weights differ", what);
    CHECK_MSG(max_rel(ref->params, two[0].params, n) < tol, "%s: %.3g away from the reference", what,
              max_rel(ref->params, two[0].params, n));
}

static void test_data_parallel(void) {
    static dp_rank one[1], two[2], adam[2], z[2], sgd[2], loc[2], bf[2];
    int stage;
    dp_world(1, one);
    two[0].dc.bucket_bytes = 4;   /* a bucket per parameter: copies overlap backward and each other */
    dp_check(one, two, 1e-5, "2 ranks against 1");
#ifdef TRAIN_DEVSIM   /* the staging buffers are the backend's host memory (pinned on CUDA), all freed */
    CHECK(two[0].staged && two[1].staged);
    CHECK_EQ_INT(devsim_host_blocks, 0);
    /* each bucket's copy was queued beside the stream (2 ranks x 4 buckets a step), and some
       were still in flight when the engine first looked (it waited, or looked again) */
    CHECK_MSG(devsim_async_copies == 2 * 4 * STEPS && devsim_async_early > 0, "%d copies queued, %d seen early",
              devsim_async_copies, devsim_async_early);
#endif
    /* ZeRO over host staging, AdamW (the moments of this rank's shard on the device) */
    memset(adam, 0, sizeof adam);
    adam[0].kind = DTR_OPT_ADAMW;
    dp_world(2, adam);
    for (stage = 1; stage <= 2; stage++) {
        memset(z, 0, sizeof z);
        z[0].kind = DTR_OPT_ADAMW;
        z[0].dc.zero = stage;
        z[0].dc.bucket_bytes = 4;
        dp_check(adam, z, 1e-6, stage == 1 ? "ZeRO-1" : "ZeRO-2");
        CHECK_MSG(z[0].opt_bytes + z[1].opt_bytes == adam[0].opt_bytes && z[0].opt_bytes < adam[0].opt_bytes,
                  "ZeRO-%d: moments %zu + %zu bytes, "
                  "unsharded %zu", stage, z[0].opt_bytes, z[1].opt_bytes, adam[0].opt_bytes);
    }
    /* local SGD averaging plain SGD's parameters every step is data parallelism */
    memset(sgd, 0, sizeof sgd);
    sgd[0].plain = 1;
    dp_world(2, sgd);
    memset(loc, 0, sizeof loc);
    loc[0].plain = 1;
    loc[0].dc.local_sgd_every = 1;
    dp_check(sgd, loc, 1e-5, "local SGD every step");
    CHECK_EQ_INT(loc[0].stats.param_averages, STEPS);
    /* bf16 gradients: half the bytes, close to f32's result */
    memset(bf, 0, sizeof bf);
    bf[0].dc.compress = DTR_COMPRESS_BF16;
    dp_check(two, bf, 1e-2, "bf16 compression");
    CHECK(bf[0].stats.wire_bytes * 2 <= bf[0].stats.raw_bytes + 64);
}

/* The loader's batches go to the device without a wait (dtr_loader_tensors, cfg.device):
   its buffers are the backend's host memory (pinned on CUDA), and every batch's tensors hold
   what a plain loader hands out, also when they are read only after later batches came (the
   loader kept each buffer until its copies were done; the simulated device lands a copy late,
   reading its source then). 0 and 2 prefetch threads. */
static void test_loader_upload(void) {
    enum { N = 40, D = 6, BATCH = 8, NB = 5 };
    static float xs[N * D], want_x[NB][BATCH * D], got_x[BATCH * D];
    static int32_t ys[N], want_y[NB][BATCH], got_y[BATCH];
    dtr_memory_dataset_config mc = dtr_memory_dataset_config_init();
    dtr_dataset *ds = NULL;
    char err[256];
    int i, k, threads;
    for (i = 0; i < N * D; i++) xs[i] = (float)i * 0.25f - 7.0f;
    for (i = 0; i < N; i++) ys[i] = i % 7;
    mc.count = N, mc.x = xs, mc.y = ys;
    mc.layout.x_dtype = DTR_F32, mc.layout.x_ndim = 1, mc.layout.x_shape[0] = D, mc.layout.y_dtype = DTR_I32;
    CHECK(dtr_dataset_from_memory(&mc, &ds, err, sizeof err) == DTR_OK);
    for (threads = 0; ds && threads <= 2; threads += 2) {
        dtr_context *dev = make_ctx(1);
        dtr_loader_config lc = dtr_loader_config_init();
        dtr_loader *ref = NULL, *l = NULL;
        dtr_tensor *tx[NB], *ty[NB];
        lc.batch_size = BATCH, lc.shuffle = 1, lc.seed = 5, lc.threads = threads;
        CHECK(dev && dtr_loader_create(ds, &lc, &ref, err, sizeof err) == DTR_OK);
        lc.device = dev;
        CHECK(dtr_loader_create(ds, &lc, &l, err, sizeof err) == DTR_OK);
        for (k = 0; l && ref && k < NB; k++) {
            dtr_batch a, b;
            CHECK(dtr_loader_next(ref, &a) == DTR_OK && dtr_loader_next(l, &b) == DTR_OK);
            memcpy(want_x[k], a.x, sizeof want_x[k]);
            memcpy(want_y[k], a.y, sizeof want_y[k]);
            CHECK_OK(dev, dtr_loader_tensors(l, dev, &b, &tx[k], &ty[k]));
        }
#ifdef TRAIN_DEVSIM
        CHECK_MSG(devsim_host_blocks >= 2, "the device loader's buffers: %d staging blocks", devsim_host_blocks);
#endif
        for (k = 0; l && ref && k < NB; k++) {
            CHECK_OK(dev, dtr_tensor_read(tx[k], DTR_F32, got_x, BATCH * D));
            CHECK_OK(dev, dtr_tensor_read(ty[k], DTR_I32, got_y, BATCH));
            CHECK_MSG(memcmp(got_x, want_x[k], sizeof got_x) == 0 && memcmp(got_y, want_y[k], sizeof got_y) == 0,
                      "%d threads: batch %d on the device differs from the host batch", threads, k);
        }
        dtr_loader_destroy(l);
        dtr_loader_destroy(ref);
        dtr_context_destroy(dev);
#ifdef TRAIN_DEVSIM
        CHECK_EQ_INT(devsim_host_blocks, 0);
#endif
    }
    dtr_dataset_destroy(ds);
}

/* ---- a frozen body's gradients take no device memory ----
 * Two 1024 x 1024 layers (8 MiB of gradients: 4 granules of a GPU's 2 MiB) under a small
 * head. Freezing the body gives its gradient memory back (dtr_cuda_memory's bytes in use drop
 * by the body's gradients but for the granules it shares with the head); training the head
 * on the device matches the CPU and leaves the body's values alone; the body's gradients
 * read zeros; unfreezing backs them again (zeros, then the next backward's) and the steps
 * match the CPU again; freezing again zeroes what the body's gradients held. With
 * DTR_CUDA_VMM=0 (and on the simulated device) the buffer stays whole: the same steps. */
#define FB_W 1024
#define FB_ROWS 8
#define FB_OUT 4

typedef struct fbnet { dtr_model *m; dtr_linear_layer b1, b2, head; } fbnet;

static int fb_make(dtr_context *ctx, fbnet *n) {
    return dtr_model_create(ctx, 6, &n->m) == DTR_OK &&
           dtr_linear_layer_init(&n->b1, n->m, "body.1", FB_W, FB_W, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
           dtr_linear_layer_init(&n->b2, n->m, "body.2", FB_W, FB_W, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
           dtr_linear_layer_init(&n->head, n->m, "head", FB_W, FB_OUT, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
           dtr_model_build(n->m) == DTR_OK;
}

/* one AdamW step on a fixed batch (opt NULL: the gradients only); its gradients into grads (NULL: not read) */
static int fb_step(dtr_context *ctx, fbnet *n, dtr_optimizer *opt, float *grads) {
    static float x[FB_ROWS * FB_W];
    int32_t y[FB_ROWS];
    int64_t xs[2] = {FB_ROWS, FB_W}, rows = FB_ROWS, i;
    dtr_rng rng;
    dtr_tensor *h, *loss;
    int ok;
    dtr_rng_seed(&rng, 23, 1);
    for (i = 0; i < FB_ROWS * FB_W; i++) x[i] = 2.0f * dtr_rng_uniform(&rng) - 1.0f;
    for (i = 0; i < FB_ROWS; i++) y[i] = (int32_t)(dtr_rng_u32(&rng) % FB_OUT);
    h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->b1, dtr_tensor_from(ctx, DTR_F32, 2, xs, x)));
    h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->b2, h));
    loss = dtr_cross_entropy(ctx, dtr_linear_layer_forward(ctx, &n->head, h), dtr_tensor_from(ctx, DTR_I32, 1, &rows, y));
    ok = loss && dtr_model_zero_grad(n->m) == DTR_OK && dtr_backward(ctx, loss) == DTR_OK &&
         (!grads || dtr_model_read_grads(n->m, grads, dtr_model_numel(n->m)) == DTR_OK) && (!opt || dtr_optimizer_step(opt, NULL) == DTR_OK);
    dtr_context_reset(ctx);
    return ok;
}

static size_t fb_in_use(dtr_context *ctx, int gpu) {
    size_t used = 0;
#ifndef TRAIN_DEVSIM
    if (gpu) dtr_cuda_memory(ctx, &used, NULL, NULL, 0);
#endif
    (void)ctx, (void)gpu;
    return used;
}

typedef struct fbrun {
    float *w[3], *g[3];     /* each phase's (frozen, thawed, frozen again) parameters after it and last gradients */
    size_t before[3], after[3];   /* device bytes in use around each phase's dtr_model_set_trainable */
    int owns;               /* the backend says the gradient buffer is its device memory */
} fbrun;

/* 2 steps frozen, 1 thawed, 1 frozen again; 0 on an error */
static int fb_run(int gpu, fbrun *out) {
    const char *body[1] = {"body."};
    dtr_context *ctx = make_ctx(gpu);
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 1e-3f);
    dtr_optimizer *opt = NULL;
    fbnet n;
    int64_t N;
    int ok, ph;
    memset(&n, 0, sizeof n);
    oc.weight_decay = 0.1f, oc.eps = 1e-3f;   /* (gradients of 1e-7 and less: eps keeps the steps off rounding's noise) */
    ok = ctx && fb_make(ctx, &n) && dtr_optimizer_create(n.m, &oc, &opt) == DTR_OK;
    N = ok ? dtr_model_numel(n.m) : 0;
    out->owns = ok && ctx->backend->owns && ctx->backend->owns(ctx, dtr_model_grads(n.m));   /* (what a host-memory group stages) */
    for (ph = 0; ok && ph < 3; ph++) {
        ok = ph != 2 || fb_step(ctx, &n, NULL, NULL);   /* frozen again with gradients in it: they go */
        out->before[ph] = fb_in_use(ctx, gpu);
        ok = ok && dtr_model_set_trainable(n.m, body, 1, ph == 1) == DTR_OK;
        out->after[ph] = fb_in_use(ctx, gpu);
        out->w[ph] = (float *)malloc((size_t)N * sizeof(float)), out->g[ph] = (float *)malloc((size_t)N * sizeof(float));
        ok = ok && out->w[ph] && out->g[ph] && (ph != 0 || fb_step(ctx, &n, opt, NULL)) && fb_step(ctx, &n, opt, out->g[ph]) &&
             dtr_model_read(n.m, out->w[ph], N) == DTR_OK;
    }
    if (!ok && ctx) fprintf(stderr, "  (%s: %s)\n", gpu ? "device" : "cpu", dtr_context_last_error(ctx));
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(n.m);
    dtr_context_destroy(ctx);
    return ok;
}

static void fb_free(fbrun *r) {
    int i;
    for (i = 0; i < 3; i++) free(r->w[i]), free(r->g[i]);
}

/* the largest difference of a and b over the largest |a| */
static double max_scaled(const float *a, const float *b, int64_t n) {
    double top = 0.0, d = 0.0;
    int64_t i;
    for (i = 0; i < n; i++) {
        top = fabs((double)a[i]) > top ? fabs((double)a[i]) : top;
        d = fabs((double)a[i] - b[i]) > d || b[i] != b[i] ? (b[i] != b[i] ? 1e30 : fabs((double)a[i] - b[i])) : d;
    }
    return top > 0.0 ? d / top : d;
}

/* the device run against the CPU's; vmm: the device backs only the trainable gradients */
static void fb_check(const fbrun *cpu, const fbrun *dev, int64_t body, int64_t N, int vmm) {
    int ph;
    int64_t i, nz = 0;
    for (ph = 0; ph < 3; ph++) {
        double dw = max_rel(cpu->w[ph], dev->w[ph], N), dg = max_scaled(cpu->g[ph], dev->g[ph], N);
        CHECK_MSG(dw < 1e-5 && dg < 1e-3, "phase %d: parameters within %.3g, gradients within %.3g of the CPU's", ph, dw, dg);
    }
    for (i = 0; i < body; i++) nz += dev->g[0][i] != 0.0f || dev->g[2][i] != 0.0f;
    CHECK_MSG(nz == 0, "%lld of the frozen body's gradients are not zero", (long long)nz);
    CHECK_MSG(memcmp(dev->w[0], cpu->w[0], (size_t)body * sizeof(float)) == 0, "the frozen body's values changed");
    CHECK_MSG(dev->owns, "the backend does not take the gradient buffer for its device memory");
    if (vmm) {   /* (a granule of 2 MiB at each end of the body may hold the head's gradients too) */
        size_t bytes = (size_t)body * sizeof(float), drop = dev->before[0] - dev->after[0];
        CHECK_MSG(dev->before[0] > dev->after[0] && drop <= bytes && drop + ((size_t)4 << 20) >= bytes,
                  "freezing %zu bytes of gradients: %zu bytes in use, then %zu", bytes, dev->before[0], dev->after[0]);
        CHECK_MSG(dev->after[1] - dev->before[1] == drop && dev->before[2] - dev->after[2] == drop,
                  "thawing takes %zu bytes back and freezing again gives %zu (freezing gave %zu)", dev->after[1] - dev->before[1],
                  dev->before[2] - dev->after[2], drop);
    } else {
        CHECK_MSG(dev->after[0] == dev->before[0], "the whole buffer stays: %zu bytes in use, then %zu", dev->before[0], dev->after[0]);
    }
}

static void test_frozen_memory(void) {
    fbrun cpu, dev;
    int64_t body = 2 * ((int64_t)FB_W * FB_W + FB_W), N = body + (int64_t)FB_OUT * FB_W + 16;
    int pass;
    memset(&cpu, 0, sizeof cpu);
    CHECK(fb_run(0, &cpu));
    for (pass = 0; pass < 2; pass++) {   /* the driver's virtual memory calls, then DTR_CUDA_VMM=0 */
        int vmm = pass == 0;
#ifdef TRAIN_DEVSIM
        vmm = 0;
#endif
        memset(&dev, 0, sizeof dev);
        setenv("DTR_CUDA_VMM", pass ? "0" : "1", 1);
        CHECK_MSG(fb_run(1, &dev), "pass %d", pass);
        if (cpu.w[2] && dev.w[2]) fb_check(&cpu, &dev, body, N, vmm);
        fb_free(&dev);
    }
    unsetenv("DTR_CUDA_VMM");
    fb_free(&cpu);
}

int main(void) {
    (void)test_ctx;
    if (DEVICE_COUNT() <= 0) {
        printf("*** test_train_gpu: no GPU visible: GPU training checks SKIPPED ***\n");
        return test_summary();
    }
    RUN(test_optimizers);
    RUN(test_narrow_activations);
#ifndef TRAIN_DEVSIM
    RUN(test_gpt_bf16);
    RUN(test_llama_block);
    RUN(test_generate);
#endif
    RUN(test_loss_scaler_overflow);
    RUN(test_batch_norm);
    RUN(test_model_lerp);
    RUN(test_save_load);
    RUN(test_checkpoint);
    RUN(test_device_engines);
    RUN(test_data_parallel);
    RUN(test_loader_upload);
    RUN(test_frozen_memory);
#ifdef TRAIN_DEVSIM
    CHECK_EQ_INT(devsim__violations, 0);
#endif
    return test_summary();
}
