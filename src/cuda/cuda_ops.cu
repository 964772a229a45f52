/* ============================================================================
 * CUDA kernels of the op list, each pair with the CPU pair's signature and meaning
 * (src/ops/): element-wise (broadcast binary, unary through the shared formulas), reductions,
 * MSE, casts, dropout (the CPU's random stream, jumped ahead per element), the softmax
 * family, cross-entropy, embedding, layer norm, views and activation-checkpoint copies.
 * Shapes: R rows of length C (leading axes flattened), as in the CPU files.
 * Order: sums that the CPU takes in order (gradients of broadcast inputs, embedding weight
 * gradients) are taken in the same order by one thread per output element, so they match the
 * CPU bit for bit; column sums over many rows (layer-norm weight and bias gradients, linear
 * bias gradients) go in fixed chunks of rows, and row reductions (softmax, layer norm
 * statistics, loss sums) are trees in double: equal to rounding, and repeatable.
 * ==========================================================================*/

/* ---- unary: y = f(x), gx += g f'(x) ---- */

__device__ static float dtr__cuda_unary_f(int op, float x, dtr__unary_params p) {
    switch (op) {
    case DTR_OP_SCALE: return p.a * x;
    case DTR_OP_RELU: return dtr__f_relu(x);
    case DTR_OP_GELU: return dtr__f_gelu(x);
    case DTR_OP_TANH: return dtr__f_tanh(x);
    case DTR_OP_ABS: return fabsf(x);
    case DTR_OP_GELU_ERF: return dtr__f_gelu_erf(x);
    case DTR_OP_SILU: return dtr__f_silu(x);
    case DTR_OP_EXP: return dtr__f_exp(x);
    case DTR_OP_LOG: return logf(x);
    case DTR_OP_SQRT: return sqrtf(x);
    case DTR_OP_POW: return powf(x, p.a);
    case DTR_OP_CLAMP: return dtr__f_clamp(x, p.a, p.b);
    case DTR_OP_LEAKY_RELU: return dtr__f_leaky_relu(x, p.a);
    case DTR_OP_SOFTPLUS: return dtr__f_softplus(x, p.a, p.b);
    default: return dtr__f_sigmoid(x);
    }
}

/* g dy/dx from x and y (tanh, sigmoid, exp and sqrt use y) in the CPU's arithmetic: log's and
   sqrt's divide (g / x, g / (2 y)), the others multiply g by the derivative */
__device__ static float dtr__cuda_unary_grad(int op, float g, float x, float y, dtr__unary_params p) {
    switch (op) {
    case DTR_OP_SCALE: return p.a * g;
    case DTR_OP_RELU: return g * dtr__f_relu_grad(x);
    case DTR_OP_GELU: return g * dtr__f_gelu_grad(x);
    case DTR_OP_TANH: return g * dtr__f_tanh_grad(y);
    case DTR_OP_ABS: return g * dtr__f_abs_grad(x);
    case DTR_OP_GELU_ERF: return g * dtr__f_gelu_erf_grad(x);
    case DTR_OP_SILU: return g * dtr__f_silu_grad(x);
    case DTR_OP_EXP: return g * y;
    case DTR_OP_LOG: return g / x;
    case DTR_OP_SQRT: return g / (2.0f * y);
    case DTR_OP_POW: return g * dtr__f_pow_grad(x, p.a);
    case DTR_OP_CLAMP: return g * dtr__f_clamp_grad(x, p.a, p.b);
    case DTR_OP_LEAKY_RELU: return g * dtr__f_leaky_relu_grad(x, p.a);
    case DTR_OP_SOFTPLUS: return g * dtr__f_softplus_grad(x, p.a, p.b);
    default: return g * dtr__f_sigmoid_grad(y);
    }
}

__global__ static void dtr__cuda_unary_fwd_k(int op, dtr__unary_params p, dtr__cuda_mem x, dtr__cuda_mem y, int64_t n) {
    DTR__CUDA_FOR(i, n) y.st(i, dtr__cuda_unary_f(op, x.ld(i), p));
}

__global__ static void dtr__cuda_unary_bwd_k(int op, dtr__unary_params p, dtr__cuda_mem x, dtr__cuda_mem y, const float *g,
                                             float *gx, int64_t n) {
    DTR__CUDA_FOR(i, n) gx[i] += dtr__cuda_unary_grad(op, g[i], x.ld(i), y.ld(i), p);
}

/* x, y, gx: (N) */
static dtr_result dtr__cuda_unary_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    if (n == 0) return DTR_OK;
    dtr__cuda_unary_fwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        nd->op, nd->p.unary, dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->out), n);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_unary_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    float *gx = dtr__gradof(nd->in[0]);
    if (!gx || n == 0) return DTR_OK;
    dtr__cuda_unary_bwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        nd->op, nd->p.unary, dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->out), nd->out->grad, gx, n);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- binary with broadcasting: y = a op b ---- */

/* The output's shape and, over its axes, the strides of a and b (views; 0 where broadcast)
 * and of their dense gradients. */
typedef struct dtr__cuda_bcast {
    int nd;
    int64_t shape[DTR_MAX_DIMS], sa[DTR_MAX_DIMS], sb[DTR_MAX_DIMS], ga[DTR_MAX_DIMS], gb[DTR_MAX_DIMS];
    int64_t oa, ob;   /* the views' offsets */
} dtr__cuda_bcast;

static dtr__cuda_bcast dtr__cuda_bcast_make(const dtr_tensor *a, const dtr_tensor *b) {
    dtr__cuda_bcast bc;
    int64_t gsa[DTR_MAX_DIMS], gsb[DTR_MAX_DIMS];
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim, d;
    memset(&bc, 0, sizeof bc);
    dtr__contig_strides(a->ndim, a->shape, gsa);
    dtr__contig_strides(b->ndim, b->shape, gsb);
    bc.nd = nd;
    bc.oa = a->offset;
    bc.ob = b->offset;
    for (d = 0; d < nd; d++) {
        int da = d - (nd - a->ndim), db = d - (nd - b->ndim);
        int64_t na = da >= 0 ? a->shape[da] : 1, nb = db >= 0 ? b->shape[db] : 1;
        bc.shape[d] = (na == 0 || nb == 0) ? 0 : na > nb ? na : nb;
        bc.sa[d] = (da >= 0 && na != 1) ? a->stride[da] : 0;
        bc.sb[d] = (db >= 0 && nb != 1) ? b->stride[db] : 0;
        bc.ga[d] = (da >= 0 && na != 1) ? gsa[da] : 0;
        bc.gb[d] = (db >= 0 && nb != 1) ? gsb[db] : 0;
    }
    return bc;
}

__device__ static float dtr__cuda_binary_f(int op, float a, float b) {
    switch (op) {
    case DTR_OP_ADD: return a + b;
    case DTR_OP_SUB: return a - b;
    case DTR_OP_MUL: return a * b;
    case DTR_OP_MAXIMUM: return dtr__f_maximum(a, b);
    case DTR_OP_MINIMUM: return dtr__f_minimum(a, b);
    default: return a / b;
    }
}

/* what input `side` (0: a, 1: b) gets of the output's gradient g, as the CPU adds it */
__device__ static float dtr__cuda_binary_grad(int op, int side, float g, float a, float b) {
    switch (op) {
    case DTR_OP_ADD: return g;
    case DTR_OP_SUB: return side ? -g : g;
    case DTR_OP_MUL: return g * (side ? a : b);
    case DTR_OP_MAXIMUM:
    case DTR_OP_MINIMUM: return g * (side ? dtr__f_pick_share(b, a, op == DTR_OP_MAXIMUM) : dtr__f_pick_share(a, b, op == DTR_OP_MAXIMUM));
    default: return side ? -(g * a / (b * b)) : g / b;
    }
}

__global__ static void dtr__cuda_binary_fwd_k(int op, dtr__cuda_bcast bc, dtr__cuda_mem A, dtr__cuda_mem B, dtr__cuda_mem Y,
                                              int64_t n) {
    DTR__CUDA_FOR(i, n) {
        int64_t r = i, oa = bc.oa, ob = bc.ob;
        for (int d = bc.nd - 1; d >= 0; d--) {
            int64_t k = r % bc.shape[d];
            r /= bc.shape[d];
            oa += k * bc.sa[d];
            ob += k * bc.sb[d];
        }
        Y.st(i, dtr__cuda_binary_f(op, A.ld(oa), B.ld(ob)));
    }
}

