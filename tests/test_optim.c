/* Optimizers, schedules and gradient clipping against PyTorch.
 *
 * The reference values come from tests/fixtures/make_optim_fixtures.py (torch.optim SGD, Adam,
 * AdamW, RMSprop, Adagrad, a float64 LAMB, torch.optim.lr_scheduler, torch.nn.utils.clip_grad_norm_), written
 * into tests/fixtures/optim_fixtures.h. A dtrain model holds the same two parameters p0 (3, 4)
 * and p1 (5) (at their offsets inside the model's padded contiguous buffer); each fixture
 * gradient is written into dtr_model_grads and dtr_optimizer_step applied. Every element of
 * the parameters after every update, and the optimizer state after the last, must agree with
 * torch within a relative tolerance of 1e-5 (|a - b| <= 1e-5 * max(|b|, 1e-2)).
 * Also covered: gradient accumulation, clipping inside the optimizer, schedules seen through
 * dtr_optimizer_lr / dtr_optimizer_steps, dtr_optimizer_moments, invalid configurations and
 * NULL handles; frozen parameters (test_frozen: no gradient, no update even by weight decay, the
 * others as if the frozen ones were constants, no moments for them; unfreezing keeps the others'
 * moments); weight decay on matrices only against torch's two param groups (the fixtures'
 * *_decay_matrices cases) and by name (test_no_decay: "*bias" gives the same bits); a parameter
 * unfrozen after others' updates counts its own steps, as in torch (the *_thaw cases), and keeps
 * counting them through a save and load of the optimizer's state (test_thaw_state); one frozen
 * and thawed between two updates keeps its state (test_frozen_between_updates). */
#if defined(__linux__)
#define _DEFAULT_SOURCE   /* mincore */
#endif
#include "test.h"
#include "fixtures/optim_fixtures.h"
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#define REL_TOL 1e-5
#define REL_FLOOR 1e-2 /* below this magnitude the tolerance is absolute: 1e-7 */

static double g_max_err_params, g_max_err_state, g_max_err_sched, g_max_err_clip;
static double g_max_pure_rel; /* |a - b| / |b| without the floor, for the report */

/* The optimizer state is held to the same tolerance as the parameters (betas are doubles,
 * so 1 - beta2 matches torch exactly). */
#define STATE1_TOL REL_TOL

/* Relative error of a against the reference b, with the floor above. */
static double rel_err(double a, double b) { return fabs(a - b) / fmax(fabs(b), REL_FLOOR); }

/* Compares n floats; returns the largest relative error and fails the case above `tol`. */
static double check_close_tol(const char *what, int step, const float *got, const float *want, int n, double tol) {
    double worst = 0.0;
    int i, bad = -1;
    for (i = 0; i < n; i++) {
        double e = rel_err(got[i], want[i]);
        if (!(e <= worst)) worst = e; /* NaN counts as the worst */
        if (!(e <= tol) && bad < 0) bad = i;
        if (want[i] != 0.0f) g_max_pure_rel = fmax(g_max_pure_rel, fabs((double)got[i] - want[i]) / fabs((double)want[i]));
    }
    CHECK_MSG(bad < 0, "%s, update %d, element %d: dtrain %.9g, torch %.9g (rel err %.3g)", what, step, bad,
              bad >= 0 ? got[bad] : 0.0, bad >= 0 ? want[bad] : 0.0, worst);
    return worst;
}

static double check_close(const char *what, int step, const float *got, const float *want, int n) {
    return check_close_tol(what, step, got, want, n, REL_TOL);
}

/* ---- the two-parameter model of the fixtures ---- */

typedef struct fx {
    dtr_context *ctx;
    dtr_model *m;
    dtr_tensor *p0, *p1;
    int64_t off0, off1;
} fx;

static void fx_open(fx *f) {
    static const int64_t s0[2] = {3, 4}, s1[1] = {5};
    memset(f, 0, sizeof(*f));
    f->ctx = test_ctx(1);
    CHECK_OK(f->ctx, dtr_model_create(f->ctx, 7, &f->m));
    /* random initialisers on purpose: the fixture values must replace them */
    f->p0 = dtr_model_param(f->m, "p0", 2, s0, DTR_INIT_NORMAL, 1.0f);
    f->p1 = dtr_model_param(f->m, "p1", 1, s1, DTR_INIT_UNIFORM, 1.0f);
    CHECK(f->p0 && f->p1);
    CHECK_OK(f->ctx, dtr_model_build(f->m));
    f->off0 = dtr_model_param_offset(f->m, 0);
    f->off1 = dtr_model_param_offset(f->m, 1);
    CHECK_EQ_INT(f->off0, 0);
    CHECK_EQ_INT(f->off1 % 16, 0); /* padded: 12 floats of p0 then 4 of padding */
    CHECK(f->off1 >= OPTF_N0);
    CHECK_OK(f->ctx, dtr_tensor_write(f->p0, DTR_F32, optf_init0, OPTF_N0));
    CHECK_OK(f->ctx, dtr_tensor_write(f->p1, DTR_F32, optf_init1, OPTF_N1));
    CHECK(dtr_model_params(f->m)[f->off0 + 5] == optf_init0[5]);
    CHECK(dtr_model_params(f->m)[f->off1 + 3] == optf_init1[3]);
}

static void fx_close(fx *f) {
    dtr_model_destroy(f->m);
    dtr_context_destroy(f->ctx);
}

/* Adds scale * (fixture gradient `step`) into the model's gradient buffer (p1's while it is
   trainable). */
static void fx_add_grad(fx *f, int step, float scale) {
    float *g = dtr_model_grads(f->m);
    int i;
    for (i = 0; i < OPTF_N0; i++) g[f->off0 + i] += scale * optf_grad0[step * OPTF_N0 + i];
    for (i = 0; dtr_model_param_trainable(f->m, 1) && i < OPTF_N1; i++) g[f->off1 + i] += scale * optf_grad1[step * OPTF_N1 + i];
}

/* Adds fixture gradient `step` through autograd: the backward of sum(p0 * g0) + sum(p1 * g1),
   whose gradients are g0 and g1 exactly; without p1's term (skip_p1) no backward reaches p1,
   as a .grad of None in torch. */
static void fx_backward(fx *f, int step, int skip_p1) {
    static const int64_t s0[2] = {3, 4}, s1[1] = {5};
    dtr_tensor *g0 = dtr_tensor_from(f->ctx, DTR_F32, 2, s0, optf_grad0 + step * OPTF_N0);
    dtr_tensor *g1 = dtr_tensor_from(f->ctx, DTR_F32, 1, s1, optf_grad1 + step * OPTF_N1);
    dtr_tensor *loss = dtr_sum_all(f->ctx, dtr_mul(f->ctx, f->p0, g0));
    if (!skip_p1) loss = dtr_add(f->ctx, loss, dtr_sum_all(f->ctx, dtr_mul(f->ctx, f->p1, g1)));
    CHECK_OK(f->ctx, dtr_backward(f->ctx, loss));
    dtr_context_reset(f->ctx);
}

/* The thaw cases: p1 frozen before update c->thaw, trainable from it. */
static void fx_thaw(fx *f, const optf_case *c, int step) {
    static const char *p1[1] = {"p1"};
    if (c->thaw > 0 && step <= c->thaw) CHECK_OK(f->ctx, dtr_model_set_trainable(f->m, p1, 1, step == c->thaw));
}

static void fx_read(fx *f, float *p0, float *p1) {
    CHECK_OK(f->ctx, dtr_tensor_read(f->p0, DTR_F32, p0, OPTF_N0));
    CHECK_OK(f->ctx, dtr_tensor_read(f->p1, DTR_F32, p1, OPTF_N1));
}

/* The case's configuration; its lr group (p1's, when it has one) lives in `group`. */
static dtr_optimizer_config case_config(const optf_case *c, dtr_lr_group *group) {
    dtr_optimizer_config cfg = dtr_optimizer_config_init(c->kind, c->lr);
    group->match = "p1";
    group->scale = c->lr1;
    cfg.lr_groups = group;
    cfg.n_lr_groups = c->lr1 != 1.0f;
    cfg.momentum = c->momentum;
    cfg.dampening = c->dampening;
    cfg.nesterov = c->nesterov;
    cfg.beta1 = c->beta1;
    cfg.beta2 = c->beta2;
    cfg.eps = c->eps;
    cfg.weight_decay = c->weight_decay;
    cfg.decay_matrices_only = c->decay_matrices_only;
    cfg.clip_norm = c->clip_norm;
    cfg.schedule.kind = c->sched;
    cfg.schedule.min_lr = c->min_lr;
    cfg.schedule.warmup_steps = c->warmup;
    cfg.schedule.total_steps = c->total;
    cfg.schedule.start_lr = c->start_lr;
    cfg.schedule.max_momentum = c->max_m;
    cfg.schedule.base_momentum = c->base_m;
    return cfg;
}

/* ---- every optimizer case against torch ---- */

