/* The gradient-ready hook of autograd and the data-parallel engine (dtr_dp), with ranks as
 * threads over the local transport.
 *
 *   test_grad_ready_hook   each parameter is reported once, after the last node that writes
 *                          its gradient (its gradient at report time is the final one, also
 *                          for a weight used twice and for a branch outside the loss),
 *                          parameters off the tape are not reported, gradients are the same
 *                          bits with and without the hook, an error from the hook stops
 *                          dtr_backward
 *   test_dp_equivalence    N = 2 and 4 ranks with per-rank batch b give the same weights as
 *                          1 rank with batch N*b after 50 SGD steps (relative error <= 1e-5),
 *                          with many small buckets (started during backward) and with one;
 *                          all ranks hold the same bits
 *   test_dp_bf16           bf16 activations: 2 ranks end where 1 rank with the whole batch and
 *                          bf16 activations does (the engine reduces f32 gradients as ever)
 *   test_dp_no_sync        gradient accumulation: no communication in no_sync steps (the
 *                          ranks' gradients differ), same weights as 1 rank with the whole
 *                          batch; dtr_dp_set_no_sync with buckets in flight is refused
 *   test_dp_broadcast      different initial weights: rank 0's win at dtr_dp_create
 *   test_dp_frozen         l1 frozen on 2 ranks: the 1-rank result, l1 untouched, no hang
 *   test_dp_unused         a parameter some steps' backward reaches on one rank, on both or on
 *                          none: with find_unused the ranks leave it out where none reached it
 *                          and end where one process with the averaged loss does; by default
 *                          every replica updates it
 *   test_dp_average_buffers  3 ranks' different batch-norm statistics averaged on every rank
 *   test_dp_report_metric  3 ranks' validation losses, weighted by their sample counts: every
 *                          rank's plateau schedule drops where one fed the means does
 *   test_dp_single         a group of 1: no hook, identical bits to plain training
 *   test_dp_fault          a rank stops: dtr_dp_finish on the other fails within the deadline
 *                          naming it */
#define _POSIX_C_SOURCE 200809L
#define DTRAIN_INTERNAL_API
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#include "test.h"
#include "posix_util.h"

#include "dp_mlp.h"

/* ---- the hook ---- */

typedef struct hook_log {
    int n;
    int order[16];
    float *grads[16];   /* copy of the gradient when reported */
    int fail_at;        /* return an error at this report (-1 never) */
    int bad_event;      /* reports whose event was not a completed one */
} hook_log;

static dtr_result hook(void *user, dtr_tensor *p, dtr_event *ready) {
    hook_log *h = (hook_log *)user;
    int64_t n = dtr_tensor_numel(p);
    int done = 0;
    if (h->n == h->fail_at) return DTR_INVALID_ARGUMENT;
    /* the CPU backend's gradients are written when reported: the event is complete */
    if (ready != NULL || dtr_event_query(p->ctx, ready, &done) != DTR_OK || !done) h->bad_event++;
    if (h->n < 16) {
        h->order[h->n] = p->param_index;
        h->grads[h->n] = (float *)malloc((size_t)(n ? n : 1) * sizeof(float));
        memcpy(h->grads[h->n], dtr_tensor_grad(p), (size_t)n * sizeof(float));
    }
    h->n++;
    return DTR_OK;
}

/* y = l2(relu(l1 x)) + x W2-shaped reuse: w2 feeds two nodes; an extra branch (u) outside the
   loss; "unused" never appears on the tape */
static dtr_result hook_graph(dtr_context *ctx, dtr_model *m, dtr_tensor **p) {
    int64_t xs[2] = {3, 4};
    float x[12];
    dtr_tensor *xt, *h, *y, *y2, *side;
    int i;
    for (i = 0; i < 12; i++) x[i] = 0.1f * (float)(i - 5);
    xt = dtr_tensor_from(ctx, DTR_F32, 2, xs, x);
    h = dtr_relu(ctx, dtr_linear(ctx, xt, p[0], p[1]));          /* (3, 6) */
    y = dtr_linear(ctx, h, p[2], p[3]);                           /* (3, 2) */
    y2 = dtr_linear(ctx, dtr_tanh(ctx, h), p[2], NULL);           /* w2 used again */
    side = dtr_linear(ctx, xt, p[4], NULL);                       /* not in the loss */
    (void)side;
    (void)m;
    return dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, dtr_add(ctx, y, y2), dtr_add(ctx, y, y2))));
}

