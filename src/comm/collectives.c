/* ============================================================================
 * Collectives built over point-to-point messages, and the reduction kernels.
 *
 * N is the group size, r this rank, x_i the input of rank i. Reductions combine two
 * operands in a fixed order ("earlier" operand first), so results are the same bits on
 * every rank and in every run for a given N, count, dtype and algorithm:
 *
 *   ring all-reduce     chunk k (count split into N chunks, the first count % N one element
 *                       longer) is reduced along the ring starting at rank k+1:
 *                       ((x_{k+1} + x_{k+2}) + ...) + x_k, at rank k, then passed around
 *                       (all-gather). 2(N-1) steps, each moving count/N elements.
 *   recursive doubling  with p the largest power of two <= N and m = N - p: ranks 2i and
 *                       2i+1 (i < m) first fold into x_{2i} + x_{2i+1}; then the p remaining
 *                       partial sums are combined pairwise at distances 1, 2, 4, ... with the
 *                       lower-ranked partner's value first, i.e. a balanced tree over the
 *                       ranks in order; the folded-out ranks receive the result at the end.
 *   reduce-scatter      block k as the ring all-reduce's chunk k (same order).
 *   average             the sum, divided by N (f32) in the step that finishes it.
 *   bf16 / f16          each step converts its two operands to f32, combines them (and
 *                       divides, for the last step of an average) and rounds once to the
 *                       storage type (round to nearest even).
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../core/internal.h"
#include "comm_internal.h"

/* ---- reduction kernels ---- */

static inline float dtr__maxf(float a, float b) { return (a > b || a != a) ? a : b; } /* NaN wins */

void dtr__comm_reduce(void *out, const void *a, const void *b, size_t n, dtr_dtype dt, dtr_reduce_op op, int div) {
    size_t i;
    int is_max = op == DTR_REDUCE_MAX;
    float d = (float)(div > 1 ? div : 1);
    if (dt == DTR_F32) {
        /* blocks of 8 through local arrays: the basic-block vectorizer makes SIMD of each at
           -O2 although out may alias a or b (a block is loaded before it is stored); per
           element the operations are those of the scalar tail, so the results are the same */
        float *o = (float *)out;
        const float *x = (const float *)a, *y = (const float *)b;
        float tx[8], ty[8];
        int k;
        i = 0;
        if (is_max)
            for (; i + 8 <= n; i += 8) {
                memcpy(tx, x + i, sizeof tx);
                memcpy(ty, y + i, sizeof ty);
                for (k = 0; k < 8; k++) tx[k] = dtr__maxf(tx[k], ty[k]);
                memcpy(o + i, tx, sizeof tx);
            }
        else if (div > 1)
            for (; i + 8 <= n; i += 8) {
                memcpy(tx, x + i, sizeof tx);
                memcpy(ty, y + i, sizeof ty);
                for (k = 0; k < 8; k++) tx[k] = (tx[k] + ty[k]) / d;
                memcpy(o + i, tx, sizeof tx);
            }
        else
            for (; i + 8 <= n; i += 8) {
                memcpy(tx, x + i, sizeof tx);
                memcpy(ty, y + i, sizeof ty);
                for (k = 0; k < 8; k++) tx[k] = tx[k] + ty[k];
                memcpy(o + i, tx, sizeof tx);
            }
        for (; i < n; i++) o[i] = is_max ? dtr__maxf(x[i], y[i]) : div > 1 ? (x[i] + y[i]) / d : x[i] + y[i];
    } else if (dt == DTR_BF16) {
        uint16_t *o = (uint16_t *)out;
        const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;
        for (i = 0; i < n; i++) {
            float fx = dtr_bf16_to_f32(x[i]), fy = dtr_bf16_to_f32(y[i]);
            o[i] = dtr_f32_to_bf16(is_max ? dtr__maxf(fx, fy) : div > 1 ? (fx + fy) / d : fx + fy);
        }
    } else if (dt == DTR_F16) {
        uint16_t *o = (uint16_t *)out;
        const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;
        for (i = 0; i < n; i++) {
            float fx = dtr_f16_to_f32(x[i]), fy = dtr_f16_to_f32(y[i]);
            o[i] = dtr_f32_to_f16(is_max ? dtr__maxf(fx, fy) : div > 1 ? (fx + fy) / d : fx + fy);
        }
    }
}

