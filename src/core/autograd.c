/* ============================================================================
 * Autograd: replays the tape recorded by the op builders in reverse.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"

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
    for (n = ctx->tape; n; n = n->prev) {
        if (!n->out->grad) continue; /* nothing flowed back into this node */
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
    }
    return DTR_OK;
}