static void t_grad_ready_hook(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_tensor *p[6];
    int64_t s1[2] = {6, 4}, s2[1] = {6}, s3[2] = {2, 6}, s4[1] = {2}, s5[2] = {3, 4}, s6[1] = {5};
    float *plain;
    hook_log h;
    int64_t total;
    int i, k, seen[6] = {0, 0, 0, 0, 0, 0}, hook_id = 0;
    CHECK_OK(ctx, dtr_model_create(ctx, 3, &m));
    p[0] = dtr_model_param(m, "w1", 2, s1, DTR_INIT_NORMAL, 0.5f);
    p[1] = dtr_model_param(m, "b1", 1, s2, DTR_INIT_NORMAL, 0.5f);
    p[2] = dtr_model_param(m, "w2", 2, s3, DTR_INIT_NORMAL, 0.5f);
    p[3] = dtr_model_param(m, "b2", 1, s4, DTR_INIT_NORMAL, 0.5f);
    p[4] = dtr_model_param(m, "u", 2, s5, DTR_INIT_NORMAL, 0.5f);
    p[5] = dtr_model_param(m, "unused", 1, s6, DTR_INIT_NORMAL, 0.5f);
    CHECK_OK(ctx, dtr_model_build(m));
    total = dtr_model_numel(m);
    /* without the hook */
    CHECK_OK(ctx, hook_graph(ctx, m, p));
    plain = (float *)malloc((size_t)total * sizeof(float));
    memcpy(plain, dtr_model_grads(m), (size_t)total * sizeof(float));
    dtr_context_reset(ctx);
    dtr_model_zero_grad(m);
    /* with it */
    memset(&h, 0, sizeof h);
    h.fail_at = -1;
    CHECK_OK(ctx, dtr_context_add_grad_hook(ctx, hook, &h, &hook_id));
    CHECK_OK(ctx, hook_graph(ctx, m, p));
    CHECK(memcmp(plain, dtr_model_grads(m), (size_t)total * sizeof(float)) == 0);
    CHECK_EQ_INT(h.n, 5);   /* w1 b1 w2 b2 u; not "unused" */
    CHECK_EQ_INT(h.bad_event, 0);
    for (i = 0; i < h.n && i < 16; i++) {
        int idx = h.order[i];
        CHECK(idx >= 0 && idx < 5);
        if (idx < 0 || idx >= 5) continue;
        seen[idx]++;
        /* the gradient was final when reported */
        CHECK_MSG(memcmp(h.grads[i], dtr_tensor_grad(p[idx]), (size_t)dtr_tensor_numel(p[idx]) * sizeof(float)) == 0,
                  "parameter %s reported before its last writer", dtr_tensor_name(p[idx]));
        free(h.grads[i]);
    }
    for (k = 0; k < 5; k++) CHECK_EQ_INT(seen[k], 1);
    /* u (outside the loss) has a zero gradient and was reported; w1/b1 come after w2/b2 */
    for (i = 0; i < h.n && i < 16; i++) {
        if (h.order[i] == 0) { for (k = i + 1; k < h.n; k++) CHECK(h.order[k] != 2 && h.order[k] != 3); }
    }
    /* an error from the hook stops backward with that error */
    dtr_context_reset(ctx);
    dtr_model_zero_grad(m);
    memset(&h, 0, sizeof h);
    h.fail_at = 1;
    CHECK_EQ_INT(hook_graph(ctx, m, p), DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_context_last_error(ctx), "gradient hook") != NULL);
    for (i = 0; i < h.n && i < 16; i++) free(h.grads[i]);
    dtr_context_clear_error(ctx);
    CHECK_OK(ctx, dtr_context_remove_grad_hook(ctx, hook_id));
    free(plain);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* ---- data parallel over rank threads ---- */

/* a context of one thread computing in `act` */
static dtr_context *act_ctx(dtr_dtype act) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    cc.threads = 1;
    cc.activation_dtype = act;
    return dtr_context_create(&cc, &ctx) == DTR_OK ? ctx : NULL;
}

typedef struct dp_job {
    int world, b, steps, accum;
    size_t bucket_bytes;
    int timeout_ms;
    int stop_rank, stop_after;   /* fault test: this rank sleeps after that many steps */
    int seed_by_rank;            /* different initial weights per rank */
    dtr_dtype act;               /* the ranks' activation_dtype */
    int freeze_l1;               /* l1 frozen (dtr_model_set_trainable) on every rank */
    int thaw_at;                 /* with freeze_l1: l1 trainable again from this step (0: never) */
    dtr_local_world *w;
    /* results */
    float *params[8];
    int64_t numel;
    int buckets, overlapped, fails;
    int64_t bucket_lo;           /* rank 0: the lowest float of any bucket, after the last step */
    uint64_t wire_bytes;         /* rank 0: dtr_dp_stats' */
    dtr_result result[8];
    double secs[8];
    int failed_rank[8];
    char msg[8][512];
    int grads_differ;            /* no_sync: rank 0 and 1 gradients differed after a local step */
    float *grad_copy[8];
    int refused;                 /* set_no_sync in flight was refused */
} dp_job;

typedef struct dp_rank { dp_job *job; int rank; } dp_rank;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_barrier_t g_bar;

