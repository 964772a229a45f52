/* ============================================================================
 * Element-wise ops, reductions and simple losses: builders and CPU kernels side by side.
 * Shapes: any; binary ops broadcast as NumPy does (axes aligned on the right).
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include "../core/formulas.h"
#include <math.h>

/* ---- broadcasting ---- */

/* Output shape and per-input strides (0 on broadcast axes) over the output's axes. */
typedef struct dtr__bcast {
    int nd;
    int64_t shape[DTR_MAX_DIMS];
    int64_t sa[DTR_MAX_DIMS], sb[DTR_MAX_DIMS];   /* element strides of a, b (views) */
    int64_t ga[DTR_MAX_DIMS], gb[DTR_MAX_DIMS];   /* strides into the dense gradients of a, b */
} dtr__bcast;

static int dtr__bcast_make(const dtr_tensor *a, const dtr_tensor *b, dtr__bcast *bc) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim, d;
    int64_t gsa[DTR_MAX_DIMS], gsb[DTR_MAX_DIMS];
    dtr__contig_strides(a->ndim, a->shape, gsa);
    dtr__contig_strides(b->ndim, b->shape, gsb);
    bc->nd = nd;
    for (d = 0; d < nd; d++) {
        int da = d - (nd - a->ndim), db = d - (nd - b->ndim);
        int64_t na = da >= 0 ? a->shape[da] : 1, nb = db >= 0 ? b->shape[db] : 1;
        if (na != nb && na != 1 && nb != 1) return 0;
        bc->shape[d] = na > nb ? na : nb;
        if (na == 0 || nb == 0) bc->shape[d] = 0;
        bc->sa[d] = (da >= 0 && na != 1) ? a->stride[da] : 0;
        bc->sb[d] = (db >= 0 && nb != 1) ? b->stride[db] : 0;
        bc->ga[d] = (da >= 0 && na != 1) ? gsa[da] : 0;
        bc->gb[d] = (db >= 0 && nb != 1) ? gsb[db] : 0;
    }
    return 1;
}

/* Walks the output in row-major order, one innermost row at a time. */
#define DTR__BCAST_ROWS(bc, ...)                                                          \
    do {                                                                                  \
        int64_t idx_[DTR_MAX_DIMS] = {0}, nrow_ = 1, r_, inner_;                          \
        int d_, last_ = (bc)->nd - 1;                                                     \
        inner_ = last_ >= 0 ? (bc)->shape[last_] : 1;                                     \
        for (d_ = 0; d_ < last_; d_++) nrow_ *= (bc)->shape[d_];                          \
        if (inner_ == 0) nrow_ = 0;                                                       \
        for (r_ = 0; r_ < nrow_; r_++) {                                                  \
            int64_t oa = 0, ob = 0, oga = 0, ogb = 0, o = r_ * inner_, n = inner_;         \
            int64_t ia = last_ >= 0 ? (bc)->sa[last_] : 0, ib = last_ >= 0 ? (bc)->sb[last_] : 0; \
            int64_t iga = last_ >= 0 ? (bc)->ga[last_] : 0, igb = last_ >= 0 ? (bc)->gb[last_] : 0; \
            for (d_ = 0; d_ < last_; d_++) {                                              \
                oa += idx_[d_] * (bc)->sa[d_]; ob += idx_[d_] * (bc)->sb[d_];             \
                oga += idx_[d_] * (bc)->ga[d_]; ogb += idx_[d_] * (bc)->gb[d_];           \
            }                                                                             \
            (void)oga; (void)ogb; (void)iga; (void)igb; (void)ia; (void)ib;               \
            __VA_ARGS__;                                                                  \
            for (d_ = last_ - 1; d_ >= 0; d_--) {                                         \
                if (++idx_[d_] < (bc)->shape[d_]) break;                                  \
                idx_[d_] = 0;                                                             \
            }                                                                             \
        }                                                                                 \
    } while (0)

