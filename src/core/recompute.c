/* ============================================================================
 * Activation checkpointing (dtr_checkpoint): a region of the forward runs on a tape of its
 * own, which is emptied as soon as the region's output is copied out; the region is
 * recorded as one CHECKPOINT node whose backward runs the region again (same inputs, same
 * random stream, same training mode) and replays it inside the current backward pass.
 *
 *   forward   in -> fn on ctx->recompute[depth] -> y (dense) -> copied into out (current tape)
 *             The node's inputs: the explicit inputs, then every tensor from outside the
 *             region that a node of the region read and that needs a gradient (parameters,
 *             tensors fn reached through its user pointer). So the outer pass makes their
 *             gradients before the node runs, and gradient hooks count the node as a writer
 *             of each parameter: they report it after the node, not inside it.
 *   backward  fn again -> y'; y'.grad is out.grad for this pass (no copy); the region's
 *             nodes replay with the pass's number and without hook reports; the tape is
 *             emptied again.
 * Each nesting level has its own tape, made on first use and kept (empty) for the next
 * step, so a steady step allocates nothing.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "internal.h"

#define DTR__CHECKPOINT_MAX_INPUTS 64

/* ---- the region's tape ---- */

typedef struct dtr__region {
    dtr_tape *outer, *tape;
    int grad_enabled;
} dtr__region;

/* Makes the tape of the next nesting level current, with gradient recording on. */
static dtr_result dtr__region_begin(dtr_context *ctx, dtr__region *g) {
    dtr_tape **slot;
    dtr_result r;
    if (ctx->recompute_depth >= DTR__MAX_RECOMPUTE_DEPTH)
        return dtr__fail(ctx, DTR_BAD_STATE, "dtr_checkpoint: regions nested deeper than %d", DTR__MAX_RECOMPUTE_DEPTH);
    slot = &ctx->recompute[ctx->recompute_depth];
    if (!*slot && (r = dtr_tape_create(ctx, slot)) != DTR_OK) return r;
    g->outer = ctx->cur;
    g->tape = *slot;
    g->grad_enabled = ctx->grad_enabled;
    ctx->cur = g->tape;
    ctx->grad_enabled = 1;
    ctx->recompute_depth++;
    return DTR_OK;
}

/* Drops everything the region recorded and makes the outer tape current again. */
static void dtr__region_end(dtr_context *ctx, const dtr__region *g) {
    dtr_tape_reset(g->tape);
    ctx->cur = g->outer;
    ctx->grad_enabled = g->grad_enabled;
    ctx->recompute_depth--;
}

/* 1 when x was computed by a node of tape t. */
static int dtr__inside(const dtr_tape *t, const dtr_tensor *x) { return x->node && x->node->tape == t; }

/* 1 when x needs a gradient and comes from outside tape t (a parameter, an outer tensor). */
static int dtr__from_outside(const dtr_tape *t, const dtr_tensor *x) {
    return x && (x->flags & DTR__REQUIRES_GRAD) && !dtr__inside(t, x);
}

/* fn's output, or NULL with the context's error set. */
static dtr_tensor *dtr__call(dtr_context *ctx, const dtr__checkpoint_params *p, dtr_tensor *const *in) {
    dtr_tensor *y = p->fn(p->user, ctx, in);
    if (ctx->status != DTR_OK) return NULL;
    if (!y) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: fn returned NULL without setting an error");
    if (y->ctx != ctx) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: fn returned a tensor of another context");
    return y;
}

/* fn's output on the region's (current) tape, made dense; NULL with the error set. */
static dtr_tensor *dtr__region_run(dtr_context *ctx, const dtr__checkpoint_params *p, dtr_tensor *const *in) {
    dtr_tensor *y = dtr__call(ctx, p, in);
    if (!y) return NULL;
    if (dtr__from_outside(ctx->cur, y))
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: fn returned '%s', a tensor it did not compute "
                          "(an input or a parameter); return the result of an op", y->name);
    return dtr__contig_input(ctx, y);
}

