/* ============================================================================
 * Layers: constructors that declare named parameters on a model, and forward passes made
 * of ops (so autograd covers them). Shapes: x (..., in) for linear, (N, C, H, W) for conv2d, (N, C, L) for conv1d,
 * (B, T, C) for attention and GPT blocks.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include <math.h>

/* "<prefix>.<suffix>" (or suffix alone) in name[256]: 1, or 0 with the error set when too long */
static int dtr__full_name(dtr_model *m, const char *prefix, const char *suffix, char *name) {
    if (!prefix) prefix = "";
    if ((size_t)snprintf(name, 256, "%s%s%s", prefix, *prefix ? "." : "", suffix) < 256) return 1;
    dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "layer name '%.40s...' is too long", prefix);
    return 0;
}

dtr_tensor *dtr__named_param(dtr_model *m, const char *prefix, const char *suffix, int ndim, const int64_t *shape,
                             dtr_init init, float arg) {
    char name[256];
    return dtr__full_name(m, prefix, suffix, name) ? dtr_model_param(m, name, ndim, shape, init, arg) : NULL;
}

/* a buffer "<prefix>.<suffix>" of n elements at `value` */
static dtr_tensor *dtr__named_buffer(dtr_model *m, const char *prefix, const char *suffix, int64_t n, float value) {
    char name[256];
    return dtr__full_name(m, prefix, suffix, name) ? dtr_model_buffer(m, name, 1, &n, value) : NULL;
}

static dtr_result dtr__layer_status(dtr_model *m) {
    return m ? dtr_context_status(dtr_model_context(m)) : DTR_NULL_HANDLE;
}

/* ---- linear ---- */

dtr_result dtr_linear_layer_init(dtr_linear_layer *l, dtr_model *m, const char *name, int64_t in, int64_t out, int bias,
                                 dtr_init init) {
    int64_t ws[2];
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (in <= 0 || out <= 0)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_linear_layer_init: '%s' needs in, out > 0", name ? name : "");
    ws[0] = out; ws[1] = in;
    l->in = in;
    l->out = out;
    l->weight = dtr__named_param(m, name, "weight", 2, ws, init, 0.0f);
    if (bias) l->bias = dtr__named_param(m, name, "bias", 1, &out, DTR_INIT_UNIFORM, (float)(1.0 / sqrt((double)in)));
    return dtr__layer_status(m);
}

dtr_tensor *dtr_linear_layer_forward(dtr_context *ctx, const dtr_linear_layer *l, dtr_tensor *x) {
    dtr_tensor *y;
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_linear_layer_forward: layer is NULL");
    y = dtr_linear(ctx, x, l->weight, l->bias);
    if (!l->lora_a) return y;
    if (l->lora_dropout != 0.0f) x = dtr_dropout(ctx, x, l->lora_dropout);   /* the adapter's input only */
    /* the scale on the rank-wide product, not on the layer-wide one: one activation less of the layer's width */
    return dtr_add(ctx, y, dtr_linear(ctx, dtr_scale(ctx, dtr_linear(ctx, x, l->lora_a, NULL), l->lora_scale), l->lora_b, NULL));
}

/* ---- LoRA adapters ---- */

dtr_result dtr__lora_check(dtr_model *m, const char *fn, const dtr_tensor *weight, const dtr_tensor *a, int rank,
                           float alpha, char *base, size_t cap) {
    dtr_context *ctx = dtr_model_context(m);
    const char *wn = weight ? dtr_tensor_name(weight) : NULL;
    size_t n = wn ? strlen(wn) : 0;
    if (n <= 7 || strcmp(wn + n - 7, ".weight") != 0 || n - 7 >= cap)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: the layer's weight is not '<name>.weight' (make the layer with its "
                                                    "_init function)", fn);
    if (rank < 1 || !(alpha > 0.0f))
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: '%s': rank %d and alpha %g must be > 0", fn, wn, rank, (double)alpha);
    if (a) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: '%s' has an adapter already", fn, wn);
    memcpy(base, wn, n - 7);
    base[n - 7] = '\0';
    return DTR_OK;
}

