/* tests/test_autograd.c: the open autograd seams and numeric corner cases, against PyTorch.
 *   test_second_backward     two losses sharing a graph, one dtr_backward each: the gradients
 *                            add up (PyTorch retain_graph=True), intermediates restart at zero
 *   test_backward_from       dtr_backward_from(h, g) == gradients of sum(h * g); leaf roots
 *   test_tapes               micro-batches on their own tapes, backward in any order: the
 *                            gradients of one tape, live/peak bytes fall when a tape is reset
 *   test_two_hooks           two gradient hooks on one context both see every parameter
 *   test_nan_propagates      relu and max pooling keep NaN (values and gradients of PyTorch)
 *   test_nan_maxpool_windows overlapping max-pool windows holding NaN: the gradient as PyTorch's
 *   test_empty_mean          mean, mean_all and mse of nothing are NaN (PyTorch)
 *   test_abs_gelu_erf        dtr_abs, dtr_gelu_erf and dtr_gelu (tanh form) against PyTorch's numbers
 *   test_math_ops            exp, log, sqrt, pow, clamp, leaky_relu, softplus, maximum, minimum,
 *                            bce_with_logits, huber_loss against PyTorch's numbers (NaN, infinities,
 *                            ties and ends included), and their argument errors
 *   test_xent_settings       dtr_cross_entropy_ex against PyTorch: label smoothing with an
 *                            ignored row (-100, the default), mean, sum and no reduction, values
 *                            and gradients; every row ignored gives 0 and no gradient; a target
 *                            out of range that is not ignored, bad smoothing or reduction: errors
 *   test_max_argmax          dtr_max, dtr_min, dtr_argmax, dtr_argmin against PyTorch: ties (the
 *                            first), NaN (wins), -inf rows, the gradient one-hot at the index,
 *                            indices i32 and never differentiable; a bad axis
 *   test_gather              dtr_gather's values and gradient (a repeated index adds up) as
 *                            torch.gather's; an index out of range, another shape, f32 indices
 *   test_upsample            dtr_upsample_nearest2d: F.interpolate's nearest values, each input's
 *                            gradient its block's sum; a factor of 0, a 3-D x
 *   test_op_names            every op's stored id and name (written out), and errors that name the op
 *   test_backend_caps        the CPU backend's capabilities, supports_op, events, result names
 *   test_fused_attention     the fused attention op equals the composite of public ops (causal or
 *                            not, cross-attention, a scale of the app's); queries from a key
 *                            position on (q_start) equal those rows of the whole; its arena peak at
 *                            T = 512 is a fraction of the composite's (no T x T per head)
 *   test_rmsnorm_silu        dtr_rmsnorm (and its layer) and dtr_silu against their definitions
 *   test_rope                dtr_rope against its definition (both pairings); scores after it
 *                            depend on the positions' difference only
 *   test_attention_layer_causal  the attention layer is causal unless told (position 0 does not
 *                            see the last one); with causal = 0 it does (an encoder's)
 *   test_release_activations a small GPT, 2 micro-batches accumulated: release_activations gives
 *                            the same gradient bits and loss with a lower arena peak (the second
 *                            micro-batch lives in the first one's blocks)
 *   test_spares_merge        two released neighbouring blocks serve one allocation of their size
 *   test_released_errors     what release_activations released gives DTR_BAD_STATE (read, write,
 *                            get, data, an op, a second backward), retained tensors and the loss
 *                            keep their values
 *   test_grad_handoff        reshape's backward hands its gradient block to its input (one
 *                            buffer less at the peak) unless the view's gradient is retained
 * Reference numbers: PyTorch 1.13 (python3-torch), the script is quoted at each case. */
#define DTRAIN_INTERNAL_API
#include "test.h"

static dtr_tensor *scalar_leaf(dtr_context *ctx, float v) {
    int64_t one = 1;
    return dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, &one, &v));
}

/* x = 0.5; s = (x*x).sum(); s.backward(retain_graph=True); tanh(s).sum().backward(): x.grad 1.9400148 */
static void test_second_backward(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_tensor *x = scalar_leaf(ctx, 0.5f);
    dtr_tensor *s = dtr_sum_all(ctx, dtr_mul(ctx, x, x));
    dtr_tensor *t = dtr_sum_all(ctx, dtr_tanh(ctx, s));
    CHECK_OK(ctx, dtr_backward(ctx, s));
    CHECK_NEAR(dtr_tensor_grad(x)[0], 1.0f, 1e-6);
    CHECK_OK(ctx, dtr_backward(ctx, t));
    CHECK_NEAR(dtr_tensor_grad(x)[0], 1.9400148391723633, 1e-6);
    /* a third pass over the first loss adds its gradient once more */
    CHECK_OK(ctx, dtr_backward(ctx, s));
    CHECK_NEAR(dtr_tensor_grad(x)[0], 2.9400148391723633, 1e-6);
    dtr_context_destroy(ctx);
}

/* h = x W^T: backward_from(h, g) must equal backward(sum(h * g)) */
static void test_backward_from(void) {
    static const float xv[6] = {0.1f, -0.2f, 0.3f, 0.4f, -0.5f, 0.6f}, wv[6] = {1, 2, 3, -1, 0.5f, 0.25f};
    static const float g[4] = {0.5f, -1.0f, 2.0f, 0.25f};
    int64_t s23[2] = {2, 3}, s22[2] = {2, 2};
    float direct[12];
    int pass, i;
    for (pass = 0; pass < 2; pass++) {
        dtr_context *ctx = test_ctx(1);
        dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, s23, xv));
        dtr_tensor *w = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, s23, wv));
        dtr_tensor *h = dtr_linear(ctx, x, w, NULL);
        if (pass == 0) {
            CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, h, dtr_tensor_from(ctx, DTR_F32, 2, s22, g)))));
            memcpy(direct, dtr_tensor_grad(x), 6 * sizeof(float));
            memcpy(direct + 6, dtr_tensor_grad(w), 6 * sizeof(float));
        } else {
            CHECK_OK(ctx, dtr_backward_from(ctx, h, g));
            for (i = 0; i < 6; i++) CHECK_NEAR(dtr_tensor_grad(x)[i], direct[i], 1e-6);
            for (i = 0; i < 6; i++) CHECK_NEAR(dtr_tensor_grad(w)[i], direct[6 + i], 1e-6);
            /* a leaf root accumulates the given gradient */
            CHECK_OK(ctx, dtr_backward_from(ctx, x, xv));
            for (i = 0; i < 6; i++) CHECK_NEAR(dtr_tensor_grad(x)[i], direct[i] + xv[i], 1e-6);
            CHECK_EQ_INT(dtr_backward_from(ctx, h, NULL), DTR_NULL_HANDLE);
        }
        dtr_context_destroy(ctx);
    }
}

typedef struct hook_count { int n; dtr_tensor *last; } hook_count;

static dtr_result count_hook(void *user, dtr_tensor *param, dtr_event *ready) {
    hook_count *h = (hook_count *)user;
    (void)ready;
    h->n++;
    h->last = param;
    return DTR_OK;
}

/* Two micro-batches, each on its own tape, backward in reverse order and interleaved with a
 * third forward: the weight's gradient is the sum of the per-batch gradients computed on the
 * context's own tape; resetting a tape gives its bytes back (peak tracks the most live). */
static void test_tapes(void) {
    static const float wv[6] = {1, 2, 3, -1, 0.5f, 0.25f};
    static const float xv[3][6] = {{0.1f, -0.2f, 0.3f, 0.4f, -0.5f, 0.6f}, {1, 0, -1, 2, 0.5f, -0.5f},
                                   {0.3f, 0.3f, -0.7f, 0.2f, 0.1f, 0.9f}};
    int64_t s23[2] = {2, 3};
    float ref[6] = {0}, *gw;
    dtr_context *ctx = test_ctx(1);
    dtr_tensor *w = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, s23, wv)), *loss[3];
    dtr_tape *tape[3];
    size_t live0, peak_two;
    int i, k;
    for (k = 0; k < 3; k++) { /* reference: each batch alone on the context's own tape */
        dtr_tensor *x = dtr_tensor_from(ctx, DTR_F32, 2, s23, xv[k]);
        CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_tanh(ctx, dtr_linear(ctx, x, w, NULL)))));
    }
    for (i = 0; i < 6; i++) ref[i] = dtr_tensor_grad(w)[i], dtr_tensor_grad(w)[i] = 0;
    live0 = dtr_context_arena_peak(ctx, 1);
    for (k = 0; k < 3; k++) CHECK_OK(ctx, dtr_tape_create(ctx, &tape[k]));
    for (k = 0; k < 2; k++) {
        CHECK(dtr_context_set_tape(ctx, tape[k]) == (k ? tape[0] : NULL));
        CHECK(dtr_context_tape(ctx) == tape[k]);
        loss[k] = dtr_sum_all(ctx, dtr_tanh(ctx, dtr_linear(ctx, dtr_tensor_from(ctx, DTR_F32, 2, s23, xv[k]), w, NULL)));
    }
    dtr_context_set_tape(ctx, NULL);
    CHECK_OK(ctx, dtr_backward(ctx, loss[1]));  /* replays tape 1 only, whatever is current */
    CHECK_OK(ctx, dtr_tape_reset(tape[1]));
    peak_two = dtr_context_arena_peak(ctx, 0);
    dtr_context_set_tape(ctx, tape[2]);
    loss[2] = dtr_sum_all(ctx, dtr_tanh(ctx, dtr_linear(ctx, dtr_tensor_from(ctx, DTR_F32, 2, s23, xv[2]), w, NULL)));
    CHECK_OK(ctx, dtr_backward(ctx, loss[2]));
    CHECK_OK(ctx, dtr_tape_reset(tape[2]));
    CHECK_OK(ctx, dtr_backward(ctx, loss[0]));
    gw = dtr_tensor_grad(w);
    for (i = 0; i < 6; i++) CHECK_NEAR(gw[i], ref[i], 1e-6);
    /* at most two batches were alive at once: the third, of the second's size, reused its
       share (a single tape would have held all three) */
    CHECK(peak_two > 0);
    CHECK_EQ_INT(dtr_context_arena_peak(ctx, 0), peak_two);
    for (k = 0; k < 3; k++) dtr_tape_destroy(tape[k]);
    CHECK(dtr_context_tape(ctx) == NULL);
    CHECK_EQ_INT(dtr_context_arena_peak(ctx, 1), peak_two);
    CHECK_EQ_INT(dtr_context_arena_peak(ctx, 0), live0);
    dtr_context_destroy(ctx);
}

/* A chain of 8 tanh(linear) layers of one width: by default each intermediate's gradient is
 * released once its producer ran its backward and the next one takes its block, so the
 * step-arena peak is lower than with retain_grads = 1 by most of the chain's gradients; the
 * leaf and parameter gradients are the same bits either way; an intermediate's gradient is
 * NULL afterwards unless dtr_tensor_retain_grad kept it (then it equals the retained run's).
 * on_tape 1 runs the chain on a tape of the app's, which recycles the same way. */