/* The gradient of one input ("self": a when side is 0, b when 1) over its dense elements:
 * one thread per element sums, in the output's row-major order (the CPU's), the
 * contributions of every output position it was broadcast to. */
__global__ static void dtr__cuda_binary_bwd_k(int op, int side, dtr__cuda_bcast bc, dtr__cuda_mem A, dtr__cuda_mem B,
                                              const float *G, float *GS, int64_t n_self) {
    const int64_t *gself = side ? bc.gb : bc.ga;
    int64_t ostr[DTR_MAX_DIMS], acc_n = 1;
    int d;
    for (d = bc.nd - 1; d >= 0; d--) {
        ostr[d] = acc_n;
        acc_n *= bc.shape[d];
    }
    DTR__CUDA_FOR(j, n_self) {
        int64_t fixed[DTR_MAX_DIMS], rem = j, reps = 1;
        float acc = GS[j];
        /* the element's index on its own axes (stride != 0), from the innermost */
        for (d = bc.nd - 1; d >= 0; d--) {
            fixed[d] = 0;
            if (gself[d] != 0) { fixed[d] = rem % bc.shape[d]; rem /= bc.shape[d]; }
            else reps *= bc.shape[d];
        }
        for (int64_t t = 0; t < reps; t++) {
            int64_t q = t, o = 0, oa = bc.oa, ob = bc.ob;
            for (d = bc.nd - 1; d >= 0; d--) {
                int64_t k = fixed[d];
                if (gself[d] == 0) { k = q % bc.shape[d]; q /= bc.shape[d]; }
                o += k * ostr[d];
                oa += k * bc.sa[d];
                ob += k * bc.sb[d];
            }
            acc += dtr__cuda_binary_grad(op, side, G[o], A.ld(oa), B.ld(ob));
        }
        GS[j] = acc;
    }
}

/* Same-shape dense inputs (the common case: residual adds, products): index i everywhere */
__global__ static void dtr__cuda_binary_dense_fwd_k(int op, dtr__cuda_mem A, dtr__cuda_mem B, dtr__cuda_mem Y, int64_t n) {
    DTR__CUDA_FOR(i, n) Y.st(i, dtr__cuda_binary_f(op, A.ld(i), B.ld(i)));
}

__global__ static void dtr__cuda_binary_dense_bwd_k(int op, int side, dtr__cuda_mem A, dtr__cuda_mem B, const float *G,
                                                    float *GS, int64_t n) {
    DTR__CUDA_FOR(i, n) GS[i] += dtr__cuda_binary_grad(op, side, G[i], A.ld(i), B.ld(i));
}

/* 1 when a and b are dense and of the output's shape (no broadcasting) */
static int dtr__cuda_binary_dense(const dtr__node *nd) {
    const dtr_tensor *a = nd->in[0], *b = nd->in[1];
    return dtr_tensor_is_contiguous(a) && dtr_tensor_is_contiguous(b) && dtr_tensor_numel(a) == dtr_tensor_numel(nd->out) &&
           dtr_tensor_numel(b) == dtr_tensor_numel(nd->out);
}

/* a (...), b (...) broadcast to y (...) */
static dtr_result dtr__cuda_binary_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_bcast bc = dtr__cuda_bcast_make(nd->in[0], nd->in[1]);
    int64_t n = dtr_tensor_numel(nd->out);
    if (n == 0) return DTR_OK;
    if (dtr__cuda_binary_dense(nd)) {
        dtr__cuda_binary_dense_fwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
            nd->op, dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->in[1]), dtr__cuda_mem_of(nd->out), n);
        return dtr__cuda_launched(ctx, nd);
    }
    dtr__cuda_binary_fwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        nd->op, bc, dtr__cuda_storage_of(nd->in[0]), dtr__cuda_storage_of(nd->in[1]), dtr__cuda_mem_of(nd->out), n);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_binary_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_bcast bc = dtr__cuda_bcast_make(nd->in[0], nd->in[1]);
    int side;
    if (dtr_tensor_numel(nd->out) == 0) return DTR_OK;
    for (side = 0; side < 2; side++) {
        float *gs = dtr__gradof(nd->in[side]);
        int64_t n = dtr_tensor_numel(nd->in[side]);
        if (!gs || n == 0) continue;
        if (dtr__cuda_binary_dense(nd))
            dtr__cuda_binary_dense_bwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
                nd->op, side, dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->in[1]), nd->out->grad, gs, n);
        else dtr__cuda_binary_bwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
            nd->op, side, bc, dtr__cuda_storage_of(nd->in[0]), dtr__cuda_storage_of(nd->in[1]), nd->out->grad, gs, n);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    }
    return DTR_OK;
}

/* ---- reductions: sum / mean over an axis or over everything ---- */

/* x viewed as (outer, len, inner) around the axis; y (outer, inner), each summed in double
 * in the CPU's order (x and y f32 or 16-bit: the widened values, y rounded once). */
__global__ static void dtr__cuda_reduce_axis_k(dtr__cuda_mem x, dtr__cuda_mem y, int64_t outer, int64_t len, int64_t inner, int mean) {
    DTR__CUDA_FOR(t, outer * inner) {
        int64_t o = t / inner, i = t % inner;
        double s = 0.0;
        for (int64_t k = 0; k < len; k++) s += x.ld((o * len + k) * inner + i);
        if (mean) s /= (double)len;
        y.st(t, (float)s);
    }
}

__global__ static void dtr__cuda_store_sum_k(const double *sum, float *y, double div) {
    if (threadIdx.x == 0 && blockIdx.x == 0) y[0] = (float)(div != 1.0 ? sum[0] / div : sum[0]);
}

/* A sum over everything (kind: plain, squares of a, squares of a - b) into y[0] (f32), / div. */
static dtr_result dtr__cuda_sum_to(dtr_context *ctx, const dtr__node *nd, int kind, dtr__cuda_mem a, dtr__cuda_mem b,
                                   int64_t n, float *y, double div) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    if (dtr__cuda_sum(ctx, kind, a, b, n, s->partial) != DTR_OK) return ctx->status;
    dtr__cuda_store_sum_k<<<1, 1, 0, s->stream>>>(s->partial, y, div);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_reduce_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_mem x = dtr__cuda_mem_of(nd->in[0]), y = dtr__cuda_mem_of(nd->out);
    int64_t outer, len, inner;
    if (nd->op == DTR_OP_SUM_ALL || nd->op == DTR_OP_MEAN_ALL) {   /* (an f32 output) */
        int64_t n = dtr_tensor_numel(nd->in[0]);
        return dtr__cuda_sum_to(ctx, nd, DTR__CUDA_SUM_PLAIN, x, dtr__cuda_mem_of(NULL), n, dtr__f32(nd->out),
                                nd->op == DTR_OP_MEAN_ALL ? (double)n : 1.0);
    }
    dtr__axis_split(nd->in[0], nd->p.axis, &outer, &len, &inner);
    if (outer * inner == 0) return DTR_OK;
    dtr__cuda_reduce_axis_k<<<dtr__cuda_grid(outer * inner), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        x, y, outer, len, inner, nd->op == DTR_OP_MEAN);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- the largest value along an axis (MAX: values, kept indices; ARGMAX: i32 indices) ---- */

/* one thread per (outer, inner) position: the shared scan (dtr__f_argmax) over its len values */
__global__ static void dtr__cuda_argmax_k(const float *x, float *y, int32_t *idx, int64_t outer, int64_t len, int64_t inner) {
    DTR__CUDA_FOR(t, outer * inner) {
        float best;
        idx[t] = dtr__f_argmax(x + (t / inner) * len * inner + t % inner, len, inner, &best);
        if (y) y[t] = best;
    }
}

/* gx[the largest] += g: each position adds into its own column of x (no two threads meet) */
__global__ static void dtr__cuda_argmax_bwd_k(const float *g, const int32_t *idx, float *gx, int64_t len, int64_t inner, int64_t n) {
    DTR__CUDA_FOR(t, n) gx[((t / inner) * len + idx[t]) * inner + t % inner] += g[t];
}

