/* ============================================================================
 * The loader: batches over any dataset, with per-epoch seeded shuffles, sharding by rank
 * (dtr_sampler), background prefetch threads, augmentation, a cache of decoded samples,
 * skipping of bad samples, and a cursor that a checkpoint can save and restore.
 *
 * Batches form one endless sequence: batch number s is batch (s % B) of epoch (s / B),
 * with B = dtr_loader_batches(). The contents of batch s depend only on s, the dataset and
 * the configuration: its indices come from dtr_sampler_epoch(epoch), and the random choices
 * of augmentation from a PCG32 stream seeded by (seed, epoch) and the sample's global
 * position in the epoch. So any number of threads, any timing and a restored cursor all
 * give the same batches.
 *
 * Prefetch: `depth` slots, batch s lives in slot s % depth. A worker claims the next
 * unclaimed batch when it is less than `depth` batches ahead of `head` (the batch the app
 * holds or waits for), fills the slot outside the lock, and marks it ready. The app's
 * dtr_loader_next releases the batch it held, then waits until slot head % depth holds
 * batch head. At most ceil(depth / B) + 1 epochs are in flight, so a ring of that many
 * per-epoch index lists suffices. Destroy sets `stop` (checked between samples) and joins.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_data.h"
#include "../core/internal.h"
#include "data_internal.h"
#include "../obs/obs_internal.h"
#include <pthread.h>

#if defined(__GNUC__) || defined(__clang__)
#else
#define DTR__ATOMIC_LOAD(p) (*(volatile int *)(p))
#define DTR__ATOMIC_STORE(p, v) (*(volatile int *)(p) = (v))
#endif

/* Replacement attempts of skip_bad before giving up on a batch. */
#define DTR__SKIP_TRIES 64

typedef struct dtr__slot {
    int64_t seq;              /* batch number it holds */
    int ready;
    dtr_result result;
    char msg[512];
    void *x, *y;              /* batch_size samples (cfg.device: its backend's host memory) */
    dtr_event *uploaded;      /* dtr_loader_tensors' copies to cfg.device (NULL: none pending) */
    int64_t *indices;
    int64_t size;
    int64_t skipped, cache_hits;
    char last_bad[256];
} dtr__slot;

typedef struct dtr__worker {
    dtr_loader *l;
    pthread_t th;
    int started;
    float *tmp;               /* one decoded sample before crop/flip */
    char err[512];
} dtr__worker;

struct dtr_loader {
    dtr_dataset *ds;
    struct dtr_metrics *obs;  /* marks the waits of dtr_loader_next (dtr_metrics_watch_loader) */
    dtr_loader_cursor state_cursor;   /* dtr_loader_state's "cursor" entry */
    dtr_loader_config cfg;
    dtr_allocation_callbacks alloc;
    float *mean, *std;        /* normalisation (owned copies) */
    int crop, flip;
    int64_t C, H, W;          /* crop/flip geometry: leading dims, then H, W */
    dtr_sampler sampler;
    int64_t per_rank, batches, B;
    int64_t x_numel, y_numel;
    size_t x_bytes, y_bytes;
    uint64_t seed;
    /* per-epoch index lists: a ring of n_ep, enough for every epoch in flight */
    int n_ep;
    int64_t *ep_epoch;
    int64_t **ep_idx;
    int64_t *perm;
    /* prefetch queue */
    int depth, nthreads;
    dtr__slot *slots;
    dtr__worker *workers;     /* nthreads (or 1 for the synchronous path) */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_ready;
    int sync_ok;              /* mutex and conditions initialised */
    int64_t head, next_claim;
    int held, busy, stop, paused;
    /* cache of decoded samples 0 .. cache_cap-1 */
    unsigned char *cache;
    unsigned char *cache_state;   /* 0 empty, 1 being filled, 2 ready */
    int64_t cache_cap;
    size_t cache_stride;
    pthread_mutex_t cache_mu;
    pthread_cond_t cache_cv;      /* a fill published */
    int cache_mu_ok;
    dtr_loader_stats stats;
    char msg[512];
};

dtr_loader_config dtr_loader_config_init(void) {
    dtr_loader_config c;
    memset(&c, 0, sizeof c);
    c.batch_size = 32;
    c.world = 1;
    return c;
}

/* splitmix64 finaliser */
static uint64_t dtr__mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The index list of `epoch` (computed once per epoch, under the lock). NULL on OOM. */
static const int64_t *dtr__epoch_indices(dtr_loader *l, int64_t epoch) {
    int k = (int)(epoch % l->n_ep);
    const int64_t *p = NULL;
    pthread_mutex_lock(&l->mu);
    if (l->ep_epoch[k] != epoch) {
        if (dtr_sampler_epoch(&l->sampler, epoch, l->ep_idx[k], l->perm, &l->alloc) == DTR_OK) l->ep_epoch[k] = epoch;
        else l->ep_epoch[k] = -1;
    }
    if (l->ep_epoch[k] == epoch) p = l->ep_idx[k];
    pthread_mutex_unlock(&l->mu);
    return p;
}

