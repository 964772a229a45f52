/* ============================================================================
 * Fused causal attention on the GPU, the CPU op's shapes and math (src/ops/ops_nn.c):
 * q, k, v, y (B, T, C), C = H * D, head h in columns h*D.., lse (B, H, T) kept for backward.
 * As the CPU does it, query rows go in tiles; a tile's scores against the keys it may see,
 * S = q k^T / sqrt(D) (n x L for every batch item and head at once: one batched cuBLAS GEMM),
 * a row kernel turns them into probabilities P (causal, with each row's log-sum-exp), and
 * y = P v is a second GEMM. Backward recomputes P from lse: dP = dy v^T,
 * dS = P (dP - rowsum(dy y)) / sqrt(D), dq += dS k, dk += dS^T q, dv += P^T dy, all GEMMs.
 * Memory: two B x H x n x L tiles in the context's scratch, n <= DTR__ATT_TILE rows and at
 * most DTR__ATT_SCRATCH floats each, never T x T per head; the step keeps only lse. Sums are
 * cuBLAS's and fixed trees: runs repeat bit for bit; no atomics.
 * 16-bit (activations of the type of matmul_precision, as linear): q, k, v and y as stored, the
 * products on 16-bit operands summed in f32 (cublasGemmEx, CUBLAS_COMPUTE_32F): scores in f32,
 * P rounded to 16 bits for P v (as the f32 path's fast 16-bit compute rounds it inside cuBLAS),
 * written over its own row of scores (a 16-bit row is the first half of the f32 row: the row
 * kernels read a chunk of the row, wait at a barrier, then write it), so the tiles take the f32
 * path's memory; backward rounds dy to 16 bits once (B T C), and P and dS per tile the same
 * way, the gradients summed in f32. Otherwise 16-bit tensors are widened into f32 copies.
 * ==========================================================================*/

#define DTR__ATT_TILE 256              /* query rows per tile, at most */
#define DTR__ATT_SCRATCH (1 << 24)     /* floats of one score tile, at most (64 MiB); 16 rows at least */
#define DTR__ATT_THREADS 128           /* threads of a row kernel */

typedef struct dtr__cuda_att {
    int64_t B, T, C, H, D, n;          /* n: rows per tile */
    float scale;
    dtr_dtype p;                       /* q, k, v, y and the products' operands: f32 or 16-bit */
    int64_t es;                        /* bytes of one of them */
} dtr__cuda_att;

/* One tile: query rows [t0, t0 + n) against keys [0, L), L = t0 + n. Row i of item z = (b, h)
   (block (i, z)) sees keys j <= t0 + i; its scores are S[(z n + i) L ..]. */
typedef struct dtr__cuda_att_tile {
    int64_t t0, n, L;
} dtr__cuda_att_tile;

/* The tiles of one call: scores and their gradient in f32 (P and dS are written over them, in
   the operands' type), dy in that type (16-bit: a rounded copy). */
typedef struct dtr__cuda_att_bufs {
    float *S, *dP;
    const void *G;
    void **ptrs;                       /* the products' pointer arrays */
} dtr__cuda_att_bufs;

/* f32 elements of a score row per element of the row written over it (1 for f32, 2 for 16 bits) */
#define DTR__ATT_PACK(a) (4 / (a).es)

/* S (B H, n, L) scores -> P over them (0 past the causal edge); lse (B, H, T) of each row */
__global__ static void dtr__cuda_att_softmax_k(float *S, float *lse, dtr__cuda_att a, dtr__cuda_att_tile w) {
    int64_t i = blockIdx.x, t = w.t0 + i;
    for (int64_t z = blockIdx.y; z < a.B * a.H; z += gridDim.y) {
        int64_t row = (z * w.n + i) * w.L;
        const float *s = S + row;
        dtr__cuda_mem P = {S, (int)a.p};
        float mx = -INFINITY;
        double sum = 0.0;
        for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) mx = fmaxf(mx, s[j]);
        mx = dtr__cuda_block_max(mx);
        for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) sum += exp((double)(s[j] - mx));
        sum = dtr__cuda_block_sum(sum);
        for (int64_t c = 0; c < w.L; c += blockDim.x) {   /* a chunk read, then written: the 16-bit row overlaps it */
            int64_t j = c + threadIdx.x;
            float p = j <= t ? (float)(exp((double)(s[j] - mx)) / sum) : 0.0f;
            __syncthreads();
            if (j < w.L) P.st(row * DTR__ATT_PACK(a) + j, p);
            __syncthreads();
        }
        if (threadIdx.x == 0) lse[z * a.T + t] = mx + (float)log(sum);
    }
}

