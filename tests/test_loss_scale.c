/* tests/test_loss_scale.c: dynamic loss scaling (dtr_loss_scaler).
 *   test_scaled_equals_plain   training with a power-of-two scale gives the weights of training
 *                              without one, bit for bit (the scale and its inverse are exact)
 *   test_overflow_skips        gradients that overflow (a huge scale) skip the step: weights and
 *                              optimizer unchanged, scale halved, the skip counted and logged
 *   test_accumulation          with grad_accum_steps 2 the scaled micro-batches add up and are
 *                              divided once: the weights of unscaled training, bit for bit; an
 *                              overflow at an update skips it and the next update comes two
 *                              micro-batches later (the accumulation starts over)
 *   test_growth                growth_interval finite steps double the scale, up to max_scale
 *   test_state_and_errors      the state entries round-trip; bad settings and NULLs refused */
#include "test.h"

typedef struct rig { dtr_context *ctx; dtr_model *m; dtr_optimizer *opt; dtr_linear_layer l; } rig;

static int g_warnings;
static void count_log(void *u, dtr_log_level lvl, const char *msg) {
    (void)u;
    if (lvl == DTR_LOG_WARN && strstr(msg, "step skipped")) g_warnings++;
}

static void rig_open_opt(rig *r, dtr_optimizer_kind kind, int accum) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(kind, kind == DTR_OPT_SGD ? 0.1f : 0.01f);
    oc.grad_accum_steps = accum;
    cc.threads = 1;
    cc.seed = 3;
    cc.log = count_log;
    memset(r, 0, sizeof *r);
    CHECK(dtr_context_create(&cc, &r->ctx) == DTR_OK);
    CHECK(dtr_model_create(r->ctx, 5, &r->m) == DTR_OK);
    CHECK(dtr_linear_layer_init(&r->l, r->m, "l", 4, 3, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK);
    CHECK(dtr_optimizer_create(r->m, &oc, &r->opt) == DTR_OK);
}

static void rig_open(rig *r) { rig_open_opt(r, DTR_OPT_ADAMW, 1); }

static void rig_close(rig *r) {
    dtr_optimizer_destroy(r->opt);
    dtr_model_destroy(r->m);
    dtr_context_destroy(r->ctx);
}

/* The loss of step s: mse of the layer's output against a target. */
static dtr_tensor *rig_loss(rig *r, int s) {
    float x[8], t[6];
    int64_t xs[2] = {2, 4}, ts[2] = {2, 3};
    int i;
    for (i = 0; i < 8; i++) x[i] = 0.1f * (float)((i * 7 + s) % 11) - 0.5f;
    for (i = 0; i < 6; i++) t[i] = 0.2f * (float)((i + s) % 5);
    return dtr_mse(r->ctx, dtr_linear_layer_forward(r->ctx, &r->l, dtr_tensor_from(r->ctx, DTR_F32, 2, xs, x)),
                   dtr_tensor_from(r->ctx, DTR_F32, 2, ts, t));
}

/* steps s0..s0+n-1 on both rigs: a with the plain optimizer, b through the loss scaler; the
   scaler's `stepped` flags, first step in the highest bit */
static int rig_pair_steps(rig *a, rig *b, dtr_loss_scaler *ls, int s0, int n) {
    int s, stepped = 0, pattern = 0;
    for (s = s0; s < s0 + n; s++) {
        CHECK_OK(a->ctx, dtr_backward(a->ctx, rig_loss(a, s)));
        CHECK_OK(a->ctx, dtr_optimizer_step(a->opt, NULL));
        dtr_context_reset(a->ctx);
        CHECK_OK(b->ctx, dtr_backward(b->ctx, dtr_loss_scaler_scale(ls, b->ctx, rig_loss(b, s))));
        CHECK_OK(b->ctx, dtr_loss_scaler_step(ls, b->m, b->opt, &stepped));
        pattern = pattern * 2 + stepped;
        dtr_context_reset(b->ctx);
    }
    return pattern;
}

static void test_scaled_equals_plain(void) {
    rig a, b;
    dtr_loss_scaler *ls = NULL;
    dtr_loss_scaler_config c = dtr_loss_scaler_config_init();
    c.init_scale = 1024.0f;
    rig_open(&a);
    rig_open(&b);
    CHECK(dtr_loss_scaler_create(&c, &ls) == DTR_OK);
    CHECK_EQ_INT(rig_pair_steps(&a, &b, ls, 0, 5), 31);   /* 11111: every step applied */
    CHECK(memcmp(dtr_model_params(a.m), dtr_model_params(b.m), (size_t)dtr_model_numel(a.m) * sizeof(float)) == 0);
    CHECK(dtr_loss_scaler_value(ls) == 1024.0f && dtr_loss_scaler_skipped(ls) == 0);
    dtr_loss_scaler_destroy(ls);
    rig_close(&a);
    rig_close(&b);
}

static void test_overflow_skips(void) {
    rig a;
    dtr_loss_scaler *ls = NULL;
    dtr_loss_scaler_config c = dtr_loss_scaler_config_init();
    float before[15];
    int stepped = 1;
    c.init_scale = 1e38f;
    c.max_scale = 3e38f;
    rig_open(&a);
    CHECK(dtr_loss_scaler_create(&c, &ls) == DTR_OK);
    g_warnings = 0;
    CHECK_OK(a.ctx, dtr_model_build(a.m));
    memcpy(before, dtr_model_params(a.m), sizeof before);
    CHECK_OK(a.ctx, dtr_backward(a.ctx, dtr_scale(a.ctx, dtr_loss_scaler_scale(ls, a.ctx, rig_loss(&a, 0)), 100.0f)));
    CHECK_OK(a.ctx, dtr_loss_scaler_step(ls, a.m, a.opt, &stepped));
    CHECK(stepped == 0);
    CHECK(memcmp(before, dtr_model_params(a.m), sizeof before) == 0);
    CHECK(dtr_loss_scaler_skipped(ls) == 1 && dtr_loss_scaler_value(ls) == 5e37f);
    CHECK_EQ_INT(g_warnings, 1);
    CHECK(dtr_model_grads(a.m)[0] == 0.0f);   /* the accumulation starts over */
    dtr_loss_scaler_destroy(ls);
    rig_close(&a);
}

