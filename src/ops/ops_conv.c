/* ============================================================================
 * Convolution and pooling over images. Shapes: x (N, C, H, W), w (O, C / G, KH, KW),
 * y (N, O, Ho, Wo) with Ho = (H + 2 PH - DH (KH - 1) - 1) / SH + 1 (stride S, padding P,
 * dilation D per axis, G groups; Wo alike). Convolution is a GEMM over the column matrix of
 * sample n, (C*KH*KW, Ho*Wo) (group g's rows a block of it, C/G*KH*KW rows), which is never
 * stored: the GEMM's packing makes each block of it from the image as it goes (implicit GEMM:
 * dtr__gemm_on_gen), in forward and, transposed, for the weight's gradient; the input's
 * gradient is col2im of W^T gy made a band of output rows at a time in a buffer per worker.
 * With fewer samples than workers a sample is split too (dtr__conv_pieces: the forward over
 * slabs of pixels, col2im over slabs of channels). A depthwise convolution (groups = C = O)
 * runs direct loops over each plane instead (no columns: its products are too thin for
 * GEMMs). 1-D convolution is the 2-D one over (N, C, 1, L).
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include "../core/formulas.h"
#include <math.h>

/* ---- im2col / col2im ---- */

typedef struct dtr__conv_geom {
    int64_t N, C, H, W, O, KH, KW, Ho, Wo;
    int64_t SH, SW, PH, PW, DH, DW, G;   /* stride, padding, dilation per axis; groups */
} dtr__conv_geom;

/* gx += col2im(col) for channels [c0, c1) and output rows [r0, r1): col holds their columns,
   ((c1 - c0) KH KW, (r1 - r0) Wo) */
static void dtr__col2im_add_ref(const dtr__conv_geom *g, const float *col, int64_t c0, int64_t c1, int64_t r0, int64_t r1,
                                float *gx) {
    int64_t c, ki, kj, oi, oj, pb = (r1 - r0) * g->Wo;
    for (c = c0; c < c1; c++)
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                const float *row = col + (((c - c0) * g->KH + ki) * g->KW + kj) * pb - r0 * g->Wo;
                for (oi = r0; oi < r1; oi++) {
                    int64_t ii = oi * g->SH - g->PH + ki * g->DH;
                    if (ii < 0 || ii >= g->H) continue;
                    for (oj = 0; oj < g->Wo; oj++) {
                        int64_t jj = oj * g->SW - g->PW + kj * g->DW;
                        if (jj >= 0 && jj < g->W) gx[(c * g->H + ii) * g->W + jj] += row[oi * g->Wo + oj];
                    }
                }
            }
}

/* The output columns [*j0, *j1) whose input column oj SW - PW + kj DW (tap kj) lies inside the
 * row. With stride 1 along the width (any padding, dilation, height stride) each output row is
 * then one contiguous run of the input row between zero margins [0, j0) and [j1, Wo): the
 * fast im2col / col2im below give the reference loops' results (copies and the same order of
 * additions) without per-element bounds checks; the depthwise loops use it at any stride. */
static void dtr__conv_valid_cols(const dtr__conv_geom *g, int64_t kj, int64_t *j0, int64_t *j1) {
    int64_t lo = g->PW - kj * g->DW, hi = g->W - 1 + g->PW - kj * g->DW;
    *j0 = lo <= 0 ? 0 : (lo + g->SW - 1) / g->SW;
    *j1 = hi < 0 ? 0 : hi / g->SW + 1;
    if (*j0 > g->Wo) *j0 = g->Wo;
    if (*j1 > g->Wo) *j1 = g->Wo;
    if (*j1 < *j0) *j1 = *j0;
}

/* d[0..n) = s[0..n) and d[0..n) += w s[0..n) for the short runs of the columns, col2im (w 1:
 * the bits of an add) and the depthwise rows: blocks of 8 the compiler vectorises at -O2
 * (DTR__ELEMENTWISE; d and s never overlap). Always inlined, so that the depthwise loops'
 * AVX2 twins run them 8 floats a vector. */
DTR__SIMD_BODY void dtr__conv_copy(float *d, const float *s, int64_t n) { DTR__ELEMENTWISE(0, n, d[i] = s[i]); }

DTR__SIMD_BODY void dtr__conv_axpy(float *d, const float *s, float w, int64_t n) { DTR__ELEMENTWISE(0, n, d[i] += w * s[i]); }

/* A tap of the kernel: channel c (of the group's image), kernel row ki and column kj, and the
 * output columns [j0, j1) where it falls inside the input row (dtr__conv_valid_cols). */
typedef struct dtr__conv_tapk { int64_t c, ki, kj, j0, j1; } dtr__conv_tapk;

static void dtr__conv_tap_of(const dtr__conv_geom *g, int64_t k, dtr__conv_tapk *t) {
    int64_t kk = g->KH * g->KW;
    t->c = k / kk, t->ki = k % kk / g->KW, t->kj = k % g->KW;
    dtr__conv_valid_cols(g, t->kj, &t->j0, &t->j1);
}

/* the next tap (kj, then ki, then c), without divisions: its valid columns from vc (2 a
   kernel column) when given */
static void dtr__conv_tap_next(const dtr__conv_geom *g, dtr__conv_tapk *t, const int64_t *vc) {
    if (++t->kj == g->KW) {
        t->kj = 0;
        if (++t->ki == g->KH) t->ki = 0, t->c++;
    }
    if (vc) t->j0 = vc[2 * t->kj], t->j1 = vc[2 * t->kj + 1];
    else dtr__conv_valid_cols(g, t->kj, &t->j0, &t->j1);
}

/* The columns' row of tap t at n output pixels from row oi, column oj, into d: zeros where
 * the tap falls into the padding, else the image's values (with stride 1 along the width a
 * run of the input row copied). */
DTR__SIMD_BODY void dtr__conv_tap(const dtr__conv_geom *g, const float *img, const dtr__conv_tapk *t, int64_t oi,
                                  int64_t oj, int64_t n, float *d) {
    int64_t off = t->kj * g->DW - g->PW, o;   /* the input column of output column o: o SW + off */
    const float *plane = img + t->c * g->H * g->W;
    for (; n > 0; oj = 0, oi++) {
        int64_t m = n < g->Wo - oj ? n : g->Wo - oj, e = oj + m, ii = oi * g->SH - g->PH + t->ki * g->DH;
        int64_t a = oj > t->j0 ? oj : t->j0, b = e < t->j1 ? e : t->j1;
        const float *row = plane + (ii >= 0 && ii < g->H ? ii : 0) * g->W;
        if (ii < 0 || ii >= g->H || b <= a) a = b = oj;
        for (o = oj; o < a; o++) d[o - oj] = 0.0f;
        if (g->SW == 1 && b - a >= 16) memcpy(d + (a - oj), row + a + off, (size_t)(b - a) * sizeof(float));
        else if (g->SW == 1) dtr__conv_copy(d + (a - oj), row + a + off, b - a);
        else for (o = a; o < b; o++) d[o - oj] = row[o * g->SW + off];
        for (o = b; o < e; o++) d[o - oj] = 0.0f;
        d += m, n -= m;
    }
}

