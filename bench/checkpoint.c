/* bench/checkpoint.c: what an asynchronous full-state checkpoint every K steps costs a
 * training loop (dtr_ckpt_save + its writer thread), against the same loop without one.
 *
 *   build/bench/checkpoint [--model mlp|gpt|all] [--every K] [--rounds R (6; even: ABBA)] [--dir DIR] [--threads T]
 *
 * Workloads (synthetic data, one process):
 *   mlp  the MLP of examples/common.h (784-256-128-10, 235k parameters), batch 64, SGD momentum
 *   gpt  a small GPT as examples/gpt.c's defaults (byte vocabulary, context 64, dim 64,
 *        4 heads, 4 blocks, 0.2M parameters), batch 8, Adam
 * Method: R rounds of 2K steps; each round times K steps without checkpointing and K steps
 * with one dtr_ckpt_save at its first step (asynchronous, BUSY_WAIT, keep 2, under --dir or
 * $TMPDIR), so both arms see the same machine load; the first round is a warm-up. The order
 * alternates (ABBA: odd rounds checkpoint first): the step time drifts over a run (the MLP's
 * grew by a few per cent from one block to the next on random data), and a fixed order
 * charged that drift to the second arm (an A/A run, no checkpoint in either arm, showed
 * 3-6% "overhead" with the fixed order). The
 * overhead is (time with - time without) / time without over all rounds, and the median of
 * the rounds' own ratios (robust to a noisy neighbour in one round). The stall is dtr_ckpt_stats
 * snapshot_s of each save (copying the state into the staging buffer), compared with the
 * median step.
 * Output: one JSON line per model on stdout:
 *   {"bench":"checkpoint","model":"mlp","every":100,"rounds":5,"state_bytes":2830000,
 *    "step_ms_none":1.7,"step_ms_ckpt":1.75,"overhead_pct":2.9,"overhead_pct_median_round":2.5,
 *    "snapshot_ms_max":0.6,
 *    "step_ms_median":1.7,"stall_steps":0.35,"write_ms":30.1,"saves":5} */
#include "../examples/common.h"
#include <time.h>
#include <unistd.h>

#define GPT_VOCAB 256
#define GPT_T 64
#define GPT_C 64
#define GPT_L 4

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct workload {
    dtr_context *ctx;
    dtr_model *m;
    dtr_optimizer *opt;
    fm_net net;                      /* mlp */
    dtr_embedding_layer wte, wpe;    /* gpt */
    dtr_gpt_block h[GPT_L];
    dtr_layernorm_layer ln_f;
    dtr_linear_layer head;
    int gpt;
    dtr_rng rng;
    float *x;
    int32_t *y, *ids, *pos;
} workload;

static dtr_result gpt_init(workload *w) {
    char name[16];
    dtr_result r = dtr_model_create(w->ctx, 1, &w->m);
    int i;
    if (r == DTR_OK) r = dtr_embedding_layer_init(&w->wte, w->m, "wte", GPT_VOCAB, GPT_C);
    if (r == DTR_OK) r = dtr_embedding_layer_init(&w->wpe, w->m, "wpe", GPT_T, GPT_C);
    for (i = 0; i < GPT_L && r == DTR_OK; i++) {
        snprintf(name, sizeof name, "h.%d", i);
        r = dtr_gpt_block_init(&w->h[i], w->m, name, GPT_C, 4);
    }
    if (r == DTR_OK) r = dtr_layernorm_layer_init(&w->ln_f, w->m, "ln_f", GPT_C);
    if (r == DTR_OK) r = dtr_linear_layer_init(&w->head, w->m, "head", GPT_C, GPT_VOCAB, 0, DTR_INIT_TORCH_DEFAULT);
    return r == DTR_OK ? dtr_model_build(w->m) : r;
}

