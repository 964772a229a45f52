/* ============================================================================
 * Fused causal attention on the GPU, the CPU op's shapes and math (src/ops/ops_nn.c):
 * q, k, v, y (B, T, C), C = H * D, head h in columns h*D.., lse (B, H, T) kept for backward.
 * As the CPU does it, query rows go in tiles; a tile's scores against the keys it may see,
 * S = q k^T / sqrt(D) (n x L for every batch item and head at once: one batched cuBLAS GEMM),
 * a row kernel turns them into probabilities P (causal, with each row's log-sum-exp), and
 * y = P v is a second GEMM. Backward recomputes P from lse: dP = dy v^T,
 * dS = P (dP - rowsum(dy y)) / sqrt(D), dq += dS k, dk += dS^T q, dv += P^T dy, all GEMMs.
 * Memory: two B x H x n x L tiles in the context's scratch, n <= DTR__ATT_TILE rows and at
 * most DTR__ATT_SCRATCH floats each, never T x T per head; the step keeps only lse. Sums are cuBLAS's and fixed trees: runs repeat bit for
 * bit; no atomics.
 * ==========================================================================*/

#define DTR__ATT_TILE 256              /* query rows per tile, at most */
#define DTR__ATT_SCRATCH (1 << 24)     /* floats of one score tile, at most (64 MiB); 16 rows at least */
#define DTR__ATT_THREADS 128           /* threads of a row kernel */

typedef struct dtr__cuda_att {
    int64_t B, T, C, H, D, n;          /* n: rows per tile */
    float scale;
} dtr__cuda_att;

/* One tile: query rows [t0, t0 + n) against keys [0, L), L = t0 + n. Row i of item z = (b, h)
   (block (i, z)) sees keys j <= t0 + i; its scores are S[(z n + i) L ..]. */
typedef struct dtr__cuda_att_tile {
    int64_t t0, n, L;
} dtr__cuda_att_tile;

/* S (B H, n, L) scores -> P in place (0 past the causal edge); lse (B, H, T) of each row */
__global__ static void dtr__cuda_att_softmax_k(float *S, float *lse, dtr__cuda_att a, dtr__cuda_att_tile w) {
    int64_t i = blockIdx.x, t = w.t0 + i;
    for (int64_t z = blockIdx.y; z < a.B * a.H; z += gridDim.y) {
        float *s = S + (z * w.n + i) * w.L;
        float mx = -INFINITY;
        double sum = 0.0;
        for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) mx = fmaxf(mx, s[j]);
        mx = dtr__cuda_block_max(mx);
        for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) sum += exp((double)(s[j] - mx));
        sum = dtr__cuda_block_sum(sum);
        for (int64_t j = threadIdx.x; j < w.L; j += blockDim.x) s[j] = j <= t ? (float)(exp((double)(s[j] - mx)) / sum) : 0.0f;
        if (threadIdx.x == 0) lse[z * a.T + t] = mx + (float)log(sum);
    }
}

/* Backward: P = exp(S - lse) in S, then dS = P (dP - Drow) scale in dP (0 past the edge) */
__global__ static void dtr__cuda_att_dscore_k(float *S, float *dP, const float *lse, const float *Drow, dtr__cuda_att a,
                                             dtr__cuda_att_tile w) {
    int64_t i = blockIdx.x, t = w.t0 + i;
    for (int64_t z = blockIdx.y; z < a.B * a.H; z += gridDim.y) {
        float *s = S + (z * w.n + i) * w.L, *dp = dP + (z * w.n + i) * w.L, l = lse[z * a.T + t], dr = Drow[z * a.T + t];
        for (int64_t j = threadIdx.x; j < w.L; j += blockDim.x) {
            float p = j <= t ? expf(s[j] - l) : 0.0f;
            s[j] = p;
            dp[j] = p * (dp[j] - dr) * a.scale;
        }
    }
}

/* Drow (B, H, T) = dy_t . y_t per head, one warp per row */
__global__ static void dtr__cuda_att_drow_k(const float *Y, const float *G, float *Drow, dtr__cuda_att a) {
    int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (row >= a.B * a.H * a.T) return;
    int64_t b = row / (a.H * a.T), h = (row / a.T) % a.H, t = row % a.T, off = (b * a.T + t) * a.C + h * a.D;
    float acc = 0.0f;
    for (int64_t d = lane; d < a.D; d += 32) acc += G[off + d] * Y[off + d];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if (lane == 0) Drow[row] = acc;
}