/* vc[2 kj], vc[2 kj + 1]: the valid output columns of each kernel column (NULL when the kernel
   is wider than the room: each tap computes its own) */
static const int64_t *dtr__conv_valid_table(const dtr__conv_geom *g, int64_t *vc, int room) {
    int64_t kj;
    if (g->KW > room) return NULL;
    for (kj = 0; kj < g->KW; kj++) dtr__conv_valid_cols(g, kj, &vc[2 * kj], &vc[2 * kj + 1]);
    return vc;
}

static void dtr__col2im_add(const dtr__conv_geom *g, const float *col, int64_t c0, int64_t c1, int64_t r0, int64_t r1, float *gx) {
    int64_t c, ki, kj, oi, j0, j1, pb = (r1 - r0) * g->Wo;
    if (g->SW != 1) { dtr__col2im_add_ref(g, col, c0, c1, r0, r1, gx); return; }
    for (c = c0; c < c1; c++)
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                const float *row = col + (((c - c0) * g->KH + ki) * g->KW + kj) * pb - r0 * g->Wo;
                dtr__conv_valid_cols(g, kj, &j0, &j1);
                for (oi = r0; oi < r1; oi++) {
                    int64_t ii = oi * g->SH - g->PH + ki * g->DH;
                    const float *r = row + oi * g->Wo + j0;
                    float *d;
                    if (ii < 0 || ii >= g->H || j1 <= j0) continue;
                    d = gx + (c * g->H + ii) * g->W + (j0 - g->PW + kj * g->DW);   /* input column of output column j0 */
                    dtr__conv_axpy(d, r, 1.0f, j1 - j0);
                }
            }
}

/* conv2d: the image x, the products y; a transposed convolution: the image y, the products x */
static void dtr__conv_geom_of(const dtr__node *nd, dtr__conv_geom *g) {
    const dtr_tensor *w = nd->in[1], *img = nd->op == DTR_OP_CONV2D ? nd->in[0] : nd->out;
    const dtr_tensor *prod = nd->op == DTR_OP_CONV2D ? nd->out : nd->in[0];
    g->N = img->shape[0]; g->C = img->shape[1]; g->H = img->shape[2]; g->W = img->shape[3];
    g->O = w->shape[0]; g->KH = w->shape[2]; g->KW = w->shape[3];
    g->SH = nd->p.conv2d.stride[0]; g->SW = nd->p.conv2d.stride[1];
    g->PH = nd->p.conv2d.padding[0]; g->PW = nd->p.conv2d.padding[1];
    g->DH = nd->p.conv2d.dilation[0]; g->DW = nd->p.conv2d.dilation[1];
    g->G = nd->p.conv2d.groups;
    g->Ho = prod->shape[2]; g->Wo = prod->shape[3];
}

/* ---- conv2d ---- */

dtr_conv_config dtr_conv_config_init(void) {
    dtr_conv_config c;
    c.stride[0] = c.stride[1] = 1;
    c.padding[0] = c.padding[1] = 0;
    c.dilation[0] = c.dilation[1] = 1;
    c.output_padding[0] = c.output_padding[1] = 0;
    c.groups = 1;
    return c;
}

/* the output's extent along an axis of `in` for a kernel of k taps; < 1 when it does not fit */
static int64_t dtr__conv_out(int64_t in, int64_t k, int s, int p, int d) {
    int64_t span = (int64_t)d * (k - 1) + 1;
    return in + 2 * (int64_t)p < span ? 0 : (in + 2 * (int64_t)p - span) / s + 1;
}

/* the geometry's values (output_padding only for a transposed convolution, below its stride or dilation) */
static dtr_result dtr__conv_check_config(dtr_context *ctx, const char *fn, const dtr_conv_config *c, int transposed) {
    int a;
    for (a = 0; a < 2; a++) {
        int op = c->output_padding[a];
        if (c->stride[a] < 1 || c->padding[a] < 0 || c->dilation[a] < 1)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: stride %d and dilation %d must be >= 1, padding %d >= 0", fn,
                             c->stride[a], c->dilation[a], c->padding[a]);
        if (op < 0 || (op > 0 && !transposed) || (op >= c->stride[a] && op >= c->dilation[a]))
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: output_padding %d must be >= 0 and below the stride %d or the "
                             "dilation %d%s", fn, op, c->stride[a], c->dilation[a], transposed ? "" : " (0 but for a transposed "
                             "convolution)");
    }
    if (c->groups < 1) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: groups %d must be >= 1", fn, c->groups);
    return DTR_OK;
}

/* the arguments' checks (DTR_OK or the context's error); *ho, *wo the output's extent */
static dtr_result dtr__conv_check(dtr_context *ctx, const dtr_tensor *x, const dtr_tensor *w, const dtr_tensor *bias,
                                  const dtr_conv_config *c, int64_t *ho, int64_t *wo) {
    char s1[96], s2[96];
    if (dtr__conv_check_config(ctx, "dtr_conv2d", c, 0) != DTR_OK) return ctx->status;
    if (x->ndim != 4 || w->ndim != 4 || x->shape[1] % c->groups || w->shape[0] % c->groups ||
        x->shape[1] != w->shape[1] * c->groups)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_conv2d: x %s and w %s must be (N, C, H, W) and (O, C / groups, KH, KW) "
                         "with groups %d dividing C and O", dtr__shape_str(x, s1, sizeof s1), dtr__shape_str(w, s2, sizeof s2),
                         c->groups);
    if (bias && (bias->ndim != 1 || bias->shape[0] != w->shape[0]))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_conv2d: bias %s must be (%lld)", dtr__shape_str(bias, s1, sizeof s1),
                         (long long)w->shape[0]);
    *ho = dtr__conv_out(x->shape[2], w->shape[2], c->stride[0], c->padding[0], c->dilation[0]);
    *wo = dtr__conv_out(x->shape[3], w->shape[3], c->stride[1], c->padding[1], c->dilation[1]);
    if (*ho < 1 || *wo < 1)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_conv2d: kernel %s (dilated) larger than the padded input %s",
                         dtr__shape_str(w, s1, sizeof s1), dtr__shape_str(x, s2, sizeof s2));
    return DTR_OK;
}

