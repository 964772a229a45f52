/* ============================================================================
 * Neural-network ops: softmax family, cross-entropy, embedding, layer and batch norm, the LSTM
 * cell, the LSTM and GRU recurrences over a sequence (one op each: a worker walks its batch
 * rows through every step), gather, dropout and fused attention (causal or not, self or cross).
 * Shapes: R rows of length C (all leading axes flattened), B batch, T time, H heads, D head dim.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include "../core/formulas.h"
#include <math.h>

static int64_t dtr__rows(const dtr_tensor *x) {
    int64_t c = x->ndim ? x->shape[x->ndim - 1] : 1;
    return c ? dtr_tensor_numel(x) / c : 0;
}

/* ---- softmax, log-softmax, causal softmax ---- */

static dtr_tensor *dtr__softmax_like(dtr_context *ctx, int op, const char *name, dtr_tensor *x) {
    dtr__node *n;
    char s1[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (x->ndim < 1) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x must have at least one axis", name);
    if (op == DTR_OP_SOFTMAX_CAUSAL && (x->ndim < 2 || x->shape[x->ndim - 1] != x->shape[x->ndim - 2]))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x %s must be (..., T, T)", name, dtr__shape_str(x, s1, sizeof s1));
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), x->ndim, x->shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_softmax(dtr_context *ctx, dtr_tensor *x) { return dtr__softmax_like(ctx, DTR_OP_SOFTMAX, "dtr_softmax", x); }
dtr_tensor *dtr_log_softmax(dtr_context *ctx, dtr_tensor *x) { return dtr__softmax_like(ctx, DTR_OP_LOG_SOFTMAX, "dtr_log_softmax", x); }
dtr_tensor *dtr_softmax_causal(dtr_context *ctx, dtr_tensor *x) { return dtr__softmax_like(ctx, DTR_OP_SOFTMAX_CAUSAL, "dtr_softmax_causal", x); }

/* The sum of exp(x[k] - mx) over k < n, in double; the f32 terms also to out when it is not
 * NULL (out may be x). Terms eight at a time: a block the compiler vectorises, the own exp
 * (dtr__f_exp) having no branch, summed into eight running sums (term k into sum k % 8, so no
 * chain of dependent additions bounds the loop), added pairwise at the end, then the tail in
 * order: a fixed order for any n, whatever the thread count. Softmax, attention and
 * cross-entropy (whose term, dtr__f_xent_term, is the same exp) take their exponentials here. */
DTR__SIMD_BODY double dtr__exp_sum_body(const float *x, int64_t n, float mx, float *out) {
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0}, t;
    int64_t k = 0;
    int i;
    for (; k + 16 <= n; k += 16) {   /* two blocks of eight at once (one AVX-512 vector), summed as two */
        float e[16];
        for (i = 0; i < 16; i++) e[i] = dtr__f_exp(x[k + i] - mx);
        for (i = 0; i < 8; i++) s[i] += e[i];
        for (i = 0; i < 8; i++) s[i] += e[8 + i];
        if (out)
            for (i = 0; i < 16; i++) out[k + i] = e[i];
    }
    for (; k + 8 <= n; k += 8) {
        float e[8];
        for (i = 0; i < 8; i++) e[i] = dtr__f_exp(x[k + i] - mx);
        for (i = 0; i < 8; i++) s[i] += e[i];
        if (out)
            for (i = 0; i < 8; i++) out[k + i] = e[i];
    }
    t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; k < n; k++) {
        float e = dtr__f_exp(x[k] - mx);
        t += e;
        if (out) out[k] = e;
    }
    return t;
}
static double dtr__exp_sum_plain(const float *x, int64_t n, float mx, float *out) { return dtr__exp_sum_body(x, n, mx, out); }
DTR__TARGET_AVX2 static double dtr__exp_sum_avx2(const float *x, int64_t n, float mx, float *out) {
    return dtr__exp_sum_body(x, n, mx, out);
}
DTR__TARGET_AVX512 static double dtr__exp_sum_avx512(const float *x, int64_t n, float mx, float *out) {
    return dtr__exp_sum_body(x, n, mx, out);
}
static double dtr__exp_sum(const float *x, int64_t n, float mx, float *out) {
    return DTR__SIMD_PICK(dtr__exp_sum_plain, dtr__exp_sum_avx2, dtr__exp_sum_avx512)(x, n, mx, out);
}

/* Row softmax of x[0..n) into y; `valid` leading entries take part, the rest get 0.
 * With logp set, writes log-probabilities instead. */
static void dtr__softmax_row(const float *x, float *y, int64_t n, int64_t valid, int logp) {
    float mx = dtr__max_f32(x, valid, -INFINITY, 0);
    int64_t j;
    if (logp) {
        float lse = mx + (float)log(dtr__exp_sum(x, valid, mx, NULL));
        for (j = 0; j < valid; j++) y[j] = x[j] - lse;
        for (; j < n; j++) y[j] = -INFINITY;
    } else {
        float inv = (float)(1.0 / dtr__exp_sum(x, valid, mx, y));
        for (j = 0; j < valid; j++) y[j] *= inv;
        for (; j < n; j++) y[j] = 0.0f;
    }
}

typedef struct { const dtr__node *nd; int64_t C; } dtr__rows_job;

static void dtr__softmax_fwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__rows_job *j = (const dtr__rows_job *)arg;
    const float *x = dtr__f32(j->nd->in[0]);
    float *y = dtr__f32(j->nd->out);
    int64_t r, C = j->C;
    (void)w;
    for (r = b; r < e; r++) {
        int64_t valid = j->nd->op == DTR_OP_SOFTMAX_CAUSAL ? (r % C) + 1 : C;
        dtr__softmax_row(x + r * C, y + r * C, C, valid, j->nd->op == DTR_OP_LOG_SOFTMAX);
    }
}

static void dtr__softmax_bwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__rows_job *j = (const dtr__rows_job *)arg;
    const float *y = dtr__f32(j->nd->out), *g = j->nd->out->grad;
    float *gx = dtr__gradof(j->nd->in[0]);
    int64_t r, k, C = j->C;
    (void)w;
    for (r = b; r < e; r++) {
        const float *yr = y + r * C, *gr = g + r * C;
        float *gxr = gx + r * C;
        double s = 0.0;
        if (j->nd->op == DTR_OP_LOG_SOFTMAX) {
            for (k = 0; k < C; k++) s += gr[k];
            for (k = 0; k < C; k++) gxr[k] += gr[k] - expf(yr[k]) * (float)s;
        } else {
            for (k = 0; k < C; k++) s += (double)gr[k] * yr[k];
            for (k = 0; k < C; k++) gxr[k] += yr[k] * (gr[k] - (float)s);
        }
    }
}

dtr_result dtr__cpu_softmax_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__rows_job j;
    j.nd = nd;
    j.C = nd->in[0]->shape[nd->in[0]->ndim - 1];
    dtr__pool_run(ctx->pool, dtr__rows(nd->in[0]), 64, dtr__softmax_fwd_range, &j);
    return DTR_OK;
}

dtr_result dtr__cpu_softmax_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__rows_job j;
    if (!dtr__gradof(nd->in[0])) return DTR_OK;
    j.nd = nd;
    j.C = nd->in[0]->shape[nd->in[0]->ndim - 1];
    dtr__pool_run(ctx->pool, dtr__rows(nd->in[0]), 64, dtr__softmax_bwd_range, &j);
    return DTR_OK;
}

/* ---- cross-entropy on class indices ---- */

dtr__node *dtr__xent_node(dtr_context *ctx, int op, const char *name, dtr_tensor *logits, dtr_tensor *targets) {
    dtr__node *n;
    char s1[96], s2[96];
    if (!dtr__check_input(ctx, name, logits, "logits")) return NULL;
    if (!targets) return (dtr__node *)dtr__failt(ctx, DTR_NULL_HANDLE, "%s: targets is NULL", name);
    if (targets->dtype != DTR_I32)
        return (dtr__node *)dtr__failt(ctx, DTR_DTYPE_MISMATCH, "%s: targets must be i32 class indices, are %s", name,
                                       dtr_dtype_name(targets->dtype));
    if (logits->ndim < 1 || dtr__rows(logits) != dtr_tensor_numel(targets))
        return (dtr__node *)dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: logits %s and targets %s disagree on the row count", name,
                                       dtr__shape_str(logits, s1, sizeof s1), dtr__shape_str(targets, s2, sizeof s2));
    logits = dtr__contig_input(ctx, logits);
    targets = dtr__contig_input(ctx, targets);
    if (!logits || !targets) return NULL;
    {
        dtr_tensor *in[2] = {logits, targets};
        n = dtr__node_new(ctx, op, 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, 0, NULL, name);
    return n->out ? n : NULL;
}

dtr_xent_config dtr_xent_config_init(void) {
    dtr_xent_config c;
    c.ignore_index = -100;
    c.label_smoothing = 0.0f;
    c.reduction = DTR_LOSS_MEAN;
    return c;
}

dtr_tensor *dtr_cross_entropy_ex(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets, const dtr_xent_config *cfg) {
    dtr_xent_config c = cfg ? *cfg : dtr_xent_config_init();
    dtr__node *n;
    if (!ctx) return NULL;
    if (!(c.label_smoothing >= 0.0f && c.label_smoothing < 1.0f) || c.reduction < DTR_LOSS_MEAN || c.reduction > DTR_LOSS_NONE)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_cross_entropy: label smoothing %g must be in [0, 1) and the reduction "
                          "(%d) mean, sum or none", (double)c.label_smoothing, (int)c.reduction);
    n = dtr__xent_node(ctx, DTR_OP_CROSS_ENTROPY, "dtr_cross_entropy", logits, targets);
    if (!n) return NULL;
    n->p.xent.ignore_index = c.ignore_index;
    n->p.xent.smoothing = c.label_smoothing;
    n->p.xent.reduction = (int)c.reduction;
    if (c.reduction == DTR_LOSS_NONE &&   /* each row's loss, in the targets' shape */
        !(n->out = dtr__tensor_alloc(ctx, DTR_F32, n->in[1]->ndim, n->in[1]->shape, "dtr_cross_entropy")))
        return NULL;
    return dtr__record(ctx, n, "dtr_cross_entropy");
}

dtr_tensor *dtr_cross_entropy(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets) {
    return dtr_cross_entropy_ex(ctx, logits, targets, NULL);
}

/* Forward keeps each row's maximum and exp-sum (dtr__xent_row), not its probabilities: the
 * backward recomputes them from the logits, which stay anyway, so the op holds R x 24 bytes
 * (the statistics and the row's loss) instead of R x K floats (the size of the logits again,
 * 400 MB for a GPT's vocabulary), and one more double: what dL/dy is divided by in backward (the
 * rows counted for a mean, 1 for a sum). The logits are read in their own dtype (f32, bf16,
 * f16: never widened, src/core/widen.c): a GPT's 16-bit logits take no f32 copy of their size.
 * Rows run on the pool; the row losses are summed in row order (the same bits at any count
 * of threads). An ignored row's loss is 0 and it gets no gradient. */
typedef struct dtr__xent_job {
    const dtr__node *nd;
    const void *X;
    int dt;
    int64_t K;
    const int32_t *t;
    dtr__xent_params p;
    dtr__xent_row *st;
    double *loss;       /* forward: each row's */
    float div;          /* backward: dL/dy's divisor (mean, sum) */
} dtr__xent_job;

static dtr__xent_job dtr__xent_job_of(const dtr__node *nd) {
    dtr__xent_job j;
    const dtr_tensor *x = nd->in[0];
    memset(&j, 0, sizeof j);
    j.nd = nd, j.X = dtr__data(x), j.dt = x->dtype, j.K = x->shape[x->ndim - 1], j.t = dtr__i32(nd->in[1]);
    j.p = nd->p.xent;
    return j;
}

/* rows at least 16K logits a task */
static int64_t dtr__xent_grain(int64_t K) { return K >= 16384 ? 1 : 16384 / (K ? K : 1); }

/* g[k] += c p[k] - d over a row of K f32 logits, p its probabilities again (g never overlaps x) */
DTR__SIMD_BODY void dtr__xent_grad_body(float *g, const float *x, int64_t K, dtr__xent_row st, float c, float d) {
    DTR__ELEMENTWISE(0, K, g[i] += c * dtr__f_xent_prob(x[i], st) - d);
}
static void dtr__xent_grad_plain(float *g, const float *x, int64_t K, dtr__xent_row st, float c, float d) {
    dtr__xent_grad_body(g, x, K, st, c, d);
}
DTR__TARGET_AVX2 static void dtr__xent_grad_avx2(float *g, const float *x, int64_t K, dtr__xent_row st, float c, float d) {
    dtr__xent_grad_body(g, x, K, st, c, d);
}
DTR__TARGET_AVX512 static void dtr__xent_grad_avx512(float *g, const float *x, int64_t K, dtr__xent_row st, float c, float d) {
    dtr__xent_grad_body(g, x, K, st, c, d);
}
static void dtr__xent_grad_row(float *g, const float *x, int64_t K, dtr__xent_row st, float c, float d) {
    DTR__SIMD_PICK(dtr__xent_grad_plain, dtr__xent_grad_avx2, dtr__xent_grad_avx512)(g, x, K, st, c, d);
}