/* ---- one sample ---- */

/* entry i's state to `state` (under the cache mutex; atomic where claim reads it without) */
static void dtr__cache_set(dtr_loader *l, int64_t i, int state) {
#if defined(__GNUC__) || defined(__clang__)
    DTR__ATOMIC_STORE(&l->cache_state[i], (unsigned char)state);
#else
    l->cache_state[i] = (unsigned char)state;
#endif
}

/* Cache entry states: 0 empty, 1 being filled by one thread, 2 ready (immutable). claim
 * returns the state of entry i once no thread fills it (a fill in flight is waited for, so a
 * sample asked for twice at once is read from the dataset once) and turns 0 into 1 for the
 * caller; publish sets 2 (or back 0 after a failure: a waiter then tries itself) and wakes the
 * waiters. A thread waits only while it fills nothing, so waits never form a cycle. States
 * change under the cache mutex; a ready entry is seen without it where atomics exist. */
static int dtr__cache_claim(dtr_loader *l, int64_t i) {
    int state;
#if defined(__GNUC__) || defined(__clang__)
    if (DTR__ATOMIC_LOAD(&l->cache_state[i]) == 2) return 2;
#endif
    pthread_mutex_lock(&l->cache_mu);
    while ((state = l->cache_state[i]) == 1) pthread_cond_wait(&l->cache_cv, &l->cache_mu);
    if (state == 0) dtr__cache_set(l, i, 1);
    pthread_mutex_unlock(&l->cache_mu);
    return state;
}

static void dtr__cache_publish(dtr_loader *l, int64_t i, int state) {
    pthread_mutex_lock(&l->cache_mu);
    dtr__cache_set(l, i, state);
    pthread_cond_broadcast(&l->cache_cv);
    pthread_mutex_unlock(&l->cache_mu);
}

/* Reads dataset sample i into x/y through the cache. *src receives the sample's features:
 * x, or (when `borrow` and the cache has it) the cache entry itself, saving a copy for a
 * caller that only reads them. Returns the dataset's result. */
static dtr_result dtr__load_sample(dtr_loader *l, dtr__worker *w, int64_t i, float *x, void *y, int borrow, int *hit,
                                   const float **src) {
    dtr_dataset *ds = l->ds;
    dtr_result r;
    int state = 0;
    *hit = 0;
    *src = x;
    if (i < l->cache_cap) {
        state = dtr__cache_claim(l, i);
        if (state == 2) {   /* ready entries never change again */
            const unsigned char *e = l->cache + (size_t)i * l->cache_stride;
            if (borrow) *src = (const float *)e;
            else memcpy(x, e, l->x_bytes);
            if (y) memcpy(y, e + l->x_bytes, l->y_bytes);
            *hit = 1;
            return DTR_OK;
        }
    }
    w->err[0] = '\0';
    r = ds->get(ds, i, x, ds->layout.unlabeled ? NULL : y, w->err, sizeof w->err);
    if (i < l->cache_cap && state == 0) {
        if (r == DTR_OK) {
            unsigned char *e = l->cache + (size_t)i * l->cache_stride;
            memcpy(e, x, l->x_bytes);
            if (y) memcpy(e + l->x_bytes, y, l->y_bytes);
        }
        dtr__cache_publish(l, i, r == DTR_OK ? 2 : 0);
    }
    if (r != DTR_OK && !w->err[0])
        snprintf(w->err, sizeof w->err, "%s: sample %lld: %s", ds->name, (long long)i, dtr_result_string(r));
    return r;
}

/* Random crop (with zero padding) and horizontal flip of src into dst (when enabled; src
 * may then be read-only), then normalisation of dst in place. Output pixel (y, x) of the
 * crop is input (y + oy - P, x + ox - P), zero outside the input; the flip mirrors the
 * cropped window: output x reads cropped column W - 1 - x. */