static dtr_result dtr__cuda_argmax_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t outer, len, inner, n = dtr_tensor_numel(nd->out);
    int max = nd->op == DTR_OP_MAX;
    if (max && !(nd->saved = dtr__node_save(ctx, nd, (size_t)(n ? n : 1) * sizeof(int32_t)))) return ctx->status;
    if (n == 0) return DTR_OK;
    dtr__axis_split(nd->in[0], nd->p.axis, &outer, &len, &inner);
    dtr__cuda_argmax_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        (const float *)dtr__data(nd->in[0]), max ? dtr__f32(nd->out) : NULL, max ? (int32_t *)nd->saved : (int32_t *)dtr__data(nd->out),
        outer, len, inner);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_argmax_bwd(dtr_context *ctx, dtr__node *nd) {
    float *gx = dtr__gradof(nd->in[0]);
    int64_t outer, len, inner, n = dtr_tensor_numel(nd->out);
    if (!gx || nd->op != DTR_OP_MAX || n == 0) return DTR_OK;
    dtr__axis_split(nd->in[0], nd->p.axis, &outer, &len, &inner);
    dtr__cuda_argmax_bwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(nd->out->grad, (const int32_t *)nd->saved,
                                                                                          gx, len, inner, n);
    return dtr__cuda_launched(ctx, nd);
}

/* gx (outer, len, inner) += g (outer, inner) * sc; an all-reduction's g is one value, divided
 * by the len = n elements for a mean (the CPU's g / n). */
__global__ static void dtr__cuda_reduce_bwd_k(const float *g, float *gx, int64_t outer, int64_t len, int64_t inner, int all,
                                              int mean_all, float sc) {
    DTR__CUDA_FOR(t, outer * len * inner)
        gx[t] += all ? (mean_all ? g[0] / (float)len : g[0]) : g[(t / (len * inner)) * inner + t % inner] * sc;
}

static dtr_result dtr__cuda_reduce_bwd(dtr_context *ctx, dtr__node *nd) {
    float *gx = dtr__gradof(nd->in[0]);
    int64_t outer = 1, len, inner = 1, n = dtr_tensor_numel(nd->in[0]);
    int all = nd->op == DTR_OP_SUM_ALL || nd->op == DTR_OP_MEAN_ALL;
    float sc;
    if (!gx || n == 0) return DTR_OK;
    if (all) {
        len = n;
        sc = 1.0f;
    } else {
        dtr__axis_split(nd->in[0], nd->p.axis, &outer, &len, &inner);
        sc = nd->op == DTR_OP_MEAN && len ? 1.0f / (float)len : 1.0f;
    }
    dtr__cuda_reduce_bwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        nd->out->grad, gx, outer, len, inner, all, nd->op == DTR_OP_MEAN_ALL, sc);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- mean squared error ---- */

/* prediction and target f32 or 16-bit (their widened values), the loss f32 */
static dtr_result dtr__cuda_mse_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->in[0]);
    return dtr__cuda_sum_to(ctx, nd, DTR__CUDA_SUM_SQDIFF, dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->in[1]), n,
                            dtr__f32(nd->out), (double)n);
}

__global__ static void dtr__cuda_mse_bwd_k(dtr__cuda_mem p, dtr__cuda_mem t, const float *g, float *gp, float *gt, int64_t n) {
    float c = n ? 2.0f * g[0] / (float)n : 0.0f;
    DTR__CUDA_FOR(i, n) {
        float d = c * (p.ld(i) - t.ld(i));
        if (gp) gp[i] += d;
        if (gt) gt[i] -= d;
    }
}

static dtr_result dtr__cuda_mse_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->in[0]);
    float *gp = dtr__gradof(nd->in[0]), *gt = dtr__gradof(nd->in[1]);
    if ((!gp && !gt) || n == 0) return DTR_OK;
    dtr__cuda_mse_bwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->in[1]), nd->out->grad, gp, gt, n);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- dtype cast ---- */

__global__ static void dtr__cuda_cast_k(void *dst, int dt_dst, const void *src, int dt_src, int64_t n) {
    DTR__CUDA_FOR(i, n) {
        if (dt_src == DTR_I32 && dt_dst == DTR_U8) ((uint8_t *)dst)[i] = (uint8_t)((const int32_t *)src)[i];
        else dtr__f_store(dst, dt_dst, i, dtr__f_load(src, dt_src, i));
    }
}

__global__ static void dtr__cuda_add_k(float *dst, const float *src, int64_t n) {
    DTR__CUDA_FOR(i, n) dst[i] += src[i];
}

static dtr_result dtr__cuda_cast_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    if (n == 0) return DTR_OK;
    dtr__cuda_cast_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__data(nd->out), nd->out->dtype, dtr__data(nd->in[0]), nd->in[0]->dtype, n);
    return dtr__cuda_launched(ctx, nd);
}

/* gx += g (casts, reshapes, contiguous copies). */
static dtr_result dtr__cuda_pass_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    float *gx = dtr__gradof(nd->in[0]);
    if (!gx || n == 0) return DTR_OK;
    dtr__cuda_add_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(gx, nd->out->grad, n);
    return dtr__cuda_launched(ctx, nd);
}
#define dtr__cuda_cast_bwd dtr__cuda_pass_bwd

/* ---- dropout: the CPU's stream, element i's draw computed on its own by jumping ahead ---- */

/* x, y in their dtype (narrow); the mask f32 */
__global__ static void dtr__cuda_dropout_fwd_k(dtr__draws d, float p, dtr__cuda_mem x, dtr__cuda_mem y, float *mask, int64_t n) {
    DTR__CUDA_FOR(i, n) {
        uint64_t st = dtr__f_pcg_at(d.rng.state, d.rng.inc, i, d.width, d.cols, d.col0);
        float m = dtr__f_dropout_mask(dtr__f_pcg_next(&st, d.rng.inc), p);
        mask[i] = m;
        y.st(i, x.ld(i) * m);
    }
}

__global__ static void dtr__cuda_mul_add_k(float *gx, const float *g, const float *m, int64_t n) {
    DTR__CUDA_FOR(i, n) gx[i] += g[i] * m[i];
}

static dtr_result dtr__cuda_dropout_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    float *m = (float *)dtr__node_save(ctx, nd, (size_t)(n ? n : 1) * sizeof(float)); /* the mask, for backward */
    if (!m) return ctx->status;
    nd->saved = m;
    if (n == 0) return DTR_OK;
    dtr__cuda_dropout_fwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        nd->p.dropout.draws, nd->p.dropout.p, dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->out), m, n);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_dropout_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t n = dtr_tensor_numel(nd->out);
    float *gx = dtr__gradof(nd->in[0]);
    if (!gx || n == 0) return DTR_OK;
    dtr__cuda_mul_add_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        gx, nd->out->grad, (const float *)nd->saved, n);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- softmax, log-softmax, causal softmax: one block per row ---- */

static int64_t dtr__cuda_rows(const dtr_tensor *x) {
    int64_t c = x->ndim ? x->shape[x->ndim - 1] : 1;
    return c ? dtr_tensor_numel(x) / c : 0;
}

/* x, y (R, C) in their dtype (f32, bf16, f16: narrow); causal: row r keeps its first
   (r % C) + 1 entries */
__global__ static void dtr__cuda_softmax_fwd_k(int op, dtr__cuda_mem x, dtr__cuda_mem y, int64_t C) {
    int64_t r = blockIdx.x, valid = op == DTR_OP_SOFTMAX_CAUSAL ? (r % C) + 1 : C, o = r * C;
    float mx = -INFINITY;
    double s = 0.0;
    for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) mx = fmaxf(mx, x.ld(o + j));
    mx = dtr__cuda_block_max(mx);
    for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += exp((double)(x.ld(o + j) - mx));
    s = dtr__cuda_block_sum(s);
    if (op == DTR_OP_LOG_SOFTMAX) {
        float lse = mx + (float)log(s);
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) y.st(o + j, j < valid ? x.ld(o + j) - lse : -INFINITY);
    } else {
        float inv = (float)(1.0 / s);
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) y.st(o + j, j < valid ? expf(x.ld(o + j) - mx) * inv : 0.0f);
    }
}

/* y in its dtype; g, gx f32 */
__global__ static void dtr__cuda_softmax_bwd_k(int op, dtr__cuda_mem y, const float *g, float *gx, int64_t C) {
    int64_t r = blockIdx.x, o = r * C;
    const float *gr = g + o;
    float *gxr = gx + o;
    double s = 0.0;
    int logp = op == DTR_OP_LOG_SOFTMAX;
    for (int64_t k = threadIdx.x; k < C; k += blockDim.x) s += logp ? (double)gr[k] : (double)gr[k] * y.ld(o + k);
    s = dtr__cuda_block_sum(s);
    for (int64_t k = threadIdx.x; k < C; k += blockDim.x)
        gxr[k] += logp ? gr[k] - expf(y.ld(o + k)) * (float)s : y.ld(o + k) * (gr[k] - (float)s);
}

