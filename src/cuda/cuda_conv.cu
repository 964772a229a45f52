/* ============================================================================
 * Convolution and pooling on the GPU, with the CPU's shapes and rules (src/ops/ops_conv.c):
 * x (N, C, H, W), w (O, C / G, KH, KW), y (N, O, Ho, Wo), Ho = (H + 2 PH - DH (KH - 1) - 1) / SH
 * + 1 (stride, padding, dilation per axis; G groups).
 * Convolution is im2col + cuBLAS: the columns of all samples, col (C*KH*KW, N*Ho*Wo), are kept
 * for backward; y_n = W col_n is one strided-batched GEMM per group (group g's rows of W, y and
 * col are blocks). Backward takes gy as (O, N*Ho*Wo) (one transposing copy): dW += gy col^T and
 * gcol = W^T gy are one GEMM each per group, the bias gradient is a row sum per output channel,
 * and col2im gathers instead of scattering (one thread per input element sums the columns that
 * read it), so nothing needs atomics and a run repeats bit for bit.
 * 16-bit (16-bit products, matmul_precision, and an output of that type): the columns are
 * written and kept in 16 bits (half the f32 path's memory), the f32 weight is rounded into
 * scratch on each call, the bias rounded before the product adds to it (as linear); backward
 * rounds gy's transpose to 16 bits and sums dW and the column gradients in f32. These are the
 * f32 path's roundings under fast 16-bit compute (cuBLAS rounds the operands). Pooling reads
 * and writes 16-bit values as they are.
 * ==========================================================================*/

typedef struct dtr__cuda_conv {
    int64_t N, C, H, W, O, KH, KW, Ho, Wo;
    int64_t SH, SW, PH, PW, DH, DW, G;   /* per axis stride, padding, dilation; groups (pooling: square, D 1, G 1) */
} dtr__cuda_conv;

static dtr__cuda_conv dtr__cuda_conv_of(const dtr__node *nd, int pool) {
    const dtr_tensor *x = nd->in[0];
    dtr__cuda_conv g;
    g.N = x->shape[0]; g.C = x->shape[1]; g.H = x->shape[2]; g.W = x->shape[3];
    g.Ho = nd->out->shape[2]; g.Wo = nd->out->shape[3];
    g.DH = g.DW = g.G = 1;
    if (pool) {
        const dtr__pool2d_params *p = &nd->p.pool2d;
        g.O = g.C; g.KH = p->k[0]; g.KW = p->k[1];
        g.SH = p->stride[0]; g.SW = p->stride[1]; g.PH = p->padding[0]; g.PW = p->padding[1];
    } else {   /* a transposed convolution: the image is y, the products x */
        const dtr__conv2d_params *p = &nd->p.conv2d;
        const dtr_tensor *img = nd->op == DTR_OP_CONV2D ? x : nd->out, *prod = nd->op == DTR_OP_CONV2D ? nd->out : x;
        g.N = img->shape[0]; g.C = img->shape[1]; g.H = img->shape[2]; g.W = img->shape[3];
        g.Ho = prod->shape[2]; g.Wo = prod->shape[3];
        g.O = nd->in[1]->shape[0]; g.KH = nd->in[1]->shape[2]; g.KW = nd->in[1]->shape[3];
        g.SH = p->stride[0]; g.SW = p->stride[1]; g.PH = p->padding[0]; g.PW = p->padding[1];
        g.DH = p->dilation[0]; g.DW = p->dilation[1]; g.G = p->groups;
    }
    return g;
}

/* col (C*KH*KW, N, Ho*Wo) from x (N, C, H, W); zero outside the padded input (each f32 or 16-bit) */
__global__ static void dtr__cuda_im2col_k(dtr__cuda_mem x, dtr__cuda_mem col, dtr__cuda_conv g) {
    int64_t ckk = g.C * g.KH * g.KW, P = g.Ho * g.Wo;
    DTR__CUDA_FOR(t, g.N * ckk * P) {
        int64_t r = t / (g.N * P), n = (t / P) % g.N, p = t % P;
        int64_t c = r / (g.KH * g.KW), ki = (r / g.KW) % g.KH, kj = r % g.KW;
        int64_t ii = (p / g.Wo) * g.SH - g.PH + ki * g.DH, jj = (p % g.Wo) * g.SW - g.PW + kj * g.DW;
        col.st(t, (ii >= 0 && ii < g.H && jj >= 0 && jj < g.W) ? x.ld(((n * g.C + c) * g.H + ii) * g.W + jj) : 0.0f);
    }
}

