/* ============================================================================
 * Generation: the key/value cache of the attention layers, and the token sampler.
 * A cache holds, per layer, keys and values (B, capacity, width) in the backend's memory
 * (zeroed, so rows never written are finite) and the positions written so far. Appending copies
 * the step's k and v rows after them (row copies queued like any op, not recorded: a cache is
 * for inference, and refuses a context that records gradients); the layer's attention then runs
 * causal over the whole cache with q_start at the first new position, so it reads the keys
 * written and no others.
 * The sampler reads the last row of logits to the host and picks one token per item: greedy,
 * or from softmax(logits / temperature) cut to the top k (by selection) and the top p of the
 * mass (sorting only the tokens that can be in it): no full sort of the vocabulary.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"

struct dtr_kv_cache {
    dtr_context *ctx;
    int layers;
    int64_t batch, capacity, width;
    dtr_dtype dtype;
    void *mem;            /* the backend's: layers x (keys, values), each (B, capacity, width) */
    dtr_tensor *t;        /* 2 x layers: layer l's keys at 2 l, its values at 2 l + 1 */
    int64_t *len;         /* positions written, per layer */
};

/* the 2 x layers tensors over c->mem, `each` bytes apart: leaves of no tape, so they outlive
   dtr_context_reset */
static void dtr__kv_tensors(dtr_kv_cache *c, size_t each) {
    int i;
    for (i = 0; i < 2 * c->layers; i++) {
        dtr_tensor *t = &c->t[i];
        t->dtype = c->dtype, t->ndim = 3;
        t->shape[0] = c->batch, t->shape[1] = c->capacity, t->shape[2] = c->width;
        dtr__contig_strides(3, t->shape, t->stride);
        t->storage = (char *)c->mem + (size_t)i * each;
        t->ctx = c->ctx, t->flags = DTR__LEAF, t->param_index = -1, t->name = "";
    }
}

dtr_result dtr_kv_cache_create(dtr_context *ctx, int layers, int64_t batch, int64_t capacity, int64_t width, dtr_kv_cache **out) {
    dtr_kv_cache *c;
    size_t each;
    if (!ctx || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (layers <= 0 || batch <= 0 || capacity <= 0 || width <= 0 || batch * capacity > ((int64_t)1 << 40) / width)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_kv_cache_create: layers %d, batch %lld, capacity %lld and width %lld "
                         "must be > 0 (and their product not huge)", layers, (long long)batch, (long long)capacity, (long long)width);
    c = (dtr_kv_cache *)dtr__calloc(&ctx->alloc, sizeof *c);
    if (!c) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_kv_cache_create: out of memory");
    c->ctx = ctx, c->layers = layers, c->batch = batch, c->capacity = capacity, c->width = width;
    c->dtype = dtr__act_dtype(ctx);
    each = (size_t)(batch * capacity * width) * dtr_dtype_size(c->dtype);
    c->t = (dtr_tensor *)dtr__calloc(&ctx->alloc, 2 * (size_t)layers * sizeof(dtr_tensor));
    c->len = (int64_t *)dtr__calloc(&ctx->alloc, (size_t)layers * sizeof(int64_t));
    c->mem = c->t && c->len ? dtr__mem_alloc_on(ctx, 1, 2 * (size_t)layers * each) : NULL;
    if (!c->mem) {
        dtr_kv_cache_destroy(c);
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_kv_cache_create: out of memory for %d layers of 2 x (%lld, %lld, %lld)", layers,
                         (long long)batch, (long long)capacity, (long long)width);
    }
    dtr__kv_tensors(c, each);
    *out = c;
    return DTR_OK;
}

void dtr_kv_cache_destroy(dtr_kv_cache *c) {
    if (!c) return;
    if (c->mem) dtr__mem_free_on(c->ctx, 1, c->mem);
    dtr__free(&c->ctx->alloc, c->t);
    dtr__free(&c->ctx->alloc, c->len);
    dtr__free(&c->ctx->alloc, c);
}

void dtr_kv_cache_reset(dtr_kv_cache *c) {
    if (c) memset(c->len, 0, (size_t)c->layers * sizeof(int64_t));
}

