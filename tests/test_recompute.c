/* Activation checkpointing (dtr_checkpoint):
 *   test_gpt_bitwise      a small GPT (embedding, 2 blocks with dropout p = 0.1, layer norm,
 *                         head) trained 2 steps with each block checkpointed gives the same
 *                         loss and gradient bits as without, and a lower arena peak
 *   test_release          the same with release_activations on the checkpointed model (one and
 *                         nested levels): the plain model's bits
 *   test_memory_per_layer 6 blocks instead of 2: with checkpoints the peak grows by under 1/8
 *                         of what it grows without, under 3 block inputs per block
 *   test_steady_state     after two steps a checkpointed step makes no heap allocation
 *   test_hooks_once       a gradient hook sees every parameter exactly once per pass, with
 *                         its final gradient
 *   test_hooks_shared     ... also for a layer that two regions use (after the second's backward)
 *   test_nested           a checkpoint inside another gives the same bits; 5 levels fail cleanly
 *   test_no_grad          with recording off dtr_checkpoint just calls fn; with it on, fn runs
 *                         once in forward and once per backward pass (two passes add up)
 *   test_errors           NULL fn, n_in out of range, NULL/foreign inputs, fn returning NULL or
 *                         its input, fn's own error, a leaf made inside, a region that changes
 *                         between forward and recompute (other tensors, other shape)
 *   test_parallel         blocks with dropout, each checkpointed, in a 2-stage 1F1B pipeline of
 *                         4 micro-batches (dtr_pipe), over 2 data-parallel replicas (dtr_dp,
 *                         whose bucketed all-reduce starts from gradient hooks), and a region
 *                         holding tensor-parallel collectives on 2 ranks give every rank the
 *                         gradient bits of the same run without checkpoints */
#define _POSIX_C_SOURCE 200809L
#define DTRAIN_INTERNAL_API
#include <pthread.h>
#include "test.h"
#include "pipe_model.h"

#define V 16        /* vocabulary */
#define C 16        /* model width */
#define B 4         /* batch */
#define T 12        /* sequence */
#define MAXBLOCK 6
#define P_DROP 0.1f

typedef struct gpt {
    dtr_context *ctx;
    dtr_model *m;
    dtr_embedding_layer wte;
    dtr_gpt_block h[MAXBLOCK];
    int nblock;
    dtr_layernorm_layer ln_f;
    dtr_linear_layer head;
    int ckpt;          /* 1: each block checkpointed; 2: both inside one more checkpoint */
} gpt;

/* heap allocations made through the contexts of the GPT tests */
static long g_allocs;
static void *count_malloc(size_t n, void *u) { (void)u; g_allocs++; return malloc(n); }
static void *count_realloc(void *p, size_t n, void *u) { (void)u; g_allocs++; return realloc(p, n); }
static void count_free(void *p, void *u) { (void)u; free(p); }

static int g_release;   /* test_release: release_activations on checkpointed models */

static void gpt_make(gpt *g, int ckpt, int nblock) {
    dtr_context_config cfg = dtr_context_config_init();
    char name[16];
    int i;
    memset(g, 0, sizeof *g);
    cfg.threads = 1;
    cfg.seed = 42;
    cfg.release_activations = ckpt ? g_release : 0;
    cfg.alloc.malloc_fn = count_malloc, cfg.alloc.realloc_fn = count_realloc, cfg.alloc.free_fn = count_free;
    if (dtr_context_create(&cfg, &g->ctx) != DTR_OK || dtr_model_create(g->ctx, 3, &g->m) != DTR_OK) exit(2);
    g->ckpt = ckpt;
    g->nblock = nblock;
    dtr_embedding_layer_init(&g->wte, g->m, "wte", V, C);
    for (i = 0; i < nblock; i++) {
        snprintf(name, sizeof name, "h%d", i);
        dtr_gpt_block_init(&g->h[i], g->m, name, C, 2);
    }
    dtr_layernorm_layer_init(&g->ln_f, g->m, "ln_f", C);
    dtr_linear_layer_init(&g->head, g->m, "head", C, V, 1, DTR_INIT_TORCH_DEFAULT);
    if (dtr_model_build(g->m) != DTR_OK) exit(2);
}