static dtr_tensor *dtr__binary(dtr_context *ctx, int op, const char *name, dtr_tensor *a, dtr_tensor *b) {
    dtr__bcast bc;
    dtr__node *n;
    char s1[96], s2[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, a, "a") || !dtr__check_input(ctx, name, b, "b")) return NULL;
    if (!dtr__bcast_make(a, b, &bc))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: shapes %s and %s do not broadcast", name,
                          dtr__shape_str(a, s1, sizeof s1), dtr__shape_str(b, s2, sizeof s2));
    {
        dtr_tensor *in[2] = {a, b};
        n = dtr__node_new(ctx, op, 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), bc.nd, bc.shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_add(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) { return dtr__binary(ctx, DTR_OP_ADD, "dtr_add", a, b); }
dtr_tensor *dtr_sub(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) { return dtr__binary(ctx, DTR_OP_SUB, "dtr_sub", a, b); }
dtr_tensor *dtr_mul(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) { return dtr__binary(ctx, DTR_OP_MUL, "dtr_mul", a, b); }
dtr_tensor *dtr_div(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) { return dtr__binary(ctx, DTR_OP_DIV, "dtr_div", a, b); }
dtr_tensor *dtr_maximum(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) {
    return dtr__binary(ctx, DTR_OP_MAXIMUM, "dtr_maximum", a, b);
}
dtr_tensor *dtr_minimum(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) {
    return dtr__binary(ctx, DTR_OP_MINIMUM, "dtr_minimum", a, b);
}

dtr_result dtr__cpu_binary_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__bcast bc;
    const float *A = (const float *)nd->in[0]->storage + nd->in[0]->offset;
    const float *B = (const float *)nd->in[1]->storage + nd->in[1]->offset;
    float *Y = dtr__f32(nd->out);
    int op = nd->op;
    (void)ctx;
    dtr__bcast_make(nd->in[0], nd->in[1], &bc);
    DTR__BCAST_ROWS(&bc, {
        const float *pa = A + oa, *pb = B + ob;
        float *py = Y + o;
        int64_t j;
        switch (op) {
        case DTR_OP_ADD:
            if (ia == 1 && ib == 1) { for (j = 0; j < n; j++) py[j] = pa[j] + pb[j]; }
            else if (ia == 1 && ib == 0) { float v = pb[0]; for (j = 0; j < n; j++) py[j] = pa[j] + v; }
            else { for (j = 0; j < n; j++) py[j] = pa[j * ia] + pb[j * ib]; }
            break;
        case DTR_OP_SUB: for (j = 0; j < n; j++) py[j] = pa[j * ia] - pb[j * ib]; break;
        case DTR_OP_MUL:
            if (ia == 1 && ib == 1) { for (j = 0; j < n; j++) py[j] = pa[j] * pb[j]; }
            else { for (j = 0; j < n; j++) py[j] = pa[j * ia] * pb[j * ib]; }
            break;
        case DTR_OP_MAXIMUM: for (j = 0; j < n; j++) py[j] = dtr__f_maximum(pa[j * ia], pb[j * ib]); break;
        case DTR_OP_MINIMUM: for (j = 0; j < n; j++) py[j] = dtr__f_minimum(pa[j * ia], pb[j * ib]); break;
        default: for (j = 0; j < n; j++) py[j] = pa[j * ia] / pb[j * ib]; break;
        }
    });
    return DTR_OK;
}

dtr_result dtr__cpu_binary_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__bcast bc;
    const float *A = (const float *)nd->in[0]->storage + nd->in[0]->offset;
    const float *B = (const float *)nd->in[1]->storage + nd->in[1]->offset;
    const float *G = nd->out->grad;
    float *GA = dtr__gradof(nd->in[0]), *GB = dtr__gradof(nd->in[1]);
    int op = nd->op;
    (void)ctx;
    dtr__bcast_make(nd->in[0], nd->in[1], &bc);
    DTR__BCAST_ROWS(&bc, {
        const float *g = G + o, *pa = A + oa, *pb = B + ob;
        float *qa = GA ? GA + oga : NULL, *qb = GB ? GB + ogb : NULL;
        int64_t j;
        switch (op) {
        case DTR_OP_ADD:
            if (qa) for (j = 0; j < n; j++) qa[j * iga] += g[j];
            if (qb) for (j = 0; j < n; j++) qb[j * igb] += g[j];
            break;
        case DTR_OP_SUB:
            if (qa) for (j = 0; j < n; j++) qa[j * iga] += g[j];
            if (qb) for (j = 0; j < n; j++) qb[j * igb] -= g[j];
            break;
        case DTR_OP_MUL:
            if (qa) for (j = 0; j < n; j++) qa[j * iga] += g[j] * pb[j * ib];
            if (qb) for (j = 0; j < n; j++) qb[j * igb] += g[j] * pa[j * ia];
            break;
        case DTR_OP_MAXIMUM:
        case DTR_OP_MINIMUM: {
            int mx = op == DTR_OP_MAXIMUM;
            if (qa) for (j = 0; j < n; j++) qa[j * iga] += g[j] * dtr__f_pick_share(pa[j * ia], pb[j * ib], mx);
            if (qb) for (j = 0; j < n; j++) qb[j * igb] += g[j] * dtr__f_pick_share(pb[j * ib], pa[j * ia], mx);
            break;
        }
        default:
            if (qa) for (j = 0; j < n; j++) qa[j * iga] += g[j] / pb[j * ib];
            if (qb) for (j = 0; j < n; j++) {
                float bv = pb[j * ib];
                qb[j * igb] -= g[j] * pa[j * ia] / (bv * bv);
            }
            break;
        }
    });
    return DTR_OK;
}

