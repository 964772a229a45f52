/* Gradient compression and local SGD of the data-parallel engine (dtr_dp_config.compress,
 * local_sgd_every), with 2 ranks as threads over the local transport.
 *
 *   test_round_trip      one step of the MLP of tests/dp_mlp.h: each codec's averaged gradient
 *                        against the exact average, within the bound api_engine.h documents
 *                        (bf16 2^-7 max|g|, fp16 2^-10 max|g| + 2^-24, int8 max scale / 2;
 *                        top-k: at most k entries sent, none smaller than what stays in the
 *                        residual, sent + residual == gradient; PowerSGD: exact for a gradient
 *                        of rank <= r, and averaged residual + result == average otherwise);
 *                        identical bits on both ranks; bytes on the wire below f32's
 *   test_error_feedback  a constant gradient that int8, top-k and rank-1 PowerSGD each lose
 *                        part of: with error feedback the mean of the synchronised gradients
 *                        over 300 steps comes within 10% of the true one for every entry;
 *                        without it (no_error_feedback) some entry is off by more than 50%
 *                        (int8 and top-k never send the small entries, PowerSGD never the
 *                        second singular component)
 *   test_local_sgd_h1    local SGD with H = 1 gives the weights of ordinary DP (20 SGD steps
 *                        with momentum, relative error <= 1e-5), identical bits on the ranks;
 *                        dtr_dp_step_done between backward and finish is DTR_BAD_STATE
 *   test_local_sgd_phases  warm-up 3 and H 4 over 11 steps: the ranks hold the same weights
 *                        after the warm-up steps and after steps 7 and 11 only; 3 gradient
 *                        syncs, 2 parameter averages, and the bytes they put on the wire
 *   test_bad_config      unknown codec, topk_ratio > 1, negative H: DTR_INVALID_ARGUMENT
 *   test_accuracy        the Fashion-MNIST MLP (examples/fmnist_dp.c), 3 epochs on 2 ranks:
 *                        every codec within 1 point of uncompressed accuracy (PowerSGD rank 4).
 *                        make test runs 100 batches of 128 per epoch (40 with
 *                        DTR_TEST_QUICK=1, the sanitizer runs), top-k sending 10% of
 *                        each bucket; DTR_COMPRESS_FULL=1 (make test-compress-full) whole
 *                        epochs, top-k at its default 1%. Data as tests/test_train.c: missing
 *                        data fails unless DTR_ALLOW_SKIP=1. */
#define FMNIST_DP_NO_MAIN
#include "../examples/fmnist_dp.c"
#include <unistd.h>
#include "test.h"
#include "dp_mlp.h"

#define WORLD 2

typedef struct cjob {
    dtr_dp_config dc;
    int b, steps;              /* rows per rank and step; steps */
    float *params[WORLD];      /* rank's weights at the end */
    float *trace[WORLD];       /* local SGD phases: weights after every step */
    double worst[WORLD];       /* round trip: largest error / bound (<= 1 passes) */
    double rel[WORLD];         /* round trip: relative error; error feedback: worst entry */
    int64_t numel;
    dtr_dp_stats stats[WORLD];
    int refused[WORLD];        /* dtr_dp_step_done between backward and finish was refused */
    int thaw_at;               /* local SGD's ranks: l1 frozen until this step (0: never frozen) */
    char msg[WORLD][256];
} cjob;

static cjob cjob_init(dtr_dp_compress kind, int b, int steps) {
    cjob j;
    memset(&j, 0, sizeof j);
    j.dc = dtr_dp_config_init();
    j.dc.compress = kind;
    j.b = b;
    j.steps = steps;
    return j;
}

static void cjob_free(cjob *j) {
    int r;
    for (r = 0; r < WORLD; r++) { free(j->params[r]); free(j->trace[r]); }
}

static float *copy_of(const float *x, int64_t n) {
    float *y = (float *)malloc((size_t)(n ? n : 1) * sizeof(float));
    memcpy(y, x, (size_t)n * sizeof(float));
    return y;
}

/* the end of a rank on the MLP: the message, the others stopped on failure, teardown */
static int mlp_rank_end(cjob *j, dtr_comm *c, int ok, dtr_dp *dp, mlp *net) {
    int rank = dtr_comm_rank(c);
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", dtr_context_last_error(net->ctx));
    if (!ok) dtr_comm_abort(c, "test rank failed");
    dtr_dp_destroy(dp);
    mlp_free(net);
    return ok;
}

