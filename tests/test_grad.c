/* Finite-difference gradient checks for every op with autograd, including broadcasting and
 * non-contiguous views. For each case the loss is L = sum(op(inputs) * R) with fixed random R;
 * analytic gradients come from dtr_backward, numerical ones from central differences
 * (L accumulated in double on the host). Pass: ||analytic - numeric|| / max(norms) <= 1e-3. */
#define DTRAIN_INTERNAL_API
#include "test.h"

#define MAXIN 4
#define EPS 1e-2f

typedef struct gc_input {
    int ndim;
    int64_t shape[DTR_MAX_DIMS];
    int kind;          /* 0 normal, 1 away from zero (relu, div), 2 distinct spaced values (max) */
} gc_input;

typedef dtr_tensor *(*build_fn)(dtr_context *ctx, dtr_tensor **in, void *user);

static int g_threads = 1;
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
        int64_t n = 1, k;
        int d;
        for (d = 0; d < spec[i].ndim; d++) n *= spec[i].shape[d];
        data[i] = malloc((size_t)(n ? n : 1) * sizeof(float));
        grad[i] = malloc((size_t)(n ? n : 1) * sizeof(float));
        for (k = 0; k < n; k++) {
            float v = dtr_rng_uniform(&rng) * 2.0f - 1.0f;
            if (spec[i].kind == 1) v = (v < 0 ? -1.0f : 1.0f) * (0.5f + fabsf(v));
            data[i][k] = v;
        }
        if (spec[i].kind == 2) { /* a shuffled ramp: all values at least 0.05 apart */
            for (k = 0; k < n; k++) data[i][k] = -1.0f + 0.05f * (float)k;
            for (k = n - 1; k > 0; k--) {
                int64_t j = dtr_rng_u32(&rng) % (uint32_t)(k + 1);
                float t = data[i][k]; data[i][k] = data[i][j]; data[i][j] = t;
            }
        }
    }
    saved = ctx->rng; /* dropout draws from it: every forward must see the same mask */
    out = gc_forward(ctx, nin, spec, data, fn, user, 1, leaves);
    CHECK_MSG(out != NULL, "%s: forward failed: %s", name, dtr_context_last_error(ctx));
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

static void test_binary_same_shape(void) {
    gc_input s[2] = {IN2(3, 5), IN2(3, 5)};
    gc_input sd[2] = {IN2(3, 5), {2, {3, 5}, 1}};
    gradcheck("add", 2, s, b_add, NULL);
    gradcheck("sub", 2, s, b_sub, NULL);
    gradcheck("mul", 2, s, b_mul, NULL);
    gradcheck("div", 2, sd, b_div, NULL);
}

static void test_binary_broadcast(void) {
    gc_input s1[2] = {IN3(3, 1, 4), IN2(2, 4)};     /* -> (3, 2, 4) */
    gc_input s2[2] = {IN1(4), IN2(3, 4)};           /* row vector */
    gc_input s3[2] = {IN2(3, 4), {2, {3, 1}, 1}};   /* column, away from zero for div */
    gc_input s4[2] = {IN4(2, 1, 3, 1), IN3(4, 1, 5)};  /* -> (2, 4, 3, 5) */
    gradcheck("add broadcast", 2, s1, b_add, NULL);
    gradcheck("sub broadcast", 2, s2, b_sub, NULL);
    gradcheck("mul broadcast", 2, s4, b_mul, NULL);
    gradcheck("div broadcast", 2, s3, b_div, NULL);
}

static dtr_tensor *b_add_t(dtr_context *c, dtr_tensor **x, void *u) {
    (void)u;
    return dtr_mul(c, dtr_transpose(c, x[0], 0, 1), dtr_slice(c, x[1], 1, 1, 5));
}

static void test_binary_noncontiguous(void) {
    gc_input s[2] = {IN2(4, 3), IN2(3, 5)};
    gradcheck("mul of transposed and sliced views", 2, s, b_add_t, NULL);
}

static dtr_tensor *b_unary(dtr_context *c, dtr_tensor **x, void *u) {
    switch (*(int *)u) {
    case 0: return dtr_scale(c, x[0], -2.5f);
    case 1: return dtr_relu(c, x[0]);
    case 2: return dtr_gelu(c, x[0]);
    case 3: return dtr_tanh(c, x[0]);
    default: return dtr_sigmoid(c, x[0]);
    }
}

static void test_unary(void) {
    static const char *names[] = {"scale", "relu", "gelu", "tanh", "sigmoid"};
    int k;
    for (k = 0; k < 5; k++) {
        gc_input s[1] = {{3, {2, 3, 7}, k == 1 ? 1 : 0}};
        gradcheck(names[k], 1, s, b_unary, &k);
    }
}

