/* The op cases: ONE table (CASES below) of small graphs over random inputs, which feeds
 *   test_gradients       finite differences: for each case the loss is L = sum(op(inputs) * R)
 *                        with fixed random R; analytic gradients come from dtr_backward,
 *                        numerical ones from central differences (L accumulated in double on
 *                        the host). Pass: ||analytic - numeric|| / max(norms) <= 1e-3.
 *   test_backend_parity  every case on every available backend against the CPU reference
 *                        (1 thread): outputs and input gradients. The CPU with 3 threads must
 *                        give the same bits; a device backend agrees within 1e-5 (relative).
 *   test_device_data_errors  an attention key length or an embedding id out of range, found by
 *                        a GPU kernel: DTR_INVALID_ARGUMENT at the next synchronisation
 *   test_op_coverage     every op of the op list (src/core/internal.h) appears on the tape of
 *                        at least one case: adding an op without a case fails here. */
#define _DEFAULT_SOURCE   /* MAP_ANONYMOUS (tests/devsim.h) */
#define DTRAIN_INTERNAL_API
#include "test.h"
#include "devsim.h"

#define MAXIN 6
#define EPS 1e-2f

typedef struct gc_input {
    int ndim;
    int64_t shape[DTR_MAX_DIMS];
    int kind;          /* 0 normal, 1 away from zero (relu, div), 2 distinct spaced values (max),
                          3 positive (log, sqrt), 4 kind 2's values + 0.025 (never within 0.025
                          of a kind 2 input: maximum, minimum) */
} gc_input;

typedef dtr_tensor *(*build_fn)(dtr_context *ctx, dtr_tensor **in, void *user);
typedef struct gc_hooks { void (*setup)(dtr_context *ctx); void (*teardown)(void); } gc_hooks;

static int g_threads = 1;
static int g_covered[DTR_OP_COUNT];   /* ops seen on the tape of some case */
static dtr_dtype g_leaf_dtype = DTR_F32;   /* bf16/f16: a case's ops get its leaves cast to it */

static void mark_covered(const dtr_context *ctx) {
    const dtr__node *n;
    for (n = ctx->cur->head; n; n = n->prev) g_covered[n->op] = 1;
}

/* Random inputs of a case: normal in [-1, 1), away from zero (kind 1), a shuffled ramp of values
 * at least 0.05 apart (kind 2; kind 4 shifted by 0.025), or in [0.5, 1.5) (kind 3). */
static void gc_fill(float *x, int64_t n, int kind, dtr_rng *rng) {
    int64_t k;
    for (k = 0; k < n; k++) {
        float v = dtr_rng_uniform(rng) * 2.0f - 1.0f;
        x[k] = kind == 1 ? (v < 0 ? -1.0f : 1.0f) * (0.5f + fabsf(v)) : kind == 3 ? 0.5f + fabsf(v) : v;
    }
    if (kind != 2 && kind != 4) return;
    for (k = 0; k < n; k++) x[k] = -1.0f + 0.05f * (float)k + (kind == 4 ? 0.025f : 0.0f);
    for (k = n - 1; k > 0; k--) {
        int64_t j = dtr_rng_u32(rng) % (uint32_t)(k + 1);
        float t = x[k]; x[k] = x[j]; x[j] = t;
    }
}
/* optional hooks around a check's context (a model whose parameters live on it) */
static void (*g_setup)(dtr_context *ctx);
static void (*g_teardown)(void);

static dtr_tensor *gc_forward(dtr_context *ctx, int nin, const gc_input *spec, float **data, build_fn fn, void *user,
                              int track, dtr_tensor **leaves) {
    int i;
    for (i = 0; i < nin; i++) {
        leaves[i] = dtr_tensor_from(ctx, DTR_F32, spec[i].ndim, spec[i].shape, data[i]);
        if (track) dtr_tensor_requires_grad(leaves[i]);
    }
    if (g_leaf_dtype != DTR_F32) {   /* the ops read 16-bit inputs; the leaves keep the gradients */
        dtr_tensor *narrow[MAXIN];
        for (i = 0; i < nin; i++) narrow[i] = dtr_cast(ctx, leaves[i], g_leaf_dtype);
        return fn(ctx, narrow, user);
    }
    return fn(ctx, leaves, user);
}

static double gc_loss(dtr_tensor *out, const float *R, float *buf) {
    int64_t n = dtr_tensor_numel(out), i;
    double s = 0.0;
    dtr_tensor_read(out, DTR_F32, buf, (size_t)n);
    for (i = 0; i < n; i++) s += (double)buf[i] * R[i];
    return s;
}

/* Returns the relative error; fails the current case when above 1e-3. */
static double gradcheck(const char *name, int nin, const gc_input *spec, build_fn fn, void *user) {
    dtr_context *ctx = test_ctx(g_threads);
    float *data[MAXIN], *grad[MAXIN], *R = NULL, *buf = NULL;
    dtr_tensor *leaves[MAXIN], *out, *Rt, *loss;
    dtr_rng rng, saved;
    double num2 = 0, ana2 = 0, diff2 = 0, rel;
    int64_t n_out;
    int i;
    dtr_rng_seed(&rng, 1234, 7);
    if (g_setup) g_setup(ctx);
    for (i = 0; i < nin; i++) {
        int64_t n = 1;
        int d;
        for (d = 0; d < spec[i].ndim; d++) n *= spec[i].shape[d];
        data[i] = malloc((size_t)(n ? n : 1) * sizeof(float));
        grad[i] = malloc((size_t)(n ? n : 1) * sizeof(float));
        gc_fill(data[i], n, spec[i].kind, &rng);
    }
    saved = ctx->rng; /* dropout draws from it: every forward must see the same mask */
    out = gc_forward(ctx, nin, spec, data, fn, user, 1, leaves);
    CHECK_MSG(out != NULL, "%s: forward failed: %s", name, dtr_context_last_error(ctx));
    mark_covered(ctx);
    if (!out) {
        for (i = 0; i < nin; i++) { free(data[i]); free(grad[i]); }
        if (g_teardown) g_teardown();
        dtr_context_destroy(ctx);
        return 1e9;
    }
    n_out = dtr_tensor_numel(out);
    R = malloc((size_t)n_out * sizeof(float));
    buf = malloc((size_t)n_out * sizeof(float));
    for (i = 0; i < n_out; i++) R[i] = dtr_rng_uniform(&rng) * 2.0f - 1.0f;
    Rt = dtr_tensor_from(ctx, DTR_F32, out->ndim, out->shape, R);
    loss = dtr_sum_all(ctx, dtr_mul(ctx, out, Rt));
    CHECK_OK(ctx, dtr_backward(ctx, loss));
    for (i = 0; i < nin; i++) {
        int64_t n = dtr_tensor_numel(leaves[i]);
        if (dtr_tensor_grad(leaves[i])) memcpy(grad[i], dtr_tensor_grad(leaves[i]), (size_t)n * sizeof(float));
        else memset(grad[i], 0, (size_t)n * sizeof(float));
    }
    dtr_context_reset(ctx);
    dtr_context_set_grad_enabled(ctx, 0);
    for (i = 0; i < nin; i++) {
        int64_t n = dtr_tensor_numel(leaves[i]) , k, step = n > 64 ? n / 64 : 1;
        for (k = 0; k < n; k += step) {
            float keep = data[i][k];
            double lp, lm, num;
            data[i][k] = keep + EPS;
            ctx->rng = saved;
            lp = gc_loss(gc_forward(ctx, nin, spec, data, fn, user, 0, leaves), R, buf);
            dtr_context_reset(ctx);
            data[i][k] = keep - EPS;
            ctx->rng = saved;
            lm = gc_loss(gc_forward(ctx, nin, spec, data, fn, user, 0, leaves), R, buf);
            dtr_context_reset(ctx);
            data[i][k] = keep;
            num = (lp - lm) / (2.0 * EPS);
            num2 += num * num;
            ana2 += (double)grad[i][k] * grad[i][k];
            diff2 += (num - grad[i][k]) * (num - grad[i][k]);
        }
    }
    rel = sqrt(diff2) / fmax(fmax(sqrt(num2), sqrt(ana2)), 1e-6);
    CHECK_MSG(rel <= 1e-3, "%s: relative error %.3g (|num| %.4g, |ana| %.4g)", name, rel, sqrt(num2), sqrt(ana2));
    CHECK_MSG(sqrt(num2) > 1e-4, "%s: the numerical gradient is zero: the check would prove nothing", name);
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_OK);
    for (i = 0; i < nin; i++) { free(data[i]); free(grad[i]); }
    free(R);
    free(buf);
    if (g_teardown) g_teardown();
    dtr_context_destroy(ctx);
    return rel;
}

#define IN1(a) {1, {a}, 0}
#define IN2(a, b) {2, {a, b}, 0}
#define IN3(a, b, c) {3, {a, b, c}, 0}
#define IN4(a, b, c, d) {4, {a, b, c, d}, 0}

/* ---- element-wise ---- */

static dtr_tensor *b_add(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_add(c, x[0], x[1]); }
static dtr_tensor *b_sub(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_sub(c, x[0], x[1]); }
static dtr_tensor *b_mul(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_mul(c, x[0], x[1]); }
static dtr_tensor *b_div(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_div(c, x[0], x[1]); }

static dtr_tensor *b_add_t(dtr_context *c, dtr_tensor **x, void *u) {
    (void)u;
    return dtr_mul(c, dtr_transpose(c, x[0], 0, 1), dtr_slice(c, x[1], 1, 1, 5));
}

static dtr_tensor *b_unary(dtr_context *c, dtr_tensor **x, void *u) {
    switch (*(int *)u) {
    case 0: return dtr_scale(c, x[0], -2.5f);
    case 1: return dtr_relu(c, x[0]);
    case 2: return dtr_gelu(c, x[0]);
    case 3: return dtr_tanh(c, x[0]);
    case 4: return dtr_sigmoid(c, x[0]);
    case 5: return dtr_abs(c, x[0]);
    case 7: return dtr_silu(c, x[0]);
    case 8: return dtr_exp(c, x[0]);
    case 9: return dtr_log(c, x[0]);
    case 10: return dtr_sqrt(c, x[0]);
    case 11: return dtr_pow(c, x[0], 2.5f);
    case 12: return dtr_pow(c, x[0], 3.0f);
    case 13: return dtr_clamp(c, x[0], -0.52f, 0.33f);     /* ends between kind 2's values */
    case 14: return dtr_clamp(c, x[0], -INFINITY, 0.33f);
    case 15: return dtr_leaky_relu(c, x[0], 0.1f);
    case 16: return dtr_softplus(c, x[0], 2.0f, 1.05f);    /* threshold at x = 0.525: kind 2 has 0.5, 0.55 */
    case 17: return dtr_softplus(c, x[0], 1.0f, 20.0f);
    default: return dtr_gelu_erf(c, x[0]);
    }
}

/* batch norm: training with running statistics (arg 0; weight and bias), training without
   them or an affine part (1), evaluation from fixed running statistics (2; weight and bias) */
static dtr_tensor *b_batchnorm(dtr_context *c, dtr_tensor **x, void *u) {
    static const float rm[4] = {0.1f, -0.2f, 0.3f, 0.05f}, rv[4] = {0.5f, 1.5f, 0.8f, 2.0f};
    int64_t C = dtr_tensor_dim(x[0], 1);   /* <= 4 where the running statistics are used */
    int k = *(int *)u;
    dtr_tensor *m, *v;
    if (k == 1) return dtr_batch_norm(c, x[0], NULL, NULL, NULL, NULL, 1, 0.1f, 1e-5f);
    m = dtr_tensor_from(c, DTR_F32, 1, &C, rm), v = dtr_tensor_from(c, DTR_F32, 1, &C, rv);
    return dtr_batch_norm(c, x[0], x[1], x[2], m, v, k == 0, 0.1f, 1e-5f);
}

static dtr_tensor *b_groupnorm(dtr_context *c, dtr_tensor **x, void *u) {
    (void)u;
    return dtr_group_norm(c, x[0], 3, x[1], x[2], 1e-5f);
}

/* an LSTM (arg 1) or a GRU over x[0] (B, T, 3) with weights x[1] (G 2, 3), x[2] (G 2, 2) and one
   bias x[3] (G 2) as both bias_ih and bias_hh, hidden 2, from a zero state; args 2 and 3: the
   same over rows of different lengths (dtr_rnn_config) */
static dtr_tensor *b_rnn(dtr_context *c, dtr_tensor **x, void *u) {
    static const int32_t lengths[2] = {3, 1};
    int k = *(int *)u;
    if (k >= 2) {   /* 2: an LSTM, 3: a GRU, over rows of 3 and 1 steps (4: the LSTM in reverse; 5: the GRU in
                       reverse over whole rows); y, the last h (and c) side by side */
        dtr_rnn_config cfg = dtr_rnn_config_init();
        dtr_lstm_layer l = {x[1], x[2], x[3], x[3], 3, 2};
        dtr_gru_layer g = {x[1], x[2], x[3], x[3], 3, 2};
        dtr_tensor *parts[3] = {NULL, NULL, NULL}, *y;
        int64_t ys[2] = {2, 6};
        cfg.lengths = k == 5 ? NULL : lengths, cfg.reverse = k >= 4;
        k = k == 4 ? 2 : k == 5 ? 3 : k;
        y = k == 2 ? dtr_lstm_layer_forward_ex(c, &l, x[0], NULL, NULL, &cfg, &parts[1], &parts[2])
                   : dtr_gru_layer_forward_ex(c, &g, x[0], NULL, &cfg, &parts[1]);
        if (!y) return NULL;
        parts[0] = dtr_reshape(c, y, 2, ys);
        return dtr_concat(c, parts, k == 2 ? 3 : 2, 1);
    }
    if (k) {
        dtr_lstm_layer l = {x[1], x[2], x[3], x[3], 3, 2};
        return dtr_lstm_layer_forward(c, &l, x[0], NULL, NULL, NULL, NULL);
    } else {
        dtr_gru_layer l = {x[1], x[2], x[3], x[3], 3, 2};
        return dtr_gru_layer_forward(c, &l, x[0], NULL, NULL);
    }
}

