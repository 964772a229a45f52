/* ============================================================================
 * Convolution and pooling over images. Shapes: x (N, C, H, W), w (O, C, KH, KW),
 * y (N, O, Ho, Wo) with Ho = (H + 2P - KH) / S + 1. Convolution is im2col + GEMM: the
 * column matrix of sample n is (C*KH*KW, Ho*Wo), kept for the backward pass when the op is
 * recorded on the tape; otherwise (inference, frozen layers) each worker reuses one.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include "../core/formulas.h"
#include <math.h>

/* ---- im2col / col2im ---- */

typedef struct dtr__conv_geom {
    int64_t N, C, H, W, O, KH, KW, Ho, Wo, S, P;
} dtr__conv_geom;

/* Reference loops: any stride and padding. */
static void dtr__im2col_ref(const dtr__conv_geom *g, const float *x, float *col) {
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

static void dtr__col2im_add_ref(const dtr__conv_geom *g, const float *col, float *gx) {
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

/* Stride 1 (any padding): for tap (ki, kj) output column oj reads input column oj - P + kj,
 * so each output row is one contiguous run of the input row between zero margins
 * [0, j0) and [j1, Wo). Same results as the reference loops (copies and the same order of
 * additions), without per-element bounds checks. */
static void dtr__conv_s1_cols(const dtr__conv_geom *g, int64_t kj, int64_t *j0, int64_t *j1) {
    int64_t a = g->P - kj, b = g->W + g->P - kj;   /* valid oj: a <= oj < b */
    *j0 = a < 0 ? 0 : (a > g->Wo ? g->Wo : a);
    *j1 = b > g->Wo ? g->Wo : (b < *j0 ? *j0 : b);
}

/* d[0..n) = s[0..n) and d[0..n) += s[0..n) for the short runs of im2col / col2im: 8 at a
 * time through a local array, which compilers turn into vector loads and stores at -O2
 * (a memcpy call costs more than the copy for runs of 10 to 30 floats). */
static void dtr__conv_copy(float *d, const float *s, int64_t n) {
    int64_t i;
    int k;
    for (i = 0; i + 8 <= n; i += 8) {
        float t[8];
        for (k = 0; k < 8; k++) t[k] = s[i + k];
        for (k = 0; k < 8; k++) d[i + k] = t[k];
    }
    for (; i < n; i++) d[i] = s[i];
}

static void dtr__conv_add(float *d, const float *s, int64_t n) {
    int64_t i;
    int k;
    for (i = 0; i + 8 <= n; i += 8) {
        float t[8], u[8];
        for (k = 0; k < 8; k++) { t[k] = d[i + k]; u[k] = s[i + k]; }
        for (k = 0; k < 8; k++) t[k] += u[k];
        for (k = 0; k < 8; k++) d[i + k] = t[k];
    }
    for (; i < n; i++) d[i] += s[i];
}

static void dtr__im2col(const dtr__conv_geom *g, const float *x, float *col) {
    int64_t c, ki, kj, oi, oj, j0, j1;
    if (g->S != 1) { dtr__im2col_ref(g, x, col); return; }
    for (c = 0; c < g->C; c++)
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                float *row = col + ((c * g->KH + ki) * g->KW + kj) * g->Ho * g->Wo;
                dtr__conv_s1_cols(g, kj, &j0, &j1);
                for (oi = 0; oi < g->Ho; oi++) {
                    int64_t ii = oi - g->P + ki;
                    float *r = row + oi * g->Wo;
                    if (ii < 0 || ii >= g->H) { memset(r, 0, (size_t)g->Wo * sizeof(float)); continue; }
                    for (oj = 0; oj < j0; oj++) r[oj] = 0.0f;
                    if (j1 > j0) dtr__conv_copy(r + j0, x + (c * g->H + ii) * g->W + (j0 - g->P + kj), j1 - j0);
                    for (oj = j1; oj < g->Wo; oj++) r[oj] = 0.0f;
                }
            }
}

static void dtr__col2im_add(const dtr__conv_geom *g, const float *col, float *gx) {
    int64_t c, ki, kj, oi, j0, j1;
    if (g->S != 1) { dtr__col2im_add_ref(g, col, gx); return; }
    for (c = 0; c < g->C; c++)
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                const float *row = col + ((c * g->KH + ki) * g->KW + kj) * g->Ho * g->Wo;
                dtr__conv_s1_cols(g, kj, &j0, &j1);
                for (oi = 0; oi < g->Ho; oi++) {
                    int64_t ii = oi - g->P + ki;
                    const float *r = row + oi * g->Wo + j0;
                    float *d;
                    if (ii < 0 || ii >= g->H || j1 <= j0) continue;
                    d = gx + (c * g->H + ii) * g->W + (j0 - g->P + kj);   /* input column of output column j0 */
                    dtr__conv_add(d, r, j1 - j0);
                }
            }
}

