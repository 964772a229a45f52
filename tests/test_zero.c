/* tests/test_zero.c: ZeRO-1 and ZeRO-2 (a sharded optimizer) and ZeRO-3 (sharded parameters)
 * in the data-parallel engine, thread ranks.
 *   test_zero_equals_dp  worlds 2, 3, 4 x SGD (momentum), AdamW, LAMB, each with clipping by
 *                        global norm, 2 micro-batches of accumulation (no_sync) and learning
 *                        rates per parameter (lr_groups): 12 steps
 *                        of ZeRO-1, ZeRO-2 and ZeRO-3 give every rank the weights of plain data
 *                        parallelism (relative error <= 1e-6: both sum their shard in rank
 *                        order, not in the all-reduce's order, and clip by the norm summed
 *                        over the shards)
 *   test_zero_loss_scaler  world 3, a dynamic loss scaler and 2 micro-batches of accumulation:
 *                        in step 3 every rank adds 3e38 to the last gradient float (in rank
 *                        2's shard) before the synchronised micro-batch, so that the average
 *                        overflows there only; plain DP, ZeRO-1 and ZeRO-2 all skip that step
 *                        on every rank (the check sums the shards' norms over the group) and
 *                        end with plain DP's weights, with one sum over the group a step
 *                        (the optimizer clips by the scaler's norm)
 *   test_zero_lamb_mixed LAMB over shards splitting parameters with biases out of weight decay
 *                        and l1.weight frozen for 4 steps (then counting its own): ZeRO-1, 2
 *                        and 3 at worlds 2 and 3 give plain DP's weights
 *   test_zero3_units     ZeRO-3 with a unit per parameter and one unit kept: refetches in
 *                        backward, prefetches, plain DP's weights, less than the model held
 *   test_zero3_memory    2 ranks of 2 x 16 MiB parameters: ZeRO-3 gives the other shard's
 *                        memory back to the system (resident size), dtr_dp_gather_params
 *                        takes it again
 *   test_zero2_release   ZeRO-2 with zero2_release_grads: the other shard's gradients go back
 *                        to the system once sent (resident size), the parameters stay; plain
 *                        DP's weights at worlds 2 to 4
 *   test_zero_memory     8 equal parameters on 4 ranks: each rank's optimizer state is a
 *                        quarter of the unsharded one, and the shards tile the buffer
 *   test_zero_grads      ZeRO-1's and ZeRO-2's shard of the gradients after dtr_dp_finish is
 *                        plain DP's average; the bytes sent per sync are the non-shard
 *                        gradients (a reduce-scatter's), and outside its shard a rank keeps
 *                        its own gradients
 *   test_zero_half       ZeRO-1, 2 and 3 with the slices in bf16 or fp16 (compress BF16 /
 *                        FP16), worlds 2 and 3, SGD and AdamW: every rank the same weights,
 *                        within 1e-2 (bf16) or 2e-3 (fp16) of plain f32 DP, half the bytes
 *   test_zero_errors     a group of 1 (whole buffer, no shard_sum), stage 3, zero2_release_grads
 *                        on stage 1, ZeRO with int8 compression or local SGD, an optimizer
 *                        shard past the buffer, a LAMB shard splitting a parameter without
 *                        shard_sum, a step range outside the shard
 * Shards are equal (splitting parameters; LAMB's split parameters take their norms summed
 * over the shards), and for LAMB also runs of whole parameters (zero_whole_params). */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE   /* mincore */
#include <pthread.h>
#include <unistd.h>
#include <sys/mman.h>
#include "test.h"
#include "dp_mlp.h"

#define STEPS 12
#define ACCUM 2
#define B 4

typedef struct zrun {
    int world, zero;
    int grads_only;         /* 1: one synchronised backward, its gradients kept */
    int scaler;             /* 1: dtr_loss_scaler_step with an overflow in step 3 (test_zero_loss_scaler) */
    int whole;              /* zero_whole_params */
    dtr_dp_compress compress;   /* BF16 / FP16: ZeRO's slices in 16 bits */
    dtr_optimizer_kind kind;
    size_t bucket;          /* bucket_bytes (ZeRO-3: the units); 0: 512 */
    int units;              /* zero3_units */
    int keep_grads;         /* zero3_keep_grads */
    int release;            /* zero2_release_grads */
    int mixed;              /* biases without weight decay, l1.weight frozen before step THAW (test_zero_lamb_mixed) */
} zrun;

#define THAW 4

