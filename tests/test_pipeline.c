/* tests/test_pipeline.c: pipeline parallelism on thread ranks (local transport).
 *   test_pipe_equivalence  2 and 4 stages, GPipe and 1F1B, 1, 4 and 8 micro-batches, and the
 *                          interleaved schedule (2 ranks x 2 chunks): 20 steps of SGD with
 *                          momentum give the weights of one rank training the whole model on
 *                          the whole batch (relative error <= 1e-5), and every rank reports
 *                          the reference's loss
 *   test_pipe_uneven       16 samples in 3 micro-batches (5, 5, 6): weighted by their size,
 *                          still the reference's weights
 *   test_pipe_grid         data 2 x pipeline 2 (1F1B, and interleaved 2 chunks, and 1F1B with
 *                          ZeRO-2, and with ZeRO-3, over the replicas) on 4 ranks,
 *                          data 2 x pipeline 2 x tensor 2 on 8 ranks and pipeline 2 x
 *                          tensor 2 (column- then row-parallel blocks) laid out by
 *                          dtr_grid_create: the reference's weights (shards against their
 *                          slices)
 *   test_pipe_clip         clip_norm 0.05 (every step clips) with dtr_pipe_optimizer_config: 2
 *                          and 4 stages, interleaved, data 2 x pipeline 2 with ZeRO-2, data 2
 *                          x pipeline 2 x tensor 2 and pipeline 2 x tensor 2 give the clipped
 *                          reference's weights (each stage, or tensor-parallel rank, clipping
 *                          by its own norm does not: the case fails without the sums)
 *   test_pipe_bf16         bf16 activations: the stages exchange bf16 (fewer bytes; gradients
 *                          f32) and end with the weights of one rank training in bf16
 *   test_pipe_memory       4 stages, 8 micro-batches: 1F1B keeps at most 4 micro-batches of
 *                          activations alive on stage 0 and GPipe 8; the arena peaks follow
 *   test_pipe_keep         dtr_model_keep: kept parameters start from the whole model's
 *                          values; a left-out one is refused by name
 *   test_pipe_errors       bad configurations; a forward returning NULL on the middle stage
 *                          fails there and gives DTR_PEER_FAILED on the others within the
 *                          deadline; an i32 activation and a malformed activation header
 *                          are refused */
#define _DEFAULT_SOURCE   /* POSIX 2008, and MAP_ANONYMOUS for tests/devsim.h */
#define DTRAIN_INTERNAL_API
#include <pthread.h>
#include "test.h"
#include "pipe_model.h"
#include "devsim.h"

#define STEPS 20
#define PM_CLIP 0.05f   /* below the reference's gradient norms: every step clips */

typedef struct pipe_run {
    dtr_pipe_schedule schedule;
    int stages, chunks, microbatches, steps, fail_rank, bogus;
    int fail_i32;      /* the failing rank returns an i32 tensor instead of NULL */
    int dp;            /* > 1: a data x pipeline grid of dp * stages ranks */
    int tp;            /* > 1: and tensor-parallel blocks over groups of tp ranks */
    int zero;          /* with dp: the replicas' ZeRO stage */
    int devsim;        /* the ranks' models on the simulated device (tests/devsim.h) */
    float clip;        /* the optimizer's clip_norm (0: none) */
} pipe_run;

typedef struct rank_out {
    pthread_t tid;
    dtr_local_world *w;
    const pipe_run *run;
    int rank;
    dtr_result result;
    char msg[512];
    double rel_error, seconds;
    float loss;
    dtr_pipe_stats stats;
    size_t peak;
} rank_out;

static dtr_model *g_ref_model;
static float g_ref_loss;

static dtr_tensor *failing_forward(void *user, dtr_context *ctx, int chunk, int mb, dtr_tensor *input) {
    int64_t n = 4;
    (void)chunk, (void)mb, (void)input;
    if (((const pipe_run *)user)->fail_i32) return dtr_tensor_zeros(ctx, DTR_I32, 1, &n);
    dtr_tensor_new(ctx, DTR_F32, -1, NULL);  /* records an error on ctx and returns NULL */
    return NULL;
}

/* the rank sends a header with ndim 99 where rank 1 expects an activation */
static void send_bogus(dtr_comm *c) {
    int64_t hdr[1 + DTR_MAX_DIMS] = {99};
    dtr_comm_send(c, hdr, sizeof hdr, 1, 1 << 24);
}

