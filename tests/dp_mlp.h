/* tests/dp_mlp.h: the small MLP and data of the data-parallel tests (tests/test_dp.c over
 * the local transport, tests/test_fabric.c over libfabric): 20-32-5 with ReLU, SGD lr 0.05
 * momentum 0.9, seeded; the data of step t, row r is a hash of (t, r), the same on every
 * rank, so rank r of N with batch b takes rows [r*b, (r+1)*b) and 1 rank with batch N*b
 * takes them all. Include after test.h (test_ctx). */
#include <math.h>

#define IN 20
#define HID 32
#define OUT 5

typedef struct mlp {
    dtr_context *ctx;
    dtr_model *m;
    dtr_linear_layer l1, l2;
    dtr_optimizer *opt;
} mlp;

/* the MLP on `ctx` (the net owns it from here) */
static int mlp_init_on(mlp *n, dtr_context *ctx, uint64_t seed, int accum) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.05f);
    memset(n, 0, sizeof *n);
    n->ctx = ctx;
    if (!ctx) return 0;
    oc.momentum = 0.9f;
    oc.grad_accum_steps = accum;
    if (dtr_model_create(n->ctx, seed, &n->m) != DTR_OK) return 0;
    if (dtr_linear_layer_init(&n->l1, n->m, "l1", IN, HID, 1, DTR_INIT_KAIMING_UNIFORM) != DTR_OK) return 0;
    if (dtr_linear_layer_init(&n->l2, n->m, "l2", HID, OUT, 1, DTR_INIT_KAIMING_UNIFORM) != DTR_OK) return 0;
    if (dtr_model_build(n->m) != DTR_OK) return 0;
    return dtr_optimizer_create(n->m, &oc, &n->opt) == DTR_OK;
}

/* the MLP on a CPU context of one thread */
#define mlp_init(n, seed, accum) mlp_init_on((n), test_ctx(1), (seed), (accum))

static void mlp_free(mlp *n) {
    dtr_optimizer_destroy(n->opt);
    dtr_model_destroy(n->m);
    dtr_context_destroy(n->ctx);
}

/* the data of step t: rows of x (IN) and labels, identical on every rank */
static float data_x(int64_t t, int64_t row, int k) {
    uint32_t h = (uint32_t)(t * 7919 + row * 104729 + k * 31 + 1);
    h ^= h >> 15; h *= 0x2c1b3c6du; h ^= h >> 12; h *= 0x297a2d39u; h ^= h >> 15;
    return (float)(h % 2001) / 1000.0f - 1.0f;
}
static int32_t data_y(int64_t t, int64_t row) { return (int32_t)((t * 13 + row * 7) % OUT); }

/* forward + backward on rows [r0, r0 + b) of step t */
static dtr_result mlp_backward(mlp *n, int64_t t, int64_t r0, int64_t b) {
    int64_t xs[2], ys[1], i;
    float *x = (float *)malloc((size_t)(b * IN) * sizeof(float));
    int32_t *y = (int32_t *)malloc((size_t)b * sizeof(int32_t));
    dtr_tensor *loss;
    dtr_result r;
    int k;
    for (i = 0; i < b; i++) {
        for (k = 0; k < IN; k++) x[i * IN + k] = data_x(t, r0 + i, k);
        y[i] = data_y(t, r0 + i);
    }
    xs[0] = b; xs[1] = IN; ys[0] = b;
    loss = dtr_cross_entropy(n->ctx, dtr_linear_layer_forward(n->ctx, &n->l2, dtr_relu(n->ctx,
                                     dtr_linear_layer_forward(n->ctx, &n->l1, dtr_tensor_from(n->ctx, DTR_F32, 2, xs, x)))),
                             dtr_tensor_from(n->ctx, DTR_I32, 1, ys, y));
    r = loss ? dtr_backward(n->ctx, loss) : dtr_context_status(n->ctx);
    free(x);
    free(y);
    return r;
}

static double rel_err(const float *a, const float *b, int64_t n) {
    double d = 0.0, s = 0.0;
    int64_t i;
    for (i = 0; i < n; i++) { d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]); s += (double)b[i] * b[i]; }
    return s > 0 ? sqrt(d / s) : sqrt(d);
}

