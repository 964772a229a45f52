/* ============================================================================
 * Tensors: arena allocation, shape queries, host read/write, and the node recorder
 * every op builder goes through.
 * ==========================================================================*/
#include "../public/api.h"
#include "internal.h"
#include "../obs/obs_internal.h"

/* ---- shapes ---- */

int64_t dtr__numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    int i;
    for (i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

void dtr__contig_strides(int ndim, const int64_t *shape, int64_t *stride) {
    int64_t s = 1;
    int i;
    for (i = ndim - 1; i >= 0; i--) { stride[i] = s; s *= shape[i]; }
}

const char *dtr__shape_str(const dtr_tensor *t, char *buf, size_t n) {
    size_t len = 0;
    int i;
    if (!t) { snprintf(buf, n, "(null)"); return buf; }
    len += (size_t)snprintf(buf + len, n - len, "(");
    for (i = 0; i < t->ndim && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (len < n) snprintf(buf + len, n - len, ")");
    return buf;
}

/* ---- allocation ---- */

dtr_tensor *dtr__tensor_view(dtr_context *ctx, dtr_tensor *base, const char *op) {
    dtr_tensor *t = (dtr_tensor *)dtr__arena_meta(ctx, sizeof(dtr_tensor), op);
    if (!t) return NULL;
    *t = *base;
    if (!t->base) t->base = base;
    t->grad = NULL;
    t->node = NULL;
    t->flags = 0;
    t->param_index = -1;
    t->model = NULL;
    t->name = "";
    return t;
}

dtr_tensor *dtr__tensor_alloc(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape, const char *op) {
    dtr_tensor *t;
    int64_t n;
    int i;
    size_t es = dtr_dtype_size(dt);
    if (!es) return dtr__failt(ctx, DTR_DTYPE_MISMATCH, "%s: unknown dtype %d", op, (int)dt);
    if (ndim < 0 || ndim > DTR_MAX_DIMS)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: ndim %d outside 0..%d", op, ndim, DTR_MAX_DIMS);
    if (ndim && !shape) return dtr__failt(ctx, DTR_NULL_HANDLE, "%s: shape is NULL", op);
    for (i = 0; i < ndim; i++)
        if (shape[i] < 0 || shape[i] > ((int64_t)1 << 40))
            return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: dimension %d is %lld", op, i, (long long)shape[i]);
    n = dtr__numel(ndim, shape);
    if (n > ((int64_t)1 << 40)) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "%s: %lld elements is too many", op, (long long)n);
    t = (dtr_tensor *)dtr__arena_meta(ctx, sizeof(dtr_tensor), op);
    if (!t) return NULL;
    memset(t, 0, sizeof(*t));
    t->dtype = dt;
    t->ndim = ndim;
    for (i = 0; i < ndim; i++) t->shape[i] = shape[i];
    dtr__contig_strides(ndim, shape, t->stride);
    t->ctx = ctx;
    t->param_index = -1;
    t->name = "";
    t->flags = DTR__OWNS_DATA;
    t->storage = dtr__arena_data(ctx, (size_t)n * es, op);
    if (!t->storage) return NULL;
    return t;
}

dtr_tensor *dtr_tensor_new(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape) {
    if (!ctx) return NULL;
    return dtr__tensor_alloc(ctx, dt, ndim, shape, "dtr_tensor_new");
}

dtr_tensor *dtr_tensor_1d(dtr_context *ctx, int64_t n0) { return dtr_tensor_new(ctx, DTR_F32, 1, &n0); }
dtr_tensor *dtr_tensor_2d(dtr_context *ctx, int64_t n0, int64_t n1) {
    int64_t s[2]; s[0] = n0; s[1] = n1;
    return dtr_tensor_new(ctx, DTR_F32, 2, s);
}
dtr_tensor *dtr_tensor_3d(dtr_context *ctx, int64_t n0, int64_t n1, int64_t n2) {
    int64_t s[3]; s[0] = n0; s[1] = n1; s[2] = n2;
    return dtr_tensor_new(ctx, DTR_F32, 3, s);
}
dtr_tensor *dtr_tensor_4d(dtr_context *ctx, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
    int64_t s[4]; s[0] = n0; s[1] = n1; s[2] = n2; s[3] = n3;
    return dtr_tensor_new(ctx, DTR_F32, 4, s);
}

dtr_tensor *dtr_tensor_zeros(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape) {
    dtr_tensor *t = dtr_tensor_new(ctx, dt, ndim, shape);
    if (!t) return NULL;
    if (ctx->backend->memset0(ctx, t->storage, (size_t)dtr_tensor_numel(t) * dtr_dtype_size(dt)) != DTR_OK)
        return dtr__failt(ctx, DTR_UNSUPPORTED, "dtr_tensor_zeros: backend memset failed");
    return t;
}

dtr_tensor *dtr_tensor_full(dtr_context *ctx, int ndim, const int64_t *shape, float value) {
    dtr_tensor *t = dtr_tensor_new(ctx, DTR_F32, ndim, shape);
    int64_t i, n;
    float *tmp;
    if (!t) return NULL;
    n = dtr_tensor_numel(t);
    if (dtr__host_direct(ctx)) {
        for (i = 0; i < n; i++) dtr__f32(t)[i] = value;
        return t;
    }
    tmp = (float *)dtr__malloc(&ctx->alloc, (size_t)n * 4);
    if (!tmp) return dtr__failt(ctx, DTR_OUT_OF_MEMORY, "dtr_tensor_full: out of memory");
    for (i = 0; i < n; i++) tmp[i] = value;
    ctx->backend->from_host(ctx, t->storage, tmp, (size_t)n * 4);
    dtr__free(&ctx->alloc, tmp);
    return t;
}

dtr_tensor *dtr_tensor_from(dtr_context *ctx, dtr_dtype dt, int ndim, const int64_t *shape, const void *src) {
    dtr_tensor *t;
    if (!ctx) return NULL;
    if (!src) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_tensor_from: src is NULL");
    t = dtr_tensor_new(ctx, dt, ndim, shape);
    if (!t) return NULL;
    if (ctx->backend->from_host(ctx, t->storage, src, (size_t)dtr_tensor_numel(t) * dtr_dtype_size(dt)) != DTR_OK)
        return dtr__failt(ctx, DTR_UNSUPPORTED, "dtr_tensor_from: copy to the device failed");
    return t;
}

/* ---- queries ---- */

int dtr_tensor_ndim(const dtr_tensor *t) { return t ? t->ndim : 0; }

int64_t dtr_tensor_dim(const dtr_tensor *t, int axis) {
    if (!t) return 0;
    if (axis < 0) axis += t->ndim;
    if (axis < 0 || axis >= t->ndim) return 0;
    return t->shape[axis];
}

int64_t dtr_tensor_stride(const dtr_tensor *t, int axis) {
    if (!t) return 0;
    if (axis < 0) axis += t->ndim;
    if (axis < 0 || axis >= t->ndim) return 0;
    return t->stride[axis];
}

int64_t dtr_tensor_numel(const dtr_tensor *t) { return t ? dtr__numel(t->ndim, t->shape) : 0; }
dtr_dtype dtr_tensor_dtype(const dtr_tensor *t) { return t ? t->dtype : DTR_F32; }
const char *dtr_tensor_name(const dtr_tensor *t) { return t && t->name ? t->name : ""; }

int dtr_tensor_is_contiguous(const dtr_tensor *t) {
    int64_t s = 1;
    int i;
    if (!t) return 0;
    for (i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s) return 0;
        s *= t->shape[i];
    }
    return 1;
}

