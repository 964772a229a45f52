/* tests/test_health.c: numeric health. Anomaly mode names the first op that makes a NaN or
 * an infinity, in forward (0/0, x/0, NaN data through a linear layer) and in backward (a
 * product whose forward is finite but whose gradient overflows); the optimizer's nonfinite
 * policy (skip by default, stop, warn) on the case a new user hit: NaN in one input sample,
 * loss finite, a NaN gradient that used to reach the parameters; dtr_clip_grad_norm refusing
 * a non-finite norm; the same decision on every rank of a data-parallel run; the progress
 * line. */
#include "test.h"
#include <pthread.h>
#include "dp_mlp.h"

static int all_finite(const float *x, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

/* ---- anomaly mode ---- */

/* x / y with x, y data of 4 values, y[idx] = 0 and x[idx] = num */
static dtr_tensor *div_at(dtr_context *ctx, float num, int idx) {
    int64_t s[1] = {4};
    float x[4] = {1, 2, 3, 4}, y[4] = {1, 1, 1, 1};
    x[idx] = num;
    y[idx] = 0.0f;
    return dtr_div(ctx, dtr_scale(ctx, dtr_tensor_from(ctx, DTR_F32, 1, s, x), 2.0f), dtr_tensor_from(ctx, DTR_F32, 1, s, y));
}

static void t_anomaly_off_by_default(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_tensor *q = div_at(ctx, 0.0f, 2);
    CHECK(q != NULL);
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_OK);
    CHECK(q && isnan(((float *)dtr_tensor_data(q))[2]));
    CHECK_EQ_INT(dtr_context_set_anomaly(ctx, 1), 0);
    CHECK_EQ_INT(dtr_context_set_anomaly(ctx, 1), 1);
    CHECK_EQ_INT(dtr_context_set_anomaly(NULL, 1), 0);
    CHECK(strcmp(dtr_result_string(DTR_NONFINITE), "non-finite value") == 0);
    dtr_context_destroy(ctx);
}

static void t_anomaly_forward_div(void) {
    dtr_context *ctx = test_ctx(1);
    const char *msg;
    dtr_context_set_anomaly(ctx, 1);
    CHECK(div_at(ctx, 0.0f, 1) == NULL);   /* 0 / 0 */
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_NONFINITE);
    msg = dtr_context_last_error(ctx);
    CHECK_MSG(strstr(msg, "forward of op 'div'") && strstr(msg, "NaN") && strstr(msg, "(4)") &&
              strstr(msg, "not on the tape"), "%s", msg);
    dtr_context_clear_error(ctx);
    dtr_context_reset(ctx);
    CHECK(div_at(ctx, 5.0f, 3) == NULL);   /* 10 / 0 */
    msg = dtr_context_last_error(ctx);
    CHECK_MSG(strstr(msg, "forward of op 'div'") && strstr(msg, "produced Inf"), "%s", msg);
    dtr_context_set_anomaly(ctx, 0);
    dtr_context_clear_error(ctx);
    dtr_context_reset(ctx);
    CHECK(div_at(ctx, 5.0f, 3) != NULL);       /* off again: no check */
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_OK);
    dtr_context_destroy(ctx);
}

/* 16-bit activations are checked too: fp16 overflows past 65504 (the f32 result of the
 * kernel is finite; the stored output is not), and a bf16 input already held the NaN */
static void t_anomaly_narrow(void) {
    dtr_context_config cfg = dtr_context_config_init();
    dtr_context *ctx = NULL;
    int64_t s[1] = {4};
    float x[4] = {1, 2, 40000, 4};
    dtr_tensor *h;
    const char *msg;
    cfg.threads = 1;
    cfg.activation_dtype = DTR_F16;
    CHECK(dtr_context_create(&cfg, &ctx) == DTR_OK);
    dtr_context_set_anomaly(ctx, 1);
    h = dtr_tensor_from(ctx, DTR_F32, 1, s, x);
    CHECK(dtr_scale(ctx, h, 1.5f) != NULL);          /* 60000: fp16 holds it */
    CHECK(dtr_scale(ctx, h, 2.0f) == NULL);          /* 80000: Inf in fp16 */
    msg = dtr_context_last_error(ctx);
    CHECK_MSG(strstr(msg, "forward of op 'scale'") && strstr(msg, "produced Inf"), "%s", msg);
    dtr_context_clear_error(ctx);
    dtr_context_set_anomaly(ctx, 0);
    h = dtr_scale(ctx, h, 2.0f);                      /* off: stored as Inf */
    dtr_context_set_anomaly(ctx, 1);
    CHECK(h && dtr_relu(ctx, h) == NULL);
    msg = dtr_context_last_error(ctx);
    CHECK_MSG(strstr(msg, "forward of op 'relu'") && strstr(msg, "input 0 (4)") && strstr(msg, "already held Inf"), "%s", msg);
    dtr_context_destroy(ctx);
}

