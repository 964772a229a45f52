/* ============================================================================
 * The backend's non-op slots on the GPU: the fused optimizer update over the model's
 * contiguous buffers (SGD, Adam, AdamW, LAMB, with the element formulas the CPU uses),
 * sum of squares (gradient clipping), scale, the element-wise reduction the collectives
 * apply to received buffers, and gradient compression's int8, top-k and PowerSGD work. Sums are two-pass trees in double with a fixed shape, so a run
 * repeats bit for bit on one GPU.
 * ==========================================================================*/

/* ---- deterministic sums ---- */

__device__ static double dtr__cuda_term(int kind, dtr__cuda_mem a, dtr__cuda_mem b, int64_t i) {
    double v = a.ld(i);
    if (kind == DTR__CUDA_SUM_SQDIFF) v -= b.ld(i);
    return kind == DTR__CUDA_SUM_PLAIN ? v : v * v;
}

/* pass 1: block k sums its grid-stride share into partial[k] */
__global__ static void dtr__cuda_sum_k(int kind, dtr__cuda_mem a, dtr__cuda_mem b, int64_t n, double *partial) {
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

static dtr_result dtr__cuda_sum(dtr_context *ctx, int kind, dtr__cuda_mem a, dtr__cuda_mem b, int64_t n, double *out) {
    unsigned blocks = dtr__launch_blocks(n, DTR__CUDA_THREADS, DTR__CUDA_MAX_PARTIALS);
    cudaStream_t st = dtr__cuda_stream(ctx);
    dtr__cuda_sum_k<<<blocks, DTR__CUDA_THREADS, 0, st>>>(kind, a, b, n, out);
    dtr__cuda_sum_partials_k<<<1, 1024, 0, st>>>(out, (int)blocks);
    return dtr__cuda_check(ctx, cudaGetLastError(), "sum kernel");
}

static dtr_result dtr__cuda_sumsq(dtr_context *ctx, const float *x, int64_t n, double *out) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    if (n <= 0) { *out = 0.0; return DTR_OK; }
    dtr__cuda_mem xm = {(void *)x, DTR_F32}, none = {NULL, DTR_F32};
    if (dtr__cuda_sum(ctx, DTR__CUDA_SUM_SQ, xm, none, n, s->partial) != DTR_OK) return ctx->status;
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

/* RMSprop and Adagrad: m the square average (the sum), v the momentum buffer or NULL */
__global__ static void dtr__cuda_rmsprop_k(float *p, const float *g, float *m, float *v, int64_t b, int64_t n, dtr__opt_k k) {
    DTR__CUDA_FOR(t, n - b) {
        int64_t i = b + t;
        dtr__f_rmsprop(&p[i], &m[i], v ? &v[i] : NULL, g[i], &k, v != NULL);
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
    case DTR_OPT_RMSPROP:
    case DTR_OPT_ADAGRAD:
        dtr__cuda_rmsprop_k<<<dtr__cuda_grid(a->n - a->begin), DTR__CUDA_THREADS, 0, st>>>(a->param, a->grad, a->m, a->v, a->begin,
                                                                                          a->n, k);
        break;
    case DTR_OPT_LAMB: return dtr__cuda_lamb(ctx, a, &k);
    default: return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "cuda: unknown optimizer kind %d", a->kind);
    }
    return dtr__cuda_check(ctx, cudaGetLastError(), "optimizer kernel");
}

/* ---- gradient compression's int8 and top-k codecs (dtr_backend.codec, dtr__codec_args; the
   engine: src/engine/compress.c). The CPU's arithmetic element by element, each rounding
   explicit (no contraction into FMAs), so a decoded bucket has the CPU's bits on every rank.
   Top-k selects as the CPU does: a radix select of the k-th largest magnitude on the bit
   patterns (11 + 11 + 10 bits, histograms in shared memory), then every entry above it and
   the first ties, written in index order (each block a contiguous chunk, scanned in tiles) ---- */

#define DTR__CUDA_TOPK_BINS 2048