/* The reduction step of an algorithm, on the backend that owns the group's buffers: the host
 * code above for host memory, the context's backend for device memory (cfg.memory). */
dtr_result dtr__coll_reduce(dtr_comm *c, void *out, const void *x, const void *y, size_t n, const dtr__coll *a, int div) {
    dtr_result r;
    if (!c->mem_ctx) {
        dtr__comm_reduce(out, x, y, n, a->dtype, a->op, div);
        return DTR_OK;
    }
    r = c->mem_ctx->backend->reduce(c->mem_ctx, out, x, y, n, a->dtype, (int)a->op, div);
    if (r != DTR_OK)
        return dtr__comm_fail(c, a, r, -1, 0, "the %s backend's reduction failed: %s", c->mem_ctx->backend->name,
                              dtr_context_last_error(c->mem_ctx));
    return DTR_OK;
}

/* bytes from src to dst in the memory of the group's buffers (memcpy, or the backend's copy) */
static dtr_result dtr__coll_copy(dtr_comm *c, const dtr__coll *a, void *dst, const void *src, size_t bytes) {
    dtr_result r;
    if (!bytes || dst == src) return DTR_OK;
    if (!c->mem_ctx) {
        memcpy(dst, src, bytes);
        return DTR_OK;
    }
    if ((r = dtr__mem_copy(c->mem_ctx, dst, src, bytes)) != DTR_OK)
        return dtr__comm_fail(c, a, r, -1, 0, "the %s backend's copy failed: %s", c->mem_ctx->backend->name,
                              dtr_context_last_error(c->mem_ctx));
    return DTR_OK;
}

/* ---- helpers ---- */

/* what the step that completes an average divides by (1 for other reductions) */
static int dtr__avg_div(const dtr_comm *c, const dtr__coll *a) {
    if (a->op != DTR_REDUCE_AVG) return 1;
    return a->avg_div ? a->avg_div : c->size;
}

static int dtr__mod(int a, int n) { return ((a % n) + n) % n; }

/* chunk k of `count` elements split into n: [*off, *off + *len) */
static void dtr__coll_chunk(size_t count, int n, int k, size_t *off, size_t *len) {
    size_t q = count / (size_t)n, rem = count % (size_t)n, kk = (size_t)k;
    *off = kk * q + (kk < rem ? kk : rem);
    *len = q + (kk < rem ? 1 : 0);
}

static dtr_result dtr__oom(dtr_comm *c, const dtr__coll *a, size_t bytes) {
    return dtr__comm_fail(c, a, DTR_OUT_OF_MEMORY, -1, 0, "out of memory for %zu bytes of scratch", bytes);
}

/* ---- all-reduce ---- */

/* Ring reduce-scatter into dst (chunk layout above): afterwards rank r holds the reduction
   of chunk r in dst. This rank's contributions are read from src (src may be dst), so an
   out-of-place call needs no copy first; dst's other chunks receive partials only. Steps
   0..N-2. */
