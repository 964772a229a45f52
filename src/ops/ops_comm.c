/* ============================================================================
 * Communication on the tape, for tensor parallelism (Megatron-LM's f and g): the ranks of a
 * group each hold a slice of a layer, and these ops join their partial results.
 *   TP_COPY    forward: y = x (every rank already holds all of x);
 *              backward: gx += all_reduce_sum(gy) (each rank's slice contributed to gy)
 *   TP_REDUCE  forward: y = all_reduce_sum(x) (each rank holds a partial sum);
 *              backward: gx += gy
 *   VOCAB_CROSS_ENTROPY  mean cross-entropy of logits whose last axis (the vocabulary) is split
 *              over the group, rank r holding classes r * K .. (r + 1) * K - 1: the global row
 *              max (all-reduce MAX), sum of exponentials and target logit (one all-reduce SUM);
 *              backward: gx += g / N * (softmax_shard - onehot_shard), no communication.
 *   TP_GATHER  forward: y = every rank's x joined along the last axis, in rank order
 *              (all-gather); backward: gx += this rank's slice of gy
 * Shapes: any; y has x's shape (TP_GATHER: the last axis times the group size). Every rank of the group must build the same ops in the same
 * order (they are collectives). The kernels work on host memory (their scratch too: the
 * context's allocator); on a backend without host memory (CUDA) they run on host images of
 * the tensors (dtr__comm_staged_fwd / _bwd). Over a group of the context's device memory
 * (NCCL) TP_COPY, TP_REDUCE and TP_GATHER run on the device (a device copy, the group's
 * all-reduce or all-gather, strided copies, the backend's sum); the cross-entropy keeps the
 * host images, which the group stages to its device in turn (src/comm/stage.c): correct, not
 * fast.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include "../comm/comm_internal.h"
#include <math.h>

static dtr_tensor *dtr__tp(dtr_context *ctx, int op, const char *name, dtr_tensor *x, dtr_comm *comm) {
    int64_t shape[DTR_MAX_DIMS];
    dtr__node *n;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (!comm) return dtr__failt(ctx, DTR_NULL_HANDLE, "%s: comm is NULL", name);
    if (op == DTR_OP_TP_GATHER && x->ndim < 1) return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "%s: x needs an axis to join", name);
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    n->p.comm = comm;
    memcpy(shape, x->shape, sizeof shape);
    if (op == DTR_OP_TP_GATHER) shape[x->ndim - 1] *= dtr_comm_size(comm);
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), x->ndim, shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_tp_copy(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_COPY, "dtr_tp_copy", x, comm); }
dtr_tensor *dtr_tp_reduce(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_REDUCE, "dtr_tp_reduce", x, comm); }
dtr_tensor *dtr_tp_gather(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_GATHER, "dtr_tp_gather", x, comm); }

dtr_tensor *dtr_vocab_parallel_cross_entropy(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets, dtr_comm *comm) {
    static const char name[] = "dtr_vocab_parallel_cross_entropy";
    dtr__node *n;
    if (!ctx) return NULL;
    if (!comm) return dtr__failt(ctx, DTR_NULL_HANDLE, "%s: comm is NULL", name);
    n = dtr__xent_node(ctx, DTR_OP_VOCAB_CROSS_ENTROPY, name, logits, targets);
    if (!n) return NULL;
    n->p.comm = comm;
    return dtr__record(ctx, n, name);
}

/* in-place reduction over the group, with the group's error on the context */
static dtr_result dtr__tp_all_reduce(dtr_context *ctx, const dtr__node *nd, float *buf, int64_t n, dtr_reduce_op op) {
    dtr_result r = dtr_comm_all_reduce(nd->p.comm, buf, buf, (size_t)n, DTR_F32, op);
    if (r != DTR_OK)
        return dtr__fail(ctx, r, "%s: all-reduce over the group failed: %s", dtr__op_name(nd->op), dtr_comm_last_error(nd->p.comm));
    return DTR_OK;
}

/* ---- vocabulary-parallel cross-entropy ---- */

typedef struct dtr__vxent {
    int64_t K, R, start;       /* classes here, rows, first class here */
    const float *x;
    const int32_t *t;
} dtr__vxent;

