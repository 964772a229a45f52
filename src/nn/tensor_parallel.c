/* ============================================================================
 * Tensor-parallel layers (Megatron-LM): each rank of a group holds a shard of a layer's
 * weights and the communication ops of src/ops/ops_comm.c join the partial results.
 *   column-parallel linear  y_r = x W_r^T + b_r   (W_r: rows r * out / tp ..), after tp_copy
 *   row-parallel linear     y = tp_reduce(x_r W_r^T) + b   (W_r: columns r * in / tp ..)
 *   attention               qkv column-parallel over this rank's heads, proj row-parallel
 *   embedding               rows r * vocab / tp ..; the others' ids give zero rows; tp_reduce
 * Shards are model parameters marked with a dtr__shard (model.c initialises, saves and loads
 * them as slices of the full tensor).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include <math.h>

/* ---- shards ---- */

void dtr__shard_copy(const dtr__shard *s, int rank, float *full, float *part, int to_full) {
    int64_t outer = 1, inner = 1, c, o;
    int d, p;
    for (d = 0; d < s->axis; d++) outer *= s->full[d];
    for (d = s->axis + 1; d < s->ndim; d++) inner *= s->full[d];
    c = s->full[s->axis] / s->parts / s->ways * inner;   /* floats of one block's slice */
    for (o = 0; o < outer; o++)
        for (p = 0; p < s->parts; p++) {
            float *f = full + ((o * s->parts + p) * s->ways + rank) * c, *q = part + (o * s->parts + p) * c;
            memcpy(to_full ? f : q, to_full ? q : f, (size_t)c * sizeof(float));
        }
}

dtr_result dtr__shard_gather(dtr_context *ctx, const dtr__shard *s, const dtr_tensor *t, float *full) {
    int64_t n = dtr_tensor_numel(t);
    float *buf = (float *)dtr__malloc(&ctx->alloc, (size_t)(n * s->ways + 1) * sizeof(float));
    dtr_result r;
    int k;
    if (!buf) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "gathering '%s': out of memory", t->name);
    r = dtr_tensor_read(t, DTR_F32, buf + s->rank * n, (size_t)n);
    if (r == DTR_OK) r = dtr_comm_all_gather(s->comm, buf + s->rank * n, buf, (size_t)n, DTR_F32);
    if (r != DTR_OK) dtr__fail(ctx, r, "gathering '%s' over the tensor-parallel group: %s", t->name, dtr_comm_last_error(s->comm));
    for (k = 0; r == DTR_OK && k < s->ways; k++) dtr__shard_copy(s, k, full, buf + k * n, 1);
    dtr__free(&ctx->alloc, buf);
    return r;
}

/* Declares "prefix.suffix" as this rank's shard of a full tensor of shape `full` split along
   `axis` (in `parts` blocks); a group of one holds the whole tensor. */
static dtr_tensor *dtr__tp_param(dtr_model *m, dtr_comm *comm, const char *prefix, const char *suffix, int ndim,
                                 const int64_t *full, int axis, int parts, dtr_init init, float arg) {
    dtr__shard s;
    int64_t shape[DTR_MAX_DIMS];
    dtr_tensor *t;
    memset(&s, 0, sizeof s);
    s.comm = comm, s.rank = dtr_comm_rank(comm), s.ways = dtr_comm_size(comm);
    s.axis = axis, s.parts = parts, s.ndim = ndim;
    memcpy(s.full, full, (size_t)ndim * sizeof(*full));
    memcpy(shape, full, (size_t)ndim * sizeof(*full));
    shape[axis] = full[axis] / s.ways;
    t = dtr__named_param(m, prefix, suffix, ndim, shape, init, arg);
    if (t && s.ways > 1) dtr__model_set_shard(m, t, &s);
    return t;
}

static dtr_result dtr__tp_status(dtr_model *m) { return dtr_context_status(dtr_model_context(m)); }