static dtr_result dtr__cuda_softmax_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t R = dtr__cuda_rows(nd->in[0]), C = nd->in[0]->shape[nd->in[0]->ndim - 1];
    if (R == 0) return DTR_OK;
    dtr__cuda_softmax_fwd_k<<<(unsigned)R, dtr__launch_row_threads(C), 0, dtr__cuda_stream(ctx)>>>(
        nd->op, dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->out), C);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_softmax_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t R = dtr__cuda_rows(nd->in[0]), C = nd->in[0]->shape[nd->in[0]->ndim - 1];
    float *gx = dtr__gradof(nd->in[0]);
    if (!gx || R == 0) return DTR_OK;
    dtr__cuda_softmax_bwd_k<<<(unsigned)R, dtr__launch_row_threads(C), 0, dtr__cuda_stream(ctx)>>>(
        nd->op, dtr__cuda_mem_of(nd->out), nd->out->grad, gx, C);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- cross-entropy on class indices: one block per row, fused softmax ---- */

/* logits x (R, K) of dtype dt (f32, bf16, f16: read as they are, never widened), targets t (R)
   -> each row's statistics st (R) and loss (R, double); an ignored row: 0, no statistics */
__global__ static void dtr__cuda_xent_fwd_k(const void *x, int dt, const int32_t *t, dtr__xent_row *st, double *loss, int64_t K,
                                            dtr__xent_params p, int *err) {
    int64_t r = blockIdx.x;
    float mx = -INFINITY;
    double s = 0.0, mean = 0.0;
    int32_t tr = t[r];
    if (tr == p.ignore_index || tr < 0 || tr >= K) {
        if (threadIdx.x == 0) {
            if (tr != p.ignore_index) dtr__cuda_flag(err, DTR_OP_CROSS_ENTROPY, r);
            loss[r] = 0.0; st[r].max = 0.0f; st[r].inv = 1.0;
        }
        return;   /* the whole block leaves: no barrier is left waiting */
    }
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) mx = fmaxf(mx, dtr__f_load(x, dt, r * K + k));
    mx = dtr__cuda_block_max(mx);
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) s += (double)dtr__f_xent_term(dtr__f_load(x, dt, r * K + k), mx);
    s = dtr__cuda_block_sum(s);
    if (p.smoothing > 0.0f) {   /* the row's mean logit */
        for (int64_t k = threadIdx.x; k < K; k += blockDim.x) mean += (double)dtr__f_load(x, dt, r * K + k);
        mean = dtr__cuda_block_sum(mean) / (double)K;
    }
    if (threadIdx.x == 0) {
        st[r].max = mx;
        st[r].inv = 1.0 / s;
        loss[r] = dtr__f_xent_loss(mx, s, dtr__f_load(x, dt, r * K + tr), mean, p.smoothing);
    }
}

/* block (column chunk, row r): the probabilities again from the logits and the row's statistics;
   dL/dy is g[r] (no reduction) or g[0] / *div */
__global__ static void dtr__cuda_xent_bwd_k(const void *x, int dt, const dtr__xent_row *st, const int32_t *t, const float *g,
                                            const double *div, float *gx, int64_t R, int64_t K, dtr__xent_params p) {
    for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
        int64_t tr = t[r];
        dtr__xent_row sr = st[r];
        float c = p.reduction == DTR_LOSS_NONE ? g[r] : g[0] / (float)*div, d = c * p.smoothing / (float)K;
        if (tr == p.ignore_index) continue;
        for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < K; k += (int64_t)gridDim.x * blockDim.x) {
            int64_t i = r * K + k;
            float v = gx[i] + (c * dtr__f_xent_prob(dtr__f_load(x, dt, i), sr) - d);
            if (k == tr) v -= c * (1.0f - p.smoothing);
            gx[i] = v;
        }
    }
}

/* The row losses' mean over the rows counted, or their sum, in a fixed order (one thread:
   deterministic); *div what backward divides dL/dy by */
__global__ static void dtr__cuda_mean_rows_k(const double *loss, const int32_t *t, int64_t R, dtr__xent_params p, float *y,
                                             double *div) {
    if (threadIdx.x || blockIdx.x) return;
    double s = 0.0;
    int64_t kept = 0;
    for (int64_t r = 0; r < R; r++) s += loss[r], kept += t[r] != p.ignore_index;
    *div = p.reduction == DTR_LOSS_SUM ? 1.0 : (double)kept;
    y[0] = kept ? (float)(s / *div) : 0.0f;
}

/* y (R) = each row's loss (no reduction) */
__global__ static void dtr__cuda_rows_loss_k(const double *loss, int64_t R, float *y) {
    DTR__CUDA_FOR(r, R) y[r] = (float)loss[r];
}

/* Keeps each row's statistics (dtr__xent_row), loss and the divisor, not the probabilities (the CPU's op). */
static dtr_result dtr__cuda_cross_entropy_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t K = x->shape[x->ndim - 1], R = dtr__cuda_rows(x);
    size_t rows = (size_t)(R ? R : 1);
    dtr__xent_row *st = (dtr__xent_row *)dtr__node_save(ctx, nd, rows * (sizeof(dtr__xent_row) + sizeof(double)) + sizeof(double));
    const int32_t *t = (const int32_t *)dtr__data(nd->in[1]);
    cudaStream_t stream = dtr__cuda_stream(ctx);
    double *loss;
    if (!st) return ctx->status;
    nd->saved = st;   /* the row statistics for backward, then the row losses, then the divisor */
    loss = (double *)(st + rows);
    if (R > 0)
        dtr__cuda_xent_fwd_k<<<(unsigned)R, dtr__launch_row_threads(K), 0, stream>>>(dtr__data(x), (int)x->dtype, t, st, loss, K,
                                                                                    nd->p.xent, dtr__cuda(ctx)->err_dev);
    if (nd->p.xent.reduction == DTR_LOSS_NONE) {
        if (R > 0) dtr__cuda_rows_loss_k<<<dtr__cuda_grid(R), DTR__CUDA_THREADS, 0, stream>>>(loss, R, dtr__f32(nd->out));
    } else {
        dtr__cuda_mean_rows_k<<<1, 1, 0, stream>>>(loss, t, R, nd->p.xent, dtr__f32(nd->out), loss + rows);
    }
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_cross_entropy_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t K = x->shape[x->ndim - 1], R = dtr__cuda_rows(x);
    size_t rows = (size_t)(R ? R : 1);
    float *gx = dtr__gradof(x);
    const double *div = (const double *)((const dtr__xent_row *)nd->saved + rows) + rows;
    if (!gx || R == 0) return DTR_OK;
    dtr__cuda_xent_bwd_k<<<dim3(dtr__launch_blocks(K, DTR__CUDA_THREADS, 64), (unsigned)(R < 65535 ? R : 65535)), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__data(x), (int)x->dtype, (const dtr__xent_row *)nd->saved, (const int32_t *)dtr__data(nd->in[1]), nd->out->grad,
        div, gx, R, K, nd->p.xent);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- vocabulary-parallel cross-entropy's local work (dtr__vxent_args; the phases and the
   collectives between them: src/ops/ops_comm.c): one block per row ---- */

/* MAX: M[r]; SUMS: Z[r] (double), T[r], S[r] (smoothing's logit sum, double). A target outside
   [0, V), not ignored, is flagged at MAX. */
__global__ static void dtr__cuda_vxent_rows_k(dtr__vxent_args a, int phase, int *err) {
    float *M = a.s, *Z = a.s + a.R, *T = Z + a.R, *S = T + a.R;
    for (int64_t r = blockIdx.x; r < a.R; r += gridDim.x) {
        const float *x = a.x + r * a.K;
        int64_t own = (int64_t)a.t[r] - a.start;
        if (phase == DTR__VXENT_MAX) {
            float mx = -INFINITY;
            if (threadIdx.x == 0 && a.t[r] != a.p.ignore_index && (a.t[r] < 0 || a.t[r] >= a.V))
                dtr__cuda_flag(err, DTR_OP_VOCAB_CROSS_ENTROPY, r);
            for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) mx = fmaxf(mx, x[k]);
            mx = dtr__cuda_block_max(mx);
            if (threadIdx.x == 0) M[r] = mx;
            continue;
        }
        double sum = 0.0, sx = 0.0;
        for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) sum += (double)dtr__f_xent_term(x[k], M[r]);
        sum = dtr__cuda_block_sum(sum);
        if (a.p.smoothing > 0.0f) {
            for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) sx += (double)x[k];
            sx = dtr__cuda_block_sum(sx);
        }
        if (threadIdx.x == 0) Z[r] = (float)sum, T[r] = own >= 0 && own < a.K ? x[own] : 0.0f, S[r] = (float)sx;
    }
}