static void run_case(const optf_case *c) {
    fx f;
    dtr_lr_group group;
    dtr_optimizer_config cfg = case_config(c, &group);
    dtr_optimizer *opt = NULL;
    float p0[OPTF_N0], p1[OPTF_N1];
    char what[128];
    double worst = 0.0, e;
    int s, k, count = -1, updated;
    fx_open(&f);
    fx_thaw(&f, c, 0);
    CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &opt));
    if (!opt) { fx_close(&f); return; }
    for (s = 0; s < OPTF_STEPS; s++) {
        fx_thaw(&f, c, s);
        fx_backward(&f, s, c->skip1 >> s & 1);
        CHECK_EQ_INT(dtr_optimizer_steps(opt), s);
        CHECK_MSG(rel_err(dtr_optimizer_lr(opt), c->lrs[s]) <= 1e-6, "%s: lr of update %d is %.9g, torch used %.9g",
                  c->name, s, dtr_optimizer_lr(opt), c->lrs[s]);
        updated = -1;
        CHECK_OK(f.ctx, dtr_optimizer_step(opt, &updated));
        CHECK_EQ_INT(updated, 1);
        fx_read(&f, p0, p1);
        snprintf(what, sizeof what, "%s p0", c->name);
        e = check_close(what, s, p0, c->p0 + s * OPTF_N0, OPTF_N0);
        worst = fmax(worst, e);
        snprintf(what, sizeof what, "%s p1", c->name);
        e = check_close(what, s, p1, c->p1 + s * OPTF_N1, OPTF_N1);
        worst = fmax(worst, e);
        /* the step zeroes the gradients */
        CHECK(dtr_model_grads(f.m)[f.off0] == 0.0f && dtr_model_grads(f.m)[f.off1 + OPTF_N1 - 1] == 0.0f);
    }
    CHECK_EQ_INT(dtr_optimizer_steps(opt), OPTF_STEPS);
    g_max_err_params = fmax(g_max_err_params, worst);
    /* the state buffers: moments at the parameters' offsets */
    for (k = 0; k < 2; k++) {
        const float *want0 = k == 0 ? c->s0_p0 : c->s1_p0, *want1 = k == 0 ? c->s0_p1 : c->s1_p1;
        float *st = dtr_optimizer_moments(opt, k, &count);
        CHECK_EQ_INT(count, c->nstate);
        if (k >= c->nstate) { CHECK(st == NULL); continue; }
        CHECK(st != NULL);
        if (!st) continue;
        snprintf(what, sizeof what, "%s state %d p0", c->name, k);
        g_max_err_state = fmax(g_max_err_state, check_close_tol(what, OPTF_STEPS - 1, st + f.off0, want0, OPTF_N0,
                                                                k == 1 ? STATE1_TOL : REL_TOL));
        snprintf(what, sizeof what, "%s state %d p1", c->name, k);
        g_max_err_state = fmax(g_max_err_state, check_close_tol(what, OPTF_STEPS - 1, st + f.off1, want1, OPTF_N1,
                                                                k == 1 ? STATE1_TOL : REL_TOL));
    }
    printf("     %-28s max rel err of the parameters vs torch %.3g\n", c->name, worst);
    dtr_optimizer_destroy(opt);
    fx_close(&f);
}

static void test_against_torch(void) {
    int i;
    for (i = 0; i < OPTF_NCASES; i++) run_case(&optf_cases[i]);
}

static const optf_case *find_case(const char *name) {
    int i;
    for (i = 0; i < OPTF_NCASES; i++)
        if (!strcmp(optf_cases[i].name, name)) return &optf_cases[i];
    return NULL;
}

/* What counts as reached: p1 reached by one micro-batch of an update takes part in it; an
   update no backward of which reached p1 leaves its values and moments alone, bit for bit
   (AdamW's weight decay included); gradients written by hand (no backward since the last
   zero_grad) update every trainable parameter, as before. */
static void test_unreached(void) {
    fx f;
    dtr_optimizer_config cfg = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.01f);
    dtr_optimizer *opt = NULL;
    float before[OPTF_N1], m1[OPTF_N1], v1[OPTF_N1], after[OPTF_N1], p0[OPTF_N0];
    int updated = -1;
    cfg.weight_decay = 0.1f;
    cfg.grad_accum_steps = 2;
    fx_open(&f);
    CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &opt));
    if (!opt) { fx_close(&f); return; }
    fx_read(&f, p0, before);
    fx_backward(&f, 0, 0);
    CHECK_OK(f.ctx, dtr_optimizer_step(opt, NULL));
    fx_backward(&f, 1, 1);
    CHECK_OK(f.ctx, dtr_optimizer_step(opt, &updated));
    fx_read(&f, p0, after);
    CHECK(updated == 1 && memcmp(before, after, sizeof before) != 0);   /* reached by the first micro-batch */
    memcpy(before, after, sizeof before);
    memcpy(m1, dtr_optimizer_moments(opt, 0, NULL) + f.off1, sizeof m1);
    memcpy(v1, dtr_optimizer_moments(opt, 1, NULL) + f.off1, sizeof v1);
    fx_backward(&f, 2, 1);
    CHECK_OK(f.ctx, dtr_optimizer_step(opt, NULL));
    fx_backward(&f, 3, 1);
    CHECK_OK(f.ctx, dtr_optimizer_step(opt, &updated));
    fx_read(&f, p0, after);
    CHECK(updated == 1 && memcmp(before, after, sizeof before) == 0);
    CHECK(memcmp(m1, dtr_optimizer_moments(opt, 0, NULL) + f.off1, sizeof m1) == 0);
    CHECK(memcmp(v1, dtr_optimizer_moments(opt, 1, NULL) + f.off1, sizeof v1) == 0);
    dtr_model_grads(f.m)[f.off0] = 1.0f;   /* by hand: p1 takes part with a zero gradient (moments, decay) */
    CHECK_OK(f.ctx, dtr_optimizer_step(opt, NULL));
    CHECK_OK(f.ctx, dtr_optimizer_step(opt, &updated));
    fx_read(&f, p0, after);
    CHECK(updated == 1 && memcmp(before, after, sizeof before) != 0);
    dtr_optimizer_destroy(opt);
    fx_close(&f);
}

/* Copies every state entry of `from` into `to` (host memory), as a checkpoint would. */
static void copy_state(dtr_optimizer *from, dtr_optimizer *to) {
    dtr_state_entry a, b;
    int i;
    for (i = 0; dtr_optimizer_state(from, i, &a) == DTR_OK; i++) {
        CHECK(dtr_optimizer_state(to, i, &b) == DTR_OK && !strcmp(a.name, b.name) && a.bytes == b.bytes);
        if (!strcmp(a.name, b.name) && a.bytes == b.bytes) memcpy(b.data, a.data, a.bytes);
    }
    CHECK(dtr_optimizer_state(to, i, &b) == DTR_NOT_FOUND);
}

/* adamw_thaw stopped after update 4 (p1 unfrozen at 3) and resumed in a new model and optimizer
   from the state entries: update 5 is torch's, so p1 still counts its own steps ("started");
   a start the state cannot have is refused */
static void test_thaw_state(void) {
    const optf_case *c = find_case("adamw_thaw");
    dtr_optimizer_config cfg;
    dtr_lr_group group;
    dtr_optimizer *o1 = NULL, *o2 = NULL;
    dtr_state_entry e;
    float p0[OPTF_N0], p1[OPTF_N1];
    fx a, b;
    int s, i;
    CHECK(c != NULL);
    if (!c) return;
    cfg = case_config(c, &group);
    fx_open(&a), fx_open(&b);
    fx_thaw(&a, c, 0);
    CHECK_OK(a.ctx, dtr_optimizer_create(a.m, &cfg, &o1));
    CHECK_OK(b.ctx, dtr_optimizer_create(b.m, &cfg, &o2));
    for (s = 0; s < OPTF_STEPS - 1; s++) {
        fx_thaw(&a, c, s);
        fx_add_grad(&a, s, 1.0f);
        CHECK_OK(a.ctx, dtr_optimizer_step(o1, NULL));
    }
    fx_read(&a, p0, p1);
    CHECK_OK(b.ctx, dtr_tensor_write(b.p0, DTR_F32, p0, OPTF_N0));
    CHECK_OK(b.ctx, dtr_tensor_write(b.p1, DTR_F32, p1, OPTF_N1));
    copy_state(o1, o2);
    CHECK_OK(b.ctx, dtr_optimizer_state_loaded(o2));
    fx_add_grad(&b, OPTF_STEPS - 1, 1.0f);
    CHECK_OK(b.ctx, dtr_optimizer_step(o2, NULL));
    fx_read(&b, p0, p1);
    check_close("adamw_thaw resumed p0", OPTF_STEPS - 1, p0, c->p0 + (OPTF_STEPS - 1) * OPTF_N0, OPTF_N0);
    check_close("adamw_thaw resumed p1", OPTF_STEPS - 1, p1, c->p1 + (OPTF_STEPS - 1) * OPTF_N1, OPTF_N1);
    for (i = 0; dtr_optimizer_state(o2, i, &e) == DTR_OK && strcmp(e.name, "started"); i++) {}
    CHECK(e.bytes == 2 * sizeof(int64_t) && ((int64_t *)e.data)[0] == 0 && ((int64_t *)e.data)[1] == c->thaw);
    ((int64_t *)e.data)[1] = -1;   /* frozen, but p1 is trainable */
    CHECK(dtr_optimizer_state_loaded(o2) == DTR_CORRUPT_FILE && strstr(dtr_context_last_error(b.ctx), "'p1'"));
    ((int64_t *)e.data)[1] = OPTF_STEPS + 1;   /* after the last update */
    CHECK(dtr_optimizer_state_loaded(o2) == DTR_CORRUPT_FILE);
    dtr_context_clear_error(b.ctx);
    dtr_optimizer_destroy(o1), dtr_optimizer_destroy(o2);
    fx_close(&a), fx_close(&b);
}

