/* ============================================================================
 * Views and copies: reshape, permute/transpose, slice (no copy), concat and contiguous
 * (copies). A view shares its input's storage and has its own dense gradient; its backward
 * adds that gradient into the input's at the positions the view covers.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"

/* Runs the body for every element of a tensor of shape (nd, shape) in row-major order with
 * `off` = the offset given by `stride` from `base` (and `i` = the flat index): a tight loop
 * along the last axis, the other axes counted once a row. */
#define DTR__FOR_EACH(nd, shape, stride, base, ...)                                       \
    do {                                                                                  \
        int64_t ix_[DTR_MAX_DIMS] = {0}, n_ = dtr__numel((nd), (shape)), i = 0, off;      \
        int64_t row_ = (base), in_ = (nd) > 0 ? (shape)[(nd) - 1] : 1;                    \
        int64_t st_ = (nd) > 0 ? (stride)[(nd) - 1] : 0, k_;                              \
        int d_;                                                                           \
        while (i < n_) {                                                                  \
            for (k_ = 0, off = row_; k_ < in_; k_++, i++, off += st_) { __VA_ARGS__; }    \
            for (d_ = (nd) - 2; d_ >= 0; d_--) {                                          \
                row_ += (stride)[d_];                                                     \
                if (++ix_[d_] < (shape)[d_]) break;                                       \
                row_ -= (stride)[d_] * ix_[d_];                                           \
                ix_[d_] = 0;                                                              \
            }                                                                             \
        }                                                                                 \
    } while (0)

static dtr_tensor *dtr__view_record(dtr_context *ctx, dtr__node *n, dtr_tensor *v, const char *name) {
    n->out = v;
    return dtr__record(ctx, n, name);
}

/* ---- reshape ---- */

dtr_tensor *dtr_reshape(dtr_context *ctx, dtr_tensor *x, int ndim, const int64_t *shape) {
    int64_t s[DTR_MAX_DIMS], known = 1;
    int d, infer = -1;
    dtr_tensor *v;
    dtr__node *n;
    char s1[96];
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_reshape: x is NULL");
    if (ndim < 0 || ndim > DTR_MAX_DIMS || (ndim && !shape))
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_reshape: bad shape (ndim %d)", ndim);
    for (d = 0; d < ndim; d++) {
        s[d] = shape[d];
        if (s[d] == -1) {
            if (infer >= 0) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_reshape: more than one -1");
            infer = d;
        } else if (s[d] < 0) {
            return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_reshape: dimension %d is %lld", d, (long long)s[d]);
        } else {
            known *= s[d];
        }
    }
    if (infer >= 0) s[infer] = known ? dtr_tensor_numel(x) / known : 0;
    if (dtr__numel(ndim, s) != dtr_tensor_numel(x))
        return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_reshape: cannot view %s (%lld elements) as %lld elements",
                          dtr__shape_str(x, s1, sizeof s1), (long long)dtr_tensor_numel(x), (long long)dtr__numel(ndim, s));
    x = dtr__contig_input(ctx, x);
    if (!x) return NULL;
    n = dtr__node_new(ctx, DTR_OP_RESHAPE, 1, &x);
    v = dtr__tensor_view(ctx, x, "dtr_reshape");
    if (!n || !v) return NULL;
    v->ndim = ndim;
    for (d = 0; d < ndim; d++) v->shape[d] = s[d];
    dtr__contig_strides(ndim, s, v->stride);
    return dtr__view_record(ctx, n, v, "dtr_reshape");
}

/* ---- permute, transpose ---- */

dtr_tensor *dtr_permute(dtr_context *ctx, dtr_tensor *x, const int *perm) {
    int seen[DTR_MAX_DIMS] = {0}, d;
    dtr_tensor *v;
    dtr__node *n;
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_permute: x is NULL");
    if (!perm && x->ndim) return dtr__failt(ctx, DTR_NULL_HANDLE, "dtr_permute: perm is NULL");
    for (d = 0; d < x->ndim; d++) {
        if (perm[d] < 0 || perm[d] >= x->ndim || seen[perm[d]])
            return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_permute: entry %d (%d) is not a permutation of %d axes", d,
                              perm[d], x->ndim);
        seen[perm[d]] = 1;
    }
    n = dtr__node_new(ctx, DTR_OP_PERMUTE, 1, &x);
    v = dtr__tensor_view(ctx, x, "dtr_permute");
    if (!n || !v) return NULL;
    for (d = 0; d < x->ndim; d++) {
        v->shape[d] = x->shape[perm[d]];
        v->stride[d] = x->stride[perm[d]];
        n->p.view.perm[d] = perm[d];
    }
    return dtr__view_record(ctx, n, v, "dtr_permute");
}