dtr_result dtr_linear_layer_add_lora(dtr_linear_layer *l, dtr_model *m, int rank, float alpha) {
    char base[256];
    int64_t as[2], bs[2];
    dtr_result r;
    if (!l || !m) return DTR_NULL_HANDLE;
    r = dtr__lora_check(m, "dtr_linear_layer_add_lora", l->weight, l->lora_a, rank, alpha, base, sizeof base);
    if (r != DTR_OK) return r;
    as[0] = rank, as[1] = l->in, bs[0] = l->out, bs[1] = rank;
    l->lora_a = dtr__named_param(m, base, "lora_A.weight", 2, as, DTR_INIT_TORCH_DEFAULT, 0.0f);
    l->lora_b = dtr__named_param(m, base, "lora_B.weight", 2, bs, DTR_INIT_ZEROS, 0.0f);
    l->lora_scale = alpha / (float)rank;
    if (!l->lora_a || !l->lora_b) l->lora_a = l->lora_b = NULL;
    return dtr__layer_status(m);
}

/* W (out, in) += s B (out, r) A (r, in), each element's sum in double */
static void dtr__lora_fold(float *w, const float *a, const float *b, int64_t out, int64_t in, int64_t r, double s) {
    int64_t o, i, k;
    for (o = 0; o < out; o++)
        for (i = 0; i < in; i++) {
            double acc = 0.0;
            for (k = 0; k < r; k++) acc += (double)b[o * r + k] * a[k * in + i];
            w[o * in + i] = (float)(w[o * in + i] + s * acc);
        }
}

dtr_result dtr__lora_merge(const char *fn, dtr_tensor *weight, dtr_tensor *a, dtr_tensor *b, float scale) {
    dtr_context *ctx = weight->ctx;
    int64_t r, out = weight->shape[0], in = weight->shape[1], nw = out * in, na, nb;
    float *w;
    dtr_result rc;
    if (!a || !b) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: '%s' has no adapter", fn, dtr_tensor_name(weight));
    r = a->shape[0], na = r * in, nb = out * r;
    w = (float *)dtr__malloc(&ctx->alloc, (size_t)(nw + na + nb) * sizeof(float));
    if (!w) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "%s: out of memory", fn);
    rc = dtr_tensor_read(weight, DTR_F32, w, (size_t)nw);
    if (rc == DTR_OK) rc = dtr_tensor_read(a, DTR_F32, w + nw, (size_t)na);
    if (rc == DTR_OK) rc = dtr_tensor_read(b, DTR_F32, w + nw + na, (size_t)nb);
    if (rc == DTR_OK) dtr__lora_fold(w, w + nw, w + nw + na, out, in, r, scale);
    if (rc == DTR_OK) rc = dtr_tensor_write(weight, DTR_F32, w, (size_t)nw);
    memset(w + nw + na, 0, (size_t)nb * sizeof(float));   /* B = 0: the layer's output stays */
    if (rc == DTR_OK) rc = dtr_tensor_write(b, DTR_F32, w + nw + na, (size_t)nb);
    dtr__free(&ctx->alloc, w);
    return rc;
}

dtr_result dtr_linear_layer_merge_lora(dtr_linear_layer *l) {
    if (!l || !l->weight) return DTR_NULL_HANDLE;
    return dtr__lora_merge("dtr_linear_layer_merge_lora", l->weight, l->lora_a, l->lora_b, l->lora_scale);
}

/* ---- convolution ---- */

/* weight (out, in / groups, kernel...) and the bias (PyTorch's bound 1 / sqrt(fan in)); a transposed
   convolution's weight (in, out / groups, kernel...) is declared as (out, in) swapped, its bias has `in` */
static dtr_result dtr__conv_layer_params(dtr_model *m, const char *name, const char *fn, int64_t in, int64_t out, int nk,
                                         const int *k, int groups, int bias, int transposed, dtr_init init, dtr_tensor **w,
                                         dtr_tensor **b) {
    int64_t ws[4], fan, nb = transposed ? in : out;
    int i;
    if (in <= 0 || out <= 0 || groups < 1 || in % groups || out % groups)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "%s: '%s' needs channels %lld and %lld > 0 divisible by "
                         "groups %d", fn, name ? name : "", (long long)in, (long long)out, groups);
    ws[0] = out; ws[1] = fan = in / groups;
    for (i = 0; i < nk; i++) {
        if (k[i] <= 0)
            return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "%s: '%s' has a kernel of %d", fn, name ? name : "", k[i]);
        ws[2 + i] = k[i];
        fan *= k[i];
    }
    *w = dtr__named_param(m, name, "weight", 2 + nk, ws, init, 0.0f);
    if (bias) *b = dtr__named_param(m, name, "bias", 1, &nb, DTR_INIT_UNIFORM, (float)(1.0 / sqrt((double)fan)));
    return dtr__layer_status(m);
}