static size_t chain_run(int retain_all, int on_tape, float *gx, float *gw, float *gmid, int *mid_null) {
    enum { L = 8, N = 16, D = 32 };
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    int64_t xs[2] = {N, D}, ws[2] = {D, D};
    float *xv = (float *)malloc(N * D * sizeof(float)), *wv = (float *)malloc(D * D * sizeof(float));
    dtr_tensor *x, *w, *h, *mid = NULL, *kept = NULL;
    dtr_tape *tape = NULL;
    dtr_rng r;
    size_t peak;
    int i;
    cfg.threads = 1;
    cfg.retain_grads = retain_all;
    if (dtr_context_create(&cfg, &ctx) != DTR_OK) { CHECK(0); exit(2); }
    dtr_rng_seed(&r, 5, 1);
    for (i = 0; i < N * D; i++) xv[i] = dtr_rng_uniform(&r) - 0.5f;
    for (i = 0; i < D * D; i++) wv[i] = (dtr_rng_uniform(&r) - 0.5f) * 0.3f;
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, xs, xv));
    w = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, ws, wv));
    dtr_context_arena_peak(ctx, 1);
    if (on_tape) CHECK_OK(ctx, dtr_tape_create(ctx, &tape));
    dtr_context_set_tape(ctx, tape);
    for (h = x, i = 0; i < L; i++) {
        h = dtr_tanh(ctx, dtr_linear(ctx, h, w, NULL));
        if (i == 3) kept = h;
        if (i == 5) mid = h;
    }
    CHECK_OK(ctx, dtr_tensor_retain_grad(kept));
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, h, h))));
    peak = dtr_context_arena_peak(ctx, 0);
    memcpy(gx, dtr_tensor_grad(x), N * D * sizeof(float));
    memcpy(gw, dtr_tensor_grad(w), D * D * sizeof(float));
    CHECK(dtr_tensor_grad(kept) != NULL);
    if (dtr_tensor_grad(kept)) memcpy(gmid, dtr_tensor_grad(kept), N * D * sizeof(float));
    *mid_null = dtr_tensor_grad(mid) == NULL;
    dtr_tape_destroy(tape);
    free(xv);
    free(wv);
    dtr_context_destroy(ctx);
    return peak;
}

static void test_released_grads(void) {
    enum { N = 16, D = 32 };
    float gx[2][N * D], gw[2][D * D], gm[2][N * D];
    int null_kept = 0, null_default = 0;
    size_t keep = chain_run(1, 0, gx[0], gw[0], gm[0], &null_kept), lean = chain_run(0, 0, gx[1], gw[1], gm[1], &null_default);
    size_t taped = chain_run(0, 1, gx[1], gw[1], gm[1], &null_default);
    CHECK(!null_kept && null_default);
    CHECK(memcmp(gx[0], gx[1], sizeof gx[0]) == 0 && memcmp(gw[0], gw[1], sizeof gw[0]) == 0);
    CHECK(memcmp(gm[0], gm[1], sizeof gm[0]) == 0);
    /* 8 layers x 2 intermediates of N x D floats: retained, all 16 gradients stay; released,
       a handful are live at once */
    CHECK_MSG(keep - lean >= (size_t)10 * N * D * sizeof(float), "peak %zu retained, %zu released", keep, lean);
    /* on a tape of the app's (a pipeline's micro-batch, a recomputed region) the same */
    CHECK_MSG(taped == lean, "peak %zu on an app tape, %zu on the own tape", taped, lean);
    CHECK(null_default && memcmp(gx[0], gx[1], sizeof gx[0]) == 0 && memcmp(gw[0], gw[1], sizeof gw[0]) == 0);
    printf("    arena peak of the chain: %zu bytes with every gradient kept, %zu released\n", keep, lean);
}

static void test_two_hooks(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_linear_layer l1, l2;
    hook_count a = {0, NULL}, b = {0, NULL};
    int ida = 0, idb = 0;
    int64_t xs[2] = {2, 3};
    float xv[6] = {1, 2, 3, 4, 5, 6};
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    CHECK_OK(ctx, dtr_linear_layer_init(&l1, m, "l1", 3, 4, 1, DTR_INIT_TORCH_DEFAULT));
    CHECK_OK(ctx, dtr_linear_layer_init(&l2, m, "l2", 4, 2, 1, DTR_INIT_TORCH_DEFAULT));
    CHECK_OK(ctx, dtr_context_add_grad_hook(ctx, count_hook, &a, &ida));
    CHECK_OK(ctx, dtr_context_add_grad_hook(ctx, count_hook, &b, &idb));
    CHECK(ida != idb);
    {
        dtr_tensor *x = dtr_tensor_from(ctx, DTR_F32, 2, xs, xv);
        dtr_tensor *y = dtr_linear_layer_forward(ctx, &l2, dtr_relu(ctx, dtr_linear_layer_forward(ctx, &l1, x)));
        CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, y)));
    }
    CHECK_EQ_INT(a.n, 4);   /* l2.weight, l2.bias, l1.weight, l1.bias */
    CHECK_EQ_INT(b.n, 4);
    CHECK(a.last == b.last && a.last != NULL);
    CHECK_OK(ctx, dtr_context_remove_grad_hook(ctx, ida));
    dtr_context_reset(ctx);
    {
        dtr_tensor *x = dtr_tensor_from(ctx, DTR_F32, 2, xs, xv);
        CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_linear_layer_forward(ctx, &l1, x))));
    }
    CHECK_EQ_INT(a.n, 4);   /* removed: not called again */
    CHECK_EQ_INT(b.n, 6);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* x = [nan, -1, 0, 2]; relu(x) = [nan, 0, 0, 2], grad of sum = [1, 0, 0, 1].
 * max_pool2d(2) of a 4x4 ramp 1..16 with x[0,1] = nan: [[nan, 8], [14, 16]], grad at the nan;
 * max_pool2d(3, 1, 1) with x[1,1] = nan: every window holding it is nan. */
static void test_nan_propagates(void) {
    dtr_context *ctx = test_ctx(1);
    float v[4] = {NAN, -1.0f, 0.0f, 2.0f}, img[16], gexp[16] = {0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 1};
    int64_t n4 = 4, s[4] = {1, 1, 4, 4};
    dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, &n4, v)), *y, *p;
    int i;
    y = dtr_relu(ctx, x);
    CHECK(isnan(dtr_tensor_get(y, 0)));
    CHECK(dtr_tensor_get(y, 1) == 0.0f && dtr_tensor_get(y, 3) == 2.0f);
    CHECK_OK(ctx, dtr_backward_from(ctx, y, (const float[]){1, 1, 1, 1}));
    CHECK(dtr_tensor_grad(x)[0] == 1.0f && dtr_tensor_grad(x)[1] == 0.0f && dtr_tensor_grad(x)[2] == 0.0f &&
          dtr_tensor_grad(x)[3] == 1.0f);
    for (i = 0; i < 16; i++) img[i] = (float)(i + 1);
    img[1] = NAN;
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 4, s, img));
    p = dtr_maxpool2d(ctx, x, 2, 0, 0);
    CHECK(isnan(dtr_tensor_get(p, 0)) && dtr_tensor_get(p, 1) == 8.0f && dtr_tensor_get(p, 2) == 14.0f);
    CHECK_OK(ctx, dtr_backward_from(ctx, p, (const float[]){1, 1, 1, 1}));
    for (i = 0; i < 16; i++) CHECK_EQ_INT(dtr_tensor_grad(x)[i], gexp[i]);
    for (i = 0; i < 16; i++) img[i] = (float)(i + 1);
    img[5] = NAN;
    p = dtr_maxpool2d(ctx, dtr_tensor_from(ctx, DTR_F32, 4, s, img), 3, 1, 1);
    for (i = 0; i < 16; i++) {   /* windows around (1,1): rows 0..2, cols 0..2 */
        int r = i / 4, c = i % 4, hit = r <= 2 && c <= 2;
        CHECK_MSG(hit ? isnan(dtr_tensor_get(p, i)) : !isnan(dtr_tensor_get(p, i)), "output %d", i);
    }
    dtr_context_destroy(ctx);
}

/* Gradients of max_pool2d(3, 1, 1) over overlapping windows holding NaN (PyTorch 1.13:
 *   img = torch.arange(1., 17.).reshape(1, 1, 4, 4); img[0, 0, 1, 1] = nan (and img[0, 0, 2, 2] = nan);
 *   F.max_pool2d(img, 3, 1, 1).sum().backward(); img.grad).
 * Each window's gradient goes to a NaN it holds; with two, to the later one in row-major order
 * (PyTorch's kernel takes every NaN it meets). */
static void test_nan_maxpool_windows(void) {
    static const float g1[16] = {0, 0, 0, 0, 0, 9, 0, 1, 0, 0, 0, 1, 0, 1, 1, 3};
    static const float g2[16] = {0, 0, 0, 0, 0, 5, 0, 1, 0, 0, 9, 0, 0, 1, 0, 0};
    dtr_context *ctx = test_ctx(1);
    int64_t s[4] = {1, 1, 4, 4};
    float img[16], ones[16];
    int two, i;
    for (i = 0; i < 16; i++) ones[i] = 1.0f;
    for (two = 0; two < 2; two++) {
        dtr_tensor *x, *p;
        for (i = 0; i < 16; i++) img[i] = (float)(i + 1);
        img[5] = NAN;
        if (two) img[10] = NAN;
        x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 4, s, img));
        p = dtr_maxpool2d(ctx, x, 3, 1, 1);
        CHECK_OK(ctx, dtr_backward_from(ctx, p, ones));
        for (i = 0; i < 16; i++)
            CHECK_MSG(dtr_tensor_grad(x)[i] == (two ? g2 : g1)[i], "%d NaN: grad[%d] %g, PyTorch %g", two + 1, i,
                      (double)dtr_tensor_grad(x)[i], (double)(two ? g2 : g1)[i]);
        CHECK(!two || (isnan(dtr_tensor_get(p, 15)) && dtr_tensor_get(p, 12) == 14.0f));
        dtr_context_reset(ctx);
    }
    dtr_context_destroy(ctx);
}

/* torch.zeros(0).mean() = nan; torch.zeros(3, 0).mean(1) = [nan]*3; mse_loss of empty = nan */
static void test_empty_mean(void) {
    dtr_context *ctx = test_ctx(1);
    int64_t s0[1] = {0}, s30[2] = {3, 0};
    dtr_tensor *e = dtr_tensor_zeros(ctx, DTR_F32, 1, s0), *e2 = dtr_tensor_zeros(ctx, DTR_F32, 2, s30), *m;
    CHECK(isnan(dtr_tensor_get(dtr_mean_all(ctx, e), 0)));
    m = dtr_mean(ctx, e2, 1, 0);
    CHECK_EQ_INT(dtr_tensor_numel(m), 3);
    CHECK(isnan(dtr_tensor_get(m, 0)) && isnan(dtr_tensor_get(m, 2)));
    CHECK(isnan(dtr_tensor_get(dtr_mse(ctx, e, e), 0)));
    CHECK(dtr_tensor_get(dtr_sum_all(ctx, e), 0) == 0.0f);   /* a sum of nothing stays 0 */
    dtr_context_destroy(ctx);
}

/* y = f(x) and the gradient of sum(y) at x = [-1.5, 0.3, 2.0] against PyTorch's numbers */
static void check_unary_ref(dtr_context *ctx, dtr_tensor *(*f)(dtr_context *, dtr_tensor *), const float *ye,
                            const float *ge) {
    int64_t n3 = 3;
    dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, &n3, (const float[]){-1.5f, 0.3f, 2.0f}));
    dtr_tensor *y = f(ctx, x);
    int i;
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, y)));
    for (i = 0; i < 3; i++) CHECK_NEAR(dtr_tensor_get(y, i), ye[i], 2e-6);
    for (i = 0; i < 3; i++) CHECK_NEAR(dtr_tensor_grad(x)[i], ge[i], 2e-6);
}

/* x = [-1.5, 0.3, 2.0] (PyTorch 1.13, y = F.gelu(x, approximate=...); y.sum().backward()):
 *   approximate='none' (dtr_gelu_erf): y [-0.10021086, 0.18537343, 1.95449996],
 *                                      grad [-0.12746915, 0.73232776, 1.08523190]
 *   approximate='tanh' (dtr_gelu):     y [-0.10042843, 0.18537094, 1.95459771],
 *                                      grad [-0.12771082, 0.73229551, 1.08609927]
 * x = [-1, 0, 2, nan]: torch.abs(x) = [1, 0, 2, nan], grad of its sum
 * [-1, 0, 1, 0] (PyTorch 1.13: abs backward is grad * sgn(x), and sgn(nan) is 0) */