static void dtr__conv_geom_of(const dtr__node *nd, dtr__conv_geom *g) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1];
    g->N = x->shape[0]; g->C = x->shape[1]; g->H = x->shape[2]; g->W = x->shape[3];
    g->O = w->shape[0]; g->KH = w->shape[2]; g->KW = w->shape[3];
    g->S = nd->p.conv2d.stride; g->P = nd->p.conv2d.padding;
    g->Ho = nd->out->shape[2]; g->Wo = nd->out->shape[3];
}

/* ---- conv2d ---- */

dtr_tensor *dtr_conv2d(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias, int stride, int padding) {
    dtr__node *n;
    int64_t shape[4], Ho, Wo;
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
    {
        dtr_tensor *in[3] = {x, w, bias};
        n = dtr__node_new(ctx, DTR_OP_CONV2D, bias ? 3 : 2, in);
    }
    if (!n) return NULL;
    n->p.conv2d.stride = stride;
    n->p.conv2d.padding = padding;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), 4, shape, "dtr_conv2d");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_conv2d");
}

typedef struct {
    const dtr__node *nd;
    dtr__conv_geom g;
    dtr__pool *pool;
    float *gcol;      /* backward: per-worker column gradients */
    int split_cols;   /* backward: dW split over columns (1) or output channels (0) */
} dtr__conv_job;

/* y[0..n) = v; 8 at a time from a local array (vector stores without -O3). */
static void dtr__conv_fill(float *y, int64_t n, float v) {
    float t[8];
    int64_t i;
    int k;
    for (k = 0; k < 8; k++) t[k] = v;
    for (i = 0; i + 8 <= n; i += 8) memcpy(y + i, t, sizeof t);
    for (; i < n; i++) y[i] = v;
}

static void dtr__conv_fwd_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    const float *X = dtr__f32(j->nd->in[0]), *Wt = dtr__f32(j->nd->in[1]);
    const float *bias = j->nd->in[2] ? dtr__f32(j->nd->in[2]) : NULL;
    float *Y = dtr__f32(j->nd->out), *COL = (float *)j->nd->saved;
    int64_t ckk = g->C * g->KH * g->KW, P = g->Ho * g->Wo, n, o;
    for (n = b; n < e; n++) {
        float *col = COL + (j->nd->taped ? n : worker) * ckk * P, *y = Y + n * g->O * P;
        dtr__im2col(g, X + n * g->C * g->H * g->W, col);
        for (o = 0; o < g->O; o++) dtr__conv_fill(y + o * P, P, bias ? bias[o] : 0.0f);
        /* y (O, P) += W (O, ckk) col (ckk, P) */
        dtr__gemm_on(j->pool, worker, g->O, P, ckk, 1.0f, Wt, ckk, 1, col, P, 1, 1.0f, y, P);
    }
}

dtr_result dtr__cpu_conv2d_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__conv_job j;
    int64_t ncol;
    memset(&j, 0, sizeof j);
    j.nd = nd;
    j.pool = ctx->pool;
    dtr__conv_geom_of(nd, &j.g);
    /* im2col columns: one matrix per sample when backward will reuse them, else one per worker */
    ncol = nd->taped ? j.g.N : dtr__pool_threads(ctx->pool);
    nd->saved = dtr__node_save(ctx, nd, (size_t)(ncol * j.g.C * j.g.KH * j.g.KW * j.g.Ho * j.g.Wo) * sizeof(float));
    if (!nd->saved) return ctx->status;
    dtr__pool_run(ctx->pool, j.g.N, 1, dtr__conv_fwd_range, &j);
    return DTR_OK;
}

