/* ============================================================================
 * The `local` transport: the ranks of a world are threads of this process.
 *
 * A dtr_local_world holds, per rank, the receives it has posted and the sends addressed to
 * it that no receive has matched yet ("unexpected"), both in posting order, under one
 * mutex. Matching is MPI's: a send takes the oldest posted receive with its (source, tag),
 * a receive the oldest unexpected send with its (source, tag). Data is copied once, from
 * the sender's buffer straight into the receiver's, outside the mutex:
 *   - a receive that finds its send already waiting copies at once (the receiver's thread);
 *   - a send that finds its receive posted copies itself when the message is small
 *     (< DTR__LOCAL_EAGER bytes), and otherwise hands the copy to the receiver, which does it
 *     in its next test or wait; so in a ring or an exchange each rank copies its own incoming
 *     data and the copies of different ranks run in parallel.
 * A send therefore completes when the receiver has the data (synchronous mode).
 * Waiting sleeps on the rank's condition variable with the caller's deadline.
 *
 * Failure: a rank that closes its endpoint fails its peers' pending requests with
 * DTR_PEER_FAILED naming it; abort(r) fails every rank's pending and later requests naming r.
 * When a wait times out, the world knows which ranks are blocked and on whom: the rank at
 * fault is found by following "waits for" from the peer until a rank that is not waiting
 * in the transport (it hangs, or computes past the deadline) or has left, and the world is
 * broken at once naming it, so every other rank fails with DTR_PEER_FAILED naming the same
 * rank.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_comm.h"
#include "../core/internal.h"
#include "comm_internal.h"

#ifndef DTR__LOCAL_EAGER
#define DTR__LOCAL_EAGER 32768
#endif

enum { DTR__LR_POSTED = 0, DTR__LR_MATCHED = 1, DTR__LR_COPYING = 2, DTR__LR_DONE = 3 };

typedef struct dtr__lreq {
    struct dtr__lreq *next;          /* in a posting queue, a copy queue or the free list */
    struct dtr__lreq *lnext, *lprev; /* the owner's live requests */
    struct dtr__lreq *match;         /* the other side once matched */
    int is_send, owner, peer;
    uint64_t tag;
    void *buf;
    size_t bytes;
    int state;
    dtr_result result;
    int fail_rank;                   /* rank named by a failed result */
    char why[96];
} dtr__lreq;

typedef struct dtr__lqueue { dtr__lreq *head, *tail; } dtr__lqueue;

typedef struct dtr__lrank {
    pthread_cond_t cv;
    dtr__lqueue recvs;       /* receives this rank posted, not matched */
    dtr__lqueue sends;       /* sends to this rank, not matched */
    dtr__lqueue copies;      /* this rank's receives matched by a large send: it copies */
    dtr__lreq *live;         /* every request this rank holds */
    dtr__lreq *free_list;
    int opened, closed;
    int blocked;             /* threads of this rank waiting in the transport */
    int wait_peer;           /* the peer the latest of them waits for */
} dtr__lrank;

/* A block the ranks of a world share under a key (a group's shared-memory segment,
 * src/comm/shm.c): made zeroed and initialised by the first rank that asks, freed by the
 * last one that lets go. `failed` when it could not be made: every rank then goes without. */
typedef struct dtr__lshared {
    struct dtr__lshared *next;
    uint64_t key;
    int refs, failed;
    void *p;
} dtr__lshared;

struct dtr_local_world {
    pthread_mutex_t mu;
    dtr__lshared *shared;
    int size, refs;
    dtr_allocation_callbacks alloc;
    dtr__lrank *r;
    int failed_rank;         /* >= 0 once the world is broken */
    char why[200];
};

typedef struct dtr__lep {
    dtr_local_world *w;
    int rank;
} dtr__lep;

/* ---- world ---- */