/* dtr_lstm_sequence over gx x[0] (T, B, 8) with w_hh x[1] (8, 2): arg 1 with b_hh x[2], h0 x[3]
   and c0 x[4], giving every step's h and c side by side (T, B, 4); arg 0 alone, h only; arg 2:
   an LSTM layer's one step (dtr_lstm_layer_step: the cell op) from x[0] (B, 3) with weights
   x[1] (8, 3), x[2] (8, 2) and x[3] (8) as both biases, from h x[4] and c x[5] (B, 2); arg 3
   and 4: dtr_gru_sequence over gx x[0] (T, B, 6) with w_hh x[1] (6, 2), alone or (4) with b_hh
   x[2] and h0 x[3] */
static dtr_tensor *b_lstm_seq(dtr_context *c, dtr_tensor **x, void *u) {
    int k = *(int *)u;
    dtr_tensor *cs, *hs, *both[2];
    if (k == 2) {
        dtr_lstm_layer l = {x[1], x[2], x[3], x[3], 3, 2};
        hs = dtr_lstm_layer_step(c, &l, x[0], x[4], x[5], &cs);
        return hs ? dtr_add(c, hs, dtr_scale(c, cs, 0.5f)) : NULL;
    }
    if (k >= 3) return dtr_gru_sequence(c, x[0], x[1], k == 4 ? x[2] : NULL, k == 4 ? x[3] : NULL);
    hs = dtr_lstm_sequence(c, x[0], x[1], k ? x[2] : NULL, k ? x[3] : NULL, k ? x[4] : NULL, &cs);
    if (!k || !hs) return hs;
    both[0] = hs, both[1] = cs;
    return dtr_concat(c, both, 2, -1);
}

static dtr_tensor *b_pick(dtr_context *c, dtr_tensor **x, void *u) {
    return *(int *)u ? dtr_minimum(c, x[0], x[1]) : dtr_maximum(c, x[0], x[1]);
}

static dtr_tensor *b_loss(dtr_context *c, dtr_tensor **x, void *u) {
    return *(int *)u ? dtr_huber_loss(c, x[0], x[1], 0.3f) : dtr_bce_with_logits(c, x[0], x[1]);
}

static dtr_tensor *b_unary_view(dtr_context *c, dtr_tensor **x, void *u) {
    (void)u;
    return dtr_gelu(c, dtr_permute(c, x[0], (const int[]){2, 0, 1}));
}

/* ---- matmul, linear ---- */

static dtr_tensor *b_matmul(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_matmul(c, x[0], x[1]); }
static dtr_tensor *b_matmul_t(dtr_context *c, dtr_tensor **x, void *u) {
    (void)u;
    return dtr_matmul(c, dtr_transpose(c, x[0], -1, -2), dtr_transpose(c, x[1], -1, -2));
}

static dtr_tensor *b_linear(dtr_context *c, dtr_tensor **x, void *u) {
    return dtr_linear(c, x[0], x[1], *(int *)u ? x[2] : NULL);
}

/* ---- softmax family, losses, reductions ---- */

static dtr_tensor *b_softmax(dtr_context *c, dtr_tensor **x, void *u) {
    switch (*(int *)u) {
    case 0: return dtr_softmax(c, x[0]);
    case 1: return dtr_log_softmax(c, x[0]);
    default: return dtr_softmax_causal(c, x[0]);
    }
}

static dtr_tensor *b_xent(dtr_context *c, dtr_tensor **x, void *u) {
    static const int32_t t[6] = {0, 4, 2, 2, 1, 3};
    int64_t n = 6;
    (void)u;
    return dtr_cross_entropy(c, x[0], dtr_tensor_from(c, DTR_I32, 1, &n, t));
}

/* dtr_cross_entropy_ex: rows 1 and 4 carry the ignored target 7; arg 0: smoothing 0.1, mean;
   1: sum; 2: no reduction (each row's loss, (2, 3)) (every row ignored: test_autograd.c) */
static dtr_tensor *b_xent_ex(dtr_context *c, dtr_tensor **x, void *u) {
    static const int32_t t[6] = {0, 7, 2, 2, 7, 3};
    int64_t n = 6, rows[2] = {2, 3};
    int a = *(const int *)u;
    dtr_xent_config cfg = dtr_xent_config_init();
    cfg.ignore_index = 7;
    cfg.label_smoothing = a == 0 ? 0.1f : 0.0f;
    cfg.reduction = a == 1 ? DTR_LOSS_SUM : a == 2 ? DTR_LOSS_NONE : DTR_LOSS_MEAN;
    return dtr_cross_entropy_ex(c, x[0], a == 2 ? dtr_tensor_from(c, DTR_I32, 2, rows, t) : dtr_tensor_from(c, DTR_I32, 1, &n, t),
                                &cfg);
}

/* dtr_max / dtr_min over axis 1 of (3, 5, 4) (arg 0, 1; arg 2: max over the last axis, kept) */
static dtr_tensor *b_max(dtr_context *c, dtr_tensor **x, void *u) {
    int a = *(const int *)u;
    return a == 1 ? dtr_min(c, x[0], 1, 0) : dtr_max(c, x[0], a == 2 ? -1 : 1, a == 2);
}

/* the rows' cross-entropy against their own argmax (arg 0) or argmin (1) as the target: right
   indices give lse - max (lse - min); ARGMAX is never on a tape (an i32 output), so its
   coverage is marked here */
static dtr_tensor *b_argmax(dtr_context *c, dtr_tensor **x, void *u) {
    dtr_xent_config cfg = dtr_xent_config_init();
    dtr_tensor *idx = *(const int *)u ? dtr_argmin(c, x[0], -1, 0) : dtr_argmax(c, x[0], -1, 0);
    if (idx) g_covered[DTR_OP_ARGMAX] = 1;
    cfg.reduction = DTR_LOSS_NONE;
    return dtr_cross_entropy_ex(c, x[0], idx, &cfg);
}

/* dtr_gather: arg 0 axis 1 of (2, 5, 3) by (2, 4, 3) with repeats; 1 the last axis of (4, 6) by
   (4, 1) (a Q-network's taken actions); 2 axis 0 of (3, 4) by (2, 4) */
static dtr_tensor *b_gather(dtr_context *c, dtr_tensor **x, void *u) {
    static const int32_t i0[24] = {0, 4, 2, 4, 4, 1, 3, 0, 2, 1, 1, 0, 2, 3, 4, 0, 0, 0, 4, 2, 1, 3, 4, 4};
    static const int32_t i1[4] = {5, 0, 3, 3}, i2[8] = {2, 0, 1, 1, 0, 2, 2, 0};
    static const int64_t s0[3] = {2, 4, 3}, s1[2] = {4, 1}, s2[2] = {2, 4};
    int a = *(const int *)u;
    if (a == 0) return dtr_gather(c, x[0], 1, dtr_tensor_from(c, DTR_I32, 3, s0, i0));
    if (a == 1) return dtr_gather(c, x[0], -1, dtr_tensor_from(c, DTR_I32, 2, s1, i1));
    return dtr_gather(c, x[0], 0, dtr_tensor_from(c, DTR_I32, 2, s2, i2));
}

static dtr_tensor *b_upsample(dtr_context *c, dtr_tensor **x, void *u) {
    return *(const int *)u ? dtr_upsample_nearest2d(c, x[0], 1, 2) : dtr_upsample_nearest2d(c, x[0], 2, 3);
}

static dtr_tensor *b_mse(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_mse(c, x[0], x[1]); }

static dtr_tensor *b_reduce(dtr_context *c, dtr_tensor **x, void *u) {
    switch (*(int *)u) {
    case 0: return dtr_sum(c, x[0], 1, 0);
    case 1: return dtr_mean(c, x[0], -1, 1);
    case 2: return dtr_sum(c, x[0], 0, 1);
    case 3: return dtr_sum_all(c, x[0]);
    case 4: return dtr_mean_all(c, x[0]);
    default: return dtr_mean(c, dtr_transpose(c, x[0], 0, 2), 1, 0);
    }
}

/* ---- embedding, layer norm, dropout ---- */

static dtr_tensor *b_embedding(dtr_context *c, dtr_tensor **x, void *u) {
    static const int32_t ids[6] = {3, 0, 3, 1, 4, 0};
    int64_t s[2] = {2, 3};
    (void)u;
    return dtr_embedding(c, x[0], dtr_tensor_from(c, DTR_I32, 2, s, ids));
}

/* 1000 ids over 2 rows: the GPU kernel lists a row's 500 uses in several chunks */
static dtr_tensor *b_embedding_many(dtr_context *c, dtr_tensor **x, void *u) {
    static int32_t ids[1000];
    int64_t n = 1000, i;
    (void)u;
    for (i = 0; i < n; i++) ids[i] = (int32_t)((i * 7 + i / 50) % 2);
    return dtr_embedding(c, x[0], dtr_tensor_from(c, DTR_I32, 1, &n, ids));
}

static dtr_tensor *b_layernorm(dtr_context *c, dtr_tensor **x, void *u) {
    return *(int *)u ? dtr_layernorm(c, x[0], x[1], x[2], 1e-5f) : dtr_layernorm(c, x[0], NULL, NULL, 1e-5f);
}
/* RoPE, arg {heads, interleaved}, theta 10000; arg[2] 1: of the q slice of a (B, T, 3C) qkv */
static dtr_tensor *b_rope(dtr_context *c, dtr_tensor **x, void *u) {
    const int *a = (const int *)u;
    dtr_tensor *in = a[2] ? dtr_slice(c, x[0], -1, 0, x[0]->shape[2] / 3) : x[0];
    return dtr_rope(c, in, a[0], 10000.0f, a[1]);
}
/* RoPE at positions start.. (a generation step's), arg {heads, interleaved, start} */
static dtr_tensor *b_rope_at(dtr_context *c, dtr_tensor **x, void *u) {
    const int *a = (const int *)u;
    return dtr_rope_at(c, x[0], a[0], 10000.0f, a[1], a[2]);
}
/* RMS norm, with a weight (arg 1) or without; rows of 200 (the GPU's row kernel: many threads) */
static dtr_tensor *b_rmsnorm(dtr_context *c, dtr_tensor **x, void *u) { return dtr_rmsnorm(c, x[0], *(int *)u ? x[1] : NULL, 1e-6f); }

static dtr_tensor *b_dropout(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_dropout(c, x[0], 0.3f); }

/* a checkpointed region (src/core/recompute.c): dropout inside, recomputed in backward with
   the same mask */
static dtr_tensor *ckpt_region(void *u, dtr_context *c, dtr_tensor *const *x) {
    (void)u;
    return dtr_dropout(c, dtr_mul(c, dtr_tanh(c, x[0]), x[1]), 0.25f);
}
static dtr_tensor *b_checkpoint(dtr_context *c, dtr_tensor **x, void *u) {
    (void)u;
    dtr_rng_seed(&c->rng, 11, 5);   /* the same mask on a context that ran other cases (parity) */
    return dtr_checkpoint(c, ckpt_region, NULL, 2, x);
}

/* ---- convolution and pooling ---- */

static dtr_tensor *b_conv(dtr_context *c, dtr_tensor **x, void *u) {
    const int *g = (const int *)u; /* stride, padding, bias */
    return dtr_conv2d(c, x[0], x[1], g[2] ? x[2] : NULL, g[0], g[1]);
}

/* dtr_conv2d_ex's geometries: {stride h, w, padding h, w, dilation h, w, groups}; the last two
   are dtr_conv1d's (stride, padding, dilation, groups from the width's entries); the case's
   arguments: {geometry, 1 with a bias (the third input)} */
static const int k_conv_geom[][7] = {
    {2, 1, 0, 2, 2, 1, 1},   /* per-axis stride and padding, dilated rows (width stride 1: the fast path) */
    {1, 2, 1, 1, 1, 2, 2},   /* 2 groups, dilated columns, width stride 2 (the reference loops) */
    {2, 2, 1, 1, 1, 1, 3},   /* depthwise (direct loops) */
    {1, 1, 1, 2, 1, 2, 4},   /* depthwise, width dilation 2, padding (1, 2) */
    {1, 1, 0, 1, 1, 1, 2},   /* 2 groups, more outputs than a group's columns: dW split by rows */
    {1, 1, 0, 2, 1, 2, 2},   /* 1-D: dilation 2, 2 groups */
    {1, 2, 0, 1, 1, 1, 1},   /* 1-D: stride 2 */
};