static void test_abs_gelu_erf(void) {
    static const float erf_y[3] = {-0.10021086037158966f, 0.1853734254837036f, 1.9544999599456787f};
    static const float erf_g[3] = {-0.12746915221214294f, 0.7323277592658997f, 1.085231900215149f};
    static const float tanh_y[3] = {-0.10042843222618103f, 0.18537093698978424f, 1.9545977115631104f};
    static const float tanh_g[3] = {-0.12771081924438477f, 0.7322955131530762f, 1.0860992670059204f};
    dtr_context *ctx = test_ctx(1);
    int64_t n4 = 4;
    dtr_tensor *a, *xa;
    check_unary_ref(ctx, dtr_gelu_erf, erf_y, erf_g);
    check_unary_ref(ctx, dtr_gelu, tanh_y, tanh_g);
    xa = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, &n4, (const float[]){-1.0f, 0.0f, 2.0f, NAN}));
    a = dtr_abs(ctx, xa);
    CHECK(dtr_tensor_get(a, 0) == 1.0f && dtr_tensor_get(a, 1) == 0.0f && dtr_tensor_get(a, 2) == 2.0f);
    CHECK(isnan(dtr_tensor_get(a, 3)));
    CHECK_OK(ctx, dtr_backward_from(ctx, a, (const float[]){1, 1, 1, 1}));
    CHECK(dtr_tensor_grad(xa)[0] == -1.0f && dtr_tensor_grad(xa)[1] == 0.0f && dtr_tensor_grad(xa)[2] == 1.0f);
    CHECK(dtr_tensor_grad(xa)[3] == 0.0f);
    dtr_context_destroy(ctx);
}

/* ---- exp, log, sqrt, pow, clamp, leaky ReLU, softplus, maximum, minimum and the two losses
 * against PyTorch 1.13's numbers (y = op(x); y.sum().backward(); x.grad), special points included ---- */

/* NaN where PyTorch has NaN, its infinity, else within 3e-7 relative */
static int torch_same(float v, double ref) {
    if (isnan(ref)) return isnan(v);
    if (isinf(ref)) return (double)v == ref;
    return fabs((double)v - ref) <= 3e-7 * (1.0 + fabs(ref));
}

typedef struct math_ref {
    const char *what;
    int which, n;
    float x[7], x2[7];   /* x2: maximum's and minimum's b, the losses' targets */
    double y[7], g[7], g2[7];
} math_ref;

static dtr_tensor *math_op(dtr_context *c, int which, dtr_tensor *a, dtr_tensor *b) {
    switch (which) {
    case 0: return dtr_exp(c, a);
    case 1: return dtr_log(c, a);
    case 2: return dtr_sqrt(c, a);
    case 3: return dtr_pow(c, a, 2.5f);
    case 4: return dtr_pow(c, a, 0.0f);
    case 5: return dtr_pow(c, a, -1.0f);
    case 6: return dtr_clamp(c, a, -0.5f, 0.3f);
    case 7: return dtr_clamp(c, a, 0.5f, -0.5f);
    case 8: return dtr_leaky_relu(c, a, 0.1f);
    case 9: return dtr_softplus(c, a, 2.0f, 1.0f);
    case 10: return dtr_softplus(c, a, 1.0f, 20.0f);
    case 11: return dtr_maximum(c, a, b);
    case 12: return dtr_minimum(c, a, b);
    case 13: return dtr_bce_with_logits(c, a, b);
    default: return dtr_huber_loss(c, a, b, 0.5f);
    }
}

static const math_ref k_math[] = {
    {"exp", 0, 6, {0, 1, -104, 89, NAN, -INFINITY}, {0}, {1, 2.7182817459106445, 0, INFINITY, NAN, 0},
     {1, 2.7182817459106445, 0, INFINITY, NAN, 0}, {0}},
    {"log", 1, 6, {1, 0, -1, INFINITY, NAN, 2}, {0}, {0, -INFINITY, NAN, INFINITY, NAN, 0.6931471824645996},
     {1, INFINITY, -1, 0, NAN, 0.5}, {0}},
    {"sqrt", 2, 5, {4, 0, -1, INFINITY, NAN}, {0}, {2, 0, NAN, INFINITY, NAN}, {0.25, INFINITY, NAN, 0, NAN}, {0}},
    {"pow 2.5", 3, 4, {4, 0, -1, NAN}, {0}, {32, 0, NAN, NAN}, {20, 0, NAN, NAN}, {0}},
    {"pow 0", 4, 3, {-2, 0, NAN}, {0}, {1, 1, 1}, {0, 0, 0}, {0}},
    {"pow -1", 5, 3, {-2, 0, 2}, {0}, {-0.5, INFINITY, 0.5}, {-0.25, -INFINITY, -0.25}, {0}},
    {"clamp", 6, 6, {-1, -0.5f, 0, 0.3f, 1, NAN}, {0}, {-0.5, -0.5, 0, 0.30000001192092896, 0.30000001192092896, NAN},
     {0, 1, 1, 1, 0, 0}, {0}},
    {"clamp, lo > hi", 7, 3, {-1, 0, 1}, {0}, {-0.5, -0.5, -0.5}, {0, 0, 0}, {0}},
    {"leaky_relu", 8, 5, {-2, 0, -0.0f, 3, NAN}, {0}, {-0.20000000298023224, 0, 0, 3, NAN},
     {0.10000000149011612, 0.10000000149011612, 0.10000000149011612, 1, 0.10000000149011612}, {0}},
    {"softplus beta 2 threshold 1", 9, 7, {-100, -1, 0, 0.5f, 0.51f, 10, NAN}, {0},
     {0, 0.06346400082111359, 0.3465735912322998, 0.65663081407547, 0.5099999904632568, 10, NAN},
     {0, 0.11920291930437088, 0.5, 0.7310585975646973, 1, 1, NAN}, {0}},
    {"softplus", 10, 4, {-100, 20, 20.5f, 100}, {0}, {3.783505853677006e-44, 20, 20.5, 100}, {3.783505853677006e-44, 1, 1, 1},
     {0}},
    {"maximum", 11, 5, {1, 2, 3, NAN, 1}, {2, 2, 1, 1, NAN}, {2, 2, 3, NAN, NAN}, {0, 0.5, 1, 1, 1}, {1, 0.5, 0, 1, 1}},
    {"minimum", 12, 5, {1, 2, 3, NAN, 1}, {2, 2, 1, 1, NAN}, {1, 2, 1, NAN, NAN}, {1, 0.5, 0, 1, 1}, {0, 0.5, 1, 1, 1}},
    {"bce_with_logits", 13, 6, {-30, -2, 0, 0.5f, 3, 40}, {1, 0, 0.5f, 1, 0, 1}, {5.723789215087891},
     {-0.1666666716337204, 0.019867153838276863, 0, -0.06292343884706497, 0.1587623506784439, 0},
     {5, 0.3333333432674408, 0, -0.0833333358168602, -0.5, -6.666666507720947}},
    {"huber_loss delta 0.5", 14, 6, {0, 0.2f, -0.5f, 1, 2.5f, -3}, {0, 0, 0, 0.5f, 0, 0}, {0.46166667342185974},
     {0, 0.03333333507180214, -0.0833333358168602, 0.0833333358168602, 0.0833333358168602, -0.0833333358168602},
     {0, -0.03333333507180214, 0.0833333358168602, -0.0833333358168602, -0.0833333358168602, 0.0833333358168602}},
};

static void check_math_ref(dtr_context *ctx, const math_ref *r) {
    int64_t n = r->n;
    int two = r->which >= 11, i;
    dtr_tensor *a = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, &n, r->x));
    dtr_tensor *b = two ? dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, &n, r->x2)) : NULL;
    dtr_tensor *y = math_op(ctx, r->which, a, b);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, y)));
    for (i = 0; i < (int)dtr_tensor_numel(y); i++)
        CHECK_MSG(torch_same(dtr_tensor_get(y, i), r->y[i]), "%s: y[%d] = %g, PyTorch %g", r->what, i,
                  (double)dtr_tensor_get(y, i), r->y[i]);
    for (i = 0; i < r->n; i++) {
        CHECK_MSG(torch_same(dtr_tensor_grad(a)[i], r->g[i]), "%s: grad[%d] = %g, PyTorch %g", r->what, i,
                  (double)dtr_tensor_grad(a)[i], r->g[i]);
        CHECK_MSG(!two || torch_same(dtr_tensor_grad(b)[i], r->g2[i]), "%s: grad of b[%d] = %g, PyTorch %g", r->what, i,
                  (double)dtr_tensor_grad(b)[i], r->g2[i]);
    }
    dtr_context_reset(ctx);
}

/* a bad argument of the new ops: a clear error code and no tensor (each from a clear context:
   the error is sticky) */
static dtr_tensor *math_bad(dtr_context *c, int i, dtr_tensor *x, dtr_tensor *w) {
    switch (i) {
    case 0: return dtr_clamp(c, x, NAN, 1.0f);
    case 1: return dtr_softplus(c, x, 0.0f, 20.0f);
    case 2: return dtr_huber_loss(c, x, x, -1.0f);
    case 3: return dtr_huber_loss(c, x, w, 1.0f);
    case 4: return dtr_bce_with_logits(c, x, w);
    case 5: return dtr_maximum(c, x, w);
    default: return dtr_minimum(c, x, NULL);
    }
}

static void check_math_errors(dtr_context *ctx) {
    static const dtr_result want[7] = {DTR_INVALID_ARGUMENT, DTR_INVALID_ARGUMENT, DTR_INVALID_ARGUMENT, DTR_SHAPE_MISMATCH,
                                       DTR_SHAPE_MISMATCH, DTR_SHAPE_MISMATCH, DTR_NULL_HANDLE};
    int64_t s3[1] = {3}, s4[1] = {4};
    dtr_tensor *x = dtr_tensor_zeros(ctx, DTR_F32, 1, s3), *w = dtr_tensor_zeros(ctx, DTR_F32, 1, s4);
    int i;
    for (i = 0; i < 7; i++) {
        dtr_tensor *t = math_bad(ctx, i, x, w);
        CHECK_MSG(t == NULL, "case %d gave a tensor", i);
        CHECK_MSG(dtr_context_status(ctx) == want[i], "case %d: %s (%s)", i, dtr_result_string(dtr_context_status(ctx)),
                  dtr_context_last_error(ctx));
        dtr_context_clear_error(ctx);
    }
}

static void test_math_ops(void) {
    dtr_context *ctx = test_ctx(1);
    size_t i;
    for (i = 0; i < sizeof k_math / sizeof k_math[0]; i++) check_math_ref(ctx, &k_math[i]);
    check_math_errors(ctx);
    dtr_context_destroy(ctx);
}

/* ---- the largest value along an axis ---- */

/* PyTorch 1.13's torch.max / torch.min / argmax / argmin over dim 1 of
   {{1, 3, 3, 2}, {nan, 5, 1, 7}, {-inf x 4}, {2, nan, 9, nan}}: the first of ties, a NaN wins
   (max and min); the gradient of sum(max) is one-hot at those indices */
static void test_max_argmax(void) {
    dtr_context *ctx = test_ctx(2);
    const float inf = INFINITY, nan = NAN;
    const float xs[16] = {1, 3, 3, 2, nan, 5, 1, 7, -inf, -inf, -inf, -inf, 2, nan, 9, nan};
    const int32_t want_max[4] = {1, 0, 0, 1}, want_min[4] = {0, 0, 0, 1};
    int64_t shape[2] = {4, 4};
    int32_t im[4], in[4];
    float v[4], vmin[4];
    dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, shape, xs)), *m, *a, *b;
    int k;
    m = dtr_max(ctx, x, 1, 0);
    a = dtr_argmax(ctx, x, -1, 0), b = dtr_argmin(ctx, x, 1, 1);
    CHECK(m && a && b && dtr_tensor_dtype(a) == DTR_I32 && dtr_tensor_ndim(b) == 2 && dtr_tensor_dim(b, 1) == 1);
    if (!m || !a || !b) { dtr_context_destroy(ctx); return; }
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, m)));
    dtr_tensor_read(m, DTR_F32, v, 4), dtr_tensor_read(dtr_min(ctx, x, 1, 0), DTR_F32, vmin, 4);
    dtr_tensor_read(a, DTR_I32, im, 4), dtr_tensor_read(b, DTR_I32, in, 4);
    CHECK(v[0] == 3.0f && v[1] != v[1] && v[2] == -inf && v[3] != v[3]);
    CHECK(vmin[0] == 1.0f && vmin[1] != vmin[1] && vmin[2] == -inf && vmin[3] != vmin[3]);
    for (k = 0; k < 4; k++) {
        CHECK_MSG(im[k] == want_max[k] && in[k] == want_min[k], "row %d: argmax %d argmin %d", k, im[k], in[k]);
        CHECK(dtr_tensor_grad(x)[4 * k + want_max[k]] == 1.0f);
    }
    CHECK(dtr_tensor_grad(x)[2] == 0.0f && dtr_tensor_grad(x)[15] == 0.0f);   /* the second of a tie; a later NaN */
    CHECK(dtr_max(ctx, x, 2, 0) == NULL && dtr_context_status(ctx) == DTR_INVALID_ARGUMENT);
    dtr_context_destroy(ctx);
}

