/* ============================================================================
 * Matrix products: batched matmul and linear (x w^T + b), through dtr__gemm.
 * Shapes: a (..., M, K), b (..., K, N) -> (..., M, N); x (R..., in), w (out, in) -> (R..., out).
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"

/* ---- matmul ---- */

/* Batch layout: output batch shape and the strides of a and b over it (0 where broadcast). */
typedef struct dtr__batch {
    int nd;
    int64_t shape[DTR_MAX_DIMS], sa[DTR_MAX_DIMS], sb[DTR_MAX_DIMS], count;
} dtr__batch;

static int dtr__batch_make(const dtr_tensor *a, const dtr_tensor *b, dtr__batch *bt) {
    int na = a->ndim - 2, nb = b->ndim - 2, nd = na > nb ? na : nb, d;
    bt->nd = nd;
    bt->count = 1;
    for (d = 0; d < nd; d++) {
        int da = d - (nd - na), db = d - (nd - nb);
        int64_t sa = da >= 0 ? a->shape[da] : 1, sb = db >= 0 ? b->shape[db] : 1;
        if (sa != sb && sa != 1 && sb != 1) return 0;
        bt->shape[d] = sa > sb ? sa : sb;
        bt->sa[d] = (da >= 0 && sa != 1) ? a->stride[da] : 0;
        bt->sb[d] = (db >= 0 && sb != 1) ? b->stride[db] : 0;
        bt->count *= bt->shape[d];
    }
    return 1;
}

static void dtr__batch_offsets(const dtr__batch *bt, int64_t i, int64_t *oa, int64_t *ob) {
    int d;
    *oa = *ob = 0;
    for (d = bt->nd - 1; d >= 0; d--) {
        int64_t k = i % bt->shape[d];
        i /= bt->shape[d];
        *oa += k * bt->sa[d];
        *ob += k * bt->sb[d];
    }
}

dtr_tensor *dtr_matmul(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b) {
    dtr__batch bt;
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS];
    char s1[96], s2[96];
    int d;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_matmul", a, "a") || !dtr__check_input(ctx, "dtr_matmul", b, "b")) return NULL;
    if (a->ndim < 2 || b->ndim < 2 || a->shape[a->ndim - 1] != b->shape[b->ndim - 2] || !dtr__batch_make(a, b, &bt))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_matmul: cannot multiply %s by %s (need (..., M, K) x (..., K, N))",
                          dtr__shape_str(a, s1, sizeof s1), dtr__shape_str(b, s2, sizeof s2));
    for (d = 0; d < bt.nd; d++) shape[d] = bt.shape[d];
    shape[bt.nd] = a->shape[a->ndim - 2];
    shape[bt.nd + 1] = b->shape[b->ndim - 1];
    {
        dtr_tensor *in[2] = {a, b};
        n = dtr__node_new(ctx, DTR_OP_MATMUL, 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), bt.nd + 2, shape, "dtr_matmul");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_matmul");
}

dtr_result dtr__cpu_matmul_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *a = nd->in[0], *b = nd->in[1];
    dtr__batch bt;
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1], i;
    const float *A = (const float *)a->storage + a->offset, *B = (const float *)b->storage + b->offset;
    float *Y = dtr__f32(nd->out);
    dtr__batch_make(a, b, &bt);
    for (i = 0; i < bt.count; i++) {
        int64_t oa, ob;
        dtr__batch_offsets(&bt, i, &oa, &ob);
        dtr__gemm(ctx->pool, M, N, K, 1.0f, A + oa, a->stride[a->ndim - 2], a->stride[a->ndim - 1],
                  B + ob, b->stride[b->ndim - 2], b->stride[b->ndim - 1], 0.0f, Y + i * M * N, N);
    }
    return DTR_OK;
}

dtr_result dtr__cpu_matmul_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *a = nd->in[0], *b = nd->in[1];
    dtr__batch bt;
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1], i;
    int64_t rsa = a->stride[a->ndim - 2], csa = a->stride[a->ndim - 1];
    int64_t rsb = b->stride[b->ndim - 2], csb = b->stride[b->ndim - 1];
    const float *A = (const float *)a->storage + a->offset, *B = (const float *)b->storage + b->offset;
    const float *G = nd->out->grad;
    float *GA = dtr__gradof(a), *GB = dtr__gradof(b);
    dtr__batch gb;
    dtr_tensor ca = *a, cb = *b;
    /* the gradients are dense: their batch offsets use dense strides */
    dtr__contig_strides(a->ndim, a->shape, ca.stride);
    dtr__contig_strides(b->ndim, b->shape, cb.stride);
    dtr__batch_make(a, b, &bt);
    dtr__batch_make(&ca, &cb, &gb);
    for (i = 0; i < bt.count; i++) {
        int64_t oa, ob, ga, gbo;
        const float *g = G + i * M * N;
        dtr__batch_offsets(&bt, i, &oa, &ob);
        dtr__batch_offsets(&gb, i, &ga, &gbo);
        /* dA (M, K) += G (M, N) B^T (N, K) */
        if (GA) dtr__gemm(ctx->pool, M, K, N, 1.0f, g, N, 1, B + ob, csb, rsb, 1.0f, GA + ga, K);
        /* dB (K, N) += A^T (K, M) G (M, N) */
        if (GB) dtr__gemm(ctx->pool, K, N, M, 1.0f, A + oa, csa, rsa, g, N, 1, 1.0f, GB + gbo, N);
    }
    return DTR_OK;
}

