/* ============================================================================
 * The backend's non-op slots on the GPU: the fused optimizer update over the model's
 * contiguous buffers (SGD, Adam, AdamW, LAMB, with the element formulas the CPU uses),
 * sum of squares (gradient clipping), scale, and the element-wise reduction the collectives
 * apply to received buffers. Sums are two-pass trees in double with a fixed shape, so a run
 * repeats bit for bit on one GPU.
 * ==========================================================================*/

/* ---- deterministic sums ---- */

__device__ static double dtr__cuda_term(int kind, const float *a, const float *b, int64_t i) {
    double v = a[i];
    if (kind == DTR__CUDA_SUM_SQDIFF) v -= b[i];
    return kind == DTR__CUDA_SUM_PLAIN ? v : v * v;
}

/* pass 1: block k sums its grid-stride share into partial[k] */
__global__ static void dtr__cuda_sum_k(int kind, const float *a, const float *b, int64_t n, double *partial) {
    double s = 0.0;
    DTR__CUDA_FOR(i, n) s += dtr__cuda_term(kind, a, b, i);
    s = dtr__cuda_block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/* pass 2: one block sums the partials into partial[0] */
__global__ static void dtr__cuda_sum_partials_k(double *partial, int count) {
    double s = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
    s = dtr__cuda_block_sum(s);
    if (threadIdx.x == 0) partial[0] = s;
}

static dtr_result dtr__cuda_sum(dtr_context *ctx, int kind, const float *a, const float *b, int64_t n, double *out) {
    unsigned blocks = dtr__launch_blocks(n, DTR__CUDA_THREADS, DTR__CUDA_MAX_PARTIALS);
    cudaStream_t st = dtr__cuda_stream(ctx);
    dtr__cuda_sum_k<<<blocks, DTR__CUDA_THREADS, 0, st>>>(kind, a, b, n, out);
    dtr__cuda_sum_partials_k<<<1, 1024, 0, st>>>(out, (int)blocks);
    return dtr__cuda_check(ctx, cudaGetLastError(), "sum kernel");
}

static dtr_result dtr__cuda_sumsq(dtr_context *ctx, const float *x, int64_t n, double *out) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    if (n <= 0) { *out = 0.0; return DTR_OK; }
    if (dtr__cuda_sum(ctx, DTR__CUDA_SUM_SQ, x, NULL, n, s->partial) != DTR_OK) return ctx->status;
    if (dtr__cuda_check(ctx, cudaMemcpyAsync(s->sum_host, s->partial, sizeof(double), cudaMemcpyDeviceToHost, s->stream),
                        "sumsq result") != DTR_OK ||
        dtr__cuda_check(ctx, cudaStreamSynchronize(s->stream), "sumsq") != DTR_OK)
        return ctx->status;
    *out = *s->sum_host;
    return DTR_OK;
}

/* ---- scale ---- */

__global__ static void dtr__cuda_scale_k(float *x, int64_t n, float s) {
    DTR__CUDA_FOR(i, n) x[i] *= s;
}

static dtr_result dtr__cuda_scale(dtr_context *ctx, float *x, int64_t n, float s) {
    if (n <= 0) return DTR_OK;
    dtr__cuda_scale_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(x, n, s);
    return dtr__cuda_check(ctx, cudaGetLastError(), "scale kernel");
}

/* ---- the collectives' reduction: out = (a op b) / div, f32 / bf16 / f16 ---- */

__global__ static void dtr__cuda_reduce_k(void *out, const void *a, const void *b, int64_t n, int dt, int op, int div) {
    DTR__CUDA_FOR(i, n) {
        float x = dtr__f_load(a, dt, i), y = dtr__f_load(b, dt, i);
        float r = op == DTR_REDUCE_MAX ? (x > y ? x : y) : x + y;
        if (div > 1) r /= (float)div;
        dtr__f_store(out, dt, i, r);
    }
}