/* NaN in the data: the first op that reads it (the linear layer, tape position 0) is named,
 * and so is its input that held the NaN already */
static void t_anomaly_forward_data(void) {
    mlp n;
    int64_t xs[2] = {2, IN};
    float x[2 * IN];
    const char *msg;
    int k;
    CHECK(mlp_init(&n, 7, 1));
    for (k = 0; k < 2 * IN; k++) x[k] = 0.1f * (float)(k % 7);
    x[IN + 3] = NAN;
    dtr_context_set_anomaly(n.ctx, 1);
    CHECK(dtr_linear_layer_forward(n.ctx, &n.l1, dtr_tensor_from(n.ctx, DTR_F32, 2, xs, x)) == NULL);
    msg = dtr_context_last_error(n.ctx);
    CHECK_MSG(strstr(msg, "forward of op 'linear' (tape position 0)") && strstr(msg, "(2, 32)") &&
              strstr(msg, "input 0 (2, 20) (data or a constant") && strstr(msg, "already held NaN"), "%s", msg);
    mlp_free(&n);
}

/* forward finite (1e30 * 1e-30 = 1, times 1e30), backward overflows: d/db of a*b is
 * 1e30 * a = 1e60, Inf in float, in the gradient of parameter "b" */
static void t_anomaly_backward(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    int64_t s[1] = {3};
    float av[3] = {1, 1e30f, 1};
    dtr_tensor *b, *loss;
    const char *msg;
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    b = dtr_model_param(m, "b", 1, s, DTR_INIT_ZEROS, 0.0f);
    CHECK_OK(ctx, dtr_model_build(m));
    ((float *)dtr_tensor_data(b))[1] = 1e-30f;
    dtr_context_set_anomaly(ctx, 1);
    loss = dtr_sum_all(ctx, dtr_scale(ctx, dtr_mul(ctx, dtr_tensor_from(ctx, DTR_F32, 1, s, av), b), 1e30f));
    CHECK(loss != NULL);
    CHECK(loss && isfinite(((float *)dtr_tensor_data(loss))[0]));
    CHECK_EQ_INT(dtr_backward(ctx, loss), DTR_NONFINITE);
    msg = dtr_context_last_error(ctx);
    CHECK_MSG(strstr(msg, "backward of op 'mul' (tape position 0)") && strstr(msg, "Inf") &&
              strstr(msg, "input 1 (3) (parameter 'b')"), "%s", msg);
    /* the same graph without anomaly mode: OK, and the Inf reaches the gradient silently */
    dtr_context_clear_error(ctx);
    dtr_context_reset(ctx);
    dtr_model_zero_grad(m);
    dtr_context_set_anomaly(ctx, 0);
    loss = dtr_sum_all(ctx, dtr_scale(ctx, dtr_mul(ctx, dtr_tensor_from(ctx, DTR_F32, 1, s, av), b), 1e30f));
    CHECK_OK(ctx, dtr_backward(ctx, loss));
    CHECK(isinf(dtr_model_grads(m)[1]));
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* ---- the nonfinite policy: NaN in one input sample ---- */

/* forward + backward of the MLP on 4 rows of step t, row `nan_row` with a NaN feature (-1:
 * none); the loss into *loss */
static dtr_result nan_backward(mlp *n, int64_t t, int nan_row, float *loss) {
    int64_t xs[2] = {4, IN}, ys[1] = {4};
    float x[4 * IN];
    int32_t y[4];
    dtr_tensor *l;
    int i, k;
    for (i = 0; i < 4; i++) {
        for (k = 0; k < IN; k++) x[i * IN + k] = data_x(t, i, k);
        y[i] = data_y(t, i);
    }
    if (nan_row >= 0) x[nan_row * IN + 5] = NAN;
    l = dtr_cross_entropy(n->ctx, dtr_linear_layer_forward(n->ctx, &n->l2, dtr_relu(n->ctx,
                              dtr_linear_layer_forward(n->ctx, &n->l1, dtr_tensor_from(n->ctx, DTR_F32, 2, xs, x)))),
                          dtr_tensor_from(n->ctx, DTR_I32, 1, ys, y));
    if (!l) return dtr_context_status(n->ctx);
    *loss = ((float *)dtr_tensor_data(l))[0];
    return dtr_backward(n->ctx, l);
}

typedef struct logged { int warns; char last[512]; } logged;
static void log_cb(void *user, dtr_log_level level, const char *msg) {
    logged *lg = (logged *)user;
    if (level == DTR_LOG_WARN) lg->warns++;
    snprintf(lg->last, sizeof lg->last, "%s", msg);
}

/* an mlp (SGD, no momentum) with the given policy, its context logging into lg */
static int policy_mlp(mlp *n, dtr_nonfinite_policy policy, logged *lg) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.05f);
    memset(n, 0, sizeof *n);
    cc.threads = 1;
    cc.log = log_cb;
    cc.log_user = lg;
    oc.nonfinite = policy;
    if (dtr_context_create(&cc, &n->ctx) != DTR_OK || dtr_model_create(n->ctx, 7, &n->m) != DTR_OK) return 0;
    if (dtr_linear_layer_init(&n->l1, n->m, "l1", IN, HID, 1, DTR_INIT_KAIMING_UNIFORM) != DTR_OK) return 0;
    if (dtr_linear_layer_init(&n->l2, n->m, "l2", HID, OUT, 1, DTR_INIT_KAIMING_UNIFORM) != DTR_OK) return 0;
    if (dtr_model_build(n->m) != DTR_OK) return 0;
    return dtr_optimizer_create(n->m, &oc, &n->opt) == DTR_OK;
}