int64_t dtr_kv_cache_length(const dtr_kv_cache *c, int layer) {
    return c && layer >= 0 && layer < c->layers ? c->len[layer] : 0;
}

/* x (B, T, width) into rows start.. of the cache tensor dst (B, capacity, width): B blocks of T
   rows, each row x's dense one (stride 1 along width; other views are copied dense first) */
static dtr_result dtr__kv_write(dtr_context *ctx, dtr_tensor *dst, int64_t start, dtr_tensor *x) {
    size_t es = dtr_dtype_size(dst->dtype), row = (size_t)dst->shape[2] * es;
    dtr_result r = DTR_OK;
    int64_t b;
    if (x->stride[2] != 1 && x->shape[2] > 1 && !(x = dtr_contiguous(ctx, x))) return ctx->status;
    for (b = 0; b < x->shape[0] && r == DTR_OK; b++)
        r = dtr__mem_copy2d(ctx, (char *)dst->storage + (size_t)((b * dst->shape[1] + start) * dst->shape[2]) * es, row,
                            (const char *)x->storage + (size_t)(x->offset + b * x->stride[0]) * es, (size_t)x->stride[1] * es, row,
                            (size_t)x->shape[1]);
    return r;
}

/* DTR_OK when k and v (B, T, width) fit after layer's rows (the error set otherwise) */
static dtr_result dtr__kv_check(dtr_kv_cache *c, int layer, const dtr_tensor *k, const dtr_tensor *v) {
    dtr_context *ctx = c->ctx;
    char s1[96], s2[96];
    if (layer < 0 || layer >= c->layers)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_kv_cache_append: layer %d outside 0..%d", layer, c->layers - 1);
    if (ctx->grad_enabled || ctx->capturing)
        return dtr__fail(ctx, DTR_BAD_STATE, "dtr_kv_cache_append: a cache is for inference: %s",
                         ctx->capturing ? "not inside a captured step (its position changes every call)"
                                        : "turn gradients off first (dtr_context_set_grad_enabled(ctx, 0))");
    if (!dtr__check_input(ctx, "dtr_kv_cache_append", k, "k") || !dtr__check_input(ctx, "dtr_kv_cache_append", v, "v"))
        return ctx->status;
    if (k->ndim != 3 || memcmp(k->shape, v->shape, sizeof k->shape) || k->shape[0] != c->batch || k->shape[2] != c->width)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_kv_cache_append: k %s and v %s must both be (%lld, T, %lld)",
                         dtr__shape_str(k, s1, sizeof s1), dtr__shape_str(v, s2, sizeof s2), (long long)c->batch, (long long)c->width);
    if (k->dtype != c->dtype || v->dtype != c->dtype)
        return dtr__fail(ctx, DTR_DTYPE_MISMATCH, "dtr_kv_cache_append: k %s and v %s into a cache of %s (the context's activations "
                         "when it was made)", dtr_dtype_name(k->dtype), dtr_dtype_name(v->dtype), dtr_dtype_name(c->dtype));
    if (k->shape[1] > c->capacity - c->len[layer])
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_kv_cache_append: layer %d holds %lld of %lld positions: %lld more do not "
                         "fit (dtr_kv_cache_reset, or a larger cache)", layer, (long long)c->len[layer], (long long)c->capacity,
                         (long long)k->shape[1]);
    return DTR_OK;
}

dtr_result dtr_kv_cache_append(dtr_kv_cache *c, int layer, dtr_tensor *k, dtr_tensor *v, dtr_tensor **keys, dtr_tensor **values) {
    dtr_context *ctx;
    dtr_result r;
    if (!c || !k || !v || !keys || !values) return DTR_NULL_HANDLE;
    ctx = c->ctx;
    *keys = *values = NULL;
    if (ctx->status != DTR_OK) return ctx->status;
    if ((r = dtr__kv_check(c, layer, k, v)) != DTR_OK) return r;
    if ((r = dtr__kv_write(ctx, &c->t[2 * layer], c->len[layer], k)) != DTR_OK ||
        (r = dtr__kv_write(ctx, &c->t[2 * layer + 1], c->len[layer], v)) != DTR_OK)
        return ctx->status != DTR_OK ? ctx->status : dtr__fail(ctx, r, "dtr_kv_cache_append: the copy failed");
    c->len[layer] += k->shape[1];
    *keys = &c->t[2 * layer];
    *values = &c->t[2 * layer + 1];
    return DTR_OK;
}

