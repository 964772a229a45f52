/* tests/test_state.c: state for checkpoints and sharded updates.
 *   test_full_state_resume   a full-state checkpoint is one loop over the objects' state
 *                            entries (context, model, optimizer, loader): saved after K steps,
 *                            trained on, restored, trained again: the same losses and
 *                            parameters bit for bit (dropout, momentum, shuffled loader)
 *   test_state_errors        entries past the last, NULL handles, corrupt counters refused
 *   test_step_range          ZeRO-style: each of two shards updates its half with
 *                            dtr_optimizer_step_range; together they equal one full step, bit
 *                            for bit (SGD momentum, Nesterov, Adam, AdamW; LAMB on a parameter
 *                            boundary); LAMB inside a parameter and clipping are refused
 *   test_atomic_write        dtr_write_file_atomic replaces a file whole, and a failure leaves
 *                            the old file and no temporary file */
#include "test.h"

#define N_SAMPLES 96
#define D_IN 6

typedef struct rig {
    dtr_context *ctx;
    dtr_model *m;
    dtr_optimizer *opt;
    dtr_loader *ld;
    dtr_dataset *ds;
    dtr_linear_layer l1, l2;
} rig;

static float g_x[N_SAMPLES * D_IN];
static int32_t g_y[N_SAMPLES];

static void make_data(void) {
    dtr_rng r;
    int i;
    dtr_rng_seed(&r, 5, 1);
    for (i = 0; i < N_SAMPLES * D_IN; i++) g_x[i] = dtr_rng_uniform(&r) * 2.0f - 1.0f;
    for (i = 0; i < N_SAMPLES; i++) g_y[i] = (int32_t)(dtr_rng_u32(&r) % 3);
}

static int rig_open(rig *g, dtr_optimizer_kind kind) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_memory_dataset_config mc = dtr_memory_dataset_config_init();
    dtr_loader_config lc = dtr_loader_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(kind, 0.05f);
    memset(g, 0, sizeof *g);
    cc.threads = 1;
    cc.seed = 11;
    mc.count = N_SAMPLES;
    mc.layout.x_dtype = DTR_F32;
    mc.layout.x_ndim = 1;
    mc.layout.x_shape[0] = D_IN;
    mc.layout.y_dtype = DTR_I32;
    mc.x = g_x;
    mc.y = g_y;
    lc.batch_size = 16;
    lc.shuffle = 1;
    lc.seed = 3;
    oc.momentum = kind == DTR_OPT_SGD ? 0.9f : 0.0f;
    oc.schedule.kind = DTR_SCHED_COSINE;
    oc.schedule.total_steps = 40;
    return dtr_context_create(&cc, &g->ctx) == DTR_OK && dtr_model_create(g->ctx, 9, &g->m) == DTR_OK &&
           dtr_linear_layer_init(&g->l1, g->m, "l1", D_IN, 8, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
           dtr_linear_layer_init(&g->l2, g->m, "l2", 8, 3, 1, DTR_INIT_TORCH_DEFAULT) == DTR_OK &&
           dtr_optimizer_create(g->m, &oc, &g->opt) == DTR_OK &&
           dtr_dataset_from_memory(&mc, &g->ds, NULL, 0) == DTR_OK && dtr_loader_create(g->ds, &lc, &g->ld, NULL, 0) == DTR_OK;
}

static void rig_close(rig *g) {
    dtr_loader_destroy(g->ld);
    dtr_dataset_destroy(g->ds);
    dtr_optimizer_destroy(g->opt);
    dtr_model_destroy(g->m);
    dtr_context_destroy(g->ctx);
}

/* One training step with dropout; returns the loss (NAN on failure). */
static float rig_step(rig *g) {
    dtr_batch b;
    dtr_tensor *x, *y, *h, *loss;
    float v;
    if (dtr_loader_next(g->ld, &b) != DTR_OK || dtr_batch_tensors(g->ctx, &b, &x, &y) != DTR_OK) return NAN;
    h = dtr_dropout(g->ctx, dtr_relu(g->ctx, dtr_linear_layer_forward(g->ctx, &g->l1, x)), 0.25f);
    loss = dtr_cross_entropy(g->ctx, dtr_linear_layer_forward(g->ctx, &g->l2, h), y);
    if (dtr_backward(g->ctx, loss) != DTR_OK) return NAN;
    v = dtr_tensor_get(loss, 0);
    if (dtr_optimizer_step(g->opt, NULL) != DTR_OK) return NAN;
    dtr_context_reset(g->ctx);
    return v;
}

