/* ============================================================================
 * Convolution and pooling over images. Shapes: x (N, C, H, W), w (O, C, KH, KW),
 * y (N, O, Ho, Wo) with Ho = (H + 2P - KH) / S + 1. Convolution is im2col + GEMM: the
 * column matrix of sample n is (C*KH*KW, Ho*Wo), kept for the backward pass.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include <math.h>

/* ---- im2col / col2im ---- */

typedef struct dtr__conv_geom {
    int64_t N, C, H, W, O, KH, KW, Ho, Wo, S, P;
} dtr__conv_geom;

static void dtr__im2col(const dtr__conv_geom *g, const float *x, float *col) {
    int64_t c, ki, kj, oi, oj;
    for (c = 0; c < g->C; c++)
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                float *row = col + ((c * g->KH + ki) * g->KW + kj) * g->Ho * g->Wo;
                for (oi = 0; oi < g->Ho; oi++) {
                    int64_t ii = oi * g->S - g->P + ki;
                    float *r = row + oi * g->Wo;
                    if (ii < 0 || ii >= g->H) { for (oj = 0; oj < g->Wo; oj++) r[oj] = 0.0f; continue; }
                    for (oj = 0; oj < g->Wo; oj++) {
                        int64_t jj = oj * g->S - g->P + kj;
                        r[oj] = (jj >= 0 && jj < g->W) ? x[(c * g->H + ii) * g->W + jj] : 0.0f;
                    }
                }
            }
}

static void dtr__col2im_add(const dtr__conv_geom *g, const float *col, float *gx) {
    int64_t c, ki, kj, oi, oj;
    for (c = 0; c < g->C; c++)
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                const float *row = col + ((c * g->KH + ki) * g->KW + kj) * g->Ho * g->Wo;
                for (oi = 0; oi < g->Ho; oi++) {
                    int64_t ii = oi * g->S - g->P + ki;
                    if (ii < 0 || ii >= g->H) continue;
                    for (oj = 0; oj < g->Wo; oj++) {
                        int64_t jj = oj * g->S - g->P + kj;
                        if (jj >= 0 && jj < g->W) gx[(c * g->H + ii) * g->W + jj] += row[oi * g->Wo + oj];
                    }
                }
            }
}

static void dtr__conv_geom_of(const dtr__node *nd, dtr__conv_geom *g) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1];
    g->N = x->shape[0]; g->C = x->shape[1]; g->H = x->shape[2]; g->W = x->shape[3];
    g->O = w->shape[0]; g->KH = w->shape[2]; g->KW = w->shape[3];
    g->S = nd->iarg[0]; g->P = nd->iarg[1];
    g->Ho = nd->out->shape[2]; g->Wo = nd->out->shape[3];
}

/* ---- conv2d ---- */

dtr_tensor *dtr_conv2d(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias, int stride, int padding) {
    dtr__node *n;
    int64_t shape[4], Ho, Wo, ckk;
    char s1[96], s2[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_conv2d", x, "x") || !dtr__check_input(ctx, "dtr_conv2d", w, "w")) return NULL;
    if (bias && !dtr__check_input(ctx, "dtr_conv2d", bias, "bias")) return NULL;
    if (x->ndim != 4 || w->ndim != 4 || x->shape[1] != w->shape[1])
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_conv2d: x %s and w %s must be (N, C, H, W) and (O, C, KH, KW)",
                          dtr__shape_str(x, s1, sizeof s1), dtr__shape_str(w, s2, sizeof s2));
    if (bias && (bias->ndim != 1 || bias->shape[0] != w->shape[0]))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_conv2d: bias %s must be (%lld)", dtr__shape_str(bias, s1, sizeof s1),
                          (long long)w->shape[0]);
    if (stride < 1 || padding < 0)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_conv2d: stride %d must be >= 1 and padding %d >= 0", stride, padding);
    Ho = (x->shape[2] + 2 * padding - w->shape[2]) / stride + 1;
    Wo = (x->shape[3] + 2 * padding - w->shape[3]) / stride + 1;
    if (x->shape[2] + 2 * padding < w->shape[2] || x->shape[3] + 2 * padding < w->shape[3] || Ho < 1 || Wo < 1)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_conv2d: kernel %s larger than the padded input %s",
                          dtr__shape_str(w, s1, sizeof s1), dtr__shape_str(x, s2, sizeof s2));
    x = dtr__contig_input(ctx, x);
    w = dtr__contig_input(ctx, w);
    if (!x || !w) return NULL;
    shape[0] = x->shape[0]; shape[1] = w->shape[0]; shape[2] = Ho; shape[3] = Wo;
    n = dtr__node_new(ctx, DTR_OP_CONV2D, "dtr_conv2d");
    if (!n) return NULL;
    n->n_in = bias ? 3 : 2;
    n->in[0] = x;
    n->in[1] = w;
    n->in[2] = bias;
    n->iarg[0] = stride;
    n->iarg[1] = padding;
    ckk = w->shape[1] * w->shape[2] * w->shape[3];
    n->aux = dtr__arena_data(ctx, (size_t)(x->shape[0] * ckk * Ho * Wo) * sizeof(float), "dtr_conv2d"); /* columns */
    if (!n->aux) return NULL;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, 4, shape, "dtr_conv2d");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_conv2d");
}