static void dtr__augment(const dtr_loader *l, const float *src, float *dst, dtr_rng *rng) {
    int64_t c, y, x, P = l->crop, H = l->H, W = l->W, n, k;
    if (l->crop || l->flip) {
        int64_t oy = P, ox = P, dx, x0, x1;
        int flip = 0;
        if (l->crop) {
            oy = (int64_t)(dtr_rng_u32(rng) % (uint32_t)(2 * P + 1));
            ox = (int64_t)(dtr_rng_u32(rng) % (uint32_t)(2 * P + 1));
        }
        if (l->flip) flip = (int)(dtr_rng_u32(rng) >> 31);
        dx = ox - P;   /* source column = (flip ? W - 1 - x : x) + dx */
        x0 = flip ? (dx > 0 ? dx : 0) : (-dx > 0 ? -dx : 0);            /* outputs with a source column */
        x1 = flip ? (W + dx < W ? W + dx : W) : (W - dx < W ? W - dx : W);
        if (x0 > W) x0 = W;   /* padding wider than the image: whole rows of zeros */
        if (x1 < x0) x1 = x0;
        for (c = 0; c < l->C; c++) {
            const float *s = src + c * H * W;
            float *d = dst + c * H * W;
            for (y = 0; y < H; y++) {
                int64_t sy = y + oy - P;
                float *drow = d + y * W;
                const float *srow;
                if (sy < 0 || sy >= H) {
                    memset(drow, 0, (size_t)W * sizeof(float));
                    continue;
                }
                srow = s + sy * W;
                for (x = 0; x < x0; x++) drow[x] = 0.0f;
                if (flip) {
                    for (x = x0; x < x1; x++) drow[x] = srow[W - 1 + dx - x];
                } else {
                    memcpy(drow + x0, srow + x0 + dx, (size_t)(x1 - x0) * sizeof(float));
                }
                for (x = x1; x < W; x++) drow[x] = 0.0f;
            }
        }
    }
    n = l->cfg.augment.norm_count;
    if (n > 0) {
        int64_t per = l->x_numel / n, j;   /* elements sharing one mean/std */
        for (j = 0; j < n; j++) {
            float m = l->mean[j], sd = l->std[j], *d = dst + j * per;
            for (k = 0; k < per; k++) d[k] = (d[k] - m) / sd;
        }
    }
}

/* ---- one batch ---- */

/* Fills `slot` with batch `seq` using worker w's scratch. */
static void dtr__fill(dtr_loader *l, dtr__worker *w, int64_t seq, dtr__slot *slot) {
    int64_t epoch = seq / l->batches, pos = seq % l->batches, start = pos * l->B, n, j;
    const int64_t *idx;
    uint64_t eseed = dtr__mix64(l->seed ^ dtr__mix64((uint64_t)epoch * 0xD1B54A32D192ED03ull + 1));
    int copy = l->crop || l->flip;
    slot->result = DTR_OK;
    slot->msg[0] = '\0';
    slot->skipped = 0;
    slot->cache_hits = 0;
    slot->last_bad[0] = '\0';
    n = l->per_rank - start < l->B ? l->per_rank - start : l->B;
    slot->size = n;
    idx = dtr__epoch_indices(l, epoch);
    if (!idx) {
        slot->result = DTR_OUT_OF_MEMORY;
        snprintf(slot->msg, sizeof slot->msg, "loader: out of memory for the indices of epoch %lld", (long long)epoch);
        return;
    }
    for (j = 0; j < n; j++) {
        int64_t k = start + j, i = idx[k], t;
        float *xd = (float *)((unsigned char *)slot->x + (size_t)j * l->x_bytes);
        void *yd = slot->y ? (unsigned char *)slot->y + (size_t)j * l->y_bytes : NULL;
        float *xs = copy ? w->tmp : xd;
        const float *src = xs;
        dtr_result r = DTR_OK;
        int hit = 0;
        if (DTR__ATOMIC_LOAD(&l->stop)) {
            slot->result = DTR_BAD_STATE;
            return;
        }
        for (t = 0; t < DTR__SKIP_TRIES; t++) {
            int64_t ii = (i + t) % l->ds->count;
            r = dtr__load_sample(l, w, ii, xs, yd, copy, &hit, &src);
            if (r == DTR_OK) {
                i = ii;
                break;
            }
            if (!l->cfg.skip_bad) {
                slot->result = r;
                snprintf(slot->msg, sizeof slot->msg, "batch %lld of epoch %lld: %.440s", (long long)pos, (long long)epoch,
                         w->err);
                return;
            }
            slot->skipped++;
            snprintf(slot->last_bad, sizeof slot->last_bad, "%.255s", w->err);
        }
        if (r != DTR_OK) {
            slot->result = r;
            snprintf(slot->msg, sizeof slot->msg, "batch %lld of epoch %lld: skip_bad: %d samples in a row from %lld failed; last: %.380s",
                     (long long)pos, (long long)epoch, DTR__SKIP_TRIES, (long long)idx[k], w->err);
            return;
        }
        slot->cache_hits += hit;
        slot->indices[j] = i;
        if (copy || l->cfg.augment.norm_count > 0) {
            dtr_rng rng;
            dtr_rng_seed(&rng, eseed, (uint64_t)(k * l->sampler.world + l->sampler.rank));
            dtr__augment(l, src, xd, &rng);
        }
    }
}

/* ---- threads ---- */