static dtr_tensor *b_conv_ex(dtr_context *c, dtr_tensor **x, void *u) {
    const int *g = k_conv_geom[((const int *)u)[0]];
    dtr_tensor *bias = ((const int *)u)[1] ? x[2] : NULL;
    dtr_conv_config cfg = dtr_conv_config_init();
    if (dtr_tensor_ndim(x[0]) == 3) return dtr_conv1d(c, x[0], x[1], bias, g[1], g[3], g[5], g[6]);
    cfg.stride[0] = g[0], cfg.stride[1] = g[1], cfg.padding[0] = g[2], cfg.padding[1] = g[3];
    cfg.dilation[0] = g[4], cfg.dilation[1] = g[5], cfg.groups = g[6];
    return dtr_conv2d_ex(c, x[0], x[1], bias, &cfg);
}

/* dtr_conv_transpose2d's geometries: {stride h, w, padding h, w, dilation h, w, output padding
   h, w, groups}; the case's arguments as b_conv_ex's */
static const int k_convt_geom[][9] = {
    {2, 2, 1, 1, 1, 1, 1, 1, 1},   /* an upsampling by 2 (output padding: 2H, 2W) */
    {1, 2, 0, 1, 2, 1, 0, 1, 2},   /* 2 groups, dilated rows, width stride 2 */
    {1, 1, 0, 0, 1, 1, 0, 0, 1},   /* more inputs than a column block's rows: dW split by rows */
};

static dtr_tensor *b_convt(dtr_context *c, dtr_tensor **x, void *u) {
    const int *g = k_convt_geom[((const int *)u)[0]];
    dtr_conv_config cfg = dtr_conv_config_init();
    cfg.stride[0] = g[0], cfg.stride[1] = g[1], cfg.padding[0] = g[2], cfg.padding[1] = g[3];
    cfg.dilation[0] = g[4], cfg.dilation[1] = g[5], cfg.output_padding[0] = g[6], cfg.output_padding[1] = g[7];
    cfg.groups = g[8];
    return dtr_conv_transpose2d(c, x[0], x[1], ((const int *)u)[1] ? x[2] : NULL, &cfg);
}

static dtr_tensor *b_pool(dtr_context *c, dtr_tensor **x, void *u) {
    switch (*(int *)u) {
    case 0: return dtr_maxpool2d(c, x[0], 2, 0, 0);
    case 1: return dtr_maxpool2d(c, x[0], 3, 2, 1);
    case 2: return dtr_avgpool2d(c, x[0], 2, 0, 0);
    case 3: return dtr_avgpool2d(c, x[0], 3, 1, 1);
    case 4: return dtr_maxpool1d(c, x[0], 3, 2, 1);
    default: return dtr_avgpool1d(c, x[0], 4, 3, 2);
    }
}

/* ---- attention and views ---- */

static dtr_tensor *b_attention(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_attention(c, x[0], x[1], x[2], 2); }

/* dtr_attention_ex, arg {causal, heads (0: 2), scale in hundredths (0: 1 / sqrt(D))}: q (B, Tq,
   C), k and v (B, Tk, C) */
static dtr_tensor *b_attention_ex(dtr_context *c, dtr_tensor **x, void *u) {
    const int *a = (const int *)u;
    dtr_attention_config cfg = dtr_attention_config_init(a[1] ? a[1] : 2, a[0]);
    cfg.scale = (float)a[2] / 100.0f;
    return dtr_attention_ex(c, x[0], x[1], x[2], &cfg);
}

/* grouped-query attention, arg {causal, heads, kv heads}: q (B, Tq, C), k and v (B, Tk, C / heads * kv heads) */
static dtr_tensor *b_attention_gqa(dtr_context *c, dtr_tensor **x, void *u) {
    const int *a = (const int *)u;
    dtr_attention_config cfg = dtr_attention_config_init(a[1], a[0]);
    cfg.kv_heads = a[2];
    return dtr_attention_ex(c, x[0], x[1], x[2], &cfg);
}

/* causal attention of queries from key position q_start on (a generation step against a KV
   cache), arg {q_start, heads (0: 2), kv heads (0: heads)}: q (B, Tq, C), k and v (B, Tk, ...) */
static dtr_tensor *b_attention_at(dtr_context *c, dtr_tensor **x, void *u) {
    const int *a = (const int *)u;
    dtr_attention_config cfg = dtr_attention_config_init(a[1] ? a[1] : 2, 1);
    cfg.q_start = a[0];
    cfg.kv_heads = a[2];
    return dtr_attention_ex(c, x[0], x[1], x[2], &cfg);
}

/* dtr_attention_ex with key lengths, arg {causal, set}: 2 heads, the lengths of set (one per
   batch item) */
static dtr_tensor *b_attention_lens(dtr_context *c, dtr_tensor **x, void *u) {
    static const int32_t sets[][2] = {{3, 5}, {2, 5}, {6, 0}, {100, 37}, {70, 3}, {130, 64}, {70, 1}};
    const int *a = (const int *)u;
    int64_t B = x[0]->shape[0];
    dtr_attention_config cfg = dtr_attention_config_init(2, a[0]);
    cfg.key_lengths = dtr_tensor_from(c, DTR_I32, 1, &B, sets[a[1]]);
    return dtr_attention_ex(c, x[0], x[1], x[2], &cfg);
}

/* attention with dropout 0.3 on its weights (training), arg {causal, kv heads (0: 2 heads, else 4
   heads sharing them), mask_head0 + 1 (0: the whole layer's mask; else the heads' share of a mask
   over 6 heads, as a tensor-parallel rank draws it)} */
static dtr_tensor *b_attention_drop(dtr_context *c, dtr_tensor **x, void *u) {
    const int *a = (const int *)u;
    dtr_attention_config cfg = dtr_attention_config_init(a[1] ? 4 : 2, a[0]);
    cfg.kv_heads = a[1];
    cfg.dropout = 0.3f;
    if (a[2]) cfg.mask_heads = 6, cfg.mask_head0 = a[2] - 1;
    return dtr_attention_ex(c, x[0], x[1], x[2], &cfg);
}

/* attention on views, read without copies where their rows are dense: 0, q, k, v the column
   slices of one (B, T, 3C) qkv (rows 3C apart); 1, q dense, k a slice of (B, T, 2C), v a
   transposed (B, C, T) (copied) */
static dtr_tensor *b_attention_views(dtr_context *c, dtr_tensor **x, void *u) {
    int64_t C = x[0]->shape[2] / (*(int *)u ? 1 : 3);
    if (*(int *)u)
        return dtr_attention(c, x[0], dtr_slice(c, x[1], -1, C, 2 * C), dtr_transpose(c, x[2], 1, 2), 2);
    return dtr_attention(c, dtr_slice(c, x[0], -1, 0, C), dtr_slice(c, x[0], -1, C, 2 * C), dtr_slice(c, x[0], -1, 2 * C, 3 * C), 2);
}

static dtr_tensor *b_views(dtr_context *c, dtr_tensor **x, void *u) {
    int64_t shp[3] = {3, -1, 2};
    dtr_tensor *parts[3];
    (void)u;
    switch (*(int *)u) {
    case 0: return dtr_reshape(c, x[0], 3, shp);
    case 1: return dtr_contiguous(c, dtr_permute(c, x[0], (const int[]){1, 0}));
    case 2: return dtr_slice(c, x[0], 1, 1, -1);
    case 3:
        parts[0] = x[0]; parts[1] = dtr_scale(c, x[1], 2.0f); parts[2] = x[0];
        return dtr_concat(c, parts, 3, 0);
    default: /* reshape of a non-contiguous view (copies) */
        return dtr_reshape(c, dtr_transpose(c, x[0], 0, 1), 1, (const int64_t[]){-1});
    }
}

/* ---- a whole GPT block through the layer API ---- */

static dtr_model *g_gpt_model;
static dtr_gpt_block g_gpt;
static dtr_llama_block g_llama;   /* on the same model: 4 heads of 2 over 2 kv heads, MLP of 12 */

static void gpt_setup(dtr_context *ctx) {
    dtr_model_create(ctx, 5, &g_gpt_model);
    dtr_gpt_block_init(&g_gpt, g_gpt_model, "h0", 8, 2);
    dtr_llama_block_init(&g_llama, g_gpt_model, "layers.0", 8, 4, 2, 12);
}

static void gpt_teardown(void) { dtr_model_destroy(g_gpt_model); g_gpt_model = NULL; }
static const gc_hooks gpt_hooks = {gpt_setup, gpt_teardown};

static dtr_tensor *b_gpt(dtr_context *c, dtr_tensor **x, void *u) {
    return *(int *)u ? dtr_llama_block_forward(c, &g_llama, x[0]) : dtr_gpt_block_forward(c, &g_gpt, x[0]);
}

/* cast f32 -> bf16 -> f32: not differentiable by finite differences (bf16 rounding); its
   gradient is checked exactly by test_cast_straight_through, its parity by the table */
static dtr_tensor *b_cast(dtr_context *c, dtr_tensor **x, void *u) {
    (void)u;
    return dtr_cast(c, dtr_cast(c, x[0], DTR_BF16), DTR_F32);
}

/* tensor-parallel communication on a group of one rank (tests/test_tp.c runs it on several) */
static dtr_comm *g_comm1;

static dtr_tensor *b_tp(dtr_context *c, dtr_tensor **x, void *u) {
    dtr_tensor *h = dtr_tanh(c, x[0]);
    int k = *(int *)u;
    return k == 2 ? dtr_tp_gather(c, h, g_comm1) : k ? dtr_tp_reduce(c, h, g_comm1) : dtr_tp_copy(c, h, g_comm1);
}

/* the vocabulary-parallel cross-entropy on a group of one rank: dtr_cross_entropy's value; arg
   1: row 3 ignored (-100), smoothing 0.2, summed; arg 2: a row ignored (7), per-row losses */
static dtr_tensor *b_vxent(dtr_context *c, dtr_tensor **x, void *u) {
    static const int32_t t[6] = {0, 4, 2, 2, 1, 3}, ti[6] = {0, 4, 2, -100, 1, 3}, t7[6] = {0, 7, 2, 2, 1, 3};
    dtr_xent_config cfg = dtr_xent_config_init();
    int64_t n = 6;
    int k = *(int *)u;
    if (k == 0) return dtr_vocab_parallel_cross_entropy(c, x[0], dtr_tensor_from(c, DTR_I32, 1, &n, t), g_comm1);
    if (k == 1) cfg.label_smoothing = 0.2f, cfg.reduction = DTR_LOSS_SUM;
    else cfg.ignore_index = 7, cfg.reduction = DTR_LOSS_NONE;
    return dtr_vocab_parallel_cross_entropy_ex(c, x[0], dtr_tensor_from(c, DTR_I32, 1, &n, k == 1 ? ti : t7), g_comm1, &cfg);
}

/* ---- the table ---- */

typedef struct op_case {
    const char *name;
    int nin;
    gc_input in[MAXIN];
    build_fn fn;
    int arg[3];               /* handed to fn as its user pointer */
    int no_fd;                /* 1: no finite differences (covered by an exact test); 2: also a
                                 large device case that quick runs (DTR_TEST_QUICK, the
                                 sanitizers') check on a device in f32 only */
    const gc_hooks *hooks;    /* setup/teardown around the case's context, or NULL */
} op_case;

