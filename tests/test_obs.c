/* Observability (src/obs/): metrics, timelines, the straggler report.
 *
 *   test_flops            the FLOPs counted for linear (forward and backward), conv2d and
 *                         attention equal the analytic counts
 *   test_step_phases      an MLP trained from a watched loader: every step's phases add up
 *                         to its step time (within 5%), data, forward, backward, optimizer
 *                         and an app-marked checkpoint are each seen; the callback and the
 *                         JSON-lines file get the same records with the fixed field names
 *   test_phase_errors     bad phases and unbalanced ends are refused with an error
 *   test_trace_dp         2 ranks (threads, local transport) of data-parallel steps with
 *                         small buckets: the parts of each step (comm included) add up to
 *                         its time; each rank's trace and their merge are valid JSON
 *                         (read by src/io/json.c through dtr_trace_merge), every span is
 *                         closed, every op of the model has forward and backward spans, and
 *                         bucket all-reduce spans overlap the backward span of their step
 *   test_trace_ring       a small ring keeps the newest events and counts the dropped ones
 *   test_straggler        3 ranks, rank 2 sleeps before each step: the report names it
 *   test_merge_errors     a missing file and a file that is not JSON are errors naming it */
#define _POSIX_C_SOURCE 200809L
#define DTRAIN_INTERNAL_API
#include <pthread.h>
#include <unistd.h>
#include "test.h"
#include "test_util.h"
#include "posix_util.h"

#include "dp_mlp.h"


/* ---- reading the files back ---- */

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    long n;
    char *s;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    s = (char *)malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) { free(s); s = NULL; }
    if (s) s[n] = '\0';
    fclose(f);
    return s;
}

/* the number after "key": in the line (NaN when absent) */
static double num_field(const char *line, const char *key) {
    char pat[64];
    const char *p;
    snprintf(pat, sizeof pat, "\"%s\":", key);
    p = strstr(line, pat);
    return p ? strtod(p + strlen(pat), NULL) : NAN;
}

/* the string after "key":" into buf */
static const char *str_field(const char *line, const char *key, char *buf, size_t n) {
    char pat[64];
    const char *p;
    size_t k = 0;
    snprintf(pat, sizeof pat, "\"%s\":\"", key);
    buf[0] = '\0';
    if (!(p = strstr(line, pat))) return buf;
    for (p += strlen(pat); *p && *p != '"' && k + 1 < n; p++) buf[k++] = *p;
    buf[k] = '\0';
    return buf;
}

/* ---- FLOPs ---- */

static double flops_of_step(dtr_metrics *m) {
    dtr_step_metrics s;
    if (dtr_metrics_step_end(m, NULL, &s) != DTR_OK) return -1;
    return s.flops;
}

static dtr_tensor *ramp(dtr_context *ctx, int ndim, const int64_t *shape, int grad) {
    float buf[4096];
    int64_t i, n = 1;
    dtr_tensor *t;
    for (i = 0; i < ndim; i++) n *= shape[i];
    for (i = 0; i < n && i < 4096; i++) buf[i] = (float)((i * 37) % 19) / 19.0f - 0.5f;
    t = dtr_tensor_from(ctx, DTR_F32, ndim, shape, buf);
    return grad ? dtr_tensor_requires_grad(t) : t;
}