static void dtr__cuda_att_make(const dtr__node *nd, dtr__cuda_att *a) {
    int64_t fit;
    a->B = nd->in[0]->shape[0]; a->T = nd->in[0]->shape[1]; a->C = nd->in[0]->shape[2];
    a->H = nd->p.heads; a->D = a->C / a->H;
    a->scale = 1.0f / sqrtf((float)a->D);
    fit = DTR__ATT_SCRATCH / (a->B * a->H * (a->T ? a->T : 1));
    a->n = fit > DTR__ATT_TILE ? DTR__ATT_TILE : fit < 16 ? 16 : fit;
    if (a->n > a->T) a->n = a->T;
}

/* the row kernels' grid height: one (b, h) item per block row, looping past 65535 */
static unsigned dtr__cuda_att_ys(const dtr__cuda_att *a) { return (unsigned)(a->B * a->H < 65535 ? a->B * a->H : 65535); }

static dtr__cuda_att_tile dtr__cuda_att_tile_at(const dtr__cuda_att *a, int64_t t0) {
    dtr__cuda_att_tile w;
    w.t0 = t0;
    w.n = a->T - t0 < a->n ? a->T - t0 : a->n;
    w.L = t0 + w.n;
    return w;
}

/* `tiles` score tiles (B H n T floats each), then the GEMMs' pointer arrays: the context's
   scratch, not the step arena (only the op's own launches use them) */
static float *dtr__cuda_att_scratch(dtr_context *ctx, const dtr__cuda_att *a, int tiles, void ***ptrs) {
    size_t floats = (size_t)(tiles * a->B * a->H * a->n * a->T), np = (size_t)(3 * a->B * a->H);
    char *p = (char *)dtr__cuda_scratch(ctx, (floats + 1) * sizeof(float) + np * sizeof(void *) + 16);
    if (!p) return NULL;
    *ptrs = (void **)(p + (((floats + 1) * sizeof(float) + 15) & ~(size_t)15));
    return (float *)p;
}

/* strides of (b, h) items: rows of x (B, T, C) head by head, and tiles of scores */
static dtr__cuda_bstride dtr__cuda_att_x(const dtr__cuda_att *a) { dtr__cuda_bstride s = {a->T * a->C, a->D}; return s; }
static dtr__cuda_bstride dtr__cuda_att_s(const dtr__cuda_att *a, dtr__cuda_att_tile w) {
    dtr__cuda_bstride s = {a->H * w.n * w.L, w.n * w.L};
    return s;
}

/* S (B H, n, L) = scale q[t0:t0+n] k[0:L]^T, every batch item and head */
static dtr_result dtr__cuda_att_scores(dtr_context *ctx, const float *Q, const float *K, float *S, const dtr__cuda_att *a,
                                       dtr__cuda_att_tile w, void **ptrs) {
    return dtr__cuda_gemm2(ctx, w.n, w.L, a->D, a->scale, Q + w.t0 * a->C, a->C, 1, dtr__cuda_att_x(a), K, 1, a->C,
                           dtr__cuda_att_x(a), 0.0f, S, w.L, dtr__cuda_att_s(a, w), a->B, a->H, ptrs);
}

static dtr_result dtr__cuda_attention_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_att a;
    const float *Q = dtr__f32(nd->in[0]), *K = dtr__f32(nd->in[1]), *V = dtr__f32(nd->in[2]);
    float *Y = dtr__f32(nd->out), *lse, *S;
    void **ptrs;
    dtr__cuda_att_make(nd, &a);
    lse = (float *)dtr__node_save(ctx, nd, (size_t)(a.B * a.H * a.T + 1) * sizeof(float)); /* row log-sum-exps */
    if (!lse) return ctx->status;
    nd->saved = lse;
    if (a.B * a.H * a.T == 0) return DTR_OK;
    if (!(S = dtr__cuda_att_scratch(ctx, &a, 1, &ptrs))) return ctx->status;
    for (int64_t t0 = 0; t0 < a.T; t0 += a.n) {
        dtr__cuda_att_tile w = dtr__cuda_att_tile_at(&a, t0);
        if (dtr__cuda_att_scores(ctx, Q, K, S, &a, w, ptrs) != DTR_OK) return ctx->status;
        dtr__cuda_att_softmax_k<<<dim3((unsigned)w.n, dtr__cuda_att_ys(&a)), DTR__ATT_THREADS, 0, dtr__cuda_stream(ctx)>>>(S, lse, a, w);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
        /* y[t0:t0+n] (n, D) = P (n, L) v[0:L] (L, D) */
        if (dtr__cuda_gemm2(ctx, w.n, a.D, w.L, 1.0f, S, w.L, 1, dtr__cuda_att_s(&a, w), V, a.C, 1, dtr__cuda_att_x(&a), 0.0f,
                            Y + t0 * a.C, a.C, dtr__cuda_att_x(&a), a.B, a.H, ptrs) != DTR_OK)
            return ctx->status;
    }
    return DTR_OK;
}