typedef struct zrank {
    pthread_t tid;
    dtr_local_world *w;
    const zrun *run;
    int rank, ok;
    float params[1024], grads[1024];
    int64_t numel, shard_begin, shard_end;
    dtr_dp_stats stats;
    size_t state_bytes;
    int64_t skipped;        /* the loss scaler's skipped steps */
    int sums;               /* the optimizer's shard_sum calls (the engine's, counted) */
    int sharded_refused;    /* ZeRO-3: reading the model before dtr_dp_gather_params was refused */
    dtr_result (*shard_sum)(void *user, double *vals, int n);
    void *shard_sum_user;
    char msg[512];
} zrank;

/* the engine's shard_sum, counted */
static dtr_result counted_sum(void *user, double *vals, int n) {
    zrank *z = (zrank *)user;
    z->sums++;
    return z->shard_sum(z->shard_sum_user, vals, n);
}


/* one step: ACCUM micro-batches (rows of this rank), then the (sharded) update and gather;
   with a loss scaler (scale 1) step 3 overflows in the last float's average */
static dtr_result zstep(mlp *n, dtr_dp *dp, int t, int rank, dtr_loss_scaler *ls) {
    dtr_result r = DTR_OK;
    int k;
    for (k = 0; k < ACCUM && r == DTR_OK; k++) {
        r = dtr_dp_set_no_sync(dp, k < ACCUM - 1);
        if (r == DTR_OK) r = mlp_backward(n, t * ACCUM + k, (int64_t)rank * B, B);
        if (r == DTR_OK && ls && t == 3 && k == 0) dtr_model_grads(n->m)[dtr_model_numel(n->m) - 1] += 3e38f;
        if (r == DTR_OK) r = dtr_dp_finish(dp);
        if (r == DTR_OK) r = ls ? dtr_loss_scaler_step(ls, n->m, n->opt, NULL) : dtr_optimizer_step(n->opt, NULL);
        if (r == DTR_OK) r = dtr_dp_step_done(dp);
        dtr_context_reset(n->ctx);
    }
    return r;
}

/* ZeRO-3 after training: reading the sharded model is refused (parameter and model), then
   dtr_dp_gather_params gives every rank the whole model */
static dtr_result zgather(zrank *z, mlp *n, dtr_dp *dp) {
    dtr_result a = dtr_model_read(n->m, z->params, dtr_model_numel(n->m)), b;
    dtr_context_clear_error(n->ctx);
    b = dtr_tensor_read(n->l1.weight, DTR_F32, z->params, HID * IN);   /* more than any rank's shard */
    z->sharded_refused = a == DTR_BAD_STATE && b == DTR_BAD_STATE && strstr(dtr_context_last_error(n->ctx), "ZeRO-3");
    dtr_context_clear_error(n->ctx);
    return dtr_dp_gather_params(dp);
}

