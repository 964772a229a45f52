/* ============================================================================
 * Fused attention on the GPU, the CPU op's shapes and math (src/ops/ops_nn.c): q, y (B, Tq,
 * C), k, v (B, Tk, C), C = H * D, head h in columns h*D.., lse (B, H, Tq) kept for backward;
 * causal (query t sees keys 0 .. q_start + t, q_start + Tq <= Tk) or not (every key).
 * As the CPU does it, query rows go in tiles; a tile's scores against the keys it may see,
 * S = scale q k^T (n x L for every batch item and head at once: one batched cuBLAS GEMM; L
 * the keys the tile sees), a row kernel turns them into probabilities P (with each row's
 * log-sum-exp), and y = P v is a second GEMM. Backward recomputes P from lse: dP = dy v^T,
 * dS = P (dP - rowsum(dy y)) scale, dq += dS k, dk += dS^T q, dv += P^T dy, all GEMMs. Dropout
 * (training): the row kernels multiply P by the CPU's mask (each element's draw found by
 * jumping the stream) in forward and again in backward (dv from P m, dS from dP m); the fused
 * kernels below do the same, a lane jumping once and then stepping along its keys or rows.
 * Memory: two B x H x n x L tiles in the context's scratch, n <= DTR__ATT_TILE rows and at
 * most DTR__ATT_SCRATCH floats each, never Tq x Tk per head; the step keeps only lse. Sums are
 * cuBLAS's and fixed trees: runs repeat bit for bit; no atomics.
 * 16-bit (activations of the type of matmul_precision, as linear): q, k, v and y as stored, the
 * products on 16-bit operands summed in f32 (cublasGemmEx, CUBLAS_COMPUTE_32F): scores in f32,
 * P rounded to 16 bits for P v (as the f32 path's fast 16-bit compute rounds it inside cuBLAS),
 * written over its own row of scores (a 16-bit row is the first half of the f32 row: the row
 * kernels read a chunk of the row, wait at a barrier, then write it), so the tiles take the f32
 * path's memory; backward rounds dy to 16 bits once (B Tq C), and P and dS per tile the same
 * way, the gradients summed in f32. Otherwise 16-bit tensors are widened into f32 copies.
 * Head width 32, 64 (the GPTs'), 96 or 128: the fused kernels further down (flash attention,
 * forward and backward on tensor cores), which keep no score tiles at all: on 16-bit operands
 * (16-bit tensors, or f32 ones with 16-bit products, rounded into dense 16-bit copies first),
 * TF32 (f32 with allow_tf32 or TF32 products) or f32 (each product three TF32 products of split
 * operands).
 * q, k, v are read with their own strides (dense rows: the CPU op copies others), so the column
 * slices of one qkv projection are read where they lie; y, dy and the gradients are dense.
 * ==========================================================================*/

#define DTR__ATT_TILE 256              /* query rows per tile, at most */
#define DTR__ATT_SCRATCH (1 << 24)     /* floats of one score tile, at most (64 MiB); 16 rows at least */
#define DTR__ATT_THREADS 128           /* threads of a row kernel */

/* the fused kernels' operands: bf16 or fp16 tiles, or f32 tiles with TF32 products (once, or
   three on split operands: f32's precision) */
enum { DTR__FA_BF16, DTR__FA_F16, DTR__FA_TF32, DTR__FA_F32, DTR__FA_KINDS };

typedef struct dtr__cuda_att {
    int64_t B, Tq, Tk, C, H, D, n;     /* q, y, dy (B, Tq, C), k, v (B, Tk, Ck); n: rows per tile */
    int64_t Ck, Hk, rep;               /* k's and v's width and heads (Hk D); q heads per kv head */
    int64_t sb[4], sr[4];              /* elements between batch items, between rows: of q, k, v (their
                                          rows 3C apart where they slice one qkv), then of y, dy (C) */
    int causal;                        /* 1: query t sees keys 0 .. qs + t (qs + Tq <= Tk); 0: all Tk */
    int64_t qs;                        /* causal: the key position of query 0 (q_start) */
    const int32_t *len;                /* key_lengths (B) on the device, or NULL: every key */
    float scale;
    float drop;                        /* the weights' dropout (0: none) and its mask's draws */
    dtr__draws draws;
    dtr_dtype p;                       /* q, k, v, y and the products' operands: f32 or 16-bit */
    int64_t es;                        /* bytes of one of them */
    int fa;                            /* the fused kernels' operands (DTR__FA_BF16 ..) */
} dtr__cuda_att;

/* One tile: query rows [t0, t0 + n) against keys [0, L), L = qs + t0 + n (causal) or Tk. Row i of
   item z = (b, h) (block (i, z)) sees keys j < dtr__cuda_att_seen(a, w, i, z); its scores are
   S[(z n + i) L ..]. */
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

/* the keys of item z = (b, h): Tk, or its key length clamped into [1, Tk] (one outside is
   flagged by dtr__cuda_att_lens_k) */
__device__ static int64_t dtr__cuda_att_keys(const dtr__cuda_att &a, int64_t z) {
    int64_t n = a.len ? a.len[z / a.H] : a.Tk;
    return n < 1 ? 1 : n > a.Tk ? a.Tk : n;
}
/* the keys row i of tile w of item z sees: 0 .. qs + t0 + i (causal) or every key of the tile
   (L), none past the item's keys */
__device__ static int64_t dtr__cuda_att_seen(const dtr__cuda_att &a, const dtr__cuda_att_tile &w, int64_t i, int64_t z) {
    int64_t n = a.causal ? a.qs + w.t0 + i + 1 : w.L, k = dtr__cuda_att_keys(a, z);
    return n < k ? n : k;
}

/* the generator's state at the dropout draw of key j of query row t of item z: element
   ((z Tq + t) Tk + j) of the mask over (B, H, Tq, Tk), the CPU's draw; the next key's draw
   follows it (dtr__f_pcg_next), the next row's is Tk draws on */
__device__ static uint64_t dtr__cuda_att_state(const dtr__cuda_att &a, int64_t z, int64_t t, int64_t j) {
    return dtr__f_pcg_at(a.draws.rng.state, a.draws.rng.inc, (z * a.Tq + t) * a.Tk + j, a.draws.width, a.draws.cols, a.draws.col0);
}
/* the dropout mask's value at the state's draw (0 or 1 / (1 - p)), stepping it */
__device__ static float dtr__cuda_att_draw(const dtr__cuda_att &a, uint64_t *st) {
    return dtr__f_dropout_mask(dtr__f_pcg_next(st, a.draws.rng.inc), a.drop);
}
/* the mask's value at key j of row t of item z (1 without dropout) */
__device__ static float dtr__cuda_att_mask(const dtr__cuda_att &a, int64_t z, int64_t t, int64_t j) {
    uint64_t st;
    if (a.drop == 0.0f) return 1.0f;
    st = dtr__cuda_att_state(a, z, t, j);
    return dtr__cuda_att_draw(a, &st);
}

/* flags (the context's error word) the first key length outside [1, Tk] */
__global__ static void dtr__cuda_att_lens_k(dtr__cuda_att a, int *err) {
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < a.B; b += (int64_t)gridDim.x * blockDim.x)
        if (a.len[b] < 1 || a.len[b] > a.Tk) dtr__cuda_flag(err, DTR_OP_ATTENTION, b);
}

/* S (B H, n, L) scores -> P over them (0 past the causal edge; times the dropout mask); lse
   (B, H, Tq) of each row */
__global__ static void dtr__cuda_att_softmax_k(float *S, float *lse, dtr__cuda_att a, dtr__cuda_att_tile w) {
    int64_t i = blockIdx.x, t = w.t0 + i;
    for (int64_t z = blockIdx.y; z < a.B * a.H; z += gridDim.y) {
        int64_t row = (z * w.n + i) * w.L, seen = dtr__cuda_att_seen(a, w, i, z);
        const float *s = S + row;
        dtr__cuda_mem P = {S, (int)a.p};
        float mx = -INFINITY;
        double sum = 0.0;
        for (int64_t j = threadIdx.x; j < seen; j += blockDim.x) mx = fmaxf(mx, s[j]);
        mx = dtr__cuda_block_max(mx);
        for (int64_t j = threadIdx.x; j < seen; j += blockDim.x) sum += exp((double)(s[j] - mx));
        sum = dtr__cuda_block_sum(sum);
        for (int64_t c = 0; c < w.L; c += blockDim.x) {   /* a chunk read, then written: the 16-bit row overlaps it */
            int64_t j = c + threadIdx.x;
            float p = j < seen ? (float)(exp((double)(s[j] - mx)) / sum) * dtr__cuda_att_mask(a, z, t, j) : 0.0f;
            __syncthreads();
            if (j < w.L) P.st(row * DTR__ATT_PACK(a) + j, p);
            __syncthreads();
        }
        if (threadIdx.x == 0) lse[z * a.Tq + t] = mx + (float)log(sum);
    }
}