/* LOSS: each row's loss, their mean, sum or each, and the divisor D (one thread: the CPU's sum) */
__global__ static void dtr__cuda_vxent_loss_k(dtr__vxent_args a) {
    const float *M = a.s, *Z = a.s + a.R, *T = Z + a.R, *S = T + a.R;
    double loss = 0.0, l;
    int64_t kept = 0;
    if (threadIdx.x || blockIdx.x) return;
    for (int64_t r = 0; r < a.R; r++) {
        if (a.t[r] == a.p.ignore_index) {
            if (a.p.reduction == DTR_LOSS_NONE) a.y[r] = 0.0f;
            continue;
        }
        l = dtr__f_xent_loss(M[r], (double)Z[r], T[r], (double)S[r] / (double)a.V, a.p.smoothing);
        if (a.p.reduction == DTR_LOSS_NONE) a.y[r] = (float)l;
        loss += l, kept++;
    }
    a.s[4 * a.R] = a.p.reduction == DTR_LOSS_MEAN ? (float)kept : 1.0f;
    if (a.p.reduction != DTR_LOSS_NONE) a.y[0] = kept ? (float)(loss / (double)a.s[4 * a.R]) : 0.0f;
}

/* GRAD: block (column chunk, row); ignored rows nothing */
__global__ static void dtr__cuda_vxent_grad_k(dtr__vxent_args a) {
    const float *M = a.s, *Z = a.s + a.R;
    float eps = a.p.smoothing;
    for (int64_t r = blockIdx.y; r < a.R; r += gridDim.y) {
        int64_t own = (int64_t)a.t[r] - a.start;
        float c = a.p.reduction == DTR_LOSS_NONE ? a.g[r] : a.g[0] / a.s[4 * a.R], d = c * eps / (float)a.V;
        if (a.t[r] == a.p.ignore_index) continue;
        for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < a.K; k += (int64_t)gridDim.x * blockDim.x) {
            int64_t i = r * a.K + k;
            float v = a.gx[i] + (c * (dtr__f_xent_term(a.x[i], M[r]) / Z[r]) - d);
            if (k == own) v -= c * (1.0f - eps);
            a.gx[i] = v;
        }
    }
}

/* dtr_backend.vocab_xent: one phase, queued on the stream */
static dtr_result dtr__cuda_vocab_xent(dtr_context *ctx, const dtr__vxent_args *a, int phase) {
    cudaStream_t st = dtr__cuda_stream(ctx);
    unsigned rows = (unsigned)(a->R < 65535 ? a->R : 65535);
    if (phase == DTR__VXENT_LOSS) dtr__cuda_vxent_loss_k<<<1, 1, 0, st>>>(*a);
    else if (a->R == 0 || (phase == DTR__VXENT_GRAD && !a->gx)) return DTR_OK;
    else if (phase == DTR__VXENT_GRAD)
        dtr__cuda_vxent_grad_k<<<dim3(dtr__launch_blocks(a->K, DTR__CUDA_THREADS, 64), rows), DTR__CUDA_THREADS, 0, st>>>(*a);
    else dtr__cuda_vxent_rows_k<<<rows, dtr__launch_row_threads(a->K), 0, st>>>(*a, phase, dtr__cuda(ctx)->err_dev);
    return dtr__cuda_check(ctx, cudaGetLastError(), "dtr_vocab_parallel_cross_entropy");
}

/* ---- gather: x (outer, L, inner), index (outer, M, inner) -> y (outer, M, inner) ---- */

__global__ static void dtr__cuda_gather_fwd_k(const float *x, const int32_t *id, float *y, int64_t L, int64_t M, int64_t inner,
                                              int64_t n, int *err) {
    DTR__CUDA_FOR(t, n) {
        int32_t v = id[t];
        if (v < 0 || v >= L) {
            dtr__cuda_flag(err, DTR_OP_GATHER, t);
            y[t] = 0.0f;
        } else {
            y[t] = x[((t / inner / M) * L + v) * inner + t % inner];
        }
    }
}

/* one thread per (outer, inner) column: its M picks added into x's column in the index's order
   (the CPU's; repeats add up, no two threads share a column) */
__global__ static void dtr__cuda_gather_bwd_k(const float *g, const int32_t *id, float *gx, int64_t L, int64_t M, int64_t inner,
                                              int64_t cols) {
    DTR__CUDA_FOR(c, cols) {
        int64_t o = c / inner, i = c % inner;
        for (int64_t m = 0; m < M; m++) {
            int64_t t = (o * M + m) * inner + i;
            int32_t v = id[t];
            if (v >= 0 && v < L) gx[(o * L + v) * inner + i] += g[t];
        }
    }
}

static dtr_result dtr__cuda_gather_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t outer, L, M, inner, n = dtr_tensor_numel(nd->out);
    if (n == 0) return DTR_OK;
    dtr__axis_split(nd->in[0], nd->p.axis, &outer, &L, &inner);
    M = nd->in[1]->shape[nd->p.axis];
    dtr__cuda_gather_fwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        (const float *)dtr__data(nd->in[0]), (const int32_t *)dtr__data(nd->in[1]), dtr__f32(nd->out), L, M, inner, n,
        dtr__cuda(ctx)->err_dev);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_gather_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t outer, L, M, inner;
    float *gx = dtr__gradof(nd->in[0]);
    if (!gx || dtr_tensor_numel(nd->out) == 0) return DTR_OK;
    dtr__axis_split(nd->in[0], nd->p.axis, &outer, &L, &inner);
    M = nd->in[1]->shape[nd->p.axis];
    dtr__cuda_gather_bwd_k<<<dtr__cuda_grid(outer * inner), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        nd->out->grad, (const int32_t *)dtr__data(nd->in[1]), gx, L, M, inner, outer * inner);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- embedding: table W (V, C), ids (N) -> Y (N, C) ---- */

__global__ static void dtr__cuda_embedding_fwd_k(dtr__cuda_mem W, const int32_t *id, dtr__cuda_mem Y, int64_t N, int64_t C,
                                                 int64_t V, int *err) {
    DTR__CUDA_FOR(i, N * C) {
        int64_t row = i / C, k = i % C;
        int32_t v = id[row];
        if (v < 0 || v >= V) {
            if (k == 0) dtr__cuda_flag(err, DTR_OP_EMBEDDING, row);
            Y.st(i, 0.0f);
        } else {
            Y.st(i, W.ld((int64_t)v * C + k));
        }
    }
}

/* Backward, one block per row i: only the first row holding id v works; it lists, in row
 * order, the rows j >= i holding v (in shared memory, a chunk at a time) and adds their
 * gradients into gw's row v, so each row of gw has one owner (no atomics) and the sum runs in
 * the CPU's order: the same bits as the CPU. */
#define DTR__CUDA_EMB_LIST (2 * DTR__CUDA_THREADS)
__global__ static void dtr__cuda_embedding_bwd_k(const float *G, const int32_t *id, float *gw, int64_t N, int64_t C, int64_t V) {
    __shared__ int64_t list[DTR__CUDA_EMB_LIST];
    __shared__ int wcount[DTR__CUDA_THREADS / 32];
    __shared__ int cnt;
    int64_t i = blockIdx.x;
    int32_t v = id[i];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (v < 0 || v >= V) return;
    for (int64_t j0 = 0; j0 < i; j0 += blockDim.x)   /* an earlier row owns v: leave */
        if (__syncthreads_or(j0 + threadIdx.x < i && id[j0 + threadIdx.x] == v)) return;
    if (threadIdx.x == 0) cnt = 0;
    __syncthreads();
    for (int64_t j0 = i; j0 < N; j0 += blockDim.x) {
        int64_t j = j0 + threadIdx.x;
        int match = j < N && id[j] == v, off = 0;
        unsigned b = __ballot_sync(0xffffffffu, match);
        if (lane == 0) wcount[warp] = __popc(b);
        __syncthreads();
        for (int w = 0; w < warp; w++) off += wcount[w];
        if (match) list[cnt + off + __popc(b & ((1u << lane) - 1u))] = j;
        __syncthreads();
        if (threadIdx.x == 0) for (int w = 0; w < nw; w++) cnt += wcount[w];
        __syncthreads();
        if (cnt > DTR__CUDA_EMB_LIST - (int)blockDim.x || j0 + blockDim.x >= N) {   /* add the listed rows, in order */
            for (int64_t k = threadIdx.x; k < C; k += blockDim.x) {
                float acc = gw[(int64_t)v * C + k];
                for (int m = 0; m < cnt; m++) acc += G[list[m] * C + k];
                gw[(int64_t)v * C + k] = acc;
            }
            __syncthreads();
            if (threadIdx.x == 0) cnt = 0;
            __syncthreads();
        }
    }
}

