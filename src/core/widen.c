/* ============================================================================
 * 16-bit activations (dtr_context_config.activation_dtype): the kernels of the op list read
 * and write f32. For a node with a bf16 or fp16 input or output the dispatch
 * (dtr__table_run) widens each such input into f32 scratch from the step arena (inputs that
 * view one storage, as attention's q, k, v view one qkv, together: the span they cover, once),
 * points the tensor at that scratch while the kernel runs, and after a forward rounds the kernel's f32
 * output into the tensor's own storage: one conversion each way, in the backend's memory,
 * through the backend's own CAST kernel, so every backend with a cast kernel takes 16-bit
 * tensors in every op. The arithmetic is the kernel's f32 arithmetic on the rounded inputs,
 * rounded once at the output. Gradients are f32 always; a backward converts only the data its
 * kernel reads (the inputs unless it reads gradients only; the output where it reads it:
 * tanh', softmax's and attention's backward). A backend whose kernels of a family load and
 * store 16-bit values themselves marks that family `narrow` in its table (CUDA's element-wise
 * ops): no widening there; a narrow kernel that leaves some cases to its f32 form (CUDA's
 * linear without 16-bit products) calls dtr__run_widened with that form itself.
 *
 * The scratch is one block of the current tape's data arena, kept for the next widened kernel
 * and grown when one needs more, up to 64 MiB a tape; a larger need gets a block of its own,
 * given back to the tape's spares after the kernel. On a device the stream's order keeps a
 * reuse behind the kernels that read the block; a captured graph's addresses stay its tape's.
 * Kernels do not nest (none runs another through the dispatch), so one block serves them all.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"

/* One tensor pointed at f32 scratch while a kernel runs, and what it was. */
typedef struct dtr__wide {
    dtr_tensor *t;
    void *storage;
    int64_t offset;
    dtr_dtype dtype;
    float *scratch;
    int64_t n;                  /* elements of scratch: the span of t's view */
} dtr__wide;

#define DTR__WIDE_INLINE 8

static int dtr__narrow(const dtr_tensor *t) { return t && (t->dtype == DTR_BF16 || t->dtype == DTR_F16); }

/* ops whose kernels take any float dtype, on every backend: the cast, the checkpoint's copy of
   its region's output, the views (no kernel), contiguous (a byte copy) and cross-entropy (its
   logits, the largest tensor of a language model, read as they are; its output is f32) */
static int dtr__any_dtype_op(int op) {
    return op == DTR_OP_CAST || op == DTR_OP_CHECKPOINT || op == DTR_OP_RESHAPE || op == DTR_OP_PERMUTE ||
           op == DTR_OP_SLICE || op == DTR_OP_CONTIGUOUS || op == DTR_OP_CROSS_ENTROPY;
}

/* ops whose backward kernel reads no tensor data, only gradients, shapes and saved state */
static int dtr__bwd_reads_no_data(int op) {
    return op == DTR_OP_ADD || op == DTR_OP_SUB || op == DTR_OP_SCALE || op == DTR_OP_SUM || op == DTR_OP_MEAN ||
           op == DTR_OP_SUM_ALL || op == DTR_OP_MEAN_ALL || op == DTR_OP_CONCAT || op == DTR_OP_DROPOUT || op == DTR_OP_ROPE ||
           op == DTR_OP_UPSAMPLE;
}

/* ops whose backward kernel reads its output's values (tanh', sigmoid', exp' and sqrt' from y,
   softmax's and attention's backward, the recurrences' earlier steps' h (and c); the
   tensor-parallel ops copy every tensor of the node) */
static int dtr__bwd_reads_out(int op) {
    return op == DTR_OP_TANH || op == DTR_OP_SIGMOID || op == DTR_OP_EXP || op == DTR_OP_SQRT || op == DTR_OP_SOFTMAX ||
           op == DTR_OP_LOG_SOFTMAX || op == DTR_OP_SOFTMAX_CAUSAL || op == DTR_OP_ATTENTION || op == DTR_OP_TP_COPY ||
           op == DTR_OP_TP_REDUCE || op == DTR_OP_TP_GATHER || op == DTR_OP_VOCAB_CROSS_ENTROPY || op == DTR_OP_LSTM ||
           op == DTR_OP_GRU;
}

/* 1 when t is 16-bit and the kernel (forward: bwd 0) reads or writes its values: in[i] (out: -1) */
static int dtr__widens(const dtr__node *n, int i, int bwd) {
    if (i < 0) return dtr__narrow(n->out) && (!bwd || dtr__bwd_reads_out(n->op));
    return dtr__narrow(n->in[i]) && !(bwd && dtr__bwd_reads_no_data(n->op));
}

int dtr__needs_widening(const dtr__node *n, int bwd) {
    int i;
    if (dtr__any_dtype_op(n->op)) return 0;
    for (i = -1; i < n->n_in; i++)
        if (dtr__widens(n, i, bwd)) return 1;
    return 0;
}

/* dst (dd) = src (sd), n dense elements of the backend's memory, by `run` on a CAST node (the
   table's cast kernel, or the backend's forward) */
