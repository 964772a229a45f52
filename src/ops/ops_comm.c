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
 * (NCCL) they run on the device: TP_COPY, TP_REDUCE and TP_GATHER by a device copy, the
 * group's all-reduce or all-gather, strided copies and the backend's sum; the cross-entropy's
 * local work (row maxima, sums, the loss, the gradient) by the backend's vocab_xent, the
 * group's all-reduces of 3 floats a row between, so the logits never leave the device (a
 * backend without vocab_xent: host images, which the group stages to its device in turn).
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
    n->p.comm.group = comm;
    memcpy(shape, x->shape, sizeof shape);
    if (op == DTR_OP_TP_GATHER) shape[x->ndim - 1] *= dtr_comm_size(comm);
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), x->ndim, shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_tp_copy(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_COPY, "dtr_tp_copy", x, comm); }
dtr_tensor *dtr_tp_reduce(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_REDUCE, "dtr_tp_reduce", x, comm); }
dtr_tensor *dtr_tp_gather(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_GATHER, "dtr_tp_gather", x, comm); }

dtr_tensor *dtr_vocab_parallel_cross_entropy_ex(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets, dtr_comm *comm,
                                                 const dtr_xent_config *cfg) {
    static const char name[] = "dtr_vocab_parallel_cross_entropy";
    dtr_xent_config c = cfg ? *cfg : dtr_xent_config_init();
    dtr__node *n;
    if (!ctx) return NULL;
    if (!comm) return dtr__failt(ctx, DTR_NULL_HANDLE, "%s: comm is NULL", name);
    if (!(c.label_smoothing >= 0.0f && c.label_smoothing < 1.0f) || c.reduction < DTR_LOSS_MEAN || c.reduction > DTR_LOSS_NONE)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: label smoothing %g must be in [0, 1) and the reduction (%d) mean, sum or none",
                          name, (double)c.label_smoothing, (int)c.reduction);
    n = dtr__xent_node(ctx, DTR_OP_VOCAB_CROSS_ENTROPY, name, logits, targets);
    if (!n) return NULL;
    n->p.comm.group = comm;
    n->p.comm.xent.ignore_index = c.ignore_index, n->p.comm.xent.smoothing = c.label_smoothing, n->p.comm.xent.reduction = (int)c.reduction;
    if (c.reduction == DTR_LOSS_NONE &&   /* each row's loss, in the targets' shape */
        !(n->out = dtr__tensor_alloc(ctx, DTR_F32, n->in[1]->ndim, n->in[1]->shape, name)))
        return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_vocab_parallel_cross_entropy(dtr_context *ctx, dtr_tensor *logits, dtr_tensor *targets, dtr_comm *comm) {
    return dtr_vocab_parallel_cross_entropy_ex(ctx, logits, targets, comm, NULL);
}

/* in-place reduction over the group, with the group's error on the context */
static dtr_result dtr__tp_all_reduce(dtr_context *ctx, const dtr__node *nd, float *buf, int64_t n, dtr_reduce_op op) {
    dtr_result r = dtr_comm_all_reduce(nd->p.comm.group, buf, buf, (size_t)n, DTR_F32, op);
    if (r != DTR_OK)
        return dtr__fail(ctx, r, "%s: all-reduce over the group failed: %s", dtr__op_name(nd->op), dtr_comm_last_error(nd->p.comm.group));
    return DTR_OK;
}

/* ---- vocabulary-parallel cross-entropy ---- */

typedef dtr_result (*dtr__vxent_fn)(dtr_context *ctx, const dtr__vxent_args *a, int phase);

/* the node's shapes and tensors (s, y, g, gx unset) */
static dtr__vxent_args dtr__vxent_of(const dtr__node *nd) {
    dtr__vxent_args a;
    memset(&a, 0, sizeof a);
    a.K = nd->in[0]->shape[nd->in[0]->ndim - 1];
    a.R = a.K ? dtr_tensor_numel(nd->in[0]) / a.K : 0;
    a.V = a.K * dtr_comm_size(nd->p.comm.group);
    a.start = (int64_t)dtr_comm_rank(nd->p.comm.group) * a.K;
    a.x = dtr__f32(nd->in[0]);
    a.t = dtr__i32(nd->in[1]);
    a.p = nd->p.comm.xent;
    return a;
}