/* The output position oi whose window's tap a (dilation D) covers input row i: i = oi S - P + a D. */
__device__ static int dtr__cuda_window(int64_t i, int64_t a, int64_t S, int64_t P, int64_t D, int64_t Ho, int64_t *oi) {
    int64_t q = i + P - a * D;
    if (q < 0 || q % S != 0) return 0;
    *oi = q / S;
    return *oi < Ho;
}

/* gx (N, C, H, W) += the column gradients gcol (C*KH*KW, N, Ho*Wo) that read each element */
__global__ static void dtr__cuda_col2im_k(const float *gcol, float *gx, dtr__cuda_conv g) {
    int64_t P = g.Ho * g.Wo;
    DTR__CUDA_FOR(t, g.N * g.C * g.H * g.W) {
        int64_t n = t / (g.C * g.H * g.W), c = (t / (g.H * g.W)) % g.C, i = (t / g.W) % g.H, j = t % g.W, oi, oj;
        float acc = gx[t];
        for (int64_t ki = 0; ki < g.KH; ki++) {
            if (!dtr__cuda_window(i, ki, g.SH, g.PH, g.DH, g.Ho, &oi)) continue;
            for (int64_t kj = 0; kj < g.KW; kj++) {
                if (!dtr__cuda_window(j, kj, g.SW, g.PW, g.DW, g.Wo, &oj)) continue;
                acc += gcol[(((c * g.KH + ki) * g.KW + kj) * g.N + n) * P + oi * g.Wo + oj];
            }
        }
        gx[t] = acc;
    }
}

/* y (N, O, P) = bias[o] (rounded to y's type) */
__global__ static void dtr__cuda_conv_bias_k(dtr__cuda_mem y, dtr__cuda_mem bias, int64_t N, int64_t O, int64_t P) {
    DTR__CUDA_FOR(t, N * O * P) y.st(t, bias.ld((t / P) % O));
}

/* gyt (O, N, P) from gy (N, O, P) (gyt f32 or rounded to 16 bits) */
__global__ static void dtr__cuda_conv_gyt_k(const float *gy, dtr__cuda_mem gyt, int64_t N, int64_t O, int64_t P) {
    DTR__CUDA_FOR(t, N * O * P) {
        int64_t o = t / (N * P), n = (t / P) % N, p = t % P;
        gyt.st(t, gy[(n * O + o) * P + p]);
    }
}

/* gb[o] += the sum of channel o of gy (N, O, P) in (n, p) order: one block per channel, a
   fixed tree in double */
__global__ static void dtr__cuda_conv_gb_k(const float *gy, float *gb, int64_t N, int64_t O, int64_t P) {
    double acc = 0.0;
    for (int64_t i = threadIdx.x; i < N * P; i += blockDim.x) acc += gy[(i / P * O + blockIdx.x) * P + i % P];
    acc = dtr__cuda_block_sum(acc);
    if (threadIdx.x == 0) gb[blockIdx.x] += (float)acc;
}

/* The products of a convolution node: the columns' and the operands' element size and types
   (f32, or 16-bit operands: the forward's output 16-bit, the backward's f32) */
typedef struct dtr__cuda_conv_t {
    dtr_dtype p;                 /* the operands' type */
    int64_t es;                  /* its bytes */
    dtr__cuda_gemm_t t, tg;
} dtr__cuda_conv_t;

