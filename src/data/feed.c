/* ============================================================================
 * Streaming dataset: a bounded ring buffer of samples for online training inside an app.
 *
 * Producers (any number of threads: a game loop, a sensor callback) copy samples in with
 * dtr_feed_push; one trainer thread takes batches out with dtr_feed_next. One mutex
 * guards the ring; two condition variables wake a waiting producer (room) or trainer
 * (samples). Waits have deadlines from the caller (0: never block), measured on the wall
 * clock that pthread_cond_timedwait uses. All memory (the ring and one batch buffer) is
 * allocated at creation: pushing and popping allocate nothing.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_data.h"
#include "../core/internal.h"
#include "data_internal.h"
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <pthread.h>
#include <sys/time.h>

struct dtr_feed {
    dtr_sample_layout layout;
    dtr_allocation_callbacks alloc;
    size_t x_bytes, y_bytes;
    int64_t x_numel, y_numel;
    int64_t cap, max_batch;
    int policy;                    /* dtr_feed_policy */
    int check;                     /* dtr_feed_check */
    unsigned char *rx, *ry;        /* the ring: cap samples */
    int64_t *rseq;                 /* push sequence number of each ring sample */
    int64_t head, size;            /* oldest sample, samples waiting */
    int64_t next_seq;
    unsigned char *bx, *by;        /* the batch handed out */
    int64_t *bseq;
    int64_t batches;
    int closed;
    dtr_feed_stats stats;
    pthread_mutex_t mu;
    pthread_cond_t room, data;
};

dtr_feed_config dtr_feed_config_init(void) {
    dtr_feed_config c;
    memset(&c, 0, sizeof c);
    c.capacity = 1024;
    c.max_batch = 256;
    return c;
}

dtr_result dtr_feed_create(const dtr_feed_config *cfg, dtr_feed **out, char *err, size_t errlen) {
    const dtr_allocation_callbacks *a;
    dtr_feed *s;
    dtr_result r;
    int64_t cap, mb;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_feed_create: out is NULL");
    *out = NULL;
    if (!cfg) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_feed_create: cfg is NULL");
    if ((r = dtr__layout_check(&cfg->layout, "stream", err, errlen)) != DTR_OK) return r;
    cap = cfg->capacity ? cfg->capacity : 1024;
    mb = cfg->max_batch ? cfg->max_batch : 256;
    if (cap < 1 || mb < 1 || cap > ((int64_t)1 << 40) || mb > ((int64_t)1 << 40))
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "stream: capacity and max_batch must be >= 1");
    if (mb > cap) mb = cap;
    a = &cfg->alloc;
    s = (dtr_feed *)dtr__calloc(a, sizeof *s);
    if (!s) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "stream: out of memory");
    s->alloc = cfg->alloc;
    a = &s->alloc;
    s->layout = cfg->layout;
    s->x_numel = dtr_sample_layout_x_numel(&s->layout);
    s->y_numel = dtr_sample_layout_y_numel(&s->layout);
    s->x_bytes = (size_t)s->x_numel * 4;
    s->y_bytes = (size_t)s->y_numel * 4;
    s->cap = cap;
    s->max_batch = mb;
    s->policy = cfg->drop_oldest ? DTR_FEED_DROP_OLDEST : (int)cfg->policy;
    s->check = (int)cfg->check;
    if (s->policy < DTR_FEED_BLOCK || s->policy > DTR_FEED_DROP_NEWEST || s->check < DTR_FEED_REJECT_PUSH ||
        s->check > DTR_FEED_NO_CHECK) {
        dtr__free(a, s);
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "stream: policy %d or check %d is not a known value",
                         (int)cfg->policy, (int)cfg->check);
    }
    if ((uint64_t)cap > (uint64_t)((size_t)-1 / 4) / (uint64_t)(s->x_bytes + s->y_bytes + 8)) {
        dtr__free(a, s);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "stream: a ring of %lld samples does not fit in memory", (long long)cap);
    }
    s->rx = (unsigned char *)dtr__malloc(a, (size_t)cap * s->x_bytes);
    s->ry = s->y_bytes ? (unsigned char *)dtr__malloc(a, (size_t)cap * s->y_bytes) : NULL;
    s->rseq = (int64_t *)dtr__malloc(a, (size_t)cap * sizeof(int64_t));
    s->bx = (unsigned char *)dtr__malloc(a, (size_t)mb * s->x_bytes);
    s->by = s->y_bytes ? (unsigned char *)dtr__malloc(a, (size_t)mb * s->y_bytes) : NULL;
    s->bseq = (int64_t *)dtr__malloc(a, (size_t)mb * sizeof(int64_t));
    if (!s->rx || (s->y_bytes && (!s->ry || !s->by)) || !s->rseq || !s->bx || !s->bseq) {
        dtr__free(a, s->rx); dtr__free(a, s->ry); dtr__free(a, s->rseq);
        dtr__free(a, s->bx); dtr__free(a, s->by); dtr__free(a, s->bseq);
        dtr__free(a, s);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "stream: out of memory for %lld samples", (long long)cap);
    }
    if (pthread_mutex_init(&s->mu, NULL) != 0 || pthread_cond_init(&s->room, NULL) != 0 ||
        pthread_cond_init(&s->data, NULL) != 0) {
        dtr__free(a, s->rx); dtr__free(a, s->ry); dtr__free(a, s->rseq);
        dtr__free(a, s->bx); dtr__free(a, s->by); dtr__free(a, s->bseq);
        dtr__free(a, s);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "stream: cannot create a mutex or condition");
    }
    *out = s;
    return DTR_OK;
}