/* ---- round trip: one compressed step against the exact average ---- */

/* largest |out - ex| / bound over the elements; bound from max_r |g_r| (mx) per codec */
static double half_int8_worst(dtr_dp_compress kind, const float *out, const float *ex, const float *mx, int64_t n) {
    double worst = 0.0, top = 0.0, e, bound;
    int64_t i;
    for (i = 0; i < n; i++) top = mx[i] > top ? mx[i] : top;
    for (i = 0; i < n; i++) {
        bound = kind == DTR_COMPRESS_BF16 ? ldexp(mx[i], -7) : kind == DTR_COMPRESS_FP16 ? ldexp(mx[i], -10) + ldexp(1.0, -24)
                                                                                      : top / 254.0;
        bound = bound * 1.001 + 1e-30;
        e = fabs((double)out[i] - ex[i]) / bound;
        worst = e > worst ? e : worst;
    }
    return worst;
}

/* top-k: sent = g - residual has at most k entries, none smaller than a residual entry */
static double topk_worst(const float *g, const float *resid, int64_t n, float ratio) {
    int64_t i, sent = 0, k = (int64_t)(ratio * (double)n + 0.5);
    double min_sent = INFINITY, max_left = 0.0;
    for (i = 0; i < n; i++) {
        if (g[i] - resid[i] != 0.0f) { sent++; min_sent = fmin(min_sent, fabs(g[i])); }
        if (resid[i] != 0.0f && resid[i] != g[i]) return 1e9;   /* an entry is sent whole or kept whole */
        max_left = fmax(max_left, fabs(resid[i]));
    }
    return sent > k ? 1e9 : min_sent >= max_left ? 0.0 : 2.0;
}

/* one local backward (no_sync) for g_r, then the same backward synchronised */
static int round_trip_rank(dtr_comm *c, void *user) {
    cjob *j = (cjob *)user;
    int rank = dtr_comm_rank(c), ok = 0;
    dtr_dp *dp = NULL;
    dtr_state_entry st;
    float *loc = NULL, *ex = NULL, *mx = NULL, *avg_resid = NULL, *out;
    int64_t n = 0, i;
    mlp net;
    if (!mlp_init(&net, 7, 1) || dtr_dp_create(net.m, c, &j->dc, &dp) != DTR_OK) goto done;
    n = dtr_model_numel(net.m);
    if (rank == 0) j->numel = n;   /* the same on every rank */
    if (dtr_dp_set_no_sync(dp, 1) != DTR_OK || mlp_backward(&net, 0, (int64_t)rank * j->b, j->b) != DTR_OK) goto done;
    loc = copy_of(dtr_model_grads(net.m), n);
    ex = copy_of(loc, n);
    mx = copy_of(loc, n);
    for (i = 0; i < n; i++) mx[i] = fabsf(mx[i]);
    if (dtr_comm_all_reduce(c, ex, ex, (size_t)n, DTR_F32, DTR_REDUCE_AVG) != DTR_OK ||
        dtr_comm_all_reduce(c, mx, mx, (size_t)n, DTR_F32, DTR_REDUCE_MAX) != DTR_OK)
        goto done;
    dtr_model_zero_grad(net.m);
    dtr_context_reset(net.ctx);
    if (dtr_dp_set_no_sync(dp, 0) != DTR_OK || mlp_backward(&net, 0, (int64_t)rank * j->b, j->b) != DTR_OK ||
        dtr_dp_finish(dp) != DTR_OK)
        goto done;
    out = dtr_model_grads(net.m);
    j->params[rank] = copy_of(out, n);
    j->rel[rank] = rel_err(out, ex, n);
    if (j->dc.compress <= DTR_COMPRESS_INT8) j->worst[rank] = half_int8_worst(j->dc.compress, out, ex, mx, n);
    if (j->dc.compress == DTR_COMPRESS_TOPK || j->dc.compress == DTR_COMPRESS_POWERSGD) {
        if (dtr_dp_state(dp, 2, &st) != DTR_OK || strcmp(st.name, "residual") != 0 || st.bytes != (size_t)n * sizeof(float))
            goto done;
        if (j->dc.compress == DTR_COMPRESS_TOPK) j->worst[rank] = topk_worst(loc, (const float *)st.data, n, j->dc.topk_ratio);
        avg_resid = copy_of((const float *)st.data, n);
        if (dtr_comm_all_reduce(c, avg_resid, avg_resid, (size_t)n, DTR_F32, DTR_REDUCE_AVG) != DTR_OK) goto done;
        for (i = 0; i < n; i++) avg_resid[i] += out[i];   /* averaged residual + result */
        j->worst[rank] = fmax(j->worst[rank], rel_err(avg_resid, ex, n) / 1e-5);
    }
    dtr_dp_get_stats(dp, &j->stats[rank]);
    ok = 1;
done:
    free(loc), free(ex), free(mx), free(avg_resid);
    return mlp_rank_end(j, c, ok, dp, &net);
}

