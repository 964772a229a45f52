/* ============================================================================
 * Captured steps (dtr_graph): a step function captured once and launched again each step.
 * While the function runs, the context's backend is the graph's guard: a copy of the real
 * vtable whose host-synchronising slots refuse (a CUDA graph cannot hold a host wait), whose
 * forward and backward refuse the op families a replay cannot repeat, and which writes down
 * every call that queues work (its slot, op and shapes: the trace) and keeps every host value
 * copied in, in backend memory. A later run of the function must make the same trace, and
 * takes its host values from those copies, so a CPU launch does what a CUDA replay does.
 * CUDA: run 1 eager (the allocator's and cuBLAS's first-use work), tape reset, run 2 under
 * stream capture into the graph; a launch is the backend's graph_launch.
 * Elsewhere: run 1 is the capture; a launch resets the tape and runs the function again.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"

typedef struct dtr__graph_call {
    int slot;                   /* DTR__GS_* */
    int op;                     /* forward and backward: the node's op */
    uint64_t key;               /* FNV-1a of what the call depends on (shapes, sizes, a scale) */
} dtr__graph_call;

typedef struct dtr__graph_copy {
    size_t bytes;
    void *dev;                  /* the capture's host value, in backend memory */
} dtr__graph_copy;

enum { DTR__GS_FORWARD = 1, DTR__GS_BACKWARD, DTR__GS_MEMSET, DTR__GS_SCALE, DTR__GS_REDUCE, DTR__GS_COPY,
       DTR__GS_FROM_HOST, DTR__GS_COPY2D };

struct dtr_graph {
    dtr_context *ctx;
    dtr_graph_fn fn;
    void *user;
    dtr_tape *tape;
    const dtr_backend *real;    /* the context's backend */
    dtr_backend guard;          /* the backend while fn runs */
    void *exec;                 /* the backend's graph (NULL: launches call fn again) */
    int reads_own;              /* the capture read tensors of the context's own tape */
    uint64_t resets;            /* ctx->resets at the capture */
    dtr__graph_call *trace;     /* the capture's calls */
    int n_trace, cap_trace;
    dtr__graph_copy *copies;    /* the capture's host values */
    int n_copies, cap_copies;
    dtr_tensor **reached;       /* the parameters the capture's backward reached: a native launch marks
                                   them reached again (an optimizer leaves the others out) */
    int n_reached, cap_reached;
    int reach_lost;             /* no memory to note one: launches leave the bookkeeping alone (every parameter updates) */
    int checking;               /* a later run: compare with the trace, take the copies */
    int at_trace, at_copy;      /* that run's position in them */
};

/* ---- the trace ---- */

static uint64_t dtr__fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static uint64_t dtr__fnv_tensor(uint64_t h, const dtr_tensor *t) {
    int none = -1;
    if (!t) return dtr__fnv(h, &none, sizeof none);
    h = dtr__fnv(h, &t->dtype, sizeof t->dtype);
    h = dtr__fnv(h, &t->ndim, sizeof t->ndim);
    return dtr__fnv(h, t->shape, (size_t)t->ndim * sizeof(int64_t));
}

static dtr_result dtr__graph_mismatch(dtr_graph *g, int at, int op) {
    return dtr__fail(g->ctx, DTR_BAD_STATE, "dtr_graph: the step differs from its capture at call %d (%s): its "
                     "function must do the same work each time, on inputs of the same shapes and the same host values",
                     at, op ? dtr__op_name(op) : "a copy or fill");
}

/* writes the call down (capture) or compares it with the capture's (later runs) */
static dtr_result dtr__graph_note(dtr_graph *g, int slot, int op, uint64_t key) {
    dtr__graph_call c;
    c.slot = slot;
    c.op = op;
    c.key = key;
    if (g->checking) {
        const dtr__graph_call *w = g->at_trace < g->n_trace ? &g->trace[g->at_trace] : NULL;
        if (!w || w->slot != slot || w->op != op || w->key != key) return dtr__graph_mismatch(g, g->at_trace, op);
        g->at_trace++;
        return DTR_OK;
    }
    if (g->n_trace == g->cap_trace) {
        int cap = g->cap_trace ? 2 * g->cap_trace : 256;
        dtr__graph_call *t = (dtr__graph_call *)dtr__realloc(&g->ctx->alloc, g->trace, (size_t)cap * sizeof(*t));
        if (!t) return dtr__fail(g->ctx, DTR_OUT_OF_MEMORY, "dtr_graph_capture: out of memory");
        g->trace = t;
        g->cap_trace = cap;
    }
    g->trace[g->n_trace++] = c;
    return DTR_OK;
}

