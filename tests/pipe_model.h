/* tests/pipe_model.h: a small model split into pipeline stages, shared by test_pipeline
 * (thread ranks) and test_fabric (processes). Four blocks of tanh(linear), an input layer
 * in block 0 and an output layer with an MSE loss in block 3; with S stages, stage s runs
 * blocks 4s/S .. 4(s+1)/S - 1 and keeps only their parameters (dtr_model_keep), so every
 * split starts from the weights of the whole model. Batch b of step t is a fixed function
 * of (t, sample). pm_reference trains the whole model on one rank without the engine.
 * With a tensor-parallel group (pm_model.tp), the blocks' layers split over it in pairs:
 * even blocks column-parallel (their output a shard), odd blocks row-parallel (summed back),
 * under the same parameter names, so stage boundaries after odd blocks carry full tensors. */
#ifndef DTRAIN_TEST_PIPE_MODEL_H
#define DTRAIN_TEST_PIPE_MODEL_H
#include <stdio.h>
#include "../dtrain.h"

#define PM_D 6        /* input features */
#define PM_H 8        /* hidden */
#define PM_O 3        /* outputs */
#define PM_BATCH 16
#define PM_BLOCKS 4

typedef struct pm_model {
    dtr_model *m;
    dtr_linear_layer in, l[PM_BLOCKS], out;
    dtr_tp_linear tl[PM_BLOCKS];   /* with tp */
    dtr_comm *tp;                  /* tensor-parallel group, or NULL */
    int stages, P, rank, step;
    int offset;       /* first sample of this replica's share of the batch (data parallel) */
} pm_model;

/* declares the whole model on m (parameters in one fixed order) */
static dtr_result pm_declare(pm_model *pm, dtr_model *m) {
    char name[32];
    dtr_result r;
    int i;
    pm->m = m;
    r = dtr_linear_layer_init(&pm->in, m, "b0.in", PM_D, PM_H, 1, DTR_INIT_TORCH_DEFAULT);
    for (i = 0; i < PM_BLOCKS && r == DTR_OK; i++) {
        snprintf(name, sizeof name, "b%d.l", i);
        if (!pm->tp) r = dtr_linear_layer_init(&pm->l[i], m, name, PM_H, PM_H, 1, DTR_INIT_TORCH_DEFAULT);
        else if (i % 2 == 0) r = dtr_tp_column_linear_init(&pm->tl[i], m, pm->tp, name, PM_H, PM_H, 1, DTR_INIT_TORCH_DEFAULT, 0);
        else r = dtr_tp_row_linear_init(&pm->tl[i], m, pm->tp, name, PM_H, PM_H, 1, DTR_INIT_TORCH_DEFAULT);
    }
    return r == DTR_OK ? dtr_linear_layer_init(&pm->out, m, "b3.out", PM_H, PM_O, 1, DTR_INIT_TORCH_DEFAULT) : r;
}

static int pm_first_block(int stage, int stages) { return stage * PM_BLOCKS / stages; }

/* keeps the blocks of this rank's stages (stage = chunk * P + rank for each chunk) */
static dtr_result pm_keep(pm_model *pm, int chunks) {
    static const char *names[PM_BLOCKS] = {"b0.", "b1.", "b2.", "b3."};
    const char *keep[PM_BLOCKS];
    int n = 0, c, b;
    for (c = 0; c < chunks; c++) {
        int s = c * pm->P + pm->rank;
        for (b = pm_first_block(s, pm->stages); b < pm_first_block(s + 1, pm->stages); b++) keep[n++] = names[b];
    }
    return dtr_model_keep(pm->m, keep, n);
}

/* sample i of step t: inputs in [-1, 1), targets in [0, 1) */
static float pm_value(int t, int i, int k, int target) {
    dtr_rng r;
    dtr_rng_seed(&r, (uint64_t)(t * 1000 + i), (uint64_t)(target * 100 + k + 1));
    return target ? dtr_rng_uniform(&r) : 2.0f * dtr_rng_uniform(&r) - 1.0f;
}

static dtr_tensor *pm_data(dtr_context *ctx, int t, int64_t b, int64_t e, int target) {
    float v[PM_BATCH * PM_D + PM_BATCH * PM_O];
    int64_t shape[2] = {e - b, target ? PM_O : PM_D}, i, k;
    for (i = b; i < e; i++)
        for (k = 0; k < shape[1]; k++) v[(i - b) * shape[1] + k] = pm_value(t, (int)i, (int)k, target);
    return dtr_tensor_from(ctx, DTR_F32, 2, shape, v);
}