dtr_tensor *dtr_transpose(dtr_context *ctx, dtr_tensor *x, int axis0, int axis1) {
    int perm[DTR_MAX_DIMS], d, t;
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_transpose: x is NULL");
    if (axis0 < 0) axis0 += x->ndim;
    if (axis1 < 0) axis1 += x->ndim;
    if (axis0 < 0 || axis1 < 0 || axis0 >= x->ndim || axis1 >= x->ndim)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_transpose: axes %d, %d outside %d dims", axis0, axis1, x->ndim);
    for (d = 0; d < x->ndim; d++) perm[d] = d;
    t = perm[axis0]; perm[axis0] = perm[axis1]; perm[axis1] = t;
    return dtr_permute(ctx, x, perm);
}

/* ---- slice ---- */

dtr_tensor *dtr_slice(dtr_context *ctx, dtr_tensor *x, int axis, int64_t start, int64_t end) {
    dtr_tensor *v;
    dtr__node *n;
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_slice: x is NULL");
    if (axis < 0) axis += x->ndim;
    if (axis < 0 || axis >= x->ndim) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_slice: axis outside %d dims", x->ndim);
    if (start < 0) start += x->shape[axis];
    if (end < 0) end += x->shape[axis];
    if (start < 0 || end > x->shape[axis] || start > end)
        return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_slice: [%lld, %lld) outside axis %d of size %lld", (long long)start,
                          (long long)end, axis, (long long)x->shape[axis]);
    n = dtr__node_new(ctx, DTR_OP_SLICE, 1, &x);
    v = dtr__tensor_view(ctx, x, "dtr_slice");
    if (!n || !v) return NULL;
    v->shape[axis] = end - start;
    v->offset += start * x->stride[axis];
    n->p.view.axis = axis;
    n->p.view.start = start;
    return dtr__view_record(ctx, n, v, "dtr_slice");
}

/* ---- contiguous ---- */

dtr_tensor *dtr_contiguous(dtr_context *ctx, dtr_tensor *x) {
    dtr__node *n;
    if (!ctx) return NULL;
    if (!x) return dtr__failt(ctx, ctx->status ? ctx->status : DTR_NULL_HANDLE, "dtr_contiguous: x is NULL");
    if (dtr_tensor_is_contiguous(x)) return x;
    n = dtr__node_new(ctx, DTR_OP_CONTIGUOUS, 1, &x);
    if (!n) return NULL;
    n->out = dtr__tensor_alloc(ctx, x->dtype, x->ndim, x->shape, "dtr_contiguous");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_contiguous");
}

/* ---- concat ---- */

dtr_tensor *dtr_concat(dtr_context *ctx, dtr_tensor *const *xs, int count, int axis) {
    dtr__node *n;
    int64_t shape[DTR_MAX_DIMS];
    char s1[96], s2[96];
    int i, d, ndim;
    if (!ctx) return NULL;
    if (!xs || count < 1) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_concat: no inputs");
    for (i = 0; i < count; i++)
        if (!dtr__check_input(ctx, "dtr_concat", xs[i], "an input")) return NULL;
    ndim = xs[0]->ndim;
    if (axis < 0) axis += ndim;
    if (axis < 0 || axis >= ndim) return dtr__failt(ctx, DTR_INVALID_ARGUMENT, "dtr_concat: axis outside %d dims", ndim);
    for (d = 0; d < ndim; d++) shape[d] = xs[0]->shape[d];
    shape[axis] = 0;
    for (i = 0; i < count; i++) {
        if (xs[i]->ndim != ndim) goto mismatch;
        for (d = 0; d < ndim; d++)
            if (d != axis && xs[i]->shape[d] != shape[d]) goto mismatch;
        shape[axis] += xs[i]->shape[axis];
    }
    n = dtr__node_new(ctx, DTR_OP_CONCAT, count, xs);
    if (!n) return NULL;
    n->p.view.axis = axis;
    n->out = dtr__tensor_alloc(ctx, dtr__act_dtype(ctx), ndim, shape, "dtr_concat");
    if (!n->out) return NULL;
    return dtr__record(ctx, n, "dtr_concat");
mismatch:
    return dtr__failt(ctx, DTR_SHAPE_MISMATCH, "dtr_concat: input %d %s does not match %s outside axis %d", i,
                      dtr__shape_str(xs[i], s1, sizeof s1), dtr__shape_str(xs[0], s2, sizeof s2), axis);
}

/* ---- CPU kernels ---- */