/* Backward: P = exp(S - lse) over S, then dS = P (dP - Drow) scale over dP (0 past the edge) */
__global__ static void dtr__cuda_att_dscore_k(float *S, float *dP, const float *lse, const float *Drow, dtr__cuda_att a,
                                             dtr__cuda_att_tile w) {
    int64_t i = blockIdx.x, t = w.t0 + i;
    for (int64_t z = blockIdx.y; z < a.B * a.H; z += gridDim.y) {
        int64_t row = (z * w.n + i) * w.L;
        float l = lse[z * a.T + t], dr = Drow[z * a.T + t];
        dtr__cuda_mem P = {S, (int)a.p}, dS = {dP, (int)a.p};
        for (int64_t c = 0; c < w.L; c += blockDim.x) {
            int64_t j = c + threadIdx.x;
            float p = j <= t ? expf(S[row + j] - l) : 0.0f, g = j < w.L ? dP[row + j] : 0.0f;
            __syncthreads();
            if (j < w.L) P.st(row * DTR__ATT_PACK(a) + j, p), dS.st(row * DTR__ATT_PACK(a) + j, p * (g - dr) * a.scale);
            __syncthreads();
        }
    }
}

/* Drow (B, H, T) = dy_t . y_t per head, one warp per row */
__global__ static void dtr__cuda_att_drow_k(dtr__cuda_mem Y, const float *G, float *Drow, dtr__cuda_att a) {
    int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (row >= a.B * a.H * a.T) return;
    int64_t b = row / (a.H * a.T), h = (row / a.T) % a.H, t = row % a.T, off = (b * a.T + t) * a.C + h * a.D;
    float acc = 0.0f;
    for (int64_t d = lane; d < a.D; d += 32) acc += G[off + d] * Y.ld(off + d);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if (lane == 0) Drow[row] = acc;
}

/* 1 when node nd runs on its 16-bit tensors as stored: q, k, v and y of the products' type */
static int dtr__cuda_att16(const dtr_context *ctx, const dtr__node *nd) {
    dtr_dtype p = dtr__cuda_product_dtype(ctx);
    return p != DTR_F32 && nd->in[0]->dtype == p && nd->in[1]->dtype == p && nd->in[2]->dtype == p && nd->out->dtype == p;
}

