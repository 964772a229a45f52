/* tests/test_ckpt.c: full-state checkpoints (dtr_ckpt_*, src/engine/checkpoint.c).
 * The rig of each rank: an MLP with dropout (the context's stream), a shuffled, sharded,
 * augmented (horizontal flips) loader, an app object (a random stream scaling the loss),
 * SGD momentum or Adam, data parallel over the local transport (ranks are threads) with or
 * without ZeRO-1, and a checkpointer over all of it.
 *   test_resume_killed   bit-exact resume: a child process trains N steps, checkpoints
 *                        (asynchronously), trains on and is SIGKILLed; the parent restores
 *                        and trains N more: parameters, optimizer state and the next batch
 *                        equal those of 2N uninterrupted steps bit for bit, for 1, 2 and 4
 *                        ranks (4: ZeRO-1 with Adam; 2 more: ZeRO-3 with Adam); the metadata
 *                        comes back
 *   test_crash_while_saving  a child checkpointing every step (keep 2) is SIGKILLed at 50
 *                        random instants (every 5th over 2 ranks): each time the newest
 *                        complete checkpoint restores and verifies
 *   test_corruption      every truncation length class and 100 random bit flips of a
 *                        checkpoint's file or manifest are refused (CORRUPT_FILE / IO_ERROR,
 *                        the message names the file) and leave the live state untouched;
 *                        a missing file; another model's checkpoint (INVALID_ARGUMENT);
 *                        fallback to the previous complete checkpoint; keep-last-K; latest;
 *                        BUSY_SKIP; argument errors
 *   test_resume_fabric   the same with ZeRO-1 and Adam over 1, 2 and 4 processes on libfabric
 *                        (shm; 1: a group of one): the saving processes are SIGKILLed;
 *                        checksums of the outcomes (parameters, moments, the next batch) match
 *   test_world_change    saved on 2 ranks (ZeRO-1, Adam) restores on 1: the moments are the
 *                        two shards joined; saved on 1 restores on 2 with ZeRO: each rank's
 *                        shard is its slice; both train on; a missing shard fails every rank;
 *                        saved on 2 with ZeRO-3 restores on 1 with the whole model */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE   /* MAP_ANONYMOUS */
#include "test.h"
#include "test_util.h"
#include "posix_util.h"
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <dirent.h>
#include <sys/mman.h>

#define N_SAMPLES 64
#define H 4
#define W 6
#define D_IN (H * W)
#define MAXW 4

static float g_x[N_SAMPLES * D_IN];
static int32_t g_y[N_SAMPLES];
static int g_quick;

static void make_data(void) {
    dtr_rng r;
    int i;
    dtr_rng_seed(&r, 5, 1);
    for (i = 0; i < N_SAMPLES * D_IN; i++) g_x[i] = dtr_rng_uniform(&r) * 2.0f - 1.0f;
    for (i = 0; i < N_SAMPLES; i++) g_y[i] = (int32_t)(dtr_rng_u32(&r) % 3);
}

/* ---- the app's own state: a stream that scales each step's loss ---- */

static dtr_result noise_state(void *obj, int index, dtr_state_entry *out) {
    if (index != 0) return DTR_NOT_FOUND;
    out->name = "rng";
    out->data = obj;
    out->bytes = sizeof(dtr_rng);
    out->device = 0;
    return DTR_OK;
}

/* ---- one rank's rig ---- */

typedef struct rig_opts {
    int world, rank, zero, adam, hidden, keep, fallback, sync, skip;
    int freeze;   /* 1: l1 frozen, only l2 trains (and has moments); 2: l1's bias alone frozen */
    dtr_comm *comm;
    const char *dir;
} rig_opts;

typedef struct rig {
    dtr_context *ctx;
    dtr_model *m;
    dtr_optimizer *opt;
    dtr_dataset *ds;
    dtr_loader *ld;
    dtr_dp *dp;
    dtr_ckpt *ck;
    dtr_rng noise;
    dtr_linear_layer l1, l2;
} rig;

static int rig_open(rig *g, const rig_opts *o) {
    dtr_context_config cc = dtr_context_config_init();
    dtr_memory_dataset_config mc = dtr_memory_dataset_config_init();
    dtr_loader_config lc = dtr_loader_config_init();
    dtr_optimizer_config oc = dtr_optimizer_config_init(o->adam ? DTR_OPT_ADAM : DTR_OPT_SGD, 0.05f);
    dtr_dp_config dc = dtr_dp_config_init();
    dtr_ckpt_config kc = dtr_ckpt_config_init();
    const char *l1[1] = {o->freeze == 2 ? "l1.bias" : "l1."};
    memset(g, 0, sizeof *g);
    cc.threads = 1;
    cc.seed = 11 + (uint64_t)o->rank;
    mc.count = N_SAMPLES;
    mc.layout.x_dtype = DTR_F32;
    mc.layout.x_ndim = 3;
    mc.layout.x_shape[0] = 1, mc.layout.x_shape[1] = H, mc.layout.x_shape[2] = W;
    mc.layout.y_dtype = DTR_I32;
    mc.x = g_x;
    mc.y = g_y;
    lc.batch_size = 4;
    lc.shuffle = 1;
    lc.seed = 3;
    lc.rank = o->rank, lc.world = o->world;
    lc.flatten = 1;
    lc.augment.hflip = 1;
    oc.momentum = o->adam ? 0.0f : 0.9f;
    oc.schedule.kind = DTR_SCHED_COSINE;
    oc.schedule.total_steps = 100;
    dc.zero = o->zero;
    dtr_rng_seed(&g->noise, 77, (uint64_t)o->rank);
    if (dtr_context_create(&cc, &g->ctx) != DTR_OK || dtr_model_create(g->ctx, 9, &g->m) != DTR_OK ||
        dtr_linear_layer_init(&g->l1, g->m, "l1", D_IN, o->hidden ? o->hidden : 16, 1, DTR_INIT_TORCH_DEFAULT) != DTR_OK ||
        dtr_linear_layer_init(&g->l2, g->m, "l2", o->hidden ? o->hidden : 16, 3, 1, DTR_INIT_TORCH_DEFAULT) != DTR_OK ||
        dtr_model_build(g->m) != DTR_OK)
        return 0;
    if (o->freeze && dtr_model_set_trainable(g->m, l1, 1, 0) != DTR_OK) return 0;
    if (o->comm && (dtr_dp_create(g->m, o->comm, &dc, &g->dp) != DTR_OK || dtr_dp_shard_optimizer(g->dp, &oc) != DTR_OK))
        return 0;
    if (dtr_optimizer_create(g->m, &oc, &g->opt) != DTR_OK || dtr_dataset_from_memory(&mc, &g->ds, NULL, 0) != DTR_OK ||
        dtr_loader_create(g->ds, &lc, &g->ld, NULL, 0) != DTR_OK)
        return 0;
    kc.dir = o->dir;
    kc.ctx = g->ctx, kc.model = g->m, kc.optimizer = g->opt, kc.loader = g->ld, kc.dp = g->dp;
    kc.comm = o->comm;   /* NULL for one thread; a group of 1 for one process over libfabric */
    kc.keep = o->keep ? o->keep : 3;
    kc.fallback = o->fallback;
    kc.sync = o->sync;
    kc.busy = o->skip ? DTR_CKPT_BUSY_SKIP : DTR_CKPT_BUSY_WAIT;
    return o->dir == NULL || (dtr_ckpt_create(&kc, &g->ck) == DTR_OK &&
                              dtr_ckpt_add_object(g->ck, "noise", &g->noise, noise_state, NULL) == DTR_OK);
}