#define K0 {0, 0, 0}
#define KA(a) {a, 0, 0}
static const op_case CASES[] = {
    {"add", 2, {IN2(3, 5), IN2(3, 5)}, b_add, K0, 0, NULL},
    {"sub", 2, {IN2(3, 5), IN2(3, 5)}, b_sub, K0, 0, NULL},
    {"mul", 2, {IN2(3, 5), IN2(3, 5)}, b_mul, K0, 0, NULL},
    {"div", 2, {IN2(3, 5), {2, {3, 5}, 1}}, b_div, K0, 0, NULL},
    {"add broadcast", 2, {IN3(3, 1, 4), IN2(2, 4)}, b_add, K0, 0, NULL},          /* -> (3, 2, 4) */
    {"sub broadcast", 2, {IN1(4), IN2(3, 4)}, b_sub, K0, 0, NULL},                /* row vector */
    {"mul broadcast", 2, {IN4(2, 1, 3, 1), IN3(4, 1, 5)}, b_mul, K0, 0, NULL},    /* -> (2, 4, 3, 5) */
    {"div broadcast", 2, {IN2(3, 4), {2, {3, 1}, 1}}, b_div, K0, 0, NULL},        /* column, away from 0 */
    {"mul of transposed and sliced views", 2, {IN2(4, 3), IN2(3, 5)}, b_add_t, K0, 0, NULL},
    {"scale", 1, {IN3(2, 3, 7)}, b_unary, KA(0), 0, NULL},
    {"relu", 1, {{3, {2, 3, 7}, 1}}, b_unary, KA(1), 0, NULL},
    {"gelu", 1, {IN3(2, 3, 7)}, b_unary, KA(2), 0, NULL},
    {"tanh", 1, {IN3(2, 3, 7)}, b_unary, KA(3), 0, NULL},
    {"sigmoid", 1, {IN3(2, 3, 7)}, b_unary, KA(4), 0, NULL},
    {"abs", 1, {{3, {2, 3, 7}, 1}}, b_unary, KA(5), 0, NULL},
    {"gelu_erf", 1, {IN3(2, 3, 7)}, b_unary, KA(6), 0, NULL},
    {"silu", 1, {IN3(2, 3, 7)}, b_unary, KA(7), 0, NULL},
    {"exp", 1, {IN3(2, 3, 7)}, b_unary, KA(8), 0, NULL},
    {"log", 1, {{3, {2, 3, 7}, 3}}, b_unary, KA(9), 0, NULL},
    {"sqrt", 1, {{3, {2, 3, 7}, 3}}, b_unary, KA(10), 0, NULL},
    {"pow 2.5", 1, {{3, {2, 3, 7}, 3}}, b_unary, KA(11), 0, NULL},
    {"pow 3 of both signs", 1, {IN3(2, 3, 7)}, b_unary, KA(12), 0, NULL},
    {"clamp", 1, {{2, {5, 8}, 2}}, b_unary, KA(13), 0, NULL},
    {"clamp, open below", 1, {{2, {5, 8}, 2}}, b_unary, KA(14), 0, NULL},
    {"leaky_relu", 1, {{3, {2, 3, 7}, 1}}, b_unary, KA(15), 0, NULL},
    {"softplus beta 2, threshold 1.05", 1, {{2, {5, 8}, 2}}, b_unary, KA(16), 0, NULL},
    {"softplus", 1, {IN3(2, 3, 7)}, b_unary, KA(17), 0, NULL},
    {"maximum", 2, {{2, {5, 8}, 2}, {2, {5, 8}, 4}}, b_pick, KA(0), 0, NULL},
    {"minimum", 2, {{2, {5, 8}, 2}, {2, {5, 8}, 4}}, b_pick, KA(1), 0, NULL},
    {"maximum broadcast", 2, {{3, {3, 1, 4}, 2}, {2, {2, 4}, 4}}, b_pick, KA(0), 0, NULL},   /* -> (3, 2, 4) */
    {"minimum broadcast", 2, {{2, {4, 1}, 4}, {2, {4, 6}, 2}}, b_pick, KA(1), 0, NULL},
    {"batch norm, training, (N, C, H, W)", 3, {IN4(3, 4, 2, 3), IN1(4), IN1(4)}, b_batchnorm, KA(0), 0, NULL},
    {"batch norm, training, (N, C), no affine", 1, {IN2(6, 5)}, b_batchnorm, KA(1), 0, NULL},
    {"batch norm, evaluation, (N, C, L)", 3, {IN3(3, 4, 5), IN1(4), IN1(4)}, b_batchnorm, KA(2), 0, NULL},
    {"batch norm, training, 2 x 3 x 300 positions (blocks of 512 threads)", 3, {IN3(2, 3, 300), IN1(3), IN1(3)}, b_batchnorm,
     KA(0), 1, NULL},
    {"group norm, 3 groups", 3, {IN4(2, 6, 2, 3), IN1(6), IN1(6)}, b_groupnorm, K0, 0, NULL},
    {"lstm over 3 steps", 4, {IN3(2, 3, 3), IN2(8, 3), IN2(8, 2), IN1(8)}, b_rnn, KA(1), 0, NULL},
    {"gru over 3 steps", 4, {IN3(2, 3, 3), IN2(6, 3), IN2(6, 2), IN1(6)}, b_rnn, KA(0), 0, NULL},
    {"lstm over rows of 3 and 1 steps (padding)", 4, {IN3(2, 3, 3), IN2(8, 3), IN2(8, 2), IN1(8)}, b_rnn, KA(2), 0, NULL},
    {"gru over rows of 3 and 1 steps (padding)", 4, {IN3(2, 3, 3), IN2(6, 3), IN2(6, 2), IN1(6)}, b_rnn, KA(3), 0, NULL},
    {"lstm in reverse over rows of 3 and 1 steps", 4, {IN3(2, 3, 3), IN2(8, 3), IN2(8, 2), IN1(8)}, b_rnn, KA(4), 0, NULL},
    {"gru in reverse", 4, {IN3(2, 3, 3), IN2(6, 3), IN2(6, 2), IN1(6)}, b_rnn, KA(5), 0, NULL},
    {"lstm sequence with h0, c0 and every step's h and c", 5, {IN3(4, 3, 8), IN2(8, 2), IN1(8), IN2(3, 2), IN2(3, 2)}, b_lstm_seq,
     KA(1), 0, NULL},
    {"lstm sequence without bias or state", 2, {IN3(3, 2, 8), IN2(8, 2)}, b_lstm_seq, KA(0), 0, NULL},
    {"gru sequence with h0", 4, {IN3(4, 3, 6), IN2(6, 2), IN1(6), IN2(3, 2)}, b_lstm_seq, KA(4), 0, NULL},
    {"gru sequence without bias or state", 2, {IN3(3, 2, 6), IN2(6, 2)}, b_lstm_seq, KA(3), 0, NULL},
    {"lstm cell: one layer step from h and c", 6, {IN2(3, 3), IN2(8, 3), IN2(8, 2), IN1(8), IN2(3, 2), IN2(3, 2)}, b_lstm_seq, KA(2), 0,
     NULL},
    {"bce_with_logits", 2, {IN3(2, 3, 5), IN3(2, 3, 5)}, b_loss, KA(0), 0, NULL},
    {"huber_loss, delta 0.3", 2, {IN3(2, 3, 5), IN3(2, 3, 5)}, b_loss, KA(1), 0, NULL},
    {"gelu of a permuted view", 1, {IN3(2, 3, 4)}, b_unary_view, K0, 0, NULL},
    {"matmul 2-D", 2, {IN2(5, 7), IN2(7, 3)}, b_matmul, K0, 0, NULL},
    {"matmul batched, shared b", 2, {IN4(2, 3, 4, 5), IN2(5, 6)}, b_matmul, K0, 0, NULL},
    {"matmul broadcast batch", 2, {IN4(2, 1, 3, 4), IN3(3, 4, 2)}, b_matmul, K0, 0, NULL},
    {"matmul of transposed views", 2, {IN3(2, 6, 4), IN3(2, 5, 6)}, b_matmul_t, K0, 0, NULL},
    {"linear with bias", 3, {IN3(2, 3, 6), IN2(4, 6), IN1(4)}, b_linear, KA(1), 0, NULL},
    {"linear without bias", 2, {IN3(2, 3, 6), IN2(4, 6)}, b_linear, KA(0), 0, NULL},
    {"softmax", 1, {IN3(2, 5, 5)}, b_softmax, KA(0), 0, NULL},
    {"log_softmax", 1, {IN3(2, 5, 5)}, b_softmax, KA(1), 0, NULL},
    {"softmax_causal", 1, {IN3(2, 5, 5)}, b_softmax, KA(2), 0, NULL},
    {"cross_entropy", 1, {IN2(6, 5)}, b_xent, K0, 0, NULL},
    {"upsample nearest by (2, 3)", 1, {IN4(2, 3, 2, 3)}, b_upsample, KA(0), 0, NULL},
    {"upsample nearest by (1, 2)", 1, {IN4(1, 2, 3, 4)}, b_upsample, KA(1), 0, NULL},
    {"gather along axis 1 with repeats", 1, {IN3(2, 5, 3)}, b_gather, KA(0), 0, NULL},
    {"gather the taken actions (last axis)", 1, {IN2(4, 6)}, b_gather, KA(1), 0, NULL},
    {"gather along axis 0", 1, {IN2(3, 4)}, b_gather, KA(2), 0, NULL},
    {"max over axis 1", 1, {{3, {3, 5, 4}, 2}}, b_max, KA(0), 0, NULL},
    {"min over axis 1", 1, {{3, {3, 5, 4}, 2}}, b_max, KA(1), 0, NULL},
    {"max over the last axis, kept", 1, {{3, {3, 5, 4}, 2}}, b_max, KA(2), 0, NULL},
    {"cross_entropy against each row's argmax", 1, {{2, {4, 6}, 2}}, b_argmax, KA(0), 0, NULL},
    {"cross_entropy against each row's argmin", 1, {{2, {4, 6}, 2}}, b_argmax, KA(1), 0, NULL},
    {"cross_entropy ignoring 2 rows, label smoothing 0.1", 1, {IN2(6, 5)}, b_xent_ex, KA(0), 0, NULL},
    {"cross_entropy ignoring 2 rows, sum", 1, {IN2(6, 5)}, b_xent_ex, KA(1), 0, NULL},
    {"cross_entropy ignoring 2 rows, each row's loss", 1, {IN3(2, 3, 5)}, b_xent_ex, KA(2), 0, NULL},
    {"mse", 2, {IN3(2, 3, 4), IN3(2, 3, 4)}, b_mse, K0, 0, NULL},
    {"sum axis 1", 1, {IN3(3, 4, 5)}, b_reduce, KA(0), 0, NULL},
    {"mean axis -1 keepdim", 1, {IN3(3, 4, 5)}, b_reduce, KA(1), 0, NULL},
    {"sum axis 0 keepdim", 1, {IN3(3, 4, 5)}, b_reduce, KA(2), 0, NULL},
    {"sum_all", 1, {IN3(3, 4, 5)}, b_reduce, KA(3), 0, NULL},
    {"mean_all", 1, {IN3(3, 4, 5)}, b_reduce, KA(4), 0, NULL},
    {"mean over a transposed view", 1, {IN3(3, 4, 5)}, b_reduce, KA(5), 0, NULL},
    {"embedding", 1, {IN2(5, 4)}, b_embedding, K0, 0, NULL},
    {"embedding, 1000 ids over 2 rows", 1, {IN2(2, 5)}, b_embedding_many, K0, 1, NULL},
    {"layernorm affine", 3, {IN3(2, 3, 8), IN1(8), IN1(8)}, b_layernorm, KA(1), 0, NULL},
    {"layernorm plain", 1, {IN3(2, 3, 8)}, b_layernorm, KA(0), 0, NULL},
    {"rmsnorm with weight", 2, {IN3(2, 3, 8), IN1(8)}, b_rmsnorm, KA(1), 0, NULL},
    {"rmsnorm plain", 1, {IN3(2, 3, 8)}, b_rmsnorm, KA(0), 0, NULL},
    {"rope, rotate_half, 2 heads", 1, {IN3(2, 5, 8)}, b_rope, {2, 0, 0}, 0, NULL},
    {"rope, interleaved, 1 head", 1, {IN3(2, 5, 8)}, b_rope, {1, 1, 0}, 0, NULL},
    {"rope of the q slice of a qkv", 1, {IN3(2, 4, 12)}, b_rope, {2, 0, 1}, 0, NULL},
    {"rope, 300 positions, 2 heads of 64", 1, {IN3(2, 300, 128)}, b_rope, {2, 0, 0}, 2, NULL},
    {"rope from position 7, 2 heads", 1, {IN3(2, 3, 8)}, b_rope_at, {2, 0, 7}, 0, NULL},
    {"rope from position 1000, interleaved, 2 heads of 64", 1, {IN3(1, 2, 128)}, b_rope_at, {2, 1, 1000}, 0, NULL},
    {"rmsnorm with weight, rows of 200", 2, {IN2(3, 200), IN1(200)}, b_rmsnorm, KA(1), 0, NULL},
    {"dropout", 1, {IN2(6, 7)}, b_dropout, K0, 0, NULL},
    {"checkpoint (dropout inside)", 2, {IN2(3, 4), IN2(3, 4)}, b_checkpoint, K0, 0, NULL},
    {"conv2d stride 1 pad 1 bias", 3, {IN4(2, 3, 6, 5), IN4(4, 3, 3, 3), IN1(4)}, b_conv, {1, 1, 1}, 0, NULL},
    {"conv2d stride 2 pad 0", 2, {IN4(2, 3, 6, 5), IN4(4, 3, 3, 3)}, b_conv, {2, 0, 0}, 0, NULL},
    {"conv2d stride 2 pad 2 bias", 3, {IN4(2, 3, 6, 5), IN4(4, 3, 3, 3), IN1(4)}, b_conv, {2, 2, 1}, 0, NULL},
    {"conv2d stride (2, 1) pad (0, 2) dilation (2, 1) bias", 3, {IN4(2, 3, 7, 6), IN4(4, 3, 2, 3), IN1(4)}, b_conv_ex, {0, 1, 0}, 0,
     NULL},
    {"conv2d 2 groups, stride (1, 2), dilation (1, 2)", 2, {IN4(2, 4, 5, 7), IN4(6, 2, 3, 2)}, b_conv_ex, {1, 0, 0}, 0, NULL},
    {"conv2d depthwise stride 2 pad 1 bias", 3, {IN4(2, 3, 6, 5), IN4(3, 1, 3, 3), IN1(3)}, b_conv_ex, {2, 1, 0}, 0, NULL},
    {"conv2d depthwise, dilation (1, 2), pad (1, 2), bias", 3, {IN4(2, 4, 5, 6), IN4(4, 1, 3, 3), IN1(4)}, b_conv_ex, {3, 1, 0}, 0,
     NULL},
    {"conv2d 2 groups, 12 outputs of 4 columns, bias", 3, {IN4(2, 4, 3, 4), IN4(12, 2, 1, 2), IN1(12)}, b_conv_ex, {4, 1, 0}, 0, NULL},
    {"conv1d dilation 2, 2 groups, pad 2, bias", 3, {IN3(2, 4, 9), IN3(6, 2, 3), IN1(6)}, b_conv_ex, {5, 1, 0}, 0, NULL},
    {"conv1d stride 2", 2, {IN3(2, 3, 8), IN3(4, 3, 3)}, b_conv_ex, {6, 0, 0}, 0, NULL},
    {"conv_transpose2d stride 2 pad 1 output padding 1 bias", 3, {IN4(2, 3, 4, 3), IN4(3, 4, 3, 3), IN1(4)}, b_convt, {0, 1, 0}, 0,
     NULL},
    {"conv_transpose2d 2 groups, stride (1, 2), dilation (2, 1)", 2, {IN4(2, 4, 3, 4), IN4(4, 3, 2, 3)}, b_convt, {1, 0, 0}, 0, NULL},
    {"conv_transpose2d 6 inputs, 1 x 2 kernel, bias", 3, {IN4(2, 6, 3, 3), IN4(6, 1, 1, 2), IN1(1)}, b_convt, {2, 1, 0}, 0, NULL},
    {"maxpool 2", 1, {{4, {2, 2, 6, 7}, 2}}, b_pool, KA(0), 0, NULL},
    {"maxpool 3 stride 2 pad 1", 1, {{4, {2, 2, 6, 7}, 2}}, b_pool, KA(1), 0, NULL},
    {"avgpool 2", 1, {IN4(2, 2, 6, 7)}, b_pool, KA(2), 0, NULL},
    {"avgpool 3 stride 1 pad 1", 1, {IN4(2, 2, 6, 7)}, b_pool, KA(3), 0, NULL},
    {"maxpool1d 3 stride 2 pad 1", 1, {{3, {2, 3, 9}, 2}}, b_pool, KA(4), 0, NULL},
    {"avgpool1d 4 stride 3 pad 2", 1, {IN3(2, 3, 10)}, b_pool, KA(5), 0, NULL},
    {"causal self-attention", 3, {IN3(2, 5, 6), IN3(2, 5, 6), IN3(2, 5, 6)}, b_attention, K0, 0, NULL},
    {"causal self-attention, two tiles of queries", 3, {IN3(1, 40, 4), IN3(1, 40, 4), IN3(1, 40, 4)}, b_attention, K0, 0, NULL},
    /* more rows than a GPU tile (256): the backend parity check only (too long to difference) */
    {"causal self-attention, two GPU tiles", 3, {IN3(2, 300, 8), IN3(2, 300, 8), IN3(2, 300, 8)}, b_attention, K0, 1, NULL},
    /* head width 64 over 150 rows: with 16-bit activations and products, CUDA's fused forward
       (three blocks of 64 query rows, the last partial, up to three steps of 64 keys) */
    {"causal self-attention, head width 64", 3, {IN3(1, 150, 128), IN3(1, 150, 128), IN3(1, 150, 128)}, b_attention, K0, 1, NULL},
    /* the fused kernels' other head widths (their tiles' strides and shared memory differ) */
    {"causal self-attention, head width 32", 3, {IN3(1, 150, 64), IN3(1, 150, 64), IN3(1, 150, 64)}, b_attention, K0, 1, NULL},
    {"causal self-attention, head width 96", 3, {IN3(1, 90, 192), IN3(1, 90, 192), IN3(1, 90, 192)}, b_attention, K0, 1, NULL},
    {"causal self-attention, head width 128", 3, {IN3(1, 150, 256), IN3(1, 150, 256), IN3(1, 150, 256)}, b_attention, K0, 1, NULL},
    {"causal self-attention on slices of one qkv", 1, {IN3(2, 7, 12)}, b_attention_views, KA(0), 0, NULL},
    {"causal self-attention on a slice and a transpose", 3, {IN3(2, 7, 4), IN3(2, 7, 8), IN3(2, 4, 7)}, b_attention_views, KA(1), 0,
     NULL},
    /* the fused kernels on slices (rows 3C apart; head width 64) */
    {"causal self-attention on slices of one qkv, head width 64", 1, {IN3(1, 150, 384)}, b_attention_views, KA(0), 1, NULL},
    {"attention, not causal", 3, {IN3(2, 5, 6), IN3(2, 5, 6), IN3(2, 5, 6)}, b_attention_ex, {0, 0, 0}, 0, NULL},
    {"causal attention, 3 heads, scale 0.3", 3, {IN3(2, 5, 6), IN3(2, 5, 6), IN3(2, 5, 6)}, b_attention_ex, {1, 3, 30}, 0, NULL},
    {"cross-attention, 4 queries, 7 keys", 3, {IN3(2, 4, 6), IN3(2, 7, 6), IN3(2, 7, 6)}, b_attention_ex, {0, 0, 0}, 0, NULL},
    {"cross-attention, 40 queries (two tiles), 3 keys", 3, {IN3(1, 40, 4), IN3(1, 3, 4), IN3(1, 3, 4)}, b_attention_ex, {0, 1, 0}, 0,
     NULL},
    /* the GPU's tiled kernels over two tiles of 256 queries, and the fused ones (head width 64):
       fewer keys than queries and more, with blocks of 64 partial on both sides */
    {"cross-attention, 300 queries, 70 keys", 3, {IN3(2, 300, 8), IN3(2, 70, 8), IN3(2, 70, 8)}, b_attention_ex, {0, 0, 0}, 2, NULL},
    {"attention, not causal, head width 64", 3, {IN3(1, 100, 128), IN3(1, 100, 128), IN3(1, 100, 128)}, b_attention_ex, {0, 0, 0}, 2,
     NULL},
    {"cross-attention, head width 64, 70 queries, 150 keys", 3, {IN3(1, 70, 128), IN3(1, 150, 128), IN3(1, 150, 128)}, b_attention_ex,
     {0, 0, 0}, 2, NULL},
    {"cross-attention, head width 32, 100 queries, 40 keys, scale 0.5", 3, {IN3(1, 100, 64), IN3(1, 40, 64), IN3(1, 40, 64)},
     b_attention_ex, {0, 0, 50}, 2, NULL},
    {"causal attention, head width 128, scale 0.05", 3, {IN3(1, 80, 256), IN3(1, 80, 256), IN3(1, 80, 256)}, b_attention_ex,
     {1, 0, 5}, 2, NULL},
    /* grouped-query heads: 2 q heads a kv head, multi-query (one kv head), and on the GPU's fused
       (head width 64) and tiled kernels */
    {"grouped-query attention, 4 heads, 2 kv heads", 3, {IN3(2, 5, 8), IN3(2, 5, 4), IN3(2, 5, 4)}, b_attention_gqa, {0, 4, 2}, 0, NULL},
    {"causal multi-query attention, 4 heads, 1 kv head", 3, {IN3(2, 6, 8), IN3(2, 6, 2), IN3(2, 6, 2)}, b_attention_gqa, {1, 4, 1}, 0,
     NULL},
    {"causal grouped-query attention, head width 64, 4 heads, 2 kv heads", 3, {IN3(1, 100, 256), IN3(1, 100, 128), IN3(1, 100, 128)},
     b_attention_gqa, {1, 4, 2}, 2, NULL},
    {"cross multi-query attention, head width 64, 70 queries, 130 keys", 3, {IN3(1, 70, 256), IN3(1, 130, 64), IN3(1, 130, 64)},
     b_attention_gqa, {0, 4, 1}, 2, NULL},
    {"grouped-query attention, 300 queries, 6 heads, 3 kv heads", 3, {IN3(2, 300, 12), IN3(2, 300, 6), IN3(2, 300, 6)}, b_attention_gqa,
     {1, 6, 3}, 2, NULL},
    /* key lengths (padding masked): not causal, causal, cross over two tiles; then the GPU's
       fused kernels (a length inside a block of 64, one at a block's end, causal) and tiled ones
       (a length of 1) */
    {"attention, key lengths 3 and 5", 3, {IN3(2, 5, 6), IN3(2, 5, 6), IN3(2, 5, 6)}, b_attention_lens, {0, 0, 0}, 0, NULL},
    {"causal attention, key lengths 2 and 5", 3, {IN3(2, 5, 6), IN3(2, 5, 6), IN3(2, 5, 6)}, b_attention_lens, {1, 1, 0}, 0, NULL},
    {"cross-attention, 40 queries, key length 6 of 9", 3, {IN3(1, 40, 4), IN3(1, 9, 4), IN3(1, 9, 4)}, b_attention_lens, {0, 2, 0}, 0, NULL},
    {"attention, head width 64, key lengths 100 and 37", 3, {IN3(2, 100, 128), IN3(2, 100, 128), IN3(2, 100, 128)}, b_attention_lens,
     {0, 3, 0}, 2, NULL},
    {"causal attention, head width 64, key lengths 70 and 3", 3, {IN3(2, 100, 128), IN3(2, 100, 128), IN3(2, 100, 128)},
     b_attention_lens, {1, 4, 0}, 2, NULL},
    {"cross-attention, head width 32, 70 queries, key lengths 130 and 64 of 140", 3, {IN3(2, 70, 64), IN3(2, 140, 64), IN3(2, 140, 64)},
     b_attention_lens, {0, 5, 0}, 2, NULL},
    {"cross-attention, 300 queries, key lengths 70 and 1 of 70", 3, {IN3(2, 300, 8), IN3(2, 70, 8), IN3(2, 70, 8)}, b_attention_lens, {0, 6, 0},
     2, NULL},
    /* dropout on the weights (its mask drawn again in backward): small ones with finite
       differences (grouped-query heads, a share of a wider layer's mask), then the GPU's tiled
       kernels over two tiles of queries, and its fused ones (head widths 64 and 32: causal, cross
       with a share of a wider mask, grouped-query) */
    {"attention, dropout 0.3", 3, {IN3(2, 5, 6), IN3(2, 5, 6), IN3(2, 5, 6)}, b_attention_drop, {0, 0, 0}, 0, NULL},
    {"causal attention, dropout 0.3, heads 3 and 4 of a mask of 6", 3, {IN3(2, 5, 6), IN3(2, 5, 6), IN3(2, 5, 6)}, b_attention_drop,
     {1, 0, 4}, 0, NULL},
    {"causal grouped-query attention, dropout 0.3, 4 heads, 2 kv heads", 3, {IN3(2, 6, 8), IN3(2, 6, 4), IN3(2, 6, 4)},
     b_attention_drop, {1, 2, 0}, 0, NULL},
    {"cross-attention, dropout 0.3, 300 queries, 70 keys", 3, {IN3(2, 300, 8), IN3(2, 70, 8), IN3(2, 70, 8)}, b_attention_drop,
     {0, 0, 0}, 2, NULL},
    {"causal attention, dropout 0.3, head width 64", 3, {IN3(1, 100, 128), IN3(1, 100, 128), IN3(1, 100, 128)}, b_attention_drop,
     {1, 0, 0}, 2, NULL},
    {"cross-attention, dropout 0.3, head width 64, 70 queries, 150 keys, heads 2 and 3 of a mask of 6", 3,
     {IN3(2, 70, 128), IN3(2, 150, 128), IN3(2, 150, 128)}, b_attention_drop, {0, 0, 3}, 2, NULL},
    {"causal grouped-query attention, dropout 0.3, head width 32, 4 heads, 2 kv heads", 3,
     {IN3(1, 100, 128), IN3(1, 100, 64), IN3(1, 100, 64)}, b_attention_drop, {1, 2, 0}, 2, NULL},
    /* queries from a key position on (KV-cache steps): small ones with finite differences (a
       decoding step of one query among them), two CPU tiles; then the GPU's fused kernels (key
       blocks past the queries' reach, a decoding step, grouped-query) and tiled ones (head width 4) */
    {"causal attention, 3 queries from key 4 of 9", 3, {IN3(2, 3, 6), IN3(2, 9, 6), IN3(2, 9, 6)}, b_attention_at, {4, 0, 0}, 0, NULL},
    {"causal attention, 1 query at key 6 of 7", 3, {IN3(2, 1, 6), IN3(2, 7, 6), IN3(2, 7, 6)}, b_attention_at, {6, 3, 0}, 0, NULL},
    {"causal attention, 40 queries from key 5 of 50", 3, {IN3(1, 40, 4), IN3(1, 50, 4), IN3(1, 50, 4)}, b_attention_at, {5, 1, 0}, 0,
     NULL},
    {"causal attention, head width 64, 70 queries from key 90 of 200", 3, {IN3(1, 70, 128), IN3(1, 200, 128), IN3(1, 200, 128)},
     b_attention_at, {90, 2, 0}, 2, NULL},
    {"causal attention, head width 64, 1 query at key 130 of 160", 3, {IN3(2, 1, 128), IN3(2, 160, 128), IN3(2, 160, 128)},
     b_attention_at, {130, 2, 0}, 2, NULL},
    {"causal grouped-query attention, head width 32, 50 queries from key 77 of 140", 3, {IN3(1, 50, 128), IN3(1, 140, 64),
     IN3(1, 140, 64)}, b_attention_at, {77, 4, 2}, 2, NULL},
    {"causal attention, 300 queries from key 20 of 330", 3, {IN3(2, 300, 8), IN3(2, 330, 8), IN3(2, 330, 8)}, b_attention_at,
     {20, 2, 0}, 2, NULL},
    {"reshape", 1, {IN2(6, 4)}, b_views, KA(0), 0, NULL},
    {"permute + contiguous", 1, {IN2(6, 4)}, b_views, KA(1), 0, NULL},
    {"slice", 1, {IN2(6, 4)}, b_views, KA(2), 0, NULL},
    {"concat", 2, {IN2(6, 4), IN2(2, 4)}, b_views, KA(3), 0, NULL},
    {"reshape of a transposed view", 1, {IN2(6, 4)}, b_views, KA(4), 0, NULL},
    {"gpt block (input gradient)", 1, {IN3(2, 4, 8)}, b_gpt, K0, 0, &gpt_hooks},
    {"llama block (input gradient)", 1, {IN3(2, 4, 8)}, b_gpt, KA(1), 0, &gpt_hooks},
    {"cast f32 -> bf16 -> f32", 1, {IN2(3, 4)}, b_cast, K0, 1, NULL},
    {"tp_copy (1 rank)", 1, {IN2(3, 4)}, b_tp, KA(0), 0, NULL},
    {"tp_reduce (1 rank)", 1, {IN2(3, 4)}, b_tp, KA(1), 0, NULL},
    {"tp_gather (1 rank)", 1, {IN2(3, 4)}, b_tp, KA(2), 0, NULL},
    {"vocab_cross_entropy (1 rank)", 1, {IN2(6, 5)}, b_vxent, K0, 0, NULL},
    {"vocab_cross_entropy, an ignored row, smoothing 0.2, summed", 1, {IN2(6, 5)}, b_vxent, KA(1), 0, NULL},
    {"vocab_cross_entropy, ignore_index 7, per-row losses", 1, {IN2(6, 5)}, b_vxent, KA(2), 0, NULL},
};
#define N_CASES ((int)(sizeof(CASES) / sizeof(CASES[0])))

