/* Core behaviour and bad input: contexts, the step arena, allocation counting in steady state,
 * errors of every op family (exact result code and a message naming the op), sticky errors
 * through NULL chains, dtype conversions against known bit patterns, views, models
 * (initialisers, save/load), and bitwise determinism (repeat runs, 1 vs 2 threads).
 * DTR_TEST_QUICK=1 shortens the training loops (sanitizer builds). */
#define _POSIX_C_SOURCE 200809L
#define DTRAIN_INTERNAL_API /* for a dtr_backend with a wrong abi_version only */
#include "test.h"
#include "test_util.h"
#include <unistd.h>
#include <sys/stat.h>

static int g_quick;
static char g_tmpdir[96];   /* short: the paths made from it are 128 bytes */

/* Expects a failed call: its result (`got`, a dtr_result), the context's sticky status and a
 * message that contains `needle`; then clears the error. */
#define EXPECT_ERR(ctx, got, code, needle) do { \
    dtr_result test__g = (got); \
    CHECK_MSG(test__g == (code), "%s: got %s (%d), want %s", #got, dtr_result_string(test__g), (int)test__g, \
              dtr_result_string(code)); \
    CHECK_MSG(dtr_context_status(ctx) == (code), "%s: status %s, want %s", #got, \
              dtr_result_string(dtr_context_status(ctx)), dtr_result_string(code)); \
    CHECK_MSG(strstr(dtr_context_last_error(ctx), (needle)) != NULL, "%s: message '%s' does not name '%s'", #got, \
              dtr_context_last_error(ctx), (needle)); \
    dtr_context_clear_error(ctx); } while (0)
/* Same for a tensor-returning builder: it must return NULL. */
#define EXPECT_NULL(ctx, expr, code, needle) do { \
    dtr_tensor *test__t = (expr); \
    CHECK_MSG(test__t == NULL, "%s returned a tensor", #expr); \
    EXPECT_ERR(ctx, dtr_context_status(ctx), code, needle); } while (0)

static dtr_tensor *tensor_of(dtr_context *ctx, int ndim, const int64_t *shape, float start, float step) {
    int64_t n = 1, i;
    int d;
    float *buf;
    dtr_tensor *t;
    for (d = 0; d < ndim; d++) n *= shape[d];
    buf = (float *)malloc((size_t)(n ? n : 1) * sizeof(float));
    for (i = 0; i < n; i++) buf[i] = start + step * (float)i;
    t = dtr_tensor_from(ctx, DTR_F32, ndim, shape, buf);
    free(buf);
    return t;
}

static dtr_tensor *t2(dtr_context *ctx, int64_t a, int64_t b) {
    int64_t s[2];
    s[0] = a; s[1] = b;
    return tensor_of(ctx, 2, s, 0.5f, 0.25f);
}

static uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ======================================================================== context */

static void test_context_defaults(void) {
    dtr_context_config c = dtr_context_config_init();
    dtr_context *ctx = NULL;
    size_t reserved = 1, used = 1;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    CHECK(c.backend == NULL && c.device == 0 && c.threads == 0);
    CHECK(c.arena_bytes == 0 && c.arena_max_bytes == 0);
    CHECK(c.alloc.user == NULL && c.alloc.malloc_fn == NULL && c.alloc.realloc_fn == NULL && c.alloc.free_fn == NULL);
    CHECK(c.log == NULL && c.log_user == NULL && c.log_level == DTR_LOG_WARN && c.seed == 0);
    CHECK_OK(ctx, dtr_context_create(NULL, &ctx));
    CHECK(ctx != NULL);
    if (!ctx) return;
    CHECK_EQ_INT(dtr_context_threads(ctx), cores > 0 ? cores : 1);
    CHECK(!strcmp(dtr_context_backend_name(ctx), "cpu"));
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_OK);
    CHECK(!strcmp(dtr_context_last_error(ctx), ""));
    dtr_context_arena_usage(ctx, &reserved, &used);
    CHECK_EQ_INT(used, 0);
    CHECK(dtr_tensor_2d(ctx, 100, 100) != NULL);
    dtr_context_arena_usage(ctx, &reserved, &used);
    CHECK(used >= 100 * 100 * sizeof(float) && reserved >= used);
    dtr_context_arena_usage(ctx, NULL, NULL);
    CHECK_OK(ctx, dtr_context_reset(ctx));
    dtr_context_arena_usage(ctx, NULL, &used);
    CHECK_EQ_INT(used, 0);
    /* the switches return the previous setting */
    CHECK_EQ_INT(dtr_context_set_grad_enabled(ctx, 0), 1);
    CHECK_EQ_INT(dtr_context_set_grad_enabled(ctx, 1), 0);
    CHECK_EQ_INT(dtr_context_set_training(ctx, 0), 1);
    CHECK_EQ_INT(dtr_context_set_training(ctx, 1), 0);
    dtr_context_destroy(ctx);
    /* a config from dtr_context_config_init with threads set */
    c.threads = 3;
    ctx = NULL;
    CHECK_OK(ctx, dtr_context_create(&c, &ctx));
    CHECK_EQ_INT(dtr_context_threads(ctx), 3);
    dtr_context_destroy(ctx);
    dtr_context_destroy(NULL);
    CHECK_EQ_INT(dtr_context_reset(NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_context_status(NULL), DTR_NULL_HANDLE);
    CHECK(dtr_context_last_error(NULL) != NULL);
    dtr_context_clear_error(NULL);
    CHECK_EQ_INT(dtr_context_threads(NULL), 0);
}

static void *plain_malloc(size_t n, void *u) { (void)u; return malloc(n); }
static void *plain_realloc(void *p, size_t n, void *u) { (void)u; return realloc(p, n); }
static void plain_free(void *p, void *u) { (void)u; free(p); }

/* No context exists to hold a message here: only the result code and *out = NULL. */
/* what: the case; words: what dtr_context_create_error must hold when it fails */
static void expect_create(const dtr_context_config *c, dtr_result code, const char *what, const char *words) {
    dtr_context *ctx = (dtr_context *)&ctx; /* must be overwritten */
    dtr_result r = dtr_context_create(c, &ctx);
    CHECK_MSG(r == code, "%s: got %s, want %s", what, dtr_result_string(r), dtr_result_string(code));
    CHECK_MSG(code == DTR_OK ? dtr_context_create_error()[0] == 0 : strstr(dtr_context_create_error(), words) != NULL,
              "%s: dtr_context_create_error says \"%s\"", what, dtr_context_create_error());
    if (code == DTR_OK) CHECK_MSG(ctx != NULL && ctx != (dtr_context *)&ctx, "%s: no context", what);
    else CHECK_MSG(ctx == NULL, "%s: *out was not set to NULL", what);
    if (r == DTR_OK && ctx != (dtr_context *)&ctx) dtr_context_destroy(ctx);
}

static void test_context_invalid_config(void) {
    dtr_context_config c = dtr_context_config_init();
    dtr_backend bad;
    c.threads = -1;
    expect_create(&c, DTR_INVALID_ARGUMENT, "threads -1", "threads -1 outside 0..1024");
    c.threads = 100000;
    expect_create(&c, DTR_INVALID_ARGUMENT, "threads 100000", "threads 100000 outside");
    c = dtr_context_config_init();
    c.matmul_precision = (dtr_matmul_precision)4;
    expect_create(&c, DTR_INVALID_ARGUMENT, "matmul_precision 4", "matmul_precision 4 is not");
    c = dtr_context_config_init();
    c.alloc.malloc_fn = plain_malloc;
    expect_create(&c, DTR_INVALID_ARGUMENT, "malloc_fn only", "callbacks need malloc_fn, realloc_fn and free_fn");
    c.alloc.free_fn = plain_free;
    expect_create(&c, DTR_INVALID_ARGUMENT, "malloc_fn and free_fn without realloc_fn", "together");
    c.alloc.malloc_fn = NULL;
    c.alloc.realloc_fn = plain_realloc;
    expect_create(&c, DTR_INVALID_ARGUMENT, "no malloc_fn", "together");
    c = dtr_context_config_init();
    bad = dtr__cpu_backend;
    bad.abi_version = DTR_VERSION_NUMBER + 1;
    c.backend = &bad;
    expect_create(&c, DTR_VERSION_MISMATCH, "backend of another version", "backend 'cpu' was built against another");
    bad = dtr__cpu_backend;
    bad.struct_size = sizeof(dtr_backend) - sizeof(void *);   /* a vtable of another layout */
    c.backend = &bad;
    expect_create(&c, DTR_VERSION_MISMATCH, "backend vtable of another size", "vtable of");
    CHECK_EQ_INT(dtr_context_create(NULL, NULL), DTR_NULL_HANDLE);
    /* all three callbacks: fine */
    c = dtr_context_config_init();
    c.alloc.malloc_fn = plain_malloc;
    c.alloc.realloc_fn = plain_realloc;
    c.alloc.free_fn = plain_free;
    c.threads = 1;
    expect_create(&c, DTR_OK, "all three callbacks", "");
}

/* ---- logging ---- */

typedef struct log_rec {
    int calls, errors, others;
    char last[512];
} log_rec;

static void log_fn(void *user, dtr_log_level level, const char *msg) {
    log_rec *r = (log_rec *)user;
    r->calls++;
    if (level == DTR_LOG_ERROR) r->errors++; else r->others++;
    snprintf(r->last, sizeof r->last, "%s", msg);
}

/* Runs a batch of failing calls on a context without a log callback. */
static void failing_calls(dtr_context *ctx) {
    dtr_model *m = NULL;
    dtr_optimizer *opt = NULL;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, -1.0f);
    int64_t s = 4;
    char path[128];
    dtr_add(ctx, t2(ctx, 3, 4), t2(ctx, 2, 4));
    dtr_context_clear_error(ctx);
    dtr_matmul(ctx, NULL, NULL);
    dtr_context_clear_error(ctx);
    dtr_backward(ctx, t2(ctx, 2, 2));
    dtr_context_clear_error(ctx);
    snprintf(path, sizeof path, "%s/does/not/exist.safetensors", g_tmpdir);
    if (dtr_model_create(ctx, 1, &m) == DTR_OK) {
        dtr_model_param(m, "w", 1, &s, DTR_INIT_ZEROS, 0.0f);
        dtr_model_param(m, "w", 1, &s, DTR_INIT_ZEROS, 0.0f);
        dtr_context_clear_error(ctx);
        dtr_model_load(m, path);
        dtr_context_clear_error(ctx);
        dtr_model_save(m, path, DTR_F32);
        dtr_context_clear_error(ctx);
        dtr_optimizer_create(m, &oc, &opt);
        dtr_context_clear_error(ctx);
        dtr_model_destroy(m);
    }
    dtr_context_reset(ctx);
}

static void test_log_callback(void) {
    dtr_context_config c = dtr_context_config_init();
    dtr_context *ctx = NULL;
    log_rec rec;
    memset(&rec, 0, sizeof rec);
    c.threads = 1;
    c.log = log_fn;
    c.log_user = &rec;
    CHECK_OK(ctx, dtr_context_create(&c, &ctx));
    if (!ctx) return;
    /* successful work logs nothing at the default level (WARN) */
    CHECK(dtr_relu(ctx, dtr_add(ctx, t2(ctx, 3, 4), t2(ctx, 1, 4))) != NULL);
    CHECK_EQ_INT(rec.calls, 0);
    /* an error is logged once, at DTR_LOG_ERROR, with the context's message */
    CHECK(dtr_add(ctx, t2(ctx, 3, 4), t2(ctx, 2, 4)) == NULL);
    CHECK_EQ_INT(rec.errors, 1);
    CHECK_EQ_INT(rec.others, 0);
    CHECK(strstr(rec.last, "dtr_add") != NULL);
    CHECK(!strcmp(rec.last, dtr_context_last_error(ctx)));
    /* a later error while the first is sticky is not a new error */
    CHECK(dtr_matmul(ctx, t2(ctx, 3, 4), t2(ctx, 3, 4)) == NULL);
    CHECK_EQ_INT(rec.errors, 1);
    dtr_context_clear_error(ctx);
    CHECK(dtr_matmul(ctx, t2(ctx, 3, 4), t2(ctx, 3, 4)) == NULL);
    CHECK_EQ_INT(rec.errors, 2);
    CHECK(strstr(rec.last, "dtr_matmul") != NULL);
    dtr_context_clear_error(ctx);
    dtr_context_destroy(ctx);

    /* without a callback the library prints nothing, neither on stdout nor on stderr */
    {
        FILE *tmp = tmpfile();
        int saved_out = dup(1), saved_err = dup(2);
        long size = -1;
        CHECK(tmp != NULL && saved_out >= 0 && saved_err >= 0);
        if (!tmp || saved_out < 0 || saved_err < 0) return;
        ctx = test_ctx(1);
        fflush(stdout);
        fflush(stderr);
        dup2(fileno(tmp), 1);
        dup2(fileno(tmp), 2);
        failing_calls(ctx);
        fflush(stdout);
        fflush(stderr);
        dup2(saved_out, 1);
        dup2(saved_err, 2);
        close(saved_out);
        close(saved_err);
        fseek(tmp, 0, SEEK_END);
        size = ftell(tmp);
        CHECK_MSG(size == 0, "the library printed %ld bytes with no log callback", size);
        fclose(tmp);
        dtr_context_destroy(ctx);
    }
    /* ... and the same calls with a callback reach it */
    memset(&rec, 0, sizeof rec);
    c.log_level = DTR_LOG_ERROR;
    CHECK_OK(ctx, dtr_context_create(&c, &ctx));
    if (ctx) {
        failing_calls(ctx);
        CHECK_MSG(rec.errors >= 7, "%d errors logged", rec.errors);
        dtr_context_destroy(ctx);
    }
}