static void rig_close(rig *g) {
    dtr_ckpt_destroy(g->ck);
    dtr_dp_destroy(g->dp);
    dtr_loader_destroy(g->ld);
    dtr_dataset_destroy(g->ds);
    dtr_optimizer_destroy(g->opt);
    dtr_model_destroy(g->m);
    dtr_context_destroy(g->ctx);
}

/* One training step; returns the loss (NAN on failure). */
static float rig_step(rig *g) {
    dtr_batch b;
    dtr_tensor *x, *y, *h, *loss;
    float v;
    if (dtr_loader_next(g->ld, &b) != DTR_OK || dtr_batch_tensors(g->ctx, &b, &x, &y) != DTR_OK) return NAN;
    h = dtr_dropout(g->ctx, dtr_relu(g->ctx, dtr_linear_layer_forward(g->ctx, &g->l1, x)), 0.25f);
    loss = dtr_cross_entropy(g->ctx, dtr_linear_layer_forward(g->ctx, &g->l2, h), y);
    loss = dtr_scale(g->ctx, loss, 0.5f + dtr_rng_uniform(&g->noise));
    if (dtr_backward(g->ctx, loss) != DTR_OK) return NAN;
    v = dtr_tensor_get(loss, 0);
    if (g->dp && dtr_dp_finish(g->dp) != DTR_OK) return NAN;
    if (dtr_optimizer_step(g->opt, NULL) != DTR_OK) return NAN;
    if (g->dp && dtr_dp_step_done(g->dp) != DTR_OK) return NAN;
    dtr_context_reset(g->ctx);
    return v;
}

/* ---- what a rank ends with: parameters, optimizer moments, the next batch ---- */

typedef struct outcome {
    float *params, *m, *v, *next;
    size_t np, nm, nnext;
    int64_t steps;
} outcome;

static void *dup_bytes(const void *p, size_t n) {
    void *q = malloc(n ? n : 1);
    if (n) memcpy(q, p, n);
    return q;
}

static void record(rig *g, outcome *out) {
    dtr_state_entry e;
    dtr_batch b;
    int i;
    out->np = (size_t)dtr_model_numel(g->m);
    if (g->dp && dtr_dp_gather_params(g->dp) != DTR_OK) return;   /* ZeRO-3: the whole model (every rank records) */
    out->params = (float *)dup_bytes(dtr_model_params(g->m), out->np * sizeof(float));
    out->steps = dtr_optimizer_steps(g->opt);
    for (i = 3; dtr_optimizer_state(g->opt, i, &e) == DTR_OK; i++) {
        if (!strcmp(e.name, "m")) out->m = (float *)dup_bytes(e.data, e.bytes), out->nm = e.bytes / sizeof(float);
        if (!strcmp(e.name, "v")) out->v = (float *)dup_bytes(e.data, e.bytes);
    }
    if (dtr_loader_next(g->ld, &b) == DTR_OK) {
        dtr_tensor *x, *y;
        if (dtr_batch_tensors(g->ctx, &b, &x, &y) == DTR_OK) {
            out->nnext = (size_t)dtr_tensor_numel(x);
            out->next = (float *)dup_bytes(dtr_tensor_data(x), out->nnext * sizeof(float));
        }
        dtr_context_reset(g->ctx);
    }
}

static void outcome_free(outcome *o) {
    free(o->params); free(o->m); free(o->v); free(o->next);
    memset(o, 0, sizeof *o);
}

static int outcome_same(const outcome *a, const outcome *b) {
    return a->np == b->np && a->nm == b->nm && a->nnext == b->nnext && a->steps == b->steps && a->nnext > 0 &&
           memcmp(a->params, b->params, a->np * sizeof(float)) == 0 && memcmp(a->m, b->m, a->nm * sizeof(float)) == 0 &&
           (!a->v || memcmp(a->v, b->v, a->nm * sizeof(float)) == 0) && memcmp(a->next, b->next, a->nnext * sizeof(float)) == 0;
}

/* ---- jobs: every rank of a world runs one as a thread ---- */

enum { JOB_TRAIN, JOB_SAVE_THEN_RUN, JOB_RESTORE_TRAIN, JOB_SAVE_EVERY_STEP, JOB_RESTORE_ONLY };

typedef struct job {
    int mode, world, zero, adam, steps, save_at, freeze;
    const char *dir;
    int signal_fd;                     /* JOB_SAVE_*: rank 0 writes a byte here once a checkpoint is complete */
    dtr_local_world *lw;
    outcome out[MAXW];
    dtr_result result[MAXW];
    int64_t restored_step[MAXW];
    char msg[MAXW][512];
    float loss[MAXW];
    char meta[64];
    int fabric, port;                  /* ranks are processes over libfabric (shm), rendezvous on port */
} job;

typedef struct rank_arg { job *j; int rank; } rank_arg;

static void signal_parent(job *j, int rank) {
    char c = 1;
    if (rank == 0 && j->signal_fd >= 0 && write(j->signal_fd, &c, 1) != 1) perror("write");
}