static dtr_result dtr__cuda_embedding_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t C = nd->in[0]->shape[1], V = nd->in[0]->shape[0], N = dtr_tensor_numel(nd->in[1]);
    if (N * C == 0) return DTR_OK;
    dtr__cuda_embedding_fwd_k<<<dtr__cuda_grid(N * C), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(nd->in[0]), (const int32_t *)dtr__data(nd->in[1]), dtr__cuda_mem_of(nd->out), N, C, V,
        dtr__cuda(ctx)->err_dev);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_embedding_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t C = nd->in[0]->shape[1], V = nd->in[0]->shape[0], N = dtr_tensor_numel(nd->in[1]);
    float *gw = dtr__gradof(nd->in[0]);
    if (!gw || N * C == 0) return DTR_OK;
    dtr__cuda_embedding_bwd_k<<<(unsigned)N, DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        nd->out->grad, (const int32_t *)dtr__data(nd->in[1]), gw, N, C, V);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- column sums of (R, C) row-major data, deterministic: chunks of rows, then the chunks
 * in order (a fixed tree, not the CPU's row order: equal to rounding) ---- */

#define DTR__CUDA_COL_CHUNK 32   /* rows per partial sum */

/* part[c][k] = sum over the rows of chunk c of G[r][k] (H[r] = (X[r] - stat mean) rstd when
   weighted, X.p not NULL: the layer norm weight gradient's g h) */
__global__ static void dtr__cuda_col_part_k(const float *G, dtr__cuda_mem X, const float *stat, float *part, int64_t R,
                                            int64_t C) {
    int64_t chunks = (R + DTR__CUDA_COL_CHUNK - 1) / DTR__CUDA_COL_CHUNK;
    DTR__CUDA_FOR(i, chunks * C) {
        int64_t c = i / C, k = i % C, r1 = (c + 1) * DTR__CUDA_COL_CHUNK < R ? (c + 1) * DTR__CUDA_COL_CHUNK : R;
        float acc = 0.0f;
        for (int64_t r = c * DTR__CUDA_COL_CHUNK; r < r1; r++)
            acc += X.p ? G[r * C + k] * ((X.ld(r * C + k) - stat[2 * r]) * stat[2 * r + 1]) : G[r * C + k];
        part[i] = acc;
    }
}

/* out[k] += the chunks' partial sums of column k, in chunk order */
__global__ static void dtr__cuda_col_finish_k(const float *part, float *out, int64_t chunks, int64_t C) {
    DTR__CUDA_FOR(k, C) {
        float acc = out[k];
        for (int64_t c = 0; c < chunks; c++) acc += part[c * C + k];
        out[k] = acc;
    }
}

/* out[k] += sum over r of G[r][k] (times h[r][k] of a layer norm when X.p is given) */
static dtr_result dtr__cuda_col_sum(dtr_context *ctx, dtr__node *nd, const float *G, dtr__cuda_mem X, const float *stat,
                                    int64_t R, int64_t C, float *out) {
    int64_t chunks = (R + DTR__CUDA_COL_CHUNK - 1) / DTR__CUDA_COL_CHUNK;
    float *part;
    if (R * C == 0) return DTR_OK;
    if (!(part = (float *)dtr__node_save(ctx, nd, (size_t)(chunks * C) * sizeof(float)))) return ctx->status;
    dtr__cuda_col_part_k<<<dtr__cuda_grid(chunks * C), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(G, X, stat, part, R, C);
    dtr__cuda_col_finish_k<<<dtr__cuda_grid(C), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(part, out, chunks, C);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- rotary position embedding: one thread per pair of a head; angles in double, as the
 * CPU's (dtr__f_rope_freq); backward rotates dy back into x's gradient (added) ---- */

__global__ static void dtr__cuda_rope_k(dtr__cuda_mem src, dtr__cuda_mem dst, float *gx, int64_t rows, int64_t T, int64_t C, int64_t D,
                                        dtr__rope_params p, float sign) {
    int64_t half = D / 2;
    DTR__CUDA_FOR(i, rows * C / 2) {
        int64_t r = i / (C / 2), k = i % half, o = r * C + (i % (C / 2)) / half * D;
        int64_t i1 = o + dtr__f_rope_first(k, p.interleaved), i2 = o + dtr__f_rope_second(k, D, p.interleaved);
        double a = (double)(p.start + r % T) * dtr__f_rope_freq(k, D, p.theta);
        float ra, rb;
        dtr__f_rope_rotate(src.ld(i1), src.ld(i2), (float)cos(a), sign * (float)sin(a), &ra, &rb);
        if (gx) gx[i1] += ra, gx[i2] += rb;
        else dst.st(i1, ra), dst.st(i2, rb);
    }
}

static dtr_result dtr__cuda_rope_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t rows = x->shape[0] * x->shape[1], C = x->shape[2];
    if (rows * C == 0) return DTR_OK;
    dtr__cuda_rope_k<<<dtr__cuda_grid(rows * C / 2), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(x), dtr__cuda_mem_of(nd->out), (float *)NULL, rows, x->shape[1], C, C / nd->p.rope.heads, nd->p.rope, 1.0f);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_rope_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t rows = x->shape[0] * x->shape[1], C = x->shape[2];
    dtr__cuda_mem g = {nd->out->grad, DTR_F32};
    if (!dtr__gradof(x) || rows * C == 0) return DTR_OK;
    dtr__cuda_rope_k<<<dtr__cuda_grid(rows * C / 2), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        g, g, dtr__gradof(x), rows, x->shape[1], C, C / nd->p.rope.heads, nd->p.rope, -1.0f);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- layer norm (and RMS norm) over the last axis: one block per row; weight/bias gradients
 * by column ---- */

/* x, y (R, C); stat (R, 2): mean, rstd; rms: RMS norm (the mean 0, not subtracted) */
__global__ static void dtr__cuda_layernorm_fwd_k(dtr__cuda_mem X, dtr__cuda_mem W, dtr__cuda_mem B, dtr__cuda_mem Y, float *stat,
                                                 int64_t C, float eps, int rms) {
    int64_t r = blockIdx.x, o = r * C;
    double m = 0.0, v = 0.0;
    for (int64_t k = threadIdx.x; k < C && !rms; k += blockDim.x) m += X.ld(o + k);
    m = dtr__cuda_block_sum(m) / (double)C;
    for (int64_t k = threadIdx.x; k < C; k += blockDim.x) { double d = X.ld(o + k) - m; v += d * d; }
    v = dtr__cuda_block_sum(v) / (double)C;
    float mean = (float)m, rstd = (float)(1.0 / sqrt(v + eps));
    for (int64_t k = threadIdx.x; k < C; k += blockDim.x) {
        float h = (X.ld(o + k) - mean) * rstd;
        Y.st(o + k, (W.p ? W.ld(k) : 1.0f) * h + (B.p ? B.ld(k) : 0.0f));
    }
    if (threadIdx.x == 0) { stat[2 * r] = mean; stat[2 * r + 1] = rstd; }
}

__global__ static void dtr__cuda_layernorm_bwd_x_k(dtr__cuda_mem X, dtr__cuda_mem W, const float *G, const float *stat,
                                                   float *gx, int64_t C, int rms) {
    int64_t r = blockIdx.x, o = r * C;
    const float *gr = G + o;
    float mean = stat[2 * r], rstd = stat[2 * r + 1], *gxr = gx + o;
    double sd = 0.0, sdh = 0.0;
    for (int64_t k = threadIdx.x; k < C; k += blockDim.x) {
        float h = (X.ld(o + k) - mean) * rstd, dh = gr[k] * (W.p ? W.ld(k) : 1.0f);
        sd += dh;
        sdh += (double)dh * h;
    }
    sd = dtr__cuda_block_sum(sd);
    sdh = dtr__cuda_block_sum(sdh);
    float md = rms ? 0.0f : (float)(sd / (double)C), mdh = (float)(sdh / (double)C);
    for (int64_t k = threadIdx.x; k < C; k += blockDim.x) {
        float h = (X.ld(o + k) - mean) * rstd, dh = gr[k] * (W.p ? W.ld(k) : 1.0f);
        gxr[k] += rstd * (dh - md - h * mdh);
    }
}

