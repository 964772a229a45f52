/* ============================================================================
 * Matrix products on the GPU through cuBLAS: linear (x w^T + b) and batched matmul (broadcast
 * batch axes, any view whose rows or columns are unit-stride), forward and backward,
 * with the CPU's shapes (src/ops/ops_matmul.c):
 *   a (..., M, K), b (..., K, N) -> (..., M, N); x (R, in), w (out, in) -> (R, out).
 * cuBLAS is column-major: a row-major C = A B is computed as the column-major C^T = B^T A^T,
 * so every call passes B first. Full FP32 (cuBLAS's default math mode); TF32 with allow_tf32
 * (the math mode); bf16 / fp16 tensor cores with matmul_precision (cublasGemmEx on the f32
 * operands with a fast 16-bit compute type: cuBLAS rounds them, sums in f32).
 * ==========================================================================*/

/* The operands' and the result's types of a product: f32 (DTR__CUDA_F32: Sgemm, or with
   s->fast16 cublasGemmEx rounding them to 16 bits by s->compute), or bf16 / fp16 operands
   (16-bit tensors as stored) summed in f32 into a 16-bit or f32 result (CUBLAS_COMPUTE_32F). */
typedef struct dtr__cuda_gemm_t { cudaDataType_t ab, y; } dtr__cuda_gemm_t;
static const dtr__cuda_gemm_t DTR__CUDA_F32 = {CUDA_R_32F, CUDA_R_32F};

static cublasComputeType_t dtr__cuda_compute(const dtr__cuda_state *s, dtr__cuda_gemm_t t) {
    return t.ab != CUDA_R_32F ? CUBLAS_COMPUTE_32F : s->compute;
}

/* the three cuBLAS products: Sgemm* for f32 without fast16, else their GemmEx forms */
static cublasStatus_t dtr__cuda_sgemm(dtr__cuda_state *s, dtr__cuda_gemm_t t, cublasOperation_t opb, cublasOperation_t opa, int n,
                                      int m, int k, const float *alpha, const void *B, int ldb, const void *A, int lda,
                                      const float *beta, void *Y, int ldy) {
    if (t.ab == CUDA_R_32F && !s->fast16)
        return cublasSgemm(s->blas, opb, opa, n, m, k, alpha, (const float *)B, ldb, (const float *)A, lda, beta, (float *)Y, ldy);
    return cublasGemmEx(s->blas, opb, opa, n, m, k, alpha, B, t.ab, ldb, A, t.ab, lda, beta, Y, t.y, ldy, dtr__cuda_compute(s, t),
                        CUBLAS_GEMM_DEFAULT);
}
static cublasStatus_t dtr__cuda_sgemm_strided(dtr__cuda_state *s, dtr__cuda_gemm_t t, cublasOperation_t opb, cublasOperation_t opa,
                                              int n, int m, int k, const float *alpha, const void *B, int ldb, int64_t sb,
                                              const void *A, int lda, int64_t sa, const float *beta, void *Y, int ldy, int64_t sy,
                                              int count) {
    if (t.ab == CUDA_R_32F && !s->fast16)
        return cublasSgemmStridedBatched(s->blas, opb, opa, n, m, k, alpha, (const float *)B, ldb, sb, (const float *)A, lda, sa,
                                         beta, (float *)Y, ldy, sy, count);
    return cublasGemmStridedBatchedEx(s->blas, opb, opa, n, m, k, alpha, B, t.ab, ldb, sb, A, t.ab, lda, sa, beta, Y, t.y, ldy, sy,
                                      count, dtr__cuda_compute(s, t), CUBLAS_GEMM_DEFAULT);
}
static cublasStatus_t dtr__cuda_sgemm_ptrs(dtr__cuda_state *s, dtr__cuda_gemm_t t, cublasOperation_t opb, cublasOperation_t opa,
                                           int n, int m, int k, const float *alpha, const void *const *pb, int ldb,
                                           const void *const *pa, int lda, const float *beta, void *const *py, int ldy, int count) {
    if (t.ab == CUDA_R_32F && !s->fast16)
        return cublasSgemmBatched(s->blas, opb, opa, n, m, k, alpha, (const float *const *)pb, ldb, (const float *const *)pa, lda,
                                  beta, (float *const *)py, ldy, count);
    return cublasGemmBatchedEx(s->blas, opb, opa, n, m, k, alpha, pb, t.ab, ldb, pa, t.ab, lda, beta, py, t.y, ldy, count,
                               dtr__cuda_compute(s, t), CUBLAS_GEMM_DEFAULT);
}

/* A row-major matrix view (rows R, cols C, row stride rs, column stride cs) as cuBLAS sees
 * it: the column-major matrix is its transpose with leading dimension rs when cs is 1 (op N),
 * or the matrix itself with leading dimension cs when rs is 1 (op T). 0: neither (copy it). */
static int dtr__cuda_blas_view(int64_t R, int64_t C, int64_t rs, int64_t cs, cublasOperation_t *op, int64_t *ld) {
    if (C <= 1) cs = 1;                                   /* one column: its stride is moot */
    if (R <= 1) rs = cs == 1 ? (C > 1 ? C : 1) : 1;       /* one row: so is the row stride */
    if (cs == 1 && rs >= (C > 1 ? C : 1)) { *op = CUBLAS_OP_N; *ld = rs; return 1; }
    if (rs == 1 && cs >= (R > 1 ? R : 1)) { *op = CUBLAS_OP_T; *ld = cs; return 1; }
    return 0;
}

/* cuBLAS's operations and leading dimensions for row-major A (M, K), B (K, N), Y (ldy). */
static dtr_result dtr__cuda_gemm_ops(dtr_context *ctx, int64_t M, int64_t N, int64_t K, int64_t rsa, int64_t csa, int64_t rsb,
                                     int64_t csb, int64_t ldy, cublasOperation_t *opa, int64_t *lda, cublasOperation_t *opb,
                                     int64_t *ldb) {
    if (!dtr__cuda_blas_view(M, K, rsa, csa, opa, lda) || !dtr__cuda_blas_view(K, N, rsb, csb, opb, ldb))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "cuda: gemm operand with neither unit row nor unit column stride (make it contiguous)");
    if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || *lda > INT32_MAX || *ldb > INT32_MAX || ldy > INT32_MAX)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "cuda: gemm of %lld x %lld x %lld is beyond cuBLAS's 32-bit sizes",
                         (long long)M, (long long)N, (long long)K);
    return DTR_OK;
}