typedef struct { const dtr__node *nd; dtr__conv_geom g; dtr__pool *pool; float *gcol; } dtr__conv_job;

static void dtr__conv_fwd_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    const float *X = dtr__f32(j->nd->in[0]), *Wt = dtr__f32(j->nd->in[1]);
    const float *bias = j->nd->in[2] ? dtr__f32(j->nd->in[2]) : NULL;
    float *Y = dtr__f32(j->nd->out), *COL = (float *)j->nd->aux;
    int64_t ckk = g->C * g->KH * g->KW, P = g->Ho * g->Wo, n, o, p;
    for (n = b; n < e; n++) {
        float *col = COL + n * ckk * P, *y = Y + n * g->O * P;
        dtr__im2col(g, X + n * g->C * g->H * g->W, col);
        for (o = 0; o < g->O; o++) {
            float bv = bias ? bias[o] : 0.0f;
            for (p = 0; p < P; p++) y[o * P + p] = bv;
        }
        /* y (O, P) += W (O, ckk) col (ckk, P) */
        dtr__gemm_on(j->pool, worker, g->O, P, ckk, 1.0f, Wt, ckk, 1, col, P, 1, 1.0f, y, P);
    }
}

dtr_result dtr__cpu_conv2d_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__conv_job j;
    j.nd = nd;
    j.pool = ctx->pool;
    dtr__conv_geom_of(nd, &j.g);
    dtr__pool_run(ctx->pool, j.g.N, 1, dtr__conv_fwd_range, &j);
    return DTR_OK;
}

/* dW and db, split over output channels so the sum over samples runs in one fixed order. */
static void dtr__conv_bwd_w_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    const float *G = j->nd->out->grad, *COL = (const float *)j->nd->aux;
    float *gw = dtr__gradof(j->nd->in[1]), *gb = dtr__gradof(j->nd->in[2]);
    int64_t ckk = g->C * g->KH * g->KW, P = g->Ho * g->Wo, n, o, p;
    for (n = 0; n < g->N; n++) {
        const float *gy = G + n * g->O * P;
        /* dW[b:e] (e-b, ckk) += gy[b:e] (e-b, P) col^T (P, ckk) */
        if (gw) dtr__gemm_on(j->pool, worker, e - b, ckk, P, 1.0f, gy + b * P, P, 1, COL + n * ckk * P, 1, P, 1.0f,
                             gw + b * ckk, ckk);
        if (gb)
            for (o = b; o < e; o++) {
                float s = 0.0f;
                for (p = 0; p < P; p++) s += gy[o * P + p];
                gb[o] += s;
            }
    }
}

/* dX, split over samples; each worker has its own column-gradient buffer in j->gcol. */
static void dtr__conv_bwd_x_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    const float *G = j->nd->out->grad, *Wt = dtr__f32(j->nd->in[1]);
    float *gx = dtr__gradof(j->nd->in[0]);
    int64_t ckk = g->C * g->KH * g->KW, P = g->Ho * g->Wo, n;
    float *gcol = j->gcol + (int64_t)worker * ckk * P;
    for (n = b; n < e; n++) {
        /* gcol (ckk, P) = W^T (ckk, O) gy (O, P) */
        dtr__gemm_on(j->pool, worker, ckk, P, g->O, 1.0f, Wt, 1, ckk, G + n * g->O * P, P, 1, 0.0f, gcol, P);
        dtr__col2im_add(g, gcol, gx + n * g->C * g->H * g->W);
    }
}

dtr_result dtr__cpu_conv2d_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__conv_job j;
    j.nd = nd;
    j.pool = ctx->pool;
    dtr__conv_geom_of(nd, &j.g);
    if (dtr__gradof(nd->in[1]) || dtr__gradof(nd->in[2])) dtr__pool_run(ctx->pool, j.g.O, 1, dtr__conv_bwd_w_range, &j);
    if (dtr__gradof(nd->in[0])) {
        size_t per = (size_t)(j.g.C * j.g.KH * j.g.KW * j.g.Ho * j.g.Wo);
        j.gcol = (float *)dtr__arena_data(ctx, per * (size_t)dtr__pool_threads(ctx->pool) * sizeof(float), "dtr_conv2d backward");
        if (!j.gcol) return ctx->status;
        dtr__pool_run(ctx->pool, j.g.N, 1, dtr__conv_bwd_x_range, &j);
    }
    return DTR_OK;
}

/* ---- pooling ---- */