static void dtr__cuda_att_make(const dtr_context *ctx, const dtr__node *nd, dtr__cuda_att *a) {
    int64_t fit;
    a->B = nd->in[0]->shape[0]; a->T = nd->in[0]->shape[1]; a->C = nd->in[0]->shape[2];
    a->H = nd->p.heads; a->D = a->C / a->H;
    a->scale = 1.0f / sqrtf((float)a->D);
    a->p = dtr__cuda_att16(ctx, nd) ? nd->out->dtype : DTR_F32;
    a->es = (int64_t)dtr_dtype_size(a->p);
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

/* The call's buffers in the context's scratch (not the step arena: only the op's own launches
   use them): f32 score tiles (1 forward, 2 backward), for 16 bits backward dy rounded, then
   the products' pointer arrays. NULL S with the error set. */
static dtr__cuda_att_bufs dtr__cuda_att_scratch(dtr_context *ctx, const dtr__cuda_att *a, int bwd) {
    dtr__cuda_att_bufs b;
    int64_t f32 = dtr__cuda_align256(a->B * a->H * a->n * a->T * 4);
    int64_t g16 = a->p == DTR_F32 || !bwd ? 0 : dtr__cuda_align256(a->B * a->T * a->C * 2);
    char *p = (char *)dtr__cuda_scratch(ctx, (size_t)((1 + bwd) * f32 + g16 + 3 * a->B * a->H * (int64_t)sizeof(void *)));
    memset(&b, 0, sizeof b);
    if (!p) return b;
    b.S = (float *)p;
    b.dP = bwd ? (float *)(p + f32) : NULL;
    b.G = g16 ? (const void *)(p + (1 + bwd) * f32) : NULL;
    b.ptrs = (void **)(p + (1 + bwd) * f32 + g16);
    return b;
}

/* strides of (b, h) items: rows of x (B, T, C) head by head in elements of `bytes`; tiles of
   scores (f32) or of what is written over them (the operands' type: pack 2 for 16 bits, whose
   rows are 2 L elements apart) */
static dtr__cuda_bstride dtr__cuda_att_x(const dtr__cuda_att *a, int64_t bytes) {
    dtr__cuda_bstride s = {a->T * a->C, a->D, bytes};
    return s;
}
static dtr__cuda_bstride dtr__cuda_att_s(const dtr__cuda_att *a, dtr__cuda_att_tile w, int packed) {
    int64_t f = packed ? DTR__ATT_PACK(*a) : 1;
    dtr__cuda_bstride s = {a->H * w.n * w.L * f, w.n * w.L * f, packed ? a->es : 4};
    return s;
}
/* element e of a buffer of `bytes`-sized elements */
static const void *dtr__cuda_att_at(const void *p, int64_t e, int64_t bytes) { return (const char *)p + e * bytes; }
/* the products' types: operands of the call's type into f32 (scores, gradients) or into it (y) */
static dtr__cuda_gemm_t dtr__cuda_att_t(const dtr__cuda_att *a, int to_p) {
    dtr__cuda_gemm_t t = {dtr__cuda_blas_type(a->p), to_p ? dtr__cuda_blas_type(a->p) : CUDA_R_32F};
    return t;
}

/* S (B H, n, L) = scale q[t0:t0+n] k[0:L]^T, every batch item and head */
static dtr_result dtr__cuda_att_scores(dtr_context *ctx, const dtr__node *nd, const dtr__cuda_att *a, dtr__cuda_att_tile w,
                                       const dtr__cuda_att_bufs *b) {
    const void *Q = dtr__data(nd->in[0]), *K = dtr__data(nd->in[1]);
    return dtr__cuda_gemm2(ctx, dtr__cuda_att_t(a, 0), w.n, w.L, a->D, a->scale, dtr__cuda_att_at(Q, w.t0 * a->C, a->es), a->C, 1,
                           dtr__cuda_att_x(a, a->es), K, 1, a->C, dtr__cuda_att_x(a, a->es), 0.0f, b->S, w.L, dtr__cuda_att_s(a, w, 0),
                           a->B, a->H, b->ptrs);
}

static dtr_result dtr__cuda_attention_run_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_att a;
    dtr__cuda_att_bufs b;
    float *lse;
    dtr__cuda_att_make(ctx, nd, &a);
    lse = (float *)dtr__node_save(ctx, nd, (size_t)(a.B * a.H * a.T + 1) * sizeof(float)); /* row log-sum-exps */
    if (!lse) return ctx->status;
    nd->saved = lse;
    if (a.B * a.H * a.T == 0) return DTR_OK;
    if (!(b = dtr__cuda_att_scratch(ctx, &a, 0)).S) return ctx->status;
    for (int64_t t0 = 0; t0 < a.T; t0 += a.n) {
        dtr__cuda_att_tile w = dtr__cuda_att_tile_at(&a, t0);
        if (dtr__cuda_att_scores(ctx, nd, &a, w, &b) != DTR_OK) return ctx->status;
        dtr__cuda_att_softmax_k<<<dim3((unsigned)w.n, dtr__cuda_att_ys(&a)), DTR__ATT_THREADS, 0, dtr__cuda_stream(ctx)>>>(b.S, lse, a, w);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
        /* y[t0:t0+n] (n, D) = P (n, L) v[0:L] (L, D) */
        if (dtr__cuda_gemm2(ctx, dtr__cuda_att_t(&a, 1), w.n, a.D, w.L, 1.0f, b.S, w.L * DTR__ATT_PACK(a), 1, dtr__cuda_att_s(&a, w, 1),
                            dtr__data(nd->in[2]), a.C, 1, dtr__cuda_att_x(&a, a.es), 0.0f, (void *)dtr__cuda_att_at(dtr__data(nd->out), t0 * a.C, a.es),
                            a.C, dtr__cuda_att_x(&a, a.es), a.B, a.H, b.ptrs) != DTR_OK)
            return ctx->status;
    }
    return DTR_OK;
}