/* ---- linear ---- */

dtr_tensor *dtr_linear(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *bias) {
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS];
    char s1[96], s2[96];
    int d;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_linear", x, "x") || !dtr__check_input(ctx, "dtr_linear", w, "w")) return NULL;
    if (bias && !dtr__check_input(ctx, "dtr_linear", bias, "bias")) return NULL;
    if (x->ndim < 1 || w->ndim != 2 || x->shape[x->ndim - 1] != w->shape[1])
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_linear: x %s does not fit weight %s (need x (..., in), w (out, in))",
                          dtr__shape_str(x, s1, sizeof s1), dtr__shape_str(w, s2, sizeof s2));
    if (bias && (bias->ndim != 1 || bias->shape[0] != w->shape[0]))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_linear: bias %s does not match %lld outputs",
                          dtr__shape_str(bias, s1, sizeof s1), (long long)w->shape[0]);
    x = dtr__contig_input(ctx, x);
    w = dtr__contig_input(ctx, w);
    if (!x || !w) return NULL;
    for (d = 0; d < x->ndim - 1; d++) shape[d] = x->shape[d];
    shape[x->ndim - 1] = w->shape[0];
    {
        dtr_tensor *in[3] = {x, w, bias};
        n = dtr__node_new(ctx, DTR_OP_LINEAR, bias ? 3 : 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), x->ndim, shape, "dtr_linear");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_linear");
}

dtr_result dtr__cpu_linear_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1], *bias = nd->in[2];
    int64_t in = w->shape[1], out = w->shape[0], R = dtr_tensor_numel(x) / (in ? in : 1), r;
    float *Y = dtr__f32(nd->out);
    float beta = 0.0f;
    if (in == 0) R = dtr_tensor_numel(nd->out) / (out ? out : 1);
    if (bias) {
        const float *bv = dtr__f32(bias);
        for (r = 0; r < R; r++) memcpy(Y + r * out, bv, (size_t)out * sizeof(float));
        beta = 1.0f;
    }
    /* Y (R, out) = X (R, in) W^T (in, out) */
    dtr__gemm(ctx->pool, R, out, in, 1.0f, dtr__f32(x), in, 1, dtr__f32(w), 1, in, beta, Y, out);
    return DTR_OK;
}

dtr_result dtr__cpu_linear_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1], *bias = nd->in[2];
    int64_t in = w->shape[1], out = w->shape[0], R = dtr_tensor_numel(nd->out) / (out ? out : 1);
    const float *G = nd->out->grad;
    float *gx = dtr__gradof(x), *gw = dtr__gradof(w), *gb = dtr__gradof(bias);
    /* dX (R, in) += G (R, out) W (out, in) */
    if (gx) dtr__gemm(ctx->pool, R, in, out, 1.0f, G, out, 1, dtr__f32(w), in, 1, 1.0f, gx, in);
    /* dW (out, in) += G^T (out, R) X (R, in) */
    if (gw) dtr__gemm(ctx->pool, out, in, R, 1.0f, G, 1, out, dtr__f32(x), in, 1, 1.0f, gw, in);
    if (gb) dtr__rows_sum_into(ctx->pool, G, R, out, gb);
    return DTR_OK;
}

typedef struct dtr__sum_job { const float *x; float *out; int64_t rows, n; } dtr__sum_job;

/* columns [b, e) of a rows sum: each row added in order */
static void dtr__rows_sum_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__sum_job *j = (const dtr__sum_job *)arg;
    int64_t r;
    (void)worker;
    for (r = 0; r < j->rows; r++) {
        const float *x = j->x + r * j->n;
        DTR__ELEMENTWISE(b, e, j->out[i] += x[i]);
    }
}

void dtr__rows_sum_into(dtr__pool *p, const float *X, int64_t rows, int64_t n, float *out) {
    dtr__sum_job j;
    j.x = X, j.out = out, j.rows = rows, j.n = n;
    dtr__pool_run(rows * n >= 65536 ? p : NULL, n, 64, dtr__rows_sum_range, &j);
}

static void dtr__add_range(void *arg, int64_t b, int64_t e, int worker) {
    const dtr__sum_job *j = (const dtr__sum_job *)arg;
    (void)worker;
    DTR__ELEMENTWISE(b, e, j->out[i] += j->x[i]);
}

void dtr__add_into(dtr__pool *p, float *out, const float *x, int64_t n) {
    dtr__sum_job j;
    j.x = x, j.out = out, j.rows = 1, j.n = n;
    dtr__pool_run(p, n, 16384, dtr__add_range, &j);
}