/* The body of a rank once its rig is open. */
static dtr_result rank_run(job *j, int rank, rig *g) {
    dtr_result r = DTR_OK;
    int t;
    if (j->mode == JOB_RESTORE_TRAIN || j->mode == JOB_RESTORE_ONLY) {
        r = dtr_ckpt_restore(g->ck, NULL, &j->restored_step[rank]);
        if (r == DTR_OK && rank == 0 && dtr_ckpt_get_meta(g->ck, "run")) snprintf(j->meta, sizeof j->meta, "%s", dtr_ckpt_get_meta(g->ck, "run"));
        if (r != DTR_OK || j->mode == JOB_RESTORE_ONLY) return r;
    }
    if (j->mode == JOB_SAVE_THEN_RUN || j->mode == JOB_SAVE_EVERY_STEP) dtr_ckpt_set_meta(g->ck, "run", "killed-child");
    for (t = 0; t < j->steps; t++) {
        j->loss[rank] = rig_step(g);
        if (isnan(j->loss[rank])) return DTR_BAD_STATE;
        if (j->mode == JOB_SAVE_THEN_RUN && t + 1 == j->save_at) {
            if ((r = dtr_ckpt_save(g->ck, t + 1, NULL)) != DTR_OK || (r = dtr_ckpt_wait(g->ck)) != DTR_OK) return r;
            signal_parent(j, rank);
        }
        if (j->mode == JOB_SAVE_EVERY_STEP) {
            if ((r = dtr_ckpt_save(g->ck, t + 1, NULL)) != DTR_OK) return r;
            if (t == 0 && ((r = dtr_ckpt_wait(g->ck)) != DTR_OK)) return r;
            if (t == 0) signal_parent(j, rank);
        }
        if (j->mode == JOB_SAVE_THEN_RUN && t >= j->save_at) sleep_ms(1);   /* until the parent kills us */
    }
    return r;
}

static void *rank_main(void *arg) {
    rank_arg *a = (rank_arg *)arg;
    job *j = a->j;
    dtr_comm_config cfg = dtr_comm_config_init();
    dtr_comm *c = NULL;
    rig_opts o;
    rig g;
    memset(&o, 0, sizeof o);
    o.world = j->world, o.rank = a->rank, o.zero = j->zero, o.adam = j->adam, o.dir = j->dir, o.keep = 2;
    o.freeze = j->freeze;
    dtr_store *st = NULL;
    cfg.local.world = j->lw;
    cfg.local.rank = a->rank;
    cfg.timeout_ms = 20000;
    if (j->fabric) {   /* one process per rank: a rendezvous store, then the libfabric group */
        dtr_rendezvous_config rc = dtr_rendezvous_config_init();
        rc.rank = a->rank, rc.world_size = j->world, rc.port = j->port, rc.timeout_ms = 20000;
        snprintf(rc.secret, sizeof rc.secret, "test-ckpt");
        cfg.transport = "libfabric";
        cfg.fabric.provider = "shm";
        if (dtr_store_create(&rc, &st, j->msg[a->rank], sizeof j->msg[a->rank]) != DTR_OK) {
            j->result[a->rank] = DTR_PEER_FAILED;
            return NULL;
        }
        cfg.store = st;
    }
    if ((j->world > 1 || j->fabric) && dtr_comm_create(&cfg, &c, j->msg[a->rank], sizeof j->msg[a->rank]) != DTR_OK) {
        j->result[a->rank] = DTR_PEER_FAILED;
        dtr_store_destroy(st);
        return NULL;
    }
    o.comm = c;
    if (!rig_open(&g, &o)) {
        j->result[a->rank] = DTR_BAD_STATE;
        snprintf(j->msg[a->rank], sizeof j->msg[a->rank], "rig: %s", dtr_context_last_error(g.ctx));
    } else {
        j->result[a->rank] = rank_run(j, a->rank, &g);
        if (j->result[a->rank] != DTR_OK)
            snprintf(j->msg[a->rank], sizeof j->msg[a->rank], "%s%s%.200s", dtr_ckpt_last_error(g.ck), c ? " | group: " : "",
                     c ? dtr_comm_last_error(c) : "");
        else record(&g, &j->out[a->rank]);
    }
    rig_close(&g);
    if (c && j->fabric) dtr_comm_barrier(c);   /* nobody leaves while the others still talk */
    dtr_comm_destroy(c);
    dtr_store_destroy(st);
    return NULL;
}

static void job_run(job *j) {
    pthread_t tid[MAXW];
    rank_arg ra[MAXW];
    int i;
    j->lw = NULL;
    if (j->world > 1) dtr_local_world_create(j->world, NULL, &j->lw);
    for (i = 0; i < j->world; i++) {
        ra[i].j = j, ra[i].rank = i;
        pthread_create(&tid[i], NULL, rank_main, &ra[i]);
    }
    for (i = 0; i < j->world; i++) pthread_join(tid[i], NULL);
    dtr_local_world_destroy(j->lw);
}

/* ---- ranks as processes (libfabric) ----
 * Each rank is a forked process; what it ends with comes back as checksums of its outcome
 * (parameters, moments, the next batch) through memory shared before the fork. */

typedef struct digest { int result; uint32_t params, m, v, next; int64_t steps, restored; char msg[256]; } digest;

static uint32_t digest_of(const void *p, size_t n) { return p ? dtr_crc32c(0, p, n) : 0; }

static void job_run_procs(job *j, digest *dg) {
    pid_t pid[MAXW];
    int i, st;
    j->port = free_port();
    for (i = 0; i < j->world; i++) {
        fflush(NULL);
        if ((pid[i] = fork()) == 0) {
            rank_arg ra;
            outcome *o = &j->out[i];
            alarm(60);
            ra.j = j, ra.rank = i;
            rank_main(&ra);
            dg[i].result = j->result[i];
            dg[i].params = digest_of(o->params, o->np * 4), dg[i].m = digest_of(o->m, o->nm * 4);
            dg[i].v = digest_of(o->v, o->nm * 4), dg[i].next = digest_of(o->next, o->nnext * 4);
            dg[i].steps = o->steps, dg[i].restored = j->restored_step[i];
            snprintf(dg[i].msg, sizeof dg[i].msg, "%s", j->msg[i]);
            if (j->signal_fd >= 0) close(j->signal_fd);
            _exit(0);
        }
    }
    for (i = 0; i < j->world; i++) waitpid(pid[i], &st, 0);
}

