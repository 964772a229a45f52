/* ============================================================================
 * Numeric health: anomaly mode (dtr_context_set_anomaly) and the context's log helpers.
 *
 * Anomaly mode checks, with the backend's sum of squares (one pass; NaN or infinity in gives
 * NaN or infinity out, and squares of finite floats cannot overflow a double), every op's
 * output after its forward kernel and every gradient an op's backward kernel wrote. The
 * first non-finite one fails with DTR_NONFINITE naming the op; when an input of that op was
 * non-finite already and nothing before made it (a leaf: data or a parameter), the message
 * says so. Off, the recorder and the backward pass test one flag.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"
#include <math.h>

int dtr_context_set_anomaly(dtr_context *ctx, int on) {
    int was;
    if (!ctx) return 0;
    was = ctx->anomaly;
    ctx->anomaly = on != 0;
    return was;
}

void dtr__ctx_log(dtr_context *ctx, dtr_log_level level, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    if (!ctx || !ctx->cfg.log || ctx->cfg.log_level < level) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    ctx->cfg.log(ctx->cfg.log_user, level, msg);
}

dtr_result dtr__note(dtr_context *ctx, dtr_result code, const char *fmt, ...) {
    va_list ap;
    if (!ctx || ctx->status != DTR_OK) return code;
    va_start(ap, fmt);
    vsnprintf(ctx->msg, sizeof(ctx->msg), fmt, ap);
    va_end(ap);
    dtr__ctx_log(ctx, DTR_LOG_WARN, "%s", ctx->msg);
    return code;
}

/* "NaN", "Inf" or NULL (finite) for n floats at x in backend memory */
static const char *dtr__nonfinite_kind(dtr_context *ctx, const float *x, int64_t n) {
    double s = 0.0;
    if (!x || n <= 0 || ctx->backend->sumsq(ctx, x, n, &s) != DTR_OK) return NULL;
    if (isnan(s)) return "NaN";
    return isinf(s) ? "Inf" : NULL;
}

/* a tensor whose values the check can read: f32, bf16 or f16 (through an f32 copy), dense */
static int dtr__checkable(const dtr_tensor *t) {
    return t && t->storage && dtr__is_float(t->dtype) && dtr_tensor_is_contiguous(t);
}

/* the kind of t's non-finite values (NULL: finite, or not checkable), n the node checking */
static const char *dtr__tensor_nonfinite(dtr_context *ctx, const dtr__node *n, const dtr_tensor *t) {
    if (!dtr__checkable(t)) return NULL;
    return dtr__nonfinite_kind(ctx, dtr__f32_view(ctx, n, t), dtr_tensor_numel(t));
}

/* nodes recorded before n on its tape (its 0-based position) */
static int dtr__tape_pos(const dtr__node *n) {
    int k = 0;
    for (n = n->prev; n; n = n->prev) k++;
    return k;
}

/* " (parameter 'w')", " (data or a constant: no op made it)" or "" */
static const char *dtr__origin(const dtr_tensor *x, char *buf, size_t len) {
    if (x->flags & DTR__PARAM) snprintf(buf, len, " (parameter '%s')", x->name ? x->name : "?");
    else if (!x->node) snprintf(buf, len, " (data or a constant: no op made it)");
    else buf[0] = 0;
    return buf;
}

/* "; input 1 (4, 784) (data ...) was already non-finite" for the first such input */
static void dtr__bad_input(dtr_context *ctx, const dtr__node *n, char *buf, size_t len) {
    char shape[96], origin[160];
    int i;
    buf[0] = 0;
    for (i = 0; i < n->n_in; i++) {
        const dtr_tensor *x = n->in[i];
        const char *k = dtr__tensor_nonfinite(ctx, n, x);
        if (!k) continue;
        snprintf(buf, len, "; its input %d %s%s already held %s", i, dtr__shape_str(x, shape, sizeof shape),
                 dtr__origin(x, origin, sizeof origin), k);
        return;
    }
}

dtr_result dtr__anomaly_forward(dtr_context *ctx, const dtr__node *n) {
    char shape[96], pos[48], inputs[320];
    const char *k;
    if (!(k = dtr__tensor_nonfinite(ctx, n, n->out))) return DTR_OK;
    if (n->taped) snprintf(pos, sizeof pos, "tape position %d", dtr__tape_pos(n));
    else snprintf(pos, sizeof pos, "not on the tape");
    dtr__bad_input(ctx, n, inputs, sizeof inputs);
    return dtr__fail(ctx, DTR_NONFINITE, "anomaly: forward of op '%s' (%s) produced %s in its output %s%s",
                     dtr__op_name(n->op), pos, k, dtr__shape_str(n->out, shape, sizeof shape), inputs);
}

dtr_result dtr__anomaly_backward(dtr_context *ctx, const dtr__node *n) {
    char shape[96], origin[160];
    int i;
    for (i = 0; i < n->n_in; i++) {
        const dtr_tensor *x = n->in[i];
        const char *k = dtr__gradof(x) ? dtr__nonfinite_kind(ctx, x->grad, dtr_tensor_numel(x)) : NULL;
        if (!k) continue;
        return dtr__fail(ctx, DTR_NONFINITE, "anomaly: backward of op '%s' (tape position %d) produced %s in the "
                         "gradient of its input %d %s%s", dtr__op_name(n->op), dtr__tape_pos(n), k, i,
                         dtr__shape_str(x, shape, sizeof shape), dtr__origin(x, origin, sizeof origin));
    }
    return DTR_OK;
}
