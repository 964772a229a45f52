/* ============================================================================
 * Models: named parameters in one contiguous buffer (gradients in another), seeded
 * initialisers, and save/load in the safetensors layout.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include "../comm/comm_internal.h"
#include <math.h>

#define DTR__PARAM_ALIGN 16 /* floats: each parameter starts on a 64-byte boundary */

struct dtr_model {
    dtr_context *ctx;
    uint64_t seed;
    dtr_tensor **params;
    char **names;
    dtr_init *inits;
    float *init_args;
    int64_t *offsets;
    uint64_t *streams;    /* each parameter's initialiser stream: its declaration number */
    dtr__shard *shards;   /* tensor-parallel shards (comm NULL: a whole tensor) */
    int count, cap;
    dtr_tensor **dropped; /* declared, then left out by dtr_model_keep (no storage) */
    int n_dropped;
    int64_t total;        /* floats in each buffer, padding included */
    int frozen;           /* parameters set not trainable (dtr_model_set_trainable) */
    unsigned trainable_gen;   /* bumped by every change of the trainable set (optimizers lay out their state again) */
    unsigned grad_gen;        /* the trainable set zero_grad last cleared the whole gradient buffer for */
    float *data, *grad;   /* backend memory */
    int built;
    int grad_sharded;           /* ZeRO-3: zero_grad keeps [grad_lo, grad_hi) and discards the rest */
    uint32_t zero_pass;         /* the context's backward pass at the last zero_grad: a parameter whose
                                   gradient a later pass wrote was reached since (dtr__model_unreached) */
    int reached_all;            /* since that zero_grad, every parameter counts as reached (dtr__model_reach_all) */
    int64_t grad_lo, grad_hi;
    /* buffers (dtr_model_buffer): state that is not trained, in a block of their own */
    dtr_tensor **bufs;
    float *buf_values;          /* each buffer's initial value */
    int64_t *buf_offsets;
    int nbuf, bufcap;
    int64_t buf_total;
    float *buf_data;            /* backend memory */
};

dtr_result dtr_model_create(dtr_context *ctx, uint64_t seed, dtr_model **out) {
    dtr_model *m;
    if (!ctx || !out) return DTR_NULL_HANDLE;
    *out = NULL;
    m = (dtr_model *)dtr__calloc(&ctx->alloc, sizeof(*m));
    if (!m) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_create: out of memory");
    m->ctx = ctx;
    m->seed = seed;
    *out = m;
    return DTR_OK;
}

void dtr_model_destroy(dtr_model *m) {
    const dtr_allocation_callbacks *a;
    int i;
    if (!m) return;
    a = &m->ctx->alloc;
    for (i = 0; i < m->count; i++) { dtr__free(a, m->params[i]); dtr__free(a, m->names[i]); }
    for (i = 0; i < m->n_dropped; i++) { dtr__free(a, (void *)m->dropped[i]->name); dtr__free(a, m->dropped[i]); }
    dtr__free(a, m->dropped);
    dtr__free(a, m->streams);
    dtr__free(a, m->shards);
    dtr__free(a, m->params);
    dtr__free(a, m->names);
    dtr__free(a, m->inits);
    dtr__free(a, m->init_args);
    dtr__free(a, m->offsets);
    for (i = 0; i < m->nbuf; i++) { dtr__free(a, (void *)m->bufs[i]->name); dtr__free(a, m->bufs[i]); }
    dtr__free(a, m->bufs);
    dtr__free(a, m->buf_values);
    dtr__free(a, m->buf_offsets);
    if (m->buf_data) m->ctx->backend->mem_free(m->ctx, m->buf_data);
    if (m->data) m->ctx->backend->mem_free(m->ctx, m->data);
    if (m->grad) m->ctx->backend->mem_free(m->ctx, m->grad);
    dtr__free(a, m);
}

/* floats a parameter takes in the buffers: each starts on a 64-byte boundary */
static int64_t dtr__padded(const dtr_tensor *t) {
    return (dtr_tensor_numel(t) + DTR__PARAM_ALIGN - 1) / DTR__PARAM_ALIGN * DTR__PARAM_ALIGN;
}

static int dtr__model_grow(dtr_model *m) {
    const dtr_allocation_callbacks *a = &m->ctx->alloc;
    int cap = m->cap ? m->cap * 2 : 16;
    void *p;
    p = dtr__realloc(a, m->params, (size_t)cap * sizeof(*m->params)); if (!p) return 0; m->params = (dtr_tensor **)p;
    p = dtr__realloc(a, m->names, (size_t)cap * sizeof(*m->names)); if (!p) return 0; m->names = (char **)p;
    p = dtr__realloc(a, m->inits, (size_t)cap * sizeof(*m->inits)); if (!p) return 0; m->inits = (dtr_init *)p;
    p = dtr__realloc(a, m->init_args, (size_t)cap * sizeof(*m->init_args)); if (!p) return 0; m->init_args = (float *)p;
    p = dtr__realloc(a, m->offsets, (size_t)cap * sizeof(*m->offsets)); if (!p) return 0; m->offsets = (int64_t *)p;
    p = dtr__realloc(a, m->streams, (size_t)cap * sizeof(*m->streams)); if (!p) return 0; m->streams = (uint64_t *)p;
    p = dtr__realloc(a, m->shards, (size_t)cap * sizeof(*m->shards)); if (!p) return 0; m->shards = (dtr__shard *)p;
    m->cap = cap;
    return 1;
}

/* 1 when a tensor named `name` of this shape may be declared now; else 0, the error set */
static int dtr__model_declarable(dtr_model *m, const char *fn, const char *name, int ndim, const int64_t *shape) {
    dtr_context *ctx = m->ctx;
    int i;
    if (!name || !*name) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: a tensor of a model needs a name", fn), 0;
    if (strlen(name) >= 256) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: name '%.40s...' is longer than 255 bytes", fn, name), 0;
    if (m->built) return dtr__fail(ctx, DTR_BAD_STATE, "%s: '%s' declared after dtr_model_build", fn, name), 0;
    if (ndim < 0 || ndim > DTR_MAX_DIMS || (ndim && !shape))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: '%s' has a bad shape", fn, name), 0;
    for (i = 0; i < ndim; i++)
        if (shape[i] < 0 || shape[i] > ((int64_t)1 << 32))
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: '%s' dimension %d is %lld", fn, name, i, (long long)shape[i]), 0;
    if (dtr_model_find(m, name)) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: '%s' declared twice", fn, name), 0;
    return 1;
}