static void job_free(job *j) {
    int i;
    for (i = 0; i < MAXW; i++) outcome_free(&j->out[i]);
}

static job job_make(int mode, int world, int zero, int adam, int steps, const char *dir) {
    job j;
    memset(&j, 0, sizeof j);
    j.mode = mode, j.world = world, j.zero = zero, j.adam = adam, j.steps = steps, j.dir = dir;
    j.signal_fd = -1;
    return j;
}

/* Forks a child that runs j and is SIGKILLed `kill_after_ms` after it signals (< 0: random
   instant in [0, -kill_after_ms) ms). Returns 1 when the child signalled before dying. */
static int run_and_kill(job *j, int kill_after_ms, unsigned *seed) {
    int pfd[2], st, signalled = 0;
    pid_t pid;
    char c;
    if (pipe(pfd) != 0) return 0;
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        alarm(60);
        j->signal_fd = pfd[1];
        job_run(j);
        fprintf(stderr, "child (world %d) ended: %d %d %s / %s\n", j->world, j->result[0], j->result[1], j->msg[0], j->msg[1]);
        _exit(3);   /* finished without being killed: the parent counts it */
    }
    close(pfd[1]);
    if (pid > 0 && read(pfd[0], &c, 1) == 1) signalled = 1;
    if (pid > 0) {
        sleep_ms(kill_after_ms >= 0 ? kill_after_ms : (int)(rand_r(seed) % (unsigned)-kill_after_ms));
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        if (!(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL)) signalled = 0;
    }
    close(pfd[0]);
    return signalled;
}


/* ---- bit-exact resume across a SIGKILL ---- */

static void resume_case(int world, int zero, int adam) {
    char dir[512];
    job base, child, resumed;
    int n = 6, r;
    CHECK(make_tmp_dir("dtr_ckpt_resume", dir, sizeof dir));
    base = job_make(JOB_TRAIN, world, zero, adam, 2 * n, NULL);
    child = job_make(JOB_SAVE_THEN_RUN, world, zero, adam, 100000, dir);
    child.save_at = n;
    resumed = job_make(JOB_RESTORE_TRAIN, world, zero, adam, n, dir);
    CHECK_MSG(run_and_kill(&child, 5, NULL), "world %d: the child did not checkpoint", world);
    job_run(&base);
    job_run(&resumed);
    for (r = 0; r < world; r++) {
        CHECK_MSG(base.result[r] == DTR_OK && resumed.result[r] == DTR_OK, "world %d rank %d: %s / %s", world, r, base.msg[r],
                  resumed.msg[r]);
        CHECK_EQ_INT(resumed.restored_step[r], n);
        CHECK_MSG(outcome_same(&base.out[r], &resumed.out[r]), "world %d zero %d rank %d: resumed run differs from the "
                  "uninterrupted one", world, zero, r);
    }
    CHECK(strcmp(resumed.meta, "killed-child") == 0);
    job_free(&base);
    job_free(&resumed);
    rm_tree(dir);
}

/* The same over libfabric's shm provider with ZeRO-1 and Adam, `w` processes (1: a group of
   one): the saving processes are SIGKILLed. */
static void fabric_case(int w, digest *dg) {
    char dir[256];
    job base, child, resumed;
    int pfd[2], n = 6, r;
    pid_t holder;
    char c;
    memset(dg, 0, 3 * MAXW * sizeof(digest));
    CHECK(pipe(pfd) == 0);
    CHECK(make_tmp_dir("dtr_ckpt_fabric", dir, sizeof dir));
    base = job_make(JOB_TRAIN, w, 1, 1, 2 * n, NULL);
    child = job_make(JOB_SAVE_THEN_RUN, w, 1, 1, 100000, dir);
    resumed = job_make(JOB_RESTORE_TRAIN, w, 1, 1, n, dir);
    base.fabric = child.fabric = resumed.fabric = 1;
    child.save_at = n;
    child.signal_fd = pfd[1];
    job_run_procs(&base, dg);
    fflush(NULL);
    if ((holder = fork()) == 0) {   /* holds the saving ranks: the parent kills its group */
        setpgid(0, 0);
        job_run_procs(&child, dg + MAXW);
        _exit(0);
    }
    close(pfd[1]);
    CHECK_MSG(read(pfd[0], &c, 1) == 1, "world %d: the saving ranks did not checkpoint", w);
    sleep_ms(5);
    kill(-holder, SIGKILL);
    kill(holder, SIGKILL);
    waitpid(holder, NULL, 0);
    sleep_ms(100);   /* the killed ranks' processes (the holder's group) are gone */
    close(pfd[0]);
    job_run_procs(&resumed, dg + 2 * MAXW);
    for (r = 0; r < w; r++) {
        digest *a = &dg[r], *b = &dg[2 * MAXW + r];
        CHECK_MSG(a->result == DTR_OK && b->result == DTR_OK, "fabric world %d rank %d: %s / %s", w, r, a->msg, b->msg);
        CHECK_EQ_INT(b->restored, n);
        CHECK_MSG(a->steps == b->steps && a->params == b->params && a->m == b->m && a->v == b->v && a->next == b->next &&
                  a->next != 0, "fabric world %d rank %d: the resumed run differs (params %08x/%08x m %08x/%08x next "
                  "%08x/%08x)", w, r, a->params, b->params, a->m, b->m, a->next, b->next);
    }
    if (w > 1) CHECK_MSG(dg[0].params == dg[w - 1].params, "fabric world %d: the ranks' parameters differ", w);
    rm_tree(dir);
}

