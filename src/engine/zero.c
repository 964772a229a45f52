/* ============================================================================
 * ZeRO in the data-parallel engine. Rank r of W owns floats [shard[r], shard[r + 1]) of the
 * parameter buffer: it updates them (its optimizer keeps state for them only) and after
 * the step sends them to the others (one broadcast per shard).
 *
 * Gradients are reduce-scattered: each rank sends the slice of rank o's shard to rank o
 * (point-to-point, asynchronous) and receives the peers' slices of its own shard into a
 * buffer, one slot per peer; dtr_dp_finish waits and sums the slices in rank order into the
 * shard. Stage 2 does it bucket by bucket as each bucket's gradients are final during
 * backward (overlapped); stage 1 once, over the whole buffer, in dtr_dp_finish. Each rank
 * sends (W - 1) / W of the gradients and receives as much: the volume of a reduce-scatter,
 * half an all-reduce's. Outside its shard a rank's gradient buffer keeps its own local
 * gradients (not the average). The buffers are the group's memory: the model's on the host;
 * for a model on a device the engine's host staging copies over a host transport (and with
 * 16-bit slices over a device transport, whose group stages them to the device), or the
 * device buffers themselves over a device transport (NCCL: the slots in device memory, the
 * sums by the backend's reduce). With compress BF16 / FP16 the slices travel in 16 bits
 * (rounded to nearest even; a rank's own slice is not rounded) and are widened before the
 * sum; the parameters' gather stays f32, so every rank holds the same weights.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include "../comm/comm_internal.h"
#include "zero.h"

#define DTR__ZERO_TAG (1 << 30)   /* + bucket index (stage 1: 0): the reduce-scatter's point-to-point tags */

struct dtr__zero {
    dtr_model *m;
    dtr_comm *c;
    dtr_context *ctx;
    int W, me, stage;
    int dev;                 /* the group's buffers are device memory (NCCL): recv too, summed by the backend */
    int64_t *shard;          /* W + 1 offsets */
    float *recv;             /* W - 1 slots of this rank's shard, peers in rank order */
    dtr_dtype wire;          /* the gradient slices' dtype on the wire: F32, or BF16 / F16 */
    uint16_t *out16, *in16;  /* 16-bit wire: the slices sent (by buffer offset) and the slots received */
    dtr_request **req;       /* this step's sends and receives */
    int nreq, cap;
};

/* Shards: rank r's starts at r / W of the buffer, rounded down to 16 floats, or with
 * zero_whole_params at the first parameter boundary there or after (a shard may be empty) */
static void dtr__zero_layout(dtr__zero *z, int whole) {
    int np = dtr_model_param_count(z->m), r, i = 0;
    int64_t total = dtr_model_numel(z->m);
    for (r = 1; r < z->W; r++) {
        int64_t want = total * r / z->W / 16 * 16;
        while (whole && i < np && dtr_model_param_offset(z->m, i) < want) i++;
        z->shard[r] = !whole ? want : i < np ? dtr_model_param_offset(z->m, i) : total;
    }
    z->shard[z->W] = total;
}