static void test_flops(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_metrics *m = NULL;
    const int64_t B = 4, K = 8, N = 6, xs[2] = {4, 8}, ws[2] = {6, 8}, bs[1] = {6};
    const int64_t cx[4] = {2, 3, 8, 8}, cw[4] = {4, 3, 3, 3}, cb[1] = {4}, qs[3] = {2, 5, 8};
    dtr_tensor *x, *w, *b, *y;
    double f;
    CHECK_OK(ctx, dtr_metrics_create(ctx, NULL, &m));
    if (!m) goto done;
    /* linear: 2BKN products + BN bias; backward: 2 * 2BKN (dx, dw) + BN (db) */
    x = ramp(ctx, 2, xs, 1); w = ramp(ctx, 2, ws, 1); b = ramp(ctx, 1, bs, 1);
    f = flops_of_step(m);   /* tensor_from makes no op */
    CHECK_NEAR(f, 0.0, 0.0);
    y = dtr_linear(ctx, x, w, b);
    CHECK_NEAR(flops_of_step(m), (double)(2 * B * K * N + B * N), 0.0);
    y = dtr_sum_all(ctx, y);                    /* B*N elements summed */
    CHECK_NEAR(flops_of_step(m), (double)(B * N), 0.0);
    CHECK_OK(ctx, dtr_backward(ctx, y));
    CHECK_NEAR(flops_of_step(m), (double)(4 * B * K * N + B * N + B * N), 0.0);
    CHECK_OK(ctx, dtr_context_reset(ctx));
    /* conv2d 3x3, stride 1, padding 1: out (2, 4, 8, 8), 2 * out * Cin*3*3 + out bias */
    y = dtr_conv2d(ctx, ramp(ctx, 4, cx, 0), ramp(ctx, 4, cw, 0), ramp(ctx, 1, cb, 0), 1, 1);
    CHECK(y != NULL);
    CHECK_NEAR(flops_of_step(m), 2.0 * (2 * 4 * 8 * 8) * (3 * 3 * 3) + 2 * 4 * 8 * 8, 0.0);
    CHECK_OK(ctx, dtr_context_reset(ctx));
    /* attention, B=2 T=5 C=8, 2 heads: q k^T and att v are 2*B*T*T*C each; the scale and
       the softmax one per score (B*H*T*T each); reshapes and permutes none */
    y = dtr_attention(ctx, ramp(ctx, 3, qs, 0), ramp(ctx, 3, qs, 0), ramp(ctx, 3, qs, 0), 2);
    CHECK(y != NULL);
    CHECK_NEAR(flops_of_step(m), 4.0 * 2 * 5 * 5 * 8 + 2.0 * 2 * 2 * 5 * 5, 0.0);
done:
    dtr_metrics_destroy(m);
    dtr_context_destroy(ctx);
}

/* ---- phases of a step ---- */

typedef struct seen { int n; dtr_step_metrics last; } seen;
static void on_step(void *user, const dtr_step_metrics *s) {
    seen *v = (seen *)user;
    v->n++;
    v->last = *s;
}

static dtr_loader *memory_loader(float *x, int32_t *y, int64_t count, int64_t batch, dtr_dataset **ds) {
    dtr_memory_dataset_config mc = dtr_memory_dataset_config_init();
    dtr_loader_config lc = dtr_loader_config_init();
    dtr_loader *l = NULL;
    char err[256];
    int64_t i;
    for (i = 0; i < count * IN; i++) x[i] = data_x(0, i / IN, (int)(i % IN));
    for (i = 0; i < count; i++) y[i] = data_y(0, i);
    mc.count = count;
    mc.layout.x_dtype = DTR_F32;
    mc.layout.x_ndim = 1;
    mc.layout.x_shape[0] = IN;
    mc.layout.y_dtype = DTR_I32;
    mc.x = x;
    mc.y = y;
    if (dtr_dataset_from_memory(&mc, ds, err, sizeof err) != DTR_OK) { fprintf(stderr, "%s\n", err); return NULL; }
    lc.batch_size = batch;
    if (dtr_loader_create(*ds, &lc, &l, err, sizeof err) != DTR_OK) fprintf(stderr, "%s\n", err);
    return l;
}

static double time_sum(const dtr_step_metrics *s) {
    double t = 0;
    int p;
    for (p = 0; p < DTR_PHASE_COUNT; p++) t += s->time[p];
    return t;
}