static dtr_tensor *b_unary_view(dtr_context *c, dtr_tensor **x, void *u) {
    (void)u;
    return dtr_gelu(c, dtr_permute(c, x[0], (const int[]){2, 0, 1}));
}

static void test_unary_on_view(void) {
    gc_input s[1] = {IN3(2, 3, 4)};
    gradcheck("gelu of a permuted view", 1, s, b_unary_view, NULL);
}

/* ---- matmul, linear ---- */

static dtr_tensor *b_matmul(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_matmul(c, x[0], x[1]); }
static dtr_tensor *b_matmul_t(dtr_context *c, dtr_tensor **x, void *u) {
    (void)u;
    return dtr_matmul(c, dtr_transpose(c, x[0], -1, -2), dtr_transpose(c, x[1], -1, -2));
}

static void test_matmul(void) {
    gc_input s2[2] = {IN2(5, 7), IN2(7, 3)};
    gc_input sb[2] = {IN4(2, 3, 4, 5), IN2(5, 6)};
    gc_input sbb[2] = {IN4(2, 1, 3, 4), IN3(3, 4, 2)};
    gc_input st[2] = {IN3(2, 6, 4), IN3(2, 5, 6)};
    gradcheck("matmul 2-D", 2, s2, b_matmul, NULL);
    gradcheck("matmul batched, shared b", 2, sb, b_matmul, NULL);
    gradcheck("matmul broadcast batch", 2, sbb, b_matmul, NULL);
    gradcheck("matmul of transposed views", 2, st, b_matmul_t, NULL);
}

static dtr_tensor *b_linear(dtr_context *c, dtr_tensor **x, void *u) {
    return dtr_linear(c, x[0], x[1], *(int *)u ? x[2] : NULL);
}

static void test_linear(void) {
    int bias = 1, nobias = 0;
    gc_input s[3] = {IN3(2, 3, 6), IN2(4, 6), IN1(4)};
    gradcheck("linear with bias", 3, s, b_linear, &bias);
    gradcheck("linear without bias", 2, s, b_linear, &nobias);
}

/* ---- softmax family, losses, reductions ---- */

static dtr_tensor *b_softmax(dtr_context *c, dtr_tensor **x, void *u) {
    switch (*(int *)u) {
    case 0: return dtr_softmax(c, x[0]);
    case 1: return dtr_log_softmax(c, x[0]);
    default: return dtr_softmax_causal(c, x[0]);
    }
}

static void test_softmax(void) {
    int k;
    gc_input s[1] = {IN3(2, 5, 5)};
    for (k = 0; k < 3; k++) gradcheck(k == 0 ? "softmax" : k == 1 ? "log_softmax" : "softmax_causal", 1, s, b_softmax, &k);
}

static dtr_tensor *b_xent(dtr_context *c, dtr_tensor **x, void *u) {
    static const int32_t t[6] = {0, 4, 2, 2, 1, 3};
    int64_t n = 6;
    (void)u;
    return dtr_cross_entropy(c, x[0], dtr_tensor_from(c, DTR_I32, 1, &n, t));
}

static dtr_tensor *b_mse(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_mse(c, x[0], x[1]); }

static void test_losses(void) {
    gc_input s[1] = {IN2(6, 5)};
    gc_input m[2] = {IN3(2, 3, 4), IN3(2, 3, 4)};
    gradcheck("cross_entropy", 1, s, b_xent, NULL);
    gradcheck("mse", 2, m, b_mse, NULL);
}

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

static void test_reductions(void) {
    static const char *names[] = {"sum axis 1", "mean axis -1 keepdim", "sum axis 0 keepdim", "sum_all", "mean_all",
                                  "mean over a transposed view"};
    gc_input s[1] = {IN3(3, 4, 5)};
    int k;
    for (k = 0; k < 6; k++) gradcheck(names[k], 1, s, b_reduce, &k);
}

/* ---- embedding, layer norm, dropout ---- */

static dtr_tensor *b_embedding(dtr_context *c, dtr_tensor **x, void *u) {
    static const int32_t ids[6] = {3, 0, 3, 1, 4, 0};
    int64_t s[2] = {2, 3};
    (void)u;
    return dtr_embedding(c, x[0], dtr_tensor_from(c, DTR_I32, 2, s, ids));
}

static dtr_tensor *b_layernorm(dtr_context *c, dtr_tensor **x, void *u) {
    return *(int *)u ? dtr_layernorm(c, x[0], x[1], x[2], 1e-5f) : dtr_layernorm(c, x[0], NULL, NULL, 1e-5f);
}

static dtr_tensor *b_dropout(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_dropout(c, x[0], 0.3f); }