/* the node of a checked convolution (op CONV2D or CONV_TRANSPOSE2D) with an output of `shape` */
static dtr_tensor *dtr__conv_node(dtr_context *ctx, int op, const char *name, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias,
                                  const dtr_conv_config *c, const int64_t *shape) {
    dtr__node *n;
    int a;
    x = dtr__contig_input(ctx, x);
    w = dtr__contig_input(ctx, w);
    if (!x || !w) return NULL;
    {
        dtr_tensor *in[3] = {x, w, bias};
        n = dtr__node_new(ctx, op, bias ? 3 : 2, in);
    }
    if (!n) return NULL;
    for (a = 0; a < 2; a++) {
        n->p.conv2d.stride[a] = c->stride[a];
        n->p.conv2d.padding[a] = c->padding[a];
        n->p.conv2d.dilation[a] = c->dilation[a];
    }
    n->p.conv2d.groups = c->groups;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), 4, shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_conv2d_ex(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias, const dtr_conv_config *cfg) {
    dtr_conv_config c = cfg ? *cfg : dtr_conv_config_init();
    int64_t shape[4], Ho = 0, Wo = 0;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_conv2d", x, "x") || !dtr__check_input(ctx, "dtr_conv2d", w, "w")) return NULL;
    if (bias && !dtr__check_input(ctx, "dtr_conv2d", bias, "bias")) return NULL;
    if (dtr__conv_check(ctx, x, w, bias, &c, &Ho, &Wo) != DTR_OK) return NULL;
    shape[0] = x->shape[0]; shape[1] = w->shape[0]; shape[2] = Ho; shape[3] = Wo;
    return dtr__conv_node(ctx, DTR_OP_CONV2D, "dtr_conv2d", x, w, bias, &c, shape);
}

dtr_tensor *dtr_conv2d(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias, int stride, int padding) {
    dtr_conv_config c = dtr_conv_config_init();
    c.stride[0] = c.stride[1] = stride;
    c.padding[0] = c.padding[1] = padding;
    return dtr_conv2d_ex(ctx, x, w, bias, &c);
}

/* 1-D: (N, C, L) as (N, C, 1, L), w (O, C / groups, K) as (O, C / groups, 1, K) */
dtr_tensor *dtr_conv1d(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias, int stride, int padding, int dilation,
                       int groups) {
    dtr_conv_config c = dtr_conv_config_init();
    int64_t xs[4], ws[4], ys[3];
    dtr_tensor *y;
    char s1[96], s2[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_conv1d", x, "x") || !dtr__check_input(ctx, "dtr_conv1d", w, "w")) return NULL;
    if (x->ndim != 3 || w->ndim != 3)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_conv1d: x %s and w %s must be (N, C, L) and (O, C / groups, K)",
                          dtr__shape_str(x, s1, sizeof s1), dtr__shape_str(w, s2, sizeof s2));
    c.stride[1] = stride; c.padding[1] = padding; c.dilation[1] = dilation; c.groups = groups;
    if (dtr__conv_check_config(ctx, "dtr_conv1d", &c, 0) != DTR_OK) return NULL;   /* (errors that name this function) */
    xs[0] = x->shape[0]; xs[1] = x->shape[1]; xs[2] = 1; xs[3] = x->shape[2];
    ws[0] = w->shape[0]; ws[1] = w->shape[1]; ws[2] = 1; ws[3] = w->shape[2];
    x = dtr_reshape(ctx, x, 4, xs);
    w = x ? dtr_reshape(ctx, w, 4, ws) : NULL;
    if (!w || !(y = dtr_conv2d_ex(ctx, x, w, bias, &c))) return NULL;
    ys[0] = y->shape[0]; ys[1] = y->shape[1]; ys[2] = y->shape[3];
    return dtr_reshape(ctx, y, 3, ys);
}

/* ---- conv_transpose2d ---- */

/* x (N, Cin, H, W), w (Cin, Cout / G, KH, KW), bias (Cout): *shape the output's, or an error */
static dtr_result dtr__convt_check(dtr_context *ctx, const dtr_tensor *x, const dtr_tensor *w, const dtr_tensor *bias,
                                   const dtr_conv_config *c, int64_t *shape) {
    char s1[96], s2[96];
    int a;
    if (dtr__conv_check_config(ctx, "dtr_conv_transpose2d", c, 1) != DTR_OK) return ctx->status;
    if (x->ndim != 4 || w->ndim != 4 || x->shape[1] != w->shape[0] || x->shape[1] % c->groups)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_conv_transpose2d: x %s and w %s must be (N, Cin, H, W) and (Cin, Cout / "
                         "groups, KH, KW) with groups %d dividing Cin", dtr__shape_str(x, s1, sizeof s1),
                         dtr__shape_str(w, s2, sizeof s2), c->groups);
    shape[0] = x->shape[0];
    shape[1] = w->shape[1] * c->groups;
    if (bias && (bias->ndim != 1 || bias->shape[0] != shape[1]))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_conv_transpose2d: bias %s must be (%lld)", dtr__shape_str(bias, s1, sizeof s1),
                         (long long)shape[1]);
    for (a = 0; a < 2; a++) {
        shape[2 + a] = (x->shape[2 + a] - 1) * c->stride[a] - 2 * (int64_t)c->padding[a] +
                       (int64_t)c->dilation[a] * (w->shape[2 + a] - 1) + c->output_padding[a] + 1;
        if (shape[2 + a] < 1)
            return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_conv_transpose2d: padding %d leaves no output of x %s", c->padding[a],
                             dtr__shape_str(x, s1, sizeof s1));
    }
    return DTR_OK;
}

dtr_tensor *dtr_conv_transpose2d(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias, const dtr_conv_config *cfg) {
    dtr_conv_config c = cfg ? *cfg : dtr_conv_config_init();
    int64_t shape[4];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_conv_transpose2d", x, "x") || !dtr__check_input(ctx, "dtr_conv_transpose2d", w, "w")) return NULL;
    if (bias && !dtr__check_input(ctx, "dtr_conv_transpose2d", bias, "bias")) return NULL;
    if (dtr__convt_check(ctx, x, w, bias, &c, shape) != DTR_OK) return NULL;
    return dtr__conv_node(ctx, DTR_OP_CONV_TRANSPOSE2D, "dtr_conv_transpose2d", x, w, bias, &c, shape);
}

/* The kernels' view of a convolution: the image side (N, C, H, W) and the product side
 * (N, O, Ho*Wo) of w (O, C/G, KH, KW). conv2d reads the image and writes the products in
 * forward; a transposed convolution runs the same pieces the other way round. */
