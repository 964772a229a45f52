/* bench/tensor_parallel.c: a tensor-parallel GPT block (dtr_tp_gpt_block) on N thread ranks
 * against the single-device block (dtr_gpt_block) on one rank.
 *
 *   build/bench/tensor_parallel [--tp N] [--batch B] [--seq T] [--dim C] [--heads H] [--steps K]
 *
 * Each step is forward, backward (mean squared error against a fixed target) and SGD, on
 * contexts of one thread each (the ranks are threads of this process, local transport). Prints
 * one JSON line:
 *   {"bench":"tensor_parallel","tp":2,"batch":8,"seq":64,"dim":256,"heads":8,"steps":10,
 *    "step_ms_single":..,"step_ms_tp":..,"speedup":..,"bytes_per_step":..,"bytes_analytic":..}
 * bytes_per_step is what one rank sent per step, counted by a transport wrapped around the
 * local one (its isend adds up the bytes of every rank; divided by N). bytes_analytic is the
 * Megatron count: 2 all-reduces of B*T*C floats in forward (after attention's proj and the
 * MLP's fc_proj) and 2 in backward (dtr_tp_copy before qkv and fc), each a ring all-reduce in
 * which a rank sends 2 (N - 1) / N of the buffer. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dtrain.h"

typedef struct opts { int tp, steps, heads; int64_t batch, seq, dim; } opts;

/* ---- a counting transport: the local one with its sends added up ---- */

static dtr_transport_vtable g_counting;
static uint64_t g_sent;   /* bytes, all ranks */

static dtr_result counting_isend(void *state, const void *buf, size_t bytes, int dst, uint64_t tag, void **req,
                                 dtr_transport_error *err) {
    __atomic_add_fetch(&g_sent, (uint64_t)bytes, __ATOMIC_RELAXED);
    return dtr_local_transport()->isend(state, buf, bytes, dst, tag, req, err);
}

/* ---- one rank's run ---- */

typedef struct rank_job {
    pthread_t tid;
    dtr_local_world *w;   /* NULL: the single-device block */
    int rank;
    const opts *o;
    double step_s;
    uint64_t sent;        /* g_sent over the timed steps (rank 0) */
    int ok;
    char msg[256];
} rank_job;

/* Times o->steps steps (after 2 warm-up steps) of the block; returns 0 on error. */
static int time_steps(rank_job *j, dtr_context *ctx, dtr_comm *c) {
    const opts *o = j->o;
    int64_t xs[3] = {o->batch, o->seq, o->dim}, n = o->batch * o->seq * o->dim, i;
    float *x = (float *)malloc((size_t)n * sizeof(float));
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.01f);
    dtr_optimizer *opt = NULL;
    dtr_model *m = NULL;
    dtr_gpt_block blk;
    dtr_tp_gpt_block tblk;
    int64_t t0 = 0;
    uint64_t s0 = 0;
    int s, ok;
    for (i = 0; x && i < n; i++) x[i] = (float)((i * 7919) % 201) / 100.0f - 1.0f;
    ok = x && dtr_model_create(ctx, 1, &m) == DTR_OK &&
         (c ? dtr_tp_gpt_block_init(&tblk, m, c, "h0", o->dim, o->heads) : dtr_gpt_block_init(&blk, m, "h0", o->dim, o->heads)) == DTR_OK &&
         dtr_optimizer_create(m, &oc, &opt) == DTR_OK;
    for (s = 0; ok && s < o->steps + 2; s++) {
        dtr_tensor *in, *y;
        if (s == 2 && c) ok = dtr_comm_barrier(c) == DTR_OK;
        if (s == 2) t0 = dtr_time_ns(), s0 = __atomic_load_n(&g_sent, __ATOMIC_RELAXED);
        in = dtr_tensor_from(ctx, DTR_F32, 3, xs, x);
        y = c ? dtr_tp_gpt_block_forward(ctx, &tblk, in) : dtr_gpt_block_forward(ctx, &blk, in);
        ok = ok && dtr_backward(ctx, dtr_mse(ctx, y, in)) == DTR_OK && dtr_optimizer_step(opt, NULL) == DTR_OK;
        dtr_context_reset(ctx);
    }
    if (c && ok) ok = dtr_comm_barrier(c) == DTR_OK;
    j->step_s = (double)(dtr_time_ns() - t0) * 1e-9 / o->steps;
    j->sent = __atomic_load_n(&g_sent, __ATOMIC_RELAXED) - s0;
    if (!ok) snprintf(j->msg, sizeof j->msg, "%s", dtr_context_last_error(ctx));
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    free(x);
    return ok;
}