static void *dtr__loader_thread(void *arg) {
    dtr__worker *w = (dtr__worker *)arg;
    dtr_loader *l = w->l;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        int64_t seq;
        dtr__slot *slot;
        if (l->stop) break;
        if (l->paused || l->next_claim >= l->head + l->depth) {
            pthread_cond_wait(&l->cv_work, &l->mu);
            continue;
        }
        seq = l->next_claim++;
        slot = &l->slots[seq % l->depth];
        l->busy++;
        pthread_mutex_unlock(&l->mu);
        dtr__fill(l, w, seq, slot);
        pthread_mutex_lock(&l->mu);
        l->busy--;
        slot->seq = seq;
        slot->ready = 1;
        pthread_cond_broadcast(&l->cv_ready);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* Stops and joins the threads. */
static void dtr__loader_stop(dtr_loader *l) {
    int i;
    if (!l->sync_ok || !l->workers) return;
    pthread_mutex_lock(&l->mu);
    DTR__ATOMIC_STORE(&l->stop, 1);
    pthread_cond_broadcast(&l->cv_work);
    pthread_mutex_unlock(&l->mu);
    for (i = 0; i < l->nthreads; i++)
        if (l->workers[i].started) pthread_join(l->workers[i].th, NULL);
}

/* a batch buffer: the device context's staging memory (page-locked on CUDA), or the allocator's */
static void *dtr__loader_buf(dtr_loader *l, size_t bytes) {
    return l->cfg.device ? dtr__host_alloc(l->cfg.device, bytes) : dtr__malloc(&l->alloc, bytes);
}
static void dtr__loader_buf_free(dtr_loader *l, void *p) {
    if (p && l->cfg.device) dtr__host_free(l->cfg.device, p);
    else dtr__free(&l->alloc, p);
}

/* waits for the copies dtr_loader_tensors queued from the slot (before it is refilled or freed) */
static void dtr__loader_settle(dtr_loader *l, dtr__slot *s) {
    if (s->uploaded) (void)dtr_event_wait(l->cfg.device, s->uploaded);
    s->uploaded = NULL;
}

void dtr_loader_destroy(dtr_loader *l) {
    dtr_allocation_callbacks a;
    int i;
    if (!l) return;
    a = l->alloc;
    dtr__loader_stop(l);
    if (l->sync_ok) {
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->cv_work);
        pthread_cond_destroy(&l->cv_ready);
    }
    if (l->cache_mu_ok) pthread_mutex_destroy(&l->cache_mu), pthread_cond_destroy(&l->cache_cv);
    if (l->slots) {
        for (i = 0; i < l->depth; i++) {
            dtr__loader_settle(l, &l->slots[i]);
            dtr__loader_buf_free(l, l->slots[i].x);
            dtr__loader_buf_free(l, l->slots[i].y);
            dtr__free(&a, l->slots[i].indices);
        }
        dtr__free(&a, l->slots);
    }
    if (l->workers) {
        for (i = 0; i < (l->nthreads ? l->nthreads : 1); i++) dtr__free(&a, l->workers[i].tmp);
        dtr__free(&a, l->workers);
    }
    if (l->ep_idx) {
        for (i = 0; i < l->n_ep; i++) dtr__free(&a, l->ep_idx[i]);
        dtr__free(&a, l->ep_idx);
    }
    dtr__free(&a, l->ep_epoch);
    dtr__free(&a, l->perm);
    dtr__free(&a, l->cache);
    dtr__free(&a, l->cache_state);
    dtr__free(&a, l->mean);
    dtr__free(&a, l->std);
    dtr__free(&a, l);
}

/* ---- creation ---- */

/* Checks the augmentation against the samples and copies mean/std. */
static dtr_result dtr__loader_augment_init(dtr_loader *l, char *err, size_t errlen) {
    const dtr_augment_config *au = &l->cfg.augment;
    const dtr_sample_layout *L = &l->ds->layout;
    int64_t n = au->norm_count, k;
    int any = au->crop_padding != 0 || au->hflip != 0 || n != 0;
    if (!any) return DTR_OK;
    if (L->x_dtype != DTR_F32)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: augmentation needs f32 samples; %s has %s", l->ds->name,
                         dtr_dtype_name(L->x_dtype));
    if (au->crop_padding < 0 || n < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: crop_padding and norm_count must be >= 0");
    if (au->crop_padding || au->hflip) {
        if (L->x_ndim < 2)
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: crop and flip need samples of (..., H, W); %s has %d-D samples",
                             l->ds->name, L->x_ndim);
        l->H = L->x_shape[L->x_ndim - 2];
        l->W = L->x_shape[L->x_ndim - 1];
        l->C = l->x_numel / (l->H * l->W);
        l->crop = au->crop_padding;
        l->flip = au->hflip ? 1 : 0;
        if (l->crop > (1 << 20))
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: crop_padding %d is too large", l->crop);
    }
    if (n) {
        if (n != 1 && n != L->x_shape[0] && n != l->x_numel)
            return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                             "loader: norm_count %lld must be 1, the channels (%lld) or the sample's elements (%lld)",
                             (long long)n, (long long)L->x_shape[0], (long long)l->x_numel);
        if (!au->mean || !au->std) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "loader: norm_count > 0 but mean or std is NULL");
        l->mean = (float *)dtr__malloc(&l->alloc, (size_t)n * sizeof(float));
        l->std = (float *)dtr__malloc(&l->alloc, (size_t)n * sizeof(float));
        if (!l->mean || !l->std) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory");
        for (k = 0; k < n; k++) {
            if (!(au->std[k] != 0.0f) || au->std[k] != au->std[k])
                return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: std[%lld] is %g", (long long)k, (double)au->std[k]);
            l->mean[k] = au->mean[k];
            l->std[k] = au->std[k];
        }
    }
    l->cfg.augment.mean = l->mean;
    l->cfg.augment.std = l->std;
    return DTR_OK;
}