static dtr__vxent dtr__vxent_of(const dtr__node *nd) {
    dtr__vxent v;
    v.K = nd->in[0]->shape[nd->in[0]->ndim - 1];
    v.R = v.K ? dtr_tensor_numel(nd->in[0]) / v.K : 0;
    v.start = (int64_t)dtr_comm_rank(nd->p.comm) * v.K;
    v.x = dtr__f32(nd->in[0]);
    v.t = dtr__i32(nd->in[1]);
    return v;
}

/* the bytes VOCAB_CROSS_ENTROPY saves (0 for the rest of the family) */
static size_t dtr__comm_saved_bytes(const dtr__node *nd) {
    return nd->op == DTR_OP_VOCAB_CROSS_ENTROPY ? (size_t)(3 * dtr__vxent_of(nd).R + 1) * sizeof(float) : 0;
}

/* saved: the rows' global max M, sum of exp(x - M) Z and target logit T, R floats each (a
   block given in nd->saved, or the node's) */
static dtr_result dtr__vxent_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__vxent v = dtr__vxent_of(nd);
    int64_t V = v.K * dtr_comm_size(nd->p.comm), r, k;
    float *M, *Z, *T;
    double loss = 0.0;
    dtr_result res;
    for (r = 0; r < v.R; r++)
        if (v.t[r] < 0 || v.t[r] >= V)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_vocab_parallel_cross_entropy: target %lld is %d, outside [0, %lld)",
                             (long long)r, (int)v.t[r], (long long)V);
    M = nd->saved ? (float *)nd->saved : (float *)dtr__node_save(ctx, nd, dtr__comm_saved_bytes(nd));
    if (!M) return ctx->status;
    nd->saved = M, Z = M + v.R, T = Z + v.R;
    for (r = 0; r < v.R; r++)
        for (M[r] = -INFINITY, k = 0; k < v.K; k++) M[r] = v.x[r * v.K + k] > M[r] ? v.x[r * v.K + k] : M[r];
    if ((res = dtr__tp_all_reduce(ctx, nd, M, v.R, DTR_REDUCE_MAX)) != DTR_OK) return res;
    for (r = 0; r < v.R; r++) {
        double s = 0.0;
        int64_t own = v.t[r] - v.start;
        for (k = 0; k < v.K; k++) s += expf(v.x[r * v.K + k] - M[r]);
        Z[r] = (float)s;
        T[r] = own >= 0 && own < v.K ? v.x[r * v.K + own] : 0.0f;
    }
    if ((res = dtr__tp_all_reduce(ctx, nd, Z, 2 * v.R, DTR_REDUCE_SUM)) != DTR_OK) return res;
    for (r = 0; r < v.R; r++) loss += (double)M[r] + log((double)Z[r]) - T[r];
    dtr__f32(nd->out)[0] = v.R ? (float)(loss / (double)v.R) : 0.0f;
    return DTR_OK;
}

static dtr_result dtr__vxent_bwd(dtr__node *nd) {
    dtr__vxent v = dtr__vxent_of(nd);
    const float *M = (const float *)nd->saved, *Z = M + v.R;
    float *gx = dtr__gradof(nd->in[0]), c;
    int64_t r, k;
    if (!gx || !v.R) return DTR_OK;
    c = nd->out->grad[0] / (float)v.R;
    for (r = 0; r < v.R; r++) {
        int64_t own = v.t[r] - v.start;
        for (k = 0; k < v.K; k++) gx[r * v.K + k] += c * (expf(v.x[r * v.K + k] - M[r]) / Z[r]);
        if (own >= 0 && own < v.K) gx[r * v.K + own] -= c;
    }
    return DTR_OK;
}

/* ---- all-gather along the last axis ---- */

