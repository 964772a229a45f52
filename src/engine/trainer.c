/* ============================================================================
 * Online trainer: learning inside a running app (dtr_trainer, api_engine.h).
 *
 * Work comes in pieces: a micro-batch (forward and backward of 1, 2, 4 ... samples popped
 * from the feed, its gradient accumulated in the model's buffer), an update (the optimizer
 * step once a batch has accumulated) and a publication (copy, guard, checksum, swap). A
 * cooperative tick starts a piece only when the recent worst time of its kind, plus a
 * margin, fits in what is left of the budget; the background thread runs them back to back,
 * sleeping in proportion to cap its CPU share.
 *
 * Snapshots (RCU-style): `nslots` buffers, one of them current. A reader increments the
 * current slot's reader count, then checks the slot is still current (else it lets go and
 * retries). The publisher writes only a slot that is not current and has no reader, then
 * makes it current with a sequentially consistent store. A reader that counted itself in
 * after the publisher's check sees another slot current and retries, so nobody reads a
 * buffer being written and no reader ever waits for the publisher.
 * ==========================================================================*/
#include "../public/api.h"
#include "../public/api_data.h"
#include "../public/api_engine.h"
#include "../core/internal.h"
#include "../public/api_comm.h"
#include "../data/data_internal.h"
#include "../comm/comm_internal.h"
#include <math.h>
#include <pthread.h>
#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
extern long syscall(long number, ...);
#endif

#define DTR__TR_BUCKETS 16   /* micro-batch sizes 1, 2, 4 ... 32768 */
#define DTR__TR_WIN 16       /* durations remembered per kind of work */

typedef struct dtr__tr_window {
    int64_t t[DTR__TR_WIN];
    int n, at;
} dtr__tr_window;

typedef struct dtr__tr_slot {
    float *params;
    int64_t version, updates;
    uint32_t crc;
    float loss;
    int readers;
} dtr__tr_slot;

struct dtr_trainer {
    dtr_trainer_config cfg;
    dtr_context *ctx;
    dtr_optimizer *opt;
    dtr_feed *feed;
    int64_t numel, batch, x_numel, y_numel;
    int64_t nbuf;                     /* the model's buffer floats: a slot holds them after the parameters */
    size_t x_bytes, y_bytes, fixed_bytes;
    dtr__tr_slot *slots;
    int nslots, current;
    /* the guard's held-out set: a ring, and the copy the evaluation reads */
    pthread_mutex_t hmu;
    unsigned char *hx, *hy, *ex, *ey;
    int64_t hcap, hhead, hsize, accepted;
    /* timing of each kind of work, in microseconds of the trainer's clock */
    dtr__tr_window micro[DTR__TR_BUCKETS], update, publish;
    int64_t acc;             /* samples whose gradient is in the model's buffer */
    int publish_req;         /* atomic */
    uint64_t t_created;
    /* counters: written by the training thread under smu */
    pthread_mutex_t smu;
    dtr_trainer_stats st;
    int64_t lost_seen;
    int64_t saved[6];        /* the "counters" state entry */
    int64_t starved;         /* ticks in a row with work waiting and nothing that fitted */
    /* background thread */
    pthread_mutex_t bmu;
    pthread_cond_t bcv;
    pthread_t th;
    int running, stop, paused;
    dtr_result status;
    char err[256];
};

/* ---- clock, errors ---- */

static uint64_t dtr__tr_now(const dtr_trainer *tr) {
    if (tr->cfg.clock) return tr->cfg.clock(tr->cfg.clock_user);
    return (uint64_t)(dtr_time_ns() / 1000);
}

static dtr_result dtr__tr_fail(dtr_trainer *tr, dtr_result r, const char *what) {
    const char *why = dtr_context_last_error(tr->ctx);
    snprintf(tr->err, sizeof tr->err, "trainer: %s: %s%s%.180s", what, dtr_result_string(r), why && *why ? ": " : "",
             why ? why : "");
    return r;
}

static void dtr__tr_log(dtr_trainer *tr, dtr_log_level level, const char *msg) {
    if (tr->ctx->cfg.log && tr->ctx->cfg.log_level >= level) tr->ctx->cfg.log(tr->ctx->cfg.log_user, level, msg);
}

/* ---- estimates ---- */

static void dtr__tr_record(dtr__tr_window *w, int64_t us) {
    w->t[w->at] = us;
    w->at = (w->at + 1) % DTR__TR_WIN;
    if (w->n < DTR__TR_WIN) w->n++;
}

/* The recent near-worst time (the largest of the last 16 but one: a single preemption or
 * page-fault burst does not starve that kind of work for 16 rounds) plus a margin of 1/8
 * and 5 us; -1 when nothing was timed. */
static int64_t dtr__tr_worst(const dtr__tr_window *w) {
    int64_t a = 0, b = 0;
    int i;
    if (w->n == 0) return -1;
    for (i = 0; i < w->n; i++) {
        if (w->t[i] > a) b = a, a = w->t[i];
        else if (w->t[i] > b) b = w->t[i];
    }
    if (w->n < 4) b = a;
    return b + b / 8 + 5;
}

/* Estimate of a micro-batch of 2^b samples: its own recent near-worst, or, while a size has
 * not run yet, four times the estimate of 2^(b-1) samples (time grows at most linearly with
 * the samples; the first run of a size also touches new arena memory); a cold one-sample
 * micro-batch takes cold_estimate_us; -1: unknown. */
static int64_t dtr__tr_micro_est(const dtr_trainer *tr, int b) {
    int64_t e = dtr__tr_worst(&tr->micro[b]), p;
    if (b == 0) return e < 0 && tr->cfg.cold_estimate_us > 0 ? tr->cfg.cold_estimate_us : e;
    if (e >= 0) return e;
    p = dtr__tr_micro_est(tr, b - 1);
    return p >= 0 ? 4 * p : -1;
}

static int dtr__tr_log2(int64_t n) {
    int b = 0;
    while (b + 1 < DTR__TR_BUCKETS && ((int64_t)1 << (b + 1)) <= n) b++;
    return b;
}

