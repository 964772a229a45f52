/* ============================================================================
 * Autograd: replays the tape recorded by the op builders in reverse.
 *
 * Passes. Each dtr_backward / dtr_backward_from is one pass with its own number. Gradients of
 * leaves (parameters, tensors marked with dtr_tensor_requires_grad) accumulate across passes;
 * the gradient of an intermediate tensor belongs to one pass: the first write of a pass
 * finds it zeroed (dtr__grad_of_pass), and a node whose output received nothing in this pass
 * is skipped. So two losses that share a graph, each with its own dtr_backward, give the sum
 * of their gradients, as PyTorch's retain_graph=True does.
 *
 * Gradient hooks. With hooks installed, a pass first counts, for every model parameter on
 * the tape, the nodes whose backward writes its gradient (grad_pending), then after each
 * node (run or skipped) counts down its parameter inputs and reports a parameter when its
 * count reaches zero: its gradient is final for this pass. The report carries an event that
 * completes when the backend has finished writing it (NULL on the CPU: already done).
 *
 * Releases. Every reader of a tensor comes after its producer on the tape, so once a node has
 * run its backward nothing of this pass reads its output's gradient again: that block goes
 * back to the own tape's spares. With release_activations the node's saved state and its
 * output go back too (unless retained or the pass's root); a later pass or op that would
 * read them fails with DTR_BAD_STATE instead (dtr__check_alive, dtr__node_new).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "internal.h"
#include "../obs/obs_internal.h"

/* ---- gradient hooks ---- */

dtr_result dtr_context_add_grad_hook(dtr_context *ctx, dtr_grad_hook_fn fn, void *user, int *id) {
    dtr__grad_hook *h;
    if (!ctx) return DTR_NULL_HANDLE;
    if (!fn) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_context_add_grad_hook: fn is NULL");
    if (ctx->n_grad_hooks >= DTR__MAX_GRAD_HOOKS)
        return dtr__fail(ctx, DTR_BAD_STATE, "dtr_context_add_grad_hook: the context has %d hooks already",
                         DTR__MAX_GRAD_HOOKS);
    h = &ctx->grad_hooks[ctx->n_grad_hooks++];
    h->fn = fn;
    h->user = user;
    h->id = ++ctx->grad_hook_ids;
    if (id) *id = h->id;
    return DTR_OK;
}

void dtr__grad_hook_defer(dtr_context *ctx, int id) {
    int i;
    for (i = 0; i < ctx->n_grad_hooks; i++)
        if (ctx->grad_hooks[i].id == id) ctx->grad_hooks[i].deferred = 1;
}

/* 1 when hook k runs now: every hook, but a deferred one not in a captured step */
static int dtr__hook_runs(const dtr_context *ctx, int k) { return !ctx->capturing || !ctx->grad_hooks[k].deferred; }

static int dtr__hooks_running(const dtr_context *ctx) {
    int k, n = 0;
    for (k = 0; k < ctx->n_grad_hooks; k++) n += dtr__hook_runs(ctx, k);
    return n;
}

dtr_result dtr_context_remove_grad_hook(dtr_context *ctx, int id) {
    int i;
    if (!ctx) return DTR_NULL_HANDLE;
    for (i = 0; i < ctx->n_grad_hooks; i++) {
        if (ctx->grad_hooks[i].id != id) continue;
        for (; i + 1 < ctx->n_grad_hooks; i++) ctx->grad_hooks[i] = ctx->grad_hooks[i + 1];
        ctx->n_grad_hooks--;
        return DTR_OK;
    }
    return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_context_remove_grad_hook: no hook with id %d", id);
}

static int dtr__is_param(const dtr_tensor *x) {
    return x && (x->flags & DTR__PARAM) && (x->flags & DTR__REQUIRES_GRAD);
}

static void dtr__count_writers(dtr__node *tape) {
    dtr__node *n;
    int i;
    for (n = tape; n; n = n->prev)
        for (i = 0; i < n->n_in; i++)
            if (dtr__is_param(n->in[i])) n->in[i]->grad_pending = 0;
    for (n = tape; n; n = n->prev)
        for (i = 0; i < n->n_in; i++)
            if (dtr__is_param(n->in[i])) n->in[i]->grad_pending++;
}