/* rows of width w: rank k's row r lands at y[r * N * w + k * w] */
static dtr_result dtr__gather_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x), w = x->shape[x->ndim - 1], r, N = dtr_comm_size(nd->p.comm), k;
    float *buf = (float *)dtr__malloc(&ctx->alloc, (size_t)(n * N + 1) * sizeof(float)), *y = dtr__f32(nd->out);
    dtr_result res;
    if (!buf) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_tp_gather: out of memory");
    res = dtr_comm_all_gather(nd->p.comm, dtr__f32(x), buf, (size_t)n, DTR_F32);
    for (k = 0; res == DTR_OK && w && k < N; k++)
        for (r = 0; r < n / w; r++) memcpy(y + (r * N + k) * w, buf + k * n + r * w, (size_t)w * sizeof(float));
    dtr__free(&ctx->alloc, buf);
    if (res != DTR_OK)
        return dtr__fail(ctx, res, "dtr_tp_gather: all-gather over the group failed: %s", dtr_comm_last_error(nd->p.comm));
    return DTR_OK;
}

static dtr_result dtr__gather_bwd(dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x), w = x->shape[x->ndim - 1], N = dtr_comm_size(nd->p.comm), i;
    const float *g = nd->out->grad + (int64_t)dtr_comm_rank(nd->p.comm) * w;
    float *gx = dtr__gradof(x);
    if (gx && w)
        for (i = 0; i < n; i++) gx[i] += g[i / w * N * w + i % w];
    return DTR_OK;
}

/* ---- the family's kernels ---- */

dtr_result dtr__cpu_comm_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    if (nd->op == DTR_OP_VOCAB_CROSS_ENTROPY) return dtr__vxent_fwd(ctx, nd);
    if (nd->op == DTR_OP_TP_GATHER) return dtr__gather_fwd(ctx, nd);
    memcpy(dtr__f32(nd->out), dtr__f32(nd->in[0]), (size_t)n * sizeof(float));
    return nd->op == DTR_OP_TP_REDUCE ? dtr__tp_all_reduce(ctx, nd, dtr__f32(nd->out), n, DTR_REDUCE_SUM) : DTR_OK;
}

dtr_result dtr__cpu_comm_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t i, n = dtr_tensor_numel(nd->out);
    float *gx = dtr__gradof(nd->in[0]), *g = nd->out->grad, *sum;
    dtr_result r;
    if (nd->op == DTR_OP_VOCAB_CROSS_ENTROPY) return dtr__vxent_bwd(nd);
    if (nd->op == DTR_OP_TP_GATHER) return dtr__gather_bwd(nd);
    if (nd->op == DTR_OP_TP_REDUCE) {
        if (gx) for (i = 0; i < n; i++) gx[i] += g[i];
        return DTR_OK;
    }
    /* every rank takes part in the all-reduce, whether or not its x needs a gradient */
    sum = (float *)dtr__malloc(&ctx->alloc, (size_t)(n ? n : 1) * sizeof(float));
    if (!sum) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_tp_copy backward: out of memory");
    memcpy(sum, g, (size_t)n * sizeof(float));
    r = dtr__tp_all_reduce(ctx, nd, sum, n, DTR_REDUCE_SUM);
    if (r == DTR_OK && gx) for (i = 0; i < n; i++) gx[i] += sum[i];
    dtr__free(&ctx->alloc, sum);
    return r;
}

/* ---- on a backend without host memory: the kernels above on host images ---- */

/* A node's copy whose tensors have host storage: x (and the targets), the output, their
   gradients and the saved block, each an image of the real one in `block`. */
typedef struct dtr__comm_images {
    dtr__node n;
    dtr_tensor in[2], out;
    char *block;
} dtr__comm_images;

/* host image of `bytes` at *at, filled from device memory `dev` unless dev is NULL */
static void *dtr__comm_image(dtr_context *ctx, char **at, const void *dev, size_t bytes, dtr_result *r) {
    void *p = *at;
    *at += (bytes + 15) / 16 * 16;
    if (dev && bytes && *r == DTR_OK) *r = ctx->backend->to_host(ctx, p, dev, bytes);
    return p;
}

static size_t dtr__comm_images_bytes(const dtr__node *nd) {
    size_t b = dtr__comm_saved_bytes(nd) + 64;
    int i;
    for (i = 0; i < nd->n_in; i++) b += 2 * ((size_t)dtr_tensor_numel(nd->in[i]) * sizeof(float) + 16);
    return b + 2 * ((size_t)dtr_tensor_numel(nd->out) * sizeof(float) + 16);
}