/* ---- unary ops ---- */

static dtr_tensor *dtr__unary(dtr_context *ctx, int op, const char *name, dtr_tensor *x, float a, float b) {
    dtr__node *n;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    n->p.unary.a = a;
    n->p.unary.b = b;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), x->ndim, x->shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_scale(dtr_context *ctx, dtr_tensor *x, float s) { return dtr__unary(ctx, DTR_OP_SCALE, "dtr_scale", x, s, 0); }
dtr_tensor *dtr_relu(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_RELU, "dtr_relu", x, 0, 0); }
dtr_tensor *dtr_gelu(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_GELU, "dtr_gelu", x, 0, 0); }
dtr_tensor *dtr_tanh(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_TANH, "dtr_tanh", x, 0, 0); }
dtr_tensor *dtr_sigmoid(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_SIGMOID, "dtr_sigmoid", x, 0, 0); }
dtr_tensor *dtr_abs(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_ABS, "dtr_abs", x, 0, 0); }
dtr_tensor *dtr_gelu_erf(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_GELU_ERF, "dtr_gelu_erf", x, 0, 0); }
dtr_tensor *dtr_silu(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_SILU, "dtr_silu", x, 0, 0); }
dtr_tensor *dtr_exp(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_EXP, "dtr_exp", x, 0, 0); }
dtr_tensor *dtr_log(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_LOG, "dtr_log", x, 0, 0); }
dtr_tensor *dtr_sqrt(dtr_context *ctx, dtr_tensor *x) { return dtr__unary(ctx, DTR_OP_SQRT, "dtr_sqrt", x, 0, 0); }
dtr_tensor *dtr_pow(dtr_context *ctx, dtr_tensor *x, float p) { return dtr__unary(ctx, DTR_OP_POW, "dtr_pow", x, p, 0); }
dtr_tensor *dtr_leaky_relu(dtr_context *ctx, dtr_tensor *x, float slope) {
    return dtr__unary(ctx, DTR_OP_LEAKY_RELU, "dtr_leaky_relu", x, slope, 0);
}

dtr_tensor *dtr_clamp(dtr_context *ctx, dtr_tensor *x, float lo, float hi) {
    if (ctx && (lo != lo || hi != hi)) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_clamp: a bound is NaN");
    return dtr__unary(ctx, DTR_OP_CLAMP, "dtr_clamp", x, lo, hi);
}

dtr_tensor *dtr_softplus(dtr_context *ctx, dtr_tensor *x, float beta, float threshold) {
    if (ctx && !(beta > 0.0f && beta < INFINITY))
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_softplus: beta is %g (a positive finite number)", (double)beta);
    return dtr__unary(ctx, DTR_OP_SOFTPLUS, "dtr_softplus", x, beta, threshold);
}


typedef struct { const dtr__node *nd; } dtr__unary_job;