/* Sum of x[0..n) in a fixed order: 8 running sums (element i goes to sum i mod 8, which
 * compilers keep in one SIMD register) added pairwise at the end, then the tail. */
static float dtr__conv_sum(const float *x, int64_t n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, s;
    int64_t i;
    int k;
    for (i = 0; i + 8 <= n; i += 8)
        for (k = 0; k < 8; k++) acc[k] += x[i + k];
    s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += x[i];
    return s;
}

/* dW and db. Each worker owns a slab of dW and sums over the samples in one fixed order, so
 * any split gives the same bits. The slab is a range of output channels (rows; every worker
 * packs all columns of each sample) or, when there are fewer output channels than C*KH*KW,
 * a range of columns (every worker packs the smaller gy instead). The bias rows are split
 * in proportion to the units. */
static void dtr__conv_bwd_w_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    const float *G = j->nd->out->grad, *COL = (const float *)j->nd->saved;
    float *gw = dtr__gradof(j->nd->in[1]), *gb = dtr__gradof(j->nd->in[2]);
    int64_t ckk = g->C * g->KH * g->KW, P = g->Ho * g->Wo, n, o, o0 = b, o1 = e;
    if (j->split_cols) { o0 = b * g->O / ckk; o1 = e * g->O / ckk; }
    for (n = 0; n < g->N; n++) {
        const float *gy = G + n * g->O * P, *col = COL + n * ckk * P;
        if (gw && j->split_cols)   /* dW[:, b:e] (O, e-b) += gy (O, P) col[b:e]^T (P, e-b) */
            dtr__gemm_on(j->pool, worker, g->O, e - b, P, 1.0f, gy, P, 1, col + b * P, 1, P, 1.0f, gw + b, ckk);
        else if (gw)               /* dW[b:e] (e-b, ckk) += gy[b:e] (e-b, P) col^T (P, ckk) */
            dtr__gemm_on(j->pool, worker, e - b, ckk, P, 1.0f, gy + b * P, P, 1, col, 1, P, 1.0f, gw + b * ckk, ckk);
        if (gb)
            for (o = o0; o < o1; o++) gb[o] += dtr__conv_sum(gy + o * P, P);
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
    memset(&j, 0, sizeof j);
    j.nd = nd;
    j.pool = ctx->pool;
    dtr__conv_geom_of(nd, &j.g);
    j.split_cols = j.g.O < j.g.C * j.g.KH * j.g.KW;
    if (dtr__gradof(nd->in[1]) || dtr__gradof(nd->in[2]))
        dtr__pool_run(ctx->pool, j.split_cols ? j.g.C * j.g.KH * j.g.KW : j.g.O, 1, dtr__conv_bwd_w_range, &j);
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
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    n->p.pool2d.k = k; n->p.pool2d.stride = stride; n->p.pool2d.padding = padding;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), 4, shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_maxpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding) {
    return dtr__pool2d(ctx, DTR_OP_MAXPOOL2D, "dtr_maxpool2d", x, k, stride, padding);
}
dtr_tensor *dtr_avgpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding) {
    return dtr__pool2d(ctx, DTR_OP_AVGPOOL2D, "dtr_avgpool2d", x, k, stride, padding);
}

/* Pooling kernels run over the N*C planes in parallel: a plane's output and its input
 * gradient depend on that plane only, so any split gives the same bits. */
typedef struct {
    const dtr__node *nd;
    int64_t H, W, Ho, Wo, k, S, P;
} dtr__pool2d_job;

/* Reference loops: any window, stride and padding; max keeps the first largest value. */
static void dtr__pool2d_fwd_ref(const dtr__pool2d_job *j, int64_t c0, int64_t c1) {
    int64_t H = j->H, W = j->W, Ho = j->Ho, Wo = j->Wo, k = j->k, S = j->S, P = j->P;
    int64_t c, oi, oj, a, b;
    const float *X = dtr__f32(j->nd->in[0]);
    float *Y = dtr__f32(j->nd->out);
    int32_t *arg = (int32_t *)j->nd->saved;
    int maxp = j->nd->op == DTR_OP_MAXPOOL2D;
    for (c = c0; c < c1; c++) {
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
                        if (dtr__f_max_takes(v, best) || bi < 0) { best = v; bi = (int32_t)(ii * W + jj); } /* NaN wins */
                    }
                }
                if (maxp) { Y[(c * Ho + oi) * Wo + oj] = best; arg[(c * Ho + oi) * Wo + oj] = bi; }
                else Y[(c * Ho + oi) * Wo + oj] = s / (float)(k * k);
            }
    }
}