void *dtr_tensor_data(dtr_tensor *t) {
    if (!t || !t->storage || dtr__released(t)) return NULL;
    if (t->ctx && !dtr__host_memory(t->ctx)) return NULL;
    return (char *)t->storage + (size_t)t->offset * dtr_dtype_size(t->dtype);
}

float *dtr_tensor_grad(dtr_tensor *t) { return t ? t->grad : NULL; }

dtr_result dtr_tensor_retain_grad(dtr_tensor *t) {
    if (!t) return DTR_NULL_HANDLE;
    t->flags |= DTR__RETAIN_GRAD;
    return DTR_OK;
}

dtr_result dtr_tensor_retain(dtr_tensor *t) {
    if (!t) return DTR_NULL_HANDLE;
    if (dtr__released(t))
        return dtr__fail(t->ctx, DTR_BAD_STATE, "dtr_tensor_retain: the tensor was released by dtr_backward already");
    ((dtr_tensor *)dtr__owner(t))->flags |= DTR__RETAIN;
    return DTR_OK;
}

/* DTR_BAD_STATE naming fn when t's values are gone: its storage released by backward
   (release_activations), or a parameter on other ranks (ZeRO-3); else DTR_OK */
static dtr_result dtr__check_live(const dtr_tensor *t, const char *fn) {
    if (!dtr__released(t)) return dtr__param_present(t, fn);
    return dtr__fail(t->ctx, DTR_BAD_STATE, "%s: the tensor was released by dtr_backward (release_activations); "
                     "keep it with dtr_tensor_retain before the backward pass", fn);
}

