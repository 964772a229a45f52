/* examples/fmnist_ps.c: the Fashion-MNIST MLP trained with parameter servers (dtr_ps).
 *
 * What it shows: the world splits into servers (ranks 0..S-1) and workers; every rank builds
 * the same model; dtr_ps_create gives each server its range of the parameter buffer and its
 * optimizer; servers call dtr_ps_serve; each worker pulls the parameters, then for each of
 * its batches runs forward and backward and dtr_ps_step (push the gradient, pull the new
 * parameters), and says dtr_ps_finish at the end. --mode picks the consistency: sync (the
 * average of every worker's step, as all-reduce data parallelism), async (each push applied
 * on arrival) or ssp (bounded staleness). --straggler-ms slows worker 0 by that many
 * milliseconds per step, to see what each mode does with a slow machine (--straggler rotate:
 * worker i is slowed on its steps k with k mod W = i instead, so that about one worker is slow
 * at any moment but which one moves). --aggregate K (async, ssp): each server averages K pushes
 * into one update (K = workers: sync's update count and batch, without its wait). --backup-workers B (sync): a round goes once all workers but B pushed
 * (a late push is dropped). --seed K picks another initialisation and shuffle (accuracy varies
 * with them: compare modes over a few seeds). --replicas 1 gives each server a backup (ranks S..2S-1, the
 * workers after them; the group isolates peer failures). --checkpoint DIR: the servers checkpoint
 * their ranges there every 100 updates and at the end, and a later run with the same DIR
 * resumes from them (the workers skip the batches the servers' update count covers: sync).
 * With the local transport the ranks are threads of this process; under the launcher each
 * process is one rank: `dtrun -n 6 --servers 2 build/examples/fmnist_ps --transport libfabric`.
 * --gpu (built by make examples-gpu): the workers train on the GPU, the servers stay on the
 * CPU (the classic layout).
 *
 * Usage: fmnist_ps [DATA_DIR] [--world N] [--servers S] [--mode sync|async|ssp] [--staleness s]
 *                  [--epochs E] [--batch B] [--lr LR] [--straggler-ms X] [--bf16|--int8] [--transport NAME]
 *                  [--provider P] [--max-steps K] [--workers W] [--replicas 0|1] [--straggler worker0|rotate]
 *                  [--aggregate K] [--seed K] [--backup-workers B] [--gpu] [--checkpoint DIR]
 *   --world 6 --servers 2 (defaults): 2 servers and 4 workers; --batch is per worker (64);
 *   --lr: the servers' Adam learning rate (1e-3). Expect about 86% after 2 epochs in every
 *   mode. */
#include "common.h"
#include "ranks.h"

typedef struct ps_opts {
    const char *dir, *transport, *provider;
    const char *ckpt;      /* dtr_ps_config.checkpoint_dir */
    int world, servers, epochs, batch, staleness, straggler_ms, bf16, quiet;
    int int8;              /* push_compress INT8 (error feedback on the workers) */
    int workers;           /* > 0: the world is the server ranks and these */
    int replicas;          /* dtr_ps_config.replicas */
    int aggregate;         /* dtr_ps_config.aggregate */
    int backup;            /* dtr_ps_config.backup_workers (sync) */
    int seed;              /* > 0: another initialisation and shuffle than the default ones (0) */
    int straggler_rotate;  /* the straggler delay hits worker i's steps k = i mod W, not worker 0's */
    int gpu;               /* the workers' contexts on the GPU (make examples-gpu) */
    int64_t max_steps;     /* > 0: steps per epoch per worker at most */
    int64_t *claim;        /* threads only: a counter the workers take batches from (NULL: fixed shards) */
    dtr_ps_mode mode;
    float lr;
} ps_opts;

typedef struct ps_result {
    int ok;
    double train_s, test_acc;
    int64_t samples, steps;
    dtr_ps_stats server, worker;   /* server 0's and worker 0's counters */
} ps_result;

static ps_opts ps_opts_default(void) {
    ps_opts o;
    memset(&o, 0, sizeof o);
    o.transport = "local";
    o.world = 6, o.servers = 2, o.epochs = 2, o.batch = 64, o.staleness = 2;
    o.mode = DTR_PS_SYNC;
    o.lr = 1e-3f;
    return o;
}

static int ps_err(dtr_comm *c, const char *what, dtr_result r, const char *msg) {
    fprintf(stderr, "rank %d: error: %s: %s (%s)\n", dtr_comm_rank(c), what, dtr_result_string(r), msg);
    return 0;
}