#define DTR__MAX_TAKES(v, best) dtr__f_max_takes(v, best)

/* One 2x2 window per lane: a b / c d. with_nan 0: plain compares (no lane holds a NaN);
 * 1: the NaN-aware rule of the reference. Two loops, each branch-free, so both vectorise. */
static void dtr__maxpool2_lanes(const float *a, const float *b, const float *c, const float *d, float *best,
                                int32_t *bi, int32_t j0, int32_t W, int with_nan) {
    int k;
    for (k = 0; k < 8; k++) { best[k] = a[k]; bi[k] = j0 + 2 * k; }
    if (with_nan) {
        for (k = 0; k < 8; k++) {
            bi[k] = DTR__MAX_TAKES(b[k], best[k]) ? bi[k] + 1 : bi[k];   best[k] = DTR__MAX_TAKES(b[k], best[k]) ? b[k] : best[k];
            bi[k] = DTR__MAX_TAKES(c[k], best[k]) ? j0 + 2 * k + W : bi[k]; best[k] = DTR__MAX_TAKES(c[k], best[k]) ? c[k] : best[k];
            bi[k] = DTR__MAX_TAKES(d[k], best[k]) ? j0 + 2 * k + W + 1 : bi[k]; best[k] = DTR__MAX_TAKES(d[k], best[k]) ? d[k] : best[k];
        }
        return;
    }
    for (k = 0; k < 8; k++) {
        int32_t j = j0 + 2 * k;
        bi[k] = b[k] > best[k] ? j + 1 : bi[k];     best[k] = b[k] > best[k] ? b[k] : best[k];
        bi[k] = c[k] > best[k] ? j + W : bi[k];     best[k] = c[k] > best[k] ? c[k] : best[k];
        bi[k] = d[k] > best[k] ? j + W + 1 : bi[k]; best[k] = d[k] > best[k] ? d[k] : best[k];
    }
}

/* Max pooling with a 2x2 window, stride 2, no padding (the common case): the scan order
 * and comparisons of the reference, without bounds checks. Outputs go in blocks of 8
 * through local arrays, which compilers turn into SIMD compares and selects instead of
 * unpredictable branches; a row's last block has n < 8 valid lanes (the others repeat
 * output column oj and are not stored). A block holding a NaN takes the NaN-aware rule. */
static void dtr__maxpool2_block(const float *r0, const float *r1, float *y, int32_t *ag, int64_t oj, int n,
                                int32_t base, int32_t W) {
    float a[8], b[8], c[8], d[8], best[8], z[8], zs;
    int32_t bi[8];
    int k;
    for (k = 0; k < 8; k++) {
        int64_t q = 2 * (oj + (k < n ? k : 0));
        a[k] = r0[q]; b[k] = r0[q + 1]; c[k] = r1[q]; d[k] = r1[q + 1];
    }
    /* x - x is 0, or NaN when x is NaN or infinite: float lanes the compiler vectorises; a
       block with an infinity takes the exact rule too (same result) */
    for (k = 0; k < 8; k++) z[k] = ((a[k] - a[k]) + (b[k] - b[k])) + ((c[k] - c[k]) + (d[k] - d[k]));
    zs = ((z[0] + z[1]) + (z[2] + z[3])) + ((z[4] + z[5]) + (z[6] + z[7]));
    dtr__maxpool2_lanes(a, b, c, d, best, bi, base + 2 * (int32_t)oj, W, zs != zs);
    for (k = 0; k < n; k++) { y[oj + k] = best[k]; ag[oj + k] = bi[k]; }
}