/* the mean of row r's logits (label smoothing's term) */
static double dtr__xent_mean(const dtr__xent_job *j, int64_t r) {
    double s = 0.0;
    int64_t k;
    for (k = 0; k < j->K; k++) s += dtr__f_load(j->X, j->dt, r * j->K + k);
    return s / (double)j->K;
}

/* each row's maximum, exp-sum and loss; f32 logits read as an array, 16-bit ones by dtype */
static void dtr__xent_fwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__xent_job *j = (const dtr__xent_job *)arg;
    const float *x32 = j->dt == DTR_F32 ? (const float *)j->X : NULL;
    int64_t r, k, K = j->K;
    (void)w;
    for (r = b; r < e; r++) {
        float mx = -INFINITY;
        double s = 0.0;
        j->st[r].max = 0.0f, j->st[r].inv = 1.0, j->loss[r] = 0.0;
        if (j->t[r] == j->p.ignore_index) continue;
        if (x32) {
            const float *x = x32 + r * K;
            mx = dtr__max_f32(x, K, -INFINITY, 0);
            s = dtr__exp_sum(x, K, mx, NULL);
        } else {
            for (k = 0; k < K; k++) mx = fmaxf(mx, dtr__f_load(j->X, j->dt, r * K + k));
            for (k = 0; k < K; k++) s += dtr__f_xent_term(dtr__f_load(j->X, j->dt, r * K + k), mx);
        }
        j->st[r].max = mx;
        j->st[r].inv = 1.0 / s;
        j->loss[r] = dtr__f_xent_loss(mx, s, dtr__f_load(j->X, j->dt, r * K + j->t[r]),
                                      j->p.smoothing > 0.0f ? dtr__xent_mean(j, r) : 0.0, j->p.smoothing);
    }
}

/* the rows that count: DTR_OK, or the first target outside [0, K) that is not ignored */
static dtr_result dtr__xent_targets(dtr_context *ctx, const dtr__xent_job *j, int64_t R, int64_t *kept) {
    int64_t r;
    for (r = 0, *kept = 0; r < R; r++) {
        if (j->t[r] == j->p.ignore_index) continue;
        if (j->t[r] < 0 || j->t[r] >= j->K)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_cross_entropy: target %lld is %d, outside [0, %lld)",
                             (long long)r, (int)j->t[r], (long long)j->K);
        ++*kept;
    }
    return DTR_OK;
}

dtr_result dtr__cpu_cross_entropy_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__xent_job j = dtr__xent_job_of(nd);
    int64_t R = dtr__rows(nd->in[0]), r, kept;
    size_t rows = (size_t)(R ? R : 1);
    double loss = 0.0, *div;
    float *y = dtr__f32(nd->out);
    if (dtr__xent_targets(ctx, &j, R, &kept) != DTR_OK) return ctx->status;
    j.st = (dtr__xent_row *)dtr__node_save(ctx, nd, rows * (sizeof(dtr__xent_row) + sizeof(double)) + sizeof(double));
    if (!j.st) return ctx->status;
    nd->saved = j.st;   /* the row statistics for backward, then the row losses, then the divisor */
    j.loss = (double *)(j.st + rows);
    div = j.loss + rows;
    dtr__pool_run(ctx->pool, R, dtr__xent_grain(j.K), dtr__xent_fwd_range, &j);
    if (j.p.reduction == DTR_LOSS_NONE) {
        for (r = 0, *div = 1.0; r < R; r++) y[r] = (float)j.loss[r];
        return DTR_OK;
    }
    for (r = 0; r < R; r++) loss += j.loss[r];
    *div = j.p.reduction == DTR_LOSS_SUM ? 1.0 : (double)kept;
    y[0] = kept ? (float)(loss / *div) : 0.0f;
    return DTR_OK;
}

static void dtr__xent_bwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__xent_job *j = (const dtr__xent_job *)arg;
    float *gx = dtr__gradof(j->nd->in[0]);
    const float *gy = j->nd->out->grad;
    int64_t r, k, K = j->K;
    (void)w;
    for (r = b; r < e; r++) {
        const dtr__xent_row st = j->st[r];
        float *g = gx + r * K, c, d;
        if (j->t[r] == j->p.ignore_index) continue;
        c = j->p.reduction == DTR_LOSS_NONE ? gy[r] : gy[0] / j->div;
        d = c * j->p.smoothing / (float)K;   /* smoothing's share of each class */
        if (j->dt == DTR_F32)
            dtr__xent_grad_row(g, (const float *)j->X + r * K, K, st, c, d);
        else
            for (k = 0; k < K; k++) g[k] += c * dtr__f_xent_prob(dtr__f_load(j->X, j->dt, r * K + k), st) - d;
        g[j->t[r]] -= c * (1.0f - j->p.smoothing);
    }
}

dtr_result dtr__cpu_cross_entropy_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__xent_job j = dtr__xent_job_of(nd);
    int64_t R = dtr__rows(nd->in[0]);
    size_t rows = (size_t)(R ? R : 1);
    if (!dtr__gradof(nd->in[0]) || !R) return DTR_OK;
    j.st = (dtr__xent_row *)nd->saved;
    j.div = (float)((const double *)(j.st + rows))[rows];
    dtr__pool_run(ctx->pool, R, dtr__xent_grain(j.K), dtr__xent_bwd_range, &j);
    return DTR_OK;
}

/* ---- gather: x (outer, L, inner), index (outer, M, inner) -> y (outer, M, inner) ---- */

/* x and index agree on every axis but `axis` (shape strings in the error) */
static int dtr__gather_shapes(dtr_context *ctx, const dtr_tensor *x, int axis, const dtr_tensor *index) {
    char s1[96], s2[96];
    int d, ok = x->ndim == index->ndim;
    for (d = 0; ok && d < x->ndim; d++) ok = d == axis || x->shape[d] == index->shape[d];
    if (!ok)
        dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_gather: index %s must have x's shape %s but along axis %d",
                  dtr__shape_str(index, s1, sizeof s1), dtr__shape_str(x, s2, sizeof s2), axis);
    return ok;
}

dtr_tensor *dtr_gather(dtr_context *ctx, dtr_tensor *x, int axis, dtr_tensor *index) {
    dtr__node *n;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_gather", x, "x")) return NULL;
    if (!index) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_gather: index is NULL");
    if (index->dtype != DTR_I32) return dtr__failt(ctx, DTR_DTYPE_MISMATCH, "dtr_gather: index must be i32");
    if (axis < 0) axis += x->ndim;
    if (axis < 0 || axis >= x->ndim) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_gather: axis %d of %d dims", axis, x->ndim);
    if (!dtr__gather_shapes(ctx, x, axis, index)) return NULL;
    x = dtr__contig_input(ctx, x);
    index = dtr__contig_input(ctx, index);
    if (!x || !index) return NULL;
    {
        dtr_tensor *in[2] = {x, index};
        n = dtr__node_new(ctx, DTR_OP_GATHER, 2, in);
    }
    if (!n) return NULL;
    n->p.axis = axis;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), index->ndim, index->shape, "dtr_gather");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_gather");
}

dtr_result dtr__cpu_gather_fwd(dtr_context *ctx, dtr__node *nd) {
    const float *x = dtr__f32(nd->in[0]);
    const int32_t *id = dtr__i32(nd->in[1]);
    float *y = dtr__f32(nd->out);
    int64_t outer, L, M, inner, t, n = dtr_tensor_numel(nd->out);
    dtr__axis_split(nd->in[0], nd->p.axis, &outer, &L, &inner);
    M = nd->in[1]->shape[nd->p.axis];
    for (t = 0; t < n; t++)
        if (id[t] < 0 || id[t] >= L)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_gather: index %lld is %d, outside [0, %lld)", (long long)t, (int)id[t],
                             (long long)L);
    for (t = 0; t < n; t++) y[t] = x[((t / inner / M) * L + id[t]) * inner + t % inner];
    return DTR_OK;
}

/* gx[picked] += g, in the index's order (repeats add up in it) */
dtr_result dtr__cpu_gather_bwd(dtr_context *ctx, dtr__node *nd) {
    float *gx = dtr__gradof(nd->in[0]);
    const int32_t *id = dtr__i32(nd->in[1]);
    int64_t outer, L, M, inner, t, n = dtr_tensor_numel(nd->out);
    (void)ctx;
    if (!gx) return DTR_OK;
    dtr__axis_split(nd->in[0], nd->p.axis, &outer, &L, &inner);
    M = nd->in[1]->shape[nd->p.axis];
    for (t = 0; t < n; t++) gx[((t / inner / M) * L + id[t]) * inner + t % inner] += nd->out->grad[t];
    return DTR_OK;
}

/* ---- embedding ---- */

dtr_tensor *dtr_embedding(dtr_context *ctx, dtr_tensor *table, dtr_tensor *ids) {
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS];
    char s1[96];
    int d;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_embedding", table, "table")) return NULL;
    if (!ids) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_embedding: ids is NULL");
    if (ids->dtype != DTR_I32) return dtr__failt(ctx, DTR_DTYPE_MISMATCH, "dtr_embedding: ids must be i32");
    if (table->ndim != 2 || ids->ndim + 1 > DTR_MAX_DIMS)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_embedding: table %s must be (V, C)", dtr__shape_str(table, s1, sizeof s1));
    table = dtr__contig_input(ctx, table);
    ids = dtr__contig_input(ctx, ids);
    if (!table || !ids) return NULL;
    for (d = 0; d < ids->ndim; d++) shape[d] = ids->shape[d];
    shape[ids->ndim] = table->shape[1];
    {
        dtr_tensor *in[2] = {table, ids};
        n = dtr__node_new(ctx, DTR_OP_EMBEDDING, 2, in);
    }
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), ids->ndim + 1, shape, "dtr_embedding");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_embedding");
}

dtr_result dtr__cpu_embedding_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t C = nd->in[0]->shape[1], N = dtr_tensor_numel(nd->in[1]), i;
    const float *W = dtr__f32(nd->in[0]);
    const int32_t *id = dtr__i32(nd->in[1]);
    float *Y = dtr__f32(nd->out);
    int64_t V = nd->in[0]->shape[0];
    for (i = 0; i < N; i++)
        if (id[i] < 0 || id[i] >= V)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_embedding: id %lld is %d, outside [0, %lld)",
                             (long long)i, (int)id[i], (long long)V);
    for (i = 0; i < N; i++) memcpy(Y + i * C, W + (int64_t)id[i] * C, (size_t)C * sizeof(float));
    return DTR_OK;
}

dtr_result dtr__cpu_embedding_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t C = nd->in[0]->shape[1], N = dtr_tensor_numel(nd->in[1]), i, k;
    const int32_t *id = dtr__i32(nd->in[1]);
    const float *G = nd->out->grad;
    float *gw = dtr__gradof(nd->in[0]);
    (void)ctx;
    if (!gw) return DTR_OK;
    for (i = 0; i < N; i++) {
        float *row = gw + (int64_t)id[i] * C;
        for (k = 0; k < C; k++) row[k] += G[i * C + k];
    }
    return DTR_OK;
}

/* ---- layer norm and RMS norm ---- */

/* the node of op (LAYERNORM, RMSNORM: no bias) named name over the last axis of x */
static dtr_tensor *dtr__norm(dtr_context *ctx, int op, const char *name, dtr_tensor *x, dtr_tensor *w, dtr_tensor *b, float eps) {
    dtr__node *n;
    int64_t C;
    char s1[96], s2[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (w && !dtr__check_input(ctx, name, w, "weight")) return NULL;
    if (b && !dtr__check_input(ctx, name, b, "bias")) return NULL;
    if (x->ndim < 1) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x must have at least one axis", name);
    C = x->shape[x->ndim - 1];
    if ((w && (w->ndim != 1 || w->shape[0] != C)) || (b && (b->ndim != 1 || b->shape[0] != C)))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: weight/bias %s must be (%lld) for x %s", name,
                          dtr__shape_str(w ? w : b, s1, sizeof s1), (long long)C, dtr__shape_str(x, s2, sizeof s2));
    if (!(eps > 0.0f)) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: eps must be > 0", name);
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    {
        dtr_tensor *in[3] = {x, w, b};
        n = dtr__node_new(ctx, op, 3, in);
    }
    if (!n) return NULL;
    n->p.eps = eps;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), x->ndim, x->shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_layernorm(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *b, float eps) {
    return dtr__norm(ctx, DTR_OP_LAYERNORM, "dtr_layernorm", x, w, b, eps);
}
dtr_tensor *dtr_rmsnorm(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, float eps) {
    return dtr__norm(ctx, DTR_OP_RMSNORM, "dtr_rmsnorm", x, w, NULL, eps);
}

/* Layer norm (and RMS norm: its mean 0, not subtracted, nor its mean of gradients) on the
 * CPU: rows on the pool (each row's arithmetic as one thread does it), the weight and bias
 * gradients as column sums on the pool by columns, each column over the rows in order: the
 * same bits at any thread count. */
typedef struct dtr__ln_job {
    const dtr__node *nd;
    int64_t C;
    const float *X, *W, *B, *G;
    float *stat;   /* mean, rstd per row */
} dtr__ln_job;