/* y[i] = F(x[i]) for i in [b, e), and gx[i] += g[i] * D(v[i]) (v: x or y, as the derivative
 * D takes), as DTR__ELEMENTWISE loops (blocks of 16 the loop vectorizer takes whole: y, gx never
 * overlap what is read at other indices), where F and D have no branch (ReLU's compare and
 * select, GELU's and tanh's bit-mask pick: dtr__f_tanh). Per element the operations are those
 * of the scalar loop, so the results are the same, on SSE2, AVX2 and AVX-512 (below). Through a
 * block copied into a local array (before 2026-11-28) GCC's AVX2 code stalled on its stores. */
#define DTR__MAP8(F, x, y, b, e) DTR__ELEMENTWISE(b, e, (y)[i] = F((x)[i]))
#define DTR__GRAD8(D, v, g, gx, b, e) DTR__ELEMENTWISE(b, e, (gx)[i] += (g)[i] * D((v)[i]))

DTR__SIMD_BODY void dtr__unary_fwd_body(void *arg, int64_t b, int64_t e, int w) {
    const dtr__node *nd = ((dtr__unary_job *)arg)->nd;
    const float *x = dtr__f32(nd->in[0]);
    float *y = dtr__f32(nd->out), pa = nd->p.unary.a, pb = nd->p.unary.b;
    int64_t i;
    (void)w;
    switch (nd->op) {
    case DTR_OP_SCALE: for (i = b; i < e; i++) y[i] = pa * x[i]; break;
    case DTR_OP_RELU: DTR__MAP8(dtr__f_relu, x, y, b, e); break;
    case DTR_OP_GELU: DTR__MAP8(dtr__f_gelu, x, y, b, e); break;
    case DTR_OP_TANH: DTR__MAP8(dtr__f_tanh, x, y, b, e); break;
    case DTR_OP_ABS: for (i = b; i < e; i++) y[i] = fabsf(x[i]); break;
    case DTR_OP_GELU_ERF: DTR__MAP8(dtr__f_gelu_erf, x, y, b, e); break;
    case DTR_OP_SILU: DTR__MAP8(dtr__f_silu, x, y, b, e); break;
    case DTR_OP_EXP: DTR__MAP8(dtr__f_exp, x, y, b, e); break;
    case DTR_OP_LOG: for (i = b; i < e; i++) y[i] = logf(x[i]); break;
    case DTR_OP_SQRT: for (i = b; i < e; i++) y[i] = sqrtf(x[i]); break;
    case DTR_OP_POW: for (i = b; i < e; i++) y[i] = powf(x[i], pa); break;
    case DTR_OP_CLAMP: for (i = b; i < e; i++) y[i] = dtr__f_clamp(x[i], pa, pb); break;
    case DTR_OP_LEAKY_RELU: for (i = b; i < e; i++) y[i] = dtr__f_leaky_relu(x[i], pa); break;
    case DTR_OP_SOFTPLUS: for (i = b; i < e; i++) y[i] = dtr__f_softplus(x[i], pa, pb); break;
    default: DTR__MAP8(dtr__f_sigmoid, x, y, b, e); break;
    }
}

DTR__SIMD_BODY void dtr__unary_bwd_body(void *arg, int64_t b, int64_t e, int w) {
    const dtr__node *nd = ((dtr__unary_job *)arg)->nd;
    const float *x = dtr__f32(nd->in[0]), *y = dtr__f32(nd->out), *g = nd->out->grad;
    float *gx = dtr__gradof(nd->in[0]), pa = nd->p.unary.a, pb = nd->p.unary.b;
    int64_t i;
    (void)w;
    switch (nd->op) {
    case DTR_OP_SCALE: for (i = b; i < e; i++) gx[i] += pa * g[i]; break;
    case DTR_OP_RELU: DTR__GRAD8(dtr__f_relu_grad, x, g, gx, b, e); break;
    case DTR_OP_GELU: DTR__GRAD8(dtr__f_gelu_grad, x, g, gx, b, e); break;
    case DTR_OP_TANH: DTR__GRAD8(dtr__f_tanh_grad, y, g, gx, b, e); break;
    case DTR_OP_ABS: for (i = b; i < e; i++) gx[i] += g[i] * dtr__f_abs_grad(x[i]); break;
    case DTR_OP_GELU_ERF: DTR__GRAD8(dtr__f_gelu_erf_grad, x, g, gx, b, e); break;
    case DTR_OP_SILU: DTR__GRAD8(dtr__f_silu_grad, x, g, gx, b, e); break;
    case DTR_OP_EXP: for (i = b; i < e; i++) gx[i] += g[i] * y[i]; break;
    case DTR_OP_LOG: for (i = b; i < e; i++) gx[i] += g[i] / x[i]; break;
    case DTR_OP_SQRT: for (i = b; i < e; i++) gx[i] += g[i] / (2.0f * y[i]); break;
    case DTR_OP_POW: for (i = b; i < e; i++) gx[i] += g[i] * dtr__f_pow_grad(x[i], pa); break;
    case DTR_OP_CLAMP: for (i = b; i < e; i++) gx[i] += g[i] * dtr__f_clamp_grad(x[i], pa, pb); break;
    case DTR_OP_LEAKY_RELU: for (i = b; i < e; i++) gx[i] += g[i] * dtr__f_leaky_relu_grad(x[i], pa); break;
    case DTR_OP_SOFTPLUS: for (i = b; i < e; i++) gx[i] += g[i] * dtr__f_softplus_grad(x[i], pa, pb); break;
    default: DTR__GRAD8(dtr__f_sigmoid_grad, y, g, gx, b, e); break;
    }
}