static dtr_result train(rank_out *o, dtr_context *ctx, dtr_comm *world) {
    const pipe_run *run = o->run;
    dtr_model *m = NULL;
    dtr_optimizer *opt = NULL;
    dtr_optimizer_config oc = dtr_optimizer_config_init(DTR_OPT_SGD, 0.1f);
    dtr_pipe_config pc = dtr_pipe_config_init();
    dtr_grid g;
    dtr_comm *c = world;
    dtr_dp *dp = NULL;
    pm_model pm;
    pm_stage st;
    int dps = run->dp > 1 ? run->dp : 1, tps = run->tp > 1 ? run->tp : 1;
    dtr_result r = dtr_grid_create(world, dps, run->stages / run->chunks, tps, &g, o->msg, sizeof o->msg);
    if (r != DTR_OK) return r;
    if (dps > 1 || tps > 1) c = g.pp;
    if (run->bogus && o->rank == 0) {
        send_bogus(c);
        dtr_grid_destroy(&g);
        return DTR_OK;
    }
    memset(&pm, 0, sizeof pm);
    pm.stages = run->stages, pm.P = dtr_comm_size(c), pm.rank = dtr_comm_rank(c);
    pm.offset = g.dp_rank * (PM_BATCH / dps);
    pm.tp = tps > 1 ? g.tp : NULL;
    oc.momentum = 0.9f;
    oc.clip_norm = run->clip;
    pc.schedule = run->schedule, pc.chunks = run->chunks, pc.microbatches = run->microbatches;
    pc.batch = PM_BATCH / dps, pc.forward = o->rank == run->fail_rank ? failing_forward : pm_forward;
    pc.user = o->rank == run->fail_rank ? (void *)run : (void *)&st;
    r = dtr_model_create(ctx, 7, &m);
    if (r == DTR_OK) r = pm_declare(&pm, m);
    if (r == DTR_OK) r = pm_keep(&pm, run->chunks);
    if (r == DTR_OK && dps > 1) {
        dtr_dp_config dc = dtr_dp_config_init();
        dc.zero = run->zero;
        r = dtr_dp_create(m, g.dp, &dc, &dp);
        if (r == DTR_OK) r = dtr_dp_shard_optimizer(dp, &oc);   /* this replica's shard (ZeRO) */
    }
    pc.dp = dp;
    if (r == DTR_OK) r = dtr_pipe_create(m, c, &pc, &st.pipe);
    if (r == DTR_OK) r = dtr_pipe_optimizer_config(st.pipe, &oc);   /* the norm over the stages */
    if (r == DTR_OK) r = dtr_optimizer_create(m, &oc, &opt);
    st.pm = &pm;
    for (pm.step = 0; r == DTR_OK && pm.step < run->steps; pm.step++) {
        r = dtr_pipe_step(st.pipe, &o->loss);
        if (r == DTR_OK) r = dtr_optimizer_step(opt, NULL);
        if (r == DTR_OK && dp) r = dtr_dp_step_done(dp);
        dtr_context_reset(ctx);
    }
    if (r == DTR_OK && dp) r = dtr_dp_gather_params(dp);   /* ZeRO-3: the whole stage on every replica */
    dtr_pipe_get_stats(st.pipe, &o->stats);
    o->peak = dtr_context_arena_peak(ctx, 0);
    if (r == DTR_OK && g_ref_model) o->rel_error = pm_max_rel_error_tp(m, g_ref_model, g.tp_rank);
    dtr_pipe_destroy(st.pipe);
    dtr_dp_destroy(dp);
    dtr_optimizer_destroy(opt);
    dtr_model_destroy(m);
    dtr_grid_destroy(&g);
    return r;
}

static void *rank_main(void *arg) {
    rank_out *o = (rank_out *)arg;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_comm *c = NULL;
    int64_t t0 = dtr_time_ns();
    cc.threads = 1;
    cc.backend = o->run->devsim ? devsim_backend() : NULL;
    cc.activation_dtype = pm_act;
    if (dtr_context_create(&cc, &ctx) != DTR_OK) { o->result = DTR_OUT_OF_MEMORY; return NULL; }
    cfg.local.world = o->w;
    cfg.local.rank = o->rank;
    cfg.timeout_ms = o->run->fail_rank >= 0 || o->run->bogus ? 2000 : 30000;
    o->result = dtr_comm_create(&cfg, &c, o->msg, sizeof o->msg);
    if (o->result == DTR_OK) o->result = train(o, ctx, c);
    if (o->result != DTR_OK && !o->msg[0]) snprintf(o->msg, sizeof o->msg, "%s", dtr_context_last_error(ctx));
    o->seconds = (double)(dtr_time_ns() - t0) * 1e-9;
    dtr_comm_destroy(c);
    dtr_context_destroy(ctx);
    return NULL;
}