/* Y (M, N; row stride ldy) = alpha A (M, K) B (K, N) + beta Y, row-major views given by their
 * strides, `count` times with batch strides sa, sb, sy (elements), of types t. */
static dtr_result dtr__cuda_gemm_as(dtr_context *ctx, dtr__cuda_gemm_t t, int64_t M, int64_t N, int64_t K, float alpha,
                                    const void *A, int64_t rsa, int64_t csa, int64_t sa, const void *B, int64_t rsb, int64_t csb,
                                    int64_t sb, float beta, void *Y, int64_t ldy, int64_t sy, int64_t count) {
    cublasOperation_t opa, opb;
    int64_t lda, ldb;
    dtr__cuda_state *s = dtr__cuda(ctx);
    if (M == 0 || N == 0 || count == 0) return DTR_OK;
    if (dtr__cuda_gemm_ops(ctx, M, N, K, rsa, csa, rsb, csb, ldy, &opa, &lda, &opb, &ldb) != DTR_OK) return ctx->status;
    if (count == 1)
        return dtr__cuda_blas(ctx, dtr__cuda_sgemm(s, t, opb, opa, (int)N, (int)M, (int)(K ? K : 1), &alpha, B, (int)ldb, A,
                                                   (int)lda, &beta, Y, (int)ldy), "gemm");
    return dtr__cuda_blas(ctx, dtr__cuda_sgemm_strided(s, t, opb, opa, (int)N, (int)M, (int)(K ? K : 1), &alpha, B, (int)ldb,
                                                       sb, A, (int)lda, sa, &beta, Y, (int)ldy, sy, (int)count),
                          "gemm (batched)");
}

/* dtr__cuda_gemm_as with f32 operands and result */
static dtr_result dtr__cuda_gemm(dtr_context *ctx, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t rsa,
                                 int64_t csa, int64_t sa, const float *B, int64_t rsb, int64_t csb, int64_t sb, float beta,
                                 float *Y, int64_t ldy, int64_t sy, int64_t count) {
    return dtr__cuda_gemm_as(ctx, DTR__CUDA_F32, M, N, K, alpha, A, rsa, csa, sa, B, rsb, csb, sb, beta, Y, ldy, sy, count);
}

/* A batch over two axes: item z sits at (z / inner) * outer_stride + (z % inner) * inner_stride
   elements of `bytes` each. */
typedef struct dtr__cuda_bstride { int64_t outer, inner, bytes; } dtr__cuda_bstride;

__device__ static void *dtr__cuda_item(const void *base, dtr__cuda_bstride s, int64_t o, int64_t i) {
    return (char *)base + (o * s.outer + i * s.inner) * s.bytes;
}

__global__ static void dtr__cuda_gemm_ptrs_k(const void **pa, const void *A, dtr__cuda_bstride sa, const void **pb, const void *B,
                                             dtr__cuda_bstride sb, void **py, void *Y, dtr__cuda_bstride sy, int64_t inner,
                                             int64_t count) {
    DTR__CUDA_FOR(z, count) {
        int64_t o = z / inner, i = z % inner;
        pa[z] = dtr__cuda_item(A, sa, o, i);
        pb[z] = dtr__cuda_item(B, sb, o, i);
        py[z] = dtr__cuda_item(Y, sy, o, i);
    }
}

/* dtr__cuda_gemm_as over outer x inner items whose strides do not collapse to one (batch items
 * times heads): strided-batched when outer is 1, else one pointer-array batch. Its arrays go
 * to `ptrs` (3 * outer * inner device pointers), which the next call may reuse: the stream
 * runs this product before the next call's arrays are written. */
static dtr_result dtr__cuda_gemm2(dtr_context *ctx, dtr__cuda_gemm_t t, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                                  int64_t rsa, int64_t csa, dtr__cuda_bstride sa, const void *B, int64_t rsb, int64_t csb,
                                  dtr__cuda_bstride sb, float beta, void *Y, int64_t ldy, dtr__cuda_bstride sy, int64_t outer,
                                  int64_t inner, void **ptrs) {
    cublasOperation_t opa, opb;
    int64_t lda, ldb, count = outer * inner;
    const void **pa = (const void **)ptrs, **pb = pa + count;
    void **py = (void **)(pb + count);
    if (outer == 1)
        return dtr__cuda_gemm_as(ctx, t, M, N, K, alpha, A, rsa, csa, sa.inner, B, rsb, csb, sb.inner, beta, Y, ldy, sy.inner, inner);
    if (M == 0 || N == 0 || count == 0) return DTR_OK;
    if (dtr__cuda_gemm_ops(ctx, M, N, K, rsa, csa, rsb, csb, ldy, &opa, &lda, &opb, &ldb) != DTR_OK) return ctx->status;
    dtr__cuda_gemm_ptrs_k<<<dtr__cuda_grid(count), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(pa, A, sa, pb, B, sb, py, Y, sy, inner,
                                                                                              count);
    if (dtr__cuda_check(ctx, cudaGetLastError(), "gemm pointers") != DTR_OK) return ctx->status;
    return dtr__cuda_blas(ctx, dtr__cuda_sgemm_ptrs(dtr__cuda(ctx), t, opb, opa, (int)N, (int)M, (int)(K ? K : 1), &alpha, pb,
                                                    (int)ldb, pa, (int)lda, &beta, py, (int)ldy, (int)count),
                          "gemm (pointer batch)");
}

/* ---- linear: y (R, out) = x (R, in) w^T + b ---- */

/* Y (R, out) = bias in every row (rounded to Y's dtype); block (column chunk, row): no division
   per element */
__global__ static void dtr__cuda_rows_fill_k(dtr__cuda_mem Y, dtr__cuda_mem bias, int64_t R, int64_t out) {
    for (int64_t r = blockIdx.y; r < R; r += gridDim.y)
        for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < out; k += (int64_t)gridDim.x * blockDim.x)
            Y.st(r * out + k, bias.ld(k));
}