static dtr_result dtr__cuda_layernorm_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t C = x->shape[x->ndim - 1], R = dtr__cuda_rows(x);
    float *stat = (float *)dtr__node_save(ctx, nd, (size_t)(R ? R : 1) * 2 * sizeof(float));
    if (!stat) return ctx->status;
    nd->saved = stat;
    if (R == 0) return DTR_OK;
    dtr__cuda_layernorm_fwd_k<<<(unsigned)R, dtr__launch_row_threads(C), 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(x), dtr__cuda_mem_of(nd->in[1]), dtr__cuda_mem_of(nd->in[2]), dtr__cuda_mem_of(nd->out), stat, C,
        nd->p.eps, nd->op == DTR_OP_RMSNORM);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_layernorm_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t C = x->shape[x->ndim - 1], R = dtr__cuda_rows(x);
    const float *stat = (const float *)nd->saved;
    dtr__cuda_mem X = dtr__cuda_mem_of(x), W = dtr__cuda_mem_of(nd->in[1]), none = dtr__cuda_mem_of(NULL);
    float *gx = dtr__gradof(x), *gw = dtr__gradof(nd->in[1]), *gb = dtr__gradof(nd->in[2]);
    if (R == 0) return DTR_OK;
    if (gx) {
        dtr__cuda_layernorm_bwd_x_k<<<(unsigned)R, dtr__launch_row_threads(C), 0, dtr__cuda_stream(ctx)>>>(
            X, W, nd->out->grad, stat, gx, C, nd->op == DTR_OP_RMSNORM);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    }
    if (gw && dtr__cuda_col_sum(ctx, nd, nd->out->grad, X, stat, R, C, gw) != DTR_OK) return ctx->status;
    return gb ? dtr__cuda_col_sum(ctx, nd, nd->out->grad, none, NULL, R, C, gb) : DTR_OK;
}

/* ---- batch norm (training): one block per channel over its N S values ---- */

/* x, y (N, C, S) f32 or 16-bit; stat (C, 2): mean, rstd; rm, rv (C) or NULL: moved by momentum */
__global__ static void dtr__cuda_batchnorm_fwd_k(dtr__cuda_mem X, dtr__cuda_mem W, dtr__cuda_mem B, dtr__cuda_mem Y, float *stat,
                                                 float *rm, float *rv, int64_t N, int64_t C, int64_t S, dtr__batchnorm_params p) {
    int64_t c = blockIdx.x, cnt = N * S;
    double m = 0.0, v = 0.0;
    for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) m += X.ld((i / S * C + c) * S + i % S);
    m = dtr__cuda_block_sum(m) / (double)cnt;
    for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) { double d = X.ld((i / S * C + c) * S + i % S) - m; v += d * d; }
    v = dtr__cuda_block_sum(v) / (double)cnt;
    float mean = (float)m, rstd = (float)(1.0 / sqrt(v + p.eps)), wc = W.p ? W.ld(c) : 1.0f, bc = B.p ? B.ld(c) : 0.0f;
    for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) {
        int64_t o = (i / S * C + c) * S + i % S;
        Y.st(o, wc * ((X.ld(o) - mean) * rstd) + bc);
    }
    if (threadIdx.x != 0) return;
    stat[2 * c] = mean, stat[2 * c + 1] = rstd;
    if (rm) dtr__f_bn_running(rm + c, rv + c, m, v, cnt, p.momentum);
}

/* the CPU's formulas: dx = rstd (g w - mean(g w) - h mean(g w h)); dw += sum(g h), db += sum(g) */
__global__ static void dtr__cuda_batchnorm_bwd_k(dtr__cuda_mem X, dtr__cuda_mem W, const float *G, const float *stat, float *gx,
                                                 float *gw, float *gb, int64_t N, int64_t C, int64_t S) {
    int64_t c = blockIdx.x, cnt = N * S;
    float mean = stat[2 * c], rstd = stat[2 * c + 1], wc = W.p ? W.ld(c) : 1.0f;
    double sg = 0.0, sgh = 0.0;
    for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) {
        int64_t o = (i / S * C + c) * S + i % S;
        sg += G[o];
        sgh += (double)G[o] * ((X.ld(o) - mean) * rstd);
    }
    sg = dtr__cuda_block_sum(sg);
    sgh = dtr__cuda_block_sum(sgh);
    if (threadIdx.x == 0 && gw) gw[c] += (float)sgh;
    if (threadIdx.x == 0 && gb) gb[c] += (float)sg;
    if (!gx) return;
    float md = (float)(sg * wc / (double)cnt), mdh = (float)(sgh * wc / (double)cnt);
    for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) {
        int64_t o = (i / S * C + c) * S + i % S;
        gx[o] += rstd * (G[o] * wc - md - ((X.ld(o) - mean) * rstd) * mdh);
    }
}

static dtr_result dtr__cuda_batchnorm_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t N, C, S;
    float *stat;
    dtr__bn_dims(nd->in[0], &N, &C, &S);
    stat = (float *)dtr__node_save(ctx, nd, (size_t)(C ? C : 1) * 2 * sizeof(float));
    if (!stat) return ctx->status;
    nd->saved = stat;
    if (N * C * S == 0) return DTR_OK;
    dtr__cuda_batchnorm_fwd_k<<<(unsigned)C, dtr__launch_row_threads(N * S), 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->in[1]), dtr__cuda_mem_of(nd->in[2]), dtr__cuda_mem_of(nd->out), stat,
        nd->in[3] ? dtr__f32(nd->in[3]) : NULL, nd->in[4] ? dtr__f32(nd->in[4]) : NULL, N, C, S, nd->p.batchnorm);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_batchnorm_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t N, C, S;
    float *gx = dtr__gradof(nd->in[0]), *gw = dtr__gradof(nd->in[1]), *gb = dtr__gradof(nd->in[2]);
    dtr__bn_dims(nd->in[0], &N, &C, &S);
    if ((!gx && !gw && !gb) || N * C * S == 0) return DTR_OK;
    dtr__cuda_batchnorm_bwd_k<<<(unsigned)C, dtr__launch_row_threads(N * S), 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->in[1]), nd->out->grad, (const float *)nd->saved, gx, gw, gb, N, C, S);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- LSTM cell: gates a (R, 4H), c (R, H) or none -> y = [h | c'] (R, 2H); one thread a unit ---- */

__global__ static void dtr__cuda_lstm_fwd_k(dtr__cuda_mem A, dtr__cuda_mem C, dtr__cuda_mem Y, int64_t R, int64_t H) {
    DTR__CUDA_FOR(t, R * H) {
        int64_t r = t / H, k = t % H, a = r * 4 * H + k;
        float h, c2;
        dtr__f_lstm_cell(A.ld(a), A.ld(a + H), A.ld(a + 2 * H), A.ld(a + 3 * H), C.p ? C.ld(t) : 0.0f, &h, &c2);
        Y.st(r * 2 * H + k, h);
        Y.st(r * 2 * H + H + k, c2);
    }
}

__global__ static void dtr__cuda_lstm_bwd_k(dtr__cuda_mem A, dtr__cuda_mem C, const float *G, float *ga, float *gc, int64_t R,
                                            int64_t H) {
    DTR__CUDA_FOR(t, R * H) {
        int64_t r = t / H, k = t % H, a = r * 4 * H + k;
        float d[4], dc;
        dtr__f_lstm_cell_grad(A.ld(a), A.ld(a + H), A.ld(a + 2 * H), A.ld(a + 3 * H), C.p ? C.ld(t) : 0.0f, G[r * 2 * H + k],
                              G[r * 2 * H + H + k], &d[0], &d[1], &d[2], &d[3], &dc);
        if (ga) ga[a] += d[0], ga[a + H] += d[1], ga[a + 2 * H] += d[2], ga[a + 3 * H] += d[3];
        if (gc) gc[t] += dc;
    }
}

static dtr_result dtr__cuda_lstm_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t H = nd->out->shape[nd->out->ndim - 1] / 2, R = H ? dtr_tensor_numel(nd->out) / (2 * H) : 0;
    if (R * H == 0) return DTR_OK;
    dtr__cuda_lstm_fwd_k<<<dtr__cuda_grid(R * H), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->in[1]), dtr__cuda_mem_of(nd->out), R, H);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_lstm_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t H = nd->out->shape[nd->out->ndim - 1] / 2, R = H ? dtr_tensor_numel(nd->out) / (2 * H) : 0;
    float *ga = dtr__gradof(nd->in[0]), *gc = dtr__gradof(nd->in[1]);
    if ((!ga && !gc) || R * H == 0) return DTR_OK;
    dtr__cuda_lstm_bwd_k<<<dtr__cuda_grid(R * H), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->in[1]), nd->out->grad, ga, gc, R, H);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- views: strided copies and their gradients ---- */