typedef struct {
    dtr__conv_geom g;
    dtr__pool *pool;
    const float *w;        /* (O, C/G*KH*KW) */
    const float *img;      /* im2col's image */
    float *prod;           /* W col written: filled with bias (or 0) first, or added to (accumulate) */
    const float *bias;     /* (O) for prod, or NULL */
    int accumulate;
    float *tmp;            /* per worker, DTR__CONV_TMP floats: the weight gradient's taps as rows */
    const float *gprod;    /* (N, O, P) read by the weight gradient and by W^T (col2im) */
    float *gimg;           /* col2im's target (added to) */
    float *gcol;           /* per-worker column buffers of the W^T products */
    float *gw, *gb;        /* gb: the product side's per-channel sums of gprod */
    int split_cols;        /* dW split over columns (1) or output channels (0) */
    int64_t pieces;        /* forward and col2im: the pieces of a sample (dtr__conv_pieces) */
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

/* The columns of one group of one sample as a GEMM operand made on the fly (dtr__gemm_bgen):
   B (taps, pixels) in forward, B (pixels, taps from t0) transposed for the weight gradient */
typedef struct dtr__conv_cols {
    const dtr__conv_geom *g;
    const float *img;      /* the group's first channel of the sample's image */
    int64_t j_off;         /* forward: the pixel of the product's column 0 */
    int64_t t0;            /* transposed: the first tap */
    float *tmp;            /* transposed: room for 32 taps of DTR__GEMM_MAX_KC pixels */
} dtr__conv_cols;

#define DTR__CONV_TMP (32 * DTR__GEMM_MAX_KC)

/* B(k, j) = row k of the columns at pixel j: tap by tap, each tap's row of every panel */
DTR__SIMD_BODY void dtr__conv_gen_body(void *user, int64_t k0, int64_t kb, int64_t j0, int64_t nb, int nr, float *dst) {
    const dtr__conv_cols *u = (const dtr__conv_cols *)user;
    const dtr__conv_geom *g = u->g;
    int64_t vcs[32], k, p, c, oi0 = (j0 + u->j_off) / g->Wo, oj0 = (j0 + u->j_off) % g->Wo;
    const int64_t *vc = dtr__conv_valid_table(g, vcs, 16);
    dtr__conv_tapk t;
    for (k = 0, dtr__conv_tap_of(g, k0, &t); k < kb; k++, dtr__conv_tap_next(g, &t, vc)) {
        int64_t oi = oi0, oj = oj0;
        for (p = 0; p < nb; p += nr) {
            int64_t cols = nb - p < nr ? nb - p : nr;
            float *d = dst + p * kb + k * nr;   /* panel p / nr starts at p kb */
            dtr__conv_tap(g, u->img, &t, oi, oj, cols, d);
            for (c = cols; c < nr; c++) d[c] = 0.0f;
            for (oj += nr; oj >= g->Wo; oj -= g->Wo) oi++;
        }
    }
}

/* B(k, j) = row t0 + j of the columns at pixel k: a panel's taps made as rows into tmp, then
   packed across as the GEMM packs a transposed operand (one-column panels: the GEMM's
   fallback without memory, element by element) */
DTR__SIMD_BODY void dtr__conv_gen_t_body(void *user, int64_t k0, int64_t kb, int64_t j0, int64_t nb, int nr, float *dst) {
    const dtr__conv_cols *u = (const dtr__conv_cols *)user;
    const dtr__conv_geom *g = u->g;
    int64_t vcs[32], p, t;
    const int64_t *vc = dtr__conv_valid_table(g, vcs, 16);
    for (p = 0; p < nb; p += nr, dst += (int64_t)nr * kb) {
        int64_t cols = nb - p < nr ? nb - p : nr;
        dtr__conv_tapk tk;
        for (t = 0, dtr__conv_tap_of(g, u->t0 + j0 + p, &tk); t < cols; t++, dtr__conv_tap_next(g, &tk, vc))
            dtr__conv_tap(g, u->img, &tk, k0 / g->Wo, k0 % g->Wo, kb, u->tmp + t * kb);
        if (nr > 1) dtr__gemm_pack_panels(u->tmp, 1, kb, kb, cols, dst);
        else for (t = 0; t < kb; t++) dst[t] = u->tmp[t];
    }
}

/* the producers as they are and for AVX2 (src/core/platform.h: the same bits) */
static void dtr__conv_gen(void *u, int64_t k0, int64_t kb, int64_t j0, int64_t nb, int nr, float *d) {
    dtr__conv_gen_body(u, k0, kb, j0, nb, nr, d);
}
static void dtr__conv_gen_t(void *u, int64_t k0, int64_t kb, int64_t j0, int64_t nb, int nr, float *d) {
    dtr__conv_gen_t_body(u, k0, kb, j0, nb, nr, d);
}
DTR__TARGET_AVX2 static void dtr__conv_gen_avx2(void *u, int64_t k0, int64_t kb, int64_t j0, int64_t nb, int nr, float *d) {
    dtr__conv_gen_body(u, k0, kb, j0, nb, nr, d);
}
DTR__TARGET_AVX2 static void dtr__conv_gen_t_avx2(void *u, int64_t k0, int64_t kb, int64_t j0, int64_t nb, int nr, float *d) {
    dtr__conv_gen_t_body(u, k0, kb, j0, nb, nr, d);
}
#define DTR__CONV_GEN (dtr__simd_avx2() ? dtr__conv_gen_avx2 : dtr__conv_gen)
#define DTR__CONV_GEN_T (dtr__simd_avx2() ? dtr__conv_gen_t_avx2 : dtr__conv_gen_t)

/* The pieces each sample's work splits into: 1, or with fewer samples than workers (one
   large image, a robot's frame) enough that every worker has one, of at least `least` items
   of the `items` the split goes over (pixels, channels). */
static int64_t dtr__conv_pieces(const dtr__conv_job *j, int64_t items, int64_t least) {
    int64_t t = dtr__pool_threads(j->pool), s;
    if (j->g.N >= t) return 1;
    s = (t + j->g.N - 1) / j->g.N;
    if (s > items / least) s = items / least;
    return s < 1 ? 1 : s;
}

/* [*a, *b): piece s of `pieces` over n items, its ends multiples of `align` (but the last) */
static void dtr__conv_piece(int64_t n, int64_t pieces, int64_t s, int64_t align, int64_t *a, int64_t *b) {
    *a = n * s / pieces / align * align;
    *b = s + 1 == pieces ? n : n * (s + 1) / pieces / align * align;
}

/* prod = W col, per sample (or per slab of a sample's pixels: j->pieces), the columns made as
   the GEMM packs them; a slab of columns is a slab of the product, the same bits */
static void dtr__conv_fwd_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    int64_t ckk = g->C / g->G * g->KH * g->KW, og = g->O / g->G, P = g->Ho * g->Wo, x, o, q, p0, p1;
    dtr__conv_cols u;
    memset(&u, 0, sizeof u);
    u.g = g;
    for (x = b; x < e; x++) {
        int64_t n = x / j->pieces;
        float *y = j->prod + n * g->O * P;
        dtr__conv_piece(P, j->pieces, x % j->pieces, 32, &p0, &p1);
        u.j_off = p0;
        if (!j->accumulate)
            for (o = 0; o < g->O; o++) dtr__conv_fill(y + o * P + p0, p1 - p0, j->bias ? j->bias[o] : 0.0f);
        for (q = 0; q < g->G && p1 > p0; q++) {   /* group q: y[q] (og, P) += W[q] (og, ckk) col[q] (ckk, P) */
            u.img = j->img + (n * g->C + q * (g->C / g->G)) * g->H * g->W;
            dtr__gemm_on_gen(j->pool, worker, og, p1 - p0, ckk, 1.0f, j->w + q * og * ckk, ckk, 1, DTR__CONV_GEN, &u, 1.0f,
                             y + q * og * P + p0, P);
        }
    }
}

/* the forward over the pool: samples, or slabs of at least 64 of their pixels */
static void dtr__conv_run_fwd(dtr_context *ctx, dtr__conv_job *j) {
    j->pieces = dtr__conv_pieces(j, j->g.Ho * j->g.Wo, 64);
    dtr__pool_run(ctx->pool, j->g.N * j->pieces, 1, dtr__conv_fwd_range, j);
}