/* blocks b0..b1-1 on x; samples [lo, hi) of step t for the input and the loss */
static dtr_tensor *pm_blocks(const pm_model *pm, dtr_context *ctx, int b0, int b1, dtr_tensor *x, int64_t lo, int64_t hi) {
    int b;
    lo += pm->offset, hi += pm->offset;
    if (b0 == 0) x = dtr_linear_layer_forward(ctx, &pm->in, pm_data(ctx, pm->step, lo, hi, 0));
    for (b = b0; b < b1; b++)
        x = dtr_tanh(ctx, pm->tp ? dtr_tp_linear_forward(ctx, &pm->tl[b], x) : dtr_linear_layer_forward(ctx, &pm->l[b], x));
    if (b1 == PM_BLOCKS) x = dtr_mse(ctx, dtr_linear_layer_forward(ctx, &pm->out, x), pm_data(ctx, pm->step, lo, hi, 1));
    return x;
}

/* the engine's forward: user is the pm_model; its pipe gives the micro-batch's samples */
typedef struct pm_stage { pm_model *pm; dtr_pipe *pipe; } pm_stage;

static dtr_tensor *pm_forward(void *user, dtr_context *ctx, int chunk, int mb, dtr_tensor *input) {
    pm_stage *st = (pm_stage *)user;
    int s = chunk * st->pm->P + st->pm->rank;
    int64_t lo, hi;
    if (dtr_pipe_microbatch_range(st->pipe, mb, &lo, &hi) != DTR_OK) return NULL;
    return pm_blocks(st->pm, ctx, pm_first_block(s, st->pm->stages), pm_first_block(s + 1, st->pm->stages), input, lo, hi);
}

/* the whole model on one rank, `steps` steps of SGD with momentum (lr 0.1, momentum 0.9),
 * clipping the gradient's norm to `clip` (0: no clipping); *loss: the last step's */
/* the activation_dtype of the reference's context and the test's ranks' (16-bit runs) */
static dtr_dtype pm_act = DTR_F32;

static dtr_result pm_reference(int steps, float clip, dtr_context **ctx_out, dtr_model **m_out, float *loss) {
    dtr_context *ctx = NULL;
    dtr_context_config cc = dtr_context_config_init();
    dtr_model *m = NULL;
    dtr_optimizer *opt = NULL;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    pm_model pm;
    dtr_result r;
    cc.activation_dtype = pm_act;
    r = dtr_context_create(&cc, &ctx);
    memset(&pm, 0, sizeof pm);
    oc.momentum = 0.9f;
    oc.clip_norm = clip;
    if (r == DTR_OK) r = dtr_model_create(ctx, 7, &m);
    if (r == DTR_OK) r = pm_declare(&pm, m);
    if (r == DTR_OK) r = dtr_optimizer_create(m, &oc, &opt);
    for (pm.step = 0; r == DTR_OK && pm.step < steps; pm.step++) {
        dtr_tensor *l = pm_blocks(&pm, ctx, 0, PM_BLOCKS, NULL, 0, PM_BATCH);
        r = dtr_backward(ctx, l);
        if (r == DTR_OK) *loss = dtr_tensor_get(l, 0);
        if (r == DTR_OK) r = dtr_optimizer_step(opt, NULL);
        dtr_context_reset(ctx);
    }
    dtr_optimizer_destroy(opt);
    *ctx_out = ctx;
    *m_out = m;
    return r;
}

/* the element of the whole tensor b that element k of a shard a holds: column-parallel
 * shards are row ranges (rank t of T holds the t-th), row-parallel weights column ranges */
static int64_t pm_whole_index(const dtr_tensor *a, const dtr_tensor *b, int64_t k, int t) {
    int64_t n = dtr_tensor_numel(a), cols;
    if (n == dtr_tensor_numel(b)) return k;
    if (dtr_tensor_ndim(a) == 2 && dtr_tensor_dim(a, 0) == dtr_tensor_dim(b, 0)) {   /* row-parallel weight */
        cols = dtr_tensor_dim(a, 1);
        return k / cols * dtr_tensor_dim(b, 1) + (int64_t)t * cols + k % cols;
    }
    return (int64_t)t * n + k;
}

/* largest relative error ||a - b|| / ||b|| over the parameters of `part` found in `whole`
 * (part's tensor-parallel rank t: its shards are compared with their slices) */
static double pm_max_rel_error_tp(dtr_model *part, dtr_model *whole, int t) {
    double worst = 0.0;
    int i;
    for (i = 0; i < dtr_model_param_count(part); i++) {
        dtr_tensor *a = dtr_model_param_at(part, i), *b = dtr_model_find(whole, dtr_tensor_name(a));
        double d = 0.0, n = 0.0;
        int64_t k;
        if (!b) return 1e30;
        for (k = 0; k < dtr_tensor_numel(a); k++) {
            double x = dtr_tensor_get(a, k), y = dtr_tensor_get(b, pm_whole_index(a, b, k, t));
            d += (x - y) * (x - y);
            n += y * y;
        }
        d = n > 0 ? sqrt(d / n) : sqrt(d);
        if (d > worst) worst = d;
    }
    return worst;
}

static double pm_max_rel_error(dtr_model *part, dtr_model *whole) { return pm_max_rel_error_tp(part, whole, 0); }
#endif