static void gpt_free(gpt *g) {
    dtr_model_destroy(g->m);
    dtr_context_destroy(g->ctx);
}

/* the region: one block, then dropout */
static dtr_tensor *block_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    return dtr_dropout(ctx, dtr_gpt_block_forward(ctx, (const dtr_gpt_block *)user, in[0]), P_DROP);
}

static dtr_tensor *blocks(gpt *g, dtr_context *ctx, dtr_tensor *x, int ckpt) {
    int i;
    for (i = 0; i < g->nblock; i++) x = ckpt ? dtr_checkpoint(ctx, block_fn, &g->h[i], 1, &x) : block_fn(&g->h[i], ctx, &x);
    return x;
}

/* the outer region of ckpt 2: both blocks, each checkpointed inside */
static dtr_tensor *all_blocks_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    return blocks((gpt *)user, ctx, in[0], 1);
}

/* batch of step `step`: token ids and next-token targets */
static void gpt_batch(gpt *g, int step, dtr_tensor **ids, dtr_tensor **targets) {
    int32_t v[B * T], t[B * T];
    int64_t s2[2] = {B, T}, s1[1] = {B * T};
    int i;
    for (i = 0; i < B * T; i++) v[i] = (i * 7 + step * 3) % V, t[i] = (i * 5 + step + 1) % V;
    *ids = dtr_tensor_from(g->ctx, DTR_I32, 2, s2, v);
    *targets = dtr_tensor_from(g->ctx, DTR_I32, 1, s1, t);
}

static dtr_tensor *gpt_loss(gpt *g, int step) {
    dtr_context *ctx = g->ctx;
    dtr_tensor *ids, *targets, *x;
    int64_t s2[2] = {B * T, V};
    gpt_batch(g, step, &ids, &targets);
    x = dtr_dropout(ctx, dtr_embedding_layer_forward(ctx, &g->wte, ids), P_DROP);
    x = g->ckpt == 2 ? dtr_checkpoint(ctx, all_blocks_fn, g, 1, &x) : blocks(g, ctx, x, g->ckpt);
    x = dtr_linear_layer_forward(ctx, &g->head, dtr_layernorm_layer_forward(ctx, &g->ln_f, x));
    return dtr_cross_entropy(ctx, dtr_reshape(ctx, x, 2, s2), targets);
}

/* one step (gradients zeroed first, kept after); its loss and arena peak */
static void gpt_step(gpt *g, int step, float *loss, size_t *peak) {
    dtr_tensor *l;
    dtr_model_zero_grad(g->m);
    dtr_context_reset(g->ctx);
    dtr_context_arena_peak(g->ctx, 1);
    l = gpt_loss(g, step);
    CHECK_OK(g->ctx, dtr_backward(g->ctx, l));
    *loss = dtr_tensor_get(l, 0);
    *peak = dtr_context_arena_peak(g->ctx, 0);
}

static int64_t gpt_nparams(const gpt *g) {
    return dtr_model_param_offset(g->m, dtr_model_param_count(g->m) - 1) +
           dtr_tensor_numel(dtr_model_param_at(g->m, dtr_model_param_count(g->m) - 1));
}