/* The padding between parameters in the shared buffer must stay untouched (zero). */
static void test_padding_untouched(void) {
    fx f;
    dtr_optimizer_config cfg = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.01f);
    dtr_optimizer *opt = NULL;
    int s, i;
    fx_open(&f);
    CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &opt));
    for (s = 0; s < OPTF_STEPS; s++) {
        fx_add_grad(&f, s, 1.0f);
        CHECK_OK(f.ctx, dtr_optimizer_step(opt, NULL));
    }
    for (i = OPTF_N0; i < f.off1; i++) CHECK(dtr_model_params(f.m)[i] == 0.0f);
    dtr_optimizer_destroy(opt);
    fx_close(&f);
}

/* ---- gradient accumulation ---- */

/* grad_accum_steps 4 with micro-gradients g_a .. g_d gives the update of one step with their
 * mean, bit for bit (the mean is formed in the same order and 1/4 is exact). */
static void accumulation_case(dtr_optimizer_kind kind, float lr, float momentum) {
    static const int micro[2][4] = {{0, 1, 2, 3}, {2, 5, 4, 1}};
    fx a, b;
    dtr_optimizer_config cfg = dtr_optimizer_config_init(kind, lr);
    dtr_optimizer *oa = NULL, *ob = NULL;
    float pa0[OPTF_N0], pa1[OPTF_N1], pb0[OPTF_N0], pb1[OPTF_N1];
    int u, k, i, updated;
    cfg.momentum = momentum;
    fx_open(&a);
    fx_open(&b);
    CHECK_OK(b.ctx, dtr_optimizer_create(b.m, &cfg, &ob));
    cfg.grad_accum_steps = 4;
    CHECK_OK(a.ctx, dtr_optimizer_create(a.m, &cfg, &oa));
    if (!oa || !ob) goto done;
    for (u = 0; u < 2; u++) {
        float *gb = dtr_model_grads(b.m);
        for (k = 0; k < 4; k++) {
            fx_add_grad(&a, micro[u][k], 1.0f);
            fx_add_grad(&b, micro[u][k], 1.0f);
            updated = -1;
            CHECK_OK(a.ctx, dtr_optimizer_step(oa, &updated));
            CHECK_EQ_INT(updated, k == 3 ? 1 : 0);
            CHECK_EQ_INT(dtr_optimizer_steps(oa), k == 3 ? u + 1 : u);
            if (k < 3) /* the micro-gradients are kept until the update */
                CHECK(dtr_model_grads(a.m)[a.off0] == dtr_model_grads(b.m)[b.off0]);
        }
        CHECK(dtr_model_grads(a.m)[a.off0] == 0.0f && dtr_model_grads(a.m)[a.off1] == 0.0f);
        for (i = 0; i < OPTF_N0; i++) gb[b.off0 + i] *= 0.25f;
        for (i = 0; i < OPTF_N1; i++) gb[b.off1 + i] *= 0.25f;
        updated = -1;
        CHECK_OK(b.ctx, dtr_optimizer_step(ob, &updated));
        CHECK_EQ_INT(updated, 1);
        fx_read(&a, pa0, pa1);
        fx_read(&b, pb0, pb1);
        CHECK_MSG(!memcmp(pa0, pb0, sizeof pa0) && !memcmp(pa1, pb1, sizeof pa1),
                  "kind %d update %d: accumulated %.9g vs mean-gradient %.9g", (int)kind, u, pa0[0], pb0[0]);
        CHECK(pa0[0] != optf_init0[0]); /* something happened */
    }
done:
    dtr_optimizer_destroy(oa);
    dtr_optimizer_destroy(ob);
    fx_close(&a);
    fx_close(&b);
}

static void test_grad_accumulation(void) {
    accumulation_case(DTR_OPT_SGD, 0.1f, 0.9f);
    accumulation_case(DTR_OPT_ADAM, 0.01f, 0.0f);
    accumulation_case(DTR_OPT_LAMB, 0.01f, 0.0f);
}

/* Accumulation and clipping together: the clip applies to the mean gradient. Each fixture
 * gradient g is fed twice with grad_accum_steps 2 (mean exactly g), so the result must match
 * torch's clip-then-step reference sgd_momentum_clip. */
static void test_accumulation_with_clip(void) {
    const optf_case *c = NULL;
    fx f;
    dtr_optimizer_config cfg;
    dtr_lr_group group;
    dtr_optimizer *opt = NULL;
    float p0[OPTF_N0], p1[OPTF_N1];
    int i, s, k, updated;
    for (i = 0; i < OPTF_NCASES; i++)
        if (!strcmp(optf_cases[i].name, "sgd_momentum_clip")) c = &optf_cases[i];
    CHECK(c != NULL);
    if (!c) return;
    cfg = case_config(c, &group);
    cfg.grad_accum_steps = 2;
    fx_open(&f);
    CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &opt));
    for (s = 0; opt && s < OPTF_STEPS; s++) {
        for (k = 0; k < 2; k++) { /* sum g + g = 2g; the mean is g */
            fx_add_grad(&f, s, 1.0f);
            CHECK_OK(f.ctx, dtr_optimizer_step(opt, &updated));
            CHECK_EQ_INT(updated, k);
        }
        fx_read(&f, p0, p1);
        check_close("accumulated sgd_momentum_clip p0", s, p0, c->p0 + s * OPTF_N0, OPTF_N0);
        check_close("accumulated sgd_momentum_clip p1", s, p1, c->p1 + s * OPTF_N1, OPTF_N1);
    }
    dtr_optimizer_destroy(opt);
    fx_close(&f);
}

/* ---- clipping ---- */