/* torch.gather(x, 1, [[2, 2], [0, 1]]) of x = [[1, 2, 3], [4, 5, 6]] is [[3, 3], [4, 5]]; the
   gradient of its sum adds the repeat: [[0, 0, 2], [1, 1, 0]]; bad indices and shapes */
static void test_gather(void) {
    dtr_context *ctx = test_ctx(1);
    const float xs[6] = {1, 2, 3, 4, 5, 6}, want_g[6] = {0, 0, 2, 1, 1, 0};
    int32_t idx[6] = {2, 2, 0, 1, 0, 0};
    int64_t s[2] = {2, 3}, si[2] = {2, 2}, s3[2] = {3, 2};
    float y[4];
    dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, s, xs));
    dtr_tensor *g = dtr_gather(ctx, x, 1, dtr_tensor_from(ctx, DTR_I32, 2, si, idx));
    CHECK(g && dtr_tensor_dim(g, 0) == 2 && dtr_tensor_dim(g, 1) == 2);
    if (!g) { dtr_context_destroy(ctx); return; }
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, g)));
    dtr_tensor_read(g, DTR_F32, y, 4);
    CHECK(y[0] == 3.0f && y[1] == 3.0f && y[2] == 4.0f && y[3] == 5.0f);
    CHECK(memcmp(dtr_tensor_grad(x), want_g, sizeof want_g) == 0);
    idx[1] = 3;
    CHECK(dtr_gather(ctx, x, 1, dtr_tensor_from(ctx, DTR_I32, 2, si, idx)) == NULL && dtr_context_status(ctx) == DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_context_last_error(ctx), "outside [0, 3)") != NULL);
    dtr_context_clear_error(ctx);
    CHECK(dtr_gather(ctx, x, 1, dtr_tensor_from(ctx, DTR_I32, 2, s3, idx)) == NULL && dtr_context_status(ctx) == DTR_SHAPE_MISMATCH);
    dtr_context_clear_error(ctx);
    CHECK(dtr_gather(ctx, x, 1, x) == NULL && dtr_context_status(ctx) == DTR_DTYPE_MISMATCH);
    dtr_context_destroy(ctx);
}

/* F.interpolate(x, scale_factor=(1, 2), mode='nearest') of (1, 1, 2, 2) [[1, 2], [3, 4]]: each
   value twice along the row; the gradient of sum(y w) sums each block */
static void test_upsample(void) {
    dtr_context *ctx = test_ctx(1);
    const float xs[4] = {1, 2, 3, 4}, ws[8] = {1, 2, 3, 4, 5, 6, 7, 8}, want[8] = {1, 1, 2, 2, 3, 3, 4, 4};
    int64_t s[4] = {1, 1, 2, 2}, s8[4] = {1, 1, 2, 4}, s3[3] = {1, 2, 2};
    float y[8];
    dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 4, s, xs)), *u = dtr_upsample_nearest2d(ctx, x, 1, 2);
    CHECK(u && dtr_tensor_dim(u, 2) == 2 && dtr_tensor_dim(u, 3) == 4);
    if (!u) { dtr_context_destroy(ctx); return; }
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, u, dtr_tensor_from(ctx, DTR_F32, 4, s8, ws)))));
    dtr_tensor_read(u, DTR_F32, y, 8);
    CHECK(memcmp(y, want, sizeof want) == 0);
    CHECK(dtr_tensor_grad(x)[0] == 3.0f && dtr_tensor_grad(x)[1] == 7.0f && dtr_tensor_grad(x)[2] == 11.0f &&
          dtr_tensor_grad(x)[3] == 15.0f);
    CHECK(dtr_upsample_nearest2d(ctx, x, 0, 2) == NULL && dtr_context_status(ctx) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
    CHECK(dtr_upsample_nearest2d(ctx, dtr_tensor_zeros(ctx, DTR_F32, 3, s3), 2, 2) == NULL &&
          dtr_context_status(ctx) == DTR_SHAPE_MISMATCH);
    dtr_context_destroy(ctx);
}

/* ---- cross-entropy's settings ---- */

/* PyTorch 1.13 in double: F.cross_entropy(x, t, label_smoothing=0.2, reduction=...) with
   x[r][k] = 2 sin(0.7 (5r + k)) (4, 5), t = {1, -100, 3, 0}; backward of the loss (mean, sum)
   or of sum(loss * {0.5, -1, 2, 1.5}) (none) */
static const double k_xs_loss[3][4] = {{2.39612016}, {7.18836049}, {1.7072082, 0, 2.22898361, 3.25216867}};
static const double k_xs_grad[3][20] = {
    {0.0038674907, -0.21761077, 0.110119202, 0.083343715, 0.0202803623, 0, 0, 0, 0, 0, 0.0525170572, 0.11437495, 0.0844359037,
     -0.246497874, -0.00483003691, -0.269545825, -0.00476530619, 0.00430577912, 0.0516180508, 0.218387301},
    {0.0116024721, -0.65283231, 0.330357606, 0.250031145, 0.0608410869, 0, 0, 0, 0, 0, 0.157551172, 0.343124851, 0.253307711,
     -0.739493623, -0.0144901107, -0.808637474, -0.0142959186, 0.0129173374, 0.154854152, 0.655161903},
    {0.00580123606, -0.326416155, 0.165178803, 0.125015573, 0.0304205435, 0, 0, 0, 0, 0, 0.315102343, 0.686249702, 0.506615422,
     -1.47898725, -0.0289802214, -1.21295621, -0.0214438779, 0.0193760061, 0.232281229, 0.982742855}};

static void check_xent_settings(dtr_context *ctx, dtr_loss_reduction red) {
    static const int32_t t[4] = {1, -100, 3, 0};
    static const float w[4] = {0.5f, -1.0f, 2.0f, 1.5f};
    int64_t xs[2] = {4, 5}, n = 4;
    float xv[20], yv[4];
    dtr_xent_config c = dtr_xent_config_init();
    dtr_tensor *x, *y;
    int k, ny = red == DTR_LOSS_NONE ? 4 : 1;
    for (k = 0; k < 20; k++) xv[k] = (float)(2.0 * sin(0.7 * k));
    c.label_smoothing = 0.2f, c.reduction = red;
    x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 2, xs, xv));
    y = dtr_cross_entropy_ex(ctx, x, dtr_tensor_from(ctx, DTR_I32, 1, &n, t), &c);   /* -100: ignored by default */
    CHECK_OK(ctx, dtr_backward(ctx, red == DTR_LOSS_NONE ? dtr_sum_all(ctx, dtr_mul(ctx, y, dtr_tensor_from(ctx, DTR_F32, 1, &n, w)))
                                                        : y));
    CHECK(dtr_tensor_numel(y) == ny && dtr_tensor_ndim(y) == (red == DTR_LOSS_NONE ? 1 : 0));
    dtr_tensor_read(y, DTR_F32, yv, (size_t)ny);
    for (k = 0; k < ny; k++) CHECK_NEAR(yv[k], k_xs_loss[red][k], 2e-6 * (1 + fabs(k_xs_loss[red][k])));
    for (k = 0; k < 20; k++) CHECK_NEAR(dtr_tensor_grad(x)[k], k_xs_grad[red][k], 2e-6);
    dtr_context_reset(ctx);
}

static void test_xent_settings(void) {
    dtr_context *ctx = test_ctx(2);
    dtr_xent_config c = dtr_xent_config_init();
    int32_t t[3] = {5, 5, 5};
    int64_t xs[2] = {3, 4}, n = 3;
    dtr_tensor *x, *y;
    check_xent_settings(ctx, DTR_LOSS_MEAN);
    check_xent_settings(ctx, DTR_LOSS_SUM);
    check_xent_settings(ctx, DTR_LOSS_NONE);
    c.ignore_index = 5;   /* every row ignored: 0 and no gradient (PyTorch: NaN) */
    x = dtr_tensor_requires_grad(dtr_tensor_full(ctx, 2, xs, 1.0f));
    y = dtr_cross_entropy_ex(ctx, x, dtr_tensor_from(ctx, DTR_I32, 1, &n, t), &c);
    CHECK_OK(ctx, dtr_backward(ctx, y));
    CHECK(dtr_tensor_get(y, 0) == 0.0f && dtr_tensor_grad(x)[0] == 0.0f && dtr_tensor_grad(x)[11] == 0.0f);
    c.ignore_index = -100, t[1] = -1;   /* a negative target that is not ignored */
    y = dtr_cross_entropy_ex(ctx, x, dtr_tensor_from(ctx, DTR_I32, 1, &n, t), &c);
    CHECK(y == NULL || dtr_context_status(ctx) == DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_context_last_error(ctx), "outside") != NULL);
    dtr_context_clear_error(ctx);
    c.label_smoothing = 1.0f;
    CHECK(dtr_cross_entropy_ex(ctx, x, dtr_tensor_from(ctx, DTR_I32, 1, &n, t), &c) == NULL);
    CHECK(dtr_context_status(ctx) == DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(ctx);
    c.label_smoothing = 0.0f, c.reduction = (dtr_loss_reduction)3;
    CHECK(dtr_cross_entropy_ex(ctx, x, dtr_tensor_from(ctx, DTR_I32, 1, &n, t), &c) == NULL);
    CHECK(dtr_context_status(ctx) == DTR_INVALID_ARGUMENT);
    dtr_context_destroy(ctx);
}

/* Every op's stored id and name, written out: traces and checkpoints keep the numbers, so
 * an entry of the op list moved or renamed fails here (a new op adds a line at the end). */
static const char *const k_op_ids[] = {
    "none", "add", "sub", "mul", "div", "scale", "relu", "gelu", "tanh", "sigmoid",           /*  0.. 9 */
    "matmul", "linear", "softmax", "log_softmax", "softmax_causal", "cross_entropy", "mse",   /* 10..16 */
    "sum", "mean", "sum_all", "mean_all", "embedding", "layernorm", "dropout", "conv2d",      /* 17..24 */
    "maxpool2d", "avgpool2d", "cast", "reshape", "permute", "slice", "concat", "contiguous",  /* 25..32 */
    "abs", "gelu_erf", "tp_copy", "tp_reduce", "vocab_cross_entropy", "tp_gather",            /* 33..38 */
    "checkpoint", "attention", "silu", "rmsnorm", "rope",                                     /* 39..43 */
    "exp", "log", "sqrt", "pow", "clamp", "leaky_relu", "softplus", "maximum", "minimum",     /* 44..52 */
    "batchnorm", "lstm_cell", "conv_transpose2d", "max", "argmax", "gather",                  /* 53..58 */
    "upsample_nearest", "lstm", "gru"                                                         /* 59..61 */
};