/* one MLP step from the loader; the checkpoint phase (app-marked) sleeps 2 ms */
static dtr_result mlp_loader_step(mlp *n, dtr_metrics *m, dtr_loader *l, int ckpt) {
    dtr_batch b;
    dtr_tensor *loss;
    dtr_result r = dtr_loader_next(l, &b);
    int64_t ys[1];
    if (r != DTR_OK) return r;
    ys[0] = b.size;
    loss = dtr_cross_entropy(n->ctx, dtr_linear_layer_forward(n->ctx, &n->l2, dtr_relu(n->ctx,
                                         dtr_linear_layer_forward(n->ctx, &n->l1,
                                                                  dtr_tensor_from(n->ctx, DTR_F32, b.x_ndim, b.x_shape, b.x)))),
                             dtr_tensor_from(n->ctx, DTR_I32, 1, ys, b.y));
    if (!loss) return dtr_context_status(n->ctx);
    if ((r = dtr_backward(n->ctx, loss)) != DTR_OK) return r;
    if ((r = dtr_optimizer_step(n->opt, NULL)) != DTR_OK) return r;
    if (ckpt) {
        if ((r = dtr_metrics_phase_begin(m, DTR_PHASE_CHECKPOINT)) != DTR_OK) return r;
        sleep_ms(2);
        r = dtr_metrics_phase_end(m, DTR_PHASE_CHECKPOINT);
    }
    return r;
}

static void check_jsonl(const char *path, int steps) {
    static const char *const keys[] = {"\"rank\":0", "\"step\":", "\"epoch\":", "\"loss\":", "\"lr\":0.05",
                                       "\"grad_norm\":", "\"samples\":16", "\"tokens\":0", "\"samples_per_s\":",
                                       "\"tokens_per_s\":", "\"time\":{\"step\":", "\"data\":", "\"forward\":",
                                       "\"backward\":", "\"comm\":", "\"optimizer\":", "\"checkpoint\":",
                                       "\"flops\":", "\"mfu\":", "\"skipped\":0"};
    char *text = slurp(path), *line, *save = NULL;
    int n = 0;
    size_t k;
    CHECK(text != NULL);
    if (!text) return;
    for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save), n++) {
        for (k = 0; k < sizeof keys / sizeof keys[0]; k++) CHECK_MSG(strstr(line, keys[k]), "line %d lacks %s", n, keys[k]);
        CHECK_EQ_INT((long long)num_field(line, "step"), 100 + n);
        CHECK(num_field(line, "grad_norm") > 0);
        CHECK(line[0] == '{' && line[strlen(line) - 1] == '}');
    }
    CHECK_EQ_INT(n, steps);
    free(text);
}

static void test_step_phases(void) {
    enum { STEPS = 6, COUNT = 64, BATCH = 16 };
    static float x[COUNT * IN];
    static int32_t y[COUNT];
    dtr_metrics_config mc = dtr_metrics_config_init();
    dtr_metrics *m = NULL;
    dtr_dataset *ds = NULL;
    dtr_loader *l;
    char path[256];
    seen v = {0, {0}};
    mlp n;
    int t;
    if (!mlp_init(&n, 3, 1)) { CHECK(!"mlp_init"); return; }
    l = memory_loader(x, y, COUNT, BATCH, &ds);
    CHECK(l != NULL);
    tmp_path("dtr_obs", "steps.jsonl", path, sizeof path);
    remove(path);
    mc.jsonl_path = path;
    mc.callback = on_step;
    mc.user = &v;
    mc.grad_norm = 1;
    mc.first_step = 100;
    mc.peak_flops = 1e12;
    CHECK_OK(n.ctx, dtr_metrics_create(n.ctx, &mc, &m));
    if (m && l) CHECK_OK(n.ctx, dtr_metrics_watch_loader(m, l));
    for (t = 0; m && l && t < STEPS; t++) {
        dtr_step_info info;
        dtr_step_metrics s;
        memset(&info, 0, sizeof info);
        info.samples = BATCH;
        info.loss = 1.5;
        CHECK_OK(n.ctx, dtr_metrics_step_begin(m));
        CHECK_OK(n.ctx, mlp_loader_step(&n, m, l, 1));
        CHECK_OK(n.ctx, dtr_context_reset(n.ctx));
        CHECK_OK(n.ctx, dtr_metrics_step_end(m, &info, &s));
        CHECK_MSG(fabs(time_sum(&s) - s.time_step) <= 0.05 * s.time_step, "parts %g vs step %g", time_sum(&s),
                  s.time_step);
        CHECK(s.time[DTR_PHASE_DATA] > 0 && s.time[DTR_PHASE_FORWARD] > 0 && s.time[DTR_PHASE_BACKWARD] > 0);
        CHECK(s.time[DTR_PHASE_OPTIMIZER] > 0 && s.time[DTR_PHASE_CHECKPOINT] >= 0.002);
        CHECK(s.time[DTR_PHASE_COMM] == 0);
        CHECK_NEAR(s.lr, 0.05, 1e-7);
        CHECK(s.grad_norm > 0 && s.flops > 0 && s.mfu > 0 && s.mfu < 1);
        CHECK_NEAR(s.samples_per_s, BATCH / s.time_step, 1e-6 * s.samples_per_s);
        CHECK_EQ_INT(s.step, 100 + t);
        CHECK_EQ_INT(v.n, t + 1);
        CHECK(memcmp(&v.last, &s, sizeof s) == 0);
    }
    dtr_metrics_destroy(m);
    check_jsonl(path, STEPS);
    remove(path);
    dtr_loader_destroy(l);
    dtr_dataset_destroy(ds);
    mlp_free(&n);
}