static void test_clip_grad_norm(void) {
    fx f;
    float g0[OPTF_N0], g1[OPTF_N1], norm;
    int k;
    fx_open(&f);
    for (k = 0; k < OPTF_NCLIPS; k++) {
        const optf_clip *c = &optf_clips[k];
        CHECK_OK(f.ctx, dtr_model_zero_grad(f.m));
        fx_add_grad(&f, c->step, 1.0f);
        norm = -1.0f;
        CHECK_OK(f.ctx, dtr_clip_grad_norm(f.m, c->max_norm, &norm));
        CHECK_MSG(rel_err(norm, c->norm) <= 1e-6, "gradient %d: norm %.9g, torch %.9g", c->step, norm, c->norm);
        g_max_err_clip = fmax(g_max_err_clip, rel_err(norm, c->norm));
        memcpy(g0, dtr_model_grads(f.m) + f.off0, sizeof g0);
        memcpy(g1, dtr_model_grads(f.m) + f.off1, sizeof g1);
        g_max_err_clip = fmax(g_max_err_clip, check_close("clipped gradient p0", c->step, g0, c->g0, OPTF_N0));
        g_max_err_clip = fmax(g_max_err_clip, check_close("clipped gradient p1", c->step, g1, c->g1, OPTF_N1));
    }
    /* the clipped norm is max_norm (up to torch's 1e-6 guard) */
    CHECK_OK(f.ctx, dtr_model_zero_grad(f.m));
    fx_add_grad(&f, 2, 1.0f);
    CHECK_OK(f.ctx, dtr_clip_grad_norm(f.m, 0.25f, NULL));
    CHECK_OK(f.ctx, dtr_clip_grad_norm(f.m, 1000.0f, &norm));
    CHECK_NEAR(norm, 0.25, 1e-6);
    /* max_norm must be > 0 */
    CHECK_EQ_INT(dtr_clip_grad_norm(f.m, 0.0f, &norm), DTR_INVALID_ARGUMENT);
    CHECK_MSG(strstr(dtr_context_last_error(f.ctx), "dtr_clip_grad_norm") != NULL, "message: %s",
              dtr_context_last_error(f.ctx));
    dtr_context_clear_error(f.ctx);
    CHECK_EQ_INT(dtr_clip_grad_norm(f.m, -1.0f, NULL), DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(f.ctx);
    CHECK_EQ_INT(dtr_clip_grad_norm(NULL, 1.0f, &norm), DTR_NULL_HANDLE);
    fx_close(&f);
}

/* ---- schedules ---- */

static void test_schedules(void) {
    int i, s;
    for (i = 0; i < OPTF_NSCHEDS; i++) {
        const optf_sched *c = &optf_scheds[i];
        dtr_schedule sc;
        memset(&sc, 0, sizeof sc);
        sc.kind = c->kind;
        sc.lr = c->lr;
        sc.min_lr = c->min_lr;
        sc.warmup_steps = c->warmup_steps;
        sc.total_steps = c->total_steps;
        sc.step_size = c->step_size;
        sc.gamma = c->gamma;
        memcpy(sc.milestones, c->milestones, sizeof sc.milestones);
        sc.start_lr = c->start_lr, sc.max_momentum = c->max_m, sc.base_momentum = c->base_m;
        for (s = 0; s < c->n; s++) {
            float lr = dtr_schedule_lr(&sc, s), mom = dtr_schedule_momentum(&sc, s, 0.5f);
            double e = fabs((double)lr - c->lr_at[s]) / fmax(fabs((double)c->lr_at[s]), 1e-3 * c->lr); /* 0 at a decay's end */
            g_max_err_sched = fmax(g_max_err_sched, e);
            CHECK_MSG(e <= 1e-6, "schedule %s step %d: %.9g, torch %.9g", c->name, s, lr, c->lr_at[s]);
            CHECK_MSG(c->mom_at ? rel_err(mom, c->mom_at[s]) <= 1e-6 : mom == 0.5f, "schedule %s step %d: momentum %.9g, "
                      "torch %.9g", c->name, s, mom, c->mom_at ? c->mom_at[s] : 0.5f);
        }
        /* a negative step counts as step 0; past the end a decay stays at min_lr */
        CHECK(dtr_schedule_lr(&sc, -3) == dtr_schedule_lr(&sc, 0));
        if (c->kind == DTR_SCHED_COSINE || c->kind == DTR_SCHED_LINEAR || c->kind == DTR_SCHED_POLY ||
            c->kind == DTR_SCHED_ONE_CYCLE)
            CHECK_NEAR(dtr_schedule_lr(&sc, c->warmup_steps + c->total_steps + 100), c->min_lr, 1e-9);
        if (c->mom_at) CHECK_NEAR(dtr_schedule_momentum(&sc, c->warmup_steps + c->total_steps + 100, 0.5f), c->max_m, 1e-7);
    }
    CHECK(dtr_schedule_lr(NULL, 3) == 0.0f);
    CHECK(dtr_schedule_momentum(NULL, 3, 0.9f) == 0.9f);
}

static char g_log[256];
static void keep_log(void *user, dtr_log_level level, const char *msg) {
    (void)user;
    if (level == DTR_LOG_INFO) snprintf(g_log, sizeof g_log, "%s", msg);
}

/* The plateau schedule against torch's ReduceLROnPlateau: the rate, num_bad_epochs and best
 * after each report; the same reports under a constant schedule keep the rate and count
 * alike until the first drop (early stopping's counts); the counts resume from the state. */
static void test_plateau(void) {
    int i, s;
    for (i = 0; i < OPTF_NPLATEAUS; i++) {
        const optf_plateau *c = &optf_plateaus[i];
        fx f;
        dtr_optimizer_config cfg = dtr_optimizer_config_init(DTR_OPT_SGD, c->lr);
        dtr_optimizer *opt = NULL, *plain = NULL, *resumed = NULL;
        dtr_metric_stats st, ps;
        int dropped = 0, stale = 0;
        cfg.schedule.kind = DTR_SCHED_PLATEAU;
        cfg.schedule.gamma = c->factor, cfg.schedule.step_size = c->patience, cfg.schedule.min_lr = c->min_lr;
        cfg.schedule.threshold = c->threshold, cfg.schedule.threshold_abs = c->threshold_abs;
        cfg.schedule.maximize = c->maximize, cfg.schedule.cooldown = c->cooldown;
        fx_open(&f);
        CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &opt));
        CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &resumed));
        cfg.schedule.kind = DTR_SCHED_CONSTANT;
        CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &plain));
        if (!opt || !plain || !resumed) { fx_close(&f); continue; }
        CHECK_OK(f.ctx, dtr_optimizer_metric_stats(opt, &st));
        CHECK(st.reports == 0 && st.stale == 0 && st.best == (c->maximize ? -INFINITY : INFINITY));
        for (s = 0; s < c->n; s++) {
            if (s == c->n / 2) {   /* halfway: the state into a fresh optimizer, which goes on */
                copy_state(opt, resumed);
                CHECK_OK(f.ctx, dtr_optimizer_state_loaded(resumed));
                dtr_optimizer_destroy(opt), opt = resumed, resumed = NULL;
            }
            CHECK_OK(f.ctx, dtr_optimizer_report_metric(opt, c->metric[s], &st));
            CHECK_OK(f.ctx, dtr_optimizer_report_metric(plain, c->metric[s], &ps));
            CHECK_MSG(rel_err(dtr_optimizer_lr(opt), c->lr_after[s]) <= 1e-6 && st.bad == c->bad[s] && st.best == c->best[s] &&
                      st.reports == s + 1, "plateau %s report %d (%g): lr %.9g bad %lld best %.9g, torch %.9g %d %.9g",
                      c->name, s, c->metric[s], dtr_optimizer_lr(opt), (long long)st.bad, st.best, c->lr_after[s], c->bad[s],
                      c->best[s]);
            CHECK(st.dropped == (s > 0 && c->lr_after[s] != c->lr_after[s - 1]));
            dropped += st.dropped;
            stale = st.improved ? 0 : stale + 1;   /* reports since the best: drops leave it */
            CHECK(st.stale == stale && ps.stale == stale);
            CHECK(dtr_optimizer_lr(plain) == c->lr && ps.best == c->best[s] && ps.drops == 0 && ps.improved == st.improved &&
                  ps.bad == ps.stale);
        }
        CHECK(dropped > 0 && st.drops == dropped);
        dtr_optimizer_destroy(opt), dtr_optimizer_destroy(plain), dtr_optimizer_destroy(resumed);
        fx_close(&f);
    }
    CHECK_EQ_INT(dtr_optimizer_report_metric(NULL, 1.0, NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_optimizer_metric_stats(NULL, NULL), DTR_NULL_HANDLE);
    {   /* a drop is told to the log callback at the info level (torch's verbose) */
        dtr_context_config cc = dtr_context_config_init();
        dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
        dtr_context *ctx = NULL;
        dtr_model *m = NULL;
        dtr_optimizer *o = NULL;
        static const int64_t one = 1;
        g_log[0] = 0;
        cc.log = keep_log, cc.log_level = DTR_LOG_INFO, cc.threads = 1;
        oc.schedule.kind = DTR_SCHED_PLATEAU, oc.schedule.gamma = 0.5f;
        CHECK_OK(NULL, dtr_context_create(&cc, &ctx));
        CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
        CHECK(dtr_model_param(m, "p", 1, &one, DTR_INIT_ZEROS, 0.0f) != NULL);
        CHECK_OK(ctx, dtr_optimizer_create(m, &oc, &o));
        CHECK_OK(ctx, dtr_optimizer_report_metric(o, 1.0, NULL));
        CHECK(g_log[0] == 0);
        CHECK_OK(ctx, dtr_optimizer_report_metric(o, 2.0, NULL));   /* patience 0: dropped */
        CHECK_MSG(strstr(g_log, "from 0.1 to 0.05") != NULL, "log: '%s'", g_log);
        dtr_optimizer_destroy(o), dtr_model_destroy(m), dtr_context_destroy(ctx);
    }
}

/* dtr_optimizer_lr / dtr_optimizer_steps follow the schedule, one step per update (not per
 * micro-batch), and dtr_optimizer_set_lr replaces the base rate. */
static void test_optimizer_schedule(void) {
    const optf_sched *c = NULL;
    fx f;
    dtr_optimizer_config cfg = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    dtr_optimizer *opt = NULL;
    int i, s, k, updated;
    for (i = 0; i < OPTF_NSCHEDS; i++)
        if (!strcmp(optf_scheds[i].name, "warmup_cosine")) c = &optf_scheds[i];
    CHECK(c != NULL);
    if (!c) return;
    cfg.schedule.kind = c->kind;
    cfg.schedule.lr = c->lr;
    cfg.schedule.min_lr = c->min_lr;
    cfg.schedule.warmup_steps = c->warmup_steps;
    cfg.schedule.total_steps = c->total_steps;
    cfg.grad_accum_steps = 2;
    fx_open(&f);
    CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &opt));
    for (s = 0; opt && s < c->n; s++) {
        CHECK_EQ_INT(dtr_optimizer_steps(opt), s);
        CHECK_MSG(fabs(dtr_optimizer_lr(opt) - c->lr_at[s]) <= 1e-6 * c->lr_at[s], "update %d: lr %.9g, torch %.9g", s,
                  dtr_optimizer_lr(opt), c->lr_at[s]);
        for (k = 0; k < 2; k++) {
            fx_add_grad(&f, s % OPTF_STEPS, 0.01f);
            CHECK_OK(f.ctx, dtr_optimizer_step(opt, &updated));
            CHECK_EQ_INT(updated, k);
        }
    }
    CHECK_EQ_INT(dtr_optimizer_steps(opt), c->n);
    /* set_lr rescales the whole schedule; past the cosine's end it reads min_lr */
    dtr_optimizer_set_lr(opt, 1.0f);
    CHECK_NEAR(dtr_optimizer_lr(opt), c->min_lr, 1e-9);
    dtr_optimizer_destroy(opt);
    /* constant schedule: set_lr takes effect on the next update */
    cfg = dtr_optimizer_config_init(DTR_OPT_SGD, 0.5f);
    CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &opt));
    if (opt) {
        float before;
        CHECK(dtr_optimizer_lr(opt) == 0.5f);
        dtr_optimizer_set_lr(opt, 0.25f);
        CHECK(dtr_optimizer_lr(opt) == 0.25f);
        CHECK_OK(f.ctx, dtr_model_zero_grad(f.m));
        before = dtr_model_params(f.m)[f.off0];
        dtr_model_grads(f.m)[f.off0] = 2.0f;
        CHECK_OK(f.ctx, dtr_optimizer_step(opt, NULL));
        CHECK(dtr_model_params(f.m)[f.off0] == before - 0.25f * 2.0f);
    }
    dtr_optimizer_destroy(opt);
    fx_close(&f);
}

