/* ============================================================================
 * The CPU backend: host memory and the dispatch from op ids to the CPU kernels that sit
 * beside each op's builder in src/ops/.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"

/* kernels (defined in src/ops and src/optim) */
dtr_result dtr__cpu_binary_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_binary_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_unary_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_unary_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_reduce_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_reduce_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_mse_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_mse_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_cast_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_cast_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_matmul_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_matmul_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_linear_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_linear_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_softmax_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_softmax_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_cross_entropy_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_cross_entropy_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_embedding_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_embedding_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_layernorm_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_layernorm_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_dropout_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_dropout_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_conv2d_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_conv2d_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_pool2d_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_pool2d_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_view_fwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_view_bwd(dtr_context *, dtr__node *);
dtr_result dtr__cpu_optimizer_update(dtr_context *, const dtr__opt_args *);

typedef dtr_result (*dtr__kernel)(dtr_context *, dtr__node *);

static const struct { dtr__kernel fwd, bwd; } dtr__cpu_kernels[DTR_OP_COUNT] = {
    /* NONE */            {NULL, NULL},
    /* ADD..DIV */        {dtr__cpu_binary_fwd, dtr__cpu_binary_bwd}, {dtr__cpu_binary_fwd, dtr__cpu_binary_bwd},
                          {dtr__cpu_binary_fwd, dtr__cpu_binary_bwd}, {dtr__cpu_binary_fwd, dtr__cpu_binary_bwd},
    /* SCALE */           {dtr__cpu_unary_fwd, dtr__cpu_unary_bwd},
    /* RELU..SIGMOID */   {dtr__cpu_unary_fwd, dtr__cpu_unary_bwd}, {dtr__cpu_unary_fwd, dtr__cpu_unary_bwd},
                          {dtr__cpu_unary_fwd, dtr__cpu_unary_bwd}, {dtr__cpu_unary_fwd, dtr__cpu_unary_bwd},
    /* MATMUL */          {dtr__cpu_matmul_fwd, dtr__cpu_matmul_bwd},
    /* LINEAR */          {dtr__cpu_linear_fwd, dtr__cpu_linear_bwd},
    /* SOFTMAX x3 */      {dtr__cpu_softmax_fwd, dtr__cpu_softmax_bwd}, {dtr__cpu_softmax_fwd, dtr__cpu_softmax_bwd},
                          {dtr__cpu_softmax_fwd, dtr__cpu_softmax_bwd},
    /* CROSS_ENTROPY */   {dtr__cpu_cross_entropy_fwd, dtr__cpu_cross_entropy_bwd},
    /* MSE */             {dtr__cpu_mse_fwd, dtr__cpu_mse_bwd},
    /* SUM..MEAN_ALL */   {dtr__cpu_reduce_fwd, dtr__cpu_reduce_bwd}, {dtr__cpu_reduce_fwd, dtr__cpu_reduce_bwd},
                          {dtr__cpu_reduce_fwd, dtr__cpu_reduce_bwd}, {dtr__cpu_reduce_fwd, dtr__cpu_reduce_bwd},
    /* EMBEDDING */       {dtr__cpu_embedding_fwd, dtr__cpu_embedding_bwd},
    /* LAYERNORM */       {dtr__cpu_layernorm_fwd, dtr__cpu_layernorm_bwd},
    /* DROPOUT */         {dtr__cpu_dropout_fwd, dtr__cpu_dropout_bwd},
    /* CONV2D */          {dtr__cpu_conv2d_fwd, dtr__cpu_conv2d_bwd},
    /* MAX/AVG POOL */    {dtr__cpu_pool2d_fwd, dtr__cpu_pool2d_bwd}, {dtr__cpu_pool2d_fwd, dtr__cpu_pool2d_bwd},
    /* CAST */            {dtr__cpu_cast_fwd, dtr__cpu_cast_bwd},
    /* views */           {dtr__cpu_view_fwd, dtr__cpu_view_bwd}, {dtr__cpu_view_fwd, dtr__cpu_view_bwd},
                          {dtr__cpu_view_fwd, dtr__cpu_view_bwd}, {dtr__cpu_view_fwd, dtr__cpu_view_bwd},
                          {dtr__cpu_view_fwd, dtr__cpu_view_bwd}
};

static dtr_result dtr__cpu_forward(dtr_context *ctx, dtr__node *n) {
    if (n->op <= 0 || n->op >= DTR_OP_COUNT || !dtr__cpu_kernels[n->op].fwd)
        return dtr__fail(ctx, DTR_UNSUPPORTED, "cpu backend: no forward kernel for op %d", n->op);
    return dtr__cpu_kernels[n->op].fwd(ctx, n);
}

static dtr_result dtr__cpu_backward(dtr_context *ctx, dtr__node *n) {
    if (n->op <= 0 || n->op >= DTR_OP_COUNT || !dtr__cpu_kernels[n->op].bwd)
        return dtr__fail(ctx, DTR_UNSUPPORTED, "cpu backend: no backward kernel for op %d", n->op);
    return dtr__cpu_kernels[n->op].bwd(ctx, n);
}

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

static dtr_result dtr__cpu_sumsq(dtr_context *ctx, const float *x, int64_t n, double *out) {
    int64_t i;
    double s = 0.0;
    (void)ctx;
    for (i = 0; i < n; i++) s += (double)x[i] * x[i];
    *out = s;
    return DTR_OK;
}

static dtr_result dtr__cpu_scale(dtr_context *ctx, float *x, int64_t n, float s) {
    int64_t i;
    (void)ctx;
    for (i = 0; i < n; i++) x[i] *= s;
    return DTR_OK;
}

static dtr_result dtr__cpu_sync(dtr_context *ctx) { (void)ctx; return DTR_OK; }

const dtr_backend dtr__cpu_backend = {
    DTR_VERSION_NUMBER,
    "cpu",
    NULL,
    NULL,
    dtr__cpu_mem_alloc,
    dtr__cpu_mem_free,
    dtr__cpu_mem_alloc,
    dtr__cpu_mem_free,
    dtr__cpu_memset0,
    dtr__cpu_copy,
    dtr__cpu_copy,
    dtr__cpu_forward,
    dtr__cpu_backward,
    dtr__cpu_optimizer_update,
    dtr__cpu_sumsq,
    dtr__cpu_scale,
    dtr__cpu_sync
};