/* the two bodies as they are, for AVX2 and for AVX-512 (src/core/platform.h) */
static void dtr__unary_fwd_range(void *arg, int64_t b, int64_t e, int w) { dtr__unary_fwd_body(arg, b, e, w); }
static void dtr__unary_bwd_range(void *arg, int64_t b, int64_t e, int w) { dtr__unary_bwd_body(arg, b, e, w); }
DTR__TARGET_AVX2 static void dtr__unary_fwd_avx2(void *arg, int64_t b, int64_t e, int w) { dtr__unary_fwd_body(arg, b, e, w); }
DTR__TARGET_AVX2 static void dtr__unary_bwd_avx2(void *arg, int64_t b, int64_t e, int w) { dtr__unary_bwd_body(arg, b, e, w); }
DTR__TARGET_AVX512 static void dtr__unary_fwd_avx512(void *arg, int64_t b, int64_t e, int w) { dtr__unary_fwd_body(arg, b, e, w); }
DTR__TARGET_AVX512 static void dtr__unary_bwd_avx512(void *arg, int64_t b, int64_t e, int w) { dtr__unary_bwd_body(arg, b, e, w); }

dtr_result dtr__cpu_unary_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__unary_job j;
    j.nd = nd;
    dtr__pool_run(ctx->pool, dtr_tensor_numel(nd->out), 16384, DTR__SIMD_PICK(dtr__unary_fwd_range, dtr__unary_fwd_avx2, dtr__unary_fwd_avx512), &j);
    return DTR_OK;
}

dtr_result dtr__cpu_unary_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__unary_job j;
    if (!dtr__gradof(nd->in[0])) return DTR_OK;
    j.nd = nd;
    dtr__pool_run(ctx->pool, dtr_tensor_numel(nd->out), 16384, DTR__SIMD_PICK(dtr__unary_bwd_range, dtr__unary_bwd_avx2, dtr__unary_bwd_avx512), &j);
    return DTR_OK;
}

/* ---- reductions ---- */

/* x's shape without `axis` (or with it as 1: keepdim) in shape; returns its rank */
static int dtr__reduced_shape(const dtr_tensor *x, int axis, int keepdim, int64_t *shape) {
    int nd = 0, d;
    for (d = 0; d < x->ndim; d++) {
        if (d == axis) { if (keepdim) shape[nd++] = 1; }
        else shape[nd++] = x->shape[d];
    }
    return nd;
}