static void *dp_rank_main(void *arg) {
    dp_rank *dr = (dp_rank *)arg;
    dp_job *j = dr->job;
    int rank = dr->rank, t;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_comm *c = NULL;
    dtr_dp *dp = NULL;
    dtr_result r = DTR_OK;
    char err[256];
    mlp n;
    double t0;
    cfg.local.world = j->w;
    cfg.local.rank = rank;
    cfg.timeout_ms = j->timeout_ms;
    if (dtr_comm_create(&cfg, &c, err, sizeof err) != DTR_OK ||
        !mlp_init_on(&n, act_ctx(j->act), j->seed_by_rank ? 100 + (uint64_t)rank : 7, j->accum)) {
        pthread_mutex_lock(&g_mu); j->fails++; pthread_mutex_unlock(&g_mu);
        return NULL;
    }
    dc.bucket_bytes = j->bucket_bytes;
    if (j->freeze_l1) {
        const char *l1[1] = {"l1."};
        r = dtr_model_set_trainable(n.m, l1, 1, 0);
    }
    if (r == DTR_OK) r = dtr_dp_create(n.m, c, &dc, &dp);
    t0 = now_s();
    for (t = 0; t < j->steps && r == DTR_OK; t++) {
        int a;
        if (rank == j->stop_rank && t == j->stop_after) {
            struct timespec ts = {2, 0};
            nanosleep(&ts, NULL);   /* stops answering past the others' deadline */
            r = DTR_PEER_FAILED;
            break;
        }
        t0 = now_s();
        if (j->freeze_l1 && j->thaw_at > 0 && t == j->thaw_at) {
            const char *l1[1] = {"l1."};
            r = dtr_model_set_trainable(n.m, l1, 1, 1);
        }
        for (a = 0; a < j->accum && r == DTR_OK; a++) {
            int last = a == j->accum - 1;
            /* micro-batch a of rank r: rows (a * world + rank) * b of step t */
            if ((r = dtr_dp_set_no_sync(dp, !last)) != DTR_OK) break;
            if ((r = mlp_backward(&n, t, ((int64_t)a * j->world + rank) * j->b, j->b)) != DTR_OK) break;
            if (!last && t == 0 && j->world > 1 && rank < 2) {   /* local gradients, to compare across ranks */
                j->grad_copy[rank] = (float *)malloc((size_t)dtr_model_numel(n.m) * sizeof(float));
                memcpy(j->grad_copy[rank], dtr_model_grads(n.m), (size_t)dtr_model_numel(n.m) * sizeof(float));
            }
            if (last && t == 0 && j->accum > 1 && dtr_dp_bucket_count(dp) > 0) {
                int refused = dtr_dp_set_no_sync(dp, 1) == DTR_BAD_STATE;
                if (rank == 0) j->refused += refused;
            }
            if ((r = dtr_dp_finish(dp)) != DTR_OK) break;
            if ((r = dtr_optimizer_step(n.opt, NULL)) != DTR_OK) break;
            dtr_context_reset(n.ctx);
        }
    }
    j->secs[rank] = now_s() - t0;
    j->result[rank] = r;
    j->failed_rank[rank] = dtr_comm_failed_rank(c);
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s | %s", dtr_comm_last_error(c), dtr_context_last_error(n.ctx));
    j->params[rank] = (float *)malloc((size_t)dtr_model_numel(n.m) * sizeof(float));
    memcpy(j->params[rank], dtr_model_params(n.m), (size_t)dtr_model_numel(n.m) * sizeof(float));
    if (rank == 0) {
        j->numel = dtr_model_numel(n.m);
        j->buckets = dtr_dp_bucket_count(dp);
        j->overlapped = dtr_dp_overlapped_buckets(dp);
        j->bucket_lo = j->numel;
        for (t = 0; t < j->buckets; t++) {
            int64_t b = 0, e = 0;
            dtr_dp_bucket_range(dp, t, &b, &e);
            if (b < j->bucket_lo) j->bucket_lo = b;
        }
        if (dp) {
            dtr_dp_stats st;
            dtr_dp_get_stats(dp, &st);
            j->wire_bytes = st.wire_bytes;
        }
    }
    if (j->stop_rank < 0) pthread_barrier_wait(&g_bar);   /* nobody leaves while others still run */
    dtr_dp_destroy(dp);
    dtr_comm_destroy(c);
    mlp_free(&n);
    return NULL;
}

static void dp_run(dp_job *j) {
    pthread_t tid[8];
    dp_rank dr[8];
    int i;
    dtr_local_world_create(j->world, NULL, &j->w);
    pthread_barrier_init(&g_bar, NULL, (unsigned)j->world);
    for (i = 0; i < j->world; i++) {
        dr[i].job = j;
        dr[i].rank = i;
        pthread_create(&tid[i], NULL, dp_rank_main, &dr[i]);
    }
    for (i = 0; i < j->world; i++) pthread_join(tid[i], NULL);
    pthread_barrier_destroy(&g_bar);
    dtr_local_world_destroy(j->w);
}

static void dp_free(dp_job *j) {
    int i;
    for (i = 0; i < 8; i++) { free(j->params[i]); free(j->grad_copy[i]); }
}

static dp_job dp_job_init(int world, int b, int steps) {
    dp_job j;
    memset(&j, 0, sizeof j);
    j.world = world;
    j.b = b;
    j.steps = steps;
    j.accum = 1;
    j.timeout_ms = 20000;
    j.stop_rank = -1;
    return j;
}