/* the new user's case, under the default policy: everything returns OK up to the step, the
 * gradient is not finite (the loss need not show it: t_anomaly_backward has a finite loss
 * with an infinite gradient); the step is skipped and the parameters stay as they
 * were; the next clean step updates */
static void t_nan_input_skipped_by_default(void) {
    mlp n;
    logged lg = {0, ""};
    float loss = 0, norm = 0, *before;
    int64_t np;
    int updated = -1;
    CHECK(dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f).nonfinite == DTR_NONFINITE_SKIP);
    CHECK(policy_mlp(&n, DTR_NONFINITE_SKIP, &lg));
    np = dtr_model_numel(n.m);
    before = (float *)malloc((size_t)np * sizeof(float));
    memcpy(before, dtr_model_params(n.m), (size_t)np * sizeof(float));
    CHECK_OK(n.ctx, nan_backward(&n, 0, 2, &loss));
    (void)loss;   /* NaN here; the check looks at the gradient, which a NaN anywhere upstream reaches */
    CHECK(!all_finite(dtr_model_grads(n.m), np));
    /* clipping refuses to scale by NaN, without making the error sticky */
    CHECK_EQ_INT(dtr_clip_grad_norm(n.m, 1.0f, &norm), DTR_NONFINITE);
    CHECK(isnan(norm));
    CHECK_EQ_INT(dtr_context_status(n.ctx), DTR_OK);
    CHECK_MSG(strstr(dtr_context_last_error(n.ctx), "dtr_clip_grad_norm: the gradients' global norm is NaN"), "%s",
              dtr_context_last_error(n.ctx));
    CHECK_OK(n.ctx, dtr_optimizer_step(n.opt, &updated));
    CHECK_EQ_INT(updated, 0);
    CHECK_EQ_INT(dtr_optimizer_skipped(n.opt), 1);
    CHECK_EQ_INT(dtr_optimizer_steps(n.opt), 0);
    CHECK(isnan(dtr_optimizer_grad_norm(n.opt)));
    CHECK(memcmp(before, dtr_model_params(n.m), (size_t)np * sizeof(float)) == 0);
    CHECK(all_finite(dtr_model_grads(n.m), np));   /* zeroed */
    CHECK_MSG(lg.warns >= 2 && strstr(lg.last, "update skipped"), "%d %s", lg.warns, lg.last);
    dtr_context_reset(n.ctx);
    CHECK_OK(n.ctx, nan_backward(&n, 1, -1, &loss));
    CHECK_OK(n.ctx, dtr_optimizer_step(n.opt, &updated));
    CHECK_EQ_INT(updated, 1);
    CHECK_EQ_INT(dtr_optimizer_steps(n.opt), 1);
    CHECK(dtr_optimizer_grad_norm(n.opt) > 0 && isfinite(dtr_optimizer_grad_norm(n.opt)));
    CHECK(memcmp(before, dtr_model_params(n.m), (size_t)np * sizeof(float)) != 0);
    CHECK(all_finite(dtr_model_params(n.m), np));
    free(before);
    mlp_free(&n);
}