dtr_tensor *dtr__kv_attention(dtr_context *ctx, dtr_kv_cache *c, int layer, dtr_tensor *q, dtr_tensor *k, dtr_tensor *v,
                              dtr_attention_config *cfg) {
    dtr_tensor *keys, *values;
    if (!c) return dtr_attention_ex(ctx, q, k, v, cfg);
    if (!q || !k || !v) return NULL;   /* (the error of the op that made them is set) */
    if (!cfg->causal)
        return dtr__failt(ctx, DTR_UNSUPPORTED, "dtr_kv_cache: an attention that is not causal (an encoder's) has no cache");
    cfg->q_start = dtr_kv_cache_length(c, layer);
    cfg->dropout = 0.0f;   /* a cache is for generating: no dropout (the layers leave out their output's too) */
    if (dtr_kv_cache_append(c, layer, k, v, &keys, &values) != DTR_OK) return NULL;
    return dtr_attention_ex(ctx, q, keys, values, cfg);
}

/* ---- sampling ---- */

dtr_sample_config dtr_sample_config_init(void) {
    dtr_sample_config c;
    memset(&c, 0, sizeof c);
    c.temperature = 1.0f;
    c.top_p = 1.0f;
    return c;
}

typedef struct dtr__cand {
    float logit;
    int32_t token;
} dtr__cand;

/* the larger logit first, then the smaller token: one order on every platform */
static int dtr__cand_cmp(const void *x, const void *y) {
    const dtr__cand *a = (const dtr__cand *)x, *b = (const dtr__cand *)y;
    if (a->logit != b->logit) return a->logit > b->logit ? -1 : 1;
    return a->token < b->token ? -1 : a->token > b->token;
}

/* a uniform double in [0, 1) from the app's state (splitmix64) */
static double dtr__sample_uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (double)((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0);
}

/* moves the top candidates (dtr__cand_cmp's order) to k[0 .. top - 1] by selection, then those
   whose logit equals the top-th's after them; their count */
static int64_t dtr__sample_top_k(dtr__cand *k, int64_t n, int64_t top) {
    int64_t lo = 0, hi = n - 1, i, keep;
    dtr__cand t;
    while (lo < hi) {   /* Hoare partitions until k[top - 1] is in its sorted place */
        dtr__cand p = k[lo + (hi - lo) / 2];
        int64_t a = lo, b = hi;
        while (a <= b) {
            while (dtr__cand_cmp(&k[a], &p) < 0) a++;
            while (dtr__cand_cmp(&k[b], &p) > 0) b--;
            if (a <= b) t = k[a], k[a] = k[b], k[b] = t, a++, b--;
        }
        if (top - 1 <= b) hi = b;
        else if (top - 1 >= a) lo = a;
        else break;
    }
    for (keep = top, i = top; i < n; i++)
        if (k[i].logit == k[top - 1].logit) t = k[keep], k[keep++] = k[i], k[i] = t;
    return keep;
}

/* The candidates cut to top_k (with ties) and the top_p of the mass: their count, their weights
   exp((logit - mx) / temperature) in w (in k's order) and their sum in *sum. Only top_p needs
   an order: the candidates that can be in its nucleus (a weight over sum (1 - top_p) / count:
   the tokens from one on hold more than 1 - top_p of the mass) are sorted, a few as a rule. */