static void test_result_strings_and_version(void) {
    static const dtr_result codes[] = {DTR_OK, DTR_INVALID_ARGUMENT, DTR_NULL_HANDLE, DTR_SHAPE_MISMATCH,
                                       DTR_DTYPE_MISMATCH, DTR_OUT_OF_MEMORY, DTR_ARENA_FULL, DTR_BAD_STATE,
                                       DTR_UNSUPPORTED, DTR_NOT_FOUND, DTR_VERSION_MISMATCH, DTR_IO_ERROR,
                                       DTR_CORRUPT_FILE, DTR_TIMEOUT, DTR_PEER_FAILED};
    int n = (int)(sizeof codes / sizeof codes[0]), i, j;
    const char *unknown = dtr_result_string((dtr_result)-55);
    char vs[32];
    CHECK(unknown != NULL && *unknown);
    for (i = 0; i < n; i++) {
        const char *s = dtr_result_string(codes[i]);
        CHECK_MSG(s != NULL && *s, "code %d has no string", (int)codes[i]);
        if (!s) continue;
        CHECK_MSG(strcmp(s, unknown) != 0, "code %d reads like an unknown code: '%s'", (int)codes[i], s);
        for (j = 0; j < i; j++)
            CHECK_MSG(strcmp(s, dtr_result_string(codes[j])) != 0, "codes %d and %d share '%s'", (int)codes[i],
                      (int)codes[j], s);
    }
    CHECK(!strcmp(dtr_result_string(DTR_OK), "ok"));
    CHECK(!strcmp(dtr_result_string(DTR_SHAPE_MISMATCH), "shape mismatch"));
    CHECK(!strcmp(dtr_result_string((dtr_result)12345), unknown));
    /* ranges: general -1..-99, files -100..-199, communication -200..-299 */
    CHECK(DTR_IO_ERROR <= -100 && DTR_IO_ERROR > -200 && DTR_CORRUPT_FILE <= -100 && DTR_CORRUPT_FILE > -200);
    CHECK(DTR_TIMEOUT <= -200 && DTR_PEER_FAILED <= -200 && DTR_VERSION_MISMATCH > -100);
    CHECK_EQ_INT(dtr_version(), DTR_VERSION_NUMBER);
    CHECK_EQ_INT(DTR_VERSION_NUMBER, DTR_VERSION_MAJOR * 10000 + DTR_VERSION_MINOR * 100 + DTR_VERSION_PATCH);
    snprintf(vs, sizeof vs, "%d.%d.%d", DTR_VERSION_MAJOR, DTR_VERSION_MINOR, DTR_VERSION_PATCH);
    CHECK(!strcmp(dtr_version_string(), vs));
    CHECK(!strcmp(DTR_VERSION_STRING, vs));
    CHECK_EQ_INT(dtr_dtype_size(DTR_F32), 4);
    CHECK_EQ_INT(dtr_dtype_size(DTR_BF16), 2);
    CHECK_EQ_INT(dtr_dtype_size(DTR_F16), 2);
    CHECK_EQ_INT(dtr_dtype_size(DTR_I32), 4);
    CHECK_EQ_INT(dtr_dtype_size(DTR_U8), 1);
    CHECK_EQ_INT(dtr_dtype_size((dtr_dtype)99), 0);
    CHECK(!strcmp(dtr_dtype_name(DTR_BF16), "bf16") && !strcmp(dtr_dtype_name(DTR_F32), "f32"));
}

/* ======================================================================== allocation counting */

static dtr_context *counted_ctx(count_alloc *cnt, int threads, uint64_t seed) {
    dtr_context_config c = dtr_context_config_init();
    dtr_context *ctx = NULL;
    c.threads = threads;
    c.seed = seed;
    c.alloc = count_alloc_callbacks(cnt);
    if (dtr_context_create(&c, &ctx) != DTR_OK) { fprintf(stderr, "cannot create context\n"); exit(2); }
    return ctx;
}

/* A fixed synthetic data set: nb batches of (B, D) inputs in [-1, 1) and labels in [0, K). */
typedef struct dataset { int nb; int64_t B, D, K; float *x; int32_t *y; } dataset;

static void data_make(dataset *d, int nb, int64_t B, int64_t D, int64_t K, uint64_t seed) {
    dtr_rng rng;
    int64_t i;
    d->nb = nb; d->B = B; d->D = D; d->K = K;
    d->x = (float *)malloc((size_t)(nb * B * D) * sizeof(float));
    d->y = (int32_t *)malloc((size_t)(nb * B) * sizeof(int32_t));
    dtr_rng_seed(&rng, seed, 3);
    for (i = 0; i < nb * B * D; i++) d->x[i] = 2.0f * dtr_rng_uniform(&rng) - 1.0f;
    for (i = 0; i < nb * B; i++) d->y[i] = (int32_t)(dtr_rng_u32(&rng) % (uint32_t)K);
}

static void data_free(dataset *d) { free(d->x); free(d->y); }

/* ---- the MLP (D -> 256 -> 128 -> 10) and the CNN (1x28x28 -> conv 8 -> pool -> 10) ---- */

typedef struct net {
    int cnn;
    float dropout;
    dtr_linear_layer l1, l2, l3;
    dtr_conv2d_layer conv;
} net;

static dtr_result net_init(net *n, dtr_model *m, int cnn, int64_t D, float dropout) {
    dtr_result r;
    memset(n, 0, sizeof *n);
    n->cnn = cnn;
    n->dropout = dropout;
    if (cnn) {
        r = dtr_conv2d_layer_init(&n->conv, m, "conv", 1, 8, 3, 1, 1, DTR_INIT_KAIMING_UNIFORM);
        if (r == DTR_OK) r = dtr_linear_layer_init(&n->l3, m, "fc", 8 * 14 * 14, 10, 1, DTR_INIT_TORCH_DEFAULT);
        return r;
    }
    r = dtr_linear_layer_init(&n->l1, m, "fc1", D, 256, 1, DTR_INIT_KAIMING_UNIFORM);
    if (r == DTR_OK) r = dtr_linear_layer_init(&n->l2, m, "fc2", 256, 128, 1, DTR_INIT_KAIMING_UNIFORM);
    if (r == DTR_OK) r = dtr_linear_layer_init(&n->l3, m, "fc3", 128, 10, 1, DTR_INIT_TORCH_DEFAULT);
    return r;
}

static dtr_tensor *net_input(dtr_context *ctx, const net *n, const dataset *d, int b) {
    int64_t s2[2], s4[4];
    if (n->cnn) {
        s4[0] = d->B; s4[1] = 1; s4[2] = 28; s4[3] = 28;
        return dtr_tensor_from(ctx, DTR_F32, 4, s4, d->x + (size_t)(b * d->B * d->D));
    }
    s2[0] = d->B; s2[1] = d->D;
    return dtr_tensor_from(ctx, DTR_F32, 2, s2, d->x + (size_t)(b * d->B * d->D));
}

static dtr_tensor *net_labels(dtr_context *ctx, const dataset *d, int b) {
    int64_t s = d->B;
    return dtr_tensor_from(ctx, DTR_I32, 1, &s, d->y + (size_t)(b * d->B));
}

static dtr_tensor *net_logits(dtr_context *ctx, const net *n, dtr_tensor *x) {
    dtr_tensor *h;
    if (n->cnn) {
        int64_t s[2];
        h = dtr_maxpool2d(ctx, dtr_relu(ctx, dtr_conv2d_layer_forward(ctx, &n->conv, x)), 2, 0, 0);
        s[0] = dtr_tensor_dim(x, 0); s[1] = 8 * 14 * 14;
        h = dtr_reshape(ctx, h, 2, s);
        if (n->dropout > 0.0f) h = dtr_dropout(ctx, h, n->dropout);
        return dtr_linear_layer_forward(ctx, &n->l3, h);
    }
    h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->l1, x));
    if (n->dropout > 0.0f) h = dtr_dropout(ctx, h, n->dropout);
    h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->l2, h));
    return dtr_linear_layer_forward(ctx, &n->l3, h);
}

/* One training step; returns the loss (NaN on error). */
static float net_step(dtr_context *ctx, const net *n, dtr_optimizer *opt, const dataset *d, int b) {
    dtr_tensor *loss = dtr_cross_entropy(ctx, net_logits(ctx, n, net_input(ctx, n, d, b)), net_labels(ctx, d, b));
    float v = loss ? dtr_tensor_get(loss, 0) : NAN;
    if (dtr_backward(ctx, loss) != DTR_OK) v = NAN;
    if (dtr_optimizer_step(opt, NULL) != DTR_OK) v = NAN;
    dtr_context_reset(ctx);
    return v;
}

enum { PH_INPUT, PH_FORWARD, PH_LOSS, PH_BACKWARD, PH_STEP, PH_RESET, PH_COUNT };
static const char *const ph_names[PH_COUNT] = {"dtr_tensor_from (inputs)", "forward", "dtr_cross_entropy",
                                               "dtr_backward", "dtr_optimizer_step", "dtr_context_reset"};

/* Trains `warm` steps, then `steps` more counting allocation-callback calls per phase.
 * obs 1: with a dtr_metrics (timeline off), 2: with its timeline on too; each step ends
 * with dtr_metrics_step_end (counted in the reset phase). */