/* ---- end to end: backward fills the model's gradients, the step consumes them ---- */

static void test_backward_then_step(void) {
    static const int64_t s0[2] = {3, 4};
    fx f;
    dtr_optimizer_config cfg = dtr_optimizer_config_init(DTR_OPT_SGD, 0.5f);
    dtr_optimizer *opt = NULL;
    dtr_tensor *c, *loss;
    float coef[OPTF_N0], before[OPTF_N0], after[OPTF_N0], p1[OPTF_N1];
    int i, updated = 0;
    for (i = 0; i < OPTF_N0; i++) coef[i] = 0.25f * (float)(i - 6);
    fx_open(&f);
    CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &opt));
    fx_read(&f, before, p1);
    /* loss = sum(p0 * coef) + sum(p1): dL/dp0 = coef, dL/dp1 = 1 */
    c = dtr_tensor_from(f.ctx, DTR_F32, 2, s0, coef);
    loss = dtr_add(f.ctx, dtr_sum_all(f.ctx, dtr_mul(f.ctx, f.p0, c)), dtr_sum_all(f.ctx, f.p1));
    CHECK_OK(f.ctx, dtr_backward(f.ctx, loss));
    CHECK(dtr_model_grads(f.m)[f.off0 + 1] == coef[1]);
    CHECK(dtr_model_grads(f.m)[f.off1 + 4] == 1.0f);
    CHECK_OK(f.ctx, dtr_optimizer_step(opt, &updated));
    CHECK_EQ_INT(updated, 1);
    CHECK_OK(f.ctx, dtr_context_reset(f.ctx));
    CHECK_OK(f.ctx, dtr_tensor_read(f.p0, DTR_F32, after, OPTF_N0));
    for (i = 0; i < OPTF_N0; i++) CHECK(after[i] == before[i] - 0.5f * coef[i]);
    CHECK_OK(f.ctx, dtr_tensor_read(f.p1, DTR_F32, p1, OPTF_N1));
    for (i = 0; i < OPTF_N1; i++) CHECK(p1[i] == optf_init1[i] - 0.5f);
    CHECK(dtr_model_grads(f.m)[f.off0 + 1] == 0.0f);
    /* a graph error is sticky: the optimizer refuses to step on it and changes nothing */
    CHECK(dtr_matmul(f.ctx, f.p0, f.p0) == NULL);
    dtr_model_grads(f.m)[f.off0] = 1.0f;
    updated = -1;
    CHECK_EQ_INT(dtr_optimizer_step(opt, &updated), DTR_SHAPE_MISMATCH);
    CHECK_EQ_INT(updated, 0);
    CHECK(dtr_model_params(f.m)[f.off0] == after[0]);
    CHECK_EQ_INT(dtr_optimizer_steps(opt), 1);
    dtr_context_clear_error(f.ctx);
    CHECK_OK(f.ctx, dtr_optimizer_step(opt, &updated));
    CHECK(dtr_model_params(f.m)[f.off0] == after[0] - 0.5f);
    dtr_optimizer_destroy(opt);
    fx_close(&f);
}

/* LAMB's trust ratio is 1 when a parameter is all zero (||p|| = 0): the first update is then
 * lr * g / (|g| + eps) element-wise. */
static void test_lamb_zero_param(void) {
    static const int64_t shp[1] = {4};
    static const float g[4] = {0.5f, -2.0f, 0.0f, 1e-3f};
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_optimizer_config cfg = dtr_optimizer_config_init(DTR_OPT_LAMB, 0.1f);
    dtr_optimizer *opt = NULL;
    int i;
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    CHECK(dtr_model_param(m, "z", 1, shp, DTR_INIT_ZEROS, 0.0f) != NULL);
    cfg.weight_decay = 0.01f;
    CHECK_OK(ctx, dtr_optimizer_create(m, &cfg, &opt));
    if (opt) {
        memcpy(dtr_model_grads(m), g, sizeof g);
        CHECK_OK(ctx, dtr_optimizer_step(opt, NULL));
        for (i = 0; i < 4; i++) {
            double want = -0.1 * g[i] / (fabs(g[i]) + 1e-6);
            CHECK_MSG(fabs(dtr_model_params(m)[i] - want) <= 1e-6, "element %d: %.9g, want %.9g", i,
                      dtr_model_params(m)[i], want);
        }
    }
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* ---- configuration ---- */

static void test_config_defaults(void) {
    dtr_optimizer_config c = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.003f);
    CHECK(c.kind == DTR_OPT_ADAM);
    CHECK(c.schedule.kind == DTR_SCHED_CONSTANT && c.schedule.lr == 0.003f && c.schedule.warmup_steps == 0);
    CHECK(c.beta1 == 0.9 && c.beta2 == 0.999 && c.eps == 1e-8f);
    CHECK(c.weight_decay == 0.0f && c.momentum == 0.0f && c.nesterov == 0 && c.dampening == 0.0f);
    CHECK(c.clip_norm == 0.0f && c.grad_accum_steps == 1);
    c = dtr_optimizer_config_init(DTR_OPT_LAMB, 0.01f);
    CHECK(c.eps == 1e-6f);
    c = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.01f);
    CHECK(c.weight_decay == 0.01f);
    c = dtr_optimizer_config_init(DTR_OPT_SGD, 0.01f);
    CHECK(c.weight_decay == 0.0f && c.momentum == 0.0f);
}

static void expect_invalid(fx *f, const dtr_optimizer_config *cfg, const char *what) {
    dtr_optimizer *opt = (dtr_optimizer *)&opt; /* must be overwritten with NULL */
    dtr_result r = dtr_optimizer_create(f->m, cfg, &opt);
    CHECK_MSG(r == DTR_INVALID_ARGUMENT, "%s: got %s", what, dtr_result_string(r));
    CHECK_MSG(opt == NULL, "%s: *out not NULL", what);
    CHECK_MSG(dtr_context_status(f->ctx) == DTR_INVALID_ARGUMENT, "%s: status %d", what, dtr_context_status(f->ctx));
    CHECK_MSG(strstr(dtr_context_last_error(f->ctx), "dtr_optimizer_create") != NULL, "%s: message '%s'", what,
              dtr_context_last_error(f->ctx));
    if (r == DTR_OK) dtr_optimizer_destroy(opt);
    dtr_context_clear_error(f->ctx);
}