/* The group's size, or 0 with DTR_NULL_HANDLE recorded for a NULL group. */
static int dtr__tp_size(dtr_model *m, dtr_comm *comm, const char *fn, const char *name) {
    if (comm) return dtr_comm_size(comm);
    dtr__fail(dtr_model_context(m), DTR_NULL_HANDLE, "%s: '%s': comm is NULL", fn, name ? name : "");
    return 0;
}

/* ---- linear ---- */

static dtr_result dtr__tp_linear_init(dtr_tp_linear *l, dtr_model *m, dtr_comm *comm, const char *name, int64_t in,
                                      int64_t out, int bias, dtr_init init, int row, int parts) {
    const char *fn = row ? "dtr_tp_row_linear_init" : "dtr_tp_column_linear_init";
    int64_t ws[2], split;
    int tp;
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (!(tp = dtr__tp_size(m, comm, fn, name))) return DTR_NULL_HANDLE;
    split = row ? in : out;
    if (in <= 0 || out <= 0 || split % ((int64_t)parts * tp))
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT,
                         "%s: '%s': %s features %lld do not split over %d ranks (in %lld, out %lld)", fn, name ? name : "",
                         row ? "input" : "output", (long long)split, tp, (long long)in, (long long)out);
    ws[0] = out, ws[1] = in;
    l->in = in, l->out = out, l->row = row, l->comm = comm, l->parts = parts;
    l->weight = dtr__tp_param(m, comm, name, "weight", 2, ws, row, parts, init, 0.0f);
    if (bias && row) l->bias = dtr__named_param(m, name, "bias", 1, &out, DTR_INIT_UNIFORM, (float)(1.0 / sqrt((double)in)));
    else if (bias) l->bias = dtr__tp_param(m, comm, name, "bias", 1, &out, 0, parts, DTR_INIT_UNIFORM, (float)(1.0 / sqrt((double)in)));
    return dtr__tp_status(m);
}

dtr_result dtr_tp_column_linear_init(dtr_tp_linear *l, dtr_model *m, dtr_comm *comm, const char *name, int64_t in,
                                     int64_t out, int bias, dtr_init init, int gather) {
    dtr_result r = dtr__tp_linear_init(l, m, comm, name, in, out, bias, init, 0, 1);
    if (r == DTR_OK) l->gather = gather;
    return r;
}

dtr_result dtr_tp_row_linear_init(dtr_tp_linear *l, dtr_model *m, dtr_comm *comm, const char *name, int64_t in,
                                  int64_t out, int bias, dtr_init init) {
    return dtr__tp_linear_init(l, m, comm, name, in, out, bias, init, 1, 1);
}

dtr_result dtr_tp_linear_add_lora(dtr_tp_linear *l, dtr_model *m, int rank, float alpha) {
    char base[256];
    int64_t as[2], bs[2];
    dtr_result r;
    if (!l || !m) return DTR_NULL_HANDLE;
    if (!l->comm) return dtr__fail(dtr_model_context(m), DTR_NULL_HANDLE, "dtr_tp_linear_add_lora: the layer is not initialised");
    r = dtr__lora_check(m, "dtr_tp_linear_add_lora", l->weight, l->lora_a, rank, alpha, base, sizeof base);
    if (r != DTR_OK) return r;
    as[0] = rank, as[1] = l->in, bs[0] = l->out, bs[1] = rank;
    if (l->row) {   /* A's columns split as the weight's; B whole */
        l->lora_a = dtr__tp_param(m, l->comm, base, "lora_A.weight", 2, as, 1, l->parts, DTR_INIT_TORCH_DEFAULT, 0.0f);
        l->lora_b = dtr__named_param(m, base, "lora_B.weight", 2, bs, DTR_INIT_ZEROS, 0.0f);
    } else {        /* A whole; B's rows split as the weight's */
        l->lora_a = dtr__named_param(m, base, "lora_A.weight", 2, as, DTR_INIT_TORCH_DEFAULT, 0.0f);
        l->lora_b = dtr__tp_param(m, l->comm, base, "lora_B.weight", 2, bs, 0, l->parts, DTR_INIT_ZEROS, 0.0f);
    }
    l->lora_scale = alpha / (float)rank;
    if (!l->lora_a || !l->lora_b) l->lora_a = l->lora_b = NULL;
    return dtr__tp_status(m);
}