static void count_steady_state(const char *name, int cnn, dtr_optimizer_kind kind, int threads, int warm, int steps,
                               int obs) {
    count_alloc cnt = {0, 0, 0, 0, 0, 0};
    dtr_context *ctx = counted_ctx(&cnt, threads, 11);
    dtr_model *m = NULL;
    dtr_optimizer *opt = NULL;
    dtr_metrics *mx = NULL;
    dtr_metrics_config mc = dtr_metrics_config_init();
    char trace[256];
    dtr_optimizer_config oc = dtr_optimizer_config_init(kind, kind == DTR_OPT_SGD ? 0.05f : 1e-3f);
    dataset d;
    net n;
    long ph[PH_COUNT] = {0}, before, m0, r0, f0;
    int s, p, ran = 0, failed_before = test__case_failed;
    float first = 0.0f, last = 0.0f;
    oc.momentum = kind == DTR_OPT_SGD ? 0.9f : 0.0f;
    data_make(&d, 4, cnn ? 16 : 64, cnn ? 28 * 28 : 784, 10, 5);
    CHECK_OK(ctx, dtr_model_create(ctx, 3, &m));
    CHECK_OK(ctx, net_init(&n, m, cnn, d.D, cnn ? 0.0f : 0.1f));
    CHECK_OK(ctx, dtr_optimizer_create(m, &oc, &opt));
    if (!opt) goto done;
    mc.trace_path = obs == 2 ? tmp_path("dtr_core", "steady.trace.json", trace, sizeof trace) : NULL;
    mc.trace_events = 64;     /* the ring wraps during the counted steps */
    mc.grad_norm = 1;
    if (obs) CHECK_OK(ctx, dtr_metrics_create(ctx, &mc, &mx));
    for (s = 0; s < warm; s++) {
        float l = net_step(ctx, &n, opt, &d, s % d.nb);
        if (s == 0) first = l;
    }
    m0 = cnt.mallocs; r0 = cnt.reallocs; f0 = cnt.frees;
    for (s = 0; s < steps; s++) {
        dtr_tensor *x, *y, *logits, *loss;
        int b = s % d.nb;
        before = count_alloc_total(&cnt);
        x = net_input(ctx, &n, &d, b);
        y = net_labels(ctx, &d, b);
        ph[PH_INPUT] += count_alloc_total(&cnt) - before;
        before = count_alloc_total(&cnt);
        logits = net_logits(ctx, &n, x);
        ph[PH_FORWARD] += count_alloc_total(&cnt) - before;
        before = count_alloc_total(&cnt);
        loss = dtr_cross_entropy(ctx, logits, y);
        ph[PH_LOSS] += count_alloc_total(&cnt) - before;
        if (s == steps - 1 && loss) last = dtr_tensor_get(loss, 0);
        before = count_alloc_total(&cnt);
        CHECK_OK(ctx, dtr_backward(ctx, loss));
        ph[PH_BACKWARD] += count_alloc_total(&cnt) - before;
        before = count_alloc_total(&cnt);
        CHECK_OK(ctx, dtr_optimizer_step(opt, NULL));
        ph[PH_STEP] += count_alloc_total(&cnt) - before;
        before = count_alloc_total(&cnt);
        CHECK_OK(ctx, dtr_context_reset(ctx));
        if (mx) CHECK_OK(ctx, dtr_metrics_step_end(mx, NULL, NULL));
        ph[PH_RESET] += count_alloc_total(&cnt) - before;
        ran++;
        if (test__case_failed && !failed_before) break;
    }
    CHECK_MSG(cnt.mallocs == m0 && cnt.reallocs == r0 && cnt.frees == f0,
              "%s: %ld malloc, %ld realloc, %ld free calls in %d steady-state steps", name, cnt.mallocs - m0,
              cnt.reallocs - r0, cnt.frees - f0, ran);
    for (p = 0; p < PH_COUNT; p++)
        CHECK_MSG(ph[p] == 0, "%s: %ld allocation-callback calls in %s", name, ph[p], ph_names[p]);
    /* it did train */
    CHECK_MSG(isfinite(first) && isfinite(last) && last < first, "%s: loss %g -> %g", name, first, last);
    CHECK(cnt.mallocs > 0); /* the callbacks are really used */
    if (obs == 2) CHECK_MSG(dtr_metrics_trace_dropped(mx) > 0, "%s: the ring did not wrap", name);
done:
    dtr_metrics_destroy(mx);
    if (obs == 2) remove(trace);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    CHECK_MSG(cnt.live == 0, "%s: %ld blocks still live after destroy (%ld malloc, %ld realloc, %ld free calls)", name,
              cnt.live, cnt.mallocs, cnt.reallocs, cnt.frees);
    data_free(&d);
}

static void test_no_allocation_in_steady_state(void) {
    int steps = g_quick ? 20 : 100;
    count_steady_state("MLP 784-256-128-10 + dropout, SGD momentum, 2 threads", 0, DTR_OPT_SGD, 2, 3, steps, 0);
    count_steady_state("MLP, SGD momentum, 1 thread", 0, DTR_OPT_SGD, 1, 3, g_quick ? 5 : 20, 0);
    count_steady_state("CNN conv+maxpool+linear, Adam, 2 threads", 1, DTR_OPT_ADAM, 2, 3, steps, 0);
    count_steady_state("MLP, metrics on, timeline off", 0, DTR_OPT_SGD, 2, 3, g_quick ? 5 : 20, 1);
    count_steady_state("MLP, metrics and timeline on", 0, DTR_OPT_SGD, 2, 3, g_quick ? 5 : 20, 2);
}

/* ======================================================================== arena limit */

static void test_arena_limit(void) {
    dtr_context_config c = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_tensor *a, *b, *s;
    int64_t big[2] = {600, 600}, small[2] = {300, 300}; /* 1.44 MB and 360 kB */
    size_t reserved = 0;
    c.threads = 1;
    c.arena_max_bytes = 1u << 20;
    CHECK_OK(ctx, dtr_context_create(&c, &ctx));
    if (!ctx) return;
    /* one tensor larger than the limit */
    EXPECT_NULL(ctx, dtr_tensor_new(ctx, DTR_F32, 2, big), DTR_ARENA_FULL, "dtr_tensor_new");
    /* an op whose output passes the limit names itself */
    a = tensor_of(ctx, 2, small, 0.0f, 1e-3f);
    b = tensor_of(ctx, 2, small, 1.0f, 0.0f);
    CHECK(a && b);
    EXPECT_NULL(ctx, dtr_add(ctx, a, b), DTR_ARENA_FULL, "dtr_add");
    dtr_context_arena_usage(ctx, &reserved, NULL);
    CHECK_MSG(reserved <= (1u << 20) + (2u << 20) /* the metadata arena is separate */, "reserved %zu", reserved);
    /* sticky until cleared: further ops return NULL */
    CHECK(dtr_tensor_1d(ctx, 4) != NULL); /* cleared above by EXPECT_NULL */
    CHECK(dtr_add(ctx, a, b) == NULL);
    CHECK(dtr_scale(ctx, a, 2.0f) == NULL); /* no room, but the first error is still the one kept */
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_ARENA_FULL);
    CHECK(strstr(dtr_context_last_error(ctx), "dtr_add") != NULL);
    CHECK(strstr(dtr_context_last_error(ctx), "arena_max_bytes") != NULL);
    /* usable again after reset + clear_error */
    CHECK_OK(ctx, dtr_context_reset(ctx));
    dtr_context_clear_error(ctx);
    a = tensor_of(ctx, 2, small, 0.0f, 1e-3f);
    b = tensor_of(ctx, 2, small, 1.0f, 0.0f);
    s = dtr_sum_all(ctx, dtr_slice(ctx, a, 0, 0, 1));
    CHECK_OK(ctx, dtr_context_status(ctx));
    CHECK(s != NULL);
    if (s) CHECK_NEAR(dtr_tensor_get(s, 0), 1e-3 * 299.0 * 300.0 / 2.0, 1e-3);
    CHECK_OK(ctx, dtr_context_reset(ctx));
    /* and several steps in a row stay within the limit */
    {
        int i;
        for (i = 0; i < 5; i++) {
            a = tensor_of(ctx, 2, small, 0.0f, 1.0f);
            CHECK(dtr_relu(ctx, a) != NULL);
            CHECK_OK(ctx, dtr_context_status(ctx));
            CHECK_OK(ctx, dtr_context_reset(ctx));
        }
    }
    dtr_context_destroy(ctx);
}

/* ======================================================================== op errors */