/* the same loss and gradient bits as the plain model, and a lower arena peak */
static void compare_with_plain(int ckpt) {
    gpt plain, cp;
    float l0, l1;
    size_t p0 = 0, p1 = 0;
    int step;
    gpt_make(&plain, 0, 2);
    gpt_make(&cp, ckpt, 2);
    for (step = 0; step < 2; step++) {
        int64_t n = gpt_nparams(&plain), nz = 0, k;
        gpt_step(&plain, step, &l0, &p0);
        gpt_step(&cp, step, &l1, &p1);
        CHECK_MSG(memcmp(&l0, &l1, sizeof l0) == 0, "step %d: loss %.9g with checkpoints, %.9g without", step, l1, l0);
        CHECK(memcmp(dtr_model_grads(plain.m), dtr_model_grads(cp.m), (size_t)n * sizeof(float)) == 0);
        for (k = 0; k < n; k++) nz += dtr_model_grads(cp.m)[k] != 0.0f;
        CHECK_MSG(nz > n / 2, "only %lld of %lld gradients are non-zero", (long long)nz, (long long)n);
        /* the random stream went on from the same place */
        CHECK(memcmp(&plain.ctx->rng, &cp.ctx->rng, sizeof(dtr_rng)) == 0);
        CHECK_EQ_INT(cp.ctx->recompute_depth, 0);
        CHECK_MSG(p1 < p0, "step %d: arena peak %zu with checkpoints, %zu without", step, p1, p0);
    }
    printf("     checkpoint mode %d: arena peak %zu bytes, %zu without\n", ckpt, p1, p0);
    gpt_free(&plain);
    gpt_free(&cp);
}

static void test_gpt_bitwise(void) { compare_with_plain(1); }

static void test_release(void) {
    g_release = 1;
    compare_with_plain(1);
    compare_with_plain(2);
    g_release = 0;
}

/* after two steps, a step with checkpoints (nested too) makes no heap allocation */
static void test_steady_state(void) {
    gpt g;
    float loss;
    size_t peak;
    int ckpt, step;
    for (ckpt = 1; ckpt <= 2; ckpt++) {
        gpt_make(&g, ckpt, 2);
        for (step = 0; step < 2; step++) gpt_step(&g, step, &loss, &peak);
        g_allocs = 0;
        gpt_step(&g, 2, &loss, &peak);
        CHECK_MSG(g_allocs == 0, "checkpoint mode %d: %ld allocations in a steady step", ckpt, g_allocs);
        gpt_free(&g);
    }
}

/* memory per layer falls to its input: each more block adds far less to the peak with
   checkpoints than without */
static void test_memory_per_layer(void) {
    size_t peak[2][2];
    float loss;
    int ckpt, k;
    for (ckpt = 0; ckpt < 2; ckpt++)
        for (k = 0; k < 2; k++) {
            gpt g;
            gpt_make(&g, ckpt, 2 + 4 * k);
            gpt_step(&g, 0, &loss, &peak[ckpt][k]);
            gpt_free(&g);
        }
    {
        double plain = (double)(peak[0][1] - peak[0][0]) / 4, cp = (double)(peak[1][1] - peak[1][0]) / 4;
        printf("     arena peak per block: %.0f bytes without checkpoints, %.0f with (block input: %d)\n", plain, cp,
               (int)(B * T * C * sizeof(float)));
        CHECK_MSG(cp * 8 < plain, "per block: %.0f bytes with checkpoints, %.0f without", cp, plain);
        /* what stays: the block's output (the next one's input), its gradient, one node */
        CHECK_MSG(cp < 3.0 * B * T * C * sizeof(float), "per block with checkpoints: %.0f bytes", cp);
    }
}

/* dropout really draws masks in the regions: eval mode gives another loss */
static void test_dropout_active(void) {
    gpt g;
    float l_train, l_eval;
    size_t peak;
    gpt_make(&g, 1, 2);
    gpt_step(&g, 0, &l_train, &peak);
    dtr_context_set_training(g.ctx, 0);
    gpt_step(&g, 0, &l_eval, &peak);
    CHECK(l_train != l_eval);
    gpt_free(&g);
}

/* ---- gradient hooks ---- */

typedef struct hook_log {
    dtr_model *m;
    int count[64];
    float *at_report;   /* each parameter's gradient when it was reported */
} hook_log;

static dtr_result log_hook(void *user, dtr_tensor *param, dtr_event *ready) {
    hook_log *h = (hook_log *)user;
    int i = param->param_index;
    (void)ready;
    h->count[i]++;
    memcpy(h->at_report + dtr_model_param_offset(h->m, i), dtr_tensor_grad(param),
           (size_t)dtr_tensor_numel(param) * sizeof(float));
    return DTR_OK;
}