/* ---- the held-out set ---- */

/* Adds samples [0, n) to the ring (the newest hcap stay). Under hmu. */
static void dtr__tr_hold(dtr_trainer *tr, const unsigned char *x, const unsigned char *y, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) {
        int64_t at = (tr->hhead + tr->hsize) % tr->hcap;
        if (tr->hsize == tr->hcap) tr->hhead = (tr->hhead + 1) % tr->hcap;
        else tr->hsize++;
        memcpy(tr->hx + (size_t)at * tr->x_bytes, x + (size_t)i * tr->x_bytes, tr->x_bytes);
        if (tr->y_bytes) memcpy(tr->hy + (size_t)at * tr->y_bytes, y + (size_t)i * tr->y_bytes, tr->y_bytes);
    }
}

/* Copies the held-out set into ex/ey for an evaluation; returns its size. */
static int64_t dtr__tr_hold_copy(dtr_trainer *tr) {
    int64_t i, n;
    pthread_mutex_lock(&tr->hmu);
    n = tr->hsize;
    for (i = 0; i < n; i++) {
        int64_t at = (tr->hhead + i) % tr->hcap;
        memcpy(tr->ex + (size_t)i * tr->x_bytes, tr->hx + (size_t)at * tr->x_bytes, tr->x_bytes);
        if (tr->y_bytes) memcpy(tr->ey + (size_t)i * tr->y_bytes, tr->hy + (size_t)at * tr->y_bytes, tr->y_bytes);
    }
    pthread_mutex_unlock(&tr->hmu);
    return n;
}

/* ---- pieces of work ---- */

/* The loss of the model's current weights on the n samples in ex/ey (no gradients). */
static dtr_result dtr__tr_eval(dtr_trainer *tr, int64_t n, float *out) {
    const dtr_sample_layout *l = &tr->cfg.feed.layout;
    int64_t xs[DTR_MAX_DIMS], ys[DTR_MAX_DIMS];
    dtr_tensor *x, *y = NULL, *loss;
    int g = dtr_context_set_grad_enabled(tr->ctx, 0), t = dtr_context_set_training(tr->ctx, 0), d;
    dtr_result r;
    xs[0] = ys[0] = n;
    for (d = 0; d < l->x_ndim; d++) xs[d + 1] = l->x_shape[d];
    for (d = 0; d < l->y_ndim; d++) ys[d + 1] = l->y_shape[d];
    x = dtr_tensor_from(tr->ctx, l->x_dtype, l->x_ndim + 1, xs, tr->ex);
    if (tr->y_bytes) y = dtr_tensor_from(tr->ctx, l->y_dtype, l->y_ndim + 1, ys, tr->ey);
    loss = x && (y || !tr->y_bytes) ? tr->cfg.loss(tr->cfg.loss_user, tr->ctx, x, y) : NULL;
    *out = loss ? dtr_tensor_get(loss, 0) : NAN;
    r = loss ? DTR_OK : dtr_context_status(tr->ctx);
    if (r == DTR_OK && !loss) r = DTR_BAD_STATE;
    if (r != DTR_OK) dtr__tr_fail(tr, r, "evaluating the held-out set");
    dtr_context_set_grad_enabled(tr->ctx, g);
    dtr_context_set_training(tr->ctx, t);
    dtr_context_reset(tr->ctx);
    return r;
}

/* Forward and backward of up to m samples from the feed (waiting up to wait_ms for them). */
static dtr_result dtr__tr_micro(dtr_trainer *tr, int64_t m, int wait_ms, int64_t *got) {
    dtr_batch b;
    dtr_tensor *x = NULL, *y = NULL, *loss = NULL;
    dtr_result r = dtr_feed_next(tr->feed, m, 1, wait_ms, &b);
    size_t reserved = 0;
    *got = 0;
    if (r == DTR_TIMEOUT || r == DTR_BAD_STATE) return DTR_OK;   /* nothing there, or the stream ended */
    if (r != DTR_OK) return dtr__tr_fail(tr, r, "popping a batch");
    r = dtr_batch_tensors(tr->ctx, &b, &x, tr->y_bytes ? &y : NULL);
    if (r == DTR_OK) loss = tr->cfg.loss(tr->cfg.loss_user, tr->ctx, x, y);
    if (loss) loss = dtr_scale(tr->ctx, loss, (float)b.size / (float)tr->batch);
    if (r == DTR_OK) r = loss ? dtr_backward(tr->ctx, loss) : dtr_context_status(tr->ctx);
    if (r == DTR_OK && !loss) r = DTR_BAD_STATE;
    dtr_context_arena_usage(tr->ctx, &reserved, NULL);
    dtr_context_reset(tr->ctx);
    if (r != DTR_OK) return dtr__tr_fail(tr, r, "a training micro-batch");
    if (tr->cfg.memory_cap && tr->fixed_bytes + reserved > tr->cfg.memory_cap) {
        snprintf(tr->err, sizeof tr->err, "trainer: the arena grew to %zu bytes: with the trainer's %zu bytes that is over memory_cap %zu",
                 reserved, tr->fixed_bytes, tr->cfg.memory_cap);
        return DTR_ARENA_FULL;
    }
    tr->acc += b.size;
    *got = b.size;
    pthread_mutex_lock(&tr->smu);
    tr->st.micro_batches++;
    tr->st.samples_trained += b.size;
    pthread_mutex_unlock(&tr->smu);
    return DTR_OK;
}

/* The optimizer step over the accumulated gradient (rescaled to the mean when the batch
 * came out larger than batch_size). */