static void test_shape_and_dtype_errors(void) {
    dtr_context *ctx = test_ctx(1);
    int64_t s4[4], s1[1], s2[2];
    int32_t ids[4] = {0, 1, 2, 3};
    dtr_tensor *x, *w, *tgt, *xs[2], *it;
    static const int perm_dup[3] = {0, 0, 1}, perm_range[3] = {0, 1, 3};

    EXPECT_NULL(ctx, dtr_add(ctx, t2(ctx, 3, 4), t2(ctx, 2, 4)), DTR_SHAPE_MISMATCH, "dtr_add");
    EXPECT_NULL(ctx, dtr_sub(ctx, t2(ctx, 3, 4), t2(ctx, 3, 5)), DTR_SHAPE_MISMATCH, "dtr_sub");
    EXPECT_NULL(ctx, dtr_mul(ctx, t2(ctx, 2, 3), t2(ctx, 3, 2)), DTR_SHAPE_MISMATCH, "dtr_mul");
    EXPECT_NULL(ctx, dtr_div(ctx, t2(ctx, 4, 1), t2(ctx, 3, 2)), DTR_SHAPE_MISMATCH, "dtr_div");
    CHECK(dtr_add(ctx, t2(ctx, 3, 1), t2(ctx, 1, 4)) != NULL); /* broadcasts */
    /* dtype: an i32 tensor into an f32 op */
    s1[0] = 4;
    it = dtr_tensor_from(ctx, DTR_I32, 1, s1, ids);
    EXPECT_NULL(ctx, dtr_add(ctx, it, it), DTR_DTYPE_MISMATCH, "dtr_add");
    EXPECT_NULL(ctx, dtr_relu(ctx, it), DTR_DTYPE_MISMATCH, "dtr_relu");
    /* matmul and linear */
    EXPECT_NULL(ctx, dtr_matmul(ctx, t2(ctx, 3, 4), t2(ctx, 5, 6)), DTR_SHAPE_MISMATCH, "dtr_matmul");
    EXPECT_NULL(ctx, dtr_linear(ctx, t2(ctx, 2, 5), t2(ctx, 3, 4), NULL), DTR_SHAPE_MISMATCH, "dtr_linear");
    s1[0] = 4;
    EXPECT_NULL(ctx, dtr_linear(ctx, t2(ctx, 2, 4), t2(ctx, 3, 4), tensor_of(ctx, 1, s1, 0, 1)), DTR_SHAPE_MISMATCH,
                "dtr_linear");
    /* conv2d channels, kernel larger than the input; pooling of a 2-D tensor */
    s4[0] = 1; s4[1] = 3; s4[2] = 8; s4[3] = 8;
    x = tensor_of(ctx, 4, s4, 0, 0.01f);
    s4[0] = 4; s4[1] = 2; s4[2] = 3; s4[3] = 3;
    w = tensor_of(ctx, 4, s4, 0, 0.01f);
    EXPECT_NULL(ctx, dtr_conv2d(ctx, x, w, NULL, 1, 0), DTR_SHAPE_MISMATCH, "dtr_conv2d");
    s4[1] = 3; s4[2] = 9; s4[3] = 9;
    w = tensor_of(ctx, 4, s4, 0, 0.01f);
    EXPECT_NULL(ctx, dtr_conv2d(ctx, x, w, NULL, 1, 0), DTR_SHAPE_MISMATCH, "dtr_conv2d");
    EXPECT_NULL(ctx, dtr_conv2d(ctx, x, w, NULL, 0, 1), DTR_INVALID_ARGUMENT, "dtr_conv2d");
    EXPECT_NULL(ctx, dtr_maxpool2d(ctx, t2(ctx, 8, 8), 2, 0, 0), DTR_SHAPE_MISMATCH, "dtr_maxpool2d");
    EXPECT_NULL(ctx, dtr_avgpool2d(ctx, x, 0, 0, 0), DTR_INVALID_ARGUMENT, "dtr_avgpool2d");
    /* cross-entropy: f32 targets, out-of-range and negative classes, row count */
    s1[0] = 4;
    EXPECT_NULL(ctx, dtr_cross_entropy(ctx, t2(ctx, 4, 10), tensor_of(ctx, 1, s1, 0, 1)), DTR_DTYPE_MISMATCH,
                "dtr_cross_entropy");
    ids[2] = 10;
    tgt = dtr_tensor_from(ctx, DTR_I32, 1, s1, ids);
    EXPECT_NULL(ctx, dtr_cross_entropy(ctx, t2(ctx, 4, 10), tgt), DTR_INVALID_ARGUMENT, "dtr_cross_entropy");
    ids[2] = -1;
    tgt = dtr_tensor_from(ctx, DTR_I32, 1, s1, ids);
    EXPECT_NULL(ctx, dtr_cross_entropy(ctx, t2(ctx, 4, 10), tgt), DTR_INVALID_ARGUMENT, "dtr_cross_entropy");
    ids[2] = 9;
    tgt = dtr_tensor_from(ctx, DTR_I32, 1, s1, ids);
    EXPECT_NULL(ctx, dtr_cross_entropy(ctx, t2(ctx, 5, 10), tgt), DTR_SHAPE_MISMATCH, "dtr_cross_entropy");
    CHECK(dtr_cross_entropy(ctx, t2(ctx, 4, 10), tgt) != NULL);
    EXPECT_NULL(ctx, dtr_mse(ctx, t2(ctx, 4, 10), t2(ctx, 4, 9)), DTR_SHAPE_MISMATCH, "dtr_mse");
    /* embedding ids */
    ids[2] = 7;
    tgt = dtr_tensor_from(ctx, DTR_I32, 1, s1, ids);
    EXPECT_NULL(ctx, dtr_embedding(ctx, t2(ctx, 7, 3), tgt), DTR_INVALID_ARGUMENT, "dtr_embedding");
    ids[2] = -3;
    tgt = dtr_tensor_from(ctx, DTR_I32, 1, s1, ids);
    EXPECT_NULL(ctx, dtr_embedding(ctx, t2(ctx, 7, 3), tgt), DTR_INVALID_ARGUMENT, "dtr_embedding");
    EXPECT_NULL(ctx, dtr_embedding(ctx, t2(ctx, 7, 3), tensor_of(ctx, 1, s1, 0, 1)), DTR_DTYPE_MISMATCH, "dtr_embedding");
    /* layernorm weight size */
    s1[0] = 5;
    EXPECT_NULL(ctx, dtr_layernorm(ctx, t2(ctx, 3, 4), tensor_of(ctx, 1, s1, 1, 0), NULL, 1e-5f), DTR_SHAPE_MISMATCH,
                "dtr_layernorm");
    s1[0] = 4;
    EXPECT_NULL(ctx, dtr_layernorm(ctx, t2(ctx, 3, 4), NULL, tensor_of(ctx, 1, s1, 1, 0), 0.0f), DTR_INVALID_ARGUMENT,
                "dtr_layernorm");
    /* views */
    s2[0] = 5; s2[1] = 3;
    EXPECT_NULL(ctx, dtr_reshape(ctx, t2(ctx, 3, 4), 2, s2), DTR_SHAPE_MISMATCH, "dtr_reshape");
    s2[0] = -1; s2[1] = -1;
    EXPECT_NULL(ctx, dtr_reshape(ctx, t2(ctx, 3, 4), 2, s2), DTR_INVALID_ARGUMENT, "dtr_reshape");
    s2[0] = -1; s2[1] = 5;
    EXPECT_NULL(ctx, dtr_reshape(ctx, t2(ctx, 3, 4), 2, s2), DTR_SHAPE_MISMATCH, "dtr_reshape");
    s4[0] = 2; s4[1] = 3; s4[2] = 4;
    x = tensor_of(ctx, 3, s4, 0, 1);
    EXPECT_NULL(ctx, dtr_permute(ctx, x, perm_dup), DTR_INVALID_ARGUMENT, "dtr_permute");
    EXPECT_NULL(ctx, dtr_permute(ctx, x, perm_range), DTR_INVALID_ARGUMENT, "dtr_permute");
    EXPECT_NULL(ctx, dtr_transpose(ctx, x, 0, 3), DTR_INVALID_ARGUMENT, "dtr_transpose");
    EXPECT_NULL(ctx, dtr_slice(ctx, x, 1, 1, 4), DTR_INVALID_ARGUMENT, "dtr_slice");
    EXPECT_NULL(ctx, dtr_slice(ctx, x, 1, 2, 1), DTR_INVALID_ARGUMENT, "dtr_slice");
    EXPECT_NULL(ctx, dtr_slice(ctx, x, 3, 0, 1), DTR_INVALID_ARGUMENT, "dtr_slice");
    CHECK(dtr_slice(ctx, x, -1, -3, -1) != NULL); /* negative indices count from the end */
    xs[0] = t2(ctx, 3, 4);
    xs[1] = t2(ctx, 2, 5);
    EXPECT_NULL(ctx, dtr_concat(ctx, xs, 2, 0), DTR_SHAPE_MISMATCH, "dtr_concat");
    xs[1] = x;
    EXPECT_NULL(ctx, dtr_concat(ctx, xs, 2, 0), DTR_SHAPE_MISMATCH, "dtr_concat");
    EXPECT_NULL(ctx, dtr_concat(ctx, xs, 0, 0), DTR_INVALID_ARGUMENT, "dtr_concat");
    /* attention: ranks, k and v differing, causal across lengths and q_start, no keys, heads, scale, no config */
    {
        int64_t sq[3] = {2, 5, 6}, sk[3] = {2, 7, 6};
        dtr_tensor *q = tensor_of(ctx, 3, sq, 0, 0.1f), *k = tensor_of(ctx, 3, sk, 0, 0.1f);
        dtr_attention_config cc = dtr_attention_config_init(2, 1), nc = dtr_attention_config_init(2, 0);
        EXPECT_NULL(ctx, dtr_attention(ctx, t2(ctx, 5, 6), q, q, 2), DTR_SHAPE_MISMATCH, "dtr_attention");
        EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, k, q, &nc), DTR_SHAPE_MISMATCH, "dtr_attention");   /* v of Tq rows */
        CHECK(dtr_attention_ex(ctx, q, k, k, &cc) != NULL);   /* causal, Tq < Tk: PyTorch's is_causal (from key 0) */
        cc.q_start = 2;
        CHECK(dtr_attention_ex(ctx, q, k, k, &cc) != NULL);   /* queries at keys 2 .. 6 */
        cc.q_start = 3;
        EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, k, k, &cc), DTR_SHAPE_MISMATCH, "Tq <= Tk - q_start (causal), q_start 3");
        cc.q_start = -1;
        EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, k, k, &cc), DTR_INVALID_ARGUMENT, "q_start -1 must be >= 0");
        cc.q_start = 0;
        EXPECT_NULL(ctx, dtr_attention_ex(ctx, k, q, q, &cc), DTR_SHAPE_MISMATCH, "dtr_attention");   /* causal, Tq > Tk */
        nc.q_start = 1;
        EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, k, k, &nc), DTR_INVALID_ARGUMENT, "0 unless causal");
        nc.q_start = 0;
        CHECK(dtr_attention_ex(ctx, q, k, k, &nc) != NULL);
        sk[1] = 0;
        k = tensor_of(ctx, 3, sk, 0, 0.1f);
        EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, k, k, &nc), DTR_SHAPE_MISMATCH, "dtr_attention");   /* no keys */
        sk[1] = 7; sk[2] = 4;
        k = tensor_of(ctx, 3, sk, 0, 0.1f);
        EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, k, k, &nc), DTR_SHAPE_MISMATCH, "dtr_attention");   /* C differs */
        EXPECT_NULL(ctx, dtr_attention(ctx, q, q, q, 4), DTR_INVALID_ARGUMENT, "dtr_attention");
        EXPECT_NULL(ctx, dtr_attention(ctx, q, q, q, 0), DTR_INVALID_ARGUMENT, "dtr_attention");
        nc.scale = NAN;
        EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, q, q, &nc), DTR_INVALID_ARGUMENT, "dtr_attention");
        EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, q, q, NULL), DTR_NULL_HANDLE, "dtr_attention_ex");
        {   /* key lengths: f32, not (B), then values outside [1, Tk] (found when the op runs) */
            int32_t lens[3] = {5, 0, 1};
            int64_t two = 2, three = 3;
            nc = dtr_attention_config_init(2, 0);
            nc.key_lengths = tensor_of(ctx, 1, &two, 1, 0);
            EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, q, q, &nc), DTR_DTYPE_MISMATCH, "key_lengths");
            nc.key_lengths = dtr_tensor_from(ctx, DTR_I32, 1, &three, lens);
            EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, q, q, &nc), DTR_SHAPE_MISMATCH, "key_lengths");
            nc.key_lengths = dtr_tensor_from(ctx, DTR_I32, 1, &two, lens + 1);
            EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, q, q, &nc), DTR_INVALID_ARGUMENT, "key_lengths[0] is 0, outside [1, 5]");
            lens[1] = 6;
            nc.key_lengths = dtr_tensor_from(ctx, DTR_I32, 1, &two, lens);
            EXPECT_NULL(ctx, dtr_attention_ex(ctx, q, q, q, &nc), DTR_INVALID_ARGUMENT, "key_lengths[1] is 6");
            lens[1] = 5;
            nc.key_lengths = dtr_tensor_from(ctx, DTR_I32, 1, &two, lens);
            CHECK(dtr_attention_ex(ctx, q, q, q, &nc) != NULL);
        }
    }
    /* others */
    EXPECT_NULL(ctx, dtr_softmax_causal(ctx, t2(ctx, 3, 4)), DTR_SHAPE_MISMATCH, "dtr_softmax_causal");
    EXPECT_NULL(ctx, dtr_sum(ctx, t2(ctx, 3, 4), 2, 0), DTR_INVALID_ARGUMENT, "dtr_sum");
    EXPECT_NULL(ctx, dtr_dropout(ctx, t2(ctx, 3, 4), 1.0f), DTR_INVALID_ARGUMENT, "dtr_dropout");
    s2[0] = 3; s2[1] = -2;
    EXPECT_NULL(ctx, dtr_tensor_new(ctx, DTR_F32, 2, s2), DTR_INVALID_ARGUMENT, "dtr_tensor_new");
    EXPECT_NULL(ctx, dtr_tensor_new(ctx, (dtr_dtype)42, 1, s1), DTR_DTYPE_MISMATCH, "dtr_tensor_new");
    EXPECT_NULL(ctx, dtr_tensor_new(ctx, DTR_F32, DTR_MAX_DIMS + 1, s4), DTR_INVALID_ARGUMENT, "dtr_tensor_new");
    EXPECT_NULL(ctx, dtr_tensor_requires_grad(it), DTR_DTYPE_MISMATCH, "dtr_tensor_requires_grad");
    /* a tensor of another context */
    {
        dtr_context *other = test_ctx(1);
        dtr_tensor *o = t2(other, 3, 4);
        EXPECT_NULL(ctx, dtr_add(ctx, t2(ctx, 3, 4), o), DTR_INVALID_ARGUMENT, "dtr_add");
        dtr_context_destroy(other);
    }
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_OK);
    dtr_context_destroy(ctx);
}

/* NULL inputs are DTR_NULL_HANDLE naming the op; NULL then flows through a chain of ops and
 * the first error is the one kept. */
static void test_null_and_sticky(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_tensor *a = t2(ctx, 3, 4), *w = t2(ctx, 5, 4), *h, *xs[2];
    int64_t s2[2] = {4, 3}, s1 = 3;
    static const int perm[2] = {1, 0};
    char first[512];

    EXPECT_NULL(ctx, dtr_add(ctx, NULL, a), DTR_NULL_HANDLE, "dtr_add");
    EXPECT_NULL(ctx, dtr_matmul(ctx, a, NULL), DTR_NULL_HANDLE, "dtr_matmul");
    EXPECT_NULL(ctx, dtr_linear(ctx, NULL, w, NULL), DTR_NULL_HANDLE, "dtr_linear");
    EXPECT_NULL(ctx, dtr_relu(ctx, NULL), DTR_NULL_HANDLE, "dtr_relu");
    EXPECT_NULL(ctx, dtr_softmax(ctx, NULL), DTR_NULL_HANDLE, "dtr_softmax");
    EXPECT_NULL(ctx, dtr_cross_entropy(ctx, NULL, NULL), DTR_NULL_HANDLE, "dtr_cross_entropy");
    EXPECT_NULL(ctx, dtr_cross_entropy(ctx, a, NULL), DTR_NULL_HANDLE, "dtr_cross_entropy");
    EXPECT_NULL(ctx, dtr_layernorm(ctx, NULL, NULL, NULL, 1e-5f), DTR_NULL_HANDLE, "dtr_layernorm");
    EXPECT_NULL(ctx, dtr_conv2d(ctx, NULL, NULL, NULL, 1, 0), DTR_NULL_HANDLE, "dtr_conv2d");
    EXPECT_NULL(ctx, dtr_reshape(ctx, NULL, 2, s2), DTR_NULL_HANDLE, "dtr_reshape");
    EXPECT_NULL(ctx, dtr_permute(ctx, NULL, perm), DTR_NULL_HANDLE, "dtr_permute");
    EXPECT_NULL(ctx, dtr_slice(ctx, NULL, 0, 0, 1), DTR_NULL_HANDLE, "dtr_slice");
    EXPECT_NULL(ctx, dtr_embedding(ctx, a, NULL), DTR_NULL_HANDLE, "dtr_embedding");
    EXPECT_NULL(ctx, dtr_sum_all(ctx, NULL), DTR_NULL_HANDLE, "dtr_sum_all");
    EXPECT_NULL(ctx, dtr_cast(ctx, NULL, DTR_BF16), DTR_NULL_HANDLE, "dtr_cast");
    EXPECT_NULL(ctx, dtr_tensor_from(ctx, DTR_F32, 2, s2, NULL), DTR_NULL_HANDLE, "dtr_tensor_from");
    xs[0] = a; xs[1] = NULL;
    EXPECT_NULL(ctx, dtr_concat(ctx, xs, 2, 0), DTR_NULL_HANDLE, "dtr_concat");
    EXPECT_NULL(ctx, dtr_linear_layer_forward(ctx, NULL, a), DTR_NULL_HANDLE, "dtr_linear_layer_forward");
    /* a NULL context: NULL back, nothing to record */
    CHECK(dtr_add(NULL, a, a) == NULL);
    CHECK(dtr_tensor_2d(NULL, 2, 2) == NULL);
    CHECK_EQ_INT(dtr_backward(NULL, a), DTR_NULL_HANDLE);

    /* a chain: the first error (a shape mismatch) is kept through every later op */
    h = dtr_matmul(ctx, a, a); /* (3, 4) x (3, 4): the first error */
    CHECK(h == NULL);
    snprintf(first, sizeof first, "%s", dtr_context_last_error(ctx));
    CHECK(strstr(first, "dtr_matmul") != NULL);
    h = dtr_relu(ctx, h);
    h = dtr_linear(ctx, h, w, NULL);
    h = dtr_add(ctx, h, t2(ctx, 9, 9));
    h = dtr_reshape(ctx, h, 2, s2);
    h = dtr_permute(ctx, h, perm);
    h = dtr_slice(ctx, h, 0, 0, 1);
    h = dtr_softmax(ctx, h);
    h = dtr_layernorm(ctx, h, NULL, NULL, 1e-5f);
    h = dtr_cast(ctx, h, DTR_BF16);
    h = dtr_contiguous(ctx, h);
    h = dtr_cross_entropy(ctx, h, NULL);
    CHECK(h == NULL);
    /* later, independent errors do not replace it either */
    CHECK(dtr_add(ctx, t2(ctx, 3, 4), t2(ctx, 2, 2)) == NULL);
    CHECK(dtr_tensor_new(ctx, DTR_F32, -1, &s1) == NULL);
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_SHAPE_MISMATCH);
    CHECK(!strcmp(dtr_context_last_error(ctx), first));
    /* even valid ops return NULL while an error is pending; backward returns it */
    CHECK(dtr_add(ctx, a, a) == NULL);
    CHECK_EQ_INT(dtr_backward(ctx, h), DTR_SHAPE_MISMATCH);
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_SHAPE_MISMATCH);
    CHECK(!strcmp(dtr_context_last_error(ctx), first));
    dtr_context_clear_error(ctx);
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_OK);
    CHECK(!strcmp(dtr_context_last_error(ctx), ""));
    CHECK(dtr_add(ctx, a, a) != NULL);
    dtr_context_destroy(ctx);
}