static dtr__ln_job dtr__ln_job_of(const dtr__node *nd) {
    dtr__ln_job j;
    const dtr_tensor *x = nd->in[0];
    j.nd = nd, j.C = x->shape[x->ndim - 1], j.X = dtr__f32(x);
    j.W = nd->in[1] ? dtr__f32(nd->in[1]) : NULL, j.B = nd->in[2] ? dtr__f32(nd->in[2]) : NULL;
    j.G = nd->out->grad, j.stat = (float *)nd->saved;
    return j;
}

static void dtr__ln_fwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__ln_job *j = (const dtr__ln_job *)arg;
    int64_t r, k, C = j->C;
    int rms = j->nd->op == DTR_OP_RMSNORM;   /* RMS norm: the mean 0, not subtracted */
    (void)w;
    for (r = b; r < e; r++) {
        const float *xr = j->X + r * C;
        float *yr = dtr__f32(j->nd->out) + r * C;
        double m = 0.0, v = 0.0;
        float mean, rstd;
        for (k = 0; k < C && !rms; k++) m += xr[k];
        m /= (double)C;
        for (k = 0; k < C; k++) { double d = xr[k] - m; v += d * d; }
        v /= (double)C;
        mean = (float)m;
        rstd = (float)(1.0 / sqrt(v + j->nd->p.eps));
        for (k = 0; k < C; k++) {
            float h = (xr[k] - mean) * rstd;
            yr[k] = (j->W ? j->W[k] : 1.0f) * h + (j->B ? j->B[k] : 0.0f);
        }
        j->stat[2 * r] = mean;
        j->stat[2 * r + 1] = rstd;
    }
}

dtr_result dtr__cpu_layernorm_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t R = dtr__rows(nd->in[0]);
    dtr__ln_job j;
    float *stat = (float *)dtr__node_save(ctx, nd, (size_t)R * 2 * sizeof(float));
    if (!stat) return ctx->status;
    nd->saved = stat;
    j = dtr__ln_job_of(nd);
    dtr__pool_run(ctx->pool, R, 16, dtr__ln_fwd_range, &j);
    return DTR_OK;
}

/* gx of rows [b, e) */
static void dtr__ln_dx_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__ln_job *j = (const dtr__ln_job *)arg;
    int64_t r, k, C = j->C;
    float *gx = dtr__gradof(j->nd->in[0]);
    (void)w;
    for (r = b; r < e; r++) {
        const float *xr = j->X + r * C, *gr = j->G + r * C;
        float mean = j->stat[2 * r], rstd = j->stat[2 * r + 1], md, mdh, *gxr = gx + r * C;
        double sd = 0.0, sdh = 0.0;
        for (k = 0; k < C; k++) {
            float h = (xr[k] - mean) * rstd, dh = gr[k] * (j->W ? j->W[k] : 1.0f);
            sd += dh;
            sdh += (double)dh * h;
        }
        md = j->nd->op == DTR_OP_RMSNORM ? 0.0f : (float)(sd / (double)C), mdh = (float)(sdh / (double)C);
        for (k = 0; k < C; k++) {
            float h = (xr[k] - mean) * rstd, dh = gr[k] * (j->W ? j->W[k] : 1.0f);
            gxr[k] += rstd * (dh - md - h * mdh);
        }
    }
}

/* the weight and bias gradients of columns [b, e), each over every row in order */
static void dtr__ln_dwb_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__ln_job *j = (const dtr__ln_job *)arg;
    int64_t r, k, C = j->C, R = dtr__rows(j->nd->in[0]);
    float *gw = dtr__gradof(j->nd->in[1]), *gb = dtr__gradof(j->nd->in[2]);
    (void)w;
    for (r = 0; r < R; r++) {
        const float *xr = j->X + r * C, *gr = j->G + r * C;
        float mean = j->stat[2 * r], rstd = j->stat[2 * r + 1];
        if (gw)
            for (k = b; k < e; k++) gw[k] += gr[k] * ((xr[k] - mean) * rstd);
        if (gb)
            for (k = b; k < e; k++) gb[k] += gr[k];
    }
}

dtr_result dtr__cpu_layernorm_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__ln_job j = dtr__ln_job_of(nd);
    if (dtr__gradof(nd->in[0])) dtr__pool_run(ctx->pool, dtr__rows(nd->in[0]), 16, dtr__ln_dx_range, &j);
    if (dtr__gradof(nd->in[1]) || dtr__gradof(nd->in[2])) dtr__pool_run(ctx->pool, j.C, 64, dtr__ln_dwb_range, &j);
    return DTR_OK;
}

/* ---- batch norm ----
 * x (N, C, S...) viewed as (N, C, S): channel c's N S values are x[(n C + c) S + s]. Training
 * normalises each channel by its batch mean and (biased) variance, and moves the running
 * statistics (unbiased variance, as PyTorch); evaluation uses the running ones (ops). */

/* 1 when v is NULL or a (C) vector; `stat`: f32, dense and without a gradient (the op writes it) */
static int dtr__bn_vec(dtr_context *ctx, const dtr_tensor *v, const char *what, int64_t C, int stat) {
    char s1[96];
    if (!v) return 1;
    if (!dtr__check_input(ctx, "dtr_batch_norm", v, what)) return 0;
    if (v->ndim != 1 || v->shape[0] != C)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_batch_norm: %s is %s, not (%lld)", what, dtr__shape_str(v, s1, sizeof s1),
                         (long long)C), 0;
    if (stat && (v->dtype != DTR_F32 || !dtr_tensor_is_contiguous(v) || (v->flags & DTR__REQUIRES_GRAD)))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_batch_norm: %s must be a dense f32 tensor without a gradient "
                         "(a model buffer)", what), 0;
    return 1;
}

/* evaluation: (x - running_mean) / sqrt(running_var + eps) * w + b, per channel */
static dtr_tensor *dtr__bn_eval(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *b, dtr_tensor *rm, dtr_tensor *rv,
                                float eps) {
    int64_t shape[DTR_MAX_DIMS];
    dtr_tensor *inv, *y;
    int d;
    shape[0] = x->shape[1];   /* (C, 1, ..., 1): a value a channel */
    for (d = 2; d < x->ndim; d++) shape[d - 1] = 1;
    inv = dtr_pow(ctx, dtr_add(ctx, rv, dtr_tensor_full(ctx, 0, NULL, eps)), -0.5f);
    if (w) inv = dtr_mul(ctx, inv, w);
    y = dtr_mul(ctx, dtr_sub(ctx, x, dtr_reshape(ctx, rm, x->ndim - 1, shape)), dtr_reshape(ctx, inv, x->ndim - 1, shape));
    return b ? dtr_add(ctx, y, dtr_reshape(ctx, b, x->ndim - 1, shape)) : y;
}

dtr_tensor *dtr_batch_norm(dtr_context *ctx, dtr_tensor *x, dtr_tensor *w, dtr_tensor *b, dtr_tensor *running_mean,
                           dtr_tensor *running_var, int training, float momentum, float eps) {
    dtr__node *n;
    int64_t C;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_batch_norm", x, "x")) return NULL;
    if (x->ndim < 2) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_batch_norm: x needs (N, C, ...), not %d axes", x->ndim);
    C = x->shape[1];
    if (!dtr__bn_vec(ctx, w, "weight", C, 0) || !dtr__bn_vec(ctx, b, "bias", C, 0) ||
        !dtr__bn_vec(ctx, running_mean, "running_mean", C, 1) || !dtr__bn_vec(ctx, running_var, "running_var", C, 1))
        return NULL;
    if (!running_mean != !running_var || (!training && !running_mean))
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_batch_norm: %s", !training ? "evaluation needs the running statistics"
                                                                                      : "running_mean and running_var go together");
    if (!(eps > 0.0f) || !(momentum >= 0.0f && momentum <= 1.0f))
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_batch_norm: eps %g must be > 0 and momentum %g in [0, 1]", (double)eps,
                          (double)momentum);
    if (!training) return dtr__bn_eval(ctx, x, w, b, running_mean, running_var, eps);
    if (C && dtr_tensor_numel(x) / C < 2)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_batch_norm: training needs more than one value a channel (x has %lld)",
                          (long long)(dtr_tensor_numel(x) / C));
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    {
        int upd = !ctx->recomputing;   /* a recomputed region's statistics were taken once already */
        dtr_tensor *in[5] = {x, w, b, upd ? running_mean : NULL, upd ? running_var : NULL};
        n = dtr__node_new(ctx, DTR_OP_BATCHNORM, 5, in);
    }
    if (!n) return NULL;
    n->p.batchnorm.eps = eps;
    n->p.batchnorm.momentum = momentum;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), x->ndim, x->shape, "dtr_batch_norm");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_batch_norm");
}

typedef struct dtr__bn_job {
    const dtr__node *nd;
    int64_t N, C, S;
    const float *X, *W, *B, *G;
    float *stat;   /* mean, rstd per channel */
} dtr__bn_job;

static dtr__bn_job dtr__bn_job_of(const dtr__node *nd) {
    dtr__bn_job j;
    dtr__bn_dims(nd->in[0], &j.N, &j.C, &j.S);
    j.nd = nd, j.X = dtr__f32(nd->in[0]);
    j.W = nd->in[1] ? dtr__f32(nd->in[1]) : NULL, j.B = nd->in[2] ? dtr__f32(nd->in[2]) : NULL;
    j.G = nd->out->grad, j.stat = (float *)nd->saved;
    return j;
}

/* Batch norm's sums over a row of n floats: f32 in 8 lanes over each block of 64 elements (the
   loop vectorises), each block's lanes added in a fixed tree into a double total; the rest one
   by one in double. sq 0: the sum of x - m; 1: of (x - m)^2. */
static double dtr__bn_row_sum(const float *x, int64_t n, float m, int sq) {
    double total = 0.0;
    int64_t k = 0;
    int b, l;
    for (; k + 64 <= n; k += 64) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (sq)
            for (b = 0; b < 64; b += 8) DTR__IVDEP for (l = 0; l < 8; l++) acc[l] += (x[k + b + l] - m) * (x[k + b + l] - m);
        else
            for (b = 0; b < 64; b += 8) DTR__IVDEP for (l = 0; l < 8; l++) acc[l] += x[k + b + l] - m;
        total += ((double)(acc[0] + acc[1]) + (acc[2] + acc[3])) + ((double)(acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
    for (; k < n; k++) {
        double d = (double)x[k] - m;
        total += sq ? d * d : d;
    }
    return total;
}

/* backward's sums over a row, as dtr__bn_row_sum's: of g (returned) and, into *gh, of g h,
   h = (x - m) r */
static double dtr__bn_row_grad_sums(const float *x, const float *g, int64_t n, float m, float r, double *gh) {
    double sg = 0.0, sgh = 0.0;
    int64_t k = 0;
    int b, l;
    for (; k + 64 <= n; k += 64) {
        float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (b = 0; b < 64; b += 8) {
            DTR__IVDEP for (l = 0; l < 8; l++) {
                a[l] += g[k + b + l];
                t[l] += g[k + b + l] * ((x[k + b + l] - m) * r);
            }
        }
        sg += ((double)(a[0] + a[1]) + (a[2] + a[3])) + ((double)(a[4] + a[5]) + (a[6] + a[7]));
        sgh += ((double)(t[0] + t[1]) + (t[2] + t[3])) + ((double)(t[4] + t[5]) + (t[6] + t[7]));
    }
    for (; k < n; k++) sg += g[k], sgh += (double)g[k] * ((x[k] - m) * r);
    *gh += sgh;
    return sg;
}

/* channels [b, e): statistics in double (the mean, then the variance about it), the output,
   the running statistics */
static void dtr__bn_fwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__bn_job *j = (const dtr__bn_job *)arg;
    const dtr__node *nd = j->nd;
    int64_t c, n, S = j->S, cnt = j->N * j->S;
    float *Y = dtr__f32(nd->out);
    (void)w;
    for (c = b; c < e; c++) {
        double m = 0.0, v = 0.0;
        float mean, rstd, wc = j->W ? j->W[c] : 1.0f, bc = j->B ? j->B[c] : 0.0f;
        for (n = 0; n < j->N; n++) m += dtr__bn_row_sum(j->X + (n * j->C + c) * S, S, 0.0f, 0);
        m /= (double)cnt;
        for (n = 0; n < j->N; n++) v += dtr__bn_row_sum(j->X + (n * j->C + c) * S, S, (float)m, 1);
        v /= (double)cnt;
        mean = (float)m, rstd = (float)(1.0 / sqrt(v + nd->p.batchnorm.eps));
        for (n = 0; n < j->N; n++) {
            const float *xr = j->X + (n * j->C + c) * S;
            float *yr = Y + (n * j->C + c) * S;
            DTR__ELEMENTWISE(0, S, yr[i] = wc * ((xr[i] - mean) * rstd) + bc);
        }
        j->stat[2 * c] = mean, j->stat[2 * c + 1] = rstd;
        if (nd->in[3]) dtr__f_bn_running(dtr__f32(nd->in[3]) + c, dtr__f32(nd->in[4]) + c, m, v, cnt, nd->p.batchnorm.momentum);
    }
}

dtr_result dtr__cpu_batchnorm_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t N, C, S;
    dtr__bn_job j;
    float *stat;
    dtr__bn_dims(nd->in[0], &N, &C, &S);
    stat = (float *)dtr__node_save(ctx, nd, (size_t)(C ? C : 1) * 2 * sizeof(float));
    if (!stat) return ctx->status;
    nd->saved = stat;
    j = dtr__bn_job_of(nd);
    dtr__pool_run(ctx->pool, C, 1, dtr__bn_fwd_range, &j);
    return DTR_OK;
}