static void round_trip(dtr_dp_compress kind, int b, int rank_r, size_t bucket, double max_rel, double min_rel) {
    cjob j = cjob_init(kind, b, 1);
    j.dc.bucket_bytes = bucket;
    j.dc.topk_ratio = 0.1f;
    j.dc.powersgd_rank = rank_r;
    CHECK_MSG(ex_run_ranks("test_compress", "local", NULL, WORLD, 0, round_trip_rank, &j), "%s | %s", j.msg[0], j.msg[1]);
    if (j.params[0] && j.params[1]) {
        CHECK_MSG(memcmp(j.params[0], j.params[1], (size_t)j.numel * sizeof(float)) == 0, "%s: ranks differ",
                  dp_compress_names[kind]);
        CHECK_MSG(j.worst[0] <= 1.0 && j.worst[1] <= 1.0, "%s: error %.3g x the bound", dp_compress_names[kind],
                  fmax(j.worst[0], j.worst[1]));
        CHECK_MSG(j.rel[0] <= max_rel && j.rel[0] >= min_rel, "%s: relative error %.3g", dp_compress_names[kind], j.rel[0]);
        CHECK_EQ_INT(j.stats[0].raw_bytes, j.numel * 4);   /* one sync of every bucket */
        CHECK_MSG(j.stats[0].wire_bytes < j.stats[0].raw_bytes, "%s: %llu bytes", dp_compress_names[kind],
                  (unsigned long long)j.stats[0].wire_bytes);
        printf("     %-8s rank %d, %d rows/rank: relative error %.2e, %llu of %llu bytes\n", dp_compress_names[kind],
               rank_r, b, j.rel[0], (unsigned long long)j.stats[0].wire_bytes, (unsigned long long)j.stats[0].raw_bytes);
    }
    cjob_free(&j);
}

static void t_round_trip(void) {
    round_trip(DTR_COMPRESS_BF16, 8, 0, 0, 1e-2, 0.0);
    round_trip(DTR_COMPRESS_FP16, 8, 0, 0, 1e-3, 0.0);
    round_trip(DTR_COMPRESS_INT8, 8, 0, 0, 5e-2, 0.0);
    round_trip(DTR_COMPRESS_TOPK, 8, 0, 0, 1.0, 1e-2);
    round_trip(DTR_COMPRESS_POWERSGD, 1, 4, 0, 1e-4, 0.0);     /* weight gradients of rank <= 2 */
    round_trip(DTR_COMPRESS_POWERSGD, 1, 4, 64, 1e-4, 0.0);    /* a bucket per parameter: some hold no matrix */
    round_trip(DTR_COMPRESS_POWERSGD, 8, 1, 0, 1.0, 1e-2);     /* rank 1 of gradients of rank up to 16 */
}

/* ---- error feedback: a constant gradient part of which each codec drops ---- */

/* rank r's gradient of w (8, 8), entry k, times (1 + r/2): for int8 and top-k 1 on the
   diagonal and 0.002 .. 0.006 elsewhere (below int8's step, outside the top k); for
   PowerSGD of rank 1 the rank-2 matrix 1 + 0.6 (-1)^(i+j), whose second component is lost */
static float ef_grad(dtr_dp_compress kind, int r, int k) {
    float base = kind == DTR_COMPRESS_POWERSGD ? 1.0f + ((k / 8 + k % 8) % 2 ? -0.6f : 0.6f)
                                               : k % 9 == 0 ? 1.0f : 0.002f * (float)(1 + k % 3);
    return (1.0f + 0.5f * (float)r) * base;
}