/* a model tensor's struct: f32, dense, of the context, named (its own copy of name in *copy) */
static dtr_tensor *dtr__model_tensor(dtr_model *m, const char *name, int ndim, const int64_t *shape, char **copy) {
    dtr_tensor *t = (dtr_tensor *)dtr__calloc(&m->ctx->alloc, sizeof(*t));
    size_t len = strlen(name);
    int i;
    *copy = (char *)dtr__malloc(&m->ctx->alloc, len + 1);
    if (!t || !*copy) {
        dtr__free(&m->ctx->alloc, t);
        dtr__free(&m->ctx->alloc, *copy);
        return NULL;
    }
    memcpy(*copy, name, len + 1);
    t->dtype = DTR_F32;
    t->ndim = ndim;
    for (i = 0; i < ndim; i++) t->shape[i] = shape[i];
    dtr__contig_strides(ndim, shape, t->stride);
    t->ctx = m->ctx;
    t->model = m;
    t->name = *copy;
    return t;
}

dtr_tensor *dtr_model_param(dtr_model *m, const char *name, int ndim, const int64_t *shape, dtr_init init, float arg) {
    dtr_context *ctx;
    dtr_tensor *t;
    if (!m) return NULL;
    ctx = m->ctx;
    if (!dtr__model_declarable(m, "dtr_model_param", name, ndim, shape)) return NULL;
    if ((int)init < 0 || init > DTR_INIT_TORCH_DEFAULT)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_model_param: '%s' has unknown initialiser %d", name, (int)init);
    if (m->count == m->cap && !dtr__model_grow(m)) return dtr__failt(ctx, DTR_OUT_OF_MEMORY, "dtr_model_param: out of memory");
    t = dtr__model_tensor(m, name, ndim, shape, &m->names[m->count]);
    if (!t) return dtr__failt(ctx, DTR_OUT_OF_MEMORY, "dtr_model_param: out of memory");
    t->flags = DTR__PARAM | DTR__REQUIRES_GRAD | DTR__LEAF;
    t->param_index = m->count;
    m->params[m->count] = t;
    m->inits[m->count] = init;
    m->init_args[m->count] = arg;
    m->offsets[m->count] = m->total;
    m->streams[m->count] = (uint64_t)(m->count + m->n_dropped) + 1;
    memset(&m->shards[m->count], 0, sizeof(m->shards[m->count]));
    m->total += dtr__padded(t);
    m->count++;
    return t;
}

/* ---- buffers ---- */

static int dtr__model_grow_bufs(dtr_model *m) {
    const dtr_allocation_callbacks *a = &m->ctx->alloc;
    int cap = m->bufcap ? m->bufcap * 2 : 8;
    void *p;
    p = dtr__realloc(a, m->bufs, (size_t)cap * sizeof(*m->bufs)); if (!p) return 0; m->bufs = (dtr_tensor **)p;
    p = dtr__realloc(a, m->buf_values, (size_t)cap * sizeof(*m->buf_values)); if (!p) return 0; m->buf_values = (float *)p;
    p = dtr__realloc(a, m->buf_offsets, (size_t)cap * sizeof(*m->buf_offsets)); if (!p) return 0; m->buf_offsets = (int64_t *)p;
    m->bufcap = cap;
    return 1;
}

dtr_tensor *dtr_model_buffer(dtr_model *m, const char *name, int ndim, const int64_t *shape, float value) {
    dtr_tensor *t;
    char *copy;
    if (!m) return NULL;
    if (!dtr__model_declarable(m, "dtr_model_buffer", name, ndim, shape)) return NULL;
    if (m->nbuf == m->bufcap && !dtr__model_grow_bufs(m)) return dtr__failt(m->ctx, DTR_OUT_OF_MEMORY, "dtr_model_buffer: out of memory");
    t = dtr__model_tensor(m, name, ndim, shape, &copy);
    if (!t) return dtr__failt(m->ctx, DTR_OUT_OF_MEMORY, "dtr_model_buffer: out of memory");
    t->flags = DTR__LEAF;
    t->param_index = -1;
    m->bufs[m->nbuf] = t;
    m->buf_values[m->nbuf] = value;
    m->buf_offsets[m->nbuf] = m->buf_total;
    m->buf_total += dtr__padded(t);
    m->nbuf++;
    return t;
}

/* the buffers' block, each buffer at its value */
static dtr_result dtr__model_build_bufs(dtr_model *m) {
    dtr_context *ctx = m->ctx;
    size_t bytes = (size_t)(m->buf_total ? m->buf_total : 1) * sizeof(float);
    float *host;
    int i;
    int64_t k;
    if (!m->nbuf) return DTR_OK;
    m->buf_data = (float *)ctx->backend->mem_alloc(ctx, bytes);
    host = (float *)dtr__calloc(&ctx->alloc, bytes);
    if (!m->buf_data || !host) {
        if (m->buf_data) ctx->backend->mem_free(ctx, m->buf_data);
        m->buf_data = NULL;
        dtr__free(&ctx->alloc, host);
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_build: out of memory for %lld buffer elements", (long long)m->buf_total);
    }
    for (i = 0; i < m->nbuf; i++)
        for (k = 0; k < dtr_tensor_numel(m->bufs[i]); k++) host[m->buf_offsets[i] + k] = m->buf_values[i];
    ctx->backend->from_host(ctx, m->buf_data, host, bytes);
    dtr__free(&ctx->alloc, host);
    for (i = 0; i < m->nbuf; i++) m->bufs[i]->storage = m->buf_data + m->buf_offsets[i];
    return DTR_OK;
}

int dtr_model_buffer_count(const dtr_model *m) { return m ? m->nbuf : 0; }

dtr_tensor *dtr_model_buffer_at(const dtr_model *m, int i) { return (m && i >= 0 && i < m->nbuf) ? m->bufs[i] : NULL; }

/* ---- initialisers ---- */

static void dtr__fans(const dtr_tensor *t, double *fan_in, double *fan_out) {
    double rf = 1.0;
    int d;
    for (d = 2; d < t->ndim; d++) rf *= (double)t->shape[d];
    if (t->ndim >= 2) { *fan_in = (double)t->shape[1] * rf; *fan_out = (double)t->shape[0] * rf; }
    else { *fan_in = *fan_out = t->ndim == 1 ? (double)t->shape[0] : 1.0; }
    if (*fan_in < 1.0) *fan_in = 1.0;
    if (*fan_out < 1.0) *fan_out = 1.0;
}