/* the bytes VOCAB_CROSS_ENTROPY saves (0 for the rest of the family): M, Z, T, S and D */
static size_t dtr__comm_saved_bytes(const dtr__node *nd) {
    return nd->op == DTR_OP_VOCAB_CROSS_ENTROPY ? (size_t)(4 * dtr__vxent_of(nd).R + 1) * sizeof(float) : 0;
}

static dtr_result dtr__vxent_max(dtr_context *ctx, const dtr__vxent_args *a) {
    float *M = a->s;
    int64_t r;
    for (r = 0; r < a->R; r++)
        if (a->t[r] != a->p.ignore_index && (a->t[r] < 0 || a->t[r] >= a->V))
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_vocab_parallel_cross_entropy: target %lld is %d, outside [0, %lld)",
                             (long long)r, (int)a->t[r], (long long)a->V);
    for (r = 0; r < a->R; r++)
        M[r] = dtr__max_f32(a->x + r * a->K, a->K, -INFINITY, 0);
    return DTR_OK;
}

static void dtr__vxent_sums(const dtr__vxent_args *a) {
    const float *M = a->s;
    float *Z = a->s + a->R, *T = Z + a->R, *S = T + a->R;
    int64_t r, k;
    for (r = 0; r < a->R; r++) {
        double s = 0.0, sx = 0.0;
        int64_t own = a->t[r] - a->start;
        for (k = 0; k < a->K; k++) s += dtr__f_xent_term(a->x[r * a->K + k], M[r]);
        for (k = 0; a->p.smoothing > 0.0f && k < a->K; k++) sx += a->x[r * a->K + k];
        Z[r] = (float)s, S[r] = (float)sx;
        T[r] = own >= 0 && own < a->K ? a->x[r * a->K + own] : 0.0f;
    }
}

static void dtr__vxent_grad(const dtr__vxent_args *a) {
    const float *M = a->s, *Z = M + a->R, *D = Z + 3 * a->R;
    float eps = a->p.smoothing;
    int64_t r, k;
    for (r = 0; r < a->R; r++) {
        int64_t own = a->t[r] - a->start;
        float c = a->p.reduction == DTR_LOSS_NONE ? a->g[r] : a->g[0] / D[0], d = c * eps / (float)a->V;
        if (a->t[r] == a->p.ignore_index) continue;
        for (k = 0; k < a->K; k++) a->gx[r * a->K + k] += c * (dtr__f_xent_term(a->x[r * a->K + k], M[r]) / Z[r]) - d;
        if (own >= 0 && own < a->K) a->gx[r * a->K + own] -= c * (1.0f - eps);
    }
}

/* LOSS: each row's loss (an ignored row's 0), then their mean, sum or each, and the divisor */
static void dtr__vxent_loss(const dtr__vxent_args *a) {
    const float *M = a->s, *Z = M + a->R, *T = Z + a->R, *S = T + a->R;
    float *D = a->s + 4 * a->R;
    double loss = 0.0, l;
    int64_t r, kept = 0;
    for (r = 0; r < a->R; r++) {
        if (a->t[r] == a->p.ignore_index) {
            if (a->p.reduction == DTR_LOSS_NONE) a->y[r] = 0.0f;
            continue;
        }
        l = dtr__f_xent_loss(M[r], (double)Z[r], T[r], (double)S[r] / (double)a->V, a->p.smoothing);
        if (a->p.reduction == DTR_LOSS_NONE) a->y[r] = (float)l;
        loss += l, kept++;
    }
    D[0] = a->p.reduction == DTR_LOSS_MEAN ? (float)kept : 1.0f;
    if (a->p.reduction != DTR_LOSS_NONE) a->y[0] = kept ? (float)(loss / (double)D[0]) : 0.0f;
}

dtr_result dtr__cpu_vocab_xent(dtr_context *ctx, const dtr__vxent_args *a, int phase) {
    if (phase == DTR__VXENT_MAX) return dtr__vxent_max(ctx, a);
    if (phase == DTR__VXENT_SUMS) dtr__vxent_sums(a);
    if (phase == DTR__VXENT_GRAD && a->gx && a->R) dtr__vxent_grad(a);
    if (phase == DTR__VXENT_LOSS) dtr__vxent_loss(a);
    return DTR_OK;
}

