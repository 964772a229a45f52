/* ============================================================================
 * Dynamic loss scaling for low-precision training (fp16 gradients underflow without it):
 * the loss is multiplied by a scale before backward, and before the optimizer step the
 * gradients are divided by it and checked. Non-finite gradients skip the step (reported, and
 * counted), halve the scale and clear the gradients; `growth_interval` good steps in a row
 * double it. The schedule of PyTorch's GradScaler. The scale and counters are state entries,
 * so a full-state checkpoint resumes them. Gradients are read through the backend (scale,
 * sumsq), so it works on any backend.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include <math.h>
#include <stdarg.h>

struct dtr_loss_scaler {
    dtr_loss_scaler_config cfg;
    float scale;
    int64_t good;       /* finite steps since the scale last changed */
    int64_t skipped;    /* steps skipped for non-finite gradients */
};

dtr_loss_scaler_config dtr_loss_scaler_config_init(void) {
    dtr_loss_scaler_config c;
    memset(&c, 0, sizeof c);
    c.init_scale = 65536.0f;
    c.growth_factor = 2.0f;
    c.backoff_factor = 0.5f;
    c.growth_interval = 2000;
    c.min_scale = 1.0f;
    c.max_scale = 16777216.0f;
    return c;
}

dtr_result dtr_loss_scaler_create(const dtr_loss_scaler_config *cfg, dtr_loss_scaler **out) {
    dtr_loss_scaler_config c = cfg ? *cfg : dtr_loss_scaler_config_init();
    dtr_loss_scaler *ls;
    if (!out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (!(c.init_scale > 0.0f) || !(c.growth_factor >= 1.0f) || !(c.backoff_factor > 0.0f && c.backoff_factor < 1.0f) ||
        c.growth_interval < 1 || !(c.min_scale > 0.0f) || !(c.max_scale >= c.min_scale) || !isfinite(c.max_scale))
        return DTR_INVALID_ARGUMENT;
    ls = (dtr_loss_scaler *)dtr__calloc(NULL, sizeof *ls);
    if (!ls) return DTR_OUT_OF_MEMORY;
    ls->cfg = c;
    ls->scale = c.init_scale < c.min_scale ? c.min_scale : c.init_scale > c.max_scale ? c.max_scale : c.init_scale;
    *out = ls;
    return DTR_OK;
}

void dtr_loss_scaler_destroy(dtr_loss_scaler *ls) { dtr__free(NULL, ls); }

dtr_tensor *dtr_loss_scaler_scale(dtr_loss_scaler *ls, dtr_context *ctx, dtr_tensor *loss) {
    if (!ctx) return NULL;
    if (!ls) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_loss_scaler_scale: scaler is NULL");
    if (ctx->capturing)   /* a replay would keep the capture's scale after dtr_loss_scaler_step changed it */
        return dtr__failt(ctx, DTR_UNSUPPORTED, "dtr_loss_scaler_scale: inside a captured step (dtr_graph_capture's fn): "
                          "the scale changes between steps and a replay would keep the capture's");
    return dtr_scale(ctx, loss, ls->scale);
}

/* A warning through the context's log callback, when it asked for warnings. */
static void dtr__ls_warn(dtr_context *ctx, const char *fmt, ...) DTR__PRINTF(2, 3);
static void dtr__ls_warn(dtr_context *ctx, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    if (!ctx->cfg.log || ctx->cfg.log_level < DTR_LOG_WARN) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ctx->cfg.log(ctx->cfg.log_user, DTR_LOG_WARN, msg);
}

/* After a finite step: count it, and grow the scale every growth_interval of them. */
static void dtr__ls_good(dtr_loss_scaler *ls) {
    if (++ls->good < ls->cfg.growth_interval) return;
    ls->good = 0;
    ls->scale = ls->scale * ls->cfg.growth_factor > ls->cfg.max_scale ? ls->cfg.max_scale : ls->scale * ls->cfg.growth_factor;
}

dtr_result dtr_loss_scaler_step(dtr_loss_scaler *ls, dtr_model *m, dtr_optimizer *opt, int *stepped) {
    dtr_context *ctx;
    float *g;
    int64_t n;
    double norm = 0.0;
    dtr_result r;
    if (stepped) *stepped = 0;
    if (!ls || !m || !opt) return DTR_NULL_HANDLE;
    ctx = dtr_model_context(m);
    g = dtr_model_grads(m);
    n = dtr_model_numel(m);
    if (!g && n > 0) return dtr__fail(ctx, DTR_BAD_STATE, "dtr_loss_scaler_step: the model has no gradients (run backward first)");
    if (!dtr__optimizer_updates_next(opt))   /* accumulating: the scaled micro-batches add up first */
        return dtr_optimizer_step(opt, stepped);
    /* the norm every rank agrees on: with ZeRO each rank holds the average of its shard only
       (elsewhere its own gradients), so the check sums the shards over the group */
    if (n > 0 && ((r = dtr__model_grad_scale(m, 1.0f / ls->scale)) != DTR_OK ||
                  (r = dtr__optimizer_grad_norm(opt, &norm)) != DTR_OK))
        return r;
    if (!isfinite(norm)) {   /* an inf or NaN somewhere: skip, back off, start the accumulation over */
        ls->skipped++;
        ls->good = 0;
        ls->scale = ls->scale * ls->cfg.backoff_factor < ls->cfg.min_scale ? ls->cfg.min_scale : ls->scale * ls->cfg.backoff_factor;
        dtr__ls_warn(ctx, "loss scaler: non-finite gradients, step skipped (%lld so far); scale now %g",
                 (long long)ls->skipped, (double)ls->scale);
        dtr__optimizer_restart_accum(opt);
        return dtr_model_zero_grad(m);
    }
    {
        int updated = 0;
        dtr__optimizer_give_norm(opt, norm);   /* the step clips by it without a second sum */
        if ((r = dtr_optimizer_step(opt, &updated)) != DTR_OK) return r;
        if (stepped) *stepped = updated;
        if (updated) dtr__ls_good(ls);
    }
    return DTR_OK;
}

float dtr_loss_scaler_value(const dtr_loss_scaler *ls) { return ls ? ls->scale : 0.0f; }
int64_t dtr_loss_scaler_skipped(const dtr_loss_scaler *ls) { return ls ? ls->skipped : 0; }

dtr_result dtr_loss_scaler_state(dtr_loss_scaler *ls, int index, dtr_state_entry *out) {
    if (!ls || !out) return DTR_NULL_HANDLE;
    if (index == 0) return dtr__state_put(out, "scale", &ls->scale, sizeof ls->scale, 0);
    if (index == 1) return dtr__state_put(out, "good", &ls->good, sizeof ls->good, 0);
    if (index == 2) return dtr__state_put(out, "skipped", &ls->skipped, sizeof ls->skipped, 0);
    return DTR_NOT_FOUND;
}

dtr_result dtr_loss_scaler_state_loaded(dtr_loss_scaler *ls) {
    if (!ls) return DTR_NULL_HANDLE;
    if (!(ls->scale >= ls->cfg.min_scale && ls->scale <= ls->cfg.max_scale) || ls->good < 0 || ls->skipped < 0)
        return DTR_CORRUPT_FILE;
    return DTR_OK;
}