static void test_hooks_once(void) {
    gpt g;
    hook_log h;
    float loss;
    size_t peak;
    int64_t n;
    int i, id = 0, step;
    gpt_make(&g, 1, 2);
    n = gpt_nparams(&g);
    memset(&h, 0, sizeof h);
    h.m = g.m;
    h.at_report = calloc((size_t)n, sizeof(float));
    CHECK_OK(g.ctx, dtr_context_add_grad_hook(g.ctx, log_hook, &h, &id));
    for (step = 0; step < 2; step++) {
        memset(h.count, 0, sizeof h.count);
        gpt_step(&g, step, &loss, &peak);
        for (i = 0; i < dtr_model_param_count(g.m); i++)
            CHECK_MSG(h.count[i] == 1, "'%s' reported %d times", dtr_tensor_name(dtr_model_param_at(g.m, i)), h.count[i]);
        CHECK(memcmp(h.at_report, dtr_model_grads(g.m), (size_t)n * sizeof(float)) == 0);
    }
    CHECK_OK(g.ctx, dtr_context_remove_grad_hook(g.ctx, id));
    free(h.at_report);
    gpt_free(&g);
}

/* a layer used by two regions: reported once, after the second region's backward (the
   earlier in forward), not inside the first one replayed */
static dtr_tensor *shared_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    return dtr_tanh(ctx, dtr_linear_layer_forward(ctx, (const dtr_linear_layer *)user, in[0]));
}

static void test_hooks_shared(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_linear_layer l;
    hook_log h;
    int64_t s[2] = {3, 4};
    float xv[12];
    dtr_tensor *x;
    int i;
    for (i = 0; i < 12; i++) xv[i] = 0.1f * (float)i - 0.5f;
    CHECK_OK(ctx, dtr_model_create(ctx, 9, &m));
    CHECK_OK(ctx, dtr_linear_layer_init(&l, m, "l", 4, 4, 1, DTR_INIT_TORCH_DEFAULT));
    CHECK_OK(ctx, dtr_model_build(m));
    memset(&h, 0, sizeof h);
    h.m = m;
    h.at_report = calloc(20, sizeof(float));
    CHECK_OK(ctx, dtr_context_add_grad_hook(ctx, log_hook, &h, NULL));
    x = dtr_tensor_from(ctx, DTR_F32, 2, s, xv);
    x = dtr_checkpoint(ctx, shared_fn, &l, 1, &x);
    x = dtr_checkpoint(ctx, shared_fn, &l, 1, &x);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, x)));
    CHECK(h.count[0] == 1 && h.count[1] == 1);
    CHECK(memcmp(h.at_report, dtr_model_grads(m), 20 * sizeof(float)) == 0);
    free(h.at_report);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* ---- nesting ---- */

static void test_nested(void) {
    compare_with_plain(2);
}

/* fn of level *user: a region of level *user - 1 inside (none at 1), then tanh */
static const int k_levels[] = {0, 1, 2, 3, 4, 5};
static dtr_tensor *deep_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    const int *level = (const int *)user;
    dtr_tensor *y = *level > 1 ? dtr_checkpoint(ctx, deep_fn, (void *)(level - 1), 1, in) : in[0];
    return y ? dtr_tanh(ctx, y) : NULL;
}

static void test_too_deep(void) {
    dtr_context *ctx = test_ctx(1);
    int64_t s[1] = {3};
    dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_full(ctx, 1, s, 0.5f)), *y;
    y = dtr_checkpoint(ctx, deep_fn, (void *)&k_levels[4], 1, &x);   /* 4 levels: allowed */
    CHECK(y != NULL);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, y)));
    /* tanh^4 (0.5): each level's derivative multiplies in */
    {
        double v = 0.5, d = 1.0;
        int k;
        for (k = 0; k < 4; k++) { v = tanh(v); d *= 1.0 - v * v; }
        CHECK_NEAR(dtr_tensor_get(y, 0), v, 1e-6);
        CHECK_NEAR(dtr_tensor_grad(x)[0], d, 1e-6);
    }
    CHECK(dtr_checkpoint(ctx, deep_fn, (void *)&k_levels[5], 1, &x) == NULL);
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_BAD_STATE);
    CHECK(strstr(dtr_context_last_error(ctx), "nested deeper than 4") != NULL);
    CHECK_EQ_INT(ctx->recompute_depth, 0);
    CHECK(ctx->cur == &ctx->own);
    dtr_context_destroy(ctx);
}

