/* ============================================================================
 * Gradient compression of the data-parallel engine: what each bucket puts on the wire.
 *
 *   n      floats in the bucket, N ranks, acc = gradient + residual (error feedback)
 *   bf16, fp16   the bucket converted to 2-byte floats, all-reduced (average) in that dtype
 *   int8         [f32 scale][n int8], all-gathered; every rank sums the N payloads in rank
 *                order (identical bits everywhere) and divides by N
 *   topk         [k int32 indices][k f32 values], all-gathered, summed likewise
 *   powersgd     per matrix M (rows, cols) of the bucket: P = M Q (rows, r) with the other
 *                parameters' floats appended, all-reduced during backward; then in
 *                dtr_dp_finish P is orthonormalised, Q = M^T P (cols, r) all-reduced, and
 *                M ~ P Q^T. Q starts random (the same seed on every rank) and is reused by
 *                the next step (warm start), as PowerSGD (Vogels et al., 2019).
 * A device model's codecs over a group of device memory (NCCL) stay on the device: the
 * backend's cast kernel (16-bit), codec slot (int8, top-k) or powersgd slot encodes into and
 * decodes from device buffers, the group reduces or gathers them there, the residual (and
 * PowerSGD's Q) is device memory too. A backend without those slots: the engine's host copy.
 * The residual (one float per gradient float) keeps what the codec lost: int8 and top-k the
 * local difference acc - decoded(acc); PowerSGD acc - (averaged approximation), whose
 * average over the ranks is what the average lost (the approximation is linear in M).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include "compress.h"
#include <math.h>

typedef struct dtr__cmat { int64_t off, rows, cols; } dtr__cmat;   /* offset in the bucket */

typedef struct dtr__cbucket {
    int64_t n;              /* floats */
    size_t bytes;           /* this rank's payload */
    unsigned char *send, *recv;   /* payload; the gathered payloads of int8 and top-k */
    dtr__cmat *mat;         /* PowerSGD: the matrices, by offset */
    int nmat;
    int64_t np, nq;         /* PowerSGD: floats of P (with the exact rest) and of Q */
    float *q;               /* PowerSGD: Q of every matrix, kept for the next step */
} dtr__cbucket;

struct dtr__dpc {
    dtr_model *m;
    dtr_comm *c;
    dtr_context *ctx;
    dtr_dp_compress kind;
    float ratio;
    int rank_r, ef, world;
    int dev;                /* in the backend's memory (dtr__dpc_create's dev): buffers, residual */
    float *resid;           /* error feedback (numel floats) */
    dtr__cbucket *b;        /* one per parameter at most, made at the first start */
    int nb;
    dtr_dp_stats st;
};

static int dtr__dpc_has_ef(const dtr__dpc *z) {
    return z->ef && (z->kind == DTR_COMPRESS_INT8 || z->kind == DTR_COMPRESS_TOPK || z->kind == DTR_COMPRESS_POWERSGD);
}