/* fills im: every tensor the kernel reads, downloaded; what it writes, room for */
static dtr_result dtr__comm_images_make(dtr_context *ctx, const dtr__node *nd, int bwd, dtr__comm_images *im) {
    size_t ob = (size_t)dtr_tensor_numel(nd->out) * sizeof(float), sb = dtr__comm_saved_bytes(nd);
    int reads_x = !bwd || nd->op == DTR_OP_VOCAB_CROSS_ENTROPY;   /* the backward of the others needs x's shape only */
    dtr_result r = DTR_OK;
    char *at;
    int i;
    im->block = NULL;
    if (nd->p.comm && !dtr__comm_takes_host(nd->p.comm))   /* a device transport that takes no host image */
        return dtr__fail(ctx, DTR_UNSUPPORTED, "%s: the group's transport (%s) takes device memory only and its "
                         "context's backend cannot stage host buffers (no `owns` slot)", dtr__op_name(nd->op),
                         dtr_comm_transport_name(nd->p.comm));
    im->block = at = (char *)dtr__malloc(&ctx->alloc, dtr__comm_images_bytes(nd));
    if (!at) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "%s: out of memory for host images", dtr__op_name(nd->op));
    im->n = *nd;
    im->n.in = im->n.in_inline;
    for (i = 0; i < nd->n_in && i < 2; i++) {
        const dtr_tensor *x = nd->in[i];
        size_t bytes = (size_t)dtr_tensor_numel(x) * dtr_dtype_size(x->dtype);
        im->in[i] = *x, im->in[i].offset = 0, im->n.in[i] = &im->in[i];
        im->in[i].storage = dtr__comm_image(ctx, &at, reads_x ? dtr__data(x) : NULL, bytes, &r);
        im->in[i].grad = bwd && dtr__gradof(x) ? (float *)dtr__comm_image(ctx, &at, x->grad, bytes, &r) : NULL;
    }
    im->out = *nd->out, im->n.out = &im->out;
    im->out.storage = dtr__comm_image(ctx, &at, NULL, ob, &r);
    im->out.grad = bwd ? (float *)dtr__comm_image(ctx, &at, nd->out->grad, ob, &r) : NULL;
    im->n.saved = sb ? dtr__comm_image(ctx, &at, bwd ? nd->saved : NULL, sb, &r) : NULL;
    return r;
}

/* ---- over a group of the context's own device memory (NCCL): copy and reduce on the device ---- */

static int dtr__comm_direct(const dtr_context *ctx, const dtr__node *nd) {
    return nd->p.comm && nd->p.comm->mem_ctx == ctx &&
           (nd->op == DTR_OP_TP_COPY || nd->op == DTR_OP_TP_REDUCE || nd->op == DTR_OP_TP_GATHER);
}

/* TP_GATHER: the group's all-gather of x into a scratch block (rank k's x at k * n), then rank
   k's rows of width w to columns k * w .. of y's rows (one strided copy per rank) */
static dtr_result dtr__gather_direct_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x), w = x->shape[x->ndim - 1], N = dtr_comm_size(nd->p.comm), k;
    float *buf = (float *)dtr__arena_data(ctx, (size_t)(n * N + 1) * sizeof(float), "dtr_tp_gather"), *y = dtr__f32(nd->out);
    size_t ws = (size_t)w * sizeof(float);
    dtr_result r = buf ? dtr_comm_all_gather(nd->p.comm, dtr__f32(x), buf, (size_t)n, DTR_F32) : ctx->status;
    if (buf && r != DTR_OK)
        return dtr__fail(ctx, r, "dtr_tp_gather: all-gather over the group failed: %s", dtr_comm_last_error(nd->p.comm));
    for (k = 0; r == DTR_OK && w && k < N; k++) r = dtr__mem_copy2d(ctx, y + k * w, (size_t)N * ws, buf + k * n, ws, ws, (size_t)(n / w));
    return r;
}