static void dtr__conv_job_of(dtr_context *ctx, const dtr__node *nd, dtr__conv_job *j) {
    memset(j, 0, sizeof *j);
    j->pool = ctx->pool;
    dtr__conv_geom_of(nd, &j->g);
    j->w = dtr__f32(nd->in[1]);
}

/* `per` floats for each worker of the pool, from the arena (NULL: the context's error) */
static float *dtr__conv_scratch(dtr_context *ctx, size_t per) {
    return (float *)dtr__arena_data(ctx, (size_t)dtr__pool_threads(ctx->pool) * per * sizeof(float), "dtr_conv columns");
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

/* ---- depthwise (groups = C = O): direct loops over each plane, no columns ---- */

/* the sum of a[i] b[i] over [0, n) in dtr__conv_sum's order (8 running sums: one SIMD register) */
DTR__SIMD_BODY float dtr__conv_dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, s;
    int64_t i;
    int k;
    for (i = 0; i + 8 <= n; i += 8)
        for (k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Tap (ki, kj) of one plane: mode 0 y += w x (a = x, b = y), 1 gx += w gy (a = gy, b = gx);
 * mode 2 returns the sum of gy x over the tap's pairs (a = gy, b = x), each row's in f32 and
 * the rows' in double. x's rows and columns: ii = oi SH - PH + ki DH, jj = oj SW - PW + kj DW. */
DTR__SIMD_BODY double dtr__dw_tap(const dtr__conv_geom *g, int64_t ki, int64_t kj, int mode, float w, const float *a, float *b) {
    int64_t oi, oj, j0, j1, d = kj * g->DW - g->PW, S = g->SW;
    double sum = 0.0;
    dtr__conv_valid_cols(g, kj, &j0, &j1);
    for (oi = 0; oi < g->Ho && j1 > j0; oi++) {
        int64_t ii = oi * g->SH - g->PH + ki * g->DH, n = j1 - j0;
        const float *ra;
        float *rb, acc = 0.0f;
        if (ii < 0 || ii >= g->H) continue;
        ra = a + (mode == 0 ? ii * g->W + j0 * S + d : oi * g->Wo + j0);   /* x (mode 0) or gy at column j0 */
        rb = b + (mode == 0 ? oi * g->Wo + j0 : ii * g->W + j0 * S + d);
        if (mode < 2 && S == 1)
            dtr__conv_axpy(rb, ra, w, n);
        else if (mode == 0)
            for (oj = 0; oj < n; oj++) rb[oj] += w * ra[oj * S];
        else if (mode == 1)
            for (oj = 0; oj < n; oj++) rb[oj * S] += w * ra[oj];
        else if (S == 1)
            acc = dtr__conv_dot(ra, rb, n);
        else
            for (oj = 0; oj < n; oj++) acc += ra[oj] * rb[oj * S];
        sum += acc;
    }
    return sum;
}

/* planes [b, e) of (N, C): y = bias + the taps over x (mode 0), or gx += the taps over gy (1) */
DTR__SIMD_BODY void dtr__dw_planes_body(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    int64_t t, ki, kj, HW = g->H * g->W, P = g->Ho * g->Wo, kk = g->KH * g->KW;
    (void)worker;
    for (t = b; t < e; t++) {
        const float *w = j->w + (t % g->C) * kk;
        if (j->prod) dtr__conv_fill(j->prod + t * P, P, j->bias ? j->bias[t % g->C] : 0.0f);
        for (ki = 0; ki < g->KH; ki++)
            for (kj = 0; kj < g->KW; kj++) {
                if (j->prod) dtr__dw_tap(g, ki, kj, 0, w[ki * g->KW + kj], j->img + t * HW, j->prod + t * P);
                else dtr__dw_tap(g, ki, kj, 1, w[ki * g->KW + kj], j->gprod + t * P, j->gimg + t * HW);
            }
    }
}

/* channels [b, e): dW[c] += the taps' sums of gy x over the samples, db[c] += gy's sum */
DTR__SIMD_BODY void dtr__dw_weights_body(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    int64_t c, n, ki, kj, HW = g->H * g->W, P = g->Ho * g->Wo, kk = g->KH * g->KW;
    (void)worker;
    for (c = b; c < e; c++)
        for (n = 0; n < g->N; n++) {
            const float *gy = j->gprod + (n * g->C + c) * P;
            if (j->gb) j->gb[c] += dtr__conv_sum(gy, P);
            for (ki = 0; j->gw && ki < g->KH; ki++)
                for (kj = 0; kj < g->KW; kj++)
                    j->gw[c * kk + ki * g->KW + kj] +=
                        (float)dtr__dw_tap(g, ki, kj, 2, 0.0f, gy, (float *)(uintptr_t)(j->img + (n * g->C + c) * HW));
        }
}

/* the depthwise loops as they are and for AVX2 (src/core/platform.h: the same bits) */
static void dtr__dw_planes(void *arg, int64_t b, int64_t e, int w) { dtr__dw_planes_body(arg, b, e, w); }
static void dtr__dw_weights(void *arg, int64_t b, int64_t e, int w) { dtr__dw_weights_body(arg, b, e, w); }
DTR__TARGET_AVX2 static void dtr__dw_planes_avx2(void *arg, int64_t b, int64_t e, int w) { dtr__dw_planes_body(arg, b, e, w); }
DTR__TARGET_AVX2 static void dtr__dw_weights_avx2(void *arg, int64_t b, int64_t e, int w) { dtr__dw_weights_body(arg, b, e, w); }
#define DTR__DW_PLANES (dtr__simd_avx2() ? dtr__dw_planes_avx2 : dtr__dw_planes)
#define DTR__DW_WEIGHTS (dtr__simd_avx2() ? dtr__dw_weights_avx2 : dtr__dw_weights)

static int dtr__conv_depthwise(const dtr__conv_geom *g) { return g->G > 1 && g->G == g->C && g->G == g->O; }

dtr_result dtr__cpu_conv2d_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__conv_job j;
    dtr__conv_job_of(ctx, nd, &j);
    j.img = dtr__f32(nd->in[0]);
    j.prod = dtr__f32(nd->out);
    j.bias = nd->in[2] ? dtr__f32(nd->in[2]) : NULL;
    if (dtr__conv_depthwise(&j.g)) {
        dtr__pool_run(ctx->pool, j.g.N * j.g.C, 1, DTR__DW_PLANES, &j);
        return DTR_OK;
    }
    dtr__conv_run_fwd(ctx, &j);
    return DTR_OK;
}

/* dW and db. Each worker owns a slab of dW (O, ckk = C/G*KH*KW) and sums over the samples in
 * one fixed order, so any split gives the same bits. The slab is a range of output channels
 * (rows; every worker packs all columns of each sample) or, when there are fewer output
 * channels than ckk, a range of columns of every group's block (every worker packs the
 * smaller gy instead). The bias rows are split in proportion to the units. */
static void dtr__conv_bwd_w_sample(const dtr__conv_job *j, int worker, const float *gy, const float *img, int64_t b, int64_t e) {
    const dtr__conv_geom *g = &j->g;
    int64_t ckk = g->C / g->G * g->KH * g->KW, og = g->O / g->G, P = g->Ho * g->Wo, q, o0, o1;
    dtr__conv_cols u;
    u.g = g;
    u.tmp = j->tmp + (int64_t)worker * DTR__CONV_TMP;
    for (q = 0; q < g->G; q++) {
        const float *gq = gy + q * og * P;
        float *wq = j->gw + q * og * ckk;
        u.img = img + q * (g->C / g->G) * g->H * g->W;
        if (j->split_cols) {   /* dW[q][:, b:e] (og, e-b) += gy[q] (og, P) col[q][b:e]^T (P, e-b) */
            u.t0 = b;
            dtr__gemm_on_gen(j->pool, worker, og, e - b, P, 1.0f, gq, P, 1, DTR__CONV_GEN_T, &u, 1.0f, wq + b, ckk);
            continue;
        }
        o0 = b > q * og ? b - q * og : 0;   /* this group's rows of [b, e) */
        o1 = e < (q + 1) * og ? e - q * og : og;
        u.t0 = 0;
        if (o1 > o0)   /* dW[q][o0:o1] (o1-o0, ckk) += gy[q][o0:o1] (o1-o0, P) col[q]^T (P, ckk) */
            dtr__gemm_on_gen(j->pool, worker, o1 - o0, ckk, P, 1.0f, gq + o0 * P, P, 1, DTR__CONV_GEN_T, &u, 1.0f,
                             wq + o0 * ckk, ckk);
    }
}

static void dtr__conv_bwd_w_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    int64_t ckk = g->C / g->G * g->KH * g->KW, P = g->Ho * g->Wo, n, o, o0 = b, o1 = e;
    if (j->split_cols) { o0 = b * g->O / ckk; o1 = e * g->O / ckk; }
    for (n = 0; n < g->N; n++) {
        const float *gy = j->gprod + n * g->O * P;
        if (j->gw) dtr__conv_bwd_w_sample(j, worker, gy, j->img + n * g->C * g->H * g->W, b, e);
        if (j->gb)
            for (o = o0; o < o1; o++) j->gb[o] += dtr__conv_sum(gy + o * P, P);
    }
}