/* the sampler, and the batches per epoch it leaves each rank */
static dtr_result dtr__loader_sampling(dtr_loader *l, char *err, size_t errlen) {
    const dtr_loader_config *c = &l->cfg;
    dtr_result r = dtr_sampler_init(&l->sampler, l->ds->count, c->rank, c->world, c->seed, c->shuffle, c->shard_drop_tail);
    if (r != DTR_OK)
        return dtr__errf(err, errlen, r, "loader: rank %d / world %d do not fit a dataset of %lld samples", c->rank, c->world,
                         (long long)l->ds->count);
    l->per_rank = dtr_sampler_count(&l->sampler);
    l->batches = c->drop_last ? l->per_rank / l->B : (l->per_rank + l->B - 1) / l->B;
    if (l->batches < 1)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: %s: %lld samples per rank make no %sbatch of %lld",
                         l->ds->name, (long long)l->per_rank, c->drop_last ? "complete " : "", (long long)l->B);
    return DTR_OK;
}

/* the queue's depth, and the index arrays of the epochs that can be in flight at once
   (batches head .. head + depth - 1) */
static dtr_result dtr__loader_epochs(dtr_loader *l, char *err, size_t errlen) {
    const dtr_loader_config *c = &l->cfg;
    const dtr_allocation_callbacks *a = &l->alloc;
    int i;
    l->depth = c->threads == 0 ? 1 : (c->prefetch ? c->prefetch : (2 * c->threads > 2 ? 2 * c->threads : 2));
    l->n_ep = (int)((l->depth + l->batches - 1) / l->batches) + 1;
    l->ep_epoch = (int64_t *)dtr__malloc(a, (size_t)l->n_ep * sizeof(int64_t));
    l->ep_idx = (int64_t **)dtr__calloc(a, (size_t)l->n_ep * sizeof(int64_t *));
    l->perm = (int64_t *)dtr__malloc(a, (size_t)l->ds->count * sizeof(int64_t));
    for (i = 0; l->ep_epoch && l->ep_idx && i < l->n_ep; i++) {
        l->ep_epoch[i] = -1;
        if (!(l->ep_idx[i] = (int64_t *)dtr__malloc(a, (size_t)l->per_rank * sizeof(int64_t)))) break;
    }
    if (!l->ep_epoch || !l->ep_idx || !l->perm || i < l->n_ep)
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory for %lld indices", (long long)l->ds->count);
    return DTR_OK;
}

/* the cache (only for datasets whose get() does real work) and its lock and condition */
static dtr_result dtr__loader_cache_init(dtr_loader *l, char *err, size_t errlen) {
    size_t stride = l->x_bytes + l->y_bytes;
    int64_t cap = l->cfg.cache_bytes > 0 && !l->ds->in_memory ? (int64_t)(l->cfg.cache_bytes / stride) : 0;
    if (cap > l->ds->count) cap = l->ds->count;
    if (cap > 0) {
        l->cache = (unsigned char *)dtr__malloc(&l->alloc, (size_t)cap * stride);
        l->cache_state = (unsigned char *)dtr__calloc(&l->alloc, (size_t)cap);
        if (!l->cache || !l->cache_state)
            return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory for a cache of %lld samples", (long long)cap);
        l->cache_cap = cap;
        l->cache_stride = stride;
    }
    if (pthread_mutex_init(&l->cache_mu, NULL) != 0) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: cannot create a mutex");
    if (pthread_cond_init(&l->cache_cv, NULL) != 0) {
        pthread_mutex_destroy(&l->cache_mu);
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: cannot create a condition");
    }
    l->cache_mu_ok = 1;
    if (pthread_mutex_init(&l->mu, NULL) != 0 || pthread_cond_init(&l->cv_work, NULL) != 0 || pthread_cond_init(&l->cv_ready, NULL) != 0)
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: cannot create a mutex or condition");   /* (a partly created set is not destroyed: acceptable on this path) */
    l->sync_ok = 1;
    return DTR_OK;
}