static void run_pipeline(const pipe_run *run, rank_out *o) {
    dtr_local_world *w = NULL;
    int P = run->stages / run->chunks * (run->dp > 1 ? run->dp : 1) * (run->tp > 1 ? run->tp : 1), r;
    if (dtr_local_world_create(P, NULL, &w) != DTR_OK) { CHECK(0); return; }
    for (r = 0; r < P; r++) {
        memset(&o[r], 0, sizeof o[r]);
        o[r].w = w, o[r].run = run, o[r].rank = r;
        pthread_create(&o[r].tid, NULL, rank_main, &o[r]);
    }
    for (r = 0; r < P; r++) pthread_join(o[r].tid, NULL);
    dtr_local_world_destroy(w);
}

static void check_equivalent(const pipe_run *run) {
    rank_out o[8];
    int P = run->stages / run->chunks * (run->dp > 1 ? run->dp : 1) * (run->tp > 1 ? run->tp : 1), r;
    run_pipeline(run, o);
    for (r = 0; r < P; r++) {
        CHECK_MSG(o[r].result == DTR_OK, "%s S=%d M=%d rank %d: %s", dtr_pipe_schedule_name(run->schedule), run->stages,
                  run->microbatches, r, o[r].msg);
        CHECK_MSG(o[r].rel_error <= 1e-5, "%s S=%d M=%d rank %d: relative error %g", dtr_pipe_schedule_name(run->schedule),
                  run->stages, run->microbatches, r, o[r].rel_error);
        if (run->dp > 1) continue;  /* each replica reports the loss of its share */
        CHECK_MSG(fabsf(o[r].loss - g_ref_loss) <= 1e-5f * (1.0f + fabsf(g_ref_loss)), "rank %d loss %g vs %g", r,
                  (double)o[r].loss, (double)g_ref_loss);
    }
}

/* the reference's weights after STEPS steps, and its loss at the last step */
static void make_reference(void) {
    static dtr_context *ctx;
    if (!g_ref_model) CHECK(pm_reference(STEPS, 0.0f, &ctx, &g_ref_model, &g_ref_loss) == DTR_OK);
}

/* clip_norm on every stage (dtr_pipe_optimizer_config): the norm is the whole model's, so the
   stages clip as one rank training the whole model does (each stage's own norm would not) */
static void test_pipe_clip(void) {
    dtr_context *ctx = NULL;
    dtr_model *whole = NULL, *plain = g_ref_model;
    float loss = 0.0f, plain_loss = g_ref_loss;
    pipe_run run;
    make_reference();
    plain = g_ref_model, plain_loss = g_ref_loss;
    if (pm_reference(STEPS, PM_CLIP, &ctx, &whole, &loss) != DTR_OK) { CHECK(0); return; }
    CHECK_MSG(pm_max_rel_error(whole, plain) > 1e-2, "clip_norm %g does not clip the reference", (double)PM_CLIP);
    g_ref_model = whole, g_ref_loss = loss;
    memset(&run, 0, sizeof run);
    run.steps = STEPS, run.fail_rank = -1, run.chunks = 1, run.microbatches = 4, run.clip = PM_CLIP;
    run.schedule = DTR_PIPE_1F1B, run.stages = 2;
    check_equivalent(&run);
    run.stages = 4;
    check_equivalent(&run);
    run.schedule = DTR_PIPE_INTERLEAVED, run.chunks = 2;
    check_equivalent(&run);
    run.schedule = DTR_PIPE_1F1B, run.chunks = 1, run.stages = 2, run.dp = 2, run.zero = 2;   /* and ZeRO's shard_sum */
    check_equivalent(&run);
    run.zero = 0, run.tp = 2;   /* data 2 x pipeline 2 x tensor 2: the shards summed over the tensor group */
    check_equivalent(&run);
    run.dp = 1;
    check_equivalent(&run);
    g_ref_model = plain, g_ref_loss = plain_loss;
    dtr_model_destroy(whole);
    dtr_context_destroy(ctx);
}