static dtr_result dtr__cast_by(dtr__kernel run, dtr_context *ctx, void *dst, dtr_dtype dd, const void *src, dtr_dtype sd,
                               int64_t n) {
    dtr_tensor a, b;
    dtr__node c;
    memset(&a, 0, sizeof a);
    a.dtype = sd;
    a.ndim = 1;
    a.shape[0] = n;
    a.stride[0] = 1;
    a.storage = (void *)src;
    a.ctx = ctx;
    a.param_index = -1;
    a.name = "";
    b = a;
    b.dtype = dd;
    b.storage = dst;
    memset(&c, 0, sizeof c);
    c.op = DTR_OP_CAST;
    c.n_in = 1;
    c.in = c.in_inline;
    c.in_inline[0] = &a;
    c.out = &b;
    return n ? run(ctx, &c) : DTR_OK;
}

/* Elements from t's first to its last (strides are never negative). */
static int64_t dtr__view_span(const dtr_tensor *t) {
    int64_t span = 1;
    int d;
    if (dtr_tensor_numel(t) == 0) return 0;
    for (d = 0; d < t->ndim; d++) span += (t->shape[d] - 1) * t->stride[d];
    return span;
}

/* Floats of scratch for t's span, rounded up to 64 (256-byte aligned pieces: vector loads). */
static int64_t dtr__wide_floats(const dtr_tensor *t) { return (dtr__view_span(t) + 63) / 64 * 64; }

/* The most scratch a tape keeps between kernels. A larger need (a language model's logits) gets
 * a block of its own, back to the spares after the kernel: the next allocation of that size
 * (the logits' gradient) takes it, instead of the scratch holding it for the whole step. */
#define DTR__WIDE_KEEP ((size_t)64 << 20)

/* The current tape's scratch of at least `floats`: kept for the next widened kernel, grown
 * (the old block back to the spares) when too small, up to DTR__WIDE_KEEP; beyond that a block
 * of its own (*own 1: give it back after the kernel). NULL with the error set. */
static float *dtr__wide_scratch(dtr_context *ctx, const dtr__node *n, int64_t floats, int *own) {
    dtr_tape *t = ctx->cur;
    size_t bytes = (size_t)(floats ? floats : 64) * sizeof(float);
    *own = 0;
    if (t->wide_bytes >= bytes) return t->wide;
    if (bytes > DTR__WIDE_KEEP) {
        *own = 1;
        return (float *)dtr__arena_data(ctx, bytes, dtr__op_name(n->op));
    }
    if (t->wide) dtr__arena_give_back(ctx, t->wide, t->wide_bytes);
    t->wide_bytes = 0;
    if (!(t->wide = (float *)dtr__arena_data(ctx, bytes, dtr__op_name(n->op)))) return NULL;
    t->wide_bytes = bytes;
    return t->wide;
}

/* Points t at f32 scratch holding elements [lo, lo + n) of its storage (converted when
 * `load`; its view's span at least), recorded in w. */
static dtr_result dtr__widen_one(dtr__kernel cast, dtr_context *ctx, dtr_tensor *t, float *scratch, int64_t lo, int64_t n, int load,
                                 dtr__wide *w) {
    dtr_result r;
    w->t = t;
    w->storage = t->storage;
    w->offset = t->offset;
    w->dtype = t->dtype;
    w->n = n;
    w->scratch = scratch;
    if (load && (r = dtr__cast_by(cast, ctx, scratch, DTR_F32, (char *)t->storage + lo * (int64_t)dtr_dtype_size(t->dtype), t->dtype,
                                  n)) != DTR_OK)
        return r;
    t->storage = scratch;
    t->offset -= lo;
    t->dtype = DTR_F32;
    return DTR_OK;
}

/* t as it was (its f32 result rounded into its storage first when `store`) */
static dtr_result dtr__unwiden(dtr__kernel cast, dtr_context *ctx, dtr__wide *w, int store) {
    dtr_tensor *t = w->t;
    t->storage = w->storage;
    t->offset = w->offset;
    t->dtype = w->dtype;
    if (!store) return DTR_OK;
    return dtr__cast_by(cast, ctx, dtr__data(t), t->dtype, w->scratch, DTR_F32, w->n);
}

/* 1 when in[j] is widened and views `storage` (a widened tensor is f32: not again) */
static int dtr__widens_with(const dtr__node *n, int j, const void *storage, int bwd) {
    return dtr__widens(n, j, bwd) && n->in[j]->storage == storage;
}

/* 1 when in[i] is widened and no input before it is widened with the same storage: an input
   twice, or views of one tensor (attention's q, k, v: the columns of one qkv), are widened
   once, together */
static int dtr__widens_input(const dtr__node *n, int i, int bwd) {
    int j;
    if (!dtr__widens(n, i, bwd)) return 0;
    for (j = 0; j < i; j++)
        if (dtr__widens_with(n, j, n->in[i]->storage, bwd)) return 0;
    return 1;
}