static void dtr__init_values(dtr_init init, float arg, const dtr_tensor *t, dtr_rng *rng, float *x) {
    int64_t i, n = dtr_tensor_numel(t);
    double fi, fo, b = 0.0, sd = 0.0;
    int normal = 0;
    dtr__fans(t, &fi, &fo);
    switch (init) {
    case DTR_INIT_ZEROS: for (i = 0; i < n; i++) x[i] = 0.0f; return;
    case DTR_INIT_ONES: for (i = 0; i < n; i++) x[i] = 1.0f; return;
    case DTR_INIT_NORMAL: normal = 1; sd = arg; break;
    case DTR_INIT_UNIFORM: b = arg; break;
    case DTR_INIT_KAIMING_UNIFORM: b = sqrt(6.0 / fi); break;
    case DTR_INIT_KAIMING_NORMAL: normal = 1; sd = sqrt(2.0 / fi); break;
    case DTR_INIT_XAVIER_UNIFORM: b = sqrt(6.0 / (fi + fo)); break;
    case DTR_INIT_XAVIER_NORMAL: normal = 1; sd = sqrt(2.0 / (fi + fo)); break;
    case DTR_INIT_TORCH_DEFAULT: b = 1.0 / sqrt(fi); break;
    }
    for (i = 0; i < n; i++)
        x[i] = normal ? (float)(sd * dtr_rng_normal(rng)) : (float)(b * (2.0 * dtr_rng_uniform(rng) - 1.0));
}

/* Parameter i's initial values into x: a shard gets its slice of the full tensor, drawn as a
   single-device model would draw it (same stream, fans of the full shape). */
static dtr_result dtr__model_init_param(dtr_model *m, int i, float *x) {
    const dtr__shard *s = &m->shards[i];
    dtr_tensor full;
    float *buf;
    dtr_rng rng;
    dtr_rng_seed(&rng, m->seed, m->streams[i]);
    if (!s->comm) {
        dtr__init_values(m->inits[i], m->init_args[i], m->params[i], &rng, x);
        return DTR_OK;
    }
    memset(&full, 0, sizeof full);
    full.ndim = s->ndim;
    memcpy(full.shape, s->full, sizeof full.shape);
    buf = (float *)dtr__malloc(&m->ctx->alloc, (size_t)dtr__numel(s->ndim, s->full) * sizeof(float) + 1);
    if (!buf) return DTR_OUT_OF_MEMORY;
    dtr__init_values(m->inits[i], m->init_args[i], &full, &rng, buf);
    dtr__shard_copy(s, s->rank, buf, x, 0);
    dtr__free(&m->ctx->alloc, buf);
    return DTR_OK;
}

dtr_result dtr__grad_sumsq_range(dtr_model *m, int64_t b, int64_t e, double *out) {
    dtr_result r = DTR_OK;
    int64_t lo, hi;
    int i = 0;
    *out = 0.0;
    if (!m->frozen || !dtr__host_memory(m->ctx)) return e > b ? m->ctx->backend->sumsq(m->ctx, m->grad + b, e - b, out) : DTR_OK;
    while (r == DTR_OK && dtr__model_next_run(m, &i, &lo, &hi)) {   /* the frozen pages are not even read */
        double x = 0.0;
        lo = lo > b ? lo : b, hi = hi < e ? hi : e;
        if (lo < hi) r = m->ctx->backend->sumsq(m->ctx, m->grad + lo, hi - lo, &x);
        *out += x;
    }
    return r;
}

dtr_result dtr__model_grad_sumsq(dtr_model *m, int64_t b, int64_t e, double *out) {
    dtr_context *ctx = m->ctx;
    dtr_comm *tp = NULL;
    double rep = 0.0, split = 0.0;
    dtr_result r = DTR_OK;
    int i;
    for (i = 0; i < m->count && !tp; i++) tp = m->shards[i].comm;
    *out = 0.0;
    if (!tp || tp->mem_ctx)   /* a group of device memory (NCCL): this rank's own, in this version */
        return dtr__grad_sumsq_range(m, b, e, out);
    for (i = 0; i < m->count && r == DTR_OK; i++) {   /* each parameter's part of [b, e) */
        int64_t lo = m->offsets[i] > b ? m->offsets[i] : b, hi = m->offsets[i] + dtr_tensor_numel(m->params[i]);
        double x = 0.0;
        if (hi > e) hi = e;
        if (lo >= hi || !dtr_model_param_trainable(m, i)) continue;   /* a frozen one's are zeros */
        r = ctx->backend->sumsq(ctx, m->grad + lo, hi - lo, &x);
        if (m->shards[i].comm) split += x;
        else rep += x;
    }
    if (r == DTR_OK) r = dtr__comm_sum_doubles(tp, ctx, &split, 1, "tensor parallel: the gradient norm");
    *out = rep + split;
    return r;
}

dtr_result dtr__model_set_shard(dtr_model *m, dtr_tensor *t, const dtr__shard *s) {
    if (!m || !t || t->model != m || t->param_index < 0) return DTR_NULL_HANDLE;
    if (m->built) return dtr__fail(m->ctx, DTR_BAD_STATE, "'%s': a shard is declared before dtr_model_build", t->name);
    m->shards[t->param_index] = *s;
    return DTR_OK;
}

/* a gradient buffer from mem_reserve: memory of its own under the trainable runs only, so a
   frozen body's gradients take no device memory (and read as zeros) */
static dtr_result dtr__model_back_grads(dtr_model *m) {
    dtr_context *ctx = m->ctx;
    int64_t lo, hi;
    int i = 0, n = 0;
    dtr_result r;
    size_t *runs = (size_t *)dtr__malloc(&ctx->alloc, (size_t)(2 * m->count + 2) * sizeof *runs);
    if (!runs) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model: out of memory backing the gradients");
    while (dtr__model_next_run(m, &i, &lo, &hi)) runs[2 * n] = (size_t)lo * sizeof(float), runs[2 * n + 1] = (size_t)hi * sizeof(float), n++;
    r = ctx->backend->mem_back(ctx, m->grad, runs, n);
    dtr__free(&ctx->alloc, runs);
    return r;
}

/* the new gradient buffer reads zeros: host pages mapped as backward writes them, a buffer
   from mem_reserve backed under the trainable runs, any other one zeroed */
static dtr_result dtr__model_clear_grads(dtr_model *m, size_t bytes) {
    dtr_context *ctx = m->ctx;
    if (dtr__host_memory(ctx)) {
        dtr__mem_discard(&ctx->alloc, m->grad, m->total, 0.0f);
        return DTR_OK;
    }
    if (ctx->backend->mem_reserve) return dtr__model_back_grads(m);
    return ctx->backend->memset0(ctx, m->grad, bytes);
}