/* dst (dense, in x's order) = x's elements: a row (the last axis) at a time, one memcpy a row
   where the row's elements are adjacent (a permute or slice that keeps the last axis), else
   element by element as the element's size allows */
static void dtr__contig_copy(const dtr_tensor *x, char *dst) {
    size_t es = dtr_dtype_size(x->dtype);
    const char *src = (const char *)x->storage;
    int64_t in = x->ndim ? x->shape[x->ndim - 1] : 1;
    if (x->ndim && x->stride[x->ndim - 1] == 1)
        DTR__FOR_EACH(x->ndim - 1, x->shape, x->stride, x->offset,
                      memcpy(dst + (size_t)(i * in) * es, src + (size_t)off * es, (size_t)in * es));
    else if (es == 4)
        DTR__FOR_EACH(x->ndim, x->shape, x->stride, x->offset, ((uint32_t *)dst)[i] = ((const uint32_t *)src)[off]);
    else if (es == 2)
        DTR__FOR_EACH(x->ndim, x->shape, x->stride, x->offset, ((uint16_t *)dst)[i] = ((const uint16_t *)src)[off]);
    else
        DTR__FOR_EACH(x->ndim, x->shape, x->stride, x->offset, memcpy(dst + (size_t)i * es, src + (size_t)off * es, es));
}

dtr_result dtr__cpu_view_fwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    (void)ctx;
    if (nd->op == DTR_OP_CONTIGUOUS) {
        dtr__contig_copy(x, (char *)dtr__data(nd->out));
    } else if (nd->op == DTR_OP_CONCAT) {
        int k, axis = nd->p.view.axis;
        int64_t ostr[DTR_MAX_DIMS], base = 0;
        float *Y = dtr__f32(nd->out);
        memcpy(ostr, nd->out->stride, sizeof(ostr));
        for (k = 0; k < nd->n_in; k++) {
            const dtr_tensor *p = nd->in[k];
            const float *X = (const float *)p->storage;
            int64_t xo = p->offset;
            /* walk the input; the output offset follows with the output's strides */
            int64_t ix[DTR_MAX_DIMS] = {0}, cnt = dtr_tensor_numel(p), i;
            int d;
            for (i = 0; i < cnt; i++) {
                int64_t ooff = base, xoff = xo;
                for (d = 0; d < p->ndim; d++) { ooff += ix[d] * ostr[d]; xoff += ix[d] * p->stride[d]; }
                Y[ooff] = X[xoff];
                for (d = p->ndim - 1; d >= 0; d--) { if (++ix[d] < p->shape[d]) break; ix[d] = 0; }
            }
            base += p->shape[axis] * ostr[axis];
        }
    }
    /* reshape, permute and slice are views: nothing to compute */
    return DTR_OK;
}

dtr_result dtr__cpu_view_bwd(dtr_context *ctx, dtr__node *nd) {
    const dtr_tensor *x = nd->in[0];
    const float *g = nd->out->grad;
    int64_t cs[DTR_MAX_DIMS], gs[DTR_MAX_DIMS];
    float *gx;
    int d;
    if (nd->op == DTR_OP_CONCAT) {
        int k, axis = nd->p.view.axis;
        int64_t base = 0;
        for (k = 0; k < nd->n_in; k++) {
            const dtr_tensor *p = nd->in[k];
            float *gp = dtr__gradof(p);
            if (gp) {
                /* gp (dense) += the block of g at `base` along axis */
                DTR__FOR_EACH(p->ndim, p->shape, nd->out->stride, base, gp[i] += g[off]);
            }
            base += p->shape[axis] * nd->out->stride[axis];
        }
        return DTR_OK;
    }
    gx = dtr__gradof(x);
    if (!gx) return DTR_OK;
    dtr__contig_strides(x->ndim, x->shape, cs);
    switch (nd->op) {
    case DTR_OP_RESHAPE:
    case DTR_OP_CONTIGUOUS:   /* the view's own dense gradient, in x's order */
        dtr__add_into(ctx->pool, gx, g, dtr_tensor_numel(x));
        break;
    case DTR_OP_PERMUTE:
        for (d = 0; d < x->ndim; d++) gs[d] = cs[nd->p.view.perm[d]];
        DTR__FOR_EACH(nd->out->ndim, nd->out->shape, gs, 0, gx[off] += g[i]);
        break;
    case DTR_OP_SLICE:
        DTR__FOR_EACH(nd->out->ndim, nd->out->shape, cs, nd->p.view.start * cs[nd->p.view.axis], gx[off] += g[i]);
        break;
    default: break;
    }
    return DTR_OK;
}
