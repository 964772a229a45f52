/* ============================================================================
 * Communication on the tape, for tensor parallelism (Megatron-LM's f and g): the ranks of a
 * group each hold a slice of a layer, and these ops join their partial results.
 *   TP_COPY    forward: y = x (every rank already holds all of x);
 *              backward: gx += all_reduce_sum(gy) (each rank's slice contributed to gy)
 *   TP_REDUCE  forward: y = all_reduce_sum(x) (each rank holds a partial sum);
 *              backward: gx += gy
 * Shapes: any; y has x's shape. Every rank of the group must build the same ops in the same
 * order (they are collectives). The group's buffers are the backend's tensors (cfg.memory).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "../core/internal.h"

static dtr_tensor *dtr__tp(dtr_context *ctx, int op, const char *name, dtr_tensor *x, dtr_comm *comm) {
    dtr__node *n;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, name, x, "x")) return NULL;
    if (!comm) return dtr__failt(ctx, DTR_NULL_HANDLE, "%s: comm is NULL", name);
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, op, 1, &x);
    if (!n) return NULL;
    n->p.comm = comm;
    n->out = dtr__tensor_alloc(ctx, DTR_F32, x->ndim, x->shape, name);
    if (!n->out) return NULL;
    return dtr__record(ctx, n, name);
}

dtr_tensor *dtr_tp_copy(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_COPY, "dtr_tp_copy", x, comm); }
dtr_tensor *dtr_tp_reduce(dtr_context *ctx, dtr_tensor *x, dtr_comm *comm) { return dtr__tp(ctx, DTR_OP_TP_REDUCE, "dtr_tp_reduce", x, comm); }

/* in-place sum over the group, with the group's error on the context */
static dtr_result dtr__tp_all_reduce(dtr_context *ctx, const dtr__node *nd, float *buf, int64_t n) {
    dtr_result r = dtr_comm_all_reduce(nd->p.comm, buf, buf, (size_t)n, DTR_F32, DTR_REDUCE_SUM);
    if (r != DTR_OK)
        return dtr__fail(ctx, r, "%s: all-reduce over the group failed: %s", dtr__op_name(nd->op), dtr_comm_last_error(nd->p.comm));
    return DTR_OK;
}

dtr_result dtr__cpu_comm_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    memcpy(dtr__f32(nd->out), dtr__f32(nd->in[0]), (size_t)n * sizeof(float));
    return nd->op == DTR_OP_TP_REDUCE ? dtr__tp_all_reduce(ctx, nd, dtr__f32(nd->out), n) : DTR_OK;
}

dtr_result dtr__cpu_comm_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t i, n = dtr_tensor_numel(nd->out);
    float *gx = dtr__gradof(nd->in[0]), *g = nd->out->grad, *sum;
    dtr_result r;
    if (nd->op == DTR_OP_TP_REDUCE) {
        if (gx) for (i = 0; i < n; i++) gx[i] += g[i];
        return DTR_OK;
    }
    /* every rank takes part in the all-reduce, whether or not its x needs a gradient */
    sum = (float *)dtr__arena_data(ctx, (size_t)(n ? n : 1) * sizeof(float), "dtr_tp_copy backward");
    if (!sum) return ctx->status;
    memcpy(sum, g, (size_t)n * sizeof(float));
    if ((r = dtr__tp_all_reduce(ctx, nd, sum, n)) != DTR_OK) return r;
    if (gx) for (i = 0; i < n; i++) gx[i] += sum[i];
    return DTR_OK;
}
