/* tests/test_online.c: the online trainer (dtr_trainer) and the checked, back-pressured feed.
 *   test_feed_checks        NaN features and labels outside num_classes: a push refused whole
 *                           (nothing enters, the message names the sample) or the bad samples
 *                           left out and counted; DTR_FEED_NO_CHECK lets them through
 *   test_feed_policies      a full ring: block (DTR_TIMEOUT after the timeout), drop oldest
 *                           (the newest stay), drop newest (the oldest stay, counted)
 *   test_tick_budget        10,000 ticks with budgets from 0.5 to 5 ms on a fake clock the
 *                           trainer accepts (the thread's CPU time times 16, so preemption by
 *                           other processes does not count and the test takes about 2 s of
 *                           CPU): the trainer's own record says no tick ran past budget +
 *                           max(10%, 200 us), while most of the budget was used for training;
 *                           a budget smaller than any piece of work does nothing
 *   test_reprobe            one stalled measurement (the fake clock jumps) does not stop
 *                           training for good: the estimates halve after starved ticks
 *   test_snapshot_stress    background training publishing every update while two inference
 *                           threads acquire snapshots: every snapshot's checksum matches the
 *                           one computed at its publication, versions never go back
 *   test_guard              a deliberately worse model is refused (the old version stays and
 *                           the stats say so); the good one is accepted again
 *   test_behind             the falling-behind report (samples lost, backlog) and push checks
 *   test_learning_drift     cooperative ticks on a rotating decision boundary: the served
 *                           weights' accuracy rises from chance and follows the drift
 *   test_buffers_published  a model with batch norm: a snapshot holds the running statistics
 *                           of its moment, and dtr_trainer_pull serves them
 *   test_pause_state        pause holds the background thread; the state entries restore the
 *                           published weights and counters into a fresh trainer; memory_cap
 *   test_device_model       the model on the simulated device (tests/devsim.h), the serving
 *                           model too: on the deterministic fake clock the same updates,
 *                           publications and guard verdicts as on the CPU, and the same bits
 *                           in every snapshot and in the served weights
 * DTR_TEST_QUICK=1 shrinks the workloads. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE   /* MAP_ANONYMOUS (tests/devsim.h) */
#define DTRAIN_INTERNAL_API
#include "test.h"
#include "devsim.h"
#include "posix_util.h"
#include <pthread.h>
#include <time.h>

static char g_err[512];

static int quick(void) {
    const char *q = getenv("DTR_TEST_QUICK");
    return q && q[0] && q[0] != '0';
}

/* ---- a small classifier: 2 features -> 16 tanh -> 2 classes ---- */

typedef struct tnet {
    dtr_context *ctx;
    dtr_model *m;
    dtr_linear_layer l1, l2;
} tnet;

static dtr_tensor *tnet_forward(tnet *n, dtr_context *ctx, dtr_tensor *x) {
    return dtr_linear_layer_forward(ctx, &n->l2, dtr_tanh(ctx, dtr_linear_layer_forward(ctx, &n->l1, x)));
}

static dtr_tensor *tnet_loss(void *user, dtr_context *ctx, dtr_tensor *x, dtr_tensor *y) {
    return dtr_cross_entropy(ctx, tnet_forward((tnet *)user, ctx, x), y);
}

/* the net on a context: the simulated device's (devsim 1) or the CPU's */
static dtr_context *tnet_ctx(int devsim) { return devsim ? devsim_context() : test_ctx(1); }

static void tnet_make_on(tnet *n, int devsim, uint64_t seed) {
    memset(n, 0, sizeof *n);
    n->ctx = tnet_ctx(devsim);
    if (dtr_model_create(n->ctx, seed, &n->m) != DTR_OK ||
        dtr_linear_layer_init(&n->l1, n->m, "l1", 2, 16, 1, DTR_INIT_TORCH_DEFAULT) != DTR_OK ||
        dtr_linear_layer_init(&n->l2, n->m, "l2", 16, 2, 1, DTR_INIT_TORCH_DEFAULT) != DTR_OK ||
        dtr_model_build(n->m) != DTR_OK) {
        fprintf(stderr, "tnet_make: %s\n", dtr_context_last_error(n->ctx));
        exit(2);
    }
}

static void tnet_make(tnet *n, uint64_t seed) { tnet_make_on(n, 0, seed); }

static void tnet_free(tnet *n) {
    dtr_model_destroy(n->m);
    dtr_context_destroy(n->ctx);
}