static dtr_result dtr__cuda_rows_fill(dtr_context *ctx, const dtr__node *nd, const dtr_tensor *bias, int64_t R, int64_t out) {
    dtr__cuda_rows_fill_k<<<dim3(dtr__launch_blocks(out, DTR__CUDA_THREADS, 64), (unsigned)(R < 65535 ? R : 65535)),
                            DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(dtr__cuda_mem_of(nd->out), dtr__cuda_mem_of(bias), R, out);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_linear32_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1], *bias = nd->n_in > 2 ? nd->in[2] : NULL;
    int64_t in = w->shape[1], out = w->shape[0], R = dtr_tensor_numel(nd->out) / (out ? out : 1);
    float *Y = dtr__f32(nd->out);
    if (R * out == 0) return DTR_OK;
    if (bias) {
        if (dtr__cuda_rows_fill(ctx, nd, bias, R, out) != DTR_OK) return ctx->status;
    } else if (in == 0) {
        return dtr__cuda_check(ctx, cudaMemsetAsync(Y, 0, (size_t)(R * out) * sizeof(float), dtr__cuda_stream(ctx)), "linear");
    }
    /* Y (R, out) = X (R, in) W^T (in, out) */
    return dtr__cuda_gemm(ctx, R, out, in, 1.0f, dtr__f32(x), in, 1, 0, dtr__f32(w), 1, in, 0, bias ? 1.0f : 0.0f, Y, out, 0, 1);
}

static dtr_result dtr__cuda_linear32_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1], *bias = nd->n_in > 2 ? nd->in[2] : NULL;
    int64_t in = w->shape[1], out = w->shape[0], R = dtr_tensor_numel(nd->out) / (out ? out : 1);
    const float *G = nd->out->grad;
    float *gx = dtr__gradof(x), *gw = dtr__gradof(w), *gb = dtr__gradof(bias);
    /* dX (R, in) += G (R, out) W (out, in) */
    if (gx && dtr__cuda_gemm(ctx, R, in, out, 1.0f, G, out, 1, 0, dtr__f32(w), in, 1, 0, 1.0f, gx, in, 0, 1) != DTR_OK)
        return ctx->status;
    /* dW (out, in) += G^T (out, R) X (R, in) */
    if (gw && dtr__cuda_gemm(ctx, out, in, R, 1.0f, G, 1, out, 0, dtr__f32(x), in, 1, 0, 1.0f, gw, in, 0, 1) != DTR_OK)
        return ctx->status;
    return gb ? dtr__cuda_col_sum(ctx, nd, G, dtr__cuda_mem_of(NULL), NULL, R, out, gb) : DTR_OK;
}

/* ---- linear on 16-bit activations with 16-bit products ----
 * With matmul_precision BF16 (F16) and activations of that type, linear's products take
 * 16-bit operands as stored (cublasGemmEx, sums in f32, CUBLAS_COMPUTE_32F): x as it is, the
 * f32 weight rounded into scratch on each call (out x in elements: a 1 / R share of the
 * product's operand traffic), y written in 16 bits, the bias rounded to 16 bits first (as
 * torch.autocast does). Backward: the f32 output gradient rounded to 16 bits in chunks of
 * rows (DTR__CUDA_G16_BYTES of scratch), the input's and the weight's gradients summed in f32
 * into their f32 buffers, chunk after chunk. The operands are rounded as the f32 path rounds
 * them with matmul_precision (cuBLAS's fast 16-bit compute does it inside), without the f32
 * copies of x and y that widening makes. Other cases (f32 activations, f32 or TF32 products,
 * an empty product) take the f32 kernels, over widened copies where tensors are 16-bit. */

#define DTR__CUDA_G16_BYTES ((int64_t)64 << 20)
static int64_t dtr__cuda_align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

/* the 16-bit type the context's products take (matmul_precision), else f32 */
static dtr_dtype dtr__cuda_product_dtype(const dtr_context *ctx) {
    if (ctx->cfg.matmul_precision == DTR_MATMUL_BF16) return DTR_BF16;
    return ctx->cfg.matmul_precision == DTR_MATMUL_F16 ? DTR_F16 : DTR_F32;
}
static cudaDataType_t dtr__cuda_blas_type(dtr_dtype dt) {
    return dt == DTR_BF16 ? CUDA_R_16BF : dt == DTR_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* 1 when linear node nd runs on 16-bit data as stored: its output is of the products'
   16-bit type, and the product is not empty */
static int dtr__cuda_linear16(const dtr_context *ctx, const dtr__node *nd) {
    dtr_dtype p = dtr__cuda_product_dtype(ctx);
    return p != DTR_F32 && nd->out->dtype == p && nd->in[1]->shape[1] > 0 && dtr_tensor_numel(nd->out) > 0;
}

/* n dense elements at src (dtype sd) in 16-bit dtype p: src itself when sd is p, else a copy
   at *at (advanced by its 256-byte aligned size). NULL with the error set. */
static const void *dtr__cuda_as16(dtr_context *ctx, const void *src, dtr_dtype sd, dtr_dtype p, int64_t n, char **at) {
    char *dst = *at;
    if (sd == p) return src;
    dtr__cuda_cast_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(dst, p, src, sd, n);
    if (dtr__cuda_check(ctx, cudaGetLastError(), "16-bit operand (product)") != DTR_OK) return NULL;
    *at += dtr__cuda_align256(n * 2);
    return dst;
}

/* y (R, out) = x (R, in) w^T + b, in 16 bits */
static dtr_result dtr__cuda_linear16_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1], *bias = nd->n_in > 2 ? nd->in[2] : NULL;
    dtr_dtype p = nd->out->dtype;
    int64_t in = w->shape[1], out = w->shape[0], R = dtr_tensor_numel(nd->out) / out;
    dtr__cuda_gemm_t t = {dtr__cuda_blas_type(p), dtr__cuda_blas_type(p)};
    char *at = (char *)dtr__cuda_scratch(ctx, (size_t)(dtr__cuda_align256(out * in * 2) +
                                                  (x->dtype == p ? 0 : dtr__cuda_align256(R * in * 2))));
    const void *W, *X;
    if (!at || !(W = dtr__cuda_as16(ctx, dtr__data(w), w->dtype, p, out * in, &at)) ||
        !(X = dtr__cuda_as16(ctx, dtr__data(x), x->dtype, p, R * in, &at)))
        return ctx->status;
    if (bias && dtr__cuda_rows_fill(ctx, nd, bias, R, out) != DTR_OK) return ctx->status;
    return dtr__cuda_gemm_as(ctx, t, R, out, in, 1.0f, X, in, 1, 0, W, 1, in, 0, bias ? 1.0f : 0.0f, dtr__data(nd->out), out, 0, 1);
}