static dtr_result dtr__tr_update(dtr_trainer *tr) {
    dtr_result r = DTR_OK;
    if (tr->acc != tr->batch)
        r = dtr__model_grad_scale(tr->cfg.model, (float)tr->batch / (float)tr->acc);
    if (r != DTR_OK || (r = dtr_optimizer_step(tr->opt, NULL)) != DTR_OK) return dtr__tr_fail(tr, r, "the optimizer step");
    tr->acc = 0;
    pthread_mutex_lock(&tr->smu);
    tr->st.updates++;
    if (tr->cfg.publish_every > 0 && tr->st.updates % tr->cfg.publish_every == 0)
        DTR__ATOMIC_STORE_SC(&tr->publish_req, 1);
    pthread_mutex_unlock(&tr->smu);
    return DTR_OK;
}

/* A slot nobody reads and that is not current, or -1. */
static int dtr__tr_free_slot(dtr_trainer *tr) {
    int cur = DTR__ATOMIC_LOAD_SC(&tr->current), i;
    for (i = 0; i < tr->nslots; i++)
        if (i != cur && DTR__ATOMIC_LOAD_SC(&tr->slots[i].readers) == 0) return i;
    return -1;
}

/* A slot's image (the parameters, then the buffers: batch norm's statistics) into model m. */
static dtr_result dtr__tr_put(dtr_trainer *tr, dtr_model *m, const float *image) {
    dtr_result r = dtr_model_write(m, image, tr->numel);
    return r == DTR_OK ? dtr_model_write_buffers(m, image + tr->numel, tr->nbuf) : r;
}

/* The guard: evaluates the candidate (the model's weights, also in `s`) and the current
 * snapshot on the same held-out samples. 1: publish; 0: refused. The candidate's loss is
 * reported to the optimizer (dtr_optimizer_report_metric: a plateau schedule's metric). */
static dtr_result dtr__tr_guard(dtr_trainer *tr, dtr__tr_slot *s, int cur, int *ok) {
    float ln, lo;
    int64_t n = dtr__tr_hold_copy(tr);
    dtr_result r, r2;
    *ok = 1;
    s->loss = NAN;
    if (n == 0 || cur < 0) return DTR_OK;
    if ((r = dtr__tr_eval(tr, n, &ln)) != DTR_OK) return r;
    /* the current snapshot's weights into the model, evaluated, then the candidate's back
       (dtr_model_write: through the backend on a device) */
    if ((r = dtr__tr_put(tr, tr->cfg.model, tr->slots[cur].params)) == DTR_OK) r = dtr__tr_eval(tr, n, &lo);
    if ((r2 = dtr__tr_put(tr, tr->cfg.model, s->params)) != DTR_OK && r == DTR_OK) r = r2;
    if (r != DTR_OK || (r = dtr_optimizer_report_metric(tr->opt, ln, NULL)) != DTR_OK) return r;
    s->loss = ln;
    *ok = ln <= lo + fabsf(lo) * tr->cfg.guard.tolerance;
    pthread_mutex_lock(&tr->smu);
    tr->st.guard_new_loss = ln;
    tr->st.guard_old_loss = lo;
    if (!*ok) tr->st.guard_refused++;
    pthread_mutex_unlock(&tr->smu);
    if (!*ok) {
        char msg[200];
        snprintf(msg, sizeof msg, "trainer: the guard kept version %lld: held-out loss %g of the new weights is worse than %g",
                 (long long)tr->slots[cur].version, (double)ln, (double)lo);
        dtr__tr_log(tr, DTR_LOG_WARN, msg);
    }
    return DTR_OK;
}

/* Publishes the model's weights (through the guard). *out: 1 published, -1 refused, 0 put
 * off (every spare buffer held). */
static dtr_result dtr__tr_publish(dtr_trainer *tr, int *out) {
    int i = dtr__tr_free_slot(tr), cur = DTR__ATOMIC_LOAD_SC(&tr->current), ok = 1;
    dtr__tr_slot *s;
    dtr_result r;
    *out = 0;
    if (i < 0) {
        pthread_mutex_lock(&tr->smu);
        tr->st.publish_busy++;
        pthread_mutex_unlock(&tr->smu);
        return DTR_OK;
    }
    s = &tr->slots[i];
    DTR__ATOMIC_STORE_SC(&tr->publish_req, 0);
    if ((r = dtr_model_read(tr->cfg.model, s->params, tr->numel)) != DTR_OK ||
        (r = dtr_model_read_buffers(tr->cfg.model, s->params + tr->numel, tr->nbuf)) != DTR_OK)
        return dtr__tr_fail(tr, r, "copying the weights");
    s->loss = NAN;
    if (tr->cfg.guard.enabled && (r = dtr__tr_guard(tr, s, cur, &ok)) != DTR_OK) return r;
    if (!ok) {
        *out = -1;
        return DTR_OK;
    }
    s->crc = dtr_crc32c(0, s->params, (size_t)tr->numel * 4);
    pthread_mutex_lock(&tr->smu);
    s->version = ++tr->st.version;
    s->updates = tr->st.updates;
    tr->st.published++;
    pthread_mutex_unlock(&tr->smu);
    DTR__ATOMIC_STORE_SC(&tr->current, i);
    *out = 1;
    return DTR_OK;
}

/* A publication's cost grows with the held-out set it evaluates: its window holds times
 * per 1024 "units" of (held-out samples + 64), its estimate scales to the set's size now. */
static int64_t dtr__tr_publish_units(dtr_trainer *tr) {
    int64_t h;
    if (!tr->cfg.guard.enabled) return 64;
    pthread_mutex_lock(&tr->hmu);
    h = tr->hsize;
    pthread_mutex_unlock(&tr->hmu);
    return h + 64;
}

static int64_t dtr__tr_publish_est(dtr_trainer *tr) {
    int64_t e = dtr__tr_worst(&tr->publish);
    return e < 0 ? -1 : e * dtr__tr_publish_units(tr) / 1024 + 5;
}

/* Runs one piece of work and times it into its window. */
static dtr_result dtr__tr_timed_publish(dtr_trainer *tr, int *out) {
    int64_t u = dtr__tr_publish_units(tr);
    uint64_t t0 = dtr__tr_now(tr);
    dtr_result r = dtr__tr_publish(tr, out);
    dtr__tr_record(&tr->publish, (int64_t)(dtr__tr_now(tr) - t0) * 1024 / u + 1);
    return r;
}