/* top-k's state on the device (the codec's scratch) */
typedef struct dtr__cuda_topk {
    unsigned long long hist[DTR__CUDA_TOPK_BINS];
    unsigned int prefix, mask;     /* the k-th largest's bits found so far */
    long long k;                   /* its rank among the entries sharing the prefix */
    long long quota, taken;        /* ties to take (k - entries above); entries taken */
    long long blk[4 * DTR__CUDA_MAX_PARTIALS];   /* per block: above, ties, ties before, taken before */
} dtr__cuda_topk;

/* int8 pass 1: block b's largest |g| (NaN skipped) into partial[b] */
__global__ static void dtr__cuda_absmax_k(const float *g, int64_t n, double *partial) {
    float m = 0.0f;
    DTR__CUDA_FOR(i, n) {
        float a = fabsf(g[i]);
        m = a > m ? a : m;
    }
    m = dtr__cuda_block_max(m);
    if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

/* int8 pass 2: one block, the partials' largest; scale = max / 127 into the payload */
__global__ static void dtr__cuda_int8_scale_k(const double *partial, int count, unsigned char *out) {
    float m = 0.0f;
    for (int b = threadIdx.x; b < count; b += blockDim.x) m = (float)partial[b] > m ? (float)partial[b] : m;
    m = dtr__cuda_block_max(m);
    if (threadIdx.x == 0) *(float *)out = __fdiv_rn(m, 127.0f);
}

/* int8 pass 3: each entry's code and residual */
__global__ static void dtr__cuda_int8_encode_k(const float *g, int64_t n, unsigned char *out, float *resid) {
    int8_t *q = (int8_t *)(out + sizeof(float));
    float scale = *(const float *)out;
    DTR__CUDA_FOR(i, n) {
        float x = g[i], v = scale > 0.0f ? __fdiv_rn(x, scale) : 0.0f;
        v = __fsub_rn(__fadd_rn(v, 12582912.0f), 12582912.0f);   /* to nearest even, as the CPU */
        int8_t c = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v == v ? v : 0.0f);
        q[i] = c;
        if (resid) resid[i] = scale > 0.0f ? __fsub_rn(x, __fmul_rn((float)c, scale)) : x;
    }
}

/* int8 decode: g = (sum over the ranks' payloads, in rank order) / world */
__global__ static void dtr__cuda_int8_decode_k(float *g, int64_t n, const unsigned char *p, size_t bytes, int world) {
    DTR__CUDA_FOR(i, n) {
        float s = 0.0f;
        for (int r = 0; r < world; r++) {
            const unsigned char *pr = p + (size_t)r * bytes;
            s = __fadd_rn(s, __fmul_rn(*(const float *)pr, (float)((const int8_t *)(pr + sizeof(float)))[i]));
        }
        g[i] = __fdiv_rn(s, (float)world);
    }
}

/* top-k decode, one rank's payload: g[idx[j]] += val[j] (the indices ascend, so they differ,
   but for the zero padding at the end, which the CPU adds to g[0] after the rest: thread 0
   does that once) */
__global__ static void dtr__cuda_topk_add_k(float *g, const unsigned char *p, int64_t k) {
    const int32_t *idx = (const int32_t *)p;
    const float *val = (const float *)(p + (size_t)k * sizeof(int32_t));
    DTR__CUDA_FOR(j, k) {
        if (j > 0 && idx[j] == 0) continue;
        g[idx[j]] = __fadd_rn(g[idx[j]], val[j]);
        if (j == 0 && k > 1 && idx[k - 1] == 0) g[0] = __fadd_rn(g[0], 0.0f);
    }
}

__global__ static void dtr__cuda_div_k(float *g, int64_t n, float d) {
    DTR__CUDA_FOR(i, n) g[i] = __fdiv_rn(g[i], d);
}

/* top-k: the state for a select of the k-th largest (one block) */
__global__ static void dtr__cuda_topk_init_k(dtr__cuda_topk *st, int64_t k) {
    for (int b = threadIdx.x; b < DTR__CUDA_TOPK_BINS; b += blockDim.x) st->hist[b] = 0;
    if (threadIdx.x == 0) st->prefix = st->mask = 0, st->k = k;
}

/* top-k select, one pass: counts the magnitudes' bits [shift, shift + log2 nb) of the entries
   that share the prefix found so far */