static void *rank_main(void *arg) {
    rank_job *j = (rank_job *)arg;
    dtr_context_config cc = dtr_context_config_init();
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_context *ctx = NULL;
    dtr_comm *c = NULL;
    cc.threads = 1;
    if (dtr_context_create(&cc, &ctx) != DTR_OK) return NULL;
    cfg.transport_vtable = &g_counting;
    cfg.local.world = j->w;
    cfg.local.rank = j->rank;
    if (j->w && (dtr_comm_create(&cfg, &c, j->msg, sizeof j->msg) != DTR_OK ||
                 dtr_comm_set_allreduce_algo(c, DTR_ALLREDUCE_RING, 0) != DTR_OK)) {
        dtr_context_destroy(ctx);
        return NULL;
    }
    j->ok = time_steps(j, ctx, c);
    dtr_comm_destroy(c);
    dtr_context_destroy(ctx);
    return NULL;
}

/* Runs the single-device block (tp 0) or N ranks; rank 0's job in *out. 0 on error. */
static int run(const opts *o, int tp, rank_job *out) {
    rank_job *jobs = (rank_job *)calloc((size_t)(tp ? tp : 1), sizeof(*jobs));
    dtr_local_world *w = NULL;
    int r, ok = 1;
    if (!jobs || (tp && dtr_local_world_create(tp, NULL, &w) != DTR_OK)) { free(jobs); return 0; }
    for (r = 0; r < (tp ? tp : 1); r++) {
        jobs[r].w = w, jobs[r].rank = r, jobs[r].o = o;
        pthread_create(&jobs[r].tid, NULL, rank_main, &jobs[r]);
    }
    for (r = 0; r < (tp ? tp : 1); r++) pthread_join(jobs[r].tid, NULL);
    for (r = 0; r < (tp ? tp : 1); r++)
        if (!jobs[r].ok) fprintf(stderr, "tensor_parallel: tp %d rank %d: %s\n", tp, r, jobs[r].msg), ok = 0;
    *out = jobs[0];
    dtr_local_world_destroy(w);
    free(jobs);
    return ok;
}

static int parse(int argc, char **argv, opts *o) {
    int i;
    o->tp = 2, o->steps = 10, o->heads = 8, o->batch = 8, o->seq = 64, o->dim = 256;
    for (i = 1; i + 1 < argc; i += 2) {
        long v = atol(argv[i + 1]);
        if (!strcmp(argv[i], "--tp")) o->tp = (int)v;
        else if (!strcmp(argv[i], "--steps")) o->steps = (int)v;
        else if (!strcmp(argv[i], "--heads")) o->heads = (int)v;
        else if (!strcmp(argv[i], "--batch")) o->batch = v;
        else if (!strcmp(argv[i], "--seq")) o->seq = v;
        else if (!strcmp(argv[i], "--dim")) o->dim = v;
        else return 0;
    }
    return i == argc && o->tp >= 1 && o->tp <= 64 && o->steps >= 1 && o->batch >= 1 && o->seq >= 1 && o->dim >= 1;
}

int main(int argc, char **argv) {
    opts o;
    rank_job single, tp;
    double analytic;
    if (!parse(argc, argv, &o)) {
        fprintf(stderr, "usage: %s [--tp N] [--batch B] [--seq T] [--dim C] [--heads H] [--steps K]\n", argv[0]);
        return 2;
    }
    g_counting = *dtr_local_transport();
    g_counting.name = "counting";
    g_counting.isend = counting_isend;
    if (!run(&o, 0, &single) || !run(&o, o.tp, &tp)) return 1;
    analytic = 4.0 * 2.0 * (o.tp - 1) / o.tp * (double)(o.batch * o.seq * o.dim) * sizeof(float);
    printf("{\"bench\":\"tensor_parallel\",\"tp\":%d,\"batch\":%lld,\"seq\":%lld,\"dim\":%lld,\"heads\":%d,\"steps\":%d,"
           "\"step_ms_single\":%.3f,\"step_ms_tp\":%.3f,\"speedup\":%.3f,\"bytes_per_step\":%.0f,\"bytes_analytic\":%.0f}\n",
           o.tp, (long long)o.batch, (long long)o.seq, (long long)o.dim, o.heads, o.steps, single.step_s * 1e3,
           tp.step_s * 1e3, single.step_s / tp.step_s, (double)tp.sent / o.steps / o.tp, analytic);
    return 0;
}