/* dX (R, in) += G W and dW (out, in) += G^T X over chunks of G's rows rounded to 16 bits */
static dtr_result dtr__cuda_linear16_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0], *w = nd->in[1], *bias = nd->n_in > 2 ? nd->in[2] : NULL;
    dtr_dtype p = nd->out->dtype;
    int64_t in = w->shape[1], out = w->shape[0], R = dtr_tensor_numel(nd->out) / out, rows = DTR__CUDA_G16_BYTES / (2 * out), r0;
    float *gx = dtr__gradof(x), *gw = dtr__gradof(w), *gb = dtr__gradof(bias);
    dtr__cuda_gemm_t t = {dtr__cuda_blas_type(p), CUDA_R_32F};
    const void *W = NULL, *X = NULL, *G;
    char *at, *g16;
    rows = rows < 1 ? 1 : rows > R ? R : rows;
    if (gx || gw) {
        at = (char *)dtr__cuda_scratch(ctx, (size_t)(dtr__cuda_align256(out * in * 2) + dtr__cuda_align256(rows * out * 2) +
                                                      (gw && x->dtype != p ? dtr__cuda_align256(R * in * 2) : 0)));
        if (!at || (gx && !(W = dtr__cuda_as16(ctx, dtr__data(w), w->dtype, p, out * in, &at))) ||
            (gw && !(X = dtr__cuda_as16(ctx, dtr__data(x), x->dtype, p, R * in, &at))))
            return ctx->status;
        for (g16 = at, r0 = 0; r0 < R; r0 += rows, at = g16) {
            int64_t n = R - r0 < rows ? R - r0 : rows;
            if (!(G = dtr__cuda_as16(ctx, nd->out->grad + r0 * out, DTR_F32, p, n * out, &at))) return ctx->status;
            if (gx && dtr__cuda_gemm_as(ctx, t, n, in, out, 1.0f, G, out, 1, 0, W, in, 1, 0, 1.0f, gx + r0 * in, in, 0, 1) != DTR_OK)
                return ctx->status;
            if (gw && dtr__cuda_gemm_as(ctx, t, out, in, n, 1.0f, G, 1, out, 0, (const char *)X + r0 * in * 2, in, 1, 0, 1.0f, gw, in,
                                        0, 1) != DTR_OK)
                return ctx->status;
        }
    }
    return gb ? dtr__cuda_col_sum(ctx, nd, nd->out->grad, dtr__cuda_mem_of(NULL), NULL, R, out, gb) : DTR_OK;
}

/* The f32 kernel k, over widened copies of the node's 16-bit tensors where it has any. */
static dtr_result dtr__cuda_wide(dtr_context *ctx, dtr__node *nd, int bwd, dtr__kernel k) {
    return dtr__needs_widening(nd, bwd) ? dtr__run_widened(dtr__cuda_cast_fwd, k, ctx, nd, bwd) : k(ctx, nd);
}

/* linear's table entry (narrow: the choice between 16-bit and widened f32 products is here) */
static dtr_result dtr__cuda_linear_fwd(dtr_context *ctx, dtr__node *nd) {
    return dtr__cuda_linear16(ctx, nd) ? dtr__cuda_linear16_fwd(ctx, nd) : dtr__cuda_wide(ctx, nd, 0, dtr__cuda_linear32_fwd);
}
static dtr_result dtr__cuda_linear_bwd(dtr_context *ctx, dtr__node *nd) {
    return dtr__cuda_linear16(ctx, nd) ? dtr__cuda_linear16_bwd(ctx, nd) : dtr__cuda_wide(ctx, nd, 1, dtr__cuda_linear32_bwd);
}

/* ---- matmul ---- */

/* The batch axes of a and b broadcast together (as the CPU's dtr__batch): the output batch
 * shape, each operand's stride over it (0 where broadcast), and, when every batch axis of
 * each operand collapses to one stride, that stride (one strided-batched call does it). */
typedef struct dtr__cuda_batch {
    int nd;
    int64_t shape[DTR_MAX_DIMS], sa[DTR_MAX_DIMS], sb[DTR_MAX_DIMS], count;
    int64_t ua, ub;   /* the collapsed strides, when uniform */
    int uniform;
} dtr__cuda_batch;

/* 1 when strides st over the batch shape are i * u for one stride u (set in *u). */
static int dtr__cuda_collapse(const dtr__cuda_batch *bt, const int64_t *st, int64_t *u) {
    int64_t expect = -1;
    int d;
    *u = 0;
    for (d = bt->nd - 1; d >= 0; d--) {
        if (bt->shape[d] == 1) continue;
        if (expect < 0) *u = st[d];
        else if (st[d] != expect) return 0;
        expect = st[d] * bt->shape[d];
    }
    return 1;
}

static dtr__cuda_batch dtr__cuda_batch_make(const dtr_tensor *a, const dtr_tensor *b, int dense) {
    dtr__cuda_batch bt;
    int64_t ca[DTR_MAX_DIMS], cb[DTR_MAX_DIMS];
    int na = a->ndim - 2, nb = b->ndim - 2, nd = na > nb ? na : nb, d;
    const int64_t *sta = a->stride, *stb = b->stride;
    if (dense) {   /* the gradients: dense strides of the same shapes */
        dtr__contig_strides(a->ndim, a->shape, ca);
        dtr__contig_strides(b->ndim, b->shape, cb);
        sta = ca;
        stb = cb;
    }
    memset(&bt, 0, sizeof bt);
    bt.nd = nd;
    bt.count = 1;
    for (d = 0; d < nd; d++) {
        int da = d - (nd - na), db = d - (nd - nb);
        int64_t xa = da >= 0 ? a->shape[da] : 1, xb = db >= 0 ? b->shape[db] : 1;
        bt.shape[d] = xa > xb ? xa : xb;
        bt.sa[d] = (da >= 0 && xa != 1) ? sta[da] : 0;
        bt.sb[d] = (db >= 0 && xb != 1) ? stb[db] : 0;
        bt.count *= bt.shape[d];
    }
    bt.uniform = dtr__cuda_collapse(&bt, bt.sa, &bt.ua) && dtr__cuda_collapse(&bt, bt.sb, &bt.ub);
    return bt;
}