dtr_result dtr__zero_create(dtr_model *m, dtr_comm *c, const dtr_dp_config *cfg, int nb, int dev, dtr__zero **out) {
    dtr_context *ctx = dtr_model_context(m);
    dtr__zero *z = (dtr__zero *)dtr__calloc(&ctx->alloc, sizeof(*z));
    int ok;
    *out = NULL;
    if (!z) return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory");
    z->m = m, z->c = c, z->ctx = ctx, z->stage = cfg->zero;
    z->wire = cfg->compress == DTR_COMPRESS_BF16 ? DTR_BF16 : cfg->compress == DTR_COMPRESS_FP16 ? DTR_F16 : DTR_F32;
    z->W = dtr_comm_size(c), z->me = dtr_comm_rank(c);
    z->shard = (int64_t *)dtr__calloc(&ctx->alloc, (size_t)(z->W + 1) * sizeof(int64_t));
    ok = z->shard != NULL;
    if (ok) dtr__zero_layout(z, cfg->zero_whole_params);
    z->cap = 2 * z->W * (nb > 0 ? nb : 1);   /* a bucket's or the gather's sends and receives: 2 (W - 1) */
    z->req = (dtr_request **)dtr__calloc(&ctx->alloc, (size_t)z->cap * sizeof(dtr_request *));
    ok = ok && z->req;
    if (ok) {   /* the peers' slices of this rank's shard (stage 1: all at once, stage 2: by bucket) */
        int64_t len = z->shard[z->me + 1] - z->shard[z->me];
        size_t bytes = (size_t)((z->W - 1) * len + 1) * sizeof(float);
        z->dev = dev;   /* the gradients on the device (a device transport): the slots there too */
        z->recv = (float *)(z->dev ? ctx->backend->mem_alloc(ctx, bytes) : dtr__calloc(&ctx->alloc, bytes));
        ok = z->recv != NULL;
        if (ok && z->wire != DTR_F32) {
            z->out16 = (uint16_t *)dtr__calloc(&ctx->alloc, (size_t)(dtr_model_numel(m) + 1) * sizeof(uint16_t));
            z->in16 = (uint16_t *)dtr__calloc(&ctx->alloc, (size_t)((z->W - 1) * len + 1) * sizeof(uint16_t));
            ok = z->out16 && z->in16;
        }
    }
    if (!ok) {
        dtr__zero_destroy(z);
        return dtr__fail(ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory for the ZeRO shards");
    }
    *out = z;
    return DTR_OK;
}

/* waits for and frees this step's requests; the first error */
static dtr_result dtr__zero_wait(dtr__zero *z) {
    dtr_result first = DTR_OK;
    int i;
    for (i = 0; i < z->nreq; i++) {
        dtr_result r = dtr_request_wait(z->req[i]);
        if (r != DTR_OK && first == DTR_OK) first = r;
        dtr_request_destroy(z->req[i]);
        z->req[i] = NULL;
    }
    z->nreq = 0;
    return first;
}

void dtr__zero_destroy(dtr__zero *z) {
    dtr_allocation_callbacks a;
    if (!z) return;
    a = z->ctx->alloc;
    if (z->req) dtr__zero_wait(z);
    dtr__free(&a, z->req);
    if (z->dev && z->recv) z->ctx->backend->mem_free(z->ctx, z->recv);
    else dtr__free(&a, z->recv);
    dtr__free(&a, z->out16);
    dtr__free(&a, z->in16);
    dtr__free(&a, z->shard);
    dtr__free(&a, z);
}

/* where peer p's value of float x of this rank's shard is: its index in the slots */
static int64_t dtr__zero_at(const dtr__zero *z, int p, int64_t x) {
    int64_t len = z->shard[z->me + 1] - z->shard[z->me];
    return (int64_t)(p < z->me ? p : p - 1) * len + (x - z->shard[z->me]);
}
static float *dtr__zero_slot(dtr__zero *z, int p, int64_t x) { return z->recv + dtr__zero_at(z, p, x); }

/* posts a send or receive of `bytes` at buf to/from rank p */
static dtr_result dtr__zero_post(dtr__zero *z, int send, void *buf, size_t bytes, int p, int tag) {
    dtr_result r;
    if (z->nreq >= z->cap) return dtr__fail(z->ctx, DTR_BAD_STATE, "ZeRO: more requests than planned");
    r = send ? dtr_comm_send_async(z->c, buf, bytes, p, tag, &z->req[z->nreq])
             : dtr_comm_recv_async(z->c, buf, bytes, p, tag, &z->req[z->nreq]);
    if (r == DTR_OK) z->nreq++;
    return r;
}

/* the slices of bucket [lo, hi) of owner o: sent (16-bit: encoded first), or the peers' received */
dtr_result dtr__zero_start(dtr__zero *z, float *g, int i, int64_t begin, int64_t end) {
    int o, p;
    for (o = 0; o < z->W; o++) {
        int64_t lo = begin > z->shard[o] ? begin : z->shard[o], hi = end < z->shard[o + 1] ? end : z->shard[o + 1];
        size_t bytes = (size_t)(hi - lo) * dtr_dtype_size(z->wire);
        dtr_result r = DTR_OK;
        if (lo >= hi) continue;
        if (o != z->me && z->out16) dtr_convert(z->out16 + lo, z->wire, g + lo, DTR_F32, (size_t)(hi - lo));
        if (o != z->me) r = dtr__zero_post(z, 1, z->out16 ? (void *)(z->out16 + lo) : (void *)(g + lo), bytes, o, DTR__ZERO_TAG + i);
        for (p = 0; p < z->W && o == z->me && r == DTR_OK; p++)
            if (p != z->me)
                r = dtr__zero_post(z, 0, z->in16 ? (void *)(z->in16 + dtr__zero_at(z, p, lo)) : (void *)dtr__zero_slot(z, p, lo),
                                   bytes, p, DTR__ZERO_TAG + i);
        if (r != DTR_OK) return r;
    }
    return DTR_OK;
}

/* rank p's slice of the shard: the local gradients (of buffer g) for this rank, else its slot */
static const float *dtr__zero_part(dtr__zero *z, const float *g, int p) {
    int64_t b = z->shard[z->me];
    return p == z->me ? g + b : dtr__zero_slot(z, p, b);
}

/* out = x + y over n floats (then / div when div > 1): on the host, or the backend's for slots
   on the device */
static dtr_result dtr__zero_add(dtr__zero *z, float *out, const float *x, const float *y, int64_t n, int div) {
    if (z->dev) return z->ctx->backend->reduce(z->ctx, out, x, y, (size_t)n, DTR_F32, (int)DTR_REDUCE_AVG, div);
    dtr__comm_reduce(out, x, y, (size_t)n, DTR_F32, DTR_REDUCE_AVG, div);
    return DTR_OK;
}

dtr_result dtr__zero_reduce(dtr__zero *z, float *grads, dtr_dp_stats *st) {
    int64_t b = z->shard[z->me], n = z->shard[z->me + 1] - b;
    float *g = grads + b, *acc;
    dtr_result r = dtr__zero_wait(z);
    int p;
    if (r != DTR_OK) return r;
    if (z->in16) dtr_convert(z->recv, DTR_F32, z->in16, z->wire, (size_t)((z->W - 1) * n));   /* the 16-bit slots widened */
    /* sum in rank order: in the shard itself for rank 0, else in rank 0's slot (rank p > 0
       may still need its own gradients); the last addition divides and lands in the shard */
    acc = z->me == 0 ? g : dtr__zero_slot(z, 0, b);
    for (p = 1; p < z->W && r == DTR_OK && n > 0; p++)
        r = dtr__zero_add(z, p == z->W - 1 ? g : acc, p == 1 ? dtr__zero_part(z, grads, 0) : acc, dtr__zero_part(z, grads, p), n,
                          p == z->W - 1 ? z->W : 1);
    if (r != DTR_OK) return dtr__fail(z->ctx, r, "ZeRO-%d: summing the shard on the device", z->stage);   /* (the backend's first) */
    st->wire_bytes += (uint64_t)(dtr_model_numel(z->m) - n) * dtr_dtype_size(z->wire);
    st->raw_bytes += (uint64_t)dtr_model_numel(z->m) * sizeof(float);
    return DTR_OK;
}

dtr_result dtr__zero_gather(dtr__zero *z, float *prm, dtr_dp_stats *st) {
    int64_t n = z->shard[z->me + 1] - z->shard[z->me];
    dtr_result r = DTR_OK;
    int p;
    /* an all-gather of unequal shards: this rank's to every peer, every peer's from it */
    for (p = 0; p < z->W && r == DTR_OK; p++) {
        if (p == z->me) continue;
        if (n > 0) r = dtr__zero_post(z, 1, prm + z->shard[z->me], (size_t)n * sizeof(float), p, DTR__ZERO_TAG - 1);
        if (r == DTR_OK && z->shard[p + 1] > z->shard[p])
            r = dtr__zero_post(z, 0, prm + z->shard[p], (size_t)(z->shard[p + 1] - z->shard[p]) * sizeof(float), p,
                               DTR__ZERO_TAG - 1);
    }
    if (r == DTR_OK) r = dtr__zero_wait(z);
    else dtr__zero_wait(z);
    if (r != DTR_OK) return dtr__fail(z->ctx, r, "ZeRO-%d: gathering the parameters: %s", z->stage, dtr_comm_last_error(z->c));
    st->wire_bytes += (uint64_t)n * sizeof(float);
    st->raw_bytes += (uint64_t)n * sizeof(float);
    return DTR_OK;
}

void dtr__zero_shard(const dtr__zero *z, int64_t *begin, int64_t *end) {
    *begin = z->shard[z->me];
    *end = z->shard[z->me + 1];
}

dtr_result dtr__zero_sum(void *user, double *vals, int n) {
    dtr__zero *z = (dtr__zero *)user;
    return dtr__comm_sum_doubles(z->c, z->ctx, vals, n, "ZeRO");
}