static void test_op_names(void) {
    dtr_context *ctx = test_ctx(1);
    int64_t s[1] = {2};
    dtr_tensor *t;
    int op;
    CHECK_EQ_INT(DTR_OP_COUNT, (int)(sizeof(k_op_ids) / sizeof(k_op_ids[0])));
    for (op = 0; op < DTR_OP_COUNT && op < (int)(sizeof(k_op_ids) / sizeof(k_op_ids[0])); op++)
        CHECK_MSG(strcmp(dtr__op_name(op), k_op_ids[op]) == 0, "op %d is '%s', stored traces say '%s'", op,
                  dtr__op_name(op), k_op_ids[op]);
    CHECK(strcmp(dtr__op_name(DTR_OP_COUNT), "?") == 0 && strcmp(dtr__op_name(-1), "?") == 0);
    CHECK_EQ_INT(DTR_OP_ADD, 1);          /* stored ids do not move */
    CHECK_EQ_INT(DTR_OP_CONTIGUOUS, 32);
    CHECK_EQ_INT(DTR_OP_ABS, 33);
    CHECK_EQ_INT(DTR_OP_TP_REDUCE, 36);
    CHECK_EQ_INT(DTR_OP_VOCAB_CROSS_ENTROPY, 37);
    CHECK_EQ_INT(DTR_OP_TP_GATHER, 38);
    CHECK_EQ_INT(DTR_OP_CHECKPOINT, 39);
    CHECK_EQ_INT(DTR_OP_ATTENTION, 40);
    /* a kernel's range check names its op */
    t = dtr_cross_entropy(ctx, dtr_tensor_zeros(ctx, DTR_F32, 2, (const int64_t[]){2, 3}),
                          dtr_tensor_from(ctx, DTR_I32, 1, s, (const int32_t[]){1, 7}));
    CHECK(t == NULL && dtr_context_status(ctx) == DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_context_last_error(ctx), "dtr_cross_entropy: target 1 is 7") != NULL);
    dtr_context_destroy(ctx);
}

static void test_backend_caps(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_event *ev = (dtr_event *)1;
    int done = 0, op;
    CHECK(ctx->backend->struct_size == sizeof(dtr_backend));
    CHECK(ctx->backend->caps & DTR__CAP_HOST_MEMORY);
    CHECK(!(ctx->backend->caps & DTR__CAP_ASYNC));
    for (op = 1; op < DTR_OP_COUNT; op++) CHECK_MSG(ctx->backend->supports_op(ctx, op), "op %s", dtr__op_name(op));
    CHECK(!ctx->backend->supports_op(ctx, 0) && !ctx->backend->supports_op(ctx, DTR_OP_COUNT));
    CHECK_OK(ctx, ctx->backend->event_record(ctx, &ev));
    CHECK(ev == NULL);
    CHECK_OK(ctx, dtr_event_wait(ctx, ev));
    CHECK_OK(ctx, dtr_event_query(ctx, ev, &done));
    CHECK(done == 1);
    CHECK_EQ_INT(dtr_event_query(ctx, ev, NULL), DTR_NULL_HANDLE);
    CHECK(strcmp(dtr_result_string(DTR_DEVICE_ERROR), "device error") == 0);
    CHECK(strcmp(dtr_result_string(DTR_DEVICE_OUT_OF_MEMORY), "device out of memory") == 0);
    CHECK(DTR_DEVICE_ERROR != DTR_UNSUPPORTED);
    {   /* the backend's reduction (collectives use it) adds in f32 and divides last */
        float a[3] = {1, 2, 3}, b[3] = {4, 5, 6}, out[3];
        CHECK_OK(ctx, ctx->backend->reduce(ctx, out, a, b, 3, DTR_F32, DTR_REDUCE_AVG, 2));
        CHECK(out[0] == 2.5f && out[1] == 3.5f && out[2] == 4.5f);
    }
    dtr_context_destroy(ctx);
}

/* dtr_rmsnorm and dtr_silu against their definitions in double (PyTorch's nn.RMSNorm and
 * F.silu): x / sqrt(mean(x^2) + eps) * w, x / (1 + exp(-x)); the layer's weight starts at 1
 * and its eps is 1e-6. (Their gradients: test_grad's finite differences.) */
static void test_rmsnorm_silu(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_rmsnorm_layer l;
    int64_t xs[2] = {2, 5}, ws = 5, r, k;
    float xv[10] = {0.5f, -1.25f, 2.0f, 0.0f, 3.5f, -0.1f, 0.2f, -0.3f, 0.05f, 0.4f}, wv[5] = {1.0f, 0.5f, -2.0f, 1.5f, 0.25f};
    float y[10], s[10], yl[10];
    double worst = 0.0;
    dtr_tensor *x = dtr_tensor_from(ctx, DTR_F32, 2, xs, xv);
    CHECK_OK(ctx, dtr_tensor_read(dtr_rmsnorm(ctx, x, dtr_tensor_from(ctx, DTR_F32, 1, &ws, wv), 1e-5f), DTR_F32, y, 10));
    CHECK_OK(ctx, dtr_tensor_read(dtr_silu(ctx, x), DTR_F32, s, 10));
    for (r = 0; r < 2; r++) {
        double ms = 0.0;
        for (k = 0; k < 5; k++) ms += (double)xv[r * 5 + k] * xv[r * 5 + k] / 5.0;
        for (k = 0; k < 5; k++) {
            double ref = xv[r * 5 + k] / sqrt(ms + 1e-5) * wv[k], sref = xv[r * 5 + k] / (1.0 + exp(-(double)xv[r * 5 + k]));
            worst = fmax(worst, fabs(y[r * 5 + k] - ref) / (1.0 + fabs(ref)));
            worst = fmax(worst, fabs(s[r * 5 + k] - sref) / (1.0 + fabs(sref)));
        }
    }
    CHECK_MSG(worst < 1e-6, "rmsnorm / silu differ from their definitions by %.3g", worst);
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    CHECK_OK(ctx, dtr_rmsnorm_layer_init(&l, m, "norm", 5));
    CHECK(l.eps == 1e-6f);
    CHECK_OK(ctx, dtr_tensor_read(dtr_rmsnorm_layer_forward(ctx, &l, x), DTR_F32, yl, 10));
    {
        double ms = 0.0;
        for (k = 0; k < 5; k++) ms += (double)xv[k] * xv[k] / 5.0;
        CHECK(fabs(yl[2] - xv[2] / sqrt(ms + 1e-6)) < 1e-6);
    }
    CHECK(dtr_rmsnorm(ctx, x, NULL, 0.0f) == NULL && dtr_context_status(ctx) == DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_context_last_error(ctx), "dtr_rmsnorm: eps must be > 0") != NULL);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* dtr_rope against its definition in double (both pairings), and its point: after RoPE the
 * score of a query at position t1 and a key at t2 depends on t1 - t2 only (the same vectors
 * placed at (7, 3) and (12, 8) score the same, to rounding; at (7, 4) they do not). */
static void rope_at(dtr_context *ctx, const float *v, int64_t T, int interleaved, float *out) {
    int64_t s[3] = {1, T, 8};
    CHECK_OK(ctx, dtr_tensor_read(dtr_rope(ctx, dtr_tensor_from(ctx, DTR_F32, 3, s, v), 2, 10000.0f, interleaved), DTR_F32, out,
                                  (size_t)(T * 8)));
}
static double rope_score(dtr_context *ctx, const float *q, const float *k, int64_t tq, int64_t tk) {
    static float xq[16 * 8], xk[16 * 8], yq[16 * 8], yk[16 * 8];
    double dot = 0.0;
    int i;
    memset(xq, 0, sizeof xq), memset(xk, 0, sizeof xk);
    memcpy(xq + tq * 8, q, 8 * sizeof(float)), memcpy(xk + tk * 8, k, 8 * sizeof(float));
    rope_at(ctx, xq, 16, 0, yq);
    rope_at(ctx, xk, 16, 0, yk);
    for (i = 0; i < 8; i++) dot += (double)yq[tq * 8 + i] * yk[tk * 8 + i];
    return dot;
}
static void test_rope(void) {
    dtr_context *ctx = test_ctx(2);
    static const float q[8] = {0.3f, -1.2f, 0.7f, 0.5f, 2.0f, -0.4f, 0.1f, 1.1f}, k[8] = {-0.6f, 0.9f, 0.2f, -1.5f, 0.8f, 0.3f, -0.7f, 0.4f};
    float x[5 * 8], y[5 * 8];
    double worst = 0.0;
    int il, t, h, j;
    for (t = 0; t < 40; t++) x[t] = (float)((t * 29) % 13) / 6.5f - 1.0f;
    for (il = 0; il < 2; il++) {
        rope_at(ctx, x, 5, il, y);
        for (t = 0; t < 5; t++)
            for (h = 0; h < 2; h++)
                for (j = 0; j < 2; j++) {   /* head width 4: two pairs */
                    int a = t * 8 + h * 4 + (il ? 2 * j : j), b = t * 8 + h * 4 + (il ? 2 * j + 1 : j + 2);
                    double ang = t * pow(10000.0, -2.0 * j / 4.0), ra = x[a] * cos(ang) - x[b] * sin(ang), rb = x[a] * sin(ang) + x[b] * cos(ang);
                    worst = fmax(worst, fmax(fabs(y[a] - ra), fabs(y[b] - rb)));
                }
    }
    CHECK_MSG(worst < 1e-6, "rope differs from its definition by %.3g", worst);
    CHECK_NEAR(rope_score(ctx, q, k, 7, 3), rope_score(ctx, q, k, 12, 8), 1e-5);
    CHECK(fabs(rope_score(ctx, q, k, 7, 3) - rope_score(ctx, q, k, 7, 4)) > 1e-2);
    dtr_context_destroy(ctx);
}

/* dtr_attention_layer: causal (init's), position 0's output does not move when the last
 * position's input does; with causal = 0 (an encoder's) it does, and every position equals
 * dtr_attention_ex with a config that is not causal on the layer's own slices. */
static void attention_layer_outputs(int causal, float last, float *y0, float *yall) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_attention_layer l;
    int64_t xs[3] = {1, 6, 8}, i;
    float xv[48];
    dtr_tensor *x, *y;
    for (i = 0; i < 48; i++) xv[i] = (float)((i * 37) % 17) / 17.0f - 0.5f;
    xv[47] = last;
    CHECK_OK(ctx, dtr_model_create(ctx, 3, &m));
    CHECK_OK(ctx, dtr_attention_layer_init(&l, m, "attn", 8, 2));
    CHECK_EQ_INT(l.causal, 1);
    CHECK_OK(ctx, dtr_model_build(m));
    l.causal = causal;
    x = dtr_tensor_from(ctx, DTR_F32, 3, xs, xv);
    y = dtr_attention_layer_forward(ctx, &l, x);
    CHECK(y != NULL);
    if (y) CHECK_OK(ctx, dtr_tensor_read(y, DTR_F32, yall, 48));
    memcpy(y0, yall, 8 * sizeof(float));
    if (!causal && y) {   /* the same through dtr_attention_ex on the projection's slices */
        dtr_attention_config cfg = dtr_attention_config_init(2, 0);
        dtr_tensor *qkv = dtr_linear_layer_forward(ctx, &l.qkv, x);
        dtr_tensor *a = dtr_attention_ex(ctx, dtr_slice(ctx, qkv, -1, 0, 8), dtr_slice(ctx, qkv, -1, 8, 16), dtr_slice(ctx, qkv, -1, 16, 24), &cfg);
        float ref[48];
        CHECK_OK(ctx, dtr_tensor_read(dtr_linear_layer_forward(ctx, &l.proj, a), DTR_F32, ref, 48));
        CHECK(memcmp(ref, yall, sizeof ref) == 0);
    }
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

static void test_attention_layer_causal(void) {
    float a[8], b[8], all[48];
    attention_layer_outputs(1, 0.25f, a, all);
    attention_layer_outputs(1, -3.0f, b, all);
    CHECK_MSG(memcmp(a, b, sizeof a) == 0, "causal: position 0 saw the last position");
    attention_layer_outputs(0, 0.25f, a, all);
    attention_layer_outputs(0, -3.0f, b, all);
    CHECK_MSG(memcmp(a, b, sizeof a) != 0, "not causal: position 0 did not see the last position");
}

