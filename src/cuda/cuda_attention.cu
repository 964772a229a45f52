/* ============================================================================
 * Fused causal attention on the GPU, the CPU op's shapes and math (src/ops/ops_nn.c):
 * q, k, v, y (B, T, C), C = H * D, head h in columns h*D.., lse (B, H, T) kept for backward.
 * A first version for correctness, not speed: one block per query row (forward, dQ) or key
 * row (dK, dV); scores live in shared memory (T floats per row), never a T x T matrix in
 * global memory. Each gradient element has one owner, so nothing needs atomics. Heads up to
 * D = 2 * DTR__ATT_THREADS; tensor-core tiles (FlashAttention-2 style) are the next step.
 * ==========================================================================*/

#define DTR__ATT_THREADS 128

typedef struct dtr__cuda_att {
    int64_t B, T, C, H, D;
    float scale;
} dtr__cuda_att;

/* Block (bh, t): the row's probabilities p_j (j <= t) into shared p[], and its lse. */
__device__ static void dtr__cuda_att_row(const float *Q, const float *K, dtr__cuda_att a, int64_t off, int64_t t, float *p,
                                         float *mx_out, double *sum_out) {
    const float *q = Q + off + t * a.C;
    float mx = -INFINITY;
    double sum = 0.0;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) {
        const float *kj = K + off + j * a.C;
        float s = 0.0f;
        for (int64_t d = 0; d < a.D; d++) s += q[d] * kj[d];
        p[j] = s * a.scale;
        mx = fmaxf(mx, p[j]);
    }
    mx = dtr__cuda_block_max(mx);
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) sum += exp((double)(p[j] - mx));
    sum = dtr__cuda_block_sum(sum);
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) p[j] = (float)(exp((double)(p[j] - mx)) / sum);
    __syncthreads();
    *mx_out = mx;
    *sum_out = sum;
}

__global__ static void dtr__cuda_att_fwd_k(const float *Q, const float *K, const float *V, float *Y, float *lse, dtr__cuda_att a) {
    extern __shared__ float p[];
    int64_t row = blockIdx.x, bh = row / a.T, t = row % a.T, off = (bh / a.H) * a.T * a.C + (bh % a.H) * a.D;
    float mx;
    double sum;
    dtr__cuda_att_row(Q, K, a, off, t, p, &mx, &sum);
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = 0; j <= t; j++) acc += p[j] * V[off + j * a.C + d];
        Y[off + t * a.C + d] = acc;
    }
    if (threadIdx.x == 0) lse[row] = mx + (float)log(sum);
}

/* dQ of query row t, and Drow[t] = dY_t . Y_t for the key kernel */
__global__ static void dtr__cuda_att_bwd_q_k(const float *Q, const float *K, const float *V, const float *Y, const float *G,
                                             float *GQ, float *Drow, dtr__cuda_att a) {
    extern __shared__ float p[];
    int64_t row = blockIdx.x, bh = row / a.T, t = row % a.T, off = (bh / a.H) * a.T * a.C + (bh % a.H) * a.D;
    const float *g = G + off + t * a.C;
    float mx;
    double sum, dy = 0.0;
    dtr__cuda_att_row(Q, K, a, off, t, p, &mx, &sum);
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) dy += (double)g[d] * Y[off + t * a.C + d];
    dy = dtr__cuda_block_sum(dy);
    if (threadIdx.x == 0) Drow[row] = (float)dy;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) {   /* dS_j = p_j (dY . v_j - D) scale */
        const float *vj = V + off + j * a.C;
        float dp = 0.0f;
        for (int64_t d = 0; d < a.D; d++) dp += g[d] * vj[d];
        p[j] = p[j] * (dp - (float)dy) * a.scale;
    }
    __syncthreads();
    if (!GQ) return;
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
        float acc = GQ[off + t * a.C + d];
        for (int64_t j = 0; j <= t; j++) acc += p[j] * K[off + j * a.C + d];
        GQ[off + t * a.C + d] = acc;
    }
}