/* dW and db over the pool (the columns of j->img made per worker in j->tmp) */
static dtr_result dtr__conv_run_w(dtr_context *ctx, dtr__conv_job *j) {
    int64_t ckk = j->g.C / j->g.G * j->g.KH * j->g.KW;
    if (j->gw && !(j->tmp = dtr__conv_scratch(ctx, DTR__CONV_TMP))) return ctx->status;
    j->split_cols = j->g.O < ckk;
    dtr__pool_run(j->pool, j->split_cols ? ckk : j->g.O, 1, dtr__conv_bwd_w_range, j);
    return DTR_OK;
}

/* The output rows of one band of the input's gradient: its columns (C KH KW floats a pixel)
   take about DTR__CONV_BAND floats, at least one row. */
#define DTR__CONV_BAND ((int64_t)1 << 18)
static int64_t dtr__conv_band_rows(const dtr__conv_geom *g) {
    int64_t r = DTR__CONV_BAND / (g->C * g->KH * g->KW * g->Wo);
    return r < 1 ? 1 : r > g->Ho ? g->Ho : r;
}

/* gimg += col2im(W^T gprod) for sample n's channels [c0, c1) and output rows [r0, r1): their
   columns (rows of W^T, a group's at a time) into gcol, then added in */
static void dtr__conv_bwd_x_band(const dtr__conv_job *j, int worker, int64_t n, int64_t c0, int64_t c1, int64_t r0, int64_t r1,
                                 float *gcol) {
    const dtr__conv_geom *g = &j->g;
    int64_t kk = g->KH * g->KW, cg = g->C / g->G, og = g->O / g->G, P = g->Ho * g->Wo, pb = (r1 - r0) * g->Wo, c, q, e;
    for (c = c0; c < c1; c = e) {   /* gcol[c - c0] (rows, pb) = W[q]^T's rows of c .. e (rows, og) gy[q] (og, the band) */
        q = c / cg, e = (q + 1) * cg < c1 ? (q + 1) * cg : c1;
        dtr__gemm_on(j->pool, worker, (e - c) * kk, pb, og, 1.0f, j->w + q * og * cg * kk + (c - q * cg) * kk, 1, cg * kk,
                     j->gprod + (n * g->O + q * og) * P + r0 * g->Wo, P, 1, 0.0f, gcol + (c - c0) * kk * pb, pb);
    }
    dtr__col2im_add(g, gcol, c0, c1, r0, r1, j->gimg + n * g->C * g->H * g->W);
}

/* gimg += col2im(W^T gprod), split over samples (or slabs of a sample's channels: j->pieces);
 * each worker has its own buffer in j->gcol, for a band of output rows at a time. The bands go
 * from the last rows up: an input element takes its taps' shares in the tap order (kernel row
 * ki, then column kj) whole-image col2im adds them in, since a later kernel row reaches it from
 * an earlier output row. Slabs of channels write disjoint planes, their rows of W^T the same bits. */
static void dtr__conv_bwd_x_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    const dtr__conv_geom *g = &j->g;
    int64_t rows = dtr__conv_band_rows(g), x, c0, c1, r0, r1;
    float *gcol = j->gcol + (int64_t)worker * g->C * g->KH * g->KW * rows * g->Wo;
    for (x = b; x < e; x++) {
        dtr__conv_piece(g->C, j->pieces, x % j->pieces, 1, &c0, &c1);
        for (r1 = g->Ho; r1 > 0 && c1 > c0; r1 = r0) {
            r0 = r1 > rows ? r1 - rows : 0;
            dtr__conv_bwd_x_band(j, worker, x / j->pieces, c0, c1, r0, r1, gcol);
        }
    }
}

static dtr_result dtr__conv_run_x(dtr_context *ctx, dtr__conv_job *j) {
    if (!(j->gcol = dtr__conv_scratch(ctx, (size_t)(j->g.C * j->g.KH * j->g.KW * dtr__conv_band_rows(&j->g) * j->g.Wo))))
        return ctx->status;
    j->pieces = dtr__conv_pieces(j, j->g.C, 4);
    dtr__pool_run(ctx->pool, j->g.N * j->pieces, 1, dtr__conv_bwd_x_range, j);
    return DTR_OK;
}

/* depthwise backward: the weights split over channels, the input's gradient over planes */
static dtr_result dtr__dw_bwd(dtr_context *ctx, dtr__node *nd, dtr__conv_job *j) {
    j->gprod = nd->out->grad;
    j->img = dtr__f32(nd->in[0]);
    j->gw = dtr__gradof(nd->in[1]);
    j->gb = dtr__gradof(nd->in[2]);
    if (j->gw || j->gb) dtr__pool_run(ctx->pool, j->g.C, 1, DTR__DW_WEIGHTS, j);
    if ((j->gimg = dtr__gradof(nd->in[0]))) dtr__pool_run(ctx->pool, j->g.N * j->g.C, 1, DTR__DW_PLANES, j);
    return DTR_OK;
}