static dtr_result workload_init(workload *w, int gpt, int threads) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(gpt ? DTR_OPT_ADAM : DTR_OPT_SGD, gpt ? 3e-3f : 0.05f);
    dtr_result r;
    memset(w, 0, sizeof *w);
    w->gpt = gpt;
    cc.threads = threads;
    if ((r = dtr_context_create(&cc, &w->ctx)) != DTR_OK) return r;
    if (gpt) r = gpt_init(w);
    else if ((r = fm_net_init(&w->net, w->ctx, FM_MLP, DTR_INIT_KAIMING_UNIFORM, 1)) == DTR_OK) w->m = w->net.model;
    oc.momentum = gpt ? 0.0f : 0.9f;
    if (r == DTR_OK) r = dtr_optimizer_create(w->m, &oc, &w->opt);
    dtr_rng_seed(&w->rng, 7, 1);
    w->x = (float *)malloc(64 * FM_PIXELS * sizeof(float));
    w->y = (int32_t *)malloc(64 * sizeof(int32_t));
    w->ids = (int32_t *)malloc(8 * (GPT_T + 1) * sizeof(int32_t));
    w->pos = (int32_t *)malloc(8 * GPT_T * sizeof(int32_t));
    return r == DTR_OK && (!w->x || !w->y || !w->ids || !w->pos) ? DTR_OUT_OF_MEMORY : r;
}

static void workload_free(workload *w) {
    free(w->x); free(w->y); free(w->ids); free(w->pos);
    dtr_optimizer_destroy(w->opt);
    dtr_model_destroy(w->m);
    dtr_context_destroy(w->ctx);
}

static dtr_tensor *gpt_loss(workload *w) {
    dtr_context *ctx = w->ctx;
    int64_t s2[2] = {8, GPT_T}, ls[2] = {8 * GPT_T, GPT_VOCAB}, ts[1] = {8 * GPT_T}, i;
    int32_t *next = (int32_t *)malloc(8 * GPT_T * sizeof(int32_t));
    dtr_tensor *x, *t;
    int b;
    for (i = 0; i < 8 * (GPT_T + 1); i++) w->ids[i] = (int32_t)(dtr_rng_u32(&w->rng) % GPT_VOCAB);
    for (i = 0; i < 8 * GPT_T; i++) w->pos[i] = (int32_t)(i % GPT_T), next[i] = w->ids[i + 1];
    x = dtr_add(ctx, dtr_embedding_layer_forward(ctx, &w->wte, dtr_tensor_from(ctx, DTR_I32, 2, s2, w->ids)),
                dtr_embedding_layer_forward(ctx, &w->wpe, dtr_tensor_from(ctx, DTR_I32, 2, s2, w->pos)));
    for (b = 0; b < GPT_L; b++) x = dtr_gpt_block_forward(ctx, &w->h[b], x);
    x = dtr_reshape(ctx, dtr_linear_layer_forward(ctx, &w->head, dtr_layernorm_layer_forward(ctx, &w->ln_f, x)), 2, ls);
    t = dtr_tensor_from(ctx, DTR_I32, 1, ts, next);
    free(next);
    return dtr_cross_entropy(ctx, x, t);
}

static dtr_tensor *mlp_loss(workload *w) {
    int64_t xs[2] = {64, FM_PIXELS}, ys[1] = {64}, i;
    for (i = 0; i < 64 * FM_PIXELS; i++) w->x[i] = dtr_rng_uniform(&w->rng);
    for (i = 0; i < 64; i++) w->y[i] = (int32_t)(dtr_rng_u32(&w->rng) % FM_CLASSES);
    return dtr_cross_entropy(w->ctx, fm_net_forward(w->ctx, &w->net, dtr_tensor_from(w->ctx, DTR_F32, 2, xs, w->x)),
                             dtr_tensor_from(w->ctx, DTR_I32, 1, ys, w->y));
}