/* ---- the checkpoint: one loop over every object's entries ---- */

typedef dtr_result (*state_fn)(void *obj, int index, dtr_state_entry *out);
static dtr_result st_ctx(void *o, int i, dtr_state_entry *e) { return dtr_context_state((dtr_context *)o, i, e); }
static dtr_result st_model(void *o, int i, dtr_state_entry *e) { return dtr_model_state((dtr_model *)o, i, e); }
static dtr_result st_opt(void *o, int i, dtr_state_entry *e) { return dtr_optimizer_state((dtr_optimizer *)o, i, e); }
static dtr_result st_loader(void *o, int i, dtr_state_entry *e) { return dtr_loader_state((dtr_loader *)o, i, e); }

typedef struct blob { unsigned char *p; size_t n, cap; } blob;

static void blob_put(blob *b, const void *data, size_t n) {
    if (b->n + n > b->cap) { b->cap = (b->n + n) * 2; b->p = (unsigned char *)realloc(b->p, b->cap); }
    memcpy(b->p + b->n, data, n);
    b->n += n;
}

/* save (restore 0) or restore (1) every entry of the rig's objects into/from b */
static int checkpoint(rig *g, blob *b, int restore) {
    void *objs[4] = {g->ctx, g->m, g->opt, g->ld};
    state_fn fns[4] = {st_ctx, st_model, st_opt, st_loader};
    size_t at = 0;
    int k, i, entries = 0;
    dtr_state_entry e;
    for (k = 0; k < 4; k++)
        for (i = 0; fns[k](objs[k], i, &e) == DTR_OK; i++, entries++) {
            if (e.device) return -1;                       /* host memory on the CPU */
            if (!restore) blob_put(b, e.data, e.bytes);
            else { memcpy(e.data, b->p + at, e.bytes); at += e.bytes; }
        }
    if (restore && (dtr_context_state_loaded(g->ctx) != DTR_OK || dtr_model_state_loaded(g->m) != DTR_OK ||
                    dtr_optimizer_state_loaded(g->opt) != DTR_OK || dtr_loader_state_loaded(g->ld) != DTR_OK))
        return -1;
    return entries;
}

static void test_full_state_resume(void) {
    rig g;
    blob b = {NULL, 0, 0};
    float first[9], again[9];
    float *params_first, *params_again;
    int64_t n;
    int i;
    make_data();
    CHECK(rig_open(&g, DTR_OPT_SGD));
    for (i = 0; i < 7; i++) CHECK(!isnan(rig_step(&g)));          /* into the middle of epoch 2 */
    CHECK_EQ_INT(checkpoint(&g, &b, 0), 1 + 2 + 7 + 1);            /* rng; params, grads; steps, micro, schedule, m, started,
                                                                      schedule2, reports; cursor */
    for (i = 0; i < 9; i++) first[i] = rig_step(&g);
    n = dtr_model_numel(g.m);
    params_first = (float *)malloc((size_t)n * sizeof(float));
    memcpy(params_first, dtr_model_params(g.m), (size_t)n * sizeof(float));
    CHECK_EQ_INT(checkpoint(&g, &b, 1), 11);                       /* back to step 7 */
    CHECK_EQ_INT(dtr_optimizer_steps(g.opt), 7);
    for (i = 0; i < 9; i++) again[i] = rig_step(&g);
    params_again = dtr_model_params(g.m);
    for (i = 0; i < 9; i++) CHECK_MSG(first[i] == again[i], "step %d: loss %.9g then %.9g", 7 + i, first[i], again[i]);
    CHECK(memcmp(params_first, params_again, (size_t)n * sizeof(float)) == 0);
    free(params_first);
    free(b.p);
    rig_close(&g);
}