/* ---- recording off ---- */

static int g_calls;

static dtr_tensor *square_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    (void)user;
    g_calls++;
    return dtr_mul(ctx, in[0], in[0]);
}

static void test_no_grad(void) {
    dtr_context *ctx = test_ctx(1);
    int64_t s[1] = {2};
    dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_full(ctx, 1, s, 3.0f)), *y;
    dtr_context_set_grad_enabled(ctx, 0);
    g_calls = 0;
    y = dtr_checkpoint(ctx, square_fn, NULL, 1, &x);
    CHECK(y != NULL && y->node == NULL && ctx->own.head == NULL && g_calls == 1);
    CHECK_NEAR(dtr_tensor_get(y, 1), 9.0f, 0);
    dtr_context_set_grad_enabled(ctx, 1);
    /* recording on: fn runs once in forward, once more in backward */
    y = dtr_checkpoint(ctx, square_fn, NULL, 1, &x);
    CHECK(y != NULL && y->node && y->node->op == DTR_OP_CHECKPOINT && g_calls == 2);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, y)));
    CHECK(g_calls == 3);
    CHECK_NEAR(dtr_tensor_grad(x)[0], 6.0f, 0);
    /* a second pass over the same region recomputes it again and adds up: 6 + 2 * 6 */
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_scale(ctx, y, 2.0f))));
    CHECK(g_calls == 4);
    CHECK_NEAR(dtr_tensor_grad(x)[1], 18.0f, 0);
    dtr_context_destroy(ctx);
}

/* ---- errors ---- */

static dtr_tensor *null_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    (void)user, (void)ctx, (void)in;
    return NULL;
}

static dtr_tensor *identity_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    (void)user, (void)ctx;
    return in[0];
}

static dtr_tensor *bad_matmul_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    (void)user;
    return dtr_matmul(ctx, in[0], in[0]);   /* (2, 3) x (2, 3): shape error */
}

/* makes a leaf that requires a gradient inside the region: refused (it would not outlive it) */
static dtr_tensor *leaf_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    dtr_tensor *w = dtr_tensor_requires_grad(dtr_tensor_full(ctx, in[0]->ndim, in[0]->shape, 2.0f));
    (void)user;
    if (w) w->name = "w";
    return dtr_mul(ctx, in[0], w);
}

/* a region that changes after its forward: *(int *)user 1 reads another tensor, 2 changes shape */
static dtr_tensor *g_other;
static dtr_tensor *fickle_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    int mode = *(int *)user;
    if (mode == 1) return dtr_mul(ctx, in[0], g_other);
    if (mode == 2) return dtr_sum(ctx, in[0], 0, 0);
    return dtr_mul(ctx, in[0], in[0]);
}

/* expects the call to have failed with `code` and a message containing `text`; clears it */
static void expect_error(dtr_context *ctx, dtr_result code, const char *text) {
    CHECK_EQ_INT(dtr_context_status(ctx), code);
    CHECK_MSG(strstr(dtr_context_last_error(ctx), text) != NULL, "message: %s", dtr_context_last_error(ctx));
    CHECK_EQ_INT(ctx->recompute_depth, 0);
    CHECK(ctx->cur == &ctx->own);
    dtr_context_clear_error(ctx);
}

/* dtr_checkpoint(ctx, fn, NULL, n_in, in) fails with `code` and `text` */
static void refused(dtr_context *ctx, dtr_checkpoint_fn fn, int n_in, dtr_tensor *const *in, dtr_result code,
                    const char *text) {
    CHECK(dtr_checkpoint(ctx, fn, NULL, n_in, in) == NULL);
    expect_error(ctx, code, text);
}

