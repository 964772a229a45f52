/* ============================================================================
 * Hybrid grids: a world of D * P * T ranks laid out as data x pipeline x tensor groups.
 * World rank r has tensor rank t = r mod T (innermost: the T ranks of a tensor group are
 * neighbours, so they share a host when hosts hold whole tensor groups), data rank
 * d = (r / T) mod D and pipeline rank p = r / (T * D) (outermost, as Megatron-LM lays it
 * out). Each rank belongs to one group of each kind, made by dtr_comm_split.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "../core/internal.h"

static dtr_result dtr__grid_split(dtr_comm *world, int color, int key, dtr_comm **out, const char *what, char *err,
                                  size_t errlen) {
    dtr_result r = dtr_comm_split(world, color, key, out);
    if (r != DTR_OK && err && errlen)
        snprintf(err, errlen, "dtr_grid_create: splitting the %s groups: %s", what, dtr_comm_last_error(world));
    return r;
}

dtr_result dtr_grid_create(dtr_comm *world, int dp, int pp, int tp, dtr_grid *out, char *err, size_t errlen) {
    int n, r, t, d, p;
    dtr_result res;
    if (err && errlen) err[0] = 0;
    if (!world || !out) return DTR_NULL_HANDLE;
    memset(out, 0, sizeof(*out));
    n = dtr_comm_size(world), r = dtr_comm_rank(world);
    if (dp < 1 || pp < 1 || tp < 1 || (int64_t)dp * pp * tp != n) {
        if (err && errlen)
            snprintf(err, errlen, "dtr_grid_create: data %d x pipeline %d x tensor %d is not the %d ranks of the group",
                     dp, pp, tp, n);
        return DTR_INVALID_ARGUMENT;
    }
    t = r % tp, d = (r / tp) % dp, p = r / (tp * dp);
    out->dp_size = dp, out->pp_size = pp, out->tp_size = tp;
    out->dp_rank = d, out->pp_rank = p, out->tp_rank = t;
    res = dtr__grid_split(world, p * dp + d, t, &out->tp, "tensor", err, errlen);
    if (res == DTR_OK) res = dtr__grid_split(world, p * tp + t, d, &out->dp, "data", err, errlen);
    if (res == DTR_OK) res = dtr__grid_split(world, d * tp + t, p, &out->pp, "pipeline", err, errlen);
    if (res != DTR_OK) dtr_grid_destroy(out);
    return res;
}

void dtr_grid_destroy(dtr_grid *g) {
    if (!g) return;
    dtr_comm_destroy(g->pp);
    dtr_comm_destroy(g->dp);
    dtr_comm_destroy(g->tp);
    g->pp = g->dp = g->tp = NULL;
}