static void dtr__cuda_batch_offsets(const dtr__cuda_batch *bt, int64_t i, int64_t *oa, int64_t *ob) {
    int d;
    *oa = *ob = 0;
    for (d = bt->nd - 1; d >= 0; d--) {
        int64_t k = i % bt->shape[d];
        i /= bt->shape[d];
        *oa += k * bt->sa[d];
        *ob += k * bt->sb[d];
    }
}

/* ---- matmul on operands as stored ----
 * With 16-bit products (matmul_precision) on 16-bit a and b of that type, the products read
 * them as stored (cublasGemmEx, f32 sums) and write y in 16 bits; backward rounds the f32
 * output gradient to 16 bits once (scratch, the output's size) and sums dA and dB in f32 into
 * their f32 buffers: the roundings of the f32 path's fast 16-bit compute, without the widened
 * copies. Otherwise (f32 operands or products, a 16-bit operand beside an f32 one, a view
 * with neither unit row nor unit column stride, an empty product) the f32 kernels, over
 * widened copies where tensors are 16-bit. */

/* A matmul node's operands as its products read them: a's and b's first elements, the output
   gradient (dense; f32 or rounded), their element sizes, the forward's types (operands, y)
   and the backward's (operands, f32 gradients). */
typedef struct dtr__cuda_mm {
    const char *A, *B, *G;
    int64_t es, gs;
    dtr__cuda_gemm_t t, tg;
} dtr__cuda_mm;

/* 1 when matmul node nd runs on its 16-bit operands as stored */
static int dtr__cuda_matmul16(const dtr_context *ctx, const dtr__node *nd) {
    const dtr_tensor *a = nd->in[0], *b = nd->in[1];
    dtr_dtype p = dtr__cuda_product_dtype(ctx);
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1], ld;
    cublasOperation_t op;
    return p != DTR_F32 && nd->out->dtype == p && a->dtype == p && b->dtype == p && K > 0 && dtr_tensor_numel(nd->out) > 0 &&
           dtr__cuda_blas_view(M, K, a->stride[a->ndim - 2], a->stride[a->ndim - 1], &op, &ld) &&
           dtr__cuda_blas_view(K, N, b->stride[b->ndim - 2], b->stride[b->ndim - 1], &op, &ld);
}

/* the node's operands for the forward, or for backward (bwd: the output gradient, rounded to
   16 bits into scratch on the 16-bit path) */
static dtr_result dtr__cuda_mm_make(dtr_context *ctx, const dtr__node *nd, int bwd, dtr__cuda_mm *mm) {
    dtr_dtype p = nd->out->dtype;
    cudaDataType_t bt = dtr__cuda_blas_type(p);
    int64_t n = dtr_tensor_numel(nd->out);
    char *at;
    mm->A = (const char *)dtr__data(nd->in[0]), mm->B = (const char *)dtr__data(nd->in[1]), mm->G = (const char *)nd->out->grad;
    if (!dtr__cuda_matmul16(ctx, nd)) {
        mm->es = mm->gs = 4, mm->t = mm->tg = DTR__CUDA_F32;
        return DTR_OK;
    }
    mm->es = 2, mm->gs = 4, mm->t.ab = mm->t.y = mm->tg.ab = bt, mm->tg.y = CUDA_R_32F;
    if (!bwd) return DTR_OK;
    if (!(at = (char *)dtr__cuda_scratch(ctx, (size_t)dtr__cuda_align256(n * 2))) ||
        !(mm->G = (const char *)dtr__cuda_as16(ctx, nd->out->grad, DTR_F32, p, n, &at)))
        return ctx->status;
    mm->gs = 2;
    return DTR_OK;
}

/* One product of the batch per call, in batch order: for batches that do not collapse and
 * for gradients of an operand broadcast over the batch (each call accumulates into it, so
 * the sum is taken in the CPU's order). `which`: 0 forward, 1 dA, 2 dB. */
static dtr_result dtr__cuda_matmul_loop(dtr_context *ctx, dtr__node *nd, const dtr__cuda_mm *mm, int which) {
    const dtr_tensor *a = nd->in[0], *b = nd->in[1];
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1], i, oa, ob, ga, gbo;
    int64_t rsa = a->stride[a->ndim - 2], csa = a->stride[a->ndim - 1], rsb = b->stride[b->ndim - 2], csb = b->stride[b->ndim - 1];
    dtr__cuda_batch bt = dtr__cuda_batch_make(a, b, 0), gb = dtr__cuda_batch_make(a, b, 1);
    dtr_result r = DTR_OK;
    for (i = 0; i < bt.count && r == DTR_OK; i++) {
        const char *A, *B, *G = mm->G + i * M * N * mm->gs;
        dtr__cuda_batch_offsets(&bt, i, &oa, &ob);
        dtr__cuda_batch_offsets(&gb, i, &ga, &gbo);
        A = mm->A + oa * mm->es, B = mm->B + ob * mm->es;
        if (which == 0)
            r = dtr__cuda_gemm_as(ctx, mm->t, M, N, K, 1.0f, A, rsa, csa, 0, B, rsb, csb, 0, 0.0f,
                                  (char *)dtr__data(nd->out) + i * M * N * mm->es, N, 0, 1);
        else if (which == 1)   /* dA (M, K) += G (M, N) B^T (N, K) */
            r = dtr__cuda_gemm_as(ctx, mm->tg, M, K, N, 1.0f, G, N, 1, 0, B, csb, rsb, 0, 1.0f, dtr__gradof(a) + ga, K, 0, 1);
        else                   /* dB (K, N) += A^T (K, M) G (M, N) */
            r = dtr__cuda_gemm_as(ctx, mm->tg, K, N, M, 1.0f, A, csa, rsa, 0, G, N, 1, 0, 1.0f, dtr__gradof(b) + gbo, N, 0, 1);
    }
    return r;
}