dtr_result dtr_tp_linear_merge_lora(dtr_tp_linear *l) {
    if (!l || !l->weight) return DTR_NULL_HANDLE;
    return dtr__lora_merge("dtr_tp_linear_merge_lora", l->weight, l->lora_a, l->lora_b, l->lora_scale);
}

/* The adapter's (alpha / rank) (x A^T) B^T: column-parallel, x A^T through dtr_tp_copy (its
   gradient is the sum of every rank's B_r part); row-parallel, x A_r^T summed by dtr_tp_reduce.
   The dropout of x: replicated (column), or this rank's columns of one device's mask (row). */
static dtr_tensor *dtr__tp_lora(dtr_context *ctx, const dtr_tp_linear *l, dtr_tensor *x) {
    int64_t share = l->in / dtr_comm_size(l->comm);
    dtr_tensor *z;
    if (l->lora_dropout != 0.0f) x = dtr__dropout_cols(ctx, x, l->lora_dropout, l->row ? l->in : 0, share * dtr_comm_rank(l->comm));
    z = dtr_linear(ctx, x, l->lora_a, NULL);
    z = l->row ? dtr_tp_reduce(ctx, z, l->comm) : dtr_tp_copy(ctx, z, l->comm);
    return dtr_linear(ctx, dtr_scale(ctx, z, l->lora_scale), l->lora_b, NULL);
}

dtr_tensor *dtr_tp_linear_forward(dtr_context *ctx, const dtr_tp_linear *l, dtr_tensor *x) {
    dtr_tensor *y;
    if (!ctx) return NULL;
    if (!l || !l->comm) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_tp_linear_forward: layer is NULL or not initialised");
    if (!l->row) {
        y = dtr_linear(ctx, dtr_tp_copy(ctx, x, l->comm), l->weight, l->bias);
        if (l->lora_a) y = dtr_add(ctx, y, dtr__tp_lora(ctx, l, x));
        return l->gather ? dtr_tp_gather(ctx, y, l->comm) : y;
    }
    y = dtr_tp_reduce(ctx, dtr_linear(ctx, x, l->weight, NULL), l->comm);
    if (l->bias) y = dtr_add(ctx, y, l->bias);
    return l->lora_a ? dtr_add(ctx, y, dtr__tp_lora(ctx, l, x)) : y;   /* after the bias, as dtr_linear_layer_forward */
}

/* ---- attention ---- */

dtr_result dtr_tp_attention_init(dtr_tp_attention *a, dtr_model *m, dtr_comm *comm, const char *name, int64_t dim,
                                 int heads) {
    char sub[256];
    int tp;
    if (!a || !m) return DTR_NULL_HANDLE;
    memset(a, 0, sizeof(*a));
    if (!(tp = dtr__tp_size(m, comm, "dtr_tp_attention_init", name))) return DTR_NULL_HANDLE;
    if (dim <= 0 || heads <= 0 || dim % heads || heads % tp)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT,
                         "dtr_tp_attention_init: '%s': %d heads must divide dim %lld and split evenly over %d ranks",
                         name ? name : "", heads, (long long)dim, tp);
    a->dim = dim, a->heads = heads, a->local_heads = heads / tp, a->causal = 1;
    dtr__tp_linear_init(&a->qkv, m, comm, dtr__sub_name(sub, sizeof sub, name, "qkv"), dim, 3 * dim, 1,
                        DTR_INIT_TORCH_DEFAULT, 0, 3);
    dtr_tp_row_linear_init(&a->proj, m, comm, dtr__sub_name(sub, sizeof sub, name, "proj"), dim, dim, 1, DTR_INIT_TORCH_DEFAULT);
    return dtr__tp_status(m);
}