static void test_pipe_equivalence(void) {
    static const int ms[3] = {1, 4, 8};
    pipe_run run;
    int s, k, sched;
    make_reference();
    memset(&run, 0, sizeof run);
    run.steps = STEPS, run.fail_rank = -1, run.chunks = 1;
    for (s = 2; s <= 4; s += 2)
        for (sched = 0; sched < 2; sched++)
            for (k = 0; k < 3; k++) {
                run.stages = s, run.schedule = sched ? DTR_PIPE_1F1B : DTR_PIPE_GPIPE, run.microbatches = ms[k];
                check_equivalent(&run);
            }
    run.schedule = DTR_PIPE_INTERLEAVED, run.stages = 4, run.chunks = 2;
    for (k = 2; k <= 8; k *= 2) {
        run.microbatches = k;
        check_equivalent(&run);
    }
}

/* the ranks' models in (simulated) device memory: activations and gradients go through the
   slots' host copies, the data-parallel gradients through the engine's staging buffer, and
   the weights are those of the CPU reference */
static void test_pipe_devsim(void) {
    pipe_run run;
    make_reference();
    memset(&run, 0, sizeof run);
    run.steps = STEPS, run.fail_rank = -1, run.chunks = 1, run.devsim = 1, run.microbatches = 4;
    run.schedule = DTR_PIPE_1F1B, run.stages = 2;
    check_equivalent(&run);
    run.schedule = DTR_PIPE_INTERLEAVED, run.stages = 4, run.chunks = 2;
    check_equivalent(&run);
    run.schedule = DTR_PIPE_1F1B, run.stages = 2, run.chunks = 1, run.dp = 2;
    check_equivalent(&run);
    CHECK_EQ_INT(devsim__violations, 0);
}

/* bf16 activations: the stages' outputs cross as stored (bf16: half the activation bytes; the
   gradients stay f32) and the weights are those of one rank training the whole model with bf16
   activations, nowhere near f32's; also with the models on the simulated device */
static void test_pipe_bf16(void) {
    dtr_context *ctx = NULL;
    dtr_model *ref = NULL, *plain;
    float loss = 0.0f, plain_loss;
    int64_t bytes[2] = {0, 0};
    rank_out o[2];
    pipe_run run;
    int k, r;
    make_reference();
    plain = g_ref_model, plain_loss = g_ref_loss;
    memset(&run, 0, sizeof run);
    run.steps = STEPS, run.fail_rank = -1, run.chunks = 1, run.microbatches = 4, run.schedule = DTR_PIPE_1F1B;
    run.stages = 2;
    for (k = 0; k < 2; k++) {
        pm_act = k ? DTR_BF16 : DTR_F32;
        if (k && pm_reference(STEPS, 0.0f, &ctx, &ref, &loss) == DTR_OK) {
            printf("  bf16 reference: %.3g from f32's weights\n", pm_max_rel_error(ref, plain));
            CHECK(pm_max_rel_error(ref, plain) > 1e-4);
            g_ref_model = ref, g_ref_loss = loss;
        }
        run_pipeline(&run, o);
        for (r = 0; r < 2; r++) {
            CHECK_MSG(o[r].result == DTR_OK, "%s activations, rank %d: %s", k ? "bf16" : "f32", r, o[r].msg);
            CHECK_MSG(o[r].rel_error <= (k ? 1e-4 : 1e-5), "%s activations, rank %d: relative error %g", k ? "bf16" : "f32",
                      r, o[r].rel_error);
        }
        bytes[k] = o[0].stats.bytes_sent;
    }
    run.devsim = 1;   /* and through the slots' host copies of a device model */
    run_pipeline(&run, o);
    for (r = 0; r < 2; r++)
        CHECK_MSG(o[r].result == DTR_OK && o[r].rel_error <= 1e-4, "bf16 activations on the simulated device, rank %d: %s "
                  "(relative error %g)", r, o[r].msg, o[r].rel_error);
    CHECK_EQ_INT(devsim__violations, 0);
    pm_act = DTR_F32;
    printf("  stage 0 sent %lld bytes with f32 activations, %lld with bf16\n", (long long)bytes[0], (long long)bytes[1]);
    CHECK(bytes[1] > 0 && bytes[1] < bytes[0]);
    g_ref_model = plain, g_ref_loss = plain_loss;
    dtr_model_destroy(ref);
    dtr_context_destroy(ctx);
}

static void test_pipe_uneven(void) {
    pipe_run run;
    make_reference();
    memset(&run, 0, sizeof run);
    run.steps = STEPS, run.fail_rank = -1, run.chunks = 1, run.stages = 2, run.microbatches = 3;
    run.schedule = DTR_PIPE_1F1B;
    check_equivalent(&run);
}