dtr_result dtr_model_build(dtr_model *m) {
    dtr_context *ctx;
    size_t bytes;
    float *host;
    int i;
    if (!m) return DTR_NULL_HANDLE;
    if (m->built) return DTR_OK;
    ctx = m->ctx;
    bytes = (size_t)(m->total ? m->total : 1) * sizeof(float);
    m->data = (float *)ctx->backend->mem_alloc(ctx, bytes);
    m->grad = (float *)(ctx->backend->mem_reserve ? ctx->backend->mem_reserve(ctx, bytes) : ctx->backend->mem_alloc(ctx, bytes));
    host = dtr__host_memory(ctx) ? m->data : (float *)dtr__malloc(&ctx->alloc, bytes);
    if (!m->data || !m->grad || !host) {
        if (m->data) ctx->backend->mem_free(ctx, m->data);
        if (m->grad) ctx->backend->mem_free(ctx, m->grad);
        if (host && host != m->data) dtr__free(&ctx->alloc, host);
        m->data = m->grad = NULL;
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_build: out of memory for %lld parameters", (long long)m->total);
    }
    memset(host, 0, bytes);
    for (i = 0; i < m->count; i++)
        if (dtr__model_init_param(m, i, host + m->offsets[i]) != DTR_OK) break;
    if (i < m->count) {
        ctx->backend->mem_free(ctx, m->data);
        ctx->backend->mem_free(ctx, m->grad);
        if (host != m->data) dtr__free(&ctx->alloc, host);
        m->data = m->grad = NULL;
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_build: out of memory for the full tensor of '%s'", m->names[i]);
    }
    if (host != m->data) {
        ctx->backend->from_host(ctx, m->data, host, bytes);
        dtr__free(&ctx->alloc, host);
    }
    for (i = 0; i < m->count; i++) {
        m->params[i]->storage = m->data + m->offsets[i];
        m->params[i]->grad = m->grad + m->offsets[i];
    }
    if (dtr__model_clear_grads(m, bytes) != DTR_OK || dtr__model_build_bufs(m) != DTR_OK) {   /* (the parameters' blocks are freed with the model) */
        for (i = 0; i < m->count; i++) m->params[i]->storage = NULL, m->params[i]->grad = NULL;
        ctx->backend->mem_free(ctx, m->data);
        ctx->backend->mem_free(ctx, m->grad);
        m->data = m->grad = NULL;
        return ctx->status;
    }
    m->built = 1;
    m->zero_pass = m->ctx->backward_pass;
    return DTR_OK;
}

/* ---- keeping a part of a model (a pipeline stage) ---- */

/* 1 when name starts with pattern, a '*' of which matches any run of characters (none too) */
static int dtr__prefix_match(const char *name, const char *pat) {
    for (; *pat && *pat != '*'; pat++, name++)
        if (*name != *pat) return 0;
    if (!*pat) return 1;
    for (pat++;; name++) {   /* the rest of the pattern from each position on */
        if (dtr__prefix_match(name, pat)) return 1;
        if (!*name) return 0;
    }
}

int dtr__name_matches(const char *name, const char *const *prefixes, int n) {
    int k;
    for (k = 0; k < n; k++)
        if (prefixes[k] && dtr__prefix_match(name, prefixes[k])) return 1;
    return 0;
}

/* moves a parameter or buffer to the dropped list (its struct stays valid: layers point at it) */
static int dtr__model_drop(dtr_model *m, dtr_tensor *t) {
    void *p = dtr__realloc(&m->ctx->alloc, m->dropped, (size_t)(m->n_dropped + 1) * sizeof(*m->dropped));
    if (!p) return 0;
    m->dropped = (dtr_tensor **)p;
    m->dropped[m->n_dropped++] = t;
    t->param_index = -1;
    return 1;
}

/* dtr_model_keep's filter over the buffers: those left out move to the dropped list */
static dtr_result dtr__model_keep_bufs(dtr_model *m, const char *const *prefixes, int n) {
    int i, kept = 0;
    m->buf_total = 0;
    for (i = 0; i < m->nbuf; i++) {
        dtr_tensor *t = m->bufs[i];
        if (!dtr__name_matches(t->name, prefixes, n)) {
            if (!dtr__model_drop(m, t)) return dtr__fail(m->ctx, DTR_OUT_OF_MEMORY, "dtr_model_keep: out of memory");
            continue;
        }
        m->bufs[kept] = t, m->buf_values[kept] = m->buf_values[i];
        m->buf_offsets[kept++] = m->buf_total;
        m->buf_total += dtr__padded(t);
    }
    m->nbuf = kept;
    return DTR_OK;
}

dtr_result dtr_model_keep(dtr_model *m, const char *const *prefixes, int n) {
    int i, kept = 0;
    if (!m) return DTR_NULL_HANDLE;
    if (n < 0 || (n && !prefixes)) return dtr__fail(m->ctx, DTR_INVALID_ARGUMENT, "dtr_model_keep: %d prefixes", n);
    if (m->built) return dtr__fail(m->ctx, DTR_BAD_STATE, "dtr_model_keep: the model is built already");
    m->total = 0;
    for (i = 0; i < m->count; i++) {
        dtr_tensor *t = m->params[i];
        if (!dtr__name_matches(t->name, prefixes, n)) {
            if (!dtr__model_drop(m, t)) return dtr__fail(m->ctx, DTR_OUT_OF_MEMORY, "dtr_model_keep: out of memory");
            continue;
        }
        m->params[kept] = t, m->names[kept] = m->names[i], m->inits[kept] = m->inits[i];
        m->init_args[kept] = m->init_args[i], m->streams[kept] = m->streams[i], m->shards[kept] = m->shards[i];
        t->param_index = kept;
        m->offsets[kept++] = m->total;
        m->total += dtr__padded(t);
    }
    m->count = kept;
    return dtr__model_keep_bufs(m, prefixes, n);
}

/* ---- trainable or frozen ---- */

dtr_result dtr_model_set_trainable(dtr_model *m, const char *const *prefixes, int n, int trainable) {
    int i, matched = 0;
    unsigned gen;
    if (!m) return DTR_NULL_HANDLE;
    if (n < 0 || (n && !prefixes)) return dtr__fail(m->ctx, DTR_INVALID_ARGUMENT, "dtr_model_set_trainable: %d prefixes", n);
    gen = m->trainable_gen;
    for (i = 0; i < m->count; i++) {
        dtr_tensor *t = m->params[i];
        int was = (t->flags & DTR__REQUIRES_GRAD) != 0;
        if (n && !dtr__name_matches(t->name, prefixes, n)) continue;
        matched++;
        if (was == !!trainable) continue;
        t->flags = trainable ? t->flags | DTR__REQUIRES_GRAD : t->flags & ~(unsigned)DTR__REQUIRES_GRAD;
        m->frozen += trainable ? -1 : 1;
        m->trainable_gen++;
    }
    if (!matched)
        return dtr__fail(m->ctx, DTR_NOT_FOUND, "dtr_model_set_trainable: no parameter starts with '%s'%s", n ? prefixes[0] : "",
                         n > 1 ? " or the other prefixes" : "");
    if (m->built && gen != m->trainable_gen && m->ctx->backend->mem_back) return dtr__model_back_grads(m);
    return DTR_OK;
}