/* One tile's backward: P and dS from the recomputed scores, then dq, dk, dv (accumulated). */
static dtr_result dtr__cuda_att_bwd_tile(dtr_context *ctx, dtr__node *nd, const dtr__cuda_att *a, dtr__cuda_att_tile w, float *S,
                                         float *dS, const float *Drow, void **ptrs) {
    const float *Q = dtr__f32(nd->in[0]), *K = dtr__f32(nd->in[1]), *V = dtr__f32(nd->in[2]), *G = nd->out->grad;
    float *GQ = dtr__gradof(nd->in[0]), *GK = dtr__gradof(nd->in[1]), *GV = dtr__gradof(nd->in[2]);
    int64_t D = a->D, C = a->C;
    const float *Gt = G + w.t0 * C, *Qt = Q + w.t0 * C;
    dtr__cuda_bstride x = dtr__cuda_att_x(a), sc = dtr__cuda_att_s(a, w);
    if (dtr__cuda_att_scores(ctx, Q, K, S, a, w, ptrs) != DTR_OK) return ctx->status;
    /* dP (n, L) = dy[t0:] (n, D) v[0:L]^T (D, L) */
    if (dtr__cuda_gemm2(ctx, w.n, w.L, D, 1.0f, Gt, C, 1, x, V, 1, C, x, 0.0f, dS, w.L, sc, a->B, a->H, ptrs) != DTR_OK)
        return ctx->status;
    dtr__cuda_att_dscore_k<<<dim3((unsigned)w.n, dtr__cuda_att_ys(a)), DTR__ATT_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        S, dS, (const float *)nd->saved, Drow, *a, w);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    if (GQ && dtr__cuda_gemm2(ctx, w.n, D, w.L, 1.0f, dS, w.L, 1, sc, K, C, 1, x, 1.0f, GQ + w.t0 * C, C, x, a->B, a->H, ptrs) != DTR_OK)
        return ctx->status;   /* dq[t0:] += dS (n, L) k[0:L] (L, D) */
    if (GK && dtr__cuda_gemm2(ctx, w.L, D, w.n, 1.0f, dS, 1, w.L, sc, Qt, C, 1, x, 1.0f, GK, C, x, a->B, a->H, ptrs) != DTR_OK)
        return ctx->status;   /* dk[0:L] += dS^T (L, n) q[t0:] (n, D) */
    if (GV && dtr__cuda_gemm2(ctx, w.L, D, w.n, 1.0f, S, 1, w.L, sc, Gt, C, 1, x, 1.0f, GV, C, x, a->B, a->H, ptrs) != DTR_OK)
        return ctx->status;   /* dv[0:L] += P^T (L, n) dy[t0:] (n, D) */
    return DTR_OK;
}

static dtr_result dtr__cuda_attention_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_att a;
    float *Drow, *S;
    void **ptrs;
    int64_t rows;
    if (!dtr__gradof(nd->in[0]) && !dtr__gradof(nd->in[1]) && !dtr__gradof(nd->in[2])) return DTR_OK;
    dtr__cuda_att_make(nd, &a);
    rows = a.B * a.H * a.T;
    if (rows == 0) return DTR_OK;
    Drow = (float *)dtr__node_save(ctx, nd, (size_t)rows * sizeof(float));
    S = dtr__cuda_att_scratch(ctx, &a, 2, &ptrs);
    if (!Drow || !S) return ctx->status;
    dtr__cuda_att_drow_k<<<dtr__launch_blocks(rows * 32, DTR__CUDA_THREADS, INT32_MAX), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__f32(nd->out), nd->out->grad, Drow, a);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    for (int64_t t0 = 0; t0 < a.T; t0 += a.n)
        if (dtr__cuda_att_bwd_tile(ctx, nd, &a, dtr__cuda_att_tile_at(&a, t0), S, S + a.B * a.H * a.n * a.T, Drow, ptrs) != DTR_OK)
            return ctx->status;
    return DTR_OK;
}