dtr_result dtr__dpc_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, int dev, dtr__dpc **out) {
    dtr_context *ctx = dtr_model_context(m);
    size_t numel = (size_t)dtr_model_numel(m);
    dtr__dpc *z;
    *out = NULL;
    if ((int)cfg->compress < 0 || cfg->compress > DTR_COMPRESS_POWERSGD)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: unknown compress %d", (int)cfg->compress);
    if (!(cfg->topk_ratio >= 0.0f && cfg->topk_ratio <= 1.0f))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: topk_ratio %g outside (0, 1]", cfg->topk_ratio);
    if (cfg->powersgd_rank < 0 || cfg->powersgd_rank > 1024)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: powersgd_rank %d outside 1..1024", cfg->powersgd_rank);
    if (cfg->compress == DTR_COMPRESS_TOPK && numel > (size_t)INT32_MAX)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_dp_create: top-k indexes buckets with int32 (%zu floats)", numel);
    z = (dtr__dpc *)dtr__calloc(&ctx->alloc, sizeof(*z));
    if (!z) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory");
    z->m = m, z->c = c, z->ctx = ctx, z->kind = cfg->compress, z->world = dtr_comm_size(c);
    z->ratio = cfg->topk_ratio > 0.0f ? cfg->topk_ratio : 0.01f;
    z->rank_r = cfg->powersgd_rank > 0 ? cfg->powersgd_rank : 4;
    z->ef = !cfg->no_error_feedback;
    z->dev = dev;
    z->b = (dtr__cbucket *)dtr__calloc(&ctx->alloc, (size_t)(dtr_model_param_count(m) + 1) * sizeof(dtr__cbucket));
    if (z->b && dtr__dpc_has_ef(z)) z->resid = (float *)dtr__mem_alloc_on(z->ctx, z->dev, (numel + 1) * sizeof(float));
    if (!z->b || (dtr__dpc_has_ef(z) && !z->resid)) {
        dtr__dpc_destroy(z);
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory");
    }
    z->nb = dtr_model_param_count(m) + 1;
    *out = z;
    return DTR_OK;
}

/* every bucket's buffers freed: made again at its next start */
static void dtr__cbuckets_free(dtr__dpc *z) {
    int i;
    for (i = 0; z->b && i < z->nb; i++) {
        dtr__mem_free_on(z->ctx, z->dev, z->b[i].send);
        dtr__mem_free_on(z->ctx, z->dev, z->b[i].recv);
        dtr__free(&z->ctx->alloc, z->b[i].mat);
        dtr__mem_free_on(z->ctx, z->dev, z->b[i].q);
        memset(&z->b[i], 0, sizeof z->b[i]);
    }
}

void dtr__dpc_forget_buckets(dtr__dpc *z) {
    size_t bytes = (size_t)dtr_model_numel(z->m) * sizeof(float);
    dtr__cbuckets_free(z);
    if (z->resid && z->dev) (void)z->ctx->backend->memset0(z->ctx, z->resid, bytes);
    else if (z->resid) memset(z->resid, 0, bytes);
}

void dtr__dpc_destroy(dtr__dpc *z) {
    if (!z) return;
    dtr__cbuckets_free(z);
    dtr__free(&z->ctx->alloc, z->b);
    dtr__mem_free_on(z->ctx, z->dev, z->resid);
    dtr__free(&z->ctx->alloc, z);
}

dtr_dp_stats *dtr__dpc_stats(dtr__dpc *z) { return &z->st; }

float *dtr__dpc_residual(dtr__dpc *z, size_t *bytes, int *dev) {
    *bytes = z->resid ? (size_t)dtr_model_numel(z->m) * sizeof(float) : 0;
    *dev = z->dev;
    return z->resid;
}

/* ---- PowerSGD: the matrices of a bucket and the floats between them ---- */

/* the parameters of [begin, end) with 2 or more dimensions and both sides above the rank */
static dtr_result dtr__psgd_plan(dtr__dpc *z, dtr__cbucket *b, int64_t begin, int64_t end) {
    int np = dtr_model_param_count(z->m), i;
    int64_t covered = 0;
    b->mat = (dtr__cmat *)dtr__calloc(&z->ctx->alloc, (size_t)(np + 1) * sizeof(dtr__cmat));
    if (!b->mat) return DTR_OUT_OF_MEMORY;
    for (i = 0; i < np; i++) {
        dtr_tensor *p = dtr_model_param_at(z->m, i);
        int64_t off = dtr_model_param_offset(z->m, i), rows = dtr_tensor_dim(p, 0), numel = dtr_tensor_numel(p);
        if (off < begin || off >= end || dtr_tensor_ndim(p) < 2 || rows <= z->rank_r || numel / rows <= z->rank_r) continue;
        b->mat[b->nmat].off = off - begin, b->mat[b->nmat].rows = rows, b->mat[b->nmat].cols = numel / rows;
        b->np += rows * z->rank_r;
        b->nq += numel / rows * z->rank_r;
        covered += numel;
        b->nmat++;
    }
    b->np += b->n - covered;
    return DTR_OK;
}