dtr_result dtr_tensor_read_grad(const dtr_tensor *t, float *dst, size_t n) {
    if (!t || !dst) return DTR_NULL_HANDLE;
    if (!t->grad) return dtr__fail(t->ctx, DTR_BAD_STATE, "dtr_tensor_read_grad: the tensor has no gradient");
    if ((int64_t)n != dtr_tensor_numel(t))
        return dtr__fail(t->ctx, DTR_SHAPE_MISMATCH, "dtr_tensor_read_grad: %zu elements asked, tensor has %lld", n,
                         (long long)dtr_tensor_numel(t));
    if (n == 0) return DTR_OK;
    if (dtr__host_direct(t->ctx)) {
        memcpy(dst, t->grad, n * sizeof(float));
        return DTR_OK;
    }
    return t->ctx->backend->to_host(t->ctx, dst, t->grad, n * sizeof(float));
}

dtr_tensor *dtr_tensor_requires_grad(dtr_tensor *t) {
    if (!t) return NULL;
    if (!dtr__is_float(t->dtype))
        return dtr__failt(t->ctx, DTR_DTYPE_MISMATCH, "dtr_tensor_requires_grad: only f32, bf16 and f16 tensors have "
                          "gradients (got %s)", dtr_dtype_name(t->dtype));
    t->flags |= DTR__REQUIRES_GRAD | DTR__LEAF;
    return t;
}

/* Gathers a (possibly strided) view into dense row-major `dst` of element size es, reading
   element offset `off` of the view at base + (off - first) * es: the storage itself (first 0),
   or a host copy of the elements the view spans starting at `first` (device views). */
static void dtr__gather(const dtr_tensor *t, const void *base, int64_t first, void *dst, size_t es) {
    int64_t n = dtr__numel(t->ndim, t->shape), i;
    int64_t idx[DTR_MAX_DIMS] = {0};
    char *out = (char *)dst;
    int d;
    for (i = 0; i < n; i++) {
        int64_t off = t->offset - first;
        for (d = 0; d < t->ndim; d++) off += idx[d] * t->stride[d];
        memcpy(out + (size_t)i * es, (const char *)base + (size_t)off * es, es);
        for (d = t->ndim - 1; d >= 0; d--) { if (++idx[d] < t->shape[d]) break; idx[d] = 0; }
    }
}

/* A device view read: the storage it spans copied to the host, then gathered there. */
static dtr_result dtr__gather_device(const dtr_tensor *t, void *dst, size_t es) {
    dtr_context *ctx = t->ctx;
    int64_t span = 1;
    void *tmp;
    dtr_result r;
    int d;
    for (d = 0; d < t->ndim; d++) span += (t->shape[d] - 1) * t->stride[d];
    tmp = dtr__malloc(&ctx->alloc, (size_t)span * es);
    if (!tmp) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_tensor_read: out of memory");
    r = ctx->backend->to_host(ctx, tmp, (const char *)t->storage + (size_t)t->offset * es, (size_t)span * es);
    if (r == DTR_OK) dtr__gather(t, tmp, t->offset, dst, es);
    dtr__free(&ctx->alloc, tmp);
    return r;
}