static dtr_result ztrain(zrank *z, dtr_comm *c) {
    static const dtr_lr_group groups[2] = {{"l1.bias", 2.0f}, {"l2.*", 0.5f}};
    static const char *bias = "*bias", *l1w = "l1.weight";
    dtr_optimizer_config oc = dtr_optimizer_config_init(z->run->kind, z->run->kind == DTR_OPT_SGD ? 0.05f : 0.01f);
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_loss_scaler_config lc = dtr_loss_scaler_config_init();
    dtr_loss_scaler *ls = NULL;
    dtr_dp *dp = NULL;
    mlp n;
    dtr_result r = DTR_OK;
    int t;
    lc.init_scale = lc.min_scale = 1.0f;   /* the loss needs no scaling: the skip decision is tested */
    if (z->run->scaler && dtr_loss_scaler_create(&lc, &ls) != DTR_OK) return DTR_OUT_OF_MEMORY;
    if (!mlp_init(&n, 7, 1)) { dtr_loss_scaler_destroy(ls); return DTR_OUT_OF_MEMORY; }
    dtr_optimizer_destroy(n.opt);
    n.opt = NULL;
    oc.momentum = z->run->kind == DTR_OPT_SGD ? 0.9f : 0.0f;
    oc.clip_norm = 0.5f;
    oc.grad_accum_steps = ACCUM;
    oc.lr_groups = groups, oc.n_lr_groups = 2;
    if (z->run->mixed) oc.no_decay = &bias, oc.n_no_decay = 1, oc.weight_decay = 0.01f;   /* per-parameter rates: ZeRO's shards (LAMB's split parameters too) keep them */
    dc.bucket_bytes = z->run->bucket ? z->run->bucket : 512;
    dc.zero3_units = z->run->units;
    dc.zero3_keep_grads = z->run->keep_grads;
    dc.zero2_release_grads = z->run->release;
    dc.zero = z->run->zero;
    dc.zero_whole_params = z->run->whole;
    dc.compress = z->run->compress;
    r = dtr_dp_create(n.m, c, &dc, &dp);
    if (r == DTR_OK) r = dtr_dp_shard_optimizer(dp, &oc);
    if (oc.shard_sum) {
        z->shard_sum = oc.shard_sum, z->shard_sum_user = oc.shard_sum_user;
        oc.shard_sum = counted_sum, oc.shard_sum_user = z;
    }
    if (r == DTR_OK) r = dtr_optimizer_create(n.m, &oc, &n.opt);
    if (r == DTR_OK && z->run->grads_only) r = mlp_backward(&n, 0, (int64_t)z->rank * B, B);
    if (r == DTR_OK && z->run->grads_only) r = dtr_dp_finish(dp);
    for (t = 0; t < STEPS && r == DTR_OK && !z->run->grads_only; t++) {
        if (z->run->mixed && t <= THAW) r = dtr_model_set_trainable(n.m, &l1w, 1, t == THAW);
        if (r == DTR_OK) r = zstep(&n, dp, t, z->rank, ls);
    }
    dtr_dp_get_stats(dp, &z->stats);   /* (ZeRO-3: the training's, before the gather below) */
    if (r == DTR_OK && z->run->zero == 3) r = zgather(z, &n, dp);
    if (r != DTR_OK) snprintf(z->msg, sizeof z->msg, "%s | %s", dtr_context_last_error(n.ctx), dtr_comm_last_error(c));
    z->numel = dtr_model_numel(n.m);
    memcpy(z->params, dtr_model_params(n.m), (size_t)z->numel * sizeof(float));
    memcpy(z->grads, dtr_model_grads(n.m), (size_t)z->numel * sizeof(float));
    z->shard_begin = oc.shard_begin, z->shard_end = oc.shard_end;
    z->state_bytes = n.opt ? test_moment_bytes(n.opt) : 0;
    z->skipped = dtr_loss_scaler_skipped(ls);
    dtr_loss_scaler_destroy(ls);
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

/* plain DP against ZeRO `zero` on `world` ranks with optimizer `kind` */
static void zcompare(int world, dtr_optimizer_kind kind, int zero, int whole, const zrank *plain) {
    static zrank z[4];
    zrun b;
    size_t sum = 0;
    int r;
    memset(&b, 0, sizeof b);
    b.world = world, b.kind = kind, b.zero = zero, b.whole = whole;
    zrun_world(&b, z);
    for (r = 0; r < world; r++) {
        double e;
        CHECK_MSG(plain[r].ok && z[r].ok, "world %d kind %d ZeRO-%d rank %d: %s %s", world, (int)kind, zero, r, plain[r].msg,
                  z[r].msg);
        e = rel_err(z[r].params, plain[0].params, plain[0].numel);
        CHECK_MSG(e <= 1e-6, "world %d optimizer %d ZeRO-%d rank %d: relative error %g against plain DP", world, (int)kind,
                  zero, r, e);
        sum += z[r].state_bytes;
        if (zero == 3)   /* 2 units (the buckets), both gathered in each forward */
            CHECK_MSG(z[r].sharded_refused && z[r].stats.param_gathers >= 2 * STEPS * ACCUM,
                      "world %d ZeRO-3 rank %d: read refused %d, %lld gathers", world, r, z[r].sharded_refused,
                      (long long)z[r].stats.param_gathers);
    }
    /* the shards' state adds up to one unsharded optimizer's */
    CHECK_MSG(sum == plain[0].state_bytes, "world %d optimizer %d ZeRO-%d: %zu state bytes over the ranks, %zu unsharded",
              world, (int)kind, zero, sum, plain[0].state_bytes);
}

static void test_zero_equals_dp(void) {
    static const dtr_optimizer_kind kinds[3] = {DTR_OPT_SGD, DTR_OPT_ADAMW, DTR_OPT_LAMB};
    static zrank plain[4];
    zrun a;
    int world, k;
    memset(&a, 0, sizeof a);
    for (world = 2; world <= 4; world++)
        for (k = 0; k < 3; k++) {
            a.world = world, a.kind = kinds[k], a.zero = 0;
            zrun_world(&a, plain);
            zcompare(world, kinds[k], 1, 0, plain);
            zcompare(world, kinds[k], 2, 0, plain);
            zcompare(world, kinds[k], 3, 0, plain);
            if (kinds[k] == DTR_OPT_LAMB) zcompare(world, kinds[k], 2, 1, plain);   /* shards of whole parameters */
            if (kinds[k] == DTR_OPT_LAMB) zcompare(world, kinds[k], 3, 1, plain);
        }
}

/* LAMB over shards that split parameters, with mixed runs: biases without weight decay, rates
   per parameter, l1.weight frozen for THAW steps and then trained from its own first step:
   ZeRO-1, 2 and 3 give plain DP's weights (before, sharded LAMB refused all but one run) */
static void test_zero_lamb_mixed(void) {
    static zrank plain[3], z[3];
    zrun a;
    int world, zero, r;
    for (world = 2; world <= 3; world++) {
        memset(&a, 0, sizeof a);
        a.world = world, a.kind = DTR_OPT_LAMB, a.mixed = 1;
        zrun_world(&a, plain);
        for (zero = 1; zero <= 3; zero++) {
            a.zero = zero;
            zrun_world(&a, z);
            for (r = 0; r < world; r++) {
                double e = rel_err(z[r].params, plain[0].params, plain[0].numel);
                CHECK_MSG(plain[r].ok && z[r].ok, "world %d ZeRO-%d rank %d: %s %s", world, zero, r, plain[r].msg, z[r].msg);
                CHECK_MSG(e <= 1e-6, "world %d ZeRO-%d rank %d: relative error %g against plain DP", world, zero, r, e);
            }
        }
    }
}

/* ZeRO-3 with a unit per parameter (16-float buckets) and one unit kept besides the running
   op's: forward releases one of l1's units while l2 runs, backward gathers it again; the
   weights are still plain DP's, and the ranks whose shard is in l1 never held the whole model */
static void test_zero3_units(void) {
    static zrank plain[4], z[4];
    zrun a;
    int world, r;
    memset(&a, 0, sizeof a);
    for (world = 2; world <= 4; world++) {
        a.world = world, a.kind = DTR_OPT_ADAMW, a.zero = 0, a.bucket = 0, a.units = 0;
        zrun_world(&a, plain);
        a.zero = 3, a.bucket = 64, a.units = 1, a.keep_grads = world == 3;   /* (world 3: the gradients kept whole) */
        zrun_world(&a, z);
        for (r = 0; r < world; r++) {
            double e = rel_err(z[r].params, plain[0].params, plain[0].numel);
            CHECK_MSG(plain[r].ok && z[r].ok, "world %d rank %d: %s %s", world, r, plain[r].msg, z[r].msg);
            CHECK_MSG(e <= 1e-6, "world %d rank %d: relative error %g against plain DP", world, r, e);
            /* 4 units a forward, and at least one gathered again in each backward */
            CHECK_MSG(z[r].stats.param_gathers >= 5 * STEPS * ACCUM, "world %d rank %d: %lld gathers", world, r,
                      (long long)z[r].stats.param_gathers);
            /* from the second micro-batch on each gather but the first of a step was posted ahead */
            CHECK_MSG(z[r].stats.param_prefetches >= 4 * (STEPS * ACCUM - 1), "world %d rank %d: %lld of %lld gathers "
                      "prefetched", world, r, (long long)z[r].stats.param_prefetches, (long long)z[r].stats.param_gathers);
            /* (the last rank's shard is l2: with l1's one op it has held everything) */
            CHECK_MSG(r == world - 1 || z[r].stats.param_bytes_peak < (uint64_t)z[r].numel * sizeof(float), "world %d rank %d: held %llu of "
                      "%lld parameter bytes", world, r, (unsigned long long)z[r].stats.param_bytes_peak, (long long)z[r].numel * 4);
        }
        if (world == 4) printf("    world 4, a unit a parameter: %lld gathers (%lld prefetched), at most %llu of %lld "
                               "parameter bytes held\n", (long long)z[0].stats.param_gathers,
                               (long long)z[0].stats.param_prefetches, (unsigned long long)z[0].stats.param_bytes_peak,
                               (long long)z[0].numel * 4);
    }
}

/* ---- ZeRO-3 gives released memory back (Linux) ---- */

#define BIG (4 << 20)   /* floats of each of the two parameters: 16 MiB */

typedef struct zbig {
    pthread_t tid;
    dtr_local_world *w;
    int rank;
    dtr_model *m;
    dtr_dp *dp;
    dtr_comm *c;
    int stage;              /* 3, or 2 with zero2_release_grads */
    int mode;               /* 0: dtr_dp_create, 1: dtr_dp_gather_params, 2: dtr_dp_step_done,
                               3: a training step (sum(a * b), the optimizer's zero_grad emulated) */
    dtr_result r;
    double grads_after_finish;   /* mode 3: resident share of the other shard's gradients then */
} zbig;

/* the fraction of the pages wholly inside floats [lo, hi) of x that are resident */
static double resident_share(const float *x, int64_t lo, int64_t hi) {
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t b = ((uintptr_t)(x + lo) + (uintptr_t)page - 1) / (uintptr_t)page * (uintptr_t)page;
    uintptr_t e = (uintptr_t)(x + hi) / (uintptr_t)page * (uintptr_t)page;
    size_t n = e > b ? (e - b) / (size_t)page : 0, i, in = 0;
    unsigned char *v = (unsigned char *)malloc(n ? n : 1);
    if (!v || !n || mincore((void *)b, e - b, v) != 0) { free(v); return -1.0; }
    for (i = 0; i < n; i++) in += v[i] & 1;
    free(v);
    return (double)in / (double)n;
}

static void *zbig_main(void *arg) {
    zbig *b = (zbig *)arg;
    dtr_dp_config dc = dtr_dp_config_init();
    if (b->mode == 3) {
        dtr_context *ctx = dtr_model_context(b->m);
        dtr_tensor *loss = dtr_sum_all(ctx, dtr_mul(ctx, dtr_model_find(b->m, "a"), dtr_model_find(b->m, "b")));
        b->r = loss ? dtr_backward(ctx, loss) : dtr_context_status(ctx);
        if (b->r == DTR_OK) b->r = dtr_dp_finish(b->dp);
        if (b->r == DTR_OK) {
            int64_t lo, hi, n = dtr_model_numel(b->m);
            dtr_dp_shard(b->dp, &lo, &hi);
            b->grads_after_finish = resident_share(dtr_model_grads(b->m), b->rank ? 0 : hi, b->rank ? lo : n);
        }
        if (b->r == DTR_OK) b->r = dtr_model_zero_grad(b->m);   /* as the optimizer's step does */
        if (b->r == DTR_OK) b->r = dtr_dp_step_done(b->dp);
        dtr_context_reset(ctx);
        return NULL;
    }
    if (b->mode) { b->r = b->mode == 1 ? dtr_dp_gather_params(b->dp) : dtr_dp_step_done(b->dp); return NULL; }
    dc.zero = b->stage;
    dc.zero2_release_grads = b->stage == 2;
    dc.bucket_bytes = 1 << 20;   /* a unit (bucket) per parameter */
    b->r = dtr_dp_create(b->m, b->c, &dc, &b->dp);
    return NULL;
}

/* resident bytes of this process */
static long long rss_bytes(void) {
    long long size = 0, res = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return -1;
    if (fscanf(f, "%lld %lld", &size, &res) != 2) res = -1;
    fclose(f);
    return res < 0 ? -1 : res * sysconf(_SC_PAGESIZE);
}

/* resident shares of rank 0's parameters and gradients outside its shard, and of its shard's gradients */
static void zbig_shares(zbig *b, double *prm, double *grad, double *own) {
    int64_t lo, hi, n = dtr_model_numel(b->m);
    dtr_dp_shard(b->dp, &lo, &hi);   /* rank 0: the first half */
    *prm = resident_share(dtr_model_params(b->m), hi, n);
    *grad = resident_share(dtr_model_grads(b->m), hi, n);
    *own = resident_share(dtr_model_grads(b->m), lo, hi);
}

static void zbig_run(zbig *b, int mode) {
    int r;
    for (r = 0; r < 2; r++) b[r].mode = mode, pthread_create(&b[r].tid, NULL, zbig_main, &b[r]);
    for (r = 0; r < 2; r++) pthread_join(b[r].tid, NULL);
}

/* two ranks (threads of this process), each a model of 2 x 16 MiB, their engines made
   (ZeRO `stage`) */
static void zbig_make(zbig *b, dtr_local_world *w, int stage) {
    dtr_comm_config cc = dtr_comm_config_init();
    int64_t shape[1] = {BIG};
    int r;
    for (r = 0; r < 2; r++) {
        dtr_context *ctx = test_ctx(1);
        memset(&b[r], 0, sizeof b[r]);
        b[r].rank = r, b[r].stage = stage;
        CHECK_OK(ctx, dtr_model_create(ctx, 3, &b[r].m));
        CHECK(dtr_model_param(b[r].m, "a", 1, shape, DTR_INIT_NORMAL, 0.02f) != NULL);
        CHECK(dtr_model_param(b[r].m, "b", 1, shape, DTR_INIT_NORMAL, 0.02f) != NULL);
        CHECK_OK(ctx, dtr_model_build(b[r].m));
        cc.local.world = w, cc.local.rank = r;
        CHECK_OK(NULL, dtr_comm_create(&cc, &b[r].c, NULL, 0));
    }
    zbig_run(b, 0);   /* the engines (their buffers are resident too); ZeRO-3: the other shards released */
    for (r = 0; r < 2; r++) CHECK_MSG(b[r].r == DTR_OK, "rank %d: %s", r, dtr_context_last_error(dtr_model_context(b[r].m)));
}

static void zbig_free(zbig *b) {
    int r;
    for (r = 0; r < 2; r++) {
        dtr_context *ctx = dtr_model_context(b[r].m);
        dtr_dp_destroy(b[r].dp);
        dtr_comm_destroy(b[r].c);
        dtr_model_destroy(b[r].m);
        dtr_context_destroy(ctx);
    }
}

/* Two training steps: every gradient written, the other shard's given back once its slices
   were sent (already after dtr_dp_finish) and after the step, the shard's kept; the other
   shard's parameters resident within [prm_lo, prm_hi] after the step. */
static void zbig_steps(zbig *b, double prm_lo, double prm_hi) {
    int r, k;
    for (k = 0; k < 2; k++) {
        double prm, grad, own;
        zbig_run(b, 3);
        for (r = 0; r < 2; r++) CHECK_MSG(b[r].r == DTR_OK, "step %d rank %d: %s", k, r, dtr_context_last_error(dtr_model_context(b[r].m)));
        zbig_shares(&b[0], &prm, &grad, &own);
        printf("    ZeRO-%d, after step %d, rank 0's pages resident: %.0f%% of the other shard's parameters, %.0f%% of its "
               "gradients (%.0f%% after dtr_dp_finish), %.0f%% of its own shard's gradients\n", b[0].stage, k + 1, 100 * prm,
               100 * grad, 100 * b[0].grads_after_finish, 100 * own);
        CHECK_MSG(prm >= prm_lo && prm <= prm_hi && grad >= 0 && grad <= 0.02 && own >= 0.98, "step %d: resident %.3f %.3f %.3f",
                  k + 1, prm, grad, own);
        for (r = 0; r < 2; r++)   /* each bucket's were given back once its slices were sent */
            CHECK_MSG(b[r].grads_after_finish >= 0 && b[r].grads_after_finish <= 0.02, "step %d rank %d: %.3f of the "
                      "sent gradients resident after dtr_dp_finish", k + 1, r, b[r].grads_after_finish);
    }
}

/* ZeRO-3: dtr_dp_gather_params makes the process's resident memory grow by the other shards
   (2 x 16 MiB), and the step's release gives them back to the system; a training step gives
   back the other shard's parameters and gradients */
static void test_zero3_memory(void) {
#if defined(__linux__)
    static zbig b[2];
    dtr_local_world *w = NULL;
    long long before, after, again, half = 2LL * BIG * (long long)sizeof(float);
    int r;
    CHECK_OK(NULL, dtr_local_world_create(2, NULL, &w));
    zbig_make(b, w, 3);
    before = rss_bytes();
    zbig_run(b, 1);
    again = rss_bytes();
    for (r = 0; r < 2; r++) CHECK(b[r].r == DTR_OK);
    zbig_run(b, 2);
    after = rss_bytes();
    for (r = 0; r < 2; r++) CHECK(b[r].r == DTR_OK);
    printf("    resident: %.1f MiB sharded, %.1f with the whole models gathered, %.1f after the step released the "
           "other shards\n", before / 1048576.0, again / 1048576.0, after / 1048576.0);
    CHECK_MSG(again - before >= half * 9 / 10, "gathered %lld bytes, want about %lld", again - before, half);
    CHECK_MSG(again - after >= half * 9 / 10, "released %lld bytes, want about %lld", again - after, half);
    zbig_steps(b, 0.0, 0.02);   /* forward and backward gather the other shard; released after */
    zbig_free(b);
    dtr_local_world_destroy(w);
#else
    printf("  SKIPPED (loudly): resident memory is read from /proc (Linux)\n");
#endif
}

/* ZeRO-2 with zero2_release_grads: the other shard's gradients go back to the system once
   sent, the parameters stay whole; and 12 steps (clipping, accumulation) still give every
   rank plain DP's weights, worlds 2 to 4 */
static void test_zero2_release(void) {
    static zrank plain[4], z[4];
    zrun a;
    int world, r;
#if defined(__linux__)
    static zbig b[2];
    dtr_local_world *w = NULL;
    CHECK_OK(NULL, dtr_local_world_create(2, NULL, &w));
    zbig_make(b, w, 2);
    zbig_steps(b, 0.98, 1.0);
    zbig_free(b);
    dtr_local_world_destroy(w);
#else
    printf("  SKIPPED (loudly): residency is read with mincore (Linux); the weights are checked\n");
#endif
    memset(&a, 0, sizeof a);
    for (world = 2; world <= 4; world++) {
        a.world = world, a.kind = DTR_OPT_ADAMW, a.zero = 0, a.release = 0;
        zrun_world(&a, plain);
        a.zero = 2, a.release = 1;
        zrun_world(&a, z);
        for (r = 0; r < world; r++) {
            double e = rel_err(z[r].params, plain[0].params, plain[0].numel);
            CHECK_MSG(plain[r].ok && z[r].ok, "world %d rank %d: %s %s", world, r, plain[r].msg, z[r].msg);
            CHECK_MSG(e <= 1e-6, "world %d rank %d: relative error %g against plain DP", world, r, e);
        }
    }
}

/* world 3: after dtr_dp_finish each rank's shard of the gradients is plain DP's average, and
   the rank sent the gradients outside its shard */
static void test_zero_loss_scaler(void) {
    static zrank plain[3], z[3];
    zrun a, b;
    int zero, r;
    memset(&a, 0, sizeof a);
    a.world = 3, a.kind = DTR_OPT_SGD, a.scaler = 1;
    zrun_world(&a, plain);
    for (r = 0; r < 3; r++) CHECK_MSG(plain[r].ok && plain[r].skipped == 1, "plain DP rank %d: %s, skipped %lld", r,
                                      plain[r].msg, (long long)plain[r].skipped);
    for (zero = 1; zero <= 2; zero++) {
        b = a;
        b.zero = zero;
        zrun_world(&b, z);
        CHECK(z[2].shard_end == plain[0].numel && z[2].shard_begin < plain[0].numel - 1);
        for (r = 0; r < 3; r++) {
            double e = rel_err(z[r].params, plain[0].params, plain[0].numel);
            CHECK_MSG(z[r].ok && z[r].skipped == 1, "ZeRO-%d rank %d: %s, skipped %lld (plain DP: 1)", zero, r, z[r].msg,
                      (long long)z[r].skipped);
            CHECK_MSG(e <= 1e-6, "ZeRO-%d rank %d: relative error %.3g against plain DP", zero, r, e);
            /* one group sum per step: the scaler's check hands its norm to the clipping */
            CHECK_MSG(z[r].sums == STEPS, "ZeRO-%d rank %d: %d shard sums in %d steps", zero, r, z[r].sums, STEPS);
        }
    }
}

static void check_zero_grads(int zero) {
    static zrank plain[3], z[3];
    zrun a, b;
    int r;
    memset(&a, 0, sizeof a);
    a.world = 3, a.kind = DTR_OPT_ADAMW, a.grads_only = 1;
    b = a;
    b.zero = zero;
    zrun_world(&a, plain);
    zrun_world(&b, z);
    CHECK_EQ_INT(z[0].shard_begin, 0);
    CHECK_EQ_INT(z[2].shard_end, plain[0].numel);
    for (r = 0; r < 3; r++) {
        int64_t sb = z[r].shard_begin, n = z[r].shard_end - sb;
        CHECK_MSG(plain[r].ok && z[r].ok, "rank %d: %s %s", r, plain[r].msg, z[r].msg);
        CHECK(n > 0 && (r == 0 || sb == z[r - 1].shard_end));
        CHECK_MSG(rel_err(z[r].grads + sb, plain[0].grads + sb, n) <= 1e-6, "ZeRO-%d rank %d: shard gradients differ", zero, r);
        CHECK_EQ_INT((int64_t)z[r].stats.wire_bytes, (plain[0].numel - n) * (int64_t)sizeof(float));
        CHECK_EQ_INT((int64_t)z[r].stats.raw_bytes, plain[0].numel * (int64_t)sizeof(float));
    }
    /* outside its shard a rank keeps its own gradients, not the average */
    CHECK(rel_err(z[0].grads + z[1].shard_begin, plain[0].grads + z[1].shard_begin,
                  z[1].shard_end - z[1].shard_begin) > 1e-3);
}

/* stages 1 and 2 reduce-scatter (stage 1 once after backward, stage 2 by bucket during it) */
static void test_zero_grads(void) {
    int zero;
    for (zero = 1; zero <= 2; zero++) check_zero_grads(zero);
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
        CHECK_EQ_INT(test_moment_bytes(part) * 4, test_moment_bytes(whole));
        dtr_optimizer_destroy(part);
        dtr_optimizer_destroy(whole);
        dtr_model_destroy(m);
        dtr_context_destroy(ctx);
    }
}