/* a (..., M, K), b (..., K, N) -> y (..., M, N) */
static dtr_result dtr__cuda_matmul_run_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *a = nd->in[0], *b = nd->in[1];
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1];
    dtr__cuda_batch bt = dtr__cuda_batch_make(a, b, 0);
    dtr__cuda_mm mm;
    dtr__cuda_mm_make(ctx, nd, 0, &mm);   /* (the forward's cannot fail) */
    if (!bt.uniform) return dtr__cuda_matmul_loop(ctx, nd, &mm, 0);
    return dtr__cuda_gemm_as(ctx, mm.t, M, N, K, 1.0f, mm.A, a->stride[a->ndim - 2], a->stride[a->ndim - 1], bt.ua, mm.B,
                             b->stride[b->ndim - 2], b->stride[b->ndim - 1], bt.ub, 0.0f, dtr__data(nd->out), N, M * N, bt.count);
}

static dtr_result dtr__cuda_matmul_run_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *a = nd->in[0], *b = nd->in[1];
    int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1];
    int64_t rsa = a->stride[a->ndim - 2], csa = a->stride[a->ndim - 1], rsb = b->stride[b->ndim - 2], csb = b->stride[b->ndim - 1];
    float *GA = dtr__gradof(a), *GB = dtr__gradof(b);
    dtr__cuda_batch bt = dtr__cuda_batch_make(a, b, 0), gb = dtr__cuda_batch_make(a, b, 1);
    int batched = bt.uniform && gb.uniform;
    dtr__cuda_mm mm;
    if (!GA && !GB) return DTR_OK;
    if (dtr__cuda_mm_make(ctx, nd, 1, &mm) != DTR_OK) return ctx->status;
    if (GA) {   /* dA (M, K) += G (M, N) B^T (N, K); a broadcast over the batch: one call per item */
        dtr_result r = batched && (gb.ua != 0 || bt.count == 1)
                           ? dtr__cuda_gemm_as(ctx, mm.tg, M, K, N, 1.0f, mm.G, N, 1, M * N, mm.B, csb, rsb, bt.ub, 1.0f, GA, K, gb.ua,
                                               bt.count)
                           : dtr__cuda_matmul_loop(ctx, nd, &mm, 1);
        if (r != DTR_OK) return r;
    }
    if (GB) {   /* dB (K, N) += A^T (K, M) G (M, N) */
        dtr_result r = batched && (gb.ub != 0 || bt.count == 1)
                           ? dtr__cuda_gemm_as(ctx, mm.tg, K, N, M, 1.0f, mm.A, csa, rsa, bt.ua, mm.G, N, 1, M * N, 1.0f, GB, N, gb.ub,
                                               bt.count)
                           : dtr__cuda_matmul_loop(ctx, nd, &mm, 2);
        if (r != DTR_OK) return r;
    }
    return DTR_OK;
}

/* matmul's table entry (narrow: 16-bit operands as stored, or widened here) */
static dtr_result dtr__cuda_matmul_fwd(dtr_context *ctx, dtr__node *nd) {
    return dtr__cuda_matmul16(ctx, nd) ? dtr__cuda_matmul_run_fwd(ctx, nd) : dtr__cuda_wide(ctx, nd, 0, dtr__cuda_matmul_run_fwd);
}
static dtr_result dtr__cuda_matmul_bwd(dtr_context *ctx, dtr__node *nd) {
    return dtr__cuda_matmul16(ctx, nd) ? dtr__cuda_matmul_run_bwd(ctx, nd) : dtr__cuda_wide(ctx, nd, 1, dtr__cuda_matmul_run_bwd);
}

/* ---- recurrences over a sequence (dtr_lstm_sequence, dtr_gru_sequence; the CPU's are in
 * src/ops/ops_nn.c): gx (T, B, G H), w_hh (G H, H), b_hh, h0 (and the LSTM's c0) -> y (T, B, Y).
 * A step is a GEMM for h W_hh^T and one kernel for the gates (a thread a unit), which keeps
 * what backward needs (the LSTM's activations and tanh(c'), the GRU's r, z, n and hn; saved
 * (T, B, 5H) / (T, B, 4H) when taped); backward walks the steps in reverse carrying dh (a GEMM
 * a step; the LSTM's dc too), then W_hh's gradient is one GEMM over all steps. f32 kernels
 * (16-bit tensors widened). ---- */

typedef struct dtr__cuda_rnn_step {
    const float *gx, *bias, *c, *h, *gy;  /* this step's gx; b_hh; the LSTM's cell before (row stride ldc); h before (ldh); y's gradient */
    float *a, *ts, *y;                    /* gates (h W^T in, kept values out); the LSTM's tanh(c'); y's step */
    float *dh, *dc, *da, *dx, *gc0, *gh0; /* backward: carried gradients of h and c; the gates' (against W_hh; the GRU's gx's apart);
                                             c0's and h0's (step 0) */
    const int32_t *len;                   /* row lengths (a row past its length carries its state), or NULL */
    int64_t B, H, ldc, ldh, Y, t;
    int hh;                               /* a holds h W^T */
} dtr__cuda_rnn_step;

/* 1 when row r is past its length at this step (as the CPU's dtr__rnn_padded) */
__device__ static int dtr__cuda_rnn_padded(const dtr__cuda_rnn_step &s, int64_t r) { return s.len && s.t >= s.len[r]; }

/* the LSTM gate q's pre-activation at element e (row r, unit k) as the CPU's dtr__lstm_gates_in */
__device__ static float dtr__cuda_lstm_pre(const dtr__cuda_rnn_step &s, int64_t e, int64_t bq) {
    if (s.hh && s.bias) return s.gx[e] + (s.a[e] + s.bias[bq]);
    if (s.hh) return s.gx[e] + s.a[e];
    return s.bias ? s.gx[e] + s.bias[bq] : s.gx[e];
}