/* TP_GATHER: gx += this rank's columns of gy, gathered into a dense block first */
static dtr_result dtr__gather_direct_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x), w = x->shape[x->ndim - 1], N = dtr_comm_size(nd->p.comm);
    float *gx = dtr__gradof(x), *slice;
    size_t ws = (size_t)w * sizeof(float);
    dtr_result r;
    if (!gx || !w || !n) return DTR_OK;
    if (!(slice = (float *)dtr__arena_data(ctx, (size_t)n * sizeof(float), "dtr_tp_gather backward"))) return ctx->status;
    r = dtr__mem_copy2d(ctx, slice, ws, nd->out->grad + (int64_t)dtr_comm_rank(nd->p.comm) * w, (size_t)N * ws, ws, (size_t)(n / w));
    return r == DTR_OK ? ctx->backend->reduce(ctx, gx, gx, slice, (size_t)n, DTR_F32, DTR_REDUCE_SUM, 1) : r;
}

/* out = in, then (TP_REDUCE) the group's sum in place; TP_GATHER above */
static dtr_result dtr__comm_direct_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    dtr_result r;
    if (nd->op == DTR_OP_TP_GATHER) return dtr__gather_direct_fwd(ctx, nd);
    r = dtr__mem_copy(ctx, dtr__data(nd->out), dtr__data(nd->in[0]), (size_t)n * sizeof(float));
    if (r == DTR_OK && nd->op == DTR_OP_TP_REDUCE) r = dtr__tp_all_reduce(ctx, nd, dtr__f32(nd->out), n, DTR_REDUCE_SUM);
    return r;
}

/* gx += g (TP_REDUCE), or gx += the group's sum of g (TP_COPY: every rank takes part) */
static dtr_result dtr__comm_direct_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    float *gx = dtr__gradof(nd->in[0]), *g = nd->out->grad;
    dtr_result r = DTR_OK;
    if (nd->op == DTR_OP_TP_GATHER) return dtr__gather_direct_bwd(ctx, nd);
    if (nd->op == DTR_OP_TP_COPY) {
        float *sum = (float *)dtr__arena_data(ctx, (size_t)(n ? n : 1) * sizeof(float), "dtr_tp_copy backward");
        if (!sum) return ctx->status;
        r = dtr__mem_copy(ctx, sum, g, (size_t)n * sizeof(float));
        if (r == DTR_OK) r = dtr__tp_all_reduce(ctx, nd, sum, n, DTR_REDUCE_SUM);
        g = sum;
    }
    if (r == DTR_OK && gx && n) r = ctx->backend->reduce(ctx, gx, gx, g, (size_t)n, DTR_F32, DTR_REDUCE_SUM, 1);
    return r;
}

dtr_result dtr__comm_staged_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__comm_images im;
    size_t sb = dtr__comm_saved_bytes(nd), ob = (size_t)dtr_tensor_numel(nd->out) * sizeof(float);
    dtr_result r;
    if (dtr__comm_direct(ctx, nd)) return dtr__comm_direct_fwd(ctx, nd);
    r = dtr__comm_images_make(ctx, nd, 0, &im);
    if (r == DTR_OK) r = dtr__cpu_comm_fwd(ctx, &im.n);
    if (r == DTR_OK) r = ctx->backend->from_host(ctx, dtr__data(nd->out), im.out.storage, ob);
    if (r == DTR_OK && sb && !(nd->saved = dtr__node_save(ctx, nd, sb))) r = ctx->status;
    if (r == DTR_OK && sb) r = ctx->backend->from_host(ctx, nd->saved, im.n.saved, sb);
    dtr__free(&ctx->alloc, im.block);
    return r;
}

dtr_result dtr__comm_staged_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__comm_images im;
    dtr_result r;
    if (dtr__comm_direct(ctx, nd)) return dtr__comm_direct_bwd(ctx, nd);
    r = dtr__comm_images_make(ctx, nd, 1, &im);
    if (r == DTR_OK) r = dtr__cpu_comm_bwd(ctx, &im.n);
    if (r == DTR_OK && im.in[0].grad)
        r = ctx->backend->from_host(ctx, nd->in[0]->grad, im.in[0].grad, (size_t)dtr_tensor_numel(nd->in[0]) * sizeof(float));
    dtr__free(&ctx->alloc, im.block);
    return r;
}