/* step k of this worker, on the batch at order[start..start + batch) */
static dtr_result ps_batch(const ps_opts *o, const dtr_mnist *d, fm_net *net, dtr_ps *ps, const int32_t *order,
                           int64_t start, int64_t k, fm_batch *b) {
    dtr_context *ctx = dtr_model_context(net->model);
    int64_t xs[2] = {o->batch, FM_PIXELS}, ys[1] = {o->batch}, i;
    dtr_tensor *loss;
    dtr_result r;
    int slowed = o->straggler_rotate ? k % dtr_ps_workers(ps) == dtr_ps_index(ps) : dtr_ps_index(ps) == 0;
    if (slowed && o->straggler_ms > 0) {
        struct timespec ts = {o->straggler_ms / 1000, (long)(o->straggler_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    for (i = 0; i < o->batch; i++) {
        memcpy(b->x + i * FM_PIXELS, d->train_x + (int64_t)order[start + i] * FM_PIXELS, FM_PIXELS * sizeof(float));
        b->y[i] = d->train_y[order[start + i]];
    }
    loss = dtr_cross_entropy(ctx, fm_net_forward(ctx, net, dtr_tensor_from(ctx, DTR_F32, 2, xs, b->x)),
                             dtr_tensor_from(ctx, DTR_I32, 1, ys, b->y));
    r = loss ? dtr_backward(ctx, loss) : dtr_context_status(ctx);
    if (r == DTR_OK) r = dtr_ps_step(ps);
    dtr_context_reset(ctx);
    return r;
}

/* one epoch of worker wi of W: its slice of the epoch's shuffle (the same on every worker) */
static dtr_result ps_epoch(const ps_opts *o, const dtr_mnist *d, fm_net *net, dtr_ps *ps, const int32_t *order,
                           fm_batch *b, int64_t *samples, int64_t *skip) {
    int W = dtr_ps_workers(ps), wi = dtr_ps_index(ps);
    int64_t per = d->train_n / W, start, steps = 0;
    dtr_result r = DTR_OK;
    for (start = wi * per; start + o->batch <= (wi + 1) * per && r == DTR_OK; start += o->batch) {
        if (o->max_steps > 0 && steps++ >= o->max_steps) break;
        if (*skip > 0 && (*skip)-- > 0) continue;   /* done before the servers' checkpoint */
        r = ps_batch(o, d, net, ps, order, start, *samples / o->batch, b);
        *samples += o->batch;
    }
    return r;
}

/* ranks as threads with o->claim: the workers take the batches of every epoch from one
   counter, so a fast worker trains more batches than a slow one (what an asynchronous
   server lets it do); epoch e's order is the shuffle of seed 42, stream 1 + e */
static dtr_result ps_claimed(const ps_opts *o, const dtr_mnist *d, fm_net *net, dtr_ps *ps, int32_t *order,
                             fm_batch *b, int64_t *samples) {
    int64_t nb = d->train_n / o->batch, per_epoch = nb, g, epoch = -1;
    dtr_result r = DTR_OK;
    dtr_rng rng;
    if (o->max_steps > 0 && per_epoch > o->max_steps * dtr_ps_workers(ps)) per_epoch = o->max_steps * dtr_ps_workers(ps);
    while (r == DTR_OK && (g = __atomic_fetch_add(o->claim, 1, __ATOMIC_RELAXED)) < o->epochs * per_epoch) {
        if (g / per_epoch != epoch) {
            epoch = g / per_epoch;
            dtr_rng_seed(&rng, 42 + (uint64_t)o->seed, 1 + (uint64_t)epoch);
            fm_shuffle(&rng, order, d->train_n);
        }
        r = ps_batch(o, d, net, ps, order, (g % per_epoch) * o->batch, *samples / o->batch, b);
        *samples += o->batch;
    }
    return r;
}

static int ps_worker(const ps_opts *o, const dtr_mnist *d, fm_net *net, dtr_ps *ps, ps_result *res) {
    int32_t *order = (int32_t *)malloc((size_t)d->train_n * sizeof(int32_t));
    dtr_context *ctx = dtr_model_context(net->model);
    fm_batch b;
    dtr_rng rng;
    dtr_result r = order ? fm_batch_alloc(&b, o->batch > 500 ? o->batch : 500) : DTR_OUT_OF_MEMORY;
    double t0 = fm_now();
    int64_t samples = 0, skip;
    dtr_ps_stats st;
    int e;
    dtr_rng_seed(&rng, 42 + (uint64_t)o->seed, 1);
    dtr_ps_get_stats(ps, &st);
    skip = o->mode == DTR_PS_SYNC ? st.resumed_updates : 0;   /* a resumed job: a sync step is an update */
    if (r == DTR_OK) r = dtr_ps_pull(ps);
    if (o->claim && r == DTR_OK) r = ps_claimed(o, d, net, ps, order, &b, &samples);
    for (e = 0; e < o->epochs && r == DTR_OK && !o->claim; e++) {
        fm_shuffle(&rng, order, d->train_n);
        r = ps_epoch(o, d, net, ps, order, &b, &samples, &skip);
    }
    if (r == DTR_OK) r = dtr_ps_pull(ps);   /* the latest parameters, to evaluate */
    if (r == DTR_OK) r = dtr_ps_finish(ps);
    res->train_s = fm_now() - t0;
    res->samples = samples;
    if (r == DTR_OK && dtr_ps_index(ps) == 0) r = fm_evaluate(ctx, net, d->test_x, d->test_y, d->test_n, &b, &res->test_acc);
    if (r == DTR_OK && dtr_ps_index(ps) == 0) dtr_ps_get_stats(ps, &res->worker);
    fm_batch_free(&b);
    free(order);
    return r == DTR_OK ? 1 : ps_err(NULL, "worker", r, dtr_context_last_error(ctx));
}

typedef struct ps_job { const ps_opts *o; const dtr_mnist *data; ps_result *res; } ps_job;

static pthread_mutex_t ps_mu = PTHREAD_MUTEX_INITIALIZER;   /* rank threads add to one result */

static int ps_rank(dtr_comm *c, void *user) {
    ps_job *j = (ps_job *)user;
    const ps_opts *o = j->o;
    dtr_context_config cc = dtr_context_config_init();
    dtr_context *ctx = NULL;
    dtr_ps_config pc = dtr_ps_config_init();
    dtr_ps *ps = NULL;
    ps_result mine;
    fm_net net;
    dtr_result r;
    int ok = 0;
    memset(&mine, 0, sizeof mine);
    cc.threads = 1;
    if (o->gpu && dtr_comm_rank(c) >= o->servers * (1 + o->replicas) && !fm_backend(1, &cc))   /* a worker */
        return ps_err(c, "--gpu", DTR_UNSUPPORTED, "no CUDA backend in this build");
    if ((r = dtr_context_create(&cc, &ctx)) != DTR_OK) return ps_err(c, "dtr_context_create", r, dtr_context_create_error());
    pc.servers = o->servers, pc.mode = o->mode, pc.staleness = o->staleness, pc.replicas = o->replicas;
    pc.aggregate = o->mode == DTR_PS_SYNC ? 0 : o->aggregate;   /* a sync round averages every worker already */
    pc.backup_workers = o->mode == DTR_PS_SYNC ? o->backup : 0;
    pc.opt = dtr_optimizer_config_init(DTR_OPT_ADAM, o->lr);
    pc.push_dtype = o->bf16 ? DTR_BF16 : DTR_F32;
    pc.push_compress = o->int8 ? DTR_COMPRESS_INT8 : DTR_COMPRESS_NONE;
    pc.checkpoint_dir = o->ckpt;
    pc.checkpoint_every = 100;
    r = fm_net_init(&net, ctx, FM_MLP, DTR_INIT_KAIMING_UNIFORM, 1 + (uint64_t)o->seed);
    if (r == DTR_OK) r = dtr_ps_create(net.model, c, &pc, &ps);
    if (r != DTR_OK) ps_err(c, "dtr_ps_create", r, dtr_context_last_error(ctx));
    else if (dtr_ps_is_server(ps)) {
        r = dtr_ps_serve(ps);
        ok = r == DTR_OK || ps_err(c, "dtr_ps_serve", r, dtr_context_last_error(ctx));
        if (ok && dtr_ps_index(ps) == 0) dtr_ps_get_stats(ps, &j->res->server);
    } else {
        ok = ps_worker(o, j->data, &net, ps, &mine);
        pthread_mutex_lock(&ps_mu);
        if (ok && dtr_ps_index(ps) == 0) j->res->test_acc = mine.test_acc, j->res->worker = mine.worker;
        if (ok && mine.train_s > j->res->train_s) j->res->train_s = mine.train_s;   /* the slowest worker */
        if (ok) j->res->samples += mine.samples;   /* threads: the job's; processes: this rank's */
        pthread_mutex_unlock(&ps_mu);
    }
    dtr_ps_destroy(ps);
    fm_net_free(&net);
    dtr_context_destroy(ctx);
    return ok;
}

/* trains with o; res gets the figures (threads: of the whole job; processes: this rank's) */
static int ps_train(const ps_opts *o, const dtr_mnist *data, ps_result *res) {
    ps_job j;
    int ok;
    memset(res, 0, sizeof *res);
    j.o = o, j.data = data, j.res = res;
    ex_isolate_peer_failures = o->replicas > 0;
    ok = ex_run_ranks("fmnist_ps", o->transport, o->provider, o->world, !o->quiet, ps_rank, &j);
    res->ok = ok;
    return ok;
}

static const char *const ps_mode_names[] = {"sync", "async", "ssp"};

static int ps_parse(ps_opts *o, int argc, char **argv) {
    int i;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--bf16")) { o->bf16 = 1; continue; }
        if (!strcmp(a, "--int8")) { o->int8 = 1; continue; }
        if (!strcmp(a, "--gpu")) { o->gpu = 1; continue; }
        if (a[0] != '-') { o->dir = a; continue; }
        if (!v) { fprintf(stderr, "%s needs a value\n", a); return 0; }
        i++;
        if (!strcmp(a, "--world")) o->world = atoi(v);
        else if (!strcmp(a, "--servers")) o->servers = atoi(v);
        else if (!strcmp(a, "--workers")) o->workers = atoi(v);
        else if (!strcmp(a, "--replicas")) o->replicas = atoi(v);
        else if (!strcmp(a, "--aggregate")) o->aggregate = atoi(v);
        else if (!strcmp(a, "--backup-workers")) o->backup = atoi(v);
        else if (!strcmp(a, "--straggler")) o->straggler_rotate = !strcmp(v, "rotate");
        else if (!strcmp(a, "--mode")) o->mode = !strcmp(v, "async") ? DTR_PS_ASYNC : !strcmp(v, "ssp") ? DTR_PS_SSP : DTR_PS_SYNC;
        else if (!strcmp(a, "--staleness")) o->staleness = atoi(v);
        else if (!strcmp(a, "--epochs")) o->epochs = atoi(v);
        else if (!strcmp(a, "--batch")) o->batch = atoi(v);
        else if (!strcmp(a, "--lr")) o->lr = (float)atof(v);
        else if (!strcmp(a, "--straggler-ms")) o->straggler_ms = atoi(v);
        else if (!strcmp(a, "--max-steps")) o->max_steps = atol(v);
        else if (!strcmp(a, "--transport")) o->transport = v;
        else if (!strcmp(a, "--provider")) o->provider = v;
        else if (!strcmp(a, "--data")) o->dir = v;
        else if (!strcmp(a, "--seed")) o->seed = atoi(v);
        else if (!strcmp(a, "--checkpoint")) o->ckpt = v;
        else { fprintf(stderr, "unknown option %s\n", a); return 0; }
    }
    if (o->workers > 0) o->world = o->servers * (1 + o->replicas) + o->workers;
    if (o->epochs < 1 || o->batch < 1 || o->world < 2 || o->servers < 1 || o->servers * (1 + o->replicas) >= o->world ||
        o->replicas < 0 || o->replicas > 1) {
        fprintf(stderr, "need --epochs >= 1, --batch >= 1, 1 <= --servers, --replicas 0 or 1, and a worker after the "
                "server ranks (--world or --workers)\n");
        return 0;
    }
    return 1;
}

#ifndef FMNIST_PS_NO_MAIN
int main(int argc, char **argv) {
    ps_opts o = ps_opts_default();
    ps_result res;
    dtr_mnist data;
    o.servers = dtr_ps_servers_from_env(2);   /* dtrun --servers S */
    if (!ps_parse(&o, argc, argv)) return 2;
    if (fm_data_load(fm_data_dir(o.dir), &data) != DTR_OK) return 1;
    if (!ps_train(&o, &data, &res)) { dtr_mnist_destroy(&data); return 1; }
    if (res.test_acc > 0)
        printf("%s, %d servers, %d workers: test accuracy %.2f%%, %.0f samples/s, staleness max %lld, "
               "%lld refused messages\n", ps_mode_names[o.mode], o.servers, o.world - o.servers, 100 * res.test_acc,
               (double)res.samples / res.train_s, (long long)res.server.max_staleness, (long long)res.server.refused);
    dtr_mnist_destroy(&data);
    return 0;
}
#endif