static dtr_tensor *dtr__reduce(dtr_context *ctx, int op, const char *name, dtr_tensor *x, int axis, int keepdim) {
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS] = {0};
    int nd = 0;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (op == DTR_OP_SUM || op == DTR_OP_MEAN) {
        if (axis < 0) axis += x->ndim;
        if (axis < 0 || axis >= x->ndim)
            return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: axis %d outside a tensor of %d dims", name, axis, x->ndim);
        nd = dtr__reduced_shape(x, axis, keepdim, shape);
    }
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    n->p.axis = axis;
    n->out = dtr__tensor_alloc(ctx, op == DTR_OP_SUM || op == DTR_OP_MEAN ? dtr__act_dtype(ctx) : DTR_F32, nd, shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_sum(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim) { return dtr__reduce(ctx, DTR_OP_SUM, "dtr_sum", x, axis, keepdim); }
dtr_tensor *dtr_mean(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim) { return dtr__reduce(ctx, DTR_OP_MEAN, "dtr_mean", x, axis, keepdim); }
dtr_tensor *dtr_sum_all(dtr_context *ctx, dtr_tensor *x) { return dtr__reduce(ctx, DTR_OP_SUM_ALL, "dtr_sum_all", x, 0, 0); }
dtr_tensor *dtr_mean_all(dtr_context *ctx, dtr_tensor *x) { return dtr__reduce(ctx, DTR_OP_MEAN_ALL, "dtr_mean_all", x, 0, 0); }

dtr_result dtr__cpu_reduce_fwd(dtr_context *ctx, dtr__node *nd) {
    const float *x = dtr__f32(nd->in[0]);
    float *y = dtr__f32(nd->out);
    (void)ctx;
    if (nd->op == DTR_OP_SUM_ALL || nd->op == DTR_OP_MEAN_ALL) {
        int64_t i, n = dtr_tensor_numel(nd->in[0]);
        double s = 0.0;
        for (i = 0; i < n; i++) s += x[i];
        y[0] = (float)(nd->op == DTR_OP_MEAN_ALL ? s / (double)n : s); /* empty: 0/0 = NaN */
    } else {
        int64_t outer, len, inner, o, k, i;
        dtr__axis_split(nd->in[0], nd->p.axis, &outer, &len, &inner);
        for (o = 0; o < outer; o++)
            for (i = 0; i < inner; i++) {
                double s = 0.0;
                for (k = 0; k < len; k++) s += x[(o * len + k) * inner + i];
                if (nd->op == DTR_OP_MEAN) s /= (double)len; /* len 0: NaN */
                y[o * inner + i] = (float)s;
            }
    }
    return DTR_OK;
}

dtr_result dtr__cpu_reduce_bwd(dtr_context *ctx, dtr__node *nd) {
    float *gx = dtr__gradof(nd->in[0]);
    const float *g = nd->out->grad;
    (void)ctx;
    if (!gx) return DTR_OK;
    if (nd->op == DTR_OP_SUM_ALL || nd->op == DTR_OP_MEAN_ALL) {
        int64_t i, n = dtr_tensor_numel(nd->in[0]);
        float v = nd->op == DTR_OP_MEAN_ALL ? (n ? g[0] / (float)n : 0.0f) : g[0];
        for (i = 0; i < n; i++) gx[i] += v;
    } else {
        int64_t outer, len, inner, o, k, i;
        float sc;
        dtr__axis_split(nd->in[0], nd->p.axis, &outer, &len, &inner);
        sc = nd->op == DTR_OP_MEAN && len ? 1.0f / (float)len : 1.0f;
        for (o = 0; o < outer; o++)
            for (k = 0; k < len; k++)
                for (i = 0; i < inner; i++) gx[(o * len + k) * inner + i] += g[o * inner + i] * sc;
    }
    return DTR_OK;
}

/* ---- the largest value along an axis, and where it is ---- */

/* MAX (values, the float type of the activations) or ARGMAX (i32 indices, never taped) of x over axis */
static dtr_tensor *dtr__argmax_op(dtr_context *ctx, int op, const char *name, dtr_tensor *x, int axis, int keepdim) {
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS] = {0};
    int nd;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (axis < 0) axis += x->ndim;
    if (axis < 0 || axis >= x->ndim || x->shape[axis] == 0)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: axis %d of a tensor of %d dims (it must be there and not empty)", name,
                          axis, x->ndim);
    nd = dtr__reduced_shape(x, axis, keepdim, shape);
    x = dtr__contig_input(ctx, x);
    if (!x || !(n = dtr__node_new(ctx, op, 1, &x))) return NULL;
    n->p.axis = axis;
    n->out = dtr__tensor_alloc(ctx, op == DTR_OP_MAX ? dtr__act_dtype(ctx) : DTR_I32, nd, shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_max(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim) {
    return dtr__argmax_op(ctx, DTR_OP_MAX, "dtr_max", x, axis, keepdim);
}
dtr_tensor *dtr_argmax(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim) {
    return dtr__argmax_op(ctx, DTR_OP_ARGMAX, "dtr_argmax", x, axis, keepdim);
}
/* -max(-x): the same index for the smallest (NaN still wins) */
dtr_tensor *dtr_min(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim) {
    return dtr_scale(ctx, dtr_max(ctx, dtr_scale(ctx, x, -1.0f), axis, keepdim), -1.0f);
}
dtr_tensor *dtr_argmin(dtr_context *ctx, dtr_tensor *x, int axis, int keepdim) {
    return dtr_argmax(ctx, dtr_scale(ctx, x, -1.0f), axis, keepdim);
}

/* each (outer, inner) position's index of the largest of its len values: the first of ties, a NaN wins */
static void dtr__argmax_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__node *nd = (const dtr__node *)arg;
    const float *x = dtr__f32(nd->in[0]);
    int32_t *idx = nd->op == DTR_OP_MAX ? (int32_t *)nd->saved : dtr__i32(nd->out);
    int64_t outer, len, inner, t;
    (void)worker;
    dtr__axis_split(nd->in[0], nd->p.axis, &outer, &len, &inner);
    for (t = b; t < e; t++) {
        float best;
        idx[t] = dtr__f_argmax(x + (t / inner) * len * inner + t % inner, len, inner, &best);
        if (nd->op == DTR_OP_MAX) dtr__f32(nd->out)[t] = best;
    }
}