static void test_phase_errors(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_metrics_config mc = dtr_metrics_config_init();
    dtr_metrics *m = NULL, *m2 = NULL;
    CHECK_OK(ctx, dtr_metrics_create(ctx, NULL, &m));
    CHECK(dtr_metrics_phase_begin(m, (dtr_phase)7) == DTR_INVALID_ARGUMENT);
    CHECK(dtr_metrics_phase_end(m, DTR_PHASE_CHECKPOINT) == DTR_BAD_STATE);
    CHECK_OK(ctx, dtr_metrics_phase_begin(m, DTR_PHASE_CHECKPOINT));
    CHECK(dtr_metrics_phase_end(m, DTR_PHASE_DATA) == DTR_BAD_STATE);
    CHECK(strstr(dtr_context_last_error(ctx), "phase 7 is not a dtr_phase") != NULL);   /* the first error stays */
    CHECK(dtr_metrics_create(ctx, NULL, &m2) == DTR_BAD_STATE && !m2);   /* one per context */
    CHECK(dtr_metrics_create(NULL, NULL, &m2) == DTR_NULL_HANDLE);
    CHECK(dtr_metrics_step_end(NULL, NULL, NULL) == DTR_NULL_HANDLE);
    dtr_metrics_destroy(m);
    dtr_context_destroy(ctx);
    ctx = test_ctx(1);
    mc.jsonl_path = "/nonexistent-dir/x/metrics.jsonl";
    CHECK(dtr_metrics_create(ctx, &mc, &m2) == DTR_IO_ERROR && !m2);
    CHECK(strstr(dtr_context_last_error(ctx), "nonexistent") != NULL);
    dtr_context_destroy(ctx);
}

/* ---- data-parallel ranks as threads ---- */

typedef struct obs_job {
    int world, steps, slow_rank, slow_ms;
    dtr_local_world *w;
    char trace[8][256];
    dtr_straggler_report rep[8];
    int64_t counts[8][8];
    int buckets;
    int fails;
    int bad_sums;        /* steps whose parts did not add up to the step time (within 5%) */
    double comm[8];      /* each rank's comm time over its steps */
} obs_job;

typedef struct obs_rank { obs_job *job; int rank; } obs_rank;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static void fail_rank(obs_job *j, const char *what, dtr_result r, const char *msg) {
    pthread_mutex_lock(&g_mu);
    j->fails++;
    fprintf(stderr, "  rank: %s: %s (%s)\n", what, dtr_result_string(r), msg);
    pthread_mutex_unlock(&g_mu);
}