/* 16-bit when the context's products are 16-bit and the output is of their type */
static dtr__cuda_conv_t dtr__cuda_conv_types(const dtr_context *ctx, const dtr__node *nd) {
    dtr_dtype p = dtr__cuda_product_dtype(ctx);
    dtr__cuda_conv_t c = {DTR_F32, 4, DTR__CUDA_F32, DTR__CUDA_F32};
    if (p == DTR_F32 || nd->out->dtype != p) return c;
    c.p = p, c.es = 2, c.t.ab = c.t.y = c.tg.ab = dtr__cuda_blas_type(p), c.tg.y = CUDA_R_32F;
    return c;
}

/* w (O, ckk) as the products read it: itself, or rounded to 16 bits at *at */
static const void *dtr__cuda_conv_w(dtr_context *ctx, const dtr__node *nd, const dtr__cuda_conv_t *c, int64_t n, char **at) {
    return c->p == DTR_F32 ? dtr__data(nd->in[1]) : dtr__cuda_as16(ctx, dtr__data(nd->in[1]), nd->in[1]->dtype, c->p, n, at);
}

/* y_n[q] (og, P) = W[q] (og, ckk) col_n[q] (ckk, P; row stride N P) + beta y_n[q], y (N, O, P): one product over the
   items (q, n); ptrs: 3 G N pointers of scratch */
static dtr_result dtr__cuda_conv_apply(dtr_context *ctx, const dtr__cuda_conv *g, const dtr__cuda_conv_t *c, const void *W,
                                       const void *col, float beta, void *y, void **ptrs) {
    int64_t ckk = g->C / g->G * g->KH * g->KW, og = g->O / g->G, P = g->Ho * g->Wo;
    dtr__cuda_bstride sw = {og * ckk, 0, c->es}, sc = {ckk * g->N * P, P, c->es}, sy = {og * P, g->O * P, c->es};
    return dtr__cuda_gemm2(ctx, c->t, og, P, ckk, 1.0f, W, ckk, 1, sw, col, g->N * P, 1, sc, beta, y, P, sy, g->G, g->N, ptrs);
}

static dtr_result dtr__cuda_conv2d_run_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_conv g = dtr__cuda_conv_of(nd, 0);
    dtr__cuda_conv_t c = dtr__cuda_conv_types(ctx, nd);
    int64_t ckk = g.C / g.G * g.KH * g.KW, P = g.Ho * g.Wo, w16 = c.p == DTR_F32 ? 0 : dtr__cuda_align256(g.O * ckk * 2);
    const dtr_tensor *bias = nd->n_in > 2 ? nd->in[2] : NULL;
    char *col = (char *)dtr__node_save(ctx, nd, (size_t)(g.N * g.G * ckk * P + 1) * (size_t)c.es), *at; /* kept for backward */
    const void *W;
    dtr__cuda_mem colm = {col, (int)c.p};
    cudaStream_t st = dtr__cuda_stream(ctx);
    if (!col) return ctx->status;
    nd->saved = col;
    if (g.N * g.O * P == 0) return DTR_OK;
    /* scratch: the rounded weight (16-bit), then the groups' pointer arrays */
    if (!(at = (char *)dtr__cuda_scratch(ctx, (size_t)(w16 + 3 * g.G * g.N * (int64_t)sizeof(void *)))) ||
        !(W = dtr__cuda_conv_w(ctx, nd, &c, g.O * ckk, &at)))
        return ctx->status;
    dtr__cuda_im2col_k<<<dtr__cuda_grid(g.N * g.G * ckk * P), DTR__CUDA_THREADS, 0, st>>>(dtr__cuda_mem_of(nd->in[0]), colm, g);
    if (bias)
        dtr__cuda_conv_bias_k<<<dtr__cuda_grid(g.N * g.O * P), DTR__CUDA_THREADS, 0, st>>>(dtr__cuda_mem_of(nd->out),
                                                                                      dtr__cuda_mem_of(bias), g.N, g.O, P);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    return dtr__cuda_conv_apply(ctx, &g, &c, W, col, bias ? 1.0f : 0.0f, dtr__data(nd->out), (void **)at);   /* (at: past the rounded weight) */
}