/* ---- forward ---- */

/* Appends x, an input of a node of the region, to list[0 .. *n) when it comes from outside
 * the region and needs a gradient, unless it is there already. 0 with the error set when x
 * was made inside the region without a node (a leaf would not outlive it). */
static int dtr__capture(dtr_context *ctx, dtr_tensor **list, int *n, dtr_tensor *x) {
    int i;
    if (!dtr__from_outside(ctx->cur, x)) return 1;
    if (dtr__tape_owns(ctx->cur, x))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: fn made '%s' require a gradient inside the region; "
                         "make it outside and pass it in", x->name), 0;
    for (i = 0; i < *n; i++)
        if (list[i] == x) return 1;
    list[(*n)++] = x;
    return 1;
}

/* The CHECKPOINT node's inputs: the explicit ones, then each tensor from outside the region
 * that a node of the region read and that needs a gradient. In the region tape's memory. */
static dtr_tensor **dtr__region_inputs(dtr_context *ctx, int n_in, dtr_tensor *const *in, int *count) {
    const dtr_tape *t = ctx->cur;
    const dtr__node *m;
    size_t cap = (size_t)n_in + 1;
    dtr_tensor **list;
    int i;
    for (m = t->head; m; m = m->prev) cap += (size_t)m->n_in;
    list = (dtr_tensor **)dtr__arena_meta(ctx, cap * sizeof(*list), "dtr_checkpoint");
    if (!list) return NULL;
    for (i = 0; i < n_in; i++) list[i] = in[i];
    *count = n_in;
    for (m = t->head; m; m = m->prev)
        for (i = 0; i < m->n_in; i++)
            if (!dtr__capture(ctx, list, count, m->in[i])) return NULL;
    return list;
}

/* Records the CHECKPOINT node on the outer tape; its forward kernel copies y into out. */
static dtr_tensor *dtr__checkpoint_record(dtr_context *ctx, const dtr__region *g, const dtr__checkpoint_params *p,
                                          dtr_tensor *const *in, dtr_tensor *y) {
    int count = 0;
    dtr_tensor **all = dtr__region_inputs(ctx, p->n_explicit, in, &count);
    dtr__node *n;
    if (!all) return NULL;
    ctx->cur = g->outer;
    n = dtr__node_new(ctx, DTR_OP_CHECKPOINT, count, all);
    if (!n) return NULL;
    n->p.checkpoint = *p;
    n->p.checkpoint.region_out = y;
    n->out = dtr__tensor_alloc(ctx, y->dtype, y->ndim, y->shape, "dtr_checkpoint");
    y = n->out ? dtr__record(ctx, n, "dtr_checkpoint") : NULL;
    n->p.checkpoint.region_out = NULL;   /* emptied with the region's tape */
    return y;
}

static int dtr__checkpoint_args(dtr_context *ctx, dtr_checkpoint_fn fn, int n_in, dtr_tensor *const *in) {
    int i;
    if (ctx->status != DTR_OK) return 0;
    if (!fn) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_checkpoint: fn is NULL"), 0;
    if (n_in < 0 || n_in > DTR__CHECKPOINT_MAX_INPUTS)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: n_in is %d, must be 0..%d", n_in,
                         DTR__CHECKPOINT_MAX_INPUTS), 0;
    if (n_in > 0 && !in) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_checkpoint: in is NULL (n_in %d)", n_in), 0;
    for (i = 0; i < n_in; i++) {
        if (!in[i]) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_checkpoint: input %d is NULL", i), 0;
        if (in[i]->ctx != ctx)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_checkpoint: input %d belongs to another context", i), 0;
    }
    return 1;
}