int dtr_model_param_trainable(const dtr_model *m, int i) {
    return (m && i >= 0 && i < m->count) ? (m->params[i]->flags & DTR__REQUIRES_GRAD) != 0 : 0;
}

int dtr__model_frozen(const dtr_model *m) { return m->frozen; }

unsigned dtr__model_trainable_gen(const dtr_model *m) { return m->trainable_gen; }

/* ---- queries ---- */

int dtr_model_param_count(const dtr_model *m) { return m ? m->count : 0; }

int64_t dtr_model_numel(const dtr_model *m) { return m ? m->total : 0; }

dtr_tensor *dtr_model_param_at(const dtr_model *m, int i) {
    return (m && i >= 0 && i < m->count) ? m->params[i] : NULL;
}

dtr_tensor *dtr_model_find(const dtr_model *m, const char *name) {
    int i;
    if (!m || !name) return NULL;
    for (i = 0; i < m->count; i++)
        if (!strcmp(m->names[i], name)) return m->params[i];
    for (i = 0; i < m->nbuf; i++)
        if (!strcmp(m->bufs[i]->name, name)) return m->bufs[i];
    return NULL;
}

int64_t dtr_model_param_offset(const dtr_model *m, int i) {
    return (m && i >= 0 && i < m->count) ? m->offsets[i] : -1;
}

float *dtr_model_params(dtr_model *m) { return m ? m->data : NULL; }
float *dtr_model_grads(dtr_model *m) { return m ? m->grad : NULL; }
dtr_context *dtr_model_context(const dtr_model *m) { return m ? m->ctx : NULL; }

dtr_result dtr__model_present(const dtr_model *m, const char *fn) {
    dtr_result r = DTR_OK;
    int i;
    for (i = 0; i < m->count && r == DTR_OK; i++) r = dtr__param_present(m->params[i], fn);
    return r;
}

/* copies a whole block (0 parameters, 1 gradients, 2 buffers) to or from n host floats */
static dtr_result dtr__model_copy(dtr_model *m, int which, float *host, int64_t n, int write, const char *fn) {
    dtr_result r;
    int64_t want;
    float *block;
    if (!m || (!host && n)) return DTR_NULL_HANDLE;
    if ((r = dtr_model_build(m)) != DTR_OK) return r;
    if (which == 0 && (r = dtr__model_present(m, fn)) != DTR_OK) return r;
    want = which == 2 ? m->buf_total : m->total;
    block = which == 2 ? m->buf_data : which ? m->grad : m->data;
    if (n != want)
        return dtr__fail(m->ctx, DTR_SHAPE_MISMATCH, "%s: %lld floats given, the model has %lld", fn, (long long)n, (long long)want);
    if (n == 0) return DTR_OK;
    if (write) return m->ctx->backend->from_host(m->ctx, block, host, (size_t)n * sizeof(float));
    return m->ctx->backend->to_host(m->ctx, host, block, (size_t)n * sizeof(float));
}

dtr_result dtr_model_read(dtr_model *m, float *dst, int64_t n) { return dtr__model_copy(m, 0, dst, n, 0, "dtr_model_read"); }
dtr_result dtr_model_write(dtr_model *m, const float *src, int64_t n) {
    return dtr__model_copy(m, 0, (float *)(uintptr_t)src, n, 1, "dtr_model_write");
}
dtr_result dtr_model_read_grads(dtr_model *m, float *dst, int64_t n) {
    return dtr__model_copy(m, 1, dst, n, 0, "dtr_model_read_grads");
}
int64_t dtr_model_buffer_numel(const dtr_model *m) { return m ? m->buf_total : 0; }
dtr_result dtr_model_read_buffers(dtr_model *m, float *dst, int64_t n) {
    return dtr__model_copy(m, 2, dst, n, 0, "dtr_model_read_buffers");
}
dtr_result dtr_model_write_buffers(dtr_model *m, const float *src, int64_t n) {
    return dtr__model_copy(m, 2, (float *)(uintptr_t)src, n, 1, "dtr_model_write_buffers");
}

/* ---- moving toward another model (target networks, weight averages) ---- */

/* tensor lists a and b (n each) of the same shapes: DTR_OK, or the first that differs */
static dtr_result dtr__same_shapes(dtr_context *ctx, dtr_tensor *const *a, dtr_tensor *const *b, int n, const char *what) {
    char s1[96], s2[96];
    int i;
    for (i = 0; i < n; i++)
        if (a[i]->ndim != b[i]->ndim || memcmp(a[i]->shape, b[i]->shape, (size_t)a[i]->ndim * sizeof(int64_t)))
            return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_model_lerp: %s %d is '%s' %s in the target, '%s' %s in the source",
                             what, i, a[i]->name, dtr__shape_str(a[i], s1, sizeof s1), b[i]->name, dtr__shape_str(b[i], s2, sizeof s2));
    return DTR_OK;
}

static dtr_result dtr__lerp_check(dtr_model *a, dtr_model *b, float tau) {
    dtr_result r;
    if (!(tau >= 0.0f && tau <= 1.0f))
        return dtr__fail(a->ctx, DTR_INVALID_ARGUMENT, "dtr_model_lerp: tau %g must be in [0, 1]", (double)tau);
    if ((r = dtr_model_build(a)) != DTR_OK || (r = dtr_model_build(b)) != DTR_OK) return r;
    if (a->count != b->count || a->nbuf != b->nbuf)   /* (equal shapes then give equal blocks) */
        return dtr__fail(a->ctx, DTR_SHAPE_MISMATCH, "dtr_model_lerp: the target has %d parameters and %d buffers, the source %d "
                         "and %d", a->count, a->nbuf, b->count, b->nbuf);
    if ((r = dtr__same_shapes(a->ctx, a->params, b->params, a->count, "parameter")) != DTR_OK ||
        (r = dtr__same_shapes(a->ctx, a->bufs, b->bufs, a->nbuf, "buffer")) != DTR_OK)
        return r;
    if ((r = dtr__model_present(a, "dtr_model_lerp")) != DTR_OK) return r;
    return dtr__model_present(b, "dtr_model_lerp");
}

/* dst (ctx's memory) = src (bctx's memory), through host memory when either is a device's */
static dtr_result dtr__lerp_copy(dtr_context *ctx, float *dst, dtr_context *bctx, const float *src, size_t bytes) {
    void *host;
    dtr_result r;
    if (bctx == ctx) return dtr__mem_copy(ctx, dst, src, bytes);
    if (dtr__host_memory(bctx)) return ctx->backend->from_host(ctx, dst, src, bytes);
    if (dtr__host_memory(ctx)) return bctx->backend->to_host(bctx, dst, src, bytes);
    if (!(host = dtr__malloc(&ctx->alloc, bytes)))
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_lerp: no host memory to stage %zu bytes", bytes);
    r = bctx->backend->to_host(bctx, host, src, bytes);
    if (r == DTR_OK) r = ctx->backend->from_host(ctx, dst, host, bytes);
    dtr__free(&ctx->alloc, host);
    return r;
}

