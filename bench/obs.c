/* bench/obs.c: what observability costs per training step. An MLP trained on synthetic data
 * (no files), the same context and model in three modes, interleaved in rounds so the
 * machine's drift hits them alike:
 *   off      no dtr_metrics (each hook is one branch on a NULL pointer)
 *   metrics        a dtr_metrics (phases, FLOPs, the step record), no file, no timeline
 *   metrics_jsonl  and its JSON-lines file (one line written and flushed per step)
 *   trace          metrics and the timeline (every op's forward and backward span in the
 *                  ring), no file
 * Two models: the Fashion-MNIST MLP 784-256-128-10 at batch 64 (a realistic step) and a
 * tiny 20-32-5 MLP at batch 8, where per-op costs are the largest share.
 * Prints one JSON line per model and mode (median and mean step time) and the ratios.
 *     make bench && build/bench/obs [--rounds R] [--steps S] [--threads T] */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "../dtrain.h"

enum { MODE_OFF, MODE_METRICS, MODE_JSONL, MODE_TRACE, MODES };
static const char *const mode_names[MODES] = {"off", "metrics", "metrics_jsonl", "trace"};

typedef struct net { dtr_context *ctx; dtr_model *m; dtr_linear_layer l1, l2, l3; dtr_optimizer *opt; } net;
typedef struct shape { const char *name; int64_t in, h1, h2, out, batch; } shape;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int net_init(net *n, const shape *s, int threads) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.01f);
    memset(n, 0, sizeof *n);
    cc.threads = threads;
    oc.momentum = 0.9f;
    return dtr_context_create(&cc, &n->ctx) == DTR_OK && dtr_model_create(n->ctx, 1, &n->m) == DTR_OK &&
           dtr_linear_layer_init(&n->l1, n->m, "l1", s->in, s->h1, 1, DTR_INIT_KAIMING_UNIFORM) == DTR_OK &&
           dtr_linear_layer_init(&n->l2, n->m, "l2", s->h1, s->h2, 1, DTR_INIT_KAIMING_UNIFORM) == DTR_OK &&
           dtr_linear_layer_init(&n->l3, n->m, "l3", s->h2, s->out, 1, DTR_INIT_KAIMING_UNIFORM) == DTR_OK &&
           dtr_model_build(n->m) == DTR_OK && dtr_optimizer_create(n->m, &oc, &n->opt) == DTR_OK;
}

/* one training step; returns its seconds (negative on error) */
static double step(net *n, const shape *s, const float *x, const int32_t *y, dtr_metrics *mx) {
    int64_t xs[2] = {s->batch, s->in}, ys[1] = {s->batch};
    double t0 = now_s();
    dtr_context *ctx = n->ctx;
    dtr_tensor *h, *loss;
    h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->l1, dtr_tensor_from(ctx, DTR_F32, 2, xs, x)));
    h = dtr_relu(ctx, dtr_linear_layer_forward(ctx, &n->l2, h));
    loss = dtr_cross_entropy(ctx, dtr_linear_layer_forward(ctx, &n->l3, h), dtr_tensor_from(ctx, DTR_I32, 1, ys, y));
    if (!loss || dtr_backward(ctx, loss) != DTR_OK || dtr_optimizer_step(n->opt, NULL) != DTR_OK) return -1;
    dtr_context_reset(ctx);
    if (mx && dtr_metrics_step_end(mx, NULL, NULL) != DTR_OK) return -1;
    return now_s() - t0;
}

static int run_mode(net *n, const shape *s, const float *x, const int32_t *y, int mode, int steps, double *out,
                    const char *jsonl, const char *trace) {
    dtr_metrics_config mc = dtr_metrics_config_init();
    dtr_metrics *mx = NULL;
    int i, ok = 1;
    mc.jsonl_path = mode == MODE_JSONL ? jsonl : NULL;
    mc.trace_path = mode == MODE_TRACE ? trace : NULL;
    if (mode != MODE_OFF && dtr_metrics_create(n->ctx, &mc, &mx) != DTR_OK) return 0;
    for (i = 0; i < steps && ok; i++) ok = (out[i] = step(n, s, x, y, mx)) >= 0;
    dtr_metrics_destroy(mx);   /* writes the trace: outside the timed steps */
    return ok;
}