static void test_gradients(void) {
    int i;
    for (i = 0; i < N_CASES; i++) {
        const op_case *c = &CASES[i];
        if (c->no_fd) continue;
        g_setup = c->hooks ? c->hooks->setup : NULL;
        g_teardown = c->hooks ? c->hooks->teardown : NULL;
        gradcheck(c->name, c->nin, c->in, c->fn, (void *)c->arg);
    }
    g_setup = NULL;
    g_teardown = NULL;
}

/* ---- backend parity ---- */

typedef struct run_result {
    int ok;
    dtr_dtype out_dtype;
    int out_op;          /* the op that made the output */
    int64_t n_out, n_grad;
    float *out, *grad;   /* the output, then every input's gradient, concatenated */
} run_result;

/* One forward and backward of a case on ctx, with the loss sum(out * R), R = 0.5 + out index / n. */
static run_result run_case(dtr_context *ctx, const op_case *c) {
    run_result r = {0, DTR_F32, 0, 0, 0, NULL, NULL};
    dtr_tensor *leaves[MAXIN], *out, *loss, *Rt;
    float *data[MAXIN], *R;
    dtr_rng rng;
    int64_t n[MAXIN], k;
    int i;
    dtr_rng_seed(&rng, 99, 3);
    if (c->hooks) c->hooks->setup(ctx);
    for (i = 0; i < c->nin; i++) {
        n[i] = dtr__numel(c->in[i].ndim, c->in[i].shape);
        data[i] = malloc((size_t)(n[i] ? n[i] : 1) * sizeof(float));
        gc_fill(data[i], n[i], c->in[i].kind, &rng);
        r.n_grad += n[i];
    }
    out = gc_forward(ctx, c->nin, c->in, data, c->fn, (void *)c->arg, 1, leaves);
    mark_covered(ctx);
    if (out) {
        r.out_dtype = dtr_tensor_dtype(out);
        r.out_op = out->node ? out->node->op : 0;
        r.n_out = dtr_tensor_numel(out);
        R = malloc((size_t)(r.n_out ? r.n_out : 1) * sizeof(float));
        for (k = 0; k < r.n_out; k++) R[k] = 0.5f + (float)k / (float)r.n_out;
        Rt = dtr_tensor_from(ctx, DTR_F32, out->ndim, out->shape, R);
        loss = dtr_sum_all(ctx, dtr_mul(ctx, dtr_cast(ctx, out, DTR_F32), Rt));
        r.out = malloc((size_t)(r.n_out + r.n_grad + 1) * sizeof(float));
        r.grad = r.out + r.n_out;
        r.ok = dtr_tensor_read(out, DTR_F32, r.out, (size_t)r.n_out) == DTR_OK && dtr_backward(ctx, loss) == DTR_OK;
        for (i = 0, k = 0; r.ok && i < c->nin; k += n[i], i++) {
            if (dtr_tensor_grad(leaves[i])) r.ok = dtr_tensor_read_grad(leaves[i], r.grad + k, (size_t)n[i]) == DTR_OK;
            else memset(r.grad + k, 0, (size_t)n[i] * sizeof(float));
        }
        free(R);
    }
    for (i = 0; i < c->nin; i++) free(data[i]);
    if (c->hooks) c->hooks->teardown();
    return r;
}