static void t_dp_equivalence(void) {
    int worlds[2] = {2, 4}, wi, bi, i;
    size_t buckets[2] = {512, 0};
    for (wi = 0; wi < 2; wi++) {
        int N = worlds[wi];
        dp_job ref = dp_job_init(1, 8 * N, 50);   /* 1 rank, batch N*b */
        dp_run(&ref);
        CHECK_EQ_INT(ref.fails, 0);
        CHECK_EQ_INT(ref.result[0], DTR_OK);
        for (bi = 0; bi < 2; bi++) {
            dp_job j = dp_job_init(N, 8, 50);
            double e;
            j.bucket_bytes = buckets[bi];
            dp_run(&j);
            CHECK_EQ_INT(j.fails, 0);
            for (i = 0; i < N; i++) CHECK_MSG(j.result[i] == DTR_OK, "rank %d: %s", i, j.msg[i]);
            if (!j.params[0] || !ref.params[0]) { dp_free(&j); continue; }
            e = rel_err(j.params[0], ref.params[0], j.numel);
            CHECK_MSG(e <= 1e-5, "world %d, bucket %zu: relative error %.3g vs 1 rank", N, buckets[bi], e);
            for (i = 1; i < N; i++)
                CHECK_MSG(memcmp(j.params[i], j.params[0], (size_t)j.numel * sizeof(float)) == 0, "rank %d differs", i);
            if (bi == 0) {
                CHECK_MSG(j.buckets >= 2, "%d buckets", j.buckets);
                CHECK_MSG(j.overlapped > 0, "no bucket started during backward (%d buckets)", j.buckets);
            } else {
                CHECK_EQ_INT(j.buckets, 1);
            }
            printf("     world %d, %d bucket(s), %d started during backward: relative error %.2e\n", N, j.buckets,
                   j.overlapped, e);
            dp_free(&j);
        }
        dp_free(&ref);
    }
}

/* l1 frozen on every rank: 2 ranks end where 1 rank with the whole batch does, l1 where it
   started; the buckets hold l2 only (every one started during backward, l1's zeros never sent).
   Unfrozen at step 8 (gradual unfreezing): the buckets are made again and take l1 in. */
static void t_dp_frozen(void) {
    dp_job ref = dp_job_init(1, 16, 20), j = dp_job_init(2, 8, 20), rt = dp_job_init(1, 16, 20), jt = dp_job_init(2, 8, 20);
    mlp init;
    int i;
    ref.freeze_l1 = j.freeze_l1 = rt.freeze_l1 = jt.freeze_l1 = 1;
    rt.thaw_at = jt.thaw_at = 8;
    j.bucket_bytes = jt.bucket_bytes = 512;
    dp_run(&ref);
    dp_run(&j);
    dp_run(&rt);
    dp_run(&jt);
    CHECK(ref.fails == 0 && j.fails == 0 && rt.fails == 0 && jt.fails == 0);
    for (i = 0; i < 2; i++) CHECK_MSG(j.result[i] == DTR_OK && jt.result[i] == DTR_OK, "rank %d: %s %s", i, j.msg[i], jt.msg[i]);
    if (jt.params[0] && rt.params[0]) {
        CHECK(rel_err(jt.params[0], rt.params[0], jt.numel) <= 1e-5);
        CHECK(memcmp(jt.params[1], jt.params[0], (size_t)jt.numel * sizeof(float)) == 0);
        CHECK_MSG(jt.bucket_lo == 0 && jt.overlapped == jt.buckets, "thawed: buckets from %lld, %d of %d overlapped",
                  (long long)jt.bucket_lo, jt.overlapped, jt.buckets);
    }
    if (j.params[0] && ref.params[0] && mlp_init(&init, 7, 1)) {
        int64_t l1 = dtr_model_param_offset(init.m, 2);   /* l1.weight and l1.bias come first */
        CHECK_MSG(j.bucket_lo == l1 && j.buckets >= 1 && j.overlapped == j.buckets, "buckets from %lld (l2 at %lld), "
                  "%d of %d overlapped", (long long)j.bucket_lo, (long long)l1, j.overlapped, j.buckets);
        CHECK_EQ_INT(j.wire_bytes, 20 * (uint64_t)(j.numel - l1) * sizeof(float));
        printf("     l1 frozen: %d buckets over l2's %lld floats (of %lld), all started during backward\n", j.buckets,
               (long long)(j.numel - l1), (long long)j.numel);
        CHECK(rel_err(j.params[0], ref.params[0], j.numel) <= 1e-5);
        CHECK(memcmp(j.params[1], j.params[0], (size_t)j.numel * sizeof(float)) == 0);
        CHECK(memcmp(j.params[0], dtr_model_params(init.m), (size_t)l1 * sizeof(float)) == 0);
        CHECK(memcmp(j.params[0] + l1, dtr_model_params(init.m) + l1, (size_t)(j.numel - l1) * sizeof(float)) != 0);
        mlp_free(&init);
    }
    dp_free(&ref), dp_free(&j), dp_free(&rt), dp_free(&jt);
}

/* ---- parameters no rank reaches (find_unused) ---- */

#define UN_STEPS 4
/* rank r's backward at step t reaches b when bit t of un_uses[r] is set: rank 0 in step 0,
   rank 1 in step 1, both in step 2, neither in step 3 */
static const int un_uses[2] = {0x5, 0x6};