static int ef_rank(dtr_comm *c, void *user) {
    cjob *j = (cjob *)user;
    int rank = dtr_comm_rank(c), ok = 0, t, k;
    int64_t shape[2] = {8, 8};
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_dp *dp = NULL;
    dtr_tensor *w;
    float cr[64];
    double sum[64];
    memset(sum, 0, sizeof sum);
    for (k = 0; k < 64; k++) cr[k] = ef_grad(j->dc.compress, rank, k);
    if (dtr_model_create(ctx, 1, &m) != DTR_OK || !(w = dtr_model_param(m, "w", 2, shape, DTR_INIT_ZEROS, 0.0f)) ||
        dtr_dp_create(m, c, &j->dc, &dp) != DTR_OK)
        goto done;
    for (t = 0; t < j->steps; t++) {
        dtr_model_zero_grad(m);
        if (dtr_backward(ctx, dtr_sum_all(ctx, dtr_mul(ctx, w, dtr_tensor_from(ctx, DTR_F32, 2, shape, cr)))) != DTR_OK ||
            dtr_dp_finish(dp) != DTR_OK)
            goto done;
        for (k = 0; k < 64; k++) sum[k] += dtr_model_grads(m)[k];
        dtr_context_reset(ctx);
    }
    for (k = 0; k < 64; k++) {   /* the worst entry of the mean against the true average */
        double want = 0.5 * (ef_grad(j->dc.compress, 0, k) + ef_grad(j->dc.compress, 1, k));
        j->rel[rank] = fmax(j->rel[rank], fabs(sum[k] / j->steps - want) / want);
    }
    ok = 1;
done:
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", dtr_context_last_error(ctx));
    if (!ok) dtr_comm_abort(c, "test rank failed");
    dtr_dp_destroy(dp);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    return ok;
}

static void t_error_feedback(void) {
    dtr_dp_compress kinds[3] = {DTR_COMPRESS_INT8, DTR_COMPRESS_TOPK, DTR_COMPRESS_POWERSGD};
    int i, ef;
    for (i = 0; i < 3; i++)
        for (ef = 1; ef >= 0; ef--) {
            cjob j = cjob_init(kinds[i], 0, 300);
            j.dc.topk_ratio = 0.25f;   /* 16 of 64: the 8 diagonal entries and 8 others */
            j.dc.powersgd_rank = 1;
            j.dc.no_error_feedback = !ef;
            CHECK_MSG(ex_run_ranks("test_compress", "local", NULL, WORLD, 0, ef_rank, &j), "%s", j.msg[0]);
            if (ef) CHECK_MSG(j.rel[0] <= 0.1, "%s with error feedback: an entry off by %.3g", dp_compress_names[kinds[i]], j.rel[0]);
            else CHECK_MSG(j.rel[0] > 0.5, "%s without error feedback: worst entry only %.3g off", dp_compress_names[kinds[i]], j.rel[0]);
            printf("     %-8s error feedback %s: worst entry of the mean off by %.3g\n", dp_compress_names[kinds[i]],
                   ef ? "on " : "off", j.rel[0]);
        }
}

/* ---- local SGD ---- */

static int sgd_rank(dtr_comm *c, void *user) {
    static const char *l1[1] = {"l1."};
    cjob *j = (cjob *)user;
    int rank = dtr_comm_rank(c), ok = 0, t;
    dtr_dp *dp = NULL;
    int64_t n = 0;
    mlp net;
    if (!mlp_init(&net, 7, 1) || (j->thaw_at && dtr_model_set_trainable(net.m, l1, 1, 0) != DTR_OK) ||
        dtr_dp_create(net.m, c, &j->dc, &dp) != DTR_OK)
        goto done;
    n = dtr_model_numel(net.m);
    if (rank == 0) j->numel = n;   /* the same on every rank */
    j->trace[rank] = (float *)malloc((size_t)(n * j->steps) * sizeof(float));
    for (t = 0; t < j->steps; t++) {
        if (j->thaw_at && t == j->thaw_at && dtr_model_set_trainable(net.m, l1, 1, 1) != DTR_OK) goto done;
        if (mlp_backward(&net, t, (int64_t)rank * j->b, j->b) != DTR_OK) goto done;
        if (t == 0 && !j->dc.local_sgd_every) j->refused[rank] = dtr_dp_step_done(dp) == DTR_BAD_STATE;
        if (dtr_dp_finish(dp) != DTR_OK ||
            dtr_optimizer_step(net.opt, NULL) != DTR_OK || dtr_dp_step_done(dp) != DTR_OK)
            goto done;
        dtr_context_reset(net.ctx);
        memcpy(j->trace[rank] + t * n, dtr_model_params(net.m), (size_t)n * sizeof(float));
    }
    j->params[rank] = copy_of(dtr_model_params(net.m), n);
    dtr_dp_get_stats(dp, &j->stats[rank]);
    ok = 1;
done:
    return mlp_rank_end(j, c, ok, dp, &net);
}