static void test_accumulation(void) {
    rig a, b;
    dtr_loss_scaler *ls = NULL;
    dtr_loss_scaler_config c = dtr_loss_scaler_config_init();
    int s, stepped = 0, pattern;
    c.init_scale = 1024.0f;
    rig_open_opt(&a, DTR_OPT_SGD, 2);   /* SGD: Adam's first steps hardly see a gradient's scale */
    rig_open_opt(&b, DTR_OPT_SGD, 2);
    CHECK(dtr_loss_scaler_create(&c, &ls) == DTR_OK);
    pattern = rig_pair_steps(&a, &b, ls, 0, 6);
    CHECK_EQ_INT(pattern, 21);   /* 010101: an update every second micro-batch */
    CHECK(memcmp(dtr_model_params(a.m), dtr_model_params(b.m), (size_t)dtr_model_numel(a.m) * sizeof(float)) == 0);
    /* an overflow in the second micro-batch: skipped, and the two after it make the update */
    pattern = 0;
    for (s = 0; s < 4; s++) {
        dtr_tensor *loss = dtr_loss_scaler_scale(ls, b.ctx, rig_loss(&b, s));
        CHECK_OK(b.ctx, dtr_backward(b.ctx, s == 1 ? dtr_scale(b.ctx, loss, 1e38f) : loss));
        CHECK_OK(b.ctx, dtr_loss_scaler_step(ls, b.m, b.opt, &stepped));
        pattern = pattern * 2 + stepped;
        dtr_context_reset(b.ctx);
    }
    CHECK_EQ_INT(pattern, 1);   /* 0001 */
    CHECK(dtr_loss_scaler_skipped(ls) == 1 && dtr_loss_scaler_value(ls) == 512.0f);
    dtr_loss_scaler_destroy(ls);
    rig_close(&a);
    rig_close(&b);
}

static void test_growth(void) {
    rig a;
    dtr_loss_scaler *ls = NULL;
    dtr_loss_scaler_config c = dtr_loss_scaler_config_init();
    int s, stepped;
    c.init_scale = 4.0f;
    c.growth_interval = 3;
    c.max_scale = 8.0f;
    rig_open(&a);
    CHECK(dtr_loss_scaler_create(&c, &ls) == DTR_OK);
    for (s = 0; s < 7; s++) {
        CHECK_OK(a.ctx, dtr_backward(a.ctx, dtr_loss_scaler_scale(ls, a.ctx, rig_loss(&a, s))));
        CHECK_OK(a.ctx, dtr_loss_scaler_step(ls, a.m, a.opt, &stepped));
        dtr_context_reset(a.ctx);
        if (s == 1) CHECK(dtr_loss_scaler_value(ls) == 4.0f);
        if (s == 2) CHECK(dtr_loss_scaler_value(ls) == 8.0f);
    }
    CHECK(dtr_loss_scaler_value(ls) == 8.0f);   /* capped */
    dtr_loss_scaler_destroy(ls);
    rig_close(&a);
}

static void test_state_and_errors(void) {
    dtr_loss_scaler *ls = NULL, *ls2 = NULL;
    dtr_loss_scaler_config c = dtr_loss_scaler_config_init();
    dtr_state_entry e, e2;
    int i;
    CHECK(dtr_loss_scaler_create(NULL, &ls) == DTR_OK && dtr_loss_scaler_value(ls) == 65536.0f);
    CHECK(dtr_loss_scaler_create(&c, &ls2) == DTR_OK);
    *(float *)(dtr_loss_scaler_state(ls, 0, &e) == DTR_OK ? e.data : &c.init_scale) = 512.0f;
    for (i = 0; dtr_loss_scaler_state(ls, i, &e) == DTR_OK; i++) {
        CHECK(dtr_loss_scaler_state(ls2, i, &e2) == DTR_OK && e.bytes == e2.bytes && !strcmp(e.name, e2.name));
        memcpy(e2.data, e.data, e.bytes);
    }
    CHECK_EQ_INT(i, 3);
    CHECK(dtr_loss_scaler_state_loaded(ls2) == DTR_OK && dtr_loss_scaler_value(ls2) == 512.0f);
    dtr_loss_scaler_state(ls2, 0, &e2);
    *(float *)e2.data = -1.0f;
    CHECK_EQ_INT(dtr_loss_scaler_state_loaded(ls2), DTR_CORRUPT_FILE);
    dtr_loss_scaler_destroy(ls2);
    c.backoff_factor = 1.5f;
    CHECK_EQ_INT(dtr_loss_scaler_create(&c, &ls2), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_loss_scaler_create(NULL, NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_loss_scaler_step(NULL, NULL, NULL, NULL), DTR_NULL_HANDLE);
    CHECK(dtr_loss_scaler_state(ls, 3, &e) == DTR_NOT_FOUND);
    dtr_loss_scaler_destroy(ls);
    dtr_loss_scaler_destroy(NULL);
}

int main(void) {
    (void)test_ctx;
    RUN(test_scaled_equals_plain);
    RUN(test_overflow_skips);
    RUN(test_accumulation);
    RUN(test_growth);
    RUN(test_state_and_errors);
    return test_summary();
}