dtr_tensor *dtr_checkpoint(dtr_context *ctx, dtr_checkpoint_fn fn, void *user, int n_in, dtr_tensor *const *in) {
    dtr__checkpoint_params p;
    dtr__region g = {NULL, NULL, 0};
    dtr_tensor *y;
    if (!ctx || !dtr__checkpoint_args(ctx, fn, n_in, in)) return NULL;
    memset(&p, 0, sizeof(p));
    p.fn = fn;
    p.user = user;
    p.rng = ctx->rng;
    p.n_explicit = n_in;
    p.training = ctx->training;
    if (!ctx->grad_enabled) return dtr__call(ctx, &p, in);   /* nothing to keep for backward */
    if (dtr__region_begin(ctx, &g) != DTR_OK) return NULL;
    y = dtr__region_run(ctx, &p, in);
    if (y) y = dtr__checkpoint_record(ctx, &g, &p, in, y);
    dtr__region_end(ctx, &g);
    return y;
}

/* ---- backward ---- */

/* The recomputed region's share of the pass: y's gradient is the node's output gradient,
 * and the region's nodes replay into the gradients the outer pass made for its inputs. */
static dtr_result dtr__region_backward(dtr_context *ctx, const dtr__node *n, dtr_tensor *y) {
    const dtr_tape *t = ctx->cur;
    const dtr__node *m;
    char s1[96], s2[96];
    int i;
    if (y->ndim != n->out->ndim || memcmp(y->shape, n->out->shape, (size_t)y->ndim * sizeof(int64_t)) != 0)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_checkpoint: the region's output was %s in forward and is %s "
                         "recomputed", dtr__shape_str(n->out, s1, sizeof s1), dtr__shape_str(y, s2, sizeof s2));
    if (!dtr__inside(t, y)) return DTR_OK;   /* nothing in the region needs a gradient */
    /* every outside tensor the region writes a gradient to must have one from this pass */
    for (m = t->head; m; m = m->prev)
        for (i = 0; i < m->n_in; i++)
            if (dtr__from_outside(t, m->in[i]) && !(m->in[i]->grad && m->in[i]->grad_pass == ctx->backward_pass))
                return dtr__fail(ctx, DTR_BAD_STATE, "dtr_checkpoint: recomputing the region read '%s', which it did "
                                 "not read in forward (fn must build the same graph each time)", m->in[i]->name);
    y->grad = n->out->grad;
    y->grad_pass = ctx->backward_pass;
    return dtr__replay(ctx, t->head, 0);
}

dtr_result dtr__checkpoint_backward(dtr_context *ctx, dtr__node *n) {
    const dtr__checkpoint_params *p = &n->p.checkpoint;
    dtr_rng rng = ctx->rng;
    int training = ctx->training;
    dtr__region g = {NULL, NULL, 0};
    dtr_tensor *y;
    dtr_result r = dtr__region_begin(ctx, &g);
    if (r != DTR_OK) return r;
    ctx->rng = p->rng;           /* the forward's stream: the same dropout masks */
    ctx->training = p->training;
    ctx->recomputing++;
    y = dtr__region_run(ctx, p, n->in);
    ctx->recomputing--;
    ctx->rng = rng;
    ctx->training = training;
    r = y ? dtr__region_backward(ctx, n, y) : ctx->status;
    dtr__region_end(ctx, &g);
    return r;
}

/* ---- CPU kernels ---- */

/* out = the region's dense output */
dtr_result dtr__cpu_checkpoint_fwd(dtr_context *ctx, dtr__node *n) {
    const dtr_tensor *y = n->p.checkpoint.region_out;
    size_t es = dtr_dtype_size(y->dtype);
    (void)ctx;
    memcpy(n->out->storage, (const char *)y->storage + (size_t)y->offset * es, (size_t)dtr_tensor_numel(y) * es);
    return DTR_OK;
}

dtr_result dtr__cpu_checkpoint_bwd(dtr_context *ctx, dtr__node *n) { return dtr__checkpoint_backward(ctx, n); }