static void test_state_errors(void) {
    rig g;
    dtr_state_entry e;
    int64_t *steps;
    CHECK(rig_open(&g, DTR_OPT_ADAM));
    CHECK_EQ_INT(dtr_context_state(g.ctx, 1, &e), DTR_NOT_FOUND);
    CHECK_EQ_INT(dtr_context_state(NULL, 0, &e), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_model_state(g.m, 2, &e), DTR_NOT_FOUND);
    CHECK_OK(g.ctx, dtr_optimizer_state(g.opt, 4, &e));            /* Adam: m and v */
    CHECK(strcmp(e.name, "v") == 0 && e.bytes == (size_t)dtr_model_numel(g.m) * sizeof(float));
    CHECK_OK(g.ctx, dtr_optimizer_state(g.opt, 5, &e));            /* then each parameter's start */
    CHECK(strcmp(e.name, "started") == 0 && e.bytes == (size_t)dtr_model_param_count(g.m) * sizeof(int64_t));
    CHECK_OK(g.ctx, dtr_optimizer_state(g.opt, 6, &e));            /* the rest of the schedule */
    CHECK(strcmp(e.name, "schedule2") == 0 && e.bytes == sizeof(dtr_schedule) - offsetof(dtr_schedule, milestones));
    CHECK_OK(g.ctx, dtr_optimizer_state(g.opt, 7, &e));            /* the metric reports */
    CHECK(strcmp(e.name, "reports") == 0 && e.bytes == sizeof(dtr_metric_stats));
    ((dtr_metric_stats *)e.data)->bad = -2;                        /* corrupt */
    CHECK_EQ_INT(dtr_optimizer_state_loaded(g.opt), DTR_CORRUPT_FILE);
    dtr_context_clear_error(g.ctx);
    ((dtr_metric_stats *)e.data)->bad = 0;
    CHECK_EQ_INT(dtr_optimizer_state(g.opt, 8, &e), DTR_NOT_FOUND);
    CHECK_EQ_INT(dtr_loader_state(g.ld, 1, &e), DTR_NOT_FOUND);
    CHECK_OK(g.ctx, dtr_optimizer_state(g.opt, 0, &e));
    steps = (int64_t *)e.data;
    *steps = -4;                                                   /* a corrupt counter */
    CHECK_EQ_INT(dtr_optimizer_state_loaded(g.opt), DTR_CORRUPT_FILE);
    dtr_context_clear_error(g.ctx);
    *steps = 0;
    CHECK_OK(g.ctx, dtr_loader_state(g.ld, 0, &e));
    ((dtr_loader_cursor *)e.data)->magic = 0;                      /* a corrupt cursor */
    CHECK_EQ_INT(dtr_loader_state_loaded(g.ld), DTR_INVALID_ARGUMENT);
    rig_close(&g);
}

/* ---- step over a range ---- */

static void range_case(dtr_optimizer_kind kind, int nesterov, const char *name) {
    rig full, s0, s1;
    int64_t n, h;
    dtr_optimizer_config oc = dtr_optimizer_config_init(kind, 0.05f);
    int k;
    CHECK(rig_open(&full, kind) && rig_open(&s0, kind) && rig_open(&s1, kind));
    if (nesterov) {
        rig *rs[3] = {&full, &s0, &s1};
        oc.momentum = 0.9f;
        oc.nesterov = 1;
        for (k = 0; k < 3; k++) {
            dtr_optimizer_destroy(rs[k]->opt);
            CHECK_OK(rs[k]->ctx, dtr_optimizer_create(rs[k]->m, &oc, &rs[k]->opt));
        }
    }
    n = dtr_model_numel(full.m);
    h = dtr_model_param_offset(full.m, 2);                         /* l2.weight starts the second shard */
    for (k = 0; k < 3; k++) {
        rig *rs[3] = {&full, &s0, &s1};
        int j;
        for (j = 0; j < 3; j++) {                                  /* identical gradients on the three */
            dtr_batch b;
            dtr_tensor *x, *y;
            dtr_loader_next(rs[j]->ld, &b);
            dtr_batch_tensors(rs[j]->ctx, &b, &x, &y);
            CHECK_OK(rs[j]->ctx, dtr_backward(rs[j]->ctx, dtr_cross_entropy(rs[j]->ctx, dtr_linear_layer_forward(rs[j]->ctx,
                     &rs[j]->l2, dtr_relu(rs[j]->ctx, dtr_linear_layer_forward(rs[j]->ctx, &rs[j]->l1, x))), y)));
        }
        CHECK_OK(full.ctx, dtr_optimizer_step(full.opt, NULL));
        CHECK_OK(s0.ctx, dtr_optimizer_step_range(s0.opt, 0, h, NULL));
        CHECK_OK(s1.ctx, dtr_optimizer_step_range(s1.opt, h, n, NULL));
        for (j = 0; j < 3; j++) dtr_context_reset(rs[j]->ctx);
        /* each shard's half equals the full step's; then the shards exchange (all-gather) */
        CHECK_MSG(memcmp(dtr_model_params(s0.m), dtr_model_params(full.m), (size_t)h * sizeof(float)) == 0, "%s: shard 0", name);
        CHECK_MSG(memcmp(dtr_model_params(s1.m) + h, dtr_model_params(full.m) + h, (size_t)(n - h) * sizeof(float)) == 0,
                  "%s: shard 1", name);
        memcpy(dtr_model_params(s0.m) + h, dtr_model_params(s1.m) + h, (size_t)(n - h) * sizeof(float));
        memcpy(dtr_model_params(s1.m), dtr_model_params(s0.m), (size_t)h * sizeof(float));
    }
    rig_close(&full);
    rig_close(&s0);
    rig_close(&s1);
}