dtr_result dtr__cpu_argmax_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    if (nd->op == DTR_OP_MAX && !(nd->saved = dtr__node_save(ctx, nd, (size_t)(n ? n : 1) * sizeof(int32_t))))
        return ctx->status;
    dtr__pool_run(ctx->pool, n, 4096, dtr__argmax_range, nd);
    return DTR_OK;
}

/* gx[the largest] += g (MAX; ARGMAX has no gradient) */
dtr_result dtr__cpu_argmax_bwd(dtr_context *ctx, dtr__node *nd) {
    float *gx = dtr__gradof(nd->in[0]);
    const int32_t *idx = (const int32_t *)nd->saved;
    int64_t outer, len, inner, t;
    (void)ctx;
    if (!gx || nd->op != DTR_OP_MAX) return DTR_OK;
    dtr__axis_split(nd->in[0], nd->p.axis, &outer, &len, &inner);
    for (t = 0; t < outer * inner; t++) gx[((t / inner) * len + idx[t]) * inner + t % inner] += nd->out->grad[t];
    return DTR_OK;
}

/* ---- mean squared error ---- */

/* 1 when a loss's two inputs are there and of one shape; else 0, the context's error set */
static int dtr__loss_inputs(dtr_context *ctx, const char *fn, dtr_tensor *pred, const char *pn, dtr_tensor *target) {
    char s1[96], s2[96];
    int d;
    if (!dtr__check_input(ctx, fn, pred, pn) || !dtr__check_input(ctx, fn, target, "target")) return 0;
    for (d = 0; pred->ndim == target->ndim && d < pred->ndim; d++)
        if (pred->shape[d] != target->shape[d]) break;
    if (pred->ndim == target->ndim && d == pred->ndim) return 1;
    dtr__fail(ctx, DTR_SHAPE_MISMATCH, "%s: %s %s and target %s differ", fn, pn, dtr__shape_str(pred, s1, sizeof s1),
              dtr__shape_str(target, s2, sizeof s2));
    return 0;
}