/* Largest |a - b| / (1 + |a|) over the output and gradients. */
static double max_rel_diff(const run_result *a, const run_result *b) {
    int64_t k, total = a->n_out + a->n_grad;
    double worst = 0.0;
    for (k = 0; k < total; k++) {
        double d = fabs((double)a->out[k] - b->out[k]) / (1.0 + fabs((double)a->out[k]));
        if (d > worst || d != d) worst = d != d ? 1e30 : d;
    }
    return worst;
}

static int g_quick;   /* DTR_TEST_QUICK: large device cases (no_fd 2) in f32 only */

static void parity_on(dtr_context *other, const char *backend, double tol) {
    int i, skipped = 0;
    for (i = 0; i < N_CASES; i++) {
        dtr_context *ref;
        run_result a, b;
        if (g_quick && CASES[i].no_fd == 2 && tol > 2e-4) continue;
        ref = test_ctx(1);
        other->rng = ref->rng;   /* dropout draws from the context's stream: the same draws on both */
        a = run_case(ref, &CASES[i]);
        b = run_case(other, &CASES[i]);
        if (!b.ok && dtr_context_status(other) == DTR_UNSUPPORTED) {   /* no kernel yet: said loudly, not failed */
            printf("*** %s on %s: SKIPPED (%s) ***\n", CASES[i].name, backend, dtr_context_last_error(other));
            skipped++;
            b.ok = a.ok;
            free(a.out);
            free(b.out);
            dtr_context_destroy(ref);
            dtr_context_clear_error(other);
            dtr_context_reset(other);
            continue;
        }
        CHECK_MSG(a.ok && b.ok, "%s on %s: the case did not run: %s / %s", CASES[i].name, backend,
                  dtr_context_last_error(ref), dtr_context_last_error(other));
        if (a.ok && b.ok) {
            double d = max_rel_diff(&a, &b);
            CHECK_MSG(a.n_out == b.n_out && d <= tol, "%s on %s: differs from the CPU by %.3g (tolerance %.3g)",
                      CASES[i].name, backend, d, tol);
        }
        free(a.out);
        free(b.out);
        dtr_context_destroy(ref);
        dtr_context_reset(other);
    }
    if (skipped) printf("*** %s: %d of %d cases SKIPPED (no kernel) ***\n", backend, skipped, N_CASES);
}

/* one cross-entropy over (3, 50257) logits with its gradient, and a softmax over (3, 1000): the
   loss, the probabilities and the logits' gradient into out (3 * 50257 + 3 * 1000 + 1 floats) */
static void big_softmaxes(float *out) {
    static const int64_t sx[2] = {3, 50257}, ss[2] = {3, 1000}, st[1] = {3};
    static float x[3 * 50257];
    int32_t t[3] = {7, 50000, 123};
    dtr_context *ctx = test_ctx(2);
    dtr_tensor *lx, *l, *p;
    int64_t i;
    for (i = 0; i < 3 * 50257; i++) x[i] = (float)((i * 7919) % 20011) / 1000.0f - 10.0f;
    lx = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, sx, x));
    l = dtr_cross_entropy(ctx, lx, dtr_tensor_from(ctx, DTR_I32, 1, st, t));
    p = dtr_softmax(ctx, dtr_tensor_from(ctx, DTR_F32, 2, ss, x));
    CHECK(l && p && dtr_backward(ctx, l) == DTR_OK);
    if (l && p) {
        CHECK(dtr_tensor_read(l, DTR_F32, out, 1) == DTR_OK && dtr_tensor_read(p, DTR_F32, out + 1, 3000) == DTR_OK &&
              dtr_tensor_read_grad(lx, out + 3001, 3 * 50257) == DTR_OK);
    }
    dtr_context_destroy(ctx);
}

/* an LSTM and a GRU of 37 units (blocks of 16 and a rest) over (2, 6, 5), and the activations
   over 1000 elements, with their gradients: outputs, then gradients of x, the weights and the
   activations' input into out (room for 20000 floats); returns how many */
static int64_t big_cells(float *out) {
    static const int64_t xs[3] = {2, 6, 5}, as[1] = {1000};
    static float xv[60], av[1000];
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_lstm_layer l;
    dtr_gru_layer g;
    dtr_tensor *x, *a, *y[8], *loss = NULL;
    float *o = out;
    int i, k;
    for (i = 0; i < 60; i++) xv[i] = (float)((i * 37) % 61) / 20.0f - 1.5f;
    for (i = 0; i < 1000; i++) av[i] = (float)((i * 7919) % 2003) / 100.0f - 10.0f;
    CHECK_OK(ctx, dtr_model_create(ctx, 3, &m));
    CHECK_OK(ctx, dtr_lstm_layer_init(&l, m, "l", 5, 37));
    CHECK_OK(ctx, dtr_gru_layer_init(&g, m, "g", 5, 37));
    CHECK_OK(ctx, dtr_model_build(m));
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, xs, xv));
    a = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, as, av));
    y[0] = dtr_lstm_layer_forward(ctx, &l, x, NULL, NULL, NULL, NULL), y[1] = dtr_gru_layer_forward(ctx, &g, x, NULL, NULL);
    y[2] = dtr_gelu(ctx, a), y[3] = dtr_tanh(ctx, a), y[4] = dtr_sigmoid(ctx, a), y[5] = dtr_gelu_erf(ctx, a);
    y[6] = dtr_silu(ctx, a), y[7] = dtr_softplus(ctx, a, 1.0f, 20.0f);
    for (k = 0; k < 8; k++) loss = k ? dtr_add(ctx, loss, dtr_sum_all(ctx, y[k])) : dtr_sum_all(ctx, y[k]);
    CHECK_MSG(loss && dtr_backward(ctx, loss) == DTR_OK && dtr_model_numel(m) >= 7 * 37 * 44 && dtr_model_numel(m) < 12000, "%s (%lld)",
              dtr_context_last_error(ctx), (long long)dtr_model_numel(m));
    if (loss && dtr_model_numel(m) < 12000) {
        for (k = 0; k < 2; k++, o += 444) CHECK(dtr_tensor_read(y[k], DTR_F32, o, 444) == DTR_OK);
        CHECK(dtr_tensor_read_grad(x, o, 60) == DTR_OK);
        o += 60;
        memcpy(o, dtr_model_grads(m), (size_t)dtr_model_numel(m) * sizeof(float)), o += dtr_model_numel(m);
        for (k = 2; k < 8; k++, o += 1000) CHECK(dtr_tensor_read(y[k], DTR_F32, o, 1000) == DTR_OK);
        CHECK(dtr_tensor_read_grad(a, o, 1000) == DTR_OK);
        o += 1000;
    }
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    return o - out;
}

/* The CPU's hot loops compiled for AVX2 and AVX-512 (src/core/platform.h: the activations, the
   recurrences' cells, exp sums, cross-entropy's gradient, the backend's sum of squares) give
   the generic loops' bits: every op case, and rows long enough for their blocks, each way. */
static void simd_level_vs_generic(int level) {
    static const char *const names[3] = {"generic", "AVX2", "AVX-512"};
    static float a[3 * 50257 + 3001], b[3 * 50257 + 3001];
    int64_t n;
    int i;
    for (i = 0; i < N_CASES; i++) {
        dtr_context *c1 = test_ctx(1), *c2 = test_ctx(1);
        run_result x, y;
        c2->rng = c1->rng;
        dtr__simd_force(0);
        x = run_case(c1, &CASES[i]);
        dtr__simd_force(level);
        y = run_case(c2, &CASES[i]);
        CHECK_MSG(x.ok == y.ok && (!x.ok || (x.n_out == y.n_out && max_rel_diff(&x, &y) == 0.0)), "%s: %s loops differ from the generic ones",
                  CASES[i].name, names[level]);
        free(x.out);
        free(y.out);
        dtr_context_destroy(c1);
        dtr_context_destroy(c2);
    }
    dtr__simd_force(0);
    big_softmaxes(a);
    dtr__simd_force(level);
    big_softmaxes(b);
    CHECK_MSG(memcmp(a, b, sizeof a) == 0, "cross-entropy / softmax over long rows: %s loops differ from the generic ones", names[level]);
    memset(a, 0, sizeof a), memset(b, 0xff, sizeof b);
    dtr__simd_force(0);
    n = big_cells(a);
    dtr__simd_force(level);
    CHECK(big_cells(b) == n && n > 19000);
    CHECK_MSG(memcmp(a, b, (size_t)n * sizeof(float)) == 0, "LSTM, GRU and activations over blocks: %s loops differ from the "
              "generic ones", names[level]);
    {   /* the backend's sum of squares (gradient norms: clipping, the optimizer's check) */
        dtr_context *c = test_ctx(1);
        double s0 = 0.0, s1 = 1.0;
        dtr__simd_force(0);
        CHECK_OK(c, c->backend->sumsq(c, a, (int64_t)(sizeof a / sizeof a[0]) - 3, &s0));
        dtr__simd_force(level);
        CHECK_OK(c, c->backend->sumsq(c, a, (int64_t)(sizeof a / sizeof a[0]) - 3, &s1));
        CHECK_MSG(memcmp(&s0, &s1, sizeof s0) == 0 && s0 > 0.0, "sum of squares: %s %.17g, generic %.17g", names[level], s1, s0);
        dtr_context_destroy(c);
    }
}