/* where the floats outside the matrices go in P's message: after every matrix's P */
static float *dtr__psgd_tail(const dtr__cbucket *b) {
    int64_t covered = 0;
    int j;
    for (j = 0; j < b->nmat; j++) covered += b->mat[j].rows * b->mat[j].cols;
    return (float *)b->send + (b->np - (b->n - covered));
}

/* segment j (0 .. nmat) of the floats outside the matrices: start in *s, length returned */
static int64_t dtr__psgd_gap(const dtr__cbucket *b, int j, int64_t *s) {
    *s = j == 0 ? 0 : b->mat[j - 1].off + b->mat[j - 1].rows * b->mat[j - 1].cols;
    return (j < b->nmat ? b->mat[j].off : b->n) - *s;
}

/* bytes from src to dst in the codec's memory (the backend's copy on the device) */
static dtr_result dtr__dpc_copy(dtr__dpc *z, void *dst, const void *src, size_t bytes) {
    if (z->dev) return dtr__mem_copy(z->ctx, dst, src, bytes);
    memcpy(dst, src, bytes);
    return DTR_OK;
}

/* copies the floats outside the matrices between the bucket g and rest (to_g: rest -> g) */
static dtr_result dtr__psgd_rest(dtr__dpc *z, const dtr__cbucket *b, float *g, float *rest, int to_g) {
    int64_t s, len, k = 0;
    dtr_result r = DTR_OK;
    int j;
    for (j = 0; j <= b->nmat && r == DTR_OK; j++, k += len) {
        size_t bytes = (size_t)(len = dtr__psgd_gap(b, j, &s)) * sizeof(float);
        if (len) r = to_g ? dtr__dpc_copy(z, g + s, rest + k, bytes) : dtr__dpc_copy(z, rest + k, g + s, bytes);
    }
    return r;
}

/* makes the r columns of p (rows, r) orthonormal (modified Gram-Schmidt, projections done
   twice so that a column of rounding noise still comes out orthogonal; zero stays zero) */
static void dtr__orthonormalise(float *p, int64_t rows, int r) {
    int c, d;
    int64_t i;
    for (c = 0; c < r; c++) {
        double norm = 0.0;
        for (d = 0; d < 2 * c; d++) {
            double dot = 0.0;
            for (i = 0; i < rows; i++) dot += (double)p[i * r + c] * p[i * r + d % c];
            for (i = 0; i < rows; i++) p[i * r + c] -= (float)dot * p[i * r + d % c];
        }
        for (i = 0; i < rows; i++) norm += (double)p[i * r + c] * p[i * r + c];
        norm = sqrt(norm);
        for (i = 0; i < rows; i++) p[i * r + c] = norm > 1e-30 ? (float)(p[i * r + c] / norm) : 0.0f;
    }
}

static dtr_result dtr__psgd_alloc(dtr__dpc *z, dtr__cbucket *b, int64_t begin, int64_t end) {
    size_t qb;
    float *q;
    dtr_rng rng;
    dtr_result r = DTR_OK;
    int64_t i;
    if (dtr__psgd_plan(z, b, begin, end) != DTR_OK) return DTR_OUT_OF_MEMORY;
    qb = (size_t)(b->nq + 1) * sizeof(float);
    b->bytes = (size_t)b->np * sizeof(float);
    b->send = (unsigned char *)dtr__mem_alloc_on(z->ctx, z->dev, b->bytes + sizeof(float));
    b->q = (float *)dtr__mem_alloc_on(z->ctx, z->dev, qb);
    q = z->dev ? (float *)dtr__calloc(&z->ctx->alloc, qb) : b->q;   /* drawn on the host */
    if (!b->send || !b->q || !q) r = DTR_OUT_OF_MEMORY;
    dtr_rng_seed(&rng, 0x9e3779b97f4a7c15ull, (uint64_t)begin);   /* the same Q on every rank */
    for (i = 0; r == DTR_OK && i < b->nq; i++) q[i] = dtr_rng_normal(&rng);
    if (r == DTR_OK && z->dev) r = z->ctx->backend->from_host(z->ctx, b->q, q, qb);
    if (q != b->q) dtr__free(&z->ctx->alloc, q);
    return r;
}