/* Backward: P = exp(S - lse), then P m over S (m the dropout mask's values, 1 without) and
   dS = P (dP m - Drow) scale over dP (0 past the edge) */
__global__ static void dtr__cuda_att_dscore_k(float *S, float *dP, const float *lse, const float *Drow, dtr__cuda_att a,
                                             dtr__cuda_att_tile w) {
    int64_t i = blockIdx.x, t = w.t0 + i;
    for (int64_t z = blockIdx.y; z < a.B * a.H; z += gridDim.y) {
        int64_t row = (z * w.n + i) * w.L, seen = dtr__cuda_att_seen(a, w, i, z);
        float l = lse[z * a.Tq + t], dr = Drow[z * a.Tq + t];
        dtr__cuda_mem P = {S, (int)a.p}, dS = {dP, (int)a.p};
        for (int64_t c = 0; c < w.L; c += blockDim.x) {
            int64_t j = c + threadIdx.x;
            float p = j < seen ? expf(S[row + j] - l) : 0.0f, g = j < w.L ? dP[row + j] : 0.0f;
            float m = j < seen ? dtr__cuda_att_mask(a, z, t, j) : 1.0f;
            __syncthreads();
            if (j < w.L) P.st(row * DTR__ATT_PACK(a) + j, p * m), dS.st(row * DTR__ATT_PACK(a) + j, p * (g * m - dr) * a.scale);
            __syncthreads();
        }
    }
}