static void t_local_sgd_h1(void) {
    cjob dp = cjob_init(DTR_COMPRESS_NONE, 8, 20), loc = cjob_init(DTR_COMPRESS_NONE, 8, 20);
    loc.dc.local_sgd_every = 1;
    CHECK(ex_run_ranks("test_compress", "local", NULL, WORLD, 0, sgd_rank, &dp));
    CHECK_MSG(ex_run_ranks("test_compress", "local", NULL, WORLD, 0, sgd_rank, &loc), "%s", loc.msg[0]);
    if (dp.params[0] && loc.params[0] && loc.params[1]) {
        double e = rel_err(loc.params[0], dp.params[0], dp.numel);
        CHECK_MSG(e <= 1e-5, "local SGD H = 1 vs DP: relative error %.3g", e);
        CHECK(memcmp(loc.params[0], loc.params[1], (size_t)loc.numel * sizeof(float)) == 0);
        CHECK_EQ_INT(loc.stats[0].syncs, 0);
        CHECK_EQ_INT(loc.stats[0].param_averages, 20);
        CHECK(dp.refused[0] && dp.refused[1]);   /* step_done with buckets in flight */
        CHECK_EQ_INT(dp.stats[0].steps, 20);
        printf("     H = 1 vs DP after 20 steps: relative error %.2e\n", e);
    }
    cjob_free(&dp);
    cjob_free(&loc);
}

static void t_local_sgd_phases(void) {
    cjob j = cjob_init(DTR_COMPRESS_NONE, 8, 11);
    int t;
    j.dc.local_sgd_every = 4;
    j.dc.local_sgd_warmup = 3;
    CHECK_MSG(ex_run_ranks("test_compress", "local", NULL, WORLD, 0, sgd_rank, &j), "%s", j.msg[0]);
    if (!j.params[0] || !j.params[1]) { cjob_free(&j); return; }
    for (t = 0; t < 11; t++) {   /* step t + 1 done: DP for 1..3, averages after 7 and 11 */
        int same = memcmp(j.trace[0] + t * j.numel, j.trace[1] + t * j.numel, (size_t)j.numel * sizeof(float)) == 0;
        int want = t + 1 <= 3 || t + 1 == 7 || t + 1 == 11;
        CHECK_MSG(same == want, "after step %d the ranks %s", t + 1, same ? "agree" : "differ");
    }
    CHECK_EQ_INT(j.stats[0].steps, 11);
    CHECK_EQ_INT(j.stats[0].syncs, 3);
    CHECK_EQ_INT(j.stats[0].param_averages, 2);
    CHECK_EQ_INT(j.stats[0].wire_bytes, (3 + 2) * j.numel * 4);
    cjob_free(&j);
}