dtr_result dtr_tensor_read(const dtr_tensor *t, dtr_dtype dt, void *dst, size_t n) {
    dtr_context *ctx;
    size_t es, bytes;
    void *tmp = NULL;
    const void *src;
    dtr_result r;
    if (!t || !dst) return DTR_NULL_HANDLE;
    ctx = t->ctx;
    if ((r = dtr__check_live(t, "dtr_tensor_read")) != DTR_OK) return r;
    /* a parameter of a model not built yet: build it, as the ops do */
    if (!t->storage && t->model && (r = dtr_model_build(t->model)) != DTR_OK) return r;
    if ((int64_t)n != dtr_tensor_numel(t))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_tensor_read: %zu elements asked, tensor has %lld", n,
                         (long long)dtr_tensor_numel(t));
    if (n == 0) return DTR_OK;
    es = dtr_dtype_size(t->dtype);
    bytes = n * es;
    if (dtr__host_direct(ctx) && dtr_tensor_is_contiguous(t)) {
        src = (const char *)t->storage + (size_t)t->offset * es;
    } else {
        tmp = dtr__malloc(&ctx->alloc, bytes);
        if (!tmp) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_tensor_read: out of memory");
        if (dtr__host_direct(ctx)) {
            dtr__gather(t, t->storage, 0, tmp, es);
        } else {
            r = dtr_tensor_is_contiguous(t)
                    ? ctx->backend->to_host(ctx, tmp, (const char *)t->storage + (size_t)t->offset * es, bytes)
                    : dtr__gather_device(t, tmp, es);
            if (r != DTR_OK) { dtr__free(&ctx->alloc, tmp); return dtr__fail(ctx, r, "dtr_tensor_read: copy failed"); }
        }
        src = tmp;
    }
    r = dtr_convert(dst, dt, src, t->dtype, n);
    dtr__free(&ctx->alloc, tmp);
    return r;
}

dtr_result dtr_tensor_write(dtr_tensor *t, dtr_dtype dt, const void *src, size_t n) {
    dtr_context *ctx;
    size_t es;
    void *tmp;
    dtr_result r;
    if (!t || !src) return DTR_NULL_HANDLE;
    ctx = t->ctx;
    if ((r = dtr__check_live(t, "dtr_tensor_write")) != DTR_OK) return r;
    if (!t->storage && t->model && (r = dtr_model_build(t->model)) != DTR_OK) return r;
    if ((int64_t)n != dtr_tensor_numel(t))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_tensor_write: %zu elements given, tensor has %lld", n,
                         (long long)dtr_tensor_numel(t));
    if (!dtr_tensor_is_contiguous(t))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_tensor_write: the tensor is a non-contiguous view");
    es = dtr_dtype_size(t->dtype);
    if (dtr__host_direct(ctx))
        return dtr_convert((char *)t->storage + (size_t)t->offset * es, t->dtype, src, dt, n);
    tmp = dtr__malloc(&ctx->alloc, n * es);
    if (!tmp) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_tensor_write: out of memory");
    r = dtr_convert(tmp, t->dtype, src, dt, n);
    if (r == DTR_OK) r = ctx->backend->from_host(ctx, (char *)t->storage + (size_t)t->offset * es, tmp, n * es);
    dtr__free(&ctx->alloc, tmp);
    return r;
}