/* dst (dense, es-byte elements) = src walked by w */
__global__ static void dtr__cuda_gather_k(char *dst, const char *src, dtr__cuda_walk w, int64_t n, int es) {
    DTR__CUDA_FOR(i, n) {
        int64_t off = dtr__cuda_walk_off(&w, i);
        if (es == 4) ((float *)dst)[i] = ((const float *)src)[off];
        else if (es == 2) ((uint16_t *)dst)[i] = ((const uint16_t *)src)[off];
        else for (int b = 0; b < es; b++) dst[i * es + b] = src[off * es + b];
    }
}

/* dst walked by wd = src walked by ws (f32 or 16-bit each: widened, rounded once) */
__global__ static void dtr__cuda_copy_walk_k(dtr__cuda_mem dst, dtr__cuda_walk wd, dtr__cuda_mem src, dtr__cuda_walk ws, int64_t n) {
    DTR__CUDA_FOR(i, n) dst.st(dtr__cuda_walk_off(&wd, i), src.ld(dtr__cuda_walk_off(&ws, i)));
}

/* dst walked by w += src (dense); every walked offset is distinct (no race) */
__global__ static void dtr__cuda_scatter_add_k(float *dst, const float *src, dtr__cuda_walk w, int64_t n) {
    DTR__CUDA_FOR(i, n) dst[dtr__cuda_walk_off(&w, i)] += src[i];
}

/* dst (dense) += src walked by w */
__global__ static void dtr__cuda_gather_add_k(float *dst, const float *src, dtr__cuda_walk w, int64_t n) {
    DTR__CUDA_FOR(i, n) dst[i] += src[dtr__cuda_walk_off(&w, i)];
}

/* Walks that are rows of unit-stride columns (slices along the last axis, dense blocks) take
 * a 2-D grid with no division per element. mode 0: dense = view; 1: view += dense;
 * 2: dense += view (f32). */
__global__ static void dtr__cuda_rows_k(int mode, float *dense, float *view, int64_t rows, int64_t cols, int64_t rs) {
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += (int64_t)gridDim.x * blockDim.x) {
            float *v = view + r * rs + c, *d = dense + r * cols + c;
            if (mode == 0) *d = *v;
            else if (mode == 1) *v += *d;
            else *d += *v;
        }
}

/* 1 after launching the rows kernel for walk w over `view` (0: w is not rows of unit stride) */
static int dtr__cuda_rows(dtr_context *ctx, int mode, float *dense, float *view, const dtr__cuda_walk *w) {
    int64_t rows = w->nd == 2 ? w->shape[0] : 1, cols = w->nd ? w->shape[w->nd - 1] : 1, rs = w->nd == 2 ? w->stride[0] : 0;
    if (w->nd > 2 || (w->nd >= 1 && w->stride[w->nd - 1] != 1)) return 0;
    dtr__cuda_rows_k<<<dim3(dtr__launch_blocks(cols, DTR__CUDA_THREADS, 64), (unsigned)(rows < 65535 ? rows : 65535)),
                       DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(mode, dense, view + w->base, rows, cols, rs);
    return 1;
}

static dtr_result dtr__cuda_view_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    if (nd->op == DTR_OP_CONTIGUOUS) {
        int64_t n = dtr_tensor_numel(x);
        if (n == 0) return DTR_OK;
        dtr__cuda_walk w = dtr__cuda_walk_make(x->ndim, x->shape, x->stride, x->offset);
        if (dtr_dtype_size(x->dtype) != 4 || !dtr__cuda_rows(ctx, 0, dtr__f32(nd->out), (float *)x->storage, &w))
            dtr__cuda_gather_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
                (char *)dtr__data(nd->out), (const char *)x->storage, w, n, (int)dtr_dtype_size(x->dtype));
        return dtr__cuda_launched(ctx, nd);
    }
    if (nd->op == DTR_OP_CONCAT) {   /* each input into its block of the output */
        int k, axis = nd->p.view.axis;
        int64_t base = 0;
        for (k = 0; k < nd->n_in; k++) {
            const dtr_tensor *p = nd->in[k];
            int64_t n = dtr_tensor_numel(p);
            if (n > 0) {   /* the output's block (walked with its strides) = p (walked with its own) */
                dtr__cuda_copy_walk_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
                    dtr__cuda_storage_of(nd->out), dtr__cuda_walk_make(p->ndim, p->shape, nd->out->stride, base),
                    dtr__cuda_storage_of(p), dtr__cuda_walk_make(p->ndim, p->shape, p->stride, p->offset), n);
                if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
            }
            base += p->shape[axis] * nd->out->stride[axis];
        }
    }
    return DTR_OK;   /* reshape, permute and slice are views: nothing to compute */
}

static dtr_result dtr__cuda_view_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t cs[DTR_MAX_DIMS], gs[DTR_MAX_DIMS], n = dtr_tensor_numel(nd->out);
    dtr__cuda_walk w;
    float *gx;
    int d;
    if (nd->op == DTR_OP_CONCAT) {
        int k, axis = nd->p.view.axis;
        int64_t base = 0;
        for (k = 0; k < nd->n_in; k++) {
            const dtr_tensor *p = nd->in[k];
            float *gp = dtr__gradof(p);
            int64_t np = dtr_tensor_numel(p);
            if (gp && np > 0) {   /* gp (dense) += the block of g at `base` along axis */
                dtr__cuda_walk w = dtr__cuda_walk_make(p->ndim, p->shape, nd->out->stride, base);
                if (!dtr__cuda_rows(ctx, 2, gp, nd->out->grad, &w))
                    dtr__cuda_gather_add_k<<<dtr__cuda_grid(np), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(gp, nd->out->grad, w, np);
                if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
            }
            base += p->shape[axis] * nd->out->stride[axis];
        }
        return DTR_OK;
    }
    gx = dtr__gradof(x);
    if (!gx || n == 0) return DTR_OK;
    if (nd->op == DTR_OP_RESHAPE || nd->op == DTR_OP_CONTIGUOUS) return dtr__cuda_pass_bwd(ctx, nd);
    dtr__contig_strides(x->ndim, x->shape, cs);
    if (nd->op == DTR_OP_PERMUTE) {
        for (d = 0; d < x->ndim; d++) gs[d] = cs[nd->p.view.perm[d]];
        w = dtr__cuda_walk_make(nd->out->ndim, nd->out->shape, gs, 0);
    } else {   /* SLICE */
        w = dtr__cuda_walk_make(nd->out->ndim, nd->out->shape, cs, nd->p.view.start * cs[nd->p.view.axis]);
    }
    if (!dtr__cuda_rows(ctx, 1, nd->out->grad, gx, &w))
        dtr__cuda_scatter_add_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(gx, nd->out->grad, w, n);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- activation checkpointing: the region's output copied into the node's ---- */

static dtr_result dtr__cuda_checkpoint_fwd(dtr_context *ctx, dtr__node *n) {
    const dtr_tensor *y = n->p.checkpoint.region_out;
    size_t es = dtr_dtype_size(y->dtype);
    return dtr__cuda_check(ctx,
                           cudaMemcpyAsync(n->out->storage, (const char *)y->storage + (size_t)y->offset * es,
                                           (size_t)dtr_tensor_numel(y) * es, cudaMemcpyDeviceToDevice, dtr__cuda_stream(ctx)),
                           "checkpoint copy");
}

static dtr_result dtr__cuda_checkpoint_bwd(dtr_context *ctx, dtr__node *n) { return dtr__checkpoint_backward(ctx, n); }