static dtr_result dtr__report_param(dtr_context *ctx, dtr_tensor *x) {
    dtr_event *ready = NULL;
    dtr_result r = ctx->backend->event_record(ctx, &ready);
    int k;
    for (k = 0; r == DTR_OK && k < ctx->n_grad_hooks; k++) {
        if (!dtr__hook_runs(ctx, k)) continue;
        r = ctx->grad_hooks[k].fn(ctx->grad_hooks[k].user, x, ready);
        if (r != DTR_OK && ctx->status == DTR_OK)
            dtr__fail(ctx, r, "dtr_backward: gradient hook %d failed on '%s'", ctx->grad_hooks[k].id, x->name);
    }
    return r;
}

static dtr_result dtr__writers_done(dtr_context *ctx, const dtr__node *n) {
    int i;
    for (i = 0; i < n->n_in; i++) {
        dtr_tensor *x = n->in[i];
        if (dtr__is_param(x) && --x->grad_pending == 0) {
            dtr_result r = dtr__report_param(ctx, x);
            if (r != DTR_OK) return r;
        }
    }
    return DTR_OK;
}

/* ---- passes ---- */

/* The gradient of x for the current pass: a leaf's accumulates; an intermediate's starts
 * from zero in each pass. */
static dtr_result dtr__grad_of_pass(dtr_context *ctx, dtr_tensor *x) {
    int stale = x->grad && x->node && x->grad_pass != ctx->backward_pass;   /* left by an earlier pass */
    dtr_result r = dtr__grad_ensure(ctx, x);                                /* a new one comes zeroed */
    x->grad_pass = ctx->backward_pass;
    if (ctx->capturing && dtr__is_param(x)) dtr__graph_reached(ctx, x);
    if (r != DTR_OK || !stale) return r;
    return ctx->backend->memset0(ctx, x->grad, (size_t)dtr_tensor_numel(x) * sizeof(float));
}

static int dtr__reached(const dtr_context *ctx, const dtr_tensor *x) {
    return x->grad && x->grad_pass == ctx->backward_pass;
}

/* DTR_BAD_STATE when n's backward would read what an earlier pass released */
static dtr_result dtr__check_alive(dtr_context *ctx, const dtr__node *n) {
    if (!n->released && !dtr__released(n->out) && dtr__released_input(n) < 0) return DTR_OK;
    return dtr__fail(ctx, DTR_BAD_STATE, "dtr_backward: op '%s' needs activations that an earlier dtr_backward "
                     "released (release_activations): back-propagate through a graph once, or keep its tensors "
                     "with dtr_tensor_retain", dtr__op_name(n->op));
}

/* 1 when n's input gradient is its output gradient, element for element (same dense layout) */
static int dtr__grad_identity(const dtr__node *n) {
    return n->op == DTR_OP_RESHAPE || n->op == DTR_OP_CONTIGUOUS;
}

static dtr_result dtr__run_node(dtr_context *ctx, dtr__node *n) {
    dtr_result r = dtr__check_alive(ctx, n);
    double t0 = 0.0;
    int i;
    if (r != DTR_OK) return r;
    if (dtr__grad_identity(n) && dtr__grad_handoff(ctx, n->out, n->in[0])) return DTR_OK;
    for (i = 0; i < n->n_in; i++) {
        dtr_tensor *x = n->in[i];
        if (x && (x->flags & DTR__REQUIRES_GRAD) && (r = dtr__grad_of_pass(ctx, x)) != DTR_OK) return r;
    }
    if ((r = dtr__fetch_params(ctx, n)) != DTR_OK) return r;   /* ZeRO-3: parameters on other ranks */
    if (ctx->obs) t0 = dtr__obs_now();
    r = ctx->backend->backward(ctx, n);
    if (ctx->obs) dtr__obs_op(ctx->obs, n, 1, t0, dtr__obs_now());
    if (r != DTR_OK && ctx->status == DTR_OK)
        dtr__fail(ctx, r, "dtr_backward: backward kernel of op '%s' failed", dtr__op_name(n->op));
    if (r == DTR_OK && ctx->anomaly) r = dtr__anomaly_backward(ctx, n);
    return r;
}

dtr_result dtr__replay(dtr_context *ctx, dtr__node *tape, int report) {
    dtr__node *n;
    dtr_result r;
    int hooks = report && dtr__hooks_running(ctx) > 0;
    if (hooks) dtr__count_writers(tape);
    for (n = tape; n; n = n->prev) {
        if (dtr__reached(ctx, n->out)) {
            if ((r = dtr__run_node(ctx, n)) != DTR_OK) return r;
            dtr__grad_release(ctx, n->out);   /* nothing reads it after its producer */
            if (ctx->cfg.release_activations) dtr__node_release(ctx, n);   /* n is on the current tape */
        }
        if (hooks && (r = dtr__writers_done(ctx, n)) != DTR_OK) return r;
    }
    return DTR_OK;
}