/* dW (O, ckk) += gy (O, NP) col^T (NP, ckk) and gcol (G ckk, NP) = W^T gy, one product per group */
static dtr_result dtr__cuda_conv2d_products(dtr_context *ctx, const void *col, const dtr__cuda_conv *g, const dtr__cuda_conv_t *c,
                                            const char *gyt, const void *W, float *gw, float *gcol) {
    int64_t ckk = g->C / g->G * g->KH * g->KW, og = g->O / g->G, NP = g->N * g->Ho * g->Wo;
    if (gw && dtr__cuda_gemm_as(ctx, c->tg, og, ckk, NP, 1.0f, gyt, NP, 1, og * NP, col, 1, NP, ckk * NP, 1.0f, gw, ckk,
                                og * ckk, g->G) != DTR_OK)
        return ctx->status;
    if (!gcol) return DTR_OK;
    return dtr__cuda_gemm_as(ctx, c->tg, ckk, NP, og, 1.0f, W, 1, ckk, og * ckk, gyt, NP, 1, og * NP, 0.0f, gcol, NP, ckk * NP,
                             g->G);
}

static dtr_result dtr__cuda_conv2d_run_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_conv g = dtr__cuda_conv_of(nd, 0);
    dtr__cuda_conv_t c = dtr__cuda_conv_types(ctx, nd);
    int64_t ckk = g.C * g.KH * g.KW, P = g.Ho * g.Wo, NP = g.N * P;   /* ckk: all groups' rows */
    float *gx = dtr__gradof(nd->in[0]), *gw = dtr__gradof(nd->in[1]), *gb = nd->n_in > 2 ? dtr__gradof(nd->in[2]) : NULL, *gcol;
    cudaStream_t st = dtr__cuda_stream(ctx);
    const void *W = NULL;
    char *gyt, *at;
    dtr__cuda_mem gytm;
    if (g.O * NP == 0) return DTR_OK;
    if (gb) {   /* from gy as it is (f32) on both paths */
        dtr__cuda_conv_gb_k<<<(unsigned)g.O, DTR__CUDA_THREADS, 0, st>>>(nd->out->grad, gb, g.N, g.O, P);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    }
    if (!gw && !gx) return DTR_OK;
    /* temporaries in the context's scratch: gy transposed, the rounded weight, the column gradients */
    if (!(gyt = at = (char *)dtr__cuda_scratch(ctx, (size_t)(dtr__cuda_align256(g.O * NP * c.es) +
                                                            (gx ? (c.es == 2 ? dtr__cuda_align256(g.O * ckk / g.G * 2) : 0) +
                                                                  ckk * NP * 4 : 0)))))
        return ctx->status;
    gytm.p = gyt, gytm.dt = (int)c.p;
    at += dtr__cuda_align256(g.O * NP * c.es);
    if (gx && !(W = dtr__cuda_conv_w(ctx, nd, &c, g.O * ckk / g.G, &at))) return ctx->status;
    gcol = gx ? (float *)at : NULL;   /* (past the rounded weight) */
    dtr__cuda_conv_gyt_k<<<dtr__cuda_grid(g.O * NP), DTR__CUDA_THREADS, 0, st>>>(nd->out->grad, gytm, g.N, g.O, P);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK || dtr__cuda_conv2d_products(ctx, nd->saved, &g, &c, gyt, W, gw, gcol) != DTR_OK)
        return ctx->status;
    if (gx)   /* the column gradients gathered back into gx */
        dtr__cuda_col2im_k<<<dtr__cuda_grid(g.N * g.C * g.H * g.W), DTR__CUDA_THREADS, 0, st>>>(gcol, gx, g);
    return dtr__cuda_launched(ctx, nd);
}

/* conv2d's table entry (narrow: 16-bit products on their type's output as stored, others
   widened here) */