/* The fused attention op against the same math built from public ops (matmul, softmax or
 * softmax_causal, scale, permute; dropout: dtr_dropout of ones (B, H, Tq, Tk) times the
 * weights): outputs and the gradients of q, k, v agree to 1e-5 over three tiles of queries,
 * causal, not causal, and cross-attention with fewer and more keys than queries and a scale
 * of the app's; and its arena peak at T = 512 is far below the composite's, which holds
 * (B, H, Tq, Tk) scores and probabilities. */
static dtr_tensor *attention_heads(dtr_context *ctx, dtr_tensor *x, int heads) {
    static const int to_heads[4] = {0, 2, 1, 3};
    int64_t shape[4];
    shape[0] = x->shape[0]; shape[1] = x->shape[1]; shape[2] = heads; shape[3] = x->shape[2] / heads;
    return dtr_permute(ctx, dtr_reshape(ctx, x, 4, shape), to_heads);
}
static dtr_tensor *attention_composite(dtr_context *ctx, dtr_tensor *q, dtr_tensor *k, dtr_tensor *v, const dtr_attention_config *c) {
    static const int to_heads[4] = {0, 2, 1, 3};
    float scale = c->scale != 0.0f ? c->scale : 1.0f / sqrtf((float)(q->shape[2] / c->heads));
    dtr_tensor *s = dtr_scale(ctx, dtr_matmul(ctx, attention_heads(ctx, q, c->heads), dtr_transpose(ctx, attention_heads(ctx, k, c->heads), 2, 3)), scale);
    dtr_tensor *att = c->causal ? dtr_softmax_causal(ctx, s) : dtr_softmax(ctx, s);
    dtr_tensor *y;
    if (c->dropout > 0.0f) {   /* dtr_dropout's mask over (B, mask_heads, Tq, Tk), these heads' share of it */
        int64_t ms[4] = {q->shape[0], c->mask_heads ? c->mask_heads : c->heads, q->shape[1], k->shape[1]};
        dtr_tensor *mask = dtr_dropout(ctx, dtr_tensor_full(ctx, 4, ms, 1.0f), c->dropout);
        att = dtr_mul(ctx, att, dtr_slice(ctx, mask, 1, c->mask_head0, c->mask_head0 + c->heads));
    }
    y = dtr_contiguous(ctx, dtr_permute(ctx, dtr_matmul(ctx, att, attention_heads(ctx, v, c->heads)), to_heads));
    int64_t shape[3];
    memcpy(shape, q->shape, sizeof shape);
    return dtr_reshape(ctx, y, 3, shape);
}

/* one run: q (B, Tq, C), k and v (B, Tk, C) of fixed random values; y and the gradients of
   sum(y * y) into out and grads (q's, then k's and v's) */
static void attention_run(int fused, int64_t B, int64_t Tq, int64_t Tk, int64_t C, const dtr_attention_config *cfg, float *out,
                          float *grads, size_t *peak) {
    dtr_context *ctx = test_ctx(2);
    int64_t len[3] = {Tq, Tk, Tk}, at = 0, i;
    float *data = (float *)malloc((size_t)(B * (Tq + 2 * Tk) * C) * sizeof(float));
    dtr_tensor *x[3], *y, *loss;
    dtr_rng r;
    int k;
    dtr_rng_seed(&r, 21, 1);
    for (i = 0; i < B * (Tq + 2 * Tk) * C; i++) data[i] = dtr_rng_uniform(&r) * 2.0f - 1.0f;
    for (k = 0; k < 3; at += B * len[k] * C, k++) {
        int64_t shape[3] = {B, len[k], C};
        x[k] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, shape, data + at));
    }
    dtr_context_arena_peak(ctx, 1);
    y = fused ? dtr_attention_ex(ctx, x[0], x[1], x[2], cfg) : attention_composite(ctx, x[0], x[1], x[2], cfg);
    loss = dtr_sum_all(ctx, dtr_mul(ctx, y, y));
    CHECK_OK(ctx, dtr_backward(ctx, loss));
    *peak = dtr_context_arena_peak(ctx, 0);
    if (out) CHECK_OK(ctx, dtr_tensor_read(y, DTR_F32, out, (size_t)(B * Tq * C)));
    for (k = 0, at = 0; grads && k < 3; at += B * len[k] * C, k++)
        memcpy(grads + at, dtr_tensor_grad(x[k]), (size_t)(B * len[k] * C) * sizeof(float));
    free(data);
    dtr_context_destroy(ctx);
}

/* largest |a - b| / (1 + |b|) of the fused op and the composite (outputs, gradients) */
static double attention_gap(int64_t B, int64_t Tq, int64_t Tk, int64_t C, const dtr_attention_config *cfg) {
    int64_t n = B * (2 * Tq + 2 * Tk) * C;   /* y, then the three gradients */
    float *a = (float *)malloc((size_t)n * 2 * sizeof(float)), *b = a + n;
    double worst = 0.0;
    size_t peak;
    attention_run(1, B, Tq, Tk, C, cfg, a, a + B * Tq * C, &peak);
    attention_run(0, B, Tq, Tk, C, cfg, b, b + B * Tq * C, &peak);
    worst = test_rel_gap(a, b, n);
    free(a);
    return worst;
}

/* y (nq floats), then the gradients of x[0] (nq), x[1] and x[2] (nk each) into out */
static void attention_outputs(dtr_tensor *y, dtr_tensor **x, float *out, int64_t nq, int64_t nk) {
    CHECK(dtr_tensor_read(y, DTR_F32, out, (size_t)nq) == DTR_OK);
    CHECK(dtr_tensor_read_grad(x[0], out + nq, (size_t)nq) == DTR_OK);
    CHECK(dtr_tensor_read_grad(x[1], out + 2 * nq, (size_t)nk) == DTR_OK);
    CHECK(dtr_tensor_read_grad(x[2], out + 2 * nq + nk, (size_t)nk) == DTR_OK);
}

/* Key lengths: the fused op with item b's keys cut at lens[b] (not causal) against the
   composite of each item alone on its first lens[b] keys; the padding keys' gradients are 0.
   q (B, Tq, C), k, v (B, Tk, C) of fixed random values, loss sum(y * y). */
static double attention_lens_gap(int64_t B, int64_t Tq, int64_t Tk, int64_t C, const int32_t *lens) {
    dtr_context *ctx = test_ctx(2);
    int64_t sq[3] = {B, Tq, C}, sk[3] = {B, Tk, C}, nq = B * Tq * C, nk = B * Tk * C, i, b;
    int64_t n = 2 * nq + 2 * nk;   /* y, then the gradients of q, k, v */
    float *data = (float *)malloc((size_t)(nq + 2 * nk + 2 * n) * sizeof(float)), *fused = data + nq + 2 * nk, *comp = fused + n;
    dtr_tensor *x[3], *y, *parts[8];
    dtr_attention_config cfg = dtr_attention_config_init(2, 0);
    dtr_rng r;
    double worst = 0.0;
    int k;
    dtr_rng_seed(&r, 5, 1);
    for (i = 0; i < nq + 2 * nk; i++) data[i] = dtr_rng_uniform(&r) * 2.0f - 1.0f;
    for (k = 0; k < 3; k++) x[k] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, k ? sk : sq, data + (k ? nq + (k - 1) * nk : 0)));
    cfg.key_lengths = dtr_tensor_from(ctx, DTR_I32, 1, &B, lens);
    y = dtr_attention_ex(ctx, x[0], x[1], x[2], &cfg);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, y, y))));
    attention_outputs(y, x, fused, nq, nk);
    for (b = 0, k = 0; b < B; b++)   /* the padding keys' gradients: k counts those that are not 0 */
        for (i = lens[b] * C; i < Tk * C; i++) k += fused[2 * nq + b * Tk * C + i] != 0.0f || fused[2 * nq + nk + b * Tk * C + i] != 0.0f;
    CHECK_MSG(k == 0, "%d gradients of padding keys are not 0", k);
    dtr_context_reset(ctx);
    for (k = 0; k < 3; k++) x[k] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, k ? sk : sq, data + (k ? nq + (k - 1) * nk : 0)));
    cfg.key_lengths = NULL;
    for (b = 0; b < B && b < 8; b++) {
        dtr_tensor *qb = dtr_slice(ctx, x[0], 0, b, b + 1), *kb = dtr_slice(ctx, dtr_slice(ctx, x[1], 0, b, b + 1), 1, 0, lens[b]);
        parts[b] = attention_composite(ctx, qb, kb, dtr_slice(ctx, dtr_slice(ctx, x[2], 0, b, b + 1), 1, 0, lens[b]), &cfg);
    }
    y = dtr_concat(ctx, parts, (int)B, 0);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, y, y))));
    attention_outputs(y, x, comp, nq, nk);
    worst = test_rel_gap(fused, comp, n);
    free(data);
    dtr_context_destroy(ctx);
    return worst;
}

/* Grouped-query attention: the fused op with kv_heads against the composite on k and v whose
   heads are repeated (q head h reads kv head h / rep): outputs and gradients (k's and v's summed
   over their group by the composite's autograd), causal, 6 heads over 2 and 3 kv heads. */
static double attention_gqa_gap(int64_t B, int64_t T, int64_t D, int heads, int kv) {
    dtr_context *ctx = test_ctx(2);
    int64_t sq[3] = {B, T, heads * D}, sk[3] = {B, T, kv * D}, nq = B * T * heads * D, nk = B * T * kv * D, n = 2 * nq + 2 * nk, i;
    float *data = (float *)malloc((size_t)(nq + 2 * nk + 2 * n) * sizeof(float)), *fused = data + nq + 2 * nk, *comp = fused + n;
    dtr_tensor *x[3], *y, *rk[16], *rv[16];
    dtr_attention_config cfg = dtr_attention_config_init(heads, 1);
    dtr_rng r;
    double worst = 0.0;
    int k, pass, h;
    dtr_rng_seed(&r, 9, 1);
    for (i = 0; i < nq + 2 * nk; i++) data[i] = dtr_rng_uniform(&r) * 2.0f - 1.0f;
    for (pass = 0; pass < 2; pass++) {
        for (k = 0; k < 3; k++) x[k] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, k ? sk : sq, data + (k ? nq + (k - 1) * nk : 0)));
        cfg.kv_heads = pass ? 0 : kv;
        for (h = 0; pass && h < heads && h < 16; h++) {   /* the composite's k and v: kv head h / rep for q head h */
            int g = h / (heads / kv);
            rk[h] = dtr_slice(ctx, x[1], -1, g * D, (g + 1) * D), rv[h] = dtr_slice(ctx, x[2], -1, g * D, (g + 1) * D);
        }
        y = pass ? dtr_attention_ex(ctx, x[0], dtr_concat(ctx, rk, heads, -1), dtr_concat(ctx, rv, heads, -1), &cfg)
                 : dtr_attention_ex(ctx, x[0], x[1], x[2], &cfg);
        CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, y, y))));
        attention_outputs(y, x, pass ? comp : fused, nq, nk);
        dtr_context_reset(ctx);
    }
    worst = test_rel_gap(fused, comp, n);
    free(data);
    dtr_context_destroy(ctx);
    return worst;
}

/* Queries from a key position on (a KV-cache step): Tq queries with q_start s against Tk keys
   equal rows s .. s + Tq - 1 of causal self-attention over the first N = s + Tq positions, with
   the loss on those rows only: outputs, dq, dk and dv of the N keys to 1e-6. Keys past N hold
   NaN: never read (their gradients stay 0). */