/* channels [b, e): dx = rstd (dh - mean(dh) - h mean(dh h)), dh = g w, h the normalised x;
   dw += sum(g h), db += sum(g), the sums in double */
static void dtr__bn_bwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__bn_job *j = (const dtr__bn_job *)arg;
    int64_t c, n, S = j->S, cnt = j->N * j->S;
    float *gx = dtr__gradof(j->nd->in[0]), *gw = dtr__gradof(j->nd->in[1]), *gb = dtr__gradof(j->nd->in[2]);
    (void)w;
    for (c = b; c < e; c++) {
        float mean = j->stat[2 * c], rstd = j->stat[2 * c + 1], wc = j->W ? j->W[c] : 1.0f, md, mdh;
        double sg = 0.0, sgh = 0.0;
        for (n = 0; n < j->N; n++) {
            int64_t o = (n * j->C + c) * S;
            sg += dtr__bn_row_grad_sums(j->X + o, j->G + o, S, mean, rstd, &sgh);
        }
        if (gw) gw[c] += (float)sgh;
        if (gb) gb[c] += (float)sg;
        if (!gx) continue;
        md = (float)(sg * wc / (double)cnt), mdh = (float)(sgh * wc / (double)cnt);
        for (n = 0; n < j->N; n++) {
            const float *xr = j->X + (n * j->C + c) * S, *gr = j->G + (n * j->C + c) * S;
            float *gxr = gx + (n * j->C + c) * S;
            DTR__ELEMENTWISE(0, S, gxr[i] += rstd * (gr[i] * wc - md - ((xr[i] - mean) * rstd) * mdh));
        }
    }
}

dtr_result dtr__cpu_batchnorm_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__bn_job j = dtr__bn_job_of(nd);
    if (dtr__gradof(nd->in[0]) || dtr__gradof(nd->in[1]) || dtr__gradof(nd->in[2]))
        dtr__pool_run(ctx->pool, j.C, 1, dtr__bn_bwd_range, &j);
    return DTR_OK;
}

/* ---- LSTM cell: gates (..., 4H) and c (..., H) -> [h | c'] (..., 2H) ---- */

dtr_tensor *dtr_lstm_cell(dtr_context *ctx, dtr_tensor *gates, dtr_tensor *c, dtr_tensor **c_out) {
    int64_t shape[DTR_MAX_DIMS], H;
    char s1[96], s2[96];
    dtr__node *n;
    dtr_tensor *out;
    int d;
    if (!ctx) return NULL;
    if (c_out) *c_out = NULL;
    if (!c_out) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_lstm_cell: c_out is NULL");
    if (!dtr__check_input(ctx, "dtr_lstm_cell", gates, "gates") || (c && !dtr__check_input(ctx, "dtr_lstm_cell", c, "c")))
        return NULL;
    H = gates->ndim ? gates->shape[gates->ndim - 1] / 4 : 0;
    for (d = 0; c && d < gates->ndim; d++)
        if (c->ndim != gates->ndim || c->shape[d] != (d == gates->ndim - 1 ? H : gates->shape[d])) break;
    if (!gates->ndim || H == 0 || gates->shape[gates->ndim - 1] != 4 * H || (c && d < gates->ndim))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_lstm_cell: gates %s must be (..., 4H) and c %s (..., H)",
                          dtr__shape_str(gates, s1, sizeof s1), c ? dtr__shape_str(c, s2, sizeof s2) : "NULL");
    gates = dtr__contig_input(ctx, gates);
    if (c && !(c = dtr__contig_input(ctx, c))) return NULL;   /* (c NULL: zeros) */
    if (!gates) return NULL;
    {
        dtr_tensor *in[2] = {gates, c};
        n = dtr__node_new(ctx, DTR_OP_LSTM_CELL, 2, in);
    }
    if (!n) return NULL;
    for (d = 0; d < gates->ndim; d++) shape[d] = gates->shape[d];
    shape[gates->ndim - 1] = 2 * H;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), gates->ndim, shape, "dtr_lstm_cell");
    if (!n->out || !(out = dtr__record(ctx, n, "dtr_lstm_cell"))) return NULL;
    *c_out = dtr_slice(ctx, out, -1, H, 2 * H);
    return *c_out ? dtr_slice(ctx, out, -1, 0, H) : NULL;
}

/* One cell pass over rows [b, e) (src/core/formulas.h's formulas at every unit, as element-wise
   blocks: the loops vectorise, compiled again for AVX2 below). Forward: gates a (rows, 4H) (with
   gx: a = gx + (a + bias) where a holds h W^T (hh 1), else gx + bias; bias may be NULL), the
   cell before c (row stride ldc) or NULL (zeros),
   y = [h | c'] (row stride 2H); with ts, the gates' activations replace a and tanh(c') goes to
   ts (rows, H), for a backward without transcendentals. Backward from g = [gh | gc] (row stride
   2H), a being pre-activations (ts NULL) or activations with ts: the gates' gradients added
   into ga (rows, 4H) (written, with ts), the previous cell's into gc (row stride ldgc). */
typedef struct dtr__lstm_job {
    float *a, *y, *ga, *gc, *ts, *carry;
    const float *gx, *bias, *c, *g, *yprev;
    const int32_t *len;       /* the recurrence's row lengths (rows past theirs carry), or NULL */
    int64_t H, ldc, ldgc, t;
    int hh;
} dtr__lstm_job;

/* 1 when row r of a recurrence's step t is past its sequence's end: its state is carried (y =
   the step before's y), and backward passes its whole gradient g on to the step before */
static int dtr__rnn_padded(const int32_t *len, int64_t t, int64_t r) { return len && t >= len[r]; }

/* a padded row's backward: its gates' gradients (ga, and gb if any, m floats each) are zero
   and its gradient g (n floats) goes on whole into the step before's, carry (if any) */
static void dtr__rnn_pad_grad(float *ga, float *gb, int64_t m, const float *g, float *carry, int64_t n) {
    int64_t i;
    if (ga) memset(ga, 0, (size_t)m * sizeof(float));
    if (gb) memset(gb, 0, (size_t)m * sizeof(float));
    for (i = 0; carry && i < n; i++) carry[i] += g[i];
}

/* the gates' pre-activations of a row: gx + (h W^T + bias), each part optional but gx */
DTR__SIMD_BODY void dtr__lstm_gates_in(float *a, const float *gx, const float *bias, int hh, int64_t n) {
    if (hh && bias) DTR__ELEMENTWISE(0, n, a[i] = gx[i] + (a[i] + bias[i]));
    else if (hh) DTR__ELEMENTWISE(0, n, a[i] = gx[i] + a[i]);
    else if (bias) DTR__ELEMENTWISE(0, n, a[i] = gx[i] + bias[i]);
    else memcpy(a, gx, (size_t)n * sizeof(float));
}

DTR__SIMD_BODY void dtr__lstm_fwd_body(void *arg, int64_t b, int64_t e, int w) {
    const dtr__lstm_job *j = (const dtr__lstm_job *)arg;
    int64_t r, H = j->H;
    (void)w;
    for (r = b; r < e; r++) {
        float *ai = j->a + r * 4 * H, *af = ai + H, *ag = af + H, *ao = ag + H, *h = j->y + r * 2 * H, *c2 = h + H, *t = j->ts;
        const float *cr = j->c ? j->c + r * j->ldc : NULL, *gr = j->gx ? j->gx + r * 4 * H : NULL;
        if (dtr__rnn_padded(j->len, j->t, r)) {
            memcpy(h, j->yprev + r * 2 * H, (size_t)(2 * H) * sizeof(float));   /* the state carried */
            continue;
        }
        if (gr) dtr__lstm_gates_in(ai, gr, j->bias, j->hh, 4 * H);
        if (t) {
            t += r * H;
            DTR__ELEMENTWISE(0, H, dtr__f_lstm_gates(ai[i], af[i], ag[i], ao[i], &ai[i], &af[i], &ag[i], &ao[i]));
            if (cr) DTR__ELEMENTWISE(0, H, dtr__f_lstm_cell_act(ai[i], af[i], ag[i], ao[i], cr[i], &h[i], &c2[i], &t[i]));
            else DTR__ELEMENTWISE(0, H, dtr__f_lstm_cell_act(ai[i], af[i], ag[i], ao[i], 0.0f, &h[i], &c2[i], &t[i]));
        } else if (cr) {
            DTR__ELEMENTWISE(0, H, dtr__f_lstm_cell(ai[i], af[i], ag[i], ao[i], cr[i], &h[i], &c2[i]));
        } else {
            DTR__ELEMENTWISE(0, H, dtr__f_lstm_cell(ai[i], af[i], ag[i], ao[i], 0.0f, &h[i], &c2[i]));
        }
    }
}

DTR__SIMD_BODY void dtr__lstm_bwd_body(void *arg, int64_t b, int64_t e, int w) {
    const dtr__lstm_job *j = (const dtr__lstm_job *)arg;
    int64_t r, H = j->H;
    (void)w;
    for (r = b; r < e; r++) {
        const float *ai = j->a + r * 4 * H, *af = ai + H, *ag = af + H, *ao = ag + H, *gh = j->g + r * 2 * H, *gcr = gh + H;
        const float *c = j->c ? j->c + r * j->ldc : NULL, *t = j->ts ? j->ts + r * H : NULL;
        float di[64], df[64], dg[64], dout[64], dcp[64], *q = j->ga ? j->ga + r * 4 * H : NULL, *gc = j->gc ? j->gc + r * j->ldgc : NULL;
        int64_t k0, k, n;
        if (dtr__rnn_padded(j->len, j->t, r)) {
            dtr__rnn_pad_grad(q, NULL, 4 * H, gh, j->carry + r * 2 * H, 2 * H);
            continue;
        }
        if (t && q && gc) {   /* a recurrence's step: the gates' gradients written in place */
            DTR__ELEMENTWISE(0, H, {
                float dcp_;
                dtr__f_lstm_cell_grad_act(ai[i], af[i], ag[i], ao[i], c ? c[i] : 0.0f, t[i], gh[i], gcr[i], &q[i], &q[H + i], &q[2 * H + i],
                                          &q[3 * H + i], &dcp_);
                gc[i] += dcp_;
            });
            continue;
        }
        for (k0 = 0; k0 < H; k0 += 64) {   /* 64 units at a time through local arrays */
            n = H - k0 < 64 ? H - k0 : 64;
            if (t)
                DTR__ELEMENTWISE(0, n, dtr__f_lstm_cell_grad_act(ai[k0 + i], af[k0 + i], ag[k0 + i], ao[k0 + i], c ? c[k0 + i] : 0.0f,
                                                             t[k0 + i], gh[k0 + i], gcr[k0 + i], &di[i], &df[i], &dg[i], &dout[i], &dcp[i]));
            else
                DTR__ELEMENTWISE(0, n, dtr__f_lstm_cell_grad(ai[k0 + i], af[k0 + i], ag[k0 + i], ao[k0 + i], c ? c[k0 + i] : 0.0f, gh[k0 + i],
                                                             gcr[k0 + i], &di[i], &df[i], &dg[i], &dout[i], &dcp[i]));
            for (k = 0; q && t && k < n; k++) q[k0 + k] = di[k], q[H + k0 + k] = df[k], q[2 * H + k0 + k] = dg[k], q[3 * H + k0 + k] = dout[k];
            for (k = 0; q && !t && k < n; k++) q[k0 + k] += di[k], q[H + k0 + k] += df[k], q[2 * H + k0 + k] += dg[k], q[3 * H + k0 + k] += dout[k];
            for (k = 0; gc && k < n; k++) gc[k0 + k] += dcp[k];
        }
    }
}

static void dtr__lstm_fwd_range(void *arg, int64_t b, int64_t e, int w) { dtr__lstm_fwd_body(arg, b, e, w); }
static void dtr__lstm_bwd_range(void *arg, int64_t b, int64_t e, int w) { dtr__lstm_bwd_body(arg, b, e, w); }
DTR__TARGET_AVX2 static void dtr__lstm_fwd_avx2(void *arg, int64_t b, int64_t e, int w) { dtr__lstm_fwd_body(arg, b, e, w); }
DTR__TARGET_AVX2 static void dtr__lstm_bwd_avx2(void *arg, int64_t b, int64_t e, int w) { dtr__lstm_bwd_body(arg, b, e, w); }
DTR__TARGET_AVX512 static void dtr__lstm_fwd_avx512(void *arg, int64_t b, int64_t e, int w) { dtr__lstm_fwd_body(arg, b, e, w); }
DTR__TARGET_AVX512 static void dtr__lstm_bwd_avx512(void *arg, int64_t b, int64_t e, int w) { dtr__lstm_bwd_body(arg, b, e, w); }