/* ---- the guard's slots ---- */

static dtr_graph *dtr__graph_of(dtr_context *ctx) { return ctx->capturing; }

static dtr_result dtr__graph_refuse(dtr_context *ctx, const char *what) {
    return dtr__fail(ctx, DTR_BAD_STATE, "dtr_graph: %s inside a captured step (a replay cannot wait on the host "
                     "or change its arguments): do it outside the step function", what);
}

static dtr_result dtr__gs_to_host(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    (void)dst; (void)src; (void)bytes;
    return dtr__graph_refuse(ctx, "reading backend memory on the host (dtr_tensor_read and the like)");
}
static dtr_result dtr__gs_to_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **d) {
    (void)dst; (void)src; (void)bytes; (void)d;
    return dtr__graph_refuse(ctx, "a copy to the host");
}
static dtr_result dtr__gs_from_host_async(dtr_context *ctx, void *dst, const void *src, size_t bytes, dtr_event **d) {
    (void)dst; (void)src; (void)bytes; (void)d;
    return dtr__graph_refuse(ctx, "an asynchronous copy from the host (a loader's batch)");
}
static dtr_result dtr__gs_optimizer(dtr_context *ctx, const dtr__opt_args *a) {
    (void)a;
    return dtr__graph_refuse(ctx, "an optimizer step");
}
static dtr_result dtr__gs_sumsq(dtr_context *ctx, const float *x, int64_t n, double *out) {
    (void)x; (void)n; (void)out;
    return dtr__graph_refuse(ctx, "a sum read on the host (gradient clipping, a loss-scaler check)");
}
static dtr_result dtr__gs_event_record(dtr_context *ctx, dtr_event **ev) {
    (void)ev;
    return dtr__graph_refuse(ctx, "an event (a gradient hook, an asynchronous copy)");
}
static dtr_result dtr__gs_event_wait(dtr_context *ctx, dtr_event *ev) {
    (void)ev;
    return dtr__graph_refuse(ctx, "waiting for an event");
}
static dtr_result dtr__gs_event_query(dtr_context *ctx, dtr_event *ev, int *done) {
    (void)ev; (void)done;
    return dtr__graph_refuse(ctx, "querying an event");
}
static dtr_result dtr__gs_sync(dtr_context *ctx) { return dtr__graph_refuse(ctx, "synchronizing with the backend"); }
static dtr_result dtr__gs_vocab_xent(dtr_context *ctx, const dtr__vxent_args *a, int phase) {
    (void)a; (void)phase;
    return dtr__graph_refuse(ctx, "the vocabulary-parallel cross-entropy (a collective)");
}
static dtr_result dtr__gs_codec(dtr_context *ctx, const dtr__codec_args *a, int decode) {
    (void)a; (void)decode;
    return dtr__graph_refuse(ctx, "gradient compression (dtr_dp_finish)");
}
static dtr_result dtr__gs_powersgd(dtr_context *ctx, const dtr__psgd_args *a, int phase) {
    (void)a; (void)phase;
    return dtr__graph_refuse(ctx, "gradient compression (dtr_dp_finish)");
}

/* each op's kernel family, from the op list: the families a replay cannot repeat are refused */
#define DTR__GRAPH_FAMILY(id, name, k) #k,
static const char *const dtr__graph_families[DTR_OP_COUNT] = {"", DTR__OP_LIST(DTR__GRAPH_FAMILY)};
#undef DTR__GRAPH_FAMILY

static dtr_result dtr__graph_op_allowed(dtr_context *ctx, int op) {
    const char *f = op > 0 && op < DTR_OP_COUNT ? dtr__graph_families[op] : "";
    if (!strcmp(f, "dropout"))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_graph: dropout inside a captured step (a replay would repeat the "
                         "capture's mask): leave it out of the step or switch training mode off");
    if (!strcmp(f, "checkpoint"))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_graph: dtr_checkpoint inside a captured step (its region runs "
                         "on tapes outside the graph's)");
    if (!strcmp(f, "comm"))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_graph: the tensor-parallel op '%s' inside a captured step (a "
                         "collective)", dtr__op_name(op));
    return DTR_OK;
}

/* h extended by the parameters that change an op's result without changing its shapes (a layer's
   geometry may change between launches) */