static void test_invalid_configs(void) {
    fx f;
    dtr_optimizer_config c;
    fx_open(&f);
    c = dtr_optimizer_config_init(DTR_OPT_SGD, -0.1f);
    expect_invalid(&f, &c, "negative lr");
    c = dtr_optimizer_config_init(DTR_OPT_SGD, NAN);
    expect_invalid(&f, &c, "NaN lr");
    c = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.1f);
    c.beta1 = 1.0;
    expect_invalid(&f, &c, "beta1 = 1");
    c = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.1f);
    c.beta2 = 1.5;
    expect_invalid(&f, &c, "beta2 = 1.5");
    c = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    c.nesterov = 1;
    expect_invalid(&f, &c, "nesterov without momentum");
    c.momentum = 0.9f;
    c.dampening = 0.1f;
    expect_invalid(&f, &c, "nesterov with dampening");
    c = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    c.momentum = -0.5f;
    expect_invalid(&f, &c, "negative momentum");
    c = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.1f);
    c.weight_decay = -0.01f;
    expect_invalid(&f, &c, "negative weight decay");
    c = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.1f);
    c.eps = -1e-8f;
    expect_invalid(&f, &c, "negative eps");
    c = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.1f);
    c.clip_norm = -1.0f;
    expect_invalid(&f, &c, "negative clip_norm");
    c = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.1f);
    c.grad_accum_steps = -2;
    expect_invalid(&f, &c, "negative grad_accum_steps");
    c = dtr_optimizer_config_init(DTR_OPT_ADAM, 0.1f);
    c.kind = (dtr_optimizer_kind)17;
    expect_invalid(&f, &c, "unknown kind");
    {   /* schedules dtr_schedule_lr cannot follow, and lr groups without a pattern or scale */
        static const struct { dtr_schedule_kind kind; float min_lr, gamma; int64_t total, step_size; const char *what; } bad[] = {
            {(dtr_schedule_kind)17, 0.0f, 0.5f, 10, 1, "unknown schedule kind"},
            {DTR_SCHED_ONE_CYCLE, 0.0f, 0.5f, 0, 1, "one-cycle without total_steps"},
            {DTR_SCHED_COSINE_RESTARTS, 0.0f, 2.0f, 10, 0, "restarts without a cycle length"},
            {DTR_SCHED_COSINE_RESTARTS, 0.0f, 1.5f, 10, 4, "restarts growing by 1.5"},
            {DTR_SCHED_COSINE_RESTARTS, 0.0f, 0.0f, 10, 4, "restarts growing by 0"},
            {DTR_SCHED_PLATEAU, 0.0f, 1.0f, 10, 4, "plateau factor 1"},
            {DTR_SCHED_PLATEAU, -1.0f, 0.5f, 10, 4, "plateau to a negative floor"},
            {DTR_SCHED_MULTISTEP, 0.0f, -0.5f, 10, 4, "multi-step by a negative factor"},
            {DTR_SCHED_COSINE, 0.0f, 0.5f, 0, 1, "cosine without total_steps"},
            {DTR_SCHED_LINEAR, -0.2f, 0.5f, 10, 1, "linear to a negative min_lr"},
            {DTR_SCHED_POLY, 0.0f, 0.0f, 10, 1, "polynomial power 0"},
            {DTR_SCHED_EXPONENTIAL, 0.0f, -1.0f, 10, 1, "negative exponential factor"},
            {DTR_SCHED_STEP, 0.0f, 0.5f, 10, 0, "step schedule without step_size"},
            {DTR_SCHED_INV_SQRT, 0.0f, 0.5f, 10, -4, "negative timescale"}};
        dtr_lr_group g[2] = {{"p0", 2.0f}, {NULL, 1.0f}};
        size_t k;
        for (k = 0; k < sizeof bad / sizeof bad[0]; k++) {
            c = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
            c.schedule.kind = bad[k].kind, c.schedule.min_lr = bad[k].min_lr, c.schedule.gamma = bad[k].gamma;
            c.schedule.total_steps = bad[k].total, c.schedule.step_size = bad[k].step_size;
            expect_invalid(&f, &c, bad[k].what);
        }
        c = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
        c.schedule.kind = DTR_SCHED_MULTISTEP, c.schedule.milestones[0] = 5, c.schedule.milestones[1] = 5;
        expect_invalid(&f, &c, "milestones not ascending");
        c.schedule.milestones[1] = 0, c.schedule.milestones[2] = 9;
        expect_invalid(&f, &c, "a milestone after the list's end");
        c.schedule.milestones[0] = -5;
        expect_invalid(&f, &c, "a negative milestone");
        c = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
        c.schedule.max_momentum = 0.9f, c.schedule.base_momentum = 0.8f;
        expect_invalid(&f, &c, "momentum cycled by a constant schedule");
        c.schedule.kind = DTR_SCHED_ONE_CYCLE, c.schedule.total_steps = 10, c.schedule.base_momentum = 1.0f;
        expect_invalid(&f, &c, "one-cycle's base momentum 1");
        c.schedule.base_momentum = 0.8f, c.schedule.start_lr = -1.0f;
        expect_invalid(&f, &c, "one-cycle from a negative rate");
        c.schedule.start_lr = 0.01f, c.kind = DTR_OPT_ADAGRAD;
        expect_invalid(&f, &c, "one-cycle cycling Adagrad's momentum");
        c = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
        c.schedule.threshold = -1e-4f;
        expect_invalid(&f, &c, "a negative threshold");
        c.schedule.threshold = 0.0f, c.schedule.cooldown = -1;
        expect_invalid(&f, &c, "a negative cooldown");
        c = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
        c.lr_groups = g, c.n_lr_groups = 2;
        expect_invalid(&f, &c, "lr group without a pattern");
        g[1].match = "p1", g[1].scale = -1.0f;
        expect_invalid(&f, &c, "negative lr group scale");
        g[1].scale = INFINITY;
        expect_invalid(&f, &c, "infinite lr group scale");
        c.lr_groups = NULL;
        expect_invalid(&f, &c, "lr groups without an array");
    }
    /* a valid one still works after all that */
    {
        dtr_optimizer *opt = NULL;
        c = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
        c.momentum = 0.9f;
        c.nesterov = 1;
        CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &c, &opt));
        CHECK(opt != NULL);
        dtr_optimizer_destroy(opt);
    }
    fx_close(&f);
}

static void test_null_handles(void) {
    fx f;
    dtr_optimizer_config c = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    dtr_optimizer *opt = NULL;
    int updated = -1, count = -1;
    fx_open(&f);
    CHECK_EQ_INT(dtr_optimizer_create(NULL, &c, &opt), DTR_NULL_HANDLE);
    CHECK(opt == NULL);
    CHECK_EQ_INT(dtr_optimizer_create(f.m, NULL, &opt), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_optimizer_create(f.m, &c, NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_optimizer_step(NULL, &updated), DTR_NULL_HANDLE);
    CHECK_EQ_INT(updated, 0);
    CHECK_EQ_INT(dtr_optimizer_steps(NULL), 0);
    CHECK(dtr_optimizer_lr(NULL) == 0.0f);
    CHECK(dtr_optimizer_moments(NULL, 0, &count) == NULL);
    CHECK_EQ_INT(count, 0);
    dtr_optimizer_set_lr(NULL, 1.0f);
    dtr_optimizer_destroy(NULL);
    /* a plain SGD optimizer has no state */
    CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &c, &opt));
    count = -1;
    CHECK(dtr_optimizer_moments(opt, 0, &count) == NULL);
    CHECK_EQ_INT(count, 0);
    CHECK(dtr_optimizer_moments(opt, 5, NULL) == NULL);
    dtr_optimizer_destroy(opt);
    CHECK_EQ_INT(dtr_context_status(f.ctx), DTR_OK);
    fx_close(&f);
}

/* ---- frozen parameters (dtr_model_set_trainable) ----
 * A 3-layer MLP (l1 4->8 tanh, l2 8->8 tanh, l3 8->2) trained with AdamW or LAMB (weight decay 0.1)
 * with l2 frozen: l2 keeps its bits, gets no gradient, and l1 and l3 end exactly where a model
 * holding only l1 and l3, with l2's values as constants, ends; the optimizer keeps moments for
 * l1 and l3 only (as many bytes as that model's); unfreezing l2 keeps l1's and l3's moments,
 * starts l2's from zero and moves l2. */

typedef struct fz_net { dtr_model *m; dtr_linear_layer l1, l2, l3; dtr_tensor *w2, *b2; } fz_net;

static void fz_make(dtr_context *ctx, fz_net *n, int whole) {
    memset(n, 0, sizeof *n);
    dtr_model_create(ctx, 11, &n->m);
    dtr_linear_layer_init(&n->l1, n->m, "l1", 4, 8, 1, DTR_INIT_TORCH_DEFAULT);
    if (whole) dtr_linear_layer_init(&n->l2, n->m, "l2", 8, 8, 1, DTR_INIT_TORCH_DEFAULT);
    dtr_linear_layer_init(&n->l3, n->m, "l3", 8, 2, 1, DTR_INIT_TORCH_DEFAULT);
    dtr_model_build(n->m);
}

/* l2 as the whole model's layer, or (w2, b2 given) as constants of these values */
static float fz_step(dtr_context *ctx, fz_net *n, dtr_optimizer *opt, const float *w2, const float *b2, int t) {
    float x[16 * 4], y[16 * 2], loss;
    int64_t xs[2] = {16, 4}, ys[2] = {16, 2}, ws[2] = {8, 8}, bs = 8;
    dtr_tensor *h;
    int k;
    for (k = 0; k < 64; k++) x[k] = (float)sin(0.3 * k + t);
    for (k = 0; k < 32; k++) y[k] = (float)cos(0.2 * k - t);
    h = dtr_tanh(ctx, dtr_linear_layer_forward(ctx, &n->l1, dtr_tensor_from(ctx, DTR_F32, 2, xs, x)));
    h = w2 ? dtr_linear(ctx, h, dtr_tensor_from(ctx, DTR_F32, 2, ws, w2), dtr_tensor_from(ctx, DTR_F32, 1, &bs, b2))
           : dtr_linear_layer_forward(ctx, &n->l2, h);
    h = dtr_linear_layer_forward(ctx, &n->l3, dtr_tanh(ctx, h));
    h = dtr_mse(ctx, h, dtr_tensor_from(ctx, DTR_F32, 2, ys, y));
    CHECK_OK(ctx, dtr_backward(ctx, h));
    loss = dtr_tensor_get(h, 0);
    CHECK_OK(ctx, dtr_optimizer_step(opt, NULL));
    dtr_context_reset(ctx);
    return loss;
}

static void fz_read(dtr_tensor *t, float *out, int n) { dtr_tensor_read(t, DTR_F32, out, (size_t)n); }