/* the cell pass, forward (bwd 0) or backward, in the CPU's instruction set */
static dtr__task_fn dtr__lstm_cell_fn(int bwd) {
    if (bwd) return DTR__SIMD_PICK(dtr__lstm_bwd_range, dtr__lstm_bwd_avx2, dtr__lstm_bwd_avx512);
    return DTR__SIMD_PICK(dtr__lstm_fwd_range, dtr__lstm_fwd_avx2, dtr__lstm_fwd_avx512);
}

/* the cell op's job: gates in[0], c in[1] (both dense), y = [h | c'] */
static dtr__lstm_job dtr__lstm_job_of(const dtr__node *nd, int64_t *rows) {
    dtr__lstm_job j;
    memset(&j, 0, sizeof j);
    j.H = nd->out->shape[nd->out->ndim - 1] / 2;
    *rows = j.H ? dtr_tensor_numel(nd->out) / (2 * j.H) : 0;
    j.a = dtr__f32(nd->in[0]), j.c = nd->in[1] ? dtr__f32(nd->in[1]) : NULL, j.ldc = j.ldgc = j.H;
    j.y = dtr__f32(nd->out), j.g = nd->out->grad;
    j.ga = dtr__gradof(nd->in[0]), j.gc = dtr__gradof(nd->in[1]);
    return j;
}

dtr_result dtr__cpu_lstm_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t rows;
    dtr__lstm_job j = dtr__lstm_job_of(nd, &rows);
    dtr__pool_run(ctx->pool, rows, 8, dtr__lstm_cell_fn(0), &j);
    return DTR_OK;
}

dtr_result dtr__cpu_lstm_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t rows;
    dtr__lstm_job j = dtr__lstm_job_of(nd, &rows);
    if (j.ga || j.gc) dtr__pool_run(ctx->pool, rows, 8, dtr__lstm_cell_fn(1), &j);
    return DTR_OK;
}

/* ---- recurrences over a sequence: an LSTM's (dtr_lstm_sequence) and a GRU's (dtr_gru_sequence).
 * gx (T, B, G H) (G = 4 or 3), w_hh (G H, H), b_hh (G H), h0 (and the LSTM's c0) (B, H), the
 * last ones optional -> y (T, B, Y): [h_t | c_t] (Y = 2H) or h_t (Y = H). When taped, the
 * forward keeps every step's gates: the LSTM's activations (T, B, 4H) and tanh(c_t) (T, B, H),
 * the GRU's r, z, n and h W_hn^T + b_hn (T, B, 4H); else one step's scratch. ---- */

/* 1 when gx is (T, B, G H) for w_hh (G H, H) with T, B, H > 0, b_hh (G H) and h0, c0 (B, H) or
   NULL; else 0 with the context's error (naming fn) */
static int dtr__rnn_seq_shapes_ok(dtr_context *ctx, const char *fn, int G, const dtr_tensor *gx, const dtr_tensor *w, const dtr_tensor *b,
                                  const dtr_tensor *h0, const dtr_tensor *c0) {
    char s1[96], s2[96];
    int64_t H = w->ndim == 2 ? w->shape[1] : 0;
    const dtr_tensor *st = h0 && !(h0->ndim == 2 && h0->shape[0] == gx->shape[1] && h0->shape[1] == H) ? h0 : c0;
    if (H == 0 || w->shape[0] != G * H)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "%s: w_hh is %s, not (%dH, H) with H > 0", fn, dtr__shape_str(w, s1, sizeof s1), G), 0;
    if (gx->ndim != 3 || gx->shape[0] == 0 || gx->shape[1] == 0 || gx->shape[2] != G * H)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "%s: gx is %s, not (T, B, %lld) with T, B > 0", fn, dtr__shape_str(gx, s1, sizeof s1),
                         (long long)(G * H)), 0;
    if (b && !(b->ndim == 1 && b->shape[0] == G * H))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "%s: b_hh is %s, not (%lld)", fn, dtr__shape_str(b, s1, sizeof s1), (long long)(G * H)), 0;
    if (st && !(st->ndim == 2 && st->shape[0] == gx->shape[1] && st->shape[1] == H))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "%s: %s is %s, not (%lld, %lld)", fn, st == h0 ? "h0" : "c0", dtr__shape_str(st, s2, sizeof s2),
                         (long long)gx->shape[1], (long long)H), 0;
    return 1;
}

dtr_tensor *dtr__rnn_sequence(dtr_context *ctx, const char *fn, int op, dtr_tensor *gx, dtr_tensor *w_hh, dtr_tensor *b_hh, dtr_tensor *h0,
                              dtr_tensor *c0, const int32_t *lengths) {
    static const char *const names[5] = {"gx", "w_hh", "b_hh", "h0", "c0"};
    int i, G = op == DTR_OP_LSTM ? 4 : 3;
    int64_t shape[3];
    dtr_tensor *in[6];
    dtr__node *n;
    in[0] = gx, in[1] = w_hh, in[2] = b_hh, in[3] = h0, in[4] = c0, in[5] = NULL;
    for (i = 0; i < 5; i++)
        if ((i < 2 || in[i]) && !dtr__check_input(ctx, fn, in[i], names[i])) return NULL;
    if (!dtr__rnn_seq_shapes_ok(ctx, fn, G, gx, w_hh, b_hh, h0, c0)) return NULL;
    for (i = 0; i < 5; i++)
        if (in[i] && !(in[i] = dtr__contig_input(ctx, in[i]))) return NULL;
    if (lengths && !(in[5] = dtr_tensor_from(ctx, DTR_I32, 1, &gx->shape[1], lengths))) return NULL;
    if (!(n = dtr__node_new(ctx, op, 6, in))) return NULL;
    shape[0] = gx->shape[0], shape[1] = gx->shape[1], shape[2] = (G == 4 ? 2 : 1) * w_hh->shape[1];
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), 3, shape, fn);
    return n->out ? dtr__record(ctx, n, fn) : NULL;
}

dtr_tensor *dtr_lstm_sequence(dtr_context *ctx, dtr_tensor *gx, dtr_tensor *w_hh, dtr_tensor *b_hh, dtr_tensor *h0, dtr_tensor *c0,
                              dtr_tensor **c_out) {
    dtr_tensor *out;
    int64_t H;
    if (!ctx) return NULL;
    if (c_out) *c_out = NULL;
    if (!c_out) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_lstm_sequence: c_out is NULL");
    if (!(out = dtr__rnn_sequence(ctx, "dtr_lstm_sequence", DTR_OP_LSTM, gx, w_hh, b_hh, h0, c0, NULL))) return NULL;
    H = w_hh->shape[1];
    *c_out = dtr_slice(ctx, out, -1, H, 2 * H);
    return *c_out ? dtr_slice(ctx, out, -1, 0, H) : NULL;
}

dtr_tensor *dtr_gru_sequence(dtr_context *ctx, dtr_tensor *gx, dtr_tensor *w_hh, dtr_tensor *b_hh, dtr_tensor *h0) {
    if (!ctx) return NULL;
    return dtr__rnn_sequence(ctx, "dtr_gru_sequence", DTR_OP_GRU, gx, w_hh, b_hh, h0, NULL, NULL);
}

/* One GRU cell pass over rows [b, e). Forward: a (rows, 4H): in, h W_hh^T in its first 3H
   columns (hh 1; else nothing), out r, z, n and hn = h W_hn^T + b_hn; gx (rows, 3H), bias (3H)
   or NULL, the state before h (row stride ldh) or NULL (zeros), y (rows, H). Backward from g
   (rows, H): the pre-activations' gradients written to dgx (rows, 3H; r, z, n) and dgh (rows,
   3H; r, z, hn's), h's through the update added into gh (row stride ldh) if any. */
typedef struct dtr__gru_job {
    float *a, *y, *dgx, *dgh, *gh;
    const float *gx, *bias, *h, *g;
    const int32_t *len;       /* as the LSTM's job: padded rows carry (the step before's y is h) */
    int64_t H, ldh, t;
    int hh;
} dtr__gru_job;

DTR__SIMD_BODY void dtr__gru_fwd_body(void *arg, int64_t b, int64_t e, int w) {
    const dtr__gru_job *j = (const dtr__gru_job *)arg;
    int64_t r, H = j->H;
    (void)w;
    for (r = b; r < e; r++) {
        float *ar = j->a + r * 4 * H, *az = ar + H, *an = az + H, *hn = an + H, *y = j->y + r * H;
        const float *xr = j->gx + r * 3 * H, *xz = xr + H, *xn = xz + H, *hp = j->h ? j->h + r * j->ldh : NULL, *bs = j->bias;
        if (dtr__rnn_padded(j->len, j->t, r)) {
            memcpy(y, hp, (size_t)H * sizeof(float));   /* the state carried */
            continue;
        }
        if (j->hh && bs) DTR__ELEMENTWISE(0, 3 * H, ar[i] = ar[i] + bs[i]);   /* h W^T + b, as dtr_linear */
        else if (!j->hh && bs) memcpy(ar, bs, (size_t)(3 * H) * sizeof(float));
        else if (!j->hh) memset(ar, 0, (size_t)(3 * H) * sizeof(float));
        memcpy(hn, an, (size_t)H * sizeof(float));
        if (hp) DTR__ELEMENTWISE(0, H, dtr__f_gru_cell(xr[i], xz[i], xn[i], ar[i], az[i], hn[i], hp[i], &ar[i], &az[i], &an[i], &y[i]));
        else DTR__ELEMENTWISE(0, H, dtr__f_gru_cell(xr[i], xz[i], xn[i], ar[i], az[i], hn[i], 0.0f, &ar[i], &az[i], &an[i], &y[i]));
    }
}

DTR__SIMD_BODY void dtr__gru_bwd_body(void *arg, int64_t b, int64_t e, int w) {
    const dtr__gru_job *j = (const dtr__gru_job *)arg;
    int64_t r, H = j->H;
    (void)w;
    for (r = b; r < e; r++) {
        const float *ar = j->a + r * 4 * H, *az = ar + H, *an = az + H, *hn = an + H, *g = j->g + r * H;
        const float *hp = j->h ? j->h + r * j->ldh : NULL;
        float *xr = j->dgx + r * 3 * H, *xz = xr + H, *xn = xz + H, *hr = j->dgh + r * 3 * H, *hz = hr + H, *dhn = hz + H;
        float dh[64], *gh = j->gh ? j->gh + r * j->ldh : NULL;
        int64_t k0, k, n;
        if (dtr__rnn_padded(j->len, j->t, r)) {
            dtr__rnn_pad_grad(xr, hr, 3 * H, g, gh, H);
            continue;
        }
        for (k0 = 0; k0 < H; k0 += 64) {   /* 64 units at a time: h's share through a local array */
            n = H - k0 < 64 ? H - k0 : 64;
            DTR__ELEMENTWISE(k0, k0 + n, dtr__f_gru_cell_grad(ar[i], az[i], an[i], hn[i], hp ? hp[i] : 0.0f, g[i], &xr[i], &xz[i], &xn[i],
                                                              &dhn[i], &dh[i - k0]));
            for (k = 0; gh && k < n; k++) gh[k0 + k] += dh[k];
        }
        memcpy(hr, xr, (size_t)(2 * H) * sizeof(float));   /* r's and z's pre-activations: one gradient for both parts */
    }
}

static void dtr__gru_fwd_range(void *arg, int64_t b, int64_t e, int w) { dtr__gru_fwd_body(arg, b, e, w); }
static void dtr__gru_bwd_range(void *arg, int64_t b, int64_t e, int w) { dtr__gru_bwd_body(arg, b, e, w); }
DTR__TARGET_AVX2 static void dtr__gru_fwd_avx2(void *arg, int64_t b, int64_t e, int w) { dtr__gru_fwd_body(arg, b, e, w); }
DTR__TARGET_AVX2 static void dtr__gru_bwd_avx2(void *arg, int64_t b, int64_t e, int w) { dtr__gru_bwd_body(arg, b, e, w); }
DTR__TARGET_AVX512 static void dtr__gru_fwd_avx512(void *arg, int64_t b, int64_t e, int w) { dtr__gru_fwd_body(arg, b, e, w); }
DTR__TARGET_AVX512 static void dtr__gru_bwd_avx512(void *arg, int64_t b, int64_t e, int w) { dtr__gru_bwd_body(arg, b, e, w); }

/* the recurrence op's tensors as pointers; G gates of H, output rows of Y */
typedef struct dtr__rnn_seq {
    int64_t T, B, H, G, Y;
    const float *gx, *w, *b, *h0, *c0;
    const int32_t *len;   /* row lengths (in[5]), or NULL */
    float *y;
    int gru;
} dtr__rnn_seq;

static const char *dtr__rnn_name(const dtr__rnn_seq *s) { return s->gru ? "dtr_gru_sequence" : "dtr_lstm_sequence"; }

static dtr__rnn_seq dtr__rnn_seq_of(const dtr__node *nd) {
    dtr__rnn_seq s;
    s.gru = nd->op == DTR_OP_GRU;
    s.T = nd->out->shape[0], s.B = nd->out->shape[1], s.H = nd->in[1]->shape[1], s.G = (s.gru ? 3 : 4) * s.H, s.Y = nd->out->shape[2];
    s.gx = dtr__f32(nd->in[0]), s.w = dtr__f32(nd->in[1]);
    s.b = nd->in[2] ? dtr__f32(nd->in[2]) : NULL;
    s.h0 = nd->in[3] ? dtr__f32(nd->in[3]) : NULL;
    s.c0 = nd->in[4] ? dtr__f32(nd->in[4]) : NULL;
    s.len = nd->in[5] ? dtr__i32(nd->in[5]) : NULL;
    s.y = dtr__f32(nd->out);
    return s;
}