/* bucket b's matrix j over g, with its P and Q (resid: the bucket's residual, may be NULL) */
static dtr__psgd_args dtr__psgd_of(const dtr__dpc *z, const dtr__cbucket *b, int j, float *g, float *resid) {
    dtr__psgd_args a;
    const dtr__cmat *m = &b->mat[j];
    int k;
    a.rows = m->rows, a.cols = m->cols, a.r = z->rank_r;
    a.m = g + m->off, a.resid = resid ? resid + m->off : NULL;
    a.p = (float *)b->send, a.q = b->q;
    for (k = 0; k < j; k++) a.p += b->mat[k].rows * z->rank_r, a.q += b->mat[k].cols * z->rank_r;
    return a;
}

dtr_result dtr__cpu_powersgd(dtr_context *ctx, const dtr__psgd_args *a, int phase) {
    int64_t i, n = a->rows * a->cols;
    if (phase == DTR__PSGD_P)
        dtr__gemm(ctx->pool, a->rows, a->r, a->cols, 1.0f, a->m, a->cols, 1, a->q, a->r, 1, 0.0f, a->p, a->r);
    if (phase == DTR__PSGD_Q) {
        dtr__orthonormalise(a->p, a->rows, a->r);
        dtr__gemm(ctx->pool, a->cols, a->r, a->rows, 1.0f, a->m, 1, a->cols, a->p, a->r, 1, 0.0f, a->q, a->r);
    }
    if (phase != DTR__PSGD_M) return DTR_OK;
    dtr__gemm(ctx->pool, a->rows, a->cols, a->r, 1.0f, a->p, a->r, 1, a->q, 1, a->r, 0.0f, a->m, a->cols);
    for (i = 0; a->resid && i < n; i++) a->resid[i] -= a->m[i];
    return DTR_OK;
}

/* one phase on every matrix of bucket b: the backend's on the device */
static dtr_result dtr__psgd_each(dtr__dpc *z, const dtr__cbucket *b, float *g, float *resid, int phase) {
    dtr_result r = DTR_OK;
    int j;
    for (j = 0; j < b->nmat && r == DTR_OK; j++) {
        dtr__psgd_args a = dtr__psgd_of(z, b, j, g, resid);
        r = z->dev ? z->ctx->backend->powersgd(z->ctx, &a, phase) : dtr__cpu_powersgd(z->ctx, &a, phase);
    }
    return r;
}

/* P (rows, r) = M (rows, cols) Q (cols, r) per matrix, the rest after them, all-reduced */
static dtr_result dtr__psgd_start(dtr__dpc *z, dtr__cbucket *b, float *g, dtr_request **req) {
    float *rest = dtr__psgd_tail(b);
    dtr_result r = dtr__psgd_each(z, b, g, NULL, DTR__PSGD_P);
    if (r == DTR_OK) r = dtr__psgd_rest(z, b, g, rest, 0);
    return r != DTR_OK ? r : dtr_comm_all_reduce_async(z->c, b->send, b->send, (size_t)b->np, DTR_F32, DTR_REDUCE_AVG, req);
}

/* P averaged: Q = M^T P (P orthonormalised) averaged (blocking), g = P Q^T, the rest from P's
   tail; resid (held acc) -= the approximation, 0 where the rest was averaged exactly */