/* data 2 x pipeline 2 on 4 ranks (dtr_grid_create), each replica half the batch: the
   replicas' all-reduce runs in the last micro-batch's backward */
static void test_pipe_grid(void) {
    pipe_run run;
    make_reference();
    memset(&run, 0, sizeof run);
    run.steps = STEPS, run.fail_rank = -1, run.chunks = 1, run.stages = 2, run.microbatches = 4, run.dp = 2;
    run.schedule = DTR_PIPE_1F1B;
    check_equivalent(&run);
    run.schedule = DTR_PIPE_INTERLEAVED, run.chunks = 2, run.stages = 4;
    check_equivalent(&run);
    /* ZeRO-2 over the replicas of each stage */
    run.schedule = DTR_PIPE_1F1B, run.chunks = 1, run.stages = 2, run.zero = 2;
    check_equivalent(&run);
    run.zero = 3;   /* ZeRO-3: each micro-batch's forward and backward gather the stage's units */
    check_equivalent(&run);
    run.zero = 0;
    /* data 2 x pipeline 2 x tensor 2 on 8 ranks, then pipeline 2 x tensor 2 */
    run.schedule = DTR_PIPE_1F1B, run.chunks = 1, run.stages = 2, run.tp = 2;
    check_equivalent(&run);
    run.dp = 1;
    check_equivalent(&run);
}

static void test_pipe_memory(void) {
    pipe_run run;
    rank_out g[4], f[4];
    memset(&run, 0, sizeof run);
    run.steps = 2, run.fail_rank = -1, run.chunks = 1, run.stages = 4, run.microbatches = 8;
    run.schedule = DTR_PIPE_GPIPE;
    run_pipeline(&run, g);
    run.schedule = DTR_PIPE_1F1B;
    run_pipeline(&run, f);
    CHECK(g[0].result == DTR_OK && f[0].result == DTR_OK);
    CHECK_EQ_INT(g[0].stats.max_live, 8);
    CHECK_EQ_INT(f[0].stats.max_live, 4);   /* P - rank on rank 0 */
    CHECK_EQ_INT(f[3].stats.max_live, 1);   /* the last stage frees each micro-batch at once */
    /* activations dominate the arena: 4 of 8 micro-batches alive is about half the peak */
    CHECK_MSG(f[0].peak < g[0].peak, "1F1B %zu, GPipe %zu", f[0].peak, g[0].peak);
    CHECK_MSG((double)f[0].peak <= 0.6 * (double)g[0].peak, "1F1B %zu, GPipe %zu", f[0].peak, g[0].peak);
    CHECK(f[0].stats.bubble_theory > 0.27 && f[0].stats.bubble_theory < 0.28);   /* 3 / 11 */
}

static void test_pipe_keep(void) {
    dtr_context *ctx = test_ctx(1);
    dtr_model *whole = NULL, *part = NULL;
    pm_model a, b;
    static const char *keep[1] = {"b2."};
    int64_t s[2] = {2, PM_H};
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    CHECK_OK(ctx, dtr_model_create(ctx, 7, &whole));
    CHECK_OK(ctx, dtr_model_create(ctx, 7, &part));
    CHECK_OK(ctx, pm_declare(&a, whole));
    CHECK_OK(ctx, pm_declare(&b, part));
    CHECK_OK(ctx, dtr_model_keep(part, keep, 1));
    CHECK_OK(ctx, dtr_model_build(whole));
    CHECK_OK(ctx, dtr_model_build(part));
    CHECK_EQ_INT(dtr_model_param_count(part), 2);
    CHECK(pm_max_rel_error(part, whole) == 0.0);
    CHECK(dtr_model_numel(part) < dtr_model_numel(whole));
    CHECK(dtr_linear_layer_forward(ctx, &b.l[1], dtr_tensor_zeros(ctx, DTR_F32, 2, s)) == NULL);
    CHECK_EQ_INT(dtr_context_status(ctx), DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_context_last_error(ctx), "b1.l.weight") != NULL);
    dtr_context_clear_error(ctx);
    CHECK_EQ_INT(dtr_model_keep(part, keep, 1), DTR_BAD_STATE);
    dtr_model_destroy(part);
    dtr_model_destroy(whole);
    dtr_context_destroy(ctx);
}