dtr_tensor *dtr_mse(dtr_context *ctx, dtr_tensor *pred, dtr_tensor *target) {
    dtr__node *n;
    if (!ctx) return NULL;
    if (!dtr__loss_inputs(ctx, "dtr_mse", pred, "pred", target)) return NULL;
    pred = dtr__contig_input(ctx, pred);
    target = dtr__contig_input(ctx, target);
    if (!pred || !target) return NULL;
    {
        dtr_tensor *in[2] = {pred, target};
        n = dtr__node_new(ctx, DTR_OP_MSE, 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, 0, NULL, "dtr_mse");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_mse");
}

/* mean(softplus(x) - x t): softplus keeps x where x > 20, so no exp overflows, and the terms are
   PyTorch's max(x, 0) - x t + log(1 + exp(-|x|)) rearranged */
dtr_tensor *dtr_bce_with_logits(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *target) {
    if (!ctx) return NULL;
    if (!dtr__loss_inputs(ctx, "dtr_bce_with_logits", logits, "logits", target)) return NULL;
    return dtr_mean_all(ctx, dtr_sub(ctx, dtr_softplus(ctx, logits, 1.0f, 20.0f), dtr_mul(ctx, logits, target)));
}

/* mean(c^2 / 2 + delta (|d| - |c|)), d = pred - target, c = clamp(d, -delta, delta): d^2 / 2 where
   |d| <= delta, delta (|d| - delta / 2) beyond; the gradient d there, delta sign(d) beyond */
dtr_tensor *dtr_huber_loss(dtr_context *ctx, dtr_tensor *pred, dtr_tensor *target, float delta) {
    dtr_tensor *d, *c, *quad, *lin;
    if (!ctx) return NULL;
    if (!(delta > 0.0f && delta < INFINITY))
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_huber_loss: delta is %g (a positive finite number)", (double)delta);
    if (!dtr__loss_inputs(ctx, "dtr_huber_loss", pred, "pred", target)) return NULL;
    d = dtr_sub(ctx, pred, target);
    c = dtr_clamp(ctx, d, -delta, delta);
    quad = dtr_scale(ctx, dtr_mul(ctx, c, c), 0.5f);
    lin = dtr_scale(ctx, dtr_sub(ctx, dtr_abs(ctx, d), dtr_abs(ctx, c)), delta);
    return dtr_mean_all(ctx, dtr_add(ctx, quad, lin));
}

dtr_result dtr__cpu_mse_fwd(dtr_context *ctx, dtr__node *nd) {
    const float *p = dtr__f32(nd->in[0]), *t = dtr__f32(nd->in[1]);
    int64_t i, n = dtr_tensor_numel(nd->in[0]);
    double s = 0.0;
    (void)ctx;
    for (i = 0; i < n; i++) { double d = (double)p[i] - t[i]; s += d * d; }
    dtr__f32(nd->out)[0] = (float)(s / (double)n); /* empty: 0/0 = NaN, as PyTorch */
    return DTR_OK;
}

dtr_result dtr__cpu_mse_bwd(dtr_context *ctx, dtr__node *nd) {
    const float *p = dtr__f32(nd->in[0]), *t = dtr__f32(nd->in[1]);
    float *gp = dtr__gradof(nd->in[0]), *gt = dtr__gradof(nd->in[1]);
    int64_t i, n = dtr_tensor_numel(nd->in[0]);
    float c = n ? 2.0f * nd->out->grad[0] / (float)n : 0.0f;
    (void)ctx;
    for (i = 0; i < n; i++) {
        float d = c * (p[i] - t[i]);
        if (gp) gp[i] += d;
        if (gt) gt[i] -= d;
    }
    return DTR_OK;
}

/* ---- dtype cast ---- */

dtr_tensor *dtr_cast(dtr_context *ctx, dtr_tensor *x, dtr_dtype dt) {
    dtr__node *n;
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_cast: x is NULL");
    if (!dtr_dtype_size(dt)) return dtr__failt(ctx, DTR_DTYPE_MISMATCH, "dtr_cast: unknown dtype %d", (int)dt);
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, DTR_OP_CAST, 1, &x);
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, dt, x->ndim, x->shape, "dtr_cast");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_cast");
}

dtr_result dtr__cpu_cast_fwd(dtr_context *ctx, dtr__node *nd) {
    (void)ctx;
    return dtr_convert(dtr__data(nd->out), nd->out->dtype, dtr__data(nd->in[0]), nd->in[0]->dtype,
                       (size_t)dtr_tensor_numel(nd->out));
}

dtr_result dtr__cpu_cast_bwd(dtr_context *ctx, dtr__node *nd) {
    float *gx = dtr__gradof(nd->in[0]);
    const float *g = nd->out->grad;
    int64_t i, n = dtr_tensor_numel(nd->out);
    (void)ctx;
    if (gx) for (i = 0; i < n; i++) gx[i] += g[i];
    return DTR_OK;
}