dtr_result dtr_local_world_create(int size, const dtr_allocation_callbacks *alloc, dtr_local_world **out) {
    dtr_local_world *w;
    int i;
    if (!out) return DTR_NULL_HANDLE;
    *out = NULL;
    if (size < 1 || size > 4096) return DTR_INVALID_ARGUMENT;
    w = (dtr_local_world *)dtr__calloc(alloc, sizeof(*w));
    if (!w) return DTR_OUT_OF_MEMORY;
    if (alloc) w->alloc = *alloc;
    w->r = (dtr__lrank *)dtr__calloc(alloc, (size_t)size * sizeof(*w->r));
    if (!w->r) { dtr__free(alloc, w); return DTR_OUT_OF_MEMORY; }
    if (pthread_mutex_init(&w->mu, NULL) != 0) { dtr__free(alloc, w->r); dtr__free(alloc, w); return DTR_OUT_OF_MEMORY; }
    for (i = 0; i < size; i++) {
        if (dtr__cond_init(&w->r[i].cv) != 0) {
            while (--i >= 0) pthread_cond_destroy(&w->r[i].cv);
            pthread_mutex_destroy(&w->mu);
            dtr__free(alloc, w->r);
            dtr__free(alloc, w);
            return DTR_OUT_OF_MEMORY;
        }
        w->r[i].wait_peer = -1;
    }
    w->size = size;
    w->refs = 1;
    w->failed_rank = -1;
    *out = w;
    return DTR_OK;
}

static void dtr__local_world_free(dtr_local_world *w) {
    dtr_allocation_callbacks a = w->alloc;
    int i;
    for (i = 0; i < w->size; i++) {
        dtr__lreq *q = w->r[i].free_list, *n;
        while (q) { n = q->next; dtr__free(&a, q); q = n; }
        pthread_cond_destroy(&w->r[i].cv);
    }
    pthread_mutex_destroy(&w->mu);
    dtr__free(&a, w->r);
    dtr__free(&a, w);
}

/* drops one reference; frees on the last. Called without the lock held. */
static void dtr__local_world_unref(dtr_local_world *w) {
    int last;
    pthread_mutex_lock(&w->mu);
    last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (last) dtr__local_world_free(w);
}

void dtr_local_world_destroy(dtr_local_world *w) {
    if (w) dtr__local_world_unref(w);
}

int dtr_local_world_size(const dtr_local_world *w) { return w ? w->size : 0; }

void *dtr__local_shared_get(void *ep_state, uint64_t key, size_t bytes, void (*init)(void *p, void *arg), void *arg) {
    dtr_local_world *w = ((dtr__lep *)ep_state)->w;
    dtr__lshared *e;
    void *p;
    pthread_mutex_lock(&w->mu);
    for (e = w->shared; e && e->key != key; e = e->next) {}
    if (!e && (e = (dtr__lshared *)dtr__calloc(&w->alloc, sizeof(*e))) != NULL) {
        e->key = key;
        e->p = dtr__calloc(&w->alloc, bytes);
        e->failed = e->p == NULL;
        if (e->p) init(e->p, arg);
        e->next = w->shared;
        w->shared = e;
    }
    if (e) e->refs++;
    p = e && !e->failed ? e->p : NULL;
    pthread_mutex_unlock(&w->mu);
    return p;
}

void dtr__local_shared_put(void *ep_state, uint64_t key) {
    dtr_local_world *w = ((dtr__lep *)ep_state)->w;
    dtr__lshared **pp, *e;
    pthread_mutex_lock(&w->mu);
    for (pp = &w->shared; (e = *pp) != NULL && e->key != key; pp = &e->next) {}
    if (e && --e->refs == 0) {
        *pp = e->next;
        dtr__free(&w->alloc, e->p);
        dtr__free(&w->alloc, e);
    }
    pthread_mutex_unlock(&w->mu);
}

/* ---- queues (world lock held) ---- */