static void test_simd_variants(void) {
    int level, best = dtr__simd_level();
    if (best == 0) {
        printf("*** SIMD variants: this CPU (or DTRAIN_SIMD=generic) runs the generic loops only: SKIPPED ***\n");
        return;
    }
    if (best < 2) printf("*** SIMD variants: no AVX-512 here (or DTRAIN_SIMD=avx2): AVX2 against generic only ***\n");
    for (level = 1; level <= best; level++) {
        dtr__simd_force(level);
        CHECK_EQ_INT(dtr__simd_level(), level);
        simd_level_vs_generic(level);
    }
    dtr__simd_force(-1);
}

static void test_backend_parity(void) {
    dtr_context *cpu3 = test_ctx(3), *sim = NULL;
    dtr_context_config sc = dtr_context_config_init();
    parity_on(cpu3, "cpu (3 threads)", 0.0);   /* the CPU gives the same bits for any thread count */
    dtr_context_destroy(cpu3);
    /* the simulated device (tests/devsim.h): the CPU's kernels, so the same bits, over memory
       the core may touch only through the backend */
    sc.backend = devsim_backend();
    sc.threads = 1;
    CHECK(dtr_context_create(&sc, &sim) == DTR_OK);
    if (sim) parity_on(sim, "devsim", 0.0);
    dtr_context_destroy(sim);
    CHECK_EQ_INT(devsim__violations, 0);
#ifdef DTR_TEST_CUDA   /* make test-gpu: this program linked with dtrain_cuda.o */
    if (dtr_cuda_device_count() > 0) {
        dtr_context_config cc = dtr_context_config_init();
        dtr_context *gpu = NULL;
        cc.backend = dtr_cuda_backend();
        cc.seed = 11;
        CHECK_MSG(dtr_context_create(&cc, &gpu) == DTR_OK, "cuda context: %s", gpu ? dtr_context_last_error(gpu) : "?");
        if (gpu) parity_on(gpu, "cuda", 2e-4);
        dtr_context_destroy(gpu);
        /* TF32 products (10-bit mantissas, as fp16's): the GEMMs and the fused attention */
        cc.matmul_precision = DTR_MATMUL_TF32;
        CHECK(dtr_context_create(&cc, &gpu) == DTR_OK);
        if (gpu) parity_on(gpu, "cuda (tf32 products)", 1e-2);
        dtr_context_destroy(gpu);
        /* the products on 16-bit tensor cores (f32 sums): every case within the rounding of
           operands to 8 (bf16) or 11 (fp16) significant bits, against the CPU's f32 */
        cc.matmul_precision = DTR_MATMUL_BF16;
        CHECK(dtr_context_create(&cc, &gpu) == DTR_OK);
        if (gpu) parity_on(gpu, "cuda (bf16 products)", 5e-2);
        dtr_context_destroy(gpu);
        cc.matmul_precision = DTR_MATMUL_F16;
        CHECK(dtr_context_create(&cc, &gpu) == DTR_OK);
        if (gpu) parity_on(gpu, "cuda (fp16 products)", 1e-2);
        dtr_context_destroy(gpu);
        return;
    }
    printf("*** backend parity: built with CUDA but no GPU is visible: CUDA parity SKIPPED ***\n");
#else
    /* A device backend (dtr_cuda_backend() from dtrain_cuda.cu) joins here when this program is
       built with it (make test-gpu) and a device is present; this build has neither. */
    printf("*** backend parity: no device backend in this build (CUDA needs dtrain_cuda.cu and a GPU): "
           "CUDA parity SKIPPED; CPU (3 threads) against CPU (1 thread) checked ***\n");
#endif
}

/* ---- 16-bit activations (dtr_context_config.activation_dtype) ---- */

/* activations in dt; products in f32 (DTR_MATMUL_F32) or mp */
static dtr_context *narrow_ctx_mp(const dtr_backend *be, dtr_dtype dt, int threads, dtr_matmul_precision mp) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    cfg.backend = be;
    cfg.threads = threads;
    cfg.activation_dtype = dt;
    cfg.matmul_precision = mp;
    cfg.seed = 11;
    CHECK_MSG(dtr_context_create(&cfg, &ctx) == DTR_OK, "context with activation_dtype %s", dtr_dtype_name(dt));
    return ctx;
}
static dtr_context *narrow_ctx(const dtr_backend *be, dtr_dtype dt, int threads) {
    return narrow_ctx_mp(be, dt, threads, DTR_MATMUL_F32);
}

/* 1 when every value is one a tensor of dtype dt holds (stored in 16 bits, read back) */
static int representable(const float *x, int64_t n, dtr_dtype dt) {
    int64_t i;
    for (i = 0; i < n; i++) {
        float v = dt == DTR_BF16 ? dtr_bf16_to_f32(dtr_f32_to_bf16(x[i])) : dtr_f16_to_f32(dtr_f32_to_f16(x[i]));
        if (v != x[i] && !(v != v && x[i] != x[i])) return 0;
    }
    return 1;
}

/* the ops whose output is f32 whatever the activations' dtype: losses, whole sums */
static int f32_out(int op) {
    return op == DTR_OP_CROSS_ENTROPY || op == DTR_OP_MSE || op == DTR_OP_SUM_ALL || op == DTR_OP_MEAN_ALL ||
           op == DTR_OP_VOCAB_CROSS_ENTROPY;
}

/* Every case with its leaves cast to dt on a context computing in dt, against the f32 CPU:
   within tol; outputs stored in dt (their values dt's) but for losses and whole sums (f32)
   and the cast case's (f32, its last cast's). Returns the largest
   difference seen (0 only if nothing was rounded). */
static double narrow_against_f32(dtr_context *nar, const char *backend, dtr_dtype dt, double tol) {
    double worst = 0.0;
    int i, narrow_outs = 0;
    for (i = 0; i < N_CASES; i++) {
        dtr_context *ref = test_ctx(1);
        run_result a, b;
        nar->rng = ref->rng;
        a = run_case(ref, &CASES[i]);
        g_leaf_dtype = dt;
        b = run_case(nar, &CASES[i]);
        g_leaf_dtype = DTR_F32;
        CHECK_MSG(a.ok && b.ok, "%s on %s (%s activations): the case did not run: %s", CASES[i].name, backend,
                  dtr_dtype_name(dt), dtr_context_last_error(nar));
        if (a.ok && b.ok) {
            double d = max_rel_diff(&a, &b);
            dtr_dtype want = b.out_op == DTR_OP_CAST ? b.out_dtype : f32_out(b.out_op) ? DTR_F32 : dt;
            CHECK_MSG(d <= tol, "%s on %s (%s activations): differs from f32 by %.3g (tolerance %.3g)", CASES[i].name,
                      backend, dtr_dtype_name(dt), d, tol);
            CHECK_MSG(b.out_dtype == want, "%s: output %s, expected %s", CASES[i].name, dtr_dtype_name(b.out_dtype),
                      dtr_dtype_name(want));
            if (b.out_dtype == dt) {
                CHECK_MSG(representable(b.out, b.n_out, dt), "%s: output not rounded to %s", CASES[i].name, dtr_dtype_name(dt));
                narrow_outs++;
            }
            if (d > worst) worst = d;
        }
        free(a.out);
        free(b.out);
        dtr_context_destroy(ref);
        dtr_context_reset(nar);
    }
    printf("  %s, %s activations: %d of %d outputs in %s, largest difference from f32 %.3g\n", backend,
           dtr_dtype_name(dt), narrow_outs, N_CASES, dtr_dtype_name(dt), worst);
    CHECK(narrow_outs >= N_CASES / 2);
    return worst;
}

/* 16-bit parity's tolerance for case c on another backend (relative, |a - b| / (1 + |a|)).
   Without products the kernels run the CPU's formulas in f32 and round once: they differ only
   where a device function (expf, tanhf, erff) or a sum's order flips a rounding, so two units
   in the last place of dt (eps: 2^-7 bf16, 2^-10 fp16) bound them; so do products on f32
   operands (prod == 0). Products on 16-bit operands (prod: their context's tolerance, set by
   the convolutions, the worst) add the operands' rounding; attention's within 0.4 of it (a
   5% error in either fused backward kernel fails), but with key lengths within it (items that
   see 1 to 3 keys sum up to 300 rounded rows of dy into one key's dv: 2.0e-3 and 2.7e-3 with
   fp16 products through cuemu); exact (the CPU with threads, the simulated device): 0. */
static double narrow_tol(const op_case *c, dtr_dtype dt, int exact, double prod) {
    static const char *products[] = {"matmul", "linear", "conv2d", "gpt block", "llama block", "causal self-attention", "attention",
                                     "causal attention", "cross-attention"};
    double eps = dt == DTR_BF16 ? 1.0 / 128 : 1.0 / 1024;
    int i, is_product = 0;
    for (i = 0; i < (int)(sizeof products / sizeof products[0]); i++)
        is_product |= strncmp(c->name, products[i], strlen(products[i])) == 0;
    if (exact) return 0.0;
    if (!is_product || prod == 0.0) return 2 * eps;
    return strstr(c->name, "attention") && !strstr(c->name, "key length") ? prod * 0.4 : prod;
}

/* The same cases, 16-bit on another backend against 16-bit on the CPU (leaves cast too), each
   within narrow_tol. */
static void narrow_parity(dtr_context *other, const char *backend, dtr_dtype dt, int exact, double prod) {
    int i;
    for (i = 0; i < N_CASES; i++) {
        dtr_context *ref;
        double tol = narrow_tol(&CASES[i], dt, exact, prod);
        run_result a, b;
        if (g_quick && CASES[i].no_fd == 2 && !exact) continue;
        ref = narrow_ctx(NULL, dt, 1);
        other->rng = ref->rng;
        g_leaf_dtype = dt;
        a = run_case(ref, &CASES[i]);
        b = run_case(other, &CASES[i]);
        g_leaf_dtype = DTR_F32;
        CHECK_MSG(a.ok && b.ok, "%s on %s (%s activations): %s", CASES[i].name, backend, dtr_dtype_name(dt),
                  dtr_context_last_error(other));
        if (a.ok && b.ok)
            CHECK_MSG(a.n_out == b.n_out && max_rel_diff(&a, &b) <= tol, "%s on %s (%s activations): differs from the CPU by %.3g",
                      CASES[i].name, backend, dtr_dtype_name(dt), max_rel_diff(&a, &b));
        free(a.out);
        free(b.out);
        dtr_context_destroy(ref);
        dtr_context_reset(other);
    }
}

static void test_narrow_activations(void) {
    dtr_context *bf = narrow_ctx(NULL, DTR_BF16, 1), *hf = narrow_ctx(NULL, DTR_F16, 1), *sim;
    /* 8 (bf16) and 11 (fp16) significant bits at each op's output, through up to a dozen ops */
    CHECK(narrow_against_f32(bf, "cpu", DTR_BF16, 3e-2) > 1e-3);
    CHECK(narrow_against_f32(hf, "cpu", DTR_F16, 6e-3) > 1e-4);
    dtr_context_destroy(bf);
    dtr_context_destroy(hf);
    /* 3 threads: the same bits as 1 (the widened kernels are the f32 ones) */
    bf = narrow_ctx(NULL, DTR_BF16, 3);
    if (bf) narrow_parity(bf, "cpu (3 threads)", DTR_BF16, 1, 0.0);
    dtr_context_destroy(bf);
    /* the simulated device: the same kernels and conversions, through the backend's memory only */
    sim = narrow_ctx(devsim_backend(), DTR_BF16, 1);
    if (sim) narrow_parity(sim, "devsim", DTR_BF16, 1, 0.0);
    dtr_context_destroy(sim);
    CHECK_EQ_INT(devsim__violations, 0);
#ifdef DTR_TEST_CUDA
    if (dtr_cuda_device_count() > 0) {
        dtr_context *gpu = narrow_ctx(dtr_cuda_backend(), DTR_BF16, 1);
        if (gpu) narrow_parity(gpu, "cuda", DTR_BF16, 0, 0.0);   /* f32 products: roundings flipped at most */
        dtr_context_destroy(gpu);
        gpu = narrow_ctx(dtr_cuda_backend(), DTR_F16, 1);
        if (gpu) narrow_parity(gpu, "cuda", DTR_F16, 0, 0.0);
        dtr_context_destroy(gpu);
        /* 16-bit products on 16-bit activations (linear reads its operands as stored and rounds
           the f32 weight and output gradient to 16 bits): within the products' tolerances */
        gpu = narrow_ctx_mp(dtr_cuda_backend(), DTR_BF16, 1, DTR_MATMUL_BF16);
        if (gpu) narrow_parity(gpu, "cuda (bf16 products)", DTR_BF16, 0, 2.5e-2);
        dtr_context_destroy(gpu);
        gpu = narrow_ctx_mp(dtr_cuda_backend(), DTR_F16, 1, DTR_MATMUL_F16);
        if (gpu) narrow_parity(gpu, "cuda (fp16 products)", DTR_F16, 0, 4e-3);
        dtr_context_destroy(gpu);
        return;
    }
#endif
    printf("*** 16-bit activations: no GPU in this build or machine: CUDA parity SKIPPED ***\n");
}