/* the layer's fields from the arguments, the geometry's values checked */
static dtr_result dtr__conv2d_layer_setup(dtr_conv2d_layer *l, dtr_model *m, const char *name, const char *fn, int64_t in,
                                          int64_t out, int kh, int kw, const dtr_conv_config *cfg) {
    int a;
    memset(l, 0, sizeof(*l));
    l->conv = cfg ? *cfg : dtr_conv_config_init();
    l->in = in; l->out = out; l->kh = kh; l->kw = kw;
    for (a = 0; a < 2; a++)
        if (l->conv.stride[a] <= 0 || l->conv.padding[a] < 0 || l->conv.dilation[a] <= 0 || l->conv.output_padding[a] < 0)
            return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "%s: '%s' has stride %d, padding %d, dilation %d, "
                             "output padding %d", fn, name ? name : "", l->conv.stride[a], l->conv.padding[a],
                             l->conv.dilation[a], l->conv.output_padding[a]);
    return DTR_OK;
}

dtr_result dtr_conv2d_layer_init_ex(dtr_conv2d_layer *l, dtr_model *m, const char *name, int64_t in, int64_t out, int kh, int kw,
                                    const dtr_conv_config *cfg, int bias, dtr_init init) {
    const char *fn = "dtr_conv2d_layer_init";
    int k[2];
    if (!l || !m) return DTR_NULL_HANDLE;
    if (dtr__conv2d_layer_setup(l, m, name, fn, in, out, kh, kw, cfg) != DTR_OK) return dtr__layer_status(m);
    k[0] = kh, k[1] = kw;
    return dtr__conv_layer_params(m, name, fn, in, out, 2, k, l->conv.groups, bias, 0, init, &l->weight, &l->bias);
}

dtr_result dtr_conv_transpose2d_layer_init(dtr_conv2d_layer *l, dtr_model *m, const char *name, int64_t in, int64_t out,
                                           int kh, int kw, const dtr_conv_config *cfg, int bias, dtr_init init) {
    const char *fn = "dtr_conv_transpose2d_layer_init";
    int k[2];
    if (!l || !m) return DTR_NULL_HANDLE;
    if (dtr__conv2d_layer_setup(l, m, name, fn, in, out, kh, kw, cfg) != DTR_OK) return dtr__layer_status(m);
    l->transposed = 1;
    k[0] = kh, k[1] = kw;
    return dtr__conv_layer_params(m, name, fn, out, in, 2, k, l->conv.groups, bias, 1, init, &l->weight, &l->bias);
}

dtr_result dtr_conv2d_layer_init(dtr_conv2d_layer *l, dtr_model *m, const char *name, int64_t in, int64_t out, int k,
                                 int stride, int padding, dtr_init init) {
    dtr_conv_config c = dtr_conv_config_init();
    c.stride[0] = c.stride[1] = stride;
    c.padding[0] = c.padding[1] = padding;
    return dtr_conv2d_layer_init_ex(l, m, name, in, out, k, k, &c, 1, init);
}

dtr_tensor *dtr_conv2d_layer_forward(dtr_context *ctx, const dtr_conv2d_layer *l, dtr_tensor *x) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_conv2d_layer_forward: layer is NULL");
    return l->transposed ? dtr_conv_transpose2d(ctx, x, l->weight, l->bias, &l->conv)
                         : dtr_conv2d_ex(ctx, x, l->weight, l->bias, &l->conv);
}