/* a = (1 - tau) a + tau b over n floats, a of ctx's memory and b of bctx's (the same context or
   another: a GPU model's moving average kept on the CPU), through a temporary for tau b */
static dtr_result dtr__lerp_block(dtr_context *ctx, float *a, dtr_context *bctx, const float *b, int64_t n, float tau) {
    size_t bytes = (size_t)n * sizeof(float);
    float *t;
    dtr_result r;
    if (n == 0 || tau == 0.0f) return DTR_OK;
    if (tau == 1.0f) return dtr__lerp_copy(ctx, a, bctx, b, bytes);
    if (!(t = (float *)ctx->backend->mem_alloc(ctx, bytes)))
        return dtr__fail(ctx, dtr__host_memory(ctx) ? DTR_OUT_OF_MEMORY : DTR_DEVICE_OUT_OF_MEMORY,
                         "dtr_model_lerp: no memory for a temporary of %lld floats", (long long)n);
    r = dtr__lerp_copy(ctx, t, bctx, b, bytes);
    if (r == DTR_OK) r = ctx->backend->scale(ctx, t, n, tau);
    if (r == DTR_OK) r = ctx->backend->scale(ctx, a, n, 1.0f - tau);
    if (r == DTR_OK) r = ctx->backend->reduce(ctx, a, a, t, (size_t)n, DTR_F32, DTR_REDUCE_SUM, 1);
    ctx->backend->mem_free(ctx, t);
    return r;
}

dtr_result dtr_model_lerp(dtr_model *target, dtr_model *src, float tau) {
    dtr_result r;
    if (!target || !src) return DTR_NULL_HANDLE;
    if ((r = dtr__lerp_check(target, src, tau)) != DTR_OK) return r;
    if ((r = dtr__lerp_block(target->ctx, target->data, src->ctx, src->data, target->total, tau)) != DTR_OK) return r;
    return dtr__lerp_block(target->ctx, target->buf_data, src->ctx, src->buf_data, target->buf_total, tau);
}

void dtr__model_shard_grads(dtr_model *m, int on, int64_t lo, int64_t hi) {
    m->grad_sharded = on, m->grad_lo = lo, m->grad_hi = hi;
}

int dtr__model_next_run(const dtr_model *m, int *i, int64_t *lo, int64_t *hi) {
    int j;
    while (*i < m->count && !dtr_model_param_trainable(m, *i)) (*i)++;
    if (*i >= m->count) return 0;
    for (j = *i + 1; j < m->count && dtr_model_param_trainable(m, j); j++) {}
    *lo = m->offsets[*i], *hi = j < m->count ? m->offsets[j] : m->total;
    *i = j;
    return 1;
}

dtr_result dtr__model_grad_scale(dtr_model *m, float factor) {
    dtr_result r = DTR_OK;
    int64_t lo, hi;
    int i = 0;
    if (!m->frozen) return m->ctx->backend->scale(m->ctx, m->grad, m->total, factor);
    while (r == DTR_OK && dtr__model_next_run(m, &i, &lo, &hi)) r = m->ctx->backend->scale(m->ctx, m->grad + lo, hi - lo, factor);
    return r;
}

/* with frozen parameters: the trainable runs zeroed; the frozen ones stay zero (backward, the
   update and data parallelism without ZeRO never write them; ZeRO's exchange writes zeros
   there), the whole buffer cleared once after each change of the trainable set (a parameter
   frozen with a gradient in it loses it): host pages given back to the system, device memory
   zeroed (a buffer from mem_reserve has none under frozen runs: zeros written there go
   nowhere) */
static dtr_result dtr__zero_grad_runs(dtr_model *m) {
    dtr_result r = DTR_OK;
    int64_t lo, hi;
    int i = 0;
    if (m->grad_gen != m->trainable_gen) {
        if (dtr__host_memory(m->ctx)) dtr__mem_discard(&m->ctx->alloc, m->grad, m->total, 0.0f);
        else r = m->ctx->backend->memset0(m->ctx, m->grad, (size_t)m->total * sizeof(float));
        m->grad_gen = m->trainable_gen;
    }
    while (r == DTR_OK && dtr__model_next_run(m, &i, &lo, &hi))
        r = m->ctx->backend->memset0(m->ctx, m->grad + lo, (size_t)(hi - lo) * sizeof(float));
    return r;
}

dtr_result dtr_model_zero_grad(dtr_model *m) {
    if (!m) return DTR_NULL_HANDLE;
    if (!m->built) return DTR_OK;
    m->zero_pass = m->ctx->backward_pass, m->reached_all = 0;
    if (m->grad_sharded && dtr__host_memory(m->ctx)) {   /* ZeRO-3: outside the shard, memory back to the system */
        dtr__mem_discard(&m->ctx->alloc, m->grad, m->grad_lo, 0.0f);
        dtr__mem_discard(&m->ctx->alloc, m->grad + m->grad_hi, m->total - m->grad_hi, 0.0f);
        return m->ctx->backend->memset0(m->ctx, m->grad + m->grad_lo, (size_t)(m->grad_hi - m->grad_lo) * sizeof(float));
    }
    if (m->frozen) return dtr__zero_grad_runs(m);
    return m->ctx->backend->memset0(m->ctx, m->grad, (size_t)m->total * sizeof(float));
}

/* 1 when a backward pass after the last zero_grad wrote parameter t's gradient */
static int dtr__param_reached(const dtr_model *m, const dtr_tensor *t) { return (int32_t)(t->grad_pass - m->zero_pass) > 0; }

int dtr__model_unreached(const dtr_model *m, unsigned char *skip) {
    int i, n = 0, any = 0;
    for (i = 0; i < m->count; i++) any |= dtr__param_reached(m, m->params[i]);
    for (i = 0; i < m->count; i++) {
        skip[i] = (unsigned char)(any && !m->reached_all && dtr_model_param_trainable(m, i) && !dtr__param_reached(m, m->params[i]));
        n += skip[i];
    }
    return n;
}

void dtr__model_reach_all(dtr_model *m) { if (m) m->reached_all = 1; }

void dtr__model_set_reached(dtr_model *m, int i, int reached) { m->params[i]->grad_pass = m->zero_pass + (reached ? 1u : 0u); }

/* ---- save and load (safetensors) ---- */