/* the queue's slots (a batch's buffers each) and the workers' (one without threads) */
static dtr_result dtr__loader_slots(dtr_loader *l, char *err, size_t errlen) {
    const dtr_allocation_callbacks *a = &l->alloc;
    int i, nw = l->nthreads ? l->nthreads : 1;
    l->slots = (dtr__slot *)dtr__calloc(a, (size_t)l->depth * sizeof(dtr__slot));
    l->workers = (dtr__worker *)dtr__calloc(a, (size_t)nw * sizeof(dtr__worker));
    if (!l->slots || !l->workers) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory");
    for (i = 0; i < l->depth; i++) {
        dtr__slot *s = &l->slots[i];
        s->seq = -1;
        s->x = dtr__loader_buf(l, (size_t)l->B * l->x_bytes);
        s->y = l->y_bytes ? dtr__loader_buf(l, (size_t)l->B * l->y_bytes) : NULL;
        s->indices = (int64_t *)dtr__malloc(a, (size_t)l->B * sizeof(int64_t));
        if (!s->x || (l->y_bytes && !s->y) || !s->indices)
            return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory for %d batches of %lld samples", l->depth,
                             (long long)l->B);
    }
    for (i = 0; i < nw; i++) {
        l->workers[i].l = l;
        if ((l->crop || l->flip) && !(l->workers[i].tmp = (float *)dtr__malloc(a, l->x_bytes)))
            return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory");
    }
    return DTR_OK;
}

/* the prefetch threads */
static dtr_result dtr__loader_start(dtr_loader *l, char *err, size_t errlen) {
    int i;
    for (i = 0; i < l->nthreads; i++) {
        if (pthread_create(&l->workers[i].th, NULL, dtr__loader_thread, &l->workers[i]) != 0)
            return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: cannot start prefetch thread %d of %d", i + 1, l->nthreads);
        l->workers[i].started = 1;
    }
    return DTR_OK;
}

dtr_result dtr_loader_create(dtr_dataset *ds, const dtr_loader_config *cfg, dtr_loader **out, char *err, size_t errlen) {
    dtr_loader_config c = cfg ? *cfg : dtr_loader_config_init();
    dtr_loader *l;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_loader_create: out is NULL");
    *out = NULL;
    if (!ds) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_loader_create: dataset is NULL");
    if (c.batch_size == 0) c.batch_size = 32;
    if (c.world == 0) c.world = 1;
    if (c.batch_size < 0 || c.threads < 0 || c.threads > 256 || c.prefetch < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "loader: batch_size, threads (0..256) and prefetch must be >= 0");
    if (!(l = (dtr_loader *)dtr__calloc(&c.alloc, sizeof *l))) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "loader: out of memory");
    l->alloc = c.alloc;
    l->cfg = c;
    l->ds = ds;
    l->seed = c.seed;
    l->B = c.batch_size;
    l->x_numel = ds->x_numel;
    l->y_numel = ds->y_numel;
    l->x_bytes = (size_t)ds->x_numel * 4;
    l->y_bytes = (size_t)ds->y_numel * 4;
    l->nthreads = c.threads;
    if ((r = dtr__loader_sampling(l, err, errlen)) != DTR_OK || (r = dtr__loader_augment_init(l, err, errlen)) != DTR_OK ||
        (r = dtr__loader_epochs(l, err, errlen)) != DTR_OK || (r = dtr__loader_cache_init(l, err, errlen)) != DTR_OK ||
        (r = dtr__loader_slots(l, err, errlen)) != DTR_OK || (r = dtr__loader_start(l, err, errlen)) != DTR_OK) {
        dtr_loader_destroy(l);
        return r;
    }
    *out = l;
    return DTR_OK;
}

int64_t dtr_loader_batches(const dtr_loader *l) { return l ? l->batches : 0; }

const char *dtr_loader_last_error(const dtr_loader *l) { return l ? l->msg : ""; }

/* ---- handing out batches ---- */

void dtr__loader_set_obs(dtr_loader *l, struct dtr_metrics *m) { l->obs = m; }