__global__ static void dtr__cuda_topk_hist_k(const float *g, int64_t n, dtr__cuda_topk *st, int shift, int nb) {
    __shared__ unsigned int h[DTR__CUDA_TOPK_BINS];
    unsigned int prefix = st->prefix, mask = st->mask;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) h[b] = 0;
    __syncthreads();
    DTR__CUDA_FOR(i, n) {
        unsigned int bits = __float_as_uint(g[i]) & 0x7fffffffu;
        if ((bits & mask) == prefix) atomicAdd(&h[(bits >> shift) & (unsigned)(nb - 1)], 1u);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
        if (h[b]) atomicAdd(&st->hist[b], (unsigned long long)h[b]);
}

/* the bin holding the k-th largest: its bits join the prefix (one thread, as the CPU), the
   histogram cleared for the next pass (the block) */
__global__ static void dtr__cuda_topk_pick_k(dtr__cuda_topk *st, int shift, int nb) {
    if (threadIdx.x == 0) {
        long long k = st->k;
        int bin;
        for (bin = nb - 1; bin > 0 && (long long)st->hist[bin] < k; bin--) k -= (long long)st->hist[bin];
        st->k = k;
        st->prefix |= (unsigned)bin << shift;
        st->mask |= (unsigned)(nb - 1) << shift;
    }
    __syncthreads();
    for (int b = threadIdx.x; b < DTR__CUDA_TOPK_BINS; b += blockDim.x) st->hist[b] = 0;
}

/* per block (a contiguous chunk): the entries above the threshold, and those equal to it */
__global__ static void dtr__cuda_topk_count_k(const float *g, int64_t n, int64_t chunk, dtr__cuda_topk *st) {
    float thr = __uint_as_float(st->prefix);
    int64_t lo = (int64_t)blockIdx.x * chunk, hi = lo + chunk < n ? lo + chunk : n;
    double above = 0.0, ties = 0.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float a = fabsf(g[i]);
        above += a > thr;
        ties += a == thr;
    }
    above = dtr__cuda_block_sum(above);
    ties = dtr__cuda_block_sum(ties);
    if (threadIdx.x == 0) st->blk[blockIdx.x] = (long long)above, st->blk[gridDim.x + blockIdx.x] = (long long)ties;
}

/* the ties to take (the first k - above), and where each block's ties and entries start */
__global__ static void dtr__cuda_topk_plan_k(dtr__cuda_topk *st, int blocks, int64_t k) {
    long long above = 0, tb = 0, tk = 0;
    if (threadIdx.x || blockIdx.x) return;
    for (int b = 0; b < blocks; b++) above += st->blk[b];
    st->quota = k - above;
    for (int b = 0; b < blocks; b++) {
        long long ties = st->blk[blocks + b], left = st->quota - tb;
        st->blk[2 * blocks + b] = tb, st->blk[3 * blocks + b] = tk;
        tk += st->blk[b] + (left < 0 ? 0 : left < ties ? left : ties);
        tb += ties;
    }
    st->taken = tk;
}

/* the block's flags before this thread's (blockDim.x a multiple of 32, every thread calling),
   and in *total all of them */
__device__ static int dtr__cuda_block_count_before(int flag, int *total) {
    __shared__ int warp_n[32];
    unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5, bal;
    int before = 0, all = 0;
    bal = __ballot_sync(0xffffffffu, flag);
    __syncthreads();   /* the previous call's reads of warp_n are done */
    if (lane == 0) warp_n[warp] = __popc(bal);
    __syncthreads();
    for (unsigned w = 0; w < nw; w++) before += w < warp ? warp_n[w] : 0, all += warp_n[w];
    *total = all;
    return before + __popc(bal & ((1u << lane) - 1u));
}