static void test_errors(void) {
    dtr_context *ctx = test_ctx(1), *other = test_ctx(1);
    int64_t s[2] = {2, 3};
    dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_full(ctx, 2, s, 1.0f)), *y;
    dtr_tensor *foreign = dtr_tensor_full(other, 2, s, 1.0f), *none = NULL;
    int mode;
    CHECK(dtr_checkpoint(NULL, square_fn, NULL, 1, &x) == NULL);
    refused(ctx, NULL, 1, &x, DTR_NULL_HANDLE, "dtr_checkpoint: fn is NULL");
    refused(ctx, square_fn, -1, &x, DTR_INVALID_ARGUMENT, "n_in is -1, must be 0..64");
    refused(ctx, square_fn, 65, &x, DTR_INVALID_ARGUMENT, "n_in is 65");
    refused(ctx, square_fn, 1, NULL, DTR_NULL_HANDLE, "in is NULL");
    refused(ctx, square_fn, 1, &none, DTR_NULL_HANDLE, "input 0 is NULL");
    refused(ctx, square_fn, 1, &foreign, DTR_INVALID_ARGUMENT, "input 0 belongs to another context");
    refused(ctx, null_fn, 1, &x, DTR_INVALID_ARGUMENT, "fn returned NULL without setting an error");
    refused(ctx, identity_fn, 1, &x, DTR_INVALID_ARGUMENT, "a tensor it did not compute");
    refused(ctx, bad_matmul_fn, 1, &x, DTR_SHAPE_MISMATCH, "dtr_matmul");
    refused(ctx, leaf_fn, 1, &x, DTR_INVALID_ARGUMENT, "fn made 'w' require a gradient inside the region");
    /* the region changes between forward and backward: the pass fails, nothing is written */
    g_other = dtr_tensor_requires_grad(dtr_tensor_full(ctx, 2, s, 2.0f));
    for (mode = 1; mode <= 2; mode++) {
        int now = 0;
        y = dtr_checkpoint(ctx, fickle_fn, &now, 1, &x);
        CHECK(y != NULL);
        now = mode;
        CHECK(dtr_backward(ctx, dtr_sum_all(ctx, y)) != DTR_OK);
        expect_error(ctx, mode == 1 ? DTR_BAD_STATE : DTR_SHAPE_MISMATCH,
                     mode == 1 ? "which it did not read in forward" : "was (2, 3) in forward and is (3) recomputed");
        CHECK(dtr_tensor_grad(g_other) == NULL);
    }
    /* still usable */
    y = dtr_checkpoint(ctx, square_fn, NULL, 1, &x);
    CHECK(y != NULL);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, y)));
    dtr_context_destroy(ctx);
    dtr_context_destroy(other);
}

/* ---- data, pipeline and tensor parallel (tests/pipe_model.h's layers, with dropout) ---- */

typedef struct par_rank {
    pthread_t tid;
    dtr_local_world *w;
    int rank, ckpt, mode;   /* mode: 0 data parallel, 1 pipeline, 2 tensor parallel */
    dtr_result r;
    char msg[256];
    float grads[512];
    int64_t n;
} par_rank;

typedef struct par_stage {
    pm_model pm;
    dtr_pipe *pipe;
    dtr_comm *comm;   /* the tensor-parallel group */
    int ckpt;
} par_stage;

static dtr_tensor *pm_block_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    return dtr_dropout(ctx, dtr_tanh(ctx, dtr_linear_layer_forward(ctx, (const dtr_linear_layer *)user, in[0])), P_DROP);
}

/* blocks b0 .. b1-1 of the model on samples [lo, hi), as pm_blocks with dropout */
static dtr_tensor *par_blocks(par_stage *st, dtr_context *ctx, int b0, int b1, dtr_tensor *x, int64_t lo, int64_t hi) {
    const pm_model *pm = &st->pm;
    int b;
    lo += pm->offset, hi += pm->offset;
    if (b0 == 0) x = dtr_linear_layer_forward(ctx, &pm->in, pm_data(ctx, pm->step, lo, hi, 0));
    for (b = b0; b < b1 && x; b++)
        x = st->ckpt ? dtr_checkpoint(ctx, pm_block_fn, (void *)&pm->l[b], 1, &x) : pm_block_fn((void *)&pm->l[b], ctx, &x);
    if (b1 == PM_BLOCKS) x = dtr_mse(ctx, dtr_linear_layer_forward(ctx, &pm->out, x), pm_data(ctx, pm->step, lo, hi, 1));
    return x;
}