static dtr_result dtr__tr_timed_update(dtr_trainer *tr) {
    uint64_t t0 = dtr__tr_now(tr);
    dtr_result r = dtr__tr_update(tr);
    dtr__tr_record(&tr->update, (int64_t)(dtr__tr_now(tr) - t0));
    return r;
}

static dtr_result dtr__tr_timed_micro(dtr_trainer *tr, int64_t m, int wait_ms, int64_t *got) {
    uint64_t t0 = dtr__tr_now(tr);
    dtr_result r = dtr__tr_micro(tr, m, wait_ms, got);
    if (*got > 0) dtr__tr_record(&tr->micro[dtr__tr_log2(*got)], (int64_t)(dtr__tr_now(tr) - t0));
    return r;
}

/* ---- creation ---- */

dtr_trainer_config dtr_trainer_config_init(void) {
    dtr_trainer_config c;
    memset(&c, 0, sizeof c);
    c.optimizer = dtr_optimizer_config_init(DTR_OPT_ADAM, 1e-3f);
    c.feed = dtr_feed_config_init();
    c.batch_size = 32;
    c.publish_every = 10;
    c.snapshots = 4;
    c.guard.holdout_every = 10;
    c.guard.holdout_size = 256;
    c.background.cpu = -1;
    c.background.cpu_share = 1.0f;
    c.background.idle_wait_ms = 5;
    return c;
}

static dtr_result dtr__tr_check_config(const dtr_trainer_config *c, char *err, size_t errlen) {
    if (!c->model || !c->loss) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_trainer_create: model or loss is NULL");
    if (c->batch_size < 0 || c->snapshots < 0 || c->snapshots == 1 || c->guard.holdout_every < 0 ||
        c->guard.holdout_size < 0 || !(c->guard.tolerance >= 0) || c->background.nice < 0 || c->background.nice > 19 ||
        !(c->background.cpu_share >= 0 && c->background.cpu_share <= 1) || c->background.max_threads < 0 ||
        c->background.idle_wait_ms < 0 || c->cold_estimate_us < 0)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "dtr_trainer_create: a field is out of range (batch_size, snapshots >= 2, guard sizes and "
                         "tolerance >= 0, nice 0..19, cpu_share in [0, 1], max_threads, idle_wait_ms, cold_estimate_us)");
    if (c->optimizer.grad_accum_steps > 1)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT,
                         "dtr_trainer_create: optimizer.grad_accum_steps must be 0 or 1 (the trainer accumulates batch_size samples)");
    return DTR_OK;
}

/* Allocates the snapshots and the held-out buffers. */
static dtr_result dtr__tr_alloc(dtr_trainer *tr, char *err, size_t errlen) {
    const dtr_allocation_callbacks *a = &tr->ctx->cfg.alloc;
    int i;
    tr->slots = (dtr__tr_slot *)dtr__calloc(a, (size_t)tr->nslots * sizeof *tr->slots);
    if (!tr->slots) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "trainer: out of memory");
    for (i = 0; i < tr->nslots; i++)
        if (!(tr->slots[i].params = (float *)dtr__malloc(a, (size_t)(tr->numel + tr->nbuf) * 4 + 4)))
            return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "trainer: out of memory for %d snapshots", tr->nslots);
    if (!tr->cfg.guard.enabled) return DTR_OK;
    tr->hx = (unsigned char *)dtr__malloc(a, (size_t)tr->hcap * tr->x_bytes);
    tr->ex = (unsigned char *)dtr__malloc(a, (size_t)tr->hcap * tr->x_bytes);
    tr->hy = (unsigned char *)dtr__malloc(a, (size_t)tr->hcap * tr->y_bytes + 4);
    tr->ey = (unsigned char *)dtr__malloc(a, (size_t)tr->hcap * tr->y_bytes + 4);
    if (!tr->hx || !tr->ex || !tr->hy || !tr->ey)
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "trainer: out of memory for %lld held-out samples", (long long)tr->hcap);
    return DTR_OK;
}

/* Bytes the trainer holds besides the arena: model (params, grads), optimizer moments,
 * feed ring and batch, snapshots, held-out ring and copy. */
static size_t dtr__tr_bytes(const dtr_trainer *tr) {
    size_t sample = tr->x_bytes + tr->y_bytes + 8, moments = tr->cfg.optimizer.kind == DTR_OPT_SGD ? 1 : 2;
    int64_t cap = tr->cfg.feed.capacity ? tr->cfg.feed.capacity : 1024;
    int64_t mb = tr->cfg.feed.max_batch ? tr->cfg.feed.max_batch : 256;
    size_t b = (size_t)tr->numel * 4 * (2 + moments + (size_t)tr->nslots) + (size_t)tr->nbuf * 4 * (size_t)tr->nslots;
    b += (size_t)(cap + mb) * sample;
    if (tr->cfg.guard.enabled) b += (size_t)tr->hcap * (tr->x_bytes + tr->y_bytes) * 2;
    return b;
}