static dtr_result obs_steps(obs_job *j, int rank, mlp *n, dtr_dp *dp, dtr_metrics *m) {
    dtr_result r = DTR_OK;
    dtr_step_metrics s;
    int t;
    for (t = 0; t < j->steps && r == DTR_OK; t++) {
        if ((r = dtr_metrics_step_begin(m)) != DTR_OK) break;
        if (rank == j->slow_rank) sleep_ms(j->slow_ms);
        if ((r = mlp_backward(n, t, (int64_t)rank * 8, 8)) != DTR_OK) break;
        if ((r = dtr_dp_finish(dp)) != DTR_OK) break;
        if ((r = dtr_optimizer_step(n->opt, NULL)) != DTR_OK) break;
        dtr_context_reset(n->ctx);
        if ((r = dtr_metrics_step_end(m, NULL, &s)) != DTR_OK) break;
        j->comm[rank] += s.time[DTR_PHASE_COMM];
        if (!(fabs(time_sum(&s) - s.time_step) <= 0.05 * s.time_step) || !(s.comm_wait <= s.time[DTR_PHASE_COMM])) {
            pthread_mutex_lock(&g_mu);
            j->bad_sums++;
            pthread_mutex_unlock(&g_mu);
        }
    }
    return r;
}

static void *obs_rank_main(void *arg) {
    obs_rank *or_ = (obs_rank *)arg;
    obs_job *j = or_->job;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_metrics_config mc = dtr_metrics_config_init();
    dtr_comm *c = NULL;
    dtr_dp *dp = NULL;
    dtr_metrics *m = NULL;
    char err[256];
    dtr_result r;
    mlp n;
    cfg.local.world = j->w;
    cfg.local.rank = or_->rank;
    cfg.timeout_ms = 20000;
    if ((r = dtr_comm_create(&cfg, &c, err, sizeof err)) != DTR_OK || !mlp_init(&n, 7, 1)) {
        fail_rank(j, "setup", r, err);
        return NULL;
    }
    dc.bucket_bytes = 64;   /* one bucket per parameter: most start during backward */
    mc.rank = or_->rank;
    mc.trace_path = j->trace[or_->rank][0] ? j->trace[or_->rank] : NULL;
    r = dtr_dp_create(n.m, c, &dc, &dp);
    if (r == DTR_OK) r = dtr_metrics_create(n.ctx, &mc, &m);
    if (r == DTR_OK) r = obs_steps(j, or_->rank, &n, dp, m);
    if (r == DTR_OK && j->slow_rank >= 0)
        r = dtr_metrics_stragglers(m, c, &j->rep[or_->rank], j->counts[or_->rank]);
    if (r != DTR_OK) fail_rank(j, "steps", r, dtr_context_last_error(n.ctx));
    if (or_->rank == 0 && dp) j->buckets = dtr_dp_bucket_count(dp);
    dtr_metrics_destroy(m);   /* writes the trace */
    dtr_dp_destroy(dp);
    dtr_comm_destroy(c);
    mlp_free(&n);
    return NULL;
}

static void obs_run(obs_job *j) {
    pthread_t tid[8];
    obs_rank rk[8];
    int i;
    CHECK_OK(NULL, dtr_local_world_create(j->world, NULL, &j->w));
    for (i = 0; i < j->world; i++) {
        rk[i].job = j;
        rk[i].rank = i;
        pthread_create(&tid[i], NULL, obs_rank_main, &rk[i]);
    }
    for (i = 0; i < j->world; i++) pthread_join(tid[i], NULL);
    dtr_local_world_destroy(j->w);
}

/* ---- the timeline ---- */

typedef struct span { char name[32], cat[16]; int pid, tid; double ts, dur; } span;

/* the "X" events of a trace file (one per line, as dtr_metrics_write_trace writes them) */
static int read_spans(const char *path, span *out, int cap, int *unclosed) {
    char *text = slurp(path), *line, *save = NULL;
    int n = 0;
    *unclosed = 0;
    if (!text) return -1;
    for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char ph[8];
        if (strcmp(str_field(line, "ph", ph, sizeof ph), "X") != 0) continue;
        if (n >= cap) break;
        str_field(line, "name", out[n].name, sizeof out[n].name);
        str_field(line, "cat", out[n].cat, sizeof out[n].cat);
        out[n].pid = (int)num_field(line, "pid");
        out[n].tid = (int)num_field(line, "tid");
        out[n].ts = num_field(line, "ts");
        out[n].dur = num_field(line, "dur");
        if (!(out[n].dur >= 0) || !(out[n].ts > 0)) (*unclosed)++;
        n++;
    }
    free(text);
    return n;
}