static void test_backward_errors(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_tensor *a = dtr_tensor_requires_grad(t2(ctx, 3, 4)), *y, *l;
    /* a non-scalar loss */
    y = dtr_mul(ctx, a, a);
    EXPECT_ERR(ctx, dtr_backward(ctx, y), DTR_SHAPE_MISMATCH, "dtr_backward");
    EXPECT_ERR(ctx, dtr_backward(ctx, NULL), DTR_NULL_HANDLE, "dtr_backward");
    /* a loss recorded with grad disabled */
    dtr_context_set_grad_enabled(ctx, 0);
    l = dtr_sum_all(ctx, dtr_mul(ctx, a, a));
    CHECK(l != NULL);
    EXPECT_ERR(ctx, dtr_backward(ctx, l), DTR_BAD_STATE, "dtr_backward");
    dtr_context_set_grad_enabled(ctx, 1);
    /* a loss that depends on nothing that wants a gradient */
    l = dtr_sum_all(ctx, t2(ctx, 2, 2));
    EXPECT_ERR(ctx, dtr_backward(ctx, l), DTR_BAD_STATE, "dtr_backward");
    /* and the good path still works: d sum(a*a) / da = 2a */
    l = dtr_sum_all(ctx, dtr_mul(ctx, a, a));
    CHECK_OK(ctx, dtr_backward(ctx, l));
    CHECK(dtr_tensor_grad(a) != NULL);
    if (dtr_tensor_grad(a)) CHECK(dtr_tensor_grad(a)[5] == 2.0f * dtr_tensor_get(a, 5));
    dtr_context_destroy(ctx);
}

/* ======================================================================== dtypes */

static double f16_val(uint16_t h) { return (double)dtr_f16_to_f32(h); }