static dtr_result dtr__tr_setup(dtr_trainer *tr, char *err, size_t errlen) {
    dtr_trainer_config *c = &tr->cfg;
    dtr_result r;
    int pub;
    if ((r = dtr_model_build(c->model)) != DTR_OK) return dtr__errf(err, errlen, r, "trainer: building the model failed");
    tr->numel = dtr_model_numel(c->model);
    tr->nbuf = dtr_model_buffer_numel(c->model);
    tr->x_numel = dtr_sample_layout_x_numel(&c->feed.layout);
    tr->y_numel = dtr_sample_layout_y_numel(&c->feed.layout);
    tr->x_bytes = (size_t)tr->x_numel * 4;
    tr->y_bytes = (size_t)tr->y_numel * 4;
    tr->fixed_bytes = dtr__tr_bytes(tr);
    if (c->memory_cap && tr->fixed_bytes > c->memory_cap)
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "trainer: needs %zu bytes (model, optimizer, feed, snapshots, held-out set): over memory_cap %zu",
                         tr->fixed_bytes, c->memory_cap);
    if (c->background.max_threads > 0 && dtr_context_threads(tr->ctx) > c->background.max_threads)
        return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "trainer: the context has %d compute threads, over max_threads %d",
                         dtr_context_threads(tr->ctx), c->background.max_threads);
    if ((r = dtr_feed_create(&c->feed, &tr->feed, err, errlen)) != DTR_OK) return r;
    if ((r = dtr_optimizer_create(c->model, &c->optimizer, &tr->opt)) != DTR_OK)
        return dtr__errf(err, errlen, r, "trainer: creating the optimizer: %s", dtr_context_last_error(tr->ctx));
    if ((r = dtr__tr_alloc(tr, err, errlen)) != DTR_OK) return r;
    if ((r = dtr__tr_publish(tr, &pub)) != DTR_OK) return dtr__errf(err, errlen, r, "%s", tr->err);
    return DTR_OK;
}

dtr_result dtr_trainer_create(const dtr_trainer_config *cfg, dtr_trainer **out, char *err, size_t errlen) {
    dtr_trainer *tr;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!out) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_trainer_create: out is NULL");
    *out = NULL;
    if (!cfg) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_trainer_create: cfg is NULL");
    if ((r = dtr__tr_check_config(cfg, err, errlen)) != DTR_OK) return r;
    tr = (dtr_trainer *)dtr__calloc(&dtr_model_context(cfg->model)->cfg.alloc, sizeof *tr);
    if (!tr) return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "trainer: out of memory");
    tr->cfg = *cfg;
    tr->ctx = dtr_model_context(cfg->model);
    tr->batch = cfg->batch_size ? cfg->batch_size : 32;
    tr->cfg.publish_every = cfg->publish_every ? cfg->publish_every : 10;
    tr->nslots = cfg->snapshots ? cfg->snapshots : 4;
    tr->hcap = cfg->guard.holdout_size ? cfg->guard.holdout_size : 256;
    tr->cfg.guard.holdout_every = cfg->guard.holdout_every ? cfg->guard.holdout_every : 10;
    if (tr->cfg.background.cpu_share == 0) tr->cfg.background.cpu_share = 1;
    if (tr->cfg.background.idle_wait_ms == 0) tr->cfg.background.idle_wait_ms = 5;
    tr->cfg.optimizer.grad_accum_steps = 1;
    tr->current = -1;
    tr->st.guard_new_loss = tr->st.guard_old_loss = NAN;
    pthread_mutex_init(&tr->hmu, NULL);
    pthread_mutex_init(&tr->smu, NULL);
    pthread_mutex_init(&tr->bmu, NULL);
    dtr__cond_init(&tr->bcv);
    tr->t_created = dtr__tr_now(tr);
    if ((r = dtr__tr_setup(tr, err, errlen)) != DTR_OK) {
        dtr_trainer_destroy(tr);
        return r;
    }
    *out = tr;
    return DTR_OK;
}

void dtr_trainer_destroy(dtr_trainer *tr) {
    const dtr_allocation_callbacks *a;
    int i;
    if (!tr) return;
    dtr_trainer_stop(tr);
    a = &tr->ctx->cfg.alloc;
    dtr_feed_destroy(tr->feed);
    dtr_optimizer_destroy(tr->opt);
    for (i = 0; tr->slots && i < tr->nslots; i++) dtr__free(a, tr->slots[i].params);
    dtr__free(a, tr->slots);
    dtr__free(a, tr->hx);
    dtr__free(a, tr->hy);
    dtr__free(a, tr->ex);
    dtr__free(a, tr->ey);
    pthread_mutex_destroy(&tr->hmu);
    pthread_mutex_destroy(&tr->smu);
    pthread_mutex_destroy(&tr->bmu);
    pthread_cond_destroy(&tr->bcv);
    dtr__free(a, tr);
}

/* ---- ingest ---- */

dtr_result dtr_trainer_push_holdout(dtr_trainer *tr, const void *x, const void *y, int64_t n) {
    dtr_feed_stats st;
    if (!tr || (n > 0 && (!x || (tr->y_bytes && !y)))) return DTR_NULL_HANDLE;
    if (n < 0) return DTR_INVALID_ARGUMENT;
    if (!tr->cfg.guard.enabled) return DTR_BAD_STATE;
    if (dtr__feed_validate(tr->feed, x, y, n, st.last_bad, sizeof st.last_bad) >= 0) {
        snprintf(tr->err, sizeof tr->err, "trainer: held-out push: %s", st.last_bad);
        return DTR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&tr->hmu);
    dtr__tr_hold(tr, (const unsigned char *)x, (const unsigned char *)y, n);
    pthread_mutex_unlock(&tr->hmu);
    return DTR_OK;
}

/* Pushes samples [i0, i1) to the feed; adds to *pushed. */
static dtr_result dtr__tr_feed_range(dtr_trainer *tr, const unsigned char *x, const unsigned char *y, int64_t i0,
                                     int64_t i1, int timeout_ms, int64_t *pushed) {
    int64_t k = 0;
    dtr_result r;
    if (i1 <= i0) return DTR_OK;
    r = dtr_feed_push(tr->feed, x + (size_t)i0 * tr->x_bytes, y ? y + (size_t)i0 * tr->y_bytes : NULL, i1 - i0,
                      timeout_ms, &k);
    *pushed += k;
    return r;
}