static uint64_t dtr__graph_params(const dtr__node *n, uint64_t h) {
    if (!strcmp(dtr__graph_families[n->op], "unary")) return dtr__fnv(h, &n->p.unary, sizeof n->p.unary);
    if (n->op == DTR_OP_CONV2D || n->op == DTR_OP_CONV_TRANSPOSE2D) return dtr__fnv(h, &n->p.conv2d, sizeof n->p.conv2d);
    if (n->op == DTR_OP_MAXPOOL2D || n->op == DTR_OP_AVGPOOL2D) return dtr__fnv(h, &n->p.pool2d, sizeof n->p.pool2d);
    if (n->op == DTR_OP_CROSS_ENTROPY) return dtr__fnv(h, &n->p.xent, sizeof n->p.xent);
    if (n->op == DTR_OP_VOCAB_CROSS_ENTROPY) return dtr__fnv(h, &n->p.comm.xent, sizeof n->p.comm.xent);
    if (n->op == DTR_OP_SUM || n->op == DTR_OP_MEAN || n->op == DTR_OP_MAX || n->op == DTR_OP_ARGMAX || n->op == DTR_OP_GATHER)
        return dtr__fnv(h, &n->p.axis, sizeof n->p.axis);
    return h;
}

/* the node's op, its tensors' shapes and parameters (dtr__graph_params); notes a read of the own tape */
static dtr_result dtr__graph_node(dtr_context *ctx, dtr__node *n, int slot) {
    dtr_graph *g = dtr__graph_of(ctx);
    uint64_t h = 14695981039346656037ull;
    dtr_result r = dtr__graph_op_allowed(ctx, n->op);
    int i;
    if (r != DTR_OK) return r;
    for (i = 0; i < n->n_in; i++) {
        h = dtr__fnv_tensor(h, n->in[i]);
        if (!g->checking && n->in[i] && dtr__tape_owns(&ctx->own, n->in[i])) g->reads_own = 1;   /* the capture's */
    }
    h = dtr__fnv_tensor(h, n->out);
    h = dtr__graph_params(n, h);
    return dtr__graph_note(g, slot, n->op, h);
}

static dtr_result dtr__gs_forward(dtr_context *ctx, dtr__node *n) {
    dtr_result r = dtr__graph_node(ctx, n, DTR__GS_FORWARD);
    return r != DTR_OK ? r : dtr__graph_of(ctx)->real->forward(ctx, n);
}
static dtr_result dtr__gs_backward(dtr_context *ctx, dtr__node *n) {
    dtr_result r = dtr__graph_node(ctx, n, DTR__GS_BACKWARD);
    return r != DTR_OK ? r : dtr__graph_of(ctx)->real->backward(ctx, n);
}

static dtr_result dtr__graph_note_size(dtr_context *ctx, int slot, size_t n, const void *extra, size_t extra_bytes) {
    uint64_t h = dtr__fnv(14695981039346656037ull, &n, sizeof n);
    if (extra) h = dtr__fnv(h, extra, extra_bytes);
    return dtr__graph_note(dtr__graph_of(ctx), slot, 0, h);
}

static dtr_result dtr__gs_memset0(dtr_context *ctx, void *dst, size_t bytes) {
    dtr_result r = dtr__graph_note_size(ctx, DTR__GS_MEMSET, bytes, NULL, 0);
    return r != DTR_OK ? r : dtr__graph_of(ctx)->real->memset0(ctx, dst, bytes);
}
static dtr_result dtr__gs_scale(dtr_context *ctx, float *x, int64_t n, float s) {
    dtr_result r = dtr__graph_note_size(ctx, DTR__GS_SCALE, (size_t)n, &s, sizeof s);
    return r != DTR_OK ? r : dtr__graph_of(ctx)->real->scale(ctx, x, n, s);
}
static dtr_result dtr__gs_reduce(dtr_context *ctx, void *out, const void *a, const void *b, size_t n, dtr_dtype dt,
                                 int op, int div) {
    int k[3] = {(int)dt, op, div};
    dtr_result r = dtr__graph_note_size(ctx, DTR__GS_REDUCE, n, k, sizeof k);
    return r != DTR_OK ? r : dtr__graph_of(ctx)->real->reduce(ctx, out, a, b, n, dt, op, div);
}
static dtr_result dtr__gs_copy(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    dtr_result r = dtr__graph_note_size(ctx, DTR__GS_COPY, bytes, NULL, 0);
    return r != DTR_OK ? r : dtr__graph_of(ctx)->real->copy(ctx, dst, src, bytes);
}

static dtr_result dtr__gs_copy2d(dtr_context *ctx, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                                 size_t rows) {
    size_t k[3] = {dpitch, spitch, rows};
    dtr_result r = dtr__graph_note_size(ctx, DTR__GS_COPY2D, width, k, sizeof k);
    return r != DTR_OK ? r : dtr__graph_of(ctx)->real->copy2d(ctx, dst, dpitch, src, spitch, width, rows);
}

