/* ============================================================================
 * The CPU backend: host memory and the dispatch from op ids to the CPU kernels that sit
 * beside each op's builder in src/ops/.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"
#include "../comm/comm_internal.h"

/* ---- dispatch (shared by every backend) ---- */

int dtr__table_has(const dtr__kernel_pair *table, int op) {
    return op > 0 && op < DTR_OP_COUNT && table[op].fwd != NULL;
}

dtr_result dtr__table_run(const dtr__kernel_pair *table, const char *backend, dtr_context *ctx, dtr__node *n, int bwd) {
    if (!dtr__table_has(table, n->op))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "%s backend: op %d (%s) has no %s kernel in this version", backend, n->op,
                         dtr__op_name(n->op), bwd ? "backward" : "forward");
    if (!table[n->op].narrow && dtr__needs_widening(n, bwd))
        return dtr__run_widened(table[DTR_OP_CAST].fwd, bwd ? table[n->op].bwd : table[n->op].fwd, ctx, n, bwd);
    return bwd ? table[n->op].bwd(ctx, n) : table[n->op].fwd(ctx, n);
}

/* The CPU kernels (src/ops/, declared in internal.h), tabled from the op list: entry
 * X(ID, name, k) runs dtr__cpu_k_fwd / dtr__cpu_k_bwd. They read and write f32: 16-bit
 * tensors are widened around them (none is `narrow`). */
#define DTR__CPU_ENTRY(id, name, k) {dtr__cpu_##k##_fwd, dtr__cpu_##k##_bwd, 0},
static const dtr__kernel_pair dtr__cpu_kernels[DTR_OP_COUNT] = {
    {NULL, NULL, 0}, /* DTR_OP_NONE */
    DTR__OP_LIST(DTR__CPU_ENTRY)
};
#undef DTR__CPU_ENTRY

static int dtr__cpu_supports_op(const dtr_context *ctx, int op) { (void)ctx; return dtr__table_has(dtr__cpu_kernels, op); }
static dtr_result dtr__cpu_forward(dtr_context *ctx, dtr__node *n) { return dtr__table_run(dtr__cpu_kernels, "cpu", ctx, n, 0); }
static dtr_result dtr__cpu_backward(dtr_context *ctx, dtr__node *n) { return dtr__table_run(dtr__cpu_kernels, "cpu", ctx, n, 1); }

static void *dtr__cpu_mem_alloc(dtr_context *ctx, size_t bytes) { return dtr__malloc(&ctx->alloc, bytes); }
static void dtr__cpu_mem_free(dtr_context *ctx, void *p) { dtr__free(&ctx->alloc, p); }

static dtr_result dtr__cpu_memset0(dtr_context *ctx, void *dst, size_t bytes) {
    (void)ctx;
    memset(dst, 0, bytes);
    return DTR_OK;
}

static dtr_result dtr__cpu_copy(dtr_context *ctx, void *dst, const void *src, size_t bytes) {
    (void)ctx;
    if (bytes) memmove(dst, src, bytes);
    return DTR_OK;
}

/* The sum of x[i]^2 in double: element i goes to running sum i mod 8 (independent chains the
 * CPU overlaps), the sums are added pairwise at the end, then the tail: the same bits for any
 * thread count, about 4x the single chain's speed (the optimizer's non-finite check runs this
 * on every update). Eight named sums, not an array: GCC kept an array on the stack (a load
 * and a store an element); these stay in registers, paired into vectors. */
DTR__SIMD_BODY double dtr__sumsq_body(const float *x, int64_t n) {
    double a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0, s;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float *v = x + i;
        a0 += (double)v[0] * v[0], a1 += (double)v[1] * v[1], a2 += (double)v[2] * v[2], a3 += (double)v[3] * v[3];
        a4 += (double)v[4] * v[4], a5 += (double)v[5] * v[5], a6 += (double)v[6] * v[6], a7 += (double)v[7] * v[7];
    }
    s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
    for (; i < n; i++) s += (double)x[i] * x[i];
    return s;
}

static double dtr__sumsq_plain(const float *x, int64_t n) { return dtr__sumsq_body(x, n); }
DTR__TARGET_AVX2 static double dtr__sumsq_avx2(const float *x, int64_t n) { return dtr__sumsq_body(x, n); }

static dtr_result dtr__cpu_sumsq(dtr_context *ctx, const float *x, int64_t n, double *out) {
    (void)ctx;
    *out = dtr__simd_avx2() ? dtr__sumsq_avx2(x, n) : dtr__sumsq_plain(x, n);
    return DTR_OK;
}

static dtr_result dtr__cpu_scale(dtr_context *ctx, float *x, int64_t n, float s) {
    int64_t i;
    (void)ctx;
    for (i = 0; i < n; i++) x[i] *= s;
    return DTR_OK;
}

static dtr_result dtr__cpu_reduce(dtr_context *ctx, void *out, const void *a, const void *b, size_t n, dtr_dtype dt,
                                  int op, int div) {
    (void)ctx;
    dtr__comm_reduce(out, a, b, n, dt, (dtr_reduce_op)op, div);
    return DTR_OK;
}

/* Every call completes before it returns: events are NULL (complete). */
static dtr_result dtr__cpu_event_record(dtr_context *ctx, dtr_event **ev) { (void)ctx; *ev = NULL; return DTR_OK; }
static dtr_result dtr__cpu_event_wait(dtr_context *ctx, dtr_event *ev) { (void)ctx; (void)ev; return DTR_OK; }
static dtr_result dtr__cpu_event_query(dtr_context *ctx, dtr_event *ev, int *done) {
    (void)ctx; (void)ev;
    *done = 1;
    return DTR_OK;
}

static dtr_result dtr__cpu_sync(dtr_context *ctx) { (void)ctx; return DTR_OK; }

const dtr_backend dtr__cpu_backend = {
    DTR_VERSION_NUMBER,
    sizeof(dtr_backend),
    "cpu",
    DTR__CAP_HOST_MEMORY,
    NULL,
    NULL,
    dtr__cpu_mem_alloc,
    dtr__cpu_mem_free,
    dtr__cpu_mem_alloc,
    dtr__cpu_mem_free,
    dtr__cpu_memset0,
    dtr__cpu_copy,
    dtr__cpu_copy,
    dtr__cpu_supports_op,
    dtr__cpu_forward,
    dtr__cpu_backward,
    dtr__cpu_optimizer_update,
    dtr__cpu_sumsq,
    dtr__cpu_scale,
    dtr__cpu_reduce,
    dtr__cpu_event_record,
    dtr__cpu_event_wait,
    dtr__cpu_event_query,
    dtr__cpu_sync,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL, NULL, NULL, NULL,  /* graphs: dtr_graph_launch calls the step function again */
    NULL,                    /* copy2d: dtr__mem_copy2d copies row by row */
    dtr__cpu_vocab_xent,
    dtr__cpu_codec,
    dtr__cpu_powersgd,
    NULL, NULL               /* mem_reserve, mem_back: host pages go back with dtr__mem_discard */
};