/* Data errors a GPU kernel finds (an embedding id, an attention key length out of range) are
   the context's DTR_INVALID_ARGUMENT at the next synchronisation, naming the op and the row;
   the kernels read nothing out of range meanwhile (memcheck on the device). Then the context,
   its error cleared, runs the same op with good data. */
static void test_device_data_errors(void) {
#ifdef DTR_TEST_CUDA
    if (dtr_cuda_device_count() > 0) {
        dtr_context_config cc = dtr_context_config_init();
        dtr_context *gpu = NULL;
        int64_t sq[3] = {2, 70, 64}, two = 2, sw[2] = {5, 3};
        int32_t bad[2] = {70, 71}, ids[2] = {4, 5};
        static float qv[2 * 70 * 64], wv[15], out[2 * 70 * 64];
        dtr_attention_config ac = dtr_attention_config_init(2, 0);
        dtr_tensor *q, *y;
        cc.backend = dtr_cuda_backend();
        CHECK(dtr_context_create(&cc, &gpu) == DTR_OK);
        if (!gpu) return;
        q = dtr_tensor_from(gpu, DTR_F32, 3, sq, qv);
        ac.key_lengths = dtr_tensor_from(gpu, DTR_I32, 1, &two, bad);
        y = dtr_attention_ex(gpu, q, q, q, &ac);   /* runs: the length is found on the device */
        CHECK(y != NULL && dtr_tensor_read(y, DTR_F32, out, (size_t)(2 * 70 * 64)) == DTR_INVALID_ARGUMENT);
        CHECK_MSG(strstr(dtr_context_last_error(gpu), "attention: the key length of row 1") != NULL, "message: %s", dtr_context_last_error(gpu));
        dtr_context_clear_error(gpu);
        dtr_context_reset(gpu);
        y = dtr_embedding(gpu, dtr_tensor_from(gpu, DTR_F32, 2, sw, wv), dtr_tensor_from(gpu, DTR_I32, 1, &two, ids));
        CHECK(y != NULL && dtr_tensor_read(y, DTR_F32, out, 6) == DTR_INVALID_ARGUMENT);
        CHECK_MSG(strstr(dtr_context_last_error(gpu), "embedding: the id of row 1") != NULL, "message: %s", dtr_context_last_error(gpu));
        dtr_context_clear_error(gpu);
        dtr_context_reset(gpu);
        q = dtr_tensor_from(gpu, DTR_F32, 3, sq, qv);
        bad[1] = 1;
        ac.key_lengths = dtr_tensor_from(gpu, DTR_I32, 1, &two, bad);
        y = dtr_attention_ex(gpu, q, q, q, &ac);
        CHECK(y != NULL && dtr_tensor_read(y, DTR_F32, out, (size_t)(2 * 70 * 64)) == DTR_OK);
        dtr_context_destroy(gpu);
        return;
    }
#endif
    printf("*** data errors found on a GPU: no GPU in this build or machine: SKIPPED ***\n");
}

/* The arithmetic: f32 on the inputs as stored, one rounding at the output; gradients f32. */
static void test_narrow_rounding(void) {
    dtr_context *f = test_ctx(1), *b = narrow_ctx(NULL, DTR_BF16, 1);
    float xv[64], yv[64], out[64], gf[64], gb[64];
    int64_t n = 64;
    dtr_rng rng;
    int i, exact = 1, rounded = 0;
    dtr_tensor *x, *y, *h, *s;
    dtr_rng_seed(&rng, 5, 1);
    for (i = 0; i < 64; i++) { xv[i] = dtr_rng_normal(&rng); yv[i] = dtr_rng_normal(&rng); }
    x = dtr_tensor_requires_grad(dtr_tensor_from(b, DTR_F32, 1, &n, xv));
    y = dtr_tensor_from(b, DTR_F32, 1, &n, yv);
    h = dtr_gelu(b, x);                                  /* f32 in, bf16 out */
    s = dtr_add(b, h, dtr_cast(b, y, DTR_BF16));         /* bf16 + bf16 */
    CHECK(dtr_tensor_dtype(h) == DTR_BF16 && dtr_tensor_dtype(s) == DTR_BF16);
    CHECK_OK(b, dtr_tensor_read(s, DTR_F32, out, 64));
    for (i = 0; i < 64; i++) {
        float hg = dtr_bf16_to_f32(dtr_f32_to_bf16(dtr__f_gelu(xv[i])));
        float want = dtr_bf16_to_f32(dtr_f32_to_bf16(hg + dtr_bf16_to_f32(dtr_f32_to_bf16(yv[i]))));
        exact &= out[i] == want;
        rounded += out[i] != dtr__f_gelu(xv[i]) + yv[i];
    }
    CHECK_MSG(exact, "bf16 gelu + add: not f32 arithmetic rounded once per op");
    CHECK(rounded > 32);
    /* the gradient of gelu's f32 input: f32, the f32 context's bits */
    CHECK_OK(b, dtr_backward(b, dtr_sum_all(b, h)));
    memcpy(gb, dtr_tensor_grad(x), sizeof gb);
    x = dtr_tensor_requires_grad(dtr_tensor_from(f, DTR_F32, 1, &n, xv));
    CHECK_OK(f, dtr_backward(f, dtr_sum_all(f, dtr_gelu(f, x))));
    memcpy(gf, dtr_tensor_grad(x), sizeof gf);
    CHECK(memcmp(gf, gb, sizeof gf) == 0);
    dtr_context_destroy(f);
    dtr_context_destroy(b);
}

/* Six GPT blocks' forward and backward: the activations kept for backward take half the
   bytes in bf16 (the gradients of a pass are f32 either way, released as it goes). */
static void test_narrow_memory(void) {
    size_t peak[2], fwd[2];
    int k, b;
    for (k = 0; k < 2; k++) {
        dtr_context *ctx = narrow_ctx(NULL, k ? DTR_BF16 : DTR_F32, 1);
        dtr_model *m = NULL;
        dtr_gpt_block blk[6];
        int64_t shape[3] = {4, 64, 64};
        char name[16];
        float loss[2];
        dtr_tensor *y;
        CHECK_OK(ctx, dtr_model_create(ctx, 3, &m));
        for (b = 0; b < 6; b++) {
            snprintf(name, sizeof name, "h%d", b);
            dtr_gpt_block_init(&blk[b], m, name, 64, 4);
        }
        CHECK_OK(ctx, dtr_model_build(m));
        y = dtr_tensor_zeros(ctx, DTR_F32, 3, shape);
        dtr_context_arena_peak(ctx, 1);
        for (b = 0; b < 6; b++) y = dtr_gpt_block_forward(ctx, &blk[b], y);
        fwd[k] = dtr_context_arena_peak(ctx, 0);
        y = dtr_mean_all(ctx, dtr_mul(ctx, y, y));
        CHECK_OK(ctx, dtr_backward(ctx, y));
        peak[k] = dtr_context_arena_peak(ctx, 0);
        CHECK_OK(ctx, dtr_tensor_read(y, DTR_F32, &loss[k], 1));
        dtr_model_destroy(m);
        dtr_context_destroy(ctx);
    }
    printf("  6 GPT blocks (4 x 64 x 64): step-arena peak after forward %zu / %zu bytes (f32 / bf16, %.2fx), "
           "after backward %zu / %zu (%.2fx)\n", fwd[0], fwd[1], (double)fwd[1] / (double)fwd[0], peak[0], peak[1],
           (double)peak[1] / (double)peak[0]);
    CHECK(fwd[1] < fwd[0] * 6 / 10);
    CHECK(peak[1] < peak[0] * 3 / 4);
}

static void test_narrow_errors(void) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    cfg.activation_dtype = DTR_I32;
    CHECK_EQ_INT(dtr_context_create(&cfg, &ctx), DTR_INVALID_ARGUMENT);
    CHECK(ctx == NULL);
    CHECK(strstr(dtr_context_create_error(), "activation_dtype") != NULL);
}

/* ---- coverage ---- */

static void test_op_coverage(void) {
    int op, missing = 0;
    for (op = 1; op < DTR_OP_COUNT; op++) {
        CHECK_MSG(g_covered[op], "op %d (%s) has no case in tests/test_grad.c's table", op, dtr__op_name(op));
        missing += !g_covered[op];
    }
    CHECK(missing == 0);
}

/* attention of qkv (2, 9, 24) in `dt` activations: its q, k, v the column slices (copy 0) or
   contiguous copies of them (copy 1); y and qkv's gradient into out (144 + 432 floats) */
static void attention_of_slices(dtr_dtype dt, int copy, float *out) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    int64_t shp[3] = {2, 9, 24}, i;
    float v[432];
    dtr_tensor *leaf, *qkv, *part[3], *y, *yf;
    dtr_rng rng;
    const dtr__node *n;
    int contig = 0, p;
    cfg.threads = 1;
    cfg.activation_dtype = dt;
    CHECK_EQ_INT(dtr_context_create(&cfg, &ctx), DTR_OK);
    dtr_rng_seed(&rng, 7, 1);
    for (i = 0; i < 432; i++) v[i] = dtr_rng_uniform(&rng) * 2.0f - 1.0f;
    leaf = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, shp, v));
    qkv = dtr_cast(ctx, leaf, dt);
    for (p = 0; p < 3; p++) {
        part[p] = dtr_slice(ctx, qkv, -1, 8 * p, 8 * p + 8);
        if (copy) part[p] = dtr_contiguous(ctx, part[p]);
    }
    y = dtr_attention(ctx, part[0], part[1], part[2], 2);
    CHECK(y != NULL);
    for (n = ctx->cur->head; n; n = n->prev) contig += n->op == DTR_OP_CONTIGUOUS;
    CHECK_EQ_INT(contig, copy ? 3 : 0);
    for (p = 0; p < 3; p++) CHECK(ctx->cur->head->in[p]->storage == (copy ? part[p] : qkv)->storage);
    yf = dtr_cast(ctx, y, DTR_F32);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, yf, yf))));
    CHECK_OK(ctx, dtr_tensor_read(yf, DTR_F32, out, 144));
    memcpy(out + 144, dtr_tensor_grad(leaf), 432 * sizeof(float));
    dtr_context_destroy(ctx);
}

/* attention reads the slices of one qkv as they are (no copies on the tape; widened together in
   16 bits), with the same values and gradients as on contiguous copies, bit for bit */
static void test_attention_reads_slices(void) {
    static const dtr_dtype dts[] = {DTR_F32, DTR_BF16, DTR_F16};
    int d, i;
    for (d = 0; d < 3; d++) {
        float a[576], b[576];
        int same = 1;
        attention_of_slices(dts[d], 0, a);
        attention_of_slices(dts[d], 1, b);
        for (i = 0; i < 576; i++) same &= a[i] == b[i];
        CHECK_MSG(same, "%s: attention on slices differs from attention on copies", dtr_dtype_name(dts[d]));
    }
}

/* cast: f32 -> bf16 -> f32 passes the gradient straight through */
static void test_cast_straight_through(void) {
    dtr_context *ctx = test_ctx(1);
    float v[4] = {1.0f, -2.0f, 0.3333f, 4.0f};
    int64_t n = 4;
    dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, &n, v));
    dtr_tensor *h = dtr_cast(ctx, x, DTR_BF16);
    dtr_tensor *y = dtr_cast(ctx, h, DTR_F32);
    dtr_tensor *l = dtr_sum_all(ctx, dtr_scale(ctx, y, 3.0f));
    int i;
    CHECK(dtr_tensor_dtype(h) == DTR_BF16);
    CHECK_NEAR(dtr_tensor_get(y, 2), dtr_bf16_to_f32(dtr_f32_to_bf16(0.3333f)), 0);
    CHECK_OK(ctx, dtr_backward(ctx, l));
    for (i = 0; i < 4; i++) CHECK_NEAR(dtr_tensor_grad(x)[i], 3.0f, 0);
    dtr_context_destroy(ctx);
}

int main(void) {
    dtr_comm_config cc = dtr_comm_config_init();
    dtr_local_world *w1 = NULL;
    int pass;
    if (dtr_local_world_create(1, NULL, &w1) != DTR_OK) return 2;
    g_quick = getenv("DTR_TEST_QUICK") != NULL;
    cc.local.world = w1;
    if (dtr_comm_create(&cc, &g_comm1, NULL, 0) != DTR_OK) return 2;
    for (pass = 0; pass < 2; pass++) {
        g_threads = pass ? 2 : 1; /* the threaded kernels must give the same gradients */
        printf("-- %d thread(s)\n", g_threads);
        RUN(test_gradients);
    }
    RUN(test_cast_straight_through);
    RUN(test_attention_reads_slices);
    RUN(test_backend_parity);
    RUN(test_simd_variants);
    RUN(test_narrow_activations);
    RUN(test_narrow_rounding);
    RUN(test_narrow_memory);
    RUN(test_narrow_errors);
    RUN(test_device_data_errors);
    RUN(test_op_coverage);   /* after the cases above have run */
    dtr_comm_destroy(g_comm1);
    dtr_local_world_destroy(w1);
    return test_summary();
}