dtr_result dtr__cpu_conv2d_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__conv_job j;
    dtr__conv_job_of(ctx, nd, &j);
    if (dtr__conv_depthwise(&j.g)) return dtr__dw_bwd(ctx, nd, &j);
    j.gprod = nd->out->grad;
    j.img = dtr__f32(nd->in[0]);
    j.gw = dtr__gradof(nd->in[1]);
    j.gb = dtr__gradof(nd->in[2]);
    if ((j.gw || j.gb) && dtr__conv_run_w(ctx, &j) != DTR_OK) return ctx->status;
    j.gimg = dtr__gradof(nd->in[0]);
    return j.gimg ? dtr__conv_run_x(ctx, &j) : DTR_OK;
}

/* ---- transposed convolution: the image side is the output ---- */

/* the gradient of y (N, C, HW) summed per channel into gb, split over channels */
static void dtr__convt_bias_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__conv_job *j = (const dtr__conv_job *)arg;
    int64_t HW = j->g.H * j->g.W, n, c;
    (void)worker;
    for (n = 0; n < j->g.N; n++)
        for (c = b; c < e; c++) j->gb[c] += dtr__conv_sum(j->img + (n * j->g.C + c) * HW, HW);
}

/* y = bias, then y += col2im(W^T x) */
dtr_result dtr__cpu_conv_transpose_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__conv_job j;
    const float *bias = nd->in[2] ? dtr__f32(nd->in[2]) : NULL;
    int64_t HW, c, n;
    dtr__conv_job_of(ctx, nd, &j);
    j.gprod = dtr__f32(nd->in[0]);
    j.gimg = dtr__f32(nd->out);
    HW = j.g.H * j.g.W;
    for (n = 0; n < j.g.N; n++)
        for (c = 0; c < j.g.C; c++) dtr__conv_fill(j.gimg + (n * j.g.C + c) * HW, HW, bias ? bias[c] : 0.0f);
    return dtr__conv_run_x(ctx, &j);
}

/* dx += W col(dy) (conv2d's forward over dy), dW += x col(dy)^T, db = dy's channel sums */
dtr_result dtr__cpu_conv_transpose_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__conv_job j;
    dtr__conv_job_of(ctx, nd, &j);
    j.img = nd->out->grad;
    j.gw = dtr__gradof(nd->in[1]);
    j.gb = dtr__gradof(nd->in[2]);
    if (j.gb) dtr__pool_run(ctx->pool, j.g.C, 1, dtr__convt_bias_range, &j);
    j.gb = NULL;
    j.prod = dtr__gradof(nd->in[0]);
    j.accumulate = 1;
    if (j.prod) dtr__conv_run_fwd(ctx, &j);
    if (!j.gw) return DTR_OK;
    j.gprod = dtr__f32(nd->in[0]);
    return dtr__conv_run_w(ctx, &j);
}

/* ---- pooling ---- */

/* x (N, C, H, W) pooled by a kh x kw window (k[0], k[1]) with per-axis stride and padding */
static dtr_tensor *dtr__pooling(dtr_context *ctx, int op, const char *name, dtr_tensor *x, const int *k, const int *stride,
                             const int *padding) {
    dtr__node *n;
    int64_t shape[4];
    char s1[96];
    int a;
    for (a = 0; a < 2; a++) {
        if (k[a] < 1 || stride[a] < 1 || padding[a] < 0 || 2 * padding[a] > k[a])
            return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: window %d, stride %d, padding %d are invalid", name, k[a], stride[a],
                              padding[a]);
        if (x->shape[2 + a] + 2 * padding[a] < k[a])
            return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: window %d larger than the input %s", name, k[a],
                              dtr__shape_str(x, s1, sizeof s1));
    }
    x = dtr__contig_input(ctx, x);
    if (!x || !(n = dtr__node_new(ctx, op, 1, &x))) return NULL;
    shape[0] = x->shape[0]; shape[1] = x->shape[1];
    for (a = 0; a < 2; a++) {
        shape[2 + a] = (x->shape[2 + a] + 2 * padding[a] - k[a]) / stride[a] + 1;
        n->p.pool2d.k[a] = k[a], n->p.pool2d.stride[a] = stride[a], n->p.pool2d.padding[a] = padding[a];
    }
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), 4, shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

static dtr_tensor *dtr__pool2d(dtr_context *ctx, int op, const char *name, dtr_tensor *x, int k, int stride, int padding) {
    int ks[2], ss[2], ps[2];
    char s1[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (x->ndim != 4) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x %s must be (N, C, H, W)", name, dtr__shape_str(x, s1, sizeof s1));
    ks[0] = ks[1] = k, ss[0] = ss[1] = stride ? stride : k, ps[0] = ps[1] = padding;
    return dtr__pooling(ctx, op, name, x, ks, ss, ps);
}

dtr_tensor *dtr_maxpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding) {
    return dtr__pool2d(ctx, DTR_OP_MAXPOOL2D, "dtr_maxpool2d", x, k, stride, padding);
}
dtr_tensor *dtr_avgpool2d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding) {
    return dtr__pool2d(ctx, DTR_OP_AVGPOOL2D, "dtr_avgpool2d", x, k, stride, padding);
}

/* 1-D: (N, C, L) pooled as (N, C, 1, L) by a 1 x k window */
static dtr_tensor *dtr__pool1d(dtr_context *ctx, int op, const char *name, dtr_tensor *x, int k, int stride, int padding) {
    int ks[2] = {1, k}, ss[2] = {1, stride ? stride : k}, ps[2] = {0, padding};
    int64_t xs[4], ys[3];
    dtr_tensor *y;
    char s1[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (x->ndim != 3) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x %s must be (N, C, L)", name, dtr__shape_str(x, s1, sizeof s1));
    xs[0] = x->shape[0], xs[1] = x->shape[1], xs[2] = 1, xs[3] = x->shape[2];
    if (!(x = dtr_reshape(ctx, x, 4, xs)) || !(y = dtr__pooling(ctx, op, name, x, ks, ss, ps))) return NULL;
    ys[0] = y->shape[0], ys[1] = y->shape[1], ys[2] = y->shape[3];
    return dtr_reshape(ctx, y, 3, ys);
}

dtr_tensor *dtr_maxpool1d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding) {
    return dtr__pool1d(ctx, DTR_OP_MAXPOOL2D, "dtr_maxpool1d", x, k, stride, padding);
}
dtr_tensor *dtr_avgpool1d(dtr_context *ctx, dtr_tensor *x, int k, int stride, int padding) {
    return dtr__pool1d(ctx, DTR_OP_AVGPOOL2D, "dtr_avgpool1d", x, k, stride, padding);
}

/* Pooling kernels run over the N*C planes in parallel: a plane's output and its input
 * gradient depend on that plane only, so any split gives the same bits. */
typedef struct {
    const dtr__node *nd;
    int64_t H, W, Ho, Wo, KH, KW, SH, SW, PH, PW;
} dtr__pool2d_job;