static void dtr__lq_push(dtr__lqueue *q, dtr__lreq *r) {
    r->next = NULL;
    if (q->tail) q->tail->next = r;
    else q->head = r;
    q->tail = r;
}

static int dtr__lq_remove(dtr__lqueue *q, dtr__lreq *r) {
    dtr__lreq *p = NULL, *c = q->head;
    while (c && c != r) { p = c; c = c->next; }
    if (!c) return 0;
    if (p) p->next = c->next;
    else q->head = c->next;
    if (q->tail == c) q->tail = p;
    c->next = NULL;
    return 1;
}

/* the oldest request of q from `peer` (sends: owner; receives: peer) with `tag` */
static dtr__lreq *dtr__lq_take(dtr__lqueue *q, int peer, uint64_t tag, int by_owner) {
    dtr__lreq *p = NULL, *c = q->head;
    for (; c; p = c, c = c->next) {
        if (c->tag == tag && (by_owner ? c->owner : c->peer) == peer) {
            if (p) p->next = c->next;
            else q->head = c->next;
            if (q->tail == c) q->tail = p;
            c->next = NULL;
            return c;
        }
    }
    return NULL;
}

static dtr__lreq *dtr__lreq_new(dtr_local_world *w, int owner) {
    dtr__lrank *rk = &w->r[owner];
    dtr__lreq *q = rk->free_list;
    if (q) rk->free_list = q->next;
    else if (!(q = (dtr__lreq *)dtr__malloc(&w->alloc, sizeof(*q)))) return NULL;
    memset(q, 0, sizeof(*q));
    q->owner = owner;
    q->fail_rank = -1;
    q->lnext = rk->live;
    if (rk->live) rk->live->lprev = q;
    rk->live = q;
    return q;
}

static void dtr__lreq_put(dtr_local_world *w, dtr__lreq *q) {
    dtr__lrank *rk = &w->r[q->owner];
    if (q->lprev) q->lprev->lnext = q->lnext;
    else rk->live = q->lnext;
    if (q->lnext) q->lnext->lprev = q->lprev;
    q->next = rk->free_list;
    rk->free_list = q;
}

static void dtr__lreq_finish(dtr_local_world *w, dtr__lreq *q, dtr_result res, int fail_rank, const char *why) {
    q->state = DTR__LR_DONE;
    q->result = res;
    q->fail_rank = fail_rank;
    if (why) snprintf(q->why, sizeof(q->why), "%.*s", (int)sizeof(q->why) - 1, why);
    pthread_cond_broadcast(&w->r[q->owner].cv);
}

/* Copies send s into receive r (both COPYING, lock NOT held), then completes both. */
static void dtr__local_copy(dtr_local_world *w, dtr__lreq *s, dtr__lreq *r) {
    int fits = s->bytes <= r->bytes;
    if (fits && s->bytes) memcpy(r->buf, s->buf, s->bytes);
    pthread_mutex_lock(&w->mu);
    if (fits) {
        r->bytes = s->bytes;
        dtr__lreq_finish(w, s, DTR_OK, -1, NULL);
        dtr__lreq_finish(w, r, DTR_OK, -1, NULL);
    } else {
        char why[96];
        snprintf(why, sizeof why, "message of %zu bytes is longer than the %zu-byte receive", s->bytes, r->bytes);
        dtr__lreq_finish(w, s, DTR_INVALID_ARGUMENT, r->owner, why);
        dtr__lreq_finish(w, r, DTR_INVALID_ARGUMENT, s->owner, why);
    }
    s->match = r->match = NULL;
}

/* Copies every receive of `rank` that a large send matched (lock held on entry and exit). */
static void dtr__local_service(dtr_local_world *w, int rank) {
    dtr__lrank *rk = &w->r[rank];
    while (rk->copies.head) {
        dtr__lreq *r = rk->copies.head, *s = r->match;
        dtr__lq_remove(&rk->copies, r);
        r->state = s->state = DTR__LR_COPYING;
        pthread_mutex_unlock(&w->mu);
        dtr__local_copy(w, s, r);   /* returns with the lock held */
    }
}