static dtr_result dtr__psgd_finish(dtr__dpc *z, dtr__cbucket *b, float *g, float *resid) {
    float *rest = dtr__psgd_tail(b);
    int64_t s, len;
    int j;
    dtr_result r = dtr__psgd_each(z, b, g, NULL, DTR__PSGD_Q);
    z->st.wire_bytes += (uint64_t)b->nq * sizeof(float);
    if (r == DTR_OK) r = dtr_comm_all_reduce(z->c, b->q, b->q, (size_t)b->nq, DTR_F32, DTR_REDUCE_AVG);
    if (r == DTR_OK) r = dtr__psgd_rest(z, b, g, rest, 1);
    if (r == DTR_OK) r = dtr__psgd_each(z, b, g, resid, DTR__PSGD_M);
    for (j = 0; resid && j <= b->nmat && r == DTR_OK; j++) {
        len = dtr__psgd_gap(b, j, &s);
        if (!len) continue;
        if (z->dev) r = z->ctx->backend->memset0(z->ctx, resid + s, (size_t)len * sizeof(float));
        else memset(resid + s, 0, (size_t)len * sizeof(float));
    }
    return r;
}

/* ---- int8 and top-k: encode, all-gather, sum in rank order ---- */

/* q = g / scale rounded to nearest even (adding and taking 1.5 * 2^23 rounds |v| < 2^22 as
   nearbyintf does, without a call), clamped to +-127, NaN as 0; resid = g - q * scale. The
   same bits as the scalar formula, element by element, so resid may be g itself. */
void dtr__int8_encode(const float *g, int64_t n, unsigned char *out, float *resid) {
    float scale = dtr__max_f32(g, n, 0.0f, 1) / 127.0f;
    int8_t *q = (int8_t *)(out + sizeof(float));
    memcpy(out, &scale, sizeof scale);
    if (!(scale > 0.0f)) {   /* all zero (or NaN): nothing to send */
        memset(q, 0, (size_t)n);
        if (resid && resid != g) memcpy(resid, g, (size_t)n * sizeof(float));
        return;
    }
    DTR__ELEMENTWISE(0, n, {
        float v = g[i] / scale;
        v = (v + 12582912.0f) - 12582912.0f;
        q[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v == v ? v : 0.0f);
    });
    if (resid) DTR__ELEMENTWISE(0, n, resid[i] = g[i] - (float)q[i] * scale);
}

/* the k-th largest of |g[0..n)| (1 <= k <= n): a radix select on the magnitudes' bit
   patterns (those of non-negative floats order as the floats), 11 + 11 + 10 bits, each pass
   counting the entries that share the prefix found so far */
static float dtr__kth_largest_abs(const float *g, int64_t n, int64_t k) {
    static const int shift[3] = {21, 10, 0};
    uint32_t prefix = 0, mask = 0, bits;
    int64_t cnt[2048], i;
    int p, bin, nb;
    float f;
    for (p = 0; p < 3; p++) {
        nb = p == 2 ? 1024 : 2048;
        memset(cnt, 0, sizeof cnt);
        for (i = 0; i < n; i++) {
            memcpy(&bits, g + i, sizeof bits);
            bits &= 0x7fffffffu;
            if ((bits & mask) == prefix) cnt[(bits >> shift[p]) & (uint32_t)(nb - 1)]++;
        }
        for (bin = nb - 1; bin > 0 && cnt[bin] < k; bin--) k -= cnt[bin];
        prefix |= (uint32_t)bin << shift[p];
        mask |= (uint32_t)(nb - 1) << shift[p];
    }
    memcpy(&f, &prefix, sizeof f);
    return f;
}

static int64_t dtr__topk_count(const dtr__dpc *z, int64_t n) {
    int64_t k = (int64_t)((double)z->ratio * (double)n + 0.5);
    return k < 1 ? 1 : k > n ? n : k;
}