static void test_resume_fabric(void) {
    static const int worlds[3] = {1, 2, 4};
    digest *dg = (digest *)mmap(NULL, 3 * MAXW * sizeof(digest), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int i;
    if (!dtr_transport_find("libfabric")) {
        const char *a = getenv("DTR_ALLOW_SKIP");
        fprintf(stderr, "*** SKIPPED: libfabric not built (dtrain_comm.c without DTR_USE_LIBFABRIC)%s\n",
                a && !strcmp(a, "1") ? "" : ": counted as a FAILURE (DTR_ALLOW_SKIP=1 allows it)");
        CHECK(a && !strcmp(a, "1"));
        return;
    }
    CHECK(dg != MAP_FAILED);
    if (dg == MAP_FAILED) return;
    make_data();
    for (i = 0; i < 3; i++) {
        int64_t t0 = now_ms();
        fabric_case(worlds[i], dg);
        printf("    libfabric (shm), %d process%s: resumed bit for bit (%lld ms)\n", worlds[i], worlds[i] > 1 ? "es" : "",
               (long long)(now_ms() - t0));
    }
    munmap(dg, 3 * MAXW * sizeof(digest));
}

static void test_resume_killed(void) {
    make_data();
    resume_case(1, 0, 0);
    resume_case(2, 0, 0);
    resume_case(4, 1, 1);
    resume_case(2, 3, 1);   /* ZeRO-3: the save gathers the parameters, the restore shards them again */
}

/* ---- crash while saving ---- */

static void test_crash_while_saving(void) {
    char dir[512];
    unsigned seed = 12345;
    int i, n = g_quick ? 10 : 50, ok = 0;
    make_data();
    for (i = 0; i < n; i++) {
        int world = i % 5 == 4 ? 2 : 1;
        job child = job_make(JOB_SAVE_EVERY_STEP, world, 0, 1, 100000, NULL), check;
        CHECK(make_tmp_dir("dtr_ckpt_crash", dir, sizeof dir));
        child.dir = dir;
        if (!run_and_kill(&child, -40, &seed)) { CHECK_MSG(0, "kill %d: the child did not checkpoint", i); continue; }
        check = job_make(JOB_RESTORE_ONLY, world, 0, 1, 0, dir);
        job_run(&check);
        CHECK_MSG(check.result[0] == DTR_OK && check.restored_step[0] >= 1, "kill %d (world %d): %s", i, world, check.msg[0]);
        ok += check.result[0] == DTR_OK;
        job_free(&check);
        rm_tree(dir);
    }
    printf("    %d of %d kills left a complete checkpoint\n", ok, n);
}

/* ---- corruption ---- */

typedef struct live_copy { unsigned char *p; size_t n; } live_copy;

/* Every entry of the rig's state, concatenated (what a failed restore must leave as it was). */
static live_copy live_state(rig *g) {
    live_copy c = {NULL, 0};
    dtr_state_entry e;
    int k, i;
    for (k = 0; k < 5; k++)
        for (i = 0;; i++) {
            dtr_result r = k == 0 ? dtr_context_state(g->ctx, i, &e) : k == 1 ? dtr_model_state(g->m, i, &e)
                         : k == 2 ? dtr_optimizer_state(g->opt, i, &e) : k == 3 ? dtr_loader_state(g->ld, i, &e)
                         : noise_state(&g->noise, i, &e);
            if (r != DTR_OK) break;
            c.p = (unsigned char *)realloc(c.p, c.n + e.bytes);
            memcpy(c.p + c.n, e.data, e.bytes);
            c.n += e.bytes;
        }
    return c;
}

static int live_same(rig *g, const live_copy *c) {
    live_copy now = live_state(g);
    int same = now.n == c->n && memcmp(now.p, c->p, c->n) == 0;
    free(now.p);
    return same;
}

static unsigned char *slurp(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    unsigned char *p;
    long len;
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    len = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    p = (unsigned char *)malloc((size_t)len + 1);
    *n = fread(p, 1, (size_t)len, fp);
    fclose(fp);
    return p;
}

/* Restoring `sd` must fail with one of the verification errors, name `what`, load nothing. */
static void expect_refused(rig *g, const char *sd, const char *what, const char *why) {
    live_copy before = live_state(g);
    dtr_result r = dtr_ckpt_restore(g->ck, sd, NULL);
    CHECK_MSG(r == DTR_CORRUPT_FILE || r == DTR_IO_ERROR, "%s: restore gave %s", why, dtr_result_string(r));
    CHECK_MSG(strstr(dtr_ckpt_last_error(g->ck), what) != NULL, "%s: message '%s' does not name %s", why,
              dtr_ckpt_last_error(g->ck), what);
    CHECK_MSG(live_same(g, &before), "%s: the live state changed", why);
    free(before.p);
}

static void corrupt_files(rig *g, const char *sd) {
    char shard[700], man[700];
    unsigned char *orig[2];
    size_t n[2], cuts[16], hdr;
    const char *paths[2];
    unsigned seed = 99;
    int i, k, nc = 0;
    snprintf(shard, sizeof shard, "%s/rank-00000.safetensors", sd);
    snprintf(man, sizeof man, "%s/manifest.json", sd);
    paths[0] = shard, paths[1] = man;
    orig[0] = slurp(shard, &n[0]);
    orig[1] = slurp(man, &n[1]);
    CHECK(orig[0] && orig[1] && n[0] > 16);
    if (!orig[0] || !orig[1]) return;
    memcpy(&hdr, orig[0], sizeof hdr);   /* little-endian u64 header length */
    /* truncation classes: empty, inside the length field, at it, inside the header, at its
       end, inside the data, one byte short */
    cuts[nc++] = 0, cuts[nc++] = 1, cuts[nc++] = 7, cuts[nc++] = 8, cuts[nc++] = 9, cuts[nc++] = 8 + hdr / 2;
    cuts[nc++] = 8 + hdr - 1, cuts[nc++] = 8 + hdr, cuts[nc++] = 8 + hdr + 1, cuts[nc++] = (8 + hdr + n[0]) / 2;
    cuts[nc++] = n[0] - 1;
    for (k = 0; k < 2; k++)
        for (i = 0; i < nc; i++) {
            char why[128];
            size_t c = k == 0 ? cuts[i] : cuts[i] * n[1] / n[0];
            snprintf(why, sizeof why, "%s cut to %zu bytes", k ? "manifest" : "shard", c);
            CHECK(write_file(paths[k], orig[k], c));
            expect_refused(g, sd, k ? "manifest.json" : "rank-00000.safetensors", why);
            CHECK(write_file(paths[k], orig[k], n[k]));
        }
    for (i = 0; i < 100; i++) {   /* bit flips */
        char why[128];
        size_t at;
        k = (int)(rand_r(&seed) % 4 == 0);   /* a quarter in the manifest */
        at = rand_r(&seed) % n[k];
        unsigned char bit = (unsigned char)(1u << (rand_r(&seed) % 8));
        orig[k][at] ^= bit;
        snprintf(why, sizeof why, "bit flip %d at byte %zu of the %s", i, at, k ? "manifest" : "shard");
        CHECK(write_file(paths[k], orig[k], n[k]));
        expect_refused(g, sd, k ? "manifest.json" : "rank-00000.safetensors", why);
        orig[k][at] ^= bit;
        CHECK(write_file(paths[k], orig[k], n[k]));
    }
    free(orig[0]);
    free(orig[1]);
}

/* Drops tensor `name`'s record from a manifest's text (its CRC redone): what a checkpoint
   written before the entry existed lists. 1 when it was there. */
static int manifest_drop(char *text, const char *name) {
    char key[128], *at, *end, *crc;
    snprintf(key, sizeof key, ",\n      {\"name\": \"%s\"", name);
    if (!(at = strstr(text, key)) || !(end = strchr(at + 1, '}'))) return 0;
    memmove(at, end + 1, strlen(end + 1) + 1);
    if (!(crc = strstr(text, "\"manifest_crc32c\":\""))) return 0;
    snprintf(key, sizeof key, "\"manifest_crc32c\":\"%08x\"}\n", dtr_crc32c(0, text, (size_t)(crc - text)));
    memcpy(crc, key, strlen(key) + 1);
    return 1;
}

/* A checkpoint from before the optimizer's later entries ("started", "schedule2", "reports":
 * their records taken out of its manifest) restores: those keep the live optimizer's values,
 * the rest is the checkpoint's. With them, the metric reports come back as saved. */
static void test_older_checkpoint(void) {
    static const char *newer[3] = {"optimizer/started", "optimizer/schedule2", "optimizer/reports"};
    char dir[256], sd[400], man[700];
    rig g;
    rig_opts o;
    dtr_metric_stats st;
    int64_t step = -1, live_steps;
    size_t n;
    char *text;
    int i;
    make_data();
    CHECK(make_tmp_dir("dtr_ckpt_older", dir, sizeof dir));
    memset(&o, 0, sizeof o);
    o.world = 1, o.dir = dir, o.adam = 1, o.sync = 1;
    CHECK(rig_open(&g, &o));
    for (i = 0; i < 3; i++) rig_step(&g);
    CHECK_OK(g.ctx, dtr_optimizer_report_metric(g.opt, 2.0, NULL));
    CHECK_OK(g.ctx, dtr_optimizer_report_metric(g.opt, 1.0, NULL));
    CHECK_OK(g.ctx, dtr_ckpt_save(g.ck, 3, NULL));
    CHECK_OK(g.ctx, dtr_ckpt_wait(g.ck));
    for (i = 0; i < 2; i++) rig_step(&g), dtr_optimizer_report_metric(g.opt, 3.0, NULL);
    live_steps = dtr_optimizer_steps(g.opt);
    snprintf(sd, sizeof sd, "%s/step-00000003", dir);
    CHECK_OK(g.ctx, dtr_ckpt_restore(g.ck, sd, &step));   /* as saved: the reports too */
    CHECK_OK(g.ctx, dtr_optimizer_metric_stats(g.opt, &st));
    CHECK(step == 3 && dtr_optimizer_steps(g.opt) == 3 && st.reports == 2 && st.best == 1.0 && st.bad == 0);
    for (i = 0; i < 2; i++) rig_step(&g), dtr_optimizer_report_metric(g.opt, 3.0, NULL);
    snprintf(man, sizeof man, "%s/manifest.json", sd);
    text = (char *)slurp(man, &n);
    CHECK(text != NULL);
    if (!text) { rig_close(&g); return; }
    text = (char *)realloc(text, n + 1), text[n] = 0;
    for (i = 0; i < 3; i++) CHECK_MSG(manifest_drop(text, newer[i]), "%s not in the manifest", newer[i]);
    CHECK(write_file(man, text, strlen(text)));
    free(text);
    CHECK_MSG(dtr_ckpt_restore(g.ck, sd, &step) == DTR_OK, "older: %s", dtr_ckpt_last_error(g.ck));   /* the live reports stay */
    CHECK_OK(g.ctx, dtr_optimizer_metric_stats(g.opt, &st));
    CHECK(step == 3 && dtr_optimizer_steps(g.opt) == 3 && live_steps == 5 && st.reports == 4 && st.bad == 2);
    rig_close(&g);
}

static void test_corruption(void) {
    char dir[256], sd[400], path[700], latest[600];
    rig g, other;
    rig_opts o;
    int64_t step = -1;
    int started = -1, i;
    live_copy before;
    make_data();
    CHECK(make_tmp_dir("dtr_ckpt_corrupt", dir, sizeof dir));
    memset(&o, 0, sizeof o);
    o.world = 1, o.dir = dir, o.adam = 1, o.sync = 1;
    CHECK(rig_open(&g, &o));
    for (i = 0; i < 3; i++) rig_step(&g);
    CHECK_OK(g.ctx, dtr_ckpt_save(g.ck, 3, &started));
    CHECK_EQ_INT(started, 1);
    for (i = 0; i < 2; i++) rig_step(&g);
    CHECK_OK(g.ctx, dtr_ckpt_save(g.ck, 5, NULL));
    CHECK_OK(g.ctx, dtr_ckpt_latest(dir, &step, latest, sizeof latest));
    CHECK_EQ_INT(step, 5);
    snprintf(sd, sizeof sd, "%s/step-00000005", dir);
    CHECK(strcmp(latest, sd) == 0);
    rig_step(&g);                                   /* the live state moves on */
    /* the checkpoint itself is good */
    before = live_state(&g);
    CHECK_OK(g.ctx, dtr_ckpt_restore(g.ck, sd, &step));
    CHECK_EQ_INT(step, 5);
    CHECK(!live_same(&g, &before));
    free(before.p);
    rig_step(&g);
    corrupt_files(&g, sd);
    /* a missing file */
    snprintf(path, sizeof path, "%s/rank-00000.safetensors", sd);
    {
        char moved[720];
        snprintf(moved, sizeof moved, "%s.moved", path);
        CHECK(rename(path, moved) == 0);
        expect_refused(&g, sd, "rank-00000.safetensors", "missing shard");
        /* fallback: the newest is broken, restoring the latest takes step 3 when asked */
        before = live_state(&g);
        CHECK(dtr_ckpt_restore(g.ck, NULL, &step) == DTR_IO_ERROR);
        CHECK(live_same(&g, &before));
        free(before.p);
        rig_close(&g);
        o.fallback = 1;
        CHECK(rig_open(&g, &o));
        step = -1;
        CHECK_OK(g.ctx, dtr_ckpt_restore(g.ck, NULL, &step));
        CHECK_EQ_INT(step, 3);
        CHECK(rename(moved, path) == 0);
    }
    /* another model */
    o.hidden = 12;
    CHECK(rig_open(&other, &o));
    before = live_state(&other);
    CHECK_EQ_INT(dtr_ckpt_restore(other.ck, sd, NULL), DTR_INVALID_ARGUMENT);
    CHECK(strstr(dtr_ckpt_last_error(other.ck), "another model") != NULL);
    CHECK(live_same(&other, &before));
    free(before.p);
    rig_close(&other);
    /* keep the newest 3 complete ones; a second save while one is written is skipped or waits */
    for (i = 6; i <= 8; i++) CHECK_OK(g.ctx, dtr_ckpt_save(g.ck, i, NULL));
    CHECK_OK(g.ctx, dtr_ckpt_wait(g.ck));
    snprintf(path, sizeof path, "%s/step-00000005", dir);
    CHECK(access(path, F_OK) != 0);
    snprintf(path, sizeof path, "%s/step-00000006/manifest.json", dir);
    CHECK(access(path, F_OK) == 0);
    CHECK_EQ_INT(dtr_ckpt_save(g.ck, -1, NULL), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_ckpt_set_meta(g.ck, "bad\nkey", "v"), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_ckpt_add_object(g.ck, "noise", &g.noise, noise_state, NULL), DTR_INVALID_ARGUMENT);
    CHECK_EQ_INT(dtr_ckpt_restore(NULL, NULL, NULL), DTR_NULL_HANDLE);
    rig_close(&g);
    o.sync = 0, o.skip = 1, o.fallback = 0, o.hidden = 0;
    CHECK(rig_open(&g, &o));
    {
        dtr_ckpt_stats s;
        int a = 0, b = 0;
        CHECK_OK(g.ctx, dtr_ckpt_save(g.ck, 20, &a));
        CHECK_OK(g.ctx, dtr_ckpt_save(g.ck, 21, &b));   /* usually still writing 20: skipped */
        CHECK_OK(g.ctx, dtr_ckpt_wait(g.ck));
        CHECK_OK(g.ctx, dtr_ckpt_get_stats(g.ck, &s));
        CHECK(a == 1 && s.saves + s.skipped == 2 && s.saves == 1 + b && s.committed == s.saves);
    }
    rig_close(&g);
    rm_tree(dir);
    {   /* nothing there */
        char empty[512];
        CHECK(make_tmp_dir("dtr_ckpt_empty", empty, sizeof empty));
        o.dir = empty;
        CHECK(rig_open(&g, &o));
        CHECK_EQ_INT(dtr_ckpt_restore(g.ck, NULL, &step), DTR_NOT_FOUND);
        CHECK_EQ_INT(dtr_ckpt_latest(empty, &step, NULL, 0), DTR_NOT_FOUND);
        rig_close(&g);
        rm_tree(empty);
    }
}

/* ---- world-size changes ---- */

/* l1 frozen, saved on 2 ranks, restored on 1: without ZeRO the moments (l2's only, the same on
   both ranks) come back; ZeRO's shards of them (each rank's trainable floats, packed) are
   re-split: the one rank holds the two shards' moments end to end. */
static void frozen_world_change(int zero) {
    char dir[256];
    job save2, load1;
    CHECK(make_tmp_dir("dtr_ckpt_frozen", dir, sizeof dir));
    save2 = job_make(JOB_SAVE_THEN_RUN, 2, zero, 1, 4, dir);
    save2.save_at = 4, save2.freeze = 1;
    job_run(&save2);
    CHECK_MSG(save2.result[0] == DTR_OK && save2.result[1] == DTR_OK, "%s / %s", save2.msg[0], save2.msg[1]);
    load1 = job_make(JOB_RESTORE_ONLY, 1, 0, 1, 0, dir);
    load1.freeze = 1;
    job_run(&load1);
    if (zero) {
        CHECK_MSG(load1.result[0] == DTR_OK, "frozen ZeRO 2 -> 1: %s", load1.msg[0]);
        CHECK(load1.out[0].m && save2.out[0].m && save2.out[1].m && load1.out[0].nm == save2.out[0].nm + save2.out[1].nm &&
              load1.out[0].nm < load1.out[0].np / 2);
        CHECK(load1.out[0].m && save2.out[0].m && save2.out[1].m && load1.out[0].nm == save2.out[0].nm + save2.out[1].nm &&
              memcmp(load1.out[0].m, save2.out[0].m, save2.out[0].nm * 4) == 0 &&
              memcmp(load1.out[0].m + save2.out[0].nm, save2.out[1].m, save2.out[1].nm * 4) == 0);
    } else {
        CHECK_MSG(load1.result[0] == DTR_OK, "frozen 2 -> 1: %s", load1.msg[0]);
        CHECK(load1.out[0].m && save2.out[0].m && load1.out[0].nm == save2.out[0].nm && load1.out[0].nm < load1.out[0].np / 2);
        CHECK(load1.out[0].m && save2.out[0].m && memcmp(load1.out[0].m, save2.out[0].m, load1.out[0].nm * 4) == 0);
    }
    job_free(&save2); job_free(&load1);
    rm_tree(dir);
}

/* l1's bias frozen (between trainable l1.weight and l2), saved on 1 rank, restored on 2 with
   ZeRO: each rank's shard of the packed moments (both hold some: the shards meet inside
   l1.weight), end to end the saved ones; the two ranks then train on alike */
static void frozen_split(void) {
    char dir[256];
    job save1, load2;
    CHECK(make_tmp_dir("dtr_ckpt_frozen", dir, sizeof dir));
    save1 = job_make(JOB_SAVE_THEN_RUN, 1, 0, 1, 4, dir);
    save1.save_at = 4, save1.freeze = 2;
    job_run(&save1);
    load2 = job_make(JOB_RESTORE_ONLY, 2, 1, 1, 0, dir);
    load2.freeze = 2;
    job_run(&load2);
    CHECK_MSG(load2.result[0] == DTR_OK && load2.result[1] == DTR_OK, "frozen 1 -> ZeRO 2: %s / %s", load2.msg[0], load2.msg[1]);
    CHECK(load2.out[0].nm > 0 && load2.out[1].nm > 0 && save1.out[0].nm < save1.out[0].np);
    CHECK(save1.out[0].m && load2.out[0].m && load2.out[1].m && load2.out[0].nm + load2.out[1].nm == save1.out[0].nm &&
          memcmp(load2.out[0].m, save1.out[0].m, load2.out[0].nm * 4) == 0 &&
          memcmp(load2.out[1].m, save1.out[0].m + load2.out[0].nm, load2.out[1].nm * 4) == 0);
    job_free(&load2);
    load2 = job_make(JOB_RESTORE_TRAIN, 2, 1, 1, 3, dir);
    load2.freeze = 2;
    job_run(&load2);
    CHECK_MSG(load2.result[0] == DTR_OK && load2.result[1] == DTR_OK && isfinite(load2.loss[0]), "%s", load2.msg[0]);
    CHECK(load2.out[0].params && load2.out[1].params &&
          memcmp(load2.out[0].params, load2.out[1].params, load2.out[0].np * 4) == 0);
    job_free(&save1); job_free(&load2);
    rm_tree(dir);
}

static void test_world_change(void) {
    char dir[256], path[700], moved[720];
    job save2, load1, save1, load2, miss;
    size_t half;
    make_data();
    /* 2 -> 1 */
    CHECK(make_tmp_dir("dtr_ckpt_world", dir, sizeof dir));
    save2 = job_make(JOB_SAVE_THEN_RUN, 2, 1, 1, 4, dir);
    save2.save_at = 4;
    job_run(&save2);
    CHECK_MSG(save2.result[0] == DTR_OK && save2.result[1] == DTR_OK, "%s / %s", save2.msg[0], save2.msg[1]);
    load1 = job_make(JOB_RESTORE_ONLY, 1, 0, 1, 0, dir);
    job_run(&load1);
    CHECK_MSG(load1.result[0] == DTR_OK, "2 -> 1: %s", load1.msg[0]);
    half = save2.out[0].nm;
    CHECK(load1.out[0].nm == half + save2.out[1].nm && load1.out[0].nm == load1.out[0].np);
    CHECK(load1.out[0].m && memcmp(load1.out[0].m, save2.out[0].m, half * 4) == 0 &&
          memcmp(load1.out[0].m + half, save2.out[1].m, save2.out[1].nm * 4) == 0);
    CHECK(memcmp(load1.out[0].params, save2.out[0].params, load1.out[0].np * 4) == 0);
    job_free(&load1);
    load1 = job_make(JOB_RESTORE_TRAIN, 1, 0, 1, 3, dir);   /* and it trains on */
    job_run(&load1);
    CHECK_MSG(load1.result[0] == DTR_OK && isfinite(load1.loss[0]) && load1.out[0].steps == 4 + 3, "%s", load1.msg[0]);
    /* a missing shard fails both ranks */
    snprintf(path, sizeof path, "%s/step-00000004/rank-00001.safetensors", dir);
    snprintf(moved, sizeof moved, "%s.moved", path);
    CHECK(rename(path, moved) == 0);
    miss = job_make(JOB_RESTORE_ONLY, 2, 1, 1, 0, dir);
    job_run(&miss);
    CHECK(miss.result[0] == DTR_IO_ERROR && miss.result[1] == DTR_IO_ERROR);
    CHECK_MSG(strstr(miss.msg[1], "rank-00001.safetensors") != NULL, "%s", miss.msg[1]);
    job_free(&save2); job_free(&load1); job_free(&miss);
    rm_tree(dir);
    /* 1 -> 2 with ZeRO */
    CHECK(make_tmp_dir("dtr_ckpt_world", dir, sizeof dir));
    save1 = job_make(JOB_SAVE_THEN_RUN, 1, 0, 1, 4, dir);
    save1.save_at = 4;
    job_run(&save1);
    load2 = job_make(JOB_RESTORE_ONLY, 2, 1, 1, 0, dir);
    job_run(&load2);
    CHECK_MSG(load2.result[0] == DTR_OK && load2.result[1] == DTR_OK, "1 -> 2: %s / %s", load2.msg[0], load2.msg[1]);
    CHECK(save1.out[0].m && load2.out[0].m && load2.out[1].m && load2.out[0].nm + load2.out[1].nm == save1.out[0].nm);
    CHECK(memcmp(load2.out[0].m, save1.out[0].m, load2.out[0].nm * 4) == 0 &&
          memcmp(load2.out[1].m, save1.out[0].m + load2.out[0].nm, load2.out[1].nm * 4) == 0);
    job_free(&load2);
    load2 = job_make(JOB_RESTORE_TRAIN, 2, 1, 1, 3, dir);
    job_run(&load2);
    CHECK_MSG(load2.result[0] == DTR_OK && load2.result[1] == DTR_OK && isfinite(load2.loss[0]), "%s", load2.msg[0]);
    CHECK(memcmp(load2.out[0].params, load2.out[1].params, load2.out[0].np * 4) == 0);
    job_free(&save1); job_free(&load2);
    rm_tree(dir);
    /* 2 -> 1 with ZeRO-3: the save gathered the parameters, so rank 0's file holds them all */
    CHECK(make_tmp_dir("dtr_ckpt_world", dir, sizeof dir));
    save2 = job_make(JOB_SAVE_THEN_RUN, 2, 3, 1, 4, dir);
    save2.save_at = 4;
    job_run(&save2);
    load1 = job_make(JOB_RESTORE_ONLY, 1, 0, 1, 0, dir);
    job_run(&load1);
    CHECK_MSG(save2.result[0] == DTR_OK && load1.result[0] == DTR_OK, "ZeRO-3 2 -> 1: %s / %s", save2.msg[0], load1.msg[0]);
    CHECK(load1.out[0].params && save2.out[0].params &&
          memcmp(load1.out[0].params, save2.out[0].params, load1.out[0].np * 4) == 0);
    job_free(&save2); job_free(&load1);
    rm_tree(dir);
    frozen_world_change(0);
    frozen_world_change(1);
    frozen_split();
}

int main(void) {
    const char *q = getenv("DTR_TEST_QUICK");
    g_quick = q && *q && strcmp(q, "0") != 0;
    alarm(300);
    (void)test_ctx;
    RUN(test_corruption);
    RUN(test_older_checkpoint);
    RUN(test_world_change);
    RUN(test_resume_killed);
    RUN(test_crash_while_saving);
    RUN(test_resume_fabric);
    return test_summary();
}