static void test_pipe_errors(void) {
    static const struct { dtr_pipe_schedule s; int chunks, mb; int64_t batch; const char *says; } bad[] = {
        {DTR_PIPE_1F1B, 1, 0, 0, "micro-batches"},
        {DTR_PIPE_1F1B, 2, 4, 0, "chunks"},
        {DTR_PIPE_INTERLEAVED, 1, 4, 0, "chunks"},
        {DTR_PIPE_INTERLEAVED, 2, 3, 0, "divisible"},
        {DTR_PIPE_GPIPE, 1, 8, 4, "cannot make"},
    };
    dtr_local_world *w = NULL;
    dtr_comm_config cc = dtr_comm_config_init();
    dtr_context *ctx = test_ctx(1);
    dtr_comm *c = NULL;
    dtr_model *m = NULL;
    dtr_pipe *p = NULL;
    pipe_run run;
    rank_out o[3];
    int i, r;
    /* configurations, checked before anything is sent (a group of 1 is enough; P = 2 is
       claimed through the interleaved check's rank count only where it matters) */
    CHECK(dtr_local_world_create(1, NULL, &w) == DTR_OK);
    cc.local.world = w;
    CHECK(dtr_comm_create(&cc, &c, NULL, 0) == DTR_OK);
    CHECK_OK(ctx, dtr_model_create(ctx, 1, &m));
    for (i = 0; i < (int)(sizeof bad / sizeof bad[0]); i++) {
        dtr_pipe_config pc = dtr_pipe_config_init();
        pc.schedule = bad[i].s, pc.chunks = bad[i].chunks, pc.microbatches = bad[i].mb, pc.batch = bad[i].batch;
        pc.forward = pm_forward;
        CHECK_EQ_INT(dtr_pipe_create(m, c, &pc, &p), DTR_INVALID_ARGUMENT);
        CHECK_MSG(strstr(dtr_context_last_error(ctx), bad[i].says) != NULL, "case %d: %s", i, dtr_context_last_error(ctx));
        CHECK(p == NULL);
        dtr_context_clear_error(ctx);
    }
    {
        dtr_pipe_config pc = dtr_pipe_config_init();
        CHECK_EQ_INT(dtr_pipe_create(m, c, &pc, &p), DTR_NULL_HANDLE);   /* no forward */
        dtr_context_clear_error(ctx);
    }
    dtr_model_destroy(m);
    dtr_comm_destroy(c);
    dtr_local_world_destroy(w);
    dtr_context_destroy(ctx);
    /* the middle stage's forward fails: it reports its own error, the others PEER_FAILED */
    memset(&run, 0, sizeof run);
    run.steps = 3, run.fail_rank = 1, run.chunks = 1, run.stages = 3, run.microbatches = 4, run.schedule = DTR_PIPE_1F1B;
    run_pipeline(&run, o);
    CHECK_MSG(o[1].result == DTR_INVALID_ARGUMENT, "%s", o[1].msg);
    for (r = 0; r < 3; r += 2) {
        CHECK_MSG(o[r].result == DTR_PEER_FAILED, "rank %d: %s (%s)", r, dtr_result_string(o[r].result), o[r].msg);
        CHECK_MSG(o[r].seconds < 1.9, "rank %d took %.2f s (deadline 2 s: the abort should be quicker)", r, o[r].seconds);
    }
    /* the middle stage returns an i32 tensor: refused by dtype, the others fail at once */
    run.fail_i32 = 1;
    run_pipeline(&run, o);
    CHECK_MSG(o[1].result == DTR_DTYPE_MISMATCH && strstr(o[1].msg, "i32"), "%s", o[1].msg);
    CHECK_MSG(o[0].result == DTR_PEER_FAILED && o[2].result == DTR_PEER_FAILED, "%s | %s", o[0].msg, o[2].msg);
    run.fail_i32 = 0;
    /* a malformed header */
    run.fail_rank = -1, run.bogus = 1, run.stages = 2;
    run_pipeline(&run, o);
    CHECK_MSG(o[1].result == DTR_INVALID_ARGUMENT && strstr(o[1].msg, "malformed"), "%s", o[1].msg);
}

int main(void) {
    RUN(test_pipe_equivalence);
    RUN(test_pipe_devsim);
    RUN(test_pipe_bf16);
    RUN(test_pipe_uneven);
    RUN(test_pipe_grid);
    RUN(test_pipe_clip);
    RUN(test_pipe_memory);
    RUN(test_pipe_keep);
    RUN(test_pipe_errors);
    return test_summary();
}