static void t_nan_input_stop_warn_off(void) {
    dtr_nonfinite_policy pol[3] = {DTR_NONFINITE_STOP, DTR_NONFINITE_WARN, DTR_NONFINITE_OFF};
    int i;
    for (i = 0; i < 3; i++) {
        mlp n;
        logged lg = {0, ""};
        float loss;
        int updated = -1;
        dtr_result r;
        CHECK(policy_mlp(&n, pol[i], &lg));
        CHECK_OK(n.ctx, nan_backward(&n, 0, 0, &loss));
        r = dtr_optimizer_step(n.opt, &updated);
        CHECK_EQ_INT(dtr_optimizer_skipped(n.opt), 0);
        if (pol[i] == DTR_NONFINITE_STOP) {
            CHECK_EQ_INT(r, DTR_NONFINITE);
            CHECK_EQ_INT(updated, 0);
            CHECK(all_finite(dtr_model_params(n.m), dtr_model_numel(n.m)));
            CHECK_MSG(strstr(dtr_context_last_error(n.ctx), "global norm is NaN before update 1: stopped"), "%s",
                      dtr_context_last_error(n.ctx));
            CHECK_EQ_INT(dtr_context_status(n.ctx), DTR_NONFINITE);
        } else {   /* the old behaviour: NaN reaches the parameters; WARN says so */
            CHECK_OK(n.ctx, r);
            CHECK_EQ_INT(updated, 1);
            CHECK(!all_finite(dtr_model_params(n.m), dtr_model_numel(n.m)));
            CHECK_EQ_INT(lg.warns, pol[i] == DTR_NONFINITE_WARN ? 1 : 0);
            if (pol[i] == DTR_NONFINITE_OFF) CHECK(dtr_optimizer_grad_norm(n.opt) == -1.0);
            else CHECK(isnan(dtr_optimizer_grad_norm(n.opt)));
        }
        mlp_free(&n);
    }
}

static void t_bad_policy(void) {
    mlp n;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    dtr_optimizer *o = NULL;
    CHECK(mlp_init(&n, 7, 1));
    oc.nonfinite = (dtr_nonfinite_policy)9;
    CHECK_EQ_INT(dtr_optimizer_create(n.m, &oc, &o), DTR_INVALID_ARGUMENT);
    CHECK(o == NULL);
    CHECK_EQ_INT(dtr_optimizer_skipped(NULL), 0);
    mlp_free(&n);
}

/* ---- data parallel: rank 1's sample is NaN; both ranks skip the same step ---- */

typedef struct dp_nan { dtr_local_world *w; int rank; dtr_result r; int64_t skipped, steps; int finite; float *params; int64_t np; } dp_nan;