/* Entry i of the model's file: parameter i, or buffer i - count (after the parameters). */
static dtr_tensor *dtr__file_tensor(const dtr_model *m, int i) { return i < m->count ? m->params[i] : m->bufs[i - m->count]; }
static const dtr__shard *dtr__file_shard(const dtr_model *m, int i) {
    static dtr__shard whole;   /* zeros: a whole tensor */
    return i < m->count ? &m->shards[i] : &whole;
}

/* Elements of entry i in a file: the full tensor's for a shard. */
static int64_t dtr__file_numel(const dtr_model *m, int i) {
    const dtr__shard *s = dtr__file_shard(m, i);
    return s->comm ? dtr__numel(s->ndim, s->full) : dtr_tensor_numel(dtr__file_tensor(m, i));
}

/* Parameter i as the file holds it: its entry (name, dtype, full shape) and its values in dt
   at dst (a shard is gathered from its group first: collective). */
static dtr_result dtr__save_param(dtr_model *m, int i, dtr_dtype dt, dtr_st_entry *e, void *dst) {
    const dtr__shard *s = dtr__file_shard(m, i);
    const dtr_tensor *t = dtr__file_tensor(m, i);
    int64_t n = dtr__file_numel(m, i);
    float *full;
    dtr_result r;
    int d;
    snprintf(e->name, sizeof(e->name), "%s", t->name);
    e->dtype = dt;
    e->ndim = s->comm ? s->ndim : t->ndim;
    for (d = 0; d < e->ndim; d++) e->shape[d] = s->comm ? s->full[d] : t->shape[d];
    if (!s->comm) return dtr_tensor_read(t, dt, dst, (size_t)n);
    full = (float *)dtr__malloc(&m->ctx->alloc, (size_t)n * sizeof(float) + 1);
    if (!full) return dtr__fail(m->ctx, DTR_OUT_OF_MEMORY, "dtr_model_save: out of memory gathering '%s'", t->name);
    r = dtr__shard_gather(m->ctx, s, t, full);
    if (r == DTR_OK) dtr_convert(dst, dt, full, DTR_F32, (size_t)n);
    dtr__free(&m->ctx->alloc, full);
    return r;
}

dtr_save_config dtr_save_config_init(dtr_dtype dtype) {
    dtr_save_config c;
    memset(&c, 0, sizeof c);
    c.dtype = dtype;
    return c;
}

dtr_result dtr_model_save(dtr_model *m, const char *path, dtr_dtype dt) {
    dtr_save_config c = dtr_save_config_init(dt);
    return dtr_model_save_ex(m, path, &c);
}

/* 1 when entry i of the model's file goes into a file saved with cfg */
static int dtr__save_wanted(const dtr_model *m, int i, const dtr_save_config *cfg) {
    return !cfg->n_only || dtr__name_matches(dtr__file_tensor(m, i)->name, cfg->only, cfg->n_only);
}