/* saved: the rows' global max M, sum of exp(x - M) Z, target logit T and logit sum S, R floats
   each, and the loss's divisor (a block given in nd->saved, or the node's); the local work by kernel k (the CPU's on host
   memory, the backend's vocab_xent on its own), the group's all-reduces between */
static dtr_result dtr__vxent_fwd(dtr_context *ctx, dtr__node *nd, dtr__vxent_fn k) {
    dtr__vxent_args a = dtr__vxent_of(nd);
    dtr_result r;
    a.s = nd->saved ? (float *)nd->saved : (float *)dtr__node_save(ctx, nd, dtr__comm_saved_bytes(nd));
    if (!a.s) return ctx->status;
    nd->saved = a.s, a.y = dtr__f32(nd->out);
    if ((r = k(ctx, &a, DTR__VXENT_MAX)) != DTR_OK || (r = dtr__tp_all_reduce(ctx, nd, a.s, a.R, DTR_REDUCE_MAX)) != DTR_OK ||
        (r = k(ctx, &a, DTR__VXENT_SUMS)) != DTR_OK || (r = dtr__tp_all_reduce(ctx, nd, a.s + a.R, 3 * a.R, DTR_REDUCE_SUM)) != DTR_OK)
        return r;
    return k(ctx, &a, DTR__VXENT_LOSS);
}

static dtr_result dtr__vxent_bwd(dtr_context *ctx, dtr__node *nd, dtr__vxent_fn k) {
    dtr__vxent_args a = dtr__vxent_of(nd);
    a.s = (float *)nd->saved, a.g = nd->out->grad, a.gx = dtr__gradof(nd->in[0]);
    return a.gx && a.R ? k(ctx, &a, DTR__VXENT_GRAD) : DTR_OK;
}

/* ---- all-gather along the last axis ---- */

/* rows of width w: rank k's row r lands at y[r * N * w + k * w] */
static dtr_result dtr__gather_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x), w = x->shape[x->ndim - 1], r, N = dtr_comm_size(nd->p.comm.group), k;
    float *buf = (float *)dtr__malloc(&ctx->alloc, (size_t)(n * N + 1) * sizeof(float)), *y = dtr__f32(nd->out);
    dtr_result res;
    if (!buf) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_tp_gather: out of memory");
    res = dtr_comm_all_gather(nd->p.comm.group, dtr__f32(x), buf, (size_t)n, DTR_F32);
    for (k = 0; res == DTR_OK && w && k < N; k++)
        for (r = 0; r < n / w; r++) memcpy(y + (r * N + k) * w, buf + k * n + r * w, (size_t)w * sizeof(float));
    dtr__free(&ctx->alloc, buf);
    if (res != DTR_OK)
        return dtr__fail(ctx, res, "dtr_tp_gather: all-gather over the group failed: %s", dtr_comm_last_error(nd->p.comm.group));
    return DTR_OK;
}

static dtr_result dtr__gather_bwd(dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x), w = x->shape[x->ndim - 1], N = dtr_comm_size(nd->p.comm.group), i;
    const float *g = nd->out->grad + (int64_t)dtr_comm_rank(nd->p.comm.group) * w;
    float *gx = dtr__gradof(x);
    if (gx && w)
        for (i = 0; i < n; i++) gx[i] += g[i / w * N * w + i % w];
    return DTR_OK;
}

/* ---- the family's kernels ---- */

dtr_result dtr__cpu_comm_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    if (nd->op == DTR_OP_VOCAB_CROSS_ENTROPY) return dtr__vxent_fwd(ctx, nd, dtr__cpu_vocab_xent);
    if (nd->op == DTR_OP_TP_GATHER) return dtr__gather_fwd(ctx, nd);
    memcpy(dtr__f32(nd->out), dtr__f32(nd->in[0]), (size_t)n * sizeof(float));
    return nd->op == DTR_OP_TP_REDUCE ? dtr__tp_all_reduce(ctx, nd, dtr__f32(nd->out), n, DTR_REDUCE_SUM) : DTR_OK;
}