/* the payload: the block's chosen entries in index order from its start; the residual */
__global__ static void dtr__cuda_topk_write_k(const float *g, int64_t n, int64_t chunk, const dtr__cuda_topk *st, int64_t k,
                                              unsigned char *out, float *resid) {
    int32_t *idx = (int32_t *)out;
    float *val = (float *)(out + (size_t)k * sizeof(int32_t)), thr = __uint_as_float(st->prefix);
    int64_t lo = (int64_t)blockIdx.x * chunk, hi = lo + chunk < n ? lo + chunk : n;
    long long tie_at = st->blk[2 * gridDim.x + blockIdx.x], pos = st->blk[3 * gridDim.x + blockIdx.x];
    for (int64_t base = lo; base < hi; base += blockDim.x) {
        int64_t i = base + threadIdx.x;
        float v = i < hi ? g[i] : 0.0f;
        int tie = i < hi && fabsf(v) == thr, ties, taken;
        int tie_rank = dtr__cuda_block_count_before(tie, &ties);
        int take = (i < hi && fabsf(v) > thr) || (tie && tie_at + tie_rank < st->quota);
        int at = dtr__cuda_block_count_before(take, &taken);
        if (take) idx[pos + at] = (int32_t)i, val[pos + at] = v;
        if (i < hi && resid) resid[i] = take ? 0.0f : v;
        tie_at += ties, pos += taken;
    }
}

/* the slots past the entries taken (NaN magnitudes compare with nothing): index 0, value 0 */
__global__ static void dtr__cuda_topk_pad_k(const dtr__cuda_topk *st, int64_t k, unsigned char *out) {
    DTR__CUDA_FOR(j, k)
        if (j >= st->taken) ((int32_t *)out)[j] = 0, ((float *)(out + (size_t)k * sizeof(int32_t)))[j] = 0.0f;
}

static dtr_result dtr__cuda_topk_encode(dtr_context *ctx, const dtr__codec_args *a) {
    static const int shift[3] = {21, 10, 0};
    cudaStream_t st = dtr__cuda_stream(ctx);
    unsigned blocks = dtr__launch_blocks(a->n, DTR__CUDA_THREADS, DTR__CUDA_MAX_PARTIALS);
    int64_t chunk = (a->n + blocks - 1) / blocks;
    dtr__cuda_topk *s = (dtr__cuda_topk *)dtr__cuda_scratch(ctx, sizeof(dtr__cuda_topk));
    if (!s) return ctx->status;
    dtr__cuda_topk_init_k<<<1, DTR__CUDA_THREADS, 0, st>>>(s, a->k);
    for (int p = 0; p < 3; p++) {
        dtr__cuda_topk_hist_k<<<blocks, DTR__CUDA_THREADS, 0, st>>>(a->g, a->n, s, shift[p], p == 2 ? 1024 : 2048);
        dtr__cuda_topk_pick_k<<<1, DTR__CUDA_THREADS, 0, st>>>(s, shift[p], p == 2 ? 1024 : 2048);
    }
    dtr__cuda_topk_count_k<<<blocks, DTR__CUDA_THREADS, 0, st>>>(a->g, a->n, chunk, s);
    dtr__cuda_topk_plan_k<<<1, 1, 0, st>>>(s, (int)blocks, a->k);
    dtr__cuda_topk_write_k<<<blocks, DTR__CUDA_THREADS, 0, st>>>(a->g, a->n, chunk, s, a->k, a->payload, a->resid);
    dtr__cuda_topk_pad_k<<<dtr__cuda_grid(a->k), DTR__CUDA_THREADS, 0, st>>>(s, a->k, a->payload);
    return dtr__cuda_check(ctx, cudaGetLastError(), "top-k codec");
}

static dtr_result dtr__cuda_codec(dtr_context *ctx, const dtr__codec_args *a, int decode) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    cudaStream_t st = s->stream;
    unsigned blocks = dtr__launch_blocks(a->n, DTR__CUDA_THREADS, DTR__CUDA_MAX_PARTIALS);
    if (a->n <= 0) return DTR_OK;
    if (!decode && a->kind == DTR_COMPRESS_TOPK) return dtr__cuda_topk_encode(ctx, a);
    if (!decode) {
        dtr__cuda_absmax_k<<<blocks, DTR__CUDA_THREADS, 0, st>>>(a->g, a->n, s->partial);
        dtr__cuda_int8_scale_k<<<1, 1024, 0, st>>>(s->partial, (int)blocks, a->payload);
        dtr__cuda_int8_encode_k<<<dtr__cuda_grid(a->n), DTR__CUDA_THREADS, 0, st>>>(a->g, a->n, a->payload, a->resid);
    } else if (a->kind == DTR_COMPRESS_INT8) {
        dtr__cuda_int8_decode_k<<<dtr__cuda_grid(a->n), DTR__CUDA_THREADS, 0, st>>>(a->g, a->n, a->payload, a->bytes, a->world);
    } else {
        if (dtr__cuda_check(ctx, cudaMemsetAsync(a->g, 0, (size_t)a->n * sizeof(float), st), "top-k decode") != DTR_OK)
            return ctx->status;
        for (int r = 0; r < a->world; r++)
            dtr__cuda_topk_add_k<<<dtr__cuda_grid(a->k), DTR__CUDA_THREADS, 0, st>>>(a->g, a->payload + (size_t)r * a->bytes, a->k);
        dtr__cuda_div_k<<<dtr__cuda_grid(a->n), DTR__CUDA_THREADS, 0, st>>>(a->g, a->n, (float)a->world);
    }
    return dtr__cuda_check(ctx, cudaGetLastError(), decode ? "codec decode" : "int8 codec");
}