/* Samples of the boundary at angle `a`: label 1 when x . (cos a, sin a) > 0. */
static void tdata(uint32_t *s, float a, float *x, int32_t *y, int n) {
    int i;
    for (i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        x[2 * i] = (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
        *s = *s * 1664525u + 1013904223u;
        x[2 * i + 1] = (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
        y[i] = x[2 * i] * cosf(a) + x[2 * i + 1] * sinf(a) > 0;
    }
}

static dtr_trainer_config tcfg(tnet *n) {
    dtr_trainer_config c = dtr_trainer_config_init();
    c.model = n->m;
    c.loss = tnet_loss;
    c.loss_user = n;
    c.optimizer = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.02f);
    c.feed.layout.x_ndim = 1;
    c.feed.layout.x_shape[0] = 2;
    c.feed.layout.y_dtype = DTR_I32;
    c.feed.layout.num_classes = 2;
    c.batch_size = 16;
    return c;
}

static dtr_trainer *tmake(const dtr_trainer_config *c) {
    dtr_trainer *tr = NULL;
    if (dtr_trainer_create(c, &tr, g_err, sizeof g_err) != DTR_OK) fprintf(stderr, "trainer: %s\n", g_err);
    return tr;
}

/* Accuracy of the published weights on 512 samples at angle a (a serving model on its own context). */
static double served_accuracy(dtr_trainer *tr, tnet *srv, int64_t *version, float a) {
    float x[1024], out[1024];
    int32_t y[512];
    uint32_t s = 99;
    int64_t shape[2] = {512, 2};
    int i, ok = 0;
    dtr_tensor *logits;
    if (dtr_trainer_pull(tr, srv->m, version) != DTR_OK) return -1;
    tdata(&s, a, x, y, 512);
    dtr_context_set_grad_enabled(srv->ctx, 0);
    logits = tnet_forward(srv, srv->ctx, dtr_tensor_from(srv->ctx, DTR_F32, 2, shape, x));
    if (!logits || dtr_tensor_read(logits, DTR_F32, out, 1024) != DTR_OK) return -1;
    for (i = 0; i < 512; i++) ok += (out[2 * i + 1] > out[2 * i]) == (y[i] == 1);
    dtr_context_reset(srv->ctx);
    return ok / 512.0;
}

/* ---- the feed's checks and policies ---- */

static dtr_feed *tfeed(int64_t cap, dtr_feed_policy p, dtr_feed_check c) {
    dtr_feed_config fc = dtr_feed_config_init();
    dtr_feed *f = NULL;
    fc.layout.x_ndim = 1;
    fc.layout.x_shape[0] = 2;
    fc.layout.y_dtype = DTR_I32;
    fc.layout.num_classes = 3;
    fc.capacity = cap;
    fc.policy = p;
    fc.check = c;
    if (dtr_feed_create(&fc, &f, g_err, sizeof g_err) != DTR_OK) fprintf(stderr, "feed: %s\n", g_err);
    return f;
}

static void test_feed_checks(void) {
    float x[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    int32_t y[4] = {0, 1, 2, 0};
    dtr_feed *f = tfeed(16, DTR_FEED_BLOCK, DTR_FEED_REJECT_PUSH);
    dtr_feed_stats st;
    dtr_batch b;
    int64_t pushed = -1;
    if (!f) return;
    x[5] = NAN;   /* sample 2, feature 1 */
    CHECK_EQ_INT(dtr_feed_push(f, x, y, 4, 0, &pushed), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(pushed, 0);
    dtr_feed_get_stats(f, &st);
    CHECK(st.size == 0 && st.rejected_pushes == 1 && strstr(st.last_bad, "sample 2") && strstr(st.last_bad, "not finite"));
    x[5] = 5;
    y[1] = 3;   /* num_classes 3 */
    CHECK_EQ_INT(dtr_feed_push(f, x, y, 4, 0, &pushed), DTR_INVALID_ARGUMENT);
    dtr_feed_get_stats(f, &st);
    CHECK(strstr(st.last_bad, "label 3 is outside 0..2") != NULL);
    y[1] = -1;
    CHECK_EQ_INT(dtr_feed_push(f, x, y, 4, 0, &pushed), DTR_INVALID_ARGUMENT);
    dtr_feed_destroy(f);
    /* reject the sample: the others go in */
    f = tfeed(16, DTR_FEED_BLOCK, DTR_FEED_REJECT_SAMPLE);
    if (!f) return;
    x[6] = INFINITY;   /* sample 3 */
    CHECK_OK(NULL, dtr_feed_push(f, x, y, 4, 0, &pushed));
    CHECK_EQ_INT(pushed, 2);
    dtr_feed_get_stats(f, &st);
    CHECK(st.size == 2 && st.rejected == 2);
    CHECK_OK(NULL, dtr_feed_next(f, 8, 1, 0, &b));
    CHECK(b.size == 2 && ((float *)b.x)[0] == 0 && ((float *)b.x)[2] == 4 && ((int32_t *)b.y)[1] == 2);
    dtr_feed_destroy(f);
    /* no check: everything goes in */
    f = tfeed(16, DTR_FEED_BLOCK, DTR_FEED_NO_CHECK);
    if (!f) return;
    CHECK_OK(NULL, dtr_feed_push(f, x, y, 4, 0, &pushed));
    CHECK_EQ_INT(pushed, 4);
    dtr_feed_destroy(f);
}

static void test_feed_policies(void) {
    float x[20];
    int32_t y[10];
    dtr_feed *f;
    dtr_feed_stats st;
    dtr_batch b;
    int64_t pushed;
    double t0;
    int i;
    for (i = 0; i < 20; i++) x[i] = (float)i;
    for (i = 0; i < 10; i++) y[i] = i % 3;
    /* drop newest: the first 4 stay */
    f = tfeed(4, DTR_FEED_DROP_NEWEST, DTR_FEED_REJECT_PUSH);
    if (!f) return;
    CHECK_OK(NULL, dtr_feed_push(f, x, y, 10, 0, &pushed));
    CHECK_EQ_INT(pushed, 4);
    dtr_feed_get_stats(f, &st);
    CHECK(st.size == 4 && st.dropped_newest == 6 && st.dropped == 0);
    CHECK_OK(NULL, dtr_feed_next(f, 8, 1, 0, &b));
    CHECK(b.size == 4 && ((float *)b.x)[6] == 6.0f && b.indices[3] == 3);
    dtr_feed_destroy(f);
    /* drop oldest: the last 4 stay */
    f = tfeed(4, DTR_FEED_DROP_OLDEST, DTR_FEED_REJECT_PUSH);
    if (!f) return;
    CHECK_OK(NULL, dtr_feed_push(f, x, y, 10, 0, &pushed));
    CHECK_OK(NULL, dtr_feed_next(f, 8, 1, 0, &b));
    dtr_feed_get_stats(f, &st);
    CHECK(b.size == 4 && ((float *)b.x)[0] == 12.0f && st.dropped == 6);
    dtr_feed_destroy(f);
    /* block: waits the timeout, then DTR_TIMEOUT with what fitted */
    f = tfeed(4, DTR_FEED_BLOCK, DTR_FEED_REJECT_PUSH);
    if (!f) return;
    t0 = now_s();
    CHECK_EQ_INT(dtr_feed_push(f, x, y, 10, 30, &pushed), DTR_TIMEOUT);
    CHECK_MSG(now_s() - t0 >= 0.025, "returned after %.3f s", now_s() - t0);
    CHECK_EQ_INT(pushed, 4);
    dtr_feed_destroy(f);
}

/* ---- budgets ---- */

/* The fake clocks: this thread's CPU time (other processes' load does not count), 16 times
 * slower than it ran or as it ran. */
static uint64_t cpu_clock16(void *user) {
    struct timespec ts;
    (void)user;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ((uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u) * 16u;
}
static uint64_t cpu_clock(void *user) { return cpu_clock16(user) / 16u; }

/* The deterministic fake clock: virtual microseconds that advance by 1 at each reading and,
 * in the loss, by a cost model of a forward and backward over N samples, 30 + 4 N us with a
 * seeded jitter of +-10% (an evaluation pass of the guard costs the same per sample). */
static uint64_t g_vt, g_vt_spike;
static uint32_t g_vt_rng = 1;
static uint64_t fake_clock(void *user) {
    (void)user;
    return ++g_vt;
}
static dtr_tensor *tnet_loss_timed(void *user, dtr_context *ctx, dtr_tensor *x, dtr_tensor *y) {
    double cost = 30.0 + 4.0 * (double)dtr_tensor_dim(x, 0);
    g_vt_rng = g_vt_rng * 1664525u + 1013904223u;
    g_vt += (uint64_t)(cost * (0.9 + 0.2 * (double)(g_vt_rng >> 8) / 16777216.0)) + g_vt_spike;
    g_vt_spike = 0;
    return tnet_loss(user, ctx, x, y);
}

/* Ticks with budgets from 0.5 to 5 ms on `clock`; returns the trainer's stats. */
static void tick_run(dtr_trainer_clock_fn clock, dtr_trainer_loss_fn loss, int ticks, int strict, dtr_trainer_stats *st) {
    tnet n;
    dtr_trainer_config c;
    dtr_trainer *tr;
    dtr_trainer_tick_report rep;
    float x[64];
    int32_t y[32];
    uint32_t s = 7, r = 1;
    int i;
    memset(st, 0, sizeof *st);
    tnet_make(&n, 1);
    c = tcfg(&n);
    c.loss = loss;
    c.feed.capacity = 512;
    c.feed.policy = DTR_FEED_DROP_OLDEST;
    c.batch_size = 64;
    c.publish_every = 4;
    c.guard.enabled = 1;
    c.clock = clock;
    if (!(tr = tmake(&c))) return tnet_free(&n);
    for (i = 0; i < ticks; i++) {
        int64_t budget;
        r = r * 1103515245u + 12345u;
        budget = 500 + (int64_t)((r >> 8) % 4501);
        tdata(&s, 0.3f, x, y, 32);
        CHECK_OK(NULL, dtr_trainer_push(tr, x, y, 32, 0, NULL));
        CHECK_OK(NULL, dtr_trainer_tick(tr, budget, &rep));
        if (strict && rep.used_us > budget + (budget / 10 > 200 ? budget / 10 : 200))
            CHECK_MSG(0, "tick %d: used %lld us of %lld", i, (long long)rep.used_us, (long long)budget);
    }
    dtr_trainer_get_stats(tr, st);
    printf("  %lld ticks: %lld over budget + max(10%%, 200 us), worst %+lld us; used %.0f%% of the budgets; %lld of %lld "
           "samples trained, %lld updates, %lld published, %lld refused\n",
           (long long)st->ticks, (long long)st->tick_overruns, (long long)st->tick_max_over_us,
           100.0 * (double)st->tick_used_us / (double)st->tick_budget_us, (long long)st->samples_trained,
           (long long)st->feed.pushed, (long long)st->updates, (long long)st->published, (long long)st->guard_refused);
    /* a budget below every piece of work: nothing starts */
    CHECK_OK(NULL, dtr_trainer_push(tr, x, y, 32, 0, NULL));
    CHECK_OK(NULL, dtr_trainer_tick(tr, 3, &rep));
    CHECK(rep.micro_batches == 0 && rep.updates == 0 && rep.published == 0);
    dtr_trainer_destroy(tr);
    tnet_free(&n);
}

static void test_tick_budget(void) {
    dtr_trainer_stats st;
    int ticks = quick() ? 1000 : 10000;
    /* the fake clock: the trainer's logic, exactly */
    tick_run(fake_clock, tnet_loss_timed, ticks, 1, &st);
    CHECK_EQ_INT(st.ticks, ticks);
    CHECK_EQ_INT(st.tick_overruns, 0);
    CHECK(st.tick_max_over_us <= 200);
    CHECK_MSG(st.samples_trained > st.feed.pushed * 9 / 10, "trained %lld of %lld samples", (long long)st.samples_trained,
              (long long)st.feed.pushed);
    CHECK(st.updates > ticks / 10 && st.published > ticks / 100);
    /* the thread's CPU time times 16 (real work; the load of other processes does not count,
     * their effect on caches does): a few ticks may run over on a loaded machine. Under
     * sanitizers (quick) the work is ten times slower: the CPU time as it is. */
    tick_run(quick() ? cpu_clock : cpu_clock16, tnet_loss, ticks / 5, 0, &st);
    CHECK_MSG(st.tick_overruns <= st.ticks / 50, "%lld of %lld ticks ran over", (long long)st.tick_overruns,
              (long long)st.ticks);
    CHECK(st.samples_trained > st.feed.pushed * 9 / 10 && st.published > 2);
}

/* The first measurement 1000 times too slow (a stall on the fake clock) makes every estimate
 * too large for the budget: after reprobe_ticks starved ticks the estimates halve until work fits
 * again, and training goes on. */
static void test_reprobe(void) {
    tnet n;
    dtr_trainer_config c;
    dtr_trainer *tr;
    dtr_trainer_stats st;
    float x[64];
    int32_t y[32];
    uint32_t s = 9;
    int i;
    int64_t trained;
    tnet_make(&n, 9);
    c = tcfg(&n);
    c.loss = tnet_loss_timed;
    c.clock = fake_clock;
    c.feed.policy = DTR_FEED_DROP_OLDEST;
    c.reprobe_ticks = 16;
    if (!(tr = tmake(&c))) return tnet_free(&n);
    g_vt_spike = 200000;
    for (i = 0; i < 50; i++) {   /* the first measurement stalls, then nothing fits */
        tdata(&s, 0, x, y, 32);
        dtr_trainer_push(tr, x, y, 32, 0, NULL);
        CHECK_OK(NULL, dtr_trainer_tick(tr, 1000, NULL));
    }
    dtr_trainer_get_stats(tr, &st);
    trained = st.samples_trained;
    for (i = 0; i < 400; i++) {
        tdata(&s, 0, x, y, 32);
        dtr_trainer_push(tr, x, y, 32, 0, NULL);
        CHECK_OK(NULL, dtr_trainer_tick(tr, 1000, NULL));
    }
    dtr_trainer_get_stats(tr, &st);
    printf("  after the stall: %lld reprobes, %lld samples trained (%lld before), %lld overrun\n", (long long)st.reprobes,
           (long long)st.samples_trained, (long long)trained, (long long)st.tick_overruns);
    CHECK(st.reprobes >= 5 && st.tick_overruns == 1 && st.samples_trained > trained + 4000);
    dtr_trainer_destroy(tr);
    tnet_free(&n);
}

/* ---- serving while training ---- */

typedef struct reader {
    dtr_trainer *tr;
    int *stop;
    int64_t reads, bad, back, last;
} reader;

static void *reader_main(void *arg) {
    reader *rd = (reader *)arg;
    dtr_snapshot s;
    while (!__atomic_load_n(rd->stop, __ATOMIC_ACQUIRE)) {
        if (dtr_trainer_acquire(rd->tr, &s) != DTR_OK) {
            rd->bad++;
            continue;
        }
        if (dtr_crc32c(0, s.params, (size_t)s.numel * 4) != s.crc32c) rd->bad++;
        if (s.version < rd->last) rd->back++;
        rd->last = s.version;
        rd->reads++;
        dtr_trainer_release(rd->tr, &s);
    }
    return NULL;
}

static void test_snapshot_stress(void) {
    tnet n;
    dtr_trainer_config c;
    dtr_trainer *tr;
    dtr_trainer_stats st;
    reader rd[2];
    pthread_t th[2];
    int stop = 0;
    float x[64];
    int32_t y[32];
    uint32_t s = 3;
    double t0;
    int i;
    tnet_make(&n, 2);
    c = tcfg(&n);
    c.publish_every = 1;
    c.batch_size = 8;
    c.snapshots = 4;
    c.feed.policy = DTR_FEED_DROP_OLDEST;
    if (!(tr = tmake(&c))) return tnet_free(&n);
    CHECK_OK(NULL, dtr_trainer_start(tr));
    CHECK_EQ_INT(dtr_trainer_tick(tr, 1000, NULL), DTR_BAD_STATE);
    for (i = 0; i < 2; i++) {
        memset(&rd[i], 0, sizeof rd[i]);
        rd[i].tr = tr;
        rd[i].stop = &stop;
        pthread_create(&th[i], NULL, reader_main, &rd[i]);
    }
    t0 = now_s();
    while (now_s() - t0 < (quick() ? 0.3 : 1.0)) {
        tdata(&s, 1.0f, x, y, 32);
        dtr_trainer_push(tr, x, y, 32, 0, NULL);
        sleep_ms(1);
    }
    __atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
    for (i = 0; i < 2; i++) pthread_join(th[i], NULL);
    CHECK_OK(NULL, dtr_trainer_stop(tr));
    dtr_trainer_get_stats(tr, &st);
    printf("  %lld + %lld snapshots read while %lld versions were published (%lld put off: buffers held)\n",
           (long long)rd[0].reads, (long long)rd[1].reads, (long long)st.published, (long long)st.publish_busy);
    for (i = 0; i < 2; i++) {
        CHECK_EQ_INT(rd[i].bad, 0);
        CHECK_EQ_INT(rd[i].back, 0);
        CHECK(rd[i].reads > 100);
    }
    CHECK(st.published > 20 && st.samples_trained > 200);
    dtr_trainer_destroy(tr);
    tnet_free(&n);
}

/* ---- the guard ---- */

static void test_guard(void) {
    tnet n;
    dtr_trainer_config c;
    dtr_trainer *tr;
    dtr_trainer_stats st;
    dtr_trainer_tick_report rep;
    dtr_snapshot snap;
    float x[128], keep[4096];
    int32_t y[64];
    uint32_t s = 5;
    int64_t i, numel, v;
    tnet_make(&n, 3);
    c = tcfg(&n);
    c.guard.enabled = 1;
    c.guard.holdout_every = 4;
    c.publish_every = -1;   /* on demand only */
    if (!(tr = tmake(&c))) return tnet_free(&n);
    for (i = 0; i < 60; i++) {
        tdata(&s, 0.5f, x, y, 64);
        CHECK_OK(NULL, dtr_trainer_push(tr, x, y, 64, 0, NULL));
        CHECK_OK(NULL, dtr_trainer_tick(tr, 100000, NULL));
    }
    dtr_trainer_get_stats(tr, &st);
    CHECK(st.holdout > 100 && st.updates > 100);
    CHECK_OK(NULL, dtr_trainer_publish(tr));
    CHECK_OK(NULL, dtr_trainer_tick(tr, 100000, &rep));
    dtr_trainer_get_stats(tr, &st);
    CHECK(rep.published == 1 && st.version == 2 && st.guard_new_loss < st.guard_old_loss);
    /* a deliberately worse model: the trained weights negated (the classes swap) */
    numel = dtr_model_numel(n.m);
    memcpy(keep, dtr_model_params(n.m), (size_t)numel * 4);
    for (i = 0; i < numel; i++) dtr_model_params(n.m)[i] = -dtr_model_params(n.m)[i];
    CHECK_OK(NULL, dtr_trainer_publish(tr));
    CHECK_OK(NULL, dtr_trainer_tick(tr, 100000, &rep));
    dtr_trainer_get_stats(tr, &st);
    CHECK_EQ_INT(rep.published, -1);
    CHECK(st.version == 2 && st.guard_refused == 1 && st.guard_new_loss > st.guard_old_loss);
    CHECK_OK(NULL, dtr_trainer_acquire(tr, &snap));
    CHECK(snap.version == 2 && memcmp(snap.params, keep, (size_t)numel * 4) == 0);
    dtr_trainer_release(tr, &snap);
    /* the good weights again: accepted (no worse than themselves) */
    memcpy(dtr_model_params(n.m), keep, (size_t)numel * 4);
    CHECK_OK(NULL, dtr_trainer_publish(tr));
    CHECK_OK(NULL, dtr_trainer_tick(tr, 100000, &rep));
    v = 0;
    dtr_trainer_get_stats(tr, &st);
    CHECK(rep.published == 1 && st.version == 3);
    CHECK_OK(NULL, dtr_trainer_acquire(tr, &snap));
    v = snap.version;
    CHECK(v == 3 && snap.crc32c == dtr_crc32c(0, keep, (size_t)numel * 4) && snap.holdout_loss == st.guard_new_loss);
    dtr_trainer_release(tr, &snap);
    dtr_trainer_destroy(tr);
    tnet_free(&n);
}

/* The guard's held-out loss drives a plateau schedule: on labels no model can learn (a coin
 * flip) the loss stops improving and the rate drops; each guarded publication is one report. */
static void test_guard_plateau(void) {
    tnet n;
    dtr_trainer_config c;
    dtr_trainer *tr;
    dtr_trainer_stats st;
    dtr_metric_stats ms;
    float x[128];
    int32_t y[64];
    uint32_t s = 11, coin = 77;
    int64_t i, k;
    tnet_make(&n, 4);
    c = tcfg(&n);
    c.guard.enabled = 1;
    c.guard.holdout_every = 4;
    c.guard.tolerance = 1.0f;   /* publish anyway: the reports are what this test is about */
    c.publish_every = 4;
    c.optimizer.schedule.kind = DTR_SCHED_PLATEAU;
    c.optimizer.schedule.gamma = 0.5f, c.optimizer.schedule.step_size = 1, c.optimizer.schedule.threshold = 0.01f;
    if (!(tr = tmake(&c))) return tnet_free(&n);
    for (i = 0; i < 60; i++) {
        tdata(&s, 0.5f, x, y, 64);
        for (k = 0; k < 64; k++) coin = coin * 1664525u + 1013904223u, y[k] = (int32_t)(coin >> 31);
        CHECK_OK(NULL, dtr_trainer_push(tr, x, y, 64, 0, NULL));
        CHECK_OK(NULL, dtr_trainer_tick(tr, 100000, NULL));
    }
    dtr_trainer_get_stats(tr, &st);
    CHECK_OK(NULL, dtr_optimizer_metric_stats(dtr_trainer_optimizer(tr), &ms));
    CHECK_MSG(ms.reports == st.published - 1 + st.guard_refused && ms.reports >= 10, "%lld reports, %lld publications",
              (long long)ms.reports, (long long)st.published);
    CHECK_MSG(ms.drops >= 1 && dtr_optimizer_lr(dtr_trainer_optimizer(tr)) < 0.02f * 0.75f, "%lld drops, lr %g", (long long)ms.drops,
              (double)dtr_optimizer_lr(dtr_trainer_optimizer(tr)));
    dtr_trainer_destroy(tr);
    tnet_free(&n);
}

/* ---- falling behind, pushes ---- */

static void test_behind(void) {
    tnet n;
    dtr_trainer_config c;
    dtr_trainer *tr;
    dtr_trainer_stats st;
    float x[512];
    int32_t y[256];
    uint32_t s = 11;
    int64_t pushed;
    tnet_make(&n, 4);
    c = tcfg(&n);
    c.feed.capacity = 64;
    c.feed.policy = DTR_FEED_DROP_OLDEST;
    if (!(tr = tmake(&c))) return tnet_free(&n);
    tdata(&s, 0, x, y, 256);
    CHECK_OK(NULL, dtr_trainer_push(tr, x, y, 256, 0, &pushed));
    dtr_trainer_get_stats(tr, &st);
    CHECK(st.behind == 1 && st.feed.dropped == 192 && st.feed.size == 64);
    CHECK_MSG(strstr(st.report, "192 samples lost") != NULL, "report: %s", st.report);
    /* trained down below the backlog mark and nothing lost since: not behind (a piece of work
     * that never ran, the first update here, starts only as the first piece of a tick) */
    for (pushed = 0; pushed < 10; pushed++) CHECK_OK(NULL, dtr_trainer_tick(tr, 1000000, NULL));
    dtr_trainer_get_stats(tr, &st);
    CHECK_MSG(st.behind == 0 && st.report[0] == 0 && st.samples_trained == 64, "%d %lld %s", st.behind,
              (long long)st.samples_trained, st.report);
    /* a bad sample refuses the push, naming it */
    y[3] = 7;
    CHECK_EQ_INT(dtr_trainer_push(tr, x, y, 8, 0, &pushed), DTR_INVALID_ARGUMENT);
    dtr_trainer_get_stats(tr, &st);
    CHECK(strstr(st.feed.last_bad, "sample 3") != NULL && st.feed.rejected_pushes == 1);
    dtr_trainer_destroy(tr);
    tnet_free(&n);
}

/* ---- learning ---- */

static void test_learning_drift(void) {
    tnet n, srv;
    dtr_trainer_config c;
    dtr_trainer *tr;
    float x[64];
    int32_t y[32];
    uint32_t s = 13;
    int64_t version = 0;
    double acc0, acc[4] = {0};
    int frame, frames = 1200;
    tnet_make(&n, 5);
    tnet_make(&srv, 6);
    c = tcfg(&n);
    c.guard.enabled = 1;
    c.publish_every = 5;
    c.feed.policy = DTR_FEED_DROP_OLDEST;
    c.clock = cpu_clock;   /* 2 ms of this thread's CPU per frame, whatever the machine's load */
    if (!(tr = tmake(&c))) goto done;
    acc0 = served_accuracy(tr, &srv, &version, 0);
    for (frame = 0; frame < frames; frame++) {
        float a = 1.5f * (float)frame / (float)frames;   /* the boundary turns 86 degrees */
        tdata(&s, a, x, y, 8);
        CHECK_OK(NULL, dtr_trainer_push(tr, x, y, 8, 0, NULL));
        CHECK_OK(NULL, dtr_trainer_tick(tr, quick() ? 20000 : 2000, NULL));   /* sanitizers: 10x slower */
        if (frame % 300 == 299) acc[frame / 300] = served_accuracy(tr, &srv, &version, a);
    }
    printf("  served accuracy: %.2f before training, then %.2f %.2f %.2f %.2f as the boundary turns\n", acc0, acc[0],
           acc[1], acc[2], acc[3]);
    CHECK(acc[0] > 0.8 && acc[3] > 0.85 && acc[3] > acc0 + 0.2);
    CHECK(acc[1] > 0.8 && acc[2] > 0.8);
    dtr_trainer_destroy(tr);
done:
    tnet_free(&n);
    tnet_free(&srv);
}

/* ---- a model with batch norm: its running statistics travel with the snapshots ---- */

typedef struct bnnet { dtr_context *ctx; dtr_model *m; dtr_linear_layer l1, l2; dtr_batchnorm_layer bn; } bnnet;

/* x (B, 2) normalised as (B, 1, 2): one channel of 2 values a sample, so that micro-batches of
   one sample have statistics too; then 2 -> 16 tanh -> 2 */
static dtr_tensor *bnnet_loss(void *user, dtr_context *ctx, dtr_tensor *x, dtr_tensor *y) {
    bnnet *n = (bnnet *)user;
    int64_t b = dtr_tensor_dim(x, 0), s3[3] = {b, 1, 2}, s2[2] = {b, 2};
    dtr_tensor *h = dtr_reshape(ctx, dtr_batchnorm_layer_forward(ctx, &n->bn, dtr_reshape(ctx, x, 3, s3)), 2, s2);
    return dtr_cross_entropy(ctx, dtr_linear_layer_forward(ctx, &n->l2, dtr_tanh(ctx, dtr_linear_layer_forward(ctx, &n->l1, h))), y);
}

static int bnnet_make(bnnet *n, uint64_t seed) {
    memset(n, 0, sizeof *n);
    n->ctx = test_ctx(1);
    return dtr_model_create(n->ctx, seed, &n->m) == DTR_OK &&
           dtr_linear_layer_init(&n->l1, n->m, "l1", 2, 16, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
           dtr_batchnorm_layer_init(&n->bn, n->m, "bn", 1) == DTR_OK &&
           dtr_linear_layer_init(&n->l2, n->m, "l2", 16, 2, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK && dtr_model_build(n->m) == DTR_OK;
}

static void test_buffers_published(void) {
    bnnet n, srv;
    dtr_trainer_config c = dtr_trainer_config_init();
    dtr_trainer *tr = NULL;
    dtr_snapshot snap;
    float x[64], live[32], served[32];
    int32_t y[32];
    uint32_t s = 21;
    int64_t version = 0;
    int k;
    CHECK(bnnet_make(&n, 5) && bnnet_make(&srv, 6));
    c.model = n.m;
    c.loss = bnnet_loss;
    c.loss_user = &n;
    c.optimizer = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.02f);
    c.feed.layout.x_ndim = 1, c.feed.layout.x_shape[0] = 2;
    c.feed.layout.y_dtype = DTR_I32, c.feed.layout.num_classes = 2;
    c.batch_size = 16;
    if (!(tr = tmake(&c))) goto done;
    for (k = 0; k < 8; k++) {
        tdata(&s, 0.3f, x, y, 16);
        CHECK_OK(NULL, dtr_trainer_push(tr, x, y, 16, 0, NULL));
        CHECK_OK(NULL, dtr_trainer_tick(tr, 1000000, NULL));
    }
    CHECK_OK(NULL, dtr_trainer_publish(tr));
    CHECK_OK(NULL, dtr_trainer_tick(tr, 1000000, NULL));
    CHECK_OK(n.ctx, dtr_model_read_buffers(n.m, live, 32));
    CHECK_OK(NULL, dtr_trainer_acquire(tr, &snap));
    CHECK(snap.buffer_numel == 32 && snap.version > 1 && memcmp(snap.buffers, live, sizeof live) == 0);
    dtr_trainer_release(tr, &snap);
    CHECK(live[0] != 0.0f && live[16] != 1.0f);   /* running mean and variance moved */
    CHECK_OK(NULL, dtr_trainer_pull(tr, srv.m, &version));
    CHECK_OK(srv.ctx, dtr_model_read_buffers(srv.m, served, 32));
    CHECK(memcmp(served, live, sizeof live) == 0);
    dtr_trainer_destroy(tr);
done:
    dtr_model_destroy(n.m), dtr_context_destroy(n.ctx);
    dtr_model_destroy(srv.m), dtr_context_destroy(srv.ctx);
}

/* ---- pause, state, memory ---- */

static void test_pause_state(void) {
    tnet n, n2;
    dtr_trainer_config c;
    dtr_trainer *tr, *tr2;
    dtr_trainer_stats st, st2;
    dtr_state_entry e, e2;
    dtr_snapshot a, b;
    float x[256];
    int32_t y[128];
    uint32_t s = 17;
    int i;
    tnet_make(&n, 7);
    tnet_make(&n2, 8);
    c = tcfg(&n);
    c.background.cpu_share = 0.5f;
    c.background.nice = 5;
    c.background.max_threads = 1;
    if (!(tr = tmake(&c))) goto done;
    CHECK_OK(NULL, dtr_trainer_start(tr));
    CHECK_EQ_INT(dtr_trainer_start(tr), DTR_BAD_STATE);
    CHECK_OK(NULL, dtr_trainer_pause(tr, 1));
    sleep_ms(20);
    dtr_trainer_get_stats(tr, &st);
    tdata(&s, 0, x, y, 128);
    dtr_trainer_push(tr, x, y, 128, 0, NULL);
    sleep_ms(50);
    dtr_trainer_get_stats(tr, &st2);
    CHECK(st2.samples_trained == st.samples_trained);
    CHECK_OK(NULL, dtr_trainer_pause(tr, 0));
    for (i = 0; i < 200 && st2.samples_trained < 128; i++) {
        sleep_ms(5);
        dtr_trainer_get_stats(tr, &st2);
    }
    CHECK_EQ_INT(st2.samples_trained, 128);
    CHECK_OK(NULL, dtr_trainer_publish(tr));
    for (i = 0; i < 200 && st2.version < 2; i++) {
        sleep_ms(5);
        dtr_trainer_get_stats(tr, &st2);
    }
    CHECK_OK(NULL, dtr_trainer_stop(tr));
    /* state: copy every entry into a fresh trainer */
    c = tcfg(&n2);
    if (!(tr2 = tmake(&c))) goto done1;
    for (i = 0; dtr_trainer_state(tr, i, &e) == DTR_OK; i++) {
        CHECK_OK(NULL, dtr_trainer_state(tr2, i, &e2));
        CHECK(e.bytes == e2.bytes && strcmp(e.name, e2.name) == 0);
        memcpy(e2.data, e.data, e.bytes);
    }
    CHECK_EQ_INT(i, 2);
    CHECK_OK(NULL, dtr_trainer_state_loaded(tr2));
    CHECK_OK(NULL, dtr_trainer_acquire(tr, &a));
    CHECK_OK(NULL, dtr_trainer_acquire(tr2, &b));
    CHECK(a.version == b.version && a.version >= 2 && a.crc32c == b.crc32c && a.updates == b.updates);
    dtr_trainer_release(tr, &a);
    dtr_trainer_release(tr2, &b);
    dtr_trainer_get_stats(tr2, &st);
    CHECK(st.samples_trained == 128 && st.updates == st2.updates);
    dtr_trainer_state(tr2, 0, &e2);
    ((int64_t *)e2.data)[0] = -1;
    CHECK_EQ_INT(dtr_trainer_state_loaded(tr2), DTR_CORRUPT_FILE);
    dtr_trainer_destroy(tr2);
done1:
    dtr_trainer_destroy(tr);
    /* memory cap and config checks */
    c = tcfg(&n2);
    c.memory_cap = 4096;
    tr2 = NULL;
    CHECK_EQ_INT(dtr_trainer_create(&c, &tr2, g_err, sizeof g_err), DTR_OUT_OF_MEMORY);
    CHECK(tr2 == NULL && strstr(g_err, "memory_cap") != NULL);
    c = tcfg(&n2);
    c.snapshots = 1;
    CHECK_EQ_INT(dtr_trainer_create(&c, &tr2, g_err, sizeof g_err), DTR_INVALID_ARGUMENT);
    c = tcfg(&n2);
    c.loss = NULL;
    CHECK_EQ_INT(dtr_trainer_create(&c, &tr2, g_err, sizeof g_err), DTR_NULL_HANDLE);
done:
    tnet_free(&n);
    tnet_free(&n2);
}

/* One deterministic run (the fake clock, the timed loss): 40 ticks with the guard and a
   publication every 4 updates; the stats, the last snapshot and the served weights out. */
typedef struct dev_run { dtr_trainer_stats st; float snap[128], served[32]; int64_t numel; } dev_run;

static void device_run(int devsim, dev_run *o) {
    tnet n, srv;
    dtr_trainer_config c;
    dtr_trainer *tr;
    dtr_snapshot snap;
    float x[64];
    int32_t y[32];
    uint32_t s = 11;
    int64_t version = 0;
    int i;
    memset(o, 0, sizeof *o);
    g_vt = 0, g_vt_rng = 1, g_vt_spike = 0;
    tnet_make_on(&n, devsim, 4);
    tnet_make_on(&srv, devsim, 99);
    c = tcfg(&n);
    c.loss = tnet_loss_timed;
    c.clock = fake_clock;
    c.batch_size = 24;   /* micro-batches of the ticks' samples: the gradient rescaled to the mean */
    c.publish_every = 4;
    c.guard.enabled = 1;
    if (!(tr = tmake(&c))) return tnet_free(&n), tnet_free(&srv);
    for (i = 0; i < 40; i++) {
        tdata(&s, 0.7f, x, y, 32);
        CHECK_OK(NULL, dtr_trainer_push(tr, x, y, 32, 0, NULL));
        CHECK_OK(NULL, dtr_trainer_tick(tr, 1500, NULL));
    }
    dtr_trainer_get_stats(tr, &o->st);
    o->numel = dtr_model_numel(n.m);
    CHECK(o->numel <= 128);
    CHECK_OK(NULL, dtr_trainer_acquire(tr, &snap));
    memcpy(o->snap, snap.params, (size_t)(o->numel <= 128 ? o->numel : 128) * sizeof(float));
    CHECK(snap.crc32c == dtr_crc32c(0, snap.params, (size_t)o->numel * 4));
    dtr_trainer_release(tr, &snap);
    CHECK_OK(srv.ctx, dtr_trainer_pull(tr, srv.m, &version));
    CHECK_OK(srv.ctx, dtr_tensor_read(dtr_model_param_at(srv.m, 0), DTR_F32, o->served, 32));
    dtr_trainer_destroy(tr);
    tnet_free(&n);
    tnet_free(&srv);
}

static void test_device_model(void) {
    dev_run cpu, dev;
    device_run(0, &cpu);
    device_run(1, &dev);
    CHECK_MSG(cpu.st.updates > 5 && cpu.st.published > 1, "%lld updates, %lld published", (long long)cpu.st.updates,
              (long long)cpu.st.published);
    CHECK_MSG(dev.st.updates == cpu.st.updates && dev.st.published == cpu.st.published &&
                  dev.st.guard_refused == cpu.st.guard_refused && dev.st.samples_trained == cpu.st.samples_trained,
              "device: %lld updates %lld published %lld refused; CPU: %lld %lld %lld", (long long)dev.st.updates,
              (long long)dev.st.published, (long long)dev.st.guard_refused, (long long)cpu.st.updates,
              (long long)cpu.st.published, (long long)cpu.st.guard_refused);
    CHECK(memcmp(dev.snap, cpu.snap, sizeof cpu.snap) == 0);
    CHECK(memcmp(dev.served, cpu.served, sizeof cpu.served) == 0);
    CHECK(memcmp(cpu.served, cpu.snap, sizeof cpu.served) == 0);   /* l1.weight: the buffer's first 32 floats */
    CHECK_EQ_INT(devsim__violations, 0);
}

int main(void) {
    RUN(test_feed_checks);
    RUN(test_feed_policies);
    RUN(test_tick_budget);
    RUN(test_reprobe);
    RUN(test_snapshot_stress);
    RUN(test_guard);
    RUN(test_guard_plateau);
    RUN(test_behind);
    RUN(test_learning_drift);
    RUN(test_buffers_published);
    RUN(test_pause_state);
    RUN(test_device_model);
    return test_summary();
}