static dtr_result dtr__cuda_reduce(dtr_context *ctx, void *out, const void *a, const void *b, size_t n, dtr_dtype dt, int op,
                                   int div) {
    if (!dtr__is_float(dt))
        return dtr__fail(ctx, DTR_DTYPE_MISMATCH, "cuda: collectives reduce f32, bf16 or f16, not %s", dtr_dtype_name(dt));
    if (n == 0) return DTR_OK;
    dtr__cuda_reduce_k<<<dtr__cuda_grid((int64_t)n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(out, a, b, (int64_t)n, dt, op,
                                                                                                   div);
    return dtr__cuda_check(ctx, cudaGetLastError(), "reduce kernel");
}

/* ---- the fused optimizer update over [begin, n) ---- */

__global__ static void dtr__cuda_sgd_k(float *p, const float *g, float *m, int64_t b, int64_t n, dtr__opt_k k) {
    DTR__CUDA_FOR(t, n - b) {
        int64_t i = b + t;
        if (m) dtr__f_sgd_momentum(&p[i], &m[i], g[i], &k, k.first, k.nesterov);
        else dtr__f_sgd(&p[i], g[i], &k);
    }
}

__global__ static void dtr__cuda_adam_k(float *p, const float *g, float *m, float *v, int64_t b, int64_t n, dtr__opt_k k) {
    DTR__CUDA_FOR(t, n - b) {
        int64_t i = b + t;
        dtr__f_adam(&p[i], &m[i], &v[i], g[i], &k, k.adamw);
    }
}

/* LAMB, one block per parameter segment: moments and direction, the two norms, the trust
 * ratio, the step. segs: (nseg, 2) begin/end. */
__global__ static void dtr__cuda_lamb_k(float *p, const float *g, float *m, float *v, float *work, const int64_t *segs, float lr,
                                        dtr__opt_k k) {
    int64_t s0 = segs[2 * blockIdx.x], s1 = segs[2 * blockIdx.x + 1];
    double pn = 0.0, un = 0.0;
    for (int64_t i = s0 + threadIdx.x; i < s1; i += blockDim.x) {
        work[i] = dtr__f_lamb_dir(p[i], &m[i], &v[i], g[i], &k);
        pn += (double)p[i] * p[i];
        un += (double)work[i] * work[i];
    }
    pn = dtr__cuda_block_sum(pn);
    un = dtr__cuda_block_sum(un);
    float trust = dtr__f_lamb_trust(pn, un);
    for (int64_t i = s0 + threadIdx.x; i < s1; i += blockDim.x) p[i] -= lr * trust * work[i];
}

/* The segments inside [begin, n), copied to the device. */
static int dtr__cuda_lamb_segments(const dtr__opt_args *a, int64_t *host, int cap) {
    int s, used = 0;
    for (s = 0; s < a->nseg && used < cap; s++) {
        if (a->seg_begin[s] < a->begin || a->seg_end[s] > a->n) continue;   /* outside the range */
        host[2 * used] = a->seg_begin[s];
        host[2 * used + 1] = a->seg_end[s];
        used++;
    }
    return used;
}

static dtr_result dtr__cuda_lamb(dtr_context *ctx, const dtr__opt_args *a, const dtr__opt_k *k) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    int64_t *host;
    int used;
    if (a->nseg > s->seg_cap) {
        if (s->segs) cudaFree(s->segs);
        s->segs = NULL;
        s->seg_cap = 0;
        if (dtr__cuda_check(ctx, cudaMalloc((void **)&s->segs, (size_t)a->nseg * 2 * sizeof(int64_t)), "LAMB segments") != DTR_OK)
            return ctx->status;
        s->seg_cap = a->nseg;
    }
    host = (int64_t *)dtr__malloc(&ctx->alloc, (size_t)(a->nseg ? a->nseg : 1) * 2 * sizeof(int64_t));
    if (!host) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "cuda: LAMB: out of memory");
    used = dtr__cuda_lamb_segments(a, host, a->nseg);
    if (used > 0 && dtr__cuda_check(ctx, cudaMemcpyAsync(s->segs, host, (size_t)used * 2 * sizeof(int64_t), cudaMemcpyHostToDevice,
                                                         s->stream), "LAMB segments") == DTR_OK &&
        dtr__cuda_check(ctx, cudaStreamSynchronize(s->stream), "LAMB segments") == DTR_OK) {
        dtr__cuda_lamb_k<<<(unsigned)used, DTR__CUDA_THREADS, 0, s->stream>>>(a->param, a->grad, a->m, a->v, a->work, s->segs,
                                                                             a->lr, *k);
        dtr__cuda_check(ctx, cudaGetLastError(), "LAMB kernel");
    }
    dtr__free(&ctx->alloc, host);
    return ctx->status;
}

static dtr_result dtr__cuda_optimizer(dtr_context *ctx, const dtr__opt_args *a) {
    dtr__opt_k k = dtr__opt_consts(a);
    cudaStream_t st = dtr__cuda_stream(ctx);
    if (a->n <= a->begin) return DTR_OK;
    switch (a->kind) {
    case DTR_OPT_SGD:
        dtr__cuda_sgd_k<<<dtr__cuda_grid(a->n - a->begin), DTR__CUDA_THREADS, 0, st>>>(a->param, a->grad, a->m, a->begin, a->n, k);
        break;
    case DTR_OPT_ADAM:
    case DTR_OPT_ADAMW:
        dtr__cuda_adam_k<<<dtr__cuda_grid(a->n - a->begin), DTR__CUDA_THREADS, 0, st>>>(a->param, a->grad, a->m, a->v, a->begin,
                                                                                       a->n, k);
        break;
    case DTR_OPT_LAMB: return dtr__cuda_lamb(ctx, a, &k);
    default: return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "cuda: unknown optimizer kind %d", a->kind);
    }
    return dtr__cuda_check(ctx, cudaGetLastError(), "optimizer kernel");
}