dtr_result dtr_tensor_copy(dtr_tensor *dst, const dtr_tensor *src) {
    dtr_context *ctx;
    size_t es;
    dtr_result r;
    if (!dst || !src) return DTR_NULL_HANDLE;
    ctx = dst->ctx;
    if (src->ctx != ctx) return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_tensor_copy: the tensors belong to two contexts");
    if ((r = dtr__check_live(dst, "dtr_tensor_copy")) != DTR_OK || (r = dtr__check_live(src, "dtr_tensor_copy")) != DTR_OK)
        return r;
    if (!dst->storage && dst->model && (r = dtr_model_build(dst->model)) != DTR_OK) return r;
    if (!src->storage && src->model && (r = dtr_model_build(src->model)) != DTR_OK) return r;
    if (dst->dtype != src->dtype)
        return dtr__fail(ctx, DTR_INVALID_ARGUMENT, "dtr_tensor_copy: dtype %s into %s", dtr_dtype_name(src->dtype),
                         dtr_dtype_name(dst->dtype));
    if (dtr_tensor_numel(dst) != dtr_tensor_numel(src))
        return dtr__fail(ctx, DTR_SHAPE_MISMATCH, "dtr_tensor_copy: %lld elements into %lld", (long long)dtr_tensor_numel(src),
                         (long long)dtr_tensor_numel(dst));
    if (!dtr_tensor_is_contiguous(dst) || !dtr_tensor_is_contiguous(src))
        return dtr__fail(ctx, DTR_UNSUPPORTED, "dtr_tensor_copy: a non-contiguous view (dtr_contiguous first)");
    es = dtr_dtype_size(dst->dtype);
    r = dtr__mem_copy(ctx, (char *)dst->storage + (size_t)dst->offset * es, (const char *)src->storage + (size_t)src->offset * es,
                      (size_t)dtr_tensor_numel(dst) * es);
    return r == DTR_OK ? DTR_OK : dtr__fail(ctx, r, "dtr_tensor_copy: the copy failed");
}

float dtr_tensor_get(const dtr_tensor *t, int64_t index) {
    int64_t off, rem;
    int d;
    float f = 0.0f;
    if (!t || index < 0 || index >= dtr_tensor_numel(t)) return 0.0f;
    if (dtr__check_live(t, "dtr_tensor_get") != DTR_OK) return NAN;
    off = t->offset;
    rem = index;
    for (d = t->ndim - 1; d >= 0; d--) {
        off += (rem % t->shape[d]) * t->stride[d];
        rem /= t->shape[d];
    }
    if (dtr__host_direct(t->ctx)) {
        dtr_convert(&f, DTR_F32, (const char *)t->storage + (size_t)off * dtr_dtype_size(t->dtype), t->dtype, 1);
    } else {
        unsigned char buf[8];
        if (t->ctx->backend->to_host(t->ctx, buf, (const char *)t->storage + (size_t)off * dtr_dtype_size(t->dtype),
                                     dtr_dtype_size(t->dtype)) == DTR_OK)
            dtr_convert(&f, DTR_F32, buf, t->dtype, 1);
    }
    return f;
}

/* ---- gradients and the recorder ---- */

dtr_result dtr__grad_ensure(dtr_context *ctx, dtr_tensor *t) {
    size_t bytes;
    if (t->grad) return DTR_OK;
    bytes = (size_t)dtr_tensor_numel(t) * sizeof(float);
    dtr__grad_spare_mark(ctx, t);
    t->grad = (float *)dtr__arena_data(ctx, bytes, "backward");
    if (!t->grad) return ctx->status;
    return ctx->backend->memset0(ctx, t->grad, bytes);
}

#define DTR__OP_NAME(id, name, kernels) name,
static const char *const dtr__op_names[DTR_OP_COUNT] = {"none", DTR__OP_LIST(DTR__OP_NAME)};
#undef DTR__OP_NAME

const char *dtr__op_name(int op) { return op >= 0 && op < DTR_OP_COUNT ? dtr__op_names[op] : "?"; }

dtr__node *dtr__node_new(dtr_context *ctx, int op, int n_in, dtr_tensor *const *in) {
    int i;
    dtr__node *n = (dtr__node *)dtr__arena_meta(ctx, sizeof(dtr__node), dtr__op_name(op));
    if (!n) return NULL;
    memset(n, 0, sizeof(*n));
    n->op = op;
    n->n_in = n_in;
    n->in = n->in_inline;
    if (n_in > DTR__INLINE_INPUTS) {
        n->in = (dtr_tensor **)dtr__arena_meta(ctx, (size_t)n_in * sizeof(dtr_tensor *), dtr__op_name(op));
        if (!n->in) return NULL;
    }
    if (n_in > 0) memcpy(n->in, in, (size_t)n_in * sizeof(dtr_tensor *));
    if ((i = dtr__released_input(n)) >= 0) {
        dtr__fail(ctx, DTR_BAD_STATE, "%s: input %d was released by dtr_backward (release_activations); "
                  "keep it with dtr_tensor_retain", dtr__op_name(op), i);
        return NULL;
    }
    return n;
}