static dtr_result dtr__cuda_conv2d_fwd(dtr_context *ctx, dtr__node *nd) {
    return dtr__cuda_conv_types(ctx, nd).p != DTR_F32 ? dtr__cuda_conv2d_run_fwd(ctx, nd)
                                                      : dtr__cuda_wide(ctx, nd, 0, dtr__cuda_conv2d_run_fwd);
}
static dtr_result dtr__cuda_conv2d_bwd(dtr_context *ctx, dtr__node *nd) {
    return dtr__cuda_conv_types(ctx, nd).p != DTR_F32 ? dtr__cuda_conv2d_run_bwd(ctx, nd)
                                                      : dtr__cuda_wide(ctx, nd, 1, dtr__cuda_conv2d_run_bwd);
}

/* ---- transposed convolution (f32; the dispatch widens 16-bit tensors): conv2d's pieces the
   other way round, the image y (N, C, H, W) and the products x (N, O, Ho, Wo) ---- */

static const dtr__cuda_conv_t dtr__cuda_conv_f32 = {DTR_F32, 4, DTR__CUDA_F32, DTR__CUDA_F32};

/* y = bias (or 0), then y += col2im(W^T x) */
static dtr_result dtr__cuda_conv_transpose_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_conv g = dtr__cuda_conv_of(nd, 0);
    int64_t NP = g.N * g.Ho * g.Wo, HW = g.H * g.W;
    const dtr_tensor *bias = nd->n_in > 2 ? nd->in[2] : NULL;
    cudaStream_t st = dtr__cuda_stream(ctx);
    float *xt, *gcol, *y = (float *)dtr__data(nd->out);
    if (g.N * g.C * HW == 0) return DTR_OK;
    if (bias) dtr__cuda_conv_bias_k<<<dtr__cuda_grid(g.N * g.C * HW), DTR__CUDA_THREADS, 0, st>>>(dtr__cuda_mem_of(nd->out),
                                                                                               dtr__cuda_mem_of(bias), g.N, g.C, HW);
    else if (dtr__cuda_check(ctx, cudaMemsetAsync(y, 0, (size_t)(g.N * g.C * HW) * sizeof(float), st), "conv_transpose2d") != DTR_OK)
        return ctx->status;
    if (NP == 0) return dtr__cuda_launched(ctx, nd);
    if (!(xt = (float *)dtr__cuda_scratch(ctx, (size_t)(dtr__cuda_align256(g.O * NP * 4) + g.C * g.KH * g.KW * NP * 4))))
        return ctx->status;
    gcol = (float *)((char *)xt + dtr__cuda_align256(g.O * NP * 4));
    dtr__cuda_mem xtm = {xt, (int)DTR_F32};
    dtr__cuda_conv_gyt_k<<<dtr__cuda_grid(g.O * NP), DTR__CUDA_THREADS, 0, st>>>((const float *)dtr__data(nd->in[0]), xtm, g.N, g.O,
                                                                                g.Ho * g.Wo);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK ||
        dtr__cuda_conv2d_products(ctx, NULL, &g, &dtr__cuda_conv_f32, (const char *)xt, dtr__data(nd->in[1]), NULL, gcol) != DTR_OK)
        return ctx->status;
    dtr__cuda_col2im_k<<<dtr__cuda_grid(g.N * g.C * HW), DTR__CUDA_THREADS, 0, st>>>(gcol, y, g);
    return dtr__cuda_launched(ctx, nd);
}