/* bytes of backend memory from src to dst through the real backend (memmove on host memory) */
static dtr_result dtr__graph_dcopy(dtr_graph *g, void *dst, const void *src, size_t bytes) {
    if (g->real->copy) return g->real->copy(g->ctx, dst, src, bytes);
    memmove(dst, src, bytes);
    return DTR_OK;
}

/* A host value copied in: the capture keeps it in backend memory; later runs copy from there
 * (a replay reads the capture's value, not what src holds now). */
static dtr_result dtr__gs_from_host(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    dtr_graph *g = dtr__graph_of(ctx);
    dtr__graph_copy *c;
    dtr_result r = dtr__graph_note_size(ctx, DTR__GS_FROM_HOST, bytes, NULL, 0);
    if (r != DTR_OK) return r;
    if (g->checking) return dtr__graph_dcopy(g, dst, g->copies[g->at_copy++].dev, bytes);
    if (g->n_copies == g->cap_copies) {
        int cap = g->cap_copies ? 2 * g->cap_copies : 16;
        c = (dtr__graph_copy *)dtr__realloc(&ctx->alloc, g->copies, (size_t)cap * sizeof(*c));
        if (!c) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_graph_capture: out of memory");
        g->copies = c;
        g->cap_copies = cap;
    }
    c = &g->copies[g->n_copies];
    if (!(c->dev = g->real->mem_alloc(ctx, bytes ? bytes : 1))) return ctx->status != DTR_OK ? ctx->status : DTR_OUT_OF_MEMORY;
    c->bytes = bytes;
    g->n_copies++;
    if ((r = g->real->from_host(ctx, c->dev, src, bytes)) != DTR_OK) return r;
    return g->real->from_host(ctx, dst, src, bytes);
}

/* the real vtable with the slots above */
static void dtr__graph_guard_init(dtr_graph *g) {
    dtr_backend *v = &g->guard;
    *v = *g->real;
    v->memset0 = dtr__gs_memset0;
    v->to_host = dtr__gs_to_host;
    v->from_host = dtr__gs_from_host;
    v->forward = dtr__gs_forward;
    v->backward = dtr__gs_backward;
    v->optimizer_update = dtr__gs_optimizer;
    v->sumsq = dtr__gs_sumsq;
    v->scale = dtr__gs_scale;
    v->reduce = dtr__gs_reduce;
    v->event_record = dtr__gs_event_record;
    v->event_wait = dtr__gs_event_wait;
    v->event_query = dtr__gs_event_query;
    v->synchronize = dtr__gs_sync;
    v->to_host_async = dtr__gs_to_host_async;
    v->from_host_async = dtr__gs_from_host_async;
    if (v->copy) v->copy = dtr__gs_copy;   /* NULL stays NULL: dtr__mem_copy memmoves host memory */
    if (v->copy2d) v->copy2d = dtr__gs_copy2d;
    if (v->vocab_xent) v->vocab_xent = dtr__gs_vocab_xent;   /* (its op is refused before it runs) */
    if (v->codec) v->codec = dtr__gs_codec;
    if (v->powersgd) v->powersgd = dtr__gs_powersgd;
}

/* ---- runs ---- */

/* One run of fn on the graph's tape behind the guard: checking 0 writes the trace, 1 compares. */
static dtr_result dtr__graph_run(dtr_graph *g, int checking) {
    dtr_context *ctx = g->ctx;
    dtr_tape *was = ctx->cur;
    dtr_result r;
    g->checking = checking;
    g->at_trace = g->at_copy = 0;
    ctx->capturing = g;
    ctx->backend = &g->guard;
    ctx->cur = g->tape;
    r = g->fn(ctx, g->user);
    ctx->cur = was;
    ctx->backend = g->real;
    ctx->capturing = NULL;
    if (r == DTR_OK && ctx->status != DTR_OK) r = ctx->status;   /* an op builder's error */
    if (r == DTR_OK && checking && g->at_trace != g->n_trace) r = dtr__graph_mismatch(g, g->at_trace, 0);
    if (r != DTR_OK && ctx->status == DTR_OK) dtr__fail(ctx, r, "dtr_graph: the step function returned %s", dtr_result_string(r));
    return r;
}

void dtr__graph_reached(dtr_context *ctx, dtr_tensor *param) {
    dtr_graph *g = ctx->capturing;
    int i;
    for (i = 0; i < g->n_reached; i++)
        if (g->reached[i] == param) return;
    if (g->n_reached == g->cap_reached) {
        int cap = g->cap_reached ? 2 * g->cap_reached : 16;
        void *p = dtr__realloc(&ctx->alloc, g->reached, (size_t)cap * sizeof(*g->reached));
        if (!p) { g->reach_lost = 1; return; }
        g->reached = (dtr_tensor **)p, g->cap_reached = cap;
    }
    g->reached[g->n_reached++] = param;
}