__global__ static void dtr__cuda_lstm_seq_fwd_k(dtr__cuda_rnn_step s) {
    DTR__CUDA_FOR(u, s.B * s.H) {
        int64_t r = u / s.H, k = u % s.H, o = r * 4 * s.H + k;
        float g[4], h, c2, t;
        if (dtr__cuda_rnn_padded(s, r)) {   /* the state carried: the step before's h and c */
            s.y[r * 2 * s.H + k] = s.y[r * 2 * s.H + k - s.B * s.Y], s.y[r * 2 * s.H + s.H + k] = s.y[r * 2 * s.H + s.H + k - s.B * s.Y];
            continue;
        }
        dtr__f_lstm_gates(dtr__cuda_lstm_pre(s, o, k), dtr__cuda_lstm_pre(s, o + s.H, s.H + k), dtr__cuda_lstm_pre(s, o + 2 * s.H, 2 * s.H + k),
                          dtr__cuda_lstm_pre(s, o + 3 * s.H, 3 * s.H + k), &g[0], &g[1], &g[2], &g[3]);
        dtr__f_lstm_cell_act(g[0], g[1], g[2], g[3], s.c ? s.c[r * s.ldc + k] : 0.0f, &h, &c2, &t);
        for (int q = 0; q < 4; q++) s.a[o + q * s.H] = g[q];
        s.ts[u] = t, s.y[r * 2 * s.H + k] = h, s.y[r * 2 * s.H + s.H + k] = c2;
    }
}

/* LSTM step t's gates' gradients into da from y's gradient plus the carried dh, dc; dc becomes
   the previous cell's (at step 0: added into c0's gradient gc0, if any) and dh 0 (the GEMM adds
   da W_hh); a padded row carries both on whole, its da 0 */
__global__ static void dtr__cuda_lstm_seq_bwd_k(dtr__cuda_rnn_step s, int first) {
    DTR__CUDA_FOR(u, s.B * s.H) {
        int64_t r = u / s.H, k = u % s.H, o = r * 4 * s.H + k;
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dcp, gh = s.gy[r * 2 * s.H + k] + s.dh[u], gc = s.gy[r * 2 * s.H + s.H + k] + s.dc[u];
        if (dtr__cuda_rnn_padded(s, r)) {
            s.dh[u] = gh, s.dc[u] = gc;
        } else {
            dtr__f_lstm_cell_grad_act(s.a[o], s.a[o + s.H], s.a[o + 2 * s.H], s.a[o + 3 * s.H], s.c ? s.c[r * s.ldc + k] : 0.0f, s.ts[u], gh, gc,
                                      &d[0], &d[1], &d[2], &d[3], &dcp);
            s.dh[u] = 0.0f;
            if (!first) s.dc[u] = dcp;
            else if (s.gc0) s.gc0[u] += dcp;
        }
        for (int q = 0; q < 4; q++) s.da[o + q * s.H] = d[q];
    }
}

/* the GRU's hidden part of gate q at unit (r, k) (a row of 4H), as the CPU's forward body */
__device__ static float dtr__cuda_gru_hid(const dtr__cuda_rnn_step &s, int64_t r, int q, int64_t k) {
    float b = s.bias ? s.bias[q * s.H + k] : 0.0f;
    if (!s.hh) return b;
    return s.bias ? s.a[r * 4 * s.H + q * s.H + k] + b : s.a[r * 4 * s.H + q * s.H + k];
}

__global__ static void dtr__cuda_gru_seq_fwd_k(dtr__cuda_rnn_step s) {
    DTR__CUDA_FOR(u, s.B * s.H) {
        int64_t r = u / s.H, k = u % s.H, o = r * 4 * s.H + k, x = r * 3 * s.H + k;
        float hr = dtr__cuda_gru_hid(s, r, 0, k), hz = dtr__cuda_gru_hid(s, r, 1, k), hn = dtr__cuda_gru_hid(s, r, 2, k), g[3], h2;
        if (dtr__cuda_rnn_padded(s, r)) {   /* the state carried */
            s.y[u] = s.h[r * s.ldh + k];
            continue;
        }
        dtr__f_gru_cell(s.gx[x], s.gx[x + s.H], s.gx[x + 2 * s.H], hr, hz, hn, s.h ? s.h[r * s.ldh + k] : 0.0f, &g[0], &g[1], &g[2], &h2);
        s.a[o] = g[0], s.a[o + s.H] = g[1], s.a[o + 2 * s.H] = g[2], s.a[o + 3 * s.H] = hn;
        s.y[u] = h2;
    }
}

/* GRU step t: the gates' gradients into dx (gx's) and da (against W_hh) from y's gradient plus
   the carried dh; dh becomes the update's share z dh' (the GEMM adds the rest), at step 0 added
   into h0's gradient */
__global__ static void dtr__cuda_gru_seq_bwd_k(dtr__cuda_rnn_step s, int first) {
    DTR__CUDA_FOR(u, s.B * s.H) {
        int64_t r = u / s.H, k = u % s.H, o = r * 4 * s.H + k, x = r * 3 * s.H + k;
        float dr = 0.0f, dz = 0.0f, dn = 0.0f, dhn = 0.0f, dh = s.gy[u] + s.dh[u];
        if (!dtr__cuda_rnn_padded(s, r))   /* else: the whole gradient carried, the gates' 0 */
            dtr__f_gru_cell_grad(s.a[o], s.a[o + s.H], s.a[o + 2 * s.H], s.a[o + 3 * s.H], s.h ? s.h[r * s.ldh + k] : 0.0f, dh, &dr, &dz, &dn,
                                 &dhn, &dh);
        s.dx[x] = s.da[x] = dr, s.dx[x + s.H] = s.da[x + s.H] = dz, s.dx[x + 2 * s.H] = dn, s.da[x + 2 * s.H] = dhn;
        if (!first) s.dh[u] = dh;
        else if (s.gh0) s.gh0[u] += dh;
    }
}

/* step t's pointers: the kept gates (rows of S floats) at A's step t (or its one step), the
   LSTM's tanh(c') after them, the state before */