dtr_result dtr_conv1d_layer_init(dtr_conv1d_layer *l, dtr_model *m, const char *name, int64_t in, int64_t out, int k,
                                 int stride, int padding, int dilation, int groups, int bias, dtr_init init) {
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    l->in = in; l->out = out; l->k = k;
    l->stride = stride; l->padding = padding; l->dilation = dilation; l->groups = groups;
    if (stride <= 0 || padding < 0 || dilation <= 0)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_conv1d_layer_init: '%s' has stride %d, padding %d, "
                         "dilation %d", name ? name : "", stride, padding, dilation);
    return dtr__conv_layer_params(m, name, "dtr_conv1d_layer_init", in, out, 1, &k, groups, bias, 0, init, &l->weight,
                                  &l->bias);
}

dtr_tensor *dtr_conv1d_layer_forward(dtr_context *ctx, const dtr_conv1d_layer *l, dtr_tensor *x) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_conv1d_layer_forward: layer is NULL");
    return dtr_conv1d(ctx, x, l->weight, l->bias, l->stride, l->padding, l->dilation, l->groups);
}

/* ---- layer norm, embedding ---- */

/* a norm's "<name>.weight" (C) = 1 and "<name>.bias" (C) = 0 (bias NULL: none) */
static dtr_result dtr__norm_params(dtr_model *m, const char *name, int64_t C, dtr_tensor **weight, dtr_tensor **bias) {
    *weight = dtr__named_param(m, name, "weight", 1, &C, DTR_INIT_ONES, 0.0f);
    if (bias) *bias = dtr__named_param(m, name, "bias", 1, &C, DTR_INIT_ZEROS, 0.0f);
    return dtr__layer_status(m);
}

dtr_result dtr_layernorm_layer_init(dtr_layernorm_layer *l, dtr_model *m, const char *name, int64_t dim) {
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (dim <= 0) return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_layernorm_layer_init: dim must be > 0");
    l->dim = dim;
    l->eps = 1e-5f;
    return dtr__norm_params(m, name, dim, &l->weight, &l->bias);
}

dtr_tensor *dtr_layernorm_layer_forward(dtr_context *ctx, const dtr_layernorm_layer *l, dtr_tensor *x) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_layernorm_layer_forward: layer is NULL");
    return dtr_layernorm(ctx, x, l->weight, l->bias, l->eps);
}

dtr_result dtr_rmsnorm_layer_init(dtr_rmsnorm_layer *l, dtr_model *m, const char *name, int64_t dim) {
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (dim <= 0) return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_rmsnorm_layer_init: dim must be > 0");
    l->dim = dim;
    l->eps = 1e-6f;
    return dtr__norm_params(m, name, dim, &l->weight, NULL);
}

dtr_tensor *dtr_rmsnorm_layer_forward(dtr_context *ctx, const dtr_rmsnorm_layer *l, dtr_tensor *x) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_rmsnorm_layer_forward: layer is NULL");
    return dtr_rmsnorm(ctx, x, l->weight, l->eps);
}

/* ---- batch norm ---- */

dtr_result dtr_batchnorm_layer_init(dtr_batchnorm_layer *l, dtr_model *m, const char *name, int64_t channels) {
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (channels <= 0)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_batchnorm_layer_init: '%s' needs channels > 0",
                         name ? name : "");
    l->channels = channels;
    l->eps = 1e-5f;
    l->momentum = 0.1f;
    dtr__norm_params(m, name, channels, &l->weight, &l->bias);
    l->running_mean = dtr__named_buffer(m, name, "running_mean", channels, 0.0f);
    l->running_var = dtr__named_buffer(m, name, "running_var", channels, 1.0f);
    return dtr__layer_status(m);
}

dtr_tensor *dtr_batchnorm_layer_forward(dtr_context *ctx, const dtr_batchnorm_layer *l, dtr_tensor *x) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_batchnorm_layer_forward: layer is NULL");
    return dtr_batch_norm(ctx, x, l->weight, l->bias, l->running_mean, l->running_var, ctx->training, l->momentum, l->eps);
}

/* ---- group norm ---- */