static void test_bf16_bits(void) {
    static const struct { uint32_t in; uint16_t out; } cases[] = {
        {0x3f800000u, 0x3f80}, /* 1.0 */
        {0xc0200000u, 0xc020}, /* -2.5 */
        {0x477fe000u, 0x4780}, /* 65504 rounds up to 65536 in bf16 */
        {0x00000000u, 0x0000}, {0x80000000u, 0x8000},
        {0x7f800000u, 0x7f80}, {0xff800000u, 0xff80}, /* +-inf */
        {0x3f808000u, 0x3f80}, /* 1 + 2^-8: a tie, to even (down) */
        {0x3f818000u, 0x3f82}, /* 1 + 3*2^-8: a tie, to even (up) */
        {0x3f808001u, 0x3f81}, /* just above the tie */
        {0x3f807fffu, 0x3f80}, /* just below */
        {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds to inf */
        {0x00000001u, 0x0000}, /* denormal f32 */
        {0x00800000u, 0x0080}, /* FLT_MIN */
    };
    int i;
    uint32_t h;
    for (i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        uint16_t got = dtr_f32_to_bf16(bitsf(cases[i].in));
        CHECK_MSG(got == cases[i].out, "bf16(0x%08x) = 0x%04x, want 0x%04x", cases[i].in, got, cases[i].out);
    }
    CHECK(dtr_bf16_to_f32(0x3f80) == 1.0f && dtr_bf16_to_f32(0xc020) == -2.5f);
    /* NaN stays NaN (a signalling NaN whose payload sits in the low bits must not become inf) */
    CHECK(isnan(dtr_bf16_to_f32(dtr_f32_to_bf16(NAN))));
    CHECK(isnan(dtr_bf16_to_f32(dtr_f32_to_bf16(bitsf(0x7f800001u)))));
    CHECK(isnan(dtr_bf16_to_f32(dtr_f32_to_bf16(bitsf(0xffc00001u)))));
    CHECK(isnan(dtr_bf16_to_f32(dtr_f32_to_bf16(bitsf(0x7fffffffu)))));
    /* every bf16 value survives a round trip through f32 */
    for (h = 0; h < 65536u; h++) {
        float f = dtr_bf16_to_f32((uint16_t)h);
        if (isnan(f)) continue;
        if (dtr_f32_to_bf16(f) != h) { CHECK_MSG(0, "bf16 0x%04x does not round-trip", h); break; }
    }
}

static void test_f16_bits(void) {
    static const struct { float in; uint16_t out; const char *what; } cases[] = {
        {1.0f, 0x3c00, "1"}, {-2.5f, 0xc100, "-2.5"}, {0.0f, 0x0000, "0"}, {-0.0f, 0x8000, "-0"},
        {65504.0f, 0x7bff, "65504 (max)"}, {65519.99f, 0x7bff, "just below 65520"},
        {65520.0f, 0x7c00, "65520 -> inf (tie to even)"}, {-65520.0f, 0xfc00, "-65520 -> -inf"},
        {1e6f, 0x7c00, "1e6 -> inf"}, {INFINITY, 0x7c00, "inf"}, {-INFINITY, 0xfc00, "-inf"},
        {1e-8f, 0x0000, "1e-8 -> 0"}, {-1e-8f, 0x8000, "-1e-8 -> -0"},
        {5.9604644775390625e-08f, 0x0001, "2^-24 (smallest subnormal)"},
        {2.98023223876953125e-08f, 0x0000, "2^-25: a tie, to even (0)"},
        {2.9802326e-08f, 0x0001, "just above 2^-25"},
        {8.94069671630859375e-08f, 0x0002, "3 * 2^-25: a tie, to even (2)"},
        {6.103515625e-05f, 0x0400, "2^-14 (smallest normal)"},
        {6.097555160522461e-05f, 0x03ff, "largest subnormal"},
        {3.0517578125e-05f, 0x0200, "2^-15"},
        {1.00048828125f, 0x3c00, "1 + 2^-11: a tie, to even (down)"},
        {1.00146484375f, 0x3c02, "1 + 3 * 2^-11: a tie, to even (up)"},
        {0.333333333f, 0x3555, "1/3"},
        {2049.0f, 0x6800, "2049: tie -> 2048"}, {2051.0f, 0x6802, "2051: tie -> 2052"},
    };
    int i;
    uint32_t h;
    for (i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        uint16_t got = dtr_f32_to_f16(cases[i].in);
        CHECK_MSG(got == cases[i].out, "f16(%s) = 0x%04x, want 0x%04x", cases[i].what, got, cases[i].out);
    }
    CHECK(dtr_f16_to_f32(0x0001) == 5.9604644775390625e-08f);
    CHECK(dtr_f16_to_f32(0x7bff) == 65504.0f);
    CHECK(dtr_f16_to_f32(0x3555) == 0.333251953125f);
    CHECK(dtr_f16_to_f32(0x8001) == -5.9604644775390625e-08f);
    CHECK(isinf(dtr_f16_to_f32(0x7c00)) && dtr_f16_to_f32(0xfc00) < 0.0f);
    CHECK(isnan(dtr_f16_to_f32(0x7e00)) && isnan(dtr_f16_to_f32(0x7c01)));
    CHECK(isnan(dtr_f16_to_f32(dtr_f32_to_f16(NAN))));
    CHECK(isnan(dtr_f16_to_f32(dtr_f32_to_f16(bitsf(0x7f800001u))))); /* payload only in low bits */
    CHECK(isnan(dtr_f16_to_f32(dtr_f32_to_f16(bitsf(0xff800001u)))));
    CHECK((dtr_f32_to_f16(bitsf(0xff800001u)) & 0x8000) != 0);
    /* every f16 value survives a round trip */
    for (h = 0; h < 65536u; h++) {
        float f = dtr_f16_to_f32((uint16_t)h);
        if (isnan(f)) continue;
        if (dtr_f32_to_f16(f) != h) { CHECK_MSG(0, "f16 0x%04x does not round-trip", h); break; }
    }
    /* round to nearest even on random finite inputs across the f16 range: no neighbour is
     * closer, and ties go to the even code */
    {
        dtr_rng rng;
        int k, bad = 0;
        dtr_rng_seed(&rng, 99, 1);
        for (k = 0; k < 200000 && !bad; k++) {
            float x = bitsf((dtr_rng_u32(&rng) % (0x477fe000u - 0x33000000u)) + 0x33000000u); /* 2^-25 .. 65504 */
            uint16_t r = dtr_f32_to_f16(x);
            double e = fabs(f16_val(r) - x), lo = r > 0 ? fabs(f16_val((uint16_t)(r - 1)) - x) : 1e30,
                   hi = r < 0x7bff ? fabs(f16_val((uint16_t)(r + 1)) - x) : 1e30;
            if (e > lo || e > hi || ((e == lo || e == hi) && (r & 1))) {
                bad = 1;
                CHECK_MSG(0, "f16(%.9g) = 0x%04x is not the nearest even", x, r);
            }
        }
    }
}

static void test_convert_and_tensor_io(void) {
    dtr_context *ctx = test_ctx(1);
    float src[6] = {1.0f, -2.5f, 65504.0f, 1e-8f, 0.1f, 300.7f}, back[6];
    uint16_t h[6];
    int32_t iv[6];
    uint8_t u8[6];
    int64_t s2[2] = {2, 3};
    dtr_tensor *t;
    int i;
    /* arrays convert like the scalar functions */
    CHECK_OK(ctx, dtr_convert(h, DTR_BF16, src, DTR_F32, 6));
    for (i = 0; i < 6; i++) CHECK(h[i] == dtr_f32_to_bf16(src[i]));
    CHECK_OK(ctx, dtr_convert(back, DTR_F32, h, DTR_BF16, 6));
    for (i = 0; i < 6; i++) CHECK(back[i] == dtr_bf16_to_f32(h[i]));
    CHECK(back[0] == 1.0f && back[1] == -2.5f && back[2] == 65536.0f);
    CHECK_OK(ctx, dtr_convert(h, DTR_F16, src, DTR_F32, 6));
    for (i = 0; i < 6; i++) CHECK(h[i] == dtr_f32_to_f16(src[i]));
    CHECK(h[0] == 0x3c00 && h[1] == 0xc100 && h[2] == 0x7bff && h[3] == 0x0000);
    CHECK_OK(ctx, dtr_convert(back, DTR_F32, h, DTR_F16, 6));
    CHECK(back[2] == 65504.0f && back[3] == 0.0f && fabsf(back[4] - 0.1f) < 1e-4f);
    /* bf16 -> f16 goes through f32 */
    {
        uint16_t b = dtr_f32_to_bf16(-2.5f), f;
        CHECK_OK(ctx, dtr_convert(&f, DTR_F16, &b, DTR_BF16, 1));
        CHECK(f == 0xc100);
    }
    /* integers: f32 -> i32 truncates toward zero; u8 saturates */
    CHECK_OK(ctx, dtr_convert(iv, DTR_I32, src, DTR_F32, 6));
    CHECK(iv[0] == 1 && iv[1] == -2 && iv[2] == 65504 && iv[5] == 300);
    CHECK_OK(ctx, dtr_convert(u8, DTR_U8, src, DTR_F32, 6));
    CHECK(u8[0] == 1 && u8[1] == 0 && u8[5] == 255);
    CHECK_OK(ctx, dtr_convert(back, DTR_F32, u8, DTR_U8, 6));
    CHECK(back[5] == 255.0f);
    CHECK_EQ_INT(dtr_convert(back, (dtr_dtype)9, src, DTR_F32, 6), DTR_DTYPE_MISMATCH);
    CHECK_EQ_INT(dtr_convert(back, DTR_F32, src, (dtr_dtype)9, 6), DTR_DTYPE_MISMATCH);
    CHECK_OK(ctx, dtr_convert(NULL, DTR_F32, NULL, DTR_F32, 0));

    /* tensors: write f32 into a bf16 / f16 tensor and read back with conversion */
    t = dtr_tensor_new(ctx, DTR_BF16, 2, s2);
    CHECK_OK(ctx, dtr_tensor_write(t, DTR_F32, src, 6));
    CHECK_OK(ctx, dtr_tensor_read(t, DTR_F32, back, 6));
    for (i = 0; i < 6; i++) CHECK(back[i] == dtr_bf16_to_f32(dtr_f32_to_bf16(src[i])));
    CHECK_OK(ctx, dtr_tensor_read(t, DTR_BF16, h, 6));
    CHECK(h[1] == 0xc020);
    CHECK(dtr_tensor_get(t, 1) == -2.5f);
    t = dtr_tensor_new(ctx, DTR_F16, 2, s2);
    CHECK_OK(ctx, dtr_tensor_write(t, DTR_F32, src, 6));
    CHECK_OK(ctx, dtr_tensor_read(t, DTR_F16, h, 6));
    CHECK(h[0] == 0x3c00 && h[2] == 0x7bff);
    /* an f32 tensor read as f16 and as i32 */
    t = dtr_tensor_from(ctx, DTR_F32, 2, s2, src);
    CHECK_OK(ctx, dtr_tensor_read(t, DTR_F16, h, 6));
    CHECK(h[1] == 0xc100);
    CHECK_OK(ctx, dtr_tensor_read(t, DTR_I32, iv, 6));
    CHECK(iv[2] == 65504);
    /* element counts must match */
    EXPECT_ERR(ctx, dtr_tensor_read(t, DTR_F32, back, 5), DTR_SHAPE_MISMATCH, "dtr_tensor_read");
    EXPECT_ERR(ctx, dtr_tensor_write(t, DTR_F32, src, 7), DTR_SHAPE_MISMATCH, "dtr_tensor_write");
    CHECK_EQ_INT(dtr_tensor_read(NULL, DTR_F32, back, 6), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_tensor_write(t, DTR_F32, NULL, 6), DTR_NULL_HANDLE);
    /* dtr_cast */
    {
        dtr_tensor *c = dtr_cast(ctx, t, DTR_F16);
        CHECK(c && dtr_tensor_dtype(c) == DTR_F16);
        if (c) CHECK(dtr_tensor_get(c, 2) == 65504.0f);
    }
    dtr_context_destroy(ctx);
}

/* ======================================================================== views */

static void test_views(void) {
    dtr_context *ctx = test_ctx(1);
    int64_t s3[3] = {2, 3, 4}, s2[2] = {3, 4};
    static const int perm[3] = {2, 0, 1};
    float buf[24], got[24];
    dtr_tensor *x = tensor_of(ctx, 3, s3, 0, 1), *p, *tr, *sl, *c, *m;
    int i, j, k;
    p = dtr_permute(ctx, x, perm); /* (4, 2, 3): p[k][i][j] = x[i][j][k] */
    CHECK(p && dtr_tensor_dim(p, 0) == 4 && dtr_tensor_dim(p, 1) == 2 && dtr_tensor_dim(p, 2) == 3);
    CHECK(!dtr_tensor_is_contiguous(p));
    CHECK(dtr_tensor_stride(p, 0) == 1 && dtr_tensor_stride(p, 1) == 12 && dtr_tensor_stride(p, 2) == 4);
    /* reading a view gives the logical order */
    CHECK_OK(ctx, dtr_tensor_read(p, DTR_F32, got, 24));
    for (k = 0; k < 4; k++)
        for (i = 0; i < 2; i++)
            for (j = 0; j < 3; j++) CHECK(got[(k * 2 + i) * 3 + j] == (float)(i * 12 + j * 4 + k));
    CHECK(dtr_tensor_get(p, 1) == 4.0f); /* p[0][0][1] = x[0][1][0] */
    /* the view shares storage: writes through the base show in the view */
    for (i = 0; i < 24; i++) buf[i] = 100.0f + (float)i;
    CHECK_OK(ctx, dtr_tensor_write(x, DTR_F32, buf, 24));
    CHECK(dtr_tensor_get(p, 1) == 104.0f);
    ((float *)dtr_tensor_data(x))[5] = -7.0f; /* x[0][1][1] = p[1][0][1] */
    CHECK(dtr_tensor_get(p, 1 * 6 + 0 * 3 + 1) == -7.0f);
    CHECK(dtr_tensor_data(p) == dtr_tensor_data(x)); /* same first element */
    /* transposes */
    m = tensor_of(ctx, 2, s2, 0, 1);
    tr = dtr_transpose(ctx, m, 0, 1);
    CHECK(!dtr_tensor_is_contiguous(tr));
    CHECK_OK(ctx, dtr_tensor_read(tr, DTR_F32, got, 12));
    CHECK(got[0] == 0.0f && got[1] == 4.0f && got[2] == 8.0f && got[3] == 1.0f && got[11] == 11.0f);
    CHECK(dtr_tensor_is_contiguous(dtr_transpose(ctx, dtr_transpose(ctx, m, 0, 1), 0, 1)));
    CHECK(dtr_tensor_is_contiguous(dtr_transpose(ctx, dtr_reshape(ctx, m, 2, (int64_t[2]){1, 12}), 0, 1))); /* (12, 1) */
    /* slices: rows stay contiguous, columns do not */
    sl = dtr_slice(ctx, m, 0, 1, 3);
    CHECK(sl && dtr_tensor_is_contiguous(sl) && dtr_tensor_get(sl, 0) == 4.0f);
    CHECK(dtr_tensor_data(sl) == (float *)dtr_tensor_data(m) + 4);
    sl = dtr_slice(ctx, m, 1, 1, 3); /* (3, 2) */
    CHECK(sl && !dtr_tensor_is_contiguous(sl));
    CHECK_OK(ctx, dtr_tensor_read(sl, DTR_F32, got, 6));
    CHECK(got[0] == 1.0f && got[1] == 2.0f && got[2] == 5.0f && got[3] == 6.0f && got[4] == 9.0f && got[5] == 10.0f);
    CHECK(dtr_tensor_is_contiguous(dtr_slice(ctx, m, 1, 0, 4)));
    CHECK(dtr_tensor_is_contiguous(dtr_slice(ctx, m, 1, 2, 3)) == 0);
    /* writing through a slice's data shows in the base */
    ((float *)dtr_tensor_data(sl))[1] = 55.0f; /* m[0][2] */
    CHECK(dtr_tensor_get(m, 2) == 55.0f);
    /* contiguous copies: logical order, no longer shared */
    c = dtr_contiguous(ctx, sl);
    CHECK(c && c != sl && dtr_tensor_is_contiguous(c));
    CHECK_OK(ctx, dtr_tensor_read(c, DTR_F32, got, 6));
    CHECK(got[1] == 55.0f && got[2] == 5.0f);
    ((float *)dtr_tensor_data(m))[1] = 77.0f;
    CHECK(dtr_tensor_get(c, 0) == 1.0f && dtr_tensor_get(sl, 0) == 77.0f);
    CHECK(dtr_contiguous(ctx, m) == m);
    /* reshape of a non-contiguous view copies, in logical order */
    {
        int64_t flat = 6;
        dtr_tensor *r = dtr_reshape(ctx, sl, 1, &flat);
        CHECK(r && dtr_tensor_is_contiguous(r));
        if (r) CHECK(dtr_tensor_get(r, 0) == 77.0f && dtr_tensor_get(r, 1) == 55.0f && dtr_tensor_get(r, 5) == 10.0f);
    }
    /* writes into a non-contiguous view are refused, not done in the wrong order */
    CHECK(dtr_tensor_write(sl, DTR_F32, buf, 6) != DTR_OK);
    CHECK(strstr(dtr_context_last_error(ctx), "dtr_tensor_write") != NULL);
    dtr_context_clear_error(ctx);
    CHECK(dtr_tensor_get(m, 1) == 77.0f);
    dtr_context_destroy(ctx);
}

/* ======================================================================== models */

static void test_model_params(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    int64_t s2[2] = {3, 4}, s1 = 5, bad = -1;
    dtr_tensor *w;
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    w = dtr_model_param(m, "layer.weight", 2, s2, DTR_INIT_XAVIER_UNIFORM, 0.0f);
    CHECK(w != NULL && !strcmp(dtr_tensor_name(w), "layer.weight"));
    EXPECT_NULL(ctx, dtr_model_param(m, "layer.weight", 1, &s1, DTR_INIT_ZEROS, 0.0f), DTR_INVALID_ARGUMENT,
                "layer.weight");
    EXPECT_NULL(ctx, dtr_model_param(m, "", 1, &s1, DTR_INIT_ZEROS, 0.0f), DTR_INVALID_ARGUMENT, "dtr_model_param");
    EXPECT_NULL(ctx, dtr_model_param(m, NULL, 1, &s1, DTR_INIT_ZEROS, 0.0f), DTR_INVALID_ARGUMENT, "dtr_model_param");
    EXPECT_NULL(ctx, dtr_model_param(m, "neg", 1, &bad, DTR_INIT_ZEROS, 0.0f), DTR_INVALID_ARGUMENT, "neg");
    EXPECT_NULL(ctx, dtr_model_param(m, "init", 1, &s1, (dtr_init)77, 0.0f), DTR_INVALID_ARGUMENT, "init");
    CHECK(dtr_model_param(m, "layer.bias", 1, &s1, DTR_INIT_ONES, 0.0f) != NULL);
    CHECK_EQ_INT(dtr_model_param_count(m), 2);
    CHECK(dtr_model_params(m) == NULL); /* not built yet */
    CHECK_OK(ctx, dtr_model_build(m));
    CHECK_OK(ctx, dtr_model_build(m)); /* twice is harmless */
    EXPECT_NULL(ctx, dtr_model_param(m, "late", 1, &s1, DTR_INIT_ZEROS, 0.0f), DTR_BAD_STATE, "late");
    CHECK_EQ_INT(dtr_model_param_count(m), 2);
    CHECK(dtr_model_find(m, "layer.bias") == dtr_model_param_at(m, 1));
    CHECK(dtr_model_find(m, "nope") == NULL && dtr_model_param_at(m, 2) == NULL && dtr_model_param_at(m, -1) == NULL);
    CHECK_EQ_INT(dtr_model_param_offset(m, 0), 0);
    CHECK_EQ_INT(dtr_model_param_offset(m, 1), 16); /* 12 floats padded to 16 */
    CHECK_EQ_INT(dtr_model_numel(m), 32);
    CHECK(dtr_model_params(m)[16] == 1.0f && dtr_model_params(m)[20] == 1.0f && dtr_model_params(m)[21] == 0.0f);
    CHECK(dtr_tensor_data(dtr_model_param_at(m, 1)) == dtr_model_params(m) + 16);
    CHECK(dtr_model_context(m) == ctx);
    CHECK_EQ_INT(dtr_model_build(NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_model_zero_grad(NULL), DTR_NULL_HANDLE);
    CHECK(dtr_model_param(NULL, "x", 1, &s1, DTR_INIT_ZEROS, 0.0f) == NULL);
    CHECK(dtr_model_params(NULL) == NULL && dtr_model_grads(NULL) == NULL && dtr_model_numel(NULL) == 0);
    CHECK_EQ_INT(dtr_model_param_offset(NULL, 0), -1);
    dtr_model_destroy(m);
    dtr_model_destroy(NULL);
    CHECK_EQ_INT(dtr_model_create(ctx, 1, NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_model_create(NULL, 1, &m), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_OK);
    dtr_context_destroy(ctx);
}

/* Reading or writing a parameter before dtr_model_build builds the model, as the ops do
 * (it used to return DTR_NULL_HANDLE with no message). */
static void test_param_io_before_build(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *m = NULL;
    int64_t s1 = 4;
    float v[4] = {1.5f, -2.0f, 3.25f, 0.0f}, got[4] = {0};
    dtr_tensor *w, *b;
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    w = dtr_model_param(m, "w", 1, &s1, DTR_INIT_NORMAL, 1.0f);
    b = dtr_model_param(m, "b", 1, &s1, DTR_INIT_ONES, 0.0f);
    CHECK(dtr_model_params(m) == NULL);
    CHECK_OK(ctx, dtr_tensor_write(w, DTR_F32, v, 4));
    CHECK(dtr_model_params(m) != NULL);
    CHECK_OK(ctx, dtr_tensor_read(w, DTR_F32, got, 4));
    CHECK(!memcmp(got, v, sizeof v));
    CHECK_OK(ctx, dtr_tensor_read(b, DTR_F32, got, 4));
    CHECK(got[0] == 1.0f && got[3] == 1.0f); /* the other parameters got their initialisers */
    EXPECT_NULL(ctx, dtr_model_param(m, "late", 1, &s1, DTR_INIT_ZEROS, 0.0f), DTR_BAD_STATE, "late");
    dtr_model_destroy(m);
    /* reading first works the same way */
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    b = dtr_model_param(m, "b", 1, &s1, DTR_INIT_ONES, 0.0f);
    CHECK_OK(ctx, dtr_tensor_read(b, DTR_F32, got, 4));
    CHECK(got[2] == 1.0f);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
}

/* Builds a model with two parameters "a" and "b" of the same shape and initialiser. */
static dtr_model *init_model(dtr_context *ctx, uint64_t seed, dtr_init init, float arg, int ndim, const int64_t *shape) {
    dtr_model *m = NULL;
    if (dtr_model_create(ctx, seed, &m) != DTR_OK) return NULL;
    if (!dtr_model_param(m, "a", ndim, shape, init, arg) || !dtr_model_param(m, "b", ndim, shape, init, arg) ||
        dtr_model_build(m) != DTR_OK) {
        dtr_model_destroy(m);
        return NULL;
    }
    return m;
}

static void test_init_determinism(void) {
    dtr_context *ctx = test_ctx(1);
    int64_t s[2] = {64, 32};
    dtr_model *a = init_model(ctx, 42, DTR_INIT_KAIMING_NORMAL, 0.0f, 2, s);
    dtr_model *b = init_model(ctx, 42, DTR_INIT_KAIMING_NORMAL, 0.0f, 2, s);
    dtr_model *c = init_model(ctx, 43, DTR_INIT_KAIMING_NORMAL, 0.0f, 2, s);
    size_t bytes = (size_t)(64 * 32) * sizeof(float);
    CHECK(a && b && c);
    if (a && b && c) {
        float *pa = dtr_model_params(a), *pb = dtr_model_params(b), *pc = dtr_model_params(c);
        int64_t off = dtr_model_param_offset(a, 1);
        CHECK(!memcmp(pa, pb, (size_t)dtr_model_numel(a) * sizeof(float)));
        CHECK(memcmp(pa, pc, bytes) != 0 && memcmp(pa + off, pc + off, bytes) != 0);
        CHECK(memcmp(pa, pa + off, bytes) != 0); /* parameters draw from different streams */
    }
    dtr_model_destroy(a);
    dtr_model_destroy(b);
    dtr_model_destroy(c);
    dtr_context_destroy(ctx);
}

static void check_init_stats(dtr_context *ctx, const char *name, dtr_init init, float arg, int ndim, const int64_t *shape,
                             double want_std, double bound) {
    dtr_model *m = init_model(ctx, 7, init, arg, ndim, shape);
    int64_t n = 1, i;
    double s = 0, s2 = 0, mx = 0, mean, sd;
    int d;
    const float *x;
    CHECK_MSG(m != NULL, "%s: model not built", name);
    if (!m) return;
    for (d = 0; d < ndim; d++) n *= shape[d];
    x = dtr_model_params(m);
    for (i = 0; i < n; i++) { s += x[i]; s2 += (double)x[i] * x[i]; mx = fmax(mx, fabs(x[i])); }
    mean = s / (double)n;
    sd = sqrt(s2 / (double)n - mean * mean);
    CHECK_MSG(fabs(mean) <= 4.0 * want_std / sqrt((double)n), "%s: mean %g (std %g, n %lld)", name, mean, want_std,
              (long long)n);
    CHECK_MSG(fabs(sd / want_std - 1.0) <= 0.05, "%s: std %g, formula %g", name, sd, want_std);
    if (bound > 0) CHECK_MSG(mx <= bound && mx >= 0.99 * bound, "%s: max |x| %g, bound %g", name, mx, bound);
    dtr_model_destroy(m);
}

static void test_init_statistics(void) {
    dtr_context *ctx = test_ctx(1);
    int64_t w[2] = {512, 512}, r[2] = {256, 1024}, cv[4] = {64, 32, 3, 3};
    double fi = 512, fo = 512;
    check_init_stats(ctx, "kaiming_uniform 512x512", DTR_INIT_KAIMING_UNIFORM, 0, 2, w, sqrt(2.0 / fi), sqrt(6.0 / fi));
    check_init_stats(ctx, "kaiming_normal 512x512", DTR_INIT_KAIMING_NORMAL, 0, 2, w, sqrt(2.0 / fi), 0);
    check_init_stats(ctx, "xavier_uniform 512x512", DTR_INIT_XAVIER_UNIFORM, 0, 2, w, sqrt(2.0 / (fi + fo)),
                     sqrt(6.0 / (fi + fo)));
    check_init_stats(ctx, "xavier_normal 512x512", DTR_INIT_XAVIER_NORMAL, 0, 2, w, sqrt(2.0 / (fi + fo)), 0);
    check_init_stats(ctx, "torch_default 512x512", DTR_INIT_TORCH_DEFAULT, 0, 2, w, 1.0 / sqrt(fi) / sqrt(3.0),
                     1.0 / sqrt(fi));
    check_init_stats(ctx, "normal(0.02)", DTR_INIT_NORMAL, 0.02f, 2, w, 0.02, 0);
    check_init_stats(ctx, "uniform(0.5)", DTR_INIT_UNIFORM, 0.5f, 2, w, 0.5 / sqrt(3.0), 0.5);
    /* fan-in is dim 1 (times the receptive field), fan-out dim 0 */
    check_init_stats(ctx, "kaiming_normal 256x1024", DTR_INIT_KAIMING_NORMAL, 0, 2, r, sqrt(2.0 / 1024), 0);
    check_init_stats(ctx, "xavier_uniform 256x1024", DTR_INIT_XAVIER_UNIFORM, 0, 2, r, sqrt(2.0 / (1024 + 256)),
                     sqrt(6.0 / (1024 + 256)));
    check_init_stats(ctx, "kaiming_uniform conv 64x32x3x3", DTR_INIT_KAIMING_UNIFORM, 0, 4, cv, sqrt(2.0 / 288),
                     sqrt(6.0 / 288));
    check_init_stats(ctx, "xavier_normal conv 64x32x3x3", DTR_INIT_XAVIER_NORMAL, 0, 4, cv, sqrt(2.0 / (288 + 576)), 0);
    {
        dtr_model *m = init_model(ctx, 1, DTR_INIT_ONES, 0, 2, w);
        dtr_model *z = init_model(ctx, 1, DTR_INIT_ZEROS, 0, 2, w);
        CHECK(m && z);
        if (m && z) CHECK(dtr_model_params(m)[1000] == 1.0f && dtr_model_params(z)[1000] == 0.0f);
        dtr_model_destroy(m);
        dtr_model_destroy(z);
    }
    dtr_context_destroy(ctx);
}

/* ---- save / load ---- */

static dtr_model *io_model(dtr_context *ctx, uint64_t seed, int64_t hidden, int with_extra) {
    dtr_model *m = NULL;
    dtr_linear_layer l1, l2;
    int64_t s = 7;
    if (dtr_model_create(ctx, seed, &m) != DTR_OK) return NULL;
    dtr_linear_layer_init(&l1, m, "fc1", 20, hidden, 1, DTR_INIT_KAIMING_NORMAL);
    dtr_linear_layer_init(&l2, m, "fc2", hidden, 3, 1, DTR_INIT_XAVIER_UNIFORM);
    if (with_extra) dtr_model_param(m, "extra", 1, &s, DTR_INIT_NORMAL, 1.0f);
    if (dtr_context_status(ctx) != DTR_OK || dtr_model_build(m) != DTR_OK) { dtr_model_destroy(m); return NULL; }
    return m;
}

static float *snapshot(dtr_model *m) {
    size_t bytes = (size_t)dtr_model_numel(m) * sizeof(float);
    float *s = (float *)malloc(bytes);
    memcpy(s, dtr_model_params(m), bytes);
    return s;
}

static int same_params(dtr_model *m, const float *snap) {
    return !memcmp(dtr_model_params(m), snap, (size_t)dtr_model_numel(m) * sizeof(float));
}

static void test_save_load(void) {
    dtr_context *ctx = test_ctx(1);
    char p32[128], p16[128], pf16[128], ptr[128], pmiss[128], pbad[128];
    dtr_model *a = io_model(ctx, 1, 16, 0), *b = io_model(ctx, 2, 16, 0), *c = NULL;
    float *snap = NULL;
    int64_t i, n;
    snprintf(p32, sizeof p32, "%s/model_f32.safetensors", g_tmpdir);
    snprintf(p16, sizeof p16, "%s/model_bf16.safetensors", g_tmpdir);
    snprintf(pf16, sizeof pf16, "%s/model_f16.safetensors", g_tmpdir);
    snprintf(ptr, sizeof ptr, "%s/truncated.safetensors", g_tmpdir);
    snprintf(pmiss, sizeof pmiss, "%s/missing.safetensors", g_tmpdir);
    snprintf(pbad, sizeof pbad, "%s/no/such/dir/x.safetensors", g_tmpdir);
    CHECK(a && b);
    if (!a || !b) goto done;
    n = dtr_model_numel(a);
    CHECK(memcmp(dtr_model_params(a), dtr_model_params(b), (size_t)n * sizeof(float)) != 0);
    /* f32: exact */
    CHECK_OK(ctx, dtr_model_save(a, p32, DTR_F32));
    CHECK_OK(ctx, dtr_model_load(b, p32));
    CHECK(!memcmp(dtr_model_params(a), dtr_model_params(b), (size_t)n * sizeof(float)));
    /* bf16 and f16: exactly the rounded values */
    CHECK_OK(ctx, dtr_model_save(a, p16, DTR_BF16));
    c = io_model(ctx, 3, 16, 0);
    CHECK_OK(ctx, dtr_model_load(c, p16));
    if (c) {
        int bad = 0;
        for (i = 0; i < n && !bad; i++) {
            float x = dtr_model_params(a)[i], y = dtr_model_params(c)[i];
            if (y != dtr_bf16_to_f32(dtr_f32_to_bf16(x)) || fabsf(y - x) > fabsf(x) * (1.0f / 256.0f)) {
                bad = 1;
                CHECK_MSG(0, "bf16 element %lld: %.9g saved, %.9g loaded", (long long)i, x, y);
            }
        }
        CHECK_OK(ctx, dtr_model_save(a, pf16, DTR_F16));
        CHECK_OK(ctx, dtr_model_load(c, pf16));
        for (i = 0, bad = 0; i < n && !bad; i++) {
            float x = dtr_model_params(a)[i], y = dtr_model_params(c)[i];
            if (y != dtr_f16_to_f32(dtr_f32_to_f16(x))) {
                bad = 1;
                CHECK_MSG(0, "f16 element %lld: %.9g saved, %.9g loaded", (long long)i, x, y);
            }
        }
    }
    dtr_model_destroy(c);
    c = NULL;
    /* entries the model does not have are ignored: a model with "extra" saves, a plain one loads */
    c = io_model(ctx, 4, 16, 1);
    if (c) {
        char pe[128];
        snprintf(pe, sizeof pe, "%s/extra.safetensors", g_tmpdir);
        CHECK_OK(ctx, dtr_model_save(c, pe, DTR_F32));
        CHECK_OK(ctx, dtr_model_load(b, pe));
        CHECK(!memcmp(dtr_model_params(b), dtr_model_params(c), (size_t)n * sizeof(float)));
        /* the other way round: the file lacks "extra" -> DTR_NOT_FOUND naming it, model unchanged */
        snap = snapshot(c);
        EXPECT_ERR(ctx, dtr_model_load(c, p32), DTR_NOT_FOUND, "extra");
        CHECK(same_params(c, snap));
        free(snap);
        snap = NULL;
        dtr_model_destroy(c);
    }
    /* another shape: DTR_SHAPE_MISMATCH naming the tensor, values unchanged */
    c = io_model(ctx, 5, 8, 0);
    if (c) {
        snap = snapshot(c);
        CHECK(dtr_model_load(c, p32) == DTR_SHAPE_MISMATCH);
        CHECK_MSG(strstr(dtr_context_last_error(ctx), "(16, 20)") && strstr(dtr_context_last_error(ctx), "(8, 20)"),
                  "the message shows both shapes: '%s'", dtr_context_last_error(ctx));
        EXPECT_ERR(ctx, dtr_context_status(ctx), DTR_SHAPE_MISMATCH, "fc1.weight");
        CHECK(same_params(c, snap));
        free(snap);
        snap = NULL;
    }
    /* a truncated file: DTR_CORRUPT_FILE naming the file, values unchanged */
    {
        FILE *in = fopen(p32, "rb"), *out = fopen(ptr, "wb");
        long size;
        char *buf;
        CHECK(in && out);
        if (in && out) {
            fseek(in, 0, SEEK_END);
            size = ftell(in);
            fseek(in, 0, SEEK_SET);
            buf = (char *)malloc((size_t)size);
            CHECK(fread(buf, 1, (size_t)size, in) == (size_t)size);
            fwrite(buf, 1, (size_t)(size - 37), out);
            free(buf);
        }
        if (in) fclose(in);
        if (out) fclose(out);
        snap = snapshot(b);
        EXPECT_ERR(ctx, dtr_model_load(b, ptr), DTR_CORRUPT_FILE, "truncated.safetensors");
        CHECK(same_params(b, snap));
        /* a header cut short too */
        out = fopen(ptr, "wb");
        if (out) { fwrite("\x40\x00\x00\x00\x00\x00\x00\x00{\"a\":", 1, 13, out); fclose(out); }
        EXPECT_ERR(ctx, dtr_model_load(b, ptr), DTR_CORRUPT_FILE, "truncated.safetensors");
        CHECK(same_params(b, snap));
        free(snap);
        snap = NULL;
    }
    /* missing file, unwritable path, bad dtype */
    EXPECT_ERR(ctx, dtr_model_load(b, pmiss), DTR_IO_ERROR, "missing.safetensors");
    EXPECT_ERR(ctx, dtr_model_save(b, pbad, DTR_F32), DTR_IO_ERROR, "x.safetensors");
    EXPECT_ERR(ctx, dtr_model_save(b, p32, DTR_I32), DTR_DTYPE_MISMATCH, "dtr_model_save");
    CHECK_EQ_INT(dtr_model_save(NULL, p32, DTR_F32), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_model_load(b, NULL), DTR_NULL_HANDLE);
    /* the earlier good file still loads after all that */
    CHECK_OK(ctx, dtr_model_load(b, p32));
    CHECK(!memcmp(dtr_model_params(a), dtr_model_params(b), (size_t)n * sizeof(float)));
done:
    dtr_model_destroy(a);
    dtr_model_destroy(b);
    dtr_model_destroy(c);
    dtr_context_destroy(ctx);
    remove(p32); remove(p16); remove(pf16); remove(ptr);
    {
        char pe[128];
        snprintf(pe, sizeof pe, "%s/extra.safetensors", g_tmpdir);
        remove(pe);
    }
}

/* ======================================================================== determinism */

/* Trains a net for `steps` steps on a fresh context; returns a copy of the parameters. */
static float *train_copy(int cnn, int threads, uint64_t ctx_seed, float dropout, dtr_optimizer_kind kind, int steps,
                         int64_t *numel) {
    dtr_context_config c = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_model *m = NULL;
    dtr_optimizer *opt = NULL;
    dtr_optimizer_config oc = dtr_optimizer_config_init(kind, kind == DTR_OPT_SGD ? 0.05f : 1e-3f);
    dataset d;
    net n;
    float *out = NULL;
    int s;
    c.threads = threads;
    c.seed = ctx_seed;
    oc.momentum = kind == DTR_OPT_SGD ? 0.9f : 0.0f;
    if (dtr_context_create(&c, &ctx) != DTR_OK) return NULL;
    data_make(&d, 4, cnn ? 16 : 64, 784, 10, 5);
    if (dtr_model_create(ctx, 3, &m) == DTR_OK && net_init(&n, m, cnn, d.D, dropout) == DTR_OK &&
        dtr_optimizer_create(m, &oc, &opt) == DTR_OK) {
        for (s = 0; s < steps; s++)
            if (!isfinite(net_step(ctx, &n, opt, &d, s % d.nb))) break;
        CHECK_MSG(s == steps, "training stopped at step %d: %s", s, dtr_context_last_error(ctx));
        *numel = dtr_model_numel(m);
        out = (float *)malloc((size_t)*numel * sizeof(float));
        memcpy(out, dtr_model_params(m), (size_t)*numel * sizeof(float));
    }
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    dtr_context_destroy(ctx);
    data_free(&d);
    return out;
}

/* Runs one forward + backward of the MLP on 1 and on `threads` threads from the same weights
 * and names the first op whose output or gradient differs. */
static void diagnose_thread_difference(int cnn, int threads) {
    dtr_context *c1 = test_ctx(1), *c2 = test_ctx(threads);
    dtr_model *m1 = NULL, *m2 = NULL;
    net n1, n2;
    dataset d;
    dtr_tensor *x1, *x2, *h1[8], *h2[8];
    const char *names[8];
    int k = 0, i;
    data_make(&d, 1, cnn ? 16 : 64, 784, 10, 5);
    dtr_model_create(c1, 3, &m1);
    dtr_model_create(c2, 3, &m2);
    net_init(&n1, m1, cnn, d.D, 0.0f);
    net_init(&n2, m2, cnn, d.D, 0.0f);
    x1 = net_input(c1, &n1, &d, 0);
    x2 = net_input(c2, &n2, &d, 0);
    if (cnn) {
        names[k] = "conv2d"; h1[k] = dtr_conv2d_layer_forward(c1, &n1.conv, x1); h2[k] = dtr_conv2d_layer_forward(c2, &n2.conv, x2); k++;
        names[k] = "relu"; h1[k] = dtr_relu(c1, h1[k - 1]); h2[k] = dtr_relu(c2, h2[k - 1]); k++;
        names[k] = "maxpool2d"; h1[k] = dtr_maxpool2d(c1, h1[k - 1], 2, 0, 0); h2[k] = dtr_maxpool2d(c2, h2[k - 1], 2, 0, 0); k++;
        names[k] = "reshape"; h1[k] = dtr_reshape(c1, h1[k - 1], 2, (int64_t[2]){16, 8 * 14 * 14});
        h2[k] = dtr_reshape(c2, h2[k - 1], 2, (int64_t[2]){16, 8 * 14 * 14}); k++;
        names[k] = "linear fc"; h1[k] = dtr_linear_layer_forward(c1, &n1.l3, h1[k - 1]); h2[k] = dtr_linear_layer_forward(c2, &n2.l3, h2[k - 1]); k++;
    } else {
        names[k] = "linear fc1"; h1[k] = dtr_linear_layer_forward(c1, &n1.l1, x1); h2[k] = dtr_linear_layer_forward(c2, &n2.l1, x2); k++;
        names[k] = "relu"; h1[k] = dtr_relu(c1, h1[k - 1]); h2[k] = dtr_relu(c2, h2[k - 1]); k++;
        names[k] = "linear fc2"; h1[k] = dtr_linear_layer_forward(c1, &n1.l2, h1[k - 1]); h2[k] = dtr_linear_layer_forward(c2, &n2.l2, h2[k - 1]); k++;
        names[k] = "relu"; h1[k] = dtr_relu(c1, h1[k - 1]); h2[k] = dtr_relu(c2, h2[k - 1]); k++;
        names[k] = "linear fc3"; h1[k] = dtr_linear_layer_forward(c1, &n1.l3, h1[k - 1]); h2[k] = dtr_linear_layer_forward(c2, &n2.l3, h2[k - 1]); k++;
    }
    names[k] = "cross_entropy";
    h1[k] = dtr_cross_entropy(c1, h1[k - 1], net_labels(c1, &d, 0));
    h2[k] = dtr_cross_entropy(c2, h2[k - 1], net_labels(c2, &d, 0));
    k++;
    dtr_backward(c1, h1[k - 1]);
    dtr_backward(c2, h2[k - 1]);
    for (i = 0; i < k; i++) {
        int64_t ne = dtr_tensor_numel(h1[i]);
        if (!h1[i] || !h2[i]) continue;
        if (memcmp(dtr_tensor_data(h1[i]), dtr_tensor_data(h2[i]), (size_t)ne * sizeof(float)))
            fprintf(stderr, "  diagnosis: forward output of %s differs between 1 and %d threads\n", names[i], threads);
        else if (dtr_tensor_grad(h1[i]) && dtr_tensor_grad(h2[i]) &&
                 memcmp(dtr_tensor_grad(h1[i]), dtr_tensor_grad(h2[i]), (size_t)ne * sizeof(float)))
            fprintf(stderr, "  diagnosis: gradient of the output of %s differs between 1 and %d threads\n", names[i], threads);
    }
    for (i = 0; i < dtr_model_param_count(m1); i++) {
        dtr_tensor *p = dtr_model_param_at(m1, i), *q = dtr_model_param_at(m2, i);
        if (memcmp(dtr_tensor_grad(p), dtr_tensor_grad(q), (size_t)dtr_tensor_numel(p) * sizeof(float)))
            fprintf(stderr, "  diagnosis: gradient of %s differs between 1 and %d threads\n", dtr_tensor_name(p), threads);
    }
    dtr_model_destroy(m1);
    dtr_model_destroy(m2);
    dtr_context_destroy(c1);
    dtr_context_destroy(c2);
    data_free(&d);
}

static void test_determinism_repeat(void) {
    int64_t n1 = 0, n2 = 0, n3 = 0;
    int steps = g_quick ? 4 : 10;
    float *a = train_copy(0, 2, 77, 0.2f, DTR_OPT_ADAM, steps, &n1);
    float *b = train_copy(0, 2, 77, 0.2f, DTR_OPT_ADAM, steps, &n2);
    float *c = train_copy(0, 2, 78, 0.2f, DTR_OPT_ADAM, steps, &n3);
    CHECK(a && b && c && n1 == n2 && n1 == n3);
    if (a && b && c) {
        CHECK_MSG(!memcmp(a, b, (size_t)n1 * sizeof(float)), "two runs with the same seeds differ");
        /* the dropout masks come from the context seed: another seed trains differently */
        CHECK_MSG(memcmp(a, c, (size_t)n1 * sizeof(float)) != 0, "dropout ignores the context seed");
    }
    free(a); free(b); free(c);
}

static void thread_case(int cnn, int threads, int steps) {
    int64_t n1 = 0, n2 = 0, i, first = -1, count = 0;
    float *a = train_copy(cnn, 1, 5, cnn ? 0.0f : 0.1f, cnn ? DTR_OPT_ADAM : DTR_OPT_SGD, steps, &n1);
    float *b = train_copy(cnn, threads, 5, cnn ? 0.0f : 0.1f, cnn ? DTR_OPT_ADAM : DTR_OPT_SGD, steps, &n2);
    CHECK(a && b && n1 == n2);
    if (a && b && n1 == n2) {
        for (i = 0; i < n1; i++)
            if (fbits(a[i]) != fbits(b[i])) { if (first < 0) first = i; count++; }
        CHECK_MSG(count == 0, "%s: %lld of %lld weights differ between 1 and %d threads after %d steps (first at %lld)",
                  cnn ? "CNN" : "MLP", (long long)count, (long long)n1, threads, steps, (long long)first);
        if (count) diagnose_thread_difference(cnn, threads);
    }
    free(a); free(b);
}

static void test_determinism_threads(void) {
    thread_case(0, 2, g_quick ? 5 : 20);
    thread_case(0, 3, g_quick ? 3 : 10);
    thread_case(1, 2, g_quick ? 3 : 10);
}

int main(void) {
    const char *q = getenv("DTR_TEST_QUICK");
    g_quick = q && *q && strcmp(q, "0") != 0;
    if (!make_tmp_dir("dtr_test_core", g_tmpdir, sizeof g_tmpdir)) return 2;
    RUN(test_context_defaults);
    RUN(test_context_invalid_config);
    RUN(test_log_callback);
    RUN(test_result_strings_and_version);
    RUN(test_no_allocation_in_steady_state);
    RUN(test_arena_limit);
    RUN(test_shape_and_dtype_errors);
    RUN(test_null_and_sticky);
    RUN(test_backward_errors);
    RUN(test_bf16_bits);
    RUN(test_f16_bits);
    RUN(test_convert_and_tensor_io);
    RUN(test_views);
    RUN(test_model_params);
    RUN(test_param_io_before_build);
    RUN(test_init_determinism);
    RUN(test_init_statistics);
    RUN(test_save_load);
    RUN(test_determinism_repeat);
    RUN(test_determinism_threads);
    rmdir(g_tmpdir);
    return test_summary();
}
