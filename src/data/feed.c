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
#include <pthread.h>
#include <sys/time.h>

struct dtr_feed {
    dtr_sample_layout layout;
    dtr_allocation_callbacks alloc;
    size_t x_bytes, y_bytes;
    int64_t x_numel, y_numel;
    int64_t cap, max_batch;
    int drop_oldest;
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
    s->drop_oldest = cfg->drop_oldest ? 1 : 0;
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

dtr_result dtr_feed_push(dtr_feed *s, const void *x, const void *y, int64_t n, int timeout_ms, int64_t *pushed) {
    struct timespec deadline;
    dtr_result r = DTR_OK;
    int64_t done = 0;
    if (pushed) *pushed = 0;
    if (!s || (n > 0 && (!x || (s->y_bytes && !y)))) return DTR_NULL_HANDLE;
    if (n < 0) return DTR_INVALID_ARGUMENT;
    if (timeout_ms > 0) deadline = dtr__deadline(timeout_ms);
    else memset(&deadline, 0, sizeof deadline);
    pthread_mutex_lock(&s->mu);
    while (done < n) {
        int64_t room, k, i;
        if (s->closed) {
            r = DTR_BAD_STATE;
            break;
        }
        room = s->cap - s->size;
        if (room == 0) {
            if (s->drop_oldest) {
                k = n - done < s->cap ? n - done : s->cap;
                s->head = (s->head + k) % s->cap;
                s->size -= k;
                s->stats.dropped += k;
                continue;
            }
            if (timeout_ms == 0 || !dtr__stream_wait(s, &s->room, timeout_ms, &deadline)) {
                if (s->size == s->cap) {   /* still full when the time ran out */
                    r = DTR_TIMEOUT;
                    s->stats.timeouts++;
                    break;
                }
            }
            continue;
        }
        k = n - done < room ? n - done : room;
        for (i = 0; i < k; i++) {
            int64_t at = (s->head + s->size + i) % s->cap;
            memcpy(s->rx + (size_t)at * s->x_bytes, (const unsigned char *)x + (size_t)(done + i) * s->x_bytes, s->x_bytes);
            if (s->y_bytes)
                memcpy(s->ry + (size_t)at * s->y_bytes, (const unsigned char *)y + (size_t)(done + i) * s->y_bytes, s->y_bytes);
            s->rseq[at] = s->next_seq++;
        }
        s->size += k;
        done += k;
        s->stats.pushed += k;
        pthread_cond_signal(&s->data);
    }
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

void dtr_feed_get_stats(dtr_feed *s, dtr_feed_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    *out = s->stats;
    out->size = s->size;
    pthread_mutex_unlock(&s->mu);
}