/* dK, dV of key row j: every query row t >= j that saw it, in order */
__global__ static void dtr__cuda_att_bwd_kv_k(const float *Q, const float *K, const float *V, const float *G, const float *lse,
                                              const float *Drow, float *GK, float *GV, dtr__cuda_att a) {
    int64_t row = blockIdx.x, bh = row / a.T, j = row % a.T, off = (bh / a.H) * a.T * a.C + (bh % a.H) * a.D;
    int64_t d0 = threadIdx.x, d1 = threadIdx.x + blockDim.x;
    const float *kj = K + off + j * a.C, *vj = V + off + j * a.C;
    float ak0 = 0, ak1 = 0, av0 = 0, av1 = 0;
    for (int64_t t = j; t < a.T; t++) {
        const float *q = Q + off + t * a.C, *g = G + off + t * a.C;
        double s = 0.0, dp = 0.0;
        for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) { s += (double)q[d] * kj[d]; dp += (double)g[d] * vj[d]; }
        s = dtr__cuda_block_sum(s);
        dp = dtr__cuda_block_sum(dp);
        float pt = expf((float)s * a.scale - lse[bh * a.T + t]), ds = pt * ((float)dp - Drow[bh * a.T + t]) * a.scale;
        if (d0 < a.D) { ak0 += ds * q[d0]; av0 += pt * g[d0]; }
        if (d1 < a.D) { ak1 += ds * q[d1]; av1 += pt * g[d1]; }
    }
    if (GK && d0 < a.D) GK[off + j * a.C + d0] += ak0;
    if (GK && d1 < a.D) GK[off + j * a.C + d1] += ak1;
    if (GV && d0 < a.D) GV[off + j * a.C + d0] += av0;
    if (GV && d1 < a.D) GV[off + j * a.C + d1] += av1;
}

static dtr_result dtr__cuda_att_make(dtr_context *ctx, const dtr__node *nd, dtr__cuda_att *a, size_t *shmem) {
    a->B = nd->in[0]->shape[0]; a->T = nd->in[0]->shape[1]; a->C = nd->in[0]->shape[2];
    a->H = nd->p.heads; a->D = a->C / a->H;
    a->scale = 1.0f / sqrtf((float)a->D);
    *shmem = (size_t)(a->T ? a->T : 1) * sizeof(float);
    if (a->D > 2 * DTR__ATT_THREADS)
        return dtr__fail(ctx, DTR_UNSUPPORTED, "cuda: attention with head size %lld > %d is not in this version", (long long)a->D,
                         2 * DTR__ATT_THREADS);
    if (*shmem > 48 * 1024) {   /* long contexts: ask for more shared memory (up to the device's opt-in limit) */
        if (cudaFuncSetAttribute(dtr__cuda_att_fwd_k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)*shmem) != cudaSuccess ||
            cudaFuncSetAttribute(dtr__cuda_att_bwd_q_k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)*shmem) != cudaSuccess)
            return dtr__fail(ctx, DTR_UNSUPPORTED, "cuda: attention over %lld positions needs more shared memory than this GPU has",
                             (long long)a->T);
    }
    return DTR_OK;
}

static dtr_result dtr__cuda_attention_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_att a;
    size_t shmem;
    float *lse;
    if (dtr__cuda_att_make(ctx, nd, &a, &shmem) != DTR_OK) return ctx->status;
    lse = (float *)dtr__node_save(ctx, nd, (size_t)(a.B * a.H * a.T + 1) * sizeof(float)); /* row log-sum-exps */
    if (!lse) return ctx->status;
    nd->saved = lse;
    if (a.B * a.H * a.T == 0) return DTR_OK;
    dtr__cuda_att_fwd_k<<<(unsigned)(a.B * a.H * a.T), DTR__ATT_THREADS, shmem, dtr__cuda_stream(ctx)>>>(
        dtr__f32(nd->in[0]), dtr__f32(nd->in[1]), dtr__f32(nd->in[2]), dtr__f32(nd->out), lse, a);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_attention_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_att a;
    size_t shmem;
    float *GQ = dtr__gradof(nd->in[0]), *GK = dtr__gradof(nd->in[1]), *GV = dtr__gradof(nd->in[2]), *Drow;
    unsigned rows;
    if (!GQ && !GK && !GV) return DTR_OK;
    if (dtr__cuda_att_make(ctx, nd, &a, &shmem) != DTR_OK) return ctx->status;
    rows = (unsigned)(a.B * a.H * a.T);
    if (rows == 0) return DTR_OK;
    Drow = (float *)dtr__node_save(ctx, nd, (size_t)rows * sizeof(float));
    if (!Drow) return ctx->status;
    dtr__cuda_att_bwd_q_k<<<rows, DTR__ATT_THREADS, shmem, dtr__cuda_stream(ctx)>>>(
        dtr__f32(nd->in[0]), dtr__f32(nd->in[1]), dtr__f32(nd->in[2]), dtr__f32(nd->out), nd->out->grad, GQ, Drow, a);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    if (!GK && !GV) return DTR_OK;
    dtr__cuda_att_bwd_kv_k<<<rows, DTR__ATT_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__f32(nd->in[0]), dtr__f32(nd->in[1]), dtr__f32(nd->in[2]), nd->out->grad, (const float *)nd->saved, Drow, GK, GV, a);
    return dtr__cuda_launched(ctx, nd);
}
