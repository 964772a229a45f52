/* ============================================================================
 * Autograd: replays the tape recorded by the op builders in reverse.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"

/* ---- gradient-ready hook ----
 * With a hook installed, dtr_backward first counts, for every model parameter on the tape,
 * the nodes whose backward writes its gradient (grad_pending), then after each node (run or
 * skipped because nothing flowed into it) counts down its parameter inputs and reports a
 * parameter when its count reaches zero: its gradient is final for this pass. */

dtr_result dtr_context_set_grad_ready(dtr_context *ctx, dtr_result (*fn)(void *user, dtr_tensor *param), void *user) {
    if (!ctx) return DTR_NULL_HANDLE;
    ctx->grad_ready = fn;
    ctx->grad_ready_user = fn ? user : NULL;
    return DTR_OK;
}

/* the i-th tensor whose gradient node n's backward writes (concat: its list) */
static int dtr__node_nin(const dtr__node *n) { return n->op == DTR_OP_CONCAT ? (int)n->iarg[1] : n->n_in; }
static dtr_tensor *dtr__node_input(const dtr__node *n, int i) { return n->op == DTR_OP_CONCAT ? n->list[i] : n->in[i]; }
static int dtr__is_param(const dtr_tensor *x) {
    return x && (x->flags & DTR__PARAM) && (x->flags & DTR__REQUIRES_GRAD);
}

static void dtr__count_writers(dtr_context *ctx) {
    dtr__node *n;
    int i;
    for (n = ctx->tape; n; n = n->prev)
        for (i = 0; i < dtr__node_nin(n); i++)
            if (dtr__is_param(dtr__node_input(n, i))) dtr__node_input(n, i)->grad_pending = 0;
    for (n = ctx->tape; n; n = n->prev)
        for (i = 0; i < dtr__node_nin(n); i++)
            if (dtr__is_param(dtr__node_input(n, i))) dtr__node_input(n, i)->grad_pending++;
}

static dtr_result dtr__writers_done(dtr_context *ctx, const dtr__node *n) {
    int i;
    for (i = 0; i < dtr__node_nin(n); i++) {
        dtr_tensor *x = dtr__node_input(n, i);
        if (dtr__is_param(x) && --x->grad_pending == 0) {
            dtr_result r = ctx->grad_ready(ctx->grad_ready_user, x);
            if (r != DTR_OK) {
                if (ctx->status == DTR_OK) dtr__fail(ctx, r, "dtr_backward: the gradient-ready hook failed on '%s'", x->name);
                return r;
            }
        }
    }
    return DTR_OK;
}

dtr_result dtr_backward(dtr_context *ctx, dtr_tensor *loss) {
    dtr__node *n;
    dtr_result r;
    float one = 1.0f;
    int i;
    if (!ctx) return DTR_NULL_HANDLE;
    if (ctx->status != DTR_OK) return ctx->status;
    if (!loss) return dtr__fail(ctx, DTR_NULL_HANDLE, "dtr_backward: loss is NULL");
    if (dtr_tensor_numel(loss) != 1)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_backward: loss must be a scalar, has %lld elements",
                         (long long)dtr_tensor_numel(loss));
    if (!(loss->flags & DTR__REQUIRES_GRAD))
        return dtr__fail(ctx, DTR_BAD_STATE, "dtr_backward: the loss does not depend on any parameter "
                                             "(or gradient recording was off)");
    r = dtr__grad_ensure(ctx, loss);
    if (r != DTR_OK) return r;
    r = ctx->backend->from_host(ctx, loss->grad, &one, sizeof(float));
    if (r != DTR_OK) return dtr__fail(ctx, r, "dtr_backward: cannot seed the gradient");
    if (ctx->grad_ready) dtr__count_writers(ctx);
    for (n = ctx->tape; n; n = n->prev) {
        if (!n->out->grad) { /* nothing flowed back into this node */
            if (ctx->grad_ready && (r = dtr__writers_done(ctx, n)) != DTR_OK) return r;
            continue;
        }
        for (i = 0; i < n->n_in; i++) {
            dtr_tensor *x = n->in[i];
            if (x && (x->flags & DTR__REQUIRES_GRAD)) {
                r = dtr__grad_ensure(ctx, x);
                if (r != DTR_OK) return r;
            }
        }
        if (n->op == DTR_OP_CONCAT) {
            for (i = 0; i < (int)n->iarg[1]; i++) {
                dtr_tensor *x = n->list[i];
                if (x->flags & DTR__REQUIRES_GRAD) {
                    r = dtr__grad_ensure(ctx, x);
                    if (r != DTR_OK) return r;
                }
            }
        }
        r = ctx->backend->backward(ctx, n);
        if (r != DTR_OK) {
            if (ctx->status == DTR_OK) dtr__fail(ctx, r, "dtr_backward: backward kernel of op %d failed", n->op);
            return r;
        }
        if (ctx->grad_ready && (r = dtr__writers_done(ctx, n)) != DTR_OK) return r;
    }
    return DTR_OK;
}