typedef struct un_rank {
    pthread_t tid;
    dtr_local_world *w;
    int rank, find_unused, world;
    float a[UN_STEPS + 1][4], b[UN_STEPS + 1][4];   /* before each step and after the last */
    dtr_result r;
    char msg[256];
} un_rank;

/* the inputs of rank r at step t (x for a, y for b) */
static void un_inputs(int r, int t, float *x, float *y) {
    int i;
    for (i = 0; i < 4; i++) x[i] = 0.25f * (float)(i + 1) - 0.5f * (float)r + 0.1f * (float)t, y[i] = 1.0f - 0.3f * (float)(i + r + t);
}

/* rank r's loss at step t: sum(a * x) (+ sum(b * y) when it uses b), times `w` */
static dtr_tensor *un_loss(dtr_context *ctx, dtr_tensor *a, dtr_tensor *b, int r, int t, float w) {
    static const int64_t n4[1] = {4};
    float x[4], y[4];
    dtr_tensor *l;
    un_inputs(r, t, x, y);
    l = dtr_sum_all(ctx, dtr_mul(ctx, a, dtr_tensor_from(ctx, DTR_F32, 1, n4, x)));
    if (un_uses[r] >> t & 1) l = dtr_add(ctx, l, dtr_sum_all(ctx, dtr_mul(ctx, b, dtr_tensor_from(ctx, DTR_F32, 1, n4, y))));
    return dtr_scale(ctx, l, w);
}

/* AdamW with weight decay on [a, b]: world 2 over the engine (rank u->rank), or world 1 with
   the two ranks' losses averaged (the reference) */
static dtr_result un_train(un_rank *u, dtr_comm *c) {
    static const int64_t n4[1] = {4};
    dtr_context *ctx = NULL;
    dtr_model *m = NULL;
    dtr_optimizer *o = NULL;
    dtr_dp *dp = NULL;
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.05f);
    dtr_tensor *a, *b;
    dtr_result r = dtr_context_create(NULL, &ctx);
    int t, k;
    oc.weight_decay = 0.1f;
    dc.find_unused = u->find_unused;
    if (r == DTR_OK) r = dtr_model_create(ctx, 3, &m);
    a = m ? dtr_model_param(m, "a", 1, n4, DTR_INIT_UNIFORM, 1.0f) : NULL;
    b = m ? dtr_model_param(m, "b", 1, n4, DTR_INIT_UNIFORM, 1.0f) : NULL;
    if (r == DTR_OK && c) r = dtr_dp_create(m, c, &dc, &dp);
    if (r == DTR_OK) r = dtr_optimizer_create(m, &oc, &o);
    for (t = 0; t < UN_STEPS && r == DTR_OK; t++) {
        dtr_tensor *loss;
        memcpy(u->a[t], dtr_model_params(m) + dtr_model_param_offset(m, 0), sizeof u->a[t]);
        memcpy(u->b[t], dtr_model_params(m) + dtr_model_param_offset(m, 1), sizeof u->b[t]);
        if (c) loss = un_loss(ctx, a, b, u->rank, t, 1.0f);
        else for (loss = NULL, k = 0; k < 2; k++)   /* the average of the ranks' losses */
            loss = loss ? dtr_add(ctx, loss, un_loss(ctx, a, b, k, t, 0.5f)) : un_loss(ctx, a, b, k, t, 0.5f);
        r = dtr_backward(ctx, loss);
        if (r == DTR_OK && dp) r = dtr_dp_finish(dp);
        if (r == DTR_OK) r = dtr_optimizer_step(o, NULL);
        dtr_context_reset(ctx);
    }
    if (m) memcpy(u->a[t], dtr_model_params(m) + dtr_model_param_offset(m, 0), sizeof u->a[t]);
    if (m) memcpy(u->b[t], dtr_model_params(m) + dtr_model_param_offset(m, 1), sizeof u->b[t]);
    if (r != DTR_OK) snprintf(u->msg, sizeof u->msg, "%s", ctx ? dtr_context_last_error(ctx) : "no context");
    dtr_optimizer_destroy(o), dtr_dp_destroy(dp), dtr_model_destroy(m), dtr_context_destroy(ctx);
    return r;
}