static int all_finite(const float *x, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

/* l1 frozen for 4 steps, then trainable (gradual unfreezing) under each codec: the buckets are
   made again with l1 in them (PowerSGD's matrices too), every rank the same weights after every
   step, l1 still until the thaw and moving after it, fewer bytes a step while it was frozen */
static void t_codec_thaw(void) {
    dtr_dp_compress kinds[4] = {DTR_COMPRESS_BF16, DTR_COMPRESS_INT8, DTR_COMPRESS_TOPK, DTR_COMPRESS_POWERSGD};
    int i, t;
    for (i = 0; i < 4; i++) {
        cjob j = cjob_init(kinds[i], 8, 8), f = cjob_init(kinds[i], 8, 4);
        j.thaw_at = 4, f.thaw_at = 100;
        j.dc.topk_ratio = f.dc.topk_ratio = 0.1f;
        j.dc.bucket_bytes = f.dc.bucket_bytes = 512;
        CHECK_MSG(ex_run_ranks("test_compress", "local", NULL, WORLD, 0, sgd_rank, &j), "%s", j.msg[0]);
        CHECK_MSG(ex_run_ranks("test_compress", "local", NULL, WORLD, 0, sgd_rank, &f), "%s", f.msg[0]);
        if (!j.params[0] || !j.params[1] || !f.params[0]) { cjob_free(&j), cjob_free(&f); continue; }
        for (t = 0; t < 8; t++)
            CHECK_MSG(!memcmp(j.trace[0] + t * j.numel, j.trace[1] + t * j.numel, (size_t)j.numel * sizeof(float)),
                      "%s: the ranks differ after step %d", dp_compress_names[kinds[i]], t + 1);
        CHECK(j.trace[0][0] == j.trace[0][3 * j.numel] && j.trace[0][3 * j.numel] != j.trace[0][7 * j.numel]);
        CHECK(all_finite(j.params[0], j.numel));
        CHECK_MSG(f.stats[0].wire_bytes * 2 < j.stats[0].wire_bytes - f.stats[0].wire_bytes, "%s: %llu bytes in 4 "
                  "frozen steps, %llu in 4 more", dp_compress_names[kinds[i]], (unsigned long long)f.stats[0].wire_bytes,
                  (unsigned long long)(j.stats[0].wire_bytes - f.stats[0].wire_bytes));
        printf("     %-8s l1 frozen 4 steps, then trainable: %llu bytes on the wire, then %llu\n",
               dp_compress_names[kinds[i]], (unsigned long long)f.stats[0].wire_bytes,
               (unsigned long long)(j.stats[0].wire_bytes - f.stats[0].wire_bytes));
        cjob_free(&j), cjob_free(&f);
    }
}

/* ---- bad configurations ---- */

static int bad_rank(dtr_comm *c, void *user) {
    mlp net;
    dtr_dp *dp = NULL;
    dtr_dp_config dc[3];
    int i, ok = 1;
    (void)user;
    for (i = 0; i < 3; i++) dc[i] = dtr_dp_config_init();
    dc[0].compress = (dtr_dp_compress)99;
    dc[1].topk_ratio = 2.0f;
    dc[2].local_sgd_every = -1;
    if (!mlp_init(&net, 7, 1)) return 0;
    for (i = 0; i < 3; i++) {
        ok &= dtr_dp_create(net.m, c, &dc[i], &dp) == DTR_INVALID_ARGUMENT && dp == NULL;
        ok &= strlen(dtr_context_last_error(net.ctx)) > 0;
    }
    mlp_free(&net);
    return ok;
}

static void t_bad_config(void) {
    CHECK(ex_run_ranks("test_compress", "local", NULL, 1, 0, bad_rank, NULL));
}

/* ---- accuracy on Fashion-MNIST ---- */

static void t_accuracy(void) {
    const char *full = getenv("DTR_COMPRESS_FULL"), *allow = getenv("DTR_ALLOW_SKIP"), *quick = getenv("DTR_TEST_QUICK");
    dtr_mnist data;
    dp_opts o = dp_opts_default();
    dp_result base, res;
    int k;
    o.dir = fm_data_dir(NULL);
    if (fm_data_load(o.dir, &data) != DTR_OK) {
        printf("*** SKIPPED: Fashion-MNIST not found at %s (set DTR_FMNIST_DIR)\n", o.dir);
        CHECK(allow && strcmp(allow, "1") == 0);
        return;
    }
    o.epochs = 3;
    o.quiet = 1;
    o.max_steps = full && strcmp(full, "1") == 0 ? 0 : quick && strcmp(quick, "1") == 0 ? 40 : 100;
    o.topk_ratio = o.max_steps ? 0.1f : 0.0f;   /* 1% trails by 2 points after 300 steps, not after 3 epochs */
    CHECK(dp_train(&o, &data, &base) && base.ok);
    printf("     none      %.2f%%  %8.0f bytes/step\n", 100.0 * base.test_acc, (double)base.stats.wire_bytes / (double)base.steps);
    for (k = DTR_COMPRESS_BF16; k <= DTR_COMPRESS_POWERSGD; k++) {
        CHECK_EQ_INT(dp_parse_compress(&o, "--compress", dp_compress_names[k]), 1);   /* the bench's option */
        CHECK(dp_train(&o, &data, &res) && res.ok);
        CHECK_MSG(res.test_acc >= base.test_acc - 0.01, "%s: %.2f%% vs %.2f%% uncompressed", dp_compress_names[k],
                  100.0 * res.test_acc, 100.0 * base.test_acc);
        CHECK(res.stats.wire_bytes < base.stats.wire_bytes);
        printf("     %-8s  %.2f%%  %8.0f bytes/step\n", dp_compress_names[k], 100.0 * res.test_acc,
               (double)res.stats.wire_bytes / (double)res.steps);
    }
    dtr_mnist_destroy(&data);
}

int main(void) {
    alarm(600);
    RUN(t_round_trip);
    RUN(t_error_feedback);
    RUN(t_local_sgd_h1);
    RUN(t_local_sgd_phases);
    RUN(t_codec_thaw);
    RUN(t_bad_config);
    RUN(t_accuracy);
    return test_summary();
}