dtr_tensor *dtr_group_norm(dtr_context *ctx, dtr_tensor *x, int groups, dtr_tensor *w, dtr_tensor *b, float eps) {
    int64_t grouped[3], affine[DTR_MAX_DIMS];
    dtr_tensor *y;
    int d;
    if (!ctx) return NULL;
    if (!dtr__check_input(ctx, "dtr_group_norm", x, "x")) return NULL;
    if (x->ndim < 2 || groups <= 0 || x->shape[1] % groups)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_group_norm: x needs (N, C, ...) with C divisible by %d groups (C is %lld)",
                          groups, (long long)(x->ndim >= 2 ? x->shape[1] : 0));
    grouped[0] = x->shape[0], grouped[1] = groups, grouped[2] = -1;
    y = dtr_reshape(ctx, dtr_layernorm(ctx, dtr_reshape(ctx, x, 3, grouped), NULL, NULL, eps), x->ndim, x->shape);
    affine[0] = x->shape[1];   /* w, b (C) as (C, 1, ..., 1): one value a channel */
    for (d = 2; d < x->ndim; d++) affine[d - 1] = 1;
    if (w) y = dtr_mul(ctx, y, dtr_reshape(ctx, w, x->ndim - 1, affine));
    if (b) y = dtr_add(ctx, y, dtr_reshape(ctx, b, x->ndim - 1, affine));
    return y;
}

dtr_result dtr_groupnorm_layer_init(dtr_groupnorm_layer *l, dtr_model *m, const char *name, int groups, int64_t channels) {
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (groups <= 0 || channels <= 0 || channels % groups)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT,
                         "dtr_groupnorm_layer_init: '%s': %lld channels do not split into %d groups", name ? name : "",
                         (long long)channels, groups);
    l->groups = groups;
    l->channels = channels;
    l->eps = 1e-5f;
    return dtr__norm_params(m, name, channels, &l->weight, &l->bias);
}

dtr_tensor *dtr_groupnorm_layer_forward(dtr_context *ctx, const dtr_groupnorm_layer *l, dtr_tensor *x) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_groupnorm_layer_forward: layer is NULL");
    if (x && x->ndim >= 2 && x->shape[1] != l->channels)
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_groupnorm_layer_forward: x has %lld channels, the layer %lld",
                          (long long)x->shape[1], (long long)l->channels);
    return dtr_group_norm(ctx, x, l->groups, l->weight, l->bias, l->eps);
}

dtr_result dtr_embedding_layer_init(dtr_embedding_layer *l, dtr_model *m, const char *name, int64_t vocab, int64_t dim) {
    int64_t s[2];
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (vocab <= 0 || dim <= 0)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_embedding_layer_init: vocab and dim must be > 0");
    s[0] = vocab; s[1] = dim;
    l->vocab = vocab;
    l->dim = dim;
    l->weight = dtr__named_param(m, name, "weight", 2, s, DTR_INIT_NORMAL, 0.02f);
    return dtr__layer_status(m);
}

dtr_tensor *dtr_embedding_layer_forward(dtr_context *ctx, const dtr_embedding_layer *l, dtr_tensor *ids) {
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_embedding_layer_forward: layer is NULL");
    return dtr_embedding(ctx, l->weight, ids);
}

/* ---- attention and the GPT block ---- */

dtr_result dtr_attention_layer_init(dtr_attention_layer *l, dtr_model *m, const char *name, int64_t dim, int heads) {
    char sub[256];
    if (!l || !m) return DTR_NULL_HANDLE;
    memset(l, 0, sizeof(*l));
    if (dim <= 0 || heads <= 0 || dim % heads)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT, "dtr_attention_layer_init: %d heads must divide dim %lld",
                         heads, (long long)dim);
    l->dim = dim;
    l->heads = heads;
    l->causal = 1;
    dtr_linear_layer_init(&l->qkv, m, dtr__sub_name(sub, sizeof sub, name, "qkv"), dim, 3 * dim, 1, DTR_INIT_TORCH_DEFAULT);
    dtr_linear_layer_init(&l->proj, m, dtr__sub_name(sub, sizeof sub, name, "proj"), dim, dim, 1, DTR_INIT_TORCH_DEFAULT);
    return dtr__layer_status(m);
}

