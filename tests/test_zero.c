/* tests/test_zero.c: ZeRO-1 (a sharded optimizer) in the data-parallel engine, thread ranks.
 *   test_zero_equals_dp  worlds 2, 3, 4 x SGD (momentum), AdamW, LAMB, each with clipping by
 *                        global norm and 2 micro-batches of accumulation (no_sync): 12 steps
 *                        of ZeRO-1 give every rank the weights of plain data parallelism
 *                        (relative error <= 1e-6; in fact the same bits: the gradients are
 *                        the same average, and each float is updated by the same formula)
 *   test_zero_memory     8 equal parameters on 4 ranks: each rank's optimizer state is a
 *                        quarter of the unsharded one, and the shards tile the buffer
 *   test_zero_errors     stage 2, ZeRO with compression, an optimizer shard past the buffer,
 *                        a LAMB shard splitting a parameter, a step range outside the shard
 * SGD and AdamW take equal shards (splitting parameters), LAMB shards of whole parameters. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include "test.h"
#include "dp_mlp.h"

#define STEPS 12
#define ACCUM 2
#define B 4

typedef struct zrun {
    int world, zero;
    dtr_optimizer_kind kind;
} zrun;

typedef struct zrank {
    pthread_t tid;
    dtr_local_world *w;
    const zrun *run;
    int rank, ok;
    float params[1024];
    int64_t numel;
    size_t state_bytes;
    char msg[512];
} zrank;

static size_t state_bytes(dtr_optimizer *o) {
    dtr_state_entry e;
    size_t b = 0;
    int i;
    for (i = 3; dtr_optimizer_state(o, i, &e) == DTR_OK; i++) b += e.bytes;
    return b;
}

/* one step: ACCUM micro-batches (rows of this rank), then the (sharded) update and gather */
static dtr_result zstep(mlp *n, dtr_dp *dp, int t, int rank) {
    dtr_result r = DTR_OK;
    int k;
    for (k = 0; k < ACCUM && r == DTR_OK; k++) {
        r = dtr_dp_set_no_sync(dp, k < ACCUM - 1);
        if (r == DTR_OK) r = mlp_backward(n, t * ACCUM + k, (int64_t)rank * B, B);
        if (r == DTR_OK) r = dtr_dp_finish(dp);
        if (r == DTR_OK) r = dtr_optimizer_step(n->opt, NULL);
        if (r == DTR_OK) r = dtr_dp_step_done(dp);
        dtr_context_reset(n->ctx);
    }
    return r;
}

static dtr_result ztrain(zrank *z, dtr_comm *c) {
    dtr_optimizer_config oc = dtr_optimizer_config_init(z->run->kind, z->run->kind == DTR_OPT_SGD ? 0.05f : 0.01f);
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_dp *dp = NULL;
    mlp n;
    dtr_result r = DTR_OK;
    int t;
    if (!mlp_init(&n, 7, 1)) return DTR_OUT_OF_MEMORY;
    dtr_optimizer_destroy(n.opt);
    n.opt = NULL;
    oc.momentum = z->run->kind == DTR_OPT_SGD ? 0.9f : 0.0f;
    oc.clip_norm = 0.5f;
    oc.grad_accum_steps = ACCUM;
    dc.bucket_bytes = 512;
    dc.zero = z->run->zero;
    dc.zero_whole_params = z->run->kind == DTR_OPT_LAMB;
    r = dtr_dp_create(n.m, c, &dc, &dp);
    if (r == DTR_OK) r = dtr_dp_shard(dp, &oc.shard_begin, &oc.shard_end);
    if (r == DTR_OK) r = dtr_optimizer_create(n.m, &oc, &n.opt);
    for (t = 0; t < STEPS && r == DTR_OK; t++) r = zstep(&n, dp, t, z->rank);
    if (r != DTR_OK) snprintf(z->msg, sizeof z->msg, "%s | %s", dtr_context_last_error(n.ctx), dtr_comm_last_error(c));
    z->numel = dtr_model_numel(n.m);
    memcpy(z->params, dtr_model_params(n.m), (size_t)z->numel * sizeof(float));
    z->state_bytes = n.opt ? state_bytes(n.opt) : 0;
    dtr_dp_destroy(dp);
    mlp_free(&n);
    return r;
}