static double attention_at_gap(int64_t B, int64_t Tq, int64_t s, int64_t Tk, int64_t C) {
    dtr_context *ctx = test_ctx(2);
    int64_t N = s + Tq, sq[3] = {B, Tq, C}, sk[3] = {B, Tk, C}, sf[3] = {B, N, C}, nq = B * Tq * C, nk = B * Tk * C, i, b, t;
    float *q = (float *)malloc((size_t)(B * N * C + 2 * nk + 2 * (2 * nq + 2 * nk)) * sizeof(float)), *kv = q + B * N * C;
    float *win = kv + 2 * nk, *full = win + 2 * nq + 2 * nk;
    dtr_tensor *x[3], *leaf[3], *y;
    dtr_attention_config cfg = dtr_attention_config_init(2, 1);
    dtr_rng r;
    double worst = 0.0, gap;
    int k, bad = 0;
    dtr_rng_seed(&r, 33, 1);
    for (i = 0; i < B * N * C + 2 * nk; i++) q[i] = dtr_rng_uniform(&r) * 2.0f - 1.0f;
    for (b = 0; b < 2 * B; b++)
        for (i = N * C; i < Tk * C; i++) kv[b * Tk * C + i] = NAN;
    for (b = 0; b < B; b++) memcpy(win + b * Tq * C, q + (b * N + s) * C, (size_t)(Tq * C) * sizeof(float));   /* the window's q */
    x[0] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, sq, win));
    for (k = 1; k < 3; k++) x[k] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, sk, kv + (k - 1) * nk));
    cfg.q_start = s;
    y = dtr_attention_ex(ctx, x[0], x[1], x[2], &cfg);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, y, y))));
    attention_outputs(y, x, win, nq, nk);
    for (i = 0; i < 2 * nk; i++) bad += (i % (Tk * C)) >= N * C && win[2 * nq + i] != 0.0f;
    CHECK_MSG(bad == 0, "%d gradients of keys past the queries' reach are not 0", bad);
    dtr_context_reset(ctx);
    x[0] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, sf, q));
    for (k = 1; k < 3; k++) {
        leaf[k] = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 3, sk, kv + (k - 1) * nk));
        x[k] = dtr_slice(ctx, leaf[k], 1, 0, N);
    }
    y = dtr_slice(ctx, dtr_attention(ctx, x[0], x[1], x[2], 2), 1, s, N);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, y, y))));
    CHECK_OK(ctx, dtr_tensor_read(y, DTR_F32, full, (size_t)nq));
    for (b = 0; b < B; b++)
        for (t = 0; t < Tq; t++) memcpy(full + nq + (b * Tq + t) * C, dtr_tensor_grad(x[0]) + (b * N + s + t) * C, (size_t)C * sizeof(float));
    for (k = 1; k < 3; k++)
        for (b = 0; b < B; b++)   /* the keys' gradients: rows 0 .. N-1 of each item */
            for (i = 0; i < N * C; i++) {
                double a = win[2 * nq + (k - 1) * nk + b * Tk * C + i], e = dtr_tensor_grad(leaf[k])[b * Tk * C + i];
                worst = fmax(worst, fabs(a - e) / (1.0 + fabs(e)));
            }
    gap = test_rel_gap(win, full, 2 * nq);
    if (!(gap <= worst)) worst = gap;   /* NaN too */
    free(q);
    dtr_context_destroy(ctx);
    return worst;
}

/* After attention with dropout over `all` heads' mask (B 2, Tq 3, Tk 4), the context's next
   draws are those after dtr_dropout of B all Tq Tk elements (a second context, the same seed). */
static void attention_dropout_stream(void) {
    static const int64_t sq[3] = {2, 3, 4}, sk[3] = {2, 4, 4}, n10 = 10;
    int all;
    for (all = 2; all <= 4; all += 2) {
        dtr_context *a = test_ctx(1), *b = test_ctx(1);
        dtr_attention_config cfg = dtr_attention_config_init(2, 0);
        int64_t whole = 2 * all * 3 * 4;
        float after_a[10], after_b[10];
        cfg.dropout = 0.5f, cfg.mask_heads = all, cfg.mask_head0 = all - 2;
        CHECK(dtr_attention_ex(a, dtr_tensor_full(a, 3, sq, 0.5f), dtr_tensor_full(a, 3, sk, 0.25f), dtr_tensor_full(a, 3, sk, 1.0f), &cfg));
        CHECK(dtr_dropout(b, dtr_tensor_full(b, 1, &whole, 1.0f), 0.5f));
        CHECK_OK(a, dtr_tensor_read(dtr_dropout(a, dtr_tensor_full(a, 1, &n10, 1.0f), 0.5f), DTR_F32, after_a, 10));
        CHECK_OK(b, dtr_tensor_read(dtr_dropout(b, dtr_tensor_full(b, 1, &n10, 1.0f), 0.5f), DTR_F32, after_b, 10));
        CHECK_MSG(memcmp(after_a, after_b, sizeof after_a) == 0, "mask of %d heads: the stream is not where the whole mask leaves it", all);
        dtr_context_destroy(a);
        dtr_context_destroy(b);
    }
}

/* Evaluation mode: dropout 0.5 gives the bits of dropout 0 and leaves the stream; dropout 1,
   a negative one and a share past mask_heads are DTR_INVALID_ARGUMENT. */
static void attention_dropout_eval_and_errors(void) {
    static const int64_t sh[3] = {2, 5, 4};
    dtr_context *ctx = test_ctx(1);
    dtr_attention_config cfg = dtr_attention_config_init(2, 1);
    dtr_tensor *x[3];
    dtr_state_entry e;
    dtr_rng before;
    float y0[40], y1[40];
    int k;
    for (k = 0; k < 3; k++) x[k] = dtr_tensor_new(ctx, DTR_F32, 3, sh);
    for (k = 0; k < 3; k++) {
        float v[40];
        int i;
        for (i = 0; i < 40; i++) v[i] = (float)((i * 7 + k * 3) % 11) / 11.0f - 0.5f;
        CHECK_OK(ctx, dtr_tensor_write(x[k], DTR_F32, v, 40));
    }
    CHECK_OK(ctx, dtr_context_state(ctx, 0, &e));
    memcpy(&before, e.data, sizeof before);
    CHECK_OK(ctx, dtr_tensor_read(dtr_attention_ex(ctx, x[0], x[1], x[2], &cfg), DTR_F32, y0, 40));
    dtr_context_set_training(ctx, 0);
    cfg.dropout = 0.5f;
    CHECK_OK(ctx, dtr_tensor_read(dtr_attention_ex(ctx, x[0], x[1], x[2], &cfg), DTR_F32, y1, 40));
    CHECK_MSG(memcmp(y0, y1, sizeof y0) == 0, "evaluation mode: dropout changed the output");
    CHECK_MSG(memcmp(&before, e.data, sizeof before) == 0, "evaluation mode: dropout drew from the stream");
    dtr_context_set_training(ctx, 1);
    for (k = 0; k < 3; k++) {
        static const float p[3] = {1.0f, -0.1f, 0.2f};
        cfg.dropout = p[k], cfg.mask_heads = k == 2 ? 3 : 0, cfg.mask_head0 = k == 2 ? 2 : 0;
        CHECK(dtr_attention_ex(ctx, x[0], x[1], x[2], &cfg) == NULL);
        CHECK_EQ_INT(dtr_context_status(ctx), DTR_INVALID_ARGUMENT);
        CHECK_MSG(strstr(dtr_context_last_error(ctx), k == 2 ? "do not fit" : "outside [0, 1)") != NULL, "%s", dtr_context_last_error(ctx));
        dtr_context_clear_error(ctx);
    }
    dtr_context_destroy(ctx);
}

static void test_fused_attention(void) {
    static const struct { int causal; int64_t Tq, Tk; float scale; } cases[] = {
        {1, 70, 70, 0.0f}, {0, 70, 70, 0.0f}, {0, 70, 45, 0.2f}, {0, 33, 90, 0.0f}, {1, 70, 70, 0.7f}};
    size_t p_fused, p_comp;
    int c;
    for (c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        dtr_attention_config cfg = dtr_attention_config_init(2, cases[c].causal);
        double worst;
        cfg.scale = cases[c].scale;
        worst = attention_gap(2, cases[c].Tq, cases[c].Tk, 8, &cfg);
        CHECK_MSG(worst < 1e-5, "fused attention (causal %d, Tq %lld, Tk %lld, scale %g) differs from the composite by %.3g",
                  cases[c].causal, (long long)cases[c].Tq, (long long)cases[c].Tk, (double)cases[c].scale, worst);
    }
    CHECK_MSG(attention_gqa_gap(2, 40, 4, 6, 2) < 1e-5 && attention_gqa_gap(2, 40, 4, 6, 3) < 1e-5,
              "grouped-query attention differs from the composite on repeated heads by %.3g / %.3g", attention_gqa_gap(2, 40, 4, 6, 2),
              attention_gqa_gap(2, 40, 4, 6, 3));
    {
        static const int64_t at[][3] = {{1, 40, 48}, {70, 0, 75}, {35, 50, 90}, {3, 29, 40}};   /* Tq, q_start, Tk */
        for (c = 0; c < 4; c++) {
            double worst = attention_at_gap(2, at[c][0], at[c][1], at[c][2], 8);
            CHECK_MSG(worst < 1e-6, "attention of %lld queries from key %lld of %lld differs from rows of the whole by %.3g",
                      (long long)at[c][0], (long long)at[c][1], (long long)at[c][2], worst);
        }
    }
    {
        static const int32_t lens[3] = {45, 1, 20};
        double worst = attention_lens_gap(3, 70, 45, 8, lens);
        CHECK_MSG(worst < 1e-5, "fused attention with key lengths differs from the composite on the items' keys by %.3g", worst);
    }
    {
        dtr_attention_config cfg = dtr_attention_config_init(4, 1);
        attention_run(1, 1, 512, 512, 32, &cfg, NULL, NULL, &p_fused);
        attention_run(0, 1, 512, 512, 32, &cfg, NULL, NULL, &p_comp);
    }
    CHECK_MSG(p_fused * 4 < p_comp, "arena peak: fused %zu bytes, composite %zu", p_fused, p_comp);
    printf("attention at T = 512, 4 heads: arena peak %zu bytes fused, %zu composite\n", p_fused, p_comp);
}

/* Dropout on the attention weights (training): the fused op's mask is dtr_dropout's over the
 * weights as a (B, H, Tq, Tk) tensor, or its heads' share of one over mask_heads (the composite
 * draws the whole and slices it): outputs and gradients to 1e-5, causal, cross, grouped-query;
 * the stream then stands where dtr_dropout of the whole mask leaves it; evaluation mode is the
 * op without dropout, bit for bit, and draws nothing; bad settings are refused. */
static void test_attention_dropout(void) {
    static const struct { int causal; int64_t Tq, Tk; float p; int mask_heads, head0; } cases[] = {
        {1, 70, 70, 0.3f, 0, 0}, {0, 33, 90, 0.5f, 5, 3}, {0, 40, 12, 0.1f, 3, 1}, {1, 40, 40, 0.2f, 4, 0}};
    int c;
    for (c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        dtr_attention_config cfg = dtr_attention_config_init(2, cases[c].causal);
        double worst;
        cfg.dropout = cases[c].p, cfg.mask_heads = cases[c].mask_heads, cfg.mask_head0 = cases[c].head0;
        worst = attention_gap(2, cases[c].Tq, cases[c].Tk, 8, &cfg);
        CHECK_MSG(worst < 1e-5, "attention dropout %g (causal %d, Tq %lld, Tk %lld, heads %d.. of %d) differs from the composite by %.3g",
                  (double)cfg.dropout, cfg.causal, (long long)cases[c].Tq, (long long)cases[c].Tk, cfg.mask_head0, cfg.mask_heads, worst);
    }
    attention_dropout_stream();
    attention_dropout_eval_and_errors();
}

/* ---- release_activations ---- */

typedef struct tiny_gpt {
    dtr_model *m;
    dtr_embedding_layer wte;
    dtr_gpt_block h[2];
    dtr_layernorm_layer ln;
    dtr_linear_layer head;
} tiny_gpt;

enum { TG_B = 2, TG_T = 16, TG_C = 32, TG_V = 97 };