/* db = dy's channel sums; col = im2col(dy); dx += W col (conv2d's forward); dW += x^T col^T */
static dtr_result dtr__cuda_conv_transpose_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_conv g = dtr__cuda_conv_of(nd, 0);
    int64_t NP = g.N * g.Ho * g.Wo, cols = g.C * g.KH * g.KW * NP, HW = g.H * g.W;
    float *gx = dtr__gradof(nd->in[0]), *gw = dtr__gradof(nd->in[1]), *gb = nd->n_in > 2 ? dtr__gradof(nd->in[2]) : NULL;
    cudaStream_t st = dtr__cuda_stream(ctx);
    char *col, *xt;
    if (gb && g.N * HW > 0) {
        dtr__cuda_conv_gb_k<<<(unsigned)g.C, DTR__CUDA_THREADS, 0, st>>>(nd->out->grad, gb, g.N, g.C, HW);
        if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    }
    if ((!gx && !gw) || NP == 0) return DTR_OK;
    /* scratch: the columns, x transposed (O, N P), the product's pointer arrays */
    if (!(col = (char *)dtr__cuda_scratch(ctx, (size_t)(dtr__cuda_align256(cols * 4) + dtr__cuda_align256(g.O * NP * 4) +
                                                        3 * g.G * g.N * (int64_t)sizeof(void *)))))
        return ctx->status;
    xt = col + dtr__cuda_align256(cols * 4);
    dtr__cuda_mem colm = {col, (int)DTR_F32}, xtm = {xt, (int)DTR_F32};
    dtr__cuda_mem dy = {nd->out->grad, (int)DTR_F32};
    dtr__cuda_im2col_k<<<dtr__cuda_grid(cols), DTR__CUDA_THREADS, 0, st>>>(dy, colm, g);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    if (gx && dtr__cuda_conv_apply(ctx, &g, &dtr__cuda_conv_f32, dtr__data(nd->in[1]), col, 1.0f, gx,
                                   (void **)(xt + dtr__cuda_align256(g.O * NP * 4))) != DTR_OK)
        return ctx->status;
    if (!gw) return DTR_OK;
    dtr__cuda_conv_gyt_k<<<dtr__cuda_grid(g.O * NP), DTR__CUDA_THREADS, 0, st>>>((const float *)dtr__data(nd->in[0]), xtm, g.N, g.O,
                                                                                g.Ho * g.Wo);
    if (dtr__cuda_launched(ctx, nd) != DTR_OK) return ctx->status;
    return dtr__cuda_conv2d_products(ctx, col, &g, &dtr__cuda_conv_f32, xt, NULL, gw, NULL);
}

/* ---- pooling: one thread per output (forward) or per input element (backward) ---- */

/* y, arg (N*C, Ho, Wo); max keeps the first largest value, and NaN wins (the CPU's rule); x
   and y f32 or 16-bit (the widened values, y rounded once) */
__global__ static void dtr__cuda_pool_fwd_k(int maxp, dtr__cuda_mem X, dtr__cuda_mem Y, int32_t *arg, dtr__cuda_conv g) {
    DTR__CUDA_FOR(t, g.N * g.C * g.Ho * g.Wo) {
        int64_t c = t / (g.Ho * g.Wo), oi = (t / g.Wo) % g.Ho, oj = t % g.Wo;
        int64_t xc = c * g.H * g.W;
        float best = -INFINITY, s = 0.0f;
        int32_t bi = -1;
        for (int64_t a = 0; a < g.KH; a++) {
            int64_t ii = oi * g.SH - g.PH + a;
            if (ii < 0 || ii >= g.H) continue;
            for (int64_t b = 0; b < g.KW; b++) {
                int64_t jj = oj * g.SW - g.PW + b;
                if (jj < 0 || jj >= g.W) continue;
                float v = X.ld(xc + ii * g.W + jj);
                s += v;
                if (dtr__f_max_takes(v, best) || bi < 0) { best = v; bi = (int32_t)(ii * g.W + jj); }
            }
        }
        if (maxp) { Y.st(t, best); arg[t] = bi; }
        else Y.st(t, s / (float)(g.KH * g.KW));
    }
}

/* gx (N*C, H, W) += the gradients of the windows that took each element, in output order */
__global__ static void dtr__cuda_pool_bwd_k(int maxp, const float *G, const int32_t *arg, float *gx, dtr__cuda_conv g) {
    DTR__CUDA_FOR(t, g.N * g.C * g.H * g.W) {
        int64_t c = t / (g.H * g.W), i = (t / g.W) % g.H, j = t % g.W, oi, oj;
        float acc = gx[t];
        for (int64_t a = g.KH - 1; a >= 0; a--) {   /* a descending: oi ascending */
            if (!dtr__cuda_window(i, a, g.SH, g.PH, 1, g.Ho, &oi)) continue;
            for (int64_t b = g.KW - 1; b >= 0; b--) {
                if (!dtr__cuda_window(j, b, g.SW, g.PW, 1, g.Wo, &oj)) continue;
                int64_t o = (c * g.Ho + oi) * g.Wo + oj;
                if (!maxp) acc += G[o] / (float)(g.KH * g.KW);
                else if (arg[o] == (int32_t)(i * g.W + j)) acc += G[o];
            }
        }
        gx[t] = acc;
    }
}