static int bench_shape(const shape *s, int threads, int rounds, int steps) {
    net n;
    float *x = (float *)malloc((size_t)(s->batch * s->in) * sizeof(float));
    int32_t *y = (int32_t *)malloc((size_t)s->batch * sizeof(int32_t));
    double *t[MODES], med[MODES];
    char jsonl[256], trace[256];
    int64_t i;
    int r, md, ok = x && y && net_init(&n, s, threads);
    snprintf(jsonl, sizeof jsonl, "/tmp/dtr_bench_obs_%ld.jsonl", (long)getpid());
    snprintf(trace, sizeof trace, "/tmp/dtr_bench_obs_%ld.trace.json", (long)getpid());
    for (i = 0; x && y && i < s->batch * s->in; i++) x[i] = (float)((i * 7919) % 2001) / 1000.0f - 1.0f;
    for (i = 0; x && y && i < s->batch; i++) y[i] = (int32_t)(i % s->out);
    for (md = 0; md < MODES; md++) t[md] = (double *)malloc((size_t)(rounds * steps) * sizeof(double));
    for (i = 0; ok && i < 20; i++) ok = step(&n, s, x, y, NULL) >= 0;   /* warm-up */
    for (r = 0; ok && r < rounds; r++)
        for (md = 0; ok && md < MODES; md++) ok = run_mode(&n, s, x, y, md, steps, t[md] + r * steps, jsonl, trace);
    for (md = 0; ok && md < MODES; md++) {
        double mean = 0.0;
        int k, total = rounds * steps;
        for (k = 0; k < total; k++) mean += t[md][k];
        mean /= total;
        qsort(t[md], (size_t)total, sizeof(double), cmp_double);
        med[md] = t[md][total / 2];
        printf("{\"bench\":\"obs\",\"model\":\"%s\",\"batch\":%lld,\"threads\":%d,\"mode\":\"%s\",\"steps\":%d,"
               "\"step_ms_median\":%.4f,\"step_ms_mean\":%.4f}\n", s->name, (long long)s->batch, threads,
               mode_names[md], total, 1e3 * med[md], 1e3 * mean);
    }
    for (md = 1; ok && md < MODES; md++)
        printf("{\"bench\":\"obs_overhead\",\"model\":\"%s\",\"mode\":\"%s\",\"vs\":\"off\",\"ratio\":%.4f,"
               "\"extra_us_per_step\":%.2f}\n", s->name, mode_names[md], med[md] / med[0], 1e6 * (med[md] - med[0]));
    if (!ok) fprintf(stderr, "bench/obs: %s failed: %s\n", s->name, n.ctx ? dtr_context_last_error(n.ctx) : "setup");
    fflush(stdout);
    for (md = 0; md < MODES; md++) free(t[md]);
    remove(jsonl);
    remove(trace);
    dtr_optimizer_destroy(n.opt);
    dtr_model_destroy(n.m);
    dtr_context_destroy(n.ctx);
    free(x);
    free(y);
    return ok;
}

int main(int argc, char **argv) {
    static const shape shapes[2] = {{"mlp_784_256_128_10", 784, 256, 128, 10, 64}, {"mlp_20_32_32_5", 20, 32, 32, 5, 8}};
    int rounds = 5, steps = 200, threads = 1, i, ok = 1;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else { fprintf(stderr, "usage: %s [--rounds R] [--steps S] [--threads T]\n", argv[0]); return 2; }
    }
    if (rounds < 1 || steps < 1 || threads < 0) { fprintf(stderr, "bench/obs: bad arguments\n"); return 2; }
    for (i = 0; i < 2; i++) ok &= bench_shape(&shapes[i], threads, rounds, steps);
    return ok ? 0 : 1;
}