/* Reference loops: any window, stride and padding; max keeps the first largest value. */
static void dtr__pool2d_fwd_ref(const dtr__pool2d_job *j, int64_t c0, int64_t c1) {
    int64_t H = j->H, W = j->W, Ho = j->Ho, Wo = j->Wo;
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
                for (a = 0; a < j->KH; a++) {
                    int64_t ii = oi * j->SH - j->PH + a;
                    if (ii < 0 || ii >= H) continue;
                    for (b = 0; b < j->KW; b++) {
                        int64_t jj = oj * j->SW - j->PW + b;
                        float v;
                        if (jj < 0 || jj >= W) continue;
                        v = xc[ii * W + jj];
                        s += v;
                        if (dtr__f_max_takes(v, best) || bi < 0) { best = v; bi = (int32_t)(ii * W + jj); } /* NaN wins */
                    }
                }
                if (maxp) { Y[(c * Ho + oi) * Wo + oj] = best; arg[(c * Ho + oi) * Wo + oj] = bi; }
                else Y[(c * Ho + oi) * Wo + oj] = s / (float)(j->KH * j->KW);
            }
    }
}

#define DTR__MAX_TAKES(v, best) dtr__f_max_takes(v, best)

/* One 2x2 window per lane: a b / c d. with_nan 0: plain compares (no lane holds a NaN);
 * 1: the NaN-aware rule of the reference. Two loops, each branch-free, so both vectorise. */
DTR__SIMD_BODY void dtr__maxpool2_lanes(const float *a, const float *b, const float *c, const float *d, float *best,
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
DTR__SIMD_BODY void dtr__maxpool2_block(const float *r0, const float *r1, float *y, int32_t *ag, int64_t oj, int n,
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

DTR__SIMD_BODY void dtr__maxpool2_fwd(const dtr__pool2d_job *j, int64_t c0, int64_t c1) {
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

DTR__SIMD_BODY void dtr__pool2d_fwd_body(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__pool2d_job *j = (const dtr__pool2d_job *)arg;
    (void)worker;
    if (j->nd->op == DTR_OP_MAXPOOL2D && j->KH == 2 && j->KW == 2 && j->SH == 2 && j->SW == 2 && j->PH == 0 && j->PW == 0)
        dtr__maxpool2_fwd(j, b, e);
    else dtr__pool2d_fwd_ref(j, b, e);
}

/* as it is and with the 2x2 max pool's lanes for AVX2 (src/core/platform.h: the same bits) */
static void dtr__pool2d_fwd_range(void *arg, int64_t b, int64_t e, int w) { dtr__pool2d_fwd_body(arg, b, e, w); }
DTR__TARGET_AVX2 static void dtr__pool2d_fwd_avx2(void *arg, int64_t b, int64_t e, int w) { dtr__pool2d_fwd_body(arg, b, e, w); }

static void dtr__pool2d_bwd_range(void *arg, int64_t c0, int64_t c1, int worker) {
    const dtr__pool2d_job *j = (const dtr__pool2d_job *)arg;
    int64_t H = j->H, W = j->W, Ho = j->Ho, Wo = j->Wo;
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
                float g = G[(c * Ho + oi) * Wo + oj] / (float)(j->KH * j->KW);
                for (a = 0; a < j->KH; a++) {
                    int64_t ii = oi * j->SH - j->PH + a;
                    if (ii < 0 || ii >= H) continue;
                    for (b = 0; b < j->KW; b++) {
                        int64_t jj = oj * j->SW - j->PW + b;
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
    j->KH = nd->p.pool2d.k[0]; j->KW = nd->p.pool2d.k[1];
    j->SH = nd->p.pool2d.stride[0]; j->SW = nd->p.pool2d.stride[1];
    j->PH = nd->p.pool2d.padding[0]; j->PW = nd->p.pool2d.padding[1];
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
    dtr__pool_run(ctx->pool, planes, grain, dtr__simd_avx2() ? dtr__pool2d_fwd_avx2 : dtr__pool2d_fwd_range, &j);
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

/* ---- nearest-neighbour upsampling: x (N, C, H, W) -> y (N, C, H sh, W sw) ---- */

dtr_tensor *dtr_upsample_nearest2d(dtr_context *ctx, dtr_tensor *x, int sh, int sw) {
    dtr__node *n;
    int64_t shape[4];
    char s1[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_upsample_nearest2d", x, "x")) return NULL;
    if (x->ndim != 4)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_upsample_nearest2d: x %s must be (N, C, H, W)", dtr__shape_str(x, s1, sizeof s1));
    if (sh < 1 || sw < 1) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_upsample_nearest2d: factors %d, %d must be >= 1", sh, sw);
    x = dtr__contig_input(ctx, x);
    if (!x || !(n = dtr__node_new(ctx, DTR_OP_UPSAMPLE, 1, &x))) return NULL;
    shape[0] = x->shape[0], shape[1] = x->shape[1], shape[2] = x->shape[2] * sh, shape[3] = x->shape[3] * sw;
    n->p.upsample.scale[0] = sh, n->p.upsample.scale[1] = sw;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), 4, shape, "dtr_upsample_nearest2d");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_upsample_nearest2d");
}

/* planes [b, e) of (N C): y's blocks from x's values (forward), or each input's block summed
   into its gradient (backward: the block's rows in order, then its columns) */
typedef struct { const dtr__node *nd; int bwd; } dtr__upsample_job;

static void dtr__upsample_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__upsample_job *j = (const dtr__upsample_job *)arg;
    const dtr__node *nd = j->nd;
    int64_t H = nd->in[0]->shape[2], W = nd->in[0]->shape[3], sh = nd->p.upsample.scale[0], sw = nd->p.upsample.scale[1];
    int64_t HW = H * W, P = HW * sh * sw, t, i, k, a, c;
    (void)worker;
    for (t = b; t < e; t++) {
        const float *x = dtr__f32(nd->in[0]) + t * HW, *gy = j->bwd ? nd->out->grad + t * P : NULL;
        float *y = dtr__f32(nd->out) + t * P, *gx = j->bwd ? dtr__gradof(nd->in[0]) + t * HW : NULL;
        for (i = 0; i < HW; i++)
            for (a = 0; a < sh; a++)
                for (c = 0; c < sw; c++) {
                    k = ((i / W) * sh + a) * (W * sw) + (i % W) * sw + c;
                    if (gx) gx[i] += gy[k];
                    else y[k] = x[i];
                }
    }
}

static dtr_result dtr__upsample_run(dtr_context *ctx, dtr__node *nd, int bwd) {
    dtr__upsample_job j;
    j.nd = nd, j.bwd = bwd;
    if (bwd && !dtr__gradof(nd->in[0])) return DTR_OK;
    dtr__pool_run(ctx->pool, nd->in[0]->shape[0] * nd->in[0]->shape[1], 1, dtr__upsample_range, &j);
    return DTR_OK;
}

dtr_result dtr__cpu_upsample_fwd(dtr_context *ctx, dtr__node *nd) { return dtr__upsample_run(ctx, nd, 0); }
dtr_result dtr__cpu_upsample_bwd(dtr_context *ctx, dtr__node *nd) { return dtr__upsample_run(ctx, nd, 1); }