static void test_step_range(void) {
    rig g;
    dtr_optimizer_config oc;
    make_data();
    range_case(DTR_OPT_SGD, 0, "sgd momentum");
    range_case(DTR_OPT_SGD, 1, "sgd nesterov");
    range_case(DTR_OPT_ADAM, 0, "adam");
    range_case(DTR_OPT_ADAMW, 0, "adamw");
    range_case(DTR_OPT_LAMB, 0, "lamb");
    CHECK(rig_open(&g, DTR_OPT_LAMB));
    CHECK_EQ_INT(dtr_optimizer_step_range(g.opt, 0, 5, NULL), DTR_INVALID_ARGUMENT);   /* inside l1.weight */
    CHECK(strstr(dtr_context_last_error(g.ctx), "parameter boundaries") != NULL);
    dtr_context_clear_error(g.ctx);
    CHECK_EQ_INT(dtr_optimizer_step_range(g.opt, 0, dtr_model_numel(g.m) + 1, NULL), DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(g.ctx);
    dtr_optimizer_destroy(g.opt);
    oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    oc.clip_norm = 1.0f;
    CHECK_OK(g.ctx, dtr_optimizer_create(g.m, &oc, &g.opt));
    CHECK_EQ_INT(dtr_optimizer_step_range(g.opt, 0, 4, NULL), DTR_INVALID_ARGUMENT);   /* clipping needs it all */
    dtr_context_clear_error(g.ctx);
    CHECK_OK(g.ctx, dtr_optimizer_step_range(g.opt, 0, dtr_model_numel(g.m), NULL));
    rig_close(&g);
}

static void test_atomic_write(void) {
    char path[256], err[256], buf[64];
    const char *tmpdir = getenv("TMPDIR");
    FILE *fp;
    size_t n;
    snprintf(path, sizeof path, "%s/dtr_state_atomic_%d.bin", tmpdir && *tmpdir ? tmpdir : "/tmp", (int)N_SAMPLES);
    CHECK_OK(NULL, dtr_write_file_atomic(path, "first version", 13, err, sizeof err));
    CHECK_OK(NULL, dtr_write_file_atomic(path, "second", 6, err, sizeof err));
    fp = fopen(path, "rb");
    n = fp ? fread(buf, 1, sizeof buf, fp) : 0;
    if (fp) fclose(fp);
    CHECK(n == 6 && memcmp(buf, "second", 6) == 0);
    CHECK_EQ_INT(dtr_write_file_atomic("/nonexistent-dir/x/y.bin", "z", 1, err, sizeof err), DTR_IO_ERROR);
    CHECK(strstr(err, "/nonexistent-dir/x/y.bin") != NULL);
    CHECK_EQ_INT(dtr_write_file_atomic(path, NULL, 3, err, sizeof err), DTR_NULL_HANDLE);
    remove(path);
}

int main(void) {
    dtr_context_destroy(test_ctx(1));   /* the harness's context helper works here too */
    RUN(test_full_state_resume);
    RUN(test_state_errors);
    RUN(test_step_range);
    RUN(test_atomic_write);
    return test_summary();
}