static void *dp_nan_rank(void *arg) {
    dp_nan *d = (dp_nan *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_comm *c = NULL;
    dtr_dp *dp = NULL;
    char err[256];
    float loss;
    int t;
    mlp n;
    cfg.local.world = d->w;
    cfg.local.rank = d->rank;
    cfg.timeout_ms = 20000;
    d->r = dtr_comm_create(&cfg, &c, err, sizeof err);
    if (d->r != DTR_OK || !mlp_init(&n, 7, 1)) { d->r = DTR_BAD_STATE; return NULL; }
    d->r = dtr_dp_create(n.m, c, &dc, &dp);
    for (t = 0; t < 3 && d->r == DTR_OK; t++) {   /* step 1: rank 1's row 3 is NaN */
        if ((d->r = nan_backward(&n, t * 2 + d->rank, t == 1 && d->rank == 1 ? 3 : -1, &loss)) != DTR_OK) break;
        if ((d->r = dtr_dp_finish(dp)) != DTR_OK || (d->r = dtr_optimizer_step(n.opt, NULL)) != DTR_OK) break;
        d->r = dtr_dp_step_done(dp);
        dtr_context_reset(n.ctx);
    }
    d->skipped = dtr_optimizer_skipped(n.opt);
    d->steps = dtr_optimizer_steps(n.opt);
    d->np = dtr_model_numel(n.m);
    d->finite = all_finite(dtr_model_params(n.m), d->np);
    d->params = (float *)malloc((size_t)d->np * sizeof(float));
    memcpy(d->params, dtr_model_params(n.m), (size_t)d->np * sizeof(float));
    dtr_dp_destroy(dp);
    dtr_comm_destroy(c);
    mlp_free(&n);
    return NULL;
}

static void t_dp_same_decision(void) {
    dp_nan d[2];
    pthread_t tid[2];
    dtr_local_world *w = NULL;
    int i;
    CHECK_EQ_INT(dtr_local_world_create(2, NULL, &w), DTR_OK);
    for (i = 0; i < 2; i++) {
        memset(&d[i], 0, sizeof d[i]);
        d[i].w = w;
        d[i].rank = i;
        pthread_create(&tid[i], NULL, dp_nan_rank, &d[i]);
    }
    for (i = 0; i < 2; i++) pthread_join(tid[i], NULL);
    for (i = 0; i < 2; i++) {
        CHECK_EQ_INT(d[i].r, DTR_OK);
        CHECK_EQ_INT(d[i].skipped, 1);
        CHECK_EQ_INT(d[i].steps, 2);
        CHECK(d[i].finite);
    }
    CHECK(d[0].params && d[1].params && memcmp(d[0].params, d[1].params, (size_t)d[0].np * sizeof(float)) == 0);
    free(d[0].params);
    free(d[1].params);
    dtr_local_world_destroy(w);
}

/* ---- the progress line ---- */

static void t_progress_format(void) {
    char buf[160], small[12];
    dtr_progress_info p;
    size_t len;
    memset(&p, 0, sizeof p);
    p.epoch = 1;
    p.epochs = 2;
    p.step = 50;
    p.steps = 100;
    p.elapsed_s = 150.0;   /* 150 of 200 steps: 50 s to go */
    p.rate = 1234.4;
    p.loss = 0.51234;
    p.has_loss = 1;
    len = dtr_progress_format(buf, sizeof buf, &p);
    CHECK_MSG(strcmp(buf, "epoch 2/2 [##########..........]  50% 50/100 | 1234 samples/s | loss 0.5123 | ETA 50s") == 0,
              "%s", buf);
    CHECK_EQ_INT(len, strlen(buf));
    p.elapsed_s = 3000.0;
    p.rate_unit = "tokens/s";
    len = dtr_progress_format(buf, sizeof buf, &p);
    CHECK_MSG(strstr(buf, "1234 tokens/s") && strstr(buf, "ETA 16m40s"), "%s", buf);
    CHECK_EQ_INT(dtr_progress_format(small, sizeof small, &p), len);   /* cut, the length of the whole line */
    CHECK_EQ_INT(strlen(small), sizeof small - 1);
    memset(&p, 0, sizeof p);
    p.step = 7;
    dtr_progress_format(buf, sizeof buf, &p);
    CHECK_MSG(strcmp(buf, "epoch 1 step 7") == 0, "%s", buf);
    CHECK_EQ_INT(dtr_progress_format(NULL, 10, &p), 0);
    CHECK_EQ_INT(dtr_progress_format(buf, 0, &p), 0);
    CHECK_EQ_INT(dtr_progress_format(buf, sizeof buf, NULL), 0);
}

int main(void) {
    (void)mlp_backward;   /* dp_mlp.h's, unused here */
    (void)rel_err;
    RUN(t_anomaly_off_by_default);
    RUN(t_anomaly_forward_div);
    RUN(t_anomaly_forward_data);
    RUN(t_anomaly_narrow);
    RUN(t_anomaly_backward);
    RUN(t_nan_input_skipped_by_default);
    RUN(t_nan_input_stop_warn_off);
    RUN(t_bad_policy);
    RUN(t_dp_same_decision);
    RUN(t_progress_format);
    return test_summary();
}