/* payload [k int32 indices, ascending][k f32 values]: the k entries of g largest in
   magnitude (ties: the first ones); resid (may be NULL) = g with those entries zeroed */
static void dtr__topk_encode(const float *g, int64_t n, int64_t k, unsigned char *out, float *resid) {
    int32_t *idx = (int32_t *)out;
    float *val = (float *)(out + (size_t)k * sizeof(int32_t)), thr = dtr__kth_largest_abs(g, n, k);
    int64_t i, m = 0, above = 0;
    for (i = 0; i < n; i++) above += fabsf(g[i]) > thr;
    for (i = 0; i < n; i++) {
        int take = m < k && (fabsf(g[i]) > thr || (fabsf(g[i]) == thr && above < k));
        if (fabsf(g[i]) == thr && take) above++;
        if (take) { idx[m] = (int32_t)i; val[m++] = g[i]; }
        if (resid) resid[i] = take ? 0.0f : g[i];
    }
    for (; m < k; m++) idx[m] = 0, val[m] = 0.0f;   /* NaN magnitudes compare with nothing */
}

/* g = (sum over ranks, in rank order, of the gathered payloads) / N */
static void dtr__gather_decode(const dtr__codec_args *a) {
    float *g = a->g;
    int r;
    int64_t i;
    memset(g, 0, (size_t)a->n * sizeof(float));
    for (r = 0; r < a->world; r++) {
        const unsigned char *p = a->payload + (size_t)r * a->bytes;
        float scale;
        if (a->kind == DTR_COMPRESS_TOPK) {
            const int32_t *idx = (const int32_t *)p;
            const float *val = (const float *)(p + (size_t)a->k * sizeof(int32_t));
            for (i = 0; i < a->k; i++) g[idx[i]] += val[i];
            continue;
        }
        memcpy(&scale, p, sizeof scale);
        for (i = 0; i < a->n; i++) g[i] += scale * (float)((const int8_t *)(p + sizeof(float)))[i];
    }
    for (i = 0; i < a->n; i++) g[i] /= (float)a->world;
}

dtr_result dtr__cpu_codec(dtr_context *ctx, const dtr__codec_args *a, int decode) {
    (void)ctx;
    if (decode) dtr__gather_decode(a);
    else if (a->kind == DTR_COMPRESS_INT8) dtr__int8_encode(a->g, a->n, a->payload, a->resid);
    else dtr__topk_encode(a->g, a->n, a->k, a->payload, a->resid);
    return DTR_OK;
}

/* bucket b's codec arguments over g (its floats): encode from send, decode from recv */
static dtr_result dtr__dpc_code(dtr__dpc *z, const dtr__cbucket *b, float *g, float *resid, int decode) {
    dtr__codec_args a;
    a.kind = (int)z->kind, a.world = z->world, a.n = b->n;
    a.k = z->kind == DTR_COMPRESS_TOPK ? dtr__topk_count(z, b->n) : 0;
    a.g = g, a.resid = resid, a.payload = decode ? b->recv : b->send, a.bytes = b->bytes;
    return z->dev ? z->ctx->backend->codec(z->ctx, &a, decode) : dtr__cpu_codec(z->ctx, &a, decode);
}

/* ---- per bucket ---- */

static dtr_result dtr__cbucket_alloc(dtr__dpc *z, dtr__cbucket *b, int64_t begin, int64_t end) {
    size_t half = (size_t)b->n * sizeof(uint16_t);
    if (z->kind == DTR_COMPRESS_POWERSGD) return dtr__psgd_alloc(z, b, begin, end);
    if (z->kind == DTR_COMPRESS_BF16 || z->kind == DTR_COMPRESS_FP16) b->bytes = half;
    if (z->kind == DTR_COMPRESS_INT8) b->bytes = (sizeof(float) + (size_t)b->n + 3) & ~(size_t)3;
    if (z->kind == DTR_COMPRESS_TOPK) b->bytes = (size_t)dtr__topk_count(z, b->n) * (sizeof(int32_t) + sizeof(float));
    b->send = (unsigned char *)dtr__mem_alloc_on(z->ctx, z->dev, b->bytes + 1);
    if (z->kind == DTR_COMPRESS_INT8 || z->kind == DTR_COMPRESS_TOPK)
        b->recv = (unsigned char *)dtr__mem_alloc_on(z->ctx, z->dev, b->bytes * (size_t)z->world + 1);
    return b->send && (b->recv || !b->bytes || b->bytes == half) ? DTR_OK : DTR_OUT_OF_MEMORY;
}