static dtr_result dtr__ring_reduce_scatter(dtr_comm *c, const dtr__coll *a, const char *src, char *dst, char *tmp) {
    int N = c->size, r = c->rank, s, right = (r + 1) % N, left = (r + N - 1) % N;
    size_t es = dtr_dtype_size(a->dtype);
    dtr_result res;
    for (s = 0; s < N - 1; s++) {
        int ks = dtr__mod(r - s - 1, N), kr = dtr__mod(r - s - 2, N);
        size_t so, sl, ro, rl;
        dtr__coll_chunk(a->count, N, ks, &so, &sl);
        dtr__coll_chunk(a->count, N, kr, &ro, &rl);
        /* step 0 sends our own input; later steps the partial reduced at the step before */
        res = dtr__comm_sendrecv(c, a, (s == 0 ? src : dst) + so * es, sl * es, right, tmp, rl * es, left, (uint32_t)s);
        if (res != DTR_OK) return res;
        /* the partial of the ranks before us comes first */
        res = dtr__coll_reduce(c, dst + ro * es, tmp, src + ro * es, rl, a, s == N - 2 ? dtr__avg_div(c, a) : 1);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

/* Ring all-gather of chunk layout over dst: rank r owns chunk r. Steps base..base+N-2. */
static dtr_result dtr__ring_all_gather_chunks(dtr_comm *c, const dtr__coll *a, char *dst, uint32_t base) {
    int N = c->size, r = c->rank, s, right = (r + 1) % N, left = (r + N - 1) % N;
    size_t es = dtr_dtype_size(a->dtype);
    dtr_result res;
    for (s = 0; s < N - 1; s++) {
        int ks = dtr__mod(r - s, N), kr = dtr__mod(r - s - 1, N);
        size_t so, sl, ro, rl;
        dtr__coll_chunk(a->count, N, ks, &so, &sl);
        dtr__coll_chunk(a->count, N, kr, &ro, &rl);
        res = dtr__comm_sendrecv(c, a, dst + so * es, sl * es, right, dst + ro * es, rl * es, left, base + (uint32_t)s);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

static dtr_result dtr__all_reduce_ring(dtr_comm *c, const dtr__coll *a) {
    size_t es = dtr_dtype_size(a->dtype), off, len;
    char *dst = (char *)a->dst, *tmp;
    dtr_result res;
    dtr__coll_chunk(a->count, c->size, 0, &off, &len);  /* chunk 0 is the longest */
    tmp = (char *)dtr__comm_scratch(c, len * es);
    if (!tmp) return dtr__oom(c, a, len * es);
    res = dtr__ring_reduce_scatter(c, a, (const char *)a->src, dst, tmp);
    if (res != DTR_OK) return res;
    return dtr__ring_all_gather_chunks(c, a, dst, (uint32_t)c->size - 1);
}

static dtr_result dtr__all_reduce_rd(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, r = c->rank, p = 1, m, nr, d;
    size_t es = dtr_dtype_size(a->dtype), bytes = a->count * es;
    char *dst = (char *)a->dst, *tmp;
    uint32_t step = 1;
    dtr_result res;
    while (p * 2 <= N) p *= 2;
    m = N - p;
    tmp = (char *)dtr__comm_scratch(c, bytes);
    if (!tmp) return dtr__oom(c, a, bytes);
    if ((res = dtr__coll_copy(c, a, dst, a->src, bytes)) != DTR_OK) return res;
    /* fold: ranks 2i hand their data to 2i+1 (i < m) */
    if (r < 2 * m) {
        if (r % 2 == 0) {
            res = dtr__comm_sendrecv(c, a, dst, bytes, r + 1, NULL, 0, -1, 0);
            if (res != DTR_OK) return res;
            nr = -1;
        } else {
            res = dtr__comm_sendrecv(c, a, NULL, 0, -1, tmp, bytes, r - 1, 0);
            if (res != DTR_OK) return res;
            res = dtr__coll_reduce(c, dst, tmp, dst, a->count, a, 1);
            if (res != DTR_OK) return res;
            nr = r / 2;
        }
    } else {
        nr = r - m;
    }
    if (nr >= 0) {
        for (d = 1; d < p; d *= 2, step++) {
            int pn = nr ^ d, partner = pn < m ? 2 * pn + 1 : pn + m;
            int div = d * 2 >= p ? dtr__avg_div(c, a) : 1;
            res = dtr__comm_sendrecv(c, a, dst, bytes, partner, tmp, bytes, partner, step);
            if (res != DTR_OK) return res;
            res = nr < pn ? dtr__coll_reduce(c, dst, dst, tmp, a->count, a, div) : dtr__coll_reduce(c, dst, tmp, dst, a->count, a, div);
            if (res != DTR_OK) return res;
        }
    }
    /* unfold: the result goes back to the folded-out ranks */
    if (r < 2 * m) {
        if (r % 2 == 1) res = dtr__comm_sendrecv(c, a, dst, bytes, r - 1, NULL, 0, -1, 0xffffffu);
        else res = dtr__comm_sendrecv(c, a, NULL, 0, -1, dst, bytes, r + 1, 0xffffffu);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

/* ---- hierarchical all-reduce ---- */

/* Runs collective `sub` on a child group of c (host or leaders) inside c's collective `a`:
 * the child's sequence number, a's deadline; a failure there is c's failure. */
static dtr_result dtr__coll_child(dtr_comm *c, const dtr__coll *a, dtr_comm *child, dtr__coll *sub) {
    dtr_result r;
    sub->seq = child->seq++;
    if (sub->kind == DTR__OP_ALL_REDUCE) sub->algo = dtr__auto_algo(child, sub->count, sub->dtype);
    r = dtr__coll_run(child, sub);
    if (r == DTR_OK) return DTR_OK;
    return dtr__comm_fail(c, a, r, dtr_comm_failed_rank(child), dtr_comm_native_error(child), "in the %s group: %s",
                          child == c->host ? "host" : "leaders'", dtr_comm_last_error(child));
}

/* Sum inside the host, all-reduce of the hosts' sums between the leaders (an average is
 * divided by the whole group's size in its last step), broadcast inside the host. */
static dtr_result dtr__all_reduce_hier(dtr_comm *c, const dtr__coll *a) {
    dtr__coll s = *a;
    dtr_result r;
    s.op = a->op == DTR_REDUCE_AVG ? DTR_REDUCE_SUM : a->op;
    if ((r = dtr__coll_child(c, a, c->host, &s)) != DTR_OK) return r;
    if (c->leaders) {
        s = *a;
        s.src = a->dst;
        s.avg_div = c->size;
        if ((r = dtr__coll_child(c, a, c->leaders, &s)) != DTR_OK) return r;
    }
    s = *a;
    s.kind = DTR__OP_BROADCAST;
    s.root = 0;
    return dtr__coll_child(c, a, c->host, &s);
}

/* hierarchical only where it changes something (decided alike on every rank) */
static int dtr__use_hier(const dtr_comm *c) { return c->hier_ready && c->hier_on; }

/* ---- broadcast ---- */

static dtr_result dtr__broadcast_tree(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, vr = dtr__mod(c->rank - a->root, N), mask = 1, n = 0;
    size_t bytes = a->count * dtr_dtype_size(a->dtype);
    const dtr_transport_vtable *vt = c->ep->vt;
    uint64_t tag = dtr__tag_coll(c->ctx, a->seq, 0);
    void *reqs[32];
    dtr_transport_error e;
    dtr_result res;
    while (mask < N) {
        if (vr & mask) {
            res = dtr__comm_sendrecv(c, a, NULL, 0, -1, a->dst, bytes, dtr__mod(vr - mask + a->root, N), 0);
            if (res != DTR_OK) return res;
            break;
        }
        mask <<= 1;
    }
    for (mask >>= 1; mask > 0; mask >>= 1) {
        if (vr + mask < N) {
            e.rank = -1; e.native_code = 0; e.msg[0] = 0;
            res = vt->isend(c->ep->state, a->dst, bytes, c->ranks[dtr__mod(vr + mask + a->root, N)], tag, &reqs[n], &e);
            if (res != DTR_OK) {
                while (n > 0) vt->release(c->ep->state, reqs[--n]);
                return dtr__comm_fail(c, a, res, e.rank, e.native_code, "%s", e.msg);
            }
            n++;
        }
    }
    return n ? dtr__comm_waitall(c, a, reqs, n) : DTR_OK;
}

#define DTR__CHAIN_WINDOW 4

/* Pipelined chain root -> root+1 -> ...: segment k goes on as soon as it has arrived. */
static dtr_result dtr__broadcast_chain(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, vr = dtr__mod(c->rank - a->root, N);
    int prev = vr > 0 ? dtr__mod(c->rank - 1, N) : -1, next = vr + 1 < N ? (c->rank + 1) % N : -1;
    size_t bytes = a->count * dtr_dtype_size(a->dtype), seg = c->segment, nseg, k, posted = 0;
    const dtr_transport_vtable *vt = c->ep->vt;
    void *rq[DTR__CHAIN_WINDOW], *sq[DTR__CHAIN_WINDOW];
    char *buf = (char *)a->dst;
    dtr_transport_error e;
    dtr_result res = DTR_OK;
    int i;
    if (seg < 4096) seg = 4096;
    while (bytes / seg >= ((size_t)1 << 23)) seg *= 2;   /* segment index fits a tag step */
    nseg = (bytes + seg - 1) / seg;
    for (i = 0; i < DTR__CHAIN_WINDOW; i++) rq[i] = sq[i] = NULL;
    e.rank = -1; e.native_code = 0; e.msg[0] = 0;
    for (k = 0; k < nseg; k++) {
        size_t off = k * seg, len = bytes - off < seg ? bytes - off : seg;
        int w = (int)(k % DTR__CHAIN_WINDOW);
        if (prev >= 0) {
            /* keep up to WINDOW receives posted ahead */
            while (posted < nseg && posted < k + DTR__CHAIN_WINDOW) {
                size_t po = posted * seg, pl = bytes - po < seg ? bytes - po : seg;
                res = vt->irecv(c->ep->state, buf + po, pl, c->ranks[prev], dtr__tag_coll(c->ctx, a->seq, (uint32_t)posted),
                                &rq[posted % DTR__CHAIN_WINDOW], &e);
                if (res != DTR_OK) goto fail;
                posted++;
            }
            res = dtr__comm_waitall(c, a, &rq[w], 1);
            if (res != DTR_OK) goto out;
        }
        if (next >= 0) {
            if (sq[w]) { res = dtr__comm_waitall(c, a, &sq[w], 1); if (res != DTR_OK) goto out; }
            res = vt->isend(c->ep->state, buf + off, len, c->ranks[next], dtr__tag_coll(c->ctx, a->seq, (uint32_t)k), &sq[w], &e);
            if (res != DTR_OK) goto fail;
        }
    }
    return dtr__comm_waitall(c, a, sq, DTR__CHAIN_WINDOW);
fail:
    res = dtr__comm_fail(c, a, res, e.rank, e.native_code, "%s", e.msg);
out:
    for (i = 0; i < DTR__CHAIN_WINDOW; i++) {
        if (rq[i]) vt->release(c->ep->state, rq[i]);
        if (sq[i]) vt->release(c->ep->state, sq[i]);
    }
    return res;
}

/* ---- reduce-scatter, all-gather, barrier ---- */

static dtr_result dtr__reduce_scatter_ring(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, r = c->rank, s, right = (r + 1) % N, left = (r + N - 1) % N;
    size_t es = dtr_dtype_size(a->dtype), bytes = a->count * es;
    const char *src = (const char *)a->src;
    char *buf[2];
    dtr_result res;
    if (N == 1) return dtr__coll_copy(c, a, a->dst, a->src, bytes);
    buf[0] = (char *)dtr__comm_scratch(c, 2 * bytes);
    if (!buf[0]) return dtr__oom(c, a, 2 * bytes);
    buf[1] = buf[0] + bytes;
    /* step s: send the partial of block r-s-1 (at s = 0 our own input), receive the partial
       of block r-s-2 and add our input to it */
    for (s = 0; s < N - 1; s++) {
        int ks = dtr__mod(r - s - 1, N), kr = dtr__mod(r - s - 2, N);
        const char *sb = s == 0 ? src + (size_t)ks * bytes : buf[(s - 1) % 2];
        char *rb = buf[s % 2];
        res = dtr__comm_sendrecv(c, a, sb, bytes, right, rb, bytes, left, (uint32_t)s);
        if (res != DTR_OK) return res;
        if (s == N - 2)
            res = dtr__coll_reduce(c, a->dst, rb, src + (size_t)kr * bytes, a->count, a, dtr__avg_div(c, a));
        else
            res = dtr__coll_reduce(c, rb, rb, src + (size_t)kr * bytes, a->count, a, 1);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

static dtr_result dtr__all_gather_ring(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, r = c->rank, s, right = (r + 1) % N, left = (r + N - 1) % N;
    size_t es = dtr_dtype_size(a->dtype), bytes = a->count * es;
    char *dst = (char *)a->dst;
    dtr_result res;
    if ((res = dtr__coll_copy(c, a, dst + (size_t)r * bytes, a->src, bytes)) != DTR_OK) return res;
    for (s = 0; s < N - 1; s++) {
        int ks = dtr__mod(r - s, N), kr = dtr__mod(r - s - 1, N);
        res = dtr__comm_sendrecv(c, a, dst + (size_t)ks * bytes, bytes, right, dst + (size_t)kr * bytes, bytes, left,
                                 (uint32_t)s);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

static dtr_result dtr__barrier_dissemination(dtr_comm *c, const dtr__coll *a) {
    int N = c->size, r = c->rank, k;
    dtr_result res;
    for (k = 0; (1 << k) < N; k++) {
        res = dtr__comm_sendrecv(c, a, NULL, 0, (r + (1 << k)) % N, NULL, 0, dtr__mod(r - (1 << k), N), (uint32_t)k);
        if (res != DTR_OK) return res;
    }
    return DTR_OK;
}

/* ---- dispatch ---- */

static dtr_result dtr__coll_native(dtr_comm *c, const dtr__coll *a, int *used) {
    const dtr_transport_vtable *vt = c->ep->vt;
    void *st = c->ep->state, *g = c->native_group;
    dtr_transport_error e;
    dtr_result r = DTR_OK;
    *used = 1;
    e.rank = -1; e.native_code = 0; e.msg[0] = 0;
    if (a->kind == DTR__OP_ALL_REDUCE && vt->all_reduce)
        r = vt->all_reduce(st, g, a->src, a->dst, a->count, a->dtype, a->op, a->deadline, &e);
    else if (a->kind == DTR__OP_BROADCAST && vt->broadcast)
        r = vt->broadcast(st, g, a->dst, a->count, a->dtype, a->root, a->deadline, &e);
    else if (a->kind == DTR__OP_REDUCE_SCATTER && vt->reduce_scatter)
        r = vt->reduce_scatter(st, g, a->src, a->dst, a->count, a->dtype, a->op, a->deadline, &e);
    else if (a->kind == DTR__OP_ALL_GATHER && vt->all_gather)
        r = vt->all_gather(st, g, a->src, a->dst, a->count, a->dtype, a->deadline, &e);
    else if (a->kind == DTR__OP_BARRIER && vt->barrier)
        r = vt->barrier(st, g, a->deadline, &e);
    else
        *used = 0;
    if (*used && r != DTR_OK) {
        if (r == DTR_TIMEOUT)
            return dtr__comm_fail(c, a, r, e.rank, e.native_code, "timed out after %d ms: %s", a->timeout_ms, e.msg);
        return dtr__comm_fail(c, a, r, e.rank, e.native_code, "%s", e.msg[0] ? e.msg : dtr_result_string(r));
    }
    return r;
}

/* the all-reduce algorithm that runs: the one asked for, AUTO's pick, or hierarchical where
 * it changes something */
static int dtr__effective_algo(const dtr_comm *c, const dtr__coll *a) {
    if (a->algo == DTR_ALLREDUCE_RING || a->algo == DTR_ALLREDUCE_RECURSIVE_DOUBLING) return a->algo;
    if (a->algo == DTR_ALLREDUCE_HIERARCHICAL && dtr__use_hier(c)) return a->algo;
    return dtr__auto_algo(c, a->count, a->dtype);
}

static dtr_result dtr__coll_exec(dtr_comm *c, const dtr__coll *in) {
    size_t es = dtr_dtype_size(in->dtype);
    dtr__coll b = *in, *a = &b;
    dtr_result r;
    int used = 0;
    if (c->size == 1) { /* no communication: copy (and an average over one rank is the value) */
        if (a->kind == DTR__OP_ALL_REDUCE || a->kind == DTR__OP_REDUCE_SCATTER || a->kind == DTR__OP_ALL_GATHER)
            return dtr__coll_copy(c, a, a->dst, a->src, a->count * es);
        return DTR_OK;
    }
    if (a->count == 0 && a->kind != DTR__OP_BARRIER) return DTR_OK;   /* the same on every rank */
    if (c->native_group) {
        r = dtr__coll_native(c, a, &used);
        if (used) return r;
    }
    if (a->kind == DTR__OP_ALL_REDUCE) b.algo = dtr__effective_algo(c, a);
    if (a->kind == DTR__OP_ALL_REDUCE && a->algo == DTR_ALLREDUCE_HIERARCHICAL) {
        r = dtr__all_reduce_hier(c, a);
    } else if (dtr__shm_run(c, a, &r)) {
        /* done through the group's shared memory */
    } else switch (a->kind) {
    case DTR__OP_ALL_REDUCE:
        r = a->algo == DTR_ALLREDUCE_RING ? dtr__all_reduce_ring(c, a) : dtr__all_reduce_rd(c, a);
        break;
    case DTR__OP_BROADCAST:
        r = a->count * es >= c->chain_threshold ? dtr__broadcast_chain(c, a) : dtr__broadcast_tree(c, a);
        break;
    case DTR__OP_REDUCE_SCATTER: r = dtr__reduce_scatter_ring(c, a); break;
    case DTR__OP_ALL_GATHER: r = dtr__all_gather_ring(c, a); break;
    case DTR__OP_BARRIER: r = dtr__barrier_dissemination(c, a); break;
    default: r = dtr__comm_fail(c, a, DTR_INVALID_ARGUMENT, -1, 0, "not a collective");
    }
    if (r != DTR_OK && r != DTR_TIMEOUT && r != DTR_PEER_FAILED) dtr__coll_cannot(c, a, r);
    return r;
}

dtr_result dtr__coll_cannot(dtr_comm *c, const dtr__coll *a, dtr_result r) {
    char why[160];
    snprintf(why, sizeof why, "rank %d could not take part in %s #%u: %s", c->ep->info.rank, dtr__coll_name(a->kind),
             a->seq, dtr_result_string(r));
    pthread_mutex_lock(&c->mu);
    if (c->status != DTR_TIMEOUT && c->status != DTR_PEER_FAILED) {
        c->status = DTR_PEER_FAILED;
        c->failed_rank = c->ep->info.rank;
    }
    pthread_mutex_unlock(&c->mu);
    c->ep->vt->abort(c->ep->state, c->ep->info.rank, why);
    return r;
}

dtr_result dtr__coll_run(dtr_comm *c, const dtr__coll *a) {
    uint64_t id = dtr__flight_begin(c, a);
    dtr_result r = dtr__coll_exec(c, a);
    dtr__flight_end(c, id, r);
    return r;
}