dtr_tensor *dtr_attention_layer_forward_cached(dtr_context *ctx, const dtr_attention_layer *l, dtr_tensor *x, dtr_kv_cache *cache,
                                               int layer) {
    dtr_tensor *qkv, *q, *k, *v;
    dtr_attention_config cfg;
    int64_t C;
    if (!ctx) return NULL;
    if (!l) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_attention_layer_forward: layer is NULL");
    C = l->dim;
    cfg = dtr_attention_config_init(l->heads, l->causal);
    cfg.dropout = l->dropout;
    qkv = dtr_linear_layer_forward(ctx, &l->qkv, x);   /* (B, T, 3C) */
    q = dtr_slice(ctx, qkv, -1, 0, C);
    k = dtr_slice(ctx, qkv, -1, C, 2 * C);
    v = dtr_slice(ctx, qkv, -1, 2 * C, 3 * C);
    x = dtr_linear_layer_forward(ctx, &l->proj, dtr__kv_attention(ctx, cache, layer, q, k, v, &cfg));
    return dtr_dropout(ctx, x, cache ? 0.0f : l->resid_dropout);
}

dtr_tensor *dtr_attention_layer_forward(dtr_context *ctx, const dtr_attention_layer *l, dtr_tensor *x) {
    return dtr_attention_layer_forward_cached(ctx, l, x, NULL, 0);
}

dtr_result dtr_gpt_block_init(dtr_gpt_block *b, dtr_model *m, const char *name, int64_t dim, int heads) {
    char sub[256];
    if (!b || !m) return DTR_NULL_HANDLE;
    memset(b, 0, sizeof(*b));
    dtr_layernorm_layer_init(&b->ln1, m, dtr__sub_name(sub, sizeof sub, name, "ln1"), dim);
    dtr_attention_layer_init(&b->attn, m, dtr__sub_name(sub, sizeof sub, name, "attn"), dim, heads);
    dtr_layernorm_layer_init(&b->ln2, m, dtr__sub_name(sub, sizeof sub, name, "ln2"), dim);
    dtr_linear_layer_init(&b->fc, m, dtr__sub_name(sub, sizeof sub, name, "fc"), dim, 4 * dim, 1, DTR_INIT_TORCH_DEFAULT);
    dtr_linear_layer_init(&b->fc_proj, m, dtr__sub_name(sub, sizeof sub, name, "fc_proj"), 4 * dim, dim, 1, DTR_INIT_TORCH_DEFAULT);
    return dtr__layer_status(m);
}

const char *dtr__sub_name(char *buf, size_t n, const char *prefix, const char *suffix) {
    snprintf(buf, n, "%s%s%s", prefix ? prefix : "", prefix && *prefix ? "." : "", suffix);
    return buf;
}

dtr_result dtr_llama_block_init(dtr_llama_block *b, dtr_model *m, const char *name, int64_t dim, int heads, int kv_heads,
                                int64_t hidden) {
    char sub[256];
    int64_t kvd;
    if (!b || !m) return DTR_NULL_HANDLE;
    memset(b, 0, sizeof(*b));
    if (dim <= 0 || hidden <= 0 || heads <= 0 || kv_heads <= 0 || dim % heads || (dim / heads) % 2 || heads % kv_heads)
        return dtr__fail(dtr_model_context(m), DTR_INVALID_ARGUMENT,
                         "dtr_llama_block_init: %d heads must divide dim %lld into even widths, %d kv_heads the heads, hidden %lld > 0",
                         heads, (long long)dim, kv_heads, (long long)hidden);
    b->dim = dim, b->hidden = hidden, b->heads = heads, b->kv_heads = kv_heads, b->rope_theta = 10000.0f;
    kvd = dim / heads * kv_heads;
    dtr_rmsnorm_layer_init(&b->attn_norm, m, dtr__sub_name(sub, sizeof sub, name, "input_layernorm"), dim);
    dtr_linear_layer_init(&b->q, m, dtr__sub_name(sub, sizeof sub, name, "self_attn.q_proj"), dim, dim, 0, DTR_INIT_TORCH_DEFAULT);
    dtr_linear_layer_init(&b->k, m, dtr__sub_name(sub, sizeof sub, name, "self_attn.k_proj"), dim, kvd, 0, DTR_INIT_TORCH_DEFAULT);
    dtr_linear_layer_init(&b->v, m, dtr__sub_name(sub, sizeof sub, name, "self_attn.v_proj"), dim, kvd, 0, DTR_INIT_TORCH_DEFAULT);
    dtr_linear_layer_init(&b->o, m, dtr__sub_name(sub, sizeof sub, name, "self_attn.o_proj"), dim, dim, 0, DTR_INIT_TORCH_DEFAULT);
    dtr_rmsnorm_layer_init(&b->mlp_norm, m, dtr__sub_name(sub, sizeof sub, name, "post_attention_layernorm"), dim);
    dtr_linear_layer_init(&b->gate, m, dtr__sub_name(sub, sizeof sub, name, "mlp.gate_proj"), dim, hidden, 0, DTR_INIT_TORCH_DEFAULT);
    dtr_linear_layer_init(&b->up, m, dtr__sub_name(sub, sizeof sub, name, "mlp.up_proj"), dim, hidden, 0, DTR_INIT_TORCH_DEFAULT);
    dtr_linear_layer_init(&b->down, m, dtr__sub_name(sub, sizeof sub, name, "mlp.down_proj"), hidden, dim, 0, DTR_INIT_TORCH_DEFAULT);
    return dtr__layer_status(m);
}

