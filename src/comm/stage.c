/* ============================================================================
 * Device buffers over a host-memory transport: a group made with cfg.memory DTR_MEM_DEVICE
 * on a transport that takes host memory only (libfabric, local) stages them. Each call's
 * buffers that lie in the device memory of cfg.context (the backend's `owns`) get a host
 * image in a page-locked block of the group: the input is copied there before the operation
 * starts (the copy waits for the work queued on the context's stream, so the operation sees
 * it), the operation runs on the images with the host code, and the output goes back to the
 * device when the caller learns that it completed (the blocking call's return,
 * dtr_request_test / _wait / _wait_any, or dtr_request_destroy). Buffers in host memory pass
 * as they are, so the engines' own host staging and the group's internal traffic (split,
 * sums of doubles) go through unchanged. A buffer inside the destination (in place, the
 * all-gather's own slot, the broadcast) shares the destination's image.
 * Blocks are kept for reuse until the group is destroyed (one per operation in flight).
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

static int dtr__stage_owned(const dtr_comm *c, const void *p) {
    return p && c->stage_ctx->backend->owns(c->stage_ctx, p);
}

/* a free block of at least `bytes` (first fit), or a new one rounded up to 64 KiB */
static dtr__stage_blk *dtr__stage_get(dtr_comm *c, size_t bytes) {
    dtr__stage_blk **pp, *b;
    pthread_mutex_lock(&c->mu);
    for (pp = &c->stage_free; *pp && (*pp)->bytes < bytes; pp = &(*pp)->next) {}
    b = *pp;
    if (b) *pp = b->next;
    pthread_mutex_unlock(&c->mu);
    if (b) return b;
    if (!(b = (dtr__stage_blk *)dtr__malloc(&c->ep->alloc, sizeof(*b)))) return NULL;
    b->bytes = (bytes + 65535) / 65536 * 65536;
    if (!(b->p = dtr__host_alloc(c->stage_ctx, b->bytes))) {
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
        dtr__host_free(c->stage_ctx, b->p);
        dtr__free(&c->ep->alloc, b);
    }
    c->stage_free = NULL;
}

dtr_result dtr__stage_in(dtr_comm *c, dtr__coll *a, dtr__staged *s) {
    size_t in, out, at;
    const char *src = (const char *)a->src;
    char *dst = (char *)a->dst, *host;
    int sdev, ddev, inside;
    dtr_result r;
    memset(s, 0, sizeof(*s));
    if (!c->stage_ctx) return DTR_OK;
    dtr__stage_extents(c, a, &in, &out);
    ddev = out && dtr__stage_owned(c, dst);
    inside = ddev && src >= dst && src < dst + out;
    sdev = !inside && in && dtr__stage_owned(c, src);
    if (!ddev && !sdev) return DTR_OK;
    at = ddev ? (out + 63) / 64 * 64 : 0;   /* the input's image after the output's */
    if (!(s->blk = dtr__stage_get(c, at + (sdev ? in : 0))))
        return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory for %zu bytes of host staging", at + in);
    host = (char *)s->blk->p;
    if (ddev) s->dev_dst = dst, s->host_dst = host, s->dst_bytes = out, a->dst = host;
    if (inside || sdev) a->src = inside ? host + (src - dst) : host + at;
    r = in && (inside || sdev) ? c->stage_ctx->backend->to_host(c->stage_ctx, (void *)a->src, src, in) : DTR_OK;
    if (r != DTR_OK) {
        dtr__stage_put(c, s->blk);
        s->blk = NULL;
        return dtr__comm_fail(c, a, r, -1, 0, "copying a device buffer to the host: %s", dtr_context_last_error(c->stage_ctx));
    }
    return DTR_OK;
}

dtr_result dtr__stage_out(dtr_comm *c, const dtr__coll *a, dtr__staged *s, dtr_result r) {
    dtr_result cr = DTR_OK;
    if (!s->blk) return r;
    if (r == DTR_OK && s->dev_dst)
        cr = c->stage_ctx->backend->from_host(c->stage_ctx, s->dev_dst, s->host_dst, s->dst_bytes);
    dtr__stage_put(c, s->blk);
    memset(s, 0, sizeof(*s));
    if (cr != DTR_OK)
        return dtr__comm_fail(c, a, cr, -1, 0, "copying the result to the device: %s", dtr_context_last_error(c->stage_ctx));
    return r;
}