/* ---- vtable ---- */

/* Every rank of a world is on this host, unless $DTR_RANKS_PER_HOST declares fake hosts of
 * k consecutive ranks (the last may hold fewer). */
static void dtr__local_host(int rank, int size, dtr_transport_info *info) {
    int k = dtr__fake_ranks_per_host(), first;
    if (k <= 0 || k > size) k = size;
    first = rank / k * k;
    info->rank = rank;
    info->size = size;
    info->local_rank = rank - first;
    info->local_size = size - first < k ? size - first : k;
}

static dtr_result dtr__local_open(const dtr_comm_config *cfg, void **state, dtr_transport_info *info, char *err,
                                  size_t errlen) {
    dtr_local_world *w = cfg->local.world;
    int rank = cfg->local.rank;
    dtr__lep *ep;
    if (!w) return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "local transport: dtr_comm_config.local.world is NULL "
                                                              "(make one with dtr_local_world_create)");
    if (rank < 0 || rank >= w->size)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "local transport: rank %d outside the world of %d", rank,
                         w->size);
    ep = (dtr__lep *)dtr__calloc(&w->alloc, sizeof(*ep));
    if (!ep) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "local transport: out of memory");
    pthread_mutex_lock(&w->mu);
    if (w->r[rank].opened) {
        pthread_mutex_unlock(&w->mu);
        dtr__free(&w->alloc, ep);
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "local transport: rank %d of this world was opened already",
                         rank);
    }
    w->r[rank].opened = 1;
    w->refs++;
    pthread_mutex_unlock(&w->mu);
    ep->w = w;
    ep->rank = rank;
    dtr__local_host(rank, w->size, info);
    *state = ep;
    return DTR_OK;
}

static void dtr__lerr(dtr_transport_error *err, int rank, const char *fmt, ...) DTR__PRINTF(3, 4);
static void dtr__lerr(dtr_transport_error *err, int rank, const char *fmt, ...) {
    va_list ap;
    if (!err) return;
    err->rank = rank;
    err->native_code = 0;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    va_end(ap);
}

/* the error a request to/from `peer` gets when the world or the peer is gone (lock held):
   DTR_OK when both are fine */
static dtr_result dtr__local_gone(dtr_local_world *w, int peer, int *who, const char **why) {
    if (w->failed_rank >= 0) { *who = w->failed_rank; *why = w->why; return DTR_PEER_FAILED; }
    if (w->r[peer].closed) { *who = peer; *why = "it left the group (closed its endpoint)"; return DTR_PEER_FAILED; }
    return DTR_OK;
}

static dtr_result dtr__local_post(dtr__lep *ep, int is_send, void *buf, size_t bytes, int peer, uint64_t tag, void **req,
                                  dtr_transport_error *err) {
    dtr_local_world *w = ep->w;
    dtr__lreq *q, *m;
    const char *why;
    int who;
    dtr_result r;
    *req = NULL;
    if (peer < 0 || peer >= w->size) {
        dtr__lerr(err, -1, "rank %d outside the world of %d", peer, w->size);
        return DTR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&w->mu);
    if ((r = dtr__local_gone(w, peer, &who, &why)) != DTR_OK) {
        pthread_mutex_unlock(&w->mu);
        dtr__lerr(err, who, "rank %d failed: %s", who, why);
        return r;
    }
    q = dtr__lreq_new(w, ep->rank);
    if (!q) { pthread_mutex_unlock(&w->mu); dtr__lerr(err, -1, "out of memory"); return DTR_OUT_OF_MEMORY; }
    q->is_send = is_send;
    q->peer = peer;
    q->tag = tag;
    q->buf = buf;
    q->bytes = bytes;
    *req = q;
    if (is_send) {
        m = dtr__lq_take(&w->r[peer].recvs, ep->rank, tag, 0);
        if (!m) { dtr__lq_push(&w->r[peer].sends, q); pthread_mutex_unlock(&w->mu); return DTR_OK; }
        q->match = m;
        m->match = q;
        if (bytes < DTR__LOCAL_EAGER) {
            q->state = m->state = DTR__LR_COPYING;
            pthread_mutex_unlock(&w->mu);
            dtr__local_copy(w, q, m);
        } else { /* the receiver copies */
            q->state = m->state = DTR__LR_MATCHED;
            dtr__lq_push(&w->r[peer].copies, m);
            pthread_cond_broadcast(&w->r[peer].cv);
        }
    } else {
        m = dtr__lq_take(&w->r[ep->rank].sends, peer, tag, 1);
        if (!m) { dtr__lq_push(&w->r[ep->rank].recvs, q); pthread_mutex_unlock(&w->mu); return DTR_OK; }
        q->match = m;
        m->match = q;
        q->state = m->state = DTR__LR_COPYING;
        pthread_mutex_unlock(&w->mu);
        dtr__local_copy(w, m, q);
    }
    pthread_mutex_unlock(&w->mu);
    return DTR_OK;
}