dtr_tensor *dtr_tp_attention_forward_cached(dtr_context *ctx, const dtr_tp_attention *a, dtr_tensor *x, dtr_kv_cache *cache,
                                            int layer) {
    dtr_tensor *qkv, *q, *k, *v;
    dtr_attention_config cfg;
    int64_t C;
    if (!ctx) return NULL;
    if (!a || !a->local_heads) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_tp_attention_forward: layer is NULL or not initialised");
    C = a->dim / a->heads * a->local_heads;   /* this rank's features */
    cfg = dtr_attention_config_init(a->local_heads, a->causal);
    cfg.dropout = a->dropout;
    cfg.mask_heads = a->heads, cfg.mask_head0 = a->local_heads * dtr_comm_rank(a->qkv.comm);   /* its share of one mask */
    qkv = dtr_tp_linear_forward(ctx, &a->qkv, x);   /* (B, T, 3C): its q | k | v */
    q = dtr_slice(ctx, qkv, -1, 0, C);
    k = dtr_slice(ctx, qkv, -1, C, 2 * C);
    v = dtr_slice(ctx, qkv, -1, 2 * C, 3 * C);
    x = dtr_tp_linear_forward(ctx, &a->proj, dtr__kv_attention(ctx, cache, layer, q, k, v, &cfg));
    return dtr_dropout(ctx, x, cache ? 0.0f : a->resid_dropout);   /* replicated: the same mask on every rank */
}

dtr_tensor *dtr_tp_attention_forward(dtr_context *ctx, const dtr_tp_attention *a, dtr_tensor *x) {
    return dtr_tp_attention_forward_cached(ctx, a, x, NULL, 0);
}

/* ---- embedding ---- */

dtr_result dtr_tp_embedding_init(dtr_tp_embedding *e, dtr_model *m, dtr_comm *comm, const char *name, int64_t vocab,
                                 int64_t dim) {
    int64_t s[2];
    int tp;
    if (!e || !m) return DTR_NULL_HANDLE;
    memset(e, 0, sizeof(*e));
    if (!(tp = dtr__tp_size(m, comm, "dtr_tp_embedding_init", name))) return DTR_NULL_HANDLE;
    if (vocab <= 0 || dim <= 0 || vocab % tp)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT,
                         "dtr_tp_embedding_init: '%s': vocab %lld must be > 0 and split evenly over %d ranks (dim %lld)",
                         name ? name : "", (long long)vocab, tp, (long long)dim);
    s[0] = vocab, s[1] = dim;
    e->vocab = vocab, e->dim = dim, e->comm = comm;
    e->start = vocab / tp * dtr_comm_rank(comm);
    e->weight = dtr__tp_param(m, comm, name, "weight", 2, s, 0, 1, DTR_INIT_NORMAL, 0.02f);
    return dtr__tp_status(m);
}

/* ids -> this rank's rows (0 for ids it does not hold) and a mask (S..., 1) of the ids it holds */
static dtr_result dtr__tp_local_ids(dtr_context *ctx, const dtr_tp_embedding *e, const int32_t *ids, int64_t n,
                                    int32_t *local, float *mask) {
    int64_t i, rows = e->vocab / dtr_comm_size(e->comm);
    for (i = 0; i < n; i++) {
        int64_t j = (int64_t)ids[i] - e->start;
        if (ids[i] < 0 || ids[i] >= e->vocab)
            return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_tp_embedding_forward: id %lld is %d, outside [0, %lld)",
                             (long long)i, (int)ids[i], (long long)e->vocab);
        mask[i] = j >= 0 && j < rows ? 1.0f : 0.0f;
        local[i] = mask[i] != 0.0f ? (int32_t)j : 0;
    }
    return DTR_OK;
}