void dtr_feed_destroy(dtr_feed *s) {
    dtr_allocation_callbacks a;
    if (!s) return;
    a = s->alloc;
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->room);
    pthread_cond_destroy(&s->data);
    dtr__free(&a, s->rx);
    dtr__free(&a, s->ry);
    dtr__free(&a, s->rseq);
    dtr__free(&a, s->bx);
    dtr__free(&a, s->by);
    dtr__free(&a, s->bseq);
    dtr__free(&a, s);
}

/* Absolute wall-clock deadline `ms` from now, for pthread_cond_timedwait. */
static struct timespec dtr__deadline(int ms) {
    struct timeval tv;
    struct timespec ts;
    long usec;
    gettimeofday(&tv, NULL);
    usec = (long)tv.tv_usec + (long)(ms % 1000) * 1000L;
    ts.tv_sec = tv.tv_sec + ms / 1000 + usec / 1000000L;
    ts.tv_nsec = (usec % 1000000L) * 1000L;
    return ts;
}

/* Waits on `cv` (forever when ms < 0). Returns 0 when the deadline passed. */
static int dtr__stream_wait(dtr_feed *s, pthread_cond_t *cv, int ms, const struct timespec *deadline) {
    if (ms < 0) {
        pthread_cond_wait(cv, &s->mu);
        return 1;
    }
    return pthread_cond_timedwait(cv, &s->mu, deadline) != ETIMEDOUT;
}

/* Writes why sample `i` of a push is bad into `msg` and returns 0, or returns 1 when it is
 * good: f32 values finite, i32 labels inside [0, num_classes) when num_classes is known. */
static int dtr__feed_sample_ok(const dtr_feed *s, const void *x, const void *y, int64_t i, char *msg, size_t len) {
    const dtr_sample_layout *l = &s->layout;
    int64_t k;
    if (l->x_dtype == DTR_F32) {
        const float *v = (const float *)x + i * s->x_numel;
        for (k = 0; k < s->x_numel; k++)
            if (!isfinite(v[k])) {
                snprintf(msg, len, "stream: sample %lld of the push: feature %lld is not finite", (long long)i, (long long)k);
                return 0;
            }
    }
    if (!s->y_bytes) return 1;
    for (k = 0; k < s->y_numel; k++) {
        if (l->y_dtype == DTR_F32) {
            float v = ((const float *)y)[i * s->y_numel + k];
            if (isfinite(v)) continue;
            snprintf(msg, len, "stream: sample %lld of the push: target %lld is not finite", (long long)i, (long long)k);
            return 0;
        } else {
            int32_t v = ((const int32_t *)y)[i * s->y_numel + k];
            if (l->num_classes <= 0 || (v >= 0 && v < l->num_classes)) continue;
            snprintf(msg, len, "stream: sample %lld of the push: label %d is outside 0..%d", (long long)i, (int)v,
                     l->num_classes - 1);
            return 0;
        }
    }
    return 1;
}