/* One pass of a recurrence op over rows [b, e) of the batch (the rows are independent
   sequences): its tensors, W_hh packed (transposed for the forward), the saved gates (every
   step's when `all`, else one step's: rows of S floats), the LSTM's tanh(c') (NULL untaped), and
   backward's buffers. With threads, each worker walks every step of its own rows (its products
   on its own packing memory: no synchronisation a step); a batch too small to split walks the
   steps with each product and cell pass over the whole pool (worker -1). */
typedef struct dtr__rnn_walk {
    dtr__rnn_seq s;
    dtr_context *ctx;
    dtr__gemm_bpack w;
    int64_t S;                 /* saved floats a row a step: 4H (the LSTM's tanh(c') apart) */
    float *A, *ts;
    float *dA, *dX, *P[2];     /* backward: the gates' gradients against W_hh (T, B, G H) and, for
                                  the GRU, gx's; y's gradient plus the carried one, a step (ping-pong) */
    float *gh0, *gc0;
    const float *gy;
    int all, bwd;
} dtr__rnn_walk;

/* the cell pass over rows [b, e) on worker w, or over the pool (w < 0: b = 0, e = B) */
static void dtr__rnn_cells(const dtr__rnn_walk *k, void *job, int64_t b, int64_t e, int w) {
    dtr__task_fn fn = !k->s.gru ? dtr__lstm_cell_fn(k->bwd)
                      : k->bwd  ? DTR__SIMD_PICK(dtr__gru_bwd_range, dtr__gru_bwd_avx2, dtr__gru_bwd_avx512)
                                : DTR__SIMD_PICK(dtr__gru_fwd_range, dtr__gru_fwd_avx2, dtr__gru_fwd_avx512);
    if (w < 0) dtr__pool_run(k->ctx->pool, e, 8, fn, job);
    else fn(job, b, e, w);
}

/* step t over rows [b, e): a = h_{t-1} W_hh^T (h_{t-1}: y's step t - 1, or h0, or none), then
   the cells with gx and b_hh */
static void dtr__rnn_fwd_step(const dtr__rnn_walk *k, int64_t t, int64_t b, int64_t e, int w) {
    const dtr__rnn_seq *s = &k->s;
    int64_t H = s->H, B = s->B, ldh = t ? s->Y : H;
    const float *h = t ? s->y + (t - 1) * B * s->Y : s->h0;
    float *a = k->A + (k->all ? t : 0) * B * k->S, *y = s->y + t * B * s->Y;
    dtr__lstm_job lj;
    dtr__gru_job gj;
    if (h) dtr__gemm_packed(k->ctx->pool, w, e - b, 1.0f, h + b * ldh, ldh, 1, &k->w, 0.0f, a + b * k->S, k->S);
    memset(&lj, 0, sizeof lj), memset(&gj, 0, sizeof gj);
    gj.a = lj.a = a, gj.y = lj.y = y, gj.gx = lj.gx = s->gx + t * B * s->G, gj.bias = lj.bias = s->b, gj.hh = lj.hh = h != NULL;
    gj.H = lj.H = H, gj.h = h, gj.ldh = ldh, gj.len = lj.len = s->len, gj.t = lj.t = t;
    lj.ts = k->ts ? k->ts + t * B * H : NULL, lj.c = t ? y - B * s->Y + H : s->c0, lj.ldc = ldh, lj.yprev = y - B * s->Y;
    dtr__rnn_cells(k, s->gru ? (void *)&gj : (void *)&lj, b, e, w);
}

/* Backward step t over rows [b, e): g (y's gradient plus what step t + 1 sent back) gives the
   gates' gradients; step t - 1's g (or h0's and c0's gradients) gets dA_t W_hh and the
   cell's direct share (the LSTM's dc, the GRU's z dh'). */
static void dtr__rnn_bwd_step(const dtr__rnn_walk *k, int64_t t, int64_t b, int64_t e, int w) {
    const dtr__rnn_seq *s = &k->s;
    int64_t H = s->H, G = s->G, B = s->B, Y = s->Y, ld = t ? Y : H;
    float *cur = k->P[t & 1], *prev = t ? k->P[(t - 1) & 1] : NULL, *to = t ? prev : k->gh0;
    size_t rows = (size_t)((e - b) * Y) * sizeof(float);
    dtr__lstm_job lj;
    dtr__gru_job gj;
    if (t == s->T - 1) memcpy(cur + b * Y, k->gy + (t * B + b) * Y, rows);
    if (prev) memcpy(prev + b * Y, k->gy + ((t - 1) * B + b) * Y, rows);
    memset(&lj, 0, sizeof lj), memset(&gj, 0, sizeof gj);
    gj.a = lj.a = k->A + t * B * k->S, gj.g = lj.g = cur, gj.H = lj.H = H, gj.len = lj.len = s->len, gj.t = lj.t = t, lj.carry = prev;
    gj.h = t ? s->y + (t - 1) * B * Y : s->h0, gj.ldh = ld, gj.dgx = k->dX + t * B * G, gj.dgh = k->dA + t * B * G, gj.gh = to;
    lj.ts = k->ts + t * B * H, lj.ga = k->dA + t * B * G;
    lj.c = t ? s->y + (t - 1) * B * Y + H : s->c0, lj.ldc = ld, lj.gc = t ? prev + H : k->gc0, lj.ldgc = ld;
    dtr__rnn_cells(k, s->gru ? (void *)&gj : (void *)&lj, b, e, w);
    if (to) dtr__gemm_packed(k->ctx->pool, w, e - b, 1.0f, k->dA + (t * B + b) * G, G, 1, &k->w, 1.0f, to + b * ld, ld);
}

/* every step of rows [b, e), in order (forward) or in reverse */
static void dtr__rnn_rows(void *arg, int64_t b, int64_t e, int w) {
    const dtr__rnn_walk *k = (const dtr__rnn_walk *)arg;
    int64_t t;
    for (t = 0; t < k->s.T; t++) {
        if (k->bwd) dtr__rnn_bwd_step(k, k->s.T - 1 - t, b, e, w);
        else dtr__rnn_fwd_step(k, t, b, e, w);
    }
}

/* W_hh packed (arena memory, given back after; unpacked when the arena has no room: the same
   bits), then the walk: rows split over the workers when each gets 8, else step by step */
static void dtr__rnn_walk_run(dtr__rnn_walk *k) {
    int64_t K = k->bwd ? k->s.G : k->s.H, N = k->bwd ? k->s.H : k->s.G, t;
    size_t bytes = dtr__gemm_bpack_floats(K, N) * sizeof(float);
    int threads = dtr__pool_threads(k->ctx->pool);
    float *mem = (float *)dtr__arena_data(k->ctx, bytes, dtr__rnn_name(&k->s));
    if (!mem) dtr_context_clear_error(k->ctx);
    dtr__gemm_bpack_fill(&k->w, k->s.w, k->bwd ? k->s.H : 1, k->bwd ? 1 : k->s.H, K, N, mem);
    if (threads <= 1 || k->s.B >= 8 * threads) dtr__pool_run(k->ctx->pool, k->s.B, 8, dtr__rnn_rows, k);
    else
        for (t = 0; t < k->s.T; t++) {
            if (k->bwd) dtr__rnn_bwd_step(k, k->s.T - 1 - t, 0, k->s.B, -1);
            else dtr__rnn_fwd_step(k, t, 0, k->s.B, -1);
        }
    if (mem) dtr__arena_give_back(k->ctx, mem, bytes);
}

/* the walk of node nd: its tensors and the saved gates' layout */
static dtr__rnn_walk dtr__rnn_walk_of(dtr_context *ctx, const dtr__node *nd, int bwd) {
    dtr__rnn_walk k;
    memset(&k, 0, sizeof k);
    k.s = dtr__rnn_seq_of(nd), k.ctx = ctx, k.bwd = bwd, k.all = bwd || nd->taped, k.S = 4 * k.s.H;
    return k;
}

dtr_result dtr__cpu_rnn_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__rnn_walk k = dtr__rnn_walk_of(ctx, nd, 0);
    size_t step = (size_t)(k.s.B * k.S) * sizeof(float), bytes = (k.all ? (size_t)k.s.T : 1) * step * (k.s.gru ? 4 : 5) / 4;
    k.A = (float *)(k.all ? dtr__node_save(ctx, nd, bytes) : dtr__arena_data(ctx, bytes, dtr__rnn_name(&k.s)));
    if (!k.A) return ctx->status;
    if (k.all) nd->saved = k.A;
    if (k.all && !k.s.gru) k.ts = k.A + k.s.T * k.s.B * k.S;
    dtr__rnn_walk_run(&k);
    if (!k.all) dtr__arena_give_back(ctx, k.A, bytes);
    return DTR_OK;
}

/* the gradients of w_hh (every step's dA (T, B, G H) against the h before it), b_hh (dA's
   column sums) and gx (dA, or the GRU's dX) */
static void dtr__rnn_seq_sums(dtr_context *ctx, const dtr__rnn_walk *k, const dtr__node *nd) {
    const dtr__rnn_seq *s = &k->s;
    int64_t H = s->H, G = s->G, B = s->B, n = s->T * B * G;
    float *gx = dtr__gradof(nd->in[0]), *gw = dtr__gradof(nd->in[1]), *gb = dtr__gradof(nd->in[2]);
    const float *dx = s->gru ? k->dX : k->dA;
    if (gx) dtr__add_into(ctx->pool, gx, dx, n);
    if (gw && s->T > 1) dtr__gemm(ctx->pool, G, H, (s->T - 1) * B, 1.0f, k->dA + B * G, 1, G, s->y, s->Y, 1, 1.0f, gw, H);
    if (gw && s->h0) dtr__gemm(ctx->pool, G, H, B, 1.0f, k->dA, 1, G, s->h0, H, 1, 1.0f, gw, H);
    if (gb) dtr__rows_sum_into(ctx->pool, k->dA, s->T * B, G, gb);
}

dtr_result dtr__cpu_rnn_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__rnn_walk k = dtr__rnn_walk_of(ctx, nd, 1);
    int64_t n = k.s.T * k.s.B * k.s.G;
    size_t bytes = (size_t)((k.s.gru ? 2 : 1) * n + 2 * k.s.B * k.s.Y) * sizeof(float);
    k.A = (float *)nd->saved, k.ts = k.s.gru ? NULL : k.A + k.s.T * k.s.B * k.S, k.gy = nd->out->grad;
    k.gh0 = dtr__gradof(nd->in[3]), k.gc0 = dtr__gradof(nd->in[4]);
    if (!(k.dA = (float *)dtr__arena_data(ctx, bytes, dtr__rnn_name(&k.s)))) return ctx->status;
    k.dX = k.s.gru ? k.dA + n : NULL, k.P[0] = k.dA + (k.s.gru ? 2 : 1) * n, k.P[1] = k.P[0] + k.s.B * k.s.Y;
    dtr__rnn_walk_run(&k);
    dtr__rnn_seq_sums(ctx, &k, nd);
    dtr__arena_give_back(ctx, k.dA, bytes);
    return DTR_OK;
}

/* ---- dropout ---- */

dtr_tensor *dtr__dropout_cols(dtr_context *ctx, dtr_tensor *x, float p, int64_t cols, int64_t col0) {
    dtr__node *n;
    int64_t w;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_dropout", x, "x")) return NULL;
    if (!(p >= 0.0f && p < 1.0f)) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_dropout: p = %g outside [0, 1)", (double)p);
    if (!ctx->training || p == 0.0f) return x;
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, DTR_OP_DROPOUT, 1, &x);
    if (!n) return NULL;
    /* the op takes its draws of the context's seeded stream (the next numel(x), or its share of
       a wider mask), so runs repeat on any backend; the backend draws them */
    w = cols > 0 && x->ndim ? x->shape[x->ndim - 1] : dtr_tensor_numel(x);
    n->p.dropout.p = p;
    n->p.dropout.draws = dtr__draws_take(ctx, dtr_tensor_numel(x), w, cols, col0);
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), x->ndim, x->shape, "dtr_dropout");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_dropout");
}

dtr_tensor *dtr_dropout(dtr_context *ctx, dtr_tensor *x, float p) { return dtr__dropout_cols(ctx, x, p, 0, 0); }

dtr_result dtr__cpu_dropout_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr__draws *d = &nd->p.dropout.draws;
    int64_t i, r, N = dtr_tensor_numel(nd->out);
    const float *x = dtr__f32(nd->in[0]);
    float *y = dtr__f32(nd->out), *m, p = nd->p.dropout.p;
    m = (float *)dtr__node_save(ctx, nd, (size_t)N * sizeof(float)); /* the mask, for backward */
    if (!m) return ctx->status;
    nd->saved = m;
    for (r = 0; r < N; r += d->width) {   /* a row's draws follow one another */
        dtr_rng rng = dtr__draws_at(d, r);
        for (i = r; i < N && i < r + d->width; i++) m[i] = dtr__f_dropout_mask(dtr__f_pcg_next(&rng.state, rng.inc), p);
    }
    for (i = 0; i < N; i++) y[i] = x[i] * m[i];
    return DTR_OK;
}