dtr_result dtr_trainer_push(dtr_trainer *tr, const void *x, const void *y, int64_t n, int timeout_ms, int64_t *pushed) {
    const unsigned char *xb = (const unsigned char *)x, *yb = (const unsigned char *)y;
    int64_t done = 0, i, start = 0, every;
    dtr_result r = DTR_OK;
    if (pushed) *pushed = 0;
    if (!tr) return DTR_NULL_HANDLE;
    if (!tr->cfg.guard.enabled || n <= 0) {
        r = dtr_feed_push(tr->feed, x, y, n, timeout_ms, pushed);
        return r;
    }
    /* every holdout_every-th sample goes to the held-out set (checked the same way) */
    if (!x || (tr->y_bytes && !y)) return DTR_NULL_HANDLE;
    if (tr->cfg.feed.check == DTR_FEED_REJECT_PUSH && dtr__feed_validate(tr->feed, x, y, n, tr->err, sizeof tr->err) >= 0)
        return DTR_INVALID_ARGUMENT;
    every = tr->cfg.guard.holdout_every;
    for (i = 0; i < n && r == DTR_OK; i++) {
        int64_t k = DTR__ATOMIC_INC(&tr->accepted);
        if (k % every != 0) continue;
        r = dtr__tr_feed_range(tr, xb, yb, start, i, timeout_ms, &done);
        if (r == DTR_OK && dtr__feed_validate(tr->feed, xb + (size_t)i * tr->x_bytes, yb ? yb + (size_t)i * tr->y_bytes : NULL, 1,
                                              NULL, 0) < 0) {
            pthread_mutex_lock(&tr->hmu);
            dtr__tr_hold(tr, xb + (size_t)i * tr->x_bytes, yb ? yb + (size_t)i * tr->y_bytes : NULL, 1);
            pthread_mutex_unlock(&tr->hmu);
            done++;
        }
        start = i + 1;
    }
    if (r == DTR_OK) r = dtr__tr_feed_range(tr, xb, yb, start, n, timeout_ms, &done);
    if (pushed) *pushed = done;
    return r;
}

/* ---- cooperative ticks ---- */

/* The largest micro-batch (a power of two up to what is wanted and there) whose estimate
 * fits in `left`; the cold one-sample batch when nothing is known and nothing ran yet in
 * this tick; 0: none fits. */
static int64_t dtr__tr_pick(const dtr_trainer *tr, int64_t want, int64_t left, int first) {
    int b;
    if (want < 1) return 0;
    for (b = dtr__tr_log2(want); b >= 0; b--) {
        int64_t e = dtr__tr_micro_est(tr, b);
        if (e >= 0 && e <= left) return (int64_t)1 << b;
        if (e < 0 && b == 0 && first) return 1;
    }
    return 0;
}

/* One piece of work for a tick with `left` microseconds. 1: done one; 0: none fits. */
static dtr_result dtr__tr_tick_one(dtr_trainer *tr, int64_t left, int first, dtr_trainer_tick_report *rep, int *did) {
    int64_t e, m, got = 0, avail;
    dtr_result r;
    *did = 0;
    if (DTR__ATOMIC_LOAD_SC(&tr->publish_req) && (e = dtr__tr_publish_est(tr)) <= left && (e >= 0 || first)) {
        int p;
        if ((r = dtr__tr_timed_publish(tr, &p)) != DTR_OK) return r;
        if (p) rep->published = p;
        *did = p != 0;
        if (*did) return DTR_OK;
    }
    if (tr->acc >= tr->batch) {
        e = dtr__tr_worst(&tr->update);
        if (!(e <= left && (e >= 0 || first))) return DTR_OK;
        rep->updates++;
        *did = 1;
        return dtr__tr_timed_update(tr);
    }
    avail = dtr__feed_size(tr->feed);
    m = dtr__tr_pick(tr, avail < tr->batch - tr->acc ? avail : tr->batch - tr->acc, left, first);
    if (m == 0) return DTR_OK;
    r = dtr__tr_timed_micro(tr, m, 0, &got);
    rep->micro_batches += got > 0;
    rep->samples += got;
    *did = got > 0;
    return r;
}

static void dtr__tr_halve(dtr__tr_window *w) {
    int i;
    for (i = 0; i < w->n; i++) w->t[i] /= 2;
}

/* A tick in which work waited and nothing fitted. After reprobe_ticks of them in a row the
 * estimates are halved, so one spike (a page-fault burst, a preemption on the clock) does not
 * stop training for good; if the work really does not fit, the next attempt shows it again. */
static void dtr__tr_starve(dtr_trainer *tr, const dtr_trainer_tick_report *rep) {
    int b;
    if (rep->micro_batches || rep->updates || rep->published || (dtr__feed_size(tr->feed) == 0 && tr->acc < tr->batch &&
                                                                 !DTR__ATOMIC_LOAD_SC(&tr->publish_req))) {
        tr->starved = 0;
        return;
    }
    if (tr->cfg.reprobe_ticks < 0 || ++tr->starved < (tr->cfg.reprobe_ticks ? tr->cfg.reprobe_ticks : 64)) return;
    tr->starved = 0;
    for (b = 0; b < DTR__TR_BUCKETS; b++) dtr__tr_halve(&tr->micro[b]);
    dtr__tr_halve(&tr->update);
    dtr__tr_halve(&tr->publish);
    pthread_mutex_lock(&tr->smu);
    tr->st.reprobes++;
    pthread_mutex_unlock(&tr->smu);
}

static void dtr__tr_tick_stats(dtr_trainer *tr, int64_t budget, int64_t used) {
    int64_t over = used - budget, slack = budget / 10 > 200 ? budget / 10 : 200;
    pthread_mutex_lock(&tr->smu);
    if (tr->st.ticks == 0 || over > tr->st.tick_max_over_us) tr->st.tick_max_over_us = over;
    tr->st.ticks++;
    tr->st.tick_overruns += over > slack;
    tr->st.tick_used_us += used;
    tr->st.tick_budget_us += budget;
    pthread_mutex_unlock(&tr->smu);
}