static void *un_main(void *arg) {
    un_rank *u = (un_rank *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    cfg.local.world = u->w, cfg.local.rank = u->rank, cfg.timeout_ms = 20000;
    u->r = dtr_comm_create(&cfg, &c, u->msg, sizeof u->msg);
    if (u->r == DTR_OK) u->r = un_train(u, c);
    dtr_comm_destroy(c);
    return NULL;
}

static void un_world(un_rank *u, int find_unused) {
    dtr_local_world *w = NULL;
    int r;
    if (dtr_local_world_create(2, NULL, &w) != DTR_OK) { CHECK(0); return; }
    for (r = 0; r < 2; r++) {
        memset(&u[r], 0, sizeof u[r]);
        u[r].w = w, u[r].rank = r, u[r].find_unused = find_unused;
        pthread_create(&u[r].tid, NULL, un_main, &u[r]);
    }
    for (r = 0; r < 2; r++) pthread_join(u[r].tid, NULL);
    dtr_local_world_destroy(w);
}

/* b is reached by one rank in steps 0 and 1, by both in step 2, by neither in step 3. With
   find_unused both ranks leave b alone in step 3 (AdamW's decay and moments included) and end
   where one process with the averaged loss does (it leaves b out there too); by default the
   replicas update b in step 3 as well, alike. */
static void t_dp_unused(void) {
    static un_rank u[2], d[2], ref;
    int r;
    un_world(u, 1);
    un_world(d, 0);
    memset(&ref, 0, sizeof ref);
    ref.r = un_train(&ref, NULL);
    CHECK_MSG(ref.r == DTR_OK, "reference: %s", ref.msg);
    for (r = 0; r < 2; r++) {
        CHECK_MSG(u[r].r == DTR_OK && d[r].r == DTR_OK, "rank %d: %s %s", r, u[r].msg, d[r].msg);
        CHECK(memcmp(u[r].b[3], u[r].b[2], sizeof u[r].b[3]) != 0);   /* reached by some rank in step 2 */
        CHECK(memcmp(u[r].b[4], u[r].b[3], sizeof u[r].b[4]) == 0);   /* by none in step 3: left out */
        CHECK(memcmp(d[r].b[4], d[r].b[3], sizeof d[r].b[4]) != 0);   /* by default updated anyway */
        CHECK(rel_err(u[r].a[UN_STEPS], ref.a[UN_STEPS], 4) <= 1e-6 && rel_err(u[r].b[UN_STEPS], ref.b[UN_STEPS], 4) <= 1e-6);
    }
    CHECK(memcmp(u[0].b, u[1].b, sizeof u[0].b) == 0 && memcmp(d[0].b, d[1].b, sizeof d[0].b) == 0);
    CHECK(memcmp(ref.b[4], ref.b[3], sizeof ref.b[4]) == 0);
}

/* bf16 activations: the engine reduces f32 gradients as ever, so 2 ranks end where 1 rank with
   the whole batch and bf16 activations does, far closer than to f32's weights */
static void t_dp_bf16(void) {
    dp_job ref = dp_job_init(1, 16, 30), f32 = dp_job_init(1, 16, 30), j = dp_job_init(2, 8, 30);
    double e, ef;
    int i;
    ref.act = j.act = DTR_BF16;
    dp_run(&ref);
    dp_run(&f32);
    dp_run(&j);
    CHECK(ref.fails == 0 && f32.fails == 0 && j.fails == 0);
    for (i = 0; i < 2; i++) CHECK_MSG(j.result[i] == DTR_OK, "rank %d: %s", i, j.msg[i]);
    if (j.params[0] && ref.params[0] && f32.params[0]) {
        e = rel_err(j.params[0], ref.params[0], j.numel);
        ef = rel_err(ref.params[0], f32.params[0], j.numel);
        printf("     world 2, bf16 activations: relative error %.2e vs 1 rank (bf16 against f32: %.2e)\n", e, ef);
        CHECK_MSG(e <= 1e-5 && ef > 1e-4, "bf16: %.3g vs 1 rank, %.3g between bf16 and f32", e, ef);
        CHECK(memcmp(j.params[1], j.params[0], (size_t)j.numel * sizeof(float)) == 0);
    }
    dp_free(&ref);
    dp_free(&f32);
    dp_free(&j);
}

static void t_dp_no_sync(void) {
    dp_job ref = dp_job_init(1, 2 * 2 * 6, 10), j = dp_job_init(2, 6, 10);
    double e;
    dp_run(&ref);
    j.accum = 2;
    j.bucket_bytes = 1024;
    dp_run(&j);
    CHECK_EQ_INT(j.fails, 0);
    CHECK_MSG(j.result[0] == DTR_OK && j.result[1] == DTR_OK, "%s / %s", j.msg[0], j.msg[1]);
    if (j.params[0] && ref.params[0]) {
        e = rel_err(j.params[0], ref.params[0], j.numel);
        CHECK_MSG(e <= 1e-5, "relative error %.3g", e);
        CHECK(memcmp(j.params[0], j.params[1], (size_t)j.numel * sizeof(float)) == 0);
    }
    /* the no_sync step communicated nothing: each rank kept its own gradient */
    CHECK(j.grad_copy[0] && j.grad_copy[1] &&
          memcmp(j.grad_copy[0], j.grad_copy[1], (size_t)j.numel * sizeof(float)) != 0);
    CHECK_EQ_INT(j.refused, 1);
    dp_free(&ref);
    dp_free(&j);
}

static void t_dp_broadcast(void) {
    dp_job j = dp_job_init(3, 4, 0);
    j.seed_by_rank = 1;
    dp_run(&j);
    CHECK_EQ_INT(j.fails, 0);
    if (j.params[0] && j.params[1] && j.params[2]) {
        mlp n;
        CHECK(mlp_init(&n, 100, 1));   /* rank 0's seed */
        CHECK(memcmp(j.params[0], dtr_model_params(n.m), (size_t)j.numel * sizeof(float)) == 0);
        CHECK(memcmp(j.params[1], j.params[0], (size_t)j.numel * sizeof(float)) == 0);
        CHECK(memcmp(j.params[2], j.params[0], (size_t)j.numel * sizeof(float)) == 0);
        mlp_free(&n);
    }
    dp_free(&j);
}

/* dtr_dp_average_buffers: 3 ranks whose batch-norm statistics differ (rank r's running mean
   r + 1, variance 2r + 1) end with their mean on every rank; the parameters are left alone */
typedef struct buf_rank { dtr_local_world *w; int rank; float got[32]; dtr_result r; } buf_rank;

static void *buf_rank_main(void *arg) {
    buf_rank *b = (buf_rank *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    dtr_dp *dp = NULL;
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_batchnorm_layer bn;
    float v[32];
    int k;
    cfg.local.world = b->w;
    cfg.local.rank = b->rank;
    b->r = dtr_comm_create(&cfg, &c, NULL, 0);
    if (b->r == DTR_OK) b->r = dtr_model_create(ctx, 1, &m);
    if (b->r == DTR_OK) b->r = dtr_batchnorm_layer_init(&bn, m, "bn", 3);
    if (b->r == DTR_OK) b->r = dtr_dp_create(m, c, NULL, &dp);
    for (k = 0; k < 32; k++) v[k] = k < 16 ? (float)(b->rank + 1) : (float)(2 * b->rank + 1);
    if (b->r == DTR_OK) b->r = dtr_model_write_buffers(m, v, 32);
    if (b->r == DTR_OK) b->r = dtr_dp_average_buffers(dp);
    if (b->r == DTR_OK) b->r = dtr_model_read_buffers(m, b->got, 32);
    dtr_dp_destroy(dp);
    dtr_comm_destroy(c);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    return NULL;
}

static void t_dp_average_buffers(void) {
    pthread_t tid[3];
    buf_rank br[3];
    dtr_local_world *w = NULL;
    int i;
    CHECK_OK(NULL, dtr_local_world_create(3, NULL, &w));
    for (i = 0; i < 3; i++) br[i].w = w, br[i].rank = i, pthread_create(&tid[i], NULL, buf_rank_main, &br[i]);
    for (i = 0; i < 3; i++) pthread_join(tid[i], NULL);
    for (i = 0; i < 3; i++) {
        CHECK_MSG(br[i].r == DTR_OK, "rank %d: %s", i, dtr_result_string(br[i].r));
        CHECK(br[i].got[0] == 2.0f && br[i].got[2] == 2.0f && br[i].got[16] == 3.0f && br[i].got[18] == 3.0f);
    }
    dtr_local_world_destroy(w);
}

/* dtr_dp_report_metric: 3 ranks report their own validation losses with their sample counts;
   every rank reports the weighted mean, so their plateau schedules drop together, as one
   optimizer fed the means does; a negative weight fails every rank; dtr_comm_report_metric
   with weight on one rank only (a pipeline's last stage) gives every rank its metric */
#define MET_N 12
typedef struct met_rank { dtr_local_world *w; int rank; float lr[MET_N]; dtr_metric_stats st, pipe; dtr_result r, bad; } met_rank;

static double met_loss(int rank, int k) { return 1.0 / (1.0 + 0.3 * (k < 5 ? k : 5)) + 0.01 * (double)((rank * 7 + k * 3) % 5); }

static dtr_optimizer_config met_cfg(void) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    oc.schedule.kind = DTR_SCHED_PLATEAU, oc.schedule.gamma = 0.5f, oc.schedule.step_size = 1, oc.schedule.threshold = 0.02f;
    return oc;
}

static void *met_rank_main(void *arg) {
    met_rank *b = (met_rank *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_optimizer_config oc = met_cfg();
    dtr_comm *c = NULL;
    dtr_dp *dp = NULL;
    dtr_optimizer *opt = NULL;
    mlp n;
    int k;
    cfg.local.world = b->w, cfg.local.rank = b->rank;
    b->r = mlp_init(&n, 7, 1) ? dtr_comm_create(&cfg, &c, NULL, 0) : DTR_INVALID_ARGUMENT;
    if (b->r == DTR_OK) b->r = dtr_dp_create(n.m, c, NULL, &dp);
    if (b->r == DTR_OK) b->r = dtr_optimizer_create(n.m, &oc, &opt);
    for (k = 0; k < MET_N && b->r == DTR_OK; k++) {
        b->r = dtr_dp_report_metric(dp, opt, met_loss(b->rank, k), (double)(10 + 5 * b->rank), &b->st);
        b->lr[k] = dtr_optimizer_lr(opt);
    }
    if (b->r == DTR_OK) b->bad = dtr_dp_report_metric(dp, opt, 1.0, b->rank == 1 ? -1.0 : 1.0, NULL);
    if (b->r == DTR_OK)   /* a pipeline's: only the last stage has the loss, the others give weight 0 (and NaN) */
        b->r = dtr_comm_report_metric(c, opt, b->rank == 2 ? 0.0625 : NAN, b->rank == 2 ? 40.0 : 0.0, &b->pipe);
    dtr_optimizer_destroy(opt);
    dtr_dp_destroy(dp);
    dtr_comm_destroy(c);
    mlp_free(&n);
    return NULL;
}

static void t_dp_report_metric(void) {
    pthread_t tid[3];
    met_rank mr[3];
    dtr_local_world *w = NULL;
    dtr_optimizer_config oc = met_cfg();
    dtr_optimizer *ref = NULL;
    dtr_metric_stats st;
    mlp n;
    int i, k;
    CHECK_OK(NULL, dtr_local_world_create(3, NULL, &w));
    for (i = 0; i < 3; i++) memset(&mr[i], 0, sizeof mr[i]), mr[i].w = w, mr[i].rank = i, pthread_create(&tid[i], NULL, met_rank_main, &mr[i]);
    for (i = 0; i < 3; i++) pthread_join(tid[i], NULL);
    CHECK(mlp_init(&n, 7, 1));
    CHECK_OK(n.ctx, dtr_optimizer_create(n.m, &oc, &ref));
    for (k = 0; ref && k < MET_N; k++) {
        double s = 0.0, ws = 0.0;
        for (i = 0; i < 3; i++) s += met_loss(i, k) * (double)(10 + 5 * i);
        for (i = 0; i < 3; i++) ws += (double)(10 + 5 * i);
        CHECK_OK(n.ctx, dtr_optimizer_report_metric(ref, s / ws, &st));
        for (i = 0; i < 3; i++) CHECK_MSG(mr[i].lr[k] == dtr_optimizer_lr(ref), "rank %d report %d: lr %g, one optimizer %g", i, k,
                                          (double)mr[i].lr[k], (double)dtr_optimizer_lr(ref));
    }
    CHECK(st.drops >= 2 && st.drops < MET_N);
    for (i = 0; i < 3; i++) {
        CHECK_MSG(mr[i].r == DTR_OK, "rank %d: %s", i, dtr_result_string(mr[i].r));
        CHECK(mr[i].st.best == st.best && mr[i].st.drops == st.drops && mr[i].st.reports == MET_N);
        CHECK_EQ_INT(mr[i].bad, DTR_INVALID_ARGUMENT);   /* rank 1's weight -1: every rank refuses */
        CHECK(mr[i].pipe.best == 0.0625 && mr[i].pipe.improved == 1);   /* the last stage's metric everywhere */
    }
    dtr_optimizer_destroy(ref);
    mlp_free(&n);
    dtr_local_world_destroy(w);
}

static void t_dp_single(void) {
    dtr_local_world *w = NULL;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    dtr_dp *dp = NULL;
    mlp a, b;
    int t;
    CHECK(mlp_init(&a, 7, 1) && mlp_init(&b, 7, 1));
    CHECK_OK(NULL, dtr_local_world_create(1, NULL, &w));
    cfg.local.world = w;
    CHECK_OK(NULL, dtr_comm_create(&cfg, &c, NULL, 0));
    CHECK_OK(a.ctx, dtr_dp_create(a.m, c, NULL, &dp));
    CHECK(a.ctx->n_grad_hooks == 0);   /* nothing installed: the 1-rank path costs nothing */
    CHECK_EQ_INT(dtr_dp_bucket_count(dp), 0);
    for (t = 0; t < 5; t++) {
        CHECK_OK(a.ctx, mlp_backward(&a, t, 0, 16));
        CHECK_OK(a.ctx, dtr_dp_finish(dp));
        CHECK_OK(a.ctx, dtr_optimizer_step(a.opt, NULL));
        dtr_context_reset(a.ctx);
        CHECK_OK(b.ctx, mlp_backward(&b, t, 0, 16));
        CHECK_OK(b.ctx, dtr_optimizer_step(b.opt, NULL));
        dtr_context_reset(b.ctx);
    }
    CHECK(memcmp(dtr_model_params(a.m), dtr_model_params(b.m), (size_t)dtr_model_numel(a.m) * sizeof(float)) == 0);
    dtr_dp_destroy(dp);
    dtr_comm_destroy(c);
    dtr_local_world_destroy(w);
    mlp_free(&a);
    mlp_free(&b);
}

static void t_dp_fault(void) {
    dp_job j = dp_job_init(2, 4, 20);
    j.timeout_ms = 500;
    j.stop_rank = 1;
    j.stop_after = 3;
    j.bucket_bytes = 512;
    dp_run(&j);
    CHECK(j.result[0] == DTR_TIMEOUT || j.result[0] == DTR_PEER_FAILED);
    CHECK_MSG(j.failed_rank[0] == 1, "blames %d: %s", j.failed_rank[0], j.msg[0]);
    CHECK_MSG(strstr(j.msg[0], "rank 1") != NULL, "%s", j.msg[0]);
    CHECK_MSG(j.secs[0] < 1.5, "took %.2f s", j.secs[0]);
    dp_free(&j);
}

int main(void) {
    const char *q = getenv("DTR_TEST_QUICK");
    alarm(q && strcmp(q, "1") == 0 ? 600 : 180);
    RUN(t_grad_ready_hook);
    RUN(t_dp_equivalence);
    RUN(t_dp_bf16);
    RUN(t_dp_no_sync);
    RUN(t_dp_broadcast);
    RUN(t_dp_frozen);
    RUN(t_dp_unused);
    RUN(t_dp_average_buffers);
    RUN(t_dp_report_metric);
    RUN(t_dp_single);
    RUN(t_dp_fault);
    return test_summary();
}