static dtr__cuda_rnn_step dtr__cuda_rnn_at(const dtr__node *nd, float *A, int64_t t, int all) {
    dtr__cuda_rnn_step s;
    int64_t T = nd->out->shape[0], S;
    int gru = nd->op == DTR_OP_GRU;
    memset(&s, 0, sizeof s);
    s.B = nd->out->shape[1], s.H = nd->in[1]->shape[1], s.Y = nd->out->shape[2], S = 4 * s.H;
    s.gx = dtr__f32(nd->in[0]) + t * s.B * (gru ? 3 : 4) * s.H, s.bias = nd->in[2] ? dtr__f32(nd->in[2]) : NULL;
    s.y = dtr__f32(nd->out) + t * s.B * s.Y;
    s.h = t ? s.y - s.B * s.Y : nd->in[3] ? dtr__f32(nd->in[3]) : NULL, s.ldh = t ? s.Y : s.H;
    s.c = gru ? NULL : t ? s.y - s.B * s.Y + s.H : nd->in[4] ? dtr__f32(nd->in[4]) : NULL, s.ldc = s.ldh;
    s.a = A + (all ? t : 0) * s.B * S, s.ts = gru ? NULL : A + (all ? T : 1) * s.B * S + (all ? t : 0) * s.B * s.H;
    s.len = nd->in[5] ? dtr__i32(nd->in[5]) : NULL, s.t = t;
    return s;
}

static dtr_result dtr__cuda_rnn_fwd(dtr_context *ctx, dtr__node *nd) {
    int64_t T = nd->out->shape[0], B = nd->out->shape[1], H = nd->in[1]->shape[1], G = (nd->op == DTR_OP_GRU ? 3 : 4) * H, t;
    size_t per = (size_t)(B * (nd->op == DTR_OP_GRU ? 4 : 5) * H) * sizeof(float);
    float *A = (float *)(nd->taped ? dtr__node_save(ctx, nd, (size_t)T * per) : dtr__cuda_scratch(ctx, per));
    if (!A) return ctx->status;
    if (nd->taped) nd->saved = A;
    for (t = 0; t < T; t++) {
        dtr__cuda_rnn_step s = dtr__cuda_rnn_at(nd, A, t, nd->taped);
        /* a (B, G H) (row stride 4H) = h (B, H) W^T (H, G H) */
        if ((s.hh = s.h != NULL) &&
            dtr__cuda_gemm(ctx, B, G, H, 1.0f, s.h, s.ldh, 1, 0, dtr__f32(nd->in[1]), 1, H, 0, 0.0f, s.a, 4 * H, 0, 1) != DTR_OK)
            return ctx->status;
        if (nd->op == DTR_OP_GRU) dtr__cuda_gru_seq_fwd_k<<<dtr__cuda_grid(B * H), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(s);
        else dtr__cuda_lstm_seq_fwd_k<<<dtr__cuda_grid(B * H), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(s);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    }
    return DTR_OK;
}

/* w_hh's gradient (every step's dA against the h before it), b_hh's (dA's column sums) and
   gx's (dX: dA, or the GRU's own) */
static dtr_result dtr__cuda_rnn_sums(dtr_context *ctx, dtr__node *nd, const float *dA, const float *dX) {
    int64_t T = nd->out->shape[0], B = nd->out->shape[1], H = nd->in[1]->shape[1], G = dtr_tensor_dim(nd->in[0], 2), Y = nd->out->shape[2];
    float *gx = dtr__gradof(nd->in[0]), *gw = dtr__gradof(nd->in[1]), *gb = dtr__gradof(nd->in[2]);
    if (gx) {
        dtr__cuda_add_k<<<dtr__cuda_grid(T * B * G), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(gx, dX, T * B * G);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    }
    /* dW (G H, H) += dA_t^T (G H, B) h_{t-1} (B, H), summed over steps 1.. in one product, and step 0's with h0 */
    if (gw && T > 1 &&
        dtr__cuda_gemm(ctx, G, H, (T - 1) * B, 1.0f, dA + B * G, 1, G, 0, dtr__f32(nd->out), Y, 1, 0, 1.0f, gw, H, 0, 1) != DTR_OK)
        return ctx->status;
    if (gw && nd->in[3] && dtr__cuda_gemm(ctx, G, H, B, 1.0f, dA, 1, G, 0, dtr__f32(nd->in[3]), H, 1, 0, 1.0f, gw, H, 0, 1) != DTR_OK)
        return ctx->status;
    return gb ? dtr__cuda_col_sum(ctx, nd, dA, dtr__cuda_mem_of(NULL), NULL, T * B, G, gb) : DTR_OK;
}

static dtr_result dtr__cuda_rnn_bwd(dtr_context *ctx, dtr__node *nd) {
    int64_t T = nd->out->shape[0], B = nd->out->shape[1], H = nd->in[1]->shape[1], G = dtr_tensor_dim(nd->in[0], 2), t;
    int gru = nd->op == DTR_OP_GRU;
    float *dA = (float *)dtr__cuda_scratch(ctx, (size_t)(((gru ? 2 : 1) * T * G + 2 * H) * B) * sizeof(float)), *dX, *gh0 = dtr__gradof(nd->in[3]);
    if (!dA) return ctx->status;
    dX = gru ? dA + T * B * G : dA;
    if (dtr__cuda_memset0(ctx, dA + (gru ? 2 : 1) * T * B * G, (size_t)(2 * B * H) * sizeof(float)) != DTR_OK) return ctx->status;
    for (t = T - 1; t >= 0; t--) {
        dtr__cuda_rnn_step s = dtr__cuda_rnn_at(nd, (float *)nd->saved, t, 1);
        s.gy = nd->out->grad + t * B * s.Y, s.da = dA + t * B * G, s.dx = dX + t * B * G;
        s.dh = dA + (gru ? 2 : 1) * T * B * G, s.dc = s.dh + B * H;
        s.gc0 = dtr__gradof(nd->in[4]), s.gh0 = gh0;
        if (gru) dtr__cuda_gru_seq_bwd_k<<<dtr__cuda_grid(B * H), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(s, t == 0);
        else dtr__cuda_lstm_seq_bwd_k<<<dtr__cuda_grid(B * H), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(s, t == 0);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
        /* the h before's gradient (B, H) += dA_t (B, G H) W (G H, H): into the carried one (the
           kernel left the GRU's z dh', the LSTM's 0, a padded row's whole), or h0's */
        if ((t || gh0) && dtr__cuda_gemm(ctx, B, H, G, 1.0f, s.da, G, 1, 0, dtr__f32(nd->in[1]), H, 1, 0, 1.0f, t ? s.dh : gh0, H, 0, 1) != DTR_OK)
            return ctx->status;
    }
    return dtr__cuda_rnn_sums(ctx, nd, dA, dX);
}