static void tiny_gpt_init(dtr_context *ctx, tiny_gpt *g) {
    CHECK_OK(ctx, dtr_model_create(ctx, 3, &g->m));
    CHECK_OK(ctx, dtr_embedding_layer_init(&g->wte, g->m, "wte", TG_V, TG_C));
    CHECK_OK(ctx, dtr_gpt_block_init(&g->h[0], g->m, "h.0", TG_C, 4));
    CHECK_OK(ctx, dtr_gpt_block_init(&g->h[1], g->m, "h.1", TG_C, 4));
    CHECK_OK(ctx, dtr_layernorm_layer_init(&g->ln, g->m, "ln", TG_C));
    CHECK_OK(ctx, dtr_linear_layer_init(&g->head, g->m, "head", TG_C, TG_V, 0, DTR_INIT_TORCH_DEFAULT));
    CHECK_OK(ctx, dtr_model_build(g->m));
}

/* micro-batch k's logits, (B T, V) */
static dtr_tensor *tiny_gpt_logits(dtr_context *ctx, tiny_gpt *g, int k) {
    int32_t ids[TG_B * TG_T];
    int64_t is[2] = {TG_B, TG_T}, ls[2] = {TG_B * TG_T, TG_V};
    dtr_tensor *h;
    int i;
    for (i = 0; i < TG_B * TG_T; i++) ids[i] = (int32_t)((i * 7 + k * 13) % TG_V);
    h = dtr_embedding_layer_forward(ctx, &g->wte, dtr_tensor_from(ctx, DTR_I32, 2, is, ids));
    for (i = 0; i < 2; i++) h = dtr_gpt_block_forward(ctx, &g->h[i], h);
    return dtr_reshape(ctx, dtr_linear_layer_forward(ctx, &g->head, dtr_layernorm_layer_forward(ctx, &g->ln, h)), 2, ls);
}

static dtr_tensor *tiny_gpt_loss(dtr_context *ctx, dtr_tensor *logits, int k) {
    int32_t y[TG_B * TG_T];
    int64_t n = TG_B * TG_T;
    int i;
    for (i = 0; i < TG_B * TG_T; i++) y[i] = (int32_t)((i * 5 + k) % TG_V);
    return dtr_cross_entropy(ctx, logits, dtr_tensor_from(ctx, DTR_I32, 1, &n, y));
}

static dtr_context *release_ctx(int release) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    cfg.threads = 1;
    cfg.release_activations = release;
    if (dtr_context_create(&cfg, &ctx) != DTR_OK) { CHECK(0); exit(2); }
    return ctx;
}

/* two micro-batches, each backward right after its forward, on one tape; grads (*n of them),
   losses, peak */
static size_t tiny_gpt_run(int release, float *grads, float *losses, int64_t *n) {
    dtr_context *ctx = release_ctx(release);
    tiny_gpt g;
    size_t peak;
    int k;
    tiny_gpt_init(ctx, &g);
    dtr_context_arena_peak(ctx, 1);
    for (k = 0; k < 2; k++) {
        dtr_tensor *loss = tiny_gpt_loss(ctx, tiny_gpt_logits(ctx, &g, k), k);
        CHECK_OK(ctx, dtr_backward(ctx, loss));
        CHECK_OK(ctx, dtr_tensor_read(loss, DTR_F32, &losses[k], 1));   /* the root stays */
    }
    peak = dtr_context_arena_peak(ctx, 0);
    *n = dtr_model_numel(g.m);
    CHECK(*n <= 100000);
    if (*n <= 100000) memcpy(grads, dtr_model_grads(g.m), (size_t)*n * sizeof(float));
    dtr_model_destroy(g.m);
    dtr_context_destroy(ctx);
    return peak;
}

/* Released blocks that touch merge: after a backward with release_activations gave back two
   adjacent outputs of n floats, one allocation of 2n floats takes them (no new arena memory
   but its tensor struct's; without merging the arena grows by the block). */
static void test_spares_merge(void) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    int64_t n = 4096, two = 2 * n;
    dtr_tensor *x, *a, *b;
    size_t peak;
    cfg.threads = 1;
    cfg.release_activations = 1;
    CHECK(dtr_context_create(&cfg, &ctx) == DTR_OK);
    if (!ctx) return;
    x = dtr_tensor_requires_grad(dtr_tensor_zeros(ctx, DTR_F32, 1, &n));
    a = dtr_scale(ctx, x, 2.0f);
    b = dtr_scale(ctx, a, 3.0f);
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, b)));
    peak = dtr_context_arena_peak(ctx, 0);
    CHECK(dtr_tensor_zeros(ctx, DTR_F32, 1, &two) != NULL);
    CHECK_MSG(dtr_context_arena_peak(ctx, 0) < peak + 1024, "a block of %lld floats grew the arena from %zu to %zu bytes",
              (long long)two, peak, dtr_context_arena_peak(ctx, 0));
    dtr_context_destroy(ctx);
}

static void test_release_activations(void) {
    float *g0 = (float *)malloc(200000 * sizeof(float)), *g1 = g0 + 100000, l0[2], l1[2];
    int64_t n = 0;
    size_t keep = tiny_gpt_run(0, g0, l0, &n), lean = tiny_gpt_run(1, g1, l1, &n);
    CHECK(memcmp(g0, g1, (size_t)n * sizeof(float)) == 0);
    CHECK(memcmp(l0, l1, sizeof l0) == 0);
    /* the second micro-batch's forward takes the first one's released blocks */
    CHECK_MSG(lean * 10 < keep * 7, "arena peak %zu kept, %zu released", keep, lean);
    printf("    arena peak of 2 micro-batches: %zu bytes kept, %zu with release_activations\n", keep, lean);
    free(g0);
}

static void test_released_errors(void) {
    dtr_context *ctx = release_ctx(1);
    tiny_gpt g;
    dtr_tensor *logits, *loss, *probe, *view;
    float before[TG_V], after[TG_V], lv = 0.0f, f = 1.0f;
    int64_t four = 4;
    tiny_gpt_init(ctx, &g);
    logits = tiny_gpt_logits(ctx, &g, 0);
    probe = dtr_relu(ctx, logits);                      /* not retained: released */
    view = dtr_reshape(ctx, probe, 1, (int64_t[]){TG_B * TG_T * TG_V});
    loss = dtr_add(ctx, tiny_gpt_loss(ctx, logits, 0), dtr_mean_all(ctx, view));
    CHECK_OK(ctx, dtr_tensor_retain(dtr_slice(ctx, logits, 0, 0, 1)));   /* a view keeps its base */
    CHECK_OK(ctx, dtr_tensor_read(dtr_slice(ctx, logits, 0, 1, 2), DTR_F32, before, TG_V));
    CHECK_OK(ctx, dtr_backward(ctx, loss));
    CHECK_OK(ctx, dtr_tensor_read(loss, DTR_F32, &lv, 1));
    CHECK(lv > 0.0f);
    CHECK_OK(ctx, dtr_tensor_read(dtr_slice(ctx, logits, 0, 1, 2), DTR_F32, after, TG_V));
    CHECK(memcmp(before, after, sizeof before) == 0);
    CHECK(dtr_tensor_data(probe) == NULL && dtr_tensor_data(view) == NULL && dtr_tensor_data(logits) != NULL);
    {
        float *all = (float *)malloc(TG_B * TG_T * TG_V * sizeof(float));
        CHECK_EQ_INT(dtr_tensor_read(probe, DTR_F32, all, TG_B * TG_T * TG_V), DTR_BAD_STATE);
        CHECK(strstr(dtr_context_last_error(ctx), "released") != NULL);
        dtr_context_clear_error(ctx);
        CHECK_EQ_INT(dtr_tensor_read(view, DTR_F32, all, TG_B * TG_T * TG_V), DTR_BAD_STATE);
        dtr_context_clear_error(ctx);
        CHECK_EQ_INT(dtr_tensor_write(probe, DTR_F32, all, TG_B * TG_T * TG_V), DTR_BAD_STATE);
        dtr_context_clear_error(ctx);
        free(all);
    }
    CHECK(isnan(dtr_tensor_get(view, 0)));
    dtr_context_clear_error(ctx);
    CHECK(dtr_relu(ctx, probe) == NULL && dtr_context_status(ctx) == DTR_BAD_STATE);
    CHECK(strstr(dtr_context_last_error(ctx), "relu") != NULL);
    dtr_context_clear_error(ctx);
    CHECK_EQ_INT(dtr_tensor_retain(probe), DTR_BAD_STATE);
    dtr_context_clear_error(ctx);
    /* a second pass through the graph needs what the first released */
    CHECK_EQ_INT(dtr_backward(ctx, loss), DTR_BAD_STATE);
    CHECK(strstr(dtr_context_last_error(ctx), "released") != NULL);
    dtr_context_clear_error(ctx);
    /* after a reset the context works as before */
    CHECK_OK(ctx, dtr_context_reset(ctx));
    CHECK_OK(ctx, dtr_backward(ctx, tiny_gpt_loss(ctx, tiny_gpt_logits(ctx, &g, 1), 1)));
    CHECK_OK(ctx, dtr_tensor_read(dtr_tensor_from(ctx, DTR_F32, 1, &four, (float[]){f, f, f, f}), DTR_F32, after, 4));
    dtr_model_destroy(g.m);
    dtr_context_destroy(ctx);
}

/* x (leaf, N) -> h = 2 x -> v = reshape(h) -> sum(v): with the handoff v's gradient becomes h's
 * (4 N floats at the peak: x, h, v's gradient, x's); kept apart, 5 N. */
static size_t handoff_run(int retain_view, float *gx) {
    enum { N = 1 << 16 };
    dtr_context *ctx = release_ctx(0);
    int64_t n = N, s2[2] = {256, 256};
    float *xv = (float *)calloc(N, sizeof(float));
    dtr_tensor *x = dtr_tensor_requires_grad(dtr_tensor_from(ctx, DTR_F32, 1, &n, xv)), *v;
    size_t peak;
    dtr_context_arena_peak(ctx, 1);
    v = dtr_reshape(ctx, dtr_scale(ctx, x, 2.0f), 2, s2);
    if (retain_view) CHECK_OK(ctx, dtr_tensor_retain_grad(v));
    CHECK_OK(ctx, dtr_backward(ctx, dtr_sum_all(ctx, v)));
    peak = dtr_context_arena_peak(ctx, 0);
    memcpy(gx, dtr_tensor_grad(x), N * sizeof(float));
    CHECK((dtr_tensor_grad(v) != NULL) == retain_view);
    if (retain_view) CHECK(dtr_tensor_grad(v)[N - 1] == 1.0f);
    free(xv);
    dtr_context_destroy(ctx);
    return peak / sizeof(float);
}

static void test_grad_handoff(void) {
    enum { N = 1 << 16 };
    float *g = (float *)malloc(2 * N * sizeof(float));
    size_t moved = handoff_run(0, g), kept = handoff_run(1, g + N);
    int i, ok = 1;
    for (i = 0; i < 2 * N; i++) ok &= g[i] == 2.0f;
    CHECK(ok);
    CHECK_MSG(moved < 4 * N + 1024 && kept >= 5 * N, "peak %zu floats moved, %zu kept", moved, kept);
    free(g);
}

int main(void) {
    RUN(test_second_backward);
    RUN(test_backward_from);
    RUN(test_tapes);
    RUN(test_released_grads);
    RUN(test_two_hooks);
    RUN(test_nan_propagates);
    RUN(test_nan_maxpool_windows);
    RUN(test_empty_mean);
    RUN(test_abs_gelu_erf);
    RUN(test_math_ops);
    RUN(test_xent_settings);
    RUN(test_max_argmax);
    RUN(test_gather);
    RUN(test_upsample);
    RUN(test_op_names);
    RUN(test_backend_caps);
    RUN(test_fused_attention);
    RUN(test_attention_dropout);
    RUN(test_attention_layer_causal);
    RUN(test_rmsnorm_silu);
    RUN(test_rope);
    RUN(test_release_activations);
    RUN(test_spares_merge);
    RUN(test_released_errors);
    RUN(test_grad_handoff);
    return test_summary();
}