dtr_result dtr__cpu_dropout_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t i, N = dtr_tensor_numel(nd->out);
    const float *g = nd->out->grad, *m = (const float *)nd->saved;
    float *gx = dtr__gradof(nd->in[0]);
    (void)ctx;
    if (gx) for (i = 0; i < N; i++) gx[i] += g[i] * m[i];
    return DTR_OK;
}

/* ---- rotary position embedding ----
 * x, y (B, T, C), C = H * D: row r = (b, t) at position start + t; per row the D/2 angles' cosines and
 * sines (in double, rounded to f32), then every head's pairs rotated (dtr__f_rope_rotate).
 * Backward rotates the gradient back (the transpose: the sines negated). Rows on the pool. */

dtr_tensor *dtr_rope_at(dtr_context *ctx, dtr_tensor *x, int heads, float theta, int interleaved, int64_t start) {
    dtr__node *n;
    char s1[96];
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_rope", x, "x")) return NULL;
    if (heads <= 0 || !(theta > 0.0f) || !isfinite(theta) || start < 0)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_rope: heads %d must be > 0, theta %g > 0 and start %lld >= 0", heads,
                          (double)theta, (long long)start);
    if (x->ndim != 3 || x->shape[2] % heads || (x->shape[2] / heads) % 2)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_rope: x %s must be (B, T, C) with C = %d heads of an even width",
                          dtr__shape_str(x, s1, sizeof s1), heads);
    if (!(x = dtr__contig_input(ctx, x))) return NULL;
    if (!(n = dtr__node_new(ctx, DTR_OP_ROPE, 1, &x))) return NULL;
    n->p.rope.heads = heads;
    n->p.rope.interleaved = interleaved != 0;
    n->p.rope.theta = theta;
    n->p.rope.start = start;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), 3, x->shape, "dtr_rope");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_rope");
}

dtr_tensor *dtr_rope(dtr_context *ctx, dtr_tensor *x, int heads, float theta, int interleaved) {
    return dtr_rope_at(ctx, x, heads, theta, interleaved, 0);
}

typedef struct dtr__rope_job {
    const dtr__node *nd;
    const float *src;   /* x (forward) or dy (backward) */
    float *dst;         /* y, or x's gradient (added to) */
    float sign;         /* 1 forward, -1 backward: the rotation's direction */
    int64_t T, C, D;
    float *cs;          /* per worker: D/2 cosines, then D/2 sines */
} dtr__rope_job;

static void dtr__rope_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__rope_job *j = (const dtr__rope_job *)arg;
    const dtr__rope_params *p = &j->nd->p.rope;
    int64_t half = j->D / 2, r, h, k;
    float *cs = j->cs + (int64_t)w * j->D;
    for (r = b; r < e; r++) {
        for (k = 0; k < half; k++) {
            double a = (double)(p->start + r % j->T) * dtr__f_rope_freq(k, j->D, p->theta);
            cs[k] = (float)cos(a), cs[half + k] = j->sign * (float)sin(a);
        }
        for (h = 0; h < p->heads; h++)
            for (k = 0; k < half; k++) {
                int64_t o = r * j->C + h * j->D, i1 = o + dtr__f_rope_first(k, p->interleaved), i2 = o + dtr__f_rope_second(k, j->D, p->interleaved);
                float ra, rb;
                dtr__f_rope_rotate(j->src[i1], j->src[i2], cs[k], cs[half + k], &ra, &rb);
                if (j->sign > 0) j->dst[i1] = ra, j->dst[i2] = rb;
                else j->dst[i1] += ra, j->dst[i2] += rb;
            }
    }
}

static dtr_result dtr__rope_run(dtr_context *ctx, dtr__node *nd, const float *src, float *dst, float sign) {
    dtr__rope_job j;
    const dtr_tensor *x = nd->in[0];
    j.nd = nd, j.src = src, j.dst = dst, j.sign = sign;
    j.T = x->shape[1], j.C = x->shape[2], j.D = j.C / nd->p.rope.heads;
    j.cs = (float *)dtr__arena_data(ctx, (size_t)(dtr__pool_threads(ctx->pool) * (j.D ? j.D : 1)) * sizeof(float), "dtr_rope");
    if (!j.cs) return ctx->status;
    dtr__pool_run(ctx->pool, x->shape[0] * x->shape[1], 16, dtr__rope_range, &j);
    return DTR_OK;
}

dtr_result dtr__cpu_rope_fwd(dtr_context *ctx, dtr__node *nd) { return dtr__rope_run(ctx, nd, dtr__f32(nd->in[0]), dtr__f32(nd->out), 1.0f); }
dtr_result dtr__cpu_rope_bwd(dtr_context *ctx, dtr__node *nd) {
    float *gx = dtr__gradof(nd->in[0]);
    return gx ? dtr__rope_run(ctx, nd, nd->out->grad, gx, -1.0f) : DTR_OK;
}

/* ---- attention, fused (flash-style) ----
 * q (B, Tq, C), k, v (B, Tk, Ck), y (B, Tq, C) with C = H * D, Ck = Hk * D (grouped-query:
 * q head h reads kv head h / (H / Hk)), head h in columns h*D .. h*D+D-1 (no permutes); keys
 * past an item's key length are not seen. q, k and v are read as they are where their rows are dense (stride 1 along
 * C: the column slices of one qkv projection, whose rows are 3C apart), else through
 * contiguous copies; y and the gradients (a view's own) are dense. Per (batch, head), query
 * rows go in tiles of DTR__ATT_TILE: the tile's scores against the keys it may see (S = scale
 * q k^T; causal: keys 0..t, else all Tk), its softmax rows, then y = P v, all through GEMM;
 * only the row log-sum-exps (B, H, Tq) are kept. Backward recomputes each tile's P from them.
 * Dropout (training) multiplies P's rows by their mask values before P v; the mask is drawn
 * again in backward (each row's draws found by jumping the stream), never stored.
 * Memory per worker: two TILE x Tk blocks, never Tq x Tk per head. A (batch, head) is one
 * worker's forward, a (batch, kv head) with its q heads in order one worker's backward, in
 * tile order, so results do not depend on the thread count. */

#define DTR__ATT_TILE 32

/* x as attention reads it: itself when its rows are dense (stride 1 along C), else a copy */
static dtr_tensor *dtr__att_input(dtr_context *ctx, dtr_tensor *x) {
    return x->stride[2] == 1 || x->shape[2] == 1 ? x : dtr_contiguous(ctx, x);
}

dtr_attention_config dtr_attention_config_init(int heads, int causal) {
    dtr_attention_config c;
    memset(&c, 0, sizeof c);
    c.heads = heads;
    c.causal = causal;
    return c;
}

/* DTR_OK when q, k, v and cfg make an attention (the error set otherwise) */
static dtr_result dtr__att_check(dtr_context *ctx, const dtr_tensor *q, const dtr_tensor *k, const dtr_tensor *v,
                                 const dtr_attention_config *cfg) {
    char s1[96], s2[96], s3[96];
    int kvh = cfg->kv_heads ? cfg->kv_heads : cfg->heads;
    if (q->ndim != 3 || k->ndim != 3 || v->ndim != 3)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_attention: q %s, k %s, v %s must be 3-D", dtr__shape_str(q, s1, sizeof s1),
                         dtr__shape_str(k, s2, sizeof s2), dtr__shape_str(v, s3, sizeof s3));
    if (cfg->heads <= 0 || q->shape[2] % cfg->heads || kvh <= 0 || cfg->heads % kvh)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_attention: %d heads must divide C = %lld, and %d kv_heads the heads",
                         cfg->heads, (long long)q->shape[2], kvh);
    if (q->shape[0] != k->shape[0] || k->shape[2] != q->shape[2] / cfg->heads * kvh || memcmp(k->shape, v->shape, 3 * sizeof(int64_t)) ||
        (cfg->causal && cfg->q_start >= 0 && cfg->q_start + q->shape[1] > k->shape[1]) || (q->shape[1] > 0 && k->shape[1] == 0))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH,
                         "dtr_attention: q %s, k %s, v %s must be (B, Tq, C), (B, Tk, Ckv), (B, Tk, Ckv) with Ckv = %lld (%d kv heads)%s%lld",
                         dtr__shape_str(q, s1, sizeof s1), dtr__shape_str(k, s2, sizeof s2), dtr__shape_str(v, s3, sizeof s3),
                         (long long)(q->shape[2] / cfg->heads * kvh), kvh, cfg->causal ? ", Tq <= Tk - q_start (causal), q_start " : ", Tk > 0",
                         cfg->causal ? (long long)cfg->q_start : 0LL);
    if (!isfinite(cfg->scale))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_attention: scale %g is not finite", (double)cfg->scale);
    if (cfg->q_start < 0 || (cfg->q_start && !cfg->causal))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_attention: q_start %lld must be >= 0, and 0 unless causal",
                         (long long)cfg->q_start);
    if (cfg->key_lengths && cfg->key_lengths->dtype != DTR_I32)
        return dtr__fail(ctx, DTR_DTYPE_MISMATCH, "dtr_attention: key_lengths must be i32");
    if (cfg->key_lengths && cfg->key_lengths->ctx != ctx)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_attention: key_lengths belongs to another context");
    if (cfg->key_lengths && (cfg->key_lengths->ndim != 1 || cfg->key_lengths->shape[0] != q->shape[0]))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_attention: key_lengths %s must be (B) with B = %lld",
                         dtr__shape_str(cfg->key_lengths, s1, sizeof s1), (long long)q->shape[0]);
    return DTR_OK;
}

/* DTR_OK when cfg's dropout and the share of the mask it names are usable (the error set otherwise) */
static dtr_result dtr__att_check_dropout(dtr_context *ctx, const dtr_attention_config *cfg) {
    int all = cfg->mask_heads ? cfg->mask_heads : cfg->heads;
    if (!(cfg->dropout >= 0.0f && cfg->dropout < 1.0f))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_attention: dropout %g outside [0, 1)", (double)cfg->dropout);
    if (cfg->mask_heads < 0 || cfg->mask_head0 < 0 || cfg->mask_head0 > all - cfg->heads)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_attention: heads %d .. %d of the mask's %d (mask_head0 %d, mask_heads %d) "
                         "do not fit", cfg->mask_head0, cfg->mask_head0 + cfg->heads - 1, all, cfg->mask_head0, cfg->mask_heads);
    if (cfg->dropout > 0.0f && ctx->training && ctx->capturing)
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_graph: attention dropout inside a captured step (a replay would repeat the "
                         "capture's mask): leave it out of the step or switch training mode off");
    return DTR_OK;
}

/* n's dropout while training: the mask of the weights (B, H, Tq, Tk), this call's heads' share of
   one over mask_heads (the stream moves past all of it) */
static void dtr__att_dropout(dtr_context *ctx, dtr__node *n, const dtr_tensor *q, const dtr_tensor *k, const dtr_attention_config *cfg) {
    int64_t per = q->shape[1] * k->shape[1], heads = cfg->heads, all = cfg->mask_heads ? cfg->mask_heads : heads;
    if (!ctx->training || cfg->dropout == 0.0f) return;
    n->p.attention.dropout = cfg->dropout;
    n->p.attention.draws = dtr__draws_take(ctx, q->shape[0] * heads * per, heads * per, all * per, cfg->mask_head0 * per);
}

dtr_tensor *dtr_attention_ex(dtr_context *ctx, dtr_tensor *q, dtr_tensor *k, dtr_tensor *v, const dtr_attention_config *cfg) {
    dtr__node *n;
    dtr_tensor *lens;
    if (!ctx) return NULL;
    if (!cfg) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_attention_ex: cfg is NULL");
    if (!dtr__check_input(ctx, "dtr_attention", q, "q") || !dtr__check_input(ctx, "dtr_attention", k, "k") ||
        !dtr__check_input(ctx, "dtr_attention", v, "v") || dtr__att_check(ctx, q, k, v, cfg) != DTR_OK ||
        dtr__att_check_dropout(ctx, cfg) != DTR_OK)
        return NULL;
    q = dtr__att_input(ctx, q);
    k = dtr__att_input(ctx, k);
    v = dtr__att_input(ctx, v);
    lens = cfg->key_lengths ? dtr__contig_input(ctx, cfg->key_lengths) : NULL;
    if (!q || !k || !v || (cfg->key_lengths && !lens)) return NULL;
    {
        dtr_tensor *in[4] = {q, k, v, lens};
        n = dtr__node_new(ctx, DTR_OP_ATTENTION, lens ? 4 : 3, in);
    }
    if (!n) return NULL;
    n->p.attention.heads = cfg->heads;
    n->p.attention.kv_heads = cfg->kv_heads ? cfg->kv_heads : cfg->heads;
    n->p.attention.causal = cfg->causal != 0;
    n->p.attention.q_start = cfg->q_start;
    n->p.attention.scale = cfg->scale != 0.0f ? cfg->scale : 1.0f / sqrtf((float)(q->shape[2] / cfg->heads));
    dtr__att_dropout(ctx, n, q, k, cfg);
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), 3, q->shape, "dtr_attention");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_attention");
}