/* After l2 of a was unfrozen: both moments span a's whole buffer, l1's and l3's as b's (the
   model without l2, trained alike), l2's zero. */
static void fz_carried(dtr_model *a, dtr_optimizer *oa, dtr_optimizer *ob) {
    int64_t l2 = dtr_model_param_offset(a, 2), l3 = dtr_model_param_offset(a, 4), n = dtr_model_numel(a), i;
    int k, count = 0;
    for (k = 0; k < 2; k++) {
        const float *ma = dtr_optimizer_moments(oa, k, &count), *mb = dtr_optimizer_moments(ob, k, NULL);
        int zero = 1;
        CHECK(ma && mb && count == 2);
        if (!ma || !mb) return;
        for (i = l2; i < l3; i++) zero &= ma[i] == 0.0f;
        CHECK_MSG(memcmp(ma, mb, (size_t)l2 * sizeof(float)) == 0, "moment %d of l1 not carried", k);
        CHECK_MSG(memcmp(ma + l3, mb + l2, (size_t)(n - l3) * sizeof(float)) == 0, "moment %d of l3 not carried", k);
        CHECK_MSG(zero, "moment %d of l2 is not zero", k);
    }
    CHECK_EQ_INT(test_moment_bytes(oa), 2 * (size_t)n * sizeof(float));
}

static void frozen_case(dtr_optimizer_kind kind) {
    dtr_context *ctx = test_ctx(1);
    dtr_optimizer_config oc = dtr_optimizer_config_init(kind, 0.05f);
    dtr_optimizer *oa = NULL, *ob = NULL;
    fz_net a, b;
    const char *l2[1] = {"l2."}, *typo[1] = {"l9."};
    float w2[64], b2[8], w2_after[64], b2_after[8], pa[32], pb[32], gz[64];
    int t, k;
    oc.weight_decay = 0.1f;
    fz_make(ctx, &a, 1);
    fz_make(ctx, &b, 0);
    fz_read(a.l2.weight, w2, 64), fz_read(a.l2.bias, b2, 8);
    fz_read(a.l1.weight, pa, 32), dtr_tensor_write(b.l1.weight, DTR_F32, pa, 32);   /* b starts where a does */
    fz_read(a.l1.bias, pa, 8), dtr_tensor_write(b.l1.bias, DTR_F32, pa, 8);
    fz_read(a.l3.weight, pa, 16), dtr_tensor_write(b.l3.weight, DTR_F32, pa, 16);
    fz_read(a.l3.bias, pa, 2), dtr_tensor_write(b.l3.bias, DTR_F32, pa, 2);
    CHECK_OK(ctx, dtr_model_set_trainable(a.m, l2, 1, 0));
    CHECK(dtr_model_param_trainable(a.m, 0) && !dtr_model_param_trainable(a.m, 2) && !dtr_model_param_trainable(a.m, 3));
    CHECK(dtr_model_set_trainable(a.m, typo, 1, 0) == DTR_NOT_FOUND && strstr(dtr_context_last_error(ctx), "'l9.'"));
    dtr_context_clear_error(ctx);
    {   /* every parameter of a model without any: nothing matched, no prefix to name */
        dtr_model *none = NULL;
        dtr_model_create(ctx, 1, &none);
        CHECK(dtr_model_set_trainable(none, NULL, 0, 0) == DTR_NOT_FOUND);
        dtr_context_clear_error(ctx);
        dtr_model_destroy(none);
    }
    CHECK_OK(ctx, dtr_optimizer_create(a.m, &oc, &oa));
    CHECK_OK(ctx, dtr_optimizer_create(b.m, &oc, &ob));
    for (t = 0; t < 5; t++) {
        float la = fz_step(ctx, &a, oa, NULL, NULL, t), lb = fz_step(ctx, &b, ob, w2, b2, t);
        CHECK_MSG(la == lb, "step %d: loss %.9g frozen, %.9g with constants", t, (double)la, (double)lb);
    }
    fz_read(a.l2.weight, w2_after, 64), fz_read(a.l2.bias, b2_after, 8);
    CHECK(memcmp(w2, w2_after, sizeof w2) == 0 && memcmp(b2, b2_after, sizeof b2) == 0);   /* weight decay too */
    memset(gz, 0, sizeof gz);
    CHECK(memcmp(dtr_tensor_grad(a.l2.weight), gz, sizeof gz) == 0);
    fz_read(a.l1.weight, pa, 32), fz_read(b.l1.weight, pb, 32);
    CHECK(memcmp(pa, pb, sizeof pa) == 0);
    fz_read(a.l3.weight, pa, 16), fz_read(b.l3.weight, pb, 16);
    CHECK(memcmp(pa, pb, 16 * sizeof(float)) == 0);
    CHECK_EQ_INT(test_moment_bytes(oa), test_moment_bytes(ob));   /* no state for l2 */
    CHECK_EQ_INT(dtr_optimizer_state_bytes(oa), test_moment_bytes(ob));
    CHECK_OK(ctx, dtr_model_set_trainable(a.m, NULL, 0, 1));   /* everything trainable again */
    fz_carried(a.m, oa, ob);
    fz_step(ctx, &a, oa, NULL, NULL, 9);
    fz_read(a.l2.weight, w2_after, 64);
    for (k = 0; k < 64 && w2_after[k] == w2[k]; k++) {}
    CHECK(k < 64);
    dtr_optimizer_destroy(oa), dtr_optimizer_destroy(ob);
    dtr_model_destroy(a.m), dtr_model_destroy(b.m);
    dtr_context_destroy(ctx);
}

#if defined(__linux__)
/* pages of [p, p + bytes) in memory (mincore), the partial pages at the ends left out */
static long resident_pages(const float *p, size_t bytes) {
    long page = sysconf(_SC_PAGESIZE), n = 0, k;
    uintptr_t lo = ((uintptr_t)p + (uintptr_t)page - 1) / (uintptr_t)page * (uintptr_t)page;
    uintptr_t hi = ((uintptr_t)p + bytes) / (uintptr_t)page * (uintptr_t)page;
    unsigned char vec[4096];
    if (hi <= lo || (hi - lo) / (uintptr_t)page > sizeof vec || mincore((void *)lo, hi - lo, vec) != 0) return -1;
    for (k = 0; k < (long)((hi - lo) / (uintptr_t)page); k++) n += vec[k] & 1;
    return n;
}
#endif

/* A large frozen body's gradient takes no memory on the CPU: after steps with clipping and
   loss scaling its gradient pages are not resident (the trainable head's are), and read zero.
   Unfrozen, they fill in; frozen again, they are given back. */
static void test_frozen_grad_memory(void) {
#if defined(__linux__)
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    dtr_optimizer *o = NULL;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.01f);
    dtr_loss_scaler *ls = NULL;
    dtr_loss_scaler_config lc = dtr_loss_scaler_config_init();
    const char *body[1] = {"body"};
    int64_t bs[2] = {512, 1024}, hs[2] = {1024, 1}, xs[2] = {4, 512};   /* body: 2 MiB of floats */
    dtr_tensor *w, *h;
    float x[4 * 512], g[64];
    size_t bytes = 512 * 1024 * sizeof(float);
    int t, k;
    for (k = 0; k < 4 * 512; k++) x[k] = (float)sin(0.01 * k);
    CHECK_OK(ctx, dtr_model_create(ctx, 3, &m));
    w = dtr_model_param(m, "body", 2, bs, DTR_INIT_NORMAL, 0.02f);
    h = dtr_model_param(m, "head", 2, hs, DTR_INIT_NORMAL, 0.02f);
    CHECK_OK(ctx, dtr_model_set_trainable(m, body, 1, 0));
    oc.clip_norm = 1e-3f;   /* clipping scales the gradients every step */
    CHECK_OK(ctx, dtr_optimizer_create(m, &oc, &o));
    CHECK_OK(ctx, dtr_loss_scaler_create(&lc, &ls));
    for (t = 0; t < 6; t++) {
        dtr_tensor *y;
        if (t == 3) CHECK_OK(ctx, dtr_model_set_trainable(m, body, 1, 1));
        if (t == 4) CHECK_OK(ctx, dtr_model_set_trainable(m, body, 1, 0));
        y = dtr_matmul(ctx, dtr_matmul(ctx, dtr_tensor_from(ctx, DTR_F32, 2, xs, x), w), h);
        y = dtr_mean_all(ctx, dtr_mul(ctx, y, y));
        CHECK_OK(ctx, dtr_backward(ctx, dtr_loss_scaler_scale(ls, ctx, y)));
        if (t == 3) CHECK(resident_pages(dtr_tensor_grad(w), bytes) > 0);   /* unfrozen: written */
        CHECK_OK(ctx, dtr_loss_scaler_step(ls, m, o, NULL));
        dtr_context_reset(ctx);
        if (t != 3)
            CHECK_MSG(resident_pages(dtr_tensor_grad(w), bytes) == 0, "step %d: %ld of the frozen body's gradient pages "
                      "resident", t, resident_pages(dtr_tensor_grad(w), bytes));
    }
    memcpy(g, dtr_tensor_grad(w) + 100000, sizeof g);
    for (k = 0; k < 64 && g[k] == 0.0f; k++) {}
    CHECK(k == 64);
    dtr_loss_scaler_destroy(ls);
    dtr_optimizer_destroy(o);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