/* ---- PowerSGD's products on one matrix (dtr_backend.powersgd, dtr__psgd_args): cuBLAS on
   the row-major matrices as column-major transposes, the orthonormalisation in one block
   (the CPU's modified Gram-Schmidt, projections twice, sums in double) ---- */

__global__ static void dtr__cuda_orthonormalise_k(float *p, int64_t rows, int r) {
    for (int c = 0; c < r; c++) {
        for (int d = 0; d < 2 * c; d++) {
            double dot = 0.0;
            for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) dot += (double)p[i * r + c] * p[i * r + d % c];
            dot = dtr__cuda_block_sum(dot);
            for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) p[i * r + c] -= (float)dot * p[i * r + d % c];
            __syncthreads();
        }
        double norm = 0.0;
        for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) norm += (double)p[i * r + c] * p[i * r + c];
        norm = sqrt(dtr__cuda_block_sum(norm));
        for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) p[i * r + c] = norm > 1e-30 ? (float)(p[i * r + c] / norm) : 0.0f;
        __syncthreads();
    }
}

__global__ static void dtr__cuda_sub_k(float *y, const float *x, int64_t n) {
    DTR__CUDA_FOR(i, n) y[i] -= x[i];
}

static dtr_result dtr__cuda_powersgd(dtr_context *ctx, const dtr__psgd_args *a, int phase) {
    dtr__cuda_state *s = dtr__cuda(ctx);
    const float one = 1.0f, zero = 0.0f;
    int rows = (int)a->rows, cols = (int)a->cols, r = a->r;
    cublasStatus_t st;
    if (a->rows > INT32_MAX || a->cols > INT32_MAX)
        return dtr__fail(ctx, DTR_UNSUPPORTED, "cuda: PowerSGD on a matrix of %lld x %lld (cuBLAS takes int sizes)",
                         (long long)a->rows, (long long)a->cols);
    if (phase == DTR__PSGD_P)   /* p^T (r, rows) = q^T (r, cols) M^T (cols, rows) */
        st = cublasSgemm(s->blas, CUBLAS_OP_N, CUBLAS_OP_N, r, rows, cols, &one, a->q, r, a->m, cols, &zero, a->p, r);
    else if (phase == DTR__PSGD_Q) {   /* q^T (r, cols) = p^T (r, rows) M (rows, cols) */
        dtr__cuda_orthonormalise_k<<<1, 1024, 0, s->stream>>>(a->p, a->rows, r);
        st = cublasSgemm(s->blas, CUBLAS_OP_N, CUBLAS_OP_T, r, cols, rows, &one, a->p, r, a->m, cols, &zero, a->q, r);
    } else {   /* M^T (cols, rows) = q (cols, r) p^T (r, rows) */
        st = cublasSgemm(s->blas, CUBLAS_OP_T, CUBLAS_OP_N, cols, rows, r, &one, a->q, r, a->p, r, &zero, a->m, cols);
        if (st == CUBLAS_STATUS_SUCCESS && a->resid)
            dtr__cuda_sub_k<<<dtr__cuda_grid(a->rows * a->cols), DTR__CUDA_THREADS, 0, s->stream>>>(a->resid, a->m, a->rows * a->cols);
    }
    if (dtr__cuda_blas(ctx, st, "PowerSGD product") != DTR_OK) return ctx->status;
    return dtr__cuda_check(ctx, cudaGetLastError(), "PowerSGD");
}