static dtr_tensor *par_forward(void *user, dtr_context *ctx, int chunk, int mb, dtr_tensor *input) {
    par_stage *st = (par_stage *)user;
    int64_t lo, hi;
    (void)chunk;
    if (dtr_pipe_microbatch_range(st->pipe, mb, &lo, &hi) != DTR_OK) return NULL;
    return par_blocks(st, ctx, pm_first_block(st->pm.rank, 2), pm_first_block(st->pm.rank + 1, 2), input, lo, hi);
}

/* one step of a 2-stage pipeline (1F1B, 4 micro-batches) */
static dtr_result par_pipe_step(dtr_context *ctx, dtr_comm *c, par_stage *st, dtr_model *m) {
    dtr_pipe_config pc = dtr_pipe_config_init();
    dtr_result r;
    (void)ctx;
    pc.schedule = DTR_PIPE_1F1B, pc.microbatches = 4, pc.batch = PM_BATCH;
    pc.forward = par_forward, pc.user = st;
    r = dtr_pipe_create(m, c, &pc, &st->pipe);
    if (r == DTR_OK) r = dtr_pipe_step(st->pipe, NULL);
    dtr_pipe_destroy(st->pipe);
    return r;
}

/* one step of a replica, half the batch; buckets of 256 bytes start as backward goes */
static dtr_result par_dp_step(dtr_context *ctx, dtr_comm *c, par_stage *st, dtr_model *m) {
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_dp *dp = NULL;
    dtr_result r;
    dc.bucket_bytes = 256;
    st->pm.offset = st->pm.rank * PM_BATCH / 2;
    r = dtr_dp_create(m, c, &dc, &dp);
    if (r == DTR_OK) r = dtr_backward(ctx, par_blocks(st, ctx, 0, PM_BLOCKS, NULL, 0, PM_BATCH / 2));
    if (r == DTR_OK) r = dtr_dp_finish(dp);
    if (r == DTR_OK && dtr_dp_overlapped_buckets(dp) < 2)
        r = dtr__fail(ctx, DTR_BAD_STATE, "%d buckets started in backward", dtr_dp_overlapped_buckets(dp));
    dtr_dp_destroy(dp);
    return r;
}

/* Megatron-LM's MLP on each rank's slice, with collectives inside the region: recomputing it
   runs the forward's all-reduce again in backward, at the same point on every rank */
static dtr_tensor *tp_region_fn(void *user, dtr_context *ctx, dtr_tensor *const *in) {
    const par_stage *st = (const par_stage *)user;
    dtr_tensor *h = dtr_tp_copy(ctx, in[0], st->comm);
    h = dtr_dropout(ctx, dtr_tanh(ctx, dtr_linear_layer_forward(ctx, &st->pm.l[0], h)), P_DROP);
    return dtr_tp_reduce(ctx, dtr_linear_layer_forward(ctx, &st->pm.l[1], h), st->comm);
}

static dtr_result par_tp_step(dtr_context *ctx, dtr_comm *c, par_stage *st, dtr_model *m) {
    dtr_tensor *x = dtr_linear_layer_forward(ctx, &st->pm.in, pm_data(ctx, 0, 0, PM_BATCH, 0));
    (void)m;
    st->comm = c;
    x = st->ckpt ? dtr_checkpoint(ctx, tp_region_fn, st, 1, &x) : tp_region_fn(st, ctx, &x);
    return dtr_backward(ctx, dtr_mse(ctx, dtr_linear_layer_forward(ctx, &st->pm.out, x), pm_data(ctx, 0, 0, PM_BATCH, 1)));
}

typedef dtr_result (*par_step_fn)(dtr_context *ctx, dtr_comm *c, par_stage *st, dtr_model *m);
static const par_step_fn k_par_steps[3] = {par_dp_step, par_pipe_step, par_tp_step};
static const char *const k_par_names[3] = {"data-parallel rank", "pipeline stage", "tensor-parallel rank"};