dtr_result dtr_trainer_tick(dtr_trainer *tr, int64_t budget_us, dtr_trainer_tick_report *report) {
    dtr_trainer_tick_report rep;
    uint64_t t0;
    dtr_result r = DTR_OK;
    int did = 1, first = 1;
    memset(&rep, 0, sizeof rep);
    if (report) *report = rep;
    if (!tr) return DTR_NULL_HANDLE;
    if (tr->running || tr->status != DTR_OK) return tr->running ? DTR_BAD_STATE : tr->status;
    if (budget_us < 0) budget_us = 0;
    t0 = dtr__tr_now(tr);
    while (did && r == DTR_OK) {
        int64_t left = budget_us - (int64_t)(dtr__tr_now(tr) - t0);
        if (left <= 0) break;
        r = dtr__tr_tick_one(tr, left, first, &rep, &did);
        first = 0;
    }
    rep.used_us = (int64_t)(dtr__tr_now(tr) - t0);
    dtr__tr_tick_stats(tr, budget_us, rep.used_us);
    if (r == DTR_OK) dtr__tr_starve(tr, &rep);
    if (r != DTR_OK) tr->status = r;
    if (report) *report = rep;
    return r;
}

/* ---- background thread ---- */

static void dtr__tr_thread_setup(dtr_trainer *tr) {
#ifdef __linux__
    if (tr->cfg.background.nice > 0) setpriority(PRIO_PROCESS, 0, tr->cfg.background.nice);   /* this thread only */
    if (tr->cfg.background.cpu >= 0 && tr->cfg.background.cpu < 1024) {
        unsigned long mask[1024 / (8 * sizeof(unsigned long))];
        memset(mask, 0, sizeof mask);
        mask[tr->cfg.background.cpu / (8 * sizeof(unsigned long))] |= 1ul << (tr->cfg.background.cpu % (8 * sizeof(unsigned long)));
        syscall(SYS_sched_setaffinity, 0L, (long)sizeof mask, mask);
    }
#else
    (void)tr;
#endif
}

/* Sleeps `us` on bcv (stop and pause wake it). Under bmu. */
static void dtr__tr_rest(dtr_trainer *tr, int64_t us) {
    int64_t deadline = dtr_time_ns() + us * 1000;
    while (!tr->stop && !tr->paused && !dtr__cond_wait_until(&tr->bcv, &tr->bmu, deadline)) {
    }
}

/* One piece of work of the background thread; returns its time in microseconds. */
static dtr_result dtr__tr_bg_one(dtr_trainer *tr, int64_t *us) {
    uint64_t t0 = dtr__tr_now(tr);
    int64_t got = 0;
    dtr_result r;
    int p;
    if (DTR__ATOMIC_LOAD_SC(&tr->publish_req)) r = dtr__tr_timed_publish(tr, &p);
    else if (tr->acc >= tr->batch) r = dtr__tr_timed_update(tr);
    else {
        r = dtr__tr_timed_micro(tr, tr->batch - tr->acc, tr->cfg.background.idle_wait_ms, &got);
        if (got == 0) t0 = dtr__tr_now(tr);   /* waited for samples: no work to pay for */
    }
    *us = (int64_t)(dtr__tr_now(tr) - t0);
    return r;
}

static void *dtr__tr_thread(void *arg) {
    dtr_trainer *tr = (dtr_trainer *)arg;
    float share = tr->cfg.background.cpu_share;
    dtr_result r = DTR_OK;
    dtr__tr_thread_setup(tr);
    for (;;) {
        int64_t us = 0;
        pthread_mutex_lock(&tr->bmu);
        while (tr->paused && !tr->stop) pthread_cond_wait(&tr->bcv, &tr->bmu);
        if (tr->stop) {
            pthread_mutex_unlock(&tr->bmu);
            break;
        }
        pthread_mutex_unlock(&tr->bmu);
        if ((r = dtr__tr_bg_one(tr, &us)) != DTR_OK) break;
        if (share < 1 && us > 0) {
            pthread_mutex_lock(&tr->bmu);
            dtr__tr_rest(tr, (int64_t)((double)us * (1 - share) / share));
            pthread_mutex_unlock(&tr->bmu);
        }
    }
    tr->status = r;
    if (r != DTR_OK) dtr__tr_log(tr, DTR_LOG_ERROR, tr->err);
    return NULL;
}

dtr_result dtr_trainer_start(dtr_trainer *tr) {
    if (!tr) return DTR_NULL_HANDLE;
    if (tr->running || tr->status != DTR_OK) return DTR_BAD_STATE;
    tr->stop = 0;
    if (pthread_create(&tr->th, NULL, dtr__tr_thread, tr) != 0) {
        snprintf(tr->err, sizeof tr->err, "trainer: cannot start the training thread");
        return DTR_OUT_OF_MEMORY;
    }
    tr->running = 1;
    return DTR_OK;
}

dtr_result dtr_trainer_stop(dtr_trainer *tr) {
    if (!tr) return DTR_NULL_HANDLE;
    if (tr->running) {
        pthread_mutex_lock(&tr->bmu);
        tr->stop = 1;
        pthread_cond_broadcast(&tr->bcv);
        pthread_mutex_unlock(&tr->bmu);
        pthread_join(tr->th, NULL);
        tr->running = 0;
    }
    return tr->status;
}

dtr_result dtr_trainer_pause(dtr_trainer *tr, int pause) {
    if (!tr) return DTR_NULL_HANDLE;
    pthread_mutex_lock(&tr->bmu);
    tr->paused = pause != 0;
    pthread_cond_broadcast(&tr->bcv);
    pthread_mutex_unlock(&tr->bmu);
    return DTR_OK;
}

/* ---- serving ---- */

dtr_result dtr_trainer_publish(dtr_trainer *tr) {
    if (!tr) return DTR_NULL_HANDLE;
    DTR__ATOMIC_STORE_SC(&tr->publish_req, 1);
    return DTR_OK;
}