static void *zmain(void *arg) {
    zrank *z = (zrank *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    cfg.local.world = z->w;
    cfg.local.rank = z->rank;
    cfg.timeout_ms = 20000;
    if (dtr_comm_create(&cfg, &c, z->msg, sizeof z->msg) != DTR_OK) return NULL;
    z->ok = ztrain(z, c) == DTR_OK;
    dtr_comm_destroy(c);
    return NULL;
}

static void zrun_world(const zrun *run, zrank *z) {
    dtr_local_world *w = NULL;
    int r;
    if (dtr_local_world_create(run->world, NULL, &w) != DTR_OK) { CHECK(0); return; }
    for (r = 0; r < run->world; r++) {
        memset(&z[r], 0, sizeof z[r]);
        z[r].w = w, z[r].run = run, z[r].rank = r;
        pthread_create(&z[r].tid, NULL, zmain, &z[r]);
    }
    for (r = 0; r < run->world; r++) pthread_join(z[r].tid, NULL);
    dtr_local_world_destroy(w);
}

static void test_zero_equals_dp(void) {
    static const dtr_optimizer_kind kinds[3] = {DTR_OPT_SGD, DTR_OPT_ADAMW, DTR_OPT_LAMB};
    static zrank plain[4], zero[4];
    zrun a, b;
    int world, k, r;
    for (world = 2; world <= 4; world++)
        for (k = 0; k < 3; k++) {
            size_t sum = 0;
            a.world = b.world = world, a.kind = b.kind = kinds[k], a.zero = 0, b.zero = 1;
            zrun_world(&a, plain);
            zrun_world(&b, zero);
            for (r = 0; r < world; r++) {
                double e;
                CHECK_MSG(plain[r].ok && zero[r].ok, "world %d kind %d rank %d: %s %s", world, k, r, plain[r].msg, zero[r].msg);
                e = rel_err(zero[r].params, plain[0].params, plain[0].numel);
                CHECK_MSG(e <= 1e-6, "world %d optimizer %d rank %d: relative error %g against plain DP", world, k, r, e);
                sum += zero[r].state_bytes;
            }
            /* the shards' state adds up to one unsharded optimizer's */
            CHECK_MSG(sum == plain[0].state_bytes, "world %d optimizer %d: %zu state bytes over the ranks, %zu unsharded",
                      world, k, sum, plain[0].state_bytes);
        }
}

/* 8 parameters of 256 floats over 4 ranks: shards of 2 parameters each */
static void test_zero_memory(void) {
    int r;
    for (r = 0; r < 4; r++) {
        dtr_context *ctx = test_ctx(1);
        dtr_model *m = NULL;
        dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_ADAMW, 0.01f);
        dtr_optimizer *whole = NULL, *part = NULL;
        int64_t shape[1] = {256}, per = 8 * 256 / 4;
        char name[16];
        int i;
        CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
        for (i = 0; i < 8; i++) {
            snprintf(name, sizeof name, "p%d", i);
            CHECK(dtr_model_param(m, name, 1, shape, DTR_INIT_ZEROS, 0.0f) != NULL);
        }
        CHECK_OK(ctx, dtr_optimizer_create(m, &oc, &whole));
        oc.shard_begin = r * per, oc.shard_end = (r + 1) * per;   /* as dtr_dp_shard lays 8 x 256 over 4 */
        CHECK_OK(ctx, dtr_optimizer_create(m, &oc, &part));
        CHECK_EQ_INT(state_bytes(part) * 4, state_bytes(whole));
        dtr_optimizer_destroy(part);
        dtr_optimizer_destroy(whole);
        dtr_model_destroy(m);
        dtr_context_destroy(ctx);
    }
}

static void test_zero_errors(void) {
    dtr_local_world *w = NULL;
    dtr_comm_config cc = dtr_comm_config_init();
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    dtr_comm *c = NULL;
    dtr_dp *dp = NULL;
    dtr_optimizer *o = NULL;
    mlp n;
    CHECK(mlp_init(&n, 1, 1));
    CHECK(dtr_local_world_create(1, NULL, &w) == DTR_OK);
    cc.local.world = w;
    CHECK(dtr_comm_create(&cc, &c, NULL, 0) == DTR_OK);
    dc.zero = 2;
    CHECK_EQ_INT(dtr_dp_create(n.m, c, &dc, &dp), DTR_UNSUPPORTED);
    CHECK(strstr(dtr_context_last_error(n.ctx), "stage 1") != NULL);
    dtr_context_clear_error(n.ctx);
    dc.zero = 1, dc.compress = DTR_COMPRESS_INT8;
    CHECK_EQ_INT(dtr_dp_create(n.m, c, &dc, &dp), DTR_UNSUPPORTED);
    dtr_context_clear_error(n.ctx);
    oc.shard_begin = 0, oc.shard_end = dtr_model_numel(n.m) + 16;   /* past the buffer */
    CHECK_EQ_INT(dtr_optimizer_create(n.m, &oc, &o), DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(n.ctx);
    oc.kind = DTR_OPT_LAMB, oc.shard_begin = 16, oc.shard_end = 96;   /* inside l1.weight */
    CHECK_EQ_INT(dtr_optimizer_create(n.m, &oc, &o), DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_context_last_error(n.ctx), "whole parameters") != NULL);
    oc.kind = DTR_OPT_SGD;
    dtr_context_clear_error(n.ctx);
    oc.shard_begin = 0, oc.shard_end = dtr_model_param_offset(n.m, 2);   /* l1 */
    CHECK_OK(n.ctx, dtr_optimizer_create(n.m, &oc, &o));
    CHECK_EQ_INT(dtr_optimizer_step_range(o, 0, dtr_model_numel(n.m), NULL), DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(n.ctx);
    dtr_optimizer_destroy(o);
    dtr_comm_destroy(c);
    dtr_local_world_destroy(w);
    mlp_free(&n);
}

int main(void) {
    RUN(test_zero_equals_dp);
    RUN(test_zero_memory);
    RUN(test_zero_errors);
    return test_summary();
}