static int count_spans(const span *s, int n, int pid, const char *name, const char *cat) {
    int i, k = 0;
    for (i = 0; i < n; i++) k += s[i].pid == pid && !strcmp(s[i].name, name) && !strcmp(s[i].cat, cat);
    return k;
}

/* all-reduce spans (rows >= 1) of rank pid that overlap one of its backward phase spans */
static int overlapping_buckets(const span *s, int n, int pid) {
    int i, k, hits = 0;
    for (i = 0; i < n; i++) {
        if (s[i].pid != pid || strcmp(s[i].name, "all_reduce") || s[i].tid < 1) continue;
        for (k = 0; k < n; k++)
            if (s[k].pid == pid && !strcmp(s[k].name, "backward") && !strcmp(s[k].cat, "phase") &&
                s[i].ts < s[k].ts + s[k].dur && s[i].ts + s[i].dur > s[k].ts) {
                hits++;
                break;
            }
    }
    return hits;
}

static void check_rank_spans(const span *s, int n, int pid, int steps, int buckets) {
    static const char *const fwd[] = {"linear", "relu", "cross_entropy"};
    int k, ar = count_spans(s, n, pid, "all_reduce", "comm");
    for (k = 0; k < 3; k++) {
        CHECK_MSG(count_spans(s, n, pid, fwd[k], "forward") >= steps, "rank %d: %s forward", pid, fwd[k]);
        CHECK_MSG(count_spans(s, n, pid, fwd[k], "backward") >= steps, "rank %d: %s backward", pid, fwd[k]);
    }
    CHECK_EQ_INT(count_spans(s, n, pid, "backward", "phase"), steps);
    CHECK_EQ_INT(count_spans(s, n, pid, "optimizer", "phase"), steps);
    CHECK_EQ_INT(count_spans(s, n, pid, "comm", "phase"), steps);
    CHECK_EQ_INT(ar, steps * buckets);
    CHECK_EQ_INT(count_spans(s, n, pid, "wait", "comm"), steps * buckets);
    /* buckets started by the gradient hook run during backward: at least one per step */
    CHECK_MSG(overlapping_buckets(s, n, pid) >= steps, "rank %d: %d of %d all-reduce spans overlap backward", pid,
              overlapping_buckets(s, n, pid), ar);
}

static void test_trace_dp(void) {
    obs_job j;
    char merged[256], again[256], err[256];
    const char *in[2];
    span *s = (span *)malloc(4096 * sizeof(span));
    int n, unclosed, r;
    memset(&j, 0, sizeof j);
    j.world = 2;
    j.steps = 3;
    j.slow_rank = -1;
    tmp_path("dtr_obs", "rank0.trace.json", j.trace[0], sizeof j.trace[0]);
    tmp_path("dtr_obs", "rank1.trace.json", j.trace[1], sizeof j.trace[1]);
    tmp_path("dtr_obs", "merged.trace.json", merged, sizeof merged);
    tmp_path("dtr_obs", "again.trace.json", again, sizeof again);
    obs_run(&j);
    CHECK_EQ_INT(j.fails, 0);
    CHECK_EQ_INT(j.bad_sums, 0);
    CHECK(j.comm[0] > 0 && j.comm[1] > 0);
    CHECK_EQ_INT(j.buckets, 4);
    in[0] = j.trace[0];
    in[1] = j.trace[1];
    r = dtr_trace_merge(in, 2, merged, err, sizeof err);   /* parses both with the JSON reader */
    CHECK_MSG(r == DTR_OK, "%s", err);
    in[0] = merged;
    r = dtr_trace_merge(in, 1, again, err, sizeof err);    /* and the merged file */
    CHECK_MSG(r == DTR_OK, "%s", err);
    n = read_spans(merged, s, 4096, &unclosed);
    CHECK(n > 0);
    CHECK_EQ_INT(unclosed, 0);
    for (r = 0; r < 2 && n > 0; r++) check_rank_spans(s, n, r, j.steps, j.buckets);
    CHECK_EQ_INT(read_spans(again, s, 4096, &unclosed), n);
    remove(j.trace[0]); remove(j.trace[1]); remove(merged); remove(again);
    free(s);
}