dtr_tensor *dtr_tp_embedding_forward(dtr_context *ctx, const dtr_tp_embedding *e, dtr_tensor *ids) {
    int64_t n, shape[DTR_MAX_DIMS];
    int32_t *buf;
    dtr_tensor *rows = NULL, *mask;
    int d;
    if (!ctx) return NULL;
    if (!e || !e->comm) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_tp_embedding_forward: layer is NULL or not initialised");
    if (!ids || ids->dtype != DTR_I32 || ids->ndim >= DTR_MAX_DIMS)
        return dtr__failt(ctx, ids ? DTR_DTYPE_MISMATCH : DTR_NULL_HANDLE, "dtr_tp_embedding_forward: ids must be i32 of at most %d dims",
                          DTR_MAX_DIMS - 1);
    n = dtr_tensor_numel(ids);
    buf = (int32_t *)dtr__malloc(&ctx->alloc, (size_t)(2 * n + 1) * sizeof(int32_t) + (size_t)n * sizeof(float));
    if (!buf) return dtr__failt(ctx, DTR_OUT_OF_MEMORY, "dtr_tp_embedding_forward: out of memory");
    for (d = 0; d < ids->ndim; d++) shape[d] = ids->shape[d];
    shape[ids->ndim] = 1;
    if (dtr_tensor_read(ids, DTR_I32, buf, (size_t)n) == DTR_OK &&
        dtr__tp_local_ids(ctx, e, buf, n, buf + n, (float *)(buf + 2 * n + 1)) == DTR_OK) {
        rows = dtr_embedding(ctx, e->weight, dtr_tensor_from(ctx, DTR_I32, ids->ndim, ids->shape, buf + n));
        mask = dtr_tensor_from(ctx, DTR_F32, ids->ndim + 1, shape, buf + 2 * n + 1);
        rows = dtr_tp_reduce(ctx, dtr_mul(ctx, rows, mask), e->comm);
    }
    dtr__free(&ctx->alloc, buf);
    return rows;
}

/* ---- the GPT block ---- */

dtr_result dtr_tp_gpt_block_init(dtr_tp_gpt_block *b, dtr_model *m, dtr_comm *comm, const char *name, int64_t dim,
                                 int heads) {
    char sub[256];
    if (!b || !m) return DTR_NULL_HANDLE;
    memset(b, 0, sizeof(*b));
    dtr_layernorm_layer_init(&b->ln1, m, dtr__sub_name(sub, sizeof sub, name, "ln1"), dim);
    if (dtr_tp_attention_init(&b->attn, m, comm, dtr__sub_name(sub, sizeof sub, name, "attn"), dim, heads) != DTR_OK)
        return dtr__tp_status(m);
    dtr_layernorm_layer_init(&b->ln2, m, dtr__sub_name(sub, sizeof sub, name, "ln2"), dim);
    dtr_tp_column_linear_init(&b->fc, m, comm, dtr__sub_name(sub, sizeof sub, name, "fc"), dim, 4 * dim, 1,
                              DTR_INIT_TORCH_DEFAULT, 0);
    dtr_tp_row_linear_init(&b->fc_proj, m, comm, dtr__sub_name(sub, sizeof sub, name, "fc_proj"), 4 * dim, dim, 1,
                           DTR_INIT_TORCH_DEFAULT);
    return dtr__tp_status(m);
}

dtr_tensor *dtr_tp_gpt_block_forward_cached(dtr_context *ctx, const dtr_tp_gpt_block *b, dtr_tensor *x, dtr_kv_cache *cache,
                                            int layer) {
    dtr_tp_attention attn;
    dtr_tensor *h;
    if (!ctx) return NULL;
    if (!b) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_tp_gpt_block_forward: block is NULL");
    attn = b->attn;
    if (b->dropout != 0.0f) attn.dropout = attn.resid_dropout = b->dropout;
    h = dtr_tp_attention_forward_cached(ctx, &attn, dtr_layernorm_layer_forward(ctx, &b->ln1, x), cache, layer);
    x = dtr_add(ctx, x, h);
    h = dtr_tp_linear_forward(ctx, &b->fc, dtr_layernorm_layer_forward(ctx, &b->ln2, x));
    h = dtr_tp_linear_forward(ctx, &b->fc_proj, dtr_gelu(ctx, h));
    return dtr_add(ctx, x, dtr_dropout(ctx, h, cache ? 0.0f : b->dropout));
}

dtr_tensor *dtr_tp_gpt_block_forward(dtr_context *ctx, const dtr_tp_gpt_block *b, dtr_tensor *x) {
    return dtr_tp_gpt_block_forward_cached(ctx, b, x, NULL, 0);
}