int64_t dtr__feed_validate(dtr_feed *s, const void *x, const void *y, int64_t n, char *msg, size_t len) {
    char buf[sizeof s->stats.last_bad];
    int64_t i;
    if (s->check == DTR_FEED_NO_CHECK) return -1;
    for (i = 0; i < n; i++)
        if (!dtr__feed_sample_ok(s, x, y, i, buf, sizeof buf)) {
            if (msg && len) snprintf(msg, len, "%s", buf);
            pthread_mutex_lock(&s->mu);
            s->stats.rejected_pushes++;
            memcpy(s->stats.last_bad, buf, sizeof buf);
            pthread_mutex_unlock(&s->mu);
            return i;
        }
    return -1;
}

/* DTR_FEED_REJECT_PUSH: the index of the first bad sample (its reason in s->stats), or -1. */
static int64_t dtr__feed_first_bad(dtr_feed *s, const void *x, const void *y, int64_t n) {
    return dtr__feed_validate(s, x, y, n, NULL, 0);
}

/* Copies sample i of the push to the ring's tail. Under the lock, with room. */
static void dtr__feed_put(dtr_feed *s, const void *x, const void *y, int64_t i) {
    int64_t at = (s->head + s->size) % s->cap;
    memcpy(s->rx + (size_t)at * s->x_bytes, (const unsigned char *)x + (size_t)i * s->x_bytes, s->x_bytes);
    if (s->y_bytes) memcpy(s->ry + (size_t)at * s->y_bytes, (const unsigned char *)y + (size_t)i * s->y_bytes, s->y_bytes);
    s->rseq[at] = s->next_seq++;
    s->size++;
    s->stats.pushed++;
}

/* The ring is full: makes room by the feed's policy, or waits. 1: go on; 0: stop with *r. */
static int dtr__feed_room(dtr_feed *s, int timeout_ms, const struct timespec *deadline, int64_t left, dtr_result *r) {
    if (s->policy == DTR_FEED_DROP_OLDEST) {
        s->head = (s->head + 1) % s->cap;
        s->size--;
        s->stats.dropped++;
        return 1;
    }
    if (s->policy == DTR_FEED_DROP_NEWEST) {
        s->stats.dropped_newest += left;
        return 0;
    }
    pthread_cond_signal(&s->data);
    if (timeout_ms == 0 || !dtr__stream_wait(s, &s->room, timeout_ms, deadline)) {
        if (s->size == s->cap) {   /* still full when the time ran out */
            *r = DTR_TIMEOUT;
            s->stats.timeouts++;
            return 0;
        }
    }
    return 1;
}

dtr_result dtr_feed_push(dtr_feed *s, const void *x, const void *y, int64_t n, int timeout_ms, int64_t *pushed) {
    struct timespec deadline;
    dtr_result r = DTR_OK;
    int64_t done = 0, i;
    if (pushed) *pushed = 0;
    if (!s || (n > 0 && (!x || (s->y_bytes && !y)))) return DTR_NULL_HANDLE;
    if (n < 0) return DTR_INVALID_ARGUMENT;
    if (s->check == DTR_FEED_REJECT_PUSH && dtr__feed_first_bad(s, x, y, n) >= 0) return DTR_INVALID_ARGUMENT;
    if (timeout_ms > 0) deadline = dtr__deadline(timeout_ms);
    else memset(&deadline, 0, sizeof deadline);
    pthread_mutex_lock(&s->mu);
    for (i = 0; i < n;) {
        if (s->closed) {
            r = DTR_BAD_STATE;
            break;
        }
        if (s->check == DTR_FEED_REJECT_SAMPLE &&
            !dtr__feed_sample_ok(s, x, y, i, s->stats.last_bad, sizeof s->stats.last_bad)) {
            s->stats.rejected++;
            i++;
            continue;
        }
        if (s->size == s->cap) {
            if (!dtr__feed_room(s, timeout_ms, &deadline, n - i, &r)) break;
            continue;
        }
        dtr__feed_put(s, x, y, i++);
        done++;
    }
    if (done) pthread_cond_signal(&s->data);
    pthread_mutex_unlock(&s->mu);
    if (pushed) *pushed = done;
    return r;
}