static dtr_result workload_step(workload *w) {
    dtr_tensor *loss = w->gpt ? gpt_loss(w) : mlp_loss(w);
    dtr_result r = loss ? dtr_backward(w->ctx, loss) : dtr_context_status(w->ctx);
    if (r == DTR_OK) r = dtr_optimizer_step(w->opt, NULL);
    dtr_context_reset(w->ctx);
    return r;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* K steps (one checkpoint at the first when ck); their time, each step's time into times */
static double run_block(workload *w, dtr_ckpt *ck, int64_t *step, int k, double *times, double *snap) {
    double t0 = now_s(), t;
    int i;
    for (i = 0; i < k; i++) {
        t = now_s();
        if (workload_step(w) != DTR_OK) return -1.0;
        ++*step;
        if (ck && i == 0) {
            dtr_ckpt_stats s;
            if (dtr_ckpt_save(ck, *step, NULL) != DTR_OK) return -1.0;
            dtr_ckpt_get_stats(ck, &s);
            if (s.snapshot_s > *snap) *snap = s.snapshot_s;
        }
        if (times) times[i] = now_s() - t;
    }
    return now_s() - t0;
}

static int bench_model(const char *model, int every, int rounds, const char *dir, int threads) {
    workload w;
    dtr_ckpt_config kc = dtr_ckpt_config_init();
    dtr_ckpt *ck = NULL;
    dtr_ckpt_stats s;
    double none = 0.0, with = 0.0, snap = 0.0, *times = (double *)malloc((size_t)every * sizeof(double));
    double ratio[256];
    int64_t step = 0;
    int r;
    dtr_result rr = workload_init(&w, strcmp(model, "gpt") == 0, threads);
    if (rr != DTR_OK) return fm_fail(w.ctx, "workload", rr);
    kc.dir = dir, kc.ctx = w.ctx, kc.model = w.m, kc.optimizer = w.opt, kc.keep = 2;
    if ((rr = dtr_ckpt_create(&kc, &ck)) != DTR_OK) return fm_fail(w.ctx, "dtr_ckpt_create", rr);
    for (r = 0; r <= rounds; r++) {
        double a, b, dummy = 0.0;
        /* ABBA: odd rounds run the checkpointing block first, so that a drift of the step
           time over the run (it grows as the weights move) favours neither arm */
        if (r % 2) b = run_block(&w, ck, &step, every, NULL, &snap);
        a = run_block(&w, NULL, &step, every, times, &snap);
        if (r % 2 == 0) b = run_block(&w, ck, &step, every, NULL, r == 0 ? &dummy : &snap);
        if (a < 0 || b < 0) return fm_fail(w.ctx, "step", dtr_context_status(w.ctx));
        if (r > 0) none += a, with += b, ratio[r - 1] = (b - a) / a;
    }
    qsort(ratio, (size_t)rounds, sizeof *ratio, cmp_double);
    dtr_ckpt_wait(ck);
    dtr_ckpt_get_stats(ck, &s);
    qsort(times, (size_t)every, sizeof *times, cmp_double);
    printf("{\"bench\":\"checkpoint\",\"model\":\"%s\",\"every\":%d,\"rounds\":%d,\"params\":%lld,\"state_bytes\":%llu,"
           "\"step_ms_none\":%.4f,\"step_ms_ckpt\":%.4f,\"overhead_pct\":%.2f,\"overhead_pct_median_round\":%.2f,\"snapshot_ms_max\":%.4f,"
           "\"step_ms_median\":%.4f,\"stall_steps\":%.3f,\"write_ms\":%.2f,\"saves\":%lld}\n",
           model, every, rounds, (long long)dtr_model_numel(w.m), (unsigned long long)s.bytes,
           1e3 * none / ((double)rounds * every), 1e3 * with / ((double)rounds * every), 100.0 * (with - none) / none, 100.0 * ratio[rounds / 2],
           1e3 * snap, 1e3 * times[every / 2], snap / times[every / 2], 1e3 * s.write_s, (long long)s.saves);
    fflush(stdout);
    dtr_ckpt_destroy(ck);
    workload_free(&w);
    free(times);
    return 0;
}

int main(int argc, char **argv) {
    const char *model = "all", *dir = NULL;
    char tmp[512];
    int every = 100, rounds = 6, threads = 1, i, rc = 0;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model")) model = argv[i + 1];
        else if (!strcmp(argv[i], "--every")) every = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--dir")) dir = argv[i + 1];
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    if (every < 2 || rounds < 1 || rounds > 256) { fprintf(stderr, "--every >= 2, 1 <= --rounds <= 256\n"); return 2; }
    if (!dir) {
        const char *t = getenv("TMPDIR");
        snprintf(tmp, sizeof tmp, "%s/dtr_bench_ckpt_%ld", t && *t ? t : "/tmp", (long)getpid());
        dir = tmp;
    }
    if (!strcmp(model, "mlp") || !strcmp(model, "all")) rc |= bench_model("mlp", every, rounds, dir, threads);
    if (!strcmp(model, "gpt") || !strcmp(model, "all")) rc |= bench_model("gpt", every, rounds, dir, threads);
    return rc;
}