static dtr_result dtr__local_isend(void *state, const void *buf, size_t bytes, int dst, uint64_t tag, void **req,
                                   dtr_transport_error *err) {
    return dtr__local_post((dtr__lep *)state, 1, (void *)(uintptr_t)buf, bytes, dst, tag, req, err);
}

static dtr_result dtr__local_irecv(void *state, void *buf, size_t bytes, int src, uint64_t tag, void **req,
                                   dtr_transport_error *err) {
    return dtr__local_post((dtr__lep *)state, 0, buf, bytes, src, tag, req, err);
}

/* 1 when q is complete (lock held); fails it first when its peer or the world is gone */
static int dtr__local_check(dtr_local_world *w, dtr__lreq *q) {
    const char *why;
    int who;
    if (q->state == DTR__LR_DONE) return 1;
    if (q->state == DTR__LR_COPYING) return 0;  /* a copy in progress always finishes */
    if (dtr__local_gone(w, q->peer, &who, &why) != DTR_OK) {
        /* unlink it from where it waits; its buffer is not touched any more */
        if (q->state == DTR__LR_POSTED) {
            if (q->is_send) dtr__lq_remove(&w->r[q->peer].sends, q);
            else dtr__lq_remove(&w->r[q->owner].recvs, q);
        } else { /* matched: the receive sits in a copy queue */
            dtr__lreq *m = q->match, *rv = q->is_send ? m : q;
            dtr__lq_remove(&w->r[rv->owner].copies, rv);
            if (m) {
                m->match = NULL;
                dtr__lreq_finish(w, m, DTR_PEER_FAILED, who, why);
            }
            q->match = NULL;
        }
        dtr__lreq_finish(w, q, DTR_PEER_FAILED, who, why);
        return 1;
    }
    return 0;
}

static dtr_result dtr__local_result(const dtr__lreq *q, dtr_transport_error *err) {
    if (q->result != DTR_OK) {
        if (q->result == DTR_PEER_FAILED) dtr__lerr(err, q->fail_rank, "rank %d failed: %s", q->fail_rank, q->why);
        else dtr__lerr(err, q->fail_rank, "%s", q->why);
    }
    return q->result;
}

static dtr_result dtr__local_test(void *state, void *req, int *done, dtr_transport_error *err) {
    dtr__lep *ep = (dtr__lep *)state;
    dtr_local_world *w = ep->w;
    dtr__lreq *q = (dtr__lreq *)req;
    dtr_result r = DTR_OK;
    pthread_mutex_lock(&w->mu);
    dtr__local_service(w, ep->rank);
    *done = dtr__local_check(w, q);
    if (*done) r = dtr__local_result(q, err);
    pthread_mutex_unlock(&w->mu);
    return r;
}