static void dtr__maxpool2_fwd(const dtr__pool2d_job *j, int64_t c0, int64_t c1) {
    int64_t H = j->H, W = j->W, Ho = j->Ho, Wo = j->Wo, c, oi, oj;
    const float *X = dtr__f32(j->nd->in[0]);
    float *Y = dtr__f32(j->nd->out);
    int32_t *arg = (int32_t *)j->nd->saved;
    for (c = c0; c < c1; c++) {
        const float *xc = X + c * H * W;
        for (oi = 0; oi < Ho; oi++) {
            const float *r0 = xc + 2 * oi * W, *r1 = r0 + W;
            float *y = Y + (c * Ho + oi) * Wo;
            int32_t *ag = arg + (c * Ho + oi) * Wo, base = (int32_t)(2 * oi * W);
            for (oj = 0; oj + 8 <= Wo; oj += 8) dtr__maxpool2_block(r0, r1, y, ag, oj, 8, base, (int32_t)W);
            if (oj < Wo) dtr__maxpool2_block(r0, r1, y, ag, oj, (int)(Wo - oj), base, (int32_t)W);
        }
    }
}

static void dtr__pool2d_fwd_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__pool2d_job *j = (const dtr__pool2d_job *)arg;
    (void)worker;
    if (j->nd->op == DTR_OP_MAXPOOL2D && j->k == 2 && j->S == 2 && j->P == 0) dtr__maxpool2_fwd(j, b, e);
    else dtr__pool2d_fwd_ref(j, b, e);
}

static void dtr__pool2d_bwd_range(void *arg, int64_t c0, int64_t c1, int worker) {
    const dtr__pool2d_job *j = (const dtr__pool2d_job *)arg;
    int64_t H = j->H, W = j->W, Ho = j->Ho, Wo = j->Wo, k = j->k, S = j->S, P = j->P;
    int64_t c, oi, oj, a, b;
    const float *G = j->nd->out->grad;
    const int32_t *arg_ = (const int32_t *)j->nd->saved;
    float *gx = dtr__gradof(j->nd->in[0]);
    (void)worker;
    for (c = c0; c < c1; c++) {
        float *gc = gx + c * H * W;
        if (j->nd->op == DTR_OP_MAXPOOL2D) {
            const float *g = G + c * Ho * Wo;
            const int32_t *ag = arg_ + c * Ho * Wo;
            for (oi = 0; oi < Ho * Wo; oi++) gc[ag[oi]] += g[oi];
            continue;
        }
        for (oi = 0; oi < Ho; oi++)
            for (oj = 0; oj < Wo; oj++) {
                float g = G[(c * Ho + oi) * Wo + oj] / (float)(k * k);
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
}

static void dtr__pool2d_job_of(const dtr__node *nd, dtr__pool2d_job *j, int64_t *planes, int64_t *grain) {
    const dtr_tensor *x = nd->in[0];
    j->nd = nd;
    j->H = x->shape[2]; j->W = x->shape[3];
    j->Ho = nd->out->shape[2]; j->Wo = nd->out->shape[3];
    j->k = nd->p.pool2d.k; j->S = nd->p.pool2d.stride; j->P = nd->p.pool2d.padding;
    *planes = x->shape[0] * x->shape[1];
    *grain = 16384 / (j->H * j->W + 1) + 1;   /* about 16k input elements per chunk at least */
}

dtr_result dtr__cpu_pool2d_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__pool2d_job j;
    int64_t planes, grain;
    if (nd->op == DTR_OP_MAXPOOL2D) { /* argmax of each window, for backward */
        nd->saved = dtr__node_save(ctx, nd, (size_t)dtr_tensor_numel(nd->out) * sizeof(int32_t));
        if (!nd->saved) return ctx->status;
    }
    dtr__pool2d_job_of(nd, &j, &planes, &grain);
    dtr__pool_run(ctx->pool, planes, grain, dtr__pool2d_fwd_range, &j);
    return DTR_OK;
}

dtr_result dtr__cpu_pool2d_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__pool2d_job j;
    int64_t planes, grain;
    if (!dtr__gradof(nd->in[0])) return DTR_OK;
    dtr__pool2d_job_of(nd, &j, &planes, &grain);
    dtr__pool_run(ctx->pool, planes, grain, dtr__pool2d_bwd_range, &j);
    return DTR_OK;
}