dtr_result dtr_loader_next(dtr_loader *l, dtr_batch *out) {
    dtr__slot *slot;
    const dtr_sample_layout *L;
    double t0, o0 = 0.0;
    int d;
    if (!l || !out) return DTR_NULL_HANDLE;
    memset(out, 0, sizeof *out);
    t0 = dtr__wall_seconds();
    if (l->obs) o0 = dtr__obs_now();
    if (l->nthreads == 0) {
        if (l->held) l->head++;
        slot = &l->slots[0];
        dtr__loader_settle(l, slot);
        dtr__fill(l, &l->workers[0], l->head, slot);
        slot->seq = l->head;
        l->held = 1;
    } else {
        if (l->held) dtr__loader_settle(l, &l->slots[l->head % l->depth]);
        pthread_mutex_lock(&l->mu);
        if (l->held) {
            l->slots[l->head % l->depth].ready = 0;
            l->head++;
            l->held = 0;
            pthread_cond_broadcast(&l->cv_work);
        }
        slot = &l->slots[l->head % l->depth];
        while (!(slot->ready && slot->seq == l->head)) pthread_cond_wait(&l->cv_ready, &l->mu);
        l->held = 1;
        pthread_mutex_unlock(&l->mu);
    }
    {
        double dt = dtr__wall_seconds() - t0;
        if (dt > 0) l->stats.wait_s += dt;
        if (l->obs) {
            dtr__obs_enter(l->obs, DTR_PHASE_DATA, o0);
            dtr__obs_leave(l->obs, DTR_PHASE_DATA, dtr__obs_now());
        }
    }
    out->epoch = slot->seq / l->batches;
    out->position = slot->seq % l->batches;
    out->last = out->position == l->batches - 1;
    l->stats.skipped += slot->skipped;
    l->stats.cache_hits += slot->cache_hits;
    if (slot->last_bad[0]) snprintf(l->stats.last_bad, sizeof l->stats.last_bad, "%s", slot->last_bad);
    if (slot->result != DTR_OK) {
        snprintf(l->msg, sizeof l->msg, "%s", slot->msg[0] ? slot->msg : dtr_result_string(slot->result));
        return slot->result;
    }
    L = &l->ds->layout;
    out->size = slot->size;
    out->x_dtype = L->x_dtype;
    out->x_shape[0] = slot->size;
    if (l->cfg.flatten) {
        out->x_ndim = 2;
        out->x_shape[1] = l->x_numel;
    } else {
        out->x_ndim = L->x_ndim + 1;
        for (d = 0; d < L->x_ndim; d++) out->x_shape[d + 1] = L->x_shape[d];
    }
    out->x = slot->x;
    if (!L->unlabeled) {
        out->y_dtype = L->y_dtype;
        out->y_ndim = L->y_ndim + 1;
        out->y_shape[0] = slot->size;
        for (d = 0; d < L->y_ndim; d++) out->y_shape[d + 1] = L->y_shape[d];
        out->y = slot->y;
    }
    out->indices = slot->indices;
    l->stats.batches++;
    l->stats.samples += slot->size;
    return DTR_OK;
}

void dtr_loader_get_stats(const dtr_loader *l, dtr_loader_stats *out) {
    if (!out) return;
    if (!l) {
        memset(out, 0, sizeof *out);
        return;
    }
    *out = l->stats;
}

/* ---- the cursor ---- */

void dtr_loader_get_cursor(const dtr_loader *l, dtr_loader_cursor *out) {
    int64_t seq;
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!l) return;
    seq = l->head + (l->held ? 1 : 0);
    out->magic = DTR_LOADER_CURSOR_MAGIC;
    out->version = 1;
    out->seed = l->seed;
    out->epoch = seq / l->batches;
    out->position = seq % l->batches;
    out->count = l->ds->count;
    out->batch_size = l->B;
    out->rank = l->sampler.rank;
    out->world = l->sampler.world;
    out->shuffle = l->sampler.shuffle;
}