static int64_t dtr__sample_keep(const dtr_sample_config *cfg, dtr__cand *k, int64_t n, float mx, double *w, double *sum) {
    int64_t i, live = 0, keep = cfg->top_k > 0 && cfg->top_k < n ? dtr__sample_top_k(k, n, cfg->top_k) : n;
    double s = 0.0, acc = 0.0, cut;
    for (i = 0; i < keep; i++) s += w[i] = exp(((double)k[i].logit - mx) / cfg->temperature);
    *sum = s;
    if (cfg->top_p >= 1.0f) return keep;
    cut = s * (1.0 - cfg->top_p) / (double)keep * (1.0 - 1e-9);   /* (under the sums' rounding) */
    for (i = 0; i < keep; i++)
        if (w[i] > cut) k[live++] = k[i];
    qsort(k, (size_t)live, sizeof *k, dtr__cand_cmp);
    for (i = 0; i < live && acc < cfg->top_p * s; i++) acc += w[i] = exp(((double)k[i].logit - mx) / cfg->temperature);
    *sum = acc;
    return i;
}

/* one token of a row of V logits; -1 when none is finite */
static int32_t dtr__sample_row(const dtr_sample_config *cfg, const float *row, int64_t V, dtr__cand *k, double *w, uint64_t *rng) {
    int64_t i, n = 0, best = -1, keep;
    double sum, u;
    for (i = 0; i < V; i++) {
        if (!isfinite(row[i])) continue;
        if (best < 0 || row[i] > row[best]) best = i;
        k[n].logit = row[i], k[n].token = (int32_t)i, n++;
    }
    if (best < 0 || cfg->temperature == 0.0f) return (int32_t)best;
    keep = dtr__sample_keep(cfg, k, n, row[best], w, &sum);
    u = dtr__sample_uniform(rng) * sum;
    for (i = 0; i + 1 < keep && u >= w[i]; i++) u -= w[i];
    return k[i].token;
}

static dtr_result dtr__sample_check(dtr_context *ctx, const dtr_tensor *logits, const dtr_sample_config *cfg) {
    char s1[96];
    if (logits->ndim != 2 && logits->ndim != 3)
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_sample: logits %s must be (B, V) or (B, T, V)",
                         dtr__shape_str(logits, s1, sizeof s1));
    if (!(cfg->temperature >= 0.0f) || !isfinite(cfg->temperature) || cfg->top_k < 0 || !(cfg->top_p > 0.0f && cfg->top_p <= 1.0f))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_sample: temperature %g (>= 0), top_k %d (>= 0), top_p %g (in (0, 1])",
                         (double)cfg->temperature, cfg->top_k, (double)cfg->top_p);
    return DTR_OK;
}

dtr_result dtr_sample(dtr_context *ctx, dtr_tensor *logits, const dtr_sample_config *cfg, uint64_t *rng, int32_t *tokens) {
    int64_t B, V, b;
    dtr_tensor *last;
    float *rows;
    dtr__cand *k;
    double *w;
    dtr_result r;
    if (!ctx || !logits || !cfg || !rng || !tokens) return DTR_NULL_HANDLE;
    if (ctx->status != DTR_OK) return ctx->status;
    if ((r = dtr__sample_check(ctx, logits, cfg)) != DTR_OK) return r;
    B = logits->shape[0], V = logits->shape[logits->ndim - 1];
    last = logits->ndim == 3 ? dtr_slice(ctx, logits, 1, logits->shape[1] - 1, logits->shape[1]) : logits;   /* (B, 1, V) */
    if (!last) return ctx->status;
    rows = (float *)dtr__malloc(&ctx->alloc, (size_t)(B * V + 1) * sizeof(float));
    k = (dtr__cand *)dtr__malloc(&ctx->alloc, (size_t)(V + 1) * sizeof(dtr__cand));
    w = (double *)dtr__malloc(&ctx->alloc, (size_t)(V + 1) * sizeof(double));
    r = !rows || !k || !w ? dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_sample: out of memory") : dtr_tensor_read(last, DTR_F32, rows, (size_t)(B * V));
    for (b = 0; r == DTR_OK && b < B; b++)
        if ((tokens[b] = dtr__sample_row(cfg, rows + b * V, V, k, w, rng)) < 0)
            r = dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_sample: row %lld has no finite logit", (long long)b);
    dtr__free(&ctx->alloc, rows);
    dtr__free(&ctx->alloc, k);
    dtr__free(&ctx->alloc, w);
    return r;
}