/* Drow (B, H, Tq) = dy_t . y_t per head, one warp per row */
__global__ static void dtr__cuda_att_drow_k(dtr__cuda_mem Y, const float *G, float *Drow, dtr__cuda_att a) {
    int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (row >= a.B * a.H * a.Tq) return;
    int64_t b = row / (a.H * a.Tq), h = (row / a.Tq) % a.H, t = row % a.Tq, off = (b * a.Tq + t) * a.C + h * a.D;
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

/* the fused kernels' operands of the context's products: 16-bit (matmul_precision), TF32
   (allow_tf32, matmul_precision TF32) or f32 */
static int dtr__cuda_fa_kind_of(const dtr_context *ctx) {
    dtr_dtype p = dtr__cuda_product_dtype(ctx);
    if (p != DTR_F32) return p == DTR_BF16 ? DTR__FA_BF16 : DTR__FA_F16;
    return ctx->cfg.allow_tf32 || ctx->cfg.matmul_precision == DTR_MATMUL_TF32 ? DTR__FA_TF32 : DTR__FA_F32;
}

static void dtr__cuda_att_make(const dtr_context *ctx, const dtr__node *nd, dtr__cuda_att *a) {
    int64_t fit;
    a->B = nd->in[0]->shape[0]; a->Tq = nd->in[0]->shape[1]; a->Tk = nd->in[1]->shape[1]; a->C = nd->in[0]->shape[2];
    a->H = nd->p.attention.heads; a->D = a->C / a->H;
    a->Ck = nd->in[1]->shape[2], a->Hk = nd->p.attention.kv_heads, a->rep = a->H / a->Hk;
    for (int i = 0; i < 3; i++) a->sb[i] = nd->in[i]->stride[0], a->sr[i] = nd->in[i]->stride[1];
    a->sb[3] = a->Tq * a->C, a->sr[3] = a->C;
    a->causal = nd->p.attention.causal;
    a->qs = nd->p.attention.q_start;
    a->len = nd->n_in > 3 && nd->in[3] ? (const int32_t *)dtr__data(nd->in[3]) : NULL;
    a->scale = nd->p.attention.scale;
    a->drop = nd->p.attention.dropout, a->draws = nd->p.attention.draws;
    a->p = dtr__cuda_att16(ctx, nd) ? nd->out->dtype : DTR_F32;
    a->es = (int64_t)dtr_dtype_size(a->p);
    a->fa = dtr__cuda_fa_kind_of(ctx);
    fit = DTR__ATT_SCRATCH / (a->B * a->H * (a->Tk ? a->Tk : 1));
    a->n = fit > DTR__ATT_TILE ? DTR__ATT_TILE : fit < 16 ? 16 : fit;
    if (a->n > a->Tq) a->n = a->Tq;
}

/* the row kernels' grid height: one (b, h) item per block row (of `heads` a batch item), looping
   past 65535 */
static unsigned dtr__cuda_att_ys(const dtr__cuda_att *a, int64_t heads = 0) {
    int64_t n = a->B * (heads ? heads : a->H);
    return (unsigned)(n < 65535 ? n : 65535);
}

static dtr__cuda_att_tile dtr__cuda_att_tile_at(const dtr__cuda_att *a, int64_t t0) {
    dtr__cuda_att_tile w;
    w.t0 = t0;
    w.n = a->Tq - t0 < a->n ? a->Tq - t0 : a->n;
    w.L = a->causal ? a->qs + t0 + w.n : a->Tk;
    return w;
}

/* The call's buffers in the context's scratch (not the step arena: only the op's own launches
   use them): f32 score tiles (1 forward, 2 backward), for 16 bits backward dy rounded, then
   the products' pointer arrays. NULL S with the error set. */
static dtr__cuda_att_bufs dtr__cuda_att_scratch(dtr_context *ctx, const dtr__cuda_att *a, int bwd) {
    dtr__cuda_att_bufs b;
    int64_t f32 = dtr__cuda_align256(a->B * a->H * a->n * a->Tk * 4);
    int64_t g16 = a->p == DTR_F32 || !bwd ? 0 : dtr__cuda_align256(a->B * a->Tq * a->C * 2);
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
static dtr__cuda_bstride dtr__cuda_att_x(const dtr__cuda_att *a, int64_t T, int64_t bytes) {
    dtr__cuda_bstride s = {T * a->C, a->D, bytes};
    return s;
}
/* of input i (q, k, v: their own batch strides) */
static dtr__cuda_bstride dtr__cuda_att_in(const dtr__cuda_att *a, int i) {
    dtr__cuda_bstride s = {a->sb[i], a->D, a->es};
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

/* dtr__cuda_gemm2 over the (b, h) items, a kv head's rep q heads one product after another:
   the operands marked q-side (bits 1 A, 2 B, 4 Y) step through the group's q heads (base at
   member r, items rep heads apart), the others sit at the kv head (items over b and Hk). With
   rep 1 it is one product over every (b, h); the group's products add into a kv-side output
   in order (no two items of one product write the same rows). */
static dtr_result dtr__cuda_att_gemm(dtr_context *ctx, const dtr__cuda_att *a, int qside, dtr__cuda_gemm_t t, int64_t M, int64_t N,
                                     int64_t K, float alpha, const void *A, int64_t rsa, int64_t csa, dtr__cuda_bstride sa, const void *B,
                                     int64_t rsb, int64_t csb, dtr__cuda_bstride sb, float beta, void *Y, int64_t ldy,
                                     dtr__cuda_bstride sy, void **ptrs) {
    for (int64_t r = 0; r < a->rep; r++) {
        dtr__cuda_bstride xa = sa, xb = sb, xy = sy;
        const char *pa = (const char *)A, *pb = (const char *)B;
        char *py = (char *)Y;
        if (qside & 1) pa += r * sa.inner * sa.bytes, xa.inner *= a->rep;
        if (qside & 2) pb += r * sb.inner * sb.bytes, xb.inner *= a->rep;
        if (qside & 4) py += r * sy.inner * sy.bytes, xy.inner *= a->rep;
        if (dtr__cuda_gemm2(ctx, t, M, N, K, alpha, pa, rsa, csa, xa, pb, rsb, csb, xb, beta, py, ldy, xy, a->B, a->Hk, ptrs) != DTR_OK)
            return ctx->status;
    }
    return DTR_OK;
}

/* S (B H, n, L) = scale q[t0:t0+n] k[0:L]^T, every batch item and head */
static dtr_result dtr__cuda_att_scores(dtr_context *ctx, const dtr__node *nd, const dtr__cuda_att *a, dtr__cuda_att_tile w,
                                       const dtr__cuda_att_bufs *b) {
    const void *Q = dtr__data(nd->in[0]), *K = dtr__data(nd->in[1]);
    return dtr__cuda_att_gemm(ctx, a, 5, dtr__cuda_att_t(a, 0), w.n, w.L, a->D, a->scale, dtr__cuda_att_at(Q, w.t0 * a->sr[0], a->es),
                              a->sr[0], 1, dtr__cuda_att_in(a, 0), K, 1, a->sr[1], dtr__cuda_att_in(a, 1), 0.0f, b->S, w.L,
                              dtr__cuda_att_s(a, w, 0), b->ptrs);
}

/* ---- the fused forward (flash attention): head width D = 32, 64, 96, 128 ----
 * One block of 4 warps per 64 query rows of one (b, h); each warp owns 16 rows. Per step of 64
 * keys (up to the causal edge, or all Tk): the block loads the k and v tiles into shared memory, each
 * warp computes its rows' scores q k^T with tensor cores (wmma, f32 sums) into shared f32 rows,
 * updates its rows' running maximum and sum (online softmax, f32) and writes P in the tiles'
 * type over the k tile (every warp has read it), rescales its output rows (accumulators staged
 * through its score rows) and adds P v. The end divides by the sums, writes y and the rows'
 * log-sum-exps (what backward recomputes P from). Shared memory (dynamic, dtr__fa<O, D>::fwd):
 * 16-bit tiles 45.8 KB for D 32 and 64, 66.3 KB for 96, 86.8 KB for 128; f32 tiles 70.4, 70.4,
 * 103.1 and 135.9 KB (the limit above 48 KB is raised per device when the context is made,
 * dtr__cuda_fa_setup; a size the device refuses takes the tiled kernels). The scores never
 * leave the chip, nothing of Tq x Tk is stored. Rows past Tq and keys past Tk read zeros and
 * are masked. */

#define DTR__FA_ROWS 64     /* query rows of a block, 16 a warp */
#define DTR__FA_KEYS 64     /* keys of a step */
#define DTR__FA_STEP 32     /* rows of the other side per step of the backward */
#define DTR__FA_LQ 36       /* f32 row stride of a backward step (16-bit rows over them: 72) */
#define DTR__FA_THREADS 128
#define DTR__FA_WIDTHS(X) X(32) X(64) X(96) X(128)   /* head widths with fused kernels */

/* The operands of kind O (DTR__FA_BF16 ..): the tiles' element E and dtype dt, the wmma
   element W and the k of one tensor-core product (16 for 16 bits, 8 for TF32). */
template <int O> struct dtr__fa_op {
    typedef typename std::conditional<O == DTR__FA_BF16, __nv_bfloat16,
                                      typename std::conditional<O == DTR__FA_F16, __half, float>::type>::type E;
    typedef typename std::conditional<(O >= DTR__FA_TF32), nvcuda::wmma::precision::tf32, E>::type W;
    static constexpr int K = O >= DTR__FA_TF32 ? 8 : 16;
    static constexpr int dt = O == DTR__FA_BF16 ? DTR_BF16 : O == DTR__FA_F16 ? DTR_F16 : DTR_F32;
};

/* The tiles of kind O and head width D: rows of LD elements (16 bytes more than W against bank
   conflicts; W at least a step's keys: the forward writes P's rows over the k tile), the
   forward's f32 rows of LS (a step's scores, then the output rows staged), PL: the backward's
   rows of E over its f32 rows, and the kernels' shared memory in bytes (the backward's: the
   larger of its two kernels'). */
template <int O, int D> struct dtr__fa {
    typedef typename dtr__fa_op<O>::E E;
    static constexpr int W = D > DTR__FA_KEYS ? D : DTR__FA_KEYS, LD = W + 16 / (int)sizeof(E), LS = W + 4;
    static constexpr int PL = DTR__FA_LQ * 4 / (int)sizeof(E);
    static constexpr int fwd = (DTR__FA_ROWS + 2 * DTR__FA_KEYS) * LD * (int)sizeof(E) + DTR__FA_ROWS * (LS + 3) * 4;
    static constexpr int bwd = (DTR__FA_ROWS + DTR__FA_STEP) * 2 * LD * (int)sizeof(E) + DTR__FA_ROWS * (2 * DTR__FA_LQ + 2) * 4;
};

template <int O> using dtr__fa_acc = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, dtr__fa_op<O>::K, float>;

/* `rows` rows r0.. of head h of item b of x (B, T, C; strides a.sb[i], a.sr[i]: q, k, v, dy;
   elements of the tiles' type) into a tile; zeros from row `end` on (past Tq, or past the keys the
   block sees: padding and unseen cache rows are never multiplied, whatever they hold). 16 bytes a load
   (dtr__cuda_fa_takes: x 16-byte aligned, its strides whole 16 bytes). */
template <int O, int D>
__device__ static void dtr__cuda_fa_load(typename dtr__fa_op<O>::E *dst, int rows, const void *x, const dtr__cuda_att &a, int i,
                                        int64_t b, int64_t h, int64_t r0, int64_t end) {
    typedef typename dtr__fa_op<O>::E E;
    const int V = 16 / (int)sizeof(E);
    for (int e = threadIdx.x; e < rows * D / V; e += blockDim.x) {
        int r = e / (D / V), d = e % (D / V) * V;
        int64_t t = r0 + r;
        uint4 v = {0u, 0u, 0u, 0u};
        if (t < end) v = *(const uint4 *)((const E *)x + b * a.sb[i] + t * a.sr[i] + h * D + d);
        *(uint4 *)(dst + r * dtr__fa<O, D>::LD + d) = v;
    }
}

/* a fragment x into TF32 (rounded) and what that leaves, small (TF32 too): x = big + small */
template <typename F> __device__ static void dtr__cuda_fa_split(F &x, F &small) {
    for (int t = 0; t < x.num_elements; t++) {
        float v = x.x[t];
        x.x[t] = nvcuda::wmma::__float_to_tf32(v);
        small.x[t] = nvcuda::wmma::__float_to_tf32(v - x.x[t]);
    }
}

/* c += a b on tensor cores for kind O: 16-bit as they are; TF32 rounded to TF32 (the hardware
   would drop the low bits); F32 as three TF32 products of x = big + small (both TF32):
   small_a big_b + big_a small_b + big_a big_b, the small ones first (about f32's precision,
   as PyTorch's f32 attention and cuBLAS's f32 GEMMs). */
template <int O, typename FA, typename FB> __device__ static void dtr__cuda_fa_mma1(dtr__fa_acc<O> &c, FA &a, FB &b) {
    if constexpr (O == DTR__FA_F32) {
        FA as;
        FB bs;
        dtr__cuda_fa_split(a, as);
        dtr__cuda_fa_split(b, bs);
        nvcuda::wmma::mma_sync(c, as, b, c);
        nvcuda::wmma::mma_sync(c, a, bs, c);
    } else if constexpr (O == DTR__FA_TF32) {
        for (int t = 0; t < a.num_elements; t++) a.x[t] = nvcuda::wmma::__float_to_tf32(a.x[t]);
        for (int t = 0; t < b.num_elements; t++) b.x[t] = nvcuda::wmma::__float_to_tf32(b.x[t]);
    }
    nvcuda::wmma::mma_sync(c, a, b, c);
}

/* acc[0..NT) (16 x 16 NT) += A (16 x KD, row-major at a, stride la) B (KD x 16 NT): B
   row-major at b (stride lb), or LB col_major: B's element (k, n) at b[n lb + k] (the
   transpose of row-major rows) */
template <int O, typename LB, int NT, int KD>
__device__ static void dtr__cuda_fa_mma(dtr__fa_acc<O> *acc, const typename dtr__fa_op<O>::E *a, int la,
                                       const typename dtr__fa_op<O>::E *b, int lb) {
    typedef dtr__fa_op<O> P;
    const bool rowb = std::is_same<LB, nvcuda::wmma::row_major>::value;
    for (int n = 0; n < NT; n++)
        for (int kk = 0; kk < KD / P::K; kk++) {
            nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, P::K, typename P::W, nvcuda::wmma::row_major> fa;
            nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, P::K, typename P::W, LB> fb;
            nvcuda::wmma::load_matrix_sync(fa, a + kk * P::K, la);
            nvcuda::wmma::load_matrix_sync(fb, b + (rowb ? kk * P::K * lb + n * 16 : n * 16 * lb + kk * P::K), lb);
            dtr__cuda_fa_mma1<O>(acc[n], fa, fb);
        }
}

/* acc[0..NT) into f32 rows at dst (stride ld) */
template <int O, int NT> __device__ static void dtr__cuda_fa_stage(float *dst, int ld, const dtr__fa_acc<O> *acc) {
    for (int n = 0; n < NT; n++) nvcuda::wmma::store_matrix_sync(dst + n * 16, acc[n], ld, nvcuda::wmma::mem_row_major);
}

/* The warp's 16 rows against 16 NT rows of another tile, (16 x D) (D x 16 NT): scores
   (unscaled) or dP, into f32 rows at dst (stride ld). */
template <int O, int D, int NT>
__device__ static void dtr__cuda_fa_rows(float *dst, int ld, const typename dtr__fa_op<O>::E *rows, const typename dtr__fa_op<O>::E *other) {
    dtr__fa_acc<O> c[NT];
    for (int n = 0; n < NT; n++) nvcuda::wmma::fill_fragment(c[n], 0.0f);
    dtr__cuda_fa_mma<O, nvcuda::wmma::col_major, NT, D>(c, rows, dtr__fa<O, D>::LD, other, dtr__fa<O, D>::LD);
    dtr__cuda_fa_stage<O, NT>(dst, ld, c);
}

/* Online softmax of the warp's rows against keys k0.. (of nk), two lanes a row (32 keys each):
   the new maximum m and sum l, the factor alpha the earlier output is scaled by, P (the tiles' type;
   times the dropout mask of item z) into sp's rows */
template <int O, int D>
__device__ static void dtr__cuda_fa_softmax(const float *ss, void *sp, float *sm, float *sl, float *sa, const dtr__cuda_att &a,
                                           int64_t z, int64_t q0, int64_t k0, int64_t nk, int w16, int lane) {
    const int LS = dtr__fa<O, D>::LS;
    int r = w16 + lane / 2, j0 = (lane & 1) * 32;
    int64_t t = q0 + r;
    float mx = -INFINITY, sum = 0.0f, m_old = sm[r], m_new, alpha;
    uint64_t st = a.drop != 0.0f ? dtr__cuda_att_state(a, z, t, k0 + j0) : 0u;   /* dropout: the lane's 32 draws in a row */
    dtr__cuda_mem P = {sp, dtr__fa_op<O>::dt};
    for (int j = j0; j < j0 + 32; j++)
        if ((!a.causal || k0 + j <= a.qs + t) && k0 + j < nk) mx = fmaxf(mx, ss[r * LS + j] * a.scale);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    m_new = fmaxf(m_old, mx);
    alpha = m_new == -INFINITY ? 1.0f : expf(m_old - m_new);
    for (int j = j0; j < j0 + 32; j++) {
        float p = (!a.causal || k0 + j <= a.qs + t) && k0 + j < nk && m_new != -INFINITY ? expf(ss[r * LS + j] * a.scale - m_new) : 0.0f;
        P.st(r * dtr__fa<O, D>::LD + j, a.drop != 0.0f ? p * dtr__cuda_att_draw(a, &st) : p);   /* the sum is the kept and dropped */
        sum += p;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (!(lane & 1)) sm[r] = m_new, sl[r] = sl[r] * alpha + sum, sa[r] = alpha;
}

/* the warp's output rows times their alpha (staged through its f32 rows); nothing to do when
   no row's maximum moved (every alpha 1: the product would be exact), as on most later steps */
template <int O, int D> __device__ static void dtr__cuda_fa_rescale(dtr__fa_acc<O> *o, float *ss, const float *sa, int w16, int lane) {
    const int LS = dtr__fa<O, D>::LS;
    if (!__ballot_sync(0xffffffffu, lane < 16 && sa[w16 + lane] != 1.0f)) return;
    dtr__cuda_fa_stage<O, D / 16>(ss + w16 * LS, LS, o);
    __syncwarp();
    for (int e = lane; e < 16 * D; e += 32) ss[(w16 + e / D) * LS + e % D] *= sa[w16 + e / D];
    __syncwarp();
    for (int n = 0; n < D / 16; n++) nvcuda::wmma::load_matrix_sync(o[n], ss + w16 * LS + n * 16, LS, nvcuda::wmma::mem_row_major);
}

/* y = output rows / l (of a.p), lse = m + log l, for the warp's rows inside Tq */
template <int O, int D>
__device__ static void dtr__cuda_fa_store(dtr__fa_acc<O> *o, float *ss, const float *sm, const float *sl, void *Y, float *lse,
                                         const dtr__cuda_att &a, int64_t z, int64_t q0, int w16, int lane) {
    const int LS = dtr__fa<O, D>::LS;
    dtr__cuda_mem y = {Y, (int)a.p};
    int64_t b = z / a.H, h = z % a.H;
    dtr__cuda_fa_stage<O, D / 16>(ss + w16 * LS, LS, o);
    __syncwarp();
    for (int e = lane; e < 16 * D; e += 32) {
        int r = w16 + e / D, d = e % D;
        if (q0 + r < a.Tq) y.st((b * a.Tq + q0 + r) * a.C + h * D + d, ss[r * LS + d] / sl[r]);
    }
    if (lane < 16 && q0 + w16 + lane < a.Tq) lse[z * a.Tq + q0 + w16 + lane] = sm[w16 + lane] + logf(sl[w16 + lane]);
}

/* the keys query block q0.. sees of an item's nk: up to its last row's (causal) or all nk */
__device__ static int64_t dtr__cuda_fa_kend(const dtr__cuda_att &a, int64_t q0, int64_t nk) {
    int64_t e = !a.causal ? nk : a.qs + (q0 + DTR__FA_ROWS < a.Tq ? q0 + DTR__FA_ROWS : a.Tq);
    return e < nk ? e : nk;
}

/* grid (query blocks, min(B H, 65535)), DTR__FA_THREADS threads, dtr__fa<O, D>::fwd bytes */
template <int O, int D>
__global__ static void __launch_bounds__(DTR__FA_THREADS) dtr__cuda_fa_fwd_k(const void *Q, const void *K, const void *V, void *Y,
                                                                            float *lse, dtr__cuda_att a) {
    typedef typename dtr__fa_op<O>::E E;
    const int LD = dtr__fa<O, D>::LD, LS = dtr__fa<O, D>::LS;
    extern __shared__ __align__(128) unsigned char dtr__fa_smem[];
    E *sq = (E *)dtr__fa_smem, *sk = sq + DTR__FA_ROWS * LD, *sv = sk + DTR__FA_KEYS * LD;
    float *ss = (float *)(sv + DTR__FA_KEYS * LD), *sm = ss + DTR__FA_ROWS * LS, *sl = sm + DTR__FA_ROWS, *sa = sl + DTR__FA_ROWS;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, w16 = warp * 16;
    int64_t q0 = (int64_t)blockIdx.x * DTR__FA_ROWS;
    for (int64_t z = blockIdx.y; z < a.B * a.H; z += gridDim.y) {
        int64_t nk = dtr__cuda_att_keys(a, z), kend = dtr__cuda_fa_kend(a, q0, nk);
        dtr__fa_acc<O> o[D / 16];
        dtr__cuda_fa_load<O, D>(sq, DTR__FA_ROWS, Q, a, 0, z / a.H, z % a.H, q0, a.Tq);
        if (threadIdx.x < DTR__FA_ROWS) sm[threadIdx.x] = -INFINITY, sl[threadIdx.x] = 0.0f;
        for (int n = 0; n < D / 16; n++) nvcuda::wmma::fill_fragment(o[n], 0.0f);
        for (int64_t k0 = 0; k0 < kend; k0 += DTR__FA_KEYS) {
            dtr__cuda_fa_load<O, D>(sk, DTR__FA_KEYS, K, a, 1, z / a.H, z % a.H / a.rep, k0, kend);
            dtr__cuda_fa_load<O, D>(sv, DTR__FA_KEYS, V, a, 2, z / a.H, z % a.H / a.rep, k0, kend);
            __syncthreads();
            dtr__cuda_fa_rows<O, D, DTR__FA_KEYS / 16>(ss + w16 * LS, LS, sq + w16 * LD, sk);   /* q k^T */
            __syncthreads();   /* every warp has read the k tile: P goes over it */
            dtr__cuda_fa_softmax<O, D>(ss, sk, sm, sl, sa, a, z, q0, k0, nk, w16, lane);
            __syncwarp();
            dtr__cuda_fa_rescale<O, D>(o, ss, sa, w16, lane);
            dtr__cuda_fa_mma<O, nvcuda::wmma::row_major, D / 16, DTR__FA_KEYS>(o, sk + w16 * LD, LD, sv, LD);   /* += P v */
            __syncthreads();   /* before the next tiles are loaded */
        }
        dtr__cuda_fa_store<O, D>(o, ss, sm, sl, Y, lse, a, z, q0, w16, lane);
        __syncthreads();
    }
}

/* ---- the fused backward: dk, dv and dq of attention with head width D ----
 * Two kernels, no atomics (each gradient element has one writer, so runs repeat bit for bit):
 * one block per 64 keys sums dk and dv over the query steps at or past them (causal), one
 * block per 64 queries sums dq over the key steps up to them; both recompute the scores on
 * tensor cores and P = exp(S - lse) from the forward's log-sum-exps, with dy in the tiles'
 * type (16 bits: rounded once, dO) and Drow = rowsum(dy y) (the tiled path's). A step is 32
 * rows of the other side: each warp's 16 x 32 scores and dP in f32 shared rows, P and dS in
 * the tiles' type over them (read, __syncwarp, write). dS = P (dP - Drow) scale with P in f32;
 * the products' operands P, dS, q, k, v and dO in the tiles' type, their sums in f32 (the
 * tiled path's roundings). Shared memory (dynamic, dtr__fa<O, D>::bwd): 16-bit tiles 46.6 KB
 * for D 32 and 64, 58.9 KB for 96, 71.2 KB for 128; f32 tiles 71.2, 71.2, 95.8, 120.4 KB. */

/* f(row, col, value) over the warp's 16 x 32 f32 rows at src (lane = column), then written in
   the tiles' type over the rows at dst (stride dtr__fa<O, D>::PL of them): every lane reads its
   column before any lane writes */
template <int O, typename F> __device__ static void dtr__cuda_fa_pack(float *dst, const float *src, int lane, F f) {
    const int PL = DTR__FA_LQ * 4 / (int)sizeof(typename dtr__fa_op<O>::E);
    float v[16];
    dtr__cuda_mem out = {dst, dtr__fa_op<O>::dt};
    for (int i = 0; i < 16; i++) v[i] = f(i, lane, src[i * DTR__FA_LQ + lane]);
    __syncwarp();
    for (int i = 0; i < 16; i++) out.st(i * PL + lane, v[i]);
    __syncwarp();
}

/* The dropout mask's values of 16 elements of item z from key j of row t on (1 without dropout):
   along the keys (j, j + 1, ..; one jump, then the draws in order) or along the rows (t, t + 1,
   ..; one jump, then Tk draws on each time: an affine step of the state, s' = mul s + add) */
__device__ static void dtr__cuda_fa_masks(float *m, const dtr__cuda_att &a, int64_t z, int64_t t, int64_t j, int along_rows) {
    uint64_t st, add, mul, s1;
    if (a.drop == 0.0f) {
        for (int i = 0; i < 16; i++) m[i] = 1.0f;
        return;
    }
    st = dtr__cuda_att_state(a, z, t, j);
    if (!along_rows) {
        for (int i = 0; i < 16; i++) m[i] = dtr__cuda_att_draw(a, &st);
        return;
    }
    add = dtr__f_pcg_advance(0u, a.draws.rng.inc, (uint64_t)a.Tk), mul = dtr__f_pcg_advance(1u, a.draws.rng.inc, (uint64_t)a.Tk) - add;
    for (int i = 0; i < 16; i++, st = mul * st + add) {
        s1 = st;
        m[i] = dtr__cuda_att_draw(a, &s1);
    }
}

/* acc[0..D/16) (16 x D, f32) into the gradient rows r0.. of a head of g (B, T, C): its first
   row's D values at head, rows C apart; added, rows past T left alone; staged 32 columns at a
   time through the warp's f32 rows st */
template <int O, int D>
__device__ static void dtr__cuda_fa_add(float *g, const dtr__fa_acc<O> *acc, float *st, int64_t T, int64_t C, int64_t head, int64_t r0,
                                       int lane) {
    for (int c = 0; c < D / 32; c++) {
        dtr__cuda_fa_stage<O, 2>(st, DTR__FA_LQ, acc + 2 * c);
        __syncwarp();
        for (int i = 0; i < 16; i++)
            if (r0 + i < T) g[head + (r0 + i) * C + c * 32 + lane] += st[i * DTR__FA_LQ + lane];
        __syncwarp();
    }
}

/* `rows` query rows q0.. of item z: q and dO into tiles, their log-sum-exps and Drow (0 past Tq) */
template <int O, int D>
__device__ static void dtr__cuda_fa_queries(typename dtr__fa_op<O>::E *sq, typename dtr__fa_op<O>::E *sg, float *sl, float *sd,
                                           int rows, const void *Q, const void *G, const float *lse, const float *Drow,
                                           const dtr__cuda_att &a, int64_t z, int64_t q0) {
    dtr__cuda_fa_load<O, D>(sq, rows, Q, a, 0, z / a.H, z % a.H, q0, a.Tq);
    dtr__cuda_fa_load<O, D>(sg, rows, G, a, 3, z / a.H, z % a.H, q0, a.Tq);
    if ((int)threadIdx.x < rows) {
        int64_t q = q0 + threadIdx.x;
        sl[threadIdx.x] = q < a.Tq ? lse[z * a.Tq + q] : 0.0f;
        sd[threadIdx.x] = q < a.Tq ? Drow[z * a.Tq + q] : 0.0f;
    }
}

/* One step of dk, dv for the warp's 16 keys key.. (rows of sk, sv; of the item's nk) against 32 queries q0..
   of q head zq (sq, sg, sl, sd): S^T = k q^T, P^T m (tiles' type, over p16; m the dropout mask,
   1 without), dv += P^T m dO, dP^T = v dO^T (over p16), dS^T = P^T (dP^T m - Drow) scale (tiles'
   type, over s16), dk += dS^T q. */
template <int O, int D>
__device__ static void dtr__cuda_fa_dkv_step(dtr__fa_acc<O> *dk, dtr__fa_acc<O> *dv, float *s16, float *p16,
                                            const typename dtr__fa_op<O>::E *sk, const typename dtr__fa_op<O>::E *sv,
                                            const typename dtr__fa_op<O>::E *sq, const typename dtr__fa_op<O>::E *sg, const float *sl,
                                            const float *sd, const dtr__cuda_att &a, int64_t zq, int64_t key, int64_t nk, int64_t q0,
                                            int lane) {
    typedef typename dtr__fa_op<O>::E E;
    const int LD = dtr__fa<O, D>::LD, PL = dtr__fa<O, D>::PL;
    float mk[16];   /* the lane's query against the warp's 16 keys */
    auto prob = [&](int i, int j, float s) {   /* row i is key + i, column j query q0 + j */
        return (!a.causal || a.qs + q0 + j >= key + i) && q0 + j < a.Tq && key + i < nk ? expf(s * a.scale - sl[j]) : 0.0f;
    };
    dtr__cuda_fa_masks(mk, a, zq, q0 + lane, key, 0);
    dtr__cuda_fa_rows<O, D, DTR__FA_STEP / 16>(s16, DTR__FA_LQ, sk, sq);
    __syncwarp();
    dtr__cuda_fa_pack<O>(p16, s16, lane, [&](int i, int j, float s) { return prob(i, j, s) * mk[i]; });
    dtr__cuda_fa_mma<O, nvcuda::wmma::row_major, D / 16, DTR__FA_STEP>(dv, (const E *)p16, PL, sg, LD);
    __syncwarp();
    dtr__cuda_fa_rows<O, D, DTR__FA_STEP / 16>(p16, DTR__FA_LQ, sv, sg);
    __syncwarp();
    for (int i = 0; i < 16; i++)
        p16[i * DTR__FA_LQ + lane] = prob(i, lane, s16[i * DTR__FA_LQ + lane]) * (p16[i * DTR__FA_LQ + lane] * mk[i] - sd[lane]) * a.scale;
    __syncwarp();
    dtr__cuda_fa_pack<O>(s16, p16, lane, [](int, int, float v) { return v; });
    dtr__cuda_fa_mma<O, nvcuda::wmma::row_major, D / 16, DTR__FA_STEP>(dk, (const E *)s16, PL, sq, LD);
}

/* dk, dv of 64 keys k0.. of a kv head over its q heads' query steps that see them, from query
   k0 - qs on (causal) or all (grid (key blocks, min(B Hk, 65535))) */
template <int O, int D>
__global__ static void __launch_bounds__(DTR__FA_THREADS) dtr__cuda_fa_dkv_k(const void *Q, const void *K, const void *V, const void *G,
                                                                            const float *lse, const float *Drow, float *GK, float *GV,
                                                                            dtr__cuda_att a) {
    typedef typename dtr__fa_op<O>::E E;
    const int LD = dtr__fa<O, D>::LD;
    extern __shared__ __align__(128) unsigned char dtr__fa_smem[];
    E *sk = (E *)dtr__fa_smem, *sv = sk + DTR__FA_KEYS * LD, *sq = sv + DTR__FA_KEYS * LD, *sg = sq + DTR__FA_STEP * LD;
    float *ss = (float *)(sg + DTR__FA_STEP * LD), *sp = ss + DTR__FA_KEYS * DTR__FA_LQ, *sl = sp + DTR__FA_KEYS * DTR__FA_LQ,
          *sd = sl + DTR__FA_STEP;
    int lane = threadIdx.x % 32, w16 = threadIdx.x / 32 * 16;
    int64_t k0 = (int64_t)blockIdx.x * DTR__FA_KEYS;
    float *s16 = ss + w16 * DTR__FA_LQ, *p16 = sp + w16 * DTR__FA_LQ;   /* the warp's rows */
    for (int64_t z = blockIdx.y; z < a.B * a.Hk; z += gridDim.y) {   /* (b, kv head g), its q heads b H + g rep + r */
        int64_t b = z / a.Hk, g = z % a.Hk, nk = dtr__cuda_att_keys(a, b * a.H);
        dtr__fa_acc<O> dk[D / 16], dv[D / 16];
        dtr__cuda_fa_load<O, D>(sk, DTR__FA_KEYS, K, a, 1, b, g, k0, nk);
        dtr__cuda_fa_load<O, D>(sv, DTR__FA_KEYS, V, a, 2, b, g, k0, nk);
        for (int n = 0; n < D / 16; n++) nvcuda::wmma::fill_fragment(dk[n], 0.0f), nvcuda::wmma::fill_fragment(dv[n], 0.0f);
        for (int64_t r = 0; r < a.rep; r++)
            for (int64_t q0 = a.causal && k0 > a.qs ? k0 - a.qs : 0; q0 < a.Tq && k0 < nk; q0 += DTR__FA_STEP) {   /* padding keys: 0 */
                dtr__cuda_fa_queries<O, D>(sq, sg, sl, sd, DTR__FA_STEP, Q, G, lse, Drow, a, b * a.H + g * a.rep + r, q0);
                __syncthreads();
                dtr__cuda_fa_dkv_step<O, D>(dk, dv, s16, p16, sk + w16 * LD, sv + w16 * LD, sq, sg, sl, sd, a, b * a.H + g * a.rep + r,
                                            k0 + w16, nk, q0, lane);
                __syncthreads();   /* before the next step's tiles */
            }
        dtr__cuda_fa_add<O, D>(GK, dk, s16, a.Tk, a.Ck, b * a.Tk * a.Ck + g * D, k0 + w16, lane);
        dtr__cuda_fa_add<O, D>(GV, dv, p16, a.Tk, a.Ck, b * a.Tk * a.Ck + g * D, k0 + w16, lane);
        __syncthreads();
    }
}

/* One step of dq for the warp's 16 queries query.. of item z (rows of sq, sg; sl, sd from row w16)
   against 32 keys k0.. (sk, sv; of the item's nk): S = q k^T, dP = dO v^T, dS = P (dP m - Drow) scale
   (tiles' type, over s16; m the dropout mask, 1 without), dq += dS k. */
template <int O, int D>
__device__ static void dtr__cuda_fa_dq_step(dtr__fa_acc<O> *dq, float *s16, float *p16, const typename dtr__fa_op<O>::E *sq,
                                           const typename dtr__fa_op<O>::E *sg, const typename dtr__fa_op<O>::E *sk,
                                           const typename dtr__fa_op<O>::E *sv, const float *sl, const float *sd,
                                           const dtr__cuda_att &a, int64_t z, int64_t query, int64_t k0, int64_t nk, int lane) {
    float mk[16];   /* the warp's 16 queries against the lane's key */
    dtr__cuda_fa_masks(mk, a, z, query, k0 + lane, 1);
    dtr__cuda_fa_rows<O, D, DTR__FA_STEP / 16>(s16, DTR__FA_LQ, sq, sk);
    dtr__cuda_fa_rows<O, D, DTR__FA_STEP / 16>(p16, DTR__FA_LQ, sg, sv);
    __syncwarp();
    dtr__cuda_fa_pack<O>(s16, p16, lane, [&](int i, int j, float dp) {   /* row i is query + i, column j key k0 + j */
        bool live = (!a.causal || k0 + j <= a.qs + query + i) && query + i < a.Tq && k0 + j < nk;
        return live ? expf(s16[i * DTR__FA_LQ + j] * a.scale - sl[i]) * (dp * mk[i] - sd[i]) * a.scale : 0.0f;
    });
    dtr__cuda_fa_mma<O, nvcuda::wmma::row_major, D / 16, DTR__FA_STEP>(dq, (const typename dtr__fa_op<O>::E *)s16, dtr__fa<O, D>::PL, sk,
                                                                     dtr__fa<O, D>::LD);
}

/* dq of 64 queries q0.. over the key steps they see (grid (query blocks, min(B H, 65535))) */
template <int O, int D>
__global__ static void __launch_bounds__(DTR__FA_THREADS) dtr__cuda_fa_dq_k(const void *Q, const void *K, const void *V, const void *G,
                                                                           const float *lse, const float *Drow, float *GQ, dtr__cuda_att a) {
    typedef typename dtr__fa_op<O>::E E;
    const int LD = dtr__fa<O, D>::LD;
    extern __shared__ __align__(128) unsigned char dtr__fa_smem[];
    E *sq = (E *)dtr__fa_smem, *sg = sq + DTR__FA_ROWS * LD, *sk = sg + DTR__FA_ROWS * LD, *sv = sk + DTR__FA_STEP * LD;
    float *ss = (float *)(sv + DTR__FA_STEP * LD), *sp = ss + DTR__FA_ROWS * DTR__FA_LQ, *sl = sp + DTR__FA_ROWS * DTR__FA_LQ,
          *sd = sl + DTR__FA_ROWS;
    int lane = threadIdx.x % 32, w16 = threadIdx.x / 32 * 16;
    int64_t q0 = (int64_t)blockIdx.x * DTR__FA_ROWS;
    float *s16 = ss + w16 * DTR__FA_LQ, *p16 = sp + w16 * DTR__FA_LQ;
    for (int64_t z = blockIdx.y; z < a.B * a.H; z += gridDim.y) {
        int64_t nk = dtr__cuda_att_keys(a, z), kend = dtr__cuda_fa_kend(a, q0, nk);
        dtr__fa_acc<O> dq[D / 16];
        dtr__cuda_fa_queries<O, D>(sq, sg, sl, sd, DTR__FA_ROWS, Q, G, lse, Drow, a, z, q0);
        for (int n = 0; n < D / 16; n++) nvcuda::wmma::fill_fragment(dq[n], 0.0f);
        for (int64_t k0 = 0; k0 < kend; k0 += DTR__FA_STEP) {
            dtr__cuda_fa_load<O, D>(sk, DTR__FA_STEP, K, a, 1, z / a.H, z % a.H / a.rep, k0, kend);
            dtr__cuda_fa_load<O, D>(sv, DTR__FA_STEP, V, a, 2, z / a.H, z % a.H / a.rep, k0, kend);
            __syncthreads();
            dtr__cuda_fa_dq_step<O, D>(dq, s16, p16, sq + w16 * LD, sg + w16 * LD, sk, sv, sl + w16, sd + w16, a, z, q0 + w16, k0, nk,
                                       lane);
            __syncthreads();
        }
        dtr__cuda_fa_add<O, D>(GQ, dq, s16, a.Tq, a.C, z / a.H * a.Tq * a.C + z % a.H * D, q0 + w16, lane);
        __syncthreads();
    }
}

/* ---- the host side of the fused kernels ---- */

/* The launches, one instance per operand kind and head width (dtr__cuda_fa_pick). */
struct dtr__fa_fwd_launch {
    template <int O, int D>
    static void run(dim3 grid, cudaStream_t s, const void *Q, const void *K, const void *V, void *Y, float *lse, const dtr__cuda_att *a) {
        dtr__cuda_fa_fwd_k<O, D><<<grid, DTR__FA_THREADS, dtr__fa<O, D>::fwd, s>>>(Q, K, V, Y, lse, *a);
    }
};
struct dtr__fa_bwd_launch {
    template <int O, int D>
    static void run(dim3 gk, dim3 gq, cudaStream_t s, const void *Q, const void *K, const void *V, const void *G, const float *lse,
                    const float *Drow, float *GQ, float *GK, float *GV, const dtr__cuda_att *a) {
        dtr__cuda_fa_dkv_k<O, D><<<gk, DTR__FA_THREADS, dtr__fa<O, D>::bwd, s>>>(Q, K, V, G, lse, Drow, GK, GV, *a);
        dtr__cuda_fa_dq_k<O, D><<<gq, DTR__FA_THREADS, dtr__fa<O, D>::bwd, s>>>(Q, K, V, G, lse, Drow, GQ, *a);
    }
};
/* raises the three kernels' shared-memory limits on the current device; 0 when refused */
struct dtr__fa_limits {
    template <int O, int D> static void run(int *ok) {
        *ok = cudaFuncSetAttribute(dtr__cuda_fa_fwd_k<O, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, dtr__fa<O, D>::fwd) == cudaSuccess &&
              cudaFuncSetAttribute(dtr__cuda_fa_dkv_k<O, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, dtr__fa<O, D>::bwd) == cudaSuccess &&
              cudaFuncSetAttribute(dtr__cuda_fa_dq_k<O, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, dtr__fa<O, D>::bwd) == cudaSuccess;
    }
};

/* F::run<O, D>(args...) for operand kind o (DTR__FA_BF16 ..) and head width D (one of DTR__FA_WIDTHS) */
template <typename F, int D, typename... A> static void dtr__cuda_fa_kind(int o, A... args) {
    switch (o) {
    case DTR__FA_BF16: F::template run<DTR__FA_BF16, D>(args...); break;
    case DTR__FA_F16: F::template run<DTR__FA_F16, D>(args...); break;
    case DTR__FA_TF32: F::template run<DTR__FA_TF32, D>(args...); break;
    default: F::template run<DTR__FA_F32, D>(args...); break;
    }
}
template <typename F, typename... A> static void dtr__cuda_fa_pick(int o, int64_t D, A... args) {
#define DTR__FA_CASE(W) case W: dtr__cuda_fa_kind<F, W>(o, args...); break;
    switch (D) { DTR__FA_WIDTHS(DTR__FA_CASE) default: break; }
#undef DTR__FA_CASE
}

/** The operand kinds and head widths whose fused kernels this device runs (bit
 *  DTR__FA_BIT(kind, D)), on the current device: their shared-memory limits raised. Called by
 *  the context's creation; a size the device refuses takes the tiled kernels, and so does every
 *  case with the environment variable DTR_CUDA_FLASH=0 (benchmarks compare the two). */
#define DTR__FA_BIT(o, D) ((o) * 8 + (int)(D) / 32)
static unsigned dtr__cuda_fa_setup(void) {
    static const int widths[] = {
#define DTR__FA_LIST(W) W,
        DTR__FA_WIDTHS(DTR__FA_LIST)
#undef DTR__FA_LIST
    };
    unsigned ok = 0;
    const char *env = getenv("DTR_CUDA_FLASH");
    if (env && strcmp(env, "0") == 0) return 0;
    for (int o = 0; o < DTR__FA_KINDS; o++)
        for (int i = 0; i < (int)(sizeof widths / sizeof widths[0]); i++) {
            int yes = 0;
            dtr__cuda_fa_pick<dtr__fa_limits>(o, widths[i], &yes);
            if (yes) ok |= 1u << DTR__FA_BIT(o, widths[i]);
        }
    (void)cudaGetLastError();   /* a refusal is not the next launch's error */
    return ok;
}

/* the 16-bit type of kind o; f32 for TF32 and F32 */
static dtr_dtype dtr__cuda_fa_dtype(int o) { return o == DTR__FA_BF16 ? DTR_BF16 : o == DTR__FA_F16 ? DTR_F16 : DTR_F32; }

/* 1 when f32 q, k, v go to 16-bit tiles: rounded into dense copies first (dtr__cuda_fa_inputs) */
static int dtr__cuda_fa_rounds(const dtr__cuda_att *a) { return a->p == DTR_F32 && a->fa < DTR__FA_TF32; }

/* 1 when the fused kernels take the node: a kind and head width of theirs this device runs,
   16-byte aligned q, k, v with strides of whole 16 bytes (the tiles' loads; rounded copies are) */
static int dtr__cuda_fa_takes(dtr_context *ctx, const dtr__node *nd, const dtr__cuda_att *a) {
    int aligned = 1;
    int64_t v = 16 / a->es;   /* elements in 16 bytes */
    for (int i = 0; i < 3 && !dtr__cuda_fa_rounds(a); i++)
        aligned &= ((uintptr_t)dtr__data(nd->in[i]) & 15) == 0 && a->sb[i] % v == 0 && a->sr[i] % v == 0;
    aligned &= ((uintptr_t)nd->out->grad & 15) == 0;   /* dy as it is (f32 tiles) */
    return a->D % 32 == 0 && a->D <= 128 && (dtr__cuda(ctx)->fa_widths >> DTR__FA_BIT(a->fa, a->D) & 1) && aligned;
}

/* The fused kernels' q, k, v (x[0..3)) and, for backward, dy (x[3]) in the tiles' type: as they
   are, or rounded from f32 into dense copies in the context's scratch, the strides in *k set to
   theirs (as linear with 16-bit products on f32 tensors). NULL x[0] with the error set. */
static void dtr__cuda_fa_inputs(dtr_context *ctx, const dtr__node *nd, dtr__cuda_att *k, int bwd, const void **x) {
    dtr_dtype t = dtr__cuda_fa_dtype(k->fa);
    int64_t each = dtr__cuda_align256(k->B * (k->Tq * k->C > k->Tk * k->Ck ? k->Tq * k->C : k->Tk * k->Ck) * 2);
    int copies = (dtr__cuda_fa_rounds(k) ? 3 : 0) + (bwd && t != DTR_F32);
    char *at = copies ? (char *)dtr__cuda_scratch(ctx, (size_t)(copies * each)) : NULL;
    for (int i = 0; i < 3; i++) x[i] = dtr__data(nd->in[i]);
    x[3] = bwd ? nd->out->grad : NULL;
    if (copies && !at) x[0] = NULL;
    for (int i = 0; at && i < 3 && dtr__cuda_fa_rounds(k); i++, at += each) {   /* f32 q, k, v into 16 bits */
        const dtr_tensor *s = nd->in[i];
        dtr__cuda_mem to = {at, (int)t};
        int64_t n = dtr_tensor_numel(s), dense[3] = {s->shape[1] * s->shape[2], s->shape[2], 1};
        dtr__cuda_copy_walk_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
            to, dtr__cuda_walk_make(3, s->shape, dense, 0), dtr__cuda_storage_of(s), dtr__cuda_walk_make(3, s->shape, s->stride, s->offset), n);
        x[i] = at, k->sb[i] = dense[0], k->sr[i] = dense[1];
    }
    if (at && bwd && t != DTR_F32 && !(x[3] = dtr__cuda_as16(ctx, nd->out->grad, DTR_F32, t, k->B * k->Tq * k->C, &at))) x[0] = NULL;
    if (x[0] && copies && dtr__cuda_launched(ctx, nd) != DTR_OK) x[0] = NULL;
}

/* the fused kernels' grid over T rows (queries or keys): blocks of 64, (b, h) items of `heads`
   heads (0: q's) */
static dim3 dtr__cuda_fa_grid(const dtr__cuda_att *a, int64_t T, int64_t heads = 0) {
    return dim3((unsigned)((T + DTR__FA_ROWS - 1) / DTR__FA_ROWS), dtr__cuda_att_ys(a, heads));
}

static dtr_result dtr__cuda_fa_fwd(dtr_context *ctx, dtr__node *nd, const dtr__cuda_att *a, float *lse) {
    dim3 grid = dtr__cuda_fa_grid(a, a->Tq);
    dtr__cuda_att k = *a;
    const void *x[4];
    dtr__cuda_fa_inputs(ctx, nd, &k, 0, x);
    if (!x[0]) return ctx->status;
    dtr__cuda_fa_pick<dtr__fa_fwd_launch>(k.fa, k.D, grid, dtr__cuda_stream(ctx), x[0], x[1], x[2], dtr__data(nd->out), lse, &k);
    return dtr__cuda_launched(ctx, nd);
}

/* the fused backward of a node whose q, k and v all take gradients: the inputs and dO = dy in
   the tiles' type, then the two kernels (Drow is computed) */
static dtr_result dtr__cuda_fa_bwd(dtr_context *ctx, dtr__node *nd, const dtr__cuda_att *a, const float *Drow) {
    dtr__cuda_att k = *a;
    const void *x[4];
    dtr__cuda_fa_inputs(ctx, nd, &k, 1, x);
    if (!x[0]) return ctx->status;
    dtr__cuda_fa_pick<dtr__fa_bwd_launch>(k.fa, k.D, dtr__cuda_fa_grid(a, a->Tk, a->Hk), dtr__cuda_fa_grid(a, a->Tq), dtr__cuda_stream(ctx), x[0], x[1], x[2], x[3], (const float *)nd->saved, Drow,
                                          dtr__gradof(nd->in[0]), dtr__gradof(nd->in[1]), dtr__gradof(nd->in[2]), &k);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_attention_run_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_att a;
    dtr__cuda_att_bufs b;
    float *lse;
    dtr__cuda_att_make(ctx, nd, &a);
    lse = (float *)dtr__node_save(ctx, nd, (size_t)(a.B * a.H * a.Tq + 1) * sizeof(float)); /* row log-sum-exps */
    if (!lse) return ctx->status;
    nd->saved = lse;
    if (a.B * a.H * a.Tq == 0) return DTR_OK;
    if (a.len) {   /* a key length out of range: the error at the next synchronisation (the kernels clamp it) */
        dtr__cuda_att_lens_k<<<dtr__cuda_grid(a.B), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(a, dtr__cuda(ctx)->err_dev);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    }
    if (dtr__cuda_fa_takes(ctx, nd, &a)) return dtr__cuda_fa_fwd(ctx, nd, &a, lse);
    if (!(b = dtr__cuda_att_scratch(ctx, &a, 0)).S) return ctx->status;
    for (int64_t t0 = 0; t0 < a.Tq; t0 += a.n) {
        dtr__cuda_att_tile w = dtr__cuda_att_tile_at(&a, t0);
        if (dtr__cuda_att_scores(ctx, nd, &a, w, &b) != DTR_OK) return ctx->status;
        dtr__cuda_att_softmax_k<<<dim3((unsigned)w.n, dtr__cuda_att_ys(&a)), DTR__ATT_THREADS, 0, dtr__cuda_stream(ctx)>>>(b.S, lse, a, w);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
        /* y[t0:t0+n] (n, D) = P (n, L) v[0:L] (L, D) */
        if (dtr__cuda_att_gemm(ctx, &a, 5, dtr__cuda_att_t(&a, 1), w.n, a.D, w.L, 1.0f, b.S, w.L * DTR__ATT_PACK(a), 1,
                               dtr__cuda_att_s(&a, w, 1), dtr__data(nd->in[2]), a.sr[2], 1, dtr__cuda_att_in(&a, 2), 0.0f,
                               (void *)dtr__cuda_att_at(dtr__data(nd->out), t0 * a.C, a.es), a.C, dtr__cuda_att_x(&a, a.Tq, a.es), b.ptrs) != DTR_OK)
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
    const void *Gt = dtr__cuda_att_at(b->G, w.t0 * C, es), *Qt = dtr__cuda_att_at(Q, w.t0 * a->sr[0], es);
    int64_t ld = w.L * DTR__ATT_PACK(*a);   /* the row stride of P and dS */
    dtr__cuda_bstride x = dtr__cuda_att_x(a, a->Tq, es), x32 = dtr__cuda_att_x(a, a->Tq, 4), k32 = {a->Tk * a->Ck, D, 4};
    dtr__cuda_bstride sc = dtr__cuda_att_s(a, w, 1);
    dtr__cuda_bstride xq = dtr__cuda_att_in(a, 0), xk = dtr__cuda_att_in(a, 1), xv = dtr__cuda_att_in(a, 2);
    dtr__cuda_gemm_t t = dtr__cuda_att_t(a, 0);
    if (dtr__cuda_att_scores(ctx, nd, a, w, b) != DTR_OK) return ctx->status;
    /* dP (n, L) = dy[t0:] (n, D) v[0:L]^T (D, L) */
    if (dtr__cuda_att_gemm(ctx, a, 5, t, w.n, w.L, D, 1.0f, Gt, C, 1, x, V, 1, a->sr[2], xv, 0.0f, b->dP, w.L, dtr__cuda_att_s(a, w, 0),
                           b->ptrs) != DTR_OK)
        return ctx->status;
    dtr__cuda_att_dscore_k<<<dim3((unsigned)w.n, dtr__cuda_att_ys(a)), DTR__ATT_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        b->S, b->dP, (const float *)nd->saved, Drow, *a, w);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    if (GQ && dtr__cuda_att_gemm(ctx, a, 5, t, w.n, D, w.L, 1.0f, b->dP, ld, 1, sc, K, a->sr[1], 1, xk, 1.0f, GQ + w.t0 * C, C, x32,
                                 b->ptrs) != DTR_OK)
        return ctx->status;   /* dq[t0:] += dS (n, L) k[0:L] (L, D) */
    if (GK && dtr__cuda_att_gemm(ctx, a, 3, t, w.L, D, w.n, 1.0f, b->dP, 1, ld, sc, Qt, a->sr[0], 1, xq, 1.0f, GK, a->Ck, k32, b->ptrs) != DTR_OK)
        return ctx->status;   /* dk[0:L] += dS^T (L, n) q[t0:] (n, D) */
    if (GV && dtr__cuda_att_gemm(ctx, a, 3, t, w.L, D, w.n, 1.0f, b->S, 1, ld, sc, Gt, C, 1, x, 1.0f, GV, a->Ck, k32, b->ptrs) != DTR_OK)
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
    rows = a.B * a.H * a.Tq;
    if (rows == 0) return DTR_OK;
    if (!(Drow = (float *)dtr__node_save(ctx, nd, (size_t)rows * sizeof(float)))) return ctx->status;
    dtr__cuda_att_drow_k<<<dtr__launch_blocks(rows * 32, DTR__CUDA_THREADS, INT32_MAX), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(nd->out), nd->out->grad, Drow, a);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    if (dtr__cuda_fa_takes(ctx, nd, &a) && dtr__gradof(nd->in[0]) && dtr__gradof(nd->in[1]) && dtr__gradof(nd->in[2]))
        return dtr__cuda_fa_bwd(ctx, nd, &a, Drow);
    if (!(b = dtr__cuda_att_scratch(ctx, &a, 1)).S) return ctx->status;
    if (!b.G) {
        b.G = nd->out->grad;   /* f32: dy as it is */
    } else {
        char *g = (char *)b.G;
        if (!dtr__cuda_as16(ctx, nd->out->grad, DTR_F32, a.p, a.B * a.Tq * a.C, &g)) return ctx->status;
    }
    for (int64_t t0 = 0; t0 < a.Tq; t0 += a.n)
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