dtr_result dtr_loader_set_cursor(dtr_loader *l, const dtr_loader_cursor *c) {
    int64_t seq;
    int i;
    if (!l || !c) return DTR_NULL_HANDLE;
    l->msg[0] = '\0';
    if (c->magic != DTR_LOADER_CURSOR_MAGIC || c->version != 1)
        return dtr__errf(l->msg, sizeof l->msg, DTR_INVALID_ARGUMENT, "loader cursor: bad magic or version (%08x, %u)",
                         (unsigned)c->magic, (unsigned)c->version);
    if (c->count != l->ds->count)
        return dtr__errf(l->msg, sizeof l->msg, DTR_INVALID_ARGUMENT,
                         "loader cursor: made for a dataset of %lld samples, this one has %lld", (long long)c->count,
                         (long long)l->ds->count);
    if (c->epoch < 0 || c->position < 0 || c->position >= l->batches)
        return dtr__errf(l->msg, sizeof l->msg, DTR_INVALID_ARGUMENT, "loader cursor: epoch %lld position %lld is outside 0..%lld",
                         (long long)c->epoch, (long long)c->position, (long long)l->batches - 1);
    if (c->position > 0 && (c->batch_size != l->B || c->world != l->sampler.world || (c->shuffle != 0) != (l->sampler.shuffle != 0)))
        return dtr__errf(l->msg, sizeof l->msg, DTR_INVALID_ARGUMENT,
                         "loader cursor: in the middle of an epoch the batch size (%lld, here %lld), world size (%d, here %d) "
                         "and shuffle (%d, here %d) must match", (long long)c->batch_size, (long long)l->B, (int)c->world,
                         l->sampler.world, (int)c->shuffle, l->sampler.shuffle != 0);
    if (c->epoch > (INT64_MAX - c->position) / l->batches - 1)
        return dtr__errf(l->msg, sizeof l->msg, DTR_INVALID_ARGUMENT, "loader cursor: epoch %lld is too large", (long long)c->epoch);
    seq = c->epoch * l->batches + c->position;
    if (l->nthreads > 0) {   /* pause the workers and wait for batches being filled */
        pthread_mutex_lock(&l->mu);
        l->paused = 1;
        while (l->busy > 0) pthread_cond_wait(&l->cv_ready, &l->mu);
    }
    l->seed = c->seed;
    l->sampler.seed = c->seed;
    for (i = 0; i < l->n_ep; i++) l->ep_epoch[i] = -1;
    for (i = 0; i < l->depth; i++) {
        dtr__loader_settle(l, &l->slots[i]);
        l->slots[i].ready = 0;
        l->slots[i].seq = -1;
    }
    l->head = seq;
    l->next_claim = seq;
    l->held = 0;
    if (l->nthreads > 0) {
        l->paused = 0;
        pthread_cond_broadcast(&l->cv_work);
        pthread_mutex_unlock(&l->mu);
    }
    return DTR_OK;
}

/* ---- batches as tensors ---- */

dtr_result dtr_batch_tensors(dtr_context *ctx, const dtr_batch *b, dtr_tensor **x, dtr_tensor **y) {
    if (x) *x = NULL;
    if (y) *y = NULL;
    if (!ctx || !b || !x || !b->x) return DTR_NULL_HANDLE;
    *x = dtr_tensor_from(ctx, b->x_dtype, b->x_ndim, b->x_shape, b->x);
    if (!*x) return dtr_context_status(ctx);
    if (y && b->y) {
        *y = dtr_tensor_from(ctx, b->y_dtype, b->y_ndim, b->y_shape, b->y);
        if (!*y) return dtr_context_status(ctx);
    }
    return DTR_OK;
}

/* x or y of the held slot into an arena tensor of the device context, queued */
static dtr_tensor *dtr__loader_upload(dtr_loader *l, dtr__slot *s, dtr_dtype dt, int ndim, const int64_t *shape, const void *src) {
    dtr_context *ctx = l->cfg.device;
    dtr_tensor *t = dtr__tensor_alloc(ctx, dt, ndim, shape, "dtr_loader_tensors");
    dtr_result r;
    if (!t) return NULL;
    r = dtr__from_host_async(ctx, dtr__data(t), src, (size_t)dtr_tensor_numel(t) * dtr_dtype_size(dt), &s->uploaded);
    return r == DTR_OK ? t : dtr__failt(ctx, r, "dtr_loader_tensors: copy to the device failed");
}

dtr_result dtr_loader_tensors(dtr_loader *l, dtr_context *ctx, const dtr_batch *b, dtr_tensor **x, dtr_tensor **y) {
    dtr__slot *s;
    if (x) *x = NULL;
    if (y) *y = NULL;
    if (!l || !ctx || !b || !x || !b->x) return DTR_NULL_HANDLE;
    s = l->held ? &l->slots[l->nthreads ? l->head % l->depth : 0] : NULL;
    if (ctx != l->cfg.device || !s || b->x != s->x || dtr__host_memory(ctx)) return dtr_batch_tensors(ctx, b, x, y);
    dtr__loader_settle(l, s);   /* a second call for the same batch */
    *x = dtr__loader_upload(l, s, b->x_dtype, b->x_ndim, b->x_shape, b->x);
    if (*x && y && b->y) *y = dtr__loader_upload(l, s, b->y_dtype, b->y_ndim, b->y_shape, b->y);
    return dtr_context_status(ctx);
}

/* ---- state ---- */

dtr_result dtr_loader_state(dtr_loader *l, int index, dtr_state_entry *out) {
    if (!l || !out) return DTR_NULL_HANDLE;
    if (index != 0) return DTR_NOT_FOUND;
    dtr_loader_get_cursor(l, &l->state_cursor);
    return dtr__state_put(out, "cursor", &l->state_cursor, sizeof l->state_cursor, 0);
}

dtr_result dtr_loader_state_loaded(dtr_loader *l) {
    if (!l) return DTR_NULL_HANDLE;
    return dtr_loader_set_cursor(l, &l->state_cursor);
}