static void test_trace_ring(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_metrics_config mc = dtr_metrics_config_init();
    dtr_metrics *m = NULL;
    const int64_t xs[2] = {2, 3};
    char path[256], err[256];
    span s[16];
    int i, n, unclosed;
    const char *in[1];
    tmp_path("dtr_obs", "ring.trace.json", path, sizeof path);
    mc.trace_path = path;
    mc.trace_events = 8;
    CHECK_OK(ctx, dtr_metrics_create(ctx, &mc, &m));
    for (i = 0; i < 20 && m; i++) CHECK(dtr_relu(ctx, ramp(ctx, 2, xs, 0)) != NULL);
    CHECK(dtr_abs(ctx, ramp(ctx, 2, xs, 0)) != NULL);   /* the newest event */
    CHECK_EQ_INT(dtr_metrics_trace_dropped(m), 13);
    CHECK_OK(ctx, dtr_metrics_write_trace(m));
    n = read_spans(path, s, 16, &unclosed);
    CHECK_EQ_INT(n, 8);
    CHECK(n == 8 && strcmp(s[7].name, "abs") == 0 && strcmp(s[0].name, "relu") == 0);
    for (i = 1; i < n; i++) CHECK(s[i].ts >= s[i - 1].ts);
    in[0] = path;
    CHECK(dtr_trace_merge(in, 1, path, err, sizeof err) == DTR_OK);
    dtr_metrics_destroy(m);
    remove(path);
    dtr_context_destroy(ctx);
}

static void test_straggler(void) {
    obs_job j;
    int r;
    memset(&j, 0, sizeof j);
    j.world = 3;
    j.steps = 6;
    j.slow_rank = 2;
    j.slow_ms = 50;
    obs_run(&j);
    CHECK_EQ_INT(j.fails, 0);
    CHECK_EQ_INT(j.bad_sums, 0);
    for (r = 0; r < 3; r++) {
        CHECK_EQ_INT(j.rep[r].steps, 6);
        CHECK_EQ_INT(j.rep[r].slowest_rank, 2);
        CHECK_MSG(j.rep[r].slowest_count >= 5, "rank 2 last in %lld of 6 steps", (long long)j.rep[r].slowest_count);
        CHECK_EQ_INT(j.counts[r][0] + j.counts[r][1] + j.counts[r][2], 6);
        CHECK(j.rep[r].others_wait_s > 0.015 && j.rep[r].slowest_wait_s < j.rep[r].others_wait_s);
    }
}

static void test_merge_errors(void) {
    char bad[256], out[256], err[256];
    const char *in[2];
    tmp_path("dtr_obs", "bad.json", bad, sizeof bad);
    tmp_path("dtr_obs", "out.json", out, sizeof out);
    CHECK(write_file(bad, "{\"traceEvents\":[{\"ph\":\"X\",}]}", 30));
    in[0] = bad;
    CHECK(dtr_trace_merge(in, 1, out, err, sizeof err) == DTR_CORRUPT_FILE);
    CHECK(strstr(err, "bad.json") != NULL);
    CHECK(write_file(bad, "{\"other\":1}", 11));
    CHECK(dtr_trace_merge(in, 1, out, err, sizeof err) == DTR_CORRUPT_FILE);
    CHECK(strstr(err, "traceEvents") != NULL);
    in[0] = "/nonexistent/trace.json";
    CHECK(dtr_trace_merge(in, 1, out, err, sizeof err) == DTR_IO_ERROR);
    CHECK(dtr_trace_merge(in, 0, out, err, sizeof err) == DTR_INVALID_ARGUMENT);
    CHECK(access(out, F_OK) != 0);   /* nothing half-written */
    remove(bad);
}

int main(void) {
    alarm(120);
    (void)rel_err;   /* dp_mlp.h's, unused here */
    RUN(test_flops);
    RUN(test_step_phases);
    RUN(test_phase_errors);
    RUN(test_trace_dp);
    RUN(test_trace_ring);
    RUN(test_straggler);
    RUN(test_merge_errors);
    return test_summary();
}