/* One tile's backward: P and dS from the recomputed scores, then dq, dk, dv (accumulated in f32). */
static dtr_result dtr__cuda_att_bwd_tile(dtr_context *ctx, dtr__node *nd, const dtr__cuda_att *a, dtr__cuda_att_tile w,
                                         const dtr__cuda_att_bufs *b, const float *Drow) {
    const void *Q = dtr__data(nd->in[0]), *K = dtr__data(nd->in[1]), *V = dtr__data(nd->in[2]);
    float *GQ = dtr__gradof(nd->in[0]), *GK = dtr__gradof(nd->in[1]), *GV = dtr__gradof(nd->in[2]);
    int64_t D = a->D, C = a->C, es = a->es;
    const void *Gt = dtr__cuda_att_at(b->G, w.t0 * C, es), *Qt = dtr__cuda_att_at(Q, w.t0 * C, es);
    int64_t ld = w.L * DTR__ATT_PACK(*a);   /* the row stride of P and dS */
    dtr__cuda_bstride x = dtr__cuda_att_x(a, es), x32 = dtr__cuda_att_x(a, 4), sc = dtr__cuda_att_s(a, w, 1);
    dtr__cuda_gemm_t t = dtr__cuda_att_t(a, 0);
    if (dtr__cuda_att_scores(ctx, nd, a, w, b) != DTR_OK) return ctx->status;
    /* dP (n, L) = dy[t0:] (n, D) v[0:L]^T (D, L) */
    if (dtr__cuda_gemm2(ctx, t, w.n, w.L, D, 1.0f, Gt, C, 1, x, V, 1, C, x, 0.0f, b->dP, w.L, dtr__cuda_att_s(a, w, 0), a->B, a->H,
                        b->ptrs) != DTR_OK)
        return ctx->status;
    dtr__cuda_att_dscore_k<<<dim3((unsigned)w.n, dtr__cuda_att_ys(a)), DTR__ATT_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        b->S, b->dP, (const float *)nd->saved, Drow, *a, w);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    if (GQ && dtr__cuda_gemm2(ctx, t, w.n, D, w.L, 1.0f, b->dP, ld, 1, sc, K, C, 1, x, 1.0f, GQ + w.t0 * C, C, x32, a->B, a->H,
                              b->ptrs) != DTR_OK)
        return ctx->status;   /* dq[t0:] += dS (n, L) k[0:L] (L, D) */
    if (GK && dtr__cuda_gemm2(ctx, t, w.L, D, w.n, 1.0f, b->dP, 1, ld, sc, Qt, C, 1, x, 1.0f, GK, C, x32, a->B, a->H, b->ptrs) != DTR_OK)
        return ctx->status;   /* dk[0:L] += dS^T (L, n) q[t0:] (n, D) */
    if (GV && dtr__cuda_gemm2(ctx, t, w.L, D, w.n, 1.0f, b->S, 1, ld, sc, Gt, C, 1, x, 1.0f, GV, C, x32, a->B, a->H, b->ptrs) != DTR_OK)
        return ctx->status;   /* dv[0:L] += P^T (L, n) dy[t0:] (n, D) */
    return DTR_OK;
}

static dtr_result dtr__cuda_attention_run_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_att a;
    dtr__cuda_att_bufs b;
    float *Drow;
    int64_t rows;
    if (!dtr__gradof(nd->in[0]) && !dtr__gradof(nd->in[1]) && !dtr__gradof(nd->in[2])) return DTR_OK;
    dtr__cuda_att_make(ctx, nd, &a);
    rows = a.B * a.H * a.T;
    if (rows == 0) return DTR_OK;
    Drow = (float *)dtr__node_save(ctx, nd, (size_t)rows * sizeof(float));
    b = dtr__cuda_att_scratch(ctx, &a, 1);
    if (!Drow || !b.S) return ctx->status;
    if (!b.G) {
        b.G = nd->out->grad;   /* f32: dy as it is */
    } else {
        char *g = (char *)b.G;
        if (!dtr__cuda_as16(ctx, nd->out->grad, DTR_F32, a.p, a.B * a.T * a.C, &g)) return ctx->status;
    }
    dtr__cuda_att_drow_k<<<dtr__launch_blocks(rows * 32, DTR__CUDA_THREADS, INT32_MAX), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(nd->out), nd->out->grad, Drow, a);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    for (int64_t t0 = 0; t0 < a.T; t0 += a.n)
        if (dtr__cuda_att_bwd_tile(ctx, nd, &a, dtr__cuda_att_tile_at(&a, t0), &b, Drow) != DTR_OK) return ctx->status;
    return DTR_OK;
}

/* attention's table entry (narrow: 16-bit tensors of the products' type as stored, others
   widened into f32 copies here) */
static dtr_result dtr__cuda_attention_fwd(dtr_context *ctx, dtr__node *nd) {
    return dtr__cuda_att16(ctx, nd) ? dtr__cuda_attention_run_fwd(ctx, nd) : dtr__cuda_wide(ctx, nd, 0, dtr__cuda_attention_run_fwd);
}
static dtr_result dtr__cuda_attention_bwd(dtr_context *ctx, dtr__node *nd) {
    return dtr__cuda_att16(ctx, nd) ? dtr__cuda_attention_run_bwd(ctx, nd) : dtr__cuda_wide(ctx, nd, 1, dtr__cuda_attention_run_bwd);
}