dtr_tensor *dtr_attention(dtr_context *ctx, dtr_tensor *q, dtr_tensor *k, dtr_tensor *v, int heads) {
    dtr_attention_config c = dtr_attention_config_init(heads, 1);
    return dtr_attention_ex(ctx, q, k, v, &c);
}

typedef struct dtr__att_job {
    const dtr__node *nd;
    dtr__pool *pool;
    int64_t B, Tq, Tk, C, H, D;
    int64_t Ck, rep;        /* k's and v's width (kv heads x D); q heads per kv head */
    int64_t sb[3], sr[3];   /* q, k, v: elements between batch items, between rows */
    int causal;
    int64_t q0;        /* causal: the key position of query 0 */
    float scale;
    float drop;        /* the weights' dropout (0: none) and its mask's draws */
    dtr__draws draws;
    const int32_t *len;   /* key_lengths (B), or NULL: every key */
    float *lse;        /* (B, H, Tq) */
    float *scratch;    /* per worker: two TILE x Tk blocks */
} dtr__att_job;

/* the keys query tile [t0, t0 + rows) of head bh sees: 0 .. q0 + t0 + rows - 1 (causal) or
   every key, and none past its item's key length */
static int64_t dtr__att_keys(const dtr__att_job *j, int64_t bh, int64_t t0, int64_t rows) {
    int64_t n = j->causal ? j->q0 + t0 + rows : j->Tk;
    return j->len && j->len[bh / j->H] < n ? j->len[bh / j->H] : n;
}

/* Rows t0.. of one tile: P (rows, nk) = softmax of the scaled scores S in place (causal: row
 * t's keys past q0 + t are 0); the row's log-sum-exp to lse (forward) or P from it (backward:
 * have_lse). */
static void dtr__att_softmax(const dtr__att_job *jb, float *S, int64_t rows, int64_t nk, int64_t t0, float *lse, int have_lse) {
    int64_t r, j;
    for (r = 0; r < rows; r++) {
        float *sr = S + r * nk, mx;
        int64_t valid = jb->causal && jb->q0 + t0 + r + 1 < nk ? jb->q0 + t0 + r + 1 : nk;
        double sum;
        for (j = 0; j < valid; j++) sr[j] *= jb->scale;
        if (have_lse) {
            (void)dtr__exp_sum(sr, valid, lse[t0 + r], sr);
        } else {
            mx = dtr__max_f32(sr, valid, -INFINITY, 0);
            sum = dtr__exp_sum(sr, valid, mx, sr);
            lse[t0 + r] = mx + (float)log(sum);
            for (j = 0; j < valid; j++) sr[j] = (float)(sr[j] / sum);
        }
        for (j = valid; j < nk; j++) sr[j] = 0.0f;
    }
}

/* Rows t0.. of one tile of head bh: dP (rows, nk) -> dS = P (dP m - rowsum(dY * Y)) scale in place,
 * dY and Y the tile's rows; with dropout, P -> P m too (the weights y was made of), m the rows'
 * mask values (0 or 1 / (1 - p); 1 without dropout), each row's draws from its element
 * ((bh Tq + t) Tk) of the mask over (B, H, Tq, Tk). dP NULL: the dropout of P only (forward). */
static void dtr__att_dscore(const dtr__att_job *j, int64_t bh, int64_t t0, int64_t rows, int64_t nk, float *P, float *dP,
                            const float *G, const float *Y) {
    int64_t r, c;
    for (r = 0; r < rows; r++) {
        float *p = P + r * nk, *dp = dP ? dP + r * nk : NULL;
        dtr_rng rng;
        double dy = 0.0;
        for (c = 0; dp && c < j->D; c++) dy += (double)G[r * j->C + c] * Y[r * j->C + c];
        if (j->drop == 0.0f) {
            for (c = 0; dp && c < nk; c++) dp[c] = p[c] * (dp[c] - (float)dy) * j->scale;
            continue;
        }
        rng = dtr__draws_at(&j->draws, (bh * j->Tq + t0 + r) * j->Tk);
        for (c = 0; c < nk; c++) {
            float m = dtr__f_dropout_mask(dtr__f_pcg_next(&rng.state, rng.inc), j->drop);
            if (dp) dp[c] = p[c] * (dp[c] * m - (float)dy) * j->scale;
            p[c] *= m;
        }
    }
}

/* head h of batch item b (bh = b H + h) of input i (q; k, v: the kv head h / rep): its first
   row's D values */
static const float *dtr__att_head(const dtr__att_job *j, int i, int64_t bh) {
    return dtr__f32(j->nd->in[i]) + (bh / j->H) * j->sb[i] + (i ? (bh % j->H) / j->rep : bh % j->H) * j->D;
}
/* the first of head bh's D values in y or q's gradient (B, Tq, C) (q: 1), or in k's or v's
   gradient (B, Tk, Ck) (its kv head's) */
static int64_t dtr__att_off(const dtr__att_job *j, int64_t bh, int q) {
    return q ? (bh / j->H) * j->Tq * j->C + (bh % j->H) * j->D : (bh / j->H) * j->Tk * j->Ck + (bh % j->H) / j->rep * j->D;
}

static void dtr__att_fwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__att_job *j = (const dtr__att_job *)arg;
    int64_t Tq = j->Tq, C = j->C, D = j->D, bh, t0;
    float *S = j->scratch + (int64_t)w * 2 * DTR__ATT_TILE * j->Tk;
    for (bh = b; bh < e; bh++) {
        const float *Q = dtr__att_head(j, 0, bh), *K = dtr__att_head(j, 1, bh), *V = dtr__att_head(j, 2, bh);
        float *Y = dtr__f32(j->nd->out) + dtr__att_off(j, bh, 1), *lse = j->lse + bh * Tq;
        for (t0 = 0; t0 < Tq; t0 += DTR__ATT_TILE) {
            int64_t rows = Tq - t0 < DTR__ATT_TILE ? Tq - t0 : DTR__ATT_TILE, nk = dtr__att_keys(j, bh, t0, rows);
            /* S (rows, nk) = Q_tile (rows, D) K^T (D, nk) */
            dtr__gemm_on(j->pool, w, rows, nk, D, 1.0f, Q + t0 * j->sr[0], j->sr[0], 1, K, 1, j->sr[1], 0.0f, S, nk);
            dtr__att_softmax(j, S, rows, nk, t0, lse, 0);
            if (j->drop != 0.0f) dtr__att_dscore(j, bh, t0, rows, nk, S, NULL, NULL, NULL);
            /* Y_tile (rows, D) = P (rows, nk) V (nk, D) */
            dtr__gemm_on(j->pool, w, rows, D, nk, 1.0f, S, nk, 1, V, j->sr[2], 1, 0.0f, Y + t0 * C, C);
        }
    }
}

/* dQ, dK, dV of one (batch, head), tile by tile; dS = P (dP m - rowsum(dY * Y)) scale
   (dtr__att_dscore; m the dropout mask, 1 without). */
static void dtr__att_bwd_head(const dtr__att_job *j, int64_t bh, int w) {
    const dtr__node *nd = j->nd;
    int64_t Tq = j->Tq, C = j->C, Ck = j->Ck, D = j->D, t0;
    int64_t off = dtr__att_off(j, bh, 1), offk = dtr__att_off(j, bh, 0), rq = j->sr[0], rk = j->sr[1];
    float *P = j->scratch + (int64_t)w * 2 * DTR__ATT_TILE * j->Tk, *dP = P + DTR__ATT_TILE * j->Tk;
    float *GQ = dtr__gradof(nd->in[0]), *GK = dtr__gradof(nd->in[1]), *GV = dtr__gradof(nd->in[2]);
    const float *Q = dtr__att_head(j, 0, bh), *K = dtr__att_head(j, 1, bh), *V = dtr__att_head(j, 2, bh);
    const float *Y = dtr__f32(nd->out) + off, *G = nd->out->grad + off, *lse = j->lse + bh * Tq;
    for (t0 = 0; t0 < Tq; t0 += DTR__ATT_TILE) {
        int64_t rows = Tq - t0 < DTR__ATT_TILE ? Tq - t0 : DTR__ATT_TILE, nk = dtr__att_keys(j, bh, t0, rows);
        dtr__gemm_on(j->pool, w, rows, nk, D, 1.0f, Q + t0 * rq, rq, 1, K, 1, rk, 0.0f, P, nk);
        dtr__att_softmax(j, P, rows, nk, t0, (float *)lse, 1);
        /* dP (rows, nk) = dY_tile (rows, D) V^T (D, nk), then dS over it (and the dropout of P) */
        if (GQ || GK) dtr__gemm_on(j->pool, w, rows, nk, D, 1.0f, G + t0 * C, C, 1, V, 1, j->sr[2], 0.0f, dP, nk);
        if (GQ || GK || j->drop != 0.0f) dtr__att_dscore(j, bh, t0, rows, nk, P, GQ || GK ? dP : NULL, G + t0 * C, Y + t0 * C);
        /* dV (nk, D) += P^T (nk, rows) dY_tile (rows, D) */
        if (GV) dtr__gemm_on(j->pool, w, nk, D, rows, 1.0f, P, 1, nk, G + t0 * C, C, 1, 1.0f, GV + offk, Ck);
        /* dQ_tile (rows, D) += dS (rows, nk) K (nk, D); dK (nk, D) += dS^T (nk, rows) Q_tile (rows, D) */
        if (GQ) dtr__gemm_on(j->pool, w, rows, D, nk, 1.0f, dP, nk, 1, K, rk, 1, 1.0f, GQ + off + t0 * C, C);
        if (GK) dtr__gemm_on(j->pool, w, nk, D, rows, 1.0f, dP, 1, nk, Q + t0 * rq, rq, 1, 1.0f, GK + offk, Ck);
    }
}

/* the kv heads [b, e) of (batch, kv head) items: each of their q heads in order (one worker
   adds every gradient a kv head gets, in a fixed order) */
static void dtr__att_bwd_range(void *arg, int64_t b, int64_t e, int w) {
    const dtr__att_job *j = (const dtr__att_job *)arg;
    int64_t g, r, Hk = j->H / j->rep;
    for (g = b; g < e; g++)
        for (r = 0; r < j->rep; r++) dtr__att_bwd_head(j, g / Hk * j->H + g % Hk * j->rep + r, w);
}

static dtr_result dtr__att_job_make(dtr_context *ctx, dtr__node *nd, dtr__att_job *j) {
    int i;
    memset(j, 0, sizeof *j);
    j->nd = nd;
    j->pool = ctx->pool;
    j->B = nd->in[0]->shape[0]; j->Tq = nd->in[0]->shape[1]; j->Tk = nd->in[1]->shape[1]; j->C = nd->in[0]->shape[2];
    j->H = nd->p.attention.heads; j->D = j->C / j->H;
    j->Ck = nd->in[1]->shape[2], j->rep = j->H / nd->p.attention.kv_heads;
    for (i = 0; i < 3; i++) j->sb[i] = nd->in[i]->stride[0], j->sr[i] = nd->in[i]->stride[1];
    j->causal = nd->p.attention.causal;
    j->q0 = nd->p.attention.q_start;
    j->scale = nd->p.attention.scale;
    j->drop = nd->p.attention.dropout, j->draws = nd->p.attention.draws;
    j->len = nd->n_in > 3 && nd->in[3] ? (const int32_t *)dtr__data(nd->in[3]) : NULL;
    j->scratch = (float *)dtr__arena_data(ctx, (size_t)(dtr__pool_threads(ctx->pool) * 2 * DTR__ATT_TILE * (j->Tk ? j->Tk : 1)) *
                                                 sizeof(float), "dtr_attention");
    return j->scratch ? DTR_OK : ctx->status;
}

dtr_result dtr__cpu_attention_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__att_job j;
    int64_t b;
    if (dtr__att_job_make(ctx, nd, &j) != DTR_OK) return ctx->status;
    for (b = 0; j.len && b < j.B; b++)
        if (j.len[b] < 1 || j.len[b] > j.Tk)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_attention: key_lengths[%lld] is %d, outside [1, %lld]", (long long)b,
                             (int)j.len[b], (long long)j.Tk);
    j.lse = (float *)dtr__node_save(ctx, nd, (size_t)(j.B * j.H * j.Tq + 1) * sizeof(float)); /* row log-sum-exps */
    if (!j.lse) return ctx->status;
    nd->saved = j.lse;
    dtr__pool_run(ctx->pool, j.B * j.H, 1, dtr__att_fwd_range, &j);
    return DTR_OK;
}

dtr_result dtr__cpu_attention_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__att_job j;
    if (!dtr__gradof(nd->in[0]) && !dtr__gradof(nd->in[1]) && !dtr__gradof(nd->in[2])) return DTR_OK;
    if (dtr__att_job_make(ctx, nd, &j) != DTR_OK) return ctx->status;
    j.lse = (float *)nd->saved;
    dtr__pool_run(ctx->pool, j.B * (j.H / j.rep), 1, dtr__att_bwd_range, &j);
    return DTR_OK;
}