#else
    printf("     SKIP: mincore is Linux's\n");
#endif
}

#if defined(__linux__)
/* allocation callbacks handing out shared mappings filled with 0xff bytes (NaNs), as a pool
   that reuses memory might: madvise DONTNEED neither zeroes nor frees such pages */
static void *shared_alloc(size_t bytes, void *user) {
    size_t *p = (size_t *)mmap(NULL, bytes + 64, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    (void)user;
    if (p == MAP_FAILED) return NULL;
    memset(p, 0xff, bytes + 64);
    p[0] = bytes + 64;
    return (char *)p + 64;
}
static void shared_free(void *q, void *user) {
    (void)user;
    if (q) munmap((char *)q - 64, *(size_t *)((char *)q - 64));
}
static void *shared_realloc(void *q, size_t bytes, void *user) {
    void *n = shared_alloc(bytes, user);
    size_t old = q ? *(size_t *)((char *)q - 64) - 64 : 0;
    if (n && q) memcpy(n, q, old < bytes ? old : bytes);
    if (n) shared_free(q, user);
    return n;
}
#endif

/* The same frozen body on such an allocator: the gradients still start and stay zero (the
   library fills what it would have given back), so training stays finite */
static void test_grad_memory_callbacks(void) {
#if defined(__linux__)
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_model *m = NULL;
    dtr_optimizer *o = NULL;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    const char *body[1] = {"body"};
    int64_t bs[2] = {256, 1024}, hs[2] = {1024, 1}, xs[2] = {4, 256};
    dtr_tensor *w, *h, *y;
    float x[4 * 256], head[1024];
    int t, k;
    cc.threads = 1;
    cc.alloc.malloc_fn = shared_alloc, cc.alloc.realloc_fn = shared_realloc, cc.alloc.free_fn = shared_free;
    CHECK_OK(ctx, dtr_context_create(&cc, &ctx));
    if (!ctx) return;
    for (k = 0; k < 4 * 256; k++) x[k] = (float)cos(0.01 * k);
    CHECK_OK(ctx, dtr_model_create(ctx, 3, &m));
    w = dtr_model_param(m, "body", 2, bs, DTR_INIT_NORMAL, 0.02f);
    h = dtr_model_param(m, "head", 2, hs, DTR_INIT_NORMAL, 0.02f);
    CHECK_OK(ctx, dtr_model_build(m));
    CHECK(dtr_tensor_grad(h)[0] == 0.0f && dtr_tensor_grad(w)[12345] == 0.0f);
    CHECK_OK(ctx, dtr_model_set_trainable(m, body, 1, 0));
    CHECK_OK(ctx, dtr_optimizer_create(m, &oc, &o));
    for (t = 0; t < 3; t++) {
        y = dtr_matmul(ctx, dtr_matmul(ctx, dtr_tensor_from(ctx, DTR_F32, 2, xs, x), w), h);
        CHECK_OK(ctx, dtr_backward(ctx, dtr_mean_all(ctx, dtr_mul(ctx, y, y))));
        CHECK_OK(ctx, dtr_optimizer_step(o, NULL));
        dtr_context_reset(ctx);
    }
    dtr_tensor_read(h, DTR_F32, head, 1024);
    for (k = 0; k < 1024 && isfinite(head[k]); k++) {}
    CHECK_MSG(k == 1024, "head[%d] = %g after 3 steps", k, k < 1024 ? (double)head[k] : 0.0);
    CHECK(dtr_tensor_grad(w)[12345] == 0.0f && dtr_tensor_grad(h)[7] == 0.0f);
    dtr_optimizer_destroy(o);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
#else
    printf("     SKIP: shared mappings through mmap are Linux's here\n");
#endif
}

/* no_decay by name ("*bias", the pattern array gone after create) gives decay_matrices_only's
   bits on the MLP (whose only 1-D parameters are its biases), and differs from decaying all */
static void test_no_decay(void) {
    dtr_context *ctx = test_ctx(1);
    fz_net n[3];
    dtr_optimizer *o[3];
    float p[3][40];
    int k, t;
    for (k = 0; k < 3; k++) {
        dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.05f);
        char pat[8];
        const char *pats[1];
        snprintf(pat, sizeof pat, "*bias");
        pats[0] = pat;
        oc.weight_decay = 0.5f;
        oc.decay_matrices_only = k == 0;
        if (k == 1) oc.no_decay = pats, oc.n_no_decay = 1;
        fz_make(ctx, &n[k], 1);
        CHECK_OK(ctx, dtr_optimizer_create(n[k].m, &oc, &o[k]));
        memset(pat, 0, sizeof pat);   /* read at create only */
    }
    for (t = 0; t < 5; t++)
        for (k = 0; k < 3; k++) fz_step(ctx, &n[k], o[k], NULL, NULL, t);
    for (k = 0; k < 3; k++) fz_read(n[k].l1.bias, p[k], 8), fz_read(n[k].l1.weight, p[k] + 8, 32);
    CHECK(memcmp(p[0], p[1], sizeof p[0]) == 0);
    CHECK(memcmp(p[0], p[2], 8 * sizeof(float)) != 0);   /* the biases decayed there */
    for (k = 0; k < 3; k++) dtr_optimizer_destroy(o[k]), dtr_model_destroy(n[k].m);
    dtr_context_destroy(ctx);
}

/* AdamW, and LAMB (its per-parameter trust ratios over the runs of trainable parameters) */
/* A parameter frozen and thawed again between two updates keeps its state: the optimizer lays
   its state out again only at its next update, when the parameter is trainable again (a GAN's
   discriminator, frozen while the generator's loss runs through it, stepped by an optimizer of
   its own). The updates are those of a run without the freeze, bit for bit. */
static void test_frozen_between_updates(void) {
    static const char *p1[1] = {"p1"};
    float want0[OPTF_N0], want1[OPTF_N1], got0[OPTF_N0], got1[OPTF_N1], wm[OPTF_N1], gm[OPTF_N1];
    int run, s, count = 0;
    for (run = 0; run < 2; run++) {
        fx f;
        dtr_optimizer_config cfg = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.01f);
        dtr_optimizer *opt = NULL;
        cfg.weight_decay = 0.01f;
        fx_open(&f);
        CHECK_OK(f.ctx, dtr_optimizer_create(f.m, &cfg, &opt));
        if (!opt) { fx_close(&f); return; }
        for (s = 0; s < 4; s++) {
            if (run == 1 && s == 2) {   /* between updates 1 and 2: p1 frozen, a backward through it, thawed */
                CHECK_OK(f.ctx, dtr_model_set_trainable(f.m, p1, 1, 0));
                fx_backward(&f, 5, 0);
                CHECK(dtr_model_grads(f.m)[f.off1] == 0.0f);
                CHECK_OK(f.ctx, dtr_model_zero_grad(f.m));
                CHECK_OK(f.ctx, dtr_model_set_trainable(f.m, p1, 1, 1));
            }
            fx_backward(&f, s, 0);
            CHECK_OK(f.ctx, dtr_optimizer_step(opt, NULL));
        }
        fx_read(&f, run ? got0 : want0, run ? got1 : want1);
        memcpy(run ? gm : wm, dtr_optimizer_moments(opt, 0, &count) + f.off1, sizeof wm);
        dtr_optimizer_destroy(opt);
        fx_close(&f);
    }
    CHECK_MSG(memcmp(want0, got0, sizeof want0) == 0 && memcmp(want1, got1, sizeof want1) == 0 && memcmp(wm, gm, sizeof wm) == 0,
              "a freeze and thaw between updates changed the parameters or p1's first moment");
}

static void test_frozen(void) {
    frozen_case(DTR_OPT_ADAMW);
    frozen_case(DTR_OPT_LAMB);
}

int main(void) {
    RUN(test_against_torch);
    RUN(test_padding_untouched);
    RUN(test_grad_accumulation);
    RUN(test_accumulation_with_clip);
    RUN(test_clip_grad_norm);
    RUN(test_schedules);
    RUN(test_optimizer_schedule);
    RUN(test_plateau);
    RUN(test_backward_then_step);
    RUN(test_lamb_zero_param);
    RUN(test_frozen);
    RUN(test_frozen_between_updates);
    RUN(test_thaw_state);
    RUN(test_unreached);
    RUN(test_frozen_grad_memory);
    RUN(test_grad_memory_callbacks);
    RUN(test_no_decay);
    RUN(test_config_defaults);
    RUN(test_invalid_configs);
    RUN(test_null_handles);
    printf("     max rel err vs torch: parameters %.3g, optimizer state %.3g, schedules %.3g, clipping %.3g;\n"
           "     without the %g floor: %.3g\n",
           g_max_err_params, g_max_err_state, g_max_err_sched, g_max_err_clip, REL_FLOOR, g_max_pure_rel);
    return test_summary();
}