/* The elements [*lo, return) of in[i]'s storage that the widened inputs sharing it span */
static int64_t dtr__wide_range(const dtr__node *n, int i, int bwd, int64_t *lo) {
    int64_t hi = n->in[i]->offset;
    int j;
    *lo = hi;
    for (j = i; j < n->n_in; j++)
        if (dtr__widens_with(n, j, n->in[i]->storage, bwd)) {
            const dtr_tensor *t = n->in[j];
            *lo = t->offset < *lo ? t->offset : *lo;
            hi = t->offset + dtr__view_span(t) > hi ? t->offset + dtr__view_span(t) : hi;
        }
    return hi;
}

/* Widens in[i] and the later inputs sharing its storage into one piece of scratch (records
   from w[*k]); the floats it took */
static dtr_result dtr__widen_group(dtr__kernel cast, dtr_context *ctx, dtr__node *n, int i, int bwd, float *scratch, dtr__wide *w,
                                   int *k, int64_t *took) {
    const void *base = n->in[i]->storage;
    int64_t lo, hi = dtr__wide_range(n, i, bwd, &lo);
    dtr_result r = dtr__widen_one(cast, ctx, n->in[i], scratch, lo, hi - lo, 1, &w[(*k)++]);
    int j;
    for (j = i + 1; r == DTR_OK && j < n->n_in; j++)
        if (dtr__widens_with(n, j, base, bwd))   /* (in[i] again is f32 now) */
            r = dtr__widen_one(cast, ctx, n->in[j], scratch, lo, 0, 0, &w[(*k)++]);
    *took = (hi - lo + 63) / 64 * 64;   /* 256-byte aligned pieces: vector loads */
    return r;
}

dtr_result dtr__run_widened(dtr__kernel cast, dtr__kernel kernel, dtr_context *ctx, dtr__node *n, int bwd) {
    dtr__wide inl[DTR__WIDE_INLINE], *w = inl;
    dtr_result r = DTR_OK, r2;
    int64_t floats = dtr__widens(n, -1, bwd) ? dtr__wide_floats(n->out) : 0, lo, took;
    float *scratch, *block;
    int i, k = 0, out_k = -1, own;
    for (i = 0; i < n->n_in; i++)
        if (dtr__widens_input(n, i, bwd)) floats += (dtr__wide_range(n, i, bwd, &lo) - lo + 63) / 64 * 64;
    if (!(block = scratch = dtr__wide_scratch(ctx, n, floats, &own))) return ctx->status;
    if (n->n_in + 1 > DTR__WIDE_INLINE &&
        !(w = (dtr__wide *)dtr__arena_meta(ctx, (size_t)(n->n_in + 1) * sizeof(*w), dtr__op_name(n->op))))
        return ctx->status;
    for (i = 0; r == DTR_OK && i < n->n_in; i++)
        if (dtr__widens_input(n, i, bwd) && (r = dtr__widen_group(cast, ctx, n, i, bwd, scratch, w, &k, &took)) == DTR_OK)
            scratch += took;   /* (shapes and strides stay the views') */
    if (r == DTR_OK && dtr__widens(n, -1, bwd) &&
        (r = dtr__widen_one(cast, ctx, n->out, scratch, n->out->offset, dtr__view_span(n->out), bwd, &w[k])) == DTR_OK)
        out_k = k++;
    if (r == DTR_OK) r = kernel(ctx, n);
    while (k-- > 0) {   /* in reverse: the output first, rounded after a forward that ran */
        r2 = dtr__unwiden(cast, ctx, &w[k], k == out_k && !bwd && r == DTR_OK);
        if (r == DTR_OK) r = r2;
    }
    if (own) dtr__arena_give_back(ctx, block, (size_t)floats * sizeof(float));
    return r;
}

dtr_result dtr__convert_on(dtr_context *ctx, void *dst, dtr_dtype dd, const void *src, dtr_dtype sd, int64_t n) {
    return dtr__cast_by(ctx->backend->forward, ctx, dst, dd, src, sd, n);
}

dtr_result dtr__convert_mem(dtr_context *ctx, int dev, void *dst, dtr_dtype dd, const void *src, dtr_dtype sd, int64_t n) {
    return dev ? dtr__convert_on(ctx, dst, dd, src, sd, n) : dtr_convert(dst, dd, src, sd, (size_t)n);
}

const float *dtr__f32_view(dtr_context *ctx, const dtr__node *n, const dtr_tensor *t) {
    int64_t count = dtr_tensor_numel(t), floats = (count + 63) / 64 * 64;
    float *scratch;
    int own;
    if (t->dtype == DTR_F32) return dtr__f32(t);
    if (!(scratch = dtr__wide_scratch(ctx, n, floats, &own))) return NULL;
    /* a block of its own goes back at once: the caller reads it before anything is allocated */
    if (own) dtr__arena_give_back(ctx, scratch, (size_t)floats * sizeof(float));
    return dtr__convert_on(ctx, scratch, DTR_F32, dtr__data(t), t->dtype, count) == DTR_OK ? scratch : NULL;
}