dtr_result dtr_trainer_acquire(dtr_trainer *tr, dtr_snapshot *out) {
    if (!tr || !out) return DTR_NULL_HANDLE;
    for (;;) {
        int c = DTR__ATOMIC_LOAD_SC(&tr->current);
        dtr__tr_slot *s = &tr->slots[c];
        DTR__ATOMIC_INC(&s->readers);
        if (DTR__ATOMIC_LOAD_SC(&tr->current) == c) {
            out->params = s->params;
            out->numel = tr->numel;
            out->buffers = s->params + tr->numel;
            out->buffer_numel = tr->nbuf;
            out->version = s->version;
            out->updates = s->updates;
            out->crc32c = s->crc;
            out->holdout_loss = s->loss;
            out->slot = c;
            return DTR_OK;
        }
        DTR__ATOMIC_DEC(&s->readers);
    }
}

void dtr_trainer_release(dtr_trainer *tr, const dtr_snapshot *snap) {
    if (!tr || !snap || snap->slot < 0 || snap->slot >= tr->nslots) return;
    DTR__ATOMIC_DEC(&tr->slots[snap->slot].readers);
}

dtr_result dtr_trainer_pull(dtr_trainer *tr, dtr_model *serving, int64_t *version) {
    dtr_snapshot s;
    dtr_result r;
    if (!tr || !serving || !version) return DTR_NULL_HANDLE;
    if (dtr_model_build(serving) != DTR_OK || dtr_model_numel(serving) != tr->numel || !dtr_model_params(serving) ||
        dtr_model_buffer_numel(serving) != tr->nbuf)
        return DTR_SHAPE_MISMATCH;
    if ((r = dtr_trainer_acquire(tr, &s)) != DTR_OK) return r;
    if (s.version != *version && (r = dtr__tr_put(tr, serving, s.params)) == DTR_OK)   /* on a device too */
        *version = s.version;
    dtr_trainer_release(tr, &s);
    return r;
}

/* ---- stats, state ---- */

/* The falling-behind verdict and its line. */
static void dtr__tr_behind(dtr_trainer *tr, dtr_trainer_stats *o) {
    int64_t lost = o->feed.dropped + o->feed.dropped_newest + o->feed.timeouts, cap;
    cap = tr->cfg.feed.capacity ? tr->cfg.feed.capacity : 1024;
    o->behind = lost > tr->lost_seen || o->feed.size * 4 > cap * 3;
    tr->lost_seen = lost;
    o->report[0] = '\0';
    if (o->behind)
        snprintf(o->report, sizeof o->report,
                 "trainer behind the stream: %lld samples lost (%lld oldest dropped, %lld newest dropped, %lld push "
                 "timeouts), backlog %lld of %lld, ingest %.0f/s, trained %.0f/s",
                 (long long)lost, (long long)o->feed.dropped, (long long)o->feed.dropped_newest, (long long)o->feed.timeouts,
                 (long long)o->feed.size, (long long)cap, o->ingest_per_s, o->trained_per_s);
}

void dtr_trainer_get_stats(dtr_trainer *tr, dtr_trainer_stats *out) {
    double s;
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!tr) return;
    pthread_mutex_lock(&tr->smu);
    *out = tr->st;
    pthread_mutex_unlock(&tr->smu);
    dtr_feed_get_stats(tr->feed, &out->feed);
    pthread_mutex_lock(&tr->hmu);
    out->holdout = tr->hsize;
    pthread_mutex_unlock(&tr->hmu);
    s = (double)(dtr__tr_now(tr) - tr->t_created) / 1e6;
    out->ingest_per_s = s > 0 ? (double)out->feed.pushed / s : 0;
    out->trained_per_s = s > 0 ? (double)out->samples_trained / s : 0;
    out->status = tr->status;
    pthread_mutex_lock(&tr->smu);
    dtr__tr_behind(tr, out);
    pthread_mutex_unlock(&tr->smu);
}

const char *dtr_trainer_last_error(const dtr_trainer *tr) { return tr ? tr->err : ""; }
dtr_optimizer *dtr_trainer_optimizer(dtr_trainer *tr) { return tr ? tr->opt : NULL; }
dtr_feed *dtr_trainer_feed(dtr_trainer *tr) { return tr ? tr->feed : NULL; }

dtr_result dtr_trainer_state(dtr_trainer *tr, int index, dtr_state_entry *out) {
    if (!tr || !out) return DTR_NULL_HANDLE;
    if (index == 0) {
        pthread_mutex_lock(&tr->smu);
        tr->saved[0] = tr->st.updates, tr->saved[1] = tr->st.micro_batches, tr->saved[2] = tr->st.samples_trained;
        tr->saved[3] = tr->st.version, tr->saved[4] = tr->acc;
        tr->saved[5] = tr->slots[DTR__ATOMIC_LOAD_SC(&tr->current)].updates;
        pthread_mutex_unlock(&tr->smu);
        return dtr__state_put(out, "counters", tr->saved, sizeof tr->saved, 0);
    }
    if (index == 1)
        return dtr__state_put(out, "published", tr->slots[DTR__ATOMIC_LOAD_SC(&tr->current)].params, (size_t)tr->numel * 4, 0);
    return DTR_NOT_FOUND;
}

dtr_result dtr_trainer_state_loaded(dtr_trainer *tr) {
    dtr__tr_slot *s;
    int i;
    if (!tr) return DTR_NULL_HANDLE;
    for (i = 0; i < 6; i++)
        if (tr->saved[i] < 0 || (i == 4 && tr->saved[i] > tr->batch)) {
            snprintf(tr->err, sizeof tr->err, "trainer: state entry \"counters\" holds a value out of range (%lld at %d)",
                     (long long)tr->saved[i], i);
            return DTR_CORRUPT_FILE;
        }
    s = &tr->slots[DTR__ATOMIC_LOAD_SC(&tr->current)];
    pthread_mutex_lock(&tr->smu);
    tr->st.updates = tr->saved[0], tr->st.micro_batches = tr->saved[1], tr->st.samples_trained = tr->saved[2];
    tr->st.version = tr->saved[3], tr->acc = tr->saved[4];
    s->version = tr->saved[3];
    s->updates = tr->saved[5];
    pthread_mutex_unlock(&tr->smu);
    s->crc = dtr_crc32c(0, s->params, (size_t)tr->numel * 4);
    return DTR_OK;
}