static dtr_result dtr__cuda_pool2d_fwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_conv g = dtr__cuda_conv_of(nd, 1);
    int64_t n = dtr_tensor_numel(nd->out);
    int maxp = nd->op == DTR_OP_MAXPOOL2D;
    if (maxp) {   /* argmax of each window, for backward */
        nd->saved = dtr__node_save(ctx, nd, (size_t)(n ? n : 1) * sizeof(int32_t));
        if (!nd->saved) return ctx->status;
    }
    if (n == 0) return DTR_OK;
    dtr__cuda_pool_fwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        maxp, dtr__cuda_mem_of(nd->in[0]), dtr__cuda_mem_of(nd->out), (int32_t *)nd->saved, g);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_pool2d_bwd(dtr_context *ctx, dtr__node *nd) {
    dtr__cuda_conv g = dtr__cuda_conv_of(nd, 1);
    int64_t n = dtr_tensor_numel(nd->in[0]);
    float *gx = dtr__gradof(nd->in[0]);
    if (!gx || n == 0) return DTR_OK;
    dtr__cuda_pool_bwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        nd->op == DTR_OP_MAXPOOL2D, nd->out->grad, (const int32_t *)nd->saved, gx, g);
    return dtr__cuda_launched(ctx, nd);
}

/* ---- nearest-neighbour upsampling: x (N C, H, W) -> y (N C, H sh, W sw) ---- */

__global__ static void dtr__cuda_upsample_fwd_k(dtr__cuda_mem x, dtr__cuda_mem y, int64_t H, int64_t W, int64_t sh, int64_t sw,
                                                int64_t n) {
    DTR__CUDA_FOR(t, n) {   /* t over y */
        int64_t Wo = W * sw, p = t / (H * sh * Wo), r = t % (H * sh * Wo);
        y.st(t, x.ld((p * H + r / Wo / sh) * W + (r % Wo) / sw));
    }
}

/* one thread per input element: its block's sum in the CPU's order (rows, then columns) */
__global__ static void dtr__cuda_upsample_bwd_k(const float *gy, float *gx, int64_t H, int64_t W, int64_t sh, int64_t sw, int64_t n) {
    DTR__CUDA_FOR(t, n) {   /* t over x */
        int64_t p = t / (H * W), i = t % (H * W) / W, j = t % W, Wo = W * sw;
        const float *blk = gy + p * H * sh * Wo + (i * sh) * Wo + j * sw;
        float acc = gx[t];
        for (int64_t a = 0; a < sh; a++)
            for (int64_t c = 0; c < sw; c++) acc += blk[a * Wo + c];
        gx[t] = acc;
    }
}

static dtr_result dtr__cuda_upsample_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(nd->out);
    if (n == 0) return DTR_OK;
    dtr__cuda_upsample_fwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        dtr__cuda_mem_of(x), dtr__cuda_mem_of(nd->out), x->shape[2], x->shape[3], nd->p.upsample.scale[0], nd->p.upsample.scale[1], n);
    return dtr__cuda_launched(ctx, nd);
}

static dtr_result dtr__cuda_upsample_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    int64_t n = dtr_tensor_numel(x);
    float *gx = dtr__gradof(x);
    if (!gx || n == 0) return DTR_OK;
    dtr__cuda_upsample_bwd_k<<<dtr__cuda_grid(n), DTR__CUDA_THREADS, 0, dtr__cuda_stream(ctx)>>>(
        nd->out->grad, gx, x->shape[2], x->shape[3], nd->p.upsample.scale[0], nd->p.upsample.scale[1], n);
    return dtr__cuda_launched(ctx, nd);
}