static dtr_result par_train(par_rank *o, dtr_context *ctx, dtr_comm *c) {
    par_stage st;
    dtr_model *m = NULL;
    dtr_result r;
    memset(&st, 0, sizeof st);
    st.ckpt = o->ckpt;
    st.pm.stages = 2, st.pm.P = 2, st.pm.rank = o->rank;
    r = dtr_model_create(ctx, 7, &m);
    if (r == DTR_OK) r = pm_declare(&st.pm, m);
    if (r == DTR_OK && o->mode == 1) r = pm_keep(&st.pm, 1);
    if (r == DTR_OK) r = dtr_model_build(m);
    if (r == DTR_OK) r = k_par_steps[o->mode](ctx, c, &st, m);
    if (r == DTR_OK) {
        o->n = dtr_model_param_offset(m, dtr_model_param_count(m) - 1) +
               dtr_tensor_numel(dtr_model_param_at(m, dtr_model_param_count(m) - 1));
        if (o->n > 512) r = DTR_INVALID_ARGUMENT;
        else memcpy(o->grads, dtr_model_grads(m), (size_t)o->n * sizeof(float));
    }
    dtr_model_destroy(m);
    return r;
}

static void *par_main(void *arg) {
    par_rank *o = (par_rank *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_comm *c = NULL;
    cc.threads = 1, cc.seed = 5;
    cfg.local.world = o->w, cfg.local.rank = o->rank, cfg.timeout_ms = 30000;
    o->r = dtr_context_create(&cc, &ctx);
    if (o->r == DTR_OK) o->r = dtr_comm_create(&cfg, &c, o->msg, sizeof o->msg);
    if (o->r == DTR_OK) o->r = par_train(o, ctx, c);
    if (o->r != DTR_OK && !o->msg[0] && ctx) snprintf(o->msg, sizeof o->msg, "%s", dtr_context_last_error(ctx));
    dtr_comm_destroy(c);
    dtr_context_destroy(ctx);
    return NULL;
}

static void par_run(int mode, int ckpt, par_rank *o) {
    dtr_local_world *w = NULL;
    int r;
    if (dtr_local_world_create(2, NULL, &w) != DTR_OK) { CHECK(0); return; }
    for (r = 0; r < 2; r++) {
        memset(&o[r], 0, sizeof o[r]);
        o[r].w = w, o[r].rank = r, o[r].ckpt = ckpt, o[r].mode = mode;
        pthread_create(&o[r].tid, NULL, par_main, &o[r]);
    }
    for (r = 0; r < 2; r++) pthread_join(o[r].tid, NULL);
    dtr_local_world_destroy(w);
}

static void test_parallel(void) {
    par_rank plain[2], cp[2];
    int mode, r;
    (void)pm_forward, (void)pm_reference, (void)pm_max_rel_error;   /* the shared model's, unused here */
    for (mode = 0; mode < 3; mode++) {
        par_run(mode, 0, plain);
        par_run(mode, 1, cp);
        for (r = 0; r < 2; r++) {
            const char *what = k_par_names[mode];
            CHECK_MSG(plain[r].r == DTR_OK && cp[r].r == DTR_OK, "%s %d: %s / %s", what, r, plain[r].msg, cp[r].msg);
            CHECK(plain[r].n > 0 && plain[r].n == cp[r].n);
            CHECK_MSG(memcmp(plain[r].grads, cp[r].grads, (size_t)plain[r].n * sizeof(float)) == 0,
                      "%s %d: gradients differ with checkpoints", what, r);
        }
    }
}

int main(void) {
    RUN(test_gpt_bitwise);
    RUN(test_release);
    RUN(test_dropout_active);
    RUN(test_steady_state);
    RUN(test_memory_per_layer);
    RUN(test_hooks_once);
    RUN(test_hooks_shared);
    RUN(test_nested);
    RUN(test_too_deep);
    RUN(test_no_grad);
    RUN(test_errors);
    RUN(test_parallel);
    return test_summary();
}