static dtr_tensor *dtr__pool2d(dtr_context *ctx, int op, const char *name, dtr_tensor *x, int k, int stride, int padding) {
    dtr__node *n;
    int64_t shape[4];
    char s1[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (x->ndim != 4) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x %s must be (N, C, H, W)", name, dtr__shape_str(x, s1, sizeof s1));
    if (stride == 0) stride = k;
    if (k < 1 || stride < 1 || padding < 0 || 2 * padding > k)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: window %d, stride %d, padding %d are invalid", name, k, stride, padding);
    if (x->shape[2] + 2 * padding < k || x->shape[3] + 2 * padding < k)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: window %d larger than the input %s", name, k, dtr__shape_str(x, s1, sizeof s1));
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    shape[0] = x->shape[0]; shape[1] = x->shape[1];
    shape[2] = (x->shape[2] + 2 * padding - k) / stride + 1;
    shape[3] = (x->shape[3] + 2 * padding - k) / stride + 1;
    n = dtr__node_new(ctx, op, name);
    if (!n) return NULL;
    n->n_in = 1;
    n->in[0] = x;
    n->iarg[0] = k; n->iarg[1] = stride; n->iarg[2] = padding;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, 4, shape, name);
    if (!n->out) return NULL;
    if (op == DTR_OP_MAXPOOL2D) {
        n->aux = dtr__arena_data(ctx, (size_t)dtr_tensor_numel(n->out) * sizeof(int32_t), name); /* argmax */
        if (!n->aux) return NULL;
    }
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_maxpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding) {
    return dtr__pool2d(ctx, DTR_OP_MAXPOOL2D, "dtr_maxpool2d", x, k, stride, padding);
}
dtr_tensor *dtr_avgpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding) {
    return dtr__pool2d(ctx, DTR_OP_AVGPOOL2D, "dtr_avgpool2d", x, k, stride, padding);
}

dtr_result dtr__cpu_pool2d_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t NC = x->shape[0] * x->shape[1], H = x->shape[2], W = x->shape[3];
    int64_t Ho = nd->out->shape[2], Wo = nd->out->shape[3], k = nd->iarg[0], S = nd->iarg[1], P = nd->iarg[2];
    int64_t c, oi, oj, a, b;
    const float *X = dtr__f32(x);
    float *Y = dtr__f32(nd->out);
    int32_t *arg = (int32_t *)nd->aux;
    int maxp = nd->op == DTR_OP_MAXPOOL2D;
    (void)ctx;
    for (c = 0; c < NC; c++) {
        const float *xc = X + c * H * W;
        for (oi = 0; oi < Ho; oi++)
            for (oj = 0; oj < Wo; oj++) {
                float best = -INFINITY, s = 0.0f;
                int32_t bi = -1;
                for (a = 0; a < k; a++) {
                    int64_t ii = oi * S - P + a;
                    if (ii < 0 || ii >= H) continue;
                    for (b = 0; b < k; b++) {
                        int64_t jj = oj * S - P + b;
                        float v;
                        if (jj < 0 || jj >= W) continue;
                        v = xc[ii * W + jj];
                        s += v;
                        if (v > best || bi < 0) { best = v; bi = (int32_t)(ii * W + jj); }
                    }
                }
                if (maxp) { Y[(c * Ho + oi) * Wo + oj] = best; arg[(c * Ho + oi) * Wo + oj] = bi; }
                else Y[(c * Ho + oi) * Wo + oj] = s / (float)(k * k);
            }
    }
    return DTR_OK;
}

dtr_result dtr__cpu_pool2d_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t NC = x->shape[0] * x->shape[1], H = x->shape[2], W = x->shape[3];
    int64_t Ho = nd->out->shape[2], Wo = nd->out->shape[3], k = nd->iarg[0], S = nd->iarg[1], P = nd->iarg[2];
    int64_t c, oi, oj, a, b;
    const float *G = nd->out->grad;
    const int32_t *arg = (const int32_t *)nd->aux;
    float *gx = dtr__gradof(x);
    (void)ctx;
    if (!gx) return DTR_OK;
    for (c = 0; c < NC; c++) {
        float *gc = gx + c * H * W;
        for (oi = 0; oi < Ho; oi++)
            for (oj = 0; oj < Wo; oj++) {
                float g = G[(c * Ho + oi) * Wo + oj];
                if (nd->op == DTR_OP_MAXPOOL2D) { gc[arg[(c * Ho + oi) * Wo + oj]] += g; continue; }
                g /= (float)(k * k);
                for (a = 0; a < k; a++) {
                    int64_t ii = oi * S - P + a;
                    if (ii < 0 || ii >= H) continue;
                    for (b = 0; b < k; b++) {
                        int64_t jj = oj * S - P + b;
                        if (jj >= 0 && jj < W) gc[ii * W + jj] += g;
                    }
                }
            }
    }
    return DTR_OK;
}