dtr_result dtr__cpu_comm_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t i, n = dtr_tensor_numel(nd->out);
    float *gx = dtr__gradof(nd->in[0]), *g = nd->out->grad, *sum;
    dtr_result r;
    if (nd->op == DTR_OP_VOCAB_CROSS_ENTROPY) return dtr__vxent_bwd(ctx, nd, dtr__cpu_vocab_xent);
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
    if (nd->p.comm.group && !dtr__comm_takes_host(nd->p.comm.group))   /* a device transport that takes no host image */
        return dtr__fail(ctx, DTR_UNSUPPORTED, "%s: the group's transport (%s) takes device memory only and its "
                         "context's backend cannot stage host buffers (no `owns` slot)", dtr__op_name(nd->op),
                         dtr_comm_transport_name(nd->p.comm.group));
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

/* ---- over a group of the context's own device memory (NCCL): copy and reduce on the device,
   the cross-entropy's local work by the backend's vocab_xent ---- */

static int dtr__comm_direct(const dtr_context *ctx, const dtr__node *nd) {
    return nd->p.comm.group && nd->p.comm.group->mem_ctx == ctx &&
           (nd->op != DTR_OP_VOCAB_CROSS_ENTROPY || ctx->backend->vocab_xent);
}

/* TP_GATHER: the group's all-gather of x into a scratch block (rank k's x at k * n), then rank
   k's rows of width w to columns k * w .. of y's rows (one strided copy per rank) */
static dtr_result dtr__gather_direct_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x), w = x->shape[x->ndim - 1], N = dtr_comm_size(nd->p.comm.group), k;
    float *buf = (float *)dtr__arena_data(ctx, (size_t)(n * N + 1) * sizeof(float), "dtr_tp_gather"), *y = dtr__f32(nd->out);
    size_t ws = (size_t)w * sizeof(float);
    dtr_result r = buf ? dtr_comm_all_gather(nd->p.comm.group, dtr__f32(x), buf, (size_t)n, DTR_F32) : ctx->status;
    if (buf && r != DTR_OK)
        return dtr__fail(ctx, r, "dtr_tp_gather: all-gather over the group failed: %s", dtr_comm_last_error(nd->p.comm.group));
    for (k = 0; r == DTR_OK && w && k < N; k++) r = dtr__mem_copy2d(ctx, y + k * w, (size_t)N * ws, buf + k * n, ws, ws, (size_t)(n / w));
    return r;
}

/* TP_GATHER: gx += this rank's columns of gy, gathered into a dense block first */
static dtr_result dtr__gather_direct_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x), w = x->shape[x->ndim - 1], N = dtr_comm_size(nd->p.comm.group);
    float *gx = dtr__gradof(x), *slice;
    size_t ws = (size_t)w * sizeof(float);
    dtr_result r;
    if (!gx || !w || !n) return DTR_OK;
    if (!(slice = (float *)dtr__arena_data(ctx, (size_t)n * sizeof(float), "dtr_tp_gather backward"))) return ctx->status;
    r = dtr__mem_copy2d(ctx, slice, ws, nd->out->grad + (int64_t)dtr_comm_rank(nd->p.comm.group) * w, (size_t)N * ws, ws, (size_t)(n / w));
    return r == DTR_OK ? ctx->backend->reduce(ctx, gx, gx, slice, (size_t)n, DTR_F32, DTR_REDUCE_SUM, 1) : r;
}

/* out = in, then (TP_REDUCE) the group's sum in place; TP_GATHER above */
static dtr_result dtr__comm_direct_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    dtr_result r;
    if (nd->op == DTR_OP_TP_GATHER) return dtr__gather_direct_fwd(ctx, nd);
    if (nd->op == DTR_OP_VOCAB_CROSS_ENTROPY) return dtr__vxent_fwd(ctx, nd, ctx->backend->vocab_xent);
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
    if (nd->op == DTR_OP_VOCAB_CROSS_ENTROPY) return dtr__vxent_bwd(ctx, nd, ctx->backend->vocab_xent);
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