dtr_result dtr__dpc_start(dtr__dpc *z, int i, float *g, int64_t begin, int64_t end, dtr_request **req) {
    dtr__cbucket *b = &z->b[i];
    float *gb = g + begin, *rb = z->resid ? z->resid + begin : NULL;
    dtr_dtype half = z->kind == DTR_COMPRESS_BF16 ? DTR_BF16 : DTR_F16;
    dtr_result r = DTR_OK;
    int64_t k;
    z->st.raw_bytes += (uint64_t)(end - begin) * sizeof(float);
    if (z->kind == DTR_COMPRESS_NONE) {
        z->st.wire_bytes += (uint64_t)(end - begin) * sizeof(float);
        return dtr_comm_all_reduce_async(z->c, gb, gb, (size_t)(end - begin), DTR_F32, DTR_REDUCE_AVG, req);
    }
    if (!b->send) {
        b->n = end - begin;
        if (dtr__cbucket_alloc(z, b, begin, end) != DTR_OK) return DTR_OUT_OF_MEMORY;
    }
    if (rb && z->dev) r = z->ctx->backend->reduce(z->ctx, gb, gb, rb, (size_t)b->n, DTR_F32, DTR_REDUCE_SUM, 1);
    else for (k = 0; rb && k < b->n; k++) gb[k] += rb[k];   /* error feedback: acc = g + residual */
    if (r != DTR_OK) return r;
    z->st.wire_bytes += b->bytes;
    switch (z->kind) {
    case DTR_COMPRESS_BF16:
    case DTR_COMPRESS_FP16:
        if ((r = dtr__convert_mem(z->ctx, z->dev, b->send, half, gb, DTR_F32, b->n)) != DTR_OK) return r;
        return dtr_comm_all_reduce_async(z->c, b->send, b->send, (size_t)b->n, half, DTR_REDUCE_AVG, req);
    case DTR_COMPRESS_INT8:
    case DTR_COMPRESS_TOPK:
        if ((r = dtr__dpc_code(z, b, gb, rb, 0)) != DTR_OK) return r;
        break;
    default:
        if (rb && (r = dtr__dpc_copy(z, rb, gb, (size_t)b->n * sizeof(float))) != DTR_OK) return r;
        return dtr__psgd_start(z, b, gb, req);
    }
    return dtr_comm_all_gather_async(z->c, b->send, b->recv, b->bytes, DTR_U8, req);
}

dtr_result dtr__dpc_finish(dtr__dpc *z, int i, float *g, int64_t begin) {
    dtr__cbucket *b = &z->b[i];
    dtr_dtype half = z->kind == DTR_COMPRESS_BF16 ? DTR_BF16 : DTR_F16;
    if (z->kind == DTR_COMPRESS_NONE || !b->send) return DTR_OK;
    if (z->kind == DTR_COMPRESS_POWERSGD) return dtr__psgd_finish(z, b, g + begin, z->resid ? z->resid + begin : NULL);
    if (z->kind == DTR_COMPRESS_BF16 || z->kind == DTR_COMPRESS_FP16)
        return dtr__convert_mem(z->ctx, z->dev, g + begin, DTR_F32, b->send, half, b->n);
    return dtr__dpc_code(z, b, g + begin, NULL, 1);
}