static int dtr__node_needs_grad(const dtr_context *ctx, const dtr__node *node) {
    int i;
    if (!ctx->grad_enabled) return 0;
    if (!dtr__is_float(node->out->dtype)) return 0;
    for (i = 0; i < node->n_in; i++)
        if (node->in[i] && (node->in[i]->flags & DTR__REQUIRES_GRAD)) return 1;
    return 0;
}

dtr_result dtr__param_present(const dtr_tensor *t, const char *fn) {
    t = dtr__owner(t);
    if (!(t->flags & DTR__ABSENT)) return DTR_OK;
    return dtr__fail(t->ctx, DTR_BAD_STATE, "%s: parameter '%s' is sharded over the data-parallel group (ZeRO-3): "
                     "call dtr_dp_gather_params on every rank first", fn, t->name ? t->name : "?");
}

dtr_result dtr__fetch_params(dtr_context *ctx, dtr__node *n) {
    int i;
    for (i = 0; i < n->n_in; i++)
        if (n->in[i] && (dtr__owner(n->in[i])->flags & DTR__ABSENT)) break;
    if (i == n->n_in) return DTR_OK;
    if (!ctx->param_fetch) return dtr__param_present(n->in[i], dtr__op_name(n->op));
    return ctx->param_fetch(ctx->param_fetch_user, n);
}

dtr_tensor *dtr__record(dtr_context *ctx, dtr__node *node, const char *opname) {
    dtr_result r;
    double t0 = 0.0;
    if (ctx->status != DTR_OK) return NULL;
    if (dtr__fetch_params(ctx, node) != DTR_OK) return NULL;   /* ZeRO-3: parameters on other ranks */
    node->taped = dtr__node_needs_grad(ctx, node);
    if (ctx->obs) t0 = dtr__obs_now();
    r = ctx->backend->forward(ctx, node);
    if (ctx->obs) dtr__obs_op(ctx->obs, node, 0, t0, dtr__obs_now());
    if (r != DTR_OK) {
        if (ctx->status == DTR_OK) dtr__fail(ctx, r, "%s: forward kernel of op '%s' failed", opname, dtr__op_name(node->op));
        return NULL;
    }
    if (node->taped) {
        node->out->flags |= DTR__REQUIRES_GRAD;
        node->out->node = node;
        node->tape = ctx->cur;
        node->prev = ctx->cur->head;
        ctx->cur->head = node;
    }
    if (ctx->anomaly && dtr__anomaly_forward(ctx, node) != DTR_OK) return NULL;
    return node->out;
}

/* ---- input checks shared by the op builders ---- */

int dtr__check_input(dtr_context *ctx, const char *op, const dtr_tensor *x, const char *what) {
    if (!x) {
        if (ctx->status == DTR_OK) dtr__fail(ctx, DTR_NULL_HANDLE, "%s: %s is NULL", op, what);
        return 0;
    }
    if (!dtr__is_float(x->dtype)) {
        dtr__fail(ctx, DTR_DTYPE_MISMATCH, "%s: %s must be f32, bf16 or f16, is %s", op, what, dtr_dtype_name(x->dtype));
        return 0;
    }
    if (x->ctx != ctx) {
        dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: %s belongs to another context", op, what);
        return 0;
    }
    if (!x->storage && x->model && dtr_model_build(x->model) != DTR_OK) return 0;
    if (!x->storage && x->model) {
        dtr__fail(ctx, DTR_INVALID_ARGUMENT, "%s: parameter '%s' is not part of this model (dtr_model_keep left it out)", op, x->name);
        return 0;
    }
    return 1;
}

dtr_tensor *dtr__contig_input(dtr_context *ctx, dtr_tensor *x) {
    return dtr_tensor_is_contiguous(x) ? x : dtr_contiguous(ctx, x);
}