static dtr_result dtr__check_root(dtr_context *ctx, const char *fn, const dtr_tensor *out) {
    if (!ctx) return DTR_NULL_HANDLE;
    if (ctx->status != DTR_OK) return ctx->status;
    if (!out) return dtr__fail(ctx, DTR_NULL_HANDLE, "%s: the tensor is NULL", fn);
    if (out->ctx != ctx) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: the tensor belongs to another context", fn);
    if (!(out->flags & DTR__REQUIRES_GRAD))
        return dtr__fail(ctx, DTR_BAD_STATE, "%s: the tensor does not depend on any parameter "
                                             "(or gradient recording was off)", fn);
    return DTR_OK;
}

/* Seeds out's gradient for this pass with `grad` (host memory, or with in_backend the
   backend's). */
static dtr_result dtr__seed(dtr_context *ctx, dtr_tensor *out, const float *grad, int in_backend) {
    size_t bytes = (size_t)dtr_tensor_numel(out) * sizeof(float);
    dtr_result r = dtr__grad_of_pass(ctx, out);
    if (r == DTR_OK && out->node) {
        r = in_backend ? dtr__mem_copy(ctx, out->grad, grad, bytes) : ctx->backend->from_host(ctx, out->grad, grad, bytes);
    } else if (r == DTR_OK) { /* a leaf: its gradient accumulates */
        float *tmp = in_backend ? (float *)grad : (float *)dtr__arena_data(ctx, bytes, "dtr_backward_from");
        r = tmp ? DTR_OK : ctx->status;
        if (r == DTR_OK && !in_backend) r = ctx->backend->from_host(ctx, tmp, grad, bytes);
        if (r == DTR_OK) r = ctx->backend->reduce(ctx, out->grad, out->grad, tmp, (size_t)dtr_tensor_numel(out), DTR_F32, DTR_REDUCE_SUM, 1);
    }
    if (r != DTR_OK) return dtr__fail(ctx, r, "dtr_backward_from: cannot seed the gradient");
    return DTR_OK;
}

dtr_result dtr_backward_from(dtr_context *ctx, dtr_tensor *out, const float *grad) {
    return dtr__backward_from(ctx, out, grad, 0);
}

/* One pass over the tape that recorded `out` (the current one for a leaf), with that tape
 * current so the gradients of its tensors live in its arenas. */
dtr_result dtr__backward_from(dtr_context *ctx, dtr_tensor *out, const float *grad, int in_backend) {
    dtr_result r = dtr__check_root(ctx, "dtr_backward_from", out);
    dtr_tape *was;
    if (r != DTR_OK) return r;
    if (!grad) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_backward_from: grad is NULL");
    was = ctx->cur;
    if (out->node) ctx->cur = out->node->tape;
    ctx->backward_pass++;
    ctx->pass_root = dtr__owner(out);
    dtr__obs_phase_begin(ctx, DTR_PHASE_BACKWARD);
    r = dtr__seed(ctx, out, grad, in_backend);
    if (r == DTR_OK) r = dtr__replay(ctx, ctx->cur->head, 1);
    dtr__obs_phase_end(ctx, DTR_PHASE_BACKWARD);
    ctx->cur = was;
    return r;
}

dtr_result dtr_backward(dtr_context *ctx, dtr_tensor *loss) {
    static const float one = 1.0f;
    if (!ctx) return DTR_NULL_HANDLE;
    if (ctx->status != DTR_OK) return ctx->status;
    if (!loss) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_backward: loss is NULL");
    if (dtr_tensor_numel(loss) != 1)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_backward: loss must be a scalar, has %lld elements",
                         (long long)dtr_tensor_numel(loss));
    return dtr_backward_from(ctx, loss, &one);
}

/* ---- completion events ---- */

dtr_result dtr_event_wait(dtr_context *ctx, dtr_event *ev) {
    if (!ctx) return DTR_NULL_HANDLE;
    return ev ? ctx->backend->event_wait(ctx, ev) : DTR_OK;
}

dtr_result dtr_event_query(dtr_context *ctx, dtr_event *ev, int *done) {
    if (!ctx || !done) return DTR_NULL_HANDLE;
    *done = 1;
    return ev ? ctx->backend->event_query(ctx, ev, done) : DTR_OK;
}