/* 16-bit slices against f32 ZeRO and plain DP */
static void test_zero_half(void) {
    static const dtr_optimizer_kind kinds[2] = {DTR_OPT_SGD, DTR_OPT_ADAMW};
    static zrank plain[3], full[3], half[3];
    zrun a;
    int world, k, zero, h, r;
    memset(&a, 0, sizeof a);
    for (world = 2; world <= 3; world++)
        for (k = 0; k < 2; k++) {
            a.world = world, a.kind = kinds[k], a.zero = 0, a.compress = DTR_COMPRESS_NONE;
            zrun_world(&a, plain);
            for (zero = 1; zero <= 3; zero++) {
                a.zero = zero, a.compress = DTR_COMPRESS_NONE;
                zrun_world(&a, full);
                for (h = 0; h < 2; h++) {
                    double e, tol = h ? 2e-3 : 1e-2;
                    a.compress = h ? DTR_COMPRESS_FP16 : DTR_COMPRESS_BF16;
                    zrun_world(&a, half);
                    for (r = 0; r < world; r++) CHECK_MSG(half[r].ok, "rank %d: %s", r, half[r].msg);
                    if (!half[0].ok || !plain[0].ok || !full[0].ok) continue;
                    e = rel_err(half[0].params, plain[0].params, plain[0].numel);
                    CHECK_MSG(e <= tol && e > 0.0, "world %d opt %d ZeRO-%d %s: relative error %g against f32 DP", world, (int)kinds[k],
                              zero, h ? "fp16" : "bf16", e);
                    for (r = 1; r < world; r++)
                        CHECK(half[r].ok && memcmp(half[r].params, half[0].params, (size_t)half[0].numel * sizeof(float)) == 0);
                    /* the gradient slices in half the bytes (the parameters' gather stays f32) */
                    CHECK_MSG(full[0].stats.wire_bytes - half[0].stats.wire_bytes ==
                                  (uint64_t)full[0].stats.syncs * (uint64_t)(full[0].numel - (full[0].shard_end - full[0].shard_begin)) * 2,
                              "%s wire bytes %llu, f32 ZeRO %llu", h ? "fp16" : "bf16",
                              (unsigned long long)half[0].stats.wire_bytes, (unsigned long long)full[0].stats.wire_bytes);
                }
            }
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
    dc.zero = 2;   /* a group of 1: the whole buffer, nothing to sum over */
    CHECK_OK(n.ctx, dtr_dp_create(n.m, c, &dc, &dp));
    oc.shard_sum_user = &oc;
    CHECK_OK(n.ctx, dtr_dp_shard_optimizer(dp, &oc));
    CHECK(oc.shard_begin == 0 && oc.shard_end == dtr_model_numel(n.m) && !oc.shard_sum && !oc.shard_sum_user);
    CHECK_EQ_INT(dtr_dp_shard_optimizer(dp, NULL), DTR_NULL_HANDLE);
    CHECK_EQ_INT(dtr_dp_shard_optimizer(NULL, &oc), DTR_NULL_HANDLE);
    dtr_dp_destroy(dp);
    dp = NULL;
    oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    dc.zero = 3;   /* a group of 1: nothing sharded, nothing gathered */
    CHECK_OK(n.ctx, dtr_dp_create(n.m, c, &dc, &dp));
    CHECK_OK(n.ctx, dtr_dp_gather_params(dp));
    CHECK_OK(n.ctx, mlp_backward(&n, 0, 0, B));
    dtr_dp_destroy(dp);
    dp = NULL;
    CHECK_EQ_INT(dtr_dp_gather_params(NULL), DTR_NULL_HANDLE);
    dc.zero = 4;
    CHECK_EQ_INT(dtr_dp_create(n.m, c, &dc, &dp), DTR_INVALID_ARGUMENT);
    dtr_context_clear_error(n.ctx);
    dc.zero = 3, dc.zero3_units = -1;
    CHECK_EQ_INT(dtr_dp_create(n.m, c, &dc, &dp), DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_context_last_error(n.ctx), "zero3_units") != NULL);
    dtr_context_clear_error(n.ctx);
    dc.zero3_units = 0;
    dc.zero = 1, dc.zero2_release_grads = 1;   /* ZeRO-2's option on another stage */
    CHECK_EQ_INT(dtr_dp_create(n.m, c, &dc, &dp), DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_context_last_error(n.ctx), "zero2_release_grads") != NULL);
    dtr_context_clear_error(n.ctx);
    dc.zero2_release_grads = 0;
    dc.zero = 1, dc.compress = DTR_COMPRESS_INT8;
    CHECK_EQ_INT(dtr_dp_create(n.m, c, &dc, &dp), DTR_UNSUPPORTED);
    dtr_context_clear_error(n.ctx);
    dc.zero = 2, dc.compress = DTR_COMPRESS_NONE, dc.local_sgd_every = 2;
    CHECK_EQ_INT(dtr_dp_create(n.m, c, &dc, &dp), DTR_UNSUPPORTED);
    CHECK(strstr(dtr_context_last_error(n.ctx), "ZeRO-2") != NULL);
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
    RUN(test_zero_lamb_mixed);
    RUN(test_zero3_units);
    RUN(test_zero3_memory);
    RUN(test_zero2_release);
    RUN(test_zero_grads);
    RUN(test_zero_loss_scaler);
    RUN(test_zero_memory);
    RUN(test_zero_half);
    RUN(test_zero_errors);
    return test_summary();
}