dtr_result dtr_feed_next(dtr_feed *s, int64_t max_size, int64_t min_size, int timeout_ms, dtr_batch *out) {
    struct timespec deadline;
    int64_t k, i;
    int d;
    if (out) memset(out, 0, sizeof *out);
    if (!s || !out) return DTR_NULL_HANDLE;
    if (max_size < 1) return DTR_INVALID_ARGUMENT;
    if (max_size > s->max_batch) max_size = s->max_batch;
    if (min_size < 1) min_size = 1;
    if (min_size > max_size) min_size = max_size;
    if (timeout_ms > 0) deadline = dtr__deadline(timeout_ms);
    else memset(&deadline, 0, sizeof deadline);
    pthread_mutex_lock(&s->mu);
    while (s->size < min_size && !s->closed) {
        if (timeout_ms == 0 || !dtr__stream_wait(s, &s->data, timeout_ms, &deadline)) {
            if (s->size < min_size && !s->closed) {
                pthread_mutex_unlock(&s->mu);
                return DTR_TIMEOUT;
            }
        }
    }
    if (s->size == 0) {   /* closed and drained */
        pthread_mutex_unlock(&s->mu);
        return DTR_BAD_STATE;
    }
    k = s->size < max_size ? s->size : max_size;
    for (i = 0; i < k; i++) {
        int64_t at = (s->head + i) % s->cap;
        memcpy(s->bx + (size_t)i * s->x_bytes, s->rx + (size_t)at * s->x_bytes, s->x_bytes);
        if (s->y_bytes) memcpy(s->by + (size_t)i * s->y_bytes, s->ry + (size_t)at * s->y_bytes, s->y_bytes);
        s->bseq[i] = s->rseq[at];
    }
    s->head = (s->head + k) % s->cap;
    s->size -= k;
    s->stats.popped += k;
    pthread_cond_broadcast(&s->room);
    out->position = s->batches++;
    pthread_mutex_unlock(&s->mu);
    out->size = k;
    out->x_dtype = s->layout.x_dtype;
    out->x_ndim = s->layout.x_ndim + 1;
    out->x_shape[0] = k;
    for (d = 0; d < s->layout.x_ndim; d++) out->x_shape[d + 1] = s->layout.x_shape[d];
    out->x = s->bx;
    if (!s->layout.unlabeled) {
        out->y_dtype = s->layout.y_dtype;
        out->y_ndim = s->layout.y_ndim + 1;
        out->y_shape[0] = k;
        for (d = 0; d < s->layout.y_ndim; d++) out->y_shape[d + 1] = s->layout.y_shape[d];
        out->y = s->by;
    }
    out->indices = s->bseq;
    return DTR_OK;
}

void dtr_feed_end(dtr_feed *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->closed = 1;
    pthread_cond_broadcast(&s->room);
    pthread_cond_broadcast(&s->data);
    pthread_mutex_unlock(&s->mu);
}

int64_t dtr__feed_size(dtr_feed *s) {
    int64_t n;
    pthread_mutex_lock(&s->mu);
    n = s->size;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void dtr_feed_get_stats(dtr_feed *s, dtr_feed_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    *out = s->stats;
    out->size = s->size;
    pthread_mutex_unlock(&s->mu);
}