/* The rank at fault when a wait for `peer` times out: follow "waits for" (lock held). */
static int dtr__local_culprit(dtr_local_world *w, int me, int peer, int *cycle) {
    int q = peer, steps;
    *cycle = 0;
    for (steps = 0; steps <= w->size; steps++) {
        if (q < 0 || q == me) break;
        if (w->r[q].closed || w->r[q].blocked == 0) return q;
        q = w->r[q].wait_peer;
    }
    *cycle = 1;
    return peer;
}

/* wait_any (soft = 0) and wait_some (soft = 1: the deadline is no failure, and the rank does
   not count as blocked on a peer for the waits-for analysis: a server loop waits on many) */
static dtr_result dtr__local_wait(dtr__lep *ep, void *const *reqs, int n, int64_t deadline_ns, int soft,
                                  dtr_transport_error *err) {
    dtr_local_world *w = ep->w;
    dtr__lrank *me = &w->r[ep->rank];
    dtr_result r = DTR_OK;
    int64_t spin_until = dtr_time_ns() + 20000;
    int i;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        int pending_peer = -1, timed_out = 0;
        dtr__local_service(w, ep->rank);
        for (i = 0; i < n; i++) {
            dtr__lreq *q = (dtr__lreq *)reqs[i];
            if (!q) continue;
            if (dtr__local_check(w, q)) goto out;
            if (pending_peer < 0) pending_peer = q->peer;
        }
        if (pending_peer < 0) goto out; /* nothing to wait for */
        if (dtr_time_ns() >= deadline_ns) {
            int cycle, who;
            if (soft) goto out;   /* wait_some: no failure, nobody to blame */
            who = dtr__local_culprit(w, ep->rank, pending_peer, &cycle);
            if (cycle)
                dtr__lerr(err, who, "no message from rank %d, and the ranks it waits for wait in turn "
                                    "(mismatched collective calls?)", pending_peer);
            else if (who == pending_peer)
                dtr__lerr(err, who, "rank %d did not answer (it is not waiting in any call of the group)", who);
            else
                dtr__lerr(err, who, "rank %d did not answer: it waits for others, and rank %d, down that chain, "
                                    "is not waiting in any call of the group", pending_peer, who);
            /* break the world now, under the lock: a rank that times out a moment later
               must not mistake this one (no longer waiting) for the culprit */
            if (w->failed_rank < 0) {
                int k;
                w->failed_rank = who;
                snprintf(w->why, sizeof(w->why), "rank %d timed out waiting for it: %.150s", ep->rank, err ? err->msg : "");
                for (k = 0; k < w->size; k++) pthread_cond_broadcast(&w->r[k].cv);
            }
            r = DTR_TIMEOUT;
            goto out;
        }
        me->blocked += !soft;
        if (!soft) me->wait_peer = pending_peer;
        if (dtr_time_ns() < spin_until) {
            /* the first microseconds: poll with the lock released (the peer is usually a
               moment away), then sleep on the condition variable */
            volatile int k;
            pthread_mutex_unlock(&w->mu);
            for (k = 0; k < 200; k++) {}
            pthread_mutex_lock(&w->mu);
        } else
            timed_out = dtr__cond_wait_until(&me->cv, &w->mu, deadline_ns);
        me->blocked -= !soft;
        (void)timed_out; /* the loop re-checks everything, the deadline included */
    }
out:
    pthread_mutex_unlock(&w->mu);
    return r;
}

static dtr_result dtr__local_wait_any(void *state, void *const *reqs, int n, int64_t deadline_ns,
                                      dtr_transport_error *err) {
    return dtr__local_wait((dtr__lep *)state, reqs, n, deadline_ns, 0, err);
}

static dtr_result dtr__local_wait_some(void *state, void *const *reqs, int n, int64_t until_ns) {
    return dtr__local_wait((dtr__lep *)state, reqs, n, until_ns, 1, NULL);
}

