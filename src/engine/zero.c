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
 * Stage 3 also shards the parameters: after the step a rank keeps its shard only, and the
 * engine's buckets become units that are gathered (an all-gather of the unit's pieces from
 * their owners, point-to-point) when an op reads one of their parameters: the core calls
 * ctx->param_fetch before a kernel whose inputs include a DTR__ABSENT parameter, in forward
 * and in backward (every rank runs the same ops, so the gathers match). A unit is released
 * (its parameters flagged absent, its memory outside the shard discarded) when its
 * gradients are final in backward, when `keep` units gathered after it are held besides the
 * running op's, and at the step. The order of the on-demand gathers is recorded each step;
 * while it repeats the last step's, the next unit's gather is posted ahead (one in flight).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include "../comm/comm_internal.h"
#include "zero.h"

#define DTR__ZERO_TAG (1 << 30)   /* + bucket index (stage 1: 0): the reduce-scatter's point-to-point tags */

/* point-to-point requests in flight, waited for together */
typedef struct dtr__zreqs {
    dtr_request **req;
    int n, cap;
} dtr__zreqs;

/* stage 3: a unit of parameters gathered together (one of the engine's buckets) */
typedef struct dtr__unit {
    int64_t begin, end;    /* floats of the parameter buffer */
    int p_lo, p_hi;        /* its parameters, [p_lo, p_hi] */
    int resident;          /* gathered: every float valid */
    uint64_t used;         /* when last gathered or read by a gathering op */
} dtr__unit;

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
    dtr__zreqs rs;           /* this step's reduce-scatter: sends and receives */
    unsigned char *rs_send;  /* per request of rs: 1 a send */
    int64_t *bk;             /* stage 3, per bucket started this step, in start order: its range
                                [bk[4i], bk[4i+1]) and its requests [bk[4i+2], bk[4i+3]) in rs */
    int nb, nbk, sent;       /* buckets; started; those whose sends completed (gradients discarded) */
    int discard_grads;       /* dtr__zero_releases_grads */
    dtr__zreqs g;            /* a gather's: 2 (W - 1) */
    /* stage 3 */
    dtr__unit *u;
    int nu, keep;            /* units; gathered units kept besides the running op's */
    const int *param_unit;   /* parameter -> unit (the engine's parameter -> bucket) */
    int pinned;              /* dtr_dp_gather_params: nothing released until the step */
    int *seq, *prev;         /* the units gathered on demand this step and the last, in order */
    int nseq, nprev, cap_seq;
    int pf;                  /* the unit whose gather is in flight (prefetched), or -1 */
    dtr__zreqs pfq;          /* its sends and receives */
    uint64_t clock;
    int64_t held;            /* floats of other ranks' shards held now */
    dtr_dp_stats *st;        /* the engine's counters */
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
    z->dev = dev;   /* the gradients on the device (a device transport): the slots there too */
    z->discard_grads = dtr__zero_releases_grads(cfg);
    z->wire = cfg->compress == DTR_COMPRESS_BF16 ? DTR_BF16 : cfg->compress == DTR_COMPRESS_FP16 ? DTR_F16 : DTR_F32;
    z->W = dtr_comm_size(c), z->me = dtr_comm_rank(c);
    z->shard = (int64_t *)dtr__calloc(&ctx->alloc, (size_t)(z->W + 1) * sizeof(int64_t));
    ok = z->shard != NULL;
    if (ok) dtr__zero_layout(z, cfg->zero_whole_params);
    z->rs.cap = 2 * z->W * (nb > 0 ? nb : 1);   /* each bucket's sends and receives: 2 (W - 1) */
    z->rs.req = (dtr_request **)dtr__calloc(&ctx->alloc, (size_t)z->rs.cap * sizeof(dtr_request *));
    z->rs_send = (unsigned char *)dtr__calloc(&ctx->alloc, (size_t)z->rs.cap);
    z->nb = nb > 0 ? nb : 1;
    z->bk = (int64_t *)dtr__calloc(&ctx->alloc, (size_t)z->nb * 4 * sizeof(int64_t));
    z->g.cap = z->pfq.cap = 2 * z->W;
    z->g.req = (dtr_request **)dtr__calloc(&ctx->alloc, (size_t)z->g.cap * sizeof(dtr_request *));
    z->pfq.req = (dtr_request **)dtr__calloc(&ctx->alloc, (size_t)z->pfq.cap * sizeof(dtr_request *));
    z->pf = -1;
    ok = ok && z->rs.req && z->rs_send && z->bk && z->g.req && z->pfq.req;
    if (ok) {   /* the peers' slices of this rank's shard (stage 1: all at once, stage 2: by bucket) */
        int64_t len = z->shard[z->me + 1] - z->shard[z->me];
        size_t bytes = (size_t)((z->W - 1) * len + 1) * sizeof(float);
        z->recv = (float *)dtr__mem_alloc_on(z->ctx, z->dev, bytes);
        ok = z->recv != NULL;
        if (ok && z->wire != DTR_F32) {   /* the 16-bit buffers where the slots are */
            z->out16 = (uint16_t *)dtr__mem_alloc_on(z->ctx, z->dev, (size_t)(dtr_model_numel(m) + 1) * sizeof(uint16_t));
            z->in16 = (uint16_t *)dtr__mem_alloc_on(z->ctx, z->dev, (size_t)((z->W - 1) * len + 1) * sizeof(uint16_t));
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

/* waits for and frees the requests of q; the first error */
static dtr_result dtr__zero_wait(dtr__zreqs *q) {
    dtr_result first = DTR_OK;
    int i;
    for (i = 0; i < q->n; i++) {
        dtr_result r = dtr_request_wait(q->req[i]);
        if (r != DTR_OK && first == DTR_OK) first = r;
        dtr_request_destroy(q->req[i]);
        q->req[i] = NULL;
    }
    q->n = 0;
    return first;
}

void dtr__zero_destroy(dtr__zero *z) {
    dtr_allocation_callbacks a;
    if (!z) return;
    a = z->ctx->alloc;
    if (z->rs.req) dtr__zero_wait(&z->rs);
    if (z->g.req) dtr__zero_wait(&z->g);
    if (z->pfq.req) dtr__zero_wait(&z->pfq);
    if (z->u && z->ctx->param_fetch_user == z) z->ctx->param_fetch = NULL, z->ctx->param_fetch_user = NULL;
    dtr__free(&a, z->rs.req);
    dtr__free(&a, z->rs_send);
    dtr__free(&a, z->bk);
    dtr__free(&a, z->g.req);
    dtr__free(&a, z->pfq.req);
    dtr__free(&a, z->u);
    dtr__free(&a, z->seq);
    dtr__free(&a, z->prev);
    dtr__mem_free_on(z->ctx, z->dev, z->recv);
    dtr__mem_free_on(z->ctx, z->dev, z->out16);
    dtr__mem_free_on(z->ctx, z->dev, z->in16);
    dtr__free(&a, z->shard);
    dtr__free(&a, z);
}

/* where peer p's value of float x of this rank's shard is: its index in the slots */
static int64_t dtr__zero_at(const dtr__zero *z, int p, int64_t x) {
    int64_t len = z->shard[z->me + 1] - z->shard[z->me];
    return (int64_t)(p < z->me ? p : p - 1) * len + (x - z->shard[z->me]);
}
static float *dtr__zero_slot(dtr__zero *z, int p, int64_t x) { return z->recv + dtr__zero_at(z, p, x); }

/* discards floats [begin, end) of buffer x outside this rank's shard (fill: see dtr__mem_discard) */
static void dtr__zero3_discard(const dtr__zero *z, float *x, int64_t begin, int64_t end, float fill) {
    int64_t sb = z->shard[z->me], se = z->shard[z->me + 1];
    if (begin < sb) dtr__mem_discard(&z->ctx->alloc, x + begin, (end < sb ? end : sb) - begin, fill);
    if (end > se) dtr__mem_discard(&z->ctx->alloc, x + (begin > se ? begin : se), end - (begin > se ? begin : se), fill);
}

/* posts a send or receive of `bytes` at buf to/from rank p into q */
static dtr_result dtr__zero_post(dtr__zero *z, dtr__zreqs *q, int send, void *buf, size_t bytes, int p, int tag) {
    dtr_result r;
    if (q->n >= q->cap) return dtr__fail(z->ctx, DTR_BAD_STATE, "ZeRO: more requests than planned");
    if (q == &z->rs) z->rs_send[q->n] = (unsigned char)send;
    r = send ? dtr_comm_send_async(z->c, buf, bytes, p, tag, &q->req[q->n])
             : dtr_comm_recv_async(z->c, buf, bytes, p, tag, &q->req[q->n]);
    if (r == DTR_OK) q->n++;
    return r;
}

/* the slices of bucket [lo, hi) of owner o: sent (16-bit: encoded first), or the peers' received */
dtr_result dtr__zero_start(dtr__zero *z, float *g, int i, int64_t begin, int64_t end) {
    int64_t *bk = z->bk + 4 * z->nbk;
    int o, p;
    if (z->nbk >= z->nb) return dtr__fail(z->ctx, DTR_BAD_STATE, "ZeRO: more buckets than planned");
    z->nbk++;
    bk[0] = begin, bk[1] = end, bk[2] = z->rs.n;
    for (o = 0; o < z->W; o++) {
        int64_t lo = begin > z->shard[o] ? begin : z->shard[o], hi = end < z->shard[o + 1] ? end : z->shard[o + 1];
        size_t bytes = (size_t)(hi - lo) * dtr_dtype_size(z->wire);
        dtr_result r = DTR_OK;
        if (lo >= hi) continue;
        if (o != z->me && z->out16)   /* the slice sent in 16 bits */
            r = dtr__convert_mem(z->ctx, z->dev, z->out16 + lo, z->wire, g + lo, DTR_F32, hi - lo);
        if (o != z->me && r == DTR_OK) r = dtr__zero_post(z, &z->rs, 1, z->out16 ? (void *)(z->out16 + lo) : (void *)(g + lo), bytes, o, DTR__ZERO_TAG + i);
        for (p = 0; p < z->W && o == z->me && r == DTR_OK; p++)
            if (p != z->me)
                r = dtr__zero_post(z, &z->rs, 0, z->in16 ? (void *)(z->in16 + dtr__zero_at(z, p, lo)) : (void *)dtr__zero_slot(z, p, lo),
                                   bytes, p, DTR__ZERO_TAG + i);
        if (r != DTR_OK) return r;
    }
    bk[3] = z->rs.n;
    return DTR_OK;
}

void dtr__zero_grads_sent(dtr__zero *z, float *g, int all) {
    for (; z->discard_grads && z->sent < z->nbk; z->sent++) {
        const int64_t *bk = z->bk + 4 * z->sent;
        int64_t q;
        for (q = bk[2]; q < bk[3] && !all; q++) {
            int done = 0;
            if (z->rs_send[q] && (dtr_request_test(z->rs.req[q], &done) != DTR_OK || !done)) return;
        }
        dtr__zero3_discard(z, g, bk[0], bk[1], 0.0f);   /* read no more: zeros, as the next step wants them */
    }
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
    dtr_result r = dtr__zero_wait(&z->rs);
    int p;
    if (r == DTR_OK) dtr__zero_grads_sent(z, grads, 1);   /* every slice sent */
    z->nbk = z->sent = 0;
    if (r != DTR_OK) return r;
    if (z->in16)   /* the 16-bit slots widened */
        r = dtr__convert_mem(z->ctx, z->dev, z->recv, DTR_F32, z->in16, z->wire, (z->W - 1) * n);
    if (r != DTR_OK) return r;
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

/* posts into q the gather of floats [begin, end) of the parameter buffer prm from their
   owners: each rank sends its part to every peer and receives the peers' (an all-gather of
   unequal pieces); counts this rank's part in st */
static dtr_result dtr__zero_gather_post(dtr__zero *z, dtr__zreqs *q, float *prm, int64_t begin, int64_t end, dtr_dp_stats *st) {
    dtr_result r = DTR_OK;
    int o, p;
    for (o = 0; o < z->W && r == DTR_OK; o++) {
        int64_t lo = begin > z->shard[o] ? begin : z->shard[o], hi = end < z->shard[o + 1] ? end : z->shard[o + 1];
        if (lo >= hi) continue;
        if (o == z->me) st->wire_bytes += (uint64_t)(hi - lo) * sizeof(float), st->raw_bytes += (uint64_t)(hi - lo) * sizeof(float);
        for (p = 0; p < z->W && r == DTR_OK; p++)
            if (p != z->me && (o == z->me || p == o))
                r = dtr__zero_post(z, q, o == z->me, prm + lo, (size_t)(hi - lo) * sizeof(float), p, DTR__ZERO_TAG - 1);
    }
    return r;
}

/* waits for the gather posted into q (all of it, also after an error) */
static dtr_result dtr__zero_gather_wait(dtr__zero *z, dtr__zreqs *q, dtr_result r) {
    dtr_result w = dtr__zero_wait(q);
    if (r == DTR_OK) r = w;
    if (r != DTR_OK) return dtr__fail(z->ctx, r, "ZeRO-%d: gathering the parameters: %s", z->stage, dtr_comm_last_error(z->c));
    return DTR_OK;
}

static dtr_result dtr__zero_gather_range(dtr__zero *z, float *prm, int64_t begin, int64_t end, dtr_dp_stats *st) {
    return dtr__zero_gather_wait(z, &z->g, dtr__zero_gather_post(z, &z->g, prm, begin, end, st));
}

dtr_result dtr__zero_gather(dtr__zero *z, float *prm, dtr_dp_stats *st) {
    return dtr__zero_gather_range(z, prm, 0, dtr_model_numel(z->m), st);
}

void dtr__zero_shard(const dtr__zero *z, int64_t *begin, int64_t *end) {
    *begin = z->shard[z->me];
    *end = z->shard[z->me + 1];
}

dtr_result dtr__zero_sum(void *user, double *vals, int n) {
    dtr__zero *z = (dtr__zero *)user;
    return dtr__comm_sum_doubles(z->c, z->ctx, vals, n, "ZeRO");
}

/* ---- stage 3: units of parameters gathered when an op reads them ---- */

/* floats of unit u outside this rank's shard */
static int64_t dtr__zero3_foreign(const dtr__zero *z, const dtr__unit *u) {
    int64_t lo = u->begin > z->shard[z->me] ? u->begin : z->shard[z->me];
    int64_t hi = u->end < z->shard[z->me + 1] ? u->end : z->shard[z->me + 1];
    return (u->end - u->begin) - (hi > lo ? hi - lo : 0);
}

/* flags the parameters of u absent (or present again); those inside this rank's shard too:
   the gathers are collective, so every rank must ask for the same units at the same op */
static void dtr__zero3_mark(dtr__zero *z, const dtr__unit *u, int absent) {
    int p;
    for (p = u->p_lo; p <= u->p_hi; p++) {
        dtr_tensor *t = dtr_model_param_at(z->m, p);
        if (absent) t->flags |= DTR__ABSENT;
        else t->flags &= ~(uint32_t)DTR__ABSENT;
    }
}

void dtr__zero3_release(dtr__zero *z, int i) {
    dtr__unit *u = &z->u[i];
    float *prm = dtr_model_params(z->m);
    if (!u->resident || z->pinned) return;
    u->resident = 0;
    z->held -= dtr__zero3_foreign(z, u);
    dtr__zero3_mark(z, u, 1);
    dtr__zero3_discard(z, prm, u->begin, u->end, NAN);
}

/* unit i's values are all here: flags cleared, counted (held: its foreign floats unless the
   prefetch counted them when it was posted) */
static void dtr__zero3_present(dtr__zero *z, int i, int counted) {
    dtr__unit *u = &z->u[i];
    uint64_t bytes;
    u->resident = 1;
    if (!counted) z->held += dtr__zero3_foreign(z, u);
    dtr__zero3_mark(z, u, 0);
    z->st->param_gathers++;
    bytes = (uint64_t)(z->held + z->shard[z->me + 1] - z->shard[z->me]) * sizeof(float);
    if (bytes > z->st->param_bytes_peak) z->st->param_bytes_peak = bytes;
}

/* the prefetched unit's gather, waited for */
static dtr_result dtr__zero3_land(dtr__zero *z) {
    int i = z->pf;
    dtr_result r;
    if (i < 0) return DTR_OK;
    z->pf = -1;
    r = dtr__zero_gather_wait(z, &z->pfq, DTR_OK);
    if (r == DTR_OK) dtr__zero3_present(z, i, 1);
    return r;
}

/* Prefetch: the units come in the same order every step (every rank runs the same ops), so
   when this step's gathers so far match the last step's, the unit that came next then is
   posted now (one at a time), to arrive while the ops of this one run. */
static dtr_result dtr__zero3_prefetch(dtr__zero *z, int k) {
    int i = z->nseq, next;
    dtr__unit *u;
    dtr_result r;
    if (i < z->cap_seq) z->seq[z->nseq++] = k;
    if (i + 1 >= z->nprev || z->prev[i] != k || z->pf >= 0) return DTR_OK;
    next = z->prev[i + 1], u = &z->u[next];
    if (u->resident) return DTR_OK;
    r = dtr__zero_gather_post(z, &z->pfq, dtr_model_params(z->m), u->begin, u->end, z->st);
    z->pf = next;
    z->st->param_prefetches++;
    z->held += dtr__zero3_foreign(z, u);   /* its memory is being written from now on */
    u->used = ++z->clock;
    return r == DTR_OK ? DTR_OK : dtr__zero3_land(z);   /* a failed post: its error (after the posted part) */
}

/* gathers unit i from the owners of its pieces (the prefetch in flight lands first: it is
   usually this unit), then prefetches the next */
static dtr_result dtr__zero3_gather(dtr__zero *z, int i) {
    dtr__unit *u = &z->u[i];
    dtr_result r = dtr__zero3_land(z);
    if (r == DTR_OK && !u->resident) {
        r = dtr__zero_gather_range(z, dtr_model_params(z->m), u->begin, u->end, z->st);
        if (r == DTR_OK) dtr__zero3_present(z, i, 0);
    }
    return r == DTR_OK && !z->pinned ? dtr__zero3_prefetch(z, i) : r;
}

/* releases the units gathered longest ago until `keep` are held besides those used since `now` */
static void dtr__zero3_trim(dtr__zero *z, uint64_t now) {
    for (;;) {
        int i, old = -1, n = 0;
        for (i = 0; i < z->nu; i++) {
            const dtr__unit *u = &z->u[i];
            if (!u->resident || u->used >= now) continue;
            n++;
            if (old < 0 || u->used < z->u[old].used) old = i;
        }
        if (n <= z->keep || old < 0 || z->pinned) return;
        dtr__zero3_release(z, old);
    }
}

/* ctx->param_fetch: the units of n's parameter inputs stamped, older ones released down to
   `keep` (before gathering: the peak is keep + n's units), the missing ones gathered */
static dtr_result dtr__zero3_fetch(void *user, dtr__node *n) {
    dtr__zero *z = (dtr__zero *)user;
    uint64_t now = z->clock + 1;
    dtr_result r = DTR_OK;
    int i, pass;
    for (pass = 0; pass < 2; pass++) {
        if (pass) dtr__zero3_trim(z, now);
        for (i = 0; i < n->n_in && r == DTR_OK; i++) {
            const dtr_tensor *t = n->in[i] ? dtr__owner(n->in[i]) : NULL;
            int k;
            if (!t || t->param_index < 0 || !t->model) continue;
            if (t->model != z->m) { r = dtr__param_present(t, dtr__op_name(n->op)); continue; }   /* another engine's, gone */
            k = z->param_unit[t->param_index];
            if (!pass) z->u[k].used = ++z->clock;
            else if (!z->u[k].resident) r = dtr__zero3_gather(z, k);
        }
    }
    return r;
}

void dtr__zero3_release_all(dtr__zero *z, int written) {
    int *t = z->prev;
    int i;
    (void)dtr__zero3_land(z);   /* (a failed prefetch: the next gather fails the same way) */
    z->prev = z->seq, z->seq = t, z->nprev = z->nseq, z->nseq = 0;   /* this step's order, for the next */
    z->pinned = 0;
    for (i = 0; i < z->nu; i++) {
        if (written && !z->u[i].resident) z->u[i].resident = 1, z->held += dtr__zero3_foreign(z, &z->u[i]);
        dtr__zero3_release(z, i);
    }
}

dtr_result dtr__zero3_gather_all(dtr__zero *z) {
    dtr_result r = dtr__zero3_land(z);
    int i;
    z->pinned = 1;   /* (no prefetch, no order recorded) */
    for (i = 0; i < z->nu && r == DTR_OK; i++)
        if (!z->u[i].resident) r = dtr__zero3_gather(z, i);
    z->pinned = r == DTR_OK;
    return r;
}

dtr_result dtr__zero3_start(dtr__zero *z, int nu, const int *param_unit, int keep, dtr_dp_stats *st) {
    int np = dtr_model_param_count(z->m), p;
    int64_t total = dtr_model_numel(z->m);
    if (z->ctx->param_fetch)
        return dtr__fail(z->ctx, DTR_BAD_STATE, "dtr_dp_create: another engine shards this context's parameters (ZeRO-3)");
    z->cap_seq = 4 * nu + 4;   /* a step's gathers: each unit in forward and again in backward, and then some */
    z->u = (dtr__unit *)dtr__calloc(&z->ctx->alloc, (size_t)(nu > 0 ? nu : 1) * sizeof(dtr__unit));
    z->seq = (int *)dtr__calloc(&z->ctx->alloc, (size_t)z->cap_seq * sizeof(int));
    z->prev = (int *)dtr__calloc(&z->ctx->alloc, (size_t)z->cap_seq * sizeof(int));
    if (!z->u || !z->seq || !z->prev) return dtr__fail(z->ctx, DTR_OUT_OF_MEMORY, "dtr_dp_create: out of memory");
    z->nu = nu, z->param_unit = param_unit, z->keep = keep, z->st = st;
    for (p = 0; p < nu; p++) z->u[p].p_lo = np, z->u[p].p_hi = -1;
    for (p = 0; p < np; p++) {   /* a unit: its parameters' run of the buffer (the first from 0, the last to the end) */
        dtr__unit *u = &z->u[param_unit[p]];
        if (p < u->p_lo) u->p_lo = p, u->begin = p == 0 ? 0 : dtr_model_param_offset(z->m, p);
        if (p > u->p_hi) u->p_hi = p, u->end = p == np - 1 ? total : dtr_model_param_offset(z->m, p + 1);
    }
    for (p = 0; p < nu; p++) {   /* every unit holds whole values now (the broadcast) */
        z->u[p].resident = 1;
        z->held += dtr__zero3_foreign(z, &z->u[p]);
    }
    z->ctx->param_fetch = dtr__zero3_fetch;
    z->ctx->param_fetch_user = z;
    dtr__zero3_release_all(z, 0);
    st->param_bytes_peak = (uint64_t)(z->shard[z->me + 1] - z->shard[z->me]) * sizeof(float);   /* from here on */
    return DTR_OK;
}