dtr_tensor *dtr_llama_block_forward_cached(dtr_context *ctx, const dtr_llama_block *b, dtr_tensor *x, dtr_kv_cache *cache,
                                           int layer) {
    dtr_tensor *h, *q, *k, *v;
    dtr_attention_config cfg;
    int64_t at = dtr_kv_cache_length(cache, layer);   /* the new rows' first position (0 without a cache) */
    if (!ctx) return NULL;
    if (!b || !b->heads) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_llama_block_forward: block is NULL or not initialised");
    cfg = dtr_attention_config_init(b->heads, 1);
    cfg.kv_heads = b->kv_heads;
    cfg.dropout = b->attention_dropout;
    h = dtr_rmsnorm_layer_forward(ctx, &b->attn_norm, x);
    q = dtr_rope_at(ctx, dtr_linear_layer_forward(ctx, &b->q, h), b->heads, b->rope_theta, 0, at);
    k = dtr_rope_at(ctx, dtr_linear_layer_forward(ctx, &b->k, h), b->kv_heads, b->rope_theta, 0, at);
    v = dtr_linear_layer_forward(ctx, &b->v, h);
    x = dtr_add(ctx, x, dtr_linear_layer_forward(ctx, &b->o, dtr__kv_attention(ctx, cache, layer, q, k, v, &cfg)));
    h = dtr_rmsnorm_layer_forward(ctx, &b->mlp_norm, x);
    h = dtr_mul(ctx, dtr_silu(ctx, dtr_linear_layer_forward(ctx, &b->gate, h)), dtr_linear_layer_forward(ctx, &b->up, h));
    return dtr_add(ctx, x, dtr_linear_layer_forward(ctx, &b->down, h));
}

dtr_tensor *dtr_llama_block_forward(dtr_context *ctx, const dtr_llama_block *b, dtr_tensor *x) {
    return dtr_llama_block_forward_cached(ctx, b, x, NULL, 0);
}

dtr_tensor *dtr_gpt_block_forward_cached(dtr_context *ctx, const dtr_gpt_block *b, dtr_tensor *x, dtr_kv_cache *cache, int layer) {
    dtr_attention_layer attn;
    dtr_tensor *h;
    if (!ctx) return NULL;
    if (!b) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_gpt_block_forward: block is NULL");
    attn = b->attn;
    if (b->dropout != 0.0f) attn.dropout = attn.resid_dropout = b->dropout;
    h = dtr_attention_layer_forward_cached(ctx, &attn, dtr_layernorm_layer_forward(ctx, &b->ln1, x), cache, layer);
    x = dtr_add(ctx, x, h);
    h = dtr_layernorm_layer_forward(ctx, &b->ln2, x);
    h = dtr_linear_layer_forward(ctx, &b->fc_proj, dtr_gelu(ctx, dtr_linear_layer_forward(ctx, &b->fc, h)));
    return dtr_add(ctx, x, dtr_dropout(ctx, h, cache ? 0.0f : b->dropout));
}

dtr_tensor *dtr_gpt_block_forward(dtr_context *ctx, const dtr_gpt_block *b, dtr_tensor *x) {
    return dtr_gpt_block_forward_cached(ctx, b, x, NULL, 0);
}