static void dtr__local_release(void *state, void *req) {
    dtr__lep *ep = (dtr__lep *)state;
    dtr_local_world *w = ep->w;
    dtr__lreq *q = (dtr__lreq *)req;
    if (!q) return;
    pthread_mutex_lock(&w->mu);
    while (q->state == DTR__LR_COPYING) dtr__cond_wait_until(&w->r[q->owner].cv, &w->mu, -1);
    if (q->state == DTR__LR_POSTED) {
        if (q->is_send) dtr__lq_remove(&w->r[q->peer].sends, q);
        else dtr__lq_remove(&w->r[q->owner].recvs, q);
    } else if (q->state == DTR__LR_MATCHED) {
        dtr__lreq *m = q->match, *rv = q->is_send ? m : q;
        char why[64];
        dtr__lq_remove(&w->r[rv->owner].copies, rv);
        snprintf(why, sizeof why, "rank %d cancelled the transfer", q->owner);
        if (m) { m->match = NULL; dtr__lreq_finish(w, m, DTR_PEER_FAILED, q->owner, why); }
    }
    dtr__lreq_put(w, q);
    pthread_mutex_unlock(&w->mu);
}

static void dtr__local_close(void *state) {
    dtr__lep *ep = (dtr__lep *)state;
    dtr_local_world *w = ep->w;
    dtr__lrank *me = &w->r[ep->rank];
    int i;
    pthread_mutex_lock(&w->mu);
    me->closed = 1;
    /* fail every request of other ranks that waits on this one */
    for (i = 0; i < w->size; i++) {
        dtr__lreq *q;
        pthread_cond_broadcast(&w->r[i].cv);
        for (q = w->r[i].live; q; q = q->lnext)
            if (q->peer == ep->rank) dtr__local_check(w, q);
    }
    pthread_mutex_unlock(&w->mu);
    /* cancel what this rank still holds (release waits for copies in flight) */
    for (;;) {
        dtr__lreq *q;
        pthread_mutex_lock(&w->mu);
        q = me->live;
        pthread_mutex_unlock(&w->mu);
        if (!q) break;
        dtr__local_release(state, q);
    }
    dtr__free(&w->alloc, ep);
    dtr__local_world_unref(w);
}

static void dtr__local_abort(void *state, int failed_rank, const char *why) {
    dtr__lep *ep = (dtr__lep *)state;
    dtr_local_world *w = ep->w;
    int i;
    pthread_mutex_lock(&w->mu);
    if (w->failed_rank < 0) {
        w->failed_rank = failed_rank >= 0 && failed_rank < w->size ? failed_rank : ep->rank;
        snprintf(w->why, sizeof(w->why), "%s", why ? why : "the group was aborted");
    }
    for (i = 0; i < w->size; i++) pthread_cond_broadcast(&w->r[i].cv);
    pthread_mutex_unlock(&w->mu);
}

/* a rank that closed its endpoint is gone (its requests fail, per peer) while the world goes
   on; after an abort every request fails for the world's reason: 1 */
static int dtr__local_peer_alive(void *state, int rank) {
    dtr_local_world *w = ((dtr__lep *)state)->w;
    int alive;
    if (rank < 0 || rank >= w->size) return 0;
    pthread_mutex_lock(&w->mu);
    alive = !w->r[rank].closed || w->failed_rank >= 0;
    pthread_mutex_unlock(&w->mu);
    return alive;
}

static const dtr_transport_vtable dtr__local_vtable = {
    DTR_VERSION_NUMBER, "local",
    dtr__local_open, dtr__local_close,
    dtr__local_isend, dtr__local_irecv, dtr__local_test, dtr__local_wait_any, dtr__local_release,
    dtr__local_abort,
    NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
    DTR_MEM_HOST,
    dtr__local_peer_alive,
    dtr__local_wait_some
};

const dtr_transport_vtable *dtr_local_transport(void) { return &dtr__local_vtable; }