dtr_result dtr_model_save_ex(dtr_model *m, const char *path, const dtr_save_config *cfg) {
    dtr_context *ctx;
    dtr_st_entry *ents = NULL;
    const void **data = NULL;
    void *conv = NULL;
    size_t es, off = 0;
    int64_t total = 0;
    char err[512];
    dtr_result r;
    dtr_dtype dt;
    int i, k = 0, nfile, writer = 1;
    if (!m || !path || !cfg) return DTR_NULL_HANDLE;
    ctx = m->ctx;
    dt = cfg->dtype;
    if (!dtr__is_float(dt))
        return dtr__fail(ctx, DTR_DTYPE_MISMATCH, "dtr_model_save: %s: weights are saved as f32, bf16 or f16, not %s", path,
                         dtr_dtype_name(dt));
    r = dtr_model_build(m);
    if (r == DTR_OK) r = dtr__model_present(m, "dtr_model_save");
    if (r != DTR_OK) return r;
    es = dtr_dtype_size(dt);
    nfile = m->count + m->nbuf;
    for (i = 0; i < nfile; i++) {
        if (!dtr__save_wanted(m, i, cfg)) continue;
        total += dtr__file_numel(m, i), k++;
        if (dtr__file_shard(m, i)->comm && dtr__file_shard(m, i)->rank) writer = 0;   /* rank 0 of a tensor-parallel group writes */
    }
    if (!k && nfile) return dtr__fail(ctx, DTR_NOT_FOUND, "dtr_model_save: %s: no tensor of the model matches '%s'%s", path,
                                      cfg->only && cfg->only[0] ? cfg->only[0] : "", cfg->n_only > 1 ? " or the others" : "");
    ents = (dtr_st_entry *)dtr__calloc(&ctx->alloc, (size_t)(nfile ? nfile : 1) * sizeof(*ents));
    data = (const void **)dtr__calloc(&ctx->alloc, (size_t)(nfile ? nfile : 1) * sizeof(*data));
    conv = dtr__malloc(&ctx->alloc, (size_t)(total ? total : 1) * es);
    if (!ents || !data || !conv) { r = dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_save: %s: out of memory", path); goto done; }
    for (k = 0, i = 0; i < nfile; i++) {
        if (!dtr__save_wanted(m, i, cfg)) continue;
        data[k] = (char *)conv + off;
        r = dtr__save_param(m, i, dt, &ents[k++], (char *)conv + off);
        if (r != DTR_OK) goto done;
        off += (size_t)dtr__file_numel(m, i) * es;
    }
    r = writer ? dtr_st_write(path, ents, data, k, err, sizeof(err)) : DTR_OK;
    if (r != DTR_OK) dtr__fail(ctx, r, "dtr_model_save: %s", err);
done:
    dtr__free(&ctx->alloc, ents);
    dtr__free(&ctx->alloc, (void *)data);
    dtr__free(&ctx->alloc, conv);
    return r;
}

/* The shape parameter i has in a file: its own, or (in *buf) the full tensor's for a shard. */
static const dtr_tensor *dtr__file_shape(const dtr_model *m, int i, dtr_tensor *buf) {
    const dtr__shard *s = dtr__file_shard(m, i);
    if (!s->comm) return dtr__file_tensor(m, i);
    *buf = *m->params[i];
    buf->ndim = s->ndim;
    memcpy(buf->shape, s->full, sizeof buf->shape);
    return buf;
}

/* Converts entry e (checked against the file shape) into parameter i's f32 values at x. */
static dtr_result dtr__load_param(dtr_model *m, int i, const dtr_st_entry *e, float *x) {
    const dtr__shard *s = dtr__file_shard(m, i);
    int64_t n = dtr__file_numel(m, i);
    float *full;
    if (!s->comm) return dtr_convert(x, DTR_F32, e->data, e->dtype, (size_t)n);
    full = (float *)dtr__malloc(&m->ctx->alloc, (size_t)n * sizeof(float) + 1);
    if (!full) return dtr__fail(m->ctx, DTR_OUT_OF_MEMORY, "dtr_model_load: out of memory for '%s'", m->names[i]);
    dtr_convert(full, DTR_F32, e->data, e->dtype, (size_t)n);
    dtr__shard_copy(s, s->rank, full, x, 0);
    dtr__free(&m->ctx->alloc, full);
    return DTR_OK;
}

/* where entry i's f32 values go in dtr_model_load's staging copy */
static int64_t dtr__stage_offset(const dtr_model *m, int i) {
    return i < m->count ? m->offsets[i] : m->total + m->buf_offsets[i - m->count];
}

dtr_load_config dtr_load_config_init(void) {
    dtr_load_config c;
    memset(&c, 0, sizeof c);
    return c;
}

dtr_result dtr_model_load(dtr_model *m, const char *path) { return dtr_model_load_ex(m, path, NULL); }

/* An entry the file lacks that cfg lets keep its values: those values staged at stage. */
static dtr_result dtr__load_keep(dtr_model *m, int i, float *stage) {
    dtr_tensor *t = dtr__file_tensor(m, i);
    return m->ctx->backend->to_host(m->ctx, stage, t->storage, (size_t)dtr_tensor_numel(t) * sizeof(float));
}

/* The shape-mismatch error of entry e (the file's) against t (the model's). */
static dtr_result dtr__load_shape_err(dtr_model *m, const char *path, const char *name, const dtr_st_entry *e,
                                      const dtr_tensor *t) {
    dtr_tensor fs;
    char s1[96], s2[96];
    int d;
    memset(&fs, 0, sizeof fs);
    fs.ndim = e->ndim >= 0 && e->ndim <= DTR_MAX_DIMS ? e->ndim : 0;
    for (d = 0; d < fs.ndim; d++) fs.shape[d] = e->shape[d];
    return dtr__fail(m->ctx, DTR_SHAPE_MISMATCH, "dtr_model_load: %s: tensor '%s' is %s in the file, %s in the model", path,
                     name, dtr__shape_str(&fs, s2, sizeof s2), dtr__shape_str(t, s1, sizeof s1));
}

/* Stages entry i of the model's file at `stage` from f, checked (or keeps its values when cfg
   lets the file lack it); *loaded counts the entries read from the file. */
static dtr_result dtr__load_stage(dtr_model *m, const dtr_st_file *f, const char *path, const dtr_load_config *cfg, int i,
                                  float *stage, int *loaded) {
    dtr_tensor want;
    const dtr_tensor *t = dtr__file_shape(m, i, &want);
    const dtr_st_entry *e = NULL;
    const char *name = dtr__file_tensor(m, i)->name;
    int j, d;
    for (j = 0; j < f->count && !e; j++)
        if (!strcmp(f->entries[j].name, name)) e = &f->entries[j];
    if (!e && cfg && dtr__name_matches(name, cfg->optional, cfg->n_optional)) return dtr__load_keep(m, i, stage);
    if (!e) return dtr__fail(m->ctx, DTR_NOT_FOUND, "dtr_model_load: %s has no tensor '%s'", path, name);
    for (d = 0; d < t->ndim && e->ndim == t->ndim; d++)
        if (e->shape[d] != t->shape[d]) break;
    if (e->ndim != t->ndim || d < t->ndim) return dtr__load_shape_err(m, path, name, e, t);
    if (e->foreign || !dtr__is_float(e->dtype))
        return dtr__fail(m->ctx, DTR_DTYPE_MISMATCH, "dtr_model_load: %s: tensor '%s' is %s; weights must be F32, BF16 or F16",
                         path, name, e->dtype_name);
    (*loaded)++;
    return dtr__load_param(m, i, e, stage);
}

dtr_result dtr_model_load_ex(dtr_model *m, const char *path, const dtr_load_config *cfg) {
    dtr_context *ctx;
    dtr_st_file f;
    float *stage = NULL;
    char err[512];
    dtr_result r;
    int i, loaded = 0;
    if (!m || !path) return DTR_NULL_HANDLE;
    ctx = m->ctx;
    r = dtr_model_build(m);
    if (r == DTR_OK) r = dtr__model_present(m, "dtr_model_load");
    if (r != DTR_OK) return r;
    r = dtr_st_open(path, &ctx->alloc, &f, err, sizeof(err));
    if (r != DTR_OK) return dtr__fail(ctx, r, "dtr_model_load: %s", err);
    /* convert everything into a staging copy first (the parameters, then the buffers): on any
       error the model is untouched */
    stage = (float *)dtr__malloc(&ctx->alloc, (size_t)(m->total + m->buf_total + 1) * sizeof(float));
    if (!stage) r = dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_model_load: %s: out of memory", path);
    for (i = 0; r == DTR_OK && i < m->count + m->nbuf; i++)
        r = dtr__load_stage(m, &f, path, cfg, i, stage + dtr__stage_offset(m, i), &loaded);
    if (r == DTR_OK && !loaded && m->count + m->nbuf > 0)
        r = dtr__fail(ctx, DTR_NOT_FOUND, "dtr_model_load: %s holds none of the model's tensors", path);
    for (i = 0; r == DTR_OK && i < m->count + m->nbuf; i++) {
        dtr_tensor *t = dtr__file_tensor(m, i);
        r = ctx->backend->from_host(ctx, t->storage, stage + dtr__stage_offset(m, i), (size_t)dtr_tensor_numel(t) * sizeof(float));
        if (r != DTR_OK) dtr__fail(ctx, r, "dtr_model_load: %s: copy to the device failed", path);
    }
    dtr__free(&ctx->alloc, stage);
    dtr_st_destroy(&f);
    return r;
}

/* ---- state ---- */

dtr_result dtr_model_state(dtr_model *m, int index, dtr_state_entry *out) {
    dtr_result r;
    size_t bytes;
    if (!m || !out) return DTR_NULL_HANDLE;
    if ((r = dtr_model_build(m)) != DTR_OK) return r;
    bytes = (size_t)m->total * sizeof(float);
    if (index == 0) return dtr__state_put(out, "params", m->data, bytes, !dtr__host_memory(m->ctx));
    if (index == 1) return dtr__state_put(out, "grads", m->grad, bytes, !dtr__host_memory(m->ctx));
    if (index == 2 && m->nbuf)
        return dtr__state_put(out, "buffers", m->buf_data, (size_t)m->buf_total * sizeof(float), !dtr__host_memory(m->ctx));
    return DTR_NOT_FOUND;
}

dtr_result dtr_model_state_loaded(dtr_model *m) { return m ? DTR_OK : DTR_NULL_HANDLE; }