static void test_embedding_layernorm_dropout(void) {
    gc_input e[1] = {IN2(5, 4)};
    gc_input ln[3] = {IN3(2, 3, 8), IN1(8), IN1(8)};
    gc_input d[1] = {IN2(6, 7)};
    int yes = 1, no = 0;
    gradcheck("embedding", 1, e, b_embedding, NULL);
    gradcheck("layernorm affine", 3, ln, b_layernorm, &yes);
    gradcheck("layernorm plain", 1, ln, b_layernorm, &no);
    gradcheck("dropout", 1, d, b_dropout, NULL);
}

/* ---- convolution and pooling ---- */

static dtr_tensor *b_conv(dtr_context *c, dtr_tensor **x, void *u) {
    const int *g = (const int *)u; /* stride, padding, bias */
    return dtr_conv2d(c, x[0], x[1], g[2] ? x[2] : NULL, g[0], g[1]);
}

static void test_conv2d(void) {
    gc_input s[3] = {IN4(2, 3, 6, 5), IN4(4, 3, 3, 3), IN1(4)};
    int a[3] = {1, 1, 1}, b[3] = {2, 0, 0}, c[3] = {2, 2, 1};
    gradcheck("conv2d stride 1 pad 1 bias", 3, s, b_conv, a);
    gradcheck("conv2d stride 2 pad 0", 2, s, b_conv, b);
    gradcheck("conv2d stride 2 pad 2 bias", 3, s, b_conv, c);
}

static dtr_tensor *b_pool(dtr_context *c, dtr_tensor **x, void *u) {
    switch (*(int *)u) {
    case 0: return dtr_maxpool2d(c, x[0], 2, 0, 0);
    case 1: return dtr_maxpool2d(c, x[0], 3, 2, 1);
    case 2: return dtr_avgpool2d(c, x[0], 2, 0, 0);
    default: return dtr_avgpool2d(c, x[0], 3, 1, 1);
    }
}

static void test_pooling(void) {
    static const char *names[] = {"maxpool 2", "maxpool 3 stride 2 pad 1", "avgpool 2", "avgpool 3 stride 1 pad 1"};
    int k;
    for (k = 0; k < 4; k++) {
        gc_input s[1] = {{4, {2, 2, 6, 7}, k < 2 ? 2 : 0}};
        gradcheck(names[k], 1, s, b_pool, &k);
    }
}

/* ---- attention and views ---- */

static dtr_tensor *b_attention(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_attention(c, x[0], x[1], x[2], 2); }

static void test_attention(void) {
    gc_input s[3] = {IN3(2, 5, 6), IN3(2, 5, 6), IN3(2, 5, 6)};
    gradcheck("causal self-attention", 3, s, b_attention, NULL);
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

static void test_views(void) {
    static const char *names[] = {"reshape", "permute + contiguous", "slice", "concat", "reshape of a transposed view"};
    gc_input s[2] = {IN2(6, 4), IN2(2, 4)};
    int k;
    for (k = 0; k < 5; k++) gradcheck(names[k], k == 3 ? 2 : 1, s, b_views, &k);
}

/* ---- a whole GPT block through the layer API ---- */

static dtr_model *g_gpt_model;
static dtr_gpt_block g_gpt;

static void gpt_setup(dtr_context *ctx) {
    dtr_model_create(ctx, 5, &g_gpt_model);
    dtr_gpt_block_init(&g_gpt, g_gpt_model, "h0", 8, 2);
}

static void gpt_teardown(void) { dtr_model_destroy(g_gpt_model); g_gpt_model = NULL; }

static dtr_tensor *b_gpt(dtr_context *c, dtr_tensor **x, void *u) { (void)u; return dtr_gpt_block_forward(c, &g_gpt, x[0]); }

static void test_gpt_block(void) {
    gc_input s[1] = {IN3(2, 4, 8)};
    g_setup = gpt_setup;
    g_teardown = gpt_teardown;
    gradcheck("gpt block (input gradient)", 1, s, b_gpt, NULL);
    g_setup = NULL;
    g_teardown = NULL;
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
    int pass;
    for (pass = 0; pass < 2; pass++) {
        g_threads = pass ? 2 : 1; /* the threaded kernels must give the same gradients */
        printf("-- %d thread(s)\n", g_threads);
        RUN(test_binary_same_shape);
        RUN(test_binary_broadcast);
        RUN(test_binary_noncontiguous);
        RUN(test_unary);
        RUN(test_unary_on_view);
        RUN(test_matmul);
        RUN(test_linear);
        RUN(test_softmax);
        RUN(test_losses);
        RUN(test_reductions);
        RUN(test_embedding_layernorm_dropout);
        RUN(test_conv2d);
        RUN(test_pooling);
        RUN(test_attention);
        RUN(test_views);
        RUN(test_gpt_block);
    }
    RUN(test_cast_straight_through);
    return test_summary();
}
