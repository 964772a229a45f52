/* ============================================================================
 * Buffers of the memory kind a group's transport does not take, staged through the other:
 *  - device memory over a host transport (cfg.memory DTR_MEM_DEVICE on libfabric or local):
 *    a buffer in the device memory of cfg.context gets a host image in a page-locked block;
 *  - host memory over a device transport (NCCL): a host buffer gets an image in a block of
 *    the context's device memory (the engines' and the group's own small host buffers:
 *    split's table, sums of doubles, an app's host array).
 * The backend's `owns` tells the kinds apart. The input is copied to its image before the
 * operation starts (ordered after the work queued on the context's stream), the operation
 * runs on the images, and the output goes back when the caller learns that it completed (the
 * blocking call's return, dtr_request_test / _wait / _wait_any, or dtr_request_destroy).
 * Buffers of the transport's own kind pass as they are. A buffer inside the destination (in
 * place, the all-gather's own slot, the broadcast) shares the destination's image. Blocks
 * are kept for reuse until the group is destroyed (one per operation in flight).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../core/internal.h"
#include "comm_internal.h"

/* the input and output extents of a, in bytes */
static void dtr__stage_extents(const dtr_comm *c, const dtr__coll *a, size_t *in, size_t *out) {
    size_t b = a->count * dtr_dtype_size(a->dtype), n = (size_t)c->size;
    *in = *out = 0;
    switch (a->kind) {
    case DTR__OP_ALL_REDUCE: *in = *out = b; break;
    case DTR__OP_BROADCAST: *in = c->rank == a->root ? b : 0, *out = b; break;
    case DTR__OP_REDUCE_SCATTER: *in = b * n, *out = b; break;
    case DTR__OP_ALL_GATHER: *in = b, *out = b * n; break;
    case DTR__OP_SEND: *in = a->count; break;
    case DTR__OP_RECV: *out = a->count; break;
    default: break;
    }
}

/* a buffer of the other memory kind, that the group stages */
static int dtr__stage_foreign(const dtr_comm *c, const void *p) {
    return p && c->stage_ctx->backend->owns(c->stage_ctx, p) != c->stage_to_dev;
}

/* a free block of at least `bytes` (first fit), or a new one rounded up to 64 KiB: page-locked
   host memory, or device memory for a device transport */
static dtr__stage_blk *dtr__stage_get(dtr_comm *c, size_t bytes) {
    dtr_context *ctx = c->stage_ctx;
    dtr__stage_blk **pp, *b;
    pthread_mutex_lock(&c->mu);
    for (pp = &c->stage_free; *pp && (*pp)->bytes < bytes; pp = &(*pp)->next) {}
    b = *pp;
    if (b) *pp = b->next;
    pthread_mutex_unlock(&c->mu);
    if (b) return b;
    if (!(b = (dtr__stage_blk *)dtr__malloc(&c->ep->alloc, sizeof(*b)))) return NULL;
    b->bytes = (bytes + 65535) / 65536 * 65536;
    b->p = c->stage_to_dev ? ctx->backend->mem_alloc(ctx, b->bytes) : dtr__host_alloc(ctx, b->bytes);
    if (!b->p) {
        dtr__free(&c->ep->alloc, b);
        return NULL;
    }
    return b;
}

static void dtr__stage_put(dtr_comm *c, dtr__stage_blk *b) {
    pthread_mutex_lock(&c->mu);
    b->next = c->stage_free;
    c->stage_free = b;
    pthread_mutex_unlock(&c->mu);
}

void dtr__stage_free_all(dtr_comm *c) {
    dtr__stage_blk *b, *n;
    for (b = c->stage_free; b; b = n) {
        n = b->next;
        if (c->stage_to_dev) c->stage_ctx->backend->mem_free(c->stage_ctx, b->p);
        else dtr__host_free(c->stage_ctx, b->p);
        dtr__free(&c->ep->alloc, b);
    }
    c->stage_free = NULL;
}

/* bytes from a user buffer to its image (in) or back (out): across the host-device line */
static dtr_result dtr__stage_copy(dtr_comm *c, void *dst, const void *src, size_t bytes, int in) {
    dtr_context *ctx = c->stage_ctx;
    return in == c->stage_to_dev ? ctx->backend->from_host(ctx, dst, src, bytes) : ctx->backend->to_host(ctx, dst, src, bytes);
}

dtr_result dtr__stage_in(dtr_comm *c, dtr__coll *a, dtr__staged *s) {
    size_t in, out, at;
    const char *src = (const char *)a->src;
    char *dst = (char *)a->dst, *img;
    int sfor, dfor, inside;
    dtr_result r;
    memset(s, 0, sizeof(*s));
    if (!c->stage_ctx) return DTR_OK;
    dtr__stage_extents(c, a, &in, &out);
    dfor = out && dtr__stage_foreign(c, dst);
    inside = dfor && src >= dst && src < dst + out;
    sfor = !inside && in && dtr__stage_foreign(c, src);
    if (!dfor && !sfor) return DTR_OK;
    at = dfor ? (out + 255) / 256 * 256 : 0;   /* the input's image after the output's */
    if (!(s->blk = dtr__stage_get(c, at + (sfor ? in : 0))))
        return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory for %zu bytes of staging", at + in);
    img = (char *)s->blk->p;
    if (dfor) s->user_dst = dst, s->img_dst = img, s->dst_bytes = out, a->dst = img;
    if (inside || sfor) a->src = inside ? img + (src - dst) : img + at;
    r = in && (inside || sfor) ? dtr__stage_copy(c, (void *)a->src, src, in, 1) : DTR_OK;
    if (r != DTR_OK) {
        dtr__stage_put(c, s->blk);
        s->blk = NULL;
        return dtr__comm_fail(c, a, r, -1, 0, "staging a buffer (%s): %s", c->stage_to_dev ? "host to device" : "device to host",
                              dtr_context_last_error(c->stage_ctx));
    }
    return DTR_OK;
}

dtr_result dtr__stage_out(dtr_comm *c, const dtr__coll *a, dtr__staged *s, dtr_result r) {
    dtr_result cr = DTR_OK;
    if (!s->blk) return r;
    if (r == DTR_OK && s->user_dst) cr = dtr__stage_copy(c, s->user_dst, s->img_dst, s->dst_bytes, 0);
    dtr__stage_put(c, s->blk);
    memset(s, 0, sizeof(*s));
    if (cr != DTR_OK)
        return dtr__comm_fail(c, a, cr, -1, 0, "copying the result back (%s): %s",
                              c->stage_to_dev ? "device to host" : "host to device", dtr_context_last_error(c->stage_ctx));
    return r;
}