/* a native launch's backward, in the bookkeeping: a pass of its own that reached what the
   capture's reached (the replay writes their gradients without the tape) */
static void dtr__graph_mark_reached(dtr_graph *g) {
    int i;
    if (g->reach_lost) return;
    g->ctx->backward_pass++;
    for (i = 0; i < g->n_reached; i++) g->reached[i]->grad_pass = g->ctx->backward_pass;
}

/* CUDA: the second run, under stream capture, into the backend's graph */
static dtr_result dtr__graph_capture_native(dtr_graph *g) {
    dtr_context *ctx = g->ctx;
    dtr_result r, e;
    dtr_tape_reset(g->tape);
    if ((r = g->real->graph_begin(ctx)) != DTR_OK) return r;
    r = dtr__graph_run(g, 1);
    e = g->real->graph_end(ctx, &g->exec);   /* ends the capture also after an error */
    return r != DTR_OK ? r : e;
}

static dtr_result dtr__graph_check_args(dtr_context *ctx, dtr_graph_fn fn, dtr_graph **out) {
    int i;
    if (!ctx || !fn || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (ctx->status != DTR_OK) return ctx->status;
    if (ctx->capturing) return dtr__fail(ctx, DTR_BAD_STATE, "dtr_graph_capture: a capture is under way on this context");
    for (i = 0; i < ctx->n_grad_hooks; i++)
        if (!ctx->grad_hooks[i].deferred)
            return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_graph_capture: the context has a gradient hook (id %d) that must "
                             "run during backward: a captured step cannot hold its work", ctx->grad_hooks[i].id);
    if (ctx->param_fetch)
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_graph_capture: ZeRO-3 gathers parameters during the step: a captured "
                         "step cannot hold that communication (ZeRO-1 and 2 can be captured)");
    return DTR_OK;
}

dtr_result dtr_graph_capture(dtr_context *ctx, dtr_graph_fn fn, void *user, dtr_graph **out) {
    dtr_result r = dtr__graph_check_args(ctx, fn, out);
    dtr_graph *g;
    if (r != DTR_OK) return r;
    if (!(g = (dtr_graph *)dtr__calloc(&ctx->alloc, sizeof(*g))))
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_graph_capture: out of memory");
    g->ctx = ctx;
    g->fn = fn;
    g->user = user;
    g->real = ctx->backend;
    g->resets = ctx->resets;
    dtr__graph_guard_init(g);
    r = dtr_tape_create(ctx, &g->tape);
    if (r == DTR_OK) r = dtr__graph_run(g, 0);
    if (r == DTR_OK && g->real->graph_begin) r = dtr__graph_capture_native(g);
    if (r != DTR_OK) {
        dtr_graph_destroy(g);
        return r;
    }
    *out = g;
    return DTR_OK;
}

dtr_result dtr_graph_launch(dtr_graph *g) {
    dtr_context *ctx;
    if (!g) return DTR_NULL_HANDLE;
    ctx = g->ctx;
    if (ctx->status != DTR_OK) return ctx->status;
    if (ctx->capturing) return dtr__fail(ctx, DTR_BAD_STATE, "dtr_graph_launch: inside a captured step");
    if (g->reads_own && ctx->resets != g->resets)
        return dtr__fail(ctx, DTR_BAD_STATE, "dtr_graph_launch: dtr_context_reset freed tensors the captured step reads "
                         "(made on the context's own tape before the capture): capture it again");
    if (g->exec) {
        dtr__graph_mark_reached(g);
        return g->real->graph_launch(ctx, g->exec);
    }
    dtr_tape_reset(g->tape);
    return dtr__graph_run(g, 1);
}

int dtr_graph_native(const dtr_graph *g) { return g && g->exec ? 1 : 0; }

void dtr_graph_destroy(dtr_graph *g) {
    dtr_context *ctx;
    int i;
    if (!g) return;
    ctx = g->ctx;
    if (g->exec) g->real->graph_free(ctx, g->exec);
    else if (g->n_copies) (void)g->real->synchronize(ctx);   /* queued copies may still read the values */
    for (i = 0; i < g->n_copies; i++) g->real->mem_free(ctx, g->copies[i].dev);
    dtr_tape_destroy(g->tape);
    dtr__free(&ctx->alloc, g->copies);
    dtr__free(&ctx->alloc, g->trace);
    dtr__free(&ctx->alloc, g->reached);
    dtr__free(&ctx->alloc, g);
}
